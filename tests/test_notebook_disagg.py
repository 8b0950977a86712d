"""``examples/colocate_or_disaggregate.ipynb`` runs top to bottom (simulations only, about ten seconds), by the
mechanism of ``test_notebook.py``: any cell that raises fails the test."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "colocate_or_disaggregate.ipynb"


@pytest.mark.slow
def test_colocate_or_disaggregate_notebook_runs_without_errors():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    text = "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))
    assert "goodput" in text and "transfer p50" in text
