"""An instance process of ``ProcessEngine`` (``engine/instances.py``): one ``LLMEngine`` and its K/V connector,
serving the router's commands (``engine/instance_rpc.py``) over a pipe until the pipe closes or says ``Close``."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sarathi_lite.engine import instance_rpc as rpc
from sarathi_lite.engine.config import EngineConfig
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.p2p_connector import P2PKVConnector
from sarathi_lite.scheduler.routing import PREFILL, kv_demand, pending_prefill_tokens

logger = logging.getLogger("sarathi_lite.engine.instances")

START_TIMEOUT = 300.0
"""Seconds the instances get to load their model and join before the engine gives up."""


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


class ChildInstance:
    """An instance's side of the pipe: one ``LLMEngine`` and its connector; ``handle`` runs one command."""

    def __init__(self, spec: InstanceSpec, connector: P2PKVConnector | None) -> None:
        self.connector = connector
        self.engine = LLMEngine(config=spec.config, connector=connector)
        if connector is not None and connector.role == "producer":
            connector.start_sender(self.engine.runner)
        self._handlers = {rpc.AddRequest: self.add, rpc.AbortRequest: self.abort, rpc.Step: self.step,
                          rpc.PeerDown: self.peer_down, rpc.GetPool: self.pool,
                          rpc.GetStats: lambda _: self.engine.stats(),
                          rpc.ResetStats: lambda _: self.engine.reset_stats(),
                          rpc.ResetPrefixCache: lambda _: self.engine.reset_prefix_cache()}

    def handle(self, command: rpc.Command) -> Any:
        """Apply the command's drops, run it, release the blocks whose receiver has them; returns its result."""
        for h in command.drops:
            self.connector.holds.drop(h)
        self.release_sent()
        handler = self._handlers.get(type(command))
        result = None if handler is None else handler(command)
        self.release_sent()
        return result

    def release_sent(self) -> None:
        """Release the blocks whose receiver has them (or that the router dropped)."""
        if self.connector is not None and self.connector.role == "producer":
            self.engine.finish_kv_sends(self.connector.holds.take_released())

    def load(self) -> rpc.InstanceLoad:
        """What every reply carries: the router's load measures, whether there is work, the snapshot."""
        sched = self.engine.scheduler
        return rpc.InstanceLoad(pending_prefill_tokens(sched), kv_demand(sched), self.engine.has_unfinished_requests(),
                                self.engine.snapshot())

    def ready(self) -> rpc.Ready:
        return rpc.Ready(self.engine.scheduler_config, self.engine.model_config)

    def add(self, c: rpc.AddRequest) -> None:
        if c.handle is not None:
            self.connector.expect(c.request_id, c.handle, c.source)
        try:
            self.engine.add_request(c.request_id, c.prompt, c.params, c.arrival,
                                    num_external_tokens=c.num_external_tokens)
        except BaseException:
            if self.connector is not None:
                self.connector.forget(c.request_id)
            raise

    def abort(self, c: rpc.AbortRequest) -> RequestOutput:
        out = self.engine.abort_request(c.request_id)
        if self.connector is not None:
            self.connector.forget(c.request_id)
        return out

    def step(self, c: rpc.Step) -> rpc.StepDone:
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
        return rpc.StepDone(outputs, transfers, [records[i] for i in range(len(records) - new, len(records))])

    def peer_down(self, c: rpc.PeerDown) -> None:
        if self.connector is not None:
            self.connector.broken.add(c.rank)

    def pool(self, c: rpc.GetPool) -> dict[str, int]:
        sched = self.engine.scheduler
        conn = self.connector
        return {"num_blocks": sched.kv.pool.num_blocks, "num_used_blocks": sched.kv.pool.num_used_blocks,
                "num_held_blocks": sched.kv.num_held_blocks, "num_requests": len(sched.requests),
                "num_holds": 0 if conn is None else len(conn.holds),
                "blocks_sent": 0 if conn is None else conn.blocks_sent,
                "blocks_received": 0 if conn is None else conn.blocks_received}


def _start(spec: InstanceSpec, port: int) -> ChildInstance:
    """Join the KV group (prefill and decode instances) and build the engine."""
    connector = None
    if spec.rank is not None:
        store = dist.TCPStore("127.0.0.1", port, spec.world_size, is_master=False,
                              timeout=timedelta(seconds=START_TIMEOUT))
        dist.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.world_size,
                                timeout=timedelta(days=7))  # the sender waits for requests this long
        connector = P2PKVConnector("producer" if spec.role == PREFILL else "consumer", spec.transfer_timeout)
    return ChildInstance(spec, connector)


def instance_main(conn: Any, spec: InstanceSpec, port: int, parent_pid: int) -> None:
    """Entry point of an instance process: build the engine, then serve the router's commands until the pipe
    closes or says ``Close``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the router, which stops the instances
    _watch_parent(parent_pid)
    torch.set_num_threads(spec.num_threads)
    try:
        child = _start(spec, port)
        conn.send(rpc.Reply(child.ready(), None, child.load()))
    except BaseException as e:
        conn.send(rpc.Reply(None, rpc.RemoteError.of(e), None))
        os._exit(1)
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):  # the router is gone
            os._exit(0)
        if isinstance(command, rpc.Close):
            conn.send(rpc.Reply())
            os._exit(0)
        try:
            reply = rpc.Reply(child.handle(command), None, child.load())
        except Exception as e:
            if not isinstance(e, ValueError):
                logger.exception("instance %s: command %s failed", spec.name, type(command).__name__)
            reply = rpc.Reply(None, rpc.RemoteError.of(e), child.load())
        conn.send(reply)
