#pragma once
/// The CUDA kernels of the NVFP4 -> Marlin repack of a whole MoE layer and the pointer and argument
/// types they take; repack/cuda_repack.cuh validates the inputs and launches them (needs nvcc).
//
// The tiled kernel is the fast path (the whole layer in one launch); the generic kernels take any
// alignment; the statistics kernel validates the scales and computes the layer-wide factors in one
// read-only pass. They evaluate the same index maps and encodes as the host repack
// (repack/host_repack.hpp), so GPU and host outputs are byte-identical.
#if !defined(__CUDACC__)
#error "expert_cache/kernels/marlin_repack.cuh needs nvcc; host code can use repack/host_repack.hpp"
#endif

#include <cuda_pipeline_primitives.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstddef>
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

// Pointers to a contiguous run of experts in the checkpoint layout (see layout/nvfp4_layer.hpp).
struct Nvfp4CheckpointPtrs {
  const std::uint8_t* w13 = nullptr;
  const std::uint8_t* w13_scale = nullptr;
  const float* w13_scale_2 = nullptr;  // [E, 2]
  const std::uint8_t* w2 = nullptr;
  const std::uint8_t* w2_scale = nullptr;
  const float* w2_scale_2 = nullptr;  // [E]
};

// Pointers to a contiguous run of experts in the Marlin layout.
struct Nvfp4MarlinPtrs {
  std::uint32_t* w13 = nullptr;
  std::uint32_t* w2 = nullptr;
  std::uint8_t* w13_scale = nullptr;
  std::uint8_t* w2_scale = nullptr;
  float* w13_scale_2 = nullptr;  // [E]
  float* w2_scale_2 = nullptr;   // [E]
};

