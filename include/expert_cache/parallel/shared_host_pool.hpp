#pragma once
/// ONE host pool per layer shared by every rank of a host (docs/parallel.md).
// Each expert byte is stored once; every rank's cache adopts its part through StorageMemory
// (tensor-major host spans at their exact size, host_registered = true), so no rank copies or
// re-registers anything.
//
// The pool registers each tensor array once through the runtime (CudaRuntime: cudaHostRegister
// Mapped | Portable, so the pinning is valid for every device and context of the process) and
// unregisters it when destroyed. It must outlive every cache built over it.
//
// Arrangement per tensor t (b = the rank layout's bytes_per_expert of t):
//   expert parallel  [P][b] in the placement's storage order (rank-major, local order; with
//                    contiguous ranges that is the physical order), each rank's run starting at a
//                    64-byte boundary (StorageMemory requires 16-byte aligned bases; a 4-byte global
//                    scale tensor gets a few bytes of padding between ranks, nothing else does when
//                    b is a multiple of 64);
//   tensor slice     sliced tensors [TP][E][b] (rank r's [E][b] at r * E * b, rounded up to 64),
//                    replicated tensors (tp_replicated: the global scales) [E][b] once, shared.
// Host-only; compiles with g++ alone.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/parallel/expert_placement.hpp"
#include "expert_cache/parallel/tp_slice.hpp"
#include "expert_cache/storage/slot_storage.hpp"
#include "expert_cache/storage/storage_memory.hpp"

namespace expert_cache::inline v0 {

/// One layer's host pool for every rank of a host, each expert byte stored once.
template <class R>
class SharedHostPool {
 public:
  static constexpr std::size_t run_alignment = 64;
  static constexpr std::int32_t max_ranks = 64;  // ranks of one host
  static constexpr std::size_t page_bytes = 4096;

  /// Allocates and registers the pool.
  /// @param rt            the runtime that registers the pool; it must outlive the pool
  /// @param placement     the layer's placement (copied)
  /// @param rank_tensors  the tensors of ONE rank's layout (expert parallel: the layer's layout;
  ///                      tensor slice: tp_slice_layout(full, TP))
  /// @throws Error invalid_argument for more than max_ranks ranks; the runtime's error when it
  ///         refuses a registration (earlier ones are undone); when memory runs out
  SharedHostPool(R& rt, const ExpertPlacement& placement, const ExpertTensorBytes& rank_tensors)
      : placement_(placement), tensors_(rank_tensors) {
    const std::int32_t W = placement.world_size();
    if (W > max_ranks)
      throw Error(ErrorCode::invalid_argument, "shared host pool: world_size " + std::to_string(W) + " > " + std::to_string(max_ranks));
    for (std::size_t t = 0; t < max_expert_tensors; ++t) {
      const std::size_t b = tensors_[t].bytes_per_expert;
      if (b == 0) continue;
      std::size_t at = 0;
      for (std::int32_t r = 0; r < W; ++r) {
        offset_[t][static_cast<std::size_t>(r)] = at;
        if (shared(t) && r > 0) {
          offset_[t][static_cast<std::size_t>(r)] = 0;  // the one copy every rank reads
          continue;
        }
        at += round_up(rank_experts(r) * b);
      }
      bytes_[t] = at;
      // Whole pages per tensor: cudaHostRegister pins whole pages, and a registration overlapping
      // pages another one pinned can be refused (cudaErrorHostMemoryAlreadyRegistered).
      const std::size_t alloc = (at + page_bytes - 1) / page_bytes * page_bytes;
      data_[t].reset(static_cast<std::byte*>(::operator new(alloc, std::align_val_t{page_bytes})));
      std::memset(data_[t].get(), 0, alloc);
      reg_[t] = detail::HostRegistration<R>(rt, data_[t].get(), at, "the shared host pool's " + std::string(tensors_[t].name));
    }
  }
  SharedHostPool(const SharedHostPool&) = delete;
  SharedHostPool& operator=(const SharedHostPool&) = delete;
  ~SharedHostPool() {
    for (auto& r : reg_) r = detail::HostRegistration<R>();  // unregister before the memory goes
  }

  [[nodiscard]] const ExpertPlacement& placement() const noexcept { return placement_; }
  [[nodiscard]] const ExpertTensorBytes& tensors() const noexcept { return tensors_; }
  [[nodiscard]] std::size_t host_bytes(std::size_t t) const noexcept { return bytes_[t]; }
  [[nodiscard]] std::size_t host_bytes() const noexcept {
    std::size_t s = 0;
    for (std::size_t b : bytes_) s += b;
    return s;
  }

  /// Where rank `rank`'s copy of tensor t of physical expert `physical` lives (write the weights
  /// here at load: expert parallel, the owner's run; tensor slice, the rank's slice).
  [[nodiscard]] std::byte* expert(std::size_t t, std::int32_t rank, std::int32_t physical) noexcept {
    const std::size_t b = tensors_[t].bytes_per_expert;
    const std::int32_t row = placement_.sharding() == Sharding::expert_parallel
                                 ? placement_.local_of(physical)
                                 : physical;
    const std::int32_t at_rank = placement_.sharding() == Sharding::expert_parallel ? placement_.owner_of(physical) : rank;
    return data_[t].get() + offset_[t][static_cast<std::size_t>(at_rank)] + static_cast<std::size_t>(row) * b;
  }

  /// Rank `rank`'s caller memory for its cache (CacheOptions::memory): one span per present
  /// tensor, exactly its experts' bytes, already registered (host_registered = true).
  [[nodiscard]] StorageMemory rank_memory(std::int32_t rank) const noexcept {
    StorageMemory m;
    m.host_registered = true;
    for (std::size_t t = 0; t < max_expert_tensors; ++t) {
      const std::size_t b = tensors_[t].bytes_per_expert;
      if (b == 0) continue;
      m.host_tensors[t] = MemorySpan{data_[t].get() + offset_[t][static_cast<std::size_t>(rank)],
                                     static_cast<std::size_t>(rank_experts(rank)) * b};
    }
    return m;
  }

 private:
  struct AlignedFree {
    void operator()(std::byte* p) const noexcept { ::operator delete(p, std::align_val_t{page_bytes}); }
  };
  [[nodiscard]] bool shared(std::size_t t) const noexcept {
    return placement_.sharding() == Sharding::tensor_slice && tp_replicated(tensors_[t].name);
  }
  [[nodiscard]] std::size_t rank_experts(std::int32_t r) const noexcept {
    return static_cast<std::size_t>(placement_.num_local(r));
  }
  static std::size_t round_up(std::size_t x) noexcept { return (x + run_alignment - 1) / run_alignment * run_alignment; }

  ExpertPlacement placement_;
  ExpertTensorBytes tensors_;
  std::array<std::unique_ptr<std::byte, AlignedFree>, max_expert_tensors> data_{};
  std::array<std::size_t, max_expert_tensors> bytes_{};
  std::array<std::array<std::size_t, max_ranks>, max_expert_tensors> offset_{};
  std::array<detail::HostRegistration<R>, max_expert_tensors> reg_{};
};

}  // namespace expert_cache::inline v0
