"""Tensor-parallel workers: ranks 1..N-1 of an engine, each holding 1/N of the weights and KV heads.

Rank 0 (the engine's process) owns the scheduler, the tokenizer and sampling. Every step it sends the
``SchedulerOutput`` to the other ranks (``broadcast_object_list`` on a gloo *control* group, whose long timeout
lets workers wait through an idle engine); then all ranks run the same forward pass on their shards, whose
all-reduces run on the *forward* group (gloo on CPU, NCCL on CUDA) with a short timeout, and rank 0 samples.

Workers are either spawned by the engine (``torch.multiprocessing``, spawn, daemon processes on this machine;
the rendezvous is a TCP store on 127.0.0.1) or launched by ``torchrun`` (``env://``), where every rank runs the
same script and ``LLMEngine(...)`` on a rank other than 0 serves rank 0's steps, then exits the process.

Faults: rank 0 checks that its spawned workers are alive before each step and while waiting for them to join,
and turns a failed collective into a ``RuntimeError`` naming the dead rank; a worker exits when rank 0 goes away
(its broadcast fails). ``WorkerGroup.shutdown`` (also run by a finalizer when the engine is collected, and at
interpreter exit) stops the workers: a ``None`` step when they are idle, else terminate, then kill.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sarathi_lite.engine.config import EngineConfig, KVPool
from sarathi_lite.engine.model_runner import ModelRunner, StepResult, rank_kv_pool
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.models.config import ModelConfig, check_tensor_parallel
from sarathi_lite.models.llama import LlamaForCausalLM
from sarathi_lite.models.loader import load_model
from sarathi_lite.models.parallel import TensorParallel
from sarathi_lite.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = 60.0
"""Seconds a rank waits in a forward-pass collective (and for spawned workers to join) before giving up."""
_IDLE_TIMEOUT = timedelta(days=7)  # the control group: workers wait this long for rank 0's next step
_SHUTDOWN_GRACE = 5.0  # seconds a worker gets to leave by itself before it is terminated


@dataclass(slots=True)
class RankSetup:
    """What every rank needs to build its shard and KV pool: the engine's options, the resolved checkpoint
    folder, dtype and device type, and rank 0's torch thread count."""

    config: EngineConfig
    model_path: str
    dtype: torch.dtype
    device_type: str
    num_threads: int

    @classmethod
    def of(cls, config: EngineConfig, model_path: str, dtype: torch.dtype, device: torch.device) -> RankSetup:
        return cls(config, model_path, dtype, device.type, torch.get_num_threads())

    def device(self, rank: int) -> torch.device:
        """Rank ``rank``'s device: ``cuda:<local rank>`` on CUDA, else the CPU."""
        if self.device_type == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        return torch.device(self.device_type)


