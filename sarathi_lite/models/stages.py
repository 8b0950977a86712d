"""Pipeline stages: which contiguous layers each stage of a pipeline-parallel deployment holds. Torch-free, so
the simulator's cost models and the engine split a model the same way."""

from __future__ import annotations


def check_pipeline_parallel(num_layers: int, size: int) -> None:
    """Raise ``ValueError`` naming the numbers when ``num_layers`` cannot be split over ``size`` stages."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"pipeline_parallel_size={size!r} must be a positive integer")
    if size > num_layers:
        raise ValueError(f"pipeline_parallel_size={size} exceeds num_hidden_layers={num_layers}: every stage needs "
                         f"at least one layer")


def stage_layers(num_layers: int, size: int, stage: int) -> range:
    """The layers stage ``stage`` of ``size`` holds: ``num_layers // size`` each, the first ``num_layers % size``
    stages one more (the last stage also runs the LM head, so it gets no extra layer)."""
    check_pipeline_parallel(num_layers, size)
    if not 0 <= stage < size:
        raise ValueError(f"stage={stage!r} is not in [0, {size})")
    base, extra = divmod(num_layers, size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))
