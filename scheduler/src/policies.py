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
from .output import ScheduledRequest, SchedulerOutput
from .registry import policy_class, register_policy
from .request import RequestStatus


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


@register_policy
class VLLMV1Scheduler(Scheduler):
    """vLLM V1's own rule (vLLM 0.32, ``policy="fcfs"``, chunked prefill), reproduced so the simulator can run vLLM
    beside sarathi-lite's policies: one token budget (``chunk_size``, vLLM's ``max_num_batched_tokens``) filled
    from the running requests in list order, decodes and prompt chunks alike, each ``min(tokens it needs,
    long_prefill_token_threshold, budget left)`` (the cap only while more than one request is running or waiting);
    a request that cannot get its blocks preempts the last running one (itself, if it is the last); then, only in
    a step that preempted nobody, waiting prompts are admitted in order on what is left, each capped the same
    way, while seats and blocks last. No head-of-line protection and no partial-prefill limits.

    Checked step by step against the real vLLM scheduler (``tests/vllm_plugin``). Where it differs from vLLM:
    blocks for a prompt's whole prefill are taken at admission (vLLM checks that they are free, then takes them
    chunk by chunk), and a request that is preempted keeps its arrival place in ``running`` when readmitted (vLLM
    appends it), so the two part only once the pool runs short."""

    policy = "vllm_v1"
    chunked = True
    reproduces = "vLLM 0.32 V1 scheduler"

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor | None = None,
                 connector: KVConnectorScheduler | None = None) -> None:
        super().__init__(config, predictor, connector)
        self.protection = None  # vLLM has none

    def compose(self, out: SchedulerOutput) -> None:
        cfg = self.config
        budget = cfg.token_budget
        threshold = cfg.long_prefill_token_threshold
        cap = threshold if threshold and len(self.running) + len(self.waiting) > 1 else None
        kv, pool, bs = self.kv, self.block_manager, cfg.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            i += 1
            if req.num_in_flight:
                continue
            if req.is_prefill:  # its blocks were taken at admission
                budget -= self.schedule_prefill_chunk(req, min(budget, cap or budget), out)
                continue
            if req.num_computed_tokens == len(req.block_ids) * bs:
                while not pool.num_free_blocks and req.status is RequestStatus.RUNNING:
                    victim = self._victim(i - 1)  # the last running request (not in flight): later in the list
                    if victim is None:
                        break
                    self.preempt(victim, out)
                if req.status is not RequestStatus.RUNNING or not pool.num_free_blocks:
                    break
                kv.allocate_one(req)
            out.add(ScheduledRequest(req.request_id, req.num_computed_tokens, 1, [req.output_token_ids[-1]],
                                     req.block_ids[:], True, False))
            budget -= 1
        if not out.preempted_ids:
            self._admit(budget, cap, out)

    def _admit(self, budget: int, cap: int | None, out: SchedulerOutput) -> None:
        """Admit waiting prompts in order while budget, seats and blocks last, each chunk ``min(need, cap, left)``."""
        waiting = self.waiting
        while waiting and budget > 0 and self.has_seat():
            req = waiting[0]
            prefix, _, fits = self.admission_blocks(req)
            if not fits:
                break
            waiting.popleft()
            budget -= self.start(req, prefix, min(budget, cap or budget), out)


def make_scheduler(config: SchedulerConfig | None = None, predictor: StepTimePredictor | None = None,
                   connector: KVConnectorScheduler | None = None) -> Scheduler:
    """The scheduler for ``config.policy`` (default: ``SchedulerConfig()``, the ``sarathi`` policy).

    predictor: the step-time model ``chunk_size="auto"`` needs (see ``sarathi_lite.scheduler.budget``).
    connector: the scheduler side of a KV connector (``sarathi_lite.scheduler.kv_transfer``), or ``None``."""
    config = config or SchedulerConfig()
    return policy_class(config.policy)(config, predictor, connector)
