// AnyPolicy and AnyStaging, the erased policies of the run-time-selected cache (any/any_cache.hpp):
// a planner over AnyPolicy makes exactly the static policy's decisions for every online policy
// (forwards, prefetches, invalidations), names are checked, and AnyStaging runs the held
// staging policy on the held policy's stream. Small on purpose: one planner per policy, one
// cache type, so this file compiles in seconds.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "expert_cache/cache/expert_cache.hpp"
#include "expert_cache/eviction/any_policy.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"
#include "expert_cache/staging/any_staging.hpp"
#include "expert_cache/staging/copy_staging.hpp"

using namespace expert_cache;
using Ids = std::vector<std::int32_t>;

namespace {

constexpr CacheShape shape{64, 12};
constexpr PoolLayout pool{16};  // four layers of 16: lrfu and layershare see layers

template <class P>
P make_static() {
  if constexpr (std::is_constructible_v<P, CacheShape, PoolLayout>) {
    return P(shape, pool);
  } else {
    return P(shape);
  }
}

// The same random forwards (skewed, so there are hits and evictions), prefetches and
// invalidations on both planners; every outcome and the whole state compared after each step.
template <class P>
void run_same(std::uint32_t seed) {
  CAPTURE(P::name);
  const std::int32_t top_k = 4;
  ForwardPlanner<P> ref(shape, top_k, make_static<P>());
  Result<AnyPolicy> made = AnyPolicy::make(P::name, shape, pool);
  REQUIRE(made.ok());
  CHECK(made.value().held_name() == P::name);
  ForwardPlanner<AnyPolicy> any(shape, top_k, std::move(made.value()));
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> hot(0, 15), all(0, shape.num_experts - 1), pick(0, 9);
  ForwardPlan pr, pa;
  PrefetchPlan fr, fa;
  for (int step = 0; step < 400; ++step) {
    CAPTURE(step);
    const int kind = pick(rng);
    if (kind == 0) {  // prefetch up to 3 predicted ids
      Ids predicted;
      for (int i = 0; i < 4; ++i) predicted.push_back(all(rng));
      std::sort(predicted.begin(), predicted.end());
      predicted.erase(std::unique(predicted.begin(), predicted.end()), predicted.end());
      const Status sr = ref.plan_prefetch(predicted, 3, 2, fr);
      const Status sa = any.plan_prefetch(predicted, 3, 2, fa);
      REQUIRE(sr.code() == sa.code());
      CHECK(fr.fills == fa.fills);
      CHECK(fr.evictions == fa.evictions);
      CHECK(fr.skipped_no_victim == fa.skipped_no_victim);
    } else if (kind == 1) {  // invalidate (resident or not)
      const std::int32_t e = all(rng);
      const Result<SlotId> ir = ref.invalidate(e);
      const Result<SlotId> ia = any.invalidate(e);
      REQUIRE(ir.ok());
      REQUIRE(ia.ok());
      CHECK(ir.value() == ia.value());
    } else {
      Ids ids;
      for (int t = 0; t < 2 * top_k; ++t) ids.push_back(pick(rng) < 7 ? hot(rng) : all(rng));
      const bool unique = kind == 2;
      if (unique) {  // an explicit unique list in the given (unsorted) order
        Ids u;
        for (std::int32_t e : ids) {
          if (std::find(u.begin(), u.end(), e) == u.end()) u.push_back(e);
        }
        ids = u;
      }
      const Status sr = unique ? ref.plan_unique(ids, pr) : ref.plan_topk(ids, pr);
      const Status sa = unique ? any.plan_unique(ids, pa) : any.plan_topk(ids, pa);
      REQUIRE(sr.code() == sa.code());
      CHECK(pr.unique == pa.unique);
      CHECK(pr.fills == pa.fills);
      CHECK(pr.evictions == pa.evictions);
      CHECK(pr.hits == pa.hits);
    }
    CHECK(std::equal(ref.resident_map().begin(), ref.resident_map().end(), any.resident_map().begin(),
                     any.resident_map().end()));
    CHECK(std::equal(ref.slot_owner().begin(), ref.slot_owner().end(), any.slot_owner().begin(),
                     any.slot_owner().end()));
    CHECK(ref.counters() == any.counters());
    // The held policy, told every hit so far, is the static one, state for state.
    const std::optional<P> held = any.policy().template held<P>();
    REQUIRE(held.has_value());
    CHECK(*held == ref.policy());
  }
  CHECK(ref.counters().hits > 0);
  CHECK(ref.counters().evictions > 0);
  CHECK(ref.counters().speculative_issued > 0);
}

}  // namespace

