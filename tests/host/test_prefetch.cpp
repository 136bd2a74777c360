// Speculative fills (lookahead API): the planner's plan_prefetch rules for several
// eviction policies, then the host-planned cache's prefetch() on SimRuntime (ordering edge 9,
// its negative test, randomized schedules, stats and bad input).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <type_traits>
#include <vector>

#include "expert_cache/any/any_cache.hpp"
#include "expert_cache/eviction/all.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "support/removed_edges.hpp"
#include "support/sim_cache_harness.hpp"
#include "support/stats_checks.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;
using Stream = SimRuntime::Stream;

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

TEST_CASE_TEMPLATE("plan_prefetch with evict_last_forward: the last forward's residents are victims, but not the ones the list names",
                   Policy, Lru, Lfru, S3Fifo) {
  auto p = make_planner<Policy>(CacheShape{10, 4});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{0, 1, 2, 3}, fwd).ok());
  // A cache of top_k slots: without the promise nothing may go.
  REQUIRE(p.plan_prefetch(Ids{4, 1, 5}, 3, 1, pre).ok());
  CHECK(pre.fills.empty());
  CHECK(pre.skipped_no_victim == 2);
  // With it, 4 and 5 take slots of 0, 2 or 3; 1 is named, so it stays.
  REQUIRE(p.plan_prefetch(Ids{4, 1, 5}, 3, 1, pre, true).ok());
  CHECK(pre.fills.size() == 2);
  CHECK(pre.evictions.size() == 2);
  CHECK_FALSE(evicted_any_of(pre, Ids{1}));
  CHECK(pre.skipped_resident == 1);
  CHECK(p.is_speculative(4));
  CHECK(p.is_speculative(5));
  CHECK(p.is_resident(1));
  // The forward map is untouched (stale for the evicted: the caller promised no reader is left).
  CHECK(p.forward_map()[1] != absent_slot);
  check_maps_consistent(p);
  // The fills are protected like any speculative fill, and 1 is named again: the one resident left
  // of the forward besides 1 is the only victim.
  REQUIRE(p.plan_prefetch(Ids{6, 1, 7}, 3, 1, pre, true).ok());
  CHECK(pre.fills.size() == 1);
  CHECK_FALSE(evicted_any_of(pre, Ids{1, 4, 5}));
  CHECK(pre.skipped_resident == 1);
  CHECK(pre.skipped_no_victim == 1);
  // The next forward uses what was prefetched.
  REQUIRE(p.plan_unique(Ids{4, 5, 1, 6}, fwd).ok());
  CHECK(fwd.hits == 4);
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

TEST_CASE_TEMPLATE("plan_prefetch never evicts a resident the list names, wherever it is listed", Policy,
                   PREFETCH_POLICIES) {
  // Two slots: 0 and 1 resident, 1 the most recent forward's. A list that names 0 after a missing
  // 3 keeps 0: no victim is left for 3. Without 0 in the list, 3 takes 0's slot.
  auto p = make_planner<Policy>(CacheShape{6, 2});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{0}, fwd).ok());
  REQUIRE(p.plan_unique(Ids{1}, fwd).ok());
  REQUIRE(p.plan_prefetch(Ids{3, 0}, 1, 1, pre).ok());
  CHECK(pre.fills.empty());
  CHECK(pre.evictions.empty());
  CHECK(pre.skipped_no_victim == 1);
  CHECK(p.is_resident(0));
  CHECK_FALSE(p.is_resident(3));
  REQUIRE(p.plan_prefetch(Ids{3}, 1, 1, pre).ok());
  REQUIRE(pre.fills.size() == 1);
  CHECK(pre.fills[0].expert == ExpertId(3));
  REQUIRE(pre.evictions.size() == 1);
  CHECK(pre.evictions[0].expert == ExpertId(0));
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
      CHECK_FALSE(evicted_any_of(pre, ids));  // a listed resident, wherever it is listed
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

// ---- the cache: ExpertCache::prefetch on SimRuntime ------------------------------------------

namespace {

// The shared fixture, plus a reader of the current forward after a prefetch and byte budgets.
template <class Cache>
struct Fixture : SimCacheFixture<Cache> {
  using SimCacheFixture<Cache>::SimCacheFixture;
  using SimCacheFixture<Cache>::rt;
  using SimCacheFixture<Cache>::cache;
  using SimCacheFixture<Cache>::log;
  using SimCacheFixture<Cache>::launched;
  using SimCacheFixture<Cache>::last_view;
  using SimCacheFixture<Cache>::last_unique;

  // The current forward's kernels after a prefetch: they read the forward map and their slots,
  // not the resident map (which prefetch rewrites).
  Status forward_map_reader(Stream s) {
    std::vector<Access> accesses;
    const auto n = static_cast<std::size_t>(cache->options().num_experts);
    accesses.push_back({last_view.expert_map, n * sizeof(std::int32_t), AccessMode::read});
    Ids slots;
    for (std::int32_t e : last_unique) slots.push_back(cache->forward_map_host()[static_cast<std::size_t>(e)]);
    for (std::int32_t slot : slots) {
      for (const SlotTensor& t : last_view.tensors) {
        if (t.bytes != 0) accesses.push_back({t.slot(slot), t.bytes, AccessMode::read});
      }
    }
    ++launched;
    return rt.launch(s, accesses, [v = last_view, ids = last_unique, slots, log = log]() {
      ++log->runs;
      for (std::size_t k = 0; k < ids.size(); ++k) {
        bool ok = v.expert_map[ids[k]] == slots[k];
        for (std::size_t t = 0; ok && t < num_expert_tensors; ++t) {
          const SlotTensor& st = v.tensors[t];
          for (std::size_t i = 0; i < st.bytes; ++i) {
            if (st.slot(slots[k])[i] != pattern_byte(t, ids[k], i)) {
              ok = false;
              break;
            }
          }
        }
        if (!ok && log->mismatches++ == 0) log->first_mismatch = "forward-map reader: expert " + std::to_string(ids[k]);
      }
    });
  }

