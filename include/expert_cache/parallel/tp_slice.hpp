#pragma once
/// Tensor-parallel slices of an expert layout (docs/parallel.md, "Tensor-slice").
// Rank r of TP holds, for every expert, intermediate columns [r n, (r+1) n) with n = N / TP:
//   w13 (gate, up) [2N, K] -> gate rows [r n, (r+1) n) and up rows [N + r n, N + (r+1) n): [2n, K]
//   w2  [K, N]             -> columns [r n, (r+1) n) of every row: [K, n]
// and the same rows / columns of the block scales; the per-expert global scales (one float per
// expert and GEMM) are the same for every slice and stored once. The slice of a rank is then
// exactly the layout {K, n}: DenseBf16{K, n} or Nvfp4Marlin{K, n, dtype}, and a rank's partial
// output (w2 slice . act(w13 slice . x)) summed over the ranks is the full expert's output.
//
// Why a packed copy: a w2 slice is not contiguous in a row-major [K, N] tensor (K runs of n
// elements, N apart), and a cache slot is one contiguous range per tensor. So the shared host
// pool holds each sliced tensor rank-major, [TP][E][slice bytes], packed once at load
// (SharedHostPool): rank r's [E][slice] is one contiguous tensor-major array that its cache
// adopts without a copy, and every expert byte is stored once.
//
// NVFP4 Marlin slices are repacked from the checkpoint slice (as each TP rank of an engine does)
// with the layer-wide scale factors of the FULL layer (analyze_checkpoint over all columns), so
// every rank decodes every weight exactly as the unsliced layer would. Checks (tp_slice_layout):
// N % TP == 0; n % 16 == 0 (w2's reduction axis is N: one e4m3 block scale per 16 of it, so a
// group never straddles two ranks); n a multiple of Marlin's column tile, 64 when K % 128 == 0
// else 128 (docs/nvfp4_marlin.md, Padding), so a slice needs no padding: no tile spans two ranks,
// and the slices together hold exactly the full layer's columns, nothing added.
// Host-only; compiles with g++ alone.
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "expert_cache/base/status.hpp"
#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/layout/dense.hpp"
#include "expert_cache/layout/nvfp4_layer.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/repack/host_repack.hpp"

