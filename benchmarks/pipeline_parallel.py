"""Pipeline parallelism, simulated: bubble fraction and serving capacity of sarathi, vllm and orca at pipeline
depths 2, 4 and 8 (``sarathi_lite.sim.simulator``, the real scheduler classes on a roofline clock).

Deployments, all on 8 A100-80GB (roofline presets; tensor parallelism within a stage, pipeline stages over a
link between nodes):

- Falcon-180B-shaped (``falcon-180b``) on ``a100-80gb-100gbe`` (stages meet over 100 Gb/s Ethernet), as
  Sarathi-Serve's Falcon-180B deployment: TP 4 x PP 2 (the paper's), TP 2 x PP 4, TP 1 x PP 8, and TP 8 x PP 1
  (one NVLink node of 8, no pipeline) for reference;
- Llama-3-70B-shaped (``llama3-70b``) on ``a100-80gb`` (200 Gb/s InfiniBand between stages): the same four shapes.

Traffic: the conversation and arXiv traces (``--num-requests`` requests from the start of each, lengths clipped to
7,168 prompt / 1,024 output tokens), Poisson arrivals; no prefix cache and first-come-first-served budget filling
(``hol_protection=False``), as the paper's comparisons. Policies: ``sarathi`` (chunk ``--chunk-strict`` under the
strict SLO, ``--chunk-relaxed`` under the relaxed one, the paper's two token budgets), ``vllm`` and ``orca``
(unchunked, prefill-prioritizing), each with ``max_concurrent_batches`` = the pipeline depth (a request is in at
most one micro-batch in flight). ``sarathi``'s capacity under the relaxed SLO is the better of its two chunk
sizes.

SLOs (per deployment: a deeper pipeline's token passes more stages and sends): P99 TBT at most 5x (strict) and
25x (relaxed) the time of a decode-only micro-batch of 32 requests with 4k-token contexts through that deployment
(every stage and send), and a median scheduling delay of at most 2 s (the paper's rule for its SLOs, applied to
this roofline). Capacity: a geometric bisection of the arrival rate over ``[--qps-low, --qps-high]`` x the
model's scale with ``--probes`` simulations. Bubble fraction (idle time of all stages over stages x the time
anything was in flight) at each policy's relaxed-SLO capacity, and of all three policies at one common rate (the
lowest of their relaxed capacities).

    python benchmarks/pipeline_parallel.py                       # 27 min on a 2-core VM under load
    python benchmarks/pipeline_parallel.py --models falcon-180b --traces conversation --probes 6   # a quick look

Prints the tables and writes ``--out`` (default benchmarks/results/pipeline_parallel.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

from sarathi_lite.bench.capacity import SLO
from sarathi_lite.bench.results import BenchResult, host
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import CostModel, load_cost_model
from sarathi_lite.scheduler import SchedulerOutput
from sarathi_lite.scheduler.output import ScheduledRequest
from sarathi_lite.sim import simulator as sim

MODELS = {  # model shape -> (hardware preset, capacity search scale in requests/s)
    "falcon-180b": ("a100-80gb-100gbe", 1.0),
    "llama3-70b": ("a100-80gb", 2.0),
}
SHAPES = ((8, 1), (4, 2), (2, 4), (1, 8))  # (tensor parallel, pipeline parallel) over 8 devices
POLICIES = ("sarathi", "vllm", "orca")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--traces", default="conversation,arxiv")
    ap.add_argument("--shapes", default=",".join(f"{t}x{p}" for t, p in SHAPES),
                    help="comma-separated TPxPP shapes over 8 devices")
    ap.add_argument("--num-requests", type=int, default=300,
                    help="requests per run: well above max_num_seqs (128), or an unchunked policy admits a whole "
                         "overload at once and its stalls hide among the drain's clean gaps")
    ap.add_argument("--probes", type=int, default=5, help="simulations per capacity search")
    ap.add_argument("--qps-low", type=float, default=0.1, help="capacity search range (times the model's scale)")
    ap.add_argument("--qps-high", type=float, default=6.0)
    ap.add_argument("--chunk-strict", type=int, default=512)
    ap.add_argument("--chunk-relaxed", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "pipeline_parallel.json")
    return ap.parse_args()


def decode_batch(num_requests: int = 32, context: int = 4096) -> SchedulerOutput:
    """A decode-only micro-batch: ``num_requests`` decodes, each after ``context`` cached tokens."""
    out = SchedulerOutput()
    for i in range(num_requests):
        out.add(ScheduledRequest(f"d{i}", context, 1, [0], [], True, False))
    return out


def slos(cost: CostModel) -> dict[str, SLO]:
    """The strict (5x) and relaxed (25x) P99 TBT SLOs of a deployment: multiples of a decode-only micro-batch's
    time through it."""
    decode = cost.predict_step_time(decode_batch())
    return {"strict": SLO(tbt_p99=5 * decode), "relaxed": SLO(tbt_p99=25 * decode)}


def geometric_capacity(probe: Any, slo: SLO, low: float, high: float, num_probes: int
                       ) -> tuple[float | None, BenchResult | None, list[dict[str, Any]]]:
    """The highest rate in ``[low, high]`` (requests/s) meeting ``slo``, by bisection on the rate's logarithm:
    ``low`` first (a fail ends it: below the range), then ``high`` (a pass ends it), then geometric midpoints.
    Returns ``(capacity or None, the passing run at it, every probe)``."""
    probes: list[dict[str, Any]] = []
    best: tuple[float | None, BenchResult | None] = (None, None)

    def run(qps: float) -> bool:
        nonlocal best
        result = probe(qps)
        s = result.summary()
        passed = slo.met_by(s)
        probes.append({"qps": qps, "passed": passed, "tbt_p99": s["tbt_p99"],
                       "scheduling_delay_p50": s["scheduling_delay_p50"], "bubble_fraction": s.get("bubble_fraction")})
        if passed and (best[0] is None or qps > best[0]):
            best = (qps, result)
        return passed

    if not run(low) or run(high):
        return best[0], best[1], probes
    lo, hi = low, high
    for _ in range(num_probes - 2):
        mid = (lo * hi) ** 0.5
        if run(mid):
            lo = mid
        else:
            hi = mid
    return best[0], best[1], probes


def config_options(policy: str, chunk: int) -> tuple[int | None, dict[str, Any]]:
    return (chunk if policy == "sarathi" else None), {"enable_prefix_caching": False, "hol_protection": False}


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    cells: list[dict[str, Any]] = []
    for model in args.models.split(","):
        hw, scale = MODELS[model]
        for trace in args.traces.split(","):
            wl = Workload.from_trace(trace, num_requests=args.num_requests, qps=1.0, max_prompt=7168,
                                     max_output=1024, seed=args.seed)
            for tp, pp in shapes:
                spec = f"roofline:{tp}x{pp}x{hw}:{model}"
                cost = load_cost_model(spec)
                shape_slos = slos(cost)
                cell: dict[str, Any] = {"model": model, "trace": trace, "tp": tp, "pp": pp, "cost_model": spec,
                                        "slos": {k: v.tbt_p99 for k, v in shape_slos.items()}, "policies": {}}
                for policy in POLICIES:
                    entry: dict[str, Any] = {}
                    for name, slo in shape_slos.items():
                        tried = []
                        chunks = (None,) if policy != "sarathi" else (args.chunk_strict,) if name == "strict" else \
                            (args.chunk_strict, args.chunk_relaxed)
                        for chunk_choice in chunks:
                            chunk, options = config_options(policy, chunk_choice or 0)
                            config = sim.scheduler_config(cost, policy, chunk, **options)

                            def probe(qps: float, w=wl, m=cost, c=config, k=chunk) -> BenchResult:
                                return sim.simulate(w.at_qps(qps), m, c, chunk_size=k, seed=args.seed)

                            capacity, at, probes = geometric_capacity(probe, slo, args.qps_low * scale,
                                                                      args.qps_high * scale, args.probes)
                            tried.append({"chunk_size": chunk, "tbt_slo": slo.tbt_p99, "capacity": capacity,
                                          "bubble_fraction": at.summary().get("bubble_fraction") if at else None,
                                          "probes": probes})
                        entry[name] = max(tried, key=lambda t: t["capacity"] or 0.0)
                        entry[name]["tried"] = [{k: t[k] for k in ("chunk_size", "capacity")} for t in tried]
                    cell["policies"][policy] = entry
                relaxed = [e["relaxed"]["capacity"] for e in cell["policies"].values()]
                if all(c is not None for c in relaxed):
                    common = min(relaxed)
                    cell["common_qps"] = common
                    for policy in POLICIES:
                        chunk, options = config_options(policy, cell["policies"][policy]["relaxed"]["chunk_size"]
                                                        or args.chunk_relaxed)
                        result = sim.simulate(wl.at_qps(common), cost, sim.scheduler_config(cost, policy, chunk,
                                                                                              **options),
                                              chunk_size=chunk, seed=args.seed)
                        s = result.summary()
                        cell["policies"][policy]["common"] = {"bubble_fraction": s.get("bubble_fraction"),
                                                              "tbt_p99": s["tbt_p99"], "ttft_p50": s["ttft_p50"]}
                cells.append(cell)
                print_cell(cell)
                sys.stdout.flush()
                record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": host(),
                          "command": "python " + " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()},
                          "wall_time": time.perf_counter() - t_start, "cells": cells}
                args.out.write_text(json.dumps(record, indent=1))  # after every cell: a long run keeps its part
    print()
    print_summary(cells)
    print(f"\nwrote {args.out} ({record['wall_time']:.0f} s)")


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_cell(cell: dict[str, Any]) -> None:
    head = f"{cell['model']} {cell['trace']} TP{cell['tp']} x PP{cell['pp']}"
    print(f"\n{head}  (P99 TBT SLOs {cell['slos']['strict']:.3f} / {cell['slos']['relaxed']:.3f} s; common rate "
          f"{_fmt(cell.get('common_qps'))} req/s)")
    print(f"  {'policy':8} {'strict cap':>10} {'relaxed cap':>11} {'bubble@cap':>10} {'bubble@common':>13}")
    for policy, e in cell["policies"].items():
        common = e.get("common", {}).get("bubble_fraction")
        print(f"  {policy:8} {_fmt(e['strict']['capacity']):>10} {_fmt(e['relaxed']['capacity']):>11} "
              f"{_fmt(e['relaxed']['bubble_fraction'], '.1%'):>10} {_fmt(common, '.1%'):>13}")


def print_summary(cells: list[dict[str, Any]]) -> None:
    """One row per cell: sarathi's capacity over vllm's and orca's, and their bubble over sarathi's (common rate)."""
    print(f"{'model':12} {'trace':13} {'shape':9} {'strict s/v':>10} {'relaxed s/v':>11} {'relaxed s/o':>11} "
          f"{'bubble v/s':>10} {'bubble o/s':>10}")
    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"

    for c in cells:
        p = c["policies"]
        common = {policy: p[policy].get("common", {}).get("bubble_fraction") for policy in POLICIES}
        shape = f"TP{c['tp']}xPP{c['pp']}"
        print(f"{c['model']:12} {c['trace']:13} {shape:9} "
              f"{ratio(p['sarathi']['strict']['capacity'], p['vllm']['strict']['capacity']):>10} "
              f"{ratio(p['sarathi']['relaxed']['capacity'], p['vllm']['relaxed']['capacity']):>11} "
              f"{ratio(p['sarathi']['relaxed']['capacity'], p['orca']['relaxed']['capacity']):>11} "
              f"{ratio(common['vllm'], common['sarathi']):>10} {ratio(common['orca'], common['sarathi']):>10}")


if __name__ == "__main__":
    main()
