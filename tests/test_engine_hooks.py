"""What benchmarks and the profiler need from the engine comes through public API: engines on shared weights
(``LLMEngine.from_model``) each bind their KV cache once, iteration records carry the model runner's time split,
and the scheduler itself reports a batch that cannot make progress."""

from __future__ import annotations

import pytest

from sarathi_lite import LLMEngine, SamplingParams
from sarathi_lite.scheduler import Request, SchedulerConfig, SchedulerOutput, make_scheduler

ENGINE = dict(block_size=4, num_kv_blocks=128, device="cpu")


def test_engines_on_shared_weights_keep_their_own_kv_binding(tiny_checkpoints):
    first = LLMEngine(tiny_checkpoints["llama"], chunk_size=8, **ENGINE)
    second = LLMEngine.from_model(first, scheduler="vllm", **ENGINE)
    assert second.config.model == str(first.model_path) and second.config.policy == "vllm"
    assert second.runner.model is not first.runner.model
    assert second.runner.model.lm_head.weight is first.model.lm_head.weight
    for engine in (first, second):
        layers = engine.runner.model.attention_layers()
        assert all(a.kv_cache.data_ptr() == engine.runner.kv_cache[i].data_ptr() for i, a in enumerate(layers))
    with pytest.raises(ValueError, match="from_model"):
        LLMEngine.from_model(first, dtype="bfloat16", **ENGINE)


def test_iteration_records_split_the_runner_time(tiny_checkpoints):
    engine = LLMEngine(tiny_checkpoints["llama"], chunk_size=16, **ENGINE)
    engine.add_request("a", list(range(10, 40)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    its = engine.stats().iterations
    assert its and all(it.prepare_time > 0 and it.forward_time > 0 for it in its)
    sampled = [it for it in its if it.num_decodes or it.index == len(its) - 1]
    assert all(it.sample_time > 0 for it in sampled)
    assert all(it.execute_time <= it.step_time - it.schedule_time and it.update_time >= 0 for it in its)
    assert {"prepare_time", "forward_time", "sample_time"} <= set(its[0].as_dict())


def test_the_scheduler_reports_an_empty_batch_while_requests_wait_and_none_run():
    sched = make_scheduler(SchedulerConfig(chunk_size=8, block_size=4, num_blocks=16, max_model_len=32))
    sched.add(Request("a", [1, 2, 3], 2))
    with pytest.raises(RuntimeError, match="admitted nothing although requests wait"):
        sched.update(SchedulerOutput(), {})
    out = sched.schedule()
    assert sched.update(out, {"a": 5}) == []  # a real batch is fine
