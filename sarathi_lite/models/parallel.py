"""Megatron-style tensor-parallel layers and the process-group state they reduce over.

A ``TensorParallel`` names this process's rank among ``size`` ranks; ``TensorParallel.single()`` (size 1) makes
every layer below an ordinary unsharded layer with no communication, so one model class serves both cases.

- ``ColumnParallelLinear``: the output features are split across ranks (QKV, gate/up). A fused projection is
  split per part, so each rank holds its own heads of q, k and v (or its slice of gate and up) back to back.
- ``RowParallelLinear``: the input features are split (o_proj, down_proj); each rank's partial product is summed
  by ONE all-reduce, and the bias is added once, after it.
- ``VocabParallelEmbedding``: each rank holds a contiguous range of vocabulary rows; ids outside it embed to zero
  and one all-reduce sums the ranks.
- ``ParallelLMHead``: each rank scores its vocabulary range; rank 0 gathers the full logits (the only rank that
  samples).

Grouped-query attention: with ``num_kv_heads >= size`` each rank holds ``num_kv_heads / size`` KV heads; with
fewer KV heads than ranks, each KV head is replicated on ``size / num_kv_heads`` ranks (its query heads are split
among them). Anything else is refused by ``check_tensor_parallel`` (``models.config``) with the numbers.

On the CPU, ``pack_weights`` gives each projection a copy of its bfloat16 or float32 weight in the blocked layout
oneDNN's matmul reads fastest (``torch.ops.mkldnn``; the layout the CPU's AMX / AVX-512 kernels block it into on
every call otherwise); ``linear`` uses it while the weight is unchanged since, for at least ``PACKED_MIN_ROWS``
rows of its dtype up to ``PACKED_MAX_ROWS`` (above ``PACKED_EXACT_ROWS`` the rows padded to a multiple of it:
oneDNN keeps one primitive per shape it has run, about 0.6 MiB each, so the row counts it sees are kept to a few),
and ``nn.functional.linear`` otherwise.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sarathi_lite.kernels.cpu_native import native_enabled
from sarathi_lite.models.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` in ``0 .. size - 1``; ``group`` the
    ``torch.distributed`` process group of the forward pass's collectives (``None``: the default group).
    comm_seconds: host seconds spent in this rank's collectives so far, waiting for slower ranks included (on
    CUDA only the launches: NCCL runs asynchronously). root: the global rank of the group's rank 0 (a pipeline
    stage's group starts past 0), where ``gather_last_dim`` gathers."""

    rank: int = 0
    size: int = 1
    group: Any = None
    comm_seconds: float = 0.0
    root: int = 0

    @classmethod
    def single(cls) -> TensorParallel:
        return cls()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (a no-op on one rank)."""
        if self.size > 1:
            t0 = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            self.comm_seconds += time.perf_counter() - t0
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' ``x`` ([M, n] each) concatenated to [M, size * n]; other ranks: ``None``."""
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=self.root, group=self.group)
        self.comm_seconds += time.perf_counter() - t0
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


