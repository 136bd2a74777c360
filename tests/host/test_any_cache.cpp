// AnyExpertCache (runtime-selected provider) against the static caches on SimRuntime: the same
// random trace gives the same ForwardView maps, stats and slot bytes; every bad name is refused
// with the valid names and nothing allocated; a rejected forward changes nothing; prepare adds
// no allocation over the static cache's.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <random>
#include <cstdlib>
#include <string>
#include <vector>

#include "expert_cache/any/any_cache.hpp"
#include "expert_cache/layout/dense.hpp"
#include "support/allocation_counter.hpp"  // the one TU of this program that replaces operator new
#include "support/caller_memory.hpp"
#include "support/sim_cache_harness.hpp"
#include "support/stats_checks.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;
using Stream = SimRuntime::Stream;
using AnySim = AnyExpertCache<SimRuntime>;

namespace {

SimRuntime::Options sim_options() {
  return SimRuntime::Options{.memory_limit = std::size_t{1} << 30, .seed = 3, .max_races = 64, .max_streams = 64};
}

AnyCacheConfig config_of(std::string provider, std::string policy, std::string staging, std::string storage,
                         std::int32_t experts, std::int32_t capacity, std::int32_t top_k) {
  AnyCacheConfig c;
  c.provider = std::move(provider);
  c.policy = std::move(policy);
  c.staging = std::move(staging);
  c.storage = std::move(storage);
  c.layout = AnyLayout::of(six_tensor_layout());
  c.options = quiet_options(experts, capacity, top_k);
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

// Device maps and every slot's bytes (read once both runtimes drained).
template <class Static>
void check_device_state_equal(const Static& s, const AnySim& a, std::int32_t experts, std::int32_t capacity) {
  for (std::int32_t e = 0; e < experts; ++e) {
    REQUIRE(s.forward_map_device()[e] == a.forward_map_device()[e]);
    REQUIRE(s.resident_map_device()[e] == a.resident_map_device()[e]);
  }
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    const SlotTensor st = s.storage().slot_tensor(t);
    const SlotTensor at = a.slot_tensor(t);
    REQUIRE(st.bytes == at.bytes);
    REQUIRE(st.slot_stride == at.slot_stride);
    for (std::int32_t slot = 0; slot < capacity; ++slot) {
      REQUIRE(std::equal(st.slot(slot), st.slot(slot) + st.bytes, at.slot(slot)));
    }
  }
}

void check_result_equal(const Result<ForwardView>& s, const Result<ForwardView>& a) {
  REQUIRE(s.ok() == a.ok());
  if (!s.ok()) {
    CHECK(s.status().code() == a.status().code());
    CHECK(s.status().message() == a.status().message());
    return;
  }
  CHECK(s.value().hits == a.value().hits);
  CHECK(s.value().misses == a.value().misses);
  CHECK(s.value().generation == a.value().generation);
}

Ids random_topk(std::mt19937_64& rng, std::int32_t n, std::int32_t experts) {
  Ids ids;
  for (std::int32_t i = 0; i < n; ++i) {
    const auto r = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(experts + 1));
    ids.push_back(r == experts ? -1 : r);
  }
  return ids;
}

// One random trace through the static cache and the erased one on twin runtimes: prepares
// from two streams (owner changes), unique groups, invalidates, and rejected forwards (ids out
// of range, too many experts, duplicates in a unique list). After each call both runtimes are
// drained and everything observable compared.
// `ref_memory`: the static cache's caller memory (config.options.memory is the erased one's).
template <class Static>
void run_same_trace(const AnyCacheConfig& config, std::uint64_t seed, const StorageMemory& ref_memory = {}) {
  const std::int32_t experts = config.options.num_experts, capacity = config.options.capacity,
                     top_k = config.options.top_k;
  SimRuntime rs(sim_options()), ra(sim_options());
  const Stream s_streams[2] = {rs.create_stream().value(), rs.create_stream().value()};
  const Stream a_streams[2] = {ra.create_stream().value(), ra.create_stream().value()};
  CacheOptions ref_options = quiet_options(experts, capacity, top_k);
  ref_options.memory = ref_memory;
  Static ref(rs, ref_options, six_tensor_layout());
  auto made = make_expert_cache(ra, config);
  REQUIRE(made.ok());
  AnySim any = std::move(made.value());
  fill_host_pools(ref);
  fill_any(any);
  check_stats_equal(ref.stats(), any.stats());
  REQUIRE(any.copy_regions().count == ref.storage().copy_regions().count);

  std::mt19937_64 rng(seed);
  for (int step = 0; step < 300; ++step) {
    const std::size_t si = rng() % 2;
    const auto kind = rng() % 20;
    if (kind < 10) {
      const Ids ids = random_topk(rng, 1 + static_cast<std::int32_t>(rng() % 6), experts);
      check_result_equal(ref.prepare(ids, s_streams[si]), any.prepare(ids, a_streams[si]));
    } else if (kind < 13) {
      Ids ids;
      for (std::int32_t e = 0; e < experts && static_cast<std::int32_t>(ids.size()) < capacity; ++e) {
        if (rng() % 3 == 0) ids.push_back(e);
      }
      std::shuffle(ids.begin(), ids.end(), rng);
      check_result_equal(ref.prepare_unique(ids, s_streams[si]), any.prepare_unique(ids, a_streams[si]));
    } else if (kind < 16) {
      const auto e = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(experts + 2)) - 1;  // -1, E: bad
      const Status x = ref.invalidate(e, s_streams[si]);
      const Status y = any.invalidate(e, a_streams[si]);
      REQUIRE(x.code() == y.code());
      CHECK(x.message() == y.message());
    } else {
      // Rejected forwards: out of range, more unique experts than slots, a duplicate.
      Ids bad;
      switch (rng() % 3) {
        case 0: bad = {0, experts}; break;
        case 1: for (std::int32_t e = 0; e <= capacity; ++e) bad.push_back(e); break;
        default: bad = {1, 1}; break;
      }
      const auto before_s = ref.stats();
      const auto before_a = any.stats();
      const bool unique = bad.size() == 2 && bad[0] == bad[1];
      const auto x = unique ? ref.prepare_unique(bad, s_streams[si]) : ref.prepare(bad, s_streams[si]);
      const auto y = unique ? any.prepare_unique(bad, a_streams[si]) : any.prepare(bad, a_streams[si]);
      REQUIRE(!x.ok());
      check_result_equal(x, y);
      check_stats_equal(before_a, any.stats());  // unchanged, as the static one
      check_stats_equal(before_s, ref.stats());
    }
    rs.drain();
    ra.drain();
    check_stats_equal(ref.stats(), any.stats());
    REQUIRE(std::ranges::equal(ref.forward_map_host(), any.forward_map_host()));
    REQUIRE(std::ranges::equal(ref.resident_map_host(), any.resident_map_host()));
    check_device_state_equal(ref, any, experts, capacity);
  }
  CHECK(rs.races().empty());
  CHECK(ra.races().empty());
  CHECK(rs.counters() == ra.counters());  // the same runtime calls, in the same order
}

}  // namespace

