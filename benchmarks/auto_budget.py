"""``chunk_size="auto"`` against every fixed chunk size: simulated serving capacity under a P99 TBT SLO.

For each deployment (``--setups``: this CPU's SmolLM2-135M profile, the H100 roofline of Llama-3-8B) and each
built-in trace (conversation, arxiv), with Poisson arrivals:

1. capacity (Sarathi-Serve's definition: the highest rate with P99 TBT <= the SLO and median scheduling delay
   <= 2 s; ``search_capacity`` with ``--probes`` simulations) of ``sarathi`` at every fixed chunk size from 32 to
   2048 and at ``chunk_size="auto"`` (target ``tbt_slo``, the deployment's ``budget_safety``);
2. at the best fixed chunk size's capacity (equal load): TTFT p50 of that chunk size and of ``auto``;
3. at ``auto``'s capacity: the fraction of all TBT gaps above the SLO.

Every configuration runs with the paper's first-come-first-served budget filling (``hol_protection=False``)
and no prefix cache.

The CPU profile has jitter (single steps spread to 1.25x of the typical one), which the simulator draws per
step: ``auto`` fills every step to its target, so its safety factor must leave room for that spread (0.8); the
roofline is deterministic (0.9, the default).

    python benchmarks/auto_budget.py --out benchmarks/results/auto_budget.json

Each search uses 12 probes by default; `--fixed` replaces the fixed chunk sizes compared (e.g. steps of one block);
`--refine` climbs from the grid's best size in steps of one KV block while the capacity rises, so the best fixed
size is found to the block without a search at every block; ``auto`` aims at P99 (the library's default;
``--tbt-percentile none``: the fixed target), with the measured spread and the target controller
(docs/design/scheduler.md).

Prints a table and writes JSON (every capacity search, the ratios, the load average).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_lite.bench.capacity import SLO, CapacityResult
from sarathi_lite.bench.results import BenchResult, commit, host
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import load_cost_model
from sarathi_lite.scheduler.config import DEFAULT_TBT_PERCENTILE
from sarathi_lite.sim import simulator as sim

FIXED = (32, 64, 128, 256, 512, 1024, 2048)
PROFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sim_profile_smollm2.json"


@dataclass(frozen=True)
class Setup:
    """A deployment: its cost model, SLO (P99 TBT seconds), the workload scaling that fits it, the rate range
    (requests/s) and ``auto``'s safety factor."""

    name: str
    cost_model: str
    tbt_slo: float
    num_requests: int
    scale: float
    max_prompt: int
    max_output: int
    qps_range: tuple[float, float]
    budget_safety: float


