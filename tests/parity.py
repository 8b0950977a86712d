"""Checking our greedy outputs against Hugging Face transformers on the same weights."""

from __future__ import annotations

import random

import torch

from sarathi_lite import LLMEngine, SamplingParams

# Float32 rounding differs between our fused/paged kernels and HF's; a greedy argmax may only flip where the
# top two logits are closer than this (a true near-tie). Measured differences are ~1e-6.
NEAR_TIE = 1e-4
# Our log-probability of every sampled token vs HF's teacher-forced log-softmax.
LOGPROB_ATOL = 1e-4


def workload(seed: int, n: int = 14, max_prompt: int = 300, max_output: int = 20, vocab: int = 320
             ) -> list[tuple[list[int], int]]:
    """``n`` (prompt, max_tokens) pairs, prompt lengths spanning 1 .. max_prompt (both ends included)."""
    rng = random.Random(seed)
    lengths = [1, max_prompt, 2] + [rng.randint(1, max_prompt) for _ in range(n - 3)]
    return [([rng.randrange(3, vocab) for _ in range(length)], rng.randint(1, max_output)) for length in lengths]


def run_staggered(engine: LLMEngine, work: list[tuple[list[int], int]], waves: int = 3) -> dict[str, tuple]:
    """Add the requests in ``waves``, stepping the engine between waves, and run all to completion.
    Returns ``{request_id: (prompt, token_ids, logprobs)}``."""
    results: dict[str, tuple] = {}
    per_wave = -(-len(work) // waves)
    for w in range(waves):
        for i in range(w * per_wave, min(len(work), (w + 1) * per_wave)):
            prompt, n = work[i]
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                               logprobs=0))
        for _ in range(3 if w < waves - 1 else 0):
            _collect(engine.step(), results)
    while engine.has_unfinished_requests():
        _collect(engine.step(), results)
    return results


def _collect(outputs, results) -> None:
    for o in outputs:
        if o.finished:
            results[o.request_id] = (o.prompt_token_ids, o.token_ids, [lp for lp, _ in o.logprobs])


def assert_matches_hf(ref, prompt: list[int], tokens: list[int], logprobs: list[float], max_tokens: int) -> str:
    """Our greedy tokens equal HF ``generate``'s, or first differ at a true near-tie; and every step's
    log-probability matches HF's teacher-forced one. Returns "exact" or "near-tie"."""
    assert len(tokens) == max_tokens
    hf_logits = ref.logits(prompt + tokens[:-1])[len(prompt) - 1:]
    hf_logprobs = torch.log_softmax(hf_logits, dim=-1)
    for j, tok in enumerate(tokens):
        gap = float(hf_logits[j].max() - hf_logits[j, tok])
        assert gap <= NEAR_TIE, (f"step {j}: our token {tok} is {gap:.2e} below HF's argmax "
                                 f"{int(hf_logits[j].argmax())} (prompt length {len(prompt)})")
        diff = abs(logprobs[j] - float(hf_logprobs[j, tok]))
        assert diff <= LOGPROB_ATOL, f"step {j}: logprob {logprobs[j]:.6f} vs HF {float(hf_logprobs[j, tok]):.6f}"
    expected = ref.generate(prompt, max_tokens)
    if tokens == expected:
        return "exact"
    j = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
    gap = abs(float(hf_logits[j, tokens[j]] - hf_logits[j, expected[j]]))
    assert gap <= NEAR_TIE, f"first divergence from HF generate at step {j} is not a near-tie (gap {gap:.2e})"
    return "near-tie"
