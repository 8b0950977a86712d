"""SLO-aware token budget (``chunk_size="auto"``): each iteration's prefill chunk chosen from a step-time model.

A fixed ``chunk_size`` must be sized for the worst iteration (many decodes over long contexts), so it is too
small in every other one. ``TokenBudget`` instead asks a step-time predictor, every iteration, how many prefill
tokens fit next to the decodes already scheduled while the predicted step time stays at most
``tbt_slo * budget_safety`` seconds:

1. the policy schedules every running decode first (stall-free, as with a fixed budget);
2. ``prefill_tokens`` grows the prefill part in whole KV blocks (``block_size`` tokens) over the prompts that
   would take it, in the order the policy fills them (prompts mid-prefill, then waiting ones), and returns the
   largest block multiple whose predicted step fits; never less than ``min_chunk_size`` while a prompt waits,
   so prefill is never starved by a decode-heavy load; never more than ``max_num_batched_tokens`` in all;
3. after the step ran, ``observe_output`` feeds the measured step time back: a multiplicative correction, an
   exponentially weighted average of ``log(measured / predicted)``, scales every later prediction, so a model
   profiled on a quieter machine still holds the SLO. For a constant ratio the correction approaches it
   monotonically (no overshoot); single ratios and the correction are clamped to ``CORRECTION_RANGE``.

The predictor is any object with ``predict_step_time(out: SchedulerOutput) -> float`` (seconds from the
iteration's start to its end, deterministic, non-decreasing in the prefill tokens); the simulator's profiled
and roofline cost models are such objects. Torch-free, like the whole scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from .config import SchedulerConfig
from .output import ScheduledRequest, SchedulerOutput
from .request import Request

CORRECTION_WEIGHT = 0.1
"""Weight of the newest ``log(measured / predicted)`` in the correction's moving average."""
CORRECTION_RANGE = (0.25, 4.0)
"""Bounds of one observed ``measured / predicted`` ratio and of the correction factor."""


class StepTimePredictor(Protocol):
    def predict_step_time(self, out: SchedulerOutput) -> float:
        """Seconds one iteration running ``out`` takes, from its start to its end."""
        ...


class TokenBudget:
    """Chooses each iteration's prefill token budget from ``predictor`` so the step meets ``config.tbt_slo``.

    config: a ``SchedulerConfig`` with ``chunk_size="auto"`` (its ``tbt_slo``, ``budget_safety``,
    ``min_chunk_size``, ``block_size``, ``max_num_batched_tokens`` apply). predictor: see the module docstring.
    ``correction`` (dimensionless, starts at 1) multiplies every prediction.
    """

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor) -> None:
        if config.chunk_size != "auto":
            raise ValueError(f"chunk_size={config.chunk_size!r}: a TokenBudget needs chunk_size='auto'")
        if not callable(getattr(predictor, "predict_step_time", None)):
            raise ValueError(f"predictor={predictor!r} has no predict_step_time(SchedulerOutput) method")
        self.predictor = predictor
        self.block_size = config.block_size
        self.target = config.tbt_slo * config.budget_safety
        self.min_blocks = math.ceil(config.min_chunk_size / config.block_size)
        self.max_tokens = config.max_num_batched_tokens
        self.correction = 1.0
        self._log_correction = 0.0

    # ------------------------------------------------------------------ choosing the budget

    def predict(self, out: SchedulerOutput) -> float:
        """Corrected predicted seconds of the iteration ``out``."""
        return self.predictor.predict_step_time(out) * self.correction

    def prefill_tokens(self, out: SchedulerOutput, candidates: Sequence[tuple[Request, int]]) -> int:
        """Prefill tokens the iteration ``out`` (its decodes already scheduled) may add: the largest multiple of
        ``block_size`` whose predicted step fits the target, at least ``min_chunk_size`` (rounded up to whole
        blocks) when ``candidates`` is not empty, 0 when it is.

        candidates: ``(request, most tokens its chunk may take)`` for the prompts that would take the prefill
        tokens, in the order the policy fills them.
        """
        if not candidates:
            return 0
        bs = self.block_size
        wanted = sum(n for _, n in candidates)
        lo = self.min_blocks
        hi = max(lo, min(self.max_tokens - out.num_batched_tokens, wanted + bs - 1) // bs)
        # Largest k in [lo, hi] whose trial batch fits; lo is granted even when it does not.
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict(self._trial(out, candidates, mid * bs)) <= self.target:
                lo = mid
            else:
                hi = mid - 1
        return lo * bs

    @staticmethod
    def _trial(out: SchedulerOutput, candidates: Sequence[tuple[Request, int]], budget: int) -> SchedulerOutput:
        """``out`` plus the prefill rows ``budget`` tokens would add (token ids and block tables left empty)."""
        trial = SchedulerOutput(list(out.scheduled), num_prefill_tokens=out.num_prefill_tokens,
                                num_decode_tokens=out.num_decode_tokens, num_prefills=out.num_prefills,
                                num_decodes=out.num_decodes)
        for req, n in candidates:
            if budget <= 0:
                break
            n = min(n, budget)
            start = req.num_computed_tokens
            trial.add(ScheduledRequest(req.request_id, start, n, [], [], start + n == req.num_tokens, True))
            budget -= n
        return trial

    # ------------------------------------------------------------------ online correction

    def observe(self, predicted: float, measured: float) -> None:
        """Fold one iteration's uncorrected ``predicted`` and ``measured`` step times (seconds) into the
        correction. Raises ``ValueError`` unless both are positive and finite."""
        for name, value in (("predicted", predicted), ("measured", measured)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive, finite step time in seconds")
        lo, hi = (math.log(b) for b in CORRECTION_RANGE)
        ratio = min(max(math.log(measured / predicted), lo), hi)
        self._log_correction += CORRECTION_WEIGHT * (ratio - self._log_correction)
        self.correction = math.exp(self._log_correction)

    def observe_output(self, out: SchedulerOutput, measured: float) -> None:
        """``observe`` the iteration ``out`` that took ``measured`` seconds (skipped for an empty one)."""
        if not out.is_empty:
            self.observe(self.predictor.predict_step_time(out), measured)
