"""``SarathiScheduler``: vLLM's ``AsyncScheduler`` with sarathi-lite deciding each step's token counts.

vLLM keeps everything it owns: its requests, KV cache manager (``allocate_slots``, prefix caching, preemption),
connectors, structured output and outputs. Each ``schedule()`` the plugin reads a ``RequestView`` of every running
and waiting request, asks its policy (``sarathi_lite.scheduler.decision``) for the step, and hands the decision to
vLLM's own fill loop through the settings it reads at the top of every step:

- the order of ``self.running`` (decodes first, then prompts mid-prefill) and of ``self.waiting``;
- ``self.max_num_scheduled_tokens``, the step's token budget (``chunk_size``, or the ``"auto"`` budget);
- ``scheduler_config.long_prefill_token_threshold``, the cap on one request's tokens in this step (the long
  prompts' share under head-of-line protection);
- the waiting requests the decision does not admit (a second long prompt, those beyond the free seats) are taken
  out of ``self.waiting`` for the step and put back behind the others;
- and for a step that holds the long prompts mid-prefill out (``StepDecision.held``: the short prompts beside them
  then finish in this step), each such request's ``next_decode_eligible_step``, which vLLM's fill loop checks
  before it gives a running request tokens. vLLM's fill loop runs once, so where a step would hold nothing
  (no running request scheduled, and vLLM's free KV blocks cannot take the first prompt it admits) the decision's
  fallback is chosen before it runs (``first_runnable``).

All are put back after the step, so vLLM's configuration is unchanged between steps. With ``policy="vllm_v1"``
nothing is changed and the steps are only logged. Every step appends a record to ``step_log`` (bounded in memory;
also a JSON-lines file with the ``step_log`` option): the decision and what vLLM scheduled (the draft tokens of each
decode under ``drafts``), so tests and benchmarks can check each claim against what really ran.

Speculative decoding: a running decode with draft tokens (vLLM's ``request.spec_token_ids``: the drafter's
proposals, or their placeholders under async scheduling) needs ``1 + drafts`` tokens, which vLLM's fill loop gives
it in one piece. The decision sees such a request as a decode and each draft token as one more decode at the next
position (``_views``), so the drafts take their place in the step's token budget beside the decodes (the prefill
tokens are what the decodes and their drafts leave), hold no seat, and are priced by the ``"auto"`` budget's cost
model as decode tokens of their request (``DraftsAsDecodeTokens``: one row of ``1 + drafts`` query tokens over
the request's context, the way the step runs them). Drafts beyond the step's per-request cap (a long prompt's
share under head-of-line protection) are dropped by vLLM's fill loop, as under its own threshold.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler

from sarathi_lite.scheduler import ScheduledRequest, SchedulerOutput, TokenBudget
from sarathi_lite.scheduler.decision import RequestView, first_runnable, make_policy

from .options import describe
from .preflight import check_vllm_config

logger = logging.getLogger("vllm.sarathi_lite")
"""Under vLLM's ``vllm`` logger, whose handler vLLM configures, so its lines appear in vLLM's log."""

STEP_LOG_LENGTH = 100_000
"""Step records kept in memory (the oldest are dropped)."""


def _views(request: Any, max_model_len: int) -> list[RequestView]:
    """A vLLM ``Request`` as the decision sees it (tokens in flight under async scheduling count as known): its own
    view, and for a decode with draft tokens one decode view per draft token vLLM would schedule (at most
    ``max_model_len`` positions, as vLLM caps them), each at its position, with id ``(request_id, i)``."""
    computed, placeholders = request.num_computed_tokens, request.num_output_placeholders
    known = request.num_tokens_with_spec + placeholders
    drafts = len(request.spec_token_ids)
    if not drafts or request.num_tokens + placeholders - computed != 1:  # a prompt's drafts (none in vLLM) stay in
        return [RequestView(request.request_id, computed, known, request.num_prompt_tokens, request.arrival_time)]
    drafts = max(min(drafts, max_model_len - computed - 2), 0)
    return [RequestView(request.request_id, computed, computed + 1, request.num_prompt_tokens, request.arrival_time),
            *(RequestView((request.request_id, i), computed + 1 + i, computed + 2 + i, request.num_prompt_tokens,
                          request.arrival_time) for i in range(drafts))]


def _owner(request_id: Any) -> str:
    """The request a view id belongs to (a draft token's id is ``(request_id, i)``)."""
    return request_id[0] if isinstance(request_id, tuple) else request_id


def _per_request(tokens: dict[Any, int]) -> dict[str, int]:
    """Planned tokens by view id folded into tokens by request (a decode's drafts added to it)."""
    out: dict[str, int] = {}
    for rid, n in tokens.items():
        out[_owner(rid)] = out.get(_owner(rid), 0) + n
    return out


class DraftsAsDecodeTokens:
    """A step-time predictor that prices a decode's draft tokens as decode tokens of that request: ``predictor``
    (any ``predict_step_time(SchedulerOutput)``) asked about the step with the draft views' one-token rows folded
    into their request's row (``1 + drafts`` query tokens over the request's context: its K/V read once, as the
    step runs them, not once per draft)."""

    def __init__(self, predictor: Any) -> None:
        self.predictor = predictor

    def predict_step_time(self, out: SchedulerOutput) -> float:
        if not any(isinstance(s.request_id, tuple) for s in out.scheduled):
            return self.predictor.predict_step_time(out)
        drafts = _per_request({s.request_id: s.num_new_tokens for s in out.scheduled
                               if isinstance(s.request_id, tuple)})
        folded = dataclasses.replace(out, scheduled=[], num_prefill_tokens=0, num_decode_tokens=0, num_prefills=0,
                                     num_decodes=0)
        for s in out.scheduled:
            if not isinstance(s.request_id, tuple):
                folded.add(dataclasses.replace(s, num_new_tokens=s.num_new_tokens + drafts.get(s.request_id, 0)))
        return self.predictor.predict_step_time(folded)


class SarathiScheduler(AsyncScheduler):
    """vLLM's scheduler with sarathi-lite's step decision (see the module docstring). Options come from
    ``additional_config["sarathi_lite"]`` (``sarathi_lite.integrations.vllm.options``). With async scheduling off
    it keeps the books as vLLM's synchronous ``Scheduler`` does (``_update_after_schedule``)."""

    budget: TokenBudget | None = None
    """The ``"auto"`` budget (``None`` with a fixed ``chunk_size``, and for an instance vLLM's tests build without
    ``__init__``, whose ``update_from_output`` then touches no state of the plugin's)."""
    clock: Callable[[], float] = staticmethod(time.perf_counter)
    """The step timer's clock (seconds): what the ``"auto"`` budget measures a step with, from ``schedule`` to
    ``update_from_output``. A simulated engine sets it to its own clock (``simclock``), so the budget learns the
    simulated step times rather than the Python time the simulation took."""
    _log_file = None
    _sync = False
    """Whether async scheduling is off (vLLM's synchronous books are then kept); an ``AsyncScheduler``'s unless set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sync = not self.scheduler_config.async_scheduling
        self.options = check_vllm_config(self.vllm_config, vllm.__version__, self.kv_cache_config.num_blocks)
        if not isinstance(self.waiting, FCFSRequestQueue):  # vLLM's policy check, as the queue it built says
            raise ValueError(f"sarathi_lite's scheduler orders requests itself: use vLLM's scheduling policy "
                             f"'fcfs', not {self.scheduler_config.policy!r}")
        config = self.options.config
        self.budget = TokenBudget(config, DraftsAsDecodeTokens(self.options.cost_model)) \
            if config.auto_budget else None
        self.policy = make_policy(config, self.budget)
        self.step_log: deque[dict[str, Any]] = deque(maxlen=STEP_LOG_LENGTH)
        self._log_file = self.options.step_log.open("a", encoding="utf-8") if self.options.step_log else None
        # a step sized by the "auto" budget, until its output returns: id(output) -> (start, rows, record)
        self._step_started: dict[int, tuple[float, SchedulerOutput, dict[str, Any]]] = {}
        self._known: set[str] = set()  # the requests a step record has named (live ones only)
        logger.info("sarathi_lite scheduler on vLLM %s: %s", vllm.__version__, describe(self.options))

    # ------------------------------------------------------------------ one step

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        started = self.clock()
        length = self.max_model_len
        running = [v for r in self.running for v in _views(r, length)]
        decodes = [v.request_id for v in running if v.is_decode and isinstance(v.request_id, str)]
        if self.options.policy == "vllm_v1":
            output = super().schedule(*args, **kwargs)
            self._record(output, decodes, None, started)
            return output
        waiting = [v for r in self.waiting for v in _views(r, length)]
        drafts = len(running) - len(self.running)  # draft tokens hold no seat
        decision = first_runnable(self.policy.decide(running, waiting, -drafts),
                                  self.kv_cache_manager.block_pool.get_num_free_blocks(), self.block_size)
        self._reorder(decision)
        sched = self.scheduler_config
        threshold, max_tokens = sched.long_prefill_token_threshold, self.max_num_scheduled_tokens
        sched.long_prefill_token_threshold = decision.long_cap or 0
        self.max_num_scheduled_tokens = decision.token_budget
        # a held request is skipped by vLLM's fill loop as one not yet eligible (schedule() counts this step as
        # current_step + 1); it keeps its place in self.running, so it is still the preemption victim it would be
        held_ids = set(decision.held)
        held = [(r, r.next_decode_eligible_step, max(r.next_decode_eligible_step, self.current_step + 2))
                for r in self.running if r.request_id in held_ids]
        for r, _, skip in held:
            r.next_decode_eligible_step = skip
        # the waiting requests the decision does not admit (after _reorder, behind those it does) sit the step out
        planned = set(decision.waiting)
        if decision.whole_prompts:  # vLLM's loop would chunk the next prompt into the budget left
            planned.intersection_update(decision.tokens)
        hidden = []
        while self.waiting and self.waiting[-1].request_id not in planned:
            hidden.append(self.waiting.pop())
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.waiting.extend(reversed(hidden))
            sched.long_prefill_token_threshold = threshold
            self.max_num_scheduled_tokens = max_tokens
            for r, eligible, skip in held:
                if r.next_decode_eligible_step == skip:  # unless vLLM set it since
                    r.next_decode_eligible_step = eligible
        self.policy.stepped(bool(set(output.num_scheduled_tokens) - set(decodes)))
        self._record(output, decodes, decision, started)
        return output

    def _reorder(self, decision: Any) -> None:
        """Put ``self.running`` and ``self.waiting`` in the decision's order (in place: vLLM holds references)."""
        rank = {rid: i for i, rid in enumerate(decision.running)}
        self.running.sort(key=lambda r: rank[r.request_id])
        if len(self.waiting) > 1:  # the decision names the prompts it may admit; the rest keep their order behind
            order = {rid: i for i, rid in enumerate(decision.waiting)}
            queue = sorted(self.waiting, key=lambda r: order.get(r.request_id, len(order)))
            if any(a is not b for a, b in zip(queue, self.waiting)):
                self.waiting.clear()
                self.waiting.extend(queue)

    def _record(self, output: Any, decodes: list[str], decision: Any, started: float) -> None:
        """Append the step's record: what was planned and what vLLM scheduled (``started``: ``clock()`` when
        ``schedule`` began)."""
        scheduled = dict(output.num_scheduled_tokens)
        preempted = sorted(output.preempted_req_ids or ())
        new = {rid: [r.num_prompt_tokens, r.max_tokens] for rid, r in self.requests.items() if rid not in self._known}
        self._known = set(self.requests)
        record = {
            "step": self.current_step,
            "new": new,
            "scheduled": scheduled,
            "decodes": decodes,
            "preempted": preempted,
            "token_budget": decision.token_budget if decision else self.max_num_scheduled_tokens,
            "long_cap": decision.long_cap if decision else None,
            "held": decision.held if decision else [],
            "planned": _per_request(decision.tokens) if decision else None,
            "drafts": {rid: len(tokens) for rid, tokens in (output.scheduled_spec_decode_tokens or {}).items()},
            "predicted": decision.predicted_step_time if decision else None,
            "measured": None,
            "gap": None,
            "time": time.monotonic(),
        }
        if self.budget is not None and decision is not None:  # the "auto" budget's state the step was sized by
            b = self.budget
            record["budget"] = {"target": b.target, "correction": b.correction, "spread": b.spread,
                                "between": b.between}
        self.step_log.append(record)
        if self.budget is not None and scheduled:
            rows = SchedulerOutput()  # the step as the cost model prices it (computed counts advanced already)
            decoding = set(decodes)
            for rid, n in scheduled.items():
                start = self.requests[rid].num_computed_tokens - n
                rows.add(ScheduledRequest(rid, start, n, [], [], True, rid not in decoding))
            self._step_started[id(output)] = (started, rows, record)
        elif self._log_file is not None:
            self._write(record)

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        # vLLM's AsyncScheduler counts each scheduled decode's token as known before it is sampled (a placeholder),
        # so the next step may schedule the decode again; without async scheduling the model runner needs that
        # token as its input, so a second batch in flight (pipeline parallelism) must not: vLLM's own Scheduler
        if self._sync:
            Scheduler._update_after_schedule(self, scheduler_output)
        else:
            super()._update_after_schedule(scheduler_output)

    def _update_request_with_output(self, request: Any, new_token_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        # the placeholders' other side (vLLM 0.32's AsyncScheduler overrides it; later releases fold it into Scheduler)
        if self._sync:
            return Scheduler._update_request_with_output(self, request, new_token_ids, *args, **kwargs)
        return super()._update_request_with_output(request, new_token_ids, *args, **kwargs)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.budget is None:
            return outputs
        now = self.clock()
        started = self._step_started.pop(id(scheduler_output), None)
        if started is not None:  # the step: scheduled, run, and its tokens out
            t0, rows, record = started
            measured = now - t0
            record["measured"] = measured
            if not self.scheduler_config.async_scheduling:  # overlapped steps have no step time of their own
                # the gap since the last step's end: the loop's period, what its decodes waited
                record["gap"] = self.budget.observe_output(rows, measured, now)
            if self._log_file is not None:
                self._write(record)
        return outputs

    def _write(self, record: dict[str, Any]) -> None:
        self._log_file.write(json.dumps(record) + "\n")
        self._log_file.flush()

    def shutdown(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        super().shutdown()

