// CacheBridge (python/src/bridge.hpp, the torch-free core of the PyTorch extension) on
// SimRuntime, driven as the extension drives it: caller host tensors adopted without a copy,
// every bad input refused with a specific message before the cache is touched (nothing
// allocated or registered, stats and maps unchanged), slot descriptors that describe the
// layout's slot arrays exactly, results equal to the static caches on the same ids, and the
// device provider on device ids; the fill engine and stored link profile of the device provider
// parsed, checked and reported as the cache resolves them; scored prefetches (hints below
// min_score skipped and counted, the rest highest score first, every provider) and their bad
// scores and min_scores refused with the library's message, nothing changed.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <random>
#include <string>
#include <vector>

#include "bridge.hpp"
#include "expert_cache/expert_cache.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

using namespace expert_cache;
using namespace expert_cache::python;
using Stream = SimRuntime::Stream;
using Bridge = CacheBridge<SimRuntime>;

namespace {

SimRuntime::Options sim_options() {
  return SimRuntime::Options{.memory_limit = std::size_t{1} << 30, .seed = 5, .max_races = 64, .max_streams = 64};
}

std::byte weight_byte(std::size_t t, std::int64_t e, std::size_t i) noexcept {
  std::uint64_t x = (t + 3) * 0x9E3779B97F4A7C15ull ^ static_cast<std::uint64_t>(e + 11) * 0xBF58476D1CE4E5B9ull ^
                    i * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<std::byte>(x & 0xFF);
}

// An engine's host weights: one 64-byte aligned [E, bytes] array per tensor (plus 64 spare
// bytes, so a misaligned span of the right size can be taken from it).
struct HostWeights {
  struct alignas(64) Line {
    std::byte b[64];
  };
  std::vector<std::vector<Line>> lines;
  std::vector<HostTensorArg> args;

  HostWeights(const std::vector<std::pair<std::string, std::size_t>>& tensors, std::int32_t experts, DType dtype = DType::uint8) {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const std::size_t bytes = static_cast<std::size_t>(experts) * tensors[t].second;
      lines.emplace_back((bytes + 64) / 64 + 1);
      for (std::size_t i = 0; i < bytes; ++i)
        data(t)[i] = weight_byte(t, static_cast<std::int64_t>(i / tensors[t].second), i % tensors[t].second);
      args.push_back(HostTensorArg{tensors[t].first, data(t), bytes, dtype, {}});
    }
  }
  [[nodiscard]] std::byte* data(std::size_t t) noexcept { return lines[t].data()->b; }
};

BridgeConfig dense_config(std::string provider, std::int32_t experts, std::int32_t capacity, std::int32_t top_k) {
  BridgeConfig c;
  c.layout.name = "dense_bf16";
  c.layout.hidden = 16;
  c.layout.intermediate = 8;
  c.provider = std::move(provider);
  c.num_experts = experts;
  c.capacity = capacity;
  c.top_k = top_k;
  c.label = "layer0";
  return c;
}

// DenseBf16{16, 8}: w13 [16, 16] bf16 = 512 bytes, w2 [16, 8] bf16 = 256 bytes per expert.
const std::vector<std::pair<std::string, std::size_t>> dense_tensors = {{"w13", 512}, {"w2", 256}};

// Everything a caller can observe: stats, host maps and (after draining) the device maps.
struct Snapshot {
  std::vector<std::pair<std::string, std::int64_t>> stats;
  std::vector<std::int32_t> forward_host, resident_host, forward_device, resident_device;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

Snapshot snapshot(SimRuntime& rt, Bridge& b) {
  rt.drain();
  Snapshot s;
  for (const StatEntry& e : b.stats()) s.stats.emplace_back(e.name, e.is_float ? static_cast<std::int64_t>(e.float_value * 1e9) : e.int_value);
  const auto fh = b.expert_map_host();
  const auto rh = b.resident_map_host();
  s.forward_host.assign(fh.begin(), fh.end());
  s.resident_host.assign(rh.begin(), rh.end());
  const auto n = static_cast<std::size_t>(b.config().num_experts);
  const auto* fd = reinterpret_cast<const std::int32_t*>(b.expert_map_device());
  const auto* rd = reinterpret_cast<const std::int32_t*>(b.resident_map_device());
  s.forward_device.assign(fd, fd + n);
  s.resident_device.assign(rd, rd + n);
  return s;
}

// Each resident expert's slot holds its host bytes, for every tensor.
void check_slots_hold_host_bytes(SimRuntime& rt, Bridge& b, HostWeights& w) {
  rt.drain();
  const auto* rd = reinterpret_cast<const std::int32_t*>(b.resident_map_device());
  std::int32_t checked = 0;
  for (std::int32_t e = 0; e < b.config().num_experts; ++e) {
    const std::int32_t slot = rd[e];
    if (slot < 0) continue;
    ++checked;
    for (std::size_t t = 0; t < b.slots().size(); ++t) {
      const SlotDescriptor& d = b.slots()[t];
      const auto* dev = reinterpret_cast<const std::byte*>(d.base + static_cast<std::size_t>(slot) * d.slot_stride);
      REQUIRE(std::equal(dev, dev + d.bytes_per_slot, w.data(t) + static_cast<std::size_t>(e) * d.bytes_per_slot));
    }
  }
  CHECK(checked > 0);
}

}  // namespace

TEST_CASE("CacheBridge: caller host tensors are adopted in place (registered at exact size, never copied)") {
  constexpr std::int32_t E = 12, C = 4, K = 2;
  for (const char* provider : {"row", "cached", "device"}) {
    CAPTURE(provider);
    SimRuntime rt(sim_options());
    HostWeights w(dense_tensors, E, DType::bfloat16);
    BridgeConfig c = dense_config(provider, E, C, K);
    c.max_ids = 8;
    auto made = Bridge::create(rt, c, w.args);
    REQUIRE(made.ok());
    Bridge& b = *made.value();
    CHECK(b.storage() == "tensor_major");  // cached: tensor_major with caller tensors
    CHECK(b.provider() == provider);
    for (std::size_t t = 0; t < 2; ++t) {
      CHECK(rt.is_registered(w.data(t), w.args[t].bytes));
      for (std::int64_t e : {0, 5, E - 1}) {
        const auto p = b.host_pointer(w.args[t].name, e);
        REQUIRE(p.ok());
        CHECK(p.value() == reinterpret_cast<std::uintptr_t>(w.data(t) + static_cast<std::size_t>(e) * dense_tensors[t].second));
      }
      CHECK(b.cache().copy_regions().regions[t].host_base == w.data(t));
    }
    CHECK(rt.registered_ranges() == 2);
    CHECK(!b.host_pointer("w13", E).ok());
    CHECK(b.host_pointer("w3", 0).status().message().find("unknown tensor 'w3'") != std::string_view::npos);
  }
  SUBCASE("host_registered: the caller's pinned memory is not registered again") {
    SimRuntime rt(sim_options());
    HostWeights w(dense_tensors, E);
    BridgeConfig c = dense_config("row", E, C, K);
    c.host_registered = true;
    auto made = Bridge::create(rt, c, w.args);
    REQUIRE(made.ok());
    CHECK(rt.registered_ranges() == 0);
  }
}

