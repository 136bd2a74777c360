// ExpertCache on the real CUDA runtime (suite 'gpu'; the main exits 77 without a device).
// Every staging policy x storage runs the same checks with the six NVFP4 Marlin tensor sizes
// (hidden 2048, intermediate 512: 1 MiB, 512 KiB, 128 KiB, 64 KiB, 4 B, 4 B):
//  * eviction reuse: a reader of the slots (a CUDA graph captured beforehand: a GPU delay, then
//    copies of every slot tensor) is still running when the next prepare() evicts those slots;
//    the reader must see the OLD experts and the slots must end with the new ones. Variants:
//    same stream, prepare from another stream (ownership moves), invalidate() + prepare().
//  * the device resident map ends at the final generation after cross-stream calls;
//  * a consumer kernel reading through the forward map matches the host reference;
//  * prepare() captured into a CUDA graph (Gather, CopyStream, Inline) replays correctly;
//    Batched refuses capture and leaves the cache unchanged.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "expert_cache/cuda.hpp"
#include "support/cuda_support.hpp"
#include "support/slot_checksum.cuh"

using namespace expert_cache;
using Ids = std::vector<std::int32_t>;

namespace {

// ---- device helpers (tests/support/slot_checksum.cuh: spin_kernel, TensorRefs, word_weight) ----
using test_support::global_ns;
using test_support::spin_kernel;
using test_support::TensorRef;
using test_support::TensorRefs;
using test_support::word_weight;

// Consumer: for each routed pair, looks its expert up in the forward map and sums every word of
// the slot's six tensors (weighted by position). A wrong slot, a stale fill or a missing map
// entry changes the sum. `delay_ns` widens the window in which a wrongly ordered fill would land.
__global__ void checksum_kernel(TensorRefs refs, const std::int32_t* ids, const std::int32_t* expert_map,
                                std::int32_t num_experts, unsigned long long delay_ns, unsigned long long* out) {
  if (delay_ns != 0 && threadIdx.x == 0) {
    const unsigned long long t0 = global_ns();
    while (global_ns() - t0 < delay_ns) {
    }
  }
  __syncthreads();
  const int pair = static_cast<int>(blockIdx.y);
  const std::int32_t id = ids[pair];
  if (id < 0 || id >= num_experts) return;
  const std::int32_t slot = expert_map[id];
  if (slot < 0) return;
  unsigned long long acc = 0;
  for (int t = 0; t < static_cast<int>(num_expert_tensors); ++t) {
    const TensorRef r = refs.t[t];
    if (r.bytes == 0) continue;
    const auto* w = reinterpret_cast<const unsigned int*>(r.base + static_cast<unsigned long long>(slot) * r.stride);
    const unsigned long long words = r.bytes / 4;
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) {
      acc += static_cast<unsigned long long>(w[i]) * word_weight(static_cast<std::size_t>(t), i);
    }
  }
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(out + pair, acc);
}

// ---- host helpers --------------------------------------------------------------------------

ExplicitLayout nvfp4_layout() {
  return ExplicitLayout{{{{"w13", 1u << 20}, {"w2", 512u << 10}, {"w13_scale", 128u << 10}, {"w2_scale", 64u << 10},
                          {"w13_scale_2", 4}, {"w2_scale_2", 4}}}};
}

std::uint32_t pattern_word(std::size_t tensor, std::int32_t expert, std::size_t i) {
  std::uint64_t x = (tensor + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(expert) + 7) * 0xBF58476D1CE4E5B9ull ^
                    i * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  return static_cast<std::uint32_t>(x);
}

template <template <class> class S, class P>
using CudaCache = ExpertCache<S, Lru, P, ExplicitLayout, CudaRuntime>;

using InlineRow = CudaCache<TensorMajorStorage, Inline>;
using InlineWhole = CudaCache<ExpertMajorStorage, Inline>;
using CopyRow = CudaCache<TensorMajorStorage, CopyStream>;
using CopyWhole = CudaCache<ExpertMajorStorage, CopyStream>;
using BatchedRow = CudaCache<TensorMajorStorage, Batched>;
using BatchedWhole = CudaCache<ExpertMajorStorage, Batched>;
using GatherRow = CudaCache<TensorMajorStorage, Gather>;
using GatherWhole = CudaCache<ExpertMajorStorage, Gather>;

