// Wide forwards on the device-planned cache (DeviceExpertCache::prepare_wide, host ids, stream
// admission) on SimRuntime: every round's map and bytes; the device planner's state untouched
// (scan resistance, exactly); copies coalesced; bad input and failures leave the cache as it
// was; the race detector silent over randomized schedules mixing device-planned forwards,
// prefetches, invalidates and wide forwards on three streams, and firing when an edge the wide
// rounds rely on is removed (3, 10, 1, and D10: the host's wait for the resident map's read-back).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "expert_cache/device_cache/device_cache.hpp"
#include "support/removed_edges.hpp"
#include "support/sim_cache_harness.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;
using Stream = SimRuntime::Stream;

namespace {

template <class Edges = OrderingEdges, template <class> class Storage = TensorMajorStorage>
using DevCache = detail::DeviceExpertCacheWithEdges<Storage, ExplicitLayout, SimRuntime, Edges>;

Ids all_experts(std::int32_t n) {
  Ids ids(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = i;
  return ids;
}

// Every byte of expert e's tensors in `slot`.
bool slot_holds(const ForwardView& v, std::int32_t slot, std::int32_t e) {
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    const SlotTensor& st = v.tensors[t];
    for (std::size_t i = 0; i < st.bytes; ++i) {
      if (st.slot(slot)[i] != pattern_byte(t, e, i)) return false;
    }
  }
  return true;
}

template <class Cache>
struct Fixture {
  static constexpr std::int32_t max_ids = 16;
  SimRuntime rt;
  std::vector<Stream> streams;
  std::vector<RuntimeBuffer<SimRuntime>> id_buffers;  // per stream: the router's output
  std::unique_ptr<Cache> cache;
  std::shared_ptr<ReaderLog> log = std::make_shared<ReaderLog>();
  std::uint64_t launched = 0;
  std::int32_t experts, capacity;

  Fixture(std::int32_t e, std::int32_t c, std::int32_t stream_slots, std::uint64_t seed = 7,
          std::int64_t max_wide_ids = default_max_wide_ids)
      : rt(SimRuntime::Options{.memory_limit = std::size_t{1} << 28, .seed = seed, .max_races = 16, .max_streams = 32}),
        experts(e),
        capacity(c) {
    for (int i = 0; i < 3; ++i) {
      streams.push_back(rt.create_stream().value());
      id_buffers.emplace_back(rt, max_ids * sizeof(std::int32_t), MemoryKind::device);
    }
    DeviceCacheOptions o;
    o.num_experts = e;
    o.capacity = c;
    o.max_ids = max_ids;
    o.stream_slots = stream_slots;
    o.max_wide_ids = max_wide_ids;
    cache = std::make_unique<Cache>(rt, o, six_tensor_layout());
    fill_host_pools(*cache);
  }

  std::int32_t* ids_of(std::size_t s) const { return reinterpret_cast<std::int32_t*>(id_buffers[s].data()); }

  // Router -> prepare (planned on the device) -> a reader of the forward's experts, on stream s.
  Status forward(std::size_t s, const Ids& ids) {
    std::int32_t* dst = ids_of(s);
    const Access w{dst, ids.size() * sizeof(std::int32_t), AccessMode::write};
    if (Status r = rt.launch(streams[s], std::span<const Access>(&w, 1), [dst, ids] { std::copy(ids.begin(), ids.end(), dst); });
        !r) {
      return r;
    }
    auto view = cache->prepare(dst, static_cast<std::int32_t>(ids.size()), streams[s]);
    if (!view.ok()) return view.status();
    const ForwardView v = view.value();
    const std::size_t map = static_cast<std::size_t>(experts) * sizeof(std::int32_t);
    std::vector<Access> acc{{v.expert_map, map, AccessMode::read}, {v.resident_map, map, AccessMode::read}};
    for (const SlotTensor& t : v.tensors) {
      if (t.bytes != 0) acc.push_back({t.base, t.slot_stride * static_cast<std::size_t>(capacity - 1) + t.bytes, AccessMode::read});
    }
    ++launched;
    return rt.launch(streams[s], acc, [v, ids, E = experts, log = log] {
      ++log->runs;
      for (const std::int32_t e : ids) {
        const std::int32_t slot = v.expert_map[e];
        if (slot < 0 || v.resident_map[e] != slot || !slot_holds(v, slot, e)) {
          if (log->mismatches++ == 0) log->first_mismatch = "forward: expert " + std::to_string(e);
        }
      }
      (void)E;
    });
  }

