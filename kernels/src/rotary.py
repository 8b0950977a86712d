"""Rotary position embedding, NeoX / Hugging Face "rotate_half" style, with Llama's rope scaling types."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ._flashinfer import load_flashinfer, use_flashinfer

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, base: float, scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies float32 [head_dim // 2], computed exactly as Hugging Face transformers does.

    scaling: the rope parameters beyond the base, transformers 5 names (``rope_type``, ``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``); the older ``type`` key
    is accepted too. None means the default (unscaled) rope. Raises NotImplementedError for other types.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    scaling = dict(scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported (supported: "
                                  f"{', '.join(SUPPORTED_ROPE_TYPES)})")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":  # transformers' _compute_llama3_parameters
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    return inv_freq


class RotaryEmbedding:
    """Rotary embedding with a cos/sin cache for positions ``0 .. max_position - 1``.

    head_dim: rotated dimension (the whole head). base: rope theta. scaling: see ``rope_inv_freq``.
    dtype: the dtype the torch path's cos/sin are kept in (they are cast to q's dtype when it differs, as Hugging
    Face does). device: where the cache lives (default: torch's current default device).

    ``cos_sin_cache``: float32 [max_position, head_dim], cos in the first half, sin in the second (FlashInfer's
    layout). Not an ``nn.Module``, so casting a model to bfloat16 never touches the float32 cache.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: Mapping[str, Any] | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if head_dim % 2:
            raise ValueError(f"head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = rope_inv_freq(head_dim, base, scaling)
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
        self._cos = self.cos_sin_cache[:, :head_dim // 2].to(dtype)
        self._sin = self.cos_sin_cache[:, head_dim // 2:].to(dtype)
        self._checked_positions: torch.Tensor | None = None
        # (positions, dtype, cos, sin) of the last call: a step's layers share one positions tensor, so the torch
        # path looks its cos/sin up once per step, not once per layer
        self._gathered: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 (or int32) [N], each in ``0 .. max_position - 1``; q: [N, Hq, head_dim];
        k: [N, Hkv, head_dim]; positions, q, k and the cache on one device (else ValueError).

        Returns the rotated ``(q, k)`` in their dtype. The torch path returns new tensors and matches Hugging
        Face's ``apply_rotary_pos_emb`` bit for bit. FlashInfer's ``apply_rope_with_cos_sin_cache_inplace``
        (float16/bfloat16 CUDA tensors, its ``rope`` kernels prebuilt or compilable) rotates q and k in place and
        returns them; it computes in float32 and rounds once, where Hugging Face rounds each product in q's dtype,
        so the two differ by about one rounding of that dtype. It reads the cache without bounds checks, so a
        positions tensor is checked against ``max_position`` the first time it is seen (one host sync per step,
        not per layer: the layers of a step share it); an out-of-range position raises ValueError.
        """
        if positions.device != q.device or self.cos_sin_cache.device != q.device:
            raise ValueError(f"positions ({positions.device}) and the cos/sin cache ({self.cos_sin_cache.device}) "
                             f"must be on q's device ({q.device})")
        if positions is not self._checked_positions and positions.numel():
            lo, hi = torch.stack(torch.aminmax(positions)).tolist()
            if lo < 0 or hi >= self.max_position:
                raise ValueError(f"positions span {lo} .. {hi}, outside the rotary cache's 0 .. "
                                 f"{self.max_position - 1}")
            self._checked_positions = positions
        if q.stride(-1) == 1 and k.stride(-1) == 1 and use_flashinfer(q, k, module="rope"):
            load_flashinfer().rope.apply_rope_with_cos_sin_cache_inplace(
                positions, q, k, self.head_dim, self.cos_sin_cache, is_neox=True)
            return q, k
        cos, sin = self._cos_sin(positions, q.dtype)
        both = _adjacent(q, k)
        if both is not None:  # one pass over q and k together (bit for bit the same as two)
            rotated = _rotate(both, cos, sin)
            return rotated[:, :q.shape[1]], rotated[:, q.shape[1]:]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, 1, head_dim / 2] of ``positions`` in ``dtype``, reused while the same positions tensor
        (the step's) comes back."""
        cached = self._gathered
        if cached is None or cached[0] is not positions or cached[1] != dtype:
            cos = self._cos.index_select(0, positions).to(dtype)[:, None, :]
            sin = self._sin.index_select(0, positions).to(dtype)[:, None, :]
            cached = self._gathered = (positions, dtype, cos, sin)
        return cached[2], cached[3]

    __call__ = forward


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [N, Hq, D] and k [N, Hkv, D] as one view [N, Hq + Hkv, D] when k's heads follow q's in memory, row by row
    (q and k split from one fused QKV projection's output), else None."""
    if q.dtype != k.dtype or q.device != k.device or q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0]:
        return None
    n, hq, d = q.shape
    if q.stride() != k.stride() or q.stride(2) != 1 or q.stride(1) != d or k.shape[2] != d:
        return None
    if k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr() or \
            k.storage_offset() != q.storage_offset() + hq * d:
        return None
    return q.as_strided((n, hq + k.shape[1], d), q.stride())


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * [cos, cos] + rotate_half(x) * [sin, sin]`` on x [N, H, D], cos/sin [N, 1, D/2]; the same roundings
    as Hugging Face's version (negation is exact), without materialising the duplicated halves. The halves are
    computed into one output with one scratch buffer (two fresh tensors instead of seven: on the CPU a fresh
    multi-megabyte tensor costs page faults)."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    lo, hi = out.chunk(2, dim=-1)
    scratch = torch.mul(x2, sin)
    torch.mul(x1, cos, out=lo).sub_(scratch)
    torch.mul(x1, sin, out=scratch)
    torch.mul(x2, cos, out=hi).add_(scratch)
    return out
