"""Instances as processes: colocated replicas, xPyD disaggregated or conditional, or a hybrid (``xPHyDH``:
prefill-heavy and decode-heavy colocated instances, ``routing.HybridRule``), each instance an ``LLMEngine`` in its
own spawned process, behind one router in the caller's process.

``ProcessEngine`` has the step API of ``LLMEngine`` (``add_request``, ``step``, ``abort_request``,
``has_unfinished_requests``, ``stats``) and routes and hands requests over with
``sarathi_lite.scheduler.coordinator`` (as the in-process ``DisaggregatedEngine`` and the simulator do), on the
loads every instance reports with each reply.

- Each instance loads the weights itself from the same model path and has its own KV pool, scheduler and policy
  options (``prefill_options`` / ``decode_options`` override the common ones per role); its torch thread count is
  ``num_threads`` (default 1, so instances on a CPU do not fight over cores).
- Prefill and decode instances are the ranks of one gloo group; the K/V of a prompt moves from the prefill rank
  to the decode rank over point-to-point sends, all layers of the blocks the decode side lacks in one tensor
  (``sarathi_lite.engine.p2p_connector``). A prompt is prefilled as a request with ``max_tokens=1`` whose blocks
  stay held on the prefill instance until the decode instance acknowledges them (or the request ends there);
  the decode instance admits it with ``num_external_tokens = prompt_len - 1`` and computes the last prompt token
  itself, so greedy outputs equal one engine's token for token. A transfer that fails or outlasts
  ``transfer_timeout`` seconds makes the decode instance recompute the prompt (one warning). In a hybrid the
  prefill-heavy instances are the prefill ranks and the decode-heavy ones the decode ranks; only a request the
  rule moves is added prefill only (with a handle); the others are served whole where they are prefilled.
- The router talks to each instance over a pipe, in typed messages (``engine/instance_rpc.py``); an instance's
  side is ``engine/instance_child.py``. Instances step independently: ``step()`` starts a step on every
  instance with work that is not stepping already and returns once at least one has ended, so forward passes run
  at the same time and a decode instance never waits for a prefill instance's chunk.
- Faults: an instance that dies is noticed within ~50 ms of its exit, busy or idle (a reply never hangs on a dead
  process, a step checks the instances it does not wait for, and ``check_health`` runs between steps).
  A dead prefill instance's unfinished prompts go to another prefill instance, or, with none left, to a decode
  instance that prefills them itself; a dead decode instance or replica ends its requests with
  ``finish_reason="error"`` (the message names the instance), and new requests go to the others; with none of a
  needed role left, ``step`` and ``add_request`` raise ``EngineDeadError``. In a hybrid, a dead instance's
  requests prefilled only there are routed again and the others end with an error; it serves on while any
  instance of either kind is left. Children are daemons, exit when the
  router's pipe closes or its process goes away, and ``shutdown()`` (also run when the engine is collected and
  at interpreter exit) stops them. Scripts need the ``if __name__ == "__main__":`` guard of the spawn start
  method.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from sarathi_lite.engine import instance_rpc as rpc
from sarathi_lite.engine.config import EngineConfig
from sarathi_lite.engine.disagg_engine import PREFILL_ONLY, deployment_stats
from sarathi_lite.engine.errors import EngineDeadError
from sarathi_lite.engine.instance_child import START_TIMEOUT, InstanceSpec, instance_main
from sarathi_lite.engine.interface import Engine
from sarathi_lite.engine.llm_engine import load_tokenizer
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.prompts import tokenize_prompt
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.engine.snapshot import EngineSnapshot
from sarathi_lite.engine.worker import EXIT_WAIT, SHUTDOWN_GRACE, free_port, stop_process
from sarathi_lite.metrics import IterationRecord, RequestMetrics, Stats
from sarathi_lite.models.builtin import resolve_model
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.scheduler import SchedulerConfig
from sarathi_lite.scheduler.coordinator import Coordinator, Hold, InstanceGone, NoInstanceLeft, Refused, RequestRecord
from sarathi_lite.scheduler.routing import COLOCATED, DECODE, PREFILL, Layout, Load

logger = logging.getLogger(__name__)

RECORD_WINDOW = 100_000
"""``routes`` and ``transfers`` keep the records of at most this many most recent requests."""
_POLL = 0.05  # seconds between liveness checks while waiting for a reply


class InstanceLost(InstanceGone):
    """An instance process exited (the message says which and how)."""


@dataclass(slots=True)
class Submitted:
    """What the router adds a request with (its ``RequestRecord``'s payload): the prompt as given, its token ids,
    its sampling parameters, and the handle its K/V is held under on the prefill instance it was last placed on."""

    prompt: Any
    token_ids: list[int]
    params: SamplingParams
    handle: int | None = None


@dataclass(slots=True, eq=False)
class InstanceProcess:
    """The router's handle on one instance process, a ``coordinator.Instance``: its last reported load
    ``(pending prefill tokens, KV demand)``, whether it has work, and why it is gone (``dead``). The coordinator's
    commands go through ``router`` (the ``ProcessEngine``: it finishes a step in flight first and handles a loss)."""

    spec: InstanceSpec
    process: Any
    conn: Any
    router: Any = None
    reported: tuple[int, int] = (0, 0)
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

    @property
    def role(self) -> str:
        return self.spec.role

    # ------------------------------------------------------------------ as a coordinator.Instance

    def load(self) -> Load:
        return None if self.dead else self.reported

    def add(self, record: RequestRecord, prefill_only: bool, num_external_tokens: int, hold: Hold | None) -> None:
        sub: Submitted = record.payload
        rid = record.request_id
        if prefill_only:
            sub.handle = next(self.router.handles)
            command = rpc.AddRequest(rid, sub.token_ids, PREFILL_ONLY, record.arrival, 0, sub.handle)
        elif hold is None:
            command = rpc.AddRequest(rid, sub.prompt, sub.params, record.arrival)
        else:
            command = rpc.AddRequest(rid, sub.prompt, sub.params, record.arrival, num_external_tokens, hold.token,
                                     hold.source.spec.rank)
        try:
            self.router.call(self, command)
        except InstanceLost:
            raise
        except (ValueError, RuntimeError) as e:
            if hold is None:
                raise
            raise Refused(f"instance {self.name} did not take the request: {e}") from None

    def release(self, request_id: str, token: Any) -> None:
        if not self.dead:
            self.drops.append(token)

    # ------------------------------------------------------------------ the pipe

    def send(self, command: rpc.Command) -> None:
        command.drops = self.drops
        try:
            self.conn.send(command)
            self.drops = []
        except (BrokenPipeError, OSError):
            self.check_alive()
            raise InstanceLost(f"instance {self.name} (pid {self.process.pid}) closed its pipe") from None

    def receive(self, timeout: float | None = None) -> Any:
        """The result of the last command; raises ``InstanceLost`` within ``_POLL`` s of the process's exit,
        ``ValueError``/``RuntimeError`` for a command that failed there."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.conn.poll(_POLL):
            self.check_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise InstanceLost(f"instance {self.name} did not answer within {timeout:.0f} s")
        try:
            reply: rpc.Reply = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(EXIT_WAIT)  # its exit code shows up a moment after the pipe closes
            self.check_alive()
            raise InstanceLost(f"instance {self.name} (pid {self.process.pid}) closed its pipe") from None
        if reply.load is not None:
            load = reply.load
            self.reported, self.busy, self.snapshot = (load.pending_prefill_tokens, load.kv_demand), load.busy, \
                load.snapshot
        if reply.error is not None:
            raise reply.error.exception()
        return reply.result

    def call(self, command: rpc.Command) -> Any:
        self.send(command)
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


def _spawn(layout: Layout, configs: dict[str, EngineConfig], num_threads: int, transfer_timeout: float,
           router: Any) -> tuple[Any, dict[str, list[InstanceProcess]]]:
    """Start the instance processes of ``layout`` (prefill, decode, then colocated ones; prefill and decode
    instances are the ranks of one KV group, whose rendezvous store this process hosts). Returns the store and
    the instances by role."""
    counts = {PREFILL: layout.prefill, DECODE: layout.decode, COLOCATED: layout.colocated}
    world = layout.prefill + layout.decode
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=START_TIMEOUT)) if world else None
    ctx = mp.get_context("spawn")
    instances: dict[str, list[InstanceProcess]] = {PREFILL: [], DECODE: [], COLOCATED: []}
    rank = itertools.count()
    for role in (PREFILL, DECODE, COLOCATED):
        for i in range(counts[role]):
            spec = InstanceSpec(role, i, None if role == COLOCATED else next(rank), world, configs[role],
                                num_threads, transfer_timeout)
            parent, child = ctx.Pipe()
            process = ctx.Process(target=instance_main, args=(child, spec, port, os.getpid()), daemon=True,
                                  name=f"sarathi-lite-{spec.name}")
            process.start()
            child.close()
            instances[role].append(InstanceProcess(spec, process, parent, router))
    return store, instances


