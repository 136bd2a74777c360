#pragma once
// A reference NVFP4 MoE consumer for small decode batches (1-16 tokens), reading the experts the
// cache made resident: through the forward map (global id -> slot) and the slot buffers, in the
// NVFP4-Marlin layout of layout/nvfp4_marlin.hpp (weight words, S0E5M3 block scales, per-slot
// fp32 global scales g'). Per token m and routed expert e (pair p = m * top_k + j):
//   C1  = x[m] . W13[slot]              (K -> 2Np; gate shard [0, Np), up shard [Np, 2Np))
//   A   = silu(C1[:Np]) * C1[Np:]       (padding rows are zero in W13, so A is zero there)
//   C3  = A . W2[slot]                  (Np -> K)
//   out[m] = sum_j topk_weight[p] * C3
// Dequant follows the kernel decode contract (spec §4.5): value = fp4 * 2^-B * s0e5m3(scale) * g'
// with B the activation dtype's bias; fp32 activations and accumulation (a reference, not a
// tensor-core GEMM). Pairs whose expert is -1, out of range or absent from the map contribute 0.
//
// Deterministic: no atomics; every sum has a fixed order, so a cached run and an all-resident
// run of the same weights give bit-identical outputs.
//
// Weight streaming (batch 1 is weight-bandwidth bound): one block per (64-column tile, slice of
// 16 K-rows, pair); each warp lane loads one 16-byte piece of a tile row (4 Marlin words: the
// words of lanes t, all four warps w), the eight row groups of a block load different rows.
#if !defined(__CUDACC__)
#error "expert_cache/device/moe_consumer.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/layout/tensor_bytes.hpp"
#include "expert_cache/status.hpp"

namespace expert_cache::device {

// Where the six tensors of a slot live and which slot holds an expert. Built from a cache's
// ForwardView (moe_weights_from_view) or from all-resident arrays (slot = expert, identity map).
struct MoeWeights {
  const unsigned char* base[num_expert_tensors] = {};
  unsigned long long stride[num_expert_tensors] = {};  // bytes from slot s to s + 1
  const std::int32_t* expert_map = nullptr;             // [num_experts]: slot or -1
  std::int32_t num_experts = 0;
};

template <class View>
MoeWeights moe_weights_from_view(const View& view, std::int32_t num_experts) noexcept {
  MoeWeights w;
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    w.base[t] = reinterpret_cast<const unsigned char*>(view.tensors[t].base);
    w.stride[t] = view.tensors[t].slot_stride;
  }
  w.expert_map = view.expert_map;
  w.num_experts = num_experts;
  return w;
}

