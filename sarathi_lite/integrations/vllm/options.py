"""The plugin's options: ``--additional-config '{"sarathi_lite": {...}}'`` (``additional_config=`` of ``vllm.LLM``),
named as in ``SchedulerConfig``, checked before the engine serves anything. No vLLM import here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarathi_lite.costs import load_cost_model
from sarathi_lite.scheduler import SchedulerConfig

OPTIONS_KEY = "sarathi_lite"
"""The key of ``additional_config`` that holds the plugin's options."""
POLICIES = ("sarathi", "vllm_v1")
"""``sarathi``: our decision (decodes first, the token budget, head-of-line protection); ``vllm_v1``: vLLM's own
rule left unchanged, only logged (the baseline the simulator's ``vllm_v1`` policy is checked against)."""
DEFAULT_CHUNK_SIZE = 512
"""The token budget when ``chunk_size`` is not given (at most vLLM's ``max_num_batched_tokens``)."""
KEYS = ("policy", "chunk_size", "tbt_slo", "tbt_percentile", "cost_model", "budget_safety", "min_chunk_size",
        "hol_protection", "long_prefill_chunk", "step_log")
DEFAULT_TBT_PERCENTILE = 99.0
"""The TBT percentile ``tbt_slo`` bounds with ``chunk_size="auto"`` when not given (``null``: a fixed target,
``tbt_slo * budget_safety``). vLLM's steps scatter around any model of them (a profile of another engine, a
busy host): the budget sizes them by their measured percentile, not by their typical time."""


@dataclass(frozen=True, slots=True)
class PluginOptions:
    """The parsed options.

    policy: see ``POLICIES``. config: our ``SchedulerConfig`` for the decision, sized like vLLM's scheduler
    (its ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``, block size, KV blocks and
    ``long_prefill_token_threshold``). cost_model: the step-time model of ``chunk_size="auto"`` (else
    ``None``). step_log: a JSON-lines file that gets one record per step (``None``: kept in memory only).
    """

    policy: str
    config: SchedulerConfig
    cost_model: Any
    step_log: Path | None


def parse_options(additional_config: Mapping[str, Any] | None, *, max_num_batched_tokens: int, max_num_seqs: int,
                  max_model_len: int, block_size: int, num_blocks: int, long_prefill_token_threshold: int,
                  enable_prefix_caching: bool) -> PluginOptions:
    """Parse ``additional_config["sarathi_lite"]`` against vLLM's scheduler limits. Raises ``ValueError`` naming
    the bad key or value (an unknown key, a chunk size above ``max_num_batched_tokens``, ``"auto"`` without
    ``tbt_slo`` or ``cost_model``, a string where a number belongs, ...)."""
    raw = (additional_config or {}).get(OPTIONS_KEY, {})
    if not isinstance(raw, Mapping):
        raise ValueError(f"additional_config[{OPTIONS_KEY!r}] must be a JSON object, not {raw!r}")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown sarathi_lite option(s) {', '.join(map(repr, unknown))}; the options are "
                         f"{', '.join(KEYS)}")
    policy = raw.get("policy", "sarathi")
    if policy not in POLICIES:
        raise ValueError(f"sarathi_lite policy={policy!r} is not one of {', '.join(POLICIES)}")
    chunk_size = raw.get("chunk_size", min(DEFAULT_CHUNK_SIZE, max_num_batched_tokens))
    if chunk_size != "auto":
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"sarathi_lite chunk_size={chunk_size!r} must be a positive int or 'auto'")
        if chunk_size > max_num_batched_tokens:
            raise ValueError(f"sarathi_lite chunk_size={chunk_size} is larger than vLLM's max_num_batched_tokens="
                             f"{max_num_batched_tokens} (which sizes its buffers): raise --max-num-batched-tokens "
                             f"or lower chunk_size")
    for key in ("tbt_slo", "tbt_percentile", "budget_safety"):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"sarathi_lite {key}={value!r} must be a number")
    spec = raw.get("cost_model")
    if chunk_size == "auto" and spec is None:
        raise ValueError("sarathi_lite chunk_size='auto' needs cost_model: a profile JSON (sarathi-lite profile) "
                         "or roofline:HW[:MODEL]")
    if spec is not None and not isinstance(spec, str):
        raise ValueError(f"sarathi_lite cost_model={spec!r} must be a string (a file path or roofline:...)")
    step_log = raw.get("step_log")
    if step_log is not None and not isinstance(step_log, str):
        raise ValueError(f"sarathi_lite step_log={step_log!r} must be a file path")
    extra = {k: raw[k] for k in ("tbt_slo", "budget_safety", "min_chunk_size", "hol_protection",
                                 "long_prefill_chunk") if k in raw}
    if chunk_size == "auto":
        extra["tbt_percentile"] = raw.get("tbt_percentile", DEFAULT_TBT_PERCENTILE)
    config = SchedulerConfig(
        policy="sarathi", chunk_size=chunk_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, block_size=block_size,
        num_blocks=num_blocks, long_prefill_token_threshold=long_prefill_token_threshold or None,
        enable_prefix_caching=enable_prefix_caching, **extra)
    cost_model = load_cost_model(spec) if chunk_size == "auto" else None
    return PluginOptions(policy, config, cost_model, Path(step_log) if step_log else None)


def describe(options: PluginOptions) -> str:
    """The options in effect, in one line for the log (``policy sarathi, chunk_size 256, ...``)."""
    config = options.config
    if options.policy == "vllm_v1":
        return "policy vllm_v1 (vLLM's own rule, steps only logged)"
    parts = [f"policy {options.policy}", f"chunk_size {config.chunk_size}", f"hol_protection {config.hol_protection}"]
    if config.long_prefill_chunk is not None:
        parts.append(f"long_prefill_chunk {config.long_prefill_chunk}")
    if config.auto_budget:
        parts += [f"tbt_slo {config.tbt_slo}", f"tbt_percentile {config.tbt_percentile}",
                  f"cost_model {type(options.cost_model).__name__}", f"min_chunk_size {config.min_chunk_size}"]
    parts.append(f"step_log {options.step_log or 'in memory only'}")
    return ", ".join(parts)
