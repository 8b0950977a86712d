"""The hybrid organization (TaiChi, arXiv 2508.01989): prefill-heavy and decode-heavy colocated instances, a request
moved from a prefill-heavy to a decode-heavy instance when ``routing.HybridRule`` says so. The rule torch-free (who
stays, who moves, by length and slack; the spec's parse/label round trip; bad specs named); the simulator serves a
hybrid with both kinds of paths; the real engines (in-process and processes) give one engine's greedy outputs, aborts
in every state leave every pool whole, and a lost instance is rerouted around or reported."""

from __future__ import annotations

import os
import random
import signal
from typing import Any

import pytest

from sarathi_lite.bench.workload import RequestSpec, Workload
from sarathi_lite.scheduler.coordinator import Coordinator, Hold, RequestRecord
from sarathi_lite.scheduler.routing import DECODE, PREFILL, HybridRule, Layout, route_hybrid

RULE = HybridRule(short=8, ttft_tokens=30, tbt_tokens=20)
"""The tests' rule: prompts of at most 8 tokens may go to a decode-heavy instance, within 30 pending tokens
there; a request on a prefill-heavy instance stays there while that instance's pending prompt tokens and its own
are at most 20, and moves after its prefill otherwise."""


# ---------------------------------------------------------------------- the rule, torch-free

def test_short_prompts_within_ttft_slack_go_to_a_decode_heavy_instance():
    # (pending prefill tokens, KV demand) per instance
    assert route_hybrid(8, RULE, [(0, 0)], [(0, 0)]) == (DECODE, 0, False)
    assert route_hybrid(9, RULE, [(0, 0)], [(0, 0)]) == (PREFILL, 0, False)  # long: prefill-heavy, stays
    assert route_hybrid(9, RULE, [(12, 0)], [(0, 0)]) == (PREFILL, 0, True)  # 12 + 9 > 20: it moves
    assert route_hybrid(8, RULE, [(0, 0)], [(22, 0)]) == (DECODE, 0, False)  # 22 + 8 <= 30
    assert route_hybrid(8, RULE, [(0, 0)], [(23, 0)]) == (PREFILL, 0, False)  # 23 + 8 > 30: no TTFT slack
    assert route_hybrid(8, RULE, [(0, 0)], [(22, 0), (20, 5)]) == (DECODE, 1, False)  # the least pending
    assert route_hybrid(8, RULE, [(0, 0)], [(23, 0), (23, 0)]) == (PREFILL, 0, False)  # no TTFT slack left


def test_a_request_moves_when_its_prefill_heavy_instance_would_break_its_tbt():
    rule = HybridRule(short=0, ttft_tokens=0, tbt_tokens=100)
    assert route_hybrid(50, rule, [(50, 0)], [(0, 0)]) == (PREFILL, 0, False)  # 50 + 50: steps within TBT
    assert route_hybrid(50, rule, [(51, 0)], [(0, 0)]) == (PREFILL, 0, True)  # more: its decode moves
    assert route_hybrid(101, rule, [(0, 0)], [(0, 0)]) == (PREFILL, 0, True)  # its own prompt is more
    assert route_hybrid(1, HybridRule(0, 0, 0), [(0, 0)], [(0, 0)]) == (PREFILL, 0, True)  # 0: every one moves
    assert route_hybrid(50, rule, [(300, 0), (101, 9)], [(0, 0)]) == (PREFILL, 1, True)
    assert route_hybrid(50, rule, [(300, 0)], [None]) == (PREFILL, 0, False)  # no decode-heavy left: stays
    assert route_hybrid(5000, rule, [None], [(900, 0)]) == (DECODE, 0, False)  # no prefill-heavy left
    with pytest.raises(RuntimeError, match="no prefill-heavy or decode-heavy instance"):
        route_hybrid(5, rule, [None], [None])


def test_the_rule_is_documented_with_its_exact_numbers():
    # short and ttft bounds are inclusive, tbt is "more than" (pending plus the prompt)
    rule = HybridRule(short=10, ttft_tokens=20, tbt_tokens=15)
    assert route_hybrid(10, rule, [(5, 0)], [(10, 0)]) == (DECODE, 0, False)
    assert route_hybrid(10, rule, [(5, 0)], [(11, 0)]) == (PREFILL, 0, False)
    assert route_hybrid(10, rule, [(6, 0)], [(11, 0)]) == (PREFILL, 0, True)


