"""How much faster ``sarathi_lite.sim.sweep`` runs on a local process pool and on a local Ray cluster than serially,
on one sweep whose rows must come out identical.

    python benchmarks/sweep_speed.py --workers 2 --out benchmarks/results/sweep_speed.json

The sweep: the conversation trace at full length (``--num-requests`` requests) on the calibrated H100 Llama-3-8B
model, ``sarathi`` at chunk sizes 256-2048 and ``vllm``, at ``--rates`` arrival rates: one simulation per point.
Each backend runs it once (Ray's start-up included, as a user pays it), in the order serial, process, ray.
A timing benchmark: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import pandas as pd

from sarathi_lite.bench.capacity import SLO
from sarathi_lite.bench.workload import Workload
from sarathi_lite.sim import sweep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--rates", default="5,10,15,20", help="comma-separated arrival rates (req/s)")
    ap.add_argument("--workers", type=int, default=2, help="processes of the pool and CPUs of the Ray cluster")
    ap.add_argument("--out", type=Path, default=Path("results/sweep_speed.json"))
    args = ap.parse_args()
    wl = Workload.from_trace("conversation", num_requests=args.num_requests, start=1000, qps=1.0, max_prompt=7168,
                             max_output=1024)
    configs = [("sarathi", c) for c in (256, 512, 1024, 2048)] + ["vllm"]
    rates = [float(r) for r in args.rates.split(",")]
    common = ({"conversation": wl}, ["roofline:h100:llama3-8b"], configs, [SLO(0.05), SLO(0.1)])
    runs = {"serial": {"backend": "serial"}, "process": {"backend": "process", "workers": args.workers},
            "ray": {"backend": "ray", "ray_options": {"num_cpus": args.workers}}}
    frames, seconds = {}, {}
    for name, options in runs.items():
        t0 = time.perf_counter()
        frames[name] = sweep(*common, qps=rates, progress=False, **options)
        seconds[name] = time.perf_counter() - t0
        print(f"{name:<8} {seconds[name]:7.1f} s  ({seconds['serial'] / seconds[name]:.2f}x serial)")
    for name in ("process", "ray"):
        pd.testing.assert_frame_equal(frames["serial"], frames[name])
    print(f"{len(frames['serial'])} rows, identical on every backend; {len(configs) * len(rates)} simulations")
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cpus": os.cpu_count(), "load_average": os.getloadavg(), "workers": args.workers,
              "num_requests": args.num_requests, "points": len(configs) * len(rates), "seconds": seconds,
              "speedup": {k: seconds["serial"] / v for k, v in seconds.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
