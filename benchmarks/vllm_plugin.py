"""vLLM's CPU build with its own scheduler against vLLM with sarathi-lite's plugin, online, on this machine.

Every system is an OpenAI-compatible server on loopback; a workload's servers are all started first (an idle
server takes no CPU), warmed up (``warm_up``), then driven in alternating rounds by the same client
(``sarathi_lite.bench.http_client.replay_http``: streamed, greedy, ``ignore_eos``). A system is named ``kind[@B]``:

- ``vllm@B``: ``vllm serve`` with its default scheduler and ``--max-num-batched-tokens B``; plain ``vllm``: with
  vLLM's own default budget (what a user gets without tuning);
- ``plugin@B``: the same with ``--scheduler-cls sarathi_lite.integrations.vllm.SarathiScheduler`` and a fixed
  ``chunk_size`` B (vLLM's budget too: what differs is decodes first and head-of-line protection);
- ``plugin-auto[@B]``: the plugin with ``chunk_size="auto"`` at the TBT SLO (``--tbt-slo``) on ``--cost-model``
  (a profile of this machine, corrected online by the plugin's measured step times), under vLLM's budget B;
- ``sarathi-lite[@B]``: our own engine's server on the same model, at chunk size B or ``auto``, for the reader.

Workloads: a long-tail mix (``--long-every``-th prompt ``--long-prompt`` tokens, the others 32-256) at ``--qps``,
with short and long requests' TTFT apart (``--long-tail-systems``); and the scaled conversation trace at each of
``--rates`` (``--capacity-systems``; the fixed budgets swept are the ``vllm@B``). Capacity: the highest rate whose
P99 TBT meets the SLO with TTFT p50 within ``--max-ttft-p50`` in every round (a client cannot see the scheduling
delay, so the TTFT median stands in for it); a system that misses at one rate is not run at the higher ones.

    python benchmarks/vllm_plugin.py                      # about 45 minutes on 2 cores, nothing else running
    python benchmarks/vllm_plugin.py --quick              # one round, small, a check of the script (minutes)

Prints a table and writes ``--out`` (JSON: command, date, commit, load average; no machine paths).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from sarathi_lite.bench.http_client import replay_http
from sarathi_lite.bench.results import commit, portable_arg
from sarathi_lite.bench.workload import Workload
from sarathi_lite.models import builtin

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "sarathi_lite.integrations.vllm.SarathiScheduler"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process on loopback; ``stop()`` ends it (and every process it started)."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict[str, str]) -> None:
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        self._sink = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._sink, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.started = time.monotonic()

    def wait(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} did not start within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout=30)
        self._sink.close()


def _spec(name: str) -> tuple[str, int | None]:
    """``"vllm@512"`` -> ``("vllm", 512)``; ``"vllm"`` -> ``("vllm", None)``: vLLM's own default budget."""
    kind, _, budget = name.partition("@")
    if kind not in ("vllm", "plugin", "plugin-auto", "sarathi-lite") or (budget and not budget.isdigit()):
        raise SystemExit(f"unknown system {name!r}: vllm[@B], plugin[@B], plugin-auto[@CAP], sarathi-lite[@B]")
    return kind, int(budget) if budget else None


def servers(args: argparse.Namespace, names: list[str], model: Path, logs: Path) -> dict[str, Server]:
    """One server per system name (see ``_spec``): ``vllm`` without ``@B`` runs with vLLM's own default
    ``--max-num-batched-tokens``; the plugins' ``@B`` is vLLM's budget (the fixed plugin's chunk size too, and the
    cap ``auto`` picks under); ``sarathi-lite@B`` is our server at chunk size B, without ``@B`` at ``auto``."""
    venv_python = Path(args.vllm_venv) / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    common = [str(model), "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
              "--served-model-name", "m", "--no-enable-prefix-caching"]
    vllm = [str(venv_python.with_name("vllm")), "serve"]
    cost_model = str(Path(args.cost_model).resolve())
    out = {}
    for name in names:
        kind, budget = _spec(name)
        if kind == "sarathi-lite":
            chunk = ["--chunk-size", str(budget)] if budget else \
                ["--chunk-size", "auto", "--tbt-slo", str(args.tbt_slo), "--cost-model", cost_model]
            cmd = [sys.executable, "-m", "sarathi_lite", "serve", "--model", str(model), "--host", "127.0.0.1",
                   "--threads", str(args.threads), "--served-model-name", "m", "--no-enable-prefix-caching", *chunk]
        else:
            if kind != "vllm" and budget is None:
                budget = args.budget
            cmd = vllm + common + ([] if budget is None else ["--max-num-batched-tokens", str(budget)])
            if kind == "plugin":
                cmd += ["--scheduler-cls", PLUGIN, "--additional-config",
                        json.dumps({"sarathi_lite": {"chunk_size": budget}})]
            elif kind == "plugin-auto":
                cmd += ["--scheduler-cls", PLUGIN, "--additional-config", json.dumps(
                    {"sarathi_lite": {"chunk_size": "auto", "tbt_slo": args.tbt_slo, "cost_model": cost_model}})]
        port = _free_port()
        out[name] = Server(name, cmd + ["--port", str(port)], port, logs / f"{name.replace('@', '_')}.log", env)
    return out


