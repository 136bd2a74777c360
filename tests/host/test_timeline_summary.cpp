// The benchmark's --timeline analysis (bench/decode/timeline_summary.hpp) on hand-made event
// logs whose layer times, fill latencies, tails and idle gaps are known.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "decode/timeline_summary.hpp"

using expert_cache::bench::format_timeline;
using expert_cache::bench::summarise_timeline;
using expert_cache::bench::TimelineEvent;
using expert_cache::bench::TimelineShape;
using expert_cache::bench::write_timeline_csv;

namespace {

constexpr std::uint64_t us = 1000;  // the device clock counts ns

// One step of two layers, capacity 2. Layer 0: router at 100 us, a demand fill of slot 0 planned
// at 105 us and landed at 145 us, output at 150 us. Layer 1's fill of slot 1 is prefetched: planned
// at 110 us (after layer 0's router, before layer 1's), landed at 185 us; layer 1's router at
// 155 us, output at 190 us. Two landings 40 us apart: with 32 us per fill, 8 us of idle link.
std::vector<TimelineEvent> one_step(const TimelineShape& s, std::uint64_t t0) {
  return {
      {t0 + 100 * us, s.router_word(0), 7},   {t0 + 105 * us, s.needed_word(0, 0), 1},
      {t0 + 110 * us, s.needed_word(1, 1), 1}, {t0 + 145 * us, s.ready_word(0, 0), 1},
      {t0 + 150 * us, s.output_word(0), 3},    {t0 + 155 * us, s.router_word(1), 9},
      {t0 + 185 * us, s.ready_word(1, 1), 1},  {t0 + 190 * us, s.output_word(1), 4},
  };
}

}  // namespace

TEST_CASE("timeline summary: layer time, tail, side chain, prefetched and demand latency, link idle") {
  const TimelineShape shape{2, 2};
  CHECK(shape.words_per_layer() == 6);
  CHECK(shape.ready_word(1, 1) == 11);
  std::vector<TimelineEvent> ev = one_step(shape, 0);
  std::reverse(ev.begin(), ev.end());  // any order in
  // 64 kB at 2 GB/s: 32 us per fill.
  const auto s = summarise_timeline(ev, shape, false, 64000.0, 2e9);
  CHECK(s.events == 8);
  CHECK(s.layers_timed == 1);
  CHECK(s.layer_median_us == doctest::Approx(40.0));  // 190 - 150
  CHECK(s.prefetched_fills == 1);
  CHECK(s.prefetched_median_us == doctest::Approx(75.0));  // 185 - 110
  CHECK(s.demand_fills == 1);
  CHECK(s.demand_median_us == doctest::Approx(40.0));  // 145 - 105
  // Tails: layer 0's fill landed after its router (150 - 145); layer 1's after its router too (190 - 185).
  CHECK(s.tails == 2);
  CHECK(s.tail_median_us == doctest::Approx(5.0));
  CHECK(s.sides == 1);
  CHECK(s.side_median_us == doctest::Approx(10.0));  // 110 - 100
  CHECK(s.landings == 2);
  CHECK(s.span_us == doctest::Approx(40.0));
  CHECK(s.per_fill_us == doctest::Approx(32.0));
  CHECK(s.idle_us == doctest::Approx(8.0));
  CHECK(s.idle_share() == doctest::Approx(0.2));
  const std::string text = format_timeline(s);
  CHECK(text.find("prefetched 75.0 us median") != std::string::npos);
  CHECK(text.find("LOG FULL") == std::string::npos);
}

TEST_CASE("timeline summary: a fill landing before its layer's router is prefetched and has no tail") {
  const TimelineShape shape{2, 1};
  const std::vector<TimelineEvent> ev{
      {100 * us, shape.router_word(0), 1},  {102 * us, shape.needed_word(1, 0), 5},
      {120 * us, shape.output_word(0), 1},  {130 * us, shape.ready_word(1, 0), 5},
      {140 * us, shape.router_word(1), 2},  {160 * us, shape.output_word(1), 2},
  };
  const auto s = summarise_timeline(ev, shape, true, 0.0, 0.0);
  CHECK(s.overflow);
  CHECK(s.prefetched_fills == 1);
  CHECK(s.prefetched_median_us == doctest::Approx(28.0));
  CHECK(s.demand_fills == 0);
  CHECK(s.tails == 0);  // the landing came before layer 1's router: the consumer did not wait for it
  CHECK(s.landings == 1);
  CHECK(s.idle_us == 0.0);
  CHECK(format_timeline(s).find("LOG FULL") != std::string::npos);
}

TEST_CASE("timeline summary: a ready word that never matches a plan is a landing without a latency; outputs of "
          "another step are not a layer time; words outside the shape are ignored") {
  const TimelineShape shape{2, 1};
  const std::vector<TimelineEvent> ev{
      {100 * us, shape.output_word(0), 1},
      {50'000 * us, shape.output_word(1), 1},       // 49.9 ms later: another step
      {50'010 * us, shape.ready_word(0, 0), 3},     // no needed word with value 3
      {50'020 * us, shape.words() + 3, 1},          // outside the shape
  };
  const auto s = summarise_timeline(ev, shape, false, 10.0, 1e9);
  CHECK(s.layers_timed == 0);
  CHECK(s.landings == 1);
  CHECK(s.prefetched_fills + s.demand_fills == 0);
}

TEST_CASE("timeline CSV: one line per event in time order, named words and slots") {
  const TimelineShape shape{2, 2};
  std::vector<TimelineEvent> ev = one_step(shape, 0);
  std::reverse(ev.begin(), ev.end());
  const std::string path = "test_timeline_summary.csv";
  REQUIRE(write_timeline_csv(path, ev, shape));
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string csv = text.str();
  CHECK(csv.rfind("t_ns,layer,word,slot,value\n100000,0,router,-1,7\n105000,0,needed,0,1\n", 0) == 0);
  CHECK(csv.find("185000,1,ready,1,1\n") != std::string::npos);
  CHECK(std::count(csv.begin(), csv.end(), '\n') == 9);
  std::remove(path.c_str());
  CHECK_FALSE(write_timeline_csv("no-such-folder/x.csv", ev, shape));
}
