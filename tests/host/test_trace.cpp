// Trace format v1 parser, writer, generator and the replay engine.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "expert_cache/eviction/lru.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/tools/replay.hpp"
#include "expert_cache/tools/trace_generator.hpp"
#include "expert_cache/tools/trace_io.hpp"

using namespace expert_cache;

namespace {

ToolResult<Trace> parse(const std::string& text, ParseOptions options = {}) {
  std::istringstream in(text);
  return parse_trace(in, options);
}

std::vector<std::int32_t> ids_of(const Trace& t, std::size_t forward) {
  const auto s = t.experts(forward);
  return {s.begin(), s.end()};
}

// The error must be a parse_error whose message starts with "line N:" and mentions `what`.
void check_error(const std::string& text, std::uint64_t line, const std::string& what, ParseOptions options = {}) {
  CAPTURE(text);
  const ToolResult<Trace> r = parse(text, options);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == ToolErrorCode::parse_error);
  const std::string msg = r.status().message();
  CAPTURE(msg);
  CHECK(msg.rfind("line " + std::to_string(line) + ":", 0) == 0);
  CHECK(msg.find(what) != std::string::npos);
}

}  // namespace

TEST_CASE("parse: records, comments, blank lines, CRLF and tabs") {
  const std::string text =
      "# expert-cache trace v1\n"
      "\n"
      "0 2 3 12 21   # trailing comment\n"
      "0\t3\t5 5 1\r\n"
      "   \t\n"
      "1 2 7#comment glued to a number\n"
      "#0 9 9 9\n"
      "1 3 0";  // no final newline
  const ToolResult<Trace> r = parse(text);
  REQUIRE(r.ok());
  const Trace& t = r.value();
  REQUIRE(t.forwards.size() == 4);
  CHECK(t.records == 4);
  CHECK(t.num_experts == 22);
  CHECK(t.forwards[0].step == 0);
  CHECK(t.forwards[0].layer == 2);
  CHECK(t.forwards[0].line == 3);
  CHECK(ids_of(t, 0) == std::vector<std::int32_t>{3, 12, 21});
  CHECK(ids_of(t, 1) == std::vector<std::int32_t>{1, 5});  // duplicates collapse, ascending
  CHECK(t.forwards[1].line == 4);
  CHECK(ids_of(t, 2) == std::vector<std::int32_t>{7});
  CHECK(t.forwards[3].line == 8);
  CHECK(ids_of(t, 3) == std::vector<std::int32_t>{0});
  CHECK(t.layers() == std::vector<std::int32_t>{2, 3});
}

TEST_CASE("parse: contiguous records of one (step, layer) merge into one forward") {
  const ToolResult<Trace> r = parse("5 1 4 2\n5 1 2 9\n5 1 0\n5 2 4\n6 1 4\n");
  REQUIRE(r.ok());
  const Trace& t = r.value();
  REQUIRE(t.forwards.size() == 3);
  CHECK(t.records == 5);
  CHECK(t.forwards[0].records == 3);
  CHECK(t.forwards[0].line == 1);
  CHECK(ids_of(t, 0) == std::vector<std::int32_t>{0, 2, 4, 9});
  CHECK(ids_of(t, 1) == std::vector<std::int32_t>{4});
  CHECK(ids_of(t, 2) == std::vector<std::int32_t>{4});
  // Steps need not be increasing: forwards keep file order.
  const ToolResult<Trace> r2 = parse("9 0 1\n3 0 2\n");
  REQUIRE(r2.ok());
  CHECK(r2.value().forwards[0].step == 9);
  CHECK(r2.value().forwards[1].step == 3);
}

TEST_CASE("parse: a forward resumed after another is an error naming the line") {
  check_error("0 2 1\n0 3 1\n# c\n0 2 5\n", 4, "must be contiguous: that forward began on line 1");
}

TEST_CASE("parse: num_experts option") {
  const ToolResult<Trace> r = parse("0 0 1 2\n", ParseOptions{64});
  REQUIRE(r.ok());
  CHECK(r.value().num_experts == 64);
  check_error("0 0 1\n0 1 63\n1 0 64\n", 3, "is >= num_experts 64", ParseOptions{64});
  const ToolResult<Trace> bad = parse("0 0 1\n", ParseOptions{0});
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == ToolErrorCode::invalid_argument);
}

