// Wide forwards (prepare_wide, cache/wide.hpp) on SimRuntime: every round's bytes and maps, the race
// detector over randomized schedules of wide and normal forwards, edge 10's negative test,
// scan resistance against the admit-everything option, copy coalescing, and bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <string_view>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "support/removed_edges.hpp"
#include "support/sim_cache_harness.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;
using Stream = SimRuntime::Stream;

namespace {

template <class Edges, template <class> class Storage = TensorMajorStorage, class Policy = Lru, class Staging = CopyStream>
using WideCache = detail::ExpertCacheWithEdges<Storage, Policy, Staging, ExplicitLayout, SimRuntime, Edges>;
using RowWide = WideCache<OrderingEdges>;
using WholeWide = WideCache<OrderingEdges, ExpertMajorStorage, Lfru>;
using InlineWide = WideCache<OrderingEdges, ExpertMajorHostStorage, Lru, Inline>;

// A cache with stream slots on its own SimRuntime (race detector on), host pools filled.
template <class Cache>
struct WideFixture {
  SimRuntime rt{SimRuntime::Options{.memory_limit = std::size_t{1} << 28, .seed = 7, .max_races = 16, .max_streams = 16}};
  std::vector<Stream> streams;
  std::unique_ptr<Cache> cache;
  std::shared_ptr<ReaderLog> log = std::make_shared<ReaderLog>();
  std::uint64_t launched = 0;

  WideFixture(std::int32_t experts, std::int32_t capacity, std::int32_t top_k, std::int32_t stream_slots,
              std::int64_t max_wide_ids = default_max_wide_ids, std::function<void(std::string_view)> log_sink = {}) {
    for (int i = 0; i < 2; ++i) streams.push_back(rt.create_stream().value());
    CacheOptions o = quiet_options(experts, capacity, top_k);
    o.stream_slots = stream_slots;
    o.max_wide_ids = max_wide_ids;
    o.log = std::move(log_sink);
    cache = std::make_unique<Cache>(rt, o, six_tensor_layout());
    fill_host_pools(*cache);
  }

  // A kernel-like reader of one round on `s`: the round's map entries and every byte of its
  // experts' slots; it checks the map names exactly the round's experts (at run time).
  Status read_round(const WideRound& round, Stream s) {
    const ForwardView v = round.view;
    const auto n = static_cast<std::size_t>(cache->options().num_experts);
    std::vector<std::int32_t> ids(round.experts.begin(), round.experts.end());
    std::vector<std::int32_t> slots(round.slots.begin(), round.slots.end());
    REQUIRE(slots.size() == ids.size());
    std::vector<Access> acc{{v.expert_map, n * sizeof(std::int32_t), AccessMode::read}};
    // A resident expert must be in its pool slot, a streamed one in a stream slot.
    const auto resident = cache->resident_map_host();
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const std::int32_t pool = resident[static_cast<std::size_t>(ids[k])];
      CHECK((pool >= 0 ? slots[k] == pool : slots[k] >= cache->options().capacity));
      for (const SlotTensor& t : v.tensors) {
        if (t.bytes != 0) acc.push_back({t.slot(slots[k]), t.bytes, AccessMode::read});
      }
    }
    ++launched;
    return rt.launch(s, acc, [v, ids, slots, n, log = log]() {
      ++log->runs;
      std::size_t named = 0;
      for (std::size_t e = 0; e < n; ++e) named += v.expert_map[e] != absent_slot ? 1 : 0;
      bool ok = named == ids.size();
      for (std::size_t k = 0; ok && k < ids.size(); ++k) {
        const std::int32_t slot = v.expert_map[ids[k]];
        ok = slot == slots[k];
        for (std::size_t t = 0; ok && t < num_expert_tensors; ++t) {
          const SlotTensor& st = v.tensors[t];
          for (std::size_t i = 0; i < st.bytes; ++i) {
            if (st.slot(slot)[i] != pattern_byte(t, ids[k], i)) {
              ok = false;
              break;
            }
          }
        }
      }
      if (!ok && log->mismatches++ == 0) log->first_mismatch = "round of " + std::to_string(ids.size()) + " experts";
    });
  }

  Result<WideSummary> wide(const Ids& topk, Stream s, WideAdmission admission = WideAdmission::stream,
                           std::vector<Ids>* rounds = nullptr, WideCopy copy = WideCopy::runs) {
    return cache->prepare_wide(
        topk, s,
        [&](const WideRound& r) noexcept {
          if (rounds) rounds->emplace_back(r.experts.begin(), r.experts.end());
          return read_round(r, s);
        },
        WideOptions{.admission = admission, .copy = copy, .batch_copies = batch_copies});
  }
  bool batch_copies = true;  // WideOptions::batch_copies of wide()

  Status forward(const Ids& topk, Stream s) {
    auto view = cache->prepare(topk, s);
    if (!view.ok()) return view.status();
    Ids unique;
    for (ExpertId e : cache->last_plan().unique) unique.push_back(e.value);
    ++launched;
    return launch_reader(rt, *cache, view.value(), unique, s, log);
  }

  void check_clean() {
    rt.drain();
    CHECK(rt.races().empty());
    if (!rt.races().empty()) MESSAGE(rt.races()[0].description);
    CHECK(log->mismatches == 0);
    if (log->mismatches != 0) MESSAGE(log->first_mismatch);
    CHECK(log->runs == launched);
    const auto host = cache->resident_map_host();
    CHECK(std::equal(host.begin(), host.end(), cache->resident_map_device()));
  }
};

Ids all_experts(std::int32_t n) {
  Ids ids(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = i;
  return ids;
}

Ids random_topk(std::mt19937_64& rng, std::int32_t rows, std::int32_t k, std::int32_t experts) {
  Ids ids;
  for (std::int32_t i = 0; i < rows * k; ++i) {
    const auto r = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(experts + 1));
    ids.push_back(r == experts ? -1 : r);
  }
  return ids;
}

}  // namespace

