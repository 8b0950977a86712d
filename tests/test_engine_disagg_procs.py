"""Instances as processes (``sarathi_lite.engine.instances``): greedy outputs of 1P1D, 1P2D, 2P1D, conditional and
colocated replicas equal one engine's; K/V moves over gloo point-to-point, only the blocks the decode side lacks,
and a block being sent stays held until the receiver acknowledges it; aborts in every state leave every pool whole;
a killed instance is rerouted around or reported, never a hang; no child outlives the engine."""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sarathi_lite import LLM, SamplingParams
from sarathi_lite.engine.errors import EngineDeadError
from sarathi_lite.engine.instances import ProcessEngine
from sarathi_lite.engine.p2p_connector import P2PKVConnector
from sarathi_lite.scheduler import Request, SchedulerConfig, make_scheduler
from sarathi_lite.scheduler.routing import Layout

OPTIONS = dict(chunk_size=16, block_size=4, num_kv_blocks=128, device="cpu", attention_backend="torch")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
MAX_STEPS = 200  # every loop here is bounded: a hang fails the test instead of stalling the suite


def prompts(n: int = 7, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 200) for _ in range(8)]  # a shared prefix: prefix caching on both sides
    return [(shared if i % 2 else []) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 40))]
            for i in range(n)]


def run(engine: ProcessEngine, requests: dict[str, list[int]], params: SamplingParams = GREEDY
        ) -> dict[str, object]:
    for rid, p in requests.items():
        engine.add_request(rid, p, params)
    done = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests(), "the engine did not finish within the step bound"
    return done


def assert_pools_whole(engine: ProcessEngine) -> None:
    """No block used or held, no request, no hold, on every live instance. A sender thread ends a finished send's
    hold a moment after the receiver's acknowledgement, so this looks a bounded few times."""
    for _ in range(50):
        pools = engine.pools()
        state = {name: (p["num_used_blocks"], p["num_held_blocks"], p["num_requests"], p["num_holds"])
                 for name, p in pools.items()}
        if all(v == (0, 0, 0, 0) for v in state.values()):
            return
        time.sleep(0.02)
    assert state == {name: (0, 0, 0, 0) for name in state}


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], **OPTIONS)
    return {f"r{i}": o.token_ids for i, o in enumerate(llm.generate(prompts(), GREEDY, use_tqdm=False))}


@pytest.fixture(scope="module")
def pd(tiny_checkpoints):
    """One 1P1D engine shared by the tests that leave it whole."""
    engine = ProcessEngine(tiny_checkpoints["llama"], instances="1P1D", **OPTIONS)
    yield engine
    engine.shutdown()


def check_outputs(engine: ProcessEngine, reference: dict[str, list[int]], layout: Layout) -> None:
    done = run(engine, {f"r{i}": p for i, p in enumerate(prompts())})
    assert {rid: o.token_ids for rid, o in done.items()} == reference
    routes = [engine.routes[f"r{i}"] for i in range(len(reference))]
    lens = [len(p) for p in prompts()]
    if layout.colocated:
        assert all(len(r) == 1 and r[0].startswith("colocated") for r in routes)
        assert {r[0] for r in routes} == {f"colocated{i}" for i in range(layout.colocated)}
    elif layout.threshold is not None:
        assert all((len(r) == 1) == (n <= layout.threshold) for r, n in zip(routes, lens))
    else:
        assert all(len(r) == 2 and r[0].startswith("prefill") and r[1].startswith("decode") for r in routes)
        assert {r[0] for r in routes} == {f"prefill{i}" for i in range(layout.prefill)}
        assert {r[1] for r in routes} == {f"decode{i}" for i in range(layout.decode)}
        pools = engine.pools()
        received = sum(p["blocks_received"] for p in pools.values())
        assert received == sum(p["blocks_sent"] for p in pools.values()) > 0  # K/V moved, every block acknowledged
        assert set(engine.transfers) <= set(reference)
    assert_pools_whole(engine)


def test_1p1d_greedy_outputs_equal_one_engine(pd, reference):
    pd.reset_prefix_cache()
    check_outputs(pd, reference, pd.layout)


