"""Paged attention in plain PyTorch: the reference backend, on any device.

Work stays proportional to each request's own context, and grouped-query heads are never copied out:

* decodes (``q_len == 1``) are sorted by context length and cut into a few buckets (a small dynamic program
  trades padding against per-bucket overhead); each bucket gathers its requests' pages into
  ``[b, L, Hkv, D]`` (L = the bucket's longest context) and runs ONE ``scaled_dot_product_attention`` with the
  query viewed as ``[b, Hkv, group, D]``, i.e. the ``group`` query heads that share a KV head become rows of the
  same matrix product;
* every other request (prefill chunks, which are few per step) runs one SDPA call. A chunk with nothing cached
  before it (a prompt's first chunk, no sliding window) attends only to its own new K/V: they are taken from the
  step's ``k``/``v`` (no gather from the cache), its KV heads repeated per group, and SDPA's causal flag does
  the masking (its CPU flash kernel then skips the blocks above the diagonal: half the work, no mask to read).
  A later chunk gathers its pages, with the query rearranged to ``[Hkv, q_len * group, D]`` and a bottom-right
  causal mask.

Gathers read the cache as rows: a layer's cache ``[num_blocks, 2, block_size, Hkv, D]`` viewed as
``[num_blocks * 2 * block_size, Hkv, D]`` has K of (block, slot) at row ``(2 * block) * block_size + slot`` and
its V ``block_size`` rows further, so ONE ``index_select`` per bucket copies K and V together, exactly the
bucket's ``kv_len`` columns per request (no page rounding). A padding column past a request's context reads the
request's own token 0 instead (a written, finite row), so no zero fill is needed: its mask is ``-inf``, its
softmax weight exactly 0, and the result is bit for bit what zeroed padding gives. The row indices (of the
gathers and of the new K/V writes) depend only on the step's block tables, so ``plan()`` builds them once per
step for every layer.

Index tensors and masks are built in ``plan()`` once per step; the gather buffer persists across steps, since
on CPU a fresh multi-megabyte allocation per layer costs more than the attention itself (page faults).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .backend import AttentionBackend
from .metadata import AttentionMetadata


@dataclass(slots=True)
class _DecodeBucket:
    """Decodes attended in one SDPA call.

    rows: int64 [b]; their query rows in the flat batch. cache_rows: int64 [b * 2 * kv_len]; the cache rows
    (module docstring) gathered as ``[b, 2 (K, V), kv_len]``, columns past a request's context reading its
    token 0. kv_len: the longest context in the bucket.
    mask: float32 [b, 1, 1, kv_len] additive (0 or -inf), or None when nothing is masked.
    """

    rows: torch.Tensor
    cache_rows: torch.Tensor
    kv_len: int
    mask: torch.Tensor | None


@dataclass(slots=True)
class _Chunk:
    """One request with ``q_len > 1`` (a prefill chunk): query rows ``start:end``, ``cache_rows`` (int64
    [2 * kv_len]: its K rows then its V rows, module docstring), ``kv_len`` cached + new tokens, and ``mask``:
    float32 [q_len * group, kv_len] additive, rows ordered (query token, head in group); ``None`` for a chunk
    with nothing cached before it and no window (plain causal attention over its own new K/V, no pages read)."""

    start: int
    end: int
    cache_rows: torch.Tensor | None
    kv_len: int
    mask: torch.Tensor | None


def bucket_by_length(lengths: np.ndarray, overhead: float) -> list[np.ndarray]:
    """Split requests into buckets that each pad to their longest member, minimising total cost.

    lengths: int [n] context lengths. overhead: the fixed cost of one bucket, in padded tokens.
    Cost of a bucket = ``overhead + size * max_length``. Returns index arrays into ``lengths`` (ascending length
    within a bucket, buckets in ascending order); O(n^2) numpy work, fine for a step's few hundred decodes.
    """
    n = len(lengths)
    order = np.argsort(lengths, kind="stable")
    srt = lengths[order].astype(np.float64)
    best = np.zeros(n + 1)
    cut = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        starts = np.arange(j)
        cost = best[:j] + overhead + (j - starts) * srt[j - 1]
        i = int(np.argmin(cost))
        best[j], cut[j] = cost[i], i
    buckets = []
    j = n
    while j > 0:
        buckets.append(order[cut[j]:j])
        j = int(cut[j])
    return buckets[::-1]


def _additive(allowed: np.ndarray, device: torch.device) -> torch.Tensor:
    """bool mask (True = attend) -> float32 tensor of 0 / -inf on ``device``."""
    mask = np.where(allowed, np.float32(0.0), np.float32(-np.inf))
    return torch.from_numpy(mask).to(device)


class TorchPagedAttention(AttentionBackend):
    """Reference paged attention over a hybrid batch (see the module docstring for the algorithm).

    bucket_overhead: cost of one extra decode bucket, in padded context tokens (measured on a 2-core CPU:
    one bucket's fixed cost is about the gather + attention time of a few hundred padded tokens).
    """

    name = "torch"

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 window_left: int = -1, bucket_overhead: float = 256.0) -> None:
        super().__init__(num_qo_heads, num_kv_heads, head_dim, scale, window_left)
        self.group = num_qo_heads // num_kv_heads
        self.bucket_overhead = bucket_overhead
        self._buckets: list[_DecodeBucket] = []
        self._chunks: list[_Chunk] = []
        self._masks: dict[torch.dtype, dict[int, torch.Tensor]] = {}
        self._write_rows = torch.empty(0, dtype=torch.int64)
        self._buf = torch.empty(0)

    def plan(self, meta: AttentionMetadata) -> None:
        """Split the step's requests into decode buckets and prefill chunks; build their indices and masks.

        Runs once per step on the host; everything it builds is copied to ``meta``'s device once.
        """
        super().plan(meta)
        self._masks = {}
        # the new tokens' K rows then their V rows (module docstring), where every layer writes them
        k_rows = (meta.slot_block * 2) * meta.block_size + meta.slot_offset
        self._write_rows = torch.cat([k_rows, k_rows + meta.block_size])
        pages = (meta.qo_indptr_host.astype(np.int64), meta.kv_indptr_host.astype(np.int64),
                 meta.kv_indices_host.astype(np.int64))  # converted once per step, for both planners
        self._buckets = self._plan_decodes(meta, *pages)
        self._chunks = self._plan_chunks(meta, *pages)

    def _plan_decodes(self, meta: AttentionMetadata, qo_indptr: np.ndarray, kv_indptr: np.ndarray,
                      kv_indices: np.ndarray) -> list[_DecodeBucket]:
        device, bs, kv_lens = meta.kv_indices.device, meta.block_size, meta.kv_lens
        buckets = []
        decodes = np.flatnonzero(meta.q_lens == 1)
        for members in bucket_by_length(kv_lens[decodes], self.bucket_overhead):
            req = decodes[members]
            lens = kv_lens[req]
            kv_len = int(lens.max())
            cols = np.arange(kv_len)[None, :]
            past_end = cols >= lens[:, None]
            pos = np.where(past_end, 0, cols)  # padding reads the request's own token 0 (masked out)
            k_rows = (kv_indices[kv_indptr[req][:, None] + pos // bs] * 2) * bs + pos % bs
            allowed = ~past_end
            if self.window_left >= 0:
                allowed &= cols >= (lens - 1 - self.window_left)[:, None]
            buckets.append(_DecodeBucket(
                rows=torch.from_numpy(qo_indptr[req]).to(device),
                cache_rows=torch.from_numpy(np.stack([k_rows, k_rows + bs], axis=1).reshape(-1)).to(device),
                kv_len=kv_len,
                mask=None if allowed.all() else _additive(allowed[:, None, None, :], device),
            ))
        return buckets

    def _plan_chunks(self, meta: AttentionMetadata, qo_indptr: np.ndarray, kv_indptr: np.ndarray,
                     kv_indices: np.ndarray) -> list[_Chunk]:
        device, bs = meta.kv_indices.device, meta.block_size
        chunks = []
        for i in np.flatnonzero(meta.q_lens > 1):
            q_len, kv_len = int(meta.q_lens[i]), int(meta.kv_lens[i])
            start, end = int(qo_indptr[i]), int(qo_indptr[i + 1])
            if q_len == kv_len and (self.window_left < 0 or self.window_left >= q_len - 1):
                chunks.append(_Chunk(start=start, end=end, cache_rows=None, kv_len=kv_len, mask=None))
                continue
            pos = np.arange(kv_len - q_len, kv_len)[:, None]
            cols = np.arange(kv_len)[None, :]
            allowed = cols <= pos
            if self.window_left >= 0:
                allowed &= cols >= pos - self.window_left
            k_rows = (kv_indices[kv_indptr[i] + cols[0] // bs] * 2) * bs + cols[0] % bs
            chunks.append(_Chunk(
                start=start,
                end=end,
                cache_rows=torch.from_numpy(np.concatenate([k_rows, k_rows + bs])).to(device),
                kv_len=kv_len,
                mask=_additive(np.repeat(allowed, self.group, axis=0), device),
            ))
        return chunks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Write the new K/V into ``kv_cache`` and attend every query row over its own request's pages.

        q: [N, num_qo_heads, head_dim]; k, v: [N, num_kv_heads, head_dim], same dtype as ``kv_cache``;
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim], updated in place.
        Returns [N, num_qo_heads, head_dim] in q's dtype (softmax accumulated in float32 by SDPA's kernels).
        """
        rows = self._write(kv_cache, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._attend_decodes(q, rows, out)
        self._attend_chunks(q, k, v, rows, out)
        return out

    def _attend_decodes(self, q: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
        """The decode buckets: one gather and one SDPA call each, written into their rows of ``out``."""
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        for idx, b in enumerate(self._buckets):
            n = len(b.rows)
            kv = self._gather(rows, b.cache_rows).view(n, 2, b.kv_len, hkv, d)
            keys, values = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
            query = q.index_select(0, b.rows).view(n, hkv, g, d)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=self._mask(b.mask, q.dtype, idx),
                                               scale=self.scale)
            out.index_copy_(0, b.rows, o.reshape(n, hkv * g, d))

    def _attend_chunks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                       out: torch.Tensor) -> None:
        """The prefill chunks, one SDPA call each (the first chunk of a prompt without reading the cache)."""
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        for idx, c in enumerate(self._chunks, start=len(self._buckets)):
            if c.mask is None:
                out[c.start:c.end] = self._causal_chunk(q[c.start:c.end], k[c.start:c.end], v[c.start:c.end])
                continue
            q_len = c.end - c.start
            kv = self._gather(rows, c.cache_rows).view(2, c.kv_len, hkv, d)
            keys, values = kv[0].transpose(0, 1).unsqueeze(0), kv[1].transpose(0, 1).unsqueeze(0)
            query = q[c.start:c.end].view(q_len, hkv, g, d).permute(1, 0, 2, 3).reshape(1, hkv, q_len * g, d)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=self._mask(c.mask, q.dtype, idx),
                                               scale=self.scale)
            out[c.start:c.end] = o.view(hkv, q_len, g, d).permute(1, 0, 2, 3).reshape(q_len, hkv * g, d)

    def _write(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the step's K/V at their planned rows; return the cache as rows ``[num_blocks * 2 * block_size,
        num_kv_heads, head_dim]`` (a view; a copy taken after the write if the cache is not contiguous)."""
        if not kv_cache.is_contiguous():
            meta = self.meta
            kv_cache[meta.slot_block, 0, meta.slot_offset] = k
            kv_cache[meta.slot_block, 1, meta.slot_offset] = v
            return kv_cache.reshape(-1, self.num_kv_heads, self.head_dim)
        rows = kv_cache.view(-1, self.num_kv_heads, self.head_dim)
        n = k.shape[0]
        rows.index_copy_(0, self._write_rows[:n], k.to(kv_cache.dtype))
        rows.index_copy_(0, self._write_rows[n:], v.to(kv_cache.dtype))
        return rows

    def _causal_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a chunk over its own new tokens: q [L, Hq, D], k and v [L, Hkv, D] -> [L, Hq, D].
        Each KV head is repeated for its group's query heads (a copy of L rows: small beside the attention)."""
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
        if self.group > 1:
            keys, values = keys.repeat_interleave(self.group, 0), values.repeat_interleave(self.group, 0)
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                           is_causal=True, scale=self.scale)
        return o[0].transpose(0, 1)

    def _gather(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Copy the cache rows ``index`` (int64 [R]) into the persistent buffer: one ``index_select`` for K and V
        together. rows: the cache as rows (``_write``). Returns a view [R, num_kv_heads, head_dim]."""
        row = rows.shape[1:]
        numel = len(index) * row.numel()
        if self._buf.numel() < numel or self._buf.dtype != rows.dtype or self._buf.device != rows.device:
            size = max(numel, self._buf.numel() * 3 // 2)  # grow geometrically: few reallocations
            self._buf = torch.empty(size, dtype=rows.dtype, device=rows.device)
        out = self._buf[:numel].view(len(index), *row)
        torch.index_select(rows, 0, index, out=out)
        return out

    def _mask(self, mask: torch.Tensor | None, dtype: torch.dtype, idx: int) -> torch.Tensor | None:
        """The planned float32 mask in the query's dtype (SDPA wants them equal), converted once per step."""
        if mask is None or dtype == torch.float32:
            return mask
        converted = self._masks.setdefault(dtype, {})
        if idx not in converted:
            converted[idx] = mask.to(dtype)
        return converted[idx]
