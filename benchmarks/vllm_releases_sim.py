"""The plugin inside a vLLM release against that release's own scheduler and its own head-of-line settings, simulated
(the release this interpreter holds: 0.32, 0.33 or 0.34).

Every system is the installed vLLM's real scheduling code (``sarathi_lite.integrations.vllm.simclock``: the
release's ``Scheduler``, or ``SarathiScheduler`` subclassing its ``AsyncScheduler``, driven model-free by the
contract harness), each step's time predicted by the calibrated H100 cost model (``roofline:h100:llama3-8b``,
``roofline:4xh100:llama3-70b``: tensor parallel over four). Every system gets vLLM's own defaults for
``vllm serve`` on an H100 (``EngineArgs``: ``max_num_batched_tokens`` 8,192, ``max_num_seqs`` 1,024), no prefix
cache (the traces share no prefix), the KV pool the simulator derives for the model:

- ``plugin``: ``--scheduler-cls sarathi_lite.integrations.vllm.SarathiScheduler`` with no options (its defaults:
  ``chunk_size`` 512, head-of-line protection on); ``plugin@B``: with ``chunk_size`` B (for the reader);
- ``plugin-auto``: the plugin told the SLO and the hardware: ``chunk_size`` ``"auto"``, ``tbt_slo`` the capacity
  SLO (``--tbt-slo``) and ``cost_model`` the model's calibrated H100 model (each step's budget sized so the step
  fits the SLO; its step timer reads the simulated clock, so its correction learns the simulated step times);
  ``plugin-auto@S``: the same with ``tbt_slo`` S seconds (for the reader: the long-tail trade at other SLOs);
- ``vllm``: the release's default scheduler (no long-prefill cap);
- ``adaptive@T``: ``long_prefill_token_threshold`` T with ``long_prefill_token_threshold_adaptive`` (the cap
  floored at the budget over the requests queued and running); ``adaptive@T+cadence@N`` also
  ``prefill_schedule_interval`` N (prefill held until N steps have passed since the last step that carried one);
- ``vllm-budget@B``: vLLM's default scheduler at ``max_num_batched_tokens`` B (for the reader: what a smaller
  budget alone does; no bar is read from it).

Parts:

1. **capacity**: on the conversation and arXiv traces (as ``benchmarks/auto_budget.py`` takes them: lengths
   unscaled, clipped to 7,168 / 1,024 tokens; ``--num-requests`` of each, Poisson), the highest rate with P99
   TBT <= ``--tbt-slo`` and median scheduling delay <= 2 s (``search_capacity``, ``--probes`` simulations per
   search). Bars: ``plugin`` >= 1.1x ``vllm`` and >= 1.0x the best ``adaptive`` setting swept.
2. **long-tail**: short prompts (32-256 tokens) with one in eight ``--long-prompt`` tokens, outputs 32-64,
   Poisson at the model's ``--long-tail-qps``, ``--seeds`` workloads pooled: short-request TTFT p99, long-prompt
   TTFT p50, output tokens/s, P99 TBT. Bars: short TTFT p99 >= 3x lower than ``vllm`` at throughput within 3%;
   against every setting swept, a lower short TTFT p99 or a lower long TTFT p50 at no worse of the other.

Runs in the environment holding the release (scripts/setup_vllm.sh: .venv-vllm/ for 0.32;
scripts/setup_vllm_harness.sh: .venv-vllm-0.33/, .venv-vllm-0.34/), with this checkout on the path:

    PYTHONPATH=. .venv-vllm-0.34/bin/python benchmarks/vllm_releases_sim.py --jobs 2

(0.32 has no ``prefill_schedule_interval``: a cadence system there is a row with vLLM's error.)

Prints the tables and the bars and writes ``--out`` (JSON: command, date, commit, machine, every search's probes
and every long-tail cell) after each finished search. Simulated: the numbers do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from auto_budget import SETUPS as TRACE_SETUPS  # the traces as the capacity benchmarks take them
from auto_budget import workload as trace_workload

from sarathi_lite.bench.capacity import SLO, search_capacity
from sarathi_lite.bench.results import BenchResult, commit, host, portable_arg
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import load_cost_model
from sarathi_lite.integrations.vllm import simclock

ROOT = Path(__file__).resolve().parents[1]
RELEASES = ("0.32", "0.33", "0.34")
BUDGET = 8192
"""vLLM's ``max_num_batched_tokens`` for ``vllm serve`` on a GPU of at least 70 GiB other than an A100 (0.32 to
0.34: ``EngineArgs``' table is the same)."""
SEATS = 1024
"""vLLM's ``max_num_seqs`` there."""
MODELS = {  # cost model, capacity search range (requests/s), the long-tail mix's rate (requests/s)
    "llama3-8b": ("roofline:h100:llama3-8b", (0.5, 40.5), 8.0),
    "llama3-70b-tp4": ("roofline:4xh100:llama3-70b", (0.25, 20.25), 4.0),
}
SHORT_LENGTHS = "uniform:32-256:32-64"
"""The long-tail mix's short requests (prompt and output tokens), as ``benchmarks/vllm_plugin.py``'s."""