template <class Cache>
struct Fixture {
  CudaRuntime rt;
  cudaStream_t x = nullptr;  // main consumer stream
  cudaStream_t y = nullptr;  // a second consumer stream (ownership moves)
  std::unique_ptr<Cache> cache;
  std::int32_t experts;
  std::int32_t capacity;

  Fixture(std::int32_t num_experts, std::int32_t cap, std::int32_t top_k) : experts(num_experts), capacity(cap) {
    x = rt.create_stream().value();
    y = rt.create_stream().value();
    CacheOptions o;
    o.num_experts = num_experts;
    o.capacity = cap;
    o.top_k = top_k;
    o.log = {};
    cache = std::make_unique<Cache>(rt, o, nvfp4_layout());
    const auto& tensors = cache->storage().tensors();
    for (std::int32_t e = 0; e < num_experts; ++e) {
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        auto* p = reinterpret_cast<std::uint32_t*>(cache->storage().host_tensor(t, e));
        for (std::size_t i = 0; i < tensors[t].bytes_per_expert / 4; ++i) p[i] = pattern_word(t, e, i);
      }
    }
  }
  ~Fixture() {
    (void)cudaDeviceSynchronize();
    cache.reset();
    rt.destroy_stream(x);
    rt.destroy_stream(y);
  }

  [[nodiscard]] std::size_t slot_bytes_total() const {
    std::size_t n = 0;
    for (const auto& t : cache->storage().tensors()) n += t.bytes_per_expert;
    return n;
  }

  // Bytes of slot `slot` (six tensors back to back) read back from the device.
  std::vector<unsigned char> read_slot(std::int32_t slot) const {
    std::vector<unsigned char> out(slot_bytes_total());
    std::size_t off = 0;
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const SlotTensor st = cache->storage().slot_tensor(t);
      if (st.bytes == 0) continue;
      if (cudaMemcpy(out.data() + off, st.slot(slot), st.bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
        FAIL("cudaMemcpy of slot " << slot << " failed");
      }
      off += st.bytes;
    }
    return out;
  }

  // Host bytes of expert `e` in the same order as read_slot.
  std::vector<unsigned char> expert_bytes(std::int32_t e) const {
    std::vector<unsigned char> out(slot_bytes_total());
    std::size_t off = 0;
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const std::size_t b = cache->storage().tensors()[t].bytes_per_expert;
      std::memcpy(out.data() + off, cache->storage().host_tensor(t, e), b);
      off += b;
    }
    return out;
  }

  // Which tensor of slot `slot` differs from expert `e` ("" when all six match).
  std::string slot_mismatch(std::int32_t slot, std::int32_t e) const {
    const auto got = read_slot(slot);
    const auto want = expert_bytes(e);
    std::size_t off = 0;
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const std::size_t b = cache->storage().tensors()[t].bytes_per_expert;
      if (std::memcmp(got.data() + off, want.data() + off, b) != 0) {
        return "slot " + std::to_string(slot) + " tensor " + std::string(cache->storage().tensors()[t].name) +
               " does not hold expert " + std::to_string(e);
      }
      off += b;
    }
    return {};
  }

  std::vector<std::int32_t> device_map(const std::int32_t* dev) const {
    std::vector<std::int32_t> out(static_cast<std::size_t>(experts));
    if (cudaMemcpy(out.data(), dev, out.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost) != cudaSuccess) {
      FAIL("cudaMemcpy of a device map failed");
    }
    return out;
  }

  // The device maps equal the host's. invalidate() re-uploads only the resident map, so after
  // one the forward map is not compared.
  void check_maps_final(bool forward_too = true) const {
    const auto host = cache->resident_map_host();
    CHECK(device_map(cache->resident_map_device()) == std::vector<std::int32_t>(host.begin(), host.end()));
    if (!forward_too) return;
    const auto fwd = cache->forward_map_host();
    CHECK(device_map(cache->forward_map_device()) == std::vector<std::int32_t>(fwd.begin(), fwd.end()));
  }

  TensorRefs refs(const ForwardView& v) const {
    TensorRefs r;
    for (std::size_t t = 0; t < num_expert_tensors; ++t) r.t[t] = TensorRef{reinterpret_cast<const unsigned char*>(v.tensors[t].base), v.tensors[t].slot_stride,
                           v.tensors[t].bytes};
    return r;
  }

  // Host reference of checksum_kernel for expert e.
  unsigned long long reference_checksum(std::int32_t e) const {
    unsigned long long acc = 0;
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const auto* w = reinterpret_cast<const std::uint32_t*>(cache->storage().host_tensor(t, e));
      for (std::size_t i = 0; i < cache->storage().tensors()[t].bytes_per_expert / 4; ++i) {
        acc += static_cast<unsigned long long>(w[i]) * word_weight(t, i);
      }
    }
    return acc;
  }
};

