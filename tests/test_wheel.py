"""The package works installed, not only from the checkout: build a wheel, install it (not editable) into a fresh
virtual environment, and from a folder outside the checkout load a built-in trace (package data), build the CPU
kernel from its shipped source, print
``sarathi-lite bench --help`` and run a 3-request synthetic ``bench`` on a tiny random model."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def _dependency_paths() -> list[str]:
    """This interpreter's site folders (torch, numpy, ... live there) without the checkout: the new venv sees
    the dependencies through a .pth file, but not this checkout's editable install (a .pth in a folder that a
    .pth lists is not run)."""
    folders = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    keep = []
    for p in folders:
        path = Path(p) if p else None
        if path is None or not path.is_dir() or path == ROOT or ROOT in path.parents or str(path) in keep:
            continue
        keep.append(str(path))
    return keep


def test_a_built_wheel_runs_from_outside_the_checkout(tmp_path, tiny_checkpoints):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SARATHI_LITE_TRACES")}
    env["OMP_NUM_THREADS"] = "1"
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
          str(ROOT)], tmp_path, env)
    (wheel,) = wheels.glob("sarathi_lite-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        tmp_path, env).strip())
    (purelib / "dependencies.pth").write_text("\n".join(_dependency_paths()) + "\n")
    _run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--no-index", str(wheel)], tmp_path, env)
    script = venv / "bin" / "sarathi-lite"

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = _run([str(python), "-c", "import sarathi_lite, sarathi_lite.scheduler as s; "
                                     "print(sarathi_lite.__file__); print(s.__file__)"], outside, env)
    assert all(line.startswith(str(purelib)) for line in where.split()), where

    loaded = _run([str(python), "-c", "from sarathi_lite.bench.workload import Workload\n"
                                      "w = Workload.from_trace('conversation', num_requests=3, qps=1.0)\n"
                                      "print(len(w.requests), w.source['trace'])"], outside, env)
    assert loaded.split() == ["3", "conversation"]
    # the compiled CPU kernel's source ships in the wheel and builds from there
    built = _run([str(python), "-c", "import sys; from pathlib import Path\n"
                                     "from sarathi_lite.kernels import cpu_native\n"
                                     "print(cpu_native.SOURCE.is_file(), cpu_native.build(Path(sys.argv[1])).suffix)",
                  str(tmp_path / "native")], outside, env)
    assert built.split() == ["True", ".so"]

    cli = [str(python), "-m", "sarathi_lite"]
    assert "--chunk-size" in _run([*cli, "bench", "--help"], outside, env)
    assert _run([str(script), "bench", "--help"], outside, env).startswith("usage: sarathi-lite bench")
    _run([*cli, "bench", "--model", str(tiny_checkpoints["llama"]), "--lengths", "fixed:8:2", "--num-requests",
          "3", "--qps", "50", "--policies", "sarathi", "--chunk-size", "16", "--block-size", "4",
          "--num-kv-blocks", "64", "--device", "cpu", "--threads", "1", "--no-progress", "--out", "out"],
         outside, env)
    result = json.loads((outside / "out" / "sarathi_16.json").read_text())
    assert result["summary"]["num_requests"] == 3
