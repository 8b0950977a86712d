"""``EngineConfig``: every engine option in one validated dataclass, with the one default each option has."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sarathi_lite.scheduler import POLICIES, SchedulerConfig

DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
LOAD_FORMATS = ("auto", "dummy")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

_SCHEDULER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}


def _scheduler_option(name: str, help_text: str, **metadata: Any) -> Any:
    """A field the engine passes to ``SchedulerConfig``, with the scheduler's default (one default per option)."""
    return field(default=_SCHEDULER_DEFAULTS[name], metadata={"help": help_text, **metadata})


def parse_chunk_size(text: str) -> int | str:
    """A chunk size from text: a token count, or ``"auto"``. Raises ``ValueError`` naming other text."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"chunk size {text!r} is neither a token count nor 'auto'") from None


@dataclass(slots=True)
class EngineConfig:
    """What an ``LLMEngine`` runs and how: every engine option, validated, with its one default. Sizes in tokens
    unless named otherwise; each field's ``metadata["help"]`` says what it means (the CLI's ``--help`` shows it).

    ``LLM``/``LLMEngine`` take ``policy`` as ``scheduler=`` (and so does the CLI: ``--scheduler``). Field metadata
    read by ``sarathi_lite.cli.common``: ``help``; ``choices``; ``flag`` (the option's name when it is not the
    field's); ``type`` (a parser from the command-line text, when the annotation's type is not one).
    """

    model: str | None = field(default=None, metadata={
        "help": "a built-in name (default: the embedded smollm2-135m) or a local Hugging Face checkpoint folder"})
    policy: str = _scheduler_option("policy", "the batching policy", flag="scheduler", choices=POLICIES)
    chunk_size: int | str = _scheduler_option(
        "chunk_size", "token budget per iteration of the chunked policies (sarathi, simple_chunking), or auto: "
        "each iteration's budget chosen so the step cost_model predicts fits tbt_slo", type=parse_chunk_size)
    max_num_seqs: int = _scheduler_option("max_num_seqs", "most requests running (holding KV blocks) at once")
    max_num_batched_tokens: int | None = _scheduler_option(
        "max_num_batched_tokens",
        "token budget per iteration of the unchunked policies (default: max(max_model_len, 2048))")
    block_size: int = _scheduler_option("block_size", "tokens per KV block")
    watermark: float = _scheduler_option(
        "watermark", "fraction of the KV pool kept free when admitting a request while others run")
    max_num_partial_prefills: int | None = _scheduler_option(
        "max_num_partial_prefills", "most prompts mid-prefill at once (default: no limit beyond max_num_seqs)")
    long_prefill_token_threshold: int | None = _scheduler_option(
        "long_prefill_token_threshold", "prompts with more prefill tokens than this are long (default: with "
        "hol_protection, 4 x chunk_size; without, no prompt is long, and a long prompt's chunk is capped at it)")
    max_long_partial_prefills: int = _scheduler_option(
        "max_long_partial_prefills", "most long prompts mid-prefill at once")
    enable_prefix_caching: bool = _scheduler_option(
        "enable_prefix_caching", "reuse the KV blocks of prompt prefixes other requests computed (greedy outputs "
        "are the same either way)")
    hol_protection: bool = _scheduler_option(
        "hol_protection", "head-of-line protection: short prompts are admitted past long ones mid-prefill, which "
        "keep a share of the budget; iterations with no short prompt beside a long one are scheduled as without "
        "it (see SchedulerConfig.hol_protection); --no-hol-protection is the Sarathi-Serve paper's "
        "first-come-first-served policy")
    long_prefill_chunk: int | None = _scheduler_option(
        "long_prefill_chunk", "with hol_protection, cap long prompts at this many prefill tokens in an iteration "
        "shared with decodes or short prompts, for TBT under long-context attention (default: no cap)")
    tbt_slo: float | None = _scheduler_option(
        "tbt_slo", "with chunk_size auto: the time-between-tokens target of every iteration (seconds)")
    budget_safety: float = _scheduler_option(
        "budget_safety", "with chunk_size auto: the fraction of tbt_slo a predicted step may take (room for the "
        "step-to-step spread)")
    min_chunk_size: int = _scheduler_option(
        "min_chunk_size", "with chunk_size auto: prefill tokens granted every iteration a prompt waits, even past "
        "tbt_slo (so prompts never starve)")
    max_concurrent_batches: int = _scheduler_option(
        "max_concurrent_batches", "most batches in flight at once (pipeline stages, async scheduling); a request is "
        "in at most one of them")
    async_scheduling: bool = _scheduler_option(
        "async_scheduling", "overlap the CPU's scheduling of step N+1 and the processing of step N-1's outputs with "
        "step N's forward pass (a decode is scheduled before its input token is sampled)")
    cost_model: Any = field(default=None, metadata={
        "type": str, "sim": True,
        "help": "with chunk_size auto: the step-time model, a profile JSON (sarathi-lite profile) or "
                "roofline:HW[:MODEL] (from Python also any object with predict_step_time); every measured step "
                "corrects it online"})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "KV pool size in blocks (default: derived from kv_cache_memory, or on CUDA from "
                "gpu_memory_utilization)"})
    kv_cache_memory: int | None = field(default=None, metadata={
        "help": "bytes for the KV pool when num_kv_blocks is not given (default: 1 GiB on CPU; on CUDA what "
                "gpu_memory_utilization leaves)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "fraction of the CUDA device's memory the engine may use"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "most tokens per request (default: the model's max_position_embeddings, capped by the KV pool)"})
    dtype: str = field(default="auto", metadata={
        "choices": DTYPES, "help": "weights and KV cache dtype (auto: bfloat16 on CUDA, float32 on CPU)"})
    device: str | None = field(default=None, metadata={
        "help": "a torch device such as cpu or cuda (default: cuda when available)"})
    attention_backend: str = field(default="auto", metadata={
        "choices": ATTENTION_BACKENDS, "help": "auto: FlashInfer on CUDA when usable, else torch"})
    load_format: str = field(default="auto", metadata={
        "choices": LOAD_FORMATS, "help": "auto: safetensors; dummy: random weights (to benchmark model shapes)"})
    record_batches: bool = field(default=False, metadata={
        "help": "keep every iteration's batch composition in the iteration records"})
    stats_window: int | None = field(default=None, metadata={
        "help": "keep the records of only the last this many finished requests and iterations (bounded memory "
                "for a long-running server; stats() then covers that window; default: keep every record)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks the model is sharded over (Megatron-style): this process is rank 0, the engine spawns "
                "ranks 1.. as worker processes (or torchrun launched them); each holds 1/N of the weights and KV "
                "heads, on cuda:<rank> on CUDA"})
    pipeline_parallel_size: int = field(default=1, metadata={
        "help": "pipeline stages, each holding a contiguous range of the layers (times tensor_parallel_size "
                "ranks; the engine spawns them or torchrun launched them); up to this many micro-batches are in "
                "flight (max_concurrent_batches is raised to it), a request in at most one"})

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
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len", "stats_window", "tensor_parallel_size",
                     "pipeline_parallel_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.pipeline_parallel_size > 1 and self.async_scheduling:
            raise ValueError(f"async_scheduling: not with pipeline_parallel_size={self.pipeline_parallel_size} (a "
                             f"request's next decode needs the token its last micro-batch samples)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        if isinstance(self.cost_model, Path):
            self.cost_model = str(self.cost_model)
        if self.chunk_size == "auto" and self.cost_model is None:
            raise ValueError("chunk_size='auto' needs cost_model= (a profile JSON, roofline:HW[:MODEL], or an "
                             "object with predict_step_time) to choose each iteration's budget")
        # The scheduler's own checks, on a stand-in length: the real max_model_len is known once the model is.
        self.scheduler_config(num_blocks=self.num_kv_blocks, max_model_len=1)

    def kv_pool(self, *, kv_bytes_per_token: int | None, max_position_embeddings: int | None,
                kv_cache_memory: int | None = None) -> KVPool:
        """The KV pool and ``max_model_len`` these options give on a deployment: see ``kv_pool``."""
        return kv_pool(self, kv_bytes_per_token=kv_bytes_per_token, max_position_embeddings=max_position_embeddings,
                       kv_cache_memory=kv_cache_memory)

    def scheduler_config(self, num_blocks: int | None, max_model_len: int) -> SchedulerConfig:
        """The ``SchedulerConfig`` of this engine once its KV pool and ``max_model_len`` are known."""
        fields = {f: getattr(self, f) for f in SCHEDULER_FIELDS}
        # pipeline parallelism: one micro-batch in flight per stage
        fields["max_concurrent_batches"] = max(fields["max_concurrent_batches"], self.pipeline_parallel_size)
        return SchedulerConfig(**fields, num_blocks=num_blocks, max_model_len=max_model_len)

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


@dataclass(slots=True, frozen=True)
class KVPool:
    """An engine's KV pool: ``num_blocks`` blocks of ``block_size`` tokens, and the longest request it accepts
    (``max_model_len``, tokens); ``kv_cache_memory``: the byte budget it was sized from (``None`` when
    ``num_kv_blocks`` was given)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    kv_cache_memory: int | None = None


