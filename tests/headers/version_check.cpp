// base/version.hpp's macros match meson.build's project version (passed in by tests/headers/meson.build).
#include <cstring>

#include "expert_cache/base/version.hpp"

static_assert(EXPERT_CACHE_VERSION_MAJOR == MESON_VERSION_MAJOR, "EXPERT_CACHE_VERSION_MAJOR differs from meson.build");
static_assert(EXPERT_CACHE_VERSION_MINOR == MESON_VERSION_MINOR, "EXPERT_CACHE_VERSION_MINOR differs from meson.build");
static_assert(EXPERT_CACHE_VERSION_PATCH == MESON_VERSION_PATCH, "EXPERT_CACHE_VERSION_PATCH differs from meson.build");
static_assert(EXPERT_CACHE_VERSION_NUMBER ==
              MESON_VERSION_MAJOR * 10000 + MESON_VERSION_MINOR * 100 + MESON_VERSION_PATCH);

int main() { return std::strcmp(EXPERT_CACHE_VERSION, MESON_VERSION) == 0 ? 0 : 1; }