@dataclass(slots=True, frozen=True)
class AttentionShard:
    """The heads rank ``rank`` holds: query heads ``q_start .. q_start + num_heads``, KV heads
    ``kv_start .. kv_start + num_kv_heads`` (of the full model's)."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @classmethod
    def of(cls, cfg: ModelConfig, tp: TensorParallel) -> AttentionShard:
        num_heads = cfg.num_heads // tp.size
        num_kv = cfg.kv_heads_per_rank(tp.size)
        return cls(num_heads, num_kv, tp.rank * num_heads, tp.rank * cfg.num_kv_heads // tp.size)


PACK_BATCH_HINT = 32
"""The rows (tokens) oneDNN is told to expect when it picks a packed weight's layout: a decode step's size; any
number of rows runs on it."""


PACKED_MIN_ROWS = {torch.bfloat16: 1, torch.float32: 4}
"""The rows (tokens) from which a projection reads its packed copy, per dtype (up to ``PACKED_MAX_ROWS``). float32
below 4 rows keeps ``nn.functional.linear`` (MKL's matrix-vector path; measured on SmolLM2 on this
project's 2-core CPU, a 1/2/3/4/8-decode step: plain 45/53/55/75/98 ms, packed 52/58/60/64/74 ms). bfloat16 reads it
from one row on (1/4/8 decodes: plain 46/51/53 ms, packed 38/41/45 ms)."""


PACKED_MAX_ROWS = 64
"""The most rows (a decode step's size) that read the packed copy. oneDNN caches a primitive for every row count
it runs (up to 1024 of them), about 0.6 MiB each: measured, 300 row counts x 4 projection shapes grew a
process by 690 MiB, packed or not (bfloat16 ``nn.functional.linear`` runs on oneDNN too). So the packed path
takes up to 64 rows, exact up to ``PACKED_EXACT_ROWS`` and padded to a multiple of it above: at most 19 row counts
per shape. Larger (prefill) steps are compute-bound, and the packed copy gains nothing there (a 512-token chunk:
equal within 2% in both dtypes)."""

PACKED_EXACT_ROWS = 16
"""Row counts up to this reach oneDNN as they are; above, they are padded to a multiple of it. Padding costs: a
step of 5 (12) decodes padded to 8 (16) rows took 2-4 ms longer in bfloat16 and 9-13 ms longer in float32 than
unpadded (SmolLM2), so the small counts of online decode steps are not padded."""


@functools.cache
def cpu_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs and multiplies ``dtype`` weights, decided once per process by one trial on a
    small weight. oneDNN's bfloat16 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and raises ``RuntimeError``
    on an AVX2-only CPU; float32 packs on any x86 CPU oneDNN supports. Where it cannot, the projections keep
    reading their plain weight through ``nn.functional.linear`` (logged once at INFO)."""
    if dtype not in PACKED_MIN_ROWS or not torch.backends.mkldnn.is_available() \
            or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        with torch.no_grad():
            w = torch.ones(16, 16, dtype=dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
            y = torch.ops.mkldnn._linear_pointwise(torch.ones(PACKED_MIN_ROWS[dtype], 16, dtype=dtype), packed,
                                                   None, "none", [], "")
        ok = bool((y == 16).all())
    except RuntimeError as e:
        logger.info("this CPU cannot pack %s weights for oneDNN (%s): projections read their plain weight",
                    dtype, str(e).splitlines()[0])
        return False
    if not ok:
        logger.info("oneDNN's packed %s product is wrong on this CPU: projections read their plain weight", dtype)
    return ok


def _can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dim() == 2 and cpu_packs(weight.dtype)


class PackedWeight(nn.Module):
    """A projection whose ``weight`` ([out, in]) may carry a packed copy (``pack``, see the module docstring)."""

    weight: nn.Parameter
    _packed: torch.Tensor | None = None
    _packed_version = -1

    def pack(self) -> bool:
        """Make (or drop) the packed copy of ``weight``; returns whether it has one now."""
        w = self.weight
        if not _can_pack(w):
            self._packed = None
            return False
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT)
        self._packed_version = w._version
        return True

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``, on the packed copy when it is current (the weight not written since)."""
        packed = self._packed
        if (packed is not None and x.dtype == packed.dtype and x.device.type == "cpu" and x.dim() == 2
                and PACKED_MIN_ROWS[x.dtype] <= x.shape[0] <= PACKED_MAX_ROWS
                and self._packed_version == self.weight._version and not torch.is_grad_enabled()):
            rows = x.shape[0]
            padded = rows if rows <= PACKED_EXACT_ROWS else -(-rows // PACKED_EXACT_ROWS) * PACKED_EXACT_ROWS
            if padded != rows:  # zero rows: their outputs are computed and dropped
                x = nn.functional.pad(x, (0, 0, 0, padded - rows))
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]
        return nn.functional.linear(x, self.weight, bias)


def pack_weights(model: nn.Module) -> int:
    """Pack every projection of ``model`` that can be (bfloat16 or float32 on the CPU with oneDNN; see the module
    docstring); returns how many were. Costs one more copy of those weights in memory. ``SARATHI_LITE_NATIVE=0``
    (the switch of every CPU fast path, ``kernels.cpu_native``) packs none."""
    if not native_enabled():
        return 0
    return sum(m.pack() for m in model.modules() if isinstance(m, PackedWeight))


class ColumnParallelLinear(PackedWeight):
    """``y = x @ W.T + b`` with the output features split across ranks.

    parts: ``(full_size, start, size)`` per fused part: this rank holds rows ``start .. start + size`` of a part
    of ``full_size`` output features; the local weight is the parts' rows stacked, ``[sum(size), in_features]``.
    forward: x [N, in_features] -> [N, sum(size)] (this rank's features; no communication).
    """

    def __init__(self, in_features: int, parts: list[tuple[int, int, int]], bias: bool) -> None:
        super().__init__()
        self.parts = parts
        out = sum(size for _, _, size in parts)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def shard(self, part: int, full: Any) -> tuple[int, int, Any]:
        """``(offset, size, rows)``: where part ``part``'s shard goes in this layer's parameters and the rows of
        ``full`` (a tensor or a safetensors slice, output features first) that belong to it."""
        offset = sum(size for _, _, size in self.parts[:part])
        _, start, size = self.parts[part]
        return offset, size, full[start:start + size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class RowParallelLinear(PackedWeight):
    """``y = x @ W.T + b`` with the input features split: this rank holds columns ``start .. start + size`` of
    ``W`` ([out_features, size]) and sums its partial product with the other ranks' in one all-reduce.

    forward: x [N, size] (this rank's features) -> [N, out_features] (the full output, on every rank).
    """

    def __init__(self, start: int, size: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.start, self.size, self.tp = start, size, tp
        self.weight = nn.Parameter(torch.empty(out_features, size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def shard(self, full: Any) -> Any:
        """This rank's columns of ``full`` ([out_features, in_features], tensor or safetensors slice)."""
        return full[:, self.start:self.start + self.size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """``(start, stop, rows)``: this rank's vocabulary ids ``start .. stop`` and its padded row count (the
    same on every rank, ``ceil(vocab_size / size)``)."""
    rows = -(-vocab_size // tp.size)
    start = min(vocab_size, tp.rank * rows)
    return start, min(vocab_size, start + rows), rows


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks. forward: ids [N] int64 -> [N, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.stop, rows = vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def shard(self, full: Any) -> Any:
        """This rank's rows of ``full`` ([vocab_size, hidden]); the padding rows beyond ``stop`` stay zero."""
        return full[self.start:self.stop]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(PackedWeight):
    """The output projection with the vocabulary split like ``VocabParallelEmbedding`` (whose weight it shares
    when the embeddings are tied). forward: hidden [M, hidden] -> logits [M, vocab_size] float32 on rank 0,
    ``None`` on the other ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.start, self.stop, rows = vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def shard(self, full: Any) -> Any:
        return full[self.start:self.stop]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_last_dim(self.linear(hidden).float())
        return None if logits is None else logits[:, :self.vocab_size]
