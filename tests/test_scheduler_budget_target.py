"""``chunk_size="auto"``: the target that follows the stated TBT percentile (``TailController``), and the search
for the largest fitting budget when step times are not monotone in the tokens (``largest_fitting``)."""

from __future__ import annotations

import math
import random

import pytest

from sarathi_lite.scheduler import (
    Request,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
    TokenBudget,
    make_scheduler,
)
from sarathi_lite.scheduler.budget import (
    DEADBAND,
    DIP_TOLERANCE,
    MAX_SCAN,
    MAX_STEP_DOWN,
    MAX_STEP_UP,
    SPREAD_MIN_STEPS,
    TailController,
    largest_fitting,
)

from .test_scheduler_budget import TOKEN, LinearCost

SLO = 0.05


def run_controller(ctl: TailController, noise: random.Random, spread: float, windows: int) -> list[float]:
    """Feed ``windows`` windows of steps that fill the target, each ``target * uniform(1 - spread, 1 + spread)``
    seconds; returns the target after each window."""
    targets = []
    for _ in range(windows):
        for _ in range(ctl.window):
            ctl.observe(ctl.target * noise.uniform(1 - spread, 1 + spread))
        targets.append(ctl.target)
    return targets


@pytest.mark.parametrize("start", [0.5, 0.9, 1.0])
def test_target_converges_so_the_p99_step_meets_the_slo_and_stays_inside_its_bounds(start: float) -> None:
    ctl = TailController(SLO, 99.0, start * SLO, 0.5 * SLO)
    assert ctl.window == 500 and ctl.rank == 5
    targets = run_controller(ctl, random.Random(0), 0.2, 60)
    assert all(0.5 * SLO <= t <= SLO for t in targets)
    # steps up to 1.2x their target: the P99 step (about 1.196x) should sit just under the SLO
    expected = SLO * (1 - DEADBAND) / 1.196
    assert targets[-1] == pytest.approx(expected, rel=0.03)
    assert all(t == pytest.approx(expected, rel=0.03) for t in targets[20:])
    steps = [math.log(b / a) for a, b in zip([start * SLO, *targets], targets)]
    assert all(-MAX_STEP_DOWN - 1e-12 <= s <= MAX_STEP_UP + 1e-12 for s in steps)


def test_exact_steps_lift_the_target_monotonically_into_the_band_under_the_slo_and_hold_it() -> None:
    ctl = TailController(SLO, 99.0, 0.9 * SLO, 0.5 * SLO)
    targets = run_controller(ctl, random.Random(0), 0.0, 30)
    assert all(a <= b for a, b in zip(targets, targets[1:]))  # no overshoot, no oscillation
    assert 0.98 * SLO <= targets[-1] <= SLO
    assert len(set(targets[10:])) == 1  # held inside the deadband


def test_a_tail_the_target_does_not_move_leaves_it_at_a_bound() -> None:
    """Steps over the SLO whatever the target (decodes alone too slow): the target falls to its floor and stays;
    steps far under it: it rises to the SLO and stays. Never beyond either."""
    down = TailController(SLO, 99.0, 0.9 * SLO, 0.5 * SLO)
    up = TailController(SLO, 99.0, 0.9 * SLO, 0.5 * SLO)
    lows, highs = [], []
    for _ in range(40):
        for _ in range(down.window):
            down.observe(2 * SLO)
            up.observe(0.1 * SLO)
        lows.append(down.target)
        highs.append(up.target)
    assert min(lows) == lows[-1] == pytest.approx(0.5 * SLO) and max(highs) == highs[-1] == pytest.approx(SLO)


def test_the_budget_learns_a_noisy_machine_and_holds_its_p99_step_under_the_slo() -> None:
    """Closed loop through the scheduler: the real step is 1.3x the model times a spread of +-15%; the
    correction learns the 1.3, the spread the +15% of the P99 step over the typical one, and the controller
    holds the target just under the SLO, so the P99 measured step sits just under the SLO."""
    cost = LinearCost()
    config = SchedulerConfig(chunk_size="auto", tbt_slo=SLO, tbt_percentile=99.0, block_size=16, max_num_seqs=32,
                             num_blocks=8192, max_model_len=2048, enable_prefix_caching=False)
    sched = make_scheduler(config, cost)
    rng = random.Random(1)
    for i in range(16):
        sched.add(Request(f"d{i}", [5] * 8, 100000))
    measured, targets = [], []
    for i in range(8000):
        if len(sched.waiting) < 4:
            sched.add(Request(f"p{i}", [5] * 800, 2))
        out = sched.schedule()
        true_time = 1.3 * cost.predict_step_time(out) * rng.uniform(0.85, 1.15)
        sched.update(out, {s.request_id: TOKEN for s in out.scheduled if s.sample})
        sched.observe(out, true_time)
        measured.append(true_time)
        targets.append(sched.budget.target)
    assert all(config.tbt_slo * 0.5 <= t <= config.tbt_slo for t in targets)
    assert sched.budget.correction == pytest.approx(1.3, rel=0.05)
    late = sorted(measured[4000:])
    p99 = late[int(0.99 * len(late))]
    assert 0.95 * SLO <= p99 <= SLO
    # the +15% over the typical step, and the correction's own wobble (a 10%-weighted average of noisy ratios)
    assert 1.13 <= sched.budget.spread <= 1.25
    assert targets[-1] > 0.9 * SLO  # above budget_safety's fixed 0.9: the measured spread is the room


