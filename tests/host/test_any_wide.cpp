// Wide forwards and the device policies through the run-time-selected cache (any/any_cache.hpp) on
// SimRuntime: AnyExpertCache::prepare_wide serves the same rounds, copies (coalesced through
// AnyStaging when the held staging coalesces) and counters as the static ExpertCache; the device
// provider serves its rounds through prepare + prepare_group with the policy named in the config
// (lru, lfru, crf: the same maps as the static DeviceExpertCache<..., P>); bad input changes
// nothing and never reaches the consumer.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "expert_cache/any/any_cache.hpp"
#include "support/sim_cache_harness.hpp"
#include "support/stats_checks.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;
using Stream = SimRuntime::Stream;
using AnySim = AnyExpertCache<SimRuntime>;

namespace {

SimRuntime::Options sim_options() {
  return SimRuntime::Options{.memory_limit = std::size_t{1} << 28, .seed = 5, .max_races = 16, .max_streams = 16};
}

AnyCacheConfig config_of(std::string provider, std::string policy, std::string staging, std::string storage,
                         std::int32_t experts, std::int32_t capacity, std::int32_t top_k, std::int32_t stream_slots) {
  AnyCacheConfig c;
  c.provider = std::move(provider);
  c.policy = std::move(policy);
  c.staging = std::move(staging);
  c.storage = std::move(storage);
  c.layout = AnyLayout::of(six_tensor_layout());
  c.options = quiet_options(experts, capacity, top_k);
  c.options.stream_slots = stream_slots;
  return c;
}

void fill_any(AnySim& cache) {
  for (std::int32_t e = 0; e < cache.options().num_experts; ++e) {
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      std::byte* p = cache.host_tensor(t, e);
      for (std::size_t i = 0; i < cache.tensors()[t].bytes_per_expert; ++i) p[i] = pattern_byte(t, e, i);
    }
  }
}

// What one round showed its consumer, captured on the host when the round's reader ran (after
// the round's fills, as the race detector checks): the forward map, and whether every mapped
// slot held its expert's bytes.
struct RoundSeen {
  std::uint32_t index = 0, rounds = 0;
  Ids experts, slots;  // the round's spans (host providers)
  Ids mapped;          // experts the device forward map named, ascending
  Ids mapped_slots;    // their slots
  bool bytes_ok = true;
};

// A kernel-like reader of one round on `s`: the forward map and the round's slots (host
// providers name them; the device provider's may be any of the `slots` pool slots); records
// what the map names and checks those slots' bytes. The next round's fills may already be
// writing the other stream half, so a host round declares only its own slots.
Status read_round(SimRuntime& rt, const WideRound& round, Stream s, std::int32_t experts, std::int32_t slots,
                  std::shared_ptr<std::vector<RoundSeen>> seen) {
  const ForwardView v = round.view;
  const auto n = static_cast<std::size_t>(experts);
  std::vector<Access> acc{{v.expert_map, n * sizeof(std::int32_t), AccessMode::read}};
  for (const SlotTensor& t : v.tensors) {
    if (t.bytes == 0) continue;
    if (round.experts.empty() && round.slots.empty()) {
      acc.push_back({t.base, t.slot_stride * static_cast<std::size_t>(slots - 1) + t.bytes, AccessMode::read});
    }
    for (const std::int32_t slot : round.slots) acc.push_back({t.slot(slot), t.bytes, AccessMode::read});
  }
  seen->push_back(RoundSeen{round.index, round.rounds, Ids(round.experts.begin(), round.experts.end()),
                            Ids(round.slots.begin(), round.slots.end()), {}, {}, true});
  const std::size_t at = seen->size() - 1;
  return rt.launch(s, acc, [v, n, at, seen] {
    RoundSeen& r = (*seen)[at];
    for (std::size_t e = 0; e < n; ++e) {
      const std::int32_t slot = v.expert_map[e];
      if (slot == absent_slot) continue;
      r.mapped.push_back(static_cast<std::int32_t>(e));
      r.mapped_slots.push_back(slot);
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        const SlotTensor& st = v.tensors[t];
        for (std::size_t i = 0; i < st.bytes; ++i) {
          if (st.slot(slot)[i] != pattern_byte(t, static_cast<std::int32_t>(e), i)) r.bytes_ok = false;
        }
      }
    }
  });
}

