"""The OpenAI-compatible HTTP server: FastAPI routes over an ``AsyncLLMEngine``.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` as
server-sent events ending in ``data: [DONE]``), ``GET /health``, ``GET /metrics`` (Prometheus text). The server
is thin: pydantic models validate a body and become ``SamplingParams`` and token ids; the engine never sees
HTTP; one function (``errors.to_api_error``) turns exceptions into OpenAI error bodies. A client that
disconnects mid-stream cancels its handler, which aborts its request.

Limits (``ServerConfig``): a bound on waiting requests (503 with ``Retry-After``), a body size cap (413), body
and header read timeouts, a per-request timeout that aborts, an optional API key (``limits.Limits``), and a
default ``max_tokens`` for chat. Tokenization and chat templating run on a worker thread, never on the event
loop. A request whose engine step fails ends with a 500 (or an error event); the engine goes on. Only a broken
device or worker stops it: ``/health`` then answers 503 saying why.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sarathi_lite.engine.async_engine import AsyncLLMEngine, RequestStream
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.server.config import ServerConfig
from sarathi_lite.server.errors import APIError, install_error_handlers, sse_error, to_api_error
from sarathi_lite.server.limits import Limits
from sarathi_lite.server.metrics import ServerMetrics
from sarathi_lite.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingRequest

DONE = "data: [DONE]\n\n"
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there (seconds)
T = TypeVar("T")


def build_app(engine: LLMEngine, served_model_name: str | None = None, config: ServerConfig | None = None
              ) -> FastAPI:
    """A FastAPI app serving ``engine`` (which it then owns: it is stepped by an ``AsyncLLMEngine`` thread and
    shut down with the app). served_model_name: the ``model`` clients must name (default: the folder name).
    config: the limits (default: ``ServerConfig()``'s). The header timeout is the HTTP server's: run the app
    with ``http=header_timeout_protocol(config.header_timeout)`` on uvicorn (``sarathi-lite serve`` does)."""
    config = config or ServerConfig()
    metrics = ServerMetrics()
    aengine = AsyncLLMEngine(engine, on_step=metrics.on_step, max_waiting_requests=config.max_waiting_requests,
                             retry_after=config.retry_after)
    metrics.watch(aengine)
    server = _Server(aengine, served_model_name or engine.model_path.name, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        aengine.shutdown()
        server.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="sarathi-lite", lifespan=lifespan)
    app.state.engine = aengine
    app.state.config = config
    install_error_handlers(app)
    app.add_middleware(Limits, config=config)

    @app.get("/health")
    async def health() -> dict[str, str]:
        if not aengine.is_running:
            raise APIError(503, f"the engine is not running: {aengine.dead_reason}", type="server_error",
                           code="engine_dead")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [server.model_card()]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completion(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    return app


class _Server:
    def __init__(self, aengine: AsyncLLMEngine, model_name: str, config: ServerConfig) -> None:
        self.aengine = aengine
        self.engine = aengine.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = model_name
        self.config = config
        self.max_model_len = self.engine.scheduler_config.max_model_len
        self.created = int(time.time())
        # One thread: tokenizers are not safe to call from several threads at once, and one keeps a burst of
        # long prompts from taking more than a core away from the engine thread.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sarathi-lite-tokenize")

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the tokenizer thread, so a long prompt never stalls the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "sarathi-lite",
                "max_model_len": self.max_model_len}

    # ------------------------------------------------------------------ the two endpoints

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        deadline = self._deadline()
        self._check_model(body.model)
        prompt_ids = await self._prompt_ids(body.prompt)
        max_tokens = self._max_tokens(len(prompt_ids), body.max_tokens, "prompt", "max_tokens")
        stream = await self._start(body, prompt_ids, max_tokens, body.logprobs, "prompt")
        fmt = _Format(self, stream.request_id, "text_completion", chat=False, top_logprobs=body.logprobs)
        return await self._respond(body, stream, fmt, request, deadline)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        deadline = self._deadline()
        self._check_model(body.model)
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, f"the model {self.model_name!r} has no chat template; use /v1/completions",
                           param="messages")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]

        def template() -> list[int]:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return tok(text, add_special_tokens=False).input_ids

        prompt_ids = await self._off_loop(template)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self._max_tokens(len(prompt_ids), requested, "messages", "max_completion_tokens"
                                      if body.max_completion_tokens is not None else "max_tokens",
                                      default=self.config.chat_default_max_tokens)
        top = None if not body.logprobs else (body.top_logprobs or 0)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        stream = await self._start(body, prompt_ids, max_tokens, top, "messages")
        fmt = _Format(self, stream.request_id, "chat.completion", chat=True, top_logprobs=top)
        return await self._respond(body, stream, fmt, request, deadline)

    # ------------------------------------------------------------------ shared steps

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _deadline(self) -> float | None:
        """When this request must be done (event loop time), or ``None`` without a ``request_timeout``."""
        timeout = self.config.request_timeout
        return None if timeout is None else asyncio.get_running_loop().time() + timeout

    def _timed_out(self) -> APIError:
        return APIError(504, f"the request did not finish within {self.config.request_timeout:g} s "
                             f"(request_timeout) and was aborted", type="server_error", code="timeout")

    async def _prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: got {len(prompt)} prompts; this server takes one per request",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            tok = self.tokenizer
            return await self._off_loop(lambda: tok(prompt).input_ids)
        return list(prompt)

    def _max_tokens(self, num_prompt: int, requested: int | None, prompt_param: str, param: str,
                    default: int | None = None) -> int:
        """``requested`` checked against the context left after the prompt; when ``None``, ``default`` capped
        by that room (all of it without a default)."""
        limit = self.max_model_len
        if num_prompt == 0:
            raise APIError(400, f"{prompt_param}: the prompt is empty", param=prompt_param)
        if num_prompt >= limit:
            raise APIError(400, f"{prompt_param}: the prompt has {num_prompt} tokens; this model's maximum context "
                           f"length is {limit} tokens (prompt and output together)", param=prompt_param,
                           code="context_length_exceeded")
        if requested is None:
            return limit - num_prompt if default is None else min(default, limit - num_prompt)
        if num_prompt + requested > limit:
            raise APIError(400, f"{param}: {num_prompt} prompt tokens + {param}={requested} exceed this model's "
                           f"maximum context length of {limit} tokens", param=param,
                           code="context_length_exceeded")
        return requested

    async def _start(self, body: _SamplingRequest, prompt_ids: list[int], max_tokens: int, logprobs: int | None,
                     prompt_param: str) -> RequestStream:
        try:
            params = body.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise to_api_error(e) from e
        rid = f"{'chatcmpl' if prompt_param == 'messages' else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            return await self.aengine.add_request(prompt_ids, params, rid)
        except ValueError as e:
            raise to_api_error(e, prompt_param) from e
        except Exception as e:  # a full queue (503 with Retry-After), a dead engine (503)
            raise to_api_error(e) from e

    async def _respond(self, body: _SamplingRequest, stream: RequestStream, fmt: _Format, request: Request,
                       deadline: float | None) -> Response:
        if body.stream:  # a disconnect cancels the streaming task, which aborts the request
            return StreamingResponse(self._events(body, stream, fmt, deadline), media_type="text/event-stream")
        loop = asyncio.get_running_loop()
        collect = asyncio.ensure_future(_last(stream))
        try:
            while not collect.done():  # nothing is sent until the end: watch for the client leaving meanwhile
                wait = DISCONNECT_POLL_S if deadline is None else min(DISCONNECT_POLL_S, deadline - loop.time())
                await asyncio.wait({collect}, timeout=max(wait, 0.0))
                if collect.done():
                    break
                if deadline is not None and loop.time() >= deadline:
                    collect.cancel()
                    raise self._timed_out()
                if await request.is_disconnected():
                    collect.cancel()
            final = await collect
        finally:
            await stream.aclose()
        if final.finish_reason == "error":
            raise APIError(500, final.error or "the engine failed this request", type="server_error")
        return JSONResponse(fmt.whole(final, _usage(final)))

    async def _events(self, body: _SamplingRequest, stream: RequestStream, fmt: _Format, deadline: float | None
                      ) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        try:
            if fmt.chat:
                yield _event(fmt.chunk(None, {"role": "assistant", "content": ""}, None, body))
            while True:
                try:
                    if deadline is None:
                        out = await stream.__anext__()
                    else:  # cancelling __anext__ aborts the request
                        out = await asyncio.wait_for(stream.__anext__(), max(deadline - loop.time(), 0.0))
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    yield sse_error(self._timed_out())
                    break
                if out.finish_reason == "error":
                    yield sse_error(APIError(500, out.error or "the engine failed this request", type="server_error"))
                    break
                usage = _usage(out) if body.continuous_usage else None
                yield _event(fmt.chunk(out, None, usage, body))
                if out.finished and body.include_usage:
                    yield _event({**fmt.envelope("chunk"), "choices": [], "usage": _usage(out)})
        except Exception as e:  # after the stream began: report it in the stream, then end it
            yield sse_error(e)
        finally:
            await stream.aclose()
        yield DONE


class _Format:
    """Turns step outputs into OpenAI completion / chat completion objects and chunks."""

    def __init__(self, server: _Server, request_id: str, object_name: str, *, chat: bool, top_logprobs: int | None
                 ) -> None:
        self.server = server
        self.request_id = request_id
        self.object_name = object_name
        self.chat = chat
        self.top_logprobs = top_logprobs
        self.created = int(time.time())
        self._text_offset = 0

    def envelope(self, kind: str) -> dict[str, Any]:
        name = self.object_name + (".chunk" if kind == "chunk" and self.chat else "")
        return {"id": self.request_id, "object": name, "created": self.created, "model": self.server.model_name}

    def chunk(self, out: RequestOutput | None, delta: dict[str, Any] | None, usage: dict[str, Any] | None,
              body: _SamplingRequest) -> dict[str, Any]:
        text = "" if out is None else out.new_text
        logprobs = None if out is None else self._logprobs(out.new_token_ids, out.new_logprobs)
        finish = None if out is None else out.finish_reason
        if self.chat:
            choice = {"index": 0, "delta": delta if delta is not None else ({"content": text} if text else {}),
                      "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        chunk = {**self.envelope("chunk"), "choices": [choice]}
        if body.include_usage or body.continuous_usage:
            chunk["usage"] = usage
        return chunk

    def whole(self, final: RequestOutput, usage: dict[str, Any]) -> dict[str, Any]:
        logprobs = self._logprobs(final.token_ids or [], final.logprobs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": final.text or ""},
                      "logprobs": logprobs, "finish_reason": final.finish_reason}
        else:
            choice = {"index": 0, "text": final.text or "", "logprobs": logprobs,
                      "finish_reason": final.finish_reason}
        return {**self.envelope("whole"), "choices": [choice], "usage": usage}

    def _logprobs(self, token_ids: list[int], logprobs: list[Any] | None) -> dict[str, Any] | None:
        if self.top_logprobs is None or logprobs is None:
            return None
        name = self._token_text
        if self.chat:
            content = []
            for tid, (lp, top) in zip(token_ids, logprobs):
                s = name(tid)
                content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                                "top_logprobs": [{"token": name(t), "logprob": v, "bytes": list(name(t).encode())}
                                                 for t, v in top.items()]})
            return {"content": content}
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, (lp, top) in zip(token_ids, logprobs):
            s = name(tid)
            tokens.append(s)
            token_logprobs.append(lp)
            tops.append({name(t): v for t, v in top.items()})
            offsets.append(self._text_offset)
            self._text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _token_text(self, token_id: int) -> str:
        tok = self.server.tokenizer
        return f"token_id:{token_id}" if tok is None else tok.decode([token_id])


async def _last(stream: RequestStream) -> RequestOutput:
    final = None
    async for out in stream:
        final = out
    return final


def _usage(out: RequestOutput) -> dict[str, Any]:
    prompt = len(out.prompt_token_ids)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": out.num_output_tokens,
                             "total_tokens": prompt + out.num_output_tokens}
    # prefix caching reports how many prompt tokens it did not recompute here
    cached = getattr(out.metrics, "num_cached_tokens", None)
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