  [[nodiscard]] std::int64_t bytes_per_expert() const {
    return static_cast<std::int64_t>(total_bytes_per_expert(cache->layout().tensors()));
  }
  PrefetchOptions budget(std::int64_t fills, std::uint32_t expires_after = 1) const {
    return PrefetchOptions{fills * bytes_per_expert(), expires_after};
  }
};

using RowSim = RowCache<SimRuntime, ExplicitLayout>;
using WholeSim = WholeExpertCache<SimRuntime, ExplicitLayout>;
using InlineSim = ExpertCache<TensorMajorStorage, Sieve, Inline, ExplicitLayout, SimRuntime>;
using BatchedSim = ExpertCache<ExpertMajorStorage, S3Fifo, Batched, ExplicitLayout, SimRuntime>;
using LayerShareSim = ExpertCache<TensorMajorStorage, LayerShare, CopyStream, ExplicitLayout, SimRuntime>;

template <class Edges>
using EdgeCache = detail::ExpertCacheWithEdges<TensorMajorStorage, Lru, CopyStream, ExplicitLayout, SimRuntime, Edges>;
static_assert(std::is_same_v<EdgeCache<OrderingEdges>, RowSim>);

Ids random_ids(std::mt19937_64& rng, std::size_t n, std::int32_t experts, bool padding) {
  Ids ids;
  for (std::size_t i = 0; i < n; ++i) {
    const auto r = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(experts + (padding ? 1 : 0)));
    ids.push_back(r == experts ? -1 : r);
  }
  return ids;
}

}  // namespace

