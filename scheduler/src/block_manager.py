"""A fixed pool of KV-cache blocks, handed out whole and never over-committed, with an optional prefix cache.

Prefix caching (``enable_caching=True``): every *full* block whose K/V have been computed gets a content key,
``block_key(parent_key, token_ids)``: SHA-256 over the key of the block before it in the same sequence and
its own token ids. A key therefore names a whole token prefix, is the same in every process and on every
machine (the simulator and a real replay see the same hits), and two blocks with equal keys hold equal K/V.
Blocks are reference counted: a block in several block tables is shared, read-only. A block whose last user
is gone keeps its content and its key (a *cached free* block) until the pool needs it, least recently freed
first; until then a new request whose prompt starts with that prefix takes it instead of recomputing it.

Only full, already computed blocks are ever shared, and a request never takes a cached block for the block
that holds its last prompt token (that token is always computed, so it can be sampled), so nobody ever writes
into a block another request reads: writes go to positions at or past ``num_computed_tokens``, which lie in
blocks of the writer's own.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from hashlib import sha256

from .request import Request

ROOT_KEY = b""  # the parent key of a sequence's first block
_PACKERS: dict[int, Callable[..., bytes]] = {}  # block length -> its token packer


def block_key(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    """The content key of a full block: SHA-256 (32 bytes) of ``parent_key`` followed by ``token_ids`` as
    little-endian signed 64-bit integers. ``parent_key`` is the previous block's key, ``ROOT_KEY`` for the
    first block. Stable across processes, Python versions and machines."""
    n = len(token_ids)
    pack = _PACKERS.get(n)
    if pack is None:
        pack = _PACKERS[n] = struct.Struct(f"<{n}q").pack
    return sha256(parent_key + pack(*token_ids)).digest()


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` token slots each. Block ids are ``0 .. num_blocks - 1``.

    Every block is in exactly one of three states: *used* (reference count >= 1: in at least one block table),
    *free* (empty, reusable at once) or *cached free* (reference count 0 but holding a cached prefix; reusable
    by a request with that prefix, or evicted, least recently freed first, when no empty block is left).
    Without caching there are no cached free blocks and this is a plain free list.

    Counters (prefix caching): ``num_queried_tokens`` is the prefill tokens of every admission,
    ``num_hit_tokens`` those of them found in the cache; ``hit_rate`` is their ratio.
    """

    __slots__ = ("num_blocks", "block_size", "enable_caching", "_free", "_cached_free", "_ref", "_key", "_table",
                 "_pack", "num_queried_tokens", "num_hit_tokens")

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # A stack: the most recently freed block is reused first.
        self._free = list(range(num_blocks - 1, -1, -1))
        # Cached free blocks, least recently freed first (values unused).
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._ref = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._table: dict[bytes, int] = {}  # content key -> the block holding it
        self._pack = struct.Struct(f"<{block_size}q").pack  # a full block's tokens, as block_key packs them
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ------------------------------------------------------------------ counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now: free plus cached free."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix, used or not."""
        return len(self._table)

    @property
    def hit_rate(self) -> float:
        """Share of admitted prefill tokens found in the prefix cache (0.0 before any admission)."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ allocation

    def can_allocate(self, num_blocks: int, reserve: int = 0, prefix: Sequence[int] = ()) -> bool:
        """Whether ``num_blocks`` new blocks plus the cached ``prefix`` blocks can be taken while still leaving
        ``reserve`` blocks free (a cached prefix block nobody uses stops being free when taken)."""
        ref = self._ref
        revived = sum(1 for b in prefix if not ref[b]) if prefix else 0
        return num_blocks + revived + reserve <= len(self._free) + len(self._cached_free)

    def allocate(self, num_blocks: int, prefix: Sequence[int] = ()) -> list[int]:
        """A block table: the cached ``prefix`` blocks (shared, from ``match_prefix``) followed by
        ``num_blocks`` new ones (empty blocks first, then evicted cached ones). Raises ``RuntimeError`` if the
        pool is short."""
        if not self.can_allocate(num_blocks, 0, prefix):
            raise RuntimeError(f"asked for {num_blocks} blocks with {self.num_free_blocks} free")
        ref = self._ref
        table = list(prefix)
        for b in table:
            if not ref[b]:
                del self._cached_free[b]
            ref[b] += 1
        free = self._free
        n = min(num_blocks, len(free))
        if n:
            taken = free[-n:]
            del free[-n:]
            taken.reverse()
            table += taken
        for _ in range(num_blocks - n):
            table.append(self._evict())
        for b in table[len(prefix):]:
            ref[b] = 1
        return table

    def allocate_one(self) -> int:
        """One new block (a decode's next block). Raises ``RuntimeError`` if none is free."""
        if self._free:
            b = self._free.pop()
        elif self._cached_free:
            b = self._evict()
        else:
            raise RuntimeError("asked for 1 block with 0 free")
        self._ref[b] = 1
        return b

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block of a block table; blocks nobody uses any more become free, or cached
        free if they hold a cached prefix (the table's first block is then the last to be evicted)."""
        ref, key = self._ref, self._key
        for b in reversed(block_ids):
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if key[b] is None:
                    self._free.append(b)
                else:
                    self._cached_free[b] = None
            elif r < 0:
                raise RuntimeError(f"block {b} freed more often than allocated")

    def _evict(self) -> int:
        b, _ = self._cached_free.popitem(last=False)
        del self._table[self._key[b]]
        self._key[b] = None
        return b

    # ------------------------------------------------------------------ prefix cache

    def block_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The content keys of ``req``'s first ``num_blocks`` full blocks (prompt + outputs), computed once and
        kept in ``req.block_hashes``."""
        hashes = req.block_hashes
        start = len(hashes)
        if start < num_blocks:
            bs, pack, tokens = self.block_size, self._pack, req.token_ids
            key = hashes[-1] if start else ROOT_KEY
            for i in range(start, num_blocks):
                key = sha256(key + pack(*tokens(i * bs, (i + 1) * bs))).digest()  # block_key, inlined
                hashes.append(key)
        return hashes

    def match_prefix(self, req: Request) -> list[int]:
        """The cached blocks holding the longest prefix of ``req``'s prefill tokens, in order, leaving at least
        the last prefill token to compute. Empty without caching. Changes nothing."""
        if not self.enable_caching:
            return []
        limit = (req.num_prefill_tokens - 1) // self.block_size
        if not limit:
            return []
        table = self._table
        if table.get(self.block_hashes(req, 1)[0]) is None:
            return []
        prefix = []
        for h in self.block_hashes(req, limit)[:limit]:
            b = table.get(h)
            if b is None:
                break
            prefix.append(b)
        return prefix

    def commit(self, req: Request) -> None:
        """Cache ``req``'s blocks filled by its computed tokens since the last call (call after every step that
        advanced ``req.num_computed_tokens``). A block whose content another block already caches stays
        uncached (it is freed as a plain block)."""
        full = req.num_computed_tokens // self.block_size
        start = req.num_committed_blocks
        if full <= start:
            return
        hashes = self.block_hashes(req, full)
        table, key, blocks = self._table, self._key, req.block_ids
        for i in range(start, full):
            h = hashes[i]
            if h not in table:
                b = blocks[i]
                table[h] = b
                key[b] = h
        req.num_committed_blocks = full

    def record_admission(self, num_prefill_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission for ``hit_rate``: ``num_hit_tokens`` of its ``num_prefill_tokens`` were cached."""
        self.num_queried_tokens += num_prefill_tokens
        self.num_hit_tokens += num_hit_tokens

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use keep their content, but are no longer shared with new
        requests) and zero the hit counters. Returns the number of cached blocks dropped."""
        dropped = len(self._table)
        for b in self._cached_free:
            self._free.append(b)
        self._cached_free.clear()
        self._table.clear()
        self._key = [None] * self.num_blocks
        self.num_queried_tokens = self.num_hit_tokens = 0
        return dropped

    # ------------------------------------------------------------------ for checks

    def free_block_ids(self) -> list[int]:
        """A copy of every allocatable block id: free, then cached free."""
        return self._free + list(self._cached_free)

    def cached_free_block_ids(self) -> list[int]:
        """Cached free blocks, least recently freed (next to be evicted) first."""
        return list(self._cached_free)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``."""
        return self._ref[block_id]

    def key_of(self, block_id: int) -> bytes | None:
        """The content key ``block_id`` is cached under, or ``None``."""
        return self._key[block_id]

    def cached_blocks(self) -> dict[bytes, int]:
        """A copy of the prefix cache: content key -> block id."""
        return dict(self._table)
