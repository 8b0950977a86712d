"""The step API every engine offers, written down: ``Engine``, which ``LLMEngine`` (one engine),
``DisaggregatedEngine`` (instances in one process) and ``ProcessEngine`` (instances as processes) declare, so
``LLM``, benchmarks and a caller's own loop drive any of them the same way:

>>> engine.add_request("a", "Hello", SamplingParams(temperature=0.0, max_tokens=8))
>>> while engine.has_unfinished_requests():
...     for out in engine.step():
...         print(out.request_id, out.new_text)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.metrics import Stats
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.scheduler import SchedulerConfig


@runtime_checkable
class Engine(Protocol):
    """Requests in, one step at a time, outputs out.

    model_path: the checkpoint's folder. model_config: its shape (``vocab_size``, ...). tokenizer: its Hugging Face
    tokenizer, ``None`` when the checkpoint ships none (then prompts are token ids). scheduler_config: the limits a
    request must fit (``max_model_len``: with several instances, the smallest).
    """

    model_path: Path
    model_config: ModelConfig
    tokenizer: Any
    scheduler_config: SchedulerConfig

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request: ``prompt`` is text (tokenized by the engine) or token ids; ``arrival_time`` (seconds on
        the engine's clock) defaults to now. Raises ``ValueError`` for bad input or an id in use; nothing is
        queued then."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that got tokens (finished ones have
        ``finish_reason`` set)."""
        ...

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request in any state and free its KV blocks; returns its final output (``finish_reason``
        ``"abort"``). Raises ``ValueError`` for an unknown id."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has more to do or to return."""
        ...

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not finished or aborted."""
        ...

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix; returns the KV blocks dropped."""
        ...

    def stats(self) -> Stats:
        """Per-request and per-iteration records so far."""
        ...

    def shutdown(self) -> None:
        """Stop whatever processes and threads the engine started (idempotent); it cannot step afterwards."""
        ...
