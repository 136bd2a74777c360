// Storages on SimRuntime: caller-owned host pools (adopted at their address, registered at
// their exact size, never copied or written), caller device workspaces, per-tensor slot arrays
// over an expert-major host pool (same slot bytes and maps as TensorMajorStorage for the same
// trace), and layouts with more than the six NVFP4 tensors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "support/sim_cache_harness.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;

namespace {

template <template <class> class Storage, class Staging = CopyStream>
using Cache = ExpertCache<Storage, Lru, Staging, ExplicitLayout, SimRuntime>;

constexpr std::int32_t kExperts = 16;
constexpr std::int32_t kCapacity = 4;

// 64-byte aligned caller memory (an engine's weight tensors / a workspace).
struct CallerBuffer {
  explicit CallerBuffer(std::size_t n) : bytes(n), raw(new std::byte[n + 64]) {
    auto a = reinterpret_cast<std::uintptr_t>(raw.get());
    data = reinterpret_cast<std::byte*>((a + 63) / 64 * 64);
    std::memset(data, 0, n);
  }
  std::size_t bytes;
  std::unique_ptr<std::byte[]> raw;
  std::byte* data;
};

// One [E, bytes_t] array per tensor, each filled with the harness's pattern.
struct CallerTensors {
  explicit CallerTensors(const ExpertTensorBytes& t) {
    for (std::size_t i = 0; i < max_expert_tensors; ++i) {
      const std::size_t b = t[i].bytes_per_expert;
      if (b == 0) continue;
      buffers[i] = std::make_unique<CallerBuffer>(kExperts * b);
      for (std::int32_t e = 0; e < kExperts; ++e)
        for (std::size_t k = 0; k < b; ++k) buffers[i]->data[static_cast<std::size_t>(e) * b + k] = pattern_byte(i, e, k);
    }
  }
  [[nodiscard]] StorageMemory memory() const {
    StorageMemory m;
    for (std::size_t i = 0; i < max_expert_tensors; ++i)
      if (buffers[i]) m.host_tensors[i] = MemorySpan{buffers[i]->data, buffers[i]->bytes};
    return m;
  }
  std::array<std::unique_ptr<CallerBuffer>, max_expert_tensors> buffers;
};

// One [E, blob] array, each tensor at its blob offset, filled with the pattern.
template <template <class> class Storage>
struct CallerBlobs {
  explicit CallerBlobs(const ExpertTensorBytes& t)
      : layout(Storage<SimRuntime>::blob_layout(t)), buffer(kExperts * layout.blob_bytes) {
    for (std::int32_t e = 0; e < kExperts; ++e)
      for (std::size_t i = 0; i < max_expert_tensors; ++i)
        for (std::size_t k = 0; k < t[i].bytes_per_expert; ++k)
          buffer.data[static_cast<std::size_t>(e) * layout.blob_bytes + layout.offsets[i] + k] = pattern_byte(i, e, k);
  }
  [[nodiscard]] StorageMemory memory() const {
    StorageMemory m;
    m.host_pool = MemorySpan{buffer.data, buffer.bytes};
    return m;
  }
  BlobLayout layout;
  CallerBuffer buffer;
};

CacheOptions options_with(const StorageMemory& m) {
  CacheOptions o = quiet_options(kExperts, kCapacity, 2);
  o.memory = m;
  return o;
}

std::vector<Ids> random_trace(std::uint64_t seed, int steps) {
  std::mt19937_64 g(seed);
  std::vector<Ids> trace;
  for (int s = 0; s < steps; ++s) {
    Ids ids;
    for (int k = 0; k < 4; ++k) ids.push_back(static_cast<std::int32_t>(g() % kExperts));
    if (g() % 5 == 0) ids.push_back(-1);  // padding
    trace.push_back(ids);
  }
  return trace;
}

// Runs `trace` with a checking reader after each prepare; returns false on any mismatch/race.
template <class C>
void run_checked(SimRuntime& rt, C& cache, const std::vector<Ids>& trace) {
  auto log = std::make_shared<ReaderLog>();
  const auto s = rt.create_stream().value();
  for (const Ids& ids : trace) {
    auto v = cache.prepare(ids, s);
    REQUIRE(v.ok());
    Ids unique;
    for (ExpertId e : cache.last_plan().unique) unique.push_back(e.value);
    REQUIRE(launch_reader(rt, cache, v.value(), unique, s, log).ok());
  }
  rt.drain();
  CHECK(rt.races().empty());
  if (!rt.races().empty()) MESSAGE(rt.races()[0].description);
  CHECK(log->mismatches == 0);
  if (log->mismatches != 0) MESSAGE(log->first_mismatch);
  CHECK(log->runs == trace.size());
  rt.destroy_stream(s);
}

// Construction that must fail with invalid_argument; returns the message.
template <template <class> class Storage>
std::string rejected(SimRuntime& rt, const StorageMemory& m, const ExplicitLayout& layout = six_tensor_layout()) {
  try {
    Cache<Storage> c(rt, options_with(m), layout);
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(rt.allocated_bytes() == 0);    // nothing allocated ...
    CHECK(rt.registered_ranges() == 0);  // ... nor registered
    return e.what();
  }
  FAIL("construction accepted bad caller memory");
  return {};
}

bool contains(const std::string& s, std::string_view what) { return s.find(what) != std::string::npos; }

ExplicitLayout seven_tensor_layout() {
  ExplicitLayout l = six_tensor_layout();
  l.bytes[6] = TensorBytes{"w13_bias", 40};  // not a multiple of 16: scatter/tail paths too
  return l;
}

}  // namespace

