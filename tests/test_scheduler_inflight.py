"""Several batches in flight (``max_concurrent_batches``), async scheduling, KV from elsewhere and held blocks, at
the scheduler's level.

A fake executor completes batches late: the driver schedules while the scheduler has room (and a random draw says
so), and completes only the oldest batch each round. It plays the model over a fake KV cache: every row writes its
input tokens into the slots its block table names, and a sampling row's token is a function of every token the
request's block table holds up to it. So a block freed, shared or reused while a batch in flight still reads it
would change a sampled token, and the greedy outputs must equal those of strict alternation (one batch at a time).
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections import deque

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from sarathi_lite.scheduler import (
    PLACEHOLDER_TOKEN,
    POLICIES,
    KVCacheManager,
    Request,
    RequestStatus,
    SchedulerConfig,
    make_scheduler,
)

from .test_scheduler_policies import D, P, batch, make, req, step
from .test_scheduler_properties import PROPERTY_SETTINGS, VOCAB, Workload, workloads


def content_token(tokens: list[int]) -> int:
    """The fake model: the token sampled after ``tokens`` (a fixed function of all of them)."""
    return zlib.crc32(repr(tokens).encode()) % VOCAB


def run(workload: Workload, depth: int = 1, async_scheduling: bool = False, seed: int = 0
        ) -> dict[str, tuple[list[int], str]]:
    """Drive ``workload`` with up to ``depth`` batches in flight; returns every request's outputs and finish reason,
    checking the in-flight rule on every batch and that the pool is whole at the end."""
    config = dataclasses.replace(workload.config, max_concurrent_batches=depth, async_scheduling=async_scheduling)
    sched = make_scheduler(config)
    bs = config.block_size
    kv: dict[int, list[int | None]] = {}
    rng = random.Random(seed)
    pending = sorted(workload.requests, key=lambda s: s.arrival_step)
    queue: deque = deque()
    sampled_last: dict[str, int] = {}
    done: dict[str, tuple[list[int], str]] = {}
    for i in range(20000):
        while pending and pending[0].arrival_step <= i:
            sched.add(pending.pop(0).request())
        if not (pending or sched.has_unfinished() or queue):
            assert sched.block_manager.num_free_blocks == config.num_blocks, "the pool is not whole"
            assert sched.num_in_flight == 0
            return done
        while sched.can_schedule() and sched.has_unfinished() and (not queue or rng.random() < 0.7):
            out = sched.schedule()
            ids = [s.request_id for s in out.scheduled]
            assert len(ids) == len(set(ids)), "a request twice in one batch"
            in_flight = {s.request_id for o in queue for s in o.scheduled}
            for s in out.scheduled:
                if s.request_id in in_flight:  # only async scheduling's decode continuation may do this
                    assert async_scheduling and s.token_ids == [PLACEHOLDER_TOKEN] and not s.is_prefill, s
            assert all(s.token_ids != [PLACEHOLDER_TOKEN] or async_scheduling for s in out.scheduled)
            queue.append(out)
            if out.is_empty:
                break
        if not queue:
            continue
        out = queue.popleft()
        sampled = {}
        for s in out.scheduled:  # the fake forward pass, in batch order
            tokens = [sampled_last[s.request_id]] if s.token_ids == [PLACEHOLDER_TOKEN] else s.token_ids
            for j, t in enumerate(tokens):
                pos = s.num_computed_tokens + j
                kv.setdefault(s.block_table[pos // bs], [None] * bs)[pos % bs] = t
            if s.sample:
                end = s.num_computed_tokens + s.num_new_tokens
                context = [kv[s.block_table[p // bs]][p % bs] for p in range(end)]
                sampled[s.request_id] = sampled_last[s.request_id] = content_token(context)
        for r in sched.update(out, sampled):
            done[r.request_id] = (list(r.output_token_ids), r.finish_reason)
    raise AssertionError("the workload did not finish")


@pytest.mark.parametrize("policy", POLICIES)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_batches_in_flight_give_the_same_greedy_tokens_as_one_at_a_time(policy: str, data: st.DataObject) -> None:
    workload = data.draw(workloads(policy, prefix_caching=data.draw(st.booleans())))
    depth = data.draw(st.sampled_from([2, 4]))
    async_scheduling = data.draw(st.booleans())
    seed = data.draw(st.integers(0, 1000))
    expected = run(workload)
    assert run(workload, depth, async_scheduling, seed) == expected
    event(f"depth {depth}{' async' if async_scheduling else ''}")


def test_default_alternation_tracks_nothing_and_a_second_schedule_is_refused_when_full() -> None:
    sched = make("sarathi", chunk_size=8, max_concurrent_batches=2)
    sched.add(req("a", 20))
    sched.add(req("b", 4))
    first = sched.schedule()
    assert batch(first) == {"a": (P, 8)}
    second = sched.schedule()
    assert batch(second) == {"b": (P, 4)}, "a is in flight: the next batch takes b, a waits"
    with pytest.raises(RuntimeError, match="2 batches are in flight"):
        sched.schedule()
    with pytest.raises(ValueError, match="update in order"):
        sched.update(second, {"b": 1})
    sched.update(first, {})
    assert batch(sched.schedule()) == {"a": (P, 8)}


def test_a_request_in_flight_is_never_preempted_and_its_abort_frees_its_blocks_at_once() -> None:
    sched = make("sarathi", chunk_size=8, block_size=2, num_blocks=4, max_concurrent_batches=2)
    sched.add(req("a", 4, max_tokens=5))
    sched.add(req("b", 4, max_tokens=5))
    out = sched.schedule()
    sched.update(out, {"a": 1, "b": 1})  # both decoding, each with 2 blocks: the pool is full
    first = sched.schedule()  # a and b each need a new block: b (the latest) is preempted for a
    assert [s.request_id for s in first.scheduled] == ["a"] and first.preempted_ids == ["b"]
    second = sched.schedule()  # a is in flight: b cannot take its blocks, and a is no victim
    assert second.is_empty and sched.requests["a"].status is RequestStatus.RUNNING
    sched.abort("a")
    assert sched.block_manager.num_free_blocks == 4, "an aborted request's blocks are free at once"
    assert sched.update(first, {"a": 2}) == [] and sched.update(second, {}) == []
    assert batch(sched.schedule()) == {"b": (P, 5)}, "b recomputes its prompt and its first output"


def test_async_scheduling_continues_a_decode_but_never_past_a_length_limit() -> None:
    sched = make("sarathi", chunk_size=8, async_scheduling=True)
    assert sched.config.max_concurrent_batches == 2
    sched.add(req("a", 3, max_tokens=2))
    first = sched.schedule()
    second = sched.schedule()  # a's first output is in flight: its second is scheduled before the first is known
    assert batch(first) == {"a": (P, 3)}
    assert [(s.num_computed_tokens, s.token_ids) for s in second.scheduled] == [(3, [PLACEHOLDER_TOKEN])]
    sched.update(first, {"a": 5})
    third = sched.schedule()  # the output in flight is a's last (max_tokens=2): nothing more is scheduled
    assert third.is_empty
    assert [r.finish_reason for r in sched.update(second, {"a": 6})] == ["length"]
    sched.update(third, {})
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == sched.config.num_blocks


def test_async_scheduling_wastes_one_row_when_the_earlier_token_stops_the_request() -> None:
    sched = make("sarathi", chunk_size=8, async_scheduling=True)
    sched.add(req("a", 3, max_tokens=10, stop_token_ids=frozenset({7})))
    first, second = sched.schedule(), sched.schedule()
    assert [r.finish_reason for r in sched.update(first, {"a": 7})] == ["stop"]
    assert sched.update(second, {"a": 1}) == [], "the continuation's token is dropped"
    assert sched.requests == {} and sched.block_manager.num_free_blocks == sched.config.num_blocks


# ---------------------------------------------------------------------------------------------- KV from elsewhere


class FakeConnector:
    """The scheduler's side of a connector that can supply ``available`` tokens and sends every finished request."""

    def __init__(self, available: int) -> None:
        self.available = available

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return max(self.available - num_computed_tokens, 0)

    def request_finished(self, request: Request) -> bool:
        return True


