"""``sarathi-lite sim``, ``sarathi-lite profile`` and ``sarathi-lite sweep``: the simulator from the command line
(each command's help is its description below)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sarathi_lite.bench.capacity import SLO
from sarathi_lite.bench.results import BenchResult, Stopped
from sarathi_lite.bench.workload import Workload
from sarathi_lite.cli.common import (
    SIM_FIELDS,
    add_capacity_args,
    add_engine_args,
    add_no_progress_arg,
    add_rate_range_args,
    add_sweep_args,
    add_threads_arg,
    add_workload_args,
    apply_threads,
    build_workload,
    csv_of,
    engine_config,
    engine_options,
    fresh_folder,
    partial_path,
    policies,
    record_run_files,
    save_capacity,
    save_comparison,
    slo_from_args,
    stopped,
)
from sarathi_lite.costs import CostModel, load_cost_model
from sarathi_lite.engine.config import OPTIONS, SCHEDULER_FIELDS
from sarathi_lite.scheduler import CHUNKED_POLICIES
from sarathi_lite.sim import simulator as sim
from sarathi_lite.sim.sweeps import sweep
from sarathi_lite.sim.validate import validate

# What profile does not take: the scheduler's settings (it times batches it builds itself, and calibrates at
# the profiler's own chunk size), the records' options, and what only serving uses (async scheduling, KV transfer).
SIM_DESCRIPTION = """\
Simulate a workload under several scheduler configurations: the same scheduler as the engine, its forward pass
priced by a cost model instead of run (no model, no device; seconds, not minutes).

The workload and comparison flags are bench's (--policies x --chunk-sizes), the scheduler-side engine flags too,
plus --cost-model (a profile JSON from sarathi-lite profile, or roofline:HW[:MODEL]). Prints bench's table; with
--out DIR also writes its JSON/CSV (and with --plot a PNG) there, a folder holding that run only. --chunk-size auto
(or auto among --chunk-sizes) picks every step's budget from --cost-model itself.

Instead of a comparison: --capacity searches each policy's capacity under --tbt-slo, as sarathi-lite capacity
does; --validate RUN.json predicts every iteration of real runs and prints the per-step error by batch kind and by
step size.

    sarathi-lite sim --cost-model roofline:h100:llama3-8b --chunk-sizes 256,512,auto --tbt-slo 0.05