TEST_CASE("caller host tensors: adopted at their address, registered exactly, never copied or written") {
  SimRuntime rt;
  const ExplicitLayout layout = six_tensor_layout();
  CallerTensors host(layout.tensors());
  std::vector<std::vector<std::byte>> before;
  for (const auto& b : host.buffers)
    if (b) before.emplace_back(b->data, b->data + b->bytes);
  std::size_t own_allocation = 0;
  {
    Cache<TensorMajorStorage> reference(rt, quiet_options(kExperts, kCapacity, 2), layout);
    own_allocation = rt.allocated_bytes();
  }
  {
    Cache<TensorMajorStorage> cache(rt, options_with(host.memory()), layout);
    const auto& st = cache.storage();
    CHECK(st.caller_host());
    CHECK_FALSE(st.caller_slots());
    const CopyRegions& r = st.copy_regions();
    REQUIRE(r.count == 6);
    std::size_t k = 0;
    std::size_t pool_bytes = 0;
    for (std::size_t t = 0; t < 6; ++t) {
      const std::size_t b = layout.bytes[t].bytes_per_expert;
      CHECK(r.regions[k].host_base == host.buffers[t]->data);  // the caller's pointer: no copy made
      CHECK(r.regions[k].host_stride == b);
      CHECK(st.host_tensor(t, 5) == host.buffers[t]->data + 5 * b);
      CHECK(rt.is_registered(host.buffers[t]->data, kExperts * b));  // exact size
      pool_bytes += kExperts * b;
      ++k;
    }
    CHECK(rt.registered_ranges() == 6);
    CHECK(st.host_bytes() == pool_bytes);
    CHECK(rt.allocated_bytes() == own_allocation - pool_bytes);  // no host pool allocated
    run_checked(rt, cache, random_trace(3, 200));
  }
  CHECK(rt.registered_ranges() == 0);  // unregistered on destruction
  CHECK(rt.allocated_bytes() == 0);
  std::size_t i = 0;
  for (const auto& b : host.buffers)
    if (b) CHECK(std::equal(b->data, b->data + b->bytes, before[i++].begin()));  // never written
}

