"""``benchmarks/vs_vllm.py`` (our engine against vLLM's CPU build) run small: ``--quick --rates`` (one round,
float32, four offline requests, no online rates), against the real vLLM in the environment ``scripts/setup_vllm.sh``
makes (found as ``tests/test_vllm_plugin.py`` finds it). A check of the script, of what it records and of greedy
equality with vLLM, not of its timings. Offline only, so vLLM starts once (its start-up, 80-110 s on 2 cores, is
most of this test's time); the online half drives ``sarathi-lite serve`` and ``vllm serve`` through the same
``Server`` and client that ``tests/test_vllm_plugin.py`` and ``benchmarks/vllm_plugin.py`` already run, and the full
measurement runs it (the command is in the script's docstring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.test_layout import provenance_problems
from tests.test_vllm_plugin import ROOT, VENV

TIMEOUT = 900  # seconds: one vLLM start-up (80-110 s on 2 cores) and two short offline runs


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_VENV"}
    return subprocess.run([sys.executable, "benchmarks/vs_vllm.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)


def test_quick_run_measures_both_engines_and_compares_their_greedy_outputs(tmp_path):
    assert (VENV / "bin" / "python").exists(), f"no vLLM environment at {VENV}: run scripts/setup_vllm.sh"
    out = tmp_path / "vs_vllm.json"
    result = _run("--quick", "--rates", "--vllm-venv", str(VENV), "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = json.loads(out.read_text())
    assert provenance_problems("vs_vllm.json", report) == []  # command, commit, machine; no path of this machine
    assert report["versions"]["vllm"] and report["rounds"] == 1

    offline = {(r["system"], r["dtype"]): r for r in report["offline"]}
    assert set(offline) == {("ours", "float32"), ("vllm", "float32")}
    for row in offline.values():
        assert row["output_tokens_per_s"] > 0 and 0 < row["startup_s"] < row["process_s"], row
        assert len(row["load_before"]) == len(row["load_after"]) == 3
    [greedy] = report["greedy"]  # float32, round 0: every request compared token for token
    assert greedy["dtype"] == "float32" and greedy["requests"] == 4
    assert greedy["identical"] == 4 and greedy["differ"] == [], greedy  # as vLLM's own greedy outputs
    assert report["online"] == [] and report["online_startup"] == []

    summary = report["summary"]
    assert summary["offline"]["float32"]["ours_over_vllm"] > 0
    table = out.with_suffix(".md").read_text()
    assert "| float32 |" in table and "4/4 requests identical token for token" in table


def test_without_vllm_it_says_so_and_measures_nothing(tmp_path):
    out = tmp_path / "vs_vllm.json"
    result = _run("--vllm-venv", str(tmp_path / "no-venv"), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "vLLM is not installed" in result.stdout and "scripts/setup_vllm.sh" in result.stdout
    assert not out.exists()
