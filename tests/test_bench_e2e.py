"""A short real online replay on a tiny model: two policies on the identical workload, loaded once; every request
arrives on time, produces exactly its output length, and the records survive a JSON round trip. Then the CLI
(``bench``, ``bench --cost-per-token``, ``capacity``) end to end. No timing assertions."""

from __future__ import annotations

import json

import pytest

from sarathi_lite import LLMEngine, SamplingParams
from sarathi_lite.bench.replay import configurations, cost_per_token, run
from sarathi_lite.bench.results import BenchResult
from sarathi_lite.bench.workload import Workload
from sarathi_lite.cli import main
from sarathi_lite.engine import executor as engine_module  # where the engine loads its weights

ENGINE = dict(block_size=4, num_kv_blocks=512, device="cpu")


@pytest.fixture(scope="module")
def two_policies(tiny_checkpoints):
    workload = Workload.synthetic("uniform:8-48:2-8", num_requests=6, qps=40.0, seed=3)
    loads = []
    original = engine_module.load_model

    def counting_load(*args, **kwargs):
        loads.append(args[0])
        return original(*args, **kwargs)

    engine_module.load_model = counting_load
    try:
        results = run(workload, policies=["sarathi", "vllm"], chunk_sizes=[16], model=tiny_checkpoints["llama"],
                      progress=False, **ENGINE)
    finally:
        engine_module.load_model = original
    return workload, results, loads


def test_configurations_run_chunked_policies_per_chunk_size_and_others_once():
    assert configurations(["sarathi", "vllm", "simple_chunking"], [64, 128]) == [
        ("sarathi", 64), ("sarathi", 128), ("vllm", None), ("simple_chunking", 64), ("simple_chunking", 128)]


def test_each_policy_replays_the_identical_workload_on_weights_loaded_once(two_policies):
    workload, results, loads = two_policies
    assert len(loads) == 1
    assert [r.label for r in results] == ["sarathi/16", "vllm"]
    for r in results:
        assert r.workload == workload and r.meta["replay"] == "real-time"
        by_id = {m.request_id: m for m in r.stats.requests}
        assert sorted(by_id) == [s.request_id for s in workload.requests]
        for spec in workload.requests:
            m = by_id[spec.request_id]
            assert (m.num_prompt_tokens, m.num_output_tokens) == (spec.prompt_len, spec.output_len)
            assert m.finish_reason == "length"


def test_requests_arrive_at_their_times_and_are_never_scheduled_early(two_policies):
    workload, results, _ = two_policies
    for r in results:
        ms = {m.request_id: m for m in r.stats.requests}
        start = ms[workload.requests[0].request_id].arrival_time
        for spec in workload.requests:
            m = ms[spec.request_id]
            assert m.arrival_time - start == pytest.approx(spec.arrival_time)
            assert m.first_scheduled_time >= m.arrival_time
            assert m.scheduling_delay <= m.ttft <= m.e2e
        assert r.stats.iterations[0].start_time >= start


def test_policy_and_chunk_size_reach_the_scheduler(two_policies):
    workload, (sarathi, vllm), _ = two_policies
    assert max(it.num_tokens for it in sarathi.stats.iterations) <= 16
    longest = max(s.prompt_len for s in workload.requests)
    assert longest > 16 and max(it.num_prefill_tokens for it in vllm.stats.iterations) >= longest
    assert sarathi.config["chunk_size"] == 16 and vllm.config["chunk_size"] is None
    assert sarathi.config["token_budget"] == 16


def test_a_real_result_round_trips_through_json(two_policies):
    _, results, _ = two_policies
    for r in results:
        back = BenchResult.from_json(r.to_json())
        assert back.summary() == r.summary() and back.stats.iterations == r.stats.iterations


