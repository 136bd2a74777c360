#pragma once
// Host reference for the NVFP4 -> Marlin repack of a whole MoE layer, and dequantisation of both
// layouts. Used by the tests (ground truth for the CUDA kernels); kernels/marlin_repack.cuh uses its
// layer types and size checks (it validates values on the GPU). Pure host code.
//
// Tensors are expert-major and contiguous. Checkpoint (ModelOpt; docs/nvfp4_marlin.md, Tensors per expert):
//   w13 u8 [E, 2N, K/2]   w13_scale e4m3 [E, 2N, K/16]   w13_scale_2 f32 [E, 2]
//   w2  u8 [E, K, N/2]    w2_scale  e4m3 [E, K, N/16]    w2_scale_2  f32 [E]
// Marlin (docs/nvfp4_marlin.md, Padding):
//   w13 i32 [E, K/16, 4Np]  w13_scale u8 [E, K/16, 2Np]  w13_scale_2 f32 [E]
//   w2  i32 [E, Np/16, 2K]  w2_scale  u8 [E, Np/16, K]   w2_scale_2  f32 [E]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <span>
#include <string_view>

#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/base/status.hpp"

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

// Validates sizes and values (no NaN or negative block scale, no NaN/inf/negative global scale)
// and computes the layer-wide scale factors over all experts. Reads only.
[[nodiscard]] inline Result<Nvfp4LayerReport> analyze_checkpoint(const Nvfp4Marlin& layout,
                                                                 const Nvfp4CheckpointLayer& src) {
  if (auto s = check_checkpoint_sizes(layout, src); !s.ok()) return s;
  auto scan = [](std::span<const std::uint8_t> scales, const char* what, std::uint8_t& max_byte) -> Status {
    max_byte = 0;
    for (std::size_t i = 0; i < scales.size(); ++i) {
      const std::uint8_t b = scales[i];
      if (marlin::is_bad_e4m3_scale(b)) {
        return Status::format(ErrorCode::invalid_argument, "nvfp4: %s[%zu] is negative or NaN (e4m3 byte %u)", what, i,
                              static_cast<unsigned>(b));
      }
      if (marlin::is_positive_e4m3(b)) max_byte = std::max(max_byte, b);
    }
    return {};
  };
  std::uint8_t max13 = 0, max2 = 0;
  if (auto s = scan(src.w13_scale, "w13_scale", max13); !s.ok()) return s;
  if (auto s = scan(src.w2_scale, "w2_scale", max2); !s.ok()) return s;
  auto check_globals = [](std::span<const float> g, const char* what) -> Status {
    for (std::size_t i = 0; i < g.size(); ++i) {
      if (!std::isfinite(g[i]) || g[i] < 0.0f) {
        return Status::format(ErrorCode::invalid_argument, "nvfp4: %s[%zu] = %f is negative or not finite", what, i,
                              static_cast<double>(g[i]));
      }
    }
    return {};
  };
  if (auto s = check_globals(src.w13_scale_2, "w13_scale_2"); !s.ok()) return s;
  if (auto s = check_globals(src.w2_scale_2, "w2_scale_2"); !s.ok()) return s;

  Nvfp4LayerReport report;
  report.params.w13_log2_sf = marlin::scale_factor_log2(max13, layout.dtype);
  report.params.w2_log2_sf = marlin::scale_factor_log2(max2, layout.dtype);
  for (std::int64_t e = 0; e < src.num_experts; ++e) {
    if (src.w13_scale_2[static_cast<std::size_t>(2 * e)] != src.w13_scale_2[static_cast<std::size_t>(2 * e + 1)]) {
      if (report.w13_global_mismatches++ == 0) report.first_mismatch = e;
    }
  }
  return report;
}

