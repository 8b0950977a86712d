"""Colocated or disaggregated serving, simulated: pools of instances running the real scheduler, with KV transfers.

A *deployment* is either ``N`` colocated replicas (data parallel: every instance prefills and decodes its own
requests, Sarathi-Serve's organization) or ``xPyD``: ``x`` prefill instances and ``y`` decode instances
(Splitwise, DistServe), optionally *conditional*: a prompt of at most ``threshold`` tokens is prefilled on a
decode instance itself and never moves; or ``xPHyDH``, a *hybrid* (TaiChi): ``x`` prefill-heavy and ``y``
decode-heavy colocated instances (the prefill and decode pools, each at its own chunk size), where a request
moves from a prefill-heavy to a decode-heavy instance once prefilled only when ``routing.HybridRule`` says so at
its arrival; the others are served whole where they are prefilled. Each instance has its own cost model (its
tensor-parallel degree is the cost model's) and its own ``Scheduler`` (``sarathi_lite.scheduler``, the classes
the engine runs), so every batch decision is the real one; only the forward pass is a predicted step time.

How a disaggregated request moves (the same steps as the real engine's, ``scheduler.kv_transfer``). The routing
and the hand-over are ``sarathi_lite.scheduler.coordinator``'s, which the real engines drive too: the simulator
feeds it simulated step ends and transfer arrivals.

1. the router sends it to the prefill instance with the fewest pending prefill tokens, as a request with
   ``max_tokens=1``; a prefill instance has a connector that takes every finished request's KV, so when the
   prompt is done its blocks stay *held* (``KVCacheManager.hold``) and a ``KVSave`` comes out;
2. the router adds it to the decode instance with the fewest KV blocks in use or wanted, with
   ``num_external_tokens = prompt_len - 1`` (the last prompt token is computed there, to sample the first token);
   that scheduler admits it when its pool has the blocks (decode admission is bounded by the decode pool), and
   emits a ``KVLoad`` for the tokens past its own prefix-cache hit (with prefix caching only missing blocks move);
3. the transfer of those tokens queues on the link: it starts when the link is free and takes
   ``kv_bytes_per_token * tokens / bandwidth + latency`` seconds (``Link``); the link carries one transfer at a
   time per lane (``num_links`` lanes), so transfers queue behind each other;
4. when it ends, the decode side's ``finish_kv_load`` makes the request run and the prefill side's
   ``finish_kv_send`` frees its blocks. Memory is counted on both sides the whole time.

TTFT is the arrival to the decode instance's first sampled token, so it includes the prefill, the wait for decode
admission, the transfer and one decode-side step; TBT is the gaps between the decode side's tokens.

With tensor parallelism the KV of a request is sharded over the ranks; each rank sends its shard over its own link
(one NIC or NVLink port per GPU), so ``kv_bytes_per_token`` is the per-rank figure of the cost model
(``CostModel.kv_bytes_per_token``) and the rank transfers of one request run side by side.

Clock (as ``sarathi_lite.sim.simulator``): an instance that becomes ready at ``t`` (its step ended, or work reached
it while idle) starts its next step at ``cost_model.start_time(t)``; arrivals at or before that start are seen by
it. With one colocated replica the simulation is exactly ``simulator.simulate``'s.

>>> from sarathi_lite.sim.disagg import Deployment, LINKS, simulate
>>> from sarathi_lite.costs import load_cost_model
>>> cm = load_cost_model("roofline:h100:llama3-8b")
>>> result = simulate(Deployment.parse("1P1D", cm, link=LINKS["infiniband"]), workload)
>>> result.summary()["ttft_p99"], result.slo_attainment(ttft=1.0, tbt=0.05)
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sarathi_lite.bench.capacity import SLO, CapacityResult, search_capacity
from sarathi_lite.bench.workload import RequestSpec, Workload
from sarathi_lite.costs import CostModel
from sarathi_lite.metrics import (
    IterationRecord,
    MetricsRecorder,
    RequestMetrics,
    Stats,
    percentiles,
    slo_arrays,
    slo_shares,
)
from sarathi_lite.scheduler import Request, Scheduler, SchedulerConfig, SchedulerOutput, make_scheduler
from sarathi_lite.scheduler.coordinator import Coordinator, Hold, RequestRecord
from sarathi_lite.scheduler.kv_transfer import KVSave
from sarathi_lite.scheduler.routing import HybridRule, Layout, Load, load_of
from sarathi_lite.sim.simulator import PROMPT_VOCAB, scheduler_config

ROLES = ("colocated", "prefill", "decode")
DEFAULT_ATTAINMENT = 0.9
"""DistServe's goodput: the highest rate at which at least this share of requests meets both SLOs."""