TEST_CASE("caller host memory already registered by the caller is not registered again") {
  SimRuntime rt;
  CallerTensors host(six_tensor_layout().tensors());
  StorageMemory m = host.memory();
  m.host_registered = true;
  Cache<TensorMajorStorage> cache(rt, options_with(m), six_tensor_layout());
  CHECK(rt.registered_ranges() == 0);
  run_checked(rt, cache, random_trace(4, 50));
}

TEST_CASE("bad caller host spans are rejected before anything is allocated or registered") {
  SimRuntime rt;
  const ExplicitLayout layout = six_tensor_layout();
  CallerTensors host(layout.tensors());

  StorageMemory m = host.memory();
  m.host_tensors[1].bytes -= 1;  // wrong size
  std::string msg = rejected<TensorMajorStorage>(rt, m);
  CHECK(contains(msg, "tensor w2"));
  CHECK(contains(msg, "expected exactly"));

  m = host.memory();
  m.host_tensors[2].data = nullptr;  // null with a size
  msg = rejected<TensorMajorStorage>(rt, m);
  CHECK(contains(msg, "tensor w13_scale"));
  CHECK(contains(msg, "null"));

  m = host.memory();
  m.host_tensors[3] = MemorySpan{};  // a present tensor without a span
  msg = rejected<TensorMajorStorage>(rt, m);
  CHECK(contains(msg, "tensor w2_scale"));

  CallerBuffer shifted(kExperts * 24 + 16);
  m = host.memory();
  m.host_tensors[2] = MemorySpan{shifted.data + 8, kExperts * 24};  // misaligned
  msg = rejected<TensorMajorStorage>(rt, m);
  CHECK(contains(msg, "tensor w13_scale"));
  CHECK(contains(msg, "16-byte aligned"));

  m = host.memory();
  m.host_tensors[1] = MemorySpan{host.buffers[0]->data + 16, kExperts * 48};  // inside w13's span
  msg = rejected<TensorMajorStorage>(rt, m);
  CHECK(contains(msg, "tensor w2"));
  CHECK(contains(msg, "overlaps"));
  CHECK(contains(msg, "w13"));

  ExplicitLayout no_scale2 = layout;
  no_scale2.bytes[5].bytes_per_expert = 0;
  m = host.memory();  // a span for a tensor the layout does not have
  msg = rejected<TensorMajorStorage>(rt, m, no_scale2);
  CHECK(contains(msg, "no such tensor"));

  m = host.memory();
  m.host_pool = MemorySpan{host.buffers[0]->data, host.buffers[0]->bytes};  // wrong kind of span
  msg = rejected<TensorMajorStorage>(rt, m);
  CHECK(contains(msg, "host_pool"));

  // Expert-major host pools: exactly num_experts * blob bytes, aligned, non-null.
  CallerBlobs<ExpertMajorStorage> blobs(layout.tensors());
  StorageMemory b = blobs.memory();
  b.host_pool.bytes -= 16;
  msg = rejected<ExpertMajorStorage>(rt, b);
  CHECK(contains(msg, "host pool"));
  b = blobs.memory();
  b.host_pool.data = blobs.buffer.data + 4;  // misaligned (never touched: rejected first)
  msg = rejected<ExpertMajorHostStorage>(rt, b);
  CHECK(contains(msg, "aligned"));
  b = blobs.memory();
  b.host_pool.data = nullptr;
  msg = rejected<ExpertMajorHostStorage>(rt, b);
  CHECK(contains(msg, "null"));
  msg = rejected<ExpertMajorStorage>(rt, host.memory());  // per-tensor spans for a blob pool
  CHECK(contains(msg, "host_tensors"));

  // The runtime refusing a registration midway: earlier registrations are undone.
  REQUIRE(rt.register_host(host.buffers[4]->data, 16).ok());
  try {
    Cache<TensorMajorStorage> c(rt, options_with(host.memory()), layout);
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(contains(e.what(), "w13_scale_2"));
  }
  CHECK(rt.registered_ranges() == 1);
  CHECK(rt.allocated_bytes() == 0);
  REQUIRE(rt.unregister_host(host.buffers[4]->data).ok());

  // And the good spans still work afterwards.
  Cache<TensorMajorStorage> ok(rt, options_with(host.memory()), layout);
  CHECK(rt.registered_ranges() == 6);
}

