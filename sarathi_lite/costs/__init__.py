"""Step-time cost models: how long one iteration takes, predicted from its ``SchedulerOutput`` alone.

Below the engine (which asks one for ``chunk_size="auto"``) and the simulator (which runs on one); torch-free.

- ``base``: the ``CostModel`` interface and ``StepTiming``;
- ``profiled``: ``ProfiledCostModel``, fitted to one machine's model runner (``sarathi-lite profile``);
- ``roofline``: ``RooflineCostModel``, a model's shape on a GPU's data-sheet figures;
- ``memory``: ``device_kv_budget``, what a device's memory leaves for the KV pool;
- ``pipeline``: ``PipelineCostModel``, any cost model on P pipeline stages, and ``stage_timing``, a micro-batch's
  time on each stage;
- ``spec``: ``load_cost_model(spec)``, from ``roofline:HW[:MODEL]`` or a profile JSON path.
"""

from sarathi_lite.costs.base import CostModel, StepTiming
from sarathi_lite.costs.memory import device_kv_budget
from sarathi_lite.costs.pipeline import PipelineCostModel, head_layer_units
from sarathi_lite.costs.profiled import TERMS, ProfiledCostModel, batch_terms
from sarathi_lite.costs.roofline import HARDWARE, MODEL_SHAPES, Hardware, RooflineCostModel, roofline
from sarathi_lite.costs.spec import load_cost_model

__all__ = ["HARDWARE", "MODEL_SHAPES", "TERMS", "CostModel", "Hardware", "PipelineCostModel", "ProfiledCostModel",
           "RooflineCostModel", "StepTiming", "batch_terms", "device_kv_budget", "head_layer_units", "load_cost_model",
           "roofline"]