namespace expert_cache::inline v0 {

/// Tensors every tensor-slice rank needs whole (the per-expert fp32 global scales).
[[nodiscard]] constexpr bool tp_replicated(std::string_view tensor_name) noexcept {
  return tensor_name == "w13_scale_2" || tensor_name == "w2_scale_2";
}

namespace detail {
inline Status check_tp(std::int64_t intermediate, std::int32_t tp, const char* layout) noexcept {
  if (tp < 1 || tp > 4096) return Status::format(ErrorCode::invalid_argument, "%s: tensor-parallel size %d outside [1, 4096]", layout, tp);
  if (intermediate % tp != 0)
    return Status::format(ErrorCode::invalid_argument, "%s: intermediate %lld is not divisible by TP=%d", layout,
                          static_cast<long long>(intermediate), tp);
  return {};
}
}  // namespace detail

/// The layout of one rank's slice of a dense layer.
/// @param full  the unsliced layout
/// @param tp    tensor-parallel size, in [1, 4096], dividing full.intermediate
/// @return {K, N / tp}, or invalid_argument
[[nodiscard]] inline Result<DenseBf16> tp_slice_layout(const DenseBf16& full, std::int32_t tp) noexcept {
  if (Status s = full.validate(); !s) return s;
  if (Status s = detail::check_tp(full.intermediate, tp, "dense_bf16 tp slice"); !s) return s;
  return DenseBf16{full.hidden, full.intermediate / tp};
}

/// The layout of one rank's slice of an NVFP4 Marlin layer.
/// @param full  the unsliced layout
/// @param tp    tensor-parallel size, in [1, 4096], dividing full.intermediate
/// @return {K, N / tp, dtype}, or invalid_argument when N / tp is not a multiple of the 16-element
///         scale group or of the Marlin column tile (see the header comment)
[[nodiscard]] inline Result<Nvfp4Marlin> tp_slice_layout(const Nvfp4Marlin& full, std::int32_t tp) noexcept {
  if (Status s = full.validate(); !s) return s;
  if (Status s = detail::check_tp(full.intermediate, tp, "nvfp4_marlin tp slice"); !s) return s;
  const std::int64_t n = full.intermediate / tp;
  if (n % marlin::group_size != 0)
    return Status::format(ErrorCode::invalid_argument,
                          "nvfp4_marlin tp slice: N/TP = %lld is not a multiple of the 16-element scale group (w2 "
                          "reduces over N: a group would straddle two ranks)",
                          static_cast<long long>(n));
  const std::int64_t tile = full.hidden % 128 == 0 ? marlin::tile_n : 2 * marlin::tile_n;
  if (n % tile != 0)
    return Status::format(ErrorCode::invalid_argument,
                          "nvfp4_marlin tp slice: N/TP = %lld is not a multiple of the %lld-column Marlin tile for "
                          "K=%lld (each slice would be padded: a tile spanning two ranks)",
                          static_cast<long long>(n), static_cast<long long>(tile), static_cast<long long>(full.hidden));
  return Nvfp4Marlin{full.hidden, n, full.dtype};
}

/// Rank `rank`'s slice of one dense expert (bf16 elements as uint16): w13 [2N, K] -> [2n, K],
/// w2 [K, N] -> [K, n]. `tp` must be one tp_slice_layout(full, tp) accepts.
/// @param w13, w2          the full expert's tensors
/// @param w13_out, w2_out  get the slice ([2n, K] and [K, n] elements)
inline void slice_dense_expert(const DenseBf16& full, std::int32_t tp, std::int32_t rank, const std::uint16_t* w13,
                               const std::uint16_t* w2, std::uint16_t* w13_out, std::uint16_t* w2_out) noexcept {
  const std::int64_t K = full.hidden, N = full.intermediate, n = N / tp;
  const std::size_t row = static_cast<std::size_t>(K) * sizeof(std::uint16_t);
  for (std::int64_t half = 0; half < 2; ++half)  // gate rows, then up rows
    std::memcpy(w13_out + half * n * K, w13 + (half * N + rank * n) * K, static_cast<std::size_t>(n) * row);
  for (std::int64_t k = 0; k < K; ++k)
    std::memcpy(w2_out + k * n, w2 + k * N + rank * n, static_cast<std::size_t>(n) * sizeof(std::uint16_t));
}

/// Rank `rank`'s slice of an NVFP4 checkpoint layer (all experts), in checkpoint form; the
/// vectors own the bytes the returned layer points at.
struct Nvfp4CheckpointSlice {
  std::vector<std::uint8_t> w13, w13_scale, w2, w2_scale;
  std::vector<float> w13_scale_2, w2_scale_2;
  Nvfp4CheckpointLayer layer;
};

/// Slices an NVFP4 checkpoint layer for one rank (repack it with the FULL layer's scale factors:
/// see the header comment).
/// @param full  the unsliced layout
/// @param src   the full checkpoint layer
/// @param tp    tensor-parallel size (as tp_slice_layout)
/// @param rank  the rank, in [0, tp)
/// @return the slice, or invalid_argument for a bad tp, rank or checkpoint size
[[nodiscard]] inline Result<Nvfp4CheckpointSlice> slice_nvfp4_checkpoint(const Nvfp4Marlin& full,
                                                                         const Nvfp4CheckpointLayer& src,
                                                                         std::int32_t tp, std::int32_t rank) {
  auto sl = tp_slice_layout(full, tp);
  if (!sl.ok()) return sl.status();
  if (rank < 0 || rank >= tp) return Status::format(ErrorCode::invalid_argument, "nvfp4 tp slice: rank %d outside [0, %d)", rank, tp);
  if (Status s = check_checkpoint_sizes(full, src); !s) return s;
  const Nvfp4Marlin& s = sl.value();
  const std::int64_t E = src.num_experts, K = full.hidden, N = full.intermediate, n = s.intermediate;
  Nvfp4CheckpointSlice out;
  out.w13.resize(static_cast<std::size_t>(E * s.ckpt_w13_bytes()));
  out.w13_scale.resize(static_cast<std::size_t>(E * s.ckpt_w13_scale_bytes()));
  out.w2.resize(static_cast<std::size_t>(E * s.ckpt_w2_bytes()));
  out.w2_scale.resize(static_cast<std::size_t>(E * s.ckpt_w2_scale_bytes()));
  out.w13_scale_2.assign(src.w13_scale_2.begin(), src.w13_scale_2.end());
  out.w2_scale_2.assign(src.w2_scale_2.begin(), src.w2_scale_2.end());
  // Row-sliced (w13 and its scales: rows are GEMM columns) and column-sliced (w2 and its scales:
  // N is the packed row axis; n/2 code bytes and n/16 scale bytes per row).
  auto rows = [&](const std::uint8_t* from, std::uint8_t* to, std::int64_t row_bytes) {
    for (std::int64_t e = 0; e < E; ++e)
      for (std::int64_t half = 0; half < 2; ++half)
        std::memcpy(to + (e * 2 * n + half * n) * row_bytes, from + (e * 2 * N + half * N + rank * n) * row_bytes,
                    static_cast<std::size_t>(n * row_bytes));
  };
  auto cols = [&](const std::uint8_t* from, std::uint8_t* to, std::int64_t full_row, std::int64_t slice_row) {
    for (std::int64_t r = 0; r < E * K; ++r)
      std::memcpy(to + r * slice_row, from + r * full_row + rank * slice_row, static_cast<std::size_t>(slice_row));
  };
  rows(src.w13.data(), out.w13.data(), K / 2);
  rows(src.w13_scale.data(), out.w13_scale.data(), K / marlin::group_size);
  cols(src.w2.data(), out.w2.data(), N / 2, n / 2);
  cols(src.w2_scale.data(), out.w2_scale.data(), N / marlin::group_size, n / marlin::group_size);
  out.layer = Nvfp4CheckpointLayer{E, out.w13, out.w13_scale, out.w13_scale_2, out.w2, out.w2_scale, out.w2_scale_2};
  return out;
}

// Repacks rank `rank`'s slice into `dst` (Marlin layout of tp_slice_layout(full, tp), E experts)
// with the FULL layer's scale factors, so every rank decodes every weight as the unsliced layer
// does (a slice's own factors could differ: the factor is a max over the layer).
[[nodiscard]] inline Result<Nvfp4LayerReport> repack_tp_slice_reference(const Nvfp4Marlin& full,
                                                                        const Nvfp4CheckpointLayer& src, std::int32_t tp,
                                                                        std::int32_t rank, const Nvfp4MarlinLayer& dst) {
  auto report = analyze_checkpoint(full, src);
  if (!report.ok()) return report.status();
  auto slice = slice_nvfp4_checkpoint(full, src, tp, rank);
  if (!slice.ok()) return slice.status();
  const Nvfp4Marlin sl = tp_slice_layout(full, tp).value();
  if (Status s = check_marlin_sizes(sl, src.num_experts, dst.as_const()); !s) return s;
  repack_experts_unchecked(sl, slice.value().layer, dst, report.value().params);
  return report;
}

}  // namespace expert_cache::inline v0
