"""Packed bfloat16 weights on the CPU (``models.parallel.pack_weights``): the projections read a copy of their
weight in oneDNN's blocked layout, give the products ``nn.functional.linear`` gives (to bfloat16 rounding), and
fall back to the weight itself once it is written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sarathi_lite.models.loader import load_model
from sarathi_lite.models.parallel import PackedWeight, _can_pack, pack_weights

pytestmark = pytest.mark.skipif(not _can_pack(torch.empty(1, 1, dtype=torch.bfloat16)),
                                reason="needs PyTorch's oneDNN (mkldnn) linear on this CPU")


def _projections(model: nn.Module) -> list[PackedWeight]:
    return [m for m in model.modules() if isinstance(m, PackedWeight)]


def test_bfloat16_projections_are_packed_and_float32_ones_are_not(tiny_checkpoints):
    bf16 = load_model(tiny_checkpoints["llama"], torch.bfloat16, torch.device("cpu"))
    layers = len(bf16.model.layers)
    assert all(m._packed is not None for m in _projections(bf16))
    assert len(_projections(bf16)) == 4 * layers + 1  # qkv, o, gate_up, down per layer, and the LM head
    fp32 = load_model(tiny_checkpoints["llama"], torch.float32, torch.device("cpu"))
    assert pack_weights(fp32) == 0 and all(m._packed is None for m in _projections(fp32))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v bias and tied embeddings
def test_packed_products_match_the_weights_own(tiny_checkpoints, kind):
    model = load_model(tiny_checkpoints[kind], torch.bfloat16, torch.device("cpu"))
    torch.manual_seed(0)
    with torch.inference_mode():
        for m in _projections(model):
            for rows in (1, 7, 33, 300):
                x = torch.randn(rows, m.weight.shape[1], dtype=torch.bfloat16)
                bias = getattr(m, "bias", None)
                got = m.linear(x, bias)
                want = nn.functional.linear(x.float(), m.weight.float(), None if bias is None else bias.float())
                scale = want.abs().max().item()
                # bfloat16 rounding of the output (8 bits of mantissa), not a different product
                assert got.dtype == torch.bfloat16 and (got.float() - want).abs().max().item() <= 2 ** -7 * scale


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
