"""The planner on a measured profile of this machine (``Setup(profile=...)``, ``--profile``) and its real check
(``sarathi_lite.plan.real``, ``--real``): degree-1 candidates priced by the profile, the top entries run as instance
processes with the plan's own arguments on the same requests, and the verdict on whether they rank as planned."""

from __future__ import annotations

from pathlib import Path

import pytest

from sarathi_lite.bench.workload import Workload
from sarathi_lite.cli import main
from sarathi_lite.plan import Candidate, Setup, plan, space, table
from sarathi_lite.plan.real import Confirmation, RealRun, confirm, runnable
from sarathi_lite.plan.search import Entry
from sarathi_lite.plan.space import launch, start_rate

PROFILE = str(Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sim_profile_smollm2.json")
CPU = dict(chunk_sizes=(64, 256), prefill_chunk=256, decode_chunk=64, threshold=None)


def cpu_workload(n: int) -> Workload:
    return Workload.from_trace("conversation", num_requests=n, start=1000, qps=1.0, prompt_scale=0.25,
                               output_scale=0.25, max_prompt=1024, max_output=128)


def test_a_profile_prices_one_device_per_instance():
    setup = Setup("smollm2-135m", "cpu", 2, ttft=5.0, tbt=1.065, profile=PROFILE, **CPU)
    found = space(setup)
    assert sorted(c.label for c in found.candidates) == ["1P1D", "1PH1DH/short=64,ttft=300,tbt=64", "2C@256", "2C@64"]
    assert {shape for shape, _ in found.skipped} == {"tp1 pp2", "tp2 pp1"}
    assert all("degree 2" in why for _, why in found.skipped)
    assert 0.01 < start_rate(setup, cpu_workload(50)) < 10  # from the profile, not from Llama-3-8B on an H100
    assert launch(setup, Candidate("2C", chunk_size="auto"))["llm"]["cost_model"] == PROFILE  # auto loads it


def test_a_profile_that_is_not_a_file_is_named():
    with pytest.raises(ValueError, match="no-such.json"):
        Setup("smollm2-135m", "cpu", 2, ttft=5.0, tbt=1.0, profile="no-such.json")


def test_plan_on_a_profile_ranks_and_says_how_it_priced():
    setup = Setup("smollm2-135m", "cpu", 2, ttft=5.0, tbt=1.065, profile=PROFILE, **CPU)
    result = plan(setup, cpu_workload(60), min_requests=30, max_requests=60, fine_probes=1, backend="serial",
                  progress=False)
    goodputs = [e.goodput for e in result.entries]
    assert goodputs == sorted(goodputs, reverse=True) and goodputs[0] > 0
    assert "measured profile sim_profile_smollm2.json" in table(result)


def _entry(layout: str, tp: int = 1, error: str | None = None) -> Entry:
    return Entry(Candidate(layout, tp=tp), [], 0.9, error=error)


def test_runnable_names_what_this_machine_cannot_run():
    assert runnable(_entry("2C"), cpus=2) is None
    assert "tensor/pipeline degree 1" in runnable(_entry("1C", tp=2), cpus=8)
    assert "3 instances need 3 CPUs" in runnable(_entry("3C"), cpus=2)
    assert "failed in the plan" in runnable(_entry("2C", error="boom"), cpus=2)


def _run(label: str, rate: float, attainment: float) -> RealRun:
    return RealRun(label, rate, attainment, 1.0, attainment, 0.1, 0.1, 10, 10, 1.0, 0.5)


def test_the_verdict_compares_attainment_at_every_rate_in_the_plans_order():
    c = Confirmation(["A", "B"], {"A": 2.0, "B": 1.0}, [1.0, 2.0], 0.9,
                     [_run("A", 1.0, 1.0), _run("B", 1.0, 1.0), _run("A", 2.0, 0.9), _run("B", 2.0, 0.5)])
    assert c.agrees and "agrees with the plan" in c.table()
    c.runs[1] = _run("B", 1.0, 1.0)
    c.runs[3] = _run("B", 2.0, 0.95)  # the lower-ranked entry does better at the top entry's goodput
    assert not c.agrees and "does NOT agree" in c.table()
    assert c.to_dict()["agrees"] is False


def test_confirm_runs_the_top_entries_for_real_with_the_plans_arguments(tiny_checkpoints):
    setup = Setup("smollm2-135m", "cpu", 2, ttft=30.0, tbt=5.0, profile=PROFILE,
                  checkpoint=str(tiny_checkpoints["llama"]), **CPU)
    wl = Workload.synthetic("uniform:8-40:3-6", num_requests=12, qps=1.0, seed=3)
    result = plan(setup, wl, min_requests=12, max_requests=12, fine_probes=1, backend="serial", progress=False)
    real = confirm(result, wl, top=2, num_requests=6, rates=[4.0], progress=False)
    assert real.labels == [e.label for e in result.entries if e.goodput > 0][:2]
    assert [(r.label, r.rate) for r in real.runs] == [(label, 4.0) for label in real.labels]
    for r in real.runs:
        assert r.requests == 6 and r.finished == 6  # every request ran to its end on the real instances
        assert r.attainment == 1.0  # SLOs of tens of seconds: a few tiny requests meet them
    assert real.agrees
    with pytest.raises(ValueError, match="top=1"):
        confirm(result, wl, top=1)


def test_cli_plan_takes_a_profile(capsys):
    assert main(["plan", "--model", "smollm2-135m", "--gpu", "cpu", "--gpus", "1", "--profile", PROFILE,
                 "--prompt-scale", "0.25", "--output-scale", "0.25", "--max-prompt", "1024", "--max-output", "128",
                 "--ttft-slo", "5", "--tbt-slo", "1.065", "--chunk-sizes", "64,256", "--num-requests", "20",
                 "--max-requests", "20", "--backend", "serial", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "1C@64" in out and "1C@256" in out and "measured profile" in out
