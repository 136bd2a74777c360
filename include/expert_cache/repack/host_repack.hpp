#pragma once
/// The host repack of an NVFP4 MoE layer: validate a checkpoint layer and compute its layer-wide
/// scale factors (analyze_checkpoint), then repack its experts to Marlin with them
/// (repack_experts_unchecked). Pure host code; the CUDA path is repack/cuda_repack.cuh.
//
// Both evaluate the index maps and encodes of layout/nvfp4_marlin.hpp, as the CUDA kernels do,
// so a host repack and a GPU repack of the same layer are byte-identical.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "expert_cache/base/status.hpp"
#include "expert_cache/layout/nvfp4_layer.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"

namespace expert_cache::inline v0 {

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

}  // namespace expert_cache::inline v0
