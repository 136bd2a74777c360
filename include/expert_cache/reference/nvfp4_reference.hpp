#pragma once
/// Host reference for the NVFP4 -> Marlin conversion of a whole MoE layer: the checked repack
/// (repack_layer_reference) and the dequantisation of both layouts, the ground truth that the
/// tests hold the CUDA kernels to. Pure host code; not the library's API.
#include <cstdint>
#include <span>

#include "expert_cache/base/status.hpp"
#include "expert_cache/layout/nvfp4_layer.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/repack/host_repack.hpp"

namespace expert_cache::inline v0 {

// Repacks a whole layer (docs/nvfp4_marlin.md, Whole layer and chunked conversion). Every check runs before the first
// write to `dst`. Warnings (a w1/w3 global-scale mismatch) go to `warn` if given.
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
