// ExpertCache on SimRuntime: data, ordering (race detector over randomized schedules),
// negative tests with each ordering edge removed, faults and bad input.
#include <doctest/doctest.h>

#include <cstdlib>
#include <random>
#include <type_traits>

#include "support/removed_edges.hpp"
#include "support/sim_cache_harness.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;
using Stream = SimRuntime::Stream;

namespace {

template <class Cache>
using Fixture = SimCacheFixture<Cache>;

using RowSim = RowCache<SimRuntime, ExplicitLayout>;
using WholeSim = WholeExpertCache<SimRuntime, ExplicitLayout>;
using InlineSim = ExpertCache<TensorMajorStorage, Sieve, Inline, ExplicitLayout, SimRuntime>;
using BatchedSim = ExpertCache<ExpertMajorStorage, S3Fifo, Batched, ExplicitLayout, SimRuntime>;
using ArcInlineExpertSim = ExpertCache<ExpertMajorStorage, Arc, Inline, ExplicitLayout, SimRuntime>;

Ids random_topk(std::mt19937_64& rng, std::int32_t rows, std::int32_t k, std::int32_t experts) {
  Ids ids;
  for (std::int32_t i = 0; i < rows * k; ++i) {
    const auto r = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(experts + 1));
    ids.push_back(r == experts ? -1 : r);  // some padding
  }
  return ids;
}

// One randomized schedule: prepares from random streams (owner changes), invalidates between
// prepares from random streams, expert-split groups and token-split chunks of overflowing
// forwards, with the simulated GPU advanced by random amounts in between.
template <class Cache>
std::uint64_t run_schedule(std::uint64_t seed) {
  constexpr std::int32_t experts = 12, capacity = 4, k = 2;
  Fixture<Cache> f(experts, capacity, k, seed, 3);
  std::mt19937_64 rng(seed);
  const int actions = 6 + static_cast<int>(rng() % 6);
  for (int a = 0; a < actions; ++a) {
    const Stream s = f.streams[rng() % f.streams.size()];
    const auto kind = rng() % 20;
    if (kind < 11) {
      REQUIRE(f.forward(random_topk(rng, 1 + static_cast<std::int32_t>(rng() % 2), k, experts), s).ok());
    } else if (kind < 14) {
      REQUIRE(f.cache->invalidate(static_cast<std::int32_t>(rng() % experts), s).ok());
    } else if (kind < 17) {
      const Ids wide = random_topk(rng, 6, k, experts);
      auto groups = f.cache->plan_expert_groups(wide);
      REQUIRE(groups.ok());
      for (const auto& g : groups.value()) REQUIRE(f.forward_unique(g.unique_ids, s).ok());
    } else {
      const Ids wide = random_topk(rng, 5, k, experts);
      auto chunks = f.cache->plan_token_chunks(wide);
      REQUIRE(chunks.ok());
      for (const auto& c : chunks.value()) REQUIRE(f.forward_unique(c.unique_ids, s).ok());
    }
    f.rt.run_random(rng(), rng() % 12);
  }
  f.check_clean_after_drain();
  return 1;  // one schedule ran to the end (a failed REQUIRE leaves the test case before this)
}

// 10^5 by default; EXPERT_CACHE_SCHEDULES lowers it for slow builds (the sanitizer run uses
// 10^4) but never below the floor: fewer schedules stop exercising the rare interleavings.
constexpr std::uint64_t default_schedules = 100000;
constexpr std::uint64_t min_schedules = 1000;
std::uint64_t schedules_requested() {
  if (const char* env = std::getenv("EXPERT_CACHE_SCHEDULES")) return std::strtoull(env, nullptr, 10);
  return default_schedules;
}

}  // namespace

TEST_CASE_TEMPLATE("data: every requested expert's slot holds its bytes for all six tensors", Cache, RowSim, WholeSim,
                   InlineSim, BatchedSim, ArcInlineExpertSim) {
  Fixture<Cache> f(24, 6, 3, 42);
  std::mt19937_64 rng(99);
  for (int step = 0; step < 300; ++step) {
    const Stream s = f.streams[step % 7 == 0 ? 1 : 0];
    const Ids topk = random_topk(rng, 2, 3, 24);
    REQUIRE(f.forward(topk, s).ok());
    f.rt.run_random(rng(), rng() % 20);
  }
  f.check_clean_after_drain();
  const auto stats = f.cache->stats();
  CHECK(stats.prepare_calls == 300);
  CHECK(stats.hits + stats.misses > 0);
  CHECK(stats.promotions == stats.misses);
  CHECK(stats.owner_changes > 0);
}

