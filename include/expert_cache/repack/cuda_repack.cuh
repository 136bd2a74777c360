#pragma once
/// The GPU repack of an NVFP4 MoE layer, host side: launch_repack_experts, repack_layer_device and
/// repack_layer_host_chunked validate their inputs and launch the kernels of
/// kernels/marlin_repack.cuh (needs nvcc).
//
//  * repack_layer_device: sources and outputs in device memory, one pass over all experts.
//  * repack_layer_host_chunked: sources and outputs in (pinned) host memory; a scales-only pass
//    on the GPU validates and computes the layer-wide scale factors over all experts first, then
//    rounds of experts are copied to the GPU, repacked and copied back, copy-out overlapping the
//    next upload (GPU peak ~ one chunk, docs/nvfp4_marlin.md, Whole layer and chunked conversion).
// Both run the same kernels with the same factors, so their outputs are byte-identical, and the
// kernels evaluate the same index maps and encodes as the host repack (repack/host_repack.hpp).
// Launchers validate everything before the first write to an output and return Status; every
// CUDA call is checked.
#if !defined(__CUDACC__)
#error "expert_cache/repack/cuda_repack.cuh needs nvcc; host code can use repack/host_repack.hpp"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>

#include "expert_cache/base/config.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/kernels/marlin_repack.cuh"
#include "expert_cache/layout/nvfp4_layer.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/runtime/cuda_error.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

