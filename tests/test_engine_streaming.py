"""Step outputs as deltas: text deltas that concatenate to the full decode (multi-byte characters included),
stop strings across token boundaries, ``min_tokens``, and bounded records for long-running engines."""

from __future__ import annotations

import pytest

from sarathi_lite import LLM, LLMEngine, SamplingParams
from tests.conftest import TINY, make_tiny_checkpoint
from tests.tiny_tokenizer import save_tiny_tokenizer

PROMPTS = ["héllo wörld, 世界", "The quick brown fox", "emoji 🙂 and"]


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tok") / "llama")
    return save_tiny_tokenizer(path, TINY["vocab_size"])


@pytest.fixture(scope="module")
def engine(tiny_with_tokenizer) -> LLMEngine:
    return LLMEngine(tiny_with_tokenizer, chunk_size=16, block_size=4, num_kv_blocks=256, device="cpu")


def stream(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> dict[str, tuple[list, object]]:
    """Run ``prompts`` together; per request, every step output and the final one."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    steps: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            steps[o.request_id].append(o)
    return {rid: (outs, outs[-1]) for rid, outs in steps.items()}


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_text_deltas_concatenate_to_the_full_decode_including_multibyte(engine):
    runs = stream(engine, PROMPTS, greedy(40))
    tok = engine.tokenizer
    for steps, final in runs.values():
        assert all(len(o.new_token_ids) == 1 for o in steps)
        assert [o.num_output_tokens for o in steps] == list(range(1, 41))
        assert all(o.token_ids is None and o.text is None for o in steps[:-1]), "only the end carries full lists"
        assert [t for o in steps for t in o.new_token_ids] == final.token_ids
        assert "".join(o.new_text for o in steps) == final.text == tok.decode(final.token_ids,
                                                                             skip_special_tokens=True)
    # the random model emits byte tokens that form incomplete characters: some deltas had to wait
    assert any(o.new_text == "" for steps, _ in runs.values() for o in steps[:-1])


def test_stop_strings_match_across_token_boundaries_and_are_never_emitted(engine):
    free = stream(engine, PROMPTS, greedy(40))
    for i, (_, final) in enumerate(free.values()):
        text = final.text
        stop = text[len(text) // 2: len(text) // 2 + 4]  # four characters from the middle, over token boundaries
        cut = text.index(stop)
        runs = stream(engine, [PROMPTS[i]], greedy(40, stop=["never-there", stop]))
        steps, out = runs["r0"]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == "".join(o.new_text for o in steps) == text[:cut]
        assert out.num_output_tokens < 40
        kept = stream(engine, [PROMPTS[i]], greedy(40, stop=[stop], include_stop_str_in_output=True))["r0"]
        assert kept[1].text == "".join(o.new_text for o in kept[0]) == text[:cut + len(stop)]
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_min_tokens_keeps_stop_tokens_out_until_reached(engine):
    free = stream(engine, [PROMPTS[1]], greedy(12))["r0"][1].token_ids
    stop_token = free[2]
    early = stream(engine, [PROMPTS[1]], greedy(12, stop_token_ids=[stop_token]))["r0"][1]
    assert early.finish_reason == "stop" and early.num_output_tokens == free.index(stop_token) + 1
    held = stream(engine, [PROMPTS[1]], greedy(12, stop_token_ids=[stop_token], min_tokens=8))["r0"][1]
    assert held.num_output_tokens >= 8 and stop_token not in held.token_ids[:7]


def test_stats_window_bounds_the_records_and_llm_keeps_everything(tiny_with_tokenizer):
    bounded = LLMEngine(tiny_with_tokenizer, chunk_size=16, block_size=4, num_kv_blocks=256, device="cpu",
                        stats_window=3)
    for _ in range(3):
        stream(bounded, PROMPTS, greedy(5))
    stats = bounded.stats()
    assert len(stats.requests) == 3 and len(stats.iterations) == 3
    assert bounded.metrics.num_iterations > 3 and stats.iterations[-1].index == bounded.metrics.num_iterations - 1
    llm = LLM(tiny_with_tokenizer, chunk_size=16, block_size=4, num_kv_blocks=256, device="cpu")
    for _ in range(3):
        llm.generate(PROMPTS, greedy(5), use_tqdm=False)
    assert len(llm.stats().requests) == 9 and len(llm.stats().iterations) == llm.engine.metrics.num_iterations
