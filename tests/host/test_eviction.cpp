// Eviction policies: hand-computed sequences, an independent LFRU model, and properties
// (in-forward victim protection, OPT dominance, no allocation on the hot path).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <random>
#include <span>
#include <type_traits>
#include <string>
#include <string_view>
#include <vector>

#include "expert_cache/eviction/all.hpp"
#include "expert_cache/expert_cache.hpp"  // the recommended cache aliases
#include "expert_cache/runtime/sim_runtime.hpp"
#include "expert_cache/eviction/make_policy.hpp"  // make_policy<P>(shape, forwards[, layout])
#include "expert_cache/planning/forward_planner.hpp"

#include "support/allocation_counter.hpp"  // the one TU of this program that replaces operator new

using expert_cache::test::g_allocations;

using namespace expert_cache;

namespace {

using Ids = std::vector<std::int32_t>;
using Forwards = std::vector<Ids>;

// Outcome of one forward, in a form the hand-computed tables can spell out.
struct Step {
  std::uint32_t hits = 0;
  std::uint32_t misses = 0;
  Ids victims;     // in eviction order
  Ids fill_slots;  // slot of each miss, in processing order
};

Ids ids_of(std::span<const std::int32_t> s) { return Ids(s.begin(), s.end()); }

template <class P>
Step run(ForwardPlanner<P>& planner, const Ids& unique_ids) {
  ForwardPlan plan;
  const Status s = planner.plan_unique(unique_ids, plan);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  Step out{plan.hits, plan.misses, {}, {}};
  for (const auto& ev : plan.evictions) out.victims.push_back(ev.expert.value);
  for (const auto& f : plan.fills) out.fill_slots.push_back(f.slot.value);
  return out;
}

// Random forwards with some locality: a sticky subset of the previous forward plus draws
// from a skewed distribution. Ids are unique per forward, in random processing order.
Forwards random_forwards(std::uint64_t seed, std::int32_t num_experts, std::int32_t capacity,
                         std::size_t count) {
  std::mt19937_64 rng(seed);
  Forwards out;
  Ids prev;
  for (std::size_t t = 0; t < count; ++t) {
    const auto width = 1 + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(capacity));
    Ids f;
    for (const std::int32_t e : prev) {
      if (static_cast<std::int32_t>(f.size()) < width && rng() % 3 == 0) f.push_back(e);
    }
    while (static_cast<std::int32_t>(f.size()) < width) {
      // Squaring a uniform draw skews towards low ids.
      const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
      const auto e = static_cast<std::int32_t>(u * u * num_experts);
      if (std::find(f.begin(), f.end(), e) == f.end()) f.push_back(e);
    }
    std::shuffle(f.begin(), f.end(), rng);
    prev = f;
    out.push_back(std::move(f));
  }
  return out;
}

