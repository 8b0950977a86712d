"""Head-of-line protection (``SchedulerConfig.hol_protection``): short prompts are never stuck behind a long one.

The property test drives workloads built to have long prompts mid-prefill while short ones arrive through the
checking driver of ``test_scheduler_properties`` (every invariant, the plan against the decision function, and the
bound: the oldest waiting short prompt is admitted in the step it is due); the examples below pin the mechanism
(``plan.decide_step``: short prompts first, the long prompts' share as a cap, long prompts held out of a step whose
short prompts the cap would cut).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from sarathi_lite.scheduler import LONG_PROMPT_CHUNKS, SchedulerConfig, make_scheduler
from sarathi_lite.scheduler.config import AUTO_LONG_THRESHOLD

from .test_scheduler_decision import PerTokenCost
from .test_scheduler_policies import D, P, batch, make, req, step
from .test_scheduler_properties import PROPERTY_SETTINGS, VOCAB, RequestSpec, Workload, fake_token, run


@st.composite
def long_context_workloads(draw: st.DrawFn, policy: str) -> Workload:
    """One to three long prompts (many chunks each) among short prompts arriving at random steps, with random
    thresholds, budgets and pools from tight (preemption) to ample."""
    chunk_size = draw(st.integers(2, 24))
    threshold = draw(st.none() | st.integers(1, 24))
    long_above = threshold if threshold is not None else chunk_size
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = 160
    specs = []
    for i in range(draw(st.integers(1, 3))):
        specs.append(RequestSpec(f"long{i}", draw(st.integers(long_above + 1, long_above + 120)),
                                 draw(st.integers(1, 8)), frozenset(), draw(st.integers(0, 6))))
    for i in range(draw(st.integers(1, 10))):
        specs.append(RequestSpec(f"short{i}", draw(st.integers(1, long_above)), draw(st.integers(1, 12)),
                                 draw(st.frozensets(st.integers(0, VOCAB - 1), max_size=1)),
                                 draw(st.integers(0, 40))))
    needs = [-(-max(min(s.prompt_len + s.max_tokens, max_model_len) - 1, s.prompt_len) // block_size)
             for s in specs]
    num_blocks = draw(st.integers(max(needs), max(needs) + sum(needs)))
    config = SchedulerConfig(
        policy=policy, chunk_size=chunk_size, max_num_seqs=draw(st.integers(2, 12)), max_model_len=max_model_len,
        block_size=block_size, num_blocks=num_blocks, watermark=draw(st.sampled_from([0.0, 0.05])),
        long_prefill_token_threshold=threshold, hol_protection=True)
    return Workload(config, tuple(specs))


@pytest.mark.parametrize("policy", ["sarathi", "simple_chunking"])
@PROPERTY_SETTINGS
@given(data=st.data())
def test_no_short_prompt_waits_behind_a_long_one(policy: str, data: st.DataObject) -> None:
    trace = run(data.draw(long_context_workloads(policy)))
    event("head-of-line bound checked" if trace.hol_checks else "head-of-line bound not reached")
    event("preemption" if trace.preemptions else "no preemption")


@st.composite
def one_sided_workloads(draw: st.DrawFn, policy: str) -> Workload:
    """Ordinary traffic for head-of-line protection: every prompt short (even recomputed after a preemption,
    with all its outputs: prompt + max_tokens at most the default long threshold, ``LONG_PROMPT_CHUNKS`` budgets,
    so prompts of several chunks are ordinary), or every prompt long (above it), arriving at random steps, with
    random budgets, pools (tight ones preempt), limits and prefix sharing."""
    chunk_size = draw(st.integers(2, 32))
    threshold = LONG_PROMPT_CHUNKS * chunk_size
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = threshold + 140
    long = draw(st.booleans())
    specs = []
    for i in range(draw(st.integers(1, 12))):
        if long:
            prompt_len, max_tokens = draw(st.integers(threshold + 1, threshold + 100)), draw(st.integers(1, 30))
        else:
            prompt_len = draw(st.integers(1, threshold))
            max_tokens = draw(st.integers(1, max(threshold - prompt_len, 1)))
        specs.append(RequestSpec(f"r{i}", prompt_len, max_tokens,
                                 draw(st.frozensets(st.integers(0, VOCAB - 1), max_size=1)),
                                 draw(st.integers(0, 30)), draw(st.integers(0, 1)), draw(st.integers(0, 40))))
    needs = [-(-max(min(s.prompt_len + s.max_tokens, max_model_len) - 1, s.prompt_len) // block_size)
             for s in specs]
    config = SchedulerConfig(
        policy=policy, chunk_size=chunk_size, max_num_seqs=draw(st.integers(1, 10)), max_model_len=max_model_len,
        block_size=block_size, num_blocks=draw(st.integers(max(needs), max(needs) + sum(needs))),
        watermark=draw(st.sampled_from([0.0, 0.05])), enable_prefix_caching=draw(st.booleans()),
        hol_protection=True)
    return Workload(config, tuple(specs))


def batches(workload: Workload) -> list[tuple[list[tuple[str, int, int]], list[str]]]:
    """Every step's rows ``(request id, computed tokens, new tokens)`` and preemptions, the fake model sampling."""
    sched = make_scheduler(workload.config)
    pending = sorted(workload.requests, key=lambda s: s.arrival_step)
    steps = []
    for i in range(5000):
        while pending and pending[0].arrival_step <= i:
            sched.add(pending.pop(0).request())
        if not (pending or sched.has_unfinished()):
            return steps
        if sched.has_unfinished():
            out = sched.schedule()
            steps.append(([(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled],
                          list(out.preempted_ids)))
            sampled = {s.request_id: fake_token(s.request_id, len(sched.requests[s.request_id].output_token_ids))
                       for s in out.scheduled if s.sample}
            sched.update(out, sampled)
    raise AssertionError("the workload did not finish")


@pytest.mark.parametrize("policy", ["sarathi", "simple_chunking"])
@PROPERTY_SETTINGS
@given(data=st.data())
def test_protection_changes_no_batch_when_no_prompt_crosses_the_threshold(policy: str, data: st.DataObject) -> None:
    workload = data.draw(one_sided_workloads(policy))
    plain = dataclasses.replace(workload, config=dataclasses.replace(workload.config, hol_protection=False))
    protected = batches(workload)
    assert protected == batches(plain)
    assert workload.config.long_threshold == LONG_PROMPT_CHUNKS * workload.config.chunk_size
    long = workload.requests[0].prompt_len > workload.config.long_threshold
    event("every prompt long" if long else "every prompt short")
    event("prompts above one chunk" if max(s.prompt_len for s in workload.requests) > workload.config.chunk_size
          else "every prompt within one chunk")
    event("preemption" if any(preempted for _, preempted in protected) else "no preemption")


def long_with_short_arrivals(**options: object) -> list[int]:
    """A 400-token prompt mid-prefill (chunk 64) while eight shorts of 10-52 tokens arrive, one every third
    step; returns how many steps each short waited before its first chunk ran."""
    options = {"max_num_seqs": 16, **options}
    sched = make("sarathi", chunk_size=64, max_model_len=512, **options)
    sched.add(req("long", 400, max_tokens=4))
    waits, arrived = {}, {}
    for i in range(40):
        if i % 3 == 1 and len(arrived) < 8:
            rid = f"s{len(arrived)}"
            sched.add(req(rid, 10 + 6 * len(arrived), max_tokens=16))
            arrived[rid] = i
        out = step(sched)
        for s in out.scheduled:
            if s.request_id in arrived and s.request_id not in waits:
                waits[s.request_id] = i - arrived[s.request_id]
    return [waits.get(rid, 99) for rid in arrived]


def test_short_prompts_are_admitted_at_once_beside_a_long_prefill() -> None:
    paper = long_with_short_arrivals()
    assert max(paper) >= 3, "the paper's FCFS policy keeps short prompts behind the long prompt"
    assert long_with_short_arrivals(hol_protection=True) == [0] * 8, "each admitted in the step it arrives"


@pytest.mark.parametrize("options", [
    {"long_prefill_token_threshold": 16},  # shorts above it are long too, and wait behind the long prompt
    {"long_prefill_token_threshold": 60},
    {"max_num_seqs": 3},  # seats run out: shorts wait for seats, not for the long prompt
])
def test_short_prompts_keep_moving_whatever_the_options(options: dict[str, int]) -> None:
    protected = long_with_short_arrivals(hol_protection=True, **options)
    paper = long_with_short_arrivals(**options)
    threshold = SchedulerConfig(chunk_size=64, hol_protection=True, **options).long_threshold
    lengths = [10 + 6 * i for i in range(8)]
    if "max_num_seqs" not in options:
        assert all(w == 0 for w, n in zip(protected, lengths) if n <= threshold), protected
    if any(w > 0 for w, n in zip(paper, lengths) if n <= threshold):  # the paper's policy blocked a short one
        assert sum(protected) < sum(paper), (protected, paper)


def test_long_prompt_takes_what_short_prompts_leave_and_is_not_throttled_beside_decodes() -> None:
    sched = make("sarathi", chunk_size=64, hol_protection=True)
    assert sched.config.long_threshold == 4 * 64
    sched.add(req("long", 300, max_tokens=2))
    assert batch(step(sched)) == {"long": (P, 64)}, "alone, a long prompt is not throttled"
    sched.add(req("short", 10, max_tokens=20))
    assert batch(step(sched)) == {"short": (P, 10), "long": (P, 54)}, "the short first, the long the rest"
    assert batch(step(sched)) == {"short": (D, 1), "long": (P, 63)}, "beside decodes, the whole budget"


def test_long_prompts_keep_their_share_when_short_prompts_fill_the_budget() -> None:
    # half the step's prefill (long_share: 31 of the 63 tokens beside a decode) is the long prompt's cap beside
    # short prompts that need more than the rest; where they all fit beside it, the long prompt sits the step out
    # instead (never twice running)
    sched = make("sarathi", chunk_size=64, max_num_seqs=32, hol_protection=True)
    sched.add(req("long", 300))
    step(sched)
    for i in range(6):
        sched.add(req(f"s{i}", 60))
    out = step(sched)
    assert sched.last_decision.held == ["long"] and batch(out) == {"s0": (P, 60), "s1": (P, 4)}
    out = step(sched)  # not held again: it keeps its share, the short prompts the rest
    assert sched.last_decision.held == [] and sched.last_decision.long_cap == 31
    assert batch(out)["long"] == (P, 31) and out.num_batched_tokens == 64


def test_protection_changes_nothing_for_unchunked_policies() -> None:
    assert not SchedulerConfig(policy="vllm", hol_protection=True).protects_short_prompts
    assert SchedulerConfig(policy="vllm", hol_protection=True).long_threshold is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hol_protection": 1}, r"hol_protection=1 must be True or False"),
    ({"long_prefill_token_threshold": 0}, r"long_prefill_token_threshold=0 "),
])
def test_bad_protection_settings_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


def test_under_auto_a_prompt_is_long_above_2048_tokens_whatever_the_cap() -> None:
    # the default cap follows the context (max(max_model_len, 2048) = 8,192 here); the steps "auto" takes are far
    # smaller (496 tokens), so a 3,000-token prompt is chunked over many of them and must not hold short ones back
    config = SchedulerConfig(chunk_size="auto", tbt_slo=0.06, budget_safety=1.0, block_size=16, max_model_len=8192,
                             max_num_seqs=32, watermark=0.0, hol_protection=True, enable_prefix_caching=False)
    assert config.max_num_batched_tokens == 8192 and config.long_threshold == AUTO_LONG_THRESHOLD == 2048
    sched = make_scheduler(config, PerTokenCost())
    sched.add(req("long", 3000))
    assert batch(step(sched)) == {"long": (P, 496)}
    sched.add(req("short", 100))
    assert batch(step(sched))["short"] == (P, 100), "admitted at once, beside the long prompt"
    explicit = dataclasses.replace(config, long_prefill_token_threshold=4000)
    assert explicit.long_threshold == 4000  # an explicit threshold still wins
