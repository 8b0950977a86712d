"""vLLM's own scheduler, model-free: the installed release's ``Scheduler`` / ``AsyncScheduler`` (or the plugin's
``SarathiScheduler``) built from a ``VllmConfig`` over a local tiny model configuration (a ``config.json`` only: no
weights, no hub, no tokenizer) and a ``KVCacheConfig`` of ``num_blocks`` blocks, driven step by step as vLLM's
engine core drives it, with synthetic model outputs: each request that finishes its known tokens in a step samples
one token, ``token_of(request_id, index)``, so two schedulers given the same requests must emit the same tokens.
With speculative decoding (``num_speculative_tokens``), each decode may carry draft tokens: synchronously the
harness proposes them after each step as vLLM's drafter does (``update_draft_token_ids``; a draft is right where
``draft_is_right`` says, else a wrong token, and a few steps propose none), under async scheduling vLLM schedules
placeholders for them; the model accepts the leading right drafts and samples one token past them, so the tokens
emitted are the same ``token_of`` sequence whatever was drafted.

``Harness.step`` is one engine-core step: synchronous (schedule, run, update), or with async scheduling as
``EngineCore.step_with_batch_queue`` with a queue of two (schedule the next step before the previous one's output
is processed). Each step returns a ``StepRecord``: what was scheduled and the state the decision saw. The contract
tests (tests/vllm_harness/) and ``sarathi-lite sim --policies vllm@X.Y`` (``sarathi_lite.integrations.vllm.simclock``)
run on it, on the CPU, for every supported release.
"""

from __future__ import annotations

import json
import os
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local folder: never ask the hub

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig  # noqa: E402, E501
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from .version import adapter  # noqa: E402

VOCAB = 512
"""The tiny model's vocabulary; sampled tokens are 3..VOCAB-1."""
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
              "vocab_size": VOCAB, "max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "bos_token_id": 1,
              "eos_token_id": 2, "torch_dtype": "float32"}
"""A tiny Llama's configuration: all vLLM's ``ModelConfig`` reads (the scheduler never sees the weights)."""


def tiny_model(folder: Path) -> Path:
    """Write ``config.json`` of ``TINY_LLAMA`` into ``folder`` (made if missing) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA), encoding="utf-8")
    return folder


def token_of(request_id: str, index: int) -> int:
    """The synthetic model's ``index``-th output token of ``request_id`` (deterministic, never 0-2)."""
    return 3 + zlib.crc32(f"{request_id}:{index}".encode()) % (VOCAB - 3)


def draft_is_right(request_id: str, index: int) -> bool:
    """Whether the synthetic drafter guesses ``request_id``'s ``index``-th output token right (three in four)."""
    return zlib.crc32(f"d{request_id}:{index}".encode()) % 4 != 0


def drafts_of(request_id: str, first: int, count: int) -> list[int]:
    """The synthetic drafter's ``count`` guesses of ``request_id``'s output tokens ``first`` on (none on one step in
    five, as an n-gram drafter finds no match)."""
    if zlib.crc32(f"n{request_id}:{first}".encode()) % 5 == 0:
        return []
    right = [token_of(request_id, i) for i in range(first, first + count)]
    return [t if draft_is_right(request_id, i) else 3 + (t - 2) % (VOCAB - 3) for i, t in enumerate(right, first)]


@dataclass(slots=True)
class StepRecord:
    """One engine-core step. ``scheduled``: request id -> tokens scheduled (empty on a step that only processed
    an output); ``decodes``: the running requests that were decoding when the step was scheduled and that vLLM
    could schedule (not held back by async scheduling at their last token); ``prefills``: the requests
    scheduled with prompt tokens (a prefill chunk); ``preempted``: ids vLLM preempted; ``finished``: request id ->
    finish reason of the requests whose output this step processed to the end; ``computed``: each scheduled
    request's tokens computed before the step (its context); ``sampled``: the scheduled requests that sample a
    token in it; ``drafts``: request id -> draft tokens scheduled (speculative decoding; counted in ``scheduled``);
    ``time``: the simulated clock after the step (``None`` without a step-time model)."""

    index: int
    scheduled: dict[str, int]
    decodes: list[str]
    prefills: list[str]
    preempted: list[str]
    finished: dict[str, str] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    sampled: set[str] = field(default_factory=set)
    drafts: dict[str, int] = field(default_factory=dict)
    time: float | None = None


