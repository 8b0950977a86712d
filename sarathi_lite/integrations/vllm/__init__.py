"""sarathi-lite's scheduling inside vLLM: ``SarathiScheduler``, a vLLM ``AsyncScheduler`` whose steps are decided by
``sarathi_lite.scheduler.decision`` (decodes first, the token budget or the SLO-aware ``"auto"`` budget, head-of-line
protection), while vLLM keeps its KV cache manager, connectors and outputs::

    vllm serve MODEL --scheduler-cls sarathi_lite.integrations.vllm.SarathiScheduler \\
        --additional-config '{"sarathi_lite": {"chunk_size": 256}}'

The only package of sarathi-lite that imports vLLM. Its submodules ``version``, ``releases``, ``options`` and
``preflight`` import no vLLM scheduler code, so the ``vllm.general_plugins`` entry point (``preflight.register``)
loads under any vLLM; ``SarathiScheduler`` is imported on first use, after the installed vLLM's version is checked
(``SUPPORTED_VLLM_VERSIONS``: any other is refused with a ``RuntimeError`` naming the supported ones)."""

from typing import Any

from .options import OPTIONS_KEY, PluginOptions, parse_options
from .version import SUPPORTED_VLLM_VERSIONS, check_vllm_version

__all__ = ["OPTIONS_KEY", "PluginOptions", "SUPPORTED_VLLM_VERSIONS", "SarathiScheduler", "check_vllm_version",
           "parse_options"]


def __getattr__(name: str) -> Any:
    if name == "SarathiScheduler":
        import vllm

        check_vllm_version(vllm.__version__)
        from .scheduler import SarathiScheduler

        return SarathiScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