@dataclass(slots=True, frozen=True)
class Link:
    """The interconnect KV transfers cross. bandwidth: bytes/s one sender moves (one direction); latency: seconds
    every transfer adds however small (setup, handshake, completion)."""

    name: str
    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"link {self.name!r}: bandwidth={self.bandwidth!r} bytes/s must be positive")
        if not self.latency >= 0:
            raise ValueError(f"link {self.name!r}: latency={self.latency!r} s must be >= 0")

    def transfer_time(self, num_bytes: float) -> float:
        """Seconds to move ``num_bytes`` once the link is free: ``num_bytes / bandwidth + latency``."""
        return num_bytes / self.bandwidth + self.latency

    def scaled(self, bandwidth: float) -> Link:
        """The same link at another ``bandwidth`` (bytes/s)."""
        return replace(self, name=f"{bandwidth / 1e9:g} GB/s", bandwidth=bandwidth)


LINKS = {
    "nvlink": Link("NVLink 4", 450e9, 10e-6),
    "pcie": Link("PCIe 5.0 x16", 64e9, 10e-6),
    "infiniband": Link("InfiniBand NDR", 50e9, 20e-6),
    "100gbe": Link("100 GbE", 12.5e9, 50e-6),
}
"""Nominal one-direction bandwidths per GPU (docs/design/disaggregation.md cites them): NVLink 4 on H100 SXM, 900 GB/s
both directions (NVIDIA H100 data sheet); PCIe 5.0 x16, 32 GT/s x 16 lanes = 64 GB/s per direction (PCI-SIG); InfiniBand
NDR, 400 Gb/s per port = 50 GB/s (NVIDIA ConnectX-7, one per GPU in a DGX H100); 100 Gigabit Ethernet, 12.5 GB/s
(IEEE 802.3). The per-transfer latencies are assumptions of the order of a small NCCL/RDMA send, not
measurements."""


