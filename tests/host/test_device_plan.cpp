// The device planning code (planning/device_plan.hpp) run on the host with SequentialBlock,
// against ForwardPlanner<Lru>: after every step the same hits, misses, fill and eviction lists,
// resident map, forward map, slot owners and free stack. Overflowing forwards are compared with
// the host's expert split (plan_unique on ascending groups of <= capacity ids).
#include <doctest/doctest.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "expert_cache/eviction/lru.hpp"
#include "expert_cache/planning/device_plan.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/planning/split.hpp"
#include "support/device_plan_support.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;

namespace {

// Everything observable of the device state equals the host planner after `plan`.
void check_same(const ForwardPlanner<Lru>& host, const ForwardPlan& plan, const DevicePlanState& s) {
  const DevicePlanScalars& k = *s.scalars;
  const auto E = s.num_experts, C = s.capacity;
  REQUIRE(k.hits == static_cast<std::int32_t>(plan.hits));
  REQUIRE(k.misses == static_cast<std::int32_t>(plan.misses));
  REQUIRE(k.fill_count == static_cast<std::int32_t>(plan.fills.size()));
  REQUIRE(k.eviction_count == static_cast<std::int32_t>(plan.evictions.size()));
  CHECK(to_vector(s.fills, k.fill_count) == entries(plan.fills));
  CHECK(to_vector(s.evictions, k.eviction_count) == entries(plan.evictions));
  Ids unique;
  for (ExpertId e : plan.unique) unique.push_back(e.value);
  CHECK(k.group_size == static_cast<std::int32_t>(unique.size()));
  CHECK(to_vector(s.prev_forward, k.prev_count) == unique);
  CHECK(to_vector(s.resident_map, E) == Ids(host.resident_map().begin(), host.resident_map().end()));
  CHECK(to_vector(s.forward_map, E) == Ids(host.forward_map().begin(), host.forward_map().end()));
  CHECK(to_vector(s.slot_owner, C) == Ids(host.slot_owner().begin(), host.slot_owner().end()));
  CHECK(to_vector(s.free_stack, k.free_count) == host.snapshot().free_slots);
  CHECK(to_vector(s.marks, E) == std::vector<std::uint32_t>(static_cast<std::size_t>(E), 0u));
}

// One forward through both planners; device groups beyond group_count up to `max_groups` must
// be empty and change nothing but the forward map (cleared).
struct Pair {
  ForwardPlanner<Lru> host;
  HostPlanStorage dev;
  SequentialBlock block;
  ForwardPlan plan;
  std::int64_t bad = 0, overflows = 0, overflow_groups = 0, forwards = 0, prefetches = 0;
  std::int64_t flagged_overflows = 0;  // overflows not declared in rounds (plan_error_overflow)
  bool forward_cleared = false;  // an empty device group ran after the host's last group

  Pair(std::int32_t E, std::int32_t C, std::int32_t top_k) : host(CacheShape{E, C}, top_k), dev(E, C) {}

  // in_rounds: the forward is declared served in rounds (DevicePlanState::forward_in_rounds, a
  // copy of the state for this launch only), so its groups list the residents first, `width`
  // experts each (0: the capacity).
  void step(const Ids& ids, std::int32_t max_groups = 0, bool in_rounds = false, std::int32_t width = 0) {
    const DevicePlanState& s = dev.state();
    const std::int32_t w = in_rounds && width > 0 && width < s.capacity ? width : s.capacity;
    const auto groups = in_rounds ? host_groups_residents_first(ids, host.resident_map(), w)
                                  : host_groups(ids, s.num_experts, s.capacity);
    Ids sanitized(ids.size(), 12345);
    DevicePlanState launch = s;
    launch.forward_in_rounds = in_rounds;
    launch.round_width = in_rounds ? width : 0;
    plan_forward(block, launch, ids.data(), static_cast<std::int32_t>(ids.size()), sanitized.data());
    ++forwards;
    bad += count_bad(ids, s.num_experts);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const bool valid = ids[i] >= 0 && ids[i] < s.num_experts;
      REQUIRE(sanitized[i] == (valid ? ids[i] : -1));
    }
    REQUIRE(s.scalars->group_count == static_cast<std::int32_t>(groups.size()));
    REQUIRE(s.scalars->group_width == w);
    std::size_t unique = 0;
    for (const Ids& g : groups) unique += g.size();
    if (unique > static_cast<std::size_t>(s.capacity)) {  // an overflow (not merely narrow rounds)
      ++overflows;
      overflow_groups += static_cast<std::int64_t>(groups.size()) - 1;
      if (!in_rounds) ++flagged_overflows;
    }
    if (groups.size() <= 1 && !in_rounds) {
      // The common path: plan_topk on the raw ids (bad ids removed; the host rejects them).
      Ids valid;
      for (std::int32_t id : ids) {
        if (id == -1 || (id >= 0 && id < s.num_experts)) valid.push_back(id);
      }
      REQUIRE(host.plan_topk(valid, plan));
      check_same(host, plan, s);
    } else {
      for (std::size_t g = 0; g < groups.size(); ++g) {
        if (g > 0) plan_group(block, s, static_cast<std::int32_t>(g));
        REQUIRE(host.plan_unique(groups[g], plan));
        check_same(host, plan, s);
      }
      if (groups.empty()) {  // an empty forward in rounds: the host plans an empty list
        REQUIRE(host.plan_unique(std::span<const std::int32_t>(), plan));
        check_same(host, plan, s);
      }
    }
    forward_cleared = false;
    for (auto g = static_cast<std::int32_t>(groups.size()); g < max_groups; ++g) {
      plan_group(block, s, g);
      forward_cleared = true;
      plan.clear();
      // The host has no empty group: its maps are the last group's minus the forward map.
      CHECK(s.scalars->fill_count == 0);
      CHECK(s.scalars->group_size == 0);
      CHECK(to_vector(s.forward_map, s.num_experts) == Ids(static_cast<std::size_t>(s.num_experts), -1));
      CHECK(to_vector(s.resident_map, s.num_experts) ==
            Ids(host.resident_map().begin(), host.resident_map().end()));
    }
    check_stats();
  }

