"""The ``"auto"`` token budget (``chunk_size="auto"``): each step's prefill tokens chosen from a step-time model.

A fixed ``chunk_size`` must be sized for the worst step (many decodes over long contexts), so it is too small in
every other one. ``TokenBudget`` instead asks a predictor, every step, how long the step would take with more
prefill tokens, and gives the step the most that keep it within ``target`` seconds.

**What it predicts.** ``predict_step_time(out)``: the seconds from a step's start to its end for a trial batch,
the step's decodes (scheduled first, as with a fixed budget) plus prefill chunks for the prompts that would take
the tokens, in the order the policy fills them. The simulator's profiled, roofline and calibrated cost models
are such predictors.

**How it picks the tokens** (``prefill_tokens``). Steps are counted in grains of ``gcd(block_size,
STEP_GRAIN)`` tokens, decodes included, as a fixed ``chunk_size`` counts them, so every step a fixed size runs
is a candidate. ``largest_fitting`` finds the largest step whose prediction fits (the step time need not grow
with its tokens); ``most_efficient`` may take a slightly smaller one that moves more tokens per second (a GPU
step just past a tile boundary pays for the whole tile). Never less than ``min_chunk_size`` while a prompt
waits (prompts never starve under a decode-heavy load), never more than ``max_num_batched_tokens``.

**What it corrects**, after each step with prefill (the steps it sizes; a decode-only step's time is mostly
fixed overheads and says little about them), from the measured time that ``observe_output`` is given. A
prediction becomes ``predicted * correction * spread + between``, compared with ``target``:

1. ``correction``: the typical ``measured / predicted``, so a model profiled on a quieter machine still holds
   the SLO (a real CPU host ran 1.5-3.7x its profile).
2. ``spread`` (with ``tbt_percentile``): a high percentile of ``measured / (predicted * correction)``, so a
   step planned at the target runs over it no more often than the percentile allows (inside vLLM, steps
   scattered to 1.39x their corrected prediction).
3. ``between`` (with ``tbt_percentile``): the same percentile of the host's seconds between two steps, which a
   decode waits for too (its TBT is the gap between steps, not the step). Added, not a ratio: it is about the
   same for every step size.
4. ``tail_percentile``: the percentile 2. and 3. are taken at. Steps without prefill are not sized and stay
   short, so when the sized steps hold a share ``f`` of the decode tokens, ``(100 - tbt_percentile) / f``
   percent of their gaps may run over.
5. ``TailController`` (with ``tbt_percentile``): moves ``target`` from ``tbt_slo * budget_safety`` toward just
   under ``tbt_slo`` so that the measured percentile of the sized steps' gaps meets the SLO, for what the
   ratios do not show; it starts from its aim once the spread is measured (the spread is then the room).

Why each exists and what it gains, measured: docs/design/scheduler.md ("The token budget") and
docs/results/auto_budget.md, docs/results/one_decision.md. Torch-free, like the whole scheduler.
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

# --- the search for a step's tokens
STEP_GRAIN = 16
"""Steps grow in ``gcd(block_size, STEP_GRAIN)`` tokens: whole 16-token KV blocks (ours and vLLM's GPU default);
16 tokens under vLLM's CPU blocks of 128, where whole blocks made steps jump between 128 and 256 tokens and a step
that fitted at 200 was planned at 128 (docs/results/vllm_plugin.md)."""
DIP_TOLERANCE = 0.05
"""How far (a fraction of the target) a step's predicted time may fall as its tokens grow while
``largest_fitting`` stays exact: a step predicted above ``target * (1 + DIP_TOLERANCE)`` proves no larger one
fits. Measured all-reduce tables dip by about 2% of a step."""
MAX_SCAN = 16
"""Most steps ``largest_fitting`` tries one by one above its binary search's answer (where the time dips)."""
EFFICIENCY_LOOKBACK, EFFICIENCY_GRAIN = 128, 64
"""``most_efficient`` weighs the steps up to ``EFFICIENCY_LOOKBACK`` tokens below the largest fitting one whose
tokens are a multiple of ``EFFICIENCY_GRAIN`` (GPU matmul tiles are 64 or 128 tokens): at most two more
predictions. It never cuts a prompt the largest step finishes (that prompt's first token would wait a step)."""
SEAT_BOUND_SHARE, SEAT_BOUND_GRAIN = 1 / 3, 128
"""When more requests wait than seats are free (the seats' turnover sets the capacity), ``most_efficient`` weighs
the steps of a multiple of ``SEAT_BOUND_GRAIN`` tokens down to ``SEAT_BOUND_SHARE`` below the largest by the
prefill tokens per second they add to the decodes' own step, and may cut a prompt: the rule above lost 0.5-0.7%
of capacity on the seat-bound simulated cells (docs/results/auto_budget.md). A share, not a width, so a step near
a memory-bound knee does not find its prefill almost free far below the largest."""

# --- the corrections of the prediction
CORRECTION_WEIGHT = 0.1
"""Weight of the newest ``log(measured / predicted)`` in the correction's moving average (settles in ~20 steps)."""
CORRECTION_RANGE = (0.25, 4.0)
"""Bounds of one observed ``measured / predicted`` and of the correction: one wild step cannot swing it."""
SPREAD_WINDOW = 256
"""Sized steps whose ratios the ``spread`` (and whose host time ``between``) is a percentile of."""
SPREAD_MIN_STEPS = 16
"""Sized steps measured before the spread and ``between`` are used (1 and 0 until then)."""
SHARE_WINDOW = 1024
"""Steps with decodes over which the sized steps' share of decode tokens (``tail_percentile``) is counted."""
TAIL_PERCENTILE_FLOOR = 90.0
"""The lowest ``tail_percentile``, however few decode tokens the sized steps hold."""

# --- the target (TailController); why it converges: docs/design/scheduler.md ("The target")
TARGET_FLOOR = 0.5
"""The lowest target, a fraction of ``tbt_slo`` (``budget_safety`` if lower)."""
TAIL_SAMPLES = 5
"""Steps over the percentile per window: a window holds ``TAIL_SAMPLES / (1 - percentile/100)`` steps (500 at
P99) and its percentile is its ``TAIL_SAMPLES``-th longest, a stable estimate."""
DEADBAND = 0.01
"""The controller aims at ``tbt_slo * (1 - DEADBAND)`` and holds within ``exp(+-DEADBAND)`` of it (about
``[0.98, 1.0] * tbt_slo``), so a window's estimation noise does not make it chatter."""
GAIN = 0.5
"""Fraction of a window's log error ``log(aim / percentile)`` corrected per window: approaches without overshoot."""
MAX_STEP_UP, MAX_STEP_DOWN = math.log(1.05), math.log(1.2)
"""Largest change of ``log(target)`` per window: up 5%, down 20% (a tail over the SLO is fixed faster than room
under it is taken)."""


class StepTimePredictor(Protocol):
    def predict_step_time(self, out: SchedulerOutput) -> float:
        """Seconds one iteration running ``out`` takes, from its start to its end (deterministic)."""
        ...


def ceil_div(tokens: int, grain: int) -> int:
    """Whole grains of ``grain`` tokens that hold ``tokens``."""
    return -(-tokens // grain)


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


class TailController:
    """Moves a per-step target (seconds) so that the ``percentile``-th percentile of measured step times meets
    ``slo``: every ``window`` steps (windows do not overlap, so each sees one target) ``log(target)`` moves by
    ``GAIN * log(aim / window's percentile)`` unless within ``DEADBAND``, by at most ``MAX_STEP_UP`` /
    ``MAX_STEP_DOWN``, inside ``[low, slo]``.

    slo: seconds; percentile: in (0, 100); start: the first target (seconds, clamped to the bounds); low: the
    lowest target (seconds).
    """

    def __init__(self, slo: float, percentile: float, start: float, low: float) -> None:
        if not 0 < percentile < 100:
            raise ValueError(f"percentile={percentile!r} must be in (0, 100)")
        self.slo = slo
        self.low = min(low, slo)
        self.high = slo
        self.target = _clamp(start, self.low, self.high)
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
        change = _clamp(GAIN * error, -MAX_STEP_DOWN, MAX_STEP_UP)
        self.target = _clamp(self.target * math.exp(change), self.low, self.high)


class TokenBudget:
    """Chooses each iteration's prefill tokens from ``predictor`` so the step meets ``config.tbt_slo``.

    config: a ``SchedulerConfig`` with ``chunk_size="auto"`` (its ``tbt_slo``, ``tbt_percentile``,
    ``budget_safety``, ``min_chunk_size``, ``block_size``, ``max_num_batched_tokens`` apply). predictor: see the
    module docstring. ``correction``, ``spread`` (dimensionless, 1 at first) and ``between`` (seconds, 0 at
    first) are the module docstring's corrections; ``target`` (seconds) is the most a corrected prediction may
    take: ``tbt_slo * budget_safety``, moved by ``controller`` when ``tbt_percentile`` is set.
    """

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor) -> None:
        if config.chunk_size != "auto":
            raise ValueError(f"chunk_size={config.chunk_size!r}: a TokenBudget needs chunk_size='auto'")
        if not callable(getattr(predictor, "predict_step_time", None)):
            raise ValueError(f"predictor={predictor!r} has no predict_step_time(SchedulerOutput) method")
        self.predictor = predictor
        self.grain = math.gcd(config.block_size, STEP_GRAIN)
        self.min_prefill = self.grain * ceil_div(config.min_chunk_size, self.grain)
        self.max_tokens = config.max_num_batched_tokens
        start = config.tbt_slo * config.budget_safety
        self.controller = None if config.tbt_percentile is None else TailController(
            config.tbt_slo, config.tbt_percentile, start, config.tbt_slo * min(TARGET_FLOOR, config.budget_safety))
        self._fixed_target = start
        self.percentile = config.tbt_percentile
        self.correction = 1.0
        self._log_correction = 0.0
        self.spread = 1.0
        self.between = 0.0
        self._ratios: deque[float] = deque(maxlen=SPREAD_WINDOW)  # log(measured / (predicted * correction))
        self._host_times: deque[float] = deque(maxlen=SPREAD_WINDOW)  # gap - measured, seconds
        self._decodes: deque[tuple[int, int]] = deque(maxlen=SHARE_WINDOW)  # (decode tokens, of them in sized steps)
        self._decodes_all = self._decodes_sized = 0
        self._last_end: float | None = None  # when the last observed step ended (its decodes' previous token)

    @property
    def target(self) -> float:
        """Seconds a corrected predicted step may take now."""
        return self._fixed_target if self.controller is None else self.controller.target

    # ------------------------------------------------------------------ choosing the tokens

    def predict(self, out: SchedulerOutput) -> float:
        """Corrected predicted seconds of the iteration ``out`` (with ``tbt_percentile``: its decodes' gap at
        that percentile)."""
        return self.corrected(self.predictor.predict_step_time(out))

    def corrected(self, predicted: float) -> float:
        """An uncorrected prediction (seconds) corrected: ``predicted * correction * spread + between``."""
        return predicted * self.correction * self.spread + self.between

    def prefill_tokens(self, out: SchedulerOutput, candidates: Sequence[tuple[Request, int]],
                       seat_bound: bool = False) -> int:
        """Prefill tokens the iteration ``out`` (its decodes already scheduled) may add: those of the step of
        whole grains (``out``'s tokens and these) that ``largest_fitting`` and then ``most_efficient`` pick; at
        least ``min_chunk_size`` (in whole grains) when ``candidates`` is not empty, 0 when it is.

        candidates: ``(request, most tokens its chunk may take)`` for the prompts that would take the prefill
        tokens, in the order the policy fills them. seat_bound: more requests wait than seats are free
        (``SEAT_BOUND_SHARE``).
        """
        if not candidates:
            return 0
        grain, decode_tokens = self.grain, out.num_batched_tokens
        wanted = decode_tokens + sum(n for _, n in candidates)
        fewest = ceil_div(decode_tokens + self.min_prefill, grain)  # step sizes, in grains
        most = max(fewest, min(self.max_tokens // grain, ceil_div(wanted, grain)))
        predicted: dict[int, float] = {}

        def step_time(grains: int) -> float:
            """Corrected predicted seconds of the step of ``grains`` grains."""
            if grains not in predicted:
                predicted[grains] = self.predict(self._trial(out, candidates, grains * grain - decode_tokens))
            return predicted[grains]

        target = self.target
        largest = largest_fitting(step_time, fewest, most, target, target * (1 + DIP_TOLERANCE))
        if step_time(largest) > target:
            return self.min_prefill
        if seat_bound and out.num_decode_tokens:  # prefill per second added to the decodes' own step
            smallest = max(fewest, largest - math.ceil(largest * SEAT_BOUND_SHARE))
            best = most_efficient(step_time, smallest, largest, target, grain, SEAT_BOUND_GRAIN,
                                  self.predict(out), decode_tokens)
        else:  # all tokens per second, keeping every prompt the largest step finishes
            finishing = ceil_div(decode_tokens + finished_prefix(candidates, largest * grain - decode_tokens), grain)
            smallest = max(fewest, finishing, largest - ceil_div(EFFICIENCY_LOOKBACK, grain))
            best = most_efficient(step_time, smallest, largest, target, grain)
        return best * grain - decode_tokens

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

    # ------------------------------------------------------------------ the corrections and the target

    def observe_output(self, out: SchedulerOutput, measured: float, end: float | None = None) -> float | None:
        """Learn from the iteration ``out`` that took ``measured`` seconds, if it had prefill tokens: ``observe``
        it, and give its decodes' gap to the ``controller`` if the budget sized it (decodes and prefill,
        predicted within the target: a step the minimum chunk or the decodes alone pushed over it is one no
        target changes).

        end: when the step ended, in seconds on the caller's clock (any, if the same every call). The gap since
        the previous observed step's end is what a decode in ``out`` waited for its token; ``measured`` stands
        in for it when ``end`` is not given (or did not advance). Returns that gap (``None`` when unknown)."""
        last, self._last_end = self._last_end, end
        gap = end - last if end is not None and last is not None and end > last else None
        if self.percentile is not None and out.num_decode_tokens:
            self._count_decodes(out)
        if out.num_prefill_tokens == 0:
            return gap
        predicted = self.predictor.predict_step_time(out)
        sized = out.num_decode_tokens > 0 and self.corrected(predicted) <= self.target * (1 + 1e-9)
        decode_gap = gap if gap is not None and out.num_decode_tokens > 0 else None
        self.observe(predicted, measured, decode_gap)
        if sized and self.controller is not None:
            self.controller.observe(measured if decode_gap is None else decode_gap)
        return gap

    def observe(self, predicted: float, measured: float, gap: float | None = None) -> None:
        """Fold one step's uncorrected ``predicted`` and ``measured`` times (seconds) into the correction and,
        with ``percentile`` set, the spread, and its decodes' ``gap`` (seconds since the previous step's end;
        ``None``: unknown, or no decode waited) into ``between``. Raises ``ValueError`` unless each is positive
        and finite."""
        for name, value in (("predicted", predicted), ("measured", measured), ("gap", gap)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive, finite step time in seconds")
        ratio = _clamp(math.log(measured / predicted), *(math.log(b) for b in CORRECTION_RANGE))
        if self.percentile is not None:
            self._ratios.append(ratio - self._log_correction)  # against the correction this step was planned with
            self.spread = max(1.0, math.exp(self._tail(self._ratios)))
            if gap is not None:
                self._host_times.append(_clamp(gap - measured, 0.0, measured))
                self.between = self._tail(self._host_times)
            if len(self._ratios) == SPREAD_MIN_STEPS and self.controller is not None:
                self.controller.target = max(self.controller.target, self.controller.aim)  # the spread is the room
        self._log_correction += CORRECTION_WEIGHT * (ratio - self._log_correction)
        self.correction = math.exp(self._log_correction)

    @property
    def tail_percentile(self) -> float:
        """The percentile of the sized steps' ratios and host times (``spread``, ``between``) that keeps the
        ``percentile``-th percentile of *all* decode gaps within the SLO: when the sized steps hold a share ``f``
        of the decode tokens (last ``SHARE_WINDOW`` steps with decodes), ``100 - (100 - percentile) / f`` (at
        P99 with half the tokens in sized steps: P98), at least ``TAIL_PERCENTILE_FLOOR``."""
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
        rank_from_top = max(1, n - math.ceil(self.tail_percentile / 100 * n) + 1)
        return heapq.nlargest(rank_from_top, window)[-1]


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


def most_efficient(step_time: Callable[[int], float], smallest: int, largest: int, target: float, unit: int,
                   grain: int = EFFICIENCY_GRAIN, base: float = 0.0, used: int = 0) -> int:
    """Of the step of ``largest`` units of ``unit`` tokens (``step_time(largest) <= target``) and those of
    ``smallest``..``largest - 1`` units whose tokens are a multiple of ``grain``, the one that fits ``target``
    with the most tokens beyond ``used`` per predicted second beyond ``base``; the largest of equals.

    With ``base`` and ``used`` 0 that is the most tokens per second: a step just past a GPU tile boundary pays
    for the whole tile and moves fewer tokens per second than the boundary's step; where the step time grows no
    faster than its tokens (an affine cost, the CPU) the largest step is kept. With ``base`` the predicted
    seconds of the ``used`` decode tokens alone, it is the most prefill tokens per second added to the decodes'
    step (``SEAT_BOUND_SHARE``). A step that adds no time is taken first."""
    def rate(units: int) -> float:
        extra = step_time(units) - base
        return (units * unit - used) / extra if extra > 0 else math.inf

    best, best_rate = largest, rate(largest)
    for units in range(largest - 1, smallest - 1, -1):
        if units * unit % grain:
            continue
        if step_time(units) <= target and (r := rate(units)) > best_rate:
            best, best_rate = units, r
    return best


def largest_fitting(cost: Callable[[int], float], low: int, high: int, target: float, bound: float) -> int:
    """The largest ``n`` in ``[low, high]`` with ``cost(n) <= target``, or ``low`` when none fits.

    ``cost`` need not grow with ``n``: the answer is exact whenever ``cost`` never falls by more than ``bound -
    target`` beyond a point (``cost(j) > bound`` then means nothing above ``j`` fits) and at most ``MAX_SCAN``
    steps above the binary search's answer cost between ``target`` and ``bound``; otherwise it is a fitting
    ``n`` (or ``low``), never one that does not fit. A binary search (fits: go up, else down; over ``bound``:
    nothing above fits either), then a scan upward from its answer, stopping at the first cost over ``bound``.
    About ``log2(high - low) + 2`` evaluations, ``MAX_SCAN`` more at most.
    """
    if low >= high:
        return low
    costs: dict[int, float] = {high: cost(high)}
    if costs[high] <= target:
        return high
    out_of_reach = high if costs[high] > bound else high + 1  # the lowest n known to put all from n up out of reach
    fits, top = low, high - 1
    while fits < top:
        mid = (fits + top + 1) // 2
        costs[mid] = c = cost(mid)
        if c <= target:
            fits = mid
        else:
            top = mid - 1
            if c > bound:
                out_of_reach = min(out_of_reach, mid)
    found = fits
    for n in range(fits + 1, min(out_of_reach, fits + 1 + MAX_SCAN)):
        c = costs[n] if n in costs else cost(n)
        if c > bound:
            break
        if c <= target:
            found = n
    return found
