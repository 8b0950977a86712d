"""Models sit behind an interface: the loader picks the class by the checkpoint's ``architectures`` from a registry
(each with its weight-name map) and names an architecture it does not know; Qwen3, a family added only through
the registry, matches Hugging Face (logits, greedy tokens), also over two tensor-parallel ranks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from sarathi_lite import LLMEngine
from sarathi_lite.engine.model_runner import ModelRunner
from sarathi_lite.models import registry
from sarathi_lite.models.interface import CausalLM, WeightMap
from sarathi_lite.models.llama import LlamaForCausalLM
from sarathi_lite.models.loader import load_model
from sarathi_lite.models.parallel import TensorParallel
from sarathi_lite.models.qwen3 import Qwen3ForCausalLM
from sarathi_lite.scheduler import POLICIES, Request

from .conftest import HFReference
from .parity import NEAR_TIE, assert_matches_hf, run_staggered, workload
from .test_engine_parity import check_run

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind, cls", [("llama", LlamaForCausalLM), ("mistral", LlamaForCausalLM),
                                       ("qwen2", LlamaForCausalLM), ("qwen3", Qwen3ForCausalLM)])
def test_the_loader_builds_the_class_registered_for_the_checkpoints_architecture(tiny_checkpoints, kind, cls):
    architecture = json.loads((tiny_checkpoints[kind] / "config.json").read_text())["architectures"][0]
    assert registry.model_spec([architecture]).model_class is cls
    model = load_model(tiny_checkpoints[kind], torch.float32, CPU)
    assert type(model) is cls and isinstance(model, CausalLM)


def test_an_unsupported_architecture_is_named(tiny_checkpoints, tmp_path):
    folder = tmp_path / "gemma"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"architecture GemmaForCausalLM is not supported \(registered: "
                                         r"LlamaForCausalLM, .*Qwen3ForCausalLM\)"):
        load_model(folder, torch.float32, CPU)
    with pytest.raises(ValueError, match="architecture GemmaForCausalLM is not supported"):
        LLMEngine(folder, device="cpu")
    del config["architectures"]  # a config.json that names none: read by its model_type, as before the registry
    (folder / "config.json").write_text(json.dumps(config))
    assert type(load_model(folder, torch.float32, CPU)) is LlamaForCausalLM
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    with pytest.raises(ValueError, match="model_type='gemma' has no registered model"):
        load_model(folder, torch.float32, CPU)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.model_spec(["LlamaForCausalLM"]))


def test_a_weight_map_fuses_by_module_name_and_counts_the_parts():
    weights = WeightMap(fused={"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)},
                        skip=("inv_freq",))
    assert weights.target("model.layers.3.self_attn.k_proj.bias") == ("model.layers.3.self_attn.qkv_proj.bias", 1)
    assert weights.target("model.layers.3.self_attn.q_norm.weight") == ("model.layers.3.self_attn.q_norm.weight",
                                                                        None)
    assert weights.num_parts("model.layers.0.self_attn.qkv_proj.weight") == 3
    assert weights.num_parts("model.norm.weight") == 1
    assert weights.skips("model.layers.0.self_attn.rotary_emb.inv_freq") and not weights.skips("lm_head.weight")


@torch.no_grad()
def _prefix_logits(model: CausalLM, prompt: list[int]) -> torch.Tensor:
    """Our logits [len(prompt), vocab] for every prefix of ``prompt``: one batch of len(prompt) requests, request
    i the prompt's first i + 1 tokens whole, each sampling at its end, through ``ModelRunner.forward``."""
    from sarathi_lite.scheduler import SchedulerConfig, make_scheduler

    n = len(prompt)
    blocks = sum(-(-(i + 1) // 16) for i in range(n))
    scheduler = make_scheduler(SchedulerConfig(chunk_size=n * (n + 1) // 2, max_num_seqs=n, block_size=16,
                                               num_blocks=blocks, max_model_len=n, watermark=0.0,
                                               enable_prefix_caching=False))
    for i in range(n):
        scheduler.add(Request(f"p{i}", prompt[:i + 1], 1, frozenset(), 0.0))
    out = scheduler.schedule()
    assert len(out.scheduled) == n
    runner = ModelRunner(model, block_size=16, num_blocks=blocks, device=CPU, dtype=torch.float32,
                         attention_backend="torch")
    logits, rows, _, _ = runner.forward(out)
    order = [int(out.scheduled[r].request_id[1:]) for r in rows]
    return logits[torch.tensor(order).argsort()]


def test_qwen3_logits_match_hf_at_every_position(tiny_checkpoints, hf_reference):
    prompt = workload(seed=4, n=3, max_prompt=40)[1][0]
    ours = _prefix_logits(load_model(tiny_checkpoints["qwen3"], torch.float32, CPU), prompt)
    theirs = hf_reference("qwen3").logits(prompt)
    assert ours.shape == theirs.shape == (40, 320)
    assert float((ours - theirs).abs().max()) < 1e-4


def test_qwen3_without_its_qk_norm_would_not_match(tiny_checkpoints, hf_reference, monkeypatch):
    """The parity above is not vacuous: with its q/k norm weights reset to ones, the same checkpoint gives other
    logits (the loaded norm weights are used), and the Llama class has no place for them."""
    model = load_model(tiny_checkpoints["qwen3"], torch.float32, CPU)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
    prompt = workload(seed=4, n=3, max_prompt=40)[1][0]
    assert float((_prefix_logits(model, prompt) - hf_reference("qwen3").logits(prompt)).abs().max()) > 1e-2
    llama = registry.ModelSpec("Qwen3AsLlama", LlamaForCausalLM, registry.model_spec(["Qwen3ForCausalLM"]).weights,
                               "qwen3")
    monkeypatch.setattr(registry, "_REGISTRY", {"Qwen3ForCausalLM": llama})
    with pytest.raises(ValueError, match=r"self_attn\.[qk]_norm\.weight' has no place in the model"):
        load_model(tiny_checkpoints["qwen3"], torch.float32, CPU)


@pytest.mark.parametrize("chunk_size", [7, 4096])
@pytest.mark.parametrize("policy", POLICIES)
def test_qwen3_greedy_matches_hf_generate(tiny_checkpoints, hf_reference, policy, chunk_size):
    engine = LLMEngine(tiny_checkpoints["qwen3"], scheduler=policy, chunk_size=chunk_size, block_size=16,
                       num_kv_blocks=64, device="cpu", attention_backend="torch")
    assert type(engine.model) is Qwen3ForCausalLM
    check_run(engine, hf_reference("qwen3"), seed=5)


def test_qwen3_shards_split_the_heads_and_replicate_the_qk_norm(tiny_checkpoints):
    path = tiny_checkpoints["qwen3"]
    full = load_model(path, torch.float32, CPU)
    ranks = [load_model(path, torch.float32, CPU, tp=TensorParallel(r, 2)) for r in range(2)]
    for i, layer in enumerate(full.model.layers):
        for rank in ranks:
            attn = rank.model.layers[i].self_attn
            assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
            assert torch.equal(attn.q_norm.weight, layer.self_attn.q_norm.weight)
            assert torch.equal(attn.k_norm.weight, layer.self_attn.k_norm.weight)
        q = full.config.num_heads * full.config.head_dim
        shards = torch.cat([r.model.layers[i].self_attn.qkv_proj.weight[:q // 2] for r in ranks])
        assert torch.equal(shards, layer.self_attn.qkv_proj.weight[:q])


def test_qwen3_tp2_greedy_matches_tp1_and_hf(tiny_checkpoints):
    options = dict(block_size=16, num_kv_blocks=12, device="cpu", attention_backend="torch")
    path = tiny_checkpoints["qwen3"]
    ref = HFReference(path)
    work = workload(seed=11, max_prompt=120, max_output=40, vocab=320)
    tp1 = LLMEngine(path, chunk_size=7, **options)
    tp2 = LLMEngine(path, tensor_parallel_size=2, chunk_size=7, **options)
    try:
        runs = {name: run_staggered(engine, work) for name, engine in (("tp1", tp1), ("tp2", tp2))}
        assert sum(r.num_preemptions for r in tp2.stats().requests) > 0
    finally:
        tp2.shutdown()
    assert mp.active_children() == []
    exact = 0
    for i, (prompt, n) in enumerate(work):
        _, tokens, logprobs = runs["tp2"][f"r{i}"]
        _, tokens1, _ = runs["tp1"][f"r{i}"]
        assert_matches_hf(ref, prompt, tokens, logprobs, n)
        same = next((j for j, (a, b) in enumerate(zip(tokens, tokens1)) if a != b), len(tokens))
        if same < len(tokens):  # a flip between TP=1 and TP=2 must be a near-tie under teacher forcing
            hf = ref.logits(prompt + tokens[:same])[-1]
            assert abs(float(hf[tokens[same]] - hf[tokens1[same]])) <= NEAR_TIE
        exact += tokens == tokens1
    assert exact >= len(work) - 1
