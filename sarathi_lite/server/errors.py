"""One place that maps exceptions to OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``.

Client mistakes are 4xx naming the field (``param``); only the server's own failures are 500.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sarathi_lite.engine.errors import EngineDeadError, QueueFullError

logger = logging.getLogger(__name__)

_PARAM = re.compile(r"^(?:prompt\[\d+\]: )?(?:request '[^']*': )?(\w+)(?:=| contains )")


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def to_api_error(exc: BaseException, param: str | None = None) -> APIError:
    """The ``APIError`` of any exception: ``ValueError`` is the client's (400, ``param`` from the message's
    ``name=`` or ``name contains`` prefix, else ``param``), ``QueueFullError`` 503 with ``Retry-After``,
    ``EngineDeadError`` 503, anything else 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        match = _PARAM.match(str(exc))
        return APIError(400, str(exc), param=match.group(1) if match else param)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), type="server_error", code="queue_full",
                        headers={"Retry-After": str(max(1, round(exc.retry_after)))})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def sse_error(exc: BaseException) -> str:
    """The event that reports an error after a stream began (followed by ``[DONE]``)."""
    return f"data: {json.dumps(to_api_error(exc).body())}\n\n"


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    # a union field reports one error per member type: the one our own checks raised says most
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0] if errors else {})
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if loc[-1:] == ["[key]"] and len(loc) > 1 and isinstance(first.get("input"), str):
        loc[-2] = first["input"]  # a bad map key: pydantic's loc has it with lone surrogates replaced by U+FFFD
    loc = [_escaped(p) for p in loc]
    # a union field reports one error per member type; name the field, not the member
    param = ".".join(p for p in loc if not _is_type_name(p)) or None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request body")
    if "input" in first and param is not None and not isinstance(first["input"], (dict, list)):
        message += f" (got {first['input']!r})"
    return APIError(400, message, param=param)


def _escaped(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` escapes (a client's JSON can carry them; UTF-8 cannot)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list[int]", "list[str]", "list[list[int]]",
                    "list[TextPart]", "function-after[...]"} or part.startswith(("list[", "function-"))


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app returns an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        kind = request.headers.get("content-type")
        if request.method == "POST" and (kind is None or kind.split(";")[0].strip().lower() != "application/json"):
            return APIError(400, f"the body must be JSON sent with 'Content-Type: application/json'; got "
                                 f"{'no Content-Type' if kind is None else repr(kind[:80])}",
                            code="invalid_content_type").response()
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return to_api_error(exc).response()
