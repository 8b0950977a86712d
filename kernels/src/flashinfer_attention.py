"""Paged attention with FlashInfer: one ``BatchPrefillWithPagedKVCacheWrapper`` serves prefill chunks and
decodes of a step together (written against flashinfer-python 0.6.13 .. 0.7.x; the calls are checked against the
installed one by tests/test_kernels_flashinfer_conformance.py)."""

from __future__ import annotations

import torch

from ._flashinfer import FAST_DTYPES, HEAD_DIMS, load_flashinfer
from .backend import AttentionBackend
from .metadata import AttentionMetadata


class FlashInferAttention(AttentionBackend):
    """FlashInfer's batch prefill kernel over the paged cache (NHD layout), bottom-right causal.

    ``plan`` hands FlashInfer the host-side int32 indptrs once per step (no device-to-host sync) and allocates the
    step's output buffer; ``forward`` appends the step's K/V with ``append_paged_kv_cache`` and runs the planned
    kernel into that buffer.

    head_dim: 64, 128 or 256 (what FlashInfer's paged-KV append and Hopper prefill kernels take; ValueError else).
    device: a CUDA device. dtype: float16 or bfloat16, the dtype of q, k, v and of the KV cache.
    workspace_bytes: FlashInfer's float workspace (split-KV partial results), allocated once.
    """

    name = "flashinfer"

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 window_left: int = -1, *, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 workspace_bytes: int = 128 << 20) -> None:
        super().__init__(num_qo_heads, num_kv_heads, head_dim, scale, window_left)
        if dtype not in FAST_DTYPES:
            raise ValueError(f"FlashInferAttention runs float16 or bfloat16, not {dtype}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"FlashInferAttention takes head_dim {', '.join(map(str, HEAD_DIMS))}, not {head_dim}")
        self._fi = load_flashinfer()
        self.dtype = dtype
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD")
        self._positions = torch.empty(0, dtype=torch.int32)

    def plan(self, meta: AttentionMetadata) -> None:
        """Plan FlashInfer's kernel for the step (host-side indptrs; kv_indices already on the device)."""
        super().plan(meta)
        if meta.num_tokens == 0:
            return
        self._positions = meta.positions.to(torch.int32)
        self._out = self._workspace.new_empty((meta.num_tokens, self.num_qo_heads, self.head_dim), dtype=self.dtype)
        self._wrapper.plan(
            torch.from_numpy(meta.qo_indptr_host),
            torch.from_numpy(meta.kv_indptr_host),
            meta.kv_indices,
            torch.from_numpy(meta.kv_last_page_len_host),
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            meta.block_size,
            causal=True,
            sm_scale=self.scale,
            window_left=self.window_left,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """q: [N, num_qo_heads, head_dim]; k, v: [N, num_kv_heads, head_dim] (last dim contiguous);
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim], updated in place; all in the backend's dtype
        (else ValueError: FlashInfer's append does not check) on the CUDA device.

        Returns [N, num_qo_heads, head_dim]: the step's output buffer, which the next ``forward`` overwrites (the
        model projects it before the next layer runs)."""
        meta = self.meta
        wrong = {name: t.dtype for name, t in (("q", q), ("k", k), ("v", v), ("kv_cache", kv_cache))
                 if t.dtype != self.dtype}
        if wrong:
            raise ValueError(f"FlashInferAttention was made for {self.dtype}, got "
                             + ", ".join(f"{name} {dtype}" for name, dtype in wrong.items()))
        if meta.num_tokens == 0:
            return torch.empty_like(q)
        self._fi.page.append_paged_kv_cache(
            k, v, meta.batch_indices, self._positions, kv_cache, meta.kv_indices, meta.kv_indptr,
            meta.kv_last_page_len, kv_layout="NHD",
        )
        return self._wrapper.run(q, kv_cache, out=self._out)