TEST_CASE("CacheBridge: bad configs and host tensors are refused with a specific message, nothing allocated") {
  constexpr std::int32_t E = 6, C = 3, K = 2;
  const auto refuse = [&](const BridgeConfig& c, const std::vector<HostTensorArg>& args, const std::string& expected) {
    SimRuntime rt(sim_options());
    auto made = Bridge::create(rt, c, args);
    REQUIRE(!made.ok());
    CHECK(made.status().code() == ErrorCode::invalid_argument);
    const std::string m(made.status().message());
    INFO("message: " << m);
    CHECK(m.find(expected) != std::string::npos);
    CHECK(rt.allocated_bytes() == 0);
    CHECK(rt.registered_ranges() == 0);
  };
  HostWeights w(dense_tensors, E, DType::bfloat16);
  const BridgeConfig good = dense_config("row", E, C, K);
  {
    SimRuntime rt(sim_options());
    REQUIRE(Bridge::create(rt, good, w.args).ok());  // the base case is accepted
  }
  SUBCASE("wrong size") {
    auto a = w.args;
    a[1].bytes -= 2;
    refuse(good, a, "host tensor 'w2' has 1534 bytes, expected exactly 1536 (6 experts * 256 bytes)");
  }
  SUBCASE("misaligned") {
    auto a = w.args;
    a[0].data = w.data(0) + 8;
    refuse(good, a, "host tensor 'w13' is not 16-byte aligned");
  }
  SUBCASE("null pointer") {
    auto a = w.args;
    a[0].data = nullptr;
    refuse(good, a, "host tensor 'w13' is a null pointer");
  }
  SUBCASE("unknown tensor name") {
    auto a = w.args;
    a.push_back(HostTensorArg{"w13_scale", w.data(0), 16, DType::uint8, {}});
    refuse(good, a, "unknown host tensor 'w13_scale' (layout dense_bf16 has: w13, w2)");
  }
  SUBCASE("missing tensor") {
    auto a = w.args;
    a.pop_back();
    refuse(good, a, "host tensor 'w2' missing (layout dense_bf16 needs: w13, w2)");
  }
  SUBCASE("tensor given twice") {
    auto a = w.args;
    a.push_back(a[0]);
    refuse(good, a, "host tensor 'w13' given twice");
  }
  SUBCASE("dtype") {
    auto a = w.args;
    a[0].dtype = DType::float32;
    refuse(good, a, "host tensor 'w13' has dtype float32, expected bfloat16 (or uint8 bytes)");
  }
  SUBCASE("shape") {
    auto a = w.args;
    a[1].shape = {E, 8, 16};  // [E, N, K] instead of [E, K, N]
    refuse(good, a, "host tensor 'w2' has shape [6, 8, 16], expected [6, 16, 8]");
  }
  SUBCASE("pinned and pageable tensors mixed") {
    auto a = w.args;
    a[0].pinned = true;
    refuse(good, a, "host tensors must be all pinned (pin_memory()) or all pageable; got a mix");
  }
  SUBCASE("a wrong shape is reported before the mix") {
    auto a = w.args;
    a[0].pinned = true;
    a[1].shape = {E, 8, 16};
    refuse(good, a, "host tensor 'w2' has shape [6, 8, 16], expected [6, 16, 8]");
  }
  SUBCASE("unknown provider") {
    BridgeConfig c = good;
    c.provider = "rows";
    refuse(c, w.args, "unknown provider 'rows' (valid: row, cached, device)");
  }
  SUBCASE("unknown policy") {
    BridgeConfig c = good;
    c.policy = "fifo";
    refuse(c, w.args, "unknown eviction policy 'fifo'");
  }
  SUBCASE("expert-major storage with caller tensors") {
    BridgeConfig c = good;
    c.storage = "expert_major";
    refuse(c, w.args, "need storage 'tensor_major'");
  }
  SUBCASE("unknown layout") {
    BridgeConfig c = good;
    c.layout.name = "dense_fp8";
    refuse(c, w.args, "unknown layout 'dense_fp8' (valid: dense_bf16, nvfp4_marlin, explicit)");
  }
  SUBCASE("layout sizes") {
    BridgeConfig c = good;
    c.layout.hidden = 0;
    refuse(c, w.args, "dense_bf16: hidden and intermediate must be in [1, 2^24]");
  }
  SUBCASE("nvfp4 group size") {
    BridgeConfig c = good;
    c.layout = LayoutConfig{"nvfp4_marlin", 128, 64, 32, {}};
    refuse(c, w.args, "group_size must be 16");
  }
  SUBCASE("capacity") {
    BridgeConfig c = good;
    c.capacity = E + 1;
    SimRuntime rt(sim_options());
    auto made = Bridge::create(rt, c, w.args);
    REQUIRE(!made.ok());
    CHECK(rt.allocated_bytes() == 0);
    CHECK(rt.registered_ranges() == 0);
  }
  SUBCASE("num_experts") {
    BridgeConfig c = good;
    c.num_experts = 0;
    refuse(c, w.args, "num_experts 0");
  }
  SUBCASE("device provider without max_ids") {
    BridgeConfig c = good;
    c.provider = "device";
    refuse(c, w.args, "needs max_ids > 0");
  }
}

TEST_CASE("CacheBridge: rejected calls leave the cache unchanged (stats and maps)") {
  constexpr std::int32_t E = 10, C = 4, K = 2;
  SimRuntime rt(sim_options());
  const Stream s = rt.create_stream().value();
  HostWeights w(dense_tensors, E);
  auto made = Bridge::create(rt, dense_config("row", E, C, K), w.args);
  REQUIRE(made.ok());
  Bridge& b = *made.value();
  REQUIRE(b.prepare(std::vector<std::int32_t>{1, 2, 3, 1}, s).ok());
  const Snapshot before = snapshot(rt, b);
  const auto refused = [&](const Status& st, const std::string& expected) {
    REQUIRE(!st.ok());
    const std::string m(st.message());
    INFO("message: " << m);
    CHECK(m.find(expected) != std::string::npos);
    CHECK(snapshot(rt, b) == before);
  };
  refused(b.prepare(std::vector<std::int32_t>{0, E}, s).status(), "topk_ids[1] = 10 out of range (num_experts 10)");
  refused(b.prepare(std::vector<std::int64_t>{2, std::int64_t{1} << 40}, s).status(), "topk_ids[1] = 1099511627776 out of range");
  refused(b.prepare(std::vector<std::int32_t>{0, 4, 5, 6, 7}, s).status(), "");  // 5 unique experts > 4 slots
  refused(b.invalidate(-1, s), "invalidate(-1): expert out of range [0, 10)");
  refused(b.invalidate(E, s), "invalidate(10)");
  refused(b.prepare_device(nullptr, 0, s).status(), "prepare_device needs provider 'device'");
  // Negative ids are padding (the planner's rule), for both id widths.
  const auto r = b.prepare(std::vector<std::int64_t>{-1, 2, -7, 3}, s);
  REQUIRE(r.ok());
  CHECK(r.value().has_counts);
  CHECK(r.value().hits == 2);
  CHECK(r.value().misses == 0);
  CHECK(r.value().generation == 2);
}

