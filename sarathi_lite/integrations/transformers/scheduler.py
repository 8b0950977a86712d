"""``SarathiScheduler``: transformers' continuous-batching ``Scheduler`` with sarathi-lite deciding each step.

transformers keeps everything it owns: its ``RequestState``s, the paged cache (block allocation, prefix sharing,
offloading of starved requests), the model runner and the outputs. Each ``schedule_batch`` the host reads a
``RequestView`` of every active and waiting request, asks its policy (the ``policy`` option, any of
``POLICIES``; ``sarathi_lite.scheduler.decision``) for the step, and hands the decision to transformers' own fill
loop (``Scheduler._process_candidates``, the loop its ``"fifo"`` and ``"prefill_first"`` schedulers run: each
candidate in turn gets ``min(tokens it needs, budget left)`` where its KV blocks can be allocated):

- the candidates in the decision's order (``sarathi``: every decode first, then the prompts mid-prefill, then the
  waiting prompts, short ones before long ones under head-of-line protection), less the requests the step holds
  out (``StepDecision.held``: they stay active and keep their blocks);
- the step's token budget (``chunk_size``, or the ``"auto"`` budget), never above transformers' ``max_batch_tokens``;
- the cap on one request's tokens (``StepDecision.long_cap``), which transformers' loop lacks: while the loop runs,
  the tokens it reads for a prompt are cut to the cap (``_infer_request_tokens``) and the prompt is split at that
  length (``_schedule_request``), so KV blocks are allocated for the capped chunk only;
- under ``StepDecision.whole_prompts`` (the unchunked policies) only the waiting prompts the decision found whole
  room for, as the loop would otherwise chunk the next one; and where the loop schedules nothing of a decision,
  its fallback is filled instead.

Every step appends a record to ``step_log`` (bounded in memory; also a JSON-lines file with the ``step_log``
option): the decision and what transformers scheduled, so tests and benchmarks can check each claim against what ran.
With ``chunk_size="auto"`` the time from one ``schedule_batch`` to the next (the loop's period: schedule, forward,
sampling, update) is the step's measured time, fed back to the budget.

Only this package imports transformers.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from transformers.generation.continuous_batching.requests import FutureRequestState, RequestState, RequestStatus
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, Scheduler

from sarathi_lite.integrations.options import PluginOptions, build_options
from sarathi_lite.scheduler import POLICIES, ScheduledRequest, SchedulerOutput, TokenBudget
from sarathi_lite.scheduler.decision import RequestView, StepDecision, make_policy

logger = logging.getLogger(__name__)

BUILTIN_SCHEDULERS = ("fifo", "prefill_first")
"""transformers' own scheduler names, which ``register`` never replaces."""
DEFAULT_SAFETY_MARGIN = 0.15
"""The free share of KV blocks under which only decodes and one prompt are scheduled when the config leaves
``safety_margin`` unset: the ``"fifo"`` scheduler's default, as both fill decodes first."""
STEP_LOG_LENGTH = 100_000
"""Step records kept in memory (the oldest are dropped)."""


def request_view(state: RequestState) -> RequestView:
    """A transformers ``RequestState`` as the decision sees it. ``position_offset`` counts the tokens whose K/V are
    cached (or computed by a batch in flight under async batching); a decoding request needs its one token
    (``tokens_to_process``), any other its prompt tokens left (``remaining_prefill_tokens``). A request requeued
    after eviction is judged long or short on its original prompt."""
    pending = state.tokens_to_process if state.status == RequestStatus.DECODING else state.remaining_prefill_tokens
    prompt = state._true_initial_tokens or len(state.initial_tokens)
    return RequestView(state.request_id, state.position_offset, state.position_offset + len(pending), prompt,
                       state.created_time)


