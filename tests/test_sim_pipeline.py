"""The simulator on P pipeline stages (``sarathi_lite.sim.simulator``, ``sarathi_lite.costs.pipeline``):
micro-batches of the real scheduler through P stages, with bubble fractions computed by hand for equal and unequal
micro-batches, the in-flight rule, and the roofline's pipelined stages. Torch-free."""

from __future__ import annotations

import dataclasses

import pytest

from sarathi_lite.bench.workload import RequestSpec, Workload
from sarathi_lite.costs import CostModel, ProfiledCostModel, StepTiming
from sarathi_lite.costs.pipeline import PipelineCostModel, head_layer_units
from sarathi_lite.costs.roofline import roofline
from sarathi_lite.metrics import IterationRecord, bubble_accounting
from sarathi_lite.models.stages import stage_layers
from sarathi_lite.scheduler import SchedulerConfig, SchedulerOutput
from sarathi_lite.sim.simulator import scheduler_config, simulate

ONE_SECOND = ProfiledCostModel((1, 2), (1.0, 1.0))  # every step takes 1 s on the whole model


def workload(*rows: tuple[str, float, int, int]) -> Workload:
    return Workload(tuple(RequestSpec(*row) for row in rows))


def config(depth: int, chunk_size: int = 8) -> SchedulerConfig:
    return SchedulerConfig(policy="sarathi", chunk_size=chunk_size, block_size=4, num_blocks=256, max_model_len=256,
                           max_concurrent_batches=depth)


class Alternating(CostModel):
    """Two stages; micro-batches with an even ``batch_id`` take ``long`` seconds a stage, odd ones ``short``."""

    pipeline_parallel_size = 2

    def __init__(self, long: float, short: float, send: float = 0.0) -> None:
        self.long, self.short, self.send = long, short, send

    def predict_stage_times(self, out: SchedulerOutput) -> list[float]:
        return [self.long if out.batch_id % 2 == 0 else self.short] * 2

    def send_time(self, out: SchedulerOutput) -> float:
        return self.send

    def predict(self, out: SchedulerOutput) -> StepTiming:
        return StepTiming(0.0, sum(self.predict_stage_times(out)) + self.send)

    def describe(self) -> dict:
        return {"kind": "test", "model": None, "dtype": None, "device": None, "attention_backend": None}


def test_layers_split_into_contiguous_stages_the_first_ones_taking_the_remainder():
    assert [list(stage_layers(30, 4, s)) for s in range(4)] == [list(range(0, 8)), list(range(8, 16)),
                                                               list(range(16, 23)), list(range(23, 30))]
    assert [len(stage_layers(80, 8, s)) for s in range(8)] == [10] * 8
    with pytest.raises(ValueError, match="pipeline_parallel_size=5 exceeds num_hidden_layers=4"):
        stage_layers(4, 5, 0)
    with pytest.raises(ValueError, match="pipeline_parallel_size=0"):
        stage_layers(4, 0, 0)


@pytest.mark.parametrize("stages", [2, 4])
def test_equal_micro_batches_leave_only_the_fill_and_drain_bubble(stages):
    # one request per stage, each prompt exactly one budget: micro-batch i holds request i % P (its prompt, then
    # its decodes), every micro-batch takes 1/P s a stage, and N = 3P of them leave (P - 1) / (N + P - 1) idle
    names = "abcd"[:stages]
    result = simulate(workload(*((r, 0.0, 8, 3) for r in names)), PipelineCostModel(ONE_SECOND, stages),
                      config(stages), record_batches=True)
    its = result.stats.iterations
    u = 1.0 / stages
    assert [it.batch[0][0] for it in its] == list(names) * 3
    assert [(it.start_time, it.end_time) for it in its] == [pytest.approx((i * u, i * u + 1.0))
                                                             for i in range(3 * stages)]
    assert all(it.stage_busy == pytest.approx((u,) * stages) for it in its)
    s = result.summary()
    assert s["pipeline_stages"] == stages
    assert s["bubble_fraction"] == pytest.approx((stages - 1) / (4 * stages - 1))
    assert s["stage_idle"] == pytest.approx([(stages - 1) * u] * stages)
    assert s["tbt_p50"] == s["tbt_p99"] == pytest.approx(1.0)  # each request's next row waits for its last


