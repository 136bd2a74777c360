#!/usr/bin/env bash
# The README's test command: installs what is missing, then builds and runs every suite.
#  1. the main build (CUDA tier compiled when nvcc exists; GPU tests SKIP without a device),
#  2. the host suite again under AddressSanitizer + UndefinedBehaviorSanitizer,
#  3. a short libFuzzer smoke over the trace parser and the planner (clang).
# Ends with one line "N passed, N failed" summed over all of them.
set -uo pipefail
cd "$(dirname "$0")/.."
EXPERT_CACHE_WANT_CLANG=1 tests/deps.sh || { echo "dependency install failed"; echo "0 passed, 1 failed"; exit 1; }
export PATH="/usr/local/cuda/bin:$PATH"
# Meson from Debian, or the Python package where only that exists (some CUDA images ship Meson only as a Python package).
meson() { if command -v meson >/dev/null 2>&1; then command meson "$@"; else python3 -m mesonbuild.mesonmain "$@"; fi; }
cuda=disabled
command -v nvcc >/dev/null 2>&1 && cuda=enabled
# Without a GPU the CUDA tier is compiled for coverage only (its tests SKIP): device code as PTX
# for the same virtual architecture (compute_90, the default sm_90's; no SASS, so no ptxas
# code generation) and, where nvcc has it, with device optimisations reduced for compile speed
# (-Ofc=max). Every CUDA translation unit still goes through nvcc's front end and cicc, so what
# does not compile still fails here; the GPU recipe (docs/cuda_backend.md, bench/scripts/gpu_suite.sh)
# builds real sm_90 code at full optimisation.
# Both builds group the tests (-Dtest_programs=grouped, tests/meson.build): the short host tests
# are one program and the GPU tests another, each compiled as one translation unit
# (tests/unity.py), so the headers are parsed once per group instead of once per source; the
# cases are the same.
main_flags=(-Dtest_programs=grouped)
cuda_args=()
# (grep without -q in these pipelines: -q exits at the first match, the writer then dies of SIGPIPE
# and pipefail turns the match into a failure.)
if [ $cuda = enabled ] && ! { [ -e /dev/nvidia0 ] || nvidia-smi -L 2>/dev/null | grep '^GPU' >/dev/null; }; then
  main_flags+=(-Dgpu_arch=compute_90)
  nvcc --help 2>/dev/null | grep -- '--Ofast-compile' >/dev/null && cuda_args+=(-Ofc=max)
fi
# g++ (the main build's compiler, and nvcc's host compiler) collects garbage as its heap grows;
# starting that only past 2 GiB of heap saves 10-14% of the CPU of these template-heavy units
# for about 25% more peak memory (about 1.2 GB for the largest). Code and warnings are the same.
cpp_args=()
if "${CXX:-c++}" --version 2>/dev/null | grep 'Free Software Foundation' >/dev/null; then
  cpp_args=(--param=ggc-min-expand=100 --param=ggc-min-heapsize=2097152)
  cuda_args+=(-Xcompiler=--param=ggc-min-expand=100 -Xcompiler=--param=ggc-min-heapsize=2097152)
