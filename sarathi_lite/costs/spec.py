"""``load_cost_model(spec)``: a cost model from the text a user gives (``--cost-model``, ``cost_model=``)."""

from __future__ import annotations

from pathlib import Path

from sarathi_lite.costs.base import CostModel
from sarathi_lite.costs.calibrated import CALIBRATED_HARDWARE, calibrated
from sarathi_lite.costs.profiled import ProfiledCostModel
from sarathi_lite.costs.roofline import roofline

ROOFLINE_PREFIX = "roofline:"
UNCALIBRATED_PREFIX = "roofline-uncalibrated:"


def load_cost_model(spec: str | Path) -> CostModel:
    """A cost model from ``spec``: a profile JSON file (``sarathi-lite profile``), ``roofline:HW[:MODEL]`` or
    ``roofline-uncalibrated:HW[:MODEL]``, with a hardware preset (``a100-80gb``, ``h100``, ``h200``; ``4xh100``
    for tensor parallelism over 4 of them) and a model shape preset (``llama3-8b``, the default; ``llama3.1-8b``,
    128k context; ``llama3-70b``, ``mistral-7b``, ``yi-34b``, ``smollm2-135m``) or a Hugging Face config.json /
    checkpoint folder.

    ``roofline:`` is calibrated on measured GPU timings (``CalibratedCostModel``) where they exist (``a100-80gb``,
    ``h100``), else (``h200``) the analytic formula; ``roofline-uncalibrated:`` is always the analytic formula
    (``RooflineCostModel``: 0.7 of peak FLOP/s, 0.85 of peak bandwidth, 10 us per collective)."""
    text = str(spec)
    if text.startswith(UNCALIBRATED_PREFIX):
        hw, _, model = text[len(UNCALIBRATED_PREFIX):].partition(":")
        return roofline(hw, model or "llama3-8b")
    if text.startswith(ROOFLINE_PREFIX):
        hw, _, model = text[len(ROOFLINE_PREFIX):].partition(":")
        count, x, preset = hw.partition("x")
        if (preset if x and count.isdigit() else hw).lower() in CALIBRATED_HARDWARE:
            return calibrated(hw, model or "llama3-8b")
        return roofline(hw, model or "llama3-8b")
    if ":" not in text or text.endswith(".json") or Path(text).exists():
        if not Path(text).is_file():
            raise ValueError(f"cost model file {text!r} not found (make one with sarathi-lite profile --out "
                             f"{text}, or give roofline:HW[:MODEL])")
        return ProfiledCostModel.load(text)
    raise ValueError(f"cost model {text!r} is neither a profile JSON file nor roofline:HW[:MODEL] / "
                     f"roofline-uncalibrated:HW[:MODEL]")
