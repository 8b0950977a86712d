"""sarathi-lite's decision inside Hugging Face transformers' continuous batching (the installed release, its own
cache, requests and outputs): the same greedy tokens as transformers' "fifo" scheduler, and each claim of the host
read from its step log (what transformers really scheduled)."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING

from sarathi_lite.costs import ProfiledCostModel
from sarathi_lite.integrations.transformers import (
    SUPPORTED_TRANSFORMERS_VERSIONS,
    SarathiScheduler,
    check_transformers_version,
    register,
)

from .step_log import decodes_first_steps

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [300, 20, 150, 5, 90, 420, 12, 64]
NEW_TOKENS = 12
TIMEOUT = 300.0  # seconds a run may take before the test fails instead of hanging


def _prompts(seed: int, vocab: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _greedy(max_new_tokens: int = NEW_TOKENS) -> GenerationConfig:
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=0)


def _config(scheduler: str, **options) -> ContinuousBatchingConfig:
    """A small paged cache: 40 pages of 16 tokens (640 tokens for LENGTHS' 1,061 prompt tokens) filled by prompts
    to the last page (no safety margin), so running requests run out of pages and are evicted and recomputed; 64
    tokens a step; no prefix sharing (steps are then exactly what the plan gives)."""
    base = dict(page_size=16, num_blocks=40, max_batch_tokens=64, allow_block_sharing=False, max_requests_per_batch=16,
                safety_margin=0.0)
    return ContinuousBatchingConfig(scheduler_type=scheduler, **{**base, **options})


def _load(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def _results(manager, ids: list[str]) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    deadline = time.monotonic() + TIMEOUT
    while len(done) < len(ids):
        assert time.monotonic() < deadline, f"only {sorted(done)} of {ids} finished"
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            assert out.error is None, out.error
            done[out.request_id] = list(out.generated_tokens)
    return done


def generate(model, prompts: list[list[int]], config: ContinuousBatchingConfig, max_new_tokens: int = NEW_TOKENS
             ) -> tuple[list[list[int]], object]:
    """Greedy tokens of ``prompts`` (in order) through transformers' continuous batching, and its scheduler."""
    with model.continuous_batching_context_manager(generation_config=_greedy(max_new_tokens),
                                                   continuous_batching_config=config, timeout=30) as manager:
        ids = manager.add_requests(inputs=prompts, max_new_tokens=max_new_tokens)
        done = _results(manager, ids)
        scheduler = manager.batch_processor.scheduler
    return [done[i] for i in ids], scheduler


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    return {kind: _load(tiny_checkpoints[kind]) for kind in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def fifo_tokens(models):
    """transformers' own "fifo" scheduler's greedy tokens for LENGTHS, per model, on the same small cache."""
    return {kind: generate(model, _prompts(0, 320, LENGTHS), _config("fifo"))[0] for kind, model in models.items()}


@pytest.fixture(scope="module")
def cost_model(tmp_path_factory) -> str:
    """A step-time model that grows with a step's tokens: 10 ms, 16 ms at 64 tokens, 60 ms at 512."""
    path = tmp_path_factory.mktemp("cost") / "profile.json"
    return str(ProfiledCostModel([1, 64, 512], [0.010, 0.016, 0.060]).save(path))


def test_importing_registers_sarathi_in_transformers_scheduler_mapping():
    assert issubclass(SCHEDULER_MAPPING["sarathi"], SarathiScheduler)
    assert "fifo" in SCHEDULER_MAPPING and "prefill_first" in SCHEDULER_MAPPING  # transformers' own are kept


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("options", [{"chunk_size": 32}, {"chunk_size": "auto", "tbt_slo": 0.03, "min_chunk_size": 16}],
                         ids=["fixed", "auto"])
def test_greedy_tokens_equal_fifo_with_chunked_prompts_and_evictions(models, fifo_tokens, cost_model, kind, options):
    if options["chunk_size"] == "auto":
        options = {**options, "cost_model": cost_model}
    name = register(f"sarathi-test-{kind}-{options['chunk_size']}", **options)
    tokens, scheduler = generate(models[kind], _prompts(0, 320, LENGTHS), _config(name))
    assert tokens == fifo_tokens[kind]
    steps = list(scheduler.step_log)
    assert any(step["starved"] for step in steps), "the small cache evicted nothing"
    chunked = {rid for step in steps for rid, n in step["scheduled"].items()
               if rid not in step["decodes"] and n < step["new"].get(rid, [n + 1])[0]}
    assert chunked, "no prompt was split over steps"
    assert decodes_first_steps(steps, "starved"), "no step mixed decodes with prefill tokens"
    assert max(sum(s["scheduled"].values()) for s in steps) <= 64


@pytest.mark.parametrize("policy", ["simple_chunking", "vllm", "orca", "request_level"])
def test_every_policy_runs_in_transformers_with_fifos_greedy_tokens_and_its_own_steps(models, fifo_tokens, policy):
    """Each of our policies decides transformers' steps: the greedy tokens are fifo's and each step has the
    policy's shape (the unchunked policies on a step budget of the model's whole context, 1,024 tokens, as they
    need; a cache with room for every prompt, so no prompt is evicted and prefilled again)."""
    chunked = policy == "simple_chunking"
    name = register(f"sarathi-test-{policy}", policy=policy, **({"chunk_size": 32} if chunked else {}))
    config = _config(name, num_blocks=128, **({} if chunked else {"max_batch_tokens": 1024}))
    tokens, scheduler = generate(models["llama"], _prompts(0, 320, LENGTHS), config)
    assert tokens == fifo_tokens["llama"]
    steps = list(scheduler.step_log)
    assert not any(s["starved"] for s in steps)
    prompt = {rid: new[0] for s in steps for rid, new in s["new"].items()}
    prefills = [{rid: n for rid, n in s["scheduled"].items() if rid not in s["decodes"]} for s in steps]
    mixed = [s for s, p in zip(steps, prefills) if p and len(p) < len(s["scheduled"])]
    if policy in ("simple_chunking", "vllm", "request_level"):  # prefill and decodes never share a step
        assert not mixed, mixed[0]
    else:
        assert mixed, "orca never batched a prompt with decodes"
    if chunked:
        assert any(n < prompt[rid] for p in prefills for rid, n in p.items()), "no prompt was split over steps"
    else:  # whole prompts, each in one step
        assert all(n == prompt[rid] for p in prefills for rid, n in p.items()), prefills
    if policy == "request_level":  # a new batch only once the last has finished
        admitted = [i for i, p in enumerate(prefills) if p]
        assert len(admitted) > 1 and all(not steps[i]["decodes"] for i in admitted), admitted


def test_each_step_is_what_the_plan_said_where_the_cache_does_not_run_out(models):
    name = register("sarathi-test-plan", chunk_size=48)
    _, scheduler = generate(models["llama"], _prompts(1, 320, LENGTHS), _config(name, num_blocks=128))
    steps = list(scheduler.step_log)
    assert not any(s["starved"] for s in steps)
    for step in steps:
        assert step["scheduled"] == step["planned"], step
        assert sum(step["scheduled"].values()) <= step["token_budget"] <= 48


def _wait_for(scheduler, condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}: {list(scheduler.step_log)[-3:]}"
        time.sleep(0.005)


def test_short_prompt_arriving_during_long_prefill_is_scheduled_within_one_step(models):
    """Chunk 64: a prompt is long above 256 tokens. A 12-token prompt sent while a 900-token prompt is mid-prefill
    gets its whole prompt in the first step that sees it (transformers' "fifo" makes it wait for the whole long
    prefill)."""
    name = register("sarathi-test-hol", chunk_size=64)
    long_prompt, short_prompt = _prompts(2, 320, [900, 12])
    config = _config(name, num_blocks=128)
    with models["llama"].continuous_batching_context_manager(generation_config=_greedy(4),
                                                             continuous_batching_config=config, timeout=30) as manager:
        manager.add_request(long_prompt, request_id="long", max_new_tokens=4)
        scheduler = manager.batch_processor.scheduler
        _wait_for(scheduler, lambda: len(scheduler.step_log) >= 2, "the long prompt's second chunk")
        manager.add_request(short_prompt, request_id="short", max_new_tokens=4)
        _results(manager, ["long", "short"])
    steps = list(scheduler.step_log)
    first = next(s for s in steps if "short" in s["new"])
    assert first["scheduled"].get("short") == 12, first
    assert "long" not in first["decodes"]  # still mid-prefill
    # held out of this step, or given what the plan said (under its cap, where the plan set one)
    assert "long" in first["held"] or first["scheduled"]["long"] == first["planned"]["long"] > 0, first
    if first["long_cap"] is not None:
        assert first["scheduled"]["long"] <= first["long_cap"], first


def test_auto_keeps_each_predicted_step_within_its_target(models, cost_model):
    name = register("sarathi-test-auto", chunk_size="auto", tbt_slo=0.03, cost_model=cost_model, min_chunk_size=16)
    _, scheduler = generate(models["llama"], _prompts(3, 320, LENGTHS), _config(name, num_blocks=128))
    budget = scheduler.token_budget
    min_prefill = budget.min_prefill
    planned = [s for s in scheduler.step_log if s["predicted"] is not None and s["planned"]]
    assert planned
    for step in planned:
        prefill = sum(n for rid, n in step["planned"].items() if rid not in step["decodes"])
        # over the target the step was sized by only where the minimum chunk was granted
        assert step["predicted"] <= step["budget"]["target"] * (1 + 1e-9) or prefill <= min_prefill, step
    assert any(s["measured"] for s in planned)  # the loop's period was timed
    assert budget.correction != 1.0  # and fed back to the budget


def test_cancellation_mid_prefill_and_mid_decode_frees_the_cache_and_keeps_the_rest(models, fifo_tokens):
    """A long prompt is cancelled mid-prefill and a short one mid-decode, inside transformers' pause (so the
    states seen are the states cancelled); the third request still gets fifo's tokens and every page comes back."""
    name = register("sarathi-test-cancel", chunk_size=32)
    long_prompt, short_prompt, kept_prompt = _prompts(0, 320, LENGTHS)[:3]
    config = _config(name, num_blocks=128)
    with models["llama"].continuous_batching_context_manager(generation_config=_greedy(200),
                                                             continuous_batching_config=config, timeout=30) as manager:
        scheduler = manager.batch_processor.scheduler
        free_before = scheduler.cache.compute_free_capacity()
        manager.add_request(long_prompt + long_prompt, request_id="prefilling", max_new_tokens=200)
        manager.add_request(short_prompt, request_id="decoding", max_new_tokens=200)
        seen = {}
        deadline = time.monotonic() + TIMEOUT
        while not seen:
            assert time.monotonic() < deadline
            with manager.pause():
                states = scheduler.active_requests
                long, short = states.get("prefilling"), states.get("decoding")
                if long is not None and short is not None and long.remaining_prefill_tokens and \
                        short.generated_tokens:
                    seen = {"prefilling": long.position_offset, "decoding": len(short.generated_tokens)}
                    manager.cancel_request("prefilling")
                    manager.cancel_request("decoding")
            time.sleep(0.01)
        manager.add_request(kept_prompt, request_id="kept", max_new_tokens=NEW_TOKENS)
        kept = _results(manager, ["kept"])["kept"]
        assert not scheduler.active_requests and not scheduler.waiting_requests
        assert scheduler.cache.compute_free_capacity() == free_before == 1.0
    assert 0 < seen["prefilling"] < 2 * len(long_prompt) and 0 < seen["decoding"] < 200
    assert kept == fifo_tokens["llama"][2]


def test_smollm2_greedy_tokens_equal_fifo():
    from sarathi_lite.models import builtin

    path = builtin.resolve_model("smollm2-135m")
    model = _load(path)
    prompts = _prompts(5, 49152, [700, 24, 160, 9])
    config = dict(page_size=32, num_blocks=64, max_batch_tokens=128, allow_block_sharing=False)
    fifo, _ = generate(model, prompts, ContinuousBatchingConfig(scheduler_type="fifo", **config), 16)
    name = register("sarathi-test-smollm2", chunk_size=64)
    ours, scheduler = generate(model, prompts, ContinuousBatchingConfig(scheduler_type=name, **config), 16)
    assert ours == fifo
    assert decodes_first_steps(list(scheduler.step_log), "starved")


def test_bad_options_are_refused_naming_the_value(models, cost_model):
    for options, message in (({"chunk_size": "big"}, "chunk_size='big'"), ({"chunk_size": "auto"}, "cost_model"),
                             ({"chunk_sise": 64}, "'chunk_sise'"), ({"policy": "fifo"}, "policy='fifo'"),
                             ({"hol_protection": "yes"}, "hol_protection"),
                             ({"chunk_size": "auto", "cost_model": cost_model}, "tbt_slo=None"),
                             ({"chunk_size": "auto", "tbt_slo": 0.1, "cost_model": "nowhere.json"}, "nowhere.json")):
        with pytest.raises(ValueError, match=message):
            register("sarathi-bad", **options)
    with pytest.raises(ValueError, match="'fifo'"):
        register("fifo")
    assert "sarathi-bad" not in SCHEDULER_MAPPING
    # what depends on the cache is refused when transformers builds the scheduler, before any step
    name = register("sarathi-too-big", chunk_size=512)
    with pytest.raises(ValueError, match="chunk_size=512 is larger than transformers' max_batch_tokens=64"):
        models["llama"].generate_batch(_prompts(0, 320, [8]), generation_config=_greedy(2),
                                       continuous_batching_config=_config(name))


def test_auto_is_refused_under_tensor_parallelism_where_ranks_would_time_steps_apart(models, cost_model,
                                                                                     monkeypatch):
    name = register("sarathi-test-tp", chunk_size="auto", tbt_slo=0.1, cost_model=cost_model)
    manager = models["llama"].init_continuous_batching(generation_config=_greedy(2), continuous_batching_config=_config(
        "fifo"))
    manager.warmup()  # builds transformers' cache (and its own scheduler)
    cache = manager.batch_processor.cache
    SCHEDULER_MAPPING[name](cache, None, 16)  # one process: accepted
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="tensor-parallel ranks"):
        SCHEDULER_MAPPING[name](cache, None, 16)
    manager.destroy()


def test_unsupported_transformers_versions_are_refused_naming_both():
    check_transformers_version(SUPPORTED_TRANSFORMERS_VERSIONS[-1])
    with pytest.raises(RuntimeError, match=r"5\.25\.0.*'5\.22\.2'"):
        check_transformers_version("5.22.2")
    code = ("import transformers; transformers.__version__ = '5.26.0.dev0'\n"
            "import sarathi_lite.integrations.transformers\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "not '5.26.0.dev0'" in run.stderr


def test_a_registered_name_registers_its_scheduler_where_it_is_unpickled():
    name = register("sarathi-pickled", chunk_size=24, hol_protection=False)
    code = ("import pickle, sys\n"
            "from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING\n"
            "name = pickle.loads(sys.stdin.buffer.read())\n"
            "print(name, dict(SCHEDULER_MAPPING[name].raw_options))\n")
    run = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(name), capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr.decode()
    assert run.stdout.decode().strip() == "sarathi-pickled {'chunk_size': 24, 'hol_protection': False}"
