"""Routing requests over instances: colocated replicas, xPyD disaggregated, or conditional. Torch-free: the
coordinator (``coordinator.py``), which the real engines (``sarathi_lite.engine.disagg_engine``, ``.instances``) and the
simulator (``sarathi_lite.sim.disagg``) all drive, routes by these rules, so they make the same decisions on the
same scheduler states.

- colocated replicas: the replica with the fewest pending prefill tokens, then the fewest KV blocks in use or
  wanted, then the lowest index;
- disaggregated: a prompt goes to the prefill instance with the fewest pending prefill tokens (then the lowest
  index); once prefilled it goes to the decode instance with the fewest KV blocks in use or wanted (then the
  lowest index);
- conditional: a prompt of at most ``threshold`` tokens goes straight to a decode instance (chosen as above),
  which prefills it itself; longer ones as disaggregated.
- hybrid (``HybridRule``, after TaiChi, arXiv 2508.01989): every instance prefills and decodes (hybrid
  chunked-prefill batches), but the prefill role holds *prefill-heavy* instances (large chunks) and the decode role
  *decode-heavy* ones (small chunks). ``route_hybrid`` decides at a request's arrival, from its prompt length and
  the loads, where it is prefilled and whether its K/V moves to a decode-heavy instance once prefilled (the rule is
  ``HybridRule``'s docstring).
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
class HybridRule:
    """Where a hybrid deployment's requests go (``route_hybrid``), in prompt tokens (the router knows no times: the
    SLOs enter as the token counts they allow).

    1. *prompts by length and TTFT slack*: a prompt of at most ``short`` tokens goes to the decode-heavy instance
       with the fewest pending prefill tokens (then the fewest KV blocks in use or wanted, then the lowest index)
       when that instance's pending prefill tokens plus the prompt stay within ``ttft_tokens`` (the prompt tokens a
       decode-heavy instance gets through, at its small chunk, within the TTFT SLO); it is prefilled and decoded
       there and never moves. Every other prompt goes to the prefill-heavy instance with the fewest pending prefill
       tokens (then the lowest index).
    2. *decodes by TBT slack*: a request prefilled on a prefill-heavy instance moves to a decode-heavy instance
       once prefilled (its K/V handed over as a prefill instance's) when the prefill tokens that instance has
       pending at its arrival plus its own prompt are more than ``tbt_tokens``: ``tbt_tokens`` is what one step
       may carry within the TBT SLO, and work beyond it means steps above it (a prefill-heavy instance's chunk is
       larger by design) while the request would decode there, so its decode would miss the TBT SLO. Otherwise
       it decodes where it was prefilled (no transfer). ``tbt_tokens=0``: every request prefilled on a
       prefill-heavy instance moves (while a decode-heavy instance is left). The decode-heavy instance it moves
       to is the one with the fewest KV blocks in use or wanted (``pick_decode_by_load``), as after a
       disaggregated prefill.

    With every decode-heavy instance gone nothing moves and every prompt goes to a prefill-heavy instance; with
    every prefill-heavy instance gone every prompt goes to a decode-heavy one. Raises ``ValueError`` naming a bad
    value."""

    short: int = 256
    ttft_tokens: int = 2048
    tbt_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("short", "ttft_tokens", "tbt_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"hybrid rule: {name}={value!r} must be a non-negative integer (prompt tokens)")

    KEYS = {"short": "short", "ttft": "ttft_tokens", "tbt": "tbt_tokens"}

    @classmethod
    def parse(cls, text: str) -> HybridRule:
        """``"short=128,ttft=1024,tbt=64"`` (any of the three keys; the others default)."""
        values: dict[str, int] = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key.strip().lower() not in cls.KEYS or not value.strip().isdigit():
                raise ValueError(f"hybrid rule {item!r} in {text!r}: expected key=tokens with key one of "
                                 f"{', '.join(cls.KEYS)}, e.g. 'short=128,ttft=1024,tbt=64'")
            values[cls.KEYS[key.strip().lower()]] = int(value)
        return cls(**values)

    @property
    def text(self) -> str:
        return f"short={self.short},ttft={self.ttft_tokens},tbt={self.tbt_tokens}"


@dataclass(slots=True, frozen=True)
class Layout:
    """How many instances of each role: ``colocated`` replicas, or ``prefill`` and ``decode`` instances, with an
    optional conditional ``threshold`` (prompt tokens) or a ``hybrid`` rule (``HybridRule``: then the prefill role
    is the prefill-heavy instances and the decode role the decode-heavy ones, all of them colocated)."""

    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    threshold: int | None = None
    hybrid: HybridRule | None = None

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
        if self.hybrid is not None and (self.colocated or self.threshold is not None
                                        or not isinstance(self.hybrid, HybridRule)):
            raise ValueError(f"hybrid={self.hybrid!r}: a hybrid layout is prefill-heavy and decode-heavy instances "
                             f"(xPHyDH), with a HybridRule and no conditional threshold")

    @classmethod
    def parse(cls, spec: str, threshold: int | None = None) -> Layout:
        """``"N"`` or ``"NC"``: N colocated replicas; ``"xPyD"``: x prefill and y decode instances; ``"xPHyDH"``: a
        hybrid of x prefill-heavy and y decode-heavy instances, optionally with its rule,
        ``"1PH1DH/short=128,ttft=1024,tbt=64"`` (``HybridRule.parse``). ``parse(layout.label) == layout``."""
        text = str(spec).strip().upper()
        m = re.fullmatch(r"(\d+)C?", text)
        if m:
            return cls(colocated=int(m.group(1)), threshold=threshold)
        m = re.fullmatch(r"(\d+)PH(\d+)DH(?:/(.*))?", str(spec).strip(), re.IGNORECASE)
        if m:
            try:
                rule = HybridRule.parse(m.group(3) or "")
            except ValueError as e:
                raise ValueError(f"instances={spec!r}: {e}") from None
            return cls(prefill=int(m.group(1)), decode=int(m.group(2)), threshold=threshold, hybrid=rule)
        m = re.fullmatch(r"(\d+)P(\d+)D", text)
        if not m:
            raise ValueError(f"instances={spec!r}: expected N (colocated replicas), xPyD (e.g. '2P1D') or a hybrid "
                             f"xPHyDH (e.g. '1PH1DH' or '1PH1DH/short=128,ttft=1024,tbt=64')")
        return cls(prefill=int(m.group(1)), decode=int(m.group(2)), threshold=threshold)

    @property
    def label(self) -> str:
        if self.colocated:
            return f"{self.colocated}C"
        if self.hybrid is not None:
            base = f"{self.prefill}PH{self.decode}DH"
            return base if self.hybrid == HybridRule() else f"{base}/{self.hybrid.text}"
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


def route_hybrid(prompt_len: int, rule: HybridRule, prefill: Sequence[Load], decode: Sequence[Load]
                 ) -> tuple[str, int, bool]:
    """Where a new request of a hybrid layout goes, ``(role, index, moves)``, by ``rule`` (``HybridRule``) and the
    prefill-heavy (``prefill``) and decode-heavy (``decode``) instances' ``load_of`` (``None``: gone); ``moves``:
    it is to be prefilled only there and handed to a decode-heavy instance. Raises ``RuntimeError`` when no
    instance can take it."""
    live_decode = [(x[0], x[1], i) for i, x in enumerate(decode) if x is not None]
    live_prefill = [(x[0], i) for i, x in enumerate(prefill) if x is not None]
    if live_decode:
        pending, _, index = min(live_decode)
        if not live_prefill or (prompt_len <= rule.short and pending + prompt_len <= rule.ttft_tokens):
            return DECODE, index, False
    if not live_prefill:
        raise RuntimeError("no prefill-heavy or decode-heavy instance is left to take the request")
    pending, index = min(live_prefill)
    return PREFILL, index, bool(live_decode) and pending + prompt_len > rule.tbt_tokens


def pick_decode_by_load(decode: Sequence[Load]) -> int:
    """The decode instance a prefilled request goes to, by the instances' ``load_of`` (``None``: gone)."""
    return _least([None if x is None else (x[1],) for x in decode], "decode instance")


def _least(loads: Sequence[tuple[int, ...] | None], what: str) -> int:
    live = [(load, i) for i, load in enumerate(loads) if load is not None]
    if not live:
        raise RuntimeError(f"no {what} is left to take the request")
    return min(live)[1]
