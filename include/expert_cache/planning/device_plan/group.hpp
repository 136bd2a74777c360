#pragma once
/// The device plan's group step: plan_group plans one group of the current forward (up to a capacity's worth of its
/// unique experts: hits, fills, victims, maps) with ForwardPlanner<host policy>::plan_unique's decisions;
/// plan_forward (forward.hpp) runs it for group 0.
//
// Why the host planner's LRU list becomes a recency tick: Lru's list, head to tail, is in order
// of last touch, and a forward touches its unique ids in ascending order. So a global counter
// stamped on every touch (hit or insert) orders the residents exactly like the list, and the
// victims of a forward are the residents outside the forward with the smallest ticks, taken in
// tick order. Giving the forward's hits their new ticks (all >= the forward's first tick) BEFORE
// the victim search makes "outside the forward" automatic: the smallest ticks then all belong
// to non-forward residents (a group of n <= C experts never needs more victims than there are
// non-forward residents). Ticks are stored per slot (a resident has exactly one slot), so the
// victim search reads two contiguous arrays of C entries; 64-bit, so they never wrap.
//
// Overflow (more unique valid experts than slots): the host planner rejects such a forward and
// the cache runs an expert split (planning/split.hpp: ascending groups of <= capacity ids). A kernel
// cannot return an error to a graph, so the device does the split itself: plan_forward
// deduplicates into the sorted unique list, plans group 0 (the first C ids) and records
// group_count; plan_group(g) plans group g = ids [g*C, (g+1)*C) (or of a narrower width the
// caller declared for its rounds, DevicePlanState::round_width) exactly like host plan_unique
// on that group (protection covers the group being planned; earlier groups' consumers already
// ran in stream order). A graph holds max_groups(n_ids) (plan_group -> fill -> consumer) rounds;
// a round with g >= group_count is empty: it clears the forward map and writes an empty fill
// list, so its consumer computes nothing and the result is still correct. Overflowing forwards
// are counted (stats.overflows, stats.overflow_groups) and flagged in the error word: never
// silent, never wrong. A forward whose caller declared it served in rounds
// (DevicePlanState::forward_in_rounds: prepare_wide plans every group) is counted, not flagged,
// and its unique list holds the experts resident at the forward's start first (each part
// ascending; the general path always): every group that reads the pool runs before the first
// group that evicts, so no expert of the forward is evicted before its group and filled again.
//
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/eviction/crf_math.hpp"
#include "expert_cache/planning/device_plan/block.hpp"
#include "expert_cache/planning/device_plan/policies.hpp"
#include "expert_cache/planning/device_plan/state.hpp"
#include "expert_cache/planning/device_plan/victims.hpp"