def test_alternating_long_and_short_micro_batches_stall_the_pipeline_as_counted_by_hand():
    # Stages take 3 s on even micro-batches (a's rows) and 1 s on odd ones (b's). Stage 0 finishes b's short row
    # at 4 but may not start a's next one before a's last leaves stage 1 at 6; stage 1 then waits for it until 9.
    result = simulate(workload(("a", 0.0, 8, 3), ("b", 0.0, 8, 3)), Alternating(3.0, 1.0), config(2),
                      record_batches=True)
    its = result.stats.iterations
    assert [it.batch[0][0] for it in its] == ["a", "b"] * 3
    assert [(it.start_time, it.end_time) for it in its] == [(0, 6), (3, 7), (6, 12), (9, 13), (12, 18), (15, 19)]
    s = result.summary()
    assert s["stage_busy"] == [12.0, 12.0]
    assert s["bubble_fraction"] == pytest.approx(7 / 19)  # 1 - 3 * (3 + 1) / (2 * 3 * 3 + 1)
    # the same work in equal micro-batches (2 s each) idles only the fill and drain: 1 / (2 * 3 + 1)
    equal = simulate(workload(("a", 0.0, 8, 3), ("b", 0.0, 8, 3)), Alternating(2.0, 2.0), config(2))
    assert equal.summary()["bubble_fraction"] == pytest.approx(1 / 7)


@pytest.mark.parametrize("balance", [True, False])
def test_decodes_that_become_ready_together_are_shared_by_the_micro_batches(balance):
    # Four 2-token prompts arrive together and are prefilled in one micro-batch (0-1 s, 0.5 s a stage); their
    # four rounds of decodes then come back together. Balanced (the default), each micro-batch takes ceil(4 / 2)
    # = 2 of them, so two micro-batches overlap: 8 of them start every 0.5 s from 1 s, the last ends at 5.5, and
    # each stage idles 1 s of 5.5 (2 / 11). Unbalanced, one micro-batch takes all four and the next finds none:
    # one crosses at a time, ending at 2, 3, 4, 5, and each stage idles half of the 5 s.
    cfg = dataclasses.replace(config(2), balance_micro_batches=balance)
    result = simulate(workload(*((r, 0.0, 2, 5) for r in "abcd")), PipelineCostModel(ONE_SECOND, 2), cfg,
                      record_batches=True)
    its = result.stats.iterations
    s = result.summary()
    if balance:
        assert [len(it.batch) for it in its] == [4] + [2] * 8
        assert [(it.start_time, it.end_time) for it in its[1:]] == [pytest.approx((1 + k / 2, 2 + k / 2))
                                                                    for k in range(8)]
        assert s["bubble_fraction"] == pytest.approx(2 / 11)
    else:
        assert [len(it.batch) for it in its] == [4] * 5
        assert [it.end_time for it in its] == pytest.approx([1, 2, 3, 4, 5])
        assert s["bubble_fraction"] == pytest.approx(0.5)
    assert s["num_requests"] == 4 and s["output_tokens"] == 20


def test_a_lone_request_cannot_fill_the_pipeline_and_each_token_pays_every_stage_and_send():
    # one request: its next decode waits for its last row to leave stage 2, so one stage works at a time
    result = simulate(workload(("a", 0.0, 8, 4)), Alternating(1.0, 1.0, send=0.5), config(2))
    s = result.summary()
    assert [(it.start_time, it.end_time) for it in result.stats.iterations] == [(0, 2.5), (2.5, 5), (5, 7.5),
                                                                                (7.5, 10)]
    assert s["tbt_p50"] == pytest.approx(2.5)
    assert s["bubble_fraction"] == pytest.approx(1 - 1 / 2.5)


