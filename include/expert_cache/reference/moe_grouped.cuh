#pragma once
/// A reference grouped NVFP4 MoE consumer for many tokens per expert (prompts, large batches).
// A grouped NVFP4 MoE consumer for many tokens per expert (prompts, large batches): the rows
// of one call are (token, expert) pairs sorted by expert, and each expert's rows form tiles of
// up to 64 rows. A block reads the weights of ONE expert and one 64-column Marlin tile once and
// applies them to all the tile's rows, so the weight decode is paid once per 16 rows instead of
// once per pair (reference/moe_consumer.cuh, one pair per consumer token, is for decode batches).
// Same slot layout (NVFP4-Marlin, layout/nvfp4_marlin.hpp), same per-row arithmetic as
// moe_consumer.cuh:
//   C1  = x[src[v]] . W13[slot]            (K -> 2Np; gate [0, Np), up [Np, 2Np))
//   A   = silu(C1[:Np]) * C1[Np:]
//   C3  = A . W2[slot]                     (Np -> K)
//   out[dst[v]] = coef[v] * C3             (rows of an absent expert: 0)
// Precision (GroupedPrecision, chosen at construction):
//   exact  as moe_consumer.cuh: each fp32 input (x and A) is split into three bf16 terms (about
//          24 significant bits), each fp4 weight times its block scale is exact in bf16, the
//          products are exact in the MMA's fp32 accumulator: an fp32 MoE to about 2e-4 of a
//          row's magnitude. Per K-row a weight fragment is decoded once and used for 3 terms x 2
//          row groups = 6 MMAs; the three terms go into one accumulator, term 0 first.
//   bf16   an engine's bf16 prefill: x and A are rounded to bf16 once (round to nearest even)
//          and each weight fragment does one MMA per row group (2 per K-row): a third of the
//          MMAs and of the activation loads, and a workspace of one term instead of three. The
//          products are still exact and the sums fp32, so a row matches the double MoE of the
//          bf16-rounded x and A to fp32 summation error (but for an A element that the fp32
//          sums put on the other side of a bf16 rounding midpoint: one bf16 ulp of it).
// Scaling, both modes: the weights enter the MMA as fp4 * s0e5m3 * 2^-111 (moe_mma.cuh) and
// the inputs are scaled by 2^62 before rounding, so a product is x * fp4 * s0e5m3 * 2^-49 and
// the outputs are scaled back by 2^49 with the global scale. The exact mode needs the 2^62 for
// its third term (about 2^-16 of the input); one term needs only the leading one, and the same
// scale serves it: bf16(x * 2^62) = bf16(x) * 2^62 exactly (a power of two commutes with the
// rounding for every normal fp32 x), finite for |x| < 2^66, and a product is a normal fp32
// for |x * fp4 * s0e5m3| >= 2^-77: with the encoder's scales (s0e5m3 >= 2 when nonzero,
// docs/nvfp4_marlin.md) for every |x| >= 2^-77. So neither overflow nor underflow is in reach
// of real activations, and no other scale is needed; products of smaller inputs (fp32
// subnormals included) may be flushed, in both modes.
// Deterministic in both modes: no atomics, no split-K, every output of a row is computed by one
// warp in a fixed order that depends only on the row's tile (expert, position among the
// expert's rows), never on the other experts of the call. So a call over all experts (an
// all-resident prefill) and calls over disjoint expert subsets (wide-forward rounds) give
// bit-identical rows when each expert's rows are the same in the same order.
//
// Kernels of run() (stream order, no inter-kernel flags), T = 3 terms (exact) or 1 (bf16):
//   split_x   grid rows: x[src[v]] * 2^62 as T bf16 terms in MMA fragment order.
//   w13       grid (2Np / 64, tiles), 128 threads: warp w takes rows 16w..16w+15 of the tile.
//   act       grid rows: silu(gate) * up * 2^62, T bf16 terms in fragment order.
//   w2        grid (K / 64, tiles): out[dst[v]] = coef[v] * C3.
// Tiles are device data (GroupedTile): a tile whose expert is out of range or absent from the
// map writes zero rows; one whose row range leaves [0, rows) or exceeds 64 rows is skipped.
#if !defined(__CUDACC__)
#error "expert_cache/reference/moe_grouped.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "expert_cache/base/config.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/reference/moe_mma.cuh"
#include "expert_cache/reference/moe_weights.cuh"
#include "expert_cache/runtime/cuda_error.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

/// One tile of a grouped call: rows [first, first + count) of the call (count 1..64), all
/// routed to `expert`.
struct GroupedTile {
  std::int32_t expert = -1;
  std::int32_t first = 0;
  std::int32_t count = 0;
  std::int32_t pad = 0;
};

