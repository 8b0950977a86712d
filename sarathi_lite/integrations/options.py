"""The options every host of the decision takes, named as in ``SchedulerConfig`` and checked the same way whatever
framework passes them (vLLM's ``additional_config``, transformers' ``register(...)``). No framework import here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarathi_lite.costs import load_cost_model
from sarathi_lite.scheduler import SchedulerConfig

KEYS = ("policy", "chunk_size", "tbt_slo", "tbt_percentile", "cost_model", "budget_safety", "min_chunk_size",
        "hol_protection", "step_log")


@dataclass(frozen=True, slots=True)
class PluginOptions:
    """The parsed options.

    policy: the policy deciding each step (a registered name; ``"vllm_v1"`` in vLLM: vLLM's own scheduler).
    config: our ``SchedulerConfig`` for the decision, sized like the host's scheduler. cost_model: the step-time
    model of ``chunk_size="auto"`` (else ``None``). step_log: a JSON-lines file that gets one record per step
    (``None``: kept in memory only).
    """

    policy: str
    config: SchedulerConfig
    cost_model: Any
    step_log: Path | None


def check_options(raw: Mapping[str, Any], policies: Sequence[str]) -> None:
    """Check what can be checked of ``raw`` without the host's limits: the keys (``KEYS``), ``policy`` (one of
    ``policies``), the types of ``chunk_size`` and the numbers, and that ``"auto"`` has a cost model. Raises
    ``ValueError`` naming the bad key or value."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"sarathi_lite options must be a mapping (a JSON object), not {raw!r}")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown sarathi_lite option(s) {', '.join(map(repr, unknown))}; the options are "
                         f"{', '.join(KEYS)}")
    policy = raw.get("policy", policies[0])
    if policy not in policies:
        raise ValueError(f"sarathi_lite policy={policy!r} is not one of {', '.join(policies)}")
    chunk_size = raw.get("chunk_size")
    if chunk_size is not None and chunk_size != "auto" and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"sarathi_lite chunk_size={chunk_size!r} must be a positive int or 'auto'")
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


def _step_log(value: Any) -> Path | None:
    """The ``step_log`` path, opened for appending once here so that a directory or a path this process cannot
    write is refused now, not inside the host's start-up."""
    if value is None or value == "":
        return None
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"sarathi_lite step_log={value!r} is a directory; give a file path (JSON lines are "
                         f"appended to it)")
    try:
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as e:
        raise ValueError(f"sarathi_lite step_log={value!r} cannot be written: {e.strerror or e}") from None
    return path


def build_options(raw: Mapping[str, Any], policies: Sequence[str], *, chunk_size: int | str,
                  max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int, num_blocks: int,
                  long_prefill_token_threshold: int | None, enable_prefix_caching: bool) -> PluginOptions:
    """``check_options``, then our ``SchedulerConfig`` sized by the host's limits (``chunk_size``: the one the
    host settled on, ``raw``'s or its default, checked against ``max_num_batched_tokens`` by the host, whose
    message names its own setting) and the cost model of ``"auto"``. Raises ``ValueError`` naming the bad value
    (``SchedulerConfig``'s own checks included)."""
    check_options(raw, policies)
    min_chunk_size = raw.get("min_chunk_size")
    budget = max_num_batched_tokens if chunk_size == "auto" else chunk_size
    if isinstance(min_chunk_size, int) and not isinstance(min_chunk_size, bool) and min_chunk_size > budget:
        raise ValueError(f"sarathi_lite min_chunk_size={min_chunk_size} is above the token budget of a step ("
                         + ("the host's max_num_batched_tokens" if chunk_size == "auto" else "chunk_size")
                         + f"={budget}): no step could grant it")
    step_log = _step_log(raw.get("step_log"))
    extra = {k: raw[k] for k in ("tbt_slo", "tbt_percentile", "budget_safety", "min_chunk_size", "hol_protection")
             if k in raw}
    policy = raw.get("policy", policies[0])
    config = SchedulerConfig(
        policy=policy, chunk_size=chunk_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, block_size=block_size,
        num_blocks=num_blocks, long_prefill_token_threshold=long_prefill_token_threshold,
        enable_prefix_caching=enable_prefix_caching, **extra)
    spec = raw.get("cost_model")
    cost_model = load_cost_model(spec) if spec is not None else None  # checked even where a fixed budget ignores it
    return PluginOptions(policy, config, cost_model if chunk_size == "auto" else None,
                         step_log)
