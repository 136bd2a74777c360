// Scored prefetch hints: HintSelector (prefetch/hint_selection.hpp) and the planner's scored
// plan_prefetch: order by score (ties in the caller's order), the min_score threshold, the byte
// budget and the protections kept, every bad input refused before any state change, no
// allocation per call. The caches' prefetch() with scores: tests/host/test_prefetch.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "expert_cache/eviction/all.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/prefetch/hint_selection.hpp"
#include "support/allocation_counter.hpp"  // the one TU of this program that replaces operator new

using namespace expert_cache;
using Ids = std::vector<std::int32_t>;
using Scores = std::vector<float>;

namespace {

constexpr float nan_score = std::numeric_limits<float>::quiet_NaN();
constexpr float inf_score = std::numeric_limits<float>::infinity();

Ids selected(const HintSelector& h) { return Ids(h.ids().begin(), h.ids().end()); }

bool contains(std::string_view text, std::string_view part) { return text.find(part) != std::string_view::npos; }

// The rule written out plainly: for each score at or above min_score, highest first, the ids
// with that score in the caller's order. (No std::stable_sort: its buffer comes from a nothrow
// operator new, which this program's allocation counter does not replace.)
Ids reference_selection(const Ids& ids, const Scores& scores, float min_score) {
  Scores levels;
  for (const float s : scores) {
    if (s >= min_score && std::find(levels.begin(), levels.end(), s) == levels.end()) levels.push_back(s);
  }
  std::sort(levels.begin(), levels.end(), [](float a, float b) { return a > b; });
  Ids out;
  for (const float level : levels) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (scores[i] == level) out.push_back(ids[i]);
    }
  }
  return out;
}

template <class Policy>
ForwardPlanner<Policy> make_planner(CacheShape shape) {
  return ForwardPlanner<Policy>(shape, 1);
}

Ids experts_of(const std::vector<SlotFill>& fills) {
  Ids out;
  for (const SlotFill& f : fills) out.push_back(f.expert.value);
  return out;
}

}  // namespace

// ---- HintSelector ----------------------------------------------------------------------------

TEST_CASE("hint selection: without scores the ids pass through as given") {
  HintSelector h(8);
  const Ids ids{5, 3, 5, 0};
  REQUIRE(h.select(ids, {}, default_min_score).ok());
  CHECK(h.ids().data() == ids.data());  // the caller's list itself, not a copy
  CHECK(h.ids().size() == 4);
  CHECK(h.skipped_unlikely() == 0);
  // min_score does not filter an unscored list (any valid value).
  REQUIRE(h.select(ids, {}, 1.0f).ok());
  CHECK(selected(h) == ids);
  REQUIRE(h.select({}, {}, 0.0f).ok());
  CHECK(h.ids().empty());
}

TEST_CASE("hint selection: highest score first, equal scores in the caller's order") {
  HintSelector h(16);
  const Ids ids{5, 3, 9, 1, 7, 2};
  const Scores scores{0.6f, 0.9f, 0.6f, 1.0f, 0.6f, 0.75f};
  REQUIRE(h.select(ids, scores, 0.5f).ok());
  CHECK(selected(h) == Ids{1, 3, 2, 5, 9, 7});  // 1.0, 0.9, 0.75, then the three 0.6 as given
  CHECK(h.skipped_unlikely() == 0);
  // All equal: exactly the caller's order.
  const Scores flat(ids.size(), 0.8f);
  REQUIRE(h.select(ids, flat, 0.5f).ok());
  CHECK(selected(h) == ids);
  // Ascending scores: reversed.
  REQUIRE(h.select(ids, Scores{0.5f, 0.6f, 0.7f, 0.8f, 0.9f, 1.0f}, 0.5f).ok());
  CHECK(selected(h) == Ids{2, 7, 1, 9, 3, 5});
}

TEST_CASE("hint selection: scores below min_score are skipped and counted; min_score itself is kept") {
  HintSelector h(16);
  const Ids ids{4, 8, 6, 2};
  const Scores scores{0.49f, 0.5f, 0.2f, 0.51f};
  REQUIRE(h.select(ids, scores, 0.5f).ok());
  CHECK(selected(h) == Ids{2, 8});
  CHECK(h.skipped_unlikely() == 2);
  REQUIRE(h.select(ids, scores, 0.0f).ok());  // 0: every hint, in score order
  CHECK(selected(h) == Ids{2, 8, 4, 6});
  CHECK(h.skipped_unlikely() == 0);
  REQUIRE(h.select(ids, scores, 1.0f).ok());  // 1: only certain hints
  CHECK(h.ids().empty());
  CHECK(h.skipped_unlikely() == 4);
  REQUIRE(h.select(ids, Scores{1.0f, 0.0f, 1.0f, 0.0f}, 1.0f).ok());
  CHECK(selected(h) == Ids{4, 6});
  CHECK(h.skipped_unlikely() == 2);
  // Repeated ids are entries like any other (the planner counts the repeat as resident).
  REQUIRE(h.select(Ids{3, 3, 3}, Scores{0.4f, 0.9f, 0.6f}, 0.5f).ok());
  CHECK(selected(h) == Ids{3, 3});
  CHECK(h.skipped_unlikely() == 1);
}