  void invalidate(std::int32_t e) {
    const DevicePlanState& s = dev.state();
    plan_invalidate(block, s, e);
    if (e < 0 || e >= s.num_experts) {
      ++bad;
      CHECK(s.scalars->last_invalidated_slot == -1);
    } else {
      auto r = host.invalidate(e);
      REQUIRE(r);
      CHECK(s.scalars->last_invalidated_slot == r.value().value);
    }
    CHECK(to_vector(s.resident_map, s.num_experts) == Ids(host.resident_map().begin(), host.resident_map().end()));
    CHECK(to_vector(s.forward_map, s.num_experts) ==
          (forward_cleared ? Ids(static_cast<std::size_t>(s.num_experts), -1)
                           : Ids(host.forward_map().begin(), host.forward_map().end())));
    CHECK(to_vector(s.slot_owner, s.capacity) == Ids(host.slot_owner().begin(), host.slot_owner().end()));
    CHECK(to_vector(s.free_stack, s.scalars->free_count) == host.snapshot().free_slots);
    check_stats();
  }

  // plan_prefetch of valid ids (the host refuses others) through both planners.
  void prefetch(const Ids& ids, std::int32_t max_fills, std::uint32_t expires_after) {
    const DevicePlanState& s = dev.state();
    PrefetchPlan hp;
    REQUIRE(host.plan_prefetch(ids, max_fills, expires_after, hp));
    plan_prefetch(block, s, ids.data(), static_cast<std::int32_t>(ids.size()), max_fills, expires_after);
    ++prefetches;
    const DevicePlanScalars& k = *s.scalars;
    REQUIRE(k.fill_count == static_cast<std::int32_t>(hp.fills.size()));
    REQUIRE(k.eviction_count == static_cast<std::int32_t>(hp.evictions.size()));
    CHECK(to_vector(s.fills, k.fill_count) == entries(hp.fills));
    CHECK(to_vector(s.evictions, k.eviction_count) == entries(hp.evictions));
    CHECK(k.prefetch_skipped_resident == static_cast<std::int32_t>(hp.skipped_resident));
    CHECK(k.prefetch_skipped_no_victim == static_cast<std::int32_t>(hp.skipped_no_victim));
    CHECK(k.spec_live == host.speculative_count());
    for (std::int32_t slot = 0; slot < s.capacity; ++slot) {
      const std::int32_t owner = s.slot_owner[slot];
      CHECK((s.slot_spec_left[slot] != 0) == (owner >= 0 && host.is_speculative(owner)));
    }
    CHECK(to_vector(s.resident_map, s.num_experts) == Ids(host.resident_map().begin(), host.resident_map().end()));
    // The forward map is the current forward's readers': untouched.
    CHECK(to_vector(s.forward_map, s.num_experts) ==
          (forward_cleared ? Ids(static_cast<std::size_t>(s.num_experts), -1)
                           : Ids(host.forward_map().begin(), host.forward_map().end())));
    CHECK(to_vector(s.slot_owner, s.capacity) == Ids(host.slot_owner().begin(), host.slot_owner().end()));
    CHECK(to_vector(s.free_stack, k.free_count) == host.snapshot().free_slots);
    CHECK(to_vector(s.marks, s.num_experts) == std::vector<std::uint32_t>(static_cast<std::size_t>(s.num_experts), 0u));
    check_stats();
  }

  void check_stats() const {
    const DevicePlanStats& st = *dev.state().stats;
    CHECK(st.prefetches == static_cast<std::uint64_t>(prefetches));
    CHECK(st.speculative_issued == host.counters().speculative_issued);
    CHECK(st.speculative_used == host.counters().speculative_used);
    CHECK(st.speculative_wasted == host.counters().speculative_wasted);
    CHECK(dev.state().scalars->spec_live == host.speculative_count());
    CHECK(st.hits == host.counters().hits);
    CHECK(st.misses == host.counters().misses);
    CHECK(st.evictions == host.counters().evictions);
    CHECK(st.invalidations == host.counters().invalidations);
    CHECK(st.bad_ids == static_cast<std::uint64_t>(bad));
    CHECK(st.overflows == static_cast<std::uint64_t>(overflows));
    CHECK(st.overflow_groups == static_cast<std::uint64_t>(overflow_groups));
    CHECK(st.forwards == static_cast<std::uint64_t>(forwards));
    const std::uint32_t want = (bad > 0 ? plan_error_bad_id : 0u) | (flagged_overflows > 0 ? plan_error_overflow : 0u);
    CHECK(*dev.state().error_word == want);
  }
};

