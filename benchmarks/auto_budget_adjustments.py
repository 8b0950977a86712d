"""Each of the ``"auto"`` budget's adjustments measured: simulated capacity with it and without it.

``TokenBudget`` (``sarathi_lite.scheduler.budget``) corrects its cost model's predictions in five ways: the
``correction`` (typical measured / predicted), the ``spread`` (a high percentile of it), ``between`` (the host's
time between steps), the ``TailController`` (moves the target so the measured percentile meets the SLO) and
``tail_percentile`` (the spread's percentile follows the share of decode tokens in the steps the budget sizes).
For each cell (a deployment and trace of ``benchmarks/auto_budget.py``) this script searches ``auto``'s capacity
with all five, then with each one switched off in turn (a ``TokenBudget`` subclass patched into the simulator's
scheduler), and compares each with the best fixed chunk size of a stored ``auto_budget.py`` run (the fixed sizes
never ask the budget, so their capacities do not change with it).

Variants: ``all``; ``no-correction`` (the correction stays 1: the spread alone absorbs the ratio);
``no-spread`` (it stays 1); ``no-between`` (it stays 0); ``no-controller`` (a fixed target, ``tbt_slo *
budget_safety``); ``no-feedback`` (the controller's jump to its aim once the spread is measured, but no later
move); ``no-tail-percentile`` (the spread and ``between`` at ``tbt_percentile`` itself).

The simulations are deterministic, so an adjustment that never leaves its neutral value in the ``all`` search
(the correction and spread exactly 1, ``between`` 0, the target never moved, ``tail_percentile`` never below
``tbt_percentile`` where a percentile is taken) gives the very same runs without it: its search is not run again
and its row says ``identical``. Each search covers ``--range`` times the stored ``auto`` capacity of the cell
(``benchmarks/results/auto_budget_*_p99.json``) with ``--probes`` simulations: resolution ``(high - low) /
2 ** (probes - 2)``; a capacity under the range is reported as 0. ``--at`` runs no search: one simulation per
variant at given fractions of the stored capacity (whether each meets the SLO there), for cells too slow to
search on a busy machine. ``--predictor-scale`` gives the budget a predictor off the clock by a constant factor,
the case the correction is for (in every cell above the predictor is the clock's own model).

    python benchmarks/auto_budget_adjustments.py --cells smollm2-cpu-350ms:conversation --probes 7 \
        --range 0.8,1.2 --out benchmarks/results/auto_budget_adjustments_cpu.json

Prints a table and writes JSON (the command, date, commit, machine, load average, every capacity search).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from auto_budget import SETUPS, gaps_over, workload  # noqa: E402

from sarathi_lite.bench.capacity import SLO, search_capacity  # noqa: E402
from sarathi_lite.bench.results import BenchResult, commit, host  # noqa: E402
from sarathi_lite.costs import load_cost_model  # noqa: E402
from sarathi_lite.scheduler import base, budget  # noqa: E402
from sarathi_lite.sim import simulator as sim  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CELLS = ("h100-llama3-8b-15ms:conversation", "a100-llama3-8b-25ms:arxiv", "4xh100-llama3-70b:arxiv",
         "smollm2-cpu:conversation", "smollm2-cpu-strict:conversation", "smollm2-cpu-350ms:conversation")
STORED = ("auto_budget_h100_p99.json", "auto_budget_a100_70b_p99.json", "auto_budget_cpu_p99.json")


def without(adjustment: str) -> type[budget.TokenBudget]:
    """A ``TokenBudget`` with ``adjustment`` switched off (``"all"``: none)."""

    class Budget(budget.TokenBudget):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._start_target = self.target
            if adjustment == "no-controller":
                self.controller = None
            elif adjustment == "no-feedback" and self.controller is not None:
                self.controller.window = 1 << 62  # a window that never fills: the target never moves again

        def corrected(self, predicted: float) -> float:
            spread = 1.0 if adjustment == "no-spread" else self.spread
            between = 0.0 if adjustment == "no-between" else self.between
            return predicted * self.correction * spread + between

        def observe(self, *args: Any, **kwargs: Any) -> None:
            super().observe(*args, **kwargs)
            if adjustment == "no-correction":
                self._log_correction, self.correction = 0.0, 1.0
            ACTIVE["no-correction"] |= self.correction != 1.0
            ACTIVE["no-spread"] |= self.spread != 1.0
            ACTIVE["no-between"] |= self.between != 0.0
            ACTIVE["no-controller"] |= self.target != self._start_target

        def _tail(self, window: Any) -> float:
            ACTIVE["no-tail-percentile"] |= len(window) >= budget.SPREAD_MIN_STEPS and \
                self.tail_percentile != self.percentile
            return super()._tail(window)

        def observe_output(self, *args: Any, **kwargs: Any) -> float | None:
            before = self.target
            gap = super().observe_output(*args, **kwargs)
            aimed = self.controller is not None and before < self.controller.aim == self.target  # the jump
            ACTIVE["no-feedback"] |= self.target != before and not aimed
            return gap

        @property
        def tail_percentile(self) -> float:
            return self.percentile if adjustment == "no-tail-percentile" else super().tail_percentile

    return Budget


ACTIVE: dict[str, bool] = {}
"""Per variant but ``all``: whether its adjustment left its neutral value in the search running now."""
VARIANTS = ("all", "no-correction", "no-spread", "no-between", "no-controller", "no-feedback",
            "no-tail-percentile")


def stored(setup: str, trace: str) -> dict[str, Any]:
    """The cell's row in a stored ``auto_budget.py`` run (its best fixed size and every capacity)."""
    for name in STORED:
        for row in json.loads((RESULTS / name).read_text())["rows"]:
            if (row["setup"], row["trace"]) == (setup, trace):
                return row
    raise SystemExit(f"no stored auto_budget.py row for {setup}:{trace} in {', '.join(STORED)}")