TEST_CASE("CacheBridge: slot descriptors describe the layout's slot arrays") {
  constexpr std::int32_t E = 6, C = 3;
  const auto check = [&](Bridge& b, const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& expected,
                        const std::vector<DType>& dtypes) {
    REQUIRE(b.slots().size() == expected.size());
    for (std::size_t t = 0; t < expected.size(); ++t) {
      const SlotDescriptor& d = b.slots()[t];
      CAPTURE(d.name);
      CHECK(d.name == expected[t].first);
      CHECK(d.shape == expected[t].second);
      CHECK(d.dtype == dtypes[t]);
      CHECK(d.capacity == C);
      CHECK(static_cast<std::size_t>(python::detail::product(d.shape)) * element_size(d.dtype) == d.bytes_per_slot);
      const SlotTensor st = b.cache().slot_tensor(d.index);
      CHECK(d.base == reinterpret_cast<std::uintptr_t>(st.base));
      CHECK(d.slot_stride == st.slot_stride);
      CHECK(d.bytes_per_slot == st.bytes);
      CHECK(d.slot_stride == d.bytes_per_slot);  // tensor_major: contiguous [C, ...]
      CHECK(d.slot_stride % element_size(d.dtype) == 0);
      CHECK(d.base % 16 == 0);
    }
  };
  SUBCASE("dense_bf16: w13 [2N, K], w2 [K, N] bf16") {
    SimRuntime rt(sim_options());
    HostWeights w(dense_tensors, E, DType::bfloat16);
    auto made = Bridge::create(rt, dense_config("row", E, C, 1), w.args);
    REQUIRE(made.ok());
    check(*made.value(), {{"w13", {16, 16}}, {"w2", {16, 8}}}, {DType::bfloat16, DType::bfloat16});
  }
  SUBCASE("nvfp4_marlin: the Marlin shapes (K=128, N=96 -> Np=128)") {
    const Nvfp4Marlin m{128, 96, ActDtype::bf16};
    REQUIRE(m.padded_intermediate() == 128);
    std::vector<std::pair<std::string, std::size_t>> t;
    for (std::size_t i = 0; i < 6; ++i) t.emplace_back(std::string(m.tensors()[i].name), m.tensors()[i].bytes_per_expert);
    SimRuntime rt(sim_options());
    HostWeights w(t, E);  // uint8 byte views of the repacked tensors
    BridgeConfig c = dense_config("cached", E, C, 1);
    c.layout = LayoutConfig{"nvfp4_marlin", 128, 96, 16, {}};
    auto made = Bridge::create(rt, c, w.args);
    REQUIRE(made.ok());
    check(*made.value(),
          {{"w13", {8, 512}}, {"w2", {8, 256}}, {"w13_scale", {8, 256}}, {"w2_scale", {8, 128}}, {"w13_scale_2", {1}}, {"w2_scale_2", {1}}},
          {DType::int32, DType::int32, DType::uint8, DType::uint8, DType::float32, DType::float32});
    // Raw bytes may come as [E, bytes per expert] uint8 (what a repack writes), also for the scales
    // whose typed dtype is uint8; a uint8 tensor of another shape is still checked against the typed one.
    auto flat = w.args;
    for (std::size_t i = 0; i < flat.size(); ++i) {
      flat[i].shape = {E, static_cast<std::int64_t>(t[i].second)};
    }
    SimRuntime rt_flat(sim_options());
    auto flat_made = Bridge::create(rt_flat, c, flat);
    REQUIRE_MESSAGE(flat_made.ok(), std::string(flat_made.status().message()));
    auto wrong = flat;
    wrong[2].shape = {E, 4, 512};  // w13_scale: uint8, 2048 bytes, but not [E, 8, 256]
    SimRuntime rt_wrong(sim_options());
    auto wrong_made = Bridge::create(rt_wrong, c, wrong);
    REQUIRE(!wrong_made.ok());
    CHECK(std::string(wrong_made.status().message()).find("host tensor 'w13_scale' has shape [6, 4, 512], expected [6, 8, 256]") !=
          std::string::npos);
  }
  SUBCASE("explicit: uint8 [bytes]") {
    const std::vector<std::pair<std::string, std::size_t>> t = {{"qweight", 96}, {"bias", 32}, {"g_idx", 48}};
    SimRuntime rt(sim_options());
    HostWeights w(t, E, DType::other);
    BridgeConfig c = dense_config("row", E, C, 1);
    c.layout = LayoutConfig{"explicit", 0, 0, 16, t};
    auto made = Bridge::create(rt, c, w.args);
    REQUIRE(made.ok());
    check(*made.value(), {{"qweight", {96}}, {"bias", {32}}, {"g_idx", {48}}}, {DType::uint8, DType::uint8, DType::uint8});
    // Explicit layouts refuse names twice and empty lists.
    BridgeConfig twice = c;
    twice.layout.tensors.push_back({"bias", 16});
    SimRuntime rt2(sim_options());
    auto bad = Bridge::create(rt2, twice, w.args);
    REQUIRE(!bad.ok());
    CHECK(std::string(bad.status().message()).find("tensor 'bias' named twice") != std::string::npos);
  }
}

TEST_CASE("CacheBridge: results equal the static caches on the same ids; slots hold the mapped experts' bytes") {
  constexpr std::int32_t E = 16, C = 5, K = 2;
  const DenseBf16 layout{16, 8};
  const auto run = [&]<class Static>(const char* provider, std::uint64_t seed) {
    CAPTURE(provider);
    SimRuntime rb(sim_options()), rs(sim_options());
    const Stream sb = rb.create_stream().value(), ss = rs.create_stream().value();
    HostWeights wb(dense_tensors, E, DType::bfloat16), ws(dense_tensors, E, DType::bfloat16);
    auto made = Bridge::create(rb, dense_config(provider, E, C, K), wb.args);
    REQUIRE(made.ok());
    Bridge& b = *made.value();
    CacheOptions o;
    o.num_experts = E;
    o.capacity = C;
    o.top_k = K;
    o.label = "layer0";
    o.memory.host_tensors[0] = MemorySpan{ws.data(0), ws.args[0].bytes};
    o.memory.host_tensors[1] = MemorySpan{ws.data(1), ws.args[1].bytes};
    Static ref(rs, o, layout);
    std::mt19937_64 rng(seed);
    for (int step = 0; step < 200; ++step) {
      std::vector<std::int64_t> ids;
      const auto n = 1 + static_cast<std::int32_t>(rng() % 6);
      for (std::int32_t i = 0; i < n; ++i) ids.push_back(static_cast<std::int64_t>(rng() % (E + 1)) - 1);  // -1: padding
      std::vector<std::int32_t> ids32(ids.begin(), ids.end());
      if (step % 9 == 4) {
        const auto e = static_cast<std::int32_t>(rng() % E);
        REQUIRE(b.invalidate(e, sb).ok() == ref.invalidate(e, ss).ok());
      }
      const auto x = ref.prepare(ids32, ss);
      const auto y = step % 2 == 0 ? b.prepare(ids, sb) : b.prepare(std::span<const std::int32_t>(ids32), sb);
      REQUIRE(x.ok() == y.ok());
      if (x.ok()) {
        CHECK(x.value().hits == y.value().hits);
        CHECK(x.value().misses == y.value().misses);
        CHECK(x.value().generation == y.value().generation);
      } else {
        CHECK(x.status().message() == y.status().message());
      }
      rb.drain();
      rs.drain();
      const auto* fd = reinterpret_cast<const std::int32_t*>(b.expert_map_device());
      const auto* rd = reinterpret_cast<const std::int32_t*>(b.resident_map_device());
      for (std::int32_t e = 0; e < E; ++e) {
        REQUIRE(fd[e] == ref.forward_map_device()[e]);
        REQUIRE(rd[e] == ref.resident_map_device()[e]);
        REQUIRE(b.expert_map_host()[static_cast<std::size_t>(e)] == ref.forward_map_host()[static_cast<std::size_t>(e)]);
      }
      if (step % 20 == 0) check_slots_hold_host_bytes(rb, b, wb);
    }
    const CacheStats rstats = ref.stats();
    const auto bstats = b.stats();
    const auto get = [&](const char* name) {
      for (const StatEntry& e : bstats)
        if (e.name == name) return e.int_value;
      FAIL("no stat " << name);
      return std::int64_t{-1};
    };
    CHECK(get("hits") == static_cast<std::int64_t>(rstats.hits));
    CHECK(get("misses") == static_cast<std::int64_t>(rstats.misses));
    CHECK(get("evictions") == static_cast<std::int64_t>(rstats.evictions));
    CHECK(get("invalidations") == static_cast<std::int64_t>(rstats.invalidations));
    CHECK(get("resident") == rstats.resident);
    CHECK(get("prepare_calls") == static_cast<std::int64_t>(rstats.prepare_calls));
    CHECK(get("total_copies") == static_cast<std::int64_t>(rstats.total_copies));
    CHECK(get("slot_bytes") == static_cast<std::int64_t>(rstats.slot_bytes));
    CHECK(get("host_bytes") == static_cast<std::int64_t>(rstats.host_bytes));
    // Every CacheStats field (26, all 8 bytes: a new field fails here; add it to CacheBridge::stats()) + hit_rate.
    static_assert(sizeof(CacheStats) == 26 * sizeof(std::uint64_t), "CacheStats changed: update CacheBridge::stats()");
    CHECK(bstats.size() == 27);
    CHECK(bstats.back().name == "hit_rate");
    CHECK(bstats.back().float_value == doctest::Approx(rstats.hit_rate()));
    CHECK(rstats.hits > 0);
    CHECK(rb.races().empty());
  };
  run.template operator()<ExpertCache<TensorMajorStorage, Lru, CopyStream, DenseBf16, SimRuntime>>("row", 21);
  run.template operator()<ExpertCache<TensorMajorStorage, Lfru, CopyStream, DenseBf16, SimRuntime>>("cached", 22);
}

