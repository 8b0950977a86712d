"""The model-free contract harness (tests/vllm_harness/) on each supported vLLM release's own scheduler code, each
in its virtual environment: 0.32 the CPU build of ``scripts/setup_vllm.sh`` (.venv-vllm/), 0.33 and 0.34 the
CUDA wheels installed model-free by ``scripts/setup_vllm_harness.sh`` (.venv-vllm-0.33/, .venv-vllm-0.34/)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from sarathi_lite.integrations.vllm.version import SUPPORTED_VLLM_VERSIONS

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # seconds: vLLM's import takes 20-45 s on this machine, the tests a few seconds


def venv_of(release: str) -> Path:
    if release == "0.32":
        return Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
    return ROOT / f"{os.environ.get('VLLM_HARNESS_PREFIX', '.venv-vllm-')}{release}"


@pytest.mark.parametrize("release", [v.rsplit(".", 1)[0] for v in SUPPORTED_VLLM_VERSIONS])
def test_contract_harness_passes_on_vllms_own_scheduler(release):
    python = venv_of(release) / "bin" / "python"
    assert python.exists(), (f"no vLLM {release} environment at {python.parent.parent}: run "
                             f"scripts/setup_vllm.sh and scripts/setup_vllm_harness.sh (scripts/setup.sh does)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["SARATHI_EXPECT_VLLM"] = release
    result = subprocess.run([str(python), "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/vllm_harness"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    tail = result.stdout[-6000:]
    print(tail)
    assert result.returncode == 0, tail + result.stderr[-3000:]
    assert " passed" in tail and "failed" not in tail.splitlines()[-1], tail


def test_sim_runs_the_installed_vllms_own_scheduler_beside_ours(tmp_path):
    from sarathi_lite.bench.results import BenchResult
    from sarathi_lite.cli import main

    release = SUPPORTED_VLLM_VERSIONS[-1].rsplit(".", 1)[0]
    assert (venv_of(release) / "bin" / "python").exists(), "run scripts/setup_vllm_harness.sh"
    assert main(["sim", "--policies", f"vllm@{release},sarathi", "--cost-model", "roofline:h100:llama3-8b",
                 "--trace", "conversation", "--num-requests", "30", "--qps", "4", "--chunk-sizes", "256",
                 "--out", str(tmp_path)]) == 0
    ours = BenchResult.from_json(tmp_path / "sarathi_256.json")
    theirs = BenchResult.from_json(tmp_path / f"vllm_{release}_256.json")
    assert theirs.config["vllm_version"].startswith(release + ".") and theirs.config["policy"] == f"vllm@{release}"
    for result in (ours, theirs):
        summary = result.stats.summary()
        assert summary["num_requests"] == 30
        assert summary["output_tokens"] == sum(r.output_len for r in result.workload.requests)


def test_sim_refuses_a_badly_spelled_or_missing_vllm_release(tmp_path, capsys):
    from sarathi_lite.cli import main

    args = ["--cost-model", "roofline:h100:llama3-8b", "--num-requests", "5", "--out", str(tmp_path)]
    assert main(["sim", "--policies", "vllm@latest", *args]) == 2
    assert "policy 'vllm@latest': name a vLLM release as vllm@X.Y" in capsys.readouterr().err
    assert main(["sim", "--policies", "vllm@0.99", *args]) == 2
    assert "policy vllm@0.99: no vLLM 0.99 here" in capsys.readouterr().err
