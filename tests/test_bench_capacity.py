"""Capacity search on a fake runner whose P99 TBT and scheduling delay grow with the rate: the binary search
brackets the true capacity, never reports a failing rate, and stops early at the ends of the range."""

from __future__ import annotations

import json

import pytest

from sarathi_lite.bench.capacity import SLO, CapacityResult, search_capacity
from sarathi_lite.bench.results import BenchResult
from sarathi_lite.bench.workload import RequestSpec, Workload
from sarathi_lite.metrics import RequestMetrics, Stats


def fake_result(qps: float, tbt: float, delay: float) -> BenchResult:
    """One finished request with two token gaps of ``tbt`` seconds, scheduled ``delay`` seconds late."""
    m = RequestMetrics("r", 0.0, 8, first_scheduled_time=delay, first_token_time=delay + 0.1,
                       token_times=[delay + 0.1, delay + 0.1 + tbt, delay + 0.1 + 2 * tbt],
                       finished_time=delay + 0.1 + 2 * tbt, finish_reason="length")
    return BenchResult({"policy": "sarathi", "chunk_size": 64}, Workload((RequestSpec("r", 0.0, 8, 3),)),
                       Stats([m], []))


class FakeRunner:
    """P99 TBT grows linearly with the rate: it crosses ``slo_tbt`` exactly at ``capacity`` requests/s."""

    def __init__(self, capacity: float, slo_tbt: float = 0.3, delay: float = 0.1) -> None:
        self.capacity, self.slo_tbt, self.delay = capacity, slo_tbt, delay
        self.calls: list[float] = []

    def __call__(self, qps: float) -> BenchResult:
        self.calls.append(qps)
        return fake_result(qps, self.slo_tbt * qps / self.capacity, self.delay)


@pytest.mark.parametrize("true_capacity", [0.37, 1.0, 2.9])
def test_binary_search_brackets_the_capacity(true_capacity):
    runner = FakeRunner(true_capacity)
    found = search_capacity(runner, SLO(0.3), 0.1, 4.0, num_probes=9)
    assert len(runner.calls) == 9 == len(found.probes)
    assert found.capacity <= true_capacity < found.failed_above
    assert found.failed_above - found.capacity <= (4.0 - 0.1) / 2 ** 7 + 1e-12
    assert all(p.passed == (p.qps <= true_capacity) for p in found.probes)
    assert all(p.result is not None for p in found.probes)


def test_low_end_failing_means_capacity_below_the_range():
    runner = FakeRunner(0.05)
    found = search_capacity(runner, SLO(0.3), 0.1, 4.0, num_probes=6)
    assert runner.calls == [0.1] and found.capacity is None and found.failed_above == 0.1


def test_high_end_passing_means_capacity_at_least_the_top():
    runner = FakeRunner(10.0)
    found = search_capacity(runner, SLO(0.3), 0.1, 4.0, num_probes=6)
    assert runner.calls == [0.1, 4.0] and found.capacity == 4.0 and found.failed_above is None


def test_scheduling_delay_bound_fails_a_rate_whose_tbt_passes():
    runner = FakeRunner(10.0, delay=3.0)
    found = search_capacity(runner, SLO(0.3, scheduling_delay_p50=2.0), 0.1, 4.0)
    assert found.capacity is None
    assert found.probes[0].tbt_p99 <= 0.3 and found.probes[0].scheduling_delay_p50 == pytest.approx(3.0)


def test_slo_check_edge_cases():
    slo = SLO(0.3, 2.0)
    assert slo.met_by({"num_requests": 3, "tbt_p99": None, "scheduling_delay_p50": 0.1})  # one-token outputs
    assert not slo.met_by({"num_requests": 0, "tbt_p99": None, "scheduling_delay_p50": None})
    assert slo.met_by({"num_requests": 3, "tbt_p99": 0.3, "scheduling_delay_p50": 2.0})  # bounds are inclusive


def test_bad_ranges_are_rejected():
    with pytest.raises(ValueError, match="qps_low < qps_high"):
        search_capacity(FakeRunner(1.0), SLO(0.3), 2.0, 1.0)
    with pytest.raises(ValueError, match="num_probes"):
        search_capacity(FakeRunner(1.0), SLO(0.3), 0.1, 1.0, num_probes=1)


def test_capacity_result_serializes_without_the_runs():
    found = search_capacity(FakeRunner(1.0), SLO(0.3), 0.5, 2.0, num_probes=4, label="sarathi/64")
    d = found.to_dict()
    assert d["label"] == "sarathi/64" and d["capacity"] == found.capacity and len(d["probes"]) == 4
    assert set(d["probes"][0]) == {"qps", "passed", "tbt_p99", "scheduling_delay_p50"}


def test_a_serialized_capacity_result_reads_back_the_same():
    """``from_dict`` inverts ``to_dict`` (``benchmarks/auto_budget.py --fixed-from`` reuses stored searches)."""
    found = search_capacity(FakeRunner(1.0), SLO(0.3, 1.5), 0.5, 2.0, num_probes=5, label="sarathi/64")
    back = CapacityResult.from_dict(json.loads(json.dumps(found.to_dict())))
    assert back.to_dict() == found.to_dict()
    assert (back.label, back.slo, back.qps_range, back.capacity) == ("sarathi/64", SLO(0.3, 1.5), (0.5, 2.0),
                                                                      found.capacity)


def test_capacity_plot_writes_a_png(tmp_path):
    from sarathi_lite.bench.plots import plot_capacity

    found = [search_capacity(FakeRunner(cap), SLO(0.3), 0.5, 2.0, num_probes=4, label=f"c{cap}") for cap in (1, 3)]
    data = plot_capacity(found, tmp_path / "capacity.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
