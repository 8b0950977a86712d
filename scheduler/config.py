"""Scheduler configuration: one small dataclass, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

POLICIES = ("sarathi", "vllm", "orca", "request_level", "simple_chunking")
CHUNKED_POLICIES = ("sarathi", "simple_chunking")


@dataclass(slots=True)
class SchedulerConfig:
    """What the scheduler may put in one iteration and how much KV memory it manages.

    All sizes are in tokens unless named otherwise.

    policy: one of ``POLICIES``. ``sarathi`` (stall-free hybrid batches) is the default; the others are the
        baselines of the Sarathi-Serve paper (see ``sarathi_lite.scheduler.policies``).
    chunk_size: the token budget of one iteration for the chunked policies (``sarathi``, ``simple_chunking``).
    max_num_seqs: most requests running (holding KV blocks) at once; never more than the token budget, so a
        decode-only iteration always fits the budget (see ``max_running``).
    max_num_batched_tokens: the token budget of one iteration for the unchunked policies (``vllm``, ``orca``,
        ``request_level``), which must fit any whole prompt in one step; ``None`` means
        ``max(max_model_len, 2048)``, as in vLLM.
    max_model_len: longest prompt accepted; generation stops once prompt + output reach it (a prompt of exactly
        this length still samples one token, as in vLLM).
    block_size: tokens per KV block.
    num_blocks: blocks in the KV pool; ``None`` means enough for ``max_num_seqs`` requests of ``max_model_len``.
    watermark: fraction of the pool kept free when admitting a new request while others run, so running
        decodes have room to grow before anyone is preempted.
    max_num_partial_prefills: most prompts mid-prefill at once (``None``: no limit beyond ``max_num_seqs``).
    long_prefill_token_threshold: prompts with more prefill tokens than this count as long; a long prompt's
        chunk per iteration is capped at this many tokens (``None``: no prompt is long).
    max_long_partial_prefills: most long prompts mid-prefill at once; waiting short prompts are admitted past
        a long prompt that this limit holds back.
    enable_prefix_caching: reuse the KV blocks of a prompt prefix another request has already computed
        (content-addressed full blocks, see ``sarathi_lite.scheduler.block_manager``): an admitted request
        starts at the longest cached prefix and computes only the rest. On by default (greedy outputs are
        the same either way); the paper's policy comparisons turn it off.
    """

    policy: str = "sarathi"
    chunk_size: int = 512
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    max_model_len: int = 4096
    block_size: int = 16
    num_blocks: int | None = None
    watermark: float = 0.01
    max_num_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None
    max_long_partial_prefills: int = 1
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in ("chunk_size", "max_num_seqs", "max_model_len", "block_size", "max_long_partial_prefills"):
            _check_positive_int(name, getattr(self, name))
        for name in ("max_num_batched_tokens", "num_blocks", "max_num_partial_prefills",
                     "long_prefill_token_threshold"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be a bool")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark={self.watermark!r} must be in [0, 1)")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(self.max_model_len, 2048)
        if self.num_blocks is None:
            self.num_blocks = self.max_num_seqs * math.ceil(self.max_model_len / self.block_size)
        if self.policy not in CHUNKED_POLICIES and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}: policy {self.policy!r} does not chunk prompts, so a "
                f"whole prompt must fit in one iteration"
            )

    @property
    def token_budget(self) -> int:
        """Tokens one iteration may hold: ``chunk_size`` for chunked policies, else ``max_num_batched_tokens``."""
        return self.chunk_size if self.policy in CHUNKED_POLICIES else self.max_num_batched_tokens

    @property
    def max_running(self) -> int:
        """Requests that may run at once: ``max_num_seqs``, capped by the token budget."""
        return min(self.max_num_seqs, self.token_budget)

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
