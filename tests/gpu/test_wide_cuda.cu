// Wide forwards (prepare_wide) on the real CUDA runtime (suite 'gpu'; the main exits 77 without
// a device). Row and whole-expert caches with the six NVFP4 Marlin tensor sizes (1 MiB, 512 KiB,
// 128 KiB, 64 KiB, 4 B, 4 B), stream admission (runs and span copies), admit admission, and the
// fallback of a cache without stream slots. Per round the consumer enqueues on the prepare_wide
// stream, with no host wait: a GPU delay (so a wrongly ordered fill of a later round would land
// while the round is still being read), a copy of the round's device forward map, and a checksum
// kernel over the round's experts read through that map. After the forward: every expert's
// checksum equals the host reference (its slot held exactly its bytes when read), every round's
// map names exactly its experts at the slots the round reported, the rounds partition the
// forward, the host returned before the device finished (no host sync inside), and stream
// admission left the pool as it was. A capturing stream is refused with nothing changed. The
// device-planned cache (DeviceExpertCache::prepare_wide from host ids: the resident map read
// back, stream rounds copied by the copy engine) under the same checks.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "expert_cache/cuda.hpp"
#include "expert_cache/device_cache/cuda_executor.cuh"
#include "support/cuda_support.hpp"
#include "support/slot_checksum.cuh"

using namespace expert_cache;
using Ids = std::vector<std::int32_t>;

namespace {

// ---- device helpers (tests/support/slot_checksum.cuh: spin_kernel, TensorRefs, word_weight) ----
using test_support::spin_kernel;
using test_support::TensorRef;
using test_support::TensorRefs;
using test_support::word_weight;

// out[k] += the weighted sum of every word of expert ids[k]'s six tensors, read from the slot
// the forward map names (nothing when the map has no slot for it: the reference then differs).
__global__ void checksum_kernel(TensorRefs refs, const std::int32_t* ids, const std::int32_t* expert_map,
                                std::int32_t num_experts, unsigned long long* out) {
  const int k = static_cast<int>(blockIdx.y);
  const std::int32_t id = ids[k];
  if (id < 0 || id >= num_experts) return;
  const std::int32_t slot = expert_map[id];
  if (slot < 0) return;
  unsigned long long acc = 0;
  for (int t = 0; t < static_cast<int>(num_expert_tensors); ++t) {
    const TensorRef r = refs.t[t];
    if (r.bytes == 0) continue;
    const auto* w = reinterpret_cast<const unsigned int*>(r.base + static_cast<unsigned long long>(slot) * r.stride);
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < r.bytes / 4; i += gridDim.x * blockDim.x)
      acc += static_cast<unsigned long long>(w[i]) * word_weight(static_cast<std::size_t>(t), i);
  }
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(out + k, acc);
}

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
using CopyRow = CudaCache<TensorMajorStorage, CopyStream>;
using CopyWhole = CudaCache<ExpertMajorStorage, CopyStream>;
using InlineWhole = CudaCache<ExpertMajorStorage, Inline>;
using DeviceRow = DeviceExpertCache<TensorMajorStorage, ExplicitLayout, CudaRuntime>;
using DeviceWhole = DeviceExpertCache<ExpertMajorStorage, ExplicitLayout, CudaRuntime>;
template <class Cache>
inline constexpr bool device_planned = requires(Cache& c, cudaStream_t s) { c.prepare_group(std::int32_t{1}, s); };

template <class T>
using DeviceArray = test_support::DeviceBuffer<T>;
template <class T>
using PinnedArray = test_support::PinnedBuffer<T>;

constexpr std::int32_t num_experts = 48;
constexpr std::int32_t capacity = 8;
constexpr unsigned long long round_delay_ns = 2'000'000;  // 2 ms per round

template <class Cache>
struct WideCudaFixture {
  CudaRuntime rt;
  cudaStream_t x = nullptr;
  std::unique_ptr<Cache> cache;

