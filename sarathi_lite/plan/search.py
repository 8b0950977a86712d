"""The budgeted search: every candidate's goodput per GPU under the setup's SLOs, coarse then fine.

A *probe* simulates a candidate at one request rate: the first requests of the workload (enough for
``PROBE_SECONDS`` of arrivals, at least ``min_requests`` and at most ``max_requests``, as the study's probes) at
that rate, Poisson arrivals, and records the share of requests meeting both SLOs (TTFT and their own P99 time
between tokens; ``DisaggResult.slo_attainment``) and each SLO alone (what limits it).

1. Coarse: per candidate, rates per GPU on the study's grid ``2 ** (k / 2)`` from ``space.start_rate`` up while
   the attainment holds (down while it does not, to the first that holds); this brackets its goodput between
   the last rate that holds and the first that does not.
2. Early stop: a candidate whose first failing rate is at or below the best candidate's last holding rate cannot
   reach the best (its goodput is below its first failure; the best's is at least its last hold), so it is not
   refined; its goodput stays the coarse one, interpolated within its bracket as the study's map does.
3. Fine: the others get ``fine_probes`` more probes, each halving their bracket (geometric midpoints).

The goodput is DistServe's (``sim.disagg.goodput_from`` over every rate probed, in order): the highest rate at
which at least ``attainment`` of the requests meet both SLOs, every lower probed rate meeting it too,
interpolated linearly to the first that does not; per GPU. Each phase's probes run on the sweep backends
(``sim.sweeps.run_tasks``: a process pool by default), one task per candidate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from sarathi_lite.bench.workload import Workload
from sarathi_lite.metrics import slo_shares
from sarathi_lite.plan.space import (
    Candidate,
    Setup,
    cost_model,
    deployment,
    launch,
    scheduler_options,
    space,
    start_rate,
)
from sarathi_lite.sim.disagg import DisaggResult, goodput_from, simulate
from sarathi_lite.sim.simulator import scheduler_config
from sarathi_lite.sim.simulator import simulate as simulate_one
from sarathi_lite.sim.sweeps import run_tasks

PROBE_SECONDS = 15.0
STEP = math.sqrt(2)
MAX_STEPS = 16  # a coarse search gives up after this many grid steps up (or down) from where it started


@dataclass(frozen=True)
class Probe:
    """One simulated rate (requests/s over the whole deployment): the share of requests meeting both SLOs, the
    TTFT SLO alone and the TBT SLO alone, and the probe's request count."""

    rate: float
    attainment: float
    ttft_share: float
    tbt_share: float
    num_requests: int


@dataclass(frozen=True)
class _Task:
    """One candidate's search under every setup of ``setups`` (the same deployment space, each its own SLOs):
    a probe's simulation is run once and judged under each (``_Probes``)."""

    setups: tuple[Setup, ...]
    candidate: Candidate
    workload: Workload
    limits: tuple[int, int]
    start: float = 0.0  # coarse: the first rate per GPU
    brackets: tuple[tuple[float, float] | None, ...] = ()  # fine, per setup: (holding, failing) rates, or None
    num_probes: int = 0


class _Probes:
    """The simulations of one candidate, each run once (by rate) and judged under any setup's SLOs."""

    def __init__(self, task: _Task) -> None:
        self.task = task
        self._runs: dict[float, tuple[np.ndarray, np.ndarray]] = {}

    def at(self, setup: Setup, rate: float) -> Probe:
        if rate not in self._runs:
            result = _simulate(setup, self.task.candidate, self.task.workload, rate, self.task.limits)
            self._runs[rate] = result.per_request()
        return judge(setup, rate, *self._runs[rate])


def probe_workload(workload: Workload, qps: float, min_requests: int, max_requests: int) -> Workload:
    """The first requests of ``workload`` at ``qps`` requests/s: enough for ``PROBE_SECONDS`` of arrivals, at
    least ``min_requests`` and at most ``max_requests`` (the study's probes)."""
    n = min(max(min_requests, math.ceil(qps * PROBE_SECONDS)), max_requests, len(workload.requests))
    return Workload(workload.requests[:n], workload.source, workload.seed).at_qps(qps)


