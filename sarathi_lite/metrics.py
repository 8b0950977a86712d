"""Per-request and per-iteration serving metrics, as data returned to the caller.

Definitions (following Sarathi-Serve), all times in seconds on one clock:

- scheduling delay: arrival to the first iteration that runs any of the request's tokens;
- TTFT (time to first token): arrival to the end of the iteration that sampled its first token;
- TBT (time between tokens): the gap between consecutive output tokens, one per output token after the first;
  a gap includes any time lost to preemption and recompute;
- end-to-end latency: arrival to the end of the iteration that sampled its last token;
- normalized latency: end-to-end latency divided by the number of output tokens;
- cached prompt tokens: the prompt tokens a request found in the prefix cache when it was first scheduled (its
  first row starts after them); the prefix-cache hit rate is their sum over the sum of prompt tokens.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Container, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestMetrics:
    """One request's timeline. ``token_times[i]`` is when output token ``i`` became available.
    ``num_cached_tokens``: prompt tokens found in the prefix cache at its first scheduling."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def scheduling_delay(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tbt(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def normalized_latency(self) -> float | None:
        e2e = self.e2e
        return None if e2e is None or not self.token_times else e2e / len(self.token_times)

    def as_dict(self) -> dict[str, Any]:
        tbt = self.tbt
        return {
            "request_id": self.request_id, "arrival_time": self.arrival_time,
            "num_prompt_tokens": self.num_prompt_tokens, "num_cached_tokens": self.num_cached_tokens,
            "num_output_tokens": self.num_output_tokens,
            "scheduling_delay": self.scheduling_delay, "ttft": self.ttft,
            "tbt_mean": float(np.mean(tbt)) if tbt else None, "tbt_max": max(tbt) if tbt else None,
            "e2e": self.e2e, "normalized_latency": self.normalized_latency,
            "num_preemptions": self.num_preemptions, "finish_reason": self.finish_reason,
        }


@dataclass(slots=True)
class IterationRecord:
    """One iteration (one forward pass): what it held and how long it took.

    batch: ``(request_id, num_new_tokens)`` per scheduled request, kept only when the recorder is asked to.
    num_cached_tokens: prefill tokens that requests admitted in this iteration found in the prefix cache.
    prepare_time, forward_time, sample_time: the model runner's host seconds (inputs and attention metadata;
    the forward pass with the sampling rows' logits; sampling), 0 where no model ran (the simulator);
    ``update_time`` is the rest of the step after scheduling.
    stage_busy: under pipeline parallelism, the seconds each stage worked on this micro-batch (``()`` otherwise);
    ``start_time`` to ``end_time`` then spans its whole trip through the pipeline (see ``bubble_accounting``).
    """

    index: int
    start_time: float
    end_time: float
    schedule_time: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefills: int
    num_decodes: int
    num_preempted: int
    num_cached_tokens: int = 0
    batch: tuple[tuple[str, int], ...] = ()
    prepare_time: float = 0.0
    forward_time: float = 0.0
    sample_time: float = 0.0
    stage_busy: tuple[float, ...] = ()

    @property
    def step_time(self) -> float:
        return self.end_time - self.start_time

    @property
    def execute_time(self) -> float:
        """The model runner's seconds: ``prepare_time + forward_time + sample_time``."""
        return self.prepare_time + self.forward_time + self.sample_time

    @property
    def update_time(self) -> float:
        """Seconds of the step outside scheduling and the model runner (the scheduler's update, bookkeeping)."""
        return self.step_time - self.schedule_time - self.execute_time

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("batch")
        d["step_time"] = self.step_time
        return d


def slo_arrays(requests: Sequence[RequestMetrics]) -> tuple[np.ndarray, np.ndarray]:
    """``(ttft, tbt_p99)`` per request, the two numbers a request's SLOs judge (seconds; TTFT ``inf`` for an
    unfinished request, TBT 0 for a request of one token)."""
    ttft = np.array([r.ttft if r.ttft is not None and r.finished_time is not None else math.inf for r in requests])
    tbt = np.array([float(np.percentile(r.tbt, 99)) if len(r.token_times) > 1 else 0.0 for r in requests])
    return ttft, tbt


def slo_shares(ttft: np.ndarray, tbt: np.ndarray, ttft_slo: float, tbt_slo: float) -> tuple[float, float, float]:
    """Shares of the requests whose ``slo_arrays`` are ``ttft`` and ``tbt`` that meet both SLOs, the TTFT SLO
    alone and the TBT SLO alone (seconds); zeros for no requests."""
    if not ttft.size:
        return 0.0, 0.0, 0.0
    met_ttft, met_tbt = ttft <= ttft_slo, tbt <= tbt_slo
    return float(np.mean(met_ttft & met_tbt)), float(np.mean(met_ttft)), float(np.mean(met_tbt))