TEST_CASE("CacheBridge: the device provider plans device ids (SimRuntime), as DeviceExpertCache") {
  constexpr std::int32_t E = 14, C = 4, max_ids = 6;
  SimRuntime rb(sim_options()), rs(sim_options());
  const Stream sb = rb.create_stream().value(), ss = rs.create_stream().value();
  HostWeights wb(dense_tensors, E, DType::bfloat16), ws(dense_tensors, E, DType::bfloat16);
  BridgeConfig c = dense_config("device", E, C, 1);
  c.max_ids = max_ids;
  auto made = Bridge::create(rb, c, wb.args);
  REQUIRE(made.ok());
  Bridge& b = *made.value();
  CHECK(b.device_provider());
  CHECK(b.expert_map_host().empty());
  DeviceCacheOptions o;
  o.num_experts = E;
  o.capacity = C;
  o.max_ids = max_ids;
  o.label = "layer0";
  o.memory.host_tensors[0] = MemorySpan{ws.data(0), ws.args[0].bytes};
  o.memory.host_tensors[1] = MemorySpan{ws.data(1), ws.args[1].bytes};
  DeviceExpertCache<TensorMajorStorage, DenseBf16, SimRuntime> ref(rs, o, DenseBf16{16, 8});
  RuntimeBuffer<SimRuntime> ids_b(rb, max_ids * sizeof(std::int32_t), MemoryKind::device);
  RuntimeBuffer<SimRuntime> ids_s(rs, max_ids * sizeof(std::int32_t), MemoryKind::device);
  const auto* dev_b = reinterpret_cast<const std::int32_t*>(ids_b.data());
  const auto* dev_s = reinterpret_cast<const std::int32_t*>(ids_s.data());

  // Host ids are refused: the device provider reads the router's output where it is.
  const auto host = b.prepare(std::vector<std::int32_t>{1}, sb);
  REQUIRE(!host.ok());
  CHECK(std::string(host.status().message()).find("takes device ids") != std::string::npos);

  std::mt19937_64 rng(31);
  for (int step = 0; step < 120; ++step) {
    std::vector<std::int32_t> ids;
    const auto n = 1 + static_cast<std::int32_t>(rng() % 3);  // <= C unique: one group
    for (std::int32_t i = 0; i < n; ++i) ids.push_back(static_cast<std::int32_t>(rng() % E));
    for (auto [rt, buf] : {std::pair{&rb, &ids_b}, std::pair{&rs, &ids_s}}) {
      rt->host_access(buf->data(), ids.size() * sizeof(std::int32_t), AccessMode::write);
      std::memcpy(buf->data(), ids.data(), ids.size() * sizeof(std::int32_t));
    }
    const auto x = ref.prepare(dev_s, n, ss);
    const auto y = b.prepare_device(dev_b, n, sb);
    REQUIRE(x.ok());
    REQUIRE(y.ok());
    CHECK(!y.value().has_counts);
    CHECK(y.value().generation == x.value().generation);
    rb.drain();
    rs.drain();
    REQUIRE(rb.synchronize(sb).ok());
    REQUIRE(rs.synchronize(ss).ok());
    const auto* fd = reinterpret_cast<const std::int32_t*>(b.expert_map_device());
    const auto* rd = reinterpret_cast<const std::int32_t*>(b.resident_map_device());
    for (std::int32_t e = 0; e < E; ++e) {
      REQUIRE(fd[e] == ref.forward_map_device()[e]);
      REQUIRE(rd[e] == ref.resident_map_device()[e]);
    }
    for (std::int32_t id : ids) REQUIRE(fd[id] >= 0);
    if (step % 30 == 0) check_slots_hold_host_bytes(rb, b, wb);
  }
  CHECK(b.device_errors() == 0);
  // Too many ids: refused, nothing changes.
  const Snapshot before = snapshot(rb, b);
  const auto big = b.prepare_device(dev_b, max_ids + 1, sb);
  REQUIRE(!big.ok());
  CHECK(std::string(big.status().message()).find("prepare of 7 ids (device provider: 0..max_ids = 6)") != std::string::npos);
  CHECK(snapshot(rb, b) == before);
  const CacheStats rstats = ref.stats();
  for (const StatEntry& e : b.stats()) {
    if (e.name == std::string("hits")) CHECK(e.int_value == static_cast<std::int64_t>(rstats.hits));
    if (e.name == std::string("misses")) CHECK(e.int_value == static_cast<std::int64_t>(rstats.misses));
  }
  CHECK(rstats.hits > 0);
  CHECK(rb.races().empty());
}

namespace {

// What the extension would see of one wide round, and a kernel-like reader of its slots.
struct WideSeen {
  std::vector<std::vector<std::int32_t>> experts;
  std::shared_ptr<std::uint64_t> mismatches = std::make_shared<std::uint64_t>(0);
  std::shared_ptr<std::uint64_t> reads = std::make_shared<std::uint64_t>(0);
};

Status read_wide_round(SimRuntime& rt, Stream s, const Bridge& b, const WideRoundInfo& info, HostWeights& w,
                       WideSeen& seen) {
  seen.experts.emplace_back(info.experts.begin(), info.experts.end());
  std::vector<Access> acc;
  std::vector<std::pair<std::int32_t, std::int32_t>> pairs;  // (expert, slot)
  for (std::size_t k = 0; k < info.experts.size(); ++k) {
    pairs.emplace_back(info.experts[k], info.slots[k]);
    for (std::size_t t = 0; t < b.slots().size(); ++t) {
      const SlotDescriptor& d = b.slots()[t];
      acc.push_back({reinterpret_cast<const std::byte*>(info.slot_bases[t] + static_cast<std::size_t>(info.slots[k]) * d.slot_stride),
                     d.bytes_per_slot, AccessMode::read});
    }
  }
  const auto n = static_cast<std::size_t>(b.config().num_experts);
  acc.push_back({reinterpret_cast<const std::int32_t*>(info.expert_map), n * sizeof(std::int32_t), AccessMode::read});
  std::vector<SlotDescriptor> descs = b.slots();
  std::vector<std::uintptr_t> bases = info.slot_bases;
  std::vector<const std::byte*> host;
  for (std::size_t t = 0; t < descs.size(); ++t) host.push_back(w.data(t));
  const auto* map = reinterpret_cast<const std::int32_t*>(info.expert_map);
  return rt.launch(s, acc, [pairs, descs, bases, host, map, mismatches = seen.mismatches, reads = seen.reads] {
    for (const auto& [e, slot] : pairs) {
      ++*reads;
      if (map[e] != slot) ++*mismatches;
      for (std::size_t t = 0; t < descs.size(); ++t) {
        const auto* dev = reinterpret_cast<const std::byte*>(bases[t] + static_cast<std::size_t>(slot) * descs[t].slot_stride);
        const std::byte* src = host[t] + static_cast<std::size_t>(e) * descs[t].bytes_per_slot;
        if (!std::equal(dev, dev + descs[t].bytes_per_slot, src)) ++*mismatches;
      }
    }
  });
}

// `host` ids in a device buffer of at least `count` ids (the device provider takes device ids).
RuntimeBuffer<SimRuntime> device_ids(SimRuntime& rt, const std::vector<std::int32_t>& host, std::size_t count) {
  RuntimeBuffer<SimRuntime> ids(rt, std::max(count, host.size()) * sizeof(std::int32_t), MemoryKind::device);
  rt.host_access(ids.data(), host.size() * sizeof(std::int32_t), AccessMode::write);
  std::memcpy(ids.data(), host.data(), host.size() * sizeof(std::int32_t));
  return ids;
}

// A kernel-like reader of a round's expert map: appends the experts it maps to `mapped`.
Status collect_mapped(SimRuntime& rt, Stream s, const WideRoundInfo& info, std::int32_t experts,
                      const std::shared_ptr<std::vector<std::int32_t>>& mapped) {
  const auto* map = reinterpret_cast<const std::int32_t*>(info.expert_map);
  const Access a{map, static_cast<std::size_t>(experts) * sizeof(std::int32_t), AccessMode::read};
  return rt.launch(s, std::span<const Access>(&a, 1), [map, mapped, n = experts] {
    for (std::int32_t e = 0; e < n; ++e) {
      if (map[e] >= 0) mapped->push_back(e);
    }
  });
}

}  // namespace

