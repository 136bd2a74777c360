#pragma once
// Device policies: DeviceLru (below), DeviceLfru (= Lfru) and DeviceCrf (= Crf) are template
// arguments of every planning function (plan_group_from says how the score policies search);
// DeviceRuntimePolicy plans with the one its state names (host planning only, see there).
//
// Device-side forward planning: the LRU planning step written once as
// __host__ __device__ code over a flat state of plain arrays, so the CPU suite runs the very
// algorithm the CUDA kernel runs (planning/device_plan.hpp + SequentialBlock on the host,
// kernels/plan_kernels.cuh + CubBlock on the GPU). Its decisions equal ForwardPlanner<Lru>
// exactly: the same hits, misses, victims, slots, fill and eviction lists, resident map and
// forward map after every step (tests/host/test_device_plan.cpp, tests/gpu/test_device_plan.cu).
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
// Ids: -1 is padding (ignored, like the host). Any other id outside [0, E) — INT32_MIN, -7,
// E, INT32_MAX: values a broken router writes, not padding — is counted in stats.bad_ids, flags
// plan_error_bad_id and is dropped (the plan is then the host plan of the remaining ids). An id
// is compared against E before it indexes anything. `sanitized` (optional) receives the ids
// with every dropped one replaced by -1, so a consumer indexing the forward map with them stays
// in bounds; it may alias the input.
//
// Speed: the stats the host reads live in mapped host memory, but the
// planner never READS mapped memory (a PCIe round trip each): the authoritative counters sit in
// the state block (device memory) and every change is published to the mapped mirror with a
// plain store. A forward of at most plan_small_ids ids (batch-1 decode: top-k <= 16) takes a
// small path: every thread loads all ids into registers and sorts them with a sorting network
// (no marks, no E-wide scan), and the loads the group step needs that nothing before it writes
// (scalars, counters, this thread's previous-forward entry and resident-map entry) are issued
// up front, so an all-hit step costs about two dependent memory round trips. Both paths run
// the same group step (plan_group_from) and leave byte-identical states
// (tests/host/test_device_plan.cpp compares them).
//
// Host-compilable with g++ alone (no CUDA headers); under nvcc every function here is
// __host__ __device__.
#include <bit>
#include <climits>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "expert_cache/base/config.hpp"
#include "expert_cache/eviction/crf_math.hpp"

// Full unrolling of the fixed-size register loops, and partial unrolling (N loads in flight) of
// the rank scan over the slots (g++ would warn about an unknown pragma).
#if defined(__CUDA_ARCH__)
#define EXPERT_CACHE_PLAN_UNROLL _Pragma("unroll")
#define EXPERT_CACHE_PLAN_UNROLL_N(n) _Pragma(EXPERT_CACHE_PLAN_STR(unroll n))
#define EXPERT_CACHE_PLAN_STR(x) #x
#else
#define EXPERT_CACHE_PLAN_UNROLL
#define EXPERT_CACHE_PLAN_UNROLL_N(n)
#endif
// A path the small kernel rarely takes, kept out of line on the GPU: inlined, it sat between the
// hot path's blocks, and a plan runs on an SM whose instruction cache is cold for it.
#if defined(__CUDACC__)
#define EXPERT_CACHE_PLAN_COLD __noinline__
#else
#define EXPERT_CACHE_PLAN_COLD
#endif

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
  // a readiness consumer's wait for a slot's ready word (kernels/plan_kernels.cuh). The kernel
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
  // Used only by the fused plan + fill kernel (kernels/plan_kernels.cuh): block 0 sets fill_ready
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

// The device policies (below).
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

// Ordering key of a resident: (tick, slot). Ticks of residents are distinct; the slot only
// makes the order total should a corrupted state repeat one.
struct PlanKey {
  std::uint64_t tick = ~std::uint64_t{0};
  std::int32_t slot = 0x7fffffff;
  EXPERT_CACHE_HOST_DEVICE friend constexpr bool operator<(const PlanKey& a, const PlanKey& b) noexcept {
    return a.tick < b.tick || (a.tick == b.tick && a.slot < b.slot);
  }
};

