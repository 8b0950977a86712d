"""The scheduling decision: one step decided from read-only views of the requests, for every policy and every host.

A host (our ``Scheduler``, the vLLM plugin, the transformers host, your own engine loop) keeps its own requests and
KV cache. Each step it hands the policy a view of every running request it may schedule and of every waiting one
(``RequestView``, or any object with the same attributes), and gets back a ``StepDecision``, which it applies with one
greedy fill, the loop vLLM runs:

1. walk ``decision.running`` in order, skipping ``decision.held``; give each request ``min(tokens it still needs,
   decision.long_cap, budget left)`` while ``decision.token_budget`` lasts. A request that needs a KV block the pool
   cannot give preempts the last request of ``decision.running`` (itself, if it is the last);
2. then, only in a step that preempted nobody, admit ``decision.waiting`` in order while seats, KV blocks and budget
   last, each with the same ``min``; under ``decision.whole_prompts`` (the unchunked policies) only a prompt whose
   whole remaining prefill fits the budget left, stopping at the first that does not;
3. if the step holds no token at all, apply ``decision.fallback`` the same way (the unchunked policies' decode step
   when no prompt could be admitted, ``simple_chunking``'s other kind of step).

``StepDecision.tokens`` is what that fill gives when blocks and seats do not run out; a host may read it, but the
fill is what applies the decision, so prefix-cache hits and preemption work out as in any vLLM-style loop.

The policies (``POLICIES``; ``make_policy`` builds one):

- ``sarathi``: stall-free hybrid batches. Every decode first (so no decode is left out of a step that schedules
  prefill), then prompts mid-prefill, then waiting prompts, under ``chunk_size`` (or the ``"auto"`` budget of
  ``TokenBudget``: the decodes plus the prefill tokens predicted to fit the TBT target). Head-of-line protection
  (``hol_protection``): a prompt is long above ``config.long_threshold`` tokens while it needs more than one
  step's prefill. Where a short prompt is there to protect (mid-prefill, or waiting with a seat), one long prompt
  is mid-prefill at a time; while one is beside a short prompt, short prompts go first, and a per-request cap
  (``long_cap``) keeps the long prompts to their share (``long_share``) or what the short prompts leave,
  whichever is more. A greedy fill applies one cap to every request, so where the cap would cut a short prompt,
  the long prompts mid-prefill are held out of the step instead and the short prompts take the whole budget;
  never two steps running, so a stream of short prompts cannot starve a long one.
- ``simple_chunking``: the same prefill steps, but never beside decodes: prefill-only and decode-only steps
  alternate while both have work.
- ``vllm_v1``: vLLM V1's own rule, to compare with it: running requests in their order, decodes and chunks alike,
  each capped at ``long_prefill_token_threshold`` while more than one request is running or waiting.
- ``orca``, ``vllm``, ``request_level``: the Sarathi-Serve paper's unchunked baselines (whole prompts beside the
  decodes; prefill-only steps first; a new batch only when the last has finished).

Stdlib only, like the whole scheduler.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Protocol

from .budget import TokenBudget
from .config import SchedulerConfig
from .output import ScheduledRequest, SchedulerOutput
from .registry import policy_class, register_policy


class View(Protocol):
    """What the decision reads of a request (read-only; ``RequestView`` is the plain record, and our ``Request``
    has the same attributes)."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    arrival: float
    num_remaining: int
    is_decode: bool


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
class StepDecision:
    """One step's decision, in the terms a greedy fill loop takes (see the module docstring).

    running: running request ids in the order the step fills them (held ones at their place: the order is also
        the preemption order, last first).
    waiting: the waiting request ids the step may admit, in order.
    token_budget: tokens the step may hold in all.
    long_cap: most tokens any one request may get in this step (``None``: no cap).
    tokens: what the fill gives each request when KV blocks and seats do not run out (request id -> tokens).
    predicted_step_time: with ``chunk_size="auto"``, the predicted seconds of the planned step (else ``None``).
    held: running request ids the step leaves out.
    whole_prompts: admit a waiting prompt only if its whole remaining prefill fits the budget left.
    fallback: the step to apply instead when this one holds no token.
    views: the views of ``running`` in its order (the objects the host passed: a host whose views are its own
        requests walks them without looking ids up); not part of the decision's equality.
    """

    running: list[str]
    waiting: list[str]
    token_budget: int
    long_cap: int | None = None
    tokens: dict[str, int] = field(default_factory=dict)
    predicted_step_time: float | None = None
    held: list[str] = field(default_factory=list)
    whole_prompts: bool = False
    fallback: StepDecision | None = None
    views: list = field(default_factory=list, compare=False, repr=False)


