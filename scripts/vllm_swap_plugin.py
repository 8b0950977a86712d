"""pytest plugin for scripts/vllm_own_tests.sh: vLLM's scheduler tests with sarathi-lite's ``SarathiScheduler`` in
place of vLLM's ``Scheduler`` and ``AsyncScheduler`` (``SARATHI_SWAP=1``; else vLLM's own classes), with no hub.
A CUDA wheel on a machine without a GPU resolves no platform, whose device type is empty (``VllmConfig`` then
fails to infer a device): it is named ``cpu``, as the harness names it (the scheduler needs no device)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.platforms import current_platform  # noqa: E402

if not current_platform.device_type:
    current_platform.device_type = "cpu"
if os.environ.get("SARATHI_SWAP") == "1":
    import vllm.v1.core.sched.async_scheduler as async_scheduler
    import vllm.v1.core.sched.scheduler as scheduler

    from sarathi_lite.integrations.vllm.scheduler import SarathiScheduler

    scheduler.Scheduler = SarathiScheduler
    async_scheduler.AsyncScheduler = SarathiScheduler
