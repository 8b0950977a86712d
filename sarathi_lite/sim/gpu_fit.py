"""Fit ``GpuCalibration``s (``sarathi_lite.costs.calibrated``) to a directory of measured GPU timings laid out
like Vidur's ``data/profiling`` (``compute/<gpu>/<org>/<model>/mlp.csv``, ``network/<gpu>_dgx/all_reduce.csv``
and ``send_recv.csv``; times in milliseconds), and measure how well they predict it.

- ``read_profiles(root)``: every model file as a ``ProfileTable`` (the median of repeated rows);
- ``fit_calibration(tables, network)``: per operator family, non-negative least squares on the squared relative
  error of every operator's time (so a 10 us decode kernel counts as much as a 10 ms prefill one); the
  collectives' tables of measured times (``fit_collective``);
- ``row_errors``: each row's predicted layer time (the sum of its operators) against the measured one, for a
  calibration or for the uncalibrated roofline formula.

Torch-free (stdlib csv and numpy); it runs on the CSVs, which never ship with the package.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_lite.costs.calibrated import (
    CALIBRATION_SCHEMA,
    OPERATORS,
    Collective,
    GpuCalibration,
    LayerShape,
    family,
    operator_terms,
)
from sarathi_lite.costs.roofline import Hardware
from sarathi_lite.sim.cost_model import nnls

MS = 1e-3


@dataclass(slots=True)
class ProfileTable:
    """One model file: its GPU, model name, per-row tokens and tensor-parallel degree, each operator's median
    seconds per row (only the operators the file has), and the shape (hidden size, heads, ...) of its rows."""

    gpu: str
    model: str
    tokens: np.ndarray
    tensor_parallel: np.ndarray
    times: dict[str, np.ndarray]
    shape: dict[str, Any]

    def layer_shape(self, tp: int) -> LayerShape:
        s = self.shape
        return LayerShape(s["n_embd"], s["n_head"], s["n_kv_head"], s["n_embd"] // s["n_head"],
                          s["n_expanded_embd"], s["vocab_size"], s["use_gated_mlp"], tp, 2)

    @property
    def measured(self) -> np.ndarray:
        """Seconds of each row's operators together."""
        return sum(self.times.values())


def _truthy(text: str) -> bool:
    return text.strip().lower() in ("true", "1")


