"""FlashInfer fast paths against the torch reference (run only where CUDA and flashinfer-python exist)."""

from __future__ import annotations

import pytest
import torch

from sarathi_lite.kernels import (
    FlashInferAttention,
    RotaryEmbedding,
    TorchPagedAttention,
    build_attention_metadata,
    flashinfer_available,
    fused_add_rms_norm,
    get_attention_backend,
    rms_norm,
    sample,
    silu_and_mul,
)

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and flashinfer_available()),
                                reason="needs CUDA and flashinfer-python")

D = 64
CUDA = "cuda"
HALF = [torch.bfloat16, torch.float16]
ATTN_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}  # relative L2 error bound vs the float32 reference


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def make_step(q_lens: list[int], ctx_lens: list[int], hq: int, hkv: int, block_size: int, seed: int):
    """A hybrid batch on CUDA in float32: (meta, cache with the contexts written and NaN elsewhere, q, k, v)."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    pages = [-(-kv // block_size) for kv in kv_lens]
    num_blocks = sum(pages) + 5
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in pages:
        tables.append(ids[start:start + n])
        start += n
    cache = torch.full((num_blocks, 2, block_size, hkv, D), float("nan"))
    for table, ctx in zip(tables, ctx_lens):
        for pos in range(ctx):
            cache[table[pos // block_size], :, pos % block_size] = torch.randn(2, hkv, D, generator=gen)
    n = sum(q_lens)
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (hq, hkv, hkv))
    meta = build_attention_metadata(q_lens, kv_lens, tables, block_size, CUDA)
    return meta, cache.to(CUDA), q.to(CUDA), k.to(CUDA), v.to(CUDA)


HYBRID = [
    ([1, 9, 1, 40, 1, 1, 1, 17, 1], [530, 130, 70, 0, 0, 210, 1100, 300, 5]),  # decodes, chunks, whole prompts
    ([1] * 33, list(range(3, 3 * 34, 3))),  # decodes only
    ([64, 128], [0, 250]),  # prefills only
]


@pytest.mark.parametrize("window_left", [-1, 31])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (9, 3), (8, 2)])
@pytest.mark.parametrize("dtype", HALF)
def test_flashinfer_attention_matches_the_torch_reference_on_hybrid_batches(dtype, hq, hkv, block_size, window_left,
                                                                             record_property):
    for seed, (q_lens, ctx_lens) in enumerate(HYBRID):
        meta, cache, q, k, v = make_step(q_lens, ctx_lens, hq, hkv, block_size, seed)
        reference = TorchPagedAttention(hq, hkv, D, window_left=window_left)
        reference.plan(meta)
        expected = reference.forward(q, k, v, cache.clone())

        fi = FlashInferAttention(hq, hkv, D, window_left=window_left, device=CUDA, dtype=dtype)
        fi.plan(meta)
        fi_cache = cache.to(dtype)
        out = fi.forward(q.to(dtype), k.to(dtype), v.to(dtype), fi_cache)

        torch_half = TorchPagedAttention(hq, hkv, D, window_left=window_left)
        torch_half.plan(meta)
        torch_cache = cache.to(dtype)
        out_torch = torch_half.forward(q.to(dtype), k.to(dtype), v.to(dtype), torch_cache)

        err, err_torch = rel_err(out, expected), rel_err(out_torch, expected)
        record_property(f"rel_err_seed{seed}", {"flashinfer": err, "torch": err_torch})
        assert out.dtype == dtype and out.shape == q.shape
        assert err < ATTN_TOL[dtype], f"flashinfer {dtype} relative error {err:.2e} (torch {err_torch:.2e})"
        torch.testing.assert_close(fi_cache, torch_cache, atol=0, rtol=0, equal_nan=True)  # same slots written


def test_flashinfer_attention_handles_an_empty_step():
    meta = build_attention_metadata([], [], [], 16, CUDA)
    fi = FlashInferAttention(9, 3, D, device=CUDA)
    fi.plan(meta)
    empty = torch.empty(0, 9, D, device=CUDA, dtype=torch.bfloat16)
    kv = torch.empty(0, 3, D, device=CUDA, dtype=torch.bfloat16)
    assert fi.forward(empty, kv, kv, torch.zeros(4, 2, 16, 3, D, device=CUDA, dtype=torch.bfloat16)).shape == (0, 9, D)


def test_auto_backend_picks_flashinfer_on_cuda_in_half_precision_and_torch_in_float32_or_other_head_dims():
    assert isinstance(get_attention_backend("auto", 9, 3, D, device=CUDA, dtype=torch.bfloat16), FlashInferAttention)
    assert isinstance(get_attention_backend("auto", 9, 3, D, device=CUDA, dtype=torch.float32), TorchPagedAttention)
    assert isinstance(get_attention_backend("auto", 4, 2, 16, device=CUDA, dtype=torch.bfloat16), TorchPagedAttention)


def test_flashinfer_attention_reuses_one_output_buffer_per_step():
    meta, cache, q, k, v = make_step([3, 1], [5, 20], 8, 2, 16, seed=4)
    fi = FlashInferAttention(8, 2, D, device=CUDA, dtype=torch.bfloat16)
    fi.plan(meta)
    cache, q, k, v = (t.to(torch.bfloat16) for t in (cache, q, k, v))
    first = fi.forward(q, k, v, cache).clone()
    assert fi.forward(q, k, v, cache).data_ptr() == fi.forward(q, k, v, cache).data_ptr()
    torch.testing.assert_close(fi.forward(q, k, v, cache), first, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", HALF)
def test_flashinfer_rms_norms_match_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(37, 576, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    out = rms_norm(x.to(CUDA), weight.to(CUDA), 1e-5)
    torch.testing.assert_close(out.cpu(), rms_norm(x, weight, 1e-5), atol=2e-2, rtol=2e-2)
    normed, new_residual = fused_add_rms_norm(x.to(CUDA), residual.to(CUDA), weight.to(CUDA), 1e-5)
    ref_normed, ref_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual.cpu(), ref_residual, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(normed.cpu(), ref_normed, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}])
@pytest.mark.parametrize("dtype", HALF)
def test_flashinfer_rope_matches_torch(dtype, scaling):
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 4096, (50,), generator=gen)
    q = torch.randn(50, 9, D, generator=gen).to(dtype)
    k = torch.randn(50, 3, D, generator=gen).to(dtype)
    cpu = RotaryEmbedding(D, 4096, 100000.0, scaling)
    gpu = RotaryEmbedding(D, 4096, 100000.0, scaling, device=CUDA)
    q_ref, k_ref = cpu(positions, q, k)
    q_out, k_out = gpu(positions.to(CUDA), q.to(CUDA), k.to(CUDA))
    torch.testing.assert_close(q_out.cpu(), q_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_out.cpu(), k_ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", HALF)
def test_flashinfer_silu_and_mul_matches_torch(dtype):
    x = torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(2)).to(dtype)
    torch.testing.assert_close(silu_and_mul(x.to(CUDA)).cpu(), silu_and_mul(x), atol=1e-2, rtol=1e-2)


def test_fast_paths_are_taken_for_half_precision_cuda_tensors(monkeypatch):
    import flashinfer

    calls = []
    for module, fn in ((flashinfer.norm, "rmsnorm"), (flashinfer.activation, "silu_and_mul"),
                       (flashinfer.rope, "apply_rope_with_cos_sin_cache_inplace")):
        original = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, _f=original, _n=fn, **kw: (calls.append(_n), _f(*a, **kw))[1])
    x = torch.randn(4, 128, device=CUDA, dtype=torch.bfloat16)
    rms_norm(x, torch.ones(128, device=CUDA, dtype=torch.bfloat16), 1e-6)
    silu_and_mul(x)
    RotaryEmbedding(D, 16, 10000.0, device=CUDA)(torch.arange(4, device=CUDA), x.view(4, 2, D).clone(),
                                                  x.view(4, 2, D).clone())
    assert calls == ["rmsnorm", "silu_and_mul", "apply_rope_with_cos_sin_cache_inplace"]


def test_flashinfer_sampling_stays_inside_top_k_top_p_and_keeps_greedy_and_seeded_rows_exact():
    torch.manual_seed(3)
    vocab, reps = 500, 200
    logits = (2 * torch.randn(4, vocab)).to(CUDA)
    top_k = torch.tensor([10, 0, 50, 1], device=CUDA)
    top_p = torch.tensor([1.0, 0.7, 0.9, 1.0], device=CUDA)
    temperature = torch.tensor([1.0, 0.8, 1.2, 1.0], device=CUDA)
    tokens = sample(logits.repeat(reps, 1), temperature.repeat(reps), top_p.repeat(reps), top_k.repeat(reps),
                    [None] * 4 * reps).view(reps, 4).cpu()
    for row in range(4):
        scaled = logits[row].double().cpu() / float(temperature[row])
        order = scaled.argsort(descending=True)
        k = int(top_k[row])
        order = order[:k] if 0 < k < vocab else order
        probs = scaled[order].softmax(-1)
        allowed = set(order[(probs.cumsum(-1) - probs) < float(top_p[row])].tolist())
        assert set(tokens[:, row].tolist()) <= allowed
    assert (tokens[:, 3] == logits[3].argmax().cpu()).all()

    greedy_and_seeded = sample(logits, torch.tensor([0.0, 1.0, 1.0, 0.0], device=CUDA), top_p, top_k,
                               [None, torch.Generator(CUDA).manual_seed(7), None, None])
    again = sample(logits[1:2], torch.ones(1, device=CUDA), top_p[1:2], top_k[1:2],
                   [torch.Generator(CUDA).manual_seed(7)])
    assert greedy_and_seeded[0] == logits[0].argmax()
    assert greedy_and_seeded[1] == again[0]
