"""``chunk_size="auto"``: the SLO-aware token budget under a synthetic cost model with known linear costs, and its
online correction."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from sarathi_lite.scheduler import (
    Request,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    TokenBudget,
    make_scheduler,
)
from sarathi_lite.scheduler.budget import CORRECTION_RANGE
from sarathi_lite.scheduler.decision import decide_step
from tests.test_scheduler_decision import view

TOKEN = 7


@dataclass
class LinearCost:
    """step time = base + per_decode * decodes + per_context * (decodes' context tokens) + per_prefill * prefill
    tokens (seconds)."""

    base: float = 0.010
    per_decode: float = 0.0004
    per_context: float = 2e-6
    per_prefill: float = 0.00011

    def decode_part(self, out: SchedulerOutput) -> float:
        ctx = sum(s.num_computed_tokens + 1 for s in out.scheduled if not s.is_prefill)
        return self.base + self.per_decode * out.num_decode_tokens + self.per_context * ctx

    def predict_step_time(self, out: SchedulerOutput) -> float:
        return self.decode_part(out) + self.per_prefill * out.num_prefill_tokens


def auto(cost: LinearCost, policy: str = "sarathi", **kwargs: object) -> Scheduler:
    # Prefix caching off: the prompts here share their tokens, and cached ones are not prefill work to budget.
    # A fixed target (tbt_percentile None): these tests check the budget against tbt_slo * budget_safety.
    kwargs = {"tbt_slo": 0.05, "block_size": 16, "max_num_seqs": 64, "num_blocks": 4096, "watermark": 0.0,
              "max_model_len": 2048, "enable_prefix_caching": False, "tbt_percentile": None, **kwargs}
    return make_scheduler(SchedulerConfig(policy=policy, chunk_size="auto", **kwargs), cost)


def step(sched: Scheduler, measured: float | None = None) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, {s.request_id: TOKEN for s in out.scheduled if s.sample})
    if measured is not None:
        sched.observe(out, measured)
    return out


def prefill_waiting(sched: Scheduler) -> int:
    """Prefill tokens the scheduler could run now: prompts mid-prefill, and waiting ones with a free slot."""
    mid = sum(r.num_prefill_tokens - r.num_computed_tokens for r in sched.running if r.is_prefill)
    slots = sched.config.max_running - len(sched.running)
    return mid + sum(r.num_prefill_tokens for r in list(sched.waiting)[:slots])


def random_workload(sched: Scheduler, rng: random.Random, n: int) -> list[tuple[int, Request]]:
    """``n`` requests with random prompt and output lengths, each tagged with the step it arrives at."""
    arrivals = []
    for i in range(n):
        prompt = rng.choice([rng.randint(1, 60), rng.randint(100, 1500)])
        arrivals.append((rng.randint(0, 400), Request(f"r{i}", [5] * prompt, rng.randint(1, 120))))
    return sorted(arrivals, key=lambda a: a[0])


def budget_beside_decodes(cost: object, tbt_slo: float, decodes: int, max_num_batched_tokens: int = 2048
                          ) -> tuple[TokenBudget, SchedulerOutput, Request]:
    """A ``TokenBudget`` at ``tbt_slo`` (no safety margin, 16-token blocks) on ``cost``, a step holding ``decodes``
    decodes at 100 tokens of context, and a 4,000-token prompt to fill it with."""
    config = SchedulerConfig(chunk_size="auto", tbt_slo=tbt_slo, budget_safety=1.0, block_size=16,
                             max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False)
    out = SchedulerOutput()
    for i in range(decodes):
        out.add(ScheduledRequest(f"d{i}", 100, 1, [], [], True, False))
    return TokenBudget(config, cost), out, Request("p", [5] * 4000, 4)


@pytest.mark.parametrize("seed", range(4))
def test_every_step_fits_the_slo_with_the_largest_whole_block_step_and_no_decode_skipped(seed: int) -> None:
    rng = random.Random(seed)
    cost = LinearCost(per_prefill=rng.uniform(5e-5, 2e-4), per_decode=rng.uniform(1e-4, 6e-4))
    sched = auto(cost, tbt_slo=rng.choice([0.04, 0.08, 0.2]), budget_safety=rng.choice([0.8, 0.9, 1.0]),
                 min_chunk_size=rng.choice([16, 32, 64]))
    cfg, bs = sched.config, sched.config.block_size
    target = cfg.tbt_slo * cfg.budget_safety
    min_chunk = math.ceil(cfg.min_chunk_size / bs) * bs
    arrivals = random_workload(sched, rng, 40)
    it = 0
    fitted = 0
    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0][0] <= it:
            sched.add(arrivals.pop(0)[1])
        decoding = {r.request_id for r in sched.running if not r.is_prefill}
        available = prefill_waiting(sched)
        out = step(sched)
        it += 1
        assert it < 5000
        assert decoding <= {s.request_id for s in out.scheduled if not s.is_prefill}  # stall-free
        # The prefill of the largest whole-block step (decodes + prefill, as a fixed chunk size counts) that fits
        # next to these decodes, at least the minimum chunk. A decode is a row of one token that ends the known
        # tokens, a prompt's last token included (the decision's view: it needs exactly one token)
        ones = SchedulerOutput()
        for s in out.scheduled:
            if s.num_new_tokens == 1 and s.sample:
                ones.add(ScheduledRequest(s.request_id, s.num_computed_tokens, 1, [], [], True, False))
        room, d = target - cost.decode_part(ones), ones.num_decode_tokens
        available -= sum(1 for s in out.scheduled if s.is_prefill and s.num_new_tokens == 1 and s.sample)
        first = -(-(d + min_chunk) // bs)
        last = min(cfg.max_num_batched_tokens, d + available + bs - 1) // bs
        fits = [k * bs - d for k in range(first, last + 1) if cost.per_prefill * min(k * bs - d, available) <= room]
        expected = max([min_chunk, *fits])
        if fits and max(fits) < available:
            assert out.num_batched_tokens % bs == 0  # the step is whole blocks
        assert out.num_batched_tokens - d == min(expected, available)
        if available:
            assert out.num_batched_tokens - d >= min(min_chunk, available)  # prefill never starves
        if expected > min_chunk:
            assert cost.predict_step_time(out) <= target
            fitted += 1
    assert fitted > 20


def test_prefill_advances_by_the_minimum_chunk_when_decodes_alone_exceed_the_slo() -> None:
    cost = LinearCost(per_decode=0.01)  # 8 decodes alone: 0.09 s > the 0.05 s SLO
    sched = auto(cost, min_chunk_size=40)  # rounded up to 48 tokens
    for i in range(8):
        sched.add(Request(f"d{i}", [5] * 4, 200))
    step(sched)
    sched.add(Request("long", [5] * 500, 4))
    progress = []
    while sched.requests["long"].is_prefill:
        before = sched.requests["long"].num_computed_tokens
        out = step(sched)
        assert out.num_decodes == 8
        progress.append(sched.requests["long"].num_computed_tokens - before)
    assert progress == [48] * 10 + [20]


def test_simple_chunking_prefill_iterations_fill_the_slo() -> None:
    cost = LinearCost()
    sched = auto(cost, policy="simple_chunking", tbt_slo=0.1, budget_safety=1.0)
    sched.add(Request("a", [5] * 2000, 2))
    out = step(sched)
    # (0.1 - 0.01) / 0.00011 = 818 tokens -> 51 blocks of 16
    assert out.num_prefill_tokens == 816 and cost.predict_step_time(out) <= 0.1


def test_correction_converges_to_a_constant_drift_without_oscillating() -> None:
    budget = TokenBudget(SchedulerConfig(chunk_size="auto", tbt_slo=0.1), LinearCost())
    corrections = []
    for i in range(100):
        predicted = 0.01 + 0.0003 * (i % 7)
        budget.observe(predicted, 1.7 * predicted)
        corrections.append(budget.correction)
    assert all(a < b <= 1.7 for a, b in zip(corrections, corrections[1:]))
    assert corrections[-1] == pytest.approx(1.7, rel=1e-3)
    for _ in range(200):  # the machine speeds up: back down, monotonically
        budget.observe(0.02, 0.5 * 0.02)
        corrections.append(budget.correction)
    assert all(a > b >= 0.5 for a, b in zip(corrections[100:], corrections[101:]))
    assert corrections[-1] == pytest.approx(0.5, rel=1e-3)


def test_correction_is_clamped_and_rejects_bad_times() -> None:
    budget = TokenBudget(SchedulerConfig(chunk_size="auto", tbt_slo=0.1), LinearCost())
    for _ in range(500):
        budget.observe(0.01, 100.0)
    assert budget.correction == pytest.approx(CORRECTION_RANGE[1])
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="measured="):
            budget.observe(0.01, bad)
        with pytest.raises(ValueError, match="predicted="):
            budget.observe(bad, 0.01)


def test_corrected_budget_holds_the_slo_on_a_machine_slower_than_its_model() -> None:
    cost = LinearCost()
    sched = auto(cost, tbt_slo=0.08, budget_safety=1.0, max_num_seqs=32)
    for i in range(16):
        sched.add(Request(f"d{i}", [5] * 8, 400))
    for i in range(40):
        sched.add(Request(f"p{i}", [5] * 600, 2))
    measured = []
    for _ in range(120):
        out = sched.schedule()
        true_time = 1.3 * cost.predict_step_time(out)
        sched.update(out, {s.request_id: TOKEN for s in out.scheduled if s.sample})
        sched.observe(out, true_time)
        measured.append(true_time)
    assert max(measured[:5]) > 0.08  # uncorrected, the model's budget overruns the real step
    assert max(measured[60:]) <= 0.08 * 1.001
    assert sched.budget.correction == pytest.approx(1.3, rel=0.01)


def test_auto_budget_inputs_are_validated() -> None:
    with pytest.raises(ValueError, match="tbt_slo=None"):
        SchedulerConfig(chunk_size="auto")
    with pytest.raises(ValueError, match="tbt_slo=-1"):
        SchedulerConfig(chunk_size="auto", tbt_slo=-1)
    with pytest.raises(ValueError, match="needs a chunked policy"):
        SchedulerConfig(policy="vllm", chunk_size="auto", tbt_slo=0.2)
    with pytest.raises(ValueError, match="budget_safety=1.5"):
        SchedulerConfig(chunk_size="auto", tbt_slo=0.2, budget_safety=1.5)
    with pytest.raises(ValueError, match="chunk_size='big'"):
        SchedulerConfig(chunk_size="big")
    with pytest.raises(ValueError, match="min_chunk_size=0"):
        SchedulerConfig(chunk_size="auto", tbt_slo=0.2, min_chunk_size=0)
    with pytest.raises(ValueError, match="needs a step-time predictor"):
        make_scheduler(SchedulerConfig(chunk_size="auto", tbt_slo=0.2))
    with pytest.raises(ValueError, match="predict_step_time"):
        make_scheduler(SchedulerConfig(chunk_size="auto", tbt_slo=0.2), object())


def test_auto_budget_with_head_of_line_protection_keeps_decodes_and_the_slo_beside_a_long_prompt() -> None:
    cost = LinearCost()
    sched = auto(cost, tbt_slo=0.1, max_model_len=8192, max_num_batched_tokens=2048)
    assert sched.config.protects_short_prompts and sched.config.long_threshold == 2048
    sched.add(Request("long", [5] * 6000, 4))
    for i in range(12):
        sched.add(Request(f"s{i}", [6 + i] * 200, 30))
    target = sched.config.tbt_slo * sched.config.budget_safety
    steps = 0
    while sched.has_unfinished():
        decoding = {r.request_id for r in sched.running if not r.is_prefill}
        out = step(sched)
        steps += 1
        assert steps < 2000
        assert decoding <= {s.request_id for s in out.scheduled if not s.is_prefill}
        assert cost.predict_step_time(out) <= target or out.num_prefill_tokens <= 32
    assert "long" not in sched.requests


@dataclass
class DippingCost:
    """step time = base + per_token * batched tokens, less ``dip`` seconds from ``dip_at`` tokens on: a
    collective that switches to a faster protocol at a size threshold (NCCL's all-reduce does), so a larger
    batch can be predicted faster than a smaller one."""

    base: float = 0.035
    per_token: float = 1.25e-5
    dip_at: int = 1344
    dip: float = 0.002

    def predict_step_time(self, out: SchedulerOutput) -> float:
        t = self.base + self.per_token * out.num_batched_tokens
        return t - self.dip if out.num_batched_tokens >= self.dip_at else t


def test_budget_finds_the_largest_fitting_prefill_when_step_time_is_not_monotone() -> None:
    cost = DippingCost()
    config = SchedulerConfig(chunk_size="auto", tbt_slo=0.05, budget_safety=1.0, block_size=16,
                             max_num_batched_tokens=2048, enable_prefix_caching=False)
    budget = TokenBudget(config, cost)
    prompt = Request("p", [5] * 4000, 4)

    def predicted(tokens: int) -> float:
        return budget.predict(budget._trial(SchedulerOutput([]), [(prompt, 4000)], tokens))

    fits = [k for k in range(16, 2049, 16) if predicted(k) <= 0.05]
    # Below the dip, 1200 tokens fit and 1216-1328 do not; past it, 1344 and 1360 fit again.
    assert max(k for k in fits if k < 1344) == 1200 and max(fits) == 1360
    assert budget.prefill_tokens(SchedulerOutput([]), [(prompt, 4000)]) == 1360


class TileCost:
    """A GPU-like step: 5 ms plus 2 ms per started tile of 128 tokens (decodes and prefill alike)."""

    def predict_step_time(self, out: SchedulerOutput) -> float:
        return 0.005 + 0.002 * math.ceil(out.num_batched_tokens / 128)


def test_the_budget_fills_whole_block_steps_so_no_fixed_chunk_size_that_fits_takes_more_tokens() -> None:
    """42 decodes and a long prompt under a 9.5 ms target: a fixed chunk of 256 tokens (two tiles, 9 ms) fits
    and 257-384 (11 ms) do not; the budget's step is those 256 tokens, not 250 (42 + 13 blocks of prefill) as
    whole-block prefill gave."""
    budget, out, prompt = budget_beside_decodes(TileCost(), 0.0095, 42)
    assert budget.prefill_tokens(out, [(prompt, 4000)]) == 256 - 42


class TiledLinearCost:
    """A GPU-like step with a per-token part: 5 ms, 2 ms per started tile of 128 tokens, 4 us per token."""

    def predict_step_time(self, out: SchedulerOutput) -> float:
        t = out.num_batched_tokens
        return 0.005 + 0.002 * math.ceil(t / 128) + 4e-6 * t


def test_the_budget_keeps_a_tile_boundary_step_when_a_larger_fitting_one_moves_fewer_tokens_per_second() -> None:
    """Under a 12.2 ms target steps of up to 288 tokens fit (288: 12.15 ms), but 257-288 tokens pay for a third
    tile: 256 tokens (10.02 ms) move 25.5 tokens/ms, 288 only 23.7. The budget takes the 256-token step, the most
    tokens per predicted second of the fitting steps of a multiple of 64 tokens within 128 below the largest
    (the largest fitting step alone gave 288)."""
    budget, out, prompt = budget_beside_decodes(TiledLinearCost(), 0.0122, 20)

    def predicted(total: int) -> float:
        return budget.predict(budget._trial(out, [(prompt, 4000)], total - 20))

    fits = [k for k in range(32, 2049, 16) if predicted(k) <= 0.0122]
    assert max(fits) == 288
    best = max((k for k in fits if k == 288 or (k >= 288 - 128 and k % 64 == 0)), key=lambda k: k / predicted(k))
    assert best == 256
    assert budget.prefill_tokens(out, [(prompt, 4000)]) == 256 - 20


def test_the_efficiency_pass_never_cuts_a_prompt_the_largest_fitting_step_finishes() -> None:
    """As above, 288 tokens fit and 256 move the most tokens per second. A 260-token prompt ahead of the long one
    finishes in the 288-token step and is cut in the 256-token one (its first token a whole step later): the
    budget keeps 288. A 200-token prompt finishes in both, and the budget takes 256 again; so does a chunk of a
    long prompt that does not finish it. Seat-bound (every seat taken: the seats' turnover sets the capacity,
    and keeping such prompts cost the simulated seat-bound cells 0.5-0.7%), the staircase's pass still stops at
    1,024 tokens, cutting a 1,100-token prompt that the 1,264-token step finishes."""
    budget, out, prompt = budget_beside_decodes(TiledLinearCost(), 0.0122, 20)
    for need, step_tokens in ((260, 288), (200, 256)):
        short = Request("s", [6] * need, 4)
        assert budget.prefill_tokens(out, [(short, need), (prompt, 4000)]) == step_tokens - 20
    assert budget.prefill_tokens(out, [(prompt, 260), (Request("s", [6] * 200, 4), 200)]) == 256 - 20
    budget, out, prompt = budget_beside_decodes(StaircaseCost(), 0.0815, 64, 4096)
    short = Request("s", [6] * 1100, 4)
    assert budget.prefill_tokens(out, [(short, 1100), (prompt, 4000)]) == 1264 - 64
    assert budget.prefill_tokens(out, [(short, 1100), (prompt, 4000)], seat_bound=True) == 1024 - 64


def test_on_an_affine_cost_the_budget_is_still_the_largest_fitting_step() -> None:
    """Where the step time grows no faster than its tokens, the largest fitting step is also the most efficient
    one, so weighing efficiency changes nothing: the budget is the brute-force largest fitting whole-block step."""
    cost = LinearCost()
    config = SchedulerConfig(chunk_size="auto", tbt_slo=0.05, budget_safety=1.0, block_size=16,
                             max_num_batched_tokens=2048, enable_prefix_caching=False)
    budget = TokenBudget(config, cost)
    prompt = Request("p", [5] * 4000, 4)
    for decodes in (0, 5, 17, 30):
        out = SchedulerOutput()
        for i in range(decodes):
            out.add(ScheduledRequest(f"d{i}", 300, 1, [], [], True, False))
        fits = [k for k in range(16, 2049, 16) if k > decodes and
                budget.predict(budget._trial(out, [(prompt, 4000)], k - decodes)) <= 0.05]
        assert budget.prefill_tokens(out, [(prompt, 4000)]) == max(fits) - decodes


def test_with_128_token_blocks_the_budget_sizes_steps_in_16_token_grains_not_whole_blocks() -> None:
    """vLLM's CPU backend keeps 128-token KV blocks. In whole blocks the largest fitting step beside 5 decodes was
    128 tokens where 240 fit (the next block, 256, does not); in 16-token grains it is the largest fitting
    multiple of 16, and a fixed chunk of 128 or 256 tokens is still a candidate. min_chunk_size rounds up to a
    grain, not a block."""
    cost = LinearCost()
    config = SchedulerConfig(chunk_size="auto", tbt_slo=0.05, budget_safety=1.0, block_size=128,
                             max_num_batched_tokens=2048, enable_prefix_caching=False, min_chunk_size=20)
    budget = TokenBudget(config, cost)
    assert budget.grain == 16 and budget.min_prefill == 32
    prompt = Request("p", [5] * 4000, 4)
    out = SchedulerOutput()
    for i in range(5):
        out.add(ScheduledRequest(f"d{i}", 300, 1, [], [], True, False))

    def fits(total: int) -> bool:
        return budget.predict(budget._trial(out, [(prompt, 4000)], total - 5)) <= 0.05

    largest = max(k for k in range(16, 2049, 16) if fits(k))
    assert largest % 128 and not fits(-(-largest // 128) * 128)  # between two whole-block steps
    assert budget.prefill_tokens(out, [(prompt, 4000)]) == largest - 5
    assert TokenBudget(SchedulerConfig(chunk_size="auto", tbt_slo=0.05, block_size=24, enable_prefix_caching=False,
                                       max_num_batched_tokens=2048), cost).grain == 8  # gcd(24, 16)


class StaircaseCost:
    """A step's decodes cost 30 ms whatever else it holds; prefill adds a 1 ms launch and 40 us a token, and a step
    of more than 1,024 tokens pays 2 ms more (the next tile of a staircase)."""

    def predict_step_time(self, out: SchedulerOutput) -> float:
        total = out.num_prefill_tokens + out.num_decode_tokens
        return (0.030 + (0.001 if out.num_prefill_tokens else 0.0) + 4e-5 * out.num_prefill_tokens
                + (0.002 if total > 1024 else 0.0))


def test_seat_bound_budget_takes_the_step_that_adds_the_most_prefill_per_second_to_the_decodes() -> None:
    """With 64 decodes and a 81.5 ms target, steps of up to 1,264 tokens fit, and the largest moves the most tokens
    per second (15.6 per ms, 1,024 tokens 14.8): without a seat bound the budget takes it. Seat-bound, the 30 ms
    of the decodes run anyway, and 1,024 tokens add 24.4 prefill tokens per added ms against 1,264's 23.5 (the
    2 ms past 1,024 buy 240 tokens), the most of the steps of a multiple of 128 within a third of the largest
    below it (896: 24.3, 1,152: 23.4): the budget takes 1,024."""
    budget, out, prompt = budget_beside_decodes(StaircaseCost(), 0.0815, 64, 4096)
    fits = [k for k in range(80, 4097, 16) if budget.predict(budget._trial(out, [(prompt, 4000)], k - 64)) <= 0.0815]
    assert max(fits) == 1264
    assert budget.prefill_tokens(out, [(prompt, 4000)]) == 1264 - 64
    assert budget.prefill_tokens(out, [(prompt, 4000)], seat_bound=True) == 1024 - 64
    # no decodes: nothing runs anyway, so the step is weighed by all its tokens as without a seat bound
    assert budget.prefill_tokens(SchedulerOutput(), [(prompt, 4000)], seat_bound=True) == \
        budget.prefill_tokens(SchedulerOutput(), [(prompt, 4000)])


def test_scheduler_and_plan_pass_the_seat_bound_when_more_requests_wait_than_seats_are_free() -> None:
    """Two requests decode and one seat of three is free. One waiting prompt: its chunk fills the largest fitting
    step (1,200 tokens). Three waiting: seat-bound, the chunk stops at the 1,024-token step; the plan the vLLM
    plugin applies decides the same."""
    chunks = {}
    for waiting in (1, 3):
        sched = auto(StaircaseCost(), tbt_slo=0.0815, budget_safety=1.0, max_num_seqs=3)
        for i in range(2):
            sched.add(Request(f"r{i}", [5] * 10, 50))
        step(sched)
        for i in range(waiting):
            sched.add(Request(f"w{i}", [5] * 1500, 4))
        plan = decide_step([view(r) for r in sched.running], [view(r) for r in sched.waiting], sched.config,
                         TokenBudget(sched.config, StaircaseCost()))
        out = step(sched)
        assert out.num_decode_tokens == 2
        chunks[waiting] = out.num_prefill_tokens
        assert plan.token_budget == out.num_batched_tokens
    assert chunks == {1: 1200 - 2, 3: 1024 - 2}
