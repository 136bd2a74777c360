#include <doctest/doctest.h>

#include <random>
#include <vector>

#include "expert_cache/eviction/lru.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/planning/split.hpp"
#include "support/allocation_counter.hpp"  // the one TU of this program that replaces operator new

using namespace expert_cache;
using Ids = std::vector<std::int32_t>;

namespace {

// Checks the planner's internal maps agree with each other and with the last forward.
template <class Planner>
void check_maps_consistent(const Planner& p, const ForwardPlan& plan) {
  const auto shape = p.shape();
  const auto resident = p.resident_map();
  const auto owner = p.slot_owner();
  std::int32_t resident_count = 0;
  for (std::int32_t e = 0; e < shape.num_experts; ++e) {
    const std::int32_t s = resident[static_cast<std::size_t>(e)];
    if (s == absent_slot) continue;
    ++resident_count;
    REQUIRE(s >= 0);
    REQUIRE(s < shape.capacity);
    CHECK(owner[static_cast<std::size_t>(s)] == e);
  }
  CHECK(resident_count == p.resident_count());
  std::vector<bool> in_forward(static_cast<std::size_t>(shape.num_experts), false);
  for (ExpertId e : plan.unique) in_forward[e.index()] = true;
  for (std::int32_t e = 0; e < shape.num_experts; ++e) {
    const auto i = static_cast<std::size_t>(e);
    if (in_forward[i]) {
      CHECK(p.forward_map()[i] == resident[i]);
      CHECK(p.forward_map()[i] != absent_slot);
    } else {
      CHECK(p.forward_map()[i] == absent_slot);
    }
  }
}

}  // namespace

TEST_CASE("Lru planner: hand-computed sequence of hits, misses, victims and slots") {
  ForwardPlanner<Lru> p(CacheShape{8, 3}, 2);
  ForwardPlan plan;
  // Row-provider slot order: 0, 1, 2 for the first misses.
  REQUIRE(p.plan_topk(Ids{5, 1, 5, -1}, plan).ok());  // unique sorted {1,5}
  CHECK(plan.hits == 0);
  CHECK(plan.misses == 2);
  CHECK(plan.fills == std::vector<SlotFill>{{ExpertId(1), SlotId(0)}, {ExpertId(5), SlotId(1)}});
  check_maps_consistent(p, plan);

  REQUIRE(p.plan_topk(Ids{2, 1}, plan).ok());  // 1 hit, 2 -> slot 2; LRU order now 5,1,2
  CHECK(plan.hits == 1);
  CHECK(plan.fills == std::vector<SlotFill>{{ExpertId(2), SlotId(2)}});
  CHECK(plan.evictions.empty());

  REQUIRE(p.plan_topk(Ids{7, 7}, plan).ok());  // full: evicts LRU 5 (slot 1)
  CHECK(plan.evictions == std::vector<SlotEviction>{{ExpertId(5), SlotId(1)}});
  CHECK(plan.fills == std::vector<SlotFill>{{ExpertId(7), SlotId(1)}});
  CHECK(p.resident_map()[5] == absent_slot);
  check_maps_consistent(p, plan);

  REQUIRE(p.plan_topk(Ids{0, 2}, plan).ok());  // 0 miss, LRU order 1,2,7 -> 1 evicted (2 protected anyway)
  CHECK(plan.evictions == std::vector<SlotEviction>{{ExpertId(1), SlotId(0)}});
  CHECK(plan.hits == 1);
  const auto& c = p.counters();
  CHECK(c.hits == 2);
  CHECK(c.misses == 5);
  CHECK(c.evictions == 2);
  CHECK(c.promotions == 5);
  CHECK(c.prepare_calls == 4);
}

TEST_CASE("in-forward victim protection: a not-yet-touched expert of the same forward is never evicted") {
  ForwardPlanner<Lru> p(CacheShape{8, 2}, 1);
  ForwardPlan plan;
  REQUIRE(p.plan_unique(Ids{0, 1}, plan).ok());  // LRU order 0, 1
  // Expert 2 is processed first; the LRU head (0) is needed later in this forward.
  REQUIRE(p.plan_unique(Ids{2, 0}, plan).ok());
  CHECK(plan.evictions == std::vector<SlotEviction>{{ExpertId(1), SlotId(1)}});
  CHECK(plan.hits == 1);
  CHECK(p.forward_map()[2] == 1);
  CHECK(p.forward_map()[0] == 0);
  check_maps_consistent(p, plan);
}