class _SendEverything:
    """A scheduler-side connector that supplies nothing and sends every finished request's KV (its blocks held
    until ``finish_kv_send``)."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return 0

    def request_finished(self, request: Request) -> bool:
        return True


class _SendMarked(_SendEverything):
    """The connector of a prefill (or prefill-heavy) instance: it sends the KV of the finished requests added
    prefill only (``marked``) only."""

    def __init__(self) -> None:
        self.marked: set[str] = set()

    def request_finished(self, request: Request) -> bool:
        return request.request_id in self.marked


@dataclass(slots=True)
class PoolSpec:
    """``count`` instances of one role, each on ``cost_model`` (its tensor-parallel degree is the GPUs per
    instance), scheduled by ``policy`` at ``chunk_size`` with further ``SchedulerConfig`` options (as
    ``simulator.scheduler_config``: ``num_kv_blocks``, ``max_num_seqs``, ``enable_prefix_caching``, ...)."""

    role: str
    count: int
    cost_model: CostModel
    policy: str = "sarathi"
    chunk_size: int | str | None = 512
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} is not one of {ROLES}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"{self.role} pool: count={self.count!r} must be a positive integer")

    @property
    def gpus_per_instance(self) -> int:
        return int(getattr(self.cost_model, "tensor_parallel_size", 1))

    def config(self) -> SchedulerConfig:
        return scheduler_config(self.cost_model, self.policy, self.chunk_size, **self.options)


@dataclass(slots=True)
class Deployment:
    """Colocated replicas (``colocated``) or prefill and decode pools (``prefill`` and ``decode``) on ``link``.

    threshold: conditional disaggregation: prompts of at most this many tokens are prefilled on a decode
        instance (``None``: every prompt goes through a prefill instance).
    hybrid: a hybrid deployment's rule (``routing.HybridRule``): the prefill pool is the prefill-heavy instances
        and the decode pool the decode-heavy ones, all serving requests whole unless the rule moves one.
    num_links: lanes of the link: transfers run one per lane, queueing for the first lane free.
    kv_bytes_per_token: bytes per token each sender moves (``None``: the larger of the two cost models'
        per-rank ``kv_bytes_per_token``).
    """

    colocated: PoolSpec | None = None
    prefill: PoolSpec | None = None
    decode: PoolSpec | None = None
    link: Link = LINKS["infiniband"]
    threshold: int | None = None
    num_links: int = 1
    kv_bytes_per_token: float | None = None
    hybrid: HybridRule | None = None

    def __post_init__(self) -> None:
        disagg = self.prefill is not None or self.decode is not None
        if (self.colocated is not None) == disagg or (disagg and (self.prefill is None or self.decode is None)):
            raise ValueError("a deployment is either colocated replicas or a prefill and a decode pool")
        for pool, role in ((self.colocated, "colocated"), (self.prefill, "prefill"), (self.decode, "decode")):
            if pool is not None and pool.role != role:
                raise ValueError(f"the {role} pool has role={pool.role!r}")
        if self.threshold is not None and (self.colocated is not None or self.threshold < 0):
            raise ValueError(f"threshold={self.threshold!r}: conditional disaggregation needs a prefill and a "
                             f"decode pool and a threshold >= 0 (prompt tokens)")
        if self.hybrid is not None and (not disagg or self.threshold is not None):
            raise ValueError("a hybrid deployment is a prefill-heavy and a decode-heavy pool, without a threshold")
        if isinstance(self.num_links, bool) or not isinstance(self.num_links, int) or self.num_links < 1:
            raise ValueError(f"num_links={self.num_links!r} must be a positive integer")
        if disagg and self.bytes_per_token() is None:
            raise ValueError("kv_bytes_per_token is unknown: the cost models give none; pass it")

    @classmethod
    def parse(cls, spec: str, cost_model: CostModel, *, prefill_cost_model: CostModel | None = None,
              decode_cost_model: CostModel | None = None, policy: str = "sarathi", chunk_size: int | str | None = 512,
              prefill_chunk_size: int | str | None = None, threshold: int | None = None, **kwargs: Any) -> Deployment:
        """A deployment from ``"4"`` or ``"4C"`` (colocated replicas), ``"2P1D"`` (2 prefill, 1 decode instances)
        or ``"1PH1DH"`` (a hybrid, ``routing.Layout.parse``) on ``cost_model`` (or the per-role ones).
        ``prefill_chunk_size``: the prefill (prefill-heavy) instances' budget (default ``chunk_size``); decode
        (decode-heavy) instances and replicas use ``chunk_size``. kwargs: ``Deployment`` fields
        (``link``, ``num_links``, ...) and ``options`` for every pool's scheduler config."""
        options = kwargs.pop("options", {})
        layout = Layout.parse(spec, threshold)
        if layout.colocated:
            return cls(colocated=PoolSpec("colocated", layout.colocated, cost_model, policy, chunk_size,
                                          dict(options)), **kwargs)
        return cls(prefill=PoolSpec("prefill", layout.prefill, prefill_cost_model or cost_model, policy,
                                    prefill_chunk_size or chunk_size, dict(options)),
                   decode=PoolSpec("decode", layout.decode, decode_cost_model or cost_model, policy, chunk_size,
                                   dict(options)), threshold=threshold, hybrid=layout.hybrid, **kwargs)

    @property
    def pools(self) -> list[PoolSpec]:
        return [p for p in (self.colocated, self.prefill, self.decode) if p is not None]

    @property
    def num_gpus(self) -> int:
        """GPUs the deployment occupies (instances times their tensor-parallel degree)."""
        return sum(p.count * p.gpus_per_instance for p in self.pools)

    @property
    def layout(self) -> Layout:
        """How many instances of each role, and the conditional threshold."""
        counts = (p.count if p is not None else 0 for p in (self.colocated, self.prefill, self.decode))
        return Layout(*counts, threshold=self.threshold, hybrid=self.hybrid)

    @property
    def label(self) -> str:
        """``Layout.label``: ``"4C"``, ``"2P1D"``, ``"2P1D/cond64"``, ``"1PH1DH"``."""
        return self.layout.label

    def bytes_per_token(self) -> float | None:
        if self.kv_bytes_per_token is not None:
            return self.kv_bytes_per_token
        values = [p.cost_model.kv_bytes_per_token for p in (self.prefill, self.decode)
                  if p is not None and p.cost_model.kv_bytes_per_token is not None]
        return max(values) if values else None


