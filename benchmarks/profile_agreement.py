"""Do two cost models (say a quick and a full profile of this machine) tell the simulator the same story?

Simulates both built-in traces (lengths scaled by 1/4 and clipped to 1024 / 128 tokens, as the CPU benchmarks;
Poisson arrivals at ``--qps``) under ``sarathi`` at each ``--chunk-sizes`` value with each model, and prints, for
every summary metric, the relative difference ``a / b - 1`` of model A (``--a``) against model B (``--b``).
Both models are simulated without jitter (``jitter=()``), so the comparison is of their typical steps, not of
two random draws.

    python benchmarks/profile_agreement.py --a quick.json --b full.json --out results/profile_agreement.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
from pathlib import Path

from sarathi_lite.bench.results import host
from sarathi_lite.bench.workload import Workload
from sarathi_lite.sim import simulator as sim
from sarathi_lite.sim.cost_model import ProfiledCostModel

METRICS = ("ttft_p50", "ttft_p90", "ttft_p99", "tbt_p50", "tbt_p90", "tbt_p99", "scheduling_delay_p50",
           "throughput_tokens_per_s", "step_time_p50")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="profile JSON (e.g. the quick one)")
    ap.add_argument("--b", required=True, help="profile JSON (e.g. the full one)")
    ap.add_argument("--chunk-sizes", default="64,128,256")
    ap.add_argument("--qps", type=float, default=0.2)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("results/profile_agreement.json"))
    args = ap.parse_args()
    models = {name: dataclasses.replace(ProfiledCostModel.load(path), jitter=())
              for name, path in (("a", args.a), ("b", args.b))}
    rows = []
    for trace in ("conversation", "arxiv"):
        wl = Workload.from_trace(trace, start=1000 if trace == "conversation" else 0,
                                 num_requests=args.num_requests, qps=args.qps, prompt_scale=0.25,
                                 output_scale=0.25, max_prompt=1024, max_output=128)
        for chunk in map(int, args.chunk_sizes.split(",")):
            s = {name: sim.run(wl, m, configs=[("sarathi", chunk)])[0].summary() for name, m in models.items()}
            diff = {k: s["a"][k] / s["b"][k] - 1 for k in METRICS if s["a"].get(k) and s["b"].get(k)}
            rows.append({"trace": trace, "chunk_size": chunk, "diff": diff,
                         "a": {k: s["a"][k] for k in METRICS}, "b": {k: s["b"][k] for k in METRICS}})
    short = {"ttft_p50": "TTFT50", "ttft_p90": "TTFT90", "ttft_p99": "TTFT99", "tbt_p50": "TBT50",
             "tbt_p90": "TBT90", "tbt_p99": "TBT99", "scheduling_delay_p50": "delay50",
             "throughput_tokens_per_s": "tok/s", "step_time_p50": "step50"}
    print(f"{'trace':<13} {'chunk':>5} " + " ".join(f"{short[k]:>8}" for k in METRICS) + f" {'worst':>7}")
    for r in rows:
        worst = max(abs(v) for v in r["diff"].values())
        print(f"{r['trace']:<13} {r['chunk_size']:>5} " +
              " ".join(f"{100 * r['diff'][k]:>+7.1f}%" if k in r["diff"] else f"{'-':>8}" for k in METRICS) +
              f" {100 * worst:>6.1f}%")
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": host(),
              "load_average": list(os.getloadavg()), "a": args.a, "b": args.b, "qps": args.qps,
              "num_requests": args.num_requests, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
