// Next-layer predictors (prefetch/predictors.hpp): rankings on hand-made traces, the emulated
// hints' exact recall, determinism, errors, no allocation per call. The replay with prefetch
// (tools/prefetch_replay.hpp): counts by hand, invariants against the plain replay.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "expert_cache/base/splitmix64.hpp"
#include "expert_cache/prefetch/predictors.hpp"
#include "expert_cache/tools/prefetch_replay.hpp"
#include "expert_cache/tools/replay.hpp"
#include "expert_cache/tools/trace_generator.hpp"
#include "expert_cache/tools/trace_io.hpp"
#include "support/allocation_counter.hpp"  // the one TU of this program that replaces operator new

using namespace expert_cache;

namespace {

using Ids = std::vector<std::int32_t>;

template <class P>
Ids predict(P& p, std::int32_t layer, const Ids& current, std::int32_t max_ids = 64, const Ids& truth = {}) {
  std::span<const std::int32_t> out;
  const Status s = p.predict(PredictionQuery{0, layer, current, truth}, max_ids, out);
  REQUIRE(s.ok());
  return Ids(out.begin(), out.end());
}

template <class P>
void observe(P& p, std::int32_t step, std::int32_t layer, const Ids& experts) {
  REQUIRE(p.observe(step, layer, experts).ok());
}

// Three layers, four experts, three tokens (see the pair counts in the first test).
template <class P>
void feed_small_trace(P& p) {
  observe(p, 0, 0, {0, 1});
  observe(p, 0, 1, {2});
  observe(p, 0, 2, {3});
  observe(p, 1, 0, {1});
  observe(p, 1, 1, {3});
  observe(p, 1, 2, {0});
  observe(p, 2, 0, {0});
  observe(p, 2, 1, {2, 3});
  observe(p, 2, 2, {1});
}

std::size_t count_in(const Ids& list, const Ids& set) {
  return static_cast<std::size_t>(
      std::count_if(list.begin(), list.end(), [&](std::int32_t id) { return std::find(set.begin(), set.end(), id) != set.end(); }));
}

bool unique_ids(Ids list) {
  std::sort(list.begin(), list.end());
  return std::adjacent_find(list.begin(), list.end()) == list.end();
}

}  // namespace

TEST_CASE("coact: rankings on a hand-made trace (summed counts, ties to the lower id)") {
  CoactivationPredictor p(3, 4);
  CHECK(predict(p, 0, {0}).empty());  // nothing learned yet: no guesses
  feed_small_trace(p);
  // Pair (0,1): step 0 {0,1}x{2}, step 1 {1}x{3}, step 2 {0}x{2,3}.
  CHECK(p.weight(0, 0, 2) == 2.0);
  CHECK(p.weight(0, 0, 3) == 1.0);
  CHECK(p.weight(0, 1, 2) == 1.0);
  CHECK(p.weight(0, 1, 3) == 1.0);
  CHECK(p.weight(0, 0, 0) == 0.0);
  CHECK(p.updates() == 6);
  CHECK(predict(p, 0, {0}) == Ids{2, 3});
  CHECK(predict(p, 0, {1}) == Ids{2, 3});  // tie 1:1 -> lower id first
  CHECK(predict(p, 0, {0, 1}) == Ids{2, 3});
  CHECK(predict(p, 0, {0, 1}, 1) == Ids{2});
  CHECK(predict(p, 0, {0, 1}, 0).empty());
  // Pair (1,2): step 0 {2}x{3}, step 1 {3}x{0}, step 2 {2,3}x{1}.
  CHECK(predict(p, 1, {3}) == Ids{0, 1});
  CHECK(predict(p, 1, {2}) == Ids{1, 3});
  CHECK(predict(p, 1, {2, 3}) == Ids{1, 0, 3});  // 1: 2, then 0 and 3 tied at 1
  CHECK(predict(p, 2, {0, 1, 2, 3}).empty());    // the last layer predicts nothing
}

TEST_CASE("coact: only consecutive layers of one step are paired") {
  CoactivationPredictor p(3, 4);
  observe(p, 0, 0, {0});
  observe(p, 0, 2, {1});  // layer 1 missing: no pair (0,1) or (1,2) update
  observe(p, 1, 1, {2});  // new step: not paired with step 0's layer 2
  CHECK(p.updates() == 0);
  CHECK(predict(p, 1, {2}).empty());
  observe(p, 1, 2, {3});
  CHECK(p.updates() == 1);
  CHECK(predict(p, 1, {2}) == Ids{3});
  CHECK(predict(p, 0, {0}).empty());
}

TEST_CASE("coact: decay favours recent co-activations") {
  CoactivationPredictor plain(2, 4);
  CoactivationPredictor decayed(2, 4, 0.5);
  for (CoactivationPredictor* p : {&plain, &decayed}) {
    observe(*p, 0, 0, {0});
    observe(*p, 0, 1, {1});
    observe(*p, 1, 0, {0});
    observe(*p, 1, 1, {2});
  }
  CHECK(predict(plain, 0, {0}) == Ids{1, 2});  // 1:1, lower id first
  CHECK(predict(decayed, 0, {0}) == Ids{2, 1});
  CHECK(decayed.weight(0, 0, 2) == 1.0);
  CHECK(decayed.weight(0, 0, 1) == 0.5);
  // Many updates: the rescale keeps the ratios (d^n) finite and exact enough.
  CoactivationPredictor longrun(2, 4, 0.5);
  for (std::int32_t s = 0; s < 2000; ++s) {
    observe(longrun, s, 0, {0});
    observe(longrun, s, 1, {s % 2 == 0 ? 1 : 2});
  }
  CHECK(predict(longrun, 0, {0}) == Ids{2, 1});  // step 1999 (odd) routed to 2
  CHECK(longrun.weight(0, 0, 2) == doctest::Approx(1.0 / (1.0 - 0.25)));
  CHECK(longrun.weight(0, 0, 1) == doctest::Approx(0.5 / (1.0 - 0.25)));
}

TEST_CASE("prev: the previous token's experts of the next layer") {
  PreviousTokenPredictor p(3, 8);
  CHECK(predict(p, 0, {1}).empty());
  observe(p, 0, 0, {0, 1});
  observe(p, 0, 1, {2, 5, 7});
  observe(p, 1, 0, {4});
  CHECK(predict(p, 0, {4}) == Ids{2, 5, 7});
  CHECK(predict(p, 0, {4}, 2) == Ids{2, 5});
  CHECK(predict(p, 1, {2}).empty());  // layer 2 never observed
  observe(p, 1, 1, {3});
  CHECK(predict(p, 0, {4}) == Ids{3});
  CHECK(predict(p, 2, {0}).empty());  // last layer
}

