"""``sarathi-lite bench`` and ``sarathi-lite capacity``: the serving benchmark from the command line.

bench: replay a workload online under each configuration (``--policies`` x ``--chunk-sizes``), print one table,
write JSON/CSV (and with ``--plot`` a PNG) to ``--out``; ``--cost-per-token`` times equal-size decode, hybrid
and prefill batches instead. capacity: per policy, binary-search the highest rate (requests/s) that meets a P99
TBT SLO and a median scheduling-delay bound.

bench --backend openai --base-url URL: replay the same workload against any OpenAI-compatible server
(``sarathi-lite serve``, vLLM, SGLang) over HTTP with streaming, timing TTFT and TBT at the client
(``sarathi_lite.bench.http_client``); the engine flags are then unused.

The default workload: 30 requests of the conversation trace from row 1000 (its first rows are a warm-up with
shorter prompts), prompt and output lengths scaled by 1/4 and clipped to 1024 / 128 tokens, Poisson arrivals at
0.5 requests/s; sarathi (at ``--chunk-size``) against vllm.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from sarathi_lite.bench.results import Stopped
from sarathi_lite.cli.common import (
    add_capacity_args,
    add_engine_args,
    add_no_progress_arg,
    add_old_spelling,
    add_sweep_args,
    add_threads_arg,
    add_workload_args,
    apply_threads,
    build_workload,
    engine_config,
    fresh_folder,
    policies,
    record_run_files,
    save_capacity,
    save_comparison,
    slo_from_args,
    stopped,
)
from sarathi_lite.engine.config import OPTIONS, EngineConfig

# The fields each configuration of a comparison sets itself; the rest are shared engine options.
_PER_CONFIGURATION = ("model", "policy", "chunk_size")


def _shared_options(config: EngineConfig) -> dict[str, Any]:
    """The ``LLMEngine`` options of ``config`` that every configuration of a comparison shares, by name."""
    return {name: getattr(config, name) for name in OPTIONS if name not in _PER_CONFIGURATION}


def cmd_bench(args: argparse.Namespace) -> int:
    from sarathi_lite.bench import replay

    apply_threads(args)
    config = engine_config(args)
    if args.cost_per_token:
        return _cost_per_token(args, config)
    workload = build_workload(args)
    print(f"workload: {workload.describe()}")
    if args.backend == "openai":
        return _bench_http(args, workload)
    try:
        results = replay.run(workload, policies=policies(args),
                             chunk_sizes=args.chunk_sizes or [config.chunk_size], model=config.model,
                             progress=not args.no_progress, **_shared_options(config))
    except Stopped as stop:
        return stopped(stop.progress, save_comparison(stop.partial, args.out, plot="bench.png" if args.plot else None,
                                                      stopped_after=stop.progress))
    print(f"\n{results[0].meta['machine']}; load average {results[0].meta['load_average_start'][0]:.2f} at start")
    save_comparison(results, args.out, plot="bench.png" if args.plot else None)
    return 0


def _bench_http(args: argparse.Namespace, workload: Any) -> int:
    from sarathi_lite.bench.http_client import replay_http

    if not args.base_url:
        raise ValueError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000)")
    result = replay_http(workload, args.base_url, model=args.served_model, api_key=args.api_key,
                         vocab_size=args.vocab_size, label=args.label, progress=not args.no_progress,
                         continuous_usage=not args.no_continuous_usage)
    print(f"\n{args.base_url} from {result.meta['machine']}; load average "
          f"{result.meta['load_average_start'][0]:.2f} at start; {result.meta['num_errors']} failed requests")
    save_comparison([result], args.out, plot="bench.png" if args.plot else None)
    return 0


def _cost_per_token(args: argparse.Namespace, config: EngineConfig) -> int:
    from sarathi_lite.bench import replay

    if config.num_kv_blocks is None:
        config = config.replace(num_kv_blocks=replay.cost_per_token_blocks(args.cost_tokens, args.cost_context,
                                                                           config.block_size))
    engine = replay.build_engine(config.model, config.policy, config.chunk_size, **_shared_options(config))
    cost = replay.cost_per_token(engine, num_tokens=args.cost_tokens, context_len=args.cost_context)
    print(f"{cost.machine}\nbatches of {cost.num_tokens} tokens, decodes with {cost.context_len} cached tokens each")
    print(cost.table())
    out = fresh_folder(args.out)
    (out / "cost_per_token.json").write_text(json.dumps(cost.to_dict(), indent=1))
    record_run_files(out, [out / "cost_per_token.json"])
    print(f"wrote {out / 'cost_per_token.json'}")
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    from sarathi_lite.bench import replay

    apply_threads(args)
    config = engine_config(args)
    workload = build_workload(args)
    print(f"workload: {workload.describe()} (arrivals re-drawn per probe)")
    slo = slo_from_args(args)
    try:
        found = replay.measured_capacity(workload, slo, policies=policies(args), chunk_size=config.chunk_size,
                                         qps_low=args.qps_low, qps_high=args.qps_high, num_probes=args.probes,
                                         model=config.model, progress=not args.no_progress,
                                         **_shared_options(config))
    except Stopped as stop:
        return stopped(stop.progress, save_capacity(stop.partial, args.out, stopped_after=stop.progress))
    save_capacity(found, args.out)
    return 0


def add_bench_parsers(sub: Any) -> None:
    """Add ``bench`` and ``capacity`` to the ``sarathi-lite`` subcommands."""
    b = sub.add_parser("bench", help="replay a workload online under several scheduler configurations",
                       description=__doc__)
    add_workload_args(b)
    add_sweep_args(b)
    b.add_argument("--out", default="results/bench",
                   help="folder for JSON, CSV and the plot, which then holds this run only (default results/bench)")
    b.add_argument("--plot", action="store_true", help="also write bench.png")
    add_no_progress_arg(b)
    b.add_argument("--cost-per-token", action="store_true",
                   help="instead: time decode-only, hybrid and prefill-only batches of equal size")
    b.add_argument("--cost-tokens", type=int, default=128, help="tokens per batch for --cost-per-token")
    b.add_argument("--cost-context", type=int, default=128, help="cached tokens per decode for --cost-per-token")
    h = b.add_argument_group("any OpenAI-compatible server (--backend openai)")
    h.add_argument("--backend", choices=("sarathi", "openai"), default="sarathi",
                   help="sarathi: replay in-process; openai: replay over HTTP against --base-url")
    h.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000")
    h.add_argument("--served-model-name", dest="served_model", default=None,
                   help="model name to send (default: the server's first)")
    add_old_spelling(h, "--served-model", "--served-model-name", dest="served_model")
    h.add_argument("--api-key", default=None, help="sent as a bearer token")
    h.add_argument("--vocab-size", type=int, default=32000,
                   help="prompt token ids are drawn below this; the model's vocabulary size replays the "
                        "in-process prompts exactly")
    h.add_argument("--label", default=None, help="the result's label (default openai:<model>)")
    h.add_argument("--no-continuous-usage", action="store_true",
                   help="count one token per streamed chunk instead of asking for usage in every chunk")
    add_threads_arg(b)
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("capacity", help="highest rate meeting a P99 TBT SLO and a median scheduling delay bound")
    add_workload_args(c)
    add_sweep_args(c, chunk_sizes=False)
    add_capacity_args(c, tbt_required=True, probes=5, probes_help="runs per policy")
    c.add_argument("--out", default="results/capacity",
                   help="folder for capacity.json, which then holds this run only (default results/capacity)")
    add_no_progress_arg(c)
    add_threads_arg(c)
    add_engine_args(c, exclude=("tbt_slo",))  # --tbt-slo is the SLO's, and also auto's target
    c.set_defaults(func=cmd_capacity)
