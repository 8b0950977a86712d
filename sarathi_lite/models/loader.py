"""Build a model from a local Hugging Face checkpoint folder (``config.json`` + safetensors): the class and the
weight names come from the registry (``sarathi_lite.models.registry``), by the checkpoint's ``architectures``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from sarathi_lite.models.config import ModelConfig, read_config_json
from sarathi_lite.models.interface import CausalLM, WeightMap
from sarathi_lite.models.llama import LlamaForCausalLM
from sarathi_lite.models.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    pack_weights,
)
from sarathi_lite.models.pipeline import PipelineParallel, PipelineStageModel
from sarathi_lite.models.registry import model_spec

logger = logging.getLogger(__name__)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(path)!r}")
    return files


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device, load_format: str = "auto",
               tp: TensorParallel | None = None, pp: PipelineParallel | None = None) -> CausalLM:
    """The model of the checkpoint folder ``path`` on ``device`` in ``dtype`` (with ``tp``: this rank's shard;
    with ``pp`` of more than one stage: this stage's ``PipelineStageModel``, holding only its layers' weights):
    the registered class of its ``architectures``. Raises ``ValueError`` naming an unsupported architecture.

    load_format: ``"auto"`` reads the safetensors weights; ``"dummy"`` fills random weights (for benchmarks
    of model shapes whose weights are not at hand; only ``config.json`` is read).
    """
    path = Path(path)
    raw = read_config_json(path)
    spec = model_spec(raw.get("architectures"), raw.get("model_type"))
    cfg = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        if pp is not None and pp.size > 1:
            if spec.model_class is not LlamaForCausalLM:
                raise ValueError(f"pipeline_parallel_size={pp.size}: pipeline stages are built for the Llama family "
                                 f"(Llama, Mistral, Qwen2), not {spec.model_class.__name__}")
            model = PipelineStageModel(cfg, tp, pp)
        else:
            model = spec.model_class(cfg, tp)
    model = model.to_empty(device=device).to(dtype)
    if isinstance(model, PipelineStageModel):
        if cfg.tie_word_embeddings and model.lm_head is not None and model.model.embed_tokens is not None:
            model.lm_head.weight = model.model.embed_tokens.weight
    else:
        model.tie_weights()
    if load_format == "dummy":
        _init_dummy(model)
    elif load_format == "auto":
        _load_safetensors(model, cfg, _safetensors_files(path), spec.weights)
    else:
        raise ValueError(f"load_format={load_format!r} must be 'auto' or 'dummy'")
    model.init_rotary(device)
    pack_weights(model)  # bfloat16 / float32 on the CPU: the projections' weights in oneDNN's layout
    return model.eval()


@torch.no_grad()
def _init_dummy(model: CausalLM) -> None:
    gen = torch.Generator(device="cpu").manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))


@torch.no_grad()
def _load_safetensors(model: CausalLM, cfg: ModelConfig, files: list[Path], weights: WeightMap) -> None:
    """Copy each checkpoint tensor's share for this rank into the model (its name through ``weights``), reading
    only that share from disk (``safe_open(...).get_slice``): a rank of N never holds a full copy of a sharded
    weight."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                if weights.skips(hf_name):
                    continue
                if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                local = hf_name
                if isinstance(model, PipelineStageModel):  # this stage's weights only, by their local names
                    local = model.checkpoint_name(hf_name)
                    if local is None:
                        continue
                name, part = weights.target(local)
                if name not in params:
                    raise ValueError(f"checkpoint weight {hf_name!r} has no place in the model")
                target, tensor = _shard(modules[name.rsplit(".", 1)[0]], params[name], name, part,
                                        f.get_slice(hf_name))
                if target.shape != tensor.shape:
                    raise ValueError(f"checkpoint weight {hf_name!r} gives a shard of shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(target.shape)}")
                target.copy_(tensor.to(target.dtype))
                loaded.add(name if part is None else f"{name}#{part}")
    expected = set()
    for name in params:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts = weights.num_parts(name)
        if parts > 1:
            expected.update(f"{name}#{i}" for i in range(parts))
        else:
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    logger.info("loaded %d tensors from %d safetensors file(s) (tensor-parallel rank %d of %d)", len(loaded),
                len(files), model.tp.rank, model.tp.size)


def _shard(module: torch.nn.Module, param: torch.nn.Parameter, name: str, part: int | None, full: Any
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target, tensor)``: the view of ``param`` that this rank's share of the checkpoint tensor ``full`` (a
    safetensors slice) fills, and that share read from disk."""
    if isinstance(module, ColumnParallelLinear):
        offset, size, rows = module.shard(part, full)
        return param.narrow(0, offset, size), rows
    if isinstance(module, RowParallelLinear) and name.endswith(".weight"):
        return param, module.shard(full)
    if isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
        return param.narrow(0, 0, module.stop - module.start), module.shard(full)
    return param, full[:]
