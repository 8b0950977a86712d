"""Step-time cost models: how long one iteration takes, predicted from its ``SchedulerOutput`` alone.

Torch-free (numpy only), so the simulator (``sarathi_lite.sim``) runs anywhere. Every model answers the same two
questions the real engine's clock answers:

- ``predict(out)``: the iteration's ``schedule_time`` (step start to the end of ``schedule()``) and
  ``step_time`` (step start to end: scheduling, input preparation, the forward pass, sampling and ``update``),
  both in seconds, as ``IterationRecord`` measures them;
- ``start_time(ready)``: when the next iteration starts, given that the engine became ready at ``ready`` (the
  previous iteration's end, or the arrival that ended an idle spell): ``ready + step_gap``, the host's time
  between steps (recording metrics, building outputs, the replay loop's look at the clock).

Models:

- ``LinearCostModel``: a few physical terms (``TERMS``) with fitted coefficients; ``sarathi-lite profile`` fits
  one to this machine's model runner (``sarathi_lite.profiler``) and saves it as a small JSON file;
- ``RooflineCostModel`` (``sarathi_lite.roofline``): a model's shape on a hardware description;
- ``ReplayCostModel``: the measured timeline of a real run, replayed step by step (faithfulness checks).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_lite.metrics import IterationRecord
from sarathi_lite.scheduler import SchedulerOutput

COST_MODEL_SCHEMA = "sarathi-lite/cost-model/1"

TERMS = ("constant", "tokens", "decode_tokens", "prefill_chunks", "sampled", "prefill_attention",
         "decode_attention")
"""The step-time terms of ``LinearCostModel``, per iteration:

