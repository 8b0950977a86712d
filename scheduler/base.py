"""The scheduler core every policy shares: request bookkeeping, block allocation, preemption, update."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Mapping
from itertools import chain, islice
from operator import attrgetter

from .block_manager import BlockManager
from .budget import StepTimePredictor, TokenBudget
from .config import SchedulerConfig
from .output import ScheduledRequest, SchedulerOutput
from .request import Request, RequestStatus

_SEQ = attrgetter("seq")
RUNNING = RequestStatus.RUNNING


class Scheduler:
    """Owns the requests and the KV block pool; a policy decides what each iteration runs.

    Use: ``add`` requests, then repeat ``out = schedule()``, run ``out``, ``update(out, sampled)``. Every
    request's counts advance only in ``update``, so each ``schedule()`` must be followed by its ``update()``.

    ``waiting`` holds requests without KV blocks in arrival order (preempted ones return to their place at the
    front); ``running`` holds requests with KV blocks, also in arrival order, so the most recently arrived
    running request, the preemption victim, is always ``running[-1]``.

    predictor: the step-time model of ``chunk_size="auto"`` (required then, unused otherwise); see ``budget``.
    """

    policy = "base"
    chunked = True

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor | None = None) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.budget = _token_budget(config, predictor)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._next_seq = 0

    # ------------------------------------------------------------------ requests

    def add(self, request: Request) -> None:
        """Queue a new request. Raises ``ValueError`` if it could never be served."""
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
        # The most K/V it will ever hold: every token but the last sampled one.
        peak = min(n + request.max_tokens, cfg.max_model_len) - 1
        if self.block_manager.blocks_for(max(peak, n)) > cfg.num_blocks:
            raise ValueError(
                f"request {request.request_id!r}: {n} prompt tokens + max_tokens={request.max_tokens} need "
                f"{self.block_manager.blocks_for(max(peak, n))} KV blocks of {cfg.block_size} tokens, more than "
                f"the whole pool (num_blocks={cfg.num_blocks})"
            )
        request.seq = self._next_seq
        self._next_seq += 1
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_prefill_tokens = n
        request.num_cached_tokens = request.num_committed_blocks = 0
        request.block_hashes = []
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request:
        """Remove a request in any state and free its blocks. Raises ``ValueError`` for an unknown id."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id={request_id!r} is unknown or already finished")
        if req.status is RUNNING:
            self.running.remove(req)
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

    # ------------------------------------------------------------------ one iteration

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[Request]:
        """Apply a finished iteration: advance computed counts, append sampled tokens, finish requests.

        sampled: the token id sampled for every scheduled request with ``sample=True``.
        Returns the requests that finished (``finish_reason`` is ``"stop"`` or ``"length"``); their blocks are
        free again. Requests aborted since ``schedule()`` are skipped. Raises ``ValueError``, having changed
        nothing, if a token is missing, and ``RuntimeError`` if ``output`` is empty although requests wait and
        none run (the policy can make no progress: a bug, reported instead of a driver looping forever).
        """
        if not output.scheduled and self.waiting and not self.running:
            raise RuntimeError("the scheduler admitted nothing although requests wait and none run")
        finished: list[Request] = []
        max_len = self.config.max_model_len
        requests = self.requests
        bm = self.block_manager
        caching, bs = bm.enable_caching, bm.block_size
        for s in output.scheduled:  # check before changing anything, so a bad call leaves the state as it was
            if s.sample and sampled.get(s.request_id) is None:
                req = requests.get(s.request_id)
                if req is not None and req.status is RUNNING:
                    raise ValueError(
                        f"no sampled token given for request {s.request_id!r}, which sampled this step")
        for s in output.scheduled:
            req = requests.get(s.request_id)
            if req is None or req.status is not RUNNING:
                continue
            req.num_computed_tokens += s.num_new_tokens
            if caching and req.num_computed_tokens >= (req.num_committed_blocks + 1) * bs:
                bm.commit(req)  # its newly filled blocks are shareable from the next schedule() on
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

    # ------------------------------------------------------------------ the token budget (chunk_size="auto")

    def _prefill_budget(self, out: SchedulerOutput, prefills: list[Request]) -> int:
        """Prefill tokens this iteration may add to ``out`` (its decodes scheduled): ``chunk_size`` less those
        decodes, or with ``chunk_size="auto"`` what ``self.budget`` predicts fits the TBT SLO, for the prompts
        mid-prefill (``prefills``) and then the waiting ones that could be admitted."""
        if self.budget is None:
            return self.config.chunk_size - out.num_decode_tokens
        slots = max(self.config.max_running - len(self.running), 0)
        return self.budget.prefill_tokens(out, [
            (r, min(r.num_prefill_tokens - r.num_computed_tokens, self._prefill_cap(r)))
            for r in (*prefills, *islice(self.waiting, slots))])

    def observe(self, output: SchedulerOutput, step_time: float) -> None:
        """Feed the measured ``step_time`` (seconds, the iteration's start to end) of the iteration ``output`` to
        the ``chunk_size="auto"`` budget's correction; nothing to do with a fixed chunk size."""
        if self.budget is not None:
            self.budget.observe_output(output, step_time)

    # ------------------------------------------------------------------ building blocks for policies

    def _finish(self, req: Request, reason: str) -> None:
        self.block_manager.free(req.block_ids)
        req.block_ids = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Preempt by recompute: free all blocks; the request waits at its arrival place to redo its tokens."""
        self.running.remove(req)
        self.block_manager.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = req.num_committed_blocks = 0
        req.num_prefill_tokens = req.num_tokens
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        waiting = self.waiting
        waiting.insert(bisect.bisect_left(waiting, req.seq, key=_SEQ), req)
        out.preempted_ids.append(req.request_id)

    def _start_from_prefix(self, req: Request, num_prefix_blocks: int, out: SchedulerOutput) -> None:
        """Prefix caching: an admitted request's first ``num_prefix_blocks`` blocks are cached, so its prefill
        starts after them; count the hit for the request (first admission), the iteration and the pool."""
        hit = num_prefix_blocks * self.block_manager.block_size
        req.num_computed_tokens = hit
        req.num_committed_blocks = num_prefix_blocks
        if not req.num_preemptions:
            req.num_cached_tokens = hit
        out.num_cached_tokens += hit
        self.block_manager.record_admission(req.num_prefill_tokens, hit)

    def _schedule_decodes(self, out: SchedulerOutput) -> list[Request]:
        """Give every running decode its one token, preempting from the tail of ``running`` when the pool is
        out of blocks. Returns the running requests that are mid-prefill, in arrival order (not scheduled)."""
        running = self.running
        bm = self.block_manager
        bs = self.config.block_size
        add_row = out.scheduled.append
        prefills: list[Request] = []
        num_decodes = 0
        i = 0
        while i < len(running):
            req = running[i]
            i += 1
            computed = req.num_computed_tokens
            if computed < req.num_prefill_tokens:
                prefills.append(req)
                continue
            blocks = req.block_ids
            if computed == len(blocks) * bs:
                while not bm.num_free_blocks:
                    self._preempt(running[-1], out)
                    if req.status is not RUNNING:
                        break
                if req.status is not RUNNING:
                    break
                blocks.append(bm.allocate_one())
            add_row(ScheduledRequest(req.request_id, computed, 1, [req.output_token_ids[-1]], blocks, True, False))
            num_decodes += 1
        out.num_decode_tokens += num_decodes
        out.num_decodes += num_decodes
        return prefills

    def _prefill_cap(self, req: Request) -> int:
        """Most tokens of ``req``'s prefill one chunk may take: ``long_prefill_token_threshold`` for a long prompt
        without head-of-line protection (with it, long prompts are held to their share by the budget instead)."""
        threshold = self.config.long_prefill_token_threshold
        if threshold is None or self.config.protects_short_prompts or req.num_prefill_tokens <= threshold:
            return req.num_prefill_tokens
        return threshold

    def _is_long(self, req: Request) -> bool:
        threshold = self.config.long_threshold
        return threshold is not None and req.num_prefill_tokens > threshold

    def _schedule_prefill_chunk(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedule the next chunk of ``req``'s prefill within ``budget`` tokens; returns its length."""
        start = req.num_computed_tokens
        n = req.num_prefill_tokens - start
        if self.chunked:
            n = min(n, budget, self._prefill_cap(req))
        end = start + n
        out.add(ScheduledRequest(
            req.request_id, start, n, req.token_ids(start, end),
            req.block_ids[:self.block_manager.blocks_for(end)], end == req.num_tokens, True))
        return n

    def _schedule_partial_prefills(self, prefills: Iterable[Request], budget: int, out: SchedulerOutput) -> int:
        """Continue prompts already mid-prefill, in arrival order, within ``budget``; returns tokens used."""
        used = 0
        for req in prefills:
            if budget - used <= 0:
                break
            used += self._schedule_prefill_chunk(req, budget - used, out)
        return used

    def _start(self, req: Request, prefix: list[int], num_blocks: int, budget: int, out: SchedulerOutput) -> int:
        """Admit ``req`` (just taken off ``waiting``): give it the cached ``prefix`` blocks and ``num_blocks`` new
        ones, make it running (in arrival order) and schedule its first chunk within ``budget``; returns the
        chunk's length."""
        bm = self.block_manager
        req.block_ids = bm.allocate(num_blocks, prefix)
        if bm.enable_caching:
            self._start_from_prefix(req, len(prefix), out)
        req.status = RUNNING
        running = self.running
        if not running or running[-1].seq < req.seq:
            running.append(req)
        else:
            bisect.insort(running, req, key=_SEQ)
        return self._schedule_prefill_chunk(req, budget, out)

    def _admission_blocks(self, req: Request) -> tuple[list[int], int, bool]:
        """What admitting ``req`` takes from the pool: the cached prefix blocks it starts from (``[]`` without
        prefix caching), the new blocks its whole prefill needs beyond them, and whether the pool can give both
        now (keeping the watermark free while others run)."""
        bm = self.block_manager
        prefix = bm.match_prefix(req)
        need = bm.blocks_for(req.num_prefill_tokens) - len(prefix)
        return prefix, need, bm.can_allocate(need, self.config.watermark_blocks if self.running else 0, prefix)

    def _admit(self, budget: int, out: SchedulerOutput, num_partial: int = 0, num_long: int = 0) -> int:
        """Admit waiting requests in arrival order while the budget, ``max_num_seqs``, the partial-prefill
        limits and the block pool allow, and schedule their first chunk (their whole prompt for unchunked
        policies). Blocks for the whole prefill are taken at admission. Returns tokens used."""
        cfg = self.config
        bm = self.block_manager
        max_partial = cfg.max_num_partial_prefills or cfg.max_num_seqs
        waiting = self.waiting
        held_back: list[Request] = []
        used = 0
        max_seqs = cfg.max_running
        while waiting and used < budget and len(self.running) < max_seqs:
            if self.chunked and num_partial >= max_partial:
                break
            req = waiting[0]
            is_long = self._is_long(req)
            if is_long and num_long >= cfg.max_long_partial_prefills:
                held_back.append(waiting.popleft())
                continue
            prefix, need, fits = self._admission_blocks(req)
            if not self.chunked and req.num_prefill_tokens - len(prefix) * bm.block_size > budget - used:
                break
            if not fits:
                break
            waiting.popleft()
            used += self._start(req, prefix, need, budget - used, out)
            num_partial += 1
            num_long += is_long
        waiting.extendleft(reversed(held_back))
        return used

    def _schedule_prefills(self, prefills: list[Request], budget: int, out: SchedulerOutput) -> int:
        """Continue the prompts mid-prefill (``prefills``, in arrival order) and admit waiting ones within
        ``budget`` tokens: first come, first served (the paper's policy), or, with head-of-line protection and a
        short prompt to protect from a long one, short prompts first (``_schedule_prefills_protected``).
        Returns tokens used."""
        protected = self.config.protects_short_prompts
        if protected and self._protection_needed(prefills):
            return self._schedule_prefills_protected(prefills, budget, out)
        used = self._schedule_partial_prefills(prefills, budget, out)
        if budget - used > 0:
            # Protected but with nobody to protect: plain FCFS. Admission happens only once every prompt
            # mid-prefill has finished in this iteration, so no long prompt holds a long slot any more.
            used += self._admit(budget - used, out, num_partial=len(prefills),
                                num_long=0 if protected else sum(map(self._is_long, prefills)))
        return used

    def _protection_needed(self, prefills: list[Request]) -> bool:
        """Whether head-of-line protection has anything to do this iteration: a long prompt (mid-prefill or
        waiting) beside a short one, or beside one long only by ``long_prefill_token_threshold`` whose whole
        prefill fits an iteration (mid-prefill or waiting); or any long prompt at all when ``long_prefill_chunk``
        caps long prompts. Otherwise the iteration is scheduled first come, first served, exactly as without
        protection."""
        is_long, budget = self._is_long, self.config.token_budget
        capped = self.config.long_prefill_chunk is not None
        seen_long = seen_small = False
        for req in chain(prefills, self.waiting):
            long = is_long(req)
            small = not long or req.num_prefill_tokens <= budget
            if long and (capped or seen_small) or small and seen_long:
                return True
            seen_long |= long
            seen_small |= small
        return False

    def _schedule_prefills_protected(self, prefills: list[Request], budget: int, out: SchedulerOutput) -> int:
        """Head-of-line protection (``SchedulerConfig.hol_protection``): short prompts first, long ones after.
        Runs only in iterations with a short prompt to protect (``_protection_needed``).

        1. Keep a share of ``budget`` for the long prompts mid-prefill: ``min(long_chunk, budget // 2, what
           they still need)``, so they progress every iteration; at least half is always the short prompts'.
        2. Short prompts mid-prefill, then waiting short prompts in arrival order (passing waiting long ones)
           fill the rest, then waiting long prompts whose whole prefill fits what is left (they finish their
           prefill in this iteration, so they never hold a long slot). Together they hold every partial-prefill
           slot the long prompts do not (at least one).
        3. Long prompts mid-prefill, then waiting long ones (at most ``max(max_num_partial_prefills - 1, 1)``
           and ``max_long_partial_prefills`` left mid-prefill at once) take everything the short prompts left:
           the share is given back the moment no short prompt needs it, so the budget is filled as without
           protection. Only an explicit ``long_prefill_chunk`` caps them, in an iteration shared with decodes or
           short prompts, at that many tokens (a TBT cap for long-context attention).

        So the oldest waiting short prompt is admitted in this iteration whenever no other short prompt is
        mid-prefill and a seat and KV blocks are free for it: nothing a long prompt holds keeps it out
        (``HOL_ADMISSION_BOUND``). Returns tokens used."""
        cfg = self.config
        is_long = self._is_long
        longs = [r for r in prefills if is_long(r)]
        shorts = [r for r in prefills if not is_long(r)]
        max_partial = cfg.max_num_partial_prefills or cfg.max_num_seqs
        share = 0
        if longs:
            share = min(cfg.long_chunk, budget // 2,
                        sum(r.num_prefill_tokens - r.num_computed_tokens for r in longs))
        short_budget = budget - share
        used = self._schedule_partial_prefills(shorts, short_budget, out)
        short_slots = max(max_partial - len(longs), 1)
        used, slots, short_left = self._admit_lane(short_budget, used, short_slots - len(shorts), out, long=False)
        used, slots, _ = self._admit_lane(short_budget, used, slots, out, long=True, whole=True)
        cap = cfg.long_prefill_chunk
        lane = budget - used if cap is None or out.is_empty else min(budget - used, cap)
        lane_used = self._schedule_partial_prefills(longs, lane, out)
        if not short_left:  # a long prompt never takes a seat or blocks from a short one left waiting
            # Long prompts still mid-prefill after this iteration: none once the lane has room left (each got
            # all it needed), so one finishing now frees its long slot for the next in the same iteration (but
            # still counts against max_num_partial_prefills, a limit on the prompts of one batch).
            held = len(longs) if lane_used >= lane else 0
            long_slots = min(cfg.max_long_partial_prefills - held, max(max_partial - 1, 1) - held,
                             max_partial - len(longs) - (short_slots - slots))
            lane_used, _, _ = self._admit_lane(lane, lane_used, long_slots, out, long=True)
        return used + lane_used

    def _admit_lane(self, budget: int, used: int, slots: int, out: SchedulerOutput, *, long: bool,
                    whole: bool = False) -> tuple[int, int, bool]:
        """Admit waiting prompts of one class (long or short) in arrival order, passing over the other class,
        while ``used`` (tokens) stays below ``budget`` and ``slots`` partial-prefill slots and the seats allow,
        and schedule their first chunk. whole: admit only long prompts whose whole prefill fits the budget left,
        passing over one the pool cannot take (a later, shorter one may fit). Returns ``used`` and ``slots``
        updated, and whether a prompt of the class was left waiting for want of budget, a slot, a seat or
        blocks."""
        cfg = self.config
        bm = self.block_manager
        is_long = self._is_long
        waiting = self.waiting
        max_seqs = cfg.max_running
        admitted: list[Request] = []
        left = False
        for req in waiting:
            if len(self.running) >= max_seqs:  # no seat for anyone: stop scanning
                left = True
                break
            if is_long(req) is not long:
                continue
            if used >= budget or slots <= 0:
                left = True
                break
            prefix, need, fits = self._admission_blocks(req)
            if whole and req.num_prefill_tokens - len(prefix) * bm.block_size > budget - used:
                continue
            if not fits:
                if whole:
                    continue
                left = True
                break
            admitted.append(req)
            used += self._start(req, prefix, need, budget - used, out)
            slots -= 1
        for req in admitted:
            waiting.remove(req)
        return used, slots, left


def _token_budget(config: SchedulerConfig, predictor: StepTimePredictor | None) -> TokenBudget | None:
    if not config.auto_budget:
        return None
    if predictor is None:
        raise ValueError("chunk_size='auto' needs a step-time predictor (a cost model) to choose each budget")
    return TokenBudget(config, predictor)
