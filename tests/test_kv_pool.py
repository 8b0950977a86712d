"""One pure function sizes the KV pool and ``max_model_len`` for the engine, the simulator and the roofline
model: the three agree on the same deployment."""

from __future__ import annotations

import pytest

from sarathi_lite.costs.memory import device_kv_budget
from sarathi_lite.costs.profiled import ProfiledCostModel
from sarathi_lite.costs.roofline import MODEL_SHAPES, hardware, roofline
from sarathi_lite.engine.config import EngineConfig, KVPool, kv_pool
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.sim.simulator import scheduler_config


def test_the_pool_comes_from_blocks_then_the_options_budget_then_the_deployments():
    per_token = 1000
    sized = kv_pool(EngineConfig(block_size=16), kv_bytes_per_token=per_token, max_position_embeddings=8192,
                    kv_cache_memory=16_000_000)
    assert sized == KVPool(1000, 16, 8192, 16_000_000)
    own = kv_pool(EngineConfig(block_size=16, kv_cache_memory=1_600_000), kv_bytes_per_token=per_token,
                  max_position_embeddings=8192, kv_cache_memory=16_000_000)
    assert (own.num_blocks, own.max_model_len) == (100, 1600)  # capped by the pool's tokens
    given = kv_pool(EngineConfig(num_kv_blocks=7, block_size=4, max_model_len=20), kv_bytes_per_token=None,
                    max_position_embeddings=None)
    assert given == KVPool(7, 4, 20, None)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        kv_pool(EngineConfig(), kv_bytes_per_token=per_token, max_position_embeddings=8192)
    with pytest.raises(ValueError, match="holds no KV block"):
        kv_pool(EngineConfig(kv_cache_memory=10), kv_bytes_per_token=per_token, max_position_embeddings=8192)
    with pytest.raises(ValueError, match="max_model_len=9000 exceeds"):
        kv_pool(EngineConfig(num_kv_blocks=8, max_model_len=9000), kv_bytes_per_token=per_token,
                max_position_embeddings=8192)


def test_a_device_budget_keeps_the_larger_of_the_utilization_margin_and_1_gib():
    gib = 1 << 30
    assert device_kv_budget(60 * gib, 80 * gib, 0.9) == 52 * gib
    assert device_kv_budget(6 * gib, 8 * gib, 0.95) == 5 * gib


def test_engine_and_simulator_derive_the_same_pool(tiny_checkpoints):
    engine = LLMEngine(tiny_checkpoints["llama"], block_size=8, kv_cache_memory=300_000, device="cpu")
    model = engine.model_config
    cost = ProfiledCostModel((1, 2), (0.01, 0.01), kv_bytes_per_token=model.kv_bytes_per_token(4),
                             kv_cache_memory=300_000, max_position_embeddings=model.max_position_embeddings)
    simulated = scheduler_config(cost, "sarathi", None, block_size=8)
    assert (simulated.num_blocks, simulated.max_model_len) == (engine.scheduler_config.num_blocks,
                                                               engine.scheduler_config.max_model_len)
    assert engine.runner.kv_cache.shape[1] == simulated.num_blocks


def test_the_roofline_model_sizes_its_budget_as_a_device_engine_would():
    model = roofline("h100", "llama3-8b")
    hw, shape = hardware("h100"), ModelConfig.from_dict(MODEL_SHAPES["llama3-8b"])
    embedding = shape.hidden_size * shape.vocab_size * 2  # untied: the input embedding is a second copy
    assert model.kv_cache_memory == device_kv_budget(hw.memory - model.weight_bytes - embedding, hw.memory, 0.9)
    assert model.kv_bytes_per_token == shape.kv_bytes_per_token(2) == 32 * 2 * 8 * 128 * 2
    cfg = scheduler_config(model, "sarathi", 512)
    assert cfg.num_blocks == model.kv_cache_memory // (model.kv_bytes_per_token * 16) and cfg.max_model_len == 8192
