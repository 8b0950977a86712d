"""SLO-aware token budget (``chunk_size="auto"``): each iteration's prefill chunk chosen from a step-time model.

A fixed ``chunk_size`` must be sized for the worst iteration (many decodes over long contexts), so it is too
small in every other one. ``TokenBudget`` instead asks a step-time predictor, every iteration, how many prefill
tokens fit next to the decodes already scheduled while the predicted step time stays at most ``target``
seconds:

1. the policy schedules every running decode first (stall-free, as with a fixed budget);
2. ``prefill_tokens`` grows the step in grains of ``gcd(block_size, STEP_GRAIN)`` tokens (whole KV blocks of
   up to 16 tokens; decodes included, as a fixed ``chunk_size`` counts them) with prefill for the prompts that
   would take it, in the order the policy fills them (prompts mid-prefill, then waiting ones), and returns the
   prefill of the largest such step whose predicted time fits (``largest_fitting``: the step time need not grow
   with the tokens); never less than ``min_chunk_size`` while a prompt waits, so prefill is never starved by a
   decode-heavy load; never more than ``max_num_batched_tokens`` in all;
3. after a step with prefill tokens ran (the steps the budget sizes; a decode-only step's ratio, dominated by
   fixed overheads, says little about them), ``observe_output`` feeds its measured time back: a multiplicative
   correction, an exponentially weighted average of ``log(measured / predicted)``, scales every later
   prediction, so a model profiled on a quieter machine still holds the SLO (for a constant ratio it approaches
   it monotonically; single ratios and the correction are clamped to ``CORRECTION_RANGE``). With
   ``tbt_percentile`` set, three more terms aim at the SLO the user states, a percentile of the time between
   tokens, not at a fixed fraction of it: the ``spread``, a high percentile (``tail_percentile``: the one that
   keeps ``tbt_percentile`` of all decode gaps, sized steps or not, within the SLO) of the last
   ``SPREAD_WINDOW`` steps' ``measured / (predicted * correction)``, also multiplies the prediction, so a step
   planned at the target runs over it no more often than the percentile allows, however widely the machine
   scatters around its typical step; ``between``, the percentile of the seconds a decode waits beyond the
   step itself (``gap - measured``: the host's work between steps), is added to it; and a ``TailController``
   moves ``target`` (from ``tbt_slo * budget_safety``, inside ``[TARGET_FLOOR * tbt_slo, tbt_slo]``) so that
   the percentile of the measured gaps of the steps the budget sized sits just under ``tbt_slo``, for what the
   ratios do not show.

The predictor is any object with ``predict_step_time(out: SchedulerOutput) -> float`` (seconds from the
iteration's start to its end, deterministic); the simulator's profiled, roofline and calibrated cost models are
such objects. Torch-free, like the whole scheduler.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from .config import SchedulerConfig
from .output import ScheduledRequest, SchedulerOutput
from .request import Request

CORRECTION_WEIGHT = 0.1
"""Weight of the newest ``log(measured / predicted)`` in the correction's moving average."""
CORRECTION_RANGE = (0.25, 4.0)
"""Bounds of one observed ``measured / predicted`` ratio and of the correction factor."""

