"""The simulator: the real scheduler on a simulated clock, the profiler that fits a cost model to this machine,
and the replay of a real run's timeline.

Everything here but ``profiler`` is torch-free. The cost models themselves live in ``sarathi_lite.costs`` (below
the engine).
"""

from sarathi_lite.sim.sweeps import sweep

__all__ = ["sweep"]
