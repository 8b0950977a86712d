"""``sweep``: simulate every combination of workloads x cost models x scheduler configurations (x arrival rates)
x SLOs and return one pandas DataFrame, on a local process pool (default), serially, or on a Ray cluster.

Every point is independent and deterministic (the simulator draws nothing from the clock), so the rows are the
same whatever runs them; each task carries its index and the frame is assembled in that order. Two kinds of
point:

- a simulation (default): the workload at its own rate (or at each of ``qps``), one row per SLO with the run's
  summary (``Stats.summary()``: TTFT, TBT, scheduling delay percentiles, throughput) and ``meets_slo``; without
  SLOs, one row per run;
- a capacity search (``capacity=(qps_low, qps_high, num_probes)``): one row per SLO with the highest rate that
  meets it (``search_capacity``), ``failed_above`` and the probes made.

>>> from sarathi_lite.sim import sweep
>>> from sarathi_lite.bench.workload import Workload
>>> from sarathi_lite.bench.capacity import SLO
>>> wl = Workload.from_trace("conversation", num_requests=500, qps=10.0, prompt_scale=1, output_scale=1,
...                          max_prompt=7168, max_output=1024)
>>> df = sweep({"conv": wl}, ["roofline:h100:llama3-8b"], [("sarathi", 512), ("vllm", None)],
...            slos=[SLO(0.05), SLO(0.1)], capacity=(1.0, 60.0, 8))

Backends: ``"process"`` (``concurrent.futures.ProcessPoolExecutor``, ``workers`` processes, default the CPU
count), ``"serial"`` (in this process), ``"ray"`` (``ray.init(address=address, **ray_options)`` unless Ray is
already initialized; a cluster's workers must have sarathi-lite installed). Giving ``address`` selects Ray.
``run_tasks(fn, items)`` runs any module-level function over picklable items on the same backends (the
deployment planner's probes, ``sarathi_lite.plan``).

Torch-free; pandas is needed for the frame, tqdm draws the progress bar, Ray only for its backend.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from functools import lru_cache
from typing import Any

from sarathi_lite.bench.capacity import SLO, search_capacity
from sarathi_lite.bench.results import Stopped, config_label
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import CostModel, load_cost_model
from sarathi_lite.sim.simulator import scheduler_config, simulate

BACKENDS = ("process", "serial", "ray")


@dataclasses.dataclass(slots=True, frozen=True)
class _Task:
    """One point: its row index, what to simulate, and under which SLOs."""

    index: int
    workload_name: str
    workload: Workload
    cost_name: str
    cost_model: str | CostModel
    config: tuple[tuple[str, Any], ...]
    slos: tuple[SLO | None, ...]
    capacity: tuple[float, float, int] | None
    rate: float | None = None


@lru_cache(maxsize=32)
def _load(spec: str) -> CostModel:
    return load_cost_model(spec)


def _run(task: _Task) -> list[tuple[int, dict[str, Any]]]:
    """The rows of one task: ``(row index, row)`` per SLO. Runs in any worker process."""
    cost = _load(task.cost_model) if isinstance(task.cost_model, str) else task.cost_model
    options = dict(task.config)
    policy, chunk = options.pop("policy"), options.pop("chunk_size", None)
    config = scheduler_config(cost, policy, chunk, **options)
    base = {"workload": task.workload_name, "cost_model": task.cost_name, "config": config_label(policy, chunk),
            "policy": policy, "chunk_size": chunk, **options,
            "offered_qps": task.workload.qps if task.rate is None else task.rate}
    rows = []
    if task.capacity is None:
        summary = simulate(task.workload, cost, config, chunk_size=chunk).summary()
        summary.pop("label")
        for i, slo in enumerate(task.slos):
            row = {**base, **_slo_columns(slo), **summary}
            if slo is not None:
                row["meets_slo"] = slo.met_by(summary)
            rows.append((task.index + i, row))
        return rows
    low, high, probes = task.capacity
    for i, slo in enumerate(task.slos):
        found = search_capacity(lambda qps: simulate(task.workload.at_qps(qps), cost, config, chunk_size=chunk),
                                slo, low, high, probes, label=base["config"])
        rows.append((task.index + i, {**base, **_slo_columns(slo), "capacity": found.capacity,
                                      "failed_above": found.failed_above, "probes": len(found.probes)}))
    return rows


def _slo_columns(slo: SLO | None) -> dict[str, float | None]:
    return {"tbt_slo": slo.tbt_p99 if slo else None, "scheduling_delay_slo": slo.scheduling_delay_p50 if slo else None}


def _named(items: Mapping[str, Any] | Sequence[Any], what: str, namer: Any) -> list[tuple[str, Any]]:
    pairs = list(items.items()) if isinstance(items, Mapping) else [(namer(i, x), x) for i, x in enumerate(items)]
    if not pairs:
        raise ValueError(f"sweep needs at least one {what}")
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"{what} names must be unique, got {names}")
    return pairs


def _config(c: Mapping[str, Any] | tuple[str, int | str | None] | str) -> tuple[tuple[str, Any], ...]:
    if isinstance(c, str):
        c = {"policy": c}
    elif isinstance(c, tuple):
        c = {"policy": c[0], "chunk_size": c[1]}
    if "policy" not in c:
        raise ValueError(f"a configuration needs a policy, got {dict(c)}")
    return tuple(dict(c).items())


def tasks(workloads: Mapping[str, Workload] | Sequence[Workload], cost_models: Mapping[str, Any] | Sequence[Any],
          configs: Iterable[Any], slos: Sequence[SLO] = (), *, qps: Sequence[float] | None = None,
          capacity: tuple[float, float, int] | None = None) -> list[_Task]:
    """The sweep's tasks in row order (see ``sweep``)."""
    wls = _named(workloads, "workload", lambda i, w: f"workload{i}")
    costs = _named(cost_models, "cost model",
                   lambda i, c: c if isinstance(c, str) else c.describe().get("model") or f"cost{i}")
    cfgs = [_config(c) for c in configs]
    if not cfgs:
        raise ValueError("sweep needs at least one configuration")
    if capacity is not None and not slos:
        raise ValueError("a capacity sweep needs at least one SLO")
    if capacity is not None and qps:
        raise ValueError("give qps or capacity, not both: a capacity search chooses the rates itself")
    slo_list: tuple[SLO | None, ...] = tuple(slos) or (None,)
    out, index = [], 0
    for wname, wl in wls:
        for rate in (qps or [None]):
            w = wl if rate is None else wl.at_qps(rate)
            for cname, cm in costs:
                for cfg in cfgs:
                    out.append(_Task(index, wname, w, str(cname), cm, cfg, slo_list, capacity, rate))
                    index += len(slo_list)
    return out


