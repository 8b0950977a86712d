"""What one iteration runs: a plain record the runner reads and never writes back into."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of an iteration.

    request_id: the request.
    num_computed_tokens: tokens whose K/V are already cached (the context before this step).
    num_new_tokens: the query length of this step.
    token_ids: the ``num_new_tokens`` token ids to run (positions ``num_computed_tokens ..``).
    block_table: KV block ids covering exactly ``num_computed_tokens + num_new_tokens`` token slots.
        Read-only: for a decode it is the request's live table, valid until the next ``schedule()``.
    sample: whether this step ends the request's known tokens, so a token is sampled for it.
    is_prefill: whether these tokens are prefill (prompt, or recompute after preemption) rather than a decode.
    """

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    token_ids: list[int]
    block_table: list[int]
    sample: bool
    is_prefill: bool


@dataclass(slots=True)
class SchedulerOutput:
    """All that one iteration runs, in batch order, and who was preempted to make room.

    ``num_cached_tokens``: prefill tokens that requests admitted in this iteration found in the prefix cache
    (their rows start after them).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    num_decodes: int = 0
    num_cached_tokens: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def add(self, item: ScheduledRequest) -> None:
        self.scheduled.append(item)
        if item.is_prefill:
            self.num_prefill_tokens += item.num_new_tokens
            self.num_prefills += 1
        else:
            self.num_decode_tokens += item.num_new_tokens
            self.num_decodes += 1