  explicit WideCudaFixture(std::int32_t stream_slots) {
    x = rt.create_stream().value();
    if constexpr (device_planned<Cache>) {
      DeviceCacheOptions o;
      o.num_experts = num_experts;
      o.capacity = capacity;
      o.max_ids = 64;
      o.stream_slots = stream_slots;
      cache = std::make_unique<Cache>(rt, o, nvfp4_layout());
    } else {
      CacheOptions o;
      o.num_experts = num_experts;
      o.capacity = capacity;
      o.top_k = 4;
      o.stream_slots = stream_slots;
      o.log = {};
      cache = std::make_unique<Cache>(rt, o, nvfp4_layout());
    }
    const auto& tensors = cache->storage().tensors();
    for (std::int32_t e = 0; e < num_experts; ++e) {
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        auto* p = reinterpret_cast<std::uint32_t*>(cache->storage().host_tensor(t, e));
        for (std::size_t i = 0; i < tensors[t].bytes_per_expert / 4; ++i) p[i] = pattern_word(t, e, i);
      }
    }
  }
  ~WideCudaFixture() {
    (void)cudaDeviceSynchronize();
    cache.reset();
    rt.destroy_stream(x);
  }

  unsigned long long reference_checksum(std::int32_t e) const {
    unsigned long long acc = 0;
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const auto* w = reinterpret_cast<const std::uint32_t*>(cache->storage().host_tensor(t, e));
      for (std::size_t i = 0; i < cache->storage().tensors()[t].bytes_per_expert / 4; ++i)
        acc += static_cast<unsigned long long>(w[i]) * word_weight(t, i);
    }
    return acc;
  }

  // The pool's resident map as the device holds it (waits for the device).
  std::vector<std::int32_t> resident_map() const {
    REQUIRE_CUDA_OK(cudaDeviceSynchronize());
    std::vector<std::int32_t> dev(static_cast<std::size_t>(num_experts));
    REQUIRE_CUDA_OK(cudaMemcpy(dev.data(), cache->resident_map_device(), dev.size() * sizeof(std::int32_t),
                               cudaMemcpyDeviceToHost));
    return dev;
  }
  // A normal forward of `ids` (device-planned: uploaded first, planned on the device).
  Result<ForwardView> prepare(const Ids& ids) {
    if constexpr (device_planned<Cache>) {
      if (!ids_dev) ids_dev = std::make_unique<test_support::DeviceBuffer<std::int32_t>>(64);
      REQUIRE_CUDA_OK(cudaMemcpyAsync(ids_dev->get(), ids.data(), ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, x));
      return cache->prepare(ids_dev->get(), static_cast<std::int32_t>(ids.size()), x);
    } else {
      return cache->prepare(ids, x);
    }
  }
  std::unique_ptr<test_support::DeviceBuffer<std::int32_t>> ids_dev;

  static TensorRefs refs(const ForwardView& v) {
    TensorRefs r;
    for (std::size_t t = 0; t < num_expert_tensors; ++t)
      r.t[t] = TensorRef{reinterpret_cast<const unsigned char*>(v.tensors[t].base), v.tensors[t].slot_stride, v.tensors[t].bytes};
    return r;
  }
};

