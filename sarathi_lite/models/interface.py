"""What the engine needs from a model, written down: the ``CausalLM`` protocol every model family implements, and
the ``WeightMap`` that says how a family's checkpoint names become its parameters' names.

``ModelRunner`` binds an attention backend and a KV cache view into each of ``attention_layers()``, then calls
``model(input_ids, positions)`` once per step and ``compute_logits`` on the rows that sample; the loader builds the
model on the meta device, ``tie_weights()`` after materializing it, fills the parameters by name through the
family's ``WeightMap``, then calls ``init_rotary(device)``. Model code never sees scheduling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from sarathi_lite.kernels import AttentionBackend
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.models.parallel import TensorParallel


@runtime_checkable
class AttentionLayer(Protocol):
    """One layer's paged attention: the model runner sets ``backend`` (the step's planned backend) and
    ``kv_cache`` (this layer's view ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``) once."""

    backend: AttentionBackend | None
    kv_cache: torch.Tensor | None


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only causal LM over one flat batch, as ``ModelRunner`` and the loader use it.

    config: the checkpoint's shape (``num_layers``, ``head_dim``, ``layer_windows`` size the KV cache and the
        attention backends). tp: this process's tensor-parallel rank and group. num_heads, num_kv_heads: this
        rank's query and KV heads (the KV cache and the backends are sized by them).
    """

    config: ModelConfig
    tp: TensorParallel
    num_heads: int
    num_kv_heads: int

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [N] int64, positions [N] int64 -> hidden states [N, hidden_size]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [M, hidden_size] -> logits [M, vocab_size] float32 on rank 0 (``None`` on other ranks)."""
        ...

    def attention_layers(self) -> Sequence[AttentionLayer]:
        """The attention layers in layer order (one per ``config.layer_windows`` entry)."""
        ...

    def init_rotary(self, device: torch.device) -> None:
        """Build the rotary cos/sin cache on ``device`` (after the weights are loaded)."""
        ...

    def tie_weights(self) -> None:
        """Share the input embedding with the LM head when ``config.tie_word_embeddings`` (again after the
        parameters were materialized)."""
        ...


@dataclass(frozen=True, slots=True)
class WeightMap:
    """How a family's checkpoint tensor names become the model's parameter names.

    fused: checkpoint module name -> (the model's fused module, part index): e.g. ``q_proj`` -> (``qkv_proj``, 0)
        puts ``model.layers.3.self_attn.q_proj.weight`` in part 0 of ``model.layers.3.self_attn.qkv_proj.weight``.
        Any other name is the parameter's own.
    skip: substrings of checkpoint names that hold no parameter (e.g. a saved ``rotary_emb.inv_freq``).
    """

    fused: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    skip: tuple[str, ...] = ()

    def target(self, name: str) -> tuple[str, int | None]:
        """``(parameter name, part)`` of the checkpoint tensor ``name`` (part ``None``: the whole parameter)."""
        module, _, param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf in self.fused:
            fused, part = self.fused[leaf]
            return ".".join(p for p in (parent, fused, param) if p), part
        return name, None

    def num_parts(self, param_name: str) -> int:
        """How many checkpoint tensors fill the parameter ``param_name`` (1 unless it is fused)."""
        leaf = param_name.rpartition(".")[0].rpartition(".")[2]
        return sum(1 for fused, _ in self.fused.values() if fused == leaf) or 1

    def skips(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` holds no parameter."""
        return any(s in name for s in self.skip)
