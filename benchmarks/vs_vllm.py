"""sarathi-lite's engine against vLLM's CPU build on this machine: the same token-id prompts, offline and online.

The full measurement (an estimate, not yet timed: about 70 minutes on 2 cores; run it with nothing else on the
machine; --threads defaults to every CPU):

    python benchmarks/vs_vllm.py --rounds 2 --dtypes float32 bfloat16 --rates 0.5 1.0 2.0 \\
        --out benchmarks/results/vs_vllm.json

    python benchmarks/vs_vllm.py --quick --out /tmp/vs_vllm.json    # one round, small, float32: a script check
                                                                   # (about 2.5 CPU-minutes, most of it vLLM start-up)

Every run is a fresh process, the two systems alternating (our engine first in even rounds, vLLM first in odd
ones), at the same torch threads (``--threads``; OMP_NUM_THREADS for vLLM, whose CPU worker runs with
``VLLM_CPU_OMP_THREADS_BIND=nobind`` and ``VLLM_CPU_KVCACHE_SPACE`` GB of KV cache unless set), eager vLLM,
prefix caching off in both, each system at its own default token budget unless ``--chunk-size`` /
``--vllm-budget`` set one. The 1/5/15-minute load averages (/proc/loadavg) are taken before and after every run.

- offline (``benchmarks/vs_vllm_worker.py``): the first ``--num-requests`` rows of the conversation trace as in
  ``benchmarks/offline_throughput.py`` (its ``load_rows`` and ``make_prompts``: random token ids, EOS ignored),
  output tokens/s of one ``generate`` call after a short first request; start-up is construct to first request
  (and process launch to first request); greedy float32 outputs are compared token for token (identical requests,
  and where they differ the first differing position);
- online: ``sarathi-lite serve`` and ``vllm serve`` on 127.0.0.1, each driven by our own client
  (``sarathi-lite bench --backend openai``: streamed, greedy, ``ignore_eos``) on the scaled conversation trace
  (``--online-requests`` from row 1000, lengths / 4) at each of ``--rates``, after a discarded warm-up; start-up
  is launch to the first answered request.

vLLM comes from its own virtual environment (``scripts/setup_vllm.sh``; ``--vllm-venv``, default ``$VLLM_VENV`` or
``.venv-vllm`` at the repository root); without it the script says so and exits without measuring. Prints a
Markdown table and writes ``--out`` (JSON: command, date, commit, machine, every run) and the table beside it
(``.md``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
# this checkout's sarathi_lite (whatever else is installed), and the scripts beside this one
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
from offline_throughput import load_rows, make_prompts  # noqa: E402
from vllm_plugin import Server, _free_port  # noqa: E402

from sarathi_lite.bench.results import commit, cpu_description, load_average, portable_arg  # noqa: E402
from sarathi_lite.models import builtin  # noqa: E402

WORKER = Path(__file__).resolve().with_name("vs_vllm_worker.py")
SYSTEMS = ("ours", "vllm")
VLLM_SETTINGS = ("OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                 "VLLM_ENABLE_V1_MULTIPROCESSING")  # the settings of vLLM's runs the results record


def settle(max_load: float, wait: float) -> None:
    """Wait until the 1-minute load average is under ``max_load`` (at most ``wait`` seconds)."""
    deadline = time.monotonic() + wait
    while load_average()[0] > max_load and time.monotonic() < deadline:
        time.sleep(5.0)


def venv_python(args: argparse.Namespace) -> Path:
    return Path(args.vllm_venv) / "bin" / "python"


def _ours_env(threads: int) -> dict[str, str]:
    """Our processes import the checkout this script is in, at ``threads`` OpenMP threads."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """vLLM's processes: the environment's own settings, OMP_NUM_THREADS at ``--threads``, the KV cache and thread
    binding as the other vLLM scripts set them unless given, and no PYTHONPATH (vLLM's own environment runs)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = str(args.threads)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gb))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def run_group(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    """Run ``cmd`` (output to ``log``) in a process group of its own; past ``timeout`` seconds the whole group is
    killed (vLLM's engine process too). Its exit status."""
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


def _ordered(rnd: int) -> tuple[str, ...]:
    return SYSTEMS if rnd % 2 == 0 else SYSTEMS[::-1]


# ------------------------------------------------------------------------------------------------ offline


def offline_run(args: argparse.Namespace, system: str, dtype: str, workload: dict, tmp: Path) -> dict[str, Any]:
    """One offline run of ``system`` in a fresh process (``vs_vllm_worker.py``); its result with the load average
    before and after, and the greedy output token ids under ``"tokens"``."""
    spec = dict(workload, model=str(args.model), dtype=dtype, threads=args.threads, max_model_len=args.max_model_len,
                budget=args.chunk_size if system == "ours" else args.vllm_budget)
    spec_path, result_path = tmp / f"spec_{system}_{dtype}.json", tmp / f"result_{system}_{dtype}.json"
    result_path.unlink(missing_ok=True)
    python, env = (sys.executable, _ours_env(args.threads)) if system == "ours" else (str(venv_python(args)),
                                                                                      _vllm_env(args))
    settle(args.max_load, args.settle)
    before = load_average()
    spec["launched"] = time.time()
    spec_path.write_text(json.dumps(spec))
    log = tmp / f"offline_{system}_{dtype}.log"
    code = run_group([python, str(WORKER), system, str(spec_path), str(result_path)], env, log, args.run_timeout)
    if code != 0:
        raise RuntimeError(f"offline {system} {dtype} failed ({code}):\n{log.read_text()[-4000:]}")
    result = json.loads(result_path.read_text())
    result.update(load_before=before, load_after=load_average())
    return result


def compare_greedy(ours: list[list[int]], vllm: list[list[int]]) -> dict[str, Any]:
    """Token-for-token comparison of two systems' greedy outputs, request by request: how many are identical and,
    for the others, the first position where they differ."""
    differ = []
    for i, (a, b) in enumerate(zip(ours, vllm, strict=True)):
        if a != b:
            first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            differ.append({"request": i, "first_diff": first, "ours_len": len(a), "vllm_len": len(b)})
    return {"requests": len(ours), "identical": len(ours) - len(differ), "differ": differ}


def offline(args: argparse.Namespace, workload: dict, tmp: Path, rows: list[dict], greedy: list[dict]) -> None:
    keep = ("output_tokens_per_s", "elapsed_s", "startup_s", "construct_s", "import_s", "process_s", "threads",
            "token_budget", "attention_backend", "versions", "load_before", "load_after")
    for rnd in range(args.rounds):
        for dtype in args.dtypes:
            tokens = {}
            for system in _ordered(rnd):
                result = offline_run(args, system, dtype, workload, tmp)
                tokens[system] = result["tokens"]
                row = {"mode": "offline", "system": system, "dtype": dtype, "round": rnd,
                       **{k: _rounded(result.get(k)) for k in keep}}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if dtype == "float32":
                greedy.append({"round": rnd, "dtype": dtype, **compare_greedy(tokens["ours"], tokens["vllm"])})
                print(json.dumps(greedy[-1]), flush=True)


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


# ------------------------------------------------------------------------------------------------ online


def server_command(args: argparse.Namespace, system: str, dtype: str) -> list[str]:
    """``sarathi-lite serve`` or ``vllm serve`` on loopback (the port is added by the caller), model name ``m``."""
    if system == "ours":
        budget = ["--chunk-size", str(args.chunk_size)] if args.chunk_size else []
        return [sys.executable, "-m", "sarathi_lite", "serve", "--model", str(args.model), "--host", "127.0.0.1",
                "--threads", str(args.threads), "--served-model-name", "m", "--no-enable-prefix-caching",
                "--dtype", dtype, "--max-model-len", str(args.max_model_len), *budget]
    budget = ["--max-num-batched-tokens", str(args.vllm_budget)] if args.vllm_budget else []
    return [str(venv_python(args).with_name("vllm")), "serve", str(args.model), "--host", "127.0.0.1",
            "--dtype", dtype, "--enforce-eager", "--seed", "0", "--max-model-len", str(args.max_model_len),
            "--served-model-name", "m", "--no-enable-prefix-caching", *budget]


def first_request(url: str, vocab: int, timeout: float) -> None:
    """One short greedy completion (token ids), raising unless it is answered."""
    body = {"model": "m", "prompt": list(range(100, 100 + min(16, vocab - 100))), "max_tokens": 4,
            "temperature": 0.0}
    httpx.post(url + "/v1/completions", json=body, timeout=timeout).raise_for_status()


def drive(args: argparse.Namespace, url: str, workload: list[str], out: Path) -> dict[str, Any]:
    """``sarathi-lite bench --backend openai`` against ``url`` on ``workload`` (its flags); its summary with the
    failed requests (``errors``)."""
    cmd = [sys.executable, "-m", "sarathi_lite", "bench", "--backend", "openai", "--base-url", url,
           "--served-model-name", "m", "--vocab-size", str(args.vocab_size), "--no-progress", "--label", "run",
           "--out", str(out), *workload]
    proc = subprocess.run(cmd, cwd=ROOT, env=_ours_env(1), capture_output=True, text=True, timeout=args.run_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    record = json.loads((out / "run.json").read_text())
    return {**record["summary"], "errors": record["meta"].get("num_errors", 0)}


ONLINE_KEYS = ("ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99", "throughput_requests_per_s",
               "throughput_output_tokens_per_s", "num_requests", "errors")


def online_run(args: argparse.Namespace, system: str, dtype: str, rnd: int, tmp: Path) -> tuple[dict, list[dict]]:
    """One server of ``system`` in a fresh process: start-up (launch to /health, and to the first answered
    request), a discarded warm-up, then the scaled conversation trace at each rate; the server is stopped after."""
    env = _ours_env(args.threads) if system == "ours" else _vllm_env(args)
    settle(args.max_load, args.settle)
    port = _free_port()
    server = Server(f"{system} {dtype}", server_command(args, system, dtype) + ["--port", str(port)], port,
                    tmp / f"serve_{system}_{dtype}_{rnd}.log", env)
    rows = []
    try:
        ready = server.wait(args.start_timeout)
        first_request(server.url, args.vocab_size, args.start_timeout)
        startup = {"system": system, "dtype": dtype, "round": rnd, "ready_s": round(ready, 2),
                   "first_request_s": round(time.monotonic() - server.started, 2)}
        warm_up = ["--lengths", "uniform:32-1024:8-16", "--qps", "2", "--num-requests", str(args.warm_up_requests)]
        drive(args, server.url, warm_up, tmp / f"warm_{system}_{dtype}_{rnd}")
        for qps in args.rates:
            before = load_average()
            summary = drive(args, server.url, ["--num-requests", str(args.online_requests), "--qps", str(qps),
                                               "--seed", str(args.seed)], tmp / f"online_{system}_{dtype}_{rnd}_{qps}")
            rows.append({"mode": "online", "system": system, "dtype": dtype, "round": rnd, "qps": qps,
                         **{k: _rounded(summary.get(k)) for k in ONLINE_KEYS}, "load_before": before,
                         "load_after": load_average()})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    return startup, rows


def online(args: argparse.Namespace, tmp: Path, rows: list[dict], startups: list[dict]) -> None:
    for rnd in range(args.rounds):
        for dtype in args.dtypes:
            for system in _ordered(rnd):
                startup, found = online_run(args, system, dtype, rnd, tmp)
                startups.append(startup)
                rows += found


# ------------------------------------------------------------------------------------------------ report


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 4) if values else None


def summarize(offline_rows: list[dict], online_rows: list[dict], startups: list[dict]) -> dict[str, Any]:
    """Medians over rounds: offline output tokens/s and start-up per dtype and system (with ours / vLLM), online
    metrics per dtype, rate and system (failed requests: the total), the servers' start-up per system."""
    out: dict[str, Any] = {"offline": {}, "online": {}, "online_startup": {}}
    for dtype in dict.fromkeys(r["dtype"] for r in offline_rows):
        cell = {s: [r for r in offline_rows if r["dtype"] == dtype and r["system"] == s] for s in SYSTEMS}
        med = {s: {k: _median(cell[s], k) for k in ("output_tokens_per_s", "startup_s", "process_s")}
               for s in SYSTEMS}
        ours, theirs = med["ours"]["output_tokens_per_s"], med["vllm"]["output_tokens_per_s"]
        out["offline"][dtype] = {**med, "ours_over_vllm": round(ours / theirs, 3) if ours and theirs else None}
    for dtype, qps in dict.fromkeys((r["dtype"], r["qps"]) for r in online_rows):
        cells = {s: [r for r in online_rows if (r["dtype"], r["qps"], r["system"]) == (dtype, qps, s)]
                 for s in SYSTEMS}
        out["online"].setdefault(dtype, {})[str(qps)] = {
            s: {**{k: _median(cells[s], k) for k in ONLINE_KEYS}, "errors": sum(r["errors"] or 0 for r in cells[s])}
            for s in SYSTEMS}
    for s in SYSTEMS:
        mine = [r for r in startups if r["system"] == s]
        if mine:
            out["online_startup"][s] = {k: _median(mine, k) for k in ("ready_s", "first_request_s")}
    return out


def _cell(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(report: dict[str, Any]) -> str:
    """The report as Markdown: offline throughput and start-up, online latency and throughput (medians over
    rounds), greedy agreement and the load averages."""
    s = report["summary"]
    lines = [f"sarathi-lite vs vLLM-CPU {report['versions'].get('vllm', '?')}, {report['model']}, "
             f"{report['threads']} threads, {report['rounds']} round(s); {report['machine']}", "",
             "| offline | ours out tok/s | vLLM out tok/s | ours / vLLM | start-up ours s | start-up vLLM s |",
             "|---|---:|---:|---:|---:|---:|"]
    for dtype, m in s["offline"].items():
        lines.append(f"| {dtype} | {_cell(m['ours']['output_tokens_per_s'])} | "
                     f"{_cell(m['vllm']['output_tokens_per_s'])} | {_cell(m['ours_over_vllm'], digits=2)}x | "
                     f"{_cell(m['ours']['startup_s'])} | {_cell(m['vllm']['startup_s'])} |")
    lines += ["", "| online | req/s offered | system | TTFT p50 s | TBT p50 ms | TBT p99 ms | served req/s | "
              "out tok/s | errors |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for dtype, rates in s["online"].items():
        for qps, systems in rates.items():
            for name, m in systems.items():
                lines.append(f"| {dtype} | {qps} | {name} | {_cell(m['ttft_p50'], digits=2)} | "
                             f"{_cell(m['tbt_p50'], 1000, 0)} | {_cell(m['tbt_p99'], 1000, 0)} | "
                             f"{_cell(m['throughput_requests_per_s'], digits=2)} | "
                             f"{_cell(m['throughput_output_tokens_per_s'])} | {_cell(m['errors'], digits=0)} |")
    if s["online_startup"]:
        lines.append("\nServer start-up, launch to the first answered request (median): " + ", ".join(
            f"{name} {_cell(m['first_request_s'])} s" for name, m in s["online_startup"].items()) + ".")
    for g in report["greedy"]:
        where = ", ".join(f"request {d['request']} at token {d['first_diff']}" for d in g["differ"]) or "none differ"
        lines.append(f"\nGreedy {g['dtype']} outputs, round {g['round']}: {g['identical']}/{g['requests']} requests "
                     f"identical token for token ({where}).")
    loads = [r["load_before"][0] for r in report["offline"] + report["online"]]
    if loads:
        lines.append(f"\n1-minute load average before the runs: {min(loads):.2f}-{max(loads):.2f}.")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (ours first in even rounds)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch / OpenMP threads of both systems")
    p.add_argument("--num-requests", type=int, default=32, help="offline: the first rows of --trace")
    p.add_argument("--trace", default="conversation", help="offline: a built-in trace or a CSV path")
    p.add_argument("--max-prompt", type=int, default=1024, help="offline: prompts clipped to this (tokens)")
    p.add_argument("--max-output", type=int, default=128, help="offline: outputs clipped to this (tokens)")
    p.add_argument("--rates", type=float, nargs="*", default=None,
                   help="online rates (requests/s; default 0.5 1.0 2.0, with --quick 1.0); none: no online runs")
    p.add_argument("--online-requests", type=int, default=36, help="online: requests per rate")
    p.add_argument("--warm-up-requests", type=int, default=6, help="online: discarded requests after start-up")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="prompt tokens (and online arrivals)")
    p.add_argument("--chunk-size", type=int, default=None, help="our token budget (default: the engine's)")
    p.add_argument("--vllm-budget", type=int, default=None,
                   help="vLLM's --max-num-batched-tokens (default: vLLM's own)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GB) unless already set")
    p.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", str(ROOT / ".venv-vllm")))
    p.add_argument("--max-load", type=float, default=1.0, help="before each run, wait for the 1-minute load "
                   "average to fall under this, at most --settle seconds")
    p.add_argument("--settle", type=float, default=60.0)
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one offline run or client may take")
    p.add_argument("--quick", action="store_true",
                   help="one round, float32, 4 short requests offline, 4 online at 1 req/s: a check of the script")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vs_vllm.json"))
    args = p.parse_args()
    if args.quick:
        args.rounds, args.dtypes, args.num_requests, args.max_prompt, args.max_output = 1, ["float32"], 4, 256, 16
        args.online_requests, args.warm_up_requests, args.settle = 4, 2, 0.0
    if args.rates is None:
        args.rates = [1.0] if args.quick else [0.5, 1.0, 2.0]
    if args.rounds < 1 or args.threads < 1:
        p.error(f"--rounds {args.rounds} and --threads {args.threads} must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if not venv_python(args).exists():
        print(f"vLLM is not installed: no interpreter at {venv_python(args)} (scripts/setup_vllm.sh makes the "
              "environment; --vllm-venv or VLLM_VENV names another). Nothing was measured.")
        return
    code, started = commit(), time.time()  # the code that runs: taken before, not after
    args.model = Path(args.model) if args.model else Path(builtin.resolve_model("smollm2-135m"))
    args.vocab_size = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rows = load_rows(args.trace, args.num_requests, args.max_prompt, args.max_output)
    workload = {"prompts": make_prompts(rows, args.vocab_size, args.seed), "outputs": [o for _, o in rows]}
    offline_rows: list[dict] = []
    online_rows: list[dict] = []
    greedy: list[dict] = []
    startups: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="vs-vllm-"))  # specs, results, logs: kept when a run fails
    try:
        if not args.skip_offline:
            offline(args, workload, tmp, offline_rows, greedy)
        if args.rates:
            online(args, tmp, online_rows, startups)
    except BaseException:
        print(f"the servers' and workers' logs are in {tmp}", file=sys.stderr)
        raise
    shutil.rmtree(tmp)
    write_report(args, code, started, offline_rows, online_rows, greedy, startups)


def installed_versions(args: argparse.Namespace) -> dict[str, str]:
    """torch here, and torch and vLLM in vLLM's environment, from the package metadata (nothing imported)."""
    code = ("import importlib.metadata as m, json; print(json.dumps({'vllm_torch': m.version('torch'), "
            "'vllm': m.version('vllm').split('+')[0]}))")
    found = {"torch": importlib.metadata.version("torch")}
    try:
        done = subprocess.run([str(venv_python(args)), "-c", code], capture_output=True, text=True, timeout=60)
        found.update(json.loads(done.stdout))
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return found


def write_report(args: argparse.Namespace, code: str | None, started: float, offline_rows: list[dict],
                 online_rows: list[dict], greedy: list[dict], startups: list[dict]) -> None:
    versions: dict[str, str] = {}
    for row in offline_rows:
        versions.update({("vllm_torch" if row["system"] == "vllm" and k == "torch" else k): v
                         for k, v in row.pop("versions").items()})
    if "vllm" not in versions:  # online only: ask the installations
        versions.update(installed_versions(args))
    hidden = ("model", "vllm_venv", "out", "quick", "trace")
    report = {"command": "python benchmarks/vs_vllm.py " + " ".join(portable_arg(a) for a in sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), "commit": code,
              "machine": cpu_description(args.threads), "model": args.model.name, "trace": portable_arg(args.trace),
              "threads": args.threads, "rounds": args.rounds, "versions": versions,
              "vllm_env": {k: v for k, v in _vllm_env(args).items() if k in VLLM_SETTINGS},
              "options": {k: v for k, v in vars(args).items() if k not in hidden},
              "wall_s": round(time.time() - started),
              "summary": summarize(offline_rows, online_rows, startups), "greedy": greedy, "online_startup": startups,
              "offline": offline_rows, "online": online_rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    text = table(report)
    out.with_suffix(".md").write_text(text + "\n")
    print("\n" + text + f"\n\nwrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