TEST_CASE("hint selection: every bad input is a specific error and keeps the previous selection") {
  HintSelector h(4);
  const Ids ids{3, 1, 2};
  REQUIRE(h.select(ids, Scores{0.7f, 0.2f, 0.9f}, 0.5f).ok());
  const Ids before = selected(h);
  REQUIRE(before == Ids{2, 3});
  auto unchanged = [&] {
    CHECK(selected(h) == before);
    CHECK(h.skipped_unlikely() == 1);
  };

  Status s = h.select(ids, Scores{0.7f, 0.2f}, 0.5f);
  CHECK(s.code() == ErrorCode::invalid_argument);
  CHECK(contains(s.message(), "2 scores for 3 predicted ids"));
  unchanged();
  s = h.select(ids, Scores{0.7f, 0.2f, 0.9f, 0.1f}, 0.5f);
  CHECK(s.code() == ErrorCode::invalid_argument);
  CHECK(contains(s.message(), "4 scores for 3 predicted ids"));
  unchanged();

  struct Bad {
    float value;
    const char* shown;
  };
  for (const Bad bad : {Bad{nan_score, "nan"}, Bad{inf_score, "inf"}, Bad{-inf_score, "-inf"}, Bad{-0.25f, "-0.25"},
                        Bad{1.5f, "1.5"}}) {
    CAPTURE(bad.shown);
    s = h.select(ids, Scores{0.7f, bad.value, 0.9f}, 0.5f);
    CHECK(s.code() == ErrorCode::invalid_argument);
    CHECK(contains(s.message(), std::string("score ") + bad.shown + " at index 1 (expert 1)"));
    CHECK(contains(s.message(), "not a probability in [0, 1]"));
    unchanged();
  }
  for (const Bad bad : {Bad{nan_score, "nan"}, Bad{-0.5f, "-0.5"}, Bad{1.25f, "1.25"}, Bad{inf_score, "inf"}}) {
    CAPTURE(bad.shown);
    s = h.select(ids, Scores{0.7f, 0.2f, 0.9f}, bad.value);
    CHECK(s.code() == ErrorCode::invalid_argument);
    CHECK(contains(s.message(), std::string("min_score ") + bad.shown + " is not in [0, 1]"));
    unchanged();
    // A bad min_score is refused without scores too.
    CHECK(h.select(ids, {}, bad.value).code() == ErrorCode::invalid_argument);
    unchanged();
  }
  s = h.select(Ids{0, 1, 2, 3, 0}, {}, 0.5f);
  CHECK(s.code() == ErrorCode::too_many_experts);
  CHECK(contains(s.message(), "5 predicted ids, more than the 4 experts"));
  unchanged();
  CHECK_THROWS_AS(HintSelector(-1), Error);
}

TEST_CASE("hint selection: the rule equals its plain statement over random lists, without allocating") {
  std::mt19937_64 rng(42);
  HintSelector h(64);
  // Scores on a coarse grid, so that ties are common.
  std::vector<Ids> lists;
  std::vector<Scores> scores;
  std::vector<float> mins;
  for (int round = 0; round < 400; ++round) {
    const std::size_t n = rng() % 65;
    Ids ids;
    Scores sc;
    for (std::size_t i = 0; i < n; ++i) {
      ids.push_back(static_cast<std::int32_t>(rng() % 64));
      sc.push_back(static_cast<float>(rng() % 9) / 8.0f);
    }
    lists.push_back(ids);
    scores.push_back(sc);
    mins.push_back(static_cast<float>(rng() % 9) / 8.0f);
  }
  std::vector<Ids> got(lists.size());
  std::vector<std::uint32_t> skipped(lists.size());
  for (std::size_t r = 0; r < lists.size(); ++r) got[r].reserve(64);
  bool all_ok = true;
  const std::uint64_t before = expert_cache::test::g_allocations.load();
  for (std::size_t r = 0; r < lists.size(); ++r) {
    all_ok = h.select(lists[r], scores[r], mins[r]).ok() && all_ok;
    got[r].assign(h.ids().begin(), h.ids().end());  // within the reserved room
    skipped[r] = h.skipped_unlikely();
  }
  const std::uint64_t after = expert_cache::test::g_allocations.load();
  CHECK(all_ok);
  CHECK(after == before);
  for (std::size_t r = 0; r < lists.size(); ++r) {
    CAPTURE(r);
    const Ids want = reference_selection(lists[r], scores[r], mins[r]);
    CHECK(got[r] == want);
    CHECK(skipped[r] == lists[r].size() - want.size());
  }
}

// ---- ForwardPlanner::plan_prefetch with scores ------------------------------------------------

