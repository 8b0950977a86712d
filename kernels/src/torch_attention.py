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

Index tensors and masks are built in ``plan()`` once per step; the gather buffers persist across steps, since
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

    rows: int64 [b]; their query rows in the flat batch. blocks: int64 [b * P]; their block tables, each padded
    to P = ceil(kv_len / block_size) pages by repeating its last block. kv_len: the longest context in the bucket.
    pad_rows: int64 [p]; rows of the gathered ``[b * P * block_size]`` buffer past each request's own
    context (zeroed after the gather, so stale or uninitialised cache slots cannot turn into NaN).
    mask: float32 [b, 1, 1, kv_len] additive (0 or -inf), or None when nothing is masked.
    """

    rows: torch.Tensor
    blocks: torch.Tensor
    kv_len: int
    pad_rows: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class _Chunk:
    """One request with ``q_len > 1`` (a prefill chunk): query rows ``start:end``, pages ``blocks`` (int64
    [num_blocks]), ``kv_len`` cached + new tokens, and ``mask``: float32 [q_len * group, kv_len] additive,
    rows ordered (query token, head in group); ``None`` for a chunk with nothing cached before it and no
    window (plain causal attention over its own new K/V, no pages read)."""

    start: int
    end: int
    blocks: torch.Tensor | None
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
        self._kbuf = torch.empty(0)
        self._vbuf = torch.empty(0)

    def plan(self, meta: AttentionMetadata) -> None:
        """Split the step's requests into decode buckets and prefill chunks; build their indices and masks.

        Runs once per step on the host; everything it builds is copied to ``meta``'s device once.
        """
        super().plan(meta)
        device = meta.kv_indices.device
        q_lens, kv_lens, bs = meta.q_lens, meta.kv_lens, meta.block_size
        kv_indptr, kv_indices = meta.kv_indptr_host.astype(np.int64), meta.kv_indices_host.astype(np.int64)
        qo_indptr = meta.qo_indptr_host.astype(np.int64)
        num_pages = kv_indptr[1:] - kv_indptr[:-1]
        self._masks = {}

        self._buckets = []
        decodes = np.flatnonzero(q_lens == 1)
        for members in bucket_by_length(kv_lens[decodes], self.bucket_overhead):
            req = decodes[members]
            lens = kv_lens[req]
            kv_len = int(lens.max())
            nb = -(-kv_len // bs)
            page = np.minimum(np.arange(nb)[None, :], num_pages[req][:, None] - 1)
            blocks = kv_indices[kv_indptr[req][:, None] + page]
            cols = np.arange(kv_len)[None, :]
            past_end = cols >= lens[:, None]
            allowed = ~past_end
            if self.window_left >= 0:
                allowed &= cols >= (lens - 1 - self.window_left)[:, None]
            pad = np.flatnonzero(past_end)  # flat index into [b, kv_len] -> row of the [b * nb * bs] buffer
            pad = (pad // kv_len) * (nb * bs) + pad % kv_len
            self._buckets.append(_DecodeBucket(
                rows=torch.from_numpy(qo_indptr[req]).to(device),
                blocks=torch.from_numpy(blocks.reshape(-1)).to(device),
                kv_len=kv_len,
                pad_rows=torch.from_numpy(pad).to(device) if len(pad) else None,
                mask=None if allowed.all() else _additive(allowed[:, None, None, :], device),
            ))

        self._chunks = []
        for i in np.flatnonzero(q_lens > 1):
            q_len, kv_len = int(q_lens[i]), int(kv_lens[i])
            start, end = int(qo_indptr[i]), int(qo_indptr[i + 1])
            if q_len == kv_len and (self.window_left < 0 or self.window_left >= q_len - 1):
                self._chunks.append(_Chunk(start=start, end=end, blocks=None, kv_len=kv_len, mask=None))
                continue
            pos = np.arange(kv_len - q_len, kv_len)[:, None]
            cols = np.arange(kv_len)[None, :]
            allowed = cols <= pos
            if self.window_left >= 0:
                allowed &= cols >= pos - self.window_left
            self._chunks.append(_Chunk(
                start=start,
                end=end,
                blocks=torch.from_numpy(kv_indices[kv_indptr[i]:kv_indptr[i + 1]]).to(device),
                kv_len=kv_len,
                mask=_additive(np.repeat(allowed, self.group, axis=0), device),
            ))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Write the new K/V into ``kv_cache`` and attend every query row over its own request's pages.

        q: [N, num_qo_heads, head_dim]; k, v: [N, num_kv_heads, head_dim], same dtype as ``kv_cache``;
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim], updated in place.
        Returns [N, num_qo_heads, head_dim] in q's dtype (softmax accumulated in float32 by SDPA's kernels).
        """
        meta = self.meta
        kv_cache[meta.slot_block, 0, meta.slot_offset] = k
        kv_cache[meta.slot_block, 1, meta.slot_offset] = v
        out = torch.empty_like(q)
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        for idx, b in enumerate(self._buckets):
            n = len(b.rows)
            keys, values = self._gather(kv_cache, b.blocks, b.pad_rows)
            keys = keys.view(n, -1, hkv, d)[:, :b.kv_len].transpose(1, 2)
            values = values.view(n, -1, hkv, d)[:, :b.kv_len].transpose(1, 2)
            query = q.index_select(0, b.rows).view(n, hkv, g, d)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=self._mask(b.mask, q.dtype, idx),
                                               scale=self.scale)
            out.index_copy_(0, b.rows, o.reshape(n, hkv * g, d))
        for idx, c in enumerate(self._chunks, start=len(self._buckets)):
            if c.mask is None:
                out[c.start:c.end] = self._causal_chunk(q[c.start:c.end], k[c.start:c.end], v[c.start:c.end])
                continue
            q_len = c.end - c.start
            keys, values = self._gather(kv_cache, c.blocks, None)
            keys = keys[:c.kv_len].transpose(0, 1).unsqueeze(0)
            values = values[:c.kv_len].transpose(0, 1).unsqueeze(0)
            query = q[c.start:c.end].view(q_len, hkv, g, d).permute(1, 0, 2, 3).reshape(1, hkv, q_len * g, d)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=self._mask(c.mask, q.dtype, idx),
                                               scale=self.scale)
            out[c.start:c.end] = o.view(hkv, q_len, g, d).permute(1, 0, 2, 3).reshape(q_len, hkv * g, d)
        return out

    def _causal_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a chunk over its own new tokens: q [L, Hq, D], k and v [L, Hkv, D] -> [L, Hq, D].
        Each KV head is repeated for its group's query heads (a copy of L rows: small beside the attention)."""
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
        if self.group > 1:
            keys, values = keys.repeat_interleave(self.group, 0), values.repeat_interleave(self.group, 0)
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                           is_causal=True, scale=self.scale)
        return o[0].transpose(0, 1)

    def _gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor, pad_rows: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the pages ``blocks`` (int64 [P]) of K and V into the persistent buffers.

        Returns two views [P * block_size, num_kv_heads, head_dim]; rows ``pad_rows`` are zeroed.
        """
        page = kv_cache.shape[2:]
        numel = len(blocks) * page.numel()
        if self._kbuf.numel() < numel or self._kbuf.dtype != kv_cache.dtype or self._kbuf.device != kv_cache.device:
            size = max(numel, self._kbuf.numel() * 3 // 2)  # grow geometrically: few reallocations
            self._kbuf = torch.empty(size, dtype=kv_cache.dtype, device=kv_cache.device)
            self._vbuf = torch.empty(size, dtype=kv_cache.dtype, device=kv_cache.device)
        keys = self._kbuf[:numel].view(len(blocks), *page)
        values = self._vbuf[:numel].view(len(blocks), *page)
        torch.index_select(kv_cache[:, 0], 0, blocks, out=keys)
        torch.index_select(kv_cache[:, 1], 0, blocks, out=values)
        keys, values = keys.flatten(0, 1), values.flatten(0, 1)
        if pad_rows is not None:
            keys.index_fill_(0, pad_rows, 0)
            values.index_fill_(0, pad_rows, 0)
        return keys, values

    def _mask(self, mask: torch.Tensor | None, dtype: torch.dtype, idx: int) -> torch.Tensor | None:
        """The planned float32 mask in the query's dtype (SDPA wants them equal), converted once per step."""
        if mask is None or dtype == torch.float32:
            return mask
        converted = self._masks.setdefault(dtype, {})
        if idx not in converted:
            converted[idx] = mask.to(dtype)
        return converted[idx]
