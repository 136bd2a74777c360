// The copy-engine fill of DeviceExpertCache (device_cache/copy_proxy.cuh): the plan's fill list goes
// to the device's proxy thread, which copies on a copy engine and publishes each slot's ready
// word. Each ordering edge of the protocol (docs/design.md, P1-P2) is removed through a test
// knob and the test shows that a consumer then reads wrong bytes; a refused copy surfaces as a
// Status from the next call and as plan_error_fill_failed, without a hang; a cache destroyed
// with copies in flight leaves the proxy serving the next cache; a cache destroyed while
// another cache's step waits for the proxy lets that step finish (edge P5).
// (The step-by-step comparison with the host-planned cache, eager, captured and with prefetch,
// is in test_device_cache.cu.)
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "expert_cache/cuda.hpp"
#include "expert_cache/device_cache/cuda_executor.cuh"
#include "support/cuda_support.hpp"

using namespace expert_cache;
using namespace test_support;

namespace {

using CeCache = DeviceExpertCache<TensorMajorStorage, ExplicitLayout, CudaRuntime>;

// Big experts (4 MiB + 64 KiB + a 4-byte scale): a fill takes about 80 us on the link, so a
// consumer that does not wait for it reads the slot's previous bytes.
ExplicitLayout big_layout() {
  return ExplicitLayout{{{{"w13", std::size_t{4} << 20}, {"w2", std::size_t{64} << 10}, {"w13_scale_2", 4}}}};
}

std::uint32_t word_of(std::size_t t, std::int32_t e, std::size_t i) {
  return static_cast<std::uint32_t>((t + 1) * 0x9E3779B9u ^ (static_cast<std::uint32_t>(e) + 7) * 0x85EBCA6Bu ^
                                    static_cast<std::uint32_t>(i) * 0xC2B2AE35u);
}

template <class Cache>
void fill_big_pools(Cache& c, std::int32_t experts) {
  const auto& tensors = c.storage().tensors();
  for (std::int32_t e = 0; e < experts; ++e) {
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      auto* p = reinterpret_cast<std::uint32_t*>(c.storage().host_tensor(t, e));
      for (std::size_t i = 0; i < tensors[t].bytes_per_expert / 4; ++i) p[i] = word_of(t, e, i);
    }
  }
}

// Keeps a stream busy for `ns`.
__global__ void hold_stream_kernel(unsigned long long ns) {
  const std::uint64_t t0 = expert_cache::device::global_timer_ns();
  while (expert_cache::device::global_timer_ns() - t0 < ns) __nanosleep(1000);
}

struct CheckParams {
  const std::int32_t* ids;
  std::int32_t n_ids;
  const std::int32_t* map;
  SlotTensor tensors[num_expert_tensors];
  SlotReadiness ready;  // empty: no wait (stream-ordered consumer)
  unsigned long long* bad;
};

// One block per id: waits for the slot when given readiness, then compares every word.
template <int U = 0>
__global__ void check_slots_kernel(const CheckParams p) {
  const std::int32_t e = p.ids[blockIdx.x];
  const std::int32_t slot = p.map[e];
  if (slot < 0) return;
  __shared__ bool ok;
  if (threadIdx.x == 0) ok = expert_cache::device::wait_slot_ready(p.ready, slot);
  __syncthreads();
  unsigned long long bad = 0;
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    const SlotTensor& st = p.tensors[t];
    const auto* w = reinterpret_cast<const std::uint32_t*>(st.base + static_cast<std::size_t>(slot) * st.slot_stride);
    for (std::size_t i = threadIdx.x; i < st.bytes / 4; i += blockDim.x) {
      const std::uint32_t want = static_cast<std::uint32_t>((t + 1) * 0x9E3779B9u ^ (static_cast<std::uint32_t>(e) + 7) * 0x85EBCA6Bu ^
                                                            static_cast<std::uint32_t>(i) * 0xC2B2AE35u);
      if (__ldcg(w + i) != want) ++bad;
    }
  }
  if (!ok) ++bad;
  if (bad != 0) atomicAdd(p.bad, bad);
}

