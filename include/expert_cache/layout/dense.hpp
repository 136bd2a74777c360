#pragma once
/// Plain dense bf16 expert layout (unquantized MoE): w13 [2N, K] and w2 [K, N] in bf16, row-major,
/// no scales.
// The cache moves these rows verbatim; there is no repack.
#include <cstdint>
#include <string>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/tensor_bytes.hpp"

namespace expert_cache::inline v0 {

/// The dense bf16 layout of one MoE layer's experts: an `expert_layout` with two tensors, w13
/// [2N, K] and w2 [K, N].
struct DenseBf16 {
  static constexpr std::string_view name = "dense_bf16";
  static constexpr std::size_t element_bytes = 2;  // bf16

  std::int64_t hidden = 0;        // K
  std::int64_t intermediate = 0;  // N (per tensor-parallel partition)

  /// @return ok, or invalid_argument when hidden or intermediate is outside [1, 2^24]
  [[nodiscard]] Status validate() const {
    if (hidden <= 0 || intermediate <= 0 || hidden > (std::int64_t{1} << 24) ||
        intermediate > (std::int64_t{1} << 24)) {
      return Status(ErrorCode::invalid_argument,
                    "dense_bf16: hidden and intermediate must be in [1, 2^24], got K=" +
                        std::to_string(hidden) + " N=" + std::to_string(intermediate));
    }
    return {};
  }

  /// Bytes of one expert's w13 (gate and up, [2N, K]).
  [[nodiscard]] constexpr std::size_t w13_bytes() const noexcept {
    return static_cast<std::size_t>(2 * intermediate * hidden) * element_bytes;
  }
  /// Bytes of one expert's w2 ([K, N]).
  [[nodiscard]] constexpr std::size_t w2_bytes() const noexcept {
    return static_cast<std::size_t>(hidden * intermediate) * element_bytes;
  }

  /// The cache's tensor list: w13 and w2, no scales.
  [[nodiscard]] constexpr ExpertTensorBytes tensors() const noexcept {
    return {{{expert_tensor_names[0], w13_bytes()},
             {expert_tensor_names[1], w2_bytes()},
             {expert_tensor_names[2], 0},
             {expert_tensor_names[3], 0},
             {expert_tensor_names[4], 0},
             {expert_tensor_names[5], 0}}};
  }
  /// Bytes of one expert (w13 + w2).
  [[nodiscard]] constexpr std::size_t bytes_per_expert() const noexcept {
    return total_bytes_per_expert(tensors());
  }
};
static_assert(expert_layout<DenseBf16>);

}  // namespace expert_cache::inline v0
