"""What a device's memory leaves for the KV pool: shared by the engine (a real GPU's free memory) and the cost
models (a modelled one's). Torch-free."""

from __future__ import annotations


def device_kv_budget(free_memory: int, total_memory: int, utilization: float) -> int:
    """Bytes for the KV pool on a device with ``free_memory`` of ``total_memory`` bytes free once the weights
    are loaded: the rest after keeping ``1 - utilization`` of the device, at least 1 GiB, for activations."""
    return int(free_memory - max(total_memory * (1 - utilization), 1 << 30))