TEST_CASE_TEMPLATE("prefetch: fills land, a using prepare hits and reads them, stats count issued/used/wasted/bytes",
                   Cache, RowSim, WholeSim, InlineSim, BatchedSim, LayerShareSim) {
  Fixture<Cache> f(12, 6, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  const Ids forward_before(f.cache->forward_map_host().begin(), f.cache->forward_map_host().end());
  const auto uploads = f.cache->stats().map_uploads;
  const auto copies = f.cache->stats().total_copies;
  auto pv = f.cache->prefetch(Ids{2, 3, 0, 4}, f.streams[0], f.budget(2, 1));
  REQUIRE(pv.ok());
  CHECK(pv.value().issued == 2);  // the budget: 2 and 3
  CHECK(pv.value().skipped_resident == 1);
  CHECK(pv.value().bytes == static_cast<std::uint64_t>(2 * f.bytes_per_expert()));
  CHECK(f.cache->planner().is_speculative(2));
  CHECK(f.cache->planner().is_speculative(3));
  CHECK_FALSE(f.cache->planner().is_resident(4));
  // The forward map is not touched; the resident map is uploaded once.
  CHECK(Ids(f.cache->forward_map_host().begin(), f.cache->forward_map_host().end()) == forward_before);
  CHECK(f.cache->stats().map_uploads == uploads + 1);
  CHECK(f.cache->stats().total_copies == copies + 2 * f.cache->storage().copy_regions().count);
  CHECK(f.cache->stats().prepare_calls == 1);
  REQUIRE(f.forward_map_reader(f.streams[0]).ok());  // the current forward's kernels go on
  f.rt.run_random(3, 5);

  REQUIRE(f.forward(Ids{2, 0, -1, 2}, f.streams[1]).ok());  // 2 used, from another stream
  CHECK(f.cache->last_plan().hits == 2);
  CHECK(f.cache->last_plan().misses == 0);
  CHECK(f.cache->stats().last_copies == 0);
  REQUIRE(f.forward(Ids{5, 1}, f.streams[0]).ok());  // 3 unused for 2 forwards: wasted after the first
  const CacheStats s = f.cache->stats();
  CHECK(s.speculative_issued == 2);
  CHECK(s.speculative_used == 1);
  CHECK(s.speculative_wasted == 1);
  CHECK(s.speculative_bytes == static_cast<std::uint64_t>(2 * f.bytes_per_expert()));
  CHECK(s.promotions == s.misses);  // speculative fills are not promotions
  CHECK(s.hits == 2 + 1);
  f.check_clean_after_drain();
}

TEST_CASE("prefetch through AnyExpertCache: host providers pass through") {
  SimRuntime rt;
  const Stream st = rt.create_stream().value();
  AnyCacheConfig config;
  config.options = quiet_options(10, 4, 2);
  config.layout = AnyLayout::explicit_bytes(six_tensor_layout().bytes);
  auto made = make_expert_cache(rt, config);
  REQUIRE(made.ok());
  auto& cache = made.value();
  REQUIRE(cache.prepare(Ids{0, 1}, st).ok());
  const std::int64_t per = static_cast<std::int64_t>(total_bytes_per_expert(six_tensor_layout().bytes));
  auto pv = cache.prefetch(Ids{5, 6, 7}, st, PrefetchOptions{2 * per + per / 2, 1});
  REQUIRE(pv.ok());
  CHECK(pv.value().issued == 2);
  CHECK(cache.stats().speculative_issued == 2);
  CHECK(cache.prefetch(Ids{10}, st, PrefetchOptions{per, 1}).status().code() == ErrorCode::expert_out_of_range);
  REQUIRE(cache.prepare(Ids{5, 1}, st).ok());
  CHECK(cache.stats().speculative_used == 1);
  rt.drain();
  CHECK(rt.races().empty());
}

TEST_CASE("prefetch: bad input gets a specific error and leaves stats, maps, plan state and device work unchanged") {
  Fixture<RowSim> f(10, 4, 2);
  REQUIRE(f.forward(Ids{1, 2}, f.streams[0]).ok());
  REQUIRE(f.cache->prefetch(Ids{3}, f.streams[0], f.budget(1, 2)).ok());
  f.rt.drain();
  const auto snap = f.cache->planner().snapshot();
  const CacheStats stats_before = f.cache->stats();
  const auto ops_before = f.rt.counters();
  const Ids resident_before(f.cache->resident_map_host().begin(), f.cache->resident_map_host().end());
  const Ids forward_before(f.cache->forward_map_host().begin(), f.cache->forward_map_host().end());
  auto same = [&] {
    CHECK(f.cache->planner().snapshot() == snap);
    check_stats_equal(f.cache->stats(), stats_before);
    CHECK(f.cache->stats().speculative_issued == stats_before.speculative_issued);
    CHECK(f.cache->stats().speculative_bytes == stats_before.speculative_bytes);
    CHECK(f.rt.counters() == ops_before);
    CHECK(Ids(f.cache->resident_map_host().begin(), f.cache->resident_map_host().end()) == resident_before);
    CHECK(Ids(f.cache->forward_map_host().begin(), f.cache->forward_map_host().end()) == forward_before);
  };
  const Stream s = f.streams[1];
  CHECK(f.cache->prefetch(Ids{4, 10}, s, f.budget(2)).status().code() == ErrorCode::expert_out_of_range);
  same();
  CHECK(f.cache->prefetch(Ids{-1}, s, f.budget(2)).status().code() == ErrorCode::expert_out_of_range);
  same();
  CHECK(f.cache->prefetch(Ids(11, 4), s, f.budget(2)).status().code() == ErrorCode::too_many_experts);
  same();
  CHECK(f.cache->prefetch(Ids{4}, s, PrefetchOptions{-1, 1}).status().code() == ErrorCode::invalid_argument);
  same();
  CHECK(f.cache->prefetch(Ids{4}, s, f.budget(1, 0)).status().code() == ErrorCode::invalid_argument);
  same();
  REQUIRE(f.rt.set_capturing(s, true).ok());
  CHECK(f.cache->prefetch(Ids{4}, s, f.budget(1)).status().code() == ErrorCode::capture_unsupported);
  REQUIRE(f.rt.set_capturing(s, false).ok());
  same();
  // A budget below one expert, or an empty list: accepted, nothing happens.
  auto none = f.cache->prefetch(Ids{4}, s, PrefetchOptions{f.bytes_per_expert() - 1, 1});
  REQUIRE(none.ok());
  CHECK(none.value().issued == 0);
  same();
  REQUIRE(f.cache->prefetch(Ids{}, s, f.budget(3)).ok());
  same();
  REQUIRE(f.forward(Ids{3, 5}, f.streams[0]).ok());
  f.check_clean_after_drain();
}

// ---- scored hints (PrefetchOptions::scores, min_score) ----------------------------------------

TEST_CASE_TEMPLATE("prefetch with scores: highest first within the budget, the unlikely skipped and counted", Cache,
                   RowSim, WholeSim, InlineSim, BatchedSim, LayerShareSim) {
  Fixture<Cache> f(12, 6, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  const std::vector<float> scores{0.6f, 0.9f, 0.3f, 0.8f, 0.6f};
  PrefetchOptions o = f.budget(2);
  o.scores = scores;
  auto pv = f.cache->prefetch(Ids{2, 3, 4, 5, 0}, f.streams[0], o);
  REQUIRE(pv.ok());
  CHECK(pv.value().issued == 2);  // 3 (0.9) and 5 (0.8); 2 and 0 (0.6) are past the budget
  CHECK(pv.value().skipped_unlikely == 1);  // 4 (0.3)
  CHECK(pv.value().skipped_resident == 0);   // the loop stopped at the budget, before 0
  CHECK(pv.value().bytes == static_cast<std::uint64_t>(2 * f.bytes_per_expert()));
  CHECK(f.cache->planner().is_speculative(3));
  CHECK(f.cache->planner().is_speculative(5));
  CHECK_FALSE(f.cache->planner().is_resident(2));
  CHECK_FALSE(f.cache->planner().is_resident(4));
  CHECK(f.cache->last_prefetch().skipped_unlikely == 1);
  REQUIRE(f.forward_map_reader(f.streams[0]).ok());
  // Ties keep the caller's order: 2 before 0 (resident; still counted after the budget is spent),
  // and 4 is still unlikely.
  o = f.budget(1);
  o.scores = scores;
  pv = f.cache->prefetch(Ids{2, 3, 4, 5, 0}, f.streams[1], o);
  REQUIRE(pv.ok());
  CHECK(pv.value().issued == 1);
  CHECK(f.cache->planner().is_speculative(2));
  CHECK(pv.value().skipped_resident == 3);  // 3 and 5 (in flight), 0
  f.rt.run_random(3, 5);
  REQUIRE(f.forward(Ids{3, 5, 2}, f.streams[1]).ok());  // all three used, read complete
  CHECK(f.cache->last_plan().hits == 3);
  CHECK(f.cache->last_plan().misses == 0);
  const CacheStats st = f.cache->stats();
  CHECK(st.speculative_issued == 3);
  CHECK(st.speculative_used == 3);
  CHECK(st.speculative_wasted == 0);
  f.check_clean_after_drain();
}

TEST_CASE_TEMPLATE("prefetch with precision feedback: a rank whose fills go unused stops costing copies; the option turns it off",
                   Cache, RowSim, WholeSim) {
  for (const bool feedback : {true, false}) {
    CAPTURE(feedback);
    Fixture<Cache> f(16, 6, 2);
    std::uint64_t issued = 0, imprecise = 0, resident = 0;
    for (std::int32_t i = 0; i < 40; ++i) {
      REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
      PrefetchOptions o = f.budget(1);
      o.precision_feedback = feedback;
      auto pv = f.cache->prefetch(Ids{2 + i % 12}, f.streams[0], o);  // never read: wasted at the next forward
      REQUIRE(pv.ok());
      issued += pv.value().issued;
      imprecise += pv.value().skipped_imprecise;
      resident += pv.value().skipped_resident;
      CHECK(pv.value().issued + pv.value().skipped_imprecise + pv.value().skipped_resident == 1);
      REQUIRE(f.forward_map_reader(f.streams[0]).ok());
      f.rt.run_random(2, 4);
    }
    const CacheStats st = f.cache->stats();
    CHECK(st.speculative_issued == issued);
    CHECK(st.speculative_bytes == issued * static_cast<std::uint64_t>(f.bytes_per_expert()));
    if (feedback) {
      CHECK(issued <= 11 + 2);  // eleven wasted fills throttle rank 0; then at most one probe in 32
      CHECK(imprecise >= 40 - 13 - resident);
      CHECK(imprecise > 0);
    } else {
      CHECK(imprecise == 0);
      CHECK(issued + resident == 40);  // every call fetches but for an id still resident from 12 calls before
    }
    f.check_clean_after_drain();
  }
}

TEST_CASE("prefetch with scores: every bad input is a specific error and changes nothing") {
  Fixture<RowSim> f(10, 4, 2);
  REQUIRE(f.forward(Ids{1, 2}, f.streams[0]).ok());
  REQUIRE(f.cache->prefetch(Ids{3}, f.streams[0], f.budget(1, 2)).ok());
  f.rt.drain();
  const auto snap = f.cache->planner().snapshot();
  const CacheStats stats_before = f.cache->stats();
  const auto ops_before = f.rt.counters();
  const Ids resident_before(f.cache->resident_map_host().begin(), f.cache->resident_map_host().end());
  const Ids forward_before(f.cache->forward_map_host().begin(), f.cache->forward_map_host().end());
  const PrefetchPlan plan_before = f.cache->last_prefetch();
  auto same = [&] {
    CHECK(f.cache->planner().snapshot() == snap);
    check_stats_equal(f.cache->stats(), stats_before);
    CHECK(f.rt.counters() == ops_before);
    CHECK(Ids(f.cache->resident_map_host().begin(), f.cache->resident_map_host().end()) == resident_before);
    CHECK(Ids(f.cache->forward_map_host().begin(), f.cache->forward_map_host().end()) == forward_before);
    CHECK(f.cache->last_prefetch().fills == plan_before.fills);
  };
  const Stream s = f.streams[1];
  auto call = [&](const Ids& ids, std::vector<float> scores, float min_score) {
    PrefetchOptions o = f.budget(2);
    o.scores = scores;
    o.min_score = min_score;
    return f.cache->prefetch(ids, s, o);
  };
  auto r = call(Ids{4, 5}, {0.9f}, 0.5f);
  CHECK(r.status().code() == ErrorCode::invalid_argument);
  CHECK(std::string(r.status().message()).find("1 scores for 2 predicted ids") != std::string::npos);
  same();
  r = call(Ids{4, 5}, {0.9f, 0.8f, 0.7f}, 0.5f);
  CHECK(r.status().code() == ErrorCode::invalid_argument);
  same();
  r = call(Ids{4, 5}, {0.9f, std::numeric_limits<float>::quiet_NaN()}, 0.5f);
  CHECK(r.status().code() == ErrorCode::invalid_argument);
  CHECK(std::string(r.status().message()).find("score nan at index 1 (expert 5)") != std::string::npos);
  same();
  r = call(Ids{4, 5}, {-std::numeric_limits<float>::infinity(), 0.8f}, 0.5f);
  CHECK(r.status().code() == ErrorCode::invalid_argument);
  CHECK(std::string(r.status().message()).find("score -inf at index 0 (expert 4)") != std::string::npos);
  same();
  r = call(Ids{4, 5}, {0.9f, 1.25f}, 0.5f);
  CHECK(r.status().code() == ErrorCode::invalid_argument);
  CHECK(std::string(r.status().message()).find("score 1.25 at index 1") != std::string::npos);
  same();
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), -0.1f, 1.5f}) {
    CAPTURE(bad);
    r = call(Ids{4, 5}, {0.9f, 0.8f}, bad);
    CHECK(r.status().code() == ErrorCode::invalid_argument);
    CHECK(std::string(r.status().message()).find("min_score") != std::string::npos);
    same();
    r = call(Ids{4, 5}, {}, bad);  // without scores too
    CHECK(r.status().code() == ErrorCode::invalid_argument);
    same();
  }
  // A bad id is refused even where its score would skip it.
  r = call(Ids{4, 10}, {0.9f, 0.1f}, 0.5f);
  CHECK(r.status().code() == ErrorCode::expert_out_of_range);
  same();
  // A budget below one expert still checks the scores.
  PrefetchOptions tiny{f.bytes_per_expert() - 1, 1};
  const std::vector<float> one_bad{2.0f};
  tiny.scores = one_bad;
  CHECK(f.cache->prefetch(Ids{4}, s, tiny).status().code() == ErrorCode::invalid_argument);
  same();
  // Every hint unlikely: accepted, nothing happens, the skips are counted.
  auto none = call(Ids{4, 5}, {0.2f, 0.49f}, 0.5f);
  REQUIRE(none.ok());
  CHECK(none.value().issued == 0);
  CHECK(none.value().skipped_unlikely == 2);
  CHECK(f.cache->planner().snapshot() == snap);
  CHECK(f.rt.counters() == ops_before);
  REQUIRE(f.forward(Ids{3, 5}, f.streams[0]).ok());
  f.check_clean_after_drain();
}

