"""One decision in every host, checked against real vLLM runs replayed step by step on our own scheduler:

- the simulator's ``vllm_v1`` policy is vLLM's own rule (the plugin with ``policy="vllm_v1"`` changes nothing and
  logs each step): it schedules the same token counts;
- the ``sarathi`` policy (head-of-line protection on) decides the same steps inside vLLM (the plugin) and in our
  scheduler: the same token counts in at least 99% of steps."""

from __future__ import annotations

import json
import random

import pytest
from vllm import SamplingParams

from sarathi_lite.scheduler import Request, SchedulerConfig, make_scheduler
from tests.conftest import make_tiny_checkpoint

from .conftest import close, make_llm, scheduler_of


@pytest.fixture(scope="module")
def vllm_rule(tiny_model):
    llm = make_llm(tiny_model, skip_tokenizer_init=True, max_num_batched_tokens=128, long_prefill_token_threshold=48,
                   block_size=32, plugin={"policy": "vllm_v1"})
    yield llm
    close(llm)


def _drive(llm, seed: int, pending: list[tuple[str, int, int]] | None = None) -> list[dict]:
    """Requests arrive while others run (0-2 per step; ``pending``: (id, prompt length, max tokens) in order, by
    default 40 of random lengths); returns the step log of the run."""
    rng = random.Random(seed)
    engine = llm.llm_engine
    sched = scheduler_of(llm)
    before = len(sched.step_log)
    if pending is None:
        pending = [(f"q{i}", rng.randint(1, 300), rng.randint(1, 30)) for i in range(40)]
    pending = list(pending)
    for _ in range(2000):
        for _ in range(rng.randint(0, 2)):
            if pending:
                name, n, m = pending.pop(0)
                prompt = {"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]}
                engine.add_request(name, prompt, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True,
                                                                detokenize=False))
        if not pending and not engine.has_unfinished_requests():
            break
        engine.step()
    return list(sched.step_log)[before:]


def _replay(steps: list[dict], config: SchedulerConfig) -> list[dict[str, int]]:
    """Our ``vllm_v1`` scheduler on the same arrivals: the token counts of each step."""
    sched = make_scheduler(config)
    counts = []
    for step in steps:
        for rid, (prompt_len, max_tokens) in step["new"].items():
            sched.add(Request(rid, [5] * prompt_len, max_tokens=max_tokens))
        out = sched.schedule()
        counts.append({s.request_id: s.num_new_tokens for s in out.scheduled})
        sched.update(out, {s.request_id: 7 for s in out.scheduled if s.sample})
    return counts


def test_vllm_v1_policy_reproduces_the_real_vllm_schedulers_token_counts(vllm_rule):
    vllm_sched = scheduler_of(vllm_rule)
    config = SchedulerConfig(policy="vllm_v1", chunk_size=128, max_num_batched_tokens=128, max_num_seqs=16,
                             block_size=32, num_blocks=vllm_sched.kv_cache_config.num_blocks, max_model_len=1024,
                             long_prefill_token_threshold=48, enable_prefix_caching=False, watermark=0.0)
    steps = [s for s in _drive(vllm_rule, 0) if s["scheduled"] or s["new"]]
    ours = _replay(steps, config)
    same = sum(a == s["scheduled"] for a, s in zip(ours, steps))
    print(f"vllm_v1 replay: {same} of {len(steps)} steps with the same token counts")
    assert len(steps) > 50
    assert same >= 0.99 * len(steps), [(s["step"], a, s["scheduled"]) for a, s in zip(ours, steps)
                                       if a != s["scheduled"]][:5]
    # the cap is vLLM's: a long prompt among others never took more than 48 tokens in a step
    assert any(48 in s["scheduled"].values() for s in steps)


@pytest.fixture(scope="module")
def sarathi_rule(tmp_path_factory):
    # prompts of 1,400 tokens: the tiny Llama with 2,048 positions
    model = make_tiny_checkpoint("llama_hd64", tmp_path_factory.mktemp("tiny2k") / "llama_hd64")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    llm = make_llm(model, skip_tokenizer_init=True, max_model_len=2048, max_num_batched_tokens=256,
                   block_size=32, enable_prefix_caching=False, plugin={"chunk_size": 128})
    yield llm
    close(llm)


def test_sarathi_decides_the_same_steps_inside_vllm_and_in_our_scheduler(sarathi_rule):
    """48 prompts of 8-900 tokens and four of 1,400 (long: above 4 x 128), arriving while others run, through the
    plugin inside vLLM and replayed on our scheduler with the same limits: the same tokens in >= 99% of steps."""
    vllm_sched = scheduler_of(sarathi_rule)
    rng = random.Random(7)
    pending = [(f"s{i}", rng.randint(8, 900), rng.randint(4, 40)) for i in range(48)]
    for i, at in enumerate((5, 17, 30, 41)):
        pending.insert(at, (f"long{i}", 1400, rng.randint(4, 40)))
    steps = [s for s in _drive(sarathi_rule, 1, pending) if s["scheduled"] or s["new"]]
    config = SchedulerConfig(policy="sarathi", chunk_size=128, max_num_batched_tokens=256, max_num_seqs=16,
                             block_size=32, num_blocks=vllm_sched.kv_cache_config.num_blocks, max_model_len=2048,
                             enable_prefix_caching=False, watermark=0.0)
    assert vllm_sched.options.config.long_threshold == config.long_threshold == 512
    ours = _replay(steps, config)
    differ = [(s["step"], a, s["scheduled"]) for a, s in zip(ours, steps) if a != s["scheduled"]]
    print(f"sarathi replay: {len(steps) - len(differ)} of {len(steps)} steps with the same token counts")
    assert len(steps) > 100 and any(s["held"] for s in steps), "the stream never exercised a held step"
    assert len(differ) <= 0.01 * len(steps), differ[:5]