TEST_CASE_TEMPLATE("forward map exposes exactly the request; resident map everything", Cache, RowSim, WholeSim) {
  Fixture<Cache> f(16, 5, 2);
  std::mt19937_64 rng(5);
  for (int step = 0; step < 100; ++step) {
    const Ids topk = random_topk(rng, 2, 2, 16);
    auto view = f.cache->prepare(topk, f.streams[0]);
    REQUIRE(view.ok());
    f.rt.drain();
    Ids unique;
    for (ExpertId e : f.cache->last_plan().unique) unique.push_back(e.value);
    CHECK(forward_map_exact(*f.cache, view.value(), unique));
    const auto host = f.cache->resident_map_host();
    CHECK(std::equal(host.begin(), host.end(), view.value().resident_map));
  }
  CHECK(f.rt.races().empty());
}

TEST_CASE("ordering: the race detector stays silent over >= 1e5 randomized schedules") {
  const std::uint64_t total = schedules_requested();
  INFO("EXPERT_CACHE_SCHEDULES asks for " << total << " schedules");
  REQUIRE_MESSAGE(total >= min_schedules, "refusing fewer than " << min_schedules << " randomized schedules");
  constexpr std::uint64_t configs = 5;
  const std::uint64_t per = (total + configs - 1) / configs;
  std::uint64_t count = 0;
  for (std::uint64_t i = 0; i < per; ++i) {
    count += run_schedule<RowSim>(i * configs + 1);
    count += run_schedule<WholeSim>(i * configs + 2);
    count += run_schedule<InlineSim>(i * configs + 3);
    count += run_schedule<BatchedSim>(i * configs + 4);
    count += run_schedule<ArcInlineExpertSim>(i * configs + 5);
  }
  MESSAGE("randomized schedules checked: " << count);
  CHECK(count >= total);
  CHECK(count >= min_schedules);
}

// ---- negative tests: each edge removed makes the detector fire -----------------------------

namespace {
// The edge-removed OrderingEdges: support/removed_edges.hpp.

// The public ExpertCache always has every edge; the negative tests reach the sixth parameter
// through the detail class it aliases.
template <class Edges, class Staging = CopyStream>
using EdgeCache = detail::ExpertCacheWithEdges<TensorMajorStorage, Lru, Staging, ExplicitLayout, SimRuntime, Edges>;
static_assert(std::is_same_v<EdgeCache<OrderingEdges>, ExpertCache<TensorMajorStorage, Lru, CopyStream, ExplicitLayout, SimRuntime>>);

struct Detected {
  std::size_t races = 0;
  std::uint64_t mismatches = 0;  // bytes a reader found wrong
};

// Slot reuse while the previous forward's reader may still run (WAR).
template <class Edges>
std::size_t races_eviction_reuse() {
  Fixture<EdgeCache<Edges>> f(8, 2, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.forward(Ids{2, 3}, f.streams[0]).ok());  // evicts 0 and 1 while their reader is queued
  f.rt.drain();
  return f.rt.races().size();
}

// Inline mode: an invalidate from another stream wrote the resident map; the owner's next fill
// writes it again from the owner's stream (WAW between two writer streams, neither the owner's
// release nor any `ready` orders them).
template <class Edges>
std::size_t races_inline_writer_change() {
  Fixture<EdgeCache<Edges, Inline>> f(8, 2, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.cache->invalidate(0, f.streams[1]).ok());  // map write on stream 1
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());    // refills 0 on stream 0, the owner
  f.rt.drain();
  return f.rt.races().size();
}