class SarathiScheduler(Scheduler):
    """transformers' scheduler with sarathi-lite's step decision (see the module docstring). ``raw_options`` are
    the options ``register`` checked (named as in ``SchedulerConfig``); ``__init__`` sizes them by the cache
    transformers built (its ``max_batch_tokens``, blocks and page size) and refuses what it cannot honour, before
    the first step."""

    raw_options: Mapping[str, Any] = MappingProxyType({})

    def __init__(self, cache: Any, safety_margin: float | None, max_requests_per_batch: int) -> None:
        self.step_log: deque[dict[str, Any]] = deque(maxlen=STEP_LOG_LENGTH)
        super().__init__(cache, DEFAULT_SAFETY_MARGIN if safety_margin is None else safety_margin,
                         max_requests_per_batch)
        self.options = self._parse(cache, max_requests_per_batch)
        config = self.options.config
        self.token_budget = TokenBudget(config, self.options.cost_model) if config.auto_budget else None
        self.policy = make_policy(config, self.token_budget)
        self._log_file = self.options.step_log.open("a", encoding="utf-8") if self.options.step_log else None
        logger.info("sarathi_lite scheduler in transformers: chunk_size %s, hol_protection %s, token budget %d",
                    config.chunk_size, config.hol_protection, config.max_num_batched_tokens)

    def _parse(self, cache: Any, max_requests_per_batch: int) -> PluginOptions:
        raw = dict(self.raw_options)
        limit = cache.max_batch_tokens
        chunk_size = raw.get("chunk_size", limit)
        if chunk_size != "auto" and chunk_size > limit:  # its type was checked by register
            raise ValueError(f"sarathi_lite chunk_size={chunk_size} is larger than transformers' max_batch_tokens="
                             f"{limit} (which sizes its buffers): raise ContinuousBatchingConfig(max_batch_tokens=...) "
                             f"or lower chunk_size")
        if chunk_size == "auto" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("sarathi_lite chunk_size='auto' sizes each step on this process's measured step times, "
                             "which differ between tensor-parallel ranks (each runs its own scheduler, and their "
                             "steps must agree): use a fixed chunk_size with tensor parallelism")
        page = min(a.tokens_per_page for a in cache.cache_allocators.values())
        max_model_len = getattr(cache.config, "max_position_embeddings", None) or cache.num_blocks * page
        return build_options(raw, POLICIES, chunk_size=chunk_size, max_num_batched_tokens=limit,
                             max_num_seqs=max_requests_per_batch, max_model_len=max_model_len, block_size=page,
                             num_blocks=cache.num_blocks, long_prefill_token_threshold=None,
                             enable_prefix_caching=bool(cache.use_prefix_sharing))

    def reset(self) -> None:
        super().reset()
        self._cap: int | None = None  # the decision's per-request cap, while transformers' fill loop runs
        self._known: set[str] = set()  # the requests a step record has named
        self._last: tuple[float, SchedulerOutput, dict[str, Any], set[str]] | None = None  # the step not yet timed
        if hasattr(self, "options"):  # a new generation loop: the policy forgets the last loop's steps
            self.policy = make_policy(self.options.config, self.token_budget)

    # ------------------------------------------------------------------ one step

    def schedule_batch(self, token_budget: int, cache_budget: int
                       ) -> tuple[list[FutureRequestState] | None, bool, int, int]:
        started = time.perf_counter()
        active = list(self.active_requests.values())
        waiting = [] if self.block_new_requests else self._get_waiting_candidates()
        self._time_last_step(started, active, waiting)
        running_views = [request_view(s) for s in active]
        decision = self.policy.decide(running_views, [request_view(s) for s in waiting])
        states = {s.request_id: s for s in (*active, *waiting)}
        leaving_waiting: set[str] = set()
        while True:  # the decision, or its fallback where transformers' fill schedules nothing of it
            self._cap = decision.long_cap
            try:
                scheduled, allocation_failed, fast_path, num_q, max_kv = self._process_candidates(
                    self._candidates(decision, states), min(decision.token_budget, token_budget), cache_budget,
                    leaving_waiting)
            finally:
                self._cap = None
            if scheduled or decision.fallback is None:
                break
            decision = decision.fallback
        self._cleanup_waiting_queue(leaving_waiting)
        decodes = [v.request_id for v in running_views if v.is_decode]
        self.policy.stepped(any(f.state.request_id not in decodes for f in scheduled))
        self._record(decision, scheduled, decodes, started)
        if not scheduled and allocation_failed:  # the cache is full: transformers offloads and asks again
            return None, fast_path, 0, 0
        return scheduled, fast_path, num_q, max_kv

    @staticmethod
    def _candidates(decision: StepDecision, states: dict[str, RequestState]) -> list[RequestState]:
        """The requests transformers' fill loop walks for ``decision``: its running order less the held requests,
        then the waiting prompts it may admit (under ``whole_prompts`` only those it found whole room for, as
        transformers' loop would otherwise chunk the next one)."""
        held = set(decision.held)
        waiting = [rid for rid in decision.waiting if rid in decision.tokens] if decision.whole_prompts \
            else decision.waiting
        return [states[rid] for rid in (*decision.running, *waiting) if rid not in held]

    def _infer_request_tokens(self, state: RequestState, request_ids_to_remove_from_waiting: set[str]) -> list[int]:
        tokens = super()._infer_request_tokens(state, request_ids_to_remove_from_waiting)
        cap = self._cap
        return tokens if cap is None or len(tokens) <= cap else tokens[:cap]

    def _schedule_request(self, state: RequestState, request_tokens: list[int], token_budget: int,
                          request_ids_to_remove_from_waiting: set[str]) -> None:
        if self._cap is not None:  # the tokens were cut to the cap: split the whole prompt left at that length
            whole = state.tokens_to_process if state.status == RequestStatus.DECODING \
                else state.remaining_prefill_tokens
            token_budget, request_tokens = min(token_budget, len(request_tokens)), whole
        super()._schedule_request(state, request_tokens, token_budget, request_ids_to_remove_from_waiting)

    # ------------------------------------------------------------------ the step log and the "auto" budget

    def _record(self, decision: StepDecision, scheduled: list[FutureRequestState], decodes: list[str], started: float
                ) -> None:
        """Append the step's record: what was planned and what transformers scheduled."""
        counts = {f.state.request_id: f.query_length for f in scheduled}
        states = {**self.waiting_requests, **self.active_requests}
        new = {rid: [len(s.initial_tokens), s.max_new_tokens] for rid, s in states.items() if rid not in self._known}
        self._known = set(states)
        record: dict[str, Any] = {
            "step": len(self.step_log), "new": new, "scheduled": counts, "decodes": decodes,
            "starved": [s.request_id for s, _ in self.starved_requests], "token_budget": decision.token_budget,
            "long_cap": decision.long_cap, "held": decision.held, "planned": decision.tokens,
            "predicted": decision.predicted_step_time, "measured": None, "time": time.monotonic(),
        }
        if self.token_budget is not None:  # the "auto" budget's state the step was sized by
            b = self.token_budget
            record["budget"] = {"target": b.target, "correction": b.correction, "spread": b.spread,
                                "between": b.between}
        self.step_log.append(record)
        if self.token_budget is not None and scheduled:
            rows = SchedulerOutput()  # the step as the cost model prices it (positions before this step's tokens)
            decoding = set(decodes)
            for f in scheduled:
                rid = f.state.request_id
                rows.add(ScheduledRequest(rid, f.state.position_offset, f.query_length, [], [], f.has_new_token,
                                          rid not in decoding))
            self._last = (started, rows, record, set(states))
        elif self._log_file is not None:
            self._write(record)

    def _time_last_step(self, now: float, active: list[RequestState], waiting: list[RequestState]) -> None:
        """With ``"auto"``: the last step took from its ``schedule_batch`` to this one, unless the loop went idle in
        between (none of the requests it knew is still here: all finished, and the loop waited for new ones)."""
        if self._last is None:
            return
        started, rows, record, known = self._last
        self._last = None
        if any(s.request_id in known for s in (*active, *waiting)):
            record["measured"] = now - started
            self.token_budget.observe_output(rows, now - started, now)
        if self._log_file is not None:
            self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        self._log_file.write(json.dumps(record) + "\n")
        self._log_file.flush()

    def close(self) -> None:
        """Close the ``step_log`` file (records still in memory stay)."""
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


