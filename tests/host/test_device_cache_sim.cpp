// DeviceExpertCache on SimRuntime against the host-planned ExpertCache<..., Lru, ...>: the ids
// are written into simulated device memory by a "router" launch, planned and filled by the
// device path's simulated ops, read by a consumer launch that declares every byte it reads.
// Checked: hits/misses per step (device stats deltas), the maps, the slot bytes, bad ids and
// overflow groups, invalidate, owner changes between streams; the race detector stays silent
// over many seeded random schedules, and fires when an edge the device path relies on
// (docs/design.md's table: 1, 2, 6) is removed. With overlap (edge D4) the fill runs off the
// consumer's stream and only the per-slot ready words (events here) order the consumer after it:
// removing the wait on a missing expert's slot makes the detector fire.
#include <doctest/doctest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "expert_cache/device_cache/device_cache.hpp"
#include "expert_cache/eviction/crf.hpp"
#include "expert_cache/eviction/lfru.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "support/caller_memory.hpp"
#include "support/device_plan_support.hpp"
#include "support/removed_edges.hpp"
#include "support/sim_cache_harness.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;
using Stream = SimRuntime::Stream;

namespace {

template <class Edges, template <class> class Storage = TensorMajorStorage, class Policy = DeviceLru>
using DevCacheE = detail::DeviceExpertCacheWithEdges<Storage, ExplicitLayout, SimRuntime, Edges, Policy>;
using HostRef = ExpertCache<TensorMajorStorage, Lru, Inline, ExplicitLayout, SimRuntime>;
using HostRefExpertMajor = ExpertCache<ExpertMajorStorage, Lru, Inline, ExplicitLayout, SimRuntime>;

struct ReadLog {
  std::uint64_t runs = 0;
  std::uint64_t mismatches = 0;
  std::string first;
  std::uint64_t consumer_copies = 0;  // fill_by_consumer: experts the consumer copied from host
  std::uint64_t unfilled_seen = 0;    // ... whose slot did not yet hold them (no fill ran before)
};

Ids sorted_unique_valid(const Ids& ids, std::int32_t experts) {
  std::set<std::int32_t> u;
  for (std::int32_t id : ids) {
    if (id >= 0 && id < experts) u.insert(id);
  }
  return Ids(u.begin(), u.end());
}

std::vector<Ids> groups_of(const Ids& ids, std::int32_t experts, std::int32_t capacity) {
  const Ids all = sorted_unique_valid(ids, experts);
  std::vector<Ids> out;
  for (std::size_t b = 0; b < all.size(); b += static_cast<std::size_t>(capacity)) {
    const std::size_t e = std::min(all.size(), b + static_cast<std::size_t>(capacity));
    out.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(b), all.begin() + static_cast<std::ptrdiff_t>(e));
  }
  return out;
}

// The device-planned cache's demand and speculative counters against the host-planned reference's.
void check_same_prefetch_stats(const CacheStats& dev, const CacheStats& host) {
  CHECK(dev.hits == host.hits);
  CHECK(dev.misses == host.misses);
  CHECK(dev.evictions == host.evictions);
  CHECK(dev.speculative_issued == host.speculative_issued);
  CHECK(dev.speculative_used == host.speculative_used);
  CHECK(dev.speculative_wasted == host.speculative_wasted);
}

// Router output: padding, duplicates, and (with `bad`) values a broken router writes.
Ids random_ids(std::mt19937_64& rng, std::int32_t n, std::int32_t experts, bool bad) {
  Ids ids;
  for (std::int32_t i = 0; i < n; ++i) {
    const auto r = rng() % 100;
    if (r < 8) {
      ids.push_back(-1);
    } else if (bad && r < 12) {
      const std::int32_t junk[] = {INT32_MIN, -7, experts, experts + 3, INT32_MAX};
      ids.push_back(junk[rng() % 5]);
    } else {
      ids.push_back(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(experts)));
    }
  }
  return ids;
}

// Every byte of expert e's tensors in `slot` of the view's slot buffers.
bool slot_holds(const ForwardView& v, std::int32_t slot, std::int32_t e) {
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    const SlotTensor& st = v.tensors[t];
    for (std::size_t i = 0; i < st.bytes; ++i)
      if (st.slot(slot)[i] != pattern_byte(t, e, i)) return false;
  }
  return true;
}

template <class Edges = OrderingEdges, template <class> class Storage = TensorMajorStorage,
          class Host = HostRef, class Policy = DeviceLru>
struct Fixture {
  using Dev = DevCacheE<Edges, Storage, Policy>;
  static constexpr std::int32_t max_ids = 24;
  SimRuntime rt;
  SimRuntime host_rt;  // the reference runs on its own runtime, drained at once
  std::vector<Stream> streams;
  std::vector<RuntimeBuffer<SimRuntime>> id_buffers;  // one per stream: the router's output
  std::vector<RuntimeBuffer<SimRuntime>> prefetch_buffers;  // one per stream: a predictor's output
  std::unique_ptr<Dev> dev;
  std::unique_ptr<Host> host;
  Stream host_stream;
  std::int32_t experts, capacity;
  std::shared_ptr<ReadLog> log = std::make_shared<ReadLog>();
  std::uint64_t readers = 0;
  bool overlap = false;
  std::int32_t skip_wait_slot = -1;  // overlap: the consumer does not wait for this slot's ready word
  bool by_consumer = false;  // fill_by_consumer: read() first copies the flagged misses (consume_missing)

  Fixture(std::int32_t e, std::int32_t c, std::uint64_t seed = 1, bool with_overlap = false,
          std::uint64_t crf_decay = crf_default_decay_q32, bool fill_by_consumer = false,
          const std::function<void(DeviceCacheOptions&)>& tweak = {})
      : rt(SimRuntime::Options{.memory_limit = std::size_t{1} << 30, .seed = seed, .max_races = 64, .max_streams = 64}),
        experts(e),
        capacity(c),
        overlap(with_overlap),
        by_consumer(fill_by_consumer) {
    for (int i = 0; i < 3; ++i) {
      streams.push_back(rt.create_stream().value());
      id_buffers.emplace_back(rt, max_ids * sizeof(std::int32_t), MemoryKind::device);
      prefetch_buffers.emplace_back(rt, static_cast<std::size_t>(e) * sizeof(std::int32_t), MemoryKind::device);
    }
    DeviceCacheOptions o;
    o.num_experts = e;
    o.capacity = c;
    o.max_ids = max_ids;
    o.overlap = with_overlap;
    o.crf_decay_q32 = crf_decay;
    o.fill_by_consumer = fill_by_consumer;
    if (tweak) tweak(o);
    dev = std::make_unique<Dev>(rt, o, six_tensor_layout());
    host = std::make_unique<Host>(host_rt, quiet_options(e, c, 1), six_tensor_layout());
    host_stream = host_rt.create_stream().value();
    fill_host_pools(*dev);
    fill_host_pools(*host);
  }

  std::int32_t* ids_of(std::size_t s) const { return reinterpret_cast<std::int32_t*>(id_buffers[s].data()); }

  // The router: a launch on stream s that writes `ids` into s's id buffer.
  Status route(std::size_t s, const Ids& ids) {
    std::int32_t* dst = ids_of(s);
    const Access w{dst, ids.size() * sizeof(std::int32_t), AccessMode::write};
    rt.set_next_label("router");
    return rt.launch(streams[s], std::span<const Access>(&w, ids.empty() ? 0 : 1),
                     [dst, ids] { std::copy(ids.begin(), ids.end(), dst); });
  }

  // The consumer of one group: reads the maps and (whole: it finds its slots through the map)
  // every slot buffer; checks the forward map holds exactly `expect`, each with its bytes.
  // Overlap: first waits for every slot's ready event (the acquire of its ready word; all of
  // them, since the slots it reads are known only on the device), except skip_wait_slot, and
  // checks each slot it reads has its ready word at the needed sequence value.
  Status read(std::size_t s, Ids expect) {
    if (by_consumer) {
      if (Status c = consume_missing(s); !c) return c;
    }
    if (overlap) {
      for (std::int32_t j = 0; j < capacity; ++j) {
        if (j == skip_wait_slot) continue;
        if (Status w = rt.wait(streams[s], dev->executor().ready_event(j)); !w) return w;
      }
    }
    const SlotReadiness ready = dev->readiness();
    std::vector<Access> acc;
    const std::size_t map = static_cast<std::size_t>(experts) * sizeof(std::int32_t);
    const ForwardView v = dev->view();
    acc.push_back({v.expert_map, map, AccessMode::read});
    acc.push_back({v.resident_map, map, AccessMode::read});
    for (const SlotTensor& t : v.tensors) {
      if (t.bytes != 0) acc.push_back({t.base, t.slot_stride * static_cast<std::size_t>(capacity - 1) + t.bytes, AccessMode::read});
    }
    ++readers;
    rt.set_next_label("consumer");
    const std::int32_t e_count = experts;
    return rt.launch(streams[s], acc, [v, ready, expect = std::move(expect), e_count, log = log] {
      ++log->runs;
      std::vector<bool> want(static_cast<std::size_t>(e_count), false);
      for (std::int32_t e : expect) want[static_cast<std::size_t>(e)] = true;
      for (std::int32_t e = 0; e < e_count; ++e) {
        const std::int32_t slot = v.expert_map[e];
        bool ok = (slot >= 0) == want[static_cast<std::size_t>(e)];
        if (ok && slot >= 0) {
          ok = v.resident_map[e] == slot;
          if (ok && ready.enabled()) ok = slot_seq_reached(ready.ready[slot], ready.needed[slot]);
          ok = ok && slot_holds(v, slot, e);
        }
        if (!ok && log->mismatches++ == 0) {
          log->first = "expert " + std::to_string(e) + " forward map " + std::to_string(slot) + " resident " +
                       std::to_string(v.resident_map[e]) + (want[static_cast<std::size_t>(e)] ? " (wanted)" : " (not wanted)");
        }
      }
    });
  }

  // fill_by_consumer: the consumer's own copies (MoeConsumer::run_one_pass's part of it): every
  // expert the view flags missing, with a slot in the expert map, copied region by region from
  // the host pools into its slot. Declares the flags and the map read, every host pool read and
  // every slot buffer written (the slots are known only on the device).
  Status consume_missing(std::size_t s) {
    const ForwardView v = dev->view();
    if (v.missing == nullptr) return Status(ErrorCode::invalid_argument, "fill_by_consumer view without missing flags");
    const std::size_t map = static_cast<std::size_t>(experts) * sizeof(std::int32_t);
    std::vector<Access> acc{{v.missing, map, AccessMode::read}, {v.expert_map, map, AccessMode::read}};
    const CopyRegions regions = dev->storage().copy_regions();
    for (const CopyRegion& r : regions) {
      if (r.bytes == 0) continue;
      acc.push_back({r.host_base, r.host_stride * static_cast<std::size_t>(experts - 1) + r.bytes, AccessMode::read});
      acc.push_back({r.slot_base, r.slot_stride * static_cast<std::size_t>(capacity - 1) + r.bytes, AccessMode::write});
    }
    rt.set_next_label("consumer (copies the missing experts)");
    return rt.launch(streams[s], acc, [v, regions, E = experts, log = log] {
      for (std::int32_t e = 0; e < E; ++e) {
        const std::int32_t slot = v.expert_map[e];
        if (v.missing[e] == 0 || slot < 0) continue;
        ++log->consumer_copies;
        if (!slot_holds(v, slot, e)) ++log->unfilled_seen;
        for (const CopyRegion& r : regions) {
          if (r.bytes == 0) continue;
          std::memcpy(r.slot_base + static_cast<std::size_t>(slot) * r.slot_stride,
                      r.host_base + static_cast<std::size_t>(e) * r.host_stride, r.bytes);
        }
      }
    });
  }

  struct StepCounts {
    std::uint64_t hits = 0, misses = 0;
  };