namespace expert_cache::inline v0 {

// Experts per group: `width` where it is in 1..capacity - 1, else the capacity (0 = capacity).
EXPERT_CACHE_HOST_DEVICE constexpr std::int32_t plan_group_width(std::int32_t width, std::int32_t capacity) noexcept {
  return width > 0 && width < capacity ? width : capacity;
}

// Groups a graph must provision for a forward of n_ids ids (unique experts <= min(n_ids, E)) in
// groups of `capacity` experts, or of a narrower round width passed in its place.
EXPERT_CACHE_HOST_DEVICE constexpr std::int32_t plan_max_groups(std::int64_t n_ids, std::int32_t num_experts,
                                                                std::int32_t capacity) noexcept {
  if (n_ids <= 0 || capacity <= 0) return 1;
  const std::int64_t u = n_ids < num_experts ? n_ids : num_experts;
  return static_cast<std::int32_t>((u + capacity - 1) / capacity);
}

namespace detail {

// Speculative bookkeeping of one accepted forward (group), after its hits and victims cleared
// their slots' entries: every other live speculative fill ages by one forward, and one that
// reaches 0 expired unused (ForwardPlanner::apply's aging). Returns the block's expirations
// (every thread). Block-collective; callers skip it when no fill is live (uniform).
template <plan_block Block>
EXPERT_CACHE_HOST_DEVICE std::int32_t age_speculative(Block& b, const DevicePlanState& s) noexcept {
  b.sync();  // the hits' and victims' clears (other threads) land before the aging reads
  std::int32_t expired = 0;
  for (std::int32_t slot = b.thread_rank(); slot < s.capacity; slot += b.size()) {
    std::uint32_t& left = s.slot_spec_left[slot];
    if (left != 0 && --left == 0) ++expired;
  }
  return b.sum(expired);
}

// What a group step starts from: the scalars (read once by the caller), the counters as they
// were and with the caller's increments (meaningful in rank 0 only).
struct GroupInput {
  std::int32_t unique = 0, groups = 0, prev = 0, free = 0;
  std::int32_t width = 0;  // experts per group (group_width; <= 0 reads as the capacity)
  std::uint64_t tick0 = 0;
  // Scalars only rank 0 advances, after the step's last barrier: read up front, together.
  std::uint32_t seq0 = 0;   // fill_seq
  std::int32_t live0 = 0;   // spec_live
  std::uint32_t clock = 0;  // crf_clock
  DevicePlanStats before{}, now{};
  bool forward = false;  // called by plan_forward (group 0 of a new forward), not plan_group
};

// The general path's reads: straight from the state.
struct StateSource {
  const DevicePlanState* s;
  EXPERT_CACHE_HOST_DEVICE std::int32_t prev(std::int32_t i) const noexcept { return s->prev_forward[i]; }
  EXPERT_CACHE_HOST_DEVICE std::int32_t id(std::int32_t k) const noexcept { return s->unique[k]; }
  EXPERT_CACHE_HOST_DEVICE std::int32_t slot_of(std::int32_t, std::int32_t e) const noexcept {
    return s->resident_map[e];
  }
  // DeviceCrf: expert e's CRF decayed to clock clk (before this request adds one).
  EXPERT_CACHE_HOST_DEVICE std::uint64_t crf_now(std::int32_t, std::int32_t e, std::uint32_t clk) const noexcept {
    return crf_at_table(s->crf_pow.data, s->expert_crf[e], s->expert_last[e], clk);
  }
};

// Plans group g: ids src.id(g*W + i), i < n (W: the forward's group width), in order, with
// ForwardPlanner<host policy>::plan_unique's decisions. g >= groups is an empty group (see the
// overflow note at the top). All threads of the block call it; the state was checked by the caller.
//
// The score policies reuse the recency tick for in-forward protection (the forward's hits get
// ticks >= tick0 before any victim is searched) and take one victim per block arg-min of
// ScoreKey over the other residents (VictimChunk: keys loaded once, in registers); each victim is
// then voided by the thread that owns its slot in the strided search (slot % threads), the only
// thread that reads it in later searches, so no barrier is needed to exclude it (when the keys
// are reloaded per victim, its tick in memory is set to ~0 instead). DeviceLfru's scores change with the clock,
// which a forward advances by one per id, so victim j is scored at the clock of its miss
// (position p in the group: tick0 + p - 1, Lfru's clock before that insert). DeviceCrf's clock
// ticks once per group, so its keys are fixed during the group.
template <device_plan_policy Policy, plan_block Block, class Source>
EXPERT_CACHE_HOST_DEVICE void plan_group_from(Block& b, const DevicePlanState& s, std::int32_t g, GroupInput in,
                                              const Source& src) noexcept {
  const bool lru = EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::lru);
  const bool lfru = EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::lfru);
  const bool crf = EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::crf);
  const std::int32_t rank = b.thread_rank(), nt = b.size();
  const std::int32_t E = s.num_experts, C = s.capacity;
  DevicePlanScalars& sc = *s.scalars;
  const std::int32_t prev = in.prev, unique = in.unique, groups = in.groups, free = in.free;
  const std::uint64_t tick0 = in.tick0;
  const std::uint32_t seq0 = in.seq0;
  const std::int32_t live0 = in.live0;  // live speculative fills (0: their code is skipped)
  const std::uint32_t clk = in.clock + 1u;  // DeviceCrf: this group's clock

  // The forward map holds only the last group: clear its entries (<= C writes, not E).
  for (std::int32_t i = rank; i < prev; i += nt) {
    const std::int32_t e = src.prev(i);
    if (e >= 0 && e < E) {
      s.forward_map[e] = -1;
      s.missing[e] = 0;
    }
  }
  b.sync();  // a cleared entry may belong to this group too: clear before set
  if (g >= groups) {
    // An empty forward (in.forward) is still an accepted forward: the host ages its speculative
    // fills. Empty overflow rounds (g >= 1) are not forwards of their own.
    const std::int32_t expired = (in.forward && live0 > 0) ? age_speculative(b, s) : 0;
    if (rank == 0) {
      sc.prev_count = sc.fill_count = sc.eviction_count = sc.hits = sc.misses = sc.group_size = 0;
      sc.group = g;
      // An empty forward leaves nothing to protect (the host's previous forward is empty); an
      // empty overflow round keeps the last real group protected, as the host (which has no
      // such round) does.
      if (in.forward) sc.protect_tick = sc.tick;
      sc.spec_live = live0 - expired;
      DevicePlanStats now = in.now;
      now.speculative_wasted += static_cast<std::uint64_t>(expired);
      publish_stats(b, s, in.before, now);
    }
    b.sync();
    return;
  }
  const std::int32_t width = plan_group_width(in.width, C);
  const std::int32_t begin = g * width;  // g < groups <= ceil(E / width): no overflow
  const std::int32_t n = min_i32(width, unique - begin);

  // Classify. Hits take their new tick now, so that every resident of this group is younger
  // than every other resident before the victim search (in-forward protection by ordering).
  // Misses are compacted in ascending order into the fill list; `slot` temporarily holds the
  // expert's position in the group (its tick offset) until the slot is known. A thread keeps
  // its miss of the first round (every miss when n <= threads: batch-1 decode) in registers,
  // with the free slot it will take loaded at once, so that applying it reads nothing back.
  std::int32_t misses = 0, used = 0;
  std::int32_t my_e = -1, my_pos = -1, my_o = -1, my_free_slot = -1, first_round = 0;
  std::uint64_t my_crf = 0;  // DeviceCrf: the CRF this thread's first-round miss was touched to
  for (std::int32_t base = 0; base < n; base += nt) {
    const std::int32_t i = base + rank;
    std::int32_t miss = 0, e = -1;
    std::uint64_t crf_new = 0;
    if (i < n) {
      e = src.id(begin + i);
      const std::int32_t slot = (e >= 0 && e < E) ? src.slot_of(begin + i, e) : -2;
      s.prev_forward[i] = e;
      if (crf) {
        if (e >= 0 && e < E) {  // Crf::touch, hits and misses alike (ids are unique)
          crf_new = src.crf_now(begin + i, e, clk) + crf_one;
          s.expert_crf[e] = crf_new;
          s.expert_last[e] = clk;
        }
      }
      if (slot >= 0 && slot < C) {
        s.slot_tick[slot] = tick0 + static_cast<std::uint64_t>(i);
        if (lfru) s.slot_freq[slot] += 1;
        if (crf) {  // the slot's mirrors (VictimChunk)
          s.slot_freq[slot] = crf_new;
          s.slot_order[slot] = clk;
        }
        s.forward_map[e] = slot;
        if (live0 > 0 && s.slot_spec_left[slot] != 0) {  // a speculative fill used
          s.slot_spec_left[slot] = 0;
          ++used;
        }
      } else {
        miss = 1;
      }
    }
    std::int32_t total = 0;
    const std::int32_t offset = b.exclusive_sum(miss, total);
    if (miss) {
      s.fills[misses + offset] = PlanEntry{e, i};
      if (base == 0) {
        my_e = e;
        my_pos = i;
        my_o = offset;
        my_crf = crf_new;
        if (offset < free) my_free_slot = s.free_stack[free - 1 - offset];  // the r-th pop (free <= C)
      }
    }
    if (base == 0) first_round = total;
    misses += total;
  }
  const std::int32_t from_free = min_i32(misses, free);
  const std::int32_t victims = misses - from_free;

  // Victims: the `victims` smallest keys among the other residents, in order. One pass: every
  // thread loads the keys of its strided slots once (all loads in flight together; in registers
  // when capacity <= plan_victim_regs * threads, else reloaded chunk by chunk per victim), then
  // one block arg-min per victim over registers, each victim excluded from the next search
  // (LRU: strictly above the previous key; score policies: its register key voided). The thread
  // whose strided slots hold a victim records it and clears its resident entry at once; the
  // thread of the miss that takes it keeps its slot. Only evicting groups pay this.
  std::int32_t my_victim_slot = -1, evicted_unused = 0;
  const bool in_regs = C <= plan_victim_regs * nt;  // uniform
  // The thread whose strided slots hold victim j records it (one writer per slot).
  auto evict = [&](std::int32_t j, std::int32_t slot, std::int32_t owner) {
    s.evictions[j] = PlanEntry{owner, slot};
    if (owner >= 0 && owner < E) s.resident_map[owner] = -1;
    if (live0 > 0 && s.slot_spec_left[slot] != 0) {  // an unused speculative fill evicted: wasted
      s.slot_spec_left[slot] = 0;
      ++evicted_unused;
    }
  };
  // By rank (many victims, a scratch for every slot; LRU and DeviceCrf, whose keys stay fixed
  // during a group): every key goes into the scratch once, then victim j is the candidate with
  // exactly j smaller keys. The same victims in the same order as the arg-min searches below,
  // which take the smallest remaining key one at a time; a corrupted state records the same
  // victims before it fails.
  const RankScratch scratch = b.rank_scratch();
  const bool by_rank = !lfru && C <= scratch.capacity && plan_by_rank(lru, victims, C, nt);  // uniform
  if (victims > 0 && by_rank) {
    b.sync();  // hit ticks visible to every thread
    const std::int32_t my_j = my_o >= from_free ? my_o - from_free : -1;
    std::int32_t mine = 0;
    for (std::int32_t first = 0; first < C; first += plan_victim_regs * nt) {
      VictimChunk chunk;
      chunk.template load<Policy>(s, first, rank, nt, tick0, clk);
      mine += chunk.template store_rank_keys<Policy>(s, scratch, first, rank, nt, tick0);
    }
    const std::int32_t candidates = b.sum(mine);  // its barrier publishes the scratch
    // The candidates read back from the scratch (nothing kept across the barrier): LRU's are
    // the keys below tick0 (every other is a newer owner's or ~0), DeviceCrf's those with an
    // owner in the secondary word. Branch-free comparisons: the slot decides only between
    // equal keys, which only a corrupted state has among candidates.
    for (std::int32_t slot = rank; slot < C; slot += nt) {
      const std::uint64_t p = scratch.primary[slot];
      std::uint32_t q = 0;  // not a constant for LRU: its comparisons below are not folded away as pointless
      if (!lru) q = scratch.secondary[slot];
      if (lru ? p >= tick0 : q == ~std::uint32_t{0}) continue;
      std::int32_t below = 0;
      if (lru) {
        EXPERT_CACHE_PLAN_UNROLL_N(8)
        for (std::int32_t i = 0; i < C; ++i) {
          const std::uint64_t pi = scratch.primary[i];
          below += static_cast<std::int32_t>((pi < p) | ((pi == p) & (i < slot)));
        }
      } else {
        EXPERT_CACHE_PLAN_UNROLL_N(8)
        for (std::int32_t i = 0; i < C; ++i) {
          const std::uint64_t pi = scratch.primary[i];
          const std::uint32_t qi = scratch.secondary[i];
          below += static_cast<std::int32_t>((pi < p) | ((pi == p) & ((qi < q) | ((qi == q) & (i < slot)))));
        }
      }
      if (below >= victims) continue;
      if (!in_regs && !lru) s.slot_tick[slot] = ~std::uint64_t{0};  // as the arg-min path leaves it
      evict(below, slot, lru ? s.slot_owner[slot] : static_cast<std::int32_t>(q));
    }
    if (candidates < victims) {  // uniform: a corrupted state only (as below)
      if (rank == 0) publish_stats(b, s, in.before, in.now);
      return plan_fail(b, s, plan_error_bad_state);
    }
    b.sync();  // the eviction list visible to every thread
    if (my_j >= 0) my_victim_slot = s.evictions[my_j].slot;
  } else if (victims > 0) {
    b.sync();  // hit ticks (and, for n > threads, the fill list) visible to every thread
    const std::int32_t my_j = my_o >= from_free ? my_o - from_free : -1;
    VictimChunk chunk{};  // loaded below when the keys fit in registers (in_regs)
    if (in_regs) chunk.template load<Policy>(s, 0, rank, nt, tick0, clk);
    PlanKey last{0, -1};
    for (std::int32_t j = 0; j < victims; ++j) {
      std::int32_t found = -1;
      if (lru) {
        PlanKey best;
        if (in_regs) {
          best = chunk.best_lru(last, rank, nt, 0);
        } else {
          for (std::int32_t first = 0; first < C; first += plan_victim_regs * nt) {
            VictimChunk m;
            m.template load<Policy>(s, first, rank, nt, tick0, clk);
            const PlanKey k = m.best_lru(last, rank, nt, first);
            if (k < best) best = k;
          }
        }
        best = b.min_key(best);
        // Not found, or a resident of this group: only a corrupted state gets here (the host
        // planner reports the same as ErrorCode::internal). Uniform: every thread has `best`.
        if (best.slot < 0 || best.slot >= C || best.tick >= tick0) {
          if (rank == 0) publish_stats(b, s, in.before, in.now);
          return plan_fail(b, s, plan_error_bad_state);
        }
        found = best.slot;
        last = best;
      } else {
        // Lfru's clock before the insert of this victim's miss (its position in the group).
        std::uint64_t clock_j = 0;
        if (lfru) {
          const std::int32_t o = from_free + j;
          const std::int32_t pos = n <= nt ? b.sum(my_o == o ? my_pos : 0) : s.fills[o].slot;
          clock_j = tick0 + static_cast<std::uint64_t>(pos) - 1u;
        }
        ScoreKey best;
        if (in_regs) {
          best = chunk.template best_score<Policy>(s, clock_j, tick0, E, rank, nt, 0);
        } else {
          for (std::int32_t first = 0; first < C; first += plan_victim_regs * nt) {
            VictimChunk m;
            m.template load<Policy>(s, first, rank, nt, tick0, clk);
            const ScoreKey k = m.template best_score<Policy>(s, clock_j, tick0, E, rank, nt, first);
            if (k < best) best = k;
          }
        }
        best = b.min_score(best);
        if (best.slot < 0 || best.slot >= C) {  // no candidate: a corrupted state only
          if (rank == 0) publish_stats(b, s, in.before, in.now);
          return plan_fail(b, s, plan_error_bad_state);
        }
        found = best.slot;
      }
      if (found % nt == rank) {  // its strided slots hold the victim: this thread evicts it
        std::int32_t owner = -1;
        if (in_regs) {
          owner = chunk.take(found, rank, nt);
        } else {
          owner = s.slot_owner[found];
          if (!lru) s.slot_tick[found] = ~std::uint64_t{0};  // out of later reloads
        }
        evict(j, found, owner);
      }
      if (j == my_j) my_victim_slot = found;
    }
  }

  // Apply: the r-th miss pops the free stack while it lasts (top first, like the host's
  // pop_back), then takes the r - from_free-th victim's slot. First-round misses from
  // registers (no barrier needed: nothing below reads what another thread wrote above, and
  // with the victims in registers nobody stores their old ticks); later rounds' misses
  // (n > threads) from the lists, after a barrier.
  auto apply = [&](std::int32_t r, std::int32_t e, std::int32_t pos, std::int32_t slot, std::uint64_t crf_of_e) {
    if (slot < 0 || slot >= C || e < 0 || e >= E) return;  // corrupted free stack only
    s.fills[r].slot = slot;
    s.resident_map[e] = slot;
    s.forward_map[e] = slot;
    s.missing[e] = 1;
    s.slot_owner[slot] = e;
    s.slot_tick[slot] = tick0 + static_cast<std::uint64_t>(pos);
    if (lfru) {
      s.slot_freq[slot] = 1;
      s.slot_order[slot] = tick0 + static_cast<std::uint64_t>(pos);
    } else if (crf) {  // the slot's mirrors of e's touch above (VictimChunk)
      s.slot_freq[slot] = crf_of_e;
      s.slot_order[slot] = clk;
    }
    s.slot_needed[slot] = seq0 + static_cast<std::uint32_t>(r) + 1u;  // edge D4: this fill's value
  };
  if (victims > 0 && !in_regs) b.sync();  // the victims' void ticks land before the new ones
  if (my_o >= 0) apply(my_o, my_e, my_pos, my_o < from_free ? my_free_slot : my_victim_slot, my_crf);
  if (n > nt) {  // uniform
    b.sync();  // the fill list and the eviction list visible to every thread
    for (std::int32_t r = first_round + rank; r < misses; r += nt) {
      const PlanEntry f = s.fills[r];
      const std::int32_t slot = r < from_free ? s.free_stack[free - 1 - r] : s.evictions[r - from_free].slot;
      apply(r, f.expert, f.slot, slot, crf && f.expert >= 0 && f.expert < E ? s.expert_crf[f.expert] : 0);
    }
  }
  std::int32_t spec_used = 0, spec_wasted = 0;
  if (live0 > 0) {  // uniform
    spec_wasted = age_speculative(b, s);
    spec_used = b.sum(used);
    spec_wasted += b.sum(evicted_unused);
  }
  if (rank == 0) {
    sc.protect_tick = tick0;
    sc.spec_live = live0 - spec_used - spec_wasted;
    sc.free_count = free - from_free;
    sc.prev_count = n;
    sc.fill_count = misses;
    sc.eviction_count = victims;
    sc.hits = n - misses;
    sc.misses = misses;
    sc.group = g;
    sc.group_size = n;
    sc.tick = tick0 + static_cast<std::uint64_t>(n);
    if (crf) sc.crf_clock = clk;
    sc.fill_seq = seq0 + static_cast<std::uint32_t>(misses);
    DevicePlanStats now = in.now;
    now.hits += static_cast<std::uint64_t>(n - misses);
    now.misses += static_cast<std::uint64_t>(misses);
    now.evictions += static_cast<std::uint64_t>(victims);
    now.speculative_used += static_cast<std::uint64_t>(spec_used);
    now.speculative_wasted += static_cast<std::uint64_t>(spec_wasted);
    publish_stats(b, s, in.before, now);
  }
  b.sync();
}

}  // namespace detail

