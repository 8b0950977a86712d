"""How well the calibrated GPU cost model predicts measured GPU timings, model by model, against the uncalibrated
roofline formula; leave-one-model-out validation; collective curves against their measurements.

    python benchmarks/gpu_calibration.py --profiles DIR --out benchmarks/results/gpu_calibration.json
    python benchmarks/gpu_calibration.py --profiles DIR --write-package-data

DIR is a copy of Vidur's measured profiles (``data/profiling`` of https://github.com/microsoft/vidur, MIT; the
shipped package data was fitted on one and does not need it at run time): ``compute/<gpu>/<org>/<model>/mlp.csv``,
``network/<gpu>_dgx/{all_reduce,send_recv}.csv``. For every model file each row (one layer's non-attention
operators at one token count and tensor-parallel degree) is predicted three ways: the uncalibrated roofline
(0.7 of peak FLOP/s, 0.85 of bandwidth), the calibration fitted to all of the GPU's models (in sample), and the
calibration fitted without that model (held out: the number that says how far a new model shape can be trusted).
Targets on held-out models: median |error| <= 5%, p90 <= 15%; all-reduce within 10% of the measured times:
median and p90 over every measured size (fitted on all of them), median on held-out sizes (fitted on every
other size, checked on the rest), and p90 on the held-out sizes whose own repetitions agree within 20 %
("stable"; Vidur times each size three times, and below 4 MB the three often land in two states 3-5x apart, so
such a size's median is not a measurement a model can be within 10 % of: their share is printed, and the p90
over all held-out sizes beside it).
``--write-package-data`` writes the all-model fits to ``sarathi_lite/costs/data/<gpu>.json``. Simulation-free;
about 20 s.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import numpy as np

from sarathi_lite.costs.roofline import HARDWARE
from sarathi_lite.sim.gpu_fit import (
    collective_errors,
    error_summary,
    fit_calibration,
    isotonic,
    network_dir,
    predict_rows,
    read_collective_rows,
    read_profiles,
    roofline_rows,
)

PRESETS = {"a100": "a100-80gb", "h100": "h100"}
SOURCE = ("microsoft/vidur data/profiling (commit 7d47513), MIT license, Copyright (c) Microsoft Corporation: "
          "compute/<gpu>/*/mlp.csv and network/<gpu>_dgx/{all_reduce,send_recv}.csv")
TARGET_MEDIAN, TARGET_P90, TARGET_ALL_REDUCE = 0.05, 0.15, 0.10
PACKAGE_DATA = Path(__file__).resolve().parents[1] / "sarathi_lite" / "costs" / "data"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%" if x < 0 else f"{100 * x:.1f}%"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", required=True,
                    help="a directory laid out like Vidur's data/profiling (compute/<gpu>/..., network/<gpu>_dgx/...)")
    ap.add_argument("--out", default=None, help="write the errors as JSON here")
    ap.add_argument("--write-package-data", action="store_true",
                    help="write the all-model fits to sarathi_lite/costs/data/<gpu>.json")
    args = ap.parse_args()
    tables = read_profiles(args.profiles)
    report: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "profiles": str(args.profiles), "source": SOURCE, "gpus": {}}
    failures = []
    for gpu in sorted({t.gpu for t in tables}):
        mine = [t for t in tables if t.gpu == gpu]
        hw = HARDWARE[PRESETS[gpu]]
        net = network_dir(args.profiles, gpu)
        full = fit_calibration(mine, net, source=SOURCE)
        if args.write_package_data:
            PACKAGE_DATA.mkdir(parents=True, exist_ok=True)
            (PACKAGE_DATA / f"{gpu}.json").write_text(json.dumps(full.to_dict()) + "\n")
        print(f"\n== {gpu} ({hw.name}): {len(mine)} models, {sum(len(t.tokens) for t in mine)} rows; "
              f"relative error of one layer's non-attention time (predicted / measured - 1)")
        print(f"{'model':<28} {'rows':>5} | {'uncalibrated':^26} | {'calibrated, in sample':^26} | "
              f"{'held out (leave one model out)':^30}")
        print(f"{'':<28} {'':>5} | {'med':>7} {'p90':>6} {'worst':>6}  {'sgn':>4}| {'med':>7} {'p90':>6} "
              f"{'worst':>6}  {'':>4}| {'med':>7} {'p90':>6} {'worst':>6} {'':>8}")
        models = {}
        pooled: dict[str, list[np.ndarray]] = {"uncalibrated": [], "in_sample": [], "held_out": []}
        for t in mine:
            measured = t.measured
            errs = {"uncalibrated": roofline_rows(hw, t) / measured - 1,
                    "in_sample": predict_rows(full, t) / measured - 1}
            others = [o for o in mine if o is not t]
            if others:
                errs["held_out"] = predict_rows(fit_calibration(others, net), t) / measured - 1
            summary = {k: error_summary(v) for k, v in errs.items()}
            for k, v in errs.items():
                pooled[k].append(v)
            models[t.model] = {"rows": len(t.tokens), "tensor_parallel": sorted(int(x) for x in set(t.tensor_parallel)),
                               "tokens": [int(t.tokens.min()), int(t.tokens.max())], **summary}
            u, c, h = summary["uncalibrated"], summary["in_sample"], summary.get("held_out")
            held = (f"{100 * h['abs_median']:>6.1f}% {100 * h['abs_p90']:>5.1f}% {100 * h['abs_max']:>5.1f}%"
                    if h else f"{'-':>30}")
            ok = h is not None and h["abs_median"] <= TARGET_MEDIAN and h["abs_p90"] <= TARGET_P90
            if h is not None and not ok:
                failures.append(f"{gpu}/{t.model}")
            print(f"{t.model:<28} {len(t.tokens):>5} | {100 * u['abs_median']:>6.1f}% {100 * u['abs_p90']:>5.1f}% "
                  f"{100 * u['abs_max']:>5.1f}% {100 * u['median']:>+4.0f}| {100 * c['abs_median']:>6.1f}% "
                  f"{100 * c['abs_p90']:>5.1f}% {100 * c['abs_max']:>5.1f}%  {'':>4}| {held} "
                  f"{'ok' if ok else ('MISS' if h else ''):>6}")
        per_gpu = {k: error_summary(np.concatenate(v)) for k, v in pooled.items() if v}
        for k, s in per_gpu.items():
            print(f"{'all rows, ' + k:<34} median {_pct(s['median'])}, |err| median {100 * s['abs_median']:.1f}% "
                  f"p90 {100 * s['abs_p90']:.1f}% worst {100 * s['abs_max']:.1f}%")
        collectives = {}
        held = fit_calibration(mine, net, holdout=True)
        print(f"{'collective':<16} {'sizes':>5} {'knots':>5} | {'fit, all sizes':^14} | {'sizes held out':^14} | "
              f"{'unstable':>8} | {'stable sizes: fit / held':^24} | {'non-decr.':>9} | ring formula")
        print(f"{'':<16} {'':>5} {'':>5} | {'med':>6} {'p90':>6} | {'med':>6} {'p90':>6} | {'share':>8} | "
              f"{'p90':>11} {'p90':>11} | {'best p90':>9} | sgn med / p90")
        for name in ("all_reduce", "send_recv"):
            measured = read_collective_rows(net / f"{name}.csv")
            curve = getattr(full, name)
            collectives[name] = {}
            for w, rows in measured.items():
                x, y, stable = rows.nbytes, rows.seconds, rows.stable
                fit_e = collective_errors(curve, {w: (x, y)})[w]
                held_e = collective_errors(getattr(held, name), {w: (x[1::2], y[1::2])})[w]
                link = hw.interconnect_bandwidth * 0.85  # the uncalibrated ring formula, RooflineCostModel's
                factor = 2 * (w - 1) / w if name == "all_reduce" else 1.0
                ring = (hw.interconnect_latency + factor * x / link) / y - 1
                s = {"fit": error_summary(fit_e), "held_out_sizes": error_summary(held_e),
                     "unstable_share": float(1 - stable.mean()),
                     "fit_stable": error_summary(fit_e[stable]),
                     "held_out_sizes_stable": error_summary(held_e[stable[1::2]]),
                     "ring_formula": error_summary(ring), "knots": len(curve.knots[w][0]),
                     "monotone_bound": error_summary(isotonic(y) / y - 1)}
                collectives[name][str(w)] = s
                if name == "all_reduce" and (s["fit"]["abs_median"] > TARGET_ALL_REDUCE
                                             or s["held_out_sizes"]["abs_median"] > TARGET_ALL_REDUCE
                                             or s["fit"]["abs_p90"] > TARGET_ALL_REDUCE
                                             or s["held_out_sizes_stable"]["abs_p90"] > TARGET_ALL_REDUCE):
                    failures.append(f"{gpu}/all_reduce/{w}")
                print(f"{name + ' x' + str(w):<16} {len(x):>5} {s['knots']:>5} | "
                      f"{100 * s['fit']['abs_median']:>5.1f}% {100 * s['fit']['abs_p90']:>5.1f}% | "
                      f"{100 * s['held_out_sizes']['abs_median']:>5.1f}% {100 * s['held_out_sizes']['abs_p90']:>5.1f}%"
                      f" | {100 * s['unstable_share']:>7.0f}% | {100 * s['fit_stable']['abs_p90']:>10.1f}% "
                      f"{100 * s['held_out_sizes_stable']['abs_p90']:>10.1f}% | "
                      f"{100 * s['monotone_bound']['abs_p90']:>8.1f}% | {_pct(s['ring_formula']['median'])} / "
                      f"{100 * s['ring_formula']['abs_p90']:.0f}%")
        report["gpus"][gpu] = {"device": hw.name, "models": models, "all_rows": per_gpu, "collectives": collectives,
                               "gemm_attained": {"flops": full.gemm_flops, "bandwidth": full.gemm_bandwidth,
                                                 "launch_floor_s": full.families["gemm"][0]}}
        print(f"fitted projections attain {full.gemm_flops / 1e12:.0f} TFLOP/s ({full.gemm_flops / hw.peak_flops:.2f}"
              f" of peak) and {full.gemm_bandwidth / 1e12:.2f} TB/s ({full.gemm_bandwidth / hw.memory_bandwidth:.2f}"
              f" of peak at one token); launch floor {1e6 * full.families['gemm'][0]:.1f} us per projection")
    report["targets"] = {"held_out_median": TARGET_MEDIAN, "held_out_p90": TARGET_P90,
                         "all_reduce": TARGET_ALL_REDUCE, "missed": failures}
    print("\ntargets (held out: median |err| <= 5%, p90 <= 15%; all-reduce: median <= 10% fitted and on held-out "
          "sizes, p90 <= 10% fitted on every size and on the held-out sizes whose repetitions agree): "
          + ("all met" if not failures else "missed: " + ", ".join(failures)))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
