#pragma once
/// CacheStats: the counters one cache keeps since construction, what stats() returns and
/// CacheOptions::stats_callback receives.
#include "expert_cache/base/version.hpp"
#include <cstddef>
#include <cstdint>

namespace expert_cache::inline v0 {

/// Counters of one cache since construction (ExpertCache::stats()); cheap to take.
struct CacheStats {
  std::uint64_t hits = 0;           ///< forward experts already resident
  std::uint64_t misses = 0;         ///< forward experts that had to be copied in
  std::uint64_t promotions = 0;     ///< policy promotions (e.g. Lfru's probation -> protected)
  std::uint64_t evictions = 0;      ///< experts evicted to make room
  std::uint64_t invalidations = 0;  ///< experts dropped by invalidate()
  std::int64_t resident = 0;        ///< experts resident now
  std::int64_t capacity = 0;        ///< GPU slots
  std::uint64_t prepare_calls = 0;  ///< accepted prepare() / prepare_unique() calls (and prepare_wide's admit rounds)
  std::uint64_t generation = 0;     ///< generation of the last accepted forward
  std::uint64_t last_copies = 0;    ///< copies the last prepare() or prepare_wide() enqueued
  std::uint64_t total_copies = 0;   ///< copies enqueued since construction
  std::uint64_t owner_changes = 0;  ///< prepares on a stream other than the previous reader's
  std::uint64_t map_uploads = 0;    ///< expert/resident map uploads
  std::uint64_t staging_stalls = 0; ///< waits for a free host staging buffer
  std::uint64_t faults = 0;         ///< runtime failures a call reported after validation
  std::uint64_t speculative_issued = 0;  ///< experts filled by prefetch() (not in misses or promotions)
  std::uint64_t speculative_used = 0;    ///< ... then used by a forward (also counted in hits)
  std::uint64_t speculative_wasted = 0;  ///< ... expired, evicted or invalidated unused
  std::uint64_t speculative_bytes = 0;   ///< bytes copied by prefetch()
  std::uint64_t wide_forwards = 0;  ///< prepare_wide() calls whose every round was served
  std::uint64_t wide_rounds = 0;    ///< rounds handed to a wide consumer
  std::uint64_t wide_hits = 0;      ///< stream admission: experts read from the pool (not in hits)
  std::uint64_t wide_streamed = 0;  ///< stream admission: experts copied into stream slots (not in misses)
  std::uint64_t wide_bytes = 0;     ///< bytes copied by wide forwards (both admissions)
  std::size_t slot_bytes = 0;       ///< device: slot buffers + maps
  std::size_t host_bytes = 0;       ///< host: expert pools + map staging
  /// @return hits / (hits + misses); 0 before the first forward
  [[nodiscard]] double hit_rate() const noexcept {
    const auto n = hits + misses;
    return n == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(n);
  }
};

}  // namespace expert_cache::inline v0
