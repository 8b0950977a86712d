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
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sarathi_lite.engine.async_engine import AsyncLLMEngine, RequestStream, Reservation
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.parallel_sampling import child_ids, child_params, pick
from sarathi_lite.engine.prompts import ContextLengthError, check_context, check_token_ids
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.server.config import ServerConfig
from sarathi_lite.server.errors import APIError, install_error_handlers, sse_error, to_api_error
from sarathi_lite.server.limits import Limits
from sarathi_lite.server.metrics import ServerMetrics
from sarathi_lite.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
_PID = re.compile(r" \(pid \d+\)")  # how a lost worker's or instance's message names its process
MIN_LOGPROB = -9999.0
"""The log-probability the wire carries for a token that cannot be sampled (-inf: a token that ``min_tokens``
bans still appears among ``top_logprobs`` when fewer tokens are left than asked for); JSON has no infinity, and
-9999.0 is vLLM's value."""
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

    states = getattr(engine, "instance_states", None)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """200 ``{"status": "ok"}`` while the engine runs; with instances (``--instances``) also their count per
        role and state, and ``"degraded"`` once one is lost. 503 naming why once the engine cannot serve (without
        process ids: the route is open to anyone who can reach the port; the log has them)."""
        instances = None if states is None else states()
        if not aengine.is_running:
            detail = "" if instances is None else f" (instances: {json.dumps(instances)})"
            reason = _PID.sub("", aengine.dead_reason or "")
            raise APIError(503, f"the engine is not running: {reason}{detail}", type="server_error",
                           code="engine_dead")
        if instances is None:
            return {"status": "ok"}
        lost = any(s["lost"] or s["stopped"] for s in instances.values())
        return {"status": "degraded" if lost else "ok", "instances": instances}

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)  # load balancers probe with it

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
        self.vocab_size = self.engine.model_config.vocab_size
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
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs needs the prompt tokens' logprobs, which this server does not "
                                "compute; drop one of them", param="echo")
        prompts = body.prompts()
        cap = self.config.max_prompts_per_request
        if len(prompts) > cap:
            raise APIError(400, f"the request has {len(prompts)} prompts; this server takes at most {cap} in one "
                                f"request (max_prompts_per_request)", param="prompt")
        several = len(prompts) > 1
        token_ids, params, echoes = [], [], []
        reservation = self._reserve(body, len(prompts))  # before the tokenizer's work: a full queue costs nothing
        try:
            for i, prompt in enumerate(prompts):
                where = f"prompt[{i}]" if several else "prompt"
                ids = await self._prompt_ids(prompt, where)
                max_tokens = self._fit(len(ids), body.max_tokens, where, "prompt", "max_tokens",
                                       self.config.completions_default_max_tokens)
                token_ids.append(ids)
                params.append(self._params(body, max_tokens, body.logprobs))
        except BaseException:
            reservation.release()
            raise
        group = await self._start(body, token_ids, params, "cmpl", reservation)
        if body.echo:  # after the engine took the ids: only ids inside the vocabulary are decoded
            try:
                echoes = [p if isinstance(p, str) else await self._decode(ids) for p, ids in zip(prompts, token_ids)]
            except BaseException:
                await group.aclose()
                raise
        fmt = _Format(self, group.request_id, "text_completion", chat=False, top_logprobs=body.logprobs,
                      echoes=echoes or None)
        return await self._respond(body, group, fmt, request, deadline)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        deadline = self._deadline()
        self._check_model(body.model)
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, f"the model {self.model_name!r} has no chat template; use /v1/completions",
                           param="messages")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        try:
            messages = body.conversation()
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e

        def template() -> list[int]:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return tok(text, add_special_tokens=False).input_ids

        prompt_ids = await self._off_loop(template)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self._fit(len(prompt_ids), requested, "messages", "messages", "max_completion_tokens"
                               if body.max_completion_tokens is not None else "max_tokens",
                               self.config.chat_default_max_tokens)
        top = None if not body.logprobs else (body.top_logprobs or 0)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        params = self._params(body, max_tokens, top)
        group = await self._start(body, [prompt_ids], [params], "chatcmpl", self._reserve(body, 1))
        fmt = _Format(self, group.request_id, "chat.completion", chat=True, top_logprobs=top)
        return await self._respond(body, group, fmt, request, deadline)

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

    async def _prompt_ids(self, prompt: str | list[int], where: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, f"{where}: this model has no tokenizer: send the prompt as token ids",
                               param="prompt")
            tok = self.tokenizer
            return await self._off_loop(lambda: tok(prompt).input_ids)
        try:
            return check_token_ids(where, prompt, self.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from e

    async def _decode(self, token_ids: list[int]) -> str:
        tok = self.tokenizer
        return "" if tok is None else await self._off_loop(lambda: tok.decode(token_ids))

    def _fit(self, num_prompt: int, requested: int | None, where: str, prompt_param: str, param: str,
             default: int) -> int:
        """The ``max_tokens`` to run with (``prompts.check_context``, the Python API's rule too)."""
        try:
            return check_context(num_prompt, requested, self.max_model_len, where, prompt_param, param, default)
        except ContextLengthError as e:
            code = None if num_prompt == 0 else "context_length_exceeded"
            raise APIError(400, str(e), param=e.param, code=code) from e

    def _params(self, body: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            params = body.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise to_api_error(e) from e
        if body.stream and params.num_completions > params.n:
            raise APIError(400, f"best_of={params.best_of} > n={params.n} cannot stream: the best completions are "
                                f"known only at the end", param="best_of")
        return params

    def _reserve(self, body: SamplingRequest, num_prompts: int) -> Reservation:
        """Places in the queue bound for every completion of every prompt (``AsyncLLMEngine.reserve``): 503 when
        they do not all fit now, 400 when they never could."""
        completions = max(body.n, body.best_of or body.n)
        count = num_prompts * completions
        bound = self.config.max_waiting_requests
        if bound is not None and count > bound:
            what = f"{num_prompts} prompts x {completions} completions" if num_prompts > 1 else \
                f"{completions} completions"
            raise APIError(400, f"the request needs {what} = {count} requests, more than the {bound} this server "
                                f"queues (max_waiting_requests)", param="prompt" if num_prompts > 1 else "n")
        try:
            return self.aengine.reserve(count)
        except Exception as e:  # a full queue (503 with Retry-After), a dead engine (503)
            raise to_api_error(e) from e

    async def _start(self, body: SamplingRequest, token_ids: list[list[int]], params: list[SamplingParams],
                     prefix: str, reservation: Reservation) -> _Choices:
        group = _Choices(self.aengine, f"{prefix}-{uuid.uuid4().hex}", token_ids, params, reservation)
        try:
            await group.start()
        except BaseException as e:  # those that started are aborted, the places not used given back
            await group.aclose()
            if isinstance(e, ValueError):
                raise to_api_error(e, "messages" if prefix == "chatcmpl" else "prompt") from e
            if isinstance(e, Exception):  # a dead engine (503)
                raise to_api_error(e) from e
            raise
        return group

    async def _respond(self, body: SamplingRequest, group: _Choices, fmt: _Format, request: Request,
                       deadline: float | None) -> Response:
        if body.stream:  # a disconnect cancels the streaming task, which aborts the requests
            return StreamingResponse(self._events(body, group, fmt, deadline), media_type="text/event-stream")
        loop = asyncio.get_running_loop()
        collect = asyncio.ensure_future(group.finals())
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
                    await asyncio.wait({collect})
                    logger.info("%s: the client left before the end; its requests were aborted", group.request_id)
                    return Response(status_code=499)  # nobody reads it: the connection is gone
            try:
                finals = collect.result()
            except Exception as e:
                raise to_api_error(e) from e
        finally:
            await group.aclose()
        failed = next((o for o in finals.values() if o.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, failed.error or "the engine failed this request", type="server_error")
        choices = []
        for i, p in enumerate(group.params):
            for out in pick([finals[(i, k)] for k in range(p.num_completions)], p):
                choices.append(fmt.whole_choice(i * p.n + out.index, out, i))
        return JSONResponse({**fmt.envelope("whole"), "choices": choices, "usage": group.usage(finals)})

    async def _events(self, body: SamplingRequest, group: _Choices, fmt: _Format, deadline: float | None
                      ) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        complete = False
        try:
            if fmt.chat:
                for i, p in enumerate(group.params):
                    for k in range(p.n):
                        yield _event(fmt.chunk(i * p.n + k, None, {"role": "assistant", "content": ""}, None, body))
            while True:
                try:
                    item = await (group.next() if deadline is None
                                  else asyncio.wait_for(group.next(), max(deadline - loop.time(), 0.0)))
                except asyncio.TimeoutError:
                    yield sse_error(self._timed_out())
                    break
                if item is None:
                    complete = True
                    break
                i, k, out = item
                if out.finish_reason == "error":
                    yield sse_error(APIError(500, out.error or "the engine failed this request", type="server_error"))
                    break
                usage = _usage(out) if body.continuous_usage else None
                yield _event(fmt.chunk(i * group.params[i].n + k, out, None, usage, body, prompt=i))
            if complete and body.include_usage:
                yield _event({**fmt.envelope("chunk"), "choices": [], "usage": group.usage(group.done)})
        except asyncio.CancelledError:
            logger.info("%s: the client left mid-stream; its requests were aborted", group.request_id)
            raise
        except Exception as e:  # after the stream began: report it in the stream, then end it
            yield sse_error(e)
        finally:
            await group.aclose()
        yield DONE


class _Choices:
    """The engine requests behind one HTTP request: per prompt, its ``num_completions`` completions
    (``parallel_sampling``), all counted against the queue bound by ``reservation`` (the group releases what it
    did not use when it closes). The first completions of all prompts are added together, in one command batch
    of the engine thread; the others once their prompt's first has its first output, so they take the prompt's KV
    blocks from the prefix cache. Outputs of all of them arrive on one queue, tagged ``(prompt, completion)``."""

    def __init__(self, aengine: AsyncLLMEngine, request_id: str, token_ids: list[list[int]],
                 params: list[SamplingParams], reservation: Reservation) -> None:
        self.aengine = aengine
        self.reservation = reservation
        self.request_id = request_id
        self.token_ids = token_ids
        self.params = params
        several = len(token_ids) > 1
        self.ids = [child_ids(f"{request_id}-{i}" if several else request_id, p) for i, p in enumerate(params)]
        self.children = [child_params(p) for p in params]
        self.done: dict[tuple[int, int], RequestOutput] = {}
        self._streams: list[RequestStream] = []
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue = asyncio.Queue()
        self._expected = sum(p.num_completions for p in params)

    async def start(self) -> None:
        """Add the first completion of every prompt, all submitted before any is awaited (so a request of many
        prompts is in the engine after one step, not one prompt per step); raises the first error
        ``AsyncLLMEngine.add_request`` raised (the caller then closes the group, aborting those that started)."""
        results = await asyncio.gather(*(self._add(i, 0) for i in range(len(self.params))), return_exceptions=True)
        for i, result in enumerate(results):
            if isinstance(result, ValueError) and len(self.params) > 1:
                raise ValueError(f"prompt[{i}]: {result}") from result
            if isinstance(result, BaseException):
                raise result

    async def _add(self, i: int, k: int) -> None:
        stream = await self.aengine.add_request(self.token_ids[i], self.children[i][k], self.ids[i][k],
                                                reservation=self.reservation)
        self._streams.append(stream)
        self._tasks.append(asyncio.ensure_future(self._pump(i, k, stream)))

    async def _pump(self, i: int, k: int, stream: RequestStream) -> None:
        try:
            first = True
            async for out in stream:
                self._queue.put_nowait((i, k, out))
                if first and k == 0:
                    first = False
                    for sibling in range(1, self.params[i].num_completions):  # the prompt's KV is cached now
                        await self._add(i, sibling)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a dead engine, a full queue for a sibling: the consumer raises it
            self._queue.put_nowait(e)

    async def next(self) -> tuple[int, int, RequestOutput] | None:
        """The next step output of any completion, or ``None`` once all have finished; raises an error a
        completion's stream raised."""
        if len(self.done) == self._expected:
            return None
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        i, k, out = item
        if out.finished:
            self.done[(i, k)] = out
        return item

    async def finals(self) -> dict[tuple[int, int], RequestOutput]:
        """Every completion's final output, by ``(prompt, completion)``."""
        while await self.next() is not None:
            pass
        return self.done

    async def aclose(self) -> None:
        """Abort every completion not finished yet, and give back the queue places of those never added."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        for stream in self._streams:
            await stream.aclose()
        self.reservation.release()

    def usage(self, finals: dict[tuple[int, int], RequestOutput]) -> dict[str, Any]:
        """OpenAI's usage: each prompt counted once, every generated completion's tokens (``best_of`` ones
        included); ``cached_tokens`` are those the prompts' first completions took from the prefix cache."""
        prompt = sum(len(ids) for ids in self.token_ids)
        completion = sum(o.num_output_tokens for o in finals.values())
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        firsts = [finals[(i, 0)] for i in range(len(self.params)) if (i, 0) in finals]
        cached = [getattr(o.metrics, "num_cached_tokens", None) for o in firsts]
        if cached and all(c is not None for c in cached):
            usage["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
        return usage


class _Format:
    """Turns step outputs into OpenAI completion / chat completion objects and chunks. echoes: per prompt, its
    text to put before each of its completions (``echo``)."""

    def __init__(self, server: _Server, request_id: str, object_name: str, *, chat: bool, top_logprobs: int | None,
                 echoes: list[str] | None = None) -> None:
        self.server = server
        self.request_id = request_id
        self.object_name = object_name
        self.chat = chat
        self.top_logprobs = top_logprobs
        self.echoes = echoes
        self.created = int(time.time())
        self._text_offset: dict[int, int] = {}
        self._echoed: set[int] = set()

    def envelope(self, kind: str) -> dict[str, Any]:
        name = self.object_name + (".chunk" if kind == "chunk" and self.chat else "")
        return {"id": self.request_id, "object": name, "created": self.created, "model": self.server.model_name}

    def chunk(self, index: int, out: RequestOutput | None, delta: dict[str, Any] | None,
              usage: dict[str, Any] | None, body: SamplingRequest, prompt: int = 0) -> dict[str, Any]:
        text = "" if out is None else out.new_text
        if self.echoes is not None and index not in self._echoed:
            self._echoed.add(index)
            text = self.echoes[prompt] + text
        logprobs = None if out is None else self._logprobs(index, out.new_token_ids, out.new_logprobs)
        finish = None if out is None else out.finish_reason
        if self.chat:
            choice = {"index": index, "delta": delta if delta is not None else ({"content": text} if text else {}),
                      "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        chunk = {**self.envelope("chunk"), "choices": [choice]}
        if body.include_usage or body.continuous_usage:
            chunk["usage"] = usage
        return chunk

    def whole_choice(self, index: int, final: RequestOutput, prompt: int) -> dict[str, Any]:
        logprobs = self._logprobs(index, final.token_ids or [], final.logprobs)
        text = final.text or ""
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": final.finish_reason}
        if self.echoes is not None:
            text = self.echoes[prompt] + text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": final.finish_reason}

    def _logprobs(self, index: int, token_ids: list[int], logprobs: list[Any] | None) -> dict[str, Any] | None:
        if self.top_logprobs is None or logprobs is None:
            return None
        name = self._token_text
        if self.chat:
            content = []
            for tid, (lp, top) in zip(token_ids, logprobs):
                s = name(tid)
                content.append({"token": s, "logprob": _finite(lp), "bytes": list(s.encode()),
                                "top_logprobs": [{"token": name(t), "logprob": _finite(v),
                                                  "bytes": list(name(t).encode())} for t, v in top.items()]})
            return {"content": content}
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = self._text_offset.get(index, 0)
        for tid, (lp, top) in zip(token_ids, logprobs):
            s = name(tid)
            tokens.append(s)
            token_logprobs.append(_finite(lp))
            tops.append({name(t): _finite(v) for t, v in top.items()})
            offsets.append(offset)
            offset += len(s)
        self._text_offset[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _token_text(self, token_id: int) -> str:
        tok = self.server.tokenizer
        return f"token_id:{token_id}" if tok is None else tok.decode([token_id])


def _usage(out: RequestOutput) -> dict[str, Any]:
    prompt = len(out.prompt_token_ids)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": out.num_output_tokens,
                             "total_tokens": prompt + out.num_output_tokens}
    # prefix caching reports how many prompt tokens it did not recompute here
    cached = getattr(out.metrics, "num_cached_tokens", None)
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _finite(logprob: float) -> float:
    """``logprob`` as JSON can carry it: ``MIN_LOGPROB`` for -inf (or NaN, which no valid request produces)."""
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def _event(payload: dict[str, Any]) -> str:
    # allow_nan=False: a non-finite number becomes an error event (valid JSON), never a bare NaN on the wire
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"