inline constexpr int grouped_tile_rows = 64;

/// How a GroupedMoe multiplies (see the header comment): `exact` carries fp32 inputs and
/// activations as three bf16 terms; `bf16` rounds them to bf16 once, as a bf16 engine's prefill
/// does, with a third of the MMAs and of the workspace.
enum class GroupedPrecision : std::uint8_t { exact, bf16 };

/// Appends the tiles of `count` consecutive rows from `first`, all of expert `expert` (host).
inline void append_grouped_tiles(std::int32_t expert, std::int32_t first, std::int32_t count,
                                 std::vector<GroupedTile>& out) {
  for (std::int32_t i = 0; i < count; i += grouped_tile_rows) {
    out.push_back(GroupedTile{expert, first + i, count - i < grouped_tile_rows ? count - i : grouped_tile_rows, 0});
  }
}

namespace grouped_detail {

using moe_detail::a_frag_index;
using moe_detail::bf16x2_mul;
using moe_detail::bf16x2_two_pow_127;
using moe_detail::e2m1_pair_bf16;
using moe_detail::in_scale;
using moe_detail::mma_bf16;
using moe_detail::s0e5m3_pair_bf16;
using moe_detail::split_bf16;
using moe_detail::terms;

inline constexpr int warps = 4;
// bf16 terms per input value: the kernels are instantiated for 3 (exact) and 1 (bf16).
EXPERT_CACHE_HOST_DEVICE constexpr int terms_of(GroupedPrecision p) noexcept { return p == GroupedPrecision::bf16 ? 1 : terms; }

inline constexpr int threads = 32 * warps;
inline constexpr int row_groups = 2;  // 8-row MMA groups per warp: 16 rows per warp, 64 per block

__device__ __forceinline__ std::int32_t tile_slot(const MoeWeights& w, const GroupedTile& t, int rows) {
  if (t.count < 1 || t.count > grouped_tile_rows || t.first < 0 || t.first > rows - t.count) return -2;  // skip
  if (t.expert < 0 || t.expert >= w.num_experts) return -1;
  return w.expert_map[t.expert];
}

__device__ __forceinline__ float global_scale(const MoeWeights& w, int tensor, std::int32_t slot) {
  float g;
  memcpy(&g, w.base[tensor] + static_cast<unsigned long long>(slot) * w.stride[tensor], sizeof g);
  return g;
}

// The four A registers of word `wd` (16 columns x 16 k) of a lane's 16-byte piece, scaled by the
// lane's scale bytes (as moe_detail::mma_row).
__device__ __forceinline__ void decode_word(std::uint32_t v, uint2 s, int wd, std::uint32_t (&a)[4]) {
  const std::uint32_t sc = bf16x2_mul(s0e5m3_pair_bf16(s.x, s.y, wd), bf16x2_two_pow_127);
  const std::uint32_t s0 = __byte_perm(sc, 0u, 0x1010), s1 = __byte_perm(sc, 0u, 0x3232);
  a[0] = bf16x2_mul(e2m1_pair_bf16<0>(v), s0);
  a[1] = bf16x2_mul(e2m1_pair_bf16<2>(v), s1);
  a[2] = bf16x2_mul(e2m1_pair_bf16<1>(v), s0);
  a[3] = bf16x2_mul(e2m1_pair_bf16<3>(v), s1);
}

// v (already times in_scale) as T bf16 terms: three that sum to v to about 24 bits (exact), or
// v rounded to nearest even (bf16).
template <int T>
__device__ __forceinline__ void to_terms(float v, unsigned short (&out)[T]) {
  static_assert(T == terms || T == 1);
  if constexpr (T == terms) {
    split_bf16(v, out);
  } else {
    out[0] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

// acc[wd][rg] += W(word wd) x terms of row group rg, for one K-row. `b[rg]`: the rows' term
// fragments (zero for rows past the tile). Terms 0 .. T - 1 in order.
template <int T>
__device__ __forceinline__ void mma_krow(float (&acc)[4][row_groups][4], uint4 q, uint2 s, const uint2 (&b)[row_groups][T]) {
  const std::uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int wd = 0; wd < 4; ++wd) {
    std::uint32_t a[4];
    decode_word(words[wd], s, wd, a);
#pragma unroll
    for (int rg = 0; rg < row_groups; ++rg)
#pragma unroll
      for (int r = 0; r < T; ++r) mma_bf16(acc[wd][rg], a[0], a[1], a[2], a[3], b[rg][r]);
  }
}

// Input rows as T terms: xt[v][kt][term][a_frag_index(kk)], kt = K-row of 16. (Templates, so
// defined in every unit that includes the header.)
template <int T>
EXPERT_CACHE_KERNEL void split_x(const float* x, const std::int32_t* src, int hidden, int rows, unsigned short* xt) {
  const int v = static_cast<int>(blockIdx.x);
  if (v >= rows) return;
  const float* in = x + static_cast<long long>(src[v]) * hidden;
  unsigned short* out = xt + static_cast<long long>(v) * hidden * T;
  for (int k = static_cast<int>(threadIdx.x); k < hidden; k += static_cast<int>(blockDim.x)) {
    unsigned short b[T];
    to_terms<T>(in[k] * in_scale, b);
#pragma unroll
    for (int r = 0; r < T; ++r) out[(k / 16) * (T * 16) + 16 * r + a_frag_index(k % 16)] = b[r];
  }
}

// One 64-column tile `nt` of a tensor (words at nt * 512 + lane * 16 + kt * 8 * width, scale
// bytes at nt * 64 + 8g + kt * width) over `krows` K-rows for the warp's 16 rows of the tile.
// in: [row][kt][term][16], T terms. Returns acc (columns 16wd + g (+8), rows 2t, 2t + 1 of each
// 8-row group).
template <int T>
__device__ __forceinline__ void tile_product(const unsigned char* wbase, const unsigned char* sbase, long long width,
                                             int nt, int krows, const unsigned short* in, int first, int warp_rows,
                                             float (&acc)[4][row_groups][4]) {
  const int lane = static_cast<int>(threadIdx.x) & 31, g = lane >> 2, t = lane & 3;
  const unsigned char* wp = wbase + nt * 512LL + lane * 16;
  const unsigned char* sp = sbase + nt * 64LL + 8 * g;
  const unsigned short* rowp[row_groups];
#pragma unroll
  for (int rg = 0; rg < row_groups; ++rg) {
    const int r = 8 * rg + g;  // this lane's B row (token) within the warp's 16
    rowp[rg] = r < warp_rows ? in + static_cast<long long>(first + r) * krows * (T * 16) + 4 * t : nullptr;
  }
#pragma unroll 2
  for (int kt = 0; kt < krows; ++kt) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(wp + kt * 8 * width));
    const uint2 s = __ldg(reinterpret_cast<const uint2*>(sp + kt * width));
    uint2 b[row_groups][T];
#pragma unroll
    for (int rg = 0; rg < row_groups; ++rg)
#pragma unroll
      for (int r = 0; r < T; ++r)
        b[rg][r] = rowp[rg] != nullptr ? __ldg(reinterpret_cast<const uint2*>(rowp[rg] + kt * (T * 16) + 16 * r))
                                       : make_uint2(0u, 0u);
    mma_krow<T>(acc, q, s, b);
  }
}