def percentiles(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    arr = np.asarray(values, dtype=np.float64)
    return {f"{prefix}_p{p}": (float(np.percentile(arr, p)) if arr.size else None) for p in PERCENTILES}


def bubble_accounting(iterations: Iterable[IterationRecord]) -> dict[str, Any] | None:
    """Pipeline bubbles of iterations with ``stage_busy`` (``None`` when none has it): ``occupied``, the seconds
    during which at least one micro-batch was in the pipeline (the union of their ``start_time .. end_time``);
    per stage, ``stage_busy`` (seconds it worked) and ``stage_idle`` (``occupied`` less that); and
    ``bubble_fraction``, the idle time of all stages over ``stages x occupied``. Time with nothing in flight (an
    idle server) is no bubble."""
    spans, busy = [], None
    for it in iterations:
        if not it.stage_busy:
            continue
        spans.append((it.start_time, it.end_time))
        busy = list(it.stage_busy) if busy is None else [b + t for b, t in zip(busy, it.stage_busy)]
    if busy is None:
        return None
    occupied, reach = 0.0, -float("inf")
    for start, end in sorted(spans):
        if end > reach:
            occupied += end - max(start, reach)
            reach = end
    idle = [max(occupied - b, 0.0) for b in busy]
    return {"occupied": occupied, "stage_busy": busy, "stage_idle": idle,
            "bubble_fraction": sum(idle) / (len(busy) * occupied) if occupied > 0 else 0.0}


class Stats:
    """What a run recorded: ``requests`` (one ``RequestMetrics`` each) and ``iterations``."""

    def __init__(self, requests: Iterable[RequestMetrics], iterations: Iterable[IterationRecord]) -> None:
        self.requests = list(requests)
        self.iterations = list(iterations)

    def summary(self) -> dict[str, Any]:
        """Percentiles (p50/p90/p99, seconds) of TTFT, TBT, scheduling delay, end-to-end and normalized
        latency over finished requests (TBT over all token gaps pooled), and throughput over the run; under
        pipeline parallelism also ``pipeline_stages``, ``bubble_fraction`` and per-stage ``stage_busy`` and
        ``stage_idle`` seconds (``bubble_accounting``)."""
        done = [r for r in self.requests
                if r.finished_time is not None and r.finish_reason not in ("abort", "error")]
        out: dict[str, Any] = {"num_requests": len(done), "num_iterations": len(self.iterations)}
        out.update(percentiles([r.ttft for r in done if r.ttft is not None], "ttft"))
        out.update(percentiles([g for r in done for g in r.tbt], "tbt"))
        out.update(percentiles([r.scheduling_delay for r in done if r.scheduling_delay is not None],
                               "scheduling_delay"))
        out.update(percentiles([r.e2e for r in done], "e2e"))
        out.update(percentiles([r.normalized_latency for r in done if r.normalized_latency is not None],
                               "normalized_latency"))
        out_tokens = sum(r.num_output_tokens for r in done)
        prompt_tokens = sum(r.num_prompt_tokens for r in done)
        span = (max(r.finished_time for r in done) - min(r.arrival_time for r in done)) if done else 0.0
        out["duration"] = span
        out["output_tokens"] = out_tokens
        out["throughput_requests_per_s"] = len(done) / span if span > 0 else None
        out["throughput_output_tokens_per_s"] = out_tokens / span if span > 0 else None
        out["throughput_tokens_per_s"] = (out_tokens + prompt_tokens) / span if span > 0 else None
        out["num_preemptions"] = sum(r.num_preemptions for r in self.requests)
        out["cached_prompt_tokens"] = cached = sum(r.num_cached_tokens for r in done)
        out["prefix_cache_hit_rate"] = cached / prompt_tokens if prompt_tokens else None
        steps = [it.step_time for it in self.iterations]
        out.update(percentiles(steps, "step_time"))
        pipeline = bubble_accounting(self.iterations)
        if pipeline is not None:
            out["pipeline_stages"] = len(pipeline["stage_busy"])
            out["bubble_fraction"] = pipeline["bubble_fraction"]
            out["stage_busy"], out["stage_idle"] = pipeline["stage_busy"], pipeline["stage_idle"]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "requests": [r.as_dict() for r in self.requests],
                "iterations": [it.as_dict() for it in self.iterations]}

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def to_pandas(self) -> dict[str, Any]:
        """``{"requests": DataFrame, "iterations": DataFrame}`` (needs pandas)."""
        import pandas as pd

        return {"requests": pd.DataFrame([r.as_dict() for r in self.requests]),
                "iterations": pd.DataFrame([it.as_dict() for it in self.iterations])}