def best_fixed(setup: str, trace: str) -> tuple[int, float]:
    """The best fixed chunk size and its capacity in a stored ``auto_budget.py`` run of the cell."""
    row = stored(setup, trace)
    return row["best_fixed"], row["capacity"][str(row["best_fixed"])]


class Scaled:
    """A predictor ``scale`` times ``cost``'s: a model profiled on a machine of another speed than the clock."""

    def __init__(self, cost: Any, scale: float) -> None:
        self.cost, self.scale = cost, scale

    def predict_step_time(self, out: Any) -> float:
        return self.scale * self.cost.predict_step_time(out)


def run_cell(cell: str, variant: str, probes: int, rate_range: tuple[float, float],
             at: tuple[float, ...] = (), predictor_scale: float = 1.0) -> dict[str, Any]:
    setup_name, trace = cell.split(":")
    setup = SETUPS[setup_name]
    cost, wl = load_cost_model(setup.cost_model), workload(setup, trace)
    options = {"tbt_slo": setup.tbt_slo, "budget_safety": setup.budget_safety, "tbt_percentile": 99.0,
               "hol_protection": False, "enable_prefix_caching": False}  # as auto_budget.py runs them
    known = stored(setup_name, trace)["capacity"]["auto"]
    low, high = (known * f for f in rate_range)
    base.TokenBudget = without(variant)
    ACTIVE.update(dict.fromkeys(VARIANTS[1:], False))
    t0 = time.perf_counter()
    config = sim.scheduler_config(cost, "sarathi", "auto", **options)
    predictor = None if predictor_scale == 1.0 else Scaled(cost, predictor_scale)

    def run(qps: float) -> BenchResult:
        return sim.simulate(wl.at_qps(qps), cost, config, chunk_size="auto", predictor=predictor)

    try:
        if at:  # one simulation per rate, no search
            runs = {known * f: run(known * f) for f in at}
        else:
            found = search_capacity(run, SLO(setup.tbt_slo), low, high, probes, label="sarathi/auto")
    finally:
        base.TokenBudget = budget.TokenBudget
    row: dict[str, Any] = {"cell": cell, "variant": variant, "slo_tbt_p99": setup.tbt_slo,
                           "predictor_scale": predictor_scale}
    if variant == "all":
        row["active"] = dict(ACTIVE)
    if at:
        slo = SLO(setup.tbt_slo)
        row["at"] = [{"qps": q, "passed": slo.met_by(r.summary()), "tbt_p99": r.summary()["tbt_p99"],
                      "scheduling_delay_p50": r.summary()["scheduling_delay_p50"],
                      "gaps_over_slo": gaps_over(r, setup.tbt_slo)} for q, r in runs.items()]
        row["wall_s"] = time.perf_counter() - t0
        return row
    row.update({"capacity": found.capacity or 0.0, "rates": [low, high], "wall_s": time.perf_counter() - t0})
    passed = [p for p in found.probes if p.passed]
    if passed:
        row["gaps_over_slo"] = gaps_over(max(passed, key=lambda p: p.qps).result, setup.tbt_slo)
    for p in found.probes:
        p.result = None
    row["search"] = found.to_dict()
    return row


