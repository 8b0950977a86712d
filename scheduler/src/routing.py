"""Routing requests over instances: colocated replicas, xPyD disaggregated, or conditional. Torch-free: the
coordinator (``coordinator.py``), which the real engines (``sarathi_lite.engine.disagg``, ``.instances``) and the
simulator (``sarathi_lite.sim.disagg``) all drive, routes by these rules, so they make the same decisions on the
same scheduler states.

- colocated replicas: the replica with the fewest pending prefill tokens, then the fewest KV blocks in use or
  wanted, then the lowest index;
- disaggregated: a prompt goes to the prefill instance with the fewest pending prefill tokens (then the lowest
  index); once prefilled it goes to the decode instance with the fewest KV blocks in use or wanted (then the
  lowest index);
- conditional: a prompt of at most ``threshold`` tokens goes straight to a decode instance (chosen as above),
  which prefills it itself; longer ones as disaggregated.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .base import Scheduler

COLOCATED, PREFILL, DECODE = "colocated", "prefill", "decode"


def pending_prefill_tokens(scheduler: Scheduler) -> int:
    """Prompt tokens the unfinished requests of ``scheduler`` have yet to compute (a decoding request, past its
    prefill, counts 0)."""
    return sum(max(r.num_prefill_tokens - r.num_computed_tokens, 0) for r in scheduler.requests.values())


def kv_demand(scheduler: Scheduler) -> int:
    """KV blocks in use (held ones included) plus those the prompts of its waiting requests need."""
    kv = scheduler.kv
    return kv.pool.num_used_blocks + sum(kv.blocks_for(r.num_prefill_tokens) for r in scheduler.waiting)


@dataclass(slots=True, frozen=True)
class Layout:
    """How many instances of each role: ``colocated`` replicas, or ``prefill`` and ``decode`` instances, with an
    optional conditional ``threshold`` (prompt tokens)."""

    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    threshold: int | None = None

    def __post_init__(self) -> None:
        for name in ("colocated", "prefill", "decode"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer")
        if bool(self.colocated) == bool(self.prefill or self.decode) or \
                (not self.colocated and not (self.prefill and self.decode)):
            raise ValueError(f"{self}: either colocated replicas or at least one prefill and one decode instance")
        if self.threshold is not None and (self.colocated or self.threshold < 0):
            raise ValueError(f"threshold={self.threshold!r}: conditional routing needs prefill and decode instances "
                             f"and a threshold >= 0 (prompt tokens)")

    @classmethod
    def parse(cls, spec: str, threshold: int | None = None) -> Layout:
        """``"N"`` or ``"NC"``: N colocated replicas; ``"xPyD"``: x prefill and y decode instances."""
        text = str(spec).strip().upper()
        m = re.fullmatch(r"(\d+)C?", text)
        if m:
            return cls(colocated=int(m.group(1)), threshold=threshold)
        m = re.fullmatch(r"(\d+)P(\d+)D", text)
        if not m:
            raise ValueError(f"instances={spec!r}: expected N (colocated replicas) or xPyD, e.g. '2P1D'")
        return cls(prefill=int(m.group(1)), decode=int(m.group(2)), threshold=threshold)

    @property
    def label(self) -> str:
        if self.colocated:
            return f"{self.colocated}C"
        base = f"{self.prefill}P{self.decode}D"
        return base if self.threshold is None else f"{base}/cond{self.threshold}"


def load_of(scheduler: Scheduler) -> tuple[int, int]:
    """What the router weighs an instance by: ``(pending_prefill_tokens, kv_demand)``."""
    return pending_prefill_tokens(scheduler), kv_demand(scheduler)


Load = tuple[int, int] | None


def route_by_load(prompt_len: int, layout: Layout, colocated: Sequence[Load], prefill: Sequence[Load],
                  decode: Sequence[Load]) -> tuple[str, int]:
    """Where a new request with ``prompt_len`` prompt tokens goes, ``(role, index)``, by the instances' ``load_of``
    (``None`` marks an instance that is gone). With every prefill instance gone, prompts go to decode instances,
    which prefill them. Raises ``RuntimeError`` when no instance can take the request."""
    if layout.colocated:
        return COLOCATED, _least(colocated, "colocated replica")
    if (layout.threshold is not None and prompt_len <= layout.threshold) or all(x is None for x in prefill):
        return DECODE, pick_decode_by_load(decode)
    return PREFILL, _least([None if x is None else (x[0],) for x in prefill], "prefill instance")


def pick_decode_by_load(decode: Sequence[Load]) -> int:
    """The decode instance a prefilled request goes to, by the instances' ``load_of`` (``None``: gone)."""
    return _least([None if x is None else (x[1],) for x in decode], "decode instance")


def _least(loads: Sequence[tuple[int, ...] | None], what: str) -> int:
    live = [(load, i) for i, load in enumerate(loads) if load is not None]
    if not live:
        raise RuntimeError(f"no {what} is left to take the request")
    return min(live)[1]