TEST_CASE("hint: list of k ids with round(R*k) true ones at the first query") {
  const Ids truth{1, 4, 6, 9};
  for (const double r : {1.0, 0.75, 0.5, 0.25, 0.1}) {
    EmulatedHintPredictor p(2, 16, r, 7);
    const Ids out = predict(p, 0, {0}, 64, truth);
    CAPTURE(r);
    CHECK(out.size() == truth.size());
    CHECK(unique_ids(out));
    CHECK(count_in(out, truth) == static_cast<std::size_t>(std::llround(r * 4)));
    CHECK(std::all_of(out.begin(), out.end(), [](std::int32_t id) { return id >= 0 && id < 16; }));
  }
  EmulatedHintPredictor full(2, 16, 1.0);
  Ids out = predict(full, 0, {0}, 64, truth);
  std::sort(out.begin(), out.end());
  CHECK(out == truth);
  CHECK(predict(full, 0, {0}, 2, truth).size() == 2);   // cut to max_ids
  CHECK(predict(full, 0, {0}, 64, {}).empty());         // no truth: nothing to hint
  CHECK(predict(full, 1, {0}, 64, truth).empty());      // last layer
  // Fewer wrong ids than asked for: as many as exist.
  EmulatedHintPredictor tight(2, 4, 0.34);
  const Ids few = predict(tight, 0, {0}, 64, {0, 1, 2});  // 1 true, 2 wrong asked, 1 exists
  CHECK(few.size() == 2);
  CHECK(count_in(few, {0, 1, 2}) == 1);
  CHECK(count_in(few, {3}) == 1);
}

TEST_CASE("hint: over many forwards the share of true ids is R (running round(R * total))") {
  for (const double r : {0.8, 0.5, 0.33, 1.0, 0.05}) {
    CAPTURE(r);
    EmulatedHintPredictor p(2, 64, r, 3);
    detail::SplitMix64 rng{11};
    std::uint64_t total = 0, returned_true = 0, returned = 0;
    for (int q = 0; q < 3000; ++q) {
      const std::size_t k = 1 + rng.below(10);
      Ids truth;
      while (truth.size() < k) {
        const auto id = static_cast<std::int32_t>(rng.below(64));
        if (std::find(truth.begin(), truth.end(), id) == truth.end()) truth.push_back(id);
      }
      const Ids out = predict(p, 0, {0}, 64, truth);
      REQUIRE(out.size() == k);  // k ids: the wrong ones fill what the true ones leave
      REQUIRE(unique_ids(out));
      total += k;
      returned_true += count_in(out, truth);
      returned += out.size();
      // Exact at every step, not only on average.
      REQUIRE(returned_true == static_cast<std::uint64_t>(std::llround(r * static_cast<double>(total))));
    }
    CHECK(p.truth_total() == total);
    CHECK(p.true_returned() == returned_true);
    CHECK(static_cast<double>(returned_true) / static_cast<double>(total) == doctest::Approx(r).epsilon(1e-3));
    CHECK(returned == total);
  }
}

TEST_CASE("hint: every true expert is equally likely to be hinted") {
  EmulatedHintPredictor p(2, 32, 0.5, 5);
  const Ids truth{3, 8, 13, 21, 30, 31};
  std::vector<int> seen(32, 0);
  const int queries = 6000;
  for (int q = 0; q < queries; ++q) {
    for (const std::int32_t id : predict(p, 0, {0}, 64, truth)) ++seen[static_cast<std::size_t>(id)];
  }
  for (const std::int32_t id : truth) {
    CAPTURE(id);
    CHECK(static_cast<double>(seen[static_cast<std::size_t>(id)]) / queries == doctest::Approx(0.5).epsilon(0.06));
  }
  // Wrong ids: 3 per query spread over the 26 others (about 3/26 each).
  for (std::int32_t id = 0; id < 32; ++id) {
    if (std::find(truth.begin(), truth.end(), id) != truth.end()) continue;
    CAPTURE(id);
    CHECK(static_cast<double>(seen[static_cast<std::size_t>(id)]) / queries == doctest::Approx(3.0 / 26).epsilon(0.2));
  }
}

TEST_CASE("predictors are deterministic; the hint's seed changes its draws") {
  auto run_hint = [](std::uint64_t seed) {
    EmulatedHintPredictor p(3, 32, 0.6, seed);
    std::vector<Ids> lists;
    detail::SplitMix64 rng{2};
    for (int q = 0; q < 200; ++q) {
      Ids truth;
      for (std::int32_t id = 0; id < 32; ++id) {
        if (rng.below(5) == 0) truth.push_back(id);
      }
      lists.push_back(predict(p, q % 2, {0}, 64, truth));
    }
    return lists;
  };
  CHECK(run_hint(9) == run_hint(9));
  CHECK(run_hint(9) != run_hint(10));
  auto run_coact = [] {
    CoactivationPredictor p(4, 16, 0.9);
    detail::SplitMix64 rng{4};
    std::vector<Ids> lists;
    for (std::int32_t s = 0; s < 300; ++s) {
      for (std::int32_t l = 0; l < 4; ++l) {
        Ids e;
        for (std::int32_t id = 0; id < 16; ++id) {
          if (rng.below(4) == 0) e.push_back(id);
        }
        observe(p, s, l, e);
        lists.push_back(predict(p, l, e, 5));
      }
    }
    return lists;
  };
  CHECK(run_coact() == run_coact());
}

TEST_CASE("predictors: bad input is an error and changes nothing") {
  CoactivationPredictor c(3, 4);
  feed_small_trace(c);
  std::span<const std::int32_t> out;
  const Ids ok{0};
  CHECK(c.observe(3, 0, Ids{4}).code() == ErrorCode::expert_out_of_range);
  CHECK(c.observe(3, 0, Ids{-1}).code() == ErrorCode::expert_out_of_range);
  CHECK(c.observe(3, 0, Ids{1, 1}).code() == ErrorCode::duplicate_expert);
  CHECK(c.observe(3, 3, ok).code() == ErrorCode::invalid_argument);
  CHECK(c.observe(3, -1, ok).code() == ErrorCode::invalid_argument);
  CHECK(c.predict(PredictionQuery{3, 0, Ids{9}, {}}, 4, out).code() == ErrorCode::expert_out_of_range);
  CHECK(c.predict(PredictionQuery{3, 0, ok, {}}, -1, out).code() == ErrorCode::invalid_argument);
  CHECK(c.predict(PredictionQuery{3, 5, ok, {}}, 4, out).code() == ErrorCode::invalid_argument);
  CHECK(out.empty());
  CHECK(c.updates() == 6);
  // A rejected observe of layer 1 must not pair with the accepted layer 0 either.
  observe(c, 3, 0, {1});
  CHECK(c.observe(3, 1, Ids{7}).code() == ErrorCode::expert_out_of_range);
  CHECK(c.updates() == 6);
  CHECK(predict(c, 0, {0}) == Ids{2, 3});

  PreviousTokenPredictor p(2, 4);
  observe(p, 0, 1, {2});
  CHECK(p.observe(1, 1, Ids{5}).code() == ErrorCode::expert_out_of_range);
  CHECK(p.observe(1, 1, Ids{3, 3}).code() == ErrorCode::duplicate_expert);
  CHECK(predict(p, 0, {0}) == Ids{2});

  EmulatedHintPredictor h(2, 4, 0.5);
  CHECK(h.predict(PredictionQuery{0, 0, ok, Ids{4}}, 4, out).code() == ErrorCode::expert_out_of_range);
  CHECK(h.predict(PredictionQuery{0, 0, ok, Ids{1, 1}}, 4, out).code() == ErrorCode::duplicate_expert);
  CHECK(h.truth_total() == 0);

  CHECK_THROWS_AS(EmulatedHintPredictor(2, 4, 0.0), Error);
  CHECK_THROWS_AS(EmulatedHintPredictor(2, 4, 1.5), Error);
  CHECK_THROWS_AS(EmulatedHintPredictor(2, 4, -0.5), Error);
  CHECK_THROWS_AS(EmulatedHintPredictor(2, 4, std::numeric_limits<double>::quiet_NaN()), Error);
  CHECK_THROWS_AS(EmulatedHintPredictor(2, 4, 0.5, 1, HintWrongIds::uniform, -0.1), Error);
  CHECK_THROWS_AS(EmulatedHintPredictor(2, 4, 0.5, 1, HintWrongIds::uniform, 1.5), Error);
  CHECK_THROWS_AS(EmulatedHintPredictor(2, 4, 0.5, 1, HintWrongIds::uniform, std::numeric_limits<double>::quiet_NaN()),
                  Error);
  EmulatedHintPredictor hs(2, 4, 0.5, 1, HintWrongIds::uniform, 0.2);
  REQUIRE(hs.predict(PredictionQuery{0, 0, ok, Ids{1, 2}}, 4, out).ok());
  CHECK(hs.scores().size() == 2);
  CHECK(hs.predict(PredictionQuery{0, 0, ok, Ids{4}}, 4, out).code() == ErrorCode::expert_out_of_range);
  CHECK(out.empty());
  CHECK(hs.scores().empty());  // a rejected query leaves no scores behind either
  CHECK_THROWS_AS(CoactivationPredictor(2, 4, 0.0), Error);
  CHECK_THROWS_AS(CoactivationPredictor(2, 4, 1.01), Error);
  CHECK_THROWS_AS(CoactivationPredictor(0, 4), Error);
  CHECK_THROWS_AS(CoactivationPredictor(2, 0), Error);
  CHECK_THROWS_AS(CoactivationPredictor(100, 1 << 14), Error);  // table above the limit
  CHECK_THROWS_AS(PreviousTokenPredictor(0, 4), Error);
}

