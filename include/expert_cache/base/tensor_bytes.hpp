#pragma once
/// Vocabulary shared by every expert weight layout: a bounded list of named per-expert tensors the
/// cache moves and their sizes per expert.
// The first six entries are, by default, vLLM's NVFP4 MoE tensors (w13, w2, w13_scale, w2_scale,
// w13_scale_2, w2_scale_2: ExpertTensor indexes them); a layout may name its own tensors and use
// more entries (a bias, GPTQ/AWQ zeros, group indices), up to max_expert_tensors. A layout without
// a tensor reports it with 0 bytes, so the cache core can treat all layouts alike.
#include "expert_cache/base/version.hpp"
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace expert_cache::inline v0 {

/// Indices of the default (NVFP4) tensors in an ExpertTensorBytes list.
enum class ExpertTensor : std::uint8_t { w13 = 0, w2, w13_scale, w2_scale, w13_scale_2, w2_scale_2 };

/// Bound on the tensors of one expert: NVFP4's six plus room for per-expert extras (GPTQ with
/// act-order and biases has qweight, scales, qzeros, g_idx and bias for w13 and w2: ten).
/// Every per-tensor array of the library (slot tensors, copy regions, kernel parameters) has
/// this many entries, so the bound is kept small.
inline constexpr std::size_t max_expert_tensors = 12;
/// Entries of an ExpertTensorBytes list (== max_expert_tensors; the loop bound code uses).
inline constexpr std::size_t num_expert_tensors = max_expert_tensors;
/// The NVFP4 six, the default names of the first entries.
inline constexpr std::size_t num_default_expert_tensors = 6;

inline constexpr std::array<std::string_view, num_default_expert_tensors> expert_tensor_names = {
    "w13", "w2", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2"};

/// One tensor of a layout: its name and its bytes per expert.
struct TensorBytes {
  std::string_view name;             // unique among the layout's present tensors
  std::size_t bytes_per_expert = 0;  // 0: the layout has no such tensor
  friend constexpr bool operator==(const TensorBytes&, const TensorBytes&) = default;
};

/// One entry per tensor; entries past the layout's tensors stay {"", 0}.
using ExpertTensorBytes = std::array<TensorBytes, max_expert_tensors>;

/// Index of the present tensor named `name`, or max_expert_tensors when there is none.
[[nodiscard]] constexpr std::size_t find_tensor(const ExpertTensorBytes& t, std::string_view name) noexcept {
  for (std::size_t i = 0; i < t.size(); ++i)
    if (t[i].bytes_per_expert != 0 && t[i].name == name) return i;
  return max_expert_tensors;
}

/// Bytes of one expert over all its tensors (unpadded).
[[nodiscard]] constexpr std::size_t total_bytes_per_expert(const ExpertTensorBytes& t) noexcept {
  std::size_t sum = 0;
  for (const auto& x : t) sum += x.bytes_per_expert;
  return sum;
}

}  // namespace expert_cache::inline v0