@pytest.mark.parametrize("layout", [Layout(prefill=1, decode=1, hybrid=HybridRule()),
                                    Layout(prefill=2, decode=3, hybrid=RULE),
                                    Layout(prefill=1, decode=2, hybrid=HybridRule(tbt_tokens=64))])
def test_parse_and_label_round_trip(layout):
    assert Layout.parse(layout.label) == layout
    assert Layout.parse(layout.label.lower()) == layout


def test_spec_forms():
    assert Layout.parse("1PH1DH").label == "1PH1DH" and Layout.parse("1PH1DH").hybrid == HybridRule()
    assert Layout.parse("2PH1DH/short=8,ttft=30,tbt=20") == Layout(prefill=2, decode=1, hybrid=RULE)
    assert Layout.parse("1PH2DH/tbt=64").label == "1PH2DH/short=256,ttft=2048,tbt=64"


@pytest.mark.parametrize("spec, named", [
    ("1PH1DH/short=-1", "short=-1"),
    ("1PH1DH/speed=3", "speed=3"),
    ("1PH1DH/short", "'short'"),
    ("0PH1DH", "prefill"),
    ("1PH", "'1PH'"),
    ("1P1DH", "'1P1DH'"),
])
def test_bad_specs_are_errors_naming_the_value(spec, named):
    with pytest.raises(ValueError, match=named):
        Layout.parse(spec)


def test_bad_rules_and_layouts_are_errors_naming_the_value():
    with pytest.raises(ValueError, match="tbt_tokens=-3"):
        HybridRule(tbt_tokens=-3)
    with pytest.raises(ValueError, match="short=1.5"):
        HybridRule(short=1.5)
    with pytest.raises(ValueError, match="hybrid=HybridRule"):
        Layout(colocated=2, hybrid=HybridRule())
    with pytest.raises(ValueError, match="hybrid"):
        Layout.parse("1PH1DH", threshold=8)
    with pytest.raises(ValueError, match="hybrid='fast'"):
        Layout(prefill=1, decode=1, hybrid="fast")


class Stub:
    """An instance whose load the test sets (as tests/test_scheduler_coordinator.py's)."""

    def __init__(self, role: str, index: int) -> None:
        self.role, self.name, self.requests = role, f"{role}{index}", set()
        self.pending, self.gone = 0, False
        self.added: list[tuple[str, bool, int]] = []
        self.released: list[tuple[str, Any]] = []

    def load(self) -> tuple[int, int] | None:
        return None if self.gone else (self.pending, 0)

    def add(self, record: RequestRecord, prefill_only: bool, num_external_tokens: int, hold: Hold | None) -> None:
        self.added.append((record.request_id, prefill_only, num_external_tokens))
        self.pending += record.prompt_len if hold is None else 1

    def release(self, request_id: str, token: Any) -> None:
        self.released.append((request_id, token))


def test_the_coordinator_adds_in_full_or_prefill_only_by_the_rule_and_hands_over_only_movers():
    layout = Layout(prefill=1, decode=1, hybrid=RULE)
    (p0,), (d0,) = stubs = [Stub(PREFILL, 0)], [Stub(DECODE, 0)]
    coord = Coordinator(layout, {PREFILL: stubs[0], DECODE: stubs[1]})
    assert coord.arrive("short", 4, 0.0, None) is d0
    assert coord.arrive("stays", 20, 0.0, None) is p0  # p0 had nothing pending: 0 + 20 <= 20
    assert coord.arrive("moves", 20, 0.0, None) is p0  # now 20 pending + 20 > tbt_tokens=20
    assert [coord.requests[r].prefill_only for r in ("short", "stays", "moves")] == [False, False, True]
    assert p0.added == [("stays", False, 0), ("moves", True, 0)] and d0.added == [("short", False, 0)]
    with pytest.raises(AssertionError, match="'stays' is not prefilled only"):
        coord.hand_over("stays", token=1)
    assert coord.hand_over("moves", token=7) is d0 and d0.added[-1] == ("moves", False, 19)
    assert coord.routes == {"short": ["decode0"], "stays": ["prefill0"], "moves": ["prefill0", "decode0"]}
    coord.finish("moves")
    assert p0.released == [("moves", 7)]
    assert coord.arrive("moves2", 20, 0.0, None) is p0 and coord.requests["moves2"].prefill_only
    d0.gone = True  # the decode-heavy instance went while it was prefilled only: it is served whole on p0
    assert coord.hand_over("moves2", token=8) is p0 and p0.added[-1] == ("moves2", False, 0)
    assert p0.released[-1] == ("moves2", 8) and "moves2" not in coord.held
    assert coord.routes["moves2"] == ["prefill0", "prefill0"] and not coord.requests["moves2"].prefill_only