// Router-like ids: each token picks top_k distinct experts, half from a small hot set.
// The fixture sits in tests/data/, beside this source's folder; __FILE__ is absolute or relative to the
// build directory, where meson runs the tests. EXPERT_CACHE_TEST_DATA overrides the folder.
std::string fixture_path() {
  if (const char* dir = std::getenv("EXPERT_CACHE_TEST_DATA")) return std::string(dir) + "/device_plan_fixture.txt";
  std::string here = __FILE__;
  const auto slash = here.find_last_of('/');
  here = slash == std::string::npos ? std::string(".") : here.substr(0, slash);
  return here + "/../data/device_plan_fixture.txt";
}

Ids random_ids(std::mt19937_64& rng, std::int32_t E, std::int32_t top_k, std::int32_t tokens, double pad_p,
               double bad_p) {
  const std::int32_t bad_values[] = {E, E + 1, INT32_MAX, INT32_MIN, -2, -1000};
  return random_plan_ids(rng, E, top_k, tokens, pad_p, bad_p, bad_values);
}

}  // namespace

TEST_CASE("device plan: random traces equal ForwardPlanner<Lru> step by step") {
  struct Config {
    std::int32_t E, C, top_k, max_tokens;
  };
  const Config configs[] = {
      {8, 4, 2, 3},     {16, 6, 2, 4},   {64, 16, 4, 8},  {64, 64, 8, 10},  // capacity == E
      {32, 4, 4, 3},    {512, 208, 10, 4}, {512, 208, 10, 32}, {300, 37, 6, 12}, {1, 1, 1, 2},
      {128, 10, 10, 2},  // capacity == top_k
  };
  std::uint64_t seed = 1, evictions = 0, overflows = 0, bad = 0, invalidations = 0;
  for (const Config& c : configs) {
    for (int rep = 0; rep < 3; ++rep) {
      CAPTURE(c.E);
      CAPTURE(c.C);
      CAPTURE(c.top_k);
      CAPTURE(rep);
      std::mt19937_64 rng(seed++);
      Pair p(c.E, c.C, c.top_k);
      const std::int32_t max_groups = plan_max_groups(static_cast<std::int64_t>(c.max_tokens) * c.top_k, c.E, c.C);
      for (int step = 0; step < 150; ++step) {
        CAPTURE(step);
        const auto tokens = static_cast<std::int32_t>(1 + rng() % static_cast<std::uint64_t>(c.max_tokens));
        p.step(random_ids(rng, c.E, c.top_k, tokens, rep == 1 ? 0.2 : 0.02, rep == 2 ? 0.05 : 0.0), max_groups);
        if (rng() % 8 == 0) p.invalidate(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E)));
      }
      evictions += p.dev.state().stats->evictions;
      overflows += p.dev.state().stats->overflows;
      bad += p.dev.state().stats->bad_ids;
      invalidations += p.dev.state().stats->invalidations;
    }
  }
  // The traces exercise every path, not just hits.
  MESSAGE("evictions ", evictions, ", overflowing forwards ", overflows, ", bad ids ", bad, ", invalidations ",
          invalidations);
  CHECK(evictions > 10000);
  CHECK(overflows > 100);
  CHECK(bad > 100);
  CHECK(invalidations > 100);
}

