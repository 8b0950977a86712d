"""The OpenAI-compatible server as a real subprocess on a free loopback port, driven by the official ``openai``
client and raw HTTP: completions and chat, streamed and not, usage, stop strings, seeds, multi-byte text, every
listed bad request, greedy parity with ``LLM.generate``, and 64 concurrent streams of which a third disconnect."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from sarathi_lite import LLM, LLMEngine, SamplingParams
from tests.conftest import TINY, make_tiny_checkpoint
from tests.live_server import free_port, stop_process
from tests.tiny_tokenizer import save_tiny_tokenizer

MODEL = "tiny-llama"
ENGINE = dict(chunk_size=64, block_size=4, num_kv_blocks=2048, max_num_seqs=128, device="cpu")
PROMPTS = ["héllo wörld, 世界 你好", "The quick brown fox", "emoji 🙂 and more", "A long prompt can stall"]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy in {timeout} s")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("serve") / "llama")
    return save_tiny_tokenizer(path, TINY["vocab_size"])


@pytest.fixture(scope="module")
def server(checkpoint):
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    cmd = [sys.executable, "-m", "sarathi_lite", "serve", str(checkpoint), "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", MODEL, "--threads", "1", *flags]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(checkpoint, **ENGINE)


def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def aclient(server: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def scrape(server: str) -> dict[str, float]:
    """``/metrics`` as ``{name{labels}: value}`` (samples only)."""
    text = httpx.get(f"{server}/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([^#\s][^\s]*) (\S+)$", text, re.M)}


def test_models_completions_and_chat_sync_and_async_streamed_and_not(server, llm):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    tok = llm.tokenizer
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    whole = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert whole.choices[0].text == ref.text and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == \
        (len(tok(PROMPTS[0]).input_ids), 12, len(tok(PROMPTS[0]).input_ids) + 12)
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text  # multi-byte prompt and output
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[2]}]
    chat_ref = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0]

    async def chat():
        ac = aclient(server)
        whole = await ac.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 extra_body={"ignore_eos": True})
        stream = await ac.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        deltas = [ch.choices[0].delta async for ch in stream]
        await ac.close()
        return whole, deltas

    whole, deltas = asyncio.run(chat())
    assert whole.choices[0].message.content == chat_ref.text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(chat_ref.prompt_token_ids) and whole.usage.completion_tokens == 10
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == chat_ref.text


def test_stop_strings_seeds_and_logprobs(server, llm):
    c = client(server)
    free = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 3]
    for stream in (False, True):
        res = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=[stop],
                                   stream=stream, extra_body={"ignore_eos": True})
        chunks = list(res) if stream else [res]
        text = "".join(ch.choices[0].text for ch in chunks)
        assert text == free[:free.index(stop)] and stop not in text
        assert chunks[-1].choices[0].finish_reason == "stop"

    def sample(seed: int) -> str:
        return c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=1.0, seed=seed,
                                    extra_body={"ignore_eos": True}).choices[0].text

    assert sample(7) == sample(7) != sample(8)
    lp = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4, temperature=0, logprobs=2,
                              extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs) and lp.text_offset[0] == 0


BAD_REQUESTS = [  # (route, body or raw text, status, param)
    ("completions", '{"model": "tiny-llama", "prompt": ', 400, None),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": 5}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 200}, 400, "n"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("completions", {"model": MODEL, "prompt": "x", "best_of": 3, "stream": True}, 400, "best_of"),
    ("completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {"model": MODEL, "prompt": "x", "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ("completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"320": 1}}, 400, "logit_bias"),
    ("completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("completions", {"model": MODEL, "prompt": ["ok", [1, 2, 10**6]]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": ["ok", ""]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": ["ok", [5] * 1100]}, 400, "prompt"),
    # strict types: a bool is not an integer, a string is not a number (these used to pass, converted)
    ("completions", {"model": MODEL, "prompt": [True], "max_tokens": 2}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": "0.5"}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "x", "seed": 1.0}, 400, "seed"),
    ("completions", {"model": MODEL, "prompt": "x", "stream": 1}, 400, "stream"),
    ("completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 9}, 400, "min_tokens"),
    ("completions", {"model": MODEL, "prompt": [5] * 1100}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [5] * 10, "max_tokens": 1020}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": [1, 2, 10**6]}, 400, "prompt"),
    # echo decodes the prompt's ids: an id outside the vocabulary is a 400, never the tokenizer's OverflowError
    ("completions", {"model": MODEL, "prompt": [-1], "echo": True}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": ["ok", [3, 10**6]], "echo": True}, 400, "prompt"),
    ("completions", {"model": "gpt-7", "prompt": "x"}, 404, "model"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages.0.role"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "hi"}]}, 400, "messages.0.role"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "", "content": "hi"}]}, 400, "messages.0.role"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url",
                                                                                      "image_url": "x"}]}]},
     400, "messages.0.content"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5},
     400, "max_tokens"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_k": -5}, 400,
     "top_k"),
]


@pytest.mark.parametrize("route,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_their_status_and_openai_error_body(server, route, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) \
        else {"json": body}
    r = httpx.post(f"{server}/v1/{route}", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert httpx.get(f"{server}/health").status_code == 200
    ok = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_raises_its_typed_errors(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_greedy_outputs_equal_generate_and_requests_share_iterations(server, llm):
    prompts = [PROMPTS[i % 4] * (1 + i % 3) for i in range(8)]
    lengths = [8 + 3 * i for i in range(8)]
    refs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths],
                        use_tqdm=False)
    before = scrape(server)

    async def run():
        ac = aclient(server)
        outs = await asyncio.gather(*[ac.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                                            extra_body={"ignore_eos": True})
                                      for p, n in zip(prompts, lengths)])
        await ac.close()
        return outs

    outs = asyncio.run(run())
    assert [o.choices[0].text for o in outs] == [r.text for r in refs]
    after = scrape(server)
    iterations = after["sarathi_lite_iterations_total"] - before["sarathi_lite_iterations_total"]
    decodes = after["sarathi_lite_decode_tokens_total"] - before["sarathi_lite_decode_tokens_total"]
    assert decodes > iterations, "no iteration ran more than one decode: the requests were not batched"
    assert iterations < sum(lengths)


def test_64_streams_with_a_third_disconnecting_leak_nothing(server):
    n, max_tokens = 64, 24
    leavers = set(random.Random(0).sample(range(n), n // 3))
    before = scrape(server)
    health: list[int] = []

    async def stream(i: int, http: httpx.AsyncClient) -> tuple[int, str | None]:
        body = {"model": MODEL, "prompt": PROMPTS[i % 4], "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        tokens, finish = 0, None
        async with http.stream("POST", f"{server}/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event["choices"]:
                    chunks += 1
                    finish = event["choices"][0]["finish_reason"] or finish
                else:
                    tokens = event["usage"]["completion_tokens"]
                if i in leavers and chunks == 3:
                    return -1, None  # leaving the block closes the connection mid-stream
        return tokens, finish

    async def watch(stop: asyncio.Event, http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            health.append((await http.get(f"{server}/health")).status_code)
            await asyncio.sleep(0.05)

    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http, httpx.AsyncClient(timeout=30) as probe:
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(stop, probe))
            results = await asyncio.gather(*[stream(i, http) for i in range(n)])
            stop.set()
            await watcher
            return results

    results = asyncio.run(main())
    for i, (tokens, finish) in enumerate(results):
        if i not in leavers:
            assert (tokens, finish) == (max_tokens, "length"), f"stream {i}"
    assert len(health) >= 2 and set(health) == {200}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = scrape(server)
        if (m["sarathi_lite_num_requests_running"], m["sarathi_lite_num_requests_waiting"],
                m["sarathi_lite_kv_blocks_used"], m["sarathi_lite_num_streams"]) == (0, 0, 0, 0):
            break
        time.sleep(0.1)
    assert (m["sarathi_lite_num_requests_running"], m["sarathi_lite_num_requests_waiting"],
            m["sarathi_lite_kv_blocks_used"], m["sarathi_lite_num_streams"]) == (0, 0, 0, 0)

    def finished(reason: str) -> float:
        key = f'sarathi_lite_requests_finished_total{{finish_reason="{reason}"}}'
        return m.get(key, 0.0) - before.get(key, 0.0)

    assert finished("length") + finished("abort") == n
    assert finished("abort") >= 1, "no disconnect reached the engine as an abort"


def test_a_client_leaving_a_non_streamed_request_aborts_it(server):
    before = scrape(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", timeout=0.3,
                   json={"model": MODEL, "prompt": [5] * 10, "max_tokens": 1000, "ignore_eos": True})
    key = 'sarathi_lite_requests_finished_total{finish_reason="abort"}'
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = scrape(server)
        if m.get(key, 0.0) > before.get(key, 0.0) and m["sarathi_lite_kv_blocks_used"] == 0:
            break
        time.sleep(0.1)
    assert m.get(key, 0.0) - before.get(key, 0.0) == 1 and m["sarathi_lite_kv_blocks_used"] == 0
    assert m["sarathi_lite_generation_tokens_total"] - before["sarathi_lite_generation_tokens_total"] < 1000


def test_an_error_after_streaming_began_is_an_error_event_then_done(checkpoint):
    import uvicorn

    from sarathi_lite.server import build_app

    engine = LLMEngine(checkpoint, **ENGINE)
    execute, calls = engine.runner.execute, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("a bug in one step")
        return execute(*args, **kwargs)

    engine.runner.execute = failing
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, MODEL), host="127.0.0.1", port=port,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=30)
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "a bug in one step" in error["message"] and error["type"] == "server_error"
        assert all("choices" in json.loads(e) for e in events[:-2]) and len(events) >= 3
        assert httpx.get(f"{url}/health").status_code == 200  # one failed step fails its requests, not the server
    finally:
        server.should_exit = True
        thread.join(30)


def test_bench_client_replays_a_workload_over_http_into_a_bench_result(server, tmp_path):
    from sarathi_lite.bench.http_client import replay_http
    from sarathi_lite.bench.results import BenchResult, compare
    from sarathi_lite.bench.workload import Workload
    from sarathi_lite.cli import main

    workload = Workload.synthetic("uniform:8-40:4-12", num_requests=8, qps=20.0, seed=3)
    result = replay_http(workload, server, vocab_size=TINY["vocab_size"], progress=False)
    assert result.meta["num_errors"] == 0 and result.config["model"] == MODEL
    prompts = workload.prompt_token_ids(TINY["vocab_size"])
    for spec, ids, m in zip(workload.requests, prompts, result.stats.requests):
        assert m.num_prompt_tokens == len(ids) == spec.prompt_len
        assert m.num_output_tokens == spec.output_len and len(m.tbt) == spec.output_len - 1
        assert 0 < m.ttft <= m.e2e and m.finish_reason == "length"
    s = result.summary()
    assert s["num_requests"] == 8 and s["ttft_p50"] > 0 and s["tbt_p50"] > 0
    assert "openai:tiny-llama" in compare([result])
    out = tmp_path / "http"
    assert main(["bench", "--backend", "openai", "--base-url", server, "--lengths", "fixed:16:6",
                 "--num-requests", "4", "--qps", "10", "--vocab-size", "320", "--no-progress",
                 "--out", str(out)]) == 0
    saved = BenchResult.from_json(out / "openai_tiny-llama.json")
    assert [r.num_output_tokens for r in saved.stats.requests] == [6] * 4