TEST_CASE("predictors: observe and predict allocate nothing after construction") {
  CoactivationPredictor c(4, 32, 0.95);
  PreviousTokenPredictor p(4, 32);
  EmulatedHintPredictor h(4, 32, 0.7, 3);
  EmulatedHintPredictor scored(4, 32, 0.7, 3, HintWrongIds::recent, 0.4);
  std::vector<Ids> layers(4);
  detail::SplitMix64 rng{8};
  for (Ids& e : layers) {
    for (std::int32_t id = 0; id < 32; ++id) {
      if (rng.below(4) == 0) e.push_back(id);
    }
  }
  std::span<const std::int32_t> out;
  std::size_t returned = 0;
  const std::uint64_t before = expert_cache::test::g_allocations.load();
  for (std::int32_t s = 0; s < 50; ++s) {
    for (std::int32_t l = 0; l < 4; ++l) {
      const std::span<const std::int32_t> cur(layers[static_cast<std::size_t>(l)]);
      const std::span<const std::int32_t> next(layers[static_cast<std::size_t>((l + 1) % 4)]);
      const PredictionQuery q{s, l, cur, next};
      bool ok = c.observe(s, l, cur).ok() && p.observe(s, l, cur).ok() && h.observe(s, l, cur).ok() &&
                scored.observe(s, l, cur).ok();
      ok = ok && c.predict(q, 8, out).ok();
      returned += out.size();
      ok = ok && p.predict(q, 8, out).ok();
      returned += out.size();
      ok = ok && h.predict(q, 8, out).ok();
      returned += out.size();
      ok = ok && scored.predict(q, 8, out).ok() && scored.scores().size() == out.size();
      returned += out.size();
      if (!ok) break;
    }
  }
  const std::uint64_t after = expert_cache::test::g_allocations.load();
  CHECK(after == before);
  CHECK(returned > 0);
}

// ---- replay with prefetch -----------------------------------------------------------------

namespace {

Trace parsed(const char* text) {
  ToolResult<Trace> t = parse_trace_text(text);
  REQUIRE(t.ok());
  return std::move(t).value();
}

PrefetchReplayReport prefetch_replay(const Trace& trace, ReplayScope scope, std::vector<std::int32_t> capacities,
                                     std::vector<std::string> policies, const char* predictor,
                                     std::optional<std::int32_t> budget = std::nullopt, std::uint64_t bytes = 1000,
                                     bool precision_feedback = false) {
  PrefetchReplayOptions o;
  o.scope = scope;
  o.capacities = std::move(capacities);
  o.policies = std::move(policies);
  Result<PrefetchSpec> spec = parse_prefetch_spec(predictor);
  REQUIRE(spec.ok());
  o.prefetch = spec.value();
  o.budget = budget;
  o.expert_bytes = bytes;
  o.precision_feedback = precision_feedback;
  Result<PrefetchReplayReport> r = replay_with_prefetch(trace, o);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return std::move(r).value();
}

// Online policies (OPT rows are replayed without prefetch).
std::vector<std::string> online_policies() {
  std::vector<std::string> names = replay_policy_names();
  names.erase(std::remove(names.begin(), names.end(), std::string(opt_policy_alias)), names.end());
  return names;
}

// Every run: counts add up, and the metrics are what docs/prefetch.md defines.
void check_invariants(const PrefetchReplayReport& r) {
  REQUIRE(r.rows.size() == r.plain.rows.size());
  for (std::size_t i = 0; i < r.rows.size(); ++i) {
    const PrefetchRow& row = r.rows[i];
    CAPTURE(row.policy);
    CAPTURE(row.capacity);
    CHECK(row.without == r.plain.rows[i].counts);
    if (detail::is_opt_name(row.policy)) {
      CHECK(!row.with);
      continue;
    }
    REQUIRE(row.with);
    REQUIRE(row.speculative);
    const PrefetchCounts& c = *row.speculative;
    CHECK(row.with->accesses() == r.plain.accesses);
    CHECK(c.used <= c.issued);
    CHECK(c.issued == c.used + c.wasted + c.pending);
    CHECK(c.predicted >= c.issued + c.skipped_resident + c.skipped_no_victim + c.skipped_unlikely);
    if (!is_scored(r.prefetch)) CHECK(c.skipped_unlikely == 0);
    CHECK(c.issued <= static_cast<std::uint64_t>(r.budget) * r.plain.forwards);
    CHECK(row.with->hits >= c.used);  // a used fill is a hit
    if (row.without.misses > 0) {
      CHECK(row.coverage.value() == doctest::Approx(static_cast<double>(c.used) / static_cast<double>(row.without.misses)));
    }
    if (c.issued > 0) {
      CHECK(row.precision.value() == doctest::Approx(static_cast<double>(c.used) / static_cast<double>(c.issued)));
    } else {
      CHECK(!row.precision);
    }
    CHECK(row.extra_bytes_per_token.value() ==
          doctest::Approx(static_cast<double>(c.issued - c.used) * static_cast<double>(r.expert_bytes) / r.tokens));
    CHECK(row.bytes_per_token_with.value() ==
          doctest::Approx(static_cast<double>(row.with->misses + c.issued) * static_cast<double>(r.expert_bytes) / r.tokens));
  }
}

}  // namespace

