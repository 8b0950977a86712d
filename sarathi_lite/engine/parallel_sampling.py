"""Several completions of one prompt (``SamplingParams.n`` and ``best_of``) as one-completion requests, for the
Python API and the server alike.

The first completion of a prompt runs alone until its prompt is prefilled; the others are added then, so they
take the prompt's KV blocks from the prefix cache instead of computing them again (``child_ids``,
``child_params``). At the end ``pick`` keeps the ``n`` with the highest cumulative log-probability of the
``best_of`` generated, in that order (all of them, in order, when ``best_of`` is ``n``)."""

from __future__ import annotations

import dataclasses

from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.sampling_params import MAX_SEED, SamplingParams


def child_ids(request_id: str, params: SamplingParams) -> list[str]:
    """The request ids of ``params.num_completions`` completions: ``request_id`` itself for the first, then
    ``request_id.1``, ``request_id.2``, ..."""
    return [request_id] + [f"{request_id}.{k}" for k in range(1, params.num_completions)]


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """One ``SamplingParams`` per completion (``n=1``, no ``best_of``). A seed becomes ``seed + k`` for the
    k-th (wrapping inside the seed range), so seeded completions differ yet repeat. With ``best_of > n`` each
    also asks for the sampled tokens' logprobs (``logprobs=0`` unless more were asked), to rank them."""
    if params.num_completions == 1:
        return [params]
    ranked = params.num_completions > params.n
    logprobs = 0 if ranked and params.logprobs is None else params.logprobs
    out = []
    for k in range(params.num_completions):
        seed = params.seed
        if seed is not None:
            seed += k
            if seed > MAX_SEED:
                seed -= 2**64
        out.append(dataclasses.replace(params, n=1, best_of=None, seed=seed, logprobs=logprobs))
    return out


def cumulative_logprob(output: RequestOutput) -> float:
    """The sum of the sampled tokens' log-probabilities (``-inf`` without logprobs)."""
    if output.logprobs is None:
        return float("-inf")
    return sum(lp for lp, _ in output.logprobs if lp is not None)


def pick(outputs: list[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    """The ``params.n`` outputs to return of the ``num_completions`` finished ``outputs`` (in ``child_ids``
    order), each with its ``index`` (0 .. n-1); logprobs the caller did not ask for are dropped."""
    if params.num_completions > params.n:
        outputs = sorted(outputs, key=cumulative_logprob, reverse=True)[:params.n]
        if params.logprobs is None:
            for out in outputs:
                out.logprobs = None
    for index, out in enumerate(outputs):
        out.index = index
    return outputs
