// Storages on the real CUDA runtime (suite 'gpu'; the main exits 77 without a device):
//  * ExpertMajorHostStorage (expert-major host pool, one contiguous [capacity, bytes] slot
//    array per tensor: fills scatter) over CALLER memory (a malloc'd host pool the storage
//    registers with cudaHostRegister, a cudaMalloc'd slot workspace) under CopyStream, Inline,
//    Batched and Gather: after every prepare every resident slot of every tensor is byte-checked
//    against the caller's host pool; NVFP4 Marlin tensor sizes plus a 7th tensor of 1000 bytes
//    (not a multiple of 16: the Gather kernel's 4-byte path and tails);
//  * TensorMajorStorage over caller per-tensor host spans under CopyStream and Gather (Gather
//    reads the registered memory zero-copy);
//  * Gather captured into a CUDA graph with the scatter storage, replayed.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "expert_cache/cuda.hpp"

using namespace expert_cache;
using Ids = std::vector<std::int32_t>;

namespace {

constexpr std::int32_t kExperts = 24;
constexpr std::int32_t kCapacity = 8;

ExplicitLayout layout7() {
  ExplicitLayout l{{{{"w13", 1u << 20}, {"w2", 512u << 10}, {"w13_scale", 128u << 10}, {"w2_scale", 64u << 10},
                     {"w13_scale_2", 4}, {"w2_scale_2", 4}}}};
  l.bytes[6] = TensorBytes{"w13_bias", 1000};
  return l;
}

unsigned char pattern(std::size_t t, std::int32_t e, std::size_t i) {
  std::uint64_t x = (t + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(e) + 7) * 0xBF58476D1CE4E5B9ull ^
                    (i / 8) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<unsigned char>(x >> (8 * (i % 8)));
}

struct HostMem {  // caller-owned, page aligned, not pinned (the storage registers it)
  explicit HostMem(std::size_t n) : bytes(n), p(static_cast<std::byte*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096))) {}
  ~HostMem() { std::free(p); }
  std::size_t bytes;
  std::byte* p;
};

struct DeviceMem {
  explicit DeviceMem(std::size_t n) : bytes(n) { REQUIRE(cudaMalloc(&p, n) == cudaSuccess); }
  ~DeviceMem() { (void)cudaFree(p); }
  std::size_t bytes;
  void* p = nullptr;
};

std::vector<Ids> trace(std::uint64_t seed, int steps) {
  std::mt19937_64 g(seed);
  std::vector<Ids> out;
  for (int s = 0; s < steps; ++s) {
    Ids ids;
    for (int k = 0; k < 4; ++k) ids.push_back(static_cast<std::int32_t>(g() % kExperts));
    out.push_back(ids);
  }
  return out;
}