TEST_CASE("prefetch replay: counts by hand (hint:1, layer and global scope)") {
  // Two layers, four experts: (step, layer) {experts}: (0,0){0} (0,1){1} (1,0){2} (1,1){3} (2,0){0} (2,1){2}.
  const Trace trace = parsed("0 0 0\n0 1 1\n1 0 2\n1 1 3\n2 0 0\n2 1 2\n");
  {
    // Layer scope, 2 slots, 1 fill: layer 1's cache gets 1, then 3 (free slots), then 2
    // (evicting 1: 3 is its most recent forward's). Every layer-1 forward hits.
    const PrefetchReplayReport r = prefetch_replay(trace, ReplayScope::layer, {2}, {"lru"}, "hint:1", 1);
    check_invariants(r);
    const PrefetchRow& row = r.rows[0];
    CHECK(r.tokens == 3.0);
    CHECK(r.expires_after == 1);
    CHECK(row.without == ReplayCounts{1, 5, 1});
    CHECK(row.with->hits == 4);
    CHECK(row.with->misses == 2);
    CHECK(row.speculative->issued == 3);
    CHECK(row.speculative->used == 3);
    CHECK(row.speculative->wasted == 0);
    CHECK(row.speculative->pending == 0);
    CHECK(row.coverage.value() == doctest::Approx(0.6));
    CHECK(row.precision.value() == 1.0);
    CHECK(row.extra_bytes_per_token.value() == 0.0);
    CHECK(row.bytes_per_token_with.value() == doctest::Approx((2 + 3) * 1000.0 / 3));
  }
  {
    // Global scope, 3 slots, keys layer*4 + e: 0 | 5 | 2 | 7 | 0 | 6. Without prefetch LRU misses
    // all six; with it every layer-1 key is filled just before its forward.
    const PrefetchReplayReport r = prefetch_replay(trace, ReplayScope::global, {3}, {"lru"}, "hint:1", 1);
    check_invariants(r);
    const PrefetchRow& row = r.rows[0];
    CHECK(r.expires_after == 2);
    CHECK(row.without.hits == 0);
    CHECK(row.without.misses == 6);
    CHECK(row.with->hits == 3);
    CHECK(row.with->misses == 3);
    CHECK(row.speculative->issued == 3);
    CHECK(row.speculative->used == 3);
    CHECK(row.coverage.value() == doctest::Approx(0.5));
  }
  {
    // prev: layer 1's previous token's experts. Step 1 predicts {1} (resident), step 2 predicts
    // {3} (resident): nothing to fill.
    const PrefetchReplayReport r = prefetch_replay(trace, ReplayScope::layer, {2}, {"lru"}, "prev", 1);
    check_invariants(r);
    CHECK(r.rows[0].speculative->predicted == 2);
    CHECK(r.rows[0].speculative->skipped_resident == 2);
    CHECK(r.rows[0].speculative->issued == 0);
    CHECK(!r.rows[0].precision);
    CHECK(*r.rows[0].with == r.rows[0].without);
  }
}

TEST_CASE("prefetch replay two layers ahead: counts by hand, the next-layer lists unchanged, bad options refused") {
  // Three layers: layers 0 and 1 route {0, 1} every step, layer 2 two new experts per step {2s, 2s+1}.
  // Layer scope, 4 slots, the widest forward (2) as the budget. Next-layer hints of recall 0.5 with
  // exact scores (noise 0): one true id per list, the wrong one scores 0 and is skipped.
  const Trace trace = parsed(
      "0 0 0 1\n0 1 0 1\n0 2 0 1\n1 0 0 1\n1 1 0 1\n1 2 2 3\n"
      "2 0 0 1\n2 1 0 1\n2 2 4 5\n3 0 0 1\n3 1 0 1\n3 2 6 7\n");
  PrefetchReplayOptions o;
  o.capacities = {4};
  o.policies = {"lru"};
  o.prefetch = parse_prefetch_spec("hint:0.5:noise=0").value();
  o.expert_bytes = 1000;
  Result<PrefetchReplayReport> one = replay_with_prefetch(trace, o);
  REQUIRE(one.ok());
  // One layer ahead: layer 1 gets one of its two experts at step 0 (then they stay), layer 2 one
  // of its two every step.
  const PrefetchRow& a = one.value().rows[0];
  CHECK(a.without.hits == 12);
  CHECK(a.without.misses == 12);
  CHECK(a.with->hits == 17);
  CHECK(a.with->misses == 7);
  CHECK(a.speculative->issued == 5);
  CHECK(a.speculative->used == 5);
  CHECK(!one.value().two_ahead);
  // And layer 2 from exact hints after each layer-0 forward: both of layer 2's experts every step,
  // so its next-layer hint (after layer 1) finds them resident.
  o.two_ahead = 1.0;
  Result<PrefetchReplayReport> two = replay_with_prefetch(trace, o);
  REQUIRE(two.ok());
  const PrefetchRow& b = two.value().rows[0];
  CHECK(two.value().two_ahead == 1.0);
  CHECK(b.without == a.without);
  CHECK(b.with->hits == 21);
  CHECK(b.with->misses == 3);
  CHECK(b.speculative->issued == 9);
  CHECK(b.speculative->used == 9);
  CHECK(b.speculative->wasted == 0);
  CHECK(b.speculative->skipped_resident >= 4);  // layer 1's four hints for layer 2, at least
  // A two-layer trace has no layer two ahead of another: the same counts as one layer ahead.
  const Trace short_trace = parsed("0 0 0\n0 1 1\n1 0 2\n1 1 3\n");
  o.two_ahead.reset();
  Result<PrefetchReplayReport> s1 = replay_with_prefetch(short_trace, o);
  o.two_ahead = 1.0;
  Result<PrefetchReplayReport> s2 = replay_with_prefetch(short_trace, o);
  REQUIRE((s1.ok() && s2.ok()));
  CHECK(*s1.value().rows[0].with == *s2.value().rows[0].with);
  CHECK(*s1.value().rows[0].speculative == *s2.value().rows[0].speculative);
  // Refused: a recall outside (0, 1], a predictor other than emulated hints, coact wrong ids.
  for (const double bad : {0.0, -0.5, 1.5}) {
    o.two_ahead = bad;
    CHECK(replay_with_prefetch(trace, o).status().code() == ErrorCode::invalid_argument);
  }
  o.two_ahead = 0.7;
  for (const char* spec : {"prev", "coact", "hint:0.9:coact"}) {
    CAPTURE(spec);
    o.prefetch = parse_prefetch_spec(spec).value();
    const Result<PrefetchReplayReport> r = replay_with_prefetch(trace, o);
    CHECK(r.status().code() == ErrorCode::invalid_argument);
  }
}

TEST_CASE("prefetch replay: budget 0 and prefetch none equal the plain replay exactly") {
  const Trace trace = generate_trace(GeneratorSpec{4, 24, 3, 300, 1.0, 0.4, 5});
  for (const ReplayScope scope : {ReplayScope::layer, ReplayScope::global}) {
    CAPTURE(to_string(scope));
    std::vector<std::string> policies = online_policies();
    policies.emplace_back(opt_policy_alias);
    for (const char* predictor : {"coact", "prev", "hint:1", "hint:0.5", "hint:0.5:noise=0.3", "none"}) {
      CAPTURE(predictor);
      const bool none = std::string_view(predictor) == "none";
      const PrefetchReplayReport r =
          prefetch_replay(trace, scope, {3, 6, 12}, policies, predictor, none ? std::nullopt : std::optional<std::int32_t>(0));
      check_invariants(r);
      for (const PrefetchRow& row : r.rows) {
        if (detail::is_opt_name(row.policy)) continue;
        CAPTURE(row.policy);
        CHECK(*row.with == row.without);  // hits, misses and evictions
        CHECK(row.speculative->issued == 0);
        CHECK(row.coverage.value() == 0.0);
      }
    }
  }
}