#define SCORED_POLICIES Lru, Lfru, S3Fifo, LayerShare

TEST_CASE_TEMPLATE("scored plan_prefetch: fills by score within the budget; the unlikely ones never", Policy,
                   SCORED_POLICIES) {
  auto p = make_planner<Policy>(CacheShape{12, 6});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{0, 1}, fwd).ok());
  // 4 free slots, budget 2: the two best of {4: 0.6, 5: 0.9, 6: 0.3, 7: 0.95, 8: 0.6}.
  const Ids ids{4, 5, 6, 7, 8};
  const Scores scores{0.6f, 0.9f, 0.3f, 0.95f, 0.6f};
  REQUIRE(p.plan_prefetch(ids, scores, 0.5f, 2, 1, pre).ok());
  CHECK(experts_of(pre.fills) == Ids{7, 5});
  CHECK(pre.skipped_unlikely == 1);  // 6
  CHECK(pre.skipped_resident == 0);
  CHECK(pre.skipped_no_victim == 0);
  CHECK(p.counters().speculative_issued == 2);
  // Budget 3 on the rest: 4 and 8 tie at 0.6 and keep the caller's order; 7 and 5 are in flight.
  REQUIRE(p.plan_prefetch(ids, scores, 0.5f, 3, 1, pre).ok());
  CHECK(experts_of(pre.fills) == Ids{4, 8});
  CHECK(pre.skipped_resident == 2);
  CHECK(pre.skipped_unlikely == 1);
  CHECK_FALSE(p.is_resident(6));
  // The same ids with 8 first: the tie goes the other way.
  auto q = make_planner<Policy>(CacheShape{12, 6});
  REQUIRE(q.plan_unique(Ids{0, 1}, fwd).ok());
  REQUIRE(q.plan_prefetch(Ids{8, 6, 4}, Scores{0.6f, 0.3f, 0.6f}, 0.5f, 1, 1, pre).ok());
  CHECK(experts_of(pre.fills) == Ids{8});
  // min_score 0 takes 6 too (last: the lowest score); 1 takes nothing.
  REQUIRE(q.plan_prefetch(Ids{6, 9}, Scores{0.3f, 0.31f}, 0.0f, 4, 1, pre).ok());
  CHECK(experts_of(pre.fills) == Ids{9, 6});
  CHECK(pre.skipped_unlikely == 0);
  REQUIRE(q.plan_prefetch(Ids{10, 11}, Scores{0.99f, 0.5f}, 1.0f, 4, 1, pre).ok());
  CHECK(pre.fills.empty());
  CHECK(pre.skipped_unlikely == 2);
}

TEST_CASE_TEMPLATE("scored plan_prefetch: empty scores are the unscored call exactly", Policy, SCORED_POLICIES) {
  std::mt19937_64 rng(7);
  auto scored = make_planner<Policy>(CacheShape{24, 8});
  auto plain = scored;
  ForwardPlan fwd;
  PrefetchPlan a, b;
  for (int step = 0; step < 300; ++step) {
    Ids forward;
    for (int k = 0; k < 3; ++k) forward.push_back(static_cast<std::int32_t>(rng() % 24));
    REQUIRE(scored.plan_topk(forward, fwd).ok());
    REQUIRE(plain.plan_topk(forward, fwd).ok());
    Ids predicted;
    for (std::uint64_t k = rng() % 8; k > 0; --k) predicted.push_back(static_cast<std::int32_t>(rng() % 24));
    const auto fills = static_cast<std::int32_t>(rng() % 4);
    const auto expires = 1 + static_cast<std::uint32_t>(rng() % 3);
    REQUIRE(scored.plan_prefetch(predicted, {}, 0.9f, fills, expires, a).ok());
    REQUIRE(plain.plan_prefetch(predicted, fills, expires, b).ok());
    CHECK(a.fills == b.fills);
    CHECK(a.evictions == b.evictions);
    CHECK(a.skipped_resident == b.skipped_resident);
    CHECK(a.skipped_no_victim == b.skipped_no_victim);
    CHECK(a.skipped_unlikely == 0);
  }
  CHECK(scored.snapshot() == plain.snapshot());
  CHECK(scored.counters().speculative_issued > 0);
}

