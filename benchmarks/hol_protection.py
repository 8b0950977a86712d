"""Head-of-line protection: what it buys on long-context traffic, and that it costs nothing on ordinary traffic.

**Long-context traffic** (short requests arriving while a very long prompt is prefilled). Simulated: a roofline
H100 serving a Llama-3.1-8B-shaped model (128k context), chunk 2048, 1,000 requests of 100-600 prompt and
50-250 output tokens with 10 of them given a 60,000-token prompt, Poisson at 5, 10 and 20 requests/s.
Configurations, all ``sarathi``:

- ``paper``: the Sarathi-Serve paper's FCFS budget filling (``hol_protection=False``), the reference;
- ``paper+t256``: the same with ``long_prefill_token_threshold=256`` alone (the setting that backfired);
- ``protected``: the default (``hol_protection=True``, thresholds derived from the chunk size);
- ``protected+t256``: protection with the threshold of 256.

Per configuration: short-request (prompt <= 600) TTFT p90/p99, long-request TTFT p50, throughput (prompt +
output tokens/s over the run), P99 TBT, each against ``paper``; and the goals for ``protected``: short TTFT p99
>= 5x lower, throughput within 2% (not lower by more).

**Ordinary traffic** (``--parts ordinary``): the conversation and arXiv traces as the serving benchmarks use
them (this CPU's SmolLM2 profile: lengths scaled 1/4 and clipped to 1024 / 128 tokens, SLO P99 TBT <= 1.065 s;
the H100 roofline of Llama-3-8B: unscaled, clipped to 7168 / 1024, SLO 100 ms; median scheduling delay <= 2 s
in both), Poisson arrivals, ``sarathi`` at chunk sizes 64 to 2048, the default (``protected``) against
``hol_protection=False`` (``plain``), both without a prefix cache (these traces share no prefix). Per cell: the
serving capacity of each (``--probes`` simulations per search), then both run at ``plain``'s capacity (near
capacity): TTFT p50 and p99, throughput. Goals: TTFT p50 at most 10% higher, throughput not more than 3% lower
(a higher one means ``plain`` built a backlog at its own capacity), capacity no lower.

With ``--real``: real-time replays on SmolLM2-135M on this CPU beside the simulator's prediction of each
(profiled cost model ``--profile``): the long-context comparison scaled to fit (chunk 256, ``--real-requests``
requests of 32-128 prompt and 8-32 output tokens, ``--real-long`` of them with a ``--real-long-prompt``-token
prompt, Poisson at ``--real-qps``), and ordinary traffic (``--ordinary-requests`` conversation-trace requests
at ``--ordinary-qps``, chunk ``--ordinary-chunk``, ``protected`` and ``plain`` in ``--rounds`` alternating
rounds).

    python benchmarks/hol_protection.py                                 # simulated only, a few minutes
    python benchmarks/hol_protection.py --real --threads 1              # plus the real CPU runs

Prints the tables and writes ``--out`` (default benchmarks/results/hol_protection.json) and the real runs' JSON under
``--results``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_lite.bench.capacity import SLO
from sarathi_lite.bench.results import BenchResult, commit, host, save_results
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import load_cost_model
from sarathi_lite.sim import simulator as sim

SHORT_MAX = 600  # prompts up to this many tokens are the "short" requests of the simulated workload
CONFIGS: dict[str, dict[str, Any]] = {
    "paper": {"hol_protection": False},
    "paper+t256": {"hol_protection": False, "long_prefill_token_threshold": 256},
    "protected": {},
    "protected+t256": {"long_prefill_token_threshold": 256},
}
ORDINARY_CHUNKS = (64, 128, 256, 512, 1024, 2048)
PROFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sim_profile_smollm2.json"


@dataclass(frozen=True)
class Setup:
    """An ordinary-traffic deployment: its cost model, SLO (P99 TBT seconds), the trace scaling that fits it and
    the rate range of the capacity searches (requests/s)."""

    name: str
    cost_model: str
    tbt_slo: float
    num_requests: int
    scale: float
    max_prompt: int
    max_output: int
    qps_range: tuple[float, float]

    def workload(self, trace: str, qps: float = 1.0, num_requests: int | None = None) -> Workload:
        start = 1000 if trace == "conversation" else 0  # the conversation trace's first rows are a warm-up
        return Workload.from_trace(trace, num_requests=num_requests or self.num_requests, start=start, qps=qps,
                                   prompt_scale=self.scale, output_scale=self.scale, max_prompt=self.max_prompt,
                                   max_output=self.max_output)


SETUPS = {
    # the README's CPU SLO (3 x a 355 ms decode step of 32 requests); lengths scaled as the real CPU benchmarks
    "smollm2-cpu": Setup("smollm2-cpu", str(PROFILE), 1.065, 330, 0.25, 1024, 128, (0.01, 1.0)),
    "h100-llama3-8b": Setup("h100-llama3-8b", "roofline:h100:llama3-8b", 0.1, 1000, 1.0, 7168, 1024, (0.2, 60.0)),
}
ORDINARY = {"protected": {}, "plain": {"hol_protection": False}}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="long,ordinary", help="comma-separated: long (long-context traffic), "
                    "ordinary (the traces near capacity)")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"ordinary traffic's deployments: {', '.join(SETUPS)}")
    ap.add_argument("--traces", default="conversation,arxiv", help="ordinary traffic's traces")
    ap.add_argument("--chunk-sizes", default=",".join(map(str, ORDINARY_CHUNKS)), help="ordinary traffic's chunks")
    ap.add_argument("--probes", type=int, default=10, help="simulations per capacity search (ordinary traffic)")
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
    ap.add_argument("--real-parts", default="long,ordinary", help="which real runs --real makes")
    ap.add_argument("--ordinary-requests", type=int, default=30)
    ap.add_argument("--ordinary-qps", type=float, default=0.5)
    ap.add_argument("--ordinary-chunk", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the real ordinary-traffic run")
    ap.add_argument("--profile", type=Path, default=PROFILE,
                    help="the profiled SmolLM2 cost model the real run is predicted with")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of the real run")
    ap.add_argument("--results", type=Path, default=Path("results/hol_protection"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/hol_protection.json"))
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
    cost_model = load_cost_model("roofline:h100:llama3.1-8b")
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
    cost_model = load_cost_model(args.profile)
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


def ordinary_cell(setup: Setup, trace: str, chunk: int, probes: int) -> dict[str, Any]:
    """One (deployment, trace, chunk size) cell of the ordinary-traffic study: both capacities, then both runs
    at ``plain``'s capacity."""
    cost = load_cost_model(setup.cost_model)
    wl = setup.workload(trace)
    slo = SLO(setup.tbt_slo)
    lo, hi = setup.qps_range
    caps = {}
    for label, options in ORDINARY.items():
        [c] = sim.capacity(wl, cost, slo, policies=["sarathi"], chunk_size=chunk, qps_low=lo, qps_high=hi,
                           num_probes=probes, enable_prefix_caching=False, **options)
        caps[label] = c.capacity
    qps = caps["plain"] or lo
    at = {}
    for label, options in ORDINARY.items():
        config = sim.scheduler_config(cost, "sarathi", chunk, enable_prefix_caching=False, **options)
        s = sim.simulate(wl.at_qps(qps), cost, config, chunk_size=chunk).summary()
        at[label] = {k: s[k] for k in ("ttft_p50", "ttft_p99", "throughput_tokens_per_s", "tbt_p99",
                                       "scheduling_delay_p50")}
    p, d = at["plain"], at["protected"]
    ratios = {"ttft_p50": d["ttft_p50"] / p["ttft_p50"], "ttft_p99": d["ttft_p99"] / p["ttft_p99"],
              "throughput": d["throughput_tokens_per_s"] / p["throughput_tokens_per_s"],
              "capacity": (caps["protected"] or 0.0) / caps["plain"] if caps["plain"] else None}
    met = {"ttft_p50_at_most_10pct_higher": ratios["ttft_p50"] <= 1.10,
           # "within 3%" as a cost: higher throughput at plain's capacity means plain fell behind (a backlog)
           "throughput_within_3pct": ratios["throughput"] >= 0.97,
           "capacity_no_lower": (caps["protected"] or 0.0) >= (caps["plain"] or 0.0)}
    return {"setup": setup.name, "trace": trace, "chunk_size": chunk, "slo_tbt_p99": setup.tbt_slo,
            "workload": wl.describe(), "capacity": caps, "qps": qps, "at_plain_capacity": at, "ratios": ratios,
            "goals": met}


