#pragma once
/// The device plan's speculative fills: plan_prefetch makes predicted experts resident with ForwardPlanner<host
/// policy>::plan_prefetch's decisions, in the fill and eviction lists a forward's fill kernels copy.
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/planning/device_plan/block.hpp"
#include "expert_cache/planning/device_plan/policies.hpp"
#include "expert_cache/planning/device_plan/state.hpp"
#include "expert_cache/planning/device_plan/victims.hpp"

namespace expert_cache::inline v0 {

// Speculative fills for `n_ids` predicted ids (best first), with the decisions of
// ForwardPlanner<Lru>::plan_prefetch: at most `max_fills` fills (clamped to C); an id already
// resident is skipped; a fill takes a free slot, else the least recently used resident that is
// neither in the last planned group (ticks >= protect_tick; not with `evict_last_forward`, whose
// caller ordered the prefetch after that forward's readers: PrefetchOptions), nor an unused, unexpired
// speculative fill, nor named anywhere in this list (every listed resident is marked before the
// first fill); no such resident: the rest is skipped (counted in prefetch_skipped_no_victim). A fill is
// inserted as the most recent resident (Lru::on_insert), lives `expires_after` forwards unless a
// forward hits it (used), and takes a fill-sequence value like a forward's miss (edge D4). The
// forward map is not touched: the current forward's readers keep reading it. The fill and
// eviction lists are the state's (fill_count, eviction_count), so the forward's fill kernels
// copy a prefetch's fills unchanged. Unlike the host planner, which refuses a list with an id
// outside [0, E), the device drops such ids (counted in bad_ids, flagged), as plan_forward
// does; -1 is padding. All threads of the block call it.
template <device_plan_policy Policy = DeviceLru, plan_block Block>
EXPERT_CACHE_HOST_DEVICE void plan_prefetch(Block& b, const DevicePlanState& s, const std::int32_t* ids,
                                            std::int32_t n_ids, std::int32_t max_fills,
                                            std::uint32_t expires_after, bool evict_last_forward = false) noexcept {
  if (!plan_state_ok(s)) return detail::plan_fail(b, s, plan_error_bad_state);
  if (n_ids < 0 || (ids == nullptr && n_ids > 0) || max_fills < 0 || expires_after == 0) {
    return detail::plan_fail(b, s, plan_error_bad_argument);
  }
  const std::int32_t rank = b.thread_rank(), nt = b.size();
  const std::int32_t E = s.num_experts, C = s.capacity;
  DevicePlanScalars& sc = *s.scalars;
  // Read once by every thread; only rank 0 writes the scalars, after the last barrier below.
  // No tick reaches the maximum: with evict_last_forward only the speculative counts and the marks protect.
  const std::uint64_t protect = evict_last_forward ? ~std::uint64_t{0} : sc.protect_tick;
  std::uint64_t tick = sc.tick;
  std::int32_t free = sc.free_count;
  const std::uint32_t seq0 = sc.fill_seq;
  const std::int32_t live0 = sc.spec_live;
  // max_fills is not clamped to C: every fill is protected once made, so at most C happen, and
  // a budget above C must end in the no-victim count as the host planner's does.

  std::int32_t bad = 0;
  for (std::int32_t i = rank; i < n_ids; i += nt) {
    const std::int32_t id = ids[i];
    if (id != plan_padding_id && (id < 0 || id >= E)) ++bad;
  }
  const std::int32_t bad_total = b.sum(bad);
  // Every resident the list names is protected from this call's victim searches (racing stores
  // of 1 for a duplicate id; the barrier publishes them before the first search).
  for (std::int32_t i = rank; i < n_ids; i += nt) {
    const std::int32_t id = ids[i];
    if (id >= 0 && id < E && s.resident_map[id] >= 0) b.mark(s.marks[id]);
  }
  b.sync();

  // One id at a time (a victim search is block-collective); every branch below is uniform:
  // each thread reads the same id and the same state (rank 0's writes of the previous id are
  // published by the barrier that ends it).
  std::int32_t fills = 0, victims = 0, skipped_resident = 0, next = 0;
  bool no_victim = false;
  const bool in_regs = C <= plan_victim_regs * nt;  // uniform
  detail::VictimChunk chunk{};  // loaded at the first victim search
  bool loaded = false;
  for (; next < n_ids; ++next) {
    const std::int32_t e = ids[next];
    if (e < 0 || e >= E) continue;  // padding or a bad id (counted above)
    const bool resident = s.resident_map[e] >= 0;
    // Every thread has read the residency before rank 0 changes it below: a fill into a free slot
    // has no collective that would otherwise keep a late thread from reading the new value.
    b.sync();
    if (resident) {  // marked above, or one of this call's fills (excluded by its speculative count)
      ++skipped_resident;
      continue;
    }
    if (fills >= max_fills) break;
    std::int32_t target;
    if (free > 0) {
      target = s.free_stack[free - 1];
      --free;
    } else {
      std::int32_t found = -1;
      if (in_regs) {
        // Keys from registers, loaded at the first search of this call: nothing a search reads
        // there changes within the call (CRF and bias of residents, the clock; a slot that takes
        // a fill is excluded by its speculative count from then on). What does change, the
        // speculative counts and the marks, is read from memory at every search.
        if (!loaded) {  // uniform
          chunk.template load<Policy>(s, 0, rank, nt, protect, sc.crf_clock);
          loaded = true;
        }
        if (EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::lru)) {
          PlanKey best;
          EXPERT_CACHE_PLAN_UNROLL
          for (std::int32_t k = 0; k < plan_victim_regs; ++k) {
            const std::int32_t slot = rank + k * nt, owner = chunk.owner[k];
            if (owner < 0 || owner >= E || chunk.tick[k] >= protect) continue;
            if (s.slot_spec_left[slot] != 0 || s.marks[owner] != 0) continue;
            const PlanKey key{chunk.tick[k], slot};
            if (key < best) best = key;
          }
          found = b.min_key(best).slot;
        } else {
          ScoreKey best;
          EXPERT_CACHE_PLAN_UNROLL
          for (std::int32_t k = 0; k < plan_victim_regs; ++k) {
            const std::int32_t slot = rank + k * nt, owner = chunk.owner[k];
            if (owner < 0 || owner >= E || chunk.tick[k] >= protect) continue;
            if (s.slot_spec_left[slot] != 0 || s.marks[owner] != 0) continue;
            const ScoreKey key = EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::lfru)
                                     ? detail::lfru_key_of(chunk.score[k], chunk.tie[k], slot, tick - 1u, chunk.tick[k])
                                     : ScoreKey{chunk.score[k], chunk.tie[k], slot};
            if (key < best) best = key;
          }
          found = b.min_score(best).slot;
        }
      } else if (EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::lru)) {
        PlanKey best;
        for (std::int32_t slot = rank; slot < C; slot += nt) {
          const std::int32_t owner = s.slot_owner[slot];
          if (owner < 0 || owner >= E) continue;
          const PlanKey key{s.slot_tick[slot], slot};
          if (key.tick >= protect || s.slot_spec_left[slot] != 0 || s.marks[owner] != 0) continue;
          if (key < best) best = key;
        }
        found = b.min_key(best).slot;
      } else {
        // The host policy's victim at its clock now: Lfru's clock is tick - 1 (one per insert).
        ScoreKey best;
        for (std::int32_t slot = rank; slot < C; slot += nt) {
          const std::int32_t owner = s.slot_owner[slot];
          if (owner < 0 || owner >= E) continue;
          const std::uint64_t t = s.slot_tick[slot];
          if (t >= protect || s.slot_spec_left[slot] != 0 || s.marks[owner] != 0) continue;
          const ScoreKey key = EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::lfru)
                                   ? detail::lfru_key(s, slot, tick - 1u, t)
                                   : detail::crf_key(s, slot, owner, sc.crf_clock);
          if (key < best) best = key;
        }
        found = b.min_score(best).slot;
      }
      if (found < 0 || found >= C) {
        no_victim = true;
        break;
      }
      target = found;
      if (rank == 0) {
        const std::int32_t victim = s.slot_owner[target];
        s.resident_map[victim] = -1;
        s.evictions[victims] = PlanEntry{victim, target};
      }
      ++victims;
    }
    if (target < 0 || target >= C) {  // a corrupted free stack only
      if (rank == 0) b.flags_or(*s.error_word, plan_error_bad_state);
      break;
    }
    if (rank == 0) {
      s.fills[fills] = PlanEntry{e, target};
      s.resident_map[e] = target;
      s.slot_owner[target] = e;
      s.slot_tick[target] = tick;
      if (EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::lfru)) {
        s.slot_freq[target] = 1;
        s.slot_order[target] = tick;
      } else if (EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::crf)) {
        detail::crf_touch(s, e, sc.crf_clock);  // Crf::on_insert (no clock tick)
        s.slot_freq[target] = s.expert_crf[e];  // the slot's mirrors (VictimChunk)
        s.slot_order[target] = sc.crf_clock;
      }
      s.slot_spec_left[target] = expires_after;
      s.slot_needed[target] = seq0 + static_cast<std::uint32_t>(fills) + 1u;  // edge D4, as a miss
    }
    ++tick;
    ++fills;
    b.sync();
  }
  // The distinct non-resident ids left once no victim remained (fresh marks), then every mark
  // of this call cleared (marks are zero between calls). Rank 0 alone: duplicates in the list
  // would otherwise race on one mark.
  std::int32_t skipped_no_victim = 0;
  if (rank == 0) {
    if (no_victim) {
      for (std::int32_t i = 0; i < next; ++i) {
        const std::int32_t id = ids[i];
        if (id >= 0 && id < E) s.marks[id] = 0;
      }
      for (std::int32_t i = next; i < n_ids; ++i) {
        const std::int32_t id = ids[i];
        if (id < 0 || id >= E || s.resident_map[id] >= 0 || s.marks[id] != 0) continue;
        s.marks[id] = 1;
        ++skipped_no_victim;
      }
    }
    for (std::int32_t i = 0; i < n_ids; ++i) {
      const std::int32_t id = ids[i];
      if (id >= 0 && id < E) s.marks[id] = 0;
    }
    DevicePlanStats now = *s.counters;
    const DevicePlanStats before = now;
    sc.tick = tick;
    sc.free_count = free;
    sc.fill_seq = seq0 + static_cast<std::uint32_t>(fills);
    sc.spec_live = live0 + fills;
    sc.fill_count = fills;
    sc.eviction_count = victims;
    sc.prefetch_skipped_resident = skipped_resident;
    sc.prefetch_skipped_no_victim = skipped_no_victim;
    now.prefetches += 1;
    now.speculative_issued += static_cast<std::uint64_t>(fills);
    now.evictions += static_cast<std::uint64_t>(victims);
    if (bad_total > 0) {
      now.bad_ids += static_cast<std::uint64_t>(bad_total);
      b.flags_or(*s.error_word, plan_error_bad_id);
    }
    detail::publish_stats(b, s, before, now);
  }
  b.sync();
}

}  // namespace expert_cache::inline v0