// A reader right after a miss (RAW).
template <class Edges>
Detected read_after_fill() {
  Fixture<EdgeCache<Edges>> f(8, 2, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  f.rt.drain();
  return {f.rt.races().size(), f.log->mismatches};
}

// An all-hit prepare on the owner's stream after an invalidate from another stream: the
// resident map it reads was last written on the copy stream, which only `ready` orders it after.
template <class Edges>
std::size_t races_all_hit_after_invalidate() {
  Fixture<EdgeCache<Edges>> f(8, 2, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.cache->invalidate(1, f.streams[1]).ok());
  REQUIRE(f.forward(Ids{0, -1}, f.streams[0]).ok());  // all hits, nothing to write
  REQUIRE(f.cache->stats().last_copies == 0);
  f.rt.drain();
  return f.rt.races().size();
}

// An all-hit prepare from a new stream uploads a different forward map into the one device
// buffer the previous owner's queued reader still reads (WAR on the forward map).
template <class Edges>
std::size_t races_owner_change_without_writes() {
  Fixture<EdgeCache<Edges>> f(8, 2, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.forward(Ids{0, -1}, f.streams[1]).ok());  // all hits; the forward map changes
  REQUIRE(f.cache->stats().last_copies == 0);
  f.rt.drain();
  return f.rt.races().size();
}

// invalidate from another stream in inline mode while the owner's reader is queued.
template <class Edges>
std::size_t races_invalidate_other_stream() {
  Fixture<EdgeCache<Edges, Inline>> f(8, 2, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.cache->invalidate(0, f.streams[1]).ok());
  f.rt.drain();
  return f.rt.races().size();
}

// Resident-map generations from two streams: a prepare's upload and a later invalidate's.
template <class Edges>
std::size_t races_resident_generations() {
  Fixture<EdgeCache<Edges>> f(8, 2, 2);
  REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
  REQUIRE(f.cache->invalidate(1, f.streams[1]).ok());
  f.rt.drain();
  return f.rt.races().size();
}

// Map uploads faster than the GPU consumes them: the staging ring wraps.
template <class Edges>
std::size_t races_staging_reuse() {
  Fixture<EdgeCache<Edges>> f(8, 4, 2, 1, 2);
  for (int i = 0; i < 4; ++i) REQUIRE(f.forward(Ids{i, i + 1}, f.streams[0]).ok());
  f.rt.drain();
  return f.rt.races().size();
}
}  // namespace

TEST_CASE("negative: removing the release wait lets a fill overwrite a slot its previous reader reads") {
  CHECK(races_eviction_reuse<OrderingEdges>() == 0);
  CHECK(races_eviction_reuse<NoReleaseWait>() > 0);
}

TEST_CASE("negative: removing the last-writer release lets two inline writer streams race on the resident map") {
  CHECK(races_inline_writer_change<OrderingEdges>() == 0);
  CHECK(races_inline_writer_change<NoLastFillRelease>() > 0);
}

TEST_CASE("negative: removing the ready wait lets the consumer read a slot before its fill lands") {
  const Detected with = read_after_fill<OrderingEdges>();
  CHECK(with.races == 0);
  CHECK(with.mismatches == 0);
  const Detected without = read_after_fill<NoReadyWait>();
  CHECK(without.races > 0);  // the detector itself fires, whatever the reader happened to see
  CHECK(without.races + without.mismatches > 0);
}

TEST_CASE("negative: removing the all-hit ready wait lets a reader without writes miss an invalidate's map write") {
  CHECK(races_all_hit_after_invalidate<OrderingEdges>() == 0);
  CHECK(races_all_hit_after_invalidate<NoAllHitReadyWait>() > 0);
}

TEST_CASE("negative: removing the owner-change release lets a new owner overwrite the forward map being read") {
  CHECK(races_owner_change_without_writes<OrderingEdges>() == 0);
  CHECK(races_owner_change_without_writes<NoOwnerChangeRelease>() > 0);
}

TEST_CASE("negative: removing invalidate ordering races its map write with the owner's work") {
  CHECK(races_invalidate_other_stream<OrderingEdges>() == 0);
  CHECK(races_invalidate_other_stream<NoInvalidateOrder>() > 0);
}

TEST_CASE("negative: resident-map uploads off the fill stream let generations race") {
  CHECK(races_resident_generations<OrderingEdges>() == 0);
  CHECK(races_resident_generations<NoResidentSerialisation>() > 0);
}

TEST_CASE("negative: removing the staging-buffer guard rewrites a buffer a pending copy reads") {
  CHECK(races_staging_reuse<OrderingEdges>() == 0);
  CHECK(races_staging_reuse<NoStagingGuard>() > 0);
}

