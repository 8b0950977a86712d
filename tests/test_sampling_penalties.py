"""Presence, frequency and repetition penalties, logit_bias, n and best_of: the sampler's one tensor pass equals a
hand-computed logit adjustment token by token, neutral values leave greedy outputs and logprobs bit-identical,
greedy generation equals Hugging Face's model steered by the hand-computed adjustment, and the completions of
one prompt after the first take its KV from the prefix cache."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from sarathi_lite import LLM, SamplingParams
from sarathi_lite.engine.parallel_sampling import cumulative_logprob
from sarathi_lite.engine.sampler import Sampler
from tests.conftest import HFReference

VOCAB = 320
OPTIONS = dict(chunk_size=16, block_size=4, num_kv_blocks=128, max_model_len=200, device="cpu")


def adjusted(logits: list[float], prompt: list[int], outputs: list[int], params: SamplingParams) -> list[float]:
    """vLLM's logit processing written out by hand, one token at a time: logit_bias, then the repetition
    penalty on every token seen in the prompt or the output, then frequency (per occurrence in the output) and
    presence (once per token in the output)."""
    out = list(logits)
    for t, b in params.logit_bias.items():
        out[t] += b
    r = params.repetition_penalty
    for t in set(prompt) | set(outputs):
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t, count in Counter(outputs).items():
        out[t] -= params.frequency_penalty * count + params.presence_penalty
    return out


def log_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    s = math.log(sum(math.exp(x - m) for x in xs))
    return [x - m - s for x in xs]


PENALTIES = [
    SamplingParams(temperature=0.0, presence_penalty=1.5),
    SamplingParams(temperature=0.0, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, repetition_penalty=0.5, presence_penalty=-0.5, frequency_penalty=-1.0),
    SamplingParams(temperature=0.0, logit_bias={7: 3.0, 11: -2.5, 300: 0.25}),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=2.0, logit_bias={5: 1.0}),
]


def test_the_sampler_applies_penalties_and_bias_as_the_hand_computed_adjustment():
    gen = torch.Generator().manual_seed(0)
    rows = len(PENALTIES) + 1
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    prompts = [[int(t) for t in torch.randint(0, VOCAB, (9,), generator=gen)] for _ in range(rows)]
    outputs = [[int(t) for t in torch.randint(0, 12, (6,), generator=gen)] for _ in range(rows)]  # repeats
    params = [SamplingParams(temperature=0.0, logprobs=VOCAB, **_fields(p)) for p in PENALTIES]
    params.append(SamplingParams(temperature=0.0, logprobs=VOCAB))  # a neutral row in the same batch
    ids = [f"r{i}" for i in range(rows)]
    history = {rid: (prompts[i], outputs[i]) for i, rid in enumerate(ids) if params[i].penalized}
    tokens, lps = Sampler(torch.device("cpu"))(logits.clone(), ids, params, history=history)
    for i, p in enumerate(params):
        expected = adjusted(logits[i].tolist(), prompts[i], outputs[i], p)
        assert tokens[i] == max(range(VOCAB), key=expected.__getitem__), i
        ref = log_softmax(expected)
        got = lps[i][1]
        assert max(abs(got[t] - ref[t]) for t in range(VOCAB)) < 1e-4, i
    neutral = torch.log_softmax(logits[-1], dim=-1).tolist()
    assert [lps[-1][1][t] for t in range(VOCAB)] == neutral  # bit-identical, not just close


def _fields(p: SamplingParams) -> dict:
    return dict(presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias)


def test_the_sampler_counts_its_own_samples_into_the_history():
    """After the first row, the penalty sees the tokens the sampler itself sampled, even before the scheduler
    has them (async scheduling): a frequency penalty of 2 over repeated steps on fixed logits walks down the
    ranking instead of repeating the top token."""
    sampler = Sampler(torch.device("cpu"))
    logits = torch.arange(VOCAB, dtype=torch.float32)[None] * 0.7  # token V-1 first, V-2 next, ... 0.7 apart
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    history = {"a": ([1, 2], [])}
    picks = [sampler(logits.clone(), ["a"], params, history=history)[0][0] for _ in range(8)]
    expected: list[int] = []
    for _ in range(8):
        adj = adjusted(logits[0].tolist(), [1, 2], expected, params[0])
        expected.append(max(range(VOCAB), key=adj.__getitem__))
    assert picks == expected and len(set(picks)) > 4
    sampler.forget("a")
    assert sampler(logits.clone(), ["a"], params, history=history)[0][0] == 319


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:
    return LLM(tiny_checkpoints["llama"], **OPTIONS)


@pytest.fixture(scope="module")
def hf(tiny_checkpoints) -> HFReference:
    return HFReference(tiny_checkpoints["llama"])


def test_neutral_values_keep_greedy_outputs_and_logprobs_bit_identical(llm):
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60)), [11] * 13]
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    neutral = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, presence_penalty=0.0,
                             frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={}, n=1, best_of=1)
    def run(prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list:
        llm.reset_prefix_cache()  # every run computes the same chunks, so float results compare bit for bit
        return llm.generate(prompts, params, use_tqdm=False)

    before = run(prompts, base)
    after = run(prompts, neutral)
    assert [(o.token_ids, o.logprobs) for o in before] == [(o.token_ids, o.logprobs) for o in after]
    # next to penalized rows (same batch shapes every step: same prompts, same lengths), the neutral rows'
    # logits are untouched
    penalized = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, repetition_penalty=1.5,
                               logit_bias={7: 2.0})
    plain = run(prompts * 2, [base] * 6)
    mixed = run(prompts * 2, [neutral] * 3 + [penalized] * 3)
    assert [(o.token_ids, o.logprobs) for o in plain[:3]] == [(o.token_ids, o.logprobs) for o in mixed[:3]]
    assert [o.token_ids for o in plain[3:]] != [o.token_ids for o in mixed[3:]]


@pytest.mark.parametrize("params", PENALTIES, ids=lambda p: ",".join(
    f"{k}={v}" for k, v in _fields(p).items() if v not in (0.0, 1.0, {})))
def test_greedy_generation_follows_the_hand_computed_adjustment_of_hugging_faces_logits(hf, llm, params):
    ref_model = hf
    prompt = [5, 6, 7, 5, 6, 7, 9, 10]
    p = SamplingParams(max_tokens=10, ignore_eos=True, **{**_fields(params), "logit_bias": params.logit_bias},
                       temperature=0.0)
    out = llm.generate(prompt, p, use_tqdm=False)[0]
    expected: list[int] = []
    for _ in range(p.max_tokens):
        logits = ref_model.logits(prompt + expected)[-1].tolist()
        adj = adjusted(logits, prompt, expected, p)
        expected.append(max(range(VOCAB), key=adj.__getitem__))
    assert out.token_ids == expected
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert plain.token_ids != expected  # the adjustment changed the output: the test can fail


def test_n_completions_share_the_prompts_kv_and_best_of_returns_the_likeliest(llm):
    prompt = list(range(30, 70))  # 40 tokens: 9 full blocks of 4 the siblings can take from the cache
    p = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=3, seed=11)
    out = llm.generate(prompt, p, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.outputs[0] is out
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert out.metrics.num_cached_tokens == 0
    assert all(c.metrics.num_cached_tokens >= 36 for c in out.outputs[1:])
    seeded = [llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=11 + k),
                           use_tqdm=False)[0].token_ids for k in range(3)]
    assert [c.token_ids for c in out.outputs] == seeded  # completion k is the one-request run with seed + k

    all4 = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=4, seed=3,
                                               logprobs=0), use_tqdm=False)[0].outputs
    best = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=2, best_of=4,
                                               seed=3), use_tqdm=False)[0]
    ranked = sorted(all4, key=cumulative_logprob, reverse=True)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1] and all(c.logprobs is None for c in best.outputs)
    assert not llm.engine.has_unfinished_requests()


def test_the_step_api_refuses_several_completions_naming_the_field(llm):
    with pytest.raises(ValueError, match="n=2"):
        llm.engine.add_request("x", [5, 6], SamplingParams(n=2))
    with pytest.raises(ValueError, match="logit_bias contains the key 320"):
        llm.generate([5, 6], SamplingParams(logit_bias={320: 1.0}), use_tqdm=False)


@pytest.mark.parametrize("fields, name", [
    (dict(presence_penalty=2.01), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(presence_penalty=True), "presence_penalty"), (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={"1": 1.0}), "logit_bias"), (dict(logit_bias=[1]), "logit_bias"), (dict(n=0), "n"),
    (dict(n=129), "n"), (dict(n=3, best_of=2), "best_of"), (dict(best_of=1.0), "best_of"),
])
def test_new_sampling_fields_reject_bad_values_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)
