"""Pipeline parallelism on the simulated clock: micro-batches of the real scheduler flowing through P stages.

Torch-free. A deployment of P pipeline stages runs each micro-batch (one ``SchedulerOutput``) through stage 0,
then stage 1, ... with a send of its activations between consecutive stages; a stage works on one micro-batch at
a time, in the order they were scheduled. The scheduler keeps up to ``max_concurrent_batches`` micro-batches in
flight (P, set by ``simulator.scheduler_config`` for a pipelined cost model), and a request is in at most one of
them (its next chunk or decode waits for the previous one to leave the last stage: Sarathi-Serve's rule).

The event loop (``simulate_pipeline``), on a clock in seconds from 0:

1. ``ready`` is when the host could schedule the next micro-batch: stage 0 has finished the previous one, and,
   with ``max_concurrent_batches`` out, the oldest has left the last stage; if nothing is unfinished and nothing is
   in flight, the clock jumps to the next arrival (as the plain simulator);
2. the micro-batch starts at ``cost_model.start_time(ready)``; first every micro-batch that left the last stage by
   then is ``update()``d (oldest first) and recorded, and every request that has arrived by then is added;
3. ``schedule()``; the cost model gives ``(schedule_time, stage_times, send_time)`` (``stage_timing``): stage
   ``s`` starts it at ``max(the end of stage s - 1 + send_time, stage s free)`` (stage 0: at the start) and works
   ``stage_times[s]`` seconds; it leaves the last stage at its end;
4. an empty micro-batch (every request in flight) takes no stage time: the host waits for the oldest in flight.

Each micro-batch is recorded at the end of its last stage as ``record_step(out, start, start + schedule_time,
end, finished)``, with ``stage_busy`` (each stage's seconds on it), so TTFT and TBT count the whole trip through
the pipeline and ``Stats.summary()`` reports the bubble fraction (``metrics.bubble_accounting``): the idle time
of all stages over ``stages x`` the time anything was in flight.

Cost models: ``RooflineCostModel(pipeline_parallel_size=P)`` (``roofline:NxPxHW:MODEL``) prices each stage's
layers and the sends over the pipeline link; ``PipelineCostModel`` puts any other cost model (a CPU profile) on P
stages, its step time split by the stages' layer counts.
"""

from __future__ import annotations

import datetime
import math
import time
from collections import deque
from typing import Any, NamedTuple

from sarathi_lite.bench.results import BenchResult, host, run_config
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import CostModel, StepTiming
from sarathi_lite.metrics import MetricsRecorder
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.models.stages import check_pipeline_parallel, stage_layers
from sarathi_lite.scheduler import Request, SchedulerConfig, SchedulerOutput, StepTimePredictor, make_scheduler

PROMPT_VOCAB = 32768  # the vocabulary prompt ids are drawn from, as the plain simulator's