TEST_CASE_TEMPLATE("wide forward, stream admission: every round's bytes and map; the pool untouched", Cache, RowWide,
                   WholeWide, InlineWide) {
  WideFixture<Cache> f(32, 8, 2, 4);
  REQUIRE(f.forward(Ids{3, 9, 9, 20}, f.streams[0]).ok());  // residents 3, 9, 20
  f.rt.drain();
  const auto before = f.cache->planner().snapshot();
  const CacheStats s0 = f.cache->stats();
  std::vector<Ids> rounds;
  auto r = f.wide(all_experts(32), f.streams[0], WideAdmission::stream, &rounds);
  REQUIRE(r.ok());
  // 29 missing experts in halves of 2: 15 rounds. The 3 residents (one id each) are spread over
  // rounds 0..13 by their rows (split_wide_hits: midpoints 1/6, 3/6, 5/6 of 14 rounds -> rounds
  // 2, 7 and 11); the last round carries only its miss.
  CHECK(r.value().rounds == 15);
  CHECK(r.value().unique == 32);
  CHECK(r.value().hits == 3);
  CHECK(r.value().streamed == 29);
  CHECK(r.value().admitted == 0);
  REQUIRE(rounds.size() == 15);
  CHECK(rounds[0] == Ids{0, 1});
  CHECK(rounds[1] == Ids{2, 4});
  CHECK(rounds[2] == Ids{3, 5, 6});
  CHECK(rounds[7] == Ids{9, 16, 17});
  CHECK(rounds[11] == Ids{20, 25, 26});
  CHECK(rounds[14] == Ids{31});
  Ids seen;
  for (const Ids& ids : rounds) seen.insert(seen.end(), ids.begin(), ids.end());
  std::sort(seen.begin(), seen.end());
  CHECK(seen == all_experts(32));  // disjoint rounds covering the forward
  f.check_clean();
  // Scan resistance, exactly: planner, policy and hit/miss counters as they were.
  CHECK(f.cache->planner().snapshot() == before);
  const CacheStats s1 = f.cache->stats();
  CHECK(s1.hits == s0.hits);
  CHECK(s1.misses == s0.misses);
  CHECK(s1.wide_forwards == 1);
  CHECK(s1.wide_rounds == 15);
  CHECK(s1.wide_hits == 3);
  CHECK(s1.wide_streamed == 29);
  CHECK(s1.wide_bytes == 29 * total_bytes_per_expert(six_tensor_layout().tensors()));
  // The cache stays usable: a normal forward after it.
  REQUIRE(f.forward(Ids{3, 31}, f.streams[1]).ok());
  f.check_clean();
}

TEST_CASE("split_wide_hits: hits spread over every round but the last, in equal shares of their rows") {
  std::vector<std::size_t> begin;
  std::vector<std::uint32_t> rows(8, 0);
  const Ids hits{1, 2, 3, 4};
  rows[1] = rows[2] = rows[3] = 1;
  rows[4] = 5;
  SUBCASE("one round: every hit in it") {
    detail::split_wide_hits(hits, rows, 1, begin);
    CHECK(begin == std::vector<std::size_t>{0, 4});
  }
  SUBCASE("three rounds: two carriers of 4 rows each; the popular expert alone in round 1") {
    // midpoints 0.5, 1.5, 2.5 and 5.5 of 8 rows: rounds 0, 0, 0, 1
    detail::split_wide_hits(hits, rows, 3, begin);
    CHECK(begin == std::vector<std::size_t>{0, 3, 4, 4});
  }
  SUBCASE("equal rows: equal counts, contiguous and ascending; the last round empty") {
    const Ids many{0, 1, 2, 3, 4, 5};
    std::vector<std::uint32_t> ones(8, 2);
    detail::split_wide_hits(many, ones, 4, begin);
    CHECK(begin == std::vector<std::size_t>{0, 2, 4, 6, 6});
  }
  SUBCASE("an expert counted 0 weighs 1; no hits gives empty rounds") {
    std::vector<std::uint32_t> zero(8, 0);
    detail::split_wide_hits(hits, zero, 3, begin);
    CHECK(begin == std::vector<std::size_t>{0, 2, 4, 4});
    detail::split_wide_hits(Ids{}, zero, 3, begin);
    CHECK(begin == std::vector<std::size_t>{0, 0, 0, 0});
  }
}

TEST_CASE("wide_unique: the unique experts ascending and their row counts in one pass; errors leave the counters zero") {
  std::vector<std::uint32_t> rows(8, 0);
  Ids unique;
  unique.reserve(8);
  SUBCASE("counts, padding skipped, ascending; clear_wide_rows zeroes them again") {
    REQUIRE(detail::wide_unique(Ids{5, 1, -1, 5, 7, 1, 5, -3}, 8, 64, rows, unique).ok());
    CHECK(unique == Ids{1, 5, 7});
    CHECK(rows == std::vector<std::uint32_t>{0, 2, 0, 0, 0, 3, 0, 1});
    detail::clear_wide_rows(unique, rows);
    CHECK(rows == std::vector<std::uint32_t>(8, 0));
  }
  SUBCASE("an id out of range after valid ones: refused, every counter zero") {
    const Status s = detail::wide_unique(Ids{2, 3, 2, 8, 4}, 8, 64, rows, unique);
    CHECK(s.code() == ErrorCode::expert_out_of_range);
    CHECK(s.message().find("expert id 8") != std::string_view::npos);
    CHECK(unique.empty());
    CHECK(rows == std::vector<std::uint32_t>(8, 0));
  }
  SUBCASE("more ids than the maximum: refused before any is counted") {
    const Status s = detail::wide_unique(Ids{1, 2, 3}, 8, 2, rows, unique);
    CHECK(s.code() == ErrorCode::too_many_experts);
    CHECK(rows == std::vector<std::uint32_t>(8, 0));
  }
}

TEST_CASE_TEMPLATE("consecutive wide forwards: each serves exactly its own experts", Cache, RowWide, WholeWide) {
  WideFixture<Cache> f(16, 4, 2, 4);
  for (const WideAdmission a : {WideAdmission::stream, WideAdmission::admit}) {
    CAPTURE(a == WideAdmission::stream);
    for (const Ids& ids : {Ids{9, 1, 9, 14, -1, 6, 3, 11}, Ids{2, 2, 5, 0, 12}, Ids{7}}) {
      std::vector<Ids> rounds;
      auto r = f.wide(ids, f.streams[0], a, &rounds);
      REQUIRE(r.ok());
      Ids served, want;
      for (const Ids& round : rounds) served.insert(served.end(), round.begin(), round.end());
      std::sort(served.begin(), served.end());
      for (const std::int32_t e : ids)
        if (e >= 0) want.push_back(e);
      std::sort(want.begin(), want.end());
      want.erase(std::unique(want.begin(), want.end()), want.end());
      CHECK(served == want);
      CHECK(r.value().unique == want.size());
    }
  }
  f.check_clean();
}