def test_idle_time_between_bursts_is_no_bubble():
    its = [IterationRecord(0, 0.0, 2.0, 0.0, 1, 0, 1, 0, 0, stage_busy=(1.0, 1.0)),
           IterationRecord(1, 1.0, 3.0, 0.0, 1, 0, 1, 0, 0, stage_busy=(1.0, 1.0)),
           IterationRecord(2, 10.0, 12.0, 0.0, 1, 0, 1, 0, 0, stage_busy=(1.0, 1.0))]
    acc = bubble_accounting(its)
    assert acc["occupied"] == 5.0  # 0-3 and 10-12
    assert acc["stage_idle"] == [2.0, 2.0]
    assert acc["bubble_fraction"] == pytest.approx(0.4)
    assert bubble_accounting(its[:0]) is None


def test_no_request_is_in_two_micro_batches_in_flight_and_at_most_p_are_in_flight():
    cost = roofline("1x4xa100-80gb", "llama3-70b")
    wl = Workload.from_trace("conversation", num_requests=120, qps=4.0, prompt_scale=0.25, output_scale=0.25)
    cfg = scheduler_config(cost, "sarathi", 256, enable_prefix_caching=False)
    assert cfg.max_concurrent_batches == 4
    result = simulate(wl, cost, cfg, record_batches=True)
    its = result.stats.iterations
    assert len(its) > 200 and result.summary()["num_requests"] == 120
    spans: dict[str, list[tuple[float, float]]] = {}
    for it in its:
        for rid, _ in it.batch:
            spans.setdefault(rid, []).append((it.start_time, it.end_time))
        assert sum(o.start_time <= it.start_time < o.end_time for o in its) <= 4
    for rid, s in spans.items():
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(s, s[1:])), rid
    assert max(sum(o.start_time <= it.start_time < o.end_time for o in its) for it in its) == 4  # it does fill


def test_pipelined_simulations_are_deterministic():
    cost = roofline("2x2xh100", "llama3-70b")
    wl = Workload.from_trace("arxiv", num_requests=60, qps=1.0, prompt_scale=0.25, output_scale=0.25)
    runs = [simulate(wl, cost, scheduler_config(cost, policy, chunk), record_batches=True)
            for policy, chunk in (("sarathi", 512), ("vllm", None)) for _ in range(2)]
    for a, b in (runs[:2], runs[2:]):
        assert a.summary() == b.summary()
        assert [(it.batch, it.start_time, it.end_time, it.stage_busy) for it in a.stats.iterations] == \
            [(it.batch, it.start_time, it.end_time, it.stage_busy) for it in b.stats.iterations]
    assert runs[0].summary()["bubble_fraction"] != runs[2].summary()["bubble_fraction"]


def _batch(rows: list[tuple[int, int, bool]]) -> SchedulerOutput:
    """A ``SchedulerOutput`` of ``(computed, new, sample)`` rows."""
    from sarathi_lite.scheduler.output import ScheduledRequest

    out = SchedulerOutput()
    for i, (computed, new, sample) in enumerate(rows):
        out.add(ScheduledRequest(f"r{i}", computed, new, [0] * new, [], sample, computed + new < 4096 and new > 1))
    return out


@pytest.mark.parametrize("rows", [[(1000 + i, 1, True) for i in range(32)], [(0, 8192, True)]],
                         ids=["decodes", "prefill"])