// Top-k ids of `tokens` tokens (duplicates across tokens, a few -1) covering `experts` ids.
Ids routing(std::int32_t tokens, std::int32_t top_k, const Ids& experts, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Ids ids;
  for (std::int32_t i = 0; i < tokens * top_k; ++i) {
    if (i < static_cast<std::int32_t>(experts.size())) {
      ids.push_back(experts[static_cast<std::size_t>(i)]);
    } else {
      const auto r = rng() % (experts.size() + 1);
      ids.push_back(r == experts.size() ? -1 : experts[r]);
    }
  }
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

// One wide forward with the checking consumer; every check after the device drained.
template <class Cache>
WideSummary wide_checked(WideCudaFixture<Cache>& f, const Ids& topk, WideOptions options) {
  Ids unique;
  for (const std::int32_t e : topk)
    if (e >= 0) unique.push_back(e);
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  const auto E = static_cast<std::size_t>(num_experts);
  const std::size_t max_rounds = E + 1;
  PinnedArray<std::int32_t> round_ids(E);              // each round its own range: no reuse in flight
  DeviceArray<std::int32_t> round_ids_dev(E);
  DeviceArray<unsigned long long> sums(E);
  DeviceArray<std::int32_t> maps(max_rounds * E);      // each round's device forward map, as read
  REQUIRE_CUDA_OK(cudaMemset(sums.get(), 0, sums.bytes()));
  const std::vector<std::int32_t> resident_before = f.resident_map();
  std::vector<Ids> rounds, slots;
  std::size_t off = 0;
  auto r = f.cache->prepare_wide(
      topk, f.x,
      [&](const WideRound& round) -> Status {
        if (round.index >= max_rounds || off + round.experts.size() > E) return Status(ErrorCode::internal, "too many");
        rounds.emplace_back(round.experts.begin(), round.experts.end());
        slots.emplace_back(round.slots.begin(), round.slots.end());
        std::copy(round.experts.begin(), round.experts.end(), round_ids.get() + off);
        spin_kernel<<<1, 1, 0, f.x>>>(round_delay_ns);
        if (Status s = cuda_status(cudaGetLastError(), "spin_kernel"); !s) return s;
        if (Status s = cuda_status(cudaMemcpyAsync(maps.get() + round.index * E, round.view.expert_map, E * sizeof(std::int32_t),
                                                   cudaMemcpyDeviceToDevice, f.x),
                                   "cudaMemcpyAsync(map)");
            !s)
          return s;
        const auto n = round.experts.size();
        if (n != 0) {
          if (Status s = cuda_status(cudaMemcpyAsync(round_ids_dev.get() + off, round_ids.get() + off, n * sizeof(std::int32_t),
                                                     cudaMemcpyHostToDevice, f.x),
                                     "cudaMemcpyAsync(ids)");
              !s)
            return s;
          checksum_kernel<<<dim3(64, static_cast<unsigned>(n)), 256, 0, f.x>>>(
              WideCudaFixture<Cache>::refs(round.view), round_ids_dev.get() + off, round.view.expert_map, num_experts,
              sums.get() + off);
          if (Status s = cuda_status(cudaGetLastError(), "checksum_kernel"); !s) return s;
        }
        off += n;
        return {};
      },
      options);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  // The host returned while the device still works on the rounds: no host wait inside.
  const cudaError_t busy = cudaStreamQuery(f.x);
  (void)cudaGetLastError();
  CHECK_MESSAGE(busy == cudaErrorNotReady, "prepare_wide returned after the device finished " << rounds.size()
                                                                                               << " rounds of 2 ms");
  REQUIRE_CUDA_OK(cudaStreamSynchronize(f.x));
  const WideSummary s = r.value();
  REQUIRE(rounds.size() == s.rounds);
  CHECK(s.unique == unique.size());
  // The rounds partition the forward.
  Ids seen;
  for (const Ids& ids : rounds) seen.insert(seen.end(), ids.begin(), ids.end());
  std::sort(seen.begin(), seen.end());
  CHECK(seen == unique);
  // Every expert read the bytes of its host expert.
  const std::vector<unsigned long long> got = sums.download();
  const std::vector<std::int32_t> all_maps = maps.download();
  std::size_t k = 0;
  for (std::size_t i = 0; i < rounds.size(); ++i) {
    for (std::size_t j = 0; j < rounds[i].size(); ++j, ++k) {
      INFO("round " << i << " expert " << rounds[i][j] << " slot " << slots[i][j]);
      CHECK(got[k] == f.reference_checksum(rounds[i][j]));
    }
    // The round's map names exactly its experts, at the slots it reported.
    std::vector<std::int32_t> want(E, absent_slot);
    for (std::size_t j = 0; j < rounds[i].size(); ++j) want[static_cast<std::size_t>(rounds[i][j])] = slots[i][j];
    INFO("round " << i);
    CHECK(std::equal(want.begin(), want.end(), all_maps.begin() + static_cast<std::ptrdiff_t>(i * E)));
  }
  if (s.admission == WideAdmission::stream) CHECK(f.resident_map() == resident_before);
  if constexpr (!device_planned<Cache>) {
    // The device resident map equals the host's.
    const std::vector<std::int32_t> dev = f.resident_map();
    const auto host = f.cache->resident_map_host();
    CHECK(std::equal(host.begin(), host.end(), dev.begin()));
  }
  return s;
}

// Runs `call(stream)` on a fresh stream under capture; returns what it returned and the nodes
// the capture got.
template <class Call>
auto captured(Call&& call) {
  cudaStream_t cap = nullptr;
  REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking));
  REQUIRE_CUDA_OK(cudaStreamBeginCapture(cap, cudaStreamCaptureModeThreadLocal));
  auto result = call(cap);
  cudaGraph_t graph = nullptr;
  REQUIRE_CUDA_OK(cudaStreamEndCapture(cap, &graph));
  std::size_t nodes = 0;
  REQUIRE_CUDA_OK(cudaGraphGetNodes(graph, nullptr, &nodes));
  REQUIRE_CUDA_OK(cudaGraphDestroy(graph));
  REQUIRE_CUDA_OK(cudaStreamDestroy(cap));
  return std::pair{std::move(result), nodes};
}

