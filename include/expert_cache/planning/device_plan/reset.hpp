#pragma once
/// The device plan's resets outside a forward: reset_plan_state empties the whole cache (the state's start),
/// plan_invalidate drops one expert with ForwardPlanner::invalidate's decisions.
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/eviction/crf_math.hpp"
#include "expert_cache/planning/device_plan/block.hpp"
#include "expert_cache/planning/device_plan/policies.hpp"
#include "expert_cache/planning/device_plan/state.hpp"

namespace expert_cache::inline v0 {

// Empty cache: nothing resident, free stack [C-1, ..., 0] (slot 0 popped first, like
// ForwardPlanner<Lru>, whose free_slot_order is lowest_first; [0, ..., C-1] for a policy that
// hands out C-1 first, like Lfru), counters, error word, policy state and prior biases zero,
// DeviceCrf's decay `crf_decay` (Q32 in (0, 2^32): CrfParams::decay_q32, crf_decay_for_half_life)
// and its power table.
template <device_plan_policy Policy = DeviceLru, plan_block Block>
EXPERT_CACHE_HOST_DEVICE void reset_plan_state(Block& b, const DevicePlanState& s,
                                               std::uint64_t crf_decay = crf_default_decay_q32) noexcept {
  const std::int32_t r = b.thread_rank(), n = b.size();
  for (std::int32_t e = r; e < s.resident_map.size; e += n) {
    s.resident_map[e] = -1;
    s.forward_map[e] = -1;
    s.unique[e] = -1;
    s.marks[e] = 0;
    s.missing[e] = 0;
    s.expert_crf[e] = 0;
    s.expert_bias[e] = 0;
    s.expert_last[e] = 0;
  }
  for (std::int32_t a = r; a < s.crf_pow.size; a += n) {
    s.crf_pow[a] = crf_decay_pow(crf_decay, static_cast<std::uint32_t>(a));
  }
  const std::int32_t c = s.capacity;
  for (std::int32_t i = r; i < s.slot_owner.size; i += n) {
    s.slot_owner[i] = -1;
    s.slot_tick[i] = 0;
    s.free_stack[i] = detail::plan_free_highest_first<Policy>(s.policy) ? i : c - 1 - i;
    s.prev_forward[i] = -1;
    s.slot_freq[i] = 0;
    s.slot_order[i] = 0;
    s.fills[i] = PlanEntry{};
    s.evictions[i] = PlanEntry{};
    s.slot_needed[i] = 0;
    s.slot_ready[i] = 0;
    s.fill_arrivals[i] = 0;
    s.slot_ready_first[i] = 0;
    s.fill_arrivals_first[i] = 0;
    s.slot_spec_left[i] = 0;
  }
  if (r == 0) {
    *s.scalars = DevicePlanScalars{};
    s.scalars->free_count = c;
    s.scalars->crf_decay = crf_decay;
    *s.counters = DevicePlanStats{};
    if (s.stats != nullptr) *s.stats = DevicePlanStats{};
    if (s.error_word != nullptr) *s.error_word = 0;
  }
  b.sync();
}

// Drops `expert` from residency (ForwardPlanner::invalidate): resident -> -1, its forward-map
// entry -> -1, slot freed and pushed on the free stack (reused first). Not resident: no-op.
// Out of range: counted as a bad id. The freed slot (or -1) lands in scalars->last_invalidated_slot.
template <plan_block Block>
EXPERT_CACHE_HOST_DEVICE void plan_invalidate(Block& b, const DevicePlanState& s, std::int32_t expert) noexcept {
  if (!plan_state_ok(s)) return detail::plan_fail(b, s, plan_error_bad_state);
  if (b.thread_rank() == 0) {
    DevicePlanScalars& sc = *s.scalars;
    DevicePlanStats now = *s.counters;
    const DevicePlanStats before = now;
    sc.last_invalidated_slot = -1;
    if (expert < 0 || expert >= s.num_experts) {
      now.bad_ids += 1;
      b.flags_or(*s.error_word, plan_error_bad_id);
    } else {
      const std::int32_t slot = s.resident_map[expert];
      if (slot >= 0 && slot < s.capacity && sc.free_count < s.capacity) {
        if (s.slot_spec_left[slot] != 0) {  // an unused speculative fill dropped: wasted
          s.slot_spec_left[slot] = 0;
          sc.spec_live -= 1;
          now.speculative_wasted += 1;
        }
        s.resident_map[expert] = -1;
        s.forward_map[expert] = -1;
        s.missing[expert] = 0;
        s.slot_owner[slot] = -1;
        s.free_stack[sc.free_count] = slot;
        sc.free_count += 1;
        sc.last_invalidated_slot = slot;
        now.invalidations += 1;
      }
    }
    detail::publish_stats(b, s, before, now);
  }
  b.sync();
}

}  // namespace expert_cache::inline v0