TEST_CASE("prefetch with scores through AnyExpertCache: host and device providers select; prefetch_device refuses") {
  const std::int64_t per = static_cast<std::int64_t>(total_bytes_per_expert(six_tensor_layout().bytes));
  const std::vector<float> scores{0.55f, 0.3f, 0.95f, 0.7f};
  const Ids predicted{5, 6, 7, 8};
  for (const char* provider : {"row", "cached", "device"}) {
    CAPTURE(provider);
    SimRuntime rt;
    const Stream st = rt.create_stream().value();
    AnyCacheConfig config;
    config.provider = provider;
    config.options = quiet_options(10, 4, 2);
    config.layout = AnyLayout::explicit_bytes(six_tensor_layout().bytes);
    config.max_ids = 4;  // the device provider's bound on a forward's ids
    auto made = make_expert_cache(rt, config);
    REQUIRE_MESSAGE(made.ok(), made.status().to_string());
    auto& cache = made.value();
    // The device provider reads its forward's ids from device memory.
    RuntimeBuffer<SimRuntime> forward_ids(rt, 4 * sizeof(std::int32_t), MemoryKind::device);
    const bool device = std::string_view(provider) == "device";
    auto prepare = [&](const Ids& ids) {
      if (!device) return cache.prepare(ids, st).ok();
      rt.host_access(forward_ids.data(), ids.size() * sizeof(std::int32_t), AccessMode::write);
      std::memcpy(forward_ids.data(), ids.data(), ids.size() * sizeof(std::int32_t));
      return cache.prepare(std::span<const std::int32_t>(reinterpret_cast<const std::int32_t*>(forward_ids.data()), ids.size()), st)
          .ok();
    };
    REQUIRE(prepare(Ids{0, 1}));
    rt.drain();
    REQUIRE(rt.synchronize(st).ok());
    // Two free slots, budget 2: 7 (0.95) and 8 (0.7); 5 (0.55) past the budget, 6 unlikely.
    auto pv = cache.prefetch(predicted, st, PrefetchOptions{2 * per, 1, scores});
    REQUIRE(pv.ok());
    CHECK(pv.value().skipped_unlikely == 1);
    rt.drain();
    REQUIRE(rt.synchronize(st).ok());
    CHECK(cache.stats().speculative_issued == 2);
    REQUIRE(prepare(Ids{7, 8}));
    rt.drain();
    REQUIRE(rt.synchronize(st).ok());
    CHECK(cache.stats().speculative_used == 2);
    CHECK(cache.stats().misses == 2);  // the first forward's only
    const CacheStats before = cache.stats();
    const std::vector<float> short_scores{0.9f};
    CHECK(cache.prefetch(predicted, st, PrefetchOptions{2 * per, 1, short_scores}).status().code() ==
          ErrorCode::invalid_argument);
    RuntimeBuffer<SimRuntime> ids(rt, 4 * sizeof(std::int32_t), MemoryKind::device);
    const auto r = cache.prefetch_device(reinterpret_cast<const std::int32_t*>(ids.data()), 2, st,
                                         PrefetchOptions{2 * per, 1, std::span<const float>(scores).first(2)});
    CHECK(r.status().code() == ErrorCode::not_supported);
    check_stats_equal(before, cache.stats());
    rt.drain();
    CHECK(rt.races().empty());
  }
}

