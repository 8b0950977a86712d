"""What rank 0 sends the other ranks each step: the batch as a change to what they already hold.

A ``SchedulerOutput`` carries every row's whole block table, and a running request's table changes by a block
every ``block_size`` decodes: sending it whole each step sends the same block ids over and over. Instead each
rank keeps every running request's block table (a ``StepDecoder``), rank 0 keeps the matching record of what it
sent (a ``StepEncoder``), and a step crosses as a ``StepDelta``: per row the request id, where its tokens start,
its input tokens (a prefill chunk's prompt tokens, a decode's last sampled token) and only the blocks its table
gained since the last step that ran it (a request new to the ranks: its whole table, prefix-cache hits included).
The requests to forget (finished, aborted, preempted: their blocks may be reused) go first. The rank rebuilds the
``SchedulerOutput`` of its forward pass from that; both sides apply the same deltas in the same order (every rank
gets every step, in order), so their records agree.

A prompt's tokens cross with the chunk that runs them, never before: a rank needs no token before its chunk, and
each crosses once (after a preemption the recomputed tokens cross again, as a whole prompt sent up front would).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sarathi_lite.scheduler import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class StepDelta:
    """One step for the ranks, rows in batch order (one list per field, as columns pickle smaller than records).

    forget: requests whose records go before this step's rows (finished, aborted, preempted).
    request_ids, num_computed_tokens, token_ids, sample, is_prefill: each row's ``ScheduledRequest`` fields
    (``num_new_tokens`` is ``len(token_ids[i])``).
    new_block_ids: the blocks each row's request gained since its last row sent (a request the ranks do not
    hold: its whole table).
    """

    forget: list[str] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    is_prefill: list[bool] = field(default_factory=list)


@dataclass(slots=True)
class _Sent:
    """Rank 0's record of a request's table as the ranks hold it: its length and last block."""

    num_blocks: int
    last_block: int


class StepEncoder:
    """Rank 0's side: turns each ``SchedulerOutput`` into the ``StepDelta`` the ranks need, remembering what
    they hold. Call ``encode`` for every step the ranks run, in the order they run them."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def __len__(self) -> int:
        """Requests the ranks hold a block table of."""
        return len(self._sent)

    def encode(self, out: SchedulerOutput, forget: Iterable[str] = ()) -> StepDelta:
        """The delta of ``out``, after forgetting ``forget`` (requests that ended since the last step) and the
        requests ``out`` preempted."""
        sent = self._sent
        delta = StepDelta(forget=[*forget, *out.preempted_ids])
        for rid in delta.forget:
            sent.pop(rid, None)
        for row in out.scheduled:
            rid, table = row.request_id, row.block_table
            record = sent.get(rid)
            n = 0 if record is None else record.num_blocks
            if record is not None and (len(table) < n or (n and table[n - 1] != record.last_block)):
                delta.forget.append(rid)  # not grown from what the ranks hold (never expected): send it whole
                n = 0
            new = table[n:]  # a copy: a decode's table is the request's live one
            if new or not n:
                sent[rid] = _Sent(len(table), table[-1] if table else -1)
            delta.request_ids.append(rid)
            delta.num_computed_tokens.append(row.num_computed_tokens)
            delta.token_ids.append(row.token_ids)
            delta.new_block_ids.append(new)
            delta.sample.append(row.sample)
            delta.is_prefill.append(row.is_prefill)
        return delta


class StepDecoder:
    """A rank's side: keeps the block table of every request rank 0 sent rows of and rebuilds each step's
    ``SchedulerOutput`` from its ``StepDelta``. A row's ``block_table`` is the rank's live table of the request,
    valid until the next ``decode`` (the rank runs each step before it takes the next)."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._tables)

    def decode(self, delta: StepDelta) -> SchedulerOutput:
        tables = self._tables
        for rid in delta.forget:
            tables.pop(rid, None)
        out = SchedulerOutput()
        for i, rid in enumerate(delta.request_ids):
            table = tables.get(rid)
            if table is None:
                table = tables[rid] = []
            table += delta.new_block_ids[i]
            tokens = delta.token_ids[i]
            out.add(ScheduledRequest(rid, delta.num_computed_tokens[i], len(tokens), tokens, table,
                                     delta.sample[i], delta.is_prefill[i]))
        return out