constant: 1 (fixed cost of a forward pass: weight reads at small batches, per-layer launches);
tokens: query tokens of every request (the linear layers, norms, rotary, KV writes);
decode_tokens: decodes (each extra: its decode-attention bookkeeping beyond the linear layers);
prefill_chunks: prompt chunks (each runs its own masked attention call per layer);
sampled: rows that sample a token (the LM head over the vocabulary, and the sampler);
prefill_attention: sum over prompt chunks of ``num_new_tokens * (num_computed_tokens + num_new_tokens)`` (query x
    key pairs of a masked attention call over the chunk's whole context);
decode_attention: sum over decodes of their context ``num_computed_tokens + 1`` (keys read).
"""


@dataclass(slots=True, frozen=True)
class StepTiming:
    """One iteration's predicted times (seconds from its start): end of scheduling, and end of the step."""

    schedule_time: float
    step_time: float


class CostModel:
    """The interface the simulator drives. Subclasses implement ``predict``; ``describe`` names the model.

    step_gap: seconds from one iteration's end to the next one's start when work is waiting.
    kv_bytes_per_token, kv_cache_memory, max_position_embeddings: what the modelled deployment holds (bytes of
    K/V per token over all layers; bytes given to the KV pool; the model's longest context), from which the
    simulator derives the KV pool size the real engine would have (``None``: pass it explicitly).
    """

    step_gap: float = 0.0
    kv_bytes_per_token: int | None = None
    kv_cache_memory: int | None = None
    max_position_embeddings: int | None = None

    def predict(self, out: SchedulerOutput) -> StepTiming:
        raise NotImplementedError

    def start_time(self, ready: float) -> float:
        """When the next iteration starts (seconds) if the engine is ready at ``ready``."""
        return ready + self.step_gap

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description, stored in a simulated result's ``meta``: ``kind``, and the deployment it
        models (``model``, ``dtype``, ``device``, ``attention_backend``; ``None`` where unknown), which a
        simulated result's configuration records like a real one's."""
        raise NotImplementedError


def batch_terms(out: SchedulerOutput) -> tuple[float, ...]:
    """The values of ``TERMS`` for one iteration (see ``TERMS`` for units)."""
    chunks = sampled = attn_pf = attn_dec = 0
    for s in out.scheduled:
        kv = s.num_computed_tokens + s.num_new_tokens
        if s.is_prefill:
            chunks += 1
            attn_pf += s.num_new_tokens * kv
        else:
            attn_dec += kv
        sampled += s.sample
    return (1.0, out.num_prefill_tokens + out.num_decode_tokens, out.num_decode_tokens, chunks, sampled, attn_pf,
            attn_dec)


@dataclass
class LinearCostModel(CostModel):
    """Step time as a non-negative combination of ``TERMS``, plus host overheads.

    step_time = sum(coefficients[t] * term t) + schedule_time
    schedule_time = schedule_constant + schedule_per_request * (scheduled requests)

    coefficients: seconds per unit of each term (missing terms are 0). schedule_constant (s),
    schedule_per_request (s per scheduled request) and step_gap (s) are host overheads. meta: how it was made
    (model, machine, threads, fit quality), free-form.
    """

    coefficients: dict[str, float]
    schedule_constant: float = 0.0
    schedule_per_request: float = 0.0
    step_gap: float = 0.0
    kv_bytes_per_token: int | None = None
    kv_cache_memory: int | None = None
    max_position_embeddings: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    _coef: tuple[float, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(TERMS)
        if unknown:
            raise ValueError(f"unknown cost term(s) {', '.join(sorted(unknown))}; terms are {', '.join(TERMS)}")
        if any(v < 0 for v in self.coefficients.values()):
            raise ValueError(f"cost coefficients must be >= 0, got {self.coefficients}")
        self._coef = tuple(float(self.coefficients.get(t, 0.0)) for t in TERMS)

    def predict(self, out: SchedulerOutput) -> StepTiming:
        sched = self.schedule_constant + self.schedule_per_request * len(out.scheduled)
        return StepTiming(sched, sched + sum(c * v for c, v in zip(self._coef, batch_terms(out))))

    def forward_time(self, terms: Sequence[Sequence[float]]) -> np.ndarray:
        """Predicted time (seconds) of the model-runner part for rows of ``TERMS`` values."""
        return np.asarray(terms, dtype=np.float64) @ np.array(self._coef)

    def describe(self) -> dict[str, Any]:
        keys = ("model", "dtype", "device", "attention_backend", "machine", "threads", "file")
        return {"kind": "linear", **{k: self.meta.get(k) for k in keys}}

    def to_dict(self) -> dict[str, Any]:
        return {"schema": COST_MODEL_SCHEMA, "kind": "linear",
                "coefficients": {t: self.coefficients.get(t, 0.0) for t in TERMS},
                "schedule_constant": self.schedule_constant, "schedule_per_request": self.schedule_per_request,
                "step_gap": self.step_gap, "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_cache_memory": self.kv_cache_memory, "max_position_embeddings": self.max_position_embeddings,
                "meta": self.meta}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinearCostModel:
        if d.get("schema") != COST_MODEL_SCHEMA or d.get("kind") != "linear":
            raise ValueError(f"not a {COST_MODEL_SCHEMA} linear cost model (schema={d.get('schema')!r})")
        fields = ("schedule_constant", "schedule_per_request", "step_gap", "kv_bytes_per_token", "kv_cache_memory",
                  "max_position_embeddings")
        return cls(dict(d["coefficients"]), **{k: d[k] for k in fields if k in d}, meta=dict(d.get("meta", {})))

    @classmethod
    def load(cls, path: str | Path) -> LinearCostModel:
        model = cls.from_dict(json.loads(Path(path).read_text()))
        model.meta["file"] = str(path)
        return model


class ReplayCostModel(CostModel):
    """Replays a real run's measured timeline: iteration ``i`` of the simulation starts when the real iteration
    ``i`` started and takes as long as it took. Arrivals then become visible at the same iterations as in the
    real run, so a faithful simulator reproduces its batches exactly (see ``tests/test_sim_faithfulness.py``).

    iterations: the real run's ``IterationRecord``s, in order. run_start: the real run's time zero on the same
    clock (the replay's start, which workload arrival times are relative to). deployment: the real run's
    ``model``, ``dtype``, ``device``, ``attention_backend``.
    """

    def __init__(self, iterations: Sequence[IterationRecord], run_start: float,
                 deployment: dict[str, Any] | None = None) -> None:
        self.deployment = {k: (deployment or {}).get(k) for k in ("model", "dtype", "device", "attention_backend")}
        self.starts = [it.start_time - run_start for it in iterations]
        self.timings = [StepTiming(it.schedule_time, it.step_time) for it in iterations]
        self.next = 0

    @classmethod
    def from_result(cls, result: Any) -> ReplayCostModel:
        """From a real ``BenchResult``: its iterations and the run start implied by any request's arrival."""
        spec = result.workload.requests[0]
        first = next(m for m in result.stats.requests if m.request_id == spec.request_id)
        return cls(result.stats.iterations, first.arrival_time - spec.arrival_time, result.config)

    def start_time(self, ready: float) -> float:
        if self.next >= len(self.starts):
            raise ValueError(f"the replayed run has only {len(self.starts)} iterations; the simulation wants more")
        return max(ready, self.starts[self.next])

    def predict(self, out: SchedulerOutput) -> StepTiming:
        timing = self.timings[self.next]
        self.next += 1
        return timing

    def describe(self) -> dict[str, Any]:
        return {"kind": "replay", **self.deployment, "iterations": len(self.timings)}


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares: ``argmin ||a x - b||`` subject to ``x >= 0`` (Lawson and Hanson's active-set
    method). a: float [m, n]; b: float [m]. Returns x: float [n]."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(np.float64).eps * np.abs(a).sum(axis=0).max() * max(m, n)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter or 3 * n):
        if passive.all() or w[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            blocking = passive & (z <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def fit_terms(terms: Sequence[Sequence[float]], times: Sequence[float], names: Sequence[str] = TERMS
              ) -> dict[str, float]:
    """Fit non-negative coefficients (seconds per unit) of ``names`` to measured ``times`` (seconds), one row of
    term values per measurement, minimising the squared *relative* error (each row weighted by 1 / its time), so
    short decode steps count as much as long prefills. Columns are scaled to unit norm for conditioning."""
    a = np.asarray(terms, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if a.ndim != 2 or a.shape != (len(y), len(names)):
        raise ValueError(f"terms must be [{len(y)}, {len(names)}], got {a.shape}")
    if (y <= 0).any():
        raise ValueError("measured times must be positive")
    weighted = a / y[:, None]
    scale = np.linalg.norm(weighted, axis=0)
    scale[scale == 0] = 1.0
    x = nnls(weighted / scale, np.ones_like(y)) / scale
    return dict(zip(names, map(float, x)))


def fit_quality(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """R^2, and median / 90th percentile / max absolute relative error, of predictions against measurements."""
    p = np.asarray(predicted, dtype=np.float64)
    y = np.asarray(measured, dtype=np.float64)
    rel = np.abs(p - y) / y
    ss_res = float(((y - p) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return {"r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"), "rel_err_p50": float(np.median(rel)),
            "rel_err_p90": float(np.percentile(rel, 90)), "rel_err_max": float(rel.max()), "n": int(len(y))}
