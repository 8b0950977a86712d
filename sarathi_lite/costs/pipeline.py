"""Pipeline parallelism's cost models: a micro-batch's time on each of P pipeline stages and between them.

Torch-free. The simulator (``sarathi_lite.sim.simulator``) runs each micro-batch through the stages with
``stage_timing``: ``RooflineCostModel(pipeline_parallel_size=P)`` (``roofline:NxPxHW:MODEL``) prices each stage's
layers and the sends over the pipeline link itself; ``PipelineCostModel`` puts any other cost model (a CPU
profile) on P stages, its step time split by the stages' layer counts (and the LM head's work, ``head_layer_units``).
"""

from __future__ import annotations

import math
from typing import Any

from sarathi_lite.costs.base import CostModel, StepTiming
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.models.stages import check_pipeline_parallel, stage_layers
from sarathi_lite.scheduler import SchedulerOutput


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