@dataclass(slots=True)
class Transfer:
    """One request's KV transfer: ``num_tokens`` tokens (``num_bytes`` bytes per sender) from prefill instance
    ``source`` to decode instance ``target``. Times (seconds): ``sent_at`` the prefill finished (blocks held from
    then), ``queued_at`` the decode side admitted it, ``start``/``end`` on the link (``end``: both sides done)."""

    request_id: str
    source: int
    target: int
    num_tokens: int
    num_bytes: float
    sent_at: float
    queued_at: float
    start: float
    end: float
    lane: int

    @property
    def transfer_time(self) -> float:
        """Seconds on the link."""
        return self.end - self.start

    @property
    def kv_wait(self) -> float:
        """Seconds from the prefill's end to the KV being on the decode side (admission wait, queue, link)."""
        return self.end - self.sent_at


class SimInstance:
    """One simulated engine (a ``coordinator.Instance``): a ``role``, a scheduler and a cost model; ``busy`` while
    a step runs. ``metrics`` records its iterations into the deployment's request records."""

    __slots__ = ("index", "role", "cost_model", "scheduler", "config", "busy", "pending_start", "out", "start",
                 "timing", "metrics", "name", "requests", "sends")

    def __init__(self, index: int, role: str, pool: PoolSpec, metrics: MetricsRecorder) -> None:
        self.index, self.role, self.cost_model = index, role, pool.cost_model
        self.config = pool.config()
        predictor = pool.cost_model if self.config.auto_budget else None
        self.sends = _SendMarked() if role == "prefill" else None
        self.scheduler: Scheduler = make_scheduler(self.config, predictor, self.sends)
        self.busy = self.pending_start = False
        self.out: SchedulerOutput | None = None
        self.start = 0.0
        self.timing: Any = None
        self.metrics = metrics
        self.name = f"{role}{index}"
        self.requests: set[str] = set()

    def load(self) -> Load:
        return load_of(self.scheduler)

    def add(self, record: RequestRecord, prefill_only: bool, num_external_tokens: int, hold: Hold | None) -> None:
        spec, prompt = record.payload
        if prefill_only:
            self.sends.marked.add(record.request_id)
        self.scheduler.add(Request(record.request_id, prompt, 1 if prefill_only else spec.output_len, frozenset(),
                                   spec.arrival_time), num_external_tokens)

    def release(self, request_id: str, token: Any) -> None:
        self.scheduler.finish_kv_send(request_id)


