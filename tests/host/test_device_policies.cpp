// The device policies beyond LRU (planning/device_plan/policies.hpp: DeviceLfru, DeviceCrf) run on the
// host with SequentialBlock against ForwardPlanner<Lfru> / ForwardPlanner<Crf>: after every
// forward, group, invalidation and prefetch the same hits, misses, fill and eviction lists,
// resident and forward maps, slot owners, free stack and counters, and the policy state itself
// (Lfru's freq/last/clock, Crf's CRF/last/clock). DeviceRuntimePolicy (the policy as a value of
// the state, for host planning) runs the same parity for each kind it can name. Kept apart from
// test_device_plan.cpp (LRU) so that each translation unit stays small.
#include <doctest/doctest.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "expert_cache/eviction/crf.hpp"
#include "expert_cache/eviction/lfru.hpp"
#include "expert_cache/eviction/lru.hpp"
#include "expert_cache/planning/device_plan.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "support/device_plan_support.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;

namespace {

template <class D>
struct HostOf;
template <>
struct HostOf<DeviceLru> {
  using type = Lru;
};
template <>
struct HostOf<DeviceLfru> {
  using type = Lfru;
};
template <>
struct HostOf<DeviceCrf> {
  using type = Crf;
};

// The policy state of the device equals the host policy's.
void check_policy(const Lfru& h, const DevicePlanState& s) {
  REQUIRE(s.scalars->tick - 1 == h.clock());  // Lfru's clock = ticks handed out
  for (std::int32_t slot = 0; slot < s.capacity; ++slot) {
    const std::int32_t e = s.slot_owner[slot];
    if (e < 0) continue;
    CHECK(s.slot_freq[slot] == h.freq(ExpertId(e)));
    CHECK(s.slot_tick[slot] == h.last(ExpertId(e)));
  }
  // Insertion order: the residents sorted by their insertion tick are Lfru's dict order.
  std::vector<std::pair<std::uint64_t, std::int32_t>> order;
  for (std::int32_t slot = 0; slot < s.capacity; ++slot) {
    if (s.slot_owner[slot] >= 0) order.emplace_back(s.slot_order[slot], s.slot_owner[slot]);
  }
  std::sort(order.begin(), order.end());
  Ids dev_order;
  for (const auto& [t, e] : order) dev_order.push_back(e);
  const auto ho = h.insertion_order();
  CHECK(dev_order == Ids(ho.begin(), ho.end()));
}
// LRU's recency order has no host-side mirror to compare; its parity (victims, maps, counters)
// is tests/host/test_device_plan.cpp's, and this file uses it for the budget case only.
void check_policy(const Lru&, const DevicePlanState&) {}
void check_policy(const Crf& h, const DevicePlanState& s) {
  REQUIRE(s.scalars->crf_clock == h.clock());
  for (std::int32_t e = 0; e < s.num_experts; ++e) {
    REQUIRE(s.expert_crf[e] == h.crf_q32(ExpertId(e)));
    REQUIRE(s.expert_last[e] == h.last(ExpertId(e)));
  }
}

// D: the device policy whose host twin plans alongside; Plan: the planning code's policy, D
// itself or DeviceRuntimePolicy holding D's kind in the state.
template <class D, class Plan = D>
struct Pair {
  using H = typename HostOf<D>::type;
  ForwardPlanner<H> host;
  HostPlanStorage dev;
  DevicePlanState view;  // dev's state, naming D's kind (read by DeviceRuntimePolicy only)
  SequentialBlock block;
  ForwardPlan plan;
  std::int64_t bad = 0, forwards = 0, prefetches = 0;
  bool forward_cleared = false;

  Pair(std::int32_t E, std::int32_t C, std::int32_t top_k, H policy, std::uint64_t crf_decay = crf_default_decay_q32)
      : host(CacheShape{E, C}, top_k, std::move(policy)), dev(E, C), view(dev.state()) {
    view.policy = D::kind;
    SequentialBlock b;
    reset_plan_state<Plan>(b, view, crf_decay);
  }

