"""``EngineConfig`` nests one config per concern (``scheduler``, ``parallel``, ``kv_transfer``) and keeps every flat
spelling: keywords, attribute reads, ``replace``, CLI flags, with one default per option."""

from __future__ import annotations

import argparse
import dataclasses
import pickle

import pytest

from sarathi_lite import LLMEngine
from sarathi_lite.cli import build_parser
from sarathi_lite.cli.common import SIM_FIELDS, add_engine_args, engine_config, flag_name
from sarathi_lite.engine.config import (
    ENGINE_SET,
    OPTIONS,
    SCHEDULER_FIELDS,
    EngineConfig,
    KVTransferConfig,
    ParallelConfig,
    default_option,
)
from sarathi_lite.scheduler import SchedulerConfig, make_scheduler


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def _argv(config: EngineConfig) -> list[str]:
    """The flags that give ``config`` (its options that differ from their defaults)."""
    argv = []
    for name, option in OPTIONS.items():
        value = getattr(config, name)
        if value == option.default:
            continue
        flag = flag_name(option)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


NESTED = EngineConfig(model="m", scheduler=SchedulerConfig(policy="vllm", chunk_size=64, max_num_batched_tokens=8192,
                                                            enable_prefix_caching=False),
                      parallel=ParallelConfig(tensor_parallel_size=2),
                      kv_transfer=KVTransferConfig(role="consumer", store="s1"), async_scheduling=True,
                      num_kv_blocks=100)


def test_the_nested_config_round_trips_through_cli_flags_and_flat_keywords():
    argv = ["--model", "m", "--scheduler", "vllm", "--chunk-size", "64", "--max-num-batched-tokens", "8192",
            "--no-enable-prefix-caching", "--tensor-parallel-size", "2", "--kv-role", "consumer", "--kv-store", "s1",
            "--async-scheduling", "--num-kv-blocks", "100"]
    flat = EngineConfig("m", scheduler="vllm", chunk_size=64, max_num_batched_tokens=8192,
                        enable_prefix_caching=False, tensor_parallel_size=2, kv_role="consumer", kv_store="s1",
                        async_scheduling=True, num_kv_blocks=100)
    assert engine_config(_parse(argv)) == flat == NESTED
    assert EngineConfig.from_options("m", **{n: getattr(NESTED, n) for n in OPTIONS if n != "model"}) == NESTED
    assert engine_config(_parse(_argv(NESTED))) == NESTED  # and back: a config's flags give the config
    assert engine_config(_parse([])) == EngineConfig() == EngineConfig(scheduler=SchedulerConfig())
    assert pickle.loads(pickle.dumps(NESTED)) == NESTED  # tensor-parallel workers receive it pickled


def test_every_nested_field_reads_by_its_option_name():
    for name, option in OPTIONS.items():
        if option.section is not None:
            assert getattr(NESTED, name) == getattr(getattr(NESTED, option.section), option.field.name), name
    assert (NESTED.policy, NESTED.chunk_size, NESTED.tensor_parallel_size, NESTED.kv_role) == ("vllm", 64, 2,
                                                                                              "consumer")
    assert NESTED.kv_transfer.is_consumer and not NESTED.kv_transfer.is_producer
    assert default_option("chunk_size") == SchedulerConfig().chunk_size and default_option("kv_role") is None


def test_every_scheduler_field_is_an_option_and_a_flag_without_cli_code():
    """A field added to SchedulerConfig (or ParallelConfig, KVTransferConfig) is a keyword, an attribute and a
    flag with its help by itself: the options are the nested configs' fields, but those the engine sets."""
    engine_set = set(ENGINE_SET["scheduler"])
    scheduler = [f.name for f in dataclasses.fields(SchedulerConfig) if f.name not in engine_set]
    assert list(SCHEDULER_FIELDS) == scheduler and set(scheduler) <= set(SIM_FIELDS)
    assert {f.name for f in dataclasses.fields(ParallelConfig)} <= set(OPTIONS)
    assert {"kv_" + f.name for f in dataclasses.fields(KVTransferConfig)} <= set(OPTIONS)
    assert {"async_scheduling", "tensor_parallel_size", "kv_role", "kv_connector", "kv_store"} <= set(OPTIONS)
    assert all(f.metadata.get("help") for f in dataclasses.fields(SchedulerConfig))
    text = _subparser_help("generate")
    for flag in ("--async-scheduling", "--kv-role", "--tensor-parallel-size", "--min-chunk-size", "--scheduler"):
        assert flag in text, flag
    assert "overlap the CPU's scheduling of step N+1" in " ".join(text.split())


def _subparser_help(name: str) -> str:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name].format_help()


