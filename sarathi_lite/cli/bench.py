"""``sarathi-lite bench`` and ``sarathi-lite capacity``: the serving benchmark from the command line.

bench: replay a workload online under each configuration (``--policies`` x ``--chunk-sizes``), print one table,
write JSON/CSV (and with ``--plot`` a PNG) to ``--out``; ``--cost-per-token`` times equal-size decode, hybrid
and prefill batches instead. capacity: per policy, binary-search the highest rate (requests/s) that meets a P99
TBT SLO and a median scheduling-delay bound.

The default run (sarathi at chunk size 128 against vllm; under 5 minutes on 2 CPU cores with SmolLM2-135M):
30 requests of the conversation trace from row 1000 (its first rows are a warm-up with shorter prompts), prompt
and output lengths scaled by 1/4 and clipped to 1024 / 128 tokens, Poisson arrivals at 0.5 requests/s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sarathi_lite.scheduler import POLICIES


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload options shared by ``bench`` and ``capacity``."""
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default="conversation",
                   help="a built-in trace (conversation, arxiv) or the path of a trace CSV")
    g.add_argument("--lengths", default=None,
                   help="synthetic lengths instead of a trace: fixed:P:O | uniform:PMIN-PMAX:OMIN-OMAX | "
                        "zipf:PMIN-PMAX:OMIN-OMAX[:THETA]")
    g.add_argument("--num-requests", type=int, default=30)
    g.add_argument("--start", type=int, default=1000, help="first trace row")
    g.add_argument("--qps", type=float, default=0.5,
                   help="Poisson arrivals at this rate (requests/s); 0: the trace's own arrival times")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="with --qps 0: multiply the trace's arrival times (2 halves the rate)")
    g.add_argument("--prompt-scale", type=float, default=0.25, help="scale prompt lengths (before clipping)")
    g.add_argument("--output-scale", type=float, default=0.25, help="scale output lengths (before clipping)")
    g.add_argument("--max-prompt", type=int, default=1024, help="clip prompt lengths (tokens)")
    g.add_argument("--max-output", type=int, default=128, help="clip output lengths (tokens)")
    g.add_argument("--seed", type=int, default=0, help="seed of arrivals, synthetic lengths and prompt tokens")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 is steadier on a CPU shared with other work)")


def build_workload(args: argparse.Namespace) -> Any:
    from sarathi_lite.bench.workload import Workload

    qps = args.qps or None
    if args.lengths:
        return Workload.synthetic(args.lengths, num_requests=args.num_requests, qps=qps, max_prompt=args.max_prompt,
                                  max_output=args.max_output, seed=args.seed)
    return Workload.from_trace(args.trace, num_requests=args.num_requests, start=args.start, qps=qps,
                               time_scale=args.time_scale, prompt_scale=args.prompt_scale,
                               output_scale=args.output_scale, max_prompt=args.max_prompt,
                               max_output=args.max_output, seed=args.seed)


def _csv(kind: type) -> Any:
    def parse(text: str) -> list:
        return [kind(x) for x in text.split(",") if x]

    return parse


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """``LLMEngine`` options from the shared engine flags; also applies ``--threads``."""
    from sarathi_lite.cli import engine_kwargs

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    options = engine_kwargs(args)
    del options["scheduler"], options["chunk_size"]
    return options


def _policies(args: argparse.Namespace) -> list[str]:
    """``--policies``, else ``--scheduler``, else sarathi and vllm."""
    policies = args.policies or ([args.scheduler] if args.scheduler else ["sarathi", "vllm"])
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    return policies


def cmd_bench(args: argparse.Namespace) -> int:
    from sarathi_lite.bench import replay as bench
    from sarathi_lite.bench.results import compare, save_results

    if args.cost_per_token:
        return _cost_per_token(args)
    workload = build_workload(args)
    print(f"workload: {workload.describe()}")
    results = bench.run(workload, policies=_policies(args), chunk_sizes=args.chunk_sizes or [args.chunk_size],
                        model=args.model, progress=not args.no_progress, **_engine_options(args))
    print(f"\n{results[0].meta['machine']}; load average {results[0].meta['load_average_start'][0]:.2f} at start")
    print(compare(results))
    paths = save_results(results, args.out, plot="bench.png" if args.plot else None)
    print(f"wrote {len(paths)} files to {args.out}" + (f", plot {paths[-1]}" if args.plot else ""))
    return 0