@dataclass(slots=True)
class DisaggResult:
    """What one simulated run recorded: per-request metrics (``requests``), every instance's iterations
    (``iterations``, by instance label), the KV transfers, and the routing (request id -> instance labels)."""

    label: str
    num_gpus: int
    workload: Workload
    requests: list[RequestMetrics]
    iterations: dict[str, list[IterationRecord]]
    transfers: list[Transfer]
    routes: dict[str, tuple[str, ...]]
    meta: dict[str, Any] = field(default_factory=dict)
    _arrays: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def summary(self) -> dict[str, Any]:
        """``Stats.summary()`` over every request and iteration (TTFT includes the transfer), plus the transfers:
        ``transfer_time_*`` (seconds on the link), ``kv_wait_*`` (prefill end to KV on the decode side),
        ``num_transfers``, ``transferred_bytes``, and ``num_gpus``."""
        out = Stats(self.requests, [it for its in self.iterations.values() for it in its]).summary()
        out.update(percentiles([t.transfer_time for t in self.transfers], "transfer_time"))
        out.update(percentiles([t.kv_wait for t in self.transfers], "kv_wait"))
        out["transfer_time_mean"] = float(np.mean([t.transfer_time for t in self.transfers])) \
            if self.transfers else None
        out["num_transfers"] = len(self.transfers)
        out["transferred_bytes"] = float(sum(t.num_bytes for t in self.transfers))
        out["num_gpus"] = self.num_gpus
        return out

    def per_request(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ttft, tbt_p99)`` per request (seconds; ``inf`` for an unfinished request, TBT 0 for one token)."""
        if self._arrays is None:
            self._arrays = slo_arrays(self.requests)
        return self._arrays

    def slo_attainment(self, ttft: float, tbt: float) -> float:
        """Share of requests meeting both SLOs: TTFT at most ``ttft`` and their own P99 time between tokens at
        most ``tbt`` (seconds)."""
        return slo_shares(*self.per_request(), ttft, tbt)[0]


class _Sim:
    """The event loop of one run (``simulate``)."""

    STEP_END, TRANSFER_END, ARRIVAL, STEP_START = range(4)

    def __init__(self, deployment: Deployment, workload: Workload, observer: Callable[[float, _Sim], None] | None,
                 record_batches: bool) -> None:
        self.d = deployment
        self.workload = workload
        self.observer = observer
        self.metrics: dict[str, RequestMetrics] = {}  # one record per request, filled by every instance's recorder
        self.instances: dict[str, list[SimInstance]] = {role: [] for role in ROLES}
        for pool in deployment.pools:
            self.instances[pool.role] = [
                SimInstance(i, pool.role, pool, MetricsRecorder(record_batches, requests=self.metrics))
                for i in range(pool.count)]
        self.all = [inst for role in ROLES for inst in self.instances[role]]
        self.coordinator = Coordinator(deployment.layout, self.instances)
        caching = any(inst.config.enable_prefix_caching for inst in self.all)
        self.prompts = workload.prompt_token_ids(PROMPT_VOCAB) if caching else None
        self.specs = {s.request_id: s for s in workload.requests}
        self.prompt_of = {s.request_id: (self.prompts[i] if self.prompts else None)
                          for i, s in enumerate(workload.requests)}
        self.routes = self.coordinator.routes
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.lanes = [0.0] * deployment.num_links
        self.bytes_per_token = deployment.bytes_per_token() or 0.0
        self.sending: dict[str, Hold] = self.coordinator.held  # request id -> (prefill instance, KVSave, time)
        self.transfers: list[Transfer] = []
        self.in_transfer: dict[str, Transfer] = {}
        self.now = 0.0
        for pool in deployment.pools:
            pool.cost_model.reset(0)
        for inst in self.all:
            workload.check_fits(inst.config.max_model_len)

    # ------------------------------------------------------------------ events

    def push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.heap, (t, kind, self.seq, payload))
        self.seq += 1

    def run(self) -> None:
        for spec in self.workload.requests:
            self.push(spec.arrival_time, self.ARRIVAL, spec)
        handlers = {self.STEP_END: self.step_end, self.TRANSFER_END: self.transfer_end, self.ARRIVAL: self.arrive,
                    self.STEP_START: self.step_start}
        heap, observer = self.heap, self.observer
        while heap:
            t, kind, _, payload = heapq.heappop(heap)
            self.now = t
            handlers[kind](t, payload)
            if observer is not None:
                observer(t, self)
        stuck = [inst.name for inst in self.all if inst.scheduler.requests]
        if stuck:
            raise RuntimeError(f"the simulation ran out of events with requests unfinished on {', '.join(stuck)} "
                               f"(a pool too small for the traffic it is routed?)")

    def wake(self, inst: SimInstance, t: float) -> None:
        """``inst`` may have work: start a step at ``start_time(t)`` unless one runs or is due."""
        if not inst.busy and not inst.pending_start and inst.scheduler.requests:
            inst.pending_start = True
            self.push(inst.cost_model.start_time(t), self.STEP_START, inst)

    # ------------------------------------------------------------------ routing

    def arrive(self, t: float, spec: RequestSpec) -> None:
        rid = spec.request_id
        prompt = self.prompt_of[rid] or [0] * spec.prompt_len
        self.metrics[rid] = RequestMetrics(rid, spec.arrival_time, spec.prompt_len)
        inst = self.coordinator.arrive(rid, spec.prompt_len, spec.arrival_time, (spec, prompt))
        self.wake(inst, t)

    def hand_over(self, t: float, save: KVSave) -> None:
        """A prefill finished and its blocks are held: the coordinator gives the request to a decode instance."""
        target = self.coordinator.hand_over(save.request_id, save, t)
        if self.specs[save.request_id].prompt_len == 1:  # nothing to move: the decode side computes the one token
            self.release(t, save.request_id)
        self.wake(target, t)

    def release(self, t: float, rid: str) -> None:
        hold = self.coordinator.release(rid)
        self.wake(hold.source, t)

    # ------------------------------------------------------------------ steps

    def step_start(self, t: float, inst: SimInstance) -> None:
        inst.pending_start = False
        sched = inst.scheduler
        if not sched.requests:
            return
        out = sched.schedule()
        for load in out.kv_loads:
            self.start_transfer(t, inst, load.request_id, load.num_tokens)
        if inst.role == "decode" and self.sending:
            for s in out.scheduled:  # its whole prompt hit the decode side's prefix cache: nothing to move
                if s.request_id in self.sending and s.request_id not in self.in_transfer:
                    self.release(t, s.request_id)
        if not out.scheduled:
            sched.update(out, {})
            inst.metrics.record_preemptions(out)  # a request gave up its own blocks in a step that runs nothing
            return  # idle until a transfer ends or work arrives
        inst.busy = True
        inst.out, inst.start = out, t
        inst.timing = inst.cost_model.predict(out)
        self.push(t + inst.timing.step_time, self.STEP_END, inst)

    def step_end(self, t: float, inst: SimInstance) -> None:
        out, sched = inst.out, inst.scheduler
        assert out is not None
        inst.busy, inst.out = False, None
        finished = sched.update(out, {s.request_id: 0 for s in out.scheduled if s.sample})
        sched.observe(out, inst.timing.step_time, t)
        saves = sched.take_kv_saves() if inst.sends is not None else []
        moved = {save.request_id for save in saves}
        whole = [req for req in finished if req.request_id not in moved]  # served whole here, not handed over
        inst.metrics.record_step(out, inst.start, inst.start + inst.timing.schedule_time, t, whole,
                                 prefill_only=inst.sends.marked if inst.sends is not None else ())
        for save in saves:
            inst.sends.marked.discard(save.request_id)
            self.hand_over(t, save)
        for req in whole:
            self.coordinator.finish(req.request_id)
        self.wake(inst, t)

    # ------------------------------------------------------------------ transfers

    def start_transfer(self, t: float, target: SimInstance, rid: str, num_tokens: int) -> None:
        """The decode side admitted ``rid`` and waits for ``num_tokens`` tokens of KV: queue them on the link."""
        source, _, sent_at = self.sending[rid]
        lane = min(range(len(self.lanes)), key=lambda i: (self.lanes[i], i))
        start = max(t, self.lanes[lane])
        num_bytes = self.bytes_per_token * num_tokens
        end = start + self.d.link.transfer_time(num_bytes)
        self.lanes[lane] = end
        tr = Transfer(rid, source.index, target.index, num_tokens, num_bytes, sent_at, t, start, end, lane)
        self.transfers.append(tr)
        self.in_transfer[rid] = tr
        self.push(end, self.TRANSFER_END, tr)

    def transfer_end(self, t: float, tr: Transfer) -> None:
        del self.in_transfer[tr.request_id]
        target = self.coordinator.where(tr.request_id)
        target.scheduler.finish_kv_load(tr.request_id, True)
        self.release(t, tr.request_id)
        self.wake(target, t)


def simulate(deployment: Deployment, workload: Workload, *, record_batches: bool = False,
             observer: Callable[[float, Any], None] | None = None) -> DisaggResult:
    """Serve ``workload`` on ``deployment`` on a simulated clock (seconds from 0); every request produces exactly
    its ``output_len`` tokens. observer: called ``observer(time, sim)`` after every event (tests inspect the
    pools through ``sim.instances``, ``sim.sending``, ``sim.in_transfer``). record_batches: keep every
    iteration's ``(request_id, num_new_tokens)`` rows. Raises ``ValueError`` if a request does not fit an
    instance, ``RuntimeError`` if the run cannot finish."""
    wall = time.perf_counter()
    sim = _Sim(deployment, workload, observer, record_batches)
    sim.run()
    by_order = [sim.metrics[s.request_id] for s in workload.requests]
    meta = {"replay": "simulated", "wall_time": time.perf_counter() - wall, "link": deployment.link.name,
            "bandwidth": deployment.link.bandwidth, "cost_models": {p.role: p.cost_model.describe()
                                                                    for p in deployment.pools}}
    return DisaggResult(deployment.label, deployment.num_gpus, workload, by_order,
                        {inst.name: list(inst.metrics.iterations) for inst in sim.all}, sim.transfers,
                        {rid: tuple(r) for rid, r in sim.routes.items()}, meta)


# ---------------------------------------------------------------------- rates: goodput and capacity

@dataclass(slots=True)
class RateSweep:
    """One deployment's runs at increasing request rates (``rates``, requests/s over the whole deployment)."""

    label: str
    num_gpus: int
    rates: list[float]
    results: list[DisaggResult]

    def attainment(self, ttft: float, tbt: float) -> list[float]:
        """``slo_attainment(ttft, tbt)`` at each rate."""
        return [r.slo_attainment(ttft, tbt) for r in self.results]

    def goodput(self, ttft: float, tbt: float, attainment: float = DEFAULT_ATTAINMENT) -> float:
        """DistServe's goodput per GPU (requests/s/GPU): the highest rate at which at least ``attainment`` of
        the requests meet both SLOs, every lower rate of the sweep meeting it too, divided by ``num_gpus``.
        Between the last rate that meets it and the first that does not, the attainment is interpolated
        linearly; 0 when the lowest rate fails, the top rate when none fails."""
        shares = self.attainment(ttft, tbt)
        return goodput_from(self.rates, shares, attainment) / self.num_gpus