TEST_CASE_TEMPLATE("scored plan_prefetch: the selected list planned unscored, over random states", Policy,
                   SCORED_POLICIES) {
  // The scored call is the unscored call on reference_selection's list: the same fills,
  // evictions, skips and state, step after step (protections and budget included).
  std::mt19937_64 rng(11);
  auto scored = make_planner<Policy>(CacheShape{20, 6});
  auto plain = scored;
  ForwardPlan fwd;
  PrefetchPlan a, b;
  std::uint64_t unlikely = 0, evictions = 0;
  for (int step = 0; step < 400; ++step) {
    Ids forward;
    for (int k = 0; k < 2; ++k) forward.push_back(static_cast<std::int32_t>(rng() % 20));
    REQUIRE(scored.plan_topk(forward, fwd).ok());
    REQUIRE(plain.plan_topk(forward, fwd).ok());
    Ids predicted;
    Scores scores;
    for (std::uint64_t k = rng() % 10; k > 0; --k) {
      predicted.push_back(static_cast<std::int32_t>(rng() % 20));
      scores.push_back(static_cast<float>(rng() % 11) / 10.0f);
    }
    const float min_score = static_cast<float>(rng() % 11) / 10.0f;
    const auto fills = static_cast<std::int32_t>(rng() % 5);
    const auto expires = 1 + static_cast<std::uint32_t>(rng() % 3);
    const Ids chosen = reference_selection(predicted, scores, min_score);
    REQUIRE(scored.plan_prefetch(predicted, scores, min_score, fills, expires, a).ok());
    REQUIRE(plain.plan_prefetch(chosen, fills, expires, b).ok());
    CHECK(a.fills == b.fills);
    CHECK(a.evictions == b.evictions);
    CHECK(a.skipped_resident == b.skipped_resident);
    CHECK(a.skipped_no_victim == b.skipped_no_victim);
    CHECK(a.skipped_unlikely == predicted.size() - chosen.size());
    CHECK(static_cast<std::int32_t>(a.fills.size()) <= fills);
    unlikely += a.skipped_unlikely;
    evictions += a.evictions.size();
    if (step % 37 == 0) {
      (void)scored.invalidate(forward[0]);
      (void)plain.invalidate(forward[0]);
    }
  }
  CHECK(scored.snapshot() == plain.snapshot());
  CHECK(unlikely > 0);
  CHECK(evictions > 0);  // the runs did evict for hints, under the protections
}

TEST_CASE_TEMPLATE("scored plan_prefetch keeps the protections: the last forward and live fills stay", Policy, Lru,
                   Lfru, S3Fifo) {
  auto p = make_planner<Policy>(CacheShape{10, 4});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{0, 1, 2, 3}, fwd).ok());
  REQUIRE(p.plan_unique(Ids{0, 1}, fwd).ok());
  // 2 and 3 may go; the third hint finds every slot protected (0, 1 forward; 8, 9 earlier hints).
  REQUIRE(p.plan_prefetch(Ids{5, 8, 9}, Scores{0.55f, 1.0f, 0.8f}, 0.5f, 3, 2, pre).ok());
  CHECK(experts_of(pre.fills) == Ids{8, 9});
  CHECK(pre.skipped_no_victim == 1);  // 5, the least likely
  for (const SlotEviction& v : pre.evictions) CHECK((v.expert.value == 2 || v.expert.value == 3));
  // A later, more confident call may not evict the live fills 8 and 9 either.
  REQUIRE(p.plan_prefetch(Ids{6}, Scores{1.0f}, 0.5f, 1, 1, pre).ok());
  CHECK(pre.fills.empty());
  CHECK(pre.skipped_no_victim == 1);
  CHECK(p.is_speculative(8));
  CHECK(p.is_speculative(9));
  CHECK(p.is_resident(0));
  CHECK(p.is_resident(1));
}

TEST_CASE_TEMPLATE("scored plan_prefetch: an unlikely resident counts as unlikely and is not protected", Policy, Lru,
                   Lfru) {
  auto p = make_planner<Policy>(CacheShape{10, 3});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{2}, fwd).ok());
  REQUIRE(p.plan_unique(Ids{3}, fwd).ok());
  REQUIRE(p.plan_unique(Ids{4}, fwd).ok());  // full: 2, 3 evictable, 4 the last forward
  // 2 is hinted, but below min_score: not a hint, so it may go for 7 (unscored, a hint at the
  // head of the list would be protected).
  REQUIRE(p.plan_prefetch(Ids{2, 7, 8}, Scores{0.1f, 0.9f, 0.8f}, 0.5f, 2, 1, pre).ok());
  CHECK(pre.skipped_unlikely == 1);
  CHECK(pre.skipped_resident == 0);
  CHECK(experts_of(pre.fills) == Ids{7, 8});
  CHECK_FALSE(p.is_resident(2));
  CHECK_FALSE(p.is_resident(3));
  CHECK(p.is_resident(4));
}