DIP_TOLERANCE = 0.05
"""How far (a fraction of the target) a predicted step time may fall as prefill tokens grow, for
``largest_fitting`` to still find the largest fitting budget: a candidate predicted above ``target * (1 +
DIP_TOLERANCE)`` proves that no larger one fits. Measured all-reduce tables dip by about 2% of a step."""
MAX_SCAN = 16
"""Most candidates ``largest_fitting`` evaluates one by one above the binary search's answer."""
STEP_GRAIN = 16
"""Steps are sized in grains of ``gcd(block_size, STEP_GRAIN)`` tokens: whole KV blocks where a block holds 16
tokens (sarathi-lite's default and vLLM's on GPUs), 16 tokens where blocks are larger (vLLM's CPU backend uses
128-token blocks: in whole blocks the budget's steps jumped between 128 and 256 tokens, and a step that fitted
at 200 was planned at 128, 30% under its target). Every whole-block step is still a candidate."""
EFFICIENCY_LOOKBACK, EFFICIENCY_GRAIN = 128, 64
"""Tokens below the largest fitting step within which ``TokenBudget.prefill_tokens`` also weighs the whole-grain
steps of a multiple of ``EFFICIENCY_GRAIN`` tokens (GPU matmul tiles are 64 or 128 tokens), taking the one with
the most tokens per predicted second: at most two more predictions. This pass takes no step that cuts a prompt
the largest fitting step finishes (``finished_prefix``): that request's first token would wait a whole step more,
for a few percent of one step's rate (where a chunk's own attention bends the rate down, as on a CPU, the pass
would otherwise cut a burst of short prompts a grain short of finishing). ``SEAT_BOUND_SHARE``'s pass may: with
every seat taken the seats' turnover, not one request's first token, sets the capacity, and with the same rule
it lost 0.5-0.7% of capacity on the seat-bound conversation cells (A100 8B, Llama-3-70B on 4 and 8 H100s,
simulated)."""

SEAT_BOUND_SHARE, SEAT_BOUND_GRAIN = 1 / 3, 128
"""With ``seat_bound`` (more requests wait than seats are free: the seats, not the prefill, decide how many
requests finish per second), the share of the largest fitting step's tokens below it within which
``TokenBudget.prefill_tokens`` weighs the whole-grain steps of a multiple of ``SEAT_BOUND_GRAIN`` tokens by the
prefill tokens per second they add to the decodes' own step (that step runs anyway: the decodes count the
steps), taking the most: a few more predictions (six at a 2,432-token step) and the decodes' own. A share, not a
fixed width: the staircase's stairs are a fixed number of tokens apart, but a small step near a memory-bound
knee would find its prefill almost free far below the largest, and take too little of it."""

SPREAD_WINDOW = 256
"""Steps with prefill whose ``measured / (predicted * correction)`` the ``spread`` is taken over (and steps with
prefill and decodes whose ``gap - measured`` ``between`` is)."""
SHARE_WINDOW = 1024
"""Steps with decodes over which the share of decode tokens in steps with prefill (those the budget sizes) is
counted: the spread's percentile follows it (``TokenBudget.tail_percentile``)."""
TAIL_PERCENTILE_FLOOR = 90.0
"""The lowest percentile the spread and ``between`` are taken at, however few decode tokens the sized steps hold."""
SPREAD_MIN_STEPS = 16
"""Steps with prefill measured before the ``spread`` is used (it is 1 until then). The ``controller``'s target,
``tbt_slo * budget_safety`` until then (room for a spread not yet measured), then starts from its aim, just under
``tbt_slo``: the measured spread is the room now, and the controller lowers the target if the tail still runs
over."""

TARGET_FLOOR = 0.5
"""The ``TailController``'s lowest target, a fraction of ``tbt_slo`` (or ``budget_safety``, if lower)."""
TAIL_SAMPLES = 5
"""Steps over the percentile per controller window: a window holds ``TAIL_SAMPLES / (1 - percentile/100)``
steps (500 at P99), and its percentile is its ``TAIL_SAMPLES``-th longest step."""
DEADBAND = 0.01
"""The controller holds while its window's percentile is within ``exp(+-DEADBAND)`` of ``tbt_slo * (1 -
DEADBAND)``, that is in about ``[0.98, 1.0] * tbt_slo``."""
GAIN = 0.5
"""Fraction of the window's log error (``log(aim / percentile)``) the controller corrects per window."""
MAX_STEP_UP, MAX_STEP_DOWN = math.log(1.05), math.log(1.2)
"""Largest change of ``log(target)`` per window: up by 5%, down by 20% (a tail over the SLO is fixed faster
than room under it is taken)."""


class StepTimePredictor(Protocol):
    def predict_step_time(self, out: SchedulerOutput) -> float:
        """Seconds one iteration running ``out`` takes, from its start to its end."""
        ...