void check_summary_equal(const WideSummary& a, const WideSummary& b) {
  CHECK(a.rounds == b.rounds);
  CHECK(a.unique == b.unique);
  CHECK(a.hits == b.hits);
  CHECK(a.streamed == b.streamed);
  CHECK(a.admitted == b.admitted);
  CHECK(a.copies == b.copies);
  CHECK(a.bytes == b.bytes);
  CHECK(a.span_rounds == b.span_rounds);
  CHECK(a.wasted == b.wasted);
  CHECK(a.admission == b.admission);
  CHECK(a.fell_back == b.fell_back);
}

void check_rounds_equal(const std::vector<RoundSeen>& a, const std::vector<RoundSeen>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t r = 0; r < a.size(); ++r) {
    CAPTURE(r);
    CHECK(a[r].index == b[r].index);
    CHECK(a[r].rounds == b[r].rounds);
    CHECK(a[r].experts == b[r].experts);
    CHECK(a[r].slots == b[r].slots);
    CHECK(a[r].mapped == b[r].mapped);
    CHECK(a[r].mapped_slots == b[r].mapped_slots);
    CHECK(a[r].bytes_ok);
    CHECK(b[r].bytes_ok);
  }
}

// Every round's map names exactly its spans' experts, the rounds are disjoint and cover `ids`.
void check_rounds_cover(const std::vector<RoundSeen>& rounds, const Ids& ids, bool spans) {
  Ids all;
  for (const RoundSeen& r : rounds) {
    if (spans) CHECK(r.mapped == r.experts);
    all.insert(all.end(), r.mapped.begin(), r.mapped.end());
  }
  Ids want;
  for (std::int32_t e : ids) {
    if (e >= 0) want.push_back(e);
  }
  std::sort(want.begin(), want.end());
  want.erase(std::unique(want.begin(), want.end()), want.end());
  std::sort(all.begin(), all.end());
  CHECK(std::adjacent_find(all.begin(), all.end()) == all.end());  // disjoint
  CHECK(all == want);
}

Ids random_topk(std::mt19937_64& rng, std::int32_t n, std::int32_t experts) {
  Ids ids;
  for (std::int32_t i = 0; i < n; ++i) {
    const auto r = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(experts + 1));
    ids.push_back(r == experts ? -1 : r);
  }
  return ids;
}

// A staging policy with CopyStream's copies that the library does not know to coalesce (as
// Gather, which keeps per-storage state): held by AnyStaging, wide forwards must issue per fill.
struct PerFillCopy {
  static constexpr std::string_view name = "per_fill";
  static constexpr bool uses_copy_stream = true;
  template <class R, class Storage>
  Status issue(R& rt, typename R::Stream stream, const Storage& storage, std::span<const SlotFill> fills) noexcept {
    return CopyStream{}.issue(rt, stream, storage, fills);
  }
};

