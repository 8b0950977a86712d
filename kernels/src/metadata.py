"""Paged-attention metadata for one step's flat hybrid batch, in FlashInfer's format.

A step runs B requests whose new tokens are concatenated into one flat batch of N query rows. Request ``i``
has ``q_lens[i]`` new tokens and ``kv_lens[i]`` tokens in the cache after this step (context + new), stored in
the blocks ``block_tables[i]`` of a per-layer KV cache ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
(FlashInfer's NHD layout; index 0 of dim 1 is K, 1 is V).

The causal mask is bottom-right aligned: query row ``j`` of request ``i`` (position ``kv_lens[i] - q_lens[i] +
j``) sees cache positions ``0 .. kv_lens[i] - q_lens[i] + j``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    """One step's attention metadata. All index tensors live on ``device``; ``*_host`` are numpy copies.

    qo_indptr: int32 [B + 1]; query rows of request i are ``qo_indptr[i]:qo_indptr[i + 1]`` of the flat batch.
    kv_indptr: int32 [B + 1]; request i's pages are ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``.
    kv_indices: int32 [total_pages]; block ids, each request's block table concatenated.
    kv_last_page_len: int32 [B]; tokens used in each request's last page (1 .. block_size).
    positions: int64 [N]; the position of every query row in its request.
    slot_block, slot_offset: int64 [N]; where each new token's K/V is written: block id and slot in the block.
    batch_indices: int32 [N]; the request each query row belongs to.
    q_lens, kv_lens: int64 [B] host arrays; query length and total KV length (context + new) of each request.
    block_size: tokens per block.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    positions: torch.Tensor
    slot_block: torch.Tensor
    slot_offset: torch.Tensor
    batch_indices: torch.Tensor
    q_lens: np.ndarray
    kv_lens: np.ndarray
    qo_indptr_host: np.ndarray
    kv_indptr_host: np.ndarray
    kv_indices_host: np.ndarray
    kv_last_page_len_host: np.ndarray
    block_size: int

    @property
    def num_requests(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr_host[-1])


def build_attention_metadata(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build the metadata of one step on the host (numpy) and copy it to ``device`` once.

    q_lens[i]: new tokens of request i this step (>= 1). kv_lens[i]: its cached + new tokens (>= q_lens[i]).
    block_tables[i]: its block ids, at least ``ceil(kv_lens[i] / block_size)`` of them (extra ones are ignored).
    """
    q = np.asarray(q_lens, dtype=np.int64)
    kv = np.asarray(kv_lens, dtype=np.int64)
    b = len(q)
    if len(kv) != b or len(block_tables) != b:
        raise ValueError(f"q_lens ({b}), kv_lens ({len(kv)}) and block_tables ({len(block_tables)}) differ in length")
    if b and (q.min() < 1 or (kv < q).any()):
        raise ValueError("every request needs q_len >= 1 and kv_len >= q_len")
    num_pages = -(-kv // block_size)
    kv_indptr = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(num_pages, out=kv_indptr[1:])
    qo_indptr = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(q, out=qo_indptr[1:])
    total_pages = int(kv_indptr[-1])
    kv_indices = np.empty(total_pages, dtype=np.int64)
    for i, table in enumerate(block_tables):
        n = int(num_pages[i])
        if len(table) < n:
            raise ValueError(f"request {i}: block table has {len(table)} blocks, {n} needed for {kv[i]} tokens")
        kv_indices[kv_indptr[i]:kv_indptr[i + 1]] = table[:n]
    last_page_len = kv - (num_pages - 1) * block_size

    n_tok = int(qo_indptr[-1])
    batch_indices = np.repeat(np.arange(b, dtype=np.int64), q)
    # position of each query row: kv_len - q_len + j
    positions = np.arange(n_tok, dtype=np.int64) - np.repeat(qo_indptr[:-1], q) + np.repeat(kv - q, q)
    page_of_token = np.repeat(kv_indptr[:-1], q) + positions // block_size
    slot_block = kv_indices[page_of_token] if n_tok else np.zeros(0, dtype=np.int64)
    slot_offset = positions % block_size

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype, non_blocking=True)

    return AttentionMetadata(
        qo_indptr=dev(qo_indptr, torch.int32),
        kv_indptr=dev(kv_indptr, torch.int32),
        kv_indices=dev(kv_indices, torch.int32),
        kv_last_page_len=dev(last_page_len, torch.int32),
        positions=dev(positions, torch.int64),
        slot_block=dev(slot_block, torch.int64),
        slot_offset=dev(slot_offset, torch.int64),
        batch_indices=dev(batch_indices, torch.int32),
        q_lens=q,
        kv_lens=kv,
        qo_indptr_host=qo_indptr.astype(np.int32),
        kv_indptr_host=kv_indptr.astype(np.int32),
        kv_indices_host=kv_indices.astype(np.int32),
        kv_last_page_len_host=last_page_len.astype(np.int32),
        block_size=block_size,
    )


def scattered_block_tables(kv_lens: Sequence[int], block_size: int, rng: np.random.Generator,
                           spare_blocks: int = 0) -> tuple[list[list[int]], int]:
    """Block tables for requests of ``kv_lens`` tokens on a pool of exactly the blocks they need plus
    ``spare_blocks``, with the block ids shuffled (each table non-contiguous, unused blocks between): the layout
    a paged-attention kernel must handle, for tests and benchmarks. Returns ``(tables, num_blocks)``."""
    pages = [-(-kv // block_size) for kv in kv_lens]
    num_blocks = sum(pages) + spare_blocks
    ids = rng.permutation(num_blocks).tolist()
    bounds = np.cumsum([0, *pages]).tolist()
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])], num_blocks
