"""A serving benchmark's result: what ran (configuration, workload) and what it recorded (``Stats``).

Torch-free, so the real-time replay (``sarathi_lite.bench.replay``) and a simulator produce the same object and the same
JSON schema. Metric definitions are those of ``sarathi_lite.metrics``; nothing here recomputes them.

>>> result.summary()["tbt_p99"]              # seconds
>>> result.to_json("sarathi.json"); BenchResult.from_json("sarathi.json")
>>> print(compare([sarathi, vllm]))           # one table row per configuration
"""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sarathi_lite.bench.workload import Workload
from sarathi_lite.metrics import IterationRecord, RequestMetrics, Stats
from sarathi_lite.scheduler import CHUNKED_POLICIES, SchedulerConfig

SCHEMA = "sarathi-lite/bench-result/1"


class Stopped(KeyboardInterrupt):
    """A long run stopped early (Ctrl-C, or SIGTERM under the CLI) carrying what it had finished: ``partial``
    (the same kind of value the run returns, or raw measurements where nothing whole was finished; ``None`` when
    nothing was) and ``progress``, how far it got in words (``"3 of 8 configurations"``). A ``KeyboardInterrupt``,
    so a caller that does not look for partial results stops as before."""

    def __init__(self, partial: Any, progress: str) -> None:
        super().__init__(progress)
        self.partial = partial
        self.progress = progress


def config_label(policy: str, chunk_size: int | str | None) -> str:
    """``"sarathi/256"`` for chunked policies; the policy alone for the others (their chunk size is unused)."""
    return f"{policy}/{chunk_size}" if policy in CHUNKED_POLICIES else policy


def configurations(policies: Sequence[str], chunk_sizes: Sequence[int]) -> list[tuple[str, int | None]]:
    """``(policy, chunk_size)`` pairs to run: each chunked policy at every chunk size, every other policy once
    (chunk size ``None``: it does not chunk)."""
    pairs: list[tuple[str, int | None]] = []
    for policy in policies:
        pairs += [(policy, c) for c in chunk_sizes] if policy in CHUNKED_POLICIES else [(policy, None)]
    return pairs


def host() -> str:
    """A one-line description of this machine (architecture, processor, CPU count), without torch."""
    return f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} CPUs"


def cpu_description(threads: int) -> str:
    """This machine in words for a CPU benchmark (no paths): ``host()``, the CPU model, the SIMD extensions
    bfloat16 speed depends on, and the thread count the run used."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{host()}; {model or platform.processor()}; {'/'.join(simd) or 'no AVX2'}; {threads} threads"


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages (/proc/loadavg; ``os.getloadavg`` where there is none)."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return [round(x, 2) for x in os.getloadavg()]


def portable_arg(arg: str) -> str:
    """A command-line argument as a result may hold it: a path inside this checkout relative to its root, any
    other absolute path by its name only (results carry no path of the machine they ran on)."""
    path, root = Path(arg), Path(__file__).resolve().parents[2]
    if not path.is_absolute():
        return arg
    return str(path.relative_to(root)) if path.is_relative_to(root) else path.name


def commit() -> str | None:
    """The short hash of the sarathi-lite checkout's ``HEAD`` (a ``-dirty`` suffix when tracked files differ
    from it), for a benchmark's record of the code it ran; ``None`` outside a git checkout. Take it before the
    run: a commit made while it runs is not what ran."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def run_config(cfg: SchedulerConfig, chunk_size: int | str | None, *, model: str | None, dtype: str | None,
               device: str | None, attention_backend: str | None) -> dict[str, Any]:
    """The configuration record of a result: policy, chunk size (``None`` means ``cfg.chunk_size`` for chunked
    policies and stays ``None`` for unchunked ones), the token budget (the most per iteration) and, for
    ``chunk_size="auto"``, its TBT target ``tbt_slo``, the KV pool, whether head-of-line protection ran, and the
    model and engine settings that shape timing (for a simulation: what it models)."""
    if chunk_size is None and cfg.policy in CHUNKED_POLICIES:
        chunk_size = cfg.chunk_size
    return {"label": config_label(cfg.policy, chunk_size), "policy": cfg.policy, "chunk_size": chunk_size,
            "token_budget": cfg.token_budget, "tbt_slo": cfg.tbt_slo if cfg.auto_budget else None,
            "max_num_seqs": cfg.max_num_seqs, "block_size": cfg.block_size,
            "num_kv_blocks": cfg.num_blocks, "max_model_len": cfg.max_model_len,
            "enable_prefix_caching": cfg.enable_prefix_caching, "hol_protection": cfg.protects_short_prompts,
            "model": model, "dtype": dtype,
            "device": device, "attention_backend": attention_backend}