// Every resident slot of every tensor holds its expert's host bytes.
template <class Cache>
void check_slots(const Cache& cache, std::uint64_t& checked) {
  const auto& st = cache.storage();
  const auto resident = cache.resident_map_host();
  std::vector<unsigned char> got;
  for (std::int32_t e = 0; e < kExperts; ++e) {
    const std::int32_t slot = resident[static_cast<std::size_t>(e)];
    if (slot < 0) continue;
    for (std::size_t t = 0; t < max_expert_tensors; ++t) {
      const SlotTensor s = st.slot_tensor(t);
      if (s.bytes == 0) continue;
      got.resize(s.bytes);
      REQUIRE(cudaMemcpy(got.data(), s.slot(slot), s.bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
      const bool same = std::memcmp(got.data(), st.host_tensor(t, e), s.bytes) == 0;
      if (!same) FAIL("slot " << slot << " tensor " << st.tensors()[t].name << " does not hold expert " << e);
      ++checked;
    }
  }
}

template <class Cache>
void run_trace(Cache& cache, cudaStream_t stream, std::uint64_t seed) {
  std::uint64_t checked = 0;
  for (const Ids& ids : trace(seed, 60)) {
    auto v = cache.prepare(ids, stream);
    REQUIRE(v.ok());
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    check_slots(cache, checked);
  }
  CHECK(checked > 0);
  CHECK(cache.stats().misses > kCapacity);  // evictions happened: slots were rewritten
}

template <class Staging>
void scatter_case(std::uint64_t seed) {
  CudaRuntime rt;
  cudaStream_t stream = rt.create_stream().value();
  const ExplicitLayout layout = layout7();
  const BlobLayout bl = ExpertMajorHostStorage<CudaRuntime>::blob_layout(layout.tensors());
  HostMem host(kExperts * bl.blob_bytes);
  for (std::int32_t e = 0; e < kExperts; ++e)
    for (std::size_t t = 0; t < max_expert_tensors; ++t)
      for (std::size_t i = 0; i < layout.bytes[t].bytes_per_expert; ++i)
        reinterpret_cast<unsigned char*>(host.p)[static_cast<std::size_t>(e) * bl.blob_bytes + bl.offsets[t] + i] = pattern(t, e, i);
  DeviceMem ws(ExpertMajorHostStorage<CudaRuntime>::slot_workspace_bytes({kExperts, kCapacity}, layout.tensors()));
  {
    CacheOptions o;
    o.num_experts = kExperts;
    o.capacity = kCapacity;
    o.top_k = 4;
    o.memory.host_pool = MemorySpan{host.p, host.bytes};
    o.memory.slot_workspace = MemorySpan{ws.p, ws.bytes};
    ExpertCache<ExpertMajorHostStorage, Lru, Staging, ExplicitLayout, CudaRuntime> cache(rt, o, layout);
    const CopyRegions& r = cache.storage().copy_regions();
    REQUIRE(r.count == 7);
    for (std::size_t t = 0; t < 7; ++t) {
      CHECK(r.regions[t].host_base == host.p + bl.offsets[t]);  // the caller's memory, not a copy
      CHECK(r.regions[t].host_stride == bl.blob_bytes);
      CHECK(r.regions[t].slot_stride == layout.bytes[t].bytes_per_expert);
      CHECK(cache.storage().slot_tensor(t).contiguous());
    }
    run_trace(cache, stream, seed);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  }
  // Unregistered by the storage: registering again succeeds.
  CHECK(cudaHostRegister(host.p, host.bytes, cudaHostRegisterDefault) == cudaSuccess);
  CHECK(cudaHostUnregister(host.p) == cudaSuccess);
  rt.destroy_stream(stream);
}

template <class Staging>
void tensor_major_caller_case(std::uint64_t seed) {
  CudaRuntime rt;
  cudaStream_t stream = rt.create_stream().value();
  const ExplicitLayout layout = layout7();
  std::vector<std::unique_ptr<HostMem>> pools;
  CacheOptions o;
  o.num_experts = kExperts;
  o.capacity = kCapacity;
  o.top_k = 4;
  for (std::size_t t = 0; t < 7; ++t) {
    const std::size_t b = layout.bytes[t].bytes_per_expert;
    pools.push_back(std::make_unique<HostMem>(kExperts * b));
    for (std::int32_t e = 0; e < kExperts; ++e)
      for (std::size_t i = 0; i < b; ++i)
        reinterpret_cast<unsigned char*>(pools.back()->p)[static_cast<std::size_t>(e) * b + i] = pattern(t, e, i);
    o.memory.host_tensors[t] = MemorySpan{pools.back()->p, pools.back()->bytes};
  }
  ExpertCache<TensorMajorStorage, Lru, Staging, ExplicitLayout, CudaRuntime> cache(rt, o, layout);
  for (std::size_t t = 0; t < 7; ++t) CHECK(cache.storage().copy_regions().regions[t].host_base == pools[t]->p);
  run_trace(cache, stream, seed);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  rt.destroy_stream(stream);
}

}  // namespace

TEST_CASE("expert-major host + per-tensor slots over caller memory: CopyStream") { scatter_case<CopyStream>(1); }
TEST_CASE("expert-major host + per-tensor slots over caller memory: Inline") { scatter_case<Inline>(2); }
TEST_CASE("expert-major host + per-tensor slots over caller memory: Batched") { scatter_case<Batched>(3); }
TEST_CASE("expert-major host + per-tensor slots over caller memory: Gather") { scatter_case<Gather>(4); }
TEST_CASE("tensor-major storage over caller host spans: CopyStream") { tensor_major_caller_case<CopyStream>(5); }
TEST_CASE("tensor-major storage over caller host spans: Gather (zero-copy reads of registered memory)") {
  tensor_major_caller_case<Gather>(6);
}

TEST_CASE("Gather with the scatter storage inside a CUDA graph") {
  CudaRuntime rt;
  cudaStream_t stream = rt.create_stream().value();
  CacheOptions o;
  o.num_experts = kExperts;
  o.capacity = kCapacity;
  o.top_k = 4;
  ExpertCache<ExpertMajorHostStorage, Lru, Gather, ExplicitLayout, CudaRuntime> cache(rt, o, layout7());
  const auto& st = cache.storage();
  for (std::int32_t e = 0; e < kExperts; ++e)
    for (std::size_t t = 0; t < max_expert_tensors; ++t)
      for (std::size_t i = 0; i < st.tensors()[t].bytes_per_expert; ++i)
        reinterpret_cast<unsigned char*>(st.host_tensor(t, e))[i] = pattern(t, e, i);
  // Warm-up outside capture (resolves the mapped addresses), then capture one miss-heavy forward.
  REQUIRE(cache.prepare(Ids{0, 1, 2, 3}, stream).ok());
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
  auto v = cache.prepare(Ids{4, 5, 6, 7}, stream);
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  (void)cudaGetLastError();
  REQUIRE_MESSAGE(v.ok(), v.status().to_string());
  REQUIRE(end == cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  for (int replay = 0; replay < 3; ++replay) {
    CAPTURE(replay);
    if (replay > 0) {  // wipe the captured forward's slots: the replay must restore them
      for (std::int32_t e = 4; e < 8; ++e) {
        const std::int32_t slot = cache.resident_map_host()[static_cast<std::size_t>(e)];
        for (std::size_t t = 0; t < max_expert_tensors; ++t) {
          const SlotTensor s = st.slot_tensor(t);
          if (s.bytes != 0) REQUIRE(cudaMemset(s.slot(slot), 0xA5, s.bytes) == cudaSuccess);
        }
      }
    }
    REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    std::uint64_t checked = 0;
    check_slots(cache, checked);
    CHECK(checked == 8 * 7);
  }
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
  rt.destroy_stream(stream);
}
