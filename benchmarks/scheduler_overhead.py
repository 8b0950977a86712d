"""Scheduler overhead: CPU time of ``schedule()`` + ``update()`` per step, at a steady number of requests.

For each policy and each concurrency N, N requests are kept in the scheduler (a new one is added for every one
that finishes), with a KV pool, ``max_num_seqs`` and token budget large enough that all of them run: most steps
are N decodes plus a chunk or two of new prompts. After a warm-up, every step's ``schedule()`` and ``update()``
are timed; the model is a stand-in that samples a fixed token, and is not timed, nor is ``add()``.
``request_level`` admits a new batch only when the last one has finished, so far fewer than N of its requests
run at once (the ``running`` column).

Python's cyclic garbage collector runs inside the timed calls whenever enough objects have been allocated (each
step allocates a record per scheduled request); its full passes dominate p99 at 1024 requests. ``--no-gc``
switches it off during the timed steps, to show the scheduler's own cost.

Besides wall time, the CPU time this process spent in the two calls (``time.process_time_ns``) is kept: on a
machine shared with other jobs it leaves out the time the process waited for a core.

``--chunk-size auto`` runs the chunked policies with the SLO-aware budget (``--cost-model``, ``--tbt-slo``): every
step's ``schedule()`` then searches the budget with the cost model's predictions, and ``update()`` is followed
by ``observe(out, predicted step time)`` (the correction and the target's controller), timed with it.

``--prefix-caching`` turns the prefix cache on (hashing every full block, looking up every admission);
``--shared-prefix N`` starts every prompt with the same N tokens (a system prompt), so admissions hit it.

    python benchmarks/scheduler_overhead.py                      # 16, 64, 256, 1024 requests; ~1 minute
    python benchmarks/scheduler_overhead.py --concurrency 256 --steps 500 --no-gc --out /tmp/overhead.json
    python benchmarks/scheduler_overhead.py --policies sarathi --concurrency 256 --prefix-caching --shared-prefix 128
    python benchmarks/scheduler_overhead.py --policies sarathi --concurrency 256 --chunk-size auto

Prints a table (mean and p99 microseconds per step, and mean microseconds per request per step) and writes it,
with the machine and the settings, as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from sarathi_lite.costs import load_cost_model
from sarathi_lite.scheduler import (
    POLICIES,
    Request,
    Scheduler,
    SchedulerConfig,
    StepTimePredictor,
    chunked_policy_names,
    make_scheduler,
)

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
PROMPT_LEN = (32, 256)  # uniform, tokens
OUTPUT_LEN = (128, 512)  # uniform, tokens
TOKEN = 11  # the stand-in model's sampled token (never a stop token)


def make(policy: str, concurrency: int, prefix_caching: bool = False,
         predictor: StepTimePredictor | None = None, tbt_slo: float | None = None) -> Scheduler:
    """A scheduler with room for ``concurrency`` requests: all of them can hold blocks and decode every step.
    With ``predictor`` (and ``tbt_slo``, seconds), a chunked policy runs with ``chunk_size="auto"``."""
    budget = max(512, 2 * concurrency)
    blocks_per_request = -(-(PROMPT_LEN[1] + OUTPUT_LEN[1]) // BLOCK_SIZE)
    auto = predictor is not None and policy in chunked_policy_names()
    return make_scheduler(SchedulerConfig(
        policy=policy,
        chunk_size="auto" if auto else budget,
        tbt_slo=tbt_slo if auto else None,
        max_num_batched_tokens=max(MAX_MODEL_LEN, concurrency * PROMPT_LEN[1]),  # unchunked: admit any backlog
        max_num_seqs=concurrency,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_blocks=concurrency * blocks_per_request,
        enable_prefix_caching=prefix_caching,
    ), predictor if auto else None)


def new_request(rng: random.Random, index: int, max_tokens: int | None = None, shared: list[int] = ()
                ) -> Request:
    """A random prompt; its first ``len(shared)`` tokens are ``shared``."""
    prompt = rng.choices(range(1, 32000), k=rng.randint(*PROMPT_LEN))
    prompt[:len(shared)] = shared[:len(prompt)]
    return Request(f"r{index}", prompt, max_tokens or rng.randint(*OUTPUT_LEN))


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def measure(policy: str, concurrency: int, steps: int, warmup: int, seed: int, collect: bool = True,
            prefix_caching: bool = False, shared_prefix: int = 0, predictor: StepTimePredictor | None = None,
            tbt_slo: float | None = None, waiting: int = 0) -> dict[str, object]:
    rng = random.Random(seed)
    sched = make(policy, concurrency, prefix_caching, predictor, tbt_slo)
    auto = sched.budget is not None
    shared = rng.choices(range(1, 32000), k=shared_prefix)
    added = 0
    # The first requests get spread-out lengths so that they do not all finish together.
    for _ in range(concurrency + waiting):  # ``waiting`` more than the seats: they wait for one (seat-bound)
        sched.add(new_request(rng, added, rng.randint(1, OUTPUT_LEN[1]), shared))
        added += 1
    schedule_ns: list[int] = []
    update_ns: list[int] = []
    cpu_ns = 0
    batch_rows = prefill_rows = running = 0
    clock, cpu = time.perf_counter_ns, time.process_time_ns
    gc.collect()
    if not collect:
        gc.disable()
    for i in range(warmup + steps):
        c0 = cpu()
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        c1 = cpu()
        sampled = {s.request_id: TOKEN for s in out.scheduled if s.sample}
        c2 = cpu()
        t2 = clock()
        finished = sched.update(out, sampled)
        if auto:
            sched.observe(out, predictor.predict_step_time(out))
        t3 = clock()
        c3 = cpu()
        if i >= warmup:
            cpu_ns += c1 - c0 + c3 - c2
            schedule_ns.append(t1 - t0)
            update_ns.append(t3 - t2)
            batch_rows += len(out.scheduled)
            prefill_rows += out.num_prefills
            running += len(sched.running)
        for _ in finished:
            sched.add(new_request(rng, added, shared=shared))
            added += 1
    gc.enable()
    step_us = sorted((a + b) / 1e3 for a, b in zip(schedule_ns, update_ns, strict=True))
    mean_us = statistics.fmean(step_us)
    return {
        "policy": policy,
        "chunk_size": "auto" if auto else sched.config.chunk_size,
        "concurrency": concurrency,
        "waiting": waiting,
        "steps": steps,
        "mean_us": mean_us,
        "p50_us": percentile(step_us, 0.50),
        "p99_us": percentile(step_us, 0.99),
        "per_request_us": mean_us / concurrency,
        "cpu_mean_us": cpu_ns / steps / 1e3,
        "schedule_mean_us": statistics.fmean(schedule_ns) / 1e3,
        "update_mean_us": statistics.fmean(update_ns) / 1e3,
        "mean_batch_rows": batch_rows / steps,
        "mean_prefill_rows": prefill_rows / steps,
        "mean_running": running / steps,
        "prefix_caching": prefix_caching,
        "hit_rate": sched.block_manager.hit_rate,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[16, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=400, help="untimed steps before timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-gc", action="store_true", help="switch the cyclic garbage collector off while timing")
    parser.add_argument("--prefix-caching", action="store_true", help="enable_prefix_caching=True")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                        help="every prompt starts with the same N tokens")
    parser.add_argument("--chunk-size", choices=("fixed", "auto"), default="fixed",
                        help="fixed: max(512, 2 x requests); auto: the SLO-aware budget for the chunked policies")
    parser.add_argument("--cost-model", default="roofline:h100:llama3-8b", help="with --chunk-size auto")
    parser.add_argument("--tbt-slo", type=float, default=0.05, help="with --chunk-size auto (seconds)")
    parser.add_argument("--waiting", type=int, default=0, metavar="N",
                        help="N requests more than the seats (max_num_seqs = concurrency), always waiting: a "
                             "seat-bound scheduler (with --chunk-size auto, the budget's seat-bound choice)")
    parser.add_argument("--out", type=Path, default=Path("results/scheduler_overhead.json"))
    args = parser.parse_args(argv)
    predictor = load_cost_model(args.cost_model) if args.chunk_size == "auto" else None

    rows = []
    header = (f"{'policy':<16}{'requests':>9}{'mean us':>10}{'p99 us':>10}{'us/request':>12}"
              f"{'schedule':>10}{'update':>9}{'rows':>8}{'running':>9}{'hit rate':>9}{'cpu us':>9}")
    print(header)
    print("-" * len(header))
    for policy in args.policies:
        for concurrency in args.concurrency:
            r = measure(policy, concurrency, args.steps, args.warmup, args.seed, collect=not args.no_gc,
                        prefix_caching=args.prefix_caching, shared_prefix=args.shared_prefix,
                        predictor=predictor, tbt_slo=args.tbt_slo, waiting=args.waiting)
            rows.append(r)
            print(f"{policy:<16}{concurrency:>9}{r['mean_us']:>10.1f}{r['p99_us']:>10.1f}{r['per_request_us']:>12.3f}"
                  f"{r['schedule_mean_us']:>10.1f}{r['update_mean_us']:>9.1f}{r['mean_batch_rows']:>8.1f}"
                  f"{r['mean_running']:>9.1f}{r['hit_rate']:>9.2f}{r['cpu_mean_us']:>9.1f}", flush=True)
    print("(mean/p99 us: schedule() + update() per step; schedule/update: their means; rows: requests per batch; "
          "running: mean requests holding blocks; hit rate: prefill tokens found in the prefix cache; cpu us: "
          "mean CPU time of schedule() + update())")

    result = {
        "benchmark": "scheduler_overhead",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "settings": {"steps": args.steps, "warmup": args.warmup, "seed": args.seed, "gc": not args.no_gc,
                     "waiting": args.waiting,
                     "block_size": BLOCK_SIZE, "prefix_caching": args.prefix_caching,
                     "shared_prefix": args.shared_prefix,
                     "max_model_len": MAX_MODEL_LEN, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                     "chunk_size": "max(512, 2 * concurrency)" if predictor is None else "auto",
                     "cost_model": args.cost_model if predictor else None,
                     "tbt_slo": args.tbt_slo if predictor else None,
                     "max_num_batched_tokens": f"max({MAX_MODEL_LEN}, concurrency * {PROMPT_LEN[1]})"},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
