"""Tensor-parallel workers: ranks 1..N-1 of an engine, each holding 1/N of the weights and KV heads.

Rank 0 (the engine's process) owns the scheduler, the tokenizer and sampling; its ``ParallelExecutor``
(``engine.parallel_executor``) runs the steps. Every step it sends the other ranks a ``StepDelta`` (the batch as
the change since the last step, ``engine.step_delta``; ``broadcast_object_list`` on a gloo *control* group, whose
long timeout lets workers wait through an idle engine), from which each rank rebuilds the ``SchedulerOutput``
with the block tables it keeps; then all ranks run the same forward pass on their shards, whose
all-reduces run on the *forward* group (gloo on CPU, NCCL on CUDA) with a short timeout, and rank 0 samples.

Workers are either spawned by the engine (``torch.multiprocessing``, spawn, daemon processes on this machine;
the rendezvous is a TCP store on 127.0.0.1) or launched by ``torchrun`` (``env://``), where every rank runs the
same script and ``LLMEngine(...)`` on a rank other than 0 serves rank 0's steps, then exits the process.

Faults: rank 0 checks that its spawned workers are alive before each step and while waiting for them to join,
and turns a failed collective into a ``RuntimeError`` naming the dead rank; a worker exits when rank 0 goes away
(its broadcast fails). ``WorkerGroup.shutdown`` (also run by a finalizer when the engine is collected, and at
interpreter exit) stops the workers: a ``None`` step when they are idle, else terminate, then kill.

With ``pipeline_parallel_size`` P > 1 the group has P x T ranks (``sarathi_lite.engine.pipeline``): rank 0
broadcasts each step to its own stage only and hands it to the next stage (``ParallelExecutor`` says how rank 0
waits for the logits).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sarathi_lite.engine.config import EngineConfig, KVPool
from sarathi_lite.engine.model_runner import ModelRunner, rank_kv_pool
from sarathi_lite.engine.pipeline import PipelineGroups, recv_micro_batch, run_stage, send_logits, send_micro_batch
from sarathi_lite.engine.step_delta import StepDecoder, StepDelta
from sarathi_lite.models.config import ModelConfig, check_tensor_parallel
from sarathi_lite.models.llama import LlamaForCausalLM
from sarathi_lite.models.loader import load_model
from sarathi_lite.models.parallel import TensorParallel
from sarathi_lite.models.pipeline import PipelineParallel
from sarathi_lite.models.stages import check_pipeline_parallel

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = 60.0
"""Seconds a rank waits in a forward-pass collective (and for spawned workers to join) before giving up."""
_IDLE_TIMEOUT = timedelta(days=7)  # the control group: workers wait this long for rank 0's next step
SHUTDOWN_GRACE = 5.0
"""Seconds a child process (a worker, an instance) gets to leave by itself before it is terminated."""
EXIT_WAIT = 5.0
"""Seconds a failure path waits for a dead child process's exit code, to name it."""


def stop_process(process: Any, grace: float = SHUTDOWN_GRACE) -> None:
    """End a child process that did not leave by itself: terminate it, wait ``grace`` seconds, then kill it
    (nothing if it has already exited)."""
    if process.is_alive():
        process.terminate()
        process.join(grace)
    if process.is_alive():
        process.kill()
        process.join()


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

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor-parallel ranks per stage times pipeline stages."""
        return self.config.tensor_parallel_size * self.config.pipeline_parallel_size

    def device(self, rank: int) -> torch.device:
        """Rank ``rank``'s device: ``cuda:<local rank>`` on CUDA, else the CPU."""
        if self.device_type == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        return torch.device(self.device_type)


def check_parallel_config(cfg: ModelConfig, size: int, device: torch.device, pipeline_parallel_size: int = 1
                          ) -> None:
    """Raise ``ValueError`` before any process starts when ``size`` tensor-parallel ranks per stage and
    ``pipeline_parallel_size`` stages cannot serve ``cfg`` on ``device``."""
    check_tensor_parallel(cfg, size)
    check_pipeline_parallel(cfg.num_layers, pipeline_parallel_size)
    world = size * pipeline_parallel_size
    if device.type == "cuda" and "WORLD_SIZE" not in os.environ and world > torch.cuda.device_count():
        what = f"tensor_parallel_size={size}" if pipeline_parallel_size == 1 else \
            f"tensor_parallel_size={size} x pipeline_parallel_size={pipeline_parallel_size}"
        raise ValueError(f"{what} exceeds the {torch.cuda.device_count()} CUDA device(s)")


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(os.environ)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(slots=True)
class Groups:
    """This rank's process groups: ``tp`` (the forward pass's collectives), ``control`` (rank 0's steps to its
    stage: every rank without pipeline parallelism), ``world`` (gloo, every rank: start-up agreement) and
    ``pipeline`` (``None`` with one stage)."""

    tp: TensorParallel
    control: Any
    world: Any
    pipeline: PipelineGroups | None = None


