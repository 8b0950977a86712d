"""The engine and LLM API: outputs, metrics, stopping, sampling, aborts and bad input; the step API (``Engine``)
every engine declares."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from sarathi_lite import LLM, LLMEngine, SamplingParams
from sarathi_lite.costs import ProfiledCostModel
from sarathi_lite.engine.disagg_engine import DisaggregatedEngine
from sarathi_lite.engine.instances import ProcessEngine
from sarathi_lite.engine.interface import Engine


@pytest.fixture()
def engine(tiny_checkpoints) -> LLMEngine:
    return LLMEngine(tiny_checkpoints["llama"], chunk_size=16, block_size=4, num_kv_blocks=128, device="cpu")


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    return done


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_generate_returns_outputs_in_input_order_with_per_request_metrics(tiny_checkpoints, hf_reference):
    llm = LLM(tiny_checkpoints["llama"], chunk_size=16, device="cpu")
    prompts = [[5, 6, 7] * 20, [9], [11, 12] * 5]
    outs = llm.generate(prompts, [greedy(3), greedy(7), greedy(5)], use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 7, 5]
    ref = hf_reference("llama")
    for prompt, o in zip(prompts, outs):
        assert o.prompt_token_ids == prompt and o.finish_reason == "length"
        assert o.token_ids == ref.generate(prompt, len(o.token_ids))
        m = o.metrics
        assert m.first_scheduled_time >= m.arrival_time and 0 < m.ttft <= m.e2e
        assert len(m.tbt) == len(o.token_ids) - 1 and all(g > 0 for g in m.tbt)
        assert m.ttft + sum(m.tbt) == pytest.approx(m.e2e)


def test_every_step_runs_exactly_one_forward_pass(engine):
    calls = []
    model = engine.model
    original = model.forward
    model.forward = lambda ids, pos: calls.append(len(ids)) or original(ids, pos)
    for i, n in enumerate([40, 3, 25]):  # distinct prompts: no prefix-cache hit shortens the prefills
        engine.add_request(f"r{i}", list(range(10 + 50 * i, 10 + 50 * i + n)), greedy(4))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert len(calls) == steps == len(engine.stats().iterations)
    its = engine.stats().iterations
    assert calls == [it.num_tokens for it in its]
    assert any(it.num_prefills and it.num_decodes for it in its), "no hybrid prefill+decode iteration"


def test_stop_token_and_eos_finish_with_stop_and_ignore_eos_continues(engine, hf_reference):
    prompt = list(range(20, 60))
    free_run = hf_reference("llama").generate(prompt, 8)
    stop = free_run[3]
    engine.add_request("stop", prompt, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop]))
    engine.add_request("eos-ignored", prompt, greedy(8, stop_token_ids=[]))
    engine.eos_token_ids = frozenset({stop})  # the model's EOS, for this test
    engine.add_request("eos", prompt, SamplingParams(temperature=0.0, max_tokens=8))
    engine.add_request("ignore", prompt, greedy(8))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    first = free_run.index(stop) + 1
    assert outs["stop"].token_ids == free_run[:first] and outs["stop"].finish_reason == "stop"
    assert outs["eos"].token_ids == free_run[:first] and outs["eos"].finish_reason == "stop"
    assert outs["ignore"].token_ids == free_run and outs["ignore"].finish_reason == "length"


def test_max_model_len_ends_generation_with_length(tiny_checkpoints):
    engine = LLMEngine(tiny_checkpoints["llama"], max_model_len=50, device="cpu")
    engine.add_request("a", list(range(10, 55)), greedy(100))
    out = run_all(engine)
    assert len(out["a"]) == 5  # 45 prompt tokens + 5 outputs reach max_model_len
    with pytest.raises(ValueError, match="prompt of 51 tokens is longer than max_model_len=50"):
        engine.add_request("b", list(range(10, 61)), greedy(1))


def test_bad_input_is_rejected_clearly_and_other_requests_finish_unchanged(tiny_checkpoints):
    def fresh() -> LLMEngine:
        return LLMEngine(tiny_checkpoints["llama"], chunk_size=16, block_size=4, num_kv_blocks=64,
                         max_model_len=300, device="cpu")

    good = {"a": list(range(10, 70)), "b": list(range(30, 35))}
    clean = fresh()
    for rid, p in good.items():
        clean.add_request(rid, p, greedy(6))
    expected = run_all(clean)

    engine = fresh()
    for rid, p in good.items():
        engine.add_request(rid, p, greedy(6))
    engine.step()
    engine.step()
    bad = [
        (("c", []), "empty prompt"),
        (("c", [5, 320]), "token id 320 is outside the vocabulary"),
        (("c", [5, -1]), "token id -1 is outside the vocabulary"),
        (("c", list(range(10, 311))), "prompt of 301 tokens is longer than max_model_len=300"),
        (("a", [5, 6]), "request_id='a' is already in use"),
    ]
    for (rid, prompt), message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request(rid, prompt, greedy(4))
    with pytest.raises(ValueError, match="request_id='nope' is unknown"):
        engine.abort_request("nope")
    with pytest.raises(ValueError, match="max_tokens=0"):
        engine.add_request("c", [5], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match=r"need \d+ KV blocks .* more than the whole pool \(num_blocks=64\)"):
        engine.add_request("c", list(range(10, 150)), greedy(150))
    assert run_all(engine) == expected


def test_abort_in_every_state_frees_blocks_and_spares_the_others(tiny_checkpoints):
    # First-come-first-served admission (no HOL protection) puts the requests in the three states named below.
    engine = LLMEngine(tiny_checkpoints["llama"], chunk_size=8, block_size=4, num_kv_blocks=64, max_num_seqs=2,
                       device="cpu", hol_protection=False)
    for rid, n in [("decoding", 4), ("prefilling", 40), ("waiting", 10), ("keeper", 6)]:
        engine.add_request(rid, list(range(10, 10 + n)), greedy(8))
    engine.step()
    engine.step()
    states = {r.request_id: (r.status.value, r.is_prefill) for r in engine.scheduler.requests.values()}
    assert states["decoding"] == ("running", False)
    assert states["prefilling"] == ("running", True)
    assert states["waiting"][0] == "waiting"
    for rid in ("decoding", "prefilling", "waiting"):
        engine.abort_request(rid)
    assert engine.scheduler.block_manager.num_free_blocks == 64
    out = run_all(engine)
    assert list(out) == ["keeper"] and len(out["keeper"]) == 8
    assert {r.request_id: r.finish_reason for r in engine.stats().requests}["waiting"] == "abort"
    assert engine.stats().summary()["num_requests"] == 1


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], chunk_size=32, device="cpu")
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([[7, 8, 9]], p, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batched = llm.generate([[1, 2, 3, 4, 5] * 9, [7, 8, 9], [40, 41]], [others, p, others], use_tqdm=False)
    assert batched[1].token_ids == alone
    different_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, seed=99, ignore_eos=True)
    assert llm.generate([[7, 8, 9]], different_seed, use_tqdm=False)[0].token_ids != alone


def test_the_smallest_top_p_samples_the_most_likely_token(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], chunk_size=32, device="cpu")
    prompts = [[7, 8, 9], [40, 41, 42, 43]]
    expected = [o.token_ids for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
    for top_p in (1e-300, 5e-324, 1e-40):  # 0, 0 and a denormal in float32
        params = SamplingParams(temperature=0.5, top_p=top_p, max_tokens=6, ignore_eos=True)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected, top_p


def test_logprobs_are_the_sampled_tokens_log_softmax(tiny_checkpoints, hf_reference):
    llm = LLM(tiny_checkpoints["llama"], device="cpu")
    prompt = list(range(40, 80))
    out = llm.generate([prompt], greedy(4, logprobs=3), use_tqdm=False)[0]
    hf = torch.log_softmax(hf_reference("llama").logits(prompt + out.token_ids[:-1])[len(prompt) - 1:], -1)
    for j, (lp, top) in enumerate(out.logprobs):
        assert lp == pytest.approx(float(hf[j, out.token_ids[j]]), abs=1e-4)
        assert len(top) == 3 and max(top.values()) == pytest.approx(lp, abs=1e-6)  # greedy picks the top one


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("max_tokens", 1.5), ("temperature", -0.1),
                                          ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
                                          ("top_k", -2), ("stop_token_ids", [-3]), ("seed", "x"),
                                          ("logprobs", -1)])
def test_sampling_params_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_engine_options_are_validated(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with pytest.raises(TypeError, match="unknown engine option"):
        LLMEngine(path, device="cpu", chunk_sise=8)
    with pytest.raises(ValueError, match="dtype='float8'"):
        LLMEngine(path, device="cpu", dtype="float8")
    with pytest.raises(ValueError, match="max_model_len=5000 exceeds"):
        LLMEngine(path, device="cpu", max_model_len=5000)
    with pytest.raises(ValueError, match="num_kv_blocks=0"):
        LLMEngine(path, device="cpu", num_kv_blocks=0)
    with pytest.raises(ValueError, match="chunk_size=0"):
        LLMEngine(path, device="cpu", chunk_size=0)
    with pytest.raises(ValueError, match="policy='fifo'"):
        LLMEngine(path, device="cpu", scheduler="fifo")
    with pytest.raises(ValueError, match="neither a built-in name"):
        LLMEngine(path / "missing", device="cpu")


def test_auto_chunk_size_from_a_profile_file_keeps_greedy_outputs_exact(tiny_checkpoints, hf_reference, tmp_path):
    profile = ProfiledCostModel((1, 64), (0.002, 0.008)).save(tmp_path / "profile.json")
    llm = LLM(tiny_checkpoints["llama"], chunk_size="auto", tbt_slo=0.004, min_chunk_size=8, cost_model=profile,
              block_size=4, device="cpu")
    prompts = [[5, 6, 7] * 30, [9] * 3, [11, 12] * 40]
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    ref = hf_reference("llama")
    for prompt, o in zip(prompts, outs):
        assert o.token_ids == ref.generate(prompt, 6)
    assert llm.engine.scheduler.budget.correction != 1.0  # every measured step was fed back
    with pytest.raises(ValueError, match="needs cost_model="):
        LLMEngine(tiny_checkpoints["llama"], device="cpu", chunk_size="auto", tbt_slo=0.2)
    with pytest.raises(ValueError, match="tbt_slo=None"):
        LLMEngine(tiny_checkpoints["llama"], device="cpu", chunk_size="auto", cost_model=profile)
    with pytest.raises(ValueError, match="missing.json. not found"):
        LLMEngine(tiny_checkpoints["llama"], device="cpu", chunk_size="auto", tbt_slo=0.2,
                  cost_model=tmp_path / "missing.json")


def test_kv_pool_is_sized_from_a_memory_budget(tiny_checkpoints):
    engine = LLMEngine(tiny_checkpoints["llama"], block_size=16, kv_cache_memory=1 << 20, device="cpu")
    # 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB per block
    assert engine.scheduler_config.num_blocks == (1 << 20) // 8192
    assert tuple(engine.runner.kv_cache.shape) == (2, 128, 2, 16, 2, 16)


def test_a_kv_pool_larger_than_the_free_memory_is_refused_naming_the_option(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    # 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB per block: 10**12 blocks need 7.3 PiB
    with pytest.raises(ValueError, match=r"num_kv_blocks=1000000000000 needs 7\.629e\+06 GiB for the KV pool "
                                         r"\(8192000000000000 bytes\), more than the [\d.]+ GiB free on cpu"):
        LLMEngine(path, device="cpu", num_kv_blocks=10**12)
    with pytest.raises(ValueError, match=r"kv_cache_memory=1152921504606846976 needs 1\.074e\+09 GiB"):
        LLMEngine(path, device="cpu", kv_cache_memory=2**60)


def test_stats_summary_and_pandas_frames(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], chunk_size=16, device="cpu")
    llm.generate([[5] * 30, [6] * 3], greedy(5), use_tqdm=False)
    stats = llm.stats()
    s = stats.summary()
    assert s["num_requests"] == 2 and s["output_tokens"] == 10
    assert s["ttft_p50"] <= s["ttft_p99"] and s["tbt_p50"] <= s["tbt_p99"]
    frames = stats.to_pandas()
    assert len(frames["requests"]) == 2 and len(frames["iterations"]) == s["num_iterations"]
    its = frames["iterations"]
    assert its["num_prefill_tokens"].sum() == 33 and its["num_decode_tokens"].sum() == 8


def protocol_problems(engine: type | object) -> list[str]:
    """What keeps ``engine`` (a class, or an instance for the data members too) from being an ``Engine``: not
    declaring it, a method left to the protocol's stub, a method that does not take the protocol's parameters (by
    name, kind and default; extra ones need a default), a data member an instance lacks."""
    cls = engine if isinstance(engine, type) else type(engine)
    problems = [] if Engine in cls.__mro__ else [f"{cls.__name__} does not declare Engine"]
    for name, stub in vars(Engine).items():
        if name.startswith("_") or not callable(stub):
            continue
        method = getattr(cls, name, None)
        if method is None or method is stub:
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        want, have = inspect.signature(stub).parameters, inspect.signature(method).parameters
        for p in want.values():
            if have.get(p.name) is None or (have[p.name].kind, have[p.name].default) != (p.kind, p.default):
                problems.append(f"{cls.__name__}.{name} does not take {p}")
        problems += [f"{cls.__name__}.{name} needs {p} the protocol does not give" for p in have.values()
                     if p.name not in want and p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                   p.KEYWORD_ONLY)]
    if not isinstance(engine, type):
        problems += [f"{cls.__name__} has no {name}" for name in Engine.__annotations__ if not hasattr(engine, name)]
    return problems


def test_the_protocol_check_finds_what_an_engine_lacks():
    class Partial(Engine):
        def add_request(self, request_id, prompt, params=None):  # no arrival_time
            return None

        def step(self, budget):  # needs an argument the protocol does not give
            return []

    problems = protocol_problems(Partial)
    assert "Partial.add_request does not take arrival_time: 'float | None' = None" in problems
    assert "Partial.step needs budget the protocol does not give" in problems
    assert "Partial.abort_request is missing" in problems and "Partial.shutdown is missing" in problems
    assert protocol_problems(Partial()) == [*problems, *(f"Partial has no {n}" for n in Engine.__annotations__)]
    assert protocol_problems(SimpleNamespace) == ["SimpleNamespace does not declare Engine"] + [
        f"SimpleNamespace.{n} is missing" for n in ("add_request", "step", "abort_request", "has_unfinished_requests",
                                                     "get_num_unfinished_requests", "reset_prefix_cache", "stats",
                                                     "shutdown")]


def test_every_engine_declares_the_engine_protocol_and_runs_through_it(tiny_checkpoints):
    """LLMEngine, DisaggregatedEngine and ProcessEngine each declare ``Engine``, implement every member, and give
    the same greedy tokens when driven through the protocol alone."""
    options = dict(chunk_size=16, block_size=4, num_kv_blocks=64, device="cpu")
    path = tiny_checkpoints["llama"]
    outputs = {}
    for make in (lambda: LLMEngine(path, **options), lambda: DisaggregatedEngine(path, instances="1P1D", **options),
                 lambda: ProcessEngine(path, instances="1P1D", **options)):
        engine: Engine = make()
        try:
            assert isinstance(engine, Engine) and protocol_problems(engine) == []
            assert engine.model_path == path and engine.scheduler_config.max_model_len > 0
            engine.add_request("a", [5, 6, 7, 8, 9], greedy(4))
            engine.add_request("b", [9, 8, 7], greedy(4))
            engine.abort_request("b")
            done = {}
            for _ in range(100):
                if not engine.has_unfinished_requests():
                    break
                done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
            assert engine.get_num_unfinished_requests() == 0 and engine.stats().summary()["num_requests"] == 1
            outputs[type(engine).__name__] = done
        finally:
            engine.shutdown()
    assert len(outputs["LLMEngine"]["a"]) == 4
    assert outputs["DisaggregatedEngine"] == outputs["ProcessEngine"] == outputs["LLMEngine"]