  void check_maps() {
    const DevicePlanState& s = dev.state();
    CHECK(to_vector(s.resident_map, s.num_experts) == Ids(host.resident_map().begin(), host.resident_map().end()));
    CHECK(to_vector(s.forward_map, s.num_experts) ==
          (forward_cleared ? Ids(static_cast<std::size_t>(s.num_experts), -1)
                           : Ids(host.forward_map().begin(), host.forward_map().end())));
    CHECK(to_vector(s.slot_owner, s.capacity) == Ids(host.slot_owner().begin(), host.slot_owner().end()));
    CHECK(to_vector(s.free_stack, s.scalars->free_count) == host.snapshot().free_slots);
    CHECK(to_vector(s.marks, s.num_experts) == std::vector<std::uint32_t>(static_cast<std::size_t>(s.num_experts), 0u));
    check_policy(host.policy(), s);
    const DevicePlanStats& st = *s.stats;
    CHECK(st.hits == host.counters().hits);
    CHECK(st.misses == host.counters().misses);
    CHECK(st.evictions == host.counters().evictions);
    CHECK(st.invalidations == host.counters().invalidations);
    CHECK(st.speculative_issued == host.counters().speculative_issued);
    CHECK(st.speculative_used == host.counters().speculative_used);
    CHECK(st.speculative_wasted == host.counters().speculative_wasted);
    CHECK(st.bad_ids == static_cast<std::uint64_t>(bad));
    CHECK(st.forwards == static_cast<std::uint64_t>(forwards));
    CHECK(st.prefetches == static_cast<std::uint64_t>(prefetches));
    CHECK(s.scalars->spec_live == host.speculative_count());
    CHECK((*s.error_word & plan_error_bad_state) == 0u);
  }

  void check_group() {
    const DevicePlanState& s = dev.state();
    const DevicePlanScalars& k = *s.scalars;
    REQUIRE(k.hits == static_cast<std::int32_t>(plan.hits));
    REQUIRE(k.misses == static_cast<std::int32_t>(plan.misses));
    REQUIRE(k.fill_count == static_cast<std::int32_t>(plan.fills.size()));
    REQUIRE(k.eviction_count == static_cast<std::int32_t>(plan.evictions.size()));
    CHECK(to_vector(s.fills, k.fill_count) == entries(plan.fills));
    CHECK(to_vector(s.evictions, k.eviction_count) == entries(plan.evictions));
    check_maps();
  }

  void step(const Ids& ids, std::int32_t max_groups) {
    const DevicePlanState& s = dev.state();
    const auto groups = host_groups(ids, s.num_experts, s.capacity);
    plan_forward<Plan>(block, view, ids.data(), static_cast<std::int32_t>(ids.size()));
    ++forwards;
    bad += count_bad(ids, s.num_experts);
    REQUIRE(s.scalars->group_count == static_cast<std::int32_t>(groups.size()));
    forward_cleared = false;
    if (groups.size() <= 1) {
      Ids valid;
      for (std::int32_t id : ids) {
        if (id == -1 || (id >= 0 && id < s.num_experts)) valid.push_back(id);
      }
      REQUIRE(host.plan_topk(valid, plan));
      check_group();
    } else {
      for (std::size_t g = 0; g < groups.size(); ++g) {
        if (g > 0) plan_group<Plan>(block, view, static_cast<std::int32_t>(g));
        REQUIRE(host.plan_unique(groups[g], plan));
        check_group();
      }
    }
    for (auto g = static_cast<std::int32_t>(groups.size()); g < max_groups; ++g) {
      plan_group<Plan>(block, view, g);  // an empty round: the policy state must not move
      forward_cleared = true;
      CHECK(s.scalars->fill_count == 0);
      check_maps();
    }
  }

  void invalidate(std::int32_t e) {
    plan_invalidate(block, view, e);
    auto r = host.invalidate(e);
    REQUIRE(r);
    CHECK(dev.state().scalars->last_invalidated_slot == r.value().value);
    check_maps();
  }