"""

PROFILE_DESCRIPTION = """\
Time this machine's model runner over a grid of batch shapes (decodes, prompt chunks and both, at several
contexts) and save the fitted cost model as JSON, for sim --cost-model and chunk_size auto. --quick times about a
third of the grid. The default grid covers what the default sim workload asks of it.
"""

SWEEP_DESCRIPTION = """\
Simulate every trace x rate x cost model x configuration (x SLO) on a local process pool or a Ray cluster
(sarathi_lite.sim.sweep), written as one CSV; with --capacity, the capacity of each point under each SLO.
"""

_PROFILE_EXCLUDES = (*(f for f in SCHEDULER_FIELDS if f != "block_size"), "record_batches", "cost_model",
                     "async_scheduling", *(name for name, o in OPTIONS.items() if o.section == "kv_transfer"))


def cmd_sim(args: argparse.Namespace) -> int:
    cost_model = load_cost_model(args.cost_model)
    if args.validate:
        return _validate(args, cost_model)
    workload = build_workload(args)
    config = engine_config(args, SIM_FIELDS, cost_model=cost_model)  # auto: the cost model picks the budgets
    options = {f: getattr(config, f) for f in SIM_FIELDS if f not in ("policy", "chunk_size", "cost_model")}
    print(f"workload: {workload.describe()}")
    print(f"cost model: {_describe(cost_model.describe())}")
    real_vllm = [p for p in args.policies or () if p.startswith("vllm@")]  # vLLM's own scheduler (simclock)
    args.policies = [p for p in args.policies or () if p not in real_vllm] or (None if not real_vllm else [])
    if args.capacity:
        if real_vllm:
            raise ValueError(f"--capacity does not run {', '.join(real_vllm)} yet: simulate it at given rates")
        return _capacity(args, cost_model, workload, config.chunk_size, options)
    try:
        results = sim.run(workload, cost_model, policies=policies(args),
                          chunk_sizes=args.chunk_sizes or [config.chunk_size], progress=not args.no_progress,
                          **options) if args.policies != [] else []
    except Stopped as stop:
        print(f"\nsimulated {stop.progress} before it stopped")
        return stopped(stop.progress, save_comparison(stop.partial, args.out, plot="sim.png" if args.plot else None,
                                                      stopped_after=stop.progress))
    results += _real_vllm(real_vllm, args, workload, config.chunk_size, options)
    wall = sum(r.meta["wall_time"] for r in results)
    print(f"\nsimulated {len(results)} configuration(s) in {wall:.2f} s")
    save_comparison(results, args.out, plot="sim.png" if args.plot else None)
    return 0


def _real_vllm(chosen: list[str], args: argparse.Namespace, workload: Workload, chunk_size: int | str,
               options: dict[str, Any]) -> list[BenchResult]:
    """The ``vllm@X.Y`` policies: that release's own scheduler on the simulated clock, each chunk size as its
    ``max_num_batched_tokens`` (``sarathi_lite.integrations.vllm.simclock``)."""
    if not chosen:
        return []
    from sarathi_lite.integrations.vllm.simclock import run_policy

    rest = {k: v for k, v in options.items() if k not in ("max_num_batched_tokens", "long_prefill_token_threshold")}
    budgets = [c for c in args.chunk_sizes or [chunk_size] if c != "auto"] or [2048]
    return [run_policy(policy, workload, args.cost_model, chunk_size=budget,
                       long_prefill_token_threshold=options.get("long_prefill_token_threshold") or 0, **rest)
            for policy in chosen for budget in budgets]


def _capacity(args: argparse.Namespace, cost_model: CostModel, workload: Workload, chunk_size: int | str,
              options: dict[str, Any]) -> int:
    if args.tbt_slo is None:
        raise ValueError("--capacity needs --tbt-slo (seconds)")
    slo = slo_from_args(args)
    try:
        found = sim.capacity(workload, cost_model, slo, policies=policies(args), chunk_size=chunk_size,
                             qps_low=args.qps_low, qps_high=args.qps_high, num_probes=args.probes,
                             progress=not args.no_progress, **options)
    except Stopped as stop:
        return stopped(stop.progress, save_capacity(stop.partial, args.out, plot=args.plot,
                                                    stopped_after=stop.progress))
    save_capacity(found, args.out, plot=args.plot)
    return 0


def _validate(args: argparse.Namespace, cost_model: CostModel) -> int:
    print(f"cost model: {_describe(cost_model.describe())}")
    out = None if args.out is None else fresh_folder(args.out)
    written = []
    for path in args.validate:
        check = validate(BenchResult.from_json(path), cost_model, long_context=args.long_context)
        print(f"\n{path}: {check.label}, {len(check.steps)} steps predicted ({check.unmatched} not rebuilt); "
              f"error = predicted / measured - 1, long context: > {check.long_context} tokens")
        print(check.table())
        if out is not None:
            written.append(out / f"validate_{Path(path).stem}.json")
            written[-1].write_text(json.dumps(check.to_dict(), indent=1))
            print(f"wrote {written[-1]}")
    if out is not None:
        record_run_files(out, written)
    return 0


def _describe(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items() if v is not None)


def cmd_profile(args: argparse.Namespace) -> int:
    from sarathi_lite.sim.profiler import profile

    apply_threads(args)
    options = engine_options(args)
    model = options.pop("model", None)
    try:
        cost = profile(model, quick=args.quick, repeats=args.repeats, max_tokens=args.max_tokens,
                       max_context=args.max_context, max_decodes=args.max_decodes,
                       max_step_tokens=args.max_step_tokens, seed=args.seed,
                       progress=not args.no_progress, **options)
    except Stopped as stop:
        if stop.partial is None:
            return stopped(stop.progress, "none, nothing was timed yet")
        path = partial_path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(stop.partial, indent=1))
        return stopped(stop.progress, f"the raw timings so far in {path}, which is not a cost model (sim "
                                      f"--cost-model refuses it); {args.out} was not written")
    meta = cost.meta
    print(f"{meta['machine']}; load average {meta['load_average_start'][0]:.2f} at start; "
          f"{meta['grid']['shapes']} batch shapes in {meta['wall_time']:.0f} s")
    print(f"{'term':<18} {'coefficient':>12}")
    for term, value in cost.coefficients.items():
        print(f"{term:<18} {value:>12.4g}")
    print("measured up to: " + ", ".join(f"{k} {v:.0f}" for k, v in cost.measured.items()) + " per step")
    print(f"host: schedule {1e6 * cost.schedule_constant:.0f} us + {1e6 * cost.schedule_per_request:.1f} us/request, "
          f"gap between steps {1e6 * cost.step_gap:.0f} us")
    for name, q in meta["fit"].items():
        if q is not None:
            print(f"fit on {name:<13} ({q['n']:>3}): R^2 {q['r2']:.3f}, relative error median "
                  f"{100 * q['rel_err_p50']:.1f}%, p90 {100 * q['rel_err_p90']:.1f}%, "
                  f"max {100 * q['rel_err_max']:.1f}%")
    print(f"wrote {cost.save(args.out)}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:

    workloads = {}
    for trace in args.traces or [args.trace]:
        args.trace = trace
        workloads[Path(trace).stem] = build_workload(args)
    configs = [(policy, chunk) for policy in policies(args)
               for chunk in ((args.chunk_sizes or [512]) if policy in CHUNKED_POLICIES else [None])]
    slos = [SLO(t, args.max_scheduling_delay) for t in args.tbt_slos or []]
    capacity = (args.qps_low, args.qps_high, args.probes) if args.capacity else None
    try:
        frame = sweep(workloads, args.cost_models, configs, slos, qps=args.qps_list, capacity=capacity,
                      backend=args.backend, address=args.address, workers=args.workers,
                      progress=not args.no_progress)
    except Stopped as stop:
        path = _write_sweep(stop.partial, partial_path(args.out))
        return stopped(stop.progress, f"the {len(stop.partial)} rows of the points finished in {path} ({args.out} "
                                      f"was not written)")
    _write_sweep(frame, Path(args.out))
    return 0


def _write_sweep(frame: Any, out: Path) -> Path:
    """Print the sweep's main columns and write its whole frame to the CSV ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out, index=False)
    shown = [c for c in ("workload", "cost_model", "config", "offered_qps", "tbt_slo", "capacity", "tbt_p99",
                         "ttft_p50", "meets_slo") if c in frame]
    if shown:
        print(frame[shown].to_string(index=False))
    print(f"wrote {len(frame)} rows to {out}")
    return out