// h[v][2Np]: C1 * g13' * unbias * 2^49 for the tile's rows. Grid (2Np / 64, tiles).
template <int T>
EXPERT_CACHE_KERNEL void __launch_bounds__(threads) w13(MoeWeights w, const GroupedTile* tiles, int rows, int hidden,
                                                         int padded, float gscale, const unsigned short* xt, float* h) {
  const GroupedTile tile = tiles[blockIdx.y];
  const std::int32_t slot = tile_slot(w, tile, rows);
  if (slot < 0) return;  // act and w2 see the same slot: absent rows are written as 0 there
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int warp_rows = tile.count - 16 * warp;
  if (warp_rows <= 0) return;
  const long long width = 2LL * padded;
  float acc[4][row_groups][4] = {};
  tile_product<T>(w.base[0] + static_cast<unsigned long long>(slot) * w.stride[0],
               w.base[2] + static_cast<unsigned long long>(slot) * w.stride[2], width, static_cast<int>(blockIdx.x),
               hidden / 16, xt, tile.first + 16 * warp, warp_rows, acc);
  const float gs = global_scale(w, 4, slot) * gscale;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int wd = 0; wd < 4; ++wd)
#pragma unroll
    for (int rg = 0; rg < row_groups; ++rg)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = 8 * rg + 2 * t + (i & 1);
        const int col = 64 * static_cast<int>(blockIdx.x) + 16 * wd + g + 8 * (i >> 1);
        if (r < warp_rows) h[static_cast<long long>(tile.first + 16 * warp + r) * width + col] = acc[wd][rg][i] * gs;
      }
}