  void prefetch(const Ids& ids, std::int32_t max_fills, std::uint32_t expires_after, bool evict_last_forward = false) {
    const DevicePlanState& s = dev.state();
    PrefetchPlan hp;
    REQUIRE(host.plan_prefetch(ids, max_fills, expires_after, hp, evict_last_forward));
    plan_prefetch<Plan>(block, view, ids.data(), static_cast<std::int32_t>(ids.size()), max_fills, expires_after,
                        evict_last_forward);
    ++prefetches;
    const DevicePlanScalars& k = *s.scalars;
    REQUIRE(k.fill_count == static_cast<std::int32_t>(hp.fills.size()));
    REQUIRE(k.eviction_count == static_cast<std::int32_t>(hp.evictions.size()));
    CHECK(to_vector(s.fills, k.fill_count) == entries(hp.fills));
    CHECK(to_vector(s.evictions, k.eviction_count) == entries(hp.evictions));
    CHECK(k.prefetch_skipped_resident == static_cast<std::int32_t>(hp.skipped_resident));
    CHECK(k.prefetch_skipped_no_victim == static_cast<std::int32_t>(hp.skipped_no_victim));
    check_maps();
  }
};

Ids random_ids(std::mt19937_64& rng, std::int32_t E, std::int32_t top_k, std::int32_t tokens, double pad_p,
               double bad_p) {
  const std::int32_t bad_values[] = {E, INT32_MAX, INT32_MIN, -2};
  return random_plan_ids(rng, E, top_k, tokens, pad_p, bad_p, bad_values);
}

struct Config {
  std::int32_t E, C, top_k, max_tokens;
};
constexpr Config configs[] = {
    {8, 4, 2, 3}, {16, 6, 2, 4}, {64, 16, 4, 8}, {64, 64, 8, 4}, {32, 4, 4, 3}, {512, 208, 10, 24}, {300, 37, 6, 12},
    {128, 10, 10, 2},
};

// Evictions of the pair's last prefetch whose victim the last forward's map still names.
template <class P>
std::uint64_t last_forward_evictions(const P& p) {
  const DevicePlanState& s = p.dev.state();
  std::uint64_t n = 0;
  for (std::int32_t i = 0; i < s.scalars->eviction_count; ++i) {
    const std::int32_t victim = s.evictions[i].expert;
    if (!p.forward_cleared && victim >= 0 && victim < s.num_experts && s.forward_map[victim] >= 0) ++n;
  }
  return n;
}

// Random forwards (small and general path, overflow groups, padding, bad ids), invalidations and
// prefetches; `policy` builds each run's host policy (fresh state).
template <class D, class Plan = D, class MakePolicy>
void random_parity(MakePolicy policy, std::uint64_t seed, bool with_prefetch, std::uint64_t clock0 = 0,
                   std::uint64_t crf_decay = crf_default_decay_q32) {
  std::uint64_t evictions = 0, overflows = 0, spec_used = 0, spec_wasted = 0, no_victim = 0, last_forward_victims = 0;
  for (const Config& c : configs) {
    for (int rep = 0; rep < 2; ++rep) {
      CAPTURE(c.E);
      CAPTURE(c.C);
      CAPTURE(rep);
      std::mt19937_64 rng(seed++);
      Pair<D, Plan> p(c.E, c.C, c.top_k, policy(CacheShape{c.E, c.C}), crf_decay);
      if (clock0 != 0) p.dev.state().scalars->tick = clock0 + 1;  // Lfru's clock = tick - 1
      const std::int32_t max_groups = plan_max_groups(static_cast<std::int64_t>(c.max_tokens) * c.top_k, c.E, c.C);
      for (int step = 0; step < 120; ++step) {
        CAPTURE(step);
        const auto tokens = static_cast<std::int32_t>(1 + rng() % static_cast<std::uint64_t>(c.max_tokens));
        const double pad = step % 29 == 0 ? 1.0 : (rep == 1 ? 0.2 : 0.02);
        p.step(random_ids(rng, c.E, c.top_k, tokens, pad, rep == 1 ? 0.03 : 0.0), max_groups);
        if (with_prefetch) {
          for (int k = static_cast<int>(rng() % 3); k > 0; --k) {
            Ids pred;
            const auto n = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(2 * c.top_k + 2));
            // One rng() call per statement: the order of the draws is the program's, not the compiler's
            // (operands of % and function arguments are unsequenced).
            for (std::int32_t i = 0; i < n; ++i) {
              const std::uint64_t draw = rng();
              const std::uint64_t wide = rng() % 3;
              pred.push_back(static_cast<std::int32_t>(draw % static_cast<std::uint64_t>(wide == 0 ? c.E : std::max(1, c.E / 8))));
            }
            const auto max_fills = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.top_k + 2));
            const auto expires = static_cast<std::uint32_t>(1 + rng() % 3);
            // Half the prefetches may evict the last forward's residents (PrefetchOptions::evict_last_forward).
            const bool evict_last = rng() % 2 == 0;
            p.prefetch(pred, max_fills, expires, evict_last);
            last_forward_victims += evict_last ? last_forward_evictions(p) : 0;
            no_victim += static_cast<std::uint64_t>(p.dev.state().scalars->prefetch_skipped_no_victim);
          }
        }
        if (rng() % 9 == 0) p.invalidate(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E)));
      }
      evictions += p.dev.state().stats->evictions;
      overflows += p.dev.state().stats->overflows;
      spec_used += p.dev.state().stats->speculative_used;
      spec_wasted += p.dev.state().stats->speculative_wasted;
    }
  }
  MESSAGE(std::string(D::name), " (", std::string(Plan::name), "): evictions ", evictions, ", overflowing forwards ", overflows, ", speculative used ", spec_used,
          ", wasted ", spec_wasted, ", skipped (no victim) ", no_victim, ", last-forward victims ", last_forward_victims);
  CHECK(evictions > 5000);
  CHECK(overflows > 50);
  if (with_prefetch) {
    CHECK(spec_used > 100);
    CHECK(spec_wasted > 100);
    CHECK(no_victim > 0);
    CHECK(last_forward_victims > 50);  // the flag's branch ran, and both planners took it alike
  }
}

}  // namespace