@dataclass(frozen=True)
class System:
    """One scheduler configuration (see the module docstring for the names)."""

    name: str
    scheduler: str = "default"
    budget: int = BUDGET
    threshold: int = 0
    adaptive: bool = False
    cadence: int = 1
    plugin_options: dict[str, Any] | None = None
    auto: bool = False
    """The plugin's ``"auto"`` budget, given the SLO and the model's cost model when it runs (``with_slo``)."""

    @classmethod
    def parse(cls, name: str) -> System:
        if name == "plugin":
            return cls(name, "plugin", plugin_options={})
        if name == "plugin-auto":
            return cls(name, "plugin", plugin_options={}, auto=True)
        if name.startswith("plugin-auto@"):
            try:
                slo = float(name.split("@", 1)[1])
            except ValueError:
                slo = 0.0
            if slo > 0:
                return cls(name, "plugin", plugin_options={"tbt_slo": slo}, auto=True)
        if name == "vllm":
            return cls(name)
        if name.startswith("plugin@") and name.split("@", 1)[1].isdigit():
            return cls(name, "plugin", plugin_options={"chunk_size": int(name.split("@", 1)[1])})
        if name.startswith("vllm-budget@") and name.split("@", 1)[1].isdigit():
            return cls(name, budget=int(name.split("@", 1)[1]))
        if name.startswith("adaptive@"):
            threshold, held, cadence = name.split("@", 1)[1].partition("+cadence@")
            if threshold.isdigit() and (cadence.isdigit() if held else not cadence):
                return cls(name, threshold=int(threshold), adaptive=True, cadence=int(cadence or 1))
        raise SystemExit(f"unknown system {name!r}: plugin, plugin@B, plugin-auto, plugin-auto@S, vllm, "
                         f"vllm-budget@B, adaptive@T, adaptive@T+cadence@N")

    def with_slo(self, tbt_slo: float, cost_model: str) -> System:
        """This system as it runs under ``tbt_slo`` (seconds) on ``cost_model`` (a ``load_cost_model`` spec)."""
        if not self.auto:
            return self
        return replace(self, plugin_options={"chunk_size": "auto", "tbt_slo": tbt_slo, "cost_model": cost_model,
                                             **(self.plugin_options or {})})

    def options(self) -> dict[str, Any]:
        """``simclock.simulate``'s keywords for this system."""
        fields: dict[str, Any] = {}
        if self.adaptive:
            fields["long_prefill_token_threshold_adaptive"] = True
        if self.cadence > 1:
            fields["prefill_schedule_interval"] = self.cadence
        # vLLM refuses fewer batched tokens than seats: a smaller budget brings its seats down with it
        return {"label": self.name, "chunk_size": self.budget, "scheduler": self.scheduler,
                "plugin_options": self.plugin_options, "long_prefill_token_threshold": self.threshold,
                "vllm_fields": fields, "enable_prefix_caching": False, "max_num_seqs": min(SEATS, self.budget)}


def run(workload: Workload, cost_model: str, system: System) -> BenchResult:
    return simclock.simulate(workload, load_cost_model(cost_model), **system.options())