def test_no_percentile_keeps_the_fixed_target() -> None:
    config = SchedulerConfig(chunk_size="auto", tbt_slo=SLO, budget_safety=0.8, tbt_percentile=None)
    budget = TokenBudget(config, LinearCost())
    assert budget.controller is None and budget.target == pytest.approx(0.8 * SLO)
    with pytest.raises(ValueError, match="tbt_percentile=100"):
        SchedulerConfig(chunk_size="auto", tbt_slo=SLO, tbt_percentile=100)


def piecewise(knots: list[tuple[int, float]]):
    """Linear between ``(k, seconds)`` knots (``k`` ascending)."""
    def cost(k: int) -> float:
        for (k0, y0), (k1, y1) in zip(knots, knots[1:]):
            if k <= k1:
                return y0 + (y1 - y0) * (k - k0) / (k1 - k0)
        return knots[-1][1]
    return cost


@pytest.mark.parametrize("seed", range(20))
def test_search_matches_brute_force_on_step_times_that_dip_within_the_tolerance(seed: int) -> None:
    """Random rising step-time curves with dips of up to ``DIP_TOLERANCE`` of the target (an all-reduce table's
    protocol switches), every target: the largest fitting candidate, as a scan of every candidate finds it."""
    rng = random.Random(seed)
    knots, k, y = [], 2, 0.01
    while k < 128:
        knots.append((k, y))
        k += rng.randint(4, 24)
        y += rng.uniform(0.0005, 0.006)
    knots.append((128, y))
    checked = 0
    for _ in range(40):
        target = rng.uniform(0.012, y)
        dipped = [(k, t - rng.uniform(0, DIP_TOLERANCE * target) * (rng.random() < 0.4)) for k, t in knots]
        cost = piecewise(dipped)
        if any(cost(j) - cost(i) < -DIP_TOLERANCE * target for i in range(2, 129) for j in range(i, 129)):
            continue  # a deeper fall than the tolerance allows
        brute = max([k for k in range(2, 129) if cost(k) <= target] or [2])
        band = [k for k in range(brute + 1, 129) if target < cost(k) <= target * (1 + DIP_TOLERANCE)]
        if len(band) > MAX_SCAN:
            continue
        assert largest_fitting(cost, 2, 128, target, target * (1 + DIP_TOLERANCE)) == brute
        checked += 1
    assert checked >= 30


def test_search_never_returns_a_budget_that_does_not_fit() -> None:
    rng = random.Random(7)
    for _ in range(300):
        values = [rng.uniform(0.0, 1.0) for _ in range(129)]  # no shape at all
        found = largest_fitting(values.__getitem__, 2, 128, 0.3, 0.33)
        assert found == 2 or values[found] <= 0.3


def rows(decodes: int, prefill: int) -> SchedulerOutput:
    """A step of ``decodes`` decodes (context 100) and one ``prefill``-token chunk (none if 0)."""
    out = SchedulerOutput()
    for i in range(decodes):
        out.add(ScheduledRequest(f"d{i}", 100, 1, [], [], True, False))
    if prefill:
        out.add(ScheduledRequest("p", 0, prefill, [], [], False, True))
    return out


def test_decode_only_steps_leave_the_correction_and_the_spread_alone() -> None:
    """The budget sizes steps with prefill; a decode-only step (fixed overheads, here measured 10x its
    prediction) must not move the prediction of the steps it sizes."""
    cost = LinearCost()
    budget = TokenBudget(SchedulerConfig(chunk_size="auto", tbt_slo=SLO, tbt_percentile=99.0), cost)
    decode_only = rows(8, 0)
    for _ in range(100):
        budget.observe_output(decode_only, 10 * cost.predict_step_time(decode_only))
    assert budget.correction == 1.0 and budget.spread == 1.0
    mixed = rows(8, 64)
    budget.observe_output(mixed, 2 * cost.predict_step_time(mixed))
    assert budget.correction > 1.0