TEST_CASE("AnyExpertCache: same maps, stats and slot bytes as the static cache on a random trace") {
  constexpr std::int32_t E = 24, C = 6, K = 2;
  SUBCASE("row defaults = RowCache") {
    run_same_trace<RowCache<SimRuntime, ExplicitLayout>>(config_of("row", "", "", "", E, C, K), 1);
  }
  SUBCASE("cached defaults = WholeExpertCache") {
    run_same_trace<WholeExpertCache<SimRuntime, ExplicitLayout>>(config_of("cached", "", "", "", E, C, K), 2);
  }
  SUBCASE("cached lfru/inline/expert_major (vLLM's inline copies)") {
    run_same_trace<ExpertCache<ExpertMajorStorage, Lfru, Inline, ExplicitLayout, SimRuntime>>(
        config_of("cached", "lfru", "inline", "expert_major", E, C, K), 3);
  }
  SUBCASE("row sieve/inline/tensor_major") {
    run_same_trace<ExpertCache<TensorMajorStorage, Sieve, Inline, ExplicitLayout, SimRuntime>>(
        config_of("row", "sieve", "inline", "tensor_major", E, C, K), 4);
  }
  SUBCASE("row s3fifo/batched/expert_major") {
    run_same_trace<ExpertCache<ExpertMajorStorage, S3Fifo, Batched, ExplicitLayout, SimRuntime>>(
        config_of("row", "s3fifo", "batched", "expert_major", E, C, K), 5);
  }
  SUBCASE("row arc/copy_stream/expert_major") {
    run_same_trace<ExpertCache<ExpertMajorStorage, Arc, CopyStream, ExplicitLayout, SimRuntime>>(
        config_of("row", "arc", "copy_stream", "expert_major", E, C, K), 6);
  }
  SUBCASE("row wtinylfu/batched/tensor_major") {
    run_same_trace<ExpertCache<TensorMajorStorage, WTinyLfu, Batched, ExplicitLayout, SimRuntime>>(
        config_of("row", "wtinylfu", "batched", "tensor_major", E, C, K), 7);
  }
  SUBCASE("row lrfu/copy_stream/tensor_major") {
    run_same_trace<ExpertCache<TensorMajorStorage, Lrfu, CopyStream, ExplicitLayout, SimRuntime>>(
        config_of("row", "lrfu", "copy_stream", "tensor_major", E, C, K), 8);
  }
  SUBCASE("cached layershare/inline/tensor_major") {
    run_same_trace<ExpertCache<TensorMajorStorage, LayerShare, Inline, ExplicitLayout, SimRuntime>>(
        config_of("cached", "layershare", "inline", "tensor_major", E, C, K), 9);
  }
  SUBCASE("row lru/copy_stream/expert_major_host") {
    run_same_trace<ExpertCache<ExpertMajorHostStorage, Lru, CopyStream, ExplicitLayout, SimRuntime>>(
        config_of("row", "lru", "copy_stream", "expert_major_host", E, C, K), 10);
  }
  SUBCASE("cached lfru/batched/expert_major_host") {
    run_same_trace<ExpertCache<ExpertMajorHostStorage, Lfru, Batched, ExplicitLayout, SimRuntime>>(
        config_of("cached", "lfru", "batched", "expert_major_host", E, C, K), 11);
  }
}