TEST_CASE("CacheBridge::prepare_wide: rounds over the stream slots, as the extension wraps them; bad input changes nothing") {
  constexpr std::int32_t E = 16, C = 4, K = 2, stream_slots = 4;
  SimRuntime rt(sim_options());
  const Stream s = rt.create_stream().value();
  HostWeights w(dense_tensors, E, DType::bfloat16);
  BridgeConfig c = dense_config("row", E, C, K);
  c.stream_slots = stream_slots;
  auto made = Bridge::create(rt, c, w.args);
  REQUIRE(made.ok());
  Bridge& b = *made.value();
  for (const SlotDescriptor& d : b.slots()) CHECK(d.capacity == C + stream_slots);  // the stream slots follow the pool
  REQUIRE(b.prepare(std::vector<std::int64_t>{1, 2}, s).ok());
  REQUIRE(b.prepare(std::vector<std::int64_t>{3, -1}, s).ok());
  const std::vector<std::int64_t> prompt = {0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, -1, 1, 2, 3, 4, 4};
  WideSeen seen;
  auto r = b.prepare_wide(prompt, s, [&](const WideRoundInfo& info) {
    CHECK(info.slot_count == C + stream_slots);
    // The round's own map: two buffers alternate (even rounds the persistent forward map, odd
    // rounds a second one), each written on the fill stream with its round's copies. The extension
    // wraps it per round, and read_wide_round reads every expert's slot through it.
    if (info.index % 2 == 0) {
      CHECK(info.expert_map == b.expert_map_device());
    } else {
      CHECK(info.expert_map != 0);
      CHECK(info.expert_map != b.expert_map_device());
    }
    CHECK(info.resident_map == b.resident_map_device());
    REQUIRE(info.slot_bases.size() == b.slots().size());
    for (std::size_t t = 0; t < b.slots().size(); ++t) CHECK(info.slot_bases[t] == b.slots()[t].base);
    REQUIRE(info.experts.size() == info.slots.size());
    return read_wide_round(rt, s, b, info, w, seen);
  });
  REQUIRE(r.ok());
  rt.drain();
  CHECK(r.value().admission == WideAdmission::stream);
  CHECK(r.value().unique == E);
  CHECK(r.value().hits == 3);  // 1, 2, 3 resident from the decode forwards
  CHECK(r.value().streamed == E - 3);
  CHECK(r.value().rounds == seen.experts.size());
  CHECK(r.value().rounds >= 4);
  std::vector<std::int32_t> all;
  for (const auto& round : seen.experts) all.insert(all.end(), round.begin(), round.end());
  std::sort(all.begin(), all.end());
  std::vector<std::int32_t> want(E);
  for (std::int32_t e = 0; e < E; ++e) want[static_cast<std::size_t>(e)] = e;
  CHECK(all == want);
  CHECK(*seen.reads == E);
  CHECK(*seen.mismatches == 0);
  CHECK(rt.races().empty());
  bool found = false;
  for (const StatEntry& e : b.stats()) {
    if (std::string(e.name) == "wide_streamed") {
      found = true;
      CHECK(e.int_value == E - 3);
    }
  }
  CHECK(found);

  // Refused before the cache is touched: nothing changes, the consumer never runs.
  int calls = 0;
  const auto count = [&](const WideRoundInfo&) {
    ++calls;
    return Status();
  };
  const Snapshot before = snapshot(rt, b);
  const auto bad_id = b.prepare_wide(std::vector<std::int64_t>{0, 3, E}, s, count);
  CHECK(bad_id.status().code() == ErrorCode::invalid_argument);
  CHECK(std::string(bad_id.status().message()).find("topk_ids[2] = 16 out of range") != std::string::npos);
  const auto bad_admission = b.prepare_wide(prompt, s, count, "scan");
  CHECK(std::string(bad_admission.status().message()).find("valid: stream, admit") != std::string::npos);
  const auto bad_copy = b.prepare_wide(prompt, s, count, "stream", "all");
  CHECK(std::string(bad_copy.status().message()).find("valid: automatic, runs, span") != std::string::npos);
  std::int32_t dummy = 0;
  const auto device_ids = b.prepare_wide_device(&dummy, 1, s, count);
  CHECK(std::string(device_ids.status().message()).find("needs provider 'device'") != std::string::npos);
  CHECK(calls == 0);
  CHECK(snapshot(rt, b) == before);

  // A consumer that fails or throws ends the forward with its message; the pool is unchanged.
  const auto failed = b.prepare_wide(prompt, s, [](const WideRoundInfo& info) {
    return info.index == 1 ? Status(ErrorCode::runtime_failure, "kernel launch failed") : Status();
  });
  CHECK(std::string(failed.status().message()).find("kernel launch failed") != std::string::npos);
  const auto threw = b.prepare_wide(prompt, s, [](const WideRoundInfo&) -> Status { throw std::runtime_error("python raised"); });
  CHECK(threw.status().code() == ErrorCode::runtime_failure);
  CHECK(std::string(threw.status().message()).find("python raised") != std::string::npos);
  rt.drain();
  CHECK(std::ranges::equal(b.resident_map_host(), before.resident_host));
}

TEST_CASE("CacheBridge::prepare_wide_device: the device provider's rounds (prepare + prepare_group), device ids") {
  constexpr std::int32_t E = 14, C = 4, max_ids = 16;
  SimRuntime rt(sim_options());
  const Stream s = rt.create_stream().value();
  HostWeights w(dense_tensors, E, DType::bfloat16);
  for (const char* policy : {"lru", "lfru", "crf"}) {
    CAPTURE(policy);
    BridgeConfig c = dense_config("device", E, C, 1);
    c.max_ids = max_ids;
    c.policy = policy;
    auto made = Bridge::create(rt, c, w.args);
    REQUIRE(made.ok());
    Bridge& b = *made.value();
    CHECK(b.policy() == policy);
    const std::vector<std::int32_t> host = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 12, -1, 0};  // 12 unique: 3 groups
    const RuntimeBuffer<SimRuntime> ids = device_ids(rt, host, max_ids);
    const auto* dev = reinterpret_cast<const std::int32_t*>(ids.data());
    auto mapped = std::make_shared<std::vector<std::int32_t>>();
    std::uint32_t rounds = 0;
    auto r = b.prepare_wide_device(dev, static_cast<std::int64_t>(host.size()), s, [&](const WideRoundInfo& info) {
      ++rounds;
      CHECK(info.experts.empty());
      CHECK(info.slot_count == C);
      return collect_mapped(rt, s, info, E, mapped);
    });
    REQUIRE(r.ok());
    rt.drain();
    CHECK(r.value().rounds == rounds);
    CHECK(rounds >= 3);
    std::sort(mapped->begin(), mapped->end());
    CHECK(*mapped == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13});
    const auto big = b.prepare_wide_device(dev, max_ids + 1, s, [](const WideRoundInfo&) { return Status(); });
    CHECK(std::string(big.status().message()).find("0..max_ids = 16") != std::string::npos);
    const auto host_ids = b.prepare_wide(std::vector<std::int64_t>{1}, s, [](const WideRoundInfo&) { return Status(); });
    CHECK(std::string(host_ids.status().message()).find("takes device ids") != std::string::npos);
    CHECK(rt.races().empty());
  }
}

