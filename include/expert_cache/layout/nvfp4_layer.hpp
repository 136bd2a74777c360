#pragma once
/// An NVFP4 MoE layer's tensors as spans, in checkpoint and Marlin form, and the checks of their
/// sizes against an Nvfp4Marlin layout; also the layer report and the warning sink that every
/// repack (host and GPU) shares. Pure host code.
//
// Tensors are expert-major and contiguous. Checkpoint (ModelOpt; docs/nvfp4_marlin.md, Tensors per expert):
//   w13 u8 [E, 2N, K/2]   w13_scale e4m3 [E, 2N, K/16]   w13_scale_2 f32 [E, 2]
//   w2  u8 [E, K, N/2]    w2_scale  e4m3 [E, K, N/16]    w2_scale_2  f32 [E]
// Marlin (docs/nvfp4_marlin.md, Padding):
//   w13 i32 [E, K/16, 4Np]  w13_scale u8 [E, K/16, 2Np]  w13_scale_2 f32 [E]
//   w2  i32 [E, Np/16, 2K]  w2_scale  u8 [E, Np/16, K]   w2_scale_2  f32 [E]
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <span>
#include <string_view>

#include "expert_cache/base/status.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"

namespace expert_cache::inline v0 {

struct Nvfp4CheckpointLayer {
  std::int64_t num_experts = 0;
  std::span<const std::uint8_t> w13;
  std::span<const std::uint8_t> w13_scale;
  std::span<const float> w13_scale_2;  // [E, 2]
  std::span<const std::uint8_t> w2;
  std::span<const std::uint8_t> w2_scale;
  std::span<const float> w2_scale_2;  // [E]
};

struct Nvfp4MarlinConstLayer {
  std::span<const std::uint32_t> w13;
  std::span<const std::uint32_t> w2;
  std::span<const std::uint8_t> w13_scale;
  std::span<const std::uint8_t> w2_scale;
  std::span<const float> w13_scale_2;
  std::span<const float> w2_scale_2;
};

struct Nvfp4MarlinLayer {
  std::span<std::uint32_t> w13;
  std::span<std::uint32_t> w2;
  std::span<std::uint8_t> w13_scale;
  std::span<std::uint8_t> w2_scale;
  std::span<float> w13_scale_2;
  std::span<float> w2_scale_2;
  [[nodiscard]] Nvfp4MarlinConstLayer as_const() const noexcept {
    return {w13, w2, w13_scale, w2_scale, w13_scale_2, w2_scale_2};
  }
};

// Layer-wide scale factors, one per tensor family (all experts' w13 scales, all w2 scales).
struct Nvfp4MarlinParams {
  int w13_log2_sf = 0;
  int w2_log2_sf = 0;
  friend constexpr bool operator==(const Nvfp4MarlinParams&, const Nvfp4MarlinParams&) = default;
};

// Where the repack's warnings go (the w1/w3 global-scale mismatch below). Empty by default: the
// library prints nothing unless the caller gives a sink (e.g. one that writes to stderr).
using Nvfp4WarningSink = std::function<void(std::string_view)>;

struct Nvfp4LayerReport {
  Nvfp4MarlinParams params;
  std::int64_t w13_global_mismatches = 0;  // experts whose w1 and w3 global scales differ
  std::int64_t first_mismatch = -1;        // the first such expert, or -1
};

namespace detail {

inline Status nvfp4_size_error(const char* what, std::size_t got, std::int64_t want) {
  return Status::format(ErrorCode::invalid_argument, "nvfp4: %s has %zu elements, expected %lld", what, got,
                        static_cast<long long>(want));
}

inline Status check_nvfp4_shape(const Nvfp4Marlin& layout, std::int64_t num_experts) {
  if (auto s = layout.validate(); !s.ok()) return s;
  if (num_experts <= 0 || num_experts > (std::int64_t{1} << 20)) {
    return Status::format(ErrorCode::invalid_argument, "nvfp4: num_experts must be in [1, 2^20], got %lld",
                          static_cast<long long>(num_experts));
  }
  return {};
}

// Mirrors vLLM's warning when w13_weight_scale_2's two columns differ (w3 then uses w1's); sent
// to `warn` when the caller gave one, else dropped (the report carries the same facts).
inline void warn_global_mismatch(const Nvfp4LayerReport& report, const Nvfp4WarningSink& warn) {
  if (report.w13_global_mismatches == 0 || !warn) return;
  char text[192];
  const int n = std::snprintf(text, sizeof text,
                              "expert_cache: warning: w13_scale_2 differs between w1 and w3 for %lld expert(s) "
                              "(first: %lld); using w1's global scale for both halves",
                              static_cast<long long>(report.w13_global_mismatches),
                              static_cast<long long>(report.first_mismatch));
  if (n > 0) warn(std::string_view(text, static_cast<std::size_t>(n) < sizeof text ? static_cast<std::size_t>(n) : sizeof text - 1));
}

}  // namespace detail

// Checks the checkpoint spans' sizes against the layout. No value checks.
[[nodiscard]] inline Status check_checkpoint_sizes(const Nvfp4Marlin& layout, const Nvfp4CheckpointLayer& src) {
  if (auto s = detail::check_nvfp4_shape(layout, src.num_experts); !s.ok()) return s;
  const std::int64_t e = src.num_experts;
  if (static_cast<std::int64_t>(src.w13.size()) != e * layout.ckpt_w13_bytes())
    return detail::nvfp4_size_error("checkpoint w13", src.w13.size(), e * layout.ckpt_w13_bytes());
  if (static_cast<std::int64_t>(src.w13_scale.size()) != e * layout.ckpt_w13_scale_bytes())
    return detail::nvfp4_size_error("checkpoint w13_scale", src.w13_scale.size(), e * layout.ckpt_w13_scale_bytes());
  if (static_cast<std::int64_t>(src.w13_scale_2.size()) != e * Nvfp4Marlin::ckpt_w13_scale_2_floats)
    return detail::nvfp4_size_error("checkpoint w13_scale_2", src.w13_scale_2.size(), e * 2);
  if (static_cast<std::int64_t>(src.w2.size()) != e * layout.ckpt_w2_bytes())
    return detail::nvfp4_size_error("checkpoint w2", src.w2.size(), e * layout.ckpt_w2_bytes());
  if (static_cast<std::int64_t>(src.w2_scale.size()) != e * layout.ckpt_w2_scale_bytes())
    return detail::nvfp4_size_error("checkpoint w2_scale", src.w2_scale.size(), e * layout.ckpt_w2_scale_bytes());
  if (static_cast<std::int64_t>(src.w2_scale_2.size()) != e * Nvfp4Marlin::ckpt_w2_scale_2_floats)
    return detail::nvfp4_size_error("checkpoint w2_scale_2", src.w2_scale_2.size(), e);
  return {};
}

// Checks the Marlin spans' sizes for `num_experts` experts.
[[nodiscard]] inline Status check_marlin_sizes(const Nvfp4Marlin& layout, std::int64_t num_experts,
                                               const Nvfp4MarlinConstLayer& dst) {
  if (auto s = detail::check_nvfp4_shape(layout, num_experts); !s.ok()) return s;
  const std::int64_t e = num_experts;
  if (static_cast<std::int64_t>(dst.w13.size()) != e * layout.w13_words())
    return detail::nvfp4_size_error("marlin w13", dst.w13.size(), e * layout.w13_words());
  if (static_cast<std::int64_t>(dst.w2.size()) != e * layout.w2_words())
    return detail::nvfp4_size_error("marlin w2", dst.w2.size(), e * layout.w2_words());
  if (static_cast<std::int64_t>(dst.w13_scale.size()) != e * layout.w13_scale_bytes())
    return detail::nvfp4_size_error("marlin w13_scale", dst.w13_scale.size(), e * layout.w13_scale_bytes());
  if (static_cast<std::int64_t>(dst.w2_scale.size()) != e * layout.w2_scale_bytes())
    return detail::nvfp4_size_error("marlin w2_scale", dst.w2_scale.size(), e * layout.w2_scale_bytes());
  if (static_cast<std::int64_t>(dst.w13_scale_2.size()) != e)
    return detail::nvfp4_size_error("marlin w13_scale_2", dst.w13_scale_2.size(), e);
  if (static_cast<std::int64_t>(dst.w2_scale_2.size()) != e)
    return detail::nvfp4_size_error("marlin w2_scale_2", dst.w2_scale_2.size(), e);
  return {};
}

}  // namespace expert_cache::inline v0
