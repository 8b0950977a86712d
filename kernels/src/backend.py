"""The attention backend interface every implementation (torch reference, FlashInfer) follows."""

from __future__ import annotations

import abc

import torch

from .metadata import AttentionMetadata


class AttentionBackend(abc.ABC):
    """Paged attention over a hybrid batch of prefill chunks and decodes, in one call per layer.

    ``plan(meta)`` runs once per step (host-side work: index tensors, masks, FlashInfer's plan); ``forward``
    runs once per layer: it writes the step's new K/V into their slots of ``kv_cache`` and returns attention
    of every query row over its own request's cache (bottom-right causal, optional sliding window).

    num_qo_heads, num_kv_heads, head_dim: attention shape (grouped-query when num_qo_heads > num_kv_heads).
    scale: softmax scale (usually ``head_dim ** -0.5``).
    window_left: a query at position p sees keys at positions >= p - window_left; -1 means no window.
    """

    name = "base"

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 window_left: int = -1) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window_left = window_left
        self.meta: AttentionMetadata | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare for one step's batch. Called once per step, before the layers run."""
        self.meta = meta

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """One layer's attention for the planned batch.

        q: [N, num_qo_heads, head_dim]; k, v: [N, num_kv_heads, head_dim] (the step's new tokens);
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim], updated in place.
        Returns [N, num_qo_heads, head_dim] in q's dtype.
        """
