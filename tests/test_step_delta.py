"""The step deltas rank 0 sends the other ranks: from them a rank rebuilds exactly the batch the scheduler made
(rows, token ids, block tables, counts), through chunked prefill, prefix-cache hits, preemption, aborts, finished
requests and batches in flight, and they are smaller than the whole ``SchedulerOutput``."""

from __future__ import annotations

import pickle
import random

import pytest

from sarathi_lite.engine.step_delta import StepDecoder, StepDelta, StepEncoder
from sarathi_lite.scheduler import Request, ScheduledRequest, SchedulerConfig, SchedulerOutput, make_scheduler

SYSTEM = list(range(100, 132))  # a shared 32-token prefix: prefix-cache hits


def _check(out: SchedulerOutput, decoder: StepDecoder, delta: StepDelta) -> None:
    rebuilt = decoder.decode(pickle.loads(pickle.dumps(delta)))
    assert rebuilt.scheduled == out.scheduled
    assert (rebuilt.num_prefill_tokens, rebuilt.num_decode_tokens, rebuilt.num_prefills, rebuilt.num_decodes) == \
        (out.num_prefill_tokens, out.num_decode_tokens, out.num_prefills, out.num_decodes)


def _run(config: SchedulerConfig, seed: int) -> tuple[int, int, int]:
    """A random workload through the scheduler; every batch encoded, sent (pickled) and rebuilt, in order, with
    finished and aborted requests forgotten as the engine does (with the next batch). Returns the preemptions,
    the pickled bytes of the whole outputs and those of the deltas."""
    rng = random.Random(seed)
    sched = make_scheduler(config)
    for i in range(24):
        prompt = (SYSTEM if i % 3 == 0 else []) + [rng.randrange(1, 500) for _ in range(rng.randint(5, 90))]
        sched.add(Request(f"r{i}", prompt, max_tokens=rng.randint(1, 40)))
    encoder, decoder = StepEncoder(), StepDecoder()
    forget: list[str] = []
    in_flight: list[SchedulerOutput] = []
    whole = sent = steps = preempted = 0
    while sched.has_unfinished() or in_flight:
        while len(in_flight) < config.max_concurrent_batches and sched.can_schedule() and sched.has_unfinished():
            out = sched.schedule()
            delta = encoder.encode(out, forget)
            forget = []
            _check(out, decoder, delta)
            whole, sent = whole + len(pickle.dumps(out)), sent + len(pickle.dumps(delta))
            in_flight.append(out)
            preempted += len(out.preempted_ids)
        out = in_flight.pop(0)
        finished = sched.update(out, {s.request_id: rng.randrange(1, 500) for s in out.scheduled if s.sample})
        forget += [r.request_id for r in finished]
        steps += 1
        if steps == 15:  # abort a running request (its blocks go back to the pool at once)
            victim = next((r for r in sched.running if not r.num_in_flight), None)
            if victim is not None:
                sched.abort(victim.request_id)
                forget.append(victim.request_id)
    _check(SchedulerOutput(), decoder, encoder.encode(SchedulerOutput(), forget))
    assert len(encoder) == len(decoder) == 0  # nothing left behind on either side
    return preempted, whole, sent


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batches", ["one", "in flight", "async"])
def test_a_rank_rebuilds_every_batch_exactly_from_the_deltas(seed, batches):
    config = SchedulerConfig(policy="sarathi", chunk_size=64, max_num_seqs=12, max_model_len=256, block_size=4,
                             num_blocks=90, watermark=0.0, enable_prefix_caching=True,
                             max_concurrent_batches=1 if batches == "one" else 2,
                             async_scheduling=batches == "async")
    _, whole, sent = _run(config, seed)
    assert sent < whole


def test_preemption_resends_the_table_and_tokens_and_the_rank_agrees():
    # a pool too small for the running requests: decodes preempt others, which come back with new tables
    sched = make_scheduler(SchedulerConfig(policy="sarathi", chunk_size=32, max_num_seqs=4, max_model_len=128,
                                           block_size=4, num_blocks=12, watermark=0.0))
    for i in range(3):
        sched.add(Request(f"r{i}", [5 + i] * 10, max_tokens=20))
    encoder, decoder = StepEncoder(), StepDecoder()
    preempted, forget = [], []
    while sched.has_unfinished():
        out = sched.schedule()
        delta = encoder.encode(out, forget)
        _check(out, decoder, delta)
        preempted += out.preempted_ids
        assert set(out.preempted_ids) <= set(delta.forget)
        for i, rid in enumerate(delta.request_ids):  # a request back from preemption gets its whole table
            if rid in preempted and delta.is_prefill[i] and delta.num_computed_tokens[i] == 0:
                assert delta.new_block_ids[i] == out.scheduled[i].block_table
        forget = [r.request_id for r in sched.update(out, {s.request_id: 9 for s in out.scheduled if s.sample})]
    assert preempted


def test_a_decode_sends_its_token_and_only_a_new_block():
    encoder, decoder = StepEncoder(), StepDecoder()
    table = list(range(40, 80))  # 40 blocks of 4: 160 tokens
    first = SchedulerOutput()
    first.add(ScheduledRequest("a", 0, 158, list(range(158)), table, True, True))
    decoder.decode(encoder.encode(first))
    decode = SchedulerOutput()
    decode.add(ScheduledRequest("a", 158, 1, [7], table, True, False))
    delta = encoder.encode(decode)
    assert delta.new_block_ids == [[]] and delta.token_ids == [[7]]
    assert decoder.decode(delta).scheduled == decode.scheduled
    grown = SchedulerOutput()
    grown.add(ScheduledRequest("a", 160, 1, [8], [*table, 3], True, False))
    delta = encoder.encode(grown)
    assert delta.new_block_ids == [[3]] and decoder.decode(delta).scheduled == grown.scheduled
    assert len(pickle.dumps(delta)) * 2 < len(pickle.dumps(grown))
    # a table that did not grow from what the ranks hold (never made by the scheduler): sent whole again
    moved = SchedulerOutput()
    moved.add(ScheduledRequest("a", 160, 1, [9], [1, *table], True, False))
    delta = encoder.encode(moved)
    assert delta.forget == ["a"] and decoder.decode(delta).scheduled == moved.scheduled