def run_probe(setup: Setup, cand: Candidate, workload: Workload, rate: float, limits: tuple[int, int]) -> Probe:
    """Simulate ``cand`` at ``rate`` requests/s (the whole deployment's) and judge it by ``setup``'s SLOs."""
    return judge(setup, rate, *_simulate(setup, cand, workload, rate, limits).per_request())


def judge(setup: Setup, rate: float, ttft: np.ndarray, tbt: np.ndarray) -> Probe:
    """The probe at ``rate`` whose requests had ``ttft`` and P99 ``tbt`` (``DisaggResult.per_request``), by
    ``setup``'s SLOs."""
    return Probe(rate, *slo_shares(ttft, tbt, setup.ttft, setup.tbt), int(ttft.size))


def _simulate(setup: Setup, cand: Candidate, workload: Workload, rate: float, limits: tuple[int, int]
              ) -> DisaggResult:
    """``cand`` at ``rate``: a pipelined instance on the single-instance simulator (which pipelines
    micro-batches), everything else on ``sim.disagg``."""
    wl = probe_workload(workload, rate, *limits)
    if cand.pp > 1:
        cm = cost_model(setup.model, setup.gpu, cand.tp, cand.pp, setup.profile)
        config = scheduler_config(cm, "sarathi", cand.chunk_size, **scheduler_options(setup, cand.chunk_size))
        one = simulate_one(wl, cm, config, chunk_size=cand.chunk_size)
        return DisaggResult(cand.label, cand.num_gpus, wl, one.stats.requests, {}, [], {})
    return simulate(deployment(setup, cand), wl)


_Found = tuple[Candidate, list[list[Probe]], str | None]
"""A task's outcome: the candidate, its probes per setup (in the order run), an error."""


def _coarse(task: _Task) -> _Found:
    """Per setup, climb (or descend) the grid until the attainment changes side."""
    c, sims = task.candidate, _Probes(task)
    found: list[list[Probe]] = []
    try:
        for s in task.setups:
            probes = [sims.at(s, task.start * c.num_gpus)]
            found.append(probes)
            step = STEP if probes[0].attainment >= s.attainment else 1 / STEP
            for k in range(1, MAX_STEPS + 1):
                p = sims.at(s, task.start * step ** k * c.num_gpus)
                probes.append(p)
                if (p.attainment >= s.attainment) != (step > 1):
                    break
    except (ValueError, RuntimeError) as e:  # a request that does not fit an instance, a pool that cannot finish
        return c, found + [[] for _ in task.setups[len(found):]], str(e)
    return c, found, None


def _fine(task: _Task) -> _Found:
    """Per setup with a bracket, halve it ``num_probes`` times (geometric midpoints)."""
    sims, found = _Probes(task), []
    for s, bracket in zip(task.setups, task.brackets):
        probes: list[Probe] = []
        found.append(probes)
        if bracket is None:
            continue
        lo, hi = bracket
        for _ in range(task.num_probes):
            mid = math.sqrt(lo * hi)
            p = sims.at(s, mid)
            probes.append(p)
            lo, hi = (mid, hi) if p.attainment >= s.attainment else (lo, mid)
    return task.candidate, found, None


