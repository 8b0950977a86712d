"""One bad request never stops the engine: every numeric field is bounded (the requests that used to raise
inside the sampler are rejected up front, naming the field), a step that fails for any other reason fails only
its own requests and frees their blocks, only a broken device or worker is fatal, and ``LLM`` recovers the same
way. Bad types and lone surrogates are ``ValueError``s naming the argument. A hypothesis test draws
``SamplingParams`` and prompts at every field's edges through ``LLM``."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sarathi_lite import LLM, LLMEngine, SamplingParams
from sarathi_lite.engine.errors import EngineDeadError
from sarathi_lite.engine.sampling_params import MIN_TEMPERATURE
from tests.conftest import TINY, make_tiny_checkpoint
from tests.tiny_tokenizer import save_tiny_tokenizer

VOCAB = TINY["vocab_size"]
OPTIONS = dict(chunk_size=16, block_size=4, num_kv_blocks=64, max_model_len=40, device="cpu")


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    return save_tiny_tokenizer(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("robust") / "llama"), VOCAB)


@pytest.fixture(scope="module")
def llm(chat_checkpoint) -> LLM:
    return LLM(chat_checkpoint, **OPTIONS)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_all(engine: LLMEngine) -> dict[str, object]:
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests() and engine.scheduler.block_manager.num_used_blocks == 0
    assert not len(engine.outputs) and not engine.runner.sampler._generators


# The five requests that passed validation on main and then raised inside the sampler, stopping the engine for
# everyone, and the subnormal temperature that overflowed the logits.
ENGINE_KILLERS = [
    (dict(temperature=1.0, seed=2**64), "seed"),
    (dict(top_k=2**63), "top_k"),
    (dict(min_tokens=2, stop_token_ids=[10**9]), "stop_token_ids"),
    (dict(min_tokens=2, stop_token_ids=[2**64]), "stop_token_ids"),
    (dict(logprobs=VOCAB + 1), "logprobs"),
    (dict(temperature=1e-40), "temperature"),
]


@pytest.mark.parametrize("fields, name", ENGINE_KILLERS)
def test_requests_that_used_to_fail_in_the_sampler_are_rejected_naming_the_field(llm, fields, name):
    with pytest.raises(ValueError, match=name):
        llm.generate("Hi", SamplingParams(max_tokens=4, **fields), use_tqdm=False)
    assert_idle(llm.engine)
    ok = llm.generate([5, 6, 7], greedy(5), use_tqdm=False)[0]
    assert ok.finish_reason == "length" and ok.num_output_tokens == 5


def test_the_largest_accepted_values_run(llm):
    params = SamplingParams(max_tokens=2**63 - 1, temperature=MIN_TEMPERATURE, top_k=2**31 - 1, seed=2**64 - 1,
                            logprobs=VOCAB, min_tokens=3, stop_token_ids=[VOCAB - 1])
    # the step API runs it to the end of the context; LLM.generate, like the server, refuses a max_tokens the
    # context cannot hold (prompts.check_context)
    llm.engine.add_request("largest", [5, 6, 7], params)
    out = run_all(llm.engine)["largest"]
    assert out.finish_reason in ("stop", "length") and out.num_output_tokens >= 3
    with pytest.raises(ValueError, match=r"prompts\[0\]: 3 prompt tokens \+ max_tokens=9223372036854775807"):
        llm.generate([5, 6, 7], params, use_tqdm=False)
    assert all(len(top) == VOCAB for _, top in out.logprobs)
    # the smallest temperature behaves as (almost) greedy: no overflow into token 0 over and over
    near = llm.generate([5, 6, 7], SamplingParams(max_tokens=8, temperature=MIN_TEMPERATURE, seed=1,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert near.token_ids == llm.generate([5, 6, 7], greedy(8), use_tqdm=False)[0].token_ids
    assert_idle(llm.engine)


def failing_execute(engine: LLMEngine, fail_on: set[int], message: str = "boom"):
    """Make ``engine``'s runner raise ``RuntimeError(message)`` on the given calls (1-based)."""
    execute, calls = engine.runner.execute, []

    def run(*args, **kwargs):
        calls.append(1)
        if len(calls) in fail_on:
            raise RuntimeError(message)
        return execute(*args, **kwargs)

    engine.runner.execute = run
    return calls


