"""``benchmarks/vllm_releases_sim.py``'s parts that need no vLLM: the systems' names as vLLM settings, and the
issue's bars read from the rows (capacity against vLLM's default and its best adaptive setting; on the long-tail
mix the 3x short-request TTFT p99 at throughput within 3%, and no worse on both against every setting swept)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports auto_budget beside it
    try:
        spec = importlib.util.spec_from_file_location("vllm_releases_sim", ROOT / "benchmarks" / "vllm_releases_sim.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass resolves its annotations there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_system_names_become_vllm_settings(script) -> None:
    plugin = script.System.parse("plugin").options()
    assert plugin["scheduler"] == "plugin" and plugin["plugin_options"] == {}  # the plugin's own defaults
    assert plugin["chunk_size"] == script.BUDGET and plugin["max_num_seqs"] == script.SEATS
    vllm = script.System.parse("vllm").options()
    assert vllm["scheduler"] == "default" and vllm["long_prefill_token_threshold"] == 0 and not vllm["vllm_fields"]
    swept = script.System.parse("adaptive@512+cadence@2").options()
    assert swept["long_prefill_token_threshold"] == 512
    assert swept["vllm_fields"] == {"long_prefill_token_threshold_adaptive": True, "prefill_schedule_interval": 2}
    small = script.System.parse("vllm-budget@512").options()
    assert small["chunk_size"] == 512 and small["max_num_seqs"] == 512  # vLLM refuses fewer tokens than seats
    assert script.System.parse("plugin@2048").options()["plugin_options"] == {"chunk_size": 2048}
    for bad in ("adaptive@", "adaptive@x", "vllm@512", "plugin@auto", "adaptive@256+cadence@"):
        with pytest.raises(SystemExit, match="unknown system"):
            script.System.parse(bad)


def capacity(system: str, cap: float | None, trace: str = "conversation") -> dict:
    return {"part": "capacity", "model": "llama3-8b", "trace": trace, "system": system, "capacity": cap}


def tail(system: str, short_p99: float, long_p50: float, tok_s: float = 100.0) -> dict:
    return {"part": "long-tail", "model": "llama3-8b", "system": system, "short_ttft_p99": short_p99,
            "long_ttft_p50": long_p50, "out_tok_s": tok_s}


def verdicts(script, rows: list[dict]) -> dict:
    return {(b["bar"], b.get("trace"), b.get("against")): b["met"] for b in script.bars(rows)}


def test_capacity_bars(script) -> None:
    rows = [capacity("plugin", 11.0), capacity("vllm", 10.0), capacity("adaptive@256", 12.0),
            capacity("adaptive@1024", None), capacity("plugin", 5.0, "arxiv"), capacity("vllm", None, "arxiv"),
            capacity("adaptive@256", 5.0, "arxiv"),
            {"part": "capacity", "model": "llama3-8b", "trace": "arxiv", "system": "adaptive@512", "error": "x"}]
    bars = {(b["bar"], b["trace"]): b for b in script.bars(rows)}
    conv = bars[("capacity >= 1.1x vllm", "conversation")]
    assert conv["met"] is True and conv["ratio"] == pytest.approx(1.1)
    best = bars[("capacity >= 1.0x best adaptive", "conversation")]
    assert best["best"] == "adaptive@256" and best["met"] is False  # 11 < 12: a miss is reported as one
    assert bars[("capacity >= 1.1x vllm", "arxiv")]["met"] is True  # vLLM below the range, the plugin in it
    assert bars[("capacity >= 1.0x best adaptive", "arxiv")]["met"] is True  # a tie; the errored cell left out


def test_long_tail_bars(script) -> None:
    rows = [tail("plugin", 0.1, 1.0), tail("vllm", 0.31, 0.8, 97.5), tail("adaptive@256", 0.2, 0.9),
            tail("adaptive@512", 0.1, 1.2), tail("adaptive@1024", 0.05, 1.5), tail("adaptive@2048", 0.1, 1.0),
            tail("plugin@2048", 0.3, 0.5), tail("vllm-budget@512", 0.3, 0.5)]
    met = verdicts(script, rows)
    assert met[("short TTFT p99 >= 3x lower than vllm, throughput within 3%", None, None)] is True
    other = "lower short TTFT p99 or long TTFT p50, no worse of the other"
    assert met[(other, None, "adaptive@256")] is False  # lower short p99, higher long p50: a trade, not a win
    assert met[(other, None, "adaptive@512")] is True  # equal short p99, lower long p50
    assert met[(other, None, "adaptive@1024")] is False
    assert met[(other, None, "adaptive@2048")] is False  # equal on both: no lower one
    assert not any(key[2] in ("plugin@2048", "vllm-budget@512") for key in met)  # for the reader only
    slower = verdicts(script, [tail("plugin", 0.1, 1.0, 96.0), tail("vllm", 0.31, 0.8, 100.0)])
    assert slower[("short TTFT p99 >= 3x lower than vllm, throughput within 3%", None, None)] is False  # -4%
