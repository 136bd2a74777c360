#!/usr/bin/env bash
# What a user's build pays for the library: compiles translation units by hand and prints each
# one's wall time, CPU time (user + sys) and peak memory (/usr/bin/time -v). docs/any_cache.md
# ("What a build costs") has the numbers.
#
#   bench/scripts/compile_time.sh [--runs N] [--cxx CXX] [--opt FLAGS] [--cuda] [--tests] [--before DIR] [TU...]
#
# Default TUs (bench/compile_time/): a static WholeExpertCache<SimRuntime, DenseBf16> program,
# the same program choosing its provider at run time with make_expert_cache (header-only), the
# same user TU in the compiled mode (EXPERT_CACHE_SEPARATE_COMPILATION), the compiled mode's
# one instantiation unit (src/any_cache_sim.cpp), and the static and
# header-only programs again with a prefetch and a wide forward beside the prepare (*_calls.cpp:
# a program compiles the calls it makes). --cuda adds their
# CudaRuntime twins with nvcc; --tests adds every tests/test_*.cpp (as tests/run.sh's builds compile
# them: -O0 or -O1, and again at -O0 with ASan + UBSan); --before DIR the static and header-only
# probes against another checkout's headers (DIR/include, e.g. a `git worktree` of an earlier commit)
# in the same run.
# Each TU is compiled --runs times (default 2), interleaved: run 1 of every TU, then run 2 of every
# TU, and so on, so that a change in the shared build machine's load falls on all rows alike. The
# table prints the minimum and the median wall time of the runs, the median CPU time, the peak
# memory of all runs, and for a row with a static counterpart (the make_expert_cache rows against
# the static probe of the same compiler and headers) "x static": its wall and CPU time divided by
# the static probe's of the same run, the median of these per-run ratios.
# Nothing is written outside a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/../.."
runs=2; cxx=${CXX:-g++}; opt=-O2; cuda=0; tests=0; before=; extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --cxx) cxx=$2; shift 2 ;;
    --opt) opt=$2; shift 2 ;;
    --cuda) cuda=1; shift ;;
    --tests) tests=1; shift ;;
    --before) before=$(cd "$2" && pwd); shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) extra+=("$1"); shift ;;
  esac
