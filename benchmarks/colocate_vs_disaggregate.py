"""Colocate or disaggregate? Which organization serves more requests per GPU within a TTFT and a TBT SLO.

Simulated (``sarathi_lite.sim.disagg``: the real scheduler on every instance, KV transfers queued on a link,
memory counted on both sides) on H100 rooflines:

- setups: Llama-3-8B on one GPU per instance (``llama3-8b``), Llama-3-70B at tensor parallelism 4
  (``llama3-70b-tp4``);
- traces: conversation and arXiv (``--requests`` requests each, prompts clipped to 7,000 and outputs to 1,000
  tokens), Poisson arrivals;
- total GPUs: 2, 4, 8 (a TP-4 instance takes 4: 4 GPUs is one colocated instance only, 8 is 2C against 1P1D);
- organizations: colocated ``sarathi`` replicas (``nC``) at chunk 256, 512, 1024 and 2048 (the best per cell counts),
  every xPyD split with prefill chunk 2048 and decode chunk 512, and every split conditional (prompts of at most
  ``--threshold`` tokens prefilled on the decode instance); KV over ``--link`` (InfiniBand NDR, 50 GB/s per GPU,
  by default), each TP rank sending its shard over its own link;
- SLO grid: TTFT {0.25, 0.5, 1, 2, 5} s x per-request P99 TBT {15, 25, 50, 100} ms.

Per organization, a rate sweep (requests/s per GPU on a geometric grid, ratio sqrt 2; it stops once even the
loosest cell falls below 90%, since no tighter cell can pass beyond); per cell, DistServe's goodput per GPU (the
highest rate with >= 90% of requests meeting both SLOs, interpolated between grid points). The map gives per
cell the winning organization and the ratio of the best disaggregated goodput (splits and conditional) to the
best colocated one (> 1: disaggregation wins). The bandwidth sweep reruns the best disaggregated organization of
a cell at lower link bandwidths until it stops beating colocation.

    python benchmarks/colocate_vs_disaggregate.py --quick              # 8B, conversation, 2 GPUs: ~1 min
    python benchmarks/colocate_vs_disaggregate.py --setups llama3-8b --traces conversation --gpus 2 \
        --max-requests 1500                                            # one map and the bandwidth sweep: ~3 min
    python benchmarks/colocate_vs_disaggregate.py                      # everything: over 40 min on 2 shared cores

The maps in docs/results/colocate_vs_disaggregate.md come from several such runs (the commands are listed there);
8 GPUs of Llama-3-8B (15 organizations, rates up to ~300 req/s) is the slow part.

Prints the maps and the sweep as markdown and writes ``--out`` (default
benchmarks/results/colocate_vs_disaggregate.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sarathi_lite.bench.results import commit, host
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import CostModel, load_cost_model
from sarathi_lite.plan.search import PROBE_SECONDS, probe_workload
from sarathi_lite.plan.space import AUTO_PERCENTILE
from sarathi_lite.sim.disagg import DEFAULT_ATTAINMENT, LINKS, Deployment, Link, RateSweep, simulate

TTFT_SLOS = (0.25, 0.5, 1.0, 2.0, 5.0)
TBT_SLOS = (0.015, 0.025, 0.05, 0.1)
COLOCATED_CHUNKS = (256, 512, 1024, 2048)
PREFILL_CHUNK = 2048
DECODE_CHUNK = 512
HYBRID_RULES = {"move": "short=512,ttft=4096,tbt=0", "fit": "short=512,ttft=4096,tbt=2048",
                "stay": "short=512,ttft=4096,tbt=1000000000"}
"""The hybrid's routing rules (``routing.HybridRule``), the same at every SLO cell: prompts of at most 512 tokens
are prefilled on a decode-heavy instance while its queue plus the prompt stay within 4,096 tokens; the others are
prefilled on a prefill-heavy instance and then ``move`` to a decode-heavy one always, or when that instance's
queue plus the prompt exceed one prefill-heavy chunk (``fit``: the request stays when its prefill fits the next
step), or never (``stay``: a colocated deployment with two chunk sizes and routing by length)."""
SETUPS = {
    "llama3-8b": ("roofline:h100:llama3-8b", 2.0),
    "llama3-70b-tp4": ("roofline:4xh100:llama3-70b", 0.25),
}
"""name -> (cost model, lowest rate of the sweep in requests/s per GPU)."""
RATE_STEPS = 12  # grid points: lowest * sqrt(2) ** k
TIE = 0.05  # goodputs within 5% of each other: neither organization wins
OPTIONS = {"enable_prefix_caching": False, "max_num_seqs": 512}  # the traces share no prefix; seats never bind

logger = logging.getLogger("colocate_vs_disaggregate")


@dataclass(slots=True)
class Family:
    """The organizations of one family (``colocated``, ``disaggregated`` or ``hybrid``) and their sweeps;
    ``only``: sweep label -> the one TBT SLO it counts at (``auto``'s budget is sized to that SLO)."""

    name: str
    sweeps: list[RateSweep]
    only: dict[str, float] = field(default_factory=dict)

    def best(self, ttft: float, tbt: float) -> tuple[str, float]:
        """``(label, goodput per GPU)`` of the best organization at a cell; ``("-", 0)`` when there is none."""
        scored = [(s.goodput(ttft, tbt), s.label) for s in self.sweeps if self.only.get(s.label, tbt) == tbt]
        if not scored:
            return "-", 0.0
        good, label = max(scored)
        return label, good


def organizations(cm: CostModel, num_gpus: int, link: Link, threshold: int) -> tuple[list[Deployment],
                                                                                     list[Deployment]]:
    """``(colocated, disaggregated)`` deployments on ``num_gpus`` GPUs of ``cm``'s instances."""
    per = int(getattr(cm, "tensor_parallel_size", 1))
    n = num_gpus // per
    if n < 1:
        return [], []
    colocated = [Deployment.parse(f"{n}C", cm, chunk_size=c, options=OPTIONS) for c in COLOCATED_CHUNKS]
    disagg = []
    for x in range(1, n):
        for thr in (None, threshold) if x <= n - x else (None,):
            disagg.append(Deployment.parse(f"{x}P{n - x}D", cm, chunk_size=DECODE_CHUNK,
                                           prefill_chunk_size=PREFILL_CHUNK, link=link, threshold=thr,
                                           options=OPTIONS))
    return colocated, disagg


def auto_replicas(cm: CostModel, num_gpus: int) -> list[tuple[float, Deployment]]:
    """``(TBT SLO, deployment)``: colocated replicas at ``chunk_size="auto"`` aimed at each TBT SLO (P99)."""
    n = num_gpus // int(getattr(cm, "tensor_parallel_size", 1))
    return [(tbt, Deployment.parse(f"{n}C", cm, chunk_size="auto",
                                   options={**OPTIONS, "tbt_slo": tbt, "tbt_percentile": AUTO_PERCENTILE}))
            for tbt in TBT_SLOS] if n >= 1 else []


def hybrids(cm: CostModel, num_gpus: int, link: Link) -> list[tuple[float | None, Deployment]]:
    """``(TBT SLO or None, deployment)``: every ``xPHyDH`` split under each rule of ``HYBRID_RULES``, prefill-heavy
    instances at ``PREFILL_CHUNK`` and decode-heavy ones at ``DECODE_CHUNK``, all colocated; and under the
    ``move`` rule with decode-heavy instances at ``chunk_size="auto"`` aimed at each TBT SLO (P99), counted at that
    SLO only."""
    n = num_gpus // int(getattr(cm, "tensor_parallel_size", 1))
    out: list[tuple[float | None, Deployment]] = [
        (None, Deployment.parse(f"{x}PH{n - x}DH/{rule}", cm, chunk_size=DECODE_CHUNK,
                                prefill_chunk_size=PREFILL_CHUNK, link=link, options=OPTIONS))
        for x in range(1, n) for rule in HYBRID_RULES.values()]
    for x in range(1, n):
        for tbt in TBT_SLOS:
            out.append((tbt, Deployment.parse(f"{x}PH{n - x}DH/{HYBRID_RULES['move']}", cm, chunk_size="auto",
                                              prefill_chunk_size=PREFILL_CHUNK, link=link,
                                              options={**OPTIONS, "tbt_slo": tbt,
                                                       "tbt_percentile": AUTO_PERCENTILE})))
    return out


def label_of(dep: Deployment) -> str:
    if dep.colocated is not None:
        auto = dep.colocated.options.get("tbt_slo") if dep.colocated.chunk_size == "auto" else None
        return f"{dep.label}@{dep.colocated.chunk_size}" + (f"/{auto * 1000:g}ms" if auto else "")
    if dep.decode is not None and dep.decode.chunk_size == "auto":
        return f"{dep.label} DH@auto/{dep.decode.options['tbt_slo'] * 1000:g}ms"
    return dep.label


def sweep(dep: Deployment, workload: Workload, lowest: float, min_requests: int, max_requests: int) -> RateSweep:
    """Rates per GPU ``lowest * sqrt(2) ** k`` until even the loosest SLO cell falls below the attainment."""
    rates, results = [], []
    for k in range(RATE_STEPS):
        qps = lowest * math.sqrt(2) ** k * dep.num_gpus
        result = simulate(dep, probe_workload(workload, qps, min_requests, max_requests))
        rates.append(qps)
        results.append(result)
        if result.slo_attainment(max(TTFT_SLOS), max(TBT_SLOS)) < DEFAULT_ATTAINMENT:
            break
    return RateSweep(label_of(dep), dep.num_gpus, rates, results)


def cell_map(colocated: Family, disagg: Family, hybrid: Family | None = None) -> dict[str, Any]:
    """Per SLO cell: the best of each family, their goodputs per GPU, the winner and the ratio (disaggregated /
    colocated); with ``hybrid``: its best, its goodput and ``hybrid_ratio`` (hybrid / the better of the other
    two), and ``winner3`` among the three."""
    cells = {}
    for ttft in TTFT_SLOS:
        for tbt in TBT_SLOS:
            c_label, c_good = colocated.best(ttft, tbt)
            d_label, d_good = disagg.best(ttft, tbt)
            ratio = d_good / c_good if c_good > 0 else (math.inf if d_good > 0 else None)
            cell = {"ttft": ttft, "tbt": tbt, "colocated": c_label, "colocated_goodput": c_good,
                    "disaggregated": d_label, "disaggregated_goodput": d_good,
                    "ratio": None if ratio is None or math.isinf(ratio) else ratio,
                    "winner": _winner(ratio, d_label, c_label)}
            if hybrid is not None:
                h_label, h_good = hybrid.best(ttft, tbt)
                o_label, o_good = max((c_good, c_label), (d_good, d_label))[::-1]
                h_ratio = h_good / o_good if o_good > 0 else (math.inf if h_good > 0 else None)
                cell.update(hybrid=h_label, hybrid_goodput=h_good,
                            hybrid_ratio=None if h_ratio is None or math.isinf(h_ratio) else h_ratio,
                            winner3=_winner(h_ratio, h_label, o_label))
            cells[f"{ttft}/{tbt}"] = cell
    return cells


def _winner(ratio: float | None, challenger: str, incumbent: str) -> str:
    """``challenger`` if ``ratio`` (its goodput over ``incumbent``'s) is above ``1 + TIE``, ``incumbent`` if below
    ``1 - TIE``, else ``"tie"``; ``"none"`` when neither serves anything."""
    if ratio is None:
        return "none"
    if ratio > 1 + TIE:
        return challenger
    return incumbent if ratio < 1 - TIE else "tie"


def map_markdown(cells: dict[str, Any], key: str = "ratio", winner: str = "winner") -> str:
    """The map: rows TTFT SLO, columns TBT SLO, each cell ``winner (ratio)``: disaggregated / colocated goodput
    (default), or with ``key="hybrid_ratio", winner="winner3"`` hybrid / the best of the other two."""
    head = "| TTFT \\ P99 TBT | " + " | ".join(f"{t * 1000:g} ms" for t in TBT_SLOS) + " |"
    lines = [head, "|" + "---|" * (len(TBT_SLOS) + 1)]
    for ttft in TTFT_SLOS:
        row = []
        for tbt in TBT_SLOS:
            c = cells[f"{ttft}/{tbt}"]
            ratio = c[key]
            text = "-" if ratio is None else f"{ratio:.2f}x"
            if c[winner] == "none":
                row.append("none")
            elif ratio is None:
                row.append(f"**{c[winner]}** (0)")
            else:
                row.append(f"**{c[winner]}** {text}" if c[winner] != "tie" else f"tie {text}")
        lines.append(f"| {ttft:g} s | " + " | ".join(row) + " |")
    return "\n".join(lines)


def cost_spec(setup: str, uncalibrated: bool = False) -> str:
    """The setup's cost model: the roofline calibrated on measured H100 timings, or the analytic formula."""
    spec = SETUPS[setup][0]
    return spec.replace("roofline:", "roofline-uncalibrated:", 1) if uncalibrated else spec


def run_setup(setup: str, trace: str, num_gpus: int, workload: Workload, link: Link, threshold: int,
              limits: tuple[int, int], uncalibrated: bool = False, auto: bool = False, hybrid: bool = False
              ) -> dict[str, Any] | None:
    spec, lowest = cost_spec(setup, uncalibrated), SETUPS[setup][1]
    cm = load_cost_model(spec)
    colocated, disagg = organizations(cm, num_gpus, link, threshold)
    if not colocated:
        return None
    wall = time.perf_counter()
    c_sweeps = [sweep(d, workload, lowest, *limits) for d in colocated]
    only = {}
    for tbt, d in auto_replicas(cm, num_gpus) if auto else ():
        c_sweeps.append(sweep(d, workload, lowest, *limits))
        only[c_sweeps[-1].label] = tbt
    d_sweeps = [sweep(d, workload, lowest, *limits) for d in disagg]
    h_sweeps, h_only = [], {}
    for tbt, d in hybrids(cm, num_gpus, link) if hybrid else ():
        h_sweeps.append(sweep(d, workload, lowest, *limits))
        if tbt is not None:
            h_only[h_sweeps[-1].label] = tbt
    cells = cell_map(Family("colocated", c_sweeps, only), Family("disaggregated", d_sweeps),
                     Family("hybrid", h_sweeps, h_only) if h_sweeps else None)
    logger.info("%s %s %d GPUs: %d organizations in %.0f s", setup, trace, num_gpus,
                len(c_sweeps) + len(d_sweeps) + len(h_sweeps), time.perf_counter() - wall)
    return {"setup": setup, "cost_model": spec, "trace": trace, "num_gpus": num_gpus, "cells": cells,
            "sweeps": {s.label: {"rates": s.rates, "attainment": {f"{a}/{b}": s.attainment(a, b)
                                                                  for a in TTFT_SLOS for b in TBT_SLOS},
                                 "transfer_time_p50": [r.summary()["transfer_time_p50"] for r in s.results]}
                       for s in c_sweeps + d_sweeps + h_sweeps},
            "_objects": (cm, colocated, disagg, c_sweeps, d_sweeps, limits)}


def bandwidth_sweep(entry: dict[str, Any], workload: Workload, bandwidths: Sequence[float],
                    cell: tuple[float, float] | None = None) -> dict[str, Any]:
    """Rerun the best disaggregated organization of ``cell`` (default: the cell where it wins by most) at each
    link bandwidth (bytes/s); its goodput per GPU against the best colocated one's there."""
    cm, colocated, disagg, c_sweeps, d_sweeps, limits = entry["_objects"]
    cells = entry["cells"]
    if cell is None:
        best = max(cells.values(), key=lambda c: c["ratio"] or 0)
        cell = (best["ttft"], best["tbt"])
    c = cells[f"{cell[0]}/{cell[1]}"]
    lowest = SETUPS[entry["setup"]][1]
    by_label = {label_of(d): d for d in disagg}
    dep = by_label[c["disaggregated"]] if c["disaggregated"] in by_label else disagg[0]
    rows = []
    for bw in bandwidths:
        variant = Deployment(prefill=dep.prefill, decode=dep.decode, link=dep.link.scaled(bw),
                             threshold=dep.threshold, num_links=dep.num_links)
        s = sweep(variant, workload, lowest, *limits)
        good = s.goodput(*cell)
        transfer = [r.summary()["transfer_time_p50"] for r in s.results]
        rows.append({"bandwidth": bw, "goodput": good, "ratio": good / c["colocated_goodput"]
                     if c["colocated_goodput"] else None,
                     "transfer_time_p50_at_goodput": _at_rate(s.rates, transfer, good * s.num_gpus)})
    paying = [r["bandwidth"] for r in rows if r["ratio"] is not None and r["ratio"] > 1 + TIE]
    return {"setup": entry["setup"], "trace": entry["trace"], "num_gpus": entry["num_gpus"],
            "cell": {"ttft": cell[0], "tbt": cell[1]}, "organization": label_of(dep),
            "colocated": c["colocated"], "colocated_goodput": c["colocated_goodput"], "rows": rows,
            "lowest_paying_bandwidth": min(paying) if paying else None}


def _at_rate(rates: list[float], values: list[float | None], rate: float) -> float | None:
    """``values`` at the grid rate nearest below ``rate``."""
    below = [v for q, v in zip(rates, values) if q <= rate * (1 + 1e-9)]
    return below[-1] if below else None


def sweep_markdown(sw: dict[str, Any]) -> str:
    lines = [f"{sw['setup']}, {sw['trace']}, {sw['num_gpus']} GPUs, cell TTFT {sw['cell']['ttft']:g} s / P99 TBT "
             f"{sw['cell']['tbt'] * 1000:g} ms: {sw['organization']} against {sw['colocated']} "
             f"({sw['colocated_goodput']:.2f} req/s/GPU)", "",
             "| link GB/s | goodput req/s/GPU | vs colocated | transfer p50 ms |", "|---|---|---|---|"]
    for r in sw["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        tt = "-" if r["transfer_time_p50_at_goodput"] is None else f"{r['transfer_time_p50_at_goodput'] * 1e3:.2f}"
        lines.append(f"| {r['bandwidth'] / 1e9:g} | {r['goodput']:.2f} | {ratio} | {tt} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--traces", nargs="+", default=["conversation", "arxiv"])
    p.add_argument("--gpus", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--requests", type=int, default=300, help="fewest requests per probe (default 300)")
    p.add_argument("--max-requests", type=int, default=3000,
                   help=f"most requests per probe (default 3000); between the two, {PROBE_SECONDS:g} s of arrivals")
    p.add_argument("--link", default="infiniband", choices=list(LINKS))
    p.add_argument("--threshold", type=int, default=512, help="conditional: prompt tokens prefilled on decode")
    p.add_argument("--bandwidths", nargs="+", type=float, default=[450, 50, 12.5, 5, 2, 1, 0.5],
                   help="link bandwidths of the sweep, GB/s")
    p.add_argument("--sweep-at", nargs=4, metavar=("SETUP", "TRACE", "GPUS", "TTFT/TBT"),
                   default=["llama3-8b", "conversation", "4", "auto"],
                   help="the bandwidth sweep's setup, trace, GPU count and cell ('auto': where D wins by most)")
    p.add_argument("--uncalibrated", action="store_true",
                   help="price steps with the analytic roofline formula (roofline-uncalibrated:), as the maps made "
                        "before the calibration did")
    p.add_argument("--auto", action="store_true",
                   help="also colocated replicas at chunk_size='auto' (P99), one per TBT SLO, each counted at its own")
    p.add_argument("--hybrid", action="store_true",
                   help="a third organization: every xPHyDH split under each rule of HYBRID_RULES; a second map, "
                        "hybrid against the best of the other two")
    p.add_argument("--no-bandwidth-sweep", action="store_true", help="skip the link bandwidth sweep")
    p.add_argument("--quick", action="store_true", help="8B, conversation, 2 GPUs, 100 requests, 3 bandwidths")
    p.add_argument("--out", default="benchmarks/results/colocate_vs_disaggregate.json")
    args = p.parse_args(argv)
    if args.quick:
        args.setups, args.traces, args.gpus, args.requests = ["llama3-8b"], ["conversation"], [2], 100
        args.max_requests = 300
        args.bandwidths = [50, 2, 0.5]
        args.sweep_at = ["llama3-8b", "conversation", "2", "auto"]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    wall = time.perf_counter()
    link = LINKS[args.link]
    entries = []
    workloads = {}
    for trace in args.traces:
        workloads[trace] = Workload.from_trace(trace, num_requests=max(args.requests, args.max_requests), qps=1.0,
                                               max_prompt=7000, max_output=1000)
    for setup in args.setups:
        for trace in args.traces:
            for g in args.gpus:
                entry = run_setup(setup, trace, g, workloads[trace], link, args.threshold,
                                  (args.requests, args.max_requests), args.uncalibrated, args.auto, args.hybrid)
                if entry is None:
                    continue
                entries.append(entry)
                print(f"\n### {setup}, {trace}, {g} GPUs (winner, best disaggregated / best colocated goodput)\n")
                print(map_markdown(entry["cells"]))
                if args.hybrid:
                    print(f"\n### {setup}, {trace}, {g} GPUs (winner of three, best hybrid / the best other)\n")
                    print(map_markdown(entry["cells"], "hybrid_ratio", "winner3"))
    setup, trace, gpus, cell = args.sweep_at
    target = next((e for e in entries if (e["setup"], e["trace"], e["num_gpus"]) == (setup, trace, int(gpus))),
                  None)
    sweep_result = None
    if target is not None and not args.no_bandwidth_sweep:
        at = None if cell == "auto" else tuple(float(x) for x in cell.split("/"))
        sweep_result = bandwidth_sweep(target, workloads[trace], [b * 1e9 for b in args.bandwidths], at)
        print("\n### Transfer bandwidth sweep\n")
        print(sweep_markdown(sweep_result))
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": host(), "commit": commit(),
              "command": "python benchmarks/colocate_vs_disaggregate.py " + " ".join(sys.argv[1:] if argv is None
                                                                                     else argv),
              "wall_time": time.perf_counter() - wall, "link": link.name,
              "requests": [args.requests, args.max_requests], "threshold": args.threshold,
              "attainment": DEFAULT_ATTAINMENT,
              "workloads": {t: w.describe() for t, w in workloads.items()},
              "maps": [{k: v for k, v in e.items() if k != "_objects"} for e in entries],
              "bandwidth_sweep": sweep_result}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"\n{time.perf_counter() - wall:.0f} s")
    return report

if __name__ == "__main__":
    main()
