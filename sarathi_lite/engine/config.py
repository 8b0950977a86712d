"""``EngineConfig``: every engine option, validated, with the one default each option has, nested by concern
(after vLLM's ``VllmConfig``): ``scheduler`` (a ``SchedulerConfig``), ``parallel`` (a ``ParallelConfig``),
``kv_transfer`` (a ``KVTransferConfig``) and the engine's own options (model, KV memory, dtype, device, ...).

Every field of a nested config is also an option of its own (flat) name: ``LLM(chunk_size=256)``,
``EngineConfig(policy="vllm")``, ``config.chunk_size``, ``config.replace(chunk_size=64)`` and ``--chunk-size`` all
reach ``config.scheduler.chunk_size``. ``OPTIONS`` lists every option by that name (a field added to a nested
config is an option, a keyword and a flag by itself); ``kv_transfer``'s are prefixed ``kv_`` (``kv_role``).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sarathi_lite.scheduler import POLICIES, SchedulerConfig
from sarathi_lite.scheduler.config import default_max_num_batched_tokens

DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flashinfer")
LOAD_FORMATS = ("auto", "dummy")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
KV_ROLES = ("producer", "consumer", "both")
KV_CONNECTORS = ("inprocess",)


def parse_chunk_size(text: str) -> int | str:
    """A chunk size from text: a token count, or ``"auto"``. Raises ``ValueError`` naming other text."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"chunk size {text!r} is neither a token count nor 'auto'") from None


@dataclass(slots=True)
class ParallelConfig:
    """How many ranks split the model, per kind of parallelism. Every field is a positive count of ranks with its
    ``metadata["help"]``: a new kind (pipeline, data) is one more field here, and it is an engine option, a
    keyword and a CLI flag by itself."""

    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks the model is sharded over (Megatron-style): this process is rank 0, the engine spawns ranks "
                "1.. as worker processes (or torchrun launched them); each holds 1/N of the weights and KV heads, "
                "on cuda:<rank> on CUDA"})
    pipeline_parallel_size: int = field(default=1, metadata={
        "help": "pipeline stages, each holding a contiguous range of the layers (times tensor_parallel_size ranks; "
                "the engine spawns them or torchrun launched them); up to this many micro-batches are in flight "
                "(max_concurrent_batches is raised to it), a request in at most one"})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_positive_int(f.name, getattr(self, f.name))


@dataclass(slots=True)
class KVTransferConfig:
    """Whether and how this engine exchanges KV blocks with other instances (disaggregated prefill/decode).

    role: ``None`` (no transfer, the default), ``"producer"`` (computes prompts' KV and sends it),
        ``"consumer"`` (receives KV that a producer computed) or ``"both"``.
    connector: the ``KVConnector`` implementation that moves the blocks (``"inprocess"``: between engines of
        one process, through a named store).
    store: the in-process connector's store name: engines that name the same store exchange blocks.
    """

    role: str | None = field(default=None, metadata={
        "choices": KV_ROLES, "help": "this engine's part in KV transfer between instances: producer (sends its "
                                     "prompts' KV), consumer (receives KV), both (default: none)"})
    connector: str = field(default="inprocess", metadata={
        "choices": KV_CONNECTORS, "help": "with kv_role: the connector that moves KV blocks between instances"})
    store: str = field(default="default", metadata={
        "help": "with kv_role and the inprocess connector: the store's name (engines naming one store exchange "
                "KV blocks)"})

    def __post_init__(self) -> None:
        if self.role is not None:
            _check_choice("kv_role", self.role, KV_ROLES)
        _check_choice("kv_connector", self.connector, KV_CONNECTORS)
        if not isinstance(self.store, str) or not self.store:
            raise ValueError(f"kv_store={self.store!r} must be a non-empty name")

    @property
    def is_producer(self) -> bool:
        """Whether this engine sends KV to others (role ``producer`` or ``both``)."""
        return self.role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        """Whether this engine receives KV from others (role ``consumer`` or ``both``)."""
        return self.role in ("consumer", "both")