def _groups(rank: int, tp_size: int, pp_size: int, device: torch.device, store: Any = None) -> Groups:
    """Join the default group and create the others (every rank calls this, in the same order)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT)
    size = tp_size * pp_size
    if store is None:
        dist.init_process_group(_backend(device), init_method="env://", rank=rank, world_size=size, timeout=timeout)
    else:
        dist.init_process_group(_backend(device), store=store, rank=rank, world_size=size, timeout=timeout)
    world = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    if pp_size == 1:
        return Groups(TensorParallel(rank, size), world, world)
    stage = rank // tp_size
    stages = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=timeout) for s in range(pp_size)]
    control = dist.new_group(list(range(tp_size)), backend="gloo", timeout=_IDLE_TIMEOUT)
    logits = dist.new_group([0, (pp_size - 1) * tp_size], backend="gloo", timeout=_IDLE_TIMEOUT)
    tp = TensorParallel(rank % tp_size, tp_size, stages[stage], root=stage * tp_size)
    return Groups(tp, control, world, PipelineGroups(PipelineParallel(stage, pp_size), tp_size, rank, world, logits))


def _min_over_ranks(value: int, control: Any) -> int:
    agreed = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
    return int(agreed)


def build_shard(setup: RankSetup, rank: int, groups: Groups) -> tuple[LlamaForCausalLM, int]:
    """This rank's model shard (its stage's layers) and the KV pool size every rank agrees on: the smallest
    rank's, in blocks."""
    device = setup.device(rank)
    pp = groups.pipeline.pp if groups.pipeline is not None else None
    model = load_model(setup.model_path, setup.dtype, device, setup.config.load_format, groups.tp, pp)
    pool = rank_kv_pool(setup.config, model.config, groups.tp.size, setup.dtype, device)
    return model, _min_over_ranks(pool.num_blocks, groups.world)


def serve(setup: RankSetup, rank: int, groups: Groups) -> None:
    """A worker's life: build its shard, then run the forward pass of every step rank 0 broadcasts (or, on a
    later pipeline stage, the previous stage hands on) until it gets ``None``."""
    model, blocks = build_shard(setup, rank, groups)
    runner = ModelRunner(model, block_size=setup.config.block_size, num_blocks=blocks, device=setup.device(rank),
                         dtype=setup.dtype, attention_backend=setup.config.attention_backend)
    logger.info("rank %d of %d ready", rank, setup.world_size)
    pipe = groups.pipeline
    steps = StepDecoder()
    while True:
        if pipe is None or pipe.pp.is_first:
            message: list[StepDelta | None] = [None]
            dist.broadcast_object_list(message, src=0, group=groups.control)
            delta = message[0]
        else:
            delta = recv_micro_batch(pipe)
        if delta is None:
            if pipe is not None and not pipe.pp.is_last:
                send_micro_batch(pipe, None)  # stop the next stage too
            return
        out = steps.decode(delta)
        if pipe is None:
            runner.forward(out)
            continue
        stage = run_stage(runner, pipe, out, delta)
        if pipe.pp.is_last and groups.tp.rank == 0:
            send_logits(pipe, stage.stage_busy, stage.logits)