  // One forward on stream s: router -> prepare -> consumer, then `rounds` - 1 overflow rounds
  // (prepare_group -> consumer). rounds = 0: the groups the forward needs. The host reference
  // plans the same forward (bad ids dropped, one prepare_unique per group).
  StepCounts step(std::size_t s, const Ids& ids, std::int32_t rounds = 0) {
    const std::vector<Ids> groups = groups_of(ids, experts, capacity);
    if (rounds == 0) rounds = std::max<std::int32_t>(1, static_cast<std::int32_t>(groups.size()));
    REQUIRE(rounds >= static_cast<std::int32_t>(groups.size()));
    REQUIRE(route(s, ids).ok());
    auto view = dev->prepare(ids_of(s), static_cast<std::int32_t>(ids.size()), streams[s]);
    REQUIRE_MESSAGE(view.ok(), std::string(view.status().message()));
    REQUIRE(read(s, groups.empty() ? Ids{} : groups[0]).ok());
    for (std::int32_t g = 1; g < rounds; ++g) {
      auto gv = dev->prepare_group(g, streams[s]);
      REQUIRE_MESSAGE(gv.ok(), std::string(gv.status().message()));
      REQUIRE(read(s, g < static_cast<std::int32_t>(groups.size()) ? groups[static_cast<std::size_t>(g)] : Ids{}).ok());
    }
    StepCounts c;
    if (groups.empty()) {
      REQUIRE(host->prepare_unique(Ids{}, host_stream).ok());
    }
    for (const Ids& g : groups) {
      REQUIRE(host->prepare_unique(g, host_stream).ok());
      c.hits += host->last_plan().hits;
      c.misses += host->last_plan().misses;
    }
    host_rt.drain();
    return c;
  }

  // A predictor kernel on stream s writes `predicted` (valid ids) into device memory, then the
  // device cache prefetches them there; the host reference prefetches the same ids.
  void prefetch(std::size_t s, const Ids& predicted, std::int32_t max_fills, std::uint32_t expires_after,
                bool evict_last_forward = false) {
    std::int32_t* dst = prefetch_ids_of(s);
    const Access w{dst, predicted.size() * sizeof(std::int32_t), AccessMode::write};
    rt.set_next_label("predictor");
    REQUIRE(rt.launch(streams[s], std::span<const Access>(&w, predicted.empty() ? 0 : 1),
                      [dst, predicted] { std::copy(predicted.begin(), predicted.end(), dst); })
                .ok());
    const std::int64_t bytes = static_cast<std::int64_t>(total_bytes_per_expert(six_tensor_layout().tensors()));
    // A budget between whole experts; the host reference without precision feedback, which the
    // device-planned cache does not apply.
    PrefetchOptions o{max_fills * bytes + bytes / 2, expires_after, {}, default_min_score, false};
    o.evict_last_forward = evict_last_forward;
    auto r = dev->prefetch(dst, static_cast<std::int32_t>(predicted.size()), streams[s], o);
    REQUIRE_MESSAGE(r.ok(), std::string(r.status().message()));
    const auto h = host->prefetch(predicted, host_stream, o);
    REQUIRE_MESSAGE(h.ok(), std::string(h.status().message()));
    host_rt.drain();
  }
  // Host ids with scores: the device cache selects on the host and plans the selected ids on
  // the device; the host reference plans the same scored call. Returns the device call's view.
  PrefetchView prefetch_scored(std::size_t s, const Ids& predicted, const std::vector<float>& scores, float min_score,
                               std::int32_t max_fills, std::uint32_t expires_after) {
    const std::int64_t bytes = static_cast<std::int64_t>(total_bytes_per_expert(six_tensor_layout().tensors()));
    const PrefetchOptions o{max_fills * bytes + bytes / 2, expires_after, scores, min_score, false};
    auto r = dev->prefetch(std::span<const std::int32_t>(predicted), streams[s], o);
    REQUIRE_MESSAGE(r.ok(), std::string(r.status().message()));
    auto h = host->prefetch(predicted, host_stream, o);
    REQUIRE(h.ok());
    CHECK(r.value().skipped_unlikely == h.value().skipped_unlikely);
    host_rt.drain();
    return r.value();
  }
  std::int32_t* prefetch_ids_of(std::size_t s) const {
    return reinterpret_cast<std::int32_t*>(prefetch_buffers[s].data());
  }

  void invalidate(std::size_t s, std::int32_t e) {
    REQUIRE(dev->invalidate(e, streams[s]).ok());
    REQUIRE(host->invalidate(e, host_stream).ok());
    host_rt.drain();
  }

  // Everything done, the host ordered after every stream.
  void settle() {
    rt.drain();
    for (Stream s : streams) REQUIRE(rt.synchronize(s).ok());
  }

  // Device state equals the host reference: resident map, slot owners' bytes (every slot
  // buffer byte), and the forward map when the last round was a real group.
  void check_equal(bool forward_is_last_group) {
    const auto hr = host->resident_map_host();
    const std::int32_t* dr = dev->resident_map_device();
    CHECK(std::equal(hr.begin(), hr.end(), dr));
    const std::int32_t* df = dev->forward_map_device();
    if (forward_is_last_group) {
      const auto hf = host->forward_map_host();
      CHECK(std::equal(hf.begin(), hf.end(), df));
    } else {
      CHECK(std::all_of(df, df + experts, [](std::int32_t x) { return x == -1; }));
    }
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const SlotTensor a = dev->storage().slot_tensor(t), b = host->storage().slot_tensor(t);
      if (a.bytes == 0) continue;
      for (std::int32_t s = 0; s < capacity; ++s) {
        if (hr.end() == std::find(hr.begin(), hr.end(), s)) continue;  // never-filled or freed: not compared
        CHECK(std::memcmp(a.slot(s), b.slot(s), a.bytes) == 0);
      }
    }
  }

  void check_clean() {
    CHECK(rt.race_count() == 0);
    if (rt.race_count() != 0) MESSAGE(rt.races()[0].description);
    CHECK(log->mismatches == 0);
    if (log->mismatches != 0) MESSAGE(log->first);
    CHECK(log->runs == readers);
  }
};

}  // namespace

TEST_CASE("device cache: step by step equal to the host-planned Lru cache (hits, misses, maps, slot bytes)") {
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    Fixture<> f(20, 6, seed);
    std::mt19937_64 rng(seed * 7919);
    bool last_full = true;  // the last forward ran exactly its groups (no empty rounds after)
    for (int step = 0; step < 60; ++step) {
      const std::size_t s = rng() % 4 == 0 ? rng() % 3 : 0;  // owner changes now and then
      const auto kind = rng() % 10;
      if (kind == 0) {
        f.invalidate(rng() % 3, static_cast<std::int32_t>(rng() % 20));
        f.settle();
        f.check_equal(last_full);
        continue;
      }
      // Mostly small forwards (the register path), some wide ones (overflow, general path).
      const std::int32_t n = kind < 7 ? 1 + static_cast<std::int32_t>(rng() % 8) : 9 + static_cast<std::int32_t>(rng() % 16);
      const Ids ids = random_ids(rng, n, 20, kind == 9);
      const std::int32_t needed = std::max<std::int32_t>(1, static_cast<std::int32_t>(groups_of(ids, 20, 6).size()));
      const std::int32_t rounds = rng() % 3 == 0 ? f.dev->max_groups(n) : needed;  // a graph provisions max_groups
      const DevicePlanStats before = f.dev->device_stats();
      const auto expect = f.step(s, ids, rounds);
      f.settle();
      const DevicePlanStats after = f.dev->device_stats();
      INFO("seed " << seed << " step " << step << " n " << n << " groups " << needed << " rounds " << rounds);
      CHECK(after.hits - before.hits == expect.hits);
      CHECK(after.misses - before.misses == expect.misses);
      CHECK(after.bad_ids - before.bad_ids == static_cast<std::uint64_t>(count_bad(ids, 20)));
      CHECK(after.overflows - before.overflows == (needed > 1 ? 1u : 0u));
      CHECK(after.overflow_groups - before.overflow_groups == static_cast<std::uint64_t>(needed - 1));
      last_full = rounds == needed;
      f.check_equal(last_full);
      // The sanitized ids: every dropped one as -1, the rest unchanged.
      const std::int32_t* san = f.dev->sanitized_ids_device();
      for (std::size_t i = 0; i < ids.size(); ++i) {
        const bool valid = ids[i] >= 0 && ids[i] < 20;
        CHECK(san[i] == (valid ? ids[i] : -1));
      }
    }
    f.check_clean();
    const CacheStats cs = f.dev->stats();
    const CacheStats hs = f.host->stats();
    CHECK(cs.hits == hs.hits);
    CHECK(cs.misses == hs.misses);
    CHECK(cs.evictions == hs.evictions);
    CHECK(cs.invalidations == hs.invalidations);
    CHECK(cs.resident == hs.resident);
    CHECK(cs.promotions == hs.promotions);
  }
}

// The device policies beyond LRU through the whole cache: the same decisions and slot bytes as the
// host-planned cache with the host policy, forwards, overflow rounds, prefetches and
// invalidations on three streams, race-free.
template <class Policy, class HostPolicy>
void device_policy_cache_run() {
  using Host = ExpertCache<TensorMajorStorage, HostPolicy, Inline, ExplicitLayout, SimRuntime>;
  std::uint64_t evictions = 0;
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    Fixture<OrderingEdges, TensorMajorStorage, Host, Policy> f(20, 6, seed);
    std::mt19937_64 rng(seed * 104729);
    bool last_full = true;
    for (int step = 0; step < 60; ++step) {
      const std::size_t s = rng() % 4 == 0 ? rng() % 3 : 0;
      const auto kind = rng() % 12;
      if (kind == 0) {
        f.invalidate(rng() % 3, static_cast<std::int32_t>(rng() % 20));
      } else if (kind == 1) {
        Ids predicted;
        for (int i = 0; i < 3; ++i) predicted.push_back(static_cast<std::int32_t>(rng() % 20));
        f.prefetch(s, predicted, 2, 2);
      } else {
        const std::int32_t n = kind < 9 ? 1 + static_cast<std::int32_t>(rng() % 8) : 9 + static_cast<std::int32_t>(rng() % 16);
        const Ids ids = random_ids(rng, n, 20, kind == 11);
        const std::int32_t needed = std::max<std::int32_t>(1, static_cast<std::int32_t>(groups_of(ids, 20, 6).size()));
        const std::int32_t rounds = rng() % 3 == 0 ? f.dev->max_groups(n) : needed;
        const DevicePlanStats before = f.dev->device_stats();
        const auto expect = f.step(s, ids, rounds);
        f.settle();
        const DevicePlanStats after = f.dev->device_stats();
        INFO("seed " << seed << " step " << step << " n " << n);
        CHECK(after.hits - before.hits == expect.hits);
        CHECK(after.misses - before.misses == expect.misses);
        last_full = rounds == needed;
      }
      f.settle();
      f.check_equal(last_full);
    }
    f.check_clean();
    const CacheStats cs = f.dev->stats();
    const CacheStats hs = f.host->stats();
    CHECK(cs.hits == hs.hits);
    CHECK(cs.misses == hs.misses);
    CHECK(cs.evictions == hs.evictions);
    evictions += cs.evictions;
  }
  CHECK(evictions > 500);
}

TEST_CASE("device cache: DeviceLfru and DeviceCrf equal the host-planned Lfru / Crf caches step by step") {
  SUBCASE("lfru") { device_policy_cache_run<DeviceLfru, Lfru>(); }
  SUBCASE("crf") { device_policy_cache_run<DeviceCrf, Crf>(); }
}

TEST_CASE("device cache: expert-major storage (one region per fill) gives the same bytes") {
  Fixture<OrderingEdges, ExpertMajorStorage, HostRefExpertMajor> f(16, 5, 3);
  std::mt19937_64 rng(3);
  for (int step = 0; step < 80; ++step) {
    const Ids ids = random_ids(rng, 1 + static_cast<std::int32_t>(rng() % 12), 16, step % 5 == 0);
    const DevicePlanStats before = f.dev->device_stats();
    const auto expect = f.step(step % 2, ids);
    f.settle();
    CHECK(f.dev->device_stats().hits - before.hits == expect.hits);
    CHECK(f.dev->device_stats().misses - before.misses == expect.misses);
    f.check_equal(true);
  }
  f.check_clean();
}

