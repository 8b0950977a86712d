"""FlashInfer conformance on the CPU: every call the project makes binds to the installed flashinfer-python's
signatures, ``FlashInferAttention`` runs through FlashInfer's real Python ``plan()`` / ``run()`` /
``append_paged_kv_cache`` with only the compiled modules stubbed (asserting what would reach the kernels), the
metadata matches FlashInfer's documented examples, and backend selection falls back safely. Needs only
``flashinfer-python`` and ``apache-tvm-ffi`` (scripts/setup.sh installs them without CUDA); no GPU."""

from __future__ import annotations

import inspect
import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

flashinfer = pytest.importorskip("flashinfer", reason="flashinfer-python is not installed (scripts/setup.sh)")

from flashinfer.jit import env as jit_env  # noqa: E402
from flashinfer.jit.attention import get_batch_prefill_uri  # noqa: E402
from flashinfer.utils import MaskMode, TensorLayout  # noqa: E402

from sarathi_lite.kernels import (  # noqa: E402
    FlashInferAttention,
    RotaryEmbedding,
    TorchPagedAttention,
    _flashinfer,
    activation,
    build_attention_metadata,
    fused_add_rms_norm,
    get_attention_backend,
    norm,
    rms_norm,
    rotary,
    sample,
    sampling,
    silu_and_mul,
)

D = 64
BF16 = torch.bfloat16
HYBRID = ([1, 9, 1, 40, 1, 17], [530, 130, 70, 0, 5, 300])  # q_lens, context lengths: decodes, chunks, a prompt

# positions of the arguments FlashInfer 0.6.13 / 0.7 passes to its compiled module's plan() and paged_run()
PLAN_QO_INDPTR, PLAN_KV_INDPTR, PLAN_KV_LENS, PLAN_CAUSAL, PLAN_WINDOW = 3, 4, 5, 14, 15
RUN_Q, RUN_K, RUN_V, RUN_KV_INDICES, RUN_OUT = 3, 4, 5, 8, 10
RUN_MASK, RUN_LAYOUT, RUN_WINDOW, RUN_SM_SCALE = 12, 13, 14, 23


class StubPrefillModule:
    """Stands in for a compiled batch-prefill module: records what FlashInfer's Python hands the kernels."""

    def __init__(self, backend: str, *args) -> None:
        self.backend, self.args, self.plans, self.runs = backend, args, [], []

    def plan(self, *args):
        self.plans.append(args)
        return [0]

    def paged_run(self, *args) -> None:
        self.runs.append(args)
        args[RUN_OUT].fill_(1.0)