class MetricsRecorder:
    """Fills ``RequestMetrics`` and ``IterationRecord``s from scheduler outputs, on any clock (real or
    simulated): the engine and the simulator share it, so their numbers mean the same thing.

    window: keep only the records of the last ``window`` finished requests and the last ``window`` iterations
    (unfinished requests are always kept), so a long-running server holds bounded memory; ``None`` keeps all.
    requests: the request records to fill (``None``: a new dict); recorders that share one dict (the instances of
    a simulated deployment) fill one record per request, wherever its steps run, and keep their own iterations.
    """

    def __init__(self, record_batches: bool = False, window: int | None = None,
                 requests: dict[str, RequestMetrics] | None = None) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window={window!r} must be a positive integer or None")
        self.record_batches = record_batches
        self.window = window
        self.requests: dict[str, RequestMetrics] = {} if requests is None else requests
        self.iterations: list[IterationRecord] | deque[IterationRecord] = [] if window is None else \
            deque(maxlen=window)
        self.num_iterations = 0
        self._finished: deque[RequestMetrics] = deque()

    def add(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> RequestMetrics:
        m = self.requests[request_id] = RequestMetrics(request_id, arrival_time, num_prompt_tokens)
        return m

    def record_preemptions(self, out: Any) -> None:
        """Count the preemptions of ``out``. ``record_step`` calls it; call it alone for a batch that ran nothing
        (with batches in flight, a request not in flight can find no other victim and give up its own blocks
        while nothing else is schedulable), which is not recorded as an iteration."""
        for pid in out.preempted_ids:
            self.requests[pid].num_preemptions += 1

    def record_step(self, out: Any, start: float, schedule_end: float, end: float,
                    finished: Iterable[Any] = (), *, prepare_time: float = 0.0, forward_time: float = 0.0,
                    sample_time: float = 0.0, stage_busy: tuple[float, ...] = (),
                    prefill_only: Container[str] = ()) -> None:
        """Record one iteration ``out`` (a ``SchedulerOutput``) that ran from ``start`` to ``end`` and the
        requests (with ``request_id``, ``finish_reason``, ``num_preemptions``) that finished in it; the model
        runner's split of the step and the pipeline stages' busy seconds as in ``IterationRecord``.
        prefill_only: ids of requests run prefill only here (their KV moves to a decode instance, which samples
        their first token again): their rows count as scheduled, the token they sample is not recorded."""
        reqs = self.requests
        self.record_preemptions(out)
        for s in out.scheduled:
            m = reqs[s.request_id]
            if m.finish_reason == "abort":
                continue
            if m.first_scheduled_time is None:
                m.first_scheduled_time = start
                m.num_cached_tokens = s.num_computed_tokens  # its first row starts after the cached prefix
            if s.sample and s.request_id not in prefill_only:
                if m.first_token_time is None:
                    m.first_token_time = end
                m.token_times.append(end)
        for req in finished:
            self.finish(req.request_id, end, req.finish_reason)
        self.iterations.append(IterationRecord(
            self.num_iterations, start, end, schedule_end - start, out.num_prefill_tokens, out.num_decode_tokens,
            out.num_prefills, out.num_decodes, len(out.preempted_ids), out.num_cached_tokens,
            tuple((s.request_id, s.num_new_tokens) for s in out.scheduled) if self.record_batches else (),
            prepare_time, forward_time, sample_time, stage_busy))
        self.num_iterations += 1

    def finish(self, request_id: str, time: float, reason: str | None) -> None:
        m = self.requests[request_id]
        m.finished_time = time
        m.finish_reason = reason
        if self.window is not None:
            self._finished.append(m)
            while len(self._finished) > self.window:
                old = self._finished.popleft()
                if self.requests.get(old.request_id) is old:  # not a newer request that reused the id
                    del self.requests[old.request_id]

    def reset(self) -> None:
        """Forget the records of finished requests and all iterations (indices start again at 0)."""
        self.requests = {rid: m for rid, m in self.requests.items() if m.finished_time is None}
        self.iterations.clear()
        self.num_iterations = 0
        self._finished.clear()

    def stats(self) -> Stats:
        return Stats(self.requests.values(), self.iterations)
