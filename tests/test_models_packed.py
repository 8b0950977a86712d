"""Packed bfloat16 and float32 weights on the CPU (``models.parallel.pack_weights``): the projections read a copy
of their weight in oneDNN's blocked layout (float32 from 4 rows on), give the products ``nn.functional.linear``
gives (to the dtype's rounding), and fall back to the weight itself once it is written."""

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
    _can_pack,
    pack_weights,
)

pytestmark = pytest.mark.skipif(not _can_pack(torch.empty(1, 1, dtype=torch.bfloat16)),
                                reason="needs PyTorch's oneDNN (mkldnn) linear on this CPU")


def _projections(model: nn.Module) -> list[PackedWeight]:
    return [m for m in model.modules() if isinstance(m, PackedWeight)]


def test_bfloat16_and_float32_projections_are_packed_and_float16_ones_are_not(tiny_checkpoints):
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(tiny_checkpoints["llama"], dtype, torch.device("cpu"))
        layers = len(model.model.layers)
        assert all(m._packed is not None and m._packed.dtype == dtype for m in _projections(model))
        assert len(_projections(model)) == 4 * layers + 1  # qkv, o, gate_up, down per layer, and the LM head
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


def test_onednn_sees_a_bounded_set_of_row_counts(tiny_checkpoints, monkeypatch):
    """oneDNN keeps a primitive (about 0.6 MiB) for every row count it runs: the packed path passes 1..16 rows as
    they are and pads 17..64 to a multiple of 16, so it sees 19 row counts; the padding rows never reach the
    output."""
    model = load_model(tiny_checkpoints["llama"], torch.bfloat16, torch.device("cpu"))
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
            x = torch.randn(rows, proj.weight.shape[1], dtype=torch.bfloat16)
            want = nn.functional.linear(x.double(), proj.weight.double())
            got = proj.linear(x)
            assert got.shape[0] == rows
            assert (got.double() - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()
    assert sorted(set(seen)) == [*range(1, PACKED_EXACT_ROWS + 1), 32, 48, 64] and len(seen) == PACKED_MAX_ROWS


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


def test_a_weight_written_after_packing_is_read_directly(tiny_checkpoints):
    model = load_model(tiny_checkpoints["llama"], torch.bfloat16, torch.device("cpu"))
    proj = model.model.layers[0].mlp.gate_up_proj
    x = torch.randn(4, proj.weight.shape[1], dtype=torch.bfloat16)
    with torch.inference_mode():
        assert proj.linear(x).abs().max().item() > 0
    with torch.no_grad():
        proj.weight.zero_()  # in place: the packed copy is stale now
    with torch.inference_mode():
        assert proj.linear(x).abs().max().item() == 0
    assert proj.pack() and proj._packed_version == proj.weight._version  # packing again takes the new weight


def test_sarathi_lite_native_0_packs_nothing(tiny_checkpoints, monkeypatch):
    monkeypatch.setenv("SARATHI_LITE_NATIVE", "0")
    model = load_model(tiny_checkpoints["llama"], torch.bfloat16, torch.device("cpu"))
    assert pack_weights(model) == 0 and all(m._packed is None for m in _projections(model))
