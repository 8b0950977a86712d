"""Incremental detokenization: the text each step adds to a request, and stop strings matched on that text.

Decoding one token at a time is wrong for byte-level and SentencePiece tokenizers: a multi-byte character can
span tokens, and a token's text can depend on the token before it (leading spaces, merges). So each step decodes
a short window twice, the tokens already shown (``[prefix_offset, read_offset)``) and the same window plus the
new tokens, and the text delta is the difference; while the window ends in an incomplete character (U+FFFD) the
delta waits for the next token. At the end the accumulated text is checked against one decode of all tokens, so
the concatenated deltas equal ``tokenizer.decode(token_ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sarathi_lite.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """One request's output text, built step by step.

    token_ids: the request's output token list, read (never copied) at each ``update``; it only grows.
    tokenizer: a Hugging Face tokenizer, or ``None`` (then every text is ``""`` and stop strings never match).
    """

    __slots__ = ("tokenizer", "token_ids", "stop", "include_stop", "min_tokens", "_hold", "text", "_emitted",
                 "_prefix_offset", "_read_offset", "stop_reason")

    def __init__(self, tokenizer: Any, token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.token_ids = token_ids
        self.stop = tuple(params.stop) if tokenizer is not None else ()
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Characters held back while they could still be the start of a stop string.
        self._hold = 0 if self.include_stop or not self.stop else max(map(len, self.stop)) - 1
        self.text = ""
        self._emitted = 0
        self._prefix_offset = 0
        self._read_offset = 0
        self.stop_reason: str | None = None

    def update(self, finished: bool) -> str:
        """Take in the tokens appended since the last call and return the new text to show.

        finished: the request ends with this step (flush everything held back). After a stop string matched,
        ``stop_reason`` names it and the request must end; the returned text stops before it (or after it, with
        ``include_stop_str_in_output``).
        """
        tok = self.tokenizer
        if tok is None:
            return ""
        ids = self.token_ids
        checked = len(self.text)
        prefix = tok.decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        window = tok.decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if len(window) > len(prefix) and not window.endswith(REPLACEMENT):
            self.text += window[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        if self.stop and len(ids) >= self.min_tokens and self._match_stop(checked):
            return self._take(len(self.text))
        if finished:
            full = tok.decode(ids, skip_special_tokens=True)
            if full.startswith(self.text):
                self.text = full
            else:
                logger.warning("incremental text diverged from the full decode; keeping the incremental text")
            return self._take(len(self.text))
        return self._take(len(self.text) - self._hold)

    def _match_stop(self, checked: int) -> bool:
        """Find the earliest stop string that ends in the text added since ``checked`` characters; cut there."""
        text = self.text
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = text.find(s, max(0, checked - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = text[:i + len(s)] if self.include_stop else text[:i]
        self.stop_reason = s
        return True

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self.text[self._emitted:upto]
        self._emitted = upto
        return delta
