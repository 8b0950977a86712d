"""Serving benchmark on the real model: replay a ``Workload`` online, in real time, under one or more scheduler
configurations, and measure the per-token cost of decode, hybrid and prefill batches.

>>> from sarathi_lite.bench.replay import run
>>> from sarathi_lite.bench.workload import Workload
>>> wl = Workload.from_trace("splitwise_conv.csv", num_requests=40, qps=0.5, prompt_scale=0.25)
>>> results = run(wl, policies=["sarathi", "vllm"], chunk_sizes=[256])
>>> print(compare(results))                   # sarathi_lite.bench.results.compare

Replay: a request is added to the engine (``arrival_time = start + spec.arrival_time`` on the engine's clock)
once the wall clock passes its arrival; the engine steps continuously while anything is unfinished, and sleeps
until the next arrival when nothing is. Prompts are token ids drawn from the workload's seed; every output is
forced to its ``output_len`` (greedy, EOS ignored). The model is loaded once and shared by every configuration.
"""

from __future__ import annotations

import datetime
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sarathi_lite.bench.capacity import SLO, CapacityResult, capacity_searches, search_capacity
from sarathi_lite.bench.results import BenchResult, Stopped, config_label, configurations, host, run_config
from sarathi_lite.bench.workload import Workload
from sarathi_lite.engine.config import default_option
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.scheduler import CHUNKED_POLICIES, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

WARM_UP_WORKLOAD = "uniform:32-64:4-4"
"""The short requests ``warm_up_instances`` plays (``Workload.synthetic`` lengths)."""

WARMUP_REQUEST_ID = "warmup"


def engine_config(engine: LLMEngine, chunk_size: int | None) -> dict[str, Any]:
    """The configuration record (``run_config``) of a result of ``engine``."""
    return run_config(engine.scheduler_config, chunk_size, model=engine.model_path.name,
                      dtype=str(engine.dtype).removeprefix("torch."), device=str(engine.device),
                      attention_backend=engine.runner.attention_backend)


def machine() -> str:
    """A one-line description of this machine and torch's thread count."""
    return f"{host()}, torch {torch.__version__} with {torch.get_num_threads()} threads"