def test_the_spread_is_the_percentile_of_measured_over_the_typical_step() -> None:
    """Every 10th step runs 1.5x the others: at P95 the spread covers it (about 1.5 over the typical step), at
    P80 it does not (about 1); it is 1 until ``SPREAD_MIN_STEPS`` steps are seen and without a percentile."""
    cost = LinearCost()
    step = rows(4, 128)
    predicted = cost.predict_step_time(step)
    spreads = {}
    for pct in (95.0, 80.0, None):
        budget = TokenBudget(SchedulerConfig(chunk_size="auto", tbt_slo=SLO, tbt_percentile=pct), cost)
        for i in range(400):
            if i == SPREAD_MIN_STEPS - 2:
                assert budget.spread == 1.0
            budget.observe_output(step, predicted * (1.5 if i % 10 == 9 else 1.0))
        spreads[pct] = budget.spread
        assert budget.predict(step) == pytest.approx(predicted * budget.correction * budget.spread)
    # the typical step is the correction's (a geometric mean, 1.5 ** 0.1 = 1.04 over the fast steps)
    assert spreads[95.0] == pytest.approx(1.5 / 1.5 ** 0.1, rel=0.03)
    assert spreads[80.0] == 1.0 and spreads[None] == 1.0


def test_the_host_time_between_steps_is_added_and_the_controller_sees_the_decodes_gap() -> None:
    """A step's decodes wait for the step and for the host's time between steps (the simulator's ``step_gap``,
    the engine loop's own work): with that ``gap`` given, ``between`` adds it to every prediction, and neither
    the correction nor the spread (the step's own ratio) moves."""
    cost = LinearCost()
    budget = TokenBudget(SchedulerConfig(chunk_size="auto", tbt_slo=SLO, tbt_percentile=99.0), cost)
    step = rows(4, 128)
    predicted = cost.predict_step_time(step)
    clock = 0.0
    for _ in range(100):  # each step ends its length plus 2 ms after the one before
        clock += predicted + 0.002
        budget.observe_output(step, predicted, end=clock)
    assert budget.correction == pytest.approx(1.0) and budget.spread == pytest.approx(1.0)
    assert budget.between == pytest.approx(0.002)
    assert budget.predict(step) == pytest.approx(predicted + 0.002)
    assert budget.controller._steps[-1] == pytest.approx(predicted + 0.002)  # the gap, not the step
    prefill_only = rows(0, 128)  # no decode waited: its gap is no time between tokens
    budget.observe_output(prefill_only, predicted, end=clock + 3 * predicted)
    assert budget.between == pytest.approx(0.002)


def test_in_closed_loop_the_budget_leaves_room_for_the_host_time_between_steps() -> None:
    """Through the scheduler: every step is followed by 2 ms of host work before the next starts, so a decode's
    gap is the step plus 2 ms. Aiming the step at the SLO alone puts every gap of a full step over it; with the
    gap fed back, the late gaps stay within the SLO and the steps still fill it."""
    cost = LinearCost()
    config = SchedulerConfig(chunk_size="auto", tbt_slo=SLO, tbt_percentile=99.0, block_size=16, max_num_seqs=8,
                             num_blocks=8192, max_model_len=4096, enable_prefix_caching=False)
    sched = make_scheduler(config, cost)  # 8 decodes at most: they alone never fill the SLO
    gaps, clock = [], 0.0
    for i in range(3000):
        if len(sched.waiting) < 4:  # prompts, and decodes of 300 tokens (contexts stay short)
            sched.add(Request(f"p{i}", [5] * 800, 2 if i % 2 else 300))
        out = sched.schedule()
        step = cost.predict_step_time(out)
        sched.update(out, {s.request_id: TOKEN for s in out.scheduled if s.sample})
        clock += step + 0.002
        sched.observe(out, step, clock)
        if out.num_prefill_tokens and out.num_decode_tokens:
            gaps.append(step + 0.002)
    late = sorted(gaps[len(gaps) // 3:])
    assert len(late) > 300 and late[int(0.99 * len(late))] <= SLO
    assert late[len(late) // 2] >= 0.9 * SLO  # the room is the 2 ms, not a fixed fraction


def test_the_spread_is_taken_at_the_percentile_all_decode_gaps_allow() -> None:
    """P99 of all decode gaps: when steps with prefill (the sized ones) hold half the decode tokens, 2% of
    their gaps may run over, so the spread is their P98; with a twentieth, the floor (P90); with all, P99."""
    cost = LinearCost()
    budget = TokenBudget(SchedulerConfig(chunk_size="auto", tbt_slo=SLO, tbt_percentile=99.0), cost)
    assert budget.tail_percentile == 99.0  # nothing counted yet
    sized, decode_only = rows(4, 64), rows(4, 0)
    for _ in range(100):
        budget.observe_output(sized, cost.predict_step_time(sized))
        budget.observe_output(decode_only, cost.predict_step_time(decode_only))
    assert budget.tail_percentile == pytest.approx(98.0)
    for _ in range(2000):  # the window (the last 1,024 steps with decodes) now holds 1 sized in 20
        for _ in range(19):
            budget.observe_output(decode_only, cost.predict_step_time(decode_only))
        budget.observe_output(sized, cost.predict_step_time(sized))
        if budget.tail_percentile == 90.0:
            break
    assert budget.tail_percentile == 90.0
    for _ in range(1100):
        budget.observe_output(sized, cost.predict_step_time(sized))
    assert budget.tail_percentile == 99.0