def test_roofline_stages_share_the_whole_models_work(rows):
    out = _batch(rows)
    flat, piped = roofline("4xh100", "llama3-70b"), roofline("4x2xh100", "llama3-70b")
    assert flat.predict_stage_times(out) == [flat.predict_step_time(out)]
    stages = piped.predict_stage_times(out)
    # memory-bound decodes and compute-bound prefill alike: the stages split the work, each adds its overhead
    assert sum(stages) == pytest.approx(flat.predict_step_time(out) + flat.step_overhead, rel=1e-9)
    assert stages[1] > stages[0]  # the LM head runs on the last stage
    tokens = out.num_prefill_tokens + out.num_decode_tokens
    assert piped.send_time(out) == pytest.approx(10e-6 + 2 * 8192 * 2 * tokens / (50e9 * 0.85))
    assert piped.predict_step_time(out) == pytest.approx(sum(stages) + piped.send_time(out))


def test_roofline_pipeline_stages_hold_their_layers_kv_and_parse_from_the_spec():
    flat, piped = roofline("4xa100-80gb", "llama3-70b"), roofline("4x2xa100-80gb", "llama3-70b")
    assert (piped.tensor_parallel_size, piped.pipeline_parallel_size) == (4, 2)
    assert piped.kv_bytes_per_token * 2 == flat.kv_bytes_per_token
    assert piped.kv_cache_memory > flat.kv_cache_memory  # half the weights per device
    assert piped.describe()["pipeline_parallel_size"] == 2
    falcon = roofline("4x2xa100-80gb-100gbe", "falcon-180b")
    assert falcon.stage_num_layers == [40, 40]
    # a device holds half of a tensor-parallel rank's weights: 179.6 B weights of 2 bytes over 8 devices
    assert falcon.weight_bytes / 2 == pytest.approx(179.6e9 * 2 / 8, rel=0.01)
    with pytest.raises(ValueError, match="pipeline_parallel_size=100 exceeds num_hidden_layers=80"):
        roofline("1x100xh100", "llama3-70b")
    with pytest.raises(ValueError, match="leaves no memory"):
        roofline("1x2xa100-80gb", "falcon-180b")  # 180 GB of weights a stage


def test_pipeline_cost_model_gives_the_last_stage_the_lm_head_of_the_sampling_rows():
    # SmolLM2-135M: 30 layers; its LM head (49,152 x 576) weighs 8.0 layers (576 x 64 x (18 + 6) + 3 x 576 x 1536)
    from sarathi_lite.costs.roofline import model_shape

    head = head_layer_units(model_shape("smollm2-135m")[1])
    assert head == pytest.approx(49152 * 576 / (576 * 64 * 24 + 3 * 576 * 1536))
    cost = PipelineCostModel(ONE_SECOND, 2, num_layers=30, head_layers=head)
    decodes = _batch([(100 + i, 1, True) for i in range(8)])
    _, stages, _ = cost.stage_timing(decodes)
    assert stages == pytest.approx([15 * 8 / (30 * 8 + 8 * head), (15 * 8 + 8 * head) / (30 * 8 + 8 * head)])
    chunk = _batch([(0, 256, False)])  # a prompt chunk that samples nothing: layers alone
    assert cost.stage_timing(chunk)[1] == pytest.approx([0.5, 0.5])
    with pytest.raises(ValueError, match="head_layers=-1"):
        PipelineCostModel(ONE_SECOND, 2, head_layers=-1)


def test_pipeline_cost_model_splits_any_step_time_by_the_stages_layers():
    cost = PipelineCostModel(ONE_SECOND, 4, num_layers=30, activation_bytes_per_token=1000, link_bandwidth=1e6,
                             link_latency=0.01)
    out = _batch([(0, 10, True)])
    schedule_time, stages, send = cost.stage_timing(out)
    assert stages == pytest.approx([8 / 30, 8 / 30, 7 / 30, 7 / 30])
    assert send == pytest.approx(0.01 + 10 * 1000 / 1e6)
    assert cost.predict(out).step_time == pytest.approx(1.0 + 3 * send)
    with pytest.raises(ValueError, match="link_bandwidth=0"):
        PipelineCostModel(ONE_SECOND, 2, link_bandwidth=0)
