"""Short prompts beside long ones under ``chunk_size="auto"``, simulated on this CPU's SmolLM2 profile.

The long-tail mix of ``benchmarks/vllm_plugin.py`` (40 requests at 0.5 req/s, Poisson; every 8th prompt 3,000
tokens, the others 32-256; outputs 32-64), one run per seed, through the simulator on the SmolLM2-135M profile
(``--profile``, with its measured step-to-step jitter), at the README's CPU SLO (P99 TBT <= 1.065 s):

- ``vllm_v1@512``: vLLM's own rule at its 512-token budget (no head-of-line protection);
- ``sarathi@512``: our policy with head-of-line protection at a fixed 512-token chunk;
- ``auto-p99``: ``chunk_size="auto"`` aiming at the P99 TBT (``tbt_percentile=99``), cap 2,048, protection on;
- ``auto-fixed``: ``chunk_size="auto"`` with the fixed target ``0.9 x SLO``, cap 2,048, protection on.

Per system and seed: short-request (prompt < 3,000) and long-request TTFT p99, P99 TBT, output tokens/s; and
the median over the seeds. A check of the budget's split between long and short prompts (which steps' share
the long prompts keep), not a model of vLLM's step times: the profile is of our own engine.

    python benchmarks/long_tail_sim.py --out benchmarks/results/long_tail_sim.json

Prints a table and writes JSON (command, date, commit, machine; simulated: the numbers do not depend on load).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from vllm_plugin import long_tail  # the mix its real runs replay (this script's folder is on sys.path)

from sarathi_lite.bench.results import commit, host
from sarathi_lite.costs import load_cost_model
from sarathi_lite.sim import simulator as sim

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "benchmarks" / "results" / "sim_profile_smollm2_2026-12-03.json"
SLO = 1.065
SYSTEMS: dict[str, tuple[str, int | str, dict[str, Any]]] = {
    "vllm_v1@512": ("vllm_v1", 512, {}),
    "sarathi@512": ("sarathi", 512, {}),
    "auto-p99": ("sarathi", "auto", {"tbt_slo": SLO, "tbt_percentile": 99.0, "max_num_batched_tokens": 2048}),
    "auto-fixed": ("sarathi", "auto", {"tbt_slo": SLO, "budget_safety": 0.9, "tbt_percentile": None,
                                       "max_num_batched_tokens": 2048}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--qps", type=float, default=0.5)
    ap.add_argument("--long-prompt", type=int, default=3000)
    ap.add_argument("--long-every", type=int, default=8)
    ap.add_argument("--profile", type=Path, default=PROFILE)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "long_tail_sim.json")
    args = ap.parse_args()
    code = commit()
    cost = load_cost_model(args.profile)
    tmp = Path(tempfile.mkdtemp(prefix="long-tail-"))
    rows = []
    for name in args.systems.split(","):
        policy, chunk, options = SYSTEMS[name]
        config = sim.scheduler_config(cost, policy, chunk, enable_prefix_caching=False, **options)
        for seed in range(args.seeds):
            wl = long_tail(tmp, seed, args.num_requests, args.qps, args.long_prompt, args.long_every)
            result = sim.simulate(wl, cost, config, chunk_size=chunk, seed=seed)
            reqs = result.stats.requests
            short = [r.ttft for r in reqs if r.ttft is not None and r.num_prompt_tokens < args.long_prompt]
            long = [r.ttft for r in reqs if r.ttft is not None and r.num_prompt_tokens >= args.long_prompt]
            s = result.summary()
            rows.append({"system": name, "seed": seed, "short_ttft_p99": float(np.percentile(short, 99)),
                         "long_ttft_p99": float(np.percentile(long, 99)), "tbt_p99": s["tbt_p99"],
                         "out_tok_s": s["throughput_output_tokens_per_s"]})
    keys = ("short_ttft_p99", "long_ttft_p99", "tbt_p99", "out_tok_s")
    medians = {name: {k: float(np.median([r[k] for r in rows if r["system"] == name])) for k in keys}
               for name in args.systems.split(",")}
    print(f"{'system':<13} " + " ".join(f"{k:>15}" for k in keys) + "   (medians over seeds)")
    for name, m in medians.items():
        print(f"{name:<13} " + " ".join(f"{m[k]:>15.3f}" for k in keys))
    profile = args.profile.resolve()
    profile_arg = str(profile.relative_to(ROOT)) if profile.is_relative_to(ROOT) else profile.name
    command = ("python benchmarks/long_tail_sim.py" + (f" --systems {args.systems}" if args.systems != ",".join(
        SYSTEMS) else "") + f" --seeds {args.seeds} --profile {profile_arg}")
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": code, "machine": host(),
              "load_average": list(os.getloadavg()), "command": command, "slo_tbt_p99": SLO,
              "medians": medians, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
