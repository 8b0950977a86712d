"""``examples/colocate_or_disaggregate.ipynb`` runs top to bottom (simulations only, about ten seconds), by the
mechanism of ``test_notebook.py``: any cell that raises fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_notebook import execute, printed

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "colocate_or_disaggregate.ipynb"


@pytest.mark.slow
def test_colocate_or_disaggregate_notebook_runs_without_errors():
    text = printed(execute(NOTEBOOK))
    assert "goodput" in text and "transfer p50" in text
