#pragma once
/// make_policy<P>(shape, forwards, extra...): one way to build any eviction policy for a cache
/// shape, for tests, benchmarks and tools that run several policies over the same forwards.
// Belady is built from `forwards` (its known future); a policy constructible from
// (shape, extra...) gets the extra arguments (e.g. a pool layout); any other from the shape
// alone. Host-only.
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/eviction/belady.hpp"

namespace expert_cache::inline v0 {

/// Builds policy P for a cache of `shape` that will see `forwards`.
/// @tparam P        an eviction policy type
/// @param shape     the cache's experts and slots
/// @param forwards  the unique ids of every forward the cache will see (only Belady reads them)
/// @param extra     further constructor arguments (e.g. a PoolLayout), used when P takes them
/// @return the policy
/// @throws Error from P's constructor (Belady: an id out of range or repeated in a forward)
template <class P, class... Extra>
[[nodiscard]] P make_policy(CacheShape shape, const std::vector<std::vector<std::int32_t>>& forwards,
                            const Extra&... extra) {
  if constexpr (std::is_same_v<P, Belady>) {
    return Belady(std::make_shared<const BeladyFuture>(shape.num_experts, forwards), shape);
  } else if constexpr (sizeof...(Extra) != 0 && std::is_constructible_v<P, CacheShape, const Extra&...>) {
    return P(shape, extra...);
  } else {
    return P(shape);
  }
}

}  // namespace expert_cache::inline v0
