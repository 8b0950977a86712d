"""A fixed pool of KV-cache blocks, handed out whole and never over-committed."""

from __future__ import annotations


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` token slots each. Block ids are ``0 .. num_blocks - 1``."""

    __slots__ = ("num_blocks", "block_size", "_free")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed block is reused first.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        """Whether ``num_blocks`` can be taken while still leaving ``reserve`` blocks free."""
        return num_blocks + reserve <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks with {len(self._free)} free")
        if num_blocks == 0:
            return []
        taken = self._free[-num_blocks:]
        del self._free[-num_blocks:]
        taken.reverse()
        return taken

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))

    def free_block_ids(self) -> list[int]:
        """A copy of the free list, for checks."""
        return list(self._free)
