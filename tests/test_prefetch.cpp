// Speculative fills (issue 16, lookahead API): the planner's plan_prefetch rules for several
// eviction policies, then the host-planned cache's prefetch() on SimRuntime (ordering edge 9,
// its negative test, randomized schedules, stats and bad input).
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "expert_cache/eviction/all.hpp"
#include "expert_cache/planner.hpp"

using namespace expert_cache;
using Ids = std::vector<std::int32_t>;

namespace {

template <class Policy>
ForwardPlanner<Policy> make_planner(CacheShape shape, std::int32_t top_k = 1) {
  return ForwardPlanner<Policy>(shape, top_k);
}

bool evicted_any_of(const PrefetchPlan& plan, const Ids& ids) {
  for (const SlotEviction& v : plan.evictions) {
    if (std::find(ids.begin(), ids.end(), v.expert.value) != ids.end()) return true;
  }
  return false;
}

template <class Planner>
void check_maps_consistent(const Planner& p) {
  const auto resident = p.resident_map();
  const auto owner = p.slot_owner();
  std::int32_t count = 0;
  for (std::int32_t e = 0; e < p.shape().num_experts; ++e) {
    const std::int32_t s = resident[static_cast<std::size_t>(e)];
    if (s == absent_slot) {
      CHECK_FALSE(p.is_speculative(e));  // a speculative expert is resident
      continue;
    }
    ++count;
    REQUIRE(s >= 0);
    REQUIRE(s < p.shape().capacity);
    CHECK(owner[static_cast<std::size_t>(s)] == e);
  }
  CHECK(count == p.resident_count());
  const PlannerCounters& c = p.counters();
  CHECK(c.speculative_issued == c.speculative_used + c.speculative_wasted +
                                    static_cast<std::uint64_t>(p.speculative_count()));
}

}  // namespace

#define PREFETCH_POLICIES Lru, Lfru, S3Fifo, LayerShare

TEST_CASE_TEMPLATE("plan_prefetch never evicts an expert of the most recent forward", Policy, PREFETCH_POLICIES) {
  auto p = make_planner<Policy>(CacheShape{10, 4});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{0, 1, 2, 3}, fwd).ok());
  // Every slot holds the most recent forward: nothing may go.
  const auto before = p.snapshot();
  REQUIRE(p.plan_prefetch(Ids{4, 5}, 2, 1, pre).ok());
  CHECK(pre.fills.empty());
  CHECK(pre.evictions.empty());
  CHECK(pre.skipped_no_victim == 2);
  CHECK(p.snapshot() == before);  // nothing changed, not even the generation

  REQUIRE(p.plan_unique(Ids{0, 1}, fwd).ok());
  REQUIRE(p.plan_prefetch(Ids{4, 5, 6, 4}, 3, 1, pre).ok());
  CHECK(pre.fills.size() == 2);  // 2 and 3 may go; then {0, 1, 4, 5} are all protected
  CHECK(pre.evictions.size() == 2);
  CHECK_FALSE(evicted_any_of(pre, Ids{0, 1}));
  CHECK(pre.skipped_no_victim == 1);  // 6; the repeated 4 after it is resident, not counted
  CHECK(pre.skipped_resident == 0);   // the loop stopped at 6, before the repeated 4
  CHECK(p.is_resident(0));
  CHECK(p.is_resident(1));
  CHECK(p.is_speculative(4));
  CHECK(p.is_speculative(5));
  CHECK_FALSE(p.is_resident(6));
  // The forward map is untouched: it still holds exactly the last forward.
  CHECK(p.forward_map()[0] != absent_slot);
  CHECK(p.forward_map()[1] != absent_slot);
  CHECK(p.forward_map()[4] == absent_slot);
  CHECK(p.forward_map()[5] == absent_slot);
  check_maps_consistent(p);
}

// LayerShare (and Lrfu) choose among heap tops only: a protected top blocks its layer, so they may
// skip a prediction although another resident could go (never an error, never a protected
// victim: the random test below covers them).
TEST_CASE_TEMPLATE("plan_prefetch never evicts an unused, unexpired speculative fill", Policy, Lru, Lfru, S3Fifo) {
  auto p = make_planner<Policy>(CacheShape{10, 4});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{0, 1, 2, 3}, fwd).ok());
  REQUIRE(p.plan_unique(Ids{0}, fwd).ok());
  REQUIRE(p.plan_prefetch(Ids{4}, 1, 3, pre).ok());  // lives 3 forwards
  REQUIRE(pre.fills.size() == 1);
  CHECK(pre.fills[0].expert == ExpertId(4));
  CHECK_FALSE(evicted_any_of(pre, Ids{0}));
  REQUIRE(p.plan_unique(Ids{0}, fwd).ok());  // 4 unused: 2 forwards left
  CHECK(p.is_speculative(4));
  for (int round = 0; round < 2; ++round) {
    REQUIRE(p.plan_prefetch(Ids{5 + 2 * round, 6 + 2 * round, 9}, 3, 3, pre).ok());
    CHECK_FALSE(evicted_any_of(pre, Ids{0, 4}));
    CHECK(p.is_speculative(4));
    check_maps_consistent(p);
  }
  // The second round found every slot protected: 0 (forward), 4, 5, 6 (speculative).
  CHECK(pre.fills.empty());
  CHECK(pre.skipped_no_victim == 3);  // 7, 8, 9
  CHECK(p.counters().speculative_wasted == 0);
}