  // A reader of one wide round on `s`: the round's map and every byte of its experts' slots.
  // Checked when it runs: the map names exactly the round's experts, a pool slot only for an
  // expert the resident map names there, a stream slot (>= capacity) otherwise.
  Status read_round(const WideRound& round, Stream s) {
    const ForwardView v = round.view;
    const Ids ids(round.experts.begin(), round.experts.end());
    const Ids slots(round.slots.begin(), round.slots.end());
    REQUIRE(ids.size() == slots.size());
    const std::size_t map = static_cast<std::size_t>(experts) * sizeof(std::int32_t);
    std::vector<Access> acc{{v.expert_map, map, AccessMode::read}, {v.resident_map, map, AccessMode::read}};
    for (const std::int32_t slot : slots) {
      for (const SlotTensor& t : v.tensors) {
        if (t.bytes != 0) acc.push_back({t.slot(slot), t.bytes, AccessMode::read});
      }
    }
    ++launched;
    return rt.launch(s, acc, [v, ids, slots, E = experts, C = capacity, log = log] {
      ++log->runs;
      std::size_t named = 0;
      for (std::int32_t e = 0; e < E; ++e) named += v.expert_map[e] != absent_slot ? 1 : 0;
      bool ok = named == ids.size();
      for (std::size_t k = 0; ok && k < ids.size(); ++k) {
        const std::int32_t slot = v.expert_map[ids[k]];
        ok = slot == slots[k] && (slot < C ? v.resident_map[ids[k]] == slot : v.resident_map[ids[k]] == absent_slot) &&
             slot_holds(v, slot, ids[k]);
      }
      if (!ok && log->mismatches++ == 0) log->first_mismatch = "wide round of " + std::to_string(ids.size()) + " experts";
    });
  }

  Result<WideSummary> wide(const Ids& topk, std::size_t s, std::vector<Ids>* rounds = nullptr,
                           WideCopy copy = WideCopy::runs) {
    return cache->prepare_wide(
        topk, streams[s],
        [&, s](const WideRound& r) noexcept {
          if (rounds) rounds->emplace_back(r.experts.begin(), r.experts.end());
          return read_round(r, streams[s]);
        },
        WideOptions{.admission = WideAdmission::stream, .copy = copy});
  }

  Ids resident_map() {
    rt.drain();
    for (Stream s : streams) REQUIRE(rt.synchronize(s).ok());
    const std::int32_t* m = cache->resident_map_device();
    return Ids(m, m + experts);
  }

  void check_clean() {
    rt.drain();
    for (Stream s : streams) REQUIRE(rt.synchronize(s).ok());
    CHECK(rt.races().empty());
    if (!rt.races().empty()) MESSAGE(rt.races()[0].description);
    CHECK(log->mismatches == 0);
    if (log->mismatches != 0) MESSAGE(log->first_mismatch);
    CHECK(log->runs == launched);
  }
};

using Tensor = DevCache<>;
using Whole = DevCache<OrderingEdges, ExpertMajorStorage>;

}  // namespace

