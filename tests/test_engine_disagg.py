"""Disaggregated serving for real, in one process (``sarathi_lite.engine.disagg_engine``): greedy outputs of 1P1D, 1P2D,
2P1D, conditional and colocated replicas equal one engine's; aborts leave every pool whole; the router's decisions
are the simulator's on a replayed run."""

from __future__ import annotations

import random

import pytest

from sarathi_lite import LLM, SamplingParams
from sarathi_lite.bench.workload import RequestSpec, Workload
from sarathi_lite.costs import CostModel, StepTiming
from sarathi_lite.engine.disagg_engine import DisaggregatedEngine
from sarathi_lite.scheduler import SchedulerOutput
from sarathi_lite.scheduler.routing import Layout
from sarathi_lite.sim.disagg import Deployment, Link, PoolSpec, simulate

OPTIONS = dict(chunk_size=16, block_size=4, num_kv_blocks=128, device="cpu", attention_backend="torch")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompts(n: int = 7, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 200) for _ in range(8)]  # a shared prefix: prefix caching on both sides
    return [(shared if i % 2 else []) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 40))]
            for i in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], **OPTIONS)
    return [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def pools_whole(engine: DisaggregatedEngine) -> None:
    for e in engine._all():
        kv = e.scheduler.kv
        assert kv.pool.num_used_blocks == 0 and kv.num_held_blocks == 0
        assert not e.scheduler.requests
    assert len(engine.store) == 0


@pytest.mark.parametrize("layout", ["1P1D", "1P2D", "2P1D", Layout.parse("1P1D", threshold=12), "2"],
                         ids=["1P1D", "1P2D", "2P1D", "1P1D-cond12", "2C"])
def test_greedy_outputs_equal_one_engine(tiny_checkpoints, reference, layout):
    llm = LLM(tiny_checkpoints["llama"], disaggregation=layout, processes=False, **OPTIONS)
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == reference
    engine = llm.engine
    lens = [len(p) for p in prompts()]
    routes = [engine.routes[f"gen-{i}"] for i in range(len(lens))]
    if isinstance(layout, Layout) and layout.threshold is not None:
        assert all((r == ["decode0"]) == (n <= 12) for r, n in zip(routes, lens))
    elif layout != "2":
        assert all(len(r) == 2 and r[0].startswith("prefill") and r[1].startswith("decode") for r in routes)
        # the decode side loaded the prompt's K/V instead of computing it
        decode = engine.engines["decode"]
        assert sum(it.num_prefill_tokens for e in decode for it in e.stats().iterations) < sum(lens)
    pools_whole(engine)


def test_aborts_in_every_state_leave_both_pools_whole(tiny_checkpoints):
    engine = DisaggregatedEngine(tiny_checkpoints["llama"], instances="1P1D", **OPTIONS)
    long = list(range(3, 43))  # 40 tokens: 3 prefill steps at chunk 16
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("waiting", long, params)
    engine.add_request("prefilling", long, params)
    engine.abort_request("waiting")
    engine.step()
    assert engine.engines["prefill"][0].scheduler.requests["prefilling"].num_computed_tokens == 16
    engine.abort_request("prefilling")
    engine.add_request("decoding", long, params)
    for _ in range(5):
        engine.step()
    decode = engine.engines["decode"][0].scheduler
    assert decode.requests["decoding"].output_token_ids  # it decodes on the decode instance
    out = engine.abort_request("decoding")
    assert out.finish_reason == "abort"
    with pytest.raises(ValueError, match="'decoding' is unknown"):
        engine.abort_request("decoding")
    pools_whole(engine)


def test_abort_while_waiting_for_decode_memory(tiny_checkpoints):
    # the decode pool holds one request at a time: the second waits there, its K/V saved, until it is aborted
    engine = DisaggregatedEngine(tiny_checkpoints["llama"], instances="1P1D", decode_options={"num_kv_blocks": 12},
                                 **{**OPTIONS, "num_kv_blocks": 128})
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("a", list(range(3, 33)), params)
    engine.add_request("b", list(range(50, 80)), params)
    for _ in range(4):
        engine.step()
    decode = engine.engines["decode"][0].scheduler
    assert [r.request_id for r in decode.waiting] == ["b"] and engine.store.get("b") is not None
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    pools_whole(engine)


class UnitCost(CostModel):
    """Every step takes one second: the simulated clock counts rounds."""

    kv_bytes_per_token = 1

    def predict(self, out: SchedulerOutput) -> StepTiming:
        return StepTiming(0.0, 1.0)

    def describe(self) -> dict:
        return {"kind": "unit", "model": None, "dtype": None, "device": None, "attention_backend": None}


def test_the_simulator_routes_and_prefills_as_the_real_router_on_a_replayed_run(tiny_checkpoints):
    ps = prompts(9, seed=3)
    engine = DisaggregatedEngine(tiny_checkpoints["llama"], instances="2P2D", record_batches=True,
                                 enable_prefix_caching=False, **OPTIONS)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, GREEDY, arrival_time=0.0)
    while engine.has_unfinished_requests():
        engine.step()
    cfg = engine.engines["prefill"][0].scheduler_config
    options = dict(num_kv_blocks=cfg.num_blocks, block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                   enable_prefix_caching=False)
    cm = UnitCost()
    dep = Deployment(prefill=PoolSpec("prefill", 2, cm, chunk_size=16, options=options),
                     decode=PoolSpec("decode", 2, cm, chunk_size=16, options=options), link=Link("instant", 1e18, 0))
    wl = Workload(tuple(RequestSpec(f"r{i}", 0.0, len(p), GREEDY.max_tokens) for i, p in enumerate(ps)))
    sim = simulate(dep, wl, record_batches=True)
    assert sim.routes == {rid: tuple(r) for rid, r in engine.routes.items()}  # the same instances, and batches:
    for i, e in enumerate(engine.engines["prefill"]):
        assert [it.batch for it in e.stats().iterations] == [it.batch for it in sim.iterations[f"prefill{i}"]]
    for i, e in enumerate(engine.engines["decode"]):
        assert [it.batch for it in e.stats().iterations] == [it.batch for it in sim.iterations[f"decode{i}"]]


def test_a_failed_transfer_recomputes_with_one_warning_and_the_same_outputs(tiny_checkpoints, reference,
                                                                             monkeypatch, caplog):
    from sarathi_lite.engine.kv_connector import InProcessKVConnector

    monkeypatch.setattr(InProcessKVConnector, "load", lambda self, load, runner: False)
    llm = LLM(tiny_checkpoints["llama"], disaggregation="1P1D", processes=False, **OPTIONS)
    with caplog.at_level("WARNING", logger="sarathi_lite.engine.llm_engine"):
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == reference
    warned = [r.getMessage() for r in caplog.records if "recomputing" in r.getMessage()]
    transferred = [rid for rid, route in llm.engine.routes.items() if len(route) == 2 and rid.startswith("gen-")]
    assert len(transferred) == len(prompts())
    assert len(warned) == len([p for p in prompts() if len(p) > 1])  # a 1-token prompt loads nothing
    pools_whole(llm.engine)
