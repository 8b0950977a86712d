"""The simulator's side of the cost models: the replay of a real run's timeline, and fitting a
``ProfiledCostModel`` to measured batch times (non-negative least squares). Torch-free (numpy only).

The models themselves (``CostModel``, ``StepTiming``, ``ProfiledCostModel``, ``RooflineCostModel``) live in
``sarathi_lite.costs``, below the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sarathi_lite.bench.results import BenchResult
from sarathi_lite.costs.base import CostModel, StepTiming
from sarathi_lite.costs.profiled import TERMS, token_basis
from sarathi_lite.metrics import IterationRecord
from sarathi_lite.scheduler import SchedulerOutput

__all__ = ["ReplayCostModel", "design_matrix", "fit_profile", "fit_quality", "nnls"]


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