namespace {
// One free-running schedule: steps from random streams (owner changes), invalidates from random
// streams, overflow rounds, the simulated GPU advanced by random amounts in between; then the
// final state against the host reference.
template <class Edges, template <class> class Storage = TensorMajorStorage, class Host = HostRef>
std::uint64_t run_schedule(std::uint64_t seed, bool check_races, bool overlap = false, bool prefetches = false,
                           bool by_consumer = false, FillEngine engine = FillEngine::sm_loads,
                           bool speculate_on_copy_engine = false) {
  Fixture<Edges, Storage, Host> f(12, 4, seed, overlap, crf_default_decay_q32, by_consumer, [=](DeviceCacheOptions& o) {
    o.fill_engine = engine;
    o.speculate_on_copy_engine = speculate_on_copy_engine;
  });
  std::mt19937_64 rng(seed);
  const int actions = 6 + static_cast<int>(rng() % 8);
  bool last_full = true;
  for (int a = 0; a < actions; ++a) {
    const std::size_t s = rng() % 3;
    if (prefetches && rng() % 3 == 0) {
      Ids predicted;
      for (auto n = rng() % 5; n > 0; --n) predicted.push_back(static_cast<std::int32_t>(rng() % 12));
      f.prefetch(s, predicted, static_cast<std::int32_t>(rng() % 4), 1 + static_cast<std::uint32_t>(rng() % 2));
    } else if (rng() % 5 == 0) {
      f.invalidate(s, static_cast<std::int32_t>(rng() % 12));
    } else {
      const std::int32_t n = 1 + static_cast<std::int32_t>(rng() % 12);
      const Ids ids = random_ids(rng, n, 12, rng() % 4 == 0);
      const auto needed = std::max<std::int32_t>(1, static_cast<std::int32_t>(groups_of(ids, 12, 4).size()));
      const std::int32_t rounds = rng() % 2 == 0 ? f.dev->max_groups(n) : needed;
      (void)f.step(s, ids, rounds);
      last_full = rounds == needed;
    }
    f.rt.run_random(rng(), rng() % 10);
  }
  f.settle();
  if (check_races) {
    f.check_clean();
    f.check_equal(last_full);
  }
  return f.rt.race_count();
}
}  // namespace

TEST_CASE("expert-major storage through the copy proxy (every fill, or the speculation only): no race over seeded "
          "schedules; state equal to the host reference") {
  // One region per fill: the proxy's copy of a fill is a single copy (the fewest calls per fill).
  std::uint64_t races = 0, runs = 0;
  for (std::uint64_t seed = 1; seed <= 150; ++seed) {
    races += run_schedule<OrderingEdges, ExpertMajorStorage, HostRefExpertMajor>(seed, true, seed % 2 == 0, true, false,
                                                                                 FillEngine::copy_engine);
    races += run_schedule<OrderingEdges, ExpertMajorStorage, HostRefExpertMajor>(seed, true, true, true, false,
                                                                                 FillEngine::sm_loads, true);
    runs += 2;
  }
  MESSAGE("expert-major proxy schedules checked: " << runs);
  CHECK(races == 0);
}

TEST_CASE("device cache ordering: no race over many seeded random schedules") {
  std::uint64_t races = 0, runs = 0;
  for (std::uint64_t seed = 1; seed <= 3000; ++seed) {
    races += run_schedule<OrderingEdges>(seed, true);
    ++runs;
  }
  MESSAGE("device-cache schedules checked: " << runs);
  CHECK(races == 0);
}

namespace {
// The edges the device path does NOT use (inline mode: no cross-stream ready wait; every call
// writes, so no read-only adoption; no host map uploads): all off, still silent.
struct UnusedEdgesOff : OrderingEdges {
  static constexpr bool ready_wait = false;               // 3
  static constexpr bool all_hit_ready_wait = false;       // 4
  static constexpr bool owner_change_release = false;     // 5
  static constexpr bool resident_map_serialised = false;  // 7
  static constexpr bool staging_guard = false;            // 8
};
}  // namespace

TEST_CASE("device cache ordering: edges 3, 4, 5, 7, 8 are not relied upon (all off, still silent)") {
  std::uint64_t races = 0;
  for (std::uint64_t seed = 1; seed <= 500; ++seed) races += run_schedule<UnusedEdgesOff>(seed, true);
  CHECK(races == 0);
  // The same schedules do exercise the edges the path needs: without edge 1 they race.
  std::uint64_t racy = 0;
  for (std::uint64_t seed = 1; seed <= 200; ++seed) racy += run_schedule<NoReleaseWait>(seed, false) > 0 ? 1 : 0;
  MESSAGE("schedules that race without edge 1: " << racy << " of 200");
  CHECK(racy > 20);
}

namespace {
// Both halves of a negative test: the schedule `run` races with the edge of `Removed` off, and is
// silent, with the state equal to the host reference, with every edge on. Returns the latter
// fixture for the test's own checks.
template <class Removed, class Run>
std::unique_ptr<Fixture<>> races_only_without(Run run) {
  Fixture<Removed> f(12, 4);
  run(f);
  REQUIRE(f.rt.race_count() > 0);
  MESSAGE(f.rt.races()[0].description);
  auto g = std::make_unique<Fixture<>>(12, 4);
  run(*g);
  g->check_clean();
  g->check_equal(true);
  return g;
}
}  // namespace

TEST_CASE("negative (edge 1): without the owner release, an owner change races the previous owner's consumer") {
  auto g = races_only_without<NoReleaseWait>([](auto& f) {
    (void)f.step(0, {0, 1, 2, 3});
    (void)f.step(1, {4, 5, 6, 7});  // owner A -> B: B's plan + fill overwrite what A's consumer reads
    f.settle();
  });
  CHECK(g->dev->ordering_counters().owner_changes == 1);
}

TEST_CASE("negative (edge 2): without the last-writer release, an invalidate from a third stream races the next plan") {
  auto run = [](auto& f) {
    (void)f.step(0, {0, 1, 2});
    f.rt.drain();
    f.invalidate(2, 1);             // last_fill = stream 2, owner stays stream 0
    (void)f.step(1, {1, 2, 3, 4});  // B waits for the owner (edge 1) and for stream 2 (edge 2)
    f.settle();
  };
  (void)races_only_without<NoLastFillRelease>(run);
}

TEST_CASE("negative (edge 6): without invalidate ordering, a device invalidate races the owner's consumer") {
  auto run = [](auto& f) {
    (void)f.step(0, {0, 1, 2});
    f.invalidate(1, 1);  // stream 1 rewrites the maps the consumer on stream 0 may still read
    f.settle();
  };
  (void)races_only_without<NoInvalidateOrder>(run);
}

TEST_CASE("device cache: bad ids and overflow are counted and flagged in the error word") {
  Fixture<> f(12, 4);
  (void)f.step(0, {INT32_MIN, 3, -7, 12, -1, 3, INT32_MAX});
  f.settle();
  const DevicePlanStats d = f.dev->device_stats();
  CHECK(d.bad_ids == 4);
  CHECK(d.misses == 1);
  CHECK(f.dev->take_errors() == plan_error_bad_id);
  CHECK(f.dev->take_errors() == 0u);  // read and cleared
  f.check_equal(true);
  const std::int32_t* san = f.dev->sanitized_ids_device();
  CHECK(Ids(san, san + 7) == Ids{-1, 3, -1, -1, -1, 3, -1});

  (void)f.step(1, {0, 1, 2, 4, 5, 6, 7, 8, 9, 10}, f.dev->max_groups(10));  // 10 unique, C = 4: 3 groups
  f.settle();
  CHECK(f.dev->device_stats().overflows == 1);
  CHECK(f.dev->device_stats().overflow_groups == 2);
  CHECK(f.dev->take_errors() == plan_error_overflow);
  CHECK(f.dev->max_groups(10) == 3);
  f.check_equal(true);
  f.check_clean();
  CHECK(f.dev->stats().resident == 4);
}

TEST_CASE("device cache: take_errors while a plan is pending and unordered with the host is reported") {
  Fixture<> f(12, 4);
  (void)f.step(0, {1, 2});
  (void)f.dev->take_errors();  // nothing ran yet: the host read races the pending plan's write
  f.rt.drain();
  REQUIRE(f.rt.race_count() > 0);
  CHECK(f.rt.races()[0].description.find("host") != std::string::npos);
}

TEST_CASE("device cache: rejected calls leave the cache unchanged and enqueue nothing") {
  Fixture<> f(12, 4);
  (void)f.step(0, {1, 2, 3});
  f.settle();
  const DevicePlanStats before = f.dev->device_stats();
  const CacheStats cs = f.dev->stats();
  const std::size_t pending = f.rt.pending_ops();
  const Ids resident(f.dev->resident_map_device(), f.dev->resident_map_device() + 12);
  const Stream s = f.streams[1];
  CHECK(f.dev->prepare(f.ids_of(1), -1, s).status().code() == ErrorCode::invalid_argument);
  CHECK(f.dev->prepare(f.ids_of(1), Fixture<>::max_ids + 1, s).status().code() == ErrorCode::invalid_argument);
  CHECK(f.dev->prepare(nullptr, 3, s).status().code() == ErrorCode::invalid_argument);
  CHECK(f.dev->prepare(f.ids_of(1), 3, Stream{999}).status().code() == ErrorCode::invalid_argument);
  CHECK(f.dev->prepare_group(0, s).status().code() == ErrorCode::invalid_argument);
  CHECK(f.dev->prepare_group(f.dev->max_groups(Fixture<>::max_ids), s).status().code() == ErrorCode::invalid_argument);
  CHECK(f.dev->prepare_group(1, Stream{999}).status().code() == ErrorCode::invalid_argument);
  CHECK(f.dev->invalidate(-1, s).code() == ErrorCode::expert_out_of_range);
  CHECK(f.dev->invalidate(12, s).code() == ErrorCode::expert_out_of_range);
  CHECK(!f.dev->invalidate(1, Stream{999}).ok());
  CHECK(f.rt.pending_ops() == pending);
  CHECK(f.dev->device_stats() == before);
  const CacheStats after = f.dev->stats();
  CHECK(after.prepare_calls == cs.prepare_calls);
  CHECK(after.generation == cs.generation);
  CHECK(after.faults == 0);
  CHECK(Ids(f.dev->resident_map_device(), f.dev->resident_map_device() + 12) == resident);
  CHECK(f.dev->owner() == f.streams[0]);
  // A zero-id prepare is accepted (an empty forward: the forward map is cleared).
  REQUIRE(f.dev->prepare(nullptr, 0, s).ok());
  f.settle();
  const std::int32_t* fm = f.dev->forward_map_device();
  CHECK(std::all_of(fm, fm + 12, [](std::int32_t x) { return x == -1; }));
  // Construction checks.
  DeviceCacheOptions bad;
  bad.num_experts = 8;
  bad.capacity = 9;
  bad.max_ids = 4;
  CHECK_THROWS_AS(Fixture<>::Dev(f.rt, bad, six_tensor_layout()), Error);
  bad.capacity = 4;
  bad.max_ids = 0;
  CHECK_THROWS_AS(Fixture<>::Dev(f.rt, bad, six_tensor_layout()), Error);
  // DeviceCrf's decay must be below 1.0 and above 0 in Q32.
  bad.max_ids = 4;
  for (const std::uint64_t decay : {std::uint64_t{0}, crf_one, crf_one + 5}) {
    bad.crf_decay_q32 = decay;
    CHECK_THROWS_WITH_AS(Fixture<>::Dev(f.rt, bad, six_tensor_layout()), doctest::Contains("crf_decay_q32"), Error);
  }
  bad.crf_decay_q32 = crf_default_decay_q32;
  bad.max_ids = 0;
  // A first fill part naming a copy region the storage lacks (six regions: bits 0-5).
  bad.max_ids = 4;
  bad.ready_first_regions = 1u << 6;
  try {
    Fixture<>::Dev d(f.rt, bad, six_tensor_layout());
    FAIL("ready_first_regions past the regions accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("ready_first_regions") != std::string::npos);
  }
  bad.ready_first_regions = 0b10101;  // W13's regions: accepted
  CHECK_NOTHROW(Fixture<>::Dev(f.rt, bad, six_tensor_layout()));
}

TEST_CASE("device cache: a fill that could not be enqueued is recovered (its experts dropped, refetched later)") {
  Fixture<> f(12, 4);
  (void)f.step(0, {1, 2});
  f.settle();
  REQUIRE(f.route(0, {1, 5, 6}).ok());
  f.rt.inject_failure(FaultKind::launch, 2);  // 1: the plan, 2: the fill
  CHECK(!f.dev->prepare(f.ids_of(0), 3, f.streams[0]).ok());
  CHECK(f.dev->stats().faults == 1);
  // The next forward first drops 5 and 6 (planned, never filled) and then refetches them.
  REQUIRE(f.route(0, {1, 5, 6}).ok());
  REQUIRE(f.dev->prepare(f.ids_of(0), 3, f.streams[0]).ok());
  REQUIRE(f.read(0, {1, 5, 6}).ok());
  f.settle();
  f.check_clean();
  const DevicePlanStats d = f.dev->device_stats();
  CHECK(d.invalidations == 2);  // 5 and 6
  CHECK(d.misses == 2 + 2 + 2);  // first step, the failed plan, the refetch
  CHECK(f.dev->stats().resident == 4);
}

TEST_CASE("device cache: the view's pointers are fixed for the cache's lifetime") {
  Fixture<> f(12, 4);
  const ForwardView v0 = f.dev->view();
  for (int i = 0; i < 5; ++i) {
    REQUIRE(f.route(0, {i, i + 1}).ok());
    auto v = f.dev->prepare(f.ids_of(0), 2, f.streams[0]);
    REQUIRE(v.ok());
    CHECK(v.value().expert_map == v0.expert_map);
    CHECK(v.value().resident_map == v0.resident_map);
    for (std::size_t t = 0; t < num_expert_tensors; ++t) CHECK(v.value().tensors[t].base == v0.tensors[t].base);
    CHECK(v.value().generation == static_cast<std::uint64_t>(i + 1));
  }
  f.settle();
  CHECK(f.rt.race_count() == 0);
}

TEST_CASE("device cache: caller host tensors and slot workspace (options.memory) are used in place, never copied") {
  constexpr std::int32_t E = 12, C = 4;
  const ExpertTensorBytes tensors = six_tensor_layout().tensors();
  SimRuntime rt, ref_rt;
  CallerHostTensors host(tensors, E);
  const auto before = host.lines;
  const std::size_t ws_bytes = TensorMajorStorage<SimRuntime>::slot_workspace_bytes({E, C}, tensors);
  auto* ws = static_cast<std::byte*>(rt.allocate(ws_bytes, MemoryKind::device).value());
  const std::size_t ws_allocated = rt.allocated_bytes();
  DeviceCacheOptions o;
  o.num_experts = E;
  o.capacity = C;
  o.max_ids = 8;
  using Dev = DeviceExpertCache<TensorMajorStorage, ExplicitLayout, SimRuntime>;
  const Dev ref(ref_rt, o, six_tensor_layout());  // allocates its own pools and slots
  o.memory = host.memory();
  o.memory.slot_workspace = MemorySpan{ws, ws_bytes};
  {
    Dev dev(rt, o, six_tensor_layout());
    CHECK(dev.storage().caller_host());
    CHECK(dev.storage().caller_slots());
    std::size_t own_bytes = 0;  // what ref allocated for pools and slots
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      if (tensors[t].bytes_per_expert == 0) continue;
      CHECK(dev.storage().copy_regions().regions[t].host_base == host.data(t));  // the caller's pointer
      CHECK(dev.storage().host_tensor(t, 7) == host.data(t) + 7 * tensors[t].bytes_per_expert);
      CHECK(rt.is_registered(host.data(t), host.bytes[t]));
      const std::byte* slots = dev.view().tensors[t].base;
      CHECK((slots >= ws && slots + C * tensors[t].bytes_per_expert <= ws + ws_bytes));
      own_bytes += host.bytes[t] + C * tensors[t].bytes_per_expert;
    }
    CHECK(rt.allocated_bytes() - ws_allocated == ref_rt.allocated_bytes() - own_bytes);  // no pool, no slots

    // Plan + fill from the caller's tensors: each resident expert's slot holds its bytes.
    const Stream s = rt.create_stream().value();
    RuntimeBuffer<SimRuntime> ids_buf(rt, 8 * sizeof(std::int32_t), MemoryKind::device);
    auto* dst = reinterpret_cast<std::int32_t*>(ids_buf.data());
    const Ids ids = {3, 9, 3, -1, 11, 0};
    const Access w{dst, ids.size() * sizeof(std::int32_t), AccessMode::write};
    REQUIRE(rt.launch(s, std::span<const Access>(&w, 1), [dst, ids] { std::copy(ids.begin(), ids.end(), dst); }).ok());
    REQUIRE(dev.prepare(dst, static_cast<std::int32_t>(ids.size()), s).ok());
    rt.drain();
    REQUIRE(rt.synchronize(s).ok());
    for (const std::int32_t e : {0, 3, 9, 11}) {
      const std::int32_t slot = dev.view().resident_map[e];
      REQUIRE(slot >= 0);
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        const SlotTensor st = dev.view().tensors[t];
        for (std::size_t i = 0; i < st.bytes; ++i) REQUIRE(st.slot(slot)[i] == pattern_byte(t, e, i));
      }
    }
    CHECK(rt.race_count() == 0);
    rt.destroy_stream(s);
  }
  CHECK(rt.registered_ranges() == 0);             // unregistered with the cache
  CHECK(rt.allocated_bytes() == ws_allocated);    // the workspace is the caller's: not freed
  for (std::size_t t = 0; t < num_expert_tensors; ++t)
    if (host.bytes[t] != 0) CHECK(std::memcmp(before[t].data(), host.lines[t].data(), host.bytes[t]) == 0);  // never written
  REQUIRE(rt.deallocate(ws).ok());
}