def test_a_lost_prefill_heavy_instance_reroutes_what_it_prefilled_only_and_ends_the_rest():
    layout = Layout(prefill=2, decode=1, hybrid=RULE)
    p0, p1, d0 = Stub(PREFILL, 0), Stub(PREFILL, 1), Stub(DECODE, 0)
    coord = Coordinator(layout, {PREFILL: [p0, p1], DECODE: [d0]})
    coord.arrive("whole", 20, 0.0, None)  # p0, served whole there
    coord.arrive("whole1", 20, 0.0, None)  # p1
    coord.arrive("mover", 20, 0.0, None)  # p0 (20 pending, lower index): moves
    ended: list[str] = []
    p0.gone = True
    coord.lost(p0, lambda record, why: ended.append(record.request_id))
    assert ended == ["whole"]  # it may have streamed tokens already
    assert coord.routes["mover"] == ["prefill0", "prefill1"] and coord.requests["mover"].prefill_only
    d0.gone = True
    coord.lost(d0, lambda record, why: ended.append(record.request_id))
    assert coord.arrive("late", 20, 0.0, None) is p1 and not coord.requests["late"].prefill_only  # none to move to


# ---------------------------------------------------------------------- the simulator

def test_the_simulator_serves_a_hybrid_with_both_kinds_of_paths():
    from sarathi_lite.sim.disagg import Deployment, simulate
    from tests.test_sim_disagg import LINK, ConstantCost

    rng = random.Random(0)
    wl = Workload(tuple(RequestSpec(f"r{i}", 0.004 * i, rng.choice([6, 40, 90]), rng.randrange(2, 12))
                        for i in range(40)))
    opts = dict(num_kv_blocks=64, max_model_len=1024, block_size=16, enable_prefix_caching=False)
    d = Deployment.parse("2PH1DH/short=8,ttft=30,tbt=40", ConstantCost(), chunk_size=16, prefill_chunk_size=64,
                         link=LINK, options=opts)
    assert d.label == "2PH1DH/short=8,ttft=30,tbt=40" and d.layout.hybrid == HybridRule(8, 30, 40)
    assert d.prefill.chunk_size == 64 and d.decode.chunk_size == 16
    result = simulate(d, wl)
    assert all(m.finished_time is not None for m in result.requests)
    for m, spec in zip(result.requests, wl.requests):  # every token of every request came out, once
        assert len(m.token_times) == spec.output_len
    routes = set(result.routes.values())
    assert ("decode0",) in routes  # short: straight to the decode-heavy instance
    assert {("prefill0",), ("prefill1",)} & routes  # served whole on a prefill-heavy instance
    movers = [rid for rid, r in result.routes.items() if len(r) == 2]
    assert movers and all(result.routes[rid][1] == "decode0" for rid in movers)
    assert {t.request_id for t in result.transfers} == set(movers)  # only movers' K/V crossed the link
    assert result.summary()["num_gpus"] == 3


# ---------------------------------------------------------------------- the real engines

OPTIONS = dict(chunk_size=16, block_size=4, num_kv_blocks=128, device="cpu", attention_backend="torch")
SPEC = "1PH2DH/short=8,ttft=30,tbt=48"
MAX_STEPS = 200


def prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 200) for _ in range(8)]
    return [(shared if i % 2 else []) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 40))]
            for i in range(n)]


