"""The five batching policies of the Sarathi-Serve paper's comparison, on one scheduler core.

Each differs only in how ``schedule()`` composes the shared steps: give running decodes their token, continue
prompts mid-prefill, admit waiting prompts.
"""

from __future__ import annotations

from .base import Scheduler
from .budget import StepTimePredictor
from .config import SchedulerConfig
from .output import SchedulerOutput


class SarathiScheduler(Scheduler):
    """Stall-free hybrid batches (Sarathi-Serve). Token budget ``chunk_size`` (or, with ``"auto"``, chosen each
    iteration: ``Scheduler._prefill_budget``): every running decode first, then prompts already mid-prefill,
    then waiting prompts admitted in arrival order, each taking a chunk of what is left. No decode waits while a
    prompt is prefilled. With ``hol_protection``, short prompts go before long ones in that order
    (``Scheduler._schedule_prefills_protected``)."""

    policy = "sarathi"
    chunked = True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        prefills = self._schedule_decodes(out)
        self._schedule_prefills(prefills, self._prefill_budget(out, prefills), out)
        return out


class VLLMScheduler(Scheduler):
    """Prefill-prioritizing, unchunked (vLLM v0): whenever waiting prompts can be admitted, run a prefill-only
    iteration of whole prompts up to ``max_num_batched_tokens``; otherwise a decode-only iteration."""

    policy = "vllm"
    chunked = False

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self._admit(self.config.max_num_batched_tokens, out):
            self._schedule_decodes(out)
        return out


class OrcaScheduler(Scheduler):
    """Iteration-level batching (Orca): every running decode, plus whole waiting prompts up to
    ``max_num_batched_tokens`` in the same iteration. Prompts are never chunked, so a long prompt stalls the
    decodes batched with it."""

    policy = "orca"
    chunked = False

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule_decodes(out)
        self._admit(self.config.max_num_batched_tokens - out.num_decode_tokens, out)
        return out


class RequestLevelScheduler(Scheduler):
    """Request-level batching (FasterTransformer): a batch of whole prompts is admitted only when the previous
    batch has entirely finished; then it decodes until every member is done."""

    policy = "request_level"
    chunked = False

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.running:
            self._schedule_decodes(out)
        else:
            self._admit(self.config.max_num_batched_tokens, out)
        return out


class SimpleChunkingScheduler(Scheduler):
    """Chunked prefill-only iterations alternating with decode-only iterations (the paper's
    "chunked-prefills-only" ablation): prompts are chunked under ``chunk_size``, but never share an iteration
    with decodes."""

    policy = "simple_chunking"
    chunked = True

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor | None = None) -> None:
        super().__init__(config, predictor)
        self._last_was_prefill = False

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        prefills = [r for r in self.running if r.num_computed_tokens < r.num_prefill_tokens]
        has_decodes = len(prefills) < len(self.running)
        if not (has_decodes and self._last_was_prefill):
            self._schedule_prefills(prefills, self._prefill_budget(out, prefills), out)
        if out.is_empty:
            prefills = self._schedule_decodes(out)
            if out.is_empty:  # every decode was preempted to make room: chunk prompts rather than run nothing
                self._schedule_prefills(prefills, self._prefill_budget(out, prefills), out)
        self._last_was_prefill = out.num_prefills > 0
        return out


_POLICY_CLASSES: dict[str, type[Scheduler]] = {
    cls.policy: cls
    for cls in (SarathiScheduler, VLLMScheduler, OrcaScheduler, RequestLevelScheduler, SimpleChunkingScheduler)
}


def make_scheduler(config: SchedulerConfig | None = None, predictor: StepTimePredictor | None = None) -> Scheduler:
    """The scheduler for ``config.policy`` (default: ``SchedulerConfig()``, the ``sarathi`` policy).

    predictor: the step-time model ``chunk_size="auto"`` needs (see ``sarathi_lite.scheduler.budget``)."""
    config = config or SchedulerConfig()
    return _POLICY_CLASSES[config.policy](config, predictor)