TEST_CASE("prefetch: a runtime failure drops the call's fills, counts a fault; the cache goes on") {
  for (FaultKind kind : {FaultKind::copy, FaultKind::record, FaultKind::wait}) {
    CAPTURE(static_cast<int>(kind));
    Fixture<RowSim> f(10, 4, 2);
    REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
    f.rt.inject_failure(kind, 1);
    auto pv = f.cache->prefetch(Ids{2, 3}, f.streams[1], f.budget(2));
    REQUIRE_FALSE(pv.ok());
    CHECK(pv.status().code() == ErrorCode::runtime_failure);
    CHECK(pv.status().message().find("prefetch") != std::string_view::npos);
    f.rt.clear_failures();
    const CacheStats s = f.cache->stats();
    CHECK(s.faults == 1);
    CHECK(f.cache->planner().speculative_count() == 0);
    CHECK(s.speculative_issued == s.speculative_wasted);
    CHECK_FALSE(f.cache->planner().is_resident(2));
    CHECK_FALSE(f.cache->planner().is_resident(3));
    REQUIRE(f.forward(Ids{2, 3}, f.streams[0]).ok());  // refetched by a prepare
    REQUIRE(f.cache->prefetch(Ids{4}, f.streams[0], f.budget(1)).ok());
    REQUIRE(f.forward(Ids{4, 2}, f.streams[1]).ok());
    f.check_clean_after_drain();
  }
}