def device_kv_budget(free_memory: int, total_memory: int, utilization: float) -> int:
    """Bytes for the KV pool on a device with ``free_memory`` of ``total_memory`` bytes free once the weights
    are loaded: the rest after keeping ``1 - utilization`` of the device, at least 1 GiB, for activations."""
    return int(free_memory - max(total_memory * (1 - utilization), 1 << 30))


def kv_pool(config: EngineConfig, *, kv_bytes_per_token: int | None, max_position_embeddings: int | None,
            kv_cache_memory: int | None = None) -> KVPool:
    """The KV pool and ``max_model_len`` of ``config`` on a deployment, for the engine, the simulator and the
    roofline model alike (pure: no torch, no device).

    num_blocks: ``config.num_kv_blocks``, else the budget (``config.kv_cache_memory``, else ``kv_cache_memory``:
    the deployment's default, e.g. ``device_kv_budget`` of a GPU or ``DEFAULT_CPU_KV_CACHE_BYTES``) over
    ``kv_bytes_per_token * block_size``. max_model_len: ``config.max_model_len``, else
    ``max_position_embeddings`` (``None``: no limit) capped by the pool's tokens.
    Raises ``ValueError`` when the budget is unknown or holds no block, or ``max_model_len`` exceeds
    ``max_position_embeddings``.
    """
    block_size = config.block_size
    budget = None
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        budget = config.kv_cache_memory if config.kv_cache_memory is not None else kv_cache_memory
        if budget is None or kv_bytes_per_token is None:
            raise ValueError("the KV memory of this deployment is not known: give num_kv_blocks")
        per_block = kv_bytes_per_token * block_size
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block of {per_block} bytes")
    max_model_len = config.max_model_len
    if max_model_len is None:
        max_model_len = num_blocks * block_size
        if max_position_embeddings is not None:
            max_model_len = min(max_position_embeddings, max_model_len)
    elif max_position_embeddings is not None and max_model_len > max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={max_position_embeddings}")
    return KVPool(int(num_blocks), block_size, max_model_len, budget)


# The SchedulerConfig fields an engine passes through unchanged: every EngineConfig field of the same name
# (num_blocks and max_model_len it derives from num_kv_blocks and the model).
SCHEDULER_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig)
                         if f.name in {g.name for g in dataclasses.fields(SchedulerConfig)} - {"max_model_len"})


def default_option(name: str) -> Any:
    """The one default of ``EngineConfig``'s option ``name`` (e.g. ``chunk_size`` where a caller gives none)."""
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)
