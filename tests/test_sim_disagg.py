"""The colocate-or-disaggregate simulator (``sarathi_lite.sim.disagg``): transfer times and memory on both sides
against hand-computed timelines, routing, goodput, and a property test that plays transfers and checks that no
block being sent is freed or reused before the receiver has it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sarathi_lite.bench.workload import RequestSpec, Workload
from sarathi_lite.costs import CostModel, StepTiming, load_cost_model
from sarathi_lite.scheduler import SchedulerOutput
from sarathi_lite.sim.disagg import LINKS, Deployment, Link, PoolSpec, goodput_from, simulate
from sarathi_lite.sim.simulator import scheduler_config
from sarathi_lite.sim.simulator import simulate as simulate_one

STEP = 0.01  # seconds per step of the constant cost model
BYTES = 1000  # K/V bytes per token
LINK = Link("test", 1e9, 1e-3)  # 1 GB/s, 1 ms per transfer
BLOCK = 16


class ConstantCost(CostModel):
    """Every step takes ``STEP`` seconds, back to back."""

    kv_bytes_per_token = BYTES

    def predict(self, out: SchedulerOutput) -> StepTiming:
        return StepTiming(0.0, STEP)

    def predict_step_time(self, out: SchedulerOutput) -> float:
        return STEP

    def describe(self) -> dict:
        return {"kind": "constant", "model": None, "dtype": None, "device": None, "attention_backend": None}


def workload(*specs: tuple[float, int, int], system: int = 0) -> Workload:
    """Requests ``(arrival, prompt_len, output_len)``; ``system``: a shared prompt prefix of that many tokens."""
    wl = Workload(tuple(RequestSpec(f"r{i}", a, p, o) for i, (a, p, o) in enumerate(specs)))
    return wl.with_system_prompt(system) if system else wl


def deployment(spec: str, *, prefill_blocks: int = 64, decode_blocks: int = 64, caching: bool = False,
               threshold: int | None = None, link: Link = LINK, num_links: int = 1,
               block_size: int = BLOCK) -> Deployment:
    cm = ConstantCost()

    def opts(blocks: int) -> dict:
        return dict(num_kv_blocks=blocks, max_model_len=blocks * block_size, block_size=block_size,
                    enable_prefix_caching=caching, hol_protection=False)

    if spec.endswith("D"):
        p, d = spec[:-1].split("P")
        return Deployment(prefill=PoolSpec("prefill", int(p), cm, options=opts(prefill_blocks)),
                          decode=PoolSpec("decode", int(d), cm, options=opts(decode_blocks)), link=link,
                          threshold=threshold, num_links=num_links)
    return Deployment(colocated=PoolSpec("colocated", int(spec), cm, options=opts(decode_blocks)), link=link)


def transfer_time(tokens: int) -> float:
    return tokens * BYTES / 1e9 + 1e-3


def test_transfers_queue_on_the_link_and_ttft_includes_them():
    held: list[tuple[float, int]] = []
    decode_used: list[tuple[float, int]] = []

    def watch(t, sim):
        held.append((t, sim.instances["prefill"][0].scheduler.kv.num_held_blocks))
        decode_used.append((t, sim.instances["decode"][0].scheduler.kv.pool.num_used_blocks))

    r = simulate(deployment("1P1D"), workload((0.0, 100, 3), (0.0, 100, 3)), observer=watch)
    t1, t2 = r.transfers
    # both prompts prefill in one 10 ms step; the decode side admits both at once; 99 tokens each move
    assert (t1.num_tokens, t2.num_tokens) == (99, 99)
    assert t1.num_bytes == 99 * BYTES
    assert t1.start == pytest.approx(STEP) and t1.end == pytest.approx(STEP + transfer_time(99))
    assert t2.start == pytest.approx(t1.end)  # queued behind the first on the one link
    assert t2.end == pytest.approx(STEP + 2 * transfer_time(99))
    r0, r1 = r.requests
    # r0 runs its last prompt token once its KV is in; r1's KV arrives during that step, so it joins the next
    assert r0.ttft == pytest.approx(t1.end + STEP)
    assert r1.ttft == pytest.approx(t1.end + 2 * STEP)
    assert r0.tbt == pytest.approx([STEP, STEP])
    assert r.summary()["transfer_time_p50"] == pytest.approx(transfer_time(99))
    # the prefill side holds 7 blocks (100 tokens / 16) per request until its transfer ends
    assert max(h for t, h in held if abs(t - STEP) < 1e-12) == 14
    assert [h for t, h in held if abs(t - t1.end) < 1e-12][-1] == 7
    assert [h for t, h in held if abs(t - t2.end) < 1e-12][-1] == 0
    # the decode side took 7 blocks each at admission, before any KV arrived
    assert [u for t, u in decode_used if abs(t - STEP) < 1e-12][-1] == 14
    assert held[-1][1] == 0 and decode_used[-1][1] == 0


def test_decode_admission_waits_for_decode_memory_while_prefill_holds_the_blocks():
    held: list[tuple[float, int]] = []
    r = simulate(deployment("1P1D", decode_blocks=8), workload((0.0, 100, 3), (0.0, 100, 3)),
                 observer=lambda t, sim: held.append((t, sim.instances["prefill"][0].scheduler.kv.num_held_blocks)))
    t1, t2 = r.transfers
    r0, r1 = r.requests
    # 8 decode blocks hold one request (7 blocks): the second is admitted when the first finishes
    assert r0.finished_time == pytest.approx(t1.end + 3 * STEP)
    assert t2.queued_at == pytest.approx(r0.finished_time)
    assert t2.start == pytest.approx(r0.finished_time)
    assert t2.kv_wait == pytest.approx(r0.finished_time + transfer_time(99) - STEP)
    assert r1.ttft == pytest.approx(t2.end + STEP)
    # its 7 blocks stay held on the prefill side all that time
    assert all(h == 7 for t, h in held if t1.end <= t < t2.end)
    assert held[-1][1] == 0


def test_several_links_carry_transfers_side_by_side():
    r = simulate(deployment("1P1D", num_links=2), workload((0.0, 100, 3), (0.0, 100, 3)))
    t1, t2 = r.transfers
    assert t1.start == t2.start == pytest.approx(STEP)
    assert {t1.lane, t2.lane} == {0, 1}


def test_with_prefix_caching_only_blocks_the_decode_side_lacks_are_sent():
    # a 64-token shared prefix (4 blocks); the second request arrives after the first is done
    r = simulate(deployment("1P1D", caching=True), workload((0.0, 36, 2), (1.0, 36, 2), system=64))
    t1, t2 = r.transfers
    assert t1.num_tokens == 99  # nothing cached on the decode side yet
    assert t2.num_tokens == 99 - 64  # the decode side has the prefix's 4 blocks from the first request
    assert t2.num_bytes == 35 * BYTES
    assert t2.transfer_time == pytest.approx(transfer_time(35))


def test_conditional_prefills_short_prompts_on_the_decode_instance():
    r = simulate(deployment("1P1D", threshold=50), workload((0.0, 40, 3), (0.0, 100, 3)))
    assert r.routes == {"r0": ("decode0",), "r1": ("prefill0", "decode0")}
    assert [t.request_id for t in r.transfers] == ["r1"]
    assert r.requests[0].ttft == pytest.approx(STEP)


def test_router_picks_the_least_loaded_instances():
    r = simulate(deployment("2"), workload((0.0, 100, 3), (0.0, 50, 3), (0.0, 20, 3)))
    # pending prefill tokens: r0 -> colocated0 (0 vs 0, lower index), r1 -> colocated1, r2 -> colocated1 (50 < 100)
    assert r.routes == {"r0": ("colocated0",), "r1": ("colocated1",), "r2": ("colocated1",)}
    r = simulate(deployment("2P2D"), workload((0.0, 100, 3), (0.0, 100, 3), (0.0, 30, 3)))
    # pending prefill tokens: r0 -> prefill0, r1 -> prefill1 (0 < 100), r2 -> prefill0 (a tie: lower index)
    assert [r.routes[f"r{i}"][0] for i in range(3)] == ["prefill0", "prefill1", "prefill0"]
    # all finish in one step; handed over in order r0, r2, r1, each to the decode instance with the fewest
    # blocks in use or wanted: r0 (7 blocks) -> decode0, r2 (2 blocks) -> decode1, r1 -> decode1 (2 < 7)
    assert [r.routes[f"r{i}"][1] for i in range(3)] == ["decode0", "decode1", "decode1"]
    assert r.num_gpus == 4 and r.label == "2P2D"


def test_one_colocated_replica_is_the_single_engine_simulation():
    cm = load_cost_model("roofline:h100:llama3-8b")
    wl = Workload.conversations(num_conversations=12, turns=3, system_prompt=200, qps=4.0)
    options = dict(enable_prefix_caching=True, max_num_seqs=64)
    one = simulate_one(wl, cm, scheduler_config(cm, "sarathi", 256, **options))
    dep = Deployment(colocated=PoolSpec("colocated", 1, cm, "sarathi", 256, options))
    r = simulate(dep, wl)
    times = {m.request_id: (m.first_scheduled_time, m.token_times, m.num_cached_tokens) for m in one.stats.requests}
    assert {m.request_id: (m.first_scheduled_time, m.token_times, m.num_cached_tokens) for m in r.requests} == times
    assert len(r.iterations["colocated0"]) == len(one.stats.iterations)


def test_slo_attainment_and_goodput():
    r = simulate(deployment("1P1D"), workload((0.0, 100, 3), (0.0, 100, 3)))
    ttft0, ttft1 = (m.ttft for m in r.requests)
    assert r.slo_attainment(ttft=ttft0, tbt=STEP * 1.01) == 0.5
    assert r.slo_attainment(ttft=ttft1, tbt=STEP * 1.01) == 1.0
    assert r.slo_attainment(ttft=ttft1, tbt=STEP * 0.99) == 0.0
    assert goodput_from([1, 2, 4], [1.0, 0.95, 0.5]) == pytest.approx(2 + 2 * (0.95 - 0.9) / (0.95 - 0.5))
    assert goodput_from([1, 2, 4], [0.8, 1.0, 1.0]) == 0.0  # the lowest rate fails
    assert goodput_from([1, 2, 4], [1.0, 1.0, 0.9]) == 4.0
    with pytest.raises(ValueError, match="increasing"):
        goodput_from([2, 1], [1.0, 1.0])


def test_bad_deployments_are_refused_by_name():
    cm = ConstantCost()
    with pytest.raises(ValueError, match="'3X'"):
        Deployment.parse("3X", cm)
    with pytest.raises(ValueError, match="bandwidth=0"):
        Link("x", 0, 0.0)
    with pytest.raises(ValueError, match="threshold"):
        Deployment.parse("2", cm, threshold=10)
    with pytest.raises(ValueError, match="count=0"):
        PoolSpec("prefill", 0, cm)
    assert Deployment.parse("2P1D", cm, threshold=64).label == "2P1D/cond64"
    assert LINKS["nvlink"].bandwidth > LINKS["pcie"].bandwidth > LINKS["infiniband"].bandwidth \
        > LINKS["100gbe"].bandwidth


def test_tensor_parallel_instances_count_their_gpus():
    cm = load_cost_model("roofline:4xh100:llama3-70b")
    dep = Deployment.parse("1P1D", cm, link=LINKS["nvlink"])
    assert dep.num_gpus == 8
    assert dep.bytes_per_token() == cm.kv_bytes_per_token  # each rank sends its shard over its own link


@settings(max_examples=60, deadline=None)
@given(data=st.data(), spec=st.sampled_from(["1P1D", "2P1D", "1P2D", "cond"]), caching=st.booleans(),
       slow=st.sampled_from([1e6, 1e8]))
def test_a_block_being_sent_is_never_freed_or_reused_before_the_receiver_has_it(data, spec, caching, slow):
    n = data.draw(st.integers(1, 8))
    reqs = [(data.draw(st.floats(0, 0.05)), data.draw(st.integers(1, 40)), data.draw(st.integers(1, 5)))
            for _ in range(n)]
    reqs.sort()
    system = data.draw(st.sampled_from([0, 8])) if caching else 0
    blocks = data.draw(st.integers(14, 24))  # at least one request of the longest prompt + output (53 tokens)
    dep = deployment("1P1D" if spec == "cond" else spec, prefill_blocks=blocks,
                     decode_blocks=data.draw(st.integers(14, 24)), caching=caching, block_size=4,
                     threshold=20 if spec == "cond" else None, link=Link("slow", slow, 1e-3))
    keys: dict[str, list] = {}
    last: list = []

    def check(t, sim):
        for rid, (source, save, _) in sim.sending.items():
            pool = source.scheduler.kv.pool
            for b in save.block_ids:
                assert pool.ref_count(b) >= 1, f"{rid}: block {b} freed at {t} while being sent"
                assert b not in pool.free_block_ids() and b not in pool.cached_free_block_ids()
            now = [pool.key_of(b) for b in save.block_ids]
            assert keys.setdefault(rid, now) == now, f"{rid}: a block being sent was reused at {t}"
        for rid in list(keys):
            if rid not in sim.sending:
                del keys[rid]
        # no request on the prefill side writes into a block another request's send holds
        for source in sim.instances["prefill"]:
            sending = {b for s, save, _ in sim.sending.values() if s is source for b in save.block_ids}
            for req in source.scheduler.requests.values():
                own = req.block_ids[req.num_computed_tokens // 4:]
                assert not sending & set(own), f"{req.request_id} writes a block being sent at {t}"
        last[:] = [sim]

    r = simulate(dep, workload(*reqs, system=system), observer=check)
    assert all(m.finished_time is not None and m.num_output_tokens == o for m, (_, _, o) in zip(r.requests, reqs))
    assert len(r.transfers) <= n
    for t in r.transfers:
        assert t.sent_at <= t.queued_at <= t.start < t.end
    assert math.isfinite(r.summary()["ttft_p99"])
    for inst in last[0].all:  # both pools whole: nothing used, nothing held
        assert inst.scheduler.kv.pool.num_used_blocks == 0 and inst.scheduler.kv.num_held_blocks == 0


def test_a_prefill_pool_full_of_blocks_being_sent_waits_instead_of_reporting_stuck():
    from sarathi_lite.scheduler import Request, SchedulerConfig, make_scheduler
    from sarathi_lite.sim.disagg import _SendEverything

    sched = make_scheduler(SchedulerConfig(policy="sarathi", chunk_size=64, num_blocks=4, block_size=4,
                                           max_model_len=16), connector=_SendEverything())
    sched.add(Request("a", list(range(15)), 1))
    out = sched.schedule()
    sched.update(out, {"a": 0})
    assert [s.request_id for s in sched.take_kv_saves()] == ["a"] and sched.kv.num_held_blocks == 4
    sched.add(Request("b", list(range(15)), 1))
    out = sched.schedule()
    assert not out.scheduled
    sched.update(out, {})  # its blocks come back when the send ends: not stuck
    sched.finish_kv_send("a")
    assert [s.request_id for s in sched.schedule().scheduled] == ["b"]


def test_decoding_requests_add_no_prefill_load_and_replicas_share_the_traffic():
    # r0 decodes for long on colocated0 (no prefill left: it counts 0, not negative); r1 arrives: both replicas
    # have no pending prefill, so the KV blocks decide: colocated1, which holds none
    r = simulate(deployment("2"), workload((0.0, 20, 50), (0.2, 20, 3)))
    assert r.routes == {"r0": ("colocated0",), "r1": ("colocated1",)}
    from collections import Counter

    cm = load_cost_model("roofline:h100:llama3-8b")
    wl = Workload.from_trace("conversation", num_requests=200, qps=20.0, max_prompt=7000, max_output=1000)
    r = simulate(Deployment.parse("4", cm, options={"enable_prefix_caching": False}), wl)
    counts = Counter(route[0] for route in r.routes.values())
    assert len(counts) == 4 and max(counts.values()) < 2 * min(counts.values())


def test_capacity_is_sarathi_serves_definition_over_the_deployment():
    from sarathi_lite.bench.capacity import SLO
    from sarathi_lite.sim.disagg import deployment_capacity

    wl = workload(*[(0.0, 300, 4)] * 40)
    dep = deployment("1P1D")
    # every decode step takes 10 ms: a P99 TBT bound below that fails at any rate, one above it holds until the
    # median scheduling delay passes its bound
    assert deployment_capacity(dep, wl, SLO(tbt_p99=0.009), qps_low=1, qps_high=100, num_probes=3).capacity is None
    found = deployment_capacity(dep, wl, SLO(tbt_p99=0.011, scheduling_delay_p50=0.05), qps_low=1, qps_high=1000,
                                num_probes=6)
    assert found.capacity is not None and found.failed_above is not None
    assert all(p.passed == (p.scheduling_delay_p50 <= 0.05) for p in found.probes)


def test_the_simulator_and_the_router_import_without_torch():
    import subprocess
    import sys

    code = ("import sys\nimport sarathi_lite.sim.disagg, sarathi_lite.scheduler.routing\n"
            "assert 'torch' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
