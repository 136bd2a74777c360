#!/usr/bin/env bash
# Builds the PyTorch extension in place and runs its tests (python/tests/test_extension.py:
# the ExpertCache API; python/tests/test_vllm.py: the vLLM-surface providers, prefetch, the
# model-level cache, policies by name; python/tests/test_vllm_contract.py: vLLM's
# CachedWeightProvider contract call by call, through the compatibility views;
# python/tests/test_vllm_state.py: the views' bookkeeping, torch-free, also meson test vllm_state).
#
#   python/run_gpu_tests.sh OUT        # from the repository root; OUT receives the logs
#
# Needs python with torch (CUDA build), nvcc and a CUDA device. Logs: OUT/build_ext.log (the
# build), OUT/test_extension.log, OUT/test_vllm.log, OUT/test_vllm_contract.log and
# OUT/test_vllm_state.log (the tests). Prints a summary; exits 0 when everything passed,
# 77 when the tests skipped (no torch / no device), 1 otherwise.
set -u
OUT=${1:?usage: python/run_gpu_tests.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python}
command -v "$PY" > /dev/null || PY=python3

{
  echo "== environment"
  date -u
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)' 2>&1
  command -v nvcc && nvcc --version | tail -n 2
  g++ --version | head -n 1
} | tee "$OUT/environment.log"

if ! "$PY" -c 'import torch' > /dev/null 2>&1; then
  echo "SUMMARY: SKIPPED: $PY cannot import torch (needs a CUDA build of torch, nvcc and a GPU)"
  exit 77
fi

echo "== build (log: $OUT/build_ext.log)"
start=$(date +%s)
(cd "$HERE" && MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
   "$PY" setup.py build_ext --inplace) > "$OUT/build_ext.log" 2>&1
build_rc=$?
echo "build rc $build_rc in $(( $(date +%s) - start )) s"
if [ $build_rc -ne 0 ]; then
  echo "---- last 60 lines of build_ext.log"
  tail -n 60 "$OUT/build_ext.log"
  echo "SUMMARY: build FAILED (rc $build_rc)"
  exit 1
fi
ls -l "$HERE"/expert_cache_torch/_C*.so

# Each test file in its own process (its own CUDA context and registrations); the worst exit
# status wins (1 over 77 over 0).
test_rc=0
for t in test_extension test_vllm test_vllm_contract test_vllm_state; do
  echo "== $t (log: $OUT/$t.log)"
  (cd "$HERE" && "$PY" "tests/$t.py") > "$OUT/$t.log" 2>&1
  rc=$?
  grep -E "^(test_|FAIL|ERROR|SKIP|SUMMARY|torch )|Error|error:" "$OUT/$t.log" | head -n 80
  if [ $rc -ne 0 ] && [ $rc -ne 77 ]; then
    echo "---- last 60 lines of $t.log"
    tail -n 60 "$OUT/$t.log"
  fi
  if [ $rc -ne 0 ] && [ $rc -ne 77 ]; then test_rc=1
  elif [ $rc -eq 77 ] && [ $test_rc -eq 0 ]; then test_rc=77
  fi
done
case $test_rc in
  0) echo "SUMMARY: build ok, tests PASSED" ;;
  77) echo "SUMMARY: build ok, tests SKIPPED (no torch or no CUDA device)" ;;
  *) echo "SUMMARY: build ok, tests FAILED (rc $test_rc)"; test_rc=1 ;;
esac
exit $test_rc