// Repacks experts [0, E) of `src` into `dst` with the given layer-wide factors. Sizes must have
// been checked (this is the loop the public functions share).
inline void repack_experts_unchecked(const Nvfp4Marlin& layout, const Nvfp4CheckpointLayer& src,
                                     const Nvfp4MarlinLayer& dst, const Nvfp4MarlinParams& params) {
  const std::int64_t k_dim = layout.hidden, n_dim = layout.intermediate, np = layout.padded_intermediate();
  const MarlinGemmShape g13 = layout.w13_gemm(), g2 = layout.w2_gemm();
  for (std::int64_t e = 0; e < src.num_experts; ++e) {
    const marlin::W13Codes q13{src.w13.data() + e * layout.ckpt_w13_bytes(), k_dim, n_dim, np};
    const marlin::W2Codes q2{src.w2.data() + e * layout.ckpt_w2_bytes(), k_dim, n_dim};
    const marlin::W13Scales s13{src.w13_scale.data() + e * layout.ckpt_w13_scale_bytes(), k_dim, n_dim, np};
    const marlin::W2Scales s2{src.w2_scale.data() + e * layout.ckpt_w2_scale_bytes(), k_dim, n_dim};
    std::uint32_t* w13_out = dst.w13.data() + e * g13.words();
    std::uint32_t* w2_out = dst.w2.data() + e * g2.words();
    for (std::int64_t kt = 0; kt < g13.rows(); ++kt)
      for (std::int64_t j = 0; j < g13.words_per_row(); ++j)
        w13_out[kt * g13.words_per_row() + j] = marlin::weight_word(q13, kt, j);
    for (std::int64_t kt = 0; kt < g2.rows(); ++kt)
      for (std::int64_t j = 0; j < g2.words_per_row(); ++j)
        w2_out[kt * g2.words_per_row() + j] = marlin::weight_word(q2, kt, j);
    std::uint8_t* s13_out = dst.w13_scale.data() + e * g13.scale_bytes();
    std::uint8_t* s2_out = dst.w2_scale.data() + e * g2.scale_bytes();
    for (std::int64_t g = 0; g < g13.rows(); ++g)
      for (std::int64_t col = 0; col < g13.size_n; ++col)
        s13_out[g * g13.size_n + col] =
            marlin::s0e5m3_from_e4m3(s13(g, marlin::scale_source_col(col)), params.w13_log2_sf);
    for (std::int64_t g = 0; g < g2.rows(); ++g)
      for (std::int64_t col = 0; col < g2.size_n; ++col)
        s2_out[g * g2.size_n + col] =
            marlin::s0e5m3_from_e4m3(s2(g, marlin::scale_source_col(col)), params.w2_log2_sf);
    const auto ue = static_cast<std::size_t>(e);
    dst.w13_scale_2[ue] = marlin::global_scale(src.w13_scale_2[2 * ue], params.w13_log2_sf, layout.dtype);
    dst.w2_scale_2[ue] = marlin::global_scale(src.w2_scale_2[ue], params.w2_log2_sf, layout.dtype);
  }
}

// Repacks a whole layer (docs/nvfp4_marlin.md, Whole layer and chunked conversion). Every check runs before the first write to `dst`. Warnings
// (a w1/w3 global-scale mismatch) go to `warn` if given.
[[nodiscard]] inline Result<Nvfp4LayerReport> repack_layer_reference(const Nvfp4Marlin& layout,
                                                                     const Nvfp4CheckpointLayer& src,
                                                                     const Nvfp4MarlinLayer& dst,
                                                                     const Nvfp4WarningSink& warn = {}) {
  auto report = analyze_checkpoint(layout, src);
  if (!report.ok()) return report.status();
  if (auto s = check_marlin_sizes(layout, src.num_experts, dst.as_const()); !s.ok()) return s;
  detail::warn_global_mismatch(*report, warn);
  repack_experts_unchecked(layout, src, dst, report->params);
  return report;
}

// Dequantises the Marlin layout back to checkpoint coordinates through the inverse maps:
// w13 [E, 2N, K], w2 [E, K, N] as doubles, value = fp4 * 2^-B * scale_decode * g' (what the kernel
// computes before rounding; exact in double). Padding is not emitted.
[[nodiscard]] inline Status dequant_marlin_reference(const Nvfp4Marlin& layout, std::int64_t num_experts,
                                                     const Nvfp4MarlinConstLayer& m, std::span<double> w13_out,
                                                     std::span<double> w2_out) {
  if (auto s = check_marlin_sizes(layout, num_experts, m); !s.ok()) return s;
  const std::int64_t k_dim = layout.hidden, n_dim = layout.intermediate, np = layout.padded_intermediate();
  if (static_cast<std::int64_t>(w13_out.size()) != num_experts * 2 * n_dim * k_dim)
    return detail::nvfp4_size_error("dequant w13 output", w13_out.size(), num_experts * 2 * n_dim * k_dim);
  if (static_cast<std::int64_t>(w2_out.size()) != num_experts * k_dim * n_dim)
    return detail::nvfp4_size_error("dequant w2 output", w2_out.size(), num_experts * k_dim * n_dim);
  const MarlinGemmShape g13 = layout.w13_gemm(), g2 = layout.w2_gemm();
  const double unbias = static_cast<double>(marlin::exp2i(-marlin::dtype_bias(layout.dtype)));
  auto value = [&](std::span<const std::uint32_t> w, std::span<const std::uint8_t> s, const MarlinGemmShape& g,
                   std::int64_t e, std::int64_t k, std::int64_t n, float global) {
    const marlin::NibbleCoord d = marlin::weight_dest(k, n, g.size_n);
    const std::uint32_t code = (w[static_cast<std::size_t>(e * g.words() + d.word)] >> (4 * d.nibble)) & 0xFu;
    const std::uint8_t sb = s[static_cast<std::size_t>(e * g.scale_bytes() + (k / marlin::group_size) * g.size_n +
                                                       marlin::scale_dest_col(n))];
    return static_cast<double>(marlin::e2m1_value(code)) * unbias * static_cast<double>(marlin::s0e5m3_value(sb)) *
           static_cast<double>(global);
  };
  for (std::int64_t e = 0; e < num_experts; ++e) {
    const float g13e = m.w13_scale_2[static_cast<std::size_t>(e)];
    const float g2e = m.w2_scale_2[static_cast<std::size_t>(e)];
    for (std::int64_t row = 0; row < 2 * n_dim; ++row) {
      const std::int64_t n = (row / n_dim) * np + row % n_dim;  // shard padding
      for (std::int64_t k = 0; k < k_dim; ++k)
        w13_out[static_cast<std::size_t>((e * 2 * n_dim + row) * k_dim + k)] = value(m.w13, m.w13_scale, g13, e, k, n, g13e);
    }
    for (std::int64_t n = 0; n < k_dim; ++n)
      for (std::int64_t k = 0; k < n_dim; ++k)
        w2_out[static_cast<std::size_t>((e * k_dim + n) * n_dim + k)] = value(m.w2, m.w2_scale, g2, e, k, n, g2e);
  }
  return {};
}

