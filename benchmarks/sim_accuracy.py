"""Simulator accuracy on this machine: real-time ``bench`` runs of SmolLM2-135M beside ``sim`` runs of the same
workload and configurations with a profiled cost model, metric by metric.

The cost model is fitted by ``sarathi-lite profile`` on synthetic batch shapes; the workload here is the
conversation trace (rows ``--start ..``, lengths scaled and clipped like ``bench``'s default, Poisson arrivals at
``--qps`` from ``--seed``), so nothing of it was used for fitting. Run the profile with the same ``--threads``
and in the same machine conditions as this script.

    sarathi-lite profile --threads 2 --out results/sim_accuracy/profile.json
    python benchmarks/sim_accuracy.py --profile results/sim_accuracy/profile.json --threads 2

For each configuration (``--policies`` x ``--chunk-sizes``) it prints and stores, measured vs predicted: P50 and
P99 TTFT and TBT, output-token throughput, and their relative errors; plus these diagnostics:

- ``step err``: the cost model's median relative error on the real run's own batches (its step times measured
  against the model's prediction for exactly those batches), and ``beyond``: how many of those batches lie
  beyond the profile's measured range (``ProfiledCostModel.measured``, extrapolated);
- the same per-step error by step size (``sim --validate``'s table, ``sarathi_lite.sim.validate``), pooled over
  every configuration: where in the range of step sizes the model errs, and how much of the run's time those
  steps take;
- ``replay``: the largest relative error of the same metrics when the simulator replays the real run's measured
  step times (``ReplayCostModel``): zero up to rounding if the event loop is faithful;
- the machine's speed around each real run: a few reference batches timed just before and just after it, over
  the cost model's prediction for them (1.0: as fast as when profiled). A second table repeats the comparison
  with the cost model scaled by it, which separates the model's error from the machine's drift.

With ``--repeat`` the real configurations run a second time, and a second table shows how much the real metrics
themselves move from run to run: the floor under any prediction's error.

Writes ``<out>/accuracy.json``, ``<out>/accuracy.md`` and every run's JSON under ``<out>/real`` (``real_repeat``)
and ``<out>/sim``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sarathi_lite.bench import replay as bench
from sarathi_lite.bench.results import BenchResult, config_label, save_results
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs.profiled import ProfiledCostModel, batch_terms
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.scheduler import ScheduledRequest, SchedulerOutput
from sarathi_lite.sim import simulator as sim
from sarathi_lite.sim.cost_model import ReplayCostModel
from sarathi_lite.sim.profiler import BatchShape, time_outputs
from sarathi_lite.sim.validate import Validation, validate

METRICS = (  # name, summary key, scale, unit, format
    ("TTFT p50", "ttft_p50", 1.0, "s", "{:.2f}"), ("TTFT p99", "ttft_p99", 1.0, "s", "{:.2f}"),
    ("TBT p50", "tbt_p50", 1e3, "ms", "{:.0f}"), ("TBT p99", "tbt_p99", 1e3, "ms", "{:.0f}"),
    ("throughput", "throughput_output_tokens_per_s", 1.0, "tok/s", "{:.1f}"))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, required=True, help="cost model from sarathi-lite profile")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (as in the profile)")
    ap.add_argument("--trace", default="conversation", help="built-in trace name or CSV path")
    ap.add_argument("--start", type=int, default=2000)
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--qps", type=float, default=0.4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--prompt-scale", type=float, default=0.25)
    ap.add_argument("--output-scale", type=float, default=0.25)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--policies", default="sarathi,simple_chunking")
    ap.add_argument("--chunk-sizes", default="64,128,256")
    ap.add_argument("--repeat", action="store_true",
                    help="run the real configurations twice: their run-to-run variation is the noise floor")
    ap.add_argument("--real-from", type=Path, default=None,
                    help="instead of running them, take the real runs from a previous run's --out folder")
    ap.add_argument("--no-jitter", action="store_true", help="simulate the typical step time only")
    ap.add_argument("--bounds", default="0.10,0.25",
                    help="comma-separated relative errors: cells within each are counted (against the real mean)")
    ap.add_argument("--out", type=Path, default=Path("results/sim_accuracy"))
    return ap.parse_args()


PROBE = (BatchShape((250,) * 3), BatchShape((250,) * 10), BatchShape((250,) * 6, ((100, 58, False),)),
         BatchShape((250,) * 8, ((0, 120, True),)), BatchShape((), ((200, 256, False),)))
"""Reference batches whose measured time over the cost model's prediction tells how fast the machine is now,
relative to when it was profiled (a shared VM's speed drifts by tens of percent over minutes)."""


def machine_speed(engine: LLMEngine, cost: ProfiledCostModel) -> float:
    """Median over ``PROBE`` of measured / predicted forward time: 1.0 = as fast as when profiled, 1.2 = 20%
    slower."""
    cfg = engine.scheduler_config
    outs = [b.output(cfg.block_size, cfg.num_blocks, engine.model_config.vocab_size, np.random.default_rng(0))
            for b in PROBE]
    measured = [np.median(runs) for runs in time_outputs(engine, outs, repeats=3, progress=False)]
    return float(np.median(np.divide(measured, cost.forward_time([batch_terms(o) for o in outs]))))


def measure(workload: Workload, configs: list[tuple[str, int | None]], engine: LLMEngine,
            cost: ProfiledCostModel) -> list[BenchResult]:
    """Real-time replays of ``configs`` (sharing ``engine``'s weights), each with ``meta["speed"]``: the mean of
    ``machine_speed`` just before and just after it."""
    results = []
    for config in configs:
        before = machine_speed(engine, cost)
        [result] = bench.run(workload, configs=[config], engine=engine, record_batches=True)
        after = machine_speed(engine, cost)
        result.meta.update(speed=(before + after) / 2, speed_before=before, speed_after=after)
        logging.info("%s: machine speed %.2f before, %.2f after", result.label, before, after)
        results.append(result)
    return results


def scaled(cost: ProfiledCostModel, factor: float) -> ProfiledCostModel:
    """``cost`` with every forward-pass time multiplied by ``factor`` (host overheads unchanged)."""
    return dataclasses.replace(cost, token_times=[t * factor for t in cost.token_times],
                               coefficients={k: v * factor for k, v in cost.coefficients.items()})


def load_real(folder: Path, configs: list[tuple[str, int | None]]) -> list[BenchResult]:
    """The saved real results of ``configs``, in that order."""
    return [BenchResult.from_json(folder / f"{config_label(p, c).replace('/', '_')}.json") for p, c in configs]


def real_batches(result: BenchResult) -> list[SchedulerOutput]:
    """The real run's iterations rebuilt as ``SchedulerOutput``s from their recorded ``(request, tokens)`` rows:
    each request's cached context is the sum of its earlier rows (the runs here never preempt)."""
    prompt = {r.request_id: r.prompt_len for r in result.workload.requests}
    done: dict[str, int] = {}
    outs = []
    for it in result.stats.iterations:
        out = SchedulerOutput()
        for rid, n in it.batch:
            c = done.get(rid, 0)
            out.add(ScheduledRequest(rid, c, n, [], [], c + n >= prompt[rid], c < prompt[rid]))
            done[rid] = c + n
        outs.append(out)
    return outs


def rel(pred: float | None, real: float | None) -> float | None:
    return None if pred is None or not real else (pred - real) / real


def compare_runs(real: BenchResult, predicted: BenchResult, replayed: BenchResult, cost: ProfiledCostModel
                 ) -> dict[str, Any]:
    r, q = real.summary(), replayed.summary()
    steps = [it.step_time for it in real.stats.iterations]
    batches = real_batches(real)
    step_pred = [cost.predict_step_time(o) for o in batches]
    row: dict[str, Any] = {"label": real.label, "iterations_real": len(steps),
                           "iterations_sim": len(predicted.stats.iterations),
                           "step_rel_err_p50": float(np.median(np.abs(np.subtract(step_pred, steps)) / steps)),
                           "steps_beyond_measured": sum(bool(cost.beyond_measured(batch_terms(o))) for o in batches),
                           "largest_step": max(o.num_prefill_tokens + o.num_decode_tokens for o in batches),
                           "step_bias": float(np.sum(step_pred) / np.sum(steps) - 1),
                           "replay_max_rel_err": max(abs(rel(q[k], r[k]) or 0.0) for _, k, *_ in METRICS),
                           "load_average_real": real.meta["load_average_start"][0],
                           "metrics": metric_rows(real, predicted)}
    return row


def metric_rows(first: BenchResult, second: BenchResult) -> dict[str, Any]:
    """Per metric: ``first``'s and ``second``'s values and the relative difference of the second."""
    a, b = first.summary(), second.summary()
    return {key: {"a": a[key], "b": b[key], "rel": rel(b[key], a[key])} for _, key, *_ in METRICS}


def mean_rows(first: BenchResult, second: BenchResult, predicted: BenchResult) -> dict[str, Any]:
    """Per metric: the mean of two real runs' values, the prediction, and the prediction's relative error."""
    a, b, p = first.summary(), second.summary(), predicted.summary()
    out = {}
    for _, key, *_ in METRICS:
        mean = (a[key] + b[key]) / 2
        out[key] = {"a": mean, "b": p[key], "rel": rel(p[key], mean)}
    return out


def within_counts(against_mean: list[dict[str, Any]], repeats: list[dict[str, Any]], bound: float = 0.10) -> str:
    """How many (configuration, metric) cells the prediction gets within ``bound`` of the real mean, and how many
    the two real runs themselves agree on within ``bound``."""
    sim = [abs(row["metrics"][key]["rel"]) <= bound for row in against_mean for _, key, *_ in METRICS]
    real = [abs(row["metrics"][key]["rel"]) <= bound for row in repeats for _, key, *_ in METRICS]
    per_metric = ", ".join(
        f"{name} {sum(abs(r['metrics'][key]['rel']) <= bound for r in against_mean)}/{len(against_mean)}"
        for name, key, *_ in METRICS)
    return (f"cells within {100 * bound:.0f}%: simulation vs real mean {sum(sim)}/{len(sim)} ({per_metric}); "
            f"real run 2 vs real run 1 {sum(real)}/{len(real)}")


def table(rows: list[dict[str, Any]], names: str = "real / sim", markdown: bool = False) -> str:
    """One line per row: its label, each metric as ``a / b (relative difference)``, and the diagnostics when the
    rows have them."""
    diagnostics = "step_rel_err_p50" in rows[0]
    head = ["config"] + [f"{name} {unit} {names}" for name, _, _, unit, _ in METRICS]
    head += ["step err", "beyond", "replay"] if diagnostics else []
    lines = []
    for row in rows:
        cells = [row["label"]]
        for _, key, scale, _, fmt in METRICS:
            m = row["metrics"][key]
            cells.append(f"{fmt.format(m['a'] * scale)} / {fmt.format(m['b'] * scale)} ({100 * m['rel']:+.1f}%)")
        if diagnostics:
            cells += [f"{100 * row['step_rel_err_p50']:.1f}%",
                      f"{row['steps_beyond_measured']} (max {row['largest_step']})",
                      f"{100 * row['replay_max_rel_err']:.0e}%"]
        lines.append(cells)
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
                         + ["| " + " | ".join(c) + " |" for c in lines])
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
                     for cells in [head] + lines)