def capacity_task(model: str, trace: str, name: str, num_requests: int, tbt_slo: float, probes: int,
                  qps_range: tuple[float, float] | None = None) -> dict[str, Any]:
    """One capacity search (over ``qps_range``, default the model's): the search's probes and the summary of the
    highest passing rate."""
    cost, default_range, _ = MODELS[model]
    lo, hi = qps_range or default_range
    wl = trace_workload(replace(TRACE_SETUPS["h100-llama3-8b"], num_requests=num_requests), trace)
    system = System.parse(name).with_slo(tbt_slo, cost)
    t0 = time.perf_counter()
    found = search_capacity(lambda qps: run(wl.at_qps(qps), cost, system), SLO(tbt_slo), lo, hi, probes,
                            label=name)
    row = {"part": "capacity", "model": model, "trace": trace, "system": name, "workload": wl.describe(),
           **found.to_dict(), "wall_s": round(time.perf_counter() - t0, 1)}
    best = max((p for p in found.probes if p.passed), key=lambda p: p.qps, default=None)
    if best is not None:
        s = best.result.summary()
        row["at_capacity"] = {k: s[k] for k in ("ttft_p50", "ttft_p99", "tbt_p99", "scheduling_delay_p50",
                                                "throughput_output_tokens_per_s", "num_preemptions")}
    return row


