#pragma once
/// Per-slot readiness of the device plan's fills (edges D4 and D4c of docs/design.md): the wrap-safe sequence
/// comparison and SlotReadiness, the view a consumer waits on before it reads a slot.
//
// The plan writes slot_needed (state.hpp), the overlapped fill stores slot_ready; a consumer
// needs only these words, not the planner (kernels/slot_ready.cuh waits on them).
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/planning/device_plan/state.hpp"

namespace expert_cache::inline v0 {

// Wrap-safe "sequence `have` has reached `want`" (uint32 sequence values; correct while fewer
// than 2^31 fills separate them, i.e. always: a slot is read within one forward of its plan).
EXPERT_CACHE_HOST_DEVICE constexpr bool slot_seq_reached(std::uint32_t have, std::uint32_t want) noexcept {
  return static_cast<std::int32_t>(have - want) >= 0;
}

// What a readiness consumer needs (device pointers into the plan state; fixed for the cache's
// lifetime, so a graph keeps it): before it reads slot s, it waits until
// slot_seq_reached(ready[s], needed[s]) (acquire), bounded by timeout_ns (0: the default,
// about 1.5 s), after which it sets plan_error_wait_timeout in error_word and goes on.
// A default-constructed view (ready == nullptr) means: no overlap, the stream-ordered path.
struct SlotReadiness {
  const std::uint32_t* ready = nullptr;
  const std::uint32_t* needed = nullptr;
  // The first part's word (edge D4c): a reader of only the copy regions the fill copies first
  // may wait on it instead of `ready`. Null: wait on `ready` for every part.
  const std::uint32_t* ready_first = nullptr;
  std::uint32_t* error_word = nullptr;
  std::int32_t capacity = 0;
  std::uint64_t timeout_ns = 0;
  [[nodiscard]] EXPERT_CACHE_HOST_DEVICE constexpr bool enabled() const noexcept { return ready != nullptr; }
};

EXPERT_CACHE_HOST_DEVICE inline SlotReadiness slot_readiness_of(const DevicePlanState& s) noexcept {
  SlotReadiness r;
  r.ready = s.slot_ready.data;
  r.needed = s.slot_needed.data;
  r.ready_first = s.slot_ready_first.data;
  r.error_word = s.error_word;
  r.capacity = s.capacity;
  return r;
}

}  // namespace expert_cache::inline v0