TEST_CASE("parse: every malformed-input class names its line") {
  check_error("0 0 1\n0\n", 2, "too few fields");
  check_error("0 0 1\n1 0\n", 2, "too few fields");
  check_error("0 0 1\n1 0 # only a comment after the layer\n", 2, "too few fields");
  check_error("x 0 1\n", 1, "step 'x' is not an integer");
  check_error("0 0 1\n0 y 1\n", 2, "layer 'y' is not an integer");
  check_error("0 0 1\n1 0 2 z\n", 2, "expert id 'z' is not an integer");
  check_error("1.5 0 1\n", 1, "not an integer");
  check_error("0 0 1e3\n", 1, "not an integer");
  check_error("+1 0 1\n", 1, "not an integer");
  check_error("- 0 1\n", 1, "not an integer");
  check_error("0 0 --1\n", 1, "not an integer");
  check_error("-1 0 1\n", 1, "step '-1' is negative");
  check_error("0 -3 1\n", 1, "layer '-3' is negative");
  check_error("0 0 4 -2\n", 1, "expert id '-2' is negative");
  check_error("2147483648 0 1\n", 1, "exceeds 2147483647");
  check_error("0 2147483648 1\n", 1, "exceeds 2147483647");
  check_error("0 0 99999999999999999999999999999\n", 1, "exceeds the limit");
  check_error("0 0 16777216\n", 1, "exceeds the limit 16777215");
  check_error("-99999999999999999999999 0 1\n", 1, "is negative");
  check_error(std::string("0 0 1\n0 0 2\x01\n"), 2, "not an integer");
  check_error(std::string("0 0 1\n\n\n0 1 ") + std::string(1000, '7') + "x\n", 4, "...'");
  // The largest legal values pass.
  CHECK(parse("2147483647 2147483647 16777215\n").ok());
  CHECK(parse("-0 0 0\n").ok());  // "-0" is zero, not negative
}

TEST_CASE("parse: empty input and io") {
  const ToolResult<Trace> r = parse("# nothing\n\n");
  REQUIRE(r.ok());
  CHECK(r.value().forwards.empty());
  CHECK(r.value().num_experts == 0);
  const ToolResult<Trace> missing = load_trace("/nonexistent/dir/x.trace");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == ToolErrorCode::io_error);
}

TEST_CASE("write_trace round-trips, generator is deterministic") {
  GeneratorSpec spec;
  spec.layers = 3;
  spec.experts = 16;
  spec.top_k = 4;
  spec.steps = 50;
  const Trace a = generate_trace(spec);
  const Trace b = generate_trace(spec);
  CHECK(a.ids == b.ids);
  REQUIRE(a.forwards.size() == 150);
  for (std::size_t i = 0; i < a.forwards.size(); ++i) CHECK(a.forwards[i].size() == 4);
  std::ostringstream out;
  write_trace(out, a, "test");
  const ToolResult<Trace> back = parse(out.str());
  REQUIRE(back.ok());
  CHECK(back.value().ids == a.ids);
  CHECK(back.value().forwards.size() == a.forwards.size());
  CHECK(back.value().forwards[0].line == 3);  // two header comment lines

  spec.seed = 2;
  CHECK(generate_trace(spec).ids != a.ids);
  // A steep Zipf with top_k == experts still terminates.
  CHECK(generate_trace(GeneratorSpec{2, 8, 8, 10, 3.0, 0.5, 7}).ids.size() == 160);
}

TEST_CASE("generator spec parsing") {
  const ToolResult<GeneratorSpec> s = parse_generator_spec("layers=2,experts=32,topk=3,steps=10,zipf=0.8,sticky=0.1,seed=9");
  REQUIRE(s.ok());
  CHECK(s.value().layers == 2);
  CHECK(s.value().experts == 32);
  CHECK(s.value().top_k == 3);
  CHECK(s.value().steps == 10);
  CHECK(s.value().seed == 9);
  CHECK(parse_generator_spec("default").ok());
  CHECK_FALSE(parse_generator_spec("layers=0").ok());
  CHECK_FALSE(parse_generator_spec("bogus=1").ok());
  CHECK_FALSE(parse_generator_spec("experts=4,topk=5").ok());
  CHECK_FALSE(parse_generator_spec("steps").ok());
  CHECK_FALSE(parse_generator_spec("sticky=2").ok());
}

