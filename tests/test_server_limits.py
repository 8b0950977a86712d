"""The server's limits and its failure isolation, on loopback: API key, body size cap, header and body read
timeouts, per-request timeout, chat's default max_tokens, lone surrogates, tokenization off the event loop, a
failed step that fails only its own requests, a dead worker that /health reports, and 300 requests at once
against a queue bound of 64."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from sarathi_lite import LLM, SamplingParams
from sarathi_lite.engine.errors import EngineDeadError
from sarathi_lite.server import ServerConfig
from tests.conftest import TINY, make_tiny_checkpoint
from tests.live_server import MODEL, assert_openai_error, serve_in_thread
from tests.tiny_tokenizer import save_tiny_tokenizer

ENGINE = dict(chunk_size=64, block_size=4, num_kv_blocks=1024, max_num_seqs=32, device="cpu")
KEY = "sekret-key"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("limits") / "llama")
    return save_tiny_tokenizer(path, TINY["vocab_size"])


@pytest.fixture(scope="module")
def limited(checkpoint):
    """A server with a key, a 64 KiB body cap, 1 s read timeouts and a chat default of 7 tokens."""
    config = ServerConfig(api_key=KEY, max_body_bytes=1 << 16, header_timeout=1.0, body_timeout=1.0,
                          chat_default_max_tokens=7)
    with serve_in_thread(checkpoint, config, **ENGINE) as url:
        yield url


AUTH = {"Authorization": f"Bearer {KEY}"}


def post(url: str, route: str, body, headers=None, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, headers={**AUTH, **(headers or {})}, timeout=30, **kwargs)


def test_the_api_key_guards_the_api_while_health_and_metrics_stay_open(limited, checkpoint):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        r = httpx.post(f"{limited}/v1/completions", json=body, headers=headers, timeout=30)
        assert_openai_error(r, 401, code="invalid_api_key")
        assert_openai_error(httpx.get(f"{limited}/v1/models", headers=headers), 401, code="invalid_api_key")
    assert post(limited, "completions", body).status_code == 200
    assert httpx.get(f"{limited}/health").status_code == 200
    assert httpx.get(f"{limited}/metrics").status_code == 200
    c = openai.OpenAI(base_url=f"{limited}/v1", api_key=KEY, max_retries=0)
    assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{limited}/v1", api_key="nope", max_retries=0).models.list()

    closed = ServerConfig(api_key=KEY, auth_health_and_metrics=True)
    with serve_in_thread(checkpoint, closed, **ENGINE) as url:
        assert_openai_error(httpx.get(f"{url}/health"), 401, code="invalid_api_key")
        assert_openai_error(httpx.get(f"{url}/metrics"), 401, code="invalid_api_key")
        assert httpx.get(f"{url}/health", headers=AUTH).status_code == 200
        assert httpx.get(f"{url}/metrics", headers=AUTH).status_code == 200


def test_two_authorization_headers_are_a_400_whichever_comes_last(limited):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for pair in ([AUTH["Authorization"], "Bearer wrong"], ["Bearer wrong", AUTH["Authorization"]],
                 [AUTH["Authorization"]] * 2):
        headers = [("authorization", value) for value in pair]
        r = httpx.post(f"{limited}/v1/completions", json=body, headers=headers, timeout=30)
        assert "2 Authorization headers" in assert_openai_error(r, 400, code="invalid_api_key")["message"]
    assert post(limited, "completions", body).status_code == 200


def test_head_health_answers_like_get_without_a_body(limited):
    head = httpx.head(f"{limited}/health", timeout=30)
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(f"{limited}/health", timeout=30).json() == {"status": "ok"}


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, gzip"])
def test_a_compressed_body_is_415_saying_content_encoding_is_unsupported(limited, encoding):
    body = gzip.compress(json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode())
    r = httpx.post(f"{limited}/v1/completions", content=body, timeout=30,
                   headers={**AUTH, "content-type": "application/json", "content-encoding": encoding})
    err = assert_openai_error(r, 415, param=None, code="unsupported_content_encoding")
    assert f"Content-Encoding '{encoding}' is not supported" in err["message"]
    plain = {**AUTH, "content-encoding": "identity"}
    assert post(limited, "completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, plain).status_code == 200


def test_a_body_over_the_cap_is_413_by_header_or_as_it_streams_in(limited):
    big = {"model": MODEL, "prompt": "x" * (1 << 17), "max_tokens": 2}
    assert_openai_error(post(limited, "completions", big), 413, code="request_too_large")

    def chunks():  # no content-length: the cap is counted as the body arrives
        for _ in range(40):
            yield b" " * 4096

    r = httpx.post(f"{limited}/v1/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"},
                   timeout=30)
    assert_openai_error(r, 413, code="request_too_large")
    assert post(limited, "completions", {"model": MODEL, "prompt": "x" * 1000, "max_tokens": 2}).status_code == 200


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while True:
        chunk = sock.recv(65536)  # socket.timeout (a test failure) if the server never closes
        if not chunk:
            return data
        data += chunk


def test_a_client_stalling_mid_body_is_cut_at_the_body_timeout(limited):
    with _raw(limited) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ")
        reply = _read_until_closed(sock)
        elapsed = time.monotonic() - t0
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"code":"request_timeout"' in reply.replace(b" ", b"")
    assert elapsed < 8, f"the stalled body held its connection for {elapsed:.1f} s (body_timeout 1 s)"
    assert httpx.get(f"{limited}/health").status_code == 200


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"])
def test_a_client_stalling_mid_headers_is_disconnected_at_the_header_timeout(limited, sent):
    with _raw(limited) as sock:
        t0 = time.monotonic()
        sock.sendall(sent)
        reply = _read_until_closed(sock)
        elapsed = time.monotonic() - t0
    assert reply == b"" and elapsed < 8, (reply, elapsed)


def test_a_connection_stalling_before_its_second_request_headers_is_closed_too(limited):
    with _raw(limited) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert _read_until_closed(sock) == b""


SURROGATES = [  # raw JSON text: "\ud800" escapes decode to lone surrogates
    ("completions", '{"model": "tiny-llama", "prompt": "a\\ud800b"}', "prompt"),
    ("completions", '{"model": "tiny-llama", "prompt": ["a\\udfffb"]}', "prompt.0"),
    ("completions", '{"model": "tiny-llama", "prompt": "ok", "stop": ["\\ud800"]}', "stop.0"),
    ("completions", '{"model": "tiny-\\ud800", "prompt": "ok"}', "model"),
    ("completions", '{"model": "tiny-llama", "prompt": "ok", "logit_bias": {"1\\ud800x": 1}}',
     "logit_bias.1\\ud800x.[key]"),  # the key escaped as the client wrote it, not garbled
    ("chat/completions", '{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi \\ud83d"}]}',
     "messages.0.content"),
    ("chat/completions", '{"model": "tiny-llama", "messages": [{"role": "user", "content": [{"type": "text", '
                         '"text": "\\udc00"}]}]}', "messages.0.content.0.text"),
]


@pytest.mark.parametrize("route, raw, param", SURROGATES)
def test_lone_surrogates_are_400_naming_the_field(limited, route, raw, param):
    r = httpx.post(f"{limited}/v1/{route}", content=raw, timeout=30,
                   headers={**AUTH, "content-type": "application/json"})
    err = assert_openai_error(r, 400, param=param)
    assert "surrogate" in err["message"]


@pytest.mark.parametrize("fields, param", [({"seed": 2**64}, "seed"), ({"top_k": 2**63}, "top_k"),
                                           ({"min_tokens": 1, "stop_token_ids": [10**9]}, "stop_token_ids"),
                                           ({"temperature": 1e-40}, "temperature")])
def test_requests_that_used_to_kill_the_engine_are_400s(limited, fields, param):
    assert_openai_error(post(limited, "completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, **fields}),
                        400, param=param)
    assert httpx.get(f"{limited}/health").status_code == 200


def test_chat_without_max_tokens_gets_the_configured_default(limited):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "ignore_eos": True}
    r = post(limited, "chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
    r = post(limited, "chat/completions", {**body, "max_tokens": 9})
    assert r.json()["usage"]["completion_tokens"] == 9


def test_tokenization_and_chat_templating_run_off_the_event_loop(checkpoint):
    seen: list[str] = []

    class Recording:
        """The engine's tokenizer, noting the thread of every call the server makes."""

        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def __call__(self, *args, **kwargs):
            seen.append(threading.current_thread().name)
            return self._tok(*args, **kwargs)

        def apply_chat_template(self, *args, **kwargs):
            seen.append(threading.current_thread().name)
            return self._tok.apply_chat_template(*args, **kwargs)

    def patch(engine):
        engine.tokenizer = Recording(engine.tokenizer)

    with serve_in_thread(checkpoint, patch=patch, **ENGINE) as url:
        assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi " * 200, "max_tokens": 2},
                          timeout=30).status_code == 200
        assert httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    assert len(seen) >= 3 and all(name.startswith("sarathi-lite-tokenize") for name in seen), seen


