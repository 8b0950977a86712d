"""``LLMEngine``: the step API. Each ``step()`` is one scheduler decision and ONE forward pass."""

from __future__ import annotations

import gc
import json
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from sarathi_lite.costs import load_cost_model
from sarathi_lite.engine.batch_queue import BatchQueue, BatchRun
from sarathi_lite.engine.config import EngineConfig
from sarathi_lite.engine.executor import Executor, SamplingInputs
from sarathi_lite.engine.interface import Engine
from sarathi_lite.engine.kv_connector import KVConnector, make_kv_connector
from sarathi_lite.engine.model_runner import runner_view
from sarathi_lite.engine.output_processor import OutputProcessor
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.parallel_executor import ParallelExecutor
from sarathi_lite.engine.prompts import tokenize_prompt
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.engine.snapshot import EngineSnapshot
from sarathi_lite.metrics import MetricsRecorder, Stats
from sarathi_lite.models.builtin import resolve_model
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.models.interface import CausalLM
from sarathi_lite.scheduler import Request, SchedulerOutput, make_scheduler

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


class LLMEngine(Engine):
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
        self._finalizer: Callable[[], Any] | None = None
        executor, model = _start_executor(config, path, dtype, device)
        self._finalizer = weakref.finalize(self, executor.shutdown)
        try:
            self._start(config, path, dtype, executor, model, model, load_tokenizer(path), clock, t0, connector)
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
        if not source.executor.single_process or config.tensor_parallel_size > 1 \
                or config.pipeline_parallel_size > 1:
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
        engine._finalizer = None
        engine._start(config, path, dtype, Executor(device), source.model, runner_view(source.model),
                      source.tokenizer, clock, t0, connector)
        return engine

    def _start(self, config: EngineConfig, path: Path, dtype: torch.dtype, executor: Executor, model: CausalLM,
               runner_model: CausalLM, tokenizer: Any, clock: Callable[[], float], t0: float,
               kv_connector: KVConnector | None = None) -> None:
        """Everything but loading: the KV pool and the executor's model runner (on ``runner_model``: ``model``
        itself, or a ``runner_view`` of shared weights), the scheduler, the records."""
        self.config = config
        self.executor = executor
        self.model_path, self.device, self.dtype = path, executor.device, dtype
        self.model, self.tokenizer = model, tokenizer
        self.clock = clock
        self.model_config: ModelConfig = self.model.config
        pool = executor.build_runner(config, runner_model, dtype)
        self.runner = executor.runner
        self.scheduler_config = config.scheduler_config(pool.num_blocks, pool.max_model_len)
        if kv_connector is None:
            kv_connector = make_kv_connector(config.kv_transfer)
        if kv_connector is not None and not executor.single_process:
            raise ValueError("kv_connector: not with tensor_parallel_size > 1 (each rank holds a shard of the KV)")
        self.kv_connector = kv_connector
        self.scheduler = make_scheduler(self.scheduler_config, _predictor(config), kv_connector)
        self.eos_token_ids = _eos_token_ids(self.model_config, path, tokenizer)
        self.metrics = MetricsRecorder(record_batches=config.record_batches, window=config.stats_window)
        self.outputs = OutputProcessor(self.tokenizer)
        # Batches scheduled and not yet processed: run inline, or several in flight on a forward thread.
        self._batches = BatchQueue(self.scheduler_config.max_concurrent_batches, kv_connector)
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
        _check_request(request_id, params, self.model_config.vocab_size)
        stop = frozenset(params.stop_token_ids) if params.ignore_eos else \
            frozenset(params.stop_token_ids) | self.eos_token_ids
        _check_min_tokens(request_id, params, stop, self.model_config.vocab_size)
        if num_external_tokens and self.kv_connector is None:
            raise ValueError(f"request {request_id!r}: num_external_tokens={num_external_tokens!r} needs an engine "
                             f"with a KV connector")
        text, token_ids = tokenize_prompt(self.tokenizer, self.model_path, self.model_config.vocab_size, request_id,
                                          prompt)
        arrival = self.clock() if arrival_time is None else arrival_time
        request = Request(request_id, token_ids, params.max_tokens, stop, arrival)
        self.scheduler.add(request, num_external_tokens)
        self.outputs.add(request, text, params, self.metrics.add(request_id, arrival, len(token_ids)))
        self._publish_snapshot()

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
        return self.scheduler.has_unfinished() or bool(self._batches)

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
        batches, scheduler = self._batches, self.scheduler
        if batches.inline:
            start = self.clock()
            out = scheduler.schedule()
            scheduled = self.clock()
            try:
                return self._postprocess(out, batches.run(self.executor, out, self._sampling(out)), start, scheduled)
            except Exception as e:  # fail this step's requests, not the engine, unless the device itself broke
                return self._failed_step(out, e)
        while len(batches) < batches.depth and scheduler.can_schedule() and scheduler.has_unfinished():
            start = self.clock()
            out = scheduler.schedule()
            scheduled = self.clock()
            batches.submit(self.executor, out, self._sampling(out), start, scheduled)
            if out.is_empty:  # nothing else can run until a batch in flight returns
                break
        if not batches:
            return []
        batch = batches.popleft()
        try:
            return self._postprocess(batch.out, batch.run.result(), batch.start, batch.scheduled)
        except Exception as e:
            return self._failed_step(batch.out, e)

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
        self.executor.check_health()

    def _sampling(self, out: SchedulerOutput) -> SamplingInputs:
        return SamplingInputs(*self.outputs.sampling([s.request_id for s in out.scheduled if s.sample]))

    def _postprocess(self, out: SchedulerOutput, run: BatchRun, start: float, scheduled: float
                     ) -> list[RequestOutput]:
        result = run.step.result()  # pipeline parallelism: waits for the last stage's logits and samples them
        for load in run.loads:
            if not load.ok:
                logger.warning("request %r: the KV connector could not supply its prompt's K/V; recomputing it",
                               load.request_id)
            self.scheduler.finish_kv_load(load.request_id, load.ok)
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
        """Forget a finished request's executor state: now, or, with batches in flight (one may still hold a row
        of it), in order with the next batch."""
        self._batches.release(self.executor, request_id)

    # ------------------------------------------------------------------ helpers

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (idempotent; also runs when the engine is
        collected and at interpreter exit), and the forward thread of batches in flight. The engine cannot step
        afterwards."""
        batches = getattr(self, "_batches", None)
        if batches is not None:
            batches.shutdown()
        if self._finalizer is not None:
            self._finalizer()

    def stats(self) -> Stats:
        """Per-request and per-iteration records so far (``summary()``, ``to_pandas()``)."""
        return self.metrics.stats()

    def reset_stats(self) -> None:
        """Forget the records of finished requests and all iterations (e.g. after a warm-up)."""
        self.metrics.reset()

    # ------------------------------------------------------------------ state for other threads

    def snapshot(self) -> EngineSnapshot:
        """The engine's queues and KV pool as of its last step, add, abort or prefix-cache reset: an immutable
        ``EngineSnapshot``, so it is safe to call from any thread while another steps the engine."""
        return self._snapshot

    def _publish_snapshot(self) -> None:
        """Replace the snapshot other threads read (one reference assignment: a reader sees the old or the new
        record, whole). Called by the engine's own thread after every operation that changes its state."""
        self._snapshot = _snapshot_of(self.scheduler, self.metrics.num_iterations)