TEST_CASE("caller slot workspace: slots carved from it, validated, never freed by the cache") {
  SimRuntime rt;
  const ExplicitLayout layout = seven_tensor_layout();
  const CacheShape shape{kExperts, kCapacity};
  const std::size_t need = TensorMajorStorage<SimRuntime>::slot_workspace_bytes(shape, layout.tensors());
  void* ws = rt.allocate(need, MemoryKind::device).value();
  void* ws2 = rt.allocate(need, MemoryKind::device).value();
  const std::size_t ws_bytes = rt.allocated_bytes();
  {
    StorageMemory m;
    m.slot_workspace = MemorySpan{ws, need};
    Cache<TensorMajorStorage> cache(rt, options_with(m), layout);
    fill_host_pools(cache);
    const auto& st = cache.storage();
    CHECK(st.caller_slots());
    std::size_t last_end = 0;
    for (std::size_t t = 0; t < 7; ++t) {
      const SlotTensor s = st.slot_tensor(t);
      const auto off = static_cast<std::size_t>(s.base - static_cast<std::byte*>(ws));
      CHECK(off % 256 == 0);
      CHECK(off >= last_end);
      CHECK(s.contiguous());
      last_end = off + kCapacity * s.bytes;
    }
    CHECK(last_end <= need);
    run_checked(rt, cache, random_trace(5, 200));
  }
  CHECK(rt.allocated_bytes() == ws_bytes);  // the cache did not free the workspace
  {
    // Expert-major host + per-tensor slots, both caller-owned. A second workspace: the first
    // cache's copies are not ordered before this one's (the caller would synchronize first).
    CallerBlobs<ExpertMajorHostStorage> blobs(layout.tensors());
    StorageMemory m = blobs.memory();
    m.slot_workspace = MemorySpan{ws2, need};
    REQUIRE(ExpertMajorHostStorage<SimRuntime>::slot_workspace_bytes(shape, layout.tensors()) == need);
    Cache<ExpertMajorHostStorage> cache(rt, options_with(m), layout);
    CHECK(cache.storage().caller_host());
    CHECK(cache.storage().caller_slots());
    CHECK(rt.allocated_bytes() - ws_bytes < 4096);  // maps and staging only
    run_checked(rt, cache, random_trace(6, 200));
  }
  StorageMemory m;
  m.slot_workspace = MemorySpan{ws, need - 1};
  SimRuntime other;
  CHECK(contains(rejected<TensorMajorStorage>(other, m, layout), "slot workspace"));
  m.slot_workspace = MemorySpan{static_cast<std::byte*>(ws) + 8, need};
  CHECK(contains(rejected<TensorMajorStorage>(other, m, layout), "aligned"));
  m.slot_workspace = MemorySpan{nullptr, need};
  CHECK(contains(rejected<TensorMajorStorage>(other, m, layout), "null"));
  const std::size_t blob_need = ExpertMajorStorage<SimRuntime>::slot_workspace_bytes(shape, layout.tensors());
  CHECK(blob_need == kCapacity * ExpertMajorStorage<SimRuntime>::blob_layout(layout.tensors()).blob_bytes);
  m.slot_workspace = MemorySpan{ws, blob_need - 1};
  CHECK(contains(rejected<ExpertMajorStorage>(other, m, layout), "slot workspace"));
  REQUIRE(rt.deallocate(ws).ok());
  REQUIRE(rt.deallocate(ws2).ok());
}

