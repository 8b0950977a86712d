"""``EngineConfig``: every engine option in one validated dataclass, with the one default each option has."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarathi_lite.scheduler import SchedulerConfig

DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
LOAD_FORMATS = ("auto", "dummy")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

# The SchedulerConfig fields an engine passes through unchanged (num_blocks and max_model_len it derives).
SCHEDULER_FIELDS = ("policy", "chunk_size", "max_num_seqs", "max_num_batched_tokens", "block_size", "watermark",
                    "max_num_partial_prefills", "long_prefill_token_threshold", "max_long_partial_prefills")


@dataclass(slots=True)
class EngineConfig:
    """What an ``LLMEngine`` runs and how. Sizes in tokens unless named otherwise.

    model: a built-in name (``None``: the embedded ``"smollm2-135m"``) or a local Hugging Face checkpoint folder.
    policy: the scheduler policy (``sarathi``, ``vllm``, ``orca``, ``request_level``, ``simple_chunking``);
        ``LLM``/``LLMEngine`` take it as ``scheduler=``.
    chunk_size: token budget per iteration (chunked policies). max_num_seqs: most running requests.
    max_num_batched_tokens, watermark, max_num_partial_prefills, long_prefill_token_threshold,
        max_long_partial_prefills: as in ``SchedulerConfig``.
    block_size: tokens per KV block. num_kv_blocks: KV pool size in blocks; ``None`` derives it from
        ``kv_cache_memory`` bytes (default 1 GiB on CPU) or, on CUDA, ``gpu_memory_utilization`` of the card.
    max_model_len: most tokens per request (``None``: the model's ``max_position_embeddings``, capped by the pool).
    dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), ``"float32"``, ``"bfloat16"``, ``"float16"``.
    device: ``None`` (CUDA when available) or a torch device string.
    attention_backend: ``"auto"`` (FlashInfer on CUDA when usable, else torch), ``"torch"``, ``"flashinfer"``.
    load_format: ``"auto"`` (safetensors) or ``"dummy"`` (random weights, for benchmarking model shapes).
    record_batches: keep every iteration's batch composition in the iteration records.
    tensor_parallel_size: ranks the model is sharded over (Megatron-style); rank 0 is this process, ranks 1.. are
        worker processes the engine spawns (or ``torchrun`` launched). Each rank holds 1/N of the weights and KV
        heads, on ``cuda:<rank>`` on CUDA.
    """

    model: str | None = None
    policy: str = "sarathi"
    chunk_size: int = 512
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    watermark: float = 0.01
    max_num_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None
    max_long_partial_prefills: int = 1
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str | None = None
    attention_backend: str = "auto"
    load_format: str = "auto"
    record_batches: bool = False
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.model, Path):
            self.model = str(self.model)
        if self.dtype is None:
            self.dtype = "auto"
        if not isinstance(self.dtype, str):  # a torch.dtype
            self.dtype = str(self.dtype).removeprefix("torch.")
        if self.device is not None and not isinstance(self.device, str):  # a torch.device
            self.device = str(self.device)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        # The scheduler's own checks, on a stand-in length: the real max_model_len is known once the model is.
        self.scheduler_config(num_blocks=self.num_kv_blocks, max_model_len=1)

    def scheduler_config(self, num_blocks: int | None, max_model_len: int) -> SchedulerConfig:
        """The ``SchedulerConfig`` of this engine once its KV pool and ``max_model_len`` are known."""
        return SchedulerConfig(**{f: getattr(self, f) for f in SCHEDULER_FIELDS}, num_blocks=num_blocks,
                               max_model_len=max_model_len)

    @classmethod
    def from_options(cls, model: Any = None, **options: Any) -> EngineConfig:
        """The config of ``LLMEngine(model, **options)``: ``scheduler=`` names the policy; unknown options raise
        ``TypeError`` naming them."""
        if "scheduler" in options:
            options["policy"] = options.pop("scheduler")
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(model=model, **options)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some options changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
