"""Property tests: every scheduling policy keeps the scheduler's invariants over random workloads.

A small pure-Python driver plays engine: it adds requests between steps, aborts some (waiting, running, and
between ``schedule()`` and ``update()``), and stands in for the model with a fake one whose sampled token is a
fixed function of the request id and the output index, so stop tokens fire and a preempted request must
reproduce exactly the outputs it would have had without preemption. Before every step the driver asks a
policy of its own for the step, from ``RequestView`` copies of the requests (the one decision, as any host calls
it), and checks that the scheduler decided the same and applied it as a plain greedy host does (``plan.fill``)
wherever the KV pool did not run short. After every step it checks the batch (token budget, stall-freedom, rows
against the requests' tokens and block tables, admission order) and the scheduler's state (block accounting,
queues, limits); at the end, every request's outputs and finish reason
against what the fake model says they must be, and that the KV pool is whole again.

With prefix caching on, prompts share prefixes (a few families of common starts), and the driver also plays
the KV cache: every scheduled row "writes" its token ids into the slots of its block table, so it checks that
no row ever writes into a block that is shared or cached, that every running request's computed positions hold
exactly its tokens (cache hits included), that a cached block holds exactly the tokens its key names (the
SHA-256 chain, recomputed here from the requests' tokens), and that reference counts match the block tables.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sarathi_lite.scheduler import (
    CHUNKED_POLICIES,
    POLICIES,
    Request,
    RequestStatus,
    RequestView,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepDecision,
    fill,
    make_policy,
    make_scheduler,
)

VOCAB = 24  # small, so that stop tokens are sampled now and then

PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def fake_token(request_id: str, index: int) -> int:
    """The fake model: the token sampled as output ``index`` of ``request_id`` (a fixed function of both)."""
    return zlib.crc32(f"{request_id}/{index}".encode()) % VOCAB


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# ---------------------------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_len: int
    max_tokens: int
    stop: frozenset[int]
    arrival_step: int  # added just before this step's schedule()
    family: int = 0  # prompts of one family share their first ``shared_len`` tokens
    shared_len: int = 0

    @property
    def prompt(self) -> list[int]:
        shared = min(self.shared_len, self.prompt_len)
        return ([fake_token(f"family{self.family}", j) for j in range(shared)]
                + [fake_token(f"{self.request_id}/prompt", j) for j in range(shared, self.prompt_len)])

    def request(self) -> Request:
        return Request(self.request_id, self.prompt, self.max_tokens, stop_token_ids=self.stop)

    def expected(self, max_model_len: int) -> tuple[list[int], str]:
        """The outputs and finish reason the fake model must produce, preempted or not."""
        limit = min(self.max_tokens, max(max_model_len - self.prompt_len, 1))
        outputs = []
        for i in range(limit):
            outputs.append(fake_token(self.request_id, i))
            if outputs[-1] in self.stop:
                return outputs, "stop"
        return outputs, "length"


@dataclass(frozen=True)
class AbortSpec:
    step: int
    between: bool  # after this step's schedule(), before its update(); else before its schedule()
    state: str  # "waiting" or "running": the queue the victim is taken from
    index: int  # position in that queue, modulo its length


@dataclass(frozen=True)
class Workload:
    config: SchedulerConfig
    requests: tuple[RequestSpec, ...]
    aborts: tuple[AbortSpec, ...] = ()


@st.composite
def workloads(draw: st.DrawFn, policy: str, prefix_caching: bool = False) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    max_model_len = draw(st.integers(4, 96))
    max_num_seqs = draw(st.integers(1, 8))
    max_prompt_len = draw(st.integers(1, max_model_len))
    last_arrival = draw(st.integers(0, 25))
    specs = []
    for i in range(draw(st.integers(1, 12))):
        specs.append(RequestSpec(
            request_id=f"r{i}",
            prompt_len=draw(st.integers(1, max_prompt_len)),
            max_tokens=draw(st.integers(1, 40)),
            stop=draw(st.frozensets(st.integers(0, VOCAB - 1), max_size=2)),
            arrival_step=draw(st.integers(0, last_arrival)),
            family=draw(st.integers(0, 2)) if prefix_caching else 0,
            shared_len=draw(st.integers(0, max_prompt_len)) if prefix_caching else 0,
        ))
    # Every request must fit the pool alone (else add() rejects it); a pool just that big forces preemption.
    needs = [blocks_for(max(min(s.prompt_len + s.max_tokens, max_model_len) - 1, s.prompt_len), block_size)
             for s in specs]
    num_blocks = draw(st.one_of(st.integers(max(needs), max(needs) + 2),
                                st.integers(max(needs), max(max(needs), sum(needs)) + 1)))
    long_prefill = {}
    if draw(st.booleans()):
        long_prefill = {"long_prefill_token_threshold": draw(st.integers(1, 32))}
    long_prefill["hol_protection"] = draw(st.booleans())
    max_num_batched_tokens = None
    if policy not in CHUNKED_POLICIES:
        max_num_batched_tokens = draw(st.none() | st.integers(max_model_len, 2 * max_model_len + 8))
    config = SchedulerConfig(
        policy=policy,
        chunk_size=draw(st.integers(1, 48)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=num_blocks,
        watermark=draw(st.sampled_from([0.0, 0.01, 0.1, 0.25])),
        enable_prefix_caching=prefix_caching,
        **long_prefill,
    )
    aborts = draw(st.lists(st.builds(AbortSpec, st.integers(0, 40), st.booleans(),
                                     st.sampled_from(["waiting", "running"]), st.integers(0, 7)), max_size=6))
    return Workload(config, tuple(specs), tuple(aborts))


# ---------------------------------------------------------------------------------------------- the driver


@dataclass
class Trace:
    """What a run did, for the tests to assert on beyond the driver's own checks."""

    steps: int = 0
    preemptions: int = 0
    recomputes: int = 0  # recomputes after preemption that reached their sampled token
    aborted: dict[str, str] = field(default_factory=dict)  # request id -> "waiting" / "running" / "between"
    finished: dict[str, Request] = field(default_factory=dict)
    first_scheduled: list[str] = field(default_factory=list)
    cached_tokens: int = 0  # prefill tokens found in the prefix cache at admissions
    computed_prefill_tokens: int = 0  # prefill tokens scheduled (computed)
    hol_checks: int = 0  # steps at which the head-of-line bound was checked (and held)
    greedy_checks: int = 0  # steps whose token counts were checked against the plain greedy fill of the plan