def goodput_from(rates: Sequence[float], shares: Sequence[float], attainment: float = DEFAULT_ATTAINMENT) -> float:
    """The highest rate (of increasing ``rates``) whose share ``shares[i]`` and every lower one's is at least
    ``attainment``, interpolated linearly towards the first rate that falls short; 0 if the first falls short."""
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment={attainment!r} must be in (0, 1]")
    if len(rates) != len(shares) or not rates:
        raise ValueError(f"{len(rates)} rates and {len(shares)} shares: need as many, at least one")
    if any(b <= a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"rates={list(rates)!r} must be increasing")
    for i, share in enumerate(shares):
        if share < attainment:
            if i == 0:
                return 0.0
            lo, hi, s_lo = rates[i - 1], rates[i], shares[i - 1]
            return lo + (hi - lo) * (s_lo - attainment) / (s_lo - share)
    return float(rates[-1])


def rate_sweep(deployment: Deployment, workload: Workload, rates: Sequence[float]) -> RateSweep:
    """Simulate ``workload.at_qps(rate)`` on ``deployment`` at each of ``rates`` (requests/s, increasing)."""
    rates = sorted(rates)
    return RateSweep(deployment.label, deployment.num_gpus, list(rates),
                     [simulate(deployment, workload.at_qps(q)) for q in rates])


def goodput(deployment: Deployment, workload: Workload, ttft: float, tbt: float, *, rates: Sequence[float],
            attainment: float = DEFAULT_ATTAINMENT) -> float:
    """DistServe's goodput per GPU of ``deployment`` (``RateSweep.goodput``) over ``rates``."""
    return rate_sweep(deployment, workload, rates).goodput(ttft, tbt, attainment)


def deployment_capacity(deployment: Deployment, workload: Workload, slo: SLO, *, qps_low: float, qps_high: float,
                        num_probes: int = 8) -> CapacityResult:
    """Sarathi-Serve's capacity of ``deployment`` (requests/s over the whole deployment): the highest rate at
    which P99 TBT (all token gaps pooled) and the median scheduling delay stay within ``slo``
    (``bench.capacity.search_capacity``)."""
    return search_capacity(lambda q: simulate(deployment, workload.at_qps(q)), slo, qps_low, qps_high, num_probes,
                           label=deployment.label)
