"""How to pick each next token, and when to stop (after vLLM's ``SamplingParams``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping.

    max_tokens: most tokens to generate.
    temperature: 0 means greedy (argmax); otherwise logits are divided by it before sampling.
    top_p: nucleus sampling mass in (0, 1]; 1 is off.
    top_k: keep the k most likely tokens; 0 or -1 is off.
    stop_token_ids: generation stops after any of these (in addition to the model's EOS).
    ignore_eos: keep generating past EOS (up to ``max_tokens``); for benchmarks that force output lengths.
    seed: a per-request seed, so the request's samples do not depend on what it is batched with.
    logprobs: if set, return the sampled token's log-probability and this many top alternatives per token.
    stop: strings that end generation when they appear in the output text, matched across token boundaries;
        the text stops before the stop string (``finish_reason="stop"``) and never contains it unless
        ``include_stop_str_in_output``.
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    min_tokens: generate at least this many tokens: EOS and ``stop_token_ids`` cannot be sampled, and stop
        strings are not matched, before that.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= -1 (0 or -1: off)")
        self.stop_token_ids = list(self.stop_token_ids)
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids contains {t!r}; token ids are integers >= 0")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs={self.logprobs!r} must be an integer >= 0 or None")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop contains {s!r}; stop strings are non-empty strings")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be an integer in [0, max_tokens={self.max_tokens}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