// One host-provider configuration: the static type the factory's choice must behave as.
template <template <class> class Storage, class Policy, class Staging>
void same_as_static(const char* provider, const char* policy, const char* staging, const char* storage) {
  constexpr std::int32_t E = 24, C = 6, K = 2;
  for (const std::int32_t stream_slots : {0, 8}) {
    for (const WideAdmission admission : {WideAdmission::stream, WideAdmission::admit}) {
      for (const WideCopy copy : {WideCopy::runs, WideCopy::span, WideCopy::automatic}) {
        CAPTURE(provider);
        CAPTURE(staging);
        CAPTURE(stream_slots);
        CAPTURE(to_string(admission));
        CAPTURE(to_string(copy));
        SimRuntime rs(sim_options()), ra(sim_options());
        const Stream ss = rs.create_stream().value(), sa = ra.create_stream().value();
        CacheOptions o = quiet_options(E, C, K);
        o.stream_slots = stream_slots;
        ExpertCache<Storage, Policy, Staging, ExplicitLayout, SimRuntime> ref(rs, o, six_tensor_layout());
        auto made = make_expert_cache(ra, config_of(provider, policy, staging, storage, E, C, K, stream_slots));
        REQUIRE(made.ok());
        AnySim any = std::move(made.value());
        fill_host_pools(ref);
        fill_any(any);
        std::mt19937_64 rng(11);
        for (int step = 0; step < 6; ++step) {
          // Decode forwards between wide ones: the pool holds a working set the wide rounds read.
          for (int d = 0; d < 4; ++d) {
            const Ids ids = random_topk(rng, K, 8);
            REQUIRE(ref.prepare(ids, ss).ok());
            REQUIRE(any.prepare(ids, sa).ok());
          }
          const Ids wide = random_topk(rng, 40, E);
          auto seen_s = std::make_shared<std::vector<RoundSeen>>();
          auto seen_a = std::make_shared<std::vector<RoundSeen>>();
          const std::int32_t slots = C + stream_slots;
          const WideOptions wo{admission, copy};
          auto x = ref.prepare_wide(
              wide, ss, [&](const WideRound& r) { return read_round(rs, r, ss, E, slots, seen_s); }, wo);
          auto y = any.prepare_wide(
              wide, sa, [&](const WideRound& r) { return read_round(ra, r, sa, E, slots, seen_a); }, wo);
          REQUIRE(x.ok());
          REQUIRE(y.ok());
          check_summary_equal(x.value(), y.value());
          rs.drain();
          ra.drain();
          check_rounds_equal(*seen_s, *seen_a);
          check_rounds_cover(*seen_a, wide, true);
          check_stats_equal(ref.stats(), any.stats());
          REQUIRE(std::ranges::equal(ref.resident_map_host(), any.resident_map_host()));
        }
        CHECK(any.stats().wide_forwards == 6);
        CHECK(rs.races().empty());
        CHECK(ra.races().empty());
        CHECK(rs.counters() == ra.counters());  // the same copies, in the same order
      }
    }
  }
}

}  // namespace

TEST_CASE("AnyExpertCache::prepare_wide: host providers serve the static cache's rounds, copies and counters") {
  same_as_static<TensorMajorStorage, Lru, CopyStream>("row", "", "", "");
  same_as_static<TensorMajorStorage, Lru, Inline>("row", "", "inline", "");
  same_as_static<TensorMajorStorage, Lru, Batched>("row", "", "batched", "");
  same_as_static<ExpertMajorStorage, Lfru, CopyStream>("cached", "", "", "");
  same_as_static<ExpertMajorHostStorage, Crf, CopyStream>("row", "crf", "", "expert_major_host");
}

TEST_CASE("AnyExpertCache::prepare_wide: stream slots from the factory config keep the pool as it was") {
  constexpr std::int32_t E = 32, C = 8, K = 2;
  SimRuntime rt(sim_options());
  const Stream s = rt.create_stream().value();
  auto made = make_expert_cache(rt, config_of("row", "", "", "", E, C, K, recommended_stream_slots(C, K)));
  REQUIRE(made.ok());
  AnySim any = std::move(made.value());
  fill_any(any);
  for (std::int32_t e = 0; e < C; e += 2) REQUIRE(any.prepare(Ids{e, e + 1}, s).ok());
  rt.drain();
  const Ids resident_before(any.resident_map_host().begin(), any.resident_map_host().end());
  const CacheStats before = any.stats();
  Ids all;
  for (std::int32_t e = 0; e < E; ++e) all.push_back(e);
  auto seen = std::make_shared<std::vector<RoundSeen>>();
  auto r = any.prepare_wide(all, s, [&](const WideRound& w) { return read_round(rt, w, s, E, C + 4, seen); });
  REQUIRE(r.ok());
  rt.drain();
  CHECK(r.value().admission == WideAdmission::stream);
  CHECK_FALSE(r.value().fell_back);
  CHECK(r.value().hits == C);
  CHECK(r.value().streamed == E - C);
  // Runs of consecutive ids: one copy per dense region per run, far fewer than one per expert.
  CHECK(r.value().copies < static_cast<std::uint64_t>(E - C) * any.copy_regions().count);
  check_rounds_cover(*seen, all, true);
  for (const RoundSeen& w : *seen) CHECK(w.bytes_ok);
  CHECK(std::ranges::equal(any.resident_map_host(), resident_before));
  CHECK(any.stats().misses == before.misses);
  CHECK(any.stats().wide_streamed == E - C);
  CHECK(rt.races().empty());
}

