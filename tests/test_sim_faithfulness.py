"""The simulator runs the engine's own scheduler, so it makes the engine's decisions.

Against real replays (``sarathi_lite.bench.replay.run``) of a tiny model, every policy:

- all requests at once: timing cannot change any decision, so any cost model gives the real batch sequence;
- online arrivals: replaying the real run's measured step times (``ReplayCostModel``) gives the real batch
  sequence and the same per-request timeline. The real replay runs on a virtual clock that advances by each
  forward pass's measured wall time and by each of the replay's sleeps: on the wall clock, whether an arrival
  microseconds before a step's start is seen by that step depends on where the OS preempts the loop between its
  look at the clock and the engine's, which no simulator can reproduce;
- the result has the bench result's JSON schema, and a small KV pool makes both preempt alike.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from sarathi_lite.bench import replay as bench
from sarathi_lite.bench.results import BenchResult
from sarathi_lite.bench.workload import Workload
from sarathi_lite.cli import main
from sarathi_lite.costs import ProfiledCostModel, roofline
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.engine.model_runner import ModelRunner
from sarathi_lite.scheduler import POLICIES, SchedulerConfig
from sarathi_lite.sim.cost_model import ReplayCostModel
from sarathi_lite.sim.simulator import run as sim_run
from sarathi_lite.sim.simulator import simulate
from sarathi_lite.sim.validate import validate

ENGINE = dict(block_size=4, num_kv_blocks=30, device="cpu")  # 120 token slots: the offline run preempts
CHUNK = 16
CONFIGS = [(p, CHUNK) for p in POLICIES]
ONLINE = Workload.synthetic("uniform:8-60:10-60", num_requests=14, qps=60.0, seed=11)  # a step takes ~1-2 ms


class VirtualClock:
    """Seconds that pass only while the model runs (by its measured wall time) or while the replay sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)


@contextlib.contextmanager
def virtual_time(clock: VirtualClock) -> Iterator[None]:
    """The model runner's measured wall time and the replay's sleeps advance ``clock``, nothing else does."""
    execute = ModelRunner.execute

    def timed(self, out, params, **kwargs):
        t0 = time.perf_counter()
        result = execute(self, out, params, **kwargs)
        clock.now += time.perf_counter() - t0
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelRunner, "execute", timed)
        mp.setattr(bench.time, "sleep", clock.sleep)
        yield


def batches(result: BenchResult) -> list[tuple[tuple[str, int], ...]]:
    return [it.batch for it in result.stats.iterations]


def scheduler_config(result: BenchResult) -> SchedulerConfig:
    """The real run's scheduler configuration, from its record."""
    c = result.config
    return SchedulerConfig(policy=c["policy"], chunk_size=c["chunk_size"] or 512, max_num_seqs=c["max_num_seqs"],
                           block_size=c["block_size"], num_blocks=c["num_kv_blocks"], max_model_len=c["max_model_len"],
                           enable_prefix_caching=c["enable_prefix_caching"], hol_protection=c["hol_protection"])


