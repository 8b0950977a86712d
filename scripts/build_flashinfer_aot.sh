#!/usr/bin/env bash
# Compiles, ahead of time and without a GPU, the FlashInfer modules the GPU check and benchmarks load, for
# Hopper (sm_90a), into .flashinfer_aot/<name>/<name>.so (ignored by git). scripts/gpu_check.sh copies that folder
# into the installed package's data/aot, where FlashInfer loads a module instead of compiling it (JitSpec.is_aot).
#
#   bash scripts/build_flashinfer_aot.sh [OUT_DIR]      # default OUT_DIR: .flashinfer_aot
#
# Needs: flashinfer-python 0.6.13 and apache-tvm-ffi in the active Python (scripts/setup.sh installs both), nvcc
# (CUDA 13.0, the device's), a C++ compiler, ninja and unzip. No GPU and no CUDA build of torch: the final link only needs the
# toolkit's lib64 (libcudart) and a stub libcuda.so (an empty library with soname libcuda.so.1, made here; the
# device's driver provides the real one). Modules are built one at a time, most needed first, at the lowest CPU
# priority (the machine is shared), each with MAX_JOBS parallel nvcc jobs (default 1; a module's kernels are up to
# ten files); a module already in OUT_DIR is kept, so an interrupted build resumes. Each
# module is loaded once built (tvm_ffi, as FlashInfer does; no GPU needed). Prints each module's build time and
# size and the total.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=$(realpath -m "${1:-.flashinfer_aot}")
BUILD_DIR=$(realpath -m build/flashinfer_aot)  # FlashInfer's workspace: generated sources, objects, ninja files
if [ -z "${CUDA_HOME:-}" ]; then
  # nvcc may be a wrapper script on PATH; ask it where its toolkit lives
  CUDA_HOME=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  CUDA_HOME=$(realpath "$CUDA_HOME")
fi
[ -e "$CUDA_HOME/lib64/libcudart.so" ] || { echo "no libcudart.so under CUDA_HOME=$CUDA_HOME/lib64" >&2; exit 1; }
mkdir -p "$BUILD_DIR/stubs" "$OUT_DIR"
if [ ! -e "$BUILD_DIR/stubs/libcuda.so" ]; then
  printf '' | ${CC:-cc} -shared -x c - -o "$BUILD_DIR/stubs/libcuda.so" -Wl,-soname,libcuda.so.1
fi
# norm includes cuBLASLt's and cuRAND's headers, which an nvcc-only toolkit lacks: take them from those libraries'
# wheels (headers only; nothing links against them)
INC="$BUILD_DIR/include"
for req in nvidia-cublas==13.1.1.3:cublasLt.h nvidia-curand==10.4.0.35:curand_kernel.h; do
  header=${req#*:} pkg=${req%:*}
  if [ ! -e "$CUDA_HOME/include/$header" ] && [ ! -e "$INC/$header" ]; then
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$BUILD_DIR/wheels" "$pkg"
    wheel=$(ls "$BUILD_DIR"/wheels/"$(echo "${pkg%==*}" | tr - _)"-"${pkg#*==}"-*.whl)
    unzip -q -j -o "$wheel" 'nvidia/cu13/include/*' -d "$INC"
  fi
done
export CUDA_HOME
export FLASHINFER_CUDA_ARCH_LIST="9.0a" FLASHINFER_WORKSPACE_BASE="$BUILD_DIR" MAX_JOBS=${MAX_JOBS:-1} FLASHINFER_NVCC_THREADS=1
export FLASHINFER_EXTRA_LDFLAGS="-L$BUILD_DIR/stubs" FLASHINFER_EXTRA_CUDAFLAGS="-isystem $INC"
export FLASHINFER_EXTRA_CFLAGS="-isystem $INC"
export AOT_OUT_DIR="$OUT_DIR" PATH="$CUDA_HOME/bin:$PATH"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # to load each module once built
nice -n 19 "$PY" - <<'EOF'
import os
import shutil
import time
from pathlib import Path

import flashinfer
import torch
import tvm_ffi
from flashinfer.jit import build_jit_specs
from flashinfer.jit.activation import gen_act_and_mul_module
from flashinfer.jit.attention import gen_batch_prefill_module
from flashinfer.jit.norm import gen_norm_module
from flashinfer.jit.page import gen_page_module
from flashinfer.jit.rope import gen_rope_module
from flashinfer.jit.sampling import gen_sampling_module

out_dir = Path(os.environ["AOT_OUT_DIR"])


def prefill(backend, dtype, head_dim, window):
    # the arguments BatchPrefillWithPagedKVCacheWrapper.plan() passes for FlashInferAttention's plan: q, kv and o
    # in one dtype, int32 indices, no positional encoding in the kernel, no logits cap, no fp16 qk reduction
    return gen_batch_prefill_module(backend, dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, window,
                                    False, False)


bf16, fp16 = torch.bfloat16, torch.float16
specs = [gen_page_module(), gen_norm_module(), gen_rope_module(), gen_act_and_mul_module("silu"),
         gen_sampling_module(),
         # fa3 is what "auto" picks on Hopper for these arguments; the GPU check's shapes first
         prefill("fa3", bf16, 64, False), prefill("fa3", bf16, 128, False), prefill("fa3", bf16, 64, True),
         prefill("fa3", fp16, 64, False), prefill("fa3", fp16, 64, True),
         prefill("fa3", bf16, 128, True), prefill("fa3", fp16, 128, False), prefill("fa3", fp16, 128, True)]
specs += [prefill("fa2", dtype, head_dim, window) for dtype in (bf16, fp16) for head_dim in (64, 128)
          for window in (False, True)]

print(f"flashinfer {flashinfer.__version__}, arch {os.environ['FLASHINFER_CUDA_ARCH_LIST']}, "
      f"{len(specs)} modules -> {out_dir}", flush=True)
total = 0
for spec in specs:
    dst = out_dir / spec.name / f"{spec.name}.so"
    start = time.monotonic()
    if not dst.exists():
        build_jit_specs([spec], verbose=False, skip_prebuilt=False)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, dst)
        status = f"built in {time.monotonic() - start:6.0f} s"
    else:
        status = "already built   "
    tvm_ffi.load_module(str(dst))  # it loads (no GPU needed) with every symbol but the driver's resolved
    size = dst.stat().st_size
    total += size
    print(f"{size / 2**20:7.2f} MiB  {status}  {spec.name}", flush=True)
print(f"{total / 2**20:7.2f} MiB  total in {out_dir}")
EOF