TEST_CASE("CacheBridge::prepare_wide_device with stream slots: read back, streamed, the pool untouched") {
  constexpr std::int32_t E = 14, C = 4, max_ids = 4, stream_slots = 4;
  SimRuntime rt(sim_options());
  const Stream s = rt.create_stream().value();
  HostWeights w(dense_tensors, E, DType::bfloat16);
  BridgeConfig c = dense_config("device", E, C, 1);
  c.max_ids = max_ids;
  c.stream_slots = stream_slots;
  auto made = Bridge::create(rt, c, w.args);
  REQUIRE_MESSAGE(made.ok(), std::string(made.status().message()));
  Bridge& b = *made.value();
  for (const SlotDescriptor& d : b.slots()) CHECK(d.capacity == C + stream_slots);  // the stream slots follow the pool
  const std::vector<std::int32_t> host = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 12, -1, 0};  // 12 unique, more than max_ids
  const RuntimeBuffer<SimRuntime> ids = device_ids(rt, host, host.size());
  const auto* dev = reinterpret_cast<const std::int32_t*>(ids.data());
  auto mapped = std::make_shared<std::vector<std::int32_t>>();
  std::uint32_t rounds = 0;
  auto r = b.prepare_wide_device(dev, static_cast<std::int64_t>(host.size()), s, [&](const WideRoundInfo& info) {
    ++rounds;
    CHECK(info.slot_count == C + stream_slots);
    CHECK(info.experts.size() == info.slots.size());
    return collect_mapped(rt, s, info, E, mapped);
  });
  REQUIRE_MESSAGE(r.ok(), std::string(r.status().message()));
  rt.drain();
  CHECK(r.value().admission == WideAdmission::stream);
  CHECK(r.value().streamed == 12);  // an empty pool: every expert streamed, none admitted
  CHECK(r.value().rounds == rounds);
  CHECK(rounds == 6);  // halves of 2
  std::sort(mapped->begin(), mapped->end());
  CHECK(*mapped == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13});
  CHECK(r.value().hits == 0);
  // Admit admission keeps the bound of the device planner's groups.
  const auto big = b.prepare_wide_device(dev, static_cast<std::int64_t>(host.size()), s,
                                         [](const WideRoundInfo&) { return Status(); }, "admit");
  CHECK(std::string(big.status().message()).find("0..max_ids = 4") != std::string::npos);
  CHECK(rt.races().empty());
}

namespace {

// A complete profile of device 0 at the dense test layout's 768 bytes per expert, as a stored
// file holds it (LinkProfile::serialize).
LinkProfile stored_profile() {
  LinkProfile p;
  p.device = 0;
  p.device_name = "Test GPU";
  p.pci_bus_id = "0000:19:00.0";
  p.expert_bytes = 768;
  p.copy_engine_gbps_one = 40.5;
  p.copy_engine_gbps_batch = 50;
  p.copy_latency_us = 9.5;
  p.sm_load_gbps = 49.5;
  p.graph_fill_latency_us = 7;
  p.measure_ms = 80;
  return p;
}

}  // namespace

TEST_CASE("fill_engine_choice: engine names and stored profiles parsed, misplaced ones refused") {
  BridgeConfig c = dense_config("device", 6, 3, 1);
  SUBCASE("default: automatic, no profile") {
    const auto r = fill_engine_choice(c);
    REQUIRE(r.ok());
    CHECK(r.value().engine == FillEngine::automatic);
    CHECK(!r.value().profile);
  }
  SUBCASE("every engine by its name") {
    for (FillEngine e : {FillEngine::automatic, FillEngine::copy_engine, FillEngine::sm_loads}) {
      c.fill_engine = std::string(to_string(e));
      const auto r = fill_engine_choice(c);
      REQUIRE(r.ok());
      CHECK(r.value().engine == e);
    }
  }
  SUBCASE("a stored profile reads back equal") {
    c.link_profile = stored_profile().serialize();
    const auto r = fill_engine_choice(c);
    REQUIRE_MESSAGE(r.ok(), std::string(r.status().message()));
    REQUIRE(r.value().profile);
    CHECK(*r.value().profile == stored_profile());
  }
  const auto refused = [&](const BridgeConfig& bad, const std::string& expected) {
    const auto r = fill_engine_choice(bad);
    REQUIRE(!r.ok());
    CHECK(r.status().code() == ErrorCode::invalid_argument);
    const std::string m(r.status().message());
    INFO("message: " << m);
    CHECK(m.find(expected) != std::string::npos);
  };
  SUBCASE("unknown engine: the library's message, with the label") {
    c.fill_engine = "copy";
    refused(c, "layer0: unknown fill engine 'copy' (available: automatic, copy_engine, sm_loads)");
    c.fill_engine = "Copy_Engine";  // exact spelling only
    refused(c, "unknown fill engine 'Copy_Engine'");
    c.fill_engine = "";
    refused(c, "unknown fill engine ''");
  }
  SUBCASE("unparsable profiles: the parser's message, naming the line and key") {
    c.link_profile = "expert_cache link profile v2\ndevice=0\n";
    refused(c, "layer0: link_profile: link profile line 1: expected 'expert_cache link profile v1'");
    std::string text = stored_profile().serialize();
    c.link_profile = text.substr(0, text.find("measure_ms="));
    refused(c, "layer0: link_profile: link profile: missing key 'measure_ms'");
    c.link_profile = text + "measure_ms=1\n";
    refused(c, "line 12: key 'measure_ms' appears twice");
    const std::size_t at = text.find("sm_load_gbps=");
    c.link_profile = text.substr(0, at) + "sm_load_gbps=fast" + text.substr(text.find('\n', at));
    refused(c, "line 9: sm_load_gbps: 'fast' is not a number");
  }
  SUBCASE("host providers: no engine to choose") {
    for (const char* provider : {"row", "cached"}) {
      CAPTURE(provider);
      c.provider = provider;
      c.fill_engine = "copy_engine";
      c.link_profile.clear();
      refused(c, "layer0: fill_engine 'copy_engine': the fill engine is chosen for provider 'device' only (provider '" +
                     std::string(provider) + "'");
      c.fill_engine = "automatic";
      c.link_profile = stored_profile().serialize();
      refused(c, "fill_engine 'automatic' with a link_profile: the fill engine is chosen for provider 'device' only");
      c.link_profile.clear();
      CHECK(fill_engine_choice(c).ok());  // the defaults are every provider's
    }
  }
  SUBCASE("a profile with a named engine: one or the other") {
    c.link_profile = stored_profile().serialize();
    c.fill_engine = "sm_loads";
    refused(c, "a link_profile is read by fill_engine 'automatic' only (got fill_engine 'sm_loads'");
  }
}

TEST_CASE("CacheBridge: a bad fill engine or profile is refused before anything is built") {
  constexpr std::int32_t E = 6, C = 3;
  HostWeights w(dense_tensors, E, DType::bfloat16);
  BridgeConfig c = dense_config("device", E, C, 1);
  c.max_ids = 4;
  const auto refuse = [&](const BridgeConfig& bad, const std::string& expected) {
    SimRuntime rt(sim_options());
    auto made = Bridge::create(rt, bad, w.args);
    REQUIRE(!made.ok());
    CHECK(made.status().code() == ErrorCode::invalid_argument);
    const std::string m(made.status().message());
    INFO("message: " << m);
    CHECK(m.find(expected) != std::string::npos);
    CHECK(rt.allocated_bytes() == 0);
    CHECK(rt.registered_ranges() == 0);
  };
  {
    SimRuntime rt(sim_options());
    REQUIRE(Bridge::create(rt, c, w.args).ok());  // the base case is accepted
  }
  SUBCASE("unknown engine") {
    BridgeConfig bad = c;
    bad.fill_engine = "dma";
    refuse(bad, "unknown fill engine 'dma'");
  }
  SUBCASE("unparsable profile") {
    BridgeConfig bad = c;
    bad.link_profile = "device=0\n";
    refuse(bad, "link_profile: link profile line 1: expected 'expert_cache link profile v1', got 'device=0'");
  }
  SUBCASE("an engine for a host provider") {
    BridgeConfig bad = c;
    bad.provider = "row";
    bad.fill_engine = "sm_loads";
    refuse(bad, "provider 'device' only (provider 'row'");
  }
}