// ---- faults --------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("faults: an injected failure reports a clear error, leaves the cache consistent, next prepare works",
                   Cache, RowSim, WholeSim, InlineSim, BatchedSim) {
  for (FaultKind kind : {FaultKind::copy, FaultKind::record, FaultKind::wait}) {
    for (std::uint64_t nth : {1u, 2u, 3u}) {
      CAPTURE(static_cast<int>(kind));
      CAPTURE(nth);
      Fixture<Cache> f(10, 4, 2);
      REQUIRE(f.forward(Ids{0, 1}, f.streams[0]).ok());
      f.rt.inject_failure(kind, nth);
      Status failed;
      // Misses from another stream exercise copies, records and waits.
      for (int attempt = 0; attempt < 3 && failed.ok(); ++attempt) {
        failed = f.forward(Ids{2 + 2 * attempt, 3 + 2 * attempt}, f.streams[attempt % 2 == 0 ? 1 : 0]);
      }
      REQUIRE_FALSE(failed.ok());
      CHECK(failed.code() == ErrorCode::runtime_failure);
      CHECK(failed.message().find("inject") != std::string::npos);
      CHECK(f.cache->stats().faults == 1);
      // Consistent: every resident expert's slot maps back to it.
      const auto resident = f.cache->resident_map_host();
      const auto owner = f.cache->planner().slot_owner();
      for (std::int32_t e = 0; e < 10; ++e) {
        const std::int32_t s = resident[static_cast<std::size_t>(e)];
        if (s != absent_slot) CHECK(owner[static_cast<std::size_t>(s)] == e);
      }
      f.rt.clear_failures();
      REQUIRE(f.forward(Ids{2, 3}, f.streams[0]).ok());
      REQUIRE(f.forward(Ids{0, 9}, f.streams[1]).ok());
      f.check_clean_after_drain();
    }
  }
}

// ---- bad input -----------------------------------------------------------------------------

TEST_CASE_TEMPLATE("bad input through the full cache: specific error, state and device work unchanged", Cache, RowSim,
                   WholeSim, BatchedSim) {
  Fixture<Cache> f(10, 3, 2);
  REQUIRE(f.forward(Ids{1, 2}, f.streams[0]).ok());
  f.rt.drain();
  const auto snap = f.cache->planner().snapshot();
  const auto stats_before = f.cache->stats();
  const auto ops_before = f.rt.counters();
  auto same = [&] {
    CHECK(f.cache->planner().snapshot() == snap);
    const auto s = f.cache->stats();
    CHECK(s.prepare_calls == stats_before.prepare_calls);
    CHECK(s.map_uploads == stats_before.map_uploads);
    CHECK(s.faults == stats_before.faults);
    CHECK(f.rt.counters() == ops_before);
  };
  CHECK(f.cache->prepare(Ids{1, 10}, f.streams[0]).status().code() == ErrorCode::expert_out_of_range);
  same();
  CHECK(f.cache->prepare(Ids{0, 1, 2, 3}, f.streams[0]).status().code() == ErrorCode::too_many_experts);
  same();
  CHECK(f.cache->prepare_unique(Ids{4, 4}, f.streams[0]).status().code() == ErrorCode::duplicate_expert);
  same();
  CHECK(f.cache->prepare_unique(Ids{-1}, f.streams[0]).status().code() == ErrorCode::expert_out_of_range);
  same();
  CHECK(f.cache->invalidate(10, f.streams[1]).code() == ErrorCode::expert_out_of_range);
  same();
  CHECK(f.cache->invalidate(7, f.streams[1]).ok());  // not resident: a no-op
  same();
  REQUIRE(f.forward(Ids{1, 5}, f.streams[0]).ok());
  f.check_clean_after_drain();
}

