"""The slow commands stopped midway (SIGINT, as Ctrl-C sends, or SIGTERM) save what they finished, say where and
that it is partial, and exit with status 130: each runs as a real subprocess on tiny settings, is signalled once
its progress bar shows finished work, and must stop within a bounded time."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd

from sarathi_lite.bench.results import BenchResult
from sarathi_lite.cli import main
from sarathi_lite.cli.common import STOPPED

H100 = "roofline:h100:llama3-8b"
# A simulated workload whose every configuration takes about a second here: enough for a signal to land midway.
SLOW_SIM = ["--lengths", "uniform:100-2000:50-200", "--num-requests", "300", "--qps", "30"]


def _stop_midway(argv: list[str], cwd: Path, ready: str, sig: int = signal.SIGINT) -> tuple[int, str, str]:
    """Run ``sarathi-lite argv`` in ``cwd``, send ``sig`` once its stderr matches ``ready`` (a progress bar's
    finished work), and return its exit status, stdout and stderr. Fails if ``ready`` never shows within 240 s
    or the command has not stopped 120 s after the signal."""
    # SIGINT's default action restored in the child: a test run started in the background by a non-interactive
    # shell (`pytest &`) ignores SIGINT, a child inherits that, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, "-m", "sarathi_lite", *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(1), "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    try:
        while not re.search(ready, "".join(err)):
            assert proc.poll() is None, f"finished before {ready!r} showed: {''.join(err)[-2000:]}"
            assert time.monotonic() < deadline, f"{ready!r} did not show in 240 s: {''.join(err)[-2000:]}"
            time.sleep(0.05)
        proc.send_signal(sig)
        out = proc.stdout.read()
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    reader.join(timeout=10)
    return code, out, "".join(err)


def test_profile_stopped_saves_its_raw_timings_beside_the_profile_which_sim_refuses(tiny_checkpoints, tmp_path,
                                                                                    capsys):
    code, _, err = _stop_midway(["profile", "--model", str(tiny_checkpoints["llama"]), "--quick", "--repeats", "200",
                                 "--max-tokens", "64", "--max-context", "64", "--max-decodes", "8", "--block-size",
                                 "4", "--num-kv-blocks", "256", "--device", "cpu", "--threads", "1",
                                 "--out", "profile.json"], tmp_path, r"profile:.*\s(\d{2,})/\d+")
    assert code == STOPPED, err[-2000:]
    assert not (tmp_path / "profile.json").exists()  # a whole profile is never replaced by a partial one
    partial = json.loads((tmp_path / "profile.partial.json").read_text())
    assert "partial results: the raw timings so far in profile.partial.json" in err
    done, total = map(int, re.fullmatch(r"(\d+) of (\d+) timed runs", partial["partial"]).groups())
    samples = partial["meta"]["samples"]
    assert 10 <= done < total and sum(len(s["runs"]) for s in samples) == done
    assert all(s["runs"] and all(t > 0 for t in s["runs"]) and s["terms"]["tokens"] > 0 for s in samples)
    assert partial["meta"]["grid"]["repeats"] == 200 and partial["meta"]["model"] == "llama"

    assert main(["sim", "--cost-model", str(tmp_path / "profile.partial.json")]) == 2
    message = capsys.readouterr().err
    assert "profile.partial.json" in message and f"a partial profile, stopped after {done} of {total}" in message


def test_sim_stopped_saves_the_configurations_it_finished(tmp_path):
    code, out, err = _stop_midway(["sim", "--cost-model", H100, *SLOW_SIM, "--policies", "sarathi",
                                   "--chunk-sizes", "16,32,48,64,96,128,192,256,384,512", "--out", "run"],
                                  tmp_path, r"sim:.*\s[1-9]\d*/10\b")
    assert code == STOPPED, err[-2000:]
    note = json.loads((tmp_path / "run" / "stopped.json").read_text())
    done = int(re.fullmatch(r"(\d+) of 10 configurations", note["stopped"]).group(1))
    assert 1 <= done < 10 and f"stopped after {done} of 10 configurations" in err and "partial results" in err
    summary = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert len(summary) == done
    finished = sorted(tmp_path.glob("run/sarathi_*.json"))
    assert len(finished) == done and all(BenchResult.from_json(p).summary()["num_requests"] == 300 for p in finished)
    assert "config" in out  # the table of those finished is printed too


def test_sim_capacity_stopped_saves_the_searches_so_far(tmp_path):
    code, _, err = _stop_midway(["sim", "--cost-model", H100, *SLOW_SIM, "--capacity", "--tbt-slo", "0.02",
                                 "--qps-low", "1", "--qps-high", "60", "--probes", "8", "--policies",
                                 "sarathi,simple_chunking,vllm,orca", "--chunk-size", "64", "--out", "cap"],
                                tmp_path, r"sim:.*\s[1-9]\d*/32\b")
    assert code == STOPPED, err[-2000:]
    found = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    assert 1 <= len(found) <= 4 and found[-1]["stopped"].endswith("of at most 8 probes")
    assert all("stopped" not in c for c in found[:-1])
    assert sum(len(c["probes"]) for c in found) >= 1
    assert json.loads((tmp_path / "cap" / "stopped.json").read_text())["stopped"]


def test_sweep_stopped_by_sigterm_writes_the_points_it_finished_beside_the_csv(tmp_path):
    rates = ",".join(str(q) for q in range(10, 40, 3))  # 10 rates
    code, _, err = _stop_midway(["sweep", "--cost-models", H100, *SLOW_SIM, "--qps-list", rates, "--policies",
                                 "sarathi", "--chunk-sizes", "32", "--workers", "1", "--out", "sweep.csv"],
                                tmp_path, r"sweep:.*\s[1-9]\d*/10\b", signal.SIGTERM)
    assert code == STOPPED, err[-2000:]
    assert not (tmp_path / "sweep.csv").exists()
    frame = pd.read_csv(tmp_path / "sweep.partial.csv")
    assert 1 <= len(frame) < 10 and f"stopped after {len(frame)} of 10 points" in err
    assert frame["tbt_p99"].notna().all() and set(frame["offered_qps"]) < set(range(10, 40, 3))


def test_bench_stopped_saves_the_configurations_it_finished(tiny_checkpoints, tmp_path):
    code, _, err = _stop_midway(["bench", "--model", str(tiny_checkpoints["llama"]), "--lengths", "fixed:16:4",
                                 "--num-requests", "4", "--qps", "50", "--policies", "sarathi", "--chunk-sizes",
                                 "8,16,32,64,128,256,512,1024", "--block-size", "4", "--num-kv-blocks", "256",
                                 "--threads", "1", "--out", "run"], tmp_path, r"sarathi/32")
    assert code == STOPPED, err[-2000:]
    finished = sorted(tmp_path.glob("run/sarathi_*.json"))
    assert {"sarathi_8.json", "sarathi_16.json"} <= {p.name for p in finished} and len(finished) < 8
    assert all(BenchResult.from_json(p).summary()["num_requests"] == 4 for p in finished)
    assert json.loads((tmp_path / "run" / "stopped.json").read_text())["stopped"] == f"{len(finished)} of 8 " \
                                                                                       f"configurations"


def test_capacity_stopped_saves_the_searches_so_far(tiny_checkpoints, tmp_path):
    code, _, err = _stop_midway(["capacity", "--model", str(tiny_checkpoints["llama"]), "--lengths", "fixed:16:4",
                                 "--num-requests", "4", "--policies", "sarathi,vllm", "--tbt-slo", "10",
                                 "--qps-low", "5", "--qps-high", "100", "--block-size", "4", "--num-kv-blocks",
                                 "256", "--threads", "1", "--out", "cap"], tmp_path, r"vllm")
    assert code == STOPPED, err[-2000:]
    sarathi, vllm = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    assert sarathi["label"] == "sarathi/512" and "stopped" not in sarathi and sarathi["capacity"] == 100
    assert vllm["label"] == "vllm" and vllm["stopped"].endswith("of at most 5 probes")


def test_plan_stopped_writes_the_ranking_so_far_and_exits_non_zero(tmp_path):
    code, out, err = _stop_midway(["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "2", "--ttft-slo",
                                   "1", "--tbt-slo", "0.05", "--num-requests", "60", "--max-requests", "120",
                                   "--workers", "1", "--json", "plan.json"], tmp_path, r"plan: coarse.*\s[1-9]\d*/")
    assert code == STOPPED, err[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert "candidates searched" in plan["stopped"] and plan["entries"]
    assert "Stopped:" in out and "in plan.json" in err
