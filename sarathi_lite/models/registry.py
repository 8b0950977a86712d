"""Which model class serves a checkpoint: a registry keyed by the ``architectures`` of its ``config.json``, each
entry with the family's ``WeightMap``. A new family is one ``CausalLM`` class and one ``register`` call here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sarathi_lite.models.config import ModelConfig
from sarathi_lite.models.interface import CausalLM, WeightMap
from sarathi_lite.models.llama import LLAMA_WEIGHTS, LlamaForCausalLM
from sarathi_lite.models.parallel import TensorParallel
from sarathi_lite.models.qwen3 import Qwen3ForCausalLM


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One architecture: ``model_class(cfg, tp)`` builds its ``CausalLM``; ``weights`` maps its checkpoint names;
    ``model_type``: the ``config.json`` ``model_type`` it reads (for checkpoints that name no architectures)."""

    architecture: str
    model_class: Callable[[ModelConfig, TensorParallel | None], CausalLM]
    weights: WeightMap
    model_type: str


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> None:
    """Serve checkpoints whose ``architectures`` name ``spec.architecture`` with ``spec``. Raises ``ValueError``
    if another spec already has that architecture."""
    if spec.architecture in _REGISTRY:
        raise ValueError(f"architecture {spec.architecture!r} is already registered")
    _REGISTRY[spec.architecture] = spec


def registered_architectures() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def model_spec(architectures: Sequence[str] | None, model_type: str | None = None) -> ModelSpec:
    """The spec of the first of ``architectures`` (a checkpoint's ``config.json`` list) that is registered; a
    checkpoint that names none is read by its ``model_type``. Raises ``ValueError`` naming the architectures
    and the registered ones."""
    for name in architectures or ():
        if name in _REGISTRY:
            return _REGISTRY[name]
    if not architectures:
        for spec in _REGISTRY.values():
            if spec.model_type == model_type:
                return spec
        raise ValueError(f"config.json names no architectures and model_type={model_type!r} has no registered "
                         f"model (registered: {', '.join(_REGISTRY)})")
    raise ValueError(f"architecture {', '.join(architectures)} is not supported (registered: "
                     f"{', '.join(_REGISTRY)})")


for _architecture, _model_type, _class in (("LlamaForCausalLM", "llama", LlamaForCausalLM),
                                           ("MistralForCausalLM", "mistral", LlamaForCausalLM),
                                           ("Qwen2ForCausalLM", "qwen2", LlamaForCausalLM),
                                           ("Qwen3ForCausalLM", "qwen3", Qwen3ForCausalLM)):
    register(ModelSpec(_architecture, _class, LLAMA_WEIGHTS, _model_type))