TEST_CASE("forward map exposes exactly the forward; resident map everything") {
  ForwardPlanner<Lru> p(CacheShape{16, 6}, 2);
  ForwardPlan plan;
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::int32_t> id(-2, 15);
  for (int f = 0; f < 500; ++f) {
    Ids ids;
    for (int j = 0; j < 6; ++j) ids.push_back(id(rng));
    REQUIRE(p.plan_topk(ids, plan).ok());
    check_maps_consistent(p, plan);
    for (std::int32_t e : ids) {
      if (e >= 0) CHECK(p.forward_map()[static_cast<std::size_t>(e)] != absent_slot);
    }
  }
}

TEST_CASE("bad input is rejected with a specific error and leaves the state unchanged") {
  ForwardPlanner<Lru> p(CacheShape{10, 3}, 2);
  ForwardPlan plan;
  REQUIRE(p.plan_topk(Ids{1, 2, 3}, plan).ok());
  REQUIRE(p.plan_topk(Ids{4}, plan).ok());
  const auto before = p.snapshot();
  const std::vector<std::int32_t> fwd_before(p.forward_map().begin(), p.forward_map().end());

  struct Case {
    const char* what;
    bool unique;
    Ids ids;
    ErrorCode code;
  };
  const std::vector<Case> cases = {
      {"top-k id == E", false, {1, 10}, ErrorCode::expert_out_of_range},
      {"top-k id huge", false, {1, 1 << 30}, ErrorCode::expert_out_of_range},
      {"top-k too many unique", false, {0, 1, 2, 5, 5}, ErrorCode::too_many_experts},
      {"unique id negative", true, {1, -1}, ErrorCode::expert_out_of_range},
      {"unique id == E", true, {10}, ErrorCode::expert_out_of_range},
      {"unique duplicate", true, {4, 2, 4}, ErrorCode::duplicate_expert},
      {"unique too many", true, {0, 1, 2, 3}, ErrorCode::too_many_experts},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    const Status s = c.unique ? p.plan_unique(c.ids, plan) : p.plan_topk(c.ids, plan);
    CHECK(s.code() == c.code);
    CHECK_FALSE(s.message().empty());
    CHECK(p.snapshot() == before);
    CHECK(std::vector<std::int32_t>(p.forward_map().begin(), p.forward_map().end()) == fwd_before);
  }
  auto inv = p.invalidate(-3);
  CHECK(inv.status().code() == ErrorCode::expert_out_of_range);
  inv = p.invalidate(10);
  CHECK(inv.status().code() == ErrorCode::expert_out_of_range);
  CHECK(p.snapshot() == before);
  // And the planner still works afterwards.
  REQUIRE(p.plan_topk(Ids{4, 2}, plan).ok());  // {1,2,3} then {4} evicted 1
  CHECK(plan.hits == 2);
}