TEST_CASE("wide forward, stream admission: a popular resident is computed in an early round, never the last") {
  WideFixture<WholeWide> f(32, 8, 2, 4);
  REQUIRE(f.forward(Ids{30, 31}, f.streams[0]).ok());  // residents 30, 31
  f.rt.drain();
  // Expert 31 named by many rows, the rest once: 30 missing -> 15 rounds; both residents are the
  // highest ids yet land in the rounds a later fill hides (not in the last round, as an
  // id-ordered split would put them).
  Ids ids = all_experts(32);
  for (int i = 0; i < 40; ++i) ids.push_back(31);
  std::vector<Ids> rounds;
  auto r = f.wide(ids, f.streams[0], WideAdmission::stream, &rounds);
  REQUIRE(r.ok());
  REQUIRE(rounds.size() == 15);
  // rows: 30 -> 1, 31 -> 41; midpoints 0.5 / 42 and 21.5 / 42 of 14 carriers: rounds 0 and 7.
  CHECK(rounds[0] == Ids{0, 1, 30});
  CHECK(rounds[7] == Ids{14, 15, 31});
  CHECK(rounds[14] == Ids{28, 29});
  f.check_clean();
}

TEST_CASE("wide forward: runs of consecutive experts go as one copy per dense region") {
  SUBCASE("tensor-major: one copy per tensor per run") {
    WideFixture<RowWide> f(32, 4, 1, 8);
    auto r = f.wide(Ids{0, 1, 2, 3, 10, 11, 12, 13}, f.streams[0]);  // one round of two runs (half = 4... two rounds)
    REQUIRE(r.ok());
    CHECK(r.value().rounds == 2);
    CHECK(r.value().copies == 2 * 6);  // each round one run of 4, six tensors
    f.check_clean();
  }
  SUBCASE("expert-major blob: one copy per run; a gap splits the run") {
    WideFixture<WholeWide> f(32, 4, 1, 8);
    auto r = f.wide(Ids{0, 1, 2, 5, 10, 11, 12, 13}, f.streams[0]);
    REQUIRE(r.ok());
    CHECK(r.value().copies == 3);  // {0,1,2} {5} | {10..13}
    f.check_clean();
  }
  SUBCASE("expert-major host scattered into per-tensor slots: per expert and tensor") {
    WideFixture<InlineWide> f(32, 4, 1, 8);
    auto r = f.wide(Ids{0, 1, 2, 3}, f.streams[0]);
    REQUIRE(r.ok());
    CHECK(r.value().copies == 4 * 6);
    f.check_clean();
  }
}

// The copies of one wide forward with and without WideOptions::batch_copies, from the same
// starting state: what SimRuntime counted, and the forward's summary.
template <class Cache>
std::pair<SimCounters, WideSummary> wide_copy_calls(bool batch, const Ids& ids, WideCopy copy) {
  WideFixture<Cache> f(32, 4, 1, 8);
  f.batch_copies = batch;
  REQUIRE(f.forward(Ids{6, 20}, f.streams[0]).ok());  // two residents: gaps in the runs
  f.rt.drain();
  const SimCounters before = f.rt.counters();
  auto r = f.wide(ids, f.streams[0], WideAdmission::stream, nullptr, copy);
  REQUIRE(r.ok());
  f.check_clean();  // every round's bytes equal the host pool's
  SimCounters d = f.rt.counters();
  d.copies -= before.copies;
  d.copy_batches -= before.copy_batches;
  d.batch_copies -= before.batch_copies;
  d.copy_bytes -= before.copy_bytes;
  return {d, r.value()};
}

TEST_CASE_TEMPLATE("wide forward, stream admission: a round's copies go in one batched call, or one call each",
                   Cache, RowWide, WholeWide, InlineWide) {
  const Ids ids = all_experts(24);  // 22 missing: rounds of 4, runs split at 6 and 20
  for (const WideCopy copy : {WideCopy::runs, WideCopy::span}) {
    CAPTURE(to_string(copy));
    const auto [on, on_summary] = wide_copy_calls<Cache>(true, ids, copy);
    const auto [off, off_summary] = wide_copy_calls<Cache>(false, ids, copy);
    CHECK(on_summary.rounds == 6);
    CHECK(on_summary.copies == off_summary.copies);
    CHECK(on_summary.bytes == off_summary.bytes);
    // Batched: one call per round, holding exactly the copies the summary counts; the plain
    // copies left are the map uploads, as many as without batching.
    CHECK(on.copy_batches == on_summary.rounds);
    CHECK(on.batch_copies == on_summary.copies);
    CHECK(off.copy_batches == 0);
    CHECK(off.batch_copies == 0);
    CHECK(off.copies - on.copies == off_summary.copies);
    CHECK(on.copy_bytes == off.copy_bytes);
  }
}

TEST_CASE_TEMPLATE("wide forward, admit admission: rounds of capacity/2 through the pool", Cache, RowWide, WholeWide) {
  WideFixture<Cache> f(20, 6, 2, 0);
  std::vector<Ids> rounds;
  auto r = f.wide(all_experts(20), f.streams[0], WideAdmission::admit, &rounds);
  REQUIRE(r.ok());
  CHECK(r.value().rounds == 7);  // groups of 3
  CHECK(r.value().admitted == 20);
  CHECK(r.value().streamed == 0);
  REQUIRE(rounds.size() == 7);
  CHECK(rounds[0] == Ids{0, 1, 2});
  f.check_clean();
  const CacheStats s = f.cache->stats();
  CHECK(s.misses == 20);
  CHECK(s.prepare_calls == 7);
  CHECK(s.resident == 6);
  // The last two groups are resident (round 6 kept round 5's experts).
  for (std::int32_t e : {15, 16, 17, 18, 19}) CHECK(f.cache->planner().is_resident(e));
}