TEST_CASE("prefetch replay: hint:1 with enough budget never lowers the hit rate; invariants for every predictor") {
  const Trace trace = generate_trace(GeneratorSpec{6, 32, 4, 400, 0.8, 0.3, 9});
  for (const ReplayScope scope : {ReplayScope::layer, ReplayScope::global}) {
    CAPTURE(to_string(scope));
    // Capacities of at least two forwards' worth: a victim outside the last forward always exists.
    const std::vector<std::int32_t> caps = scope == ReplayScope::layer ? std::vector<std::int32_t>{8, 16}
                                                                       : std::vector<std::int32_t>{8, 32, 64};
    const PrefetchReplayReport hint = prefetch_replay(trace, scope, caps, online_policies(), "hint:1", 4);
    check_invariants(hint);
    for (const PrefetchRow& row : hint.rows) {
      CAPTURE(row.policy);
      CAPTURE(row.capacity);
      CHECK(row.with->hit_rate() >= row.without.hit_rate());
      CHECK(row.speculative->issued > 0);
      CHECK(row.precision.value() == 1.0);  // every hinted id is a true one
      if (scope == ReplayScope::layer) CHECK(row.speculative->pending == 0);  // each fill meets its forward
    }
    for (const char* predictor : {"coact", "prev", "hint:0.8", "hint:0.3", "hint:0.5:recent:noise=0.7"}) {
      CAPTURE(predictor);
      const PrefetchReplayReport r = prefetch_replay(trace, scope, caps, online_policies(), predictor);
      check_invariants(r);
      CHECK(r.budget == 4);  // default: the widest forward (top_k)
      // The same run twice gives the same numbers (seeded hints, deterministic tables).
      const PrefetchReplayReport again = prefetch_replay(trace, scope, caps, online_policies(), predictor);
      for (std::size_t i = 0; i < r.rows.size(); ++i) {
        CHECK(*r.rows[i].with == *again.rows[i].with);
        CHECK(*r.rows[i].speculative == *again.rows[i].speculative);
      }
    }
  }
}

TEST_CASE("prefetch replay: a lower recall hits less than a higher one (emulated hints are monotone on average)") {
  const Trace trace = generate_trace(GeneratorSpec{6, 32, 4, 400, 0.8, 0.3, 9});
  const PrefetchReplayReport hi = prefetch_replay(trace, ReplayScope::layer, {8}, {"lru"}, "hint:0.9");
  const PrefetchReplayReport lo = prefetch_replay(trace, ReplayScope::layer, {8}, {"lru"}, "hint:0.2");
  CHECK(hi.rows[0].with->hits > lo.rows[0].with->hits);
  CHECK(hi.rows[0].precision.value() > lo.rows[0].precision.value());
}

TEST_CASE("prefetch spec: parsing and errors") {
  CHECK(parse_prefetch_spec("none").value().kind == PrefetchKind::none);
  CHECK(parse_prefetch_spec("coact").value().kind == PrefetchKind::coact);
  CHECK(parse_prefetch_spec("prev").value().kind == PrefetchKind::prev);
  const PrefetchSpec h = parse_prefetch_spec("hint:0.75").value();
  CHECK(h.kind == PrefetchKind::hint);
  CHECK(h.recall == 0.75);
  CHECK(to_string(h) == "hint:0.75");
  CHECK(to_label(h).find("emulated") != std::string::npos);
  CHECK(to_label(parse_prefetch_spec("coact").value()) == "coact");
  CHECK(parse_prefetch_spec("hint:1").value().recall == 1.0);
  for (const char* bad : {"hint:0", "hint:1.5", "hint:-0.5", "hint:", "hint:abc", "hint:0.5x", "hint:nan", "hint:inf",
                          "hint:1e-1", "bogus", "", "hint"}) {
    CAPTURE(bad);
    const Result<PrefetchSpec> r = parse_prefetch_spec(bad);
    CHECK(!r.ok());
    CHECK(r.status().code() == ErrorCode::invalid_argument);
  }
  const Trace trace = parsed("0 0 0\n0 1 1\n");
  PrefetchReplayOptions o;
  o.capacities = {2};
  o.policies = {"lru"};
  o.prefetch.kind = PrefetchKind::coact;
  o.budget = -1;
  CHECK(replay_with_prefetch(trace, o).status().code() == ErrorCode::invalid_argument);
  o.budget = 1;
  o.capacities = {9};
  CHECK(replay_with_prefetch(trace, o).status().code() == ErrorCode::invalid_capacity);
}

// ---- the hint model's wrong ids (docs/prefetch.md, "The hint model") ----------------------------

TEST_CASE("hint wrong ids, recent: drawn from the next layer's last 8 forwards, the rest uniformly") {
  EmulatedHintPredictor p(2, 64, 0.5, 11, HintWrongIds::recent);
  CHECK(p.wrong_ids() == HintWrongIds::recent);
  // Layer 1 chose experts 40..47 in its last forwards (older choices 20..23 fall out of the window).
  for (std::int32_t s = 0; s < 4; ++s) observe(p, s, 1, {20, 21, 22, 23});
  for (std::int32_t s = 4; s < 12; ++s) observe(p, s, 1, {40, 41, 42, 43, 44, 45, 46, 47});
  const Ids truth{1, 2, 3, 4, 5, 6};  // 3 true, 3 wrong per list at recall 0.5
  for (int q = 0; q < 50; ++q) {
    const Ids got = predict(p, 0, {0}, 64, truth);
    REQUIRE(got.size() == truth.size());
    for (const std::int32_t id : got) {
      if (std::find(truth.begin(), truth.end(), id) != truth.end()) continue;
      CAPTURE(id);
      CHECK((id >= 40 && id <= 47));  // a recent choice, never an older or a never-chosen one
    }
  }
  CHECK(p.true_returned() * 2 == p.truth_total());
  // Too few recent ids outside the truth: the rest uniformly, no id twice.
  EmulatedHintPredictor q(2, 64, 0.25, 3, HintWrongIds::recent);
  observe(q, 0, 1, {1, 2, 50});
  const Ids got = predict(q, 0, {0}, 64, Ids{1, 2, 3, 4, 5, 6, 7, 8});  // 2 true, 6 wrong: 50 and 5 uniform
  REQUIRE(got.size() == 8);
  CHECK(std::count(got.begin(), got.end(), 50) == 1);
  Ids sorted = got;
  std::sort(sorted.begin(), sorted.end());
  CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
  // Nothing observed yet: uniform.
  EmulatedHintPredictor fresh(2, 16, 0.5, 1, HintWrongIds::recent);
  CHECK(predict(fresh, 0, {0}, 64, Ids{1, 2}).size() == 2);
}