TEST_CASE("AnyStaging coalesces a wide forward's copies when the held policy does, per fill otherwise") {
  using Staging = AnyStaging<CopyStream, PerFillCopy>;
  CHECK(detail::coalescing_staging<Staging>);
  CHECK(detail::coalesces(Staging(0)));
  CHECK_FALSE(detail::coalesces(Staging(1)));
  CHECK_FALSE(detail::coalesces(PerFillCopy{}));
  constexpr std::int32_t E = 16, C = 4;
  std::uint64_t copies[2] = {};
  for (std::size_t held = 0; held < 2; ++held) {
    CAPTURE(held);
    SimRuntime rt(sim_options());
    const Stream s = rt.create_stream().value();
    CacheOptions o = quiet_options(E, C, 1);
    o.stream_slots = 8;
    ExpertCache<TensorMajorStorage, Lru, Staging, ExplicitLayout, SimRuntime> cache(rt, o, six_tensor_layout(),
                                                                                    Lru(CacheShape{E, C}), Staging(held));
    fill_host_pools(cache);
    Ids all;
    for (std::int32_t e = 0; e < E; ++e) all.push_back(e);
    auto seen = std::make_shared<std::vector<RoundSeen>>();
    auto r = cache.prepare_wide(all, s, [&](const WideRound& w) { return read_round(rt, w, s, E, C + 8, seen); },
                                WideOptions{WideAdmission::stream, WideCopy::runs});
    REQUIRE(r.ok());
    rt.drain();
    for (const RoundSeen& w : *seen) CHECK(w.bytes_ok);
    check_rounds_cover(*seen, all, true);
    CHECK(rt.races().empty());
    copies[held] = r.value().copies;
  }
  const std::uint64_t regions = 6;  // six_tensor_layout: six dense tensor-major regions
  CHECK(copies[1] == E * regions);  // per fill and region
  CHECK(copies[0] == 4 * regions);  // 16 ids in rounds of 4 consecutive: one run per round
}

TEST_CASE("AnyExpertCache::prepare_wide, device provider: rounds = prepare + prepare_group, as DeviceExpertCache<P>") {
  constexpr std::int32_t E = 20, C = 5, max_ids = 24;
  const auto run = [&]<class P>(const char* name) {
    CAPTURE(name);
    SimRuntime rs(sim_options()), ra(sim_options());
    const Stream ss = rs.create_stream().value(), sa = ra.create_stream().value();
    RuntimeBuffer<SimRuntime> ids_s(rs, max_ids * sizeof(std::int32_t), MemoryKind::device);
    RuntimeBuffer<SimRuntime> ids_a(ra, max_ids * sizeof(std::int32_t), MemoryKind::device);
    DeviceCacheOptions o;
    o.num_experts = E;
    o.capacity = C;
    o.max_ids = max_ids;
    o.label = "layer";
    DeviceExpertCache<TensorMajorStorage, ExplicitLayout, SimRuntime, P> ref(rs, o, six_tensor_layout());
    AnyCacheConfig c = config_of("device", name, "", "", E, C, 1, 0);
    c.max_ids = max_ids;
    c.options.label = "layer";
    auto made = make_expert_cache(ra, c);
    REQUIRE(made.ok());
    AnySim any = std::move(made.value());
    CHECK(any.policy() == name);
    fill_host_pools(ref);
    fill_any(any);
    std::mt19937_64 rng(23);
    for (int step = 0; step < 40; ++step) {
      const Ids ids = random_topk(rng, 1 + static_cast<std::int32_t>(rng() % max_ids), E);
      for (auto [rt, buf] : {std::pair{&rs, &ids_s}, std::pair{&ra, &ids_a}}) {
        rt->host_access(buf->data(), ids.size() * sizeof(std::int32_t), AccessMode::write);
        std::memcpy(buf->data(), ids.data(), ids.size() * sizeof(std::int32_t));
      }
      const auto n = static_cast<std::int32_t>(ids.size());
      auto seen_s = std::make_shared<std::vector<RoundSeen>>();
      auto seen_a = std::make_shared<std::vector<RoundSeen>>();
      // The static reference: what a captured graph does (prepare, then every provisioned group).
      const auto rounds = static_cast<std::uint32_t>(ref.max_groups(n));
      for (std::uint32_t g = 0; g < rounds; ++g) {
        auto v = g == 0 ? ref.prepare(reinterpret_cast<const std::int32_t*>(ids_s.data()), n, ss, DeviceForward::in_rounds)
                        : ref.prepare_group(static_cast<std::int32_t>(g), ss);
        REQUIRE(v.ok());
        WideRound w;
        w.view = v.value();
        w.index = g;
        w.rounds = rounds;
        REQUIRE(read_round(rs, w, ss, E, C, seen_s).ok());
      }
      auto r = any.prepare_wide(std::span<const std::int32_t>(reinterpret_cast<const std::int32_t*>(ids_a.data()), ids.size()),
                                sa, [&](const WideRound& w) { return read_round(ra, w, sa, E, C, seen_a); });
      REQUIRE(r.ok());
      CHECK(r.value().rounds == rounds);
      CHECK(r.value().admission == WideAdmission::admit);
      rs.drain();
      ra.drain();
      check_rounds_equal(*seen_s, *seen_a);
      check_rounds_cover(*seen_a, ids, false);
      REQUIRE(rs.synchronize(ss).ok());
      REQUIRE(ra.synchronize(sa).ok());
      check_stats_equal(ref.stats(), any.stats());
      CHECK(ref.take_errors() == any.take_errors());
    }
    CHECK(rs.races().empty());
    CHECK(ra.races().empty());
  };
  run.template operator()<DeviceLru>("lru");
  run.template operator()<DeviceLfru>("lfru");
  run.template operator()<DeviceCrf>("crf");
}

