"""Attention backends and fused ops: each has a pure-torch reference and a FlashInfer fast path.

FlashInfer is optional: it is imported lazily, and only used for CUDA tensors when ``import flashinfer`` works.
"""

from __future__ import annotations

import logging

import torch

from ._flashinfer import (
    FAST_DTYPES,
    HEAD_DIMS,
    INSTALL_HINT,
    attention_unusable,
    flashinfer_available,
    warn_once,
)
from .activation import silu_and_mul
from .backend import AttentionBackend
from .cpu_attention import DTYPES as CPU_DTYPES
from .cpu_attention import CpuPagedAttention
from .cpu_native import paged_decode_library
from .cpu_native import unsupported as cpu_unsupported
from .flashinfer_attention import FlashInferAttention
from .metadata import AttentionMetadata, build_attention_metadata, scattered_block_tables
from .norm import fused_add_rms_norm, rms_norm
from .rotary import RotaryEmbedding, rope_inv_freq
from .sampling import apply_logit_bias, apply_penalties, compute_logprobs, sample
from .torch_attention import TorchPagedAttention

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuPagedAttention",
    "FlashInferAttention",
    "RotaryEmbedding",
    "TorchPagedAttention",
    "apply_logit_bias",
    "apply_penalties",
    "build_attention_metadata",
    "scattered_block_tables",
    "compute_logprobs",
    "flashinfer_available",
    "fused_add_rms_norm",
    "get_attention_backend",
    "rms_norm",
    "rope_inv_freq",
    "sample",
    "silu_and_mul",
]

BACKEND_NAMES = ("auto", "torch", "cpu", "flashinfer")
logger = logging.getLogger(__name__)


def _flashinfer_missing(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FlashInfer's attention cannot run on ``device`` in ``dtype`` here, or None if it can."""
    if not torch.cuda.is_available():
        return f"CUDA is not available (torch {torch.__version__})"
    if device.type != "cuda":
        return f"the device is {device}, not a CUDA device"
    if dtype not in FAST_DTYPES:
        return f"the dtype is {dtype}; FlashInfer runs float16 or bfloat16"
    if not flashinfer_available():
        return "flashinfer-python does not import"
    return None


def _cpu_missing(device: torch.device, dtype: torch.dtype, head_dim: int, num_qo_heads: int,
                 num_kv_heads: int) -> str | None:
    """Why the compiled CPU decode attention cannot run here, or None if it can (building it on first use)."""
    if device.type != "cpu":
        return f"the device is {device}, not the CPU"
    if dtype not in CPU_DTYPES:
        return f"the dtype is {dtype}; the compiled CPU kernel runs float32 or bfloat16"
    why = cpu_unsupported(head_dim, num_qo_heads // num_kv_heads, num_qo_heads)
    if why:
        return f"the compiled CPU kernel does not take {why}"
    if paged_decode_library() is None:
        return "the compiled CPU kernel did not build or load (see the log)"
    return None


def get_attention_backend(name: str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                          scale: float | None = None, window_left: int = -1,
                          device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """Make the attention backend ``name`` for one attention shape.

    name: "torch" (TorchPagedAttention, any device), "cpu" (CpuPagedAttention: the torch path with decodes in the
    compiled CPU kernel; RuntimeError saying why when it cannot run here), "flashinfer" (FlashInferAttention;
    raises RuntimeError saying what is missing: CUDA, a CUDA device, a float16/bfloat16 dtype, flashinfer-python,
    or its kernels, which must load, prebuilt or compiled by nvcc, and are loaded here; ValueError for a head_dim
    FlashInfer lacks), or "auto" (FlashInfer when all of those are present and head_dim is one of 64, 128, 256; on
    the CPU, "cpu" when its kernel builds and takes the shape and dtype; else torch; a CUDA half-precision setup
    that falls back for want of kernels or of a head_dim logs one warning). An unknown name raises ValueError.
    scale: softmax scale (default ``head_dim ** -0.5``); window_left: sliding window, -1 for none; device, dtype:
    where and in which dtype q and the KV cache will live.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    device = torch.device(device)
    if name == "torch":
        return TorchPagedAttention(num_qo_heads, num_kv_heads, head_dim, scale, window_left)
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        missing = _cpu_missing(device, dtype, head_dim, num_qo_heads, num_kv_heads)
        if not missing:
            return CpuPagedAttention(num_qo_heads, num_kv_heads, head_dim, scale, window_left)
        if name == "cpu":
            raise RuntimeError(f"attention backend 'cpu' is unavailable: {missing}")
        logger.debug("attention backend 'auto' uses torch: %s", missing)
        return TorchPagedAttention(num_qo_heads, num_kv_heads, head_dim, scale, window_left)
    missing = _flashinfer_missing(device, dtype)
    if missing and name == "auto":
        logger.debug("attention backend 'auto' uses torch: %s", missing)
        return TorchPagedAttention(num_qo_heads, num_kv_heads, head_dim, scale, window_left)
    if not missing and head_dim not in HEAD_DIMS:
        missing = f"FlashInfer's kernels take head_dim {', '.join(map(str, HEAD_DIMS))}, not {head_dim}"
        if name == "flashinfer":
            raise ValueError(missing)
    if not missing:
        missing = attention_unusable(device, dtype, head_dim, window_left)
    if name == "auto" and missing:
        warn_once(f"attention backend 'auto' uses torch: {missing}")
        return TorchPagedAttention(num_qo_heads, num_kv_heads, head_dim, scale, window_left)
    if missing:
        raise RuntimeError(f"attention backend 'flashinfer' is unavailable: {missing}. It needs a CUDA device, "
                           f"float16/bfloat16, flashinfer-python ({INSTALL_HINT}) and its kernels prebuilt or nvcc")
    return FlashInferAttention(num_qo_heads, num_kv_heads, head_dim, scale, window_left, device=device, dtype=dtype)
