#pragma once
/// How the ids of one slot pool map to model layers.
// A per-layer cache is one layer; the replay tool's global pool keys experts layer_index *
// experts_per_layer + expert, and the layer-aware policies need that split to measure time per
// layer and to keep per-layer shares.
#include <cstdint>

#include "expert_cache/base/concepts.hpp"

namespace expert_cache::inline v0 {

/// How a pool's ids split into layers: id = layer * experts_per_layer + expert.
struct PoolLayout {
  std::int32_t experts_per_layer = 0;  // 0: the whole id space is one layer

  /// Experts per layer for a pool of `shape`, never 0 (a bad split falls back to one layer).
  [[nodiscard]] constexpr std::int32_t layer_width(CacheShape shape) const noexcept {
    return experts_per_layer > 0 && experts_per_layer <= shape.num_experts ? experts_per_layer
                                                                           : shape.num_experts;
  }
  /// Layers of a pool of `shape` (at least 1).
  [[nodiscard]] constexpr std::int32_t num_layers(CacheShape shape) const noexcept {
    const std::int32_t w = layer_width(shape);
    return w > 0 ? (shape.num_experts + w - 1) / w : 1;
  }
  friend bool operator==(const PoolLayout&, const PoolLayout&) = default;
};

}  // namespace expert_cache::inline v0