namespace {
// One cache's caller memory: host tensors (optional) and a slot workspace. SimRuntime copies
// to any address, so host memory stands in for the device workspace.
struct CallerMemory {
  CallerHostTensors host;
  std::vector<CallerHostTensors::Line> workspace;
  StorageMemory memory;
  CallerMemory(bool host_tensors, std::size_t workspace_bytes, std::int32_t experts)
      : host(six_tensor_layout().tensors(), experts),
        workspace((workspace_bytes + sizeof(CallerHostTensors::Line) - 1) / sizeof(CallerHostTensors::Line)) {
    if (host_tensors) memory = host.memory();
    memory.slot_workspace = MemorySpan{workspace_base(), workspace_bytes};
  }
  [[nodiscard]] bool in_workspace(const std::byte* p) const noexcept {
    const std::byte* b = workspace_base();
    return b != nullptr && p >= b && p < b + memory.slot_workspace.bytes;
  }
  // No workspace asked for: null (an empty vector has no element to take the address of).
  [[nodiscard]] std::byte* workspace_base() const noexcept {
    return workspace.empty() ? nullptr : const_cast<std::byte*>(workspace.front().b);
  }
};
}  // namespace

TEST_CASE("AnyExpertCache: caller memory (options.memory) is used in place, with the static cache's results and errors") {
  constexpr std::int32_t E = 24, C = 6, K = 2;
  const ExpertTensorBytes tensors = six_tensor_layout().tensors();
  const CacheShape shape{E, C};
  SUBCASE("row tensor_major: caller host tensors + slot workspace") {
    const std::size_t ws = TensorMajorStorage<SimRuntime>::slot_workspace_bytes(shape, tensors);
    CallerMemory ref(true, ws, E), mine(true, ws, E);
    AnyCacheConfig c = config_of("row", "", "", "tensor_major", E, C, K);
    c.options.memory = mine.memory;
    {
      SimRuntime rt(sim_options());
      auto made = make_expert_cache(rt, c);
      REQUIRE(made.ok());
      const AnySim& any = made.value();
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        if (tensors[t].bytes_per_expert == 0) continue;
        CHECK(any.host_tensor(t, 5) == mine.host.data(t) + 5 * tensors[t].bytes_per_expert);  // no copy
        CHECK(any.copy_regions().regions[t].host_base == mine.host.data(t));
        CHECK(rt.is_registered(mine.host.data(t), mine.host.bytes[t]));
        CHECK(mine.in_workspace(any.slot_tensor(t).base));
      }
    }
    run_same_trace<RowCache<SimRuntime, ExplicitLayout>>(c, 12, ref.memory);
  }
  SUBCASE("cached expert_major_host: caller slot workspace") {
    const std::size_t ws = ExpertMajorHostStorage<SimRuntime>::slot_workspace_bytes(shape, tensors);
    CallerMemory ref(false, ws, E), mine(false, ws, E);
    AnyCacheConfig c = config_of("cached", "lfru", "inline", "expert_major_host", E, C, K);
    c.options.memory = mine.memory;
    {
      SimRuntime rt(sim_options());
      auto made = make_expert_cache(rt, c);
      REQUIRE(made.ok());
      for (std::size_t t = 0; t < num_expert_tensors; ++t)
        if (tensors[t].bytes_per_expert != 0) CHECK(mine.in_workspace(made.value().slot_tensor(t).base));
    }
    run_same_trace<ExpertCache<ExpertMajorHostStorage, Lfru, Inline, ExplicitLayout, SimRuntime>>(c, 13, ref.memory);
  }
  SUBCASE("device provider: caller host tensors reach DeviceExpertCache") {
    CallerMemory mine(true, 0, E);
    mine.memory.slot_workspace = MemorySpan{};
    AnyCacheConfig c = config_of("device", "", "", "tensor_major", E, C, 1);
    c.max_ids = 8;
    c.options.memory = mine.memory;
    SimRuntime rt(sim_options());
    auto made = make_expert_cache(rt, c);
    REQUIRE(made.ok());
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      if (tensors[t].bytes_per_expert == 0) continue;
      CHECK(made.value().host_tensor(t, 3) == mine.host.data(t) + 3 * tensors[t].bytes_per_expert);
    }
  }
  SUBCASE("a bad span is refused with the static cache's error, nothing allocated or registered") {
    CallerMemory mine(true, 0, E);
    mine.memory.slot_workspace = MemorySpan{};
    mine.memory.host_tensors[1].bytes -= 1;  // not exactly E * bytes
    for (const char* provider : {"row", "device"}) {
      CAPTURE(provider);
      std::string expected;
      try {
        SimRuntime rt(sim_options());
        CacheOptions o = quiet_options(E, C, 1);
        o.memory = mine.memory;
        RowCache<SimRuntime, ExplicitLayout> ref(rt, o, six_tensor_layout());
        FAIL("the static cache accepted a bad span");
      } catch (const Error& e) {
        REQUIRE(e.code() == ErrorCode::invalid_argument);
        expected = e.what();
      }
      AnyCacheConfig c = config_of(provider, "", "", "tensor_major", E, C, 1);
      c.max_ids = 8;
      c.options.memory = mine.memory;
      SimRuntime rt(sim_options());
      auto made = make_expert_cache(rt, c);
      REQUIRE(!made.ok());
      CHECK(made.status().code() == ErrorCode::invalid_argument);
      CHECK(std::string(to_string(made.status().code())) + ": " + std::string(made.status().message()) == expected);
      CHECK(rt.allocated_bytes() == 0);
      CHECK(rt.registered_ranges() == 0);
    }
  }
}