// Storage: tensor-major (a fill is one copy per tensor) or expert-major (a fill is one copy).
template <template <class> class Storage>
struct BasicCeRig {
  using Cache = DeviceExpertCache<Storage, ExplicitLayout, CudaRuntime>;
  static constexpr std::int32_t experts = 24, capacity = 8, n = 6;
  std::unique_ptr<Cache> cache;
  cudaStream_t x = nullptr;
  DeviceBuffer<std::int32_t> ids{static_cast<std::size_t>(n)};
  DeviceBuffer<unsigned long long> bad{1};

  explicit BasicCeRig(DeviceCacheOptions o, FillEngine engine = FillEngine::copy_engine) {
    o.num_experts = experts;
    o.capacity = capacity;
    o.max_ids = n;
    o.fill_engine = engine;
    cache = std::make_unique<Cache>(cuda_runtime(), o, big_layout());
    fill_big_pools(*cache, experts);
    REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
    load_kernels(&check_slots_kernel<0>);
  }
  ~BasicCeRig() {
    (void)cudaStreamSynchronize(x);
    cache.reset();
    (void)cudaStreamDestroy(x);
  }

  // prepare(step's ids) -> check kernel, synchronised; returns the words that differed.
  unsigned long long step(int s, bool with_readiness) {
    enqueue(s, with_readiness);
    REQUIRE_CUDA_OK(cudaStreamSynchronize(x));
    return bad.download()[0];
  }

  // The same, not waited for: the words that differ land in `bad`.
  void enqueue(int s, bool with_readiness) {
    std::vector<std::int32_t> h(n);
    for (std::int32_t i = 0; i < n; ++i) h[static_cast<std::size_t>(i)] = (s * n + i) % experts;  // all misses
    REQUIRE_CUDA_OK(cudaMemcpyAsync(ids.get(), h.data(), n * sizeof(std::int32_t), cudaMemcpyHostToDevice, x));
    REQUIRE_CUDA_OK(cudaMemsetAsync(bad.get(), 0, sizeof(unsigned long long), x));
    auto v = cache->prepare(ids.get(), n, x);
    REQUIRE_MESSAGE(v.ok(), std::string(v.status().message()));
    CheckParams p{};
    p.ids = cache->sanitized_ids_device();
    p.n_ids = n;
    p.map = v.value().expert_map;
    for (std::size_t t = 0; t < num_expert_tensors; ++t) p.tensors[t] = v.value().tensors[t];
    if (with_readiness) p.ready = cache->readiness();
    p.bad = bad.get();
    check_slots_kernel<0><<<n, 256, 0, x>>>(p);
    REQUIRE_CUDA_OK(cudaGetLastError());
  }
};

using CeRig = BasicCeRig<TensorMajorStorage>;

// Construction with `o` throws invalid_argument naming `needle`.
void expect_refused(const DeviceCacheOptions& o, const char* needle) {
  try {
    CeCache c(cuda_runtime(), o, big_layout());
    FAIL("constructed");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
  }
}

}  // namespace

namespace {
// Every fill through the proxy, 12 forwards of all misses, stream ordered and with per-slot readiness:
// each slot's bytes checked, no error word, one proxy fill per miss.
template <class Rig>
void every_slot_holds_its_bytes() {
  for (const bool overlap : {false, true}) {
    CAPTURE(overlap);
    DeviceCacheOptions o;
    o.overlap = overlap;
    Rig r(o);
    CHECK(r.cache->fill_engine() == FillEngine::copy_engine);
    unsigned long long bad = 0;
    for (int s = 0; s < 12; ++s) {
      const unsigned long long b = r.step(s, overlap);
      const std::uint32_t err = r.cache->take_errors();
      CAPTURE(s);
      CHECK(b == 0ull);
      CHECK(err == 0u);
      bad += b;
    }
    CHECK(bad == 0ull);
    CHECK(r.cache->executor().proxy_fills() == r.cache->device_stats().misses);
    CHECK(r.cache->executor().proxy_fills() == 12u * Rig::n);
    CHECK(r.cache->executor().proxy_copy_call_ns() > 0u);
  }
}
}  // namespace