// e2m1 code (sign bit 3) -> float, exact; integer ops and a select (no table).
EXPERT_CACHE_HOST_DEVICE inline float e2m1_decode(std::uint32_t code) noexcept {
  const std::uint32_t m = code & 7u;
  // m >= 2: exponent 126 + (m >> 1), mantissa bit m & 1 -> 1, 1.5, 2, 3, 4, 6; m = 1: 0.5.
  const std::uint32_t bits = (m >= 2u ? (m + 252u) << 22 : (m != 0u ? 0x3F000000u : 0u)) | ((code & 8u) << 28);
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// The nibble at bit `Shift` of `word` as the float e2m1 * 2^-126, exactly: the three magnitude
// bits land in the lowest float exponent bits and the top mantissa bit (e = 0 codes become float
// subnormals, just as e2m1's own subnormal), the sign bit in the sign. Four integer ops, no select:
// the inner loop's cost. Needs denormals (nvcc's default; not --use_fast_math / -ftz=true).
template <int Shift>
EXPERT_CACHE_HOST_DEVICE inline std::uint32_t e2m1_scaled_bits(std::uint32_t word) noexcept {
  const std::uint32_t mag = (Shift <= 22 ? word << (22 - Shift) : word >> (Shift - 22)) & 0x01C00000u;
  return mag | ((word << (28 - Shift)) & 0x80000000u);
}
inline constexpr float e2m1_scaled_unit = 0x1p-126f;  // e2m1_scaled_bits value = e2m1 * this

// S0E5M3 scale byte -> float, exact (= marlin::s0e5m3_value): bytes >= 8 are fp16 bits << 7,
// i.e. float exponent e16 + 112 and the top three mantissa bits.
EXPERT_CACHE_HOST_DEVICE inline float s0e5m3_decode(std::uint32_t b) noexcept {
  if (b < 8u) return static_cast<float>(b) * 7.62939453125e-06f;  // b * 2^-17 (fp16 subnormal)
  const std::uint32_t bits = (b + 896u) << 20;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

namespace moe_detail {

inline constexpr int rows_per_block = 16;  // K-rows (of 16 k) per block: the split-K slice
inline constexpr int row_groups = 8;       // warps per block, each on its own rows
inline constexpr int gemv_threads = 32 * row_groups;

__device__ __forceinline__ std::int32_t slot_of(const MoeWeights& w, const std::int32_t* ids, int p) {
  const std::int32_t e = ids[p];
  if (e < 0 || e >= w.num_experts) return -1;
  return w.expert_map[e];
}

// partial[p][split][n] = sum over this block's K-rows of in[k] * W(k, n) * s0e5m3(S[k/16][n])
// (fp4 decoded without 2^-B; the global scale and 2^-B are applied by the next kernel).
// Grid: (size_n / 64 tiles, splits, pairs).
template <int WeightTensor, int ScaleTensor>
__global__ void __launch_bounds__(gemv_threads)
    marlin_gemv_partial(MoeWeights w, const std::int32_t* ids,
                        const float* in, long long in_stride, int in_div, long long size_k, long long size_n,
                        float* partial) {
  const int p = static_cast<int>(blockIdx.z);
  const std::int32_t slot = slot_of(w, ids, p);
  if (slot < 0) return;  // never read: the reductions skip absent pairs
  const int nt = static_cast<int>(blockIdx.x);
  const int split = static_cast<int>(blockIdx.y);
  const int splits = static_cast<int>(gridDim.y);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int rg = static_cast<int>(threadIdx.x) >> 5;
  const long long rows = size_k / marlin::tile_k;
  const long long kt0 = static_cast<long long>(split) * rows_per_block;
  const long long kt1 = kt0 + rows_per_block < rows ? kt0 + rows_per_block : rows;

  const auto* words = reinterpret_cast<const uint4*>(w.base[WeightTensor] + static_cast<unsigned long long>(slot) * w.stride[WeightTensor]);
  const unsigned char* scales = w.base[ScaleTensor] + static_cast<unsigned long long>(slot) * w.stride[ScaleTensor];
  const float* x = in + static_cast<long long>(p / in_div) * in_stride;

  // Lane t holds words j = 128 nt + 4 t + w (w = 0..3) of every row: Marlin's (warp w, lane t).
  // Per marlin::weight_source: nibble i of word j is code (16 kt + r + dk(i), 64 nt + c + dn(i))
  // with r = 2 (t % 4), c = 16 w + t / 4, dk = (i & 4 ? 1 : 0) + (i & 1 ? 8 : 0), dn = i & 2 ? 8 : 0.
  const int r = 2 * (lane % 4);
  long long scale_col[4][2];
#pragma unroll
  for (int ww = 0; ww < 4; ++ww)
#pragma unroll
    for (int h = 0; h < 2; ++h) scale_col[ww][h] = marlin::scale_dest_col(64LL * nt + 16 * ww + lane / 4 + 8 * h);

  float acc[4][2] = {};
  const long long row_uint4 = 2 * size_n / 4;  // uint4 per K-row
  for (long long kt = kt0 + rg; kt < kt1; kt += row_groups) {
    const uint4 q = __ldg(&words[kt * row_uint4 + 32LL * nt + lane]);
    const long long k = kt * marlin::tile_k + r;
    // x * 2^64 times e2m1 * 2^-126 = x * e2m1 * 2^-62: normal floats (full precision) for any
    // |x * e2m1| > 2^-64; the 2^62 goes into the scale. Inputs must stay below 2^63 in magnitude.
    const float x0 = x[k] * 0x1p64f, x1 = x[k + 1] * 0x1p64f, x8 = x[k + 8] * 0x1p64f, x9 = x[k + 9] * 0x1p64f;
    const unsigned char* srow = scales + kt * size_n;
    const std::uint32_t qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int ww = 0; ww < 4; ++ww) {
      const std::uint32_t v = qw[ww];
      // h = 0: nibbles 0, 1, 4, 5 (k = r, r+8, r+1, r+9); h = 1: nibbles 2, 3, 6, 7.
      const float s0 = x0 * __uint_as_float(e2m1_scaled_bits<0>(v)) + x8 * __uint_as_float(e2m1_scaled_bits<4>(v)) +
                       x1 * __uint_as_float(e2m1_scaled_bits<16>(v)) + x9 * __uint_as_float(e2m1_scaled_bits<20>(v));
      const float s1 = x0 * __uint_as_float(e2m1_scaled_bits<8>(v)) + x8 * __uint_as_float(e2m1_scaled_bits<12>(v)) +
                       x1 * __uint_as_float(e2m1_scaled_bits<24>(v)) + x9 * __uint_as_float(e2m1_scaled_bits<28>(v));
      acc[ww][0] += s0 * (s0e5m3_decode(srow[scale_col[ww][0]]) * 0x1p62f);
      acc[ww][1] += s1 * (s0e5m3_decode(srow[scale_col[ww][1]]) * 0x1p62f);
    }
  }
  // The four lanes of a column group (t % 4 = 0..3) hold different k: sum them.
#pragma unroll
  for (int ww = 0; ww < 4; ++ww)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v = acc[ww][h];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      acc[ww][h] = v;
    }
  __shared__ float red[row_groups][64];
  if (lane % 4 == 0) {
#pragma unroll
    for (int ww = 0; ww < 4; ++ww)
#pragma unroll
      for (int h = 0; h < 2; ++h) red[rg][16 * ww + lane / 4 + 8 * h] = acc[ww][h];
  }
  __syncthreads();
  if (threadIdx.x < 64) {
    float sum = 0.0f;
#pragma unroll
    for (int g = 0; g < row_groups; ++g) sum += red[g][threadIdx.x];
    partial[(static_cast<long long>(p) * splits + split) * size_n + 64LL * nt + threadIdx.x] = sum;
  }
}

__device__ __forceinline__ float global_of(const MoeWeights& w, int tensor, std::int32_t slot) {
  float g;
  memcpy(&g, w.base[tensor] + static_cast<unsigned long long>(slot) * w.stride[tensor], sizeof g);
  return g;
}

// act[p][j] = silu(C1[j]) * C1[Np + j], C1 = (sum over splits) * g13' * 2^-B. Grid: pairs.
__global__ void moe_activation(MoeWeights w, const std::int32_t* ids, const float* partial, int splits,
                               long long padded, float unbias, float* act) {
  const int p = static_cast<int>(blockIdx.x);
  const std::int32_t slot = slot_of(w, ids, p);
  if (slot < 0) return;
  const float g = global_of(w, 4, slot) * unbias;
  const long long size_n = 2 * padded;
  for (long long j = threadIdx.x; j < padded; j += blockDim.x) {
    float gate = 0.0f, up = 0.0f;
    for (int s = 0; s < splits; ++s) {
      gate += partial[(static_cast<long long>(p) * splits + s) * size_n + j];
      up += partial[(static_cast<long long>(p) * splits + s) * size_n + padded + j];
    }
    gate *= g;
    up *= g;
    act[static_cast<long long>(p) * padded + j] = gate / (1.0f + expf(-gate)) * up;
  }
}

// out[m][n] = sum_j weight[p] * (sum over splits) * g2' * 2^-B. Grid: (ceil(K / block), tokens).
__global__ void moe_combine(MoeWeights w, const std::int32_t* ids, const float* topk_weights, int top_k,
                            const float* partial, int splits, long long hidden, float unbias, float* out) {
  const int m = static_cast<int>(blockIdx.y);
  const long long n = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= hidden) return;
  float sum = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    const int p = m * top_k + j;
    const std::int32_t slot = slot_of(w, ids, p);
    if (slot < 0) continue;
    float c = 0.0f;
    for (int s = 0; s < splits; ++s) c += partial[(static_cast<long long>(p) * splits + s) * hidden + n];
    sum += topk_weights[p] * (c * (global_of(w, 5, slot) * unbias));
  }
  out[static_cast<long long>(m) * hidden + n] = sum;
}

}  // namespace moe_detail

