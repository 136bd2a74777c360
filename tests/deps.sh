#!/usr/bin/env bash
# Installs what the build needs and is missing (Debian 12): meson, ninja, doctest, Google Benchmark.
set -euo pipefail
# A dependency counts as present when pkg-config finds it (Debian's package, or a staged copy
# on PKG_CONFIG_PATH, for machines without a package registry).
has_pc() { command -v pkg-config >/dev/null 2>&1 && pkg-config --exists "$1"; }
missing=()
command -v meson >/dev/null 2>&1 || python3 -c 'import mesonbuild' >/dev/null 2>&1 || missing+=(meson)
command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
dpkg -s doctest-dev >/dev/null 2>&1 || has_pc doctest || missing+=(doctest-dev)
dpkg -s libbenchmark-dev >/dev/null 2>&1 || has_pc benchmark || missing+=(libbenchmark-dev)
dpkg -s pkg-config >/dev/null 2>&1 || command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
command -v cmake >/dev/null 2>&1 || missing+=(cmake)  # the install_consumers test (CMake package consumer)
if [ "${EXPERT_CACHE_WANT_CLANG:-0}" = 1 ]; then
  command -v clang++ >/dev/null 2>&1 || missing+=(clang)
  dpkg -s libclang-rt-14-dev >/dev/null 2>&1 || missing+=(libclang-rt-14-dev)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}" >&2
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
