"""Turns the logits of the rows that sample into next tokens, per request's ``SamplingParams``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.kernels import sample


class Sampler:
    """Samples one token per row; keeps each seeded request's generator across steps (and preemptions), so its
    draws do not depend on what it is batched with."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams],
                 banned: Mapping[str, Sequence[int]] | None = None) -> tuple[list[int], list[Any] | None]:
        """logits: [B, vocab] float32. banned: per request id, token ids its row must not sample (their
        logits become -inf). Returns the B token ids, and per row ``(logprob, {id: logprob})`` or ``None`` (the
        list itself is ``None`` when no row asked for logprobs). Values past the vocabulary (a banned id, a
        ``top_k`` or ``logprobs`` above it) are clipped to it, never an error: ``LLMEngine.add_request`` rejects
        what it can, and what it cannot check must not fail the whole batch."""
        vocab = logits.shape[-1]
        if banned:
            for i, rid in enumerate(request_ids):
                ids = [t for t in banned.get(rid, ()) if 0 <= t < vocab]
                if ids:
                    logits[i, ids] = float("-inf")
        if all(p.temperature == 0 for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            dev = logits.device
            temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            top_k = torch.tensor([min(p.top_k, vocab) for p in params], dtype=torch.int64, device=dev)
            generators = [self._generator(rid, p) for rid, p in zip(request_ids, params)]
            tokens = sample(logits, temperature, top_p, top_k, generators)
        token_list = tokens.tolist()
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

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.temperature == 0:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self._generators[request_id] = gen
        return gen

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
