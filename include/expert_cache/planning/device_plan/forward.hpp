#pragma once
/// The device plan of one forward: plan_forward deduplicates top-k routing ids into the ascending unique list,
/// records the group count and plans group 0 (group.hpp), by a register small path for a few ids or a marking path
/// for any number.
//
// Ids: -1 is padding (ignored, like the host). Any other id outside [0, E) — INT32_MIN, -7,
// E, INT32_MAX: values a broken router writes, not padding — is counted in stats.bad_ids, flags
// plan_error_bad_id and is dropped (the plan is then the host plan of the remaining ids). An id
// is compared against E before it indexes anything. `sanitized` (optional) receives the ids
// with every dropped one replaced by -1, so a consumer indexing the forward map with them stays
// in bounds; it may alias the input.
//
// Speed: a forward of at most plan_small_ids ids (batch-1 decode: top-k <= 16) takes a
// small path: every thread loads all ids into registers and sorts them with a sorting network
// (no marks, no E-wide scan), and the loads the group step needs that nothing before it writes
// (scalars, counters, this thread's previous-forward entry and resident-map entry) are issued
// up front, so an all-hit step costs about two dependent memory round trips. Both paths run
// the same group step (plan_group_from) and leave byte-identical states
// (tests/host/test_device_plan.cpp compares them).
#include <climits>
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/eviction/crf_math.hpp"
#include "expert_cache/planning/device_plan/block.hpp"
#include "expert_cache/planning/device_plan/group.hpp"
#include "expert_cache/planning/device_plan/policies.hpp"
#include "expert_cache/planning/device_plan/state.hpp"

