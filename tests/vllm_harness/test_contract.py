"""The plugin's contract with the installed vLLM release, on vLLM's own scheduler code, with async scheduling on
and off: decodes never stall behind a prompt, short prompts beside a long one wait far fewer steps than under vLLM's
default scheduler, the same request stream gives the same tokens and finish reasons, preemption and aborts give
every KV block back, and the options the plugin cannot honour are refused."""

from __future__ import annotations

import statistics

import pytest
import vllm

from sarathi_lite.integrations.vllm.harness import Harness
from sarathi_lite.integrations.vllm.version import adapter

from .conftest import BUDGET, long_tail_stream, run

ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def short_waits(harness: Harness) -> dict[str, int]:
    """Each short prompt that arrived while a long prompt was mid-prefill: the steps from its arrival to the step
    that computes its last prompt token (0: the step it arrived before)."""
    done = harness.prefill_done()
    longs = [rid for rid in harness.prompt_lens if rid.startswith("long")]
    waits = {}
    for rid, arrived in harness.arrived.items():
        if rid.startswith("short") and any(harness.arrived[lg] <= arrived <= done[lg] for lg in longs):
            waits[rid] = done[rid] - arrived
    return waits


@ASYNC
def test_no_running_decode_is_left_out_of_a_step_that_schedules_prefill(model, async_scheduling):
    harness = run(model, "plugin", async_scheduling, long_tail_stream(1))
    prefill_steps = [s for s in harness.steps if s.prefills]
    assert len(prefill_steps) > 10 and any(s.decodes for s in prefill_steps)
    for step in prefill_steps:
        left_out = set(step.decodes) - set(step.scheduled) - set(step.preempted)
        assert not left_out, (step.index, left_out, step.scheduled)


@ASYNC
def test_short_prompts_beside_a_long_prefill_wait_far_fewer_steps_than_under_vllms_default(model,
                                                                                           async_scheduling):
    stream = long_tail_stream(2)
    default = short_waits(run(model, "default", async_scheduling, stream))
    plugin_harness = run(model, "plugin", async_scheduling, stream)
    plugin = short_waits(plugin_harness)
    assert set(plugin) and set(default)
    mean_default, mean_plugin = statistics.mean(default.values()), statistics.mean(plugin.values())
    print(f"vLLM {vllm.__version__} async={async_scheduling}: short prompts beside a long prefill wait "
          f"{mean_default:.2f} steps on mean under the default scheduler, {mean_plugin:.2f} under the plugin")
    assert mean_default >= 2.0  # the stream does make vLLM's default scheduler keep short prompts waiting
    assert mean_plugin * 4 <= mean_default
    # within one step wherever the budget the decodes and the earlier short prompts leave has room for it
    steps, done, lens = plugin_harness.steps, plugin_harness.prefill_done(), plugin_harness.prompt_lens
    for rid, wait in plugin.items():
        arrived = plugin_harness.arrived[rid]
        earlier = sum(lens[o] for o, a in plugin_harness.arrived.items()
                      if o.startswith("short") and o != rid and a <= arrived and done[o] >= arrived)
        room = BUDGET - len(steps[arrived].decodes) - earlier
        if room >= lens[rid]:
            assert wait <= 1, (rid, wait, room)


@ASYNC
def test_tokens_and_finished_outputs_equal_vllms_default_scheduler(model, async_scheduling):
    stream = long_tail_stream(3)
    default = run(model, "default", async_scheduling, stream)
    plugin = run(model, "plugin", async_scheduling, stream)
    assert plugin.finish_reasons == default.finish_reasons
    assert "stop" in default.finish_reasons.values() and "length" in default.finish_reasons.values()
    assert plugin.tokens == default.tokens
    total = sum(map(len, default.tokens.values()))
    assert sum(map(len, plugin.tokens.values())) == total > 0
    # every prompt token computed once: no step scheduled more than the prompts and outputs need
    assert sum(sum(s.scheduled.values()) for s in plugin.steps) == sum(sum(s.scheduled.values())
                                                                       for s in default.steps)