TEST_CASE("device plan: committed fixture (tests/data/device_plan_fixture.txt)") {
  std::ifstream in(fixture_path());
  INFO("fixture: ", fixture_path());
  REQUIRE(in.good());
  std::string line;
  std::int32_t E = 0, C = 0, top_k = 0;
  while (std::getline(in, line) && line.rfind("shape", 0) != 0) {}
  REQUIRE(std::sscanf(line.c_str(), "shape %d %d %d", &E, &C, &top_k) == 3);
  Pair p(E, C, top_k);
  const DevicePlanState& s = p.dev.state();
  auto parse_pairs = [](std::istringstream& is) {
    std::vector<PlanEntry> v;
    std::string tok;
    while (is >> tok && tok != "|") {
      if (tok == "-") continue;
      const auto colon = tok.find(':');
      v.push_back({std::stoi(tok.substr(0, colon)), std::stoi(tok.substr(colon + 1))});
    }
    return v;
  };
  int steps = 0, groups_seen = 0, line_no = 3;
  std::vector<std::int32_t> planned_group;  // device group index of the next "group" line
  Ids ids;
  while (std::getline(in, line)) {
    ++line_no;
    CAPTURE(line_no);
    std::istringstream is(line);
    std::string kind;
    is >> kind;
    if (kind == "invalidate") {
      std::int32_t e = 0;
      is >> e;
      p.invalidate(e);
    } else if (kind == "step") {
      ids.clear();
      for (std::int32_t id; is >> id;) ids.push_back(id);
      p.step(ids, plan_max_groups(static_cast<std::int64_t>(ids.size()), E, C));
      ++steps;
      // Pair::step left the device after its last non-empty group; replay the groups on a
      // second device state to check each group line against the fixture.
    } else if (kind == "group") {
      ++groups_seen;
    }
  }
  CHECK(steps == 40);
  CHECK(groups_seen >= 42);

  // Second pass: the device state alone against the fixture's expectations, group by group.
  std::ifstream in2(fixture_path());
  HostPlanStorage dev(E, C);
  const DevicePlanState& d = dev.state();
  SequentialBlock b;
  std::uint64_t bad_expected = 0;
  while (std::getline(in2, line)) {
    std::istringstream is(line);
    std::string kind;
    is >> kind;
    if (kind == "invalidate") {
      std::int32_t e = 0;
      is >> e;
      plan_invalidate(b, d, e);
    } else if (kind == "step") {
      ids.clear();
      for (std::int32_t id; is >> id;) ids.push_back(id);
      bad_expected += static_cast<std::uint64_t>(count_bad(ids, E));
      plan_forward(b, d, ids.data(), static_cast<std::int32_t>(ids.size()));
    } else if (kind == "group") {
      CAPTURE(line);
      std::int32_t g = 0, hits = 0, misses = 0;
      is >> g >> hits >> misses;
      if (g > 0) plan_group(b, d, g);
      const auto fills = parse_pairs(is);
      const auto evictions = parse_pairs(is);
      CHECK(d.scalars->hits == hits);
      CHECK(d.scalars->misses == misses);
      CHECK(to_vector(d.fills, d.scalars->fill_count) == fills);
      CHECK(to_vector(d.evictions, d.scalars->eviction_count) == evictions);
    }
  }
  CHECK(d.stats->bad_ids == bad_expected);
  CHECK(bad_expected == 3);
  CHECK(d.stats->overflows == 3);
  (void)s;
}

TEST_CASE("device plan: padding, duplicates and an empty forward") {
  Pair p(16, 4, 2);
  p.step({-1, -1});
  CHECK(p.dev.state().scalars->group_count == 0);
  p.step({3, 3, 3, -1, 7, 3});
  CHECK(p.dev.state().scalars->fill_count == 2);
  CHECK(p.dev.state().fills[0] == PlanEntry{3, 0});  // slot 0 first (lowest_first)
  CHECK(p.dev.state().fills[1] == PlanEntry{7, 1});
  p.step({7, 3, 7, 3});
  CHECK(p.dev.state().scalars->hits == 2);
  p.step({});
  CHECK(p.dev.state().forward_map[3] == -1);
  CHECK(p.dev.state().resident_map[3] == 0);
  CHECK(*p.dev.state().error_word == 0);
}

TEST_CASE("device plan: bad ids are counted, dropped, never indexed") {
  Pair p(16, 4, 2);
  const Ids ids = {16, 2, INT32_MAX, INT32_MIN, -1, -2, 5, 17, 2};
  p.step(ids);
  const DevicePlanState& s = p.dev.state();
  CHECK(s.scalars->bad_ids == 5);
  CHECK(s.stats->bad_ids == 5);
  CHECK((*s.error_word & plan_error_bad_id) != 0);
  CHECK(s.scalars->misses == 2);
  CHECK(s.resident_map[2] == 0);
  CHECK(s.resident_map[5] == 1);
  // Sanitized in place: the consumer then indexes the forward map with -1 or a valid id only.
  Ids in_place = ids;
  plan_forward(p.block, s, in_place.data(), static_cast<std::int32_t>(in_place.size()), in_place.data());
  CHECK(in_place == Ids{-1, 2, -1, -1, -1, -1, 5, -1, 2});
  // Invalidate with an out-of-range id: counted, nothing else changes.
  const auto before = to_vector(s.resident_map, 16);
  plan_invalidate(p.block, s, 99);
  plan_invalidate(p.block, s, INT32_MIN);
  CHECK(s.stats->bad_ids == 12);
  CHECK(to_vector(s.resident_map, 16) == before);
}

TEST_CASE("device plan: overflow is planned as ascending groups and counted") {
  Pair p(16, 4, 2);
  p.step({0, 1, 2, 3});  // fill the cache: slots 0..3
  // 10 unique ids with capacity 4: groups {0,1,2,3} {4,5,6,7} {8,9}, as the host's expert split.
  const Ids ids = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 9, 0};
  auto split = plan_expert_groups(ids, 2, 4, 16);
  REQUIRE(split);
  REQUIRE(split.value().size() == 3);
  CHECK(host_groups(ids, 16, 4)[1] == split.value()[1].unique_ids);
  p.step(ids, plan_max_groups(static_cast<std::int64_t>(ids.size()), 16, 4));
  const DevicePlanState& s = p.dev.state();
  CHECK(s.scalars->group_count == 3);
  CHECK(s.stats->overflows == 1);
  CHECK(s.stats->overflow_groups == 2);
  CHECK((*s.error_word & plan_error_overflow) != 0);
  // The last group {8, 9} evicted group 1's least recent residents; group 0 hit everything.
  CHECK(s.stats->hits == 4);
  CHECK(s.stats->misses == 4 + 6);
  CHECK(s.resident_map[8] >= 0);
  CHECK(s.resident_map[9] >= 0);
  // Every unique expert (16) at capacity 16: one group, no overflow.
  Pair q(16, 16, 2);
  Ids all;
  for (int e = 15; e >= 0; --e) all.push_back(e);
  q.step(all);
  CHECK(q.dev.state().scalars->group_count == 1);
  CHECK(q.dev.state().stats->overflows == 0);
}

