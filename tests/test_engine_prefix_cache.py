"""Prefix caching in the engine: greedy outputs are the same, token for token, with the cache on and off (and
match Hugging Face), across chunk sizes that cut blocks mid-way, block sizes, eviction, preemption and aborts;
and the cache-hit path never writes into KV blocks that another request reads."""

from __future__ import annotations

import random

import pytest
import torch

from sarathi_lite import LLMEngine, SamplingParams

from .parity import assert_matches_hf

VOCAB = 320


def shared_prefix_workload(seed: int, n: int = 12) -> list[tuple[list[int], int]]:
    """``n`` (prompt, max_tokens): each prompt is one of three shared starts (a "system prompt", a longer one
    extending it, none) plus, now and then, an earlier prompt of the list resent as a previous turn, then a few
    tokens of its own."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(37)]
    starts = [system, system + [rng.randrange(3, VOCAB) for _ in range(20)], []]
    work: list[tuple[list[int], int]] = []
    for _ in range(n):
        if work and rng.random() < 0.3:
            prompt = list(rng.choice(work)[0])
        else:
            prompt = list(rng.choice(starts))
        prompt += [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))]
        work.append((prompt, rng.randint(1, 12)))
    return work


def make_engine(path, caching: bool, **options) -> LLMEngine:
    cfg = dict(scheduler="sarathi", chunk_size=13, block_size=16, num_kv_blocks=64, device="cpu",
               attention_backend="torch", enable_prefix_caching=caching)
    cfg.update(options)
    return LLMEngine(path, **cfg)


def run(engine: LLMEngine, work, waves: int = 4, aborts: dict[int, list[str]] | None = None) -> dict[str, tuple]:
    """Add ``work`` in waves a few steps apart (so later prompts find earlier ones cached) and run it all;
    ``aborts``: step index -> request ids to abort before that step. Returns id -> (tokens, logprobs)."""
    results: dict[str, tuple] = {}
    per_wave = -(-len(work) // waves)
    pending = list(enumerate(work))
    step = 0
    aborts = aborts or {}
    while pending or engine.has_unfinished_requests():
        if step % 4 == 0:
            for i, (prompt, n) in pending[:per_wave]:
                engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                                   logprobs=0))
            del pending[:per_wave]
        for rid in aborts.get(step, ()):
            if rid in engine.scheduler.requests:
                engine.abort_request(rid)
        for o in engine.step() if engine.has_unfinished_requests() else ():
            if o.finished:
                results[o.request_id] = (o.token_ids, [lp for lp, _ in o.logprobs])
        step += 1
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler_config.num_blocks, "pool not whole"
    return results


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("chunk_size", [5, 13])
def test_greedy_outputs_are_identical_with_prefix_caching_on_and_off_and_match_hf(
        tiny_checkpoints, hf_reference, chunk_size, block_size):
    path = tiny_checkpoints["llama"]
    work = shared_prefix_workload(seed=3)
    off = run(make_engine(path, False, chunk_size=chunk_size, block_size=block_size, num_kv_blocks=1024), work)
    # A pool just big enough for the longest request: cached prefixes are evicted, running requests preempted.
    need = max(-(-(len(p) + n) // block_size) for p, n in work)
    engine = make_engine(path, True, chunk_size=chunk_size, block_size=block_size, num_kv_blocks=need + 1)
    on = run(engine, work)
    assert {rid: t for rid, (t, _) in on.items()} == {rid: t for rid, (t, _) in off.items()}
    summary = engine.stats().summary()
    assert summary["cached_prompt_tokens"] > 0 and summary["num_preemptions"] > 0
    ref = hf_reference("llama")
    for i, (prompt, n) in enumerate(work):
        tokens, logprobs = on[f"r{i}"]
        assert_matches_hf(ref, prompt, tokens, logprobs, n)


def test_aborts_in_every_state_leave_the_others_outputs_unchanged(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    work = shared_prefix_workload(seed=4)
    off = run(make_engine(path, False, chunk_size=5, block_size=3, num_kv_blocks=1024), work)
    engine = make_engine(path, True, chunk_size=5, block_size=3, num_kv_blocks=60)
    seen: dict[str, set[str]] = {"waiting": set(), "prefill": set(), "decode": set()}
    original_step = engine.step

    def step():  # abort one request of each state along the way, noting which state it was in
        sched = engine.scheduler
        for state, pick in (("waiting", list(sched.waiting)), ("prefill", [r for r in sched.running if r.is_prefill]),
                            ("decode", [r for r in sched.running if not r.is_prefill])):
            if pick and not seen[state] and len(sched.requests) > 2:
                seen[state].add(pick[-1].request_id)
                engine.abort_request(pick[-1].request_id)
        return original_step()

    engine.step = step
    on = run(engine, work)
    aborted = set().union(*seen.values())
    assert all(seen.values()), seen
    assert set(on) == set(off) - aborted
    assert {rid: on[rid][0] for rid in on} == {rid: off[rid][0] for rid in on}


def test_two_requests_with_one_prefix_in_one_iteration_and_a_third_that_hits(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    rng = random.Random(0)
    prefix = [rng.randrange(3, VOCAB) for _ in range(40)]
    prompts = {"a": prefix + [5, 6], "b": prefix + [7], "c": prefix + [8, 9, 10]}
    outs = {}
    for caching in (False, True):
        engine = make_engine(path, caching, chunk_size=256, block_size=8)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        engine.add_request("a", prompts["a"], params)
        engine.add_request("b", prompts["b"], params)
        first = engine.step()
        assert {o.request_id for o in first} == {"a", "b"}  # both prefilled in the same iteration
        engine.add_request("c", prompts["c"], params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        done.update({o.request_id: o for o in first if o.finished})
        outs[caching] = {rid: o.token_ids for rid, o in done.items()}
        cached = {rid: o.metrics.num_cached_tokens for rid, o in done.items()}
        assert cached == ({"a": 0, "b": 0, "c": 40} if caching else {"a": 0, "b": 0, "c": 0})
    assert outs[True] == outs[False]


def gather_kv(engine: LLMEngine, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """K/V of token positions ``0 .. num_tokens - 1`` through ``block_ids``: ``[num_tokens, layers, 2, heads,
    head_dim]``."""
    bs = engine.config.block_size
    blocks = torch.tensor([block_ids[p // bs] for p in range(num_tokens)])
    slots = torch.tensor([p % bs for p in range(num_tokens)])
    return engine.runner.kv_cache[:, blocks, :, slots].clone()


def test_the_cache_hit_path_never_writes_into_blocks_others_read_and_matches_a_cold_run(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    rng = random.Random(1)
    prefix = [rng.randrange(3, VOCAB) for _ in range(45)]  # 5 full blocks of 8 and 5 tokens more
    prompts = {"a": prefix + [11, 12, 13], "b": prefix + [21], "c": prefix[:43] + [31, 32], "d": prefix + [41] * 9}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = make_engine(path, True, chunk_size=7, block_size=8)
    engine.add_request("a", prompts["a"], params)
    while engine.scheduler.requests["a"].is_prefill:
        engine.step()
    shared = engine.scheduler.requests["a"].block_ids[:6]
    before = engine.runner.kv_cache[:, shared].clone()
    # b, c and d resume at a cached prefix (c one block short of it) while a decodes beside them.
    for rid in "bcd":
        engine.add_request(rid, prompts[rid], params)
    snapshots = {}
    while engine.has_unfinished_requests():
        engine.step()
        assert torch.equal(engine.runner.kv_cache[:, shared], before), "a hit wrote into a shared block"
        for rid in "bcd":
            req = engine.scheduler.requests.get(rid)
            if req is not None and not req.is_prefill and rid not in snapshots:
                assert req.block_ids[:5] == shared[:5]
                snapshots[rid] = gather_kv(engine, req.block_ids, len(prompts[rid]))
    cached = {rid: m.num_cached_tokens for rid, m in engine.metrics.requests.items()}
    assert cached == {"a": 0, "b": 40, "c": 40, "d": 40}
    for rid in "bcd":
        cold = make_engine(path, False, chunk_size=7, block_size=8)
        cold.add_request(rid, prompts[rid], params)
        while cold.scheduler.requests[rid].is_prefill:
            cold.step()
        expected = gather_kv(cold, cold.scheduler.requests[rid].block_ids, len(prompts[rid]))
        torch.testing.assert_close(snapshots[rid], expected, rtol=1e-5, atol=1e-5)


def test_engine_option_cli_flag_and_reset(tiny_checkpoints):
    from sarathi_lite.cli import build_parser
    from sarathi_lite.cli.common import engine_config

    assert engine_config(build_parser().parse_args(["generate"])).enable_prefix_caching is True
    assert engine_config(build_parser().parse_args(["generate", "--no-enable-prefix-caching"])
                         ).enable_prefix_caching is False
    engine = make_engine(tiny_checkpoints["llama"], True, block_size=4)
    engine.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() == 5
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        make_engine(tiny_checkpoints["llama"], "yes")
