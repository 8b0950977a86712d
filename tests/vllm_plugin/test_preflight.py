"""The ``vllm.general_plugins`` entry point (``preflight.register``): a configuration naming the plugin's scheduler is
checked as soon as vLLM makes it, before any engine, model or KV cache exists; vLLM without the plugin is left
alone, an unsupported vLLM release included."""

from __future__ import annotations

import pytest
import vllm
from vllm.engine.arg_utils import EngineArgs

from .conftest import PLUGIN


def engine_args(model, **kwargs) -> EngineArgs:
    return EngineArgs(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                      max_model_len=1024, max_num_batched_tokens=256, **kwargs)


def test_a_bad_option_is_refused_when_vllm_makes_its_configuration(tiny_model):
    args = engine_args(tiny_model, scheduler_cls=PLUGIN, additional_config={"sarathi_lite": {"chunk_size": 4096}})
    with pytest.raises(ValueError, match="chunk_size=4096 is larger than vLLM's max_num_batched_tokens=256"):
        args.create_engine_config()
    conflicting = engine_args(tiny_model, scheduler_cls=PLUGIN, long_prefill_token_threshold=64,
                              long_prefill_token_threshold_adaptive=True)
    with pytest.raises(ValueError, match="--long-prefill-token-threshold-adaptive True"):
        conflicting.create_engine_config()
    assert engine_args(tiny_model, scheduler_cls=PLUGIN).create_engine_config().additional_config == {}


def test_an_unsupported_vllm_is_refused_up_front_only_where_the_plugin_is_asked_for(tiny_model, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0, 0\.33\.0, 0\.34\.0, not '0\.35\.0'"):
        engine_args(tiny_model, scheduler_cls=PLUGIN).create_engine_config()
    assert engine_args(tiny_model).create_engine_config() is not None  # vLLM's own scheduler: untouched