TEST_CASE_TEMPLATE("scored plan_prefetch rejects bad input before any state change", Policy, SCORED_POLICIES) {
  auto p = make_planner<Policy>(CacheShape{8, 4});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{0, 1, 2}, fwd).ok());
  REQUIRE(p.plan_prefetch(Ids{5, 6}, Scores{0.9f, 0.2f}, 0.5f, 2, 2, pre).ok());
  REQUIRE(pre.fills.size() == 1);
  const auto before = p.snapshot();
  const Ids forward_before(p.forward_map().begin(), p.forward_map().end());
  const std::vector<SlotFill> fills_before = pre.fills;
  auto unchanged = [&] {
    CHECK(p.snapshot() == before);
    CHECK(Ids(p.forward_map().begin(), p.forward_map().end()) == forward_before);
    CHECK(pre.fills == fills_before);  // the caller's plan is not cleared either
    CHECK(pre.skipped_unlikely == 1);
  };
  const Ids ids{6, 7};
  Status s = p.plan_prefetch(ids, Scores{0.9f}, 0.5f, 2, 1, pre);
  CHECK(s.code() == ErrorCode::invalid_argument);
  CHECK(contains(s.message(), "1 scores for 2 predicted ids"));
  unchanged();
  s = p.plan_prefetch(ids, Scores{0.9f, nan_score}, 0.5f, 2, 1, pre);
  CHECK(s.code() == ErrorCode::invalid_argument);
  CHECK(contains(s.message(), "score nan at index 1 (expert 7)"));
  unchanged();
  s = p.plan_prefetch(ids, Scores{inf_score, 0.5f}, 0.5f, 2, 1, pre);
  CHECK(s.code() == ErrorCode::invalid_argument);
  CHECK(contains(s.message(), "score inf at index 0 (expert 6)"));
  unchanged();
  s = p.plan_prefetch(ids, Scores{0.9f, 1.01f}, 0.5f, 2, 1, pre);
  CHECK(s.code() == ErrorCode::invalid_argument);
  CHECK(contains(s.message(), "at index 1 (expert 7)"));
  unchanged();
  s = p.plan_prefetch(ids, Scores{-0.01f, 0.5f}, 0.5f, 2, 1, pre);
  CHECK(s.code() == ErrorCode::invalid_argument);
  unchanged();
  for (const float bad : {nan_score, -0.1f, 1.1f, inf_score}) {
    CAPTURE(bad);
    s = p.plan_prefetch(ids, Scores{0.9f, 0.9f}, bad, 2, 1, pre);
    CHECK(s.code() == ErrorCode::invalid_argument);
    CHECK(contains(s.message(), "min_score"));
    unchanged();
    CHECK(p.plan_prefetch(ids, {}, bad, 2, 1, pre).code() == ErrorCode::invalid_argument);
    unchanged();
  }
  // An id out of range is an error even where its score would skip it.
  s = p.plan_prefetch(Ids{6, 8}, Scores{0.9f, 0.1f}, 0.5f, 2, 1, pre);
  CHECK(s.code() == ErrorCode::expert_out_of_range);
  CHECK(contains(s.message(), "8"));
  unchanged();
  // The unscored checks come first and stay what they were.
  CHECK(p.plan_prefetch(Ids(9, 6), Scores(9, 0.9f), 0.5f, 2, 1, pre).code() == ErrorCode::too_many_experts);
  unchanged();
  CHECK(p.plan_prefetch(ids, Scores{0.9f, 0.9f}, 0.5f, -1, 1, pre).code() == ErrorCode::invalid_argument);
  unchanged();
  CHECK(p.plan_prefetch(ids, Scores{0.9f, 0.9f}, 0.5f, 2, 0, pre).code() == ErrorCode::invalid_argument);
  unchanged();
  CHECK(p.is_speculative(5));
}

TEST_CASE("scored plan_prefetch allocates nothing after the plan's first use") {
  ForwardPlanner<Lru> p(CacheShape{64, 16}, 4);
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_topk(Ids{0, 1, 2, 3}, fwd).ok());
  REQUIRE(p.plan_prefetch(Ids{9}, Scores{1.0f}, 0.5f, 1, 1, pre).ok());  // sizes the plan's vectors once
  std::mt19937_64 rng(3);
  std::vector<Ids> forwards(200), lists(200);
  std::vector<Scores> scores(200);
  for (std::size_t i = 0; i < 200; ++i) {
    for (int k = 0; k < 4; ++k) forwards[i].push_back(static_cast<std::int32_t>(rng() % 64));
    for (int k = 0; k < 12; ++k) {
      lists[i].push_back(static_cast<std::int32_t>(rng() % 64));
      scores[i].push_back(static_cast<float>(rng() % 101) / 100.0f);
    }
  }
  bool all_ok = true;
  std::uint64_t issued = 0;
  const std::uint64_t before = expert_cache::test::g_allocations.load();
  for (std::size_t i = 0; i < 200; ++i) {
    all_ok = p.plan_topk(forwards[i], fwd).ok() && all_ok;
    all_ok = p.plan_prefetch(lists[i], scores[i], 0.5f, 4, 1, pre).ok() && all_ok;
    issued += pre.fills.size();
  }
  const std::uint64_t after = expert_cache::test::g_allocations.load();
  CHECK(all_ok);
  CHECK(after == before);
  CHECK(issued > 0);
}

// ---- precision feedback (prefetch/rank_precision.hpp) ----