// ---- edge 9: a prepare using a speculative fill waits for exactly that slot ------------------

namespace {

struct Detected {
  std::size_t races = 0;
  std::uint64_t mismatches = 0;
};

// prefetch(2) on the copy stream, then an all-hit prepare using 2 on the consumer stream: only
// the slot's event orders the reader after the copy (`ready` precedes the fill).
template <class Edges>
Detected read_speculative_fill() {
  Fixture<EdgeCache<Edges>> f(8, 4, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.cache->prefetch(Ids{2}, f.streams[0], f.budget(1)).ok());
  REQUIRE(f.forward(Ids{0, 2}, f.streams[0]).ok());
  REQUIRE(f.cache->stats().last_copies == 0);  // all hits: nothing else orders the reader
  f.rt.drain();
  if (!f.rt.races().empty()) MESSAGE(f.rt.races()[0].description);
  return {f.rt.races().size(), f.log->mismatches};
}

}  // namespace

TEST_CASE("negative (edge 9): removing the speculative-slot wait lets a prepare read a fill still in flight") {
  const Detected with = read_speculative_fill<OrderingEdges>();
  CHECK(with.races == 0);
  CHECK(with.mismatches == 0);
  const Detected without = read_speculative_fill<NoSpeculativeSlotWait>();
  CHECK(without.races > 0);  // the detector itself fires, whatever the reader happened to see
}

// ---- speculative fills after the latest forward's adoption (edges 1 and 11) -----------------

namespace {

// forward {0, 1}, a first prefetch (reserves the speculative stream), forward {2, 3} (adopted:
// the latest forward), then prefetch(4): it evicts 0 or 1, whose slot was filled and read for
// forward {0, 1}; only the event recorded when {2, 3} was adopted orders the fill after both.
template <class Edges>
Detected overwrite_older_forward_slot() {
  Fixture<EdgeCache<Edges>> f(8, 4, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.cache->prefetch(Ids{0}, f.streams[0], f.budget(1)).ok());  // resident: no fill
  REQUIRE(f.forward(Ids{2, 3}, f.streams[0]).ok());
  REQUIRE(f.cache->prefetch(Ids{4}, f.streams[0], f.budget(1)).ok());
  REQUIRE(f.cache->stats().speculative_issued == 1);
  f.rt.drain();
  if (!f.rt.races().empty()) MESSAGE(f.rt.races()[0].description);
  return {f.rt.races().size(), f.log->mismatches};
}

// As above, then invalidate(4) (its slot freed, the fill still pending) and a forward that
// fills the freed slot: only the slot's pending-fill event orders that write after the fill.
template <class Edges>
Detected refill_slot_of_pending_fill() {
  Fixture<EdgeCache<Edges>> f(8, 4, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.cache->prefetch(Ids{0}, f.streams[0], f.budget(1)).ok());
  REQUIRE(f.forward(Ids{2, 3}, f.streams[0]).ok());
  REQUIRE(f.cache->prefetch(Ids{4}, f.streams[0], f.budget(1)).ok());
  REQUIRE(f.cache->invalidate(4, f.streams[0]).ok());
  REQUIRE(f.forward(Ids{2, 5}, f.streams[0]).ok());  // 5 takes the freed slot
  f.rt.drain();
  if (!f.rt.races().empty()) MESSAGE(f.rt.races()[0].description);
  return {f.rt.races().size(), f.log->mismatches};
}

}  // namespace

TEST_CASE("negative (edge 1, speculative): a fill ordered only by the latest forward's adoption; without it, it races the slot's earlier use") {
  const Detected with = overwrite_older_forward_slot<OrderingEdges>();
  CHECK(with.races == 0);
  CHECK(with.mismatches == 0);
  const Detected without = overwrite_older_forward_slot<NoReleaseWait>();
  CHECK(without.races > 0);
}

TEST_CASE("negative (edge 11): a slot write waits for the slot's pending speculative fill; without it, the two writes race") {
  const Detected with = refill_slot_of_pending_fill<OrderingEdges>();
  CHECK(with.races == 0);
  CHECK(with.mismatches == 0);
  const Detected without = refill_slot_of_pending_fill<NoSpeculativeOverwriteWait>();
  CHECK(without.races > 0);
}

namespace {

// A cache of top_k slots: forward {0, 1}, a prefetch that reserves the speculative stream, forward
// {1, 0} (adopted: the latest forward, its reader enqueued on streams[0]), then, from streams[1],
// a prefetch that promises the forward's readers are enqueued (evict_last_forward) and evicts 0
// or 1: only the slot's release (edge 1, as for a prepare's eviction) orders the fill after that
// reader; the adoption event, which orders a prefetch that leaves the latest forward's slots
// alone, comes before it.
template <class Edges>
Detected evict_last_forward_slot() {
  Fixture<EdgeCache<Edges>> f(8, 2, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.cache->prefetch(Ids{0}, f.streams[0], f.budget(1)).ok());  // resident: no fill; reserves the speculative stream
  REQUIRE(f.forward(Ids{1, 0}, f.streams[0]).ok());                    // adopted: the latest forward, read again
  PrefetchOptions o = f.budget(1);
  o.evict_last_forward = true;
  REQUIRE(f.cache->prefetch(Ids{2}, f.streams[1], o).ok());
  REQUIRE(f.cache->stats().speculative_issued == 1);
  REQUIRE(f.forward(Ids{2, 0}, f.streams[1]).ok());  // the prefetched expert is read and checked
  f.rt.drain();
  if (!f.rt.races().empty()) MESSAGE(f.rt.races()[0].description);
  return {f.rt.races().size(), f.log->mismatches};
}

}  // namespace

