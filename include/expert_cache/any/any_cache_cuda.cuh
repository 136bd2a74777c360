#pragma once
/// The CUDA tier of AnyExpertCache: make_expert_cache<CudaRuntime> with the Gather staging and the device provider.
// The CUDA tier of AnyExpertCache (needs nvcc): make_expert_cache<CudaRuntime> also offers
// staging "gather" (staging/gather_staging.cuh) and, where device_cache/cuda_executor.cuh is present,
// provider "device" on the GPU (its plan executor). Include this header INSTEAD of
// any/any_cache.hpp in a CUDA translation unit, before any use of make_expert_cache<CudaRuntime>:
// the staging list is a specialisation that must be visible at the factory's instantiation.
#if !defined(__CUDACC__)
#error "expert_cache/any/any_cache_cuda.cuh needs nvcc (host code: expert_cache/any/any_cache.hpp)"
#endif

//
// Compiled mode (docs/any_cache.md, EXPERT_CACHE_SEPARATE_COMPILATION): a user translation unit
// only declares make_expert_cache<CudaRuntime>, so this header then brings neither the gather
// kernel nor the device planner's kernels (compiling those for the device is most of what it
// costs under nvcc); include staging/gather_staging.cuh or device_cache/cuda_executor.cuh where you use
// them directly. The instantiation unit (src/any_cache_cuda.cu) defines
// EXPERT_CACHE_ANY_CACHE_INSTANTIATION and gets everything.

#include "expert_cache/runtime/cuda_runtime.hpp"
#if !defined(EXPERT_CACHE_SEPARATE_COMPILATION) || defined(EXPERT_CACHE_ANY_CACHE_INSTANTIATION)
#include "expert_cache/staging/gather_staging.cuh"
#if __has_include("expert_cache/device_cache/cuda_executor.cuh")
#include "expert_cache/device_cache/cuda_executor.cuh"
#endif
#endif
#include "expert_cache/any/any_cache.hpp"

namespace expert_cache::inline v0 {

#if !defined(EXPERT_CACHE_SEPARATE_COMPILATION) || defined(EXPERT_CACHE_ANY_CACHE_INSTANTIATION)
template <>
struct AnyCacheStagings<CudaRuntime> {
  using type = detail::TypeList<Inline, CopyStream, Batched, Gather>;
};
#endif

#if (!defined(EXPERT_CACHE_SEPARATE_COMPILATION) || defined(EXPERT_CACHE_ANY_CACHE_INSTANTIATION)) && \
    __has_include("expert_cache/device_cache/cuda_executor.cuh")
// The current device's profile (link_profile_for: measured once per process), which the device
// provider's default storage follows; none when it cannot be measured (the executor then reports why).
template <>
struct detail::AnyLinkProfileSource<CudaRuntime> {
  static std::optional<LinkProfile> measure(std::uint64_t expert_bytes) noexcept {
    int device = 0;
    LinkProfile p;
    if (cudaGetDevice(&device) != cudaSuccess || !link_profile_for(device, expert_bytes, p).ok()) {
      (void)cudaGetLastError();
      return std::nullopt;
    }
    return p;
  }
};
#endif

#if defined(EXPERT_CACHE_SEPARATE_COMPILATION)
// Also the non-virtual calls: instantiated here they would cast to the types this translation unit
// sees, which lack gather and the device planner.
EXPERT_CACHE_ANY_CACHE_INSTANTIATIONS(extern, CudaRuntime);
#endif

}  // namespace expert_cache::inline v0
