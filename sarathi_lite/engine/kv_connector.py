"""KV connectors: how prompt K/V moves between engines (disaggregated prefill/decode).

A connector has two sides. The scheduler's (``sarathi_lite.scheduler.KVConnectorScheduler``, torch-free): how many
of a request's prompt tokens it can supply, and whether it takes a finished request's K/V. The worker's
(``KVConnectorWorker`` here): ``save`` a finished request's blocks, ``load`` a request's blocks, through the model
runner's ``export_blocks`` / ``import_blocks`` (all layers of a block at once). ``KVConnector`` is both.

``InProcessKVConnector`` moves K/V between engines of one process through a named store: the sending engine's
connector saves each finished request's K/V there; an engine given the same store name loads it for a request
added with ``num_external_tokens``. It is the reference implementation the tests use; a connector over
torch.distributed or a network implements the same four methods.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch

from sarathi_lite.engine.config import KVTransferConfig
from sarathi_lite.engine.model_runner import ModelRunner
from sarathi_lite.scheduler import KVConnectorScheduler, KVLoad, KVSave, Request

logger = logging.getLogger(__name__)

ROLES = ("producer", "consumer", "both")


class KVConnectorWorker(Protocol):
    """The worker side: runs in the engine's step, beside the forward pass."""

    def save(self, save: KVSave, runner: ModelRunner) -> bool:
        """Take the K/V of ``save``'s blocks. ``True``: done with them (they are released now; copy what must
        outlive the call); ``False``: the connector keeps them held until the receiver has them, then the engine
        releases them (``LLMEngine.finish_kv_sends``)."""

    def load(self, load: KVLoad, runner: ModelRunner) -> bool:
        """Write the K/V of ``load``'s tokens into its blocks; ``False`` if they cannot be had (the request then
        recomputes them)."""


class KVConnector(KVConnectorScheduler, KVConnectorWorker, Protocol):
    """Both sides of a connector."""


@dataclass(slots=True)
class StoredKV:
    """A finished request's K/V: ``kv`` ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`` holding
    tokens ``0 .. num_tokens - 1`` (their ids ``token_ids``)."""

    kv: torch.Tensor
    num_tokens: int
    token_ids: list[int]


class KVStore:
    """A bounded, thread-safe map request id -> ``StoredKV`` (the oldest entry goes first when full)."""

    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredKV] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, request_id: str, entry: StoredKV) -> None:
        with self._lock:
            self._entries[request_id] = entry
            self._entries.move_to_end(request_id)
            while len(self._entries) > self.max_entries:
                dropped, _ = self._entries.popitem(last=False)
                logger.warning("KV store full: dropped the K/V of request %r, never loaded", dropped)

    def get(self, request_id: str) -> StoredKV | None:
        with self._lock:
            return self._entries.get(request_id)

    def pop(self, request_id: str) -> StoredKV | None:
        with self._lock:
            return self._entries.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._entries)


_STORES: dict[str, KVStore] = {}
_STORES_LOCK = threading.Lock()


def kv_store(name: str) -> KVStore:
    """The process-wide store ``name`` (created on first use)."""
    with _STORES_LOCK:
        return _STORES.setdefault(name, KVStore())


def make_kv_connector(config: KVTransferConfig) -> KVConnector | None:
    """The connector an engine's ``kv_transfer`` options ask for (``None`` without a role)."""
    if config.role is None:
        return None
    if config.connector == "inprocess":
        return InProcessKVConnector(config.store, config.role)
    raise ValueError(f"kv_connector={config.connector!r} is not one of inprocess")


class InProcessKVConnector:
    """A ``KVConnector`` over the in-process store ``store`` (``kv_store``).

    role: ``"producer"`` saves every finished request's K/V; ``"consumer"`` loads them for requests added with
    ``num_external_tokens`` (each entry is taken once); ``"both"`` does both.
    marked_only: the producer saves only the requests ``mark``-ed before they finish (a hybrid deployment's
    prefill-heavy instance serves most requests whole and sends only those that move).
    """

    def __init__(self, store: str = "default", role: str = "both", marked_only: bool = False) -> None:
        if role not in ROLES:
            raise ValueError(f"role={role!r} is not one of {', '.join(ROLES)}")
        self.role = role
        self.store = kv_store(store)
        self.marked: set[str] | None = set() if marked_only else None

    def mark(self, request_id: str) -> None:
        """Save the K/V of ``request_id`` when it finishes (with ``marked_only``)."""
        if self.marked is not None:
            self.marked.add(request_id)

    def unmark(self, request_id: str) -> None:
        if self.marked is not None:
            self.marked.discard(request_id)

    # ------------------------------------------------------------------ the scheduler's side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if self.role == "producer":
            return 0
        entry = self.store.get(request.request_id)
        if entry is None:
            return 0
        return max(min(entry.num_tokens, request.num_external_tokens) - num_computed_tokens, 0)

    def request_finished(self, request: Request) -> bool:
        if self.role == "consumer":
            return False
        if self.marked is None:
            return True
        if request.request_id in self.marked:
            self.marked.discard(request.request_id)
            return True
        return False

    # ------------------------------------------------------------------ the worker's side

    def save(self, save: KVSave, runner: ModelRunner) -> bool:
        blocks = save.block_ids[:-(-save.num_tokens // runner.block_size)]
        self.store.put(save.request_id, StoredKV(runner.export_blocks(blocks), save.num_tokens, save.token_ids))
        return True

    def load(self, load: KVLoad, runner: ModelRunner) -> bool:
        entry = self.store.pop(load.request_id)
        if entry is None:
            return False
        bs = runner.block_size
        first = load.start_token // bs
        kv = entry.kv[:, first:first + len(load.block_ids)]
        if entry.kv.shape[3] != bs or kv.shape[1] != len(load.block_ids) \
                or entry.num_tokens < load.start_token + load.num_tokens:
            logger.warning("request %r: stored K/V (%d tokens in blocks of %d) does not cover tokens %d..%d in "
                           "blocks of %d", load.request_id, entry.num_tokens, entry.kv.shape[3], load.start_token,
                           load.start_token + load.num_tokens, bs)
            return False
        runner.import_blocks(load.block_ids, kv)
        return True
