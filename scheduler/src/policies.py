"""The five batching policies of the Sarathi-Serve paper's comparison, on one scheduler core.

Each differs only in how ``compose(out)`` combines the scheduler's public building blocks: give running decodes
their token, continue prompts mid-prefill, admit waiting prompts. A new policy is one such class and one
``register_policy``.
"""

from __future__ import annotations

from .base import Scheduler
from .budget import StepTimePredictor
from .config import SchedulerConfig
from .kv_transfer import KVConnectorScheduler
from .output import SchedulerOutput
from .registry import policy_class, register_policy


@register_policy
class SarathiScheduler(Scheduler):
    """Stall-free hybrid batches (Sarathi-Serve). Token budget ``chunk_size`` (or, with ``"auto"``, chosen each
    iteration: ``Scheduler.prefill_budget``): every running decode first, then prompts already mid-prefill,
    then waiting prompts admitted in arrival order, each taking a chunk of what is left. No decode waits while a
    prompt is prefilled. With ``hol_protection``, short prompts go before long ones in that order
    (``admission.ShortPromptProtection``)."""

    policy = "sarathi"
    chunked = True

    def compose(self, out: SchedulerOutput) -> None:
        prefills = self.schedule_decodes(out)
        self.schedule_prefills(prefills, self.prefill_budget(out, prefills), out)


@register_policy
class VLLMScheduler(Scheduler):
    """Prefill-prioritizing, unchunked (vLLM v0): whenever waiting prompts can be admitted, run a prefill-only
    iteration of whole prompts up to ``max_num_batched_tokens``; otherwise a decode-only iteration."""

    policy = "vllm"
    chunked = False

    def compose(self, out: SchedulerOutput) -> None:
        if not self.admit(self.config.max_num_batched_tokens, out):
            self.schedule_decodes(out)


@register_policy
class OrcaScheduler(Scheduler):
    """Iteration-level batching (Orca): every running decode, plus whole waiting prompts up to
    ``max_num_batched_tokens`` in the same iteration. Prompts are never chunked, so a long prompt stalls the
    decodes batched with it."""

    policy = "orca"
    chunked = False

    def compose(self, out: SchedulerOutput) -> None:
        self.schedule_decodes(out)
        self.admit(self.config.max_num_batched_tokens - out.num_decode_tokens, out)


@register_policy
class RequestLevelScheduler(Scheduler):
    """Request-level batching (FasterTransformer): a batch of whole prompts is admitted only when the previous
    batch has entirely finished; then it decodes until every member is done."""

    policy = "request_level"
    chunked = False

    def compose(self, out: SchedulerOutput) -> None:
        if self.running or self.waiting_for_kv:
            self.schedule_decodes(out)
        else:
            self.admit(self.config.max_num_batched_tokens, out)


@register_policy
class SimpleChunkingScheduler(Scheduler):
    """Chunked prefill-only iterations alternating with decode-only iterations (the paper's
    "chunked-prefills-only" ablation): prompts are chunked under ``chunk_size``, but never share an iteration
    with decodes."""

    policy = "simple_chunking"
    chunked = True

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor | None = None,
                 connector: KVConnectorScheduler | None = None) -> None:
        super().__init__(config, predictor, connector)
        self._last_was_prefill = False

    def compose(self, out: SchedulerOutput) -> None:
        prefills = self.prefills_in_progress()
        has_decodes = any(r.num_computed_tokens >= r.num_prefill_tokens for r in self.running)
        if not (has_decodes and self._last_was_prefill):
            self.schedule_prefills(prefills, self.prefill_budget(out, prefills), out)
        if out.is_empty:
            prefills = self.schedule_decodes(out)
            if out.is_empty:  # every decode was preempted to make room: chunk prompts rather than run nothing
                self.schedule_prefills(prefills, self.prefill_budget(out, prefills), out)
        self._last_was_prefill = out.num_prefills > 0


def make_scheduler(config: SchedulerConfig | None = None, predictor: StepTimePredictor | None = None,
                   connector: KVConnectorScheduler | None = None) -> Scheduler:
    """The scheduler for ``config.policy`` (default: ``SchedulerConfig()``, the ``sarathi`` policy).

    predictor: the step-time model ``chunk_size="auto"`` needs (see ``sarathi_lite.scheduler.budget``).
    connector: the scheduler side of a KV connector (``sarathi_lite.scheduler.kv_transfer``), or ``None``."""
    config = config or SchedulerConfig()
    return policy_class(config.policy)(config, predictor, connector)
