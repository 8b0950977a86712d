"""The serving benchmark: workloads and the built-in traces, real-time replay, results, capacity search, plots.

Everything here but ``replay`` is torch-free, so the simulator shares it.
"""
