"""Shared fixtures: tiny random Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3) built from configs in well
under a second, and Hugging Face's own greedy generation as the reference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.08,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_tiny_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    """Save a tiny random model of ``kind`` (llama | llama3 | llama_hd64 | mistral | qwen2 | qwen3) as
    safetensors."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    elif kind == "llama3":  # Llama-3 rope scaling and tied embeddings
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters=rope))
    elif kind == "mistral":  # a sliding window shorter than the longest prompts
        model = MistralForCausalLM(MistralConfig(**TINY, sliding_window=48, head_dim=16))
    elif kind == "llama_hd64":  # head_dim 64: a size FlashInfer's kernels take (they have no head_dim 16)
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, "hidden_size": 128, "num_attention_heads": 2,
                                                "num_key_value_heads": 1}, tie_word_embeddings=False))
    elif kind == "qwen2":  # q/k/v bias, tied embeddings
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    elif kind == "qwen3":  # q/k RMSNorm per head (weights drawn around 1), head_dim 32 != hidden / heads, tied
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True))
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.normal_(1.0, 0.3)
    else:
        raise ValueError(kind)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {k: make_tiny_checkpoint(k, root / k) for k in ("llama", "llama3", "llama_hd64", "mistral", "qwen2",
                                                           "qwen3")}


class HFReference:
    """Hugging Face transformers' own model on the same weights: greedy ``generate`` and teacher-forced logits."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self._cache: dict[tuple, list[int]] = {}

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._cache:
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
            self._cache[key] = out[0, len(prompt):].tolist()
        return self._cache[key]

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] of one teacher-forced forward over ``tokens``."""
        return self.model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="session")
def hf_reference(tiny_checkpoints):
    refs: dict[str, HFReference] = {}

    def get(kind: str) -> HFReference:
        if kind not in refs:
            refs[kind] = HFReference(tiny_checkpoints[kind])
        return refs[kind]

    return get


# The vLLM plugin's tests and the contract harness's need vLLM, which lives in virtual environments of its own
# (scripts/setup_vllm.sh, scripts/setup_vllm_harness.sh): tests/test_vllm_plugin.py and tests/test_vllm_harness.py
# run them there; an interpreter without vLLM collects neither.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_plugin", "vllm_harness"]
