"""The gated MLP activation: SiLU(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._flashinfer import load_flashinfer, use_flashinfer


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2 * I] (any leading dims) = [gate | up]. Returns [N, I] = ``silu(x[..., :I]) * x[..., I:]``.

    FlashInfer's ``activation.silu_and_mul`` for contiguous float16/bfloat16 CUDA tensors whose rows are a
    multiple of 16 bytes (computed in float32, rounded once; torch rounds silu(gate) before the multiply).
    """
    if x.is_contiguous() and (x.shape[-1] * x.element_size()) % 16 == 0 and use_flashinfer(x, module="silu_and_mul"):
        return load_flashinfer().activation.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # silu's output is fresh: multiply in place (the same product, one allocation)
