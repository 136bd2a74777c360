#pragma once
/// The device plan's victim search: the keys one thread loads for its strided slots (VictimChunk) and when a group
/// takes its victims by rank instead of one block arg-min per victim.
//
// Used by the group step (group.hpp) and by plan_prefetch (prefetch.hpp), which search the
// same keys under different exclusions.
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/eviction/crf_math.hpp"
#include "expert_cache/planning/device_plan/block.hpp"
#include "expert_cache/planning/device_plan/policies.hpp"
#include "expert_cache/planning/device_plan/state.hpp"

namespace expert_cache::inline v0 {

// Slots per thread whose victim keys a group step keeps in registers (a warp: 256 slots).
inline constexpr std::int32_t plan_victim_regs = 8;
// A group takes its victims by rank when the block has a scratch for every slot and there are
// enough of them (LRU and DeviceCrf only, whose keys stay fixed during a group): one barrier and
// one pass of every candidate over every key, instead of one block arg-min (two barriers) per
// victim. Measured on the H200 (bench_device_plan, plan_block rows, 256 threads, 208 slots), a
// block arg-min costs about as much as this many steps of that pass: 80 for LRU's one-word keys,
// 40 for DeviceCrf's two words. So rank when victims x that > slots per thread x slots.
inline constexpr std::int32_t plan_rank_min_victims = 2;
inline constexpr std::int32_t plan_rank_steps_per_victim_lru = 80;
inline constexpr std::int32_t plan_rank_steps_per_victim_score = 40;
EXPERT_CACHE_HOST_DEVICE constexpr bool plan_by_rank(bool lru, std::int32_t victims, std::int32_t capacity,
                                                     std::int32_t threads) noexcept {
  const std::int64_t per_thread = (static_cast<std::int64_t>(capacity) + threads - 1) / threads;
  const std::int64_t steps = lru ? plan_rank_steps_per_victim_lru : plan_rank_steps_per_victim_score;
  return victims >= plan_rank_min_victims && static_cast<std::int64_t>(victims) * steps > per_thread * capacity;
}

namespace detail {

// One thread's share of a victim search: its strided slots first + rank + k * threads,
// k < plan_victim_regs, with what their keys need, loaded together (every load of the chunk in
// flight at once: one memory round trip per chunk, not one per slot). LRU keys are (tick, slot);
// DeviceCrf's are fixed during a group and computed here once; DeviceLfru's depend on the clock
// of each victim's miss, so its raw words are kept and scored per victim.
struct VictimChunk {
  std::int32_t owner[plan_victim_regs];
  std::uint64_t tick[plan_victim_regs];
  std::uint64_t score[plan_victim_regs];  // DeviceLfru: request count; DeviceCrf: CRF + bias
  std::uint64_t tie[plan_victim_regs];    // DeviceLfru: insertion tick; DeviceCrf: the owner
  // (DeviceCrf loads its slot mirrors into score / tie first: slot_freq, slot_order.)

