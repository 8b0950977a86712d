"""The engine's batches between scheduling and processing: run inline, or several in flight on a forward thread.

With ``max_concurrent_batches`` = 1 a batch runs inline (``run``) and the engine processes it at once. With N > 1
(async scheduling, pipeline stages) the engine submits batches while the queue has room; they run in order, one at
a time, on one forward thread, and the engine processes the oldest while the next runs. A decode row scheduled
before its input token was sampled (``PLACEHOLDER_TOKEN``, async scheduling) gets that token on the forward
thread, from the batch before, which has run by then.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from sarathi_lite.engine.executor import Executor, SamplingInputs, StepFuture
from sarathi_lite.engine.kv_connector import KVConnector
from sarathi_lite.engine.model_runner import StepResult
from sarathi_lite.scheduler import PLACEHOLDER_TOKEN, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVLoadResult:
    """Whether the KV connector wrote the K/V a request of the batch loads."""

    request_id: str
    ok: bool


@dataclass(slots=True)
class BatchRun:
    """What running a batch gave: its step (whose result may still be on its way down a pipeline) and its KV
    loads' outcomes."""

    step: StepFuture
    loads: list[KVLoadResult]


@dataclass(slots=True)
class Batch:
    """A batch in flight: its scheduler output, when its scheduling began and ended (engine clock), and its run
    on the forward thread."""

    out: SchedulerOutput
    start: float
    scheduled: float
    run: Future[BatchRun]


class BatchQueue:
    """Up to ``depth`` batches scheduled and not yet processed, oldest first; with ``depth`` 1, none (batches
    run inline). connector: the engine's KV connector (``None``: no KV loads)."""

    def __init__(self, depth: int, connector: KVConnector | None) -> None:
        self.depth = depth
        self.connector = connector
        self.batches: deque[Batch] = deque()
        self.forward_thread = ThreadPoolExecutor(1, thread_name_prefix="sarathi-lite-forward") if depth > 1 \
            else None
        self._recent_tokens: deque[dict[str, int]] = deque(maxlen=depth)  # forward thread only
        self._to_release: list[str] = []  # finished requests whose executor state goes with the next batch

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def inline(self) -> bool:
        """Whether batches run inline, one at a time (``depth`` 1)."""
        return self.forward_thread is None

    def submit(self, executor: Executor, out: SchedulerOutput, sampling: SamplingInputs, start: float,
               scheduled: float) -> None:
        """Queue ``out`` to run on the forward thread after the batches before it."""
        release, self._to_release = self._to_release, []
        run = self.forward_thread.submit(self.run, executor, out, sampling, release)
        self.batches.append(Batch(out, start, scheduled, run))

    def popleft(self) -> Batch:
        return self.batches.popleft()

    def release(self, executor: Executor, request_id: str) -> None:
        """Forget a finished request's executor state: now, or, with batches in flight (one may still hold a row
        of it), in order with the next batch."""
        if self.inline:
            executor.release(request_id)
        else:
            self._to_release.append(request_id)

    def run(self, executor: Executor, out: SchedulerOutput, sampling: SamplingInputs,
            release: Sequence[str] = ()) -> BatchRun:
        """Run one batch: its KV loads, then its forward pass and sampling (on the forward thread when batches
        are in flight). ``release``: finished requests whose executor state can go now."""
        for rid in release:
            executor.release(rid)
        loads = [KVLoadResult(load.request_id, self.connector.load(load, executor.runner)) for load in out.kv_loads]
        if out.is_empty:
            return BatchRun(StepFuture(StepResult({}, {})), loads)
        if not self.inline:
            out = self._resolve_placeholders(out)
        step = executor.execute(out, sampling)
        if not self.inline and step.ready is not None:  # pipeline stages: sampled later, when processed
            self._recent_tokens.append(step.ready.tokens)
        return BatchRun(step, loads)

    def _resolve_placeholders(self, out: SchedulerOutput) -> SchedulerOutput:
        """``out`` with each ``PLACEHOLDER_TOKEN`` input replaced by the token a batch before it sampled for that
        request (async scheduling; the scheduler's own record is left as it is)."""
        rows = out.scheduled
        if not any(s.token_ids[0] == PLACEHOLDER_TOKEN for s in rows if not s.is_prefill):
            return out
        recent = self._recent_tokens

        def sampled(rid: str) -> int:
            for tokens in reversed(recent):
                if rid in tokens:
                    return tokens[rid]
            raise RuntimeError(f"async scheduling: no sampled token for request {rid!r}'s next decode")

        return dataclasses.replace(out, scheduled=[
            dataclasses.replace(s, token_ids=[sampled(s.request_id)])
            if not s.is_prefill and s.token_ids[0] == PLACEHOLDER_TOKEN else s for s in rows])

    def shutdown(self) -> None:
        """Stop the forward thread after the batches on it (idempotent)."""
        if self.forward_thread is not None:
            self.forward_thread.shutdown(wait=True)