@ASYNC
@pytest.mark.parametrize("policy", ["simple_chunking", "vllm", "orca", "request_level"])
def test_every_policy_decides_inside_vllm_with_the_default_schedulers_outputs_and_its_own_steps(
        model, async_scheduling, policy):
    """Each of our policies through vLLM's loop: the tokens and finish reasons of vLLM's default scheduler, and
    steps of the policy's shape (the unchunked policies on a step budget of the whole context, as they need)."""
    stream = long_tail_stream(4, longs=2, shorts=12)
    chunked = policy == "simple_chunking"
    budget = BUDGET if chunked else 4096
    default = run(model, "default", async_scheduling, stream, max_num_batched_tokens=budget)
    harness = run(model, "plugin", async_scheduling, stream, max_num_batched_tokens=budget,
                  plugin_options={"policy": policy, **({"chunk_size": BUDGET} if chunked else {})})
    assert harness.finish_reasons == default.finish_reasons and harness.tokens == default.tokens
    steps = [s for s in harness.steps if s.scheduled]
    assert not any(s.preempted for s in steps)
    lens = harness.prompt_lens
    mixed = [s for s in steps if s.prefills and set(s.scheduled) - set(s.prefills)]
    if policy == "orca":
        assert mixed, "orca never batched a prompt with decodes"
    else:  # prefill and decodes never share a step
        assert not mixed, (mixed[0].index, mixed[0].scheduled)
    chunks = [(rid, s.scheduled[rid]) for s in steps for rid in s.prefills]
    if chunked:
        assert any(n < lens[rid] for rid, n in chunks), "no prompt was split over steps"
    else:  # whole prompts, each in one step
        assert all(n == lens[rid] for rid, n in chunks), chunks
    if policy == "request_level":  # a new batch only once the last has finished
        assert all(not s.decodes for s in steps if s.prefills)


@ASYNC
@pytest.mark.parametrize("scheduler", ["default", "plugin"])
def test_preemption_and_aborts_mid_prefill_and_mid_decode_leave_the_block_pool_whole(model, async_scheduling,
                                                                                      scheduler):
    num_blocks = 64  # 1,008 tokens of KV for six requests of up to 520: vLLM must preempt
    harness = Harness(model, scheduler=scheduler, async_scheduling=async_scheduling, max_num_batched_tokens=BUDGET,
                      num_blocks=num_blocks, enable_prefix_caching=True,
                      plugin_options={"chunk_size": BUDGET} if scheduler == "plugin" else None)
    for i in range(6):
        harness.add(f"r{i}", 200 + 40 * i, 120)
    for _ in range(10):
        harness.step()
        mid_prefill = [r.request_id for r in harness.scheduler.running
                       if 0 < r.num_computed_tokens < r.num_prompt_tokens]
        if mid_prefill:
            break
    assert mid_prefill, "no prompt mid-prefill in ten steps"
    harness.abort(mid_prefill[:1])
    for _ in range(200):
        harness.step()
        decoding = [r.request_id for r in harness.scheduler.running if r.num_output_tokens >= 3
                    and r.request_id not in mid_prefill[:1]]
        if decoding:
            break
    harness.abort(decoding[:1])
    harness.run()
    harness.drain()
    assert any(s.preempted for s in harness.steps), "the pool was large enough: no preemption"
    assert not harness.scheduler.requests
    assert harness.blocks_held() == []
    assert harness.free_blocks() == num_blocks - 1
    aborted = set(mid_prefill[:1]) | set(decoding[:1])
    assert {rid for rid, why in harness.finish_reasons.items() if why == "abort"} == aborted
    for rid, tokens in harness.tokens.items():
        if rid not in aborted:
            assert len(tokens) == 120


def test_without_async_scheduling_a_second_batch_in_flight_does_not_schedule_a_decode_before_its_token(model):
    # two batches in flight with async scheduling off (pipeline parallelism): vLLM's synchronous Scheduler waits for
    # a decode's sampled token, which the model runner takes as input, before it schedules the decode again
    harness = Harness(model, scheduler="plugin", max_num_batched_tokens=100, num_blocks=11, block_size=16,
                      plugin_options={"chunk_size": 100})
    harness.add("first", 80, 4)
    first = harness.scheduler.schedule()
    assert dict(first.num_scheduled_tokens) == {"first": 80}
    harness.add("second", 80, 4)
    second = harness.scheduler.schedule()  # the first batch's output not processed yet
    assert dict(second.num_scheduled_tokens) == {"second": 80}


