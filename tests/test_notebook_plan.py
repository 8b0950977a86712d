"""``examples/plan_a_deployment.ipynb`` runs top to bottom (a small plan on the calibrated simulator under two SLO
pairs, the hybrid study's recorded map, a plan on this CPU's profile and its recorded real runs), by the mechanism
of ``test_notebook.py``: any cell that raises fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_notebook import execute, printed

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "plan_a_deployment.ipynb"


@pytest.mark.slow
def test_plan_a_deployment_notebook_runs_without_errors():
    outputs = execute(NOTEBOOK)
    text = printed(outputs)
    assert "goodput req/s/GPU" in text and "best colocated" in text and "best hybrid" in text
    assert "PH" in text  # the hybrid candidates are in the ranking
    assert "the real order agrees with the plan's: True" in text
    assert any(o.get("output_type") in ("display_data", "execute_result") and "image/png" in o.get("data", {})
               for o in outputs)  # the figure