  template <device_plan_policy Policy>
  EXPERT_CACHE_HOST_DEVICE void load(const DevicePlanState& s, std::int32_t first, std::int32_t rank, std::int32_t nt,
                                     std::uint64_t tick0, std::uint32_t clk) noexcept {
    const std::int32_t C = s.capacity, E = s.num_experts;
    EXPERT_CACHE_PLAN_UNROLL
    for (std::int32_t k = 0; k < plan_victim_regs; ++k) {
      const std::int32_t slot = first + rank + k * nt;
      const bool in = slot < C;
      owner[k] = in ? s.slot_owner[slot] : -1;
      tick[k] = in ? s.slot_tick[slot] : ~std::uint64_t{0};
      // Score policies: the slot's own words. DeviceLfru: count and insertion tick. DeviceCrf:
      // the resident's CRF and clock as of its last request (mirrors of expert_crf and
      // expert_last), so no load here waits for the owner.
      if (!EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::lru)) {
        score[k] = in ? s.slot_freq[slot] : 0;
        tie[k] = in ? s.slot_order[slot] : 0;
      }
    }
    if (EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::crf)) {
      // Two more passes, so that each pass's loads are all in flight together and no multiply
      // stands between them: the owners' bias and one power-table word per age; then one
      // multiply per key. Until the last pass `tie` holds the CRF and `score` the bias (fewer
      // live registers: the fused plan + fill kernel plans in 128 per thread).
      std::uint32_t age[plan_victim_regs];
      std::uint64_t power[plan_victim_regs];
      auto candidate = [&](std::int32_t k) { return owner[k] >= 0 && owner[k] < E && tick[k] < tick0; };
      EXPERT_CACHE_PLAN_UNROLL
      for (std::int32_t k = 0; k < plan_victim_regs; ++k) {
        const bool c = candidate(k);
        age[k] = c ? clk - static_cast<std::uint32_t>(tie[k]) : 0u;
        tie[k] = c ? score[k] : 0;  // the CRF as of its last request
        power[k] = tie[k] != 0 ? s.crf_pow[static_cast<std::int32_t>(age[k] & crf_pow_table_mask)] : 0;
        score[k] = c ? s.expert_bias[owner[k]] : 0;
      }
      EXPERT_CACHE_PLAN_UNROLL
      for (std::int32_t k = 0; k < plan_victim_regs; ++k) {
        // crf_at_table, with the table word already loaded (age >= the table: rare, a loop).
        const std::uint64_t crf = tie[k] == 0 ? 0 : crf_mul_q32(tie[k], crf_pow_high_bits(s.crf_pow.data, power[k], age[k]));
        const bool c = candidate(k);
        score[k] = c ? crf_add_sat(crf, score[k]) : ~std::uint64_t{0};
        tie[k] = c ? static_cast<std::uint64_t>(owner[k]) : ~std::uint64_t{0};
      }
    }
  }
  // The smallest LRU key above `last` (owner >= 0).
  EXPERT_CACHE_HOST_DEVICE PlanKey best_lru(PlanKey last, std::int32_t rank, std::int32_t nt,
                                            std::int32_t first) const noexcept {
    PlanKey best;
    EXPERT_CACHE_PLAN_UNROLL
    for (std::int32_t k = 0; k < plan_victim_regs; ++k) {
      const PlanKey key{tick[k], first + rank + k * nt};
      if (owner[k] >= 0 && last < key && key < best) best = key;
    }
    return best;
  }
  // The smallest score key among candidates (owner in [0, E), not of this group).
  template <device_plan_policy Policy>
  EXPERT_CACHE_HOST_DEVICE ScoreKey best_score(const DevicePlanState& s, std::uint64_t clock, std::uint64_t tick0,
                                               std::int32_t E, std::int32_t rank, std::int32_t nt,
                                               std::int32_t first) const noexcept {
    ScoreKey best;
    EXPERT_CACHE_PLAN_UNROLL
    for (std::int32_t k = 0; k < plan_victim_regs; ++k) {
      if (owner[k] < 0 || owner[k] >= E || tick[k] >= tick0) continue;
      const std::int32_t slot = first + rank + k * nt;
      const ScoreKey key = EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::lfru)
                               ? lfru_key_of(score[k], tie[k], slot, clock, tick[k])
                               : ScoreKey{score[k], tie[k], slot};
      if (key < best) best = key;
    }
    return best;
  }
  // Rank selection: this chunk's keys into the scratch at their slots (the slot is the key's
  // last word), as the arg-min searches order them: LRU (tick, slot) for every owner, DeviceCrf
  // (score, owner, slot) for candidates; every other slot (~0, ~0). Returns the number of
  // candidates, the keys the arg-min searches may take: LRU, owners older than this group (an
  // owner of this group would be a corrupted state's victim); score policies, the keys that
  // load() did not void.
  template <device_plan_policy Policy>
  EXPERT_CACHE_HOST_DEVICE std::int32_t store_rank_keys(const DevicePlanState& s, const RankScratch& r, std::int32_t first,
                                                        std::int32_t rank, std::int32_t nt, std::uint64_t tick0) const noexcept {
    const bool lru = EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::lru);
    std::int32_t candidates = 0;
    EXPERT_CACHE_PLAN_UNROLL
    for (std::int32_t k = 0; k < plan_victim_regs; ++k) {
      const std::int32_t slot = first + rank + k * nt;
      if (slot >= s.capacity) continue;
      const bool c = owner[k] >= 0 && tick[k] < tick0 && (lru || owner[k] < s.num_experts);
      const bool keyed = lru ? owner[k] >= 0 : c;
      r.primary[slot] = keyed ? (lru ? tick[k] : score[k]) : ~std::uint64_t{0};
      if (!lru) r.secondary[slot] = keyed ? static_cast<std::uint32_t>(tie[k]) : ~std::uint32_t{0};  // tie = owner < E
      candidates += c ? 1 : 0;
    }
    return candidates;
  }
  // Slot `slot` (one of this thread's, first chunk) is a victim: its owner, and its key voided.
  EXPERT_CACHE_HOST_DEVICE std::int32_t take(std::int32_t slot, std::int32_t rank, std::int32_t nt) noexcept {
    std::int32_t o = -1;
    EXPERT_CACHE_PLAN_UNROLL
    for (std::int32_t k = 0; k < plan_victim_regs; ++k) {
      if (rank + k * nt == slot) {
        o = owner[k];
        tick[k] = ~std::uint64_t{0};
      }
    }
    return o;
  }
};

}  // namespace detail

}  // namespace expert_cache::inline v0
