"""Packed bfloat16 and float32 weights on the CPU (``models.parallel.pack_weights``): the projections read a copy
of their weight in oneDNN's blocked layout (float32 from 4 rows on), give the products ``nn.functional.linear``
gives (to the dtype's rounding), and fall back to the weight itself once it is written.

Whether this CPU packs a dtype is ``cpu_packs(dtype)`` (bfloat16 needs AVX-512 or AVX-NE-CONVERT): each test
asserts packing where the CPU packs the dtype and the plain-weight fallback where it does not, and
``test_a_cpu_that_cannot_pack_keeps_the_plain_weights`` forces the fallback on every machine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sarathi_lite.models.loader import load_model
from sarathi_lite.models.parallel import (
    PACKED_EXACT_ROWS,
    PACKED_MAX_ROWS,
    PACKED_MIN_ROWS,
    PackedWeight,
    cpu_packs,
    pack_weights,
)

PACKS = {dtype: cpu_packs(dtype) for dtype in (torch.bfloat16, torch.float32)}


def _projections(model: nn.Module) -> list[PackedWeight]:
    return [m for m in model.modules() if isinstance(m, PackedWeight)]


def test_bfloat16_and_float32_projections_are_packed_and_float16_ones_are_not(tiny_checkpoints):
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(tiny_checkpoints["llama"], dtype, torch.device("cpu"))
        layers = len(model.model.layers)
        assert len(_projections(model)) == 4 * layers + 1  # qkv, o, gate_up, down per layer, and the LM head
        if PACKS[dtype]:
            assert all(m._packed is not None and m._packed.dtype == dtype for m in _projections(model))
        else:  # this CPU cannot pack the dtype: every projection reads its plain weight
            assert all(m._packed is None for m in _projections(model))
    fp16 = load_model(tiny_checkpoints["llama"], torch.float16, torch.device("cpu"))
    assert pack_weights(fp16) == 0 and all(m._packed is None for m in _projections(fp16))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2 ** -7), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v bias and tied embeddings
def test_packed_products_match_the_weights_own(tiny_checkpoints, kind, dtype, tol):
    model = load_model(tiny_checkpoints[kind], dtype, torch.device("cpu"))
    torch.manual_seed(0)
    with torch.inference_mode():
        for m in _projections(model):
            for rows in (1, 3, 4, 7, 33, 300):
                x = torch.randn(rows, m.weight.shape[1], dtype=dtype)
                bias = getattr(m, "bias", None)
                got = m.linear(x, bias)
                want = nn.functional.linear(x.double(), m.weight.double(), None if bias is None else bias.double())
                scale = want.abs().max().item()
                # the output's rounding (bfloat16: 8 bits of mantissa), not a different product
                assert got.dtype == dtype and (got.double() - want).abs().max().item() <= tol * scale


def test_the_packed_copy_is_read_from_min_to_max_rows(tiny_checkpoints):
    """Below ``PACKED_MIN_ROWS`` (float32: 4) and above ``PACKED_MAX_ROWS`` the weight itself is read: shown with a
    packed copy of another weight, which only the calls in between see."""
    model = load_model(tiny_checkpoints["llama"], torch.float32, torch.device("cpu"))
    proj = model.model.layers[0].mlp.down_proj
    other = torch.randn_like(proj.weight)
    proj._packed = torch.ops.mkldnn._reorder_linear_weight(other, 32)
    with torch.inference_mode():
        for rows in (1, 3, 4, 9, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 200):
            x = torch.randn(rows, proj.weight.shape[1])
            inside = PACKED_MIN_ROWS[torch.float32] <= rows <= PACKED_MAX_ROWS
            want = nn.functional.linear(x, other if inside else proj.weight)
            got = proj.linear(x)
            assert got.shape == (rows, proj.weight.shape[0])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_onednn_sees_a_bounded_set_of_row_counts(tiny_checkpoints, monkeypatch, dtype):
    """oneDNN keeps a primitive (about 0.6 MiB) for every row count it runs: the packed path passes its smallest to
    16 rows as they are and pads 17..64 to a multiple of 16, so it sees at most 19 row counts; the padding rows
    never reach the output. Where this CPU cannot pack the dtype, the packed path is never entered."""
    model = load_model(tiny_checkpoints["llama"], dtype, torch.device("cpu"))
    proj = model.model.layers[0].self_attn.o_proj
    seen = []
    real = torch.ops.mkldnn._linear_pointwise

    def record(x, *args):
        seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", record)
    torch.manual_seed(0)
    with torch.inference_mode():
        for rows in range(1, PACKED_MAX_ROWS + 1):
            x = torch.randn(rows, proj.weight.shape[1], dtype=dtype)
            want = nn.functional.linear(x.double(), proj.weight.double())
            got = proj.linear(x)
            assert got.shape[0] == rows
            tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
            assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item()
    if not PACKS[dtype]:
        assert seen == []
        return
    low = PACKED_MIN_ROWS[dtype]
    assert sorted(set(seen)) == [*range(low, PACKED_EXACT_ROWS + 1), 32, 48, 64]
    assert len(seen) == PACKED_MAX_ROWS - low + 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_runner_view_shares_the_packed_copies(tiny_checkpoints, dtype):
    """A second model runner's view of a packed model (``LLMEngine.from_model``) shares the packed copies (opaque
    oneDNN tensors, which cannot be deep-copied) as it shares the weights."""
    from sarathi_lite.engine.model_runner import runner_view

    model = load_model(tiny_checkpoints["llama"], dtype, torch.device("cpu"))
    view = runner_view(model)
    assert view is not model
    for a, b in zip(_projections(model), _projections(view)):
        assert a is not b and b._packed is a._packed and b.weight is a.weight
        assert (a._packed is not None) == PACKS[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_weight_written_after_packing_is_read_directly(tiny_checkpoints, dtype):
    model = load_model(tiny_checkpoints["llama"], dtype, torch.device("cpu"))
    proj = model.model.layers[0].mlp.gate_up_proj
    x = torch.randn(4, proj.weight.shape[1], dtype=dtype)
    with torch.inference_mode():
        assert proj.linear(x).abs().max().item() > 0
    with torch.no_grad():
        proj.weight.zero_()  # in place: the packed copy (if any) is stale now
    with torch.inference_mode():
        assert proj.linear(x).abs().max().item() == 0
    # packing again takes the new weight, where the CPU packs the dtype
    assert proj.pack() == PACKS[dtype]
    assert not PACKS[dtype] or proj._packed_version == proj.weight._version


def test_sarathi_lite_native_0_packs_nothing(tiny_checkpoints, monkeypatch):
    monkeypatch.setenv("SARATHI_LITE_NATIVE", "0")
    model = load_model(tiny_checkpoints["llama"], torch.bfloat16, torch.device("cpu"))
    assert pack_weights(model) == 0 and all(m._packed is None for m in _projections(model))


def test_a_cpu_that_cannot_pack_keeps_the_plain_weights(tiny_checkpoints, monkeypatch, caplog):
    """Forced here on every machine: where ``cpu_packs`` says no (an AVX2-only CPU for bfloat16), nothing is packed,
    the products are the plain weights' and a whole bfloat16 generation runs, equal to one with packing off."""
    import logging

    from sarathi_lite import LLMEngine, SamplingParams
    from sarathi_lite.models import parallel

    def generate() -> list[int]:
        engine = LLMEngine(tiny_checkpoints["llama"], dtype="bfloat16", chunk_size=16, block_size=8)
        engine.add_request("r", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=6))
        out = []
        while engine.has_unfinished_requests():
            out += [t for o in engine.step() for t in o.new_token_ids]
        return out

    monkeypatch.setenv("SARATHI_LITE_NATIVE", "0")
    want = generate()
    monkeypatch.delenv("SARATHI_LITE_NATIVE")
    cpu_packs.cache_clear()
    real = torch.ops.mkldnn._reorder_linear_weight

    def refuse(weight, *args):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
                               "avx512bw, avx512vl and avx512dq")
        return real(weight, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    try:
        with caplog.at_level(logging.INFO, logger=parallel.__name__):
            assert not cpu_packs(torch.bfloat16)
            assert not cpu_packs(torch.bfloat16)  # decided once: one log line
        assert sum("cannot pack torch.bfloat16" in r.getMessage() for r in caplog.records) == 1
        model = load_model(tiny_checkpoints["llama"], torch.bfloat16, torch.device("cpu"))
        assert all(m._packed is None for m in _projections(model))
        proj = model.model.layers[0].mlp.down_proj
        x = torch.randn(5, proj.weight.shape[1], dtype=torch.bfloat16)
        with torch.inference_mode():
            torch.testing.assert_close(proj.linear(x), nn.functional.linear(x, proj.weight))
        assert generate() == want and len(want) == 6
    finally:
        cpu_packs.cache_clear()