TEST_CASE("negative (edge 1, evict_last_forward): a prefetch into the last forward's slots waits for its reader") {
  const Detected with = evict_last_forward_slot<OrderingEdges>();
  CHECK(with.races == 0);
  CHECK(with.mismatches == 0);
  const Detected without = evict_last_forward_slot<NoReleaseWait>();
  CHECK(without.races > 0);
}

TEST_CASE("prefetch: a cache of top_k slots looks ahead only with evict_last_forward") {
  // The per-layer ExpertCache takes it; a model cache with a shared pool refuses it (tests/host/test_model_cache.cpp).
  Fixture<RowSim> f(8, 2, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  PrefetchOptions o = f.budget(1);
  auto without = f.cache->prefetch(Ids{2}, f.streams[0], o);
  REQUIRE(without.ok());
  CHECK(without.value().issued == 0);
  CHECK(without.value().skipped_no_victim == 1);
  o.evict_last_forward = true;
  auto with = f.cache->prefetch(Ids{2}, f.streams[0], o);
  REQUIRE(with.ok());
  CHECK(with.value().issued == 1);
  f.check_clean_after_drain();
}

TEST_CASE("prefetch after an adopted forward: the fills do not wait for that forward's consumer, nor the next prepare for them") {
  Fixture<RowSim> f(8, 4, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.cache->prefetch(Ids{0}, f.streams[0], f.budget(1)).ok());
  REQUIRE(f.forward(Ids{2, 3}, f.streams[0]).ok());
  REQUIRE(f.cache->copy_stream().has_value());
  const Stream copy = *f.cache->copy_stream();
  const std::size_t total = f.rt.pending_ops(), on_caller = f.rt.pending_ops(f.streams[0]),
                    on_copy = f.rt.pending_ops(copy);
  REQUIRE(f.cache->prefetch(Ids{4}, f.streams[0], f.budget(1)).ok());
  // Enqueued on a stream of its own: nothing behind the caller's consumer, nothing in front of
  // the next prepare's own writes on the copy stream.
  CHECK(f.rt.pending_ops() > total);
  CHECK(f.rt.pending_ops(f.streams[0]) == on_caller);
  CHECK(f.rt.pending_ops(copy) == on_copy);
  CHECK(f.cache->resident_map_behind());  // the map goes with the next prepare
  REQUIRE(f.forward(Ids{2, 4}, f.streams[0]).ok());
  CHECK_FALSE(f.cache->resident_map_behind());
  f.check_clean_after_drain();
}

TEST_CASE("edge 9 waits for exactly the slot's event: a later prefetch's fill still in flight does not hold the reader") {
  Fixture<RowSim> f(10, 5, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.cache->prefetch(Ids{2}, f.streams[0], f.budget(1)).ok());
  REQUIRE(f.cache->prefetch(Ids{3}, f.streams[0], f.budget(1)).ok());
  REQUIRE(f.forward(Ids{0, 2}, f.streams[0]).ok());  // all hits, uses 2 only
  REQUIRE(f.cache->stats().last_copies == 0);
  const Stream copy = f.cache->copy_stream().value();
  // The copy stream's last ops: expert 3's copies (one per present tensor) and its slot event.
  const std::size_t tail = f.cache->storage().copy_regions().count + 1;
  for (int guard = 0; guard < 1000 && f.rt.pending_ops(copy) > tail; ++guard) {
    if (!f.rt.step(copy)) REQUIRE(f.rt.step(f.streams[0]));  // the copy stream waits on the owner
  }
  REQUIRE(f.rt.pending_ops(copy) == tail);
  while (f.rt.step(f.streams[0])) {
  }
  CHECK(f.rt.pending_ops(f.streams[0]) == 0);  // both readers ran with 3's fill still queued
  CHECK(f.log->runs == 2);
  CHECK(f.rt.pending_ops(copy) == tail);
  f.check_clean_after_drain();
}

namespace {

struct SecondWait {
  bool held = false;  // the second reader was still queued while the other slot's fill was
  std::size_t races = 0;
  std::uint64_t mismatches = 0;
};

// One prefetch() fills 2 then 3 (copy 2, event 2, copy 3, event 3 on the copy stream); an all-hit
// prepare on the owner stream uses 2, then one on another stream uses 3. After the first prepare
// one fill is still pending, so the second must not take the no-pending early return: only
// slot 3's event orders its reader after copy 3 (the first prepare waited for event 2 only).
template <class Edges>
SecondWait consume_one_of_two_pending() {
  Fixture<EdgeCache<Edges>> f(10, 5, 2);
  SecondWait out;
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.cache->prefetch(Ids{2, 3}, f.streams[0], f.budget(2, 2)).ok());
  REQUIRE(f.forward(Ids{0, 2}, f.streams[0]).ok());  // consumes 2; 3 stays pending
  REQUIRE(f.cache->stats().last_copies == 0);
  REQUIRE(f.forward(Ids{3, 0}, f.streams[1]).ok());  // all hits, another stream
  REQUIRE(f.cache->stats().last_copies == 0);
  const Stream copy = f.cache->copy_stream().value();
  const std::size_t tail = f.cache->storage().copy_regions().count + 1;  // copy 3 and event 3
  for (int guard = 0; guard < 1000 && f.rt.pending_ops(copy) > tail; ++guard) {
    if (!f.rt.step(copy)) REQUIRE(f.rt.step(f.streams[0]));
  }
  REQUIRE(f.rt.pending_ops(copy) == tail);
  while (f.rt.step(f.streams[0]) || f.rt.step(f.streams[1])) {
  }
  CHECK(f.rt.pending_ops(f.streams[0]) == 0);
  out.held = f.log->runs == 2 && f.rt.pending_ops(f.streams[1]) > 0;
  f.rt.drain();
  CHECK(f.log->runs == f.launched);
  if (!f.rt.races().empty()) MESSAGE(f.rt.races()[0].description);
  out.races = f.rt.races().size();
  out.mismatches = f.log->mismatches;
  return out;
}

}  // namespace