def add_sim_parsers(sub: Any) -> None:
    """Add ``sim``, ``profile`` and ``sweep`` to the ``sarathi-lite`` subcommands."""
    s = sub.add_parser("sim", help="simulate a workload under several scheduler configurations (no model run)",
                       description=SIM_DESCRIPTION)
    s.add_argument("--cost-model", required=True,
                   help="profile JSON (sarathi-lite profile) or roofline:HW[:MODEL] (calibrated on measured GPU "
                        "timings for a100-80gb and h100; roofline-uncalibrated:HW[:MODEL] for the analytic formula), "
                        "HW one of a100-80gb, h100, h200, or NxHW for tensor parallelism over N (e.g. 4xh100); MODEL "
                        "a preset (llama3-8b, llama3.1-8b, llama3-70b, mistral-7b, yi-34b, smollm2-135m) or a "
                        "config.json / folder")
    add_workload_args(s)
    add_sweep_args(s)
    s.add_argument("--out", default=None, metavar="DIR",
                   help="write the results (JSON, CSV, the plot) to this folder, which then holds this run only "
                        "(default: print only, write nothing)")
    s.add_argument("--plot", action="store_true", help="also write sim.png (capacity.png with --capacity)")
    add_no_progress_arg(s)
    v = s.add_argument_group("cost model check (--validate)")
    v.add_argument("--validate", nargs="+", default=None, metavar="RUN.json",
                   help="instead: predict every iteration of these real runs (bench result JSON files) and print "
                        "the per-step error by batch kind and context, and by step size")
    v.add_argument("--long-context", type=int, default=512,
                   help="with --validate: a batch whose longest context exceeds this (tokens) counts as long")
    g = s.add_argument_group("capacity search (--capacity)")
    g.add_argument("--capacity", action="store_true",
                   help="instead: per policy, the highest rate meeting --tbt-slo and --max-scheduling-delay")
    add_capacity_args(g, tbt_required=False, probes=8, probes_help="simulations per policy")
    # num_kv_blocks None: what the engine would allocate on the modelled deployment
    # --tbt-slo is the capacity flag (also auto's target); --cost-model the simulator's own (also auto's model)
    add_engine_args(s, fields=SIM_FIELDS, exclude=("tbt_slo", "cost_model"))
    s.set_defaults(func=cmd_sim)

    p = sub.add_parser("profile", help="time this machine's model runner over batch shapes; save a cost model",
                       description=PROFILE_DESCRIPTION)
    p.add_argument("--out", default="profile.json", help="where to write the cost model (JSON)")
    p.add_argument("--quick", action="store_true", help="a third of the grid (for notebooks and CI)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per batch shape (the median counts)")
    p.add_argument("--max-tokens", type=int, default=512, help="largest batch (tokens) in the grid")
    p.add_argument("--max-context", type=int, default=1024, help="longest cached context in the grid (tokens)")
    p.add_argument("--max-decodes", type=int, default=64, help="most decodes in a batch of the grid")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="largest step of several whole prompts in the grid (tokens), as the unchunked policies "
                        "(vllm, orca) run them (default: 4 x --max-tokens, 2048); a simulation asking for larger "
                        "steps warns that they are extrapolated")
    p.add_argument("--seed", type=int, default=0, help="seed of the profiled prompts' tokens (default 0)")
    add_no_progress_arg(p)
    add_threads_arg(p)
    add_engine_args(p, exclude=_PROFILE_EXCLUDES)
    p.set_defaults(func=cmd_profile)

    w = sub.add_parser("sweep", help="simulate traces x rates x cost models x configurations x SLOs in parallel "
                                     "(process pool or Ray); one CSV",
                       description=SWEEP_DESCRIPTION)
    w.add_argument("--cost-models", type=csv_of(str), required=True,
                   help="comma-separated cost model specs (as sim --cost-model)")
    add_workload_args(w)
    w.add_argument("--traces", type=csv_of(str), default=None, help="comma-separated traces (default: --trace)")
    w.add_argument("--qps-list", type=csv_of(float), default=None, help="comma-separated arrival rates (req/s)")
    w.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    add_sweep_args(w)
    w.add_argument("--tbt-slos", type=csv_of(float), default=None, help="comma-separated P99 TBT bounds (s)")
    w.add_argument("--max-scheduling-delay", type=float, default=2.0, help="median scheduling delay bound (s)")
    g = w.add_argument_group("capacity search (--capacity)")
    g.add_argument("--capacity", action="store_true", help="per point and SLO, search the highest rate meeting it")
    add_rate_range_args(g)
    g.add_argument("--probes", type=int, default=8, help="simulations per capacity search")
    r = w.add_argument_group("where it runs")
    r.add_argument("--backend", choices=("process", "serial", "ray"), default=None,
                   help="default: process, or ray when --address is given")
    r.add_argument("--address", default=None, help="a Ray cluster's address (ray.init(address=...))")
    r.add_argument("--workers", type=int, default=None, help="processes of the local pool (default: CPU count)")
    add_no_progress_arg(r)
    w.add_argument("--out", default="results/sweep.csv", help="the CSV to write")
    w.set_defaults(func=cmd_sweep)
