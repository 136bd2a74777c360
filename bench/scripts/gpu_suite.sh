#!/usr/bin/env bash
# The H200 verification run, in two phases so each fits one device call:
#   bench/scripts/gpu_suite.sh test  OUT   build the GPU targets, the GPU test suite, compute-sanitizer
#                                  memcheck / racecheck / synccheck on the device-planned paths
#   bench/scripts/gpu_suite.sh bench OUT   the GPU benchmarks (device planner, decode loop, staging fills)
#   bench/scripts/gpu_suite.sh lookahead OUT  the decode benchmark's lookahead rows (batch 1, batch 16, and the
#                                  real traces with TRACE_DIR), the device rows on both storages
#   bench/scripts/gpu_suite.sh python OUT  the PyTorch extension (build + its tests) and the transformers Mixtral
#                                  served through it (examples/torch, --check for both providers)
# GPU_TESTS="tests/test_gpu_x ..." restricts the test phase to those targets (and skips the sanitizers).
# Logs and JSON go to OUT (default ./gpu-logs). Build folder: build-gpu (kept between phases).
# Needs nvcc and a GPU; doctest and Google Benchmark from the system or a staged copy on
# PKG_CONFIG_PATH. Exit status: non-zero when a test, a sanitizer or a benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-test}
out=${2:-gpu-logs}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
meson() { if command -v meson >/dev/null 2>&1; then command meson "$@"; else python3 -m mesonbuild.mesonmain "$@"; fi; }
build=build-gpu
status=0
note() { echo "== $*" | tee -a "$out/summary.txt"; }
git rev-parse --short HEAD > "$out/commit.txt" 2>/dev/null || true

gpu_tests=(tests/test_gpu_marlin_repack tests/test_gpu_cache_cuda tests/test_gpu_moe_consumer tests/test_gpu_moe_consumer_host tests/test_gpu_moe_grouped tests/test_gpu_device_plan
           tests/test_gpu_device_cache tests/test_gpu_storage_cuda tests/test_gpu_any_cache_cuda
           tests/test_gpu_parallel_cuda tests/test_gpu_wide_cuda tests/test_gpu_copy_engine tests/test_gpu_link_profile_cuda
           tests/any_cache_cuda_header_only examples/quickstart_cuda)
subset=${GPU_TESTS:-}
if [ -n "$subset" ]; then read -r -a gpu_tests <<< "$subset"; fi
gpu_benches=(bench/bench_device_plan bench/expert-cache-bench bench/bench_staging bench/bench_consumer_host)

if [ "$phase" != python ] && [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" -Dcuda=enabled -Dgpu_arch=sm_90 -Dtests=enabled -Dbenchmarks=enabled >"$out/setup.log" 2>&1 \
    || { note "configure failed"; tail -30 "$out/setup.log"; exit 1; }
fi

case "$phase" in
test)
  if ! meson compile -C "$build" "${gpu_tests[@]}" "${gpu_benches[@]}" >"$out/compile.log" 2>&1; then
    note "compile failed"; grep -E "error|FAILED" "$out/compile.log" | head -30; exit 1
  fi
  if [ -n "$subset" ]; then
    for t in "${gpu_tests[@]}"; do
      if "$build/$t" >"$out/$(basename "$t").log" 2>&1; then note "$t: OK ($(grep -E '^\[doctest\] (test cases|assertions)' "$out/$(basename "$t").log" | tr '\n' ' '))"
      else note "$t: FAILED"; tail -40 "$out/$(basename "$t").log"; status=1; fi
    done
    note "phase $phase (subset): status $status"; exit $status
  fi
  meson test -C "$build" --no-rebuild --suite gpu --print-errorlogs >"$out/gpu_tests.log" 2>&1 || status=1
  grep -E "^ *[0-9]+/[0-9]+ |^Ok:|^Fail:|^Skipped:" "$out/gpu_tests.log" | tee -a "$out/summary.txt"
  # The device-planned paths under compute-sanitizer, with shortened runs (the tools are slow).
  # The edge tests' negative halves (a launch without its ordering edge must race) are left out here:
  # the tools serialise kernels, so the race they provoke cannot happen under them.
  export EXPERT_CACHE_DPLAN_STEPS=20 EXPERT_CACHE_DPLAN_REPLAYS=40 EXPERT_CACHE_DCACHE_STEPS=12
  for tool in memcheck racecheck synccheck; do
    for t in test_gpu_device_plan test_gpu_device_cache; do
      if compute-sanitizer --tool "$tool" --error-exitcode 9 "$build/tests/$t" --test-case-exclude='*(edge D6)*' \
          >"$out/sanitize_${tool}_$t.log" 2>&1; then
        note "compute-sanitizer $tool $t: clean ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_${tool}_$t.log" | tail -1))"
      else
        note "compute-sanitizer $tool $t: FAILED"; tail -20 "$out/sanitize_${tool}_$t.log"; status=1
      fi
    done
    # The consumer that copies its misses (fill_by_consumer + run_one_pass): its own case only
    # (the slowed-fill cases spin for hundreds of microseconds per step, far too slow under the tools).
    t=test_gpu_moe_consumer
    if compute-sanitizer --tool "$tool" --error-exitcode 9 "$build/tests/$t" --test-case='*fill_by_consumer*' \
        >"$out/sanitize_${tool}_$t.log" 2>&1; then
      note "compute-sanitizer $tool $t (fill_by_consumer): clean ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_${tool}_$t.log" | tail -1))"
    else
      note "compute-sanitizer $tool $t (fill_by_consumer): FAILED"; tail -20 "$out/sanitize_${tool}_$t.log"; status=1
    fi
  done
  ;;
