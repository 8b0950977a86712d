"""vLLM engines for the plugin tests, one per configuration and module (vLLM's start-up is slow): in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so a test can read the scheduler's step log, eager, float32, seeded.
These tests run in the vLLM virtual environment (``scripts/setup_vllm.sh``), driven by
``tests/test_vllm_plugin.py``."""

from __future__ import annotations

import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import gc  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.conftest import make_tiny_checkpoint  # noqa: E402

PLUGIN = "sarathi_lite.integrations.vllm.SarathiScheduler"


def make_llm(model: Path, *, plugin: dict | None = None, **kwargs):
    """A ``vllm.LLM`` on ``model`` (eager, float32, seed 0), with the plugin and its ``plugin`` options when
    given, else vLLM's default scheduler."""
    from vllm import LLM

    args = dict(enforce_eager=True, dtype="float32", seed=0, max_model_len=1024, max_num_seqs=16,
                max_num_batched_tokens=256)
    args.update(kwargs)
    if plugin is not None:
        args.update(scheduler_cls=PLUGIN, additional_config={"sarathi_lite": plugin})
    return LLM(str(model), **args)


def scheduler_of(llm):
    """The engine core's scheduler (in-process engine)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama (head_dim 64, which vLLM's CPU attention takes); prompts are token ids."""
    return make_tiny_checkpoint("llama_hd64", tmp_path_factory.mktemp("tiny") / "llama_hd64")


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as converted by the main environment (``SARATHI_SMOLLM2``: its folder)."""
    path = os.environ.get("SARATHI_SMOLLM2")
    if not path:
        from sarathi_lite.models import builtin

        path = builtin.resolve_model("smollm2-135m")
    return Path(path)
