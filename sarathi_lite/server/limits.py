"""The server's limits below the routes: the API key, the body size cap and the body read timeout (an ASGI
middleware, ``Limits``), and the header read timeout (``header_timeout_protocol``: uvicorn's h11 protocol with a
timer from the connection's first byte to its request's last header).

Every rejection is an OpenAI error body; 408 and 413 also close the connection (``connection: close``), since
the rest of the body may never come.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from sarathi_lite.server.config import ServerConfig
from sarathi_lite.server.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/metrics"})


class Limits:
    """ASGI middleware: 401 without the API key, 400 with several ``Authorization`` headers (``/health`` and
    ``/metrics`` stay open unless ``auth_health_and_metrics``), 415 for a compressed body (a ``Content-Encoding``
    other than ``identity``), 413 for a body over ``max_body_bytes`` (by its ``content-length`` before
    reading, or as it arrives), 408 when the body is not in ``body_timeout`` seconds after the headers. The app
    then gets the whole body in one message (as FastAPI reads it anyway); later ``receive`` calls (disconnect
    checks) reach the client."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self.config = config
        self._key = None if config.api_key is None else config.api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cfg = self.config
        raw = scope.get("headers") or ()
        headers = dict(raw)
        if self._key is not None and (scope["path"] not in OPEN_PATHS or cfg.auth_health_and_metrics):
            count = sum(name == b"authorization" for name, _ in raw)
            if count > 1:  # which one counts would be up to each proxy on the way: none does
                await _reply(send, APIError(400, f"the request has {count} Authorization headers; send one",
                                            code="invalid_api_key"), close=True)
                return
            if not self._authorized(headers.get(b"authorization", b"")):
                await _reply(send, APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                                            code="invalid_api_key"))
                return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > cfg.max_body_bytes):
            if not length.isdigit():
                await _reply(send, APIError(400, f"content-length {length[:40]!r} is not a byte count"), close=True)
            else:
                await _reply(send, _too_large(int(length), cfg.max_body_bytes), close=True)
            return
        encoding = headers.get(b"content-encoding", b"").strip().lower()
        if encoding not in (b"", b"identity"):
            await _reply(send, APIError(415, f"Content-Encoding {encoding.decode('latin-1')[:40]!r} is not supported: "
                                             f"send the body uncompressed", code="unsupported_content_encoding"),
                         close=True)
            return
        body = await self._read_body(receive, send)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or ``None`` once it answered (408, 413) or the client left."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.body_timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                await _reply(send, APIError(408, f"the request body did not arrive within {cfg.body_timeout:g} s "
                                                 f"(body_timeout)", code="request_timeout"), close=True)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cfg.max_body_bytes:
                await _reply(send, _too_large(size, cfg.max_body_bytes, at_least=True), close=True)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    return APIError(413, f"the request body is {'over ' if at_least else ''}{size} bytes; this server takes at most "
                         f"{limit} (max_body_bytes)", code="request_too_large")


async def _reply(send: Send, error: APIError, close: bool = False) -> None:
    response = error.response()
    if close:
        response.headers["connection"] = "close"
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def header_timeout_protocol(timeout: float) -> type:
    """uvicorn's h11 protocol class that closes a connection whose request line and headers are not complete
    ``timeout`` seconds after the connection opened or its previous response ended (uvicorn has no such limit:
    a client sending partial headers would hold its connection for good). For ``uvicorn.Config(http=...)``."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
