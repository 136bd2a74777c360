#pragma once
/// The preset cache types on CudaRuntime: the host tier's presets (cache/presets.hpp) with the
/// CUDA runtime and, under nvcc, the ones that fill with the Gather kernel.
//   CudaRowCache          tensor-major pools, Lru, per-tensor copies on the copy stream
//   CudaWholeExpertCache  expert-major pools, Lfru, one copy per miss on the copy stream
//   CudaGatherRowCache    tensor-major pools, Lru, one gather kernel per prepare (capturable)
// and the recommended ones (docs/policies.md "Choosing a policy"):
//   CudaRecommendedRowCache, CudaRecommendedWholeExpertCache (Lrfu), CudaRecommendedModelCache
//   (LayerShare), and under nvcc CudaRecommendedGatherRowCache (Lrfu)
// Host compiler plus CUDA's include directory; the Gather ones need nvcc.
#include "expert_cache/cache/presets.hpp"
#include "expert_cache/runtime/cuda_runtime.hpp"

#if defined(__CUDACC__)
#include "expert_cache/staging/gather_staging.cuh"
#endif

namespace expert_cache::inline v0 {

template <expert_layout Layout>
using CudaRowCache = RowCache<CudaRuntime, Layout>;
template <expert_layout Layout>
using CudaWholeExpertCache = WholeExpertCache<CudaRuntime, Layout>;
// The same with the measured per-layer / global-pool winners (presets.hpp says why).
template <expert_layout Layout>
using CudaRecommendedRowCache = RecommendedRowCache<CudaRuntime, Layout>;
template <expert_layout Layout>
using CudaRecommendedWholeExpertCache = RecommendedWholeExpertCache<CudaRuntime, Layout>;
template <expert_layout Layout>
using CudaRecommendedModelCache = RecommendedModelCache<CudaRuntime, Layout>;
#if defined(__CUDACC__)
template <expert_layout Layout>
using CudaGatherRowCache = ExpertCache<TensorMajorStorage, Lru, Gather, Layout, CudaRuntime>;
// One gather kernel per prepare, per-layer winner policy.
template <expert_layout Layout>
using CudaRecommendedGatherRowCache = ExpertCache<TensorMajorStorage, Lrfu, Gather, Layout, CudaRuntime>;
#endif

}  // namespace expert_cache::inline v0
