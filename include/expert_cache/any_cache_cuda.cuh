#pragma once
// The CUDA tier of AnyExpertCache (needs nvcc): make_expert_cache<CudaRuntime> also offers
// staging "gather" (staging/gather.cuh) and, where device/device_cache_cuda.cuh is present,
// provider "device" on the GPU (its plan executor). Include this header INSTEAD of
// any_cache.hpp in a CUDA translation unit, before any use of make_expert_cache<CudaRuntime>:
// the staging list is a specialisation that must be visible at the factory's instantiation.
#if !defined(__CUDACC__)
#error "expert_cache/any_cache_cuda.cuh needs nvcc (host code: expert_cache/any_cache.hpp)"
#endif

//
// Compiled mode (docs/any_cache.md, EXPERT_CACHE_SEPARATE_COMPILATION): a user translation unit
// only declares make_expert_cache<CudaRuntime>, so this header then brings neither the gather
// kernel nor the device planner's kernels (compiling those for the device is most of what it
// costs under nvcc); include staging/gather.cuh or device/device_cache_cuda.cuh where you use
// them directly. The instantiation unit (compiled/any_cache_cuda.cu) defines
// EXPERT_CACHE_ANY_CACHE_INSTANTIATION and gets everything.

#include "expert_cache/runtime/cuda_runtime.hpp"
#if !defined(EXPERT_CACHE_SEPARATE_COMPILATION) || defined(EXPERT_CACHE_ANY_CACHE_INSTANTIATION)
#include "expert_cache/staging/gather.cuh"
#if __has_include("expert_cache/device/device_cache_cuda.cuh")
#include "expert_cache/device/device_cache_cuda.cuh"
#endif
#endif
#include "expert_cache/any_cache.hpp"

namespace expert_cache::inline v0 {

#if !defined(EXPERT_CACHE_SEPARATE_COMPILATION) || defined(EXPERT_CACHE_ANY_CACHE_INSTANTIATION)
template <>
struct AnyCacheStagings<CudaRuntime> {
  using type = detail::TypeList<Inline, CopyStream, Batched, Gather>;
};
#endif

#if defined(EXPERT_CACHE_SEPARATE_COMPILATION)
// Also the non-virtual calls: instantiated here they would cast to the types this translation unit
// sees, which lack gather and the device planner.
extern template Result<AnyExpertCache<CudaRuntime>> make_expert_cache<CudaRuntime>(CudaRuntime& rt, const AnyCacheConfig& config);
extern template Result<ForwardView> detail::any_call_prepare_unique<CudaRuntime>(detail::AnyCacheBase<CudaRuntime>&, bool,
                                                                  std::span<const std::int32_t>, CudaRuntime::Stream) noexcept;
extern template Result<ForwardView> detail::any_call_prepare_group<CudaRuntime>(detail::AnyCacheBase<CudaRuntime>&, bool, std::int32_t,
                                                                 CudaRuntime::Stream) noexcept;
extern template Result<WideSummary> detail::any_call_prepare_wide<CudaRuntime>(detail::AnyCacheBase<CudaRuntime>&, bool,
                                                                std::span<const std::int32_t>, CudaRuntime::Stream,
                                                                detail::WideConsumerRef, WideOptions) noexcept;
extern template Result<PrefetchView> detail::any_call_prefetch<CudaRuntime>(detail::AnyCacheBase<CudaRuntime>&, bool,
                                                             std::span<const std::int32_t>, CudaRuntime::Stream,
                                                             PrefetchOptions) noexcept;
extern template Result<PrefetchView> detail::any_call_prefetch_device<CudaRuntime>(detail::AnyCacheBase<CudaRuntime>&, bool,
                                                                    const std::int32_t*, std::int32_t, CudaRuntime::Stream,
                                                                    PrefetchOptions) noexcept;
#endif

}  // namespace expert_cache::inline v0
