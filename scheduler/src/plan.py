"""The scheduling decision over a read-only view of requests, for engines whose requests and KV cache are not ours.

Another engine (vLLM, through ``sarathi_lite.integrations.vllm``) keeps its own request objects, KV cache manager
and greedy fill loop: each step it walks its running requests in list order, gives each ``min(tokens it still
needs, per-request cap, budget left)`` and then admits waiting requests in queue order the same way, while KV
blocks last. ``plan_step`` decides, from a ``RequestView`` of each request, the three things such a loop takes:

- the order of the running requests: every decode first (so no decode is ever left out of a step that schedules
  prefill tokens), then prompts mid-prefill: short ones before long ones under head-of-line protection, else
  in arrival order;
- the order of the waiting requests: short prompts before long ones under head-of-line protection, else as is;
- the step's token budget (``chunk_size``, or with ``chunk_size="auto"`` the decodes plus the prefill tokens
  ``TokenBudget`` predicts fit the TBT target) and a cap on any one request's tokens in this step: under
  head-of-line protection, while a long prompt is mid-prefill beside a short one, the long prompts' share
  (``admission.long_share``, the rule ``ShortPromptProtection`` uses) or, if more, what the short prompts leave
  of the budget, so the short prompts get the rest (no cap where the long prompts get that much without one: it
  would only cut short prompts); otherwise the configured ``long_prefill_token_threshold``.
  A greedy loop applies one cap to every request, so where the short prompts need more than the budget less the
  share, a short prompt longer than the share would get only the share in this step (our own scheduler gives it
  the rest of the budget). So where the cap would cut a short prompt, the long prompts mid-prefill are *held* out
  of this step instead (``StepPlan.held``; the engine skips them) and the short prompts take the whole budget,
  each its whole prompt, oldest first; the long prompts take it in the next step: never held in two steps
  running (``just_held``), so a stream of short prompts cannot starve them (they keep at least their cap every
  other step). Where the short prompts all finish in the held step, on a cost linear in tokens the long ones
  lose nothing by it (a share now and a share next step, or nothing now and both next step), and the short
  prompts' first token comes a step earlier; in a burst of short prompts the oldest finish first, not all of
  them a share at a time.
  Under ``chunk_size="auto"`` the step is sized on its prompts in the order their tokens are given (the short
  ones first where the long ones may be held), and a held step is sized again for what it holds.

Stdlib only, like the whole scheduler.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from .admission import long_share
from .budget import TokenBudget
from .config import SchedulerConfig
from .output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the decision reads of one request, whatever engine owns it.

    request_id: the engine's id.
    num_computed_tokens: tokens whose K/V are cached or being computed by a batch in flight.
    num_tokens: tokens known to the engine (prompt, outputs so far, tokens in flight), so ``num_tokens -
        num_computed_tokens`` is what the request still needs to catch up (1 for a decode).
    num_prompt_tokens: the prompt's length (whether it is long is judged on it).
    arrival: arrival order key (seconds or a counter); smaller arrived earlier.
    """

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    arrival: float = 0.0

    @property
    def num_remaining(self) -> int:
        """Tokens the request needs to catch up with what is known."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """Whether the request needs exactly one token (a decode, or the last token of a prompt)."""
        return self.num_remaining == 1


@dataclass(slots=True)
class StepPlan:
    """One step's decision, in the terms a greedy fill loop takes.

    running: running request ids in the order the step should fill them.
    waiting: waiting request ids in the order they should be admitted.
    token_budget: tokens the step may hold in all.
    long_cap: most tokens any one request may get in this step (``None``: no cap).
    tokens: what a greedy fill with these settings gives each request when KV blocks and seats do not run out
        (request id -> tokens; waiting requests as if their whole prompt still had to be computed).
    predicted_step_time: with ``chunk_size="auto"``, the predicted seconds of the planned step (else ``None``).
    held: running request ids (long prompts mid-prefill) the step must leave out, though they stay in ``running``'s
        order (see the module docstring).
    """

    running: list[str]
    waiting: list[str]
    token_budget: int
    long_cap: int | None
    tokens: dict[str, int] = field(default_factory=dict)
    predicted_step_time: float | None = None
    held: list[str] = field(default_factory=list)


def fill(running: Sequence[RequestView], waiting: Sequence[RequestView], token_budget: int,
         long_cap: int | None, max_running: int | None = None) -> dict[str, int]:
    """The greedy fill a vLLM-style loop runs: running requests in order, then waiting ones while seats last
    (``max_running``: most requests running at once), each ``min(num_remaining, long_cap, budget left)``.
    Returns request id -> tokens (requests given none are left out)."""
    tokens: dict[str, int] = {}
    left = token_budget
    seats = len(running) + len(waiting) if max_running is None else max_running
    for i, view in enumerate((*running, *waiting)):
        if left <= 0 or i >= max(seats, len(running)):  # a waiting one would run as one of i + 1
            break
        n = view.num_remaining
        if long_cap is not None and 0 < long_cap < n:
            n = long_cap
        n = min(n, left)
        if n > 0:
            tokens[view.request_id] = n
            left -= n
    return tokens


def decode_rows(decodes: Sequence[RequestView]) -> SchedulerOutput:
    """A ``SchedulerOutput`` holding one decode row per view (token ids and block tables left empty): what a
    step-time predictor needs to price the decode part of a step."""
    out = SchedulerOutput()
    for view in decodes:
        out.add(ScheduledRequest(view.request_id, view.num_computed_tokens, 1, [], [], True, False))
    return out


def plan_step(running: Sequence[RequestView], waiting: Sequence[RequestView], config: SchedulerConfig,
              budget: TokenBudget | None = None, just_held: Collection[str] = ()) -> StepPlan:
    """Decide one step (see the module docstring).

    running: the requests holding KV blocks, in the engine's order. waiting: the queue, in its order.
    config: a chunked policy's ``SchedulerConfig`` (its ``chunk_size``, ``max_num_batched_tokens``,
    ``hol_protection``, ``long_prefill_token_threshold``, ...). budget: the ``TokenBudget`` of
    ``chunk_size="auto"`` (required then). just_held: the previous step's ``StepPlan.held`` (not held again)."""
    decodes = [v for v in running if v.is_decode]
    prefills = sorted((v for v in running if not v.is_decode), key=lambda v: v.arrival)
    limit = config.max_num_batched_tokens
    seats = max(config.max_running - len(running), 0)
    waiting_order = list(waiting)
    threshold = config.long_threshold if config.protects_short_prompts else None
    longs: list[RequestView] = []
    shorts: list[RequestView] = []
    waiting_shorts: list[RequestView] = []  # of the waiting prompts a step may admit (with a seat)
    waiting_longs: list[RequestView] = []
    if threshold is not None:
        def is_long(v: RequestView) -> bool:
            return v.num_prompt_tokens > threshold

        longs = [v for v in prefills if is_long(v)]
        shorts = [v for v in prefills if not is_long(v)]
        waiting_order = [v for v in waiting if not is_long(v)] + [v for v in waiting if is_long(v)]
        prefills = shorts + longs
        waiting_shorts = [v for v in waiting[:seats] if not is_long(v)]
        waiting_longs = [v for v in waiting[:seats] if is_long(v)]
    protecting = bool(longs and (shorts or waiting_shorts))
    # under protection, the long prompts mid-prefill this step may hold out for the short prompts it protects
    holdable = protecting and not any(v.request_id in just_held for v in longs)  # never held two steps running
    seated = [*waiting_shorts, *waiting_longs] if threshold is not None else list(waiting[:seats])
    seat_bound = len(waiting) > seats
    if config.auto_budget:
        if budget is None:
            raise ValueError("chunk_size='auto' needs a TokenBudget to plan a step")
        # sized on the prompts in the order their tokens are given: where the long prompts may be held, the short
        # ones first (the cap then leaves them their whole need, or the long ones are held and the step is sized
        # again below); where they may not, the prompts mid-prefill first, as the cap may give the long ones their
        # share before the short ones are through (a short prompt's tokens, at a short context, cost less)
        if holdable:
            order = [*shorts, *waiting_shorts, *longs, *waiting_longs]
        else:
            order = [*prefills, *seated]
        token_budget = _auto_budget(budget, decodes, order, seat_bound, limit)
    else:
        token_budget = min(max(config.chunk_size, len(decodes)), limit)
    long_cap = config.long_prefill_token_threshold
    protected: tuple[RequestView, ...] = ()
    ordered = decodes + prefills
    tokens: dict[str, int] | None = None  # the greedy fill, where deciding the cap already ran it
    if threshold is not None:
        long_cap = None
        if protecting:
            # the long prompts get their share, and whatever the short ones leave of the budget
            prefill_budget = token_budget - len(decodes)
            short_need = sum(v.num_remaining for v in (*shorts, *waiting_shorts))
            # vLLM's loop applies one cap to every request, so the share is taken from the cap, not the step
            # (``long_chunk``: a quarter of max_num_batched_tokens under "auto"): a step's quarter, or a cap that
            # lets the most short prompts finish (the long prompt then gets as much as the longest of them), cut
            # the long prompts' progress and measured worse inside vLLM on the long-tail mix (2026-12-05, commit
            # f8d56a6: short TTFT p99 3.75 / 2.45 s, long 15.0 / 14.6 s, against 1.46 / 2.09 s and 7.3 / 9.5 s)
            long_need = sum(v.num_remaining for v in longs)
            share = long_share(config, prefill_budget, long_need, config.token_budget)
            long_cap = max(share, prefill_budget - short_need, 1)
            # the cap cuts short prompts as well: none where, without it, the long prompts still get their share
            # (the short prompts mid-prefill, filled before them, leave it) and no more than the cap (so the short
            # prompts behind them get the rest): a long prompt's last chunk beside a short prompt, where inside
            # vLLM a 128-token prompt got 40 tokens of a 176-token step, and 81 were used (2026-12-06 night)
            uncapped = fill(ordered, waiting_order, token_budget, None, config.max_running)
            if min(long_need, share) <= sum(uncapped.get(v.request_id, 0) for v in longs) <= long_cap:
                long_cap, tokens = None, uncapped
            if holdable:
                protected = (*shorts, *waiting_shorts)
    if tokens is None:
        tokens = fill(ordered, waiting_order, token_budget, long_cap, config.max_running)
    held: list[str] = []
    if any(tokens.get(v.request_id, 0) < v.num_remaining for v in protected):
        # the cap cuts a short prompt: the long prompts are held out, the short ones take the budget uncapped
        held, long_cap = [v.request_id for v in longs], None
        kept = [v for v in ordered if v.request_id not in held]  # held requests keep their seats
        if config.auto_budget:  # sized again for what the step now holds
            order = [*shorts, *seated]
            token_budget = _auto_budget(budget, decodes, order, seat_bound, limit)
        tokens = fill(kept, waiting_order, token_budget, None, config.max_running - len(held))
    predicted = None
    if budget is not None:
        predicted = budget.predict(_planned_output(ordered, waiting_order, tokens))
    return StepPlan([v.request_id for v in ordered], [v.request_id for v in waiting_order], token_budget,
                    long_cap, tokens, predicted, held)


def _auto_budget(budget: TokenBudget, decodes: Sequence[RequestView], prompts: Sequence[RequestView],
                 seat_bound: bool, limit: int) -> int:
    """The ``chunk_size="auto"`` step: the decodes plus the prefill tokens ``budget`` predicts fit for
    ``prompts`` (in the order they take them), at most ``limit`` tokens in all (``seat_bound``: see
    ``TokenBudget.prefill_tokens``)."""
    prefill = budget.prefill_tokens(decode_rows(decodes), [(v, v.num_remaining) for v in prompts], seat_bound)
    return min(len(decodes) + prefill, limit)


def _planned_output(running: Sequence[RequestView], waiting: Sequence[RequestView],
                    tokens: dict[str, int]) -> SchedulerOutput:
    """The planned step as a ``SchedulerOutput`` (rows without token ids or block tables), for a predictor."""
    out = SchedulerOutput()
    for view in (*running, *waiting):
        n = tokens.get(view.request_id)
        if n:
            start = view.num_computed_tokens
            out.add(ScheduledRequest(view.request_id, start, n, [], [], start + n == view.num_tokens,
                                     not view.is_decode))
    return out