TEST_CASE_TEMPLATE("device wide forward: every round's map and bytes; the device planner's state untouched", Cache,
                   Tensor, Whole) {
  Fixture<Cache> f(32, 8, 4);
  REQUIRE(f.forward(0, Ids{3, 9, 9, 20}).ok());  // residents 3, 9, 20
  const Ids resident0 = f.resident_map();
  const CacheStats s0 = f.cache->stats();
  const DevicePlanStats d0 = f.cache->device_stats();
  std::vector<Ids> rounds;
  auto r = f.wide(all_experts(32), 0, &rounds);
  REQUIRE_MESSAGE(r.ok(), std::string(r.status().message()));
  // 29 missing experts in halves of 2: 15 rounds, the 3 residents read in place.
  CHECK(r.value().rounds == 15);
  CHECK(r.value().unique == 32);
  CHECK(r.value().hits == 3);
  CHECK(r.value().streamed == 29);
  REQUIRE(rounds.size() == 15);
  Ids seen;
  for (const Ids& ids : rounds) seen.insert(seen.end(), ids.begin(), ids.end());
  std::sort(seen.begin(), seen.end());
  CHECK(seen == all_experts(32));  // disjoint rounds covering the forward
  f.check_clean();
  // Scan resistance, exactly: the device state and its counters as they were.
  CHECK(f.resident_map() == resident0);
  const DevicePlanStats d1 = f.cache->device_stats();
  CHECK(d1.hits == d0.hits);
  CHECK(d1.misses == d0.misses);
  CHECK(d1.evictions == d0.evictions);
  const CacheStats s1 = f.cache->stats();
  CHECK(s1.hits == s0.hits);
  CHECK(s1.misses == s0.misses);
  CHECK(s1.wide_forwards == 1);
  CHECK(s1.wide_rounds == 15);
  CHECK(s1.wide_hits == 3);
  CHECK(s1.wide_streamed == 29);
  CHECK(s1.wide_bytes == 29 * total_bytes_per_expert(six_tensor_layout().tensors()));
  // The decode working set is still there: the same forward hits all three.
  REQUIRE(f.forward(1, Ids{3, 9, 20}).ok());
  f.check_clean();
  const DevicePlanStats d2 = f.cache->device_stats();
  CHECK(d2.hits == d1.hits + 3);
  CHECK(d2.misses == d1.misses);
  // Consecutive wide forwards on other streams each serve exactly their own experts.
  for (std::size_t s = 0; s < 3; ++s) {
    rounds.clear();
    const Ids odd{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25};
    auto w = f.wide(odd, s, &rounds);
    REQUIRE(w.ok());
    Ids got;
    for (const Ids& ids : rounds) got.insert(got.end(), ids.begin(), ids.end());
    std::sort(got.begin(), got.end());
    CHECK(got == odd);
  }
  f.check_clean();
}

TEST_CASE("device wide forward: runs of consecutive missing experts go as one copy per dense region") {
  SUBCASE("expert-major: one region") {
    Fixture<Whole> f(32, 8, 8);
    auto r = f.wide(Ids{0, 1, 2, 3, 8, 9, 10, 11}, 0);  // two rounds of 4, one run each
    REQUIRE(r.ok());
    CHECK(r.value().rounds == 2);
    CHECK(r.value().copies == 2);
    f.check_clean();
  }
  SUBCASE("tensor-major: six regions") {
    Fixture<Tensor> f(32, 8, 8);
    auto r = f.wide(Ids{0, 1, 2, 3, 8, 10, 11, 12}, 0);  // round 1: runs {8} and {10, 11, 12}
    REQUIRE(r.ok());
    CHECK(r.value().rounds == 2);
    CHECK(r.value().copies == 6 * 3);
    CHECK(f.cache->stats().total_copies == 6 * 3);
    f.check_clean();
  }
  SUBCASE("span copies: unneeded experts copied, never mapped") {
    Fixture<Whole> f(32, 8, 8);
    auto r = f.wide(Ids{0, 2, 4, 6, 8, 10}, 0, nullptr, WideCopy::span);
    REQUIRE(r.ok());
    CHECK(r.value().span_rounds == r.value().rounds);
    CHECK(r.value().wasted > 0);
    f.check_clean();
  }
}

