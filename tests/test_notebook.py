"""``examples/tune_chunk_size.ipynb`` runs top to bottom on this machine (a quick profile of SmolLM2-135M, a
simulated sweep and capacity search, one short real ``bench`` run), and ``examples/reproduce_sarathi_serve.ipynb``
(Sarathi-Serve's capacity comparison, simulated on the calibrated A100 model): any cell that raises fails the test."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "tune_chunk_size.ipynb"


@pytest.mark.slow
def test_tune_chunk_size_notebook_runs_without_errors():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    assert any("chosen chunk size" in o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))


REPRO = Path(__file__).resolve().parents[1] / "examples" / "reproduce_sarathi_serve.ipynb"


@pytest.mark.slow
def test_reproduce_sarathi_serve_notebook_runs_and_compares_with_the_paper(monkeypatch):
    monkeypatch.setenv("REPRO_REQUESTS", "24")  # CI checks that it runs; its capacities need the default scale
    monkeypatch.setenv("REPRO_PROBES", "3")
    nb = nbformat.read(REPRO, as_version=4)
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(REPRO.parent)}}).execute()
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    text = "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))
    assert "Mistral-7B, 1xA100: sarathi / vllm here" in text and "Yi-34B, 2xA100 TP2: sarathi / vllm here" in text
