"""Scheduler configuration: one small dataclass, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .registry import chunked_policy_names, is_chunked, policy_class

# With hol_protection, iterations a short prompt waits (counting the one that admits it) once it is the oldest waiting
# short prompt, no other short prompt is mid-prefill and a seat and KV blocks are free for it, whatever long prompts
# hold: it is admitted in the very next iteration (simple_chunking: its next prefill iteration, so within 2).
HOL_ADMISSION_BOUND = 1
# With hol_protection and a fixed chunk_size, a prompt is long (by default) when its prefill needs more than this many
# iterations' budgets. One chunk made every ordinary prompt above the budget "long" and cost capacity on ordinary
# traffic; four keeps every measured ordinary trace unchanged (docs/design/scheduler.md, head-of-line protection;
# docs/results/hol_protection.md).
LONG_PROMPT_CHUNKS = 4
DEFAULT_CHUNK_SIZE = 512
# With chunk_size="auto" the steps vary, so a prompt is long (by default) above what the default fixed chunk size
# calls long, LONG_PROMPT_CHUNKS * DEFAULT_CHUNK_SIZE = 2,048 tokens (or above max_num_batched_tokens, if less):
# a threshold of max_num_batched_tokens alone (8,192 for a model of 8k context) left every prompt the steps really
# chunk, at a few hundred tokens each, unprotected (docs/results/vllm_plugin.md, the evening re-run).
AUTO_LONG_THRESHOLD = LONG_PROMPT_CHUNKS * DEFAULT_CHUNK_SIZE


@dataclass(slots=True)
class SchedulerConfig:
    """What the scheduler may put in one iteration and how much KV memory it manages.

    All sizes are in tokens unless named otherwise.

    policy: a registered policy (``POLICIES``; ``registry.register_policy`` adds one). ``sarathi`` (stall-free
        hybrid batches) is the default; the others are the baselines of the Sarathi-Serve paper (see
        ``sarathi_lite.scheduler.policies``).
    chunk_size: the token budget of one iteration for the chunked policies (``sarathi``, ``simple_chunking``),
        or ``"auto"``: each iteration's prefill budget chosen by a step-time predictor so the predicted step
        fits a target (``tbt_slo * budget_safety`` at first, then moved by ``tbt_percentile``; see
        ``sarathi_lite.scheduler.budget``), with at most ``max_num_batched_tokens`` tokens in all.
    max_num_seqs: most requests running (holding KV blocks) at once; never more than the token budget, so a
        decode-only iteration always fits the budget (see ``max_running``).
    max_num_batched_tokens: the token budget of one iteration for the unchunked policies (``vllm``, ``orca``,
        ``request_level``), which must fit any whole prompt in one step; ``None`` means
        ``max(max_model_len, 2048)``, as in vLLM.
    max_model_len: longest prompt accepted; generation stops once prompt + output reach it (a prompt of exactly
        this length still samples one token, as in vLLM). ``None``: not known yet, as in ``EngineConfig.scheduler``
        before the engine knows its model and KV pool (``EngineConfig.scheduler_config`` completes it); such a
        config keeps ``max_num_batched_tokens`` and ``num_blocks`` as given, and no ``Scheduler`` takes it.
    block_size: tokens per KV block.
    num_blocks: blocks in the KV pool; ``None`` means enough for ``max_num_seqs`` requests of ``max_model_len``.
    watermark: fraction of the pool kept free when admitting a new request while others run, so running
        decodes have room to grow before anyone is preempted.
    max_num_partial_prefills: most prompts mid-prefill at once (``None``: no limit beyond ``max_num_seqs``).
    long_prefill_token_threshold: prompts with more prefill tokens than this count as long. Without
        ``hol_protection`` a long prompt's chunk per iteration is capped at this many tokens (``None``: no
        prompt is long); with it, see below (``None``: ``LONG_PROMPT_CHUNKS * chunk_size``, or
        ``max_num_batched_tokens`` with ``chunk_size="auto"``).
    max_long_partial_prefills: most long prompts mid-prefill at once; waiting short prompts are admitted past
        a long prompt that this limit holds back.
    enable_prefix_caching: reuse the KV blocks of a prompt prefix another request has already computed
        (content-addressed full blocks, see ``sarathi_lite.scheduler.block_manager``): an admitted request
        starts at the longest cached prefix and computes only the rest. On by default (greedy outputs are
        the same either way); the paper's policy comparisons turn it off.
    hol_protection: head-of-line protection for short prompts (chunked policies only). On by default;
        ``False`` is the Sarathi-Serve paper's first-come-first-served budget filling, which the paper's policy
        comparisons use. It acts only in iterations with a short prompt to protect (a long prompt beside a short
        one, mid-prefill or waiting); every other iteration is scheduled exactly as without it, so traffic
        whose prompts all sit on one side of ``long_threshold`` gets the paper's batches. With it the knobs
        compose into one guarantee (``HOL_ADMISSION_BOUND``): a short prompt (at most ``long_threshold`` prefill
        tokens) is admitted in the first iteration in which it is the oldest waiting short prompt, no other short
        prompt is mid-prefill and a seat and KV blocks are free for it, whatever long prompts are mid-prefill or
        waiting. In such an iteration, after the decodes: short prompts (mid-prefill, then waiting ones passing
        waiting long ones, then long ones whose whole prefill fits what is left) fill the budget but for a share
        kept for the long prompts mid-prefill (``min(long_chunk, half the budget, what they still need)``, so
        they never starve); the long prompts take everything the short ones leave (capped only by an explicit
        ``long_prefill_chunk``). Long prompts hold at most ``max(max_num_partial_prefills - 1, 1)`` (and
        ``max_long_partial_prefills``) partial-prefill slots; short prompts always have at least one. See
        ``admission.ShortPromptProtection``.
    long_prefill_chunk: with ``hol_protection``, a cap on the prefill tokens long prompts get in an iteration
        they share with decodes or short prompts, which keeps those iterations, whose long-context attention is
        the costliest, about as fast as the others, at some throughput (``None``, the default: no cap; the share
        kept for long prompts beside short ones is then ``min(long_threshold, chunk_size // 4)``).
    tbt_slo: with ``chunk_size="auto"`` (required then, unused otherwise): the time-between-tokens target,
        seconds per iteration.
    tbt_percentile: with ``chunk_size="auto"``: the percentile of time between tokens that ``tbt_slo`` bounds,
        in (0, 100) (99: P99 TBT <= ``tbt_slo``). The budget's target then moves with the measured steps so that
        their percentile sits just under ``tbt_slo`` (``budget.TailController``); ``None`` (the default until the
        controller sees TBT gaps rather than step times, see docs/results/auto_budget.md): the target stays at
        ``tbt_slo * budget_safety``.
    budget_safety: with ``chunk_size="auto"``: the fraction of ``tbt_slo`` a predicted step may take before any
        step is measured (with ``tbt_percentile=None``, always), in (0, 1].
    min_chunk_size: with ``chunk_size="auto"``: prefill tokens granted every iteration a prompt waits, even
        when the predicted step then exceeds the target (rounded up to whole blocks), so prefill never starves.
    max_concurrent_batches: most batches ``schedule()`` may hand out before the oldest is ``update()``d (pipeline
        stages, or async scheduling). A request is in at most one of them: its next prompt chunk or decode waits
        for the previous one (Sarathi-Serve's pipeline rule), except under ``async_scheduling``. 1 (the default)
        is strict alternation of ``schedule()`` and ``update()``.
    async_scheduling: let a request whose in-flight row samples a token be scheduled for its next decode before
        that token is known (the row's input is ``PLACEHOLDER_TOKEN``, which the executor replaces with the token
        the previous batch sampled), as vLLM's async scheduling does; never when that token could end it by
        length. Raises ``max_concurrent_batches`` from 1 to 2. A request that stops on the earlier token wastes
        that one row.
    balance_micro_batches: with ``max_concurrent_batches`` P > 1 and not ``async_scheduling``: a batch takes at
        most ``ceil(D / P)`` of the D running requests that decode (in flight or not), so the P micro-batches of
        a pipeline share the decodes evenly (vLLM gets the same from one scheduler per micro-batch, each with its
        own requests). Without it, decodes that become ready together all go into one batch and come back
        together, and the micro-batches after it find nothing to run: with only decodes running, one micro-batch
        at a time crosses the pipeline, forever. No effect at P = 1.
    """

    policy: str = field(default="sarathi", metadata={
        "help": "the batching policy"})
    chunk_size: int | str = field(default=DEFAULT_CHUNK_SIZE, metadata={
        "help": "token budget per iteration of the chunked policies (sarathi, simple_chunking), or auto: each "
                "iteration's budget chosen so the step cost_model predicts fits tbt_slo"})
    max_num_seqs: int = field(default=128, metadata={
        "help": "most requests running (holding KV blocks) at once"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "token budget per iteration of the unchunked policies (default: max(max_model_len, 2048))"})
    max_model_len: int | None = field(default=4096, metadata={
        "help": "longest request (tokens; an engine sets it from the model and its KV pool)"})
    block_size: int = field(default=16, metadata={
        "help": "tokens per KV block"})
    num_blocks: int | None = field(default=None, metadata={
        "help": "blocks in the KV pool (an engine sets it from num_kv_blocks or its KV memory)"})
    watermark: float = field(default=0.01, metadata={
        "help": "fraction of the KV pool kept free when admitting a request while others run"})
    max_num_partial_prefills: int | None = field(default=None, metadata={
        "help": "most prompts mid-prefill at once (default: no limit beyond max_num_seqs)"})
    long_prefill_token_threshold: int | None = field(default=None, metadata={
        "help": "prompts with more prefill tokens than this are long (default: with hol_protection, 4 x chunk_size; "
                "without, no prompt is long, and a long prompt's chunk is capped at it)"})
    max_long_partial_prefills: int = field(default=1, metadata={
        "help": "most long prompts mid-prefill at once"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV blocks of prompt prefixes other requests computed (greedy outputs are the same either "
                "way)"})
    hol_protection: bool = field(default=True, metadata={
        "help": "head-of-line protection: short prompts are admitted past long ones mid-prefill, which keep a share "
                "of the budget; iterations with no short prompt beside a long one are scheduled as without it (see "
                "SchedulerConfig.hol_protection); --no-hol-protection is the Sarathi-Serve paper's first-come-first-"
                "served policy"})
    long_prefill_chunk: int | None = field(default=None, metadata={
        "help": "with hol_protection, cap long prompts at this many prefill tokens in an iteration shared with "
                "decodes or short prompts, for TBT under long-context attention (default: no cap)"})
    tbt_slo: float | None = field(default=None, metadata={
        "help": "with chunk_size auto: the time-between-tokens target of every iteration (seconds)"})
    tbt_percentile: float | None = field(default=None, metadata={
        "help": "with chunk_size auto: the percentile of time between tokens that tbt_slo bounds (99: P99); the "
                "budget's target follows the measured steps' percentile to just under tbt_slo (None: a fixed "
                "target, tbt_slo x budget_safety)"})
    budget_safety: float = field(default=0.9, metadata={
        "help": "with chunk_size auto: the fraction of tbt_slo a predicted step may take until steps are measured "
                "(with tbt_percentile None, always: room for the step-to-step spread)"})
    min_chunk_size: int = field(default=32, metadata={
        "help": "with chunk_size auto: prefill tokens granted every iteration a prompt waits, even past tbt_slo (so "
                "prompts never starve)"})
    max_concurrent_batches: int = field(default=1, metadata={
        "help": "most batches in flight at once (pipeline stages, async scheduling); a request is in at most one of "
                "them"})
    balance_micro_batches: bool = field(default=True, metadata={
        "help": "with batches in flight (pipeline stages): a batch takes at most 1/max_concurrent_batches of the "
                "running decodes, so micro-batches share them evenly instead of one taking all"})
    async_scheduling: bool = field(default=False, metadata={
        "help": "overlap the CPU's scheduling of step N+1 and the processing of step N-1's outputs with step N's "
                "forward pass (a decode is scheduled before its input token is sampled)"})

    def __post_init__(self) -> None:
        policy_class(self.policy)  # raises ValueError naming the registered policies
        if self.chunk_size != "auto":
            _check_positive_int("chunk_size", self.chunk_size)
        for name in ("max_num_seqs", "max_model_len", "block_size", "max_long_partial_prefills",
                     "min_chunk_size", "max_concurrent_batches"):
            if name != "max_model_len" or self.max_model_len is not None:  # None: not known yet
                _check_positive_int(name, getattr(self, name))
        for name in ("max_num_batched_tokens", "num_blocks", "max_num_partial_prefills",
                     "long_prefill_token_threshold", "long_prefill_chunk"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be a bool")
        if not isinstance(self.hol_protection, bool):
            raise ValueError(f"hol_protection={self.hol_protection!r} must be True or False")
        if not isinstance(self.balance_micro_batches, bool):
            raise ValueError(f"balance_micro_batches={self.balance_micro_batches!r} must be True or False")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} must be True or False")
        if self.async_scheduling and self.max_concurrent_batches == 1:
            self.max_concurrent_batches = 2  # the batch running and the next
        self._check_auto_budget()
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark={self.watermark!r} must be in [0, 1)")
        if self.max_model_len is None:
            return  # not known yet: what follows from it waits for it (EngineConfig.scheduler_config)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_max_num_batched_tokens(self.max_model_len)
        if self.num_blocks is None:
            self.num_blocks = self.max_num_seqs * math.ceil(self.max_model_len / self.block_size)
        if not is_chunked(self.policy) and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}: policy {self.policy!r} does not chunk prompts, so a "
                f"whole prompt must fit in one iteration"
            )

    @property
    def token_budget(self) -> int:
        """Tokens one iteration may hold: ``chunk_size`` for chunked policies (``max_num_batched_tokens`` when it is
        ``"auto"``), else ``max_num_batched_tokens``."""
        if is_chunked(self.policy) and not self.auto_budget:
            return self.chunk_size
        return self.max_num_batched_tokens

    @property
    def auto_budget(self) -> bool:
        """Whether each iteration's budget comes from a step-time predictor (``chunk_size="auto"``)."""
        return self.chunk_size == "auto"

    @property
    def max_running(self) -> int:
        """Requests that may run at once: ``max_num_seqs``, capped by the token budget."""
        return min(self.max_num_seqs, self.token_budget)

    @property
    def protects_short_prompts(self) -> bool:
        """Whether head-of-line protection applies: ``hol_protection`` under a chunked policy."""
        return self.hol_protection and is_chunked(self.policy)

    @property
    def long_threshold(self) -> int | None:
        """Prefill tokens above which a prompt is long: ``long_prefill_token_threshold``, which under head-of-line
        protection defaults to ``LONG_PROMPT_CHUNKS * chunk_size`` (a prompt that needs several iterations; with
        ``chunk_size="auto"``, ``min(AUTO_LONG_THRESHOLD, max_num_batched_tokens)``); ``None`` when no prompt is
        long."""
        if self.long_prefill_token_threshold is None and self.protects_short_prompts:
            if self.auto_budget:
                return min(AUTO_LONG_THRESHOLD, self.token_budget)
            return LONG_PROMPT_CHUNKS * self.token_budget
        return self.long_prefill_token_threshold

    @property
    def long_chunk(self) -> int:
        """Under head-of-line protection, the prefill tokens kept for long prompts mid-prefill in an iteration that
        short prompts fill first, and with an explicit ``long_prefill_chunk`` also the most they get beside
        decodes or short prompts: ``long_prefill_chunk``, by default ``min(long_threshold, token_budget // 4)``
        (at least 1; ``token_budget`` is ``chunk_size``, or ``max_num_batched_tokens`` for ``"auto"``, whose
        steps keep a quarter of their own budget instead: ``long_chunk_for``)."""
        return self.long_chunk_for(self.token_budget)

    def long_chunk_for(self, step_tokens: int) -> int:
        """``long_chunk`` in a step whose token budget (decodes and prefill) is ``step_tokens``: with
        ``chunk_size="auto"`` and no explicit ``long_prefill_chunk``, ``min(long_threshold, step_tokens // 4)``
        (at least 1), a quarter of the step as a fixed chunk size keeps a quarter of its chunk; otherwise
        ``long_chunk`` (the step's budget is then ``chunk_size``)."""
        if self.long_prefill_chunk is not None:
            return self.long_prefill_chunk
        budget = step_tokens if self.auto_budget else self.token_budget
        return max(min(self.long_threshold or budget, budget // 4), 1)

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

    def _check_auto_budget(self) -> None:
        if not self.auto_budget:
            return
        if not is_chunked(self.policy):
            raise ValueError(f"chunk_size='auto' needs a chunked policy ({', '.join(chunked_policy_names())}), "
                             f"not {self.policy!r}")
        slo = self.tbt_slo
        if isinstance(slo, bool) or not isinstance(slo, (int, float)) or not math.isfinite(slo) or slo <= 0:
            raise ValueError(f"tbt_slo={slo!r} must be a positive number of seconds with chunk_size='auto'")
        safety = self.budget_safety
        if isinstance(safety, bool) or not isinstance(safety, (int, float)) or not 0 < safety <= 1:
            raise ValueError(f"budget_safety={safety!r} must be in (0, 1]")
        pct = self.tbt_percentile
        if pct is not None and (isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 < pct < 100):
            raise ValueError(f"tbt_percentile={pct!r} must be in (0, 100), or None for a fixed target")


def default_max_num_batched_tokens(max_model_len: int) -> int:
    """``SchedulerConfig.max_num_batched_tokens`` when none is given: ``max(max_model_len, 2048)``, as in vLLM."""
    return max(max_model_len, 2048)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
