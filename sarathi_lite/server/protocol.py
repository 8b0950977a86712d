"""The OpenAI request bodies the server accepts, as pydantic models, and their translation to ``SamplingParams``.

Unknown fields are rejected (400 naming the field) rather than silently ignored. Beyond OpenAI's fields, the
ones vLLM also takes: ``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output`` and ``stream_options.continuous_usage_stats``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from sarathi_lite.engine.sampling_params import SamplingParams, check_text

MAX_TOP_LOGPROBS = 20


def _valid_text(text: str) -> str:
    check_text("the text", text)
    return text


# Every string of a body: JSON's "\ud800" escapes decode to lone surrogates, which no tokenizer (and no UTF-8
# response) can take; they are 400s naming the field.
Text = Annotated[str, AfterValidator(_valid_text)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk (vLLM's extension; benchmark clients use it)


class _SamplingRequest(_Strict):
    model: Text
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=1)
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
                              include_stop_str_in_output=self.include_stop_str_in_output)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or token ids (a one-element list of either also works)."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] = False


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: the conversation goes through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