def _slow(engine, delay: float = 0.05) -> None:
    execute = engine.runner.execute

    def run(*args, **kwargs):
        time.sleep(delay)
        return execute(*args, **kwargs)

    engine.runner.execute = run


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_request_over_the_request_timeout_is_aborted_and_frees_its_blocks(checkpoint):
    config = ServerConfig(request_timeout=1.0)
    body = {"model": MODEL, "prompt": [5] * 10, "max_tokens": 1000, "ignore_eos": True}
    with serve_in_thread(checkpoint, config, patch=_slow, **ENGINE) as url:
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert_openai_error(r, 504, code="timeout")
        assert time.monotonic() - t0 < 10
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"
        assert len(events) > 3  # tokens streamed before the deadline
        deadline = time.monotonic() + 10
        while _metric(url, "sarathi_lite_kv_blocks_used") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(url, "sarathi_lite_kv_blocks_used") == 0
        assert _metric(url, 'sarathi_lite_requests_finished_total{finish_reason="abort"}') == 2
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(checkpoint):
    calls = []

    def patch(engine):
        execute = engine.runner.execute

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) in (4, 30):
                raise RuntimeError("a bug in step")
            return execute(*args, **kwargs)

        engine.runner.execute = failing

    with serve_in_thread(checkpoint, patch=patch, **ENGINE) as url:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "a bug in step" in error["message"] and error["type"] == "server_error"
        assert httpx.get(f"{url}/health").status_code == 200
        ok = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 20
        failed = httpx.post(f"{url}/v1/completions", json=body, timeout=30)  # the 30th step fails
        assert "a bug in step" in assert_openai_error(failed, 500)["message"]
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        assert _metric(url, "sarathi_lite_kv_blocks_used") == 0


