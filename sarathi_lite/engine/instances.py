"""Instances as processes: colocated replicas, xPyD disaggregated or conditional, each instance an ``LLMEngine``
in its own spawned process, behind one router in the caller's process.

``ProcessEngine`` has the step API of ``LLMEngine`` (``add_request``, ``step``, ``abort_request``,
``has_unfinished_requests``, ``stats``) and routes with ``sarathi_lite.scheduler.routing`` (the rules of the
in-process ``DisaggregatedEngine`` and of the simulator), on the loads every instance reports with each reply.

- Each instance loads the weights itself from the same model path and has its own KV pool, scheduler and policy
  options (``prefill_options`` / ``decode_options`` override the common ones per role); its torch thread count is
  ``num_threads`` (default 1, so instances on a CPU do not fight over cores).
- Prefill and decode instances are the ranks of one gloo group; the K/V of a prompt moves from the prefill rank
  to the decode rank over point-to-point sends, all layers of the blocks the decode side lacks in one tensor
  (``sarathi_lite.engine.p2p_connector``). A prompt is prefilled as a request with ``max_tokens=1`` whose blocks
  stay held on the prefill instance until the decode instance acknowledges them (or the request ends there);
  the decode instance admits it with ``num_external_tokens = prompt_len - 1`` and computes the last prompt token
  itself, so greedy outputs equal one engine's token for token. A transfer that fails or outlasts
  ``transfer_timeout`` seconds makes the decode instance recompute the prompt (one warning).
- The router talks to each instance over a pipe. Instances step independently: ``step()`` starts a step on every
  instance with work that is not stepping already and returns once at least one has ended, so forward passes run
  at the same time and a decode instance never waits for a prefill instance's chunk.
- Faults: an instance that dies is noticed within ~50 ms of its exit (a reply never hangs on a dead process).
  A dead prefill instance's unfinished prompts go to another prefill instance, or, with none left, to a decode
  instance that prefills them itself; a dead decode instance or replica ends its requests with
  ``finish_reason="error"`` (the message names the instance), and new requests go to the others; with none of a
  needed role left, ``step`` and ``add_request`` raise ``EngineDeadError``. Children are daemons, exit when the
  router's pipe closes or its process goes away, and ``shutdown()`` (also run when the engine is collected and
  at interpreter exit) stops them. Scripts need the ``if __name__ == "__main__":`` guard of the spawn start
  method.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sarathi_lite.engine.config import EngineConfig
from sarathi_lite.engine.errors import EngineDeadError
from sarathi_lite.engine.llm_engine import LLMEngine, _load_tokenizer
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.p2p_connector import P2PKVConnector
from sarathi_lite.engine.prompts import check_token_ids
from sarathi_lite.engine.sampling_params import SamplingParams, check_text
from sarathi_lite.engine.snapshot import EngineSnapshot
from sarathi_lite.engine.worker import _EXIT_WAIT, _SHUTDOWN_GRACE, _free_port
from sarathi_lite.metrics import IterationRecord, RequestMetrics, Stats
from sarathi_lite.models.builtin import resolve_model
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.scheduler import SchedulerConfig
from sarathi_lite.scheduler.routing import (
    COLOCATED,
    DECODE,
    PREFILL,
    Layout,
    kv_demand,
    pending_prefill_tokens,
    pick_decode_by_load,
    route_by_load,
)

logger = logging.getLogger(__name__)

START_TIMEOUT = 300.0
"""Seconds the instances get to load their model and join before the engine gives up."""
RECORD_WINDOW = 100_000
"""``routes`` and ``transfers`` keep the records of at most this many most recent requests."""
_POLL = 0.05  # seconds between liveness checks while waiting for a reply


# ---------------------------------------------------------------------------------------------------- the child


@dataclass(slots=True)
class InstanceSpec:
    """What one instance process needs: its role and index, its rank in the KV group (``None`` for a colocated
    replica), the group's size, the engine options and the torch thread count."""

    role: str
    index: int
    rank: int | None
    world_size: int
    config: EngineConfig
    num_threads: int
    transfer_timeout: float

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"