bench)
  "$build/bench/bench_device_plan" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
    --benchmark_counters_tabular=true --benchmark_out="$out/bench_device_plan.json" --benchmark_out_format=json \
    >"$out/bench_device_plan.txt" 2>&1 || { note "bench_device_plan failed"; status=1; }
  "$build/bench/expert-cache-bench" --provider all --staging all --overlap --json "$out/decode.json" \
    >"$out/decode.txt" 2>&1 || { note "expert-cache-bench failed"; status=1; }
  cat "$out/decode.txt"
  # Lookahead (docs/prefetch.md): the host-planned cached provider with copy-stream fills and each predictor.
  "$build/bench/expert-cache-bench" --provider resident,cached --staging copy_stream --prefetch coact,hint:0.8 \
    --json "$out/decode_prefetch.json" >"$out/decode_prefetch.txt" 2>&1 || { note "expert-cache-bench --prefetch failed"; status=1; }
  tail -16 "$out/decode_prefetch.txt"
  "$build/bench/bench_staging" --benchmark_filter='fill/' --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_counters_tabular=true --benchmark_out="$out/bench_staging.json" --benchmark_out_format=json \
    >"$out/bench_staging.txt" 2>&1 || { note "bench_staging failed"; status=1; }
  # Compute from host: fill-then-consume against the one-pass consumer, per layer of a 48-layer graph.
  "$build/bench/bench_consumer_host" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_counters_tabular=true --benchmark_out="$out/bench_consumer_host.json" --benchmark_out_format=json \
    >"$out/bench_consumer_host.txt" 2>&1 || { note "bench_consumer_host failed"; status=1; }
  grep -E "_median" "$out/bench_device_plan.txt" "$out/bench_staging.txt" "$out/bench_consumer_host.txt" | head -100
  ;;
lookahead)
  # The lookahead rows of docs/benchmarks.md ("With the listed-resident rule, after the router", "Where the
  # proxy's host time goes"): batch 1, batch 16 and, with TRACE_DIR (a folder holding the public
  # qwen3-30b-a3b-top6-decode.trace and granite-1b-a400m-decode.trace routing traces), the Qwen3 trace at 32
  # slots and the Granite trace at 8; the device rows once per storage (--device-storage).
  meson compile -C "$build" bench/expert-cache-bench >"$out/compile.log" 2>&1 || { note "compile failed"; exit 1; }
  common=(--staging copy_stream --overlap --fill-engine split --prefetch none,hint:0.9:recent:noise=0.3 --two-ahead 0.7
          --prefetch-at router --progress --provider resident,device,cached)
  rows() {  # name, then the invocation's own arguments
    local name=$1; shift
    if "$build/bench/expert-cache-bench" "${common[@]}" "$@" --json "$out/$name.json" >"$out/$name.txt" 2>&1; then
      note "$name: $(grep -cE 'done:' "$out/$name.txt") rows"
    else note "$name: FAILED"; tail -20 "$out/$name.txt"; status=1; fi
    grep -E "^(device|cached) .*(none|hint)|proxy served" "$out/$name.txt"
  }
  for storage in tensor_major expert_major; do
    rows "b1_$storage" --device-storage "$storage" --steps 16 --warmup 32
    rows "b16_$storage" --device-storage "$storage" --batch 16 --steps 8 --warmup 16
    if [ -n "${TRACE_DIR:-}" ]; then
      rows "qwen3_$storage" --device-storage "$storage" --trace "$TRACE_DIR/qwen3-30b-a3b-top6-decode.trace" --capacity 32 \
        --steps 16 --warmup 32
      rows "granite_$storage" --device-storage "$storage" --trace "$TRACE_DIR/granite-1b-a400m-decode.trace" --capacity 8 \
        --steps 16 --warmup 32
    fi
  done
  ;;
python)
  py_out="$out/python"; mkdir -p "$py_out"
  python/run_gpu_tests.sh "$py_out" 2>&1 | tail -60 | tee "$out/python_tests.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { note "python extension tests failed"; status=1; }
  if PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" python3 tests/gpu/test_torch_mixtral.py \
      >"$out/torch_mixtral_check.txt" 2>&1; then note "torch mixtral check: OK"
  else note "torch mixtral check: FAILED"; status=1; fi
  tail -40 "$out/torch_mixtral_check.txt"
  if [ "${MIXTRAL_BENCH:-1}" = 1 ]; then
    # The defaults (8 experts, top-2, 4 slots), then a harder routing (32 experts, top-4, 8 slots); every
    # provider, the prompt as one wide forward (TTFT) and decode tok/s.
    PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" python3 examples/torch/mixtral_offload.py --provider all \
      --json "$out/mixtral.json" >"$out/mixtral.txt" 2>&1 || { note "mixtral_offload --provider all failed"; status=1; }
    tail -16 "$out/mixtral.txt"
    PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" python3 examples/torch/mixtral_offload.py --provider row,cached,device \
      --experts 32 --top-k 4 --capacity 8 --json "$out/mixtral_e32.json" >"$out/mixtral_e32.txt" 2>&1 \
      || { note "mixtral_offload --experts 32 failed"; status=1; }
    tail -16 "$out/mixtral_e32.txt"
  fi
  ;;
*) echo "usage: bench/scripts/gpu_suite.sh test|bench|lookahead|python [OUT]"; exit 2 ;;
esac
note "phase $phase: status $status"
exit $status
