"""The transformers releases the host supports: it subclasses transformers' continuous-batching ``Scheduler`` and
calls its fill loop (``_process_candidates``) and request helpers, which are not a public API, so any other
version is refused before a model is loaded."""

from __future__ import annotations

SUPPORTED_TRANSFORMERS_VERSIONS = ("5.23.0", "5.24.0", "5.25.0")
"""Releases whose continuous-batching scheduler module, request states and scheduler construction are the same
source (``scheduler.py`` and ``requests.py`` unchanged across them); the tests run on the newest."""


def check_transformers_version(version: str) -> None:
    """Raise ``RuntimeError`` naming ``version`` and the supported ones unless it is supported."""
    if version not in SUPPORTED_TRANSFORMERS_VERSIONS:
        raise RuntimeError(
            f"sarathi_lite.integrations.transformers supports transformers "
            f"{', '.join(SUPPORTED_TRANSFORMERS_VERSIONS)}, not {version!r}: install one of them "
            f"(pip install transformers=={SUPPORTED_TRANSFORMERS_VERSIONS[-1]})")
