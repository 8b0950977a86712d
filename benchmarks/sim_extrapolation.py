"""The profile's old and new fit on the same timings, validated on the same real steps, by step size (issue 36).

A profile's samples (``meta["samples"]``) are fitted twice: the old way (the grid cut at 512 tokens and single
prompt chunks, as it was before steps of whole prompts were timed, the token curve continuing its last segment
above 512) and the new way (every sample, ``ProfiledCostModel``'s chord extrapolation); both predict every step of
the real runs that ``benchmarks/sim_accuracy.py`` saved (``<folder>/real``, ``<folder>/real_repeat``). Errors are
``predicted / measured - 1``, raw and "scaled" (each real run's predictions times its own median measured /
predicted, which removes the machine's speed of the moment and leaves the error in shape), by ``size_bin``.

    python benchmarks/sim_extrapolation.py results/acc36/arxiv results/acc36/profile_quick_arxiv.json

Prints a table and writes ``<folder>/extrapolation.json``. No timing of its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path

import numpy as np

from sarathi_lite.bench.results import BenchResult
from sarathi_lite.costs.profiled import TERMS, ProfiledCostModel
from sarathi_lite.sim.cost_model import fit_profile
from sarathi_lite.sim.profiler import grid_knots
from sarathi_lite.sim.validate import STEP_SIZES, size_bin, validate

OLD_GRID_TOKENS = 512


class LastSegment(ProfiledCostModel):
    """The token curve as it was extrapolated before issue 36: its last segment continued."""

    def token_time(self, tokens: float) -> float:
        k, t = self.token_knots, self.token_times
        if tokens <= k[-1]:
            return super().token_time(tokens)
        return t[-1] + (tokens - k[-1]) * (t[-1] - t[-2]) / (k[-1] - k[-2])


def fits(cost: ProfiledCostModel) -> dict[str, ProfiledCostModel]:
    """The old and the new fit of ``cost``'s samples (its host overheads kept)."""
    rows = [[s["terms"][k] for k in ("tokens", *TERMS)] for s in cost.meta["samples"]]
    times = [statistics.median(s["runs"]) for s in cost.meta["samples"]]
    host = {"schedule_constant": cost.schedule_constant, "schedule_per_request": cost.schedule_per_request}
    old = [(r, t) for r, t in zip(rows, times) if r[0] <= OLD_GRID_TOKENS and r[2] <= 1]
    old_knots = grid_knots([r for r, _ in old], OLD_GRID_TOKENS)
    new_knots = grid_knots(rows, max(int(r[0]) for r in rows))
    return {"old": LastSegment(old_knots, *fit_profile([r for r, _ in old], [t for _, t in old], old_knots), **host),
            "new": ProfiledCostModel(new_knots, *fit_profile(rows, times, new_knots), **host)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="a benchmarks/sim_accuracy.py --out folder")
    ap.add_argument("profile", type=Path, help="the profile JSON those runs were compared with")
    args = ap.parse_args()
    models = fits(ProfiledCostModel.load(args.profile))
    errors: dict[str, dict[str, list[tuple[float, float]]]] = {name: {} for name in models}
    for sub in ("real", "real_repeat"):
        for path in sorted((args.folder / sub).glob("*.json")):
            result = BenchResult.from_json(path)
            for name, model in models.items():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the old fit is asked beyond its grid on purpose
                    check = validate(result, model)
                for s in check.steps:
                    errors[name].setdefault(size_bin(s.tokens), []).append((s.error, s.scaled_error(check.scale)))
    rows = []
    for b in [size_bin(1)] + [size_bin(e + 1) for e in STEP_SIZES]:
        if b in errors["new"]:
            row: dict[str, object] = {"size": b, "n": len(errors["new"][b])}
            for name in models:
                e = np.array(errors[name][b])
                row[f"{name}_error_p50"] = float(np.median(e[:, 0]))
                row[f"{name}_scaled_error_p50"] = float(np.median(e[:, 1]))
            rows.append(row)
    print(f"{'step tokens':<12} {'steps':>6} {'old raw':>8} {'new raw':>8} {'old scaled':>10} {'new scaled':>10}")
    for r in rows:
        print(f"{r['size']:<12} {r['n']:>6} {100 * r['old_error_p50']:>+7.1f}% {100 * r['new_error_p50']:>+7.1f}% "
              f"{100 * r['old_scaled_error_p50']:>+9.1f}% {100 * r['new_scaled_error_p50']:>+9.1f}%")
    coefficients = {name: {k: m.coefficients[k] for k in ("prefill_chunks", "sampled")} for name, m in models.items()}
    print("per-chunk and per-sample seconds:", coefficients)
    out = args.folder / "extrapolation.json"
    out.write_text(json.dumps({"profile": args.profile.name, "by_size": rows, "coefficients": coefficients}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