def _engine_config(model: str | Path | None, config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    if config is None:
        return EngineConfig.from_options(model, **options)
    if model is not None or options:
        raise TypeError("give either config= or the model and options, not both")
    return config


def _check_request(request_id: str, params: SamplingParams, vocab: int) -> None:
    """The checks of a request's id and ``params`` (with those that need the vocabulary: stop token ids and
    ``logit_bias`` keys inside it, ``logprobs`` at most its size; and one completion per request)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    if not isinstance(request_id, str):
        raise ValueError(f"request_id={request_id!r} must be a string")
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


def _check_min_tokens(request_id: str, params: SamplingParams, stop: frozenset[int], vocab: int) -> None:
    """Refuse a request whose ``min_tokens`` leaves no token to sample: the sampler bans its stop tokens (EOS
    included unless ``ignore_eos``) until ``min_tokens`` are out, and a ban on the whole vocabulary would leave it
    nothing but garbage and NaN log-probabilities."""
    if params.min_tokens and sum(t < vocab for t in stop) >= vocab:
        raise ValueError(f"request {request_id!r}: min_tokens={params.min_tokens} bans the stop tokens until then, "
                         f"and stop_token_ids{'' if params.ignore_eos else ' with EOS'} cover all {vocab} token "
                         f"ids of the vocabulary: no token could be sampled; drop min_tokens or some stop_token_ids")


def _predictor(config: EngineConfig) -> Any:
    """The step-time model of ``chunk_size="auto"`` (``None`` otherwise): ``config.cost_model`` loaded if it is
    a spec."""
    if config.chunk_size != "auto":
        return None
    if isinstance(config.cost_model, str):
        return load_cost_model(config.cost_model)
    return config.cost_model


def load_tokenizer(path: Path) -> Any:
    """The Hugging Face tokenizer of the checkpoint folder ``path``, ``None`` when it ships none."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _eos_token_ids(model_config: ModelConfig, path: Path, tokenizer: Any) -> frozenset[int]:
    """The token ids that end a request (unless it ignores EOS): the model's, its generation config's, the
    tokenizer's."""
    eos = frozenset(model_config.eos_token_ids) | _generation_eos(path)
    return eos | {tokenizer.eos_token_id} if tokenizer is not None and tokenizer.eos_token_id is not None else eos


def _generation_eos(path: Path) -> frozenset[int]:
    file = path / "generation_config.json"
    if not file.is_file():
        return frozenset()
    eos = json.loads(file.read_text()).get("eos_token_id")
    return frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)


def _start_executor(config: EngineConfig, path: Path, dtype: torch.dtype, device: torch.device
                    ) -> tuple[Executor, CausalLM]:
    """The executor ``config`` asks for (worker processes started when it spans several ranks) and rank 0's
    share of the model at ``path``, loaded. Raises ``ValueError`` before any process starts for a parallel layout
    the model or the machine cannot take."""
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        executor = Executor(device)
    else:
        executor = ParallelExecutor.start(config, path, dtype, device)
    try:
        return executor, executor.load_model(path, dtype, config.load_format)
    except BaseException:
        executor.shutdown()
        raise


def _snapshot_of(scheduler: Any, num_steps: int) -> EngineSnapshot:
    """The ``EngineSnapshot`` of ``scheduler``'s queues and KV pool after ``num_steps`` steps."""
    blocks = scheduler.block_manager
    return EngineSnapshot(num_steps=num_steps, num_waiting=len(scheduler.waiting), num_running=len(scheduler.running),
                          kv_blocks_used=blocks.num_used_blocks, kv_blocks_total=blocks.num_blocks,
                          kv_blocks_cached=blocks.num_cached_blocks, prefix_hit_rate=blocks.hit_rate)