def _watch_parent(parent_pid: int) -> None:
    """Exit this process (at once, without cleanup) as soon as the router's process is gone."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="sarathi-lite-parent-watch").start()


class _Child:
    """An instance's side of the pipe: one ``LLMEngine`` and its connector; each command runs one method."""

    def __init__(self, spec: InstanceSpec, connector: P2PKVConnector | None) -> None:
        self.connector = connector
        self.engine = LLMEngine(config=spec.config, connector=connector)
        if connector is not None and connector.role == "producer":
            connector.start_sender(self.engine.runner)

    def release_sent(self) -> None:
        """Release the blocks whose receiver has them (or that the router dropped)."""
        if self.connector is not None and self.connector.role == "producer":
            self.engine.finish_kv_sends(self.connector.holds.take_released())

    def load(self) -> tuple[int, int, bool, EngineSnapshot]:
        """What every reply carries: the router's load measures, whether there is work, the snapshot."""
        sched = self.engine.scheduler
        return (pending_prefill_tokens(sched), kv_demand(sched), self.engine.has_unfinished_requests(),
                self.engine.snapshot())

    def ready(self) -> tuple[SchedulerConfig, ModelConfig]:
        return self.engine.scheduler_config, self.engine.model_config

    def add(self, request_id: str, prompt: Any, params: SamplingParams, arrival: float, num_external: int,
            handle: int | None, source: int | None) -> None:
        if handle is not None:
            self.connector.expect(request_id, handle, source)
        try:
            self.engine.add_request(request_id, prompt, params, arrival, num_external_tokens=num_external)
        except BaseException:
            if self.connector is not None:
                self.connector.forget(request_id)
            raise

    def abort(self, request_id: str) -> RequestOutput:
        out = self.engine.abort_request(request_id)
        if self.connector is not None:
            self.connector.forget(request_id)
        return out

    def step(self) -> tuple[list[RequestOutput], dict[str, tuple[float, int]], list[IterationRecord]]:
        """One step (two when the first only loaded K/V): its outputs, the K/V transfers it made and its
        iteration records."""
        engine = self.engine
        before = engine.metrics.num_iterations
        outputs = engine.step()
        if engine.metrics.num_iterations == before and engine.scheduler.running:
            outputs += engine.step()  # the step only loaded K/V
        transfers = {}
        if self.connector is not None and self.connector.transfers:
            transfers, self.connector.transfers = self.connector.transfers, {}
        records = engine.metrics.iterations
        new = min(engine.metrics.num_iterations - before, len(records))
        return outputs, transfers, [records[i] for i in range(len(records) - new, len(records))]

    def drop(self, handles: Sequence[int]) -> None:
        for h in handles:
            self.connector.holds.drop(h)

    def peer_down(self, rank: int) -> None:
        if self.connector is not None:
            self.connector.broken.add(rank)

    def pool(self) -> dict[str, int]:
        sched = self.engine.scheduler
        c = self.connector
        return {"num_blocks": sched.kv.pool.num_blocks, "num_used_blocks": sched.kv.pool.num_used_blocks,
                "num_held_blocks": sched.kv.num_held_blocks, "num_requests": len(sched.requests),
                "num_holds": 0 if c is None else len(c.holds), "blocks_sent": 0 if c is None else c.blocks_sent,
                "blocks_received": 0 if c is None else c.blocks_received}

    def stats(self) -> Stats:
        return self.engine.stats()

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()


_COMMANDS = ("add", "abort", "step", "peer_down", "pool", "stats", "reset_stats", "reset_prefix_cache")


def _error(e: BaseException) -> tuple[str, str]:
    return ("ValueError" if isinstance(e, ValueError) else "RuntimeError", f"{e}" if isinstance(e, ValueError)
            else f"{type(e).__name__}: {e}")


