"""What limits each policy's capacity in the Sarathi-Serve comparison (Mistral-7B on one A100), calibrated and
uncalibrated, under the paper's strict and relaxed P99 TBT SLOs: every probe of every capacity search with the two
quantities the paper's capacity is defined by (P99 TBT, median scheduling delay) and what explains them
(preemptions, the longest stall, the share of token gaps over the SLO, the batch sizes).

    python benchmarks/sarathi_serve_slo.py --requests 400 --probes 7 --out benchmarks/results/sarathi_serve_slo.json

Simulation only (no timing), about 15 minutes on 2 cores. The notebook examples/reproduce_sarathi_serve.ipynb
quotes its findings.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_lite.bench.capacity import SLO, search_capacity
from sarathi_lite.bench.workload import RequestSpec, Workload
from sarathi_lite.costs import load_cost_model
from sarathi_lite.sim.simulator import scheduler_config, simulate

Z90 = 1.2815515655446004
FCFS = {"hol_protection": False, "enable_prefix_caching": False}
CONFIGS = {"strict": {"sarathi": (512, 128), "vllm": (None, 128), "orca": (None, 16)},
           "relaxed": {"sarathi": (2048, 128), "vllm": (None, 128), "orca": (None, 16)}}
SLOS = {"strict": 0.1, "relaxed": 0.5}
CONTEXT = 8192


def openchat_like(n: int, seed: int = 0) -> Workload:
    """Log-normal prompt and output lengths with the paper's openchat_sharegpt4 medians and P90s (Table 3)."""
    rng = np.random.default_rng(seed)

    def draw(median: float, p90: float) -> np.ndarray:
        return np.rint(np.exp(rng.normal(np.log(median), np.log(p90 / median) / Z90, n)))
    prompts = draw(1730, 5696).clip(1, CONTEXT - 1)
    outputs = np.minimum(draw(415, 834).clip(1, None), CONTEXT - prompts)
    specs = tuple(RequestSpec(f"req-{i:04d}", 0.0, int(p), int(o)) for i, (p, o) in enumerate(zip(prompts, outputs)))
    return Workload(specs, {"name": "openchat_sharegpt4-like"}, seed).at_qps(1.0)


def workload(name: str, n: int) -> Workload:
    if name == "openchat_sharegpt4":
        return openchat_like(n)
    return Workload.from_trace(name, num_requests=n, qps=1.0)


def probe_row(result: Any, slo: float) -> dict[str, Any]:
    s = result.summary()
    stats = result.stats
    gaps = np.array([g for r in stats.requests for g in r.tbt]) if stats.requests else np.array([])
    its = stats.iterations
    prefill = np.array([it.num_prefill_tokens for it in its])
    decodes = np.array([it.num_decodes for it in its])
    steps = np.array([it.end_time - it.start_time for it in its])
    return {"tbt_p99": s["tbt_p99"], "scheduling_delay_p50": s["scheduling_delay_p50"],
            "ttft_p50": s["ttft_p50"], "num_preemptions": s["num_preemptions"],
            "gaps_over_slo": float((gaps > slo).mean()) if len(gaps) else 0.0,
            "longest_gap": float(gaps.max()) if len(gaps) else 0.0,
            "longest_step": float(steps.max()), "step_p99": float(np.percentile(steps, 99)),
            "prefill_steps_share": float((prefill > 0).mean()),
            "largest_prefill_step_tokens": int(prefill.max()),
            "mean_decodes_per_step": float(decodes.mean()),
            "throughput_requests_per_s": s["throughput_requests_per_s"]}


def search(task: tuple[str, str, str, str, int, int, float]) -> dict[str, Any]:
    spec, wl_name, slo_name, policy, n, probes, high = task
    cost = load_cost_model(spec)
    chunk, seats = CONFIGS[slo_name][policy]
    config = scheduler_config(cost, policy, chunk, max_num_seqs=seats, **FCFS)
    wl = workload(wl_name, n)
    slo = SLO(SLOS[slo_name], 2.0)
    found = search_capacity(lambda q: simulate(wl.at_qps(q), cost, config, chunk_size=chunk), slo, 0.1, high, probes)
    rows = [{"qps": p.qps, "passed": p.passed, **probe_row(p.result, slo.tbt_p99)} for p in found.probes]
    return {"cost_model": spec, "workload": wl_name, "slo": slo_name, "policy": policy, "chunk_size": chunk,
            "max_num_seqs": seats, "capacity": found.capacity, "failed_above": found.failed_above,
            "num_kv_blocks": config.num_blocks, "probes": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--probes", type=int, default=7)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--high", type=float, default=8.0, help="top of the capacity search range (req/s; bottom 0.1)")
    ap.add_argument("--slos", default="strict,relaxed")
    ap.add_argument("--workloads", default="conversation,openchat_sharegpt4")
    ap.add_argument("--policies", default="sarathi,vllm,orca")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tasks = [(spec, wl, slo, pol, args.requests, args.probes, args.high)
             for spec in ("roofline:a100-80gb:mistral-7b", "roofline-uncalibrated:a100-80gb:mistral-7b")
             for wl in args.workloads.split(",") for slo in args.slos.split(",") for pol in args.policies.split(",")]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(search, tasks))
    for r in results:
        print(f"\n{r['cost_model']:<44} {r['workload']:<20} {r['slo']:<8} {r['policy']:<8} capacity {r['capacity']} "
              f"(fails at {r['failed_above']}), {r['num_kv_blocks']} KV blocks")
        for p in r["probes"]:
            print(f"   {p['qps']:6.3f} req/s {'pass' if p['passed'] else 'FAIL'}: P99 TBT {p['tbt_p99']:.3f} s, "
                  f"delay p50 {p['scheduling_delay_p50']:.2f} s, gaps > SLO {100 * p['gaps_over_slo']:.2f}%, "
                  f"longest gap {p['longest_gap']:.2f} s, preemptions {p['num_preemptions']}, decodes/step "
                  f"{p['mean_decodes_per_step']:.1f}, largest prefill step {p['largest_prefill_step_tokens']} tok, "
                  f"{p['throughput_requests_per_s']:.2f} req/s done")
    if args.out:
        Path(args.out).write_text(json.dumps({"requests": args.requests, "probes": args.probes, "high": args.high,
                                              "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