@dataclass(slots=True)
class BenchResult:
    """One configuration run on one workload.

    config: at least ``policy`` and ``chunk_size``; also the model and engine options that were used.
    workload: exactly what was replayed. stats: the per-request and per-iteration records.
    meta: how it ran (``replay``: ``"real-time"`` or ``"simulated"``; date, machine, load average, wall time).
    """

    config: dict[str, Any]
    workload: Workload
    stats: Stats
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.config.get("label") or config_label(self.config["policy"], self.config["chunk_size"])

    def summary(self) -> dict[str, Any]:
        """``Stats.summary()`` (seconds, tokens/s, requests/s) with the configuration's label, policy, chunk
        size and the workload's offered rate ``qps`` (requests/s) in front."""
        return {"label": self.label, "policy": self.config["policy"], "chunk_size": self.config["chunk_size"],
                "qps": self.workload.qps, **self.stats.summary()}

    # ------------------------------------------------------------------ files and frames

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``summary`` is included for readers and recomputed on load."""
        return {"schema": SCHEMA, "config": self.config, "meta": self.meta, "summary": self.summary(),
                "workload": self.workload.to_dict(),
                "requests": [asdict(r) for r in self.stats.requests],
                "iterations": [asdict(it) for it in self.stats.iterations]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchResult:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} record (schema={d.get('schema')!r})")
        requests = [RequestMetrics(**r) for r in d["requests"]]
        iterations = [IterationRecord(**{**it, "batch": tuple(tuple(b) for b in it["batch"]),
                                         "stage_busy": tuple(it.get("stage_busy", ()))})
                      for it in d["iterations"]]
        return cls(dict(d["config"]), Workload.from_dict(d["workload"]), Stats(requests, iterations),
                   dict(d.get("meta", {})))

    def to_json(self, path: str | Path | None = None) -> str:
        """The JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> BenchResult:
        """From JSON text or a path to a JSON file."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            text = Path(source).read_text()
        return cls.from_dict(json.loads(text))

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        """Rows of ``requests`` (one per request, ``RequestMetrics.as_dict``), ``iterations`` (one per forward
        pass, ``IterationRecord.as_dict``) and ``tbt`` (one per token gap: request, index of the later token,
        gap in seconds), each row led by the configuration's label."""
        label = self.label
        tbt = [{"label": label, "request_id": r.request_id, "token_index": i + 1, "tbt": gap}
               for r in self.stats.requests for i, gap in enumerate(r.tbt)]
        return {"requests": [{"label": label, **r.as_dict()} for r in self.stats.requests],
                "iterations": [{"label": label, **it.as_dict()} for it in self.stats.iterations],
                "tbt": tbt}

    def to_csv(self, prefix: str | Path) -> list[Path]:
        """Write ``<prefix>_requests.csv``, ``<prefix>_iterations.csv`` and ``<prefix>_tbt.csv``; returns them."""
        paths = []
        for name, rows in self.tables().items():
            path = Path(f"{prefix}_{name}.csv")
            _write_csv(path, rows)
            paths.append(path)
        return paths

    def to_pandas(self) -> dict[str, Any]:
        """``{"requests", "iterations", "tbt"}`` DataFrames (needs pandas); ``pd.concat`` several results' frames
        to compare them, the ``label`` column tells them apart."""
        import pandas as pd

        return {name: pd.DataFrame(rows) for name, rows in self.tables().items()}


# ---------------------------------------------------------------------- several results

_COLUMNS = (  # header, summary key, scale, format
    ("config", "label", None, "{}"),
    ("req/s", "throughput_requests_per_s", 1, "{:.2f}"),
    ("tok/s", "throughput_tokens_per_s", 1, "{:.0f}"),
    ("out tok/s", "throughput_output_tokens_per_s", 1, "{:.1f}"),
    ("TTFT p50 s", "ttft_p50", 1, "{:.2f}"),
    ("p90", "ttft_p90", 1, "{:.2f}"),
    ("p99", "ttft_p99", 1, "{:.2f}"),
    ("TBT p50 ms", "tbt_p50", 1000, "{:.0f}"),
    ("p90", "tbt_p90", 1000, "{:.0f}"),
    ("p99", "tbt_p99", 1000, "{:.0f}"),
    ("sched p50 s", "scheduling_delay_p50", 1, "{:.2f}"),
    ("p90", "scheduling_delay_p90", 1, "{:.2f}"),
    ("p99", "scheduling_delay_p99", 1, "{:.2f}"),
    ("preempt", "num_preemptions", 1, "{}"),
)


def compare(results: Sequence[BenchResult]) -> str:
    """A text table, one row per result: throughput (requests/s, tokens/s), TTFT (s), TBT (ms) and scheduling
    delay (s) at p50/p90/p99, preemptions."""
    rows = [[_cell(r.summary(), key, scale, fmt) for _, key, scale, fmt in _COLUMNS] for r in results]
    header = [h for h, *_ in _COLUMNS]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    return "\n".join(lines)


def compare_markdown(results: Sequence[BenchResult]) -> str:
    """``compare`` as a Markdown table (for docs)."""
    header = [h for h, *_ in _COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for r in results:
        s = r.summary()
        lines.append("| " + " | ".join(_cell(s, key, scale, fmt) for _, key, scale, fmt in _COLUMNS) + " |")
    return "\n".join(lines)


def _cell(summary: dict[str, Any], key: str, scale: float | None, fmt: str) -> str:
    value = summary.get(key)
    if value is None:
        return "-"
    return fmt.format(value * scale if scale is not None else value)


def save_results(results: Sequence[BenchResult], out_dir: str | Path) -> list[Path]:
    """Write each result as ``<label>.json`` and its CSVs (``to_csv``) and ``summary.csv`` (one row per result)
    to ``out_dir``; returns the paths. Labels become file names with ``/`` replaced by ``_``. (The figure:
    ``sarathi_lite.bench.plots.plot_results``.)"""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in results:
        stem = out / re.sub(r"[^A-Za-z0-9_.-]+", "_", r.label)
        paths.append(stem.with_name(stem.name + ".json"))  # a label may hold a dot (vllm@0.34/512)
        r.to_json(paths[-1])
        paths += r.to_csv(stem)
    paths.append(out / "summary.csv")
    _write_csv(paths[-1], [r.summary() for r in results])
    return paths


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
