#pragma once
// Test support: field-by-field CacheStats comparison (a CHECK per field, so a failure names it).
#include <doctest/doctest.h>

#include "expert_cache/cache/expert_cache.hpp"

namespace expert_cache::test {

// The counters fixed by the trace and the policy, plus the memory footprint. Leaves out the
// runtime-side counters (owner changes, map uploads, staging stalls, faults), which differ where
// caches share a copy stream or an upload (e.g. ModelExpertCache against L separate caches).
inline void check_plan_stats_equal(const CacheStats& a, const CacheStats& b) {
  CHECK(a.hits == b.hits);
  CHECK(a.misses == b.misses);
  CHECK(a.promotions == b.promotions);
  CHECK(a.evictions == b.evictions);
  CHECK(a.invalidations == b.invalidations);
  CHECK(a.resident == b.resident);
  CHECK(a.capacity == b.capacity);
  CHECK(a.prepare_calls == b.prepare_calls);
  CHECK(a.generation == b.generation);
  CHECK(a.speculative_issued == b.speculative_issued);
  CHECK(a.speculative_used == b.speculative_used);
  CHECK(a.speculative_wasted == b.speculative_wasted);
  CHECK(a.speculative_bytes == b.speculative_bytes);
  CHECK(a.last_copies == b.last_copies);
  CHECK(a.total_copies == b.total_copies);
  CHECK(a.slot_bytes == b.slot_bytes);
  CHECK(a.host_bytes == b.host_bytes);
}

// Every field.
inline void check_stats_equal(const CacheStats& a, const CacheStats& b) {
  check_plan_stats_equal(a, b);
  CHECK(a.owner_changes == b.owner_changes);
  CHECK(a.map_uploads == b.map_uploads);
  CHECK(a.staging_stalls == b.staging_stalls);
  CHECK(a.faults == b.faults);
}

}  // namespace expert_cache::test
