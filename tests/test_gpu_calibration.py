"""The calibrated GPU cost model: its package data loads and predicts measured rows (quoted below from Vidur's
files, so nothing outside the repository is read), its step times never fall as a batch grows, the spec names
pick calibrated and uncalibrated models, and the fitter recovers a calibration from files laid out like Vidur's."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from sarathi_lite.costs import load_cost_model
from sarathi_lite.costs.calibrated import (
    OPERATORS,
    CalibratedCostModel,
    LayerShape,
    calibrated,
    load_calibration,
)
from sarathi_lite.costs.roofline import RooflineCostModel
from sarathi_lite.scheduler import ScheduledRequest, SchedulerOutput
from sarathi_lite.sim.gpu_fit import fit_calibration, predict_rows, read_profiles

LLAMA2_7B = LayerShape(4096, 32, 32, 128, 11008, 32768)
CODELLAMA_34B = LayerShape(8192, 64, 8, 128, 22016, 32768)
LLAMA2_70B = LayerShape(8192, 64, 8, 128, 28672, 32768)
LLAMA3_8B = LayerShape(4096, 32, 8, 128, 14336, 128256)
LLAMA3_70B = LayerShape(8192, 64, 8, 128, 28672, 128256)
PHI2 = LayerShape(2560, 32, 32, 80, 10240, 51200, gated=False)
PHI2_OPS = tuple(op for op in OPERATORS if op != "post_attention_layernorm")

# (gpu, shape, tokens, tensor parallel, operators, measured ms: the sum of the row's operator medians in
# ../shared/gpu-profiles/compute/<gpu>/<model>/mlp.csv, repeated rows merged by their median)
KNOWN_ROWS = [
    ("h100", LLAMA2_7B, 1, 1, OPERATORS, 0.1770),
    ("h100", LLAMA2_7B, 4096, 1, OPERATORS, 2.7193),
    ("h100", CODELLAMA_34B, 512, 2, OPERATORS, 0.6380),
    ("h100", LLAMA2_70B, 64, 8, OPERATORS, 0.1180),
    ("a100", LLAMA3_8B, 1, 1, OPERATORS, 0.3060),
    ("a100", LLAMA3_8B, 2048, 1, OPERATORS, 4.6125),
    ("a100", LLAMA3_70B, 16384, 4, OPERATORS, 34.4932),
    ("a100", PHI2, 256, 1, PHI2_OPS, 0.2890),
]
# (gpu, GPUs, bytes, measured ms) from network/<gpu>_dgx/all_reduce.csv, all GPUs in one node
KNOWN_ALL_REDUCES = [("a100", 2, 19922944, 0.1000), ("a100", 8, 134217728, 0.6750), ("h100", 2, 19922944, 0.0500),
                     ("h100", 8, 19922944, 0.0880)]


def _batch(decodes=(), chunks=()) -> SchedulerOutput:
    out = SchedulerOutput()
    for i, context in enumerate(decodes):
        out.add(ScheduledRequest(f"d{i}", context, 1, [0], [0], True, False))
    for i, (computed, new, sample) in enumerate(chunks):
        out.add(ScheduledRequest(f"p{i}", computed, new, [0] * new, [0], sample, True))
    return out


@pytest.mark.parametrize("gpu,shape,tokens,tp,ops,measured_ms", KNOWN_ROWS)
def test_package_data_predicts_measured_layer_times(gpu, shape, tokens, tp, ops, measured_ms):
    cal = load_calibration(gpu)
    rank = dataclasses.replace(shape, tensor_parallel=tp)
    predicted = float(cal.layer_time(tokens, rank, ops)[0]) * 1e3
    assert predicted == pytest.approx(measured_ms, rel=0.10)


@pytest.mark.parametrize("gpu,workers,nbytes,measured_ms", KNOWN_ALL_REDUCES)
def test_package_data_predicts_measured_all_reduces(gpu, workers, nbytes, measured_ms):
    assert load_calibration(gpu).all_reduce.time(nbytes, workers) * 1e3 == pytest.approx(measured_ms, rel=0.10)


def test_package_data_is_small_and_names_its_source_and_license():
    data = Path(__file__).resolve().parents[1] / "sarathi_lite" / "costs" / "data"
    for gpu in ("a100", "h100"):
        assert (data / f"{gpu}.json").stat().st_size < 16_000
        assert "vidur" in load_calibration(gpu).meta["source"].lower()
    assert "MIT" in (data / "LICENSE").read_text() and "Microsoft" in (data / "LICENSE").read_text()
    assert not list(data.glob("*.csv"))


@pytest.mark.parametrize("spec", ["roofline:h100:llama3-8b", "roofline:a100-80gb:mistral-7b",
                                  "roofline:8xh100:llama3-70b", "roofline:2xa100-80gb:yi-34b"])
def test_calibrated_step_time_never_falls_as_tokens_grow(spec):
    model = load_cost_model(spec)
    assert isinstance(model, CalibratedCostModel)
    layer = model.calibration.layer_time(np.arange(1, 32769), model.shape)
    assert (np.diff(layer) >= 0).all()
    decodes = [model.predict_step_time(_batch([1000] * n)) for n in range(1, 257)]
    chunks = [model.predict_step_time(_batch([1000] * 16, [(500, q, False)])) for q in range(1, 4097, 7)]
    contexts = [model.predict_step_time(_batch([c] * 32)) for c in range(1, 8000, 97)]
    for times in (decodes, chunks, contexts):
        assert all(b >= a for a, b in zip(times, times[1:]))
    sizes = np.geomspace(1e3, 1e9, 400)
    for workers in model.calibration.all_reduce.knots:
        times = [model.calibration.all_reduce.time(b, workers) for b in sizes]
        assert all(b >= a for a, b in zip(times, times[1:]))


def test_remembered_operator_times_equal_freshly_computed_ones():
    model, fresh = load_cost_model("roofline:h100:llama3-8b"), load_cost_model("roofline:h100:llama3-8b")
    batches = [_batch([1000] * 32), _batch([1000] * 16, [(500, 300, False)]), _batch([], [(0, 700, True)]),
               _batch([2000] * 32), _batch([1000] * 16, [(800, 300, True)])]
    first = [model.predict_step_time(b) for b in batches]
    again = [model.predict_step_time(b) for b in batches]  # the same (tokens, sampled) pairs, now remembered
    assert len(model._operator_times) == 4  # 32 decodes at 1k and at 2k context share their operators
    assert first == again
    for b in batches:
        tokens, sampled = b.num_prefill_tokens + b.num_decode_tokens, sum(s.sample for s in b.scheduled)
        assert model.operators_time(b) == fresh._operators_time(tokens, sampled)


def test_roofline_specs_are_calibrated_where_measured_and_the_old_formula_stays_available():
    cal, old = load_cost_model("roofline:h100:llama3-8b"), load_cost_model("roofline-uncalibrated:h100:llama3-8b")
    assert type(old) is RooflineCostModel and isinstance(cal, CalibratedCostModel)
    assert cal.describe()["kind"] == "calibrated" and old.describe()["kind"] == "roofline"
    hybrid = _batch([1000] * 32, [(1000, 480, False)])
    assert cal.predict_step_time(hybrid) > old.predict_step_time(hybrid)  # the formula is optimistic
    assert cal.kv_cache_memory == old.kv_cache_memory  # same deployment, same KV pool
    assert type(load_cost_model("roofline:h200")) is RooflineCostModel  # no H200 measurements
    with pytest.raises(ValueError, match="no GPU measurements for 'h200'"):
        calibrated("h200")
    with pytest.raises(ValueError, match="unknown hardware"):
        load_cost_model("roofline:tpu")


def test_attention_is_analytic_and_a_bounded_share_of_typical_steps():
    model = load_cost_model("roofline:h100:llama3-8b")
    short_decodes, hybrid = _batch([500] * 32), _batch([1000] * 32, [(1000, 480, False)])
    assert model.attention_share(short_decodes) < 0.15
    assert model.attention_share(hybrid) < 0.15
    assert model.attention_share(_batch([4000] * 64)) > model.attention_share(short_decodes)


def _write_fake_profiles(root: Path) -> None:
    """Two model files of a made-up GPU whose times are the shipped H100 calibration's predictions, and an
    all-reduce file: a fit must recover them."""
    cal = load_calibration("h100")
    for name, shape in (("small", LLAMA2_7B), ("big", LLAMA2_70B)):
        path = root / "compute" / "fake" / "org" / name / "mlp.csv"
        path.parent.mkdir(parents=True)
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow([f"time_stats.{op}.median" for op in OPERATORS] + [
                "n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp", "num_tokens",
                "num_tensor_parallel_workers"])
            for tp in (1, 2, 4):
                rank = dataclasses.replace(shape, tensor_parallel=tp)
                for t in (1, 8, 64, 200, 512, 1000, 2048, 4096):
                    w.writerow([1e3 * float(cal.operator_time(op, t, rank)[0]) for op in OPERATORS] + [
                        shape.heads, shape.kv_heads, shape.hidden, shape.intermediate, shape.vocab, True, t, tp])
    net = root / "network" / "fake_dgx"
    net.mkdir(parents=True)
    for name in ("all_reduce", "send_recv"):
        with (net / f"{name}.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["", f"time_stats.{name}.median", "num_workers", "size"])
            for i, size in enumerate(range(1024, 4_000_000, 40_000)):
                w.writerow([i, 0.01 + size * 2 / 300e9 * 1e3, 2, size])


def test_the_fit_recovers_a_known_calibration_from_files_laid_out_like_vidurs(tmp_path):
    _write_fake_profiles(tmp_path)
    tables = read_profiles(tmp_path)
    assert sorted(t.model for t in tables) == ["big", "small"]
    fit = fit_calibration(tables, tmp_path / "network" / "fake_dgx", source="test")
    for t in tables:
        assert np.allclose(predict_rows(fit, t), t.measured, rtol=1e-3)
    assert fit.all_reduce.time(2 * 2_000_000, 2) == pytest.approx(1e-5 + 4_000_000 / 300e9, rel=0.01)
    with pytest.raises(ValueError, match="no compute"):
        read_profiles(tmp_path / "network")