# The nested configs: EngineConfig's field, its class, and the prefix of its fields' option names.
SECTIONS: dict[str, tuple[type, str]] = {"scheduler": (SchedulerConfig, ""), "parallel": (ParallelConfig, ""),
                                         "kv_transfer": (KVTransferConfig, "kv_")}
# Fields of a nested config that the engine sets itself, so they are no options: the scheduler's pool and
# longest request come from num_kv_blocks / the KV memory and from max_model_len / the model.
ENGINE_SET = {"scheduler": ("num_blocks", "max_model_len")}
# What the CLI needs beyond a nested field's own metadata: --scheduler names the policy; chunk_size's parser.
_CLI_METADATA: dict[str, dict[str, Any]] = {"policy": {"flag": "scheduler", "choices": POLICIES},
                                            "chunk_size": {"type": parse_chunk_size}}


def _scheduler_options(given: SchedulerConfig | None = None, **changes: Any) -> SchedulerConfig:
    """An engine's scheduler options: ``given``'s (or the defaults) with ``changes``, and the fields the engine
    sets (``ENGINE_SET``) not known yet (``None``), so the options are checked now and the rest once the engine
    knows its model and KV pool (``EngineConfig.scheduler_config``). A ``max_num_batched_tokens`` that ``given``
    derived from its own ``max_model_len`` is no choice: it is derived again from the engine's."""
    values: dict[str, Any] = {}
    if given is not None:
        values = {name: getattr(given, name) for name in SCHEDULER_FIELDS}
        if given.max_model_len is not None and given.max_num_batched_tokens == default_max_num_batched_tokens(
                given.max_model_len):
            values["max_num_batched_tokens"] = None
    return SchedulerConfig(**{**values, **changes}, **dict.fromkeys(ENGINE_SET["scheduler"]))


