"""The step decision over a read-only view (``sarathi_lite.scheduler.decision``), which the vLLM plugin applies: it
makes the same batches as our own scheduler where the two rules coincide, and each claim holds on its own."""

from __future__ import annotations

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
from sarathi_lite.scheduler.decision import RequestView, decide_step, fill, long_share


def view(req: Request) -> RequestView:
    """The read-only view of our scheduler's ``req`` that ``decide_step`` decides from."""
    return RequestView(req.request_id, req.num_computed_tokens, req.num_tokens, len(req.prompt_token_ids), req.seq)


@pytest.mark.parametrize("seed", range(6))
def test_plan_makes_our_schedulers_fcfs_batches_on_random_workloads(seed):
    """Without head-of-line protection or prefix caching, and with KV to spare, the plan (decodes first, then
    prompts in arrival order, under chunk_size) gives every request the tokens our sarathi scheduler does."""
    rng = random.Random(seed)
    config = SchedulerConfig(policy="sarathi", chunk_size=rng.choice([16, 32, 64]), max_num_seqs=8,
                             hol_protection=False, enable_prefix_caching=False, block_size=8, num_blocks=4096,
                             max_model_len=1024)
    sched = make_scheduler(config)
    pending = [Request(f"r{i}", [1] * rng.randint(1, 200), max_tokens=rng.randint(1, 12)) for i in range(30)]
    steps = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add(pending.pop(0))
        plan = decide_step([view(r) for r in sched.running], [view(r) for r in sched.waiting], config)
        out = sched.schedule()
        assert plan.tokens == {s.request_id: s.num_new_tokens for s in out.scheduled}, steps
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.sample})
        steps += 1
    assert steps > 20


def test_decodes_come_first_and_all_of_them_even_beyond_the_chunk_size():
    config = SchedulerConfig(chunk_size=4, max_num_seqs=16, hol_protection=False)
    prefill = RequestView("p", 0, 50, 50, 0)
    decodes = [RequestView(f"d{i}", 10, 11, 10, i + 1) for i in range(6)]
    plan = decide_step([prefill, *decodes], [], config)
    assert plan.running == ["p", *[d.request_id for d in decodes]][1:] + ["p"]
    assert plan.token_budget == 6 and plan.tokens == {d.request_id: 1 for d in decodes}
    plan = decide_step([prefill, *decodes[:2]], [], config)
    assert plan.tokens == {"d0": 1, "d1": 1, "p": 2}


def test_short_prompt_beside_a_long_prefill_gets_the_budget_the_long_share_leaves():
    config = SchedulerConfig(chunk_size=64, max_num_seqs=16)  # long: above 4 chunks (256 tokens)
    long = RequestView("long", 64, 1000, 1000, 0)
    short = RequestView("short", 0, 20, 20, 1)
    decode = RequestView("d", 30, 31, 30, 2)
    plan = decide_step([long, decode], [short], config)
    assert long_share(63, 936) == 31  # half the step's prefill (63 tokens beside a decode)
    assert long_share(63, 20) == 20  # or what the long prompts still need
    # the long prompt gets what the short one leaves, more than its share
    assert plan.long_cap == 43 and plan.tokens == {"d": 1, "long": 43, "short": 20}
    # short prompts that need more than the budget less the share: the long prompts are held to their share
    # (in a step after one they were held out of: see the next test)
    crowd = [RequestView(f"s{i}", 0, 30, 30, i + 1) for i in range(3)]
    plan = decide_step([long, decode], crowd, config, just_held=["long"])
    assert plan.long_cap == 31 and plan.tokens == {"d": 1, "long": 31, "s0": 30, "s1": 2}
    # nobody to protect: the long prompt takes the whole budget left
    assert decide_step([long, decode], [], config).tokens == {"d": 1, "long": 63}