TEST_CASE("wide forward: stream admission without stream slots falls back to admit, said once on the log") {
  std::vector<std::string> lines;
  WideFixture<RowWide> f(16, 4, 1, 0, default_max_wide_ids, [&](std::string_view l) {
    if (l.find("prepare_wide") != std::string_view::npos) lines.emplace_back(l);
  });
  REQUIRE(f.forward(Ids{1, 2}, f.streams[0]).ok());
  std::vector<Ids> rounds;
  auto r = f.wide(all_experts(16), f.streams[0], WideAdmission::stream, &rounds);
  REQUIRE(r.ok());
  CHECK(r.value().fell_back);
  CHECK(r.value().admission == WideAdmission::admit);
  CHECK(r.value().rounds == 8);  // groups of capacity / 2 = 2 through the pool
  CHECK(r.value().streamed == 0);
  CHECK(r.value().admitted + r.value().hits == 16);
  REQUIRE(rounds.size() == 8);
  CHECK(rounds[0] == Ids{0, 1});
  f.check_clean();
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].find("stream_slots is 0") != std::string::npos);
  // Said once per cache; a later fallback is still reported in the summary.
  auto again = f.wide(Ids{5, 6}, f.streams[0]);
  REQUIRE(again.ok());
  CHECK(again.value().fell_back);
  CHECK(lines.size() == 1);
  f.check_clean();
  // With stream slots the summary says stream, no fallback.
  WideFixture<RowWide> g(16, 4, 1, 4);
  auto s = g.wide(all_experts(16), g.streams[0]);
  REQUIRE(s.ok());
  CHECK_FALSE(s.value().fell_back);
  CHECK(s.value().admission == WideAdmission::stream);
  g.check_clean();
}

TEST_CASE("plan_stream_rounds: runs, span and the automatic choice under the copy cost") {
  std::vector<detail::StreamRound> out;
  const Ids misses{0, 1, 2, 4, 5, 7, 8, 9, 10, 20, 21};
  SUBCASE("runs: half misses per round") {
    detail::plan_stream_rounds(misses, 4, WideCopy::runs, WideCopyCost{}, 1, 1000, out);
    REQUIRE(out.size() == 3);
    CHECK(out[0].begin == 0);
    CHECK(out[0].end == 4);
    CHECK(out[2].end == misses.size());
    for (const auto& r : out) CHECK_FALSE(r.span);
  }
  SUBCASE("span: ids within half of the first") {
    detail::plan_stream_rounds(misses, 4, WideCopy::span, WideCopyCost{}, 1, 1000, out);
    // [0,3]: 0 1 2 | [4,7]: 4 5 7 | [8,11]: 8 9 10 | [20,23]: 20 21
    REQUIRE(out.size() == 4);
    CHECK(out[0].end == 3);
    CHECK(out[1].first == 4);
    CHECK(out[1].end == 6);
    CHECK(out[3].first == 20);
    for (const auto& r : out) CHECK(r.span);
  }
  SUBCASE("automatic: small experts (copies dominate) take spans, large ones runs") {
    const Ids even{0, 2, 4, 6, 8, 10};
    detail::plan_stream_rounds(even, 4, WideCopy::automatic, WideCopyCost{}, 1, 1000, out);
    REQUIRE(out.size() == 3);
    CHECK(out[0].span);  // {0,2}: one copy of 3 x 1000 B beats 4 copies of {0,2,4,6} per expert served
    CHECK(out[0].end == 2);
    detail::plan_stream_rounds(misses, 4, WideCopy::automatic, WideCopyCost{}, 1, 1000, out);
    CHECK_FALSE(out[0].span);  // {0,1,2} (the only span from 0) has no gap: a run, the fuller runs round wins
    detail::plan_stream_rounds(misses, 4, WideCopy::automatic, WideCopyCost{}, 1, 1u << 21, out);
    // 2 MiB experts: a wasted expert costs 38 us, more than a copy saved: no span.
    for (const auto& r : out) CHECK_FALSE(r.span);
    const Ids gapless{8, 9, 10, 11, 12, 13, 14, 15};
    detail::plan_stream_rounds(gapless, 4, WideCopy::automatic, WideCopyCost{}, 1, 1u << 21, out);
    REQUIRE(out.size() == 2);  // one run per round either way
  }
  SUBCASE("no dense region: always runs") {
    detail::plan_stream_rounds(misses, 4, WideCopy::span, WideCopyCost{}, 0, 0, out);
    for (const auto& r : out) CHECK_FALSE(r.span);
  }
}

TEST_CASE_TEMPLATE("wide forward, span copies: bytes right, unneeded experts copied but never mapped", Cache, RowWide,
                   WholeWide) {
  WideFixture<Cache> f(32, 4, 1, 8);
  REQUIRE(f.forward(Ids{5}, f.streams[0]).ok());  // 5 resident: inside a span, copied again, mapped to the pool
  f.rt.drain();
  const auto before = f.cache->planner().snapshot();
  std::vector<Ids> rounds;
  const Ids topk{0, 2, 3, 5, 6, 9, 10, 11, 12, 30};
  auto r = f.cache->prepare_wide(
      topk, f.streams[0],
      [&](const WideRound& round) noexcept {
        rounds.emplace_back(round.experts.begin(), round.experts.end());
        return f.read_round(round, f.streams[0]);
      },
      WideOptions{WideAdmission::stream, WideCopy::span});
  REQUIRE(r.ok());
  // Misses 0 2 3 6 9 10 11 12 30 in halves of 4 ids: [0..3] {0,2,3}, [6..9] {6,9}, [10..13] {10,11,12}, [30].
  CHECK(r.value().rounds == 4);
  CHECK(r.value().span_rounds == 4);
  CHECK(r.value().streamed == 9);
  CHECK(r.value().hits == 1);
  CHECK(r.value().wasted == 1 + 2 + 0 + 0);  // 1 | 7, 8
  REQUIRE(rounds.size() == 4);
  // The resident 5 (one row; carriers rounds 0..2, midpoint 1/2 -> round 1) read from its pool slot.
  CHECK(rounds[0] == Ids{0, 2, 3});
  CHECK(rounds[1] == Ids{5, 6, 9});
  const std::uint64_t dense = detail::dense_copy_shape(CopyStream{}, f.cache->storage()).second;
  const std::uint64_t per_expert = total_bytes_per_expert(six_tensor_layout().tensors());
  CHECK(r.value().bytes == 9 * per_expert + 3 * dense);
  f.check_clean();  // every mapped byte right (read_round checks slots and map contents), no race
  CHECK(f.cache->planner().snapshot() == before);
}

