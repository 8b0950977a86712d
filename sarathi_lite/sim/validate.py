"""How far a cost model is from a real run, step by step (``sarathi-lite sim --validate RUN.json``).

Summary metrics (TTFT, TBT percentiles) mix every error of a cost model with queueing; this checks the model
where it is made: one iteration at a time. The real run's batches are rebuilt by simulating its workload under
its configuration with a ``ReplayCostModel`` of its own timeline (the simulator then makes the engine's
decisions, ``tests/test_sim_faithfulness.py``), so every recorded iteration gets its ``SchedulerOutput`` with
each request's context; the cost model predicts each one's typical step time (``predict_step_time``) and the
relative error ``predicted / measured - 1`` is grouped by batch kind (decode-only, chunk-only, hybrid) and by
context (short, or long: some request's context above ``long_context`` tokens), and by step size (query tokens,
in the bins of ``STEP_SIZES``): a cost model that is right on the steps it was profiled on and wrong beyond shows
as one bad row of the second table, with the share of the run's time those steps take.

A machine shared with other work runs slower than when it was profiled, by a factor that drifts; the
``chunk_size="auto"`` budget corrects for it online. So besides the raw error, each group reports the error
once every prediction is multiplied by one ``scale`` (the run's median of measured / predicted): what is left is
the model's error in *shape* (decode against prefill, short against long context), which no correction removes.

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sarathi_lite.bench.results import BenchResult
from sarathi_lite.costs import CostModel, StepTiming
from sarathi_lite.scheduler import SchedulerConfig, SchedulerOutput
from sarathi_lite.sim.cost_model import ReplayCostModel
from sarathi_lite.sim.simulator import simulate

KINDS = ("decode-only", "chunk-only", "hybrid")
DEFAULT_LONG_CONTEXT = 512
STEP_SIZES = (16, 64, 256, 512, 1024, 2048)
"""Upper edges (query tokens, inclusive) of the step-size bins of ``Validation.by_size``; one more bin above."""


def size_bin(tokens: int) -> str:
    """The ``STEP_SIZES`` bin of a step of ``tokens`` query tokens: ``"1-16"``, ``"17-64"``, ..., ``">2048"``."""
    low = 1
    for edge in STEP_SIZES:
        if tokens <= edge:
            return f"{low}-{edge}"
        low = edge + 1
    return f">{STEP_SIZES[-1]}"


class _RecordingReplay(ReplayCostModel):
    """A replay that keeps every ``SchedulerOutput`` it is asked about."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: list[SchedulerOutput] = []

    def predict(self, out: SchedulerOutput) -> StepTiming:
        self.outputs.append(out)
        return super().predict(out)


@dataclass(slots=True)
class StepError:
    """One iteration: its kind, whether its context is long, and the predicted and measured step times (s);
    tokens: its query tokens."""

    kind: str
    long: bool
    predicted: float
    measured: float
    tokens: int = 0

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0

    def scaled_error(self, scale: float) -> float:
        return self.predicted * scale / self.measured - 1.0