TEST_CASE("replay (layer scope) equals a direct ForwardPlanner run per layer") {
  GeneratorSpec spec;
  spec.layers = 4;
  spec.experts = 32;
  spec.top_k = 4;
  spec.steps = 300;
  const Trace t = generate_trace(spec);
  ReplayOptions options;
  options.capacities = {4, 8, 16};
  options.policies = {"lru"};
  const Result<ReplayReport> r = replay(t, options);
  REQUIRE(r.ok());
  REQUIRE(r.value().rows.size() == 3);
  CHECK(r.value().caches == 4);
  CHECK(r.value().accesses == 4u * 300u * 4u);
  for (const ReplayRow& row : r.value().rows) {
    std::uint64_t hits = 0;
    std::uint64_t misses = 0;
    for (std::int32_t layer = 0; layer < spec.layers; ++layer) {
      ForwardPlanner<Lru> p(CacheShape{spec.experts, row.capacity}, spec.top_k);
      ForwardPlan plan;
      for (const TraceForward& f : t.forwards) {
        if (f.layer != layer) continue;
        REQUIRE(p.plan_topk(t.experts(f), plan).ok());
      }
      hits += p.counters().hits;
      misses += p.counters().misses;
    }
    CAPTURE(row.capacity);
    CHECK(row.counts.hits == hits);
    CHECK(row.counts.misses == misses);
    CHECK(hits + misses == r.value().accesses);
    CHECK(row.counts.hits > 0);  // the generator has locality
  }
}

TEST_CASE("replay (global scope) equals a direct run keyed layer_index*E + e") {
  // Sparse, unordered layer numbers: the key uses the layer's rank, not its number.
  const ToolResult<Trace> t = parse("0 7 1 2\n0 3 1\n1 7 2 3\n1 3 0 1\n2 7 1\n2 3 3\n");
  REQUIRE(t.ok());
  ReplayOptions options;
  options.scope = ReplayScope::global;
  options.capacities = {3};
  options.policies = {"lru"};
  const Result<ReplayReport> r = replay(t.value(), options);
  REQUIRE(r.ok());
  CHECK(r.value().cache_experts == 8);  // 2 layers x 4 experts
  ForwardPlanner<Lru> p(CacheShape{8, 3}, 1);
  ForwardPlan plan;
  const std::vector<std::vector<std::int32_t>> keyed{{5, 6}, {1}, {6, 7}, {0, 1}, {5}, {3}};
  for (const auto& f : keyed) REQUIRE(p.plan_unique(f, plan).ok());
  CHECK(r.value().rows[0].counts.hits == p.counters().hits);
  CHECK(r.value().rows[0].counts.misses == p.counters().misses);
}