TEST_CASE("expert-major host with per-tensor slots: copy regions scatter the blob into the tensors") {
  SimRuntime rt;
  const ExplicitLayout layout = six_tensor_layout();
  Cache<ExpertMajorHostStorage> cache(rt, quiet_options(kExperts, kCapacity, 2), layout);
  const auto& st = cache.storage();
  const BlobLayout bl = ExpertMajorHostStorage<SimRuntime>::blob_layout(layout.tensors());
  const CopyRegions& r = st.copy_regions();
  REQUIRE(r.count == 6);
  for (std::size_t t = 0; t < 6; ++t) {
    const std::size_t b = layout.bytes[t].bytes_per_expert;
    CHECK(r.regions[t].host_base == st.host_expert(0) + bl.offsets[t]);
    CHECK(r.regions[t].host_stride == bl.blob_bytes);
    CHECK(r.regions[t].slot_stride == b);
    CHECK(r.regions[t].bytes == b);
    CHECK(r.regions[t].slot_base == st.slot_tensor(t).base);
    CHECK(st.slot_tensor(t).contiguous());
    CHECK(st.host_tensor(t, 3) == st.host_expert(3) + bl.offsets[t]);
  }
  CHECK(st.host_bytes() == kExperts * bl.blob_bytes);
  CHECK(st.slot_bytes() == kCapacity * total_bytes_per_expert(layout.tensors()));  // no blob padding in slots
}

TEST_CASE("expert-major host with per-tensor slots gives TensorMajorStorage's slot bytes and maps (every copy staging)") {
  auto compare = [](auto staging_tag) {
    using Staging = decltype(staging_tag);
    const ExplicitLayout layout = seven_tensor_layout();
    SimRuntime rt_a, rt_b;
    Cache<TensorMajorStorage, Staging> a(rt_a, quiet_options(kExperts, kCapacity, 2), layout);
    Cache<ExpertMajorHostStorage, Staging> b(rt_b, quiet_options(kExperts, kCapacity, 2), layout);
    fill_host_pools(a);
    fill_host_pools(b);
    const auto sa = rt_a.create_stream().value();
    const auto sb = rt_b.create_stream().value();
    for (const Ids& ids : random_trace(11, 300)) {
      auto va = a.prepare(ids, sa);
      auto vb = b.prepare(ids, sb);
      REQUIRE(va.ok());
      REQUIRE(vb.ok());
      CHECK(va.value().hits == vb.value().hits);
      CHECK(va.value().misses == vb.value().misses);
      CHECK(a.stats().last_copies == b.stats().last_copies);  // one copy per tensor per fill
      rt_a.drain();
      rt_b.drain();
      REQUIRE(std::ranges::equal(a.forward_map_host(), b.forward_map_host()));
      REQUIRE(std::ranges::equal(a.resident_map_host(), b.resident_map_host()));
      for (std::int32_t e = 0; e < kExperts; ++e) {
        const std::int32_t slot = a.resident_map_host()[static_cast<std::size_t>(e)];
        if (slot < 0) continue;
        for (std::size_t t = 0; t < max_expert_tensors; ++t) {
          const SlotTensor x = a.storage().slot_tensor(t), y = b.storage().slot_tensor(t);
          REQUIRE(x.bytes == y.bytes);
          if (x.bytes == 0) continue;
          REQUIRE(std::memcmp(x.slot(slot), y.slot(slot), x.bytes) == 0);
        }
        // and both hold the expert's pattern (the 7th tensor included)
        const SlotTensor bias = b.storage().slot_tensor(6);
        REQUIRE(bias.bytes == 40);
        for (std::size_t k = 0; k < bias.bytes; ++k) REQUIRE(bias.slot(slot)[k] == pattern_byte(6, e, k));
      }
    }
    CHECK(rt_a.races().empty());
    CHECK(rt_b.races().empty());
    CHECK(a.stats().hits == b.stats().hits);
    CHECK(a.stats().total_copies == b.stats().total_copies);
  };
  SUBCASE("copy_stream") { compare(CopyStream{}); }
  SUBCASE("inline") { compare(Inline{}); }
  SUBCASE("batched") { compare(Batched{}); }
}

