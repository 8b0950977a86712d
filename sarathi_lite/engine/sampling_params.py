"""How to pick each next token, and when to stop (after vLLM's ``SamplingParams``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MIN_TEMPERATURE = 1e-3  # below it logits / temperature overflow float32 for ordinary logit ranges
MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_N = 128  # completions per prompt (n, best_of): OpenAI's bound
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's bound)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0  # logits / 0.01 stays far from float32's range
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI's bound)


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
    n: completions to return for the prompt (``LLM.generate`` and the server run them as ``best_of`` requests
        that share the prompt's KV blocks through the prefix cache; ``LLMEngine.add_request`` takes only 1).
    best_of: completions to generate, of which the ``n`` with the highest cumulative log-probability are
        returned (default ``n``; at least ``n``).
    presence_penalty: subtracted from the logit of every token that already appears in the output (vLLM's and
        OpenAI's definition); in [-2, 2], 0 is off.
    frequency_penalty: subtracted once per occurrence in the output so far; in [-2, 2], 0 is off.
    repetition_penalty: tokens of the prompt or the output have their logit divided by it when positive and
        multiplied by it otherwise (vLLM's definition, after the CTRL paper); in [0.01, 100], 1 is off.
    logit_bias: token id -> value in [-100, 100] added to its logit before sampling (OpenAI's ``logit_bias``).

    Logit processing order, per row: ``min_tokens`` bans, ``logit_bias``, repetition, frequency and presence
    penalties, then temperature, top-k and top-p. Returned logprobs are those of the processed logits (before
    temperature). Neutral values skip the processing entirely, so greedy outputs stay bit-identical.

    Every field is bounded, so a request that passes these checks (and the engine's, which knows the vocabulary:
    token ids and ``logprobs`` below its size) cannot fail in the sampler: ``max_tokens`` in [1, 2**63),
    ``temperature`` 0 or in [``MIN_TEMPERATURE``, inf), ``top_k`` in [-1, 2**31), ``seed`` in [-2**63, 2**64),
    ``logprobs`` in [0, 2**31), ``n`` and ``best_of`` in [1, 128], stop strings valid Unicode, penalties and
    biases finite and bounded as above. A bad value raises ``ValueError`` naming the field.
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
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, MAX_INT64)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature!r} is below {MIN_TEMPERATURE}, the smallest "
                             f"temperature that samples (smaller ones overflow the scaled logits); 0 is greedy")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        _check_int("top_k", self.top_k, -1, MAX_INT32, " (0 or -1: off)")
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        if self.seed is not None:
            _check_int("seed", self.seed, MIN_SEED, MAX_SEED, " or None")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_INT32, " or None")
        self.stop = _str_list("stop", self.stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output={self.include_stop_str_in_output!r} must be True or "
                             f"False")
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_int("n", self.n, 1, MAX_N)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, self.n, MAX_N, f" (at least n={self.n})")
        _check_float("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_float("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_float("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        self.logit_bias = _bias_dict(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_completions(self) -> int:
        """Completions generated for the prompt: ``best_of``, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def penalized(self) -> bool:
        """Whether a repetition, frequency or presence penalty is on (the sampler then needs the history)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _check_float(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} must be a number in [{low:g}, {high:g}]")


def _bias_dict(values: Any) -> dict[int, float]:
    """``values`` as ``{token id: bias}``; raises ``ValueError`` naming ``logit_bias`` and the bad entry."""
    if not isinstance(values, dict):
        raise ValueError(f"logit_bias={values!r:.80} must be a dict of token id -> bias")
    out = {}
    for t, v in values.items():
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_INT64:
            raise ValueError(f"logit_bias contains the key {t!r}; keys are token ids (integers >= 0)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias contains {t}: {v!r}; biases are numbers in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}]")
        out[t] = float(v)
    return out


def _check_int(name: str, value: object, low: int, high: int, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} must be an integer in [{low}, {high}]{note}")


def _int_list(name: str, values: Any) -> list[int]:
    """``values`` as a list of token ids (integers in [0, 2**63)); raises ``ValueError`` naming ``name``."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name}={values!r} must be a list of token ids")
    out = list(values)
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_INT64:
            raise ValueError(f"{name} contains {t!r}; token ids are integers >= 0")
    return out


def _str_list(name: str, values: Any) -> list[str]:
    """``values`` (a string or strings) as a list of non-empty strings that UTF-8 can encode."""
    if isinstance(values, str):
        values = [values]
    elif isinstance(values, (bytes, dict)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name}={values!r} must be a string or a list of strings")
    out = list(values)
    for s in out:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{name} contains {s!r}; stop strings are non-empty strings")
        check_text(name, s)
    return out


def check_text(name: str, text: str) -> None:
    """Raise ``ValueError`` naming ``name`` if ``text`` holds a lone surrogate (e.g. ``"\\ud800"`` from a JSON
    escape), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} contains a lone surrogate {text[e.start]!r} at character {e.start}; text must "
                         f"be valid Unicode") from None
