"""Head-of-line protection (``SchedulerConfig.hol_protection``): an admission component a chunked policy consults
when it fills an iteration's prefill budget. Built only on the scheduler's public building blocks."""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

from .config import SchedulerConfig
from .output import SchedulerOutput
from .request import Request

if TYPE_CHECKING:
    from .base import Scheduler


def long_share(config: SchedulerConfig, budget: int, long_remaining: int, step_tokens: int) -> int:
    """The prefill tokens kept for the long prompts mid-prefill in an iteration short prompts fill first:
    ``min(long_chunk, budget // 2, long_remaining)`` (``budget``: the iteration's prefill tokens;
    ``long_remaining``: the prefill tokens they still need), so they progress every iteration while at least half
    of ``budget`` is always the short prompts'. ``long_chunk`` is ``config.long_chunk_for(step_tokens)``, with
    ``step_tokens`` the iteration's whole budget (decodes and prefill): under
    ``chunk_size="auto"`` a quarter of the step, as a fixed chunk size keeps a quarter of its chunk."""
    return min(config.long_chunk_for(step_tokens), budget // 2, long_remaining)


class ShortPromptProtection:
    """Short prompts first, long ones after, in iterations with a short prompt to protect.

    ``needed(prefills)`` says whether an iteration has one (a long prompt, mid-prefill or waiting, beside a short
    one; see the method); ``schedule(prefills, budget, out)`` fills the budget then:

    1. Keep a share of ``budget`` for the long prompts mid-prefill: ``min(long_chunk, budget // 2, what they still
       need)``, so they progress every iteration; at least half is always the short prompts'.
    2. Short prompts mid-prefill, then waiting short prompts in arrival order (passing waiting long ones) fill the
       rest, then waiting long prompts whose whole prefill fits what is left (they finish their prefill in this
       iteration, so they never hold a long slot). Together they hold every partial-prefill slot the long prompts
       do not (at least one).
    3. Long prompts mid-prefill, then waiting long ones (at most ``max(max_num_partial_prefills - 1, 1)`` and
       ``max_long_partial_prefills`` left mid-prefill at once) take everything the short prompts left: the share
       is given back the moment no short prompt needs it, so the budget is filled as without protection. Only an
       explicit ``long_prefill_chunk`` caps them, in an iteration shared with decodes or short prompts, at that
       many tokens (a TBT cap for long-context attention).

    So the oldest waiting short prompt is admitted in this iteration whenever no other short prompt is mid-prefill
    and a seat and KV blocks are free for it: nothing a long prompt holds keeps it out (``HOL_ADMISSION_BOUND``).
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.config = scheduler.config

    def needed(self, prefills: list[Request]) -> bool:
        """Whether protection has anything to do this iteration: a long prompt (mid-prefill or waiting) beside a
        short one, or beside one long only by ``long_prefill_token_threshold`` whose whole prefill fits an
        iteration (mid-prefill or waiting); or any long prompt at all when ``long_prefill_chunk`` caps long
        prompts. Otherwise the iteration is scheduled first come, first served, exactly as without protection."""
        is_long, budget = self.scheduler.is_long, self.config.token_budget
        capped = self.config.long_prefill_chunk is not None
        seen_long = seen_small = False
        for req in chain(prefills, self.scheduler.waiting):
            long = is_long(req)
            small = not long or req.num_prefill_tokens <= budget
            if long and (capped or seen_small) or small and seen_long:
                return True
            seen_long |= long
            seen_small |= small
        return False

    def schedule(self, prefills: list[Request], budget: int, out: SchedulerOutput) -> int:
        """Continue ``prefills`` (mid-prefill, in arrival order) and admit waiting prompts within ``budget``
        tokens, short prompts first (see the class). Returns tokens used."""
        cfg = self.config
        sched = self.scheduler
        is_long = sched.is_long
        longs = [r for r in prefills if is_long(r)]
        shorts = [r for r in prefills if not is_long(r)]
        max_partial = cfg.max_num_partial_prefills or cfg.max_num_seqs
        share = 0
        if longs:
            share = long_share(cfg, budget, sum(r.num_prefill_tokens - r.num_computed_tokens for r in longs),
                               budget + out.num_decode_tokens)
        short_budget = budget - share
        used = sched.schedule_partial_prefills(shorts, short_budget, out)
        short_slots = max(max_partial - len(longs), 1)
        used, slots, short_left = self._admit_lane(short_budget, used, short_slots - len(shorts), out, long=False)
        used, slots, _ = self._admit_lane(short_budget, used, slots, out, long=True, whole=True)
        cap = cfg.long_prefill_chunk
        lane = budget - used if cap is None or out.is_empty else min(budget - used, cap)
        lane_used = sched.schedule_partial_prefills(longs, lane, out)
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
        sched = self.scheduler
        bs = sched.kv.block_size
        is_long = sched.is_long
        waiting = sched.waiting
        admitted: list[Request] = []
        left = False
        for req in waiting:
            if not sched.has_seat():  # no seat for anyone: stop scanning
                left = True
                break
            if is_long(req) is not long:
                continue
            if used >= budget or slots <= 0:
                left = True
                break
            prefix, need, fits = sched.admission_blocks(req)
            if whole and req.num_prefill_tokens - len(prefix) * bs > budget - used:
                continue
            if not fits:
                if whole:
                    continue
                left = True
                break
            admitted.append(req)
            used += sched.start(req, prefix, budget - used, out)
            slots -= 1
        for req in admitted:
            waiting.remove(req)
        return used, slots, left