TEST_CASE("hint distance 2: lists for layer L+2, wrong ids from its recent choices, none past the last layer") {
  EmulatedHintPredictor p(4, 64, 0.5, 11, HintWrongIds::recent, std::nullopt, 2);
  CHECK(p.distance() == 2);
  // Layer 2 chose 40..47 lately, layer 1 chose 20..27: a query after layer 0 is about layer 2.
  for (std::int32_t s = 0; s < 8; ++s) {
    observe(p, s, 1, {20, 21, 22, 23, 24, 25, 26, 27});
    observe(p, s, 2, {40, 41, 42, 43, 44, 45, 46, 47});
  }
  const Ids truth{1, 2, 3, 4, 5, 6};  // layer 2's experts: 3 true, 3 wrong per list at recall 0.5
  for (int q = 0; q < 50; ++q) {
    const Ids got = predict(p, 0, {0}, 64, truth);
    REQUIRE(got.size() == truth.size());
    CHECK(count_in(got, truth) == 3);
    for (const std::int32_t id : got) {
      if (std::find(truth.begin(), truth.end(), id) != truth.end()) continue;
      CAPTURE(id);
      CHECK((id >= 40 && id <= 47));  // layer 2's recent choices, not layer 1's
    }
  }
  // After layer 1 the list is for layer 3, the last one; after layer 2 there is no layer 4.
  CHECK(predict(p, 1, {0}, 64, truth).size() == truth.size());
  CHECK(predict(p, 2, {0}, 64, truth).empty());
  CHECK(predict(p, 3, {0}, 64, truth).empty());
  // Distance 1 is the default and keeps its lists: the same seed gives the same draws as before.
  EmulatedHintPredictor one(4, 64, 0.5, 11, HintWrongIds::uniform);
  EmulatedHintPredictor one_explicit(4, 64, 0.5, 11, HintWrongIds::uniform, std::nullopt, 1);
  CHECK(one.distance() == 1);
  CHECK(predict(one, 0, {0}, 64, truth) == predict(one_explicit, 0, {0}, 64, truth));
  CHECK(predict(one, 2, {0}, 64, truth).size() == truth.size());  // layer 3 exists
  // Bad distances and co-activation further than one layer are refused with the reason.
  const auto message = [](auto&& make) {
    try {
      make();
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message([] { EmulatedHintPredictor(4, 64, 0.9, 1, HintWrongIds::uniform, std::nullopt, 0); }).find(
            "distance must be in [1, 3]") != std::string::npos);
  CHECK(message([] { EmulatedHintPredictor(4, 64, 0.9, 1, HintWrongIds::uniform, std::nullopt, 4); }).find(
            "got 4") != std::string::npos);
  CHECK(message([] { EmulatedHintPredictor(4, 64, 0.9, 1, HintWrongIds::coact, std::nullopt, 2); }).find(
            "one layer ahead only") != std::string::npos);
}

TEST_CASE("hint wrong ids, coact: the next layer's experts most often seen with the current ones") {
  EmulatedHintPredictor p(2, 32, 0.5, 5, HintWrongIds::coact);
  // Layer 0 expert 7 is always followed by layer 1 experts 20, 21 (often) and 22 (less often).
  for (std::int32_t s = 0; s < 40; ++s) {
    observe(p, s, 0, {7});
    observe(p, s, 1, s % 4 == 0 ? Ids{20, 21, 22} : Ids{20, 21});
  }
  // Truth {1, 2, 3, 4}: 2 true ids and 2 wrong ones, the two most co-activated: 20 and 21.
  const Ids got = predict(p, 0, {7}, 64, Ids{1, 2, 3, 4});
  REQUIRE(got.size() == 4);
  CHECK(std::count(got.begin(), got.end(), 20) == 1);
  CHECK(std::count(got.begin(), got.end(), 21) == 1);
  CHECK(std::count(got.begin(), got.end(), 22) == 0);
  // A co-activated expert that is in the truth is a true id, not a wrong one: 22 is next.
  const Ids got2 = predict(p, 0, {7}, 64, Ids{20, 1, 2, 3, 4, 5});  // 3 true (truth_total 10 -> 5), 3 wrong
  Ids wrong;
  for (const std::int32_t id : got2) {
    if (id != 20 && (id < 1 || id > 5)) wrong.push_back(id);
  }
  CHECK(std::count(wrong.begin(), wrong.end(), 21) == 1);
  CHECK(std::count(wrong.begin(), wrong.end(), 22) == 1);
  // Bad current ids are refused (the table's own check), the state unchanged.
  std::span<const std::int32_t> out;
  const Ids bad{40};
  CHECK(p.predict(PredictionQuery{0, 0, bad, Ids{1}}, 8, out).code() == ErrorCode::expert_out_of_range);
}

TEST_CASE("hint spelling: hint:R[:uniform|recent|coact], the plain one uniform, bad models refused") {
  const auto plain = parse_prefetch_spec("hint:0.8");
  REQUIRE(plain.ok());
  CHECK(plain.value().wrong == HintWrongIds::uniform);
  CHECK(to_string(plain.value()) == "hint:0.8");
  for (const char* text : {"hint:0.9:recent", "hint:0.5:coact"}) {
    CAPTURE(text);
    const auto s = parse_prefetch_spec(text);
    REQUIRE(s.ok());
    CHECK(to_string(s.value()) == text);
    CHECK(to_label(s.value()).find("emulated") != std::string::npos);
  }
  const auto u = parse_prefetch_spec("hint:0.5:uniform");
  REQUIRE(u.ok());
  CHECK(to_string(u.value()) == "hint:0.5");
  const auto bad = parse_prefetch_spec("hint:0.5:nearby");
  REQUIRE_FALSE(bad.ok());
  CHECK(std::string(bad.status().message()).find("'uniform', 'recent' or 'coact', not 'nearby'") != std::string::npos);
  CHECK_FALSE(parse_prefetch_spec("hint::recent").ok());
  CHECK_FALSE(parse_prefetch_spec("hint:1.5:recent").ok());
}

// ---- scored hints: the hint model's noise and the replay's min_score ------------------------------

namespace {

// Scores of `queries` random queries of a scored hint predictor, split by true and wrong ids.
struct ScoreSample {
  std::vector<float> true_scores, wrong_scores;
};

ScoreSample sample_scores(double noise, std::uint64_t seed, int queries = 3000) {
  EmulatedHintPredictor p(2, 64, 0.5, seed, HintWrongIds::uniform, noise);
  detail::SplitMix64 rng{seed + 100};
  ScoreSample out;
  for (int q = 0; q < queries; ++q) {
    Ids truth;
    while (truth.size() < 6) {
      const auto id = static_cast<std::int32_t>(rng.below(64));
      if (std::find(truth.begin(), truth.end(), id) == truth.end()) truth.push_back(id);
    }
    std::span<const std::int32_t> ids;
    REQUIRE(p.predict(PredictionQuery{q, 0, Ids{0}, truth}, 64, ids).ok());
    const std::span<const float> scores = p.scores();
    REQUIRE(scores.size() == ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const bool is_true = std::find(truth.begin(), truth.end(), ids[i]) != truth.end();
      (is_true ? out.true_scores : out.wrong_scores).push_back(scores[i]);
    }
  }
  return out;
}

double share_at_least(const std::vector<float>& v, float threshold) {
  return static_cast<double>(std::count_if(v.begin(), v.end(), [&](float x) { return x >= threshold; })) /
         static_cast<double>(v.size());
}

double mean_of(const std::vector<float>& v) {
  double sum = 0.0;
  for (const float x : v) sum += x;
  return sum / static_cast<double>(v.size());
}

}  // namespace

TEST_CASE("hint scores: noise 0 separates true and wrong ids exactly") {
  const ScoreSample s = sample_scores(0.0, 5);
  REQUIRE(s.true_scores.size() == 3000 * 3);
  REQUIRE(s.wrong_scores.size() == 3000 * 3);
  CHECK(std::all_of(s.true_scores.begin(), s.true_scores.end(), [](float x) { return x == 1.0f; }));
  CHECK(std::all_of(s.wrong_scores.begin(), s.wrong_scores.end(), [](float x) { return x == 0.0f; }));
}

TEST_CASE("hint scores: noise N keeps true ids above 1 - N and wrong ids below N, each uniform there") {
  const ScoreSample s = sample_scores(0.3, 6);
  CHECK(std::all_of(s.true_scores.begin(), s.true_scores.end(), [](float x) { return x > 0.7f - 1e-6f && x <= 1.0f; }));
  CHECK(std::all_of(s.wrong_scores.begin(), s.wrong_scores.end(), [](float x) { return x >= 0.0f && x < 0.3f + 1e-6f; }));
  CHECK(mean_of(s.true_scores) == doctest::Approx(0.85).epsilon(0.01));
  CHECK(mean_of(s.wrong_scores) == doctest::Approx(0.15).epsilon(0.03));
  // So min_score 0.5 keeps every true id and no wrong one.
  CHECK(share_at_least(s.true_scores, 0.5f) == 1.0);
  CHECK(share_at_least(s.wrong_scores, 0.5f) == 0.0);
  // At noise 0.7 they overlap on [0.3, 0.7): a threshold of 0.5 keeps 5/7 of the true ids and
  // 2/7 of the wrong ones.
  const ScoreSample o = sample_scores(0.7, 7);
  CHECK(share_at_least(o.true_scores, 0.5f) == doctest::Approx(5.0 / 7).epsilon(0.03));
  CHECK(share_at_least(o.wrong_scores, 0.5f) == doctest::Approx(2.0 / 7).epsilon(0.06));
}

TEST_CASE("hint scores: noise 1 carries no information (true and wrong ids score alike)") {
  const ScoreSample s = sample_scores(1.0, 8);
  for (const auto* v : {&s.true_scores, &s.wrong_scores}) {
    CHECK(std::all_of(v->begin(), v->end(), [](float x) { return x >= 0.0f && x <= 1.0f; }));
    CHECK(mean_of(*v) == doctest::Approx(0.5).epsilon(0.03));
    for (const float t : {0.25f, 0.5f, 0.75f}) {
      CAPTURE(t);
      CHECK(share_at_least(*v, t) == doctest::Approx(1.0 - t).epsilon(0.06));
    }
  }
  // The same threshold keeps the same share of both.
  CHECK(share_at_least(s.true_scores, 0.5f) == doctest::Approx(share_at_least(s.wrong_scores, 0.5f)).epsilon(0.06));
}

TEST_CASE("hint scores: parallel to the list, cut with it; the ids do not depend on the noise") {
  const Ids truth{1, 4, 6, 9};
  EmulatedHintPredictor plain(3, 16, 0.5, 9);
  EmulatedHintPredictor scored(3, 16, 0.5, 9, HintWrongIds::uniform, 0.4);
  EmulatedHintPredictor exact(3, 16, 0.5, 9, HintWrongIds::uniform, 0.0);
  for (int q = 0; q < 50; ++q) {
    const Ids a = predict(plain, q % 2, {0}, 64, truth);
    const Ids b = predict(scored, q % 2, {0}, 64, truth);
    const Ids c = predict(exact, q % 2, {0}, 64, truth);
    CHECK(a == b);  // the same ids, whatever the noise
    CHECK(a == c);
    CHECK(plain.scores().empty());  // unscored
    REQUIRE(scored.scores().size() == b.size());
    REQUIRE(exact.scores().size() == c.size());
    for (std::size_t i = 0; i < c.size(); ++i) {
      const bool is_true = count_in(Ids{c[i]}, truth) == 1;
      CHECK(exact.scores()[i] == (is_true ? 1.0f : 0.0f));
    }
  }
  CHECK(predict(scored, 0, {0}, 2, truth).size() == 2);
  CHECK(scored.scores().size() == 2);  // cut to max_ids with the ids
  CHECK(predict(scored, 2, {0}, 64, truth).empty());  // the last layer predicts nothing
  CHECK(scored.scores().empty());
  CHECK(scored.noise() == 0.4);
  CHECK(!plain.noise());
}

TEST_CASE("hint spelling with noise: hint:R[:W][:noise=N]; bad spellings refused with the reason") {
  for (const char* text : {"hint:0.9:recent:noise=0.3", "hint:0.5:noise=0", "hint:1:coact:noise=1", "hint:0.8:noise=0.25"}) {
    CAPTURE(text);
    const auto s = parse_prefetch_spec(text);
    REQUIRE(s.ok());
    CHECK(to_string(s.value()) == text);
    CHECK(is_scored(s.value()));
  }
  const PrefetchSpec a = parse_prefetch_spec("hint:0.9:recent:noise=0.3").value();
  CHECK(a.recall == 0.9);
  CHECK(a.wrong == HintWrongIds::recent);
  CHECK(a.noise == 0.3);
  CHECK(parse_prefetch_spec("hint:0.5:uniform:noise=0.5").value() == parse_prefetch_spec("hint:0.5:noise=0.5").value());
  CHECK(!is_scored(parse_prefetch_spec("hint:0.5:recent").value()));
  CHECK(!is_scored(parse_prefetch_spec("coact").value()));
  struct Bad {
    const char* text;
    const char* reason;
  };
  for (const Bad bad : {Bad{"hint:0.5:noise=1.5", "noise 1.5 is outside [0, 1]"},
                        Bad{"hint:0.5:noise=-0.1", "noise -0.1 is outside [0, 1]"},
                        Bad{"hint:0.5:noise=x", "decimal number in [0, 1]"},
                        Bad{"hint:0.5:noise=", "decimal number in [0, 1]"},
                        Bad{"hint:0.5:noise=nan", "decimal number in [0, 1]"},
                        Bad{"hint:0.5:noise=1e-1", "decimal number in [0, 1]"},
                        Bad{"hint:0.5:noise=0.1:recent", "'recent' is out of place"},
                        Bad{"hint:0.5:recent:coact", "'coact' is out of place"},
                        Bad{"hint:0.5:noise=0.1:noise=0.2", "given twice"},
                        Bad{"hint:0.5:", "not ''"},
                        Bad{"hint:0.5:noise", "not 'noise'"},
                        Bad{"hint:2:noise=0.1", "recall 2 is outside (0, 1]"}}) {
    CAPTURE(bad.text);
    const auto r = parse_prefetch_spec(bad.text);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == ErrorCode::invalid_argument);
    CHECK(std::string(r.status().message()).find(bad.reason) != std::string::npos);
  }
}