def ordinary_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'setup':<15} {'trace':<13} {'chunk':>5} {'capacity plain/prot req/s':>26} {'at req/s':>8} "
             f"{'TTFT p50 plain/prot s':>22} {'ratio':>6} {'TTFT p99 ratio':>14} {'tok/s ratio':>11} {'goals':>5}"]
    for r in rows:
        c, a, q = r["capacity"], r["at_plain_capacity"], r["ratios"]
        cap = " / ".join(f"{c[k]:.3f}" if c[k] else "<" for k in ("plain", "protected"))
        verdict = "met" if all(r["goals"].values()) else "MISS"
        lines.append(f"{r['setup']:<15} {r['trace']:<13} {r['chunk_size']:>5} {cap:>26} {r['qps']:>8.3f} "
                     f"{a['plain']['ttft_p50']:>10.3f} / {a['protected']['ttft_p50']:<9.3f} {q['ttft_p50']:>6.3f} "
                     f"{q['ttft_p99']:>14.3f} {q['throughput']:>11.4f} {verdict:>5}")
    return "\n".join(lines)


def ordinary(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name in args.setups.split(","):
        for trace in args.traces.split(","):
            for chunk in (int(k) for k in args.chunk_sizes.split(",")):
                rows.append(ordinary_cell(SETUPS[name], trace, chunk, args.probes))
                print(ordinary_table(rows[-1:]).splitlines()[1], flush=True)
    print(f"\nsimulated, ordinary traffic, near capacity (both at plain's capacity)\n{ordinary_table(rows)}")
    return rows


def real_ordinary(args: argparse.Namespace) -> dict[str, Any]:
    """``protected`` and ``plain`` replayed on SmolLM2 in ``args.rounds`` alternating rounds, on the same
    conversation-trace workload, beside the simulator's prediction of each."""
    import torch

    from sarathi_lite.bench import replay

    torch.set_num_threads(args.threads)
    setup = SETUPS["smollm2-cpu"]
    workload = setup.workload("conversation", qps=args.ordinary_qps, num_requests=args.ordinary_requests)
    configs = [("sarathi", args.ordinary_chunk)]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in ORDINARY}
    results = []
    engine = replay.build_engine(None, "sarathi", args.ordinary_chunk)  # loaded once; each run gets its own KV
    for i in range(args.rounds):
        for label in (ORDINARY if i % 2 == 0 else reversed(ORDINARY)):
            load = os.getloadavg()
            [result] = replay.run(workload, configs=configs, progress=False, engine=engine,
                                  enable_prefix_caching=False, **ORDINARY[label])
            result.meta.update(loadavg_before=load, round=i, label=label)
            results.append(result)
            s = result.summary()
            runs[label].append({"round": i, "loadavg_before": load, **{k: s[k] for k in (
                "ttft_p50", "ttft_p99", "throughput_tokens_per_s", "tbt_p99", "scheduling_delay_p50")}})
            print(f"round {i} {label:<9} load {load[0]:.2f}: TTFT p50 {s['ttft_p50']:.2f} s, p99 "
                  f"{s['ttft_p99']:.2f} s, {s['throughput_tokens_per_s']:.1f} tok/s, P99 TBT {s['tbt_p99']:.3f} s",
                  flush=True)
    save_results(results, args.results / "real_ordinary")
    cost_model = load_cost_model(args.profile)
    predicted = {}
    for label, options in ORDINARY.items():
        config = sim.scheduler_config(cost_model, "sarathi", args.ordinary_chunk, enable_prefix_caching=False,
                                      num_kv_blocks=results[0].config["num_kv_blocks"],
                                      max_model_len=results[0].config["max_model_len"], **options)
        s = sim.simulate(workload, cost_model, config).summary()
        predicted[label] = {k: s[k] for k in ("ttft_p50", "ttft_p99", "throughput_tokens_per_s", "tbt_p99")}
    paired = {k: [d[k] / p[k] for d, p in zip(runs["protected"], runs["plain"])]
              for k in ("ttft_p50", "ttft_p99", "throughput_tokens_per_s", "tbt_p99")}
    out = {"workload": workload.describe(), "chunk_size": args.ordinary_chunk, "runs": runs,
           "protected_over_plain_per_round": paired,
           "protected_over_plain_median": {k: float(np.median(v)) for k, v in paired.items()},
           "simulated": predicted,
           "simulated_protected_over_plain": {k: predicted["protected"][k] / predicted["plain"][k]
                                              for k in predicted["plain"]}}
    print(f"\nreal CPU run, ordinary traffic, {workload.describe()}, chunk {args.ordinary_chunk}: protected / plain "
          f"per round {paired}\nsimulated protected / plain: {out['simulated_protected_over_plain']}")
    return out


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    command = "python benchmarks/hol_protection.py " + " ".join(sys.argv[1:])
    parts, real_parts = args.parts.split(","), args.real_parts.split(",")
    report: dict[str, Any] = {"command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                              "commit": commit(), "machine": host(), "loadavg": os.getloadavg()}
    if "long" in parts:
        report["simulated"] = simulated(args)
    if "ordinary" in parts:
        report["ordinary"] = ordinary(args)
    if args.real and "long" in real_parts:
        report["real"] = real(args)
    if args.real and "ordinary" in real_parts:
        report["real_ordinary"] = real_ordinary(args)
    report["loadavg_end"] = os.getloadavg()
    report["wall_time"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out} ({report['wall_time']:.0f} s, load average {report['loadavg']})")


if __name__ == "__main__":
    main()
