"""Property-based fuzzing of the OpenAPI schema the server publishes (hypothesis): bodies drawn from
each POST route's request schema, and mutations of them (a field replaced by any JSON value, a required field
dropped, strings with lone surrogates). Properties: never a 5xx, every body and event JSON proper (no NaN or
Infinity), every error in OpenAI's shape, and the engine still serves a normal request after each example (so a
request that leaked its places in the queue bound would show). Bounded: a short context (every drawn request
finishes in a few dozen tiny steps) and a fixed number of examples. The fields added for OpenAI compatibility
(``n``, ``best_of``, penalties, ``logit_bias``, ``echo``, several prompts) are drawn from the schema like the
others, and also injected together with a prompt that runs, so they reach the engine, with the edges hostile
clients found: tiny and denormal ``top_p``, ``stop_token_ids`` that leave no token before ``min_tokens``, and
many prompts x ``n`` around ``max_prompts_per_request`` and ``max_waiting_requests``."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sarathi_lite.server import ServerConfig
from tests.conftest import TINY, make_tiny_checkpoint
from tests.live_server import MODEL, assert_openai_error, serve_in_thread
from tests.schema_strategy import from_schema
from tests.tiny_tokenizer import save_tiny_tokenizer

ENGINE = dict(chunk_size=32, block_size=4, num_kv_blocks=128, max_num_seqs=8, max_model_len=48, device="cpu")
EXAMPLES = 100  # per route
LIMITS = dict(request_timeout=60.0, max_waiting_requests=128, max_prompts_per_request=32)  # any n (<= 128) runs
VOCAB = TINY["vocab_size"]

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                  max_size=3), max_leaves=6)
# the OpenAI fields added for compatibility, drawn around their edges, with a prompt that runs: so they reach the
# engine together (several prompts, n, best_of, penalties, logit_bias, echo) and not only the validation
NEW_FIELDS = st.fixed_dictionaries({}, optional={
    "n": st.integers(1, 4), "best_of": st.integers(1, 5), "echo": st.booleans(), "stream": st.booleans(),
    "presence_penalty": st.sampled_from([-2.0, -0.5, 0, 1.5, 2]),
    "frequency_penalty": st.sampled_from([-2, 0.0, 0.3, 2.0]),
    "repetition_penalty": st.sampled_from([0.01, 0.5, 1, 1.7, 100.0]),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str),
                                  st.sampled_from([-100, -1.5, 0, 2.0, 100]), max_size=3),
    "prompt": st.sampled_from([["a", "b"], [[5, 6], [7]], "hello", [[5] * 30, [6]]]),
    "temperature": st.sampled_from([0, 0.7]), "seed": st.integers(0, 5), "max_tokens": st.integers(1, 6)})
# the edges hostile clients found, with a prompt that runs: many prompts x n over max_prompts_per_request (400) or
# at and past max_waiting_requests, tiny and denormal top_p (0 in float32), stop tokens that leave no token (or
# one) before min_tokens, with logprobs
HOSTILE = st.one_of(
    st.fixed_dictionaries({"prompt": st.sampled_from([[[7]] * 33, [[5, 6]] * 32]),  # 32 x 4 = 128 fit, 32 x 5 not
                           "n": st.integers(1, 4), "max_tokens": st.just(1)},
                          optional={"best_of": st.integers(4, 5), "stream": st.booleans()}),
    st.fixed_dictionaries({"top_p": st.sampled_from([5e-324, 1e-300, 1e-45, 1e-40, 1e-38]),
                           "temperature": st.sampled_from([0.5, 1.0, 2.0]), "max_tokens": st.integers(1, 6)},
                          optional={"logprobs": st.sampled_from([0, 5]), "stream": st.booleans()}),
    st.fixed_dictionaries({"stop_token_ids": st.sampled_from([list(range(VOCAB)), list(range(1, VOCAB)),
                                                              list(range(VOCAB - 3))]),
                           "min_tokens": st.integers(1, 3), "max_tokens": st.integers(3, 6)},
                          optional={"logprobs": st.sampled_from([0, 5, 20]), "stream": st.booleans(),
                                    "ignore_eos": st.booleans(), "temperature": st.sampled_from([0, 1.0])}))
# bodies with the added fields and the hostile edges that the engine runs (200), whatever Hypothesis draws
CHAT = [{"role": "user", "content": "hi"}]
RUNS = {"/v1/completions": [
    {"prompt": ["a", "b"], "n": 2, "best_of": 3, "max_tokens": 3, "logit_bias": {"5": 2.0}, "presence_penalty": 0.5},
    {"prompt": [[5] * 30, [6]], "echo": True, "max_tokens": 2, "repetition_penalty": 1.7},
    {"prompt": "hello", "stream": True, "top_p": 1e-45, "temperature": 1.0, "max_tokens": 3, "seed": 1},
    {"prompt": [[7]] * 32, "n": 4, "max_tokens": 1},
    {"prompt": [5, 6], "stop_token_ids": list(range(1, VOCAB)), "min_tokens": 2, "max_tokens": 4}],
    "/v1/chat/completions": [
    {"messages": CHAT, "n": 3, "max_tokens": 3, "frequency_penalty": -2, "logit_bias": {"7": -100}},
    {"messages": CHAT, "logprobs": True, "top_logprobs": 5, "max_tokens": 2, "stream": True},
    {"messages": CHAT, "top_p": 5e-324, "temperature": 2.0, "max_tokens": 4, "seed": 3},
    {"messages": CHAT, "stop_token_ids": list(range(1, VOCAB)), "min_tokens": 1, "max_tokens": 3, "ignore_eos": True}]}
SURROGATE_TEXT = st.builds(lambda a, s, b: a + s + b, st.text(max_size=3),
                           st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"]), st.text(max_size=3))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_tiny_tokenizer(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("fuzz") / "llama"), VOCAB)
    with serve_in_thread(path, ServerConfig(**LIMITS), **ENGINE) as url:
        yield url


def body_schema(openapi: dict, route: str) -> dict:
    """The JSON schema of ``route``'s request body (its ``$ref``s point into ``openapi``)."""
    return openapi["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]


@st.composite
def mutated(draw, valid: st.SearchStrategy) -> tuple[str, dict]:
    """A body valid per the schema, then often broken in one place; with the name of what was done to it."""
    body = draw(valid)
    body["model"] = draw(st.sampled_from([MODEL, MODEL, MODEL, body.get("model", MODEL)]))
    how = draw(st.sampled_from(["valid", "valid", "runnable", "runnable", "new_fields", "new_fields", "hostile",
                                "hostile", "replace", "drop", "surrogate"]))
    keys = sorted(body)
    if how == "runnable":  # a prompt and a length the engine takes, so the other fields reach it more often
        body["model"] = MODEL
        body["prompt" if "prompt" in body else "messages"] = draw(st.sampled_from(
            ["hello", [5, 6, 7], ["hi"], [[8, 9]]] if "prompt" in body else [[{"role": "user", "content": "hi"}]]))
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = draw(st.integers(1, 6))
    elif how in ("new_fields", "hostile"):
        extra = draw(NEW_FIELDS if how == "new_fields" else HOSTILE)
        if "prompt" not in body:  # chat: a conversation instead of prompts, no echo, logprobs as chat has them
            extra.pop("echo", None)
            if "logprobs" in extra:
                extra["top_logprobs"], extra["logprobs"] = extra["logprobs"], True
            extra["messages"] = [{"role": "user", "content": "hi"}]
            extra.pop("prompt", None)
        body.update(extra)
    elif how == "replace" and keys:
        body[draw(st.sampled_from(keys))] = draw(JSON)
    elif how == "drop" and keys:
        body.pop(draw(st.sampled_from(keys)))
    elif how == "surrogate":
        body[draw(st.sampled_from(["prompt", "stop", "user", "model", "messages"]))] = draw(SURROGATE_TEXT)
    return how, body


def strict_json(text: str):
    """JSON proper: the NaN and Infinity that Python's json reads (and writes) are refused."""
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def check_route(url: str, route: str, body: dict) -> int:
    raw = json.dumps(body)  # lone surrogates travel as "\ud800" escapes, as a client's JSON would carry them
    r = httpx.post(f"{url}{route}", content=raw, headers={"content-type": "application/json"}, timeout=90)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)
        strict_json(r.text)
    elif body.get("stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in strict_json(e) for e in events[:-1]), r.text
    else:
        choices = strict_json(r.text)["choices"]
        assert all(c["finish_reason"] in ("stop", "length") for c in choices), r.text
        prompt = body.get("prompt")
        several = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        expected = (len(prompt) if several else 1) * body.get("n", 1)
        assert [c["index"] for c in choices] == list(range(expected)), r.text
    ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2,
                                                   "ignore_eos": True}, timeout=90)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2, ok.text
    return r.status_code


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_bodies_never_get_a_5xx_and_the_engine_keeps_serving(server, route):
    openapi = httpx.get(f"{server}/openapi.json").json()
    valid = from_schema(body_schema(openapi, route), openapi)
    statuses: list[tuple[str, int]] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(drawn=mutated(valid))
    def fuzz(drawn: tuple[str, dict]) -> None:
        how, body = drawn
        statuses.append((how, check_route(server, route, body)))

    for body in RUNS[route]:
        fuzz = example(drawn=("example", {"model": MODEL, **body}))(fuzz)

    fuzz()
    assert httpx.get(f"{server}/health").status_code == 200
    examples = [status for how, status in statuses if how == "example"]
    drawn = [status for how, status in statuses if how != "example"]
    # the added fields reach the engine whatever Hypothesis draws: every explicit example runs
    assert examples == [200] * len(RUNS[route]), statuses
    # the drawn bodies reached both the engine and the validation: neither (nearly) all rejected nor all accepted
    assert drawn.count(200) >= EXAMPLES // 10 and sum(400 <= s < 500 for s in drawn) >= EXAMPLES // 5, \
        sorted(statuses)
