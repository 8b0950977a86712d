"""A request in the unified view: prompt, outputs so far, and how many of those tokens have cached K/V."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not holding KV blocks: new, or preempted and waiting to recompute
    RUNNING = "running"  # holding KV blocks, scheduled every iteration the policy allows
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # holding KV blocks a connector is filling (kv_transfer)
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One generation request as the scheduler sees it; also, while not in flight, the view the decision reads
    (``decision.View``).

    ``num_computed_tokens`` counts the tokens (prompt first, then outputs) whose K/V are in the cache.
    ``num_prefill_tokens`` is how many tokens must be computed before the next token is sampled: the prompt
    length on arrival, prompt + outputs after a preemption (recompute). While ``num_computed_tokens`` is below
    it, the request is prefilling; after, it decodes one token per iteration.

    Prefix caching: ``num_cached_tokens`` is how many prompt tokens its first admission found in the prefix
    cache (not computed by it); ``block_hashes`` holds the content keys of its full blocks so far (see
    ``block_manager.block_key``); ``num_committed_blocks`` how many of its blocks the cache has seen since it
    last took blocks.

    KV from elsewhere: ``num_external_tokens`` prompt tokens whose K/V a connector supplies (see ``kv_transfer``).
    Batches in flight (``SchedulerConfig.max_concurrent_batches`` > 1): ``num_in_flight`` batches scheduled and not
    yet updated hold a row of the request, with ``num_scheduled_tokens`` tokens not yet computed, of which
    ``num_pending_samples`` rows sample a token.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_prefill_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: str | None = None
    seq: int = -1  # arrival order within one scheduler; set by Scheduler.add
    num_cached_tokens: int = 0
    num_committed_blocks: int = 0
    num_external_tokens: int = 0
    num_in_flight: int = 0
    num_scheduled_tokens: int = 0
    num_pending_samples: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def arrival(self) -> int:
        """The arrival order key the decision sorts by (``seq``)."""
        return self.seq

    @property
    def num_remaining(self) -> int:
        """Tokens the request needs to catch up with what is known (1 for a decode)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """Whether the request needs exactly one token (a decode, or the last token of a prompt): ``num_remaining ==
        1`` for a request not in flight (a decode has computed all but its last token, past its prefill; a request
        prefilling or waiting needs its prefill, ``num_prefill_tokens == num_tokens``), read off two counts."""
        return self.num_computed_tokens + 1 >= self.num_prefill_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + outputs."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]