class Driver:
    """Runs one workload through one scheduler, checking the invariants after every step."""

    def __init__(self, workload: Workload, max_steps: int = 20_000) -> None:
        self.workload = workload
        self.config = workload.config
        self.sched: Scheduler = make_scheduler(workload.config)
        self.policy = make_policy(workload.config)  # the decision as another host calls it, on copies
        self.max_steps = max_steps
        self.trace = Trace()
        self.seq: dict[str, int] = {}
        self._seen: set[str] = set()  # requests scheduled at least once
        self._last_had_prefill = False
        # request id -> prompt + outputs at its preemption, and the recomputed tokens scheduled since
        self._recompute: dict[str, tuple[list[int], list[int]]] = {}
        # The stand-in KV cache: the token id each slot of each block holds (None: never written).
        bs = self.config.block_size
        self.kv: list[list[int | None]] = [[None] * bs for _ in range(self.config.num_blocks)]
        self.key_tokens: dict[bytes, list[int]] = {}  # content key -> its block's tokens, from requests' tokens
        self._chains: dict[str, list[bytes]] = {}  # request id -> its chain of block keys so far

    def run(self) -> Trace:
        sched, trace = self.sched, self.trace
        pending = sorted(self.workload.requests, key=lambda s: s.arrival_step)
        aborts = defaultdict(list)
        for a in self.workload.aborts:
            aborts[a.step, a.between].append(a)
        step = 0
        while pending or sched.has_unfinished():
            assert step < self.max_steps, "the scheduler stopped making progress"
            while pending and pending[0].arrival_step <= step:
                spec = pending.pop(0)
                sched.add(spec.request())
                self.seq[spec.request_id] = len(self.seq)
                self._chains[spec.request_id] = []
            for a in aborts[step, False]:
                self._abort(a, a.state)
            self.check_state()
            if sched.has_unfinished():
                self._step(aborts[step, True])
            step += 1
        trace.steps = step
        self.check_end()
        return trace

    def _abort(self, a: AbortSpec, label: str) -> None:
        queue = list(self.sched.waiting if a.state == "waiting" else self.sched.running)
        if not queue:
            return
        victim = queue[a.index % len(queue)]
        req = self.sched.abort(victim.request_id)
        assert req is victim and req.status is RequestStatus.FINISHED and req.finish_reason == "abort"
        assert req.block_ids == [] and req.request_id not in self.sched.requests
        self.trace.aborted[req.request_id] = label
        self._recompute.pop(req.request_id, None)

    def _step(self, between_aborts: list[AbortSpec]) -> None:
        sched = self.sched
        decoding = [r.request_id for r in sched.running if not r.is_prefill]
        mid_prefill = [r.request_id for r in sched.running if r.is_prefill]
        was_running = {r.request_id for r in sched.running}
        protected = self.hol_protected_short()
        views = {r.request_id: RequestView(r.request_id, r.num_computed_tokens, r.num_tokens, r.num_prompt_tokens,
                                           r.seq) for r in (*sched.running, *sched.waiting)}
        plan = self.policy.decide([views[r.request_id] for r in sched.running],
                                  [views[r.request_id] for r in sched.waiting])
        num_running = len(sched.running)
        out = sched.schedule()
        self.policy.stepped(out.num_prefills > 0)
        assert sched.last_decision == plan, "the scheduler decided otherwise than the decision function on its views"
        self.check_greedy(out, plan, views, num_running)
        self.check_output(out, decoding, mid_prefill, was_running)
        self.write_kv(out)
        if protected is not None and not out.preempted_ids:
            assert protected in {s.request_id for s in out.scheduled}, (
                f"short prompt {protected} was kept waiting although it was the oldest short one, no other short "
                f"prompt was mid-prefill and a seat and blocks were free")
            self.trace.hol_checks += 1
        sampled = {s.request_id: fake_token(s.request_id, len(sched.requests[s.request_id].output_token_ids))
                   for s in out.scheduled if s.sample}
        for a in between_aborts:
            self._abort(a, "between")
        live = set(sched.requests)
        finished = sched.update(out, sampled)
        for req in finished:
            assert req.status is RequestStatus.FINISHED and req.finish_reason in ("stop", "length")
            assert req.block_ids == [] and req.request_id not in sched.requests
            self.trace.finished[req.request_id] = req
        assert live - set(sched.requests) == {r.request_id for r in finished}, "a request left without finishing"

    def hol_protected_short(self) -> str | None:
        """Under head-of-line protection, the waiting short prompt that this step must admit, if any: the oldest
        waiting short prompt, while a long prompt is mid-prefill, no other short prompt is, and a seat and KV
        blocks (above the watermark, after the decodes' new blocks) are free for it."""
        cfg, sched = self.config, self.sched
        if not cfg.protects_short_prompts:
            return None
        threshold = cfg.long_threshold
        # long as the decision judges it: above the threshold and needing more than this step's prefill
        step_prefill = cfg.token_budget  # simple_chunking's prefill steps hold no decode
        if cfg.policy != "simple_chunking":
            step_prefill -= sum(1 for r in sched.running if r.is_decode)

        def long(r: Request) -> bool:
            return r.num_prompt_tokens > threshold and r.num_remaining > step_prefill

        mid = [r for r in sched.running if not r.is_decode]
        if not any(long(r) for r in mid) or any(not long(r) for r in mid):
            return None
        short = next((r for r in sched.waiting if not long(r)), None)
        if short is None or len(sched.running) >= cfg.max_running:
            return None
        if cfg.policy == "simple_chunking" and self._last_had_prefill and len(mid) < len(sched.running):
            return None  # a decode-only iteration by that policy's alternation: the bound counts the next one
        bs = cfg.block_size
        decode_blocks = sum(1 for r in sched.running
                            if not r.is_prefill and r.num_computed_tokens == len(r.block_ids) * bs)
        free = sched.block_manager.num_free_blocks - decode_blocks - cfg.watermark_blocks
        return short.request_id if free >= blocks_for(short.num_prefill_tokens, bs) else None

    # ------------------------------------------------------------------------------------------ checks

    def check_greedy(self, out: SchedulerOutput, plan: StepDecision, views: dict[str, RequestView],
                     num_running: int) -> None:
        """The step is the plan applied by a plain greedy host (``plan`` module docstring): of the plan's fallback
        chain, the plan the rows come from; its running requests (less the held ones) each given ``min(need,
        long_cap, budget left)`` in order, then a prefix of its waiting ones the same way (each admission's need
        less its prefix-cache hit), no more than the seats. Checked wherever no request was preempted."""
        got = {s.request_id: s.num_new_tokens for s in out.scheduled}
        if out.preempted_ids or not got:
            return
        chain = [plan]
        while chain[-1].fallback is not None:
            chain.append(chain[-1].fallback)
        step = next(p for p in chain if all(i in p.waiting or i in p.running and i not in p.held for i in got))
        held = set(step.held)
        running = [views[i] for i in step.running if i not in held]
        expected = fill(running, [], step.token_budget, step.long_cap)
        assert {i: n for i, n in got.items() if i not in step.waiting} == expected, \
            f"running rows {got} are not the plan's greedy fill {expected}"
        admitted = [i for i in step.waiting if i in got]
        assert admitted == step.waiting[:len(admitted)], "admissions are not a prefix of the plan's waiting order"
        assert len(admitted) <= max(self.config.max_running - num_running, 0), "admitted more than the seats"
        left = step.token_budget - sum(expected.values())
        for i in admitted:
            want = min(views[i].num_remaining, step.long_cap or left, left)
            assert got[i] == want or self.config.enable_prefix_caching and 0 < got[i] < want, \
                f"{i} admitted with {got[i]} tokens, the greedy fill gives {want}"
            if step.whole_prompts:
                assert got[i] <= left
            left -= got[i]
        self.trace.greedy_checks += 1

    def check_output(self, out: SchedulerOutput, decoding: list[str], mid_prefill: list[str],
                     was_running: set[str]) -> None:
        cfg, sched, trace = self.config, self.sched, self.trace
        rows = out.scheduled
        ids = [s.request_id for s in rows]
        assert rows, "nothing scheduled although requests are unfinished"
        assert len(set(ids)) == len(ids), "a request appears twice in one batch"
        assert len(rows) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
        prefill_rows = [s for s in rows if s.is_prefill]
        decode_rows = [s for s in rows if not s.is_prefill]
        assert out.num_prefills == len(prefill_rows) and out.num_decodes == len(decode_rows)
        assert out.num_prefill_tokens == sum(s.num_new_tokens for s in prefill_rows)
        assert out.num_decode_tokens == len(decode_rows)

        preempted = set(out.preempted_ids)
        assert len(preempted) == len(out.preempted_ids)
        assert preempted <= was_running, "preempted a request that was not running"
        trace.preemptions += len(preempted)
        for rid in preempted:
            req = sched.requests[rid]
            assert req.num_preemptions >= 1
            self._recompute[rid] = (req.prompt_token_ids + req.output_token_ids, [])
            if rid not in ids:
                assert req.status is RequestStatus.WAITING and req.block_ids == [] and req.num_computed_tokens == 0

        threshold = cfg.long_threshold
        chunked = cfg.policy in CHUNKED_POLICIES
        protected = cfg.protects_short_prompts
        first_now: list[str] = []
        for s in rows:
            req = sched.requests[s.request_id]
            tokens = req.prompt_token_ids + req.output_token_ids
            end = s.num_computed_tokens + s.num_new_tokens
            assert req.status is RequestStatus.RUNNING
            assert s.num_new_tokens >= 1
            assert s.num_computed_tokens == req.num_computed_tokens
            assert end <= len(tokens)
            assert s.token_ids == tokens[s.num_computed_tokens:end], "scheduled tokens are not prompt + outputs"
            assert s.sample == (end == len(tokens)), "sample flag disagrees with the end of the known tokens"
            assert len(s.block_table) == blocks_for(end, cfg.block_size), "block table does not cover the tokens"
            assert s.block_table == req.block_ids[:len(s.block_table)]
            if s.is_prefill:
                trace.computed_prefill_tokens += s.num_new_tokens
                assert s.num_computed_tokens < req.num_prefill_tokens and end <= req.num_prefill_tokens
                remaining = req.num_prefill_tokens - s.num_computed_tokens
                long = threshold is not None and req.num_prefill_tokens > threshold
                if chunked:
                    cap = threshold if long and not protected else remaining
                    assert s.num_new_tokens <= cap, "a long prompt's chunk exceeds long_prefill_token_threshold"
                else:
                    assert s.num_computed_tokens == req.num_committed_blocks * cfg.block_size
                    assert s.num_new_tokens == remaining, "an unchunked prompt split"
                if s.request_id in self._recompute:
                    expected, got = self._recompute[s.request_id]
                    if not got:  # a recompute may start at a cached prefix: write_kv checks those slots
                        got.extend(expected[:s.num_computed_tokens])
                    got.extend(s.token_ids)
                    if s.sample:
                        expected, got = self._recompute.pop(s.request_id)
                        assert got == expected, "recompute after preemption ran other tokens than prompt + outputs"
                        trace.recomputes += 1
            else:
                assert s.num_new_tokens == 1 and s.num_computed_tokens >= req.num_prefill_tokens and s.sample
            if s.request_id not in self._seen:
                self._seen.add(s.request_id)
                trace.first_scheduled.append(s.request_id)
                first_now.append(s.request_id)

        # Admission order: with no long-prefill hold-back, requests are first scheduled in arrival order; with
        # it, a request is first scheduled before an earlier arrival only if that one is a long prompt held back.
        if threshold is None:
            seqs = [self.seq[rid] for rid in trace.first_scheduled]
            assert seqs == sorted(seqs), f"admission was not FCFS: first scheduled in order {trace.first_scheduled}"
        elif first_now:
            latest = max(self.seq[rid] for rid in first_now)
            passed = [r for r in sched.waiting if r.request_id not in self._seen and self.seq[r.request_id] < latest]
            assert all(r.num_prefill_tokens > threshold for r in passed), "a short prompt was passed over"

        # Whenever a decode runs, every decode runs (bar those preempted to make room).
        still_decoding = [rid for rid in decoding if rid not in preempted]
        scheduled = set(ids)
        if decode_rows or cfg.policy in ("sarathi", "orca", "request_level"):
            missing = [rid for rid in still_decoding if rid not in scheduled]
            assert not missing, f"decodes {missing} stalled"

        budget = cfg.token_budget
        policy = cfg.policy
        if policy == "sarathi":
            # At most max(budget, decodes) by construction; and as admission is budgeted, decodes never exceed it.
            assert out.num_batched_tokens <= max(budget, out.num_decodes)
            assert out.num_decodes <= budget
            if prefill_rows:
                assert set(still_decoding) <= scheduled, "a decode stalled beside a prefill chunk"
            left_out = [rid for rid in mid_prefill if rid not in scheduled and rid not in preempted]
            if left_out and out.num_batched_tokens < budget:  # only long prompts sit a step out for short ones
                held = sched.last_decision.held
                assert protected and set(left_out) <= set(held), f"prompts {left_out} left out with budget to spare"
                assert all(sched.requests[rid].num_prompt_tokens > threshold for rid in left_out)
        elif policy == "simple_chunking":
            assert out.num_batched_tokens <= budget
            # a prompt's last token is a decode to the decision (it needs exactly one token), so a decode-only
            # step may end a prompt; every other prefill row never shares a step with a decode
            if any(s.num_new_tokens > 1 or not s.sample for s in prefill_rows):
                assert not decode_rows
                assert not (self._last_had_prefill and still_decoding), "two prefill iterations in a row"
        else:
            assert out.num_batched_tokens <= budget
            if policy == "vllm":
                assert not (prefill_rows and decode_rows), "vllm mixed prefill and decode"
            elif policy == "request_level":
                assert not (prefill_rows and was_running - preempted), "request_level admitted while running"
        self._last_had_prefill = bool(prefill_rows)
        trace.cached_tokens += out.num_cached_tokens
        if not cfg.enable_prefix_caching:
            assert out.num_cached_tokens == 0

    def write_kv(self, out: SchedulerOutput) -> None:
        """Play the model: write every row's tokens into its slots, never into a block shared or cached, after
        checking that the context the row attends to (cache hits included) holds the request's tokens."""
        bm, bs, kv = self.sched.block_manager, self.config.block_size, self.kv
        for s in out.scheduled:
            tokens = self.sched.requests[s.request_id].token_ids(0, s.num_computed_tokens)
            table = s.block_table
            assert [kv[table[p // bs]][p % bs] for p in range(s.num_computed_tokens)] == tokens, \
                f"{s.request_id} attends to K/V of other tokens than its own"
            for j, token in enumerate(s.token_ids):
                pos = s.num_computed_tokens + j
                b = table[pos // bs]
                assert bm.ref_count(b) == 1, f"{s.request_id} writes into block {b}, which another request reads"
                assert bm.key_of(b) is None, f"{s.request_id} writes into cached block {b}"
                kv[b][pos % bs] = token

    def _chain(self, req: Request) -> list[bytes]:
        """The content keys of ``req``'s full blocks of known tokens, by the documented SHA-256 chain."""
        bs = self.config.block_size
        chain = self._chains[req.request_id]
        tokens = req.prompt_token_ids + req.output_token_ids
        while len(chain) < len(tokens) // bs:
            i = len(chain)
            block = tokens[i * bs:(i + 1) * bs]
            key = hashlib.sha256((chain[-1] if chain else b"") + struct.pack(f"<{bs}q", *block)).digest()
            chain.append(key)
            self.key_tokens.setdefault(key, block)
        return chain

    def check_pool(self) -> None:
        """Reference counts match the block tables; every block is exactly one of used, free, cached free; a
        cached block holds exactly the tokens its key names."""
        cfg, sched = self.config, self.sched
        bm = sched.block_manager
        free = bm.free_block_ids()
        cached_free = bm.cached_free_block_ids()
        tables = defaultdict(int)
        for r in sched.requests.values():
            for b in r.block_ids:
                tables[b] += 1
        for b in range(cfg.num_blocks):
            assert bm.ref_count(b) == tables.get(b, 0) >= 0, f"block {b}: ref count is not its number of tables"
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(free) & set(tables), "a block is both free and referenced"
        assert len(free) + len(tables) == cfg.num_blocks, "blocks leaked: free + cached free + used != total"
        assert bm.num_free_blocks == len(free) and bm.num_used_blocks == len(tables)
        assert set(cached_free) <= set(free)
        if not cfg.enable_prefix_caching:
            assert not cached_free and not bm.cached_blocks()
            assert all(n == 1 for n in tables.values()), "a block is in two block tables"
        for r in sched.requests.values():
            self._chain(r)
        cached = bm.cached_blocks()
        assert set(cached_free) <= set(cached.values())
        for key, b in cached.items():
            assert bm.key_of(b) == key
            assert key in self.key_tokens, f"block {b} is cached under a key no request's tokens chain to"
            assert self.kv[b] == self.key_tokens[key], f"cached block {b} does not hold its key's tokens"
        for b in set(free) - set(cached_free):
            assert bm.key_of(b) is None
        for r in sched.running:
            chain = self._chain(r)
            for i in range(r.num_computed_tokens // cfg.block_size):
                key = bm.key_of(r.block_ids[i])
                assert key is None or key == chain[i], f"{r.request_id}'s block {i} is cached under another prefix"

    def check_state(self) -> None:
        """The scheduler's state between steps: queues, limits, and the block pool's accounting."""
        cfg, sched = self.config, self.sched
        self.check_pool()

        running_ids = [r.request_id for r in sched.running]
        waiting_ids = [r.request_id for r in sched.waiting]
        assert sorted(running_ids + waiting_ids) == sorted(sched.requests)
        assert len(running_ids) <= cfg.max_num_seqs
        assert [r.seq for r in sched.running] == sorted(r.seq for r in sched.running), "running not in arrival order"
        assert [r.seq for r in sched.waiting] == sorted(r.seq for r in sched.waiting), "waiting not in arrival order"
        for r in sched.waiting:
            assert r.status is RequestStatus.WAITING and r.block_ids == [] and r.num_computed_tokens == 0
            assert r.num_prefill_tokens == r.num_tokens
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING
            assert len(r.block_ids) == blocks_for(max(r.num_computed_tokens, r.num_prefill_tokens), cfg.block_size)
            if not r.is_prefill:
                assert r.num_computed_tokens == r.num_tokens - 1
        if cfg.policy not in CHUNKED_POLICIES:
            assert not any(r.is_prefill for r in sched.running), "an unchunked policy left a prompt half-prefilled"
        for r in sched.requests.values():
            assert len(r.output_token_ids) < r.max_tokens
            assert not r.output_token_ids or r.num_tokens < cfg.max_model_len
            assert not r.output_token_ids or r.output_token_ids[-1] not in r.stop_token_ids

    def check_end(self) -> None:
        sched, trace = self.sched, self.trace
        for spec in self.workload.requests:
            if spec.request_id in trace.aborted:
                assert spec.request_id not in trace.finished
                continue
            req = trace.finished[spec.request_id]
            outputs, reason = spec.expected(self.config.max_model_len)
            assert req.output_token_ids == outputs, f"{spec.request_id} produced the wrong outputs"
            assert req.finish_reason == reason
        assert not sched.waiting and not sched.running and not sched.requests
        assert sorted(sched.block_manager.free_block_ids()) == list(range(self.config.num_blocks)), "pool not whole"
        self.check_pool()
        assert not self._recompute


def run(workload: Workload) -> Trace:
    return Driver(workload).run()


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("policy", POLICIES)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_every_policy_keeps_its_invariants_on_random_workloads(policy: str, data: st.DataObject) -> None:
    workload = data.draw(workloads(policy))
    trace = run(workload)
    event("preemption" if trace.preemptions else "no preemption")
    if workload.config.protects_short_prompts:
        event("head-of-line bound checked" if trace.hol_checks else "head-of-line bound not reached")
    for label in set(trace.aborted.values()):
        event(f"abort {label}")


@pytest.mark.parametrize("policy", POLICIES)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_every_policy_keeps_its_invariants_with_prefix_caching_on_shared_prefixes(
        policy: str, data: st.DataObject) -> None:
    workload = data.draw(workloads(policy, prefix_caching=True))
    trace = run(workload)
    event("cache hits" if trace.cached_tokens else "no cache hit")
    event("preemption" if trace.preemptions else "no preemption")
    for label in set(trace.aborted.values()):
        event(f"abort {label}")


def preemption_workload(policy: str, num_blocks: int) -> Workload:
    """Four requests that outgrow a pool of ``num_blocks`` blocks of 4 tokens when decoding together."""
    config = SchedulerConfig(policy=policy, chunk_size=8, max_num_seqs=4, max_model_len=64, block_size=4,
                             num_blocks=num_blocks, watermark=0.0)
    specs = tuple(RequestSpec(f"r{i}", prompt_len=5 + 3 * i, max_tokens=20, stop=frozenset(), arrival_step=i)
                  for i in range(4))
    return Workload(config, specs)


@pytest.mark.parametrize("policy", POLICIES)
def test_recompute_after_preemption_reruns_prompt_and_outputs_and_preserves_them(policy: str) -> None:
    tight = run(preemption_workload(policy, num_blocks=9))
    ample = run(preemption_workload(policy, num_blocks=64))
    assert tight.preemptions > 0 and tight.recomputes > 0
    assert ample.preemptions == 0
    for rid, req in ample.finished.items():
        assert tight.finished[rid].output_token_ids == req.output_token_ids
        assert len(req.output_token_ids) == 20
    assert sum(r.num_preemptions for r in tight.finished.values()) == tight.preemptions


@pytest.mark.parametrize("policy", POLICIES)
def test_driver_exercises_aborts_in_every_state(policy: str) -> None:
    config = SchedulerConfig(policy=policy, chunk_size=4, max_num_seqs=2, max_model_len=64, block_size=4,
                             num_blocks=32)
    specs = tuple(RequestSpec(f"r{i}", prompt_len=6, max_tokens=10, stop=frozenset(), arrival_step=0)
                  for i in range(6))
    aborts = (AbortSpec(1, False, "waiting", 0), AbortSpec(3, False, "running", 0), AbortSpec(5, True, "running", 0))
    trace = run(Workload(config, specs, aborts))
    assert sorted(trace.aborted.values()) == ["between", "running", "waiting"]
    assert len(trace.finished) == 3