def long_tail_workload(seed: int, num_requests: int, qps: float, long_prompt: int) -> Workload:
    """The long-tail mix: ``SHORT_LENGTHS`` with one request in eight given a ``long_prompt``-token prompt."""
    return Workload.synthetic(SHORT_LENGTHS, num_requests=num_requests, qps=qps, seed=seed).with_long_prompts(
        num_requests // 8, long_prompt)


def long_tail_task(model: str, name: str, seeds: int, num_requests: int, long_prompt: int,
                   tbt_slo: float) -> dict[str, Any]:
    """The long-tail mix's seeds under one system, pooled: every request's TTFT and every token gap taken as one
    run, throughput as all output tokens over the sum of the runs' spans."""
    cost, _, qps = MODELS[model]
    system = System.parse(name).with_slo(tbt_slo, cost)
    t0 = time.perf_counter()
    short, long, gaps, tokens, span, preempted = [], [], [], 0, 0.0, 0
    for seed in range(seeds):
        result = run(long_tail_workload(seed, num_requests, qps, long_prompt), cost, system)
        for r in result.stats.requests:
            if r.ttft is not None:
                (long if r.num_prompt_tokens >= long_prompt else short).append(r.ttft)
            gaps.extend(r.tbt)
        s = result.summary()
        tokens, span, preempted = tokens + s["output_tokens"], span + s["duration"], preempted + s["num_preemptions"]
    return {"part": "long-tail", "model": model, "system": name, "qps": qps, "seeds": seeds,
            "short_requests": len(short), "long_requests": len(long),
            "short_ttft_p50": float(np.percentile(short, 50)), "short_ttft_p99": float(np.percentile(short, 99)),
            "long_ttft_p50": float(np.percentile(long, 50)), "long_ttft_p99": float(np.percentile(long, 99)),
            "tbt_p99": float(np.percentile(gaps, 99)), "out_tok_s": tokens / span, "num_preemptions": preempted,
            "wall_s": round(time.perf_counter() - t0, 1)}


def _call(task: tuple[str, tuple[Any, ...]]) -> dict[str, Any]:
    """One task's row; a configuration vLLM refuses gives a row with its ``error`` (reported, not dropped)."""
    kind, args = task
    try:
        return (capacity_task if kind == "capacity" else long_tail_task)(*args)
    except Exception as e:  # noqa: BLE001  (vLLM's pydantic errors do not pickle back to the parent)
        model, *rest = args
        return {"part": kind, "model": model, "trace": rest[0] if kind == "capacity" else "",
                "system": rest[1] if kind == "capacity" else rest[0], "error": f"{type(e).__name__}: {e}",
                "wall_s": 0.0}


def is_plugin(system: str) -> bool:
    """Whether the bars are read for ``system``: the plugin at its defaults and told an SLO (``plugin``,
    ``plugin-auto``, ``plugin-auto@S``), each on its own; ``plugin@B`` is for the reader."""
    return system in ("plugin", "plugin-auto") or system.startswith("plugin-auto@")


def bars(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each bar of the issue, per plugin configuration (``is_plugin``), model and trace, with the numbers it reads
    and whether it is met (``None`` where a cell it needs is missing or below the search's range)."""
    out = []
    rows = [r for r in rows if "error" not in r]
    for plugin in sorted({r["system"] for r in rows if is_plugin(r["system"])}):
        for model in MODELS:
            for trace in ("conversation", "arxiv"):
                cap = {r["system"]: r["capacity"] for r in rows
                       if r["part"] == "capacity" and r["model"] == model and r["trace"] == trace}
                if plugin not in cap:
                    continue
                swept = {k: v for k, v in cap.items() if k.startswith("adaptive@")}
                best = max(swept, key=lambda k: swept[k] or 0.0, default=None)
                ours, base = cap[plugin], cap.get("vllm")
                out.append({"bar": "capacity >= 1.1x vllm", "system": plugin, "model": model, "trace": trace,
                            "plugin": ours, "against": base, "ratio": ours / base if ours and base else None,
                            "met": None if not ours or "vllm" not in cap else (base is None or ours >= 1.1 * base)})
                if best is not None:
                    top = swept[best]
                    out.append({"bar": "capacity >= 1.0x best adaptive", "system": plugin, "model": model,
                                "trace": trace, "plugin": ours, "against": top, "best": best,
                                "ratio": ours / top if ours and top else None,
                                "met": None if not ours else (top is None or ours >= top)})
            cells = {r["system"]: r for r in rows if r["part"] == "long-tail" and r["model"] == model}
            if plugin in cells:
                out += _long_tail_bars(plugin, model, cells)
    return out


def _long_tail_bars(plugin: str, model: str, cells: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The long-tail bars of ``plugin``'s cell against vLLM's default and every vLLM setting swept."""
    out = []
    ours = cells[plugin]
    if "vllm" in cells:
        base = cells["vllm"]
        ratio = base["short_ttft_p99"] / ours["short_ttft_p99"]
        change = ours["out_tok_s"] / base["out_tok_s"] - 1
        out.append({"bar": "short TTFT p99 >= 3x lower than vllm, throughput within 3%", "system": plugin,
                    "model": model, "ratio": ratio, "throughput_change": change,
                    "met": ratio >= 3 and abs(change) <= 0.03})
    for name, cell in cells.items():
        if name == "vllm" or name.startswith(("plugin", "vllm-budget@")):
            continue
        short_better = ours["short_ttft_p99"] < cell["short_ttft_p99"]
        long_better = ours["long_ttft_p50"] < cell["long_ttft_p50"]
        met = (short_better and ours["long_ttft_p50"] <= cell["long_ttft_p50"]) or (
            long_better and ours["short_ttft_p99"] <= cell["short_ttft_p99"])
        out.append({"bar": "lower short TTFT p99 or long TTFT p50, no worse of the other", "system": plugin,
                    "model": model, "against": name,
                    "short_ttft_p99": [ours["short_ttft_p99"], cell["short_ttft_p99"]],
                    "long_ttft_p50": [ours["long_ttft_p50"], cell["long_ttft_p50"]], "met": met})
    return out


def tables(rows: list[dict[str, Any]]) -> str:
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    lines = [f"{r['part']} {r['model']} {r['trace']} {r['system']}: {r['error']}" for r in failed]
    lines += [f"{'model':<15} {'trace':<13} {'system':<26} {'capacity':>9} {'failed at':>9} {'TTFT p50':>9} "
              f"{'TBT p99':>8}   (capacity: requests/s; at capacity: seconds)"]
    for r in sorted((r for r in rows if r["part"] == "capacity"), key=lambda r: (r["model"], r["trace"])):
        at = r.get("at_capacity", {})
        cap = "<" + f"{r['qps_range'][0]:g}" if r["capacity"] is None else f"{r['capacity']:.2f}"
        fail = "-" if r["failed_above"] is None else f"{r['failed_above']:.2f}"
        ttft = f"{at['ttft_p50']:.3f}" if at else "-"
        tbt = f"{at['tbt_p99']:.3f}" if at else "-"
        lines.append(f"{r['model']:<15} {r['trace']:<13} {r['system']:<26} {cap:>9} {fail:>9} {ttft:>9} {tbt:>8}")
    lines.append("")
    lines.append(f"{'model':<15} {'system':<26} {'short p50':>9} {'short p99':>9} {'long p50':>9} {'long p99':>9} "
                 f"{'TBT p99':>8} {'out tok/s':>9}   (long-tail, seconds)")
    for r in sorted((r for r in rows if r["part"] == "long-tail"), key=lambda r: r["model"]):
        lines.append(f"{r['model']:<15} {r['system']:<26} {r['short_ttft_p50']:>9.3f} {r['short_ttft_p99']:>9.3f} "
                     f"{r['long_ttft_p50']:>9.3f} {r['long_ttft_p99']:>9.3f} {r['tbt_p99']:>8.3f} "
                     f"{r['out_tok_s']:>9.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--traces", default="conversation,arxiv")
    ap.add_argument("--systems", default="plugin,vllm,adaptive@256,adaptive@512,adaptive@1024,adaptive@2048,"
                    "adaptive@512+cadence@2,adaptive@512+cadence@4,vllm-budget@512,plugin@2048",
                    help="comma-separated (module docstring); both parts run each")
    ap.add_argument("--parts", default="capacity,long-tail")
    ap.add_argument("--num-requests", type=int, default=300, help="requests per capacity probe")
    ap.add_argument("--probes", type=int, default=8, help="simulations per capacity search")
    ap.add_argument("--qps-range", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                    help="the capacity searches' rates (requests/s; default: each model's)")
    ap.add_argument("--tbt-slo", type=float, default=0.1, help="P99 TBT bound, seconds")
    ap.add_argument("--seeds", type=int, default=2, help="long-tail workloads pooled")
    ap.add_argument("--long-tail-requests", type=int, default=400)
    ap.add_argument("--long-prompt", type=int, default=7000, help="tokens (Llama-3's context is 8,192)")
    ap.add_argument("--jobs", type=int, default=1, help="searches run at once (processes)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_releases_sim.json")
    ap.add_argument("--reuse", type=Path, nargs="*", default=[],
                    help="earlier results (this script's JSON) whose rows join this run's in the bars and tables, "
                         "where this run has no row of the same part, model, trace and system (named in the JSON)")
    args = ap.parse_args()
    release = simclock.installed_release()
    if release not in RELEASES:
        sys.exit(f"run this in an environment holding vLLM {', '.join(RELEASES)} (scripts/setup_vllm.sh, "
                 f"scripts/setup_vllm_harness.sh), with this checkout on PYTHONPATH; this interpreter has "
                 f"{release or 'no vLLM'}")
    from sarathi_lite.integrations.vllm import harness  # noqa: F401  (imported once, before the workers fork)

    models, parts = args.models.split(","), args.parts.split(",")
    names = args.systems.split(",")
    for name in names:
        System.parse(name)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}: of {', '.join(MODELS)}")
    tasks: list[tuple[str, tuple[Any, ...]]] = []
    if "long-tail" in parts:
        tasks += [("long-tail", (m, n, args.seeds, args.long_tail_requests, args.long_prompt, args.tbt_slo))
                  for m in models for n in names]
    if "capacity" in parts:
        tasks += [("capacity", (m, t, n, args.num_requests, args.tbt_slo, args.probes, args.qps_range))  # by system
                  for n in names for m in models for t in args.traces.split(",")]
    record: dict[str, Any] = {
        "command": f"PYTHONPATH=. {portable_arg(sys.executable)} benchmarks/vllm_releases_sim.py " +
                   " ".join(portable_arg(a) for a in sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "commit": commit(), "machine": host(), "vllm": simclock._vllm_version(),
        "defaults": {"max_num_batched_tokens": BUDGET, "max_num_seqs": SEATS, "tbt_slo": args.tbt_slo,
                     "scheduling_delay_p50": 2.0},
        "models": {m: {"cost_model": MODELS[m][0], "qps_range": MODELS[m][1], "long_tail_qps": MODELS[m][2]}
                   for m in models},
        "rows": [], "reused": {}}
    reused = []
    for path in args.reuse:
        earlier = json.loads(path.read_text(encoding="utf-8"))
        record["reused"][portable_arg(str(path))] = {"command": earlier["command"], "commit": earlier["commit"]}
        reused += earlier["rows"]
    planned = {(kind, a[0], a[1] if kind == "capacity" else "", a[2] if kind == "capacity" else a[1])
               for kind, a in tasks}
    reused = [r for r in reused if (r["part"], r["model"], r.get("trace", ""), r["system"]) not in planned]
    t0 = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for row in pool.imap_unordered(_call, tasks):
            record["rows"].append(row)
            record["bars"] = bars(record["rows"] + reused)
            record["wall_s"] = round(time.perf_counter() - t0)
            record["load_average"] = list(os.getloadavg())
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=1))
            print(f"done: {row['part']} {row['model']} {row.get('trace', '')} {row['system']} "
                  f"({row['wall_s']} s)", flush=True)
    print(tables(record["rows"] + reused))
    for b in record["bars"]:
        print(("MET   " if b["met"] else "MISSED" if b["met"] is not None else "n/a   "),
              json.dumps({k: v for k, v in b.items() if k != "met"}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