def check_parallel_config(cfg: ModelConfig, size: int, device: torch.device) -> None:
    """Raise ``ValueError`` before any process starts when ``size`` ranks cannot serve ``cfg`` on ``device``."""
    check_tensor_parallel(cfg, size)
    if device.type == "cuda" and "WORLD_SIZE" not in os.environ and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} exceeds the {torch.cuda.device_count()} CUDA device(s)")


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(os.environ)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _groups(rank: int, size: int, device: torch.device, store: Any = None) -> tuple[TensorParallel, Any]:
    """Join the default (forward) group and create the control group; returns ``(tp, control group)``."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT)
    if store is None:
        dist.init_process_group(_backend(device), init_method="env://", rank=rank, world_size=size, timeout=timeout)
    else:
        dist.init_process_group(_backend(device), store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return TensorParallel(rank, size), control


def _min_over_ranks(value: int, control: Any) -> int:
    agreed = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
    return int(agreed)


def build_shard(setup: RankSetup, tp: TensorParallel, control: Any) -> tuple[LlamaForCausalLM, int]:
    """This rank's model shard and the KV pool size every rank agrees on: the smallest rank's, in blocks."""
    device = setup.device(tp.rank)
    model = load_model(setup.model_path, setup.dtype, device, setup.config.load_format, tp)
    pool = rank_kv_pool(setup.config, model.config, tp.size, setup.dtype, device)
    return model, _min_over_ranks(pool.num_blocks, control)


def serve(setup: RankSetup, tp: TensorParallel, control: Any) -> None:
    """A worker's life: build its shard, then run the forward pass of every step rank 0 broadcasts until it
    broadcasts ``None``."""
    model, blocks = build_shard(setup, tp, control)
    runner = ModelRunner(model, block_size=setup.config.block_size, num_blocks=blocks,
                         device=setup.device(tp.rank), dtype=setup.dtype,
                         attention_backend=setup.config.attention_backend)
    logger.info("tensor-parallel rank %d of %d ready", tp.rank, tp.size)
    while True:
        message: list[SchedulerOutput | None] = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        if message[0] is None:
            return
        runner.forward(message[0])


def _worker_main(rank: int, size: int, port: int, setup: RankSetup) -> None:
    """Entry point of a spawned worker process (rank ``rank`` >= 1)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to rank 0, which stops the workers
    torch.set_num_threads(setup.num_threads)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT))
    store.add("joined", 1)
    tp, control = _groups(rank, size, setup.device(rank), store)
    try:
        serve(setup, tp, control)
    except Exception as e:  # rank 0 is gone, or this rank failed: one line, not a traceback per worker
        logger.error("tensor-parallel worker rank %d stops: %s", rank, e)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """Rank 0's side of the tensor-parallel group: starts the workers (or joins ``torchrun``'s), broadcasts each
    step, watches the workers' health and stops them.

    ``WorkerGroup.start`` returns on rank 0 only; under ``torchrun`` a rank other than 0 serves until rank 0
    shuts down, then raises ``SystemExit(0)``. broadcast_seconds: host seconds rank 0 spent sending steps.
    """

    def __init__(self, tp: TensorParallel, control: Any, processes: list[Any]) -> None:
        self.tp, self.control, self.processes = tp, control, processes
        self.busy = True  # in a collective the workers may be in too: no stop message then
        self.failed: str | None = None
        self.closed = False
        self.broadcast_seconds = 0.0

    @classmethod
    def start(cls, size: int, setup: RankSetup) -> WorkerGroup:
        if launched_by_torchrun():
            world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
            if world != size:
                raise ValueError(f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={world} processes")
            tp, control = _groups(rank, size, setup.device(rank))
            if rank != 0:
                try:
                    serve(setup, tp, control)
                finally:
                    dist.destroy_process_group()
                raise SystemExit(0)
            return cls(tp, control, [])
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process: shut the other "
                               "tensor-parallel engine down first")
        port = _free_port()
        store = dist.TCPStore("127.0.0.1", port, size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=COLLECTIVE_TIMEOUT))
        ctx = mp.get_context("spawn")
        processes = [ctx.Process(target=_worker_main, args=(rank, size, port, setup), daemon=True,
                                 name=f"sarathi-lite-tp{rank}") for rank in range(1, size)]
        for p in processes:
            p.start()
        group = cls(TensorParallel(0, size), None, processes)
        try:
            group._wait_joined(store, size - 1)
            group.tp, group.control = _groups(0, size, setup.device(0), store)
        except BaseException:
            group.shutdown()
            raise
        return group

    def _wait_joined(self, store: Any, n: int) -> None:
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT
        while store.add("joined", 0) < n:
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not join within {COLLECTIVE_TIMEOUT:.0f} s")
            time.sleep(0.05)

    def check_alive(self) -> None:
        """Raise ``RuntimeError`` naming the first spawned worker that has exited."""
        if self.failed:
            raise RuntimeError(self.failed)
        for rank, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                how = f"was killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with code {p.exitcode}"
                self.failed = (f"tensor-parallel worker rank {rank} (pid {p.pid}) {how}; the engine cannot run "
                               f"without it")
                raise RuntimeError(self.failed)

    def agree_pool(self, config: EngineConfig, pool: KVPool, max_position_embeddings: int) -> KVPool:
        """Rank 0's side of ``build_shard``: ``pool`` cut to the smallest rank's, in blocks (``max_model_len``
        derived from it as usual). The workers are ready for steps after it."""
        blocks = self._guard(_min_over_ranks, pool.num_blocks, self.control)
        self.busy = False
        if blocks == pool.num_blocks:
            return pool
        return config.replace(num_kv_blocks=blocks).kv_pool(kv_bytes_per_token=None,
                                                             max_position_embeddings=max_position_embeddings)

    def execute(self, runner: ModelRunner, out: SchedulerOutput, params: Mapping[str, SamplingParams],
                banned: Mapping[str, Sequence[int]]) -> StepResult:
        """Send ``out`` to the workers, then run rank 0's share of the forward pass and sample (``banned``: as
        ``ModelRunner.execute``'s)."""
        self.check_alive()
        self.busy = True
        result = self._guard(self._step, runner, out, params, banned)
        self.busy = False
        return result

    def _step(self, runner: ModelRunner, out: SchedulerOutput, params: Mapping[str, SamplingParams],
              banned: Mapping[str, Sequence[int]]) -> StepResult:
        t0 = time.perf_counter()
        dist.broadcast_object_list([out], src=0, group=self.control)
        self.broadcast_seconds += time.perf_counter() - t0
        return runner.execute(out, params, banned=banned)

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(...)``, with a failure reported as the worker that caused it when one has exited."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:  # gloo and NCCL errors are RuntimeErrors (DistBackendError among them)
            time.sleep(0.2)  # a killed worker's exit code shows up a moment after its sockets close
            self.check_alive()
            self.failed = f"a tensor-parallel step failed (the workers may be out of step now): {e}"
            raise RuntimeError(self.failed) from e

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        idle = self.control is not None and not self.busy and not self.failed
        if idle:
            try:
                dist.broadcast_object_list([None], src=0, group=self.control)
            except Exception:  # a dead worker: the terminate below handles the rest
                logger.warning("could not tell the tensor-parallel workers to stop", exc_info=True)
        for p in self.processes:
            p.join(_SHUTDOWN_GRACE if idle else 0.1)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(_SHUTDOWN_GRACE)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()