TEST_CASE("prefetch replay with scores: counts by hand; noise 0 fetches the true ids only") {
  // Two layers, six experts (the trace's largest id + 1), two per forward. Layer 0 runs {0, 1}
  // every step; layer 1 runs {0, 1}, {2, 3}, {4, 5}: never seen before, so without prefetch
  // every layer-1 request misses. Recall 0.5 with k = 2: every list is one true and one wrong id.
  // Layer scope, 6 slots (every expert: no eviction), budget 2, expires after 1 forward.
  const Trace trace = parsed("0 0 0 1\n0 1 0 1\n1 0 0 1\n1 1 2 3\n2 0 0 1\n2 1 4 5\n");
  const auto run = [&](const char* predictor, float min_score) {
    PrefetchReplayOptions o;
    o.capacities = {6};
    o.policies = {"lru"};
    o.prefetch = parse_prefetch_spec(predictor).value();
    o.budget = 2;
    o.expert_bytes = 1000;
    o.min_score = min_score;
    Result<PrefetchReplayReport> r = replay_with_prefetch(trace, o);
    REQUIRE_MESSAGE(r.ok(), r.status().to_string());
    check_invariants(r.value());
    return r.value();
  };
  {
    // Noise 0, min_score 0.5: per step the true id is fetched (a free slot) and used, the wrong
    // one skipped. Layer 1: 3 hits of 6; layer 0: 4 hits of 6.
    const PrefetchReplayReport r = run("hint:0.5:noise=0", 0.5f);
    const PrefetchRow& row = r.rows[0];
    CHECK(r.min_score == 0.5f);
    CHECK(row.without == ReplayCounts{4, 8, 0});
    CHECK(row.speculative->predicted == 6);
    CHECK(row.speculative->skipped_unlikely == 3);
    CHECK(row.speculative->issued == 3);
    CHECK(row.speculative->used == 3);
    CHECK(row.speculative->wasted == 0);
    CHECK(row.with->hits == 4 + 3);
    CHECK(row.with->misses == 5);
    CHECK(row.precision.value() == 1.0);
    CHECK(row.coverage.value() == doctest::Approx(3.0 / 8));
    CHECK(row.extra_bytes_per_token.value() == 0.0);
  }
  {
    // min_score 0 with enough budget and room: every hinted id is fetched, as without scores
    // (the order differs, the set does not).
    const PrefetchReplayReport scored = run("hint:0.5:noise=0", 0.0f);
    const PrefetchReplayReport plain = run("hint:0.5", 0.5f);
    CHECK(!plain.min_score);
    CHECK(scored.rows[0].speculative->skipped_unlikely == 0);
    CHECK(scored.rows[0].speculative->issued == plain.rows[0].speculative->issued);
    CHECK(scored.rows[0].speculative->used == plain.rows[0].speculative->used);
    CHECK(*scored.rows[0].with == *plain.rows[0].with);
    CHECK(plain.rows[0].speculative->issued >= 3);  // the true ones, and the wrong ones not resident
  }
  {
    // Noise 1, min_score 1: a true id scores 1 - u, a wrong one u < 1: nothing is fetched (but a
    // true id drawn with u = 0 exactly, which does not happen here).
    const PrefetchReplayReport r = run("hint:0.5:noise=1", 1.0f);
    CHECK(r.rows[0].speculative->issued == 0);
    CHECK(r.rows[0].speculative->skipped_unlikely == 6);
    CHECK(*r.rows[0].with == r.rows[0].without);
  }
  // A min_score outside [0, 1] is refused before any run.
  PrefetchReplayOptions bad;
  bad.capacities = {6};
  bad.policies = {"lru"};
  bad.prefetch = parse_prefetch_spec("hint:0.5:noise=0").value();
  for (const float m : {-0.5f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    CAPTURE(m);
    bad.min_score = m;
    const auto r = replay_with_prefetch(trace, bad);
    CHECK(r.status().code() == ErrorCode::invalid_argument);
    CHECK(std::string(r.status().message()).find("min_score") != std::string::npos);
  }
}

TEST_CASE("prefetch replay with scores: noise 0 wastes nothing where unscored hints waste, on a generated trace") {
  const Trace trace = generate_trace(GeneratorSpec{6, 32, 4, 400, 0.8, 0.3, 9});
  for (const ReplayScope scope : {ReplayScope::layer, ReplayScope::global}) {
    CAPTURE(to_string(scope));
    const std::vector<std::int32_t> caps = scope == ReplayScope::layer ? std::vector<std::int32_t>{8}
                                                                       : std::vector<std::int32_t>{48};
    const PrefetchReplayReport plain = prefetch_replay(trace, scope, caps, {"lru"}, "hint:0.5");
    const PrefetchReplayReport exact = prefetch_replay(trace, scope, caps, {"lru"}, "hint:0.5:noise=0");
    const PrefetchReplayReport blind = prefetch_replay(trace, scope, caps, {"lru"}, "hint:0.5:noise=1");
    check_invariants(exact);
    check_invariants(blind);
    const PrefetchCounts& p = *plain.rows[0].speculative;
    const PrefetchCounts& e = *exact.rows[0].speculative;
    const PrefetchCounts& b = *blind.rows[0].speculative;
    CHECK(e.predicted == p.predicted);  // the same lists
    CHECK(p.wasted > 0);
    CHECK(e.wasted <= e.issued / 20);  // true ids only: the few wasted are evicted before use
    CHECK(e.issued < p.issued);
    CHECK(exact.rows[0].precision.value() > 0.95);
    CHECK(plain.rows[0].precision.value() < 0.8);
    // No information: about half of the entries skipped, precision as without scores.
    CHECK(static_cast<double>(b.skipped_unlikely) / static_cast<double>(b.predicted) == doctest::Approx(0.5).epsilon(0.1));
    CHECK(blind.rows[0].precision.value() == doctest::Approx(plain.rows[0].precision.value()).epsilon(0.15));
  }
}

TEST_CASE("replay with precision feedback: wrong hints stop being fetched, right ones are not held back") {
  const Trace trace = generate_trace(GeneratorSpec{6, 32, 4, 400, 0.8, 0.3, 9});
  const auto run = [&](const char* predictor, bool feedback) {
    const PrefetchReplayReport r =
        prefetch_replay(trace, ReplayScope::layer, {16}, {"lru"}, predictor, std::nullopt, 1000, feedback);
    check_invariants(r);
    CHECK(r.precision_feedback == feedback);
    return *r.rows[0].speculative;
  };
  // Uniform wrong ids at recall 0.2: most fills are wasted, so the feedback throttles them.
  const PrefetchCounts bad = run("hint:0.2", false), bad_fb = run("hint:0.2", true);
  CHECK(bad.skipped_imprecise == 0);
  CHECK(bad_fb.skipped_imprecise > 0);
  CHECK(bad_fb.issued * 2 < bad.issued);
  CHECK(bad_fb.wasted * 2 < bad.wasted);
  // Perfect hints: every fill is used, nothing is throttled, the run is the same.
  const PrefetchCounts good = run("hint:1", false), good_fb = run("hint:1", true);
  CHECK(good_fb.skipped_imprecise == 0);
  CHECK(good_fb == good);
}