TEST_CASE("AnyExpertCache: provider device = DeviceExpertCache on the same device ids") {
  constexpr std::int32_t E = 20, C = 5, max_ids = 12;
  for (const char* storage : {"tensor_major", "expert_major"}) {
    CAPTURE(storage);
    SimRuntime rs(sim_options()), ra(sim_options());
    const Stream ss = rs.create_stream().value(), sa = ra.create_stream().value();
    RuntimeBuffer<SimRuntime> ids_s(rs, max_ids * sizeof(std::int32_t), MemoryKind::device);
    RuntimeBuffer<SimRuntime> ids_a(ra, max_ids * sizeof(std::int32_t), MemoryKind::device);
    RuntimeBuffer<SimRuntime> pred_s(rs, E * sizeof(std::int32_t), MemoryKind::device);
    RuntimeBuffer<SimRuntime> pred_a(ra, E * sizeof(std::int32_t), MemoryKind::device);
    std::uint64_t speculative = 0;
    DeviceCacheOptions o;
    o.num_experts = E;
    o.capacity = C;
    o.max_ids = max_ids;
    o.label = "layer";
    std::unique_ptr<DeviceExpertCache<TensorMajorStorage, ExplicitLayout, SimRuntime>> ref_tm;
    std::unique_ptr<DeviceExpertCache<ExpertMajorStorage, ExplicitLayout, SimRuntime>> ref_em;
    const bool tm = std::string_view(storage) == "tensor_major";
    if (tm) ref_tm = std::make_unique<DeviceExpertCache<TensorMajorStorage, ExplicitLayout, SimRuntime>>(rs, o, six_tensor_layout());
    else ref_em = std::make_unique<DeviceExpertCache<ExpertMajorStorage, ExplicitLayout, SimRuntime>>(rs, o, six_tensor_layout());
    AnyCacheConfig c = config_of("device", "", "", storage, E, C, 1);
    c.max_ids = max_ids;
    c.options.label = "layer";
    auto made = make_expert_cache(ra, c);
    REQUIRE(made.ok());
    AnySim any = std::move(made.value());
    CHECK(any.provider() == "device");
    CHECK(any.policy() == "lru");
    CHECK(any.staging() == "inline");
    CHECK(any.storage() == storage);
    fill_any(any);
    const auto run = [&](auto& ref) {
      fill_host_pools(ref);
      std::mt19937_64 rng(17);
      for (int step = 0; step < 200; ++step) {
        const Ids ids = random_topk(rng, 1 + static_cast<std::int32_t>(rng() % max_ids), E);
        // The router's output: written to device memory, declared to the race detector.
        for (auto [rt, buf] : {std::pair{&rs, &ids_s}, std::pair{&ra, &ids_a}}) {
          rt->host_access(buf->data(), ids.size() * sizeof(std::int32_t), AccessMode::write);
          std::memcpy(buf->data(), ids.data(), ids.size() * sizeof(std::int32_t));
        }
        const auto* dev_s = reinterpret_cast<const std::int32_t*>(ids_s.data());
        const auto* dev_a = reinterpret_cast<const std::int32_t*>(ids_a.data());
        if (step % 7 == 3) {
          const auto e = static_cast<std::int32_t>(rng() % E);
          REQUIRE(ref.invalidate(e, ss).ok() == any.invalidate(e, sa).ok());
        }
        const auto x = ref.prepare(dev_s, static_cast<std::int32_t>(ids.size()), ss);
        const auto y = any.prepare(std::span<const std::int32_t>(dev_a, ids.size()), sa);
        check_result_equal(x, y);
        for (std::int32_t g = 1; g < ref.max_groups(max_ids); ++g) {
          check_result_equal(ref.prepare_group(g, ss), any.prepare_group(g, sa));
        }
        if (step % 3 == 1) {  // lookahead: device ids (prefetch_device) or host ids (prefetch)
          Ids predicted;
          for (auto n = rng() % 5; n > 0; --n) predicted.push_back(static_cast<std::int32_t>(rng() % E));
          const PrefetchOptions po{2 * static_cast<std::int64_t>(total_bytes_per_expert(six_tensor_layout().tensors())), 1};
          if (step % 2 == 0) {
            for (auto [rt, buf] : {std::pair{&rs, &pred_s}, std::pair{&ra, &pred_a}}) {
              if (predicted.empty()) break;  // nothing to write (and no null pointer to memcpy)
              rt->host_access(buf->data(), predicted.size() * sizeof(std::int32_t), AccessMode::write);
              std::memcpy(buf->data(), predicted.data(), predicted.size() * sizeof(std::int32_t));
            }
            const auto n = static_cast<std::int32_t>(predicted.size());
            REQUIRE(ref.prefetch(reinterpret_cast<const std::int32_t*>(pred_s.data()), n, ss, po).ok());
            REQUIRE(any.prefetch_device(reinterpret_cast<const std::int32_t*>(pred_a.data()), n, sa, po).ok());
          } else {
            REQUIRE(ref.prefetch(std::span<const std::int32_t>(predicted), ss, po).ok());
            REQUIRE(any.prefetch(std::span<const std::int32_t>(predicted), sa, po).ok());
          }
        }
        rs.drain();
        ra.drain();
        REQUIRE(rs.synchronize(ss).ok());  // the host reads the error word next
        REQUIRE(ra.synchronize(sa).ok());
        check_stats_equal(ref.stats(), any.stats());
        CHECK(ref.take_errors() == any.take_errors());
        for (std::int32_t e = 0; e < E; ++e) {
          REQUIRE(ref.forward_map_device()[e] == any.forward_map_device()[e]);
          REQUIRE(ref.resident_map_device()[e] == any.resident_map_device()[e]);
        }
        for (std::size_t t = 0; t < num_expert_tensors; ++t) {
          const SlotTensor st = ref.storage().slot_tensor(t), at = any.slot_tensor(t);
          for (std::int32_t slot = 0; slot < C; ++slot) REQUIRE(std::equal(st.slot(slot), st.slot(slot) + st.bytes, at.slot(slot)));
        }
      }
      speculative += ref.stats().speculative_issued;
      // Too many ids: refused by both, nothing changes.
      const Ids big(max_ids + 1, 0);
      check_result_equal(ref.prepare(reinterpret_cast<const std::int32_t*>(ids_s.data()), max_ids + 1, ss),
                         any.prepare(std::span<const std::int32_t>(big), sa));
      CHECK(rs.races().empty());
      if (!rs.races().empty()) MESSAGE(rs.races()[0].description);
      CHECK(ra.races().empty());
    };
    if (tm) run(*ref_tm); else run(*ref_em);
    CHECK(any.prepare_unique(Ids{1}, sa).status().code() == ErrorCode::not_supported);
    CHECK(any.last_plan() == nullptr);
    CHECK(any.forward_map_host().empty());
    CHECK(speculative > 20);  // the lookahead calls did fill
    const Ids bad = {E};
    CHECK(any.prefetch(std::span<const std::int32_t>(bad), sa, {1 << 20, 1}).status().code() == ErrorCode::expert_out_of_range);
  }
}

