"""Workload construction: trace rows, clipping and scaling, Poisson arrivals, synthetic lengths, seeds, JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sarathi_lite.bench.workload import RequestSpec, Workload, parse_lengths, poisson_arrivals

ROWS = [(10.0, 400, 50), (12.5, 90, 7), (13.0, 2000, 300), (20.0, 1, 1), (21.0, 640, 129)]


@pytest.fixture()
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{t},{p},{o}\n" for t, p, o in ROWS))
    return path


def lengths(w: Workload) -> list[tuple[int, int]]:
    return [(r.prompt_len, r.output_len) for r in w.requests]


def test_trace_rows_keep_lengths_and_arrivals_relative_to_the_first_row(trace):
    w = Workload.from_trace(trace)
    assert lengths(w) == [(p, o) for _, p, o in ROWS]
    assert [r.arrival_time for r in w.requests] == pytest.approx([0.0, 2.5, 3.0, 10.0, 11.0])
    assert w.source["arrivals"] == "trace"
    assert w.qps == pytest.approx(4 / 11)


def test_time_scale_stretches_trace_arrivals(trace):
    w = Workload.from_trace(trace, time_scale=2.0)
    assert [r.arrival_time for r in w.requests] == pytest.approx([0.0, 5.0, 6.0, 20.0, 22.0])


def test_start_and_num_requests_select_consecutive_rows(trace):
    w = Workload.from_trace(trace, start=1, num_requests=3)
    assert lengths(w) == [(90, 7), (2000, 300), (1, 1)]
    assert w.requests[0].arrival_time == 0.0 and w.requests[-1].arrival_time == pytest.approx(7.5)
    with pytest.raises(ValueError, match="asked for 9 rows"):
        Workload.from_trace(trace, start=1, num_requests=9)


def test_clipping_caps_lengths(trace):
    w = Workload.from_trace(trace, max_prompt=512, max_output=64)
    assert lengths(w) == [(400, 50), (90, 7), (512, 64), (1, 1), (512, 64)]


def test_scaling_rounds_and_keeps_at_least_one_token_then_clips(trace):
    w = Workload.from_trace(trace, prompt_scale=0.25, output_scale=0.1, max_prompt=400)
    assert lengths(w) == [(100, 5), (22, 1), (400, 30), (1, 1), (160, 13)]


def test_qps_replaces_trace_arrivals_with_poisson(trace):
    w = Workload.from_trace(trace, qps=2.0, seed=3)
    assert [r.arrival_time for r in w.requests] == pytest.approx(poisson_arrivals(5, 2.0, 3).tolist())
    assert w.source["arrivals"] == "poisson" and w.source["qps"] == 2.0


def test_trace_without_arrival_times_arrives_all_at_once_or_at_qps(tmp_path):
    path = tmp_path / "lengths.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens\n100,10,110\n200,20,220\n")
    assert [r.arrival_time for r in Workload.from_trace(path).requests] == [0.0, 0.0]
    assert Workload.from_trace(path, qps=1.0).requests[1].arrival_time > 0


def test_trace_missing_length_columns_is_rejected(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("arrived_at,prompt\n0,5\n")
    with pytest.raises(ValueError, match="num_decode_tokens, num_prefill_tokens"):
        Workload.from_trace(path)


def test_poisson_arrivals_have_the_requested_rate_and_exponential_gaps():
    times = poisson_arrivals(20_000, 4.0, seed=7)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 4.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: coefficient of variation 1
    counts = np.bincount(times.astype(int))[:-1]  # arrivals per whole second
    assert counts.mean() == pytest.approx(4.0, rel=0.03) and counts.var() == pytest.approx(4.0, rel=0.1)


def test_at_qps_keeps_requests_and_scales_arrival_times_exactly():
    w = Workload.synthetic("uniform:10-100:5-20", num_requests=50, qps=1.0, seed=5)
    faster = w.at_qps(4.0)
    assert lengths(faster) == lengths(w)
    assert [r.request_id for r in faster.requests] == [r.request_id for r in w.requests]
    assert [r.arrival_time for r in faster.requests] == pytest.approx([r.arrival_time / 4 for r in w.requests])
    assert faster.source["qps"] == 4.0 and faster.seed == w.seed


def test_same_seed_same_workload_and_prompts_other_seed_differs():
    a = Workload.synthetic("zipf:8-512:4-64:1.1", num_requests=40, qps=2.0, seed=11)
    b = Workload.synthetic("zipf:8-512:4-64:1.1", num_requests=40, qps=2.0, seed=11)
    c = Workload.synthetic("zipf:8-512:4-64:1.1", num_requests=40, qps=2.0, seed=12)
    assert a == b and a.prompt_token_ids(1000) == b.prompt_token_ids(1000)
    assert lengths(a) != lengths(c) and a.requests[5].arrival_time != c.requests[5].arrival_time


def test_prompts_match_lengths_stay_in_vocabulary_and_depend_only_on_the_request(trace):
    w = Workload.from_trace(trace, seed=2)
    prompts = w.prompt_token_ids(vocab_size=500)
    assert [len(p) for p in prompts] == [r.prompt_len for r in w.requests]
    flat = np.concatenate(prompts)
    assert flat.min() >= 100 and flat.max() < 500
    subset = Workload.from_trace(trace, seed=2, num_requests=2, qps=9.0)
    assert subset.prompt_token_ids(500) == prompts[:2]
    assert min(min(p) for p in w.prompt_token_ids(vocab_size=150)) >= 0  # small vocabularies use every id


def test_synthetic_lengths_follow_their_distribution():
    fixed = Workload.synthetic("fixed:128:16", num_requests=10)
    assert set(lengths(fixed)) == {(128, 16)} and all(r.arrival_time == 0 for r in fixed.requests)
    uni = Workload.synthetic("uniform:10-20:3-5", num_requests=500, seed=1)
    ps, os_ = zip(*lengths(uni))
    assert set(ps) == set(range(10, 21)) and set(os_) == {3, 4, 5}
    zipf = Workload.synthetic("zipf:1-1000:1-100:1.2", num_requests=2000, seed=1)
    ps = np.array([p for p, _ in lengths(zipf)])
    assert ps.min() >= 1 and ps.max() <= 1000
    assert np.median(ps) < 20 and (ps == 1).mean() > 0.2  # heavy head: most requests are short
    clipped = Workload.synthetic("uniform:10-20:3-5", num_requests=50, max_prompt=12, max_output=4)
    assert max(p for p, _ in lengths(clipped)) == 12 and max(o for _, o in lengths(clipped)) == 4


@pytest.mark.parametrize("bad", ["fixed:10", "uniform:10-20", "zipf:5-1:1-2", "normal:1:2", "zipf:1-5:1-5:0",
                                 "fixed:a:b"])
def test_bad_length_specs_are_rejected(bad):
    with pytest.raises(ValueError, match="lengths="):
        parse_lengths(bad)


def test_bad_rates_and_scales_are_rejected(trace):
    with pytest.raises(ValueError, match="qps"):
        Workload.synthetic("fixed:1:1", num_requests=3, qps=0)
    with pytest.raises(ValueError, match="prompt_scale"):
        Workload.from_trace(trace, prompt_scale=-1)
    with pytest.raises(ValueError, match="max_output"):
        Workload.from_trace(trace, max_output=0)


def test_dict_round_trip_through_json_is_exact(trace):
    w = Workload.from_trace(trace, qps=1.5, prompt_scale=0.5, max_output=100, seed=4)
    back = Workload.from_dict(json.loads(json.dumps(w.to_dict())))
    assert back == w
    assert back.prompt_token_ids(1000) == w.prompt_token_ids(1000)


def test_request_specs_are_sorted_and_validated():
    with pytest.raises(AssertionError):
        Workload((RequestSpec("a", 2.0, 1, 1), RequestSpec("b", 1.0, 1, 1)))
    with pytest.raises(AssertionError):
        RequestSpec("a", 0.0, 0, 1)


def test_the_conversation_trace_scaled_for_a_cpu():
    w = Workload.from_trace("conversation", num_requests=200, prompt_scale=0.25, output_scale=0.25, max_prompt=256,
                            max_output=64)
    assert len(w) == 200 and max(p for p, _ in lengths(w)) == 256 and max(o for _, o in lengths(w)) <= 64
    assert 1 < w.qps < 10  # the production trace's own arrival rate, a few requests per second
    assert w.source["trace"] == "conversation"


def test_built_in_traces_ship_with_the_package_and_paths_still_work(tmp_path, monkeypatch):
    arxiv = Workload.from_trace("arxiv", num_requests=50, qps=2.0)
    assert len(arxiv) == 50 and arxiv.source["arrivals"] == "poisson"
    assert sum(p for p, _ in lengths(arxiv)) / 50 > 1000  # arXiv prompts are long
    csv_file = tmp_path / "mine.csv"
    csv_file.write_text("num_prefill_tokens,num_decode_tokens\n10,3\n20,4\n")
    mine = Workload.from_trace(csv_file)
    assert lengths(mine) == [(10, 3), (20, 4)] and mine.source["trace"] == "mine.csv"
    with pytest.raises(ValueError, match="'nope' is neither a built-in trace"):
        Workload.from_trace("nope")
    override = tmp_path / "traces"
    override.mkdir()
    (override / "arxiv.csv").write_text("num_prefill_tokens,num_decode_tokens\n7,2\n")
    monkeypatch.setenv("SARATHI_LITE_TRACES", str(override))
    assert lengths(Workload.from_trace("arxiv")) == [(7, 2)]


def test_check_fits_names_the_requests_that_exceed_max_model_len():
    wl = Workload.synthetic("fixed:100:28", num_requests=3, qps=1.0)
    wl.check_fits(128)  # exactly 128 tokens fits
    with pytest.raises(ValueError, match=r"3 request\(s\) .* more than max_model_len=127 tokens"):
        wl.check_fits(127)


def test_with_long_prompts_puts_a_few_very_long_prompts_among_the_others() -> None:
    base = Workload.synthetic("uniform:100-600:50-250", num_requests=200, qps=10.0, seed=3)
    w = base.with_long_prompts(5, 60_000)
    changed = [(a, b) for a, b in zip(base.requests, w.requests) if a != b]
    assert len(changed) == 5 and all(b.prompt_len == 60_000 and b.output_len == a.output_len for a, b in changed)
    assert [r.arrival_time for r in w.requests] == [r.arrival_time for r in base.requests]
    assert w.long_request_ids(600) == {b.request_id for _, b in changed}
    assert base.with_long_prompts(5, 60_000) == w, "drawn from the seed alone"
    assert w.at_qps(20.0).long_request_ids(600) == w.long_request_ids(600), "a rate change keeps the long ones"
    assert Workload.from_dict(json.loads(json.dumps(w.to_dict()))) == w
    assert w.source["long_prompts"] == {"num_long": 5, "prompt_len": 60_000, "output_len": None}
    assert {r.output_len for r in base.with_long_prompts(3, 9000, 7).requests if r.prompt_len == 9000} == {7}


@pytest.mark.parametrize(("args", "message"), [((0, 100), "num_long=0"), ((201, 100), "num_long=201"),
                                               ((2, 0), "prompt_len=0"), ((2, 10, -1), "output_len=-1")])
def test_with_long_prompts_rejects_bad_values_by_name(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Workload.synthetic("fixed:10:2", num_requests=200, seed=0).with_long_prompts(*args)
