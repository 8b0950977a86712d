"""Guarded, lazy import of flashinfer-python: nothing in ``sarathi_lite.kernels`` needs it to import or run.

flashinfer-python ships no kernels: each of its modules (``page``, ``norm``, ``rope``, ``silu_and_mul``,
``sampling``, one batch-prefill module per dtype / head_dim / window) is compiled by nvcc on first use, unless it
is prebuilt in the package's ``data/aot/<name>/<name>.so`` (scripts/build_flashinfer_aot.sh) or already in
FlashInfer's JIT cache. A fast path is only taken once its modules have loaded (prebuilt, or compiled where nvcc
is), so a CUDA machine without nvcc, or whose compile fails, runs the torch paths (with one warning) instead of
failing a request.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

INSTALL_HINT = ('pip install "sarathi-lite[flashinfer]" (flashinfer-python >= 0.6.13, < 0.8, and a CUDA build '
                'of torch)')
FAST_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer's attention and fused ops run these input dtypes
# head dims both FlashInfer's paged-KV append (64, 128, 256, 512) and its Hopper (fa3) prefill (64, 128, 256) take
HEAD_DIMS = (64, 128, 256)

logger = logging.getLogger(__name__)


@functools.cache
def _import() -> tuple[ModuleType | None, str]:
    try:
        import flashinfer
    except Exception as e:  # ImportError, or an error raised while it loads its CUDA libraries
        return None, f"{type(e).__name__}: {e}"
    return flashinfer, ""


def flashinfer_available() -> bool:
    """Whether ``import flashinfer`` succeeds (the result is cached)."""
    return _import()[0] is not None


def load_flashinfer() -> ModuleType:
    """The flashinfer module; raises RuntimeError saying why it cannot be imported and how to install it."""
    module, error = _import()
    if module is None:
        raise RuntimeError(f"flashinfer-python is not importable ({error}); install it with {INSTALL_HINT}")
    return module


def find_nvcc() -> str | None:
    """The nvcc FlashInfer would compile with (``FLASHINFER_NVCC``, ``$CUDA_HOME/bin/nvcc``, ``$CUDA_PATH/bin/nvcc``
    or nvcc on PATH, in its order), or None when there is none; compiling also needs ninja on PATH."""
    if shutil.which("ninja") is None:
        return None
    explicit = os.environ.get("FLASHINFER_NVCC")
    if explicit:
        return shutil.which(explicit)
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        nvcc = Path(cuda_home) / "bin" / "nvcc"
        return str(nvcc) if nvcc.exists() else None
    return shutil.which("nvcc")


def prebuilt(name: str) -> bool:
    """Whether FlashInfer's module ``name`` loads without compiling: in its AOT folder or already JIT-compiled."""
    from flashinfer.jit import env as jit_env

    return any((folder / name / f"{name}.so").exists()
               for folder in (jit_env.FLASHINFER_AOT_DIR, jit_env.FLASHINFER_JIT_DIR))


def missing_modules(*names: str) -> str | None:
    """Why FlashInfer's modules ``names`` cannot be loaded here (none prebuilt for some, and no nvcc + ninja to
    compile them), or None when they can."""
    if find_nvcc() is not None:
        return None
    absent = [name for name in names if not prebuilt(name)]
    if not absent:
        return None
    return (f"FlashInfer's kernels {', '.join(absent)} are neither prebuilt nor compilable (no nvcc and ninja; "
            f"see scripts/build_flashinfer_aot.sh)")


def batch_prefill_spec(device: torch.device, dtype: torch.dtype, head_dim: int, window_left: int
                       ) -> tuple[str, tuple]:
    """``(backend, args)`` of the batch-prefill module FlashInfer's ``plan()`` loads for FlashInferAttention's
    arguments on ``device`` (CUDA): the backend FlashInfer's "auto" picks there (fa3 on Hopper, else fa2), q/kv/o
    in ``dtype``, int32 indices, no positional encoding in the kernel, a sliding window when ``window_left >= 0``,
    no logits cap, no fp16 QK reduction."""
    from flashinfer.utils import determine_attention_backend

    backend = determine_attention_backend(device, 0, False, False, dtype, dtype)
    return backend, (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, window_left >= 0, False, False)


def batch_prefill_module(device: torch.device, dtype: torch.dtype, head_dim: int, window_left: int) -> str:
    """The name of that module (its folder in FlashInfer's AOT directory and JIT cache)."""
    from flashinfer.jit.attention import get_batch_prefill_uri

    backend, args = batch_prefill_spec(device, dtype, head_dim, window_left)
    return get_batch_prefill_uri(backend, *args)


def unusable(loaders: dict[str, Callable[[], object]]) -> str | None:
    """Why FlashInfer's modules (name -> a function loading it, as FlashInfer's calls do) cannot be used here:
    some neither prebuilt nor compilable, or one failing to compile or load; None when all of them load (FlashInfer
    caches them, so the calls that follow load nothing)."""
    missing = missing_modules(*loaders)
    if missing:
        return missing
    for name, load in loaders.items():
        try:
            load()
        except Exception as e:  # a failed compile (RuntimeError), a library that does not load (OSError, ...)
            first_line = (str(e).strip().splitlines() or [""])[0]
            return f"FlashInfer's module {name} does not load ({type(e).__name__}: {first_line})"
    return None


def attention_unusable(device: torch.device, dtype: torch.dtype, head_dim: int, window_left: int) -> str | None:
    """``unusable`` for FlashInferAttention's modules: the paged-KV append and its batch-prefill module."""
    fi = load_flashinfer()
    backend, args = batch_prefill_spec(device, dtype, head_dim, window_left)
    return unusable({"page": fi.page.get_page_module,
                     batch_prefill_module(device, dtype, head_dim, window_left):
                         lambda: fi.prefill.get_batch_prefill_module(backend, *args)})


@functools.cache
def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it is seen in this process."""
    logger.warning(message)


def _fused_op_loaders(fi: ModuleType) -> dict[str, Callable[[], object]]:
    return {"norm": fi.norm.get_norm_module, "rope": fi.rope.get_rope_module,
            "silu_and_mul": lambda: fi.activation.get_act_and_mul_module("silu"),
            "sampling": fi.sampling.get_sampling_module}


@functools.cache
def _modules_ready(name: str) -> bool:
    reason = unusable({name: _fused_op_loaders(load_flashinfer())[name]})
    if reason:
        warn_once(f"{reason}; using the torch path")
    return reason is None


def use_flashinfer(*tensors: torch.Tensor, module: str, dtypes: tuple[torch.dtype, ...] = FAST_DTYPES) -> bool:
    """The fused ops' gate: every tensor is a CUDA tensor of one of ``dtypes``, flashinfer imports and its
    ``module`` (norm, rope, silu_and_mul or sampling) loads, prebuilt or compiled (checked once per process)."""
    return (all(t.is_cuda and t.dtype in dtypes for t in tensors) and flashinfer_available()
            and _modules_ready(module))