// Owns the workspace for up to `max_tokens` tokens of `top_k` experts; run() enqueues four
// kernels on `stream`. Inputs and outputs are device pointers: ids and weights [tokens * top_k],
// x and out [tokens, hidden] fp32.
class MoeConsumer {
 public:
  MoeConsumer(const Nvfp4Marlin& layout, int max_tokens, int top_k) : layout_(layout), max_tokens_(max_tokens), top_k_(top_k) {
    throw_if_error(layout.validate());
    if (max_tokens < 1 || top_k < 1) throw Error(ErrorCode::invalid_argument, "MoeConsumer: max_tokens and top_k must be >= 1");
    const long long pairs = static_cast<long long>(max_tokens) * top_k;
    splits1_ = splits(layout.w13_gemm().size_k);
    splits2_ = splits(layout.w2_gemm().size_k);
    const std::size_t bytes1 = static_cast<std::size_t>(pairs * splits1_ * layout.w13_gemm().size_n) * sizeof(float);
    const std::size_t bytes_act = static_cast<std::size_t>(pairs * layout.padded_intermediate()) * sizeof(float);
    const std::size_t bytes2 = static_cast<std::size_t>(pairs * splits2_ * layout.w2_gemm().size_n) * sizeof(float);
    alloc(part1_, bytes1);
    alloc(act_, bytes_act);
    alloc(part2_, bytes2);
    unbias_ = marlin::exp2i(-marlin::dtype_bias(layout.dtype));
  }
  MoeConsumer(const MoeConsumer&) = delete;
  MoeConsumer& operator=(const MoeConsumer&) = delete;
  ~MoeConsumer() {
    cudaFree(part1_);
    cudaFree(act_);
    cudaFree(part2_);
  }

