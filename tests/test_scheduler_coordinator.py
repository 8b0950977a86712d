"""The hand-over coordinator (``sarathi_lite.scheduler.coordinator``) on stand-in instances, torch-free: routing,
the hand-over and its hold, release on finish, a refused hand-over, and a lost instance's requests rerouted or
ended."""

from __future__ import annotations

from typing import Any

import pytest

from sarathi_lite.scheduler.coordinator import Coordinator, Hold, InstanceGone, NoInstanceLeft, Refused, RequestRecord
from sarathi_lite.scheduler.routing import Layout


class Stub:
    """An instance whose load the test sets; it records what it was asked."""

    def __init__(self, role: str, index: int) -> None:
        self.role, self.name, self.requests = role, f"{role}{index}", set()
        self.pending, self.demand, self.gone, self.refuse, self.dies_on_add = 0, 0, False, False, False
        self.added: list[tuple[str, bool, int, Any]] = []
        self.released: list[tuple[str, Any]] = []

    def load(self) -> tuple[int, int] | None:
        return None if self.gone else (self.pending, self.demand)

    def add(self, record: RequestRecord, prefill_only: bool, num_external_tokens: int, hold: Hold | None) -> None:
        if self.dies_on_add:  # as a deployment does, it marks the instance gone before raising
            self.gone = True
            raise InstanceGone(f"{self.name} is gone")
        if self.refuse and hold is not None:
            raise Refused(f"{self.name} refuses")
        self.added.append((record.request_id, prefill_only, num_external_tokens, None if hold is None else hold.token))
        self.pending += record.prompt_len if prefill_only or hold is None else 1

    def release(self, request_id: str, token: Any) -> None:
        self.released.append((request_id, token))


def deployment(spec: str, threshold: int | None = None) -> tuple[Coordinator, dict[str, list[Stub]]]:
    layout = Layout.parse(spec, threshold)
    stubs = {"colocated": [Stub("colocated", i) for i in range(layout.colocated)],
             "prefill": [Stub("prefill", i) for i in range(layout.prefill)],
             "decode": [Stub("decode", i) for i in range(layout.decode)]}
    return Coordinator(layout, stubs), stubs


def test_a_request_is_prefilled_handed_over_held_and_released():
    coord, stubs = deployment("2P2D")
    (p0, p1), (d0, d1) = stubs["prefill"], stubs["decode"]
    assert coord.arrive("a", 10, 0.0, None) is p0
    assert coord.arrive("b", 5, 0.0, None) is p1  # fewer pending prefill tokens
    assert p0.added == [("a", True, 0, None)]  # prefill only
    d0.demand = 3
    assert coord.hand_over("a", token="h-a", now=1.5) is d1  # fewer KV blocks in use or wanted
    assert d1.added == [("a", False, 9, "h-a")]  # all but the last prompt token come from the hold
    assert coord.held["a"] == Hold(p0, "h-a", 1.5) and "a" not in p0.requests and "a" in d1.requests
    assert coord.routes["a"] == ["prefill0", "decode1"]
    assert coord.release("a").token == "h-a" and p0.released == [("a", "h-a")]
    assert coord.release("a") is None  # once
    coord.finish("a")
    assert "a" not in coord.requests and not d1.requests and p0.released == [("a", "h-a")]
    coord.hand_over("b", token="h-b")
    coord.finish("b")  # ended before the decode side had its K/V: the hold goes with it
    assert p1.released == [("b", "h-b")] and not coord.held


def test_conditional_routing_and_colocated_replicas():
    coord, stubs = deployment("1P1D", threshold=8)
    assert coord.arrive("short", 8, 0.0, None) is stubs["decode"][0]
    assert stubs["decode"][0].added == [("short", False, 0, None)]
    assert coord.arrive("long", 9, 0.0, None) is stubs["prefill"][0]
    coord, stubs = deployment("2")
    assert [coord.arrive(r, 4, 0.0, None).name for r in "abc"] == ["colocated0", "colocated1", "colocated0"]


def test_a_gone_instance_is_routed_around_and_a_refusal_ends_the_hand_over():
    coord, stubs = deployment("2P2D")
    (p0, p1), (d0, _) = stubs["prefill"], stubs["decode"]
    p0.dies_on_add = True  # it looks live until the request is added to it: the router then picks p1
    assert coord.arrive("a", 4, 0.0, None) is p1
    d0.refuse = True
    with pytest.raises(NoInstanceLeft, match="decode0 refuses"):
        coord.hand_over("a", token=7)
    assert coord.held["a"].token == 7  # kept for finish to release
    coord.finish("a")
    assert p1.released == [("a", 7)]
    for s in stubs["prefill"] + stubs["decode"]:
        s.gone = True
    with pytest.raises(NoInstanceLeft, match="no decode instance is left"):
        coord.arrive("b", 4, 0.0, None)
    assert "b" not in coord.requests and "b" not in coord.routes  # nothing recorded


def test_a_lost_instance_drops_its_holds_reroutes_its_prompts_and_ends_its_decodes():
    coord, stubs = deployment("2P1D")
    (p0, p1), (d0,) = stubs["prefill"], stubs["decode"]
    coord.arrive("done", 4, 0.0, None)  # p0
    coord.arrive("prefilling", 4, 0.0, None)  # p1
    coord.arrive("waiting", 4, 0.0, None)  # p0 (4 vs 4: the lower index)
    coord.hand_over("done", token=1)  # on d0, its K/V held on p0
    ended: list[tuple[str, Any]] = []
    p0.gone = True
    coord.lost(p0, lambda record, why: ended.append((record.request_id, why)))
    assert "done" not in coord.held and p0.released == []  # the decode side recomputes; nothing to release
    assert coord.where("waiting") is p1 and coord.routes["waiting"] == ["prefill0", "prefill1"]
    assert not ended and not p0.requests
    p1.gone = True
    coord.lost(p1, lambda record, why: ended.append((record.request_id, why)))
    # no prefill instance left: both prompts go to the decode instance, which prefills them itself
    assert coord.where("prefilling") is d0 and coord.where("waiting") is d0 and not ended
    d0.gone = True
    coord.lost(d0, lambda record, why: ended.append((record.request_id, why)))
    assert sorted(ended) == [("done", None), ("prefilling", None), ("waiting", None)]
    assert not coord.requests
