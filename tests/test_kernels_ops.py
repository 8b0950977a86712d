"""RMSNorm, rotary embedding and SiLU against Hugging Face transformers' own modules; sampling and logprobs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from sarathi_lite.kernels import RotaryEmbedding, compute_logprobs, fused_add_rms_norm, rms_norm, sample, silu_and_mul

EXACT = dict(atol=0, rtol=0)


def hf_norm(hidden: int, eps: float, dtype: torch.dtype, seed: int = 0) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(hidden, eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_equals_hugging_face_llama_rms_norm_bit_for_bit(dtype):
    norm = hf_norm(96, 1e-5, dtype)
    x = (3 * torch.randn(17, 96, generator=torch.Generator().manual_seed(1))).to(dtype)
    out = rms_norm(x, norm.weight.detach(), 1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, norm(x), **EXACT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_equals_adding_the_residual_then_hugging_face_norm(dtype):
    norm = hf_norm(64, 1e-6, dtype)
    gen = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(9, 64, generator=gen).to(dtype) for _ in range(2))
    expected_residual = residual + x
    normed, new_residual = fused_add_rms_norm(x.clone(), residual.clone(), norm.weight.detach(), 1e-6)
    torch.testing.assert_close(new_residual, expected_residual, **EXACT)
    torch.testing.assert_close(normed, norm(expected_residual), **EXACT)


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def hf_rotary(head_dim: int, theta: float, scaling: dict | None, max_pos: int) -> LlamaRotaryEmbedding:
    rope = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=max_pos, rope_parameters=rope)
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(ROPE_CASES))
def test_rotary_embedding_equals_hugging_face_llama_rotary_bit_for_bit(kind, dtype):
    head_dim, theta, max_pos = 64, 500000.0, 2048
    scaling = ROPE_CASES[kind]
    ours = RotaryEmbedding(head_dim, max_pos, theta, scaling)
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, max_pos, (37,), generator=gen)  # unsorted, as in a hybrid batch
    q = torch.randn(37, 9, head_dim, generator=gen).to(dtype)
    k = torch.randn(37, 3, head_dim, generator=gen).to(dtype)
    cos, sin = hf_rotary(head_dim, theta, scaling, max_pos)(q, positions[None])  # [1, N, D]
    # HF's layout is [batch, heads, seq, dim]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = ours(positions, q, k)
    assert q_out.dtype == k_out.dtype == dtype
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), **EXACT)
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), **EXACT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_of_q_and_k_split_from_one_fused_projection_equals_hugging_face_bit_for_bit(dtype):
    # q and k as a model's fused QKV output gives them: adjacent views of one [N, (9 + 3 + 3) * D] tensor (the
    # torch path then rotates them in one pass); the layers of a step share one positions tensor
    head_dim, max_pos = 64, 2048
    ours = RotaryEmbedding(head_dim, max_pos, 10000.0)
    gen = torch.Generator().manual_seed(5)
    positions = torch.randint(0, max_pos, (21,), generator=gen)
    cos, sin = hf_rotary(head_dim, 10000.0, None, max_pos)(torch.zeros(1, dtype=dtype), positions[None])
    for _ in range(2):
        qkv = torch.randn(21, 15 * head_dim, generator=gen).to(dtype)
        q, k, v = qkv.split([9 * head_dim, 3 * head_dim, 3 * head_dim], dim=-1)
        q, k = q.reshape(21, 9, head_dim), k.reshape(21, 3, head_dim)
        q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        q_out, k_out = ours(positions, q, k)
        assert q_out.shape == q.shape and k_out.shape == k.shape
        torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), **EXACT)
        torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), **EXACT)
        torch.testing.assert_close(v, qkv[:, 12 * head_dim:], **EXACT)  # v untouched


def test_rotary_accepts_the_older_type_key():
    new = RotaryEmbedding(32, 128, 10000.0, {"rope_type": "linear", "factor": 2.0})
    old = RotaryEmbedding(32, 128, 10000.0, {"type": "linear", "factor": 2.0})
    torch.testing.assert_close(new.cos_sin_cache, old.cos_sin_cache, **EXACT)
    assert not torch.equal(new.cos_sin_cache, RotaryEmbedding(32, 128, 10000.0).cos_sin_cache)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_rotary_rejects_unsupported_scaling_types_by_name(rope_type):
    with pytest.raises(NotImplementedError, match=rope_type):
        RotaryEmbedding(64, 128, 10000.0, {"rope_type": rope_type, "factor": 2.0})


def test_rotary_cache_is_float32_cos_then_sin_as_flashinfer_expects():
    rope = RotaryEmbedding(16, 10, 10000.0, dtype=torch.bfloat16)
    assert rope.cos_sin_cache.shape == (10, 16) and rope.cos_sin_cache.dtype == torch.float32
    pos = torch.arange(10).float()[:, None]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(rope.cos_sin_cache, torch.cat(((pos * inv_freq).cos(), (pos * inv_freq).sin()), -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_equals_hugging_face_silu_gate_times_up(dtype):
    x = torch.randn(11, 2 * 40, generator=torch.Generator().manual_seed(4)).to(dtype)
    torch.testing.assert_close(silu_and_mul(x), ACT2FN["silu"](x[:, :40]) * x[:, 40:], **EXACT)


def test_gated_mlp_built_on_silu_and_mul_matches_hugging_face_llama_mlp():
    torch.manual_seed(5)
    cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4)
    mlp = LlamaMLP(cfg)
    x = torch.randn(7, 48)
    gate_up = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight))
    out = F.linear(silu_and_mul(F.linear(x, gate_up)), mlp.down_proj.weight)
    torch.testing.assert_close(out, mlp(x), atol=1e-6, rtol=1e-5)


# sampling ---------------------------------------------------------------------------------------------------


def sampling_args(n: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0):
    return (torch.full((n,), temperature), torch.full((n,), top_p), torch.full((n,), top_k, dtype=torch.int64))


def test_temperature_zero_is_greedy_argmax_and_ignores_the_rows_generator():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(6))
    gen = torch.Generator().manual_seed(123)
    state = gen.get_state()
    tokens = sample(logits, *sampling_args(6, temperature=0.0), [gen, None, gen, None, None, None])
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(gen.get_state(), state)


def test_greedy_rows_stay_argmax_in_a_batch_with_sampled_rows():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(7))
    temperature = torch.tensor([0.0, 1.0] * 4)
    tokens = sample(logits, temperature, torch.ones(8), torch.zeros(8, dtype=torch.int64), [None] * 8)
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(8))
    for temperature in (0.5, 1.0, 3.0):
        tokens = sample(logits, *sampling_args(16, temperature=temperature, top_k=1), [None] * 16)
        assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("top_p", [0.0, 5e-324, 1e-300, 1e-46])
def test_a_top_p_that_is_zero_in_float32_keeps_the_most_likely_token(top_p):
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(11))
    generators = [None] * 8 + [seeded(i) for i in range(8)]
    tokens = sample(logits, *sampling_args(16, temperature=0.5, top_p=top_p), generators)
    assert torch.equal(tokens, logits.argmax(-1))


def nucleus(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> set[int]:
    """The tokens top-k then top-p may return, computed independently in float64."""
    scaled = logits.double() / temperature
    order = scaled.argsort(descending=True)
    if 0 < top_k < len(logits):
        order = order[:top_k]
    probs = scaled[order].softmax(-1)
    before = probs.cumsum(-1) - probs
    return set(order[before < top_p].tolist())


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (20, 0.8), (-1, 0.3), (1000, 0.95)])
def test_top_k_and_top_p_never_return_a_token_outside_the_allowed_set(top_k, top_p):
    torch.manual_seed(9)
    logits = 2 * torch.randn(4, 200)
    allowed = [nucleus(row, 1.3, top_p, top_k) for row in logits]
    reps = 250
    tokens = sample(logits.repeat(reps, 1), *sampling_args(4 * reps, 1.3, top_p, top_k), [None] * 4 * reps)
    seen = [set(tokens[i::4].tolist()) for i in range(4)]
    for row in range(4):
        assert seen[row] <= allowed[row]
    assert any(len(s) > 1 for s in seen)  # it does sample, not just argmax


def test_sampling_frequencies_follow_the_softmax_distribution():
    torch.manual_seed(10)
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]])
    n = 20000
    tokens = sample(logits.expand(n, 5), *sampling_args(n), [None] * n)
    freq = torch.bincount(tokens, minlength=5).float() / n
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.015, rtol=0)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch():
    gen = torch.Generator().manual_seed(11)
    row = torch.randn(1, 100, generator=gen)
    others = torch.randn(5, 100, generator=gen)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.0, 1.5])
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0, 0.8])
    top_k = torch.tensor([50, 0, 10, 3, 0])

    def steps(batch_of, n: int = 8) -> list[int]:
        g = seeded(42)
        out = []
        for _ in range(n):
            logits, t, p, k, gens, where = batch_of(g)
            out.append(int(sample(logits, t, p, k, gens)[where]))
        return out

    alone = steps(lambda g: (row, torch.tensor([0.9]), torch.tensor([0.95]), torch.tensor([40]), [g], 0))

    def mixed(g, at=3):  # the row in the middle of greedy, unseeded and other seeded rows
        logits = torch.cat((others[:at], row, others[at:]))
        t = torch.cat((temperature[:at], torch.tensor([0.9]), temperature[at:]))
        p = torch.cat((top_p[:at], torch.tensor([0.95]), top_p[at:]))
        k = torch.cat((top_k[:at], torch.tensor([40]), top_k[at:]))
        gens = [None, seeded(1), None, seeded(2), None]
        gens.insert(at, g)
        return logits, t, p, k, gens, at

    assert steps(mixed) == alone
    assert steps(lambda g: mixed(g, at=0)) == alone
    assert len(set(alone)) > 1


def test_rows_with_the_same_seed_draw_the_same_tokens_and_different_seeds_differ():
    logits = torch.zeros(3, 1000)  # uniform: any difference comes from the draw
    tokens = sample(logits, *sampling_args(3), [seeded(5), seeded(5), seeded(6)])
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2]


def test_compute_logprobs_returns_the_chosen_and_top_log_softmax_values():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    chosen_ids = torch.tensor([3, 0, 29, 7])
    chosen, top_ids, top_lp = compute_logprobs(logits, chosen_ids, num_top=5)
    ref = torch.log_softmax(logits.float(), -1)
    assert chosen.dtype == top_lp.dtype == torch.float32 and top_ids.dtype == torch.int64
    torch.testing.assert_close(chosen, ref[torch.arange(4), chosen_ids], **EXACT)
    torch.testing.assert_close(top_lp, ref.topk(5, -1).values, **EXACT)
    torch.testing.assert_close(top_ids, ref.topk(5, -1).indices, **EXACT)
    assert (top_lp[:, :-1] >= top_lp[:, 1:]).all()
