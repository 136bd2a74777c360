#!/usr/bin/env bash
# Build and run the libFuzzer target over the trace parser and the planner API.
#   tests/fuzz/run.sh [SECONDS] [extra libFuzzer args...]     (default 60 s)
#   FUZZ_RUNS=1000000 tests/fuzz/run.sh 0                     (a fixed number of executions)
# Env: CXX (default clang++), FUZZ_BUILD (default build-fuzz), FUZZ_JOBS (parallel workers, default 1).
# Exit status is libFuzzer's: non-zero when a crash or invariant failure was found; the
# reproducer is written to $FUZZ_BUILD/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/../.."

seconds="${1:-60}"
shift || true
cxx="${CXX:-clang++}"
build="${FUZZ_BUILD:-build-fuzz}"
mkdir -p "$build/corpus" "$build/artifacts"

"$cxx" -std=c++20 -O1 -g -fno-omit-frame-pointer \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -Iinclude -Itools/include tests/fuzz/fuzz_trace_planner.cpp -o "$build/fuzz_trace_planner"

# Seed corpus: small valid and malformed traces (the first byte picks parser options).
seed() { printf '%b' "$2" > "$build/corpus/$1"; }
seed valid      '\x000 0 1 2 3\n0 1 4 5\n1 0 1 6\n# comment\n1 1 5 # trailing\n'
seed merged     '\x212 0 1 2\n2 0 3\n2 0 1\n3 0 0\n'
seed malformed  '\x000 0 1\n0 x 2\n-1 0 3\n0 0 99999999999\n'
seed resumed    '\x000 0 1\n0 1 2\n0 0 3\n'
seed ops        '\x07\x05\x00\x03\x01\x02\x03\x01\x02\x04\x05\x02\x03\x00\x04\x01\x02\x03\x04'
# Wide forwards (8 experts, 4 slots, 2 stream slots): stream, admit, and stream with a failing consumer.
seed wide       '\x00\x07\x03\x01\x01\x01\x05\x00\x03\x0a\x02\x03\x04\x05\x06\x07\x08\x09\x0b\x02\x43\x06\x02\x04\x06\x08\x0a\x03\x23\x04\x02\x03\x04\x05\x00\x02\x02\x03'

runs_arg=()
if [[ -n "${FUZZ_RUNS:-}" ]]; then runs_arg=(-runs="$FUZZ_RUNS"); fi
time_arg=()
if [[ "$seconds" != 0 ]]; then time_arg=(-max_total_time="$seconds"); fi
jobs_arg=()
if [[ "${FUZZ_JOBS:-1}" -gt 1 ]]; then jobs_arg=(-fork="$FUZZ_JOBS"); fi

exec "$build/fuzz_trace_planner" "${time_arg[@]}" "${runs_arg[@]}" "${jobs_arg[@]}" \
  -max_len=4096 -print_final_stats=1 -artifact_prefix="$build/artifacts/" "$@" "$build/corpus"