class _DeadWorkers:
    failed = None

    def __init__(self, executor) -> None:
        self.executor = executor  # the engine's own, for everything but running a step

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def execute(self, *args, **kwargs):
        self.failed = "tensor-parallel worker rank 1 (pid 4242) was killed by signal 9"
        raise RuntimeError("Connection closed by peer")

    def check_health(self) -> None:
        if self.failed:
            raise EngineDeadError(self.failed)


def test_a_dead_worker_stops_the_engine_and_health_says_why(checkpoint):
    def patch(engine):
        engine.executor = _DeadWorkers(engine.executor)

    with serve_in_thread(checkpoint, patch=patch, **ENGINE) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}, timeout=30)
        assert_openai_error(r, 503, code="engine_dead")
        health = assert_openai_error(httpx.get(f"{url}/health"), 503, code="engine_dead")
        assert "rank 1 was killed by signal 9" in health["message"] and "4242" not in health["message"]
        head = httpx.head(f"{url}/health")
        assert head.status_code == 503 and head.content == b""
        later = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}, timeout=30)
        assert_openai_error(later, 503, code="engine_dead")


def test_300_requests_at_once_against_a_queue_bound_of_64(checkpoint):
    n, max_tokens = 300, 12
    prompts = [[5 + i % 50, 6, 7 + i % 13] for i in range(n)]
    reference = LLM(checkpoint, **ENGINE).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    config = ServerConfig(max_waiting_requests=64, retry_after=2)

    async def burst(url: str):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*[
                http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": max_tokens,
                                                         "temperature": 0, "ignore_eos": True})
                for p in prompts])

    with serve_in_thread(checkpoint, config, patch=_slow, **{**ENGINE, "max_num_seqs": 8}) as url:
        responses = asyncio.run(asyncio.wait_for(burst(url), 240))
        assert httpx.get(f"{url}/health").status_code == 200
        assert _metric(url, "sarathi_lite_kv_blocks_used") == 0 and _metric(url, "sarathi_lite_num_streams") == 0
    ok = [i for i, r in enumerate(responses) if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(rejected) == n
    assert len(ok) >= 64 and len(rejected) >= 100, (len(ok), len(rejected))
    for r in rejected:
        assert_openai_error(r, 503, code="queue_full")
        assert r.headers["retry-after"] == "2"
    for i in ok:
        assert responses[i].json()["choices"][0]["text"] == reference[i].text


def _until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(0.05)


def test_every_prompt_and_completion_counts_against_the_queue_bound_and_a_client_leaving_aborts_them_all(
        checkpoint):
    added: list[float] = []

    def patch(engine) -> None:
        _slow(engine)  # 50 ms steps: adding 40 prompts one per step would take 2 s
        add = engine.add_request

        def recorded(*args, **kwargs) -> None:
            add(*args, **kwargs)
            added.append(time.monotonic())

        engine.add_request = recorded

    config = ServerConfig(max_waiting_requests=64, max_prompts_per_request=48)
    many = {"model": MODEL, "prompt": [[5, 6, 7 + i] for i in range(40)], "max_tokens": 1000, "ignore_eos": True}
    aborted = 'sarathi_lite_requests_finished_total{finish_reason="abort"}'
    with serve_in_thread(checkpoint, config, patch=patch, **{**ENGINE, "max_num_seqs": 8}) as url:
        completions = f"{url}/v1/completions"
        err = assert_openai_error(httpx.post(completions, json={**many, "prompt": [[5]] * 49}), 400, param="prompt")
        assert "49 prompts; this server takes at most 48 in one request (max_prompts_per_request)" in err["message"]
        err = assert_openai_error(httpx.post(completions, json={**many, "n": 2}), 400, param="prompt")
        assert "40 prompts x 2 completions = 80 requests, more than the 64" in err["message"]
        assert_openai_error(httpx.post(completions, json={**many, "prompt": [5], "best_of": 65}), 400, param="n")
        assert not added  # refused before any work

        left: list[float] = []

        def leave() -> None:  # sends 40 prompts and leaves after 1 s
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(completions, json=many, timeout=1.0)
            left.append(time.monotonic())

        client = threading.Thread(target=leave)
        client.start()
        _until(lambda: len(added) == 40 or bool(left))
        # 40 of the 64 places are taken (8 running, 32 waiting): 40 more prompts do not fit
        r = httpx.post(completions, json=many, timeout=30)
        assert_openai_error(r, 503, code="queue_full")
        assert r.headers["retry-after"] == "1"
        client.join(30)
        assert len(added) == 40 and max(added) < left[0]  # all in the engine before the client left
        _until(lambda: _metric(url, aborted) == 40)
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_blocks_used"):
            assert _metric(url, f"sarathi_lite_{gauge}") == 0, gauge
        r = httpx.post(completions, json={**many, "prompt": [[5, 6]] * 3, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        assert len(added) == 43


def test_server_metrics_count_every_iteration_a_step_ran():
    # instances as processes return from a step when one of them ends one, with the iterations of all of them
    # since the last step: each counts once; a stats reset starts the count over
    from types import SimpleNamespace

    from sarathi_lite.engine.instances import RecentIterations
    from sarathi_lite.metrics import IterationRecord
    from sarathi_lite.server.metrics import ServerMetrics

    def record(i: int, prefill: int, decode: int) -> IterationRecord:
        return IterationRecord(i, 0.0, 0.1, 0.0, prefill, decode, 1 if prefill else 0, decode, 0)

    metrics, rec = ServerMetrics(), RecentIterations(window=4)
    engine = SimpleNamespace(metrics=rec)

    def counted(name: str) -> float:
        return metrics.registry.get_sample_value(f"sarathi_lite_{name}_total")

    rec.add([record(0, 16, 0), record(1, 0, 3), record(2, 8, 2)])
    metrics.on_step(engine, [])
    assert counted("iterations") == 3 and counted("prefill_tokens") == 24 and counted("decode_tokens") == 5
    metrics.on_step(engine, [])  # nothing new
    assert counted("iterations") == 3
    rec.add([record(3, 0, 1)] * 6)  # more than the window keeps: only the 4 kept are known
    metrics.on_step(engine, [])
    assert counted("iterations") == 7 and counted("decode_tokens") == 9
    rec.iterations.clear()
    rec.num_iterations = 0  # reset_stats
    rec.add([record(0, 4, 0)])
    metrics.on_step(engine, [])
    assert counted("iterations") == 8 and counted("prefill_tokens") == 28
