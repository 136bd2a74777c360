#pragma once
/// The preset cache types of the host tier: the two standard instantiations and the three
/// recommended ones, as aliases of ExpertCache and ModelExpertCache.
//   RowCache          tensor-major host pools (one row per expert in each tensor), Lru,
//                     fills as per-tensor copies on the cache-owned copy stream: the row provider.
//   WholeExpertCache  the cached provider's policy (Lfru, its exact hit/miss behaviour) with
//                     expert-major storage, so a miss is ONE transfer, on the cache-owned copy
//                     stream. The copy stream (not the cached provider's inline copies) lets
//                     fills overlap earlier work on the consumer stream; use
//                     ExpertCache<ExpertMajorStorage, Lfru, Inline, ...> for inline copies.
// The recommended ones (docs/policies.md "Choosing a policy") differ from the standard ones only
// in the eviction policy:
//   RecommendedRowCache          RowCache with Lrfu
//   RecommendedWholeExpertCache  WholeExpertCache with Lrfu
//   RecommendedModelCache        ModelExpertCache (tensor-major, copy stream) with LayerShare
// cache/cuda_presets.hpp names the same on CudaRuntime.
#include "expert_cache/base/concepts.hpp"
#include "expert_cache/cache/expert_cache.hpp"
#include "expert_cache/cache/model_cache.hpp"
#include "expert_cache/eviction/layer_share.hpp"
#include "expert_cache/eviction/lfru.hpp"
#include "expert_cache/eviction/lrfu.hpp"
#include "expert_cache/eviction/lru.hpp"
#include "expert_cache/staging/copy_staging.hpp"
#include "expert_cache/storage/slot_storage.hpp"

namespace expert_cache::inline v0 {

template <allocating_runtime Runtime, expert_layout Layout>
using RowCache = ExpertCache<TensorMajorStorage, Lru, CopyStream, Layout, Runtime>;

template <allocating_runtime Runtime, expert_layout Layout>
using WholeExpertCache = ExpertCache<ExpertMajorStorage, Lfru, CopyStream, Layout, Runtime>;

// Per-layer caches: Lrfu is best or tied on the real decode traces at 12.5 and 25 % of E.
template <allocating_runtime Runtime, expert_layout Layout>
using RecommendedRowCache = ExpertCache<TensorMajorStorage, Lrfu, CopyStream, Layout, Runtime>;

// Expert-major pools (one copy per miss) with the per-layer winner instead of vLLM's Lfru.
template <allocating_runtime Runtime, expert_layout Layout>
using RecommendedWholeExpertCache = ExpertCache<ExpertMajorStorage, Lrfu, CopyStream, Layout, Runtime>;

// Model-level cache: LayerShare leads in a global pool at 7.5 and 15 %, never below Lru; in
// ModelPool::per_layer each layer's policy has one layer and plans exactly as Lrfu.
template <allocating_runtime Runtime, expert_layout Layout>
using RecommendedModelCache = ModelExpertCache<TensorMajorStorage, LayerShare, CopyStream, Layout, Runtime>;

}  // namespace expert_cache::inline v0
