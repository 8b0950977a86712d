"""Pipeline-parallel stages of a Llama-family model: each stage holds a contiguous range of the layers
(``models.stages.stage_layers``), the first also the token embedding, the last also the final norm and the LM head.

A stage is a ``LlamaForCausalLM`` built on the stage's own config (``stage_config``: its layer count and their
sliding windows), so the model runner sizes its KV cache and binds its attention layers for those layers alone,
and the loader reads only their weights. The model still never sees communication: the engine's pipeline code
(``sarathi_lite.engine.pipeline``) hands a stage the previous stage's output in ``stage_input`` before the forward
pass and takes ``stage_output`` after it.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from sarathi_lite.models.config import ModelConfig
from sarathi_lite.models.llama import LlamaForCausalLM
from sarathi_lite.models.parallel import TensorParallel
from sarathi_lite.models.stages import stage_layers

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


@dataclasses.dataclass(slots=True, frozen=True)
class PipelineParallel:
    """This process's stage: ``stage`` in ``0 .. size - 1``."""

    stage: int = 0
    size: int = 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1


def stage_config(cfg: ModelConfig, pp: PipelineParallel) -> tuple[ModelConfig, range]:
    """``(the stage's config, the full model's layers it holds)``: ``cfg`` with ``num_layers`` and
    ``layer_windows`` of the stage's layers only."""
    layers = stage_layers(cfg.num_layers, pp.size, pp.stage)
    windows = cfg.layer_windows[layers.start:layers.stop] if cfg.layer_windows else cfg.layer_windows
    return dataclasses.replace(cfg, num_layers=len(layers), layer_windows=list(windows)), layers


class PipelineStageModel(LlamaForCausalLM):
    """Stage ``pp.stage`` of ``cfg`` (the full model's config; ``config`` is the stage's).

    ``forward(input_ids [N] int64, positions [N] int64)``: the first stage embeds ``input_ids``, the others start
    from ``stage_input`` (``(hidden [N, hidden_size], residual [N, hidden_size])`` of the previous stage); every
    stage runs its layers; the last returns the normed hidden states ``[N, hidden_size]``, the others set
    ``stage_output`` (``(hidden, residual)``) and return the hidden states. ``compute_logits`` is ``None`` but on
    the last stage. ``checkpoint_name`` maps a checkpoint weight's name to this stage's (``None``: not held here).
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None, pp: PipelineParallel) -> None:
        local, layers = stage_config(cfg, pp)
        super().__init__(local, tp)
        self.pp, self.layers = pp, layers
        self.stage_input: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stage_output: tuple[torch.Tensor, torch.Tensor] | None = None
        keep_embedding = pp.is_first or (pp.is_last and cfg.tie_word_embeddings)  # a tied LM head needs it
        if not keep_embedding:
            self.model.embed_tokens = None
        if not pp.is_last:
            self.model.norm = None
            self.lm_head = None

    def checkpoint_name(self, name: str) -> str | None:
        m = _LAYER_NAME.match(name)
        if m:
            i = int(m.group(1))
            return f"model.layers.{i - self.layers.start}.{name[m.end():]}" if i in self.layers else None
        if name.startswith("model.embed_tokens."):
            return name if self.model.embed_tokens is not None else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.pp.is_last else None
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.pp.is_first:
            x, residual = self.model.embed_tokens(input_ids), None
        else:
            x, residual = self.stage_input
            self.stage_input = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        if self.pp.is_last:
            x, _ = self.model.norm(x, residual)
            return x
        self.stage_output = (x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden) if self.pp.is_last else None