def at_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'cell':<34} {'variant':<19} {'req/s':>7} {'P99 TBT ms':>10} {'delay p50 s':>11} {'meets SLO':>9}"]
    for r in rows:
        for a in r["at"]:
            lines.append(f"{r['cell']:<34} {r['variant']:<19} {a['qps']:>7.3f} {1000 * a['tbt_p99']:>10.2f} "
                         f"{a['scheduling_delay_p50']:>11.3f} {str(a['passed']):>9}"
                         + ("  identical (never active)" if r.get("identical") else ""))
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    single = [r for r in rows if "at" in r]
    rows = [r for r in rows if "at" not in r]
    lines = [f"{'cell':<34} {'variant':<19} {'capacity':>8} {'vs all':>7} {'vs best fixed':>18} {'gaps>SLO':>8}"]
    for r in rows:
        ref = next((a["capacity"] for a in rows if a["cell"] == r["cell"] and a["variant"] == "all"
                    and a.get("predictor_scale") == r.get("predictor_scale")), None)
        cap = r["capacity"] or 0.0
        vs_all = f"{cap / ref:.3f}x" if ref else "-"
        fixed = best_fixed(*r["cell"].split(":"))
        vs_fixed = f"{cap / fixed[1]:.3f}x of {fixed[0]}" if fixed[1] else "-"
        gaps = f"{100 * r['gaps_over_slo']:.2f}%" if "gaps_over_slo" in r else "-"
        lines.append(f"{r['cell']:<34} {r['variant']:<19} {cap:>8.3f} {vs_all:>7} {vs_fixed:>18} {gaps:>8}"
                     + ("  identical (never active)" if r.get("identical") else "")
                     + (f"  predictor x{r['predictor_scale']:g}" if r.get("predictor_scale", 1.0) != 1.0 else ""))
    return "\n".join(lines) + ("\n\n" + at_table(single) if single else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=",".join(CELLS), help="comma-separated setup:trace of auto_budget.py")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--probes", type=int, default=10, help="simulations per capacity search")
    ap.add_argument("--range", type=lambda t: tuple(float(x) for x in t.split(",")), default=(0.6, 1.2),
                    help="the rates searched, as fractions of the cell's stored auto capacity (default 0.6,1.2)")
    ap.add_argument("--at", type=lambda t: tuple(float(x) for x in t.split(",")), default=(),
                    help="no search: one simulation per variant at each of these fractions of the stored auto "
                         "capacity (for cells too slow to search on a busy machine)")
    ap.add_argument("--predictor-scale", type=float, default=1.0,
                    help="the budget's predictor is this times the clock's cost model (0.67: a profile from a "
                         "machine 1.5x faster than the one simulated; what the correction is for)")
    ap.add_argument("--merge", type=Path, nargs="*", default=[],
                    help="earlier outputs of this script whose rows join this run's (for runs split in parts)")
    ap.add_argument("--out", type=Path, default=RESULTS / "auto_budget_adjustments.json")
    args = ap.parse_args()
    load = os.getloadavg()
    rows = []
    for cell in filter(None, args.cells.split(",")):
        reference = run_cell(cell, "all", args.probes, args.range, args.at, args.predictor_scale)
        rows.append(reference)
        for variant in args.variants.split(","):
            if variant == "all":
                continue
            if reference["active"][variant]:
                rows.append(run_cell(cell, variant, args.probes, args.range, args.at, args.predictor_scale))
            else:  # the same deterministic runs, step by step
                rows.append({**reference, "variant": variant, "identical": True, "wall_s": 0.0})
                del rows[-1]["active"]
    parts = [json.loads(p.read_text()) for p in args.merge]
    rows = [r for part in parts for r in part["rows"]] + rows
    print(table(rows))
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit(), "machine": host(),
              "load_average_start": list(load), "load_average_end": list(os.getloadavg()),
              "command": " ".join(["python", *sys.argv]), "parts": [p["command"] for p in parts], "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"load average {load[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; wrote {args.out}")


if __name__ == "__main__":
    main()