TEST_CASE("device LFRU equals ForwardPlanner<Lfru> step by step (forwards, groups, invalidations)") {
  random_parity<DeviceLfru>([](CacheShape s) { return Lfru(s); }, 101, false);
}

TEST_CASE("device LFRU equals ForwardPlanner<Lfru> with prefetch") {
  random_parity<DeviceLfru>([](CacheShape s) { return Lfru(s); }, 202, true);
}

TEST_CASE("device LFRU equals Lfru on its double path (clock >= 2^25)") {
  constexpr std::uint64_t clock0 = (std::uint64_t{1} << 25) - 50;  // crosses the limit within a run
  random_parity<DeviceLfru>(
      [](CacheShape s) {
        Lfru l(s);
        l.set_clock_for_testing(clock0);
        return l;
      },
      303, true, clock0);
}

TEST_CASE("device Crf equals ForwardPlanner<Crf> step by step (forwards, groups, invalidations, prefetch)") {
  random_parity<DeviceCrf>([](CacheShape s) { return Crf(s); }, 404, false);
  random_parity<DeviceCrf>([](CacheShape s) { return Crf(s); }, 505, true);
}

TEST_CASE("device Crf equals ForwardPlanner<Crf> at other half-lives (the state's decay, Crf's CrfParams)") {
  for (const double half_life : {1.0, 3.0, 16.0, 32.0, 1000.0}) {
    CAPTURE(half_life);
    const std::uint64_t decay = crf_decay_for_half_life(half_life);
    random_parity<DeviceCrf>([decay](CacheShape s) { return Crf(s, CrfParams{decay}); }, 606, half_life == 16.0, 0, decay);
  }
}

// A budget above the capacity: the list fills every slot, then its last id finds no victim (all
// slots hold this call's fills) and is counted as skipped, by the host and the device alike.
template <class D>
void prefetch_budget_above_capacity() {
  Pair<D> p(32, 4, 2, typename HostOf<D>::type(CacheShape{32, 4}));
  p.prefetch(Ids{1, 2, 3, 24, 0}, 5, 1);
  CHECK(p.dev.state().scalars->fill_count == 4);
  CHECK(p.dev.state().scalars->prefetch_skipped_no_victim == 1);
}

TEST_CASE("device policies: a prefetch budget above the capacity counts the ids left without a victim") {
  prefetch_budget_above_capacity<DeviceLru>();
  prefetch_budget_above_capacity<DeviceLfru>();
  prefetch_budget_above_capacity<DeviceCrf>();
}

TEST_CASE("device Crf with a prior bias (pins and weights) equals Crf with the same bias") {
  std::mt19937_64 rng(606);
  std::vector<std::vector<std::uint64_t>> biases;
  auto make = [&](CacheShape s) {
    std::vector<std::uint64_t> bias(static_cast<std::size_t>(s.num_experts), 0);
    for (auto& b : bias) {
      const std::uint64_t r = rng() % 10;
      b = r == 0 ? crf_pin_bias : (r < 4 ? (rng() % 8) * crf_one : 0);
    }
    biases.push_back(bias);
    return Crf(s, CrfParams{}, bias);
  };
  for (const Config& c : configs) {
    CAPTURE(c.E);
    CAPTURE(c.C);
    std::mt19937_64 r2(rng());
    Pair<DeviceCrf> p(c.E, c.C, c.top_k, make(CacheShape{c.E, c.C}));
    REQUIRE(plan_set_bias(p.dev.state(), biases.back().data(), c.E));
    const std::int32_t max_groups = plan_max_groups(static_cast<std::int64_t>(c.max_tokens) * c.top_k, c.E, c.C);
    for (int step = 0; step < 150; ++step) {
      const auto tokens = static_cast<std::int32_t>(1 + r2() % static_cast<std::uint64_t>(c.max_tokens));
      p.step(random_ids(r2, c.E, c.top_k, tokens, 0.02, 0.0), max_groups);
      if (r2() % 7 == 0) p.prefetch(random_ids(r2, c.E, 1, c.top_k, 0.0, 0.0), c.top_k, 2);
    }
  }
}

