"""Do two cost models (say a quick and a full profile of this machine) tell the simulator the same story?

Simulates both built-in traces (lengths scaled by 1/4 and clipped to 1024 / 128 tokens, as the CPU benchmarks;
Poisson arrivals at ``--qps``) under ``sarathi`` at each ``--chunk-sizes`` value with each model, and prints, for
every summary metric, the relative difference ``a / b - 1`` of model A (``--a``) against model B (``--b``).
Both models are simulated without jitter (``jitter=()``), so the comparison is of their typical steps, not of
two random draws.

    python benchmarks/profile_agreement.py --a quick.json --b full.json --out results/profile_agreement.json

Two profiles taken one after the other also differ by how this machine's speed moved in between (on the shared
VM, two full profiles 25 minutes apart disagreed by up to 85% on these metrics). ``--one-pass MODEL`` separates
the grids from the machine: it times the quick and the full grid's batches in one interleaved pass (one random
order over both grids, ``--repeats`` passes) with one calibration run, fits each grid's model from its own
batches, saves both next to ``--out`` and compares quick (A) against full (B); a slow spell then hits both
grids alike.

    python benchmarks/profile_agreement.py --one-pass smollm2-135m --out results/profile_agreement.json

``--halves`` (with ``--one-pass`` and an even ``--repeats``) measures the noise floor under the comparison: each
grid is also fitted twice, on the first and on the second half of its timed passes (same shapes, same machine
minutes, disjoint runs), and three comparisons are printed: quick (first half) against full (second half), full
against full, quick against quick. Two fits of the same grid disagree only by the timing noise; a quick-vs-full
difference no larger than that is not the grid's.

    python benchmarks/profile_agreement.py --one-pass smollm2-135m --repeats 6 --halves --out results/halves.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
from pathlib import Path

import numpy as np
import torch

from sarathi_lite.bench.replay import build_engine, warm_up
from sarathi_lite.bench.results import host
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs.profiled import TERMS, ProfiledCostModel, batch_terms
from sarathi_lite.sim import simulator as sim
from sarathi_lite.sim.profiler import (
    CALIBRATION_CHUNK_SIZE,
    calibrate,
    fit_grid,
    grid_outputs,
    profile_grid,
    time_outputs,
)

METRICS = ("ttft_p50", "ttft_p90", "ttft_p99", "tbt_p50", "tbt_p90", "tbt_p99", "scheduling_delay_p50",
           "throughput_tokens_per_s", "step_time_p50")


def one_pass(model: str, out_dir: Path, repeats: int, seed: int = 0, halves: bool = False) -> dict[str, Path]:
    """Profile the quick and the full grid in one interleaved timing pass (see the module docstring); returns
    the paths of the saved models by name: ``quick`` and ``full`` (all runs) and, with ``halves``, also
    ``quick-1``, ``quick-2``, ``full-1``, ``full-2`` (fitted on the first / second half of the passes)."""
    if halves and (repeats < 2 or repeats % 2):
        raise ValueError(f"repeats={repeats}: halves needs an even number of passes, at least 2")
    torch.set_num_threads(1)
    load = os.getloadavg()
    engine = build_engine(model, "sarathi", CALIBRATION_CHUNK_SIZE, None, device="cpu")
    warm_up(engine)
    grids = {"quick": profile_grid(quick=True, seed=seed), "full": profile_grid(seed=seed)}
    outputs = {name: grid_outputs(engine, shapes, seed) for name, shapes in grids.items()}
    batches = [(name, i) for name in grids for i in range(len(grids[name]))]
    order = np.random.default_rng(seed).permutation(len(batches))
    timed = time_outputs(engine, [outputs[batches[j][0]][batches[j][1]] for j in order], repeats=repeats)
    runs: dict[str, list] = {name: [None] * len(shapes) for name, shapes in grids.items()}
    for j, r in zip(order, timed):
        name, i = batches[j]
        runs[name][i] = r
    calibration = calibrate(engine, seed=seed)
    h = repeats // 2
    parts = {"": slice(None), **({"-1": slice(0, h), "-2": slice(h, None)} if halves else {})}
    paths = {}
    for name, shapes in grids.items():
        terms = [batch_terms(o) for o in outputs[name]]
        for suffix, passes in parts.items():
            used = [r[passes] for r in runs[name]]
            cost, quality = fit_grid(engine, shapes, terms, used, calibration, max_tokens=512)
            cost.meta = {"model": engine.model_path.name, "machine": host(), "threads": 1, "one_pass": True,
                         "date": datetime.datetime.now().isoformat(timespec="seconds"),
                         "load_average_start": list(load), "load_average_end": list(os.getloadavg()),
                         "grid": {"quick": name == "quick", "shapes": len(shapes), "repeats": len(used[0]),
                                  "passes": [passes.start or 0, passes.stop or repeats]},
                         "fit": quality,
                         "samples": [{"terms": dict(zip(("tokens", *TERMS), t)), "runs": r}
                                     for t, r in zip(terms, used)]}
            paths[name + suffix] = cost.save(out_dir / f"one_pass_{name}{suffix}.json")
            print(f"{name}{suffix}: {len(shapes)} shapes x {len(used[0])} runs, fit on held-out hybrids: median "
                  f"error {100 * quality['held_out']['rel_err_p50']:.1f}%, on the calibration's engine steps "
                  f"{100 * quality['engine_steps']['rel_err_p50']:.1f}%", flush=True)
    return paths


SHORT = {"ttft_p50": "TTFT50", "ttft_p90": "TTFT90", "ttft_p99": "TTFT99", "tbt_p50": "TBT50", "tbt_p90": "TBT90",
         "tbt_p99": "TBT99", "scheduling_delay_p50": "delay50", "throughput_tokens_per_s": "tok/s",
         "step_time_p50": "step50"}


def compare(a: str | Path, b: str | Path, qps: float, num_requests: int, chunk_sizes: list[int]) -> list[dict]:
    """Simulate both traces at each chunk size with the profiles ``a`` and ``b`` (jitter off); one row per
    configuration with each metric's relative difference ``a / b - 1`` and both summaries."""
    models = {name: dataclasses.replace(ProfiledCostModel.load(path), jitter=()) for name, path in (("a", a), ("b", b))}
    rows = []
    for trace in ("conversation", "arxiv"):
        wl = Workload.from_trace(trace, start=1000 if trace == "conversation" else 0, num_requests=num_requests,
                                 qps=qps, prompt_scale=0.25, output_scale=0.25, max_prompt=1024, max_output=128)
        for chunk in chunk_sizes:
            s = {name: sim.run(wl, m, configs=[("sarathi", chunk)])[0].summary() for name, m in models.items()}
            diff = {k: s["a"][k] / s["b"][k] - 1 for k in METRICS if s["a"].get(k) and s["b"].get(k)}
            rows.append({"trace": trace, "chunk_size": chunk, "diff": diff,
                         "a": {k: s["a"][k] for k in METRICS}, "b": {k: s["b"][k] for k in METRICS}})
    return rows


