"""Discrete-event simulation of online serving: the real scheduler, a predicted step time.

The simulator drives the very classes the engine uses (``sarathi_lite.scheduler``) and feeds the same
``MetricsRecorder``; only the forward pass is replaced by a ``CostModel``'s predicted step time. Its loop is
``sarathi_lite.bench.replay``'s on a simulated clock:

- before each iteration, every request whose arrival time has passed by the iteration's start is added, in
  arrival order (an arrival during an iteration is seen by the next one);
- iterations run back to back while anything is unfinished, each starting ``cost_model.start_time(ready)``
  (the previous end plus the host's gap between steps);
- when nothing is unfinished, the clock jumps to the next arrival;
- each non-empty iteration is recorded as ``record_step(out, start, start + schedule_time, start + step_time)``.

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
from collections.abc import Sequence
from typing import Any

from sarathi_lite.bench.capacity import SLO, CapacityResult, search_capacity
from sarathi_lite.bench.results import BenchResult, config_label, configurations, host, run_config
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import CostModel

# re-exported: the loader moved to costs (below the engine); benchmarks and notebooks call sim.load_cost_model
from sarathi_lite.costs.spec import ROOFLINE_PREFIX as ROOFLINE_PREFIX
from sarathi_lite.costs.spec import load_cost_model as load_cost_model
from sarathi_lite.engine.config import EngineConfig, default_option
from sarathi_lite.metrics import MetricsRecorder
from sarathi_lite.scheduler import CHUNKED_POLICIES, Request, SchedulerConfig, StepTimePredictor, make_scheduler
from sarathi_lite.sim.pipeline import pipeline_parallel_size, simulate_pipeline

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
    # pipeline parallelism (sim/pipeline.py): one micro-batch in flight per stage
    options.setdefault("max_concurrent_batches", pipeline_parallel_size(cost_model))
    options.setdefault("cost_model", cost_model)  # chunk_size="auto": the cost model also picks the budgets
    config = EngineConfig(policy=policy, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, **options)
    pool = config.kv_pool(kv_bytes_per_token=cost_model.kv_bytes_per_token,
                          max_position_embeddings=cost_model.max_position_embeddings,
                          kv_cache_memory=cost_model.kv_cache_memory)
    return config.scheduler_config(pool.num_blocks, pool.max_model_len)


def simulate(workload: Workload, cost_model: CostModel, config: SchedulerConfig, *,
             chunk_size: int | str | None = None, record_batches: bool = False, seed: int = 0,
             predictor: StepTimePredictor | None = None) -> BenchResult:
    """Serve ``workload`` under ``config`` on a simulated clock (seconds from 0) and return what it recorded.

    Every request produces exactly its ``output_len`` tokens (as the real replay forces them). With prefix
    caching, prompts are ``workload.prompt_token_ids(PROMPT_VOCAB)``, so shared prefixes hit as in a replay
    (without, their ids do not matter and are not drawn). chunk_size:
    recorded in the configuration (default: ``config.chunk_size`` for chunked policies, else ``None``).
    record_batches: keep every iteration's ``(request_id, num_new_tokens)`` rows, as the engine's option.
    seed: of the cost model's random draws, if it makes any (``cost_model.reset(seed)`` runs first).
    predictor: with ``config.chunk_size == "auto"``, the step-time model that picks each budget (default:
    ``cost_model`` itself). Each step's simulated time is fed back to it as the engine feeds its measured one, so
    its correction stays 1 when it is the cost model without jitter.
    Raises ``ValueError`` if a request does not fit ``config.max_model_len``.
    A pipelined cost model (``pipeline_parallel_size`` > 1) runs ``pipeline.simulate_pipeline`` instead.
    """
    if pipeline_parallel_size(cost_model) > 1:  # pipeline parallelism: micro-batches through the stages
        return simulate_pipeline(workload, cost_model, config, chunk_size=chunk_size, record_batches=record_batches,
                                 seed=seed, predictor=predictor)
    workload.check_fits(config.max_model_len)
    wall = time.perf_counter()
    cost_model.reset(seed)
    scheduler = make_scheduler(config, (predictor or cost_model) if config.auto_budget else None)
    metrics = MetricsRecorder(record_batches=record_batches)
    specs = workload.requests
    prompts = workload.prompt_token_ids(PROMPT_VOCAB) if config.enable_prefix_caching else None
    no_stop: frozenset[int] = frozenset()
    start_time, predict, schedule, update = cost_model.start_time, cost_model.predict, scheduler.schedule, \
        scheduler.update
    record, add_metrics, add_request = metrics.record_step, metrics.add, scheduler.add
    nxt, n = 0, len(specs)
    ready = 0.0
    while nxt < n or scheduler.requests:
        if not scheduler.requests:
            ready = max(ready, specs[nxt].arrival_time)
        start = start_time(ready)
        while nxt < n and specs[nxt].arrival_time <= start:
            spec = specs[nxt]
            add_request(Request(spec.request_id, prompts[nxt] if prompts else [0] * spec.prompt_len,
                                spec.output_len, no_stop, spec.arrival_time))
            add_metrics(spec.request_id, spec.arrival_time, spec.prompt_len)
            nxt += 1
        out = schedule()
        timing = predict(out)
        ready = start + timing.step_time
        finished = update(out, {s.request_id: 0 for s in out.scheduled if s.sample})
        if out.scheduled:
            record(out, start, start + timing.schedule_time, ready, finished)
            scheduler.observe(out, timing.step_time)
        elif out.preempted_ids:
            metrics.record_preemptions(out)
    description = cost_model.describe()
    config_record = run_config(config, chunk_size, model=description["model"], dtype=description["dtype"],
                               device=description["device"], attention_backend=description["attention_backend"])
    meta = {"replay": "simulated", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": host(),
            "cost_model": description, "wall_time": time.perf_counter() - wall}
    return BenchResult(config_record, workload, metrics.stats(), meta)


def run(workload: Workload, cost_model: CostModel, *, policies: Sequence[str] = ("sarathi",),
        chunk_sizes: Sequence[int] | None = None, configs: Sequence[tuple[str, int | None]] | None = None,
        record_batches: bool = False, **config_options: Any) -> list[BenchResult]:
    """Simulate ``workload`` under every configuration of ``configurations(policies, chunk_sizes)`` (or the
    ``(policy, chunk_size)`` pairs of ``configs``), in that order; one result each, as ``bench.run``.
    config_options: as for ``scheduler_config`` (``max_num_seqs``, ``block_size``, ``num_kv_blocks``, ...)."""
    pairs = configs if configs is not None else configurations(policies,
                                                               chunk_sizes or [default_option("chunk_size")])
    return [simulate(workload, cost_model, scheduler_config(cost_model, policy, chunk, **config_options),
                     chunk_size=chunk, record_batches=record_batches) for policy, chunk in pairs]


def capacity(workload: Workload, cost_model: CostModel, slo: SLO, *, policies: Sequence[str] = ("sarathi", "vllm"),
             chunk_size: int | str | None = None, qps_low: float, qps_high: float, num_probes: int = 8,
             **config_options: Any) -> list[CapacityResult]:
    """Serving capacity of each policy (chunked ones at ``chunk_size``), as ``bench.capacity`` but simulated:
    ``search_capacity`` over ``[qps_low, qps_high]`` requests/s, each probe ``workload.at_qps(qps)``."""
    found = []
    for policy in policies:
        chunk = (chunk_size or default_option("chunk_size")) if policy in CHUNKED_POLICIES else None
        config = scheduler_config(cost_model, policy, chunk, **config_options)
        found.append(search_capacity(lambda qps, c=config, k=chunk: simulate(workload.at_qps(qps), cost_model, c,
                                                                            chunk_size=k),
                                     slo, qps_low, qps_high, num_probes, label=config_label(policy, chunk)))
    return found