TEST_CASE("CacheBridge: the device provider reports the fill engine its cache runs, as DeviceExpertCache resolves it") {
  constexpr std::int32_t E = 8, C = 3, max_ids = 4;
  HostWeights w(dense_tensors, E, DType::bfloat16);
  const auto reference_engine = [&](FillEngine requested) {
    SimRuntime rt(sim_options());
    DeviceCacheOptions o;
    o.num_experts = E;
    o.capacity = C;
    o.max_ids = max_ids;
    o.fill_engine = requested;
    o.memory.host_tensors[0] = MemorySpan{w.data(0), w.args[0].bytes};
    o.memory.host_tensors[1] = MemorySpan{w.data(1), w.args[1].bytes};
    const DeviceExpertCache<TensorMajorStorage, DenseBf16, SimRuntime> ref(rt, o, DenseBf16{16, 8});
    return ref.fill_engine();
  };
  for (FillEngine requested : {FillEngine::automatic, FillEngine::copy_engine, FillEngine::sm_loads}) {
    CAPTURE(to_string(requested));
    SimRuntime rt(sim_options());
    BridgeConfig c = dense_config("device", E, C, 1);
    c.max_ids = max_ids;
    c.fill_engine = std::string(to_string(requested));
    auto made = Bridge::create(rt, c, w.args);
    REQUIRE_MESSAGE(made.ok(), std::string(made.status().message()));
    const std::optional<FillEngine> engine = made.value()->fill_engine();
    REQUIRE(engine);
    CHECK(*engine != FillEngine::automatic);
    CHECK(*engine == reference_engine(requested));
    if (requested != FillEngine::automatic) CHECK(*engine == requested);
  }
  SUBCASE("a stored profile is accepted by the device provider") {
    SimRuntime rt(sim_options());
    BridgeConfig c = dense_config("device", E, C, 1);
    c.max_ids = max_ids;
    c.link_profile = stored_profile().serialize();
    auto made = Bridge::create(rt, c, w.args);
    REQUIRE_MESSAGE(made.ok(), std::string(made.status().message()));
    // SimRuntime's executor resolves nothing from a profile: automatic runs its fill op (sm_loads).
    CHECK(made.value()->fill_engine() == FillEngine::sm_loads);
  }
  SUBCASE("host providers report none") {
    for (const char* provider : {"row", "cached"}) {
      SimRuntime rt(sim_options());
      auto made = Bridge::create(rt, dense_config(provider, E, C, 1), w.args);
      REQUIRE(made.ok());
      CHECK(!made.value()->fill_engine());
    }
  }
}

TEST_CASE("check_link_profile_request: a device ordinal and a positive expert size") {
  CHECK(check_link_profile_request(0, 1).ok());
  CHECK(check_link_profile_request(7, std::int64_t{1} << 40).ok());
  const auto refused = [](Status s, const std::string& expected) {
    REQUIRE(!s.ok());
    CHECK(s.code() == ErrorCode::invalid_argument);
    const std::string m(s.message());
    INFO("message: " << m);
    CHECK(m.find(expected) != std::string::npos);
  };
  refused(check_link_profile_request(-1, 1024), "link_profile: device -1 is not a CUDA device ordinal");
  refused(check_link_profile_request(std::int64_t{1} << 31, 1024), "device 2147483648 is not a CUDA device ordinal");
  refused(check_link_profile_request(0, 0), "link_profile: expert_bytes 0 (accepted: > 0");
  refused(check_link_profile_request(0, -5), "expert_bytes -5 (accepted: > 0");
}

namespace {

// A bridge of `provider` over dense weights (E 12, C 4) whose last forward was expert 0: host ids
// for the host providers, device ids for the device provider.
struct ScoredSetup {
  static constexpr std::int32_t E = 12, C = 4;
  static constexpr std::int64_t per_expert = 512 + 256;  // dense_tensors: w13 + w2 bytes
  SimRuntime rt{sim_options()};
  Stream s = rt.create_stream().value();
  HostWeights w{dense_tensors, E, DType::bfloat16};
  std::unique_ptr<Bridge> bridge;

  explicit ScoredSetup(const char* provider) {
    BridgeConfig c = dense_config(provider, E, C, 2);
    c.max_ids = 8;
    auto made = Bridge::create(rt, c, w.args);
    REQUIRE(made.ok());
    bridge = std::move(made.value());
    prepare({0});
  }
  void prepare(const std::vector<std::int32_t>& ids) {
    if (bridge->device_provider()) {
      RuntimeBuffer<SimRuntime> dev = device_ids(rt, ids, ids.size());
      REQUIRE(bridge->prepare_device(reinterpret_cast<const std::int32_t*>(dev.data()),
                                     static_cast<std::int64_t>(ids.size()), s)
                  .ok());
      rt.drain();
    } else {
      REQUIRE(bridge->prepare(ids, s).ok());
    }
  }
  // The device resident map after the queued work ran: expert -> slot, -1 absent (every provider).
  // The host planner's resident map where there is one (a host-planned cache's device copy may
  // be behind after a prefetch until the next prepare), else the device's.
  std::vector<std::int32_t> resident() {
    rt.drain();
    const std::span<const std::int32_t> host = bridge->resident_map_host();
    if (host.size() == static_cast<std::size_t>(E)) return {host.begin(), host.end()};
    const auto* rd = reinterpret_cast<const std::int32_t*>(bridge->resident_map_device());
    return {rd, rd + E};
  }
  std::int64_t stat(const std::string& name) {
    rt.drain();
    for (const StatEntry& e : bridge->stats()) {
      if (e.name == name) return e.int_value;
    }
    FAIL("no stat " << name);
    return -1;
  }
};

}  // namespace

TEST_CASE("CacheBridge prefetch with evict_last_forward: the last forward's experts make room, every provider") {
  for (const std::string provider : {"row", "cached", "device"}) {
    CAPTURE(provider);
    ScoredSetup x(provider.c_str());
    Bridge& b = *x.bridge;
    x.prepare({0, 1, 2, 3});  // every slot holds the last forward
    const std::vector<std::int64_t> ids{5, 1};
    HintScores keep;  // no promise: nothing may go
    const auto p = b.prefetch(ids, 2 * ScoredSetup::per_expert, 1, x.s, keep);
    REQUIRE_MESSAGE(p.ok(), std::string(p.status().message()));
    x.rt.drain();
    CHECK(x.resident()[5] < 0);
    HintScores evict;
    evict.evict_last_forward = true;
    const auto q = b.prefetch(ids, 2 * ScoredSetup::per_expert, 1, x.s, evict);
    REQUIRE_MESSAGE(q.ok(), std::string(q.status().message()));
    x.rt.drain();
    const std::vector<std::int32_t> r = x.resident();
    CHECK(r[5] >= 0);  // fetched into a slot of 0, 2 or 3
    CHECK(r[1] >= 0);  // named: kept
    CHECK(x.rt.races().empty());
  }
}