def _trace(path: Path, lengths: list[tuple[int, int]], qps: float, seed: int) -> Workload:
    """A workload of ``(prompt tokens, output tokens)`` pairs at ``qps`` (Poisson from ``seed``), through a trace
    file at ``path``."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["num_prefill_tokens", "num_decode_tokens"])
        w.writerows(lengths)
    return Workload.from_trace(path, qps=qps, seed=seed)


def long_tail(tmp: Path, seed: int, num_requests: int, qps: float, long_prompt: int, long_every: int) -> Workload:
    """The long-tail mix: every ``long_every``-th prompt ``long_prompt`` tokens, the others 32-256, outputs 32-64,
    Poisson at ``qps``, all drawn from ``seed`` (its trace file under ``tmp``)."""
    rng = np.random.default_rng(seed)
    lengths = [(long_prompt if i % long_every == long_every - 1 else int(rng.integers(32, 257)),
                int(rng.integers(32, 65))) for i in range(num_requests)]
    return _trace(tmp / f"long_tail_{seed}.csv", lengths, qps, seed)


def conversation(args: argparse.Namespace, qps: float, seed: int) -> Workload:
    return Workload.from_trace("conversation", num_requests=args.capacity_requests, qps=qps, prompt_scale=0.25,
                               output_scale=0.25, max_prompt=1024, max_output=128, seed=seed)


WARM_UP_LOAD, WARM_UP_WAIT = 1.0, 180.0
"""After the warm-up, measuring starts once the 1-minute load average is under WARM_UP_LOAD (or WARM_UP_WAIT s)."""


def warm_up(running: dict[str, Server], tmp: Path) -> None:
    """Send every server a few requests of the step sizes the workloads bring (prompts of 32 to 2,000 tokens, some
    at once), discarded: a server's first steps of a new size are slower (its CPU kernels pick their primitives on
    first use), and the first system measured after start-up must not pay for it alone. Then wait for the machine
    to settle (``WARM_UP_LOAD``)."""
    prompts = (32, 96, 256, 700, 2000, 64, 128, 512)
    workload = _trace(tmp / "warm_up.csv", [(p, 16) for p in prompts], qps=4.0, seed=0)
    for server in running.values():
        replay_http(workload, server.url, model="m", progress=False, timeout=600.0)
    deadline = time.monotonic() + WARM_UP_WAIT
    while os.getloadavg()[0] > WARM_UP_LOAD and time.monotonic() < deadline:
        time.sleep(5.0)


def summarize(result: Any, long_threshold: int) -> dict[str, Any]:
    s = result.summary()
    cells = {k: s.get(k) for k in ("ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99", "throughput_output_tokens_per_s",
                                   "num_requests")}
    for name, keep in (("short", lambda r: r.num_prompt_tokens < long_threshold),
                       ("long", lambda r: r.num_prompt_tokens >= long_threshold)):
        ttft = [r.ttft for r in result.stats.requests if r.ttft is not None and keep(r)]
        cells[f"{name}_ttfts"] = [round(t, 4) for t in ttft]
        if ttft:
            cells[f"{name}_ttft_p50"] = float(np.percentile(ttft, 50))
            cells[f"{name}_ttft_p99"] = float(np.percentile(ttft, 99))
    cells["errors"] = result.meta.get("num_errors", 0)
    cells["duration_s"] = s.get("duration")
    cells["output_tokens"] = s.get("output_tokens")
    return cells


def pooled(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system, the long-tail rounds taken as one run: short and long requests' TTFT p50/p99 over every round's
    requests (``short_ttfts`` / ``long_ttfts``), and throughput as all rounds' output tokens over the sum of their
    spans. A round's p99 over its 35 short requests is its second-worst request, so one burst decides it; over
    the rounds pooled it is a percentile of the mix."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["system"] for r in rows if r["workload"] == "long-tail"):
        mine = [r for r in rows if r["system"] == name and r["workload"] == "long-tail" and "short_ttfts" in r]
        if not mine:
            continue
        cell: dict[str, Any] = {"rounds": sorted(r["round"] for r in mine)}
        for kind in ("short", "long"):
            ttft = [t for r in mine for t in r[f"{kind}_ttfts"]]
            cell[f"{kind}_requests"] = len(ttft)
            if ttft:
                cell[f"{kind}_ttft_p50"] = float(np.percentile(ttft, 50))
                cell[f"{kind}_ttft_p99"] = float(np.percentile(ttft, 99))
        span = sum(r["duration_s"] for r in mine)
        cell["throughput_output_tokens_per_s"] = sum(r["output_tokens"] for r in mine) / span if span else None
        out[name] = cell
    return out


def _meets(row: dict[str, Any], args: argparse.Namespace) -> bool:
    return (row["tbt_p99"] is not None and row["tbt_p99"] <= args.tbt_slo and row["ttft_p50"] is not None
            and row["ttft_p50"] <= args.max_ttft_p50 and not row["errors"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--long-tail-systems", nargs="*", default=["vllm@512", "plugin@512", "plugin-auto@2048"],
                   help="systems on the long-tail mix (vllm[@B], plugin[@B], plugin-auto[@CAP], sarathi-lite[@B])")
    p.add_argument("--capacity-systems", nargs="*",
                   default=["vllm", "vllm@256", "vllm@512", "plugin-auto@2048", "sarathi-lite"],
                   help="systems on the conversation trace at each rate (the fixed budgets swept are vllm@B)")
    p.add_argument("--budget", type=int, default=512, help="vLLM's budget for plugin / plugin-auto without @B")
    p.add_argument("--tbt-slo", type=float, default=1.065, help="seconds: the README's CPU SLO (P99 TBT)")
    p.add_argument("--max-ttft-p50", type=float, default=2.0, help="seconds, with the SLO, for capacity")
    p.add_argument("--cost-model", default=str(ROOT / "benchmarks" / "results" / "sim_profile_smollm2_2026-12-03.json"))
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--qps", type=float, default=0.5, help="the long-tail mix's rate (requests/s)")
    p.add_argument("--long-prompt", type=int, default=3000)
    p.add_argument("--long-every", type=int, default=8)
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.75, 1.0, 1.5, 2.0],
                   help="the conversation trace's rates, ascending; a system that misses the SLO at one is not run "
                        "at the higher ones in that round")
    p.add_argument("--capacity-requests", type=int, default=32, help="requests per conversation cell")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--first-round", type=int, default=0,
                   help="the first round's number (round r draws its workloads from seed r; odd rounds run the "
                        "systems in reverse order): to add rounds to an earlier run")
    p.add_argument("--threads", type=int, default=2, help="sarathi-lite's torch threads")
    p.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"))
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="one round, 8 requests, one rate: a check of the script")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_plugin.json"))
    args = p.parse_args()
    if args.quick:
        args.rounds, args.num_requests, args.capacity_requests, args.rates = 1, 8, 8, [0.5]
        args.long_prompt, args.long_every = 600, 4
    if not (Path(args.vllm_venv) / "bin" / "python").exists():
        sys.exit(f"vLLM is not installed at {args.vllm_venv}: run scripts/setup_vllm.sh first")
    if args.rates != sorted(args.rates):
        sys.exit(f"--rates {args.rates} must be ascending")
    model = Path(args.model) if args.model else Path(builtin.resolve_model("smollm2-135m"))
    tmp = Path(tempfile.mkdtemp(prefix="vllm-plugin-"))
    rows: list[dict[str, Any]] = []
    startup: dict[str, dict[str, float]] = {}
    started = time.time()
    code = commit()  # the code that runs: taken before, not after

    def write(complete: bool) -> dict[str, float]:
        """Write the report to ``--out`` (after every cell, so a run stopped early keeps what it measured;
        ``complete`` is false until the last cell) and return the capacities (requests/s: the highest rate met
        in every round; 0 where a rate lacks a round)."""
        capacity = {}
        for name in args.capacity_systems:
            mine = [r for r in rows if r["system"] == name and r["workload"] == "conversation"]
            passing = [q for q in args.rates
                       if len([r for r in mine if r["qps"] == q]) == args.rounds
                       and all(_meets(r, args) for r in mine if r["qps"] <= q)]
            capacity[name] = max(passing, default=0.0)
        report = {"command": "python benchmarks/vllm_plugin.py " + " ".join(portable_arg(a) for a in sys.argv[1:]),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                  "commit": code, "machine": f"{os.cpu_count()} CPUs", "wall_s": round(time.time() - started),
                  "complete": complete, "startup_s": startup, "capacity_rps": capacity,
                  "long_tail_pooled": pooled(rows), "rows": rows,
                  "options": {k: v for k, v in vars(args).items() if k not in ("model", "vllm_venv", "out",
                                                                              "cost_model")},
                  "cost_model": Path(args.cost_model).name}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        return capacity

    def drive(url: str, name: str, workload_name: str, qps: float, rnd: int, wl: Workload) -> dict[str, Any]:
        load = os.getloadavg()[0]
        result = replay_http(wl, url, model="m", progress=False, timeout=900.0)
        row = {"system": name, "workload": workload_name, "qps": qps, "round": rnd, "load_average": round(load, 2),
               **summarize(result, args.long_prompt)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        write(complete=False)
        return row

    # One phase per workload, each with only its own servers up: a vLLM-CPU server holds about 3-4 GB (its
    # worker, engine core and API server), so more than four at once do not fit in 24 GB.
    for phase, names in (("long-tail", args.long_tail_systems), ("conversation", args.capacity_systems)):
        if not names:
            continue
        running = servers(args, names, model, tmp)
        try:
            startup[phase] = {name: round(s.wait(args.start_timeout), 1) for name, s in running.items()}
            warm_up(running, tmp)
            for rnd in range(args.first_round, args.first_round + args.rounds):
                order = names if rnd % 2 == 0 else names[::-1]
                if phase == "long-tail":
                    wl = long_tail(tmp, rnd, args.num_requests, args.qps, args.long_prompt, args.long_every)
                    for name in order:
                        drive(running[name].url, name, phase, args.qps, rnd, wl)
                    continue
                failed: set[str] = set()
                for q in args.rates:
                    wl = conversation(args, q, rnd)
                    for name in order:
                        if name in failed:
                            continue
                        if not _meets(drive(running[name].url, name, phase, q, rnd, wl), args):
                            failed.add(name)
        finally:
            for s in running.values():
                s.stop()
    capacity = write(complete=True)
    keys = ("ttft_p50", "short_ttft_p99", "long_ttft_p99", "tbt_p50", "tbt_p99", "throughput_output_tokens_per_s")
    print(f"\n{'system':16} {'workload':13} {'qps':>5} " + " ".join(f"{k:>15}" for k in keys))
    for name in dict.fromkeys(r["system"] for r in rows):
        for workload_name, qps in sorted({(r["workload"], r["qps"]) for r in rows}):
            cell = [r for r in rows if r["system"] == name and r["workload"] == workload_name and r["qps"] == qps]
            if not cell:
                continue
            vals = [np.median([r[k] for r in cell if r.get(k) is not None]) if any(r.get(k) is not None for r in cell)
                    else float("nan") for k in keys]
            print(f"{name:16} {workload_name:13} {qps:5.2f} " + " ".join(f"{v:15.3f}" for v in vals))
    print("capacity (req/s, highest rate meeting the SLO in every round):", capacity, "| startup (s):", startup)
    for name, cell in pooled(rows).items():
        print(f"long-tail, rounds pooled: {name:16} short TTFT p50/p99 {cell.get('short_ttft_p50', float('nan')):.3f}"
              f"/{cell.get('short_ttft_p99', float('nan')):.3f} s, long TTFT p50 "
              f"{cell.get('long_ttft_p50', float('nan')):.3f} s, {cell['throughput_output_tokens_per_s']:.2f} "
              f"output tokens/s ({cell['short_requests']} short, {cell['long_requests']} long requests)")


if __name__ == "__main__":
    main()