def test_replace_changes_one_option_and_keeps_the_rest():
    changed = NESTED.replace(chunk_size=8)
    assert [n for n in OPTIONS if getattr(changed, n) != getattr(NESTED, n)] == ["chunk_size"]
    assert changed.chunk_size == 8
    assert NESTED.replace(scheduler="sarathi").policy == "sarathi"
    assert NESTED.replace(scheduler="sarathi").chunk_size == 64  # the policy alone, not a fresh scheduler
    assert NESTED.replace(tensor_parallel_size=1).parallel == ParallelConfig()
    assert NESTED.replace(parallel=ParallelConfig(4)).tensor_parallel_size == 4
    assert NESTED.replace(kv_role=None).kv_transfer == KVTransferConfig(store="s1")
    assert dataclasses.replace(NESTED, chunk_size=8) == NESTED.replace(chunk_size=8)
    with pytest.raises(ValueError, match="chunk_size=0"):
        NESTED.replace(chunk_size=0)


def test_the_engine_derives_max_num_batched_tokens_unless_it_was_given():
    assert EngineConfig(policy="vllm").max_num_batched_tokens is None
    assert EngineConfig(policy="vllm").scheduler_config(10, 8192).max_num_batched_tokens == 8192
    assert EngineConfig(policy="vllm", max_num_batched_tokens=9000).scheduler_config(10, 8192
                                                                                     ).max_num_batched_tokens == 9000
    with pytest.raises(ValueError, match="max_num_batched_tokens=4096 is smaller than max_model_len=8192"):
        EngineConfig(policy="vllm", max_num_batched_tokens=4096).scheduler_config(10, 8192)
    # a SchedulerConfig built by hand carries the default of its own max_model_len: still the engine's to derive
    whole = EngineConfig(scheduler=SchedulerConfig(policy="vllm", max_model_len=4096))
    assert whole == EngineConfig(policy="vllm") and whole.scheduler_config(10, 8192).max_num_batched_tokens == 8192
    edited = EngineConfig(scheduler=dataclasses.replace(NESTED.scheduler, chunk_size=8))
    assert edited.scheduler_config(10, 8192).max_num_batched_tokens == 8192 and edited.chunk_size == 8
    cfg = EngineConfig(num_kv_blocks=7).scheduler_config(7, 100)
    assert (cfg.num_blocks, cfg.max_model_len) == (7, 100)


def test_unknown_and_bad_options_are_named():
    with pytest.raises(TypeError, match="unknown engine option.*chunk_sise"):
        EngineConfig(chunk_sise=8)
    with pytest.raises(TypeError, match="unknown engine option.*num_blocks"):  # the engine's to set
        EngineConfig(num_blocks=8)
    with pytest.raises(TypeError, match="unknown engine option.*role"):  # kv_transfer's is kv_role
        EngineConfig(role="producer")
    with pytest.raises(TypeError, match="name the policy once"):
        EngineConfig(scheduler="vllm", policy="orca")
    with pytest.raises(TypeError, match="parallel= takes a ParallelConfig, not SchedulerConfig"):
        EngineConfig(parallel=SchedulerConfig())
    with pytest.raises(ValueError, match="kv_role='sender' is not one of producer, consumer, both"):
        EngineConfig(kv_role="sender")
    with pytest.raises(ValueError, match="kv_connector='nixl'"):
        KVTransferConfig(role="producer", connector="nixl")
    with pytest.raises(ValueError, match="kv_store=''"):
        EngineConfig(kv_store="")
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be a positive integer"):
        ParallelConfig(0)
    with pytest.raises(ValueError, match="async_scheduling=1 must be True or False"):
        EngineConfig(async_scheduling=1)
    with pytest.raises(ValueError, match="policy='fifo'"):
        EngineConfig(scheduler="fifo")


def test_llm_engine_takes_the_flat_keywords_and_names_an_unknown_one(tiny_checkpoints):
    with pytest.raises(TypeError, match="unknown engine option.*chunk_sise"):
        LLMEngine(tiny_checkpoints["llama"], chunk_sise=8)
    engine = LLMEngine(tiny_checkpoints["llama"], scheduler="vllm", chunk_size=32, tensor_parallel_size=1,
                       kv_store="mine", num_kv_blocks=64, device="cpu", attention_backend="torch")
    assert engine.config.scheduler.policy == engine.scheduler_config.policy == "vllm"
    assert engine.config.kv_transfer == KVTransferConfig(store="mine") and engine.config.parallel == ParallelConfig()
    assert engine.scheduler_config.num_blocks == 64
    assert engine.scheduler_config.max_num_batched_tokens == max(engine.scheduler_config.max_model_len, 2048)


def test_the_configs_are_dataclasses_and_the_flat_names_come_from_options():
    """No option is attached to ``EngineConfig`` (the flat names are read through ``OPTIONS``), and the scheduler
    options an engine holds leave what the engine sets unknown (``None``), not at a stand-in value."""
    assert not [name for name, o in OPTIONS.items() if o.section is not None and hasattr(EngineConfig, name)]
    options = EngineConfig(policy="vllm", max_num_batched_tokens=1024).scheduler
    assert (options.max_model_len, options.num_blocks, options.max_num_batched_tokens) == (None, None, 1024)
    with pytest.raises(ValueError, match="max_model_len=None"):
        make_scheduler(options)
    assert make_scheduler(EngineConfig(policy="vllm").scheduler_config(8, 1024)).config.max_num_batched_tokens == 2048