class PipelineCostModel(CostModel):
    """``base`` (any cost model of the whole model on one device group) on ``num_stages`` pipeline stages.

    A micro-batch's stage ``s`` takes ``base``'s step time (one ``predict`` per micro-batch, jitter included)
    times the stage's share of the work: ``n_s * T / (num_layers * T + head_layers * R)`` for a micro-batch of
    ``T`` tokens of which ``R`` rows sample, ``n_s = len(stage_layers(num_layers, num_stages, s))``, and the last
    stage adds ``head_layers * R`` (its LM head). ``head_layers``: what the LM head costs a sampling row, in
    layers' work per token (``head_layer_units``: its weights over a layer's; 0 leaves it out, splitting by
    layers alone; ``num_layers``: ``None`` splits equally). The send between consecutive stages takes
    ``link_latency + activation_bytes_per_token * tokens / link_bandwidth`` seconds (bytes/s; the defaults make
    it free). The KV pool, host gap and scheduling time are
    ``base``'s. ``predict`` gives a micro-batch's time through the whole pipeline.
    """

    def __init__(self, base: CostModel, num_stages: int, *, num_layers: int | None = None,
                 activation_bytes_per_token: float = 0.0, link_bandwidth: float = math.inf,
                 link_latency: float = 0.0, head_layers: float = 0.0) -> None:
        check_pipeline_parallel(num_layers if num_layers is not None else num_stages, num_stages)
        if not link_bandwidth > 0 or activation_bytes_per_token < 0 or link_latency < 0 or not head_layers >= 0:
            raise ValueError(f"link_bandwidth={link_bandwidth!r} must be positive, activation_bytes_per_token="
                             f"{activation_bytes_per_token!r}, link_latency={link_latency!r} and head_layers="
                             f"{head_layers!r} non-negative")
        self.base = base
        self.pipeline_parallel_size = num_stages
        self.num_layers = layers = num_layers or num_stages
        self.stage_num_layers = [len(stage_layers(layers, num_stages, s)) for s in range(num_stages)]
        self.shares = [n / layers for n in self.stage_num_layers]
        self.head_layers = float(head_layers)
        self.activation_bytes_per_token = activation_bytes_per_token
        self.link_bandwidth, self.link_latency = link_bandwidth, link_latency
        self.step_gap = base.step_gap
        self.kv_bytes_per_token, self.kv_cache_memory = base.kv_bytes_per_token, base.kv_cache_memory
        self.max_position_embeddings = base.max_position_embeddings

    def send_time(self, out: SchedulerOutput) -> float:
        """Seconds one micro-batch's activations take from one stage to the next."""
        tokens = out.num_prefill_tokens + out.num_decode_tokens
        return self.link_latency + self.activation_bytes_per_token * tokens / self.link_bandwidth

    def stage_timing(self, out: SchedulerOutput) -> tuple[float, list[float], float]:
        """``(schedule_time, stage_times, send_time)`` of one micro-batch (one draw of ``base``'s jitter)."""
        timing = self.base.predict(out)
        return timing.schedule_time, self.split(timing.step_time, out), self.send_time(out)

    def split(self, step_time: float, out: SchedulerOutput) -> list[float]:
        """``step_time`` (the whole model's, on ``out``) split into the stages' shares (see the class)."""
        if not self.head_layers:
            return [step_time * share for share in self.shares]
        tokens = out.num_prefill_tokens + out.num_decode_tokens
        head = self.head_layers * sum(1 for s in out.scheduled if s.sample)
        work = [n * tokens for n in self.stage_num_layers]
        work[-1] += head
        total = sum(work)
        return [step_time * w / total for w in work] if total else [0.0] * len(work)

    def predict(self, out: SchedulerOutput) -> StepTiming:
        timing = self.base.predict(out)
        return StepTiming(timing.schedule_time,
                          timing.step_time + (self.pipeline_parallel_size - 1) * self.send_time(out))

    def predict_step_time(self, out: SchedulerOutput) -> float:
        return self.base.predict_step_time(out) + (self.pipeline_parallel_size - 1) * self.send_time(out)

    def start_time(self, ready: float) -> float:
        return self.base.start_time(ready)

    def reset(self, seed: int) -> None:
        self.base.reset(seed)

    def describe(self) -> dict[str, Any]:
        return {**self.base.describe(), "pipeline_parallel_size": self.pipeline_parallel_size,
                "pipeline_num_layers": self.num_layers, "pipeline_head_layers": self.head_layers,
                "pipeline_activation_bytes_per_token": self.activation_bytes_per_token,
                "pipeline_link_bandwidth": self.link_bandwidth, "pipeline_link_latency": self.link_latency}


def head_layer_units(config: ModelConfig) -> float:
    """The LM head's weights over one decoder layer's projections (``ModelConfig.lm_head_weights`` over
    ``layer_weights``): ``PipelineCostModel``'s ``head_layers``. Per token both are one multiply-add per weight,
    so this is also their ratio of work."""
    return config.lm_head_weights() / config.layer_weights()


def pipeline_parallel_size(cost_model: CostModel) -> int:
    """The pipeline stages ``cost_model`` prices (1: no pipeline)."""
    return getattr(cost_model, "pipeline_parallel_size", 1)


def stage_timing(cost_model: CostModel, out: SchedulerOutput) -> tuple[float, list[float], float]:
    """``(schedule_time, stage_times, send_time)`` (seconds) of micro-batch ``out``: a ``PipelineCostModel``'s, or
    those of a model with ``predict_stage_times`` and ``send_time`` (``RooflineCostModel``)."""
    if isinstance(cost_model, PipelineCostModel):
        return cost_model.stage_timing(out)
    return cost_model.predict(out).schedule_time, cost_model.predict_stage_times(out), cost_model.send_time(out)


