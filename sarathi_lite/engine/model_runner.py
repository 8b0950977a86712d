"""Turns a ``SchedulerOutput`` into one forward pass: flat inputs, attention metadata, logits, samples."""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import torch

from sarathi_lite.costs.memory import device_kv_budget
from sarathi_lite.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, KVPool
from sarathi_lite.engine.sampler import History, Sampler
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.kernels import AttentionBackend, build_attention_metadata, get_attention_backend
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.models.interface import CausalLM
from sarathi_lite.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepResult:
    """Sampled tokens (and logprobs when asked) of one step, keyed by request id, and where the step's host
    time went (seconds): building inputs and attention metadata, the forward pass with the logits of the
    sampling rows (on CUDA: their launch; the wait shows up in sampling), and sampling. stage_busy: under pipeline
    parallelism, the seconds each stage spent on the step's micro-batch."""

    tokens: dict[str, int]
    logprobs: dict[str, Any]
    prepare_time: float = 0.0
    forward_time: float = 0.0
    sample_time: float = 0.0
    stage_busy: tuple[float, ...] = ()


class ForwardPass(NamedTuple):
    """One forward pass (``ModelRunner.forward``): the sampling rows' logits ``[len(rows), vocab]`` float32 (``None``
    when no row samples, and on ranks that do not sample), ``rows`` (indices into the batch's rows that sample),
    and the seconds spent building inputs and running the model."""

    logits: torch.Tensor | None
    rows: list[int]
    prepare_time: float
    forward_time: float