// (experts, capacity) of the whole-state comparisons below. Their loops name the two values
// instead of binding them: CAPTURE's lambda captures them (clang before 16 refuses bindings).
constexpr std::pair<std::int32_t, std::int32_t> compared_shapes[] = {{64, 16}, {512, 208}, {32, 5}, {300, 3}};

TEST_CASE("device policies: the small and the general path leave identical states") {
  auto run = [](auto policy_tag) {
    using D = decltype(policy_tag);
    std::mt19937_64 rng(4343);
    for (const auto& shape : compared_shapes) {
      const std::int32_t E = shape.first, C = shape.second;
      CAPTURE(E);
      CAPTURE(C);
      HostPlanStorage a(E, C), g(E, C);
      SequentialBlock b;
      reset_plan_state<D>(b, a.state());
      reset_plan_state<D>(b, g.state());
      for (int step = 0; step < 1500; ++step) {
        const auto n = static_cast<std::int32_t>(rng() % (plan_small_ids + 1));
        Ids ids(static_cast<std::size_t>(n));
        for (auto& id : ids) {
          const std::uint64_t r = rng() % 100;
          id = r < 5 ? -1
                     : static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(r < 60 ? std::max(1, E / 8) : E));
        }
        plan_forward_small<D>(b, a.state(), ids.data(), n);
        plan_forward_general<D>(b, g.state(), ids.data(), n);
        for (std::int32_t k = 1; k < g.state().scalars->group_count; ++k) {
          plan_group<D>(b, a.state(), k);
          plan_group<D>(b, g.state(), k);
        }
        REQUIRE(std::memcmp(a.block(), g.block(), a.bytes()) == 0);
      }
      CHECK(a.state().stats->evictions > 0);
    }
  };
  run(DeviceLfru{});
  run(DeviceCrf{});
}

TEST_CASE("DeviceRuntimePolicy equals the host planner of the policy its state names") {
  random_parity<DeviceLru, DeviceRuntimePolicy>([](CacheShape s) { return Lru(s); }, 606, true);
  random_parity<DeviceLfru, DeviceRuntimePolicy>([](CacheShape s) { return Lfru(s); }, 202, true);
  random_parity<DeviceCrf, DeviceRuntimePolicy>([](CacheShape s) { return Crf(s); }, 505, true);
}