def _stop(processes: list[tuple[Any, Any]]) -> None:
    """Stop every instance process (``(process, pipe)``): ``Close`` to the idle ones, then terminate, then kill
    (idempotent)."""
    for process, conn in processes:
        if process.exitcode is None:
            try:
                conn.send(rpc.Close())
            except (BrokenPipeError, OSError):
                pass
    deadline = time.monotonic() + SHUTDOWN_GRACE
    for process, _ in processes:
        process.join(max(deadline - time.monotonic(), 0.1))
    for process, conn in processes:
        stop_process(process)
        conn.close()


def _check_options(num_threads: Any, transfer_timeout: Any, step_timeout: Any) -> None:
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads={num_threads!r} must be a positive integer")
    if isinstance(transfer_timeout, bool) or not isinstance(transfer_timeout, (int, float)) \
            or not transfer_timeout > 0:
        raise ValueError(f"transfer_timeout={transfer_timeout!r} must be > 0 (seconds)")
    if isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float)) or not step_timeout > 0:
        raise ValueError(f"step_timeout={step_timeout!r} must be > 0 (seconds)")


def _role_configs(model: str | Path | None, config: EngineConfig | None, prefill_options: dict[str, Any] | None,
                  decode_options: dict[str, Any] | None, options: dict[str, Any]) -> dict[str, EngineConfig]:
    """Every role's engine config (bad options fail here, before any process starts)."""
    if config is not None and (model is not None or options):
        raise TypeError("give either config= or the model and options, not both")
    base = config if config is not None else EngineConfig.from_options(model, **options)
    base = base.replace(model=str(resolve_model(base.model)))
    configs = {COLOCATED: base, PREFILL: base.replace(**(prefill_options or {})),
               DECODE: base.replace(**(decode_options or {}))}
    for c in configs.values():
        if c.tensor_parallel_size * c.pipeline_parallel_size != 1:
            raise ValueError("instances as processes: tensor_parallel_size and pipeline_parallel_size must be 1")
    return configs