@dataclass(slots=True)
class Entry:
    """One candidate's outcome: its probes (sorted by rate), goodput per GPU, whether it was refined, and an error
    when it could not be simulated."""

    candidate: Candidate
    probes: list[Probe]
    attainment: float
    refined: bool = False
    error: str | None = None

    @property
    def label(self) -> str:
        return self.candidate.label

    @property
    def num_gpus(self) -> int:
        return self.candidate.num_gpus

    @property
    def goodput(self) -> float:
        """Requests/s per GPU (``goodput_from`` over the probes); 0 without probes or with an error."""
        if not self.probes or self.error:
            return 0.0
        rates = [p.rate for p in self.probes]
        return goodput_from(rates, [p.attainment for p in self.probes], self.attainment) / self.num_gpus

    def bracket(self) -> tuple[float | None, float | None]:
        """(last rate that holds, first that fails), requests/s over the deployment, in rate order."""
        held = None
        for p in self.probes:
            if p.attainment < self.attainment:
                return held, p.rate
            held = p.rate
        return held, None

    @property
    def limiting(self) -> str:
        """What fails first above the goodput: ``TTFT``, ``TBT`` or ``both``; ``-`` when no probed rate fails."""
        _, failing = self.bracket()
        if failing is None:
            return "-"
        p = next(p for p in self.probes if p.rate == failing)
        ttft_bad, tbt_bad = p.ttft_share < self.attainment, p.tbt_share < self.attainment
        if ttft_bad == tbt_bad:
            return "both" if ttft_bad else ("TTFT" if p.ttft_share < p.tbt_share else "TBT")
        return "TTFT" if ttft_bad else "TBT"


@dataclass(slots=True)
class Plan:
    """The ranked outcome of ``plan``: ``entries`` best first, the shapes that did not fit (``skipped``), the
    workload, the wall time and the probes run."""

    setup: Setup
    entries: list[Entry]
    workload: str
    skipped: list[tuple[str, str]] = field(default_factory=list)
    wall_time: float = 0.0
    limits: tuple[int, int] = (300, 1500)
    stopped: str = ""
    """Empty for a whole search; else how far a search stopped early (Ctrl-C) got: its entries are those."""

    @property
    def num_probes(self) -> int:
        return sum(len(e.probes) for e in self.entries)

    @property
    def best(self) -> Entry:
        return self.entries[0]

    def launch(self, entry: Entry) -> dict[str, Any]:
        """How to run ``entry`` (``space.launch``)."""
        return launch(self.setup, entry.candidate)

    def to_dict(self) -> dict[str, Any]:
        return {"setup": asdict(self.setup), "workload": self.workload, "limits": list(self.limits),
                "stopped": self.stopped,
                "wall_time": self.wall_time, "num_probes": self.num_probes, "skipped": self.skipped,
                "entries": [{"label": e.label, "candidate": asdict(e.candidate), "num_gpus": e.num_gpus,
                             "goodput_per_gpu": e.goodput, "limiting": e.limiting, "refined": e.refined,
                             "bracket": list(e.bracket()), "error": e.error, **self.launch(e),
                             "probes": [asdict(p) for p in e.probes]} for e in self.entries]}


def plan(setup: Setup, workload: Workload, *, min_requests: int = 300, max_requests: int = 1500,
         fine_probes: int = 3, backend: str | None = None, workers: int | None = None, address: str | None = None,
         progress: bool = True) -> Plan:
    """Rank every candidate of ``setup`` (``space.space``) by goodput per GPU on ``workload`` (its requests'
    lengths and order; the rates are the search's), coarse then fine (module docstring). backend, workers,
    address: ``sim.sweeps.run_tasks``'s. progress: tqdm bars per phase. Raises ``ValueError`` naming a bad
    value, or when nothing fits."""
    return plan_slos(setup, workload, [(setup.ttft, setup.tbt)], min_requests=min_requests,
                     max_requests=max_requests, fine_probes=fine_probes, backend=backend, workers=workers,
                     address=address, progress=progress)[0]