TEST_CASE("rank precision: trusted at first, throttled after wasted fills, probed while its skipped hints look right, restored by used fills") {
  RankPrecision r;
  CHECK(r.precision(0) == 1.0f);
  CHECK(r.precision(100) == r.precision(RankPrecision::buckets - 1));  // past the last bucket: shared
  CHECK(r.admit(0, 0.5f));
  int wasted = 0;
  while (r.precision(0) >= 0.5f) {
    r.record(RankPrecision::bucket(0), false);
    ++wasted;
  }
  CHECK(wasted == 11);  // (15/16)^11 < 0.5 <= (15/16)^10
  CHECK(r.precision(1) == 1.0f);  // other ranks keep their own estimate
  // Throttled: one hint in probe_every is admitted, the others are not.
  int admitted = 0;
  for (std::uint32_t i = 0; i < 4 * RankPrecision::probe_every; ++i) admitted += r.admit(0, 0.5f) ? 1 : 0;
  CHECK(admitted == 4);
  // Its skipped hints, watched, turn out unread: no more probes.
  int unread = 0;
  while (r.watched_precision(0) >= 0.5f) {
    r.record_watched(RankPrecision::bucket(0), false);
    ++unread;
  }
  CHECK(unread == 11);
  CHECK(r.precision(0) < 0.5f);  // a watched outcome is not a fill's
  admitted = 0;
  for (std::uint32_t i = 0; i < 4 * RankPrecision::probe_every; ++i) admitted += r.admit(0, 0.5f) ? 1 : 0;
  CHECK(admitted == 0);
  CHECK(r.admit(1, 0.5f));
  CHECK(r.admit(0, 0.0f));  // a threshold of 0 admits everything
  // Read again: the probes resume.
  while (r.watched_precision(0) < 0.5f) r.record_watched(RankPrecision::bucket(0), true);
  admitted = 0;
  for (std::uint32_t i = 0; i < 2 * RankPrecision::probe_every; ++i) admitted += r.admit(0, 0.5f) ? 1 : 0;
  CHECK(admitted == 2);
  int used = 0;
  while (r.precision(0) < 0.5f) {
    r.record(RankPrecision::bucket(0), true);
    ++used;
  }
  CHECK(used >= 1);
  CHECK(used <= 11);
  CHECK(r.admit(0, 0.5f));
}

// Outcomes of one kind (0 = wasted) that bring a rank's moving average from `from` to the other
// side of the admission floor (RankPrecision::min_admit_precision): what feedback needs before it acts.
int outcomes_to_cross(float from, bool used) {
  float p = from;
  int n = 0;
  const float floor = RankPrecision::min_admit_precision;
  while (used ? p < floor : p >= floor) {
    p += RankPrecision::weight * ((used ? 1.0f : 0.0f) - p);
    ++n;
  }
  return n;
}

TEST_CASE_TEMPLATE("plan_prefetch with precision feedback: ranks whose fills go unused stop fetching, the others keep on",
                   Policy, Lru, Lfru) {
  // Each round: a forward of {0, 1}, then a prefetch of [2 + r % 8 (used next round), 20 + r % 8
  // (never used)], budget 2, expiring after one forward. Rank 0's fills are used, rank 1's wasted.
  for (const bool feedback : {false, true}) {
    CAPTURE(feedback);
    auto p = make_planner<Policy>(CacheShape{40, 8});
    ForwardPlan fwd;
    PrefetchPlan pre;
    std::uint64_t rank1_fills = 0, imprecise = 0;
    Ids next_forward{0, 1};
    for (int round = 0; round < 200; ++round) {
      REQUIRE(p.plan_unique(next_forward, fwd).ok());
      const std::int32_t good = 2 + round % 8, bad = 20 + round % 8;
      REQUIRE(p.plan_prefetch(Ids{good, bad}, Scores{}, 0.5f, 2, 1, pre, feedback).ok());
      for (const SlotFill& f : pre.fills) rank1_fills += f.expert.value == bad ? 1 : 0;
      imprecise += pre.skipped_imprecise;
      CHECK(pre.skipped_unlikely == 0);
      next_forward = Ids{0, good};
    }
    const PlannerCounters& c = p.counters();
    if (!feedback) {
      CHECK(rank1_fills == 200);
      CHECK(imprecise == 0);
    } else {
      // Four wasted fills bring rank 1 below the floor of 0.8 (the threshold min_score 0.5 alone took
      // eleven); its skipped hints, watched, are never read, and as many of them end the probes before
      // the first one would run.
      CHECK(rank1_fills == static_cast<std::uint64_t>(outcomes_to_cross(1.0f, false)));
      CHECK(rank1_fills == 4);
      CHECK(imprecise == 200 - rank1_fills);
    }
    CHECK(c.speculative_used >= 190);  // rank 0 is never throttled (its fills are used)
    CHECK(c.speculative_wasted + c.speculative_used + static_cast<std::uint64_t>(p.speculative_count()) ==
          c.speculative_issued);
  }
}

