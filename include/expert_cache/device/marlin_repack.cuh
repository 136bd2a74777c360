#pragma once
// CUDA kernels for the NVFP4 -> Marlin repack of a whole MoE layer (needs nvcc).
//
//  * repack_layer_device: sources and outputs in device memory, one pass over all experts.
//  * repack_layer_host_chunked: sources and outputs in (pinned) host memory; the layer-wide scale
//    factors are computed on the host over all experts first, then `expert_chunk` experts at a
//    time are copied to the GPU, repacked and copied back (GPU peak = one chunk, spec §4.7).
// Both run the same kernels with the same factors, so their outputs are byte-identical, and the
// kernels evaluate the same index maps and encodes as the host reference (nvfp4_reference.hpp).
// Launchers validate everything before the first write to an output and return Status; every
// CUDA call is checked.
#if !defined(__CUDACC__)
#error "expert_cache/device/marlin_repack.cuh needs nvcc; host code can use layout/nvfp4_reference.hpp"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <string>

#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/layout/nvfp4_reference.hpp"
#include "expert_cache/status.hpp"

namespace expert_cache::device {

// Pointers to a contiguous run of experts in the checkpoint layout (see nvfp4_reference.hpp).
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

inline Status cuda_error_status(cudaError_t err, const char* what) {
  return Status(ErrorCode::runtime_failure,
                std::string(what) + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// Returns a runtime_failure Status from the enclosing function when a CUDA call fails.
#define EXPERT_CACHE_DETAIL_TRY_CUDA(expr)                                         \
  do {                                                                             \
    const cudaError_t expert_cache_err_ = (expr);                                  \
    if (expert_cache_err_ != cudaSuccess) {                                        \
      (void)cudaGetLastError(); /* clear a non-sticky error for the next caller */ \
      return ::expert_cache::device::detail::cuda_error_status(expert_cache_err_, #expr); \
    }                                                                              \
  } while (0)

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

// One thread per output int32 word (grid-stride); each gathers its eight codes (spec §4.2).
template <int Tensor>
__global__ void marlin_weights_kernel(Nvfp4CheckpointPtrs src, Nvfp4MarlinPtrs dst, RepackArgs a) {
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

// One thread per output scale byte (spec §4.3): permuted source, then the S0E5M3 encode.
template <int Tensor>
__global__ void marlin_scales_kernel(Nvfp4CheckpointPtrs src, Nvfp4MarlinPtrs dst, RepackArgs a) {
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

// Global scales (spec §4.4); w13 uses column 0 of [E, 2].
template <class = void>
__global__ void marlin_globals_kernel(Nvfp4CheckpointPtrs src, Nvfp4MarlinPtrs dst, RepackArgs a) {
  for (std::int64_t e = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < a.num_experts;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    dst.w13_scale_2[e] = marlin::global_scale(src.w13_scale_2[2 * e], a.w13_log2_sf, a.dtype);
    dst.w2_scale_2[e] = marlin::global_scale(src.w2_scale_2[e], a.w2_log2_sf, a.dtype);
  }
}

// Layer statistics for validation and the scale factors, all in one read-only pass.
enum StatSlot : int {
  stat_max13 = 0,     // max positive e4m3 byte of all w13 scales
  stat_max2,          // same for w2
  stat_bad_scale13,   // nonzero: a NaN or negative w13 block scale exists
  stat_bad_scale2,
  stat_bad_global,    // nonzero: a NaN, infinite or negative global scale exists
  stat_mismatches,    // experts whose w1 and w3 globals differ
  stat_first_mismatch,  // min such expert (0xFFFFFFFF if none)
  stat_count
};

__device__ inline bool bad_global(float g) { return !(g >= 0.0f && g <= FLT_MAX); }

template <class = void>
__global__ void nvfp4_stats_kernel(Nvfp4CheckpointPtrs src, std::int64_t n13, std::int64_t n2,
                                   std::int64_t num_experts, unsigned int* stats) {
  unsigned int max13 = 0, max2 = 0, bad13 = 0, bad2 = 0, bad_g = 0;
  const std::int64_t stride = std::int64_t{gridDim.x} * blockDim.x;
  const std::int64_t first = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (std::int64_t i = first; i < n13; i += stride) {
    const std::uint8_t b = src.w13_scale[i];
    bad13 |= marlin::is_bad_e4m3_scale(b) ? 1u : 0u;
    if (marlin::is_positive_e4m3(b)) max13 = max(max13, static_cast<unsigned int>(b));
  }
  for (std::int64_t i = first; i < n2; i += stride) {
    const std::uint8_t b = src.w2_scale[i];
    bad2 |= marlin::is_bad_e4m3_scale(b) ? 1u : 0u;
    if (marlin::is_positive_e4m3(b)) max2 = max(max2, static_cast<unsigned int>(b));
  }
  for (std::int64_t e = first; e < num_experts; e += stride) {
    const float g1 = src.w13_scale_2[2 * e], g3 = src.w13_scale_2[2 * e + 1], g2 = src.w2_scale_2[e];
    bad_g |= (bad_global(g1) || bad_global(g3) || bad_global(g2)) ? 1u : 0u;
    if (g1 != g3) {
      atomicAdd(&stats[stat_mismatches], 1u);
      atomicMin(&stats[stat_first_mismatch], static_cast<unsigned int>(e));
    }
  }
  // One atomic per thread and statistic; only when it can change the result.
  if (max13 != 0) atomicMax(&stats[stat_max13], max13);
  if (max2 != 0) atomicMax(&stats[stat_max2], max2);
  if (bad13) atomicOr(&stats[stat_bad_scale13], 1u);
  if (bad2) atomicOr(&stats[stat_bad_scale2], 1u);
  if (bad_g) atomicOr(&stats[stat_bad_global], 1u);
}

inline RepackArgs make_args(const Nvfp4Marlin& layout, std::int64_t num_experts, const Nvfp4MarlinParams& p) {
  return {layout.hidden, layout.intermediate, layout.padded_intermediate(), num_experts, p.w13_log2_sf,
          p.w2_log2_sf, layout.dtype};
}

// Stream-ordered device scratch, freed on every exit path.
class DeviceScratch {
 public:
  explicit DeviceScratch(cudaStream_t stream) noexcept : stream_(stream) {}
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() {
    if (ptr_ != nullptr) (void)cudaFreeAsync(ptr_, stream_);
  }
  [[nodiscard]] Status allocate(std::size_t bytes) {
    EXPERT_CACHE_DETAIL_TRY_CUDA(cudaMallocAsync(&ptr_, bytes, stream_));
    return {};
  }
  [[nodiscard]] std::byte* get() const noexcept { return static_cast<std::byte*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

inline bool any_null(const Nvfp4CheckpointPtrs& s) {
  return !s.w13 || !s.w13_scale || !s.w13_scale_2 || !s.w2 || !s.w2_scale || !s.w2_scale_2;
}
inline bool any_null(const Nvfp4MarlinPtrs& d) {
  return !d.w13 || !d.w2 || !d.w13_scale || !d.w2_scale || !d.w13_scale_2 || !d.w2_scale_2;
}

}  // namespace detail

// Enqueues the repack of `num_experts` device-resident experts with given layer-wide factors.
// No validation of values: for callers that already ran analyze_checkpoint / the stats pass.
[[nodiscard]] inline Status launch_repack_experts(const Nvfp4Marlin& layout, std::int64_t num_experts,
                                                  const Nvfp4CheckpointPtrs& src, const Nvfp4MarlinPtrs& dst,
                                                  const Nvfp4MarlinParams& params, cudaStream_t stream) {
  if (auto s = expert_cache::detail::check_nvfp4_shape(layout, num_experts); !s.ok()) return s;
  if (detail::any_null(src) || detail::any_null(dst))
    return Status(ErrorCode::invalid_argument, "nvfp4 repack: null tensor pointer");
  const detail::RepackArgs a = detail::make_args(layout, num_experts, params);
  constexpr int threads = detail::block_threads;
  detail::marlin_weights_kernel<detail::w13_tensor>
      <<<detail::grid_for(layout.w13_words() * num_experts), threads, 0, stream>>>(src, dst, a);
  EXPERT_CACHE_DETAIL_TRY_CUDA(cudaGetLastError());
  detail::marlin_weights_kernel<detail::w2_tensor>
      <<<detail::grid_for(layout.w2_words() * num_experts), threads, 0, stream>>>(src, dst, a);
  EXPERT_CACHE_DETAIL_TRY_CUDA(cudaGetLastError());
  detail::marlin_scales_kernel<detail::w13_tensor>
      <<<detail::grid_for(layout.w13_scale_bytes() * num_experts), threads, 0, stream>>>(src, dst, a);
  EXPERT_CACHE_DETAIL_TRY_CUDA(cudaGetLastError());
  detail::marlin_scales_kernel<detail::w2_tensor>
      <<<detail::grid_for(layout.w2_scale_bytes() * num_experts), threads, 0, stream>>>(src, dst, a);
  EXPERT_CACHE_DETAIL_TRY_CUDA(cudaGetLastError());
  detail::marlin_globals_kernel<><<<detail::grid_for(num_experts), threads, 0, stream>>>(src, dst, a);
  EXPERT_CACHE_DETAIL_TRY_CUDA(cudaGetLastError());
  return {};
}

// Single pass over a device-resident layer. Validates shapes and values with a read-only stats
// kernel (one host sync) before any output is written, then enqueues the repack on `stream`;
// the outputs are ready in stream order.
[[nodiscard]] inline Result<Nvfp4LayerReport> repack_layer_device(const Nvfp4Marlin& layout, std::int64_t num_experts,
                                                                  const Nvfp4CheckpointPtrs& src,
                                                                  const Nvfp4MarlinPtrs& dst, cudaStream_t stream) {
  if (auto s = expert_cache::detail::check_nvfp4_shape(layout, num_experts); !s.ok()) return s;
  if (detail::any_null(src) || detail::any_null(dst))
    return Status(ErrorCode::invalid_argument, "nvfp4 repack: null tensor pointer");

  unsigned int stats[detail::stat_count] = {};
  {
    detail::DeviceScratch scratch(stream);
    if (auto s = scratch.allocate(sizeof(stats)); !s.ok()) return s;
    auto* d_stats = reinterpret_cast<unsigned int*>(scratch.get());
    EXPERT_CACHE_DETAIL_TRY_CUDA(cudaMemsetAsync(d_stats, 0, sizeof(stats), stream));
    EXPERT_CACHE_DETAIL_TRY_CUDA(
        cudaMemsetAsync(d_stats + detail::stat_first_mismatch, 0xFF, sizeof(unsigned int), stream));
    const std::int64_t n13 = num_experts * layout.ckpt_w13_scale_bytes();
    const std::int64_t n2 = num_experts * layout.ckpt_w2_scale_bytes();
    detail::nvfp4_stats_kernel<><<<detail::grid_for(std::max(n13, n2)), detail::block_threads, 0, stream>>>(
        src, n13, n2, num_experts, d_stats);
    EXPERT_CACHE_DETAIL_TRY_CUDA(cudaGetLastError());
    EXPERT_CACHE_DETAIL_TRY_CUDA(cudaMemcpyAsync(stats, d_stats, sizeof(stats), cudaMemcpyDeviceToHost, stream));
    EXPERT_CACHE_DETAIL_TRY_CUDA(cudaStreamSynchronize(stream));
  }
  if (stats[detail::stat_bad_scale13])
    return Status(ErrorCode::invalid_argument, "nvfp4: w13_scale holds a negative or NaN e4m3 scale");
  if (stats[detail::stat_bad_scale2])
    return Status(ErrorCode::invalid_argument, "nvfp4: w2_scale holds a negative or NaN e4m3 scale");
  if (stats[detail::stat_bad_global])
    return Status(ErrorCode::invalid_argument, "nvfp4: a global scale (*_scale_2) is negative or not finite");

  Nvfp4LayerReport report;
  report.params.w13_log2_sf = marlin::scale_factor_log2(static_cast<std::uint8_t>(stats[detail::stat_max13]), layout.dtype);
  report.params.w2_log2_sf = marlin::scale_factor_log2(static_cast<std::uint8_t>(stats[detail::stat_max2]), layout.dtype);
  report.w13_global_mismatches = stats[detail::stat_mismatches];
  report.first_mismatch = report.w13_global_mismatches ? static_cast<std::int64_t>(stats[detail::stat_first_mismatch]) : -1;
  expert_cache::detail::warn_global_mismatch(report);
  if (auto s = launch_repack_experts(layout, num_experts, src, dst, report.params, stream); !s.ok()) return s;
  return report;
}

// Chunked conversion of a host-resident layer (spec §4.7): `src` and `dst` in host memory
// (pinned for asynchronous copies; pageable works but serialises). Validation and the two
// layer-wide scale factors run on the host over all experts before any device work; then each
// chunk of `expert_chunk` experts goes H2D, through the kernels, and D2H into rows [a, b) of
// `dst`. Returns after the stream has drained. Byte-identical to repack_layer_device.
[[nodiscard]] inline Result<Nvfp4LayerReport> repack_layer_host_chunked(const Nvfp4Marlin& layout,
                                                                        const Nvfp4CheckpointLayer& src,
                                                                        const Nvfp4MarlinLayer& dst,
                                                                        cudaStream_t stream,
                                                                        std::int64_t expert_chunk = 64) {
  if (expert_chunk <= 0)
    return Status(ErrorCode::invalid_argument, "nvfp4: expert_chunk must be positive, got " + std::to_string(expert_chunk));
  auto report = analyze_checkpoint(layout, src);
  if (!report.ok()) return report.status();
  const std::int64_t num_experts = src.num_experts;
  if (auto s = check_marlin_sizes(layout, num_experts, dst.as_const()); !s.ok()) return s;
  expert_cache::detail::warn_global_mismatch(*report);

  // Per-expert bytes of the twelve tensors, each region 256-byte aligned in one allocation.
  const std::int64_t chunk = std::min(expert_chunk, num_experts);
  const std::size_t in_bytes[6] = {
      static_cast<std::size_t>(layout.ckpt_w13_bytes()), static_cast<std::size_t>(layout.ckpt_w13_scale_bytes()),
      2 * sizeof(float), static_cast<std::size_t>(layout.ckpt_w2_bytes()),
      static_cast<std::size_t>(layout.ckpt_w2_scale_bytes()), sizeof(float)};
  const std::size_t out_bytes[6] = {
      static_cast<std::size_t>(layout.w13_words()) * 4, static_cast<std::size_t>(layout.w2_words()) * 4,
      static_cast<std::size_t>(layout.w13_scale_bytes()), static_cast<std::size_t>(layout.w2_scale_bytes()),
      sizeof(float), sizeof(float)};
  std::size_t offsets[12] = {};
  std::size_t total = 0;
  for (int i = 0; i < 12; ++i) {
    offsets[i] = total;
    total += (((i < 6 ? in_bytes[i] : out_bytes[i - 6]) * static_cast<std::size_t>(chunk)) + 255) / 256 * 256;
  }

  detail::DeviceScratch scratch(stream);
  if (auto s = scratch.allocate(total); !s.ok()) return s;
  std::byte* base = scratch.get();
  const Nvfp4CheckpointPtrs d_src{
      reinterpret_cast<const std::uint8_t*>(base + offsets[0]), reinterpret_cast<const std::uint8_t*>(base + offsets[1]),
      reinterpret_cast<const float*>(base + offsets[2]), reinterpret_cast<const std::uint8_t*>(base + offsets[3]),
      reinterpret_cast<const std::uint8_t*>(base + offsets[4]), reinterpret_cast<const float*>(base + offsets[5])};
  const Nvfp4MarlinPtrs d_dst{
      reinterpret_cast<std::uint32_t*>(base + offsets[6]), reinterpret_cast<std::uint32_t*>(base + offsets[7]),
      reinterpret_cast<std::uint8_t*>(base + offsets[8]), reinterpret_cast<std::uint8_t*>(base + offsets[9]),
      reinterpret_cast<float*>(base + offsets[10]), reinterpret_cast<float*>(base + offsets[11])};
  const void* h_src[6] = {src.w13.data(), src.w13_scale.data(), src.w13_scale_2.data(),
                          src.w2.data(), src.w2_scale.data(), src.w2_scale_2.data()};
  void* h_dst[6] = {dst.w13.data(), dst.w2.data(), dst.w13_scale.data(),
                    dst.w2_scale.data(), dst.w13_scale_2.data(), dst.w2_scale_2.data()};

  auto run = [&]() -> Status {
    for (std::int64_t a = 0; a < num_experts; a += chunk) {
      const auto n = static_cast<std::size_t>(std::min(chunk, num_experts - a));
      const auto first = static_cast<std::size_t>(a);
      for (int i = 0; i < 6; ++i)
        EXPERT_CACHE_DETAIL_TRY_CUDA(cudaMemcpyAsync(base + offsets[i], static_cast<const std::byte*>(h_src[i]) + first * in_bytes[i],
                                                     n * in_bytes[i], cudaMemcpyHostToDevice, stream));
      if (auto s = launch_repack_experts(layout, static_cast<std::int64_t>(n), d_src, d_dst, report->params, stream); !s.ok())
        return s;
      for (int i = 0; i < 6; ++i)
        EXPERT_CACHE_DETAIL_TRY_CUDA(cudaMemcpyAsync(static_cast<std::byte*>(h_dst[i]) + first * out_bytes[i],
                                                     base + offsets[6 + i], n * out_bytes[i], cudaMemcpyDeviceToHost, stream));
    }
    EXPERT_CACHE_DETAIL_TRY_CUDA(cudaStreamSynchronize(stream));
    return {};
  };
  if (auto s = run(); !s.ok()) {
    (void)cudaStreamSynchronize(stream);  // no copy may still target the caller's buffers
    return s;
  }
  return report;
}

}  // namespace expert_cache::device
