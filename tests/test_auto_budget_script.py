"""``benchmarks/auto_budget.py``'s CPU options: ``--cpu-profile`` swaps the CPU setups' measured profile and
``--qps-high`` the capacity searches' highest rate (the engine outgrew the 2026-11-30 profile's 1.0 req/s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEW_PROFILE = "benchmarks/results/sim_profile_smollm2_2026-12-06.json"


def run(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    subprocess.run([sys.executable, "benchmarks/auto_budget.py", "--setups", "smollm2-cpu", "--traces",
                    "conversation", "--probes", "3", "--fixed", "128", *extra, "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    return json.loads(out.read_text())


def test_cpu_profile_and_qps_high_reach_every_search(tmp_path: Path) -> None:
    old = run(tmp_path, "old")
    new = run(tmp_path, "new", "--cpu-profile", NEW_PROFILE, "--qps-high", "2.0")
    for record, top in ((old, 1.0), (new, 2.0)):
        [row] = record["rows"]
        assert {tuple(s["qps_range"]) for s in row["searches"]} == {(0.01, top)}
    assert "--cpu-profile " + NEW_PROFILE in new["command"] and "--cpu-profile" not in old["command"]
    # the faster profile's fixed 128 passes above the old ceiling; on the old profile it is below it
    assert new["rows"][0]["capacity"]["128"] > 1.0 > old["rows"][0]["capacity"]["128"]
