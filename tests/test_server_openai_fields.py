"""The fields real OpenAI clients send, through the official ``openai`` client against ``sarathi-lite serve`` as
a subprocess: ``n``, ``best_of``, presence/frequency/repetition penalties, ``logit_bias``, several prompts per
completions request, ``echo``, streamed and not, with OpenAI's ``usage``; each matched against a reference
computed here (``LLM.generate``, whose penalized tokens equal a hand-computed logit adjustment of Hugging Face's
logits). Also the completions default of 16 tokens, and no traceback in the server's log when clients leave."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from sarathi_lite import LLM, SamplingParams
from tests.conftest import TINY, HFReference, make_tiny_checkpoint
from tests.live_server import MODEL, free_port, stop_process, wait_healthy
from tests.test_sampling_penalties import adjusted
from tests.tiny_tokenizer import save_tiny_tokenizer

ENGINE = dict(chunk_size=32, block_size=4, num_kv_blocks=512, max_num_seqs=32, device="cpu")
VOCAB = TINY["vocab_size"]
PROMPT = [5, 6, 7, 5, 6, 7, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("fields") / "llama")
    return save_tiny_tokenizer(path, VOCAB)


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    """``(url, path of the server's log)``."""
    log = tmp_path_factory.mktemp("log") / "server.log"
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    cmd = [sys.executable, "-m", "sarathi_lite", "serve", str(checkpoint), "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", MODEL, "--threads", "1", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=120)
        yield url, log
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(checkpoint, **ENGINE)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def sampled(**fields) -> SamplingParams:
    return SamplingParams(ignore_eos=True, **fields)


def test_n_3_returns_three_indexed_choices_equal_to_generate_and_usage_counts_the_prompt_once(served, llm):
    url, _ = served
    res = client(url).completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0, seed=4,
                                         extra_body={"ignore_eos": True})
    ref = llm.generate(PROMPT, sampled(n=3, max_tokens=6, temperature=1.0, seed=4), use_tqdm=False)[0].outputs
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert [c.text for c in res.choices] == [r.text for r in ref] and len({c.text for c in res.choices}) == 3
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(PROMPT), 18)
    chat = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                               max_tokens=4, temperature=1.0, seed=9,
                                               extra_body={"ignore_eos": True})
    chat_ref = llm.chat([{"role": "user", "content": "hi"}], sampled(n=3, max_tokens=4, temperature=1.0, seed=9),
                        use_tqdm=False)[0].outputs
    assert [c.message.content for c in chat.choices] == [r.text for r in chat_ref]
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 12


def test_penalties_match_a_hand_computed_adjustment_of_the_models_logits(served, llm, checkpoint):
    url, _ = served
    fields = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4)
    res = client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                         presence_penalty=0.8, frequency_penalty=0.6,
                                         extra_body={"ignore_eos": True, "repetition_penalty": 1.4})
    ref = llm.generate(PROMPT, sampled(max_tokens=10, temperature=0.0, **fields), use_tqdm=False)[0]
    assert res.choices[0].text == ref.text
    hf = HFReference(checkpoint)
    params = sampled(max_tokens=10, temperature=0.0, **fields)
    expected: list[int] = []
    for _ in range(10):
        adj = adjusted(hf.logits(PROMPT + expected)[-1].tolist(), PROMPT, expected, params)
        expected.append(max(range(VOCAB), key=adj.__getitem__))
    assert ref.token_ids == expected
    plain = llm.generate(PROMPT, sampled(max_tokens=10, temperature=0.0), use_tqdm=False)[0]
    assert plain.text != res.choices[0].text


def test_logit_bias_steers_greedy_decoding(served, llm):
    url, _ = served
    c = client(url)
    forced = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={"65": 100},
                                  logprobs=0, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == llm.tokenizer.decode([65]) * 5
    mild = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                logit_bias={"57": -100, "191": 2.5}, extra_body={"ignore_eos": True})
    ref = llm.generate(PROMPT, sampled(max_tokens=8, temperature=0.0, logit_bias={57: -100.0, 191: 2.5}),
                       use_tqdm=False)[0]
    assert mild.choices[0].text == ref.text and 57 not in ref.token_ids
    # OpenAI's neutral defaults, as LangChain-style clients send them on every call, change nothing
    neutral = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, presence_penalty=0,
                                   frequency_penalty=0, logit_bias={}, n=1, extra_body={"ignore_eos": True})
    assert neutral.choices[0].text == llm.generate(PROMPT, sampled(max_tokens=8, temperature=0.0),
                                                   use_tqdm=False)[0].text


def test_several_prompts_get_one_choice_each_in_openais_order_streamed_and_not(served, llm):
    url, _ = served
    prompts = ["The quick brown fox", "emoji 🙂 and more", "A long prompt"]
    refs = llm.generate(prompts, sampled(n=2, max_tokens=5, temperature=0.9, seed=1), use_tqdm=False)
    c = client(url)
    whole = c.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0.9, seed=1,
                                 extra_body={"ignore_eos": True})
    expected = [o.text for r in refs for o in r.outputs]  # index = prompt * n + completion
    assert [ch.index for ch in whole.choices] == list(range(6))
    assert [ch.text for ch in whole.choices] == expected
    tok = llm.tokenizer
    assert whole.usage.prompt_tokens == sum(len(tok(p).input_ids) for p in prompts)
    assert whole.usage.completion_tokens == 30
    chunks = list(c.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0.9, seed=1,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    texts = [""] * 6
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts == expected and chunks[-1].usage.completion_tokens == 30
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason) == \
        list(range(6))


