"""``EngineSnapshot``: the engine's state as other threads may read it (a server's metrics, health checks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """An engine's queues and KV pool between two of its operations, immutable: the engine thread publishes a
    new one after every step (and every add, abort and prefix-cache reset), so a reader on any thread sees one
    whole record, never a half-updated one.

    num_steps: iterations run so far. num_waiting: requests waiting to be admitted (preempted ones included).
    num_running: requests holding KV blocks (being prefilled or decoded). kv_blocks_used, kv_blocks_total: KV
    blocks in use and in the pool. kv_blocks_cached: blocks holding a cached prompt prefix, in use or not.
    prefix_hit_rate: share of admitted prefill tokens found in the prefix cache so far (0.0 before any).
    """

    num_steps: int
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int
    prefix_hit_rate: float

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool in use, in [0, 1]."""
        return self.kv_blocks_used / self.kv_blocks_total
