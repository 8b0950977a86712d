"""What serving costs: HTTP vs in-process replay, and ``AsyncLLMEngine`` vs ``LLM.generate``, side by side.

1. HTTP overhead: the same Poisson workload (same requests, arrivals and prompt token ids) replayed in process
   (``bench.replay.replay`` on an ``LLMEngine``) and over HTTP (``bench.http_client.replay_http`` against a
   ``sarathi-lite serve`` subprocess with the same engine options), alternating, ``--rounds`` times each.
   TTFT and TBT of the HTTP runs are measured at the client, so they include request parsing, the engine
   thread hand-off, SSE encoding, loopback and the client's parsing. Both engines run without a prefix cache:
   every round replays the same prompts, and with it the later rounds' prefills would be cache hits (fewer,
   and different in each engine, whose caches hold different histories), not the work being compared.
   Wall-clock latencies on a shared machine move with its load, so each run also reports the engine's mean
   step time and the CPU seconds per output token (server + client process for HTTP, the one process in
   process), which the load does not inflate; the ratios are given as medians over rounds and as the median
   of each round's ratio (its two runs are adjacent in time).
2. Async engine overhead: offline throughput (output tokens/s over the wall time of the whole batch) of the
   same requests through ``LLM.generate`` and through ``AsyncLLMEngine.generate`` (all requests at once, one
   asyncio consumer each) on the same engine, alternating; also CPU seconds per output token.

    python benchmarks/serving_overhead.py                 # SmolLM2-135M, one torch thread
    python benchmarks/serving_overhead.py --rounds 1 --num-requests 10   # a quick look

Prints a table and writes JSON (default results/serving_overhead.json), with the load average around each run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from sarathi_lite import LLM, SamplingParams
from sarathi_lite.bench.http_client import replay_http
from sarathi_lite.bench.replay import machine, replay, warm_up
from sarathi_lite.bench.workload import Workload
from sarathi_lite.engine.async_engine import AsyncLLMEngine

KEYS = ("ttft_p50", "tbt_p50", "tbt_p99", "throughput_output_tokens_per_s", "mean_step_s", "cpu_s_per_token")


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process, all its threads (Linux ``/proc``): unlike wall times, it does
    not grow when other work on a shared machine takes the cores."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sarathi_lite", "serve", args.model, "--port", str(port), "--threads", "1",
           "--chunk-size", str(args.chunk_size), "--device", "cpu", "--served-model-name", "bench",
           "--no-enable-prefix-caching"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("the server did not start in 300 s")


def http_overhead(args: argparse.Namespace, llm: LLM) -> dict:
    engine = llm.engine
    workload = Workload.synthetic(args.lengths, num_requests=args.num_requests, qps=args.qps, seed=args.seed)
    vocab = engine.model_config.vocab_size
    port = free_port()
    server = start_server(args, port, Path(tempfile.gettempdir()) / f"sarathi-lite-serve-{port}.log")
    url = f"http://127.0.0.1:{port}"
    runs: dict[str, list[dict]] = {"in-process": [], "http": []}
    try:
        httpx.post(f"{url}/v1/completions", timeout=120,  # warm-up, as warm_up does in process
                   json={"model": "bench", "prompt": list(range(100, 132)), "max_tokens": 4, "ignore_eos": True})
        warm_up(engine)
        for r in range(args.rounds):
            for name in ("in-process", "http"):
                load = os.getloadavg()[0]
                cpu0 = cpu_seconds() + cpu_seconds(server.pid)
                if name == "in-process":
                    result = replay(engine, workload, progress=False)
                    its = result.stats.iterations
                    step = sum(it.step_time for it in its) / len(its)
                else:
                    before = _iteration_seconds(url)
                    result = replay_http(workload, url, vocab_size=vocab, progress=False)
                    assert result.meta["num_errors"] == 0
                    after = _iteration_seconds(url)
                    step = (after[0] - before[0]) / (after[1] - before[1])
                cpu = cpu_seconds() + cpu_seconds(server.pid) - cpu0  # client + server, or the engine alone
                s = result.summary()
                runs[name].append({"round": r, "load_average_1m": load, **{k: s[k] for k in KEYS if k in s},
                                   "num_requests": s["num_requests"], "mean_step_s": step,
                                   "cpu_s_per_token": cpu / s["output_tokens"]})
                print(f"  round {r} {name:<10} load {load:.2f}: TTFT p50 {1000 * s['ttft_p50']:.0f} ms, TBT p50 "
                      f"{1000 * s['tbt_p50']:.1f} ms p99 {1000 * s['tbt_p99']:.1f} ms, "
                      f"{s['throughput_output_tokens_per_s']:.1f} out tok/s, engine step {1000 * step:.1f} ms, "
                      f"CPU {1000 * cpu / s['output_tokens']:.1f} ms/token",
                      flush=True)
    finally:
        server.terminate()
        server.wait(30)
    return {"workload": workload.describe(), "runs": runs, "ratios": _ratios(runs["http"], runs["in-process"]),
            "paired_ratios": _paired_ratios(runs["http"], runs["in-process"])}


def _iteration_seconds(url: str) -> tuple[float, float]:
    """The server's iteration time histogram: (sum of seconds, count)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return float(values["sarathi_lite_iteration_seconds_sum"]), float(values["sarathi_lite_iteration_seconds_count"])


