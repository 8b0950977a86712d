"""examples/embed_scheduler.py, an engine loop around the decision, runs on the standard library and the scheduler
package alone: an isolated interpreter (no site-packages, no environment) with only ``sarathi_lite`` and its
``scheduler`` copied in, as a fresh clone's install would lay them out."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_embedding_example_runs_with_only_the_standard_library_and_the_scheduler(tmp_path):
    package = tmp_path / "site" / "sarathi_lite"
    package.mkdir(parents=True)
    shutil.copy(ROOT / "sarathi_lite" / "__init__.py", package / "__init__.py")
    shutil.copytree(ROOT / "scheduler" / "src", package / "scheduler", ignore=shutil.ignore_patterns("__pycache__"))
    code = (f"import sys, runpy; sys.path.insert(0, {str(tmp_path / 'site')!r}); "
            f"runpy.run_path({str(ROOT / 'examples' / 'embed_scheduler.py')!r}, run_name='__main__'); "
            "loaded = sorted(m.split('.')[0] for m in sys.modules); "
            "assert not {'numpy', 'torch'} & set(loaded), loaded")
    run = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=120,
                         env={}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    steps = [dict(re.findall(r"(\w+):(\d+)", line.partition("|")[2])) for line in lines if line.startswith("step")]
    # every short prompt (24 tokens, arriving at steps 2, 5, 8 while the 600-token prompt prefills) gets its whole
    # prompt in the step it arrives; the long prompt gets tokens beside it or is held out of that one step
    for i, arrival in enumerate((2, 5, 8)):
        assert steps[arrival].get(f"short{i}") == "24", lines
        assert int(steps[arrival].get("long", 0)) > 0 or "held ['long']" in lines[arrival], lines
    assert lines[-1] == f"done in {len(steps)} steps; free blocks 64/64"
