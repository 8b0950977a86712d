"""The scheduler host: our requests and KV cache, with the step decided by the policy (``decision``) and applied here.

``Scheduler`` owns request bookkeeping, the batches in flight, preemption, admission with the KV cache manager,
and ``update``; each step it hands its policy views of its requests (our ``Request`` is one) and applies the
``StepDecision`` it gets back exactly as the other hosts (the vLLM plugin, the transformers host) apply it.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping
from operator import attrgetter

from .budget import StepTimePredictor, TokenBudget
from .config import SchedulerConfig
from .decision import RequestView, StepDecision, make_policy
from .kv_cache_manager import KVCacheManager
from .kv_transfer import KVConnectorScheduler, KVLoad, KVSave
from .output import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from .request import Request, RequestStatus

RUNNING = RequestStatus.RUNNING
WAITING_FOR_REMOTE_KV = RequestStatus.WAITING_FOR_REMOTE_KV


class Scheduler:
    """Owns the requests and the KV cache; ``policy`` (``config.policy``, see ``decision``) decides each step.

    Use: ``add`` requests, then repeat ``out = schedule()``, run ``out``, ``update(out, sampled)``. With
    ``max_concurrent_batches`` N, up to N outputs may be outstanding; ``update`` takes them in the order
    ``schedule`` gave them, and a request is in at most one of them (except under ``async_scheduling``, see
    ``SchedulerConfig``). A request's counts advance in ``update``; while its row is in flight it is marked
    (``Request.num_in_flight``) and not shown to the policy, it is never a preemption victim, and aborting it
    frees its blocks at once (safe because batches execute in order: any later batch that reuses them runs after).

    ``waiting`` holds requests without KV blocks in arrival order (preempted ones return to their place);
    ``running`` holds requests with KV blocks in the same order; ``waiting_for_kv`` those whose blocks a KV
    connector is filling. The block tables belong to ``kv`` (a ``KVCacheManager``); ``block_manager`` is its
    pool, for reading counts. ``last_decision`` is the policy's last ``StepDecision``.

    predictor: the step-time model of ``chunk_size="auto"`` (required then, unused otherwise); see ``budget``.
    connector: the scheduler side of a KV connector (``kv_transfer``), or ``None``.
    """

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor | None = None,
                 connector: KVConnectorScheduler | None = None) -> None:
        if config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len=None (not known yet): a scheduler needs the longest "
                             "request, e.g. from EngineConfig.scheduler_config(num_blocks, max_model_len)")
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.block_manager = self.kv.pool
        self.budget = _token_budget(config, predictor)
        self.policy = make_policy(config, self.budget)
        self.last_decision: StepDecision | None = None
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self._next_seq = 0
        # Batches handed out and not yet updated, oldest first, with the requests of their rows (tracked only
        # when several may be in flight: with one, schedule() and update() simply alternate).
        self._track = config.max_concurrent_batches > 1
        self._in_flight: deque[tuple[SchedulerOutput, list[Request]]] = deque()
        self._next_batch_id = 0
        self._outstanding = 0  # untracked: whether a schedule() awaits its update()
        self._loads: dict[str, int] = {}  # KV loads under way: request id -> tokens loading
        self._load_holds: dict[str, int] = {}  # aborted while loading: its blocks held until the load ends
        self._sends: dict[str, int] = {}  # finished requests whose KV is being sent -> hold handle
        self._saves: list[KVSave] = []

    # ------------------------------------------------------------------ requests

    def add(self, request: Request, num_external_tokens: int = 0) -> None:
        """Queue a new request. ``num_external_tokens``: its first prompt tokens whose K/V a KV connector supplies
        (their prefill is skipped; at least the last prompt token is computed here, to sample from). Raises
        ``ValueError`` if it could never be served or the count is out of range."""
        cfg = self.config
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use by an unfinished request")
        n = request.num_tokens
        if n == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) \
                or request.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_tokens={request.max_tokens!r} must be >= 1")
        if n > cfg.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {n} tokens is longer than "
                f"max_model_len={cfg.max_model_len}"
            )
        if isinstance(num_external_tokens, bool) or not isinstance(num_external_tokens, int) \
                or not 0 <= num_external_tokens < n:
            raise ValueError(f"request {request.request_id!r}: num_external_tokens={num_external_tokens!r} must be "
                             f"an int in [0, {n}) (the last prompt token is computed here)")
        # The most K/V it will ever hold: every token but the last sampled one.
        peak = min(n + request.max_tokens, cfg.max_model_len) - 1
        if self.kv.blocks_for(max(peak, n)) > cfg.num_blocks:
            raise ValueError(
                f"request {request.request_id!r}: {n} prompt tokens + max_tokens={request.max_tokens} need "
                f"{self.kv.blocks_for(max(peak, n))} KV blocks of {cfg.block_size} tokens, more than "
                f"the whole pool (num_blocks={cfg.num_blocks})"
            )
        request.seq = self._next_seq
        self._next_seq += 1
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_prefill_tokens = n
        request.num_cached_tokens = request.num_committed_blocks = 0
        request.num_external_tokens = num_external_tokens
        request.block_hashes = []
        self.requests[request.request_id] = request
        self._insert(self.waiting, request)

    def abort(self, request_id: str) -> Request:
        """Remove a request in any state and free its blocks (a request whose KV is loading keeps them held until
        the load ends). Raises ``ValueError`` for an unknown id."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id={request_id!r} is unknown or already finished")
        if req.status is RUNNING:
            self.running.remove(req)
        elif req.status is WAITING_FOR_REMOTE_KV:
            del self.waiting_for_kv[request_id]
            del self._loads[request_id]
            self._load_holds[request_id] = self.kv.hold(req.block_ids)
        else:
            self.waiting.remove(req)
        self._finish(req, "abort")
        return req

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix and zero the hit counters (e.g. between benchmark runs). Blocks that
        running requests hold stay theirs. Returns the number of cached blocks dropped."""
        return self.block_manager.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def num_in_flight(self) -> int:
        """Batches scheduled and not yet updated (tracked when ``max_concurrent_batches`` > 1)."""
        return len(self._in_flight)

    def can_schedule(self) -> bool:
        """Whether ``schedule()`` may hand out another batch now (fewer than ``max_concurrent_batches`` out)."""
        if not self._track:
            return not self._outstanding
        return len(self._in_flight) < self.config.max_concurrent_batches

    # ------------------------------------------------------------------ one iteration

    def schedule(self) -> SchedulerOutput:
        """The next batch (possibly empty). Raises ``RuntimeError`` when ``max_concurrent_batches`` are out."""
        if not self._track:
            out = SchedulerOutput()
            self.compose(out)
            self._outstanding = 1
            return out
        if len(self._in_flight) >= self.config.max_concurrent_batches:
            raise RuntimeError(f"{len(self._in_flight)} batches are in flight (max_concurrent_batches="
                               f"{self.config.max_concurrent_batches}): update() the oldest first")
        out = SchedulerOutput(batch_id=self._next_batch_id)
        self._next_batch_id += 1
        self.compose(out)
        if not self._in_flight and self._stuck(out):
            raise RuntimeError("the scheduler admitted nothing although requests wait and none run")
        reqs = self.requests
        rows = [reqs[s.request_id] for s in out.scheduled]
        for s, req in zip(out.scheduled, rows):
            req.num_in_flight += 1
            req.num_scheduled_tokens += s.num_new_tokens
            req.num_pending_samples += s.sample
        self._in_flight.append((out, rows))
        return out

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[Request]:
        """Apply a finished iteration: advance computed counts, append sampled tokens, finish requests.

        sampled: the token id sampled for every scheduled request with ``sample=True``.
        Returns the requests that finished (``finish_reason`` is ``"stop"`` or ``"length"``); their blocks are
        free again. Requests aborted since ``schedule()`` are skipped. Raises ``ValueError``, having changed
        nothing, if a token is missing or ``output`` is not the oldest batch in flight, and ``RuntimeError`` if
        ``output`` is empty although requests wait and nothing runs or loads (the policy can make no progress: a
        bug, reported instead of a driver looping forever; with several batches in flight ``schedule()`` raises
        it, when no other batch is out).
        """
        requests = self.requests
        scheduled = output.scheduled
        if self._track:
            if not self._in_flight or self._in_flight[0][0] is not output:
                raise ValueError(f"update() of batch {output.batch_id}, but the oldest batch in flight is "
                                 f"{self._in_flight[0][0].batch_id if self._in_flight else None}: update in order")
            rows = self._in_flight[0][1]
            # the rows of requests still live: not aborted or finished since (nor replaced under the same id)
            scheduled = [s for s, req in zip(scheduled, rows) if requests.get(s.request_id) is req]
        elif self._stuck(output):
            raise RuntimeError("the scheduler admitted nothing although requests wait and none run")
        for s in scheduled:  # check first, so a bad call leaves the state as it was
            if s.sample and sampled.get(s.request_id) is None:
                req = requests.get(s.request_id)
                if req is not None and req.status is RUNNING:
                    raise ValueError(
                        f"no sampled token given for request {s.request_id!r}, which sampled this step")
        if self._track:
            self._in_flight.popleft()
            for s, req in zip(output.scheduled, rows):
                req.num_in_flight -= 1
                req.num_scheduled_tokens -= s.num_new_tokens
                req.num_pending_samples -= s.sample
        self._outstanding = 0
        finished: list[Request] = []
        max_len = self.config.max_model_len
        caching, bs = self.kv.enable_caching, self.kv.block_size
        for s in scheduled:
            req = requests.get(s.request_id)
            if req is None or req.status is not RUNNING:
                continue
            req.num_computed_tokens += s.num_new_tokens
            if caching and req.num_computed_tokens >= (req.num_committed_blocks + 1) * bs:
                self.kv.commit(req)  # its newly filled blocks are shareable from the next schedule() on
            if not s.sample:
                continue
            token = sampled[s.request_id]
            outputs = req.output_token_ids
            outputs.append(token)
            if token in req.stop_token_ids:
                reason = "stop"
            elif len(outputs) >= req.max_tokens or len(req.prompt_token_ids) + len(outputs) >= max_len:
                reason = "length"
            else:
                continue
            self._finish(req, reason)
            finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.status is RUNNING]
        return finished

    def discard(self, output: SchedulerOutput) -> None:
        """Forget a batch that failed to run (its requests' counts stay as they were; the caller aborts or retries
        them): its KV loads end as failed, and it stops being in flight. A batch already updated is left alone."""
        for load in output.kv_loads:
            if load.request_id in self._loads or load.request_id in self._load_holds:
                self.finish_kv_load(load.request_id, ok=False)
        if not self._track:
            self._outstanding = 0
        elif self._in_flight and self._in_flight[0][0] is output:
            _, rows = self._in_flight.popleft()
            for s, req in zip(output.scheduled, rows):
                req.num_in_flight -= 1
                req.num_scheduled_tokens -= s.num_new_tokens
                req.num_pending_samples -= s.sample

    # ------------------------------------------------------------------ KV from elsewhere

    def finish_kv_load(self, request_id: str, ok: bool = True) -> bool:
        """The connector has written (``ok``) or failed to write the K/V of a ``KVLoad``: the request runs from the
        end of the loaded tokens, or, after a failure, from its local prefix (recomputing the rest). Returns
        whether the request still waited for it (``False``: it was aborted meanwhile; its blocks are released)."""
        hold = self._load_holds.pop(request_id, None)
        if hold is not None:
            self.kv.release(hold)
            return False
        req = self.waiting_for_kv.pop(request_id, None)
        if req is None:
            raise ValueError(f"request_id={request_id!r} is not waiting for a KV load")
        num_tokens = self._loads.pop(request_id)
        if ok:
            req.num_computed_tokens += num_tokens
            self.kv.commit(req)
        req.status = RUNNING
        self._insert(self.running, req)
        return True

    def take_kv_saves(self) -> list[KVSave]:
        """The finished requests whose K/V the connector sends, since the last call; their blocks stay held until
        ``finish_kv_send``."""
        saves, self._saves = self._saves, []
        return saves

    def finish_kv_send(self, request_id: str) -> None:
        """The receiver has the K/V of a ``KVSave``: release its blocks."""
        self.kv.release(self._sends.pop(request_id))

    # ------------------------------------------------------------------ the token budget (chunk_size="auto")

    def observe(self, output: SchedulerOutput, step_time: float, end: float | None = None) -> None:
        """Feed the measured ``step_time`` (seconds, the iteration's start to end) of the iteration ``output``,
        and its ``end`` (seconds on the caller's clock, from which the budget takes its decodes' time since the
        previous iteration's end; ``None``: not known) to the ``chunk_size="auto"`` budget; nothing to do with a
        fixed chunk size."""
        if self.budget is not None:
            self.budget.observe_output(output, step_time, end)

    # ------------------------------------------------------------------ applying the decision

    def compose(self, out: SchedulerOutput) -> None:
        """Fill ``out``: the policy decides the step from views of the requests (``decision``), and the step is applied
        with the KV cache (``apply``); where it holds nothing, the decision's fallback is applied instead."""
        running, others = self._candidates()
        decision = self.policy.decide(running, self.waiting, others)
        self.last_decision = decision
        while decision is not None and not out.scheduled:
            self.apply(decision, out)
            decision = decision.fallback
        self.policy.stepped(out.num_prefills > 0)

    def apply(self, decision: StepDecision, out: SchedulerOutput) -> None:
        """Apply ``decision`` as every host does (``decision`` module docstring): running requests in its order,
        each ``min(tokens it needs, long_cap, budget left)``, a decode short of a block preempting the last request
        of that order (itself, if it is the last: the fill stops there); then, unless this step preempted a request
        that still left others running, waiting requests in the decision's order while seats, blocks and budget
        last. Blocks for a prompt's whole prefill are taken at its admission, so only decodes need blocks later."""
        reqs = self.requests
        kv, pool, bs = self.kv, self.block_manager, self.config.block_size
        left = decision.token_budget
        cap = decision.long_cap or left
        held = set(decision.held) if decision.held else ()
        track = self._track  # batches in flight: requests in flight are passed over, or continued (async)
        # the running requests in the decision's order: the views themselves where the policy kept them (our
        # requests, or a continuation's RequestView), else looked up by id
        ids = decision.running
        order = decision.views if len(decision.views) == len(ids) else [reqs[rid] for rid in ids]
        if track:
            order = [reqs[v.request_id] if v.__class__ is RequestView else v for v in order]
        decode_cap = self._decode_cap() if track else math.inf
        add_row = out.scheduled.append  # decode rows; their counts are added once, after the loop
        num_decodes = 0
        # victims are taken from the end of ``order`` (``tail``); without batches in flight they form its suffix,
        # which the loop stops before (``end``), else they are skipped by their status
        end = len(order)
        tail = end - 1
        i = 0
        while i < end and left > 0:
            req = order[i]
            i += 1
            if held and req.request_id in held:
                continue
            computed = req.num_computed_tokens
            token = PLACEHOLDER_TOKEN
            if track and (req.status is not RUNNING or req.num_in_flight):
                if req.status is not RUNNING:
                    continue
                computed = self._continuation(req)
                if computed < 0:
                    continue
            elif computed < req.num_prefill_tokens:
                left -= self._chunk(req, min(left, cap), out)
                continue
            else:
                if num_decodes >= decode_cap:
                    continue  # the next micro-batch's share
                token = req.output_token_ids[-1]
            blocks = req.block_ids
            if computed == len(blocks) * bs:
                while not pool.num_free_blocks:
                    while tail >= i - 1 and (order[tail].status is not RUNNING or track and order[tail].num_in_flight):
                        tail -= 1  # a request in flight is never a victim (nor is this one, if it is)
                    if tail < i - 1:
                        break
                    self.preempt(order[tail], out)
                    if not track:
                        end = tail
                    tail -= 1
                if req.status is not RUNNING:
                    break  # it preempted itself: the fill stops, as vLLM's does
                if not pool.num_free_blocks:
                    continue  # in flight: it waits for the batch that holds it
                kv.allocate_one(req)
            add_row(ScheduledRequest(req.request_id, computed, 1, [token], blocks[:] if track else blocks, True,
                                     False))
            left -= 1
            num_decodes += 1
        out.num_decode_tokens += num_decodes
        out.num_decodes += num_decodes
        if out.preempted_ids and self.running:
            return  # no admission in a step that had to preempt, while others still run
        self._admit(decision, left, cap, out)

    def _admit(self, decision: StepDecision, left: int, cap: int, out: SchedulerOutput) -> None:
        """Admit ``decision.waiting`` in order while seats, blocks and ``left`` tokens last (see ``apply``)."""
        if not decision.waiting or left <= 0:
            return
        reqs, bs = self.requests, self.kv.block_size
        seats = self.config.max_running - len(self.running) - len(self.waiting_for_kv)
        admitted: list[Request] = []
        for rid in decision.waiting:
            if left <= 0 or seats <= 0:
                break
            req = reqs.get(rid)
            if req is None or req.status is not RequestStatus.WAITING:
                continue
            prefix, _, fits = self.admission_blocks(req)
            if not fits or decision.whole_prompts and req.num_prefill_tokens - len(prefix) * bs > left:
                break
            admitted.append(req)
            left -= self.start(req, prefix, min(left, cap), out)
            seats -= 1
        waiting = self.waiting
        for req in admitted:
            if waiting[0] is req:
                waiting.popleft()
            else:
                waiting.remove(req)

    def _candidates(self) -> tuple[list[Request | RequestView], int]:
        """The running requests a step may schedule, as views, and how many others hold a seat: those in flight
        (but for a decode async scheduling may continue, seen at its in-flight count) and those loading KV."""
        if not self._track:
            return self.running, len(self.waiting_for_kv)
        candidates: list[Request | RequestView] = []
        others = len(self.waiting_for_kv)
        for req in self.running:
            if not req.num_in_flight:
                candidates.append(req)
                continue
            computed = self._continuation(req)
            if computed < 0:
                others += 1
            else:
                candidates.append(RequestView(req.request_id, computed, computed + 1, req.num_prompt_tokens, req.seq))
        return candidates, others

    def _decode_cap(self) -> int | float:
        """Most decodes one batch may take (``balance_micro_batches``): ``ceil(D / P)`` of the D running requests
        past their prompt (in flight or not) with P = ``max_concurrent_batches`` (> 1: only batches in flight
        call this); unbounded without it."""
        config = self.config
        if not config.balance_micro_batches or config.async_scheduling:
            return math.inf
        decoding = sum(1 for r in self.running if r.num_computed_tokens + r.num_scheduled_tokens
                       >= r.num_prefill_tokens)
        return -(-decoding // config.max_concurrent_batches)

    def _continuation(self, req: Request) -> int:
        """Under ``async_scheduling``: where ``req``'s next decode starts if it may be scheduled although a row of
        it is in flight (that row samples, and the token it samples cannot end ``req`` by length); else -1."""
        if not self.config.async_scheduling or req.num_in_flight != 1 or req.num_pending_samples != 1:
            return -1
        outputs = len(req.output_token_ids) + 1
        if outputs >= req.max_tokens or len(req.prompt_token_ids) + outputs >= self.config.max_model_len:
            return -1
        return req.num_computed_tokens + req.num_scheduled_tokens

    def preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Preempt by recompute: free all blocks; the request waits at its place to redo its tokens."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = req.num_committed_blocks = 0
        req.num_prefill_tokens = req.num_tokens
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self._insert(self.waiting, req)
        out.preempted_ids.append(req.request_id)

    def _chunk(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedule the next chunk of ``req``'s prefill, at most ``budget`` tokens; returns its length."""
        start = req.num_computed_tokens
        n = min(req.num_prefill_tokens - start, budget)
        end = start + n
        out.add(ScheduledRequest(
            req.request_id, start, n, req.token_ids(start, end),
            req.block_ids[:self.kv.blocks_for(end)], end == req.num_tokens, True))
        return n

    def admission_blocks(self, req: Request) -> tuple[list[int], int, bool]:
        """What admitting ``req`` takes from the pool: the cached prefix blocks it starts from (``[]`` without
        prefix caching), the new blocks its whole prefill needs beyond them, and whether the pool can give both
        now (keeping the watermark free while others run)."""
        kv = self.kv
        prefix = kv.get_computed_blocks(req)
        need = kv.num_new_blocks(req, req.num_prefill_tokens, prefix)
        reserve = self.config.watermark_blocks if self.running else 0
        return prefix, need, kv.can_allocate(need, reserve, prefix)

    def start(self, req: Request, prefix: list[int], budget: int, out: SchedulerOutput) -> int:
        """Admit ``req`` (still in ``waiting``; the caller removes it): its block table (the cached ``prefix``
        blocks, then new ones for the whole prefill), and its first chunk within ``budget``; returns the chunk's
        length. A request with external tokens the prefix does not cover waits for their K/V instead
        (``WAITING_FOR_REMOTE_KV``, a ``KVLoad`` in ``out``; 0 tokens used)."""
        kv = self.kv
        hit = len(prefix) * kv.block_size
        kv.allocate_slots(req, req.num_prefill_tokens - hit, computed_blocks=prefix)
        if kv.enable_caching:
            self._start_from_prefix(req, len(prefix), out)
        external = req.num_external_tokens - hit
        if external > 0 and not req.num_preemptions:
            if self.connector is not None:
                external = min(external, self.connector.get_num_new_matched_tokens(req, hit))
            if external > 0:
                first, last = len(prefix), kv.blocks_for(hit + external)
                req.status = WAITING_FOR_REMOTE_KV
                self.waiting_for_kv[req.request_id] = req
                self._loads[req.request_id] = external
                out.kv_loads.append(KVLoad(req.request_id, req.block_ids[first:last], hit, external))
                return 0
        req.status = RUNNING
        self._insert(self.running, req)
        return self._chunk(req, budget, out)

    # ------------------------------------------------------------------ internals

    def _insert(self, queue: deque[Request] | list[Request], req: Request) -> None:
        """Put ``req`` into ``queue`` (``waiting`` or ``running``) at its arrival place."""
        seq = req.seq
        if not queue or queue[-1].seq < seq:
            queue.append(req)
        else:
            queue.insert(bisect.bisect_left(queue, seq, key=_seq), req)

    def _stuck(self, out: SchedulerOutput) -> bool:
        """Whether ``out`` is empty although requests wait and nothing runs, loads or is being sent (no batch in
        flight). Blocks held for a send or an aborted load come back when it ends, so waiting for them is not
        stuck."""
        return not out.scheduled and not out.kv_loads and bool(self.waiting) and not self.running \
            and not self.waiting_for_kv and not self._sends and not self._load_holds

    def _finish(self, req: Request, reason: str) -> None:
        if reason != "abort" and self.connector is not None and self.connector.request_finished(req):
            self._sends[req.request_id] = self.kv.hold(req.block_ids)
            self._saves.append(KVSave(req.request_id, list(req.block_ids), req.num_computed_tokens,
                                      req.token_ids(0, req.num_computed_tokens)))
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]

    def _start_from_prefix(self, req: Request, num_prefix_blocks: int, out: SchedulerOutput) -> None:
        """Prefix caching: an admitted request's first ``num_prefix_blocks`` blocks are cached, so its prefill
        starts after them; count the hit for the request (first admission), the iteration and the pool."""
        hit = num_prefix_blocks * self.kv.block_size
        req.num_computed_tokens = hit
        req.num_committed_blocks = num_prefix_blocks
        if not req.num_preemptions:
            req.num_cached_tokens = hit
        out.num_cached_tokens += hit
        self.block_manager.record_admission(req.num_prefill_tokens, hit)


_seq = attrgetter("seq")


def _token_budget(config: SchedulerConfig, predictor: StepTimePredictor | None) -> TokenBudget | None:
    if not config.auto_budget:
        return None
    if predictor is None:
        raise ValueError("chunk_size='auto' needs a step-time predictor (a cost model) to choose each budget")
    return TokenBudget(config, predictor)


def make_scheduler(config: SchedulerConfig | None = None, predictor: StepTimePredictor | None = None,
                   connector: KVConnectorScheduler | None = None) -> Scheduler:
    """A scheduler deciding by ``config.policy`` (default: ``SchedulerConfig()``, the ``sarathi`` policy).

    predictor: the step-time model ``chunk_size="auto"`` needs (see ``sarathi_lite.scheduler.budget``).
    connector: the scheduler side of a KV connector (``sarathi_lite.scheduler.kv_transfer``), or ``None``."""
    return Scheduler(config or SchedulerConfig(), predictor, connector)