TEST_CASE_TEMPLATE("plan_prefetch with precision feedback: a throttled rank is probed again once its skipped hints turn right",
                   Policy, Lru, Lfru) {
  // Rounds 0-99: rank 0's hint is never read (throttled after 4 wasted fills, no probe once its
  // watched hints are seen unread). From round 100 on it is the next forward's expert: its
  // watched hints turn out read, the probes resume, and the probes' fills, used, restore the rank
  // once its precision is back over the floor of 0.8.
  auto p = make_planner<Policy>(CacheShape{40, 8});
  ForwardPlan fwd;
  PrefetchPlan pre;
  Ids next_forward{0, 1};
  int fills_while_wrong = 0, first_fill_when_right = -1, last_round_without_fill = -1;
  std::uint64_t watched_used = 0;
  constexpr int rounds = 400;
  for (int round = 0; round < rounds; ++round) {
    REQUIRE(p.plan_unique(next_forward, fwd).ok());
    const std::int32_t hint = 2 + round % 30;
    const bool right = round >= 100;
    REQUIRE(p.plan_prefetch(Ids{hint}, Scores{}, 0.5f, 1, 1, pre, true).ok());
    REQUIRE(pre.fills.size() + pre.skipped_imprecise + pre.skipped_resident == 1);
    if (!right) fills_while_wrong += static_cast<int>(pre.fills.size());
    if (right && !pre.fills.empty() && first_fill_when_right < 0) first_fill_when_right = round;
    if (right && pre.skipped_imprecise == 1) ++watched_used;
    if (pre.fills.empty()) last_round_without_fill = round;
    next_forward = right ? Ids{0, hint} : Ids{0, 1};
  }
  const int to_throttle = outcomes_to_cross(1.0f, false);
  CHECK(fills_while_wrong == to_throttle);
  REQUIRE(first_fill_when_right >= 100);
  // Read watches bring the watched precision back over the floor (from at worst 0), then at most one
  // probe period passes before a probe.
  const int period = static_cast<int>(RankPrecision::probe_every);
  const int watches_to_recover = outcomes_to_cross(0.0f, true);
  CHECK(first_fill_when_right <= 100 + watches_to_recover + 1 + period);
  CHECK(watched_used >= 1);
  // Each used probe raises the rank's precision; as many as the floor needs restore it, one period apart.
  float after_throttle = 1.0f;
  for (int i = 0; i < to_throttle; ++i) after_throttle -= RankPrecision::weight * after_throttle;
  const int probes_to_restore = outcomes_to_cross(after_throttle, true);
  CHECK(probes_to_restore >= 1);
  CHECK(last_round_without_fill < 100 + watches_to_recover + 1 + probes_to_restore * period);
  CHECK(p.counters().speculative_used >= static_cast<std::uint64_t>(rounds - last_round_without_fill - 2));
}

TEST_CASE("plan_prefetch with precision feedback: fills that are used but evict what the next forward misses stop") {
  // Five slots, Lru; forwards alternate between {0, 1, h} and {2, 3, h}, h the previous round's
  // hint. Every hint is used, but its fill evicts the least recently used of the other forward's
  // experts (0, 1 and h are protected), which the next forward misses: each fill saves one copy
  // and costs one. With feedback the rank's
  // precision net of that regret falls below the floor (0.8) and its fills stop but for probes.
  for (const bool feedback : {false, true}) {
    CAPTURE(feedback);
    auto p = make_planner<Lru>(CacheShape{200, 5});
    ForwardPlan fwd;
    PrefetchPlan pre;
    std::int32_t hint = 10;
    int late_fills = 0;
    for (int round = 0; round < 120; ++round) {
      const Ids forward = round % 2 == 0 ? Ids{0, 1, hint} : Ids{2, 3, hint};
      REQUIRE(p.plan_unique(forward, fwd).ok());
      hint = 10 + round + 1;
      REQUIRE(p.plan_prefetch(Ids{hint}, Scores{}, 0.5f, 1, 1, pre, feedback).ok());
      if (round >= 60) late_fills += static_cast<int>(pre.fills.size());
    }
    CHECK(p.counters().speculative_wasted == 0u);  // every fill issued was used
    if (feedback) {
      CHECK(p.snapshot().precision.regret(0) > 1.0f - RankPrecision::min_admit_precision);
      CHECK(late_fills <= 3);  // probes only: the skipped hints are read, so probes go on
    } else {
      CHECK(late_fills == 60);
      CHECK(p.snapshot().precision.regret(0) > 0.9f);  // measured without feedback too
    }
  }
}