def test_external_tokens_skip_their_prefill_once_the_load_is_done() -> None:
    sched = make("sarathi", chunk_size=64, block_size=4)
    sched.add(req("a", 30, max_tokens=4), num_external_tokens=24)
    out = sched.schedule()
    [load] = out.kv_loads
    a = sched.requests["a"]
    assert out.is_empty and a.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert (load.start_token, load.num_tokens, load.block_ids) == (0, 24, a.block_ids[:6])
    assert sched.update(out, {}) == [] and sched.schedule().is_empty, "it waits until the connector is done"
    assert sched.finish_kv_load("a")
    out = sched.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(24, 6)], "only the rest"


def test_a_failed_load_recomputes_the_prompt_and_an_abort_while_loading_holds_the_blocks_until_it_ends() -> None:
    sched = make("sarathi", chunk_size=64, block_size=4, num_blocks=16)
    sched.add(req("a", 30), num_external_tokens=24)
    sched.add(req("b", 30), num_external_tokens=24)
    sched.schedule()
    sched.finish_kv_load("a", ok=False)
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in sched.schedule().scheduled] == [(0, 30)]
    blocks = list(sched.requests["b"].block_ids)
    sched.abort("b")
    assert not set(blocks) & set(sched.block_manager.free_block_ids()), "a block being written was freed"
    assert not sched.finish_kv_load("b")
    assert set(blocks) <= set(sched.block_manager.free_block_ids())