class InstanceGroup:
    """The instance processes of a layout, apart from the routing: started (prefill, decode, then colocated ones;
    their ``add`` goes through ``router``, a weak proxy of the ``ProcessEngine``), read (states, snapshots) and
    stopped (``shutdown`` also runs when the group is collected and at interpreter exit)."""

    def __init__(self, layout: Layout, configs: dict[str, EngineConfig], num_threads: int, transfer_timeout: float,
                 router: Any) -> None:
        self._store, self.by_role = _spawn(layout, configs, num_threads, transfer_timeout, router)
        self.all = [inst for role in (PREFILL, DECODE, COLOCATED) for inst in self.by_role[role]]
        self._finalizer = weakref.finalize(self, _stop, [(i.process, i.conn) for i in self.all])

    def ready(self) -> list[rpc.Ready]:
        """Wait until every instance has loaded its model (``START_TIMEOUT``); stops them all if one fails."""
        try:
            return [inst.receive(START_TIMEOUT) for inst in self.all]
        except BaseException:
            self.shutdown()
            raise

    def live(self) -> list[InstanceProcess]:
        return [i for i in self.all if not i.dead]

    def deaths(self) -> str:
        return "; ".join(i.dead for i in self.all if i.dead) or "all instances live"

    def stop_live(self, reason: str) -> None:
        """Stop the live instances, marked ``stopped``: ``reason`` says why."""
        rest = self.live()
        logger.error("%s; stopping the other instances (%s)", reason, ", ".join(i.name for i in rest))
        _stop([(i.process, i.conn) for i in rest])
        for inst in rest:
            inst.dead, inst.stopped, inst.stepping = f"instance {inst.name} was stopped: {reason}", True, False

    def states(self) -> dict[str, dict[str, int]]:
        """Per role: instances ``alive``, ``lost`` (exited or hung) and ``stopped`` (by the router, once the role
        they need was gone). Reads plain fields only: safe from any thread."""
        states = {}
        for role, insts in self.by_role.items():
            if insts:
                stopped = sum(i.stopped for i in insts)
                lost = sum(i.dead is not None for i in insts) - stopped
                states[role] = {"alive": len(insts) - lost - stopped, "lost": lost, "stopped": stopped}
        return states

    def snapshot(self) -> EngineSnapshot:
        """The live instances' queues and KV pools added up, as of their last replies (each instance's part is one
        whole record; safe from any thread)."""
        shots = [i.snapshot for i in self.all if not i.dead and i.snapshot is not None]
        total = sum(s.kv_blocks_total for s in shots)
        return EngineSnapshot(
            num_steps=sum(s.num_steps for s in shots), num_waiting=sum(s.num_waiting for s in shots),
            num_running=sum(s.num_running for s in shots), kv_blocks_used=sum(s.kv_blocks_used for s in shots),
            kv_blocks_total=total or 1, kv_blocks_cached=sum(s.kv_blocks_cached for s in shots),
            prefix_hit_rate=sum(s.prefix_hit_rate for s in shots) / len(shots) if shots else 0.0)

    def shutdown(self) -> None:
        """Stop every instance process (idempotent)."""
        self._finalizer()