TEST_CASE("AnyExpertCache: readiness() is the device provider's; overlap on SimRuntime is refused, nothing allocated") {
  constexpr std::int32_t E = 16, C = 6, max_ids = 4;
  SimRuntime rt(sim_options());
  {
    AnyCacheConfig c = config_of("device", "", "", "", E, C, 2);
    c.max_ids = max_ids;
    c.lookahead = true;  // accepted with the device provider (it steers automatic's engine choice)
    auto made = make_expert_cache(rt, c);
    REQUIRE(made.ok());
    CHECK_FALSE(made.value().readiness().enabled());  // no overlap: the consumer relies on stream order
  }
  // SimRuntime's run-time-selected executor is compiled without the overlapped fill (build time);
  // the static DeviceExpertCache models overlap, and the CUDA build's erased executor runs it
  // (tests/gpu/test_any_cache_cuda.cu).
  AnyCacheConfig c = config_of("device", "", "", "", E, C, 2);
  c.max_ids = max_ids;
  c.overlap = true;
  const SimCounters before = rt.counters();
  auto refused = make_expert_cache(rt, c);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == ErrorCode::not_supported);
  CHECK(std::string(refused.status().message()).find("overlap") != std::string::npos);
  CHECK(rt.counters() == before);
  CHECK(rt.allocated_bytes() == 0);
  // The host providers have no per-slot readiness (prepare orders the consumer after the copies).
  auto row = make_expert_cache(rt, config_of("row", "", "", "", E, C, 2));
  REQUIRE(row.ok());
  CHECK_FALSE(row.value().readiness().enabled());
}