// at[v][kt][term][16]: silu(gate) * up as T terms. Grid rows.
template <int T>
EXPERT_CACHE_KERNEL void act(const float* h, int rows, int padded, unsigned short* at) {
  const int v = static_cast<int>(blockIdx.x);
  if (v >= rows) return;
  const float* hv = h + static_cast<long long>(v) * 2 * padded;
  unsigned short* out = at + static_cast<long long>(v) * padded * T;
  for (int k = static_cast<int>(threadIdx.x); k < padded; k += static_cast<int>(blockDim.x)) {
    const float gate = hv[k], up = hv[padded + k];
    const float a = gate / (1.0f + expf(-gate)) * up;
    unsigned short b[T];
    to_terms<T>(a * in_scale, b);
#pragma unroll
    for (int r = 0; r < T; ++r) out[(k / 16) * (T * 16) + 16 * r + a_frag_index(k % 16)] = b[r];
  }
}

// out[dst[v]][K] = coef[v] * C3 * g2' * unbias * 2^49; rows of an absent expert: 0. Grid (K / 64, tiles).
template <int T>
EXPERT_CACHE_KERNEL void __launch_bounds__(threads) w2(MoeWeights w, const GroupedTile* tiles, int rows, int hidden,
                                                        int padded, float gscale, const unsigned short* at,
                                                        const float* coef, const std::int32_t* dst, float* out) {
  const GroupedTile tile = tiles[blockIdx.y];
  const std::int32_t slot = tile_slot(w, tile, rows);
  if (slot == -2) return;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int warp_rows = tile.count - 16 * warp;
  if (warp_rows <= 0) return;
  const int g = lane >> 2, t = lane & 3;
  const int nt = static_cast<int>(blockIdx.x);
  float acc[4][row_groups][4] = {};
  float gs = 0.0f;
  if (slot >= 0) {
    tile_product<T>(w.base[1] + static_cast<unsigned long long>(slot) * w.stride[1],
                 w.base[3] + static_cast<unsigned long long>(slot) * w.stride[3], hidden, nt, padded / 16, at,
                 tile.first + 16 * warp, warp_rows, acc);
    gs = global_scale(w, 5, slot) * gscale;
  }
#pragma unroll
  for (int wd = 0; wd < 4; ++wd)
#pragma unroll
    for (int rg = 0; rg < row_groups; ++rg)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = 8 * rg + 2 * t + (i & 1);
        if (r >= warp_rows) continue;
        const int v = tile.first + 16 * warp + r;
        const int col = 64 * nt + 16 * wd + g + 8 * (i >> 1);
        out[static_cast<long long>(dst[v]) * hidden + col] = slot >= 0 ? coef[v] * (acc[wd][rg][i] * gs) : 0.0f;
      }
}

}  // namespace grouped_detail

/// The grouped consumer's workspace (sized for `max_rows` rows per call) and launcher.
/// `precision` picks the arithmetic (GroupedPrecision; exact by default) for every run().
class GroupedMoe {
 public:
  GroupedMoe(const Nvfp4Marlin& layout, int max_rows, int max_tiles, GroupedPrecision precision = GroupedPrecision::exact)
      : layout_(layout), max_rows_(max_rows), max_tiles_(max_tiles), precision_(precision) {
    throw_if_error(layout.validate());
    if (max_rows < 1 || max_tiles < 1) throw Error(ErrorCode::invalid_argument, "GroupedMoe: max_rows and max_tiles must be >= 1");
    if (max_tiles > 65535) throw Error(ErrorCode::invalid_argument, "GroupedMoe: max_tiles must be <= 65535");
    if (precision != GroupedPrecision::exact && precision != GroupedPrecision::bf16)
      throw Error(ErrorCode::invalid_argument, "GroupedMoe: precision must be GroupedPrecision::exact or GroupedPrecision::bf16");
    hidden_ = static_cast<int>(layout.hidden);
    padded_ = static_cast<int>(layout.padded_intermediate());
    if (hidden_ % 64 != 0 || padded_ % 64 != 0)
      throw Error(ErrorCode::invalid_argument, "GroupedMoe: hidden and the padded intermediate size must be multiples of 64");
    const auto rows = static_cast<std::size_t>(max_rows);
    const auto terms = static_cast<std::size_t>(grouped_detail::terms_of(precision));
    try {
      alloc(xt_, rows * static_cast<std::size_t>(hidden_) * terms * sizeof(unsigned short));
      alloc(h_, rows * 2 * static_cast<std::size_t>(padded_) * sizeof(float));
      alloc(at_, rows * static_cast<std::size_t>(padded_) * terms * sizeof(unsigned short));
    } catch (...) {
      release();  // the destructor does not run for a constructor that throws
      throw;
    }
    gscale_ = marlin::exp2i(-marlin::dtype_bias(layout.dtype)) * moe_detail::out_scale;
  }
  GroupedMoe(const GroupedMoe&) = delete;
  GroupedMoe& operator=(const GroupedMoe&) = delete;
  ~GroupedMoe() { release(); }

