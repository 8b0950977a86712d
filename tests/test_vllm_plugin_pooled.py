"""``benchmarks/vllm_plugin.py``'s long-tail rounds pooled (``pooled``): percentiles over every round's requests and
throughput over the sum of the rounds' spans, per system (the script's servers need vLLM; this part does not)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    pytest.importorskip("httpx")  # the script's client; installed with the serve extra by .ci/run
    spec = importlib.util.spec_from_file_location("vllm_plugin_bench", ROOT / "benchmarks" / "vllm_plugin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(system: str, rnd: int, shorts: list[float], longs: list[float], span: float, tokens: int) -> dict:
    return {"system": system, "workload": "long-tail", "round": rnd, "short_ttfts": shorts, "long_ttfts": longs,
            "duration_s": span, "output_tokens": tokens}


def test_rounds_pool_into_one_run_per_system(script) -> None:
    rng = np.random.default_rng(0)
    a0, a1 = list(rng.uniform(0.2, 1.0, 35)), list(rng.uniform(0.2, 1.0, 34)) + [9.0]
    rows = [row("a", 0, a0, [6.0, 7.0], 90.0, 1800), row("a", 1, a1, [8.0], 110.0, 1900),
            row("b", 0, [1.0, 2.0], [], 50.0, 100),
            {"system": "a", "workload": "conversation", "round": 0, "qps": 1.0}]  # not long-tail: left out
    cells = script.pooled(rows)
    assert set(cells) == {"a", "b"}
    a = cells["a"]
    assert a["rounds"] == [0, 1] and a["short_requests"] == 70 and a["long_requests"] == 3
    assert a["short_ttft_p99"] == pytest.approx(np.percentile(a0 + a1, 99))
    assert a["long_ttft_p50"] == 7.0
    # all rounds' tokens over the sum of their spans, not the mean of the rounds' rates (20.0 and 17.27)
    assert a["throughput_output_tokens_per_s"] == pytest.approx(3700 / 200)
    assert "long_ttft_p50" not in cells["b"] and cells["b"]["long_requests"] == 0