TEST_CASE("AnyExpertCache::prepare_wide, device provider with stream slots: as DeviceExpertCache::prepare_wide") {
  constexpr std::int32_t E = 20, C = 5, max_ids = 8, stream_slots = 4;
  SimRuntime rs(sim_options()), ra(sim_options());
  const Stream ss = rs.create_stream().value(), sa = ra.create_stream().value();
  constexpr std::size_t wide_ids = 64;
  RuntimeBuffer<SimRuntime> ids_s(rs, wide_ids * sizeof(std::int32_t), MemoryKind::device);
  RuntimeBuffer<SimRuntime> ids_a(ra, wide_ids * sizeof(std::int32_t), MemoryKind::device);
  DeviceCacheOptions o;
  o.num_experts = E;
  o.capacity = C;
  o.max_ids = max_ids;
  o.stream_slots = stream_slots;
  o.label = "layer";
  DeviceExpertCache<TensorMajorStorage, ExplicitLayout, SimRuntime> ref(rs, o, six_tensor_layout());
  AnyCacheConfig c = config_of("device", "lru", "", "", E, C, 1, stream_slots);
  c.max_ids = max_ids;
  c.options.label = "layer";
  auto made = make_expert_cache(ra, c);
  REQUIRE_MESSAGE(made.ok(), std::string(made.status().message()));
  AnySim any = std::move(made.value());
  fill_host_pools(ref);
  fill_any(any);
  std::mt19937_64 rng(29);
  for (int step = 0; step < 12; ++step) {
    // A decode forward (device ids, planned on the device), then a wide one from device ids.
    const Ids small = random_topk(rng, 1 + static_cast<std::int32_t>(rng() % max_ids), E);
    const Ids wide = random_topk(rng, 1 + static_cast<std::int32_t>(rng() % wide_ids), E);
    for (const Ids* ids : {&small, &wide}) {
      for (auto [rt, buf] : {std::pair{&rs, &ids_s}, std::pair{&ra, &ids_a}}) {
        REQUIRE(rt->synchronize(rt == &rs ? ss : sa).ok());
        rt->host_access(buf->data(), ids->size() * sizeof(std::int32_t), AccessMode::write);
        std::memcpy(buf->data(), ids->data(), ids->size() * sizeof(std::int32_t));
      }
      if (ids == &small) {
        const auto n = static_cast<std::int32_t>(small.size());
        REQUIRE(ref.prepare(reinterpret_cast<const std::int32_t*>(ids_s.data()), n, ss).ok());
        REQUIRE(any.prepare(std::span<const std::int32_t>(reinterpret_cast<const std::int32_t*>(ids_a.data()), small.size()), sa).ok());
        continue;
      }
      auto seen_s = std::make_shared<std::vector<RoundSeen>>();
      auto seen_a = std::make_shared<std::vector<RoundSeen>>();
      auto rr = ref.prepare_wide(reinterpret_cast<const std::int32_t*>(ids_s.data()), wide.size(), ss,
                                 [&](const WideRound& w) { return read_round(rs, w, ss, E, C + stream_slots, seen_s); });
      auto ra_ = any.prepare_wide(std::span<const std::int32_t>(reinterpret_cast<const std::int32_t*>(ids_a.data()), wide.size()),
                                  sa, [&](const WideRound& w) { return read_round(ra, w, sa, E, C + stream_slots, seen_a); });
      REQUIRE(rr.ok());
      REQUIRE(ra_.ok());
      CHECK(ra_.value().admission == WideAdmission::stream);
      CHECK_FALSE(ra_.value().fell_back);
      check_summary_equal(rr.value(), ra_.value());
      rs.drain();
      ra.drain();
      check_rounds_equal(*seen_s, *seen_a);
      check_rounds_cover(*seen_a, wide, true);
    }
    REQUIRE(rs.synchronize(ss).ok());
    REQUIRE(ra.synchronize(sa).ok());
    check_stats_equal(ref.stats(), any.stats());
  }
  CHECK(any.stats().wide_forwards == 12);
  CHECK(rs.races().empty());
  CHECK(ra.races().empty());
  // Admit admission (or no stream slots) keeps the device planner's groups.
  const Ids ids{1, 2, 3};
  ra.host_access(ids_a.data(), ids.size() * sizeof(std::int32_t), AccessMode::write);
  std::memcpy(ids_a.data(), ids.data(), ids.size() * sizeof(std::int32_t));
  auto admit = any.prepare_wide(std::span<const std::int32_t>(reinterpret_cast<const std::int32_t*>(ids_a.data()), ids.size()),
                                sa, [](const WideRound&) { return Status(); }, WideOptions{WideAdmission::admit});
  REQUIRE(admit.ok());
  CHECK(admit.value().admission == WideAdmission::admit);
  ra.drain();
  CHECK(ra.races().empty());
}