def fill(running: Sequence[View], waiting: Sequence[View], token_budget: int, long_cap: int | None,
         max_running: int | None = None, whole_prompts: bool = False) -> dict[str, int]:
    """The greedy fill a host runs (module docstring, without KV blocks): running requests in order, then waiting
    ones while seats last (``max_running``: most requests running at once, counting ``running``), each
    ``min(num_remaining, long_cap, budget left)``; under ``whole_prompts`` a waiting prompt only if it fits whole.
    Returns request id -> tokens (requests given none are left out)."""
    tokens: dict[str, int] = {}
    left = token_budget
    for view in running:
        if left <= 0:
            return tokens
        n = view.num_remaining
        if long_cap is not None and long_cap < n:
            n = long_cap
        if n > left:
            n = left
        if n > 0:
            tokens[view.request_id] = n
            left -= n
    seats = len(waiting) if max_running is None else max_running - len(running)
    for view in islice(waiting, max(seats, 0)):
        if left <= 0:
            break
        n = view.num_remaining
        if whole_prompts and n > left:
            break
        if long_cap is not None and long_cap < n:
            n = long_cap
        n = min(n, left)
        tokens[view.request_id] = n
        left -= n
    return tokens


def long_share(prefill_budget: int, long_remaining: int) -> int:
    """The prefill tokens kept for the long prompts mid-prefill in a step short prompts fill first: half the
    step's prefill budget, or what they still need (``long_remaining``) if less. So they progress every step
    while at least half of the prefill budget is the short prompts'. Half, not less: on ordinary traffic a
    quarter of a 256-token chunk left the long prompts 64 tokens a step and served 6% fewer requests under the
    SLO (docs/results/one_decision.md)."""
    return min(prefill_budget // 2, long_remaining)


def decode_rows(decodes: Sequence[View]) -> SchedulerOutput:
    """A ``SchedulerOutput`` holding one decode row per view (token ids and block tables left empty): what a
    step-time predictor needs to price the decode part of a step."""
    out = SchedulerOutput()
    for view in decodes:
        out.add(ScheduledRequest(view.request_id, view.num_computed_tokens, 1, [], [], True, False))
    return out


def decide_step(running: Sequence[View], waiting: Sequence[View], config: SchedulerConfig,
              budget: TokenBudget | None = None, just_held: Collection[str] = (),
              num_other_running: int = 0) -> StepDecision:
    """The ``sarathi`` policy's step (see the module docstring).

    running: the running requests the step may schedule, in the host's order. waiting: the queue, in its order.
    config: a chunked policy's ``SchedulerConfig``. budget: the ``TokenBudget`` of ``chunk_size="auto"`` (required
    then). just_held: the previous step's ``StepDecision.held`` (not held again). num_other_running: requests holding a
    seat that are not in ``running`` (in flight, loading KV): they count against ``max_num_seqs``."""
    decodes = [v for v in running if v.is_decode]
    prefills = sorted((v for v in running if not v.is_decode), key=_arrival) if len(decodes) < len(running) else []
    decode_ids = _ids(decodes)
    limit = config.max_num_batched_tokens
    max_running = config.max_running - num_other_running
    seats = max(max_running - len(running), 0)
    threshold = config.long_threshold if config.protects_short_prompts else None
    if threshold is not None and not any(v.num_prompt_tokens > threshold for v in prefills) \
            and not any(v.num_prompt_tokens > threshold for v in islice(waiting, seats)):
        threshold = None  # no prompt the step may run is long: nothing to protect, nothing to reorder (a long
        # prompt behind the free seats changes nothing: the seats go to the prompts ahead of it, all short)
    # the waiting prompts in admission order, as many as seats are free (no step admits more)
    waiting_order = list(islice(waiting, seats))
    longs: list[View] = []
    shorts: list[View] = []
    waiting_shorts: list[View] = []  # of the waiting prompts a step may admit (with a seat)
    waiting_longs: list[View] = []
    if threshold is not None:
        # a prompt is long while it is above the threshold and still needs more than one step's prefill (with a
        # fixed chunk size; "auto" steps have no size until they are planned): one that finishes in this step
        # holds back nobody. Short prompts pass long ones in the queue, from anywhere in it, and are the prompts
        # to protect; while there are some, one long prompt is mid-prefill at a time (it holds its KV while it
        # prefills over many steps, which would starve them of blocks)
        step_prefill = 0 if config.auto_budget else config.token_budget - len(decodes)

        def is_long(v: View) -> bool:
            return v.num_prompt_tokens > threshold and v.num_remaining > step_prefill

        longs = [v for v in prefills if is_long(v)]
        shorts = [v for v in prefills if not is_long(v)]
        waiting_shorts = list(islice((v for v in waiting if not is_long(v)), seats))
        if shorts or waiting_shorts:
            prefills = shorts + longs
            if not longs and len(waiting_shorts) < seats:
                waiting_longs = list(islice((v for v in waiting if is_long(v)), 1))
            waiting_order = [*waiting_shorts, *waiting_longs]
        else:  # every prompt the step may run is long: no short prompt to protect, the step is the plain one
            threshold, longs = None, []
    protecting = bool(longs and (shorts or waiting_shorts))
    holdable = protecting and not any(v.request_id in just_held for v in longs)
    seated = [*waiting_shorts, *waiting_longs] if threshold is not None else waiting_order
    seat_bound = len(waiting) > seats
    if config.auto_budget:
        if budget is None:
            raise ValueError("chunk_size='auto' needs a TokenBudget to decide a step")
        # sized on the prompts in the order they take tokens: the short ones first where the long ones may be
        # held (the step is sized again below if they are); else the prompts mid-prefill first, since the cap may
        # give the long ones their share before the short ones are through
        order = [*shorts, *waiting_shorts, *longs, *waiting_longs] if holdable else [*prefills, *seated]
        token_budget = _auto_budget(budget, decodes, order, seat_bound, limit)
    else:
        token_budget = min(max(config.chunk_size, len(decodes)), limit)
    long_cap = None if config.protects_short_prompts else config.long_prefill_token_threshold
    ordered = [*decodes, *prefills] if prefills else decodes
    tokens: dict[str, int] | None = None

    def fill_step(kept: Sequence[View], budget_: int, cap: int | None, seats_for: int) -> dict[str, int]:
        # every decode first, one token each (the budget holds them all but where max_num_batched_tokens is
        # smaller), then the prompts: ``fill`` over decodes and prompts, without walking the decodes
        if budget_ < len(decode_ids):
            return fill([*decodes, *kept], waiting_order, budget_, cap, seats_for)
        step = dict.fromkeys(decode_ids, 1)
        step.update(fill(kept, waiting_order, budget_ - len(decode_ids), cap, seats_for - len(decode_ids)))
        return step

    protected: tuple[View, ...] = ()
    if protecting:
        # the long prompts get their share, or whatever the short ones leave of the budget if more; one cap
        # applies to every request, so the share is taken from the cap
        prefill_budget = token_budget - len(decodes)
        short_need = sum(v.num_remaining for v in (*shorts, *waiting_shorts))
        long_need = sum(v.num_remaining for v in longs)
        share = long_share(prefill_budget, long_need)
        total = max(share, prefill_budget - short_need, 1)  # what the long prompts get together
        long_cap = max(total // len(longs), 1)
        # no cap where the long prompts get their share and no more than that without one: there it would only
        # cut short prompts
        uncapped = fill_step(prefills, token_budget, None, max_running)
        if min(long_need, share) <= sum(uncapped.get(v.request_id, 0) for v in longs) <= total:
            long_cap, tokens = None, uncapped
        if holdable:
            protected = (*shorts, *waiting_shorts)
    if tokens is None:
        tokens = fill_step(prefills, token_budget, long_cap, max_running)
    running_ids = [*decode_ids, *_ids(prefills)] if prefills else decode_ids
    waiting_ids = _ids(waiting_order)
    if not any(tokens.get(v.request_id, 0) < v.num_remaining for v in protected):
        return StepDecision(running_ids, waiting_ids, token_budget, long_cap, tokens,
                        _predict(budget, ordered, waiting_order, tokens), views=ordered)
    # the cap cuts a short prompt: the long prompts sit this step out and the short ones take the budget. Where
    # the host cannot admit them (the KV pool is short) the step would hold nothing: the capped step is then its
    # fallback
    capped = StepDecision(running_ids, waiting_ids, token_budget, long_cap, tokens,
                      _predict(budget, ordered, waiting_order, tokens), views=ordered)
    held = _ids(longs)
    if config.auto_budget:
        token_budget = _auto_budget(budget, decodes, [*shorts, *seated], seat_bound, limit)
    tokens = fill_step(shorts, token_budget, None, max_running - len(held))  # held requests keep their seats
    return StepDecision(running_ids, waiting_ids, token_budget, None, tokens,
                    _predict(budget, ordered, waiting_order, tokens), held, fallback=capped, views=ordered)


def _predict(budget: TokenBudget | None, running: Sequence[View], waiting: Sequence[View],
             tokens: dict[str, int]) -> float | None:
    """The predicted seconds of the planned step under ``chunk_size="auto"`` (else ``None``)."""
    return None if budget is None else budget.predict(_planned_output(running, waiting, tokens))


def first_runnable(decision: StepDecision, free_blocks: int, block_size: int) -> StepDecision:
    """The step of the chain ``decision`` -> its fallbacks that a host whose fill loop runs once (vLLM's) applies:
    the first that gives a running request a token, or whose first admitted prompt fits ``free_blocks`` KV blocks
    of ``block_size`` tokens. The rule is the module docstring's third one (a step that would hold no token gives
    way to its fallback), predicted before the fill; a host that can fill again (our ``Scheduler``) applies it
    after an empty fill instead. The prediction ignores prefix-cache hits, so it may fall back where the fill
    would have found room in the cache, never the other way."""
    while decision.fallback is not None:
        held = set(decision.held)
        if any(decision.tokens.get(rid) for rid in decision.running if rid not in held):
            return decision
        first = next((rid for rid in decision.waiting if rid in decision.tokens), None)
        if first is not None and free_blocks * block_size >= decision.tokens[first]:
            return decision
        decision = decision.fallback
    return decision


def then(first: StepDecision | None, other: StepDecision) -> StepDecision:
    """``first`` with ``other`` applied when ``first`` and all its fallbacks hold nothing (copies: decisions are not
    changed)."""
    if first is None:
        return other
    return replace(first, fallback=then(first.fallback, other))


def _auto_budget(budget: TokenBudget, decodes: Sequence[View], prompts: Sequence[View], seat_bound: bool,
                 limit: int) -> int:
    """The ``chunk_size="auto"`` step: the decodes plus the prefill tokens ``budget`` predicts fit for ``prompts``
    (in the order they take them), at most ``limit`` tokens in all (``seat_bound``: see
    ``TokenBudget.prefill_tokens``)."""
    prefill = budget.prefill_tokens(decode_rows(decodes), [(v, v.num_remaining) for v in prompts], seat_bound)
    return min(len(decodes) + prefill, limit)


def _planned_output(running: Sequence[View], waiting: Sequence[View], tokens: dict[str, int]) -> SchedulerOutput:
    """The planned step as a ``SchedulerOutput`` (rows without token ids or block tables), for a predictor."""
    out = SchedulerOutput()
    for view in (*running, *waiting):
        n = tokens.get(view.request_id)
        if n:
            start = view.num_computed_tokens
            out.add(ScheduledRequest(view.request_id, start, n, [], [], start + n == view.num_tokens,
                                     not view.is_decode))
    return out


def _ids(views: Sequence[View]) -> list[str]:
    return [v.request_id for v in views]


def _arrival(view: View) -> float:
    return view.arrival


# ---------------------------------------------------------------------------------------------------- policies


class Policy:
    """A policy decides each step from views (``decide``); a host applies the decision (module docstring) and tells it
    whether the step it ran held prefill tokens (``stepped``). A new policy is one subclass with a ``name`` and
    ``chunked`` (whether it cuts prompts under ``chunk_size``) and one ``register_policy``."""

    name = "base"
    chunked = True
    reproduces: str | None = None
    """Another engine's rule this policy reproduces (compared with that engine, not held to the paper's
    invariants)."""

    def __init__(self, config: SchedulerConfig, budget: TokenBudget | None = None) -> None:
        self.config = config
        self.budget = budget

    def decide(self, running: Sequence[View], waiting: Sequence[View], num_other_running: int = 0) -> StepDecision:
        """The step for these views (``num_other_running``: see ``decide_step``)."""
        raise NotImplementedError

    def stepped(self, had_prefill: bool) -> None:
        """The host ran a step (``had_prefill``: it held prefill tokens)."""

    def _seated(self, running: Sequence[View], waiting: Sequence[View], num_other_running: int) -> list[View]:
        """The waiting requests a step may admit: as many as seats are free, in queue order."""
        return list(islice(waiting, max(self.config.max_running - num_other_running - len(running), 0)))

    def _decode_step(self, running: Sequence[View]) -> StepDecision:
        """A decode-only step: every decode, the rest held, nothing admitted."""
        decodes = [v for v in running if v.is_decode]
        held = [v.request_id for v in running if not v.is_decode]
        return StepDecision(_ids(running), [], max(len(decodes), 1), None,
                        {v.request_id: 1 for v in decodes}, None, held)


@register_policy
class Sarathi(Policy):
    """Stall-free hybrid batches with head-of-line protection (``decide_step``)."""

    name = "sarathi"

    def __init__(self, config: SchedulerConfig, budget: TokenBudget | None = None) -> None:
        super().__init__(config, budget)
        self._held: Collection[str] = ()

    def decide(self, running: Sequence[View], waiting: Sequence[View], num_other_running: int = 0) -> StepDecision:
        decision = decide_step(running, waiting, self.config, self.budget, self._held, num_other_running)
        self._held = set(decision.held) if decision.held else ()
        return decision


@register_policy
class VLLMV0(Policy):
    """Prefill-prioritizing, unchunked (vLLM v0): whenever a waiting prompt can be admitted, a prefill-only step of
    whole prompts up to ``max_num_batched_tokens``; otherwise a decode-only step."""

    name = "vllm"
    chunked = False

    def decide(self, running: Sequence[View], waiting: Sequence[View], num_other_running: int = 0) -> StepDecision:
        decode = self._decode_step(running)
        seated = self._seated(running, waiting, num_other_running)
        if not seated:
            return decode
        budget = self.config.max_num_batched_tokens
        return StepDecision(_ids(running), _ids(seated), budget, None, fill((), seated, budget, None, None, True),
                        held=_ids(running), whole_prompts=True, fallback=decode)


@register_policy
class Orca(Policy):
    """Iteration-level batching (Orca): every decode, plus whole waiting prompts up to ``max_num_batched_tokens``
    in the same step. Prompts are never chunked, so a long prompt stalls the decodes batched with it."""

    name = "orca"
    chunked = False

    def decide(self, running: Sequence[View], waiting: Sequence[View], num_other_running: int = 0) -> StepDecision:
        seated = self._seated(running, waiting, num_other_running)
        budget = self.config.max_num_batched_tokens
        return StepDecision(_ids(running), _ids(seated), budget, None, fill(running, seated, budget, None, None, True),
                        whole_prompts=True)


@register_policy
class RequestLevel(Policy):
    """Request-level batching (FasterTransformer): a batch of whole prompts is admitted only when the previous
    batch has entirely finished; then it decodes until every member is done."""

    name = "request_level"
    chunked = False

    def decide(self, running: Sequence[View], waiting: Sequence[View], num_other_running: int = 0) -> StepDecision:
        if running or num_other_running:
            return self._decode_step(running)
        seated = self._seated(running, waiting, 0)
        budget = self.config.max_num_batched_tokens
        return StepDecision([], _ids(seated), budget, None, fill((), seated, budget, None, None, True),
                        whole_prompts=True)


@register_policy
class SimpleChunking(Sarathi):
    """Chunked prefill-only steps alternating with decode-only steps (the paper's "chunked-prefills-only"
    ablation): the prefill steps are ``sarathi``'s without the decodes; a decode-only step follows a step that
    held prefill whenever decodes wait, and each kind falls back to the other when it holds nothing."""

    name = "simple_chunking"

    def __init__(self, config: SchedulerConfig, budget: TokenBudget | None = None) -> None:
        super().__init__(config, budget)
        self._last_had_prefill = False

    def decide(self, running: Sequence[View], waiting: Sequence[View], num_other_running: int = 0) -> StepDecision:
        decodes = [v for v in running if v.is_decode]
        prompts = [v for v in running if not v.is_decode]
        prefill = self._without(super().decide(prompts, waiting, num_other_running + len(decodes)), decodes)
        decode = self._decode_step(running)
        if decodes and self._last_had_prefill:
            return then(decode, prefill)
        # a prefill step, else the decodes, else (every decode preempted to make room) prefill again
        return then(prefill, then(decode, prefill))

    @staticmethod
    def _without(decision: StepDecision, decodes: Sequence[View]) -> StepDecision:
        """``decision`` (and its fallbacks) with ``decodes`` held at the head of its running order."""
        ids = _ids(decodes)
        fallback = None if decision.fallback is None else SimpleChunking._without(decision.fallback, decodes)
        return replace(decision, running=[*ids, *decision.running], held=[*ids, *decision.held], fallback=fallback)

    def stepped(self, had_prefill: bool) -> None:
        self._last_had_prefill = had_prefill


@register_policy
class VLLMV1(Policy):
    """vLLM V1's own rule (``policy="fcfs"``, chunked prefill), so the simulator can run vLLM beside our policies:
    one token budget (``chunk_size``, vLLM's ``max_num_batched_tokens``) filled from the running requests in
    their order, decodes and prompt chunks alike, then waiting prompts in order, each ``min(tokens it needs,
    long_prefill_token_threshold, budget left)`` (the cap only while more than one request is running or
    waiting). No head-of-line protection. Checked step by step against the real vLLM scheduler
    (``tests/vllm_plugin``)."""

    name = "vllm_v1"
    reproduces = "vLLM 0.32 V1 scheduler"

    def decide(self, running: Sequence[View], waiting: Sequence[View], num_other_running: int = 0) -> StepDecision:
        cfg = self.config
        threshold = cfg.long_prefill_token_threshold
        cap = threshold if threshold and len(running) + num_other_running + len(waiting) > 1 else None
        seated = self._seated(running, waiting, num_other_running)
        return StepDecision(_ids(running), _ids(seated), cfg.token_budget, cap,
                        fill(running, seated, cfg.token_budget, cap))


def make_policy(config: SchedulerConfig, budget: TokenBudget | None = None) -> Policy:
    """The policy ``config.policy`` names, deciding under ``config`` (``budget``: required with
    ``chunk_size="auto"``)."""
    if config.auto_budget and budget is None:
        raise ValueError("chunk_size='auto' needs a TokenBudget (a step-time predictor) to choose each budget")
    return policy_class(config.policy)(config, budget)