// A device buffer owned by the test (bytes).
using DeviceBuffer = test_support::DeviceBuffer<>;

// The reader: captured beforehand as a graph on a scratch stream. GPU delay, then a copy of every
// slot's six tensors into `out` (slot-major, six tensors back to back).
template <class Cache>
cudaGraphExec_t capture_reader(const Fixture<Cache>& f, unsigned char* out, unsigned long long delay_ns) {
  cudaStream_t cap = nullptr;
  REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking));
  REQUIRE_CUDA_OK(cudaStreamBeginCapture(cap, cudaStreamCaptureModeThreadLocal));
  spin_kernel<<<1, 1, 0, cap>>>(delay_ns);
  std::size_t off = 0;
  for (std::int32_t s = 0; s < f.capacity; ++s) {
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const SlotTensor st = f.cache->storage().slot_tensor(t);
      if (st.bytes == 0) continue;
      REQUIRE_CUDA_OK(cudaMemcpyAsync(out + off, st.slot(s), st.bytes, cudaMemcpyDeviceToDevice, cap));
      off += st.bytes;
    }
  }
  cudaGraph_t graph = nullptr;
  REQUIRE_CUDA_OK(cudaStreamEndCapture(cap, &graph));
  cudaGraphExec_t exec = nullptr;
  REQUIRE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  REQUIRE_CUDA_OK(cudaGraphDestroy(graph));
  REQUIRE_CUDA_OK(cudaStreamDestroy(cap));
  return exec;
}

Ids ids_range(std::int32_t begin, std::int32_t end) {
  Ids v;
  for (std::int32_t e = begin; e < end; ++e) v.push_back(e);
  return v;
}

enum class Reuse { same_stream, other_stream, invalidate_other_stream };

const char* to_string(Reuse r) {
  switch (r) {
    case Reuse::same_stream: return "same stream";
    case Reuse::other_stream: return "prepare from another stream";
    case Reuse::invalidate_other_stream: return "invalidate() from another stream + prepare()";
  }
  return "?";
}

constexpr unsigned long long reader_delay_ns = 150'000'000;  // 150 ms

