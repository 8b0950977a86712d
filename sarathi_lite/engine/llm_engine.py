"""``LLMEngine``: the step API. Each ``step()`` is one scheduler decision and ONE forward pass."""

from __future__ import annotations

import gc
import json
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sarathi_lite.engine.config import EngineConfig
from sarathi_lite.engine.detokenizer import IncrementalDetokenizer
from sarathi_lite.engine.errors import EngineDeadError
from sarathi_lite.engine.model_runner import ModelRunner, StepResult, rank_kv_pool, runner_view
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.sampling_params import SamplingParams, check_text
from sarathi_lite.engine.worker import RankSetup, WorkerGroup, check_parallel_config
from sarathi_lite.metrics import MetricsRecorder, RequestMetrics, Stats
from sarathi_lite.models.builtin import resolve_model
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.models.llama import LlamaForCausalLM
from sarathi_lite.models.loader import load_model
from sarathi_lite.scheduler import Request, SchedulerOutput, make_scheduler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


@dataclass(slots=True)
class _Entry:
    """The engine's side of a request: what the scheduler does not need."""

    request: Request
    prompt: str | None
    params: SamplingParams
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer
    logprobs: list[Any] | None = field(default=None)
    # EOS and stop tokens the sampler must not pick while fewer than ``min_tokens`` tokens are out
    banned: tuple[int, ...] = ()


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
    clock: the time source for metrics (seconds). ``LLMEngine.from_model(engine, ...)``: another engine on the
    same loaded weights.
    With ``tensor_parallel_size`` N > 1 the engine starts N - 1 worker processes (``sarathi_lite.engine.worker``);
    ``shutdown()`` (or dropping the engine) stops them. Scripts that spawn workers need the usual
    ``if __name__ == "__main__":`` guard of Python's spawn start method.
    """

    def __init__(self, model: str | Path | None = None, *, config: EngineConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter, **options: Any) -> None:
        config = _engine_config(model, config, options)
        t0 = time.perf_counter()
        path = resolve_model(config.model)
        device = _resolve_device(config.device)
        dtype = _resolve_dtype(config.dtype, device)
        self.workers: WorkerGroup | None = None
        self._finalizer: Callable[[], Any] | None = None
        tp_size = config.tensor_parallel_size
        if tp_size > 1:
            check_parallel_config(ModelConfig.from_pretrained(path), tp_size, device)
            setup = RankSetup.of(config, str(path), dtype, device)
            device = setup.device(0)
            self.workers = WorkerGroup.start(tp_size, setup)
            self._finalizer = weakref.finalize(self, self.workers.shutdown)
        try:
            tp = None if self.workers is None else self.workers.tp
            model = load_model(path, dtype, device, config.load_format, tp)
            self._start(config, path, device, dtype, model, model, _load_tokenizer(path), clock, t0)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def from_model(cls, source: LLMEngine, *, config: EngineConfig | None = None,
                   clock: Callable[[], float] = time.perf_counter, **options: Any) -> LLMEngine:
        """A new engine on ``source``'s loaded weights and tokenizer (not loaded again), with its own scheduler,
        KV cache and records: e.g. to sweep scheduler settings over one model. config, options: as for
        ``LLMEngine``; ``model``, ``dtype`` and ``device`` default to ``source``'s, and raise ``ValueError`` if
        they name others. Not with tensor parallelism. Do not step engines that share weights from two threads
        at once."""
        model = options.pop("model", None)
        config = _engine_config(model, config, options)
        if source.workers is not None or config.tensor_parallel_size > 1:
            raise ValueError("from_model: engines with tensor_parallel_size > 1 cannot share loaded weights")
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
                      clock, t0)
        return engine

    def _start(self, config: EngineConfig, path: Path, device: torch.device, dtype: torch.dtype,
               model: LlamaForCausalLM, runner_model: LlamaForCausalLM, tokenizer: Any, clock: Callable[[], float],
               t0: float) -> None:
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
        self.scheduler = make_scheduler(self.scheduler_config, _predictor(config))
        self.runner = ModelRunner(runner_model, block_size=pool.block_size, num_blocks=pool.num_blocks,
                                  device=self.device, dtype=self.dtype, attention_backend=config.attention_backend)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | _generation_eos(self.model_path) | (
            {self.tokenizer.eos_token_id} if self.tokenizer is not None and self.tokenizer.eos_token_id is not None
            else set())
        self.metrics = MetricsRecorder(record_batches=config.record_batches, window=config.stats_window)
        self._entries: dict[str, _Entry] = {}
        # Move everything loaded so far out of the collector's sight: full collections over the model and
        # tokenizer objects otherwise show up as step-time spikes (as vLLM does).
        gc.freeze()

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. ``prompt`` is text (tokenized here) or token ids. ``arrival_time`` (on the engine's
        clock) defaults to now. Raises ``ValueError`` for bad input; the engine is unchanged then."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str):
            raise ValueError(f"request_id={request_id!r} must be a string")
        self._check_vocab(request_id, params)
        text, token_ids = self._tokenize(request_id, prompt)
        stop = frozenset(params.stop_token_ids) if params.ignore_eos else \
            frozenset(params.stop_token_ids) | self.eos_token_ids
        arrival = self.clock() if arrival_time is None else arrival_time
        request = Request(request_id, token_ids, params.max_tokens, stop, arrival)
        self.scheduler.add(request)
        self._entries[request_id] = _Entry(
            request, text, params, self.metrics.add(request_id, arrival, len(token_ids)),
            IncrementalDetokenizer(self.tokenizer, request.output_token_ids, params),
            [] if params.logprobs is not None else None, tuple(sorted(stop)) if params.min_tokens else ())

    def _check_vocab(self, request_id: str, params: SamplingParams) -> None:
        """The checks of ``params`` that need the vocabulary: stop token ids inside it, ``logprobs`` at most its
        size."""
        vocab = self.model_config.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"request {request_id!r}: stop_token_ids contains {t}, outside the vocabulary "
                                 f"[0, {vocab})")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"request {request_id!r}: logprobs={params.logprobs} exceeds the vocabulary size "
                             f"{vocab}")

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request in any state and free its KV blocks; returns its final output (``finish_reason``
        ``"abort"``). Raises ``ValueError`` for an unknown id."""
        self.scheduler.abort(request_id)
        self.metrics.finish(request_id, self.clock(), "abort")
        entry = self._entries[request_id]
        self._release(request_id)
        return self._output(entry, [], "")

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix (e.g. between benchmark runs); returns the blocks dropped."""
        return self.scheduler.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # ------------------------------------------------------------------ one iteration

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, ONE forward pass over the hybrid batch, then update. Returns an output for
        every request that got a token (finished ones have ``finish_reason`` set)."""
        start = self.clock()
        out = self.scheduler.schedule()
        scheduled = self.clock()
        try:
            result = self._run(out)
            return self._postprocess(out, result, start, scheduled)
        except Exception as e:  # fail this step's requests, not the engine, unless the device itself broke
            self.check_health()
            logger.exception("a step failed; its %d request(s) end with an error", len(out.scheduled))
            return self._fail_requests([s.request_id for s in out.scheduled], e)

    def _fail_requests(self, request_ids: Sequence[str], error: BaseException) -> list[RequestOutput]:
        """End the unfinished ones of ``request_ids`` because of ``error``: free their blocks, record them
        finished with reason ``"error"``; returns their final outputs (``finish_reason="error"``, ``error`` the
        message)."""
        message = f"the step running this request failed: {type(error).__name__}: {error}"
        now = self.clock()
        outputs = []
        for rid in request_ids:
            entry = self._entries.get(rid)
            if entry is None or rid not in self.scheduler.requests:
                continue
            self.scheduler.abort(rid)
            entry.request.finish_reason = "error"
            self.metrics.finish(rid, now, "error")
            self._release(rid)
            out = self._output(entry, [], "")
            out.error = message
            outputs.append(out)
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

    def _run(self, out: SchedulerOutput) -> StepResult:
        if out.is_empty:
            return StepResult({}, {})
        entries = self._entries
        sampling = [entries[s.request_id] for s in out.scheduled if s.sample]
        banned = {e.request.request_id: e.banned for e in sampling
                  if e.banned and len(e.request.output_token_ids) < e.params.min_tokens}
        params = {e.request.request_id: e.params for e in sampling}
        if self.workers is not None:
            return self.workers.execute(self.runner, out, params, banned)
        # banned only when a request needs it, so code that wraps execute(out, params) to time it keeps working
        return self.runner.execute(out, params, banned=banned) if banned else self.runner.execute(out, params)

    def _postprocess(self, out: SchedulerOutput, result: StepResult, start: float, scheduled: float
                     ) -> list[RequestOutput]:
        finished = self.scheduler.update(out, result.tokens)
        end = self.clock()
        if out.is_empty:
            return []
        self.metrics.record_step(out, start, scheduled, end, finished, prepare_time=result.prepare_time,
                                 forward_time=result.forward_time, sample_time=result.sample_time)
        self.scheduler.observe(out, end - start)
        outputs = []
        for rid, token in result.tokens.items():
            entry = self._entries.get(rid)
            if entry is None:
                continue
            new_logprobs = None
            if entry.logprobs is not None:
                new_logprobs = [result.logprobs.get(rid)]
                entry.logprobs.append(new_logprobs[0])
            req = entry.request
            text = entry.detokenizer.update(req.finish_reason is not None)
            if entry.detokenizer.stop_reason is not None and req.finish_reason is None:
                self._stop_on_string(req, end)
            outputs.append(self._output(entry, [token], text, new_logprobs))
            if req.finish_reason is not None:
                self._release(rid)
        return outputs

    def _stop_on_string(self, req: Request, now: float) -> None:
        """End ``req`` because its text matched a stop string: free its blocks, record ``"stop"``."""
        self.scheduler.abort(req.request_id)
        req.finish_reason = "stop"
        self.metrics.finish(req.request_id, now, "stop")

    def _output(self, entry: _Entry, new_token_ids: list[int], new_text: str,
                new_logprobs: list[Any] | None = None) -> RequestOutput:
        req = entry.request
        out = RequestOutput(req.request_id, entry.prompt, req.prompt_token_ids, new_token_ids, new_text,
                            len(req.output_token_ids), req.finish_reason, entry.metrics, new_logprobs,
                            entry.detokenizer.stop_reason)
        if req.finish_reason is not None:
            out.token_ids = req.output_token_ids
            out.text = entry.detokenizer.text
            out.logprobs = entry.logprobs
        return out

    def _release(self, request_id: str) -> None:
        self._entries.pop(request_id, None)
        self.runner.release(request_id)

    # ------------------------------------------------------------------ helpers

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (idempotent; also runs when the engine is
        collected and at interpreter exit). The engine cannot step afterwards."""
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
        token_ids = list(prompt)
        vocab = self.model_config.vocab_size
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"request {request_id!r}: token id {t!r} is outside the vocabulary [0, {vocab})")
        return None, token_ids


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
        # The cost models live in sim/, above the engine; loading one from its spec is the one use the engine
        # makes of them, at construction, so it imports the loader here rather than at module level.
        from sarathi_lite.sim.simulator import load_cost_model

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