// Beyond the parity above: the whole block (every array, scalar and counter) equals the static
// policy's after each step, forwards on both paths, overflow groups, prefetches, invalidations.
TEST_CASE("DeviceRuntimePolicy leaves the static policy's state byte for byte") {
  auto run = [](auto policy_tag) {
    using D = decltype(policy_tag);
    CAPTURE(D::name);
    std::mt19937_64 rng(7171);
    for (const auto& shape : compared_shapes) {
      const std::int32_t E = shape.first, C = shape.second;
      CAPTURE(E);
      CAPTURE(C);
      HostPlanStorage a(E, C), r(E, C);
      DevicePlanState rs = r.state();
      rs.policy = D::kind;
      SequentialBlock b;
      reset_plan_state<D>(b, a.state());
      reset_plan_state<DeviceRuntimePolicy>(b, rs);
      REQUIRE(std::memcmp(a.block(), r.block(), a.bytes()) == 0);
      for (int step = 0; step < 600; ++step) {
        const auto n = static_cast<std::int32_t>(rng() % (step % 5 == 0 ? 4 * plan_small_ids : plan_small_ids + 1));
        Ids ids(static_cast<std::size_t>(n));
        for (auto& id : ids) {
          const std::uint64_t x = rng() % 100;
          id = x < 5 ? -1 : static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(x < 60 ? std::max(1, E / 8) : E));
        }
        plan_forward<D>(b, a.state(), ids.data(), n);
        plan_forward<DeviceRuntimePolicy>(b, rs, ids.data(), n);
        for (std::int32_t k = 1; k < a.state().scalars->group_count; ++k) {
          plan_group<D>(b, a.state(), k);
          plan_group<DeviceRuntimePolicy>(b, rs, k);
        }
        if (rng() % 4 == 0) {
          Ids pred(static_cast<std::size_t>(1 + rng() % 6));
          for (auto& id : pred) id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(E));
          const auto fills = static_cast<std::int32_t>(rng() % 4);
          plan_prefetch<D>(b, a.state(), pred.data(), static_cast<std::int32_t>(pred.size()), fills, 2);
          plan_prefetch<DeviceRuntimePolicy>(b, rs, pred.data(), static_cast<std::int32_t>(pred.size()), fills, 2);
        }
        if (rng() % 11 == 0) {
          const auto e = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(E));
          plan_invalidate(b, a.state(), e);
          plan_invalidate(b, rs, e);
        }
        REQUIRE(std::memcmp(a.block(), r.block(), a.bytes()) == 0);
        REQUIRE(*a.state().stats == *rs.stats);
        REQUIRE(*a.state().error_word == *rs.error_word);
      }
      CHECK(a.state().stats->evictions > 0);
      CHECK(a.state().stats->speculative_issued > 0);
    }
  };
  run(DeviceLru{});
  run(DeviceLfru{});
  run(DeviceCrf{});
}

TEST_CASE("device Crf: a bad bias table is refused and changes nothing") {
  HostPlanStorage dev(16, 4);
  SequentialBlock b;
  reset_plan_state<DeviceCrf>(b, dev.state());
  const std::vector<std::uint64_t> bias(16, crf_one);
  REQUIRE(plan_set_bias(dev.state(), bias.data(), 16));
  const std::vector<std::uint8_t> before(static_cast<const std::uint8_t*>(dev.block()),
                                         static_cast<const std::uint8_t*>(dev.block()) + dev.bytes());
  CHECK_FALSE(plan_set_bias(dev.state(), bias.data(), 15));   // wrong length
  CHECK_FALSE(plan_set_bias(dev.state(), nullptr, 16));       // no table
  const std::vector<std::uint8_t> after(static_cast<const std::uint8_t*>(dev.block()),
                                        static_cast<const std::uint8_t*>(dev.block()) + dev.bytes());
  CHECK(before == after);
  CHECK(dev.state().expert_bias[3] == crf_one);
}

TEST_CASE("Crf: hand-computed victims, decay and bias") {
  // d^8 = 1/2 (half-life 8), up to the Q32 truncations.
  CHECK(static_cast<double>(crf_decay_pow(crf_default_decay_q32, 8)) / 4294967296.0 == doctest::Approx(0.5).epsilon(1e-8));
  CHECK(crf_decay_pow(crf_default_decay_q32, 0) == crf_one);
  CHECK(crf_decay_pow(crf_default_decay_q32, 100000) == 0u);
  // Forwards {0}, {1}, {0}, {2} with two slots: at the miss on 2, expert 0 (two requests) has
  // CRF (d^2 + 1) d, expert 1 (one, more recent) d^2: 1 is the victim.
  for (const bool pin_one : {false, true}) {
    CAPTURE(pin_one);
    std::vector<std::uint64_t> bias(4, 0);
    if (pin_one) bias[1] = crf_pin_bias;  // pinned: 0 goes instead
    const CacheShape shape{4, 2};
    ForwardPlanner<Crf> p(shape, 1, Crf(shape, CrfParams{}, bias));
    ForwardPlan plan;
    for (const std::int32_t e : {0, 1, 0}) REQUIRE(p.plan_topk(std::vector<std::int32_t>{e}, plan));
    const double d = static_cast<double>(crf_default_decay_q32) / 4294967296.0;
    CHECK(static_cast<double>(p.policy().key(0)) / 4294967296.0 == doctest::Approx(1.0 + d * d).epsilon(1e-8));
    REQUIRE(p.plan_topk(std::vector<std::int32_t>{2}, plan));
    REQUIRE(plan.evictions.size() == 1);
    CHECK(plan.evictions[0].expert.value == (pin_one ? 0 : 1));
    CHECK(p.policy().clock() == 4u);
  }
}
