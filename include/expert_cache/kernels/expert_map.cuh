#pragma once
/// Device helpers on the consumer side: apply a forward-scoped expert map to top-k ids, gather expert rows.
// Device helpers on the consumer side of the cache (needs nvcc):
//  * map_expert_to_slot / apply_expert_map: apply a forward-scoped expert map (global id -> slot,
//    -1 = not in this forward) to top-k ids. Pairs whose id is out of range, whose map entry is
//    -1, or whose map entry is not a valid slot become -1 (dropped: docs/nvfp4_marlin.md, The consumer's side of the
//    expert map). Safe for any id.
//  * gather_experts_to_slots: copy whole expert rows from a source pool (device memory or mapped
//    pinned host memory, read zero-copy) into slot rows: dst[slot_i] <- src[expert_i].
#if !defined(__CUDACC__)
#error "expert_cache/kernels/expert_map.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "expert_cache/base/config.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/types.hpp"
#include "expert_cache/runtime/cuda_error.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

// Slot of global expert `id`, or absent_slot. The comparison happens in the id's own type, so
// int64 ids beyond the int32 range never wrap into a valid index.
template <class IdT>
EXPERT_CACHE_HOST_DEVICE constexpr std::int32_t map_expert_to_slot(IdT id, const std::int32_t* expert_map,
                                                                   std::int32_t num_experts,
                                                                   std::int32_t capacity) noexcept {
  static_assert(std::is_integral_v<IdT>, "expert ids are integers");
  if constexpr (std::is_signed_v<IdT>) {
    if (id < 0) return absent_slot;
  }
  if (static_cast<std::uint64_t>(id) >= static_cast<std::uint64_t>(num_experts < 0 ? 0 : num_experts))
    return absent_slot;
  const std::int32_t slot = expert_map[static_cast<std::size_t>(id)];
  return (slot >= 0 && slot < capacity) ? slot : absent_slot;
}

// Address of a slot's row in a slot buffer, or nullptr for an absent slot.
template <class T>
EXPERT_CACHE_HOST_DEVICE constexpr T* slot_row(T* base, std::int32_t slot, std::size_t row_elems) noexcept {
  return slot < 0 ? nullptr : base + static_cast<std::size_t>(slot) * row_elems;
}

namespace detail {

template <class IdT>
EXPERT_CACHE_KERNEL void apply_expert_map_kernel(const IdT* ids, std::int64_t count, const std::int32_t* expert_map,
                                        std::int32_t num_experts, std::int32_t capacity, std::int32_t* slots) {
  for (std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += std::int64_t{gridDim.x} * blockDim.x)
    slots[i] = map_expert_to_slot(ids[i], expert_map, num_experts, capacity);
}

// Block y handles pair y; blocks x stride over the row in VecT units.
template <class VecT>
EXPERT_CACHE_KERNEL void gather_rows_kernel(const VecT* src, std::int32_t num_experts, VecT* dst, std::int32_t capacity,
                                   std::size_t row_vecs, const std::int32_t* experts, const std::int32_t* slots) {
  const std::int32_t e = experts[blockIdx.y], s = slots[blockIdx.y];
  if (e < 0 || e >= num_experts || s < 0 || s >= capacity) return;  // dropped pair
  const VecT* from = src + static_cast<std::size_t>(e) * row_vecs;
  VecT* to = dst + static_cast<std::size_t>(s) * row_vecs;
  for (std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < row_vecs;
       i += std::size_t{gridDim.x} * blockDim.x)
    to[i] = from[i];
}

}  // namespace detail

// slots[i] = slot of ids[i] under `expert_map` ([num_experts] device int32), or -1. IdT is
// int32_t or int64_t (vLLM uses both for topk_ids). Enqueued on `stream`.
template <class IdT>
[[nodiscard]] Status apply_expert_map(const IdT* ids, std::int64_t count, const std::int32_t* expert_map,
                                      std::int32_t num_experts, std::int32_t capacity, std::int32_t* slots,
                                      cudaStream_t stream) {
  if (count < 0 || num_experts < 0 || capacity < 0)
    return Status(ErrorCode::invalid_argument, "apply_expert_map: negative count, num_experts or capacity");
  if (count == 0) return {};
  if (!ids || !slots || (num_experts > 0 && !expert_map))
    return Status(ErrorCode::invalid_argument, "apply_expert_map: null pointer");
  const int blocks = static_cast<int>((count + 255) / 256 < 4096 ? (count + 255) / 256 : 4096);
  detail::apply_expert_map_kernel<IdT><<<blocks, 256, 0, stream>>>(ids, count, expert_map, num_experts, capacity, slots);
  EXPERT_CACHE_TRY_CUDA(cudaGetLastError());
  return {};
}

// For each pair i < count: copies row_bytes from src + experts[i]*row_bytes to
// dst + slots[i]*row_bytes; pairs with an expert outside [0, num_experts) or a slot outside
// [0, capacity) are skipped. `experts`/`slots` are device arrays; `src` may be mapped pinned host
// memory (cudaHostAllocMapped / registered, device pointer). Uses 16-byte loads when every
// address and the row size allow it. Slots must be distinct (two pairs writing one slot race).
[[nodiscard]] inline Status gather_experts_to_slots(const void* src, std::int32_t num_experts, void* dst,
                                                    std::int32_t capacity, std::size_t row_bytes,
                                                    const std::int32_t* experts, const std::int32_t* slots,
                                                    std::int32_t count, cudaStream_t stream) {
  if (count < 0 || num_experts < 0 || capacity < 0)
    return Status(ErrorCode::invalid_argument, "gather_experts_to_slots: negative count, num_experts or capacity");
  if (count == 0 || row_bytes == 0) return {};
  if (!src || !dst || !experts || !slots)
    return Status(ErrorCode::invalid_argument, "gather_experts_to_slots: null pointer");
  if (count > 65535) return Status(ErrorCode::invalid_argument, "gather_experts_to_slots: at most 65535 pairs per call");
  const bool vec16 = row_bytes % 16 == 0 && reinterpret_cast<std::uintptr_t>(src) % 16 == 0 &&
                     reinterpret_cast<std::uintptr_t>(dst) % 16 == 0;
  const std::size_t unit = vec16 ? 16 : 1;
  const std::size_t row_units = row_bytes / unit;
  const dim3 grid(static_cast<unsigned>(row_units / 256 + 1 < 64 ? row_units / 256 + 1 : 64), static_cast<unsigned>(count));
  if (vec16) {
    detail::gather_rows_kernel<uint4><<<grid, 256, 0, stream>>>(static_cast<const uint4*>(src), num_experts,
                                                                 static_cast<uint4*>(dst), capacity, row_units,
                                                                 experts, slots);
  } else {
    detail::gather_rows_kernel<unsigned char><<<grid, 256, 0, stream>>>(
        static_cast<const unsigned char*>(src), num_experts, static_cast<unsigned char*>(dst), capacity, row_units,
        experts, slots);
  }
  EXPERT_CACHE_TRY_CUDA(cudaGetLastError());
  return {};
}

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