TEST_CASE("make_expert_cache: the device provider's default storage is expert-major where the copy proxy moves fills") {
  constexpr std::int32_t E = 16, C = 8, max_ids = 4;  // room to look ahead: C >= 2 * max_ids
  const auto storage_of = [](const AnyCacheConfig& c) {
    const std::array<std::string_view, 2> stagings = {"inline", "copy_stream"};
    detail::AnyCacheChoices chosen;
    const Status s = detail::check_any_cache_config(c, stagings, true, chosen);
    REQUIRE_MESSAGE(s.ok(), std::string(s.message()));
    return std::string(chosen.storage_name);
  };
  const auto device = [&](FillEngine engine, bool overlap, bool lookahead) {
    AnyCacheConfig c = config_of("device", "", "", "", E, C, 2);
    c.max_ids = max_ids;
    c.fill_engine = engine;
    c.overlap = overlap;
    c.lookahead = lookahead;
    return c;
  };
  // Every fill through the proxy, or automatic's speculation on the copy engine: one copy per fill.
  CHECK(storage_of(device(FillEngine::copy_engine, false, false)) == "expert_major");
  CHECK(storage_of(device(FillEngine::copy_engine, true, true)) == "expert_major");
  CHECK(storage_of(device(FillEngine::automatic, true, true)) == "expert_major");
  // SM-load fills, or automatic without the overlapped lookahead (the demand fills choose alone).
  CHECK(storage_of(device(FillEngine::sm_loads, true, true)) == "tensor_major");
  CHECK(storage_of(device(FillEngine::automatic, false, true)) == "tensor_major");
  CHECK(storage_of(device(FillEngine::automatic, true, false)) == "tensor_major");
  CHECK(storage_of(device(FillEngine::automatic, false, false)) == "tensor_major");
  {  // no room to look ahead: automatic's speculation stays off the copy engine
    AnyCacheConfig c = device(FillEngine::automatic, true, true);
    c.options.capacity = 2 * max_ids - 1;
    CHECK(storage_of(c) == "tensor_major");
  }
  {  // automatic with the link's profile in the config: the engines it picks there decide
    LinkProfile slow;
    slow.copy_engine_gbps_batch = 50.0;
    slow.sm_load_gbps = 30.0;  // 0.6 of the copy engine: every fill through the proxy
    LinkProfile fast = slow;
    fast.sm_load_gbps = 47.0;  // 0.94: SM loads for the forwards
    AnyCacheConfig c = device(FillEngine::automatic, false, false);
    c.link_profile = slow;
    CHECK(storage_of(c) == "expert_major");
    c.link_profile = fast;
    CHECK(storage_of(c) == "tensor_major");
    c = device(FillEngine::automatic, true, true);
    c.link_profile = fast;
    CHECK(storage_of(c) == "expert_major");  // the speculative copies through the proxy
    c.options.capacity = 2 * max_ids - 1;
    CHECK(storage_of(c) == "tensor_major");  // no room: no speculation
    c.link_profile = slow;
    CHECK(storage_of(c) == "expert_major");
    c.link_profile = LinkProfile{};  // no measurement: automatic takes the copy engine
    CHECK(storage_of(c) == "expert_major");
    // One hardware work queue (CUDA_DEVICE_MAX_CONNECTIONS=1): automatic keeps every fill on SM loads.
    const char* before = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    const std::string saved = before != nullptr ? before : "";
    REQUIRE(setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 1) == 0);
    c.link_profile = slow;
    CHECK(storage_of(c) == "tensor_major");
    c.link_profile.reset();
    c.options.capacity = C;  // room to look ahead again
    CHECK(storage_of(c) == "tensor_major");
    CHECK(storage_of(device(FillEngine::copy_engine, true, true)) == "expert_major");  // named: the CUDA cache refuses it
    REQUIRE(setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8", 1) == 0);
    CHECK(storage_of(c) == "expert_major");
    if (before != nullptr) {
      REQUIRE(setenv("CUDA_DEVICE_MAX_CONNECTIONS", saved.c_str(), 1) == 0);
    } else {
      REQUIRE(unsetenv("CUDA_DEVICE_MAX_CONNECTIONS") == 0);
    }
  }
  {  // expert-major takes policy lru only
    AnyCacheConfig c = device(FillEngine::copy_engine, true, true);
    c.policy = "lfru";
    CHECK(storage_of(c) == "tensor_major");
  }
  {  // caller memory keeps the tensor-major default its spans were made for
    std::vector<std::byte> host(64);
    AnyCacheConfig c = device(FillEngine::copy_engine, true, true);
    c.options.memory.host_tensors[0] = MemorySpan{host.data(), host.size()};
    CHECK(storage_of(c) == "tensor_major");
  }
  {  // a named storage is kept
    AnyCacheConfig c = device(FillEngine::copy_engine, true, true);
    c.storage = "tensor_major";
    CHECK(storage_of(c) == "tensor_major");
  }
  // The host providers keep theirs.
  CHECK(storage_of(config_of("row", "", "", "", E, C, 2)) == "tensor_major");
  CHECK(storage_of(config_of("cached", "", "", "", E, C, 2)) == "expert_major");
  // Built on the simulated runtime: every fill through the proxy, on the expert-major storage.
  SimRuntime rt(sim_options());
  auto made = make_expert_cache(rt, device(FillEngine::copy_engine, false, false));
  REQUIRE_MESSAGE(made.ok(), std::string(made.status().message()));
  CHECK(made.value().storage() == "expert_major");
  CHECK(made.value().copy_regions().count == 1u);
}

TEST_CASE("AnyExpertCache: prefetch_device is the device provider's; host providers refuse it") {
  SimRuntime rt(sim_options());
  const Stream s = rt.create_stream().value();
  auto made = make_expert_cache(rt, config_of("row", "", "", "", 12, 4, 1));
  REQUIRE(made.ok());
  AnySim row = std::move(made.value());
  RuntimeBuffer<SimRuntime> ids(rt, 4 * sizeof(std::int32_t), MemoryKind::device);
  const CacheStats before = row.stats();
  const auto r = row.prefetch_device(reinterpret_cast<const std::int32_t*>(ids.data()), 2, s, {1 << 20, 1});
  CHECK(r.status().code() == ErrorCode::not_supported);
  CHECK(std::string(r.status().message()).find("host-planned") != std::string::npos);
  check_stats_equal(before, row.stats());
}

