#!/usr/bin/env bash
# The prepared device check for a session lent a CUDA GPU (run through the device tool, in the repo root):
#   1. FlashInfer vs the torch reference: attention on random hybrid batches (bf16/fp16), fused ops, sampling;
#   2. Hugging Face parity on CUDA (float32 exact; FlashInfer bf16 within bf16 rounding);
#   3. the offline benchmark on a Llama-3-8B-shaped random-weight model, ours vs HF static batches.
# Wheels that the device lacks travel in .whl/ (ignored by git): flashinfer_python 0.6.13 and apache_tvm_ffi,
# fetched here with `pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl NAME==VER`;
# ../shared does not travel, so copy the trace there too: cp ../shared/traces/splitwise_conv.csv .whl/
set -uo pipefail
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)"
timeout 420 python3 -m pytest -q -rs tests/test_kernels_flashinfer.py tests/test_engine_parity.py -k \
  "flashinfer or cuda" 2>&1 | tee "$OUT/pytest.log"
timeout 300 python3 benchmarks/offline_throughput.py --model benchmarks/models/llama3-8b-shape \
  --trace .whl/splitwise_conv.csv --load-format dummy --num-requests 128 --max-prompt 4096 --max-output 128 \
  --chunk-size 512 --hf-batch 8 \
  --device cuda --dtype bfloat16 --out "$OUT/offline_llama3_8b_shape.json" 2>&1 | tail -20 | tee "$OUT/bench.log"
