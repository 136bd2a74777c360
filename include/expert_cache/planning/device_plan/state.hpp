#pragma once
/// The device plan's state: the flat arrays and scalars one cache's planner works on, their layout in one allocation,
/// and the checks that a view of them is consistent.
//
// Plain pointers and sizes (PlanSpan) fixed for the cache's lifetime: a view passed by value as
// a kernel parameter stays valid in a replayed graph, and the same layout on the host and the
// device lets a byte copy of the device block be read as a state. Every planning function of
// planning/device_plan/ works on a DevicePlanState; nothing here plans.
//
// The stats the host reads live in mapped host memory, but the planner never READS mapped
// memory (a PCIe round trip each): the authoritative counters sit in the state block (device
// memory) and every change is published to the mapped mirror with a plain store
// (detail::publish_stats, block.hpp).
//
// Host-compilable with g++ alone (no CUDA headers); under nvcc every function here is
// __host__ __device__.
#include <cstddef>
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/eviction/crf_math.hpp"

namespace expert_cache::inline v0 {

// Pointer + size: cuda::std::span is not available to g++, and the kernel parameter must be a
// trivially copyable view.
template <class T>
struct PlanSpan {
  T* data = nullptr;
  std::int32_t size = 0;
  EXPERT_CACHE_HOST_DEVICE constexpr T& operator[](std::int32_t i) const noexcept { return data[i]; }
};

// One fill (slot `slot` must receive expert `expert`) or one eviction (expert left slot).
struct PlanEntry {
  std::int32_t expert = -1;
  std::int32_t slot = -1;
  friend constexpr bool operator==(const PlanEntry&, const PlanEntry&) = default;
};

// Cumulative counters. Two copies: the authoritative one in the state block (device memory,
// DevicePlanState::counters) and a mirror in mapped host memory on the GPU (DevicePlanState::stats)
// that the host reads while a graph runs; each changed word is stored to the mirror whole
// (64-bit aligned, single-copy atomic), never read back by the device.
struct DevicePlanStats {
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t evictions = 0;
  std::uint64_t overflows = 0;        // forwards with more unique experts than slots
  std::uint64_t overflow_groups = 0;  // groups beyond group 0 those forwards needed
  std::uint64_t bad_ids = 0;          // ids dropped by plan_forward / plan_invalidate
  std::uint64_t forwards = 0;         // plan_forward calls
  std::uint64_t invalidations = 0;    // experts dropped by plan_invalidate
  // Speculative fills (plan_prefetch; the same rules as ForwardPlanner::plan_prefetch).
  std::uint64_t prefetches = 0;          // plan_prefetch calls
  std::uint64_t speculative_issued = 0;  // experts made resident by plan_prefetch (not misses)
  std::uint64_t speculative_used = 0;    // ... then hit by a forward (also counted in hits)
  std::uint64_t speculative_wasted = 0;  // ... expired, evicted or invalidated unused
  friend constexpr bool operator==(const DevicePlanStats&, const DevicePlanStats&) = default;
};

// Bits of the sticky error word (OR-ed by the device, read and cleared by the host).
enum PlanErrorBit : std::uint32_t {
  plan_error_bad_id = 1u << 0,        // an id outside [0, E) other than -1 was dropped
  plan_error_overflow = 1u << 1,      // a forward needed more than one group (not one served in rounds)
  plan_error_bad_state = 1u << 2,     // the state view or its scalars are inconsistent: nothing planned
  plan_error_bad_argument = 1u << 3,  // n_ids < 0, null ids with n_ids > 0, or group < 0
  // A kernel's bounded spin-wait gave up (about 1.5 s): the fused fill's wait for the plan, or
  // a readiness consumer's wait for a slot's ready word (kernels/slot_ready.cuh). The kernel
  // went on instead of hanging; what it computed is not trustworthy.
  plan_error_wait_timeout = 1u << 4,
  // The copy engine's proxy could not issue a fill's copy (device_cache/copy_proxy.cuh): the slot's
  // ready word was published all the same, its bytes are not trustworthy; the cache's next call
  // returns the failure as a Status.
  plan_error_fill_failed = 1u << 5,
};

// Requests the copy engine's ring of one cache holds (device_cache/copy_proxy.cuh; the SimRuntime
// model uses the same depth): a prefetch, the forward and its overflow groups may be posted
// before the proxy took the first.
inline constexpr std::uint32_t proxy_ring_depth = 8;

// Mutable scalars of one cache's planning state (device memory on the GPU).
struct DevicePlanScalars {
  std::uint64_t tick = 1;          // next recency tick (slot_tick 0 = never used)
  std::int32_t free_count = 0;     // entries of free_stack in use; top = free_count - 1
  std::int32_t prev_count = 0;     // experts of the last planned group (in prev_forward)
  std::int32_t unique_count = 0;   // unique valid experts of the current forward
  std::int32_t group_count = 0;    // ceil(unique_count / group_width); 0 for an empty forward
  std::int32_t group_width = 0;    // experts per group of the current forward (capacity unless
                                   // its rounds were declared narrower; 0 = capacity)
  std::int32_t group = 0;          // group planned last
  std::int32_t group_size = 0;     // its experts
  std::int32_t fill_count = 0;     // entries of fills (= misses of the last group)
  std::int32_t eviction_count = 0; // entries of evictions
  std::int32_t hits = 0;           // of the last group
  std::int32_t misses = 0;         // of the last group
  std::int32_t bad_ids = 0;        // of the last forward
  std::int32_t last_invalidated_slot = -1;
  // Used only by the fused plan + fill kernel (kernels/plan_fill.cuh): block 0 sets fill_ready
  // (release) once the fill list is written; the other blocks wait for it (acquire); the last
  // block to finish (fill_done counts them) sets both back to 0 for the next launch.
  std::uint32_t fill_ready = 0;
  std::uint32_t fill_done = 0;
  // Per-slot readiness (docs/design.md, edge D4): the last fill sequence value handed out. Each
  // planned fill takes the next value (wrapping uint32; compared with slot_seq_reached).
  std::uint32_t fill_seq = 0;
  // Speculative fills: slots whose slot_spec_left is non-zero, and the first tick of the last
  // planned group (its residents, ticks >= protect_tick, are protected from plan_prefetch's
  // victim search like the host planner's previous forward; ~0 = no group planned yet).
  std::int32_t spec_live = 0;
  std::uint64_t protect_tick = ~std::uint64_t{0};
  // The last plan_prefetch: predicted ids already resident, and distinct ones dropped because
  // every slot was protected (PrefetchPlan's skipped_resident / skipped_no_victim).
  std::int32_t prefetch_skipped_resident = 0;
  std::int32_t prefetch_skipped_no_victim = 0;
  // DeviceCrf only: forwards (planned groups) seen, and the decay per forward in Q32
  // (eviction/crf_math.hpp; Crf's CrfParams::decay_q32). The planner reads the decay through its
  // powers (DevicePlanState::crf_pow, filled from this value by reset_plan_state).
  std::uint32_t crf_clock = 0;
  std::uint64_t crf_decay = crf_default_decay_q32;
};

// The device policies (policies.hpp).
enum class DevicePolicyKind : std::uint8_t { lru, lfru, crf };

// The view every planning function works on. Plain pointers, fixed for the cache's lifetime:
// passed by value as a kernel parameter, it stays valid in a replayed graph.
struct DevicePlanState {
  std::int32_t num_experts = 0;  // E
  std::int32_t capacity = 0;     // C
  PlanSpan<std::int32_t> resident_map;  // [E] expert -> slot, -1 absent (every resident)
  PlanSpan<std::int32_t> forward_map;   // [E] expert -> slot for the last planned group only
  PlanSpan<std::int32_t> unique;        // [E] unique valid ids of the current forward, ascending
                                        // (in rounds: the resident ones first, see the overflow note)
  PlanSpan<std::uint32_t> marks;        // [E] dedup scratch, all zero between calls
  // [E] 1 for the misses of the last planned group (the experts its fill list names), else 0:
  // what a consumer that copies missing experts itself reads (DeviceCacheOptions::
  // fill_by_consumer). Each group step clears the previous group's entries before it sets its
  // own; plan_prefetch never touches it (its fills are real fills); plan_invalidate clears it.
  PlanSpan<std::int32_t> missing;
  PlanSpan<std::int32_t> slot_owner;    // [C] slot -> expert, -1 free
  PlanSpan<std::uint64_t> slot_tick;    // [C] recency tick of the slot's resident (LRU = smallest)
  PlanSpan<std::int32_t> free_stack;    // [C] LIFO, same initial order and pops as ForwardPlanner
  PlanSpan<std::int32_t> prev_forward;  // [C] experts of the last group (sparse forward-map clear)
  PlanSpan<PlanEntry> fills;            // [C] fill list of the last group, in processing order
  PlanSpan<PlanEntry> evictions;        // [C] evictions of the last group, in order
  // Per-slot readiness (edge D4). slot_needed[s]: the sequence value slot s's content must have
  // reached, written by the plan (a miss takes a new value; a hit keeps the value of the fill
  // that last wrote the slot). slot_ready[s]: the value of the last COMPLETED fill of slot s,
  // stored (release) by the overlapped fill once every byte of it landed. A reader may read slot
  // s once slot_seq_reached(slot_ready[s], slot_needed[s]) (acquire). Both only grow, so a
  // replayed graph needs no reset. fill_arrivals[i]: blocks done with fill i (the overlapped
  // fill's per-fill counter; the last block resets it).
  PlanSpan<std::uint32_t> slot_needed;  // [C]
  PlanSpan<std::uint32_t> slot_ready;   // [C]
  PlanSpan<std::uint32_t> fill_arrivals;  // [C]
  // Finer readiness (edge D4c): when the overlapped fill copies a first part of every expert
  // (PlanFillParams::first_part_items: the copy regions a consumer's first pass reads) before
  // the rest, slot_ready_first[s] is stored (release) once slot s's first part landed, and
  // fill_arrivals_first counts the blocks done with fill i's first part. Without a split both
  // words are stored together after the whole expert. Grow like slot_ready.
  PlanSpan<std::uint32_t> slot_ready_first;     // [C]
  PlanSpan<std::uint32_t> fill_arrivals_first;  // [C]
  // slot_spec_left[s]: forwards left before the unused speculative fill in slot s expires
  // (0 = the slot holds no live speculative fill).
  PlanSpan<std::uint32_t> slot_spec_left;  // [C]
  // Policy state beyond the recency tick (every policy's arrays are bound, whichever plans: a
  // few bytes per expert, one layout). DeviceLfru: a resident's request count and the tick it
  // was inserted at (its place in Lfru's insertion order), in slot_freq / slot_order.
  // DeviceCrf: every expert's CRF (Q32) and the clock of its last request (kept after eviction,
  // like Crf), and its prior bias; slot_freq / slot_order mirror the resident's CRF and clock,
  // written with them, so a victim search loads them with the owner instead of after it.
  PlanSpan<std::uint64_t> slot_freq;    // [C]
  PlanSpan<std::uint64_t> slot_order;   // [C]
  PlanSpan<std::uint64_t> expert_crf;   // [E]
  PlanSpan<std::uint64_t> expert_bias;  // [E] 0 = no prior (plan_set_bias)
  PlanSpan<std::uint32_t> expert_last;  // [E]
  // crf_pow[a] = crf_decay_pow(crf_decay, a), a < crf_pow_table_size: DeviceCrf decays a CRF with
  // one lookup (crf_decay_pow_table) instead of a chain of multiplies per resident.
  PlanSpan<std::uint64_t> crf_pow;      // [crf_pow_table_size]
  DevicePlanScalars* scalars = nullptr;
  DevicePlanStats* counters = nullptr;  // authoritative counters (in the block)
  DevicePlanStats* stats = nullptr;     // their published mirror (mapped host memory on the GPU)
  std::uint32_t* error_word = nullptr;
  // Set (in the copy of the state one plan_forward launch takes) by a caller that serves every
  // group of that forward itself (prepare + prepare_group rounds, a wide forward): its overflow
  // is planned work, counted in the stats but not raised as plan_error_overflow.
  bool forward_in_rounds = false;
  // With forward_in_rounds: experts per group, 1..capacity (0 = capacity). Narrower groups leave
  // room beside the group being consumed: a prefetch of the next group's experts (which never
  // evicts the group planned last) can then fill them while that group's consumer runs.
  std::int32_t round_width = 0;
  // The policy DeviceRuntimePolicy plans this state with (set before the reset, fixed after it);
  // the static policies never read it.
  DevicePolicyKind policy = DevicePolicyKind::lru;
};

// An id every planning function ignores: the padding of a routing list, as the host planner's.
inline constexpr std::int32_t plan_padding_id = -1;

// ---- one allocation for every array ----------------------------------------------------------

namespace detail {
// Lays the arrays out back to back (16-byte aligned) from `base`; base 0 measures the size.
struct PlanCursor {
  std::uintptr_t at;
  template <class T>
  EXPERT_CACHE_HOST_DEVICE PlanSpan<T> take(std::int32_t n) noexcept {
    at = (at + 15u) & ~std::uintptr_t{15};
    PlanSpan<T> s{reinterpret_cast<T*>(at), n};
    at += sizeof(T) * static_cast<std::size_t>(n);
    return s;
  }
};
}  // namespace detail

// Binds a view onto `base` (plan_state_bytes(E, C) bytes, 16-byte aligned). The same layout on
// the host and the device, so a byte copy of the device block, bound here, reads as a state.
EXPERT_CACHE_HOST_DEVICE inline DevicePlanState bind_plan_state(void* base, std::int32_t num_experts,
                                                                std::int32_t capacity, DevicePlanStats* stats,
                                                                std::uint32_t* error_word) noexcept {
  DevicePlanState s;
  s.num_experts = num_experts;
  s.capacity = capacity;
  detail::PlanCursor c{reinterpret_cast<std::uintptr_t>(base)};
  s.scalars = c.take<DevicePlanScalars>(1).data;
  s.counters = c.take<DevicePlanStats>(1).data;
  s.slot_tick = c.take<std::uint64_t>(capacity);
  s.resident_map = c.take<std::int32_t>(num_experts);
  s.forward_map = c.take<std::int32_t>(num_experts);
  s.unique = c.take<std::int32_t>(num_experts);
  s.marks = c.take<std::uint32_t>(num_experts);
  s.missing = c.take<std::int32_t>(num_experts);
  s.slot_owner = c.take<std::int32_t>(capacity);
  s.free_stack = c.take<std::int32_t>(capacity);
  s.prev_forward = c.take<std::int32_t>(capacity);
  s.fills = c.take<PlanEntry>(capacity);
  s.evictions = c.take<PlanEntry>(capacity);
  s.slot_needed = c.take<std::uint32_t>(capacity);
  s.slot_ready = c.take<std::uint32_t>(capacity);
  s.fill_arrivals = c.take<std::uint32_t>(capacity);
  s.slot_ready_first = c.take<std::uint32_t>(capacity);
  s.fill_arrivals_first = c.take<std::uint32_t>(capacity);
  s.slot_spec_left = c.take<std::uint32_t>(capacity);
  s.slot_freq = c.take<std::uint64_t>(capacity);
  s.slot_order = c.take<std::uint64_t>(capacity);
  s.expert_crf = c.take<std::uint64_t>(num_experts);
  s.expert_bias = c.take<std::uint64_t>(num_experts);
  s.expert_last = c.take<std::uint32_t>(num_experts);
  s.crf_pow = c.take<std::uint64_t>(static_cast<std::int32_t>(crf_pow_table_size));
  s.stats = stats;
  s.error_word = error_word;
  return s;
}

EXPERT_CACHE_HOST_DEVICE inline std::size_t plan_state_bytes(std::int32_t num_experts, std::int32_t capacity) noexcept {
  if (num_experts <= 0 || capacity <= 0) return 0;
  const DevicePlanState s = bind_plan_state(nullptr, num_experts, capacity, nullptr, nullptr);
  const auto end = reinterpret_cast<std::uintptr_t>(s.crf_pow.data + s.crf_pow.size);
  return static_cast<std::size_t>(end);
}

// Shape and pointers consistent (reads only the view: callable by the host on a device view).
EXPERT_CACHE_HOST_DEVICE inline bool plan_view_ok(const DevicePlanState& s) noexcept {
  const std::int32_t e = s.num_experts, c = s.capacity;
  if (e <= 0 || c <= 0 || c > e || s.scalars == nullptr || s.counters == nullptr || s.stats == nullptr ||
      s.error_word == nullptr) {
    return false;
  }
  if (s.resident_map.size != e || s.forward_map.size != e || s.unique.size != e || s.marks.size != e ||
      s.missing.size != e ||
      s.expert_crf.size != e || s.expert_bias.size != e || s.expert_last.size != e ||
      s.crf_pow.size != static_cast<std::int32_t>(crf_pow_table_size)) {
    return false;
  }
  return s.slot_owner.size == c && s.slot_tick.size == c && s.free_stack.size == c && s.prev_forward.size == c &&
         s.fills.size == c && s.evictions.size == c && s.slot_needed.size == c && s.slot_ready.size == c &&
         s.fill_arrivals.size == c && s.slot_ready_first.size == c && s.fill_arrivals_first.size == c &&
         s.slot_spec_left.size == c && s.slot_freq.size == c && s.slot_order.size == c;
}

// The scalars' counts within their arrays (E experts, C slots).
EXPERT_CACHE_HOST_DEVICE constexpr bool plan_counts_ok(std::int32_t free, std::int32_t prev, std::int32_t unique,
                                                       std::int32_t groups, std::int32_t live, std::int32_t e,
                                                       std::int32_t c) noexcept {
  return free >= 0 && free <= c && prev >= 0 && prev <= c && unique >= 0 && unique <= e && groups >= 0 && groups <= e &&
         live >= 0 && live <= c;
}
// The view, and the scalars within range (dereferences them: where the state lives). Checked at
// every entry so a broken view cannot make the planner index out of bounds; the scalars are
// written only by this code, the check guards against a state corrupted from outside.
EXPERT_CACHE_HOST_DEVICE inline bool plan_state_ok(const DevicePlanState& s) noexcept {
  if (!plan_view_ok(s)) return false;
  const DevicePlanScalars& k = *s.scalars;
  return plan_counts_ok(k.free_count, k.prev_count, k.unique_count, k.group_count, k.spec_live, s.num_experts, s.capacity);
}

}  // namespace expert_cache::inline v0
