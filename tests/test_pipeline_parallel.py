"""Pipeline parallelism, real: stages hold only their layers, PP=2 and PP=2 x TP=2 (gloo processes on CPU) generate
what PP=1 and Hugging Face do, no request is in two micro-batches in flight, the iteration records carry each
stage's busy time, and a dead stage is a clear error, never a hang; no worker outlives the engine."""

from __future__ import annotations

import argparse
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sarathi_lite import LLMEngine, SamplingParams
from sarathi_lite.cli.common import add_engine_args, engine_config
from sarathi_lite.engine import worker
from sarathi_lite.engine.model_runner import ModelRunner
from sarathi_lite.models.loader import load_model
from sarathi_lite.models.pipeline import PipelineParallel
from sarathi_lite.scheduler import Request, SchedulerConfig, make_scheduler

from .conftest import HFReference
from .parity import LOGPROB_ATOL, NEAR_TIE, assert_matches_hf, run_staggered, workload

CPU = torch.device("cpu")


# ---------------------------------------------------------------- stages, no processes


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_two_stages_hold_only_their_layers_and_chained_give_the_full_models_logits(tiny_checkpoints, kind):
    path = tiny_checkpoints[kind]
    full = load_model(path, torch.float32, CPU)
    stages = [load_model(path, torch.float32, CPU, pp=PipelineParallel(s, 2)) for s in range(2)]
    cfg = full.config
    assert [m.config.num_layers for m in stages] == [1, 1]
    assert [m.config.layer_windows for m in stages] == [cfg.layer_windows[:1], cfg.layer_windows[1:]]
    first, last = stages
    assert first.lm_head is None and first.model.norm is None and first.model.embed_tokens is not None
    assert last.model.norm is not None and last.lm_head is not None
    assert (last.model.embed_tokens is not None) == cfg.tie_word_embeddings  # a tied head needs the embedding
    for stage, layer in zip(stages, full.model.layers):
        for (name, p), (_, q) in zip(stage.model.layers[0].named_parameters(), layer.named_parameters()):
            assert torch.equal(p, q), name
    held = sum(p.numel() for m in stages for p in m.parameters())
    embedding = full.model.embed_tokens.weight.numel()
    assert held == sum(p.numel() for p in full.parameters()) + (embedding if cfg.tie_word_embeddings else 0)

    scheduler = make_scheduler(SchedulerConfig(chunk_size=64, block_size=16, num_blocks=16, max_model_len=256))
    scheduler.add(Request("a", list(range(3, 60)), 4, frozenset(), 0.0))
    scheduler.add(Request("b", list(range(7, 30)), 4, frozenset(), 0.0))
    out = scheduler.schedule()
    runners = [ModelRunner(m, block_size=16, num_blocks=16, device=CPU, dtype=torch.float32,
                           attention_backend="torch") for m in (full, *stages)]
    want, rows, _, _ = runners[0].forward(out)
    logits0, _, _, _ = runners[1].forward(out)
    assert logits0 is None
    last.stage_input = first.stage_output
    got, rows1, _, _ = runners[2].forward(out)
    assert rows1 == rows and torch.allclose(got, want, atol=1e-5)


# ---------------------------------------------------------------- the engine, with worker processes


def test_bad_pipeline_options_error_before_any_process_starts(tiny_checkpoints, monkeypatch):
    def no_start(*args, **kwargs):
        raise AssertionError("worker processes were started")

    monkeypatch.setattr(worker.WorkerGroup, "start", no_start)
    with pytest.raises(ValueError, match="pipeline_parallel_size=0 must be a positive integer"):
        LLMEngine(tiny_checkpoints["llama"], pipeline_parallel_size=0, device="cpu")
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds num_hidden_layers=2"):
        LLMEngine(tiny_checkpoints["llama"], pipeline_parallel_size=3, device="cpu")
    with pytest.raises(ValueError, match="async_scheduling: not with pipeline_parallel_size=2"):
        LLMEngine(tiny_checkpoints["llama"], pipeline_parallel_size=2, async_scheduling=True, device="cpu")


def test_the_cli_takes_pipeline_parallel_size_and_it_raises_the_batches_in_flight():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config(parser.parse_args(["--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"]))
    assert (config.pipeline_parallel_size, config.tensor_parallel_size) == (2, 2)
    assert config.scheduler_config(64, 256).max_concurrent_batches == 2


