"""``ProfiledCostModel``: a step time fitted to one machine's measured model runner (the prediction side; the
profiler and the fit live in ``sarathi_lite.sim``). Torch-free (numpy only)."""

from __future__ import annotations

import bisect
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_lite.costs.base import CostModel, StepTiming
from sarathi_lite.scheduler import SchedulerOutput

COST_MODEL_SCHEMA = "sarathi-lite/cost-model/1"

TERMS = ("decode_tokens", "prefill_chunks", "sampled", "prefill_attention", "decode_attention")
"""The per-request terms of ``ProfiledCostModel``, each summed over an iteration's batch:

decode_tokens: decodes (each: its decode-attention bookkeeping and gather beyond the dense layers);
prefill_chunks: prompt chunks (each runs its own masked attention call per layer);
sampled: rows that sample a token (the LM head over the vocabulary, and the sampler);
prefill_attention: sum over prompt chunks of ``num_new_tokens * (num_computed_tokens + num_new_tokens)`` (query x
    key pairs of a masked attention call over the chunk's whole context);
decode_attention: sum over decodes of their context ``num_computed_tokens + 1`` (keys read).
"""


def batch_terms(out: SchedulerOutput) -> tuple[int, ...]:
    """``(query tokens, *TERMS)`` of one iteration (see ``TERMS``)."""
    chunks = sampled = attn_pf = attn_dec = 0
    for s in out.scheduled:
        kv = s.num_computed_tokens + s.num_new_tokens
        if s.is_prefill:
            chunks += 1
            attn_pf += s.num_new_tokens * kv
        else:
            attn_dec += kv
        sampled += s.sample
    return (out.num_prefill_tokens + out.num_decode_tokens, out.num_decode_tokens, chunks, sampled, attn_pf,
            attn_dec)


def token_basis(tokens: float, knots: Sequence[int]) -> list[float]:
    """Weights ``w`` with ``g(tokens) = sum(w[j] * g(knots[j]))`` for every ``g`` that is linear between the
    knots, constant below the first and continues the last segment's slope above the last."""
    w = [0.0] * len(knots)
    if tokens <= knots[0]:
        w[0] = 1.0
        return w
    j = min(bisect.bisect_left(knots, tokens), len(knots) - 1)  # tokens in (knots[j - 1], knots[j]], or beyond
    f = (tokens - knots[j - 1]) / (knots[j] - knots[j - 1])
    w[j - 1], w[j] = 1.0 - f, f
    return w


