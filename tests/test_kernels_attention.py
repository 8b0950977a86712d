"""TorchPagedAttention against plain dense attention computed per request, and the backend factory."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import sarathi_lite.kernels as kernels
from sarathi_lite.kernels import (
    AttentionMetadata,
    CpuPagedAttention,
    TorchPagedAttention,
    build_attention_metadata,
    flashinfer_available,
    get_attention_backend,
    scattered_block_tables,
)
from sarathi_lite.kernels.torch_attention import bucket_by_length

D = 16


@dataclass
class PagedCase:
    """A step's batch over a paged cache: ``cache`` holds every request's earlier context (NaN elsewhere),
    ``q``/``k``/``v`` are the step's new rows, ``full_k``/``full_v`` each request's whole K/V (context + new)."""

    meta: AttentionMetadata
    cache: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    full_k: list[torch.Tensor]
    full_v: list[torch.Tensor]
    tables: list[list[int]]


def make_case(q_lens: list[int], ctx_lens: list[int], hq: int, hkv: int, block_size: int, seed: int = 0,
              dtype: torch.dtype = torch.float32, spare_blocks: int = 7) -> PagedCase:
    """Random K/V and queries; block tables are shuffled, non-contiguous block ids with unused blocks between."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    tables, num_blocks = scattered_block_tables(kv_lens, block_size, np.random.default_rng(seed), spare_blocks)
    cache = torch.full((num_blocks, 2, block_size, hkv, D), float("nan"), dtype=dtype)
    full_k = [torch.randn(kv, hkv, D, generator=gen).to(dtype) for kv in kv_lens]
    full_v = [torch.randn(kv, hkv, D, generator=gen).to(dtype) for kv in kv_lens]
    for table, kk, vv, ctx in zip(tables, full_k, full_v, ctx_lens):
        for pos in range(ctx):
            cache[table[pos // block_size], 0, pos % block_size] = kk[pos]
            cache[table[pos // block_size], 1, pos % block_size] = vv[pos]
    q = torch.randn(sum(q_lens), hq, D, generator=gen).to(dtype)
    k = torch.cat([kk[c:] for kk, c in zip(full_k, ctx_lens)]) if q_lens else torch.empty(0, hkv, D, dtype=dtype)
    v = torch.cat([vv[c:] for vv, c in zip(full_v, ctx_lens)]) if q_lens else torch.empty(0, hkv, D, dtype=dtype)
    meta = build_attention_metadata(q_lens, kv_lens, tables, block_size)
    return PagedCase(meta, cache, q, k, v, full_k, full_v, tables)


def dense_reference(case: PagedCase, window_left: int = -1) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v per request in float64, K/V heads repeated per group; bottom-right causal
    mask, and key k visible to query position p only if ``p - window_left <= k`` when ``window_left >= 0``."""
    out = []
    hq = case.q.shape[1]
    for i, (q_len, kv_len) in enumerate(zip(case.meta.q_lens, case.meta.kv_lens)):
        start = int(case.meta.qo_indptr_host[i])
        q = case.q[start:start + q_len].double()
        group = hq // case.full_k[i].shape[1]
        k = case.full_k[i].double().repeat_interleave(group, dim=1)
        v = case.full_v[i].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
        pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        key = torch.arange(kv_len)[None, :]
        allowed = key <= pos
        if window_left >= 0:
            allowed &= key >= pos - window_left
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v))
    return torch.cat(out) if out else torch.empty(0, hq, D, dtype=torch.float64)


BACKENDS = ["torch", "cpu"]  # the pure-torch reference, and its decodes in the compiled CPU kernel


def make_backend(name: str, hq: int, hkv: int, window_left: int = -1, bucket_overhead: float = 256.0):
    if name == "cpu":
        return CpuPagedAttention(hq, hkv, D, window_left=window_left)
    return TorchPagedAttention(hq, hkv, D, window_left=window_left, bucket_overhead=bucket_overhead)


def run(case: PagedCase, hq: int, hkv: int, window_left: int = -1, bucket_overhead: float = 256.0,
        backend: str = "torch") -> torch.Tensor:
    attention = make_backend(backend, hq, hkv, window_left, bucket_overhead)
    attention.plan(case.meta)
    return attention.forward(case.q, case.k, case.v, case.cache)


HYBRID = dict(  # decodes with long contexts, a chunk continuing a prompt, a whole prompt, a one-token prompt
    q_lens=[1, 9, 1, 11, 1, 1, 1, 4, 1],
    ctx_lens=[53, 13, 70, 0, 0, 21, 38, 30, 5],
)


@pytest.mark.parametrize("window_left", [-1, 6])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_batch_matches_dense_attention_per_request(hq, hkv, block_size, window_left, backend):
    case = make_case(**HYBRID, hq=hq, hkv=hkv, block_size=block_size, seed=block_size + hq)
    out = run(case, hq, hkv, window_left, bucket_overhead=8.0, backend=backend)  # torch: several decode buckets
    assert out.shape == case.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, dense_reference(case, window_left).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_hybrid_batches_match_dense_attention(seed, backend):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    q_lens = [int(x) if rng.random() < 0.4 else 1 for x in rng.integers(2, 40, n)]
    ctx_lens = [int(x) for x in rng.integers(0, 120, n)]
    hkv = int(rng.choice([1, 2, 3]))
    hq = hkv * int(rng.choice([1, 3, 4]))
    window = int(rng.choice([-1, 0, 17]))
    case = make_case(q_lens, ctx_lens, hq, hkv, block_size=int(rng.choice([1, 3, 16])), seed=seed)
    torch.testing.assert_close(run(case, hq, hkv, window, bucket_overhead=float(rng.choice([0, 32, 1e9])),
                                   backend=backend),
                               dense_reference(case, window).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([1, 1, 1, 1], [40, 3, 0, 17]),  # decodes only
    ([7, 12], [0, 30]),  # prefill chunks only
    ([], []),  # nothing scheduled
], ids=["decodes-only", "prefills-only", "empty"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_only_prefill_only_and_empty_batches_match_dense_attention(q_lens, ctx_lens, backend):
    case = make_case(q_lens, ctx_lens, hq=6, hkv=2, block_size=3)
    out = run(case, 6, 2, backend=backend)
    assert out.shape == (sum(q_lens), 6, D)
    torch.testing.assert_close(out, dense_reference(case).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_uninitialised_cache_slots_never_reach_the_output(backend):
    # every slot outside the requests' contexts is NaN (make_case), including the tails of last pages and the
    # padding of decode buckets; one bucket pads a context of 2 up to 61
    case = make_case([1, 1, 5], [60, 1, 3], hq=4, hkv=2, block_size=16)
    out = run(case, 4, 2, bucket_overhead=1e9, backend=backend)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, dense_reference(case).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_what_the_unused_cache_slots_hold_changes_no_bit_of_the_output(block_size, dtype, backend):
    # one decode bucket padded to its longest context, beside a chunk: the padding columns are masked out, so
    # the output is bit for bit the same whether the unused slots hold NaN, zeros or large random values
    q_lens, ctx_lens = [1, 1, 1, 1, 1, 7, 1], [90, 3, 0, 41, 41, 20, 17]
    outs = []
    for fill in ("nan", "zero", "random"):
        case = make_case(q_lens, ctx_lens, hq=6, hkv=2, block_size=block_size, dtype=dtype)
        unused = case.cache.isnan()
        if fill == "zero":
            case.cache[unused] = 0
        elif fill == "random":
            case.cache[unused] = (1e3 * torch.randn(int(unused.sum()), generator=torch.Generator().manual_seed(3))
                                  ).to(dtype)
        outs.append([run(case, 6, 2, window, bucket_overhead=1e9, backend=backend) for window in (-1, 5)])
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_contiguous_cache_is_written_and_read_like_a_contiguous_one(backend):
    case = make_case(**HYBRID, hq=6, hkv=2, block_size=3)
    wide = torch.full((*case.cache.shape[:-1], 2 * D), float("nan"))
    strided = wide[..., :D]
    strided.copy_(case.cache)
    assert not strided.is_contiguous()
    out = make_backend(backend, 6, 2)
    out.plan(case.meta)
    got = out.forward(case.q, case.k, case.v, strided)
    assert torch.equal(got, run(case, 6, 2, backend=backend))
    torch.testing.assert_close(strided, case.cache, atol=0, rtol=0, equal_nan=True)


def test_new_kv_is_written_exactly_at_the_block_table_slots_and_other_blocks_are_untouched():
    case = make_case(**HYBRID, hq=6, hkv=2, block_size=3)
    expected = case.cache.clone()
    for i, table in enumerate(case.tables):
        for pos in range(int(case.meta.kv_lens[i] - case.meta.q_lens[i]), int(case.meta.kv_lens[i])):
            expected[table[pos // 3], 0, pos % 3] = case.full_k[i][pos]
            expected[table[pos // 3], 1, pos % 3] = case.full_v[i][pos]
    run(case, 6, 2)
    torch.testing.assert_close(case.cache, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("chunk", [1, 7, 23])
def test_prompt_run_in_chunks_over_the_paged_cache_equals_one_full_pass(chunk):
    prompt_len, hq, hkv, bs = 23, 6, 2, 4
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(prompt_len, h, D, generator=gen) for h in (hq, hkv, hkv))
    table = [5, 0, 9, 2, 7, 3]  # 6 blocks of 4 >= 23 tokens, out of order
    full = TorchPagedAttention(hq, hkv, D)
    full.plan(build_attention_metadata([prompt_len], [prompt_len], [table], bs))
    expected = full.forward(q, k, v, torch.zeros(10, 2, bs, hkv, D))

    backend = TorchPagedAttention(hq, hkv, D)
    cache = torch.full((10, 2, bs, hkv, D), float("nan"))
    outs = []
    for start in range(0, prompt_len, chunk):
        end = min(start + chunk, prompt_len)
        backend.plan(build_attention_metadata([end - start], [end], [table], bs))
        outs.append(backend.forward(q[start:end], k[start:end], v[start:end], cache))
    torch.testing.assert_close(torch.cat(outs), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_is_reusable_across_steps_with_growing_and_shrinking_batches(backend):
    attention = make_backend(backend, 6, 2)
    for seed, (q_lens, ctx_lens) in enumerate([([1] * 3, [5, 9, 2]), (HYBRID["q_lens"], HYBRID["ctx_lens"]),
                                               ([3], [1])]):
        case = make_case(q_lens, ctx_lens, 6, 2, block_size=3, seed=seed)
        attention.plan(case.meta)
        out = attention.forward(case.q, case.k, case.v, case.cache)
        torch.testing.assert_close(out, dense_reference(case).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_decodes", [1, 2, 3, 9])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 2), (4, 1), (8, 8)])
def test_cpu_kernel_split_over_threads_and_kv_heads_matches_dense_attention(monkeypatch, num_decodes, hq, hkv):
    """Below about 4 decodes per thread the compiled kernel splits each decode's KV heads over tasks; with the
    parallel grain at 0, every such split (1..hkv parts, uneven ones included) runs on 2 threads."""
    from sarathi_lite.kernels import cpu_attention
    monkeypatch.setattr(cpu_attention, "PARALLEL_GRAIN", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rng = np.random.default_rng(num_decodes * 100 + hq)
        case = make_case([1] * num_decodes, [int(x) for x in rng.integers(1, 90, num_decodes)], hq, hkv,
                         block_size=16, seed=num_decodes + hq)
        for window in (-1, 7):
            attention = make_backend("cpu", hq, hkv, window)
            attention.plan(case.meta)
            assert attention._threads == min(2, num_decodes * hkv)
            out = attention.forward(case.q, case.k, case.v, case.cache)
            torch.testing.assert_close(out, dense_reference(case, window).float(), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype,tol,backend", [(torch.bfloat16, 2e-2, "torch"), (torch.float16, 2e-3, "torch"),
                                               (torch.bfloat16, 2e-2, "cpu")])
def test_half_precision_inputs_match_dense_attention_within_their_precision(dtype, tol, backend):
    case = make_case(**HYBRID, hq=6, hkv=2, block_size=16, dtype=dtype)
    out = run(case, 6, 2, window_left=6, backend=backend)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), dense_reference(case, 6).float(), atol=tol, rtol=tol)


def test_bucket_by_length_partitions_the_requests_and_trades_padding_for_fewer_buckets():
    lengths = np.array([500, 20, 21, 480, 19, 22, 1000])
    for overhead in (0.0, 50.0, 1e9):
        buckets = bucket_by_length(lengths, overhead)
        assert sorted(np.concatenate(buckets).tolist()) == list(range(len(lengths)))
    assert len(bucket_by_length(lengths, 1e9)) == 1
    assert len(bucket_by_length(lengths, 0.0)) == len(set(lengths.tolist()))
    # a moderate overhead groups the near-equal lengths and keeps the long one apart
    groups = sorted(sorted(lengths[b].tolist()) for b in bucket_by_length(lengths, 50.0))
    assert groups == [[19, 20, 21, 22], [480, 500], [1000]]


def test_get_attention_backend_returns_torch_for_torch_and_for_auto_without_cuda(monkeypatch):
    assert type(get_attention_backend("torch", 9, 3, 64)) is TorchPagedAttention
    backend = get_attention_backend("auto", 9, 3, 64, window_left=4, device="cpu", dtype=torch.float32)
    assert type(backend) is CpuPagedAttention  # the compiled kernel builds on this machine
    assert (backend.scale, backend.window_left) == (64 ** -0.5, 4)
    assert type(get_attention_backend("auto", 9, 3, 64, device="cpu", dtype=torch.bfloat16)) is CpuPagedAttention
    # what the kernel does not take falls back to the torch path under auto, and is refused by name under cpu
    for dtype, head_dim, heads, why in [(torch.float16, 64, (9, 3), "float16"), (torch.float32, 48, (9, 3), "48"),
                                        (torch.float32, 64, (34, 2), "17 query heads")]:
        assert type(get_attention_backend("auto", *heads, head_dim, dtype=dtype)) is TorchPagedAttention
        with pytest.raises(RuntimeError, match=why):
            get_attention_backend("cpu", *heads, head_dim, dtype=dtype)
    with pytest.raises(RuntimeError, match="not the CPU"):
        get_attention_backend("cpu", 9, 3, 64, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(kernels, "paged_decode_library", lambda: None)  # no compiler, or SARATHI_LITE_NATIVE=0
    assert type(get_attention_backend("auto", 9, 3, 64, device="cpu")) is TorchPagedAttention
    with pytest.raises(RuntimeError, match="did not build or load"):
        get_attention_backend("cpu", 9, 3, 64)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(get_attention_backend("auto", 9, 3, 64, device="cuda", dtype=torch.bfloat16),
                      TorchPagedAttention)


def test_get_attention_backend_flashinfer_without_cuda_says_what_is_missing_and_how_to_install(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"CUDA is not available.*pip install \"sarathi-lite\[flashinfer\]\""):
        get_attention_backend("flashinfer", 9, 3, 64, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="not a CUDA device"):
        get_attention_backend("flashinfer", 9, 3, 64, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        get_attention_backend("flashinfer", 9, 3, 64, device="cuda", dtype=torch.float32)
    if not flashinfer_available():
        with pytest.raises(RuntimeError, match="flashinfer-python does not import"):
            get_attention_backend("flashinfer", 9, 3, 64, device="cuda", dtype=torch.bfloat16)


def test_get_attention_backend_rejects_an_unknown_name_by_name():
    with pytest.raises(ValueError, match="'flashattn'"):
        get_attention_backend("flashattn", 9, 3, 64)


def test_importing_the_kernels_never_imports_flashinfer():
    code = "import sys, sarathi_lite.kernels; assert 'flashinfer' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_compiled_kernel_is_built_once_per_source_and_a_missing_compiler_is_named(tmp_path, monkeypatch):
    from sarathi_lite.kernels import cpu_native

    lib = cpu_native.build(tmp_path)
    assert lib.parent == tmp_path and lib.name.startswith("paged_decode-") and lib.suffix == ".so"
    stamp = lib.stat().st_mtime_ns
    assert cpu_native.build(tmp_path) == lib and lib.stat().st_mtime_ns == stamp  # cached: not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # no temporary left behind
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(cpu_native.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C compiler found.*no-such-compiler"):
        cpu_native.build(tmp_path / "other")


def test_sarathi_lite_native_0_turns_the_compiled_kernel_off():
    code = ("import torch; from sarathi_lite.kernels import get_attention_backend, TorchPagedAttention; "
            "assert type(get_attention_backend('auto', 9, 3, 64)) is TorchPagedAttention")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "SARATHI_LITE_NATIVE": "0"})


def test_release_thread_pool_ends_the_calling_threads_idle_openmp_workers():
    """In a fresh process with 2 torch threads: a matmul starts one OpenMP worker thread; releasing the pool ends
    it (the process's thread count falls by one); the next parallel region starts a worker again."""
    code = """
import os, time, torch
from sarathi_lite.kernels.cpu_native import release_thread_pool
torch.set_num_threads(2)
x = torch.randn(512, 512)
def count():
    time.sleep(0.2)
    return len(os.listdir("/proc/self/task"))
x @ x
before = count()
released = release_thread_pool()
after = count()
x @ x
print(released, before - after, count() - after)
"""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs Linux's /proc")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "1", "1"]