class _MicroBatch(NamedTuple):
    out: SchedulerOutput
    start: float
    schedule_end: float
    end: float
    stage_busy: tuple[float, ...]


def simulate_pipeline(workload: Workload, cost_model: CostModel, config: SchedulerConfig, *,
                      chunk_size: int | str | None = None, record_batches: bool = False, seed: int = 0,
                      predictor: StepTimePredictor | None = None) -> BenchResult:
    """Serve ``workload`` under ``config`` on ``pipeline_parallel_size(cost_model)`` stages (see the module
    docstring); arguments and result as ``simulator.simulate``, whose loop this is when the cost model is
    pipelined. ``config.max_concurrent_batches`` is the number of micro-batches in flight (normally the stage
    count; fewer leaves stages idle). Each micro-batch's ``schedule_time + sum(stage_times) + sends`` is fed to
    a ``chunk_size="auto"`` budget as its step time."""
    workload.check_fits(config.max_model_len)
    wall = time.perf_counter()
    num_stages = pipeline_parallel_size(cost_model)
    cost_model.reset(seed)
    scheduler = make_scheduler(config, (predictor or cost_model) if config.auto_budget else None)
    metrics = MetricsRecorder(record_batches=record_batches)
    specs = workload.requests
    prompts = workload.prompt_token_ids(PROMPT_VOCAB) if config.enable_prefix_caching else None
    no_stop: frozenset[int] = frozenset()
    free = [0.0] * num_stages  # when each stage finishes the micro-batches it has been given
    in_flight: deque[_MicroBatch] = deque()
    nxt, n = 0, len(specs)
    ready = 0.0
    while nxt < n or scheduler.requests or in_flight:
        if not scheduler.requests and not in_flight:
            ready = max(ready, specs[nxt].arrival_time)
        start = cost_model.start_time(ready)
        while in_flight and in_flight[0].end <= start:
            _complete(scheduler, metrics, in_flight.popleft())
        while nxt < n and specs[nxt].arrival_time <= start:
            spec = specs[nxt]
            scheduler.add(Request(spec.request_id, prompts[nxt] if prompts else [0] * spec.prompt_len,
                                  spec.output_len, no_stop, spec.arrival_time))
            metrics.add(spec.request_id, spec.arrival_time, spec.prompt_len)
            nxt += 1
        if not scheduler.can_schedule():
            ready = in_flight[0].end
            continue
        if not scheduler.requests:
            continue  # everything finished when the last micro-batches completed; the next arrival
        out = scheduler.schedule()
        if not out.scheduled:  # every runnable request is in flight: wait for the oldest micro-batch
            last = in_flight[-1].end if in_flight else start
            in_flight.append(_MicroBatch(out, start, start, max(start, last), ()))
            ready = in_flight[0].end
            continue
        schedule_time, stage_times, send = stage_timing(cost_model, out)
        t = start
        for s, busy in enumerate(stage_times):
            begin = max(t + (send if s else 0.0), free[s])
            t = free[s] = begin + busy
        in_flight.append(_MicroBatch(out, start, start + schedule_time, t, tuple(stage_times)))
        scheduler.observe(out, schedule_time + sum(stage_times) + (num_stages - 1) * send)
        ready = free[0]
    description = cost_model.describe()
    config_record = run_config(config, chunk_size, model=description["model"], dtype=description["dtype"],
                               device=description["device"], attention_backend=description["attention_backend"])
    config_record["pipeline_parallel_size"] = num_stages
    meta = {"replay": "simulated", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": host(), "cost_model": description, "wall_time": time.perf_counter() - wall}
    return BenchResult(config_record, workload, metrics.stats(), meta)


def _complete(scheduler: Any, metrics: MetricsRecorder, batch: _MicroBatch) -> None:
    """``batch`` has left the last stage: apply it to the scheduler and record it (empty ones are not)."""
    out = batch.out
    finished = scheduler.update(out, {s.request_id: 0 for s in out.scheduled if s.sample})
    if out.scheduled:
        metrics.record_step(out, batch.start, batch.schedule_end, batch.end, finished, stage_busy=batch.stage_busy)
    else:
        metrics.record_preemptions(out)
