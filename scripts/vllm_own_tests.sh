#!/usr/bin/env bash
# vLLM's own scheduler tests (tests/v1/core/test_scheduler.py and test_async_scheduler.py of a release's source)
# run twice in that release's environment: with vLLM's Scheduler/AsyncScheduler, then with sarathi-lite's
# SarathiScheduler in their place (scripts/vllm_swap_plugin.py). Not part of the test command (minutes per run).
#   bash scripts/vllm_own_tests.sh 0.34.0      # the environment: .venv-vllm-0.34/ (.venv-vllm/ for 0.32.0)
#   for r in 0.32.0 0.33.0 0.34.0; do bash scripts/vllm_own_tests.sh $r; done   # every supported release
# VLLM_VENV (0.32) and VLLM_HARNESS_PREFIX (others, default .venv-vllm-) name the environments as
# tests/test_vllm_harness.py takes them; VLLM_OWN_TESTS_SWAPS=1 runs only the plugin's half. The pass counts and
# every test that fails only with the plugin, with why: docs/guides/vllm_plugin.md.
# The tests come from the release's source distribution. pip is the client: `pip download` of an sdist unpacks
# it and then tries to build its metadata (which vLLM's needs CUDA for), so it fails; --no-clean keeps the
# unpacked tree, which is all this needs. The tests' model, facebook/opt-125m, is replaced by a local folder (no
# hub): a tiny Llama's config.json with OPT's vocabulary size and end-of-sequence id, and SmolLM2's tokenizer files
# (the tests build a tokenizer); conftest.py files are not loaded (--noconftest: vLLM's root one needs its whole
# test stack).
set -uo pipefail
cd "$(dirname "$0")/.."
release=${1:?name a release, e.g. 0.34.0}
short=${release%.*}
venv=$([ "$short" = 0.32 ] && echo "${VLLM_VENV:-.venv-vllm}" || echo "${VLLM_HARNESS_PREFIX:-.venv-vllm-}$short")
venv=$(cd "$venv" && pwd)  # absolute: the tests run from the work folder
work=${VLLM_OWN_TESTS_DIR:-.whl/vllm-tests-$release}
if [ ! -f "$work/tests/v1/core/test_scheduler.py" ]; then
  before=$(ls -d "${TMPDIR:-/tmp}"/pip-download-* 2>/dev/null)
  "$venv/bin/python" -m pip download -q --no-clean --no-deps --no-binary :all: --no-build-isolation \
    -d .whl "vllm==$release" >/dev/null 2>&1
  src=$(comm -13 <(echo "$before") <(ls -d "${TMPDIR:-/tmp}"/pip-download-* 2>/dev/null) | tail -1)
  tree=$(ls -d "$src"/vllm_* | head -1)
  mkdir -p "$work" && cp -r "$tree/tests" "$work/" && rm -rf "$src"
fi
mkdir -p "$work/tinymodel"
"$venv/bin/python" - "$work" <<'PY'
import json, pathlib, sys
import shutil
from sarathi_lite.integrations.vllm.harness import TINY_LLAMA
from sarathi_lite.models import builtin
work = pathlib.Path(sys.argv[1])
for tokenizer_file in builtin.resolve_model("smollm2-135m").glob("tokenizer*"):
    shutil.copy(tokenizer_file, work / "tinymodel")
# OPT-125m's vocabulary and end-of-sequence id, which the tests' token ids assume
(work / "tinymodel" / "config.json").write_text(json.dumps(dict(TINY_LLAMA, vocab_size=50272, eos_token_id=50256)))
for name in ("utils.py", "test_scheduler.py", "test_async_scheduler.py"):
    path = work / "tests" / "v1" / "core" / name
    path.write_text(path.read_text().replace('"facebook/opt-125m"', json.dumps(str((work / "tinymodel").resolve()))))
PY
cp scripts/vllm_swap_plugin.py "$work/"
for swap in ${VLLM_OWN_TESTS_SWAPS:-0 1}; do  # 1 alone: only the plugin run
  echo "== vLLM $release, $([ $swap = 1 ] && echo "SarathiScheduler in place of vLLM's" || echo "vLLM's own scheduler")"
  (cd "$work" && SARATHI_SWAP=$swap "$venv/bin/python" -m pytest -q -rf --noconftest -p vllm_swap_plugin \
     -p no:cacheprovider -W ignore tests/v1/core/test_scheduler.py tests/v1/core/test_async_scheduler.py | \
     grep -E "^FAILED|^ERROR|passed|failed")
done
