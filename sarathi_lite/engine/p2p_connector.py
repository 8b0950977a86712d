"""A KV connector over torch.distributed point-to-point (gloo), between instances in separate processes.

Every prefill and decode instance of a ``ProcessEngine`` (``sarathi_lite.engine.instances``) is one rank of a
gloo group. The prefill side (``P2PKVConnector`` with role ``"producer"``) keeps each finished prompt's blocks
*held* (the scheduler's ``hold``) and registered under an integer handle the router gave the request; a sender
thread answers requests for them. The decode side (role ``"consumer"``), when its scheduler admits a request into
``WAITING_FOR_REMOTE_KV``, asks the prefill rank for exactly the blocks its ``KVLoad`` covers (those past its own
prefix-cache hit: block keys are the same in every process, so it never asks for blocks it has), receives all
layers of them in one tensor, writes them into its blocks and acknowledges. Only on that acknowledgement (or when
the router drops the handle) does the prefill side release the blocks, so a block being sent is never freed or
reused before the receiver has it.

The messages, all int64 unless said, on tags that keep them apart:

- decode -> prefill, tag 1: ``[handle, first_block, num_blocks]``;
- prefill -> decode, tag 2: ``[num_blocks]`` (0: the handle is unknown, e.g. the request was aborted);
- prefill -> decode, tag 3: the K/V, ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`` in the
  cache's dtype, on the CPU;
- decode -> prefill, tag 4: ``[1]``, the acknowledgement.

Every wait has a deadline (``timeout`` seconds). A load that fails or times out returns ``False`` (the engine
recomputes the prompt, with one warning) and marks the peer broken (gloo closes a pair after a timeout): later
requests from that peer are recomputed at once instead of waiting again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sarathi_lite.engine.model_runner import ModelRunner
from sarathi_lite.scheduler import KVLoad, KVSave, Request

logger = logging.getLogger(__name__)

_ASK, _ANSWER, _KV, _ACK = 1, 2, 3, 4


class SendHolds:
    """The prefill side's book of held blocks, shared by the engine's thread and the sender thread.

    ``register`` a finished request's blocks under its handle; the sender ``begin``s a send (the blocks stay
    held while it runs) and ``end``s it; ``drop`` (the router: the decode side no longer needs them) ends a hold
    that is not being sent now, or marks one that is to end when the send does. ``take_released`` gives the
    engine's thread the request ids whose hold has ended, to release in the scheduler (``finish_kv_send``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, tuple[str, list[int], int]] = {}  # handle -> (request id, blocks, tokens)
        self._sending: set[int] = set()
        self._dropped: set[int] = set()  # dropped while being sent: released when the send ends
        self._released: list[str] = []

    def register(self, handle: int, request_id: str, block_ids: Sequence[int], num_tokens: int) -> None:
        with self._lock:
            self._held[handle] = (request_id, list(block_ids), num_tokens)

    def begin(self, handle: int) -> list[int] | None:
        """The held blocks of ``handle`` (``None`` if it is unknown or dropped), held until ``end``."""
        with self._lock:
            entry = self._held.get(handle)
            if entry is None or handle in self._sending:
                return None
            self._sending.add(handle)
            return entry[1]

    def end(self, handle: int, acknowledged: bool) -> None:
        """A send of ``handle`` ended: the hold ends if the receiver acknowledged or the handle was dropped."""
        with self._lock:
            self._sending.discard(handle)
            if acknowledged or handle in self._dropped:
                self._dropped.discard(handle)
                self._release(handle)

    def drop(self, handle: int) -> None:
        """End ``handle``'s hold now, or when its send in progress ends (an unknown handle: nothing to do, e.g.
        a request aborted before its prompt finished)."""
        with self._lock:
            if handle in self._sending:
                self._dropped.add(handle)
            else:
                self._release(handle)

    def _release(self, handle: int) -> None:
        entry = self._held.pop(handle, None)
        if entry is not None:
            self._released.append(entry[0])

    def take_released(self) -> list[str]:
        with self._lock:
            released, self._released = self._released, []
            return released

    def held_blocks(self) -> list[int]:
        with self._lock:
            return [b for _, blocks, _ in self._held.values() for b in blocks]

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class P2PKVConnector:
    """A ``KVConnector`` between ranks of the default torch.distributed group (gloo).

    role: ``"producer"`` (a prefill instance: keeps finished prompts' blocks held and serves them from a sender
    thread started by ``start_sender``) or ``"consumer"`` (a decode instance: loads the blocks of requests added
    with ``expect``). timeout: seconds any one wait of a transfer may take.
    Counters: ``blocks_sent``, ``blocks_received``; ``transfers``: request id -> ``(seconds, blocks)`` of each
    load on the decode side.
    """

    def __init__(self, role: str, timeout: float = 10.0) -> None:
        if role not in ("producer", "consumer"):
            raise ValueError(f"role={role!r} is not one of producer, consumer")
        if not timeout > 0:
            raise ValueError(f"transfer_timeout={timeout!r} must be > 0 (seconds)")
        self.role = role
        self.timeout = timedelta(seconds=timeout)
        self.holds = SendHolds()
        self.blocks_sent = 0
        self.blocks_received = 0
        self.transfers: dict[str, tuple[float, int]] = {}
        self._handles: dict[str, int] = {}  # producer: request id -> handle, until it finishes
        self._sources: dict[str, tuple[int, int]] = {}  # consumer: request id -> (prefill rank, handle)
        self.broken: set[int] = set()  # ranks whose pair failed: no more transfers from them
        self._abandoned: list[Any] = []  # timed-out receives: keep their buffers alive
        self._sender: threading.Thread | None = None

    # ------------------------------------------------------------------ the router's side

    def expect(self, request_id: str, handle: int, source: int | None = None) -> None:
        """Producer: ``request_id`` will be asked for under ``handle``. Consumer: its K/V comes from rank
        ``source`` under ``handle``."""
        if self.role == "producer":
            self._handles[request_id] = handle
        else:
            self._sources[request_id] = (source, handle)

    def forget(self, request_id: str) -> None:
        """Drop what ``expect`` recorded for a request that ended before its K/V moved (aborted)."""
        self._handles.pop(request_id, None)
        self._sources.pop(request_id, None)

    # ------------------------------------------------------------------ the scheduler's side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        source = self._sources.get(request.request_id)
        if self.role == "producer" or source is None or source[0] in self.broken:
            return 0
        return max(request.num_external_tokens - num_computed_tokens, 0)

    def request_finished(self, request: Request) -> bool:
        return self.role == "producer" and request.request_id in self._handles

    # ------------------------------------------------------------------ the worker's side

    def save(self, save: KVSave, runner: ModelRunner) -> bool:
        """Register the held blocks for the sender; they stay held (returns ``False``) until acknowledged."""
        handle = self._handles.pop(save.request_id)
        blocks = save.block_ids[:-(-save.num_tokens // runner.block_size)]
        self.holds.register(handle, save.request_id, blocks, save.num_tokens)
        return False

    def load(self, load: KVLoad, runner: ModelRunner) -> bool:
        source = self._sources.pop(load.request_id, None)
        if source is None or source[0] in self.broken:
            return False
        rank, handle = source
        t0 = time.perf_counter()
        first, n = load.start_token // runner.block_size, len(load.block_ids)
        answer = torch.zeros(1, dtype=torch.int64)
        try:
            self._send(torch.tensor([handle, first, n], dtype=torch.int64), rank, _ASK)
            self._wait(dist.irecv(answer, src=rank, tag=_ANSWER), answer)
            if int(answer) != n:
                logger.warning("request %r: prefill rank %d no longer holds its K/V", load.request_id, rank)
                return False
            cache = runner.kv_cache
            kv = torch.empty((cache.shape[0], n, *cache.shape[2:]), dtype=cache.dtype)
            self._wait(dist.irecv(kv, src=rank, tag=_KV), kv)
            runner.import_blocks(load.block_ids, kv)
            self._send(torch.ones(1, dtype=torch.int64), rank, _ACK)
        except RuntimeError as e:  # gloo: a timeout or a closed pair
            self.broken.add(rank)
            logger.warning("request %r: the K/V transfer from prefill rank %d failed (%s); no more transfers from "
                           "it", load.request_id, rank, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return False
        self.blocks_received += n
        self.transfers[load.request_id] = (time.perf_counter() - t0, n)
        return True

    def _send(self, tensor: torch.Tensor, rank: int, tag: int) -> None:
        """Send ``tensor`` to ``rank``, waiting at most ``timeout`` for it to leave."""
        self._wait(dist.isend(tensor, dst=rank, tag=tag), tensor)

    def _wait(self, work: Any, buffer: torch.Tensor) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError:
            self._abandoned.append((work, buffer))
            raise

    # ------------------------------------------------------------------ the sender (producer)

    def start_sender(self, runner: ModelRunner) -> None:
        """Serve K/V requests from decode ranks on a daemon thread, for the life of the process."""
        self._sender = threading.Thread(target=self._serve, args=(runner,), daemon=True,
                                        name="sarathi-lite-kv-sender")
        self._sender.start()

    def _serve(self, runner: ModelRunner) -> None:
        while True:
            ask = torch.zeros(3, dtype=torch.int64)
            try:
                rank = dist.recv(ask, tag=_ASK)
            except RuntimeError as e:  # a decode rank went away: keep serving the others
                logger.warning("KV sender: a receive failed (%s)", str(e).splitlines()[0] if str(e) else e)
                time.sleep(0.05)
                continue
            handle, first, n = (int(x) for x in ask)
            self._serve_one(runner, rank, handle, first, n)

    def _serve_one(self, runner: ModelRunner, rank: int, handle: int, first: int, n: int) -> None:
        blocks = self.holds.begin(handle)
        acknowledged = False
        try:
            if blocks is None or first + n > len(blocks):
                self._send(torch.zeros(1, dtype=torch.int64), rank, _ANSWER)
                return
            self._send(torch.tensor([n], dtype=torch.int64), rank, _ANSWER)
            self._send(runner.export_blocks(blocks[first:first + n]), rank, _KV)
            ack = torch.zeros(1, dtype=torch.int64)
            self._wait(dist.irecv(ack, src=rank, tag=_ACK), ack)
            acknowledged = True
            self.blocks_sent += n
        except RuntimeError as e:
            logger.warning("KV sender: sending handle %d to rank %d failed (%s)", handle, rank,
                           str(e).splitlines()[0] if str(e) else e)
        finally:
            if blocks is not None:
                self.holds.end(handle, acknowledged)
