"""Cost models: the profiled model's terms counted by hand, its fit recovering a known token curve and
coefficients from synthetic batches, its JSON file, the replay model, and the roofline model against hand
calculations (a decode batch is memory-bound, a long prefill compute-bound). Torch-free."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sarathi_lite.costs import load_cost_model
from sarathi_lite.costs.profiled import TERMS, ProfiledCostModel, batch_terms, token_basis
from sarathi_lite.costs.roofline import HARDWARE, MODEL_SHAPES, RooflineCostModel, _keys_seen, model_shape, roofline
from sarathi_lite.metrics import IterationRecord
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.scheduler import ScheduledRequest, SchedulerOutput
from sarathi_lite.sim.cost_model import ReplayCostModel, fit_profile, fit_quality, nnls

REPO = Path(__file__).resolve().parents[1]


def batch(decode_contexts=(), chunks=()) -> SchedulerOutput:
    """Decodes with these cached contexts, then prompt chunks ``(computed, new, sample)``."""
    out = SchedulerOutput()
    for i, ctx in enumerate(decode_contexts):
        out.add(ScheduledRequest(f"d{i}", ctx, 1, [0], [], True, False))
    for i, (computed, new, sample) in enumerate(chunks):
        out.add(ScheduledRequest(f"p{i}", computed, new, [0] * new, [], sample, True))
    return out


def random_batch(rng: np.random.Generator) -> SchedulerOutput:
    if rng.random() < 0.25:  # decode-only, small batches included
        return batch(rng.integers(1, 2000, int(rng.integers(1, 40))).tolist())
    decodes = rng.integers(1, 2000, int(rng.integers(0, 40))).tolist()
    chunks = [(int(rng.integers(0, 1000)), int(rng.integers(1, 512)), bool(rng.random() < 0.5))
              for _ in range(int(rng.integers(1, 3)))]
    return batch(decodes, chunks)


KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# a CPU-like dense-layer curve: flat-ish up to a few tokens, then a kernel switch, then linear
TRUE_CURVE = (0.040, 0.045, 0.070, 0.090, 0.095, 0.130, 0.175, 0.290, 0.520, 0.980)
TRUE_TERMS = {"decode_tokens": 5e-4, "prefill_chunks": 3e-3, "sampled": 1e-3, "prefill_attention": 2e-8,
              "decode_attention": 4e-7}


# ---------------------------------------------------------------------- profiled model


def test_batch_terms_count_tokens_chunks_samples_and_attention_work():
    out = batch([10], [(4, 6, False), (0, 3, True)])
    assert batch_terms(out) == (10, 1, 2, 2, 6 * 10 + 3 * 3, 11)
    assert TERMS == ("decode_tokens", "prefill_chunks", "sampled", "prefill_attention", "decode_attention")


def test_token_curve_interpolates_between_knots_and_extends_the_chord_over_its_top_two_octaves():
    model = ProfiledCostModel((1, 4, 8), (1.0, 4.0, 6.0))
    assert [model.token_time(t) for t in (0, 1, 2, 4, 6, 8)] == [1.0, 1.0, 2.0, 4.0, 5.0, 6.0]
    assert token_basis(6, (1, 4, 8)) == [0.0, 0.5, 0.5]
    # above the last knot (8): the chord from the largest knot at or below 8 / 4 (here 1), not the last segment,
    # whose slope rests on two knots' noise over a base of a quarter of the range
    assert model.token_time(15) == pytest.approx(6.0 + 7 * 5 / 7)
    top = ProfiledCostModel((1, 128, 256, 384, 512), (0.1, 0.4, 0.7, 1.0, 1.4))
    assert top.token_time(1024) == pytest.approx(1.4 + 512 * (1.4 - 0.4) / 384)
    with pytest.raises(ValueError, match="increasing"):
        ProfiledCostModel((4, 1), (1.0, 1.0))


def test_nnls_matches_least_squares_when_unconstrained_and_clamps_negative_coefficients():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (40, 4))
    assert nnls(a, a @ np.array([1.0, 0.5, 2.0, 0.25])) == pytest.approx([1.0, 0.5, 2.0, 0.25])
    b = a @ np.array([1.0, -0.5, 2.0, 0.0])
    x = nnls(a, b)
    assert x.min() >= 0 and x[1] == 0
    # optimality (Karush-Kuhn-Tucker): no zero coefficient could grow to lower the error, the others are at a
    # stationary point
    gradient = a.T @ (b - a @ x)
    assert (gradient[x == 0] <= 1e-9).all() and gradient[x > 0] == pytest.approx(0, abs=1e-9)


def test_fit_recovers_a_known_token_curve_and_coefficients_from_synthetic_batches():
    model = ProfiledCostModel(KNOTS, TRUE_CURVE, TRUE_TERMS)
    rng = np.random.default_rng(1)
    outs = [random_batch(rng) for _ in range(120)] + [batch([5] * n) for n in (1, 2, 3, 4, 6, 8)]
    terms = [batch_terms(o) for o in outs]
    exact = [model.predict(o).step_time for o in outs]
    curve, coefficients = fit_profile(terms, exact, KNOTS)
    assert curve == pytest.approx(TRUE_CURVE, rel=1e-6) and coefficients == pytest.approx(TRUE_TERMS, rel=1e-6)

    noisy = np.array(exact) * (1 + rng.normal(0, 0.01, len(exact)))  # 1% timing noise
    fitted = ProfiledCostModel(KNOTS, *fit_profile(terms, noisy, KNOTS))
    held_out = [random_batch(rng) for _ in range(60)]
    quality = fit_quality([fitted.predict(o).step_time for o in held_out],
                          [model.predict(o).step_time for o in held_out])
    assert quality["r2"] > 0.999 and quality["rel_err_max"] < 0.03
    c = fitted.coefficients
    assert fitted.token_times == pytest.approx(TRUE_CURVE, rel=0.05)
    # decodes always sample, so only their sum is well determined by noisy times: the cost of one more decode
    assert c["decode_tokens"] + c["sampled"] == pytest.approx(TRUE_TERMS["decode_tokens"] + TRUE_TERMS["sampled"],
                                                              rel=0.15)


def test_a_straight_line_cannot_fit_a_kernel_switch_but_the_token_curve_can():
    model = ProfiledCostModel(KNOTS, TRUE_CURVE, TRUE_TERMS)
    rng = np.random.default_rng(3)
    outs = [random_batch(rng) for _ in range(120)]
    terms = [batch_terms(o) for o in outs]
    times = [model.predict(o).step_time for o in outs]
    line = ProfiledCostModel((1, 512), *fit_profile(terms, times, (1, 512)))
    small = [batch([100] * n) for n in (1, 2, 4, 8)]
    errors = [abs(line.predict(o).step_time / model.predict(o).step_time - 1) for o in small]
    assert max(errors) > 0.2


def test_fit_keeps_coefficients_non_negative():
    rng = np.random.default_rng(2)
    outs = [random_batch(rng) for _ in range(30)]
    terms = np.array([batch_terms(o) for o in outs], dtype=float)
    times = 0.05 + 1e-4 * terms[:, 0] - 1e-9 * terms[:, 4]  # prefill attention "speeds up" a step
    design = np.column_stack([np.ones(len(times)), terms])
    assert np.linalg.lstsq(design, times, rcond=None)[0][5] < 0
    curve, coefficients = fit_profile(terms, times, (1, 512))
    assert min(curve) >= 0 and min(coefficients.values()) >= 0


def test_fit_quality_of_exact_and_biased_predictions():
    assert fit_quality([1.0, 2.0, 4.0], [1.0, 2.0, 4.0]) == {"r2": 1.0, "rel_err_p50": 0.0, "rel_err_p90": 0.0,
                                                             "rel_err_max": 0.0, "n": 3}
    q = fit_quality([1.1, 2.2, 4.4], [1.0, 2.0, 4.0])
    assert q["rel_err_p50"] == pytest.approx(0.1) and q["r2"] < 1


def test_jitter_draws_step_times_from_the_measured_spread_reproducibly_per_seed():
    model = ProfiledCostModel((1, 2), (0.1, 0.1), jitter=(0.8, 1.0, 1.0, 1.6))
    out = batch([5])

    def draws(seed: int) -> list[float]:
        model.reset(seed)
        return [model.predict(out).step_time for _ in range(3000)]

    first = draws(1)
    assert draws(1) == first and draws(2) != first
    assert 0.08 <= min(first) and max(first) <= 0.16
    # a third of the mass on each segment between quantiles: 0.8-1.0, exactly 1.0, 1.0-1.6
    assert np.mean(np.array(first) < 0.1) == pytest.approx(1 / 3, abs=0.03)
    assert np.mean(np.array(first) > 0.1) == pytest.approx(1 / 3, abs=0.03)
    assert np.mean(first) == pytest.approx(0.1 * (0.9 + 1.0 + 1.3) / 3, rel=0.02)
    assert ProfiledCostModel((1, 2), (0.1, 0.1)).predict(out).step_time == 0.1  # no jitter: deterministic
    with pytest.raises(ValueError, match="jitter"):
        ProfiledCostModel((1, 2), (0.1, 0.1), jitter=(1.2, 0.9))


def test_profiled_model_round_trips_through_its_json_file(tmp_path):
    model = ProfiledCostModel((1, 8, 64), (0.01, 0.02, 0.1), {"sampled": 1e-3}, schedule_constant=1e-5,
                              schedule_per_request=1e-6, step_gap=2e-5, kv_bytes_per_token=4096,
                              kv_cache_memory=1 << 30, max_position_embeddings=8192, jitter=(0.9, 1.0, 1.2),
                              meta={"model": "m", "threads": 2})
    back = load_cost_model(model.save(tmp_path / "p.json"))
    out = batch([5, 6], [(0, 7, True)])
    back.reset(3)
    model.reset(3)
    assert back.predict(out) == model.predict(out) and back.jitter == (0.9, 1.0, 1.2)
    assert back.predict(out).schedule_time == pytest.approx(1e-5 + 3e-6)
    assert (back.kv_cache_memory, back.step_gap, back.meta["threads"]) == (1 << 30, 2e-5, 2)
    assert back.describe()["file"] == str(tmp_path / "p.json")
    with pytest.raises(ValueError, match="unknown cost term"):
        ProfiledCostModel((1, 2), (1.0, 1.0), {"flops": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        ProfiledCostModel((1, 2), (1.0, -1.0))
    with pytest.raises(ValueError, match="missing.json' not found"):
        load_cost_model(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="neither"):
        load_cost_model("rooflin:h100")


def test_replay_model_replays_start_times_and_durations_then_stops():
    its = [IterationRecord(0, 10.5, 11.0, 0.1, 4, 0, 1, 0, 0), IterationRecord(1, 11.25, 12.0, 0.05, 0, 1, 0, 1, 0)]
    replay = ReplayCostModel(its, run_start=10.0)
    assert replay.start_time(0.0) == 0.5
    assert replay.predict(batch([1])).step_time == 0.5
    assert replay.start_time(1.0) == 1.25
    assert (replay.predict(batch([1])).schedule_time, replay.timings[1].step_time) == (0.05, 0.75)
    with pytest.raises(ValueError, match="only 2 iterations"):
        replay.start_time(2.0)


# ---------------------------------------------------------------------- roofline

# Llama-3-8B by hand: hidden 4096, 32 query heads and 8 KV heads of 128, MLP 14336, 32 layers, vocabulary 128256.
LAYER_PARAMS = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336  # 218,103,808
HEAD_PARAMS = 4096 * 128256
WEIGHT_BYTES = 2 * (32 * LAYER_PARAMS + HEAD_PARAMS)  # 15.0 GB of bf16
ACT_BYTES_PER_TOKEN = 2 * 32 * (4 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336)  # projection inputs and outputs
KV_BYTES_PER_TOKEN_LAYER = 2 * 2 * 1024
FLOPS, BANDWIDTH = 989e12 * 0.7, 3.35e12 * 0.85  # H100 SXM at the default efficiencies


def test_a_decode_batch_is_memory_bound_by_hand():
    model = roofline("h100", "llama3-8b")
    out = batch([1023] * 32)  # 32 decodes, each attending to 1024 keys
    a = model.analyze(out)
    assert a["linear_flops"] == 2 * (32 * LAYER_PARAMS + HEAD_PARAMS) * 32
    assert a["linear_bytes"] == WEIGHT_BYTES + ACT_BYTES_PER_TOKEN * 32
    assert a["attention_flops"] == 4 * 32 * 128 * 32 * (32 * 1024)
    kv_bytes = KV_BYTES_PER_TOKEN_LAYER * 32 * 32 * 1024 + (32 * KV_BYTES_PER_TOKEN_LAYER + 2 * 32 * 4096 * 2) * 32
    assert a["attention_bytes"] == kv_bytes
    assert (a["linear_bound"], a["attention_bound"]) == ("memory", "memory")
    expected = 1e-3 + (WEIGHT_BYTES + ACT_BYTES_PER_TOKEN * 32) / BANDWIDTH + kv_bytes / BANDWIDTH
    assert model.predict(out).step_time == pytest.approx(expected)
    assert 7.5e-3 < expected < 8.0e-3  # 5.3 ms of weights, 1.5 ms of KV cache, 1 ms of host


def test_a_long_prefill_is_compute_bound_by_hand():
    model = roofline("h100", "llama3-8b")
    out = batch(chunks=[(0, 4096, True)])
    a = model.analyze(out)
    assert a["attention_flops"] == 4 * 32 * 128 * 32 * (4096 * 4097 // 2)  # causal: query j sees j + 1 keys
    assert (a["linear_bound"], a["attention_bound"]) == ("compute", "compute")
    expected = 1e-3 + (2 * 32 * LAYER_PARAMS * 4096 + 2 * HEAD_PARAMS) / FLOPS + a["attention_flops"] / FLOPS
    assert model.predict(out).step_time == pytest.approx(expected)
    assert 0.085 < expected < 0.095  # about 57 TFLOP of projections and 4.4 TFLOP of attention


def test_faster_memory_speeds_up_decodes_but_not_prefills():
    h100, h200 = roofline("h100"), roofline("h200")
    decode, prefill = batch([2000] * 64), batch(chunks=[(0, 4096, True)])
    assert h200.predict(decode).step_time < 0.8 * h100.predict(decode).step_time
    assert h200.predict(prefill).step_time == pytest.approx(h100.predict(prefill).step_time)
    a100 = roofline("a100-80gb")
    assert a100.predict(prefill).step_time > 3 * h100.predict(prefill).step_time - 0.01


def test_kv_pool_is_what_is_left_of_device_memory_after_weights_and_a_reserve():
    model = roofline("h100", "llama3-8b")
    embeddings = HEAD_PARAMS * 2  # untied: the input embedding is a second vocabulary matrix
    assert model.kv_cache_memory == int(80e9 - WEIGHT_BYTES - embeddings - 8e9)
    assert model.kv_bytes_per_token == 32 * KV_BYTES_PER_TOKEN_LAYER
    assert model.max_position_embeddings == 8192
    with pytest.raises(ValueError, match="no memory"):
        RooflineCostModel(model.model, HARDWARE["a100-80gb"], dtype_bytes=4, memory_utilization=0.4)


def test_sliding_window_caps_the_keys_each_query_sees():
    for computed, new, window in [(0, 10, 4), (2, 3, 4), (5, 2, 4), (0, 3, 8), (3, 9, 5)]:
        brute = sum(min(computed + j + 1, window) for j in range(new))
        assert _keys_seen(computed, new, window) == brute
    windowed = RooflineCostModel(ModelConfig.from_dict({**MODEL_SHAPES["mistral-7b"], "sliding_window": 1024}),
                                 HARDWARE["h100"])
    full = load_cost_model("roofline:h100:mistral-7b")
    long_decodes = batch([8000] * 8)
    assert windowed.analyze(long_decodes)["attention_bytes"] < full.analyze(long_decodes)["attention_bytes"] / 4


def test_model_shapes_from_presets_and_config_files_agree():
    name, from_file = model_shape(REPO / "benchmarks" / "models" / "llama3-8b-shape")
    _, preset = model_shape("llama3-8b")
    out = batch([100, 200], [(0, 300, True)])
    assert name == "llama3-8b-shape"
    assert RooflineCostModel(from_file, HARDWARE["h200"]).predict(out) == \
        RooflineCostModel(preset, HARDWARE["h200"]).predict(out)
    assert load_cost_model("roofline:h200").describe()["device"] == "H200 SXM"
    with pytest.raises(ValueError, match="unknown hardware"):
        load_cost_model("roofline:tpu")
    with pytest.raises(ValueError, match="preset"):
        model_shape("gpt-5")

