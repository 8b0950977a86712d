"""What one iteration runs: a plain record the runner reads and never writes back into."""

from __future__ import annotations

from dataclasses import dataclass, field

from .kv_transfer import KVLoad

PLACEHOLDER_TOKEN = -1
"""A decode row's input token under async scheduling: the token the previous batch samples for the request, which
the executor puts in before running the row (``SchedulerConfig.async_scheduling``)."""


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of an iteration.

    request_id: the request.
    num_computed_tokens: tokens whose K/V are already cached (the context before this step).
    num_new_tokens: the query length of this step.
    token_ids: the ``num_new_tokens`` token ids to run (positions ``num_computed_tokens ..``); ``[PLACEHOLDER_TOKEN]``
        for a decode scheduled before its input token was sampled (async scheduling).
    block_table: KV block ids covering exactly ``num_computed_tokens + num_new_tokens`` token slots.
        Read-only: for a decode it is the request's live table, valid until the next ``schedule()`` (a copy when
        several batches may be in flight).
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
    (their rows start after them). ``kv_loads``: K/V a connector must write before the requests named can run
    (``kv_transfer``). ``batch_id``: the batch's number when several may be in flight (else 0).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    num_decodes: int = 0
    num_cached_tokens: int = 0
    kv_loads: list[KVLoad] = field(default_factory=list)
    batch_id: int = 0

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