def _use_scheduler(engine: LLMEngine, policy: str, chunk_size: int) -> None:
    """A fresh scheduler with another policy and chunk size on the same worker processes (they run whatever rank
    0 schedules)."""
    config = engine.config.replace(policy=policy, chunk_size=chunk_size)
    engine.scheduler_config = config.scheduler_config(engine.scheduler_config.num_blocks,
                                                      engine.scheduler_config.max_model_len)
    engine.scheduler = make_scheduler(engine.scheduler_config)
    engine.reset_stats()


def _no_request_in_two_batches_in_flight(engine: LLMEngine) -> int:
    """Assert the in-flight rule on the iteration records (each spans schedule to processing); returns the most
    micro-batches that were in flight at once."""
    its = engine.stats().iterations
    spans: dict[str, list[tuple[float, float]]] = {}
    for it in its:
        for rid, _ in it.batch:
            spans.setdefault(rid, []).append((it.start_time, it.end_time))
    for rid, s in spans.items():
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(s, s[1:])), rid
    return max(sum(o.start_time <= it.start_time < o.end_time for o in its) for it in its)


@pytest.fixture(scope="module")
def pp1_runs() -> dict:
    """PP=1 runs by ``(kind, policy, chunk_size)``: ``(results, preemptions)``, shared by the PP=2 and PP=2 x TP=2
    cases of a model."""
    return {}


@pytest.mark.parametrize("kind,tp", [("llama", 1), ("qwen2", 1), ("mistral", 1), ("llama", 2), ("qwen2", 2),
                                     ("mistral", 2)])
def test_pp2_greedy_matches_pp1_and_hf_for_sarathi_and_vllm_chunks_7_and_64_with_preemption(tiny_checkpoints, kind,
                                                                                          tp, pp1_runs):
    options = dict(block_size=16, num_kv_blocks=12, device="cpu", attention_backend="torch", record_batches=True)
    ref = HFReference(tiny_checkpoints[kind])
    work = workload(seed=11, max_prompt=120, max_output=40, vocab=320)
    pp1 = None if (kind, "vllm", 64) in pp1_runs else LLMEngine(tiny_checkpoints[kind], **options)
    pp2 = LLMEngine(tiny_checkpoints[kind], pipeline_parallel_size=2, tensor_parallel_size=tp, **options)
    try:
        assert len(pp2.executor.workers.processes) == 2 * tp - 1
        assert pp2.runner.kv_cache.shape[0] == 1  # stage 0's one layer of the two
        preempted = {"pp1": 0, "pp2": 0}
        for policy, chunk_size in (("sarathi", 7), ("sarathi", 64), ("vllm", 64)):
            runs = {}
            for name, engine in (("pp1", pp1), ("pp2", pp2)):
                if engine is None:  # PP=1 ran for this model already
                    runs[name], count = pp1_runs[kind, policy, chunk_size]
                    preempted[name] += count
                    continue
                _use_scheduler(engine, policy, chunk_size)
                runs[name] = run_staggered(engine, work)
                count = sum(r.num_preemptions for r in engine.stats().requests)
                preempted[name] += count
                assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler_config.num_blocks
                if name == "pp1":
                    pp1_runs[kind, policy, chunk_size] = runs[name], count
            assert _no_request_in_two_batches_in_flight(pp2) == 2  # the pipeline did fill
            summary = pp2.stats().summary()
            assert summary["pipeline_stages"] == 2 and 0 < summary["bubble_fraction"] < 1
            assert all(len(it.stage_busy) == 2 and min(it.stage_busy) > 0 for it in pp2.stats().iterations)
            exact = 0
            for i, (prompt, n) in enumerate(work):
                _, tokens, logprobs = runs["pp2"][f"r{i}"]
                _, tokens1, logprobs1 = runs["pp1"][f"r{i}"]
                assert_matches_hf(ref, prompt, tokens, logprobs, n)
                same = next((j for j, (a, b) in enumerate(zip(tokens, tokens1)) if a != b), len(tokens))
                if same < len(tokens):  # a flip must be a near-tie under teacher forcing
                    hf = ref.logits(prompt + tokens[:same])[-1]
                    assert abs(float(hf[tokens[same]] - hf[tokens1[same]])) <= NEAR_TIE
                assert all(abs(a - b) <= LOGPROB_ATOL for a, b in zip(logprobs[:same], logprobs1[:same]))
                exact += tokens == tokens1
            assert exact >= len(work) - 1, (policy, chunk_size, exact)
        assert preempted["pp1"] > 0 and preempted["pp2"] > 0  # the small KV pool preempts (not in every setting)
    finally:
        pp2.shutdown()
    assert mp.active_children() == [] and not dist.is_initialized()