@dataclass(slots=True, kw_only=True)
class _EngineConfigFields:
    """``EngineConfig``'s fields, with their one default each, checked in ``__post_init__``; ``EngineConfig``
    adds the options' flat names (keywords and attributes)."""

    model: str | None = field(default=None, kw_only=False, metadata={
        "help": "a built-in name (default: the embedded smollm2-135m) or a local Hugging Face checkpoint folder"})
    scheduler: SchedulerConfig = field(default_factory=_scheduler_options)
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
        "choices": ATTENTION_BACKENDS, "help": "auto: FlashInfer on CUDA when usable; on the CPU, cpu (the "
                "torch path with decodes in a compiled kernel) when it builds; else torch"})
    load_format: str = field(default="auto", metadata={
        "choices": LOAD_FORMATS, "help": "auto: safetensors; dummy: random weights (to benchmark model shapes)"})
    record_batches: bool = field(default=False, metadata={
        "help": "keep every iteration's batch composition in the iteration records"})
    stats_window: int | None = field(default=None, metadata={
        "help": "keep the records of only the last this many finished requests and iterations (bounded memory "
                "for a long-running server; stats() then covers that window; default: keep every record)"})
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    def __post_init__(self) -> None:
        """Every check of the engine's own options (the nested configs check theirs), after taking the other
        spellings of a value: a ``Path`` for ``model``/``cost_model``, a ``torch.dtype``/``torch.device``."""
        if isinstance(self.model, Path):
            self.model = str(self.model)
        if self.dtype is None:
            self.dtype = "auto"
        if not isinstance(self.dtype, str):  # a torch.dtype
            self.dtype = str(self.dtype).removeprefix("torch.")
        if self.device is not None and not isinstance(self.device, str):  # a torch.device
            self.device = str(self.device)
        if isinstance(self.cost_model, Path):
            self.cost_model = str(self.cost_model)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len", "stats_window"):
            value = getattr(self, name)
            if value is not None:
                _check_positive_int(name, value)
        pp = self.parallel.pipeline_parallel_size
        if pp > 1 and self.scheduler.async_scheduling:
            raise ValueError(f"async_scheduling: not with pipeline_parallel_size={pp} (a "
                             f"request's next decode needs the token its last micro-batch samples)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        if self.scheduler.chunk_size == "auto" and self.cost_model is None:
            raise ValueError("chunk_size='auto' needs cost_model= (a profile JSON, roofline:HW[:MODEL], or an "
                             "object with predict_step_time) to choose each iteration's budget")


class EngineConfig(_EngineConfigFields):
    """What an ``LLMEngine`` runs and how: every engine option, validated, with its one default. Sizes in tokens
    unless named otherwise; each field's ``metadata["help"]`` says what it means (the CLI's ``--help`` shows it).

    scheduler: the scheduling options (a ``SchedulerConfig``). Its ``max_model_len`` and ``num_blocks`` are
        ``None`` (not known yet), and its ``max_num_batched_tokens`` is ``None`` unless given: the engine sets
        them once it knows the model and the KV pool (``scheduler_config``).
    parallel: a ``ParallelConfig``; kv_transfer: a ``KVTransferConfig``.

    ``EngineConfig(model, **options)`` takes each nested field by its option name (``policy=``, ``chunk_size=``,
    ``tensor_parallel_size=``, ``kv_role=``; see ``OPTIONS``), or a nested config whole (``scheduler=
    SchedulerConfig(...)``; then options given by name override its fields); ``scheduler="vllm"`` names the
    policy, as ``LLM``/``LLMEngine`` and the CLI (``--scheduler``) take it. Unknown options raise ``TypeError``
    naming them; bad values ``ValueError`` naming them. ``config.chunk_size`` reads ``config.scheduler.chunk_size``
    (every option by its name: ``__getattr__``).

    Field metadata read by ``sarathi_lite.cli.common``: ``help``; ``choices``; ``flag`` (the option's name when
    it is not the field's); ``type`` (a parser from the command-line text, when the annotation's type is not one);
    ``sim`` (the simulator reads it too).
    """

    __slots__ = ()

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        super().__init__(model, **_field_values(options))

    def __getattr__(self, name: str) -> Any:
        """A nested config's option by its flat name (``config.chunk_size`` is ``config.scheduler.chunk_size``);
        called only for names that are no attribute of the class."""
        option = OPTIONS.get(name)
        if option is None or option.section is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(getattr(self, option.section), option.field.name)

    def kv_pool(self, *, kv_bytes_per_token: int | None, max_position_embeddings: int | None,
                kv_cache_memory: int | None = None) -> KVPool:
        """The KV pool and ``max_model_len`` these options give on a deployment: see ``kv_pool``."""
        return kv_pool(self, kv_bytes_per_token=kv_bytes_per_token, max_position_embeddings=max_position_embeddings,
                       kv_cache_memory=kv_cache_memory)

    def scheduler_config(self, num_blocks: int | None, max_model_len: int) -> SchedulerConfig:
        """The ``SchedulerConfig`` of this engine once its KV pool and ``max_model_len`` are known: ``scheduler``
        with both set (and ``max_num_batched_tokens``, unless given, derived from that ``max_model_len``), and under
        pipeline parallelism one micro-batch in flight per stage."""
        return dataclasses.replace(self.scheduler, num_blocks=num_blocks, max_model_len=max_model_len,
                                   max_concurrent_batches=max(self.scheduler.max_concurrent_batches,
                                                              self.parallel.pipeline_parallel_size))

    @classmethod
    def from_options(cls, model: Any = None, **options: Any) -> EngineConfig:
        """The config of ``LLMEngine(model, **options)``: ``scheduler=`` names the policy; unknown options raise
        ``TypeError`` naming them."""
        return cls(model, **options)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some options changed (validated again): any option by name (``chunk_size=64``), a nested
        config whole (``parallel=ParallelConfig(...)``), or ``scheduler="vllm"`` for the policy."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return EngineConfig(**{**current, **_policy_keyword(changes)})


def _field_values(options: dict[str, Any]) -> dict[str, Any]:
    """``EngineConfig``'s fields (but ``model``) from options by name: each nested config (given whole, or its
    defaults) with the options of its section applied. Raises ``TypeError`` naming an unknown option, a policy
    named twice or a nested config of the wrong class."""
    options = _policy_keyword(options)
    unknown = sorted(set(options) - set(OPTIONS) - set(SECTIONS))
    if unknown:
        raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
    values = {name: value for name, value in options.items() if name in OPTIONS and OPTIONS[name].section is None}
    for name, (cls, _) in SECTIONS.items():
        given = options.get(name)
        if given is not None:
            _check_section(name, given, cls)
        changes = {o.field.name: options[o.name] for o in OPTIONS.values() if o.section == name and o.name in options}
        values[name] = (_scheduler_options(given, **changes) if name == "scheduler"
                        else dataclasses.replace(given or cls(), **changes))
    return values


def _check_section(name: str, value: object, cls: type) -> None:
    if not isinstance(value, cls):
        raise TypeError(f"{name}= takes a {cls.__name__}, not {type(value).__name__}")


def _policy_keyword(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``scheduler="name"`` (the CLI's and ``LLM``'s spelling of the policy) as ``policy=``."""
    if not isinstance(options.get("scheduler"), str):
        return options
    options = dict(options)
    if "policy" in options:
        raise TypeError(f"scheduler={options['scheduler']!r} and policy={options['policy']!r}: name the policy once")
    options["policy"] = options.pop("scheduler")
    return options


@dataclass(slots=True, frozen=True)
class Option:
    """One engine option as keywords, attributes and the CLI see it: ``name`` (``LLM(name=...)``,
    ``config.name``, ``--name``), the nested config holding it (``section``: an ``EngineConfig`` field, or
    ``None`` for ``EngineConfig``'s own), its dataclass ``field`` and type ``annotation``, and ``metadata``: the
    field's, with what the CLI needs beyond it."""

    name: str
    section: str | None
    field: dataclasses.Field
    annotation: Any
    metadata: Mapping[str, Any]

    @property
    def default(self) -> Any:
        """The option's one default (its dataclass field's)."""
        return self.field.default


def config_options(config_class: type | None = None) -> tuple[Option, ...]:
    """The options of ``config_class`` (default ``EngineConfig``: ``OPTIONS``, nested configs' fields in place
    of their section); of any other dataclass, its fields."""
    if config_class is None or config_class is EngineConfig:
        return tuple(OPTIONS.values())
    hints = typing.get_type_hints(config_class)
    return tuple(Option(f.name, None, f, hints[f.name], f.metadata) for f in dataclasses.fields(config_class))


def _options() -> dict[str, Option]:
    found: dict[str, Option] = {}
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name not in SECTIONS:
            found[f.name] = Option(f.name, None, f, hints[f.name], f.metadata)
            continue
        cls, prefix = SECTIONS[f.name]
        inner = typing.get_type_hints(cls)
        for g in dataclasses.fields(cls):
            if g.name in ENGINE_SET.get(f.name, ()):
                continue
            name = prefix + g.name
            if name in found or name in SECTIONS:
                raise TypeError(f"engine option {name!r} is defined twice")
            found[name] = Option(name, f.name, g, inner[g.name], {**g.metadata, **_CLI_METADATA.get(name, {})})
    return found


OPTIONS: dict[str, Option] = _options()
"""Every engine option by name: ``EngineConfig``'s own fields and, in their section's place, its nested
configs' fields (but those the engine sets itself, ``ENGINE_SET``)."""


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


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


# The scheduler's options, by name: every SchedulerConfig field but those the engine sets (ENGINE_SET).
SCHEDULER_FIELDS = tuple(o.name for o in OPTIONS.values() if o.section == "scheduler")


def default_option(name: str) -> Any:
    """The one default of the engine option ``name`` (e.g. ``chunk_size`` where a caller gives none)."""
    return OPTIONS[name].default