done
[ -x /usr/bin/time ] || { echo "compile_time.sh: needs GNU time at /usr/bin/time (apt-get install time)" >&2; exit 2; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/expert_cache_ctime_XXXXXX")
trap 'rm -rf "$tmp"' EXIT
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
sep="-DEXPERT_CACHE_SEPARATE_COMPILATION"

# name|compiler|flags|source|reference: the index in jobs of the static row that "x static" divides by
# (empty: no ratio)
jobs=(
  "static WholeExpertCache (SimRuntime)|$cxx|$opt|bench/compile_time/static_cache.cpp|"
  "make_expert_cache, header-only (SimRuntime)|$cxx|$opt|bench/compile_time/any_cache.cpp|0"
  "make_expert_cache, compiled mode: user TU|$cxx|$opt $sep|bench/compile_time/any_cache.cpp|0"
  "make_expert_cache, compiled mode: the instantiation unit|$cxx|$opt $sep|src/any_cache_sim.cpp|0"
  "static WholeExpertCache + prefetch + prepare_wide|$cxx|$opt|bench/compile_time/static_cache_calls.cpp|"
  "make_expert_cache + prefetch + prepare_wide, header-only|$cxx|$opt|bench/compile_time/any_cache_calls.cpp|4"
)
if [ -n "$before" ]; then
  b=${#jobs[@]}
  jobs+=(
    "before: static WholeExpertCache (SimRuntime)|$cxx|$opt -I$before/include|bench/compile_time/static_cache.cpp|"
    "before: make_expert_cache, header-only (SimRuntime)|$cxx|$opt -I$before/include|bench/compile_time/any_cache.cpp|$b"
  )
fi
if [ $cuda = 1 ]; then
  cu="-std=c++20 -arch=sm_90 --expt-relaxed-constexpr $opt"
  c=${#jobs[@]}
  jobs+=(
    "static WholeExpertCache (CudaRuntime, nvcc)|$nvcc|$cu|bench/compile_time/static_cache_cuda.cu|"
    "make_expert_cache, header-only (CudaRuntime, nvcc)|$nvcc|$cu|bench/compile_time/any_cache_cuda.cu|$c"
    "make_expert_cache, compiled mode: user TU (nvcc)|$nvcc|$cu $sep|bench/compile_time/any_cache_cuda.cu|$c"
    "make_expert_cache, compiled mode: the instantiation unit (nvcc)|$nvcc|$cu $sep|src/any_cache_cuda.cu|$c"
  )
  if [ -n "$before" ]; then
    b=${#jobs[@]}
    jobs+=(
      "before: static WholeExpertCache (CudaRuntime, nvcc)|$nvcc|$cu -I$before/include|bench/compile_time/static_cache_cuda.cu|"
      "before: make_expert_cache, header-only (CudaRuntime, nvcc)|$nvcc|$cu -I$before/include|bench/compile_time/any_cache_cuda.cu|$b"
    )
  fi
fi
if [ $tests = 1 ]; then
  for t in tests/test_*.cpp; do
    inc="-Itests"
    case $t in tests/host/test_python_bridge.cpp | tests/host/test_vllm_bridge.cpp | tests/host/test_model_bridge.cpp) inc="-Itests -Ipython/src" ;; esac
    # tests/meson.build's optimized_tests get -O1 in the main build.
    o=-O0
    case $t in tests/host/test_cache_sim.cpp | tests/host/test_device_cache_sim.cpp | tests/host/test_model_cache.cpp) o=-O1 ;; esac
    jobs+=("$t $o (compiled mode)|$cxx|$o $inc $sep|$t|")
    jobs+=("$t -O0 ASan+UBSan (compiled mode)|$cxx|-O0 -fsanitize=address,undefined $inc $sep|$t|")
  done
fi
for t in "${extra[@]}"; do jobs+=("$t|$cxx|$opt -Itests|$t|"); done

# Per TU i, one line per run in $tmp/runs.$i: wall seconds, CPU seconds, peak KB.
for ((r = 0; r < runs; ++r)); do
  for i in "${!jobs[@]}"; do
    IFS='|' read -r name comp flags src ref <<<"${jobs[$i]}"
    if [ "${comp##*/}" = nvcc ]; then std=(); else std=(-std=c++20); fi
    # shellcheck disable=SC2086
    if ! /usr/bin/time -v -o "$tmp/time.txt" "$comp" "${std[@]}" $flags -Iinclude -c "$src" -o "$tmp/out.o" 2>"$tmp/err.txt"; then
      echo "compile failed: $name ($src)"; tail -20 "$tmp/err.txt"; exit 1
    fi
    awk -F': ' '/Elapsed \(wall clock\)/ {n = split($2, p, ":"); w = 0; for (i = 1; i <= n; ++i) w = w * 60 + p[i]}
                /User time/ {u = $2} /System time/ {s = $2} /Maximum resident set size/ {kb = $2}
                END {print w, u + s, kb}' "$tmp/time.txt" >>"$tmp/runs.$i"
  done
done

median() { sort -g | awk '{v[NR] = $1} END {printf "%.2f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
printf '%-62s %9s %9s %9s %9s %13s\n' "translation unit" "wall min" "wall med" "cpu med" "peak GB" "x static"
printf '%-62s %9s %9s %9s %9s %13s\n' "" "" "" "" "" "wall / cpu"
for i in "${!jobs[@]}"; do
  IFS='|' read -r name comp flags src ref <<<"${jobs[$i]}"
  wmin=$(awk '{print $1}' "$tmp/runs.$i" | sort -g | head -1)
  wmed=$(awk '{print $1}' "$tmp/runs.$i" | median)
  cmed=$(awk '{print $2}' "$tmp/runs.$i" | median)
  peak=$(awk '$3 > p {p = $3} END {printf "%.2f", p / 1048576}' "$tmp/runs.$i")
  ratio=
  if [ -n "$ref" ]; then
    # Pairwise: run r of this TU against run r of its static row, then the median of the ratios.
    rw=$(paste -d' ' "$tmp/runs.$i" "$tmp/runs.$ref" | awk '{print $1 / $4}' | median)
    rc=$(paste -d' ' "$tmp/runs.$i" "$tmp/runs.$ref" | awk '{print $2 / $5}' | median)
    ratio="${rw} / ${rc}"
  fi
  printf '%-62s %8.1fs %8.1fs %8.1fs %9s %13s\n' "$name" "$wmin" "$wmed" "$cmed" "$peak" "$ratio"
done
echo "($runs runs each, interleaved; $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $($cxx --version | head -1))"