TEST_CASE("make_expert_cache: every bad name is refused, naming the valid ones, with nothing allocated") {
  constexpr std::array<std::string_view, 9> policies = {"lru",      "lfru", "sieve",      "s3fifo", "arc",
                                                        "wtinylfu", "lrfu", "layershare", "crf"};
  struct Bad {
    const char* what;
    AnyCacheConfig config;
    ErrorCode code;
    std::vector<std::string_view> named;  // every one must appear in the message
  };
  const AnyCacheConfig good = config_of("row", "", "", "", 16, 4, 2);
  std::vector<Bad> cases;
  const auto with = [&](auto edit) {
    AnyCacheConfig c = good;
    edit(c);
    return c;
  };
  cases.push_back({"provider", with([](auto& c) { c.provider = "rows"; }), ErrorCode::invalid_argument, {"row", "cached", "device"}});
  cases.push_back({"empty provider", with([](auto& c) { c.provider = ""; }), ErrorCode::invalid_argument, {"row", "cached", "device"}});
  cases.push_back({"policy", with([](auto& c) { c.policy = "LRU"; }), ErrorCode::invalid_argument, {policies.begin(), policies.end()}});
  {
    std::vector<std::string_view> named(policies.begin(), policies.end());
    named.push_back("offline");
    cases.push_back({"belady", with([](auto& c) { c.policy = "belady"; }), ErrorCode::invalid_argument, named});
  }
  cases.push_back({"staging", with([](auto& c) { c.staging = "async"; }), ErrorCode::invalid_argument, {"inline", "copy_stream", "batched"}});
  cases.push_back({"gather on SimRuntime", with([](auto& c) { c.staging = "gather"; }), ErrorCode::invalid_argument,
                   {"CUDA", "inline", "copy_stream", "batched"}});
  cases.push_back({"storage", with([](auto& c) { c.storage = "blob"; }), ErrorCode::invalid_argument, {"tensor_major", "expert_major"}});
  cases.push_back({"device with a policy", with([](auto& c) { c.provider = "device"; c.policy = "sieve"; c.max_ids = 8; }),
                   ErrorCode::invalid_argument, {"sieve", "lru", "lfru", "crf"}});
  cases.push_back({"device with an unknown policy", with([](auto& c) { c.provider = "device"; c.policy = "fifo"; c.max_ids = 8; }),
                   ErrorCode::invalid_argument, {"fifo", "lru", "lfru", "crf"}});
  cases.push_back({"device lfru on expert_major",
                   with([](auto& c) { c.provider = "device"; c.policy = "lfru"; c.storage = "expert_major"; c.max_ids = 8; }),
                   ErrorCode::invalid_argument, {"lfru", "tensor_major only", "expert_major"}});
  cases.push_back({"device with negative stream slots",
                   with([](auto& c) { c.provider = "device"; c.max_ids = 8; c.options.stream_slots = -2; }),
                   ErrorCode::invalid_argument, {"stream_slots", "-2"}});
  cases.push_back({"device with a staging", with([](auto& c) { c.provider = "device"; c.staging = "copy_stream"; c.max_ids = 8; }),
                   ErrorCode::invalid_argument, {"lru", "inline"}});
  cases.push_back({"device without max_ids", with([](auto& c) { c.provider = "device"; }), ErrorCode::invalid_argument, {"max_ids"}});
  cases.push_back({"overlap with a host provider", with([](auto& c) { c.overlap = true; }), ErrorCode::invalid_argument,
                   {"overlap", "provider 'device'", "'row'"}});
  cases.push_back({"lookahead with a host provider", with([](auto& c) { c.provider = "cached"; c.lookahead = true; }),
                   ErrorCode::invalid_argument, {"lookahead", "provider 'device'", "'cached'"}});
  cases.push_back({"layout that does not validate",
                   with([](auto& c) { c.layout.validation = Status(ErrorCode::invalid_argument, "k not a multiple of 64"); }),
                   ErrorCode::invalid_argument, {"multiple of 64"}});
  cases.push_back({"dense_bf16 without sizes", with([](auto& c) { c.layout = AnyLayout::of(DenseBf16{}); }),
                   ErrorCode::invalid_argument, {"dense_bf16", "hidden"}});
  cases.push_back({"empty layout", with([](auto& c) { c.layout = AnyLayout::explicit_bytes({}); }), ErrorCode::invalid_argument,
                   {"non-zero size"}});
  cases.push_back({"capacity above num_experts", with([](auto& c) { c.options.capacity = 17; }), ErrorCode::invalid_capacity,
                   {"capacity"}});
  cases.push_back({"top_k above capacity", with([](auto& c) { c.options.top_k = 5; }), ErrorCode::invalid_capacity, {"top_k"}});

  for (Bad& b : cases) {
    CAPTURE(b.what);
    SimRuntime rt(sim_options());
    int log_lines = 0;
    b.config.options.log = [&](std::string_view) { ++log_lines; };
    const SimCounters before = rt.counters();
    auto made = make_expert_cache(rt, b.config);
    REQUIRE(!made.ok());
    CHECK(made.status().code() == b.code);
    const std::string message(made.status().message());
    CAPTURE(message);
    for (std::string_view n : b.named) CHECK(message.find(n) != std::string::npos);
    CHECK(rt.allocated_bytes() == 0);  // nothing allocated, or everything given back
    CHECK(rt.counters() == before);
    CHECK(log_lines == 0);
  }

  // The good config builds, logs one line naming the choices, and frees everything on destruction.
  SimRuntime rt(sim_options());
  std::vector<std::string> lines;
  AnyCacheConfig c = good;
  c.layout = AnyLayout::of(DenseBf16{.hidden = 16, .intermediate = 8});
  c.options.log = [&](std::string_view l) { lines.emplace_back(l); };
  c.options.label = "layer0";
  {
    auto made = make_expert_cache(rt, c);
    REQUIRE(made.ok());
    CHECK(rt.allocated_bytes() != 0);
    REQUIRE(lines.size() == 1);
    CHECK(lines[0].find("layer0: row provider, lru/copy_stream/tensor_major/dense_bf16") == 0);
    CHECK(made.value().layout() == "dense_bf16");
  }
  CHECK(rt.allocated_bytes() == 0);
}