template <class Cache>
void eviction_reuse(Reuse mode) {
  constexpr std::int32_t experts = 16, capacity = 4;
  Fixture<Cache> f(experts, capacity, capacity);
  const std::size_t per_slot = f.slot_bytes_total();
  DeviceBuffer out(per_slot * capacity);
  cudaGraphExec_t reader = capture_reader(f, out.as<unsigned char>(), reader_delay_ns);
  cudaEvent_t reader_done = nullptr;
  REQUIRE_CUDA_OK(cudaEventCreateWithFlags(&reader_done, cudaEventDisableTiming));

  // 1. experts 0..3 resident, the device idle.
  auto first = f.cache->prepare(ids_range(0, capacity), f.x);
  REQUIRE_MESSAGE(first.ok(), first.status().to_string());
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  std::vector<std::int32_t> old_expert_of_slot(capacity, -1);
  for (std::int32_t e = 0; e < capacity; ++e) old_expert_of_slot[f.cache->forward_map_host()[e]] = e;

  // 2. the reader of those slots starts on the owner stream and keeps running.
  REQUIRE_CUDA_OK(cudaGraphLaunch(reader, f.x));
  REQUIRE_CUDA_OK(cudaEventRecord(reader_done, f.x));

  // 3. the next call evicts the slots while the reader runs.
  Ids second;
  if (mode == Reuse::invalidate_other_stream) {
    REQUIRE(f.cache->invalidate(0, f.y).ok());
    second = {capacity, 1, 2, 3};  // expert 4 takes the freed slot; 1..3 are hits
  } else {
    second = ids_range(capacity, 2 * capacity);
  }
  auto next = f.cache->prepare(second, mode == Reuse::same_stream ? f.x : f.y);
  const cudaError_t reader_state = cudaEventQuery(reader_done);
  (void)cudaGetLastError();
  REQUIRE_MESSAGE(next.ok(), next.status().to_string());
  CHECK_MESSAGE(reader_state == cudaErrorNotReady,
                "INCONCLUSIVE: the reader (" << reader_delay_ns / 1000000 << " ms GPU delay) had already finished when "
                "prepare() returned, so this run did not overlap slot reuse with a running reader");

  // 4. drain; the reader saw the old experts, the slots hold the new ones.
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  std::vector<unsigned char> seen(per_slot * capacity);
  REQUIRE_CUDA_OK(cudaMemcpy(seen.data(), out.get(), seen.size(), cudaMemcpyDeviceToHost));
  for (std::int32_t s = 0; s < capacity; ++s) {
    INFO("slot " << s << " held expert " << old_expert_of_slot[s] << " when the reader started");
    CHECK(std::memcmp(seen.data() + per_slot * s, f.expert_bytes(old_expert_of_slot[s]).data(), per_slot) == 0);
  }
  for (std::int32_t e : second) {
    const std::int32_t slot = f.cache->forward_map_host()[e];
    REQUIRE(slot >= 0);
    const std::string bad = f.slot_mismatch(slot, e);
    CHECK_MESSAGE(bad.empty(), bad);
  }
  f.check_maps_final();
  // Every route planned once: two accepted prepares, each miss fetched once, no fault/rollback.
  const CacheStats st = f.cache->stats();
  CHECK(st.prepare_calls == 2);
  CHECK(st.faults == 0);
  CHECK(st.misses == (mode == Reuse::invalidate_other_stream ? capacity + 1u : 2u * capacity));
  CHECK(st.generation >= 2);
  REQUIRE_CUDA_OK(cudaEventDestroy(reader_done));
  REQUIRE_CUDA_OK(cudaGraphExecDestroy(reader));
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE_TEMPLATE("eviction reuse waits for a running reader of the slots", Cache, InlineRow, InlineWhole, CopyRow,
                   CopyWhole, BatchedRow, BatchedWhole, GatherRow, GatherWhole) {
  for (Reuse mode : {Reuse::same_stream, Reuse::other_stream, Reuse::invalidate_other_stream}) {
    SUBCASE(to_string(mode)) { eviction_reuse<Cache>(mode); }
  }
}

TEST_CASE_TEMPLATE("resident map ends at the final generation after cross-stream calls", Cache, InlineRow, CopyWhole,
                   BatchedWhole, GatherRow) {
  constexpr std::int32_t experts = 12, capacity = 4;
  Fixture<Cache> f(experts, capacity, 2);
  DeviceBuffer out(f.slot_bytes_total() * capacity);
  cudaGraphExec_t reader = capture_reader(f, out.as<unsigned char>(), 50'000'000);
  std::mt19937 rng(7);
  for (int round = 0; round < 6; ++round) {
    const cudaStream_t s = round % 2 == 0 ? f.x : f.y;
    const cudaStream_t other = round % 2 == 0 ? f.y : f.x;
    Ids ids = {static_cast<std::int32_t>(rng() % experts), static_cast<std::int32_t>(rng() % experts)};
    auto v = f.cache->prepare(ids, s);
    REQUIRE_MESSAGE(v.ok(), v.status().to_string());
    REQUIRE_CUDA_OK(cudaGraphLaunch(reader, s));  // a reader still running during the next calls
    // invalidate from the other stream while that reader runs, then a prepare from it.
    REQUIRE(f.cache->invalidate(ids[0], other).ok());
    auto w = f.cache->prepare(Ids{ids[1], static_cast<std::int32_t>(rng() % experts)}, other);
    REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  }
  REQUIRE(f.cache->invalidate(static_cast<std::int32_t>(rng() % experts), f.y).ok());  // last call: an invalidate
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  f.check_maps_final(false);
  for (std::int32_t e = 0; e < experts; ++e) {
    const std::int32_t slot = f.cache->resident_map_host()[e];
    if (slot < 0) continue;
    const std::string bad = f.slot_mismatch(slot, e);
    CHECK_MESSAGE(bad.empty(), bad);
  }
  CHECK(f.cache->stats().faults == 0);
  REQUIRE_CUDA_OK(cudaGraphExecDestroy(reader));
}

TEST_CASE_TEMPLATE("a consumer reading through the forward map matches all-resident results", Cache, InlineRow,
                   InlineWhole, CopyRow, CopyWhole, BatchedRow, BatchedWhole, GatherRow, GatherWhole) {
  constexpr std::int32_t experts = 16, capacity = 8, top_k = 4, tokens = 2, forwards = 40;
  constexpr int pairs = top_k * tokens;
  Fixture<Cache> f(experts, capacity, top_k);
  std::mt19937 rng(11);
  std::vector<std::int32_t> all_ids(static_cast<std::size_t>(forwards * pairs));
  for (auto& id : all_ids) id = rng() % 10 == 0 ? -1 : static_cast<std::int32_t>(rng() % experts);  // some padding
  DeviceBuffer d_ids(all_ids.size() * sizeof(std::int32_t));
  DeviceBuffer d_out(all_ids.size() * sizeof(unsigned long long));
  REQUIRE_CUDA_OK(cudaMemcpy(d_ids.get(), all_ids.data(), all_ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));
  REQUIRE_CUDA_OK(cudaMemset(d_out.get(), 0, all_ids.size() * sizeof(unsigned long long)));
  std::uint64_t misses = 0;
  for (int fw = 0; fw < forwards; ++fw) {
    const cudaStream_t s = fw % 3 == 2 ? f.y : f.x;
    const std::span<const std::int32_t> ids(all_ids.data() + fw * pairs, pairs);
    auto view = f.cache->prepare(ids, s);
    REQUIRE_MESSAGE(view.ok(), view.status().to_string());
    misses += view.value().misses;
    checksum_kernel<<<dim3(8, pairs), 256, 0, s>>>(f.refs(view.value()), d_ids.as<std::int32_t>() + fw * pairs,
                                                    view.value().expert_map, experts, 200'000,
                                                    d_out.as<unsigned long long>() + fw * pairs);
    REQUIRE_CUDA_OK(cudaGetLastError());
  }
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  std::vector<unsigned long long> got(all_ids.size());
  REQUIRE_CUDA_OK(cudaMemcpy(got.data(), d_out.get(), got.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  std::vector<unsigned long long> ref(static_cast<std::size_t>(experts));
  for (std::int32_t e = 0; e < experts; ++e) ref[e] = f.reference_checksum(e);
  int wrong = 0;
  for (std::size_t i = 0; i < all_ids.size(); ++i) {
    const unsigned long long want = all_ids[i] < 0 ? 0 : ref[static_cast<std::size_t>(all_ids[i])];
    if (got[i] != want && wrong++ < 5) {
      MESSAGE("forward " << i / pairs << " pair " << i % pairs << " expert " << all_ids[i] << ": checksum "
                         << got[i] << ", all-resident reference " << want);
    }
  }
  CHECK(wrong == 0);
  CHECK(misses > static_cast<std::uint64_t>(capacity));  // evictions happened
  CHECK(f.cache->stats().faults == 0);
  f.check_maps_final();
}

TEST_CASE_TEMPLATE("prefetch on CUDA: speculative fills land before the forward that uses them; outputs match all-resident",
                   Cache, InlineWhole, CopyRow, CopyWhole, BatchedWhole) {
  // Per forward: prepare on x (or y), a slow checksum consumer, then a prefetch of the next
  // forward's experts plus wrong ids (scored: the wrong ones below min_score half of the time).
  // After the first adopted forward the fills run on the cache's speculative stream (edges 1s,
  // 9, 11): a forward that reads a prefetched expert must see its bytes, and a prefetch must never
  // overwrite a slot the running consumer reads.
  constexpr std::int32_t experts = 24, capacity = 12, top_k = 4, tokens = 1, forwards = 60;
  constexpr int pairs = top_k * tokens;
  Fixture<Cache> f(experts, capacity, top_k);
  std::mt19937 rng(23);
  std::vector<std::int32_t> all_ids(static_cast<std::size_t>(forwards * pairs));
  for (auto& id : all_ids) id = static_cast<std::int32_t>(rng() % experts);
  DeviceBuffer d_ids(all_ids.size() * sizeof(std::int32_t));
  DeviceBuffer d_out(all_ids.size() * sizeof(unsigned long long));
  REQUIRE_CUDA_OK(cudaMemcpy(d_ids.get(), all_ids.data(), all_ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));
  REQUIRE_CUDA_OK(cudaMemset(d_out.get(), 0, all_ids.size() * sizeof(unsigned long long)));
  const auto bytes = static_cast<std::int64_t>(f.slot_bytes_total());
  std::uint64_t issued = 0;
  for (int fw = 0; fw < forwards; ++fw) {
    const cudaStream_t s = fw % 5 == 4 ? f.y : f.x;
    const std::span<const std::int32_t> ids(all_ids.data() + fw * pairs, pairs);
    auto view = f.cache->prepare(ids, s);
    REQUIRE_MESSAGE(view.ok(), view.status().to_string());
    checksum_kernel<<<dim3(8, pairs), 256, 0, s>>>(f.refs(view.value()), d_ids.as<std::int32_t>() + fw * pairs,
                                                    view.value().expert_map, experts, 100'000,
                                                    d_out.as<unsigned long long>() + fw * pairs);
    REQUIRE_CUDA_OK(cudaGetLastError());
    if (fw + 1 == forwards) break;
    std::vector<std::int32_t> hints;
    std::vector<float> scores;
    for (int i = 0; i < pairs; ++i) {
      const std::int32_t e = all_ids[static_cast<std::size_t>((fw + 1) * pairs + i)];
      if (std::find(hints.begin(), hints.end(), e) == hints.end()) {
        hints.push_back(e);
        scores.push_back(0.9f);
      }
    }
    for (int i = 0; i < 2; ++i) {
      const auto e = static_cast<std::int32_t>(rng() % experts);
      if (std::find(hints.begin(), hints.end(), e) != hints.end()) continue;
      hints.push_back(e);
      scores.push_back(fw % 2 == 0 ? 0.2f : 0.7f);
    }
    PrefetchOptions o{static_cast<std::int64_t>(pairs) * bytes, 1};
    if (fw % 3 != 0) o.scores = scores;  // every third call unscored
    auto pv = f.cache->prefetch(hints, s, o);
    REQUIRE_MESSAGE(pv.ok(), pv.status().to_string());
    issued += pv.value().issued;
  }
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  std::vector<unsigned long long> got(all_ids.size());
  REQUIRE_CUDA_OK(cudaMemcpy(got.data(), d_out.get(), got.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (std::size_t i = 0; i < all_ids.size(); ++i) {
    const unsigned long long want = f.reference_checksum(all_ids[i]);
    if (got[i] != want && wrong++ < 5) {
      MESSAGE("forward " << i / pairs << " pair " << i % pairs << " expert " << all_ids[i] << ": checksum " << got[i]
                         << ", all-resident reference " << want);
    }
  }
  CHECK(wrong == 0);
  const CacheStats st = f.cache->stats();
  CHECK(st.speculative_issued == issued);
  CHECK(st.speculative_used > 20);  // the prefetches did serve later forwards
  CHECK(st.faults == 0);
  f.check_maps_final();
}

TEST_CASE_TEMPLATE("prepare() captured into a CUDA graph replays correctly", Cache, GatherRow, GatherWhole, CopyRow,
                   CopyWhole, InlineRow) {
  constexpr std::int32_t experts = 16, capacity = 4;
  Fixture<Cache> f(experts, capacity, capacity);
  DeviceBuffer d_ids(capacity * sizeof(std::int32_t));
  DeviceBuffer d_out(capacity * sizeof(unsigned long long));
  const Ids first = ids_range(0, capacity), second = ids_range(capacity, 2 * capacity);
  REQUIRE_CUDA_OK(cudaMemcpy(d_ids.get(), second.data(), second.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));

  auto v0 = f.cache->prepare(first, f.x);
  REQUIRE_MESSAGE(v0.ok(), v0.status().to_string());
  REQUIRE_CUDA_OK(cudaStreamSynchronize(f.x));

  // Capture prepare() (fills of 4 misses + both map uploads) and a consumer of its view.
  REQUIRE_CUDA_OK(cudaStreamBeginCapture(f.x, cudaStreamCaptureModeGlobal));
  auto view = f.cache->prepare(second, f.x);
  if (view.ok()) {
    (void)cudaMemsetAsync(d_out.get(), 0, capacity * sizeof(unsigned long long), f.x);
    checksum_kernel<<<dim3(8, capacity), 256, 0, f.x>>>(f.refs(view.value()), d_ids.as<std::int32_t>(),
                                                       view.value().expert_map, experts, 0,
                                                       d_out.as<unsigned long long>());
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(f.x, &graph);
  (void)cudaGetLastError();
  REQUIRE_MESSAGE(view.ok(), view.status().to_string());
  REQUIRE_CUDA_OK(end);
  cudaGraphExec_t exec = nullptr;
  REQUIRE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  // Nothing ran eagerly: the slots of the new experts still hold the old ones.
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  for (std::int32_t e : second) {
    const std::int32_t slot = f.cache->forward_map_host()[e];
    CHECK_MESSAGE(!f.slot_mismatch(slot, e).empty(), "slot " << slot << " was filled outside the graph");
  }

  std::vector<unsigned long long> ref;
  for (std::int32_t e : second) ref.push_back(f.reference_checksum(e));
  for (int replay = 0; replay < 3; ++replay) {
    CAPTURE(replay);
    if (replay > 0) {  // wipe the slots and maps: the replay must restore them
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        const SlotTensor st = f.cache->storage().slot_tensor(t);
        if (st.bytes != 0) REQUIRE_CUDA_OK(cudaMemset(st.base, 0xA5, st.slot_stride * (capacity - 1) + st.bytes));
      }
      REQUIRE_CUDA_OK(cudaMemset(const_cast<std::int32_t*>(f.cache->forward_map_device()), 0xFF, experts * sizeof(std::int32_t)));
    }
    REQUIRE_CUDA_OK(cudaGraphLaunch(exec, f.x));
    REQUIRE_CUDA_OK(cudaStreamSynchronize(f.x));
    for (std::int32_t e : second) {
      const std::string bad = f.slot_mismatch(f.cache->forward_map_host()[e], e);
      CHECK_MESSAGE(bad.empty(), bad);
    }
    std::vector<unsigned long long> got(capacity);
    REQUIRE_CUDA_OK(cudaMemcpy(got.data(), d_out.get(), got.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    CHECK(got == ref);
    f.check_maps_final();
  }
  REQUIRE_CUDA_OK(cudaGraphExecDestroy(exec));
  REQUIRE_CUDA_OK(cudaGraphDestroy(graph));

  // Eager use continues past the captured staging buffers and events (more prepares than the
  // staging ring holds, ownership moving between streams, an all-hit prepare on a new stream).
  auto hit = f.cache->prepare(second, f.y);
  REQUIRE_MESSAGE(hit.ok(), hit.status().to_string());
  std::mt19937 rng(3);
  for (int i = 0; i < 12; ++i) {
    Ids ids = {static_cast<std::int32_t>(rng() % experts), static_cast<std::int32_t>(rng() % experts)};
    auto v = f.cache->prepare(ids, i % 2 == 0 ? f.x : f.y);
    REQUIRE_MESSAGE(v.ok(), v.status().to_string());
  }
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  for (std::int32_t e = 0; e < experts; ++e) {
    const std::int32_t slot = f.cache->resident_map_host()[e];
    if (slot < 0) continue;
    const std::string bad = f.slot_mismatch(slot, e);
    CHECK_MESSAGE(bad.empty(), bad);
  }
  f.check_maps_final();
  CHECK(f.cache->stats().faults == 0);
}

TEST_CASE_TEMPLATE("Batched refuses a capturing stream and leaves the cache unchanged", Cache, BatchedRow, BatchedWhole) {
  constexpr std::int32_t experts = 8, capacity = 4;
  Fixture<Cache> f(experts, capacity, capacity);
  REQUIRE(f.cache->prepare(ids_range(0, capacity), f.x).ok());
  REQUIRE_CUDA_OK(cudaStreamSynchronize(f.x));
  const CacheStats before = f.cache->stats();
  const auto resident_before = std::vector<std::int32_t>(f.cache->resident_map_host().begin(), f.cache->resident_map_host().end());

  REQUIRE_CUDA_OK(cudaStreamBeginCapture(f.x, cudaStreamCaptureModeGlobal));
  auto r = f.cache->prepare(ids_range(capacity, 2 * capacity), f.x);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(f.x, &graph);
  (void)cudaGetLastError();
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == ErrorCode::capture_unsupported);
  MESSAGE("Batched under capture: " << r.status().to_string());
  CHECK(end == cudaSuccess);  // nothing was enqueued: the capture ends cleanly
  if (graph != nullptr) REQUIRE_CUDA_OK(cudaGraphDestroy(graph));

  const CacheStats after = f.cache->stats();
  CHECK(after.prepare_calls == before.prepare_calls);
  CHECK(after.misses == before.misses);
  CHECK(after.generation == before.generation);
  CHECK(after.faults == before.faults);
  CHECK(std::vector<std::int32_t>(f.cache->resident_map_host().begin(), f.cache->resident_map_host().end()) == resident_before);
  for (std::int32_t e = 0; e < capacity; ++e) CHECK(f.slot_mismatch(f.cache->resident_map_host()[e], e).empty());
  // And the cache still works eagerly.
  REQUIRE(f.cache->prepare(ids_range(capacity, 2 * capacity), f.x).ok());
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  f.check_maps_final();
}

TEST_CASE("CudaRuntime: errors carry the call and CUDA's name; allocation kinds; register_host") {
  CudaRuntime rt;
  auto big = rt.allocate(std::size_t{1} << 50, MemoryKind::device);  // 1 PiB cannot exist
  REQUIRE_FALSE(big.ok());
  CHECK(big.status().code() == ErrorCode::runtime_failure);
  CHECK(big.status().message().find("cudaMalloc failed: cudaErrorMemoryAllocation") != std::string::npos);
  CHECK(cudaGetLastError() == cudaSuccess);  // the error was cleared

  auto pinned = rt.allocate(4096, MemoryKind::pinned_host);
  REQUIRE(pinned.ok());
  auto dev = rt.device_pointer(pinned.value());
  REQUIRE(dev.ok());
  rt.deallocate(pinned.value(), MemoryKind::pinned_host);

  std::vector<unsigned char> mine(1 << 16, 7);
  REQUIRE(rt.register_host(mine.data(), mine.size()).ok());
  CHECK(rt.device_pointer(mine.data()).ok());
  REQUIRE(rt.unregister_host(mine.data()).ok());

  auto s = rt.create_stream().value();
  auto e = rt.create_event().value();
  CHECK(rt.query(e).value());  // never recorded: complete
  REQUIRE(rt.record(e, s).ok());
  REQUIRE(rt.synchronize(e).ok());
  CHECK_FALSE(rt.is_capturing(s).value());
  CHECK(rt.capture_id(s).value() == 0);
  rt.destroy_event(e);
  rt.destroy_stream(s);
}

TEST_CASE("CudaRuntime: debug sync mode reports through the enqueuing call") {
  CudaRuntime rt(CudaRuntime::Options{.sync_after_enqueue = true});
  CHECK(rt.sync_after_enqueue());
  auto s = rt.create_stream().value();
  std::vector<unsigned char> a(1024, 1), b(1024, 0);
  REQUIRE(rt.copy_async(b.data(), a.data(), a.size(), s).ok());
  CHECK(b == a);  // synchronised: the copy already ran
  rt.destroy_stream(s);
}

}  // TEST_SUITE