TEST_CASE_TEMPLATE("plan_prefetch skips resident and repeated ids and respects max_fills", Policy, PREFETCH_POLICIES) {
  auto p = make_planner<Policy>(CacheShape{12, 6});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{0, 1}, fwd).ok());
  REQUIRE(p.plan_prefetch(Ids{0, 4, 4, 1, 0}, 5, 1, pre).ok());
  REQUIRE(pre.fills.size() == 1);
  CHECK(pre.fills[0].expert == ExpertId(4));
  CHECK(pre.skipped_resident == 4);  // 0, the repeated 4 (in flight), 1, 0
  CHECK(pre.skipped_no_victim == 0);
  CHECK(p.counters().speculative_issued == 1);

  REQUIRE(p.plan_prefetch(Ids{7, 8, 9, 10}, 2, 1, pre).ok());
  CHECK(pre.fills.size() == 2);
  CHECK(pre.fills[0].expert == ExpertId(7));  // priority order
  CHECK(pre.fills[1].expert == ExpertId(8));
  CHECK_FALSE(p.is_resident(9));
  CHECK(pre.skipped_no_victim == 0);  // a budget stop is not a missing victim

  const auto before = p.snapshot();
  REQUIRE(p.plan_prefetch(Ids{9, 10}, 0, 1, pre).ok());  // no budget: nothing
  CHECK(pre.fills.empty());
  CHECK(p.snapshot() == before);
  REQUIRE(p.plan_prefetch(Ids{}, 4, 1, pre).ok());
  CHECK(p.snapshot() == before);
  CHECK(p.counters().speculative_issued == 3);
  check_maps_consistent(p);
}

TEST_CASE_TEMPLATE("plan_prefetch rejects bad input before any state change", Policy, PREFETCH_POLICIES) {
  auto p = make_planner<Policy>(CacheShape{8, 4});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{0, 1, 2}, fwd).ok());
  REQUIRE(p.plan_prefetch(Ids{5}, 1, 2, pre).ok());
  const auto before = p.snapshot();
  const Ids forward_before(p.forward_map().begin(), p.forward_map().end());

  Status s = p.plan_prefetch(Ids{6, 8}, 4, 1, pre);  // 6 valid first: still nothing happens
  CHECK(s.code() == ErrorCode::expert_out_of_range);
  CHECK(s.message().find("8") != std::string_view::npos);
  CHECK(p.plan_prefetch(Ids{6, -1}, 4, 1, pre).code() == ErrorCode::expert_out_of_range);
  CHECK(p.plan_prefetch(Ids(9, 6), 4, 1, pre).code() == ErrorCode::too_many_experts);
  CHECK(p.plan_prefetch(Ids{6}, -1, 1, pre).code() == ErrorCode::invalid_argument);
  CHECK(p.plan_prefetch(Ids{6}, 1, 0, pre).code() == ErrorCode::invalid_argument);
  CHECK(p.snapshot() == before);
  CHECK(Ids(p.forward_map().begin(), p.forward_map().end()) == forward_before);
  CHECK(p.is_speculative(5));
}

