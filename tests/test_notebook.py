"""``examples/tune_chunk_size.ipynb`` runs top to bottom on this machine (a quick profile of SmolLM2-135M, a
simulated sweep and capacity search, one short real ``bench`` run): any cell that raises fails the test."""

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