// ---- overlap: per-slot readiness (edge D4) ---------------------------------------------------

TEST_CASE("overlap (edge D4): step by step equal to the host-planned Lru cache, ready words at the needed values") {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    Fixture<> f(20, 6, seed, true);
    REQUIRE(f.dev->readiness().enabled());
    std::mt19937_64 rng(seed * 104729);
    bool last_full = true;
    for (int step = 0; step < 40; ++step) {
      const std::size_t s = rng() % 4 == 0 ? rng() % 3 : 0;
      if (rng() % 10 == 0) {
        f.invalidate(rng() % 3, static_cast<std::int32_t>(rng() % 20));
        f.settle();
        f.check_equal(last_full);
        continue;
      }
      const std::int32_t n = 1 + static_cast<std::int32_t>(rng() % 20);
      const Ids ids = random_ids(rng, n, 20, rng() % 8 == 0);
      const std::int32_t needed = std::max<std::int32_t>(1, static_cast<std::int32_t>(groups_of(ids, 20, 6).size()));
      const std::int32_t rounds = rng() % 3 == 0 ? f.dev->max_groups(n) : needed;
      const DevicePlanStats before = f.dev->device_stats();
      const auto expect = f.step(s, ids, rounds);
      f.settle();
      INFO("seed " << seed << " step " << step);
      CHECK(f.dev->device_stats().hits - before.hits == expect.hits);
      CHECK(f.dev->device_stats().misses - before.misses == expect.misses);
      last_full = rounds == needed;
      f.check_equal(last_full);
    }
    f.check_clean();  // includes: every slot a consumer read had reached its needed value
    // The sequence counter advanced once per fill, never reset (replays need no reset).
    CHECK(f.dev->plan_state().scalars->fill_seq == static_cast<std::uint32_t>(f.dev->device_stats().misses));
  }
}

TEST_CASE("overlap (edge D4): no race over many seeded random schedules") {
  std::uint64_t races = 0;
  for (std::uint64_t seed = 1; seed <= 1000; ++seed) races += run_schedule<OrderingEdges>(seed, true, true);
  CHECK(races == 0);
}

TEST_CASE("negative (edge D4): without the consumer's wait on a missing expert's ready word, the race detector fires") {
  auto run = [](Fixture<>& f, bool skip) {
    (void)f.step(0, {0, 1});  // experts 0, 1 -> slots 0, 1
    f.settle();
    // Expert 5 misses: slot 2 (the next free slot); expert 0 hits in slot 0.
    if (skip) f.skip_wait_slot = 2;
    (void)f.step(0, {0, 5});
    f.settle();
    CHECK(f.dev->resident_map_device()[5] == 2);
  };
  Fixture<> f(12, 4, 1, true);
  run(f, true);
  REQUIRE(f.rt.race_count() > 0);
  MESSAGE(f.rt.races()[0].description);
  const std::string d = f.rt.races()[0].description;
  CHECK(d.find("plan_fill_ready (slot 2)") != std::string::npos);
  CHECK(d.find("consumer") != std::string::npos);
  // With the wait: silent, and the consumer saw expert 5's bytes.
  Fixture<> g(12, 4, 1, true);
  run(g, false);
  g.check_clean();
  g.check_equal(true);
}

TEST_CASE("overlap (edge D4): the plan tags the slots, the fill's ready word reaches the tag (wrap-safe)") {
  Fixture<> f(12, 4, 1, true);
  (void)f.step(0, {0, 1});
  f.settle();
  const DevicePlanState& st = f.dev->plan_state();
  CHECK(st.slot_needed[0] == 1u);
  CHECK(st.slot_needed[1] == 2u);
  CHECK(st.slot_ready[0] == 1u);
  CHECK(st.slot_ready[1] == 2u);
  // Router and plan only: expert 5's slot is tagged with the next value, its word is behind.
  REQUIRE(f.route(0, {0, 5}).ok());
  REQUIRE(f.dev->prepare(f.ids_of(0), 2, f.streams[0]).ok());
  REQUIRE(f.rt.step(f.streams[0]));  // the lanes' join of the previous step
  while (st.scalars->fill_seq != 3u) REQUIRE(f.rt.step(f.streams[0]));  // router, plan
  CHECK(st.resident_map[5] == 2);
  CHECK(st.slot_needed[2] == 3u);
  CHECK(!slot_seq_reached(st.slot_ready[2], st.slot_needed[2]));  // a consumer would wait here
  CHECK(slot_seq_reached(st.slot_ready[0], st.slot_needed[0]));   // the hit: no wait
  f.settle();
  CHECK(slot_seq_reached(st.slot_ready[2], st.slot_needed[2]));
  CHECK(st.slot_ready[2] == 3u);
  CHECK(f.rt.race_count() == 0);
  // Wrap-safe comparison of uint32 sequence values.
  CHECK(slot_seq_reached(5u, 5u));
  CHECK(slot_seq_reached(0x00000002u, 0xFFFFFFFEu));
  CHECK(!slot_seq_reached(0xFFFFFFFEu, 0x00000002u));
  CHECK(!slot_seq_reached(4u, 5u));
  // Without overlap the view is empty (the stream-ordered path).
  Fixture<> plain(12, 4);
  CHECK(!plain.dev->readiness().enabled());
}

// ---- speculative fills planned on the device --------------------------------------

TEST_CASE("device prefetch: step by step equal to the host-planned Lru cache's prefetch") {
  std::uint64_t issued = 0, used = 0, wasted = 0;
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    Fixture<> f(20, 6, seed);
    std::mt19937_64 rng(seed * 104729);
    for (int step = 0; step < 60; ++step) {
      const std::size_t s = rng() % 4 == 0 ? rng() % 3 : 0;
      const Ids ids = random_ids(rng, 1 + static_cast<std::int32_t>(rng() % 6), 20, false);
      (void)f.step(s, ids);
      // The next forward's likely experts from another stream (a side stream of the engine).
      Ids predicted;
      for (auto n = rng() % 6; n > 0; --n) predicted.push_back(static_cast<std::int32_t>(rng() % 20));
      f.prefetch(rng() % 3, predicted, static_cast<std::int32_t>(rng() % 4), 1 + static_cast<std::uint32_t>(rng() % 2));
      f.settle();
      f.check_equal(true);
      if (rng() % 10 == 0) {
        f.invalidate(rng() % 3, static_cast<std::int32_t>(rng() % 20));
        f.settle();
      }
    }
    f.check_clean();
    const CacheStats cs = f.dev->stats(), hs = f.host->stats();
    check_same_prefetch_stats(cs, hs);
    CHECK(cs.resident == hs.resident);
    CHECK(cs.speculative_bytes == hs.speculative_bytes);
    issued += cs.speculative_issued;
    used += cs.speculative_used;
    wasted += cs.speculative_wasted;
  }
  MESSAGE("speculative fills issued " << issued << ", used " << used << ", wasted " << wasted);
  CHECK(issued > 200);
  CHECK(used > 50);
  CHECK(wasted > 50);
}