TEST_CASE("copy engine: every slot holds its expert's bytes, stream ordered and with per-slot readiness") {
  every_slot_holds_its_bytes<CeRig>();
}

// speculate_on_copy_engine, `rounds` fresh caches: a prefetch of `capacity` experts into the
// empty pool through the proxy (about 80 us a copy, one after another), then at once a forward
// of n other experts, which evicts prefetched slots and fills them with SM loads while the
// proxy's later copies are still in flight; the forward is checked with readiness. Returns the
// words that differed and ORs the error words into `errors`.
template <class Rig = CeRig>
unsigned long long speculate_then_evict(const DeviceCacheOptions& o, int rounds, std::uint32_t& errors,
                                        std::uint64_t& speculative, std::uint64_t& proxy_fills) {
  unsigned long long bad = 0;
  for (int k = 0; k < rounds; ++k) {
    Rig r(o, FillEngine::sm_loads);
    REQUIRE(r.cache->speculates_on_copy_engine());
    DeviceBuffer<std::int32_t> hint{static_cast<std::size_t>(CeRig::capacity)};
    std::vector<std::int32_t> h(CeRig::capacity);
    // Experts the forward of step 0 (ids 0..n-1) does not read.
    for (std::int32_t i = 0; i < CeRig::capacity; ++i) h[static_cast<std::size_t>(i)] = CeRig::n + i;
    REQUIRE_CUDA_OK(cudaMemcpyAsync(hint.get(), h.data(), h.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, r.x));
    PrefetchOptions po;
    po.max_bytes = std::int64_t{1} << 40;  // the capacity bounds it
    auto pv = r.cache->prefetch(hint.get(), CeRig::capacity, r.x, po);
    REQUIRE_MESSAGE(pv.ok(), std::string(pv.status().message()));
    bad += r.step(0, true);
    errors |= r.cache->take_errors();
    speculative += r.cache->device_stats().speculative_issued;
    proxy_fills += r.cache->executor().proxy_fills();
  }
  return bad;
}

TEST_CASE("speculate_on_copy_engine: prefetches through the proxy, forwards with SM loads; every slot holds its bytes") {
  DeviceCacheOptions o;
  o.overlap = true;
  o.speculate_on_copy_engine = true;
  std::uint32_t errors = 0;
  std::uint64_t speculative = 0, proxy_fills = 0;
  CHECK(speculate_then_evict(o, 6, errors, speculative, proxy_fills) == 0ull);
  CHECK(errors == 0u);
  CHECK(speculative == 6u * CeRig::capacity);
  CHECK(proxy_fills == speculative);  // only the prefetches went through the proxy
  // Later steps: forwards (all misses) after the speculative fills, still byte-exact.
  CeRig r(o, FillEngine::sm_loads);
  CHECK(r.cache->fill_engine() == FillEngine::sm_loads);
  for (int s = 0; s < 6; ++s) CHECK(r.step(s, true) == 0ull);
  CHECK(r.cache->executor().proxy_fills() == 0u);
  DeviceCacheOptions plain;
  plain.speculate_on_copy_engine = true;  // without overlap
  plain.num_experts = CeRig::experts;
  plain.capacity = CeRig::capacity;
  plain.max_ids = CeRig::n;
  plain.fill_engine = FillEngine::sm_loads;
  expect_refused(plain, "speculate_on_copy_engine without overlap");
}

TEST_CASE("copy engine on the expert-major storage (a fill is one copy): every slot holds its bytes, with and "
          "without readiness, and with the speculation only on the copy engine") {
  using Rig = BasicCeRig<ExpertMajorStorage>;
  every_slot_holds_its_bytes<Rig>();
  DeviceCacheOptions o;
  o.overlap = true;
  o.speculate_on_copy_engine = true;
  std::uint32_t errors = 0;
  std::uint64_t speculative = 0, proxy_fills = 0;
  CHECK(speculate_then_evict<Rig>(o, 4, errors, speculative, proxy_fills) == 0ull);
  CHECK(errors == 0u);
  CHECK(speculative == 4u * Rig::capacity);
  CHECK(proxy_fills == speculative);
}

