"""The simulator: the real scheduler on a simulated clock, its cost models (profiled, roofline), the profiler.

Everything here but ``profiler`` is torch-free.
"""