TEST_CASE("device wide forward bad input: refused before anything is enqueued; the cache as it was and usable") {
  Fixture<Tensor> f(16, 4, 4, 7, /*max_wide_ids=*/64);
  REQUIRE(f.forward(0, Ids{1, 2}).ok());
  const Ids resident0 = f.resident_map();
  const CacheStats s0 = f.cache->stats();
  const std::size_t ops = f.rt.pending_ops();
  int calls = 0;
  const auto consumer = [&](const WideRound&) noexcept {
    ++calls;
    return Status();
  };
  auto big = f.cache->prepare_wide(Ids(65, 3), f.streams[0], consumer);
  REQUIRE_FALSE(big.ok());
  CHECK(big.status().code() == ErrorCode::too_many_experts);
  CHECK(big.status().message().find("65 ids") != std::string_view::npos);
  auto out = f.cache->prepare_wide(Ids{1, 2, 16, 3}, f.streams[0], consumer);
  REQUIRE_FALSE(out.ok());
  CHECK(out.status().code() == ErrorCode::expert_out_of_range);
  auto admit = f.cache->prepare_wide(Ids{1, 2}, f.streams[0], consumer, WideOptions{WideAdmission::admit});
  REQUIRE_FALSE(admit.ok());
  CHECK(admit.status().code() == ErrorCode::not_supported);
  CHECK(admit.status().message().find("prepare_group") != std::string_view::npos);
  REQUIRE(f.rt.set_capturing(f.streams[1], true).ok());
  auto captured = f.cache->prepare_wide(Ids{1, 2}, f.streams[1], consumer);
  REQUIRE(f.rt.set_capturing(f.streams[1], false).ok());
  REQUIRE_FALSE(captured.ok());
  CHECK(captured.status().code() == ErrorCode::capture_unsupported);
  CHECK(calls == 0);
  CHECK(f.rt.pending_ops() == ops);  // nothing enqueued
  CHECK(f.resident_map() == resident0);
  const CacheStats s1 = f.cache->stats();
  CHECK(s1.map_uploads == s0.map_uploads);
  CHECK(s1.faults == 0);
  CHECK(s1.wide_rounds == 0);
  // Without stream slots there is no prepare_wide at all.
  Fixture<Tensor> none(16, 4, 0);
  auto no_slots = none.cache->prepare_wide(Ids{1, 2}, none.streams[0], consumer);
  REQUIRE_FALSE(no_slots.ok());
  CHECK(no_slots.status().code() == ErrorCode::not_supported);
  CHECK(no_slots.status().message().find("stream_slots") != std::string_view::npos);
  // Out-of-range stream slots are refused at construction.
  DeviceCacheOptions o;
  o.num_experts = 16;
  o.capacity = 4;
  o.max_ids = 8;
  o.stream_slots = 17;
  CHECK_THROWS_AS(Tensor(f.rt, o, six_tensor_layout()), Error);
  // Still usable: a valid wide forward and a normal one, all bytes right. Negative ids are
  // padding, as in every prepare_wide.
  std::vector<Ids> rounds;
  Ids padded(64, 7);
  padded[3] = -1;
  padded[9] = -5;
  auto next = f.wide(padded, 0, &rounds);
  REQUIRE(next.ok());
  CHECK(next.value().unique == 1);
  REQUIRE(rounds.size() == 1);
  CHECK(rounds[0] == Ids{7});
  REQUIRE(f.wide(all_experts(16), 1).ok());
  REQUIRE(f.forward(0, Ids{1, 5}).ok());
  f.check_clean();
}

TEST_CASE("device wide forward: a consumer failing or throwing mid-forward; the pool as it was, the cache usable") {
  for (const bool throws : {false, true}) {
    CAPTURE(throws);
    Fixture<Tensor> f(24, 6, 4);
    REQUIRE(f.forward(0, Ids{0, 5, 7, 11}).ok());
    const Ids resident0 = f.resident_map();
    int calls = 0;
    auto r = f.cache->prepare_wide(all_experts(24), f.streams[0], [&](const WideRound& round) -> Status {
      ++calls;
      if (round.index == 2) {
        if (throws) throw std::runtime_error("boom");
        return Status(ErrorCode::invalid_argument, "engine kernel refused");
      }
      return f.read_round(round, f.streams[0]);
    });
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == (throws ? ErrorCode::runtime_failure : ErrorCode::invalid_argument));
    CHECK(r.status().message().find("round 2 of") != std::string_view::npos);
    CHECK(r.status().message().find(throws ? "boom" : "engine kernel refused") != std::string_view::npos);
    CHECK(calls == 3);
    CHECK(f.resident_map() == resident0);
    CHECK(f.cache->stats().wide_forwards == 0);
    CHECK(f.cache->stats().wide_rounds == 2);
    REQUIRE(f.forward(1, Ids{0, 5}).ok());
    REQUIRE(f.wide(all_experts(24), 2).ok());
    f.check_clean();
  }
}

TEST_CASE("device wide forward: a runtime failure mid-forward is reported; the pool as it was, the cache usable") {
  Fixture<Tensor> f(24, 6, 4);
  REQUIRE(f.forward(0, Ids{0, 5}).ok());
  const Ids resident0 = f.resident_map();
  f.rt.inject_failure(FaultKind::copy, 12);  // inside a later round's fills
  auto r = f.wide(all_experts(24), 0);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == ErrorCode::runtime_failure);
  CHECK(r.status().message().find("prepare_wide: round") != std::string_view::npos);
  CHECK(f.cache->stats().faults == 1);
  CHECK(f.resident_map() == resident0);
  REQUIRE(f.wide(all_experts(24), 0).ok());
  REQUIRE(f.forward(0, Ids{0, 5}).ok());
  f.check_clean();
}