TEST_CASE("plan_prefetch with precision feedback: a fill's victim is watched; missed is regret, read resident is not") {
  auto p = make_planner<Lru>(CacheShape{10, 4});
  ForwardPlan fwd;
  PrefetchPlan pre;
  for (std::int32_t e = 0; e < 4; ++e) REQUIRE(p.plan_unique(Ids{e}, fwd).ok());  // residents 0-3, 3 protected
  REQUIRE(p.plan_prefetch(Ids{5}, Scores{}, 0.5f, 1, 1, pre, true).ok());
  REQUIRE(pre.evictions.size() == 1);
  REQUIRE(pre.evictions[0].expert.value == 0);
  CHECK(p.snapshot().victims[0] == 8u);  // eight times the fill's protection of one forward
  // Fetched back (evicting 1, the next least recent) and read resident: no regret.
  REQUIRE(p.plan_prefetch(Ids{0}, Scores{}, 0.5f, 1, 1, pre, false).ok());
  REQUIRE(pre.evictions.size() == 1);
  REQUIRE(pre.evictions[0].expert.value == 1);
  REQUIRE(p.plan_unique(Ids{0, 5}, fwd).ok());
  CHECK(p.snapshot().victims[0] == 0u);
  CHECK(p.snapshot().victims[1] == 7u);
  CHECK(p.snapshot().precision.regret(0) == 0.0f);
  // 1 is missed: the regret of the rank whose fill evicted it.
  REQUIRE(p.plan_unique(Ids{1}, fwd).ok());
  CHECK(p.snapshot().victims[1] == 0u);
  CHECK(p.snapshot().precision.regret(0) > 0.0f);
  CHECK(p.snapshot().precision.regret(1) == 0.0f);
}

TEST_CASE("plan_prefetch with precision feedback: a watched hint that is fetched or expires leaves no watch behind") {
  auto p = make_planner<Lru>(CacheShape{10, 3});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{0}, fwd).ok());
  for (std::int32_t i = 0; i < outcomes_to_cross(1.0f, false); ++i) {  // rank 0 throttled
    REQUIRE(p.plan_prefetch(Ids{1 + i % 9}, Scores{}, 0.5f, 1, 1, pre, true).ok());
    REQUIRE(p.plan_unique(Ids{0}, fwd).ok());
  }
  // Watched, then fetched without feedback: the fill's outcome stands for it.
  REQUIRE(p.plan_prefetch(Ids{6}, Scores{}, 0.5f, 1, 2, pre, true).ok());
  REQUIRE(pre.skipped_imprecise == 1);
  CHECK(p.snapshot().watched[6] == 2u);
  REQUIRE(p.plan_prefetch(Ids{6}, Scores{}, 0.5f, 1, 2, pre, false).ok());
  REQUIRE(experts_of(pre.fills) == Ids{6});
  CHECK(p.snapshot().watched[6] == 0u);
  // Watched for two forwards that do not read it: wasted, and gone.
  REQUIRE(p.plan_prefetch(Ids{7}, Scores{}, 0.5f, 1, 2, pre, true).ok());
  REQUIRE(pre.skipped_imprecise == 1);
  const float before = p.snapshot().precision.watched_precision(0);
  REQUIRE(p.plan_unique(Ids{0}, fwd).ok());
  CHECK(p.snapshot().watched[7] == 1u);
  REQUIRE(p.plan_unique(Ids{0}, fwd).ok());
  CHECK(p.snapshot().watched[7] == 0u);
  CHECK(p.snapshot().precision.watched_precision(0) < before);
}

TEST_CASE("plan_prefetch with precision feedback: a skipped hint is not protected, and the outcome state is part of the snapshot") {
  auto p = make_planner<Lru>(CacheShape{10, 3});
  ForwardPlan fwd;
  PrefetchPlan pre;
  REQUIRE(p.plan_unique(Ids{0}, fwd).ok());
  // Rank 0 wasted until it is throttled.
  for (std::int32_t i = 0; i < outcomes_to_cross(1.0f, false); ++i) {
    REQUIRE(p.plan_prefetch(Ids{1 + i % 9}, Scores{}, 0.5f, 1, 1, pre, true).ok());
    REQUIRE(pre.fills.size() == 1);
    REQUIRE(p.plan_unique(Ids{0}, fwd).ok());  // the fill expires unused
  }
  REQUIRE_FALSE(p.is_resident(6));
  REQUIRE_FALSE(p.is_resident(7));
  const auto before = p.snapshot();
  REQUIRE(p.plan_prefetch(Ids{6, 7}, Scores{}, 0.5f, 2, 1, pre, true).ok());
  CHECK(pre.skipped_imprecise == 1);       // 6, at rank 0
  CHECK(experts_of(pre.fills) == Ids{7});  // rank 1 is still trusted
  CHECK_FALSE(p.is_resident(6));
  CHECK(p.snapshot() != before);  // 6 is watched, and the probe counter moved
  // The same call without feedback fetches rank 0 again.
  REQUIRE(p.plan_unique(Ids{0}, fwd).ok());
  REQUIRE(p.plan_prefetch(Ids{6}, Scores{}, 0.5f, 1, 1, pre, false).ok());
  CHECK(experts_of(pre.fills) == Ids{6});
  CHECK(pre.skipped_imprecise == 0);
}
