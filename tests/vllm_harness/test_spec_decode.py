"""Speculative decoding under the plugin, on vLLM's own scheduler code with synthetic draft tokens (the harness's
drafter; placeholders under async scheduling): each decode's drafts are counted in the step's token budget and in
the ``"auto"`` budget's predicted step time, no decode is left out of a step that schedules prefill, the tokens
equal vLLM's default scheduler's, and finished and aborted requests give every KV block back."""

from __future__ import annotations

import pytest
import vllm

from sarathi_lite.costs import ProfiledCostModel, load_cost_model
from sarathi_lite.integrations.vllm.harness import Harness
from sarathi_lite.scheduler import ScheduledRequest, SchedulerOutput

from .conftest import BUDGET, long_tail_stream, run

DRAFTS = 3
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def spec_run(model, scheduler: str, async_scheduling: bool, stream, **kwargs) -> Harness:
    """``run`` with ``DRAFTS`` draft tokens per step; on a release whose async scheduling does not take vLLM's
    n-gram method (0.32), checks that vLLM refuses it, for its own scheduler and the plugin alike, and returns
    ``None``."""
    if async_scheduling and vllm.__version__.startswith("0.32."):
        with pytest.raises(ValueError, match="async scheduling is only supported with"):
            run(model, scheduler, async_scheduling, stream, num_speculative_tokens=DRAFTS, **kwargs)
        return None
    return run(model, scheduler, async_scheduling, stream, num_speculative_tokens=DRAFTS, **kwargs)


@ASYNC
def test_draft_tokens_count_in_the_step_budget_and_no_decode_is_left_out(model, async_scheduling):
    stream = long_tail_stream(1)
    plugin = spec_run(model, "plugin", async_scheduling, stream)
    if plugin is None:
        return
    default = spec_run(model, "default", async_scheduling, stream)
    drafted = [s for s in plugin.steps if s.drafts and s.prefills]
    assert len(drafted) > 5, "no step scheduled draft tokens beside prefill"
    for step in plugin.steps:
        assert sum(step.scheduled.values()) <= BUDGET, (step.index, step.scheduled)
        for rid, n in step.drafts.items():  # a decode runs with all its drafts, in one piece
            assert step.scheduled[rid] == 1 + n, (step.index, rid, step.scheduled[rid], n)
        if step.prefills:
            left_out = set(step.decodes) - set(step.scheduled) - set(step.preempted)
            assert not left_out, (step.index, left_out, step.scheduled)
    # the plan counted each decode's drafts: what vLLM scheduled is what the decision planned, prefill included
    log = [r for r in plugin.scheduler.step_log if r["planned"] is not None]
    assert any(r["drafts"] and set(r["scheduled"]) - set(r["decodes"]) for r in log)
    for record in log:
        planned, scheduled = record["planned"], record["scheduled"]
        # under async scheduling vLLM skips a decode whose step in flight reaches its max_tokens (the plan does
        # not), and the next request in the fill takes its tokens
        skipped = set(planned) - set(scheduled)
        assert all(rid in record["decodes"] and plugin.finish_reasons[rid] == "length" for rid in skipped), record
        if skipped:
            assert sum(scheduled.values()) <= sum(planned.values()), record
        else:
            assert planned == scheduled, record
    # drafts change how many tokens a step emits, never which: the same tokens as vLLM's own scheduler's
    assert plugin.tokens == default.tokens and plugin.finish_reasons == default.finish_reasons
    assert "stop" in plugin.finish_reasons.values() and "length" in plugin.finish_reasons.values()
    assert not plugin.scheduler.requests and plugin.blocks_held() == []
    assert plugin.free_blocks() == plugin.num_blocks - 1


@ASYNC
def test_aborts_and_preemption_with_draft_tokens_leave_the_block_pool_whole(model, async_scheduling):
    if async_scheduling and vllm.__version__.startswith("0.32."):
        with pytest.raises(ValueError, match="async scheduling is only supported with"):
            Harness(model, scheduler="plugin", async_scheduling=True, num_speculative_tokens=DRAFTS)
        return
    num_blocks = 64  # too few for six requests of up to 520 tokens: vLLM must preempt
    harness = Harness(model, scheduler="plugin", async_scheduling=async_scheduling, max_num_batched_tokens=BUDGET,
                      num_blocks=num_blocks, enable_prefix_caching=True, plugin_options={"chunk_size": BUDGET},
                      num_speculative_tokens=DRAFTS)
    for i in range(6):
        harness.add(f"r{i}", 200 + 40 * i, 120)
    drafting = []
    for _ in range(200):
        record = harness.step()
        drafting = [rid for rid in (record.drafts if record else ()) if rid in harness.scheduler.requests]
        if drafting:
            break
    assert drafting, "no decode drafted in 200 steps"
    harness.abort(drafting[:1])  # its drafts in flight (async) or proposed (sync)
    harness.run()
    harness.drain()
    assert any(s.preempted for s in harness.steps), "the pool was large enough: no preemption"
    assert not harness.scheduler.requests and harness.blocks_held() == []
    assert harness.free_blocks() == num_blocks - 1
    assert all(len(tokens) == 120 for rid, tokens in harness.tokens.items() if rid != drafting[0])


def test_the_auto_budget_prices_drafts_as_decode_tokens_of_their_request(model, tmp_path):
    # a step time of its tokens, plus a cost per decode row and per key a decode row reads
    spec = str(ProfiledCostModel([1, 64, 512], [0.010, 0.016, 0.060], {"decode_tokens": 1e-4, "decode_attention": 1e-6},
                                 schedule_per_request=1e-4).save(tmp_path / "profile.json"))
    plugin = spec_run(model, "plugin", False, long_tail_stream(1),
                      plugin_options={"chunk_size": "auto", "tbt_slo": 0.05, "cost_model": spec})
    cost_model = load_cost_model(spec)
    priced = 0
    for record in plugin.scheduler.step_log:
        if not record["drafts"] or record["predicted"] is None:
            continue
        matches = [s for s in plugin.steps if s.scheduled == record["scheduled"]]
        if len(matches) != 1:  # the harness's step of this record is not known (a repeated decode-only step)
            continue
        step = matches[0]
        # each decode's drafts in its row; not counted; in rows of their own
        with_drafts, without, apart = SchedulerOutput(), SchedulerOutput(), SchedulerOutput()
        for rid, n in step.scheduled.items():
            prefill, start, sampled = rid in step.prefills, step.computed[rid], rid in step.sampled
            drafts = step.drafts.get(rid, 0)
            with_drafts.add(ScheduledRequest(rid, start, n, [], [], sampled, prefill))
            for out in (without, apart):
                out.add(ScheduledRequest(rid, start, n - drafts, [], [], sampled, prefill))
            for i in range(drafts):
                apart.add(ScheduledRequest(f"{rid}.{i}", start + 1 + i, 1, [], [], False, False))
        b = record["budget"]
        predicted = [cost_model.predict_step_time(out) * b["correction"] * b["spread"] + b["between"]
                     for out in (with_drafts, without, apart)]
        assert predicted[1] < predicted[0] < predicted[2]
        assert record["predicted"] == pytest.approx(predicted[0], rel=1e-9), (record, predicted)
        priced += 1
    assert priced > 5
