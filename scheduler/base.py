"""The scheduler core every policy shares: request bookkeeping, block allocation, preemption, update."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Mapping
from operator import attrgetter

from .block_manager import BlockManager
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
    """

    policy = "base"
    chunked = True

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
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
        nothing, if a token is missing.
        """
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
        threshold = self.config.long_prefill_token_threshold
        return threshold if threshold is not None and req.num_prefill_tokens > threshold else req.num_prefill_tokens

    def _is_long(self, req: Request) -> bool:
        threshold = self.config.long_prefill_token_threshold
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
            prefix = bm.match_prefix(req)  # prefix caching: cached blocks it starts from ([] without)
            n = req.num_prefill_tokens - len(prefix) * bm.block_size
            if not self.chunked and n > budget - used:
                break
            need = bm.blocks_for(req.num_prefill_tokens) - len(prefix)
            if not bm.can_allocate(need, cfg.watermark_blocks if self.running else 0, prefix):
                break
            waiting.popleft()
            req.block_ids = bm.allocate(need, prefix)
            if bm.enable_caching:
                self._start_from_prefix(req, len(prefix), out)
            req.status = RUNNING
            running = self.running
            if not running or running[-1].seq < req.seq:
                running.append(req)
            else:
                bisect.insort(running, req, key=_SEQ)
            used += self._schedule_prefill_chunk(req, budget - used, out)
            num_partial += 1
            num_long += is_long
        waiting.extendleft(reversed(held_back))
        return used