TEST_CASE("a 7th tensor (a bias) is carried through prepare by every storage") {
  const ExplicitLayout layout = seven_tensor_layout();
  CHECK(find_tensor(layout.tensors(), "w13_bias") == 6);
  CHECK(find_tensor(layout.tensors(), "w2_bias") == max_expert_tensors);
  CHECK(find_tensor(layout.tensors(), "w13") == static_cast<std::size_t>(ExpertTensor::w13));
  auto check = [](auto& cache, SimRuntime& rt, std::size_t regions) {
    fill_host_pools(cache);
    CHECK(cache.storage().copy_regions().count == regions);
    const auto s = rt.create_stream().value();
    auto v = cache.prepare(Ids{1, 2, 3}, s);
    REQUIRE(v.ok());
    const ExpertTensorBytes& tb = cache.layout().tensors();
    for (std::size_t t = 0; t < max_expert_tensors; ++t) CHECK(v.value().tensors[t].bytes == tb[t].bytes_per_expert);
    CHECK(v.value().tensor(ExpertTensor::w2).bytes == tb[1].bytes_per_expert);
    run_checked(rt, cache, random_trace(12, 100));  // the reader checks all tensors, the bias too
  };
  {
    SimRuntime rt;
    Cache<TensorMajorStorage> c(rt, quiet_options(kExperts, kCapacity, 2), layout);
    check(c, rt, 7);
  }
  {
    SimRuntime rt;
    Cache<ExpertMajorStorage> c(rt, quiet_options(kExperts, kCapacity, 2), layout);
    check(c, rt, 1);
  }
  {
    SimRuntime rt;
    Cache<ExpertMajorHostStorage, Batched> c(rt, quiet_options(kExperts, kCapacity, 2), layout);
    check(c, rt, 7);
  }
  {
    // All max_expert_tensors entries used (GPTQ-like names).
    ExplicitLayout full;
    const char* names[] = {"w13_qweight", "w13_scales", "w13_qzeros", "w13_g_idx", "w13_bias", "w2_qweight",
                           "w2_scales",   "w2_qzeros",  "w2_g_idx",   "w2_bias",  "extra_a",   "extra_b"};
    for (std::size_t t = 0; t < max_expert_tensors; ++t) full.bytes[t] = TensorBytes{names[t], 8 * (t + 1)};
    SimRuntime rt;
    Cache<ExpertMajorHostStorage> c(rt, quiet_options(kExperts, kCapacity, 2), full);
    check(c, rt, max_expert_tensors);
  }
}

TEST_CASE("tensor names: a present tensor needs a unique, non-empty name") {
  SimRuntime rt;
  ExplicitLayout dup = six_tensor_layout();
  dup.bytes[6] = TensorBytes{"w2", 16};
  CHECK(contains(rejected<TensorMajorStorage>(rt, StorageMemory{}, dup), "two tensors are named w2"));
  ExplicitLayout unnamed = six_tensor_layout();
  unnamed.bytes[7] = TensorBytes{"", 16};
  CHECK(contains(rejected<ExpertMajorStorage>(rt, StorageMemory{}, unnamed), "no name"));
}

TEST_CASE("first_part_first: the named regions first, each part in its own order") {
  CopyRegions r;
  r.count = 5;
  for (std::size_t i = 0; i < r.count; ++i) r.regions[i].bytes = 10 + i;
  std::size_t first = 99;
  const CopyRegions out = first_part_first(r, 0b10110u, first);  // regions 1, 2, 4 first
  CHECK(first == 3);
  REQUIRE(out.count == 5);
  const std::size_t want[] = {11, 12, 14, 10, 13};
  for (std::size_t i = 0; i < out.count; ++i) CHECK(out.regions[i].bytes == want[i]);
  const CopyRegions none = first_part_first(r, 0u, first);
  CHECK(first == 0);
  for (std::size_t i = 0; i < none.count; ++i) CHECK(none.regions[i].bytes == 10 + i);
}
