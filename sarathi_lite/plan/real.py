"""``plan --real``: run the planner's top entries on this machine and check that they rank as planned.

A plan made with a measured ``profile`` (``sarathi-lite profile`` on this CPU) prices instances that this
machine can run: every instance a process with ``threads`` torch threads (``engine.instances.ProcessEngine``, as
``benchmarks/disagg_real.py`` runs them). ``confirm`` runs each of the top entries, with the arguments the plan
prints for it (``space.launch``), on the same requests in real time at every rate the plan names as one of their
goodputs (requests/s over the deployment), and measures the share of requests meeting both SLOs. The real runs
agree with the plan when, at every rate, an entry ranked higher attains at least as much as one ranked lower;
each entry is also checked against the attainment target at its own planned goodput.

    result = plan(setup, workload)              # setup.profile: this machine's profile
    print(confirm(result, workload, top=2).table())

Torch is needed here (the real engine); ``sarathi_lite.plan``'s other modules stay torch-free.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from sarathi_lite.bench.workload import Workload
from sarathi_lite.metrics import slo_arrays, slo_shares
from sarathi_lite.plan.search import Entry, Plan
from sarathi_lite.scheduler.routing import Layout


@dataclass(slots=True)
class RealRun:
    """One entry at one rate: what share of the requests met both SLOs (and each), the worst TTFT and P99 TBT of
    a request, how many finished, and the load average before the run."""

    label: str
    rate: float
    attainment: float
    ttft_share: float
    tbt_share: float
    ttft_max: float
    tbt_p99_max: float
    finished: int
    requests: int
    wall_time: float
    loadavg: float


@dataclass(slots=True)
class Confirmation:
    """The real runs of ``labels`` (the plan's order) at ``rates`` (requests/s over the deployment)."""

    labels: list[str]
    planned: dict[str, float]
    """label -> the plan's goodput, requests/s over the deployment."""
    rates: list[float]
    target: float
    runs: list[RealRun] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def run(self, label: str, rate: float) -> RealRun:
        return next(r for r in self.runs if r.label == label and r.rate == rate)

    @property
    def agrees(self) -> bool:
        """At every rate, attainment does not rise down the plan's order."""
        return all(self.run(a, rate).attainment >= self.run(b, rate).attainment
                   for rate in self.rates for a, b in zip(self.labels, self.labels[1:]))

    def table(self) -> str:
        head = "| configuration | planned goodput req/s | " + " | ".join(f"{r:.3g} req/s" for r in self.rates) + " |"
        lines = [head, "|---" * (2 + len(self.rates)) + "|"]
        for label in self.labels:
            cells = [f"{self.run(label, r).attainment:.0%}" for r in self.rates]
            lines.append(f"| {label} | {self.planned[label]:.3g} | " + " | ".join(cells) + " |")
        verdict = "agrees with" if self.agrees else "does NOT agree with"
        lines.append(f"\nShare of requests meeting both SLOs, measured (target {self.target:.0%}); the real order "
                     f"{verdict} the plan's." + "".join(f"\nnot run: {lab}: {why}" for lab, why in self.skipped))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"labels": self.labels, "planned_goodput": self.planned, "rates": self.rates, "target": self.target,
                "agrees": self.agrees, "runs": [asdict(r) for r in self.runs], "skipped": self.skipped}


def runnable(entry: Entry, cpus: int | None = None) -> str | None:
    """Why ``entry`` cannot run on this machine's ``cpus`` (default: the CPU count), or ``None``."""
    cand, cpus = entry.candidate, cpus or os.cpu_count() or 1
    if entry.error:
        return f"it failed in the plan: {entry.error}"
    if cand.tp * cand.pp > 1:
        return "instances as processes run tensor/pipeline degree 1 only"
    if cand.instances > cpus:
        return f"{cand.instances} instances need {cand.instances} CPUs; this machine has {cpus}"
    return None


def confirm(result: Plan, workload: Workload, *, top: int = 2, num_requests: int = 60, threads: int = 1,
            rates: list[float] | None = None, progress: bool = True) -> Confirmation:
    """Run the ``top`` runnable entries of ``result`` (see the module docstring) on the first ``num_requests`` of
    ``workload`` at ``rates`` (default: each entry's planned goodput over its deployment), ``threads`` torch
    threads per instance. Raises ``ValueError`` when fewer than two entries can run here."""
    if top < 2:
        raise ValueError(f"top={top!r}: comparing needs at least two entries")
    chosen, skipped = [], []
    for e in result.entries:
        why = runnable(e)
        if why is None and e.goodput > 0 and len(chosen) < top:
            chosen.append(e)
        elif len(chosen) < top:
            skipped.append((e.label, why or "no goodput in the plan"))
    if len(chosen) < 2:
        raise ValueError(f"fewer than two of the plan's entries can run here ({skipped})")
    planned = {e.label: e.goodput * e.num_gpus for e in chosen}
    rates = sorted(set(rates or planned.values()))
    out = Confirmation([e.label for e in chosen], planned, rates, result.setup.attainment, skipped=skipped)
    base = Workload(workload.requests[:num_requests], workload.source, workload.seed)
    from sarathi_lite.bench.replay import warm_up_instances  # torch: only when a real run is asked for

    for e in chosen:
        engine = _engine(result, e, threads)
        try:
            warm_up_instances(engine, _vocab(engine))
            for rate in rates:
                out.runs.append(_measure(engine, e.label, base.at_qps(rate), rate, result.setup))
                if progress:
                    r = out.runs[-1]
                    print(f"real {r.label} at {rate:.3g} req/s (load {r.loadavg:.2f}): {r.attainment:.0%} meet "
                          f"both SLOs, {r.finished}/{r.requests} finished, {r.wall_time:.0f} s", flush=True)
        finally:
            engine.shutdown()
    return out


def _engine(result: Plan, entry: Entry, threads: int) -> Any:
    """The deployment of ``entry`` as instance processes, with the plan's own arguments (``space.launch``)."""
    from sarathi_lite.engine.instances import ProcessEngine  # torch: only when a real run is asked for

    cand = entry.candidate
    llm = dict(result.launch(entry)["llm"])
    model = llm.pop("model")
    llm.pop("disaggregation", None)
    llm.pop("data_parallel_size", None)
    prefill = llm.pop("prefill_options", None)
    layout = Layout.parse(cand.layout, threshold=cand.threshold)
    return ProcessEngine(model, instances=layout, prefill_options=prefill, num_threads=threads, device="cpu", **llm)


def _measure(engine: Any, label: str, wl: Workload, rate: float, setup: Any) -> RealRun:
    from sarathi_lite.bench.replay import play

    load = os.getloadavg()[0]
    engine.reset_stats()
    t0 = time.perf_counter()
    play(engine, list(zip(wl.requests, wl.prompt_token_ids(_vocab(engine)))), time.perf_counter)
    requests = engine.stats().requests
    ttft, tbt = slo_arrays(requests)
    return RealRun(label, rate, *slo_shares(ttft, tbt, setup.ttft, setup.tbt),
                   float(max(ttft, default=0.0)), float(max(tbt, default=0.0)),
                   sum(r.finished_time is not None for r in requests), len(wl.requests),
                   time.perf_counter() - t0, load)


def _vocab(engine: Any) -> int:
    return engine.model_config.vocab_size