TEST_CASE("device plan: a forward in rounds lists the residents first and fills no expert twice") {
  // Slots hold 10..13 (LRU order 10 oldest); the forward needs 0..5 and 10..13 at capacity 4.
  const Ids ids = {0, 1, 2, 3, 4, 5, 10, 11, 12, 13};
  const auto run = [&](bool in_rounds) {
    Pair p(16, 4, 2);
    p.step({10, 11, 12, 13});
    const std::uint64_t misses0 = p.dev.state().stats->misses;
    p.step(ids, plan_max_groups(static_cast<std::int64_t>(ids.size()), 16, 4), in_rounds);
    const DevicePlanState& s = p.dev.state();
    CHECK(s.scalars->group_count == 3);
    CHECK(s.stats->overflows == 1);
    return std::pair{to_vector(s.unique, s.scalars->unique_count), s.stats->misses - misses0};
  };
  // In rounds: group 0 = the four residents (all hits), then 0..5 in two groups: six fills, one
  // per expert the forward lacks.
  const auto [rounds_order, rounds_fills] = run(true);
  CHECK(rounds_order == Ids{10, 11, 12, 13, 0, 1, 2, 3, 4, 5});
  CHECK(rounds_fills == 6);
  // Ascending (a plain prepare's overflow): group 0 = 0..3 evicts the residents 10..13, which
  // group 2 then fills again: ten fills for six missing experts.
  const auto [plain_order, plain_fills] = run(false);
  CHECK(plain_order == Ids{0, 1, 2, 3, 4, 5, 10, 11, 12, 13});
  CHECK(plain_fills == 10);
}

TEST_CASE("device plan: forwards in rounds (any width) equal ForwardPlanner<Lru>::plan_unique on residents-first groups") {
  struct Config {
    std::int32_t E, C, top_k, max_tokens;
  };
  const Config configs[] = {{16, 6, 2, 8}, {64, 16, 4, 12}, {300, 37, 6, 12}, {512, 208, 10, 40}, {8, 1, 1, 3}};
  std::uint64_t seed = 101, overflows = 0;
  for (const Config& c : configs) {
    CAPTURE(c.E);
    CAPTURE(c.C);
    std::mt19937_64 rng(seed++);
    Pair p(c.E, c.C, c.top_k);
    const std::int32_t max_groups = plan_max_groups(static_cast<std::int64_t>(c.max_tokens) * c.top_k, c.E, c.C);
    for (int step = 0; step < 120; ++step) {
      CAPTURE(step);
      const auto tokens = static_cast<std::int32_t>(1 + rng() % static_cast<std::uint64_t>(c.max_tokens));
      const Ids ids = random_ids(rng, c.E, c.top_k, tokens, 0.05, 0.02);
      // Every unique expert is filled at most once per forward: the misses of its groups are
      // exactly the experts not resident at its start.
      std::set<std::int32_t> missing;
      for (const std::int32_t id : ids) {
        if (id >= 0 && id < c.E && p.host.resident_map()[static_cast<std::size_t>(id)] < 0) missing.insert(id);
      }
      const std::uint64_t misses0 = p.dev.state().stats->misses;
      const bool in_rounds = rng() % 4 != 0;  // most forwards in rounds, some plain between them
      // Rounds of the capacity or narrower (1..C).
      const auto width = static_cast<std::int32_t>(rng() % 2 == 0 ? 0 : 1 + rng() % static_cast<std::uint64_t>(c.C));
      const std::int32_t w = width == 0 ? c.C : width;
      p.step(ids, in_rounds ? plan_max_groups(static_cast<std::int64_t>(c.max_tokens) * c.top_k, c.E, w) : max_groups,
             in_rounds, width);
      if (in_rounds) {
        CHECK(p.dev.state().stats->misses - misses0 == missing.size());
        if (p.dev.state().scalars->group_count > 1) ++overflows;
      }
      if (rng() % 8 == 0) p.invalidate(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E)));
    }
  }
  CHECK(overflows > 50);
}

