"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2) that runs one flat hybrid batch per forward; a ``CausalLM``
(``sarathi_lite.models.interface``). Families that differ only in attention (Qwen3) subclass it with their own
``attention_class``.

The model never sees scheduling: each ``Attention`` layer holds a reference to the step's planned attention
backend and its own KV cache (set by the model runner), so the forward only takes token ids and positions.
Built with a ``TensorParallel`` of size N, every rank holds 1/N of the heads, of the MLP and of the vocabulary
(``sarathi_lite.models.parallel``) and runs the same forward, with two all-reduces per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from sarathi_lite.kernels import AttentionBackend, RotaryEmbedding, fused_add_rms_norm, rms_norm, silu_and_mul
from sarathi_lite.models.config import ModelConfig, check_tensor_parallel
from sarathi_lite.models.interface import WeightMap
from sarathi_lite.models.parallel import (
    AttentionShard,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [N, hidden]. With ``residual``, returns ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """Paged attention over the step's batch. ``backend`` and ``kv_cache`` are bound by the model runner."""

    def __init__(self) -> None:
        super().__init__()
        self.backend: AttentionBackend | None = None
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] -> [N, Hq, D]."""
        return self.backend.forward(q, k, v, self.kv_cache)


class LlamaAttention(nn.Module):
    """This rank's heads (``AttentionShard``): column-parallel QKV, row-parallel output projection."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        shard = AttentionShard.of(cfg, tp)
        d = self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.q_size, self.kv_size = shard.num_heads * d, shard.num_kv_heads * d
        kv_part = (cfg.num_kv_heads * d, shard.kv_start * d, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [(cfg.num_heads * d, shard.q_start * d, self.q_size),
                                                               kv_part, kv_part], bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(shard.q_start * d, self.q_size, cfg.hidden_size,
                                        bias=cfg.attention_bias and cfg.model_type != "qwen2", tp=tp)
        self.rotary_emb: RotaryEmbedding | None = None  # shared by all layers, see LlamaForCausalLM.init_rotary
        self.attn = Attention()

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> q [N, num_heads, head_dim], k and v [N, num_kv_heads, head_dim] (before rotary)."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.reshape(n, self.num_heads, self.head_dim), k.reshape(n, self.num_kv_heads, self.head_dim),
                v.reshape(n, self.num_kv_heads, self.head_dim))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v).reshape(x.shape[0], self.q_size))


class LlamaMLP(nn.Module):
    """This rank's 1/N of the intermediate features: column-parallel gate/up, row-parallel down projection."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        size = cfg.intermediate_size // tp.size
        part = (cfg.intermediate_size, tp.rank * size, size)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [part, part], bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(tp.rank * size, size, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, attention_class: type[LlamaAttention] = LlamaAttention
                 ) -> None:
        super().__init__()
        self.self_attn = attention_class(cfg, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, attention_class: type[LlamaAttention] = LlamaAttention
                 ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp, attention_class) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flat batch.

    ``forward(input_ids [N] int64, positions [N] int64) -> hidden [N, hidden_size]``;
    ``compute_logits(hidden [M, hidden_size]) -> [M, vocab_size]`` float32, called only on rows that sample
    (every rank calls it; ranks other than 0 get ``None``).
    tp: this process's tensor-parallel rank and group (default: one rank, no sharding). ``num_heads`` and
    ``num_kv_heads`` are this rank's head counts (the attention backends and the KV cache are sized by them).
    attention_class: each layer's attention (a subclass of ``LlamaAttention`` for a family that differs there).
    """

    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp or TensorParallel.single()
        check_tensor_parallel(cfg, self.tp.size)
        shard = AttentionShard.of(cfg, self.tp)
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.model = LlamaModel(cfg, self.tp, self.attention_class)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """The LM head shares the input embedding's weight when the checkpoint ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def init_rotary(self, device: torch.device) -> None:
        """Build the rotary cos/sin cache on ``device`` once and share it across layers."""
        cfg = self.config
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                               device=device)
        for layer in self.model.layers:
            layer.self_attn.rotary_emb = rope

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]


LLAMA_WEIGHTS = WeightMap(
    fused={"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)},
    skip=("rotary_emb.inv_freq",))
"""Hugging Face's Llama checkpoint names (also Mistral's, Qwen2's, Qwen3's): q/k/v and gate/up are fused here."""
