"""``AsyncLLMEngine``: streaming from an event loop while the engine thread batches continuously; cancelling a
consumer aborts its request within one step; engine errors and shutdown reach every waiting generator."""

from __future__ import annotations

import asyncio

import pytest

from sarathi_lite import LLM, LLMEngine, SamplingParams
from sarathi_lite.engine.async_engine import AsyncLLMEngine
from sarathi_lite.engine.errors import EngineDeadError, QueueFullError

PROMPTS = [[5, 6, 7] * 10, [9, 10], [11, 12] * 7, [40] * 3]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture()
def engine(tiny_checkpoints) -> LLMEngine:
    return LLMEngine(tiny_checkpoints["llama"], chunk_size=16, block_size=4, num_kv_blocks=256, device="cpu",
                     record_batches=True)


async def collect(aengine: AsyncLLMEngine, prompt, params, rid) -> list:
    return [o async for o in aengine.generate(prompt, params, rid)]


def test_streams_match_generate_and_late_requests_join_running_batches(engine, tiny_checkpoints):
    lengths = [200, 12, 12, 12]  # the first request is still decoding when the others arrive
    expected = LLM(tiny_checkpoints["llama"], chunk_size=16, device="cpu").generate(
        PROMPTS, [greedy(n) for n in lengths], use_tqdm=False)
    aengine = AsyncLLMEngine(engine)

    async def main():
        first = asyncio.create_task(collect(aengine, PROMPTS[0], greedy(lengths[0]), "a0"))
        while engine.metrics.num_iterations < 3:
            await asyncio.sleep(0.001)
        rest = asyncio.gather(*[collect(aengine, p, greedy(n), f"a{i}")
                                for i, (p, n) in enumerate(zip(PROMPTS[1:], lengths[1:]), 1)])
        return [await first, *await rest]

    try:
        runs = asyncio.run(main())
    finally:
        aengine.shutdown()
    for outs, ref in zip(runs, expected):
        assert [t for o in outs for t in o.new_token_ids] == ref.token_ids == outs[-1].token_ids
        assert outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])
    shared = [it for it in engine.stats().iterations if "a0" in dict(it.batch) and len(it.batch) > 1]
    assert shared, "requests added while a0 ran never shared an iteration with it"
    assert aengine.num_streams == 0 and engine.scheduler.block_manager.num_used_blocks == 0


def test_a_reservation_lets_requests_in_together_or_not_at_all(engine):
    aengine = AsyncLLMEngine(engine, max_waiting_requests=4)

    async def main():
        with pytest.raises(ValueError, match="5 requests at once are more than max_waiting_requests=4"):
            aengine.reserve(5)
        group = aengine.reserve(3)
        assert aengine.num_waiting == 3
        with pytest.raises(QueueFullError, match="3 requests are waiting and the bound is 4"):
            aengine.reserve(2)  # all or none: one place is left
        last = aengine.reserve(1)
        last.release()
        last.release()  # once only
        assert aengine.num_waiting == 3
        streams = [await aengine.add_request([5, 6], greedy(1000), f"g{i}", reservation=group) for i in range(2)]
        group.release()  # the place never used is given back; the two added wait or run
        assert aengine.num_waiting <= 2
        with pytest.raises(ValueError, match="no place left"):
            await aengine.add_request([9], greedy(2), "late", reservation=group)
        for stream in streams:
            await stream.aclose()

    try:
        asyncio.run(main())
    finally:
        aengine.shutdown()


def test_cancelling_the_consumer_aborts_and_frees_kv_within_one_step(engine):
    aengine = AsyncLLMEngine(engine)

    async def main():
        seen = []

        async def consume():
            async for o in aengine.generate(PROMPTS[0], greedy(500), "long"):
                seen.append(o)

        task = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        at_cancel = engine.metrics.num_iterations
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.001)
        return at_cancel

    try:
        at_cancel = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert not engine.has_unfinished_requests()
    assert engine.metrics.num_iterations - at_cancel <= 1, "the abort waited for more than the running step"
    assert engine.scheduler.block_manager.num_used_blocks == 0 and aengine.num_streams == 0
    assert engine.stats().requests[-1].finish_reason == "abort"


