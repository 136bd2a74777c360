#pragma once
/// Umbrella header of the CUDA tier: CudaRuntime (host compiler + CUDA include dir suffice) and,
/// under nvcc, the Gather staging policy.
// Standard instantiations on the CUDA runtime:
//   CudaRowCache          tensor-major pools, Lru, per-tensor copies on the copy stream
//   CudaWholeExpertCache  expert-major pools, Lfru, one copy per miss on the copy stream
//   CudaGatherRowCache    tensor-major pools, Lru, one gather kernel per prepare (capturable)
// and the recommended ones (docs/policies.md "Choosing a policy"):
//   CudaRecommendedRowCache, CudaRecommendedWholeExpertCache (Lrfu), CudaRecommendedModelCache
//   (LayerShare), and under nvcc CudaRecommendedGatherRowCache (Lrfu)
// Streams can come in as cuda::stream_ref (to_cuda_stream) where libcu++ is available.
#include "expert_cache/cache/cuda_presets.hpp"
#include "expert_cache/expert_cache.hpp"
#include "expert_cache/runtime/cuda_error.hpp"
#include "expert_cache/runtime/cuda_runtime.hpp"

#if defined(__CUDACC__)
#include "expert_cache/staging/gather_staging.cuh"
#endif

#if defined(__has_include)
#if __has_include(<cuda/stream_ref>)
#include <cuda/stream_ref>
#define EXPERT_CACHE_HAS_STREAM_REF 1
#endif
#endif

namespace expert_cache::inline v0 {

#if defined(EXPERT_CACHE_HAS_STREAM_REF)
/// prepare(ids, to_cuda_stream(ref)) for callers holding a cuda::stream_ref.
/// @param stream  a libcu++ stream reference
/// @return the cudaStream_t it refers to
[[nodiscard]] inline cudaStream_t to_cuda_stream(::cuda::stream_ref stream) noexcept { return stream.get(); }
#endif

}  // namespace expert_cache::inline v0