def warm_up(engine: LLMEngine, prompt_len: int = 32, output_len: int = 4) -> None:
    """Run one short request to completion, then forget its records (``reset_stats``) and its cached prefix."""
    vocab = engine.model_config.vocab_size
    engine.add_request(WARMUP_REQUEST_ID, [i % vocab for i in range(1, prompt_len + 1)],
                       SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_stats()
    engine.reset_prefix_cache()


def warm_up_instances(engine: Any, vocab_size: int) -> None:
    """Play ``WARM_UP_WORKLOAD`` (a few short requests at once) on ``engine`` so every instance of a deployment
    steps before it is measured; its records stay until the caller's ``reset_stats``."""
    warm = Workload.synthetic(WARM_UP_WORKLOAD, num_requests=4, qps=None, seed=1)
    play(engine, list(zip(warm.requests, warm.prompt_token_ids(vocab_size))), time.perf_counter)


def play(engine: Any, pending: Sequence[tuple[Any, Sequence[int]]], clock: Callable[[], float],
         on_step: Callable[[list], None] | None = None) -> None:
    """Add each ``(spec, prompt ids)`` of ``pending`` (a ``RequestSpec``, arrival order) to ``engine`` (an
    ``LLMEngine`` or anything with its step API) when ``clock`` reaches its ``arrival_time`` after the start,
    greedy with ``spec.output_len`` tokens, EOS ignored; step until every request has finished, sleeping while
    nothing runs. on_step: called with each step's outputs."""
    start = clock()
    nxt = 0
    while nxt < len(pending) or engine.has_unfinished_requests():
        now = clock()
        while nxt < len(pending) and start + pending[nxt][0].arrival_time <= now:
            spec, ids = pending[nxt]
            engine.add_request(spec.request_id, ids, SamplingParams(temperature=0.0, max_tokens=spec.output_len,
                                                                    ignore_eos=True),
                               arrival_time=start + spec.arrival_time)
            nxt += 1
        if engine.has_unfinished_requests():
            outputs = engine.step()
            if on_step is not None:
                on_step(outputs)
        elif nxt < len(pending):
            time.sleep(max(0.0, start + pending[nxt][0].arrival_time - clock()))


def replay(engine: LLMEngine, workload: Workload, *, chunk_size: int | None = None, progress: bool = True
           ) -> BenchResult:
    """Replay ``workload`` on ``engine`` in real time and return what it recorded.

    The engine must have no unfinished requests and a real-time clock; warm it up first (``warm_up``).
    chunk_size: recorded in the configuration (default: the engine's, or ``None`` for unchunked policies).
    Raises ``ValueError`` if a request does not fit the engine's ``max_model_len``.
    """
    if engine.has_unfinished_requests():
        raise ValueError("replay needs an idle engine; it has unfinished requests")
    cfg = engine.scheduler_config
    workload.check_fits(cfg.max_model_len)
    config = engine_config(engine, chunk_size)
    prompts = workload.prompt_token_ids(engine.model_config.vocab_size)
    pending = list(zip(workload.requests, prompts))
    engine.reset_stats()
    load_start = os.getloadavg()
    bar = _progress(len(pending), config["label"], progress)
    wall = time.perf_counter()

    def finished(outputs: list) -> None:
        done = sum(o.finished for o in outputs)
        if bar is not None and done:
            bar.update(done)

    play(engine, pending, engine.clock, finished)
    if bar is not None:
        bar.close()
    meta = {"replay": "real-time", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(), "load_average_start": list(load_start), "load_average_end": list(os.getloadavg()),
            "wall_time": time.perf_counter() - wall}
    return BenchResult(config, workload, engine.stats(), meta)


def run(workload: Workload, *, policies: Sequence[str] = ("sarathi",), chunk_sizes: Sequence[int] | None = None,
        configs: Sequence[tuple[str, int | None]] | None = None, model: str | Path | None = None,
        progress: bool = True, engine: LLMEngine | None = None, **engine_options: Any) -> list[BenchResult]:
    """Replay ``workload`` under every configuration of ``configurations(policies, chunk_sizes)`` (or the
    ``(policy, chunk_size)`` pairs of ``configs``), in that order, each on a fresh engine that shares the loaded
    weights; returns one result per configuration. chunk_sizes: ``None`` means ``EngineConfig``'s default.

    model, engine_options: as for ``LLMEngine`` (``max_num_seqs``, ``block_size``, ``num_kv_blocks``, ``dtype``,
    ``device``, ...). engine: an already loaded engine to take the weights from (``model`` is then unused).
    Stopped early (``KeyboardInterrupt``), raises ``Stopped`` with the results of the configurations finished.
    """
    results: list[BenchResult] = []
    current = engine
    if configs is None:
        configs = configurations(policies, chunk_sizes or [default_option("chunk_size")])
    for policy, chunk in configs:
        try:
            current = build_engine(model, policy, chunk, current, **engine_options)
            warm_up(current)
            results.append(replay(current, workload, chunk_size=chunk, progress=progress))
        except KeyboardInterrupt:
            raise Stopped(results, f"{len(results)} of {len(configs)} configurations") from None
        s = results[-1].summary()
        logger.info("%s: %d requests in %.0f s, P99 TBT %.3f s, P50 TTFT %.3f s", results[-1].label,
                    s["num_requests"], results[-1].meta["wall_time"], s["tbt_p99"] or 0.0, s["ttft_p50"] or 0.0)
    return results


def build_engine(model: str | Path | None, policy: str, chunk_size: int | None, share: LLMEngine | None = None,
                 **engine_options: Any) -> LLMEngine:
    """An engine for one configuration; with ``share``, on that engine's loaded weights
    (``LLMEngine.from_model``; ``model`` is then unused). chunk_size: ``None`` (an unchunked policy) leaves
    ``EngineConfig``'s default."""
    if chunk_size is not None:
        engine_options = {**engine_options, "chunk_size": chunk_size}
    if share is not None:
        return LLMEngine.from_model(share, scheduler=policy, **engine_options)
    return LLMEngine(model, scheduler=policy, **engine_options)


def measured_capacity(workload: Workload, slo: SLO, *, policies: Sequence[str] = ("sarathi", "vllm"),
                      chunk_size: int | None = None, qps_low: float, qps_high: float, num_probes: int = 5,
                      model: str | Path | None = None, progress: bool = True, engine: LLMEngine | None = None,
                      **engine_options: Any) -> list[CapacityResult]:
    """Serving capacity of each policy (chunked ones at ``chunk_size``, default ``EngineConfig``'s), measured on
    the real engine (``sim.simulator.capacity`` predicts it): ``search_capacity`` over ``[qps_low, qps_high]``
    requests/s, each probe a real-time replay of ``workload.at_qps(qps)`` (the same requests and lengths, Poisson
    arrivals from the workload's seed scaled to the rate). Stopped early, raises ``Stopped`` with the searches
    so far (``capacity_searches``)."""
    current = engine

    def search(policy: str) -> CapacityResult:
        nonlocal current
        chunk = (chunk_size or default_option("chunk_size")) if policy in CHUNKED_POLICIES else None
        current = build_engine(model, policy, chunk, current, **engine_options)
        warm_up(current)
        probe = _probe(current, workload, chunk, progress)
        return search_capacity(probe, slo, qps_low, qps_high, num_probes, label=config_label(policy, chunk))

    return capacity_searches([partial(search, policy) for policy in policies])


def _probe(engine: LLMEngine, workload: Workload, chunk: int | None, progress: bool
           ) -> Callable[[float], BenchResult]:
    return lambda qps: replay(engine, workload.at_qps(qps), chunk_size=chunk, progress=progress)


def _progress(total: int, label: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label, unit="req", leave=False)


# ---------------------------------------------------------------------- batches built by hand


@dataclass(slots=True, frozen=True)
class BatchShape:
    """One batch to time. decode_contexts: cached tokens of each decode. chunks: ``(num_computed_tokens,
    num_new_tokens, sample)`` of each prompt chunk."""

    decode_contexts: tuple[int, ...]
    chunks: tuple[tuple[int, int, bool], ...] = ()

    def output(self, block_size: int, num_blocks: int, vocab_size: int, rng: np.random.Generator
               ) -> SchedulerOutput:
        """The batch as a ``SchedulerOutput`` (decodes first, as the scheduler orders them). Block tables take
        consecutive block ids, wrapping around the pool: only their count matters for timing."""
        out = SchedulerOutput()
        nxt = 0

        def blocks(num_tokens: int) -> list[int]:
            nonlocal nxt
            n = -(-num_tokens // block_size)
            nxt += n
            return [(nxt - n + i) % num_blocks for i in range(n)]

        for i, ctx in enumerate(self.decode_contexts):
            out.add(ScheduledRequest(f"d{i}", ctx, 1, [int(rng.integers(vocab_size))], blocks(ctx + 1), True, False))
        for i, (computed, new, sample) in enumerate(self.chunks):
            out.add(ScheduledRequest(f"p{i}", computed, new, rng.integers(vocab_size, size=new).tolist(),
                                     blocks(computed + new), sample, True))
        return out


# ---------------------------------------------------------------------- cost per token


@dataclass(slots=True)
class BatchCost:
    """One batch shape's step time: ``step_time`` (seconds, median over repeats) and ``ms_per_token``."""

    batch: str
    num_decodes: int
    num_prefill_tokens: int
    step_time: float

    @property
    def num_tokens(self) -> int:
        return self.num_decodes + self.num_prefill_tokens

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.step_time / self.num_tokens


@dataclass(slots=True)
class CostPerToken:
    """Per-token cost of batches of equal token count on this machine (Sarathi-Serve's Table 2).

    rows: ``decode-only``, ``hybrid``, ``prefill-only`` (``num_tokens`` tokens each), and ``single decode``
    (one decode alone). ``context_len``: cached tokens each decode attends to.
    """

    num_tokens: int
    context_len: int
    rows: list[BatchCost]
    machine: str

    def row(self, batch: str) -> BatchCost:
        return next(r for r in self.rows if r.batch == batch)

    @property
    def decode_prefill_ratio(self) -> float:
        """Per-token cost of the decode-only batch over that of the prefill-only batch."""
        return self.row("decode-only").ms_per_token / self.row("prefill-only").ms_per_token

    @property
    def prefill_tokens_per_decode(self) -> float:
        """How many prefill tokens (at the prefill-only batch's per-token cost) one lone decode step costs."""
        return 1000 * self.row("single decode").step_time / self.row("prefill-only").ms_per_token

    def table(self) -> str:
        lines = [f"{'batch':<14} {'decodes':>8} {'prefill tok':>11} {'step ms':>9} {'ms/token':>9}"]
        lines += [f"{r.batch:<14} {r.num_decodes:>8} {r.num_prefill_tokens:>11} {1000 * r.step_time:>9.1f} "
                  f"{r.ms_per_token:>9.2f}" for r in self.rows]
        lines.append(f"decode/prefill per-token cost: {self.decode_prefill_ratio:.1f}x; one lone decode step costs "
                     f"as much as {self.prefill_tokens_per_decode:.0f} prefill tokens")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"num_tokens": self.num_tokens, "context_len": self.context_len, "machine": self.machine,
                "decode_prefill_ratio": self.decode_prefill_ratio,
                "prefill_tokens_per_decode": self.prefill_tokens_per_decode,
                "rows": [{**asdict(r), "ms_per_token": r.ms_per_token} for r in self.rows]}


def step_seconds(engine: LLMEngine, out: SchedulerOutput, params: dict[str, SamplingParams], repeats: int,
                 warmups: int = 1) -> float:
    """Median seconds of ``repeats`` back-to-back forward passes of ``out`` (``engine.runner.execute``), after
    ``warmups`` untimed ones."""
    for _ in range(warmups):
        engine.runner.execute(out, params)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.runner.execute(out, params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cost_per_token_blocks(num_tokens: int, context_len: int, block_size: int) -> int:
    """KV blocks ``cost_per_token`` needs: ``num_tokens`` decodes of ``context_len + 1`` tokens and one chunk."""
    return num_tokens * -(-(context_len + 1) // block_size) + -(-num_tokens // block_size)


def cost_per_token(engine: LLMEngine, num_tokens: int = 128, context_len: int = 128, repeats: int = 5,
                   seed: int = 0) -> CostPerToken:
    """Time ``engine``'s model runner on batches of ``num_tokens`` tokens: all decodes (each with
    ``context_len`` cached tokens), half decodes and half one prompt chunk, one prompt chunk alone; and a single
    decode. Each is run once to warm up, then ``repeats`` times; the median step time counts. The batches are
    built directly (no scheduler) on the engine's KV pool, whose contents do not matter for timing.
    Raises ``ValueError`` if the pool cannot hold the decodes' contexts."""
    if num_tokens < 2 or context_len < 1 or repeats < 1:
        raise ValueError("need num_tokens >= 2, context_len >= 1, repeats >= 1")
    if engine.has_unfinished_requests():
        raise ValueError("cost_per_token needs an idle engine (it writes into the KV pool)")
    bs = engine.scheduler_config.block_size
    need = cost_per_token_blocks(num_tokens, context_len, bs)
    if need > engine.scheduler_config.num_blocks:
        raise ValueError(f"cost_per_token needs {need} KV blocks, the pool has {engine.scheduler_config.num_blocks}"
                         f"; lower num_tokens or context_len")
    rng = np.random.default_rng(seed)

    def batch(num_decodes: int, prefill_len: int) -> SchedulerOutput:
        """``num_decodes`` decodes then one sampling prompt chunk, each on its own consecutive blocks."""
        chunks = ((0, prefill_len, True),) if prefill_len else ()
        return BatchShape((context_len,) * num_decodes, chunks).output(bs, engine.scheduler_config.num_blocks,
                                                                       engine.model_config.vocab_size, rng)

    half = num_tokens // 2
    shapes = {"decode-only": batch(num_tokens, 0), "hybrid": batch(half, num_tokens - half),
              "prefill-only": batch(0, num_tokens), "single decode": batch(1, 0)}
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    rows = []
    for name, out in shapes.items():
        params = {s.request_id: greedy for s in out.scheduled}
        rows.append(BatchCost(name, out.num_decodes, out.num_prefill_tokens,
                              step_seconds(engine, out, params, repeats)))
    return CostPerToken(num_tokens, context_len, rows, machine())
