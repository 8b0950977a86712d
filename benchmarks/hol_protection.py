"""Head-of-line protection on long-context traffic: short requests arriving while a very long prompt is prefilled.

Simulated (the issue's setting): a roofline H100 serving a Llama-3.1-8B-shaped model (128k context), chunk 2048,
1,000 requests of 100-600 prompt and 50-250 output tokens with 10 of them given a 60,000-token prompt, Poisson at
5, 10 and 20 requests/s. Configurations, all ``sarathi``:

- ``paper``: the Sarathi-Serve paper's FCFS budget filling (``hol_protection=False``), the reference;
- ``paper+knobs``: the same with the hand-tuned knobs of the issue (4 partial prefills, threshold 1024, one long);
- ``paper+t256``: the same with ``long_prefill_token_threshold=256`` alone (the setting that backfired);
- ``protected``: the default (``hol_protection=True``, thresholds derived from the chunk size);
- ``protected+t256``: protection with the threshold of 256.

Per configuration: short-request (prompt <= 600) TTFT p90/p99, long-request TTFT p50, throughput (prompt +
output tokens/s over the run), P99 TBT, each against ``paper``; and the issue's goals for ``protected``: short
TTFT p99 >= 5x lower, long TTFT p50 at most 20% higher, throughput within 2% (not lower by more), P99 TBT no
worse.

With ``--real``: the same comparison (``paper`` and ``protected``) replayed in real time on SmolLM2-135M on this
CPU, the traffic scaled to fit (chunk 256, ``--real-requests`` requests of 32-128 prompt and 8-32 output tokens,
``--real-long`` of them with a ``--real-long-prompt``-token prompt, Poisson at ``--real-qps``), next to the
simulator's prediction of that very run with the profiled cost model ``--profile``.

    python benchmarks/hol_protection.py                     # simulated only, about 30 s
    python benchmarks/hol_protection.py --real --threads 1  # plus the real CPU run, a few minutes

Prints the tables and writes ``--out`` (default docs/hol_protection.json) and the real runs' JSON under
``--results``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_lite.bench.results import BenchResult, host, save_results
from sarathi_lite.bench.workload import Workload
from sarathi_lite.sim import simulator as sim

SHORT_MAX = 600  # prompts up to this many tokens are the "short" requests of the simulated workload
CONFIGS: dict[str, dict[str, Any]] = {
    "paper": {"hol_protection": False},
    "paper+knobs": {"hol_protection": False, "max_num_partial_prefills": 4, "long_prefill_token_threshold": 1024,
                    "max_long_partial_prefills": 1},
    "paper+t256": {"hol_protection": False, "long_prefill_token_threshold": 256},
    "protected": {},
    "protected+t256": {"long_prefill_token_threshold": 256},
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qps", default="5,10,20", help="comma-separated arrival rates of the simulated runs")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--num-long", type=int, default=10)
    ap.add_argument("--long-prompt", type=int, default=60_000)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", action="store_true", help="also replay the scaled traffic on SmolLM2 on this CPU")
    ap.add_argument("--real-requests", type=int, default=60)
    ap.add_argument("--real-long", type=int, default=3)
    ap.add_argument("--real-long-prompt", type=int, default=2000)
    ap.add_argument("--real-qps", type=float, default=1.0)
    ap.add_argument("--real-chunk-size", type=int, default=256)
    ap.add_argument("--profile", type=Path, default=Path("docs/sim_profile_smollm2.json"),
                    help="the profiled SmolLM2 cost model the real run is predicted with")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of the real run")
    ap.add_argument("--results", type=Path, default=Path("results/hol_protection"))
    ap.add_argument("--out", type=Path, default=Path("docs/hol_protection.json"))
    return ap.parse_args()


def metrics(result: BenchResult, short_max: int) -> dict[str, float]:
    """Short-request TTFT p90/p99 and long-request TTFT p50 (seconds), throughput (tokens/s), P99 TBT (s)."""
    done = [r for r in result.stats.requests if r.ttft is not None]
    short = [r.ttft for r in done if r.num_prompt_tokens <= short_max]
    long_ = [r.ttft for r in done if r.num_prompt_tokens > short_max]
    s = result.summary()
    return {"short_ttft_p90": float(np.percentile(short, 90)), "short_ttft_p99": float(np.percentile(short, 99)),
            "long_ttft_p50": float(np.percentile(long_, 50)), "throughput": s["throughput_tokens_per_s"],
            "tbt_p99": s["tbt_p99"], "num_short": len(short), "num_long": len(long_)}


def against(m: dict[str, float], ref: dict[str, float]) -> dict[str, float]:
    """The ratios the goals are stated in."""
    return {"short_ttft_p99_x_lower": ref["short_ttft_p99"] / m["short_ttft_p99"],
            "long_ttft_p50_change": m["long_ttft_p50"] / ref["long_ttft_p50"] - 1,
            "throughput_change": m["throughput"] / ref["throughput"] - 1,
            "tbt_p99_change": m["tbt_p99"] / ref["tbt_p99"] - 1}


def goals(r: dict[str, float]) -> dict[str, bool]:
    return {"short_ttft_p99_5x_lower": r["short_ttft_p99_x_lower"] >= 5,
            "long_ttft_p50_at_most_20pct_higher": r["long_ttft_p50_change"] <= 0.20,
            "throughput_within_2pct": r["throughput_change"] >= -0.02,
            "tbt_p99_no_worse": r["tbt_p99_change"] <= 0.0}


def table(rows: list[tuple[str, dict[str, float], dict[str, float]]]) -> str:
    lines = [f"{'config':<16} {'short TTFT p90':>14} {'p99':>8} {'(x lower)':>9} {'long TTFT p50':>13} {'(chg)':>7} "
             f"{'tok/s':>7} {'(chg)':>6} {'TBT p99':>8} {'(chg)':>6}"]
    for label, m, r in rows:
        lines.append(f"{label:<16} {m['short_ttft_p90']:>12.3f} s {m['short_ttft_p99']:>6.3f} s "
                     f"{r['short_ttft_p99_x_lower']:>8.1f}x {m['long_ttft_p50']:>11.2f} s "
                     f"{r['long_ttft_p50_change']:>+7.0%} {m['throughput']:>7.0f} {r['throughput_change']:>+6.1%} "
                     f"{1e3 * m['tbt_p99']:>6.1f}ms {r['tbt_p99_change']:>+6.0%}")
    return "\n".join(lines)


def simulated(args: argparse.Namespace) -> dict[str, Any]:
    cost_model = sim.load_cost_model("roofline:h100:llama3.1-8b")
    base = Workload.synthetic("uniform:100-600:50-250", num_requests=args.num_requests, qps=1.0, seed=args.seed)
    base = base.with_long_prompts(args.num_long, args.long_prompt)
    out: dict[str, Any] = {}
    for qps in [float(q) for q in args.qps.split(",")]:
        workload = base.at_qps(qps)
        results, rows = {}, []
        for label, options in CONFIGS.items():
            config = sim.scheduler_config(cost_model, "sarathi", args.chunk_size, **options)
            results[label] = sim.simulate(workload, cost_model, config)
        ref = metrics(results["paper"], SHORT_MAX)
        entry = {}
        for label, result in results.items():
            m = metrics(result, SHORT_MAX)
            r = against(m, ref)
            rows.append((label, m, r))
            entry[label] = {"options": CONFIGS[label], "metrics": m, "vs_paper": r}
        entry["protected"]["goals"] = goals(entry["protected"]["vs_paper"])
        print(f"\nsimulated, {workload.describe()}\n{table(rows)}\ngoals (protected): "
              f"{entry['protected']['goals']}")
        out[f"{qps:g}"] = entry
    return out


def real(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from sarathi_lite.bench import replay

    torch.set_num_threads(args.threads)
    long_min = 128
    workload = Workload.synthetic("uniform:32-128:8-32", num_requests=args.real_requests, qps=args.real_qps,
                                  seed=args.seed).with_long_prompts(args.real_long, args.real_long_prompt)
    configs = [("sarathi", args.real_chunk_size)]
    measured, predicted = {}, {}
    cost_model = sim.load_cost_model(args.profile)
    for label in ("paper", "protected"):
        loadavg = os.getloadavg()
        measured[label] = replay.run(workload, configs=configs, progress=False, **CONFIGS[label])[0]
        measured[label].meta["loadavg_before"] = loadavg
        config = sim.scheduler_config(cost_model, "sarathi", args.real_chunk_size,
                                      num_kv_blocks=measured[label].config["num_kv_blocks"],
                                      max_model_len=measured[label].config["max_model_len"], **CONFIGS[label])
        predicted[label] = sim.simulate(workload, cost_model, config)
    save_results(list(measured.values()), args.results / "real")
    out: dict[str, Any] = {"workload": workload.describe(), "loadavg": [m.meta["loadavg_before"]
                                                                        for m in measured.values()]}
    for kind, runs in (("measured", measured), ("simulated", predicted)):
        ref = metrics(runs["paper"], long_min)
        rows = [(label, metrics(r, long_min), against(metrics(r, long_min), ref)) for label, r in runs.items()]
        out[kind] = {label: {"metrics": m, "vs_paper": r} for label, m, r in rows}
        print(f"\nreal CPU run ({kind}), SmolLM2-135M, {args.threads} thread(s), {workload.describe()}\n"
              f"{table(rows)}")
    return out


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    command = "python benchmarks/hol_protection.py " + " ".join(sys.argv[1:])
    report: dict[str, Any] = {"command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                              "machine": host(), "loadavg": os.getloadavg(), "simulated": simulated(args)}
    if args.real:
        report["real"] = real(args)
    report["wall_time"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out} ({report['wall_time']:.0f} s, load average {report['loadavg']})")


if __name__ == "__main__":
    main()
