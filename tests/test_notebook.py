"""``examples/tune_chunk_size.ipynb`` runs top to bottom on this machine (a quick profile of SmolLM2-135M, a
simulated sweep and capacity search, one short real ``bench`` run), and ``examples/reproduce_sarathi_serve.ipynb``
(Sarathi-Serve's capacity comparison, simulated on the calibrated A100 model): any cell that raises fails the test."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "tune_chunk_size.ipynb"


def execute(path: Path, timeout: int = 600) -> list[dict]:
    """Run the notebook at ``path`` top to bottom in its own folder; asserts that no cell raised and returns
    every code cell's outputs."""
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    return outputs


def printed(outputs: list[dict]) -> str:
    """The text the cells printed."""
    return "".join(o.get("text", "") for o in outputs)


@pytest.mark.slow
def test_tune_chunk_size_notebook_runs_without_errors():
    assert "chosen chunk size" in printed(execute(NOTEBOOK))


REPRO = Path(__file__).resolve().parents[1] / "examples" / "reproduce_sarathi_serve.ipynb"


@pytest.mark.slow
def test_reproduce_sarathi_serve_notebook_runs_and_compares_with_the_paper(monkeypatch):
    monkeypatch.setenv("REPRO_REQUESTS", "24")  # CI checks that it runs; its capacities need the default scale
    monkeypatch.setenv("REPRO_PROBES", "3")
    text = printed(execute(REPRO, timeout=900))
    assert "Mistral-7B, 1xA100: sarathi / vllm here" in text and "Yi-34B, 2xA100 TP2: sarathi / vllm here" in text