def test_a_short_prompt_the_cap_would_cut_finishes_in_this_step_with_the_long_prompt_held_out_of_it():
    config = SchedulerConfig(chunk_size=64, max_num_seqs=16)  # long: above 256 tokens; share 31 of 63
    long = RequestView("long", 64, 1000, 1000, 0)
    decode = RequestView("d", 30, 31, 30, 2)
    short = RequestView("short", 0, 40, 40, 1)
    plan = decide_step([long, decode], [short], config)
    # one cap for every request: max(share 31, 63 - 40) = 31 would cut the short prompt to 31 of its 40 tokens
    assert plan.held == ["long"] and plan.long_cap is None
    assert plan.tokens == {"d": 1, "short": 40}
    assert plan.running == ["d", "long"]  # held out of the step, it keeps its place (and its seat)
    # never two steps running: with the long prompt held in the previous step, the cap splits the short one
    again = decide_step([long, decode], [short], config, just_held=["long"])
    assert again.held == [] and again.long_cap == 31 and again.tokens == {"d": 1, "long": 31, "short": 31}
    # short prompts that would not all finish even without the long one: held too, the oldest finishes now and
    # the next fills the budget (under the cap the long prompt and the first short one would get 31, the next 1)
    crowd = decide_step([long, decode], [short, RequestView("s2", 0, 40, 40, 3)], config)
    assert crowd.held == ["long"] and crowd.tokens == {"d": 1, "short": 40, "s2": 23}
    # only the short prompts with a seat count: one seat left, the short prompt in it finishes
    seated = decide_step([long, decode], [short, RequestView("s2", 0, 40, 40, 3)],
                       SchedulerConfig(chunk_size=64, max_num_seqs=3))
    assert seated.held == ["long"] and seated.tokens == {"d": 1, "short": 40}
    # a short prompt the cap does not cut: the long prompt takes what it leaves, as before
    small = decide_step([long, decode], [RequestView("s", 0, 20, 20, 1)], config)
    assert small.held == [] and small.tokens == {"d": 1, "long": 43, "s": 20}


def test_no_cap_cuts_a_short_prompt_where_the_long_prompt_gets_its_tokens_without_one():
    # a long prompt's last chunk beside a short prompt: the cap max(share 10, 63 - 50) = 13 binds no long prompt,
    # and would cut the short one to 13 tokens, or hold the long one out of a step it would have finished in
    config = SchedulerConfig(chunk_size=64, max_num_seqs=16)  # long: above 256 tokens
    long = RequestView("long", 990, 1000, 1000, 0)  # 10 tokens left
    decode = RequestView("d", 30, 31, 30, 2)
    for just_held in ((), ["long"]):
        plan = decide_step([long, decode], [RequestView("short", 0, 50, 50, 1)], config, just_held=just_held)
        assert plan.held == [] and plan.long_cap is None
        assert plan.tokens == {"d": 1, "long": 10, "short": 50}
    # a prompt that finishes in this step is long no more: beside a short prompt one token too long for the step
    # it is neither capped nor held (it finishes now, the short prompt takes the rest and finishes next step)
    bigger = RequestView("short", 0, 54, 54, 1)
    for just_held in ((), ["long"]):
        plan = decide_step([long, decode], [bigger], config, just_held=just_held)
        assert plan.held == [] and plan.long_cap is None
        assert plan.tokens == {"d": 1, "long": 10, "short": 53}
    # still long with more than a step's prefill left, beside a short prompt mid-prefill that would take its share
    # without a cap: in the step after it was held the long prompt keeps its share (31) as the one cap, which cuts
    # the short prompt too (the price of one cap for every request, paid one step in two)
    longer = RequestView("long", 900, 1000, 1000, 0)
    running_short = RequestView("s", 20, 200, 200, 1)
    plan = decide_step([longer, running_short, decode], [], config, just_held=["long"])
    assert plan.long_cap == 31 and plan.tokens == {"d": 1, "s": 31, "long": 31}
    assert decide_step([longer, running_short, decode], [], config).held == ["long"]