def test_abort_ends_the_stream_and_bad_input_fails_only_its_request(engine):
    aengine = AsyncLLMEngine(engine)

    at_abort = []  # iterations the engine had finished when abort() was called

    async def main():
        outs = []

        async def consume():
            async for o in aengine.generate(PROMPTS[1], greedy(500), "victim"):
                outs.append(o)
                if len(outs) == 2:
                    at_abort.append(engine.metrics.num_iterations)
                    aengine.abort("victim")

        bad = aengine.generate([10**9], greedy(4), "bad")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await bad.__anext__()
        await consume()
        ok = await collect(aengine, PROMPTS[2], greedy(5), "after")
        return outs, ok

    try:
        outs, ok = asyncio.run(main())
    finally:
        aengine.shutdown()
    # outputs already queued when abort() was called still arrive (how many depends on how far the engine thread
    # ran ahead of this consumer), but the request takes part in at most the one step running at that moment
    victim_steps = [it.index for it in engine.stats().iterations if "victim" in dict(it.batch)]
    assert outs[-1].finish_reason == "abort" and sum(i >= at_abort[0] for i in victim_steps) <= 1, \
        (at_abort, victim_steps)
    assert ok[-1].finish_reason == "length" and ok[-1].num_output_tokens == 5


def test_a_failed_step_ends_only_its_requests_and_the_loop_keeps_serving(engine):
    calls = {"n": 0}
    execute = engine.runner.execute

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("a bug in one step")
        return execute(*args, **kwargs)

    engine.runner.execute = failing
    aengine = AsyncLLMEngine(engine)

    async def main():
        results = await asyncio.gather(*[collect(aengine, p, greedy(50), f"e{i}") for i, p in enumerate(PROMPTS)])
        after = await collect(aengine, PROMPTS[0], greedy(3), "after")
        return results, after

    try:
        results, after = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        aengine.shutdown()
    assert all(outs[-1].finish_reason == "error" and "a bug in one step" in outs[-1].error for outs in results)
    assert after[-1].finish_reason == "length" and after[-1].num_output_tokens == 3
    assert engine.scheduler.block_manager.num_used_blocks == 0 and aengine.num_streams == 0


class _DeadWorkers:
    """A tensor-parallel group whose rank 1 died during a step."""

    failed = None

    def __init__(self, executor) -> None:
        self.executor = executor  # the engine's own, for everything but running a step

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def execute(self, *args, **kwargs):
        self.failed = "tensor-parallel worker rank 1 (pid 4242) exited with code 1"
        raise RuntimeError("Connection closed by peer")

    def check_health(self) -> None:
        if self.failed:
            raise EngineDeadError(self.failed)


def test_a_dead_worker_reaches_every_waiting_generator_and_shutdown_ends_them(engine):
    engine.executor = _DeadWorkers(engine.executor)
    aengine = AsyncLLMEngine(engine)

    async def main():
        results = await asyncio.gather(*[collect(aengine, p, greedy(50), f"e{i}") for i, p in enumerate(PROMPTS)],
                                       return_exceptions=True)
        with pytest.raises(EngineDeadError):
            await collect(aengine, PROMPTS[0], greedy(2), "late")
        return results

    results = asyncio.run(asyncio.wait_for(main(), 60))
    engine.executor = engine.executor.executor
    assert all(isinstance(r, EngineDeadError) and "rank 1 (pid 4242) exited" in str(r) for r in results)
    assert not aengine.is_running and "rank 1 (pid 4242) exited with code 1" in aengine.dead_reason

    healthy = AsyncLLMEngine(LLMEngine(engine.model_path, chunk_size=16, device="cpu", num_kv_blocks=64))

    async def waiting():
        task = asyncio.create_task(collect(healthy, PROMPTS[0], greedy(10**3 // 2), "w"))
        while healthy.engine.metrics.num_iterations < 2:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(healthy.shutdown)
        with pytest.raises(EngineDeadError):
            await task

    asyncio.run(asyncio.wait_for(waiting(), 60))
    assert not healthy._thread.is_alive()


def test_the_caller_hands_its_openmp_workers_over_to_the_engine_thread(engine, monkeypatch):
    """The engine is built in the caller's thread and stepped in the engine thread: the caller's idle OpenMP
    workers are released (two pools on a machine of few cores make libgomp's idle workers sleep at once, and
    every matmul of a step then waits for a wake-up)."""
    import sarathi_lite.engine.async_engine as async_engine

    calls = []
    monkeypatch.setattr(async_engine, "release_thread_pool", lambda: calls.append(1) or True)
    aengine = AsyncLLMEngine(engine)
    try:
        assert calls == [1]
    finally:
        aengine.shutdown()