@dataclass
class ProfiledCostModel(CostModel):
    """Step time fitted to this machine: the dense layers' cost as a measured curve over the batch's tokens, plus
    non-negative per-request terms (``TERMS``), plus host overheads.

    step_time = schedule_time + g(query tokens) + sum(coefficients[t] * term t for t in TERMS)
    schedule_time = schedule_constant + schedule_per_request * (scheduled requests)

    and, when ``jitter`` is given, the forward part (g and the terms) multiplied by a factor drawn per iteration
    from that distribution: the same batch does not take the same time twice on a real machine, and a
    deterministic model predicts the typical step, so it underestimates tail latencies (P99 TBT) by the width of
    that spread.

    g is linear between ``token_knots`` (tokens) where it takes ``token_times`` (seconds): CPU BLAS libraries
    switch kernels with the batch size, so the cost of the projections is far from a straight line below a few
    dozen tokens. coefficients: seconds per unit of each term (missing terms are 0). schedule_constant (s),
    schedule_per_request (s per scheduled request) and step_gap (s, between steps) are host overheads. jitter:
    quantiles (evenly spaced, from the 0th to the 100th percentile) of a step's time over its typical time, as
    measured by the profile's repeated runs; empty: deterministic. meta: how it was made (model, machine, threads,
    fit quality), free-form.
    """

    token_knots: tuple[int, ...]
    token_times: tuple[float, ...]
    coefficients: dict[str, float] = field(default_factory=dict)
    schedule_constant: float = 0.0
    schedule_per_request: float = 0.0
    step_gap: float = 0.0
    kv_bytes_per_token: int | None = None
    kv_cache_memory: int | None = None
    max_position_embeddings: int | None = None
    jitter: tuple[float, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    _coef: tuple[float, ...] = field(init=False, repr=False)
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_knots = tuple(int(k) for k in self.token_knots)
        self.token_times = tuple(float(t) for t in self.token_times)
        k = self.token_knots
        if len(k) < 2 or len(k) != len(self.token_times) or any(a >= b for a, b in zip(k, k[1:])) or k[0] < 1:
            raise ValueError(f"token_knots must be at least two increasing positive token counts, one per token "
                             f"time; got {k} and {len(self.token_times)} times")
        unknown = set(self.coefficients) - set(TERMS)
        if unknown:
            raise ValueError(f"unknown cost term(s) {', '.join(sorted(unknown))}; terms are {', '.join(TERMS)}")
        if any(v < 0 for v in (*self.coefficients.values(), *self.token_times)):
            raise ValueError("cost coefficients and token times must be >= 0")
        self.jitter = tuple(float(q) for q in self.jitter)
        if len(self.jitter) == 1 or any(a > b for a, b in zip(self.jitter, self.jitter[1:])) or \
                any(q <= 0 for q in self.jitter):
            raise ValueError(f"jitter must be at least two increasing positive quantiles, got {self.jitter}")
        self._coef = tuple(float(self.coefficients.get(t, 0.0)) for t in TERMS)
        self._rng = random.Random(0)

    def token_time(self, tokens: float) -> float:
        """g(tokens): seconds of the dense layers for a batch of ``tokens`` query tokens."""
        return sum(w * t for w, t in zip(token_basis(tokens, self.token_knots), self.token_times))

    def typical_forward(self, row: Sequence[float]) -> float:
        """Typical model-runner seconds (no jitter, no host overheads) for one row of ``batch_terms`` values."""
        return self.token_time(row[0]) + sum(c * v for c, v in zip(self._coef, row[1:]))

    def forward_time(self, terms: Sequence[Sequence[float]]) -> np.ndarray:
        """``typical_forward`` of each row of ``batch_terms`` values."""
        return np.array([self.typical_forward(row) for row in terms])

    def predict_step_time(self, out: SchedulerOutput) -> float:
        return self.schedule_constant + self.schedule_per_request * len(out.scheduled) + \
            self.typical_forward(batch_terms(out))

    def predict(self, out: SchedulerOutput) -> StepTiming:
        sched = self.schedule_constant + self.schedule_per_request * len(out.scheduled)
        forward = self.typical_forward(batch_terms(out))
        if self.jitter:  # inverse-CDF draw, linear between the quantiles
            x = self._rng.random() * (len(self.jitter) - 1)
            i = min(int(x), len(self.jitter) - 2)
            forward *= self.jitter[i] + (x - i) * (self.jitter[i + 1] - self.jitter[i])
        return StepTiming(sched, sched + forward)

    def reset(self, seed: int) -> None:
        self._rng.seed(seed)

    def describe(self) -> dict[str, Any]:
        keys = ("model", "dtype", "device", "attention_backend", "machine", "threads", "file")
        return {"kind": "profiled", **{k: self.meta.get(k) for k in keys}, "jitter": bool(self.jitter)}

    def to_dict(self) -> dict[str, Any]:
        return {"schema": COST_MODEL_SCHEMA, "kind": "profiled", "token_knots": list(self.token_knots),
                "token_times": list(self.token_times),
                "coefficients": {t: self.coefficients.get(t, 0.0) for t in TERMS},
                "schedule_constant": self.schedule_constant, "schedule_per_request": self.schedule_per_request,
                "step_gap": self.step_gap, "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_cache_memory": self.kv_cache_memory, "max_position_embeddings": self.max_position_embeddings,
                "jitter": list(self.jitter), "meta": self.meta}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProfiledCostModel:
        if d.get("schema") != COST_MODEL_SCHEMA or d.get("kind") != "profiled":
            raise ValueError(f"not a {COST_MODEL_SCHEMA} profiled cost model (schema={d.get('schema')!r}, "
                             f"kind={d.get('kind')!r})")
        fields = ("coefficients", "schedule_constant", "schedule_per_request", "step_gap", "kv_bytes_per_token",
                  "kv_cache_memory", "max_position_embeddings", "jitter", "meta")
        return cls(d["token_knots"], d["token_times"], **{k: d[k] for k in fields if k in d})

    @classmethod
    def load(cls, path: str | Path) -> ProfiledCostModel:
        model = cls.from_dict(json.loads(Path(path).read_text()))
        model.meta["file"] = str(path)
        return model