// Ordering key of a resident under a score policy: (score, tie, slot), the lowest is the victim.
// DeviceLfru: score = the bits of the double freq / age (positive doubles order like their bits),
// tie = insertion tick. DeviceCrf: score = CRF + bias, tie = expert id.
struct ScoreKey {
  std::uint64_t score = ~std::uint64_t{0};
  std::uint64_t tie = ~std::uint64_t{0};
  std::int32_t slot = 0x7fffffff;
  EXPERT_CACHE_HOST_DEVICE friend constexpr bool operator<(const ScoreKey& a, const ScoreKey& b) noexcept {
    return a.score < b.score || (a.score == b.score && (a.tie < b.tie || (a.tie == b.tie && a.slot < b.slot)));
  }
};

// The device policies, chosen at compile time (a template argument of every planning function,
// the kernels and DeviceExpertCache; DeviceLru by default). Each takes exactly the decisions of
// its host policy (`host` names it): DeviceLru = Lru, DeviceLfru = Lfru (vLLM's LFRU), DeviceCrf =
// Crf (LRFU's CRF order per layer, eviction/crf.hpp).
struct DeviceLru {
  static constexpr DevicePolicyKind kind = DevicePolicyKind::lru;
  static constexpr const char* name = "lru";
  static constexpr bool free_highest_first = false;  // Lru's FreeSlotOrder::lowest_first
};
struct DeviceLfru {
  static constexpr DevicePolicyKind kind = DevicePolicyKind::lfru;
  static constexpr const char* name = "lfru";
  static constexpr bool free_highest_first = true;  // Lfru's FreeSlotOrder::highest_first
};
struct DeviceCrf {
  static constexpr DevicePolicyKind kind = DevicePolicyKind::crf;
  static constexpr const char* name = "crf";
  static constexpr bool free_highest_first = false;
};
// The policy chosen at run time: every branch a static policy resolves at compile time reads
// the state's kind (DevicePlanState::policy) instead, so ONE instantiation of the planning code
// plans with any of the three, with the same decisions. For host planning, where each
// instantiation costs seconds of a user's -O2 build (the SimRuntime executor behind
// make_expert_cache); the kernels keep the static policies, their branches resolved at
// compile time.
struct DeviceRuntimePolicy {
  static constexpr const char* name = "runtime";
};
template <class P>
concept device_plan_policy = std::same_as<P, DeviceRuntimePolicy> || requires {
  { P::kind } -> std::convertible_to<DevicePolicyKind>;
  { P::free_highest_first } -> std::convertible_to<bool>;
};

namespace detail {
template <class Policy>
inline constexpr bool plan_kind_fixed = !std::same_as<Policy, DeviceRuntimePolicy>;
template <class Policy>
struct PlanFixedKind {
  static constexpr DevicePolicyKind value = Policy::kind;
};
template <>
struct PlanFixedKind<DeviceRuntimePolicy> {
  static constexpr DevicePolicyKind value = DevicePolicyKind::lru;  // never read (plan_kind_fixed is false)
};
template <device_plan_policy Policy>
EXPERT_CACHE_HOST_DEVICE constexpr bool plan_free_highest_first(DevicePolicyKind state_kind) noexcept {
  if constexpr (std::same_as<Policy, DeviceRuntimePolicy>) {
    return state_kind == DeviceLfru::kind ? DeviceLfru::free_highest_first
           : state_kind == DeviceCrf::kind ? DeviceCrf::free_highest_first
                                           : DeviceLru::free_highest_first;
  } else {
    (void)state_kind;
    return Policy::free_highest_first;
  }
}
}  // namespace detail

