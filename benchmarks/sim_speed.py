"""How fast the simulator runs on this machine (wall-clock seconds; no model is run).

1. one long run: the first ``--num-requests`` (10,000) requests of the conversation trace at their own arrival
   times and full lengths (prompts clipped to fit Llama-3-8B's 8,192 tokens), ``sarathi/512`` with the roofline
   model of Llama-3-8B on an H100;
2. a sweep: 8 chunk sizes x the chunked policies (``sarathi``, ``simple_chunking``) plus ``vllm`` on the first
   ``--sweep-requests`` (2,000) requests of that workload;
3. a capacity search: ``sarathi/512`` and ``vllm``, 8 probes each, on ``--capacity-requests`` (1,000) requests
   with Poisson arrivals, P99 TBT SLO 100 ms.

    python benchmarks/sim_speed.py --out results/sim_speed.json

Prints a table and writes JSON (timings, what was simulated, the load average).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

from sarathi_lite.bench.capacity import SLO
from sarathi_lite.bench.results import host
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import load_cost_model
from sarathi_lite.sim import simulator as sim

CHUNK_SIZES = (128, 256, 384, 512, 768, 1024, 1536, 2048)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="conversation", help="built-in trace name or CSV path")
    ap.add_argument("--cost-model", default="roofline:h100:llama3-8b")
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--sweep-requests", type=int, default=2_000)
    ap.add_argument("--capacity-requests", type=int, default=1_000)
    ap.add_argument("--out", type=Path, default=Path("results/sim_speed.json"))
    args = ap.parse_args()
    cost = load_cost_model(args.cost_model)
    load = os.getloadavg()
    full = Workload.from_trace(args.trace, num_requests=args.num_requests, max_prompt=7168)
    rows = []

    t0 = time.perf_counter()
    [one] = sim.run(full, cost, policies=["sarathi"], chunk_sizes=[512])
    rows.append({"task": f"{len(full)} requests, sarathi/512", "simulations": 1,
                 "iterations": len(one.stats.iterations), "wall_s": time.perf_counter() - t0})

    part = Workload(full.requests[:args.sweep_requests], full.source, full.seed)
    t0 = time.perf_counter()
    sweep = sim.run(part, cost, policies=["sarathi", "simple_chunking", "vllm"], chunk_sizes=CHUNK_SIZES)
    rows.append({"task": f"sweep: 8 chunk sizes x 2 chunked policies + vllm, {len(part)} requests",
                 "simulations": len(sweep), "iterations": sum(len(r.stats.iterations) for r in sweep),
                 "wall_s": time.perf_counter() - t0})

    probe_wl = Workload(full.requests[:args.capacity_requests], full.source, full.seed)
    t0 = time.perf_counter()
    found = sim.capacity(probe_wl, cost, SLO(0.1), policies=["sarathi", "vllm"], chunk_size=512, qps_low=0.5,
                         qps_high=64.0, num_probes=8)
    rows.append({"task": f"capacity search: sarathi/512 and vllm, 8 probes, {len(probe_wl)} requests",
                 "simulations": sum(len(c.probes) for c in found),
                 "iterations": sum(len(p.result.stats.iterations) for c in found for p in c.probes),
                 "wall_s": time.perf_counter() - t0, "capacity": {c.label: c.capacity for c in found}})

    print(f"{host()}, load average {load[0]:.2f}; "
          f"cost model {args.cost_model}")
    print(f"{'task':<74} {'sims':>5} {'iterations':>11} {'wall s':>7} {'us/iter':>8}")
    for r in rows:
        print(f"{r['task']:<74} {r['simulations']:>5} {r['iterations']:>11} {r['wall_s']:>7.2f} "
              f"{1e6 * r['wall_s'] / r['iterations']:>8.1f}")
    print(f"capacity (req/s): {rows[-1]['capacity']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                                    "machine": host(),
                                    "load_average_start": list(load), "load_average_end": list(os.getloadavg()),
                                    "cost_model": cost.describe(), "workload": full.describe(), "rows": rows},
                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
