"""A real disaggregated run on this CPU: SmolLM2 as 1P1D (a prefill and a decode instance, K/V over gloo
point-to-point) against 2 colocated replicas ("2"), every instance its own process with one torch thread, on the
same scaled conversation trace replayed in real time; then the simulator's prediction of both runs.

Workload: ``--num-requests`` rows of the conversation trace from row 1000 (the first rows are a warm-up), lengths
scaled by 1/4 and clipped to 1024 / 128 tokens (as ``hol_protection.py``'s CPU setup), Poisson arrivals at
``--qps``, EOS ignored. Each organization runs it in ``--rounds`` alternating rounds (1P1D, 2, then 2, 1P1D, ...),
both engines started once and warmed up; the load average is printed before each run.

Per run, side by side: TTFT p50/p99, TBT p50/p99, K/V transfer time per request p50 (measured on the decode
instance: ask, receive, write, acknowledge), the share of requests meeting the TTFT SLO and the TBT SLO (their own
P99 time between tokens) and both, and throughput (prompt + output tokens/s). The prediction:
``sarathi_lite.sim.disagg`` with the profiled SmolLM2 CPU cost model (``--profile``) as every instance's, the same
workload, chunk size, KV pool and max_model_len, and a CPU-loopback link whose bandwidth is the one measured in
the real 1P1D runs (total bytes moved / total transfer seconds; ``--link-bandwidth`` states one instead); then
the relative error (predicted / measured - 1) of every cell.

    python benchmarks/disagg_real.py --num-requests 60 --qps 0.5 --rounds 2

Prints the table and writes JSON (``--out``, default benchmarks/results/disagg_real.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_lite.bench.replay import play, warm_up_instances
from sarathi_lite.bench.results import host
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import load_cost_model
from sarathi_lite.engine.instances import ProcessEngine
from sarathi_lite.metrics import RequestMetrics, Stats, slo_arrays
from sarathi_lite.models.builtin import resolve_model
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.sim.disagg import Deployment, Link, simulate

PROFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sim_profile_smollm2.json"
LAYOUTS = ("1P1D", "2")
METRICS = ("ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99", "transfer_p50", "ttft_slo", "tbt_slo", "both_slo",
           "throughput_tokens_per_s")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--qps", type=float, default=0.5)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=2048, help="per instance")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per instance")
    ap.add_argument("--ttft-slo", type=float, default=5.0, help="seconds")
    ap.add_argument("--tbt-slo", type=float, default=1.065, help="seconds (the README's CPU SLO)")
    ap.add_argument("--link-bandwidth", type=float, default=None,
                    help="bytes/s of the simulated CPU-loopback link (default: measured in the 1P1D runs)")
    ap.add_argument("--profile", default=str(PROFILE))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/disagg_real.json"))
    return ap.parse_args()


def workload(args: argparse.Namespace) -> Workload:
    return Workload.from_trace("conversation", num_requests=args.num_requests, start=1000, qps=args.qps,
                               prompt_scale=0.25, output_scale=0.25, max_prompt=1024, max_output=128)


def replay(engine: ProcessEngine, wl: Workload, prompts: list[list[int]]) -> tuple[Stats, dict[str, float]]:
    """Replay ``wl`` in real time on ``engine`` (idle); returns its stats and each request's transfer seconds."""
    engine.reset_stats()
    play(engine, list(zip(wl.requests, prompts)), time.perf_counter)
    return engine.stats(), {rid: t for rid, (t, _) in engine.transfers.items()}


