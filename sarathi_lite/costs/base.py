"""The cost-model interface: how long one iteration takes, predicted from its ``SchedulerOutput`` alone.

Torch-free, so the simulator (``sarathi_lite.sim.simulator``) and the engine's ``chunk_size="auto"`` budget use it
anywhere. Every model answers the same questions the real engine's clock answers:

- ``predict(out)``: the iteration's ``schedule_time`` (step start to the end of ``schedule()``) and
  ``step_time`` (step start to end: scheduling, input preparation, the forward pass, sampling and ``update``),
  both in seconds, as ``IterationRecord`` measures them;
- ``start_time(ready)``: when the next iteration starts, given that the engine became ready at ``ready`` (the
  previous iteration's end, or the arrival that ended an idle spell): ``ready + step_gap``, the host's time
  between steps (recording metrics, building outputs, the replay loop's look at the clock);
- ``reset(seed)``: called before each simulation, for models with state;
- ``predict_step_time(out)``: the typical step time, deterministic and stateless: what ``chunk_size="auto"``
  asks about trial batches (profiled, roofline and calibrated models; a replay has none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sarathi_lite.scheduler import SchedulerOutput


@dataclass(slots=True, frozen=True)
class StepTiming:
    """One iteration's predicted times (seconds from its start): end of scheduling, and end of the step."""

    schedule_time: float
    step_time: float


class CostModel:
    """The interface the simulator drives. Subclasses implement ``predict``; ``describe`` names the model.

    step_gap: seconds from one iteration's end to the next one's start when work is waiting.
    kv_bytes_per_token, kv_cache_memory, max_position_embeddings: what the modelled deployment holds (bytes of
    K/V per token over all layers; bytes given to the KV pool; the model's longest context), from which the
    simulator derives the KV pool size the real engine would have (``None``: pass it explicitly).
    """

    step_gap: float = 0.0
    kv_bytes_per_token: int | None = None
    kv_cache_memory: int | None = None
    max_position_embeddings: int | None = None

    def predict(self, out: SchedulerOutput) -> StepTiming:
        raise NotImplementedError

    def predict_step_time(self, out: SchedulerOutput) -> float:
        """The typical ``step_time`` (seconds) of ``out``: deterministic, with no random draw and no state
        change, so ``chunk_size="auto"`` can ask it about trial batches (``sarathi_lite.scheduler.budget``)."""
        raise NotImplementedError(f"{type(self).__name__} gives no deterministic step-time prediction")

    def start_time(self, ready: float) -> float:
        """When the next iteration starts (seconds) if the engine is ready at ``ready``."""
        return ready + self.step_gap

    def reset(self, seed: int) -> None:
        """Start a new simulation: the simulator calls this first, so a model with state (a replay's position,
        a random draw's generator) gives every simulation the same sequence whatever ran before."""

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description, stored in a simulated result's ``meta``: ``kind``, and the deployment it
        models (``model``, ``dtype``, ``device``, ``attention_backend``; ``None`` where unknown), which a
        simulated result's configuration records like a real one's."""
        raise NotImplementedError
