"""The scheduler's side of KV transfer between instances (disaggregated prefill/decode): records of the blocks to
load and to send, and the ``KVConnectorScheduler`` protocol. Torch-free; the worker side, which moves the tensors,
is ``sarathi_lite.engine.kv_connector``.

A request added with ``num_external_tokens`` (``Scheduler.add``) gets its blocks at admission like any other, then
waits in ``RequestStatus.WAITING_FOR_REMOTE_KV`` while a connector writes the K/V of those tokens into them (a
``KVLoad`` in that iteration's ``SchedulerOutput.kv_loads``); ``Scheduler.finish_kv_load`` makes it running from
there, or, if the load failed, from its local prefix (it recomputes the rest). On the sending side, a finished
request whose KV the connector takes (``KVConnectorScheduler.request_finished``) leaves its blocks *held*
(``KVCacheManager.hold``) and a ``KVSave`` in ``Scheduler.take_kv_saves()``; ``Scheduler.finish_kv_send`` ends the
hold once the receiver has them, so no block being sent is freed, evicted or reused before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .request import Request


@dataclass(slots=True)
class KVLoad:
    """Write the K/V of tokens ``start_token .. start_token + num_tokens - 1`` of ``request_id`` into
    ``block_ids``: the request's blocks covering those tokens, the first holding token ``start_token`` (a block
    boundary)."""

    request_id: str
    block_ids: list[int]
    start_token: int
    num_tokens: int


@dataclass(slots=True)
class KVSave:
    """The K/V of tokens ``0 .. num_tokens - 1`` of a finished ``request_id`` lie in ``block_ids`` (held until
    ``Scheduler.finish_kv_send``); ``token_ids`` are those tokens (the receiver can key its prefix cache by them)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    token_ids: list[int]


class KVConnectorScheduler(Protocol):
    """What the scheduler asks a KV connector. Both methods run inside ``schedule()``/``update()``: keep them
    cheap and non-blocking."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens of ``request``'s prompt past its first ``num_computed_tokens`` (the local prefix-cache hit) whose
        K/V the connector can supply (0: none; at most up to the request's ``num_external_tokens``)."""

    def request_finished(self, request: Request) -> bool:
        """``request`` finished: whether the connector will send its K/V (its blocks are then held until
        ``Scheduler.finish_kv_send``)."""
