"""The checks of what a caller asks to run, shared by the Python API (``LLM.generate`` / ``LLM.chat``), the
engines' ``add_request`` and the OpenAI-compatible server, so all accept and refuse the same things with the same
messages: chat messages (roles, content as a string or text parts), a prompt as text or token ids inside the
vocabulary, and a prompt's fit in the context with its ``max_tokens``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sarathi_lite.engine.sampling_params import check_text

ROLES = ("system", "developer", "user", "assistant")
"""The chat roles a conversation may use (OpenAI's, less ``tool`` and ``function``: no tool calling here)."""


class ContextLengthError(ValueError):
    """A prompt, or a prompt with its ``max_tokens``, does not fit in the model's context. ``param``: the field
    to blame (``"prompt"``, ``"messages"``, ``"max_tokens"``, ...)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_token_ids(where: str, token_ids: Sequence[Any], vocab_size: int) -> list[int]:
    """``token_ids`` as a list, each an ``int`` in ``[0, vocab_size)``; else a ``ValueError`` naming the first bad
    id (booleans are no token ids)."""
    ids = list(token_ids)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"{where}: token id {t!r:.40} is outside the vocabulary [0, {vocab_size})")
    return ids


def tokenize_prompt(tokenizer: Any, model_path: Path, vocab_size: int, request_id: str,
                    prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
    """``(text, token ids)`` of request ``request_id``'s ``prompt``: text is checked and tokenized with
    ``tokenizer`` (a Hugging Face tokenizer, ``None`` when ``model_path`` has none), token ids are checked against
    ``vocab_size`` (``text`` is ``None`` then). Raises ``ValueError`` naming the request for a bad prompt."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"request {request_id!r}: text prompts need a tokenizer in {model_path}")
        check_text(f"request {request_id!r}: prompt", prompt)
        return prompt, tokenizer(prompt).input_ids
    if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"request {request_id!r}: prompt must be text or a list of token ids, got "
                         f"{type(prompt).__name__}")
    return None, check_token_ids(f"request {request_id!r}", prompt, vocab_size)


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, where: str = "prompt",
                  prompt_param: str = "prompt", param: str = "max_tokens", default: int | None = None) -> int:
    """The ``max_tokens`` to run a prompt of ``num_prompt_tokens`` with: ``max_tokens`` itself, or when it is
    ``None``, ``default`` capped by the room the prompt leaves (all of it without a default). Raises
    ``ContextLengthError`` (a ``ValueError``) whose message starts with ``where`` (e.g. ``"prompt[2]"``) for an
    empty prompt, a prompt that leaves no room for one output token, or a prompt plus ``max_tokens`` over
    ``max_model_len`` tokens."""
    if num_prompt_tokens == 0:
        raise ContextLengthError(f"{where}: the prompt is empty", prompt_param)
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthError(f"{where}: the prompt has {num_prompt_tokens} tokens; this model's maximum context "
                                 f"length is {max_model_len} tokens (prompt and output together)", prompt_param)
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room if default is None else min(default, room)
    if max_tokens > room:
        raise ContextLengthError(f"{where}: {num_prompt_tokens} prompt tokens + {param}={max_tokens} exceed this "
                                 f"model's maximum context length of {max_model_len} tokens", param)
    return max_tokens


def chat_messages(messages: Any, name: str = "messages") -> list[dict[str, str]]:
    """``messages`` (a non-empty list of ``{"role", "content"[, "name"]}`` dicts, ``content`` a string or a list
    of ``{"type": "text", "text": ...}`` parts) as the ``[{"role", "content"}]`` a chat template takes, text
    parts joined. Raises ``ValueError`` naming the message (``messages[1].role``) for anything else."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"{name} must be a non-empty list of {{'role', 'content'}} dicts; got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be a dict with 'role' and 'content'; got {type(m).__name__}")
        unknown = set(m) - {"role", "content", "name"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(map(str, unknown))}; a message has 'role', 'content' "
                             f"and optionally 'name'")
        role = m.get("role")
        if not isinstance(role, str):
            raise ValueError(f"{where}: 'role' must be a string; got {role!r:.80}")
        if role not in ROLES:
            raise ValueError(f"{where}.role={role!r:.80} must be one of {', '.join(ROLES)}")
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise ValueError(f"{where}.name={m['name']!r:.80} must be a string")
            check_text(f"{where}.name", m["name"])
        out.append({"role": role, "content": _content(m.get("content"), f"{where}.content")})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        check_text(where, content)
        return content
    if isinstance(content, (bytes, dict)) or not isinstance(content, Sequence):
        raise ValueError(f"{where.rsplit('.', 1)[0]}: 'content' must be a string or a list of text parts; got "
                         f"{content!r:.80}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"} \
                or not isinstance(part["text"], str):
            raise ValueError(f"{where}[{j}] must be {{'type': 'text', 'text': str}} (only text parts are "
                             f"supported); got {part!r:.80}")
        check_text(f"{where}[{j}].text", part["text"])
        texts.append(part["text"])
    return "".join(texts)