namespace expert_cache::inline v0 {

// Forwards of at most this many ids take the register-sort small path (a power of two).
inline constexpr std::int32_t plan_small_ids = 16;

namespace detail {

// The forward's bookkeeping (rank 0): scalars, counter increments, error flags.
template <plan_block Block>
EXPERT_CACHE_HOST_DEVICE void note_forward(Block& b, const DevicePlanState& s, std::int32_t unique,
                                           std::int32_t groups, std::int32_t width, std::int32_t bad,
                                           std::uint32_t flags, DevicePlanStats& now) noexcept {
  DevicePlanScalars& sc = *s.scalars;
  sc.unique_count = unique;
  sc.group_count = groups;
  sc.group_width = width;
  sc.bad_ids = bad;
  now.forwards += 1;
  if (bad > 0) {
    now.bad_ids += static_cast<std::uint64_t>(bad);
    flags |= plan_error_bad_id;
  }
  if (unique > s.capacity) {  // an overflow: more unique experts than slots (not merely narrow rounds)
    now.overflows += 1;
    now.overflow_groups += static_cast<std::uint64_t>(groups - 1);
    if (!s.forward_in_rounds) flags |= plan_error_overflow;
  }
  if (flags != 0) b.flags_or(*s.error_word, flags);
}

EXPERT_CACHE_HOST_DEVICE constexpr std::int32_t plan_groups_of(std::int32_t unique, std::int32_t capacity) noexcept {
  return static_cast<std::int32_t>((static_cast<std::int64_t>(unique) + capacity - 1) / capacity);
}

// Experts per group of a forward planned from `s` (a launch's copy: forward_in_rounds and
// round_width): the capacity unless the forward's rounds were declared narrower.
EXPERT_CACHE_HOST_DEVICE constexpr std::int32_t plan_width_of(const DevicePlanState& s) noexcept {
  return s.forward_in_rounds ? plan_group_width(s.round_width, s.capacity) : s.capacity;
}

// Ascending bitonic sorting network over N registers (N a power of two; every index is a
// compile-time constant once unrolled, so the array stays in registers).
template <std::int32_t N>
EXPERT_CACHE_HOST_DEVICE inline void sort_network(std::int32_t (&v)[N]) noexcept {
  static_assert(N > 0 && (N & (N - 1)) == 0);
  EXPERT_CACHE_PLAN_UNROLL
  for (std::int32_t k = 2; k <= N; k <<= 1) {
    EXPERT_CACHE_PLAN_UNROLL
    for (std::int32_t j = k >> 1; j > 0; j >>= 1) {
      EXPERT_CACHE_PLAN_UNROLL
      for (std::int32_t i = 0; i < N; ++i) {
        const std::int32_t l = i ^ j;
        if (l > i) {
          const std::int32_t a = v[i], c = v[l];
          const bool swap = ((i & k) == 0) ? (a > c) : (a < c);
          v[i] = swap ? c : a;
          v[l] = swap ? a : c;
        }
      }
    }
  }
}

// The small path's ids: sorted in registers (invalid ids as INT32_MAX, at the end).
struct SmallIds {
  std::int32_t v[plan_small_ids];
  // The k-th distinct valid id (INT32_MAX when k >= the distinct count).
  EXPERT_CACHE_HOST_DEVICE std::int32_t unique_at(std::int32_t k) const noexcept {
    std::int32_t e = INT32_MAX, pos = 0;
    EXPERT_CACHE_PLAN_UNROLL
    for (std::int32_t j = 0; j < plan_small_ids; ++j) {
      const bool keep = v[j] != INT32_MAX && (j == 0 || v[j] != v[j > 0 ? j - 1 : 0]);
      if (keep && pos == k) e = v[j];
      pos += keep ? 1 : 0;
    }
    return e;
  }
  EXPERT_CACHE_HOST_DEVICE std::int32_t unique_count() const noexcept {
    std::int32_t u = 0;
    EXPERT_CACHE_PLAN_UNROLL
    for (std::int32_t j = 0; j < plan_small_ids; ++j) {
      u += (v[j] != INT32_MAX && (j == 0 || v[j] != v[j > 0 ? j - 1 : 0])) ? 1 : 0;
    }
    return u;
  }
};

// The small path's reads: this thread's own index (k == rank) comes from values it loaded up
// front (nothing in this step writes them before they are used: prev_forward is rewritten only
// after the clear, resident_map only in the apply phase), other indices as in the state.
struct SmallSource {
  const DevicePlanState* s;
  const SmallIds* ids;
  std::int32_t rank;
  std::int32_t prev_mine, id_mine, slot_mine;
  // DeviceCrf: id_mine's CRF and last request, and the power-table word of its age's low bits.
  std::uint64_t crf_mine = 0, power_mine = 0;
  std::uint32_t last_mine = 0;
  EXPERT_CACHE_HOST_DEVICE std::int32_t prev(std::int32_t i) const noexcept {
    return i == rank ? prev_mine : s->prev_forward[i];
  }
  EXPERT_CACHE_HOST_DEVICE std::int32_t id(std::int32_t k) const noexcept {
    return k == rank ? id_mine : ids->unique_at(k);
  }
  EXPERT_CACHE_HOST_DEVICE std::int32_t slot_of(std::int32_t k, std::int32_t e) const noexcept {
    return k == rank ? slot_mine : s->resident_map[e];
  }
  EXPERT_CACHE_HOST_DEVICE std::uint64_t crf_now(std::int32_t k, std::int32_t e, std::uint32_t clk) const noexcept {
    if (k != rank) return crf_at_table(s->crf_pow.data, s->expert_crf[e], s->expert_last[e], clk);
    return crf_mine == 0 ? 0 : crf_mul_q32(crf_mine, crf_pow_high_bits(s->crf_pow.data, power_mine, clk - last_mine));
  }
};

}  // namespace detail

// The general path of plan_forward (any n_ids): dedup by marking instead of sorting: each valid
// id sets marks[id], then one block scan over the E marks emits the unique ids already in
// ascending order (and clears the marks). O(n_ids / threads + E / threads) for any n_ids, where
// a block radix sort needs the input size fixed at compile time and log2(E)-bit passes each with
// their own scans.
template <device_plan_policy Policy = DeviceLru, plan_block Block>
EXPERT_CACHE_HOST_DEVICE void plan_forward_general(Block& b, const DevicePlanState& s, const std::int32_t* ids,
                                                   std::int32_t n_ids, std::int32_t* sanitized = nullptr) noexcept {
  if (!plan_state_ok(s)) return detail::plan_fail(b, s, plan_error_bad_state);
  const std::int32_t rank = b.thread_rank(), nt = b.size();
  const std::int32_t E = s.num_experts;
  std::uint32_t arg_error = 0;
  if (n_ids < 0 || (ids == nullptr && n_ids > 0)) {
    arg_error = plan_error_bad_argument;
    n_ids = 0;  // planned as an empty forward: maps stay consistent
  }

  std::int32_t bad = 0;
  for (std::int32_t i = rank; i < n_ids; i += nt) {
    const std::int32_t id = ids[i];
    const bool valid = id >= 0 && id < E;
    if (valid) {
      b.mark(s.marks[id]);
    } else if (id != plan_padding_id) {
      ++bad;
    }
    if (sanitized != nullptr) sanitized[i] = valid ? id : plan_padding_id;
  }
  const std::int32_t bad_total = b.sum(bad);
  b.sync();  // every mark visible

  // A forward served in rounds lists its resident experts first (each part ascending): the
  // groups that hold them are consumed before any group evicts, so no group evicts an expert a
  // later group of the same forward would read from the pool (it would have to fill it again).
  // One scan per part; otherwise one ascending scan. Marks are cleared by the last scan.
  std::int32_t unique = 0;
  const bool residents_first = s.forward_in_rounds;
  for (std::int32_t part = residents_first ? 0 : 2; part < 3; ++part) {
    for (std::int32_t base = 0; base < E; base += nt) {
      const std::int32_t e = base + rank;
      const bool marked = e < E && s.marks[e] != 0;
      // part 0: the resident marked ids, part 1: the others, part 2: all of them.
      const bool resident = marked && part != 2 && s.resident_map[e] >= 0;
      const std::int32_t flag = (part == 2 ? marked : (part == 0) == resident && marked) ? 1 : 0;
      std::int32_t total = 0;
      const std::int32_t offset = b.exclusive_sum(flag, total);
      if (flag) s.unique[unique + offset] = e;
      if (marked && part != 0) s.marks[e] = 0;  // only this thread touches marks[e] in this phase
      unique += total;
    }
  }
  const std::int32_t width = detail::plan_width_of(s);
  const std::int32_t groups = detail::plan_groups_of(unique, width);
  if (rank == 0) {
    DevicePlanStats now = *s.counters;
    const DevicePlanStats before = now;
    detail::note_forward(b, s, unique, groups, width, bad_total, arg_error, now);
    detail::publish_stats(b, s, before, now);
  }
  b.sync();  // unique list and group count visible
  plan_group<Policy>(b, s, 0, true);
}

namespace detail {
template <device_plan_policy Policy, plan_block Block>
EXPERT_CACHE_HOST_DEVICE EXPERT_CACHE_PLAN_COLD void plan_forward_general_cold(Block& b, const DevicePlanState& s,
                                                                              const std::int32_t* ids, std::int32_t n_ids,
                                                                              std::int32_t* sanitized) noexcept {
  plan_forward_general<Policy>(b, s, ids, n_ids, sanitized);
}
}  // namespace detail

// The small path of plan_forward (0 <= n_ids <= plan_small_ids; otherwise the general path):
// the same result, from registers. Every thread loads all ids (one round trip, broadcast
// loads) and sorts them; the bad-id count and the distinct count are then known to every
// thread without a reduction, and thread r holds the group's r-th id and its resident-map entry
// before the group step starts.
template <device_plan_policy Policy = DeviceLru, plan_block Block>
EXPERT_CACHE_HOST_DEVICE void plan_forward_small(Block& b, const DevicePlanState& s, const std::int32_t* ids,
                                                 std::int32_t n_ids, std::int32_t* sanitized = nullptr) noexcept {
  if (n_ids > plan_small_ids || n_ids < 0 || (ids == nullptr && n_ids > 0) || s.forward_in_rounds) {
    return detail::plan_forward_general_cold<Policy>(b, s, ids, n_ids, sanitized);
  }
  if (!plan_view_ok(s)) return detail::plan_fail(b, s, plan_error_bad_state);
  const std::int32_t rank = b.thread_rank(), nt = b.size();
  const std::int32_t E = s.num_experts, C = s.capacity;
  const DevicePlanScalars& sc = *s.scalars;

  // Up front, independent of each other: scalars, counters, ids, this thread's old entry (one
  // memory round trip); the scalars are checked once they are here (plan_state_ok's check), so
  // the other loads do not wait for them. Reading the ids and the entry of a bad state is
  // harmless: nothing is stored before the check.
  detail::GroupInput in;
  const std::int32_t unique_before = sc.unique_count, groups_before = sc.group_count;
  in.forward = true;
  in.prev = sc.prev_count;
  in.free = sc.free_count;
  in.tick0 = sc.tick;
  in.seq0 = sc.fill_seq;
  in.live0 = sc.spec_live;
  in.clock = sc.crf_clock;
  if (rank == 0) in.before = in.now = *s.counters;
  const std::int32_t prev_mine = rank < C ? s.prev_forward[rank] : -1;
  detail::SmallIds sorted;
  std::int32_t clean[plan_small_ids];
  std::int32_t bad = 0;
  EXPERT_CACHE_PLAN_UNROLL
  for (std::int32_t j = 0; j < plan_small_ids; ++j) {
    const std::int32_t id = j < n_ids ? ids[j] : plan_padding_id;
    const bool valid = id >= 0 && id < E;
    bad += (!valid && id != plan_padding_id) ? 1 : 0;
    clean[j] = valid ? id : plan_padding_id;
    sorted.v[j] = valid ? id : INT32_MAX;
  }
  if (!plan_counts_ok(in.free, in.prev, unique_before, groups_before, in.live0, E, C)) {
    return detail::plan_fail(b, s, plan_error_bad_state);
  }
  detail::sort_network(sorted.v);
  const std::int32_t unique = sorted.unique_count();
  const std::int32_t groups = detail::plan_groups_of(unique, C);
  in.unique = unique;
  in.groups = groups;
  const std::int32_t n0 = detail::min_i32(C, unique);
  const std::int32_t id_mine = rank < n0 ? sorted.unique_at(rank) : -1;
  const std::int32_t slot_mine = rank < n0 ? s.resident_map[id_mine] : -2;
  detail::SmallSource src{&s, &sorted, rank, prev_mine, id_mine, slot_mine};
  if (EXPERT_CACHE_PLAN_KIND_IS(Policy, s, DevicePolicyKind::crf)) {
    // The CRF update of this thread's id, loaded now (nothing before the group step writes it),
    // the table word as soon as its age is known: both round trips overlap the work below.
    if (rank < n0) {
      src.crf_mine = s.expert_crf[id_mine];
      src.last_mine = s.expert_last[id_mine];
      src.power_mine = s.crf_pow[static_cast<std::int32_t>((in.clock + 1u - src.last_mine) & crf_pow_table_mask)];
    }
  }

  if (sanitized != nullptr) {
    b.sync();  // sanitized may alias ids: every thread has read them
    for (std::int32_t i = rank; i < n_ids; i += nt) {
      std::int32_t x = plan_padding_id;
      EXPERT_CACHE_PLAN_UNROLL
      for (std::int32_t j = 0; j < plan_small_ids; ++j) x = j == i ? clean[j] : x;
      sanitized[i] = x;
    }
  }
  for (std::int32_t t = rank; t < unique; t += nt) s.unique[t] = t == rank && t < n0 ? id_mine : sorted.unique_at(t);
  in.width = C;
  if (rank == 0) detail::note_forward(b, s, unique, groups, C, bad, 0u, in.now);
  detail::plan_group_from<Policy>(b, s, 0, in, src);
}

// Plans one forward from top-k routing ids (any length; duplicates allowed; -1 padding; other
// out-of-range ids counted and dropped): deduplicates into the ascending unique list, records
// the group count, and plans group 0. All threads of the block call it. Up to plan_small_ids
// ids take the register path, more the marking path: the same state either way.
template <device_plan_policy Policy = DeviceLru, plan_block Block>
EXPERT_CACHE_HOST_DEVICE void plan_forward(Block& b, const DevicePlanState& s, const std::int32_t* ids,
                                           std::int32_t n_ids, std::int32_t* sanitized = nullptr) noexcept {
  if (n_ids >= 0 && n_ids <= plan_small_ids && !s.forward_in_rounds) {
    return plan_forward_small<Policy>(b, s, ids, n_ids, sanitized);
  }
  plan_forward_general<Policy>(b, s, ids, n_ids, sanitized);
}

}  // namespace expert_cache::inline v0