TEST_CASE_TEMPLATE("speculative fills: expiry counts wasted, a using forward counts hit and used, invalidate wasted",
                   Policy, PREFETCH_POLICIES) {
  auto p = make_planner<Policy>(CacheShape{10, 5});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{0, 1}, fwd).ok());

  SUBCASE("expires_after = 1: the next forward not using it expires it") {
    REQUIRE(p.plan_prefetch(Ids{4}, 1, 1, pre).ok());
    REQUIRE(p.plan_unique(Ids{0}, fwd).ok());
    CHECK_FALSE(p.is_speculative(4));
    CHECK(p.is_resident(4));  // expired, still resident, now evictable
    CHECK(p.counters().speculative_wasted == 1);
    CHECK(p.counters().speculative_used == 0);
    // A later forward using it is an ordinary hit, not a use.
    REQUIRE(p.plan_unique(Ids{4}, fwd).ok());
    CHECK(fwd.hits == 1);
    CHECK(p.counters().speculative_used == 0);
  }
  SUBCASE("expires_after = 3: wasted after the third forward without it") {
    REQUIRE(p.plan_prefetch(Ids{4}, 1, 3, pre).ok());
    for (int i = 0; i < 2; ++i) {
      REQUIRE(p.plan_unique(Ids{0}, fwd).ok());
      CHECK(p.is_speculative(4));
    }
    REQUIRE(p.plan_unique(Ids{1}, fwd).ok());
    CHECK_FALSE(p.is_speculative(4));
    CHECK(p.counters().speculative_wasted == 1);
  }
  SUBCASE("a forward using it counts a hit and the fill used") {
    REQUIRE(p.plan_prefetch(Ids{4, 6}, 2, 2, pre).ok());
    const auto hits = p.counters().hits;
    const auto misses = p.counters().misses;
    REQUIRE(p.plan_topk(Ids{4, 0, 4}, fwd).ok());
    CHECK(fwd.hits == 2);
    CHECK(fwd.misses == 0);
    CHECK(p.counters().hits == hits + 2);
    CHECK(p.counters().misses == misses);
    CHECK(p.counters().speculative_used == 1);
    CHECK_FALSE(p.is_speculative(4));
    CHECK(p.is_speculative(6));  // one forward left
    REQUIRE(p.plan_unique(Ids{0}, fwd).ok());
    CHECK(p.counters().speculative_used == 1);
    CHECK(p.counters().speculative_wasted == 1);  // 6
  }
  SUBCASE("invalidate of a speculative expert counts it wasted") {
    REQUIRE(p.plan_prefetch(Ids{4}, 1, 1, pre).ok());
    REQUIRE(p.invalidate(4).ok());
    CHECK_FALSE(p.is_resident(4));
    CHECK_FALSE(p.is_speculative(4));
    CHECK(p.counters().speculative_wasted == 1);
    REQUIRE(p.plan_unique(Ids{0}, fwd).ok());
    CHECK(p.counters().speculative_wasted == 1);  // not counted twice
  }
  SUBCASE("a forward evicting an unused fill counts it wasted") {
    REQUIRE(p.plan_prefetch(Ids{4, 5, 6}, 3, 2, pre).ok());  // every slot taken: 0 1 4 5 6
    REQUIRE(p.plan_unique(Ids{2, 3, 7, 8, 9}, fwd).ok());      // needs all five slots
    CHECK(p.counters().speculative_wasted == 3);
    CHECK(p.speculative_count() == 0);
  }
  check_maps_consistent(p);
}

TEST_CASE_TEMPLATE("plan_prefetch over random forwards, prefetches and invalidates keeps its rules", Policy,
                   PREFETCH_POLICIES) {
  constexpr std::int32_t experts = 24, capacity = 8;
  auto p = make_planner<Policy>(CacheShape{experts, capacity});
  std::mt19937_64 rng(7);
  ForwardPlan fwd;
  PrefetchPlan pre;
  Ids last_forward;
  std::uint64_t fills = 0;
  for (int step = 0; step < 3000; ++step) {
    const auto op = rng() % 10;
    if (op < 5) {
      Ids ids;
      const auto n = 1 + rng() % 4;
      for (std::uint64_t i = 0; i < n; ++i) ids.push_back(static_cast<std::int32_t>(rng() % experts));
      REQUIRE(p.plan_topk(ids, fwd).ok());
      last_forward.clear();
      for (ExpertId e : fwd.unique) last_forward.push_back(e.value);
    } else if (op < 9) {
      Ids ids;
      const auto n = rng() % 6;
      for (std::uint64_t i = 0; i < n; ++i) ids.push_back(static_cast<std::int32_t>(rng() % experts));
      Ids live;
      for (std::int32_t e = 0; e < experts; ++e) {
        if (p.is_speculative(e)) live.push_back(e);
      }
      const auto max_fills = static_cast<std::int32_t>(rng() % 4);
      REQUIRE(p.plan_prefetch(ids, max_fills, 1 + static_cast<std::uint32_t>(rng() % 3), pre).ok());
      CHECK(static_cast<std::int32_t>(pre.fills.size()) <= max_fills);
      CHECK_FALSE(evicted_any_of(pre, last_forward));
      CHECK_FALSE(evicted_any_of(pre, live));
      for (const SlotFill& f : pre.fills) CHECK(p.is_speculative(f.expert.value));
      fills += pre.fills.size();
    } else {
      const auto e = static_cast<std::int32_t>(rng() % experts);
      REQUIRE(p.invalidate(e).ok());
      last_forward.erase(std::remove(last_forward.begin(), last_forward.end(), e), last_forward.end());
    }
    check_maps_consistent(p);
  }
  CHECK(p.counters().speculative_issued == fills);
  CHECK(fills > 100);
  CHECK(p.counters().speculative_used > 0);
  CHECK(p.counters().speculative_wasted > 0);
}