def test_waiting_short_prompts_are_admitted_before_an_earlier_long_one():
    config = SchedulerConfig(chunk_size=64, max_num_seqs=16)
    waiting = [RequestView("long", 0, 900, 900, 0), RequestView("s1", 0, 10, 10, 1), RequestView("s2", 0, 30, 30, 2)]
    plan = decide_step([], waiting, config)
    assert plan.waiting == ["s1", "s2", "long"]
    assert plan.tokens == {"s1": 10, "s2": 30, "long": 24}
    off = decide_step([], waiting, SchedulerConfig(chunk_size=64, max_num_seqs=16, hol_protection=False))
    assert off.waiting == ["long", "s1", "s2"] and off.tokens == {"long": 64}


class PerTokenCost:
    """A step time of 10 ms plus 0.1 ms per token."""

    def predict_step_time(self, out) -> float:
        return 0.010 + 1e-4 * out.num_batched_tokens


def test_auto_budget_plans_the_largest_step_within_the_target():
    config = SchedulerConfig(chunk_size="auto", tbt_slo=0.05, budget_safety=1.0, block_size=16,
                             max_num_batched_tokens=2048, max_num_seqs=64, hol_protection=False)
    budget = TokenBudget(config, PerTokenCost())
    decodes = [RequestView(f"d{i}", 100, 101, 100, i) for i in range(40)]
    plan = decide_step(decodes, [RequestView("p", 0, 5000, 5000, 99)], config, budget)
    assert plan.predicted_step_time <= 0.05
    prefill = plan.tokens["p"]
    # the step (decodes and prefill) is whole blocks, and one more block would not fit
    assert (40 + prefill) % 16 == 0 and 0.010 + 1e-4 * (40 + prefill + 16) > 0.05
    assert plan.token_budget == 40 + prefill


def test_under_auto_the_long_share_inside_vllm_is_taken_from_the_cap_not_the_step():
    # one cap for every request of vLLM's loop: the long prompt keeps half the step's prefill beside short prompts
    # that want more (a quarter of the step measured worse inside vLLM: docs/results/hol_protection.md)
    config = SchedulerConfig(chunk_size="auto", tbt_slo=0.06, budget_safety=1.0, block_size=16,
                             max_num_batched_tokens=2048, max_num_seqs=64)
    budget = TokenBudget(config, PerTokenCost())
    long = RequestView("long", 496, 5000, 5000, 0)  # long under "auto": above max_num_batched_tokens
    shorts = [RequestView(f"s{i}", 0, 200, 200, i + 1) for i in range(3)]
    plan = decide_step([long], shorts, config, budget, just_held=["long"])  # not held again (see decide_step)
    assert plan.token_budget == 496 and plan.long_cap == 248
    assert plan.tokens == {"long": 248, "s0": 200, "s1": 48}


class ContextCost:
    """A step time of 10 ms, 0.1 ms per token and 0.05 us per query x key pair of a prompt chunk (about this CPU's
    profile's ratio): a long prompt's tokens deep in its prefill cost twice a fresh short prompt's."""

    def predict_step_time(self, out) -> float:
        pairs = sum(s.num_new_tokens * (s.num_computed_tokens + s.num_new_tokens) for s in out.scheduled
                    if s.is_prefill)
        return 0.010 + 1e-4 * out.num_batched_tokens + 5e-8 * pairs


def largest_step(rows, target, grain=16):
    """The most tokens (whole grains) of a step giving ``rows`` ((start, most tokens), in order, a decode being
    (start, 1)) their tokens greedily whose ``ContextCost`` fits ``target``: brute force."""
    best = 0
    for k in range(grain, 2048 + 1, grain):
        out, left = SchedulerOutput(), k
        for i, (start, most) in enumerate(rows):
            n = min(most, left)
            if n > 0:
                out.add(ScheduledRequest(f"r{i}", start, n, [], [], True, most > 1))
                left -= n
        if ContextCost().predict_step_time(out) <= target:
            best = k
    return best


