"""Guarded, lazy import of flashinfer-python: nothing in ``sarathi_lite.kernels`` needs it to import or run."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

INSTALL_HINT = 'pip install "sarathi-lite[flashinfer]" (flashinfer-python >= 0.6, needs a CUDA build of torch)'
FAST_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer's kernels are compiled for these input dtypes


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


def use_flashinfer(*tensors: torch.Tensor) -> bool:
    """True when every tensor is a float16/bfloat16 CUDA tensor and flashinfer imports: the fast paths' gate."""
    return (all(t.is_cuda and t.dtype in FAST_DTYPES for t in tensors) and flashinfer_available())
