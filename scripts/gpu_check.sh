#!/usr/bin/env bash
# The prepared device check for a session lent a CUDA GPU (run through the device tool, in the repo root;
# docs/guides/gpu_check.md says how to prepare and carry what it needs, and how long it takes):
#   1. FlashInfer vs the torch reference: attention on random hybrid batches (bf16/fp16), fused ops, sampling;
#      and the CPU conformance tests against the carried wheel;
#   2. Hugging Face parity on CUDA (float32 exact; FlashInfer bf16 within bf16 rounding);
#   3. the offline benchmark on a Llama-3-8B-shaped random-weight model, ours vs HF static batches.
# Carried (ignored by git, named in the device call's `carry`): .whl/ with the wheels the device lacks
# (flashinfer-python, apache-tvm-ffi, nvidia-ml-py) and .flashinfer_aot/ from scripts/build_flashinfer_aot.sh: its
# modules are copied into the installed flashinfer's data/aot, so no kernel is compiled on the device.
set -uo pipefail
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2 nvidia-ml-py==13.615.71
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
export PYTHONUNBUFFERED=1 FLASHINFER_USE_CUDA_NORM=1  # the prebuilt CUDA norm, not the CuTe-DSL one
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
# the prebuilt modules link CUDA 13's runtime: install them only under a CUDA 13 torch (else FlashInfer compiles)
if [ -d .flashinfer_aot ] && python3 -c "import sys, torch; sys.exit(torch.version.cuda.split('.')[0] != '13')"; then
  AOT=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)")
  mkdir -p "$AOT" && cp -r .flashinfer_aot/. "$AOT"/
fi
python3 - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import torch, flashinfer
from sarathi_lite.kernels import _flashinfer as fi
names = ["page", "norm", "rope", "silu_and_mul", "sampling"] + [
    fi.batch_prefill_module(torch.device("cuda"), dtype, d, w) for dtype in (torch.bfloat16, torch.float16)
    for d in (64, 128) for w in (-1, 0)]
print("torch", torch.__version__, "cuda", torch.version.cuda, "flashinfer", flashinfer.__version__, "nvcc",
      fi.find_nvcc())
print("prebuilt:", ", ".join(n for n in names if fi.prebuilt(n)) or "none")
print("to compile:", ", ".join(n for n in names if not fi.prebuilt(n)) or "none")
EOF
timeout 240 python3 -m pytest -q -rs tests/test_kernels_flashinfer.py tests/test_kernels_flashinfer_conformance.py \
  tests/test_engine_parity.py -k "flashinfer or cuda" 2>&1 | tee "$OUT/pytest.log"
timeout 240 python3 benchmarks/offline_throughput.py --model benchmarks/models/llama3-8b-shape \
  --trace conversation --load-format dummy --num-requests 128 --max-prompt 4096 --max-output 128 \
  --chunk-size 512 --hf-batch 8 \
  --device cuda --dtype bfloat16 --out "$OUT/offline_llama3_8b_shape.json" 2>&1 | tail -20 | tee "$OUT/bench.log"