def test_a_stage_sends_the_micro_batch_on_only_after_its_own_layers(monkeypatch):
    # A gloo send waits until the receiver posts its receive, and the next stage posts it only when it is done
    # with the micro-batch before. Sending the micro-batch ahead of the layers made each stage wait for the next
    # before starting its own work, so the stages took turns: a measured bubble of one half at P = 2.
    from types import SimpleNamespace

    from sarathi_lite.engine import pipeline

    events: list[str] = []
    model = SimpleNamespace(stage_output=None, config=SimpleNamespace(hidden_size=4))

    def forward(out):
        events.append("layers")
        model.stage_output = (torch.zeros(2, 4), torch.zeros(2, 4))
        return None, [], 0.0, 0.0

    runner = SimpleNamespace(model=model, forward=forward, device=CPU)
    groups = SimpleNamespace(pp=PipelineParallel(0, 2), rank=0, tp_size=1, pipe=None)
    monkeypatch.setattr(pipeline, "send_micro_batch", lambda g, out: events.append(f"micro-batch {out}"))
    monkeypatch.setattr(pipeline.dist, "send", lambda t, dst, group=None: events.append(f"tensor to {dst}"))
    busy = pipeline.run_stage(runner, groups, "batch", "mb").stage_busy
    assert events == ["layers", "micro-batch mb", "tensor to 1", "tensor to 1", "tensor to 1"]
    assert len(busy) == 1 and busy[0] >= 0


def test_decodes_ready_together_are_shared_by_the_two_micro_batches(tiny_checkpoints):
    # eight prompts prefilled in one micro-batch come back together; each decode micro-batch then takes four of
    # them (balance_micro_batches), so two are in flight instead of one with eight and an empty one
    engine = LLMEngine(tiny_checkpoints["llama"], pipeline_parallel_size=2, num_kv_blocks=64, chunk_size=64,
                       device="cpu", attention_backend="torch", record_batches=True)
    try:
        for i in range(8):
            engine.add_request(f"r{i}", [5 + i, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=6,
                                                                          ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        its = engine.stats().iterations
        assert [it.num_prefills for it in its][:1] == [8]
        assert [it.num_decodes for it in its[1:]] == [4] * 10
        assert _no_request_in_two_batches_in_flight(engine) == 2
    finally:
        engine.shutdown()


def _start(path) -> tuple[LLMEngine, list]:
    engine = LLMEngine(path, pipeline_parallel_size=2, num_kv_blocks=16, chunk_size=16, device="cpu",
                       attention_backend="torch")
    return engine, list(engine.executor.workers.processes)


def test_dropping_the_engine_leaves_no_child_process(tiny_checkpoints):
    engine, procs = _start(tiny_checkpoints["llama"])
    engine.add_request("a", [5, 6, 7], None)
    while engine.has_unfinished_requests():
        engine.step()
    del engine
    assert all(p.exitcode == 0 for p in procs)  # told to stop, they left by themselves
    assert mp.active_children() == [] and not dist.is_initialized()


@pytest.mark.parametrize("when", ["idle", "in flight"])
def test_a_killed_stage_makes_rank_0_raise_a_clear_error_within_seconds(tiny_checkpoints, when):
    engine, procs = _start(tiny_checkpoints["llama"])
    for i in range(3):
        engine.add_request(f"r{i}", list(range(3 + i, 60)), None)
    engine.step()
    if when == "in flight":  # a micro-batch is down the pipeline when stage 1 dies
        engine._batches.forward_thread.submit(lambda: None).result()
        assert engine.executor.workers.pending >= 1
    os.kill(procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError,
                           match=r"worker rank 1 \(pipeline stage 1\) \(pid \d+\) was killed by signal 9"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < 10.0  # a bound on hanging, not a speed claim
    finally:  # a failure here must not leave the process group to the next test
        engine.shutdown()
    assert mp.active_children() == [] and not dist.is_initialized()
