"""vLLM 0.34: adds cache-aware admission (``cache_aware_admission_window``: waiting requests with a cached
prefix are admitted ahead of others), which would reorder the admission order the plugin sets, and sets every
scheduled decode's ``next_decode_eligible_step`` in ``AsyncScheduler`` whatever the model runner (the plugin's
hold of a long prompt puts back only a value vLLM has not changed since, so this needs no change). Its
``ModelRunnerOutput`` drops ``req_id_to_index`` (the scheduler indexes ``req_ids`` itself), which only the
model-free harness builds."""

from __future__ import annotations

from . import Conflict
from .v0_33 import CONFLICTS as CONFLICTS_0_33

RELEASE = "0.34"
RUNNER_OUTPUT_INDEX = False
CONFLICTS: tuple[Conflict, ...] = CONFLICTS_0_33 + (
    Conflict("cache_aware_admission_window", 0, "--cache-aware-admission-window",
             "it admits waiting requests with a cached prefix ahead of the plugin's admission order"),
)