def _instance_main(conn: Any, spec: InstanceSpec, port: int, parent_pid: int) -> None:
    """Entry point of an instance process: build the engine, then serve the router's commands until the pipe
    closes or says ``close``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the router, which stops the instances
    _watch_parent(parent_pid)
    torch.set_num_threads(spec.num_threads)
    try:
        connector = None
        if spec.rank is not None:
            store = dist.TCPStore("127.0.0.1", port, spec.world_size, is_master=False,
                                  timeout=timedelta(seconds=START_TIMEOUT))
            dist.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.world_size,
                                    timeout=timedelta(days=7))  # the sender waits for requests this long
            connector = P2PKVConnector("producer" if spec.role == PREFILL else "consumer", spec.transfer_timeout)
        child = _Child(spec, connector)
        conn.send(("ok", child.ready(), child.load()))
    except BaseException as e:
        conn.send(("error", _error(e), None))
        os._exit(1)
    while True:
        try:
            op, args, drops = conn.recv()
        except (EOFError, OSError):  # the router is gone
            os._exit(0)
        if op == "close":
            conn.send(("ok", None, None))
            os._exit(0)
        try:
            if drops:
                child.drop(drops)
            child.release_sent()
            result = getattr(child, op)(*args) if op in _COMMANDS else None
            child.release_sent()
            reply = ("ok", result, child.load())
        except Exception as e:
            if not isinstance(e, ValueError):
                logger.exception("instance %s: command %s failed", spec.name, op)
            reply = ("error", _error(e), child.load())
        conn.send(reply)


# ---------------------------------------------------------------------------------------------------- the router


class InstanceLost(RuntimeError):
    """An instance process exited (the message says which and how)."""


@dataclass(slots=True, eq=False)
class Instance:
    """The router's handle on one instance process: its last reported load ``(pending prefill tokens, KV
    demand)``, whether it has work, and why it is gone (``dead``)."""

    spec: InstanceSpec
    process: Any
    conn: Any
    load: tuple[int, int] = (0, 0)
    busy: bool = False
    snapshot: EngineSnapshot | None = None
    dead: str | None = None
    stopped: bool = False  # dead because the router stopped it (the instances it needs are gone), not lost
    stepping: bool = False
    step_started: float = 0.0
    requests: set[str] = field(default_factory=set)
    drops: list[int] = field(default_factory=list)
    """Handles of held K/V the decode side no longer needs: sent with the next command (no round trip of its
    own; an idle prefill instance gets them with its next request)."""

    @property
    def name(self) -> str:
        return self.spec.name

    def send(self, op: str, *args: Any) -> None:
        try:
            self.conn.send((op, args, self.drops))
            self.drops = []
        except (BrokenPipeError, OSError):
            self.check_alive()
            raise InstanceLost(f"instance {self.name} (pid {self.process.pid}) closed its pipe") from None

    def receive(self, timeout: float | None = None) -> Any:
        """The reply to the last command; raises ``InstanceLost`` within ``_POLL`` s of the process's exit,
        ``ValueError``/``RuntimeError`` for a command that failed there."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.conn.poll(_POLL):
            self.check_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise InstanceLost(f"instance {self.name} did not answer within {timeout:.0f} s")
        try:
            status, result, load = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(_EXIT_WAIT)  # its exit code shows up a moment after the pipe closes
            self.check_alive()
            raise InstanceLost(f"instance {self.name} (pid {self.process.pid}) closed its pipe") from None
        if load is not None:
            self.load, self.busy, self.snapshot = (load[0], load[1]), load[2], load[3]
        if status == "error":
            kind, message = result
            raise (ValueError if kind == "ValueError" else RuntimeError)(message)
        return result

    def call(self, op: str, *args: Any) -> Any:
        self.send(op, *args)
        return self.receive()

    def check_alive(self) -> None:
        code = self.process.exitcode
        if code is not None:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise InstanceLost(f"instance {self.name} (pid {self.process.pid}) {how}")


class RecentIterations:
    """The last iterations of every instance, in the order the router got them (``num_iterations`` counts them
    all): what a server's metrics read after each step."""

    def __init__(self, window: int = 256) -> None:
        self.iterations: deque[IterationRecord] = deque(maxlen=window)
        self.num_iterations = 0

    def add(self, records: Sequence[IterationRecord]) -> None:
        self.iterations.extend(records)
        self.num_iterations += len(records)