TEST_CASE("device prefetch with evict_last_forward: a cache of top_k slots looks ahead, step by step equal to the host-planned cache") {
  // Every forward fills all C slots; each prefetch comes from the forward's own stream after its
  // consumer (the promise evict_last_forward states), so the last forward's residents are victims.
  constexpr std::int32_t E = 16, C = 4;
  const auto run = [](bool evict_last_forward) {
    std::uint64_t issued = 0, used = 0;
    for (std::uint64_t seed = 1; seed <= 20; ++seed) {
      Fixture<> f(E, C, seed);
      std::mt19937_64 rng(seed * 7919);
      for (int step = 0; step < 50; ++step) {
        Ids ids;
        while (static_cast<std::int32_t>(ids.size()) < C) {
          const auto e = static_cast<std::int32_t>(rng() % E);
          if (std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
        }
        (void)f.step(0, ids);
        Ids predicted;
        for (auto n = rng() % 6; n > 0; --n) predicted.push_back(static_cast<std::int32_t>(rng() % E));
        f.prefetch(0, predicted, static_cast<std::int32_t>(rng() % 4), 1, evict_last_forward);
        f.settle();
        f.check_equal(true);
      }
      f.check_clean();
      const CacheStats cs = f.dev->stats(), hs = f.host->stats();
      check_same_prefetch_stats(cs, hs);
      issued += cs.speculative_issued;
      used += cs.speculative_used;
    }
    return std::pair{issued, used};
  };
  const auto [issued, used] = run(true);
  MESSAGE("speculative fills issued " << issued << ", used " << used);
  CHECK(issued > 200);
  CHECK(used > 20);
  CHECK(run(false).first == 0);  // without the promise every slot holds the last forward: no victim
}

TEST_CASE("negative (edge 1, evict_last_forward): a side-stream prefetch into the latest forward's slots waits for its consumer") {
  auto run = [](auto& f) {
    (void)f.step(0, {0, 1, 2, 3});     // all four slots, read by stream 0's consumer: the latest forward
    f.prefetch(1, {7, 8}, 2, 1, true);  // the promise: evicts two of them, from stream 1
    f.settle();
  };
  auto g = races_only_without<NoReleaseWait>(run);
  CHECK(g->dev->stats().speculative_issued == 2);
}

TEST_CASE("device prefetch: two prefetches before each forward (two layers of lookahead) equal the host-planned cache") {
  // An engine that prefetches two layers ahead calls prefetch() twice on a layer's cache before
  // its next forward: once two layers before (a first list), once a layer before (a refresh
  // that overlaps it). The second call must skip what the first fetched and never evict its
  // unused fills; both may run on different side streams.
  std::uint64_t issued = 0, used = 0;
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    Fixture<> f(20, 8, seed);
    std::mt19937_64 rng(seed * 7919);
    for (int step = 0; step < 50; ++step) {
      const Ids next = random_ids(rng, 1 + static_cast<std::int32_t>(rng() % 5), 20, false);
      // The first list: some of the next forward's experts and some others.
      Ids first;
      for (const std::int32_t e : next)  // -1 is a forward's padding, not a hint
        if (e >= 0 && rng() % 3 != 0) first.push_back(e);
      for (auto n = rng() % 3; n > 0; --n) first.push_back(static_cast<std::int32_t>(rng() % 20));
      f.prefetch(1 + rng() % 2, first, 1 + static_cast<std::int32_t>(rng() % 4), 1);
      // The refresh: most of the next forward's experts, the first list's among them.
      Ids refresh;
      for (const std::int32_t e : next)
        if (e >= 0 && rng() % 5 != 0) refresh.push_back(e);
      f.prefetch(1 + rng() % 2, refresh, 1 + static_cast<std::int32_t>(rng() % 4), 1);
      f.settle();
      f.check_equal(true);
      (void)f.step(0, next);
      f.settle();
      f.check_equal(true);
    }
    f.check_clean();
    const CacheStats cs = f.dev->stats(), hs = f.host->stats();
    check_same_prefetch_stats(cs, hs);
    issued += cs.speculative_issued;
    used += cs.speculative_used;
  }
  MESSAGE("two prefetches per forward: speculative fills issued " << issued << ", used " << used);
  CHECK(issued > 300);
  CHECK(used > 200);
}

TEST_CASE("device prefetch from host ids with scores: step by step equal to the host-planned scored prefetch") {
  std::uint64_t issued = 0, unlikely = 0, evictions = 0;
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    Fixture<> f(20, 6, seed);
    std::mt19937_64 rng(seed * 7919);
    for (int step = 0; step < 50; ++step) {
      const std::size_t s = rng() % 4 == 0 ? rng() % 3 : 0;
      (void)f.step(s, random_ids(rng, 1 + static_cast<std::int32_t>(rng() % 6), 20, false));
      Ids predicted;
      std::vector<float> scores;
      for (auto n = rng() % 8; n > 0; --n) {
        predicted.push_back(static_cast<std::int32_t>(rng() % 20));
        scores.push_back(static_cast<float>(rng() % 5) / 4.0f);  // ties are common
      }
      const float min_score = static_cast<float>(rng() % 3) / 4.0f;
      const PrefetchView v = f.prefetch_scored(rng() % 3, predicted, scores, min_score,
                                               static_cast<std::int32_t>(rng() % 4), 1 + static_cast<std::uint32_t>(rng() % 2));
      unlikely += v.skipped_unlikely;
      f.settle();
      f.check_equal(true);
    }
    f.check_clean();
    const CacheStats cs = f.dev->stats(), hs = f.host->stats();
    check_same_prefetch_stats(cs, hs);
    issued += cs.speculative_issued;
    evictions += cs.evictions;
  }
  MESSAGE("scored speculative fills issued " << issued << ", hints skipped as unlikely " << unlikely);
  CHECK(issued > 50);
  CHECK(unlikely > 50);
  CHECK(evictions > 0);
}

TEST_CASE("device prefetch with scores: the selected ids in score order; bad scores and device-id scores refused") {
  Fixture<> f(12, 4);
  (void)f.step(0, {0, 1});
  f.settle();
  // Two free slots, budget 2: of {5: 0.6, 6: 0.95, 7: 0.2, 8: 0.7} the device fills 6 and 8.
  const PrefetchView v = f.prefetch_scored(1, Ids{5, 6, 7, 8}, {0.6f, 0.95f, 0.2f, 0.7f}, 0.5f, 2, 1);
  CHECK(v.skipped_unlikely == 1);
  f.settle();
  f.check_equal(true);
  CHECK(f.dev->resident_map_device()[6] >= 0);
  CHECK(f.dev->resident_map_device()[8] >= 0);
  CHECK(f.dev->resident_map_device()[5] == -1);
  CHECK(f.dev->resident_map_device()[7] == -1);
  CHECK(f.dev->stats().speculative_issued == 2);
  // Every hint below min_score: accepted, nothing enqueued.
  const SimCounters calls = f.rt.counters();
  const PrefetchView none = f.prefetch_scored(1, Ids{9, 10}, {0.1f, 0.4f}, 0.5f, 2, 1);
  CHECK(none.skipped_unlikely == 2);
  CHECK(f.rt.counters() == calls);

  const CacheStats before = f.dev->stats();
  const DevicePlanStats dev_before = f.dev->device_stats();
  const Ids resident(f.dev->resident_map_device(), f.dev->resident_map_device() + 12);
  const std::int64_t bytes = static_cast<std::int64_t>(total_bytes_per_expert(six_tensor_layout().tensors()));
  const Ids host_ids{9, 10};
  auto call = [&](std::vector<float> scores, float min_score) {
    return f.dev->prefetch(std::span<const std::int32_t>(host_ids), f.streams[0],
                           PrefetchOptions{2 * bytes, 1, scores, min_score});
  };
  auto r = call({0.9f}, 0.5f);
  CHECK(r.status().code() == ErrorCode::invalid_argument);
  CHECK(std::string(r.status().message()).find("1 scores for 2 predicted ids") != std::string::npos);
  r = call({0.9f, std::numeric_limits<float>::quiet_NaN()}, 0.5f);
  CHECK(r.status().code() == ErrorCode::invalid_argument);
  CHECK(std::string(r.status().message()).find("score nan at index 1 (expert 10)") != std::string::npos);
  CHECK(call({0.9f, 2.0f}, 0.5f).status().code() == ErrorCode::invalid_argument);
  r = call({0.9f, 0.9f}, 1.5f);
  CHECK(r.status().code() == ErrorCode::invalid_argument);
  CHECK(std::string(r.status().message()).find("min_score 1.5 is not in [0, 1]") != std::string::npos);
  CHECK(call({}, std::numeric_limits<float>::quiet_NaN()).status().code() == ErrorCode::invalid_argument);
  // An id out of range is refused even with a score that would skip it.
  const Ids bad{9, 12};
  const std::vector<float> bad_scores{0.9f, 0.1f};
  CHECK(f.dev->prefetch(std::span<const std::int32_t>(bad), f.streams[0], PrefetchOptions{2 * bytes, 1, bad_scores})
            .status()
            .code() == ErrorCode::expert_out_of_range);
  // Device ids take no scores: not_supported, nothing enqueued.
  std::int32_t* ids = f.prefetch_ids_of(0);
  const std::vector<float> two{0.9f, 0.9f};
  r = f.dev->prefetch(ids, 2, f.streams[0], PrefetchOptions{2 * bytes, 1, two});
  CHECK(r.status().code() == ErrorCode::not_supported);
  CHECK(std::string(r.status().message()).find("device ids takes no scores") != std::string::npos);
  CHECK(f.dev->prefetch(ids, 2, f.streams[0], PrefetchOptions{2 * bytes, 1, {}, -0.5f}).status().code() ==
        ErrorCode::invalid_argument);
  CHECK(f.rt.counters() == calls);
  CHECK(f.dev->device_stats() == dev_before);
  CHECK(Ids(f.dev->resident_map_device(), f.dev->resident_map_device() + 12) == resident);
  CHECK(f.dev->stats().generation == before.generation);
  CHECK(f.dev->stats().speculative_issued == before.speculative_issued);
  f.check_clean();
}

// A consumer of one group that reads only that group's slots (`slots`: where the host reference
// put each expert of `group`), so a write to any other slot while it runs is not a race, and a
// write to one of these is.
Status read_group_slots(Fixture<>& f, std::size_t s, const Ids& group, const Ids& slots) {
  const ForwardView v = f.dev->view();
  std::vector<Access> acc;
  const std::size_t map = static_cast<std::size_t>(f.experts) * sizeof(std::int32_t);
  acc.push_back({v.expert_map, map, AccessMode::read});
  for (const SlotTensor& t : v.tensors) {
    if (t.bytes == 0) continue;
    for (const std::int32_t slot : slots) acc.push_back({t.slot(slot), t.bytes, AccessMode::read});
  }
  ++f.readers;
  f.rt.set_next_label("group consumer");
  return f.rt.launch(f.streams[s], acc, [v, group, slots, log = f.log, E = f.experts] {
    ++log->runs;
    std::int32_t named = 0;
    for (std::int32_t e = 0; e < E; ++e) named += v.expert_map[e] >= 0 ? 1 : 0;
    bool ok = named == static_cast<std::int32_t>(group.size());
    for (std::size_t k = 0; ok && k < group.size(); ++k) {
      const std::int32_t e = group[k], slot = slots[k];
      ok = v.expert_map[e] == slot && slot_holds(v, slot, e);
    }
    if (!ok && log->mismatches++ == 0) log->first = "a group's map or bytes differ";
  });
}

