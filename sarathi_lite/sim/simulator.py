"""Discrete-event simulation of online serving: the real scheduler, a predicted step time, P pipeline stages.

The simulator drives the very classes the engine uses (``sarathi_lite.scheduler``) and feeds the same
``MetricsRecorder``; only the forward pass is replaced by a ``CostModel``'s predicted times. One loop serves every
deployment: a deployment of P pipeline stages (``costs.pipeline.pipeline_parallel_size``; 1 without pipeline
parallelism) runs each micro-batch (one ``SchedulerOutput``) through stage 0, then stage 1, ... with a send of its
activations between consecutive stages; a stage works on one micro-batch at a time, in the order they were
scheduled. The scheduler keeps up to ``max_concurrent_batches`` micro-batches in flight (P, set by
``scheduler_config``), and a request is in at most one of them (its next chunk or decode waits for the previous
one to leave the last stage: Sarathi-Serve's rule). On a clock in seconds from 0 (``simulate``):

1. ``ready`` is when the host could schedule the next micro-batch: stage 0 has finished the previous one, and,
   with ``max_concurrent_batches`` out, the oldest has left the last stage; if nothing is unfinished and nothing is
   in flight, the clock jumps to the next arrival;
2. the micro-batch starts at ``cost_model.start_time(ready)`` (``ready`` plus the host's gap between steps);
   first every micro-batch that left the last stage by then is ``update()``d (oldest first) and recorded, and
   every request that has arrived by then is added, in arrival order (an arrival during an iteration is seen by
   the next one);
3. ``schedule()``; with one stage the cost model's ``predict`` gives ``(schedule_time, step_time)`` and the
   iteration ends at ``start + step_time``; with P, ``costs.pipeline.stage_timing`` gives ``(schedule_time,
   stage_times, send_time)``: stage ``s`` starts it at ``max(the end of stage s - 1 + send_time, stage s free)``
   (stage 0: at the start) and works ``stage_times[s]`` seconds; it leaves the last stage at its end (with one
   stage nothing happens on the host before it ends, so it is applied and recorded at once);
4. with P > 1, an empty micro-batch (every request in flight) takes no stage time: the host waits for the oldest
   in flight.

Each non-empty micro-batch is recorded at the end of its last stage as ``record_step(out, start, start +
schedule_time, end, finished)``; with P > 1 also with ``stage_busy`` (each stage's seconds on it), so TTFT and TBT
count the whole trip through the pipeline and ``Stats.summary()`` reports the bubble fraction
(``metrics.bubble_accounting``): the idle time of all stages over ``stages x`` the time anything was in flight.

It returns the same ``BenchResult`` (and JSON schema) as the real-time replay, with ``meta["replay"] ==
"simulated"``, so predicted and measured runs compare column by column and plot alike.

>>> from sarathi_lite.costs import load_cost_model
>>> from sarathi_lite.sim.simulator import run
>>> from sarathi_lite.bench.workload import Workload
>>> wl = Workload.from_trace("splitwise_conv.csv", num_requests=1000, qps=2.0)
>>> results = run(wl, load_cost_model("roofline:h100:llama3-8b"), policies=["sarathi", "vllm"],
...               chunk_sizes=[256, 512, 1024])
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

from sarathi_lite.bench.capacity import SLO, CapacityResult, capacity_searches, search_capacity
from sarathi_lite.bench.results import BenchResult, Stopped, config_label, configurations, host, run_config
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import CostModel
from sarathi_lite.costs.pipeline import pipeline_parallel_size, stage_timing
from sarathi_lite.engine.config import EngineConfig, default_option
from sarathi_lite.metrics import MetricsRecorder
from sarathi_lite.scheduler import (
    CHUNKED_POLICIES,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepTimePredictor,
    make_scheduler,
)

# Prompt token ids matter only to the prefix cache, through which of them are equal: the simulator draws them
# from the workload (as the replay does) over this vocabulary.
PROMPT_VOCAB = 32768


def scheduler_config(cost_model: CostModel, policy: str, chunk_size: int | str | None, *,
                     num_kv_blocks: int | None = None, max_model_len: int | None = None,
                     **options: Any) -> SchedulerConfig:
    """The ``SchedulerConfig`` the real engine would build for these options on the modelled deployment: the
    same ``EngineConfig`` and ``kv_pool`` as ``LLMEngine``, with the cost model's KV bytes per token, KV memory
    and ``max_position_embeddings`` standing for the model and device.

    num_kv_blocks: ``None`` derives it from the cost model's KV memory. max_model_len: ``None`` means the model's
    ``max_position_embeddings`` capped by the pool. chunk_size: ``None`` (unchunked policies) leaves the default,
    as ``bench.build_engine``. options: further ``EngineConfig`` scheduler fields (``max_num_seqs``,
    ``block_size``, ...), at their defaults when not given. Raises ``ValueError`` as the engine would."""
    if chunk_size is not None:
        options["chunk_size"] = chunk_size
    # pipeline parallelism (the module docstring): one micro-batch in flight per stage
    options.setdefault("max_concurrent_batches", pipeline_parallel_size(cost_model))
    options.setdefault("cost_model", cost_model)  # chunk_size="auto": the cost model also picks the budgets
    config = EngineConfig(policy=policy, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, **options)
    pool = config.kv_pool(kv_bytes_per_token=cost_model.kv_bytes_per_token,
                          max_position_embeddings=cost_model.max_position_embeddings,
                          kv_cache_memory=cost_model.kv_cache_memory)
    return config.scheduler_config(pool.num_blocks, pool.max_model_len)


class _MicroBatch(NamedTuple):
    out: SchedulerOutput
    start: float
    schedule_end: float
    end: float
    stage_busy: tuple[float, ...]


class _Stages:
    """The deployment's P stages on the simulated clock (steps 3 and 4 of the module docstring): when each is free,
    and the micro-batches in flight, oldest first, each applied to the scheduler and recorded once it has left the
    last stage (``complete``)."""

    def __init__(self, cost_model: CostModel, scheduler: Scheduler, metrics: MetricsRecorder) -> None:
        self.cost_model, self.scheduler, self.metrics = cost_model, scheduler, metrics
        self.num_stages = pipeline_parallel_size(cost_model)
        self.free = [0.0] * self.num_stages  # when each stage finishes the micro-batches it has been given
        self.in_flight: deque[_MicroBatch] = deque()

    def run(self, out: SchedulerOutput, start: float) -> float:
        """Put ``out``, started at ``start``, through the stages and feed its step time (with one stage, also its
        end) to the scheduler's budget; returns when the host is ready for the next
        micro-batch (stage 0 is free)."""
        if self.num_stages == 1:  # the whole step on one device group, as the engine measures it
            timing = self.cost_model.predict(out)
            end = start + timing.step_time
            self.apply(out, start, start + timing.schedule_time, end, ())
            self.scheduler.observe(out, timing.step_time, end)
            return end
        schedule_time, stage_times, send = stage_timing(self.cost_model, out)
        free, t = self.free, start
        for s, busy in enumerate(stage_times):
            begin = max(t + (send if s else 0.0), free[s])
            t = free[s] = begin + busy
        self.in_flight.append(_MicroBatch(out, start, start + schedule_time, t, tuple(stage_times)))
        self.scheduler.observe(out, schedule_time + sum(stage_times) + (self.num_stages - 1) * send)
        return free[0]

    def wait(self, out: SchedulerOutput, start: float) -> float:
        """An empty micro-batch (every runnable request in flight) takes no stage time: it leaves with the newest
        in flight, and the host is ready when the oldest leaves."""
        last = self.in_flight[-1].end if self.in_flight else start
        self.in_flight.append(_MicroBatch(out, start, start, max(start, last), ()))
        return self.in_flight[0].end

    def complete(self, now: float) -> None:
        """``apply`` every micro-batch that has left the last stage by ``now``, oldest first."""
        in_flight, apply = self.in_flight, self.apply
        while in_flight and in_flight[0].end <= now:
            apply(*in_flight.popleft())

    def apply(self, out: SchedulerOutput, start: float, schedule_end: float, end: float,
              stage_busy: tuple[float, ...]) -> None:
        """``out`` has left the last stage: apply it to the scheduler and record it (an empty one is not)."""
        finished = self.scheduler.update(out, {s.request_id: 0 for s in out.scheduled if s.sample})
        if out.scheduled:
            self.metrics.record_step(out, start, schedule_end, end, finished, stage_busy=stage_busy)
        else:
            self.metrics.record_preemptions(out)


def simulate(workload: Workload, cost_model: CostModel, config: SchedulerConfig, *,
             chunk_size: int | str | None = None, record_batches: bool = False, seed: int = 0,
             predictor: StepTimePredictor | None = None) -> BenchResult:
    """Serve ``workload`` under ``config`` on a simulated clock (seconds from 0), on the cost model's
    ``pipeline_parallel_size`` stages (the module docstring), and return what it recorded.

    Every request produces exactly its ``output_len`` tokens (as the real replay forces them). With prefix
    caching, prompts are ``workload.prompt_token_ids(PROMPT_VOCAB)``, so shared prefixes hit as in a replay
    (without, their ids do not matter and are not drawn). chunk_size: recorded in the configuration (default:
    ``config.chunk_size`` for chunked policies, else ``None``). record_batches: keep every iteration's
    ``(request_id, num_new_tokens)`` rows, as the engine's option. seed: of the cost model's random draws, if it
    makes any (``cost_model.reset(seed)`` runs first). predictor: with ``config.chunk_size == "auto"``, the
    step-time model that picks each budget (default: ``cost_model`` itself). Each step's simulated time is fed
    back to it as the engine feeds its measured one (with P stages: ``schedule_time + sum(stage_times) + sends``).
    ``config.max_concurrent_batches`` is the number of micro-batches in flight (normally the stage count; fewer
    leaves stages idle). Raises ``ValueError`` if a request does not fit ``config.max_model_len``.
    """
    workload.check_fits(config.max_model_len)
    wall = time.perf_counter()
    cost_model.reset(seed)
    scheduler = make_scheduler(config, (predictor or cost_model) if config.auto_budget else None)
    metrics = MetricsRecorder(record_batches=record_batches)
    stages = _Stages(cost_model, scheduler, metrics)
    specs, in_flight, pipelined = workload.requests, stages.in_flight, stages.num_stages > 1
    prompts = workload.prompt_token_ids(PROMPT_VOCAB) if config.enable_prefix_caching else None
    no_stop: frozenset[int] = frozenset()
    start_time, complete, run, add_request, add_metrics = cost_model.start_time, stages.complete, stages.run, \
        scheduler.add, metrics.add
    nxt, n = 0, len(specs)
    ready = 0.0
    while nxt < n or scheduler.requests or in_flight:
        if not scheduler.requests and not in_flight:
            ready = max(ready, specs[nxt].arrival_time)
        start = start_time(ready)
        if in_flight:
            complete(start)
        while nxt < n and specs[nxt].arrival_time <= start:
            spec = specs[nxt]
            add_request(Request(spec.request_id, prompts[nxt] if prompts else [0] * spec.prompt_len,
                                spec.output_len, no_stop, spec.arrival_time))
            add_metrics(spec.request_id, spec.arrival_time, spec.prompt_len)
            nxt += 1
        if in_flight and not scheduler.can_schedule():  # nothing in flight: the scheduler has nothing out
            ready = in_flight[0].end
            continue
        if not scheduler.requests:
            continue  # everything finished when the last micro-batches completed; the next arrival
        out = scheduler.schedule()
        if pipelined and not out.scheduled:
            ready = stages.wait(out, start)
            continue
        ready = run(out, start)
    return bench_result(workload, cost_model, config, chunk_size, stages.num_stages, metrics.stats(), wall)


def bench_result(workload: Workload, cost_model: CostModel, config: SchedulerConfig, chunk_size: int | str | None,
                 num_stages: int, stats: Any, wall: float) -> BenchResult:
    """The ``BenchResult`` of a simulation that started at ``wall`` (``time.perf_counter()``)."""
    description = cost_model.describe()
    config_record = run_config(config, chunk_size, model=description["model"], dtype=description["dtype"],
                               device=description["device"], attention_backend=description["attention_backend"])
    if num_stages > 1:
        config_record["pipeline_parallel_size"] = num_stages
    meta = {"replay": "simulated", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": host(), "cost_model": description, "wall_time": time.perf_counter() - wall}
    return BenchResult(config_record, workload, stats, meta)


def run(workload: Workload, cost_model: CostModel, *, policies: Sequence[str] = ("sarathi",),
        chunk_sizes: Sequence[int] | None = None, configs: Sequence[tuple[str, int | None]] | None = None,
        record_batches: bool = False, progress: bool = False, **config_options: Any) -> list[BenchResult]:
    """Simulate ``workload`` under every configuration of ``configurations(policies, chunk_sizes)`` (or the
    ``(policy, chunk_size)`` pairs of ``configs``), in that order; one result each, as ``bench.run``.
    config_options: as for ``scheduler_config`` (``max_num_seqs``, ``block_size``, ``num_kv_blocks``, ...).
    progress: a progress bar over the configurations. Stopped early (``KeyboardInterrupt``), raises ``Stopped``
    with the results of the configurations finished."""
    pairs = configs if configs is not None else configurations(policies,
                                                               chunk_sizes or [default_option("chunk_size")])
    results: list[BenchResult] = []
    with _bar(len(pairs), "configuration", progress) as bar:
        for policy, chunk in pairs:
            try:
                results.append(simulate(workload, cost_model, scheduler_config(cost_model, policy, chunk,
                                                                               **config_options),
                                        chunk_size=chunk, record_batches=record_batches))
            except KeyboardInterrupt:
                raise Stopped(results, f"{len(results)} of {len(pairs)} configurations") from None
            bar.update(1)
    return results


def capacity(workload: Workload, cost_model: CostModel, slo: SLO, *, policies: Sequence[str] = ("sarathi", "vllm"),
             chunk_size: int | str | None = None, qps_low: float, qps_high: float, num_probes: int = 8,
             progress: bool = False, **config_options: Any) -> list[CapacityResult]:
    """Serving capacity of each policy (chunked ones at ``chunk_size``), simulated (``bench.replay.measured_capacity``
    measures it on the real engine): ``search_capacity`` over ``[qps_low, qps_high]`` requests/s, each probe
    ``workload.at_qps(qps)``. progress: a progress bar over the probes (at most ``num_probes`` per policy).
    Stopped early, raises ``Stopped`` with the searches so far (``capacity_searches``)."""
    with _bar(len(policies) * num_probes, "probe", progress) as bar:
        def search(policy: str) -> CapacityResult:
            chunk = (chunk_size or default_option("chunk_size")) if policy in CHUNKED_POLICIES else None
            config = scheduler_config(cost_model, policy, chunk, **config_options)
            found = search_capacity(lambda qps: simulate(workload.at_qps(qps), cost_model, config, chunk_size=chunk),
                                    slo, qps_low, qps_high, num_probes, label=config_label(policy, chunk),
                                    on_probe=lambda _: bar.update(1))
            bar.update(num_probes - len(found.probes))  # a search that ends early leaves its other probes undone
            return found

        return capacity_searches([partial(search, policy) for policy in policies])


def _bar(total: int, unit: str, enabled: bool) -> Any:
    """A tqdm progress bar over ``total`` ``unit``s (disabled unless ``enabled``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="sim", unit=unit, leave=False, disable=not enabled)