class SchedulerName(str):
    """A name ``register`` gave a scheduler, carrying its options: unpickled in another process (``transformers
    serve`` runs its model in a spawned process, with the ``ContinuousBatchingConfig`` pickled), it registers the
    same scheduler there first. Compares and hashes as the plain name."""

    options: dict[str, Any]

    def __new__(cls, name: str, options: Mapping[str, Any]) -> SchedulerName:
        self = super().__new__(cls, name)
        self.options = dict(options)
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _register_again, (str(self), self.options)


def _register_again(name: str, options: dict[str, Any]) -> SchedulerName:
    return register(name, **options)


def register(name: str = "sarathi", **options: Any) -> SchedulerName:
    """Register a scheduler running sarathi-lite's decision under ``name`` in transformers'
    ``SCHEDULER_MAPPING``, with ``options`` named as in ``SchedulerConfig`` (``chunk_size``: an int, at most
    transformers' ``max_batch_tokens``, or ``"auto"`` with ``tbt_slo`` and ``cost_model``; ``hol_protection``,
    ``tbt_percentile``, ``budget_safety``, ``min_chunk_size``, ``policy``; ``step_log``:
    a JSON-lines file of the steps). Without ``chunk_size`` the token budget is transformers' ``max_batch_tokens``.
    Importing ``sarathi_lite.integrations.transformers`` registers ``"sarathi"`` with the defaults.

    Returns the name to pass as ``ContinuousBatchingConfig(scheduler_type=...)``. Raises ``ValueError`` naming a
    bad option (what depends on the cache, a ``chunk_size`` above ``max_batch_tokens``, is refused when
    transformers builds the scheduler, before its first step), or a name of transformers' own schedulers."""
    if not isinstance(name, str) or not name or name in BUILTIN_SCHEDULERS:
        raise ValueError(f"scheduler name {name!r} must be a non-empty string other than transformers' own "
                         f"{', '.join(BUILTIN_SCHEDULERS)}")
    # every check that needs no cache, on a stand-in of the host's limits (the budget is then the chunk size)
    chunk_size = options.get("chunk_size", 1)
    limit = chunk_size if isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size > 0 \
        else 2048
    build_options(options, POLICIES, chunk_size=chunk_size, max_num_batched_tokens=limit, max_num_seqs=1,
                  max_model_len=limit, block_size=16, num_blocks=1, long_prefill_token_threshold=None,
                  enable_prefix_caching=True)
    frozen = MappingProxyType(dict(options))
    SCHEDULER_MAPPING[str(name)] = type(f"SarathiScheduler[{name}]", (SarathiScheduler,),
                                        {"raw_options": frozen, "__module__": __name__})
    return SchedulerName(str(name), options)
