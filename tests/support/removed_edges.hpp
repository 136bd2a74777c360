#pragma once
// Test support: one OrderingEdges per row of docs/design.md's happens-before table, with that
// edge removed; the negative tests of the host and device caches (test_cache_sim.cpp,
// test_device_cache_sim.cpp) build a cache with one and expect the race detector to fire.
#include "expert_cache/core/ordering_core.hpp"

namespace expert_cache::test {

struct NoReleaseWait : OrderingEdges {  // 1
  static constexpr bool release_wait = false;
};
struct NoLastFillRelease : OrderingEdges {  // 2
  static constexpr bool last_fill_release = false;
};
struct NoReadyWait : OrderingEdges {  // 3
  static constexpr bool ready_wait = false;
};
struct NoAllHitReadyWait : OrderingEdges {  // 4
  static constexpr bool all_hit_ready_wait = false;
};
struct NoOwnerChangeRelease : OrderingEdges {  // 5
  static constexpr bool owner_change_release = false;
};
struct NoInvalidateOrder : OrderingEdges {  // 6
  static constexpr bool invalidate_order = false;
};
struct NoResidentSerialisation : OrderingEdges {  // 7
  static constexpr bool resident_map_serialised = false;
};
struct NoStagingGuard : OrderingEdges {  // 8
  static constexpr bool staging_guard = false;
};
struct NoSpeculativeSlotWait : OrderingEdges {  // 9 (tests/host/test_prefetch.cpp)
  static constexpr bool speculative_slot_wait = false;
};
struct NoWideBufferRelease : OrderingEdges {  // 10 (tests/host/test_wide_forward.cpp, tests/host/test_device_wide.cpp)
  static constexpr bool wide_buffer_release = false;
};
struct NoWideResidentReadWait : OrderingEdges {  // D10 (tests/host/test_device_wide.cpp)
  static constexpr bool wide_resident_read_wait = false;
};
struct NoSpeculativeOverwriteWait : OrderingEdges {  // 11 (tests/host/test_prefetch.cpp)
  static constexpr bool speculative_overwrite_wait = false;
};

}  // namespace expert_cache::test