def plan_slos(setup: Setup, workload: Workload, slos: Sequence[tuple[float, float]], *, min_requests: int = 300,
              max_requests: int = 1500, fine_probes: int = 3, backend: str | None = None, workers: int | None = None,
              address: str | None = None, progress: bool = True) -> list[Plan]:
    """``plan`` under each ``(ttft, tbt)`` SLO pair of ``slos`` (seconds), in one search: a candidate's probe at
    a rate is simulated once and judged under every pair (the coarse grid is shared; the early stop and the
    fine probes are each pair's). Returns one ``Plan`` per pair, in order; the wall time is the whole search's."""
    if not 1 <= min_requests <= max_requests:
        raise ValueError(f"need 1 <= min_requests <= max_requests, got {min_requests}, {max_requests}")
    if fine_probes < 0:
        raise ValueError(f"fine_probes={fine_probes!r} must be >= 0")
    if not slos:
        raise ValueError("slos is empty: give at least one (ttft, tbt) pair")
    wall = time.perf_counter()
    setups = tuple(replace(setup, ttft=ttft, tbt=tbt) for ttft, tbt in slos)
    spaces = [space(s) for s in setups]  # a hybrid's routing rule follows the SLOs: each pair has its own space
    judged: dict[Candidate, list[int]] = {}  # candidate -> the pairs whose space holds it
    for i, found in enumerate(spaces):
        for c in found.candidates:
            judged.setdefault(c, []).append(i)
    limits = (min_requests, max_requests)
    start = start_rate(setup, workload)
    tasks = [_Task(tuple(setups[i] for i in idx), c, workload, limits, start=start) for c, idx in judged.items()]
    coarse, stopped = _run(_coarse, tasks, "coarse", backend, workers, address, progress)
    entries: dict[Candidate, dict[int, Entry]] = {
        c: {i: Entry(c, sorted(p, key=lambda q: q.rate), setups[i].attainment, error=err)
            for i, p in zip(judged[c], per_setup)}
        for c, per_setup, err in coarse}
    note = f"{len(entries)} of {len(tasks)} candidates searched, none refined" if stopped else ""
    floors = [max([(e[i].bracket()[0] or 0.0) / e[i].num_gpus for e in entries.values() if i in e and not e[i].error]
                  or [0.0]) for i in range(len(setups))]
    todo = []
    for c, per_setup in entries.items() if not stopped else ():
        brackets = tuple(_refine(e, floors[i]) if fine_probes else None for i, e in per_setup.items())
        if any(b is not None for b in brackets):
            todo.append(_Task(tuple(setups[i] for i in per_setup), c, workload, limits, brackets=brackets,
                              num_probes=fine_probes))
    fine, stopped = _run(_fine, todo, "fine", backend, workers, address, progress)
    for c, per_setup, _ in fine:
        for e, probes in zip(entries[c].values(), per_setup):
            if probes:
                e.probes = sorted(e.probes + probes, key=lambda q: q.rate)
                e.refined = True
    if stopped:
        note = f"all {len(tasks)} candidates searched, {len(fine)} of {len(todo)} refined"
    seconds = time.perf_counter() - wall
    return [Plan(s, sorted((e[i] for e in entries.values() if i in e), key=lambda e: (-e.goodput, e.label)),
                 workload.describe(), spaces[i].skipped, seconds, limits, note) for i, s in enumerate(setups)]


def _refine(entry: Entry, floor: float) -> tuple[float, float] | None:
    """The bracket to refine ``entry`` in, or ``None`` when it cannot reach the best (``floor``, per GPU)."""
    held, failing = entry.bracket()
    if entry.error or held is None or failing is None or failing / entry.num_gpus <= floor:
        return None
    return held, failing


def _run(fn: Any, tasks: list[_Task], phase: str, backend: str | None, workers: int | None, address: str | None,
         progress: bool) -> tuple[list[_Found], bool]:
    """The tasks' outcomes, and whether a Ctrl-C stopped the phase early (the outcomes are then those finished)."""
    from tqdm.auto import tqdm

    out = []
    with tqdm(total=len(tasks), desc=f"plan: {phase}", unit="candidate", disable=not progress or not tasks) as bar:
        try:
            for done in run_tasks(fn, tasks, backend=backend, workers=workers, address=address):
                out.append(done)
                bar.update(1)
        except KeyboardInterrupt:
            return out, True
    return out, False