def test_a_failing_step_fails_only_its_requests_frees_their_blocks_and_the_engine_goes_on(tiny_checkpoints):
    reference = LLMEngine(tiny_checkpoints["llama"], **OPTIONS)
    reference.add_request("c", [9, 10, 11], greedy(6))
    expected = run_all(reference)["c"].token_ids

    engine = LLMEngine(tiny_checkpoints["llama"], **OPTIONS)
    failing_execute(engine, {3}, "boom in the forward pass")
    engine.add_request("a", list(range(10, 30)), greedy(8))
    engine.add_request("b", [5, 6, 7], greedy(8))
    done = run_all(engine)
    assert {rid: o.finish_reason for rid, o in done.items()} == {"a": "error", "b": "error"}
    assert all("boom in the forward pass" in o.error and o.text is not None for o in done.values())
    assert_idle(engine)
    assert [r.finish_reason for r in engine.stats().requests] == ["error", "error"]
    assert engine.stats().summary()["num_requests"] == 0  # failed requests are not latency samples
    engine.add_request("c", [9, 10, 11], greedy(6))
    after = run_all(engine)["c"]
    assert after.finish_reason == "length" and after.token_ids == expected and after.error is None


def test_a_step_that_fails_while_others_are_mid_request_spares_the_requests_outside_it(tiny_checkpoints):
    engine = LLMEngine(tiny_checkpoints["llama"], **{**OPTIONS, "max_num_seqs": 1})
    failing_execute(engine, {2})
    engine.add_request("first", [5, 6, 7], greedy(4))
    engine.add_request("queued", [8, 9], greedy(4))  # waits: one request runs at a time
    done = run_all(engine)
    assert done["first"].finish_reason == "error" and done["queued"].finish_reason == "length"
    assert_idle(engine)


class _DeadWorkers:
    """A tensor-parallel group whose rank 1 died mid-step (what ``WorkerGroup`` reports then)."""

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


def test_only_a_broken_device_or_worker_is_fatal_and_the_error_says_why(tiny_checkpoints):
    engine = LLMEngine(tiny_checkpoints["llama"], **OPTIONS)
    engine.executor = _DeadWorkers(engine.executor)
    engine.add_request("a", [5, 6, 7], greedy(4))
    with pytest.raises(EngineDeadError, match="rank 1 .* killed by signal 9"):
        engine.step()
    engine.executor = engine.executor.executor