TEST_CASE("device plan: a prefetch of the next narrow group never touches the group planned last") {
  // Rounds of width W <= C / 2: after group g is planned, plan_prefetch of group g + 1 takes its
  // victims outside group g and leaves the forward map and the unique list as they were, so it
  // may run while group g's consumer reads them; every expert of group g + 1 is then resident.
  // Every device policy: under the score policies a group's recent use alone does not keep it.
  struct Shape {
    std::int32_t E, C;
  };
  const auto run = [&]<class Policy>(Policy) {
    std::uint64_t prefetched = 0;
    for (const Shape shape : {Shape{40, 8}, Shape{64, 16}, Shape{512, 208}, Shape{12, 2}}) {
      const std::int32_t E = shape.E, C = shape.C, W = C / 2;
      std::mt19937_64 rng(static_cast<std::uint64_t>(E) * 31 + static_cast<std::uint64_t>(C));
      HostPlanStorage dev(E, C);
      const DevicePlanState& s = dev.state();
      SequentialBlock b;
      reset_plan_state<Policy>(b, s);
      for (int forward = 0; forward < 60; ++forward) {
        CAPTURE(Policy::name);
        CAPTURE(E);
        CAPTURE(forward);
        const Ids ids = random_ids(rng, E, std::min(8, E), 1 + static_cast<std::int32_t>(rng() % 12), 0.02, 0.0);
        DevicePlanState launch = s;
        launch.forward_in_rounds = true;
        launch.round_width = W;
        plan_forward<Policy>(b, launch, ids.data(), static_cast<std::int32_t>(ids.size()));
        const std::int32_t groups = s.scalars->group_count, unique = s.scalars->unique_count;
        REQUIRE(s.scalars->group_width == W);
        for (std::int32_t g = 0; g < groups; ++g) {
          if (g > 0) plan_group<Policy>(b, s, g);
          const Ids forward_map = to_vector(s.forward_map, E), unique_list = to_vector(s.unique, unique);
          std::set<std::int32_t> group_slots;
          for (std::int32_t e = 0; e < E; ++e)
            if (forward_map[static_cast<std::size_t>(e)] >= 0) group_slots.insert(forward_map[static_cast<std::size_t>(e)]);
          REQUIRE(group_slots.size() == static_cast<std::size_t>(s.scalars->group_size));
          if (g + 1 == groups) break;
          const std::int32_t next_begin = (g + 1) * W, next_n = std::min(W, unique - next_begin);
          const Ids next(unique_list.begin() + next_begin, unique_list.begin() + next_begin + next_n);
          plan_prefetch<Policy>(b, s, next.data(), next_n, W, 1);
          for (std::int32_t i = 0; i < s.scalars->fill_count; ++i) CHECK(group_slots.count(s.fills[i].slot) == 0);
          prefetched += static_cast<std::uint64_t>(s.scalars->fill_count);
          CHECK(to_vector(s.forward_map, E) == forward_map);
          CHECK(to_vector(s.unique, unique) == unique_list);
          for (const std::int32_t e : next) CHECK(s.resident_map[e] >= 0);
          for (std::int32_t e = 0; e < E; ++e) {
            const std::int32_t slot = forward_map[static_cast<std::size_t>(e)];
            if (slot >= 0) CHECK(s.resident_map[e] == slot);
          }
        }
      }
    }
    CHECK(prefetched > 500);
  };
  run(DeviceLru{});
  run(DeviceLfru{});
  run(DeviceCrf{});
}

TEST_CASE("device plan: invalidate then replan reuses the freed slot first") {
  Pair p(8, 3, 1);
  p.step({0, 1, 2});
  p.invalidate(1);  // slot 1 back on top of the (empty) free stack
  CHECK(p.dev.state().scalars->free_count == 1);
  p.invalidate(1);  // not resident: no-op
  p.step({5});
  CHECK(p.dev.state().fills[0] == PlanEntry{5, 1});
  CHECK(p.dev.state().scalars->eviction_count == 0);
  p.step({6, 0});  // full again: evicts the LRU outside {0, 6}, which is 2
  CHECK(p.dev.state().evictions[0] == PlanEntry{2, 2});
  p.invalidate(0);
  p.invalidate(6);
  p.step({7, 0, 6});
}

TEST_CASE("device plan: capacity == E never evicts; capacity == top_k evicts the whole forward") {
  Pair full(12, 12, 3);
  std::mt19937_64 rng(7);
  for (int i = 0; i < 60; ++i) full.step(random_ids(rng, 12, 3, 4, 0.1, 0.0));
  CHECK(full.dev.state().stats->evictions == 0);
  Pair tight(40, 5, 5);
  for (int i = 0; i < 60; ++i) tight.step(random_ids(rng, 40, 5, 1, 0.0, 0.0));
  CHECK(tight.dev.state().stats->evictions > 0);
}