def size_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """The per-step error by step size (``Validation.by_size``): one line per bin."""
    head = ["step tokens", "steps", "largest", "time share", "error p50", "|error| p50", "|error| p90"]
    lines = [[r["size"], str(r["n"]), str(r["max_tokens"]), f"{100 * r['time_share']:.0f}%",
              f"{100 * r['error_p50']:+.1f}%", f"{100 * r['abs_error_p50']:.1f}%", f"{100 * r['abs_error_p90']:.1f}%"]
             for r in rows]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
                         + ["| " + " | ".join(c) + " |" for c in lines])
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
                     for cells in [head] + lines)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    cost = ProfiledCostModel.load(args.profile)
    if args.no_jitter:
        cost = dataclasses.replace(cost, jitter=())
    if cost.meta.get("threads") != torch.get_num_threads():
        logging.warning("the profile was taken with %s threads, this run uses %d", cost.meta.get("threads"),
                        torch.get_num_threads())
    workload = Workload.from_trace(args.trace, num_requests=args.num_requests, start=args.start, qps=args.qps,
                                   prompt_scale=args.prompt_scale, output_scale=args.output_scale,
                                   max_prompt=args.max_prompt, max_output=args.max_output, seed=args.seed)
    print(f"workload: {workload.describe()}")
    configs = bench.configurations(args.policies.split(","), [int(c) for c in args.chunk_sizes.split(",")])
    if args.real_from:
        real = load_real(args.real_from / "real", configs)
    else:
        engine = bench.build_engine(args.model, "sarathi", 128)
        real = measure(workload, configs, engine, cost)
    rows, predicted = [], []
    pooled = Validation("all configurations", 0)
    for r in real:
        c = r.config
        options = {"max_num_seqs": c["max_num_seqs"], "block_size": c["block_size"],
                   "num_kv_blocks": c["num_kv_blocks"], "max_model_len": c["max_model_len"]}
        config = [(c["policy"], c["chunk_size"])]
        [p] = sim.run(workload, cost, configs=config, **options)
        [q] = sim.run(workload, ReplayCostModel.from_result(r), configs=config, **options)
        [at_speed] = sim.run(workload, scaled(cost, r.meta["speed"]), configs=config, **options)
        predicted.append(p)
        check = validate(r, cost)
        pooled.steps += check.steps
        rows.append({**compare_runs(r, p, q, cost), "speed": r.meta["speed"],
                     "metrics_at_speed": metric_rows(r, at_speed), "step_error_by_size": check.by_size()})
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\n{bench.machine()}; load average {os.getloadavg()[0]:.2f} now; profile {args.profile.name} "
          f"(threads {cost.meta.get('threads')}, load {cost.meta.get('load_average_start', ['?'])[0]})")
    print(table(rows))
    measured = ", ".join(f"{k} {v:.0f}" for k, v in cost.measured.items()) or f"tokens {cost.token_knots[-1]}"
    print(f"\nper-step error by step size, every configuration's real steps (error = predicted / measured - 1; "
          f"profile measured up to {measured} per step)")
    print(size_table(pooled.by_size()))
    args.out.mkdir(parents=True, exist_ok=True)
    save_results(real, args.out / "real")
    save_results(predicted, args.out / "sim")
    markdown = table(rows, markdown=True) + "\n\nPer-step error by step size, every configuration's real steps:\n\n" + \
        size_table(pooled.by_size(), markdown=True)
    repeats: list[dict[str, Any]] = []
    speed_rows = [{"label": row["label"], "metrics": row["metrics_at_speed"]} for row in rows]
    print("\nthe same, with the cost model scaled by the machine's speed measured around each real run "
          "(speed: " + ", ".join(f"{row['label']} {row['speed']:.2f}" for row in rows) + ")")
    print(table(speed_rows))
    markdown += "\n\nWith the cost model scaled by the machine's speed around each real run:\n\n" + \
        table(speed_rows, markdown=True)
    if args.repeat:
        again = load_real(args.real_from / "real_repeat", configs) if args.real_from else \
            measure(workload, configs, engine, cost)
        save_results(again, args.out / "real_repeat")
        repeats = [{"label": a.label, "metrics": metric_rows(a, b)} for a, b in zip(real, again)]
        print(f"\nrun-to-run variation of the real runs (load average {os.getloadavg()[0]:.2f} now)")
        print(table(repeats, "run 1 / run 2"))
        markdown += "\n\nRun-to-run variation of the real runs:\n\n" + table(repeats, "run 1 / run 2", markdown=True)
        against_mean = [{"label": p.label, "metrics": mean_rows(a, b, p)} for a, b, p in zip(real, again, predicted)]
        verdict = "\n".join(within_counts(against_mean, repeats, float(b)) for b in args.bounds.split(","))
        print("\nthe simulation against the mean of the two real runs\n" + table(against_mean, "real mean / sim"))
        print(verdict)
        markdown += ("\n\nThe simulation against the mean of the two real runs:\n\n"
                     + table(against_mean, "real mean / sim", markdown=True) + "\n\n" + verdict)
    record = {"against_mean": against_mean if args.repeat else [],
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": bench.machine(),
              "profile": args.profile.name, "profile_meta": {k: v for k, v in cost.meta.items() if k != "samples"},
              "workload": workload.to_dict()["source"], "workload_description": workload.describe(), "rows": rows,
              "step_error_by_size": pooled.by_size(), "repeat_rows": repeats}
    (args.out / "accuracy.json").write_text(json.dumps(record, indent=1))
    (args.out / "accuracy.md").write_text(markdown + "\n")
    print(f"wrote {args.out / 'accuracy.json'}, {args.out / 'accuracy.md'}")


if __name__ == "__main__":
    main()