def _cost_per_token(args: argparse.Namespace) -> int:
    from sarathi_lite.bench import replay as bench

    options = _engine_options(args)
    if options["num_kv_blocks"] is None:
        options["num_kv_blocks"] = bench.cost_per_token_blocks(args.cost_tokens, args.cost_context, args.block_size)
    engine = bench.build_engine(args.model, args.scheduler or "sarathi", args.chunk_size, **options)
    cost = bench.cost_per_token(engine, num_tokens=args.cost_tokens, context_len=args.cost_context)
    print(f"{cost.machine}\nbatches of {cost.num_tokens} tokens, decodes with {cost.context_len} cached tokens each")
    print(cost.table())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost_per_token.json").write_text(json.dumps(cost.to_dict(), indent=1))
    print(f"wrote {out / 'cost_per_token.json'}")
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    from sarathi_lite.bench import replay as bench

    workload = build_workload(args)
    print(f"workload: {workload.describe()} (arrivals re-drawn per probe)")
    slo = slo_from_args(args)
    found = bench.capacity(workload, slo, policies=_policies(args), chunk_size=args.chunk_size,
                           qps_low=args.qps_low, qps_high=args.qps_high, num_probes=args.probes, model=args.model,
                           progress=not args.no_progress, **_engine_options(args))
    save_capacity(found, args.out)
    return 0


def add_capacity_args(g: Any, *, tbt_required: bool, probes: int, probes_help: str) -> None:
    """The capacity search's flags (SLO, rate range, probes), shared by ``capacity`` and ``sim --capacity``."""
    g.add_argument("--tbt-slo", type=float, required=tbt_required, default=None,
                   help="P99 TBT bound (seconds); also the per-iteration target of --chunk-size auto")
    g.add_argument("--max-scheduling-delay", type=float, default=2.0, help="median scheduling delay bound (s)")
    g.add_argument("--qps-low", type=float, default=0.1)
    g.add_argument("--qps-high", type=float, default=2.0)
    g.add_argument("--probes", type=int, default=probes, help=probes_help)


def slo_from_args(args: argparse.Namespace) -> Any:
    """The ``SLO`` of ``add_capacity_args``' flags, printed."""
    from sarathi_lite.bench.capacity import SLO

    slo = SLO(args.tbt_slo, args.max_scheduling_delay)
    print(f"SLO: P99 TBT <= {1000 * slo.tbt_p99:.0f} ms, median scheduling delay <= {slo.scheduling_delay_p50} s")
    return slo


def save_capacity(found: list[Any], out_dir: str | Path, *, plot: bool = False) -> None:
    """Print ``capacity_table(found)``, write ``capacity.json`` (and with ``plot`` ``capacity.png``) to
    ``out_dir``."""
    print(capacity_table(found))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps([c.to_dict() for c in found], indent=1))
    written = [out / "capacity.json"]
    if plot:
        from sarathi_lite.bench.plots import plot_capacity

        written.append(plot_capacity(found, out / "capacity.png"))
    print(f"wrote {', '.join(map(str, written))}")


def capacity_table(found: list[Any]) -> str:
    """One row per policy: capacity (requests/s), the lowest failing rate, and every probe."""
    lines = [f"{'config':<14} {'capacity req/s':>14} {'fails at':>9}  probes (req/s: P99 TBT ms, median delay s)"]
    for c in found:
        cap = "< range" if c.capacity is None else f"{c.capacity:.3f}"
        fail = "-" if c.failed_above is None else f"{c.failed_above:.3f}"
        probes = ", ".join(f"{p.qps:.3f}{'+' if p.passed else 'x'}: {_ms(p.tbt_p99)}/{_s(p.scheduling_delay_p50)}"
                           for p in c.probes)
        lines.append(f"{c.label:<14} {cap:>14} {fail:>9}  {probes}")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def add_bench_parsers(sub: Any) -> None:
    """Add ``bench`` and ``capacity`` to the ``sarathi-lite`` subcommands."""
    from sarathi_lite.cli import add_engine_args, chunk_size_arg

    b = sub.add_parser("bench", help="replay a workload online under several scheduler configurations",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(b)
    add_workload_args(b)
    b.add_argument("--policies", type=_csv(str), default=None,
                   help=f"comma-separated, of {','.join(POLICIES)} (default: --scheduler, else sarathi,vllm)")
    b.add_argument("--chunk-sizes", type=_csv(chunk_size_arg), default=None,
                   help="comma-separated chunk sizes (or auto) for the chunked policies (default: --chunk-size)")
    b.add_argument("--out", default="results/bench", help="folder for JSON, CSV and the plot")
    b.add_argument("--plot", action="store_true", help="also write bench.png")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--cost-per-token", action="store_true",
                   help="instead: time decode-only, hybrid and prefill-only batches of equal size")
    b.add_argument("--cost-tokens", type=int, default=128, help="tokens per batch for --cost-per-token")
    b.add_argument("--cost-context", type=int, default=128, help="cached tokens per decode for --cost-per-token")
    b.set_defaults(func=cmd_bench, scheduler=None, chunk_size=128)

    c = sub.add_parser("capacity", help="highest rate meeting a P99 TBT SLO and a median scheduling delay bound")
    add_engine_args(c, tbt_slo=False)
    add_workload_args(c)
    c.add_argument("--policies", type=_csv(str), default=None,
                   help="comma-separated (default: --scheduler, else sarathi,vllm)")
    add_capacity_args(c, tbt_required=True, probes=5, probes_help="runs per policy")
    c.add_argument("--out", default="results/capacity")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(func=cmd_capacity, scheduler=None, chunk_size=128)