TEST_CASE_TEMPLATE("forward map: a repeat is not re-uploaded; a change, a captured upload or a fault re-uploads",
                   Cache, RowSim, WholeSim, InlineSim) {
  Fixture<Cache> f(10, 4, 2);
  const auto uploads = [&] { return f.cache->stats().map_uploads; };
  REQUIRE(f.forward(Ids{1, 2}, f.streams[0]).ok());
  REQUIRE(f.forward(Ids{3, 4}, f.streams[0]).ok());  // 1-4 resident from here on: all hits below
  const std::uint64_t start = uploads();
  REQUIRE(f.forward(Ids{1, 2}, f.streams[0]).ok());
  CHECK(uploads() == start + 1);  // the forward map changed
  // The same forward again, from the same stream and from another one: no upload, and the
  // readers (which check the map they read against the request) still see the right slots.
  REQUIRE(f.forward(Ids{2, 1}, f.streams[0]).ok());
  REQUIRE(f.forward(Ids{1, 2}, f.streams[1]).ok());
  CHECK(uploads() == start + 1);
  REQUIRE(f.forward(Ids{1, 3}, f.streams[1]).ok());
  CHECK(uploads() == start + 2);
  REQUIRE(f.forward(Ids{1, 3}, f.streams[0]).ok());
  CHECK(uploads() == start + 2);

  // Under capture a repeat of the eagerly uploaded map is skipped too (by the capture contract the
  // graph runs before the next cache call, so the device map still holds it) ...
  REQUIRE(f.rt.set_capturing(f.streams[0], true).ok());
  REQUIRE(f.forward(Ids{1, 3}, f.streams[0]).ok());
  CHECK(uploads() == start + 2);
  // ... but a map uploaded inside a capture only lands if the graph is launched: the next eager
  // prepare of the same forward uploads it again.
  REQUIRE(f.forward(Ids{1, 2}, f.streams[0]).ok());
  CHECK(uploads() == start + 3);
  REQUIRE(f.rt.set_capturing(f.streams[0], false).ok());
  REQUIRE(f.forward(Ids{1, 2}, f.streams[0]).ok());
  CHECK(uploads() == start + 4);

  std::uint64_t before = 0;
  // After a failed prepare the device map's content is not trusted: the next prepare uploads.
  f.rt.inject_failure(FaultKind::copy, 1);
  CHECK_FALSE(f.forward(Ids{5, 6}, f.streams[1]).ok());
  f.rt.clear_failures();
  before = uploads();
  REQUIRE(f.forward(Ids{1, 2}, f.streams[1]).ok());
  CHECK(uploads() > before);
  f.check_clean_after_drain();
}

TEST_CASE("Batched staging refuses a capturing stream before any state change") {
  Fixture<BatchedSim> f(10, 3, 2);
  REQUIRE(f.forward(Ids{1, 2}, f.streams[0]).ok());
  const auto snap = f.cache->planner().snapshot();
  REQUIRE(f.rt.set_capturing(f.streams[0], true).ok());
  auto r = f.cache->prepare(Ids{3, 4}, f.streams[0]);
  CHECK(r.status().code() == ErrorCode::capture_unsupported);
  CHECK(f.cache->planner().snapshot() == snap);
  REQUIRE(f.rt.set_capturing(f.streams[0], false).ok());
  REQUIRE(f.forward(Ids{3, 4}, f.streams[0]).ok());
  f.check_clean_after_drain();
}

TEST_CASE("construction rejects impossible configurations with a specific error") {
  SimRuntime rt;
  auto code_of = [&](std::int32_t e, std::int32_t c, std::int32_t k, ExplicitLayout layout) {
    try {
      RowSim cache(rt, quiet_options(e, c, k), layout);
    } catch (const Error& err) {
      return err.code();
    }
    return ErrorCode::ok;
  };
  CHECK(code_of(8, 0, 1, six_tensor_layout()) == ErrorCode::invalid_capacity);
  CHECK(code_of(8, 9, 1, six_tensor_layout()) == ErrorCode::invalid_capacity);
  CHECK(code_of(8, 2, 3, six_tensor_layout()) == ErrorCode::invalid_capacity);
  CHECK(code_of(8, 2, 1, ExplicitLayout{}) == ErrorCode::invalid_argument);
  ExplicitLayout huge = six_tensor_layout();
  huge.bytes[0].bytes_per_expert = std::size_t{1} << 45;
  CHECK(code_of(8, 2, 1, huge) == ErrorCode::invalid_argument);
  ExplicitLayout over_pool = six_tensor_layout();
  over_pool.bytes[0].bytes_per_expert = std::size_t{1} << 36;  // 8 rows exceed the 1 TiB pool limit
  CHECK(code_of(1 << 20, 2, 1, over_pool) == ErrorCode::invalid_argument);
  CHECK(rt.allocated_bytes() == 0);  // nothing leaked by the failed constructions
  CHECK(code_of(8, 2, 1, six_tensor_layout()) == ErrorCode::ok);
}

TEST_CASE("whole-expert cache reproduces the Lfru planner exactly and does one transfer per miss") {
  Fixture<WholeSim> f(16, 4, 2);
  ForwardPlanner<Lfru> reference(CacheShape{16, 4}, 2);
  ForwardPlan plan;
  std::mt19937_64 rng(3);
  for (int step = 0; step < 200; ++step) {
    const Ids topk = random_topk(rng, 1, 2, 16);
    REQUIRE(f.forward(topk, f.streams[0]).ok());
    REQUIRE(reference.plan_topk(topk, plan).ok());
    CHECK(f.cache->last_plan().fills == plan.fills);
    CHECK(f.cache->stats().last_copies == plan.fills.size());
  }
  CHECK(f.cache->planner().snapshot() == reference.snapshot());
  f.check_clean_after_drain();
}