fi
[ ${#cpp_args[@]} -gt 0 ] && main_flags+=("-Dcpp_args=${cpp_args[*]}")
[ $cuda = enabled ] && [ ${#cuda_args[@]} -gt 0 ] && main_flags+=("-Dcuda_args=${cuda_args[*]}")

passed=0; failed=0
count() {  # adds one Meson summary (from its log) to the totals
  local log=$1 ok fail to up
  ok=$(grep -E '^Ok: ' "$log" | awk '{print $2}' | tail -1)
  # No summary at all: meson test itself failed (e.g. a test program was not built).
  if [ -z "$ok" ]; then echo "== no test summary in $log:"; tail -5 "$log"; failed=$((failed + 1)); return; fi
  fail=$(grep -E '^Fail: ' "$log" | awk '{print $2}' | tail -1)
  to=$(grep -E '^Timeout: ' "$log" | awk '{print $2}' | tail -1)
  up=$(grep -E '^Unexpected Pass: ' "$log" | awk '{print $3}' | tail -1)
  passed=$((passed + ${ok:-0})); failed=$((failed + ${fail:-0} + ${to:-0} + ${up:-0}))
}
step() {  # step NAME LOG CMD...: runs a build step; a failure counts as one failed test
  local name=$1 log=$2; shift 2
  if ! "$@" >"$log" 2>&1; then
    echo "== $name failed; log tail:"; tail -40 "$log"; failed=$((failed + 1)); return 1
  fi
}
mkdir -p build-logs

# The three parts overlap so that no core idles: the sanitizer build starts with the main build,
# at the lowest CPU priority, so it takes only what the main build leaves (its last long units,
# its links); the main build's tests then run with it and the fuzz smoke. The longest tests start
# first (tests/meson.build: priority). Each part's results are printed and counted in order.
echo "== main build (cuda=$cuda)"
rm -rf build-test build-asan

# Only the doctest suites and the example (suite 'sanitize'): the benchmark programs are large
# and already run (unsanitized) as smoke tests in the main build. Both builds take
# make_expert_cache from its compiled unit (-Dany_cache=compiled, the default: instantiating it in
# every test that calls it cost minutes under the sanitizers); the header-only mode runs in the main
# build's any_cache_header_only_* tests and in the install consumers.
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# With clang (installed above for the fuzz smoke): it compiles these template-heavy programs with
# ASan + UBSan in less than half of g++'s CPU time; the main build keeps g++ (and its warnings).
asan_env=()
command -v clang++ >/dev/null 2>&1 && asan_env=(CC=clang CXX=clang++)
build_asan() {  # exit status 1: configure failed, 2: compile failed (logs in build-logs/)
  env "${asan_env[@]}" meson setup build-asan -Dcuda=disabled -Dtests=enabled -Dbenchmarks=disabled -Dbuildtype=plain -Doptimization=0 \
    -Db_sanitize=address,undefined -Dtest_programs=grouped >build-logs/setup-asan.log 2>&1 || return 1
  # The programs of the 'sanitize' suite (the doctest programs and examples/meson.build's), as
  # Meson lists them.
  local targets
  targets=$(meson introspect build-asan --tests | python3 -c '
import json, os, sys
root = os.path.realpath("build-asan")
exes = {os.path.relpath(os.path.realpath(t["cmd"][0]), root) for t in json.load(sys.stdin) if any(s.split(":")[-1] == "sanitize" for s in t["suite"])}
print(" ".join(sorted(exes)))') || return 2
  [ -n "$targets" ] || return 2
  # shellcheck disable=SC2086
  meson compile -C build-asan -j 2 $targets >build-logs/compile-asan.log 2>&1 || return 2
}
( renice -n 19 -p $BASHPID >/dev/null 2>&1; build_asan ) &
asan_build_pid=$!

# Compiling the template-heavy tests is most of this script's time. Both builds are at -O0 (a
# test translation unit compiles in about 60% of its -O1 time); the few programs that need the
# optimiser to run in seconds ask for -Og, those that must warn as an engine's build would for -O1
# (meson.build, tests/meson.build: test_cache_sim's 10^5 random schedules take 86 s at -O0).
main_built=0
if step "configure" build-logs/setup.log meson setup build-test -Dcuda=$cuda "${main_flags[@]}" -Dtests=enabled -Dbenchmarks=enabled -Doptimization=0 \
   && step "compile" build-logs/compile.log meson compile -C build-test; then
  main_built=1
fi

fuzz_pid=
if [ -x tests/fuzz/run.sh ]; then
  tests/fuzz/run.sh "${EXPERT_CACHE_FUZZ_SECONDS:-30}" >build-logs/fuzz.log 2>&1 &
  fuzz_pid=$!
fi

if [ $main_built = 1 ]; then
  meson test -C build-test --print-errorlogs --num-processes 2 2>&1 | tee build-logs/test.log | grep -vE '^\s*$' | tail -60
  count build-logs/test.log
fi

echo "== host suite under ASan + UBSan"
wait $asan_build_pid
case $? in
  0)
    EXPERT_CACHE_SCHEDULES=${EXPERT_CACHE_ASAN_SCHEDULES:-10000} meson test -C build-asan --no-rebuild --suite sanitize \
      --print-errorlogs --num-processes 2 2>&1 | tee build-logs/test-asan.log | tail -12
    count build-logs/test-asan.log ;;
  1) echo "== configure (sanitizers) failed; log tail:"; tail -40 build-logs/setup-asan.log; failed=$((failed + 1)) ;;
  *) echo "== compile (sanitizers) failed; log tail:"; tail -40 build-logs/compile-asan.log; failed=$((failed + 1)) ;;
esac

if [ -n "$fuzz_pid" ]; then
  echo "== fuzz smoke"
  if wait $fuzz_pid; then
    passed=$((passed + 1)); tail -3 build-logs/fuzz.log
  else
    failed=$((failed + 1)); echo "fuzz smoke failed:"; tail -40 build-logs/fuzz.log
  fi
fi

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