TEST_CASE("construction rejects impossible shapes with a specific error") {
  auto code_of = [](CacheShape shape, std::int32_t top_k) {
    try {
      ForwardPlanner<Lru> p(shape, top_k);
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::ok;
  };
  CHECK(code_of({10, 0}, 1) == ErrorCode::invalid_capacity);
  CHECK(code_of({10, 11}, 1) == ErrorCode::invalid_capacity);
  CHECK(code_of({10, -1}, 1) == ErrorCode::invalid_capacity);
  CHECK(code_of({10, 4}, 5) == ErrorCode::invalid_capacity);
  CHECK(code_of({10, 4}, 0) == ErrorCode::invalid_capacity);
  CHECK(code_of({0, 1}, 1) == ErrorCode::invalid_argument);
  CHECK(code_of({10, 10}, 10) == ErrorCode::ok);
}

TEST_CASE("invalidate frees the slot for last-in-first-out reuse and is a no-op when absent") {
  ForwardPlanner<Lru> p(CacheShape{10, 3}, 1);
  ForwardPlan plan;
  REQUIRE(p.plan_topk(Ids{1, 2, 3}, plan).ok());  // slots 0,1,2
  auto freed = p.invalidate(2);
  REQUIRE(freed.ok());
  CHECK(freed.value() == SlotId(1));
  CHECK(p.resident_map()[2] == absent_slot);
  CHECK(p.forward_map()[2] == absent_slot);
  CHECK(p.resident_count() == 2);
  auto none = p.invalidate(2);
  REQUIRE(none.ok());
  CHECK_FALSE(none.value().valid());
  REQUIRE(p.plan_topk(Ids{9}, plan).ok());
  CHECK(plan.evictions.empty());
  CHECK(plan.fills == std::vector<SlotFill>{{ExpertId(9), SlotId(1)}});
  CHECK(p.counters().invalidations == 1);
}

TEST_CASE("token split: greedy row chunks whose union fits; one row over capacity is an error") {
  // 4 rows, top-2, capacity 3.
  const Ids topk{0, 1, /**/ 1, 2, /**/ 3, 4, /**/ 4, -1};
  auto chunks = plan_token_chunks(topk, 2, 3, 8);
  REQUIRE(chunks.ok());
  REQUIRE(chunks.value().size() == 2);
  CHECK(chunks.value()[0] == TokenChunk{0, 2, {0, 1, 2}});
  CHECK(chunks.value()[1] == TokenChunk{2, 4, {3, 4}});

  auto fits = plan_token_chunks(Ids{1, 2, 2, 1}, 2, 3, 8);
  REQUIRE(fits.ok());
  CHECK(fits.value() == std::vector<TokenChunk>{{0, 2, {1, 2}}});

  auto over = plan_token_chunks(Ids{0, 1, 2, 3}, 4, 3, 8);
  CHECK(over.status().code() == ErrorCode::row_exceeds_capacity);
  CHECK(plan_token_chunks(Ids{0, 9}, 2, 3, 8).status().code() == ErrorCode::expert_out_of_range);
  CHECK(plan_token_chunks(Ids{0, 1, 2}, 2, 3, 8).status().code() == ErrorCode::invalid_argument);
  auto empty = plan_token_chunks(Ids{}, 2, 3, 8);
  REQUIRE(empty.ok());
  CHECK(empty.value().empty());
}

TEST_CASE("token split chunks cover every row once and each chunk fits") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int32_t k = 1 + static_cast<std::int32_t>(rng() % 4);
    const std::int32_t cap = k + static_cast<std::int32_t>(rng() % 5);
    const std::int32_t rows = static_cast<std::int32_t>(rng() % 20);
    Ids topk;
    for (std::int32_t i = 0; i < rows * k; ++i) topk.push_back(static_cast<std::int32_t>(rng() % 20) - 1);
    auto chunks = plan_token_chunks(topk, k, cap, 19);
    REQUIRE(chunks.ok());
    std::int64_t next = 0;
    for (const auto& c : chunks.value()) {
      CHECK(c.row_begin == next);
      CHECK(c.row_end > c.row_begin);
      CHECK(static_cast<std::int32_t>(c.unique_ids.size()) <= cap);
      for (std::int64_t r = c.row_begin; r < c.row_end; ++r) {
        for (std::int32_t j = 0; j < k; ++j) {
          const std::int32_t id = topk[static_cast<std::size_t>(r * k + j)];
          if (id >= 0) CHECK(std::binary_search(c.unique_ids.begin(), c.unique_ids.end(), id));
        }
      }
      next = c.row_end;
    }
    CHECK(next == rows);
  }
}

TEST_CASE("expert split: ascending groups of <= capacity ids, shared work in group 0 only") {
  const Ids topk{7, 3, 3, 9, 1, -1, 12, 5};
  auto groups = plan_expert_groups(topk, 2, 3, 16);
  REQUIRE(groups.ok());
  REQUIRE(groups.value().size() == 2);
  CHECK(groups.value()[0] == ExpertGroup{{1, 3, 5}, true});
  CHECK(groups.value()[1] == ExpertGroup{{7, 9, 12}, false});
  auto empty = plan_expert_groups(Ids{-1, -1}, 2, 3, 16);
  REQUIRE(empty.ok());
  CHECK(empty.value() == std::vector<ExpertGroup>{{{}, true}});
  CHECK(plan_expert_groups(Ids{16, 1}, 2, 3, 16).status().code() == ErrorCode::expert_out_of_range);
}