def runner_view(model: CausalLM) -> CausalLM:
    """A copy of ``model``'s module tree that shares everything else (weights, buffers, the rotary cache, the
    config), for a second ``ModelRunner`` on loaded weights (``LLMEngine.from_model``): each runner binds its
    own KV cache and attention backends into its model's attention layers once, so no runner rebinds
    another's."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for module in model.modules():
        for name, value in vars(module).items():
            # public attributes, and every tensor (a projection's packed weight is an opaque oneDNN tensor that
            # cannot be deep-copied, and must be shared like the weight it copies)
            if isinstance(value, torch.Tensor) or not (name.startswith("_") or isinstance(value, torch.nn.Module)):
                memo[id(value)] = value
    return copy.deepcopy(model, memo)


def rank_kv_pool(config: EngineConfig, model_config: ModelConfig, tensor_parallel_size: int, dtype: torch.dtype,
                 device: torch.device) -> KVPool:
    """The KV pool ``config`` gives on this rank's ``device`` (whose K/V per token are its own KV heads').
    Raises ``ValueError`` naming the option when ``num_kv_blocks`` or ``kv_cache_memory`` asks for more memory than
    the device has free, before anything is allocated."""
    per_token = model_config.kv_bytes_per_token(dtype.itemsize, tensor_parallel_size)
    pool = config.kv_pool(kv_bytes_per_token=per_token, max_position_embeddings=model_config.max_position_embeddings,
                          kv_cache_memory=default_kv_budget(config, device))
    _check_kv_fits(config, pool.num_blocks * pool.block_size * per_token, device)
    if pool.kv_cache_memory is not None:
        logger.info("KV pool from a %.0f MiB budget: %d blocks of %d tokens", pool.kv_cache_memory / 2**20,
                    pool.num_blocks, pool.block_size)
    return pool


def default_kv_budget(config: EngineConfig, device: torch.device) -> int | None:
    """The KV pool's byte budget on ``device`` (this rank's) when the options give none: on CUDA what
    ``gpu_memory_utilization`` leaves of the free memory, on CPU ``DEFAULT_CPU_KV_CACHE_BYTES`` (``None`` when the
    options size the pool)."""
    if config.num_kv_blocks is not None or config.kv_cache_memory is not None:
        return None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return device_kv_budget(free, total, config.gpu_memory_utilization)
    return DEFAULT_CPU_KV_CACHE_BYTES


def _check_kv_fits(config: EngineConfig, needed: int, device: torch.device) -> None:
    """Refuse a KV pool of ``needed`` bytes that the options size (``num_kv_blocks``, ``kv_cache_memory``) when
    ``device`` has less memory free (the default budget is sized from the device already)."""
    option = "num_kv_blocks" if config.num_kv_blocks is not None else \
        "kv_cache_memory" if config.kv_cache_memory is not None else None
    free = None if option is None else free_memory(device)
    if free is not None and needed > free:
        raise ValueError(f"{option}={getattr(config, option)} needs {needed / 2**30:.4g} GiB for the KV pool "
                         f"({needed} bytes), more than the {free / 2**30:.4g} GiB free on {device}: lower {option}")


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device``: CUDA's free memory, the host's available memory (``MemAvailable``, else its
    physical memory) for the CPU; ``None`` for other devices."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class ModelRunner:
    """Owns the paged KV cache and runs the model over one hybrid batch per ``execute`` call. It binds its KV
    cache and attention backends into ``model``'s attention layers once, here: a model that another runner
    uses must be given as a ``runner_view``.

    kv cache: one tensor ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``; layer ``i``'s
    attention reads and writes its view ``[i]`` (FlashInfer's NHD paged layout). ``num_kv_heads`` (and the
    backends' query heads) are the model's on this rank: a tensor-parallel shard runs the same code on its heads.
    """

    def __init__(self, model: CausalLM, *, block_size: int, num_blocks: int, device: torch.device,
                 dtype: torch.dtype, attention_backend: str = "auto") -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_cache = torch.zeros(cfg.num_layers, num_blocks, 2, block_size, model.num_kv_heads, cfg.head_dim,
                                    dtype=dtype, device=device)
        self.backends: dict[int, AttentionBackend] = {
            w: get_attention_backend(attention_backend, model.num_heads, model.num_kv_heads, cfg.head_dim,
                                     window_left=w, device=device, dtype=dtype)
            for w in sorted(set(cfg.layer_windows))
        }
        self.attention_backend = next(iter(self.backends.values())).name
        self.sampler = Sampler(device)
        for attn, window in zip(self.model.attention_layers(), cfg.layer_windows):
            attn.backend = self.backends[window]
        for i, attn in enumerate(self.model.attention_layers()):
            attn.kv_cache = self.kv_cache[i]
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB), attention backend %s", num_blocks, block_size,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**20, self.attention_backend)

    def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the K/V in ``block_ids``, every layer: ``[num_layers, len(block_ids), 2, block_size,
        num_kv_heads, head_dim]`` in the cache's dtype, on the CPU (to send to another instance)."""
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=self.kv_cache.device)
        return self.kv_cache.index_select(1, index).cpu()

    def import_blocks(self, block_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Write ``kv`` (as ``export_blocks`` gives it, for ``len(block_ids)`` blocks) into ``block_ids``. Raises
        ``ValueError`` naming the shapes when ``kv`` does not fit this cache's layout."""
        expected = (self.kv_cache.shape[0], len(block_ids), *self.kv_cache.shape[2:])
        if tuple(kv.shape) != expected:
            raise ValueError(f"import_blocks: K/V of shape {tuple(kv.shape)} does not fit {len(block_ids)} blocks of "
                             f"this cache (expected {expected})")
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=self.kv_cache.device)
        self.kv_cache.index_copy_(1, index, kv.to(self.kv_cache.device, self.kv_cache.dtype))

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's per-request state (its seeded sampling generator)."""
        self.sampler.forget(request_id)

    def execute(self, out: SchedulerOutput, params: Mapping[str, SamplingParams],
                banned: Mapping[str, Sequence[int]] | None = None, history: Mapping[str, History] | None = None
                ) -> StepResult:
        """Run ``out``'s batch in one forward pass and sample the rows that end their known tokens.
        banned: token ids a request's row must not sample this step (``min_tokens``). history: the penalized
        requests' ``(prompt, output)`` token ids (see ``Sampler``)."""
        logits, rows, prepare_time, forward_time = self.forward(out)
        return self.sample(out, logits, rows, params, banned, prepare_time, forward_time, history)

    def sample(self, out: SchedulerOutput, logits: torch.Tensor | None, rows: list[int],
               params: Mapping[str, SamplingParams], banned: Mapping[str, Sequence[int]] | None = None,
               prepare_time: float = 0.0, forward_time: float = 0.0, history: Mapping[str, History] | None = None
               ) -> StepResult:
        """Sample the ``rows`` of ``out`` (indices into ``out.scheduled``) from their ``logits`` ([len(rows),
        vocab] float32, as ``forward`` gives them; ``None`` when no row samples)."""
        if logits is None:
            return StepResult({}, {}, prepare_time, forward_time)
        t2 = time.perf_counter()
        ids = [out.scheduled[i].request_id for i in rows]
        tokens, logprobs = self.sampler(logits, ids, [params[rid] for rid in ids], banned, history)
        return StepResult(dict(zip(ids, tokens)),
                          {} if logprobs is None else {rid: lp for rid, lp in zip(ids, logprobs) if lp is not None},
                          prepare_time, forward_time, time.perf_counter() - t2)

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> ForwardPass:
        """The forward pass of ``out``'s batch: ``(logits [len(rows), vocab] float32, rows, prepare seconds,
        forward seconds)``, ``rows`` the indices into ``out.scheduled`` that sample. Logits are ``None`` when no
        row samples, and on tensor-parallel ranks other than 0 (they take part in the same collectives)."""
        t0 = time.perf_counter()
        scheduled = out.scheduled
        q_lens = [s.num_new_tokens for s in scheduled]
        kv_lens = [s.num_computed_tokens + s.num_new_tokens for s in scheduled]
        meta = build_attention_metadata(q_lens, kv_lens, [s.block_table for s in scheduled], self.block_size,
                                        self.device)
        for backend in self.backends.values():
            backend.plan(meta)
        input_ids = torch.tensor(list(chain.from_iterable(s.token_ids for s in scheduled)), dtype=torch.int64
                                 ).to(self.device, non_blocking=True)
        rows = [i for i, s in enumerate(scheduled) if s.sample]
        last = torch.from_numpy(meta.qo_indptr_host[1:][rows].astype(np.int64) - 1).to(self.device)
        t1 = time.perf_counter()
        hidden = self.model(input_ids, meta.positions)
        logits = self.model.compute_logits(hidden.index_select(0, last)) if rows else None
        return ForwardPass(logits, rows, t1 - t0, time.perf_counter() - t1)