  [[nodiscard]] Status run(const MoeWeights& w, const std::int32_t* ids, const float* topk_weights, const float* x,
                           float* out, int tokens, cudaStream_t stream) const noexcept {
    if (tokens < 1 || tokens > max_tokens_) {
      return Status(ErrorCode::invalid_argument, "MoeConsumer::run: tokens " + std::to_string(tokens) +
                                                     " outside [1, " + std::to_string(max_tokens_) + "]");
    }
    const auto g13 = layout_.w13_gemm(), g2 = layout_.w2_gemm();
    const unsigned pairs = static_cast<unsigned>(tokens * top_k_);
    const long long padded = layout_.padded_intermediate();
    moe_detail::marlin_gemv_partial<0, 2><<<dim3(static_cast<unsigned>(g13.size_n / 64), static_cast<unsigned>(splits1_), pairs),
                                            moe_detail::gemv_threads, 0, stream>>>(
        w, ids, x, layout_.hidden, top_k_, g13.size_k, g13.size_n, part1_);
    moe_detail::moe_activation<<<pairs, 256, 0, stream>>>(w, ids, part1_, splits1_, padded, unbias_, act_);
    moe_detail::marlin_gemv_partial<1, 3><<<dim3(static_cast<unsigned>(g2.size_n / 64), static_cast<unsigned>(splits2_), pairs),
                                            moe_detail::gemv_threads, 0, stream>>>(w, ids, act_, padded, 1, g2.size_k,
                                                                             g2.size_n, part2_);
    moe_detail::moe_combine<<<dim3(static_cast<unsigned>((layout_.hidden + 255) / 256), static_cast<unsigned>(tokens)), 256, 0,
                              stream>>>(w, ids, topk_weights, top_k_, part2_, splits2_, layout_.hidden, unbias_, out);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      return Status(ErrorCode::runtime_failure, std::string("MoeConsumer::run: launch failed: ") + cudaGetErrorName(err) +
                                                    ": " + cudaGetErrorString(err));
    }
    return {};
  }

  [[nodiscard]] int top_k() const noexcept { return top_k_; }
  [[nodiscard]] int max_tokens() const noexcept { return max_tokens_; }

 private:
  static int splits(long long size_k) noexcept {
    const long long rows = size_k / marlin::tile_k;
    return static_cast<int>((rows + moe_detail::rows_per_block - 1) / moe_detail::rows_per_block);
  }
  static void alloc(float*& p, std::size_t bytes) {
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error(ErrorCode::runtime_failure, std::string("MoeConsumer: cudaMalloc(") + std::to_string(bytes) +
                                                  ") failed: " + cudaGetErrorString(err));
    }
  }

  Nvfp4Marlin layout_;
  int max_tokens_;
  int top_k_;
  int splits1_ = 1;
  int splits2_ = 1;
  float unbias_ = 1.0f;
  float* part1_ = nullptr;
  float* act_ = nullptr;
  float* part2_ = nullptr;
};

}  // namespace expert_cache::device