TEST_CASE("replay: forwards by misses, counted from a step on, sum to the forwards and to the misses") {
  // One layer, 2 slots, LRU. Step 0: {1, 2} 2 misses; 1: {1, 2} 0; 2: {3} 1 (evicts 1);
  // 3: {1, 3} 1 (evicts 2); 4: {1, 3} 0; 5: {2, 4} 2.
  const ToolResult<Trace> t = parse("0 0 1 2\n1 0 1 2\n2 0 3\n3 0 1 3\n4 0 1 3\n5 0 2 4\n");
  REQUIRE(t.ok());
  ReplayOptions options;
  options.capacities = {2};
  options.policies = {"lru"};
  Result<ReplayReport> r = replay(t.value(), options);
  REQUIRE(r.ok());
  CHECK(r.value().rows[0].forwards_by_misses == std::vector<std::uint64_t>{2, 2, 2});
  CHECK(r.value().rows[0].counts.misses == 6);
  options.histogram_from_step = 2;  // steps 0 and 1 warm the cache up and are not counted
  r = replay(t.value(), options);
  REQUIRE(r.ok());
  CHECK(r.value().rows[0].forwards_by_misses == std::vector<std::uint64_t>{1, 2, 1});
  CHECK(r.value().rows[0].counts.misses == 6);  // the totals still count every forward
  options.histogram_from_step = 6;  // past the last step: nothing counted
  r = replay(t.value(), options);
  REQUIRE(r.ok());
  CHECK(r.value().rows[0].forwards_by_misses.empty());
  // Generated, 4 layers: the histogram's forwards and misses equal the totals.
  GeneratorSpec spec;
  spec.layers = 4;
  spec.experts = 32;
  spec.top_k = 4;
  spec.steps = 200;
  options.histogram_from_step = 0;
  options.capacities = {8};
  options.policies = {"lru", "lfru"};
  r = replay(generate_trace(spec), options);
  REQUIRE(r.ok());
  for (const ReplayRow& row : r.value().rows) {
    std::uint64_t forwards = 0, misses = 0;
    for (std::size_t m = 0; m < row.forwards_by_misses.size(); ++m) {
      forwards += row.forwards_by_misses[m];
      misses += m * row.forwards_by_misses[m];
    }
    CAPTURE(row.policy);
    CHECK(forwards == r.value().forwards);
    CHECK(misses == row.counts.misses);
    CHECK(row.forwards_by_misses.size() > 2);
  }
}

TEST_CASE("replay errors") {
  const ToolResult<Trace> t = parse("0 0 1 2\n1 0 3\n1 0 4 5 6\n2 0 1\n");
  REQUIRE(t.ok());
  ReplayOptions options;
  options.policies = {"lru"};
  options.capacities = {2};
  Result<ReplayReport> r = replay(t.value(), options);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == ErrorCode::too_many_experts);
  CHECK(r.status().message().rfind("line 2: forward (step 1, layer 0) needs 4 unique experts", 0) == 0);

  options.capacities = {0};
  r = replay(t.value(), options);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == ErrorCode::invalid_capacity);
  options.capacities = {8};  // E = 7
  CHECK(replay(t.value(), options).status().code() == ErrorCode::invalid_capacity);

  options.capacities = {4};
  options.policies = {"nope"};
  r = replay(t.value(), options);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == ErrorCode::invalid_argument);
  CHECK(r.status().message().find("unknown policy 'nope'") != std::string::npos);

  options.policies = {"lru"};
  CHECK(replay(Trace{}, options).status().code() == ErrorCode::invalid_argument);
}

TEST_CASE("replay runs every available policy; OPT bounds them when present") {
  const Trace t = generate_trace(GeneratorSpec{3, 24, 3, 200, 1.0, 0.4, 5});
  ReplayOptions options;
  options.capacities = {3, 6, 12};
  options.policies = replay_policy_names();
  std::uint64_t progress_calls = 0;
  options.progress = [&](const ReplayProgress& p) {
    ++progress_calls;
    CHECK(p.done <= p.total);
  };
  options.progress_every = 100;
  const Result<ReplayReport> r = replay(t, options);
  REQUIRE(r.ok());
  CHECK(r.value().rows.size() == options.capacities.size() * options.policies.size());
  CHECK(progress_calls > 0);
  for (const ReplayRow& row : r.value().rows) {
    CAPTURE(row.policy);
    CHECK(row.counts.accesses() == r.value().accesses);
    if (r.value().has_opt) {
      REQUIRE(row.hits_vs_opt.has_value());
      CHECK(*row.hits_vs_opt <= 1.0 + 1e-12);
      CHECK(*row.misses_vs_opt >= 1.0 - 1e-12);
      if (row.policy == opt_policy_alias) CHECK(*row.hits_vs_opt == doctest::Approx(1.0));
    } else {
      CHECK_FALSE(row.hits_vs_opt.has_value());
    }
  }
}