@dataclass(slots=True)
class Validation:
    """Every matched iteration's error, and how many iterations the rebuilt batches did not match."""

    label: str
    long_context: int
    steps: list[StepError] = field(default_factory=list)
    unmatched: int = 0

    @property
    def scale(self) -> float:
        """The run's median measured / predicted step time (1.0 without steps)."""
        return float(np.median([s.measured / s.predicted for s in self.steps])) if self.steps else 1.0

    def groups(self) -> list[dict[str, Any]]:
        """Per (kind, context) group and over all: ``n``; median signed error, median and p90 absolute error;
        and median signed and absolute error after ``scale``."""
        rows = []
        scale = self.scale
        keys = [(k, c) for k in KINDS for c in (False, True)] + [("all", None)]
        for kind, long in keys:
            mine = [s for s in self.steps if kind == "all" or (s.kind == kind and s.long == long)]
            if not mine:
                continue
            errs = np.array([s.error for s in mine])
            scaled = np.array([s.scaled_error(scale) for s in mine])
            rows.append({"kind": kind, "context": "all" if long is None else ("long" if long else "short"),
                         "n": len(mine), "error_p50": float(np.median(errs)),
                         "abs_error_p50": float(np.median(np.abs(errs))),
                         "abs_error_p90": float(np.percentile(np.abs(errs), 90)),
                         "scaled_error_p50": float(np.median(scaled)),
                         "scaled_abs_error_p50": float(np.median(np.abs(scaled)))})
        return rows

    def by_size(self) -> list[dict[str, Any]]:
        """Per step-size bin (``size_bin``) that has steps, smallest first: ``size``, ``n``, the largest step's
        ``max_tokens``, ``time_share`` (its steps' share of the run's measured step time), median signed error,
        median and p90 absolute error, and median signed error after ``scale``."""
        scale = self.scale
        total = sum(s.measured for s in self.steps) or 1.0
        bins = [size_bin(1)] + [size_bin(e + 1) for e in STEP_SIZES]
        rows = []
        for name in bins:
            mine = [s for s in self.steps if size_bin(s.tokens) == name]
            if not mine:
                continue
            errs = np.array([s.error for s in mine])
            rows.append({"size": name, "n": len(mine), "max_tokens": max(s.tokens for s in mine),
                         "time_share": sum(s.measured for s in mine) / total, "error_p50": float(np.median(errs)),
                         "abs_error_p50": float(np.median(np.abs(errs))),
                         "abs_error_p90": float(np.percentile(np.abs(errs), 90)),
                         "scaled_error_p50": float(np.median([s.scaled_error(scale) for s in mine]))})
        return rows

    def table(self) -> str:
        """The error by batch kind and context, then by step size."""
        lines = [f"{'batch kind':<12} {'context':<7} {'steps':>6} {'error p50':>9} {'|error| p50':>11} "
                 f"{'|error| p90':>11}   after scale {self.scale:.2f}: {'error p50':>9} {'|error| p50':>11}"]
        for g in self.groups():
            lines.append(f"{g['kind']:<12} {g['context']:<7} {g['n']:>6} {100 * g['error_p50']:>8.1f}% "
                         f"{100 * g['abs_error_p50']:>10.1f}% {100 * g['abs_error_p90']:>10.1f}%   "
                         f"{'':>17} {100 * g['scaled_error_p50']:>8.1f}% {100 * g['scaled_abs_error_p50']:>10.1f}%")
        lines += ["", f"{'step tokens':<12} {'steps':>6} {'time':>6} {'error p50':>9} {'|error| p50':>11} "
                      f"{'|error| p90':>11}   after scale: {'error p50':>9}"]
        for g in self.by_size():
            lines.append(f"{g['size']:<12} {g['n']:>6} {100 * g['time_share']:>5.0f}% {100 * g['error_p50']:>8.1f}% "
                         f"{100 * g['abs_error_p50']:>10.1f}% {100 * g['abs_error_p90']:>10.1f}%   "
                         f"{'':>12} {100 * g['scaled_error_p50']:>8.1f}%")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "long_context": self.long_context, "unmatched": self.unmatched,
                "scale": self.scale, "groups": self.groups(), "by_size": self.by_size(),
                "steps": [{"kind": s.kind, "long": s.long, "tokens": s.tokens, "predicted": s.predicted,
                           "measured": s.measured} for s in self.steps]}


def batch_kind(out: SchedulerOutput) -> str:
    if not out.num_prefills:
        return "decode-only"
    return "chunk-only" if not out.num_decodes else "hybrid"


def validate(result: BenchResult, cost_model: CostModel, *, long_context: int = DEFAULT_LONG_CONTEXT
             ) -> Validation:
    """Predict every iteration of the real run ``result`` with ``cost_model`` (see the module docstring).

    Iterations whose rebuilt batch differs from the record (token counts per kind; on a wall clock an arrival
    right at a step's start may be seen one step apart) are counted in ``unmatched`` and left out. Raises
    ``ValueError`` for a simulated result or a ``chunk_size="auto"`` run (its budgets came from a predictor the
    record does not name).
    """
    if result.meta.get("replay") != "real-time":
        raise ValueError(f"{result.label}: --validate needs a real run, not a {result.meta.get('replay')!r} one")
    c = result.config
    if c["chunk_size"] == "auto":
        raise ValueError(f"{result.label}: validate a run with a fixed chunk size")
    config = SchedulerConfig(policy=c["policy"], chunk_size=c["chunk_size"] or 512, max_num_seqs=c["max_num_seqs"],
                             block_size=c["block_size"], num_blocks=c["num_kv_blocks"],
                             max_model_len=c["max_model_len"])
    replay = _RecordingReplay.from_result(result)
    try:
        simulate(result.workload, replay, config)
    except ValueError:  # the rebuilt run drifted and wanted more iterations than were recorded
        pass
    out = Validation(result.label, long_context)
    for record, batch in zip(result.stats.iterations, replay.outputs):
        if (record.num_prefill_tokens, record.num_decode_tokens) != (batch.num_prefill_tokens, batch.num_decode_tokens):
            out.unmatched += 1
            continue
        long = max(s.num_computed_tokens + s.num_new_tokens for s in batch.scheduled) > long_context
        out.steps.append(StepError(batch_kind(batch), long, cost_model.predict_step_time(batch), record.step_time,
                                   batch.num_prefill_tokens + batch.num_decode_tokens))
    out.unmatched += max(len(result.stats.iterations) - len(replay.outputs), 0)
    return out