class TailController:
    """Moves a per-step target (seconds) so that the ``percentile``-th percentile of measured step times meets
    ``slo``.

    Every ``window`` observed steps (non-overlapping windows, so each sees only steps taken under one target), the
    window's percentile ``p`` is compared with ``aim = slo * (1 - DEADBAND)``: inside the deadband the target
    holds; else ``log(target)`` moves by ``GAIN * log(aim / p)``, at most ``MAX_STEP_UP`` up and
    ``MAX_STEP_DOWN`` down, and stays inside ``[low, slo]``. Why this converges and cannot run away:
    docs/design/scheduler.md ("The target").

    slo: seconds; percentile: in (0, 100); start: the first target (seconds, clamped to the bounds); low: the
    lowest target (seconds).
    """

    def __init__(self, slo: float, percentile: float, start: float, low: float) -> None:
        if not 0 < percentile < 100:
            raise ValueError(f"percentile={percentile!r} must be in (0, 100)")
        self.slo = slo
        self.low = min(low, slo)
        self.high = slo
        self.target = min(max(start, self.low), self.high)
        self.window = math.ceil(TAIL_SAMPLES / (1 - percentile / 100) - 1e-9)
        self.rank = max(1, round(self.window * (1 - percentile / 100)))
        self.aim = slo * (1 - DEADBAND)
        self._steps: list[float] = []

    def observe(self, step_time: float) -> None:
        """Add one measured step time (seconds); at the end of a window, move the target."""
        self._steps.append(step_time)
        if len(self._steps) < self.window:
            return
        tail = heapq.nlargest(self.rank, self._steps)[-1]
        self._steps.clear()
        error = math.log(self.aim / tail)
        if abs(error) <= DEADBAND:
            return
        change = min(max(GAIN * error, -MAX_STEP_DOWN), MAX_STEP_UP)
        self.target = min(max(self.target * math.exp(change), self.low), self.high)


