"""The vLLM plugin's tests (tests/vllm_plugin/) on the real vLLM CPU build, run in the virtual environment that
``scripts/setup_vllm.sh`` makes (vLLM pins transformers < 5.20; this interpreter tracks the newest)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from sarathi_lite.models import builtin

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
TIMEOUT = 1500  # seconds: four in-process engines and one `vllm serve`, each with vLLM's slow start-up


def test_plugin_suite_passes_inside_real_vllm():
    python = VENV / "bin" / "python"
    assert python.exists(), f"no vLLM environment at {VENV}: run scripts/setup_vllm.sh (scripts/setup.sh does)"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["SARATHI_SMOLLM2"] = str(builtin.resolve_model("smollm2-135m"))  # converted here, where gguf is installed
    result = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/vllm_plugin"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    tail = result.stdout[-6000:]
    print(tail)
    assert result.returncode == 0, tail + result.stderr[-3000:]
    assert " passed" in tail and "failed" not in tail and "error" not in tail.splitlines()[-1], tail