TEST_CASE("wide forward, span copies: one copy per dense region per round") {
  WideFixture<WholeWide> f(32, 4, 1, 8);
  auto runs = f.cache->prepare_wide(Ids{0, 2, 4, 6}, f.streams[0], [&](const WideRound& round) noexcept {
    return f.read_round(round, f.streams[0]);
  }, WideOptions{WideAdmission::stream, WideCopy::runs});
  REQUIRE(runs.ok());
  CHECK(runs.value().copies == 4);  // four runs of one blob
  auto span = f.cache->prepare_wide(Ids{0, 2, 4, 6}, f.streams[0], [&](const WideRound& round) noexcept {
    return f.read_round(round, f.streams[0]);
  }, WideOptions{WideAdmission::stream, WideCopy::span});
  REQUIRE(span.ok());
  CHECK(span.value().rounds == 2);  // [0..3] {0,2}, [4..7] {4,6}
  CHECK(span.value().copies == 2);
  CHECK(span.value().wasted == 2);
  f.check_clean();
}

TEST_CASE_TEMPLATE("wide forward bad input: too many ids, an id out of range; nothing changes", Cache, RowWide, WholeWide) {
  WideFixture<Cache> f(16, 4, 2, 4, /*max_wide_ids=*/64);
  REQUIRE(f.forward(Ids{1, 2}, f.streams[0]).ok());
  f.rt.drain();
  const auto before = f.cache->planner().snapshot();
  const CacheStats s0 = f.cache->stats();
  const std::size_t ops = f.rt.pending_ops();
  int calls = 0;
  const auto consumer = [&](const WideRound&) noexcept {
    ++calls;
    return Status();
  };
  for (const WideAdmission a : {WideAdmission::stream, WideAdmission::admit}) {
    auto big = f.cache->prepare_wide(Ids(65, 3), f.streams[0], consumer, WideOptions{a});
    REQUIRE_FALSE(big.ok());
    CHECK(big.status().code() == ErrorCode::too_many_experts);
    CHECK(big.status().message().find("65 ids") != std::string_view::npos);
    auto out = f.cache->prepare_wide(Ids{1, 2, 16, 3}, f.streams[0], consumer, WideOptions{a});
    REQUIRE_FALSE(out.ok());
    CHECK(out.status().code() == ErrorCode::expert_out_of_range);
    CHECK(out.status().message().find("16") != std::string_view::npos);
  }
  CHECK(calls == 0);
  CHECK(f.rt.pending_ops() == ops);  // nothing enqueued
  CHECK(f.cache->planner().snapshot() == before);
  const CacheStats s1 = f.cache->stats();
  CHECK(s1.total_copies == s0.total_copies);
  CHECK(s1.map_uploads == s0.map_uploads);
  CHECK(s1.faults == 0);
  // Still usable: a valid wide forward and a normal one, all bytes right. The refused forwards
  // left no expert counted: the next one serves exactly its own experts.
  std::vector<Ids> rounds;
  auto next = f.wide(Ids(64, 7), f.streams[0], WideAdmission::stream, &rounds);
  REQUIRE(next.ok());
  CHECK(next.value().unique == 1);
  REQUIRE(rounds.size() == 1);
  CHECK(rounds[0] == Ids{7});
  REQUIRE(f.wide(all_experts(16), f.streams[1]).ok());
  REQUIRE(f.forward(Ids{1, 5}, f.streams[0]).ok());
  f.check_clean();
}

TEST_CASE("wide forward: a consumer failing mid-forward; no round half-published, the cache usable") {
  SUBCASE("stream admission: the pool exactly as before") {
    WideFixture<RowWide> f(24, 6, 2, 4);
    REQUIRE(f.forward(Ids{0, 5, 7, 11}, f.streams[0]).ok());
    const auto before = f.cache->planner().snapshot();
    int calls = 0;
    auto r = f.cache->prepare_wide(all_experts(24), f.streams[0], [&](const WideRound& round) noexcept {
      ++calls;
      if (round.index == 2) return Status(ErrorCode::invalid_argument, "engine kernel refused");
      return f.read_round(round, f.streams[0]);
    });
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == ErrorCode::invalid_argument);
    CHECK(r.status().message().find("round 2 of") != std::string_view::npos);
    CHECK(r.status().message().find("engine kernel refused") != std::string_view::npos);
    CHECK(calls == 3);
    CHECK(f.cache->planner().snapshot() == before);
    CHECK(f.cache->stats().wide_forwards == 0);
    CHECK(f.cache->stats().wide_rounds == 2);
    // Usable: a normal forward (its map re-uploaded), then a full wide forward.
    REQUIRE(f.forward(Ids{0, 5}, f.streams[0]).ok());
    REQUIRE(f.wide(all_experts(24), f.streams[1]).ok());
    f.check_clean();
  }
  SUBCASE("a consumer that throws") {
    WideFixture<WholeWide> f(24, 6, 2, 4);
    const auto before = f.cache->planner().snapshot();
    auto r = f.cache->prepare_wide(all_experts(24), f.streams[0], [&](const WideRound& round) -> Status {
      if (round.index == 1) throw std::runtime_error("boom");
      return f.read_round(round, f.streams[0]);
    });
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == ErrorCode::runtime_failure);
    CHECK(r.status().message().find("boom") != std::string_view::npos);
    CHECK(f.cache->planner().snapshot() == before);
    REQUIRE(f.wide(all_experts(24), f.streams[0]).ok());
    f.check_clean();
  }
  SUBCASE("admit admission: the pool as after the rounds planned so far (0..r+1)") {
    WideFixture<RowWide> f(24, 6, 2, 0);
    REQUIRE(f.forward(Ids{0, 5, 7, 11}, f.streams[0]).ok());
    // The prediction: a planner of the same shape given the same calls.
    ForwardPlanner<Lru> twin(CacheShape{24, 6}, 2);
    ForwardPlan scratch;
    REQUIRE(twin.plan_topk(Ids{0, 5, 7, 11}, scratch));
    const Ids all = all_experts(24);
    for (std::size_t g = 0; g <= 3; ++g) {  // round 2 fails: rounds 0..3 planned
      const auto group = std::span<const std::int32_t>(all).subspan(3 * g, 3);
      const auto keep = g == 0 ? std::span<const std::int32_t>() : std::span<const std::int32_t>(all).subspan(3 * (g - 1), 3);
      REQUIRE(twin.plan_unique(group, scratch, keep));
    }
    auto r = f.cache->prepare_wide(all, f.streams[0], [&](const WideRound& round) noexcept {
      if (round.index == 2) return Status(ErrorCode::invalid_argument, "stop");
      return f.read_round(round, f.streams[0]);
    }, WideOptions{WideAdmission::admit});
    REQUIRE_FALSE(r.ok());
    CHECK(f.cache->planner().snapshot() == twin.snapshot());
    REQUIRE(f.forward(Ids{9, 10}, f.streams[1]).ok());  // round 3's experts: resident, hits
    CHECK(f.cache->last_plan().hits == 2);
    f.check_clean();
  }
}

