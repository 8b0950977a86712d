"""The engine's own exceptions (bad input is ``ValueError``, as everywhere in the library)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot run any request any more: its device or a tensor-parallel worker is broken (the message
    says which and why), or the engine loop was shut down. A step that fails for any other reason fails only the
    requests in that step (``finish_reason="error"``) and the engine keeps serving."""


class QueueFullError(RuntimeError):
    """``AsyncLLMEngine`` already holds its bound of waiting requests (``max_waiting_requests``); try again
    later. retry_after: a suggested wait (seconds)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after