class TokenBudget:
    """Chooses each iteration's prefill token budget from ``predictor`` so the step meets ``config.tbt_slo``.

    config: a ``SchedulerConfig`` with ``chunk_size="auto"`` (its ``tbt_slo``, ``tbt_percentile``,
    ``budget_safety``, ``min_chunk_size``, ``block_size``, ``max_num_batched_tokens`` apply). predictor: see the
    module docstring. ``correction`` (dimensionless, starts at 1, the typical ``measured / predicted``) and,
    with ``tbt_percentile`` set, ``spread`` (at least 1: how far above the typical step the percentile runs)
    multiply every prediction, and ``between`` (seconds, at least 0: what a decode waits beyond the step) is
    added to it; ``target`` (seconds) is the most a corrected predicted step may take: ``tbt_slo *
    budget_safety`` at first, then, with ``tbt_percentile`` set, what ``controller`` makes of the measured steps
    (fixed when it is ``None``).
    """

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor) -> None:
        if config.chunk_size != "auto":
            raise ValueError(f"chunk_size={config.chunk_size!r}: a TokenBudget needs chunk_size='auto'")
        if not callable(getattr(predictor, "predict_step_time", None)):
            raise ValueError(f"predictor={predictor!r} has no predict_step_time(SchedulerOutput) method")
        self.predictor = predictor
        self.grain = math.gcd(config.block_size, STEP_GRAIN)
        start = config.tbt_slo * config.budget_safety
        self.controller = None if config.tbt_percentile is None else TailController(
            config.tbt_slo, config.tbt_percentile, start, config.tbt_slo * min(TARGET_FLOOR, config.budget_safety))
        self._target = start
        self.min_grains = math.ceil(config.min_chunk_size / self.grain)
        self.max_tokens = config.max_num_batched_tokens
        self.correction = 1.0
        self._log_correction = 0.0
        self.percentile = config.tbt_percentile
        self.spread = 1.0
        self.between = 0.0
        self._residuals: deque[float] = deque(maxlen=SPREAD_WINDOW)  # log(measured / (predicted * correction))
        self._betweens: deque[float] = deque(maxlen=SPREAD_WINDOW)  # gap - measured, seconds
        self._decodes: deque[tuple[int, int]] = deque(maxlen=SHARE_WINDOW)  # (decode tokens, of them in sized steps)
        self._decodes_all = self._decodes_sized = 0
        self._last_end: float | None = None  # when the last observed step ended (its decodes' previous token)

    @property
    def target(self) -> float:
        """Seconds a corrected predicted step may take now."""
        return self._target if self.controller is None else self.controller.target

    # ------------------------------------------------------------------ choosing the budget

    def predict(self, out: SchedulerOutput) -> float:
        """Corrected predicted seconds of the iteration ``out`` (with ``tbt_percentile``: its decodes' gap at
        that percentile)."""
        return self.corrected(self.predictor.predict_step_time(out))

    def corrected(self, predicted: float) -> float:
        """An uncorrected prediction (seconds) corrected: ``predicted * correction * spread + between``."""
        return predicted * self.correction * self.spread + self.between

    def prefill_tokens(self, out: SchedulerOutput, candidates: Sequence[tuple[Request, int]],
                       seat_bound: bool = False) -> int:
        """Prefill tokens the iteration ``out`` (its decodes already scheduled) may add: as many as make the
        step's tokens (``out``'s and these) the largest multiple of ``grain`` (``STEP_GRAIN``) whose predicted
        step fits the target, as a fixed ``chunk_size`` of that many tokens would; at least ``min_chunk_size``
        (rounded up to whole grains) when ``candidates`` is not empty, 0 when it is.

        Whole-grain steps, not whole-grain prefill: every step a fixed chunk size C (a block multiple, or a
        multiple of 16) runs is then a candidate here too, so the budget never takes fewer tokens than the
        largest fixed size whose step fits; and a model whose step time jumps at tile boundaries (GPU kernels, in
        128-token tiles) is filled to a boundary, not a grain short of it with the decodes' odd count left over.

        candidates: ``(request, most tokens its chunk may take)`` for the prompts that would take the prefill
        tokens, in the order the policy fills them. seat_bound: more requests wait than seats are free (see
        ``SEAT_BOUND_SHARE``); the step near the largest is then weighed by the prefill tokens per second it adds
        to the decodes' own step, not by all its tokens per second. Without it, the pass keeps every prompt the
        largest fitting step finishes (``EFFICIENCY_LOOKBACK``).
        """
        if not candidates:
            return 0
        g, used = self.grain, out.num_batched_tokens
        wanted = sum(n for _, n in candidates)
        floor = g * self.min_grains
        lo = -(-(used + floor) // g)  # the fewest whole grains in a step with the floor's prefill
        hi = max(lo, min(self.max_tokens, used + wanted + g - 1) // g)
        target = self.target
        seen: dict[int, float] = {}

        def cost(k: int) -> float:
            if k not in seen:
                seen[k] = self.predict(self._trial(out, candidates, k * g - used))
            return seen[k]

        k = largest_fitting(cost, lo, hi, target, target * (1 + DIP_TOLERANCE))
        if cost(k) > target:
            return floor
        if seat_bound and out.num_decode_tokens:
            low = max(lo, k - math.ceil(k * SEAT_BOUND_SHARE))
            return most_efficient(cost, low, k, target, g, SEAT_BOUND_GRAIN, self.predict(out), used) * g - used
        # weighing all tokens per second, no smaller step that cuts a prompt the largest step finishes
        keep = max(lo, -(-(used + finished_prefix(candidates, k * g - used)) // g))
        return most_efficient(cost, max(keep, k - -(-EFFICIENCY_LOOKBACK // g)), k, target, g) * g - used

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

    # ------------------------------------------------------------------ online correction and target

    def observe(self, predicted: float, measured: float, gap: float | None = None) -> None:
        """Fold one iteration's uncorrected ``predicted`` and ``measured`` step times (seconds) into the
        correction and, with ``percentile`` set, into the spread, and ``gap`` (seconds from the previous step's
        end to this one's, what its decodes waited; ``None``: not known, or no decode waited) into ``between``.
        Raises ``ValueError`` unless each is positive and finite."""
        for name, value in (("predicted", predicted), ("measured", measured), ("gap", gap)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive, finite step time in seconds")
        lo, hi = (math.log(b) for b in CORRECTION_RANGE)
        ratio = min(max(math.log(measured / predicted), lo), hi)
        if self.percentile is not None:  # against the correction this step was planned with
            self._residuals.append(ratio - self._log_correction)
            self.spread = max(1.0, math.exp(self._tail(self._residuals)))
            if gap is not None:
                self._betweens.append(min(max(gap - measured, 0.0), measured))
                self.between = self._tail(self._betweens)
            if len(self._residuals) == SPREAD_MIN_STEPS and self.controller is not None:
                self.controller.target = max(self.controller.target, self.controller.aim)  # the spread is the room
        self._log_correction += CORRECTION_WEIGHT * (ratio - self._log_correction)
        self.correction = math.exp(self._log_correction)

    @property
    def tail_percentile(self) -> float:
        """The percentile of the sized steps' spread and ``between`` that keeps the ``percentile``-th percentile
        of *all* decode gaps within the SLO: a step without prefill is not sized and its gap stays short, so
        when the sized steps hold a share ``f`` of the decode tokens (over the last ``SHARE_WINDOW`` steps with
        decodes), ``(100 - percentile) / f`` percent of their gaps may run over (at P99 with half the tokens in
        sized steps: their P98). At least ``TAIL_PERCENTILE_FLOOR``, at most ``percentile``."""
        if not self._decodes_sized:
            return self.percentile
        share = self._decodes_sized / self._decodes_all
        return min(self.percentile, max(TAIL_PERCENTILE_FLOOR, 100 - (100 - self.percentile) / share))

    def _count_decodes(self, out: SchedulerOutput) -> None:
        """Add ``out``'s decode tokens to the window the sized steps' share is counted over."""
        if len(self._decodes) == self._decodes.maxlen:
            old_all, old_sized = self._decodes[0]
            self._decodes_all -= old_all
            self._decodes_sized -= old_sized
        n = out.num_decode_tokens
        sized = n if out.num_prefill_tokens else 0
        self._decodes.append((n, sized))
        self._decodes_all += n
        self._decodes_sized += sized

    def _tail(self, window: deque[float]) -> float:
        """The ``tail_percentile``-th percentile (nearest rank) of ``window``; 0 until it holds
        ``SPREAD_MIN_STEPS``."""
        n = len(window)
        if n < SPREAD_MIN_STEPS:
            return 0.0
        rank = max(1, n - math.ceil(self.tail_percentile / 100 * n) + 1)  # from the top
        return heapq.nlargest(rank, window)[-1]

    def observe_output(self, out: SchedulerOutput, measured: float, end: float | None = None) -> float | None:
        """``observe`` the iteration ``out`` that took ``measured`` seconds if it had prefill tokens (the steps
        the budget sizes), and hand its decodes' TBT gap to the ``controller`` when the budget sized that step:
        it had decodes and prefill, and was predicted within the target (not a step the minimum chunk or the
        decodes alone pushed over it, whose time no target changes).

        end: when the step ended, in seconds on the caller's clock (any, if the same every call). The gap from
        the previous observed step's end is what a decode in ``out`` waited for its token (``measured`` plus the
        host's time between steps); it is used only for a step with decodes, and ``measured`` stands in for it
        when ``end`` is not given (or did not advance). Returns that gap (``None`` when unknown)."""
        last, self._last_end = self._last_end, end
        gap = end - last if end is not None and last is not None and end > last else None
        if self.percentile is not None and out.num_decode_tokens:
            self._count_decodes(out)
        if out.num_prefill_tokens == 0:
            return gap
        predicted = self.predictor.predict_step_time(out)
        sized = out.num_decode_tokens > 0 and self.corrected(predicted) <= self.target * (1 + 1e-9)
        tbt = gap if gap is not None and out.num_decode_tokens > 0 else None
        self.observe(predicted, measured, tbt)
        if sized and self.controller is not None:
            self.controller.observe(measured if tbt is None else tbt)
        return gap


def finished_prefix(candidates: Sequence[tuple[Request, int]], budget: int) -> int:
    """Of ``budget`` prefill tokens given to ``candidates`` in order (``(request, most tokens its chunk may
    take)``), the tokens up to the end of the last chunk that finishes its prompt (0 when none does)."""
    given = done = 0
    for req, n in candidates:
        if given + n > budget:
            break
        given += n
        if req.num_computed_tokens + n == req.num_tokens:
            done = given
    return done


def most_efficient(cost: Callable[[int], float], lo: int, hi: int, target: float, unit: int,
                   grain: int = EFFICIENCY_GRAIN, base: float = 0.0, used: int = 0) -> int:
    """Of the step of ``hi`` units of ``unit`` tokens (``cost(hi) <= target``) and those of ``lo``..``hi - 1``
    units whose tokens are a multiple of ``grain``, the one that fits ``target`` with the most tokens beyond
    ``used`` per predicted second beyond ``base``; the largest of equals.

    With ``base`` and ``used`` 0 that is the most tokens per predicted second: a step just past a GPU tile
    boundary pays for the whole tile and moves fewer tokens per second than the boundary's step, which the
    largest fitting step alone cannot see; where the step time grows no faster than its tokens (an affine cost,
    the CPU), the largest fitting step is the most efficient and is kept. With ``base`` the predicted seconds of
    the step's ``used`` decode tokens alone, it is the most prefill tokens per second they add to it: the
    measure when the decodes' step runs anyway (``SEAT_BOUND_SHARE``). A step that adds no time is taken
    first."""
    def rate(k: int) -> float:
        extra = cost(k) - base
        return (k * unit - used) / extra if extra > 0 else math.inf

    best, best_rate = hi, rate(hi)
    for k in range(hi - 1, lo - 1, -1):
        if k * unit % grain:
            continue
        if cost(k) <= target and (r := rate(k)) > best_rate:
            best, best_rate = k, r
    return best


def largest_fitting(cost: Callable[[int], float], lo: int, hi: int, target: float, bound: float) -> int:
    """The largest ``k`` in ``[lo, hi]`` with ``cost(k) <= target``, or ``lo`` when none fits.

    ``cost`` need not grow with ``k``: it is exact whenever ``cost`` never falls by more than ``bound - target``
    beyond a point (``cost(j) > bound`` for some ``j`` then means nothing above ``j`` fits) and at most
    ``MAX_SCAN`` candidates above the binary search's answer cost between ``target`` and ``bound``; otherwise
    it returns a fitting ``k`` (or ``lo``), never one that does not fit. A binary search (``cost <= target``:
    go up, else down; ``cost > bound`` also marks everything above out) then a scan upward from its answer to
    the lowest point marked out, stopping at the first cost over ``bound``. About ``log2(hi - lo) + 2``
    evaluations where ``cost`` rises steeply near ``target``, ``MAX_SCAN`` more at most.
    """
    if lo >= hi:
        return lo
    seen: dict[int, float] = {hi: cost(hi)}
    if seen[hi] <= target:
        return hi
    out = hi if seen[hi] > bound else hi + 1  # the lowest k known to put everything from k up out of reach
    best, top = lo, hi - 1
    while best < top:
        mid = (best + top + 1) // 2
        seen[mid] = c = cost(mid)
        if c <= target:
            best = mid
        else:
            top = mid - 1
            if c > bound:
                out = min(out, mid)
    found = best
    for k in range(best + 1, min(out, best + 1 + MAX_SCAN)):
        c = seen[k] if k in seen else cost(k)
        if c > bound:
            break
        if c <= target:
            found = k
    return found
