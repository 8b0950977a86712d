"""The hand-over of requests between instances, written once for every deployment (torch-free).

A deployment is colocated replicas, prefill and decode instances, or a hybrid of prefill-heavy and decode-heavy
colocated instances (``routing.Layout``; in a hybrid the prefill role is the prefill-heavy instances, the decode
role the decode-heavy ones). The simulator
(``sarathi_lite.sim.disagg``), the in-process engines (``sarathi_lite.engine.disagg_engine``) and the instance processes
(``sarathi_lite.engine.instances``) each give their instances to one ``Coordinator`` as ``Instance`` objects and
tell it what happened; they differ only in how an instance steps and how K/V moves.

How a request moves (``Coordinator``):

1. ``arrive``: the router (``routing.route_by_load`` on every instance's ``load()``) picks an instance; on a
   prefill instance the request is added *prefill only*: it stops after one token by length (the deployment adds
   it with ``max_tokens=1``, EOS and stop strings off), so its prompt's K/V is always kept for sending;
2. ``hand_over``: a prefill instance finished the prompt and holds its K/V (``Hold``); the router picks the decode
   instance with the fewest KV blocks in use or wanted, which gets the request with ``num_external_tokens =
   prompt_len - 1`` (it computes the last prompt token itself, to sample the first token with the request's own
   parameters, so greedy outputs equal one engine's);
   in a hybrid layout ``routing.route_hybrid`` decides at arrival where the request goes and whether it moves
   (``RequestRecord.prefill_only``): only a request that moves is added prefill only to its prefill-heavy
   instance; the others are added in full and decode where they were prefilled (the deployment tells them apart
   by ``prefill_only`` when they finish there);
3. ``release``: the decode side has the K/V (or needs it no more): the prefill instance lets the held blocks go;
4. ``finish``: the request ended (finished, aborted, failed): its record goes and any hold is released;
5. ``lost``: an instance is gone: the K/V it held is forgotten (a decode side waiting for it recomputes), the
   prompts it was prefilling only are routed again, the requests it served in full end.

The coordinator keeps the per-request records (``RequestRecord``: where a request is now, what the deployment
adds it with) and the routes (request id -> the instances it went through, e.g. ``["prefill0", "decode1"]``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from .routing import COLOCATED, DECODE, PREFILL, Layout, Load, pick_decode_by_load, route_by_load, route_hybrid

logger = logging.getLogger(__name__)


class InstanceGone(RuntimeError):
    """An instance turned out to be gone while the coordinator talked to it (the deployment has already handled
    the loss, ``Coordinator.lost``)."""


class NoInstanceLeft(RuntimeError):
    """No instance of the role a request needs is left to take it."""


class Refused(RuntimeError):
    """An instance refused a request handed over to it (the message says which and why): the hand-over ends."""


@dataclass(slots=True, eq=False)
class RequestRecord:
    """One unfinished request: ``prompt_len`` prompt tokens, ``arrival`` time, ``payload`` (what the deployment
    adds it with: its prompt and sampling parameters, opaque here), the instance it is on (``where``) and whether
    it was added there prefill only (``prefill_only``: it is to be handed over once prefilled)."""

    request_id: str
    prompt_len: int
    arrival: float
    payload: Any
    where: Instance | None = None
    prefill_only: bool = False


class Hold(NamedTuple):
    """K/V a prefill instance (``source``) holds for a request handed over at ``since``, under the deployment's
    ``token`` (a ``KVSave``, a handle, ``None``)."""

    source: Instance
    token: Any
    since: float


class Instance(Protocol):
    """What the coordinator needs of one instance of a deployment: its ``name`` (``"prefill0"``), ``role`` and
    ``requests`` (the ids the coordinator placed on it, kept by the coordinator)."""

    name: str
    role: str
    requests: set[str]

    def load(self) -> Load:
        """``routing.load_of`` of its scheduler (``None``: the instance is gone)."""

    def add(self, record: RequestRecord, prefill_only: bool, num_external_tokens: int, hold: Hold | None) -> None:
        """Queue the request: prefill only (one token, by length), or in full, its first ``num_external_tokens``
        prompt tokens' K/V coming from ``hold``. Raises ``InstanceGone`` if the instance is found gone, ``Refused``
        if it will not take a request handed over."""

    def release(self, request_id: str, token: Any) -> None:
        """The K/V held for ``request_id`` under ``token`` is needed no more."""


class Coordinator:
    """Routes and hands over the requests of ``layout`` over ``instances`` (role -> instances, in index order);
    see the module's docstring. max_routes: ``routes`` keeps at most this many most recent requests."""

    def __init__(self, layout: Layout, instances: dict[str, list[Instance]], max_routes: int | None = None) -> None:
        self.layout = layout
        self.instances = {role: list(instances.get(role, ())) for role in (COLOCATED, PREFILL, DECODE)}
        self.num_instances = sum(len(v) for v in self.instances.values())
        self.max_routes = max_routes
        self.requests: dict[str, RequestRecord] = {}
        """request id -> its record, while it is unfinished."""
        self.routes: dict[str, list[str]] = {}
        """request id -> the names of the instances it went through."""
        self.held: dict[str, Hold] = {}
        """request id -> the K/V held for it on a prefill instance, until ``release``."""

    def where(self, request_id: str) -> Instance | None:
        record = self.requests.get(request_id)
        return None if record is None else record.where

    # ------------------------------------------------------------------ a request's way

    def arrive(self, request_id: str, prompt_len: int, arrival: float, payload: Any) -> Instance:
        """A new request: record it and place it where the router says (``place``). Nothing is recorded if that
        raises."""
        record = RequestRecord(request_id, prompt_len, arrival, payload)
        self.requests[request_id] = record
        self.routes[request_id] = []
        if self.max_routes is not None:
            while len(self.routes) > self.max_routes:
                del self.routes[next(iter(self.routes))]
        try:
            return self.place(record)
        except BaseException:
            self.requests.pop(request_id, None)
            self.routes.pop(request_id, None)
            raise

    def place(self, record: RequestRecord) -> Instance:
        """Add ``record`` to the instance the router picks (prefill only on a prefill instance, or on a prefill-heavy
        one when the hybrid rule moves it); an instance found gone on the way is routed around. Raises
        ``NoInstanceLeft`` when none can take it."""
        for _ in range(self.num_instances):
            try:
                role, index, prefill_only = self.route(record.prompt_len)
            except RuntimeError as e:
                raise NoInstanceLeft(str(e)) from None
            inst = self.instances[role][index]
            try:
                inst.add(record, prefill_only, 0, None)
            except InstanceGone:
                continue
            record.prefill_only = prefill_only
            self._put(record, inst)
            return inst
        raise NoInstanceLeft(f"no instance took request {record.request_id!r}")

    def route(self, prompt_len: int) -> tuple[str, int, bool]:
        """Where a request of ``prompt_len`` prompt tokens goes now, ``(role, index, prefill_only)``, by the layout's
        rule on the instances' loads (``routing.route_by_load``, ``routing.route_hybrid``)."""
        loads = {role: [i.load() for i in self.instances[role]] for role in (COLOCATED, PREFILL, DECODE)}
        if self.layout.hybrid is not None:
            return route_hybrid(prompt_len, self.layout.hybrid, loads[PREFILL], loads[DECODE])
        role, index = route_by_load(prompt_len, self.layout, loads[COLOCATED], loads[PREFILL], loads[DECODE])
        return role, index, role == PREFILL

    def hand_over(self, request_id: str, token: Any = None, now: float = 0.0) -> Instance:
        """The prefill instance of ``request_id`` finished its prompt and holds its K/V under ``token``: add the
        request to the decode instance the router picks (another one if that one is found gone). In a hybrid
        layout with no decode-heavy instance left, the hold is released and the request placed again (``place``:
        served whole on a prefill-heavy instance; no output of it came out yet). Raises ``NoInstanceLeft`` (the
        hold stays: ``finish`` releases it) when no instance takes it."""
        record = self.requests[request_id]
        source = record.where
        assert source is not None and source.role == PREFILL and record.prefill_only, \
            f"{request_id!r} is not prefilled only on a prefill instance"
        source.requests.discard(request_id)
        record.where, record.prefill_only = None, False
        hold = self.held[request_id] = Hold(source, token, now)
        decode = self.instances[DECODE]
        error = "no decode instance is left"
        for _ in decode:
            try:
                target = decode[pick_decode_by_load([i.load() for i in decode])]
            except RuntimeError:
                break
            try:
                target.add(record, False, record.prompt_len - 1, hold)
            except InstanceGone as e:
                error = str(e)
                continue
            except Refused as e:
                error = str(e)
                break
            self._put(record, target)
            return target
        if self.layout.hybrid is not None and all(i.load() is None for i in decode):
            self.release(request_id)
            return self.place(record)
        raise NoInstanceLeft(error)

    def release(self, request_id: str) -> Hold | None:
        """The decode side has the K/V of ``request_id`` or needs it no more: the prefill instance releases it.
        Returns the hold (``None`` if there was none)."""
        hold = self.held.pop(request_id, None)
        if hold is not None:
            hold.source.release(request_id, hold.token)
        return hold

    def finish(self, request_id: str) -> RequestRecord | None:
        """``request_id`` ended (finished, aborted, failed): forget it and release its hold. Returns its record
        (``None`` if it was unknown)."""
        record = self.requests.pop(request_id, None)
        if record is None:
            return None
        if record.where is not None:
            record.where.requests.discard(request_id)
        if request_id in self.held:
            self.release(request_id)
        return record

    def _put(self, record: RequestRecord, inst: Instance) -> None:
        record.where = inst
        inst.requests.add(record.request_id)
        self.routes[record.request_id].append(inst.name)

    # ------------------------------------------------------------------ faults

    def lost(self, inst: Instance, end: Callable[[RequestRecord, BaseException | None], None]) -> None:
        """``inst`` is gone (its ``load()`` is ``None`` from now on): the K/V it held is forgotten (a decode side
        waiting for it recomputes), its requests added prefill only are placed again, and its other requests
        end: ``end(record, why)`` is called for each before it is forgotten (``why``: the error of a
        failed rerouting, or ``None``)."""
        for rid, hold in list(self.held.items()):
            if hold.source is inst:
                del self.held[rid]
        for rid in sorted(inst.requests):
            inst.requests.discard(rid)
            record = self.requests[rid]
            again = record.prefill_only  # no output of it came out: it can start over elsewhere
            record.where, record.prefill_only = None, False
            self.release(rid)
            why: BaseException | None = None
            if again:
                logger.warning("request %r: its prefill instance %s is gone; routing it again", rid, inst.name)
                try:
                    self.place(record)
                    continue
                except (InstanceGone, ValueError, RuntimeError) as e:
                    why = e
            end(record, why)
            self.finish(rid)

    def clear(self) -> None:
        """Forget every request and hold without releasing anything (every instance is gone)."""
        self.requests.clear()
        self.held.clear()