def async_overhead(args: argparse.Namespace, llm: LLM) -> dict:
    workload = Workload.synthetic(args.offline_lengths, num_requests=args.offline_requests, seed=args.seed)
    prompts = workload.prompt_token_ids(llm.engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload.requests]
    total = sum(r.output_len for r in workload.requests)
    runs: dict[str, list[dict]] = {"LLM.generate": [], "AsyncLLMEngine": []}

    async def through_async(aengine: AsyncLLMEngine) -> list[int]:
        async def one(i: int) -> int:
            n = 0
            async for out in aengine.generate(prompts[i], params[i], f"async-{i}"):
                n = out.num_output_tokens
            return n

        return await asyncio.gather(*[one(i) for i in range(len(prompts))])

    for r in range(args.rounds):
        for name in runs:
            load = os.getloadavg()[0]
            cpu0 = cpu_seconds()
            t0 = time.perf_counter()
            if name == "LLM.generate":
                counts = [len(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            else:
                aengine = AsyncLLMEngine(llm.engine)
                try:
                    counts = asyncio.run(through_async(aengine))
                finally:
                    aengine.shutdown()
            wall = time.perf_counter() - t0
            cpu = cpu_seconds() - cpu0
            assert sum(counts) == total
            runs[name].append({"round": r, "load_average_1m": load, "wall_s": wall,
                               "throughput_output_tokens_per_s": total / wall, "cpu_s_per_token": cpu / total})
            print(f"  round {r} {name:<15} load {load:.2f}: {total / wall:.1f} out tok/s ({wall:.1f} s), "
                  f"CPU {1000 * cpu / total:.1f} ms/token", flush=True)

    def ratio(key: str) -> float:
        return (statistics.median(x[key] for x in runs["AsyncLLMEngine"])
                / statistics.median(x[key] for x in runs["LLM.generate"]))

    return {"workload": workload.describe(), "runs": runs, "throughput_ratio": ratio("throughput_output_tokens_per_s"),
            "cpu_per_token_ratio": ratio("cpu_s_per_token")}


def _ratios(test: list[dict], base: list[dict]) -> dict[str, float]:
    """Median over rounds of each metric, test over base."""
    return {k: statistics.median(x[k] for x in test) / statistics.median(x[k] for x in base) for k in KEYS}


def _paired_ratios(test: list[dict], base: list[dict]) -> dict[str, float]:
    """Median over rounds of each round's ratio test / base: the two runs of a round are adjacent in time, so
    a slow spell of the machine that spans a round cancels in its ratio."""
    return {k: statistics.median(t[k] / b[k] for t, b in zip(test, base)) for k in KEYS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--lengths", default="uniform:64-256:16-48", help="synthetic lengths of the Poisson workload")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--qps", type=float, default=1.0)
    p.add_argument("--offline-lengths", default="uniform:64-192:16-32")
    p.add_argument("--offline-requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4, help="alternating runs of each system")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/serving_overhead.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model, chunk_size=args.chunk_size, device="cpu", enable_prefix_caching=False)
    load_start = os.getloadavg()
    print(f"{machine()}; load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}")
    print("1. HTTP (bench --backend openai against sarathi-lite serve) vs in-process replay")
    http = http_overhead(args, llm)
    print("2. AsyncLLMEngine vs LLM.generate, offline")
    offline = async_overhead(args, llm)
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
              "model": args.model, "chunk_size": args.chunk_size, "load_average_start": list(load_start),
              "load_average_end": list(os.getloadavg()), "http_vs_in_process": http, "async_vs_generate": offline}
    out.write_text(json.dumps(report, indent=1))
    print(f"\n{'metric (median of rounds)':<34} {'in-process':>11} {'HTTP':>9} {'HTTP/in-process':>16} "
          f"{'median of round ratios':>23}")
    for k in KEYS:
        base = statistics.median(x[k] for x in http["runs"]["in-process"])
        test = statistics.median(x[k] for x in http["runs"]["http"])
        scale, unit = (1, "") if k == "throughput_output_tokens_per_s" else (1000, " ms")
        print(f"{k + unit:<34} {scale * base:>11.1f} {scale * test:>9.1f} {http['ratios'][k]:>16.3f} "
              f"{http['paired_ratios'][k]:>23.3f}")
    print(f"{'offline out tok/s: AsyncLLMEngine / LLM.generate':<56} {offline['throughput_ratio']:>16.3f}")
    print(f"{'offline CPU per token: AsyncLLMEngine / LLM.generate':<56} {offline['cpu_per_token_ratio']:>16.3f}")
    print(f"load average at end {report['load_average_end'][0]:.2f}; wrote {out}")


if __name__ == "__main__":
    main()
