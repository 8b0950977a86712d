"""The executor: how an engine's batches run on the model, behind one interface.

``LLMEngine`` hands each batch (a ``SchedulerOutput`` and its sampling inputs) to ``Executor.execute`` and gets a
``StepFuture``; it never asks how the model runs. ``Executor`` runs the model in the engine's own process;
``ParallelExecutor`` (``engine.parallel_executor``) runs it over tensor-parallel ranks and pipeline stages in
worker processes (``engine.worker``), sending each step as the change since the last (``engine.step_delta``).
``LLMEngine`` picks one from its options at construction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from sarathi_lite.engine.config import EngineConfig, KVPool
from sarathi_lite.engine.errors import EngineDeadError
from sarathi_lite.engine.model_runner import ModelRunner, StepResult, rank_kv_pool
from sarathi_lite.engine.sampler import History
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.models.interface import CausalLM
from sarathi_lite.models.loader import load_model
from sarathi_lite.models.parallel import TensorParallel
from sarathi_lite.models.pipeline import PipelineParallel
from sarathi_lite.scheduler import SchedulerOutput


@dataclass(slots=True)
class SamplingInputs:
    """What sampling a batch's rows needs besides their logits, keyed by request id: each sampling request's
    ``SamplingParams``, the token ids it must not sample this step (``min_tokens``) and the penalized requests'
    ``(prompt, output)`` token ids (see ``Sampler``)."""

    params: Mapping[str, SamplingParams]
    banned: Mapping[str, Sequence[int]]
    history: Mapping[str, History]


class StepFuture:
    """A step's result: known when ``execute`` returns (one process, tensor parallelism: ``ready``), or once the
    last pipeline stage's logits are back and sampled (``result()`` waits for them; ``ready`` is ``None`` until
    then)."""

    def __init__(self, result: StepResult | None = None) -> None:
        self._result = result

    @property
    def ready(self) -> StepResult | None:
        return self._result

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self._finish()
        return self._result

    def _finish(self) -> StepResult:
        raise NotImplementedError


class Executor:
    """Runs batches in the engine's process on its ``ModelRunner`` (built by ``build_runner``, once the pool size
    is known). The base of the executors: one that spans processes overrides ``execute`` and the rest.

    single_process: whether the model runs whole in this process (then a KV connector may read and write its
    cache, and another engine may share its weights; under tensor parallelism each rank holds a shard)."""

    single_process = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.runner: ModelRunner | None = None

    @property
    def tp(self) -> TensorParallel | None:
        """Rank 0's tensor-parallel group (``None``: one rank)."""
        return None

    @property
    def pp(self) -> PipelineParallel | None:
        """Rank 0's pipeline stage (``None``: one stage)."""
        return None

    def load_model(self, path: Path, dtype: torch.dtype, load_format: str) -> CausalLM:
        """Rank 0's share of the model at ``path``: all of it, or its shard of its stage's layers."""
        return load_model(path, dtype, self.device, load_format, self.tp, self.pp)

    def build_runner(self, config: EngineConfig, model: CausalLM, dtype: torch.dtype) -> KVPool:
        """Size the KV pool (on every rank: the smallest rank's) and build the runner on ``model``; returns the
        pool."""
        pool = self.agree_pool(config, rank_kv_pool(config, model.config, model.tp.size, dtype, self.device),
                               model.config.max_position_embeddings)
        self.runner = ModelRunner(model, block_size=pool.block_size, num_blocks=pool.num_blocks, device=self.device,
                                  dtype=dtype, attention_backend=config.attention_backend)
        return pool

    def agree_pool(self, config: EngineConfig, pool: KVPool, max_position_embeddings: int) -> KVPool:
        """``pool`` as every rank can hold it (one rank: as it is)."""
        return pool

    def execute(self, out: SchedulerOutput, sampling: SamplingInputs) -> StepFuture:
        """Run ``out``'s batch in one forward pass and sample its sampling rows."""
        return StepFuture(self.runner.execute(out, sampling.params, banned=sampling.banned,
                                              history=sampling.history))

    def release(self, request_id: str) -> None:
        """Forget a finished, aborted or failed request's per-request state (call it once no batch that holds it
        is still to run)."""
        self.runner.release(request_id)

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` saying why if no more steps can run: here, the CUDA device reports an error
        (CUDA errors are sticky: every later kernel would fail too)."""
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except Exception as e:  # torch.AcceleratorError and friends: the device is gone for this process
                raise EngineDeadError(f"the device {self.device} failed: {e}") from e

    def shutdown(self) -> None:
        """Stop whatever the executor started (idempotent; nothing here)."""

