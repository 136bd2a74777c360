#pragma once
// The CUDA tier of AnyExpertCache (needs nvcc): make_expert_cache<CudaRuntime> also offers
// staging "gather" (staging/gather.cuh) and, where device/device_cache_cuda.cuh is present,
// provider "device" on the GPU (its plan executor). Include this header INSTEAD of
// any_cache.hpp in a CUDA translation unit, before any use of make_expert_cache<CudaRuntime>:
// the staging list is a specialisation that must be visible at the factory's instantiation.
#if !defined(__CUDACC__)
#error "expert_cache/any_cache_cuda.cuh needs nvcc (host code: expert_cache/any_cache.hpp)"
#endif

#include "expert_cache/runtime/cuda_runtime.hpp"
#include "expert_cache/staging/gather.cuh"
#if __has_include("expert_cache/device/device_cache_cuda.cuh")
#include "expert_cache/device/device_cache_cuda.cuh"
#endif
#include "expert_cache/any_cache.hpp"

namespace expert_cache::inline v0 {

template <>
struct AnyCacheStagings<CudaRuntime> {
  using type = detail::TypeList<Inline, CopyStream, Batched, Gather>;
};

// Compiled mode (docs/any_cache.md): instantiated once, in expert_cache/compiled/any_cache_cuda.cu.
#if defined(EXPERT_CACHE_SEPARATE_COMPILATION)
extern template Result<AnyExpertCache<CudaRuntime>> make_expert_cache<CudaRuntime>(CudaRuntime& rt,
                                                                                   const AnyCacheConfig& config);
#endif

}  // namespace expert_cache::inline v0
