"""``AsyncLLMEngine``: an ``LLMEngine`` stepped by its own thread, streamed to asyncio callers.

The engine thread owns the model; event loops own the connections; they meet at per-request ``asyncio.Queue``s.
Adds and aborts are commands the engine thread applies between steps, so a request added while a step runs
joins the next one (continuous batching), and an abort frees the request's KV blocks before the next step.

>>> engine = AsyncLLMEngine(LLMEngine("smollm2-135m"))
>>> async for out in engine.generate("Hello", SamplingParams(max_tokens=16), "req-1"):
...     print(out.new_text, end="")
>>> engine.shutdown()
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sarathi_lite.engine.errors import EngineDeadError, QueueFullError
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.engine.snapshot import EngineSnapshot
from sarathi_lite.kernels.cpu_native import release_thread_pool

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "RequestStream", "Reservation"]

IDLE_HEALTH_CHECK_S = 1.0  # how often an idle engine loop calls the engine's check_health (seconds)


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    stream: _Stream
    accepted: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str
    stream: _Stream | None  # only if the request still streams to this consumer; None: whoever it is


StepListener = Callable[[LLMEngine, list[RequestOutput]], None]


class AsyncLLMEngine:
    """Runs ``engine.step()`` in a background thread while any request is unfinished.

    engine: the ``LLMEngine`` to drive; from now on only this object may call it.
    on_step: called in the engine thread after every step with the engine and that step's outputs (e.g. to
    update metrics); it must be quick and must not raise.
    max_waiting_requests: admission control: ``add_request`` raises ``QueueFullError`` while this many requests
    wait (queued for the engine thread, in the scheduler's waiting queue, preempted ones included, or held by a
    ``reserve``); ``None``: no bound. retry_after: the wait (seconds) ``QueueFullError`` suggests. Requests that
    belong together (the prompts and completions of one HTTP request) are let in all at once or not at all with
    ``reserve``.

    A step that fails ends only its own requests (``finish_reason="error"``, see ``LLMEngine.step``); only a
    broken device or worker (``EngineDeadError``) stops the loop, and then ``dead_reason`` says why. While idle,
    the loop calls the engine's ``check_health()`` (if it has one) every ``IDLE_HEALTH_CHECK_S`` seconds, so a
    lost worker or instance is noticed without traffic.

    The engine thread takes over the caller's torch work: the caller's idle OpenMP workers are released here
    (``kernels.cpu_native.release_thread_pool``), since two pools on a machine of few cores slowed every CPU step
    by about 30%. Torch work the caller runs later builds a new pool (correct, the steps only slower again).
    """

    def __init__(self, engine: LLMEngine, on_step: StepListener | None = None,
                 max_waiting_requests: int | None = None, retry_after: float = 1.0) -> None:
        if max_waiting_requests is not None and (isinstance(max_waiting_requests, bool)
                                                 or not isinstance(max_waiting_requests, int)
                                                 or max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests={max_waiting_requests!r} must be a positive integer or None")
        self.engine = engine
        self.on_step = on_step
        self.max_waiting_requests = max_waiting_requests
        self.retry_after = retry_after
        self._num_adds = 0  # _Add commands not yet applied
        self._num_waiting = 0  # the scheduler's waiting queue after the engine thread's last step
        self._num_reserved = 0  # places held by reservations for requests not added yet
        self._commands: list[_Add | _Abort] = []
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        # torch's CPU thread count is per OS thread (OpenMP): carry the caller's over to the engine thread, and
        # release the caller's idle OpenMP workers (built with the engine): with two pools on a machine of few
        # cores, libgomp lets idle workers spin only briefly, and the engine's every matmul waits for a wake-up
        self._num_threads = torch.get_num_threads()
        release_thread_pool()
        self._thread = threading.Thread(target=self._loop, name="sarathi-lite-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the asyncio side

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stopping

    @property
    def dead_reason(self) -> str | None:
        """Why the engine loop stopped (``None`` while it runs)."""
        if self._error is not None:
            return f"{type(self._error).__name__}: {self._error}"
        return "the engine was shut down" if self._stopping or not self._thread.is_alive() else None

    @property
    def num_waiting(self) -> int:
        """Requests waiting: added but not yet applied by the engine thread, in the scheduler's queue (as of the
        last step), or reserved and not added yet."""
        return self._num_adds + self._num_waiting + self._num_reserved

    @property
    def num_streams(self) -> int:
        """Requests with a consumer still waiting for outputs."""
        return len(self._streams)

    def snapshot(self) -> EngineSnapshot:
        """The engine's queues and KV pool as of its last step (``LLMEngine.snapshot``): safe from any thread."""
        return self.engine.snapshot()

    def reserve(self, count: int) -> Reservation:
        """Hold ``count`` places in ``max_waiting_requests`` for requests about to be added with
        ``add_request(..., reservation=...)``, all at once: raises ``QueueFullError`` when they do not all fit
        now, ``ValueError`` when they never could (more than the bound), ``EngineDeadError`` if the engine loop
        stopped. ``Reservation.release()`` gives back the places never used."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count={count!r} must be a positive integer")
        with self._lock:
            self._hold(count)
        return Reservation(self, count)

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                          request_id: str | None = None, reservation: Reservation | None = None) -> RequestStream:
        """Queue a request; once the engine thread accepted it, return the stream of its step outputs.

        Raises ``ValueError`` for bad input, as ``LLMEngine.add_request`` does, ``QueueFullError`` when
        ``max_waiting_requests`` requests wait already (unless it takes one of the places of ``reservation``, see
        ``reserve``), and ``EngineDeadError`` if the engine loop stopped. Iterate the stream to its end or
        ``aclose()`` it: closing or cancelling aborts.
        """
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        accepted = loop.create_future()
        self._submit(_Add(request_id, prompt, params or SamplingParams(), stream, accepted), reservation)
        try:
            await accepted
        except asyncio.CancelledError:
            self._abort(_Abort(request_id, stream))  # applied after the add: the request never runs
            raise
        return RequestStream(self, request_id, stream)

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """``add_request`` then yield its step outputs (deltas) until the one that finishes it; closing or
        cancelling the consumer aborts the request."""
        outputs = await self.add_request(prompt, params, request_id)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); its generator ends with an ``"abort"`` output."""
        self._abort(_Abort(request_id, None))

    def _abort(self, abort: _Abort) -> None:
        with self._lock:
            if self._error is None and not self._stopping:
                self._commands.append(abort)
                self._wake.notify()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread after its current step; waiting generators raise ``EngineDeadError``."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    def _submit(self, add: _Add, reservation: Reservation | None = None) -> None:
        with self._lock:
            if reservation is None:
                self._hold(1)
            else:
                self._check_running()
                reservation.take()
            self._num_reserved -= 1
            self._num_adds += 1
            self._commands.append(add)
            self._wake.notify()

    def _check_running(self) -> None:
        if self._error is not None or self._stopping:
            raise EngineDeadError("the engine is not running" + (f": {self._error!r}" if self._error else ""))

    def _hold(self, count: int) -> None:
        """Count ``count`` more requests as waiting, or raise (under the lock)."""
        self._check_running()
        bound = self.max_waiting_requests
        if bound is not None:
            if count > bound:
                raise ValueError(f"{count} requests at once are more than max_waiting_requests={bound}: they could "
                                 f"never all wait")
            if self._num_adds + self._num_waiting + self._num_reserved + count > bound:
                waiting = self._num_adds + self._num_waiting + self._num_reserved
                raise QueueFullError(f"the server is busy: {waiting} requests are waiting and the bound is {bound} "
                                     f"(max_waiting_requests)" + (f", too few places for {count}" if count > 1 else "")
                                     + f"; retry after {self.retry_after:g} s", self.retry_after)
        self._num_reserved += count

    def _release(self, count: int) -> None:
        with self._lock:
            self._num_reserved -= count

    # ------------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        engine = self.engine
        check_health = getattr(engine, "check_health", None)
        torch.set_num_threads(self._num_threads)
        try:
            while True:
                idle = False
                with self._lock:
                    while not self._commands and not self._stopping and not engine.has_unfinished_requests():
                        if not self._wake.wait(IDLE_HEALTH_CHECK_S):
                            idle = True
                            break
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                    self._num_waiting += self._num_adds  # until _apply says how many it queued
                    self._num_adds = 0
                if idle and not commands:
                    if check_health is not None:  # a lost worker or instance is noticed without traffic too
                        check_health()
                    continue
                self._apply(commands)
                self._num_waiting = engine.snapshot().num_waiting
                if engine.has_unfinished_requests():
                    outputs = engine.step()  # a failed step fails its requests; only a dead device raises
                    self._num_waiting = engine.snapshot().num_waiting
                    if self.on_step is not None:
                        self.on_step(engine, outputs)
                    self._deliver(outputs)
        except BaseException as e:  # the engine cannot go on: every waiting generator must hear of it, not hang
            logger.exception("engine loop failed")
            with self._lock:
                self._error = e
            self._fail_all(e)
            return
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        engine = self.engine
        aborted = []
        for c in commands:
            if isinstance(c, _Abort):
                stream = self._streams.get(c.request_id)
                if c.stream is not None and stream is not c.stream:
                    continue  # that consumer's request already finished (or never started)
                try:
                    out = engine.abort_request(c.request_id)
                except ValueError:  # it finished in the step before the abort arrived
                    continue
                aborted.append(out)
                continue
            try:
                engine.add_request(c.request_id, c.prompt, c.params)
            except Exception as e:  # bad input: this request fails, the engine goes on
                _call(c.stream.loop, _settle, c.accepted, e)
                continue
            self._streams[c.request_id] = c.stream
            _call(c.stream.loop, _settle, c.accepted, None)
        if aborted:
            if self.on_step is not None:
                self.on_step(engine, aborted)
            self._deliver(aborted)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for out in outputs:
            stream = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            _call(loop, _put_all, items)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        with self._lock:
            pending, self._commands = self._commands, []
        for c in pending:
            if isinstance(c, _Add):
                _call(c.stream.loop, _settle, c.accepted, EngineDeadError(f"the engine stopped: {error!r}"))
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for stream in streams.values():
            by_loop.setdefault(stream.loop, []).append((stream.queue, error))
        for loop, items in by_loop.items():
            _call(loop, _put_all, items)