class ProcessEngine(Engine):
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
        _check_options(num_threads, transfer_timeout, step_timeout)
        self.step_timeout = float(step_timeout)
        configs = _role_configs(model, config, prefill_options, decode_options, options)
        self.model_path = Path(configs[COLOCATED].model)
        self.tokenizer = load_tokenizer(self.model_path)
        self.group = InstanceGroup(self.layout, configs, num_threads, float(transfer_timeout), weakref.proxy(self))
        self.instances, self._all = self.group.by_role, self.group.all
        ready = self.group.ready()
        self.config = configs[COLOCATED]
        self.scheduler_config: SchedulerConfig = ready[-1].scheduler_config
        """A decode instance's (a replica's) scheduler config: its ``max_model_len`` bounds every request."""
        self.model_config: ModelConfig = ready[-1].model_config
        self.metrics = RecentIterations()
        self.handles = itertools.count()
        """The handles prefill instances hold K/V under."""
        self.coordinator = Coordinator(self.layout, self.instances, max_routes=RECORD_WINDOW)
        self.routes = self.coordinator.routes
        """request id -> the instances it went through, e.g. ``["prefill0", "decode1"]``."""
        self.transfers: dict[str, tuple[float, int]] = {}
        """request id -> ``(seconds, blocks)`` of its K/V transfer, measured on the decode instance."""
        self._errors: list[RequestOutput] = []  # requests ended with a lost instance, for the next step
        self._replies: list[tuple[InstanceProcess, rpc.StepDone]] = []  # step replies taken, not processed yet
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
        if request_id in self.coordinator.requests:
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request")
        _, token_ids = tokenize_prompt(self.tokenizer, self.model_path, self.model_config.vocab_size, request_id,
                                       prompt)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        while len(self.transfers) > RECORD_WINDOW:  # bounded: a server runs for long (routes: the coordinator's)
            del self.transfers[next(iter(self.transfers))]
        try:
            self.coordinator.arrive(request_id, len(token_ids), arrival, Submitted(prompt, token_ids, params))
        except NoInstanceLeft as e:
            raise EngineDeadError(f"{e}: {self._deaths()}") from None

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request wherever it is (waiting or mid-prefill on a prefill instance, on its way or waiting for
        its K/V or decoding on a decode instance) and free its blocks on every instance. Raises ``ValueError`` for
        an unknown id, or one that finished in a step whose outputs the next ``step`` returns."""
        inst = self.coordinator.where(request_id)
        if inst is not None and inst.stepping:  # its step in flight may have moved or finished it
            self._finish_step(inst)
            self._process()
            inst = self.coordinator.where(request_id)
        if inst is None:
            raise ValueError(f"request_id={request_id!r} is unknown or already finished")
        try:
            output = self.call(inst, rpc.AbortRequest(request_id))
        except InstanceLost:
            output = self._ended(request_id, "abort")
        self._forget(request_id)
        return output

    def has_unfinished_requests(self) -> bool:
        """Whether a request is unfinished or outputs wait for the next ``step`` to return them."""
        return bool(self.coordinator.requests or self._outputs or self._errors or self._replies)

    def get_num_unfinished_requests(self) -> int:
        return len(self.coordinator.requests)

    def reset_prefix_cache(self) -> int:
        return sum(self.call(i, rpc.ResetPrefixCache()) for i in self._live())

    # ------------------------------------------------------------------ one round

    def step(self) -> list[RequestOutput]:
        """Start a step on every instance with work that is not stepping already, wait until at least one step
        has ended (instances step independently: a decode instance never waits for a prefill instance's long
        chunk), and process what ended: prompts that finished prefilling go to the decode instance the router
        picks. Returns the outputs of decode instances and replicas (a prefill instance's one token is not an
        output: the decode instance samples the first token again), and ``finish_reason="error"`` outputs for
        requests lost with an instance. Raises ``EngineDeadError`` when a role the layout needs has no instance
        left. An instance that is not stepping (an idle prefill instance while decodes run) and has exited is
        noticed here too, and every ``_POLL`` seconds of a long wait: ``/health`` says so within a step, busy or
        idle."""
        self._notice_exits()
        for inst in self._live():
            if inst.busy and not inst.stepping:
                try:
                    inst.send(rpc.Step())
                    inst.stepping, inst.step_started = True, time.monotonic()
                except InstanceLost as e:
                    self._lost(inst, str(e))
        stepping = [i for i in self._live() if i.stepping]
        while stepping:
            ready = mp_connection.wait([i.conn for i in stepping], timeout=_POLL)
            done = [i for i in stepping if i.conn in ready or i.process.exitcode is not None]
            if done:
                for inst in done:
                    if inst.stepping:  # handling an earlier one's loss may have taken its reply already
                        self._finish_step(inst)
                break
            hung = [i for i in stepping if time.monotonic() - i.step_started > self.step_timeout]
            if hung:
                for inst in hung:
                    self._hung(inst)
                break
            self._notice_exits()
            if any(not i.stepping for i in stepping):  # a loss took a step's reply (its PeerDown waits for it)
                break
        self._process()
        outputs, self._outputs = self._outputs, []
        self._check_roles()
        return outputs

    def _finish_step(self, inst: InstanceProcess) -> None:
        """Take the reply of ``inst``'s step in flight (it is processed by ``_process``); an instance that does
        not answer within ``step_timeout`` of the step's start is lost (``_hung``)."""
        left = max(self.step_timeout - (time.monotonic() - inst.step_started), _POLL)
        try:
            done = inst.receive(left)
        except InstanceLost as e:
            if inst.process.exitcode is None:  # alive, and silent past the bound
                self._hung(inst)
            else:
                inst.stepping = False
                self._lost(inst, str(e))
            return
        inst.stepping = False
        self._replies.append((inst, done))

    def _hung(self, inst: InstanceProcess) -> None:
        """``inst`` has not answered its step within ``step_timeout`` s: kill it and handle it as lost."""
        inst.stepping = False
        pid = inst.process.pid
        inst.process.kill()
        inst.process.join(SHUTDOWN_GRACE)
        self._lost(inst, f"instance {inst.name} (pid {pid}) did not finish a step within {self.step_timeout:g} s "
                         f"(hung); it was killed")

    def _process(self) -> None:
        """Process the step replies taken so far: outputs to ``_outputs``, prefilled prompts handed over."""
        while self._replies:
            inst, done = self._replies.pop(0)
            if inst.dead:
                continue
            self.transfers.update(done.transfers)
            self.metrics.add(done.iterations)
            for out in done.outputs:
                record = self.coordinator.requests.get(out.request_id)
                mine = record is not None and record.where is inst
                served_whole = mine and not record.prefill_only  # a hybrid's request decoded where prefilled
                if inst.role == PREFILL and not served_whole:  # prefilled only here
                    if out.finish_reason == "error":
                        self._forget(out.request_id)
                        self._outputs.append(out)
                    elif out.finished and mine:
                        self._hand_over(out.request_id)
                    continue  # its one token is not an output
                if out.request_id in self.coordinator.held and (out.new_token_ids or out.finished):
                    self.coordinator.release(out.request_id)  # past its load: the prefill side's blocks can go
                if out.finished:
                    self._forget(out.request_id)
                self._outputs.append(out)
        self._outputs += self._errors
        self._errors = []

    def _hand_over(self, request_id: str) -> None:
        """A prompt was prefilled, its blocks held under its handle: the coordinator hands it to a decode instance."""
        try:
            self.coordinator.hand_over(request_id, self.coordinator.requests[request_id].payload.handle)
        except NoInstanceLeft as e:
            self._errors.append(self._ended(request_id, "error", f"{e}: {self._deaths()}"))
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        """``request_id`` ended: forgotten, its K/V released (on a prefill instance still: its handle dropped)."""
        record = self.coordinator.requests.get(request_id)
        if record is not None and record.where is not None and record.prefill_only:
            record.where.release(request_id, record.payload.handle)
        self.coordinator.finish(request_id)

    # ------------------------------------------------------------------ faults

    def call(self, inst: InstanceProcess, command: rpc.Command) -> Any:
        """``inst.call``; a lost instance is handled (its requests rerouted or ended) before ``InstanceLost`` is
        raised on. Outputs of requests it ended come with the next ``step``."""
        if inst.stepping:
            self._finish_step(inst)
            if inst.dead:
                raise InstanceLost(inst.dead)
        try:
            return inst.call(command)
        except InstanceLost as e:
            self._lost(inst, str(e))
            raise

    def _lost(self, inst: InstanceProcess, reason: str) -> None:
        """``inst`` died: the other instances stop waiting for its K/V, and the coordinator reroutes its unfinished
        prompts (prefill) or ends its requests with an error (their outputs come with the next ``step``)."""
        if inst.dead:
            return
        inst.dead = reason
        logger.error("%s", reason)
        if inst.spec.rank is not None:
            for other in self._live():
                try:
                    self.call(other, rpc.PeerDown(inst.spec.rank))
                except (InstanceLost, RuntimeError, ValueError):
                    pass

        def end(record: RequestRecord, why: BaseException | None) -> None:
            text = reason
            if why is not None:
                text += f"; rerouting failed: {why}" + (f": {self._deaths()}" if isinstance(why, NoInstanceLeft)
                                                        else "")
            self._errors.append(self._ended(record.request_id, "error", f"{text}; the request was lost with it"))

        self.coordinator.lost(inst, end)

    def _ended(self, request_id: str, reason: str, error: str | None = None) -> RequestOutput:
        return _ended_output(request_id, self.coordinator.requests.get(request_id), reason, error)

    def _check_roles(self) -> None:
        """Raise ``EngineDeadError`` when a role the layout needs has no live instance, after stopping the
        instances left (a prefill instance cannot serve without a decode instance: its process and KV blocks
        would be held for nothing)."""
        needed = [COLOCATED] if self.layout.colocated else [DECODE]
        if self.layout.hybrid is not None:  # either kind serves requests whole
            needed = [PREFILL] if all(i.dead for i in self.instances[DECODE]) else []
        for role in needed:
            if all(i.dead for i in self.instances[role]):
                reason = f"no {role} instance is left: {self._deaths()}"
                if self._live():
                    self.group.stop_live(reason)
                    self.coordinator.clear()
                raise EngineDeadError(reason)

    def check_health(self) -> None:
        """Between steps (``AsyncLLMEngine`` calls it while idle): notice instances that exited, handle them as
        a step would (their requests rerouted or ended), and raise ``EngineDeadError`` if a role the layout needs
        has none left (the other instances are stopped then)."""
        self._notice_exits()
        self._check_roles()

    def _notice_exits(self) -> None:
        """Handle the live instances not stepping whose process has exited (a stepping one's exit ends the step's
        wait): their requests rerouted or ended, as a step would."""
        for inst in self._live():
            if not inst.stepping and inst.process.exitcode is not None:
                try:
                    inst.check_alive()
                except InstanceLost as e:
                    self._lost(inst, str(e))

    def instance_states(self) -> dict[str, dict[str, int]]:
        """Per role of the layout: instances ``alive``, ``lost`` and ``stopped`` (``InstanceGroup.states``)."""
        return self.group.states()

    def _deaths(self) -> str:
        return self.group.deaths()

    def _live(self) -> list[InstanceProcess]:
        return self.group.live()

    # ------------------------------------------------------------------ records

    def stats(self) -> Stats:
        """``deployment_stats`` of every live instance."""
        return deployment_stats([(inst.role, self.call(inst, rpc.GetStats())) for inst in self._live()],
                                self.layout.hybrid is not None)

    def reset_stats(self) -> None:
        for inst in self._live():
            self.call(inst, rpc.ResetStats())
        self.transfers.clear()

    def snapshot(self) -> EngineSnapshot:
        """The live instances' queues and KV pools added up, as of their last replies (each instance's part is one
        whole record; safe from any thread)."""
        return self.group.snapshot()

    def pools(self) -> dict[str, dict[str, int]]:
        """Each live instance's KV pool and transfer counters, after it has applied the pending drops:
        ``num_blocks``, ``num_used_blocks``, ``num_held_blocks``, ``num_requests``, ``num_holds`` (prompts held for
        sending), ``blocks_sent``, ``blocks_received``."""
        return {i.name: self.call(i, rpc.GetPool()) for i in self._live()}

    def shutdown(self) -> None:
        """Stop every instance process (idempotent; also runs when the engine is collected and at exit)."""
        self.group.shutdown()


def _ended_output(request_id: str, record: RequestRecord | None, reason: str, error: str | None) -> RequestOutput:
    """The final output of a request the router ended itself (``"abort"`` or ``"error"``, with ``error``)."""
    prompt = None if record is None else record.payload.prompt
    metrics = RequestMetrics(request_id, 0.0 if record is None else record.arrival,
                             0 if record is None else record.prompt_len, finished_time=time.perf_counter(),
                             finish_reason=reason)
    out = RequestOutput(request_id, prompt if isinstance(prompt, str) else None,
                        [] if isinstance(prompt, str) or prompt is None else list(prompt), [], "", 0, reason,
                        metrics, token_ids=[], text="")
    out.error = error
    return out
