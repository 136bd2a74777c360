// The device planner (planning/device_plan.hpp) run by a block of several host threads
// (LaneBlock: std::thread lanes, std::barrier collectives), against the same planner run by
// SequentialBlock, for every device policy: after every forward, group, invalidation and
// prefetch the whole state block is byte-identical. SequentialBlock (one thread) is what the
// parity suites (test_device_plan.cpp, test_device_policies.cpp) compare with the host
// planners; this suite covers what only several threads do: strided slots, a group's misses
// spread over threads and kept in their registers, the victim keys held in registers (capacity
// <= plan_victim_regs * threads, the GPU's warp at the decode shape) or reloaded per victim
// (larger capacity), groups larger than the block (misses of later rounds from the lists), and
// victims taken by rank through a block-shared scratch (as the GPU's block does) against the
// sequential block's one arg-min per victim.
#include <doctest/doctest.h>

#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "expert_cache/planning/device_plan.hpp"

using namespace expert_cache;
using Ids = std::vector<std::int32_t>;

namespace {

struct LaneShared {
  LaneShared(std::int32_t n, std::int32_t scratch)
      : bar(n), v(static_cast<std::size_t>(n)), k(v.size()), sk(v.size()), rank_primary(static_cast<std::size_t>(scratch)),
        rank_secondary(rank_primary.size()) {}
  std::barrier<> bar;
  std::vector<std::int32_t> v;
  std::vector<PlanKey> k;
  std::vector<ScoreKey> sk;
  std::vector<std::uint64_t> rank_primary;  // empty: no scratch (arg-min victims)
  std::vector<std::uint32_t> rank_secondary;
};

// One lane of a block of sh.v.size() threads. Every collective: each lane posts its value,
// barrier, each lane reads all, barrier (nobody posts the next value before all have read).
class LaneBlock {
 public:
  LaneBlock(LaneShared& sh, std::int32_t rank) : sh_(sh), rank_(rank) {}
  std::int32_t thread_rank() const noexcept { return rank_; }
  std::int32_t size() const noexcept { return static_cast<std::int32_t>(sh_.v.size()); }
  void sync() noexcept { sh_.bar.arrive_and_wait(); }
  std::int32_t exclusive_sum(std::int32_t v, std::int32_t& total) noexcept {
    post(sh_.v, v);
    std::int32_t before = 0;
    total = 0;
    for (std::int32_t r = 0; r < size(); ++r) {
      if (r < rank_) before += sh_.v[static_cast<std::size_t>(r)];
      total += sh_.v[static_cast<std::size_t>(r)];
    }
    sync();
    return before;
  }
  std::int32_t sum(std::int32_t v) noexcept {
    std::int32_t total = 0;
    (void)exclusive_sum(v, total);
    return total;
  }
  PlanKey min_key(PlanKey k) noexcept {
    post(sh_.k, k);
    PlanKey best = sh_.k[0];
    for (const PlanKey& x : sh_.k) best = x < best ? x : best;
    sync();
    return best;
  }
  ScoreKey min_score(ScoreKey k) noexcept {
    post(sh_.sk, k);
    ScoreKey best = sh_.sk[0];
    for (const ScoreKey& x : sh_.sk) best = x < best ? x : best;
    sync();
    return best;
  }
  void publish(std::uint64_t& w, std::uint64_t v) noexcept { w = v; }
  void flags_or(std::uint32_t& w, std::uint32_t v) noexcept { w |= v; }
  void mark(std::uint32_t& w) noexcept { std::atomic_ref<std::uint32_t>(w).store(1u, std::memory_order_relaxed); }
  RankScratch rank_scratch() noexcept {
    if (sh_.rank_primary.empty()) return {};
    return {sh_.rank_primary.data(), sh_.rank_secondary.data(), static_cast<std::int32_t>(sh_.rank_primary.size())};
  }