TEST_CASE("device cache: narrow rounds with the next group prefetched on a side stream") {
  // Groups of capacity / 2 (round_width); after group g's consumer is enqueued on X, a prefetch
  // on P fills group g + 1's missing experts, then prepare_group(g + 1) on X (ordered after the
  // prefetch by edge 2) finds them resident. The simulator models a prefetch's fill as writing
  // every slot, so here the prefetch is ordered after the consumer (edge 1); that it never
  // writes the slots of the group planned last, which lets an engine enqueue it before that
  // group's consumer, is the planner's property (tests/host/test_device_plan.cpp).
  constexpr std::int32_t E = 40, C = 8, W = C / 2;
  std::uint64_t overlapped = 0;
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    CAPTURE(seed);
    Fixture<> f(E, C, seed);
    std::mt19937_64 rng(seed * 7919);
    for (int step = 0; step < 6; ++step) (void)f.step(0, random_ids(rng, 4, E, false));  // decode residents
    f.settle();
    const std::size_t X = 0, P = 1;
    Ids ids = random_ids(rng, Fixture<>::max_ids, E, seed % 3 == 0);
    // The reference order: residents at the forward's start first, groups of W.
    const auto groups = host_groups_residents_first(ids, f.host->resident_map_host(), W);
    REQUIRE(f.route(X, ids).ok());
    const auto n = static_cast<std::int32_t>(ids.size());
    const std::uint64_t used0 = f.dev->stats().speculative_used, misses0 = f.dev->stats().misses;
    std::uint64_t missing = 0;  // experts of the forward not resident at its start
    for (const Ids& g : groups)
      for (const std::int32_t e : g) missing += f.host->resident_map_host()[static_cast<std::size_t>(e)] < 0 ? 1 : 0;
    const std::int32_t rounds = f.dev->max_groups(n, W);
    for (std::int32_t g = 0; g < rounds; ++g) {
      auto v = g == 0 ? f.dev->prepare(f.ids_of(X), n, f.streams[X], DeviceForward::in_rounds, W)
                      : f.dev->prepare_group(g, f.streams[X]);
      REQUIRE_MESSAGE(v.ok(), std::string(v.status().message()));
      const auto gi = static_cast<std::size_t>(g);
      const Ids group = gi < groups.size() ? groups[gi] : Ids{};
      if (gi < groups.size()) REQUIRE(f.host->prepare_unique(group, f.host_stream).ok());
      Ids slots;
      for (const std::int32_t e : group) slots.push_back(f.host->forward_map_host()[static_cast<std::size_t>(e)]);
      REQUIRE(read_group_slots(f, X, group, slots).ok());
      if (gi + 1 < groups.size()) {  // the next group, from P
        f.prefetch(P, groups[gi + 1], W, 1);
        ++overlapped;
      }
      f.host_rt.drain();
    }
    f.settle();
    f.check_clean();
    f.check_equal(static_cast<std::size_t>(rounds) == groups.size());  // else the last rounds were empty
    // Group 0's misses were filled by the forward, every later group's by the prefetches: each
    // missing expert exactly once.
    const CacheStats cs = f.dev->stats();
    CHECK((cs.misses - misses0) + (cs.speculative_used - used0) == missing);
    CHECK(cs.speculative_used == f.host->stats().speculative_used);
  }
  CHECK(overlapped > 100);
}

TEST_CASE("device cache: round_width is checked, and max_groups / prepare_group follow it") {
  Fixture<> f(20, 8);
  REQUIRE(f.route(0, Ids{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}).ok());
  const SimCounters before = f.rt.counters();
  for (const std::int32_t w : {-1, 9}) {
    auto v = f.dev->prepare(f.ids_of(0), 10, f.streams[0], DeviceForward::in_rounds, w);
    CHECK(v.status().code() == ErrorCode::invalid_argument);
  }
  auto single = f.dev->prepare(f.ids_of(0), 10, f.streams[0], DeviceForward::single, 4);
  CHECK(single.status().code() == ErrorCode::invalid_argument);
  CHECK(f.rt.counters() == before);  // nothing enqueued
  CHECK(f.dev->max_groups(10) == 2);
  CHECK(f.dev->max_groups(10, 4) == 3);
  CHECK(f.dev->max_groups(10, 3) == 4);
  REQUIRE(f.dev->prepare(f.ids_of(0), 10, f.streams[0], DeviceForward::in_rounds, 3).ok());
  CHECK(f.dev->prepare_group(3, f.streams[0]).ok());  // groups 0..3 of width 3
  // A graph provisions max_groups(max_ids = 24, 3) = 7 rounds (20 experts): 4..6 are empty, 7 is refused.
  CHECK(f.dev->prepare_group(6, f.streams[0]).ok());
  CHECK(f.dev->prepare_group(7, f.streams[0]).status().code() == ErrorCode::invalid_argument);
  f.settle();
  CHECK(f.dev->plan_state().scalars->group_width == 3);
  CHECK(f.dev->device_stats().overflows == 1);  // 10 unique experts, 8 slots
  // A plain prepare afterwards: groups of the capacity again.
  REQUIRE(f.dev->prepare(f.ids_of(0), 10, f.streams[0]).ok());
  CHECK(f.dev->prepare_group(2, f.streams[0]).ok());  // max_groups(24) = 3 at width 8
  CHECK(f.dev->prepare_group(3, f.streams[0]).status().code() == ErrorCode::invalid_argument);
  f.settle();
  CHECK(f.dev->plan_state().scalars->group_count == 2);
  CHECK(f.dev->plan_state().scalars->group_width == 8);
  CHECK(f.dev->take_errors() == plan_error_overflow);
}

TEST_CASE("device prefetch ordering: no race over many seeded random schedules (also with overlap)") {
  std::uint64_t races = 0;
  for (std::uint64_t seed = 1; seed <= 1500; ++seed) races += run_schedule<OrderingEdges>(seed, true, seed % 2 == 0, true);
  CHECK(races == 0);
  // The same schedules need edge 2 for the prefetches: without it they race.
  std::uint64_t racy = 0;
  for (std::uint64_t seed = 1; seed <= 200; ++seed) racy += run_schedule<NoLastFillRelease>(seed, false, false, true) > 0 ? 1 : 0;
  MESSAGE("schedules with prefetches that race without edge 2: " << racy << " of 200");
  CHECK(racy > 10);
}

TEST_CASE("negative (edge 2, prefetch): without the last-writer release, a forward races the side stream's prefetch") {
  auto run = [](auto& f) {
    (void)f.step(0, {0, 1, 2});
    (void)f.step(0, {0});            // 1 and 2 no longer protected
    f.prefetch(1, {5, 6}, 2, 1);     // side stream: plan + fill of 5 (free slot) and 6 (evicts 1)
    (void)f.step(0, {5, 6, 0});      // uses them: ordered after stream 1 by edge 2 only
    f.settle();
  };
  auto g = races_only_without<NoLastFillRelease>(run);
  CHECK(g->dev->stats().speculative_used == 2);
}

TEST_CASE("negative (edge 1, prefetch): without the owner release, a side-stream prefetch races the owner's consumer") {
  auto run = [](auto& f) {
    (void)f.step(0, {0, 1, 2, 3});   // all four slots, read by stream 0's consumer
    (void)f.step(0, {0, 1});         // 2 and 3 no longer protected
    f.prefetch(1, {7, 8}, 2, 1);     // evicts 2 and 3 while stream 0's consumers may still read every slot
    f.settle();
  };
  auto g = races_only_without<NoReleaseWait>(run);
  CHECK(g->dev->stats().speculative_issued == 2);
}

TEST_CASE("device prefetch: rejected calls leave the cache unchanged and enqueue nothing; host ids as device ids") {
  Fixture<> f(12, 4);
  (void)f.step(0, {0, 1, 2});
  f.settle();
  const CacheStats before = f.dev->stats();
  const SimCounters calls = f.rt.counters();
  const DevicePlanStats dev_before = f.dev->device_stats();
  const Ids resident(f.dev->resident_map_device(), f.dev->resident_map_device() + 12);
  std::int32_t* ids = f.prefetch_ids_of(0);
  const std::int64_t bytes = static_cast<std::int64_t>(total_bytes_per_expert(six_tensor_layout().tensors()));
  auto code = [](const Result<PrefetchView>& r) { return r.ok() ? ErrorCode::ok : r.status().code(); };
  CHECK(code(f.dev->prefetch(ids, -1, f.streams[0], {bytes, 1})) == ErrorCode::invalid_argument);
  CHECK(code(f.dev->prefetch(ids, 13, f.streams[0], {bytes, 1})) == ErrorCode::too_many_experts);
  CHECK(code(f.dev->prefetch(nullptr, 2, f.streams[0], {bytes, 1})) == ErrorCode::invalid_argument);
  CHECK(code(f.dev->prefetch(ids, 2, f.streams[0], {-1, 1})) == ErrorCode::invalid_argument);
  CHECK(code(f.dev->prefetch(ids, 2, f.streams[0], {bytes, 0})) == ErrorCode::invalid_argument);
  CHECK(!f.dev->prefetch(ids, 2, Stream{999}, {bytes, 1}).ok());
  const Ids bad_host = {3, 12};
  auto r = f.dev->prefetch(std::span<const std::int32_t>(bad_host), f.streams[0], {bytes, 1});
  CHECK(code(r) == ErrorCode::expert_out_of_range);
  CHECK(std::string(r.status().message()).find("12") != std::string::npos);
  const Ids pad_host = {-1};
  CHECK(code(f.dev->prefetch(std::span<const std::int32_t>(pad_host), f.streams[0], {bytes, 1})) ==
        ErrorCode::expert_out_of_range);
  const Ids too_many(13, 0);
  CHECK(code(f.dev->prefetch(std::span<const std::int32_t>(too_many), f.streams[0], {bytes, 1})) ==
        ErrorCode::too_many_experts);
  // A zero budget or an empty list is accepted and enqueues nothing.
  CHECK(f.dev->prefetch(ids, 2, f.streams[0], {bytes - 1, 1}).ok());
  CHECK(f.dev->prefetch(ids, 0, f.streams[0], {bytes, 1}).ok());
  CHECK(f.rt.counters() == calls);
  CHECK(f.dev->device_stats() == dev_before);
  CHECK(Ids(f.dev->resident_map_device(), f.dev->resident_map_device() + 12) == resident);
  const CacheStats after = f.dev->stats();
  CHECK(after.generation == before.generation);
  CHECK(after.speculative_issued == 0);
  CHECK(after.resident == before.resident);
  // Host ids: uploaded and planned like device ids (padding and bad ids are device-only inputs).
  const Ids predicted = {4, 0, 5};
  REQUIRE(f.dev->prefetch(std::span<const std::int32_t>(predicted), f.streams[1], {2 * bytes, 1}).ok());
  f.settle();
  // 4 takes the free slot, 0 is resident, 5 finds no victim (1 and 2 are the last forward's).
  CHECK(f.dev->stats().speculative_issued == 1);
  CHECK(f.dev->resident_map_device()[4] >= 0);
  CHECK(f.dev->resident_map_device()[5] == -1);
  CHECK(f.dev->plan_state().scalars->prefetch_skipped_resident == 1);
  CHECK(f.dev->plan_state().scalars->prefetch_skipped_no_victim == 1);
  CHECK(f.dev->device_stats().bad_ids == 0);
  f.check_clean();
}

namespace {
using HostCrfRef = ExpertCache<TensorMajorStorage, Crf, Inline, ExplicitLayout, SimRuntime>;
template <class Edges = OrderingEdges>
using CrfFixture = Fixture<Edges, TensorMajorStorage, HostCrfRef, DeviceCrf>;

std::vector<std::uint64_t> bias_table(const DevicePlanState& s) {
  return std::vector<std::uint64_t>(s.expert_bias.data, s.expert_bias.data + s.num_experts);
}

// `steps` forwards of 3 of the fixture's 16 experts (`draw` picks one), alternating streams: the
// device cache's resident map must equal `want`'s (a host Crf planner) after every forward.
// Returns the forwards after which the fixture's own host reference (a default Crf) differed.
template <class Draw>
std::uint64_t crf_steps_equal(CrfFixture<>& f, ForwardPlanner<Crf>& want, int steps, std::mt19937_64& rng, Draw draw) {
  ForwardPlan plan;
  std::uint64_t differs_from_reference = 0;
  for (int step = 0; step < steps; ++step) {
    std::set<std::int32_t> row;
    while (row.size() < 3) row.insert(draw(rng));
    const Ids ids(row.begin(), row.end());
    (void)f.step(step % 3 == 0 ? 2 : 0, ids);
    f.settle();
    REQUIRE(want.plan_topk(ids, plan));
    const std::int32_t* dr = f.dev->resident_map_device();
    REQUIRE(Ids(dr, dr + 16) == Ids(want.resident_map().begin(), want.resident_map().end()));
    const auto hr = f.host->resident_map_host();
    if (!std::equal(hr.begin(), hr.end(), dr)) ++differs_from_reference;
  }
  return differs_from_reference;
}
}  // namespace

TEST_CASE("set_prior: DeviceCrf plans with the uploaded prior exactly as Crf with the same bias") {
  CrfFixture<> f(16, 5, 7);
  // CRF units: a pin, weights of a few requests, fractions, zero.
  std::vector<double> prior(16, 0.0);
  prior[3] = 1e12;  // >= 2^30: pinned
  prior[7] = 2.5;
  prior[9] = 0.75;
  prior[12] = 4.0;
  REQUIRE(f.dev->set_prior(prior, f.streams[1]).ok());
  f.settle();
  std::vector<std::uint64_t> q32(16, 0);
  for (std::size_t e = 0; e < 16; ++e) {
    q32[e] = prior[e] >= 1073741824.0 ? crf_pin_bias : static_cast<std::uint64_t>(std::llround(prior[e] * 4294967296.0));
  }
  CHECK(bias_table(f.dev->plan_state()) == q32);
  CHECK(q32[9] == 3221225472u);  // 0.75 in Q32
  f.check_clean();

  // The decisions: a host Crf with the same bias, forward by forward; the fixture's own host
  // reference plans without a prior, and must part from the device somewhere (the prior acts).
  ForwardPlanner<Crf> biased(CacheShape{16, 5}, 3, Crf(CacheShape{16, 5}, CrfParams{}, q32));
  std::mt19937_64 rng(31);
  const std::uint64_t differs_from_unbiased =
      crf_steps_equal(f, biased, 80, rng, [](std::mt19937_64& r) { return static_cast<std::int32_t>(r() % 16); });
  CHECK(f.dev->resident_map_device()[3] >= 0);  // pinned: requested once, never evicted since
  CHECK(differs_from_unbiased > 10);
  f.check_clean();
}