// Plans group g of the current forward (set up by plan_forward): ids unique[g*C, g*C + n) in
// ascending order, with ForwardPlanner<Lru>::plan_unique's decisions. g >= group_count is an
// empty group (see the overflow note at the top). All threads of the block call it.
// `forward` (internal): the call is plan_forward's group 0 (an empty forward still ages the
// speculative fills; a later empty round does not).
template <device_plan_policy Policy = DeviceLru, plan_block Block>
EXPERT_CACHE_HOST_DEVICE void plan_group(Block& b, const DevicePlanState& s, std::int32_t g,
                                         bool forward = false) noexcept {
  if (!plan_state_ok(s)) return detail::plan_fail(b, s, plan_error_bad_state);
  if (g < 0) return detail::plan_fail(b, s, plan_error_bad_argument);
  const DevicePlanScalars& sc = *s.scalars;
  detail::GroupInput in;
  in.forward = forward;
  in.prev = sc.prev_count;
  in.unique = sc.unique_count;
  in.groups = sc.group_count;
  in.width = sc.group_width;
  in.free = sc.free_count;
  in.tick0 = sc.tick;
  in.seq0 = sc.fill_seq;
  in.live0 = sc.spec_live;
  in.clock = sc.crf_clock;
  if (b.thread_rank() == 0) in.before = in.now = *s.counters;
  detail::plan_group_from<Policy>(b, s, g, in, detail::StateSource{&s});
}

}  // namespace expert_cache::inline v0
