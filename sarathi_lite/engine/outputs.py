"""What the engine hands back for a request after a step: the step's delta, and the whole output at the end."""

from __future__ import annotations

from typing import Any

from sarathi_lite.metrics import RequestMetrics


class RequestOutput:
    """A request's progress in one step; on the step that finishes it, also its whole output.

    Per step (O(new tokens), never a copy of the whole output): ``new_token_ids`` (the tokens sampled this step),
    ``new_text`` (the text they add, see ``IncrementalDetokenizer``; may be ``""`` while a multi-byte character
    or a possible stop string is incomplete), ``new_logprobs``, and the cumulative ``num_output_tokens``.
    finished / finish_reason: ``"stop"`` (EOS, a stop token or a stop string), ``"length"`` (``max_tokens`` or
    ``max_model_len``), ``"abort"``, ``"error"`` (the step running it failed; ``error`` says why, the engine
    goes on). stop_reason: the stop string that matched, else ``None``.
    At the end (``finished``): ``token_ids``, ``text`` (the concatenation of every ``new_text``) and
    ``logprobs`` (per token ``(sampled token's logprob, {token_id: logprob} of the top alternatives)`` when
    ``SamplingParams.logprobs`` is set); before the end they are ``None``.
    metrics: the request's timeline (``ttft``, ``tbt``, ``e2e`` in seconds) and ``num_cached_tokens``, the
    prompt tokens served from the prefix cache.
    index, outputs: with ``SamplingParams.n`` > 1, ``LLM.generate`` returns one output per prompt, its first
    completion, whose ``outputs`` lists all ``n`` (each with its ``index``, 0 .. n-1); otherwise ``index`` is 0
    and ``outputs`` is ``[self]``.
    """

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "new_token_ids", "new_text", "new_logprobs",
                 "num_output_tokens", "finish_reason", "stop_reason", "metrics", "token_ids", "text", "logprobs",
                 "error", "index", "_outputs")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], new_token_ids: list[int],
                 new_text: str, num_output_tokens: int, finish_reason: str | None, metrics: RequestMetrics,
                 new_logprobs: list[Any] | None = None, stop_reason: str | None = None,
                 token_ids: list[int] | None = None, text: str | None = None, logprobs: list[Any] | None = None
                 ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.new_token_ids = new_token_ids
        self.new_text = new_text
        self.new_logprobs = new_logprobs
        self.num_output_tokens = num_output_tokens
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.metrics = metrics
        self.token_ids = token_ids
        self.text = text
        self.logprobs = logprobs
        self.error: str | None = None
        self.index = 0
        self._outputs: list[RequestOutput] | None = None

    @property
    def outputs(self) -> list[RequestOutput]:
        """The completions of this output's prompt (``[self]`` unless ``n`` > 1)."""
        return [self] if self._outputs is None else self._outputs

    @outputs.setter
    def outputs(self, outputs: list[RequestOutput]) -> None:
        self._outputs = outputs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        if self.finished:
            return (f"RequestOutput(request_id={self.request_id!r}, text={self.text!r}, "
                    f"num_tokens={self.num_output_tokens}, finish_reason={self.finish_reason!r})")
        return (f"RequestOutput(request_id={self.request_id!r}, new_text={self.new_text!r}, "
                f"num_tokens={self.num_output_tokens})")
