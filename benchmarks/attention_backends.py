"""Time one layer of paged attention on a SmolLM2-135M-shaped hybrid batch, per backend.

Backends: ``TorchPagedAttention`` (the reference), a dense packed baseline in the style of Hugging Face's
continuous batching (all requests of the step in one sequence with a ``[total_q, total_kv]`` mask and K/V heads
repeated per group), and ``FlashInferAttention`` when CUDA and flashinfer-python are present. For scale it also
times the layer's MLP matmuls (576 -> 2x1536 -> 576) on the same number of tokens.

Each layer reads its own KV cache (``--layers`` of them, cycled), so the caches do not all sit in the CPU's
last-level cache as a single reused tensor would. Prints a table and writes JSON (default
``results/attention_backends.json``).

    python benchmarks/attention_backends.py [--decodes 32 --chunk 256 --chunk-context 512 --device cpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from sarathi_lite.kernels import (
    AttentionMetadata,
    TorchPagedAttention,
    build_attention_metadata,
    flashinfer_available,
    scattered_block_tables,
)

HQ, HKV, D, HIDDEN, INTERMEDIATE = 9, 3, 64, 576, 1536


def make_batch(decodes: int, chunks: int, chunk: int, chunk_context: int, block_size: int, ctx_range: tuple[int, int],
               seed: int) -> tuple[list[int], list[int], list[list[int]], int]:
    """Random hybrid batch: decode contexts ~ U(ctx_range), then ``chunks`` prefill chunks of ``chunk`` tokens
    after ``chunk_context`` cached ones. Returns q_lens, kv_lens, shuffled block tables, number of blocks."""
    rng = np.random.default_rng(seed)
    q_lens = [1] * decodes + [chunk] * chunks
    kv_lens = [int(x) + 1 for x in rng.integers(ctx_range[0], ctx_range[1] + 1, decodes)]
    kv_lens += [chunk_context + chunk] * chunks
    tables, num_blocks = scattered_block_tables(kv_lens, block_size, rng)
    return q_lens, kv_lens, tables, num_blocks


class DensePacked:
    """Baseline: one SDPA over the whole step packed as one sequence, block-diagonal bottom-right causal mask
    ``[total_q, total_kv]``, K/V gathered in full and repeated per query head (``repeat_kv``)."""

    name = "dense-packed"

    def plan(self, meta: AttentionMetadata) -> None:
        kv_indptr, bs = meta.kv_indptr_host, meta.block_size
        token_index, allowed_rows = [], []
        kv_off = 0
        total_kv = int(meta.kv_lens.sum())
        for i, (ql, kl) in enumerate(zip(meta.q_lens, meta.kv_lens)):
            blocks = meta.kv_indices_host[kv_indptr[i]:kv_indptr[i + 1]].astype(np.int64)
            pos = np.arange(kl)
            token_index.append(blocks[pos // bs] * bs + pos % bs)
            rows = np.zeros((ql, total_kv), dtype=bool)
            rows[:, kv_off:kv_off + kl] = np.arange(kl)[None, :] <= np.arange(kl - ql, kl)[:, None]
            allowed_rows.append(rows)
            kv_off += kl
        device = meta.kv_indices.device
        self.token_index = torch.from_numpy(np.concatenate(token_index)).to(device)
        self.mask = torch.from_numpy(np.concatenate(allowed_rows)).to(device)
        self.meta = meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        kv_cache[meta.slot_block, 0, meta.slot_offset] = k
        kv_cache[meta.slot_block, 1, meta.slot_offset] = v
        flat = kv_cache.transpose(0, 1).flatten(1, 2)  # [2, num_blocks * block_size, Hkv, D]
        keys = flat[0].index_select(0, self.token_index).repeat_interleave(HQ // HKV, dim=1)
        values = flat[1].index_select(0, self.token_index).repeat_interleave(HQ // HKV, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                           attn_mask=self.mask)
        return o.transpose(0, 1)


def time_layers(run_layer: Callable[[int], object], layers: int, repeats: int, sync: Callable[[], None]
                ) -> list[float]:
    """Per-layer seconds of ``repeats`` sweeps over all layers (after one warm-up sweep)."""
    for i in range(layers):
        run_layer(i)
    sync()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(layers):
            run_layer(i)
        sync()
        out.append((time.perf_counter() - start) / layers)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=1, help="prefill chunks in the batch")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per prefill chunk")
    ap.add_argument("--chunk-context", type=int, default=512, help="cached tokens before each chunk")
    ap.add_argument("--ctx-min", type=int, default=100)
    ap.add_argument("--ctx-max", type=int, default=1200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8, help="distinct KV caches cycled through")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU, "
                                                 "bfloat16 on CUDA)")
    ap.add_argument("--skip-dense", action="store_true", help="skip the dense packed baseline")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/attention_backends.json")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    q_lens, kv_lens, tables, num_blocks = make_batch(args.decodes, args.chunks, args.chunk, args.chunk_context,
                                                     args.block_size, (args.ctx_min, args.ctx_max), args.seed)
    n_tok = sum(q_lens)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    caches = [torch.randn(num_blocks, 2, args.block_size, HKV, D, generator=gen, device=device, dtype=dtype)
              for _ in range(args.layers)]
    q = torch.randn(n_tok, HQ, D, generator=gen, device=device, dtype=dtype)
    k = torch.randn(n_tok, HKV, D, generator=gen, device=device, dtype=dtype)
    v = torch.randn(n_tok, HKV, D, generator=gen, device=device, dtype=dtype)

    backends: list = [TorchPagedAttention(HQ, HKV, D)]
    if not args.skip_dense:
        backends.append(DensePacked())
    if device.type == "cuda" and flashinfer_available():
        from sarathi_lite.kernels import FlashInferAttention

        backends.append(FlashInferAttention(HQ, HKV, D, device=device))

    rows = []
    reference = None
    for be in backends:
        t0 = time.perf_counter()
        meta = build_attention_metadata(q_lens, kv_lens, tables, args.block_size, device)
        be.plan(meta)
        sync()
        plan_s = time.perf_counter() - t0
        times = time_layers(lambda i, be=be: be.forward(q, k, v, caches[i]), args.layers, args.repeats, sync)
        out = be.forward(q, k, v, caches[0]).float()
        reference = out if reference is None else reference
        rel = float((out - reference).norm() / reference.norm())
        rows.append(dict(backend=be.name, plan_ms=plan_s * 1e3, layer_ms=statistics.median(times) * 1e3,
                         layer_ms_min=min(times) * 1e3, rel_err_vs_torch=rel))

    w_gate_up = torch.randn(HIDDEN, 2 * INTERMEDIATE, generator=gen, device=device, dtype=dtype) * 0.02
    w_down = torch.randn(INTERMEDIATE, HIDDEN, generator=gen, device=device, dtype=dtype) * 0.02
    x = torch.randn(n_tok, HIDDEN, generator=gen, device=device, dtype=dtype)

    def mlp(_: int) -> torch.Tensor:
        h = x @ w_gate_up
        return (F.silu(h[:, :INTERMEDIATE]) * h[:, INTERMEDIATE:]) @ w_down

    mlp_times = time_layers(mlp, args.layers, args.repeats, sync)
    rows.append(dict(backend="mlp-matmuls (reference)", plan_ms=0.0, layer_ms=statistics.median(mlp_times) * 1e3,
                     layer_ms_min=min(mlp_times) * 1e3, rel_err_vs_torch=float("nan")))

    dec_ctx = np.asarray(kv_lens[:args.decodes])
    kv_bytes = int(sum(kv_lens)) * 2 * HKV * D * caches[0].element_size()
    print(f"batch: {args.decodes} decodes (context mean {dec_ctx.mean() if len(dec_ctx) else 0:.0f}), "
          f"{args.chunks} x {args.chunk}-token chunks after {args.chunk_context} cached; {n_tok} query tokens, "
          f"{sum(kv_lens)} KV tokens ({kv_bytes / 2**20:.1f} MiB per layer); {device} {dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'backend':26s} {'layer ms (median)':>18s} {'min':>8s} {'plan ms':>8s} {'rel err':>9s}")
    for r in rows:
        print(f"{r['backend']:26s} {r['layer_ms']:18.2f} {r['layer_ms_min']:8.2f} {r['plan_ms']:8.2f} "
              f"{r['rel_err_vs_torch']:9.1e}")

    result = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), machine=platform.processor() or
                  platform.machine(), torch=torch.__version__, threads=torch.get_num_threads(), device=str(device),
                  dtype=str(dtype), config=vars(args), num_query_tokens=n_tok, num_kv_tokens=int(sum(kv_lens)),
                  kv_mib_per_layer=kv_bytes / 2**20, rows=rows)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