SETUPS = {
    # README's CPU SLO: 3 x a 355 ms decode step of 32 requests; lengths scaled as the real CPU benchmarks
    "smollm2-cpu": Setup("smollm2-cpu", str(PROFILE), 1.065, 300, 0.25, 1024, 128, (0.01, 1.0), 0.8),
    "smollm2-cpu-strict": Setup("smollm2-cpu-strict", str(PROFILE), 0.5, 300, 0.25, 1024, 128, (0.01, 1.0), 0.8),
    # an SLO between the P99 steps of chunks 32 and 64 (sarathi/64 just misses it): found by an SLO sweep
    "smollm2-cpu-350ms": Setup("smollm2-cpu-350ms", str(PROFILE), 0.35, 300, 0.25, 1024, 128, (0.01, 1.0), 0.8),
    "h100-llama3-8b": Setup("h100-llama3-8b", "roofline:h100:llama3-8b", 0.1, 1000, 1.0, 7168, 1024,
                            (0.2, 60.0), 0.9),
    "h100-llama3-8b-strict": Setup("h100-llama3-8b-strict", "roofline:h100:llama3-8b", 0.025, 1000, 1.0, 7168,
                                   1024, (0.2, 60.0), 0.9),
    "h100-llama3-8b-15ms": Setup("h100-llama3-8b-15ms", "roofline:h100:llama3-8b", 0.015, 1000, 1.0, 7168,
                                 1024, (0.2, 60.0), 0.9),
    "h100-llama3-8b-12ms": Setup("h100-llama3-8b-12ms", "roofline:h100:llama3-8b", 0.012, 1000, 1.0, 7168,
                                 1024, (0.2, 60.0), 0.9),
    "h100-llama3-8b-10ms": Setup("h100-llama3-8b-10ms", "roofline:h100:llama3-8b", 0.010, 1000, 1.0, 7168,
                                 1024, (0.2, 60.0), 0.9),
    # the calibrated A100 (Llama-3-8B) and Llama-3-70B on 2, 4 and 8 calibrated H100s (tensor parallel)
    "a100-llama3-8b": Setup("a100-llama3-8b", "roofline:a100-80gb:llama3-8b", 0.1, 1000, 1.0, 7168, 1024,
                            (0.2, 40.0), 0.9),
    "a100-llama3-8b-25ms": Setup("a100-llama3-8b-25ms", "roofline:a100-80gb:llama3-8b", 0.025, 1000, 1.0, 7168,
                                 1024, (0.2, 40.0), 0.9),
    **{f"{n}xh100-llama3-70b": Setup(f"{n}xh100-llama3-70b", f"roofline:{n}xh100:llama3-70b", 0.1, 1000, 1.0, 7168,
                                     1024, (0.05, 30.0 if n == 8 else 20.0), 0.9) for n in (2, 4, 8)},
}


def workload(setup: Setup, trace: str) -> Workload:
    start = 1000 if trace == "conversation" else 0  # the conversation trace's first rows are a warm-up
    return Workload.from_trace(trace, num_requests=setup.num_requests, start=start, qps=1.0,
                               prompt_scale=setup.scale, output_scale=setup.scale, max_prompt=setup.max_prompt,
                               max_output=setup.max_output)


def gaps_over(result: BenchResult, slo: float) -> float:
    """Fraction of all TBT gaps (every request's) above ``slo`` seconds."""
    gaps = np.concatenate([np.asarray(r.tbt) for r in result.stats.requests if r.tbt] or [np.zeros(0)])
    return float((gaps > slo).mean()) if gaps.size else 0.0


def stored_fixed(record: dict[str, Any], setup: Setup, trace: str, max_num_seqs: int,
                 default_seats: int) -> dict[int, CapacityResult]:
    """The fixed chunk sizes' capacity searches of ``setup`` and ``trace`` at ``max_num_seqs`` in an earlier run's
    ``record`` (this script's JSON; rows from before ``max_num_seqs`` was recorded ran at ``default_seats``), by
    chunk size: a fixed chunk size never asks the token budget, and the simulations are deterministic, so a
    change to ``auto`` need not search them again. Empty if the record has no such row."""
    out: dict[int, CapacityResult] = {}
    for row in record["rows"]:
        seats = row.get("max_num_seqs", default_seats)
        if (row["setup"], row["trace"], seats) != (setup.name, trace, max_num_seqs):
            continue
        if row["slo_tbt_p99"] != setup.tbt_slo:
            raise SystemExit(f"--fixed-from: {setup.name} {trace} was run at another SLO ({row['slo_tbt_p99']})")
        for search in row["searches"]:
            chunk = search["label"].rpartition("/")[2]
            if chunk.isdigit():
                out[int(chunk)] = CapacityResult.from_dict(search)
    return out


