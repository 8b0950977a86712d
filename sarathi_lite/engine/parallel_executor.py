"""``ParallelExecutor``: batches over tensor-parallel ranks and pipeline stages in worker processes.

Rank 0 (the engine's process) keeps the scheduler and sampling. Each step it sends the other ranks a
``StepDelta`` (``engine.step_delta``: the batch as the change since the last step), then runs its own share:

- tensor parallelism (one stage): every rank runs the same forward pass on its shard; rank 0 samples, and the
  step's result is ready when ``execute`` returns;
- pipeline stages: rank 0 runs stage 0's layers and hands the micro-batch on, then ``execute`` returns at once
  with a ``PipelinedStep`` whose ``result()`` waits for the last stage's logits and samples them (``LLMEngine``
  calls it when it processes that step), so rank 0 can send the next micro-batch meanwhile. While it waits it
  checks every 50 ms that the spawned workers are alive, so a dead stage is an error within a second, never a
  hang.

The processes, their groups and their faults are ``WorkerGroup``'s (``engine.worker``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch

from sarathi_lite.engine.config import EngineConfig, KVPool
from sarathi_lite.engine.errors import EngineDeadError
from sarathi_lite.engine.executor import Executor, SamplingInputs, StepFuture
from sarathi_lite.engine.model_runner import StepResult
from sarathi_lite.engine.pipeline import StageLogits, StageResult, recv_logits, run_stage
from sarathi_lite.engine.step_delta import StepDelta, StepEncoder
from sarathi_lite.engine.worker import RankSetup, WorkerGroup, check_parallel_config
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.models.parallel import TensorParallel
from sarathi_lite.models.pipeline import PipelineParallel
from sarathi_lite.scheduler import SchedulerOutput


class PipelinedStep(StepFuture):
    """A micro-batch down the pipeline: its result once the last stage's logits are back (``result()`` waits for
    them and samples; call the results in the order of ``execute``)."""

    def __init__(self, executor: ParallelExecutor, out: SchedulerOutput, sampling: SamplingInputs,
                 stage: StageResult, received: Future[StageLogits]) -> None:
        super().__init__()
        self._executor, self._out, self._sampling = executor, out, sampling
        self._stage, self._received = stage, received

    def _finish(self) -> StepResult:
        return self._executor.finish(self._out, self._sampling, self._stage, self._received)


class ParallelExecutor(Executor):
    """Rank 0's executor over ``workers`` (started or joined by ``start``); its runner holds rank 0's shard."""

    single_process = False

    def __init__(self, workers: WorkerGroup, device: torch.device) -> None:
        super().__init__(device)
        self.workers = workers
        self._encoder = StepEncoder()
        self._forget: list[str] = []  # released requests the ranks still hold: they go with the next step
        self._receiver: ThreadPoolExecutor | None = None

    @classmethod
    def start(cls, config: EngineConfig, path: Path, dtype: torch.dtype, device: torch.device) -> ParallelExecutor:
        """Check the layout (``ValueError`` before any process starts), then start (or join ``torchrun``'s) ranks.
        Under ``torchrun`` a rank other than 0 serves rank 0's steps in here, then raises ``SystemExit(0)``."""
        check_parallel_config(ModelConfig.from_pretrained(path), config.tensor_parallel_size, device,
                              config.pipeline_parallel_size)
        setup = RankSetup.of(config, str(path), dtype, device)
        return cls(WorkerGroup.start(setup.world_size, setup), setup.device(0))

    @property
    def tp(self) -> TensorParallel:
        return self.workers.tp

    @property
    def pp(self) -> PipelineParallel | None:
        return self.workers.pp

    def agree_pool(self, config: EngineConfig, pool: KVPool, max_position_embeddings: int) -> KVPool:
        return self.workers.agree_pool(config, pool, max_position_embeddings)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._forget.append(request_id)

    def execute(self, out: SchedulerOutput, sampling: SamplingInputs) -> StepFuture:
        """Send ``out``'s delta to the ranks, then run rank 0's share: forward and sample (tensor parallelism),
        or stage 0's layers, handing the micro-batch on (pipeline)."""
        workers = self.workers
        workers.check_alive()
        workers.busy = True
        if workers.pp is not None:
            workers.pending += 1
            return workers.guard(self._send_down, out, sampling)
        result = workers.guard(self._step, out, sampling)
        workers.busy = False
        return StepFuture(result)

    def _message(self, out: SchedulerOutput) -> StepDelta:
        forget, self._forget = self._forget, []
        return self._encoder.encode(out, forget)

    def _step(self, out: SchedulerOutput, sampling: SamplingInputs) -> StepResult:
        self.workers.broadcast(self._message(out))
        return self.runner.execute(out, sampling.params, banned=sampling.banned, history=sampling.history)

    def _send_down(self, out: SchedulerOutput, sampling: SamplingInputs) -> PipelinedStep:
        delta = self._message(out)
        self.workers.broadcast(delta)
        pipe = self.workers.groups.pipeline
        stage = run_stage(self.runner, pipe, out, delta)
        if self._receiver is None:
            self._receiver = ThreadPoolExecutor(1, thread_name_prefix="sarathi-lite-logits")
        received = self._receiver.submit(recv_logits, pipe, len(stage.rows), self.runner.model.config.vocab_size)
        return PipelinedStep(self, out, sampling, stage, received)

    def finish(self, out: SchedulerOutput, sampling: SamplingInputs, stage: StageResult,
               received: Future[StageLogits]) -> StepResult:
        """A micro-batch's result: wait for its logits (checking the workers), then sample them."""
        workers = self.workers
        back = workers.guard(self._wait, received)
        workers.pending -= 1
        workers.busy = workers.pending > 0
        runner = self.runner
        logits = None if back.logits is None else back.logits.to(runner.device)
        result = runner.sample(out, logits, stage.rows, sampling.params, sampling.banned, stage.prepare_time,
                               stage.forward_time, sampling.history)
        result.stage_busy = tuple(back.stage_busy)
        return result

    def _wait(self, received: Future[StageLogits]) -> StageLogits:
        """The logits receive's result; checks every 50 ms that the spawned workers live."""
        while True:
            try:
                return received.result(timeout=0.05)
            except FutureTimeout:
                self.workers.check_alive()

    def check_health(self) -> None:
        """``EngineDeadError`` if a worker has exited or fallen out of step, or the device failed."""
        try:
            self.workers.check_alive()
        except RuntimeError as e:
            raise EngineDeadError(str(e)) from e
        if self.workers.failed:
            raise EngineDeadError(self.workers.failed)
        super().check_health()

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        self.workers.shutdown()
        if self._receiver is not None:
            self._receiver.shutdown(wait=False, cancel_futures=True)