TEST_CASE("speculate_on_copy_engine: edge P6 removed (the SM-load fill does not wait for a pending copy) -> stale slots") {
  DeviceCacheOptions o;
  o.overlap = true;
  o.speculate_on_copy_engine = true;
  o.test_skip_pending_copy_wait = true;
  std::uint32_t errors = 0;
  std::uint64_t speculative = 0, proxy_fills = 0;
  const unsigned long long bad = speculate_then_evict(o, 6, errors, speculative, proxy_fills);
  MESSAGE("P6 removed: " << bad << " words differed, error word " << errors);
  // The proxy's late copy overwrote a slot the forward filled (wrong bytes), or set its ready
  // word back so that the consumer's wait gave up.
  CHECK((bad > 0ull || (errors & plan_error_wait_timeout) != 0u));
}

TEST_CASE("copy engine: edge P2 removed (ready word before the copy) -> the consumer reads stale slots") {
  for (const bool overlap : {false, true}) {
    CAPTURE(overlap);
    DeviceCacheOptions o;
    o.overlap = overlap;
    o.test_ready_before_copy = true;
    CeRig r(o);
    unsigned long long bad = 0;
    for (int s = 0; s < 12; ++s) bad += r.step(s, overlap);
    CHECK(bad > 0ull);
  }
}

TEST_CASE("copy engine: edge P1 removed (posted before the fill list) -> the proxy copies a stale list") {
  DeviceCacheOptions o;
  o.test_post_before_list = true;
  o.overlap = true;
  CeRig r(o);
  unsigned long long bad = 0;
  for (int s = 0; s < 6; ++s) bad += r.step(s, true);
  // The proxy read the entry before it was written: wrong experts, or none (then the readiness
  // wait gives up and flags the error word).
  const std::uint32_t err = r.cache->take_errors();
  CHECK((bad > 0ull || (err & plan_error_wait_timeout) != 0u));
}

TEST_CASE("copy engine: a refused copy surfaces as a Status from the next call and in the error word, no hang") {
  DeviceCacheOptions o;
  o.test_fail_copies = true;
  CeRig r(o);
  (void)r.step(0, false);  // the copies fail; the ready words are still published
  const std::uint32_t err = r.cache->take_errors();
  CHECK((err & plan_error_fill_failed) != 0u);
  CHECK((err & plan_error_wait_timeout) == 0u);
  auto next = r.cache->prepare(r.ids.get(), CeRig::n, r.x);
  REQUIRE_FALSE(next.ok());
  CHECK(next.status().code() == ErrorCode::runtime_failure);
  CHECK(std::string(next.status().message()).find("copy-engine fill failed") != std::string::npos);
  // Reported once: the call after it runs (its copies fail again, reported by the call after).
  CHECK(r.cache->prepare(r.ids.get(), CeRig::n, r.x).ok());
  REQUIRE_CUDA_OK(cudaStreamSynchronize(r.x));
}

TEST_CASE("copy engine: a cache destroyed with copies in flight; the proxy serves the next cache; bad options refused") {
  {
    DeviceCacheOptions o;
    CeRig r(o);
    std::vector<std::int32_t> h = {1, 2, 3, 4, 5, 6};
    REQUIRE_CUDA_OK(cudaMemcpyAsync(r.ids.get(), h.data(), h.size() * 4, cudaMemcpyHostToDevice, r.x));
    auto p = r.cache->prefetch(r.ids.get(), CeRig::n, r.x, PrefetchOptions{std::int64_t{1} << 30, 1});
    REQUIRE(p.ok());
    r.cache.reset();  // waits for the proxy to take the request and for its copies (edge P4)
  }
  DeviceCacheOptions o;
  o.overlap = true;
  CeRig r(o);
  CHECK(r.step(0, true) == 0ull);
  // fill_by_consumer reads host memory with SM loads: refused with the copy engine.
  DeviceCacheOptions bad;
  bad.num_experts = 8;
  bad.capacity = 4;
  bad.max_ids = 4;
  bad.fill_engine = FillEngine::copy_engine;
  bad.fill_by_consumer = true;
  expect_refused(bad, "fill_by_consumer");
}

