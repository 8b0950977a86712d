"""What one call of the decision costs a host: ``decide_step`` over N running requests (a quarter of them mid-prefill,
short and long, the rest decoding) and a queue of waiting prompts, with a fixed chunk size and with
``chunk_size="auto"`` (a profiled cost model), with head-of-line protection on (the default) and off.

    python benchmarks/decide_step_cost.py            # about a minute

Prints a table and writes ``--out`` (JSON: command, date, commit, machine, load average). Microseconds per call,
the median of ``--repeats`` timed batches of calls (each batch long enough to time), on one core.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from sarathi_lite.bench.results import commit, portable_arg
from sarathi_lite.costs import load_cost_model
from sarathi_lite.scheduler import SchedulerConfig, TokenBudget
from sarathi_lite.scheduler.decision import RequestView, decide_step

ROOT = Path(__file__).resolve().parents[1]


def views(n_running: int, n_waiting: int, seed: int = 0) -> tuple[list[RequestView], list[RequestView]]:
    """``n_running`` running requests (3 in 4 decoding, the rest mid-prefill: one in 8 of those long) and
    ``n_waiting`` waiting prompts (one in 8 long)."""
    rng = random.Random(seed)
    running = []
    for i in range(n_running):
        prompt = 3000 if i % 32 == 31 else rng.randint(32, 512)
        if i % 4:  # decoding: prompt and some outputs computed, one token to go
            out = rng.randint(1, 128)
            running.append(RequestView(f"r{i}", prompt + out - 1, prompt + out, prompt, float(i)))
        else:
            running.append(RequestView(f"r{i}", rng.randint(0, prompt - 1), prompt, prompt, float(i)))
    waiting = [RequestView(f"w{i}", 0, p, p, float(n_running + i))
               for i, p in enumerate(3000 if i % 8 == 7 else rng.randint(32, 512) for i in range(n_waiting))]
    return running, waiting


def time_calls(running: list[RequestView], waiting: list[RequestView], config: SchedulerConfig,
               budget: TokenBudget | None, repeats: int) -> float:
    """Median microseconds per ``decide_step`` call."""
    decide_step(running, waiting, config, budget)
    t0 = time.perf_counter()
    calls = 0
    while time.perf_counter() - t0 < 0.05:
        decide_step(running, waiting, config, budget)
        calls += 1
    per_batch = max(calls, 1)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            decide_step(running, waiting, config, budget)
        samples.append((time.perf_counter() - t0) / per_batch * 1e6)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=int, nargs="*", default=[256, 1024])
    p.add_argument("--waiting", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--cost-model", default=str(ROOT / "benchmarks" / "results" / "sim_profile_smollm2_2026-12-06.json"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decide_step_cost.json"))
    args = p.parse_args()
    load = os.getloadavg()
    cost = load_cost_model(args.cost_model)
    rows = []
    for n in args.running:
        running, waiting = views(n, args.waiting)
        for chunk in (512, "auto"):
            for hol in (True, False):
                extra = {"tbt_slo": 0.5} if chunk == "auto" else {}
                config = SchedulerConfig(chunk_size=chunk, max_num_seqs=max(2 * n, 256), max_num_batched_tokens=8192,
                                         max_model_len=8192, num_blocks=1 << 20, hol_protection=hol, **extra)
                budget = TokenBudget(config, cost) if chunk == "auto" else None
                us = time_calls(running, waiting, config, budget, args.repeats)
                rows.append({"running": n, "waiting": args.waiting, "chunk_size": chunk, "hol_protection": hol,
                             "us_per_call": round(us, 1)})
                print(f"running {n:5d} waiting {args.waiting} chunk {chunk!s:>4} hol {hol!s:5}: {us:8.1f} us/call",
                      flush=True)
    result = {"command": "python " + " ".join(portable_arg(a) for a in sys.argv), "commit": commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "load_average_before": load, "load_average_after": os.getloadavg(), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
