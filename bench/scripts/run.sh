#!/usr/bin/env bash
# The README's benchmark command: installs what is missing, builds, and runs the provider
# benchmark (expert-cache-bench: row vs cached providers x staging policies vs all-resident in a
# decode loop; docs/benchmarks.md). With a GPU (nvidia-smi lists one and nvcc exists) the run is
# MEASURED on the device; otherwise it is MODELLED on SimRuntime's cost model and says so.
# Arguments go to expert-cache-bench (--help lists them), e.g. bench/scripts/run.sh --steps 64 --json out.json
set -euo pipefail
cd "$(dirname "$0")/../.."
tests/deps.sh
export PATH="/usr/local/cuda/bin:$PATH"
# Meson from Debian, or the Python package where only that exists (some CUDA images ship Meson only as a Python package).
meson() { if command -v meson >/dev/null 2>&1; then command meson "$@"; else python3 -m mesonbuild.mesonmain "$@"; fi; }
gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep '^GPU ' >/dev/null; then gpu=1; fi
if [ "$gpu" = 1 ] && command -v nvcc >/dev/null 2>&1; then
  dir=build-bench-cuda cuda=enabled
else
  [ "$gpu" = 1 ] && echo "bench/scripts/run.sh: a GPU is present but nvcc is not: running the MODELLED benchmark" >&2
  dir=build-bench cuda=disabled
fi
if [ ! -d "$dir" ]; then
  meson setup "$dir" -Dcuda=$cuda -Dtests=disabled -Dbenchmarks=enabled >/dev/null
fi
meson compile -C "$dir" >/dev/null
exec "$dir/bench/expert-cache-bench" "$@"
