"""The OpenAI request bodies the server accepts, as pydantic models, and their translation to ``SamplingParams``.

Types are strict (pydantic's strict mode): a bool is not an integer, a string is not a number, a number is not a
string; every refusal is a 400 naming the field. Unknown fields are rejected (400 naming the field) rather than
silently ignored. Beyond OpenAI's fields, the ones vLLM also takes: ``top_k``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``repetition_penalty`` and
``stream_options.continuous_usage_stats``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from sarathi_lite.engine.prompts import ROLES, chat_messages
from sarathi_lite.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    check_text,
)

MAX_TOP_LOGPROBS = 20


def _valid_text(text: str) -> str:
    check_text("the text", text)
    return text


def _token_id_keys(bias: dict[str, float] | None) -> dict[str, float] | None:
    for key in bias or {}:
        if not key.isascii() or not key.isdigit():
            raise ValueError(f"logit_bias contains the key {key!r:.40}; keys are token ids as strings, e.g. \"50256\"")
    return bias


# Every string of a body: JSON's "\ud800" escapes decode to lone surrogates, which no tokenizer (and no UTF-8
# response) can take; they are 400s naming the field.
Text = Annotated[str, AfterValidator(_valid_text)]
Bias = Annotated[dict[Text, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None,
                 AfterValidator(_token_id_keys)]
Role = Literal[ROLES]  # type: ignore[valid-type]  # the roles prompts.chat_messages takes, one list for both


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk (vLLM's extension; benchmark clients use it)


class SamplingRequest(_Strict):
    """The fields a completion and a chat completion share: the model, streaming and the sampling options."""

    model: Text
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    logit_bias: Bias = None
    user: Text | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """``SamplingParams`` of this request; raises ``ValueError`` naming a bad value."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=stop, logprobs=logprobs,
                              min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                              stop_token_ids=list(self.stop_token_ids or []),
                              include_stop_str_in_output=self.include_stop_str_in_output, n=self.n,
                              best_of=self.best_of, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt or several (text or token ids); one choice per prompt and completion
    (``index = prompt * n + completion``, OpenAI's order). ``max_tokens`` absent or null:
    ``ServerConfig.completions_default_max_tokens`` (16, OpenAI's default)."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Role
    content: Text | list[TextPart]
    name: Text | None = None


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: the conversation goes through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them, checked by the Python API's own function."""
        return chat_messages([m.model_dump(exclude_none=True) for m in self.messages])
