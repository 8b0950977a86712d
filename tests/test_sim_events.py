"""The simulator's event loop on hand-made workloads with constant-time steps: arrivals during a step are seen
at the next schedule, idle gaps jump to the next arrival, the host gap between steps is added, and TTFT / TBT /
scheduling delay come out as computed by hand. Torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sarathi_lite.bench.workload import RequestSpec, Workload
from sarathi_lite.costs import ProfiledCostModel
from sarathi_lite.scheduler import SchedulerConfig
from sarathi_lite.sim.simulator import scheduler_config, simulate

ONE_SECOND = ProfiledCostModel((1, 2), (1.0, 1.0))  # every step takes 1 s


def workload(*rows: tuple[str, float, int, int]) -> Workload:
    return Workload(tuple(RequestSpec(*row) for row in rows))


def config(policy: str = "sarathi", chunk_size: int = 8) -> SchedulerConfig:
    return SchedulerConfig(policy=policy, chunk_size=chunk_size, block_size=4, num_blocks=64, max_model_len=256)


def by_id(result):
    return {m.request_id: m for m in result.stats.requests}


def test_an_arrival_during_a_step_is_scheduled_at_the_next_one_and_latencies_match_a_hand_count():
    # a arrives at 0 (prompt 4, 3 outputs); b at 0.5, while step 0 (a's whole prompt) runs from 0 to 1.
    result = simulate(workload(("a", 0.0, 4, 3), ("b", 0.5, 4, 2)), ONE_SECOND, config(), record_batches=True)
    assert [it.batch for it in result.stats.iterations] == [
        (("a", 4),),                  # 0-1: a's prompt; b has not arrived when it starts
        (("a", 1), ("b", 4)),         # 1-2: a's decode first, then b's prompt
        (("a", 1), ("b", 1)),         # 2-3: both decode; a ends with 3 tokens, b with 2
    ]
    assert [(it.start_time, it.end_time) for it in result.stats.iterations] == [(0, 1), (1, 2), (2, 3)]
    a, b = by_id(result)["a"], by_id(result)["b"]
    assert (a.ttft, a.tbt, a.e2e, a.scheduling_delay) == (1.0, [1.0, 1.0], 3.0, 0.0)
    assert (b.ttft, b.tbt, b.e2e, b.scheduling_delay) == (1.5, [1.0], 2.5, 0.5)
    s = result.summary()
    assert (s["ttft_p50"], s["tbt_p50"], s["duration"], s["output_tokens"]) == (1.25, 1.0, 3.0, 5)


def test_an_arrival_exactly_at_a_step_start_is_seen_by_that_step():
    result = simulate(workload(("a", 0.0, 4, 2), ("b", 1.0, 4, 1)), ONE_SECOND, config(), record_batches=True)
    assert result.stats.iterations[1].batch == (("a", 1), ("b", 4))
    assert by_id(result)["b"].scheduling_delay == 0.0


def test_an_idle_engine_jumps_to_the_next_arrival():
    result = simulate(workload(("a", 0.0, 4, 2), ("c", 10.0, 4, 2)), ONE_SECOND, config())
    assert [it.start_time for it in result.stats.iterations] == [0.0, 1.0, 10.0, 11.0]
    c = by_id(result)["c"]
    assert (c.first_scheduled_time, c.ttft, c.tbt) == (10.0, 1.0, [1.0])


def test_host_gap_and_scheduling_time_are_added_as_the_engine_measures_them():
    cost = ProfiledCostModel((1, 2), (1.0, 1.0), schedule_constant=0.25, schedule_per_request=0.125, step_gap=0.5)
    result = simulate(workload(("a", 0.0, 4, 2), ("b", 5.0, 4, 1)), cost, config())
    its = result.stats.iterations
    # every step: 0.25 + 0.125 per request scheduling, then 1 s; 0.5 s between steps and after an idle wake-up
    assert [(it.start_time, it.schedule_time, it.step_time) for it in its] == [
        (0.5, 0.375, 1.375), (2.375, 0.375, 1.375), (5.5, 0.375, 1.375)]
    assert by_id(result)["b"].ttft == 5.5 + 1.375 - 5.0


def test_step_time_follows_the_cost_terms_of_the_batch():
    cost = ProfiledCostModel((1, 2), (0.01, 0.02), {"sampled": 0.1, "decode_attention": 0.001})  # 10 ms a token
    result = simulate(workload(("a", 0.0, 6, 2)), cost, config())
    prefill, decode = result.stats.iterations
    assert prefill.step_time == pytest.approx(6 * 0.01 + 0.1)
    assert decode.step_time == pytest.approx(0.01 + 0.1 + 7 * 0.001)


def test_chunked_prefill_spans_steps_and_unchunked_policies_wait_for_a_free_slot():
    sarathi = simulate(workload(("a", 0.0, 20, 2)), ONE_SECOND, config(chunk_size=8), record_batches=True)
    assert [it.batch for it in sarathi.stats.iterations] == [(("a", 8),), (("a", 8),), (("a", 4),), (("a", 1),)]
    assert by_id(sarathi)["a"].ttft == 3.0
    request_level = simulate(workload(("a", 0.0, 4, 3), ("b", 0.5, 4, 1)), ONE_SECOND, config("request_level"),
                             record_batches=True)
    assert [it.batch for it in request_level.stats.iterations] == [
        (("a", 4),), (("a", 1),), (("a", 1),), (("b", 4),)]


def test_a_simulation_with_random_step_times_depends_on_its_seed_only():
    jittery = ProfiledCostModel((1, 2), (1.0, 1.0), jitter=(0.5, 1.0, 2.0))
    wl = workload(("a", 0.0, 4, 6), ("b", 2.5, 4, 6), ("c", 4.0, 8, 4))

    def timeline(seed: int) -> list[float]:
        return [it.end_time for it in simulate(wl, jittery, config(), seed=seed).stats.iterations]

    first = timeline(0)
    simulate(wl, jittery, config(), seed=5)  # another simulation in between changes nothing
    assert timeline(0) == first and timeline(1) != first
    assert len({round(b - a, 9) for a, b in zip([0.0, *first], first)}) > 3  # steps really vary


def test_scheduler_config_derives_the_pool_as_the_engine_does():
    cost = ProfiledCostModel((1, 2), (1.0, 1.0), kv_bytes_per_token=1000, kv_cache_memory=16_000_000,
                             max_position_embeddings=8192)
    cfg = scheduler_config(cost, "vllm", None, block_size=16)
    assert (cfg.num_blocks, cfg.max_model_len, cfg.chunk_size) == (1000, 8192, 512)
    small = scheduler_config(cost, "sarathi", 64, block_size=16, num_kv_blocks=100)
    assert (small.num_blocks, small.max_model_len, small.chunk_size) == (100, 1600, 64)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        scheduler_config(ONE_SECOND, "sarathi", 64)


def test_a_request_longer_than_max_model_len_is_refused_before_simulating():
    with pytest.raises(ValueError, match="max_model_len=256"):
        simulate(workload(("a", 0.0, 250, 10)), ONE_SECOND, config())


def test_the_simulator_does_not_import_torch():
    code = ("import sys\nfrom sarathi_lite.costs import load_cost_model\nfrom sarathi_lite.sim.simulator import run\n"
            "from sarathi_lite.bench.workload import Workload\n"
            "wl = Workload.synthetic('uniform:8-64:2-8', num_requests=20, qps=50.0)\n"
            "run(wl, load_cost_model('roofline:h100:llama3-8b'), policies=['sarathi', 'vllm'], chunk_sizes=[32])\n"
            "assert 'torch' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