TEST_CASE("DeviceCrf with another half-life plans exactly as Crf with the same decay") {
  for (const double half_life : {2.0, 16.0, 32.0}) {
    CAPTURE(half_life);
    const std::uint64_t decay = crf_decay_for_half_life(half_life);
    REQUIRE(decay != crf_default_decay_q32);
    CrfFixture<> f(16, 5, 11, false, decay);
    f.settle();
    const DevicePlanState& s = f.dev->plan_state();
    CHECK(s.scalars->crf_decay == decay);
    for (std::uint32_t a = 0; a < crf_pow_table_size; a += 37) CHECK(s.crf_pow[static_cast<std::int32_t>(a)] == crf_decay_pow(decay, a));
    // The decisions: a host Crf with the same decay, forward by forward. The fixture's own host
    // reference decays at the default half-life (8) and must part from the device somewhere.
    ForwardPlanner<Crf> same(CacheShape{16, 5}, 3, Crf(CacheShape{16, 5}, CrfParams{decay}));
    std::mt19937_64 rng(47);
    // Skewed draws (half from experts 0..3), so frequency and recency disagree often.
    const std::uint64_t differs_from_default = crf_steps_equal(f, same, 150, rng, [](std::mt19937_64& r) {
      return static_cast<std::int32_t>(r() % 2 == 0 ? r() % 4 : r() % 16);
    });
    CHECK(differs_from_default > 0);
    f.check_clean();
  }
}

TEST_CASE("set_prior: refused tables and policies leave the cache exactly as it was and enqueue nothing") {
  CrfFixture<> f(12, 4);
  const std::vector<double> first(12, 1.5);
  REQUIRE(f.dev->set_prior(first, f.streams[0]).ok());
  (void)f.step(0, {1, 2, 3});
  f.settle();
  const std::vector<std::uint64_t> table = bias_table(f.dev->plan_state());
  const DevicePlanStats dev_before = f.dev->device_stats();
  const CacheStats before = f.dev->stats();
  const auto calls = f.rt.counters();
  const Ids resident(f.dev->resident_map_device(), f.dev->resident_map_device() + 12);
  auto code_of = [&](std::vector<double> bias, Stream s = Stream{}) {
    if (s == Stream{}) s = f.streams[1];
    const Status st = f.dev->set_prior(bias, s);
    return st.ok() ? ErrorCode::ok : st.code();
  };
  std::vector<double> good(12, 0.5);
  CHECK(code_of(std::vector<double>(11, 0.5)) == ErrorCode::invalid_argument);  // length
  CHECK(code_of(std::vector<double>(13, 0.5)) == ErrorCode::invalid_argument);
  CHECK(code_of({}) == ErrorCode::invalid_argument);
  for (const double badv : {-1.0, -1e-300, std::nan(""), std::numeric_limits<double>::infinity()}) {
    std::vector<double> b = good;
    b[11] = badv;  // the last entry: the whole table is checked before anything is written
    CHECK(code_of(b) == ErrorCode::invalid_argument);
  }
  const Status named = f.dev->set_prior(std::vector<double>{0, 0, 0, 0, 0, -2.0, 0, 0, 0, 0, 0, 0}, f.streams[1]);
  CHECK(std::string(named.message()).find("expert 5") != std::string::npos);
  CHECK(code_of(good, Stream{999}) != ErrorCode::ok);  // a stream the runtime refuses
  CHECK(f.dev->set_prior_q32(std::vector<std::uint64_t>(11, 0), f.streams[1]).code() == ErrorCode::invalid_argument);
  CHECK(f.rt.counters() == calls);
  CHECK(bias_table(f.dev->plan_state()) == table);
  CHECK(f.dev->device_stats() == dev_before);
  CHECK(f.dev->stats().generation == before.generation);
  CHECK(f.dev->stats().faults == 0);
  CHECK(Ids(f.dev->resident_map_device(), f.dev->resident_map_device() + 12) == resident);
  // The accepted halves: -0.0 is a zero bias; the Q32 form takes PopularityTable's tables as they are.
  good[0] = -0.0;
  REQUIRE(f.dev->set_prior(good, f.streams[1]).ok());
  f.settle();
  CHECK(bias_table(f.dev->plan_state()) == std::vector<std::uint64_t>{0, crf_one / 2, crf_one / 2, crf_one / 2, crf_one / 2,
                                                                      crf_one / 2, crf_one / 2, crf_one / 2, crf_one / 2,
                                                                      crf_one / 2, crf_one / 2, crf_one / 2});
  std::vector<std::uint64_t> pins(12, 0);
  pins[4] = crf_pin_bias;
  REQUIRE(f.dev->set_prior_q32(pins, f.streams[2]).ok());
  f.settle();
  CHECK(bias_table(f.dev->plan_state()) == pins);
  f.check_clean();

  // A policy that ranks without a prior refuses it (nothing enqueued, nothing written).
  Fixture<> lru(12, 4);
  const auto lru_calls = lru.rt.counters();
  const Status st = lru.dev->set_prior(good, lru.streams[0]);
  CHECK(st.code() == ErrorCode::not_supported);
  CHECK(std::string(st.message()).find("lru") != std::string::npos);
  CHECK(lru.rt.counters() == lru_calls);
  CHECK(bias_table(lru.dev->plan_state()) == std::vector<std::uint64_t>(12, 0));
}

// `run` on a 12-expert, 4-slot DeviceCrf cache whose ordering lacks the edge `Edges` removes:
// the race detector must fire.
template <class Edges, class Run>
void require_race_without(Run run) {
  CrfFixture<Edges> without(12, 4);
  run(without);
  REQUIRE(without.rt.race_count() > 0);
  MESSAGE(without.rt.races()[0].description);
}

// The upload is a write of the plan state that plans read: ordered after the plans already
// enqueued on other streams (edge 6, as invalidate) and before the next plan on any stream (edge 2).
TEST_CASE("negative (edge 6, set_prior): without invalidate ordering, the upload races the owner's pending plan") {
  auto run = [](auto& f) {
    (void)f.step(0, {0, 1, 2});
    REQUIRE(f.dev->set_prior(std::vector<double>(12, 1.0), f.streams[1]).ok());  // rewrites what stream 0's plan reads
    f.settle();
  };
  require_race_without<NoInvalidateOrder>(run);
  CrfFixture<> with(12, 4);
  run(with);
  with.check_clean();
  CHECK(bias_table(with.dev->plan_state()) == std::vector<std::uint64_t>(12, crf_one));
}

TEST_CASE("negative (edge 2, set_prior): without the last-writer release, the next plan races the upload") {
  auto run = [](auto& f) {
    (void)f.step(0, {0, 1, 2});
    f.rt.drain();
    REQUIRE(f.dev->set_prior(std::vector<double>(12, 2.0), f.streams[2]).ok());  // last writer: stream 2
    (void)f.step(1, {1, 2, 3, 4});  // stream 1's plan reads the bias: it must wait for stream 2
    f.settle();
  };
  require_race_without<NoLastFillRelease>(run);
  CrfFixture<> with(12, 4);
  run(with);
  with.check_clean();
  with.check_equal(true);  // uniform bias: the same decisions as the host Crf without one
}

// ---- fill_by_consumer: the consumer copies the misses from host -----------------------------

