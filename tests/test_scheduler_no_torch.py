"""The scheduler is importable alone: a serving framework or a simulator must not pay for torch."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_scheduler_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import sarathi_lite.scheduler\n"
        "from sarathi_lite.scheduler import make_scheduler, SchedulerConfig, Request\n"
        "sched = make_scheduler(SchedulerConfig())\n"
        "sched.add(Request('r', [1, 2, 3], 2))\n"
        "while sched.has_unfinished():\n"
        "    out = sched.schedule()\n"
        "    sched.update(out, {s.request_id: 0 for s in out.scheduled if s.sample})\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