def test_under_auto_a_short_prompt_beside_a_long_prefill_is_sized_at_its_own_cost_and_finishes_in_the_step():
    # the step is sized on the tokens in the order they are given (the short prompt's whole need first, the long
    # prompt the rest), not as if the long prompt, deep in its prefill, took them all at twice the cost:
    # the step that was sized so took 154 of a 168-token short prompt inside vLLM, which then took a second step
    config = SchedulerConfig(chunk_size="auto", tbt_slo=0.2, budget_safety=1.0, block_size=16,
                             max_num_batched_tokens=2048, max_num_seqs=64)
    budget = TokenBudget(config, ContextCost())
    long = RequestView("long", 2400, 5000, 5000, 0)  # long under "auto": above max_num_batched_tokens
    decode = RequestView("d", 50, 51, 50, 1)
    short = RequestView("short", 0, 168, 168, 2)
    plan = decide_step([long, decode], [short], config, budget)
    assert plan.held == [] and plan.tokens["short"] == 168 and plan.tokens["d"] == 1
    # the step fits (the efficiency pass may take a step up to 128 tokens below the largest fitting one, with the
    # short prompt's tokens given first: design/scheduler.md)
    step = largest_step([(50, 1), (0, 168), (2400, 2600)], 0.2)
    assert step - 128 <= plan.token_budget <= step and plan.tokens["long"] == plan.token_budget - 169
    assert plan.predicted_step_time <= 0.2


def test_under_auto_a_step_that_holds_the_long_prompt_out_is_sized_again_for_the_short_ones():
    config = SchedulerConfig(chunk_size="auto", tbt_slo=0.07, budget_safety=1.0, block_size=16,
                             max_num_batched_tokens=2048, max_num_seqs=64)
    budget = TokenBudget(config, ContextCost())
    long = RequestView("long", 2400, 5000, 5000, 0)
    decode = RequestView("d", 50, 51, 50, 1)
    shorts = [RequestView(f"s{i}", 0, 150, 150, 2 + i) for i in range(2)]
    plan = decide_step([long, decode], shorts, config, budget)
    # the 300 short tokens fit the step, but not beside the long prompt's share: the long prompt is held out and
    # the step holds the two short prompts whole, as many tokens as fit with them alone
    assert plan.held == ["long"] and plan.tokens == {"d": 1, "s0": 150, "s1": 150}
    assert plan.token_budget == min(largest_step([(50, 1), (0, 150), (0, 150)], 0.07), 16 * -(-301 // 16))
    assert plan.predicted_step_time <= 0.07


def test_fill_respects_seats_cap_and_budget():
    views = [RequestView(f"r{i}", 0, 50, 50, i) for i in range(5)]
    assert fill(views[:1], views[1:], 120, 30, max_running=3) == {"r0": 30, "r1": 30, "r2": 30}
    assert fill([], views, 70, None) == {"r0": 50, "r1": 20}


def test_vllm_v1_policy_fills_running_in_list_order_under_vllms_cap():
    """vLLM's rule by hand: running requests in list order (a prompt mid-prefill before a later decode), each
    capped at long_prefill_token_threshold, then waiting ones on what is left."""
    config = SchedulerConfig(policy="vllm_v1", chunk_size=64, max_num_seqs=8, block_size=8, num_blocks=256,
                             long_prefill_token_threshold=40, enable_prefix_caching=False)
    sched = make_scheduler(config)
    sched.add(Request("d", [3] * 5, max_tokens=10))
    out = sched.schedule()
    sched.update(out, {"d": 7})  # d decodes from now on
    sched.add(Request("p", [3] * 100, max_tokens=4))
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("d", 1), ("p", 40)]
    sched.update(out, {"d": 7})
    sched.add(Request("w", [3] * 10, max_tokens=4))
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("d", 1), ("p", 40), ("w", 10)]


def test_the_simulator_runs_vllms_rule_beside_sarathi():
    from sarathi_lite.bench.workload import Workload
    from sarathi_lite.costs import load_cost_model
    from sarathi_lite.sim.simulator import run

    wl = Workload.from_trace("conversation", num_requests=40, qps=4.0)
    results = run(wl, load_cost_model("roofline:h100:llama3-8b"), policies=["vllm_v1", "sarathi"],
                  chunk_sizes=[512])
    summaries = {r.config["policy"]: r.summary() for r in results}
    assert set(summaries) == {"vllm_v1", "sarathi"}
    assert all(s["num_requests"] == 40 for s in summaries.values())
