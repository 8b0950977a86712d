"""Step-time cost models: how long one iteration takes, predicted from its ``SchedulerOutput`` alone.

Torch-free (numpy only), so the simulator (``sarathi_lite.sim.simulator``) runs anywhere. Every model answers
the same two questions the real engine's clock answers:

- ``predict(out)``: the iteration's ``schedule_time`` (step start to the end of ``schedule()``) and
  ``step_time`` (step start to end: scheduling, input preparation, the forward pass, sampling and ``update``),
  both in seconds, as ``IterationRecord`` measures them;
- ``start_time(ready)``: when the next iteration starts, given that the engine became ready at ``ready`` (the
  previous iteration's end, or the arrival that ended an idle spell): ``ready + step_gap``, the host's time
  between steps (recording metrics, building outputs, the replay loop's look at the clock);
- ``reset(seed)``: called before each simulation, for models with state;
- ``predict_step_time(out)``: the typical step time, deterministic and stateless: what ``chunk_size="auto"``
  asks about trial batches (profiled and roofline models; a replay has none).

Models:

- ``ProfiledCostModel``: the dense layers' measured cost curve over the batch's tokens plus a few physical
  per-request terms (``TERMS``); ``sarathi-lite profile`` fits one to this machine's model runner
  (``sarathi_lite.sim.profiler``) and saves it as a small JSON file;
- ``RooflineCostModel`` (``sarathi_lite.sim.roofline``): a model's shape on a hardware description;
- ``ReplayCostModel``: the measured timeline of a real run, replayed step by step (faithfulness checks).
"""

from __future__ import annotations

import bisect
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_lite.bench.results import BenchResult
from sarathi_lite.metrics import IterationRecord
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

    def predict_step_time(self, out: SchedulerOutput) -> float:
        """The typical ``step_time`` (seconds) of ``out``: deterministic, with no random draw and no state
        change, so ``chunk_size="auto"`` can ask it about trial batches (``sarathi_lite.scheduler.budget``)."""
        raise NotImplementedError(f"{type(self).__name__} gives no deterministic step-time prediction")

    def start_time(self, ready: float) -> float:
        """When the next iteration starts (seconds) if the engine is ready at ``ready``."""
        return ready + self.step_gap

    def reset(self, seed: int) -> None:
        """Start a new simulation: the simulator calls this first, so a model with state (a replay's position,
        a random draw's generator) gives every simulation the same sequence whatever ran before."""

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description, stored in a simulated result's ``meta``: ``kind``, and the deployment it
        models (``model``, ``dtype``, ``device``, ``attention_backend``; ``None`` where unknown), which a
        simulated result's configuration records like a real one's."""
        raise NotImplementedError


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
    def from_result(cls, result: BenchResult) -> ReplayCostModel:
        """From a real ``BenchResult``: its iterations and the run start implied by any request's arrival."""
        spec = result.workload.requests[0]
        first = next(m for m in result.stats.requests if m.request_id == spec.request_id)
        return cls(result.stats.iterations, first.arrival_time - spec.arrival_time, result.config)

    def reset(self, seed: int) -> None:
        self.next = 0

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


def design_matrix(terms: Sequence[Sequence[float]], knots: Sequence[int]) -> np.ndarray:
    """The linear model behind ``ProfiledCostModel``: one row per row of ``batch_terms`` values, its
    ``token_basis`` weights over ``knots`` followed by its ``TERMS`` values, so ``design_matrix @ [token_times,
    coefficients]`` is each batch's typical forward time."""
    rows = np.asarray(terms, dtype=np.float64).reshape(-1, 1 + len(TERMS))
    basis = np.array([token_basis(t, knots) for t in rows[:, 0]]).reshape(len(rows), len(knots))
    return np.hstack([basis, rows[:, 1:]])


def fit_profile(terms: Sequence[Sequence[float]], times: Sequence[float], knots: Sequence[int]
                ) -> tuple[list[float], dict[str, float]]:
    """Fit ``ProfiledCostModel``'s token curve (seconds at ``knots``) and ``TERMS`` coefficients to measured
    ``times`` (seconds), one row of ``batch_terms`` values per measurement, by non-negative least squares on the
    squared *relative* error (each row weighted by 1 / its time, so short decode steps count as much as long
    prefills). Columns are scaled to unit norm for conditioning. Returns ``(token_times, coefficients)``."""
    rows = np.asarray(terms, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if rows.ndim != 2 or rows.shape != (len(y), 1 + len(TERMS)):
        raise ValueError(f"terms must be [{len(y)}, {1 + len(TERMS)}], got {rows.shape}")
    if (y <= 0).any():
        raise ValueError("measured times must be positive")
    a = design_matrix(rows, knots) / y[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    x = nnls(a / scale, np.ones_like(y)) / scale
    return [float(v) for v in x[:len(knots)]], dict(zip(TERMS, map(float, x[len(knots):])))


def fit_quality(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """R^2, and median / 90th percentile / max absolute relative error, of predictions against measurements."""
    p = np.asarray(predicted, dtype=np.float64)
    y = np.asarray(measured, dtype=np.float64)
    rel = np.abs(p - y) / y
    ss_res = float(((y - p) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return {"r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"), "rel_err_p50": float(np.median(rel)),
            "rel_err_p90": float(np.percentile(rel, 90)), "rel_err_max": float(rel.max()), "n": int(len(y))}
