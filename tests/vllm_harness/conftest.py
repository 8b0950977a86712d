"""The model-free contract harness's tests: vLLM's own scheduler of the installed release
(``sarathi_lite.integrations.vllm.harness``), run in each vLLM environment by ``tests/test_vllm_harness.py``
(``scripts/setup_vllm.sh`` makes the 0.32 one, ``scripts/setup_vllm_harness.sh`` the 0.33 and 0.34 ones)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import random  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from sarathi_lite.integrations.vllm.harness import Harness, tiny_model  # noqa: E402

BUDGET = 256
"""vLLM's ``max_num_batched_tokens`` and the plugin's ``chunk_size`` in these tests."""


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def long_tail_stream(seed: int = 0, longs: int = 3, shorts: int = 24) -> dict[int, list[tuple]]:
    """Arrivals by step: ``longs`` prompts of 1,600 tokens, one every 10 steps, and ``shorts`` prompts of 16-64
    tokens, one or two a step at random steps among them; outputs of 4-16 tokens, a few ending at a stop token."""
    rng = random.Random(seed)
    arrivals: dict[int, list[tuple]] = {}
    for i in range(longs):
        arrivals.setdefault(10 * i, []).append((f"long{i}", 1600, rng.randint(4, 12)))
    for i in range(shorts):
        step = rng.randint(1, 10 * longs + 4)
        stop = rng.randint(1, 6) if i % 5 == 0 else None
        arrivals.setdefault(step, []).append((f"short{i}", rng.randint(16, 64), rng.randint(4, 16), stop))
    return arrivals


def run(model: Path, scheduler: str, async_scheduling: bool, arrivals: dict[int, list[tuple]], **kwargs) -> Harness:
    """A harness of ``scheduler`` run over ``arrivals`` to the end, every output processed."""
    kwargs.setdefault("max_num_batched_tokens", BUDGET)
    kwargs.setdefault("enable_prefix_caching", True)
    if scheduler == "plugin":
        kwargs.setdefault("plugin_options", {"chunk_size": kwargs["max_num_batched_tokens"]})
    harness = Harness(model, scheduler=scheduler, async_scheduling=async_scheduling, **kwargs)
    harness.run(arrivals)
    harness.drain()
    return harness


@pytest.fixture(scope="session", autouse=True)
def expected_release():
    """``SARATHI_EXPECT_VLLM`` (set by tests/test_vllm_harness.py): the release this environment must hold."""
    import vllm

    expected = os.environ.get("SARATHI_EXPECT_VLLM")
    assert expected is None or vllm.__version__.startswith(expected + "."), (vllm.__version__, expected)
