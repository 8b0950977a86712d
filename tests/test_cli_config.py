"""The CLI's engine flags come from ``EngineConfig``: one flag per field with its type, choices and help, ``None``
defaults (so the dataclass keeps the one default), and the flags given turn back into an ``EngineConfig``."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from sarathi_lite.cli import build_parser, main
from sarathi_lite.cli.common import SIM_FIELDS, add_engine_args, engine_config, flag_name, option_fields
from sarathi_lite.engine.config import SCHEDULER_FIELDS, EngineConfig


def _subparser(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _engine_flags(parser: argparse.ArgumentParser) -> set[str]:
    names = {f.name for f in option_fields()}
    return {a.dest for a in parser._actions if a.dest in names}


def test_every_field_has_help_and_a_flag_in_every_engine_command():
    fields = option_fields()
    assert all(f.metadata.get("help") for f in fields)
    for command in ("generate", "bench", "capacity"):
        assert _engine_flags(_subparser(command)) == {f.name for f in fields}, command
    assert _engine_flags(_subparser("sim")) == set(SIM_FIELDS)
    assert "dtype" not in SIM_FIELDS and {"chunk_size", "num_kv_blocks", "max_model_len"} <= set(SIM_FIELDS)
    profile = _engine_flags(_subparser("profile"))
    assert {"model", "block_size", "num_kv_blocks", "dtype", "device", "attention_backend"} <= profile
    assert not profile & (set(SCHEDULER_FIELDS) - {"block_size"})


def test_flags_parse_to_the_fields_types_and_default_to_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    untouched = parser.parse_args([])
    assert all(getattr(untouched, f.name) is None for f in option_fields())
    assert engine_config(untouched) == EngineConfig()
    args = parser.parse_args(["--scheduler", "vllm", "--chunk-size", "64", "--max-num-seqs", "3", "--watermark",
                              "0.05", "--kv-cache-memory", "4096", "--dtype", "bfloat16", "--record-batches"])
    assert engine_config(args) == EngineConfig(policy="vllm", chunk_size=64, max_num_seqs=3, watermark=0.05,
                                               kv_cache_memory=4096, dtype="bfloat16", record_batches=True)
    assert engine_config(args, chunk_size=8).chunk_size == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int8"])  # choices from the field's metadata
    with pytest.raises(SystemExit):
        parser.parse_args(["--chunk-size", "many"])  # an int field


def test_a_field_level_type_hook_parses_values_the_annotation_does_not():
    def chunk(text: str) -> int | str:
        return text if text == "auto" else int(text)

    @dataclasses.dataclass
    class Config:
        chunk_size: int | str = dataclasses.field(default=512, metadata={"help": "budget", "type": chunk})
        tbt_slo: float | None = dataclasses.field(default=None, metadata={"help": "seconds"})

    parser = argparse.ArgumentParser()
    add_engine_args(parser, config_class=Config)
    assert [flag_name(f) for f in dataclasses.fields(Config)] == ["--chunk-size", "--tbt-slo"]
    assert vars(parser.parse_args(["--chunk-size", "auto", "--tbt-slo", "0.2"])) == {"chunk_size": "auto",
                                                                                      "tbt_slo": 0.2}
    assert parser.parse_args(["--chunk-size", "64"]).chunk_size == 64
    assert "(default: 512)" in parser.format_help()


def test_a_bad_flag_value_is_reported_by_name(capsys):
    assert main(["sim", "--cost-model", "roofline:h100", "--lengths", "fixed:8:2", "--num-requests", "2",
                 "--chunk-size", "0"]) == 2
    assert "chunk_size=0" in capsys.readouterr().err