TEST_CASE("wide forward: a runtime failure mid-forward is reported; the pool unchanged, the cache usable") {
  WideFixture<RowWide> f(24, 6, 2, 4);
  REQUIRE(f.forward(Ids{0, 5}, f.streams[0]).ok());
  f.rt.drain();
  const auto before = f.cache->planner().snapshot();
  f.rt.inject_failure(FaultKind::copy, 20);  // inside a later round's fills
  auto r = f.wide(all_experts(24), f.streams[0]);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == ErrorCode::runtime_failure);
  CHECK(r.status().message().find("prepare_wide: round") != std::string_view::npos);
  CHECK(f.cache->stats().faults == 1);
  CHECK(f.cache->planner().snapshot() == before);
  REQUIRE(f.wide(all_experts(24), f.streams[0]).ok());
  REQUIRE(f.forward(Ids{0, 5}, f.streams[0]).ok());
  f.check_clean();
}

TEST_CASE("negative (edge 10): without the buffer release a round's fill races the consumer two rounds back") {
  const auto races = [](auto tag) {
    using Cache = typename decltype(tag)::type;
    WideFixture<Cache> f(24, 4, 1, 4);
    REQUIRE(f.wide(all_experts(24), f.streams[0]).ok());  // 12 rounds over two halves of 2
    f.rt.drain();
    CHECK(f.log->runs == f.launched);
    return f.rt.races().size();
  };
  CHECK(races(std::type_identity<WideCache<NoWideBufferRelease>>{}) > 0);
  CHECK(races(std::type_identity<RowWide>{}) == 0);
  // Edge 3 orders each round's reader after its own fills, also inside a wide forward.
  CHECK(races(std::type_identity<WideCache<NoReadyWait>>{}) > 0);
  // Span copies (every other expert: each span also writes the slot of an unneeded one).
  const auto span_races = [](auto tag) {
    using Cache = typename decltype(tag)::type;
    WideFixture<Cache> f(24, 4, 1, 8);  // halves of 4 ids: {0, 2} per span, 1 wasted
    Ids even;
    for (std::int32_t e = 0; e < 24; e += 2) even.push_back(e);
    auto r = f.wide(even, f.streams[0], WideAdmission::stream, nullptr, WideCopy::span);
    REQUIRE(r.ok());
    CHECK(r.value().span_rounds == r.value().rounds);
    CHECK(r.value().wasted > 0);
    f.rt.drain();
    CHECK(f.log->runs == f.launched);
    return f.rt.races().size();
  };
  CHECK(span_races(std::type_identity<WideCache<NoWideBufferRelease>>{}) > 0);
  CHECK(span_races(std::type_identity<RowWide>{}) == 0);
}

TEST_CASE("scan resistance: the decode working set's hit rate after a wide forward equals what it was") {
  // Decode: top-2 of 6 hot experts in a 64-expert layer with 8 slots; then a 512-token prompt.
  const auto decode = [](auto& f, std::mt19937_64& rng, int steps) {
    const CacheStats s0 = f.cache->stats();
    for (int i = 0; i < steps; ++i) {
      const auto a = static_cast<std::int32_t>(rng() % 6), b = static_cast<std::int32_t>((a + 1 + rng() % 5) % 6);
      REQUIRE(f.forward(Ids{a * 7, b * 7}, f.streams[0]).ok());
    }
    const CacheStats s1 = f.cache->stats();
    return static_cast<double>(s1.hits - s0.hits) / static_cast<double>(s1.hits + s1.misses - s0.hits - s0.misses);
  };
  const auto run = [&](bool with_prompt, WideAdmission a) {
    WideFixture<RowWide> f(64, 8, 2, 8);
    std::mt19937_64 rng(3), prompt_rng(4);
    (void)decode(f, rng, 32);  // warm
    const double warm = decode(f, rng, 32);
    CHECK(warm == 1.0);  // 6 hot experts fit in 8 slots
    if (with_prompt) REQUIRE(f.wide(random_topk(prompt_rng, 512, 2, 64), f.streams[0], a).ok());
    const double after = decode(f, rng, 16);
    f.check_clean();
    return after;
  };
  const double baseline = run(false, WideAdmission::stream);
  const double streamed = run(true, WideAdmission::stream);
  const double admitted = run(true, WideAdmission::admit);
  MESSAGE("decode hit rate after a prompt: none " << baseline << ", stream " << streamed << ", admit " << admitted);
  CHECK(streamed == baseline);
  CHECK(admitted < baseline);  // the prompt flushed the working set
}

