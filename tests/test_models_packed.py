"""Packed bfloat16 and float32 weights on the CPU (``models.parallel.pack_weights``): the projections read a copy
of their weight in oneDNN's blocked layout (float32 from 4 rows on), give the products ``nn.functional.linear``
gives (to the dtype's rounding), and fall back to the weight itself once it is written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sarathi_lite.models.loader import load_model
from sarathi_lite.models.parallel import PACKED_MIN_ROWS, PackedWeight, _can_pack, pack_weights

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


def test_float32_reads_its_packed_copy_from_four_rows_on(tiny_checkpoints):
    """Below ``PACKED_MIN_ROWS`` (float32: 4) the weight itself is read: shown with a packed copy of another
    weight, which only the calls of 4 rows and more see."""
    model = load_model(tiny_checkpoints["llama"], torch.float32, torch.device("cpu"))
    proj = model.model.layers[0].mlp.down_proj
    other = torch.randn_like(proj.weight)
    proj._packed = torch.ops.mkldnn._reorder_linear_weight(other, 32)
    with torch.inference_mode():
        for rows in (1, 3, 4, 9):
            x = torch.randn(rows, proj.weight.shape[1])
            want = nn.functional.linear(x, other if rows >= PACKED_MIN_ROWS[torch.float32] else proj.weight)
            torch.testing.assert_close(proj.linear(x), want, atol=1e-4, rtol=1e-4)


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