namespace {

// Random calls on three streams: device-planned forwards, host-id prefetches, invalidates and
// wide forwards. Returns the races the detector saw (the readers' byte checks must pass).
template <class Cache>
std::size_t run_schedule(std::uint64_t seed, bool check_bytes) {
  Fixture<Cache> f(24, 6, 4, seed);
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 1);
  for (int step = 0; step < 24; ++step) {
    const std::size_t s = rng() % 3;
    const auto op = rng() % 10;
    if (op < 4) {
      Ids ids;
      for (int i = 0; i < 4; ++i) ids.push_back(static_cast<std::int32_t>(rng() % 24));
      REQUIRE(f.forward(s, ids).ok());
    } else if (op < 6) {
      Ids ids;
      for (int i = 0; i < 10 + static_cast<int>(rng() % 20); ++i) ids.push_back(static_cast<std::int32_t>(rng() % 24));
      auto r = f.wide(ids, s, nullptr, rng() % 2 == 0 ? WideCopy::runs : WideCopy::automatic);
      REQUIRE_MESSAGE(r.ok(), std::string(r.status().message()));
    } else if (op < 8) {
      const Ids predicted{static_cast<std::int32_t>(rng() % 24), static_cast<std::int32_t>(rng() % 24)};
      const std::int64_t bytes = static_cast<std::int64_t>(total_bytes_per_expert(six_tensor_layout().tensors()));
      if (predicted[0] != predicted[1]) {
        REQUIRE(f.cache->prefetch(std::span<const std::int32_t>(predicted), f.streams[s], PrefetchOptions{2 * bytes, 1}).ok());
      }
    } else {
      REQUIRE(f.cache->invalidate(static_cast<std::int32_t>(rng() % 24), f.streams[s]).ok());
    }
    if (rng() % 4 == 0) f.rt.run_random(rng() % 16);
  }
  f.rt.drain();
  for (Stream st : f.streams) REQUIRE(f.rt.synchronize(st).ok());
  if (check_bytes) {
    CHECK(f.log->mismatches == 0);
    if (f.log->mismatches != 0) MESSAGE(f.log->first_mismatch);
  }
  CHECK(f.log->runs == f.launched);
  return f.rt.races().size();
}

}  // namespace

TEST_CASE("device wide forward ordering: randomized schedules with forwards, prefetches and invalidates stay silent") {
  std::size_t races = 0;
  for (std::uint64_t seed = 1; seed <= 300; ++seed) races += run_schedule<Tensor>(seed, true);
  CHECK(races == 0);
}

TEST_CASE("negative (edges 3, 10 in a device wide forward): without them a round races its fill or a refill") {
  const auto races = [](auto tag) {
    using Cache = typename decltype(tag)::type;
    Fixture<Cache> f(24, 4, 4);
    REQUIRE(f.wide(all_experts(24), 0).ok());  // 10 rounds over two halves of 2
    f.rt.drain();
    CHECK(f.log->runs == f.launched);
    return f.rt.races().size();
  };
  CHECK(races(std::type_identity<Tensor>{}) == 0);
  CHECK(races(std::type_identity<DevCache<NoWideBufferRelease>>{}) > 0);
  CHECK(races(std::type_identity<DevCache<NoReadyWait>>{}) > 0);
}

TEST_CASE("negative (edge D10): without the host's wait for the read-back it reads the resident map too early") {
  const auto races = [](auto tag) {
    using Cache = typename decltype(tag)::type;
    Fixture<Cache> f(24, 6, 4);
    REQUIRE(f.forward(0, Ids{0, 5, 7}).ok());
    f.rt.drain();
    REQUIRE(f.rt.synchronize(f.streams[0]).ok());
    REQUIRE(f.forward(0, Ids{1, 5, 8}).ok());  // pending: the read-back queues behind it
    (void)f.wide(all_experts(24), 0);
    f.rt.drain();
    return f.rt.races().size();
  };
  CHECK(races(std::type_identity<Tensor>{}) == 0);
  CHECK(races(std::type_identity<DevCache<NoWideResidentReadWait>>{}) > 0);
}

