#!/usr/bin/env bash
# The README's benchmark command: installs what is missing, builds, and runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
tests/deps.sh
export PATH="/usr/local/cuda/bin:$PATH"
cuda=disabled
command -v nvcc >/dev/null 2>&1 && cuda=enabled
if [ ! -d build-bench ]; then
  meson setup build-bench -Dcuda=$cuda -Dtests=disabled -Dbenchmarks=enabled >/dev/null
fi
meson compile -C build-bench >/dev/null
exec build-bench/bench/expert-cache-replay "$@"
