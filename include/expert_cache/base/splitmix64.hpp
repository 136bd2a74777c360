#pragma once
/// SplitMix64: a tiny PRNG with the same sequence on every platform (SimRuntime's scheduler, the
/// trace generator, tests, benchmarks).
// Host and device. In detail/ because the runtime uses it and the runtime does not depend on
// tools/.
#include <cstdint>

#include "expert_cache/base/config.hpp"

namespace expert_cache::inline v0::detail {

struct SplitMix64 {
  std::uint64_t state;
  EXPERT_CACHE_HOST_DEVICE std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  EXPERT_CACHE_HOST_DEVICE double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  EXPERT_CACHE_HOST_DEVICE std::uint32_t below(std::uint32_t n) noexcept {  // [0, n); bias negligible for small n
    return static_cast<std::uint32_t>((next() >> 32) * n >> 32);
  }
};

}  // namespace expert_cache::inline v0::detail
