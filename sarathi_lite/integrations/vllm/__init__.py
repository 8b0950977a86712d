"""sarathi-lite's scheduling inside vLLM: ``SarathiScheduler``, a vLLM ``AsyncScheduler`` whose steps are decided by
``sarathi_lite.scheduler.plan`` (decodes first, the token budget or the SLO-aware ``"auto"`` budget, head-of-line
protection), while vLLM keeps its KV cache manager, connectors and outputs::

    vllm serve MODEL --scheduler-cls sarathi_lite.integrations.vllm.SarathiScheduler \\
        --additional-config '{"sarathi_lite": {"chunk_size": 256}}'

The only package of sarathi-lite that imports vLLM; importing it refuses an unsupported vLLM version
(``SUPPORTED_VLLM_VERSIONS``)."""

import vllm

from .version import SUPPORTED_VLLM_VERSIONS, check_vllm_version

check_vllm_version(vllm.__version__)

from .options import OPTIONS_KEY, PluginOptions, parse_options  # noqa: E402
from .scheduler import SarathiScheduler  # noqa: E402

__all__ = ["OPTIONS_KEY", "PluginOptions", "SUPPORTED_VLLM_VERSIONS", "SarathiScheduler", "check_vllm_version",
           "parse_options"]