TEST_CASE("AnyPolicy: every online policy, chosen by name, plans exactly as the static policy") {
  SUBCASE("lru") { run_same<Lru>(1); }
  SUBCASE("lfru") { run_same<Lfru>(2); }
  SUBCASE("sieve") { run_same<Sieve>(3); }
  SUBCASE("s3fifo") { run_same<S3Fifo>(4); }
  SUBCASE("arc") { run_same<Arc>(5); }
  SUBCASE("wtinylfu") { run_same<WTinyLfu>(6); }
  SUBCASE("lrfu") { run_same<Lrfu>(7); }
  SUBCASE("layershare") { run_same<LayerShare>(8); }
  SUBCASE("crf") { run_same<Crf>(9); }
  CHECK(AnyPolicy::names.size() == 9);
}

TEST_CASE("AnyPolicy: the held policy's free-slot order (lfru hands out the highest slot first)") {
  for (const std::string_view name : AnyPolicy::names) {
    CAPTURE(name);
    Result<AnyPolicy> made = AnyPolicy::make(name, shape, pool);
    REQUIRE(made.ok());
    const FreeSlotOrder order = free_slot_order_of(made.value());
    CHECK(order == (name == "lfru" ? FreeSlotOrder::highest_first : FreeSlotOrder::lowest_first));
    ForwardPlanner<AnyPolicy> p(shape, 1, std::move(made.value()));
    ForwardPlan plan;
    REQUIRE(p.plan_topk(Ids{7}, plan).ok());
    REQUIRE(plan.fills.size() == 1);
    CHECK(plan.fills[0].slot.value == (name == "lfru" ? shape.capacity - 1 : 0));
  }
}

TEST_CASE("AnyPolicy: hits are told before the held policy is read, copied or compared") {
  // Lru over 4 slots: 0 1 2 3 inserted, then an all-hit forward {0, 1}. Told the hits, the held
  // Lru evicts 2 next; without them it would evict 0.
  const CacheShape s{8, 4};
  ForwardPlanner<AnyPolicy> p(s, 1, AnyPolicy::make("lru", s).value());
  ForwardPlanner<Lru> ref(s, 1);
  ForwardPlan plan;
  for (const Ids& f : {Ids{0, 1, 2, 3}, Ids{0, 1}}) {
    REQUIRE(p.plan_topk(f, plan).ok());
    REQUIRE(ref.plan_topk(f, plan).ok());
  }
  CHECK(plan.hits == 2);
  CHECK(p.policy().held<Lru>() == ref.policy());
  CHECK(!p.policy().held<Lfru>().has_value());
  const ForwardPlanner<AnyPolicy> copy = p;
  CHECK(copy.snapshot() == p.snapshot());
  REQUIRE(p.plan_topk(Ids{5}, plan).ok());
  REQUIRE(plan.evictions.size() == 1);
  CHECK(plan.evictions[0].expert.value == 2);
  CHECK(!(copy.snapshot() == p.snapshot()));
}

