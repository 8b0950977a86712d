"""The plan as text (the ranked table, the commands of the top entries) and as a figure (``plot``)."""

from __future__ import annotations

import shlex
from pathlib import Path

from sarathi_lite.plan.search import Entry, Plan
from sarathi_lite.plan.space import Candidate, Setup, llm_text


def _rate(entry: Entry) -> str:
    held, failing = entry.bracket()
    if entry.error:
        return "error"
    if held is None:
        return "0 (fails at the lowest rate)"
    if failing is None:
        return f">= {held / entry.num_gpus:.2f}"
    return f"{held / entry.num_gpus:.2f}-{failing / entry.num_gpus:.2f}"


def _pricing(setup: Setup) -> str:
    if setup.profile is not None:
        return f"measured profile {Path(setup.profile).name}"
    return "calibrated" if setup.calibrated else "analytic roofline"


def table(result: Plan, top: int | None = None) -> str:
    """The ranking as a markdown table: rank, configuration, GPUs, goodput per GPU (requests/s), the bracket the
    probes left (per GPU), what limits it, whether it was refined, and the ``serve`` arguments."""
    s = result.setup
    lines = [f"Plan: {s.model} on {s.gpus} x {s.gpu} ({_pricing(s)}), "
             f"SLOs TTFT {s.ttft:g} s and P99 TBT {s.tbt * 1000:g} ms for {s.attainment:.0%} of requests; "
             f"{result.workload}; {len(result.entries)} candidates, {result.num_probes} probes, "
             f"{result.wall_time:.0f} s", "",
             "| # | configuration | GPUs | goodput req/s/GPU | bracket | limited by | refined | sarathi-lite "
             "arguments |", "|---|---|---|---|---|---|---|---|"]
    for i, e in enumerate(result.entries[:top] if top else result.entries, 1):
        run = result.launch(e)
        args = f"`{shlex.join(['sarathi-lite', *run['serve']])}`" + (f" (note: {run['note']})" if run["note"] else "")
        lines.append(f"| {i} | {e.label} | {e.num_gpus} | {e.goodput:.2f} | {_rate(e)} | "
                     f"{e.error or e.limiting} | {'yes' if e.refined else 'no'} | {args} |")
    lines += ["", "bracket: the last probed rate that met the SLOs and the first that did not (per GPU); the "
              "goodput is interpolated inside it. refined: yes if fine probes narrowed the bracket; no if its "
              "first failing rate was already at or below the best entry's last holding rate (it cannot win)."]
    lines += [f"Ranks {first}-{last} share the bracket {bracket}: their order is interpolation inside it, not a "
              f"measured difference (a tie)." for first, last, bracket in ties(result, top)]
    if result.skipped:
        lines += ["", "Did not fit: " + "; ".join(f"{shape}: {why}" for shape, why in result.skipped)]
    return "\n".join(lines)


def ties(result: Plan, top: int | None = None) -> list[tuple[int, int, str]]:
    """Runs of consecutive entries (ranks from 1, within ``top``) whose brackets are the same: ``(first rank,
    last rank, the bracket as the table shows it)``."""
    shown = result.entries[:top] if top else result.entries
    runs: list[tuple[int, int, str]] = []
    for rank, entry in enumerate(shown, 1):
        bracket = _rate(entry)
        if runs and runs[-1][2] == bracket and runs[-1][1] == rank - 1:
            runs[-1] = (runs[-1][0], rank, bracket)
        else:
            runs.append((rank, rank, bracket))
    return [r for r in runs if r[1] > r[0] and "-" in r[2]]


def summary(results: list[Plan]) -> str:
    """One row per SLO pair (``plan_slos``): the best entry, and the best of each organization with its goodput
    per GPU as a ratio to the best."""
    kinds = sorted({organization(e.candidate) for r in results for e in r.entries})
    lines = ["| TTFT SLO | P99 TBT SLO | best | goodput req/s/GPU | " + " | ".join(f"best {k}" for k in kinds) + " |",
             "|---" * (4 + len(kinds)) + "|"]
    for r in results:
        best = r.best
        cells = []
        for k in kinds:
            top = next((e for e in r.entries if organization(e.candidate) == k), None)
            ratio = "" if top is None or not best.goodput else f" ({top.goodput / best.goodput:.2f}x)"
            cells.append("-" if top is None else f"{top.label} {top.goodput:.2f}{ratio}")
        lines.append(f"| {r.setup.ttft:g} s | {r.setup.tbt * 1000:g} ms | {best.label} | {best.goodput:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def commands(result: Plan, top: int = 3) -> str:
    """The ``LLM(...)`` call and the ``serve`` command of the ``top`` entries."""
    out = []
    for i, e in enumerate(result.entries[:top], 1):
        run = result.launch(e)
        out += [f"{i}. {e.label}: {e.goodput:.2f} req/s/GPU", f"   {llm_text(run['llm'])}",
                f"   {shlex.join(['sarathi-lite', *run['serve']])}"]
        if run["note"]:
            out.append(f"   note: {run['note']}")
    return "\n".join(out)


def organization(cand: Candidate) -> str:
    """``"colocated"``, ``"disaggregated"``, ``"conditional"`` or ``"hybrid"``: what the plot colours it by."""
    if cand.colocated:
        return "colocated"
    if cand.hybrid is not None:
        return "hybrid"
    return "conditional" if cand.threshold is not None else "disaggregated"


def plot(result: Plan, path: str | Path, top: int | None = 20) -> Path:
    """A horizontal bar per entry (best at the top): goodput per GPU, colored by organization (colocated,
    disaggregated, conditional, hybrid), the bracket as an error bar. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = result.entries[:top] if top else result.entries
    colors = {"colocated": "tab:blue", "disaggregated": "tab:orange", "conditional": "tab:green",
              "hybrid": "tab:red"}
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(entries) + 1.5))
    for y, e in enumerate(reversed(entries)):
        org = organization(e.candidate)
        held, failing = e.bracket()
        err = None
        if held is not None and failing is not None:
            g = e.goodput
            err = [[g - held / e.num_gpus], [failing / e.num_gpus - g]]
        ax.barh(y, e.goodput, color=colors[org], xerr=err, capsize=2,
                label=org if org not in ax.get_legend_handles_labels()[1] else None)
    ax.set_yticks(range(len(entries)), [e.label for e in reversed(entries)], fontsize=8)
    s = result.setup
    ax.set_xlabel("goodput per GPU (requests/s)")
    ax.set_title(f"{s.model}, {s.gpus} x {s.gpu}: TTFT {s.ttft:g} s, P99 TBT {s.tbt * 1000:g} ms, "
                 f"{s.attainment:.0%}", fontsize=9)
    # beside the axes, not on them: the best entries' bars and brackets reach the right edge
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