TEST_CASE("row cache copies one row per present tensor per miss; stats and callback") {
  Fixture<RowSim> f(16, 4, 2);
  std::uint64_t calls = 0;
  std::uint64_t last_prepares = 0;
  f.cache->set_stats_callback(
      [&](const CacheStats& s) {
        ++calls;
        last_prepares = s.prepare_calls;
      },
      5);
  REQUIRE(f.forward(Ids{1, 2}, f.streams[0]).ok());
  CHECK(f.cache->stats().last_copies == 2 * 6);
  REQUIRE(f.forward(Ids{1, 2}, f.streams[0]).ok());
  CHECK(f.cache->stats().last_copies == 0);
  for (int i = 0; i < 8; ++i) REQUIRE(f.forward(Ids{i, i + 1}, f.streams[i % 2]).ok());
  CHECK(calls == 2);
  CHECK(last_prepares == 10);
  const auto s = f.cache->stats();
  CHECK(s.capacity == 4);
  CHECK(s.resident == 4);
  CHECK(s.owner_changes == 7);  // i = 1..7 alternate streams
  CHECK(s.slot_bytes == 4 * (96 + 48 + 24 + 12 + 4 + 4) + 2 * 16 * 4);
  CHECK(s.host_bytes >= 16 * (96 + 48 + 24 + 12 + 4 + 4));
  f.check_clean_after_drain();
}

TEST_CASE("storage copy regions: one per present tensor (tensor-major) or one blob (expert-major), as copied") {
  SimRuntime rt;
  ExplicitLayout layout = six_tensor_layout();
  layout.bytes[3].bytes_per_expert = 0;  // an absent tensor has no region
  using TensorSim = ExpertCache<TensorMajorStorage, Lru, CopyStream, ExplicitLayout, SimRuntime>;
  using ExpertSim = ExpertCache<ExpertMajorStorage, Lru, CopyStream, ExplicitLayout, SimRuntime>;
  TensorSim rows(rt, quiet_options(8, 3, 2), layout);
  ExpertSim blobs(rt, quiet_options(8, 3, 2), layout);

  const CopyRegions& tr = rows.storage().copy_regions();
  REQUIRE(tr.count == 5);
  std::size_t r = 0;
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    const std::size_t bytes = layout.bytes[t].bytes_per_expert;
    if (bytes == 0) continue;
    CAPTURE(t);
    CHECK(tr.regions[r].host_base == rows.storage().host_tensor(t, 0));
    CHECK(tr.regions[r].host_base + 5 * tr.regions[r].host_stride == rows.storage().host_tensor(t, 5));
    CHECK(tr.regions[r].slot_base == rows.storage().slot_tensor(t).base);
    CHECK(tr.regions[r].slot_stride == rows.storage().slot_tensor(t).slot_stride);
    CHECK(tr.regions[r].bytes == bytes);
    ++r;
  }
  CHECK(tr.bytes_per_expert() == total_bytes_per_expert(layout.bytes));

  const CopyRegions& br = blobs.storage().copy_regions();
  REQUIRE(br.count == 1);
  CHECK(br.regions[0].host_base == blobs.storage().host_expert(0));
  CHECK(br.regions[0].host_stride == blobs.storage().blob_bytes());
  CHECK(br.regions[0].slot_base == blobs.storage().slot_blob(0));
  CHECK(br.regions[0].slot_stride == blobs.storage().blob_bytes());
  CHECK(br.regions[0].bytes == blobs.storage().blob_bytes());

  // The copies a prepare enqueues are the regions, per fill (plus its map uploads).
  const auto s = rt.create_stream().value();
  const auto check_copies = [&](auto& cache, const CopyRegions& regions) {
    const SimCounters before = rt.counters();
    const std::uint64_t uploads_before = cache.stats().map_uploads;
    REQUIRE(cache.prepare(Ids{1, 2}, s).ok());
    const std::uint64_t uploads = cache.stats().map_uploads - uploads_before;
    CHECK(cache.stats().last_copies == 2 * regions.count);
    CHECK(rt.counters().copies - before.copies == 2 * regions.count + uploads);
    CHECK(rt.counters().copy_bytes - before.copy_bytes == 2 * regions.bytes_per_expert() + uploads * 8 * sizeof(std::int32_t));
  };
  check_copies(rows, tr);
  check_copies(blobs, br);
  rt.drain();
  CHECK(rt.races().empty());
}