TEST_CASE("replay --calibrate: counts the first steps, replays the rest; crf+prior/crf+pin take the counts") {
  GeneratorSpec spec;
  spec.layers = 3;
  spec.experts = 32;
  spec.top_k = 4;
  spec.steps = 200;
  const Trace t = generate_trace(spec);
  ReplayOptions options;
  options.capacities = {8};
  options.policies = {"crf", "crf+prior", "crf+pin"};
  options.calibrate = 0.25;
  const Result<ReplayReport> r = replay(t, options);
  REQUIRE(r.ok());
  const ReplayReport& rep = r.value();
  REQUIRE(rep.replay_from_step.has_value());
  CHECK(*rep.replay_from_step == 50);
  CHECK(rep.calibration_forwards == 3u * 50u);
  CHECK(rep.forwards == 3u * 150u);
  // The rows are a cold replay of steps >= 50 only: crf equals a direct Crf run on them, and
  // crf+prior a direct run with the bias of a PopularityTable of steps < 50.
  for (const ReplayRow& row : rep.rows) {
    std::uint64_t hits = 0, misses = 0;
    for (std::int32_t layer = 0; layer < spec.layers; ++layer) {
      PopularityTable pop(spec.experts);
      for (const TraceForward& f : t.forwards) {
        if (f.layer == layer && f.step < 50) pop.count(t.experts(f));
      }
      const CacheShape shape{spec.experts, 8};
      std::vector<std::uint64_t> bias;
      if (row.policy == "crf+prior") bias = pop.weighted_bias(1.0);
      if (row.policy == "crf+pin") bias = pop.pinned_bias(2);  // 0.25 x 8
      ForwardPlanner<Crf> p(shape, spec.top_k, Crf(shape, CrfParams{}, bias));
      ForwardPlan plan;
      for (const TraceForward& f : t.forwards) {
        if (f.layer == layer && f.step >= 50) REQUIRE(p.plan_topk(t.experts(f), plan).ok());
      }
      hits += p.counters().hits;
      misses += p.counters().misses;
    }
    CAPTURE(row.policy);
    CHECK(row.counts.hits == hits);
    CHECK(row.counts.misses == misses);
  }
  CHECK(rep.rows[0].counts.misses != rep.rows[1].counts.misses);  // the prior changed decisions
  // Without calibration the prior policies have no counts: they plan exactly as crf.
  options.calibrate = 0.0;
  const Result<ReplayReport> plain = replay(t, options);
  REQUIRE(plain.ok());
  CHECK(plain.value().rows[0].counts == plain.value().rows[1].counts);
  CHECK(plain.value().rows[0].counts == plain.value().rows[2].counts);
  // Bad calibration arguments are refused.
  for (const double bad : {-0.1, 1.0, 0.001}) {
    options.calibrate = bad;
    const Result<ReplayReport> e = replay(t, options);
    CHECK_FALSE(e.ok());
    CHECK(e.status().code() == ErrorCode::invalid_argument);
  }
}

TEST_CASE("PopularityTable: counts, weighted and pinned biases") {
  PopularityTable pop(6);
  const std::vector<std::int32_t> f1{0, 1, 2}, f2{1, 2, 9, -1}, f3{2};
  pop.count(f1);
  pop.count(f2);  // 9 and -1 are outside [0, 6): not counted
  pop.count(f3);
  CHECK(pop.forwards() == 3u);
  CHECK(std::vector<std::uint64_t>(pop.counts().begin(), pop.counts().end()) ==
        std::vector<std::uint64_t>{1, 2, 3, 0, 0, 0});
  // Expert 2: rate 1 per forward -> bias = 1 / (1 - d) in Q32 (d = 2^(-1/8)).
  const double one_minus_d = 1.0 - static_cast<double>(crf_default_decay_q32) / 4294967296.0;
  const auto w = pop.weighted_bias(1.0);
  CHECK(w[2] == static_cast<std::uint64_t>(std::llround(4294967296.0 / one_minus_d)));
  CHECK(w[0] * 3 == doctest::Approx(static_cast<double>(w[2])).epsilon(1e-9));
  CHECK(w[3] == 0u);
  const auto p = pop.pinned_bias(2);
  CHECK(p == std::vector<std::uint64_t>{0, crf_pin_bias, crf_pin_bias, 0, 0, 0});
  CHECK(pop.pinned_bias(5)[3] == 0u);  // never requested: never pinned
}