TEST_CASE("ordering: randomized schedules of wide and normal forwards keep the race detector silent") {
  const auto schedule = [](auto tag, std::uint64_t seed) {
    using Cache = typename decltype(tag)::type;
    WideFixture<Cache> f(16, 4, 2, 4);
    f.rt.set_seed(seed);
    std::mt19937_64 rng(seed);
    const int actions = 4 + static_cast<int>(rng() % 6);
    for (int a = 0; a < actions; ++a) {
      const Stream s = f.streams[rng() % f.streams.size()];
      const auto kind = rng() % 10;
      if (kind < 4) {
        REQUIRE(f.forward(random_topk(rng, 1, 2, 16), s).ok());
      } else if (kind < 6) {
        const auto copy = static_cast<WideCopy>(rng() % 3);  // runs, span, automatic
        REQUIRE(f.wide(random_topk(rng, 8, 2, 16), s, WideAdmission::stream, nullptr, copy).ok());
      } else if (kind < 8) {
        REQUIRE(f.wide(random_topk(rng, 8, 2, 16), s, WideAdmission::admit).ok());
      } else {
        REQUIRE(f.cache->invalidate(static_cast<std::int32_t>(rng() % 16), s).ok());
      }
      f.rt.run_random(rng(), rng() % 16);
    }
    f.check_clean();
  };
  for (std::uint64_t seed = 1; seed <= 400; ++seed) {
    schedule(std::type_identity<RowWide>{}, seed);
    schedule(std::type_identity<WholeWide>{}, seed + 1000);
    schedule(std::type_identity<InlineWide>{}, seed + 2000);
  }
}

// ---- ModelExpertCache::prepare_wide (one stream area for the model) --------------------------

namespace {
using ModelWide = ModelExpertCache<TensorMajorStorage, Lru, CopyStream, ExplicitLayout, SimRuntime>;

struct ModelWideFixture {
  SimRuntime rt{SimRuntime::Options{.memory_limit = std::size_t{1} << 28, .seed = 11, .max_races = 16, .max_streams = 16}};
  std::vector<Stream> streams;
  std::unique_ptr<ModelWide> cache;
  std::shared_ptr<ReaderLog> log = std::make_shared<ReaderLog>();
  std::uint64_t launched = 0;
  std::int32_t experts;

  ModelWideFixture(ModelPool pool, std::int32_t layers, std::int32_t experts_, std::int32_t capacity,
                   std::int32_t stream_slots)
      : experts(experts_) {
    for (int i = 0; i < 2; ++i) streams.push_back(rt.create_stream().value());
    ModelCacheOptions o;
    o.num_layers = layers;
    o.num_experts = experts;
    o.capacity = capacity;
    o.top_k = 2;
    o.pool = pool;
    o.stream_slots = stream_slots;
    cache = std::make_unique<ModelWide>(rt, o, six_tensor_layout());
    const auto& tensors = cache->storage().tensors();
    for (std::int32_t l = 0; l < layers; ++l)
      for (std::int32_t e = 0; e < experts; ++e)
        for (std::size_t t = 0; t < num_expert_tensors; ++t)
          for (std::size_t i = 0; i < tensors[t].bytes_per_expert; ++i)
            cache->host_tensor(l, t, e)[i] = pattern_byte(t, l * experts + e, i);
  }

  // Reads the round's (or forward's) experts of `layer` through the view's map and slots.
  Status read(std::int32_t layer, const ForwardView& v, std::span<const std::int32_t> ids_in,
              std::span<const std::int32_t> slots_in, Stream s) {
    std::vector<std::int32_t> ids(ids_in.begin(), ids_in.end()), slots(slots_in.begin(), slots_in.end());
    std::vector<Access> acc{{v.expert_map, static_cast<std::size_t>(experts) * sizeof(std::int32_t), AccessMode::read}};
    for (const std::int32_t slot : slots)
      for (const SlotTensor& t : v.tensors)
        if (t.bytes != 0) acc.push_back({t.slot(slot), t.bytes, AccessMode::read});
    ++launched;
    const std::int32_t key0 = layer * experts;
    return rt.launch(s, acc, [v, ids, slots, key0, log = log]() {
      ++log->runs;
      bool ok = true;
      for (std::size_t k = 0; ok && k < ids.size(); ++k) {
        ok = v.expert_map[ids[k]] == slots[k];
        for (std::size_t t = 0; ok && t < num_expert_tensors; ++t)
          for (std::size_t i = 0; ok && i < v.tensors[t].bytes; ++i)
            ok = v.tensors[t].slot(slots[k])[i] == pattern_byte(t, key0 + ids[k], i);
      }
      if (!ok) ++log->mismatches;
    });
  }
  Status forward(std::int32_t layer, const Ids& topk, Stream s) {
    auto v = cache->prepare(layer, topk, s);
    if (!v.ok()) return v.status();
    Ids ids, slots;
    const auto map = cache->forward_map_host(layer);
    for (std::int32_t e = 0; e < experts; ++e)
      if (map[static_cast<std::size_t>(e)] != absent_slot) {
        ids.push_back(e);
        slots.push_back(map[static_cast<std::size_t>(e)]);
      }
    return read(layer, v.value(), ids, slots, s);
  }
  Result<WideSummary> wide(std::int32_t layer, const Ids& topk, Stream s, WideAdmission admission = WideAdmission::stream,
                           std::vector<Ids>* rounds = nullptr) {
    return cache->prepare_wide(
        layer, topk, s,
        [&](const WideRound& r) noexcept {
          if (rounds) rounds->emplace_back(r.experts.begin(), r.experts.end());
          return read(layer, r.view, r.experts, r.slots, s);
        },
        WideOptions{admission});
  }
  void check_clean() {
    rt.drain();
    CHECK(rt.races().empty());
    if (!rt.races().empty()) MESSAGE(rt.races()[0].description);
    CHECK(log->mismatches == 0);
    CHECK(log->runs == launched);
  }
  // A stream forward of `topk` naming one expert, `expert`: served as one round of exactly that
  // expert, so no earlier forward (refused or admitted) left another one counted.
  void check_serves_only(std::int32_t layer, const Ids& topk, std::int32_t expert) {
    std::vector<Ids> rounds;
    auto r = wide(layer, topk, streams[0], WideAdmission::stream, &rounds);
    REQUIRE(r.ok());
    CHECK(r.value().unique == 1);
    REQUIRE(rounds.size() == 1);
    CHECK(rounds[0] == Ids{expert});
  }
};
}  // namespace

