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
from sarathi_lite.sim.gpu_fit import (
    fit_calibration,
    fit_collective,
    predict_rows,
    read_collective_rows,
    read_profiles,
)

LLAMA2_7B = LayerShape(4096, 32, 32, 128, 11008, 32768)
CODELLAMA_34B = LayerShape(8192, 64, 8, 128, 22016, 32768)
LLAMA2_70B = LayerShape(8192, 64, 8, 128, 28672, 32768)
LLAMA3_8B = LayerShape(4096, 32, 8, 128, 14336, 128256)
LLAMA3_70B = LayerShape(8192, 64, 8, 128, 28672, 128256)
PHI2 = LayerShape(2560, 32, 32, 80, 10240, 51200, gated=False)
PHI2_OPS = tuple(op for op in OPERATORS if op != "post_attention_layernorm")

# (gpu, shape, tokens, tensor parallel, operators, measured ms: the sum of the row's operator medians in Vidur's
# measured profiles, microsoft/vidur commit 7d47513, data/profiling/compute/<gpu>/<org>/<model>/mlp.csv, MIT;
# repeated rows merged by their median)
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
# (gpu, GPUs, bytes, measured ms) from network/<gpu>_dgx/all_reduce.csv, all GPUs in one node; the H100 x4 pair
# straddles a step down NCCL really takes (every repetition agrees: 55 us at 10,158,080 bytes, 44 us just above)
KNOWN_ALL_REDUCES = [("a100", 2, 19922944, 0.1000), ("a100", 8, 134217728, 0.6750), ("h100", 2, 19922944, 0.0500),
                     ("h100", 8, 19922944, 0.0880), ("h100", 4, 10158080, 0.055), ("h100", 4, 10289152, 0.044),
                     ("a100", 4, 299008, 0.061), ("a100", 4, 839680, 0.023)]


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


def _step_times(model, exclude_comm=False):
    def step(out):
        return model.predict_step_time(out) - (model.comm_time(out) if exclude_comm else 0.0)
    decodes = [step(_batch([1000] * n)) for n in range(1, 257)]
    chunks = [step(_batch([1000] * 16, [(500, q, False)])) for q in range(1, 4097, 7)]
    contexts = [step(_batch([c] * 32)) for c in range(1, 8000, 97)]
    return decodes, chunks, contexts


@pytest.mark.parametrize("spec", ["roofline:h100:llama3-8b", "roofline:a100-80gb:mistral-7b",
                                  "roofline:8xh100:llama3-70b", "roofline:2xa100-80gb:yi-34b"])
def test_calibrated_step_time_never_falls_as_tokens_grow(spec):
    """Every operator's time and attention's never fall as a batch grows. On one GPU that is the whole step.
    Under tensor parallelism the all-reduces follow NCCL's measured times, which do fall over some sizes
    (protocol and algorithm switches: see the next test), so there the step less its collectives is monotone and
    the collectives are exactly the measured table."""
    model = load_cost_model(spec)
    assert isinstance(model, CalibratedCostModel)
    layer = model.calibration.layer_time(np.arange(1, 32769), model.shape)
    assert (np.diff(layer) >= 0).all()
    tp = model.tensor_parallel_size
    for times in _step_times(model, exclude_comm=tp > 1):
        assert all(b >= a for a, b in zip(times, times[1:]))
    if tp > 1:
        table = model.calibration.all_reduce
        for n in (1, 7, 64, 300, 2048):
            out = _batch([1000] * n)
            per_layer = table.time(model.allreduce_bytes_per_token * n, tp)
            gather = table.time(model.gather_bytes_per_sample * n / 2, tp)
            assert model.comm_time(out) == pytest.approx(2 * model.model.num_layers * per_layer + gather)


def test_all_reduce_table_keeps_real_dips_and_shrugs_off_sizes_whose_repetitions_disagree(tmp_path):
    """A measured file with a true step down at 8 MB (every repetition agrees) and isolated sizes in a slow state
    (repetitions 3x apart): the fit keeps the step, ignores the isolated sizes, and flags them unstable."""
    path = tmp_path / "all_reduce.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["", "time_stats.all_reduce.min", "time_stats.all_reduce.max", "time_stats.all_reduce.median",
                    "num_workers", "devices_per_node", "size"])
        for i, size in enumerate(range(1 << 20, 8 << 20, 1 << 16)):  # 2 MB to 16 MB of fp16
            nbytes = 2 * size
            fast = 0.02 + nbytes / 300e9 * 1e3 - (0.012 if nbytes >= 8 << 20 else 0.0)
            if i % 17 == 5:
                w.writerow([i, fast, 3 * fast, 3 * fast, 4, 4, size])  # slow state, one repetition fast
            else:
                w.writerow([i, fast * 0.99, fast * 1.01, fast, 4, 4, size])
            w.writerow([i, 1.0, 1.0, 1.0, 4, 2, size])  # across nodes: not tensor parallel
    rows = read_collective_rows(path)
    assert list(rows) == [4]
    assert (~rows[4].stable).sum() == len(range(5, len(rows[4].nbytes), 17))
    curve = fit_collective(rows)
    below, above = (8 << 20) - (1 << 17), 8 << 20
    assert curve.time(below, 4) * 1e3 == pytest.approx(0.02 + below / 300e9 * 1e3, rel=0.03)
    assert curve.time(above, 4) * 1e3 == pytest.approx(0.008 + above / 300e9 * 1e3, rel=0.03)
    assert curve.time(above, 4) < curve.time(below, 4)  # the dip is kept, not averaged away
    for i in np.flatnonzero(~rows[4].stable):  # slow-state sizes predicted at the fast state around them
        assert curve.time(rows[4].nbytes[i], 4) == pytest.approx(rows[4].seconds[i] / 3, rel=0.05)
    beyond = [curve.time(b, 4) for b in (17e6, 32e6, 64e6)]
    assert all(b > a for a, b in zip(beyond, beyond[1:]))  # extrapolated at the large messages' bandwidth
    with pytest.raises(ValueError, match="usable sizes"):
        fit_collective({2: (np.array([1.0]), np.array([1e-5]))})


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


def test_remembered_operator_times_stay_bounded(monkeypatch):
    from sarathi_lite.costs import calibrated

    monkeypatch.setattr(calibrated, "_MAX_REMEMBERED", 3)
    model = load_cost_model("roofline:h100:llama3-8b")
    fresh = load_cost_model("roofline:h100:llama3-8b")
    for n in range(1, 11):  # ten different token counts: the store is cleared, never past 3
        b = _batch([1000] * n)
        assert model.predict_step_time(b) == fresh.predict_step_time(b)
        assert len(model._operator_times) <= 3


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