TEST_CASE("prepare_wide, device provider: a forward served in rounds is counted, not flagged as an overflow") {
  constexpr std::int32_t E = 16, C = 4, max_ids = 16;
  const Ids wide{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};  // 12 unique experts of C = 4: three groups
  Ids bad_id = wide;
  bad_id[5] = 99;  // dropped and flagged as plan_error_bad_id
  SimRuntime rt(sim_options());
  const Stream s = rt.create_stream().value();
  RuntimeBuffer<SimRuntime> buf(rt, max_ids * sizeof(std::int32_t), MemoryKind::device);
  const auto load = [&](const Ids& ids) {
    rt.host_access(buf.data(), ids.size() * sizeof(std::int32_t), AccessMode::write);
    std::memcpy(buf.data(), ids.data(), ids.size() * sizeof(std::int32_t));
    return std::span<const std::int32_t>(reinterpret_cast<const std::int32_t*>(buf.data()), ids.size());
  };
  const auto settle = [&] {
    rt.drain();
    REQUIRE(rt.synchronize(s).ok());
  };

  SUBCASE("AnyExpertCache") {
    AnyCacheConfig c = config_of("device", "lru", "", "", E, C, 1, 0);
    c.max_ids = max_ids;
    auto made = make_expert_cache(rt, c);
    REQUIRE(made.ok());
    AnySim any = std::move(made.value());
    fill_any(any);
    auto seen = std::make_shared<std::vector<RoundSeen>>();
    const auto consumer = [&](const WideRound& w) { return read_round(rt, w, s, E, C, seen); };
    auto r = any.prepare_wide(load(wide), s, consumer);
    REQUIRE(r.ok());
    CHECK(r.value().rounds == 3);
    settle();
    check_rounds_cover(*seen, wide, false);
    for (const RoundSeen& x : *seen) CHECK(x.bytes_ok);
    CHECK(any.take_errors() == 0u);
    // A plain prepare of the same forward serves group 0 only: still an error.
    REQUIRE(any.prepare(load(wide), s).ok());
    settle();
    CHECK(any.take_errors() == plan_error_overflow);
    // Only the overflow is the wide path's to quiet: a bad id in a wide forward is reported.
    seen->clear();
    REQUIRE(any.prepare_wide(load(bad_id), s, consumer).ok());
    settle();
    Ids kept = bad_id;
    kept[5] = -1;  // what the planner keeps of it
    check_rounds_cover(*seen, kept, false);
    CHECK(any.take_errors() == plan_error_bad_id);
    // The declaration belongs to one forward: the next plain prepare reports its overflow again.
    REQUIRE(any.prepare(load(wide), s).ok());
    settle();
    CHECK(any.take_errors() == plan_error_overflow);
    CHECK(rt.races().empty());
  }
  SUBCASE("DeviceExpertCache: in_rounds counts the overflow in device_stats(), single also flags it") {
    DeviceCacheOptions o;
    o.num_experts = E;
    o.capacity = C;
    o.max_ids = max_ids;
    DeviceExpertCache<TensorMajorStorage, ExplicitLayout, SimRuntime> cache(rt, o, six_tensor_layout());
    fill_host_pools(cache);
    const auto n = static_cast<std::int32_t>(wide.size());
    REQUIRE(cache.prepare(load(wide).data(), n, s, DeviceForward::in_rounds).ok());
    for (std::int32_t g = 1; g < cache.max_groups(n); ++g) REQUIRE(cache.prepare_group(g, s).ok());
    settle();
    CHECK(cache.device_stats().overflows == 1);
    CHECK(cache.device_stats().overflow_groups == 2);
    CHECK(cache.take_errors() == 0u);
    REQUIRE(cache.prepare(load(wide).data(), n, s).ok());
    settle();
    CHECK(cache.device_stats().overflows == 2);
    CHECK(cache.take_errors() == plan_error_overflow);
    CHECK(rt.races().empty());
  }
}

