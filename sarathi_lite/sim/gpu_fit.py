"""Fit ``GpuCalibration``s (``sarathi_lite.costs.calibrated``) to a directory of measured GPU timings laid out
like Vidur's ``data/profiling`` (``compute/<gpu>/<org>/<model>/mlp.csv``, ``network/<gpu>_dgx/all_reduce.csv``
and ``send_recv.csv``; times in milliseconds), and measure how well they predict it.

- ``read_profiles(root)``: every model file as a ``ProfileTable`` (the median of repeated rows);
- ``fit_calibration(tables, network)``: per operator family, non-negative least squares on the squared relative
  error of every operator's time (so a 10 us decode kernel counts as much as a 10 ms prefill one); the
  collectives' curves at log-spaced message sizes;
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
COLLECTIVE_KNOTS = 80
"""Log-spaced (and as many evenly spaced) message sizes kept per measured collective curve (4 kB to 128 MB in
Vidur's files)."""


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


def read_collective(path: str | Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """A Vidur network file: per number of GPUs, message bytes (``2 * size``: float16 elements) and the median
    seconds of repeated rows, sorted by size. Only rows with every GPU in one node (``devices_per_node ==
    num_workers``, the tensor-parallel case) count: the files also time the same collectives across nodes."""
    by: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    with Path(path).open() as f:
        reader = csv.DictReader(f)
        col = next(c for c in reader.fieldnames or () if c.startswith("time_stats.") and c.endswith(".median"))
        for r in reader:
            workers = int(r["num_workers"])
            if int(r.get("devices_per_node") or workers) != workers:
                continue
            by[workers][2 * int(r["size"])].append(float(r[col]) * MS)
    return {w: (np.array(sorted(d), dtype=float), np.array([statistics.median(d[s]) for s in sorted(d)]))
            for w, d in sorted(by.items())}


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


def fit_collective(measured: dict[int, tuple[np.ndarray, np.ndarray]], knots: int = COLLECTIVE_KNOTS,
                   holdout: bool = False) -> Collective:
    """Per number of GPUs: the measured times made non-decreasing in size (``isotonic``: a larger message never
    costs less; where NCCL switches protocol a measured curve dips, and the fit averages the dip), kept at
    ``knots`` log-spaced and as many evenly spaced sizes (the files measure sizes evenly, and the large ones
    matter for prefills), 4 significant digits. holdout: fit on every other measured size only (the rest
    checks it)."""
    out = {}
    for w, (x, y) in measured.items():
        if holdout:
            x, y = x[::2], y[::2]
        mono = isotonic(y)
        targets = np.union1d(np.geomspace(x[0], x[-1], knots), np.linspace(x[0], x[-1], knots))
        idx = np.unique(np.searchsorted(x, targets).clip(0, len(x) - 1))
        out[w] = (tuple(float(v) for v in x[idx]), tuple(float(f"{v:.4g}") for v in mono[idx]))
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
                          fit_collective(read_collective(network / "all_reduce.csv"), holdout=holdout),
                          fit_collective(read_collective(network / "send_recv.csv"), holdout=holdout), meta)


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