 private:
  template <class T>
  void post(std::vector<T>& slots, const T& v) {
    slots[static_cast<std::size_t>(rank_)] = v;
    sync();
  }
  LaneShared& sh_;
  std::int32_t rank_;
};
static_assert(plan_block<LaneBlock>);

// Runs f(block) on `lanes` threads, all of them calling the same planning function.
template <class F>
void on_lanes(std::int32_t lanes, std::int32_t scratch, F&& f) {
  LaneShared sh(lanes, scratch);
  std::vector<std::thread> threads;
  for (std::int32_t r = 0; r < lanes; ++r) {
    threads.emplace_back([&sh, &f, r] {
      LaneBlock b(sh, r);
      f(b);
    });
  }
  for (auto& t : threads) t.join();
}

struct Shape {
  std::int32_t lanes, E, C, top_k, max_tokens, steps;
  std::int32_t scratch;  // slots of the lanes' rank scratch (0: none)
};

struct PathCounts {
  std::uint64_t evictions = 0, in_regs_evicting = 0, multi_round = 0, by_rank = 0;
};

template <class Policy>
void run_pair(const Shape& c, std::uint64_t seed, PathCounts& counts) {
  CAPTURE(c.lanes);
  CAPTURE(c.E);
  CAPTURE(c.C);
  CAPTURE(c.scratch);
  CAPTURE(Policy::name);
  HostPlanStorage seq(c.E, c.C), par(c.E, c.C);
  SequentialBlock one;
  reset_plan_state<Policy>(one, seq.state());
  reset_plan_state<Policy>(one, par.state());
  std::mt19937_64 rng(seed);
  const std::int32_t hot = c.top_k / 2 > 0 ? c.top_k / 2 : 1;
  std::int32_t cold = 0;
  for (std::int32_t step = 0; step < c.steps; ++step) {
    CAPTURE(step);
    // A few hot experts (hits) and cold ones cycling through the rest (misses, evictions once
    // the slots are full), some padding, duplicates and a bad id now and then.
    const auto tokens = static_cast<std::int32_t>(1 + rng() % static_cast<std::uint64_t>(c.max_tokens));
    Ids ids;
    for (std::int32_t t = 0; t < tokens; ++t) {
      for (std::int32_t j = 0; j < c.top_k; ++j) {
        std::int32_t id;
        if (j < hot) id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(2 * hot));
        else id = (cold++ % (c.E - 2 * hot)) + 2 * hot;
        const std::uint64_t r = rng() % 100;
        if (r < 3) id = -1;
        else if (r == 3) id = c.E;
        ids.push_back(id);
      }
    }
    if (ids.size() > 1 && rng() % 5 == 0) ids[1] = ids[0];
    const auto n = static_cast<std::int32_t>(ids.size());
    plan_forward<Policy>(one, seq.state(), ids.data(), n);
    on_lanes(c.lanes, c.scratch, [&](LaneBlock& b) { plan_forward<Policy>(b, par.state(), ids.data(), n); });
    const std::int32_t groups = seq.state().scalars->group_count;
    for (std::int32_t g = 1; g < groups; ++g) {
      plan_group<Policy>(one, seq.state(), g);
      on_lanes(c.lanes, c.scratch, [&](LaneBlock& b) { plan_group<Policy>(b, par.state(), g); });
    }
    const DevicePlanScalars& k = *seq.state().scalars;
    if (k.eviction_count > 0 && c.C <= plan_victim_regs * c.lanes) ++counts.in_regs_evicting;
    if (k.group_size > c.lanes && k.misses > 0) ++counts.multi_round;
    if (Policy::kind != DevicePolicyKind::lfru && c.C <= c.scratch &&
        plan_by_rank(Policy::kind == DevicePolicyKind::lru, static_cast<std::int32_t>(k.eviction_count), c.C, c.lanes)) {
      ++counts.by_rank;
    }
    if (rng() % 16 == 0) {
      const auto e = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E));
      plan_invalidate(one, seq.state(), e);
      on_lanes(c.lanes, c.scratch, [&](LaneBlock& b) { plan_invalidate(b, par.state(), e); });
    }
    if (rng() % 8 == 0) {
      const Ids predicted = {static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E)),
                             static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E))};
      plan_prefetch<Policy>(one, seq.state(), predicted.data(), 2, 2, 2);
      on_lanes(c.lanes, c.scratch, [&](LaneBlock& b) { plan_prefetch<Policy>(b, par.state(), predicted.data(), 2, 2, 2); });
    }
    REQUIRE(std::memcmp(seq.block(), par.block(), seq.bytes()) == 0);  // every array, scalar and counter
    REQUIRE(*seq.state().stats == *par.state().stats);
    REQUIRE(*seq.state().error_word == *par.state().error_word);
    REQUIRE((*par.state().error_word & plan_error_bad_state) == 0u);
  }
  counts.evictions += seq.state().stats->evictions;
}

template <class Policy>
void run_shapes() {
  // lanes x plan_victim_regs >= C: victim keys in registers; below: reloaded per victim.
  // top_k * tokens > lanes: groups with more than one round of misses.
  // A scratch of at least C slots: victims by rank when plan_by_rank says so (enough of them).
  const Shape shapes[] = {
      {4, 64, 16, 4, 1, 120, 0},       // in registers, one round (the decode shape in small)
      {4, 48, 12, 6, 3, 120, 0},       // in registers, several rounds, overflow groups
      {4, 96, 40, 4, 2, 120, 0},       // reloaded (40 > 32), several rounds
      {32, 512, 208, 10, 1, 60, 0},    // the GPU's warp at the decode defaults: 208 <= 256 in registers
      {4, 48, 12, 6, 3, 120, 16},      // by rank, keys in registers, overflow groups
      {16, 96, 40, 4, 3, 120, 64},     // by rank, keys in registers, several rounds
      {4, 96, 40, 4, 4, 120, 64},      // by rank, keys reloaded
      {8, 96, 40, 4, 2, 120, 32},      // scratch smaller than C: arg-min
      {128, 512, 208, 10, 4, 30, 512}  // the decode defaults, batched, 2 slots per thread (as the GPU's block)
  };
  std::uint64_t seed = 11;
  PathCounts counts;
  for (const Shape& c : shapes) run_pair<Policy>(c, seed++, counts);
  // The traces reach the paths they are for.
  CHECK(counts.evictions > 500);
  CHECK(counts.in_regs_evicting > 100);
  CHECK(counts.multi_round > 50);
  if (Policy::kind != DevicePolicyKind::lfru) CHECK(counts.by_rank > 100);
}