  /// Rows [0, rows) sorted so that `tiles` (device, `num_tiles` of them) cover them: row v
  /// reads x[src[v]] ([*, hidden] fp32) and writes out[dst[v]] scaled by coef[v]. All pointers
  /// device memory (or mapped host memory) valid for work on `stream`.
  [[nodiscard]] Status run(const MoeWeights& w, const GroupedTile* tiles, int num_tiles, const std::int32_t* src,
                           const std::int32_t* dst, const float* coef, const float* x, float* out, int rows,
                           cudaStream_t stream) const noexcept {
    if (rows < 0 || rows > max_rows_) {
      return Status::format(ErrorCode::invalid_argument, "GroupedMoe::run: rows %d outside [0, %d]", rows, max_rows_);
    }
    if (num_tiles < 0 || num_tiles > max_tiles_) {
      return Status::format(ErrorCode::invalid_argument, "GroupedMoe::run: tiles %d outside [0, %d]", num_tiles, max_tiles_);
    }
    if (rows == 0 || num_tiles == 0) return {};
    if (precision_ == GroupedPrecision::bf16) {
      launch<grouped_detail::terms_of(GroupedPrecision::bf16)>(w, tiles, num_tiles, src, dst, coef, x, out, rows, stream);
    } else {
      launch<grouped_detail::terms_of(GroupedPrecision::exact)>(w, tiles, num_tiles, src, dst, coef, x, out, rows, stream);
    }
    return cuda_status(cudaGetLastError(), "GroupedMoe::run: launch");
  }

  [[nodiscard]] int max_rows() const noexcept { return max_rows_; }
  [[nodiscard]] int max_tiles() const noexcept { return max_tiles_; }
  [[nodiscard]] GroupedPrecision precision() const noexcept { return precision_; }
  /// Device bytes of the workspace: per row hidden * T + Np * T bf16 terms and 2Np fp32 sums
  /// (T = 3 exact, 1 bf16).
  [[nodiscard]] std::size_t workspace_bytes() const noexcept {
    const auto rows = static_cast<std::size_t>(max_rows_);
    const auto terms = static_cast<std::size_t>(grouped_detail::terms_of(precision_));
    return rows * (static_cast<std::size_t>(hidden_ + padded_) * terms * sizeof(unsigned short) +
                   2 * static_cast<std::size_t>(padded_) * sizeof(float));
  }

 private:
  template <int T>
  void launch(const MoeWeights& w, const GroupedTile* tiles, int num_tiles, const std::int32_t* src, const std::int32_t* dst,
              const float* coef, const float* x, float* out, int rows, cudaStream_t stream) const noexcept {
    using namespace grouped_detail;
    split_x<T><<<static_cast<unsigned>(rows), 256, 0, stream>>>(x, src, hidden_, rows, xt_);
    w13<T><<<dim3(static_cast<unsigned>(2 * padded_ / 64), static_cast<unsigned>(num_tiles)), threads, 0, stream>>>(
        w, tiles, rows, hidden_, padded_, gscale_, xt_, h_);
    act<T><<<static_cast<unsigned>(rows), 256, 0, stream>>>(h_, rows, padded_, at_);
    grouped_detail::w2<T><<<dim3(static_cast<unsigned>(hidden_ / 64), static_cast<unsigned>(num_tiles)), threads, 0, stream>>>(
        w, tiles, rows, hidden_, padded_, gscale_, at_, coef, dst, out);
  }

  template <class T>
  static void alloc(T*& p, std::size_t bytes) {
    if (Status s = cuda_status(cudaMalloc(&p, bytes), "cudaMalloc"); !s) {
      p = nullptr;  // release() frees what was allocated before
      throw Error(s.with_context("GroupedMoe: %zu bytes", bytes));
    }
  }
  void release() noexcept {
    cudaFree(xt_);
    cudaFree(h_);
    cudaFree(at_);
  }

  Nvfp4Marlin layout_;
  int max_rows_;
  int max_tiles_;
  GroupedPrecision precision_;
  int hidden_ = 0;
  int padded_ = 0;
  float gscale_ = 1.0f;
  unsigned short* xt_ = nullptr;
  float* h_ = nullptr;
  unsigned short* at_ = nullptr;
};

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
