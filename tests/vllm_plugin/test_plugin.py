"""sarathi-lite's scheduler inside the real vLLM (CPU build): same greedy tokens as vLLM's own scheduler, and each
claim of the plugin read from its own step log (what vLLM really scheduled)."""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams

from sarathi_lite.costs import ProfiledCostModel
from sarathi_lite.integrations.vllm import SarathiScheduler, check_vllm_version, parse_options

from ..step_log import decodes_first_steps
from .conftest import close, make_llm, scheduler_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)


def _prompts(seed: int, vocab: int, lengths: list[int], shared: int = 0) -> list[dict]:
    """Token-id prompts of ``lengths``; the first ``shared`` tokens are common to all (a prefix-cache hit)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared)]
    return [{"prompt_token_ids": prefix + [rng.randrange(3, vocab) for _ in range(n - shared)]} for n in lengths]


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


LENGTHS = [300, 20, 150, 5, 90, 420, 12, 64]
HELD = _prompts(4, 49152, [400, 40])  # a long prompt, and a short one that arrives during its prefill


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_model):
    """vLLM's own scheduler's greedy tokens: ``(LENGTHS prompts, their tokens, HELD's tokens)``."""
    llm = make_llm(smollm2_model)
    prompts = _prompts(0, 49152, LENGTHS, shared=48)
    yield prompts, _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)), _tokens(
        llm.generate(HELD, GREEDY, use_tqdm=False))
    close(llm)


@pytest.fixture(scope="module")
def smollm2_plugin(smollm2_model):
    llm = make_llm(smollm2_model, plugin={"chunk_size": 64})
    yield llm
    close(llm)


@pytest.fixture(scope="module")
def tiny_reference(tiny_model):
    llm = make_llm(tiny_model, skip_tokenizer_init=True)
    yield llm
    close(llm)


@pytest.fixture(scope="module")
def tiny_plugin(tiny_model, tmp_path_factory):
    """The plugin with the SLO-aware budget on a KV pool small enough to preempt (16 blocks of 32 tokens), and
    vLLM's long-prefill cap set."""
    # a step-time model that grows with the tokens of a step: 10 ms, 16 ms at 64 tokens, 60 ms at 512
    profile = ProfiledCostModel([1, 64, 512], [0.010, 0.016, 0.060]).save(tmp_path_factory.mktemp("cost") / "p.json")
    llm = make_llm(tiny_model, skip_tokenizer_init=True, num_gpu_blocks_override=16, block_size=32, max_model_len=480,
                   long_prefill_token_threshold=96,
                   plugin={"chunk_size": "auto", "tbt_slo": 0.03, "cost_model": str(profile), "min_chunk_size": 16})
    yield llm
    close(llm)


def _steps(llm, since: int = 0) -> list[dict]:
    return list(scheduler_of(llm).step_log)[since:]


def test_plugin_is_the_engines_scheduler(smollm2_plugin):
    assert isinstance(scheduler_of(smollm2_plugin), SarathiScheduler)


def test_smollm2_greedy_tokens_equal_vllm_default_scheduler(smollm2_reference, smollm2_plugin):
    prompts, reference, _ = smollm2_reference
    before = len(scheduler_of(smollm2_plugin).step_log)
    assert _tokens(smollm2_plugin.generate(prompts, GREEDY, use_tqdm=False)) == reference
    steps = _steps(smollm2_plugin, before)
    assert max(sum(s["scheduled"].values()) for s in steps) <= 64  # the chunk size, not vLLM's 256
    assert any(len(s["scheduled"]) > 2 for s in steps)  # hybrid batches
    assert decodes_first_steps(steps, "preempted"), "no step mixed decodes with prefill tokens"


def test_fixed_budget_steps_are_what_the_plan_said(smollm2_reference, smollm2_plugin):
    prompts, _, _ = smollm2_reference
    before = len(scheduler_of(smollm2_plugin).step_log)
    smollm2_plugin.generate(prompts, GREEDY, use_tqdm=False)
    steps = _steps(smollm2_plugin, before)
    # vLLM's own fill of the planned order and budget: the plan, except where the prefix cache shortened a prompt
    same = sum(s["scheduled"] == s["planned"] for s in steps)
    assert same >= 0.9 * len(steps), (same, len(steps))


