"""The Sarathi-Serve trade-off on this machine: cost per token, serving capacity under a TBT SLO, and every
policy and chunk size on the identical online workload (real-time replay of the conversation trace).

Workload: rows ``--start ..`` of the Azure conversation trace with prompt and output lengths scaled by
``--prompt-scale``/``--output-scale`` and clipped to ``--max-prompt``/``--max-output`` (defaults 1/4, 1024, 128:
this CPU runs SmolLM2-135M about two orders of magnitude slower than an A100 runs Mistral-7B), Poisson arrivals
from ``--seed``. Chunk sizes are scaled alike: ``--chunk-size 128`` stands for the paper's 512. Every engine runs
the paper's policies as published (``hol_protection=False``; the default is on), so the ratios stay
comparable with the paper's and with earlier runs (``benchmarks/hol_protection.py`` measures the protection).

Steps, each printed as it finishes:
1. cost per token: decode-only, hybrid and prefill-only batches of 128 tokens; the "decode step" (a decode-only
   batch of 32 requests with 256 cached tokens each) that sets the SLO: P99 TBT <= ``--slo-factor`` x it;
2. capacity of each ``--capacity-policies`` at ``--chunk-size``: binary search on the rate (Sarathi-Serve's
   definition: P99 TBT within the SLO and median scheduling delay within ``--max-scheduling-delay``);
3. at one load (``--qps``, default: the capacity found for ``sarathi``), every ``--policies`` at ``--chunk-size``
   and ``sarathi`` at every ``--chunk-sizes``.

Prefix caching is off here (the paper's baselines have none): the trace's prompts share no prefix, but under a
small pool a preempted request would find its own prefix cached and recompute less, which changes the
comparison.

    python benchmarks/serving.py --threads 1        # about 31 minutes on 2 CPU cores

Writes every run's JSON and CSVs under ``--results`` (default results/serving), the figures under ``--figures``
(default docs/results/, beside the results page), and ``serving_results.md`` and ``serving_results.json`` under
``--report`` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from sarathi_lite.bench.capacity import SLO, CapacityResult
from sarathi_lite.bench.plots import plot_capacity, plot_results
from sarathi_lite.bench.replay import build_engine, cost_per_token, machine, measured_capacity, run, warm_up
from sarathi_lite.bench.results import BenchResult, compare, compare_markdown, config_label, save_results
from sarathi_lite.bench.workload import Workload

PAPER = {"enable_prefix_caching": False}  # the paper's five-policy comparison: no prefix cache


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--trace", default="conversation", help="built-in trace name or CSV path")
    ap.add_argument("--start", type=int, default=1000, help="first trace row (the first rows are its warm-up)")
    ap.add_argument("--num-requests", type=int, default=50, help="requests of the comparison runs")
    ap.add_argument("--capacity-requests", type=int, default=30, help="requests of each capacity probe")
    ap.add_argument("--prompt-scale", type=float, default=0.25)
    ap.add_argument("--output-scale", type=float, default=0.25)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-size", type=int, default=128, help="chunk size of the policy comparison and capacity")
    ap.add_argument("--chunk-sizes", default="32,64,128,256", help="sarathi's chunk-size sweep")
    ap.add_argument("--policies", default="sarathi,vllm,orca,request_level,simple_chunking")
    ap.add_argument("--capacity-policies", default="sarathi,vllm")
    ap.add_argument("--slo-factor", type=float, default=3.0, help="P99 TBT SLO in decode steps")
    ap.add_argument("--max-scheduling-delay", type=float, default=2.0, help="median scheduling delay bound (s)")
    ap.add_argument("--qps-low", type=float, default=0.2)
    ap.add_argument("--qps-high", type=float, default=1.6)
    ap.add_argument("--probes", type=int, default=6, help="capacity probes per policy")
    ap.add_argument("--qps", type=float, default=None, help="load of the comparison (default: sarathi's capacity)")
    ap.add_argument("--results", type=Path, default=Path("results/serving"))
    ap.add_argument("--figures", type=Path, default=Path("docs/results"))
    ap.add_argument("--report", type=Path, default=Path("benchmarks/results"))
    return ap.parse_args()


PAPER = {"hol_protection": False}  # the Sarathi-Serve paper's first-come-first-served policies


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}, load {os.getloadavg()[0]:.2f}] {msg}", flush=True)


def trace_workload(args: argparse.Namespace, num_requests: int, qps: float) -> Workload:
    return Workload.from_trace(args.trace, start=args.start, num_requests=num_requests, qps=qps,
                               prompt_scale=args.prompt_scale, output_scale=args.output_scale,
                               max_prompt=args.max_prompt, max_output=args.max_output, seed=args.seed)


def capacity_rows(found: list[CapacityResult]) -> list[str]:
    rows = ["| config | capacity (req/s) | lowest failing rate | probes: rate -> P99 TBT ms / median delay s |",
            "| --- | --- | --- | --- |"]
    for c in found:
        probes = ", ".join(f"{p.qps:.3f} {'pass' if p.passed else 'fail'} ({_ms(p.tbt_p99)} / "
                           f"{p.scheduling_delay_p50:.2f})" for p in c.probes)
        cap = f"< {c.qps_range[0]}" if c.capacity is None else f"{c.capacity:.3f}"
        fail = "-" if c.failed_above is None else f"{c.failed_above:.3f}"
        rows.append(f"| {c.label} | {cap} | {fail} | {probes} |")
    return rows


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def checks(by_label: dict[str, BenchResult], sweep: list[BenchResult], found: list[CapacityResult],
           chunk: int) -> dict[str, Any]:
    """The issue's three targets, each with its measured numbers and whether it was reached."""
    out: dict[str, Any] = {}
    sarathi, vllm = by_label.get(f"sarathi/{chunk}"), by_label.get("vllm")
    if sarathi and vllm:
        s, v = sarathi.summary(), vllm.summary()
        ratio = v["tbt_p99"] / s["tbt_p99"]
        tput = s["throughput_tokens_per_s"] / v["throughput_tokens_per_s"] - 1
        out["p99_tbt"] = {"sarathi_ms": 1000 * s["tbt_p99"], "vllm_ms": 1000 * v["tbt_p99"],
                          "vllm_over_sarathi": ratio, "throughput_diff": tput,
                          "reached": ratio >= 3 and abs(tput) <= 0.10}
    summaries = [r.summary() for r in sorted(sweep, key=lambda r: r.config["chunk_size"])]
    tbt = [s["tbt_p99"] for s in summaries]
    ttft = [s["ttft_p50"] for s in summaries]
    out["chunk_sweep"] = {"chunk_sizes": [s["chunk_size"] for s in summaries],
                          "tbt_p99_ms": [1000 * t for t in tbt], "ttft_p50_s": ttft,
                          "tbt_rises_with_chunk": all(a <= b for a, b in zip(tbt, tbt[1:])),
                          "ttft_falls_with_chunk": all(a >= b for a, b in zip(ttft, ttft[1:]))}
    caps = {c.label: c for c in found}
    if f"sarathi/{chunk}" in caps and "vllm" in caps:
        sc, vc = caps[f"sarathi/{chunk}"], caps["vllm"]
        ratio = None if not (sc.capacity and vc.capacity) else sc.capacity / vc.capacity
        bound = None
        if sc.capacity and vc.capacity is None:  # vllm failed even the lowest rate: a lower bound on the ratio
            bound = sc.capacity / vc.qps_range[0]
        out["capacity"] = {"sarathi": sc.capacity, "vllm": vc.capacity, "ratio": ratio,
                           "ratio_at_least": bound,
                           "reached": (ratio is not None and ratio >= 2) or (bound is not None and bound >= 2)}
    return out


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("sarathi_lite.bench.replay", "sarathi_lite.bench.capacity"):  # each run's and each probe's outcome
        logging.getLogger(name).setLevel(logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/serving.py " + " ".join(sys.argv[1:])
    t_start = time.perf_counter()
    args.figures.mkdir(parents=True, exist_ok=True)
    args.report.mkdir(parents=True, exist_ok=True)
    log(f"{command}\n{machine()}")

    # 1. cost per token and the SLO
    engine = build_engine(args.model, "sarathi", args.chunk_size, **PAPER)
    warm_up(engine)
    cost = cost_per_token(engine, num_tokens=128, context_len=128)
    step = cost_per_token(engine, num_tokens=32, context_len=256).row("decode-only").step_time
    slo = SLO(args.slo_factor * step, args.max_scheduling_delay)
    log(f"cost per token (batches of 128 tokens, decodes with 128 cached tokens):\n{cost.table()}\n"
        f"decode step (32 decodes x 256 cached tokens): {1000 * step:.0f} ms -> SLO: P99 TBT <= "
        f"{1000 * slo.tbt_p99:.0f} ms, median scheduling delay <= {slo.scheduling_delay_p50} s")

    # 2. capacity
    cap_workload = trace_workload(args, args.capacity_requests, 1.0)
    log(f"capacity workload: {cap_workload.describe()} (arrivals re-drawn per probe)")
    found = measured_capacity(cap_workload, slo, policies=args.capacity_policies.split(","),
                              chunk_size=args.chunk_size, qps_low=args.qps_low, qps_high=args.qps_high,
                              num_probes=args.probes, engine=engine, **PAPER)
    cap_dir = args.results / "capacity"
    cap_dir.mkdir(parents=True, exist_ok=True)
    for c in found:
        for p in c.probes:
            p.result.to_json(cap_dir / f"{c.label.replace('/', '_')}_qps{p.qps:.3f}.json")
    log("capacity:\n" + "\n".join(capacity_rows(found)))
    plot_capacity(found, args.figures / "serving_capacity.png")

    # 3. every policy and chunk size at one load
    sarathi_cap = next((c.capacity for c in found if c.label == f"sarathi/{args.chunk_size}"), None)
    qps = args.qps or sarathi_cap or args.qps_low
    workload = trace_workload(args, args.num_requests, qps)
    log(f"comparison workload: {workload.describe()}")
    policies = args.policies.split(",")
    sweep_chunks = [int(c) for c in args.chunk_sizes.split(",")]
    configs = [(p, args.chunk_size if p in ("sarathi", "simple_chunking") else None) for p in policies]
    configs += [("sarathi", c) for c in sweep_chunks if c != args.chunk_size]
    results = run(workload, configs=configs, engine=engine, **PAPER)
    save_results(results, args.results / "comparison")
    by_label = {r.label: r for r in results}
    policy_results = [by_label[config_label(p, c)] for p, c in configs[:len(policies)]]
    sweep = [r for r in results if r.config["policy"] == "sarathi"]
    sweep.sort(key=lambda r: r.config["chunk_size"])
    log(f"policies at chunk size {args.chunk_size}, {qps:.3f} req/s:\n{compare(policy_results)}")
    log(f"sarathi chunk sizes:\n{compare(sweep)}")
    plot_results(policy_results, args.figures / "serving_policies.png")
    plot_results(sweep, args.figures / "serving_chunk_sweep.png", max_timelines=len(sweep))

    verdict = checks(by_label, sweep, found, args.chunk_size)
    elapsed = time.perf_counter() - t_start
    report = {"command": command, "date": datetime.date.today().isoformat(), "machine": machine(),
              "load_average_end": list(os.getloadavg()), "elapsed_s": elapsed, "slo": {
                  "decode_step_s": step, "tbt_p99_s": slo.tbt_p99,
                  "scheduling_delay_p50_s": slo.scheduling_delay_p50},
              "cost_per_token": cost.to_dict(), "capacity": [c.to_dict() for c in found],
              "comparison_qps": qps, "comparison_workload": workload.source,
              "comparison": [r.summary() for r in results],
              "load_average_per_run": {r.label: [r.meta["load_average_start"][0], r.meta["load_average_end"][0]]
                                       for r in results},
              "checks": verdict}
    (args.report / "serving_results.json").write_text(json.dumps(report, indent=1))
    md = [f"Command: `{command}`  ", f"Date: {report['date']}; machine: {report['machine']}; "
          f"{elapsed / 60:.0f} minutes.", "",
          "Cost per token:", "", "```", cost.table(), "```", "",
          f"SLO: P99 TBT <= {1000 * slo.tbt_p99:.0f} ms ({args.slo_factor:g} x a {1000 * step:.0f} ms decode step "
          f"of 32 requests with 256 cached tokens), median scheduling delay <= {slo.scheduling_delay_p50} s.", "",
          f"Capacity ({cap_workload.describe()}, arrivals re-drawn per probe):", "", *capacity_rows(found), "",
          f"Policies at chunk size {args.chunk_size} ({workload.describe()}):", "",
          compare_markdown(policy_results), "", "Sarathi chunk sizes, same workload:", "", compare_markdown(sweep),
          "", "Checks:", "", "```", json.dumps(verdict, indent=1), "```"]
    (args.report / "serving_results.md").write_text("\n".join(md) + "\n")
    log(f"checks: {json.dumps(verdict, indent=1)}\nwrote {args.figures}/serving_*.png, "
        f"{args.report}/serving_results.md/json and "
        f"{args.results}/ in {elapsed / 60:.1f} minutes")


if __name__ == "__main__":
    main()
