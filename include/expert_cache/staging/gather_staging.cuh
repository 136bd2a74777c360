#pragma once
/// Gather staging policy (needs nvcc): all of a prepare()'s misses copied by ONE kernel launch on
/// the cache-owned copy stream, the SMs reading the mapped pinned host pools zero-copy with 16-byte
/// loads.
// Capturable in a CUDA graph (a kernel node; nothing is read from host staging memory at replay
// time, unlike cudaMemcpyBatchAsync which cannot be captured at all).
//
// The fill list is a kernel parameter (kernels/fill_copy.cuh): per fill an (expert, slot)
// pair, plus per copy region of the storage (storage/copy_region.hpp) its source/destination
// bases, their two strides and bytes (so it scatters, e.g. ExpertMajorHostStorage). Launch
// sizes are tiers of 16, 128 and 1024 fills (0.8, 1.7 and 8.8 KiB of parameters with
// max_copy_regions = 12 regions; > 4 KiB parameters need CUDA 12.1+, which the tier requires
// anyway); a prepare with more than 1024 misses is split into several launches on the same
// stream (ordering unchanged).
#if !defined(__CUDACC__)
#error "expert_cache/staging/gather_staging.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/nvtx.hpp"
#include "expert_cache/kernels/fill_copy.cuh"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/runtime/cuda_runtime.hpp"
#include "expert_cache/storage/copy_region.hpp"
#include "expert_cache/storage/slot_storage.hpp"

namespace expert_cache::inline v0 {

/// The Gather staging policy (CudaRuntime only): a prepare's misses copied by one kernel launch
/// that reads the mapped pinned host pools zero-copy.
class Gather {
 public:
  static constexpr std::string_view name = "gather";
  static constexpr bool uses_copy_stream = true;
  // Thread blocks of the launch: a zero-copy read saturates PCIe with ~16 blocks (docs/hardware_limits.md),
  // and fewer blocks leave more SMs to compute that overlaps the fill.
  static constexpr int blocks = 32;
  static constexpr int threads = 512;

  /// Blocks of a launch of `items` work items: never more than the items need (a single small
  /// expert launches few blocks), at most `blocks`. Also the grid of the link profile's SM-load
  /// probe (staging/link_probe.cuh).
  [[nodiscard]] static constexpr int grid_for(std::uint64_t items) noexcept {
    const std::uint64_t per_block = static_cast<std::uint64_t>(threads) * 4;
    return static_cast<int>(items / per_block + 1 < static_cast<std::uint64_t>(blocks) ? items / per_block + 1 : blocks);
  }

  /// Enqueues one gather launch per 1024 fills on `stream`.
  /// @param rt       the cache's runtime (resolves the pools' device addresses once per storage)
  /// @param stream   the fill stream the ordering core hands over
  /// @param storage  the cache's storage; its host pools must be mapped pinned memory
  /// @param fills    the planned (expert, slot) fills
  /// @return the first failure (resolving an address, an unusable region, a launch)
  template <class Storage>
  Status issue(CudaRuntime& rt, cudaStream_t stream, const Storage& storage, std::span<const SlotFill> fills) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::fill");
    if (fills.empty()) return {};
    if (Status s = resolve(rt, storage); !s) return s;
    while (!fills.empty()) {
      const std::size_t n = fills.size() < 1024 ? fills.size() : 1024;
      const std::span<const SlotFill> part = fills.first(n);
      fills = fills.subspan(n);
      if (Status s = launch_tier(rt, stream, part); !s) return s;
    }
    return {};
  }

 private:
  // Source/destination bases and item shapes of the storage's copy regions; computed once per
  // storage (the pools never move), device addresses of the host pools through
  // cudaHostGetDevicePointer.
  template <class Storage>
  Status resolve(CudaRuntime& rt, const Storage& storage) noexcept {
    const CopyRegions& regions = storage.copy_regions();
    const void* key = regions.count != 0 ? regions.regions[0].host_base : nullptr;
    if (key == resolved_for_) return {};
    if (regions.count > static_cast<std::size_t>(device::gather_max_tensors)) {
      return Status::format(ErrorCode::invalid_argument, "Gather staging: %zu copy regions, the kernel takes at most %d",
                            regions.count, device::gather_max_tensors);
    }
    header_ = Header{};
    for (const CopyRegion& r : regions) {
      if (Status s = add_region(rt, r); !s) return s;
    }
    resolved_for_ = key;
    return {};
  }

