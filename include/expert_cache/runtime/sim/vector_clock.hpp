#pragma once
/// Vector clocks of SimRuntime's happens-before relation: one component per actor (0 = the
/// host, k = stream k).
// Epoch 0 means "never", so every actor starts at 1. Host-only.
#include "expert_cache/base/version.hpp"
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace expert_cache::inline v0::detail::sim {

using Clock = std::vector<std::uint32_t>;  // index = actor

// The component of `actor`; a clock too short to name it has seen nothing of it.
[[nodiscard]] inline std::uint32_t clock_at(const Clock& c, std::uint32_t actor) noexcept {
  return actor < c.size() ? c[actor] : 0;
}

// into = max(into, from), component-wise (the acquiring side of an edge).
inline void join(Clock& into, const Clock& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (std::size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

// Whether the event at (actor, epoch) happens-before a point whose clock is `c`.
[[nodiscard]] inline bool happens_before(std::uint32_t actor, std::uint32_t epoch, const Clock& c) noexcept {
  return epoch <= clock_at(c, actor);
}

}  // namespace expert_cache::inline v0::detail::sim
