#pragma once
/// Caller-owned memory for a storage (CacheOptions::memory, or the storages' last constructor
/// argument).
// Empty fields mean "the storage allocates it from the runtime".
//
//   host_tensors[t]  tensor-major host pools: tensor t of every expert, one [E, bytes_t] array
//                    per tensor (an engine's weight tensors as they are), exactly
//                    num_experts * bytes_per_expert bytes each;
//   host_pool        expert-major host pool: one [E, blob] array, exactly num_experts *
//                    blob_bytes (each tensor at its 16-byte aligned offset in the blob; the
//                    storage's static blob_layout() says where);
//   slot_workspace   device memory the slots are carved from, at least the storage's
//                    slot_workspace_bytes(shape, tensors) bytes.
//
// Host memory is registered at its exact size (CudaRuntime: cudaHostRegister Mapped|Portable,
// so copies are DMA and the Gather kernel can read it zero-copy) and unregistered when the
// storage is destroyed; set host_registered when the caller has pinned and mapped it already.
// It is never copied and never written by the storage. Nothing here is ever freed by the cache.
//
// Requirements, checked before anything is allocated or registered (ErrorCode::invalid_argument
// naming the tensor and the problem): no null pointer with a size; exact host sizes; bases
// aligned to caller_memory_alignment (16 bytes: the Gather and device-planned fill kernels copy
// with 16-byte vector loads/stores only when bases and strides are 16-byte aligned, and Marlin
// reads its tensors with 16-byte loads); host spans of different tensors do not overlap.
// Host-only (plain data).
#include <array>
#include <cstddef>

#include "expert_cache/base/tensor_bytes.hpp"

namespace expert_cache::inline v0 {

/// Alignment every caller base must have (16 bytes: see the requirements above).
inline constexpr std::size_t caller_memory_alignment = 16;

/// Caller memory: a pointer and a size (host or device).
struct MemorySpan {
  void* data = nullptr;
  std::size_t bytes = 0;
  /// True for the default span: no pointer and no size ("allocate it").
  [[nodiscard]] constexpr bool empty() const noexcept { return data == nullptr && bytes == 0; }
};

/// The caller memory one storage adopts; every field is optional (see the top of this header).
struct StorageMemory {
  std::array<MemorySpan, max_expert_tensors> host_tensors{};  // tensor-major host layouts
  MemorySpan host_pool{};                                     // expert-major host layouts
  bool host_registered = false;  // the caller's host memory is already pinned + mapped
  MemorySpan slot_workspace{};   // device memory for the slots

  /// True when any tensor-major host span is given.
  [[nodiscard]] constexpr bool caller_host_tensors() const noexcept {
    for (const MemorySpan& s : host_tensors)
      if (!s.empty()) return true;
    return false;
  }
};

}  // namespace expert_cache::inline v0