def test_tiny_model_with_preemption_and_auto_budget_equals_default(tiny_reference, tiny_plugin):
    # vLLM reserves a prompt's blocks at admission, so preemption comes from decodes outgrowing the pool
    prompts = _prompts(1, 320, [200, 70, 130, 17, 90, 8, 75, 33, 150, 65])
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, detokenize=False)
    reference = _tokens(tiny_reference.generate(prompts, params, use_tqdm=False))
    before = len(scheduler_of(tiny_plugin).step_log)
    assert _tokens(tiny_plugin.generate(prompts, params, use_tqdm=False)) == reference
    steps = _steps(tiny_plugin, before)
    assert any(s["preempted"] for s in steps), "the small KV pool forced no preemption"
    assert decodes_first_steps(steps, "preempted"), "no step mixed decodes with prefill tokens"


def test_auto_keeps_each_predicted_step_within_its_target(tiny_plugin):
    sched = scheduler_of(tiny_plugin)
    budget = sched.budget
    min_prefill = budget.min_prefill  # min_chunk_size in whole grains
    planned = [s for s in sched.step_log if s["predicted"] is not None and s["planned"]]
    assert planned
    for step in planned:
        prefill = sum(n for rid, n in step["planned"].items() if rid not in step["decodes"])
        # over the target the step was sized by (its record's budget state) only when the floor was granted
        assert step["predicted"] <= step["budget"]["target"] * (1 + 1e-9) or prefill <= min_prefill, step
    assert any(s["measured"] for s in planned)
    assert any(s["gap"] for s in planned)  # the loop's period, what the step's decodes waited
    assert budget.correction != 1.0  # the measured step times fed the correction
    assert budget.percentile == 99.0 and budget.spread >= 1.0 and budget.between >= 0.0


def _run(engine, pending: set[str], limit: int = 400) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert not engine.has_unfinished_requests()
    return done


def test_short_prompt_arriving_during_long_prefill_is_admitted_within_one_step(tiny_plugin):
    engine = tiny_plugin.llm_engine
    sched = scheduler_of(tiny_plugin)
    long_prompt, short_prompt = _prompts(2, 320, [400, 12])
    engine.add_request("long", long_prompt, GREEDY)
    engine.step()  # at most max_num_batched_tokens (256) of its 400 tokens
    (long,) = [r for r in sched.running if r.num_computed_tokens < r.num_prompt_tokens]  # still prefilling
    long_left = long.num_prompt_tokens - long.num_computed_tokens
    engine.add_request("short", short_prompt, GREEDY)
    before = len(sched.step_log)
    engine.step()
    (step,) = _steps(tiny_plugin, before)
    short_tokens = [n for rid, n in step["scheduled"].items() if rid.startswith("short")]
    assert short_tokens == [12], step  # admitted, its whole prompt in this step
    # the step's budget is sized on measured step times: where both prompts' whole need fits it there is no cap
    # (it would only cut the short prompt); where the long prompt's share would cut the short one (a small step,
    # on a busy machine) the long prompt sits the step out; else it is held to what the short one leaves
    if step["held"]:
        assert step["held"] == [long.request_id] and long.request_id not in step["scheduled"], step
    elif long_left + 12 <= step["token_budget"]:
        assert step["long_cap"] is None and step["scheduled"][long.request_id] == long_left, step
    else:
        assert step["long_cap"] is not None and step["scheduled"][long.request_id] <= step["long_cap"], step
    _run(engine, {"long", "short"})