def test_echo_puts_the_prompt_before_the_completion(served, llm):
    url, _ = served
    c = client(url)
    ref = llm.generate(["The quick brown fox", PROMPT], sampled(max_tokens=4, temperature=0.0), use_tqdm=False)
    res = c.completions.create(model=MODEL, prompt="The quick brown fox", echo=True, max_tokens=4, temperature=0,
                               extra_body={"ignore_eos": True})
    assert res.choices[0].text == "The quick brown fox" + ref[0].text
    ids = c.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=4, temperature=0,
                               extra_body={"ignore_eos": True})
    assert ids.choices[0].text == llm.tokenizer.decode(PROMPT) + ref[1].text
    streamed = c.completions.create(model=MODEL, prompt="The quick brown fox", echo=True, max_tokens=4,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in streamed) == res.choices[0].text


def test_best_of_returns_the_likeliest_and_usage_counts_every_generated_token(served, llm):
    url, _ = served
    res = client(url).completions.create(model=MODEL, prompt=PROMPT, n=1, best_of=3, max_tokens=6,
                                         temperature=1.0, seed=21, extra_body={"ignore_eos": True})
    ref = llm.generate(PROMPT, sampled(n=1, best_of=3, max_tokens=6, temperature=1.0, seed=21), use_tqdm=False)[0]
    assert [c.text for c in res.choices] == [ref.text] and res.choices[0].index == 0
    assert res.choices[0].logprobs is None and res.usage.completion_tokens == 18


def test_completions_without_max_tokens_get_16_and_the_flag_sets_it(served):
    url, _ = served
    for extra in ({}, {"max_tokens": None}):
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": [5, 6], "ignore_eos": True, **extra})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    from sarathi_lite.cli import build_parser

    args = build_parser().parse_args(["serve", "--completions-default-max-tokens", "5"])
    assert args.completions_default_max_tokens == 5


def test_a_wrong_or_missing_content_type_is_named(served):
    url, _ = served
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2})
    r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "text/plain"}, timeout=30)
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    assert "'text/plain'" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", content=b"prompt=x", timeout=30)
    assert r.status_code == 400 and "no Content-Type" in r.json()["error"]["message"]


def test_the_smallest_top_p_returns_the_greedy_completion(served):
    url, _ = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "logprobs": 0}
    greedy = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0}, timeout=30).json()["choices"][0]
    assert len(greedy["logprobs"]["tokens"]) == 6
    for top_p in (1e-300, 5e-324):  # 0 in float32: every token was masked, and token 0 came out
        r = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0.5, "top_p": top_p}, timeout=30)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == greedy["text"] and choice["logprobs"]["tokens"] == greedy["logprobs"]["tokens"]


def strict_json(text: str):
    """``text`` parsed as JSON proper: NaN and Infinity (which Python's json writes and reads) refused."""
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_constraints_that_leave_no_token_are_a_400_and_logprobs_on_the_wire_stay_finite(served, llm):
    url, log = served
    before = log.read_text()
    every = list(range(VOCAB))
    body = {"model": MODEL, "prompt": PROMPT, "stop_token_ids": every, "min_tokens": 2, "max_tokens": 3,
            "temperature": 1, "logprobs": 3}
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        assert "no token could be sampled" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="min_tokens=2 bans the stop tokens"):
        llm.generate([PROMPT], SamplingParams(stop_token_ids=every, min_tokens=2, max_tokens=3), use_tqdm=False)

    # two tokens left until min_tokens: the banned ones among the top 5 are -9999.0, never -Infinity or NaN
    body["stop_token_ids"] = every[:40] + every[42:]
    body["logprobs"] = 5
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    choice = strict_json(r.text)["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == 3
    first = choice["logprobs"]["top_logprobs"][0]
    assert -9999.0 in first.values() and all(v > -9999.0 for v in choice["logprobs"]["token_logprobs"][:2])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop_token_ids": body["stop_token_ids"],
            "min_tokens": 2, "max_tokens": 3, "logprobs": True, "top_logprobs": 5}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 200, r.text
    top = strict_json(r.text)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert -9999.0 in [t["logprob"] for t in top]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [strict_json(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), events
    assert -9999.0 in chunks[0]["choices"][0]["logprobs"]["top_logprobs"][0].values()
    assert "Traceback" not in log.read_text()[len(before):]


def test_clients_leaving_leave_no_traceback_in_the_log(served):
    url, log = served
    before = log.read_text()
    for _ in range(2):  # a non-streamed request whose client gives up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", timeout=0.5,
                       json={"model": MODEL, "prompt": [5] * 10, "max_tokens": 1000, "ignore_eos": True, "n": 2})

    async def leave_mid_stream() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1000, "ignore_eos": True, "stream": True}
            async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        return

    asyncio.run(leave_mid_stream())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # every aborted request's blocks are back
        text = httpx.get(f"{url}/metrics").text
        used = next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("sarathi_lite_kv_blocks_used "))
        running = next(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("sarathi_lite_num_requests_running "))
        if used == 0 and running == 0:
            break
        time.sleep(0.2)
    assert used == 0 and running == 0
    time.sleep(1.0)  # what the server logs after the abort
    new = log.read_text()[len(before):]
    assert "Traceback" not in new and "CancelledError" not in new, new[-3000:]