// Whether a step of Policy on `state` plans with kind K. For a static policy a constant
// expression (`true ? constant : ...`), so each branch on it resolves at compile time and the
// kernels' code is what `if constexpr` on Policy::kind gives; for DeviceRuntimePolicy the
// state's kind. A macro because a function's result is never a constant expression once an
// argument is a run-time value.
#define EXPERT_CACHE_PLAN_KIND_IS(Policy, state, K)                                                        \
  (::expert_cache::detail::plan_kind_fixed<Policy> ? ::expert_cache::detail::PlanFixedKind<Policy>::value == (K) \
                                                   : (state).policy == (K))

// Block-shared memory for rank selection of victims (plan_group_from): per slot a primary key
// word (LRU's tick, DeviceCrf's CRF + bias) and a secondary one (DeviceCrf's owner, an expert id),
// `capacity` slots; capacity 0 = none (victims by arg-min).
struct RankScratch {
  std::uint64_t* primary = nullptr;
  std::uint32_t* secondary = nullptr;
  std::int32_t capacity = 0;
};

// Cooperative primitives the planning code needs from the group of threads running it. Every
// member except thread_rank/size is called by all threads of the block with the same control
// flow (block-collective); publish / flags_or are called by thread 0 only, the single writer of
// the stats mirror and the error word (so they need no atomic read-modify-write).
template <class B>
concept plan_block = requires(B& b, std::int32_t v, std::int32_t& total, PlanKey k, std::uint64_t& c64,
                              std::uint32_t& c32) {
  { b.thread_rank() } -> std::same_as<std::int32_t>;
  { b.size() } -> std::same_as<std::int32_t>;
  b.sync();                                                         // barrier + memory visibility
  { b.exclusive_sum(v, total) } -> std::same_as<std::int32_t>;     // prefix sum, total to all
  { b.sum(v) } -> std::same_as<std::int32_t>;                      // result to all threads
  { b.min_key(k) } -> std::same_as<PlanKey>;                       // arg-min, result to all
  { b.min_score(ScoreKey{}) } -> std::same_as<ScoreKey>;           // arg-min, result to all
  b.publish(c64, std::uint64_t{});                                  // store to the stats mirror
  b.flags_or(c32, std::uint32_t{});                                 // sticky error word
  b.mark(c32);                                                      // racing stores of 1
  { b.rank_scratch() } -> std::same_as<RankScratch>;               // shared keys, or none
};

// The host block: one thread, barriers are no-ops. Also valid as a one-thread device block.
struct SequentialBlock {
  EXPERT_CACHE_HOST_DEVICE std::int32_t thread_rank() const noexcept { return 0; }
  EXPERT_CACHE_HOST_DEVICE std::int32_t size() const noexcept { return 1; }
  EXPERT_CACHE_HOST_DEVICE void sync() noexcept {}
  EXPERT_CACHE_HOST_DEVICE std::int32_t exclusive_sum(std::int32_t v, std::int32_t& total) noexcept {
    total = v;
    return 0;
  }
  EXPERT_CACHE_HOST_DEVICE std::int32_t sum(std::int32_t v) noexcept { return v; }
  EXPERT_CACHE_HOST_DEVICE PlanKey min_key(PlanKey k) noexcept { return k; }
  EXPERT_CACHE_HOST_DEVICE ScoreKey min_score(ScoreKey k) noexcept { return k; }
  EXPERT_CACHE_HOST_DEVICE void publish(std::uint64_t& w, std::uint64_t v) noexcept { w = v; }
  EXPERT_CACHE_HOST_DEVICE void flags_or(std::uint32_t& w, std::uint32_t v) noexcept { w |= v; }
  EXPERT_CACHE_HOST_DEVICE void mark(std::uint32_t& w) noexcept { w = 1; }
  EXPERT_CACHE_HOST_DEVICE RankScratch rank_scratch() noexcept { return {}; }
};
static_assert(plan_block<SequentialBlock>);

inline constexpr std::int32_t plan_padding_id = -1;
// Forwards of at most this many ids take the register-sort small path (a power of two).
inline constexpr std::int32_t plan_small_ids = 16;
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