def test_shared_engine_reuses_weights_and_both_engines_stay_correct(tiny_checkpoints):
    first = LLMEngine(tiny_checkpoints["llama"], chunk_size=8, **ENGINE)
    second = LLMEngine.from_model(first, scheduler="vllm", **ENGINE)
    assert second.model is first.model and second.runner.kv_cache is not first.runner.kv_cache

    def generate(engine: LLMEngine) -> list[int]:
        engine.add_request("x", list(range(20, 50)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        tokens = []
        while engine.has_unfinished_requests():
            tokens = next((o.token_ids for o in engine.step() if o.finished), tokens)
        return tokens

    assert generate(second) == generate(first) == generate(second)
    with pytest.raises(ValueError, match="from_model"):
        LLMEngine.from_model(first, model=tiny_checkpoints["qwen2"], **ENGINE)


def test_cost_per_token_times_equal_size_batches(tiny_checkpoints):
    engine = LLMEngine(tiny_checkpoints["llama"], **ENGINE)
    cost = cost_per_token(engine, num_tokens=16, context_len=12, repeats=2)
    assert [(r.batch, r.num_decodes, r.num_prefill_tokens) for r in cost.rows] == [
        ("decode-only", 16, 0), ("hybrid", 8, 8), ("prefill-only", 0, 16), ("single decode", 1, 0)]
    assert all(r.step_time > 0 for r in cost.rows) and cost.decode_prefill_ratio > 0
    assert "decode/prefill per-token cost" in cost.table()
    with pytest.raises(ValueError, match="KV blocks"):
        cost_per_token(engine, num_tokens=400, context_len=400)


def test_cli_bench_writes_a_table_json_csv_and_plot(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["bench", "--model", str(tiny_checkpoints["llama"]), "--lengths", "uniform:8-40:2-6",
               "--num-requests", "4", "--qps", "50", "--policies", "sarathi,orca", "--chunk-sizes", "8,16",
               "--block-size", "4", "--num-kv-blocks", "256", "--device", "cpu", "--out", str(out), "--plot",
               "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0
    assert all(label in text for label in ("sarathi/8", "sarathi/16", "orca", "TBT p50 ms"))
    assert {"sarathi_8.json", "sarathi_16.json", "orca.json", "summary.csv", "bench.png"} <= {
        p.name for p in out.iterdir()}
    assert BenchResult.from_json(out / "orca.json").workload.source["lengths"] == "uniform:8-40:2-6"


def test_cli_cost_per_token_and_capacity(tiny_checkpoints, tmp_path, capsys):
    model = ["--model", str(tiny_checkpoints["llama"]), "--block-size", "4", "--num-kv-blocks", "256",
             "--device", "cpu", "--no-progress"]
    assert main(["bench", "--cost-per-token", "--cost-tokens", "16", "--cost-context", "8", "--out",
                 str(tmp_path), *model]) == 0
    assert "prefill-only" in capsys.readouterr().out
    assert json.loads((tmp_path / "cost_per_token.json").read_text())["num_tokens"] == 16
    # a generous SLO: both ends of the range pass, so each policy stops after two probes at the top
    assert main(["capacity", "--lengths", "fixed:12:3", "--num-requests", "3", "--tbt-slo", "30",
                 "--max-scheduling-delay", "30", "--qps-low", "5", "--qps-high", "50", "--probes", "3",
                 "--policies", "sarathi,vllm", "--chunk-size", "16", "--out", str(tmp_path / "capacity"), *model]) == 0
    found = json.loads((tmp_path / "capacity" / "capacity.json").read_text())
    assert [c["label"] for c in found] == ["sarathi/16", "vllm"]
    assert all(c["capacity"] == 50 and len(c["probes"]) == 2 for c in found)


def test_cli_rejects_an_unknown_policy(tiny_checkpoints, tmp_path, capsys):
    rc = main(["bench", "--model", str(tiny_checkpoints["llama"]), "--lengths", "fixed:4:2", "--policies",
               "fifo", "--out", str(tmp_path)])
    assert rc == 2 and "unknown policy fifo" in capsys.readouterr().err
