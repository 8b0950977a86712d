"""Scheduler configuration: one small dataclass, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .registry import chunked_policy_names, is_chunked, policy_class

LONG_PROMPT_CHUNKS = 4
"""With ``hol_protection`` and a fixed ``chunk_size``, a prompt is long (by default) when it needs more than this
many steps' budgets: every measured ordinary trace is then scheduled as without protection
(docs/results/hol_protection.md)."""
DEFAULT_CHUNK_SIZE = 512
AUTO_LONG_THRESHOLD = LONG_PROMPT_CHUNKS * DEFAULT_CHUNK_SIZE
"""With ``chunk_size="auto"`` the steps vary, so a prompt is long (by default) above what the default fixed chunk
size calls long, 2,048 tokens (or above ``max_num_batched_tokens``, if less)."""
DEFAULT_TBT_PERCENTILE = 99.0
"""The percentile of time between tokens that ``tbt_slo`` bounds under ``chunk_size="auto"``, by default: real
steps scatter around any model of them, so the budget sizes them by their measured percentile, not by their typical
time (docs/results/auto_budget.md)."""


def option(default: Any, text: str) -> Any:
    """A dataclass field with its ``default`` and its one description, ``text`` (its ``help``, which the CLI's
    ``--help`` shows)."""
    return field(default=default, metadata={"help": text})


@dataclass(slots=True)
class SchedulerConfig:
    """What the scheduler may put in one step and how much KV memory it manages, validated on construction.

    Sizes are in tokens, times in seconds. Each field's ``help`` (its ``metadata``, which the CLI shows) documents
    it; docs/design/scheduler.md explains how they work together.
    """

    policy: str = option("sarathi", "the batching policy")
    chunk_size: int | str = option(DEFAULT_CHUNK_SIZE, "token budget per iteration of the chunked policies (sarathi, "
        "simple_chunking), or auto: each iteration's budget chosen so the step cost_model predicts fits tbt_slo")
    max_num_seqs: int = option(128, "most requests running (holding KV blocks) at once")
    max_num_batched_tokens: int | None = option(None, "token budget per iteration of the unchunked policies (default: "
        "max(max_model_len, 2048))")
    max_model_len: int | None = option(4096, "longest request (tokens; an engine sets it from the model and its KV "
        "pool)")
    block_size: int = option(16, "tokens per KV block")
    num_blocks: int | None = option(None, "blocks in the KV pool (an engine sets it from num_kv_blocks or its KV "
        "memory)")
    watermark: float = option(0.01, "fraction of the KV pool kept free when admitting a request while others run")
    long_prefill_token_threshold: int | None = option(None, "prompts of more tokens than this are long: with "
        "hol_protection, short prompts go before them (default: 4 x chunk_size, or 2048 with chunk_size auto); "
        "without it, no request gets more tokens than this in one step (default: no cap)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes other requests computed "
        "(greedy outputs are the same either way)")
    hol_protection: bool = option(True, "head-of-line protection (chunked policies): while a long prompt is "
        "mid-prefill beside a short one, short prompts go first and the long ones keep a share of the step; steps "
        "with no short prompt beside a long one are scheduled as without it. Off: the Sarathi-Serve paper's "
        "first-come-first-served filling")
    tbt_slo: float | None = option(None, "with chunk_size auto: the time-between-tokens target of every iteration "
        "(seconds)")
    tbt_percentile: float | None = option(DEFAULT_TBT_PERCENTILE, "with chunk_size auto: the percentile of time "
        "between tokens that tbt_slo bounds (99: P99); the budget's target follows the measured steps' percentile to "
        "just under tbt_slo (None: a fixed target, tbt_slo x budget_safety)")
    budget_safety: float = option(0.9, "with chunk_size auto: the fraction of tbt_slo a predicted step may take until "
        "steps are measured (with tbt_percentile None, always: room for the step-to-step spread)")
    min_chunk_size: int = option(32, "with chunk_size auto: prefill tokens granted every iteration a prompt waits, "
        "even past tbt_slo (so prompts never starve)")
    max_concurrent_batches: int = option(1, "most batches in flight at once (pipeline stages, async scheduling); a "
        "request is in at most one of them")
    balance_micro_batches: bool = option(True, "with batches in flight (pipeline stages): a batch takes at most "
        "1/max_concurrent_batches of the running decodes, so micro-batches share them evenly instead of one taking all")
    async_scheduling: bool = option(False, "overlap the CPU's scheduling of step N+1 and the processing of step N-1's "
        "outputs with step N's forward pass (a decode is scheduled before its input token is sampled)")
    def __post_init__(self) -> None:
        policy_class(self.policy)  # raises ValueError naming the registered policies
        if self.chunk_size != "auto":
            _check_positive_int("chunk_size", self.chunk_size)
        for name in ("max_num_seqs", "max_model_len", "block_size", "min_chunk_size", "max_concurrent_batches"):
            if name != "max_model_len" or self.max_model_len is not None:  # None: not known yet
                _check_positive_int(name, getattr(self, name))
        for name in ("max_num_batched_tokens", "num_blocks", "long_prefill_token_threshold"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be a bool")
        if not isinstance(self.hol_protection, bool):
            raise ValueError(f"hol_protection={self.hol_protection!r} must be True or False")
        if not isinstance(self.balance_micro_batches, bool):
            raise ValueError(f"balance_micro_batches={self.balance_micro_batches!r} must be True or False")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} must be True or False")
        if self.async_scheduling and self.max_concurrent_batches == 1:
            self.max_concurrent_batches = 2  # the batch running and the next
        self._check_auto_budget()
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark={self.watermark!r} must be in [0, 1)")
        if self.max_model_len is None:
            return  # not known yet: what follows from it waits for it (EngineConfig.scheduler_config)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_max_num_batched_tokens(self.max_model_len)
        if self.num_blocks is None:
            self.num_blocks = self.max_num_seqs * math.ceil(self.max_model_len / self.block_size)
        if not is_chunked(self.policy) and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}: policy {self.policy!r} does not chunk prompts, so a "
                f"whole prompt must fit in one iteration"
            )

    @property
    def token_budget(self) -> int:
        """Tokens one iteration may hold: ``chunk_size`` for chunked policies (``max_num_batched_tokens`` when it is
        ``"auto"``), else ``max_num_batched_tokens``."""
        if is_chunked(self.policy) and not self.auto_budget:
            return self.chunk_size
        return self.max_num_batched_tokens

    @property
    def auto_budget(self) -> bool:
        """Whether each iteration's budget comes from a step-time predictor (``chunk_size="auto"``)."""
        return self.chunk_size == "auto"

    @property
    def max_running(self) -> int:
        """Requests that may run at once: ``max_num_seqs``, capped by the token budget."""
        return min(self.max_num_seqs, self.token_budget)

    @property
    def protects_short_prompts(self) -> bool:
        """Whether head-of-line protection applies: ``hol_protection`` under a chunked policy."""
        return self.hol_protection and is_chunked(self.policy)

    @property
    def long_threshold(self) -> int | None:
        """Prefill tokens above which a prompt is long: ``long_prefill_token_threshold``, which under head-of-line
        protection defaults to ``LONG_PROMPT_CHUNKS * chunk_size`` (a prompt that needs several iterations; with
        ``chunk_size="auto"``, ``min(AUTO_LONG_THRESHOLD, max_num_batched_tokens)``); ``None`` when no prompt is
        long."""
        if self.long_prefill_token_threshold is None and self.protects_short_prompts:
            if self.auto_budget:
                return min(AUTO_LONG_THRESHOLD, self.token_budget)
            return LONG_PROMPT_CHUNKS * self.token_budget
        return self.long_prefill_token_threshold

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

    def _check_auto_budget(self) -> None:
        if not self.auto_budget:
            return
        if not is_chunked(self.policy):
            raise ValueError(f"chunk_size='auto' needs a chunked policy ({', '.join(chunked_policy_names())}), "
                             f"not {self.policy!r}")
        slo = self.tbt_slo
        if isinstance(slo, bool) or not isinstance(slo, (int, float)) or not math.isfinite(slo) or slo <= 0:
            raise ValueError(f"tbt_slo={slo!r} must be a positive number of seconds with chunk_size='auto'")
        safety = self.budget_safety
        if isinstance(safety, bool) or not isinstance(safety, (int, float)) or not 0 < safety <= 1:
            raise ValueError(f"budget_safety={safety!r} must be in (0, 1]")
        pct = self.tbt_percentile
        if pct is not None and (isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 < pct < 100):
            raise ValueError(f"tbt_percentile={pct!r} must be in (0, 100), or None for a fixed target")


def default_max_num_batched_tokens(max_model_len: int) -> int:
    """``SchedulerConfig.max_num_batched_tokens`` when none is given: ``max(max_model_len, 2048)``, as in vLLM."""
    return max(max_model_len, 2048)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