namespace detail {
template <plan_block Block>
EXPERT_CACHE_HOST_DEVICE void plan_fail(Block& b, const DevicePlanState& s, std::uint32_t bit) noexcept {
  if (b.thread_rank() == 0 && s.error_word != nullptr) b.flags_or(*s.error_word, bit);
  b.sync();
}
EXPERT_CACHE_HOST_DEVICE constexpr std::int32_t min_i32(std::int32_t a, std::int32_t b) noexcept { return a < b ? a : b; }
}  // namespace detail

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

namespace detail {

// Stores the changed counters: the authoritative copy (device memory) and the mirror (mapped).
// Rank 0 only; `now` = `before` plus this step's increments.
template <plan_block Block>
EXPERT_CACHE_HOST_DEVICE void publish_stats(Block& b, const DevicePlanState& s, const DevicePlanStats& before,
                                            const DevicePlanStats& now) noexcept {
  if (now == before) return;
  *s.counters = now;
  if (now.hits != before.hits) b.publish(s.stats->hits, now.hits);
  if (now.misses != before.misses) b.publish(s.stats->misses, now.misses);
  if (now.evictions != before.evictions) b.publish(s.stats->evictions, now.evictions);
  if (now.overflows != before.overflows) b.publish(s.stats->overflows, now.overflows);
  if (now.overflow_groups != before.overflow_groups) b.publish(s.stats->overflow_groups, now.overflow_groups);
  if (now.bad_ids != before.bad_ids) b.publish(s.stats->bad_ids, now.bad_ids);
  if (now.forwards != before.forwards) b.publish(s.stats->forwards, now.forwards);
  if (now.invalidations != before.invalidations) b.publish(s.stats->invalidations, now.invalidations);
  if (now.prefetches != before.prefetches) b.publish(s.stats->prefetches, now.prefetches);
  if (now.speculative_issued != before.speculative_issued) b.publish(s.stats->speculative_issued, now.speculative_issued);
  if (now.speculative_used != before.speculative_used) b.publish(s.stats->speculative_used, now.speculative_used);
  if (now.speculative_wasted != before.speculative_wasted) b.publish(s.stats->speculative_wasted, now.speculative_wasted);
}

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

// The bits of a positive double, ordered like its value.
EXPERT_CACHE_HOST_DEVICE inline std::uint64_t double_bits(double x) noexcept {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint64_t>(__double_as_longlong(x));
#else
  return std::bit_cast<std::uint64_t>(x);
#endif
}

// Lfru's score freq / (clock - last + 1) as Lfru::victim_double divides it (IEEE, round to
// nearest on both sides; the explicit intrinsic keeps nvcc from approximating). Below clock 2^25
// Lfru compares by cross-multiplication instead, which orders exactly like these doubles
// (eviction/lfru.hpp says why), so one comparison serves both of its paths.
EXPERT_CACHE_HOST_DEVICE inline ScoreKey lfru_key_of(std::uint64_t freq, std::uint64_t order, std::int32_t slot,
                                                     std::uint64_t clock, std::uint64_t last) noexcept {
  const double f = static_cast<double>(freq);
  const double a = static_cast<double>(clock - last + 1);
#if defined(__CUDA_ARCH__)
  const double q = __ddiv_rn(f, a);
#else
  const double q = f / a;
#endif
  return ScoreKey{double_bits(q), order, slot};
}
EXPERT_CACHE_HOST_DEVICE inline ScoreKey lfru_key(const DevicePlanState& s, std::int32_t slot, std::uint64_t clock,
                                                  std::uint64_t last) noexcept {
  return lfru_key_of(s.slot_freq[slot], s.slot_order[slot], slot, clock, last);
}

// Crf's victim key of resident `owner` (in `slot`) at clock `clk`: CRF + prior bias, then id.
EXPERT_CACHE_HOST_DEVICE inline ScoreKey crf_key(const DevicePlanState& s, std::int32_t slot, std::int32_t owner,
                                                 std::uint32_t clk) noexcept {
  const std::uint64_t crf = crf_at_table(s.crf_pow.data, s.expert_crf[owner], s.expert_last[owner], clk);
  return ScoreKey{crf_add_sat(crf, s.expert_bias[owner]), static_cast<std::uint64_t>(owner), slot};
}

// Crf::touch: one request of expert e at clock clk.
EXPERT_CACHE_HOST_DEVICE inline void crf_touch(const DevicePlanState& s, std::int32_t e, std::uint32_t clk) noexcept {
  s.expert_crf[e] = crf_at_table(s.crf_pow.data, s.expert_crf[e], s.expert_last[e], clk) + crf_one;
  s.expert_last[e] = clk;
}

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

// Speculative fills for `n_ids` predicted ids (best first), with the decisions of
// ForwardPlanner<Lru>::plan_prefetch: at most `max_fills` fills (clamped to C); an id already
// resident is skipped (and protected for the rest of the list); a fill takes a free slot, else
// the least recently used resident that is neither in the last planned group (ticks >=
// protect_tick), nor an unused, unexpired speculative fill, nor an earlier id of this list; no
// such resident: the rest is skipped (counted in prefetch_skipped_no_victim). A fill is
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
                                            std::uint32_t expires_after) noexcept {
  if (!plan_state_ok(s)) return detail::plan_fail(b, s, plan_error_bad_state);
  if (n_ids < 0 || (ids == nullptr && n_ids > 0) || max_fills < 0 || expires_after == 0) {
    return detail::plan_fail(b, s, plan_error_bad_argument);
  }
  const std::int32_t rank = b.thread_rank(), nt = b.size();
  const std::int32_t E = s.num_experts, C = s.capacity;
  DevicePlanScalars& sc = *s.scalars;
  // Read once by every thread; only rank 0 writes the scalars, after the last barrier below.
  const std::uint64_t protect = sc.protect_tick;
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
    if (s.resident_map[e] >= 0) {
      ++skipped_resident;
      if (rank == 0) b.mark(s.marks[e]);  // protected for the rest of the list
      b.sync();
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

// Sets every expert's prior bias (DeviceCrf's frequency prior, eviction/crf_math.hpp's Q32; see
// eviction/crf.hpp) in a state the host can write (HostPlanStorage; DeviceExpertCache uploads the
// same table with set_prior_bias). A table of the wrong length, or none, is refused: false,
// nothing written.
inline bool plan_set_bias(const DevicePlanState& s, const std::uint64_t* bias, std::int32_t n) noexcept {
  if (!plan_view_ok(s) || bias == nullptr || n != s.num_experts) return false;
  for (std::int32_t e = 0; e < n; ++e) s.expert_bias[e] = bias[e];
  return true;
}

// Host memory for one state (the CPU suite; a SimRuntime model later): the block laid out by
// bind_plan_state, stats and error word, reset to an empty cache. Not for device code.
class HostPlanStorage {
 public:
  HostPlanStorage(std::int32_t num_experts, std::int32_t capacity, std::uint64_t crf_decay = crf_default_decay_q32)
      : block_((plan_state_bytes(num_experts, capacity) + sizeof(Chunk) - 1) / sizeof(Chunk)) {
    state_ = bind_plan_state(block_.data(), num_experts, capacity, &stats_, &error_word_);
    SequentialBlock b;
    reset_plan_state(b, state_, crf_decay);
  }
  HostPlanStorage(const HostPlanStorage&) = delete;  // the view points into this object
  HostPlanStorage& operator=(const HostPlanStorage&) = delete;

  [[nodiscard]] const DevicePlanState& state() const noexcept { return state_; }
  [[nodiscard]] void* block() noexcept { return block_.data(); }
  [[nodiscard]] std::size_t bytes() const noexcept { return block_.size() * sizeof(Chunk); }

 private:
  struct alignas(16) Chunk {
    std::byte b[16];
  };
  std::vector<Chunk> block_;
  DevicePlanStats stats_{};
  std::uint32_t error_word_ = 0;
  DevicePlanState state_{};
};

}  // namespace expert_cache::inline v0