def greedy():
    from sarathi_lite import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    from sarathi_lite import LLM
    llm = LLM(tiny_checkpoints["llama"], **OPTIONS)
    return [o.token_ids for o in llm.generate(prompts(), greedy(), use_tqdm=False)]


def check_routes(routes: list[list[str]], lens: list[int]) -> None:
    kinds = {("decode" if r == ["decode0"] or r == ["decode1"] else "whole" if len(r) == 1 else "moved")
             for r in routes}
    assert kinds == {"decode", "whole", "moved"}, routes
    for r, n in zip(routes, lens):
        if len(r) == 1 and r[0].startswith("decode"):
            assert n <= 8
        if len(r) == 2:
            assert r[0] == "prefill0" and r[1].startswith("decode")


def test_in_process_greedy_outputs_equal_one_engines(tiny_checkpoints, reference):
    from sarathi_lite import LLM
    llm = LLM(tiny_checkpoints["llama"], disaggregation=SPEC, processes=False,
              prefill_options={"chunk_size": 32}, **OPTIONS)
    assert [o.token_ids for o in llm.generate(prompts(), greedy(), use_tqdm=False)] == reference
    engine = llm.engine
    check_routes([engine.routes[f"gen-{i}"] for i in range(len(prompts()))], [len(p) for p in prompts()])
    assert engine.engines["prefill"][0].scheduler_config.chunk_size == 32
    assert engine.engines["decode"][0].scheduler_config.chunk_size == 16
    for e in engine._all():
        assert e.scheduler.kv.pool.num_used_blocks == 0 and e.scheduler.kv.num_held_blocks == 0
        assert not e.scheduler.requests
    assert len(engine.store) == 0 and not engine.engines["prefill"][0].kv_connector.marked
    assert len(engine.stats().requests) == len(prompts())  # one record per request, where it was decoded


