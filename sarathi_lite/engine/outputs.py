"""What the engine hands back for a request after a step or at the end of ``generate``."""

from __future__ import annotations

from typing import Any

from sarathi_lite.metrics import RequestMetrics


class RequestOutput:
    """A request's state after a step.

    token_ids: output tokens so far. text: their decoded text (decoded on first access).
    finished / finish_reason: ``"stop"`` (EOS or a stop token), ``"length"`` (``max_tokens`` or
    ``max_model_len``), ``"abort"``. metrics: the request's timeline (``ttft``, ``tbt``, ``e2e`` in seconds) and
    ``num_cached_tokens``, the prompt tokens served from the prefix cache.
    logprobs: per output token, ``(sampled token's logprob, {token_id: logprob} of the top alternatives)`` when
    ``SamplingParams.logprobs`` is set, else ``None``.
    """

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "token_ids", "finish_reason", "metrics", "logprobs",
                 "_tokenizer", "_text")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], token_ids: list[int],
                 finish_reason: str | None, metrics: RequestMetrics, logprobs: list[Any] | None = None,
                 tokenizer: Any = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.token_ids = token_ids
        self.finish_reason = finish_reason
        self.metrics = metrics
        self.logprobs = logprobs
        self._tokenizer = tokenizer
        self._text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = "" if self._tokenizer is None else self._tokenizer.decode(
                self.token_ids, skip_special_tokens=True)
        return self._text

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, text={self.text!r}, "
                f"num_tokens={len(self.token_ids)}, finish_reason={self.finish_reason!r})")
