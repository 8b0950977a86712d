"""Moved to ``sarathi_lite.costs.roofline`` (below the engine); re-exported here for code written before."""

from sarathi_lite.costs.roofline import (
    HARDWARE,
    MODEL_SHAPES,
    Hardware,
    RooflineCostModel,
    hardware,
    model_shape,
    roofline,
)

__all__ = ["HARDWARE", "MODEL_SHAPES", "Hardware", "RooflineCostModel", "hardware", "model_shape", "roofline"]