TEST_CASE("AnyExpertCache::prepare_wide: bad input is refused before the consumer runs; nothing changes") {
  constexpr std::int32_t E = 16, C = 4, max_ids = 8;
  int calls = 0;
  const auto consumer = [&](const WideRound&) {
    ++calls;
    return Status();
  };
  {
    SimRuntime rt(sim_options());
    const Stream s = rt.create_stream().value();
    auto made = make_expert_cache(rt, config_of("row", "", "", "", E, C, 1, 4));
    REQUIRE(made.ok());
    AnySim any = std::move(made.value());
    REQUIRE(any.prepare(Ids{1, 2}, s).ok());
    rt.drain();
    const CacheStats before = any.stats();
    const Ids resident(any.resident_map_host().begin(), any.resident_map_host().end());
    const SimCounters counters = rt.counters();
    const auto r = any.prepare_wide(Ids{0, 3, E}, s, consumer);
    CHECK(r.status().code() == ErrorCode::expert_out_of_range);
    CHECK(std::string(r.status().message()).find("16") != std::string::npos);
    check_stats_equal(before, any.stats());
    CHECK(std::ranges::equal(any.resident_map_host(), resident));
    CHECK(rt.counters() == counters);
    CHECK(calls == 0);
    // A consumer that fails: its Status comes back with the round named; the pool is unchanged.
    const auto f = any.prepare_wide(Ids{0, 5, 6, 7, 8, 9, 10}, s, [](const WideRound& w) {
      return w.index == 1 ? Status(ErrorCode::runtime_failure, "consumer failed") : Status();
    });
    CHECK(f.status().code() == ErrorCode::runtime_failure);
    CHECK(std::string(f.status().message()).find("round 1") != std::string::npos);
    CHECK(std::ranges::equal(any.resident_map_host(), resident));
  }
  {
    SimRuntime rt(sim_options());
    const Stream s = rt.create_stream().value();
    AnyCacheConfig c = config_of("device", "crf", "", "", E, C, 1, 0);
    c.max_ids = max_ids;
    auto made = make_expert_cache(rt, c);
    REQUIRE(made.ok());
    AnySim any = std::move(made.value());
    RuntimeBuffer<SimRuntime> ids(rt, (max_ids + 1) * sizeof(std::int32_t), MemoryKind::device);
    rt.drain();
    const CacheStats before = any.stats();
    const SimCounters counters = rt.counters();
    const auto r = any.prepare_wide(
        std::span<const std::int32_t>(reinterpret_cast<const std::int32_t*>(ids.data()), max_ids + 1), s, consumer);
    CHECK(r.status().code() == ErrorCode::invalid_argument);
    CHECK(std::string(r.status().message()).find("max_ids") != std::string::npos);
    check_stats_equal(before, any.stats());
    CHECK(rt.counters() == counters);
    CHECK(calls == 0);
  }
}