namespace detail {

inline Status reset_stats(unsigned long long* d_stats, cudaStream_t stream) {
  EXPERT_CACHE_TRY_CUDA(cudaMemsetAsync(d_stats, 0, stat_first_slot * sizeof(unsigned long long), stream));
  EXPERT_CACHE_TRY_CUDA(cudaMemsetAsync(d_stats + stat_first_slot, 0xFF,
                                               (stat_count - stat_first_slot) * sizeof(unsigned long long), stream));
  return {};
}

// Enqueues the stats pass over `num_experts` experts starting at layer expert `expert_base`.
inline Status launch_stats(const Nvfp4Marlin& layout, const Nvfp4CheckpointPtrs& src, std::int64_t num_experts,
                           std::int64_t expert_base, unsigned long long* d_stats, cudaStream_t stream) {
  const std::int64_t n13 = num_experts * layout.ckpt_w13_scale_bytes();
  const std::int64_t n2 = num_experts * layout.ckpt_w2_scale_bytes();
  // A grid-stride pass: ~16 bytes per thread at most keeps the block reductions cheap.
  const int grid = static_cast<int>(std::min<std::int64_t>((std::max(n13, n2) / 16 + block_threads - 1) / block_threads + 1, 4096));
  nvfp4_stats_kernel<><<<grid, block_threads, 0, stream>>>(
      src, n13, n2, num_experts, expert_base, layout.ckpt_w13_scale_bytes(), layout.ckpt_w2_scale_bytes(), d_stats);
  EXPERT_CACHE_TRY_CUDA(cudaGetLastError());
  return {};
}

// Turns the statistics into the layer report, or the error for the first invalid value.
inline Result<Nvfp4LayerReport> report_from_stats(const Nvfp4Marlin& layout, const unsigned long long (&stats)[stat_count]) {
  const auto invalid = [](const char* what, unsigned long long index, const char* why) {
    return Status::format(ErrorCode::invalid_argument, "nvfp4: %s[%llu] %s", what, index, why);
  };
  if (stats[stat_first_bad13] != stat_none) return invalid("w13_scale", stats[stat_first_bad13], "is a negative or NaN e4m3 scale");
  if (stats[stat_first_bad2] != stat_none) return invalid("w2_scale", stats[stat_first_bad2], "is a negative or NaN e4m3 scale");
  if (stats[stat_first_bad_g13] != stat_none)
    return invalid("w13_scale_2", stats[stat_first_bad_g13], "is negative or not finite");
  if (stats[stat_first_bad_g2] != stat_none)
    return invalid("w2_scale_2", stats[stat_first_bad_g2], "is negative or not finite");
  Nvfp4LayerReport report;
  report.params.w13_log2_sf = marlin::scale_factor_log2(static_cast<std::uint8_t>(stats[stat_max13]), layout.dtype);
  report.params.w2_log2_sf = marlin::scale_factor_log2(static_cast<std::uint8_t>(stats[stat_max2]), layout.dtype);
  report.w13_global_mismatches = static_cast<std::int64_t>(stats[stat_mismatches]);
  report.first_mismatch = report.w13_global_mismatches ? static_cast<std::int64_t>(stats[stat_first_mismatch]) : -1;
  return report;
}

// Copies the statistics back (one host sync) and turns them into the report or the error.
inline Result<Nvfp4LayerReport> read_report(const Nvfp4Marlin& layout, const unsigned long long* d_stats, cudaStream_t stream) {
  unsigned long long stats[stat_count] = {};
  EXPERT_CACHE_TRY_CUDA(cudaMemcpyAsync(stats, d_stats, sizeof(stats), cudaMemcpyDeviceToHost, stream));
  EXPERT_CACHE_TRY_CUDA(cudaStreamSynchronize(stream));
  return report_from_stats(layout, stats);
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
    EXPERT_CACHE_TRY_CUDA(cudaMallocAsync(&ptr_, bytes, stream_));
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

// The tiled kernel loads 8-byte weight pieces and stores 16-byte weight quads and 4-byte scale
// words. Any other alignment (e.g. a tensor view at an odd byte offset) takes the generic kernels.
inline bool tileable(const Nvfp4CheckpointPtrs& s, const Nvfp4MarlinPtrs& d) {
  return aligned(s.w13, 8) && aligned(s.w2, 8) && aligned(d.w13, 16) && aligned(d.w2, 16) && aligned(d.w13_scale, 4) &&
         aligned(d.w2_scale, 4);
}

// A second stream and four events for the chunked path's copy-out overlap; released (after the
// caller drained both streams) on every exit path.
class ChunkPipeline {
 public:
  ChunkPipeline() = default;
  ChunkPipeline(const ChunkPipeline&) = delete;
  ChunkPipeline& operator=(const ChunkPipeline&) = delete;
  ~ChunkPipeline() {
    for (cudaEvent_t e : computed) if (e) (void)cudaEventDestroy(e);
    for (cudaEvent_t e : drained) if (e) (void)cudaEventDestroy(e);
    if (copy_out) (void)cudaStreamDestroy(copy_out);
  }
  [[nodiscard]] Status create() {
    EXPERT_CACHE_TRY_CUDA(cudaStreamCreateWithFlags(&copy_out, cudaStreamNonBlocking));
    for (int b = 0; b < 2; ++b) {
      EXPERT_CACHE_TRY_CUDA(cudaEventCreateWithFlags(&computed[b], cudaEventDisableTiming));
      EXPERT_CACHE_TRY_CUDA(cudaEventCreateWithFlags(&drained[b], cudaEventDisableTiming));
    }
    return {};
  }
  cudaStream_t copy_out = nullptr;
  cudaEvent_t computed[2] = {};  // buffer set b's outputs are written (recorded on the caller's stream)
  cudaEvent_t drained[2] = {};   // buffer set b's outputs are copied out (recorded on copy_out)
};

}  // namespace detail

// Enqueues the repack of `num_experts` device-resident experts with given layer-wide factors.
// No validation of values: for callers that already ran analyze_checkpoint / the stats pass.
[[nodiscard]] inline Status launch_repack_experts(const Nvfp4Marlin& layout, std::int64_t num_experts,
                                                  const Nvfp4CheckpointPtrs& src, const Nvfp4MarlinPtrs& dst,
                                                  const Nvfp4MarlinParams& params, cudaStream_t stream) {
  if (auto s = expert_cache::detail::check_nvfp4_shape(layout, num_experts); !s.ok()) return s;
  if (detail::any_null(src) || detail::any_null(dst))
    return Status(ErrorCode::invalid_argument, "nvfp4: null tensor pointer");
  const detail::RepackArgs a = detail::make_args(layout, num_experts, params);
  constexpr int threads = detail::block_threads;
  constexpr int run = detail::tiled_run_tiles;
  detail::TiledConsts consts = detail::tiled_consts(layout, num_experts, run);
  if (detail::tileable(src, dst) && consts.tasks > 0) {
    int device = 0, sm_count = 0;
    EXPERT_CACHE_TRY_CUDA(cudaGetDevice(&device));
    EXPERT_CACHE_TRY_CUDA(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
    consts.scale_words[0] = consts.tensor[0].scale_row_bytes % 4 == 0 && detail::aligned(src.w13_scale, 4);
    consts.scale_words[1] = consts.tensor[1].scale_row_bytes % 4 == 0 && detail::aligned(src.w2_scale, 4);
    detail::marlin_repack_tiled_kernel<run>
        <<<detail::tiled_grid(consts.tasks, sm_count), threads, 0, stream>>>(src, dst, a, consts);
    EXPERT_CACHE_TRY_CUDA(cudaGetLastError());
    return {};
  }
  detail::marlin_weights_kernel<detail::w13_tensor>
      <<<detail::grid_for(layout.w13_words() * num_experts), threads, 0, stream>>>(src, dst, a);
  EXPERT_CACHE_TRY_CUDA(cudaGetLastError());
  detail::marlin_weights_kernel<detail::w2_tensor>
      <<<detail::grid_for(layout.w2_words() * num_experts), threads, 0, stream>>>(src, dst, a);
  EXPERT_CACHE_TRY_CUDA(cudaGetLastError());
  detail::marlin_scales_kernel<detail::w13_tensor>
      <<<detail::grid_for(layout.w13_scale_bytes() * num_experts), threads, 0, stream>>>(src, dst, a);
  EXPERT_CACHE_TRY_CUDA(cudaGetLastError());
  detail::marlin_scales_kernel<detail::w2_tensor>
      <<<detail::grid_for(layout.w2_scale_bytes() * num_experts), threads, 0, stream>>>(src, dst, a);
  EXPERT_CACHE_TRY_CUDA(cudaGetLastError());
  detail::marlin_globals_kernel<><<<detail::grid_for(num_experts), threads, 0, stream>>>(src, dst, a);
  EXPERT_CACHE_TRY_CUDA(cudaGetLastError());
  return {};
}

// Single pass over a device-resident layer. Validates shapes and values with a read-only stats
// kernel (one host sync) before any output is written, then enqueues the repack on `stream`;
// the outputs are ready in stream order. Warnings go to `warn` if given.
[[nodiscard]] inline Result<Nvfp4LayerReport> repack_layer_device(const Nvfp4Marlin& layout, std::int64_t num_experts,
                                                                  const Nvfp4CheckpointPtrs& src,
                                                                  const Nvfp4MarlinPtrs& dst, cudaStream_t stream,
                                                                  const Nvfp4WarningSink& warn = {}) {
  if (auto s = expert_cache::detail::check_nvfp4_shape(layout, num_experts); !s.ok()) return s;
  if (detail::any_null(src) || detail::any_null(dst))
    return Status(ErrorCode::invalid_argument, "nvfp4: null tensor pointer");

  auto validate = [&]() -> Result<Nvfp4LayerReport> {
    detail::DeviceScratch scratch(stream);
    if (auto s = scratch.allocate(sizeof(unsigned long long) * detail::stat_count); !s.ok()) return s;
    auto* d_stats = reinterpret_cast<unsigned long long*>(scratch.get());
    if (auto s = detail::reset_stats(d_stats, stream); !s.ok()) return s;
    if (auto s = detail::launch_stats(layout, src, num_experts, 0, d_stats, stream); !s.ok()) return s;
    return detail::read_report(layout, d_stats, stream);
  };
  auto report = validate();
  if (!report.ok()) return report;
  expert_cache::detail::warn_global_mismatch(*report, warn);
  if (auto s = launch_repack_experts(layout, num_experts, src, dst, report->params, stream); !s.ok()) return s;
  return report;
}

// Chunked conversion of a host-resident layer (docs/nvfp4_marlin.md, Whole layer and chunked conversion): `src` and
// `dst` in host memory (pinned for asynchronous copies; pageable works but serialises). Sizes are checked on the
// host; then a first pass streams only the scale tensors through the stats kernel (validation and the two layer-wide
// factors over all experts) before anything is written to `dst`. The second pass converts ceil(expert_chunk / 2)
// experts at a time through two device buffer sets (GPU peak ~ one chunk): uploads and kernels run on `stream`,
// copies out on an internal stream, so the D2H of one set overlaps the H2D of the other. Returns after both streams
// drained. Byte-identical to repack_layer_device. Warnings go to `warn` if given.
[[nodiscard]] inline Result<Nvfp4LayerReport> repack_layer_host_chunked(const Nvfp4Marlin& layout,
                                                                        const Nvfp4CheckpointLayer& src,
                                                                        const Nvfp4MarlinLayer& dst,
                                                                        cudaStream_t stream,
                                                                        std::int64_t expert_chunk = 64,
                                                                        const Nvfp4WarningSink& warn = {}) {
  if (expert_chunk <= 0)
    return Status::format(ErrorCode::invalid_argument, "nvfp4: expert_chunk must be positive, got %lld",
                          static_cast<long long>(expert_chunk));
  if (auto s = check_checkpoint_sizes(layout, src); !s.ok()) return s;
  const std::int64_t num_experts = src.num_experts;
  if (auto s = check_marlin_sizes(layout, num_experts, dst.as_const()); !s.ok()) return s;

  // Two buffer sets of `sub` experts, twelve 256-byte aligned regions each, then the statistics.
  const std::int64_t sub = (std::min(expert_chunk, num_experts) + 1) / 2;
  const std::size_t in_bytes[6] = {
      static_cast<std::size_t>(layout.ckpt_w13_bytes()), static_cast<std::size_t>(layout.ckpt_w13_scale_bytes()),
      2 * sizeof(float), static_cast<std::size_t>(layout.ckpt_w2_bytes()),
      static_cast<std::size_t>(layout.ckpt_w2_scale_bytes()), sizeof(float)};
  const std::size_t out_bytes[6] = {
      static_cast<std::size_t>(layout.w13_words()) * 4, static_cast<std::size_t>(layout.w2_words()) * 4,
      static_cast<std::size_t>(layout.w13_scale_bytes()), static_cast<std::size_t>(layout.w2_scale_bytes()),
      sizeof(float), sizeof(float)};
  std::size_t offsets[2][12] = {};
  std::size_t total = 0;
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 12; ++i) {
      offsets[b][i] = total;
      total += (((i < 6 ? in_bytes[i] : out_bytes[i - 6]) * static_cast<std::size_t>(sub)) + 255) / 256 * 256;
    }
  const std::size_t stats_offset = total;
  total += sizeof(unsigned long long) * detail::stat_count;

  detail::DeviceScratch scratch(stream);
  if (auto s = scratch.allocate(total); !s.ok()) return s;
  detail::ChunkPipeline pipe;
  if (auto s = pipe.create(); !s.ok()) return s;
  std::byte* base = scratch.get();
  auto* d_stats = reinterpret_cast<unsigned long long*>(base + stats_offset);
  const auto set_src = [&](int b) {
    return Nvfp4CheckpointPtrs{reinterpret_cast<const std::uint8_t*>(base + offsets[b][0]),
                               reinterpret_cast<const std::uint8_t*>(base + offsets[b][1]),
                               reinterpret_cast<const float*>(base + offsets[b][2]),
                               reinterpret_cast<const std::uint8_t*>(base + offsets[b][3]),
                               reinterpret_cast<const std::uint8_t*>(base + offsets[b][4]),
                               reinterpret_cast<const float*>(base + offsets[b][5])};
  };
  const auto set_dst = [&](int b) {
    return Nvfp4MarlinPtrs{reinterpret_cast<std::uint32_t*>(base + offsets[b][6]),
                           reinterpret_cast<std::uint32_t*>(base + offsets[b][7]),
                           reinterpret_cast<std::uint8_t*>(base + offsets[b][8]),
                           reinterpret_cast<std::uint8_t*>(base + offsets[b][9]),
                           reinterpret_cast<float*>(base + offsets[b][10]),
                           reinterpret_cast<float*>(base + offsets[b][11])};
  };
  const void* h_src[6] = {src.w13.data(), src.w13_scale.data(), src.w13_scale_2.data(),
                          src.w2.data(), src.w2_scale.data(), src.w2_scale_2.data()};
  void* h_dst[6] = {dst.w13.data(), dst.w2.data(), dst.w13_scale.data(),
                    dst.w2_scale.data(), dst.w13_scale_2.data(), dst.w2_scale_2.data()};
  constexpr int scale_inputs[4] = {1, 2, 4, 5};  // the tensors the stats pass reads
  const std::int64_t rounds = (num_experts + sub - 1) / sub;
  const auto upload = [&](int b, int i, std::size_t first, std::size_t n) -> Status {
    EXPERT_CACHE_TRY_CUDA(cudaMemcpyAsync(base + offsets[b][i], static_cast<const std::byte*>(h_src[i]) + first * in_bytes[i],
                                                 n * in_bytes[i], cudaMemcpyHostToDevice, stream));
    return {};
  };

  // Pass 1: statistics over all experts; nothing is written to `dst` before it is checked.
  auto stats_pass = [&]() -> Result<Nvfp4LayerReport> {
    if (auto s = detail::reset_stats(d_stats, stream); !s.ok()) return s;
    for (std::int64_t r = 0; r < rounds; ++r) {
      const auto first = static_cast<std::size_t>(r * sub);
      const auto n = static_cast<std::size_t>(std::min(sub, num_experts - r * sub));
      for (int i : scale_inputs)
        if (auto s = upload(0, i, first, n); !s.ok()) return s;
      if (auto s = detail::launch_stats(layout, set_src(0), static_cast<std::int64_t>(n), static_cast<std::int64_t>(first),
                                        d_stats, stream); !s.ok())
        return s;
    }
    return detail::read_report(layout, d_stats, stream);
  };
  auto report = stats_pass();
  if (!report.ok()) {
    (void)cudaStreamSynchronize(stream);  // after a CUDA error an upload may still be in flight
    return report;
  }
  expert_cache::detail::warn_global_mismatch(*report, warn);

  // Pass 2: round r uses buffer set r % 2. With one round, pass 1 left its scales in set 0.
  auto convert_pass = [&]() -> Status {
    for (std::int64_t r = 0; r < rounds; ++r) {
      const int b = static_cast<int>(r % 2);
      const auto first = static_cast<std::size_t>(r * sub);
      const auto n = static_cast<std::size_t>(std::min(sub, num_experts - r * sub));
      // Set b's outputs from round r - 2 must be copied out before this round overwrites them.
      if (r >= 2) EXPERT_CACHE_TRY_CUDA(cudaStreamWaitEvent(stream, pipe.drained[b], 0));
      for (int i = 0; i < 6; ++i) {
        const bool resident = rounds == 1 && std::find(std::begin(scale_inputs), std::end(scale_inputs), i) != std::end(scale_inputs);
        if (!resident)
          if (auto s = upload(b, i, first, n); !s.ok()) return s;
      }
      if (auto s = launch_repack_experts(layout, static_cast<std::int64_t>(n), set_src(b), set_dst(b), report->params, stream);
          !s.ok())
        return s;
      EXPERT_CACHE_TRY_CUDA(cudaEventRecord(pipe.computed[b], stream));
      EXPERT_CACHE_TRY_CUDA(cudaStreamWaitEvent(pipe.copy_out, pipe.computed[b], 0));
      for (int i = 0; i < 6; ++i)
        EXPERT_CACHE_TRY_CUDA(cudaMemcpyAsync(static_cast<std::byte*>(h_dst[i]) + first * out_bytes[i],
                                                     base + offsets[b][6 + i], n * out_bytes[i], cudaMemcpyDeviceToHost,
                                                     pipe.copy_out));
      EXPERT_CACHE_TRY_CUDA(cudaEventRecord(pipe.drained[b], pipe.copy_out));
    }
    // The caller's stream (and the scratch free queued on it) waits for the last copies out.
    for (int b = 0; b < std::min<std::int64_t>(rounds, 2); ++b)
      EXPERT_CACHE_TRY_CUDA(cudaStreamWaitEvent(stream, pipe.drained[b], 0));
    EXPERT_CACHE_TRY_CUDA(cudaStreamSynchronize(stream));
    return {};
  };
  if (auto s = convert_pass(); !s.ok()) {
    // No copy may still target the caller's buffers, nor read the scratch after its free.
    (void)cudaStreamSynchronize(pipe.copy_out);
    (void)cudaStreamSynchronize(stream);
    return s;
  }
  return report;
}

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