// A global pool over `layers` layers of `experts` each: steps visit the layers in order and
// every forward is one layer's random set, keyed layer * experts + e (the replay tool's
// global scope).
Forwards pool_forwards(std::uint64_t seed, std::int32_t layers, std::int32_t experts, std::int32_t width,
                       std::size_t steps) {
  std::vector<Forwards> per_layer;
  for (std::int32_t l = 0; l < layers; ++l) {
    per_layer.push_back(random_forwards(seed * 131 + static_cast<std::uint64_t>(l), experts, width, steps));
  }
  Forwards out;
  for (std::size_t t = 0; t < steps; ++t) {
    for (std::int32_t l = 0; l < layers; ++l) {
      Ids f = per_layer[static_cast<std::size_t>(l)][t];
      for (std::int32_t& e : f) e += l * experts;
      out.push_back(std::move(f));
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Independent LFRU model: a literal transcription of the rules in docs/reference_providers.md ("LFRU, exactly").
// Residency is an insertion-ordered list (a Python dict), scores are doubles.
class NaiveLfru {
 public:
  NaiveLfru(std::int32_t capacity, std::uint64_t clock) : clock_(clock) {
    for (std::int32_t s = 0; s < capacity; ++s) free_.push_back(s);  // popped from the end
  }

  struct Out {
    std::uint32_t hits = 0, misses = 0;
  };

  Out prepare(const Ids& ids) {
    Out out;
    for (const std::int32_t e : ids) {
      auto it = find(e);
      if (it != entries_.end()) {
        clock_ += 1;
        it->freq += 1;
        it->last = clock_;
        ++out.hits;
        continue;
      }
      std::int32_t slot;
      if (!free_.empty()) {
        slot = free_.back();
        free_.pop_back();
      } else {
        auto victim = entries_.end();
        double best = 0.0;
        for (auto k = entries_.begin(); k != entries_.end(); ++k) {
          if (std::find(ids.begin(), ids.end(), k->id) != ids.end()) continue;
          const double score = static_cast<double>(k->freq) / static_cast<double>(clock_ - k->last + 1);
          if (victim == entries_.end() || score < best) {
            victim = k;
            best = score;
          }
        }
        REQUIRE(victim != entries_.end());
        slot = victim->slot;
        entries_.erase(victim);
      }
      clock_ += 1;
      entries_.push_back({e, slot, 1, clock_});
      ++out.misses;
    }
    return out;
  }

  void invalidate(std::int32_t e) {
    auto it = find(e);
    if (it == entries_.end()) return;
    free_.push_back(it->slot);
    entries_.erase(it);
  }

  [[nodiscard]] std::int32_t slot_of(std::int32_t e) const {
    for (const auto& k : entries_) if (k.id == e) return k.slot;
    return -1;
  }

 private:
  struct Entry {
    std::int32_t id;
    std::int32_t slot;
    std::uint64_t freq;
    std::uint64_t last;
  };
  std::vector<Entry>::iterator find(std::int32_t e) {
    return std::find_if(entries_.begin(), entries_.end(), [e](const Entry& k) { return k.id == e; });
  }

  std::vector<Entry> entries_;
  std::vector<std::int32_t> free_;
  std::uint64_t clock_;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// LFRU

TEST_CASE("lfru: hand-computed sequence with in-forward protection and LIFO slot reuse") {
  ForwardPlanner<Lfru> p(CacheShape{8, 3}, 1);
  // F1 [0,1,2]: free slots are handed out from the top: 2, 1, 0. clock 1..3, freq 1 each.
  Step s = run(p, {0, 1, 2});
  CHECK(s.misses == 3);
  CHECK(s.fill_slots == Ids{2, 1, 0});
  CHECK(p.policy().clock() == 3);
  // F2..F4 [0,1]: hits. After F4: 0 (freq 4, last 8), 1 (freq 4, last 9), clock 9.
  for (int i = 0; i < 3; ++i) CHECK(run(p, {0, 1}).hits == 2);
  CHECK(p.policy().clock() == 9);
  CHECK(p.policy().freq(ExpertId(0)) == 4);
  CHECK(p.policy().last(ExpertId(1)) == 9);
  // F5 [3,4]. Miss 3 at clock 9: scores 0: 4/2 = 2, 1: 4/1 = 4, 2: 1/7 -> victim 2 (slot 0);
  // 3 inserted at clock 10. Miss 4 at clock 10: 0: 4/3 = 1.33, 1: 4/2 = 2, and 3 (in this
  // forward) would score 1/1 = 1, the minimum -> protection makes the victim 0 (slot 2).
  s = run(p, {3, 4});
  CHECK(s.misses == 2);
  CHECK(s.victims == Ids{2, 0});
  CHECK(s.fill_slots == Ids{0, 2});
  CHECK(p.policy().clock() == 11);
  CHECK(ids_of(p.policy().insertion_order()) == Ids{1, 3, 4});
  // Invalidate 3: slot 0 goes back on the free list and is reused first, no eviction.
  auto freed = p.invalidate(3);
  REQUIRE(freed.ok());
  CHECK(freed.value().value == 0);
  s = run(p, {5});
  CHECK(s.victims.empty());
  CHECK(s.fill_slots == Ids{0});
  CHECK(ids_of(p.policy().insertion_order()) == Ids{1, 4, 5});
  // Re-inserting 0 restarts its frequency at 1. Miss 0 at clock 12: 1: 4/4 = 1,
  // 4: 1/2 = 0.5, 5: 1/1 = 1 -> victim 4 (slot 2).
  s = run(p, {0});
  CHECK(s.victims == Ids{4});
  CHECK(s.fill_slots == Ids{2});
  CHECK(p.policy().freq(ExpertId(0)) == 1);
  CHECK(p.policy().last(ExpertId(0)) == 13);
}

TEST_CASE("lfru: ties go to the earliest-inserted resident; hits do not reorder") {
  ForwardPlanner<Lfru> p(CacheShape{8, 3}, 1);
  // [2] c1 (slot 2), [4] c2 (slot 1), [4] c3, [4] c4, [2] c5, [1] c6 (slot 0).
  // State: 2 (f2, l5), 4 (f3, l4), 1 (f1, l6); insertion order 2, 4, 1.
  for (const Ids& f : {Ids{2}, Ids{4}, Ids{4}, Ids{4}, Ids{2}, Ids{1}}) (void)run(p, f);
  CHECK(ids_of(p.policy().insertion_order()) == Ids{2, 4, 1});
  // Miss 0 at clock 6: 2: 2/2 = 1, 4: 3/3 = 1, 1: 1/1 = 1 -> three-way tie. Earliest
  // inserted is 2 (a hit-reordered dict would say 4, lowest id would say 1).
  const Step s = run(p, {0});
  CHECK(s.victims == Ids{2});
  CHECK(s.fill_slots == Ids{2});
}

TEST_CASE("lfru: matches an independent model of the reference over random traces") {
  for (std::uint64_t seed = 1; seed <= 60; ++seed) {
    std::mt19937_64 rng(seed);
    const std::int32_t experts = seed % 3 == 0 ? 64 : (seed % 3 == 1 ? 16 : 8);
    const auto capacity = 1 + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(experts));
    // Some seeds start near 2^40 to cover the floating-point comparison path.
    const std::uint64_t start_clock = seed % 4 == 0 ? (std::uint64_t{1} << 40) + seed : 0;
    CAPTURE(seed);
    CAPTURE(capacity);
    Lfru policy(CacheShape{experts, capacity});
    policy.set_clock_for_testing(start_clock);
    ForwardPlanner<Lfru> planner(CacheShape{experts, capacity}, 1, policy);
    NaiveLfru model(capacity, start_clock);
    ForwardPlan plan;
    for (int t = 0; t < 400; ++t) {
      if (rng() % 10 == 0) {  // occasional invalidation
        const auto e = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(experts));
        REQUIRE(planner.invalidate(e).ok());
        model.invalidate(e);
        continue;
      }
      // Top-k style input (duplicates and padding); both sides process sorted unique ids.
      Ids topk;
      const auto n = 1 + rng() % static_cast<std::uint64_t>(capacity);
      for (std::uint64_t i = 0; i < n; ++i) {
        const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
        topk.push_back(rng() % 8 == 0 ? -1 : static_cast<std::int32_t>(u * u * experts));
      }
      Ids unique;
      for (const auto e : topk) if (e >= 0) unique.push_back(e);
      std::sort(unique.begin(), unique.end());
      unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
      if (static_cast<std::int32_t>(unique.size()) > capacity) continue;
      REQUIRE(planner.plan_topk(topk, plan).ok());
      const auto expect = model.prepare(unique);
      REQUIRE(plan.hits == expect.hits);
      REQUIRE(plan.misses == expect.misses);
      for (std::int32_t e = 0; e < experts; ++e) {
        REQUIRE(planner.resident_map()[static_cast<std::size_t>(e)] == model.slot_of(e));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Other policies, hand-computed

TEST_CASE("lru: hand-computed sequence") {
  ForwardPlanner<Lru> p(CacheShape{8, 3}, 1);
  (void)run(p, {0, 1, 2});   // slots 0, 1, 2 (lowest first)
  (void)run(p, {0});         // recency: 1, 2, 0
  Step s = run(p, {3, 1});   // LRU-most is 1, but it is in the forward -> evict 2 (slot 2)
  CHECK(s.hits == 1);
  CHECK(s.victims == Ids{2});
  CHECK(s.fill_slots == Ids{2});
  s = run(p, {4});           // recency 0, 3, 1 -> evict 0 (slot 0)
  CHECK(s.victims == Ids{0});
  CHECK(s.fill_slots == Ids{0});
}

TEST_CASE("lrfu: hand-computed sequence (half-life 2 forwards)") {
  // One layer, so the clock counts forwards. CRF = sum of 2^(-age/2); the victim is the
  // resident outside the forward with the lowest CRF now.
  ForwardPlanner<Lrfu> p(CacheShape{8, 3}, 1, Lrfu(CacheShape{8, 3}, PoolLayout{}, LrfuParams{2.0, 1.0}));
  (void)run(p, {0});  // t1: CRF0 = 1
  (void)run(p, {0});  // t2: 1 * 2^-0.5 + 1 = 1.707
  (void)run(p, {0});  // t3: 1.707 * 2^-0.5 + 1 = 2.207
  (void)run(p, {1});  // t4: CRF1 = 1
  (void)run(p, {2});  // t5: CRF2 = 1
  // t6: CRF0 = 2.207 * 2^-1.5 = 0.780, CRF1 = 2^-1 = 0.5, CRF2 = 2^-0.5 = 0.707 -> evict 1
  // (LRU would evict 0, the oldest).
  Step s = run(p, {3});
  CHECK(s.victims == Ids{1});
  CHECK(p.policy().crf(ExpertId(0)) == doctest::Approx(2.207107 * std::exp2(-1.5)));
  // t7: CRF0 = 0.552, CRF2 = 0.5, CRF3 = 0.707 -> evict 2. Expert 1 comes back with its
  // history: 1 * 2^-1.5 + 1.
  s = run(p, {1});
  CHECK(s.victims == Ids{2});
  CHECK(p.policy().crf(ExpertId(1)) == doctest::Approx(1.0 + std::exp2(-1.5)));
  // t8: 0 has the lowest CRF but is in the forward; 3 (0.5) goes, not 1 (1.354 * 2^-0.5).
  s = run(p, {4, 0});
  CHECK(s.hits == 1);
  CHECK(s.victims == Ids{3});
}

TEST_CASE("layershare: hand-computed sequence in a two-layer pool") {
  // Layers of 4 experts (ids 0-3 and 4-7), 4 slots: shares start at 2 + 2. Ghost depth
  // 0.1 * 4 rounds up to 1: only the latest victim is a ghost.
  const CacheShape shape{8, 4};
  ForwardPlanner<LayerShare> p(shape, 1, LayerShare(shape, PoolLayout{4}));
  (void)run(p, {0, 1});  // layer 0
  (void)run(p, {4, 5});  // layer 1: full
  // Both layers sit at their share; the first layer wins the tie, its lowest CRF (tie: id) goes.
  Step s = run(p, {2});
  CHECK(s.victims == Ids{0});
  // 0 was the latest victim: a ghost hit, so layer 0's share grows by one slot, taken from
  // layer 1 (3 + 1). Now layer 1 is above its share (2 > 1) and gives the victim.
  s = run(p, {0});
  CHECK(s.victims == Ids{4});
  CHECK(p.policy().share(0) == doctest::Approx(3.0));
  CHECK(p.policy().share(1) == doctest::Approx(1.0));
  CHECK(p.policy().residents(0) == 3);
  CHECK(p.policy().residents(1) == 1);
}

TEST_CASE("wtinylfu: hand-computed sequence through window, probation and protected") {
  // 4 slots: window 1, main 3 (protected target 2).
  const CacheShape shape{16, 4};
  ForwardPlanner<WTinyLfu> p(shape, 1);
  for (const std::int32_t e : {0, 1, 2, 3}) (void)run(p, {e});  // window [3], probation [0 1 2]
  CHECK(p.policy().in_window(ExpertId(3)));
  CHECK(p.policy().in_probation(ExpertId(0)));
  CHECK(run(p, {0}).hits == 1);  // probation hit -> protected
  CHECK(p.policy().in_protected(ExpertId(0)));
  // Candidate 3 (freq 1) does not beat probation's victim 1 (freq 1): 3 is evicted.
  Step s = run(p, {4});
  CHECK(s.victims == Ids{3});
  CHECK(run(p, {4}).hits == 1);  // freq(4) = 2
  // Candidate 4 (freq 2) beats 1 (freq 1): 4 is admitted to probation and 1 goes.
  s = run(p, {5});
  CHECK(s.victims == Ids{1});
  CHECK(p.policy().in_probation(ExpertId(4)));
  CHECK(p.policy().in_window(ExpertId(5)));
  CHECK(p.policy().frequency(ExpertId(4)) == 2);
}

TEST_CASE("sieve: hand-computed sequence") {
  ForwardPlanner<Sieve> p(CacheShape{8, 3}, 1);
  // FIFO (oldest first) 0, 1, 2 in slots 0, 1, 2; hit 0 sets its visited bit.
  (void)run(p, {0});
  (void)run(p, {1});
  (void)run(p, {2});
  CHECK(run(p, {0}).hits == 1);
  // [3]: the hand starts at 0 (visited: clear, pass), evicts 1; the hand stays at 2.
  Step s = run(p, {3});
  CHECK(s.victims == Ids{1});
  CHECK(s.fill_slots == Ids{1});
  // [1]: hand at 2 (unvisited) -> evict 2; hand moves to 3.  Queue: 0, 3, 1.
  s = run(p, {1});
  CHECK(s.victims == Ids{2});
  CHECK(s.fill_slots == Ids{2});
  // [2]: hand at 3 -> evict 3; hand moves to 1.  Queue: 0, 1, 2.
  s = run(p, {2});
  CHECK(s.victims == Ids{3});
  CHECK(s.fill_slots == Ids{1});
  // [4]: hand at 1 -> evict 1. Expert 0 survives all of it on one hit.
  s = run(p, {4});
  CHECK(s.victims == Ids{1});
  CHECK(p.is_resident(0));
}

TEST_CASE("sieve: victim protection passes over the forward's entries") {
  ForwardPlanner<Sieve> p(CacheShape{8, 2}, 1);
  (void)run(p, {0});
  (void)run(p, {1});
  CHECK(run(p, {1}).hits == 1);  // 1 visited
  // [2,3]: 2 evicts 0 (unvisited); hand -> 1. 3: 1 visited -> clear, pass; 2 is in the
  // forward -> pass; wrap to 1 -> evict it. Unprotected SIEVE would have taken 2.
  const Step s = run(p, {2, 3});
  CHECK(s.victims == Ids{0, 1});
  CHECK(p.is_resident(2));
  CHECK(p.is_resident(3));
}

TEST_CASE("s3fifo: hand-computed sequence through small, main and ghost") {
  // capacity 4: small target 1, ghost holds 3 ids.
  ForwardPlanner<S3Fifo> p(CacheShape{16, 4}, 1);
  for (std::int32_t e = 0; e < 4; ++e) (void)run(p, {e});  // S: 0 1 2 3
  CHECK(run(p, {0}).hits == 1);                           // 0 hit in S
  // [4]: S tail 0 was hit -> moves to M (freq reset); 1 was not -> victim, ghosted.
  Step s = run(p, {4});
  CHECK(s.victims == Ids{1});
  CHECK(p.policy().in_main(ExpertId(0)));
  CHECK(p.policy().freq(ExpertId(0)) == 0);
  CHECK(p.policy().in_ghost(ExpertId(1)));
  // [1]: ghost hit -> inserted into M; the victim is S's tail 2.
  s = run(p, {1});
  CHECK(s.victims == Ids{2});
  CHECK(p.policy().in_main(ExpertId(1)));
  CHECK_FALSE(p.policy().in_ghost(ExpertId(1)));
  // [2] ghost -> M, victim 3; [3] ghost -> M, victim 4. S is now empty, M: 0 1 2 3.
  CHECK(run(p, {2}).victims == Ids{3});
  CHECK(run(p, {3}).victims == Ids{4});
  CHECK(p.policy().small_size() == 0);
  CHECK(p.policy().main_size() == 4);
  // Two hits on 0 (freq 2). [5]: S below target -> evict from M: 0 reinserted (freq 1),
  // 1 evicted without a ghost.
  (void)run(p, {0});
  (void)run(p, {0});
  CHECK(p.policy().freq(ExpertId(0)) == 2);
  s = run(p, {5});
  CHECK(s.victims == Ids{1});
  CHECK(p.policy().freq(ExpertId(0)) == 1);
  CHECK_FALSE(p.policy().in_ghost(ExpertId(1)));
  // [1]: not a ghost -> enters S; S (5) is at target -> victim 5, ghosted.
  s = run(p, {1});
  CHECK(s.victims == Ids{5});
  CHECK(p.policy().in_small(ExpertId(1)));
  CHECK(p.policy().in_ghost(ExpertId(5)));
}

TEST_CASE("s3fifo: ghost forgets beyond its capacity; protection falls back to main") {
  ForwardPlanner<S3Fifo> g(CacheShape{16, 4}, 1);  // ghost capacity 3
  for (std::int32_t e = 0; e < 8; ++e) (void)run(g, {e});  // victims 0..3 ghosted in order
  CHECK_FALSE(g.policy().in_ghost(ExpertId(0)));  // pushed out by 1, 2, 3
  CHECK(g.policy().in_ghost(ExpertId(1)));
  CHECK(g.policy().in_ghost(ExpertId(3)));

  ForwardPlanner<S3Fifo> p(CacheShape{16, 2}, 1);  // small target 1
  (void)run(p, {0});
  (void)run(p, {1});
  (void)run(p, {0});  // 0 hit
  // [2,3]: 2: S tail 0 (hit) -> M, 1 -> victim. 3: S holds only 2, which is in the forward,
  // so the victim comes from M: 0.
  const Step s = run(p, {2, 3});
  CHECK(s.victims == Ids{1, 0});
}

TEST_CASE("arc: hand-computed sequence with ghost hits adapting p") {
  ForwardPlanner<Arc> p(CacheShape{8, 2}, 1);
  (void)run(p, {0});  // T1: 0
  (void)run(p, {1});  // T1: 0 1
  (void)run(p, {0});  // hit: T2: 0, T1: 1
  CHECK(p.policy().in_t2(ExpertId(0)));
  // [2]: new; |T1| = 1 > p = 0 -> evict T1's LRU 1 into B1.
  Step s = run(p, {2});
  CHECK(s.victims == Ids{1});
  CHECK(p.policy().in_b1(ExpertId(1)));
  // [1]: B1 ghost hit: p = 0 + max(1, |B2|/|B1|) = 1. |T1| = 1 is not > p -> evict T2's
  // LRU 0 into B2; 1 goes to T2.
  s = run(p, {1});
  CHECK(s.victims == Ids{0});
  CHECK(p.policy().target_t1() == doctest::Approx(1.0));
  CHECK(p.policy().in_t2(ExpertId(1)));
  CHECK(p.policy().in_b2(ExpertId(0)));
  // [0]: B2 ghost hit: p = max(0, 1 - max(1, 0/1)) = 0. |T1| = 1 > 0 -> evict 2 into B1.
  s = run(p, {0});
  CHECK(s.victims == Ids{2});
  CHECK(p.policy().target_t1() == doctest::Approx(0.0));
  CHECK(p.policy().in_b1(ExpertId(2)));
  // [3]: new; T1 empty -> evict T2's LRU 1 into B2; 3 enters T1.
  s = run(p, {3});
  CHECK(s.victims == Ids{1});
  CHECK(p.policy().in_b2(ExpertId(1)));
  CHECK(p.policy().in_t1(ExpertId(3)));
}

TEST_CASE("belady: hand-computed sequences") {
  SUBCASE("furthest next use") {
    const Forwards f{{0}, {1}, {2}, {0}, {1}, {2}};
    const CacheShape shape{8, 2};
    ForwardPlanner<Belady> p(shape, 1, make_policy<Belady>(shape, f));
    (void)run(p, f[0]);
    (void)run(p, f[1]);
    CHECK(run(p, f[2]).victims == Ids{1});  // 0 is next used at 3, 1 at 4
    CHECK(run(p, f[3]).hits == 1);
    CHECK(run(p, f[4]).victims == Ids{0});  // 0 never again, 2 at 5
    CHECK(run(p, f[5]).hits == 1);
    CHECK(p.counters().hits == 2);
    CHECK(p.policy().divergent_forwards() == 0);
  }
  SUBCASE("never again ties go to the lowest id") {
    const Forwards f{{3}, {1}, {2}};
    const CacheShape shape{8, 2};
    ForwardPlanner<Belady> p(shape, 1, make_policy<Belady>(shape, f));
    (void)run(p, f[0]);
    (void)run(p, f[1]);
    CHECK(run(p, f[2]).victims == Ids{1});
  }
  SUBCASE("protection inside a forward") {
    const Forwards f{{0}, {1}, {2, 3}, {0}};
    const CacheShape shape{8, 2};
    ForwardPlanner<Belady> p(shape, 1, make_policy<Belady>(shape, f));
    (void)run(p, f[0]);
    (void)run(p, f[1]);
    // 2: 1 is never used again -> victim 1. 3: only 0 is outside the forward -> victim 0.
    CHECK(run(p, f[2]).victims == Ids{1, 0});
  }
  SUBCASE("a forward that differs from the future is counted") {
    const Forwards f{{0}, {1}};
    const CacheShape shape{8, 2};
    ForwardPlanner<Belady> p(shape, 1, make_policy<Belady>(shape, f));
    (void)run(p, {0});
    (void)run(p, {2});
    CHECK(p.policy().divergent_forwards() == 1);
  }
  SUBCASE("bad futures are rejected") {
    CHECK_THROWS_AS(BeladyFuture(4, Forwards{{0, 4}}), Error);
    CHECK_THROWS_AS(BeladyFuture(4, Forwards{{1, 1}}), Error);
    const auto fut = std::make_shared<const BeladyFuture>(4, Forwards{{0}});
    CHECK_THROWS_AS(Belady(fut, CacheShape{5, 2}), Error);
  }
}

// ---------------------------------------------------------------------------------------
// Properties over random traces, every policy

namespace {

// Checks in-forward protection and map consistency after every forward; returns hits.
template <class P>
std::uint64_t replay_checked(const Forwards& forwards, CacheShape shape, std::uint64_t seed,
                             bool with_invalidations, PoolLayout layout = {}) {
  ForwardPlanner<P> planner(shape, 1, make_policy<P>(shape, forwards, layout));
  std::mt19937_64 rng(seed);
  ForwardPlan plan;
  for (const Ids& f : forwards) {
    if (with_invalidations && rng() % 8 == 0) {
      REQUIRE(planner.invalidate(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(shape.num_experts))).ok());
    }
    const Status s = planner.plan_unique(f, plan);
    // The planner rejects a victim inside the forward with ErrorCode::internal.
    REQUIRE_MESSAGE(s.ok(), s.to_string());
    for (const auto& ev : plan.evictions) {
      REQUIRE(std::find(f.begin(), f.end(), ev.expert.value) == f.end());
    }
    REQUIRE(plan.hits + plan.misses == f.size());
    for (const std::int32_t e : f) {
      const std::int32_t slot = planner.resident_map()[static_cast<std::size_t>(e)];
      REQUIRE(slot >= 0);
      REQUIRE(planner.forward_map()[static_cast<std::size_t>(e)] == slot);
      REQUIRE(planner.slot_owner()[static_cast<std::size_t>(slot)] == e);
    }
    // Every slot holds at most one expert and the owner table mirrors the resident map.
    std::int32_t owned = 0;
    for (std::int32_t slot = 0; slot < shape.capacity; ++slot) {
      const std::int32_t owner = planner.slot_owner()[static_cast<std::size_t>(slot)];
      if (owner < 0) continue;
      ++owned;
      REQUIRE(planner.resident_map()[static_cast<std::size_t>(owner)] == slot);
    }
    REQUIRE(owned == planner.resident_count());
  }
  if constexpr (std::is_same_v<P, Belady>) REQUIRE(planner.policy().divergent_forwards() == 0);
  return planner.counters().hits;
}

template <class P>
void protection_property() {
  for (std::uint64_t seed = 1; seed <= 80; ++seed) {
    const std::int32_t experts = seed % 2 == 0 ? 16 : 48;
    const auto capacity = 1 + static_cast<std::int32_t>(seed % 12);
    CAPTURE(seed);
    const Forwards f = random_forwards(seed, experts, capacity, 300);
    (void)replay_checked<P>(f, CacheShape{experts, capacity}, seed, true);
  }
  // A global pool over several layers, the layer split given to policies that take it.
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    const std::int32_t layers = 2 + static_cast<std::int32_t>(seed % 5), experts = 8 + static_cast<std::int32_t>(seed % 9);
    const std::int32_t width = 1 + static_cast<std::int32_t>(seed % 4);
    const std::int32_t capacity = width + static_cast<std::int32_t>(seed % static_cast<std::uint64_t>(layers * experts - width));
    CAPTURE(seed);
    const Forwards f = pool_forwards(seed, layers, experts, width, 120);
    (void)replay_checked<P>(f, CacheShape{layers * experts, capacity}, seed, true, PoolLayout{experts});
  }
}

}  // namespace

TEST_CASE_TEMPLATE("victim protection and map consistency over random traces", P, Lru, Lfru, Sieve,
                   S3Fifo, Arc, WTinyLfu, Lrfu, LayerShare, Belady) {
  protection_property<P>();
}

TEST_CASE("OPT hits >= every online policy's hits over random traces") {
  std::uint64_t strictly_better = 0;
  for (std::uint64_t seed = 100; seed < 300; ++seed) {
    const std::int32_t experts = 8 + static_cast<std::int32_t>(seed % 57);
    const auto capacity = 1 + static_cast<std::int32_t>(seed % static_cast<std::uint64_t>(std::min(experts, 20)));
    const CacheShape shape{experts, capacity};
    const Forwards f = random_forwards(seed, experts, std::min(capacity, 6), 250);
    CAPTURE(seed);
    const std::uint64_t opt = replay_checked<Belady>(f, shape, seed, false);
    const std::uint64_t online[] = {
        replay_checked<Lru>(f, shape, seed, false),    replay_checked<Lfru>(f, shape, seed, false),
        replay_checked<Sieve>(f, shape, seed, false),  replay_checked<S3Fifo>(f, shape, seed, false),
        replay_checked<Arc>(f, shape, seed, false),    replay_checked<WTinyLfu>(f, shape, seed, false),
        replay_checked<Lrfu>(f, shape, seed, false),   replay_checked<LayerShare>(f, shape, seed, false),
    };
    for (const std::uint64_t h : online) {
      REQUIRE(opt >= h);
      if (opt > h) ++strictly_better;
    }
  }
  CHECK(strictly_better > 800);  // the traces do separate OPT from the online policies
}

TEST_CASE("OPT hits >= the layer-aware policies' hits in a global pool") {
  for (std::uint64_t seed = 1; seed <= 60; ++seed) {
    const std::int32_t layers = 2 + static_cast<std::int32_t>(seed % 6), experts = 8 + static_cast<std::int32_t>(seed % 17);
    const std::int32_t width = 2 + static_cast<std::int32_t>(seed % 5);
    const std::int32_t capacity = width + static_cast<std::int32_t>(seed * 7 % static_cast<std::uint64_t>(layers * experts - width));
    const CacheShape shape{layers * experts, capacity};
    const PoolLayout layout{experts};
    const Forwards f = pool_forwards(seed, layers, experts, width, 150);
    CAPTURE(seed);
    const std::uint64_t opt = replay_checked<Belady>(f, shape, seed, false);
    REQUIRE(opt >= replay_checked<Lrfu>(f, shape, seed, false, layout));
    REQUIRE(opt >= replay_checked<LayerShare>(f, shape, seed, false, layout));
    REQUIRE(opt >= replay_checked<WTinyLfu>(f, shape, seed, false));
  }
}

TEST_CASE_TEMPLATE("layer-aware policies are deterministic in a global pool", P, Lrfu, LayerShare) {
  const CacheShape shape{6 * 16, 30};
  const PoolLayout layout{16};
  const Forwards f = pool_forwards(5, 6, 16, 4, 200);
  ForwardPlanner<P> a(shape, 1, P(shape, layout));
  ForwardPlanner<P> b(shape, 1, P(shape, layout));
  ForwardPlan pa, pb;
  for (const Ids& ids : f) {
    REQUIRE(a.plan_unique(ids, pa).ok());
    REQUIRE(b.plan_unique(ids, pb).ok());
    REQUIRE(pa.evictions == pb.evictions);
  }
  CHECK(a.snapshot() == b.snapshot());
  // The layer split matters: the same policy without it makes other choices.
  ForwardPlanner<P> flat(shape, 1, P(shape));
  for (const Ids& ids : f) REQUIRE(flat.plan_unique(ids, pa).ok());
  CHECK(flat.counters().hits != a.counters().hits);
}

TEST_CASE_TEMPLATE("policies are values: a copied planner replays identically", P, Lru, Lfru, Sieve,
                   S3Fifo, Arc, WTinyLfu, Lrfu, LayerShare, Belady) {
  const CacheShape shape{32, 6};
  const Forwards f = random_forwards(7, shape.num_experts, shape.capacity, 200);
  ForwardPlanner<P> a(shape, 1, make_policy<P>(shape, f));
  ForwardPlan plan;
  for (std::size_t t = 0; t < 100; ++t) REQUIRE(a.plan_unique(f[t], plan).ok());
  ForwardPlanner<P> b = a;
  REQUIRE(a.snapshot() == b.snapshot());
  for (std::size_t t = 100; t < f.size(); ++t) {
    REQUIRE(a.plan_unique(f[t], plan).ok());
    REQUIRE(b.plan_unique(f[t], plan).ok());
  }
  CHECK(a.snapshot() == b.snapshot());
  CHECK(a.policy() == b.policy());
  // Equality is not vacuous: a fresh policy differs from one that has seen traffic.
  CHECK_FALSE(a.policy() == make_policy<P>(shape, f));
}

TEST_CASE_TEMPLATE("planning allocates nothing after warm-up", P, Lru, Lfru, Sieve, S3Fifo, Arc, WTinyLfu, Lrfu,
                   LayerShare, Belady) {
  const CacheShape shape{512, 208};
  const Forwards f = random_forwards(3, shape.num_experts, 10, 3000);
  ForwardPlanner<P> planner(shape, 10, make_policy<P>(shape, f));
  // The plan is caller-owned; sized once here, so any growth below would be the planner's
  // or the policy's.
  ForwardPlan plan;
  plan.unique.reserve(208);
  plan.fills.reserve(208);
  plan.evictions.reserve(208);
  std::size_t t = 0;
  for (; t < 500; ++t) REQUIRE(planner.plan_unique(f[t], plan).ok());
  std::uint64_t misses_before = planner.counters().misses;
  const std::uint64_t before = g_allocations.load();
  bool all_ok = true;
  for (; t < f.size(); ++t) all_ok = planner.plan_unique(f[t], plan).ok() && all_ok;
  const std::uint64_t after = g_allocations.load();
  CHECK(all_ok);
  CHECK(after == before);
  CHECK(planner.counters().misses > misses_before);  // evictions did happen in the window
}

// A copy does not keep std::vector::reserve(): a policy that relied on it would allocate on
// the hot path once copied (a planner takes its policy by value). Copy a fresh policy, build
// the planner from the copy, and plan a whole stream from cold: no allocation anywhere.
TEST_CASE_TEMPLATE("a copied policy plans without allocating", P, Lru, Lfru, Sieve, S3Fifo, Arc, WTinyLfu, Lrfu,
                   LayerShare, Belady) {
  const CacheShape shape{512, 208};
  const Forwards f = random_forwards(3, shape.num_experts, 10, 3000);
  const P original = make_policy<P>(shape, f, PoolLayout{64});
  P copy = original;  // the copy constructor under test
  ForwardPlanner<P> planner(shape, 10, std::move(copy));
  ForwardPlan plan;
  plan.unique.reserve(208);
  plan.fills.reserve(208);
  plan.evictions.reserve(208);
  const std::uint64_t before = g_allocations.load();
  bool all_ok = true;
  for (const Ids& ids : f) all_ok = planner.plan_unique(ids, plan).ok() && all_ok;
  const std::uint64_t after = g_allocations.load();
  CHECK(all_ok);
  CHECK(after - before == 0);
  CHECK(planner.counters().evictions > 0);  // the pool filled and evicted inside the window
  // Copy assignment over a policy of another shape must not leave a too-small buffer either.
  P assigned = make_policy<P>(CacheShape{512, 4}, f, PoolLayout{64});
  assigned = original;
  ForwardPlanner<P> planner2(shape, 10, std::move(assigned));
  const std::uint64_t before2 = g_allocations.load();
  for (const Ids& ids : f) all_ok = planner2.plan_unique(ids, plan).ok() && all_ok;
  CHECK(all_ok);
  CHECK(g_allocations.load() - before2 == 0);
}

// ---------------------------------------------------------------------------------------
// Recommended instantiations (docs/policies.md "Choosing a policy"): the aliases name
// the intended policy, and a cache built from them plans a trace exactly as that policy's
// planner does (same hits and misses per forward, same final residency and policy state).

namespace {

using SimLayout = ExplicitLayout;
ExplicitLayout alias_layout() { return ExplicitLayout{{{{"w13", 64}, {"w2", 32}}}}; }

// A cache's prepare() plans top-k ids (deduplicated, in ascending order): plan the same way.
template <class P>
Step run_topk(ForwardPlanner<P>& planner, const Ids& topk_ids) {
  ForwardPlan plan;
  const Status s = planner.plan_topk(topk_ids, plan);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  return Step{plan.hits, plan.misses, {}, {}};
}

template <class P>
void same_planner_state(const ForwardPlanner<P>& got, const ForwardPlanner<P>& want) {
  const auto g = got.snapshot();
  const auto w = want.snapshot();
  CHECK(g.resident_map == w.resident_map);
  CHECK(g.slot_owner == w.slot_owner);
  CHECK(g.free_slots == w.free_slots);
  CHECK(g.policy == w.policy);
  CHECK(g.counters.hits == w.counters.hits);
  CHECK(g.counters.misses == w.counters.misses);
  CHECK(g.counters.evictions == w.counters.evictions);
}

// One ExpertCache alias over `forwards`, against ForwardPlanner<P> with P built from the shape.
template <class Cache, class P>
void cache_plans_as_planner(std::uint64_t seed) {
  constexpr std::int32_t E = 16, C = 6, K = 4;
  const Forwards forwards = random_forwards(seed, E, K, 300);
  SimRuntime rt;
  const auto x = rt.create_stream().value();
  CacheOptions o;
  o.num_experts = E;
  o.capacity = C;
  o.top_k = K;
  Cache cache(rt, o, alias_layout());
  ForwardPlanner<P> want(CacheShape{E, C}, K, P(CacheShape{E, C}));
  std::size_t mismatched = 0;
  for (const Ids& f : forwards) {
    const auto v = cache.prepare(f, x);
    REQUIRE(v.ok());
    const Step s = run_topk(want, f);
    mismatched += v.value().hits != s.hits || v.value().misses != s.misses;
    rt.drain();
  }
  CHECK(mismatched == 0);
  same_planner_state(cache.planner(), want);
}

}  // namespace

TEST_CASE("recommended cache aliases name their policies; the standard ones keep theirs") {
  static_assert(std::is_same_v<RecommendedRowCache<SimRuntime, SimLayout>::Policy, Lrfu>);
  static_assert(std::is_same_v<RecommendedWholeExpertCache<SimRuntime, SimLayout>::Policy, Lrfu>);
  static_assert(std::is_same_v<RecommendedModelCache<SimRuntime, SimLayout>::Policy, LayerShare>);
  static_assert(std::is_same_v<RowCache<SimRuntime, SimLayout>::Policy, Lru>);           // row provider parity
  static_assert(std::is_same_v<WholeExpertCache<SimRuntime, SimLayout>::Policy, Lfru>);  // vLLM parity
  static_assert(std::is_same_v<RecommendedRowCache<SimRuntime, SimLayout>::StorageType,
                               RowCache<SimRuntime, SimLayout>::StorageType>);
  static_assert(std::is_same_v<RecommendedWholeExpertCache<SimRuntime, SimLayout>::StorageType,
                               WholeExpertCache<SimRuntime, SimLayout>::StorageType>);
  CHECK(RecommendedRowCache<SimRuntime, SimLayout>::Policy::name == std::string_view("lrfu"));
}

TEST_CASE("recommended per-layer caches plan a trace as ForwardPlanner<Lrfu>") {
  for (const std::uint64_t seed : {3u, 4u}) {
    CAPTURE(seed);
    cache_plans_as_planner<RecommendedRowCache<SimRuntime, SimLayout>, Lrfu>(seed);
    cache_plans_as_planner<RecommendedWholeExpertCache<SimRuntime, SimLayout>, Lrfu>(seed);
  }
}

TEST_CASE("RecommendedModelCache plans as ForwardPlanner<LayerShare> (global) and as Lrfu (per layer)") {
  constexpr std::int32_t L = 3, E = 8, K = 3;
  const Forwards forwards = pool_forwards(9, L, E, K, 120);  // ids l*E + e, layers in order
  const auto options = [&](std::int32_t capacity, ModelPool pool) {
    ModelCacheOptions o;
    o.num_layers = L;
    o.num_experts = E;
    o.capacity = capacity;
    o.top_k = K;
    o.pool = pool;
    return o;
  };
  SUBCASE("global pool: one LayerShare over L*E ids with PoolLayout{E}") {
    constexpr std::int32_t C = 7;
    SimRuntime rt;
    const auto x = rt.create_stream().value();
    RecommendedModelCache<SimRuntime, SimLayout> model(rt, options(C, ModelPool::global), alias_layout());
    const CacheShape shape{L * E, C};
    ForwardPlanner<LayerShare> want(shape, K, LayerShare(shape, PoolLayout{E}));
    std::size_t mismatched = 0;
    for (std::size_t t = 0; t < forwards.size(); ++t) {
      const auto layer = static_cast<std::int32_t>(t % L);
      Ids local = forwards[t];
      for (std::int32_t& e : local) e -= layer * E;
      const auto v = model.prepare(layer, local, x);
      REQUIRE(v.ok());
      const Step s = run_topk(want, forwards[t]);
      mismatched += v.value().hits != s.hits || v.value().misses != s.misses;
      rt.drain();
    }
    CHECK(mismatched == 0);
    same_planner_state(model.planner(), want);
  }
  SUBCASE("per-layer pools: each layer's one-layer LayerShare plans exactly as Lrfu") {
    constexpr std::int32_t C = 4;
    SimRuntime rt;
    const auto x = rt.create_stream().value();
    RecommendedModelCache<SimRuntime, SimLayout> model(rt, options(C, ModelPool::per_layer), alias_layout());
    std::vector<ForwardPlanner<Lrfu>> want;
    for (std::int32_t l = 0; l < L; ++l) want.emplace_back(CacheShape{E, C}, K, Lrfu(CacheShape{E, C}));
    std::size_t mismatched = 0, other_state = 0;
    for (std::size_t t = 0; t < forwards.size(); ++t) {
      const auto layer = static_cast<std::int32_t>(t % L);
      Ids local = forwards[t];
      for (std::int32_t& e : local) e -= layer * E;
      const auto v = model.prepare(layer, local, x);
      REQUIRE(v.ok());
      const Step s = run_topk(want[static_cast<std::size_t>(layer)], local);
      mismatched += v.value().hits != s.hits || v.value().misses != s.misses;
      const auto& got = model.planner(layer);
      other_state += !std::ranges::equal(got.resident_map(), want[static_cast<std::size_t>(layer)].resident_map());
      rt.drain();
    }
    CHECK(mismatched == 0);
    CHECK(other_state == 0);
  }
}
