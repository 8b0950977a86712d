"""``sarathi_lite.sim.sweep``: one DataFrame over workloads x rates x cost models x configurations x SLOs, the same
rows on every backend (serial, a local process pool, a local Ray cluster), and the ``sarathi-lite sweep`` CLI."""

from __future__ import annotations

import pandas as pd
import pytest

from sarathi_lite.bench.capacity import SLO
from sarathi_lite.bench.workload import Workload
from sarathi_lite.cli import main
from sarathi_lite.costs import load_cost_model
from sarathi_lite.sim import sweep
from sarathi_lite.sim.simulator import scheduler_config, simulate

WORKLOADS = {"conv": Workload.from_trace("conversation", num_requests=24, qps=4.0, prompt_scale=1, output_scale=1,
                                         max_prompt=4096, max_output=64),
             "synthetic": Workload.synthetic("uniform:100-2000:8-64", num_requests=24, qps=4.0)}
COSTS = ["roofline:h100:llama3-8b", "roofline-uncalibrated:h100:llama3-8b"]
CONFIGS = [("sarathi", 256), {"policy": "sarathi", "chunk_size": 1024, "max_num_seqs": 8}, "vllm"]
SLOS = [SLO(0.02), SLO(0.1)]


def test_sweep_rows_are_every_combination_in_order_and_match_a_direct_simulation():
    df = sweep(WORKLOADS, COSTS, CONFIGS, SLOS, qps=[2.0, 6.0], backend="serial", progress=False)
    assert len(df) == 2 * 2 * 2 * 3 * 2
    assert list(df["workload"][:24].unique()) == ["conv"] and list(df["offered_qps"][:12].unique()) == [2.0]
    assert list(df["config"][:6]) == ["sarathi/256"] * 2 + ["sarathi/1024"] * 2 + ["vllm"] * 2
    assert (df["meets_slo"] == ((df["tbt_p99"] <= df["tbt_slo"]) & (df["scheduling_delay_p50"] <= 2.0))).all()
    assert df["max_num_seqs"].iloc[2] == 8
    cost = load_cost_model(COSTS[0])
    direct = simulate(WORKLOADS["conv"].at_qps(2.0), cost, scheduler_config(cost, "sarathi", 256),
                      chunk_size=256).summary()
    assert df["tbt_p99"].iloc[0] == direct["tbt_p99"] and df["ttft_p50"].iloc[0] == direct["ttft_p50"]


def test_sweep_is_identical_on_serial_process_pool_and_ray_backends():
    args = ({"conv": WORKLOADS["conv"]}, COSTS, CONFIGS, SLOS)
    serial = sweep(*args, backend="serial", progress=False)
    pool = sweep(*args, backend="process", workers=2, progress=False)
    on_ray = sweep(*args, backend="ray", ray_options={"num_cpus": 2}, progress=False)
    assert len(serial) == 12
    pd.testing.assert_frame_equal(serial, pool)
    pd.testing.assert_frame_equal(serial, on_ray)


def test_capacity_sweep_gives_one_search_per_slo():
    df = sweep({"conv": WORKLOADS["conv"]}, COSTS[:1], ["vllm", ("sarathi", 512)], SLOS, capacity=(0.5, 20.0, 4),
               backend="serial", progress=False)
    assert list(df["tbt_slo"]) == [0.02, 0.1, 0.02, 0.1]
    assert df["probes"].between(2, 4).all()  # a search stops early when its range decides it
    loose, strict = df[df["tbt_slo"] == 0.1], df[df["tbt_slo"] == 0.02]
    assert (loose["capacity"].fillna(0).values >= strict["capacity"].fillna(0).values).all()


def test_bad_sweeps_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="backend='dask'"):
        sweep(WORKLOADS, COSTS, CONFIGS, backend="dask", progress=False)
    with pytest.raises(ValueError, match="at least one configuration"):
        sweep(WORKLOADS, COSTS, [], progress=False)
    with pytest.raises(ValueError, match="capacity sweep needs at least one SLO"):
        sweep(WORKLOADS, COSTS, CONFIGS, capacity=(1, 2, 3), progress=False)
    with pytest.raises(ValueError, match="needs a policy"):
        sweep(WORKLOADS, COSTS, [{"chunk_size": 5}], progress=False)


def test_sweep_cli_writes_the_frame_as_csv(tmp_path, capsys):
    out = tmp_path / "sweep.csv"
    assert main(["sweep", "--cost-models", COSTS[0], "--traces", "conversation,arxiv", "--num-requests", "12",
                 "--policies", "sarathi,vllm", "--chunk-sizes", "256,512", "--tbt-slos", "0.05",
                 "--qps-list", "1,3", "--backend", "serial", "--no-progress", "--out", str(out)]) == 0
    df = pd.read_csv(out)
    assert len(df) == 2 * 2 * 3 and set(df["workload"]) == {"conversation", "arxiv"}
    assert set(df["config"]) == {"sarathi/256", "sarathi/512", "vllm"}
    assert "wrote 12 rows" in capsys.readouterr().out