Ids range(std::int32_t b, std::int32_t e) {
  Ids v;
  for (std::int32_t i = b; i < e; ++i) v.push_back(i);
  return v;
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE_TEMPLATE("prepare_wide on CUDA: stream admission, every round's bytes and map", Cache, CopyRow, CopyWhole,
                   InlineWhole, DeviceRow, DeviceWhole) {
  WideCudaFixture<Cache> f(8);
  auto warm = f.prepare(Ids{1, 5, 9, 30});
  REQUIRE(warm.ok());
  REQUIRE_CUDA_OK(cudaStreamSynchronize(f.x));
  const CacheStats s0 = f.cache->stats();
  const WideSummary s = wide_checked(f, routing(64, 4, range(0, num_experts), 3), WideOptions{WideAdmission::stream, WideCopy::runs});
  CHECK(s.hits == 4);
  CHECK(s.streamed == num_experts - 4);
  CHECK(s.rounds == 11);  // 44 missing experts in halves of 4
  const CacheStats s1 = f.cache->stats();
  CHECK(s1.hits == s0.hits);
  CHECK(s1.misses == s0.misses);
  CHECK(s1.faults == 0);
  CHECK(s1.wide_streamed == num_experts - 4);
  // Usable afterwards: a normal forward reads its experts.
  auto after = f.prepare(Ids{1, 40});
  REQUIRE(after.ok());
}

TEST_CASE_TEMPLATE("prepare_wide on CUDA: span copies, unneeded experts never mapped", Cache, CopyRow, CopyWhole) {
  WideCudaFixture<Cache> f(8);
  REQUIRE(f.cache->prepare(Ids{5}, f.x).ok());
  REQUIRE_CUDA_OK(cudaStreamSynchronize(f.x));
  const Ids experts{0, 2, 3, 5, 6, 9, 10, 11, 12, 30, 33, 47};
  const WideSummary s = wide_checked(f, routing(16, 2, experts, 5), WideOptions{WideAdmission::stream, WideCopy::span});
  CHECK(s.span_rounds == s.rounds);
  CHECK(s.wasted > 0);  // e.g. 1 and 4 inside [0, 3] / [2, 5]: copied, never mapped (the maps are checked)
  CHECK(s.streamed == experts.size() - 1);
}

TEST_CASE_TEMPLATE("prepare_wide on CUDA: admit admission through the pool", Cache, CopyRow, CopyWhole) {
  WideCudaFixture<Cache> f(0);
  const WideSummary s = wide_checked(f, routing(40, 4, range(0, 40), 7), WideOptions{WideAdmission::admit});
  CHECK(s.admission == WideAdmission::admit);
  CHECK_FALSE(s.fell_back);
  CHECK(s.rounds == 10);  // groups of capacity / 2
  CHECK(f.cache->stats().resident == capacity);
  // Stream admission asked of a cache without stream slots: served by admit.
  const WideSummary fb = wide_checked(f, routing(8, 4, range(8, 32), 9), WideOptions{});
  CHECK(fb.fell_back);
  CHECK(fb.admission == WideAdmission::admit);
}

TEST_CASE("prepare_wide on CUDA: a capturing stream is refused, nothing changes") {
  WideCudaFixture<CopyWhole> f(8);
  REQUIRE(f.cache->prepare(Ids{1, 2}, f.x).ok());
  REQUIRE_CUDA_OK(cudaStreamSynchronize(f.x));
  const CacheStats s0 = f.cache->stats();
  const std::vector<std::int32_t> before(f.cache->resident_map_host().begin(), f.cache->resident_map_host().end());
  int calls = 0;
  auto [r, nodes] = captured([&](cudaStream_t cap) {
    return f.cache->prepare_wide(range(0, num_experts), cap, [&](const WideRound&) {
      ++calls;
      return Status();
    });
  });
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == ErrorCode::capture_unsupported);
  CHECK(calls == 0);
  CHECK(nodes == 0);  // nothing was enqueued into the capture
  const CacheStats s1 = f.cache->stats();
  CHECK(s1.wide_forwards == s0.wide_forwards);
  CHECK(s1.total_copies == s0.total_copies);
  CHECK(s1.faults == s0.faults);
  const auto after = f.cache->resident_map_host();
  CHECK(std::equal(before.begin(), before.end(), after.begin()));
  // Still usable.
  const WideSummary s = wide_checked(f, routing(16, 4, range(0, 24), 11), WideOptions{});
  CHECK(s.streamed == 22);
}

TEST_CASE_TEMPLATE("prepare_wide on CUDA: the device-planned cache, span copies; its residents still hit; capture refused",
                   Cache, DeviceRow, DeviceWhole) {
  WideCudaFixture<Cache> f(8);
  REQUIRE(f.prepare(Ids{1, 5, 9, 30}).ok());
  REQUIRE_CUDA_OK(cudaStreamSynchronize(f.x));
  const CacheStats s0 = f.cache->stats();
  const WideSummary sp = wide_checked(f, routing(16, 2, Ids{0, 2, 3, 5, 6, 10, 11, 12, 33, 47}, 5),
                                      WideOptions{WideAdmission::stream, WideCopy::span});
  CHECK(sp.span_rounds == sp.rounds);
  CHECK(sp.hits == 1);  // expert 5
  // A plan on the device afterwards: the four residents still hit.
  REQUIRE(f.prepare(Ids{1, 5, 9, 30}).ok());
  REQUIRE_CUDA_OK(cudaStreamSynchronize(f.x));
  CHECK(f.cache->stats().hits == s0.hits + 4);
  CHECK(f.cache->take_errors() == 0);
  // A capturing stream is refused before anything is enqueued.
  auto [r, nodes] = captured([&](cudaStream_t cap) {
    return f.cache->prepare_wide(range(0, num_experts), cap, [](const WideRound&) { return Status(); });
  });
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == ErrorCode::capture_unsupported);
  CHECK(nodes == 0);
}

}  // TEST_SUITE