TEST_CASE("copy engine: a cache destroyed while another cache's step waits for the proxy; edge P5 removed -> that step stalls") {
  // The second cache's step is held back 20 ms by a kernel before it, so it posts after the
  // first cache left the proxy, while that cache frees its memory. With edge P5 the leaving
  // cache waits for the device first and the step completes; without it the free holds the
  // driver while it waits for the device, the proxy's copy call waits for the free, and the
  // step ends only when its bounded wait gives up.
  load_kernels(&hold_stream_kernel);
  for (const bool removed : {false, true}) {
    CAPTURE(removed);
    DeviceCacheOptions o;  // stream-ordered: the post kernel waits for every ready word
    CeRig b(o);
    DeviceCacheOptions leaving;
    leaving.test_skip_release_drain = removed;
    auto a = std::make_unique<CeRig>(leaving);
    REQUIRE(a->step(0, false) == 0ull);
    REQUIRE(b.step(0, false) == 0ull);
    REQUIRE(b.cache->take_errors() == 0u);
    hold_stream_kernel<<<1, 1, 0, b.x>>>(20'000'000ull);
    REQUIRE_CUDA_OK(cudaGetLastError());
    b.enqueue(1, false);
    a.reset();
    REQUIRE_CUDA_OK(cudaStreamSynchronize(b.x));
    const std::uint32_t errors = b.cache->take_errors();
    const unsigned long long bad = b.bad.download()[0];
    if (!removed) {
      CHECK(errors == 0u);
      CHECK(bad == 0ull);
    } else {
      CHECK((errors & plan_error_wait_timeout) != 0u);
    }
  }
}

TEST_CASE("fill engine automatic: resolved from the link profile; a stored profile of another expert size is refused") {
  DeviceCacheOptions o;
  o.num_experts = 8;
  o.capacity = 4;
  o.max_ids = 4;
  CeCache c(cuda_runtime(), o, big_layout());
  CHECK(c.fill_engine() != FillEngine::automatic);
  LinkProfile p;
  int device = 0;
  REQUIRE_CUDA_OK(cudaGetDevice(&device));
  REQUIRE(link_profile_for(device, total_bytes_per_expert(big_layout().tensors()), p).ok());
  CHECK(c.fill_engine() == p.choose_engine());
  LinkProfile other = p;
  other.expert_bytes += 4;
  o.link_profile = other;
  expect_refused(o, "link profile is for experts of");
  // A stored profile that says SM loads are slow picks the copy engine, and one that says they
  // are as fast picks SM loads, without measuring.
  other = p;
  other.sm_load_gbps = other.copy_engine_gbps_batch * 0.5;
  o.link_profile = other;
  CHECK(CeCache(cuda_runtime(), o, big_layout()).fill_engine() == FillEngine::copy_engine);
  other.sm_load_gbps = other.copy_engine_gbps_batch;
  o.link_profile = other;
  CHECK(CeCache(cuda_runtime(), o, big_layout()).fill_engine() == FillEngine::sm_loads);
  // Lookahead: an overlapping cache with room for the next forward's experts puts its
  // speculative copies on the copy engine where SM loads are as fast (forwards stay SM loads);
  // one that does not overlap, or whose pool holds only the current forward (4 slots, 4 ids),
  // decides from the bandwidths alone; with slow SM loads every fill takes the copy engine.
  o.lookahead = true;
  o.max_ids = 2;
  CHECK(CeCache(cuda_runtime(), o, big_layout()).fill_engine() == FillEngine::sm_loads);
  CHECK_FALSE(CeCache(cuda_runtime(), o, big_layout()).speculates_on_copy_engine());
  o.overlap = true;
  {
    CeCache split(cuda_runtime(), o, big_layout());
    CHECK(split.fill_engine() == FillEngine::sm_loads);
    CHECK(split.speculates_on_copy_engine());
  }
  o.max_ids = 4;
  CHECK_FALSE(CeCache(cuda_runtime(), o, big_layout()).speculates_on_copy_engine());
  o.max_ids = 2;
  other.sm_load_gbps = other.copy_engine_gbps_batch * 0.5;
  o.link_profile = other;
  {
    CeCache ce(cuda_runtime(), o, big_layout());
    CHECK(ce.fill_engine() == FillEngine::copy_engine);
    CHECK_FALSE(ce.speculates_on_copy_engine());
  }
  other.sm_load_gbps = other.copy_engine_gbps_batch;
  o.link_profile = other;
  o.max_ids = 4;
  o.overlap = false;
  o.lookahead = false;
  // fill_by_consumer where the copy engine is picked: the cache overlaps instead.
  other.sm_load_gbps = other.copy_engine_gbps_batch * 0.5;
  o.link_profile = other;
  o.fill_by_consumer = true;
  CeCache e(cuda_runtime(), o, big_layout());
  CHECK(e.fill_engine() == FillEngine::copy_engine);
  CHECK(e.view().missing == nullptr);
  CHECK(e.readiness().enabled());
}

// CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware work queue per context): the copy engine's forwards
// stall there (docs/design.md, "One hardware work queue"), so a cache naming copy_engine is refused
// before it allocates anything and automatic takes SM loads even where the profile says copy
// engine. The rule reads the variable when a cache is built; CUDA reads it when it creates a
// context, so this process's queues stay as they were.
TEST_CASE("copy engine with CUDA_DEVICE_MAX_CONNECTIONS=1: copy_engine refused, automatic takes SM loads") {
  const char* before = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const std::string saved = before != nullptr ? before : "";
  REQUIRE(setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 1) == 0);
  DeviceCacheOptions o;
  o.num_experts = CeRig::experts;
  o.capacity = CeRig::capacity;
  o.max_ids = 2;
  o.fill_engine = FillEngine::copy_engine;
  (void)cuda_runtime();  // the runtime object's own setup is not the refused cache's
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  size_t free_before = 0, free_after = 0, total = 0;
  REQUIRE_CUDA_OK(cudaMemGetInfo(&free_before, &total));
  expect_refused(o, "CUDA_DEVICE_MAX_CONNECTIONS=1");
  REQUIRE_CUDA_OK(cudaMemGetInfo(&free_after, &total));
  CHECK(free_after == free_before);
  // automatic with a stored profile of slow SM loads (alone: the copy engine for every fill), and
  // with lookahead room: SM loads for every fill, no speculation on the copy engine.
  LinkProfile slow;
  int device = 0;
  REQUIRE_CUDA_OK(cudaGetDevice(&device));
  char bus[32] = {};
  REQUIRE_CUDA_OK(cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), device));
  slow.device = device;
  slow.pci_bus_id = bus;
  slow.expert_bytes = total_bytes_per_expert(big_layout().tensors());
  slow.copy_engine_gbps_batch = 50.0;
  slow.sm_load_gbps = 25.0;
  o.fill_engine = FillEngine::automatic;
  o.link_profile = slow;
  o.overlap = true;
  o.lookahead = true;
  {
    CeCache c(cuda_runtime(), o, big_layout());
    CHECK(c.fill_engine() == FillEngine::sm_loads);
    CHECK_FALSE(c.speculates_on_copy_engine());
    CHECK(c.executor().proxy_fills() == 0u);
  }
  // The same options with eight queues: the profile decides again.
  REQUIRE(setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8", 1) == 0);
  CHECK(CeCache(cuda_runtime(), o, big_layout()).fill_engine() == FillEngine::copy_engine);
  if (before != nullptr) {
    REQUIRE(setenv("CUDA_DEVICE_MAX_CONNECTIONS", saved.c_str(), 1) == 0);
  } else {
    REQUIRE(unsetenv("CUDA_DEVICE_MAX_CONNECTIONS") == 0);
  }
}
