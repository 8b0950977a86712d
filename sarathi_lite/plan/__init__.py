"""Which organization for my workload? ``plan``: every deployment of a model on some GPUs that fits (colocated
replicas at each chunk size and ``auto``, every xPyD split and its conditional variant, tensor and pipeline
degrees), ranked by goodput per GPU under TTFT and P99 TBT SLOs on the calibrated simulator, each with the
``LLM(...)`` and ``sarathi-lite serve`` arguments that run it.

>>> from sarathi_lite.plan import Setup, plan
>>> from sarathi_lite.bench.workload import Workload
>>> wl = Workload.from_trace("conversation", num_requests=1500, qps=1.0, max_prompt=7000, max_output=1000)
>>> result = plan(Setup("llama3-8b", "h100", 4, ttft=1.0, tbt=0.05), wl)
>>> print(table(result, top=10)); plot(result, "plan.png")

- ``space``: the ``Setup``, the ``Candidate`` deployments and how to run each (``launch``);
- ``search``: the budgeted search (coarse, early stop, fine) on the sweep backends and the ranked ``Plan``;
- ``report``: the table, the commands and the figure.

Torch-free (the simulator's imports only); tqdm draws the progress bars, matplotlib the figure.
"""

from sarathi_lite.plan.report import commands, plot, table
from sarathi_lite.plan.search import Entry, Plan, Probe, plan, plan_slos, probe_workload
from sarathi_lite.plan.space import CHUNK_SIZES, Candidate, Setup, launch, space

__all__ = ["CHUNK_SIZES", "Candidate", "Entry", "Plan", "Probe", "Setup", "commands", "launch", "plan", "plan_slos",
           "plot", "probe_workload", "space", "table"]
