"""Greedy outputs match Hugging Face transformers on the same weights, whatever the policy, chunk size, block
size, batch mix or preemption."""

from __future__ import annotations

import pytest
import torch

from sarathi_lite import LLMEngine
from sarathi_lite.kernels import flashinfer_available
from sarathi_lite.scheduler import POLICIES

from .parity import assert_matches_hf, run_staggered, workload


def check_run(engine: LLMEngine, ref, seed: int, **workload_options) -> dict[str, int]:
    work = workload(seed, **workload_options)
    results = run_staggered(engine, work)
    assert len(results) == len(work)
    verdicts = {"exact": 0, "near-tie": 0}
    for i, (prompt, n) in enumerate(work):
        got_prompt, tokens, logprobs = results[f"r{i}"]
        assert got_prompt == prompt
        verdicts[assert_matches_hf(ref, prompt, tokens, logprobs, n)] += 1
    assert verdicts["exact"] >= len(work) - 1, verdicts  # near-ties are rare; more means a real bug
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler_config.num_blocks
    return verdicts


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("chunk_size", [7, 32, 4096])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_matches_hf_for_every_policy_chunk_and_block_size(tiny_checkpoints, hf_reference, policy,
                                                                 chunk_size, block_size):
    engine = LLMEngine(tiny_checkpoints["llama"], scheduler=policy, chunk_size=chunk_size, block_size=block_size,
                       num_kv_blocks=4096 // block_size, device="cpu", attention_backend="torch")
    check_run(engine, hf_reference("llama"), seed=chunk_size * 7 + block_size)
    its = engine.stats().iterations
    if policy == "sarathi" and chunk_size < 300:
        assert any(it.num_prefills and it.num_decodes for it in its), "no hybrid batch was formed"


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_matches_hf_when_a_small_kv_pool_forces_preemption(tiny_checkpoints, hf_reference, policy,
                                                                  block_size, backend):
    # Prompts of up to 120 tokens with up to 40 outputs each, 14 of them, in a pool of 192 token slots: decodes
    # run out of blocks and the most recent arrivals are preempted and recomputed.
    engine = LLMEngine(tiny_checkpoints["llama"], scheduler=policy, chunk_size=32, block_size=block_size,
                       num_kv_blocks=192 // block_size, device="cpu", attention_backend=backend)
    assert engine.runner.attention_backend == backend
    check_run(engine, hf_reference("llama"), seed=11, max_prompt=120, max_output=40)
    assert sum(r.num_preemptions for r in engine.stats().requests) > 0, "the pool did not force a preemption"


@pytest.mark.parametrize("backend", ["torch", "cpu"])  # cpu: the decodes in the compiled kernel
@pytest.mark.parametrize("chunk_size", [7, 4096])
@pytest.mark.parametrize("kind", ["llama3", "llama_hd64", "mistral", "qwen2"])
def test_greedy_matches_hf_for_llama3_mistral_and_qwen2(tiny_checkpoints, hf_reference, kind, chunk_size, backend):
    engine = LLMEngine(tiny_checkpoints[kind], scheduler="sarathi", chunk_size=chunk_size, block_size=16,
                       num_kv_blocks=32, device="cpu", attention_backend=backend)
    assert engine.runner.attention_backend == backend
    check_run(engine, hf_reference(kind), seed=5)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
def test_greedy_matches_hf_on_cuda_in_float32(tiny_checkpoints, hf_reference, policy):
    engine = LLMEngine(tiny_checkpoints["llama"], scheduler=policy, chunk_size=32, block_size=16,
                       num_kv_blocks=256, device="cuda", dtype="float32", attention_backend="torch")
    check_run(engine, hf_reference("llama"), seed=3)


@pytest.mark.skipif(not (torch.cuda.is_available() and flashinfer_available()),
                    reason="needs CUDA and flashinfer-python")
@pytest.mark.parametrize("chunk_size", [7, 4096])
def test_flashinfer_bf16_engine_tracks_hf_within_bf16_rounding(tiny_checkpoints, hf_reference, chunk_size):
    """bf16 rounds logits at ~1e-2, so greedy may flip wherever HF's top two are that close; every token we pick
    must be within that of HF's float32 argmax under teacher forcing, and logprobs within bf16 error."""
    engine = LLMEngine(tiny_checkpoints["llama_hd64"], chunk_size=chunk_size, block_size=16, num_kv_blocks=256,
                       device="cuda", dtype="bfloat16", attention_backend="flashinfer")
    assert engine.runner.attention_backend == "flashinfer"
    work = workload(9)
    results = run_staggered(engine, work)
    ref = hf_reference("llama_hd64")
    for i, (prompt, _) in enumerate(work):
        _, tokens, logprobs = results[f"r{i}"]
        logits = ref.logits(prompt + tokens[:-1])[len(prompt) - 1:]
        lp = torch.log_softmax(logits, -1)
        for j, tok in enumerate(tokens):
            assert float(logits[j].max() - logits[j, tok]) <= 0.05
            assert abs(logprobs[j] - float(lp[j, tok])) <= 0.05


def test_hol_protection_changes_the_batches_not_the_outputs(tiny_checkpoints, hf_reference):
    """Protection under a low threshold (short prompts first, long ones capped to their share or held out of a
    step) reorders prefill chunks, but every greedy output still matches HF, as with the paper's FCFS policy."""
    batches = {}
    for protection in (False, True):
        engine = LLMEngine(tiny_checkpoints["llama"], chunk_size=32, block_size=4, num_kv_blocks=1024, device="cpu",
                           attention_backend="torch", record_batches=True, hol_protection=protection,
                           long_prefill_token_threshold=24)
        check_run(engine, hf_reference("llama"), seed=11)
        batches[protection] = [it.batch for it in engine.stats().iterations]
    assert batches[True] != batches[False], "protection did not change the batching"


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_matches_hf_with_batches_in_flight_and_preemption(tiny_checkpoints, hf_reference, policy,
                                                                 async_scheduling):
    # Two batches in flight on the forward thread (the strict pipeline rule, or async scheduling's decode
    # continuation with its input token filled in from the batch before), in a pool small enough to preempt.
    engine = LLMEngine(tiny_checkpoints["llama"], scheduler=policy, chunk_size=32, block_size=4,
                       num_kv_blocks=192 // 4, device="cpu", attention_backend="torch", max_concurrent_batches=2,
                       async_scheduling=async_scheduling)
    try:
        check_run(engine, hf_reference("llama"), seed=11, max_prompt=120, max_output=40)
        assert sum(r.num_preemptions for r in engine.stats().requests) > 0, "the pool did not force a preemption"
        assert engine.scheduler.num_in_flight == 0
    finally:
        engine.shutdown()
