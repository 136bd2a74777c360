#pragma once
/// What a caller passes a host-planned cache: its construction parameters (CacheOptions) and
/// one prefetch()'s budget and hints (PrefetchOptions).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "expert_cache/cache/stats.hpp"
#include "expert_cache/cache/wide.hpp"
#include "expert_cache/prefetch/hint_selection.hpp"
#include "expert_cache/storage/storage_memory.hpp"

namespace expert_cache::inline v0 {

/// Budget, lifetime and (optionally) the caller's confidence of one prefetch() call.
///
/// Scored hints (docs/prefetch.md "Scored hints"): `scores[i]` is the caller's estimate of the
/// probability that the next forward reads `predicted[i]`, in [0, 1]. Without scores (an empty
/// span, the default) the ids are taken best first as given. With scores the cache
///  (a) takes the hints highest score first; equal scores keep the caller's order;
///  (b) skips every hint scoring below `min_score` (PrefetchView::skipped_unlikely): it is never
///      fetched and, like an unhinted resident, not protected;
///  (c) evicts for the others only what an unscored prefetch may evict: never an expert of the
///      most recent forward, an unused unexpired speculative fill, or a resident named by any
///      hint this call takes (a hint is never evicted for another hint);
///  (d) copies at most `max_bytes`, as without scores.
/// The selection rule lives in one place, HintSelector (prefetch/hint_selection.hpp), which
/// also says why `min_score` defaults to 0.5: from there on a fill is at least as likely used as
/// wasted, so on a busy link its expected saving covers its expected waste.
/// Errors (invalid_argument, before any state change): a number of scores other than the
/// number of ids, a score that is NaN, infinite or outside [0, 1] (the message names its index
/// and value), a `min_score` that is NaN or outside [0, 1] (checked with or without scores).
/// The span is read during the call only.
struct PrefetchOptions {
  /// Bytes this call may copy: max_bytes / bytes per expert fills (0 = none; < 0 is an error).
  std::int64_t max_bytes = 0;
  /// Accepted forwards a fill stays protected unused before it counts wasted (>= 1): 1 for a
  /// per-layer cache prefetched one forward ahead, L for a cache shared by L layers.
  std::uint32_t expires_after = 1;
  /// Per-id probability of use, parallel to the predicted ids; empty = no scores.
  std::span<const float> scores{};
  /// Scored hints below this probability are skipped, in [0, 1] (hint_selection.hpp: why 0.5).
  float min_score = default_min_score;
  /// The cache measures how often its speculative fills at each rank of the hint list are used
  /// and skips ranks whose precision is below min_score, and never admits one below
  /// RankPrecision::min_admit_precision (0.8), but for a periodic probe that runs only while the
  /// skipped hints turn out read (prefetch/rank_precision.hpp): hints that turn out wrong, scored
  /// or not, stop costing link time. Host-planned caches; the device-planned cache plans on the
  /// device and ignores it.
  bool precision_feedback = true;
  /// The caller's promise that every reader of this cache's last forward is enqueued before this
  /// call, in stream order (a per-layer cache prefetched for its next forward after its previous
  /// forward's consumer, as in a decode loop): that forward's residents may then be evicted like
  /// any other, except the ones this list names, so a cache of top_k slots can look ahead. Its
  /// expert map is then stale (slots may hold other experts) until the next prepare. Without it a
  /// prefetch never evicts the last forward's residents (the consumer may still read them).
  /// A model-level cache with a pool shared by layers refuses it (its last forward is another
  /// layer's, which may be the one being consumed).
  bool evict_last_forward = false;
};

/// Construction parameters of an ExpertCache. The constructor throws Error when they are
/// impossible (capacity 0, > num_experts or < top_k).
struct CacheOptions {
  std::int32_t num_experts = 0;  ///< experts of the layer (valid ids are [0, num_experts))
  std::int32_t capacity = 0;     ///< GPU slots (experts resident at once)
  std::int32_t top_k = 1;        ///< routed experts per token
  std::size_t staging_ring = 8;  ///< host staging buffers for map uploads
  std::string label = "expert_cache";  ///< name in log lines and error messages
  /// Called every `stats_every` accepted prepare() calls (0 = never).
  std::function<void(const CacheStats&)> stats_callback;
  std::uint64_t stats_every = 1000;  ///< see stats_callback
  /// Receives one line at construction (policies, sizes, byte accounting). The library is
  /// silent unless a sink is given here.
  std::function<void(std::string_view)> log;
  /// Caller-owned host pools and/or slot workspace (storage/storage_memory.hpp); empty: the
  /// storage allocates them. The caller keeps the memory alive for the cache's lifetime. A
  /// workspace covers capacity + stream_slots slots.
  StorageMemory memory{};
  /// Extra GPU slots after the pool's `capacity` for wide forwards with WideAdmission::stream
  /// (cache/wide.hpp): two halves of stream_slots / 2, used alternately, never admitted. 0 (the
  /// default, so a decode-only cache spends no memory on them): such forwards are served with
  /// WideAdmission::admit instead (WideSummary::fell_back, one line on `log`), which works but
  /// evicts the decode working set; recommended_stream_slots() gives the size to configure.
  std::int32_t stream_slots = 0;
  /// Most top-k ids one prepare_wide() accepts (too_many_experts beyond).
  std::int64_t max_wide_ids = default_max_wide_ids;
};

namespace detail {

// What a host-planned prefetch checks before it plans (ExpertCache, ModelExpertCache): the
// staging policy's precheck, and no capture of `stream` (the per-slot events are recorded eagerly).
template <class Runtime, class Staging>
Status prefetch_allowed(Runtime& rt, Staging& staging, typename Runtime::Stream stream) noexcept {
  return eager_call_allowed(rt, staging, stream,
                            "prefetch() under stream capture: its per-slot events must be recorded eagerly");
}

// The fills a prefetch may issue: min(slots, max_bytes / bytes per expert); invalid_argument for max_bytes < 0.
[[nodiscard]] inline Result<std::int32_t> prefetch_fill_budget(std::int64_t max_bytes, std::uint64_t bytes_per_expert,
                                                               std::int32_t slots) noexcept {
  if (max_bytes < 0) {
    return Status::format(ErrorCode::invalid_argument, "prefetch max_bytes must be >= 0, got %lld",
                          static_cast<long long>(max_bytes));
  }
  const std::uint64_t fills = bytes_per_expert == 0 ? 0 : static_cast<std::uint64_t>(max_bytes) / bytes_per_expert;
  return static_cast<std::int32_t>(std::min<std::uint64_t>(fills, static_cast<std::uint64_t>(std::max(slots, 0))));
}

}  // namespace detail

}  // namespace expert_cache::inline v0
