// The device planner (planning/device_plan.hpp) run by a block of several host threads
// (LaneBlock: std::thread lanes, std::barrier collectives), against the same planner run by
// SequentialBlock, for every device policy: after every forward, group, invalidation and
// prefetch the whole state block is byte-identical. SequentialBlock (one thread) is what the
// parity suites (test_device_plan.cpp, test_device_policies.cpp) compare with the host
// planners; this suite covers what only several threads do: strided slots, a group's misses
// spread over threads and kept in their registers, the victim keys held in registers (capacity
// <= plan_victim_regs * threads, the GPU's warp at the decode shape) or reloaded per victim
// (larger capacity), and groups larger than the block (misses of later rounds from the lists).
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
  explicit LaneShared(std::int32_t n) : bar(n), v(static_cast<std::size_t>(n)), k(v.size()), sk(v.size()) {}
  std::barrier<> bar;
  std::vector<std::int32_t> v;
  std::vector<PlanKey> k;
  std::vector<ScoreKey> sk;
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
void on_lanes(std::int32_t lanes, F&& f) {
  LaneShared sh(lanes);
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
};

template <class Policy>
void run_pair(const Shape& c, std::uint64_t seed, std::uint64_t& evictions, std::uint64_t& in_regs_evicting,
              std::uint64_t& multi_round) {
  CAPTURE(c.lanes);
  CAPTURE(c.E);
  CAPTURE(c.C);
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
    on_lanes(c.lanes, [&](LaneBlock& b) { plan_forward<Policy>(b, par.state(), ids.data(), n); });
    const std::int32_t groups = seq.state().scalars->group_count;
    for (std::int32_t g = 1; g < groups; ++g) {
      plan_group<Policy>(one, seq.state(), g);
      on_lanes(c.lanes, [&](LaneBlock& b) { plan_group<Policy>(b, par.state(), g); });
    }
    const DevicePlanScalars& k = *seq.state().scalars;
    if (k.eviction_count > 0 && c.C <= plan_victim_regs * c.lanes) ++in_regs_evicting;
    if (k.group_size > c.lanes && k.misses > 0) ++multi_round;
    if (rng() % 16 == 0) {
      const auto e = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E));
      plan_invalidate(one, seq.state(), e);
      on_lanes(c.lanes, [&](LaneBlock& b) { plan_invalidate(b, par.state(), e); });
    }
    if (rng() % 8 == 0) {
      const Ids predicted = {static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E)),
                             static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E))};
      plan_prefetch<Policy>(one, seq.state(), predicted.data(), 2, 2, 2);
      on_lanes(c.lanes, [&](LaneBlock& b) { plan_prefetch<Policy>(b, par.state(), predicted.data(), 2, 2, 2); });
    }
    REQUIRE(std::memcmp(seq.block(), par.block(), seq.bytes()) == 0);  // every array, scalar and counter
    REQUIRE(*seq.state().stats == *par.state().stats);
    REQUIRE(*seq.state().error_word == *par.state().error_word);
    REQUIRE((*par.state().error_word & plan_error_bad_state) == 0u);
  }
  evictions += seq.state().stats->evictions;
}

template <class Policy>
void run_shapes() {
  // lanes x plan_victim_regs >= C: victim keys in registers; below: reloaded per victim.
  // top_k * tokens > lanes: groups with more than one round of misses.
  const Shape shapes[] = {
      {4, 64, 16, 4, 1, 120},    // in registers, one round (the decode shape in small)
      {4, 48, 12, 6, 3, 120},    // in registers, several rounds, overflow groups
      {4, 96, 40, 4, 2, 120},    // reloaded (40 > 32), several rounds
      {32, 512, 208, 10, 1, 60}, // the GPU's warp at the decode defaults: 208 <= 256 in registers
  };
  std::uint64_t seed = 11, evictions = 0, in_regs = 0, multi = 0;
  for (const Shape& c : shapes) run_pair<Policy>(c, seed++, evictions, in_regs, multi);
  // The traces reach the paths they are for.
  CHECK(evictions > 500);
  CHECK(in_regs > 100);
  CHECK(multi > 50);
}

}  // namespace

TEST_CASE("device plan on several threads equals the sequential plan: DeviceLru") { run_shapes<DeviceLru>(); }
TEST_CASE("device plan on several threads equals the sequential plan: DeviceLfru") { run_shapes<DeviceLfru>(); }
TEST_CASE("device plan on several threads equals the sequential plan: DeviceCrf") { run_shapes<DeviceCrf>(); }