def test_llm_recovers_after_a_failed_step(chat_checkpoint):
    llm = LLM(chat_checkpoint, **OPTIONS)
    expected = llm.generate("Hi", greedy(5), use_tqdm=False)[0].token_ids
    failing_execute(llm.engine, {1})
    outs = llm.generate(["Hello", [5, 6, 7]], greedy(5), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["error", "error"] and all("boom" in o.error for o in outs)
    assert_idle(llm.engine)
    for _ in range(2):
        again = llm.generate("Hi", greedy(5), use_tqdm=False)[0]
        assert again.finish_reason == "length" and again.token_ids == expected


def test_a_dead_engine_leaves_none_of_the_calls_requests_queued(chat_checkpoint):
    llm = LLM(chat_checkpoint, **OPTIONS)
    llm.engine.executor = _DeadWorkers(llm.engine.executor)
    with pytest.raises(EngineDeadError):
        llm.generate(["a", "b"], greedy(4), use_tqdm=False)
    llm.engine.executor = llm.engine.executor.executor
    assert_idle(llm.engine)


@pytest.mark.parametrize("call, message", [
    (lambda llm: SamplingParams(stop=5), "stop=5 must be a string or a list of strings"),
    (lambda llm: SamplingParams(stop=["ok", "a\ud800"]), "stop contains a lone surrogate"),
    (lambda llm: SamplingParams(stop_token_ids=5), "stop_token_ids=5 must be a list of token ids"),
    (lambda llm: SamplingParams(ignore_eos="yes"), "ignore_eos='yes'"),
    (lambda llm: SamplingParams(temperature=True), "temperature=True"),
    (lambda llm: llm.generate(None), "prompts must be text, token ids, or a list"),
    (lambda llm: llm.generate(["ok", 3]), "prompt must be text or a list of token ids, got int"),
    (lambda llm: llm.generate("a\ud800b"), "prompt contains a lone surrogate '\\\\ud800' at character 1"),
    (lambda llm: llm.generate("x", params=[1]), r"params\[0\] must be SamplingParams; got int"),
    (lambda llm: llm.generate("x", params=[SamplingParams(), 1]), r"got 2 SamplingParams for 1 prompts"),
    (lambda llm: llm.generate(["x", "y"], params=[SamplingParams(), 1]), r"params\[1\] must be SamplingParams"),
    (lambda llm: llm.chat([{"role": "user"}]), r"messages\[0\]: 'content' must be a string"),
    (lambda llm: llm.chat([{"role": "user", "content": "a\udfffb"}]), r"messages\[0\].content contains a lone"),
    (lambda llm: llm.chat(None), "messages must be a non-empty list"),
    (lambda llm: llm.chat([]), "messages must be a non-empty list"),
    (lambda llm: llm.chat(["hi"]), "messages must be a non-empty list"),
    (lambda llm: llm.chat([[{"role": "user", "content": "hi"}], [5]]), r"messages\[1\]\[0\] must be a dict"),
])
def test_bad_types_and_text_raise_value_errors_naming_them(llm, call, message):
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert_idle(llm.engine)


@pytest.mark.parametrize("device, message", [("cuda:99", "device='cuda:99'"), ("nonsense", "device='nonsense'"),
                                             ("mps:7", "device='mps:7'")])
def test_a_device_this_machine_lacks_is_a_value_error_naming_it(tiny_checkpoints, device, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(tiny_checkpoints["llama"], device=device, num_kv_blocks=8)


# --------------------------------------------------------------------------- every field at its edges

def _edges(valid: list, invalid: list) -> st.SearchStrategy:
    return st.sampled_from(valid + invalid)


FIELDS = {
    "max_tokens": _edges([1, 2, 7, 2**63 - 1], [0, -1, 2**63, 1.5, None, True]),
    "temperature": _edges([0, 0.0, MIN_TEMPERATURE, 0.7, 2.0, 1e30, 1e300], [-1e-9, 1e-40, 5e-324, math.nan,
                                                                           math.inf, -1, "1"]),
    "top_p": _edges([5e-324, 1e-9, 0.5, 1, 1.0], [0, -0.1, 1.0000001, math.nan, math.inf]),
    "top_k": _edges([-1, 0, 1, VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1], [-2, 2**31, 2**63, 1.0]),
    "seed": _edges([None, -(2**63), -1, 0, 2**63, 2**64 - 1], [2**64, -(2**63) - 1, 1.5, "7"]),
    "logprobs": _edges([None, 0, 1, VOCAB], [-1, VOCAB + 1, 2**31, 2**63, 0.5]),
    "stop_token_ids": st.lists(st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, 10**9, 2**63 - 1, 2**64, -1]),
                               max_size=3),
    "min_tokens": _edges([0, 1, 5], [-1, 2**63]),
    "stop": st.one_of(st.lists(st.text(min_size=1, max_size=3), max_size=2), st.sampled_from(["", ["", "a"]])),
    "ignore_eos": st.booleans(),
}


@st.composite
def sampling_fields(draw) -> dict:
    return {name: draw(strategy) for name, strategy in FIELDS.items() if draw(st.booleans())}


PROMPTS = st.one_of(st.text(max_size=12),
                    st.lists(st.sampled_from([0, 1, 2, 5, VOCAB - 1, VOCAB, -1, 2**63]), max_size=6),
                    st.lists(st.integers(0, VOCAB - 1), min_size=30, max_size=45))


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fields=sampling_fields(), prompt=PROMPTS)
def test_sampling_params_and_prompts_at_every_edge_fail_cleanly_or_run(llm, fields, prompt):
    """Whatever is drawn: either a ValueError up front, or outputs that respect the params; and the engine is
    idle and serves a normal request afterwards."""
    try:
        params = SamplingParams(**fields)
        outs = llm.generate(prompt, params, use_tqdm=False)
    except ValueError:
        outs = None
    if outs is not None and prompt == []:  # no prompts at all
        assert outs == []
    elif outs is not None:
        out, = outs
        assert out.finish_reason in ("stop", "length"), out.error
        assert params.min_tokens <= out.num_output_tokens <= params.max_tokens or out.finish_reason == "length"
        assert len(out.prompt_token_ids) + out.num_output_tokens <= OPTIONS["max_model_len"]
        assert all(0 <= t < VOCAB for t in out.token_ids)
        if params.logprobs is not None:
            assert len(out.logprobs) == out.num_output_tokens
            assert all(math.isfinite(lp) and len(top) == params.logprobs for lp, top in out.logprobs)
    assert_idle(llm.engine)
    ok = llm.generate([5, 6, 7], greedy(2), use_tqdm=False)[0]
    assert ok.finish_reason == "length" and ok.num_output_tokens == 2