// Dequantises the checkpoint: e2m1 * e4m3 * g (w13 uses w1's global for both halves, as vLLM).
// With `flush` set, scales that the Marlin encode flushes (s * sf * 128 < 2) count as 0 — the one
// documented difference between the two layouts.
[[nodiscard]] inline Status dequant_checkpoint_reference(const Nvfp4Marlin& layout, const Nvfp4CheckpointLayer& src,
                                                         std::span<double> w13_out, std::span<double> w2_out,
                                                         const Nvfp4MarlinParams* flush = nullptr) {
  if (auto s = check_checkpoint_sizes(layout, src); !s.ok()) return s;
  const std::int64_t k_dim = layout.hidden, n_dim = layout.intermediate, num_experts = src.num_experts;
  if (static_cast<std::int64_t>(w13_out.size()) != num_experts * 2 * n_dim * k_dim)
    return detail::nvfp4_size_error("dequant w13 output", w13_out.size(), num_experts * 2 * n_dim * k_dim);
  if (static_cast<std::int64_t>(w2_out.size()) != num_experts * k_dim * n_dim)
    return detail::nvfp4_size_error("dequant w2 output", w2_out.size(), num_experts * k_dim * n_dim);
  auto scale = [&](std::uint8_t b, int log2_sf) {
    if (flush != nullptr && marlin::s0e5m3_from_e4m3(b, log2_sf) == 0) return 0.0;
    return static_cast<double>(marlin::e4m3_value(b));
  };
  const std::int64_t kg = k_dim / marlin::group_size, ng = n_dim / marlin::group_size;
  for (std::int64_t e = 0; e < num_experts; ++e) {
    const double g13 = src.w13_scale_2[static_cast<std::size_t>(2 * e)];
    const double g2 = src.w2_scale_2[static_cast<std::size_t>(e)];
    for (std::int64_t row = 0; row < 2 * n_dim; ++row) {
      const std::int64_t r = e * 2 * n_dim + row;
      for (std::int64_t k = 0; k < k_dim; ++k) {
        const std::uint32_t code = marlin::packed_code(src.w13.data() + r * (k_dim / 2), k);
        const double s = scale(src.w13_scale[static_cast<std::size_t>(r * kg + k / 16)], flush ? flush->w13_log2_sf : 0);
        w13_out[static_cast<std::size_t>(r * k_dim + k)] = static_cast<double>(marlin::e2m1_value(code)) * s * g13;
      }
    }
    for (std::int64_t n = 0; n < k_dim; ++n) {
      const std::int64_t r = e * k_dim + n;
      for (std::int64_t k = 0; k < n_dim; ++k) {
        const std::uint32_t code = marlin::packed_code(src.w2.data() + r * (n_dim / 2), k);
        const double s = scale(src.w2_scale[static_cast<std::size_t>(r * ng + k / 16)], flush ? flush->w2_log2_sf : 0);
        w2_out[static_cast<std::size_t>(r * n_dim + k)] = static_cast<double>(marlin::e2m1_value(code)) * s * g2;
      }
    }
  }
  return {};
}

}  // namespace expert_cache::inline v0