def test_a_short_prompt_the_cap_would_cut_finishes_in_one_step_with_the_long_prompt_held_out(smollm2_reference,
                                                                                               smollm2_plugin):
    """Chunk 64: a prompt is long above 256 tokens and keeps a share of 16 beside short ones. vLLM's one cap for
    every request would give a 40-token short prompt max(16, 64 - 40) = 24 tokens a step; instead the long prompt
    is held out of one step (skipped by vLLM's loop, still in its running list) and the short one finishes. The
    greedy tokens are still vLLM's own scheduler's."""
    engine = smollm2_plugin.llm_engine
    sched = scheduler_of(smollm2_plugin)
    long_prompt, short_prompt = HELD
    engine.add_request("long", long_prompt, GREEDY)
    engine.step()
    engine.add_request("short", short_prompt, GREEDY)
    before = len(sched.step_log)
    engine.step()
    engine.step()
    held, after = _steps(smollm2_plugin, before)
    long_id = next(rid for rid in held["held"])
    assert long_id.startswith("long") and long_id not in held["scheduled"]
    assert [n for rid, n in held["scheduled"].items() if rid.startswith("short")] == [40]  # its whole prompt
    assert any(r.request_id == long_id for r in sched.running)  # held, not removed
    assert after["held"] == [] and after["scheduled"][long_id] > 0  # never held two steps running
    done = _run(engine, {"long", "short"})
    assert [done["long"], done["short"]] == smollm2_reference[2]


def test_abort_mid_prefill_and_mid_decode_leaves_the_pool_whole(tiny_reference, tiny_plugin):
    engine = tiny_plugin.llm_engine
    sched = scheduler_of(tiny_plugin)
    pool = sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    prompts = _prompts(3, 320, [300, 30, 60])
    reference = _tokens(tiny_reference.generate(prompts, GREEDY, use_tqdm=False))
    for name, prompt in zip(("prefilling", "decoding", "kept"), prompts):
        engine.add_request(name, prompt, GREEDY)

    def states() -> tuple[bool, bool]:
        by_name = {r.request_id.split("-")[0]: r for r in sched.running}
        long, short = by_name.get("prefilling"), by_name.get("decoding")
        return (long is not None and 0 < long.num_computed_tokens < long.num_prompt_tokens,
                short is not None and short.num_output_tokens > 0)

    for _ in range(10):  # until the short prompt decodes (short prompts go first) while the long one prefills
        engine.step()
        if all(states()):
            break
    assert states() == (True, True)
    engine.abort_request(["prefilling", "decoding"])
    done = _run(engine, {"kept"})
    assert done["kept"] == reference[2]
    assert pool.get_num_free_blocks() == free_before


def test_bad_options_are_refused_naming_the_value():
    limits = dict(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=1024, block_size=16, num_blocks=64,
                  long_prefill_token_threshold=0, enable_prefix_caching=True)
    for options, message in (({"chunk_size": 512}, "chunk_size=512"), ({"chunk_size": "auto"}, "cost_model"),
                             ({"chunk_sise": 64}, "'chunk_sise'"), ({"policy": "edf"}, "'edf'"),
                             ({"hol_protection": "yes"}, "hol_protection"), ({"chunk_size": True}, "True"),
                             ({"tbt_slo": "0.1", "chunk_size": "auto", "cost_model": "roofline:h100"}, "'0.1'"),
                             ({"tbt_percentile": "p99", "chunk_size": "auto", "cost_model": "roofline:h100"},
                              "'p99'"),
                             ({"tbt_percentile": 100, "tbt_slo": 0.1, "chunk_size": "auto",
                               "cost_model": "roofline:h100"}, "tbt_percentile=100")):
        with pytest.raises(ValueError, match=message):
            parse_options({"sarathi_lite": options}, **limits)
    assert parse_options(None, **limits).config.chunk_size == 256
    auto = {"chunk_size": "auto", "tbt_slo": 0.1, "cost_model": "roofline:h100"}
    assert parse_options({"sarathi_lite": auto}, **limits).config.tbt_percentile == 99.0  # the plugin's default
    fixed_target = {**auto, "tbt_percentile": None}
    assert parse_options({"sarathi_lite": fixed_target}, **limits).config.tbt_percentile is None


def test_unsupported_vllm_versions_are_refused_naming_both():
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(RuntimeError, match=r"0\.32\.0.*'0\.31\.1'"):
        check_vllm_version("0.31.1")


def test_a_bad_option_stops_the_engine_before_it_serves(tiny_model):
    with pytest.raises(Exception, match="chunk_size=4096 is larger than vLLM's max_num_batched_tokens=256"):
        make_llm(tiny_model, skip_tokenizer_init=True, plugin={"chunk_size": 4096})
