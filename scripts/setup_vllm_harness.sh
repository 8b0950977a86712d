#!/usr/bin/env bash
# Installs vLLM releases that have no CPU build (0.33.0 and 0.34.0 by default; name others as arguments) into a
# virtual environment each, .venv-vllm-X.Y/ (override the prefix with VLLM_HARNESS_PREFIX), for the model-free
# contract harness (sarathi_lite.integrations.vllm.harness, tests/vllm_harness/): vLLM's own scheduler code run on
# the CPU with no model, beside the CPU build of torch.
# Why not `pip install vllm`: the CUDA wheel pins a CUDA torch (several GB) and dozens of GPU packages that the
# scheduler never imports. So the wheel is installed --no-deps (downloaded once into .whl/), next to torch's CPU
# build, with only the Python packages that `import` of vLLM's scheduler, configuration and model registry need,
# each at the version the wheel's own metadata asks for. 0.32 is the CPU build of scripts/setup_vllm.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PREFIX=${VLLM_HARNESS_PREFIX:-.venv-vllm-}
RELEASES=("$@")
[ ${#RELEASES[@]} -gt 0 ] || RELEASES=(0.33.0 0.34.0)
TORCH=${TORCH_SPEC:-torch==2.13.0}  # the CPU build on this machine (pip's find-links); any torch the scheduler imports
# what vLLM's scheduler, config and model registry import (found by importing them and building the harness's
# schedulers), named as on PyPI
NEEDS=(packaging pydantic regex numpy psutil pyzmq urllib3 transformers aiohttp requests msgspec cloudpickle pillow
       pybase64 cachetools uvloop py-cpuinfo cbor2 prometheus_client llguidance xgrammar einops safetensors tqdm
       blake3 huggingface_hub tokenizers sentencepiece protobuf pyyaml oss-harmony openai fastapi partial-json-parser)
mkdir -p .whl
for release in "${RELEASES[@]}"; do
  venv="$PREFIX${release%.*}"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q)
  "$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "$TORCH"
  wheel=$(ls .whl/vllm-"$release"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    "$venv/bin/python" -m pip download -q --no-deps -d .whl "vllm==$release"
    wheel=$(ls .whl/vllm-"$release"-*.whl | head -1)
  fi
  # each needed package with the wheel's own version constraint (Requires-Dist), so the harness runs what that
  # release's users run
  specs=$("$venv/bin/python" - "$wheel" "${NEEDS[@]}" <<'EOF'
import re, sys, zipfile
wheel, needs = sys.argv[1], sys.argv[2:]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
pins = {}
for line in lines:
    if line.startswith("Requires-Dist:") and "extra ==" not in line:
        req = line.split(":", 1)[1].split(";")[0].strip()
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        if norm(name) not in pins:  # the first of a platform split (x86_64 comes first)
            pins[norm(name)] = re.sub(r"\[.*?\]", "", req)
print(" ".join(pins.get(norm(n), n) for n in needs))
EOF
)
  # shellcheck disable=SC2086  # one word per requirement
  "${pip[@]}" $specs pytest
  "${pip[@]}" --no-deps "$wheel"
  "${pip[@]}" --no-deps -e .
  "$venv/bin/python" - <<'EOF'
import tempfile
from pathlib import Path

import vllm

from sarathi_lite.integrations.vllm.harness import Harness, tiny_model

model = tiny_model(Path(tempfile.mkdtemp()))
Harness(model, scheduler="plugin", async_scheduling=True)
print("the harness runs on vLLM", vllm.__version__)
EOF
done