def _stop(instances: list[Instance]) -> None:
    """Stop every instance process: ``close`` to the idle ones, then terminate, then kill (idempotent)."""
    for inst in instances:
        if inst.process.exitcode is None:
            try:
                inst.conn.send(("close", (), []))
            except (BrokenPipeError, OSError):
                pass
    deadline = time.monotonic() + _SHUTDOWN_GRACE
    for inst in instances:
        inst.process.join(max(deadline - time.monotonic(), 0.1))
    for inst in instances:
        if inst.process.is_alive():
            inst.process.terminate()
            inst.process.join(_SHUTDOWN_GRACE)
        if inst.process.is_alive():
            inst.process.kill()
            inst.process.join()
        inst.conn.close()


class ProcessEngine:
    """Instances of ``instances`` (``"2"``, ``"1P1D"``, ``"2P1D"``, a ``Layout``) as processes behind one router;
    see the module's docstring. options: ``LLMEngine`` options for every instance; ``prefill_options`` /
    ``decode_options`` override them for one role. num_threads: torch threads per instance. transfer_timeout:
    seconds one wait of a K/V transfer may take before the decode side recomputes the prompt. step_timeout:
    seconds an instance may take to answer a step (or any command while a step is in flight) before the router
    counts it lost, as if it had died: a hung instance (stopped, deadlocked) is killed, and its requests are
    rerouted or end with an error."""

    def __init__(self, model: str | Path | None = None, *, instances: str | Layout = "1P1D",
                 config: EngineConfig | None = None, prefill_options: dict[str, Any] | None = None,
                 decode_options: dict[str, Any] | None = None, num_threads: int = 1, transfer_timeout: float = 10.0,
                 step_timeout: float = 300.0, **options: Any) -> None:
        self.layout = instances if isinstance(instances, Layout) else Layout.parse(instances)
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads={num_threads!r} must be a positive integer")
        if isinstance(transfer_timeout, bool) or not isinstance(transfer_timeout, (int, float)) \
                or not transfer_timeout > 0:
            raise ValueError(f"transfer_timeout={transfer_timeout!r} must be > 0 (seconds)")
        if isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float)) or not step_timeout > 0:
            raise ValueError(f"step_timeout={step_timeout!r} must be > 0 (seconds)")
        self.step_timeout = float(step_timeout)
        if config is not None and (model is not None or options):
            raise TypeError("give either config= or the model and options, not both")
        base = config if config is not None else EngineConfig.from_options(model, **options)
        self.model_path = resolve_model(base.model)
        base = base.replace(model=str(self.model_path))
        configs = {COLOCATED: base, PREFILL: base.replace(**(prefill_options or {})),
                   DECODE: base.replace(**(decode_options or {}))}  # bad options fail here, before any process
        for c in configs.values():
            if c.tensor_parallel_size * c.pipeline_parallel_size != 1:
                raise ValueError("instances as processes: tensor_parallel_size and pipeline_parallel_size must be 1")
        self.tokenizer = _load_tokenizer(self.model_path)
        counts = {PREFILL: self.layout.prefill, DECODE: self.layout.decode, COLOCATED: self.layout.colocated}
        world = self.layout.prefill + self.layout.decode
        port = _free_port()
        self._store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=START_TIMEOUT)) if world else None
        ctx = mp.get_context("spawn")
        self.instances: dict[str, list[Instance]] = {PREFILL: [], DECODE: [], COLOCATED: []}
        self._all: list[Instance] = []
        rank = itertools.count()
        for role in (PREFILL, DECODE, COLOCATED):
            for i in range(counts[role]):
                spec = InstanceSpec(role, i, None if role == COLOCATED else next(rank), world, configs[role],
                                    num_threads, float(transfer_timeout))
                parent, child = ctx.Pipe()
                process = ctx.Process(target=_instance_main, args=(child, spec, port, os.getpid()), daemon=True,
                                      name=f"sarathi-lite-{spec.name}")
                process.start()
                child.close()
                inst = Instance(spec, process, parent)
                self.instances[role].append(inst)
                self._all.append(inst)
        self._finalizer = weakref.finalize(self, _stop, list(self._all))
        try:
            ready = [inst.receive(START_TIMEOUT) for inst in self._all]
        except BaseException:
            self.shutdown()
            raise
        self.config = base
        self.scheduler_config: SchedulerConfig = ready[-1][0]
        """A decode instance's (a replica's) scheduler config: its ``max_model_len`` bounds every request."""
        self.model_config: ModelConfig = ready[-1][1]
        self.metrics = RecentIterations()
        self._handles = itertools.count()
        self._requests: dict[str, tuple[Any, SamplingParams, float, int]] = {}
        self._where: dict[str, Instance] = {}
        self._held: dict[str, tuple[Instance, int]] = {}  # request id -> prefill instance holding its K/V, handle
        self.routes: dict[str, list[str]] = {}
        """request id -> the instances it went through, e.g. ``["prefill0", "decode1"]``."""
        self.transfers: dict[str, tuple[float, int]] = {}
        """request id -> ``(seconds, blocks)`` of its K/V transfer, measured on the decode instance."""
        self._errors: list[RequestOutput] = []  # requests ended with a lost instance, for the next step
        self._replies: list[tuple[Instance, Any]] = []  # step replies taken, not processed yet
        self._outputs: list[RequestOutput] = []  # outputs processed, for the next step to return

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request on the instance the router picks. Raises ``ValueError`` for bad input (nothing is
        queued then) or an id in use, ``EngineDeadError`` when no instance can take it."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str):
            raise ValueError(f"request_id={request_id!r} must be a string")
        if request_id in self._where:
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request")
        token_ids = self._tokenize(request_id, prompt)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self._requests[request_id] = (prompt, params, arrival, len(token_ids))
        self.routes[request_id] = []
        for records in (self.routes, self.transfers):  # bounded: a server runs for long
            while len(records) > RECORD_WINDOW:
                del records[next(iter(records))]
        try:
            self._place(request_id, token_ids)
        except BaseException:
            self._requests.pop(request_id, None)
            self.routes.pop(request_id, None)
            raise

    def _tokenize(self, request_id: str, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {request_id!r}: text prompts need a tokenizer in {self.model_path}")
            check_text(f"request {request_id!r}: prompt", prompt)
            return self.tokenizer(prompt).input_ids
        if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
            raise ValueError(f"request {request_id!r}: prompt must be text or a list of token ids, got "
                             f"{type(prompt).__name__}")
        return check_token_ids(f"request {request_id!r}", prompt, self.model_config.vocab_size)

    def _place(self, request_id: str, token_ids: list[int]) -> None:
        """Add a request (new, or back from a lost prefill instance) where the router says; an instance found dead
        on the way is routed around."""
        prompt, params, arrival, _ = self._requests[request_id]
        for _ in range(len(self._all)):
            loads = {role: [None if i.dead else i.load for i in self.instances[role]] for role in self.instances}
            try:
                role, index = route_by_load(len(token_ids), self.layout, loads[COLOCATED], loads[PREFILL],
                                            loads[DECODE])
            except RuntimeError as e:
                raise EngineDeadError(f"{e}: {self._deaths()}") from None
            inst = self.instances[role][index]
            try:
                if role == PREFILL:
                    handle = next(self._handles)
                    self._call(inst, "add", request_id, token_ids,
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), arrival, 0, handle,
                               None)
                    self._held[request_id] = (inst, handle)
                else:
                    self._call(inst, "add", request_id, prompt, params, arrival, 0, None, None)
            except InstanceLost:
                continue
            self._where[request_id] = inst
            inst.requests.add(request_id)
            self.routes[request_id].append(inst.name)
            return
        raise EngineDeadError(f"no instance took request {request_id!r}: {self._deaths()}")

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request wherever it is (waiting or mid-prefill on a prefill instance, on its way or waiting for
        its K/V or decoding on a decode instance) and free its blocks on every instance. Raises ``ValueError`` for
        an unknown id, or one that finished in a step whose outputs the next ``step`` returns."""
        inst = self._where.get(request_id)
        if inst is not None and inst.stepping:  # its step in flight may have moved or finished it
            self._finish_step(inst)
            self._process()
            inst = self._where.get(request_id)
        if inst is None:
            raise ValueError(f"request_id={request_id!r} is unknown or already finished")
        try:
            output = self._call(inst, "abort", request_id)
        except InstanceLost:
            output = self._ended(request_id, "abort")
        self._forget(request_id)
        return output

    def has_unfinished_requests(self) -> bool:
        """Whether a request is unfinished or outputs wait for the next ``step`` to return them."""
        return bool(self._where or self._outputs or self._errors or self._replies)

    def get_num_unfinished_requests(self) -> int:
        return len(self._where)

    def reset_prefix_cache(self) -> int:
        return sum(self._call(i, "reset_prefix_cache") for i in self._live())

    # ------------------------------------------------------------------ one round

    def step(self) -> list[RequestOutput]:
        """Start a step on every instance with work that is not stepping already, wait until at least one step
        has ended (instances step independently: a decode instance never waits for a prefill instance's long
        chunk), and process what ended: prompts that finished prefilling go to the decode instance the router
        picks. Returns the outputs of decode instances and replicas (a prefill instance's one token is not an
        output: the decode instance samples the first token again), and ``finish_reason="error"`` outputs for
        requests lost with an instance. Raises ``EngineDeadError`` when a role the layout needs has no instance
        left."""
        for inst in self._live():
            if inst.busy and not inst.stepping:
                try:
                    inst.send("step")
                    inst.stepping, inst.step_started = True, time.monotonic()
                except InstanceLost as e:
                    self._lost(inst, str(e))
        stepping = [i for i in self._live() if i.stepping]
        while stepping:
            ready = mp_connection.wait([i.conn for i in stepping], timeout=_POLL)
            done = [i for i in stepping if i.conn in ready or i.process.exitcode is not None]
            if done:
                for inst in done:
                    self._finish_step(inst)
                break
            hung = [i for i in stepping if time.monotonic() - i.step_started > self.step_timeout]
            if hung:
                for inst in hung:
                    self._hung(inst)
                break
        self._process()
        outputs, self._outputs = self._outputs, []
        self._check_roles()
        return outputs

    def _finish_step(self, inst: Instance) -> None:
        """Take the reply of ``inst``'s step in flight (it is processed by ``_process``); an instance that does
        not answer within ``step_timeout`` of the step's start is lost (``_hung``)."""
        left = max(self.step_timeout - (time.monotonic() - inst.step_started), _POLL)
        try:
            reply = inst.receive(left)
        except InstanceLost as e:
            if inst.process.exitcode is None:  # alive, and silent past the bound
                self._hung(inst)
            else:
                inst.stepping = False
                self._lost(inst, str(e))
            return
        inst.stepping = False
        self._replies.append((inst, reply))

    def _hung(self, inst: Instance) -> None:
        """``inst`` has not answered its step within ``step_timeout`` s: kill it and handle it as lost."""
        inst.stepping = False
        pid = inst.process.pid
        inst.process.kill()
        inst.process.join(_SHUTDOWN_GRACE)
        self._lost(inst, f"instance {inst.name} (pid {pid}) did not finish a step within {self.step_timeout:g} s "
                         f"(hung); it was killed")

    def _process(self) -> None:
        """Process the step replies taken so far: outputs to ``_outputs``, prefilled prompts handed over."""
        while self._replies:
            inst, (found, transfers, iterations) = self._replies.pop(0)
            if inst.dead:
                continue
            self.transfers.update(transfers)
            self.metrics.add(iterations)
            if inst.spec.role == PREFILL:
                for out in found:
                    if out.finish_reason == "error":
                        self._forget(out.request_id)
                        self._outputs.append(out)
                    elif out.finished and out.request_id in self._where:
                        self._hand_over(out.request_id)
                continue
            for out in found:
                if out.request_id in self._held and (out.new_token_ids or out.finished):
                    self._drop_hold(out.request_id)  # past its load: the prefill side's blocks can go
                if out.finished:
                    self._forget(out.request_id)
            self._outputs += found
        self._outputs += self._errors
        self._errors = []

    def _hand_over(self, request_id: str) -> None:
        """A prompt was prefilled and its blocks are held: add the request to the decode instance the router
        picks (another one if that one turns out dead), to load the K/V of all but its last prompt token."""
        prompt, params, arrival, prompt_len = self._requests[request_id]
        source, handle = self._held[request_id]
        source.requests.discard(request_id)
        self._where.pop(request_id, None)
        decode = self.instances[DECODE]
        error = "no decode instance is left"
        for _ in decode:
            try:
                inst = decode[pick_decode_by_load([None if i.dead else i.load for i in decode])]
            except RuntimeError:
                break
            try:
                self._call(inst, "add", request_id, prompt, params, arrival, prompt_len - 1, handle,
                           source.spec.rank)
            except InstanceLost as e:
                error = str(e)
                continue
            except (ValueError, RuntimeError) as e:
                error = f"instance {inst.name} did not take the request: {e}"
                break
            self._where[request_id] = inst
            inst.requests.add(request_id)
            self.routes[request_id].append(inst.name)
            return
        self._errors.append(self._ended(request_id, "error", f"{error}: {self._deaths()}"))
        self._forget(request_id)

    def _drop_hold(self, request_id: str) -> None:
        """The decode side no longer needs the K/V the prefill side holds for ``request_id``."""
        held = self._held.pop(request_id, None)
        if held is not None and not held[0].dead:
            held[0].drops.append(held[1])

    def _forget(self, request_id: str) -> None:
        inst = self._where.pop(request_id, None)
        if inst is not None:
            inst.requests.discard(request_id)
        if request_id in self._held:
            self._drop_hold(request_id)
        self._requests.pop(request_id, None)

    # ------------------------------------------------------------------ faults

    def _call(self, inst: Instance, op: str, *args: Any) -> Any:
        """``inst.call``; a lost instance is handled (its requests rerouted or ended) before ``InstanceLost`` is
        raised on. Outputs of requests it ended come with the next ``step``."""
        if inst.stepping:
            self._finish_step(inst)
            if inst.dead:
                raise InstanceLost(inst.dead)
        try:
            return inst.call(op, *args)
        except InstanceLost as e:
            self._lost(inst, str(e))
            raise

    def _lost(self, inst: Instance, reason: str) -> None:
        """``inst`` died: reroute its unfinished prompts (prefill) or end its requests with an error (their outputs
        come with the next ``step``)."""
        if inst.dead:
            return
        inst.dead = reason
        logger.error("%s", reason)
        if inst.spec.rank is not None:
            for other in self._live():
                try:
                    self._call(other, "peer_down", inst.spec.rank)
                except (InstanceLost, RuntimeError, ValueError):
                    pass
        for rid, (holder, _) in list(self._held.items()):
            if holder is inst and self._where.get(rid) is not inst:
                del self._held[rid]  # on a decode instance already: its load fails, it recomputes
        for rid in sorted(inst.requests):
            inst.requests.discard(rid)
            self._where.pop(rid, None)
            self._drop_hold(rid)
            if inst.spec.role == PREFILL:
                logger.warning("request %r: its prefill instance %s is gone; routing it again", rid, inst.name)
                try:
                    self._place(rid, self._tokenize(rid, self._requests[rid][0]))
                    continue
                except (EngineDeadError, InstanceLost, ValueError, RuntimeError) as e:
                    reason = f"{reason}; rerouting failed: {e}"
            self._errors.append(self._ended(rid, "error", f"{reason}; the request was lost with it"))
            self._forget(rid)

    def _ended(self, request_id: str, reason: str, error: str | None = None) -> RequestOutput:
        prompt, _, arrival, prompt_len = self._requests.get(request_id, (None, None, 0.0, 0))
        metrics = RequestMetrics(request_id, arrival, prompt_len, finished_time=time.perf_counter(),
                                 finish_reason=reason)
        out = RequestOutput(request_id, prompt if isinstance(prompt, str) else None,
                            [] if isinstance(prompt, str) or prompt is None else list(prompt), [], "", 0, reason,
                            metrics, token_ids=[], text="")
        out.error = error
        return out

    def _check_roles(self) -> None:
        """Raise ``EngineDeadError`` when a role the layout needs has no live instance, after stopping the
        instances left (a prefill instance cannot serve without a decode instance: its process and KV blocks
        would be held for nothing)."""
        needed = (COLOCATED,) if self.layout.colocated else (DECODE,)
        for role in needed:
            if all(i.dead for i in self.instances[role]):
                reason = f"no {role} instance is left: {self._deaths()}"
                rest = self._live()
                if rest:
                    logger.error("%s; stopping the other instances (%s)", reason, ", ".join(i.name for i in rest))
                    _stop(rest)
                    for inst in rest:
                        inst.dead, inst.stopped, inst.stepping = f"instance {inst.name} was stopped: {reason}", \
                            True, False
                    self._where.clear()
                    self._held.clear()
                raise EngineDeadError(reason)

    def check_health(self) -> None:
        """Between steps (``AsyncLLMEngine`` calls it while idle): notice instances that exited, handle them as
        a step would (their requests rerouted or ended), and raise ``EngineDeadError`` if a role the layout needs
        has none left (the other instances are stopped then)."""
        for inst in self._live():
            if not inst.stepping and inst.process.exitcode is not None:
                try:
                    inst.check_alive()
                except InstanceLost as e:
                    self._lost(inst, str(e))
        self._check_roles()

    def instance_states(self) -> dict[str, dict[str, int]]:
        """Per role of the layout: instances ``alive``, ``lost`` (exited or hung) and ``stopped`` (by the router,
        once the role they need was gone). Reads plain fields only: safe from any thread."""
        states = {}
        for role, insts in self.instances.items():
            if insts:
                stopped = sum(i.stopped for i in insts)
                lost = sum(i.dead is not None for i in insts) - stopped
                states[role] = {"alive": len(insts) - lost - stopped, "lost": lost, "stopped": stopped}
        return states

    def _deaths(self) -> str:
        return "; ".join(i.dead for i in self._all if i.dead) or "all instances live"

    def _live(self) -> list[Instance]:
        return [i for i in self._all if not i.dead]

    # ------------------------------------------------------------------ records

    def stats(self) -> Stats:
        """Per-request records of the instances that produce outputs (decode instances and replicas; TTFT from
        the arrival, so it includes the prefill elsewhere) and every live instance's iterations."""
        requests, iterations = [], []
        for inst in self._live():
            s = self._call(inst, "stats")
            if inst.spec.role != PREFILL:
                requests += s.requests
            iterations += s.iterations
        return Stats(requests, iterations)

    def reset_stats(self) -> None:
        for inst in self._live():
            self._call(inst, "reset_stats")
        self.transfers.clear()

    def snapshot(self) -> EngineSnapshot:
        """The live instances' queues and KV pools added up, as of their last replies (each instance's part is one
        whole record; safe from any thread)."""
        shots = [i.snapshot for i in self._all if not i.dead and i.snapshot is not None]
        total = sum(s.kv_blocks_total for s in shots)
        return EngineSnapshot(
            num_steps=sum(s.num_steps for s in shots), num_waiting=sum(s.num_waiting for s in shots),
            num_running=sum(s.num_running for s in shots), kv_blocks_used=sum(s.kv_blocks_used for s in shots),
            kv_blocks_total=total or 1, kv_blocks_cached=sum(s.kv_blocks_cached for s in shots),
            prefix_hit_rate=sum(s.prefix_hit_rate for s in shots) / len(shots) if shots else 0.0)

    def pools(self) -> dict[str, dict[str, int]]:
        """Each live instance's KV pool and transfer counters, after it has applied the pending drops:
        ``num_blocks``, ``num_used_blocks``, ``num_held_blocks``, ``num_requests``, ``num_holds`` (prompts held for
        sending), ``blocks_sent``, ``blocks_received``."""
        return {i.name: self._call(i, "pool") for i in self._live()}

    def shutdown(self) -> None:
        """Stop every instance process (idempotent; also runs when the engine is collected and at exit)."""
        self._finalizer()
