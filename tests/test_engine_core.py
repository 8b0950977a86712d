"""The engine core: async scheduling through the batch queue, and prompt K/V moved between engines by a KV
connector (the runner's block export and import)."""

from __future__ import annotations

import pytest
import torch

from sarathi_lite import LLMEngine, SamplingParams
from sarathi_lite.engine.kv_connector import InProcessKVConnector, kv_store
from sarathi_lite.scheduler import PLACEHOLDER_TOKEN

from .parity import assert_matches_hf

OPTIONS = dict(chunk_size=16, block_size=4, num_kv_blocks=128, device="cpu", attention_backend="torch")


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = (o.token_ids, o.finish_reason, o.text)
    return done


def test_async_scheduling_gives_the_same_outputs_with_stop_tokens_min_tokens_and_seeded_sampling(tiny_checkpoints):
    requests = {
        "greedy": (list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
        "stop": (list(range(5, 20)), SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[73])),
        "min": (list(range(7, 30)), SamplingParams(temperature=0.0, max_tokens=9, min_tokens=6,
                                                   stop_token_ids=[73])),
        "seeded": (list(range(2, 25)), SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=15,
                                                      ignore_eos=True)),
    }
    sync = LLMEngine(tiny_checkpoints["llama"], **OPTIONS)
    expected = run(sync, requests)
    assert expected["stop"][1] == "stop" and len(expected["min"][0]) >= 6
    engine = LLMEngine.from_model(sync, async_scheduling=True, **OPTIONS)
    continued = []
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        continued.extend(s.request_id for s in out.scheduled if s.token_ids == [PLACEHOLDER_TOKEN])
        return out

    engine.scheduler.schedule = counting
    try:
        assert run(engine, requests) == expected
    finally:
        engine.shutdown()
    assert len(continued) > 10, "async scheduling never scheduled a decode ahead of its input token"
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler_config.num_blocks


def test_kv_from_another_engine_skips_the_prefill_and_holds_exactly_the_imported_kv(tiny_checkpoints, hf_reference):
    prompt = [(7 * i + 3) % 250 + 2 for i in range(45)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    producer = LLMEngine(tiny_checkpoints["llama"], connector=InProcessKVConnector("core-test", "producer"),
                         **OPTIONS)
    run(producer, {"r": (prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))})
    stored = kv_store("core-test").get("r")
    assert stored is not None and stored.num_tokens == len(prompt) and stored.token_ids == prompt
    assert producer.scheduler.block_manager.num_free_blocks == producer.scheduler_config.num_blocks, \
        "the producer's blocks are released once saved"

    consumer = LLMEngine.from_model(producer, connector=InProcessKVConnector("core-test", "consumer"),
                                    **OPTIONS)
    consumer.add_request("r", prompt, greedy, num_external_tokens=len(prompt) - 1)
    consumer.step()  # the load
    blocks = list(consumer.scheduler.requests["r"].block_ids)
    imported = consumer.runner.export_blocks(blocks[:11])  # the 44 loaded tokens fill 11 blocks of 4
    assert torch.equal(imported, stored.kv[:, :11])
    outputs = []
    while consumer.has_unfinished_requests():
        outputs += [o for o in consumer.step() if o.finished]
    [out] = outputs
    first = consumer.stats().iterations[0]
    assert first.num_prefill_tokens == 1, "only the last prompt token was computed"
    cold = run(LLMEngine.from_model(producer, **OPTIONS), {"r": (prompt, greedy)})
    assert out.token_ids == cold["r"][0]
    assert_matches_hf(hf_reference("llama"), prompt, out.token_ids, [lp for lp, _ in out.logprobs], 8)
    assert kv_store("core-test").get("r") is None, "a loaded entry is taken"


def test_missing_or_unusable_kv_falls_back_to_recomputing_the_prompt(tiny_checkpoints, caplog):
    prompt = list(range(3, 30))
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # the options build the same connector: kv_role, kv_connector (inprocess by default), kv_store
    producer = LLMEngine(tiny_checkpoints["llama"], kv_role="producer", kv_store="core-fallback",
                         **{**OPTIONS, "block_size": 8, "num_kv_blocks": 64})
    assert isinstance(producer.kv_connector, InProcessKVConnector) and producer.kv_connector.role == "producer"
    run(producer, {"odd": (prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))})
    cold = run(LLMEngine.from_model(producer, **OPTIONS), {"x": (prompt, greedy)})["x"][0]
    consumer = LLMEngine.from_model(producer, connector=InProcessKVConnector("core-fallback", "consumer"),
                                    enable_prefix_caching=False, **OPTIONS)
    # "none": the store has nothing for it, so nothing is loaded; "odd": stored in blocks of 8, not 4
    outputs: dict[str, list[int]] = {}
    for rid in ("none", "odd"):
        consumer.add_request(rid, prompt, greedy, num_external_tokens=20)
    while consumer.has_unfinished_requests():
        outputs.update({o.request_id: o.token_ids for o in consumer.step() if o.finished})
    assert outputs == {"none": cold, "odd": cold}
    assert "'odd': the KV connector could not supply" in caplog.text and "'none'" not in caplog.text
    assert sum(it.num_prefill_tokens for it in consumer.stats().iterations) == 2 * len(prompt), "both recomputed"


def test_external_tokens_need_a_connector_and_import_checks_the_layout(tiny_checkpoints):
    engine = LLMEngine(tiny_checkpoints["llama"], **OPTIONS)
    with pytest.raises(ValueError, match="num_external_tokens=5 needs an engine with a KV connector"):
        engine.add_request("a", list(range(3, 20)), num_external_tokens=5)
    with pytest.raises(ValueError, match=r"does not fit 2 blocks"):
        engine.runner.import_blocks([0, 1], torch.zeros(1, 2, 2, 4, 1, 1))
    with pytest.raises(ValueError, match="role='sender' is not one of"):
        InProcessKVConnector("x", "sender")