def read_profiles(root: str | Path) -> list[ProfileTable]:
    """Every ``compute/<gpu>/<org>/<model>/mlp.csv`` under ``root``; rows repeated for one (tokens, degree) are
    merged by their median. Raises ``ValueError`` if there are none."""
    root = Path(root)
    files = sorted(root.glob("compute/*/*/*/mlp.csv"))
    if not files:
        raise ValueError(f"no compute/<gpu>/<org>/<model>/mlp.csv under {root}")
    tables = []
    for path in files:
        with path.open() as f:
            rows = list(csv.DictReader(f))
        ops = [op for op in OPERATORS if f"time_stats.{op}.median" in rows[0]]
        groups: dict[tuple[int, int], list[dict[str, str]]] = defaultdict(list)
        for r in rows:
            groups[(int(r["num_tokens"]), int(r["num_tensor_parallel_workers"]))].append(r)
        keys = sorted(groups)
        times = {op: np.array([statistics.median(float(r[f"time_stats.{op}.median"]) for r in groups[k])
                               for k in keys]) * MS for op in ops}
        first = rows[0]
        shape = {k: int(first[k]) for k in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size")}
        shape["use_gated_mlp"] = _truthy(first["use_gated_mlp"])
        tables.append(ProfileTable(path.parts[-4], path.parts[-2], np.array([k[0] for k in keys], dtype=float),
                                   np.array([k[1] for k in keys]), times, shape))
    return tables


def _operator_rows(tables: Sequence[ProfileTable]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per family: the basis rows of every (table, row, operator) and their measured seconds."""
    rows: dict[str, list[np.ndarray]] = defaultdict(list)
    ys: dict[str, list[np.ndarray]] = defaultdict(list)
    for t in tables:
        for tp in np.unique(t.tensor_parallel):
            mask = t.tensor_parallel == tp
            shape = t.layer_shape(int(tp))
            for op, y in t.times.items():
                rows[family(op)].append(operator_terms(op, t.tokens[mask], shape))
                ys[family(op)].append(y[mask])
    return {f: (np.vstack(rows[f]), np.concatenate(ys[f])) for f in rows}


def fit_families(tables: Sequence[ProfileTable]) -> dict[str, tuple[float, ...]]:
    """Non-negative coefficients per operator family, minimising the squared relative error of every measured
    operator time (columns scaled to unit norm for conditioning; rows with a zero time are left out)."""
    out = {}
    for fam, (a, y) in _operator_rows(tables).items():
        keep = y > 0
        a, y = a[keep] / y[keep, None], y[keep]
        scale = np.linalg.norm(a, axis=0)
        scale[scale == 0] = 1.0
        out[fam] = tuple(float(v) for v in nnls(a / scale, np.ones(len(y))) / scale)
    return out


@dataclass(slots=True)
class CollectiveRows:
    """One collective at one number of GPUs: message bytes (sorted), the median seconds of each size and whether
    that size's repetitions agree (``stable``: the spread of its timed repetitions, max - min, is at most
    ``UNSTABLE_SPREAD`` of its median; files without min/max columns count as stable)."""

    nbytes: np.ndarray
    seconds: np.ndarray
    stable: np.ndarray


UNSTABLE_SPREAD = 0.2
"""A measured size whose repetitions spread by more than this fraction of their median (max - min) is a
measurement that disagrees with itself by more than twice the 10 % target: the fit keeps it (through a running
median), and its error is reported apart (docs/results/gpu_calibration.md, "Collectives")."""
COLLECTIVE_WINDOW = 5
COLLECTIVE_TOLERANCE = 0.03


def read_collective_rows(path: str | Path) -> dict[int, CollectiveRows]:
    """A Vidur network file: per number of GPUs, message bytes (``2 * size``: float16 elements), the median
    seconds (sizes measured twice: the median of both) and whether each size's repetitions agree. Only rows with
    every GPU in one node (``devices_per_node == num_workers``, the tensor-parallel case) count: the files also
    time the same collectives across nodes."""
    by: dict[int, dict[int, list[tuple[float, bool]]]] = defaultdict(lambda: defaultdict(list))
    with Path(path).open() as f:
        reader = csv.DictReader(f)
        col = next(c for c in reader.fieldnames or () if c.startswith("time_stats.") and c.endswith(".median"))
        lo, hi = col.replace(".median", ".min"), col.replace(".median", ".max")
        for r in reader:
            workers = int(r["num_workers"])
            if int(r.get("devices_per_node") or workers) != workers:
                continue
            median = float(r[col])
            stable = not (r.get(lo) and r.get(hi)) or float(r[hi]) - float(r[lo]) <= UNSTABLE_SPREAD * median
            by[workers][2 * int(r["size"])].append((median * MS, stable))
    out = {}
    for w, d in sorted(by.items()):
        sizes = sorted(d)
        out[w] = CollectiveRows(np.array(sizes, dtype=float),
                                np.array([statistics.median(t for t, _ in d[s]) for s in sizes]),
                                np.array([all(ok for _, ok in d[s]) for s in sizes]))
    return out


def read_collective(path: str | Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``read_collective_rows`` as ``(bytes, seconds)`` per number of GPUs, every measured size."""
    return {w: (r.nbytes, r.seconds) for w, r in read_collective_rows(path).items()}


def isotonic(y: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest ``y`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in y:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return np.concatenate([np.full(int(c), m) for m, c in blocks])


def running_median(y: np.ndarray, window: int = COLLECTIVE_WINDOW) -> np.ndarray:
    """Each value replaced by the median of the ``window`` values centred on it (fewer at the ends)."""
    h = window // 2
    return np.array([np.median(y[max(0, i - h):i + h + 1]) for i in range(len(y))])


def knot_indices(x: np.ndarray, y: np.ndarray, tolerance: float = COLLECTIVE_TOLERANCE) -> np.ndarray:
    """The fewest points (greedily, left to right) whose piecewise-linear interpolation stays within
    ``tolerance`` (relative) of every point of ``(x, y)``; always the first and the last."""
    idx, i = [0], 0
    while i < len(x) - 1:
        j = i + 1
        while j + 1 < len(x):
            seg = slice(i, j + 2)
            line = np.interp(x[seg], [x[i], x[j + 1]], [y[i], y[j + 1]])
            if np.max(np.abs(line / y[seg] - 1)) > tolerance:
                break
            j += 1
        idx.append(j)
        i = j
    return np.array(idx)


def fit_collective(measured: dict[int, CollectiveRows | tuple[np.ndarray, np.ndarray]], *,
                   window: int = COLLECTIVE_WINDOW, tolerance: float = COLLECTIVE_TOLERANCE,
                   holdout: bool = False) -> Collective:
    """Per number of GPUs, a table of the measured times against message bytes, as NCCL measured them, dips
    included (a protocol or algorithm switch can make a larger message cheaper; the table does not force the
    curve to be non-decreasing): every measured size's median replaced by the running median of ``window``
    neighbours (an isolated size measured in the other of two states, see ``UNSTABLE_SPREAD``, does not move the
    curve), kept at the fewest knots that interpolate them within ``tolerance``, 4 significant digits.
    holdout: fit on every other measured size only (the rest checks it)."""
    out = {}
    for w, rows in measured.items():
        if not isinstance(rows, CollectiveRows):
            rows = CollectiveRows(rows[0], rows[1], np.ones(len(rows[0]), dtype=bool))
        keep = np.ones(len(rows.nbytes), dtype=bool)
        if holdout:
            keep[1::2] = False
        x, y = rows.nbytes[keep], rows.seconds[keep]
        if len(x) < 2:
            raise ValueError(f"all-reduce/send-recv over {w} GPUs: {len(x)} usable sizes, need at least 2")
        smooth = running_median(y, window)
        idx = knot_indices(x, smooth, tolerance)
        out[w] = (tuple(int(v) for v in x[idx]), tuple(float(f"{v:.4g}") for v in smooth[idx]))
    return Collective(out)


def collective_errors(curve: Collective, measured: dict[int, tuple[np.ndarray, np.ndarray]]
                      ) -> dict[int, np.ndarray]:
    """Per number of GPUs: ``predicted / measured - 1`` at every measured size."""
    return {w: np.array([curve.time(b, w) for b in x]) / y - 1 for w, (x, y) in measured.items()}


def network_dir(root: str | Path, gpu: str) -> Path:
    """The 8-GPU node's (NVSwitch) measurements of ``gpu``: ``network/<gpu>_dgx``."""
    return Path(root) / "network" / f"{gpu}_dgx"


def fit_calibration(tables: Sequence[ProfileTable], network: str | Path, *, source: str = "",
                    holdout: bool = False) -> GpuCalibration:
    """A ``GpuCalibration`` of one GPU from its model files and its network directory."""
    gpus = {t.gpu for t in tables}
    if len(gpus) != 1:
        raise ValueError(f"fit one GPU at a time, got {sorted(gpus)}")
    network = Path(network)
    meta = {"source": source, "models": sorted(t.model for t in tables),
            "rows": int(sum(len(t.tokens) for t in tables)), "schema": CALIBRATION_SCHEMA}
    return GpuCalibration(gpus.pop(), fit_families(tables),
                          fit_collective(read_collective_rows(network / "all_reduce.csv"), holdout=holdout),
                          fit_collective(read_collective_rows(network / "send_recv.csv"), holdout=holdout), meta)


def predict_rows(calibration: GpuCalibration, table: ProfileTable) -> np.ndarray:
    """Predicted seconds of each row of ``table`` (the operators it has, summed)."""
    out = np.zeros(len(table.tokens))
    for tp in np.unique(table.tensor_parallel):
        mask = table.tensor_parallel == tp
        out[mask] = calibration.layer_time(table.tokens[mask], table.layer_shape(int(tp)), tuple(table.times))
    return out


def roofline_rows(hw: Hardware, table: ProfileTable, flops_efficiency: float = 0.7,
                  bandwidth_efficiency: float = 0.85) -> np.ndarray:
    """Each row's layer time by the uncalibrated roofline formula (``RooflineCostModel``'s defaults): a
    projection takes ``max(FLOPs / attainable FLOP/s, bytes / attainable bandwidth)``, an element-wise operator
    its bytes over the attainable bandwidth."""
    flops, bandwidth = hw.peak_flops * flops_efficiency, hw.memory_bandwidth * bandwidth_efficiency
    out = np.zeros(len(table.tokens))
    for tp in np.unique(table.tensor_parallel):
        mask = table.tensor_parallel == tp
        shape = table.layer_shape(int(tp))
        for op in table.times:
            terms = operator_terms(op, table.tokens[mask], shape)
            if family(op) == "gemm":
                out[mask] += np.maximum(terms[:, 4] / flops, (terms[:, 1] + terms[:, 2]) / bandwidth)
            else:
                out[mask] += terms[:, 1] / bandwidth
    return out


def error_summary(errors: np.ndarray) -> dict[str, float]:
    """Median signed, and median / p90 / worst absolute relative error."""
    a = np.abs(errors)
    return {"n": int(len(errors)), "median": float(np.median(errors)), "abs_median": float(np.median(a)),
            "abs_p90": float(np.percentile(a, 90)), "abs_max": float(a.max())}
