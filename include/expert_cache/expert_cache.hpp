#pragma once
/// Umbrella header of the host tier: the whole host API, never a CUDA header.
// With the two standard instantiations:
//   RowCache          tensor-major host pools (one row per expert in each tensor), Lru,
//                     fills as per-tensor copies on the cache-owned copy stream: the row provider.
//   WholeExpertCache  the cached provider's policy (Lfru, its exact hit/miss behaviour) with
//                     expert-major storage, so a miss is ONE transfer, on the cache-owned copy
//                     stream. The copy stream (not the cached provider's inline copies) lets
//                     fills overlap earlier work on the consumer stream; use
//                     ExpertCache<ExpertMajorStorage, Lfru, Inline, ...> for inline copies.
// and the recommended ones (docs/policies.md "Choosing a policy"), which differ from
// the standard ones only in the eviction policy:
//   RecommendedRowCache          RowCache with Lrfu
//   RecommendedWholeExpertCache  WholeExpertCache with Lrfu
//   RecommendedModelCache        ModelExpertCache (tensor-major, copy stream) with LayerShare
#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/types.hpp"
#include "expert_cache/cache/expert_cache.hpp"
#include "expert_cache/cache/model_cache.hpp"
#include "expert_cache/cache/presets.hpp"
#include "expert_cache/eviction/all.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/planning/split.hpp"
#include "expert_cache/staging/copy_staging.hpp"
#include "expert_cache/storage/slot_storage.hpp"