def test_the_plugins_options_and_this_releases_conflicting_settings_are_refused(model):
    with pytest.raises(ValueError, match="chunk_size=512"):
        Harness(model, scheduler="plugin", plugin_options={"chunk_size": 512})  # above max_num_batched_tokens 256
    with pytest.raises(ValueError, match="'chunk'"):
        Harness(model, scheduler="plugin", plugin_options={"chunk": 64})
    conflicts = adapter(vllm.__version__).CONFLICTS
    assert conflicts
    for conflict in conflicts:
        value = (not conflict.neutral) if isinstance(conflict.neutral, bool) else conflict.neutral + 4
        with pytest.raises(ValueError, match=conflict.flag):
            Harness(model, scheduler="plugin", long_prefill_token_threshold=64, **{conflict.field: value})
        Harness(model, scheduler="default", long_prefill_token_threshold=64, **{conflict.field: value})  # vLLM's own


def test_vllms_scheduler_on_the_simulated_clock_matches_our_vllm_v1_policy_step_by_step():
    from sarathi_lite.bench.workload import Workload
    from sarathi_lite.costs import load_cost_model
    from sarathi_lite.integrations.vllm.simclock import replay_vllm_v1, run_on_clock

    workload = Workload.from_trace("conversation", num_requests=40, qps=8.0)
    cost_model = load_cost_model("roofline:h100:llama3-8b")  # calibrated on measured H100 timings
    result, harness, config = run_on_clock(workload, cost_model, label="vllm", chunk_size=128, max_num_seqs=16,
                                           long_prefill_token_threshold=48)
    summary = result.stats.summary()
    assert summary["num_requests"] == 40 and summary["output_tokens"] == sum(r.output_len for r in workload.requests)
    assert result.config["vllm_version"] == vllm.__version__ and summary["duration"] > 0
    steps = replay_vllm_v1(harness, config)
    differ = [(i, ours, theirs) for i, ours, theirs in steps if ours != theirs]
    print(f"vLLM {vllm.__version__} against our vllm_v1 policy: {len(steps) - len(differ)} of {len(steps)} steps "
          f"with the same token counts; first differences {differ[:3]}")
    assert len(steps) > 100 and any(48 in theirs.values() for _, _, theirs in steps)  # the cap was exercised
    assert not differ


def test_the_plugins_auto_budget_learns_the_simulated_step_times_and_holds_the_slo():
    """On the simulated clock the plugin's step timer reads simulated time: its "auto" budget, told the H100 model
    while the clock runs the slower A100 one, learns the A100's step times (its correction is their ratio) and
    keeps the time between tokens within the SLO; timed by the wall clock it would learn the simulation's own
    Python time instead."""
    import math

    from sarathi_lite.bench.workload import Workload
    from sarathi_lite.costs import load_cost_model
    from sarathi_lite.integrations.vllm.simclock import rows, run_on_clock

    told, clock = load_cost_model("roofline:h100:llama3-8b"), load_cost_model("roofline:a100-80gb:llama3-8b")
    workload = Workload.from_trace("arxiv", num_requests=60, qps=4.0)
    options = {"chunk_size": "auto", "tbt_slo": 0.1, "cost_model": "roofline:h100:llama3-8b"}
    result, harness, _ = run_on_clock(workload, clock, label="plugin", chunk_size=8192, max_num_seqs=64,
                                      scheduler="plugin", plugin_options=options)
    budget = harness.scheduler.budget
    prefill_steps = [rows(r) for r in harness.steps if r.scheduled and r.prefills]
    ratios = sorted(clock.predict_step_time(o) / told.predict_step_time(o) for o in prefill_steps[-40:])
    assert ratios[0] > 1.2  # the A100 is slower: a budget that did not learn it would overrun the SLO
    assert abs(math.log(budget.correction) - math.log(ratios[len(ratios) // 2])) < 0.1
    measured = [r["measured"] for r in harness.scheduler.step_log if r["measured"] is not None]
    assert measured and min(measured) > 0.005  # simulated steps, not the microseconds of Python between calls
    summary = result.stats.summary()
    assert summary["output_tokens"] == sum(r.output_len for r in workload.requests)
    assert summary["tbt_p99"] <= 0.1