def test_connector_limits_the_external_tokens_and_prefix_hits_are_not_loaded_again() -> None:
    config = SchedulerConfig(chunk_size=64, block_size=4, num_blocks=64, enable_prefix_caching=True)
    sched = make_scheduler(config, connector=FakeConnector(available=20))
    prompt = list(range(30))
    sched.add(Request("first", prompt, 1))
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {s.request_id: 0 for s in out.scheduled if s.sample})
    sched.take_kv_saves()
    sched.add(Request("second", prompt + [99], 1), num_external_tokens=28)
    out = sched.schedule()
    assert out.kv_loads == [] and out.scheduled[0].num_computed_tokens == 28, "all 7 full blocks were cached"
    sched2 = make_scheduler(config, connector=FakeConnector(available=20))
    sched2.add(Request("third", prompt, 1), num_external_tokens=28)
    [load] = sched2.schedule().kv_loads
    assert (load.start_token, load.num_tokens) == (0, 20), "the connector had only 20"


def test_a_block_being_sent_is_neither_freed_nor_evicted_until_released() -> None:
    config = SchedulerConfig(chunk_size=64, block_size=4, num_blocks=8, enable_prefix_caching=True)
    sched = make_scheduler(config, connector=FakeConnector(available=0))
    sched.add(Request("a", list(range(10)), 1))
    out = sched.schedule()
    sent = list(sched.requests["a"].block_ids)
    sched.update(out, {"a": 3})
    [save] = sched.take_kv_saves()
    assert (save.request_id, save.block_ids, save.num_tokens) == ("a", sent, 10)
    pool = sched.block_manager
    assert pool.num_free_blocks == 8 - len(sent) and all(pool.ref_count(b) == 1 for b in sent)
    sched.add(Request("b", [50 + i for i in range(28)], 1))  # needs every free block and would evict cached ones
    assert sched.schedule().is_empty, "b must wait: the held blocks are neither free nor evictable"
    sched.finish_kv_send("a")
    assert pool.num_free_blocks == 8
    assert [s.request_id for s in sched.schedule().scheduled] == ["b"]


def test_kv_cache_manager_hold_and_release_count_references() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    r = Request("r", [1, 2, 3], 1)
    assert kv.allocate_slots(r, 3) == r.block_ids and len(r.block_ids) == 2
    handle = kv.hold(r.block_ids)
    kv.free(r)
    assert kv.num_free_blocks == 2 and kv.num_held_blocks == 2 and kv.usage() == 0.5
    assert kv.allocate_slots(Request("s", [1] * 8, 1), 8) is None, "held blocks cannot be given out"
    kv.release(handle)
    assert kv.num_free_blocks == 4 and kv.usage() == 0.0
    with pytest.raises(KeyError):
        kv.release(handle)


def test_policy_registry_derives_the_lists_and_rejects_a_duplicate_name() -> None:
    from sarathi_lite.scheduler import CHUNKED_POLICIES, policy_class, register_policy
    from sarathi_lite.scheduler.decision import Sarathi

    assert set(CHUNKED_POLICIES) == {p for p in POLICIES if policy_class(p).chunked}
    assert policy_class("sarathi") is Sarathi
    with pytest.raises(ValueError, match="policy 'sarathi' is already registered"):
        register_policy(type("Other", (Sarathi,), {}))
    with pytest.raises(ValueError, match="policy='nope' is not one of sarathi"):
        SchedulerConfig(policy="nope")


def test_a_new_policy_is_one_class_and_one_registration() -> None:
    from sarathi_lite.scheduler import Policy, StepDecision, policy_names, register_policy, registry

    @register_policy
    class DecodeFirstOnly(Policy):
        """Decodes, or, with none to run, the first waiting prompt admitted whole."""

        name = "test_decode_first"
        chunked = False

        def decide(self, running, waiting, num_other_running=0):
            ids = [v.request_id for v in running]
            if running:
                return StepDecision(ids, [], len(running))
            return StepDecision([], [v.request_id for v in waiting][:1], self.config.max_num_batched_tokens,
                            whole_prompts=True)

    try:
        assert "test_decode_first" in policy_names()
        sched = make_scheduler(SchedulerConfig(policy="test_decode_first", num_blocks=64))
        sched.add(req("a", 5, max_tokens=2))
        sched.add(req("b", 3, max_tokens=2))
        assert batch(step(sched)) == {"a": (P, 5)}
        assert batch(step(sched)) == {"a": (D, 1)}
        assert batch(step(sched)) == {"b": (P, 3)}
    finally:
        del registry._REGISTRY["test_decode_first"]