TEST_CASE("AnyExpertCache: the view's pointers are the cache's; prepare allocates no more than the static cache") {
  constexpr std::int32_t E = 64, C = 16, K = 4;
  SimRuntime rs(sim_options()), ra(sim_options());
  const Stream ss = rs.create_stream().value(), sa = ra.create_stream().value();
  WholeExpertCache<SimRuntime, ExplicitLayout> ref(rs, quiet_options(E, C, K), six_tensor_layout());
  auto made = make_expert_cache(ra, config_of("cached", "", "", "", E, C, K));
  REQUIRE(made.ok());
  AnySim any = std::move(made.value());
  const Ids hit = {3, 9, 12, 40};
  auto v = any.prepare(hit, sa);
  REQUIRE(v.ok());
  CHECK(v.value().expert_map == any.forward_map_device());
  CHECK(v.value().resident_map == any.resident_map_device());
  for (std::size_t t = 0; t < num_expert_tensors; ++t) CHECK(v.value().tensors[t].base == any.slot_tensor(t).base);
  REQUIRE(ref.prepare(hit, ss).ok());
  rs.drain();
  ra.drain();

  // All-hit and miss forwards: the erased call adds no allocation to what the prepare (and
  // SimRuntime's op queue) makes.
  const auto count = [&hit](auto& cache, SimRuntime& rt, Stream s, bool misses) {
    std::uint64_t allocs = 0;
    for (int i = 0; i < 64; ++i) {
      Ids ids = hit;
      if (misses) ids = {(i * 4) % E, (i * 4 + 1) % E, (i * 4 + 2) % E, (i * 4 + 3) % E};
      const std::uint64_t a = g_allocations.load();
      auto r = cache.prepare(ids, s);
      allocs += g_allocations.load() - a;
      REQUIRE(r.ok());
      rt.drain();
    }
    return allocs;
  };
  CHECK(count(any, ra, sa, false) == count(ref, rs, ss, false));
  CHECK(count(any, ra, sa, true) == count(ref, rs, ss, true));
}

// The factory names the storage arrangement and the device policy for the one construction it
// runs (detail::AnyChoiceScope); outside it the erased storage and device executor refuse to be
// built, before allocating anything, and inside it they build the chosen one.
TEST_CASE("make_expert_cache: the erased storage and device executor take the factory's choice, and only there") {
  constexpr std::int32_t E = 16, C = 4;
  SimRuntime rt(sim_options());
  const ExpertTensorBytes tensors = six_tensor_layout().tensors();
  const auto refused_outside = [&](const char* when) {
    INFO(when);
    const std::size_t before = rt.allocated_bytes();
    try {
      detail::AnyArrangementStorage<SimRuntime> s(rt, CacheShape{E, C}, tensors);
      FAIL("the erased storage was built outside make_expert_cache");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::internal);
      CHECK(std::string(e.what()).find("make_expert_cache") != std::string::npos);
    }
    DeviceCacheOptions o;
    o.num_experts = E;
    o.capacity = C;
    o.max_ids = 8;
    try {
      detail::AnyDevicePlanExecutor<SimRuntime> x(rt, E, C, 8, CopyRegions{}, o);
      FAIL("the erased device executor was built outside make_expert_cache");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::internal);
    }
    CHECK(rt.allocated_bytes() == before);
  };
  refused_outside("before any factory call");
  {
    AnyCacheConfig c = config_of("device", "crf", "", "tensor_major", E, C, 1);
    c.max_ids = 8;
    auto made = make_expert_cache(rt, c);
    REQUIRE(made.ok());
    CHECK(made.value().policy() == "crf");
  }
  refused_outside("after a factory call");

  // Inside a scope the storage is the chosen arrangement: tensor-major has a copy region per
  // present tensor, expert-major one (the whole blob), expert-major-host one per tensor again
  // but strided by the blob on the host.
  for (std::size_t arrangement = 0; arrangement < 3; ++arrangement) {
    detail::AnyChoice choice;
    choice.storage = arrangement;
    const detail::AnyChoiceScope scope(choice);
    detail::AnyArrangementStorage<SimRuntime> s(rt, CacheShape{E, C}, tensors);
    const std::size_t present = static_cast<std::size_t>(
        std::count_if(tensors.begin(), tensors.end(), [](const TensorBytes& t) { return t.bytes_per_expert != 0; }));
    CHECK(s.copy_regions().count == (arrangement == 1 ? 1 : present));
    const std::size_t blob = ExpertMajorStorage<SimRuntime>::blob_layout(tensors).blob_bytes;
    CHECK(s.copy_regions().regions[0].host_stride == (arrangement == 0 ? tensors[0].bytes_per_expert : blob));
    CHECK(s.host_tensor(0, 1) - s.host_tensor(0, 0) == static_cast<std::ptrdiff_t>(s.copy_regions().regions[0].host_stride));
  }

  // Inside a scope the device executor plans with the chosen policy (the state names it). It has
  // no overlapped fill (AnyCacheConfig has no overlap): overlap is refused, nothing kept.
  for (std::size_t policy = 0; policy < 3; ++policy) {
    detail::AnyChoice choice;
    choice.device_policy = policy;
    const detail::AnyChoiceScope scope(choice);
    DeviceCacheOptions o;
    o.num_experts = E;
    o.capacity = C;
    o.max_ids = 8;
    {
      detail::AnyDevicePlanExecutor<SimRuntime> x(rt, E, C, 8, CopyRegions{}, o);
      CHECK(x.state().policy == std::array{DevicePolicyKind::lru, DevicePolicyKind::lfru, DevicePolicyKind::crf}[policy]);
      CHECK_FALSE(x.overlap());
    }
    o.overlap = true;
    const std::size_t before = rt.allocated_bytes();
    try {
      detail::AnyDevicePlanExecutor<SimRuntime> x(rt, E, C, 8, CopyRegions{}, o);
      FAIL("the erased device executor took overlap");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      CHECK(std::string(e.what()).find("overlap") != std::string::npos);
    }
    CHECK(rt.allocated_bytes() == before);
  }
}
