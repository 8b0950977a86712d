"""Prefix caching in the scheduler: what a request takes from the cache, when blocks become shareable, eviction,
accounting, and the stable content key. (The random-workload invariants are in test_scheduler_properties.py.)"""

from __future__ import annotations

import hashlib
import struct

import pytest

from sarathi_lite.scheduler import POLICIES, Request, SchedulerConfig, block_key, make_scheduler

SYSTEM = list(range(100, 124))  # a 24-token shared prefix: 6 blocks of 4


def sched_for(policy: str = "sarathi", **kw):
    cfg = dict(policy=policy, chunk_size=64, max_num_seqs=8, max_model_len=128, block_size=4, num_blocks=64,
               watermark=0.0, enable_prefix_caching=True, hol_protection=False)  # batches in FCFS order
    cfg.update(kw)
    return make_scheduler(SchedulerConfig(**cfg))


def step(sched, token: int = 7):
    out = sched.schedule()
    sched.update(out, {s.request_id: token for s in out.scheduled if s.sample})
    return out


def row(out, request_id):
    return next(s for s in out.scheduled if s.request_id == request_id)


def test_block_key_is_sha256_of_parent_key_and_little_endian_int64_tokens() -> None:
    first = block_key(b"", [1, 2, 3, 4])
    assert first == hashlib.sha256(struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert block_key(first, [5]) == hashlib.sha256(first + (5).to_bytes(8, "little")).digest()
    assert block_key(b"", [1, 2, 3, 4]) != block_key(block_key(b"", [0]), [1, 2, 3, 4])  # the prefix counts
    # A fixed digest: the key must not depend on the process (no Python hash()).
    assert block_key(b"", [0]).hex().startswith("af5570f5")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_finished_requests_full_prompt_blocks_serve_the_next_request_with_that_prefix(policy: str) -> None:
    sched = sched_for(policy)
    sched.add(Request("a", SYSTEM + [1, 2, 3], max_tokens=2))
    while sched.has_unfinished():
        step(sched)
    sched.add(Request("b", SYSTEM + [9, 9], max_tokens=2))
    out = step(sched)
    b = row(out, "b")
    assert b.num_computed_tokens == 24 and b.token_ids == [9, 9]  # only the new tokens run
    assert sched.requests["b"].num_cached_tokens == 24 and out.num_cached_tokens == 24
    bm = sched.block_manager
    assert bm.num_hit_tokens == 24 and bm.num_queried_tokens == 27 + 26 and bm.hit_rate == 24 / 53


def test_a_fully_cached_prompt_still_computes_its_last_token_in_a_block_of_its_own() -> None:
    sched = sched_for()
    sched.add(Request("a", SYSTEM, max_tokens=1))
    step(sched)
    assert not sched.has_unfinished()
    sched.add(Request("b", SYSTEM, max_tokens=1))
    out = sched.schedule()
    b = row(out, "b")
    # 24 tokens = 6 full blocks, but the block holding token 24 is recomputed, not shared, so it can be written.
    assert b.num_computed_tokens == 20 and b.num_new_tokens == 4 and b.sample
    assert sched.block_manager.ref_count(b.block_table[-1]) == 1
    assert sched.block_manager.key_of(b.block_table[-1]) is None


def test_blocks_filled_by_a_chunk_are_shared_from_the_next_iteration_while_the_owner_still_prefills() -> None:
    sched = sched_for(chunk_size=16)
    sched.add(Request("a", SYSTEM + [1], max_tokens=3))
    step(sched)  # a's first chunk: tokens 0..15, blocks 0..3
    sched.add(Request("b", SYSTEM + [2], max_tokens=3))
    a = sched.requests["a"]
    out = sched.schedule()  # a's last 9 prompt tokens, and b in the 7 tokens left
    b = row(out, "b")
    assert a.is_prefill and row(out, "a").num_computed_tokens == 16
    assert b.num_computed_tokens == 16 and b.num_new_tokens == 7  # a's first chunk, shared mid-prefill
    assert b.block_table[:4] == a.block_ids[:4]
    assert all(sched.block_manager.ref_count(x) == 2 for x in a.block_ids[:4])


def test_two_requests_with_one_prefix_in_the_same_iteration_both_compute_it_and_the_cache_keeps_one_copy() -> None:
    sched = sched_for()
    sched.add(Request("a", SYSTEM + [1], max_tokens=5))
    sched.add(Request("b", SYSTEM + [2], max_tokens=5))
    out = step(sched)
    # Nothing was computed before this iteration, so neither can hit: both run their whole prompt.
    assert row(out, "a").num_computed_tokens == row(out, "b").num_computed_tokens == 0
    a, b = sched.requests["a"], sched.requests["b"]
    bm = sched.block_manager
    assert [bm.key_of(x) is not None for x in a.block_ids[:6]] == [True] * 6
    assert [bm.key_of(x) for x in b.block_ids[:6]] == [None] * 6  # duplicates stay uncached
    sched.add(Request("c", SYSTEM + [3], max_tokens=2))
    assert row(step(sched), "c").block_table[:6] == a.block_ids[:6]


def test_cached_free_blocks_are_evicted_least_recently_freed_first_and_only_when_no_empty_block_is_left() -> None:
    sched = sched_for(num_blocks=12, max_num_seqs=1)
    bm = sched.block_manager
    sched.add(Request("a", [1] * 8 + [0], max_tokens=1))  # blocks: 2 full + 1
    sched.add(Request("b", [2] * 8 + [0], max_tokens=1))
    while sched.has_unfinished():
        step(sched)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 12
    # Needs 9 blocks: the 8 empty ones first, then one eviction: a's second block (a was freed first, and a
    # request's last block goes before its first).
    sched.add(Request("c", list(range(30, 63)), max_tokens=1))
    step(sched)
    assert bm.num_cached_blocks == 3 + 8  # and c's own 8 full blocks
    sched.add(Request("a2", [1] * 8 + [5], max_tokens=1))
    assert row(sched.schedule(), "a2").num_computed_tokens == 4


def test_a_preempted_request_takes_its_own_cached_prefix_back() -> None:
    sched = sched_for(num_blocks=7, max_num_seqs=2, chunk_size=16)
    sched.add(Request("a", [1] * 8, max_tokens=12))
    sched.add(Request("b", [2] * 8, max_tokens=12))
    preempted = []
    for _ in range(30):
        out = step(sched)
        preempted += out.preempted_ids
        if "b" in preempted and row_or_none(out, "b") is not None:
            break
    assert "b" in preempted
    b = row(out, "b")
    assert b.is_prefill and b.num_computed_tokens >= 8  # at least its prompt came back from the cache
    assert sched.requests["b"].num_cached_tokens == 0  # the request's own count is its first admission's


def row_or_none(out, request_id):
    return next((s for s in out.scheduled if s.request_id == request_id), None)


def test_reset_prefix_cache_forgets_every_prefix_and_the_counters() -> None:
    sched = sched_for()
    sched.add(Request("a", SYSTEM + [1], max_tokens=1))
    step(sched)
    assert sched.block_manager.num_cached_blocks == 6
    assert sched.reset_prefix_cache() == 6
    bm = sched.block_manager
    assert bm.num_cached_blocks == 0 and bm.hit_rate == 0.0 and not bm.cached_free_block_ids()
    assert bm.num_free_blocks == 64
    sched.add(Request("b", SYSTEM + [1], max_tokens=1))
    assert row(sched.schedule(), "b").num_computed_tokens == 0


def test_without_prefix_caching_nothing_is_shared_or_counted() -> None:
    sched = sched_for(enable_prefix_caching=False)
    sched.add(Request("a", SYSTEM + [1], max_tokens=1))
    step(sched)
    sched.add(Request("b", SYSTEM + [1], max_tokens=1))
    out = step(sched)
    assert row(out, "b").num_computed_tokens == 0 and out.num_cached_tokens == 0
    assert sched.block_manager.num_cached_blocks == 0 and sched.block_manager.num_queried_tokens == 0


def test_enable_prefix_caching_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        SchedulerConfig(enable_prefix_caching="yes")