@pytest.mark.parametrize("layout", ["1P2D", "2P1D", Layout.parse("1P1D", threshold=12)],
                         ids=["1P2D", "2P1D", "1P1D-cond12"])
def test_greedy_outputs_equal_one_engine(tiny_checkpoints, reference, layout):
    engine = ProcessEngine(tiny_checkpoints["llama"], instances=layout, **OPTIONS)
    try:
        check_outputs(engine, reference, engine.layout)
    finally:
        engine.shutdown()


def test_llm_with_disaggregation_runs_instances_as_processes(tiny_checkpoints, reference):
    llm = LLM(tiny_checkpoints["llama"], disaggregation="2", num_threads=1, **OPTIONS)
    try:
        assert isinstance(llm.engine, ProcessEngine)
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outputs] == list(reference.values())
        assert {r[0] for r in llm.engine.routes.values()} == {"colocated0", "colocated1"}
        assert len(llm.stats().requests) == len(reference)
        assert_pools_whole(llm.engine)
    finally:
        llm.engine.shutdown()


def test_only_the_blocks_the_decode_side_lacks_are_sent(pd, tiny_checkpoints):
    pd.reset_prefix_cache()
    bs = OPTIONS["block_size"]
    first = list(range(100, 130))  # 30 tokens: 7 full blocks and 2 tokens
    second = first + list(range(200, 212))  # the same 7 full blocks, then 12 new tokens
    before = pd.pools()
    run(pd, {"first": first})
    middle = pd.pools()
    got = run(pd, {"second": second})
    after = pd.pools()
    # the decode side loads every block of the first prompt but its last token's (a block of 4 holds tokens 0..3)
    assert middle["decode0"]["blocks_received"] - before["decode0"]["blocks_received"] == -(-(30 - 1) // bs)
    # the second prompt's 7 full blocks are in the decode side's prefix cache: only blocks 7..10 move
    assert after["decode0"]["blocks_received"] - middle["decode0"]["blocks_received"] == -(-(42 - 1) // bs) - 7
    assert after["prefill0"]["blocks_sent"] - middle["prefill0"]["blocks_sent"] == -(-(42 - 1) // bs) - 7
    assert pd.transfers["second"][1] == -(-(42 - 1) // bs) - 7
    single = LLM(tiny_checkpoints["llama"], **OPTIONS).generate([second], GREEDY, use_tqdm=False)[0]
    assert got["second"].token_ids == single.token_ids
    assert_pools_whole(pd)


def test_token_ids_outside_the_vocabulary_are_refused_before_any_instance_sees_them(pd):
    vocab = pd.model_config.vocab_size
    for bad in ([5, -1], [5, vocab], [True]):
        with pytest.raises(ValueError, match=f"request 'bad': token id {bad[-1]!r} is outside the vocabulary"):
            pd.add_request("bad", bad, GREEDY)
        assert "bad" not in pd.routes
    assert not pd.has_unfinished_requests()
    assert_pools_whole(pd)


def test_aborts_in_every_state_leave_both_pools_whole(pd):
    long = list(range(3, 43))  # 40 tokens: 3 prefill steps at chunk 16
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    pd.add_request("waiting", long, params)
    pd.add_request("prefilling", long, params)
    assert pd.abort_request("waiting").finish_reason == "abort"
    pd.step()
    assert pd.pools()["prefill0"]["num_requests"] == 1
    assert pd.abort_request("prefilling").finish_reason == "abort"  # mid-prefill
    pd.add_request("transfer", list(range(50, 90)), params)
    for _ in range(10):
        pd.step()
        if len(pd.routes["transfer"]) == 2:
            break
    # handed to the decode instance, its K/V held on the prefill instance, not loaded yet
    assert pd.routes["transfer"] == ["prefill0", "decode0"] and pd.pools()["prefill0"]["num_holds"] == 1
    assert pd.abort_request("transfer").finish_reason == "abort"
    pd.add_request("decoding", list(range(60, 100)), params)
    outputs = []
    for _ in range(10):
        outputs += [o for o in pd.step() if o.request_id == "decoding"]
        if outputs:
            break
    assert outputs and not outputs[-1].finished
    assert pd.abort_request("decoding").finish_reason == "abort"
    with pytest.raises(ValueError, match="'decoding' is unknown"):
        pd.abort_request("decoding")
    assert not pd.has_unfinished_requests()
    assert_pools_whole(pd)


def test_abort_while_waiting_for_decode_memory(tiny_checkpoints):
    # the decode pool holds one request at a time: the second waits there, its K/V held on the prefill side
    engine = ProcessEngine(tiny_checkpoints["llama"], instances="1P1D", decode_options={"num_kv_blocks": 12},
                           **OPTIONS)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        engine.add_request("a", list(range(3, 33)), params)
        engine.add_request("b", list(range(50, 80)), params)
        for _ in range(MAX_STEPS):
            engine.step()
            if len(engine.routes["b"]) == 2:
                break
        assert engine.pools()["decode0"]["num_requests"] == 2  # "a" decodes, "b" waits for room
        assert engine.routes["b"] == ["prefill0", "decode0"] and engine.pools()["prefill0"]["num_holds"] == 1
        engine.abort_request("b")
        for _ in range(MAX_STEPS):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


def test_a_killed_prefill_instance_is_routed_around_with_the_same_outputs(tiny_checkpoints, reference, caplog):
    # with no prefill instance left, the decode instance prefills; prompts already handed over recompute
    engine = ProcessEngine(tiny_checkpoints["llama"], instances="1P1D", transfer_timeout=5.0, **OPTIONS)
    try:
        for i, p in enumerate(prompts()):
            engine.add_request(f"r{i}", p, GREEDY)
        engine.step()
        engine.step()
        os.kill(engine.instances["prefill"][0].process.pid, signal.SIGKILL)
        with caplog.at_level("WARNING"):
            done = run(engine, {})
        assert {rid: o.token_ids for rid, o in done.items()} == reference
        assert engine.instances["prefill"][0].dead and "prefill0" in engine.instances["prefill"][0].dead
        assert any("prefill instance prefill0 is gone" in r.getMessage() for r in caplog.records)
        engine.add_request("after", prompts()[1], GREEDY)  # new requests still run, on the decode instance
        assert run(engine, {})["after"].token_ids == reference["r1"]
        assert engine.routes["after"] == ["decode0"]
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


def test_a_transfer_that_times_out_is_recomputed_on_the_decode_side(tiny_checkpoints):
    import psutil

    # the prefill instance is stopped (alive, silent) once it has handed the prompt over: the decode side's wait
    # for the K/V ends after transfer_timeout, and it computes the prompt itself
    engine = ProcessEngine(tiny_checkpoints["llama"], instances="1P1D", transfer_timeout=1.0, **OPTIONS)
    prefill = engine.instances["prefill"][0].process
    try:
        prompt = list(range(5, 35))
        engine.add_request("slow", prompt, GREEDY)
        for _ in range(10):
            engine.step()
            if len(engine.routes["slow"]) == 2:
                break
        assert not engine.instances["prefill"][0].busy  # idle: the router has nothing to ask it meanwhile
        os.kill(prefill.pid, signal.SIGSTOP)
        for _ in range(100):  # the stop takes effect when the kernel next schedules it
            if psutil.Process(prefill.pid).status() == psutil.STATUS_STOPPED:
                break
            time.sleep(0.01)
        assert psutil.Process(prefill.pid).status() == psutil.STATUS_STOPPED
        done = run(engine, {})
        os.kill(prefill.pid, signal.SIGCONT)
        single = LLM(tiny_checkpoints["llama"], **OPTIONS).generate([prompt], GREEDY, use_tqdm=False)[0]
        assert done["slow"].token_ids == single.token_ids
        assert "slow" not in engine.transfers  # no K/V arrived: the decode side recomputed
        engine.add_request("next", prompt, GREEDY)  # the pair to that rank is closed: later requests recompute
        assert run(engine, {})["next"].token_ids == single.token_ids
        assert_pools_whole(engine)
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
        engine.shutdown()


def load_until_on(engine: ProcessEngine, victim) -> set[str]:
    """Add the seven prompts and step until ``victim`` (an instance) holds some of them; returns their ids."""
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(MAX_STEPS):
        engine.step()
        if victim.requests:
            break
    on_victim = set(victim.requests)
    assert on_victim
    return on_victim


def assert_victims_failed(done: dict[str, object], on_victim: set[str], reference: dict[str, list[int]],
                          *error_parts: str) -> None:
    """Every request ended: those on the lost instance with an error containing ``error_parts``, the others
    with the reference tokens."""
    for rid, out in done.items():
        if rid in on_victim:
            assert out.finish_reason == "error" and all(part in out.error for part in error_parts), out.error
        else:
            assert out.token_ids == reference[rid]
    assert set(done) == set(reference)


def test_a_killed_decode_instance_ends_its_requests_with_an_error_and_the_others_go_on(tiny_checkpoints,
                                                                                        reference):
    engine = ProcessEngine(tiny_checkpoints["llama"], instances="1P2D", **OPTIONS)
    try:
        victim = engine.instances["decode"][1]
        on_victim = load_until_on(engine, victim)
        os.kill(victim.process.pid, signal.SIGKILL)
        assert_victims_failed(run(engine, {}), on_victim, reference, "decode1", "signal 9")
        engine.add_request("after", prompts()[1], GREEDY)
        assert run(engine, {})["after"].token_ids == reference["r1"]
        assert engine.routes["after"][1] == "decode0"
        assert_pools_whole(engine)
        os.kill(engine.instances["decode"][0].process.pid, signal.SIGKILL)
        engine.add_request("last", prompts()[1], GREEDY)
        with pytest.raises(EngineDeadError, match="no decode instance is left"):
            for _ in range(MAX_STEPS):
                engine.step()
    finally:
        engine.shutdown()


def test_a_hung_instance_is_killed_after_step_timeout_and_its_requests_end_with_an_error(tiny_checkpoints,
                                                                                         reference):
    # a replica stopped (SIGSTOP) with requests on it never answers its step: within step_timeout the router
    # kills it, ends its requests with an error naming it, and the other replica serves the rest
    engine = ProcessEngine(tiny_checkpoints["llama"], instances="2", step_timeout=2.0, **OPTIONS)
    try:
        victim = engine.instances["colocated"][1]
        on_victim = load_until_on(engine, victim)
        os.kill(victim.process.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        done = run(engine, {})
        assert time.monotonic() - t0 < 2.0 + 10.0
        assert victim.process.exitcode is not None  # killed, not left stopped
        assert_victims_failed(done, on_victim, reference, "did not finish a step within 2 s")
    finally:
        if victim.process.exitcode is None:
            os.kill(victim.process.pid, signal.SIGCONT)
        engine.shutdown()
    with pytest.raises(ValueError, match="step_timeout=0"):
        ProcessEngine(tiny_checkpoints["llama"], instances="2", step_timeout=0, **OPTIONS)


def test_no_child_outlives_the_engine(tiny_checkpoints):
    engine = ProcessEngine(tiny_checkpoints["llama"], instances="1P1D", **OPTIONS)
    processes = [i.process for i in engine._all]
    engine.shutdown()
    assert all(p.exitcode is not None for p in processes)
    engine = ProcessEngine(tiny_checkpoints["llama"], instances="2", **OPTIONS)
    processes = [i.process for i in engine._all]
    assert all(p.is_alive() for p in processes)
    del engine
    gc.collect()
    assert all(p.exitcode is not None for p in processes)


def test_instances_exit_when_the_router_process_is_killed(tiny_checkpoints, tmp_path):
    import psutil

    script = textwrap.dedent(f"""
        import sys, time
        from sarathi_lite.engine.instances import ProcessEngine
        if __name__ == "__main__":
            engine = ProcessEngine({str(tiny_checkpoints["llama"])!r}, instances="1P1D", **{OPTIONS!r})
            print(" ".join(str(i.process.pid) for i in engine._all), flush=True)
            time.sleep(120)
    """)
    (tmp_path / "router.py").write_text(script)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "router.py")], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        children = [psutil.Process(p) for p in pids]
    finally:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"instances outlived their router: {alive}"


class _Runner:
    block_size = 4


@pytest.mark.parametrize("seed", range(6))
def test_a_block_being_sent_is_never_freed_or_reused_before_the_receiver_acknowledges(seed):
    """Plays a prefill instance's scheduler and connector with random sends, acknowledgements, drops, aborts
    and new requests: every block registered for sending or in a send stays allocated (not free, in no other
    request's table) until the hold ends."""
    rng = random.Random(seed)
    connector = P2PKVConnector("producer")
    config = SchedulerConfig(chunk_size=16, block_size=4, num_blocks=48, enable_prefix_caching=False)
    sched = make_scheduler(config, connector=connector)
    handles: dict[int, list[int]] = {}  # registered and not yet released: handle -> blocks
    sending: set[int] = set()
    by_request: dict[str, int] = {}
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3 and len(sched.requests) < 6:
            rid = f"q{next_id}"
            connector.expect(rid, next_id)
            sched.add(Request(rid, [rng.randrange(3, 300) for _ in range(rng.randrange(2, 30))], 1, frozenset(),
                              0.0))
            by_request[rid] = next_id
            next_id += 1
        elif op < 0.6 and sched.has_unfinished():
            out = sched.schedule()
            sched.update(out, {s.request_id: 7 for s in out.scheduled if s.sample})
            for save in sched.take_kv_saves():
                assert not connector.save(save, _Runner())  # held, not released
                handles[by_request[save.request_id]] = list(save.block_ids)
        elif op < 0.7 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            sched.abort(rid)
            connector.forget(rid)
        elif op < 0.8 and handles:
            h = rng.choice(sorted(handles))
            if connector.holds.begin(h) is not None:
                sending.add(h)
        elif op < 0.9 and sending:
            h = rng.choice(sorted(sending))
            sending.discard(h)
            connector.holds.end(h, acknowledged=rng.random() < 0.7)
        elif handles:
            connector.holds.drop(rng.choice(sorted(handles)))
        for rid in connector.holds.take_released():
            sched.finish_kv_send(rid)
            handles.pop(by_request[rid])
        pool = sched.kv.pool
        free = set(pool._free) | set(pool._cached_free)
        in_tables = {b for r in sched.requests.values() for b in r.block_ids}
        for h in sending:
            assert h in handles  # a send in progress never lost its hold
        for h, blocks in handles.items():
            assert not free & set(blocks) and not in_tables & set(blocks), (h, blocks)


def test_serve_with_instances_1p1d_answers_as_one_engine(tmp_path):
    """``sarathi-lite serve --instances 1P1D`` as a real subprocess on loopback: completions equal one engine's
    greedy text, and no instance outlives the server."""
    import subprocess
    import sys

    import httpx
    import psutil

    from tests.conftest import TINY, make_tiny_checkpoint
    from tests.live_server import free_port, stop_process, wait_healthy
    from tests.tiny_tokenizer import save_tiny_tokenizer

    checkpoint = save_tiny_tokenizer(make_tiny_checkpoint("llama", tmp_path / "llama"), TINY["vocab_size"])
    engine = dict(chunk_size=16, block_size=4, num_kv_blocks=256, device="cpu")
    port = free_port()
    cmd = [sys.executable, "-m", "sarathi_lite", "serve", str(checkpoint), "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", "tiny", "--threads", "1", "--instances", "1P1D",
           *[f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    texts = ["The quick brown fox", "héllo wörld", "A long prompt can stall the others for a while"]
    try:
        wait_healthy(url, timeout=120)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len([c for c in children if "spawn_main" in " ".join(c.cmdline())]) >= 2
        got = []
        for prompt in texts:
            r = httpx.post(f"{url}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
    finally:
        stop_process(proc)
    _, stderr = proc.communicate()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"instances outlived the server: {alive}"
    single = LLM(checkpoint, **engine).generate(texts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert got == [o.text for o in single], stderr[-2000:]