def cells(requests: list[RequestMetrics], summary: dict[str, Any], transfers: list[float],
          ttft_slo: float, tbt_slo: float) -> dict[str, float | None]:
    done = [r for r in requests if r.finished_time is not None and r.ttft is not None]
    ttft, tbt = slo_arrays(done)
    return {"ttft_p50": summary["ttft_p50"], "ttft_p99": summary["ttft_p99"], "tbt_p50": summary["tbt_p50"],
            "tbt_p99": summary["tbt_p99"],
            "transfer_p50": float(np.percentile(transfers, 50)) if transfers else None,
            "ttft_slo": float(np.mean(ttft <= ttft_slo)), "tbt_slo": float(np.mean(tbt <= tbt_slo)),
            "both_slo": float(np.mean((ttft <= ttft_slo) & (tbt <= tbt_slo))),
            "throughput_tokens_per_s": summary["throughput_tokens_per_s"]}


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def table(measured: dict[str, dict], predicted: dict[str, dict], error: dict[str, dict]) -> str:
    head = f"{'metric':<24}" + "".join(f"{f'{lay} {k}':>16}" for lay in LAYOUTS for k in ("real", "sim", "err"))
    lines = [head]
    for m in METRICS:
        row = f"{m:<24}"
        for lay in LAYOUTS:
            row += f"{fmt(measured[lay][m]):>16}{fmt(predicted[lay][m]):>16}"
            e = error[lay][m]
            row += f"{'-' if e is None else f'{e:+.0%}':>16}"
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    command = "python benchmarks/disagg_real.py " + " ".join(sys.argv[1:])
    path = resolve_model(args.model)
    mc = ModelConfig.from_pretrained(path)
    wl = workload(args)
    prompts = wl.prompt_token_ids(mc.vocab_size)
    options = dict(chunk_size=args.chunk_size, device="cpu", num_kv_blocks=args.num_kv_blocks)
    engines = {lay: ProcessEngine(args.model, instances=lay, num_threads=args.threads, **options) for lay in LAYOUTS}
    runs: dict[str, list[dict[str, Any]]] = {lay: [] for lay in LAYOUTS}
    moved_bytes, moved_seconds = 0.0, 0.0
    try:
        for engine in engines.values():  # warm-up: every instance runs a few steps
            warm_up_instances(engine, mc.vocab_size)
        block_bytes = None
        for r in range(args.rounds):
            for lay in (LAYOUTS if r % 2 == 0 else tuple(reversed(LAYOUTS))):
                engine = engines[lay]
                load = os.getloadavg()
                stats, transfers = replay(engine, wl, prompts)
                s = stats.summary()
                cell = cells(stats.requests, s, list(transfers.values()), args.ttft_slo, args.tbt_slo)
                if lay == "1P1D":
                    cfg = engine.scheduler_config
                    block_bytes = cfg.block_size * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4  # fp32
                    moved_bytes += sum(n for _, n in engine.transfers.values()) * block_bytes
                    moved_seconds += sum(transfers.values())
                runs[lay].append({"round": r, "loadavg_before": load, "loadavg_after": os.getloadavg(), **cell})
                print(f"round {r} {lay:<5} load {load[0]:.2f}: " + ", ".join(f"{k} {fmt(v)}" for k, v in cell.items()),
                      flush=True)
        cfg = engines["2"].scheduler_config
    finally:
        for engine in engines.values():
            engine.shutdown()
    measured = {lay: {m: (statistics.median([x[m] for x in runs[lay]])
                          if all(x[m] is not None for x in runs[lay]) else None) for m in METRICS}
                for lay in LAYOUTS}
    bandwidth = args.link_bandwidth or (moved_bytes / moved_seconds if moved_seconds > 0 else 1e9)
    link = Link("cpu-loopback (gloo)", bandwidth, 0.0)
    cm = load_cost_model(args.profile)
    sim_options = dict(num_kv_blocks=cfg.num_blocks, max_model_len=cfg.max_model_len, block_size=cfg.block_size)
    predicted = {}
    for lay in LAYOUTS:
        dep = Deployment.parse(lay, cm, chunk_size=args.chunk_size, link=link, options=sim_options)
        result = simulate(dep, wl)
        s = result.summary()
        predicted[lay] = cells(result.requests, s, [t.transfer_time for t in result.transfers], args.ttft_slo,
                               args.tbt_slo)
    error = {lay: {m: (predicted[lay][m] / measured[lay][m] - 1 if measured[lay][m] and predicted[lay][m] is not None
                       else None) for m in METRICS} for lay in LAYOUTS}
    print(f"\nSmolLM2 on this CPU, {wl.describe()}, chunk {args.chunk_size}, {args.threads} thread(s) per instance, "
          f"median of {args.rounds} round(s); link {bandwidth / 1e9:.2f} GB/s "
          f"({'stated' if args.link_bandwidth else 'measured'}); SLOs TTFT <= {args.ttft_slo} s, TBT <= "
          f"{args.tbt_slo} s\n{table(measured, predicted, error)}")
    out = {"command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"), "host": host(),
           "workload": wl.describe(), "chunk_size": args.chunk_size, "threads_per_instance": args.threads,
           "slo": {"ttft": args.ttft_slo, "tbt": args.tbt_slo}, "link_bandwidth": bandwidth,
           "link_bandwidth_source": "stated" if args.link_bandwidth else "measured",
           "kv_block_bytes": block_bytes, "runs": runs, "measured_median": measured, "simulated": predicted,
           "relative_error": error, "wall_time_s": time.perf_counter() - t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