def run_setup(setup: Setup, trace: str, probes: int, fixed: tuple[int, ...] = FIXED,
              tbt_percentile: float | None = DEFAULT_TBT_PERCENTILE, refine: bool = False,
              max_num_seqs: int | None = None, fixed_from: dict[str, Any] | None = None) -> dict[str, Any]:
    cost = load_cost_model(setup.cost_model)
    wl = workload(setup, trace)
    slo = SLO(setup.tbt_slo)
    # The paper's budget filling (first come, first served) and no prefix cache, for every configuration alike:
    # head-of-line protection lets short requests pass long ones, which moves the median scheduling delay the
    # capacity is defined by, and its default long threshold follows the chunk size (see docs/design/scheduler.md).
    options = {"tbt_slo": setup.tbt_slo, "budget_safety": setup.budget_safety, "tbt_percentile": tbt_percentile,
               "hol_protection": False, "enable_prefix_caching": False}
    if max_num_seqs is not None:
        options["max_num_seqs"] = max_num_seqs
    lo, hi = setup.qps_range
    t0 = time.perf_counter()
    seats = sim.scheduler_config(cost, "sarathi", "auto", **options).max_num_seqs
    found: dict[int | str, Any] = {}
    if fixed_from is not None:
        default = sim.scheduler_config(cost, "sarathi", "auto", **{k: v for k, v in options.items()
                                                                  if k != "max_num_seqs"}).max_num_seqs
        found.update(stored_fixed(fixed_from, setup, trace, seats, default))

    def search(chunk: int | str) -> float:
        if chunk not in found:
            [c] = sim.capacity(wl, cost, slo, policies=["sarathi"], chunk_size=chunk, qps_low=lo, qps_high=hi,
                               num_probes=probes, **options)
            found[chunk] = c
            if chunk != "auto":  # keep only the runs used below (each holds every token time)
                for p in c.probes:
                    p.result = None
        return found[chunk].capacity or 0.0

    for chunk in (*fixed, "auto"):
        search(chunk)
    if refine:  # climb from the best of the grid in steps of one block while the capacity rises
        config = sim.scheduler_config(cost, "sarathi", fixed[0], **options)
        block, top = config.block_size, config.max_num_batched_tokens
        best = max(fixed, key=search)
        for direction in (block, -block):
            k = best
            while block <= k + direction <= top and search(k + direction) > search(k):
                k += direction
            best = max((best, k), key=search)
        fixed = tuple(sorted(k for k in found if k != "auto"))
    best = max(fixed, key=search)
    best_cap, auto_cap = found[best].capacity, found["auto"].capacity
    row: dict[str, Any] = {"setup": setup.name, "trace": trace, "slo_tbt_p99": setup.tbt_slo,
                           "max_num_seqs": seats,
                           "budget_safety": setup.budget_safety, "tbt_percentile": tbt_percentile,
                           "workload": wl.describe(), "fixed": list(fixed),
                           "capacity": {str(k): found[k].capacity for k in found}, "best_fixed": best,
                           "ratio": auto_cap / best_cap if auto_cap and best_cap else None}
    if best_cap:
        config = {k: sim.scheduler_config(cost, "sarathi", k, **options) for k in (best, "auto")}
        at = {k: sim.simulate(wl.at_qps(best_cap), cost, config[k], chunk_size=k).summary() for k in config}
        row["equal_load"] = {"qps": best_cap, **{f"ttft_p50_{k}": at[k]["ttft_p50"] for k in at},
                             **{f"tbt_p99_{k}": at[k]["tbt_p99"] for k in at}}
    if auto_cap:
        passed = max((p for p in found["auto"].probes if p.passed), key=lambda p: p.qps)
        row["auto_gaps_over_slo"] = gaps_over(passed.result, setup.tbt_slo)
    row["searches"] = [found[k].to_dict() for k in found]
    row["wall_s"] = time.perf_counter() - t0
    return row


