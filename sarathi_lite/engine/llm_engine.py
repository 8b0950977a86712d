"""``LLMEngine``: the step API. Each ``step()`` is one scheduler decision and ONE forward pass."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from sarathi_lite.costs import load_cost_model
from sarathi_lite.engine.config import EngineConfig
from sarathi_lite.engine.errors import EngineDeadError
from sarathi_lite.engine.kv_connector import KVConnector, make_kv_connector
from sarathi_lite.engine.model_runner import ModelRunner, StepResult, rank_kv_pool, runner_view
from sarathi_lite.engine.output_processor import OutputProcessor
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.prompts import check_token_ids
from sarathi_lite.engine.sampler import History
from sarathi_lite.engine.sampling_params import SamplingParams, check_text
from sarathi_lite.engine.snapshot import EngineSnapshot
from sarathi_lite.engine.worker import RankSetup, WorkerGroup, check_parallel_config
from sarathi_lite.metrics import MetricsRecorder, Stats
from sarathi_lite.models.builtin import resolve_model
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.models.interface import CausalLM
from sarathi_lite.models.loader import load_model
from sarathi_lite.scheduler import PLACEHOLDER_TOKEN, Request, SchedulerOutput, make_scheduler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def _resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch device of the ``device`` option; raises ``ValueError`` naming a device this machine lacks."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a torch device ({e})") from None
    if dev.type == "cpu":
        return dev
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise ValueError(f"device={device!r}: this machine has no {dev.type} device (use device='cpu')")
    count = getattr(backend, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise ValueError(f"device={device!r}: this machine has {count()} {dev.type} device(s)")
    return dev


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


class LLMEngine:
    """Chunked-prefill inference over a paged KV cache.

    ``LLMEngine(model, **options)`` takes every ``EngineConfig`` field as a keyword (``scheduler=`` names the
    policy), or ``LLMEngine(config=EngineConfig(...))``; see ``EngineConfig`` for each option and its default.
    clock: the time source for metrics (seconds). connector: a ``KVConnector`` object that moves prompt K/V between
    engines (disaggregated prefill/decode; ``sarathi_lite.engine.kv_connector``): it saves every finished
    request's K/V, and a request added with ``num_external_tokens`` loads them (default: the one the ``kv_role``,
    ``kv_connector`` (its name) and ``kv_store`` options describe, if any). ``LLMEngine.from_model(engine, ...)``:
    another engine on the
    same loaded weights.
    With ``tensor_parallel_size`` N > 1 the engine starts N - 1 worker processes (``sarathi_lite.engine.worker``);
    ``shutdown()`` (or dropping the engine) stops them. Scripts that spawn workers need the usual
    ``if __name__ == "__main__":`` guard of Python's spawn start method.
    """

    def __init__(self, model: str | Path | None = None, *, config: EngineConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter, connector: KVConnector | None = None,
                 **options: Any) -> None:
        config = _engine_config(model, config, options)
        t0 = time.perf_counter()
        path = resolve_model(config.model)
        device = _resolve_device(config.device)
        dtype = _resolve_dtype(config.dtype, device)
        self.workers: WorkerGroup | None = None
        self._finalizer: Callable[[], Any] | None = None
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        if tp_size * pp_size > 1:
            check_parallel_config(ModelConfig.from_pretrained(path), tp_size, device, pp_size)
            setup = RankSetup.of(config, str(path), dtype, device)
            device = setup.device(0)
            self.workers = WorkerGroup.start(setup.world_size, setup)
            self._finalizer = weakref.finalize(self, self.workers.shutdown)
        try:
            tp, pp = (None, None) if self.workers is None else (self.workers.tp, self.workers.pp)
            model = load_model(path, dtype, device, config.load_format, tp, pp)
            self._start(config, path, device, dtype, model, model, _load_tokenizer(path), clock, t0, connector)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def from_model(cls, source: LLMEngine, *, config: EngineConfig | None = None,
                   clock: Callable[[], float] = time.perf_counter, connector: KVConnector | None = None,
                   **options: Any) -> LLMEngine:
        """A new engine on ``source``'s loaded weights and tokenizer (not loaded again), with its own scheduler,
        KV cache and records: e.g. to sweep scheduler settings over one model. config, options: as for
        ``LLMEngine``; ``model``, ``dtype`` and ``device`` default to ``source``'s, and raise ``ValueError`` if
        they name others. Not with tensor parallelism. Do not step engines that share weights from two threads
        at once."""
        model = options.pop("model", None)
        config = _engine_config(model, config, options)
        if source.workers is not None or config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            raise ValueError("from_model: engines with tensor_parallel_size or pipeline_parallel_size > 1 cannot "
                             "share loaded weights")
        t0 = time.perf_counter()
        path = source.model_path if config.model is None else resolve_model(config.model)
        device = source.device if config.device is None else _resolve_device(config.device)
        dtype = source.dtype if config.dtype == "auto" else _resolve_dtype(config.dtype, device)
        if (path, dtype, device) != (source.model_path, source.dtype, source.device):
            raise ValueError(f"from_model: that engine holds {source.model_path.name} ({source.dtype}, "
                             f"{source.device}), not {path.name} ({dtype}, {device})")
        config = config.replace(model=str(path), dtype=str(dtype).removeprefix("torch."), device=str(device))
        engine = cls.__new__(cls)
        engine.workers, engine._finalizer = None, None
        engine._start(config, path, device, dtype, source.model, runner_view(source.model), source.tokenizer,
                      clock, t0, connector)
        return engine

    def _start(self, config: EngineConfig, path: Path, device: torch.device, dtype: torch.dtype,
               model: CausalLM, runner_model: CausalLM, tokenizer: Any, clock: Callable[[], float],
               t0: float, kv_connector: KVConnector | None = None) -> None:
        """Everything but loading: the KV pool, the scheduler, the model runner (on ``runner_model``: ``model``
        itself, or a ``runner_view`` of shared weights), the records."""
        self.config = config
        self.model_path, self.device, self.dtype = path, device, dtype
        self.model, self.tokenizer = model, tokenizer
        self.clock = clock
        self.model_config: ModelConfig = self.model.config
        pool = rank_kv_pool(config, self.model_config, self.model.tp.size, self.dtype, self.device)
        if self.workers is not None:
            pool = self.workers.agree_pool(config, pool, self.model_config.max_position_embeddings)
        max_model_len = pool.max_model_len
        self.scheduler_config = config.scheduler_config(pool.num_blocks, max_model_len)
        if kv_connector is None:
            kv_connector = make_kv_connector(config.kv_transfer)
        if kv_connector is not None and self.workers is not None:
            raise ValueError("kv_connector: not with tensor_parallel_size > 1 (each rank holds a shard of the KV)")
        self.kv_connector = kv_connector
        self.scheduler = make_scheduler(self.scheduler_config, _predictor(config), kv_connector)
        self.runner = ModelRunner(runner_model, block_size=pool.block_size, num_blocks=pool.num_blocks,
                                  device=self.device, dtype=self.dtype, attention_backend=config.attention_backend)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | _generation_eos(self.model_path) | (
            {self.tokenizer.eos_token_id} if self.tokenizer is not None and self.tokenizer.eos_token_id is not None
            else set())
        self.metrics = MetricsRecorder(record_batches=config.record_batches, window=config.stats_window)
        self.outputs = OutputProcessor(self.tokenizer)
        # The batch queue: batches scheduled and submitted, oldest first, with their submission future (None when
        # they run inline), start and end-of-schedule times. Batches run in order on one executor thread.
        self._depth = self.scheduler_config.max_concurrent_batches
        self._queue: deque[tuple[SchedulerOutput, Future[tuple[StepResult, list[tuple[str, bool]]]] | None,
                                 float, float]] = deque()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="sarathi-lite-forward") if self._depth > 1 \
            else None
        self._recent_tokens: deque[dict[str, int]] = deque(maxlen=self._depth)  # executor thread only
        self._to_release: list[str] = []  # finished requests whose runner state goes with the next batch
        self._publish_snapshot()
        # Move everything loaded so far out of the collector's sight: full collections over the model and
        # tokenizer objects otherwise show up as step-time spikes (as vLLM does).
        gc.freeze()

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, num_external_tokens: int = 0) -> None:
        """Queue a request. ``prompt`` is text (tokenized here) or token ids. ``arrival_time`` (on the engine's
        clock) defaults to now. ``num_external_tokens``: its first prompt tokens whose K/V the engine's KV
        connector supplies (their prefill is skipped; see ``sarathi_lite.engine.kv_connector``). Raises
        ``ValueError`` for bad input; the engine is unchanged then."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str):
            raise ValueError(f"request_id={request_id!r} must be a string")
        self._check_vocab(request_id, params)
        if num_external_tokens and self.kv_connector is None:
            raise ValueError(f"request {request_id!r}: num_external_tokens={num_external_tokens!r} needs an engine "
                             f"with a KV connector")
        text, token_ids = self._tokenize(request_id, prompt)
        stop = frozenset(params.stop_token_ids) if params.ignore_eos else \
            frozenset(params.stop_token_ids) | self.eos_token_ids
        arrival = self.clock() if arrival_time is None else arrival_time
        request = Request(request_id, token_ids, params.max_tokens, stop, arrival)
        self.scheduler.add(request, num_external_tokens)
        self.outputs.add(request, text, params, self.metrics.add(request_id, arrival, len(token_ids)))
        self._publish_snapshot()

    def _check_vocab(self, request_id: str, params: SamplingParams) -> None:
        """The checks of ``params`` that need the vocabulary: stop token ids and ``logit_bias`` keys inside it,
        ``logprobs`` at most its size; and one completion per request."""
        vocab = self.model_config.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"request {request_id!r}: stop_token_ids contains {t}, outside the vocabulary "
                                 f"[0, {vocab})")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"request {request_id!r}: logprobs={params.logprobs} exceeds the vocabulary size "
                             f"{vocab}")
        for t in params.logit_bias:
            if t >= vocab:
                raise ValueError(f"request {request_id!r}: logit_bias contains the key {t}, outside the vocabulary "
                                 f"[0, {vocab})")
        if params.num_completions > 1:
            raise ValueError(f"request {request_id!r}: n={params.n}, best_of={params.best_of}: a request of the "
                             f"step API is one completion; LLM.generate and the server run several")

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request in any state and free its KV blocks; returns its final output (``finish_reason``
        ``"abort"``). Raises ``ValueError`` for an unknown id."""
        self.scheduler.abort(request_id)
        self.metrics.finish(request_id, self.clock(), "abort")
        state = self.outputs.remove(request_id)
        self._release(request_id)
        self._publish_snapshot()
        return self.outputs.output(state, [], "")

    def finish_kv_sends(self, request_ids: Sequence[str]) -> None:
        """The receivers have the K/V of these finished requests, which a connector kept held (its ``save``
        returned ``False``): release their blocks."""
        for rid in request_ids:
            self.scheduler.finish_kv_send(rid)
        if request_ids:
            self._publish_snapshot()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix (e.g. between benchmark runs); returns the blocks dropped."""
        dropped = self.scheduler.reset_prefix_cache()
        self._publish_snapshot()
        return dropped

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._queue)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # ------------------------------------------------------------------ one iteration

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, ONE forward pass over the hybrid batch, then update. Returns an output for
        every request that got a token (finished ones have ``finish_reason`` set).

        With ``max_concurrent_batches`` > 1 (async scheduling) it first schedules and submits batches while the
        queue has room (they run in order on a forward thread), then waits for the oldest and processes it: the
        CPU work of scheduling the next batch and processing this one overlaps the running forward pass."""
        outputs = self._step()
        self._publish_snapshot()
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self._executor is None:
            start = self.clock()
            out = self.scheduler.schedule()
            scheduled = self.clock()
            try:
                return self._postprocess(out, self._execute(out, *self._sampling(out)), start, scheduled)
            except Exception as e:  # fail this step's requests, not the engine, unless the device itself broke
                return self._failed_step(out, e)
        while len(self._queue) < self._depth and self.scheduler.can_schedule() and self.scheduler.has_unfinished():
            start = self.clock()
            out = self.scheduler.schedule()
            scheduled = self.clock()
            release, self._to_release = self._to_release, []
            future = self._executor.submit(self._execute, out, *self._sampling(out), release)
            self._queue.append((out, future, start, scheduled))
            if out.is_empty:  # nothing else can run until a batch in flight returns
                break
        if not self._queue:
            return []
        out, future, start, scheduled = self._queue.popleft()
        try:
            return self._postprocess(out, future.result(), start, scheduled)
        except Exception as e:
            return self._failed_step(out, e)

    def _failed_step(self, out: SchedulerOutput, error: BaseException) -> list[RequestOutput]:
        """A batch failed to run or be processed: raise ``EngineDeadError`` if the device or a worker broke, else
        end the batch's requests with the error (the engine goes on) and drop the batch from the scheduler."""
        self.check_health()
        logger.exception("a step failed; its %d request(s) end with an error", len(out.scheduled),
                         exc_info=error)
        ids = [s.request_id for s in out.scheduled] + [load.request_id for load in out.kv_loads]
        self.scheduler.discard(out)
        return self._fail_requests(ids, error)

    def _fail_requests(self, request_ids: Sequence[str], error: BaseException) -> list[RequestOutput]:
        """End the unfinished ones of ``request_ids`` because of ``error``: free their blocks, record them
        finished with reason ``"error"``; returns their final outputs (``finish_reason="error"``, ``error`` the
        message)."""
        message = f"the step running this request failed: {type(error).__name__}: {error}"
        now = self.clock()
        outputs = []
        for rid in dict.fromkeys(request_ids):
            state = self.outputs.get(rid)
            if state is None or rid not in self.scheduler.requests:
                continue
            self.scheduler.abort(rid)
            state.request.finish_reason = "error"
            self.metrics.finish(rid, now, "error")
            self.outputs.remove(rid)
            self._release(rid)
            result = self.outputs.output(state, [], "")
            result.error = message
            outputs.append(result)
        return outputs

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` saying why if the engine cannot run steps any more: a tensor-parallel
        worker has exited or fallen out of step, or the CUDA device reports an error (CUDA errors are sticky:
        every later kernel would fail too)."""
        if self.workers is not None:
            try:
                self.workers.check_alive()
            except RuntimeError as e:
                raise EngineDeadError(str(e)) from e
            if self.workers.failed:
                raise EngineDeadError(self.workers.failed)
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except Exception as e:  # torch.AcceleratorError and friends: the device is gone for this process
                raise EngineDeadError(f"the device {self.device} failed: {e}") from e

    def _sampling(self, out: SchedulerOutput) -> tuple[dict[str, SamplingParams], dict[str, tuple[int, ...]],
                                                       dict[str, History]]:
        return self.outputs.sampling([s.request_id for s in out.scheduled if s.sample])

    def _execute(self, out: SchedulerOutput, params: dict[str, SamplingParams], banned: dict[str, tuple[int, ...]],
                 history: dict[str, History], release: Sequence[str] = ()
                 ) -> tuple[StepResult, list[tuple[str, bool]]]:
        """Run one batch: its KV loads, then its forward pass and sampling (on the forward thread when batches are
        in flight). ``release``: finished requests whose runner state can go now. Returns the step's result and
        each KV load's ``(request id, ok)``."""
        for rid in release:
            self.runner.release(rid)
        loads = [(load.request_id, self.kv_connector.load(load, self.runner)) for load in out.kv_loads] \
            if out.kv_loads else []
        if out.is_empty:
            return StepResult({}, {}), loads
        if self._executor is not None:
            out = self._resolve_placeholders(out)
        if self.workers is not None:
            result = self.workers.execute(self.runner, out, params, banned, history)
        else:
            result = self.runner.execute(out, params, banned=banned, history=history)
        if self._executor is not None and not callable(result):  # pipeline stages: sampled later, in _postprocess
            self._recent_tokens.append(result.tokens)
        return result, loads

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

    def _postprocess(self, out: SchedulerOutput, run: tuple[StepResult, list[tuple[str, bool]]], start: float,
                     scheduled: float) -> list[RequestOutput]:
        result, loads = run
        if callable(result):  # pipeline parallelism: wait for the last stage's logits and sample them
            result = result()
        for rid, ok in loads:
            if not ok:
                logger.warning("request %r: the KV connector could not supply its prompt's K/V; recomputing it", rid)
            self.scheduler.finish_kv_load(rid, ok)
        finished = self.scheduler.update(out, result.tokens)
        end = self.clock()
        if self.kv_connector is not None:
            for save in self.scheduler.take_kv_saves():
                if self.kv_connector.save(save, self.runner):
                    self.scheduler.finish_kv_send(save.request_id)
        if out.is_empty:
            self.metrics.record_preemptions(out)
            return []
        self.metrics.record_step(out, start, scheduled, end, finished, prepare_time=result.prepare_time,
                                 forward_time=result.forward_time, sample_time=result.sample_time,
                                 stage_busy=result.stage_busy)
        self.scheduler.observe(out, end - start, end)
        outputs = self.outputs.process(result.tokens, result.logprobs, lambda req: self._stop_on_string(req, end))
        for o in outputs:
            if o.finish_reason is not None:
                self._release(o.request_id)
        return outputs

    def _stop_on_string(self, req: Request, now: float) -> None:
        """End ``req`` because its text matched a stop string: free its blocks, record ``"stop"``."""
        self.scheduler.abort(req.request_id)
        req.finish_reason = "stop"
        self.metrics.finish(req.request_id, now, "stop")

    def _release(self, request_id: str) -> None:
        """Forget a finished request's runner state: now, or, with batches in flight (one may still hold a row of
        it), in order with the next batch."""
        if self._executor is None:
            self.runner.release(request_id)
        else:
            self._to_release.append(request_id)

    # ------------------------------------------------------------------ helpers

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (idempotent; also runs when the engine is
        collected and at interpreter exit), and the forward thread of batches in flight. The engine cannot step
        afterwards."""
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=True)
        if self._finalizer is not None:
            self._finalizer()

    def stats(self) -> Stats:
        """Per-request and per-iteration records so far (``summary()``, ``to_pandas()``)."""
        return self.metrics.stats()

    def reset_stats(self) -> None:
        """Forget the records of finished requests and all iterations (e.g. after a warm-up)."""
        self.metrics.reset()

    def _tokenize(self, request_id: str, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {request_id!r}: text prompts need a tokenizer in {self.model_path}")
            check_text(f"request {request_id!r}: prompt", prompt)
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
            raise ValueError(f"request {request_id!r}: prompt must be text or a list of token ids, got "
                             f"{type(prompt).__name__}")
        return None, check_token_ids(f"request {request_id!r}", prompt, self.model_config.vocab_size)

    # ------------------------------------------------------------------ state for other threads

    def snapshot(self) -> EngineSnapshot:
        """The engine's queues and KV pool as of its last step, add, abort or prefix-cache reset: an immutable
        ``EngineSnapshot``, so it is safe to call from any thread while another steps the engine."""
        return self._snapshot

    def _publish_snapshot(self) -> None:
        """Replace the snapshot other threads read (one reference assignment: a reader sees the old or the new
        record, whole). Called by the engine's own thread after every operation that changes its state."""
        sched = self.scheduler
        blocks = sched.block_manager
        self._snapshot = EngineSnapshot(
            num_steps=self.metrics.num_iterations, num_waiting=len(sched.waiting), num_running=len(sched.running),
            kv_blocks_used=blocks.num_used_blocks, kv_blocks_total=blocks.num_blocks,
            kv_blocks_cached=blocks.num_cached_blocks, prefix_hit_rate=blocks.hit_rate)


def _engine_config(model: str | Path | None, config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    if config is None:
        return EngineConfig.from_options(model, **options)
    if model is not None or options:
        raise TypeError("give either config= or the model and options, not both")
    return config


def _predictor(config: EngineConfig) -> Any:
    """The step-time model of ``chunk_size="auto"`` (``None`` otherwise): ``config.cost_model`` loaded if it is
    a spec."""
    if config.chunk_size != "auto":
        return None
    if isinstance(config.cost_model, str):
        return load_cost_model(config.cost_model)
    return config.cost_model


def _load_tokenizer(path: Path) -> Any:
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _generation_eos(path: Path) -> frozenset[int]:
    file = path / "generation_config.json"
    if not file.is_file():
        return frozenset()
    eos = json.loads(file.read_text()).get("eos_token_id")
    return frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)
