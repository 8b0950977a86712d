"""Workloads with shared prompt structure (a system prompt, multi-turn chats) and the prefix cache seeing it the
same way in a real replay and in the simulator."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sarathi_lite.bench import replay as bench
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import ProfiledCostModel
from sarathi_lite.sim.simulator import simulate

from .test_sim_faithfulness import batches, scheduler_config


def test_each_turn_of_a_conversation_resends_the_previous_turn_and_every_prompt_starts_with_the_system_prompt():
    wl = Workload.conversations("conversation", num_conversations=3, turns=4, system_prompt=32, turn_gap=5.0,
                                prompt_scale=0.05, output_scale=0.1, seed=2)
    plain = Workload.from_trace("conversation", num_requests=12, prompt_scale=0.05, output_scale=0.1)
    assert len(wl) == 12
    prompts = dict(zip((r.request_id for r in wl.requests), wl.prompt_token_ids(1000)))
    system = prompts["conv-0-turn-1"][:32]
    assert all(p[:32] == system for p in prompts.values())
    by_id = {r.request_id: r for r in wl.requests}
    for c in range(3):
        first = by_id[f"conv-{c}-turn-1"]
        assert first.prompt_len == 32 + plain.requests[4 * c].prompt_len
        for k in range(2, 5):
            prev, turn = by_id[f"conv-{c}-turn-{k - 1}"], by_id[f"conv-{c}-turn-{k}"]
            assert turn.arrival_time - prev.arrival_time == pytest.approx(5.0)
            # the previous prompt, its reply's length of resent tokens, then this turn's message
            reply, message = prev.output_len, plain.requests[4 * c + k - 1].prompt_len
            assert prompts[turn.request_id][:prev.prompt_len] == prompts[prev.request_id]
            assert turn.prompt_len == prev.prompt_len + reply + message
    # Different conversations share only the system prompt.
    assert prompts["conv-0-turn-2"][32:40] != prompts["conv-1-turn-2"][32:40]


def test_a_system_prompt_is_prepended_to_the_same_prompts_and_survives_json():
    wl = Workload.synthetic("uniform:5-20:1-4", num_requests=6, seed=3)
    sys_wl = wl.with_system_prompt(16)
    before, after = wl.prompt_token_ids(500), sys_wl.prompt_token_ids(500)
    assert all(a == after[0][:16] + b for a, b in zip(after, before))
    again = Workload.from_dict(sys_wl.to_dict())
    assert again == sys_wl and again.prompt_token_ids(500) == after
    assert "segments" not in wl.to_dict()["requests"]  # plain workloads keep their JSON as it was
    with pytest.raises(ValueError, match="num_tokens"):
        wl.with_system_prompt(0)


def test_the_simulator_predicts_the_real_batches_and_cache_hits_of_a_conversation_workload(tiny_checkpoints):
    # All turns at once: timing cannot change any decision, so the simulator must make the real ones, hits
    # included (later turns hit the blocks earlier turns' chunks have filled).
    wl = Workload.conversations("conversation", num_conversations=3, turns=3, system_prompt=20, turn_gap=0.0,
                                prompt_scale=0.04, output_scale=0.05, seed=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        real = bench.run(wl, configs=[("sarathi", 16)], model=tiny_checkpoints["llama"], progress=False,
                         record_batches=True, block_size=4, num_kv_blocks=256, device="cpu")[0]
    finally:
        torch.set_num_threads(threads)
    sim = simulate(wl, ProfiledCostModel((1, 64), (0.01, 0.02)), scheduler_config(real), chunk_size=16,
                   record_batches=True)
    assert batches(sim) == batches(real)
    cached = {r.request_id: r.num_cached_tokens for r in real.stats.requests}
    assert cached == {r.request_id: r.num_cached_tokens for r in sim.stats.requests}
    assert sum(v > 0 for v in cached.values()) >= len(wl) // 2
    off = simulate(wl, ProfiledCostModel((1, 64), (0.01, 0.02)),
                   dataclasses.replace(scheduler_config(real), enable_prefix_caching=False), chunk_size=16)
    assert off.summary()["cached_prompt_tokens"] == 0
    assert sim.summary()["ttft_p50"] < off.summary()["ttft_p50"]