namespace {
// The experts flagged in the plan state's missing flags (the host reads the simulated device memory).
template <class F>
Ids flagged_missing(const F& f) {
  Ids out;
  const DevicePlanState& st = f.dev->plan_state();
  for (std::int32_t e = 0; e < f.experts; ++e)
    if (st.missing[e] != 0) out.push_back(e);
  return out;
}
// The experts of the last group's fill list, ascending.
template <class F>
Ids fill_list_experts(const F& f) {
  const DevicePlanState& st = f.dev->plan_state();
  Ids out;
  for (std::int32_t i = 0; i < st.scalars->fill_count; ++i) out.push_back(st.fills[i].expert);
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

// Steps (overflow rounds, bad ids, owner changes), prefetches from a side stream and invalidates
// through a fill_by_consumer cache, against the host-planned cache of the same policy and storage.
template <class F>
void fill_by_consumer_run(std::uint64_t seeds) {
  std::uint64_t groups_checked = 0, unfilled_seen = 0, prefetches = 0;
  for (std::uint64_t seed = 1; seed <= seeds; ++seed) {
    CAPTURE(seed);
    F f(12, 4, seed, false, crf_default_decay_q32, true);
    REQUIRE(f.dev->view().missing == f.dev->plan_state().missing.data);
    std::mt19937_64 rng(seed * 104729);
    const std::uint64_t misses0 = f.dev->stats().misses;
    for (int step = 0; step < 14; ++step) {
      if (rng() % 5 == 0) {  // a prefetch from a side stream: real fills, the flags stay the last group's
        f.settle();
        const Ids before = flagged_missing(f);
        f.prefetch(2, Ids{static_cast<std::int32_t>(rng() % 12), static_cast<std::int32_t>(rng() % 12)}, 2, 1);
        f.settle();
        CHECK(flagged_missing(f) == before);
        ++prefetches;
        continue;
      }
      if (rng() % 7 == 0) {
        f.invalidate(step % 2, static_cast<std::int32_t>(rng() % 12));
        continue;
      }
      const Ids ids = random_ids(rng, 1 + static_cast<std::int32_t>(rng() % F::max_ids), 12, rng() % 4 == 0);
      const DevicePlanStats before = f.dev->device_stats();
      const SimCounters c0 = f.rt.counters();
      const auto expect = f.step(step % 2, ids);  // owner changes between streams 0 and 1
      f.settle();
      CHECK(f.dev->device_stats().hits - before.hits == expect.hits);
      CHECK(f.dev->device_stats().misses - before.misses == expect.misses);
      // No fill op: per group one router or plan launch and the consumer's two (copies, reads).
      const auto groups = static_cast<std::uint64_t>(std::max<std::size_t>(1, groups_of(ids, 12, 4).size()));
      CHECK(f.rt.counters().launches - c0.launches == 1 + groups * 3);
      // The flags name exactly the last group's misses (its fill list), each in the forward map.
      const Ids flagged = flagged_missing(f);
      CHECK(flagged == fill_list_experts(f));
      for (const std::int32_t e : flagged) CHECK(f.dev->forward_map_device()[e] >= 0);
      f.check_equal(true);
      ++groups_checked;
    }
    f.check_clean();
    // Every miss was copied once, by the consumer; prefetched experts are not flagged.
    CHECK(f.log->consumer_copies == f.dev->stats().misses - misses0);
    unfilled_seen += f.log->unfilled_seen;
  }
  CHECK(groups_checked > 6 * seeds);
  CHECK(prefetches > seeds);
  CHECK(unfilled_seen > 3 * seeds);  // the slots did not hold the misses before the consumer copied them
}

TEST_CASE("fill_by_consumer: step by step equal to the host-planned Lru cache; the consumer copies exactly the misses") {
  fill_by_consumer_run<Fixture<>>(30);
}

TEST_CASE("fill_by_consumer: expert-major storage, DeviceLfru and DeviceCrf equal their host-planned caches") {
  using HostLfru = ExpertCache<TensorMajorStorage, Lfru, Inline, ExplicitLayout, SimRuntime>;
  fill_by_consumer_run<Fixture<OrderingEdges, ExpertMajorStorage, HostRefExpertMajor>>(12);
  fill_by_consumer_run<Fixture<OrderingEdges, TensorMajorStorage, HostLfru, DeviceLfru>>(12);
  fill_by_consumer_run<Fixture<OrderingEdges, TensorMajorStorage, HostCrfRef, DeviceCrf>>(12);
}

TEST_CASE("fill_by_consumer: no race over many seeded random schedules; without edge 1 the consumer's copies race") {
  std::uint64_t races = 0;
  for (std::uint64_t seed = 1; seed <= 1000; ++seed) races += run_schedule<OrderingEdges>(seed, true, false, seed % 2 == 0, true);
  CHECK(races == 0);
  // The consumer writes slots: the next call from another stream (a plan that evicts, a
  // prefetch's fill, the next consumer's copies) must wait for it (edge 1).
  std::uint64_t racy = 0;
  for (std::uint64_t seed = 1; seed <= 200; ++seed) racy += run_schedule<NoReleaseWait>(seed, false, false, true, true) > 0 ? 1 : 0;
  MESSAGE("fill_by_consumer schedules that race without edge 1: " << racy << " of 200");
  CHECK(racy > 20);
}

TEST_CASE("fill_by_consumer: drop_unfilled drops a group whose consumer never ran") {
  SUBCASE("dropped: the experts miss again and the consumer copies them") {
    Fixture<> f(12, 4, 1, false, crf_default_decay_q32, true);
    REQUIRE(f.route(0, Ids{0, 1, 2}).ok());
    REQUIRE(f.dev->prepare(f.ids_of(0), 3, f.streams[0]).ok());  // the consumer never runs
    f.prefetch(0, Ids{5}, 1, 1);  // rewrites the fill list: drop_unfilled still finds the forward's misses
    REQUIRE(f.dev->drop_unfilled(f.streams[0]).ok());
    f.settle();
    const std::int32_t* rm = f.dev->resident_map_device();
    CHECK(rm[0] == -1);
    CHECK(rm[1] == -1);
    CHECK(rm[2] == -1);
    CHECK(rm[5] >= 0);  // the prefetched expert was filled: kept
    CHECK(f.dev->device_stats().invalidations == 3);
    CHECK(flagged_missing(f).empty());
    const DevicePlanStats before = f.dev->device_stats();
    REQUIRE(f.route(0, Ids{0, 1, 2}).ok());
    REQUIRE(f.dev->prepare(f.ids_of(0), 3, f.streams[0]).ok());
    REQUIRE(f.read(0, Ids{0, 1, 2}).ok());
    f.settle();
    CHECK(f.dev->device_stats().misses - before.misses == 3);
    CHECK(f.log->consumer_copies == 3);
    CHECK(f.rt.race_count() == 0);
    CHECK(f.log->mismatches == 0);
  }
  SUBCASE("not dropped: the next forward hits slots that never received their bytes") {
    Fixture<> f(12, 4, 1, false, crf_default_decay_q32, true);
    REQUIRE(f.route(0, Ids{0, 1, 2}).ok());
    REQUIRE(f.dev->prepare(f.ids_of(0), 3, f.streams[0]).ok());
    REQUIRE(f.dev->prepare(f.ids_of(0), 3, f.streams[0]).ok());  // all hits: nothing flagged
    REQUIRE(f.read(0, Ids{0, 1, 2}).ok());
    f.settle();
    CHECK(f.log->consumer_copies == 0);
    CHECK(f.log->mismatches > 0);
  }
  SUBCASE("refused: without fill_by_consumer (nothing enqueued), and with overlap") {
    Fixture<> f(12, 4);
    CHECK(f.dev->view().missing == nullptr);
    const SimCounters before = f.rt.counters();
    CHECK(f.dev->drop_unfilled(f.streams[0]).code() == ErrorCode::not_supported);
    CHECK(f.rt.counters() == before);
    DeviceCacheOptions o;
    o.num_experts = 12;
    o.capacity = 4;
    o.max_ids = 8;
    o.overlap = true;
    o.fill_by_consumer = true;
    try {
      DevCacheE<OrderingEdges> bad(f.rt, o, six_tensor_layout());
      FAIL("fill_by_consumer with overlap was accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      CHECK(std::string(e.what()).find("fill_by_consumer with overlap") != std::string::npos);
    }
  }
}

// ---- the copy engine (docs/design.md "Copy-engine fills"): the proxy is an agent of its own --

TEST_CASE("copy engine (SimRuntime): no race over seeded random schedules; state equal to the host reference") {
  std::uint64_t races = 0, runs = 0;
  for (const bool overlap : {false, true}) {
    for (const bool prefetches : {false, true}) {
      for (std::uint64_t seed = 1; seed <= 400; ++seed) {
        races += run_schedule<OrderingEdges>(seed, true, overlap, prefetches, false, FillEngine::copy_engine);
        ++runs;
      }
    }
  }
  MESSAGE("copy-engine schedules checked: " << runs);
  CHECK(races == 0);
  Fixture<> f(12, 4, 1, false, crf_default_decay_q32, false, [](DeviceCacheOptions& o) { o.fill_engine = FillEngine::copy_engine; });
  CHECK(f.dev->fill_engine() == FillEngine::copy_engine);
  // automatic on SimRuntime: SM loads (the runtime has no link to profile).
  Fixture<> g(12, 4);
  CHECK(g.dev->fill_engine() == FillEngine::sm_loads);
}

namespace {
// A forward, then one that misses expert 5 into slot 2 while expert 0 hits.
void copy_engine_steps(Fixture<>& f) {
  (void)f.step(0, {0, 1});
  f.settle();
  (void)f.step(0, {0, 5});
  f.settle();
  CHECK(f.dev->resident_map_device()[5] == 2);
}
auto copy_engine_with(bool overlap, bool post_before_list, bool ready_before_copy) {
  return std::make_unique<Fixture<>>(12, 4, 1, overlap, crf_default_decay_q32, false, [=](DeviceCacheOptions& o) {
    o.fill_engine = FillEngine::copy_engine;
    o.test_post_before_list = post_before_list;
    o.test_ready_before_copy = ready_before_copy;
  });
}
}  // namespace

TEST_CASE("negative (edge P1): a proxy that takes the fill list without waiting for the post races the post") {
  auto f = copy_engine_with(false, true, false);
  copy_engine_steps(*f);
  REQUIRE(f->rt.race_count() > 0);
  const std::string d = f->rt.races()[0].description;
  MESSAGE(d);
  CHECK(d.find("proxy take") != std::string::npos);
  CHECK(d.find("device proxy_post") != std::string::npos);
  auto g = copy_engine_with(false, false, false);
  copy_engine_steps(*g);
  g->check_clean();
  g->check_equal(true);
}

TEST_CASE("negative (edge P2): ready words published before the proxy's copies: the consumer races the copy") {
  for (const bool overlap : {false, true}) {
    CAPTURE(overlap);
    auto f = copy_engine_with(overlap, false, true);
    copy_engine_steps(*f);
    REQUIRE(f->rt.race_count() > 0);
    const std::string d = f->rt.races()[0].description;
    MESSAGE(d);
    CHECK(d.find("proxy copy") != std::string::npos);
    CHECK(d.find("consumer") != std::string::npos);
    auto g = copy_engine_with(overlap, false, false);
    copy_engine_steps(*g);
    g->check_clean();
    g->check_equal(true);
  }
}

// speculate_on_copy_engine: prefetches through the proxy, forwards' fills on SM loads (lanes).
namespace {
auto speculating_with(bool skip_pending_copy_wait) {
  return std::make_unique<Fixture<>>(12, 4, 1, true, crf_default_decay_q32, false, [=](DeviceCacheOptions& o) {
    o.fill_engine = FillEngine::sm_loads;
    o.speculate_on_copy_engine = true;
    o.test_skip_pending_copy_wait = skip_pending_copy_wait;
  });
}
// A forward of 0 and 1, a prefetch of 6 and 7 into the two free slots through the proxy, then a
// forward that misses 8, 9 and 10 while the prefetch's copies may still be in flight.
void speculating_steps(Fixture<>& f) {
  (void)f.step(0, {0, 1});
  f.settle();
  f.prefetch(0, Ids{6, 7}, 2, 1);
  (void)f.step(0, {8, 9, 10});
  f.settle();
}
}  // namespace

TEST_CASE("speculate_on_copy_engine (SimRuntime): no race over seeded random schedules; state equal to the host reference") {
  std::uint64_t races = 0, runs = 0;
  for (std::uint64_t seed = 1; seed <= 600; ++seed) {
    races += run_schedule<OrderingEdges>(seed, true, true, true, false, FillEngine::sm_loads, true);
    ++runs;
  }
  MESSAGE("speculating schedules checked: " << runs);
  CHECK(races == 0);
  auto f = speculating_with(false);
  CHECK(f->dev->fill_engine() == FillEngine::sm_loads);
  CHECK(f->dev->speculates_on_copy_engine());
  speculating_steps(*f);
  f->check_clean();
  f->check_equal(true);
  const DevicePlanStats st = f->dev->device_stats();
  CHECK(st.speculative_issued == 2);
  CHECK(st.misses == 5);
  // The option changes nothing with the copy engine (every fill goes through the proxy already).
  Fixture<> g(12, 4, 1, true, crf_default_decay_q32, false, [](DeviceCacheOptions& o) {
    o.fill_engine = FillEngine::copy_engine;
    o.speculate_on_copy_engine = true;
  });
  CHECK_FALSE(g.dev->speculates_on_copy_engine());
}

TEST_CASE("negative (edge P6): a forward's SM-load fill that does not wait for a slot's pending speculative copy races it") {
  auto f = speculating_with(true);
  speculating_steps(*f);
  REQUIRE(f->rt.race_count() > 0);
  const std::string d = f->rt.races()[0].description;
  MESSAGE(d);
  CHECK(d.find("proxy copy") != std::string::npos);
  CHECK(d.find("plan_fill_ready") != std::string::npos);
  auto g = speculating_with(false);
  speculating_steps(*g);
  g->check_clean();
  g->check_equal(true);
}

TEST_CASE("speculate_on_copy_engine without overlap is refused") {
  SimRuntime rt;
  DeviceCacheOptions o;
  o.num_experts = 12;
  o.capacity = 4;
  o.max_ids = 8;
  o.speculate_on_copy_engine = true;
  try {
    DevCacheE<OrderingEdges> bad(rt, o, six_tensor_layout());
    FAIL("speculate_on_copy_engine without overlap was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("speculate_on_copy_engine without overlap") != std::string::npos);
  }
}

TEST_CASE("negative (edge P4): a cache destroyed without waiting for its proxy frees memory the proxy's copy still writes") {
  for (const bool skip_wait : {true, false}) {
    CAPTURE(skip_wait);
    Fixture<> f(12, 4, 1, false, crf_default_decay_q32, false, [=](DeviceCacheOptions& o) {
      o.fill_engine = FillEngine::copy_engine;
      o.test_skip_shutdown_wait = skip_wait;
    });
    const std::int32_t* ids = f.ids_of(0);
    REQUIRE(f.route(0, {0, 1}).ok());
    REQUIRE(f.dev->prepare(ids, 2, f.streams[0]).ok());  // two misses: the proxy's take and copy pend
    REQUIRE(f.rt.race_count() == 0);
    f.dev.reset();
    if (skip_wait) {
      REQUIRE(f.rt.race_count() > 0);
      const std::string d = f.rt.races()[0].description;
      MESSAGE(d);
      CHECK(d.find("freed while") != std::string::npos);
      CHECK(d.find("proxy") != std::string::npos);
      CHECK(d.find("issued by a host thread") != std::string::npos);
    } else {
      CHECK(f.rt.race_count() == 0);  // the destructor waited for the proxy's stream
    }
  }
}

TEST_CASE("copy engine (SimRuntime): a failed copy flags the error word, publishes the ready words, and the next call returns it") {
  Fixture<> f(12, 4, 1, true, crf_default_decay_q32, false, [](DeviceCacheOptions& o) {
    o.fill_engine = FillEngine::copy_engine;
    o.test_fail_copies = true;
  });
  const std::int32_t* ids = f.ids_of(0);
  REQUIRE(f.route(0, {0, 1}).ok());
  REQUIRE(f.dev->prepare(ids, 2, f.streams[0]).ok());
  f.settle();
  const DevicePlanState& st = f.dev->plan_state();
  CHECK(slot_seq_reached(st.slot_ready[0], st.slot_needed[0]));  // published: no consumer waits forever
  CHECK((f.dev->take_errors() & plan_error_fill_failed) != 0u);
  auto next = f.dev->prepare(ids, 2, f.streams[0]);
  REQUIRE_FALSE(next.ok());
  CHECK(next.status().code() == ErrorCode::runtime_failure);
  CHECK(std::string(next.status().message()).find("copy-engine fill failed") != std::string::npos);
  CHECK(f.dev->prepare(ids, 2, f.streams[0]).ok());  // reported once
  f.settle();
}