class Harness:
    """One scheduler of the installed vLLM under a model-free engine loop.

    scheduler: ``"default"`` (vLLM's ``Scheduler``, or ``AsyncScheduler`` with ``async_scheduling``) or
    ``"plugin"`` (``SarathiScheduler`` with ``plugin_options`` as ``additional_config["sarathi_lite"]``).
    scheduler_fields: further vLLM ``SchedulerConfig`` fields (``long_prefill_token_threshold_adaptive``, ...).
    num_speculative_tokens: speculative decoding's draft tokens per step (vLLM's n-gram method; 0: off).
    Raises what vLLM or the plugin raise for a bad configuration (the plugin's ``ValueError`` names the option; vLLM's
    for a speculative method its async scheduling does not run with).
    """

    def __init__(self, model: Path, *, scheduler: str = "default", async_scheduling: bool = False,
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 16, max_model_len: int = 4096,
                 block_size: int = 16, num_blocks: int = 2000, enable_prefix_caching: bool = False,
                 plugin_options: Mapping[str, Any] | None = None, num_speculative_tokens: int = 0,
                 **scheduler_fields: Any) -> None:
        self._release = adapter(vllm.__version__)  # refuses an unsupported release
        if scheduler not in ("default", "plugin"):
            raise ValueError(f"scheduler={scheduler!r} is not 'default' or 'plugin'")
        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, enable_chunked_prefill=True,
                                async_scheduling=async_scheduling, is_encoder_decoder=False, **scheduler_fields)
        model_config = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", seed=0,
                                   max_model_len=max_model_len)
        cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
        additional = {"sarathi_lite": dict(plugin_options or {})} if scheduler == "plugin" else {}
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=num_speculative_tokens, prompt_lookup_max=4,
                                 prompt_lookup_min=2) if num_speculative_tokens else None
        # the device named: a CUDA wheel on a machine without a GPU cannot infer one, and the scheduler needs none
        self.vllm_config = VllmConfig(scheduler_config=sched, model_config=model_config, cache_config=cache,
                                      device_config=DeviceConfig(device="cpu"), additional_config=additional,
                                      speculative_config=spec)
        # vLLM's CPU platform turns async scheduling off (0.32 has only a CPU build here): the scheduler code runs
        # as the release's GPU build runs it, which a scheduler reads from this flag
        self.vllm_config.scheduler_config.async_scheduling = async_scheduling
        self.num_speculative_tokens = num_speculative_tokens
        cache.num_gpu_blocks = num_blocks
        attention = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32)
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec(["layer"], attention)])
        if scheduler == "plugin":
            from .scheduler import SarathiScheduler as cls
        else:
            cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = cls(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                             structured_output_manager=StructuredOutputManager(self.vllm_config),
                             block_size=block_size, log_stats=False)
        hash_fn = _hash_fn(cache)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(block_size, hash_fn)
        self.async_scheduling = async_scheduling
        self.num_blocks = num_blocks
        self._queue: deque[tuple[Any, set[str], StepRecord]] = deque()  # steps scheduled, output not yet processed
        self.steps: list[StepRecord] = []
        self.tokens: dict[str, list[int]] = {}  # request id -> output tokens emitted
        self.finish_reasons: dict[str, str] = {}
        self.prompts: dict[str, list[int]] = {}  # request id -> prompt token ids
        self.arrived: dict[str, int] = {}  # request id -> index of the first step it could be scheduled in

    # ------------------------------------------------------------------ requests

    def add(self, request_id: str, prompt: int | list[int], max_tokens: int, stop_at: int | None = None, *,
            arrival: float | None = None) -> None:
        """Add a request of ``prompt`` tokens (a count: tokens drawn from its id) that generates ``max_tokens``
        (or stops at its ``stop_at``-th output token, which the synthetic model makes a stop token)."""
        tokens = prompt if isinstance(prompt, list) else [
            3 + zlib.crc32(f"p{request_id}:{i}".encode()) % (VOCAB - 3) for i in range(prompt)]
        stop = [token_of(request_id, stop_at)] if stop_at is not None else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop, detokenize=False)
        request = Request(request_id, tokens, params, None, arrival_time=arrival, block_hasher=self._hasher)
        self.tokens[request_id] = []
        self.prompts[request_id] = tokens
        self.arrived[request_id] = len(self.steps)
        self.scheduler.add_request(request)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests as the engine core does on a client's cancel (finish reason ``"abort"``; the engine core,
        not the scheduler, reports them)."""
        live = [rid for rid in request_ids if rid in self.scheduler.requests]
        self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        self.finish_reasons.update(dict.fromkeys(live, "abort"))

    # ------------------------------------------------------------------ the loop

    def step(self, ran: Callable[[StepRecord], None] | None = None) -> StepRecord | None:
        """One engine-core step (``None`` when there was nothing to schedule or process).

        ran: called with the record of the step whose output is processed next, just before vLLM's
        ``update_from_output`` sees it (the model has run: a simulated clock advances by its step time here, so a
        scheduler that times its steps reads the step's end)."""
        sched = self.scheduler
        record = None
        if sched.has_requests():
            decoding = {r.request_id for r in sched.running if _is_decode(r)}
            decodes = self._decodes()
            output = sched.schedule()
            sampling = {rid for rid in output.num_scheduled_tokens if not sched.requests[rid].is_prefill_chunk}
            scheduled = dict(output.num_scheduled_tokens)
            record = StepRecord(len(self.steps), scheduled, decodes, [rid for rid in scheduled if rid not in decoding],
                                sorted(output.preempted_req_ids or ()), computed={
                                    rid: sched.requests[rid].num_computed_tokens - n for rid, n in scheduled.items()},
                                sampled=sampling, drafts={rid: len(tokens) for rid, tokens in
                                                          (output.scheduled_spec_decode_tokens or {}).items()})
            self.steps.append(record)
            self._queue.appendleft((output, sampling, record))
            if self.async_scheduling and len(self._queue) < 2 and (
                    output.total_num_scheduled_tokens > 0 or sched.has_requests()):
                return record
        elif not self._queue:
            return None
        output, sampling, ran_record = self._queue.pop()
        if ran is not None:
            ran(ran_record)
        finished = self._process(output, sampling)
        if record is None:
            record = StepRecord(len(self.steps), {}, [], [], [])
            self.steps.append(record)
        record.finished.update(finished)
        return record

    def run(self, arrivals: Mapping[int, Iterable[tuple]] | None = None, max_steps: int = 100_000
            ) -> list[StepRecord]:
        """Step until every request has finished; ``arrivals``: step index -> ``add`` argument tuples
        ``(request_id, prompt, max_tokens[, stop_at])`` added before that step."""
        arrivals = dict(arrivals or {})
        for i in range(max_steps):
            for args in arrivals.pop(i, ()):
                self.add(*args)
            if self.step() is None and not arrivals:
                return self.steps
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")

    def drain(self) -> None:
        """Process every scheduled step's output and let vLLM free what it defers."""
        for _ in range(8):
            if self.step() is None and not self._queue:
                break

    @property
    def prompt_lens(self) -> dict[str, int]:
        """Request id -> prompt tokens."""
        return {rid: len(tokens) for rid, tokens in self.prompts.items()}

    def prefill_done(self) -> dict[str, int]:
        """Request id -> index of the step that scheduled its prompt's last token (the step that samples its first
        output token), for the requests whose prompt was computed."""
        done: dict[str, int] = {}
        computed: dict[str, int] = {}
        lens = self.prompt_lens
        for record in self.steps:
            for rid, n in record.scheduled.items():
                computed[rid] = computed.get(rid, 0) + n
                if rid not in done and computed[rid] >= lens[rid]:
                    done[rid] = record.index
        return done

    def free_blocks(self) -> int:
        """Blocks in vLLM's free queue (a whole pool: ``num_blocks - 1``, the null block never being free)."""
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def blocks_held(self) -> list[int]:
        """Ids of the pool's blocks with a reference (the null block aside)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return [b.block_id for b in pool.blocks if b.ref_cnt > 0 and not b.is_null]

    # ------------------------------------------------------------------ internals

    def _decodes(self) -> list[str]:
        """Running requests with their prompt computed that vLLM may schedule this step (under async
        scheduling vLLM skips a request whose step in flight already reaches its ``max_tokens``)."""
        out = []
        for r in self.scheduler.running:
            if not _is_decode(r):
                continue
            if r.num_output_placeholders > 0 and (r.num_computed_tokens + 2 - r.num_output_placeholders
                                                  >= r.num_prompt_tokens + r.max_tokens):
                continue
            out.append(r.request_id)
        return out

    def _process(self, output: Any, sampling: set[str]) -> dict[str, str]:
        sched = self.scheduler
        ids = list(output.num_scheduled_tokens)
        sampled = []
        drafts = output.scheduled_spec_decode_tokens or {}
        for rid in ids:
            request = sched.requests.get(rid)
            n = len(request.output_token_ids) if request is not None else 0
            # the leading right drafts are accepted (a placeholder, under async scheduling, by draft_is_right)
            accepted = 0
            for j, token in enumerate(drafts.get(rid, ())):
                if not (token == token_of(rid, n + j) if token >= 0 else draft_is_right(rid, n + j)):
                    break
                accepted += 1
            sampled.append([token_of(rid, n + i) for i in range(accepted + 1)] if rid in sampling else [])
        index = {"req_id_to_index": {rid: i for i, rid in enumerate(ids)}} if self._release.RUNNER_OUTPUT_INDEX else {}
        runner = ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **index)
        finished = {}
        for outputs in sched.update_from_output(output, runner).values():
            for o in outputs.outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    reason = str(o.finish_reason)
                    finished[o.request_id] = self.finish_reasons[o.request_id] = reason
        if self.num_speculative_tokens and not self.async_scheduling:  # the drafter, after the step (engine core)
            live = [rid for rid in ids if rid in sched.requests and not sched.requests[rid].is_finished()]
            sched.update_draft_token_ids(DraftTokenIds(live, [
                drafts_of(rid, len(sched.requests[rid].output_token_ids), self.num_speculative_tokens)
                for rid in live]))
        return finished


def _is_decode(request: Request) -> bool:
    """Whether ``request`` has its prompt (and any recomputed output) computed and is generating."""
    return (request.num_output_tokens + request.num_output_placeholders > 0
            and request.num_computed_tokens >= request.num_tokens - 1)


def _hash_fn(cache: CacheConfig) -> Any:
    """The prefix-cache hash function vLLM's engine core uses for ``cache``."""
    from vllm.utils.hashing import get_hash_fn_by_name

    return get_hash_fn_by_name(cache.prefix_caching_hash_algo)
