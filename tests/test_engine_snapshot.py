"""Other threads read the engine's state through ``snapshot()``: an immutable record the engine thread publishes after
every step, add, abort and prefix-cache reset; the server's metrics read nothing else."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
from prometheus_client import generate_latest

from sarathi_lite import LLMEngine, SamplingParams
from sarathi_lite.engine.async_engine import AsyncLLMEngine
from sarathi_lite.engine.snapshot import EngineSnapshot
from sarathi_lite.server.metrics import ServerMetrics


def _engine(tiny_checkpoints) -> LLMEngine:
    return LLMEngine(tiny_checkpoints["llama"], chunk_size=16, block_size=4, num_kv_blocks=64, device="cpu",
                     attention_backend="torch")


def _live(engine: LLMEngine) -> tuple:
    """What the snapshot should say, read from the scheduler on the engine's own thread."""
    sched, blocks = engine.scheduler, engine.scheduler.block_manager
    return (engine.metrics.num_iterations, len(sched.waiting), len(sched.running), blocks.num_used_blocks,
            blocks.num_blocks, blocks.num_cached_blocks, blocks.hit_rate)


def _fields(snap: EngineSnapshot) -> tuple:
    return dataclasses.astuple(snap)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_the_snapshot_follows_queues_blocks_and_the_prefix_cache(tiny_checkpoints):
    engine = _engine(tiny_checkpoints)
    assert _fields(engine.snapshot()) == (0, 0, 0, 0, 64, 0, 0.0) and engine.snapshot().kv_usage == 0.0
    prompt = list(range(3, 43))  # 40 tokens: 10 full blocks
    engine.add_request("a", prompt, GREEDY)
    engine.add_request("b", list(range(50, 60)), GREEDY)
    assert engine.snapshot().num_waiting == 2  # published by add_request, before any step
    seen_running = False
    while engine.has_unfinished_requests():
        engine.step()
        snap = engine.snapshot()
        assert _fields(snap) == _live(engine)
        assert snap.kv_usage == snap.kv_blocks_used / 64
        seen_running |= snap.num_running == 2 and snap.kv_blocks_used > 0
    assert seen_running
    assert engine.snapshot().kv_blocks_used == 0 and engine.snapshot().kv_blocks_cached >= 10
    engine.add_request("again", prompt, GREEDY)  # the same prompt: its full blocks come from the prefix cache
    engine.step()
    assert engine.snapshot().prefix_hit_rate > 0 and _fields(engine.snapshot()) == _live(engine)
    engine.abort_request("again")
    assert _fields(engine.snapshot())[1:4] == (0, 0, 0)  # published by the abort, with no step after it
    engine.reset_prefix_cache()
    assert engine.snapshot().kv_blocks_cached == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.snapshot().num_running = 5


def test_a_reader_thread_sees_only_whole_published_snapshots(tiny_checkpoints):
    engine = _engine(tiny_checkpoints)
    published = [engine.snapshot()]
    seen: list[EngineSnapshot] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.append(engine.snapshot())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(6):
            engine.add_request(f"r{i}", [5 + i] * (8 + 5 * i), GREEDY)
            published.append(engine.snapshot())
        while engine.has_unfinished_requests():
            engine.step()
            published.append(engine.snapshot())
        deadline = time.monotonic() + 30  # a bound on hanging if snapshots were not the published records
        while (not seen or seen[-1] is not published[-1]) and time.monotonic() < deadline:
            time.sleep(0.001)  # until the reader has read the last one too
    finally:
        stop.set()
        reader.join()
    ids = {id(s) for s in published}
    assert len(seen) > len(published) and all(id(s) in ids for s in seen)  # never a record built mid-step
    steps = [s.num_steps for s in seen]
    assert steps == sorted(steps) and steps[-1] == published[-1].num_steps > 5


class _SnapshotOnly:
    """An engine as the server's metrics may see it: a snapshot and a stream count, nothing to reach through."""

    def __init__(self, snap: EngineSnapshot) -> None:
        self.snap = snap
        self.num_streams = 3

    def snapshot(self) -> EngineSnapshot:
        return self.snap


def test_the_server_metrics_read_only_the_snapshot():
    metrics = ServerMetrics()
    engine = _SnapshotOnly(EngineSnapshot(7, 2, 5, 40, 100, 12, 0.5))
    metrics.watch(engine)
    text = generate_latest(metrics.registry).decode()
    for line in ("sarathi_lite_num_requests_running 5.0", "sarathi_lite_num_requests_waiting 2.0",
                 "sarathi_lite_kv_blocks_used 40.0", "sarathi_lite_kv_blocks_total 100.0",
                 "sarathi_lite_num_streams 3.0"):
        assert line in text, line
    engine.snap = EngineSnapshot(8, 0, 1, 4, 100, 12, 0.5)  # read again at the next scrape
    assert "sarathi_lite_kv_blocks_used 4.0" in generate_latest(metrics.registry).decode()


def test_the_async_engine_gives_its_engines_snapshot(tiny_checkpoints):
    engine = _engine(tiny_checkpoints)
    aengine = AsyncLLMEngine(engine)

    async def run() -> None:
        async for _ in aengine.generate([5, 6, 7, 8, 9], GREEDY):
            pass

    try:
        asyncio.run(run())
        snap = aengine.snapshot()
        assert snap is engine.snapshot() and snap.num_steps == 6 and snap.kv_blocks_used == 0
    finally:
        aengine.shutdown()
