#pragma once
// Vocabulary shared by every expert weight layout: the six per-expert tensors the cache moves
// (vLLM's w13, w2, w13_scale, w2_scale, w13_scale_2, w2_scale_2) and their sizes per expert.
// A layout without a tensor reports it with 0 bytes, so the cache core can treat all layouts alike.
#include "expert_cache/version.hpp"
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace expert_cache::inline v0 {

enum class ExpertTensor : std::uint8_t { w13 = 0, w2, w13_scale, w2_scale, w13_scale_2, w2_scale_2 };

inline constexpr std::size_t num_expert_tensors = 6;

inline constexpr std::array<std::string_view, num_expert_tensors> expert_tensor_names = {
    "w13", "w2", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2"};

struct TensorBytes {
  std::string_view name;
  std::size_t bytes_per_expert = 0;  // 0: the layout has no such tensor
  friend constexpr bool operator==(const TensorBytes&, const TensorBytes&) = default;
};

using ExpertTensorBytes = std::array<TensorBytes, num_expert_tensors>;

[[nodiscard]] constexpr std::size_t total_bytes_per_expert(const ExpertTensorBytes& t) noexcept {
  std::size_t sum = 0;
  for (const auto& x : t) sum += x.bytes_per_expert;
  return sum;
}

}  // namespace expert_cache::inline v0
