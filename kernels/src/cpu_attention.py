"""Paged attention for the CPU: decodes in the compiled kernel, prefill chunks as in the torch backend.

On the CPU the torch path's decode buckets spend most of their time copying: each bucket gathers its requests' K
and V rows into a padded buffer (``index_select``), then SDPA reads that copy again, with a few query rows per
(request, KV head) at a time. The compiled kernel (``cpu_native``, ``csrc/paged_decode.c``) reads every
decode's K and V rows straight from their pages instead, once, with all the query heads of a KV head group sharing
each row read: about 2x faster than gather + SDPA for a decode-heavy step's attention on this project's 2-core
CPU (bfloat16 and float32), and no padding. Prefill chunks keep the torch backend's path (SDPA's flash kernel,
with large query blocks, is efficient there).

The kernel accumulates in float32, as SDPA does; its results differ from the torch path only by rounding order
(``tests/test_cpu_attention.py`` bounds the difference; the engine's Hugging Face parity tests run on it).
"""

from __future__ import annotations

import numpy as np
import torch

from .cpu_native import paged_decode_library, unsupported
from .metadata import AttentionMetadata
from .torch_attention import TorchPagedAttention

DTYPES = (torch.float32, torch.bfloat16)
PARALLEL_GRAIN = 1 << 12
"""Query-head x context-token dot products below which the kernel runs on one thread (about one decode of 450
tokens with 9 query heads): a parallel region costs a barrier, more than such a call's work. Above it, even a
few decodes gain from a second thread (the kernel then splits their KV heads over tasks): in an engine step their
K/V rows come from memory, and one thread alone cannot draw the bandwidth (measured on this project's 2-core CPU:
4 decodes of 300-600 tokens, SmolLM2 bfloat16, attention 12.4 ms per step on one thread, 9.0 ms on two)."""


class CpuPagedAttention(TorchPagedAttention):
    """``TorchPagedAttention`` with its decodes (``q_len == 1``) computed by the compiled kernel.

    Raises RuntimeError when the kernel is unavailable (no compiler, ``SARATHI_LITE_NATIVE=0``) and ValueError for
    an attention shape it does not take; ``get_attention_backend("auto", ...)`` checks both first.
    """

    name = "cpu"

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 window_left: int = -1) -> None:
        super().__init__(num_qo_heads, num_kv_heads, head_dim, scale, window_left)
        why = unsupported(head_dim, self.group, num_qo_heads)
        if why:
            raise ValueError(f"the compiled CPU decode attention does not take {why}")
        self._lib = paged_decode_library()
        if self._lib is None:
            raise RuntimeError("the compiled CPU decode attention is unavailable (see the log; "
                               "SARATHI_LITE_NATIVE=0 turns it off); use attention_backend='torch'")
        self._decodes: tuple[np.ndarray, ...] = ()
        self._threads = 1

    def _plan_decodes(self, meta: AttentionMetadata, qo_indptr: np.ndarray, kv_indptr: np.ndarray,
                      kv_indices: np.ndarray) -> list:
        """The decodes' query rows, context lengths and page-table offsets (host arrays the kernel reads),
        longest context first so the threads' dynamic schedule ends evenly. No buckets: nothing is gathered."""
        if meta.kv_indices.device.type != "cpu":
            raise ValueError(f"CpuPagedAttention runs on the CPU, not {meta.kv_indices.device}")
        decodes = np.flatnonzero(meta.q_lens == 1)
        req = decodes[np.argsort(-meta.kv_lens[decodes], kind="stable")]
        self._decodes = (np.ascontiguousarray(qo_indptr[req]), np.ascontiguousarray(meta.kv_lens[req]),
                         np.ascontiguousarray(kv_indptr[req]),
                         np.ascontiguousarray(meta.kv_indices_host, dtype=np.int32))
        work = int(meta.kv_lens[req].sum()) * self.num_qo_heads
        # tasks: a decode each, or a range of its KV heads each when there are few decodes (the kernel splits)
        self._threads = 1 if work < PARALLEL_GRAIN else max(1, min(torch.get_num_threads(),
                                                                   len(req) * self.num_kv_heads))
        return []

    def _attend_decodes(self, q: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
        q_rows, kv_lens, kv_starts, pages = self._decodes
        if not len(q_rows):
            return
        if q.dtype not in DTYPES or rows.dtype != q.dtype:
            raise ValueError(f"the compiled CPU decode attention runs float32 or bfloat16 with the cache in the "
                             f"query's dtype, not q {q.dtype} and cache {rows.dtype}")
        if q.stride(2) != 1 or q.stride(1) != self.head_dim:
            q = q.contiguous()
        if not rows.is_contiguous():  # a strided cache (written already): the kernel reads a dense copy
            rows = rows.contiguous()
        code = self._lib.paged_decode(
            q.data_ptr(), rows.data_ptr(), out.data_ptr(), q_rows.ctypes.data, q.stride(0), out.stride(0),
            kv_lens.ctypes.data, kv_starts.ctypes.data, pages.ctypes.data, len(q_rows), self.num_kv_heads,
            self.group, self.head_dim, self.meta.block_size, self.scale, self.window_left, self._threads,
            int(q.dtype == torch.bfloat16))
        if code != 0:
            raise ValueError(f"the compiled CPU decode attention refused head_dim {self.head_dim}, "
                             f"group {self.group}")