@pytest.fixture(scope="module")
def one_thread():
    """Tiny-model steps take about a millisecond on one thread; two threads spin on a busy 2-core CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def offline(tiny_checkpoints, one_thread):
    workload = Workload.synthetic("uniform:8-40:2-16", num_requests=10, seed=5)
    return workload, bench.run(workload, configs=CONFIGS, model=tiny_checkpoints["llama"], progress=False,
                               record_batches=True, **ENGINE)


@pytest.fixture(scope="module")
def online(tiny_checkpoints, one_thread):
    clock = VirtualClock()
    with virtual_time(clock):
        return bench.run(ONLINE, configs=CONFIGS, model=tiny_checkpoints["llama"], progress=False,
                         record_batches=True, clock=clock, block_size=4, num_kv_blocks=512, device="cpu")


@pytest.mark.parametrize("cost_model", [ProfiledCostModel((1, 64), (0.01, 0.02)),
                                        roofline("h100", "smollm2-135m")], ids=["linear", "roofline"])
def test_all_at_once_every_policy_schedules_the_real_batches_with_any_cost_model(offline, cost_model):
    workload, real = offline
    assert sum(r.summary()["num_preemptions"] for r in real) > 0  # the small pool is exercised
    for r in real:
        sim = simulate(workload, cost_model, scheduler_config(r), chunk_size=r.config["chunk_size"],
                       record_batches=True)
        assert batches(sim) == batches(r), r.label
        assert sim.summary()["num_preemptions"] == r.summary()["num_preemptions"]


def test_online_every_policy_schedules_the_real_batches_when_replaying_measured_step_times(online):
    for r in online:
        sim = simulate(ONLINE, ReplayCostModel.from_result(r), scheduler_config(r), chunk_size=r.config["chunk_size"],
                       record_batches=True)
        assert batches(sim) == batches(r), r.label
        real_ms = {m.request_id: m for m in r.stats.requests}
        for m in sim.stats.requests:
            real_m = real_ms[m.request_id]
            assert m.ttft == pytest.approx(real_m.ttft, abs=1e-9)
            assert m.tbt == pytest.approx(real_m.tbt, abs=1e-9)
            assert m.scheduling_delay == pytest.approx(real_m.scheduling_delay, abs=1e-9)


def test_online_arrivals_shape_the_batches(online):
    """The check above is not vacuous: the online runs interleave requests, and other step times than the
    measured ones would have batched them differently."""
    sarathi = next(r for r in online if r.config["policy"] == "sarathi")
    assert max(len(b) for b in batches(sarathi)) >= 3
    slower = simulate(ONLINE, ProfiledCostModel((1, 2), (0.02, 0.02)), scheduler_config(sarathi), record_batches=True)
    assert batches(slower) != batches(sarathi)


def test_a_simulated_result_has_the_bench_result_schema(online):
    real = online[0]
    sim = sim_run(ONLINE, roofline("h100", "smollm2-135m"), configs=[(real.config["policy"], CHUNK)],
                  block_size=4, num_kv_blocks=512, max_model_len=real.config["max_model_len"])[0]
    r, s = real.to_dict(), sim.to_dict()
    assert s.keys() == r.keys() and s["schema"] == r["schema"]
    assert s["config"].keys() == r["config"].keys()
    assert {k: s["config"][k] for k in ("label", "policy", "chunk_size", "token_budget", "num_kv_blocks")} == \
        {k: r["config"][k] for k in ("label", "policy", "chunk_size", "token_budget", "num_kv_blocks")}
    assert s["summary"].keys() == r["summary"].keys()
    assert s["workload"] == r["workload"]
    assert s["requests"][0].keys() == r["requests"][0].keys()
    assert s["iterations"][0].keys() == r["iterations"][0].keys()
    assert s["meta"]["replay"] == "simulated" and r["meta"]["replay"] == "real-time"
    assert BenchResult.from_json(sim.to_json()).summary() == sim.summary()
    assert {k: v[0].keys() for k, v in sim.tables().items()} == {k: v[0].keys() for k, v in real.tables().items()}


AUTO_PREDICTOR = ProfiledCostModel((1, 64), (0.002, 0.008))  # 2 ms + ~0.1 ms per token


@pytest.mark.parametrize("policy", ["sarathi", "simple_chunking"])
def test_online_auto_budget_schedules_the_real_batches_when_replaying_measured_step_times(
        tiny_checkpoints, one_thread, policy):
    """``chunk_size="auto"``: the engine corrects the predictor with every measured step; the simulator, fed the
    same step times, makes the same corrections and so the same budgets."""
    clock = VirtualClock()
    with virtual_time(clock):
        engine = LLMEngine(tiny_checkpoints["llama"], scheduler=policy, chunk_size="auto", tbt_slo=0.006,
                           budget_safety=1.0, min_chunk_size=4, cost_model=AUTO_PREDICTOR, clock=clock,
                           record_batches=True, block_size=4, num_kv_blocks=512, device="cpu")
        real = bench.replay(engine, ONLINE, progress=False)
    assert real.config["chunk_size"] == "auto" and real.config["tbt_slo"] == 0.006
    assert engine.scheduler.budget.correction != 1.0  # the measured steps moved the predictions
    prefill = {it.num_prefill_tokens for it in real.stats.iterations}
    assert len(prefill) > 3  # the budget varied
    config = SchedulerConfig(policy=policy, chunk_size="auto", tbt_slo=0.006, budget_safety=1.0, min_chunk_size=4,
                             block_size=4, num_blocks=512, max_model_len=real.config["max_model_len"])
    sim = simulate(ONLINE, ReplayCostModel.from_result(real), config, predictor=AUTO_PREDICTOR, record_batches=True)
    assert batches(sim) == batches(real)
    # Not vacuous: with the predictor's own step times (so no correction), other budgets and batches.
    uncorrected = simulate(ONLINE, AUTO_PREDICTOR, config, record_batches=True)
    assert batches(uncorrected) != batches(real)


def test_validate_rebuilds_every_real_batch_and_groups_the_step_errors(online, tmp_path, capsys):
    constant = ProfiledCostModel((1, 2), (0.001, 0.001))  # 1 ms, whatever the batch
    for r in online:
        check = validate(r, constant, long_context=40)
        assert check.unmatched == 0 and len(check.steps) == len(r.stats.iterations), r.label
        assert [s.measured for s in check.steps] == [it.step_time for it in r.stats.iterations]
        assert all(s.error == pytest.approx(0.001 / s.measured - 1) for s in check.steps)
    sarathi = validate(next(r for r in online if r.config["policy"] == "sarathi"), constant, long_context=40)
    groups = {(g["kind"], g["context"]): g for g in sarathi.groups()}
    assert {k for k, _ in groups} == {"decode-only", "chunk-only", "hybrid", "all"}
    assert {c for _, c in groups} == {"short", "long", "all"}
    assert sum(g["n"] for k, g in groups.items() if k[0] != "all") == groups["all", "all"]["n"]
    ratios = sorted(s.measured / 0.001 for s in sarathi.steps)  # scale: the median measured / predicted
    assert sarathi.scale == pytest.approx(float(np.median(ratios)))
    # by step size: every step in exactly one bin, by its query tokens
    its = next(r for r in online if r.config["policy"] == "sarathi").stats.iterations
    assert [s.tokens for s in sarathi.steps] == [it.num_prefill_tokens + it.num_decode_tokens for it in its]
    sizes = sarathi.by_size()
    assert sum(g["n"] for g in sizes) == len(sarathi.steps) and sum(g["time_share"] for g in sizes) == pytest.approx(1)
    path = tmp_path / "run.json"
    online[0].to_json(path)
    assert main(["sim", "--cost-model", "roofline:h100:smollm2-135m", "--validate", str(path),
                 "--out", str(tmp_path / "validated")]) == 0
    text = capsys.readouterr().out
    written = tmp_path / "validated" / "validate_run.json"
    assert "decode-only" in text and "step tokens" in text and written.is_file()
    assert json.loads(written.read_text())["by_size"]
    simulated = simulate(ONLINE, constant, scheduler_config(online[0]))
    with pytest.raises(ValueError, match="needs a real run"):
        validate(simulated, constant)
