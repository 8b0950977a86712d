"""The vLLM plugin's options (``sarathi_lite/integrations/vllm/options.py``) without vLLM: the module imports no
vLLM (the package's ``__init__`` does, to refuse unsupported releases), so it is loaded here from its file and
checked in this interpreter; the plugin's own suite (tests/vllm_plugin) runs inside vLLM."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import sarathi_lite

PATH = Path(sarathi_lite.__file__).parent / "integrations" / "vllm" / "options.py"
LIMITS = dict(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=1024, block_size=16, num_blocks=64,
              long_prefill_token_threshold=0, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def parse_options():
    spec = importlib.util.spec_from_file_location("sarathi_lite_vllm_options", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
        yield module.parse_options
    finally:
        del sys.modules[spec.name]


def parse(parse_options, limits=None, **options):
    return parse_options({"sarathi_lite": options}, **{**LIMITS, **(limits or {})})


def test_a_step_log_that_cannot_be_written_is_refused_when_parsed(parse_options, tmp_path):
    with pytest.raises(ValueError, match=r"step_log='.*' is a directory"):
        parse(parse_options, step_log=str(tmp_path))
    with pytest.raises(ValueError, match=r"step_log='.*/missing/steps\.jsonl' cannot be written: No such file"):
        parse(parse_options, step_log=str(tmp_path / "missing" / "steps.jsonl"))
    log = tmp_path / "steps.jsonl"
    assert parse(parse_options, step_log=str(log)).step_log == log and log.is_file()


def test_a_missing_cost_model_is_refused_even_with_a_fixed_chunk_size(parse_options, tmp_path):
    with pytest.raises(ValueError, match=r"cost model file '.*missing\.json' not found"):
        parse(parse_options, chunk_size=64, cost_model=str(tmp_path / "missing.json"))
    assert parse(parse_options, chunk_size=64, cost_model="roofline:h100").cost_model is None  # unused by 64
    assert parse(parse_options, chunk_size="auto", tbt_slo=0.1, cost_model="roofline:h100").cost_model is not None


def test_a_zero_max_num_batched_tokens_is_named_as_such(parse_options):
    with pytest.raises(ValueError, match=r"^vLLM's max_num_batched_tokens=0 must be a positive integer"):
        parse(parse_options, {"max_num_batched_tokens": 0})
    with pytest.raises(ValueError, match=r"^vLLM's max_num_batched_tokens=0"):
        parse(parse_options, {"max_num_batched_tokens": 0}, chunk_size=64)


def test_a_min_chunk_size_above_the_step_budget_is_refused(parse_options):
    with pytest.raises(ValueError, match=r"min_chunk_size=128 is above the token budget of a step \(chunk_size=64\)"):
        parse(parse_options, chunk_size=64, min_chunk_size=128)
    with pytest.raises(ValueError, match=r"min_chunk_size=512 is above .*max_num_batched_tokens=256\)"):
        parse(parse_options, chunk_size="auto", tbt_slo=0.1, cost_model="roofline:h100", min_chunk_size=512)
    assert parse(parse_options, chunk_size=64, min_chunk_size=64).config.min_chunk_size == 64
