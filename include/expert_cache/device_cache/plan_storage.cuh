#pragma once
/// DevicePlanStorage: owns one device plan state on the GPU (needs nvcc): the array block
/// (cudaMalloc) and the stats + error word in mapped pinned host memory, readable by the host
/// while kernels run. The CUDA executor holds one; kernel-level tests and benchmarks use it alone.
#if !defined(__CUDACC__)
#error "expert_cache/device_cache/plan_storage.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "expert_cache/base/config.hpp"
#include "expert_cache/kernels/plan_kernels.cuh"
#include "expert_cache/planning/device_plan.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

// Owns one state on the device: the array block (cudaMalloc) and the stats + error word in
// mapped pinned host memory, readable by the host while kernels run. Move-only.
class DevicePlanStorage {
 public:
  DevicePlanStorage() = default;
  DevicePlanStorage(const DevicePlanStorage&) = delete;
  DevicePlanStorage& operator=(const DevicePlanStorage&) = delete;
  DevicePlanStorage(DevicePlanStorage&& o) noexcept { swap(o); }
  DevicePlanStorage& operator=(DevicePlanStorage&& o) noexcept {
    if (this != &o) {
      release();
      swap(o);
    }
    return *this;
  }
  ~DevicePlanStorage() { release(); }

  // Allocates and enqueues the reset on `stream` (the state is empty once it ran), for the
  // policy that will plan it (its free-slot order) and DeviceCrf's decay (reset_plan_state).
  template <device_plan_policy Policy = DeviceLru>
  [[nodiscard]] cudaError_t create(std::int32_t num_experts, std::int32_t capacity, cudaStream_t stream,
                                   std::uint64_t crf_decay = crf_default_decay_q32) noexcept {
    release();
    const std::size_t bytes = plan_state_bytes(num_experts, capacity);
    if (bytes == 0 || capacity > num_experts) return cudaErrorInvalidValue;
    cudaError_t err = cudaMalloc(&block_, bytes);
    if (err != cudaSuccess) return fail(err);
    bytes_ = bytes;
    err = cudaHostAlloc(reinterpret_cast<void**>(&words_), sizeof(MappedWords), cudaHostAllocMapped | cudaHostAllocPortable);
    if (err != cudaSuccess) return fail(err);
    *words_ = MappedWords{};
    MappedWords* dev_words = nullptr;
    err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_words), words_, 0);
    if (err != cudaSuccess) return fail(err);
    state_ = bind_plan_state(block_, num_experts, capacity, &dev_words->stats, &dev_words->error_word);
    err = launch_plan_reset<plan_block_threads, Policy>(state_, stream, crf_decay);
    return err == cudaSuccess ? err : fail(err);
  }

  // DeviceCrf's prior bias (plan_set_bias's table: one Q32 value per expert), copied into the
  // state after the work already enqueued on `stream` and before any later work there. A table
  // of the wrong length, or none, is refused (cudaErrorInvalidValue) and nothing is copied.
  // Synchronises `stream` (the host table need not outlive the call); not under capture.
  [[nodiscard]] cudaError_t set_bias(const std::uint64_t* bias, std::int32_t n, cudaStream_t stream) noexcept {
    if (block_ == nullptr || bias == nullptr || n != state_.num_experts) return cudaErrorInvalidValue;
    const cudaError_t err = cudaMemcpyAsync(state_.expert_bias.data, bias, sizeof(std::uint64_t) * static_cast<std::size_t>(n),
                                            cudaMemcpyHostToDevice, stream);
    return err == cudaSuccess ? cudaStreamSynchronize(stream) : err;
  }

  [[nodiscard]] const DevicePlanState& state() const noexcept { return state_; }
  [[nodiscard]] void* device_block() const noexcept { return block_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

  // Host reads of the mapped words, word by word (the device updates them atomically).
  [[nodiscard]] DevicePlanStats stats() const noexcept {
    DevicePlanStats out;
    if (words_ == nullptr) return out;
    const volatile std::uint64_t* w = &words_->stats.hits;
    std::uint64_t* o = &out.hits;
    for (std::size_t i = 0; i < sizeof(DevicePlanStats) / sizeof(std::uint64_t); ++i) o[i] = w[i];
    return out;
  }
  [[nodiscard]] std::uint32_t error_word() const noexcept {
    return words_ == nullptr ? 0u : *static_cast<const volatile std::uint32_t*>(&words_->error_word);
  }
  // Host-side copy of the mapped stats / error word (for binding a host view of the block).
  [[nodiscard]] DevicePlanStats* host_stats() const noexcept { return words_ ? &words_->stats : nullptr; }
  [[nodiscard]] std::uint32_t* host_error_word() const noexcept { return words_ ? &words_->error_word : nullptr; }

 private:
  struct MappedWords {
    DevicePlanStats stats;
    std::uint32_t error_word = 0;
  };
  cudaError_t fail(cudaError_t err) noexcept {
    release();
    return err;
  }
  void release() noexcept {
    if (block_ != nullptr) (void)cudaFree(block_);
    if (words_ != nullptr) (void)cudaFreeHost(words_);
    block_ = nullptr;
    words_ = nullptr;
    bytes_ = 0;
    state_ = DevicePlanState{};
  }
  void swap(DevicePlanStorage& o) noexcept {
    std::swap(block_, o.block_);
    std::swap(words_, o.words_);
    std::swap(bytes_, o.bytes_);
    std::swap(state_, o.state_);
  }
  void* block_ = nullptr;
  MappedWords* words_ = nullptr;
  std::size_t bytes_ = 0;
  DevicePlanState state_{};
};

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
