#pragma once
/// The SM-load fill kernel: copies one prepare's misses from mapped pinned host memory into their slots.
// The Gather staging kernel (needs nvcc): copies every miss of one prepare() from mapped pinned
// host memory (read zero-copy over PCIe by the SMs) into its slot, in ONE launch.
//
// The fill list travels as a __grid_constant__ kernel parameter (FillGatherParams), so a launch
// needs no device descriptor buffer and no upload, and a captured launch keeps its own copy of
// the list in the graph node. Work item = one `width`-byte piece of one tensor row of one fill;
// width is 16 (int4 loads/stores) when the row bases and both strides are 16-byte aligned, else
// 4 or 1; a row's last item copies the remaining tail byte by byte. Source and destination rows
// have their own strides, so a fill may scatter an expert-major host blob into per-tensor slot
// arrays (host stride = blob bytes, slot stride = tensor bytes) at the same speed: one extra
// multiply per item, the loads and stores unchanged.
#if !defined(__CUDACC__)
#error "expert_cache/kernels/fill_copy.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/storage/copy_region.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

// One copy region of the storage: a tensor, or the whole blob (expert-major storage).
struct GatherTensor {
  const unsigned char* src = nullptr;  // device address of expert 0's row in mapped host memory
  unsigned char* dst = nullptr;        // slot 0's row in device memory
  std::uint64_t src_stride = 0;        // bytes from expert e to e + 1
  std::uint64_t dst_stride = 0;        // bytes from slot s to s + 1
  std::uint64_t copy_bytes = 0;        // bytes copied per row (<= both strides)
  std::uint32_t width = 16;            // bytes per work item: 16, 4 or 1
  std::uint32_t items = 0;             // work items per row: ceil(copy_bytes / width)
};

inline constexpr int gather_max_tensors = static_cast<int>(max_copy_regions);

template <int MaxFills>
struct FillGatherParams {
  GatherTensor tensors[gather_max_tensors];
  std::uint32_t item_begin[gather_max_tensors + 1];  // first item of each tensor inside a fill
  std::uint32_t num_tensors;
  std::uint32_t items_per_fill;
  std::uint32_t num_fills;
  std::int32_t expert[MaxFills];
  std::int32_t slot[MaxFills];
};

namespace detail {

// One work item of `width` bytes (16, 4 or 1) with `left` bytes to its row's end. A 16-byte item
// is loaded into `v` and its destination returned through `dst16` (true), so the caller can keep
// several loads in flight before the stores; a 4- or 1-byte item, or a row's tail, is copied here.
// Also the item copy of the device planner's fill (kernels/plan_fill.cuh).
__device__ __forceinline__ bool copy_item(const void* src_v, void* dst_v, std::uint32_t width, std::uint64_t left,
                                          int4& v, int4*& dst16) {
  const auto* src = static_cast<const unsigned char*>(src_v);
  auto* dst = static_cast<unsigned char*>(dst_v);
  if (width == 16 && left >= 16) {
    v = __ldcs(reinterpret_cast<const int4*>(src));  // streamed: host bytes are read once
    dst16 = reinterpret_cast<int4*>(dst);
    return true;
  }
  if (width == 4 && left >= 4) {
    *reinterpret_cast<std::uint32_t*>(dst) = __ldcs(reinterpret_cast<const unsigned int*>(src));
    return false;
  }
  const std::uint64_t n = left < width ? left : width;  // a row's tail, or width 1
  for (std::uint64_t i = 0; i < n; ++i) dst[i] = src[i];
  return false;
}

// This block's share of `total` work items (grid-stride), `Ilp` 16-byte loads in flight per
// thread before the stores. locate(idx, v, dst16) is a copy_item of item idx.
template <int Ilp, class Locate>
__device__ __forceinline__ void copy_items(std::uint64_t total, Locate locate) {
  const std::uint64_t first = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x * Ilp;
  if (first >= total) return;  // the common short list: most blocks leave here
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x * Ilp;
  for (std::uint64_t base = first + threadIdx.x; base < total; base += stride) {
    int4 v[Ilp];
    int4* dst[Ilp];
#pragma unroll
    for (int j = 0; j < Ilp; ++j) {
      dst[j] = nullptr;
      const std::uint64_t idx = base + static_cast<std::uint64_t>(j) * blockDim.x;
      if (idx < total) (void)locate(idx, v[j], dst[j]);
    }
#pragma unroll
    for (int j = 0; j < Ilp; ++j) {
      if (dst[j] != nullptr) *dst[j] = v[j];
    }
  }
}

// Locates and copies one work item of the fill list.
template <int MaxFills>
__device__ __forceinline__ bool locate_item(const FillGatherParams<MaxFills>& p, std::uint64_t idx, int4& v,
                                            int4*& dst16) {
  const auto fill = static_cast<std::uint32_t>(idx / p.items_per_fill);
  const auto r = static_cast<std::uint32_t>(idx - static_cast<std::uint64_t>(fill) * p.items_per_fill);
  std::uint32_t t = 0;
  while (t + 1 < p.num_tensors && r >= p.item_begin[t + 1]) ++t;
  const GatherTensor& g = p.tensors[t];
  const std::uint64_t offset = static_cast<std::uint64_t>(r - p.item_begin[t]) * g.width;
  const unsigned char* src = g.src + static_cast<std::uint64_t>(p.expert[fill]) * g.src_stride + offset;
  unsigned char* dst = g.dst + static_cast<std::uint64_t>(p.slot[fill]) * g.dst_stride + offset;
  return copy_item(src, dst, g.width, g.copy_bytes - offset, v, dst16);
}

}  // namespace detail

// Grid-stride over all items of all fills, `Ilp` 16-byte loads in flight per thread.
template <int MaxFills, int Ilp = 4>
EXPERT_CACHE_KERNEL void __launch_bounds__(512) fill_gather_kernel(const __grid_constant__ FillGatherParams<MaxFills> p) {
  detail::copy_items<Ilp>(static_cast<std::uint64_t>(p.num_fills) * p.items_per_fill,
                          [&p](std::uint64_t idx, int4& v, int4*& dst16) { return detail::locate_item(p, idx, v, dst16); });
}

// Launches the kernel on `stream` (capturable). Returns the launch's error code.
template <int MaxFills>
cudaError_t launch_fill_gather(const FillGatherParams<MaxFills>& params, int blocks, int threads,
                               cudaStream_t stream) noexcept {
  void* args[] = {const_cast<FillGatherParams<MaxFills>*>(&params)};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&fill_gather_kernel<MaxFills>), dim3(static_cast<unsigned>(blocks)),
                          dim3(static_cast<unsigned>(threads)), args, 0, stream);
}

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