namespace detail {

// Everything a repack kernel needs, trivially copyable.
struct RepackArgs {
  std::int64_t hidden = 0;        // K
  std::int64_t intermediate = 0;  // N
  std::int64_t padded = 0;        // Np
  std::int64_t num_experts = 0;   // experts in this launch
  int w13_log2_sf = 0;
  int w2_log2_sf = 0;
  ActDtype dtype = ActDtype::bf16;
};

inline constexpr int block_threads = 256;

inline int grid_for(std::int64_t work) {
  return static_cast<int>(std::min<std::int64_t>((work + block_threads - 1) / block_threads, 16384));
}

enum : int { w13_tensor = 0, w2_tensor = 1 };

// ---------------------------------------------------------------------------------------------
// The tiled kernel (the fast path): the whole layer in ONE launch. Both repacks are transposes:
// the checkpoint is n-major (one row per GEMM output column, packed along k), Marlin is k-major.
// A block task is (tensor, expert, 64-column strip nt, run of RunTiles 16-k tiles). Since a
// weight tile and a scale group both span 16 k, the task's weight tiles and its scale groups
// come from the same 64 source rows: the block stages both in shared memory with coalesced loads
// and writes whole output tiles (weights) and 64-byte output rows (scales) with coalesced stores.
// Rows in the w13 shard padding and k beyond N in w2 read as zero. Grid-stride blocks copy the
// next task's bytes into shared memory (cp.async) while they write the current task, so loads
// stay in flight without holding registers.

// Measured on the H200 (bench_repack, E64 K2048 N512): 32-tile runs, 2 stages, 8 blocks per SM
// in the grid beat 16-tile runs with 2-4 stages and 8-tile runs, at 4-8 blocks per SM; a
// register-prefetch version of the same kernel reached 0.75 of the D2D copy, this one 0.87.
inline constexpr int tiled_run_tiles = 32;  // 16-k tiles per task: 256 weight bytes per source row
inline constexpr int tiled_grid_per_sm = 8; // blocks launched per SM (more than are resident at once)
inline constexpr int tiled_min_blocks = 5;  // resident blocks per SM the register budget allows

// The kernel is instruction-bound before it is memory-bound, so everything a task needs beyond
// its own indices is precomputed on the host, and task decoding uses 32-bit arithmetic (the
// launcher checks the task count fits).
struct TiledTensorConsts {
  int runs = 0;             // task runs along k: ceil(k_tiles / RunTiles)
  int n_tiles = 0;          // 64-column strips
  int k_tiles = 0;          // 16-k tiles of the GEMM operand (padding included)
  int source_tiles = 0;     // leading k-tiles with a checkpoint source (w2: N / 16)
  int row_bytes = 0;        // checkpoint code bytes per source row
  int scale_row_bytes = 0;  // checkpoint scale bytes per source row
  int size_n = 0;
};

struct TiledConsts {
  TiledTensorConsts tensor[2];
  int w13_tasks = 0;
  int tasks = 0;
  bool scale_words[2] = {};  // scale rows allow 4-byte async copies (row bytes % 4 == 0 and aligned)
};

inline TiledConsts tiled_consts(const Nvfp4Marlin& layout, std::int64_t num_experts, int run_tiles) {
  TiledConsts c;
  const MarlinGemmShape shapes[2] = {layout.w13_gemm(), layout.w2_gemm()};
  const std::int64_t source_k[2] = {layout.hidden, layout.intermediate};
  std::int64_t tasks[2] = {};
  for (int t = 0; t < 2; ++t) {
    TiledTensorConsts& x = c.tensor[t];
    x.k_tiles = static_cast<int>(shapes[t].rows());
    x.runs = (x.k_tiles + run_tiles - 1) / run_tiles;
    x.n_tiles = static_cast<int>(shapes[t].size_n / marlin::tile_n);
    x.source_tiles = static_cast<int>(source_k[t] / marlin::tile_k);
    x.row_bytes = static_cast<int>(source_k[t] / 2);
    x.scale_row_bytes = static_cast<int>(source_k[t] / marlin::group_size);
    x.size_n = static_cast<int>(shapes[t].size_n);
    tasks[t] = num_experts * x.n_tiles * x.runs;
  }
  // Sizes are <= 2^20 (Nvfp4Marlin::validate), so only the task count can exceed 32 bits.
  const std::int64_t total = tasks[0] + tasks[1];
  c.w13_tasks = static_cast<int>(std::min<std::int64_t>(tasks[0], INT32_MAX));
  c.tasks = total > INT32_MAX ? -1 : static_cast<int>(total);
  return c;
}

// One block task: (tensor, expert, 64-column strip, run of k-tiles). A strip never straddles
// the w13 shards (Np is a multiple of 64), so its source is one contiguous run of checkpoint rows
// followed by zero rows (shard padding); along k, w2's source ends at N (Np > N is padding, in
// whole 16-k tiles since N % 16 == 0).
struct StripTask {
  int tensor = w13_tensor;
  int expert = 0;
  int strip = 0;
  int first = 0;         // first k-tile (= scale group) of the run
  int count = 0;         // k-tiles in the run
  int valid_rows = 0;    // strip rows [0, valid_rows) have a checkpoint source
  int valid_count = 0;   // run tiles [0, valid_count) have a checkpoint source
  std::int64_t row = 0;  // checkpoint row of strip row 0 (experts stacked)
};

// Field-wise select: indexing the kernel-parameter array with a runtime index made nvcc copy
// the whole parameter block to local memory.
__device__ __forceinline__ TiledTensorConsts pick(const TiledConsts& c, int tensor) {
  const TiledTensorConsts &a = c.tensor[w13_tensor], &b = c.tensor[w2_tensor];
  const bool w13 = tensor == w13_tensor;
  TiledTensorConsts x;
  x.runs = w13 ? a.runs : b.runs;
  x.n_tiles = w13 ? a.n_tiles : b.n_tiles;
  x.k_tiles = w13 ? a.k_tiles : b.k_tiles;
  x.source_tiles = w13 ? a.source_tiles : b.source_tiles;
  x.row_bytes = w13 ? a.row_bytes : b.row_bytes;
  x.scale_row_bytes = w13 ? a.scale_row_bytes : b.scale_row_bytes;
  x.size_n = w13 ? a.size_n : b.size_n;
  return x;
}

// Sizes come from RepackArgs as 32-bit values (<= 2^20 by Nvfp4Marlin::validate).
template <int RunTiles>
__device__ __forceinline__ StripTask strip_task(const RepackArgs& a, const TiledConsts& c, int task) {
  StripTask s;
  s.tensor = task < c.w13_tasks ? w13_tensor : w2_tensor;
  const TiledTensorConsts x = pick(c, s.tensor);
  const int local = task - (s.tensor == w13_tensor ? 0 : c.w13_tasks);
  const int run = local % x.runs, rest = local / x.runs;
  s.strip = rest % x.n_tiles;
  s.expert = rest / x.n_tiles;
  s.first = run * RunTiles;
  s.count = min(RunTiles, x.k_tiles - s.first);
  s.valid_count = max(0, min(s.count, x.source_tiles - s.first));
  const int n0 = 64 * s.strip;
  const int intermediate = static_cast<int>(a.intermediate), padded = static_cast<int>(a.padded);
  if (s.tensor == w13_tensor) {
    const int shard = n0 >= padded ? 1 : 0, in_shard = n0 - shard * padded;
    s.row = std::int64_t{s.expert} * 2 * intermediate + shard * intermediate + in_shard;
    s.valid_rows = max(0, min(64, intermediate - in_shard));
  } else {
    s.row = std::int64_t{s.expert} * static_cast<int>(a.hidden) + n0;
    s.valid_rows = 64;
  }
  return s;
}

// Shared-memory stage of one task: the strip's weight bytes ([row][tile], rows padded by 8 B so
// rows 8 apart fall in different banks) and its scale bytes ([row][group], untransposed).
template <int RunTiles>
struct TiledStage {
  static constexpr int weight_row = RunTiles * 8 + 8;
  static constexpr int scale_row = RunTiles + 4;
  __align__(16) unsigned char weights[64 * weight_row];
  __align__(16) std::uint8_t scales[64 * scale_row];
};

// Scale bytes a thread loads with plain loads for the NEXT stage when the scale rows do not allow
// 4-byte async copies (w2 with N % 64 != 0): held in registers and written to shared memory one
// iteration later, so their latency is hidden like the cp.async copies'.
template <int RunTiles>
struct PendingScales {
  static constexpr int words = 64 * (RunTiles / 4) / block_threads;
  std::uint8_t bytes[words][4];
  bool active = false;
};

// Issues the copies of task `t` into `stage` (cp.async: no registers held while in flight).
// Weight piece j of a thread: strip row tid / RunTiles + j * (256 / RunTiles), tile
// tid % RunTiles, so a warp reads whole source rows' contiguous bytes. Scales: 4-byte copies when
// the source rows allow (`c.scale_words`), else plain byte loads into `pending`. Rows and tiles
// without a checkpoint source are zero-filled.
template <int RunTiles>
__device__ __forceinline__ void issue_task(const Nvfp4CheckpointPtrs& src, const TiledConsts& c, const StripTask& t,
                                           int tid, TiledStage<RunTiles>& stage, PendingScales<RunTiles>& pending) {
  using Stage = TiledStage<RunTiles>;
  constexpr int pieces = 64 * RunTiles / block_threads;
  constexpr int rows_per_pass = block_threads / RunTiles;
  const TiledTensorConsts x = pick(c, t.tensor);
  const bool w13 = t.tensor == w13_tensor;
  const std::uint8_t* weights = (w13 ? src.w13 : src.w2) + t.row * x.row_bytes + t.first * 8;
  const std::uint8_t* scales = (w13 ? src.w13_scale : src.w2_scale) + t.row * x.scale_row_bytes + t.first;
  {
    const int row0 = tid / RunTiles, piece = tid % RunTiles;
    const bool piece_valid = piece < t.valid_count;
#pragma unroll
    for (int j = 0; j < pieces; ++j) {
      const int row = row0 + j * rows_per_pass;
      unsigned char* to = stage.weights + row * Stage::weight_row + piece * 8;
      if (piece_valid && row < t.valid_rows)
        __pipeline_memcpy_async(to, weights + row * x.row_bytes + piece * 8, 8);
      else
        *reinterpret_cast<uint2*>(to) = make_uint2(0u, 0u);
    }
  }
  constexpr int words_per_row = RunTiles / 4;
  pending.active = !(w13 ? c.scale_words[0] : c.scale_words[1]);
#pragma unroll
  for (int j = 0; j < PendingScales<RunTiles>::words; ++j) {
    const int i = tid + j * block_threads, row = i / words_per_row, word = i % words_per_row;
    const int valid_bytes = row < t.valid_rows ? max(0, min(4, t.valid_count - 4 * word)) : 0;
    const std::uint8_t* from = scales + row * x.scale_row_bytes + 4 * word;
    if (pending.active) {
#pragma unroll
      for (int b = 0; b < 4; ++b) pending.bytes[j][b] = b < valid_bytes ? __ldg(from + b) : std::uint8_t{0};
    } else {
      // Word-aligned rows: valid_bytes is 0 or 4 (the row length and the run starts are multiples of 4).
      std::uint8_t* to = stage.scales + row * Stage::scale_row + 4 * word;
      if (valid_bytes == 4)
        __pipeline_memcpy_async(to, from, 4);
      else
        *reinterpret_cast<std::uint32_t*>(to) = 0u;
    }
  }
}

// Writes the plain-loaded scale bytes of the task whose copies were issued into `stage`.
template <int RunTiles>
__device__ __forceinline__ void land_pending(const PendingScales<RunTiles>& pending, int tid, TiledStage<RunTiles>& stage) {
  if (!pending.active) return;
  constexpr int words_per_row = RunTiles / 4;
#pragma unroll
  for (int j = 0; j < PendingScales<RunTiles>::words; ++j) {
    const int i = tid + j * block_threads, row = i / words_per_row, word = i % words_per_row;
    const std::uint32_t v = std::uint32_t{pending.bytes[j][0]} | std::uint32_t{pending.bytes[j][1]} << 8 |
                            std::uint32_t{pending.bytes[j][2]} << 16 | std::uint32_t{pending.bytes[j][3]} << 24;
    *reinterpret_cast<std::uint32_t*>(stage.scales + row * TiledStage<RunTiles>::scale_row + 4 * word) = v;
  }
}

/// @brief The tiled repack: every task of the launch's experts, both tensors, in one grid.
/// Needs 8-byte aligned weight sources, 16-byte aligned weight outputs and 4-byte aligned scale
/// outputs, and a task count that fits 32 bits (the launcher checks). Grid-stride blocks run a
/// two-stage cp.async pipeline over their tasks: while a block writes task k, the copies of its
/// next task are in flight.
/// @tparam RunTiles 16-k tiles per task (tiled_run_tiles).
/// @param src The checkpoint tensors of the launch's experts.
/// @param dst The Marlin tensors they are written to.
/// @param a Sizes, expert count and the layer-wide scale factors.
/// @param c The tasks' geometry (tiled_consts) and whether scale rows allow 4-byte async copies.
template <int RunTiles>
EXPERT_CACHE_KERNEL void __launch_bounds__(block_threads, tiled_min_blocks)
    marlin_repack_tiled_kernel(Nvfp4CheckpointPtrs src, Nvfp4MarlinPtrs dst, RepackArgs a, TiledConsts c) {
  using Stage = TiledStage<RunTiles>;
  static_assert(block_threads == 256 && 64 * RunTiles % block_threads == 0 && RunTiles % 4 == 0,
                "one encode-table entry per thread; whole weight pieces and scale words per thread");
  __shared__ Stage stages[2];
  __shared__ std::uint8_t encode[2][256];
  const int tid = static_cast<int>(threadIdx.x);
  encode[w13_tensor][tid] = marlin::s0e5m3_from_e4m3(static_cast<std::uint8_t>(tid), a.w13_log2_sf);
  encode[w2_tensor][tid] = marlin::s0e5m3_from_e4m3(static_cast<std::uint8_t>(tid), a.w2_log2_sf);

  // Per-thread constants of the write phase.
  const int lane = tid % 32, warp = tid / 32;
  const int byte_select = (lane % 4) | ((lane % 4 + 4) << 4);  // bytes t%4 of .x and .y: k = r and r + 8
  const int lane_row = lane / 4;
  const int quad = tid % 16, scale_g0 = tid / 16;
  int scale_src[4];
#pragma unroll
  for (int b = 0; b < 4; ++b) scale_src[b] = static_cast<int>(marlin::scale_source_col(4 * quad + b)) * Stage::scale_row;

  // Prologue: task blockIdx.x goes to stage 0. Every iteration commits one group (empty when
  // the block has no further task), so the wait count is uniform.
  const int stride = static_cast<int>(gridDim.x);
  const int first_task = static_cast<int>(blockIdx.x);
  PendingScales<RunTiles> pending;
  if (first_task < c.tasks) issue_task<RunTiles>(src, c, strip_task<RunTiles>(a, c, first_task), tid, stages[0], pending);
  __pipeline_commit();
  int stage = 0;
  for (int task = first_task; task < c.tasks; task += stride) {
    land_pending<RunTiles>(pending, tid, stages[stage]);
    __pipeline_wait_prior(0);  // this thread's copies for `task` have landed
    __syncthreads();           // everyone's have; and the other stage is free again
    {
      const int ahead = task + stride;
      pending.active = false;
      if (ahead < c.tasks) issue_task<RunTiles>(src, c, strip_task<RunTiles>(a, c, ahead), tid, stages[stage ^ 1], pending);
      __pipeline_commit();
    }
    const StripTask cur = strip_task<RunTiles>(a, c, task);
    const Stage& st = stages[stage];
    const bool w13 = cur.tensor == w13_tensor;
    const TiledTensorConsts x = pick(c, cur.tensor);
    const std::int64_t first_row = std::int64_t{cur.expert} * x.k_tiles + cur.first;  // output k-tile row
    // Weights: warp `piece` of a pass builds tile `piece`; lane t the words of lane t for all
    // four warps w (output words 4t .. 4t+3, one 16-byte store).
    std::uint32_t* out_w = (w13 ? dst.w13 : dst.w2) + first_row * 2 * x.size_n + marlin::words_per_tile * cur.strip + 4 * lane;
    for (int piece = warp; piece < cur.count; piece += block_threads / 32) {
      const unsigned char* col = st.weights + lane_row * Stage::weight_row + piece * 8;
      std::uint32_t words[4];
#pragma unroll
      for (int ww = 0; ww < 4; ++ww) {
        const uint2 c0 = *reinterpret_cast<const uint2*>(col + (16 * ww) * Stage::weight_row);
        const uint2 c8 = *reinterpret_cast<const uint2*>(col + (16 * ww + 8) * Stage::weight_row);
        const std::uint32_t quad_bytes =
            __byte_perm(__byte_perm(c0.x, c0.y, byte_select), __byte_perm(c8.x, c8.y, byte_select), 0x5410);
        words[ww] = marlin::weight_word_from_quad(quad_bytes);
      }
      // __stcs: an explicit 16-byte streaming store (a plain uint4 assignment was split into four
      // 4-byte stores, quadrupling the L2 write sectors).
      __stcs(reinterpret_cast<uint4*>(out_w + std::int64_t{piece} * 2 * x.size_n), make_uint4(words[0], words[1], words[2], words[3]));
    }
    // Scales: output row g of the run is 64 bytes = 16 words; byte col takes column scale_source_col(col).
    std::uint8_t* out_s = (w13 ? dst.w13_scale : dst.w2_scale) + first_row * x.size_n + 64 * cur.strip + 4 * quad;
    const std::uint8_t* table = encode[cur.tensor];
    for (int g = scale_g0; g < cur.count; g += block_threads / 16) {
      const std::uint8_t* col = st.scales + g;
      const std::uint32_t word = std::uint32_t{table[col[scale_src[0]]]} | std::uint32_t{table[col[scale_src[1]]]} << 8 |
                                 std::uint32_t{table[col[scale_src[2]]]} << 16 | std::uint32_t{table[col[scale_src[3]]]} << 24;
      __stcs(reinterpret_cast<unsigned int*>(out_s + std::int64_t{g} * x.size_n), word);
    }
    // Global scales (docs/nvfp4_marlin.md, Encodes), once per expert: with its first w13 task.
    if (w13 && cur.strip == 0 && cur.first == 0 && tid == 0) {
      dst.w13_scale_2[cur.expert] = marlin::global_scale(src.w13_scale_2[2 * cur.expert], a.w13_log2_sf, a.dtype);
      dst.w2_scale_2[cur.expert] = marlin::global_scale(src.w2_scale_2[cur.expert], a.w2_log2_sf, a.dtype);
    }
    stage ^= 1;
  }
  __pipeline_wait_prior(0);  // leave no copy in flight into shared memory at exit
}

// A grid-stride grid of tiled_grid_per_sm blocks per SM, at most `tasks`.
inline int tiled_grid(int tasks, int sm_count) { return std::min(tasks, tiled_grid_per_sm * std::max(sm_count, 1)); }

inline bool aligned(const void* p, std::size_t to) { return reinterpret_cast<std::uintptr_t>(p) % to == 0; }

// ---------------------------------------------------------------------------------------------
// Generic kernels: any alignment, one thread per output element. Used when a pointer does not
// meet the tiled kernels' alignment (e.g. a tensor view at an odd byte offset).

/// @brief One thread per output int32 word (grid-stride); each gathers its eight codes (docs/nvfp4_marlin.md, Maps).
/// @tparam Tensor w13_tensor or w2_tensor.
/// @param src The checkpoint tensors of the launch's experts.
/// @param dst The Marlin tensors they are written to.
/// @param a Sizes, expert count and the layer-wide scale factors.
template <int Tensor>
EXPERT_CACHE_KERNEL void marlin_weights_kernel(Nvfp4CheckpointPtrs src, Nvfp4MarlinPtrs dst, RepackArgs a) {
  const std::int64_t size_k = Tensor == w13_tensor ? a.hidden : a.padded;
  const std::int64_t size_n = Tensor == w13_tensor ? 2 * a.padded : a.hidden;
  const std::int64_t per_row = 2 * size_n;
  const std::int64_t per_expert = size_k / marlin::tile_k * per_row;
  const std::int64_t total = per_expert * a.num_experts;
  for (std::int64_t idx = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; idx < total;
       idx += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t e = idx / per_expert, w = idx % per_expert;
    if constexpr (Tensor == w13_tensor) {
      const marlin::W13Codes q{src.w13 + e * a.intermediate * a.hidden, a.hidden, a.intermediate, a.padded};
      dst.w13[idx] = marlin::weight_word(q, w / per_row, w % per_row);
    } else {
      const marlin::W2Codes q{src.w2 + e * a.hidden * a.intermediate / 2, a.hidden, a.intermediate};
      dst.w2[idx] = marlin::weight_word(q, w / per_row, w % per_row);
    }
  }
}

/// @brief One thread per output scale byte (docs/nvfp4_marlin.md, Maps and Encodes): permuted source, then the S0E5M3
///        encode.
/// @tparam Tensor w13_tensor or w2_tensor.
/// @param src The checkpoint tensors of the launch's experts.
/// @param dst The Marlin tensors they are written to.
/// @param a Sizes, expert count and the layer-wide scale factors.
template <int Tensor>
EXPERT_CACHE_KERNEL void marlin_scales_kernel(Nvfp4CheckpointPtrs src, Nvfp4MarlinPtrs dst, RepackArgs a) {
  const std::int64_t size_k = Tensor == w13_tensor ? a.hidden : a.padded;
  const std::int64_t size_n = Tensor == w13_tensor ? 2 * a.padded : a.hidden;
  const std::int64_t per_expert = size_k / marlin::group_size * size_n;
  const std::int64_t total = per_expert * a.num_experts;
  for (std::int64_t idx = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; idx < total;
       idx += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t e = idx / per_expert, b = idx % per_expert;
    const std::int64_t g = b / size_n, n = marlin::scale_source_col(b % size_n);
    if constexpr (Tensor == w13_tensor) {
      const marlin::W13Scales s{src.w13_scale + e * 2 * a.intermediate * (a.hidden / marlin::group_size), a.hidden,
                                a.intermediate, a.padded};
      dst.w13_scale[idx] = marlin::s0e5m3_from_e4m3(s(g, n), a.w13_log2_sf);
    } else {
      const marlin::W2Scales s{src.w2_scale + e * a.hidden * (a.intermediate / marlin::group_size), a.hidden,
                               a.intermediate};
      dst.w2_scale[idx] = marlin::s0e5m3_from_e4m3(s(g, n), a.w2_log2_sf);
    }
  }
}

/// @brief Global scales (docs/nvfp4_marlin.md, Encodes); w13 uses column 0 of [E, 2].
/// @param src The checkpoint tensors of the launch's experts.
/// @param dst The Marlin tensors they are written to.
/// @param a Sizes, expert count and the layer-wide scale factors.
template <class = void>
EXPERT_CACHE_KERNEL void marlin_globals_kernel(Nvfp4CheckpointPtrs src, Nvfp4MarlinPtrs dst, RepackArgs a) {
  for (std::int64_t e = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < a.num_experts;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    dst.w13_scale_2[e] = marlin::global_scale(src.w13_scale_2[2 * e], a.w13_log2_sf, a.dtype);
    dst.w2_scale_2[e] = marlin::global_scale(src.w2_scale_2[e], a.w2_log2_sf, a.dtype);
  }
}

// Layer statistics for validation and the scale factors, all in one read-only pass. The "first_*"
// slots hold the smallest offending element index (all ones when none), so errors name an element.
enum StatSlot : int {
  stat_max13 = 0,       // max positive e4m3 byte of all w13 scales
  stat_max2,            // same for w2
  stat_mismatches,      // experts whose w1 and w3 globals differ
  stat_first_bad13,     // first NaN or negative w13 block scale (byte index in the layer)
  stat_first_bad2,      // same for w2
  stat_first_bad_g13,   // first NaN, infinite or negative w13_scale_2 element
  stat_first_bad_g2,    // same for w2_scale_2
  stat_first_mismatch,  // first expert whose w1 and w3 globals differ
  stat_count
};
inline constexpr int stat_first_slot = stat_first_bad13;
inline constexpr unsigned long long stat_none = ~0ull;

__device__ inline bool bad_global(float g) { return !(g >= 0.0f && g <= FLT_MAX); }

/// @brief The read-only statistics pass over the scale tensors of `num_experts` experts: the
/// StatSlot values, combined into `stats` with one atomic per block and statistic.
/// @param src Points at expert `expert_base` of the layer; indices are reported layer-wide.
/// @param n13 w13 block-scale bytes to read (num_experts experts).
/// @param n2 w2 block-scale bytes to read.
/// @param num_experts Experts whose global scales are read.
/// @param expert_base The layer index of the first expert of `src`.
/// @param scale13_per_expert w13 block-scale bytes per expert.
/// @param scale2_per_expert w2 block-scale bytes per expert.
/// @param stats Device array [stat_count], initialised by reset_stats.
template <class = void>
EXPERT_CACHE_KERNEL void nvfp4_stats_kernel(Nvfp4CheckpointPtrs src, std::int64_t n13, std::int64_t n2,
                                   std::int64_t num_experts, std::int64_t expert_base, std::int64_t scale13_per_expert,
                                   std::int64_t scale2_per_expert, unsigned long long* stats) {
  unsigned long long max13 = 0, max2 = 0, mismatches = 0;
  unsigned long long bad13 = stat_none, bad2 = stat_none, bad_g13 = stat_none, bad_g2 = stat_none,
                     first_mismatch = stat_none;
  const std::int64_t stride = std::int64_t{gridDim.x} * blockDim.x;
  const std::int64_t first = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const auto at = [](std::int64_t base, std::int64_t i) { return static_cast<unsigned long long>(base + i); };
  for (std::int64_t i = first; i < n13; i += stride) {
    const std::uint8_t b = __ldg(src.w13_scale + i);
    if (marlin::is_bad_e4m3_scale(b)) bad13 = min(bad13, at(expert_base * scale13_per_expert, i));
    if (marlin::is_positive_e4m3(b)) max13 = max(max13, static_cast<unsigned long long>(b));
  }
  for (std::int64_t i = first; i < n2; i += stride) {
    const std::uint8_t b = __ldg(src.w2_scale + i);
    if (marlin::is_bad_e4m3_scale(b)) bad2 = min(bad2, at(expert_base * scale2_per_expert, i));
    if (marlin::is_positive_e4m3(b)) max2 = max(max2, static_cast<unsigned long long>(b));
  }
  for (std::int64_t e = first; e < num_experts; e += stride) {
    const float g1 = src.w13_scale_2[2 * e], g3 = src.w13_scale_2[2 * e + 1], g2 = src.w2_scale_2[e];
    if (bad_global(g1)) bad_g13 = min(bad_g13, at(2 * expert_base, 2 * e));
    else if (bad_global(g3)) bad_g13 = min(bad_g13, at(2 * expert_base, 2 * e + 1));
    if (bad_global(g2)) bad_g2 = min(bad_g2, at(expert_base, e));
    if (g1 != g3) {
      ++mismatches;
      first_mismatch = min(first_mismatch, at(expert_base, e));
    }
  }
  // Reduce in the block first (warp shuffles, then one warp over the warps' results), so each
  // block issues at most one atomic per statistic: per-thread atomics on one address serialise.
  unsigned long long v[stat_count] = {max13, max2, mismatches, bad13, bad2, bad_g13, bad_g2, first_mismatch};
  const auto combine = [](int slot, unsigned long long x, unsigned long long y) {
    return slot == stat_mismatches ? x + y : slot < stat_first_slot ? max(x, y) : min(x, y);
  };
#pragma unroll
  for (int slot = 0; slot < stat_count; ++slot)
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v[slot] = combine(slot, v[slot], __shfl_xor_sync(0xffffffffu, v[slot], off));
  __shared__ unsigned long long per_warp[block_threads / 32][stat_count];
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  if (lane == 0)
#pragma unroll
    for (int slot = 0; slot < stat_count; ++slot) per_warp[warp][slot] = v[slot];
  __syncthreads();
  if (threadIdx.x < stat_count) {
    const int slot = static_cast<int>(threadIdx.x);
    unsigned long long x = per_warp[0][slot];
    for (int w = 1; w < block_threads / 32; ++w) x = combine(slot, x, per_warp[w][slot]);
    const bool neutral = slot < stat_first_slot ? x == 0 : x == stat_none;
    if (!neutral) {
      if (slot == stat_mismatches) atomicAdd(&stats[slot], x);
      else if (slot < stat_first_slot) atomicMax(&stats[slot], x);
      else atomicMin(&stats[slot], x);
    }
  }
}

}  // namespace detail

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
