"""Pipeline parallelism between engine ranks: micro-batches and activations stage to stage, logits back to rank 0.

With ``pipeline_parallel_size`` P and ``tensor_parallel_size`` T the engine has P x T ranks; global rank ``r`` is
tensor-parallel rank ``r % T`` of stage ``r // T`` (``models.pipeline``: contiguous layers per stage). Rank 0
(stage 0) schedules and samples. For each micro-batch (a ``SchedulerOutput``):

- stage 0's ranks get it from rank 0 as a ``StepDelta`` (``engine.step_delta``: what changed since the last step,
  a broadcast on their control group, as tensor parallelism does); every rank rebuilds the batch from it, and
  every rank of stage ``s`` < P - 1 runs its layers, then sends the delta, the hidden states and residual
  ``[N, hidden]`` and the seconds each stage so far spent on it to its peer (the same tensor-parallel rank) of
  stage ``s + 1`` (``run_stage``), all with point-to-point sends on a gloo group. The micro-batch travels with
  its activations, after the stage's work, not before it: a gloo send waits until the receiver posts the
  matching receive, and the next stage posts it only once it is done with the previous micro-batch, so a
  stage that sent first would wait for the next stage before it could start its own layers (the two stages
  would take turns instead of overlapping: a bubble of one half at P = 2);
- the last stage's first rank sends those seconds and the sampling rows' logits ``[rows, vocab]`` float32 to rank 0
  (``send_logits``), which samples them.

Rank 0 hands a micro-batch to stage 1 and returns to schedule the next, so up to P micro-batches are in flight
(the engine's batch queue, ``max_concurrent_batches`` = P); they pass every stage in order. Activations cross on
the default process group: gloo on the CPU, NCCL device to device on CUDA (not yet run on GPUs); the micro-batch,
the busy seconds and the logits cross gloo groups on the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sarathi_lite.engine.model_runner import ModelRunner
from sarathi_lite.engine.step_delta import StepDelta
from sarathi_lite.models.pipeline import PipelineParallel
from sarathi_lite.scheduler import SchedulerOutput


@dataclass(slots=True)
class PipelineGroups:
    """This rank's place in the pipeline (global ``rank``; ``tp_size`` ranks a stage) and its gloo groups:
    ``pipe`` (gloo, every rank: micro-batches and busy seconds) and ``logits`` (gloo, rank 0 and the last stage's
    first). Activations go over the default group: gloo on the CPU, NCCL on CUDA (device to device, no host
    copy)."""

    pp: PipelineParallel
    tp_size: int
    rank: int
    pipe: Any
    logits: Any

    @property
    def last_root(self) -> int:
        """The global rank of the last stage's first rank (which sends the logits)."""
        return (self.pp.size - 1) * self.tp_size


@dataclass(slots=True)
class StageResult:
    """This stage's share of a micro-batch: ``ModelRunner.forward``'s logits (last stage only), sampling rows and
    seconds, and the seconds each stage up to this one spent on it."""

    logits: torch.Tensor | None
    rows: list[int]
    prepare_time: float
    forward_time: float
    stage_busy: list[float]


def send_micro_batch(groups: PipelineGroups, message: StepDelta | None) -> None:
    """Send ``message`` (``None``: stop) to this rank's peer in the next stage."""
    dist.send_object_list([message], dst=groups.rank + groups.tp_size, group=groups.pipe)


def recv_micro_batch(groups: PipelineGroups) -> StepDelta | None:
    """The next micro-batch's delta (``None``: stop) from this rank's peer in the previous stage."""
    message: list[StepDelta | None] = [None]
    dist.recv_object_list(message, src=groups.rank - groups.tp_size, group=groups.pipe)
    return message[0]


def _recv_activations(runner: ModelRunner, groups: PipelineGroups, out: SchedulerOutput) -> list[float]:
    """Receive the previous stage's hidden states and residual for ``out`` into the model's stage input; returns
    the seconds each stage before this one spent on it."""
    model = runner.model
    on = activation_device(runner.device)
    n = sum(s.num_new_tokens for s in out.scheduled)
    hidden = torch.empty(n, model.config.hidden_size, dtype=runner.kv_cache.dtype, device=on)
    residual, times = torch.empty_like(hidden), torch.empty(groups.pp.stage, dtype=torch.float64)
    src = groups.rank - groups.tp_size
    dist.recv(hidden, src)
    dist.recv(residual, src)
    dist.recv(times, src, group=groups.pipe)
    model.stage_input = (hidden.to(runner.device), residual.to(runner.device))
    return times.tolist()


def run_stage(runner: ModelRunner, groups: PipelineGroups, out: SchedulerOutput, message: StepDelta
              ) -> StageResult:
    """This stage's share of ``out``: receive the previous stage's activations (not on the first stage), run its
    layers (``runner.forward``), send ``message`` (``out``'s delta) and the activations on (not on the last)."""
    pp = groups.pp
    busy = [] if pp.is_first else _recv_activations(runner, groups, out)
    t0 = time.perf_counter()
    logits, rows, prepare_time, forward_time = runner.forward(out)
    if not pp.is_last:
        model = runner.model
        on = activation_device(runner.device)
        hidden, residual = model.stage_output
        model.stage_output = None
        hidden, residual = hidden.to(on).contiguous(), residual.to(on).contiguous()
        busy.append(time.perf_counter() - t0)
        dst = groups.rank + groups.tp_size
        send_micro_batch(groups, message)
        dist.send(hidden, dst)
        dist.send(residual, dst)
        dist.send(torch.tensor(busy, dtype=torch.float64), dst, group=groups.pipe)
    else:
        busy.append(time.perf_counter() - t0)
    return StageResult(logits, rows, prepare_time, forward_time, busy)


def activation_device(device: torch.device) -> torch.device:
    """Where activations cross between stages: on ``device`` when the default group is NCCL (CUDA), else on the
    CPU (gloo)."""
    return device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")


def send_logits(groups: PipelineGroups, busy: list[float], logits: torch.Tensor | None) -> None:
    """The last stage's first rank: send each stage's seconds and the logits (if any row samples) to rank 0."""
    dist.send(torch.tensor(busy, dtype=torch.float64), 0, group=groups.logits)
    if logits is not None:
        dist.send(logits.cpu().contiguous(), 0, group=groups.logits)


@dataclass(slots=True)
class StageLogits:
    """What the last stage sends rank 0 for a micro-batch: each stage's seconds on it, and its sampling rows'
    logits (``None`` when no row samples)."""

    stage_busy: list[float]
    logits: torch.Tensor | None


def recv_logits(groups: PipelineGroups, num_rows: int, vocab_size: int) -> StageLogits:
    """Rank 0: each stage's seconds on the oldest micro-batch in flight, and its ``num_rows`` rows' logits."""
    busy = torch.empty(groups.pp.size, dtype=torch.float64)
    dist.recv(busy, groups.last_root, group=groups.logits)
    if not num_rows:
        return StageLogits(busy.tolist(), None)
    logits = torch.empty(num_rows, vocab_size, dtype=torch.float32)
    dist.recv(logits, groups.last_root, group=groups.logits)
    return StageLogits(busy.tolist(), logits)
