"""Qwen3: the Llama-family decoder with an RMSNorm over each head's query and key (``q_norm``, ``k_norm``, weights
[head_dim] shared by all heads) before rotary, and no q/k/v bias by default. Everything else is
``LlamaForCausalLM``'s; under tensor parallelism every rank holds the whole (per-head) norm weights."""

from __future__ import annotations

import torch

from sarathi_lite.models.config import ModelConfig
from sarathi_lite.models.llama import LlamaAttention, LlamaForCausalLM, RMSNorm
from sarathi_lite.models.parallel import TensorParallel


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__(cfg, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``LlamaAttention.qkv``, with q [N, num_heads, head_dim] and k [N, num_kv_heads, head_dim] each
        RMS-normalized over head_dim."""
        q, k, v = super().qkv(x)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models (``Qwen3ForCausalLM`` checkpoints): ``LlamaForCausalLM`` with ``Qwen3Attention``."""

    attention_class = Qwen3Attention