TEST_CASE("device plan: broken views and arguments are reported, not followed") {
  HostPlanStorage dev(16, 4);
  SequentialBlock b;
  DevicePlanState s = dev.state();
  const Ids ids = {1, 2};
  plan_forward(b, s, nullptr, 5);  // null ids with n > 0: an empty forward
  CHECK((*s.error_word & plan_error_bad_argument) != 0);
  CHECK(s.scalars->group_count == 0);
  plan_forward(b, s, ids.data(), -3);
  plan_group(b, s, -1);
  CHECK(s.scalars->misses == 0);
  *s.error_word = 0;
  DevicePlanState broken = s;
  broken.resident_map.size = 15;
  plan_forward(b, broken, ids.data(), 2);
  CHECK(*s.error_word == plan_error_bad_state);
  CHECK(s.resident_map[1] == -1);
  broken = s;
  broken.capacity = 17;
  plan_invalidate(b, broken, 1);
  // Corrupted scalars: nothing planned, nothing counted, the error word says why (the small
  // path loads the scalars with the ids and checks them before its first store).
  const std::int32_t free0 = s.scalars->free_count;
  for (int which = 0; which < 3; ++which) {
    CAPTURE(which);
    *s.error_word = 0;
    s.scalars->free_count = which == 0 ? 99 : free0;
    s.scalars->group_count = which == 1 ? -1 : 0;
    s.scalars->spec_live = which == 2 ? s.capacity + 1 : 0;
    const DevicePlanStats counted = *s.counters;
    plan_forward(b, s, ids.data(), 2);
    CHECK(s.resident_map[1] == -1);
    CHECK(s.forward_map[1] == -1);
    CHECK(*s.error_word == plan_error_bad_state);
    CHECK(*s.counters == counted);
  }
  s.scalars->free_count = free0;
  s.scalars->group_count = 0;
  s.scalars->spec_live = 0;
  CHECK(plan_state_bytes(0, 4) == 0);
  CHECK(plan_max_groups(0, 16, 4) == 1);
  CHECK(plan_max_groups(40, 16, 4) == 4);
  CHECK(plan_max_groups(9, 16, 4) == 3);
}

TEST_CASE("device plan: the small path (<= plan_small_ids ids) and the general path leave identical states") {
  struct Config {
    std::int32_t E, C;
  };
  const Config configs[] = {{64, 16}, {512, 208}, {32, 5}, {16, 16}, {300, 3}};
  std::mt19937_64 rng(4242);
  std::int64_t small_overflows = 0;
  for (const Config& c : configs) {
    CAPTURE(c.E);
    CAPTURE(c.C);
    HostPlanStorage a(c.E, c.C), g(c.E, c.C);
    SequentialBlock b;
    for (int step = 0; step < 3000; ++step) {
      CAPTURE(step);
      const auto n = static_cast<std::int32_t>(rng() % (plan_small_ids + 1));
      Ids ids(static_cast<std::size_t>(n));
      for (auto& id : ids) {
        const std::uint64_t r = rng() % 100;
        if (r < 5) id = -1;
        else if (r < 8) id = (r == 5) ? c.E : (r == 6 ? INT32_MIN : -7);
        else if (r < 60) id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(std::max(1, c.E / 8)));
        else id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E));
      }
      if (n > 1 && rng() % 4 == 0) ids[1] = ids[0];  // duplicates
      Ids sa(ids.size(), 7), sg(ids.size(), 9);
      if (step % 3 == 0) {  // in place
        sa = ids;
        plan_forward_small(b, a.state(), sa.data(), n, sa.data());
      } else {
        plan_forward_small(b, a.state(), ids.data(), n, sa.data());
      }
      plan_forward_general(b, g.state(), ids.data(), n, sg.data());
      CHECK(sa == sg);
      const std::int32_t groups = g.state().scalars->group_count;
      if (groups > 1) ++small_overflows;
      for (std::int32_t k = 1; k < groups; ++k) {
        plan_group(b, a.state(), k);
        plan_group(b, g.state(), k);
      }
      REQUIRE(a.bytes() == g.bytes());
      REQUIRE(std::memcmp(a.block(), g.block(), a.bytes()) == 0);  // every array, scalar and counter
      REQUIRE(*a.state().stats == *g.state().stats);
      REQUIRE(*a.state().error_word == *g.state().error_word);
      if (rng() % 20 == 0) {
        const auto e = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E));
        plan_invalidate(b, a.state(), e);
        plan_invalidate(b, g.state(), e);
      }
    }
    if (c.C < c.E) CHECK(a.state().stats->evictions > 0);
  }
  CHECK(small_overflows > 100);
}

// Predictions like an engine's: mostly the next forward's hot experts, some cold ones, duplicates.
static Ids predicted_ids(std::mt19937_64& rng, std::int32_t E, std::int32_t n) {
  std::uniform_int_distribution<std::int32_t> any(0, E - 1);
  std::uniform_int_distribution<std::int32_t> hot(0, std::max(1, E / 8) - 1);
  Ids ids;
  for (std::int32_t i = 0; i < n; ++i) ids.push_back(rng() % 3 == 0 ? any(rng) : hot(rng));
  if (n > 1 && rng() % 4 == 0) ids.push_back(ids.front());  // a duplicate
  return ids;
}