class StubPageModule:
    """Stands in for the compiled ``page`` module: appends with the slot formula FlashInfer documents (token i of
    request b at position p goes to page ``kv_indices[kv_indptr[b] + p // page_size]``, slot ``p % page_size``)."""

    def __init__(self) -> None:
        self.calls = []

    def append_paged_kv_cache(self, key, value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
                              kv_last_page_len, layout) -> None:
        self.calls.append(dict(batch_indices=batch_indices, positions=positions, kv_indices=kv_indices,
                               kv_indptr=kv_indptr, kv_last_page_len=kv_last_page_len, layout=layout))
        page_size = k_cache.shape[1]
        for i, (b, p) in enumerate(zip(batch_indices.tolist(), positions.tolist())):
            page = int(kv_indices[int(kv_indptr[b]) + p // page_size])
            k_cache[page, p % page_size] = key[i]
            v_cache[page, p % page_size] = value[i]


@pytest.fixture
def fake_device(monkeypatch):
    """FlashInfer's Python on a CPU as if on a GPU of a chosen compute capability: pinned host buffers become
    plain ones (no pinned allocator without CUDA), the compiled modules are stubs. Returns the stubs."""
    empty = torch.empty

    def unpinned_empty(*args, pin_memory=False, **kwargs):
        return empty(*args, **kwargs)

    stubs = SimpleNamespace(prefill=[], page=StubPageModule(), capability=(9, 0))

    def get_batch_prefill_module(backend, *args):
        stubs.prefill.append(StubPrefillModule(backend, *args))
        return stubs.prefill[-1]

    monkeypatch.setattr(torch, "empty", unpinned_empty)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(flashinfer.utils, "get_compute_capability", lambda device: stubs.capability)
    monkeypatch.setattr(flashinfer.prefill, "get_batch_prefill_module", get_batch_prefill_module)
    monkeypatch.setattr(flashinfer.page, "get_page_module", lambda: stubs.page)
    return stubs


def make_step(block_size: int, hq: int, hkv: int, seed: int = 0):
    """The HYBRID batch on the CPU in bf16: (meta, cache with NaN in every unwritten slot, q, k, v)."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, ctx = HYBRID
    kv_lens = [q + c for q, c in zip(q_lens, ctx)]
    pages = [-(-kv // block_size) for kv in kv_lens]
    ids = torch.randperm(sum(pages) + 3, generator=gen).tolist()
    tables = [ids[sum(pages[:i]):sum(pages[:i + 1])] for i in range(len(pages))]
    cache = torch.full((len(ids), 2, block_size, hkv, D), float("nan"), dtype=BF16)
    n = sum(q_lens)
    q, k, v = (torch.randn(n, h, D, generator=gen).to(BF16) for h in (hq, hkv, hkv))
    return build_attention_metadata(q_lens, kv_lens, tables, block_size), cache, q, k, v


@pytest.mark.parametrize("capability,backend", [((9, 0), "fa3"), ((8, 0), "fa2")])
@pytest.mark.parametrize("window_left", [-1, 31])
def test_plan_hands_flashinfer_host_int32_indptrs_causal_and_the_window(fake_device, capability, backend,
                                                                        window_left):
    fake_device.capability = capability
    meta, _, _, _, _ = make_step(16, 8, 2)
    fi = FlashInferAttention(8, 2, D, window_left=window_left, device="cpu", dtype=BF16, workspace_bytes=1 << 20)
    fi.plan(meta)

    (module,) = fake_device.prefill
    assert module.backend == backend  # what FlashInfer's "auto" picks on that GPU
    assert module.args == (BF16, BF16, BF16, torch.int32, D, D, 0, window_left >= 0, False, False)
    name = get_batch_prefill_uri(module.backend, *module.args)
    assert name == _flashinfer.batch_prefill_module(torch.device("cuda"), BF16, D, window_left)  # the AOT name
    (plan,) = module.plans
    for index, expected in ((PLAN_QO_INDPTR, meta.qo_indptr_host), (PLAN_KV_INDPTR, meta.kv_indptr_host),
                            (PLAN_KV_LENS, meta.kv_lens)):
        assert plan[index].device.type == "cpu" and plan[index].dtype == torch.int32
        np.testing.assert_array_equal(plan[index].numpy(), expected)
    assert plan[PLAN_CAUSAL] is True and plan[PLAN_WINDOW] == window_left
    assert plan[6:14] == (meta.num_tokens, meta.num_requests, 8, 2, 16, False, D, D)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window_left", [-1, 31])
def test_forward_appends_to_the_projects_slots_and_runs_into_one_output_buffer(fake_device, block_size, window_left):
    hq, hkv = 9, 3
    meta, cache, q, k, v = make_step(block_size, hq, hkv)
    fi = FlashInferAttention(hq, hkv, D, window_left=window_left, device="cpu", dtype=BF16, workspace_bytes=1 << 20)
    fi.plan(meta)
    fi_cache = cache.clone()
    out = fi.forward(q, k, v, fi_cache)

    (append,) = fake_device.page.calls
    for key in ("batch_indices", "positions", "kv_indices", "kv_indptr", "kv_last_page_len"):
        assert append[key].dtype == torch.int32, key
    assert append["layout"] == TensorLayout["NHD"].value
    reference = TorchPagedAttention(hq, hkv, D, window_left=window_left)  # writes slot_block / slot_offset
    reference.plan(meta)
    torch_cache = cache.clone()
    reference.forward(q, k, v, torch_cache)
    torch.testing.assert_close(fi_cache, torch_cache, rtol=0, atol=0, equal_nan=True)

    (run,) = fake_device.prefill[0].runs
    k_view, v_view = run[RUN_K], run[RUN_V]
    assert run[RUN_Q] is q and run[RUN_KV_INDICES].dtype == torch.int32
    assert k_view.shape == v_view.shape == (cache.shape[0], block_size, hkv, D)
    assert k_view.stride() == v_view.stride() == fi_cache[:, 0].stride()
    assert (v_view.data_ptr() - k_view.data_ptr()) == fi_cache.stride(1) * fi_cache.element_size()
    assert run[RUN_MASK] == MaskMode.CAUSAL.value and run[RUN_LAYOUT] == TensorLayout["NHD"].value
    assert run[RUN_WINDOW] == window_left and run[RUN_SM_SCALE] == pytest.approx(D ** -0.5)
    assert run[RUN_OUT] is out and out.shape == q.shape and out.dtype == BF16 and bool((out == 1).all())
    assert fi.forward(q, k, v, fi_cache) is out  # one buffer per step, not one allocation per layer


def test_forward_rejects_kv_of_another_dtype_than_the_cache(fake_device):
    meta, cache, q, k, v = make_step(16, 8, 2)
    fi = FlashInferAttention(8, 2, D, device="cpu", dtype=BF16, workspace_bytes=1 << 20)
    fi.plan(meta)
    with pytest.raises(ValueError, match="kv_cache torch.float32"):
        fi.forward(q, k, v, cache.float())
    with pytest.raises(ValueError, match="k torch.float16, v torch.float16"):
        fi.forward(q, k.half(), v.half(), cache)
    assert fake_device.page.calls == []


def test_flashinfer_attention_rejects_head_dims_its_kernels_lack():
    with pytest.raises(ValueError, match="not 16"):
        FlashInferAttention(4, 2, 16, device="cpu")


def test_metadata_matches_flashinfers_documented_batch_indices_and_positions():
    # get_batch_indices_positions' docstring: append lengths 1, 2, 3, 4 onto sequences of 5 tokens
    doc = flashinfer.page.get_batch_indices_positions.__doc__
    assert "tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 3]" in doc and "tensor([4, 3, 4, 2, 3, 4, 1, 2, 3, 4]" in doc
    meta = build_attention_metadata([1, 2, 3, 4], [5] * 4, [[0], [1], [2], [3]], 16)
    assert meta.batch_indices.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert meta.positions.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]

    # append_paged_kv_cache's docstring: 45, 8, 25, 22 new tokens in pages 0..7 of size 16
    meta = build_attention_metadata([45, 8, 25, 22], [45, 8, 25, 22], [[0, 1, 2], [3], [4, 5], [6, 7]], 16)
    assert meta.kv_indptr.tolist() == [0, 3, 4, 6, 8] and meta.kv_last_page_len.tolist() == [13, 8, 9, 6]
    assert meta.positions.tolist() == [*range(45), *range(8), *range(25), *range(22)]
    seq_lens = flashinfer.page.get_seq_lens(meta.kv_indptr, meta.kv_last_page_len, 16)
    assert seq_lens.tolist() == meta.kv_lens.tolist() == [45, 8, 25, 22]


def binding(monkeypatch, owner, name: str, result=None):
    """Replace ``owner.name`` by a recorder that binds each call to the real function's signature."""
    signature = inspect.signature(getattr(owner, name))
    calls = []

    def record(*args, **kwargs):
        calls.append(signature.bind(*args, **kwargs).arguments)
        return result(calls[-1]) if result else None

    monkeypatch.setattr(owner, name, record)
    return calls


def test_every_fused_op_call_binds_to_flashinfers_signature(monkeypatch):
    for module in (norm, activation, rotary, sampling):
        monkeypatch.setattr(module, "use_flashinfer", lambda *tensors, **kw: True)
    x = torch.randn(5, 2 * D, dtype=BF16)
    weight = torch.ones(2 * D, dtype=BF16)

    calls = binding(monkeypatch, flashinfer.norm, "rmsnorm", lambda a: a["input"])
    assert rms_norm(x, weight, 1e-5) is x
    assert calls[0]["weight"] is weight and calls[0]["eps"] == 1e-5
    calls = binding(monkeypatch, flashinfer.norm, "fused_add_rmsnorm")
    residual = x.clone()
    assert fused_add_rms_norm(x, residual, weight, 1e-5) == (x, residual)
    assert calls[0]["residual"] is residual and calls[0]["eps"] == 1e-5

    calls = binding(monkeypatch, flashinfer.activation, "silu_and_mul", lambda a: a["input"][:, :D])
    assert silu_and_mul(x).shape == (5, D) and calls[0]["input"] is x

    calls = binding(monkeypatch, flashinfer.rope, "apply_rope_with_cos_sin_cache_inplace")
    rope = RotaryEmbedding(D, 32, 10000.0)
    q, k = x.view(5, 2, D).clone(), x.view(5, 2, D)[:, :1].clone()
    assert rope(torch.arange(5), q, k) == (q, k)
    (call,) = calls
    assert call["head_size"] == D and call["is_neox"] is True
    assert call["cos_sin_cache"].dtype == torch.float32 and call["cos_sin_cache"].shape == (32, D)

    calls = binding(monkeypatch, flashinfer.sampling, "top_k_top_p_sampling_from_logits",
                    lambda a: torch.zeros(len(a["logits"]), dtype=torch.int32))
    logits = torch.randn(3, 50)
    tokens = sample(logits, torch.tensor([0.0, 1.0, 0.7]), torch.tensor([1.0, 0.9, 0.5]),
                    torch.tensor([0, 5, 60]), [None, None, torch.Generator().manual_seed(0)])
    (call,) = calls
    assert call["logits"].shape == (1, 50) and call["top_k"].dtype == torch.int32
    assert call["top_k"].tolist() == [5] and call["top_p"].tolist() == pytest.approx([0.9])
    assert tokens[0] == logits[0].argmax() and tokens[1] == 0


def test_every_attention_call_binds_to_flashinfers_signature(fake_device, monkeypatch):
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper
    inits = binding(monkeypatch, wrapper, "__init__")
    plans = binding(monkeypatch, wrapper, "plan")
    runs = binding(monkeypatch, wrapper, "run")
    appends = binding(monkeypatch, flashinfer.page, "append_paged_kv_cache")
    meta, cache, q, k, v = make_step(16, 8, 2)
    fi = FlashInferAttention(8, 2, D, window_left=7, device="cpu", dtype=BF16, workspace_bytes=1 << 20)
    fi.plan(meta)
    fi.forward(q, k, v, cache)
    assert inits[0]["kv_layout"] == "NHD"
    assert plans[0]["causal"] is True and plans[0]["window_left"] == 7 and plans[0]["page_size"] == 16
    assert plans[0]["q_data_type"] == plans[0]["kv_data_type"] == BF16 and plans[0]["head_dim_qk"] == D
    assert runs[0]["q"] is q and runs[0]["paged_kv_cache"] is cache and runs[0]["out"] is fi._out
    assert appends[0]["paged_kv_cache"] is cache and appends[0]["kv_layout"] == "NHD"


@pytest.fixture
def cuda_without_kernels(monkeypatch, tmp_path):
    """A CUDA machine (faked) whose FlashInfer has no prebuilt kernels, an empty JIT cache and no nvcc."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(flashinfer.utils, "get_compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(jit_env, "FLASHINFER_AOT_DIR", tmp_path / "aot")
    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", tmp_path / "jit")
    for var in ("CUDA_HOME", "CUDA_PATH", "FLASHINFER_NVCC"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    _flashinfer.warn_once.cache_clear()
    _flashinfer._modules_ready.cache_clear()
    yield tmp_path
    _flashinfer.warn_once.cache_clear()
    _flashinfer._modules_ready.cache_clear()


def test_auto_falls_back_to_torch_with_one_warning_without_kernels_or_nvcc(cuda_without_kernels, caplog):
    with caplog.at_level(logging.WARNING, logger="sarathi_lite.kernels"):
        backends = [get_attention_backend("auto", 8, 2, D, device="cuda", dtype=BF16) for _ in range(3)]
    assert all(isinstance(b, TorchPagedAttention) for b in backends)
    (record,) = caplog.records
    name = _flashinfer.batch_prefill_module(torch.device("cuda"), BF16, D, -1)
    assert "page" in record.getMessage() and name in record.getMessage() and name.endswith("_sm90")
    with pytest.raises(RuntimeError, match="neither prebuilt nor compilable"):
        get_attention_backend("flashinfer", 8, 2, D, device="cuda", dtype=BF16)
    assert not _flashinfer._modules_ready("norm")  # the fused ops take their torch paths too


def test_prebuilt_kernels_or_nvcc_make_flashinfer_usable(cuda_without_kernels):
    name = _flashinfer.batch_prefill_module(torch.device("cuda"), BF16, D, 31)
    assert _flashinfer.missing_modules("page", name) is not None
    for module in ("page", name):  # what scripts/gpu_check.sh copies into the package's data/aot
        (cuda_without_kernels / "aot" / module).mkdir(parents=True)
        (cuda_without_kernels / "aot" / module / f"{module}.so").touch()
    assert _flashinfer.missing_modules("page", name) is None
    assert _flashinfer.missing_modules("norm") is not None
    fake_tools(cuda_without_kernels / "bin")
    assert _flashinfer.find_nvcc() == str(cuda_without_kernels / "bin" / "nvcc")
    assert _flashinfer.missing_modules("norm") is None


def fake_tools(folder) -> None:
    for tool in ("nvcc", "ninja"):
        (folder / tool).write_text("#!/bin/sh\nexit 1\n")
        os.chmod(folder / tool, 0o755)


def test_auto_falls_back_to_torch_for_a_head_dim_flashinfer_lacks(cuda_without_kernels, caplog):
    fake_tools(cuda_without_kernels / "bin")
    with caplog.at_level(logging.WARNING, logger="sarathi_lite.kernels"):
        backend = get_attention_backend("auto", 4, 2, 16, device="cuda", dtype=BF16)
    assert isinstance(backend, TorchPagedAttention)
    assert "not 16" in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match="not 16"):
        get_attention_backend("flashinfer", 4, 2, 16, device="cuda", dtype=BF16)


def test_kernels_that_fail_to_load_or_compile_mean_torch_not_a_failed_request(cuda_without_kernels, monkeypatch,
                                                                               caplog):
    import flashinfer.jit.core

    monkeypatch.setattr(flashinfer.jit.core.current_compilation_context, "TARGET_CUDA_ARCHS", {(9, "0a")})
    name = _flashinfer.batch_prefill_module(torch.device("cuda"), BF16, D, -1)
    for module in ("page", name, "norm"):  # not shared libraries: loading them fails as a broken build would
        (cuda_without_kernels / "aot" / module).mkdir(parents=True)
        (cuda_without_kernels / "aot" / module / f"{module}.so").write_text("not a library")
    with caplog.at_level(logging.WARNING, logger="sarathi_lite.kernels"):
        assert isinstance(get_attention_backend("auto", 8, 2, D, device="cuda", dtype=BF16), TorchPagedAttention)
        assert not _flashinfer._modules_ready("norm")
    assert [r.getMessage().count("does not load") for r in caplog.records] == [1, 1]
    assert "module page" in caplog.records[0].getMessage() and "module norm" in caplog.records[1].getMessage()
    with pytest.raises(RuntimeError, match="does not load"):
        get_attention_backend("flashinfer", 8, 2, D, device="cuda", dtype=BF16)
    fake_tools(cuda_without_kernels / "bin")  # an nvcc whose compile fails
    assert "does not load" in _flashinfer.unusable({"rope": flashinfer.rope.get_rope_module})


def test_rope_checks_devices_and_the_position_range():
    rope = RotaryEmbedding(D, 8, 10000.0)
    q, k = torch.randn(2, 2, D), torch.randn(2, 1, D)
    with pytest.raises(ValueError, match="positions span 3 .. 8, outside the rotary cache's 0 .. 7"):
        rope(torch.tensor([3, 8]), q, k)
    with pytest.raises(ValueError, match="-1 .. 0"):
        rope(torch.tensor([-1, 0]), q, k)
    with pytest.raises(ValueError, match="on q's device"):
        rope(torch.tensor([0, 1], device="meta"), q, k)
    rope(torch.tensor([0, 7]), q, k)