def print_rows(title: str, rows: list[dict]) -> None:
    print(title)
    print(f"{'trace':<13} {'chunk':>5} " + " ".join(f"{SHORT[k]:>8}" for k in METRICS) + f" {'worst':>7}")
    for r in rows:
        worst = max(abs(v) for v in r["diff"].values())
        print(f"{r['trace']:<13} {r['chunk_size']:>5} " +
              " ".join(f"{100 * r['diff'][k]:>+7.1f}%" if k in r["diff"] else f"{'-':>8}" for k in METRICS) +
              f" {100 * worst:>6.1f}%")
    cells = [abs(v) for r in rows for v in r["diff"].values()]
    print(f"{sum(c <= 0.10 for c in cells)} of {len(cells)} metric values within 10%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", help="profile JSON (e.g. the quick one)")
    ap.add_argument("--b", help="profile JSON (e.g. the full one)")
    ap.add_argument("--one-pass", metavar="MODEL", help="instead: profile quick and full grids in one pass")
    ap.add_argument("--repeats", type=int, default=3, help="with --one-pass: timed runs per batch")
    ap.add_argument("--halves", action="store_true",
                    help="with --one-pass: also fit each grid on each half of the passes (the noise floor)")
    ap.add_argument("--chunk-sizes", default="64,128,256")
    ap.add_argument("--qps", type=float, default=0.2)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("results/profile_agreement.json"))
    args = ap.parse_args()
    if args.halves and not args.one_pass:
        ap.error("--halves needs --one-pass")
    pairs = {}
    if args.one_pass:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        paths = one_pass(args.one_pass, args.out.parent, args.repeats, halves=args.halves)
        pairs["quick vs full"] = (paths["quick"], paths["full"])
        if args.halves:
            pairs["quick (first half) vs full (second half)"] = (paths["quick-1"], paths["full-2"])
            pairs["full (first half) vs full (second half)"] = (paths["full-1"], paths["full-2"])
            pairs["quick (first half) vs quick (second half)"] = (paths["quick-1"], paths["quick-2"])
    elif args.a and args.b:
        pairs["a vs b"] = (args.a, args.b)
    else:
        ap.error("give --a and --b, or --one-pass MODEL")
    chunks = [int(c) for c in args.chunk_sizes.split(",")]
    comparisons = {}
    for title, (a, b) in pairs.items():
        rows = compare(a, b, args.qps, args.num_requests, chunks)
        print_rows(title, rows)
        comparisons[title] = {"a": str(a), "b": str(b), "rows": rows}
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": host(),
              "load_average": list(os.getloadavg()), "qps": args.qps, "num_requests": args.num_requests,
              "repeats": args.repeats if args.one_pass else None, "comparisons": comparisons}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
