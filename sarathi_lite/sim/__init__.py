"""The simulator: the real scheduler on a simulated clock, the profiler that fits a cost model to this machine,
and the replay of a real run's timeline.

Everything here but ``profiler`` is torch-free. The cost models themselves moved to ``sarathi_lite.costs`` (below
the engine); ``sarathi_lite.sim.cost_model``, ``sarathi_lite.sim.roofline`` and ``sarathi_lite.sim.simulator``
still re-export what they held.
"""

from sarathi_lite.sim.sweeps import sweep

__all__ = ["sweep"]
