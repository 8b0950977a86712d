"""The checkout's top-level folders never shadow other packages: from the repository's root (where ``python3 -m``,
pytest and a notebook put the root first on ``sys.path``), ``import kernels`` and ``import scheduler`` find the
installed packages of those names, not ours, while ``sarathi_lite.kernels`` and ``sarathi_lite.scheduler`` still
resolve to our code. Hugging Face transformers imports a package named ``kernels`` whenever one is installed, so
a shadowing ``kernels/__init__.py`` at the root broke every model load (``cannot import name 'CUDAProperties'``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for Hugging Face's ``kernels`` (0.19.x, the range transformers 5.25 accepts): every name transformers
# imports from it is a pass-through (decorators return what they decorate), plus a marker our package lacks.
STAND_IN_KERNELS = '''
STAND_IN = "kernels"


class _PassThrough:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _PassThrough()

    def __getattr__(self, name):
        return _PassThrough()


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _PassThrough()
'''

CHECK = '''
import sys
import kernels, scheduler
assert kernels.STAND_IN == "kernels", kernels
assert scheduler.STAND_IN == "scheduler", scheduler
import transformers.activations  # imports the installed `kernels` (transformers' hub-kernels integration)
import sarathi_lite.kernels, sarathi_lite.scheduler
assert sarathi_lite.kernels.rms_norm and sarathi_lite.scheduler.make_scheduler
from sarathi_lite import LLM, SamplingParams
llm = LLM(sys.argv[1], chunk_size=16, block_size=4, num_kv_blocks=64, device="cpu")
out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4))[0]
assert len(out.token_ids) == 4, out.token_ids
print("ok", kernels.__file__, scheduler.__file__)
'''


def _stand_ins(site: Path) -> None:
    """Top-level ``kernels`` and ``scheduler`` packages with dist-info, as pip would install them."""
    for name, source, version in (("kernels", STAND_IN_KERNELS, "0.19.1"),
                                  ("scheduler", 'STAND_IN = "scheduler"\n', "0.8.8")):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(source)
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_root_folders_do_not_shadow_installed_kernels_or_scheduler(tmp_path, tiny_checkpoints):
    site = tmp_path / "site"
    _stand_ins(site)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    # `python3 -c` from the root puts the root (as '') first on sys.path, before PYTHONPATH and site-packages
    result = subprocess.run([sys.executable, "-c", CHECK, str(tiny_checkpoints["llama"])], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.startswith("ok"), result.stdout
    assert str(site) in result.stdout, result.stdout


def test_top_level_folders_are_not_packages():
    """The installed names come from setup.py's package_dir (``kernels/src``, ``scheduler/src``); the folders
    themselves hold no ``__init__.py``, so from the root they are at most empty namespace portions."""
    for folder in ("kernels", "scheduler"):
        assert not (ROOT / folder / "__init__.py").exists(), folder
        assert (ROOT / folder / "src" / "__init__.py").is_file(), folder
