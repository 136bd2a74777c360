#pragma once
/// Vocabulary types shared by every tier.
// Host-only, no CUDA.
#include "expert_cache/base/version.hpp"
#include <compare>
#include <cstddef>
#include <cstdint>

namespace expert_cache::inline v0 {

/// Strong ids: an expert id and a slot id can never be mixed up by accident.
/// The value type is int32_t because the device maps use -1 for "absent".
template <class Tag>
struct StrongId {
  std::int32_t value = -1;
  constexpr StrongId() noexcept = default;
  constexpr explicit StrongId(std::int32_t v) noexcept : value(v) {}
  [[nodiscard]] constexpr bool valid() const noexcept { return value >= 0; }
  [[nodiscard]] constexpr std::size_t index() const noexcept { return static_cast<std::size_t>(value); }
  friend constexpr auto operator<=>(StrongId, StrongId) noexcept = default;
};

struct ExpertTag;
struct SlotTag;
using ExpertId = StrongId<ExpertTag>;
using SlotId = StrongId<SlotTag>;

inline constexpr std::int32_t absent_slot = -1;  // value of an expert map entry for "not here"

}  // namespace expert_cache::inline v0