TEST_CASE("CacheBridge prefetch with scores: below min_score skipped, the rest highest score first, every provider") {
  for (const std::string provider : {"row", "cached", "device"}) {
    CAPTURE(provider);
    ScoredSetup x(provider.c_str());
    Bridge& b = *x.bridge;
    const bool device = b.device_provider();
    // 7 scores below 0.5: skipped. Then 6 (0.9), 8 (0.7), 5 (0.6); the budget takes two.
    const std::vector<std::int64_t> ids{5, 6, 7, 8};
    const std::vector<float> scores{0.6f, 0.9f, 0.3f, 0.7f};
    const auto p = b.prefetch(ids, 2 * ScoredSetup::per_expert, 1, x.s, HintScores{scores, 0.5f});
    REQUIRE_MESSAGE(p.ok(), std::string(p.status().message()));
    CHECK(p.value().skipped_unlikely == 1);
    if (!device) {  // the device provider's view counts only the host selection
      CHECK(p.value().issued == 2);
      CHECK(p.value().skipped_resident == 0);
      CHECK(p.value().skipped_no_victim == 0);
      CHECK(p.value().bytes == 2 * ScoredSetup::per_expert);
    } else {
      CHECK(p.value().issued == 0);
    }
    std::vector<std::int32_t> r = x.resident();
    CHECK(r[0] >= 0);
    CHECK(r[6] >= 0);
    CHECK(r[8] >= 0);
    CHECK(r[5] == -1);  // over the budget
    CHECK(r[7] == -1);  // below min_score
    CHECK(x.stat("speculative_issued") == 2);
    check_slots_hold_host_bytes(x.rt, b, x.w);
    // The next forward finds both.
    x.prepare({6, 8});
    CHECK(x.stat("speculative_used") == 2);
    if (!device) {
      const ForwardPlan* plan = b.cache().last_plan();
      REQUIRE(plan != nullptr);
      CHECK(plan->fills.empty());
    }

    // Equal scores keep the caller's order: one free slot, the first of three equal hints.
    const auto q = b.prefetch(std::vector<std::int64_t>{9, 3, 4}, ScoredSetup::per_expert, 1, x.s,
                              HintScores{std::vector<float>{0.8f, 0.8f, 0.8f}, 0.5f});
    REQUIRE(q.ok());
    CHECK(q.value().skipped_unlikely == 0);
    r = x.resident();
    CHECK(r[9] >= 0);
    CHECK(r[3] == -1);
    CHECK(r[4] == -1);

    // min_score is inclusive at both ends: 0 keeps a score of 0, 1 keeps only a score of 1.
    const std::vector<float> low{0.0f, 1.0f};
    const auto z = b.prefetch(std::vector<std::int64_t>{10, 11}, 0, 1, x.s, HintScores{low, 0.0f});
    REQUIRE(z.ok());
    CHECK(z.value().skipped_unlikely == 0);
    const auto one = b.prefetch(std::vector<std::int64_t>{10, 11}, 0, 1, x.s, HintScores{low, 1.0f});
    REQUIRE(one.ok());
    CHECK(one.value().skipped_unlikely == 1);
    // No ids, no scores (an empty list with its empty scores): nothing to do.
    const auto none = b.prefetch(std::vector<std::int64_t>{}, ScoredSetup::per_expert, 1, x.s,
                                 HintScores{std::span<const float>{}, 0.5f});
    REQUIRE(none.ok());
    CHECK(none.value().issued == 0);
    CHECK(none.value().skipped_unlikely == 0);
    CHECK(x.stat("speculative_issued") == 3);  // 6, 8 and 9
    CHECK(x.rt.races().empty());
  }
}

TEST_CASE("CacheBridge prefetch: bad scores and min_score are refused with the library's message, nothing changed") {
  for (const std::string provider : {"row", "device"}) {
    CAPTURE(provider);
    ScoredSetup x(provider.c_str());
    Bridge& b = *x.bridge;
    const Snapshot before = snapshot(x.rt, b);
    const auto refused = [&](const Status& st, const std::string& expected,
                             ErrorCode code = ErrorCode::invalid_argument) {
      REQUIRE(!st.ok());
      CHECK(st.code() == code);
      const std::string m(st.message());
      INFO("message: " << m);
      CHECK(m.find(expected) != std::string::npos);
      CHECK(snapshot(x.rt, b) == before);
    };
    using V = std::vector<std::int64_t>;
    using F = std::vector<float>;
    const std::int64_t budget = 4 * ScoredSetup::per_expert;
    const auto with = [&](V ids, F scores, float min_score = 0.5f) {
      return b.prefetch(ids, budget, 1, x.s, HintScores{std::span<const float>(scores), min_score}).status();
    };
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    refused(with(V{3, 7}, F{0.9f, 0.8f, 0.7f}),
            "layer0: prefetch got 3 scores for 2 predicted ids (scores[i] belongs to ids[i]; no scores: None)");
    refused(with(V{3, 7}, F{}), "layer0: prefetch got 0 scores for 2 predicted ids");
    refused(with(V{3, 7}, F{0.9f, nan}), "layer0: prefetch score nan at index 1 (expert 7) is not a probability in [0, 1]");
    refused(with(V{3, 7}, F{1.5f, 0.9f}), "prefetch score 1.5 at index 0 (expert 3) is not a probability");
    refused(with(V{3, 7}, F{0.9f, -0.25f}), "prefetch score -0.25 at index 1 (expert 7)");
    refused(with(V{3, 7}, F{inf, 0.9f}), "prefetch score inf at index 0 (expert 3)");
    refused(with(V{3, 7}, F{0.9f, 0.8f}, nan), "layer0: prefetch min_score nan is not in [0, 1]");
    // min_score is checked without scores too.
    refused(b.prefetch(V{3, 7}, budget, 1, x.s, HintScores{std::nullopt, 1.5f}).status(),
            "layer0: prefetch min_score 1.5 is not in [0, 1]");
    refused(b.prefetch(V{3}, budget, 1, x.s, HintScores{std::nullopt, -0.5f}).status(), "prefetch min_score -0.5");
    // The ids are checked first, a skipped one too.
    refused(with(V{3, 3}, F{0.9f, nan}), "predicted ids[1] = 3 appears twice", ErrorCode::duplicate_expert);
    refused(with(V{3, 12}, F{0.9f, 0.1f}), "predicted ids[1] = 12 outside [0, 12)", ErrorCode::expert_out_of_range);
    // Device ids: the device plan takes them in the given order, so no scores.
    RuntimeBuffer<SimRuntime> dev = device_ids(x.rt, {3, 7}, 2);
    const auto* ids = reinterpret_cast<const std::int32_t*>(dev.data());
    const F two{0.9f, 0.8f};
    if (b.device_provider()) {
      refused(b.prefetch_device(ids, 2, budget, 1, x.s, HintScores{std::span<const float>(two), 0.5f}).status(),
              "layer0: prefetch with CUDA ids takes no scores (2 given): provider 'device' plans CUDA ids on the GPU");
      refused(b.prefetch_device(ids, 2, budget, 1, x.s, HintScores{std::nullopt, 2.0f}).status(),
              "layer0: prefetch min_score 2 is not in [0, 1]");
    } else {
      refused(b.prefetch_device(ids, 2, budget, 1, x.s, HintScores{std::span<const float>(two), 0.5f}).status(),
              "prefetch with CUDA ids needs provider 'device'");
    }
    // The cache is usable after every refusal: the same call with good scores is accepted.
    const auto ok = b.prefetch(V{3, 7}, budget, 1, x.s, HintScores{std::span<const float>(two), 0.85f});
    REQUIRE(ok.ok());
    CHECK(ok.value().skipped_unlikely == 1);
    const std::vector<std::int32_t> r = x.resident();
    CHECK(r[3] >= 0);
    CHECK(r[7] == -1);
    if (b.device_provider()) {
      // Device ids without scores (min_score alone, in range) are still planned.
      REQUIRE(b.prefetch_device(ids, 2, budget, 1, x.s, HintScores{std::nullopt, 0.9f}).ok());
      CHECK(x.resident()[7] >= 0);
    }
    CHECK(x.rt.races().empty());
  }
}
