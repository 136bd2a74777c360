#pragma once
/// Version of expert_cache and its language requirement.
// Self-contained: no includes. Every public header includes this one (directly or through
// base/config.hpp), so a translation unit built under an older standard stops here with one clear
// message instead of pages of concept errors.
// The numbers match meson.build's project version (the test version_matches_meson checks it).

#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 202002L
#error "expert_cache needs C++20: compile with -std=c++20 (nvcc: -std=c++20; CMake: link expert_cache::expert_cache, which carries cxx_std_20)"
#endif

#define EXPERT_CACHE_VERSION_MAJOR 0
#define EXPERT_CACHE_VERSION_MINOR 1
#define EXPERT_CACHE_VERSION_PATCH 0
#define EXPERT_CACHE_VERSION "0.1.0"
// One comparable number, e.g. `#if EXPERT_CACHE_VERSION_NUMBER >= 100` for 0.1.0.
#define EXPERT_CACHE_VERSION_NUMBER \
  (EXPERT_CACHE_VERSION_MAJOR * 10000 + EXPERT_CACHE_VERSION_MINOR * 100 + EXPERT_CACHE_VERSION_PATCH)