  Status add_region(CudaRuntime& rt, const CopyRegion& region) noexcept {
    // Host and slot rows have their own strides (a scatter from an expert-major host pool into
    // per-tensor slot arrays has host_stride = blob, slot_stride = tensor bytes); a row wider
    // than either stride would overlap the next one.
    if (region.bytes > region.host_stride || region.bytes > region.slot_stride) {
      return Status::format(ErrorCode::invalid_argument,
                            "Gather staging: a copy region of %zu bytes is wider than its host stride (%zu) or slot stride (%zu)",
                            region.bytes, region.host_stride, region.slot_stride);
    }
    Result<const void*> src = rt.device_pointer(region.host_base);
    if (!src.ok()) {
      return src.status().with_context(
          "Gather staging needs mapped pinned host pools (cudaHostAllocMapped / cudaHostRegisterMapped)");
    }
    const std::size_t copy_bytes = region.bytes;
    const auto s = reinterpret_cast<std::uintptr_t>(src.value());
    const auto d = reinterpret_cast<std::uintptr_t>(region.slot_base);
    const std::uintptr_t bits = s | d | region.host_stride | region.slot_stride;
    const std::uint32_t width = (bits % 16 == 0) ? 16 : (bits % 4 == 0) ? 4 : 1;
    device::GatherTensor& g = header_.tensors[header_.num_tensors];
    g.src = static_cast<const unsigned char*>(src.value());
    g.dst = reinterpret_cast<unsigned char*>(region.slot_base);
    g.src_stride = region.host_stride;
    g.dst_stride = region.slot_stride;
    g.copy_bytes = copy_bytes;
    g.width = width;
    g.items = static_cast<std::uint32_t>((copy_bytes + width - 1) / width);
    header_.item_begin[header_.num_tensors] = header_.items_per_fill;
    header_.items_per_fill += g.items;
    ++header_.num_tensors;
    header_.item_begin[header_.num_tensors] = header_.items_per_fill;
    return {};
  }

  // The smallest parameter block that holds the fills (fewer parameter bytes per launch).
  Status launch_tier(CudaRuntime& rt, cudaStream_t stream, std::span<const SlotFill> fills) noexcept {
    if (fills.size() <= 16) return launch<16>(rt, stream, fills);
    if (fills.size() <= 128) return launch<128>(rt, stream, fills);
    return launch<1024>(rt, stream, fills);
  }

  template <int MaxFills>
  Status launch(CudaRuntime& rt, cudaStream_t stream, std::span<const SlotFill> fills) noexcept {
    device::FillGatherParams<MaxFills>& p = params<MaxFills>();
    for (int t = 0; t < device::gather_max_tensors; ++t) p.tensors[t] = header_.tensors[t];
    for (int t = 0; t <= device::gather_max_tensors; ++t) p.item_begin[t] = header_.item_begin[t];
    p.num_tensors = header_.num_tensors;
    p.items_per_fill = header_.items_per_fill;
    p.num_fills = static_cast<std::uint32_t>(fills.size());
    for (std::size_t i = 0; i < fills.size(); ++i) {
      p.expert[i] = fills[i].expert.value;
      p.slot[i] = fills[i].slot.value;
    }
    const int grid = grid_for(static_cast<std::uint64_t>(p.num_fills) * p.items_per_fill);
    if (Status s = cuda_status(device::launch_fill_gather(p, grid, threads, stream), "fill_gather_kernel launch"); !s) return s;
    return rt.after_enqueue(stream, "fill_gather_kernel");
  }

  // Parameter blocks live in the policy (no stack frame of 8 KiB, no allocation per call);
  // the launch copies them, so reusing them for the next prepare is safe.
  template <int MaxFills>
  device::FillGatherParams<MaxFills>& params() noexcept {
    if constexpr (MaxFills == 16) return small_;
    else if constexpr (MaxFills == 128) return medium_;
    else return large_;
  }

  struct Header {
    device::GatherTensor tensors[device::gather_max_tensors]{};
    std::uint32_t item_begin[device::gather_max_tensors + 1]{};
    std::uint32_t num_tensors = 0;
    std::uint32_t items_per_fill = 0;
  };

  const void* resolved_for_ = nullptr;
  Header header_{};
  device::FillGatherParams<16> small_{};
  device::FillGatherParams<128> medium_{};
  device::FillGatherParams<1024> large_{};
};

static_assert(staging_policy_for<Gather, CudaRuntime, TensorMajorStorage>);
static_assert(staging_policy_for<Gather, CudaRuntime, ExpertMajorStorage>);
static_assert(staging_policy_for<Gather, CudaRuntime, ExpertMajorHostStorage>);

}  // namespace expert_cache::inline v0
