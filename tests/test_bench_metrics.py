"""Serving metrics on a hand-made timeline: scheduler outputs with known times go through ``MetricsRecorder``,
and TTFT, TBT (with a preemption), scheduling delay, latency, throughput and percentiles come out as computed
by hand. Then the same records through ``BenchResult``: summary, JSON round trip, CSV, pandas, table, plot."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest

from sarathi_lite.bench.results import BenchResult, compare, compare_markdown, save_results
from sarathi_lite.bench.workload import RequestSpec, Workload
from sarathi_lite.metrics import MetricsRecorder, Stats
from sarathi_lite.scheduler import ScheduledRequest, SchedulerOutput


def chunk(rid: str, computed: int, n: int, sample: bool) -> ScheduledRequest:
    return ScheduledRequest(rid, computed, n, [7] * n, [], sample, True)


def decode(rid: str, computed: int) -> ScheduledRequest:
    return ScheduledRequest(rid, computed, 1, [7], [], True, False)


def step(rec: MetricsRecorder, start: float, end: float, items: list[ScheduledRequest], preempted: tuple = (),
         finished: tuple = ()) -> None:
    out = SchedulerOutput()
    for item in items:
        out.add(item)
    out.preempted_ids = list(preempted)
    rec.record_step(out, start, start + 0.01, end,
                    [SimpleNamespace(request_id=r, finish_reason="length") for r in finished])


def timeline() -> Stats:
    """A: arrives at 0, 4-token prompt, 4 output tokens. B: arrives at 1, 6-token prompt chunked 3 + 3, is
    preempted after its first token and recomputes 7 tokens, 3 output tokens.

    iteration  time        A                      B
    0          0.5 - 1.5   prefill 4 -> token 0
    1          1.5 - 2.0   decode -> token 1      prefill 3 (first scheduled)
    2          2.0 - 3.0   decode -> token 2      prefill 3 -> token 0
    3          3.0 - 3.4   decode -> token 3, done (B preempted)
    4          3.4 - 4.4                          recompute 7 -> token 1
    5          4.4 - 4.6                          decode -> token 2, done
    """
    rec = MetricsRecorder()
    rec.add("A", 0.0, 4)
    rec.add("B", 1.0, 6)
    step(rec, 0.5, 1.5, [chunk("A", 0, 4, True)])
    step(rec, 1.5, 2.0, [decode("A", 4), chunk("B", 0, 3, False)])
    step(rec, 2.0, 3.0, [decode("A", 5), chunk("B", 3, 3, True)])
    step(rec, 3.0, 3.4, [decode("A", 6)], preempted=("B",), finished=("A",))
    step(rec, 3.4, 4.4, [chunk("B", 0, 7, True)])
    step(rec, 4.4, 4.6, [decode("B", 7)], finished=("B",))
    return rec.stats()


def test_two_recorders_fill_one_request_record_across_a_prefill_and_a_decode_instance():
    """A disaggregated request: prefilled only on one instance (its token there is not its own), then decoded on
    another; both recorders fill the one record, each keeps its own iterations."""
    requests: dict = {}
    prefill, decode_side = MetricsRecorder(requests=requests), MetricsRecorder(requests=requests)
    prefill.add("A", 0.0, 4)
    out = SchedulerOutput()
    out.add(chunk("A", 0, 4, True))
    prefill.record_step(out, 0.5, 0.6, 1.5, prefill_only={"A"})
    a = requests["A"]
    assert a.first_scheduled_time == 0.5 and a.token_times == [] and a.first_token_time is None
    step(decode_side, 2.0, 2.5, [chunk("A", 3, 1, True)])
    step(decode_side, 2.5, 3.0, [decode("A", 4)], finished=("A",))
    assert a.ttft == pytest.approx(2.5) and a.token_times == [2.5, 3.0] and a.e2e == pytest.approx(3.0)
    assert (len(prefill.iterations), len(decode_side.iterations)) == (1, 2)
    assert prefill.iterations[0].num_prefill_tokens == 4 and decode_side.iterations[0].index == 0


def result() -> BenchResult:
    wl = Workload((RequestSpec("A", 0.0, 4, 4), RequestSpec("B", 1.0, 6, 3)), {"kind": "hand-made"}, seed=0)
    return BenchResult({"policy": "sarathi", "chunk_size": 8}, wl, timeline(), {"replay": "hand-made"})


def test_per_request_times_follow_the_definitions():
    a, b = timeline().requests
    assert a.scheduling_delay == pytest.approx(0.5) and b.scheduling_delay == pytest.approx(0.5)
    assert a.ttft == pytest.approx(1.5) and b.ttft == pytest.approx(2.0)
    assert a.tbt == pytest.approx([0.5, 1.0, 0.4])
    assert b.tbt == pytest.approx([1.4, 0.2])  # the gap across the preemption counts the recompute
    assert a.e2e == pytest.approx(3.4) and b.e2e == pytest.approx(3.6)
    assert a.normalized_latency == pytest.approx(3.4 / 4) and b.normalized_latency == pytest.approx(3.6 / 3)
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert a.ttft + sum(a.tbt) == pytest.approx(a.e2e)


def test_summary_percentiles_and_throughput():
    s = timeline().summary()
    assert s["num_requests"] == 2 and s["num_iterations"] == 6 and s["num_preemptions"] == 1
    assert s["ttft_p50"] == pytest.approx(1.75)
    # TBT pools every gap: [0.2, 0.4, 0.5, 1.0, 1.4]; p90 and p99 interpolate linearly between ranks
    assert s["tbt_p50"] == pytest.approx(0.5)
    assert s["tbt_p90"] == pytest.approx(1.0 + 0.6 * 0.4)
    assert s["tbt_p99"] == pytest.approx(1.0 + 0.96 * 0.4)
    assert s["scheduling_delay_p50"] == pytest.approx(0.5)
    assert s["normalized_latency_p50"] == pytest.approx((0.85 + 1.2) / 2)
    assert s["duration"] == pytest.approx(4.6)  # first arrival to last finish
    assert s["throughput_requests_per_s"] == pytest.approx(2 / 4.6)
    assert s["throughput_output_tokens_per_s"] == pytest.approx(7 / 4.6)
    assert s["throughput_tokens_per_s"] == pytest.approx((4 + 6 + 7) / 4.6)


def test_iteration_records_count_prefill_and_decode_tokens():
    its = timeline().iterations
    assert [(it.num_prefill_tokens, it.num_decode_tokens) for it in its] == [(4, 0), (3, 1), (3, 1), (0, 1),
                                                                            (7, 0), (0, 1)]
    assert [(it.num_prefills, it.num_decodes) for it in its] == [(1, 0), (1, 1), (1, 1), (0, 1), (1, 0), (0, 1)]
    assert [it.step_time for it in its] == pytest.approx([1.0, 0.5, 1.0, 0.4, 1.0, 0.2])
    assert [it.num_preempted for it in its] == [0, 0, 0, 1, 0, 0]


def test_result_summary_adds_configuration_and_offered_rate():
    s = result().summary()
    assert s["label"] == "sarathi/8" and s["policy"] == "sarathi" and s["chunk_size"] == 8
    assert s["qps"] == pytest.approx(1.0)
    assert s["tbt_p99"] == pytest.approx(timeline().summary()["tbt_p99"])


def test_unchunked_policies_are_labelled_without_a_chunk_size():
    r = result()
    r.config = {"policy": "vllm", "chunk_size": None}
    assert r.label == "vllm"


def test_json_round_trip_keeps_every_record(tmp_path):
    r = result()
    path = tmp_path / "r.json"
    text = r.to_json(path)
    back = BenchResult.from_json(path)
    assert BenchResult.from_json(text).summary() == back.summary() == r.summary()
    assert back.workload == r.workload and back.config == r.config and back.meta == r.meta
    assert [m.token_times for m in back.stats.requests] == [m.token_times for m in r.stats.requests]
    assert back.stats.iterations == r.stats.iterations
    with pytest.raises(ValueError, match="schema"):
        BenchResult.from_dict({"schema": "something else"})


def test_csv_files_hold_requests_iterations_and_every_token_gap(tmp_path):
    paths = result().to_csv(tmp_path / "run")
    assert [p.name for p in paths] == ["run_requests.csv", "run_iterations.csv", "run_tbt.csv"]
    rows = {p.name: list(csv.DictReader(open(p))) for p in paths}
    reqs = rows["run_requests.csv"]
    assert [r["request_id"] for r in reqs] == ["A", "B"]
    assert float(reqs[1]["ttft"]) == pytest.approx(2.0) and reqs[1]["num_preemptions"] == "1"
    its = rows["run_iterations.csv"]
    assert len(its) == 6 and float(its[4]["step_time"]) == pytest.approx(1.0)
    gaps = [(r["request_id"], int(r["token_index"]), float(r["tbt"])) for r in rows["run_tbt.csv"]]
    assert gaps == [("A", 1, 0.5), ("A", 2, 1.0), ("A", 3, pytest.approx(0.4)), ("B", 1, pytest.approx(1.4)),
                    ("B", 2, pytest.approx(0.2))]


def test_pandas_frames_carry_the_label():
    frames = result().to_pandas()
    assert set(frames) == {"requests", "iterations", "tbt"}
    assert (frames["tbt"]["label"] == "sarathi/8").all() and len(frames["tbt"]) == 5
    assert frames["requests"]["e2e"].tolist() == pytest.approx([3.4, 3.6])


def test_compare_prints_one_row_per_result_with_milliseconds_for_tbt():
    a, b = result(), result()
    b.config = {"policy": "vllm", "chunk_size": None}
    table = compare([a, b]).splitlines()
    assert len(table) == 3 and table[1].startswith("sarathi/8") and table[2].startswith("vllm")
    assert " 1384 " in table[1]  # P99 TBT in ms
    md = compare_markdown([a, b]).splitlines()
    assert md[0].startswith("| config |") and len(md) == 4


def test_save_results_writes_json_csv_and_a_summary(tmp_path):
    a, b = result(), result()
    b.config = {"policy": "vllm", "chunk_size": None}
    paths = save_results([a, b], tmp_path / "out")
    names = {p.name for p in paths}
    assert {"sarathi_8.json", "vllm.json", "sarathi_8_tbt.csv", "summary.csv"} <= names
    summary = list(csv.DictReader(open(tmp_path / "out" / "summary.csv")))
    assert [row["label"] for row in summary] == ["sarathi/8", "vllm"]


def test_plot_writes_a_png(tmp_path):
    from sarathi_lite.bench.plots import plot_results

    a, b = result(), result()
    b.config = {"policy": "vllm", "chunk_size": None}
    path = plot_results([a, b], tmp_path / "plots" / "bench.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
