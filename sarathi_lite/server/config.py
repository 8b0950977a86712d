"""``ServerConfig``: the server's limits, each with its default and the reason for it (``sarathi-lite serve``
makes every field a flag, as it does ``EngineConfig``'s)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

API_KEY_ENV = "SARATHI_LITE_API_KEY"


@dataclass(slots=True)
class ServerConfig:
    """Admission control and limits of the OpenAI-compatible server. Times in seconds, sizes in bytes or tokens;
    each field's ``metadata["help"]`` says what it bounds and why its default."""

    max_waiting_requests: int | None = field(default=256, metadata={
        "help": "requests that may wait for the engine (not yet running) before new ones get 503 with "
                "Retry-After: a client then retries or goes elsewhere instead of queueing for minutes; every "
                "prompt x n (or best_of) of an HTTP request counts, and a request counting more than the bound is "
                "a 400; about two full batches of the default max_num_seqs (0: no bound)"})
    max_prompts_per_request: int = field(default=128, metadata={
        "help": "most prompts in one /v1/completions request (400 above it): each is tokenized and queued as a "
                "request of its own, and every prompt x n (or best_of) counts against max_waiting_requests; 128, "
                "half the default queue bound, so one request cannot fill it"})
    retry_after: int = field(default=1, metadata={
        "help": "seconds a 503 for a full queue asks the client to wait (the Retry-After header)"})
    max_body_bytes: int = field(default=4 << 20, metadata={
        "help": "largest request body (413 above it): 4 MiB holds a 128k-token prompt as token ids; a larger "
                "body only costs memory and tokenizer time"})
    header_timeout: float = field(default=10.0, metadata={
        "help": "seconds a connection may take to send a request's headers (it is closed then): connections "
                "that never finish their headers would otherwise stay open for good"})
    body_timeout: float = field(default=30.0, metadata={
        "help": "seconds a request may take to send its whole body once its headers are in (408 then)"})
    request_timeout: float | None = field(default=600.0, metadata={
        "help": "seconds a request may run, queueing included, before it is aborted and its KV blocks freed "
                "(504, or an error event in a stream); raise it for long generations on a slow device "
                "(0: no limit)"})
    api_key: str | None = field(default=None, metadata={
        "help": f"clients must send 'Authorization: Bearer KEY' (401 otherwise); default: the {API_KEY_ENV} "
                "environment variable, else no key (keep keys out of command lines: ps shows them)"})
    auth_health_and_metrics: bool = field(default=False, metadata={
        "help": "require the API key on /health and /metrics too (by default they stay open for load "
                "balancers and Prometheus, as in vLLM)"})
    chat_default_max_tokens: int = field(default=1024, metadata={
        "help": "max_tokens of a chat request that gives none (capped by the context left after the prompt): "
                "without a bound a chat request could hold its KV blocks for the whole context"})
    completions_default_max_tokens: int = field(default=16, metadata={
        "help": "max_tokens of a /v1/completions request that gives none or null (capped by the context left): "
                "16, OpenAI's default; without it one request could hold a seat and its KV blocks for the whole "
                "context"})

    def __post_init__(self) -> None:
        for name in ("max_waiting_requests", "max_prompts_per_request", "retry_after", "max_body_bytes",
                     "chat_default_max_tokens", "completions_default_max_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_waiting_requests":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0")
        if self.max_waiting_requests == 0:
            self.max_waiting_requests = None
        for name in ("max_prompts_per_request", "max_body_bytes", "chat_default_max_tokens",
                     "completions_default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1")
        for name in ("header_timeout", "body_timeout", "request_timeout"):
            value = getattr(self, name)
            if value is None and name == "request_timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name}={value!r} must be a number of seconds >= 0")
        if self.request_timeout == 0:
            self.request_timeout = None
        if self.header_timeout <= 0 or self.body_timeout <= 0:
            raise ValueError("header_timeout and body_timeout must be > 0 seconds")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")

    def replace(self, **changes: Any) -> ServerConfig:
        """A copy with some options changed (validated again)."""
        return dataclasses.replace(self, **changes)