TEST_CASE("negative (edge 1 after a device wide forward): a plan on another stream races the rounds' pool reads") {
  const auto races = [](auto tag) {
    using Cache = typename decltype(tag)::type;
    Fixture<Cache> f(24, 4, 4);
    REQUIRE(f.forward(0, Ids{0, 1, 2, 3}).ok());  // the pool: 0..3
    REQUIRE(f.wide(Ids{0, 1, 2, 3, 10, 11}, 0).ok());  // rounds read pool slots on stream 0
    REQUIRE(f.forward(1, Ids{12, 13, 14, 15}).ok());  // evicts all four from stream 1
    f.rt.drain();
    return f.rt.races().size();
  };
  CHECK(races(std::type_identity<Tensor>{}) == 0);
  CHECK(races(std::type_identity<DevCache<NoReleaseWait>>{}) > 0);
}

TEST_CASE("device wide forward from device ids: read back with the resident map, then the same rounds") {
  Fixture<Tensor> f(32, 8, 4, 7, /*max_wide_ids=*/256);
  REQUIRE(f.forward(0, Ids{3, 9, 20}).ok());
  const Ids resident0 = f.resident_map();
  Ids topk;
  for (int t = 0; t < 40; ++t) topk.push_back((t * 7) % 32);
  topk.push_back(-1);
  RuntimeBuffer<SimRuntime> ids(f.rt, topk.size() * sizeof(std::int32_t), MemoryKind::device);
  auto* dst = reinterpret_cast<std::int32_t*>(ids.data());
  const auto route = [&](const Ids& v) {
    const Access w{dst, v.size() * sizeof(std::int32_t), AccessMode::write};
    REQUIRE(f.rt.launch(f.streams[1], std::span<const Access>(&w, 1), [dst, v] { std::copy(v.begin(), v.end(), dst); }).ok());
  };
  route(topk);  // written on stream 1, read by the wide forward on stream 1
  std::vector<Ids> rounds;
  auto r = f.cache->prepare_wide(dst, topk.size(), f.streams[1], [&](const WideRound& round) noexcept {
    rounds.emplace_back(round.experts.begin(), round.experts.end());
    return f.read_round(round, f.streams[1]);
  });
  REQUIRE_MESSAGE(r.ok(), std::string(r.status().message()));
  CHECK(r.value().unique == 32);
  CHECK(r.value().hits == 3);
  Ids seen;
  for (const Ids& v : rounds) seen.insert(seen.end(), v.begin(), v.end());
  std::sort(seen.begin(), seen.end());
  CHECK(seen == all_experts(32));
  f.check_clean();
  CHECK(f.resident_map() == resident0);
  // Bad input: too many ids or a null pointer, refused before anything is enqueued; an id out of
  // range, found after the read-back: the cache unchanged either way.
  const std::size_t ops = f.rt.pending_ops();
  const auto none = [](const WideRound&) noexcept { return Status(); };
  auto big = f.cache->prepare_wide(dst, 257, f.streams[1], none);
  REQUIRE_FALSE(big.ok());
  CHECK(big.status().code() == ErrorCode::too_many_experts);
  auto null = f.cache->prepare_wide(static_cast<const std::int32_t*>(nullptr), 4, f.streams[1], none);
  REQUIRE_FALSE(null.ok());
  CHECK(null.status().code() == ErrorCode::invalid_argument);
  CHECK(f.rt.pending_ops() == ops);
  Ids bad = topk;
  bad[5] = 32;
  route(bad);
  auto out = f.cache->prepare_wide(dst, bad.size(), f.streams[1], none);
  REQUIRE_FALSE(out.ok());
  CHECK(out.status().code() == ErrorCode::expert_out_of_range);
  CHECK(f.resident_map() == resident0);
  CHECK(f.cache->stats().wide_forwards == 1);
  // Usable: the same forward again, and a device-planned forward that still hits.
  route(topk);
  REQUIRE(f.cache->prepare_wide(dst, topk.size(), f.streams[1], [&](const WideRound& round) noexcept {
                   return f.read_round(round, f.streams[1]);
                 }).ok());
  f.check_clean();
  const std::uint64_t hits0 = f.cache->device_stats().hits;
  REQUIRE(f.forward(0, Ids{3, 9, 20}).ok());
  f.check_clean();
  CHECK(f.cache->device_stats().hits == hits0 + 3);
}