def test_in_process_aborts_in_every_state_leave_every_pool_whole(tiny_checkpoints):
    from sarathi_lite import SamplingParams
    from sarathi_lite.engine.disagg_engine import DisaggregatedEngine
    engine = DisaggregatedEngine(tiny_checkpoints["llama"], instances="1PH1DH/short=8,ttft=30,tbt=40", **OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    long = list(range(3, 43))
    engine.add_request("whole", list(range(3, 13)), params)  # 10 tokens: served whole on prefill0
    engine.add_request("mover", list(range(50, 90)), params)  # prefilled only on prefill0
    engine.add_request("waiting", list(range(100, 140)), params)
    engine.abort_request("waiting")
    engine.step()
    assert engine.engines["prefill"][0].scheduler.requests["mover"].num_computed_tokens == 6
    engine.abort_request("mover")  # mid-prefill, prefill only
    for _ in range(6):
        engine.step()
    assert engine.engines["prefill"][0].scheduler.requests["whole"].output_token_ids  # decoding where prefilled
    engine.abort_request("whole")
    engine.add_request("a", long, params)
    engine.add_request("b", list(range(60, 100)), params)  # moves
    for _ in range(MAX_STEPS):
        engine.step()
        if engine.engines["decode"][0].scheduler.requests.get("b") is not None \
                and engine.engines["decode"][0].scheduler.requests["b"].output_token_ids:
            break
    assert engine.routes["b"] == ["prefill0", "decode0"]
    engine.abort_request("b")  # decoding on the decode-heavy side
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    for e in engine._all():
        assert e.scheduler.kv.pool.num_used_blocks == 0 and e.scheduler.kv.num_held_blocks == 0
    assert len(engine.store) == 0 and not engine.engines["prefill"][0].kv_connector.marked


def run(engine, requests: dict[str, list[int]], params=None) -> dict[str, Any]:
    """Add ``requests`` and step until all finish (bounded): ``test_engine_disagg_procs.run``, greedy by default."""
    from tests.test_engine_disagg_procs import run as run_bounded
    return run_bounded(engine, requests, params or greedy())


@pytest.fixture(scope="module")
def procs(tiny_checkpoints):
    from sarathi_lite.engine.instances import ProcessEngine
    engine = ProcessEngine(tiny_checkpoints["llama"], instances=SPEC, prefill_options={"chunk_size": 32}, **OPTIONS)
    yield engine
    engine.shutdown()


def test_processes_greedy_outputs_equal_one_engines(procs, reference):
    from tests.test_engine_disagg_procs import assert_pools_whole
    done = run(procs, {f"r{i}": p for i, p in enumerate(prompts())})
    assert [done[f"r{i}"].token_ids for i in range(len(prompts()))] == reference
    check_routes([procs.routes[f"r{i}"] for i in range(len(prompts()))], [len(p) for p in prompts()])
    pools = procs.pools()
    assert sum(p["blocks_received"] for p in pools.values()) == sum(p["blocks_sent"] for p in pools.values()) > 0
    movers = {f"r{i}" for i in range(len(prompts())) if len(procs.routes[f"r{i}"]) == 2}
    assert procs.transfers and set(procs.transfers) <= movers
    assert_pools_whole(procs)


def test_processes_aborts_in_every_state_leave_every_pool_whole(procs):
    from sarathi_lite import SamplingParams
    from tests.test_engine_disagg_procs import assert_pools_whole
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert not procs.has_unfinished_requests()
    procs.add_request("whole", list(range(3, 13)), params)  # prefill0, served whole
    procs.add_request("mover", list(range(50, 90)), params)  # prefill0, prefill only
    procs.add_request("waiting", list(range(100, 140)), params)
    assert procs.abort_request("waiting").finish_reason == "abort"
    procs.step()
    assert procs.pools()["prefill0"]["num_requests"] == 2  # "whole" (10 tokens) and 22 tokens of "mover"
    assert procs.abort_request("mover").finish_reason == "abort"  # mid-prefill
    outputs = []
    for _ in range(MAX_STEPS):
        outputs += [o for o in procs.step() if o.request_id == "whole"]
        if outputs:
            break
    assert outputs and not outputs[-1].finished and procs.routes["whole"] == ["prefill0"]
    assert procs.abort_request("whole").finish_reason == "abort"  # decoding where it was prefilled
    procs.add_request("busy", list(range(3, 43)), params)  # stays
    procs.add_request("held", list(range(60, 100)), params)  # moves
    procs.add_request("moved", list(range(110, 150)), params)  # moves
    for _ in range(MAX_STEPS):
        procs.step()
        if len(procs.routes["held"]) == 2:
            break
    assert procs.pools()["prefill0"]["num_holds"] >= 1  # handed over, its K/V held, not loaded yet
    assert procs.abort_request("held").finish_reason == "abort"
    outputs = []
    for _ in range(MAX_STEPS):
        outputs += [o for o in procs.step() if o.request_id == "moved"]
        if outputs:
            break
    assert len(procs.routes["moved"]) == 2 and outputs and not outputs[-1].finished
    assert procs.abort_request("moved").finish_reason == "abort"  # decoding on the decode-heavy side
    assert procs.abort_request("busy").finish_reason == "abort"
    assert not procs.coordinator.requests, procs.coordinator.requests
    assert all(not o.finished or o.finish_reason == "abort" for o in procs.step())  # outputs taken on the way
    assert not procs.has_unfinished_requests()
    assert_pools_whole(procs)


def test_a_killed_instance_of_either_kind_is_handled_and_the_rest_serve_on(tiny_checkpoints, reference):
    from sarathi_lite.engine.errors import EngineDeadError
    from sarathi_lite.engine.instances import ProcessEngine
    from tests.test_engine_disagg_procs import assert_pools_whole
    engine = ProcessEngine(tiny_checkpoints["llama"], instances=SPEC, transfer_timeout=5.0, **OPTIONS)
    try:
        victim = engine.instances["prefill"][0]
        for i, p in enumerate(prompts()):
            engine.add_request(f"r{i}", p, greedy())
        engine.step()
        whole = {rid for rid in victim.requests if not engine.coordinator.requests[rid].prefill_only}
        os.kill(victim.process.pid, signal.SIGKILL)
        done = run(engine, {})
        assert set(done) == {f"r{i}" for i in range(len(prompts()))}
        for rid, out in done.items():  # served whole on it: an error naming it; the others: one engine's tokens
            if rid in whole:
                assert out.finish_reason == "error" and "prefill0" in out.error
            else:
                assert out.token_ids == reference[int(rid[1:])], rid
        assert whole  # the test killed an instance with a request it served whole
        engine.add_request("after", prompts()[0], greedy())  # a long prompt: a decode-heavy instance takes it
        assert run(engine, {})["after"].token_ids == reference[0] and len(engine.routes["after"]) == 1
        assert_pools_whole(engine)
        for inst in engine.instances["decode"]:
            os.kill(inst.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="no prefill-heavy or decode-heavy instance|no prefill instance"):
            engine.add_request("last", prompts()[1], greedy())
            for _ in range(MAX_STEPS):
                engine.step()
    finally:
        engine.shutdown()


def test_with_every_decode_heavy_instance_lost_the_prefill_heavy_one_serves_everything_whole(tiny_checkpoints,
                                                                                          reference):
    from sarathi_lite.engine.instances import ProcessEngine
    from tests.test_engine_disagg_procs import assert_pools_whole
    engine = ProcessEngine(tiny_checkpoints["llama"], instances="1PH1DH/short=8,ttft=30,tbt=40", **OPTIONS)
    try:
        victim = engine.instances["decode"][0]
        for i, p in enumerate(prompts()):
            engine.add_request(f"r{i}", p, greedy())
        for _ in range(MAX_STEPS):
            engine.step()
            if victim.requests:
                break
        on_victim = set(victim.requests)  # served whole there or moved there: they may have streamed tokens
        assert on_victim
        os.kill(victim.process.pid, signal.SIGKILL)
        done = run(engine, {})
        assert set(done) == {f"r{i}" for i in range(len(prompts()))}
        for rid, out in done.items():
            if rid in on_victim:
                assert out.finish_reason == "error" and "decode0" in out.error, out.error
            else:
                assert out.token_ids == reference[int(rid[1:])], rid
        assert engine.instance_states()["decode"]["lost"] == 1
        # prefilled only when decode0 went: served whole on prefill0 after all
        assert any(r == ["prefill0", "prefill0"] for r in engine.routes.values())
        later = run(engine, {f"again{i}": p for i, p in enumerate(prompts())})  # nothing moves now
        assert [later[f"again{i}"].token_ids for i in range(len(prompts()))] == reference
        assert all(engine.routes[f"again{i}"] == ["prefill0"] for i in range(len(prompts())))
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


def test_the_simulator_routes_and_batches_a_hybrid_as_the_real_router_on_a_replayed_run(tiny_checkpoints):
    from sarathi_lite.engine.disagg_engine import DisaggregatedEngine
    from sarathi_lite.sim.disagg import Deployment, Link, PoolSpec, simulate
    from tests.test_engine_disagg import UnitCost

    ps = prompts(9, seed=3)
    engine = DisaggregatedEngine(tiny_checkpoints["llama"], instances=SPEC, record_batches=True,
                                 enable_prefix_caching=False, prefill_options={"chunk_size": 32}, **OPTIONS)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, greedy(), arrival_time=0.0)
    while engine.has_unfinished_requests():
        engine.step()
    cfg = engine.engines["prefill"][0].scheduler_config
    options = dict(num_kv_blocks=cfg.num_blocks, block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                   enable_prefix_caching=False)
    cm = UnitCost()
    dep = Deployment(prefill=PoolSpec("prefill", 1, cm, chunk_size=32, options=options),
                     decode=PoolSpec("decode", 2, cm, chunk_size=16, options=options), link=Link("instant", 1e18, 0),
                     hybrid=Layout.parse(SPEC).hybrid)
    wl = Workload(tuple(RequestSpec(f"r{i}", 0.0, len(p), 6) for i, p in enumerate(ps)))
    sim = simulate(dep, wl, record_batches=True)
    assert sim.routes == {rid: tuple(r) for rid, r in engine.routes.items()}  # the same instances, and batches:
    assert {len(r) for r in sim.routes.values()} == {1, 2}
    for role, count in (("prefill", 1), ("decode", 2)):
        for i in range(count):
            e = engine.engines[role][i]
            assert [it.batch for it in e.stats().iterations] == [it.batch for it in sim.iterations[f"{role}{i}"]]
