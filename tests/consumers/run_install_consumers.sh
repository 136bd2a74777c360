#!/usr/bin/env bash
# Installs expert_cache into a fresh `meson install --destdir` tree and builds and runs its
# consumers against it: examples/cmake (find_package, CMake) and tests/consumers/meson_pkgconfig
# (pkg-config, Meson). Neither consumer sets a C++ standard: C++20 must come from the package.
#
#   run_install_consumers.sh SOURCE_ROOT MESON CUDA    (CUDA: enabled|disabled, as the parent build)
# NVCC in the environment names the CUDA compiler when CUDA is enabled. Exit 77 (skip) without cmake.
set -euo pipefail
src=$(cd "$1" && pwd); meson=$2; cuda=$3
command -v cmake >/dev/null 2>&1 || { echo "cmake not installed (tests/deps.sh installs it): skipped"; exit 77; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/expert_cache_install_XXXXXX")
trap 'rm -rf "$tmp"' EXIT
log() { echo "+ $*"; }
# Quiet on success, the whole log on failure.
run() { log "$@"; if ! "$@" >"$tmp/last.log" 2>&1; then cat "$tmp/last.log"; echo "FAIL: $*"; exit 1; fi; }

# A fresh, minimal build of the library (nothing compiled: install only takes the 'devel' files).
# pkgconfig.relocatable: the .pc files find their prefix from their own location, so they work
# from the destdir tree.
cuda_env=()
[ "$cuda" = enabled ] && cuda_env=(env "NVCC=${NVCC:-nvcc}")
run "${cuda_env[@]}" "$meson" setup "$tmp/build" "$src" --prefix=/usr/local -Dcuda="$cuda" -Dtests=disabled \
  -Dbenchmarks=disabled -Dexamples=disabled -Dpkgconfig.relocatable=true
run "$meson" install -C "$tmp/build" --no-rebuild --tags devel --destdir "$tmp/dest"
prefix="$tmp/dest/usr/local"
pcdir=$(dirname "$(find "$prefix" -name expert_cache.pc | head -1)")
[ -f "$pcdir/expert_cache.pc" ] || { echo "FAIL: expert_cache.pc not installed"; exit 1; }
[ -f "$prefix/share/cmake/expert_cache/expert_cacheConfig.cmake" ] || { echo "FAIL: CMake package not installed"; exit 1; }
[ -f "$prefix/include/expert_cache/base/version.hpp" ] || { echo "FAIL: headers not installed"; exit 1; }
cflags=$(PKG_CONFIG_PATH="$pcdir" pkg-config --cflags expert_cache)
case " $cflags " in *" -std=c++20 "*) ;; *) echo "FAIL: expert_cache.pc Cflags lack -std=c++20: $cflags"; exit 1;; esac
if [ "$cuda" = enabled ]; then
  [ -f "$pcdir/expert_cache_cuda.pc" ] || { echo "FAIL: expert_cache_cuda.pc not installed"; exit 1; }
  libs=$(PKG_CONFIG_PATH="$pcdir" pkg-config --libs expert_cache_cuda)
  case " $libs " in *" -lcudart "*) ;; *) echo "FAIL: expert_cache_cuda.pc Libs lack -lcudart: $libs"; exit 1;; esac
fi

# CMake consumer (examples/cmake).
with_cuda=OFF; cuda_root=()
if [ "$cuda" = enabled ]; then
  with_cuda=ON
  nvcc_path=$(command -v "${NVCC:-nvcc}")
  cuda_root=("-DCUDAToolkit_ROOT=$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")")
fi
# No build type, and plain in the Meson consumer below: these builds check that the package is
# found and used (include directory, C++20, the compiled mode's symbols), not the optimiser or
# debug info, which only made them slower (-O3: twice the compile time of -O0; -g: 20% more).
run cmake -S "$src/examples/cmake" -B "$tmp/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" -DWITH_CUDA=$with_cuda \
  "${cuda_root[@]}"
run cmake --build "$tmp/cmake-build"
run "$tmp/cmake-build/host_example"; cat "$tmp/last.log"
# The run-time-selected cache both ways; the compiled one's user object only declares the factory.
run "$tmp/cmake-build/any_header_only_example" row; cat "$tmp/last.log"
run "$tmp/cmake-build/any_compiled_example" cached s3fifo; cat "$tmp/last.log"
any_obj=$(find "$tmp/cmake-build/CMakeFiles/any_compiled_example.dir" -name 'any_main.cpp.o' | head -1)
if command -v nm >/dev/null 2>&1; then
  # grep -c reads all of nm's output: grep -q would exit at the first match and, under pipefail,
  # nm's SIGPIPE would fail the check.
  nm -C "$any_obj" | grep -c ' U .*make_expert_cache<expert_cache::v0::SimRuntime>' >/dev/null \
    || { echo "FAIL: the compiled-mode consumer instantiated make_expert_cache itself"; exit 1; }
fi
if [ "$cuda" = enabled ]; then run "$tmp/cmake-build/cuda_example"; cat "$tmp/last.log"; fi
# The package's include directory is the destdir tree's, not the source tree's.
grep -q -- "$prefix/include" "$tmp/cmake-build/CMakeFiles/host_example.dir/flags.make" \
  || { echo "FAIL: CMake consumer does not use the installed include directory"; exit 1; }
grep -Eq -- "-std=(c|gnu)\+\+20" "$tmp/cmake-build/CMakeFiles/host_example.dir/flags.make" \
  || { echo "FAIL: CMake consumer not compiled as C++20 (cxx_std_20 missing?)"; exit 1; }

# Meson consumer through pkg-config (tests/consumers/meson_pkgconfig).
with_cuda_meson=false; [ "$cuda" = enabled ] && with_cuda_meson=true
run env PKG_CONFIG_PATH="$pcdir" "$meson" setup "$tmp/meson-build" "$src/tests/consumers/meson_pkgconfig" \
  -Dwith_cuda=$with_cuda_meson -Dbuildtype=plain
run "$meson" compile -C "$tmp/meson-build"
run "$tmp/meson-build/consumer_host"; cat "$tmp/last.log"
run "$tmp/meson-build/consumer_any_compiled"; cat "$tmp/last.log"
if [ "$cuda" = enabled ]; then run "$tmp/meson-build/consumer_cuda"; cat "$tmp/last.log"; fi
echo "ok: installed to a fresh destdir; CMake and pkg-config consumers built and ran (cuda $cuda)"
