"""The KV cache manager: the one owner of every request's block table.

The scheduler decides how many tokens a request computes in an iteration; the manager decides which blocks hold
them. Nothing else writes ``Request.block_ids``. Underneath is a ``BlockManager`` (the pool: reference counts, the
free lists and the prefix cache), which the manager drives.

Blocks being sent to another instance (disaggregated prefill/decode, ``sarathi_lite.scheduler.kv_transfer``) are
*held*: ``hold`` takes one more reference to each, so a finished request's blocks are neither freed nor evicted
nor reused until ``release`` (the receiver has them).
"""

from __future__ import annotations

from collections.abc import Sequence

from .block_manager import BlockManager
from .request import Request


class KVCacheManager:
    """Block tables over a pool of ``num_blocks`` blocks of ``block_size`` tokens (``enable_caching``: prefix
    caching, see ``block_manager``).

    Use: ``get_computed_blocks(req)`` (the cached prefix blocks an admission may start from), then
    ``allocate_slots(req, n, computed_blocks=...)`` before scheduling ``n`` tokens of ``req``; ``commit(req)`` after
    its tokens are computed (caches newly full blocks); ``free(req)`` when it finishes or is preempted.
    """

    __slots__ = ("pool", "block_size", "_held", "_next_handle")

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.pool = BlockManager(num_blocks, block_size, enable_caching)
        self.block_size = block_size
        self._held: dict[int, list[int]] = {}
        self._next_handle = 0

    # ------------------------------------------------------------------ counts

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_held_blocks(self) -> int:
        """Block references held for sending (a block held twice counts twice)."""
        return sum(map(len, self._held.values()))

    def usage(self) -> float:
        """Share of the pool in use (held blocks included), in [0, 1]."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ block tables

    def get_computed_blocks(self, req: Request) -> list[int]:
        """The cached blocks holding the longest prefix of ``req``'s prefill tokens (at least its last prefill
        token left to compute); ``[]`` without prefix caching. Takes nothing."""
        return self.pool.match_prefix(req)

    def num_new_blocks(self, req: Request, num_tokens: int, computed_blocks: Sequence[int] = ()) -> int:
        """New blocks ``req``'s table needs to cover ``num_tokens`` token slots, after its current blocks and the
        ``computed_blocks`` it would start from."""
        return max(self.blocks_for(num_tokens) - len(req.block_ids) - len(computed_blocks), 0)

    def can_allocate(self, num_blocks: int, reserve: int = 0, computed_blocks: Sequence[int] = ()) -> bool:
        """Whether ``num_blocks`` new blocks and the ``computed_blocks`` can be taken, leaving ``reserve`` free."""
        return self.pool.can_allocate(num_blocks, reserve, computed_blocks)

    def allocate_slots(self, req: Request, num_new_tokens: int, num_external_tokens: int = 0,
                       computed_blocks: Sequence[int] = (), reserve: int = 0) -> list[int] | None:
        """Grow ``req``'s block table to cover its computed tokens (``req.num_computed_tokens``, or the
        ``computed_blocks`` a request without blocks starts from), ``num_external_tokens`` whose K/V a connector
        will write, and ``num_new_tokens`` to compute. Returns the new blocks (``[]`` when none are needed), or
        ``None``, changing nothing, when the pool cannot give them while keeping ``reserve`` blocks free."""
        start = len(computed_blocks) * self.block_size if computed_blocks else req.num_computed_tokens
        need = self.num_new_blocks(req, start + num_external_tokens + num_new_tokens, computed_blocks)
        if not self.pool.can_allocate(need, reserve, computed_blocks):
            return None
        if not need and not computed_blocks:
            return []
        table = self.pool.allocate(need, computed_blocks)
        new = table[len(computed_blocks):]
        req.block_ids += table
        return new

    def allocate_one(self, req: Request) -> int | None:
        """One more block at the end of ``req``'s table (a decode's next block), or ``None`` if none is free."""
        if not self.pool.num_free_blocks:
            return None
        b = self.pool.allocate_one()
        req.block_ids.append(b)
        return b

    def commit(self, req: Request) -> None:
        """Cache ``req``'s blocks newly filled by its computed tokens (prefix caching; nothing otherwise)."""
        if self.pool.enable_caching:
            self.pool.commit(req)

    def free(self, req: Request) -> None:
        """Drop ``req``'s references to its blocks; its table becomes empty."""
        self.pool.free(req.block_ids)
        req.block_ids = []

    # ------------------------------------------------------------------ blocks being sent

    def hold(self, block_ids: Sequence[int]) -> int:
        """Keep ``block_ids`` (in use by someone) from being freed, evicted or reused until ``release`` of the
        returned handle: one more reference to each."""
        blocks = list(block_ids)
        self.pool.allocate(0, blocks)
        handle = self._next_handle
        self._next_handle += 1
        self._held[handle] = blocks
        return handle

    def release(self, handle: int) -> None:
        """End a ``hold``. Raises ``KeyError`` for an unknown or released handle."""
        self.pool.free(self._held.pop(handle))

    def held_blocks(self) -> list[int]:
        """Every held block, once per hold."""
        return [b for blocks in self._held.values() for b in blocks]
