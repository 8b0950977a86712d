"""Figures of serving results (matplotlib, imported only when a figure is drawn; no torch).

``plot_results(results, "bench.png")`` draws, for a list of ``BenchResult``:

- TTFT (P50) against P99 TBT, one point per configuration: the trade-off the chunk size tunes;
- the CDF of every TBT gap, one line per configuration: stalls are the long right tails;
- per configuration, the token timeline: one bar per iteration spanning its step time, its height the prefill
  tokens stacked on the decode tokens it ran. A prefill-only stall shows as a wide bar with no decode part.

``plot_capacity(found, "capacity.png")`` draws each capacity search's probes: P99 TBT and median scheduling
delay against the rate, with the SLO bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_lite.bench.capacity import CapacityResult
from sarathi_lite.bench.results import BenchResult

DECODE_COLOR = "tab:blue"
PREFILL_COLOR = "tab:orange"


def plot_tradeoff(results: Sequence[BenchResult], ax: Any) -> None:
    """P50 TTFT (s) against P99 TBT (ms, log scale), one labelled point per result."""
    for r in results:
        s = r.summary()
        if s["tbt_p99"] is None or s["ttft_p50"] is None:
            continue
        ax.scatter(1000 * s["tbt_p99"], s["ttft_p50"], s=30)
        ax.annotate(r.label, (1000 * s["tbt_p99"], s["ttft_p50"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    _log_ms_axis(ax)
    ax.set_xlabel("P99 TBT (ms)")
    ax.set_ylabel("P50 TTFT (s)")
    ax.set_title("TTFT vs P99 TBT")
    ax.grid(alpha=0.3)


def plot_tbt_cdf(results: Sequence[BenchResult], ax: Any) -> None:
    """Empirical CDF of all TBT gaps (ms) per result, log-scaled time axis."""
    for r in results:
        gaps = np.sort([1000 * g for m in r.stats.requests for g in m.tbt])
        if gaps.size:
            ax.step(gaps, np.arange(1, gaps.size + 1) / gaps.size, where="post", label=r.label)
    _log_ms_axis(ax)
    ax.set_xlabel("TBT (ms)")
    ax.set_ylabel("fraction of token gaps")
    ax.set_title("TBT CDF")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def _log_ms_axis(ax: Any) -> None:
    """A log-scaled x axis labelled 50, 100, 200, 500, ... in plain numbers."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_timeline(result: BenchResult, ax: Any) -> None:
    """Tokens per iteration over time (s from the first iteration): decode tokens, prefill tokens on top."""
    its = result.stats.iterations
    if not its:
        return
    t0 = its[0].start_time
    left = np.array([it.start_time - t0 for it in its])
    width = np.array([it.step_time for it in its])
    decode = np.array([it.num_decode_tokens for it in its])
    prefill = np.array([it.num_prefill_tokens for it in its])
    ax.bar(left, decode, width=width, align="edge", color=DECODE_COLOR, label="decode tokens", linewidth=0)
    ax.bar(left, prefill, width=width, bottom=decode, align="edge", color=PREFILL_COLOR, label="prefill tokens",
           linewidth=0)
    ax.set_ylabel("tokens / iteration")
    ax.set_title(f"{result.label}: token timeline", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")


def plot_results(results: Sequence[BenchResult], path: str | Path, max_timelines: int = 6,
                 timeline_window: float | None = None) -> Path:
    """Draw the trade-off, the TBT CDF and up to ``max_timelines`` token timelines (the first results) into one
    PNG at ``path``; returns the path. timeline_window: show only the first this many seconds of each timeline
    (``None``: all)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = list(results)[:max_timelines]
    fig = plt.figure(figsize=(12, 4 + 2.2 * len(shown)), layout="constrained")
    grid = fig.add_gridspec(1 + len(shown), 2, height_ratios=[4] + [2.2] * len(shown))
    plot_tradeoff(results, fig.add_subplot(grid[0, 0]))
    plot_tbt_cdf(results, fig.add_subplot(grid[0, 1]))
    axes: list[Any] = []
    for i, r in enumerate(shown):
        axes.append(fig.add_subplot(grid[1 + i, :], sharex=axes[0] if axes else None))
        plot_timeline(r, axes[-1])
    if axes:
        axes[-1].set_xlabel("time since the first iteration (s)")
        axes[0].set_xlim(0, timeline_window)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_capacity(found: Sequence[CapacityResult], path: str | Path) -> Path:
    """P99 TBT (ms) and median scheduling delay (s) of every probe against its rate (requests/s), one line per
    configuration, with the SLO bounds dashed and each capacity marked; writes a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tbt_ax, delay_ax) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    for c in found:
        probes = sorted(c.probes, key=lambda p: p.qps)
        qps = [p.qps for p in probes]
        line, = tbt_ax.plot(qps, [_ms(p.tbt_p99) for p in probes], marker="o", label=c.label)
        delay_ax.plot(qps, [p.scheduling_delay_p50 for p in probes], marker="o", color=line.get_color(),
                      label=c.label)
        if c.capacity is not None:
            tbt_ax.axvline(c.capacity, color=line.get_color(), alpha=0.4, linestyle=":")
    if found:
        tbt_ax.axhline(1000 * found[0].slo.tbt_p99, color="black", linestyle="--", label="SLO")
        delay_ax.axhline(found[0].slo.scheduling_delay_p50, color="black", linestyle="--", label="bound")
    tbt_ax.set_yscale("log")
    tbt_ax.set(xlabel="arrival rate (requests/s)", ylabel="P99 TBT (ms)", title="P99 TBT per probe (dotted: capacity)")
    delay_ax.set(xlabel="arrival rate (requests/s)", ylabel="median scheduling delay (s)",
                 title="median scheduling delay per probe")
    for ax in (tbt_ax, delay_ax):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else 1000 * seconds
