#pragma once
/// What the device plan needs from the group of threads that runs it: the plan_block concept, the host's one-thread
/// SequentialBlock, and the two ways a step reports through a block (an error bit, the published counters).
//
// The planning code is written once as __host__ __device__ code over these primitives, so the
// CPU suite runs with SequentialBlock (or several host threads, tests/host/
// test_device_plan_lanes.cpp) the very algorithm the CUDA kernels run with theirs
// (kernels/plan_block.cuh: CubBlock, one thread block; WarpBlock, one warp). Also here: the
// step code's compile hints for the GPU (unrolling, cold paths), which g++ ignores.
#include <concepts>
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/planning/device_plan/policies.hpp"
#include "expert_cache/planning/device_plan/state.hpp"

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

namespace detail {
template <plan_block Block>
EXPERT_CACHE_HOST_DEVICE void plan_fail(Block& b, const DevicePlanState& s, std::uint32_t bit) noexcept {
  if (b.thread_rank() == 0 && s.error_word != nullptr) b.flags_or(*s.error_word, bit);
  b.sync();
}
EXPERT_CACHE_HOST_DEVICE constexpr std::int32_t min_i32(std::int32_t a, std::int32_t b) noexcept { return a < b ? a : b; }
}  // namespace detail

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

}  // namespace detail

}  // namespace expert_cache::inline v0
