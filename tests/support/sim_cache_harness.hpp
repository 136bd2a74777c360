#pragma once
// Test support: fills a cache's host pools with a recognisable pattern and launches a
// simulated consumer kernel that reads the slots through the forward map, declaring every
// byte it reads so the race detector sees it, and checks the bytes it finds. SimCacheFixture
// puts them together: a cache on its own SimRuntime with three streams and a reader log.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "expert_cache/expert_cache.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"


namespace expert_cache::test {

inline std::byte pattern_byte(std::size_t tensor, std::int32_t expert, std::size_t i) noexcept {
  std::uint64_t x = (tensor + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(expert) + 7) * 0xBF58476D1CE4E5B9ull ^ i * 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<std::byte>(x & 0xFF);
}

template <class Cache>
void fill_host_pools(Cache& cache) {
  const auto& tensors = cache.storage().tensors();
  for (std::int32_t e = 0; e < cache.options().num_experts; ++e) {
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      std::byte* p = cache.storage().host_tensor(t, e);
      for (std::size_t i = 0; i < tensors[t].bytes_per_expert; ++i) p[i] = pattern_byte(t, e, i);
    }
  }
}

struct ReaderLog {
  std::uint64_t runs = 0;
  std::uint64_t mismatches = 0;
  std::string first_mismatch;
};

// Enqueues on `stream` a kernel-like reader of the forward `ids` (unique, non-negative):
// reads the forward map, the resident map and every tensor of every requested slot.
template <class Cache>
Status launch_reader(SimRuntime& rt, const Cache& cache, const ForwardView& view, std::vector<std::int32_t> ids,
                     SimRuntime::Stream stream, std::shared_ptr<ReaderLog> log) {
  std::vector<Access> accesses;
  const auto e_count = static_cast<std::size_t>(cache.options().num_experts);
  accesses.push_back({view.expert_map, e_count * sizeof(std::int32_t), AccessMode::read});
  accesses.push_back({view.resident_map, e_count * sizeof(std::int32_t), AccessMode::read});
  const auto host_map = cache.forward_map_host();
  std::vector<std::int32_t> slots;
  for (std::int32_t e : ids) slots.push_back(host_map[static_cast<std::size_t>(e)]);
  for (std::size_t k = 0; k < ids.size(); ++k) {
    for (const SlotTensor& t : view.tensors) {
      if (t.bytes != 0) accesses.push_back({t.slot(slots[k]), t.bytes, AccessMode::read});
    }
  }
  const ForwardView v = view;
  return rt.launch(stream, accesses, [v, ids = std::move(ids), slots = std::move(slots), log]() {
    ++log->runs;
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const std::int32_t mapped = v.expert_map[ids[k]];
      const std::int32_t resident = v.resident_map[ids[k]];
      bool ok = mapped == slots[k] && resident == slots[k];
      for (std::size_t t = 0; ok && t < num_expert_tensors; ++t) {
        const SlotTensor& st = v.tensors[t];
        const std::byte* p = st.slot(slots[k]);
        for (std::size_t i = 0; i < st.bytes; ++i) {
          if (p[i] != pattern_byte(t, ids[k], i)) {
            ok = false;
            break;
          }
        }
      }
      if (!ok) {
        if (log->mismatches++ == 0) {
          log->first_mismatch = "expert " + std::to_string(ids[k]) + " slot " + std::to_string(slots[k]) +
                                " (map says " + std::to_string(mapped) + ", resident " + std::to_string(resident) + ")";
        }
      }
    }
  });
}

// Checks the device forward map holds exactly `ids` (after the stream drained).
template <class Cache>
bool forward_map_exact(const Cache& cache, const ForwardView& view, std::span<const std::int32_t> ids) {
  const auto n = cache.options().num_experts;
  std::vector<bool> wanted(static_cast<std::size_t>(n), false);
  for (std::int32_t e : ids) wanted[static_cast<std::size_t>(e)] = true;
  for (std::int32_t e = 0; e < n; ++e) {
    const bool present = view.expert_map[e] != absent_slot;
    if (present != wanted[static_cast<std::size_t>(e)]) return false;
  }
  return true;
}

inline ExplicitLayout six_tensor_layout() {
  return ExplicitLayout{{{{"w13", 96}, {"w2", 48}, {"w13_scale", 24}, {"w2_scale", 12}, {"w13_scale_2", 4}, {"w2_scale_2", 4}}}};
}

inline CacheOptions quiet_options(std::int32_t experts, std::int32_t capacity, std::int32_t top_k) {
  CacheOptions o;
  o.num_experts = experts;
  o.capacity = capacity;
  o.top_k = top_k;
  o.log = {};
  return o;
}

// A cache on its own SimRuntime (1 GiB, race detector on) with three streams and the host
// pools filled, plus the log of the readers launched after each forward. Shared by the CPU
// tests of the host-planned cache (test_cache_sim.cpp, test_prefetch.cpp).
template <class Cache>
struct SimCacheFixture {
  using Ids = std::vector<std::int32_t>;
  using Stream = SimRuntime::Stream;

  SimRuntime rt;
  std::vector<Stream> streams;
  std::unique_ptr<Cache> cache;
  std::shared_ptr<ReaderLog> log = std::make_shared<ReaderLog>();
  std::uint64_t launched = 0;
  ForwardView last_view{};  // the latest forward()'s view and unique experts
  Ids last_unique;

  SimCacheFixture(std::int32_t experts, std::int32_t capacity, std::int32_t top_k, std::uint64_t seed = 1,
                  std::size_t staging_ring = 8)
      : rt(SimRuntime::Options{.memory_limit = std::size_t{1} << 30, .seed = seed, .max_races = 64, .max_streams = 64}) {
    for (int i = 0; i < 3; ++i) streams.push_back(rt.create_stream().value());
    CacheOptions o = quiet_options(experts, capacity, top_k);
    o.staging_ring = staging_ring;
    cache = std::make_unique<Cache>(rt, o, six_tensor_layout());
    fill_host_pools(*cache);
  }

  // prepare + a reader of the forward (forward map, resident map, slots) on the same stream.
  Status forward(const Ids& topk, Stream s) {
    auto view = cache->prepare(topk, s);
    if (!view.ok()) return view.status();
    last_view = view.value();
    last_unique.clear();
    for (ExpertId e : cache->last_plan().unique) last_unique.push_back(e.value);
    ++launched;
    return launch_reader(rt, *cache, view.value(), last_unique, s, log);
  }
  Status forward_unique(const Ids& ids, Stream s) {
    auto view = cache->prepare_unique(ids, s);
    if (!view.ok()) return view.status();
    ++launched;
    return launch_reader(rt, *cache, view.value(), ids, s, log);
  }

  void check_clean_after_drain() {
    rt.drain();
    CHECK(rt.races().empty());
    if (!rt.races().empty()) MESSAGE(rt.races()[0].description);
    CHECK(log->mismatches == 0);
    if (log->mismatches != 0) MESSAGE(log->first_mismatch);
    CHECK(log->runs == launched);
    // The device resident map ends at the final generation, unless a prefetch since the last
    // prepare left it for the next one to upload.
    const auto host = cache->resident_map_host();
    const std::int32_t* dev = cache->resident_map_device();
    if constexpr (requires { cache->resident_map_behind(); }) {
      if (cache->resident_map_behind()) return;
    }
    CHECK(std::equal(host.begin(), host.end(), dev));
  }
};

}  // namespace expert_cache::test