TEST_CASE("AnyPolicy::make: unknown and offline-only names are refused, naming the valid ones") {
  for (const char* name : {"", "LRU", "belady", "fifo", "lru "}) {
    CAPTURE(name);
    const Result<AnyPolicy> made = AnyPolicy::make(name, shape);
    REQUIRE(!made.ok());
    CHECK(made.status().code() == ErrorCode::invalid_argument);
    const std::string message(made.status().message());
    CHECK(message.find("unknown eviction policy") != std::string::npos);
    CHECK(message.find("lru, lfru, sieve, s3fifo, arc, wtinylfu, lrfu, layershare") != std::string::npos);
  }
  CHECK(AnyPolicy::index_of("layershare") == std::optional<std::size_t>(7));
  CHECK(!AnyPolicy::index_of("belady").has_value());
  // Shapes no planner accepts are refused before any allocation (an absurd count included).
  struct Bad {
    CacheShape shape;
    ErrorCode code;
  };
  for (const Bad& b : {Bad{{0, 0}, ErrorCode::invalid_argument}, Bad{{-5, 2}, ErrorCode::invalid_argument},
                       Bad{{8, 0}, ErrorCode::invalid_capacity}, Bad{{8, 9}, ErrorCode::invalid_capacity},
                       Bad{{INT32_MIN, INT32_MAX}, ErrorCode::invalid_argument}}) {
    CAPTURE(b.shape.num_experts);
    CAPTURE(b.shape.capacity);
    const Result<AnyPolicy> made = AnyPolicy::make("lrfu", b.shape, pool);
    REQUIRE(!made.ok());
    CHECK(made.status().code() == b.code);
  }
}

TEST_CASE("AnyStaging: an index past the list is refused") {
  using Staging = AnyStaging<Inline, CopyStream>;
  CHECK_THROWS_AS(Staging(2), Error);
  CHECK(Staging(1).held_name() == "copy_stream");
  CHECK(Staging().held_name() == "inline");
}

TEST_CASE("AnyStaging: holds the staging picked by index; fills run where the held policy runs them") {
  using Staging = AnyStaging<Inline, CopyStream, Batched>;
  using Cache = ExpertCache<TensorMajorStorage, Lru, Staging, ExplicitLayout, SimRuntime>;
  const ExplicitLayout layout{{{{"w13", 64}, {"w2", 32}}}};
  for (std::size_t i = 0; i < Staging::size; ++i) {
    CAPTURE(i);
    const Staging staging(i);
    CHECK(staging.index() == i);
    const std::string_view name = staging.held_name();
    CHECK(name == std::array<std::string_view, 3>{"inline", "copy_stream", "batched"}[i]);
    CHECK(uses_copy_stream_of(staging) == (i != 0));
    SimRuntime rt(SimRuntime::Options{.memory_limit = std::size_t{1} << 26, .seed = 9});
    CacheOptions o;
    o.num_experts = 16;
    o.capacity = 4;
    o.top_k = 2;
    Cache cache(rt, o, layout, Lru(CacheShape{16, 4}), staging);
    // Inline fills on the caller's stream: no copy stream; the others own one.
    CHECK(cache.copy_stream().has_value() == (i != 0));
    const SimRuntime::Stream s = rt.create_stream().value();
    const Result<ForwardView> v = cache.prepare(Ids{1, 2}, s);
    REQUIRE(v.ok());
    CHECK(v.value().misses == 2);
    CHECK(cache.stats().last_copies == 2 * 2);  // two tensors per fill, whichever policy issued them
    REQUIRE(rt.synchronize(s).ok());
    CHECK(rt.races().empty());
    // Batched refuses a capturing caller before planning (its precheck runs through AnyStaging).
    REQUIRE(rt.set_capturing(s, true).ok());
    const Result<ForwardView> captured = cache.prepare(Ids{3}, s);
    if (i == 2) {
      REQUIRE(!captured.ok());
      CHECK(captured.status().code() == ErrorCode::capture_unsupported);
      CHECK(!cache.planner().is_resident(3));
    } else {
      CHECK(captured.ok());
    }
    REQUIRE(rt.set_capturing(s, false).ok());
  }
}
