"""The plugin's options: ``--additional-config '{"sarathi_lite": {...}}'`` (``additional_config=`` of ``vllm.LLM``),
named as in ``SchedulerConfig`` and checked by ``sarathi_lite.integrations.options`` before the engine serves
anything. No vLLM import here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sarathi_lite.integrations.options import KEYS, PluginOptions, build_options, check_options
from sarathi_lite.scheduler import POLICIES as OUR_POLICIES

OPTIONS_KEY = "sarathi_lite"
"""The key of ``additional_config`` that holds the plugin's options."""
POLICIES = (*OUR_POLICIES, "vllm_v1")
"""Our policies (``sarathi``, the default: decodes first, the token budget, head-of-line protection; the paper's
baselines), each applied through vLLM's loop; ``vllm_v1``: vLLM's own rule left unchanged, only logged (the
baseline the simulator's ``vllm_v1`` policy is checked against)."""
DEFAULT_CHUNK_SIZE = 512
"""The token budget when ``chunk_size`` is not given (at most vLLM's ``max_num_batched_tokens``)."""

__all__ = ["DEFAULT_CHUNK_SIZE", "KEYS", "OPTIONS_KEY", "POLICIES", "PluginOptions", "parse_options"]


def parse_options(additional_config: Mapping[str, Any] | None, *, max_num_batched_tokens: int, max_num_seqs: int,
                  max_model_len: int, block_size: int, num_blocks: int, long_prefill_token_threshold: int,
                  enable_prefix_caching: bool) -> PluginOptions:
    """Parse ``additional_config["sarathi_lite"]`` against vLLM's scheduler limits. Raises ``ValueError`` naming
    the bad key or value (an unknown key, a chunk size above ``max_num_batched_tokens``, ``"auto"`` without
    ``tbt_slo`` or ``cost_model``, a string where a number belongs, ...)."""
    if isinstance(max_num_batched_tokens, bool) or not isinstance(max_num_batched_tokens, int) \
            or max_num_batched_tokens < 1:
        raise ValueError(f"vLLM's max_num_batched_tokens={max_num_batched_tokens!r} must be a positive integer (the "
                         f"sarathi_lite chunk_size is at most it)")
    raw = (additional_config or {}).get(OPTIONS_KEY, {})
    if not isinstance(raw, Mapping):
        raise ValueError(f"additional_config[{OPTIONS_KEY!r}] must be a JSON object, not {raw!r}")
    check_options(raw, POLICIES)
    chunk_size = raw.get("chunk_size", min(DEFAULT_CHUNK_SIZE, max_num_batched_tokens))
    if chunk_size != "auto" and chunk_size > max_num_batched_tokens:
        raise ValueError(f"sarathi_lite chunk_size={chunk_size} is larger than vLLM's max_num_batched_tokens="
                         f"{max_num_batched_tokens} (which sizes its buffers): raise --max-num-batched-tokens "
                         f"or lower chunk_size")
    return build_options(raw, POLICIES, chunk_size=chunk_size, max_num_batched_tokens=max_num_batched_tokens,
                         max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size,
                         num_blocks=num_blocks, long_prefill_token_threshold=long_prefill_token_threshold or None,
                         enable_prefix_caching=enable_prefix_caching)


def describe(options: PluginOptions) -> str:
    """The options in effect, in one line for the log (``policy sarathi, chunk_size 256, ...``)."""
    config = options.config
    if options.policy == "vllm_v1":
        return "policy vllm_v1 (vLLM's own rule, steps only logged)"
    parts = [f"policy {options.policy}", f"chunk_size {config.chunk_size}", f"hol_protection {config.hol_protection}"]
    if config.auto_budget:
        parts += [f"tbt_slo {config.tbt_slo}", f"tbt_percentile {config.tbt_percentile}",
                  f"cost_model {type(options.cost_model).__name__}", f"min_chunk_size {config.min_chunk_size}"]
    parts.append(f"step_log {options.step_log or 'in memory only'}")
    return ", ".join(parts)