def _worker_main(rank: int, size: int, port: int, setup: RankSetup) -> None:
    """Entry point of a spawned worker process (rank ``rank`` >= 1)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to rank 0, which stops the workers
    torch.set_num_threads(setup.num_threads)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT))
    store.add("joined", 1)
    groups = _groups(rank, setup.config.tensor_parallel_size, setup.config.pipeline_parallel_size,
                     setup.device(rank), store)
    try:
        serve(setup, rank, groups)
    except Exception as e:  # rank 0 is gone, or this rank failed: one line, not a traceback per worker
        logger.error("worker rank %d stops: %s", rank, e)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a rendezvous store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """Rank 0's side of the tensor-parallel group: starts the workers (or joins ``torchrun``'s), broadcasts each
    step, watches the workers' health and stops them.

    ``WorkerGroup.start`` returns on rank 0 only; under ``torchrun`` a rank other than 0 serves until rank 0
    shuts down, then raises ``SystemExit(0)``. broadcast_seconds: host seconds rank 0 spent sending steps.
    ``tp``: rank 0's tensor-parallel group; ``pp``: its pipeline stage (``None`` with one stage).
    """

    def __init__(self, groups: Groups | None, processes: list[Any]) -> None:
        self.groups, self.processes = groups, processes
        self.busy = True  # in a collective the workers may be in too: no stop message then
        self.pending = 0  # micro-batches sent down the pipeline whose logits have not come back
        self.failed: str | None = None
        self._exit_awaited = False  # a failure path waited for a worker's exit code already
        self._exit_lock = threading.Lock()  # the forward thread and the caller may both be on a failure path
        self.closed = False
        self.broadcast_seconds = 0.0

    @property
    def tp(self) -> TensorParallel:
        return self.groups.tp

    @property
    def pp(self) -> PipelineParallel | None:
        return None if self.groups is None or self.groups.pipeline is None else self.groups.pipeline.pp

    @property
    def control(self) -> Any:
        return None if self.groups is None else self.groups.control

    @classmethod
    def start(cls, size: int, setup: RankSetup) -> WorkerGroup:
        """Start (or join) the ``size`` = ``setup.world_size`` ranks."""
        tp_size, pp_size = setup.config.tensor_parallel_size, setup.config.pipeline_parallel_size
        if launched_by_torchrun():
            world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
            if world != size:
                raise ValueError(f"tensor_parallel_size={tp_size} x pipeline_parallel_size={pp_size} = {size} ranks "
                                 f"but torchrun started WORLD_SIZE={world} processes")
            groups = _groups(rank, tp_size, pp_size, setup.device(rank))
            if rank != 0:
                try:
                    serve(setup, rank, groups)
                finally:
                    dist.destroy_process_group()
                raise SystemExit(0)
            return cls(groups, [])
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process: shut the other "
                               "tensor-parallel engine down first")
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=COLLECTIVE_TIMEOUT))
        ctx = mp.get_context("spawn")
        processes = [ctx.Process(target=_worker_main, args=(rank, size, port, setup), daemon=True,
                                 name=f"sarathi-lite-tp{rank}") for rank in range(1, size)]
        for p in processes:
            p.start()
        group = cls(None, processes)
        try:
            group._wait_joined(store, size - 1)
            group.groups = _groups(0, tp_size, pp_size, setup.device(0), store)
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

    def _await_exit(self) -> None:
        """On a failure path, once: poll until a spawned worker's exit code shows, at most ``EXIT_WAIT`` s (a
        killed worker's sockets close before its exit code can be read, later still on a loaded machine)."""
        with self._exit_lock:  # a second caller waits for the first's poll instead of returning at once
            if self._exit_awaited:
                return
            deadline = time.monotonic() + EXIT_WAIT
            while time.monotonic() < deadline and all(p.exitcode is None for p in self.processes):
                time.sleep(0.01)
            self._exit_awaited = True

    def check_alive(self) -> None:
        """Raise ``RuntimeError`` naming the first spawned worker that has exited, else the failure seen before
        (after giving a dying worker's exit code time to show)."""
        if self.failed:
            self._await_exit()
        for rank, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                how = f"was killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with code {p.exitcode}"
                pipe = None if self.groups is None else self.groups.pipeline
                who = f"tensor-parallel worker rank {rank}" if pipe is None else \
                    f"worker rank {rank} (pipeline stage {rank // pipe.tp_size})"
                self.failed = f"{who} (pid {p.pid}) {how}; the engine cannot run without it"
                raise RuntimeError(self.failed)
        if self.failed:
            raise RuntimeError(self.failed)

    def agree_pool(self, config: EngineConfig, pool: KVPool, max_position_embeddings: int) -> KVPool:
        """Rank 0's side of ``build_shard``: ``pool`` cut to the smallest rank's, in blocks (``max_model_len``
        derived from it as usual). The workers are ready for steps after it."""
        blocks = self.guard(_min_over_ranks, pool.num_blocks, self.groups.world)
        self.busy = False
        if blocks == pool.num_blocks:
            return pool
        return config.replace(num_kv_blocks=blocks).kv_pool(kv_bytes_per_token=None,
                                                             max_position_embeddings=max_position_embeddings)

    def broadcast(self, message: StepDelta | None) -> None:
        """Send a step's delta (``None``: stop) to rank 0's stage (and, to stop, down the pipeline: a micro-batch
        goes on with its activations, ``run_stage``)."""
        t0 = time.perf_counter()
        if self.tp.size > 1 or self.pp is None:
            dist.broadcast_object_list([message], src=0, group=self.control)
        if self.pp is not None and message is None:
            send_micro_batch(self.groups.pipeline, message)
        self.broadcast_seconds += time.perf_counter() - t0

    def guard(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(...)``, with a failure reported as the worker that caused it when one has exited."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:  # gloo and NCCL errors are RuntimeErrors (DistBackendError among them)
            self._await_exit()
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
                self.broadcast(None)
            except Exception:  # a dead worker: the terminate below handles the rest
                logger.warning("could not tell the tensor-parallel workers to stop", exc_info=True)
        for p in self.processes:
            p.join(SHUTDOWN_GRACE if idle else 0.1)
        for p in self.processes:
            stop_process(p)
        if dist.is_initialized():
            dist.destroy_process_group()