def table(rows: list[dict[str, Any]], fixed: tuple[int, ...] = FIXED) -> str:
    head = (f"{'setup':<18} {'trace':<13} {'SLO ms':>6} " + " ".join(f"{k:>6}" for k in fixed) +
            f" {'auto':>6} {'best':>5} {'ratio':>6} {'TTFT p50 best/auto s':>21} {'gaps>SLO':>8}")
    lines = [head, "capacity, requests/s" + " " * (len(head) - 20)]
    for r in rows:
        cap = r["capacity"]
        cells = " ".join(f"{cap[str(k)]:>6.3f}" if cap[str(k)] else f"{'<':>6}" for k in fixed)
        auto = f"{cap['auto']:>6.3f}" if cap["auto"] else f"{'<':>6}"
        eq = r.get("equal_load")
        ttft = f"{eq['ttft_p50_' + str(r['best_fixed'])]:.2f} / {eq['ttft_p50_auto']:.2f}" if eq else "-"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        gaps = f"{100 * r['auto_gaps_over_slo']:.2f}%" if "auto_gaps_over_slo" in r else "-"
        lines.append(f"{r['setup']:<18} {r['trace']:<13} {1000 * r['slo_tbt_p99']:>6.0f} {cells} {auto} "
                     f"{r['best_fixed']:>5} {ratio:>6} {ttft:>21} {gaps:>8}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--traces", default="conversation,arxiv")
    ap.add_argument("--probes", type=int, default=12, help="simulations per capacity search")
    ap.add_argument("--fixed", default=",".join(map(str, FIXED)),
                    help="comma-separated fixed chunk sizes to compare with (default: the powers of two 32-2048)")
    ap.add_argument("--tbt-percentile", type=lambda t: None if t == "none" else float(t),
                    default=DEFAULT_TBT_PERCENTILE,
                    help=f"auto's tbt_percentile (default {DEFAULT_TBT_PERCENTILE:g}, the library's: the budget aims "
                         "at that percentile of TBT <= the SLO with the measured spread and the target controller; "
                         "none: the fixed target tbt_slo x budget_safety)")
    ap.add_argument("--refine", action="store_true",
                    help="after the --fixed grid, climb from its best size in steps of one KV block (up, then "
                         "down) while the capacity rises: the best fixed size to the block")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="most requests running at once (default: the engine's, 128): with more, a deployment whose "
                         "capacity the seats bound is not")
    ap.add_argument("--cpu-profile", type=Path, default=None,
                    help="the CPU setups' measured profile (`sarathi-lite profile --threads 1`; default: "
                         "benchmarks/results/sim_profile_smollm2.json, 2026-11-30)")
    ap.add_argument("--qps-high", type=float, default=None,
                    help="the capacity searches' highest rate (default: each setup's; a faster profile may need more)")
    ap.add_argument("--fixed-from", type=Path, default=None,
                    help="an earlier run's JSON of the same setups, traces, probes and options: its fixed chunk "
                         "sizes' searches are reused (they never ask the budget; the simulations are "
                         "deterministic) and only `auto` is searched again")
    ap.add_argument("--out", type=Path, default=Path("results/auto_budget.json"))
    args = ap.parse_args()
    for name, setup in SETUPS.items():
        if args.cpu_profile is not None and setup.cost_model == str(PROFILE):
            setup = SETUPS[name] = replace(setup, cost_model=str(args.cpu_profile))
        if args.qps_high is not None:
            SETUPS[name] = replace(setup, qps_range=(setup.qps_range[0], args.qps_high))
    load, code = os.getloadavg(), commit()
    fixed = tuple(int(k) for k in args.fixed.split(","))
    fixed_from = json.loads(args.fixed_from.read_text()) if args.fixed_from else None
    rows = [run_setup(SETUPS[s], t, args.probes, fixed, args.tbt_percentile, args.refine, args.max_num_seqs,
                      fixed_from)
            for s in args.setups.split(",")
            for t in args.traces.split(",")]
    print(table(rows, fixed))
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": code, "machine": host(),
              "load_average_start": list(load), "load_average_end": list(os.getloadavg()),
              "command": "python benchmarks/auto_budget.py " + " ".join(
                  f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
                  if v is not None and v is not False), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"load average {load[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; wrote {args.out}")


if __name__ == "__main__":
    main()
