"""vLLM 0.33: adds a local prefill cadence (``prefill_schedule_interval`` now applies without data parallelism:
steps between two prefill-carrying steps run decodes only), which would hold back the prefill the plugin plans,
and moves ``AsyncScheduler._update_request_with_output`` into ``Scheduler`` (the plugin's synchronous books
call ``Scheduler``'s, whichever class defines it)."""

from __future__ import annotations

from . import Conflict
from .v0_32 import CONFLICTS as CONFLICTS_0_32
from .v0_32 import RUNNER_OUTPUT_INDEX  # noqa: F401  (unchanged)

RELEASE = "0.33"
CONFLICTS: tuple[Conflict, ...] = CONFLICTS_0_32 + (
    Conflict("prefill_schedule_interval", 1, "--prefill-schedule-interval",
             "it holds every prefill chunk out of the steps between its interval's steps"),
)
