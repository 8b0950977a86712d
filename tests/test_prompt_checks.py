"""One check of chat messages and of a prompt's fit in the context for the Python API and the server
(``sarathi_lite.engine.prompts``): the same roles and content parts accepted and refused, context overflow an
error in both, and every error naming the index of the bad prompt or message; one tokenization of a request's
prompt for every engine."""

from __future__ import annotations

import re
from types import SimpleNamespace

import httpx
import pytest

from sarathi_lite import LLM, SamplingParams
from sarathi_lite.engine.prompts import ROLES, chat_messages, check_context, tokenize_prompt
from sarathi_lite.server import ServerConfig
from tests.conftest import TINY, make_tiny_checkpoint
from tests.live_server import MODEL, assert_openai_error, serve_in_thread
from tests.tiny_tokenizer import save_tiny_tokenizer

OPTIONS = dict(chunk_size=16, block_size=4, num_kv_blocks=64, max_model_len=40, device="cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_tokenizer(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("checks") / "llama"),
                               TINY["vocab_size"])


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(checkpoint, **OPTIONS)


@pytest.fixture(scope="module")
def server(checkpoint):
    with serve_in_thread(checkpoint, ServerConfig(), **OPTIONS) as url:
        yield url


def test_a_prompt_is_checked_text_or_token_ids_inside_the_vocabulary(tmp_path):
    def tokenizer(text):
        return SimpleNamespace(input_ids=[len(word) for word in text.split()])

    assert tokenize_prompt(tokenizer, tmp_path, 10, "a", "hi there") == ("hi there", [2, 5])
    assert tokenize_prompt(None, tmp_path, 10, "a", (3, 9)) == (None, [3, 9])
    bad = [
        (None, "hi", re.escape(f"request 'a': text prompts need a tokenizer in {tmp_path}")),
        (tokenizer, "x\ud800", r"request 'a': prompt contains a lone surrogate"),
        (None, [3, 10], r"request 'a': token id 10 is outside the vocabulary \[0, 10\)"),
        (None, [True], r"request 'a': token id True is outside the vocabulary"),
        (tokenizer, b"hi", "request 'a': prompt must be text or a list of token ids, got bytes"),
        (tokenizer, 7, "request 'a': prompt must be text or a list of token ids, got int"),
    ]
    for tok, prompt, message in bad:
        with pytest.raises(ValueError, match=message):
            tokenize_prompt(tok, tmp_path, 10, "a", prompt)


BAD_CONVERSATIONS = [  # (messages, what the Python error says, the server's param)
    ([{"role": "tool", "content": "x"}], r"messages\[0\]\.role='tool' must be one of", "messages.0.role"),
    ([{"role": "", "content": "x"}], r"messages\[0\]\.role='' must be one of", "messages.0.role"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
     r"messages\[1\]\.content\[0\] must be \{'type': 'text'", "messages.1.content"),
    ([{"role": "user", "content": "a", "tool_calls": []}], r"messages\[0\]: unknown keys \['tool_calls'\]",
     "messages.0.tool_calls"),
]


@pytest.mark.parametrize("messages, message, param", BAD_CONVERSATIONS)
def test_python_and_server_refuse_the_same_messages_naming_the_index(llm, server, messages, message, param):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False)
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": MODEL, "messages": messages}, timeout=30)
    assert_openai_error(r, 400, param=param)


def test_text_parts_are_accepted_by_both_and_give_the_string_contents_output(llm, server):
    parts = [{"role": "developer", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "e"}]},
             {"role": "user", "content": "hi", "name": "ann"}]
    flat = [{"role": "developer", "content": "be"}, {"role": "user", "content": "hi"}]
    assert chat_messages(parts) == flat and set(ROLES) == {"system", "developer", "user", "assistant"}
    ref = llm.chat(flat, GREEDY, use_tqdm=False)[0]
    assert llm.chat(parts, GREEDY, use_tqdm=False)[0].token_ids == ref.token_ids
    r = httpx.post(f"{server}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": parts, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ref.text


def test_context_overflow_is_an_error_in_both_naming_the_prompt(llm, server):
    with pytest.raises(ValueError, match=r"prompts\[1\]: 30 prompt tokens \+ max_tokens=20 exceed .* 40 tokens"):
        llm.generate([[5] * 4, [5] * 30], SamplingParams(max_tokens=20), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[2\]: the prompt has 40 tokens"):
        llm.generate([[5], [6], [7] * 40], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[1\]: the prompt is empty"):
        llm.generate(["ok", ""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[1\]: .*token id 999 is outside the vocabulary"):
        llm.generate([[5], [999]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    r = httpx.post(f"{server}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": [[5] * 4, [5] * 30], "max_tokens": 20})
    err = assert_openai_error(r, 400, param="max_tokens", code="context_length_exceeded")
    assert err["message"].startswith("prompt[1]: 30 prompt tokens + max_tokens=20 exceed")
    r = httpx.post(f"{server}/v1/completions", timeout=30, json={"model": MODEL, "prompt": [[5], [6], [7] * 40]})
    assert assert_openai_error(r, 400, param="prompt")["message"].startswith("prompt[2]: the prompt has 40 tokens")
    r = httpx.post(f"{server}/v1/completions", timeout=30, json={"model": MODEL, "prompt": [[5], [999]]})
    assert "prompt[1]" in assert_openai_error(r, 400, param="prompt")["message"]


def test_check_context_defaults_and_caps():
    assert check_context(10, None, 40) == 30
    assert check_context(10, None, 40, default=16) == 16
    assert check_context(30, None, 40, default=16) == 10
    assert check_context(10, 30, 40) == 30
