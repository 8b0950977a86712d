"""This checkout's scheduler against another checkout's, in one process: ``schedule()`` + ``update()`` per step.

Both scheduler packages (``scheduler/src`` of this tree and of ``--other``, a git worktree or clone) are loaded
side by side under other names, each drives the same workload (``--requests`` kept in the scheduler, a new one
added for every one that finishes; prompts of 32-256 tokens, outputs of 16-128; a KV pool large enough that
blocks never run out), and the two are timed in alternating rounds, so the machine's drift over minutes hits
both alike. Per round: CPU seconds of this process per step (``time.process_time``, which leaves out the time the
process waited for a core on a busy machine); the ratio this/other per round, and its median over the rounds.

    git worktree add /tmp/before <commit>
    python benchmarks/scheduler_ab.py --other /tmp/before                 # ~1 minute
    python benchmarks/scheduler_ab.py --other /tmp/before --no-hol-protection --requests 1024

Prints a table and writes JSON (command, date, commits, machine, load average, every round).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from sarathi_lite.bench.results import host

ROOT = Path(__file__).resolve().parents[1]


def load(tree: Path, name: str) -> ModuleType:
    """The scheduler package of checkout ``tree`` (``scheduler/src``), imported as ``name``."""
    spec = importlib.util.spec_from_file_location(name, tree / "scheduler" / "src" / "__init__.py",
                                                  submodule_search_locations=[str(tree / "scheduler" / "src")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def driver(mod: ModuleType, requests: int, hol: bool, seed: int) -> Callable[[int], float]:
    """A scheduler of ``mod`` holding ``requests`` requests; returns ``steps(k)``: CPU seconds per step of k."""
    config = mod.SchedulerConfig(chunk_size=max(512, 2 * requests), max_num_seqs=requests, num_blocks=1_000_000,
                                 max_model_len=4096, enable_prefix_caching=False, hol_protection=hol)
    sched = mod.make_scheduler(config)
    rng = random.Random(seed)
    count = [0]

    def add() -> None:
        sched.add(mod.Request(f"r{count[0]}", [5] * rng.randint(32, 256), max_tokens=rng.randint(16, 128)))
        count[0] += 1

    for _ in range(requests):
        add()

    def steps(k: int) -> float:
        spent = 0.0
        for _ in range(k):
            t0 = time.process_time()
            out = sched.schedule()
            finished = sched.update(out, {s.request_id: 7 for s in out.scheduled if s.sample})
            spent += time.process_time() - t0
            for _ in finished:
                add()
        return spent / k

    steps(200)  # warm-up: the steady mix of decodes and new prompts
    return steps


def commit(tree: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    return done.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", type=Path, required=True, help="the other checkout (its scheduler/src is timed)")
    ap.add_argument("--requests", type=int, default=256, help="requests kept in the scheduler")
    ap.add_argument("--rounds", type=int, default=12, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=150, help="timed steps per round and tree")
    ap.add_argument("--no-hol-protection", action="store_true", help="hol_protection=False in both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scheduler_ab.json")
    args = ap.parse_args()
    hol = not args.no_hol_protection
    this = driver(load(ROOT, "_sched_this"), args.requests, hol, args.seed)
    other = driver(load(args.other.resolve(), "_sched_other"), args.requests, hol, args.seed)
    rounds = []
    gc.disable()  # its full passes land in random steps of either tree
    for _ in range(args.rounds):
        b = other(args.steps)
        a = this(args.steps)
        rounds.append({"this_us": a * 1e6, "other_us": b * 1e6, "ratio": a / b})
    gc.enable()
    ratio = statistics.median(r["ratio"] for r in rounds)
    this_us = statistics.median(r["this_us"] for r in rounds)
    other_us = statistics.median(r["other_us"] for r in rounds)
    print(f"requests {args.requests}, hol_protection {hol}, {args.rounds} alternating rounds of {args.steps} steps")
    print(f"{'tree':>6} {'commit':>10} {'CPU us/step (median)':>22}")
    print(f"{'this':>6} {commit(ROOT):>10} {this_us:>22.1f}")
    print(f"{'other':>6} {commit(args.other):>10} {other_us:>22.1f}")
    print(f"this/other per round: median {ratio:.3f} (min {min(r['ratio'] for r in rounds):.3f}, "
          f"max {max(r['ratio'] for r in rounds):.3f}); load average {os.getloadavg()}")
    record = {
        "command": " ".join(["python", *sys.argv]).replace(str(args.other), "<other checkout>"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(ROOT), "other_commit": commit(args.other),
        "machine": host(), "requests": args.requests, "hol_protection": hol, "loadavg": os.getloadavg(),
        "median_ratio": ratio, "this_us": this_us, "other_us": other_us, "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
