"""sarathi-lite: chunked-prefill, stall-free LLM inference scheduling (Sarathi-Serve style) over a paged KV cache.

>>> from sarathi_lite import LLM, SamplingParams
>>> llm = LLM("smollm2-135m", scheduler="sarathi", chunk_size=256)
>>> outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))

The public names load lazily, so ``import sarathi_lite.scheduler`` alone never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "sarathi_lite.engine.llm",
    "LLMEngine": "sarathi_lite.engine.llm_engine",
    "AsyncLLMEngine": "sarathi_lite.engine.async_engine",
    "EngineConfig": "sarathi_lite.engine.config",
    "SamplingParams": "sarathi_lite.engine.sampling_params",
    "RequestOutput": "sarathi_lite.engine.outputs",
    "RequestMetrics": "sarathi_lite.metrics",
    "IterationRecord": "sarathi_lite.metrics",
    "Stats": "sarathi_lite.metrics",
    "POLICIES": "sarathi_lite.scheduler",
    "SchedulerConfig": "sarathi_lite.scheduler",
    "make_scheduler": "sarathi_lite.scheduler",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sarathi_lite' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
