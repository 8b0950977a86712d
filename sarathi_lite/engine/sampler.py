"""Turns the logits of the rows that sample into next tokens, per request's ``SamplingParams``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.kernels import apply_logit_bias, apply_penalties, sample

MIN_TOP_P = float(torch.finfo(torch.float32).tiny)
"""The smallest ``top_p`` the sampling kernels get (float32's smallest normal number, about 1.2e-38): any
``top_p`` at or below it keeps only the most likely token."""

History = tuple[Sequence[int], Sequence[int]]
"""A request's ``(prompt token ids, output token ids so far)``: what its penalties look at."""


@dataclass(slots=True)
class _Seen:
    """The tokens a penalized request has seen, kept by the sampler from its first sampled row on: the prompt's
    distinct ids (on the device, made once) and every output token, including those sampled by batches whose
    results the scheduler has not taken yet (async scheduling)."""

    prompt: torch.Tensor
    outputs: list[int] = field(default_factory=list)


class Sampler:
    """Samples one token per row; keeps each seeded request's generator across steps (and preemptions), so its
    draws do not depend on what it is batched with, and each penalized request's token history."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}
        self._seen: dict[str, _Seen] = {}

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams],
                 banned: Mapping[str, Sequence[int]] | None = None,
                 history: Mapping[str, History] | None = None) -> tuple[list[int], list[Any] | None]:
        """logits: [B, vocab] float32. banned: per request id, token ids its row must not sample (their
        logits become -inf). history: per request id whose params set a penalty, its ``(prompt ids, output
        ids)``; read on the request's first sampled row only (the sampler keeps its own record after that).
        Returns the B token ids, and per row ``(logprob, {id: logprob})`` or ``None`` (the list itself is
        ``None`` when no row asked for logprobs). Values past the vocabulary (a banned id, a ``top_k`` or
        ``logprobs`` above it, a ``logit_bias`` key) are clipped to it or dropped, never an error:
        ``LLMEngine.add_request`` rejects what it can, and what it cannot check must not fail the whole
        batch. Logits are processed in place: bans, ``logit_bias``, penalties (see ``SamplingParams``)."""
        vocab = logits.shape[-1]
        if banned:
            for i, rid in enumerate(request_ids):
                ids = [t for t in banned.get(rid, ()) if 0 <= t < vocab]
                if ids:
                    logits[i, ids] = float("-inf")
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:
            self._bias(logits, [(i, params[i].logit_bias) for i in biased])
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if penalized:
            self._penalize(logits, penalized, request_ids, params, history or {})
        if all(p.temperature == 0 for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            dev = logits.device
            temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
            # a top_p below float32's smallest normal number (validation takes any top_p > 0) would round to 0
            # or a denormal: raised to it, the smallest top_p keeps exactly the most likely token
            top_p = torch.tensor([max(p.top_p, MIN_TOP_P) for p in params], dtype=torch.float32, device=dev)
            top_k = torch.tensor([min(p.top_k, vocab) for p in params], dtype=torch.int64, device=dev)
            generators = [self._generator(rid, p) for rid, p in zip(request_ids, params)]
            tokens = sample(logits, temperature, top_p, top_k, generators)
        token_list = tokens.tolist()
        for i in penalized:
            self._seen[request_ids[i]].outputs.append(token_list[i])
        if all(p.logprobs is None for p in params):
            return token_list, None
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        rows: list[Any] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                rows.append(None)
                continue
            top = {}
            if p.logprobs:
                values, ids = logprobs[i].topk(min(p.logprobs, vocab))
                top = dict(zip(ids.tolist(), values.tolist()))
            rows.append((float(logprobs[i, token_list[i]]), top))
        return token_list, rows

    def _bias(self, logits: torch.Tensor, rows: list[tuple[int, dict[int, float]]]) -> None:
        vocab = logits.shape[-1]
        entries = [(i, t, b) for i, bias in rows for t, b in bias.items() if t < vocab]
        if not entries:
            return
        dev = logits.device
        row, tok, val = zip(*entries)
        apply_logit_bias(logits, torch.tensor(row, dtype=torch.int64, device=dev),
                         torch.tensor(tok, dtype=torch.int64, device=dev),
                         torch.tensor(val, dtype=torch.float32, device=dev))

    def _penalize(self, logits: torch.Tensor, rows: list[int], request_ids: Sequence[str],
                  params: Sequence[SamplingParams], history: Mapping[str, History]) -> None:
        """Penalties on ``rows`` of ``logits``, one tensor pass over all of them (the history goes flat)."""
        dev, vocab = logits.device, logits.shape[-1]
        seen = [self._seen_of(request_ids[i], history, vocab) for i in rows]
        out_lens = torch.tensor([len(s.outputs) for s in seen], dtype=torch.int64, device=dev)
        prompt_lens = torch.tensor([len(s.prompt) for s in seen], dtype=torch.int64, device=dev)
        order = torch.arange(len(rows), device=dev)
        out_ids = torch.tensor(list(chain.from_iterable(s.outputs for s in seen)), dtype=torch.int64, device=dev)
        index = torch.tensor(rows, dtype=torch.int64, device=dev)
        sub = logits.index_select(0, index)
        apply_penalties(sub, order.repeat_interleave(out_lens), out_ids, order.repeat_interleave(prompt_lens),
                        torch.cat([s.prompt for s in seen]),
                        torch.tensor([params[i].repetition_penalty for i in rows], dtype=torch.float32, device=dev),
                        torch.tensor([params[i].frequency_penalty for i in rows], dtype=torch.float32, device=dev),
                        torch.tensor([params[i].presence_penalty for i in rows], dtype=torch.float32, device=dev))
        logits.index_copy_(0, index, sub)

    def _seen_of(self, request_id: str, history: Mapping[str, History], vocab: int) -> _Seen:
        seen = self._seen.get(request_id)
        if seen is None:
            prompt, outputs = history.get(request_id, ((), ()))
            ids = torch.tensor(list(prompt), dtype=torch.int64, device=self.device)
            seen = _Seen(ids[(ids >= 0) & (ids < vocab)].unique(), list(outputs))  # outputs: sampled, in range
            self._seen[request_id] = seen
        return seen

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.temperature == 0:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self._generators[request_id] = gen
        return gen

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator and token history."""
        self._generators.pop(request_id, None)
        self._seen.pop(request_id, None)