TEST_CASE("model cache wide forward: per-layer and global pools, every round right, the pools untouched") {
  for (const ModelPool pool : {ModelPool::per_layer, ModelPool::global}) {
    CAPTURE(to_string(pool));
    ModelWideFixture f(pool, 3, 16, pool == ModelPool::global ? 9 : 4, 4);
    REQUIRE(f.forward(1, Ids{2, 5}, f.streams[0]).ok());
    REQUIRE(f.forward(2, Ids{7, 8}, f.streams[0]).ok());
    std::vector<ForwardPlanner<Lru>::Snapshot> before;
    for (std::int32_t l = 0; l < 3; ++l) before.push_back(f.cache->planner(l).snapshot());
    auto r = f.wide(1, all_experts(16), f.streams[1]);
    REQUIRE(r.ok());
    CHECK(r.value().hits == 2);
    CHECK(r.value().streamed == 14);
    CHECK(r.value().rounds == 7);
    CHECK(r.value().copies == 7 * 6);  // each round one run of consecutive experts, six tensors
    for (std::int32_t l = 0; l < 3; ++l) CHECK(f.cache->planner(l).snapshot() == before[static_cast<std::size_t>(l)]);
    REQUIRE(f.wide(2, all_experts(16), f.streams[0]).ok());
    REQUIRE(f.forward(1, Ids{2, 5}, f.streams[0]).ok());
    CHECK(f.cache->stats().per_layer[1].hits == 2);
    f.check_clean();
    auto bad = f.wide(3, all_experts(16), f.streams[0]);
    CHECK(bad.status().code() == ErrorCode::invalid_argument);
    auto out = f.wide(0, Ids{1, 16}, f.streams[0]);
    CHECK(out.status().code() == ErrorCode::expert_out_of_range);
    // The refused forward left no expert counted: the next one serves exactly its own.
    f.check_serves_only(0, Ids{4, 4, -1}, 4);
    f.check_clean();
  }
}

TEST_CASE("model cache wide forward, admit admission: rounds of half the pool through the layer's planner") {
  for (const ModelPool pool : {ModelPool::per_layer, ModelPool::global}) {
    CAPTURE(to_string(pool));
    // per_layer: 6 slots per layer (groups of 3); global: 8 slots (groups of 4).
    ModelWideFixture f(pool, 3, 16, pool == ModelPool::global ? 8 : 6, 4);
    REQUIRE(f.forward(0, Ids{3, 4}, f.streams[0]).ok());
    std::vector<Ids> rounds;
    auto r = f.wide(1, all_experts(16), f.streams[1], WideAdmission::admit, &rounds);
    REQUIRE(r.ok());
    const std::size_t group = pool == ModelPool::global ? 4 : 3;
    CHECK(r.value().rounds == (16 + group - 1) / group);
    CHECK(r.value().admission == WideAdmission::admit);
    CHECK(r.value().admitted == 16);
    CHECK(r.value().streamed == 0);
    REQUIRE(rounds.size() == r.value().rounds);
    const Ids all = all_experts(16);
    CHECK(rounds[0] == Ids(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(group)));
    // The pool admitted the layer's experts: the last group is resident and hit.
    const CacheStats l1 = f.cache->stats().per_layer[1];
    CHECK(l1.misses == 16);
    CHECK(l1.prepare_calls == r.value().rounds);
    REQUIRE(f.forward(1, Ids{15}, f.streams[0]).ok());
    CHECK(f.cache->stats().per_layer[1].hits == 1);
    // The admit rounds left no expert counted: a stream forward after them serves exactly its own.
    f.check_serves_only(0, Ids{5, 5, -1}, 5);
    f.check_clean();
    // Bad input: nothing changes.
    const auto before = f.cache->planner(1).snapshot();
    auto out = f.wide(1, Ids{1, 16}, f.streams[0], WideAdmission::admit);
    CHECK(out.status().code() == ErrorCode::expert_out_of_range);
    CHECK(f.cache->planner(1).snapshot() == before);
    // A consumer failing in round 1: the pool as after rounds 0 and 1, the cache usable.
    int calls = 0;
    auto failed = f.cache->prepare_wide(2, all_experts(16), f.streams[0], [&](const WideRound& round) noexcept {
      ++calls;
      if (round.index == 1) return Status(ErrorCode::runtime_failure, "consumer failed");
      return f.read(2, round.view, round.experts, round.slots, f.streams[0]);
    }, WideOptions{WideAdmission::admit});
    REQUIRE_FALSE(failed.ok());
    CHECK(failed.status().message().find("round 1") != std::string_view::npos);
    CHECK(calls == 2);
    CHECK(f.cache->stats().per_layer[2].prepare_calls == 2);
    REQUIRE(f.forward(2, Ids{0, 15}, f.streams[0]).ok());
    f.check_clean();
  }
}

TEST_CASE("model cache wide forward without stream slots: falls back to admit") {
  ModelWideFixture f(ModelPool::per_layer, 2, 12, 4, 0);
  auto r = f.wide(0, all_experts(12), f.streams[0]);
  REQUIRE(r.ok());
  CHECK(r.value().fell_back);
  CHECK(r.value().admission == WideAdmission::admit);
  CHECK(r.value().rounds == 6);
  f.check_clean();
}

TEST_CASE("model cache wide forward: randomized schedules over layers and streams keep the detector silent") {
  for (std::uint64_t seed = 1; seed <= 150; ++seed) {
    for (const ModelPool pool : {ModelPool::per_layer, ModelPool::global}) {
      ModelWideFixture f(pool, 3, 12, pool == ModelPool::global ? 8 : 3, 4);
      f.rt.set_seed(seed);
      std::mt19937_64 rng(seed);
      for (int a = 0; a < 8; ++a) {
        const Stream s = f.streams[rng() % 2];
        const auto layer = static_cast<std::int32_t>(rng() % 3);
        if (rng() % 2 == 0) {
          REQUIRE(f.forward(layer, random_topk(rng, 1, 2, 12), s).ok());
        } else {
          const auto admission = rng() % 3 == 0 ? WideAdmission::admit : WideAdmission::stream;
          REQUIRE(f.wide(layer, random_topk(rng, 6, 2, 12), s, admission).ok());
        }
        f.rt.run_random(rng(), rng() % 16);
      }
      f.check_clean();
    }
  }
}