TEST_CASE("edge 9 with two fills pending: after one is consumed, a prepare using the other still waits for it") {
  const SecondWait with = consume_one_of_two_pending<OrderingEdges>();
  CHECK(with.held);
  CHECK(with.races == 0);
  CHECK(with.mismatches == 0);
  // Without edge 9 the same schedule reads slot 3 early: the wait the second prepare issues is
  // the only order, so an early return that skipped it would fail the two checks above.
  const SecondWait without = consume_one_of_two_pending<NoSpeculativeSlotWait>();
  CHECK_FALSE(without.held);
  CHECK(without.races > 0);
}

// ---- randomized schedules --------------------------------------------------------------------

namespace {

// prefetches, prepares (with readers), current-forward readers after a prefetch, invalidates and
// expert-split groups from random streams, the simulated GPU advanced by random amounts.
template <class Cache>
std::uint64_t run_prefetch_schedule(std::uint64_t seed) {
  constexpr std::int32_t experts = 12, capacity = 5, k = 2;
  Fixture<Cache> f(experts, capacity, k, seed, 3);
  std::mt19937_64 rng(seed);
  const int actions = 8 + static_cast<int>(rng() % 8);
  bool have_forward = false;
  Stream owner = f.streams[0];
  for (int a = 0; a < actions; ++a) {
    const Stream s = f.streams[rng() % f.streams.size()];
    const auto kind = rng() % 20;
    if (kind < 8) {
      REQUIRE(f.forward(random_ids(rng, 2 * k, experts, true), s).ok());
      have_forward = true;
      owner = s;
    } else if (kind < 14) {
      const Ids predicted = random_ids(rng, 1 + rng() % 4, experts, false);
      const auto fills = static_cast<std::int64_t>(rng() % 4);
      REQUIRE(f.cache->prefetch(predicted, s, f.budget(fills, 1 + static_cast<std::uint32_t>(rng() % 2))).ok());
      if (have_forward && rng() % 2 == 0) REQUIRE(f.forward_map_reader(owner).ok());
    } else if (kind < 17) {
      REQUIRE(f.cache->invalidate(static_cast<std::int32_t>(rng() % experts), s).ok());
      have_forward = false;  // the last forward's reader may no longer name a resident slot
    } else {
      auto groups = f.cache->plan_expert_groups(random_ids(rng, 10, experts, true));
      REQUIRE(groups.ok());
      for (const auto& g : groups.value()) {
        auto view = f.cache->prepare_unique(g.unique_ids, s);
        REQUIRE(view.ok());
        ++f.launched;
        REQUIRE(launch_reader(f.rt, *f.cache, view.value(), g.unique_ids, s, f.log).ok());
      }
      have_forward = false;
    }
    f.rt.run_random(rng(), rng() % 12);
  }
  f.check_clean_after_drain();
  const CacheStats st = f.cache->stats();
  CHECK(st.speculative_issued == st.speculative_used + st.speculative_wasted +
                                     static_cast<std::uint64_t>(f.cache->planner().speculative_count()));
  return st.speculative_used;
}

// 4000 schedules by default; EXPERT_CACHE_SCHEDULES (10^5 by default in test_cache_sim.cpp)
// scales them by 1/25, with a floor of 400.
std::uint64_t prefetch_schedules() {
  if (const char* env = std::getenv("EXPERT_CACHE_SCHEDULES")) {
    return std::max<std::uint64_t>(400, std::strtoull(env, nullptr, 10) / 25);
  }
  return 4000;
}

}  // namespace

TEST_CASE("ordering: the race detector stays silent over randomized schedules mixing prefetch, prepare, invalidate") {
  const std::uint64_t total = prefetch_schedules();
  constexpr std::uint64_t configs = 5;
  std::uint64_t used = 0, count = 0;
  for (std::uint64_t i = 0; i < (total + configs - 1) / configs; ++i) {
    used += run_prefetch_schedule<RowSim>(i * configs + 1);
    used += run_prefetch_schedule<WholeSim>(i * configs + 2);
    used += run_prefetch_schedule<InlineSim>(i * configs + 3);
    used += run_prefetch_schedule<BatchedSim>(i * configs + 4);
    used += run_prefetch_schedule<LayerShareSim>(i * configs + 5);
    count += configs;
  }
  MESSAGE("prefetch schedules checked: " << count << ", speculative fills used: " << used);
  CHECK(count >= total);
  CHECK(used > count / 10);  // the schedules do exercise edge 9
}