def sweep(workloads: Mapping[str, Workload] | Sequence[Workload], cost_models: Mapping[str, Any] | Sequence[Any],
          configs: Iterable[Any], slos: Sequence[SLO] = (), *, qps: Sequence[float] | None = None,
          capacity: tuple[float, float, int] | None = None, backend: str | None = None, address: str | None = None,
          workers: int | None = None, ray_options: Mapping[str, Any] | None = None,
          progress: bool = True) -> Any:
    """Simulate every workload x rate x cost model x configuration (x SLO) and return a ``pandas.DataFrame``,
    one row per point and SLO, in that nesting order (see the module docstring).

    workloads: ``{name: Workload}`` or a list (named ``workload0``, ...). cost_models: ``{name: spec or
    CostModel}`` or a list (a spec names itself: ``roofline:h100:llama3-8b``, a profile path). configs: per
    configuration a policy name, a ``(policy, chunk_size)`` pair or a dict of ``EngineConfig`` scheduler options
    with ``policy`` (``{"policy": "sarathi", "chunk_size": 512, "max_num_seqs": 256}``). slos: ``SLO``s each row
    is judged by (``meets_slo``) or, with ``capacity``, searched under. qps: re-rate every workload to each of
    these (requests/s). capacity: ``(qps_low, qps_high, num_probes)`` for capacity searches instead of single
    runs. backend: ``"process"`` (default), ``"serial"`` or ``"ray"`` (default when ``address`` is given).
    workers: processes of the pool (default: CPU count). ray_options: more ``ray.init`` keywords (e.g.
    ``{"local_mode": True}``, ``{"num_cpus": 2}``). progress: a tqdm bar over finished tasks.
    Raises ``ValueError`` for an unknown backend or an empty dimension; stopped early (``KeyboardInterrupt``),
    ``Stopped`` with the frame of the points finished.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    backend = backend or ("ray" if address else "process")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose from {', '.join(BACKENDS)}")
    todo = tasks(workloads, cost_models, configs, slos, qps=qps, capacity=capacity)
    rows: dict[int, dict[str, Any]] = {}
    with tqdm(total=len(todo), desc="sweep", unit="point", disable=not progress) as bar:
        try:
            for done in _execute(todo, backend, address, workers, ray_options or {}):
                rows.update(done)
                bar.update(1)
        except KeyboardInterrupt:
            raise Stopped(pd.DataFrame([rows[i] for i in sorted(rows)]),
                          f"{bar.n} of {len(todo)} points") from None
    return pd.DataFrame([rows[i] for i in sorted(rows)])


def run_tasks(fn: Callable[[Any], Any], items: Iterable[Any], *, backend: str | None = None,
              address: str | None = None, workers: int | None = None,
              ray_options: Mapping[str, Any] | None = None) -> Iterable[Any]:
    """``fn(item)`` for each of ``items``, yielded in the order they finish, on the sweep's backends (``backend``,
    ``address``, ``workers``, ``ray_options`` as ``sweep`` takes them). ``fn`` must be a module-level function and
    the items picklable (they travel to worker processes). Raises ``ValueError`` for an unknown backend."""
    backend = backend or ("ray" if address else "process")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose from {', '.join(BACKENDS)}")
    yield from _execute(list(items), backend, address, workers, ray_options or {}, fn)


def _execute(todo: list[Any], backend: str, address: str | None, workers: int | None,
             ray_options: Mapping[str, Any], fn: Callable[[Any], Any] = _run) -> Iterable[Any]:
    """``fn`` of each task (a sweep's: its rows), in the order they finish."""
    if backend == "serial":
        yield from map(fn, todo)
    elif backend == "process":
        # Ctrl-C reaches the caller alone (the workers ignore it): the caller may keep what finished, and the
        # pool stops at once, its queued tasks cancelled and its workers ended, instead of running them out.
        pool = ProcessPoolExecutor(max_workers=workers, initializer=_ignore_interrupts)
        try:
            futures = [pool.submit(fn, t) for t in todo]
            for f in as_completed(futures):
                yield f.result()
        except BaseException:
            workers_left = list((pool._processes or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for process in workers_left:
                process.terminate()
            raise
        pool.shutdown()
    else:
        yield from _ray(todo, address, ray_options, fn)


def _ignore_interrupts() -> None:
    """A pool worker's signals: Ctrl-C is the caller's alone, and SIGTERM (how the caller stops the pool) ends the
    worker at once, whatever handler the caller installed before the pool forked it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _ray(todo: list[Any], address: str | None, ray_options: Mapping[str, Any], fn: Callable[[Any], Any]
         ) -> Iterable[Any]:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address=address, **{"include_dashboard": False, "log_to_driver": False, **ray_options})
    try:
        run = ray.remote(fn)
        pending = [run.remote(t) for t in todo]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            yield ray.get(ready[0])
    finally:
        if started:
            ray.shutdown()
