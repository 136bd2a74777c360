#pragma once
/// What a caller passes and reads back from a ModelExpertCache: the pool mode (ModelPool), the
/// construction parameters (ModelCacheOptions) and the per-layer counters (ModelCacheStats).
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "expert_cache/cache/stats.hpp"
#include "expert_cache/cache/wide.hpp"
#include "expert_cache/storage/storage_memory.hpp"

namespace expert_cache::inline v0 {

/// How a ModelExpertCache shares its slots among the layers (ModelCacheOptions::pool).
enum class ModelPool : std::uint8_t {
  per_layer,  ///< mode A: each layer its own slots, planner and maps
  global,     ///< mode B: one slot pool and one planner over all layers' experts
};

/// @return the enumerator's name: "per_layer" or "global"
[[nodiscard]] constexpr std::string_view to_string(ModelPool p) noexcept {
  return p == ModelPool::per_layer ? "per_layer" : "global";
}

/// Bound on L * E (the ids of a global pool, and the entries of the model's maps).
inline constexpr std::int64_t model_max_experts = std::int64_t{1} << 26;

/// Construction parameters of a ModelExpertCache. The constructor throws Error when they are impossible.
struct ModelCacheOptions {
  std::int32_t num_layers = 0;   ///< MoE layers (valid layers are [0, num_layers)), >= 1
  std::int32_t num_experts = 0;  ///< experts per layer, E (valid ids are [0, E)), >= 1
  /// per_layer: the slots of every layer (unless layer_capacities is given); global: the slots
  /// of the one pool.
  std::int32_t capacity = 0;
  std::vector<std::int32_t> layer_capacities;  ///< per_layer only: one entry per layer; empty = `capacity` each
  std::int32_t top_k = 1;                      ///< routed experts per token, in [1, each layer's capacity]
  ModelPool pool = ModelPool::per_layer;       ///< how the layers share slots
  /// Map-upload staging buffers of the whole model (0: 8 per layer in per_layer mode, as L
  /// separate caches have; 2L + 8 in global mode, enough for one captured forward of every
  /// layer). A buffer holds E entries (per_layer) or L*E (global).
  std::size_t staging_ring = 0;
  std::string label = "model_expert_cache";   ///< name in log lines
  std::function<void(std::string_view)> log;  ///< one line at construction; silent when empty
  /// Caller-owned host pools and/or slot workspace, as CacheOptions::memory, for the whole
  /// model: the storage holds L*E experts layer-major (host_tensor(l, t, e) is expert l*E + e),
  /// so a host span covers [L][E] experts and the workspace every layer's slots.
  StorageMemory memory{};
  /// Stream slots of the whole model for prepare_wide (CacheOptions::stream_slots): one area
  /// after every layer's slots, shared by the layers (their wide forwards run one at a time).
  std::int32_t stream_slots = 0;
  std::int64_t max_wide_ids = default_max_wide_ids;  ///< most top-k ids of one prepare_wide call
};

/// stats(): the model's totals and one entry per layer. Ordering counters (owner_changes,
/// map_uploads, staging_stalls) exist only in the total (the core is shared). Global mode, per
/// layer: capacity is the pool's, evictions count the layer's experts that were evicted (by
/// any layer's forward), slot_bytes are the layer's maps plus the slots it holds now; the speculative
/// counters (prefetch) are the one planner's and exist only in the total, except speculative_bytes.
struct ModelCacheStats {
  CacheStats total;                   ///< the whole model (capacity: the layers' slots, stream slots not counted)
  std::vector<CacheStats> per_layer;  ///< one entry per layer
};

}  // namespace expert_cache::inline v0