class RequestStream:
    """The step outputs of one request, as an async iterator that ends after the finishing output.

    Cancelling a pending ``__anext__`` or calling ``aclose()`` before the end aborts the request (its KV blocks
    are free before the engine's next step). Raises ``EngineDeadError`` if the engine loop stops.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, stream: _Stream) -> None:
        self.request_id = request_id
        self._engine = engine
        self._stream = stream
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.queue.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise EngineDeadError(f"the engine stopped: {item!r}") from item
        if item.finished:
            self._done = True
        return item

    async def aclose(self) -> None:
        """Abort the request unless it already ended."""
        if not self._done:
            self._done = True
            self._engine._abort(_Abort(self.request_id, self._stream))


class Reservation:
    """Places held in an ``AsyncLLMEngine``'s bound of waiting requests (``AsyncLLMEngine.reserve``): each
    ``add_request(..., reservation=...)`` takes one; ``release()`` gives back those not taken (at most once)."""

    def __init__(self, engine: AsyncLLMEngine, count: int) -> None:
        self._engine = engine
        self.left = count

    def take(self) -> None:
        """Use one place (the engine calls it under its lock)."""
        if self.left < 1:
            raise ValueError("this reservation has no place left")
        self.left -= 1

    def release(self) -> None:
        """Give back the places not taken."""
        left, self.left = self.left, 0
        if left:
            self._engine._release(left)


def _call(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