TEST_CASE("device plan: prefetch equals ForwardPlanner<Lru>::plan_prefetch step by step") {
  struct Config {
    std::int32_t E, C, top_k, max_tokens;
  };
  const Config configs[] = {
      {8, 4, 2, 2}, {16, 6, 2, 3}, {64, 16, 4, 4}, {64, 64, 8, 4}, {512, 208, 10, 2}, {300, 37, 6, 8}, {128, 10, 10, 1},
  };
  std::uint64_t seed = 77, issued = 0, used = 0, wasted = 0, no_victim = 0, evictions = 0;
  for (const Config& c : configs) {
    for (int rep = 0; rep < 3; ++rep) {
      CAPTURE(c.E);
      CAPTURE(c.C);
      CAPTURE(rep);
      std::mt19937_64 rng(seed++);
      Pair p(c.E, c.C, c.top_k);
      const std::int32_t max_groups = plan_max_groups(static_cast<std::int64_t>(c.max_tokens) * c.top_k, c.E, c.C);
      for (int step = 0; step < 200; ++step) {
        CAPTURE(step);
        const auto tokens = static_cast<std::int32_t>(1 + rng() % static_cast<std::uint64_t>(c.max_tokens));
        // Some forwards are all padding (an empty forward still ages the speculative fills).
        const double pad = step % 23 == 0 ? 1.0 : 0.02;
        p.step(random_ids(rng, c.E, c.top_k, tokens, pad, rep == 2 ? 0.03 : 0.0), max_groups);
        const int prefetches = static_cast<int>(rng() % 3);  // 0, 1 or 2 prefetches between forwards
        for (int k = 0; k < prefetches; ++k) {
          const auto n = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(2 * c.top_k + 2));
          const auto max_fills = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.top_k + 2));
          const auto expires = static_cast<std::uint32_t>(1 + rng() % 3);
          p.prefetch(predicted_ids(rng, c.E, n), max_fills, expires);
          no_victim += static_cast<std::uint64_t>(p.dev.state().scalars->prefetch_skipped_no_victim);
        }
        if (rng() % 10 == 0) p.invalidate(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E)));
      }
      const DevicePlanStats& st = *p.dev.state().stats;
      issued += st.speculative_issued;
      used += st.speculative_used;
      wasted += st.speculative_wasted;
      evictions += st.evictions;
    }
  }
  MESSAGE("speculative issued ", issued, ", used ", used, ", wasted ", wasted, ", skipped (no victim) ", no_victim,
          ", evictions ", evictions);
  // Every rule is exercised: fills used and wasted (expiry, eviction, invalidation), protection
  // leaving no victim.
  CHECK(issued > 1000);
  CHECK(used > 100);
  CHECK(wasted > 100);
  CHECK(no_victim > 0);
}

TEST_CASE("device plan: prefetch drops bad ids, refuses bad arguments, protects the forward") {
  HostPlanStorage dev(16, 4);
  const DevicePlanState& s = dev.state();
  SequentialBlock b;
  const Ids fwd = {1, 2};
  plan_forward(b, s, fwd.data(), 2);  // slots 0, 1; two free
  // Bad ids are counted and dropped, -1 is padding; the valid ones are filled into free slots.
  const Ids mixed = {-1, 16, 5, INT32_MIN, 6};
  plan_prefetch(b, s, mixed.data(), 5, 4, 1);
  CHECK(s.scalars->fill_count == 2);
  CHECK(s.stats->bad_ids == 2);
  CHECK((*s.error_word & plan_error_bad_id) != 0);
  CHECK(s.resident_map[5] >= 0);
  CHECK(s.resident_map[6] >= 0);
  // Full, and every resident protected (the forward's two, two live speculative fills): nothing.
  const Ids more = {7, 8};
  plan_prefetch(b, s, more.data(), 2, 2, 1);
  CHECK(s.scalars->fill_count == 0);
  CHECK(s.scalars->prefetch_skipped_no_victim == 2);
  CHECK(s.resident_map[1] >= 0);
  CHECK(s.resident_map[2] >= 0);
  // Bad arguments: flagged, nothing changes.
  const std::vector<std::uint8_t> before(static_cast<const std::uint8_t*>(dev.block()),
                                         static_cast<const std::uint8_t*>(dev.block()) + dev.bytes());
  *s.error_word = 0;
  plan_prefetch(b, s, more.data(), -1, 2, 1);
  plan_prefetch(b, s, nullptr, 2, 2, 1);
  plan_prefetch(b, s, more.data(), 2, -1, 1);
  plan_prefetch(b, s, more.data(), 2, 2, 0);
  CHECK(*s.error_word == plan_error_bad_argument);
  const std::vector<std::uint8_t> after(static_cast<const std::uint8_t*>(dev.block()),
                                        static_cast<const std::uint8_t*>(dev.block()) + dev.bytes());
  CHECK(before == after);
  // The next forward uses one fill (used) and not the other; it expires (wasted), and is then
  // evictable by a prefetch.
  const Ids next = {5, 1};
  plan_forward(b, s, next.data(), 2);
  CHECK(s.stats->speculative_used == 1);
  CHECK(s.stats->speculative_wasted == 1);
  CHECK(s.scalars->spec_live == 0);
  plan_prefetch(b, s, more.data(), 2, 2, 1);
  CHECK(s.scalars->fill_count == 2);  // victims: 6 (expired) and 2 (not in the last forward)
  CHECK(s.resident_map[6] == -1);
  CHECK(s.resident_map[2] == -1);
  CHECK(s.resident_map[5] >= 0);
  CHECK(s.resident_map[1] >= 0);
}
