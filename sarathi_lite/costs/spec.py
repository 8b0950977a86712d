"""``load_cost_model(spec)``: a cost model from the text a user gives (``--cost-model``, ``cost_model=``)."""

from __future__ import annotations

from pathlib import Path

from sarathi_lite.costs.base import CostModel
from sarathi_lite.costs.profiled import ProfiledCostModel
from sarathi_lite.costs.roofline import roofline

ROOFLINE_PREFIX = "roofline:"


def load_cost_model(spec: str | Path) -> CostModel:
    """A cost model from ``spec``: a profile JSON file (``sarathi-lite profile``), or ``roofline:HW[:MODEL]``
    with a hardware preset (``a100-80gb``, ``h100``, ``h200``; ``4xh100`` for tensor parallelism over 4 of them)
    and a model shape preset (``llama3-8b``, the default; ``llama3.1-8b``, 128k context; ``llama3-70b``,
    ``mistral-7b``, ``smollm2-135m``) or a Hugging Face config.json / checkpoint folder."""
    text = str(spec)
    if text.startswith(ROOFLINE_PREFIX):
        hw, _, model = text[len(ROOFLINE_PREFIX):].partition(":")
        return roofline(hw, model or "llama3-8b")
    if not Path(text).is_file():
        raise ValueError(f"cost model {text!r} is neither a profile JSON file nor roofline:HW[:MODEL]")
    return ProfiledCostModel.load(text)