TEST_CASE("expert groups planned through the cache one at a time: each expert fetched at most once") {
  ForwardPlanner<Lru> p(CacheShape{32, 4}, 2);
  ForwardPlan plan;
  Ids topk;
  for (std::int32_t i = 0; i < 20; ++i) topk.push_back((i * 7) % 32);
  auto groups = plan_expert_groups(topk, 2, 4, 32);
  REQUIRE(groups.ok());
  std::uint32_t fetched = 0;
  for (const auto& g : groups.value()) {
    REQUIRE(p.plan_unique(g.unique_ids, plan).ok());
    fetched += plan.misses;
    for (std::int32_t e = 0; e < 32; ++e) {
      const bool in_group = std::find(g.unique_ids.begin(), g.unique_ids.end(), e) != g.unique_ids.end();
      CHECK((p.forward_map()[static_cast<std::size_t>(e)] != absent_slot) == in_group);
    }
  }
  CHECK(fetched == 20);
}

TEST_CASE("a rejected forward allocates nothing: the error is built in the Status, not on the heap") {
  ForwardPlanner<Lru> p(CacheShape{16, 4}, 2);
  ForwardPlan plan;
  REQUIRE(p.plan_topk(Ids{1, 2}, plan).ok());  // sizes the plan's vectors once
  const Ids out_of_range{3, 600};
  const Ids too_many{0, 1, 2, 3, 4, 5};
  const Ids duplicate{5, 5};
  const auto snapshot = p.snapshot();
  const std::uint64_t before = expert_cache::test::g_allocations.load();
  const Status a = p.plan_topk(out_of_range, plan);
  const Status b = p.plan_topk(too_many, plan);
  const Status c = p.plan_unique(duplicate, plan);
  const std::uint64_t after = expert_cache::test::g_allocations.load();
  CHECK(after == before);
  CHECK(a.code() == ErrorCode::expert_out_of_range);
  CHECK(a.message() == "expert id 600 is outside [0, 16)");
  CHECK(b.code() == ErrorCode::too_many_experts);
  CHECK(b.message().find("6 unique experts but the cache has 4 slots") != std::string_view::npos);
  CHECK(c.code() == ErrorCode::duplicate_expert);
  CHECK(c.message() == "expert 5 appears more than once in the unique id list");
  CHECK(p.snapshot() == snapshot);  // and nothing changed
}

TEST_CASE("a copied planner plans without allocating (its bounded lists keep their room)") {
  ForwardPlanner<Lru> original(CacheShape{64, 8}, 2);
  ForwardPlan plan;
  REQUIRE(original.plan_topk(Ids{1, 2}, plan).ok());  // sizes the plan's vectors once
  ForwardPlanner<Lru> copy = original;
  ForwardPlanner<Lru> assigned(CacheShape{64, 8}, 2);
  assigned = original;
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::int32_t> id(0, 63);
  // Forwards of 1..8 ids: wider than any the original planned before it was copied.
  Ids stream(500 * 8);
  for (auto& x : stream) x = id(rng);
  const std::uint64_t evictions_before = copy.counters().evictions;
  bool all_ok = true;
  const std::uint64_t before = expert_cache::test::g_allocations.load();
  for (std::size_t step = 0; step < 500; ++step) {
    const std::span<const std::int32_t> ids(stream.data() + 8 * step, 1 + step % 8);
    all_ok = copy.plan_topk(ids, plan).ok() && assigned.plan_topk(ids, plan).ok() && all_ok;
    if (step % 50 == 0) (void)copy.invalidate(ids[0]);
  }
  const std::uint64_t after = expert_cache::test::g_allocations.load();
  CHECK(all_ok);
  CHECK(after == before);
  CHECK(copy.counters().evictions > evictions_before);  // the stream really evicted
}