// A corrupted state (fewer candidates than victims) fails with plan_error_bad_state after
// recording the same victims whether they are taken by rank or by arg-min (the same lanes, with
// and without a scratch), and leaves the same bytes.
template <class Policy>
void corrupted_state_fails_alike() {
  const std::int32_t E = 96, C = 40, lanes = 8;
  HostPlanStorage by_min(E, C), by_rank(E, C);
  SequentialBlock one;
  reset_plan_state<Policy>(one, by_min.state());
  reset_plan_state<Policy>(one, by_rank.state());
  auto plan_both = [&](const Ids& ids) {
    const auto n = static_cast<std::int32_t>(ids.size());
    on_lanes(lanes, 0, [&](LaneBlock& b) { plan_forward<Policy>(b, by_min.state(), ids.data(), n); });
    on_lanes(lanes, C, [&](LaneBlock& b) { plan_forward<Policy>(b, by_rank.state(), ids.data(), n); });
  };
  Ids fill(static_cast<std::size_t>(C));
  for (std::int32_t i = 0; i < C; ++i) fill[static_cast<std::size_t>(i)] = i;
  plan_both(fill);
  REQUIRE(by_min.state().scalars->eviction_count == 0);
  // Every slot but three leaves the candidates: LRU by a tick no older than the next group's,
  // the score policies by an owner outside [0, E).
  for (HostPlanStorage* h : {&by_min, &by_rank}) {
    const DevicePlanState s = h->state();
    for (std::int32_t slot = 3; slot < C; ++slot) {
      if (Policy::kind == DevicePolicyKind::lru) s.slot_tick[slot] = ~std::uint64_t{0} - static_cast<std::uint64_t>(slot);
      else s.slot_owner[slot] = E;
    }
  }
  Ids misses;
  for (std::int32_t i = C; i < C + 8; ++i) misses.push_back(i);  // 8 victims, 3 candidates
  plan_both(misses);
  CHECK((*by_min.state().error_word & plan_error_bad_state) != 0u);
  CHECK((*by_rank.state().error_word & plan_error_bad_state) != 0u);
  CHECK(std::memcmp(by_min.block(), by_rank.block(), by_min.bytes()) == 0);
  for (std::int32_t j = 0; j < 3; ++j) {  // the three candidates were recorded, in the same order
    CHECK(by_rank.state().evictions[j].slot == by_min.state().evictions[j].slot);
    CHECK(by_rank.state().evictions[j].slot < 3);
  }
}

}  // namespace

TEST_CASE("device plan on several threads equals the sequential plan: DeviceLru") { run_shapes<DeviceLru>(); }
TEST_CASE("device plan on several threads equals the sequential plan: DeviceLfru") { run_shapes<DeviceLfru>(); }
TEST_CASE("device plan on several threads equals the sequential plan: DeviceCrf") { run_shapes<DeviceCrf>(); }
TEST_CASE("a corrupted state fails alike by rank and by arg-min: DeviceLru") { corrupted_state_fails_alike<DeviceLru>(); }
TEST_CASE("a corrupted state fails alike by rank and by arg-min: DeviceCrf") { corrupted_state_fails_alike<DeviceCrf>(); }

TEST_CASE("plan_by_rank: ranks only where a pass over the keys costs less than the arg-mins") {
  // The GPU's planning block: 256 threads, the decode default of 208 slots (one slot per thread).
  CHECK(!plan_by_rank(true, 2, 208, 256));
  CHECK(plan_by_rank(true, 3, 208, 256));    // LRU from 3 victims
  CHECK(!plan_by_rank(false, 5, 208, 256));
  CHECK(plan_by_rank(false, 6, 208, 256));   // DeviceCrf from 6
  CHECK(!plan_by_rank(true, 1, 1, 256));     // one victim: never (an arg-min is one pass already)
  // Two slots per thread double the pass: 512 slots need 2 * 512 / 80 = 12.8, so 13 LRU victims.
  CHECK(!plan_by_rank(true, 12, 512, 256));
  CHECK(plan_by_rank(true, 13, 512, 256));
}
