// DeviceExpertCache<TensorMajorStorage, ExplicitLayout, CudaRuntime> against the host-planned
// CudaRowCache (Lru), step by step: the same hits/misses (device stats deltas), the same resident
// and forward maps, byte-identical slot contents; eagerly and inside one captured CUDA graph of
// several layers (router stand-in kernel writing ids on the device -> prepare -> consumer kernel
// [-> prepare_group -> consumer]...) replayed >= 1000 times with new ids each replay (the router
// reads a device step counter that the graph's last node bumps). Bad ids and overflowing
// forwards come from the router inside the graph. EXPERT_CACHE_DCACHE_STEPS sets the step count
// (default 1000).
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "expert_cache/cuda.hpp"
#include "expert_cache/device_cache/cuda_executor.cuh"
#include "expert_cache/eviction/crf.hpp"
#include "expert_cache/eviction/lfru.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "support/cuda_support.hpp"

using namespace expert_cache;
using namespace test_support;
using Ids = std::vector<std::int32_t>;
using DevCache = DeviceExpertCache<TensorMajorStorage, ExplicitLayout, CudaRuntime>;
using HostCache = CudaRowCache<ExplicitLayout>;

namespace {

// 16-aligned rows and one 20-byte row (the fill kernel's 4-byte path).
ExplicitLayout test_layout() {
  return ExplicitLayout{{{{"w13", 256}, {"w2", 128}, {"w13_scale", 32}, {"w2_scale", 20}, {"w13_scale_2", 16}, {"w2_scale_2", 16}}}};
}

std::byte pattern(std::size_t t, std::int32_t e, std::size_t i) {
  std::uint64_t x = (t + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(e) + 11) * 0xBF58476D1CE4E5B9ull ^
                    i * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<std::byte>(x & 0xFF);
}

template <class Cache>
void fill_pools(Cache& c, std::int32_t experts) {
  const auto& tensors = c.storage().tensors();
  for (std::int32_t e = 0; e < experts; ++e) {
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      std::byte* p = c.storage().host_tensor(t, e);
      for (std::size_t i = 0; i < tensors[t].bytes_per_expert; ++i) p[i] = pattern(t, e, i);
    }
  }
}

// The router stand-in: ids of step *counter, layer `layer`, from a device table.
template <int U = 0>
__global__ void router_kernel(const std::int32_t* table, const std::uint32_t* counter, std::int32_t layers,
                              std::int32_t layer, std::int32_t n_ids, std::int32_t steps, std::int32_t* out) {
  const std::uint32_t step = *counter % static_cast<std::uint32_t>(steps);
  const std::int32_t* src = table + (static_cast<std::size_t>(step) * layers + layer) * n_ids;
  for (std::int32_t i = threadIdx.x; i < n_ids; i += blockDim.x) out[i] = src[i];
}
template <int U = 0>
__global__ void bump_kernel(std::uint32_t* counter) {
  *counter += 1;
}

struct ReaderParams {
  const std::int32_t* forward_map;
  const std::int32_t* resident_map;
  const std::int32_t* ids;  // sanitized
  std::int32_t n_ids;
  std::int32_t num_experts;
  SlotTensor tensors[num_expert_tensors];
  const std::byte* pools[num_expert_tensors];  // mapped host pools (device addresses)
  unsigned long long* found;                   // ids of this layer found in their group
  unsigned long long* mismatches;
};

// The consumer: every id whose expert is in this group's forward map must have its bytes there.
template <int U = 0>
__global__ void reader_kernel(const ReaderParams p) {
  unsigned long long found = 0, bad = 0;
  for (std::int32_t i = threadIdx.x; i < p.n_ids; i += blockDim.x) {
    const std::int32_t e = p.ids[i];
    if (e < 0) continue;
    if (e >= p.num_experts) {
      ++bad;
      continue;
    }
    const std::int32_t slot = p.forward_map[e];
    if (slot < 0) continue;
    ++found;
    if (p.resident_map[e] != slot) ++bad;
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const SlotTensor& st = p.tensors[t];
      const std::byte* src = p.pools[t] + static_cast<std::size_t>(e) * st.bytes;
      const std::byte* dst = st.base + static_cast<std::size_t>(slot) * st.slot_stride;
      for (std::size_t k = 0; k < st.bytes; ++k) {
        if (src[k] != dst[k]) {
          ++bad;
          break;
        }
      }
    }
  }
  if (found) atomicAdd(p.found, found);
  if (bad) atomicAdd(p.mismatches, bad);
}

Ids sorted_unique_valid(const std::int32_t* ids, std::int32_t n, std::int32_t experts) {
  std::set<std::int32_t> u;
  for (std::int32_t i = 0; i < n; ++i) {
    if (ids[i] >= 0 && ids[i] < experts) u.insert(ids[i]);
  }
  return Ids(u.begin(), u.end());
}

struct Config {
  std::int32_t layers, experts, capacity, n_ids, steps;
  bool fused;
  // Lookahead: at layer l a predictor kernel on a side stream writes hint ids for
  // layer l + 1 (mostly that step's true ids, some wrong ones) and dev[l + 1] prefetches them
  // there, overlapping layer l's consumer; the host reference prefetches the same ids.
  std::int32_t hint_ids = 0;  // 0: no prefetch
  // The engine that moves the fills: SM loads (the fill kernels) or the copy engine (the
  // device's proxy thread, device_cache/copy_proxy.cuh).
  FillEngine engine = FillEngine::sm_loads;
};

// The predictor stand-in: hint ids of step *counter, layer `layer`, from a device table.
template <int U = 0>
__global__ void hint_kernel(const std::int32_t* table, const std::uint32_t* counter, std::int32_t layers,
                            std::int32_t layer, std::int32_t n, std::int32_t steps, std::int32_t* out) {
  const std::uint32_t step = *counter % static_cast<std::uint32_t>(steps);
  const std::int32_t* src = table + (static_cast<std::size_t>(step) * layers + layer) * n;
  for (std::int32_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = src[i];
}

// Dev: a DeviceExpertCache; Host: the host-planned cache with the same policy.
template <class Dev = DevCache, class Host = HostCache>
struct RigT {
  Config cfg;
  std::int32_t rounds;
  cudaStream_t x = nullptr;
  cudaStream_t host_x = nullptr;
  cudaStream_t side = nullptr;   // the prefetches' stream
  cudaEvent_t forked = nullptr;  // recorded on x before each prefetch: side starts after layer l's prepare
  std::vector<Ids> hints;        // [step][layer] -> hint_ids ids for layer + 1 (valid ids)
  DeviceBuffer<std::int32_t> d_hints;
  DeviceBuffer<std::int32_t> d_hint_ids;  // [layer][hint_ids]
  PrefetchOptions prefetch_options{};
  std::vector<std::unique_ptr<Dev>> dev;
  std::vector<std::unique_ptr<Host>> host;
  std::vector<Ids> table;  // [step][layer] -> n_ids ids
  DeviceBuffer<std::int32_t> d_table;
  DeviceBuffer<std::int32_t> d_ids;  // [layer][n_ids]
  DeviceBuffer<std::uint32_t> d_counter;
  // [layer], device memory (no atomics on mapped host memory over PCIe)
  DeviceBuffer<unsigned long long> found;
  DeviceBuffer<unsigned long long> mismatches;
  std::vector<ReaderParams> readers;

  static std::vector<std::int32_t> make_table(const Config& c, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<std::int32_t> t;
    for (std::int32_t s = 0; s < c.steps; ++s) {
      for (std::int32_t l = 0; l < c.layers; ++l) {
        // Skewed routing (a hot set plus a tail); every 9th step wide (overflow), every 7th bad ids.
        const bool wide = s % 9 == 4;
        for (std::int32_t i = 0; i < c.n_ids; ++i) {
          std::int32_t id;
          const auto r = rng() % 100;
          if (r < 5) {
            id = -1;
          } else if (s % 7 == 3 && r < 9) {
            const std::int32_t junk[] = {INT32_MIN, -5, c.experts, INT32_MAX};
            id = junk[rng() % 4];
          } else if (wide || r < 40) {
            id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.experts));
          } else {
            id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.capacity / 2 + 2));
          }
          t.push_back(id);
        }
      }
    }
    return t;
  }

  // Per step and layer l: hints for layer l + 1: its valid ids of the step (deduplicated, in
  // order), every third replaced by a random expert, padded with random experts.
  static std::vector<std::int32_t> make_hints(const Config& c, const std::vector<std::int32_t>& flat, std::uint64_t seed) {
    std::mt19937_64 rng(seed ^ 0x5151);
    std::vector<std::int32_t> h;
    for (std::int32_t s = 0; s < c.steps; ++s) {
      for (std::int32_t l = 0; l < c.layers; ++l) {
        Ids row;
        if (l + 1 < c.layers) {
          const auto* next = flat.data() + (static_cast<std::size_t>(s) * c.layers + l + 1) * c.n_ids;
          for (std::int32_t i = 0; i < c.n_ids && static_cast<std::int32_t>(row.size()) < c.hint_ids; ++i) {
            if (next[i] < 0 || next[i] >= c.experts) continue;
            row.push_back(rng() % 3 == 0 ? static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.experts)) : next[i]);
          }
        }
        while (static_cast<std::int32_t>(row.size()) < c.hint_ids) {
          row.push_back(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.experts)));
        }
        h.insert(h.end(), row.begin(), row.end());
      }
    }
    return h;
  }

  RigT(Config c, std::uint64_t seed)
      : cfg(c),
        d_hints(c.hint_ids > 0 ? make_hints(c, make_table(c, seed), seed) : std::vector<std::int32_t>{0}),
        d_hint_ids(static_cast<std::size_t>(std::max(1, c.layers * c.hint_ids))),
        d_table(make_table(c, seed)),
        d_ids(static_cast<std::size_t>(c.layers * c.n_ids)),
        d_counter(std::vector<std::uint32_t>{0u}),
        found(std::vector<unsigned long long>(static_cast<std::size_t>(c.layers), 0ull)),
        mismatches(std::vector<unsigned long long>(static_cast<std::size_t>(c.layers), 0ull)) {
    const std::vector<std::int32_t> flat = make_table(c, seed);
    for (std::int32_t s = 0; s < c.steps; ++s) {
      for (std::int32_t l = 0; l < c.layers; ++l) {
        const auto* p = flat.data() + (static_cast<std::size_t>(s) * c.layers + l) * c.n_ids;
        table.emplace_back(p, p + c.n_ids);
      }
    }
    REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
    REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&host_x, cudaStreamNonBlocking));
    REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    REQUIRE_CUDA_OK(cudaEventCreateWithFlags(&forked, cudaEventDisableTiming));
    if (c.hint_ids > 0) {
      const std::vector<std::int32_t> hf = make_hints(c, flat, seed);
      for (std::size_t i = 0; i < hf.size(); i += static_cast<std::size_t>(c.hint_ids)) {
        hints.emplace_back(hf.begin() + static_cast<std::ptrdiff_t>(i), hf.begin() + static_cast<std::ptrdiff_t>(i + c.hint_ids));
      }
      // Budget: half the hints (whole experts), each fill protected for one forward; the host
      // reference without precision feedback, which the device-planned cache does not apply.
      const auto bytes = static_cast<std::int64_t>(total_bytes_per_expert(test_layout().tensors()));
      prefetch_options = PrefetchOptions{bytes * std::max(1, c.hint_ids / 2), 1, {}, default_min_score, false};
    }
    for (std::int32_t l = 0; l < c.layers; ++l) {
      DeviceCacheOptions o;
      o.num_experts = c.experts;
      o.capacity = c.capacity;
      o.max_ids = c.n_ids;
      o.fused_plan_fill = c.fused;
      o.fill_engine = c.engine;
      dev.push_back(std::make_unique<Dev>(cuda_runtime(), o, test_layout()));
      CacheOptions ho;
      ho.num_experts = c.experts;
      ho.capacity = c.capacity;
      ho.top_k = 1;
      host.push_back(std::make_unique<Host>(cuda_runtime(), ho, test_layout()));
      fill_pools(*dev.back(), c.experts);
      fill_pools(*host.back(), c.experts);
      ReaderParams r{};
      const ForwardView& v = dev.back()->view();
      r.forward_map = v.expert_map;
      r.resident_map = v.resident_map;
      r.ids = dev.back()->sanitized_ids_device();
      r.n_ids = c.n_ids;
      r.num_experts = c.experts;
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        r.tensors[t] = v.tensors[t];
        r.pools[t] = nullptr;
        if (v.tensors[t].bytes != 0) {
          auto p = cuda_runtime().device_pointer(dev.back()->storage().host_tensor(t, 0));
          REQUIRE(p.ok());
          r.pools[t] = static_cast<const std::byte*>(p.value());
        }
      }
      r.found = found.get() + l;
      r.mismatches = mismatches.get() + l;
      readers.push_back(r);
    }
    rounds = dev[0]->max_groups(c.n_ids);
    load_kernels(&router_kernel<0>, &hint_kernel<0>, &reader_kernel<0>, &bump_kernel<0>);
    REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  }
  ~RigT() {
    (void)cudaStreamSynchronize(x);
    (void)cudaStreamSynchronize(side);
    (void)cudaStreamDestroy(x);
    (void)cudaStreamDestroy(host_x);
    (void)cudaStreamDestroy(side);
    (void)cudaEventDestroy(forked);
  }

  // One decode step on x: per layer router -> prepare -> consumer, then the overflow rounds.
  void enqueue_step() {
    for (std::int32_t l = 0; l < cfg.layers; ++l) {
      std::int32_t* ids = d_ids.get() + l * cfg.n_ids;
      router_kernel<0><<<1, 64, 0, x>>>(d_table.get(), d_counter.get(), cfg.layers, l, cfg.n_ids, cfg.steps, ids);
      REQUIRE_CUDA_OK(cudaGetLastError());
      auto v = dev[static_cast<std::size_t>(l)]->prepare(ids, cfg.n_ids, x);
      REQUIRE_MESSAGE(v.ok(), std::string(v.status().message()));
      if (cfg.hint_ids > 0 && l + 1 < cfg.layers) {
        // Fork after this layer's prepare; the next layer's prepare joins (edge 2).
        std::int32_t* h = d_hint_ids.get() + l * cfg.hint_ids;
        REQUIRE_CUDA_OK(cudaEventRecord(forked, x));
        REQUIRE_CUDA_OK(cudaStreamWaitEvent(side, forked, 0));
        hint_kernel<0><<<1, 32, 0, side>>>(d_hints.get(), d_counter.get(), cfg.layers, l, cfg.hint_ids, cfg.steps, h);
        REQUIRE_CUDA_OK(cudaGetLastError());
        auto pv = dev[static_cast<std::size_t>(l + 1)]->prefetch(h, cfg.hint_ids, side, prefetch_options);
        REQUIRE_MESSAGE(pv.ok(), std::string(pv.status().message()));
      }
      reader_kernel<0><<<1, 64, 0, x>>>(readers[static_cast<std::size_t>(l)]);
      REQUIRE_CUDA_OK(cudaGetLastError());
      for (std::int32_t g = 1; g < rounds; ++g) {
        auto gv = dev[static_cast<std::size_t>(l)]->prepare_group(g, x);
        REQUIRE_MESSAGE(gv.ok(), std::string(gv.status().message()));
        reader_kernel<0><<<1, 64, 0, x>>>(readers[static_cast<std::size_t>(l)]);
        REQUIRE_CUDA_OK(cudaGetLastError());
      }
    }
    bump_kernel<0><<<1, 1, 0, x>>>(d_counter.get());
    REQUIRE_CUDA_OK(cudaGetLastError());
  }

  // After step s ran on the device: the host reference plans it and everything is compared.
  // Returns the step's misses (all layers).
  std::uint64_t check_step(std::int32_t s, std::vector<DevicePlanStats>& before) {
    std::uint64_t misses = 0;
    const std::vector<unsigned long long> found_h = found.download(), bad_h = mismatches.download();
    REQUIRE_CUDA_OK(cudaMemset(found.get(), 0, found.bytes()));
    REQUIRE_CUDA_OK(cudaMemset(mismatches.get(), 0, mismatches.bytes()));
    for (std::int32_t l = 0; l < cfg.layers; ++l) {
      const auto li = static_cast<std::size_t>(l);
      const Ids& ids = table[static_cast<std::size_t>(s) * cfg.layers + li];
      const Ids uniq = sorted_unique_valid(ids.data(), cfg.n_ids, cfg.experts);
      std::vector<Ids> groups;
      for (std::size_t b = 0; b < uniq.size(); b += static_cast<std::size_t>(cfg.capacity)) {
        groups.emplace_back(uniq.begin() + static_cast<std::ptrdiff_t>(b),
                            uniq.begin() + static_cast<std::ptrdiff_t>(std::min(uniq.size(), b + cfg.capacity)));
      }
      std::uint64_t hits = 0, miss = 0;
      if (cfg.hint_ids > 0 && l > 0) {  // the prefetch issued at layer l - 1 of this step
        auto pv = host[li]->prefetch(hints[static_cast<std::size_t>(s) * cfg.layers + li - 1], host_x, prefetch_options);
        REQUIRE_MESSAGE(pv.ok(), std::string(pv.status().message()));
      }
      if (groups.empty()) REQUIRE(host[li]->prepare_unique(Ids{}, host_x).ok());
      for (const Ids& g : groups) {
        auto v = host[li]->prepare_unique(g, host_x);
        REQUIRE_MESSAGE(v.ok(), std::string(v.status().message()));
        hits += host[li]->last_plan().hits;
        miss += host[li]->last_plan().misses;
      }
      REQUIRE_CUDA_OK(cudaDeviceSynchronize());
      const DevicePlanStats now = dev[li]->device_stats();
      INFO("step " << s << " layer " << l << " groups " << groups.size() << "; copy proxy requests "
                    << dev[li]->executor().proxy_requests() << ", fills " << dev[li]->executor().proxy_fills()
                    << ", longest driver call " << dev[li]->executor().proxy_longest_call_ns() / 1000 << " us");
      CHECK(now.hits - before[li].hits == hits);
      CHECK(now.misses - before[li].misses == miss);
      const auto bad = static_cast<std::uint64_t>(std::count_if(
          ids.begin(), ids.end(), [&](std::int32_t id) { return id != -1 && (id < 0 || id >= cfg.experts); }));
      CHECK(now.bad_ids - before[li].bad_ids == bad);
      CHECK(now.overflows - before[li].overflows == (groups.size() > 1 ? 1u : 0u));
      const CacheStats hs = host[li]->stats();
      CHECK(now.speculative_issued == hs.speculative_issued);
      CHECK(now.speculative_used == hs.speculative_used);
      CHECK(now.speculative_wasted == hs.speculative_wasted);
      CHECK(now.evictions == hs.evictions);
      before[li] = now;
      misses += miss;
      // Maps.
      std::vector<std::int32_t> dres(static_cast<std::size_t>(cfg.experts)), dfwd(dres.size());
      REQUIRE_CUDA_OK(cudaMemcpy(dres.data(), dev[li]->resident_map_device(), dres.size() * 4, cudaMemcpyDeviceToHost));
      REQUIRE_CUDA_OK(cudaMemcpy(dfwd.data(), dev[li]->forward_map_device(), dfwd.size() * 4, cudaMemcpyDeviceToHost));
      const auto hres = host[li]->resident_map_host();
      CHECK(std::equal(hres.begin(), hres.end(), dres.begin()));
      if (static_cast<std::int32_t>(std::max<std::size_t>(groups.size(), 1)) == rounds) {
        const auto hf = host[li]->forward_map_host();
        CHECK(std::equal(hf.begin(), hf.end(), dfwd.begin()));
      } else {
        CHECK(std::all_of(dfwd.begin(), dfwd.end(), [](std::int32_t v) { return v == -1; }));
      }
      // Slot bytes of every resident slot: device-planned == host-planned.
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        const SlotTensor a = dev[li]->storage().slot_tensor(t), b = host[li]->storage().slot_tensor(t);
        if (a.bytes == 0) continue;
        const std::size_t bytes = a.bytes * static_cast<std::size_t>(cfg.capacity);
        std::vector<std::byte> da(bytes), db(bytes);
        REQUIRE_CUDA_OK(cudaMemcpy(da.data(), a.base, bytes, cudaMemcpyDeviceToHost));
        REQUIRE_CUDA_OK(cudaMemcpy(db.data(), b.base, bytes, cudaMemcpyDeviceToHost));
        for (std::int32_t slot = 0; slot < cfg.capacity; ++slot) {
          if (std::find(hres.begin(), hres.end(), slot) == hres.end()) continue;
          const std::size_t off = static_cast<std::size_t>(slot) * a.bytes;
          CHECK(std::memcmp(da.data() + off, db.data() + off, a.bytes) == 0);
        }
      }
      // The consumers found every valid id in its group, with its bytes.
      const auto valid = static_cast<unsigned long long>(
          std::count_if(ids.begin(), ids.end(), [&](std::int32_t id) { return id >= 0 && id < cfg.experts; }));
      CHECK(found_h[li] == valid);
      CHECK(bad_h[li] == 0ull);
      const std::uint32_t err = dev[li]->take_errors();
      CHECK(((err & plan_error_bad_id) != 0) == (bad > 0));
      CHECK(((err & plan_error_overflow) != 0) == (groups.size() > 1));
      CHECK((err & (plan_error_bad_state | plan_error_bad_argument | plan_error_wait_timeout | plan_error_fill_failed)) == 0u);
    }
    return misses;
  }
};

using Rig = RigT<>;

std::int32_t steps_requested() {
  if (const char* e = std::getenv("EXPERT_CACHE_DCACHE_STEPS")) return std::max(10, std::atoi(e));
  return 1000;
}

// With hints: the prefetches did fill, and some fills were used by the next forward.
template <class R>
void report_speculative(const R& r) {
  if (r.cfg.hint_ids == 0) return;
  std::uint64_t issued = 0, used = 0, wasted = 0;
  for (const auto& d : r.dev) {
    const CacheStats s = d->stats();
    issued += s.speculative_issued;
    used += s.speculative_used;
    wasted += s.speculative_wasted;
  }
  MESSAGE("speculative fills issued " << issued << ", used " << used << ", wasted " << wasted);
  CHECK(issued > 0);
  CHECK(used > 0);
}

template <class R = Rig>
void run_eager(const Config& c) {
  R r(c, 17);
  std::vector<DevicePlanStats> before(static_cast<std::size_t>(c.layers));
  std::uint64_t misses = 0;
  for (std::int32_t s = 0; s < c.steps; ++s) {
    r.enqueue_step();
    REQUIRE_CUDA_OK(cudaStreamSynchronize(r.x));
    misses += r.check_step(s, before);
  }
  MESSAGE("eager: " << c.steps << " steps x " << c.layers << " layers, " << r.rounds << " rounds, misses " << misses
                    << ", fused " << c.fused << ", hint ids " << c.hint_ids << ", engine " << to_string(c.engine));
  report_speculative(r);
}

template <class R = Rig>
void run_graph(const Config& c) {
  R r(c, 29);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  REQUIRE_CUDA_OK(cudaStreamBeginCapture(r.x, cudaStreamCaptureModeGlobal));
  r.enqueue_step();
  REQUIRE_CUDA_OK(cudaStreamEndCapture(r.x, &graph));
  REQUIRE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  std::size_t nodes = 0;
  REQUIRE_CUDA_OK(cudaGraphGetNodes(graph, nullptr, &nodes));
  std::vector<DevicePlanStats> before(static_cast<std::size_t>(c.layers));
  std::uint64_t misses = 0;
  for (std::int32_t s = 0; s < c.steps; ++s) {
    REQUIRE_CUDA_OK(cudaGraphLaunch(exec, r.x));
    REQUIRE_CUDA_OK(cudaStreamSynchronize(r.x));
    misses += r.check_step(s, before);
  }
  // The host saw no cache call during the replays: every prepare was captured once.
  for (const auto& d : r.dev) CHECK(d->stats().prepare_calls == 1);
  MESSAGE("graph: " << nodes << " nodes, replayed " << c.steps << " times x " << c.layers << " layers, " << r.rounds
                    << " rounds, misses " << misses << ", fused " << c.fused << ", hint ids " << c.hint_ids
                    << ", engine " << to_string(c.engine));
  report_speculative(r);
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
}

}  // namespace

TEST_CASE("device cache == host-planned CudaRowCache, eager (small path, fused plan+fill)") {
  run_eager(Config{4, 64, 12, 16, steps_requested(), true});
}
TEST_CASE("device cache == host-planned CudaRowCache, eager (general path, two nodes, 4 rounds)") {
  run_eager(Config{2, 64, 12, 40, std::max(100, steps_requested() / 4), false});
}
TEST_CASE("device cache == host-planned CudaRowCache, captured graph replayed with new ids (fused)") {
  run_graph(Config{4, 64, 12, 16, steps_requested(), true});
}
TEST_CASE("device cache == host-planned CudaRowCache, captured graph replayed with new ids (two nodes, general path)") {
  run_graph(Config{2, 64, 12, 40, steps_requested(), false});
}

// The copy engine (the proxy copies the plan's fill list; the post node waits for the ready
// words): the same plans, maps and bytes as the host-planned cache, in rounds, captured and
// replayed, and with prefetches on a side stream that a later forward may read.
TEST_CASE("device cache with the copy engine == host-planned CudaRowCache: eager, graph, rounds, prefetch") {
  const std::int32_t steps = std::max(100, steps_requested() / 4);
  run_eager(Config{2, 64, 12, 40, steps, false, 0, FillEngine::copy_engine});
  run_graph(Config{4, 64, 12, 16, steps, true, 0, FillEngine::copy_engine});
  run_eager(Config{4, 64, 12, 16, steps, true, 6, FillEngine::copy_engine});
  run_graph(Config{4, 64, 12, 16, steps, false, 6, FillEngine::copy_engine});
}

TEST_CASE("device cache: invalidate on the device, owner change between two streams, rejected input") {
  Rig r(Config{1, 32, 8, 8, 4, true}, 5);
  cudaStream_t y = nullptr;
  REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&y, cudaStreamNonBlocking));
  std::vector<DevicePlanStats> before(1);
  r.enqueue_step();
  REQUIRE_CUDA_OK(cudaStreamSynchronize(r.x));
  (void)r.check_step(0, before);
  // Invalidate every expert of step 0 from stream y (ordered after x's consumer by the core).
  const Ids uniq = sorted_unique_valid(r.table[0].data(), 8, 32);
  for (std::int32_t e : uniq) {
    REQUIRE(r.dev[0]->invalidate(e, y).ok());
    REQUIRE(r.host[0]->invalidate(e, r.host_x).ok());
  }
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  std::vector<std::int32_t> dres(32);
  REQUIRE_CUDA_OK(cudaMemcpy(dres.data(), r.dev[0]->resident_map_device(), 32 * 4, cudaMemcpyDeviceToHost));
  const auto hres = r.host[0]->resident_map_host();
  CHECK(std::equal(hres.begin(), hres.end(), dres.begin()));
  CHECK(r.dev[0]->device_stats().invalidations == uniq.size());
  // Next step on y (owner change x -> y), then back on x.
  std::swap(r.x, y);
  r.enqueue_step();
  REQUIRE_CUDA_OK(cudaStreamSynchronize(r.x));
  (void)r.check_step(1, before);
  std::swap(r.x, y);
  r.enqueue_step();
  REQUIRE_CUDA_OK(cudaStreamSynchronize(r.x));
  (void)r.check_step(2, before);
  CHECK(r.dev[0]->stats().owner_changes == 2);
  // Rejected: nothing enqueued, nothing changed.
  const DevicePlanStats d = r.dev[0]->device_stats();
  CHECK(r.dev[0]->prepare(r.d_ids.get(), 9, r.x).status().code() == ErrorCode::invalid_argument);
  CHECK(r.dev[0]->prepare(nullptr, 4, r.x).status().code() == ErrorCode::invalid_argument);
  CHECK(r.dev[0]->prepare_group(1, r.x).status().code() == ErrorCode::invalid_argument);  // max_groups(8) == 1
  CHECK(r.dev[0]->invalidate(32, r.x).code() == ErrorCode::expert_out_of_range);
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  CHECK(r.dev[0]->device_stats() == d);
  CHECK(r.dev[0]->stats().faults == 0);
  (void)cudaStreamDestroy(y);
}

TEST_CASE("device prefetch on a side stream == host-planned prefetch, eager (fused) and captured (two nodes)") {
  run_eager(Config{4, 64, 12, 16, std::max(100, steps_requested() / 4), true, 6});
  run_graph(Config{4, 64, 12, 16, steps_requested(), false, 6});
}

// The device policies beyond LRU: the same comparison against the host-planned cache with the
// host policy (DeviceLfru = Lfru, DeviceCrf = Crf), eager and in a replayed graph, with prefetch.
template <class Policy, class HostPolicy>
using PolicyRig = RigT<DeviceExpertCache<TensorMajorStorage, ExplicitLayout, CudaRuntime, Policy>,
                       ExpertCache<TensorMajorStorage, HostPolicy, CopyStream, ExplicitLayout, CudaRuntime>>;

TEST_CASE("device cache (DeviceLfru) == host-planned Lfru cache: eager (fused), graph (two nodes, general path), prefetch") {
  using R = PolicyRig<DeviceLfru, Lfru>;
  run_eager<R>(Config{4, 64, 12, 16, std::max(100, steps_requested() / 2), true});
  run_graph<R>(Config{2, 64, 12, 40, std::max(100, steps_requested() / 2), false});
  run_graph<R>(Config{4, 64, 12, 8, std::max(100, steps_requested() / 2), true, 6});
}
TEST_CASE("device cache (DeviceCrf) == host-planned Crf cache: eager (fused), graph (two nodes, general path), prefetch") {
  using R = PolicyRig<DeviceCrf, Crf>;
  run_eager<R>(Config{4, 64, 12, 16, std::max(100, steps_requested() / 2), true});
  run_graph<R>(Config{2, 64, 12, 40, std::max(100, steps_requested() / 2), false});
  run_graph<R>(Config{4, 64, 12, 8, std::max(100, steps_requested() / 2), true, 6});
}

// DeviceExpertCache::set_prior on the GPU: the table lands in the device plan state (eagerly and
// from a replayed graph), a refused table changes nothing, and the device then plans exactly as
// the host Crf with the same bias (resident map after every forward, CRF state included).
TEST_CASE("device cache (DeviceCrf): set_prior uploads the prior in stream order; plans equal Crf with that bias") {
  constexpr std::int32_t E = 32, C = 6, n = 3;
  using CrfDev = DeviceExpertCache<TensorMajorStorage, ExplicitLayout, CudaRuntime, DeviceCrf>;
  DeviceCacheOptions o;
  o.num_experts = E;
  o.capacity = C;
  o.max_ids = 8;
  CrfDev dev(cuda_runtime(), o, test_layout());
  fill_pools(dev, E);
  cudaStream_t x = nullptr;
  REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  const DevicePlanState& st = dev.plan_state();
  auto table = [&] {
    std::vector<std::uint64_t> t(E);
    REQUIRE_CUDA_OK(cudaStreamSynchronize(x));
    REQUIRE_CUDA_OK(cudaMemcpy(t.data(), st.expert_bias.data, E * sizeof(std::uint64_t), cudaMemcpyDeviceToHost));
    return t;
  };
  std::vector<double> prior(E, 0.0);
  prior[1] = 2e9;  // pinned: at or above 2^30 (crf_pin_bias / crf_one)
  prior[5] = 3.0;
  prior[9] = 0.5;
  std::vector<std::uint64_t> q32(E, 0);
  q32[1] = crf_pin_bias;
  q32[5] = 3 * crf_one;
  q32[9] = crf_one / 2;
  // From a captured graph first (the host table may change after the capture: the staging
  // buffer holds the graph's copy), then eagerly.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  REQUIRE_CUDA_OK(cudaStreamBeginCapture(x, cudaStreamCaptureModeGlobal));
  const Status captured = dev.set_prior(std::vector<double>(E, 2.0), x);
  REQUIRE_CUDA_OK(cudaStreamEndCapture(x, &graph));
  REQUIRE_MESSAGE(captured.ok(), std::string(captured.message()));
  REQUIRE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  REQUIRE_CUDA_OK(cudaGraphLaunch(exec, x));
  CHECK(table() == std::vector<std::uint64_t>(E, 2 * crf_one));
  REQUIRE(dev.set_prior(prior, x).ok());
  CHECK(table() == q32);
  // Refused: nothing enqueued, the table as it was.
  CHECK(dev.set_prior(std::vector<double>(E - 1, 1.0), x).code() == ErrorCode::invalid_argument);
  std::vector<double> nan_prior = prior;
  nan_prior[E - 1] = std::nan("");
  CHECK(dev.set_prior(nan_prior, x).code() == ErrorCode::invalid_argument);
  CHECK(table() == q32);

  ForwardPlanner<Crf> host(CacheShape{E, C}, n, Crf(CacheShape{E, C}, CrfParams{}, q32));
  ForwardPlan plan;
  DeviceBuffer<std::int32_t> d_ids(n);
  std::mt19937_64 rng(17);
  std::vector<std::int32_t> res(E);
  std::vector<std::uint64_t> crf(E);
  for (int step = 0; step < 300; ++step) {
    CAPTURE(step);
    std::set<std::int32_t> row;
    if (step == 0) row.insert(1);
    while (static_cast<std::int32_t>(row.size()) < n) row.insert(static_cast<std::int32_t>(rng() % E));
    const Ids ids(row.begin(), row.end());
    REQUIRE_CUDA_OK(cudaMemcpyAsync(d_ids.get(), ids.data(), n * sizeof(std::int32_t), cudaMemcpyHostToDevice, x));
    REQUIRE(dev.prepare(d_ids.get(), n, x).ok());
    REQUIRE(host.plan_topk(ids, plan));
    REQUIRE_CUDA_OK(cudaStreamSynchronize(x));
    REQUIRE_CUDA_OK(cudaMemcpy(res.data(), dev.resident_map_device(), E * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    REQUIRE(res == Ids(host.resident_map().begin(), host.resident_map().end()));
    REQUIRE_CUDA_OK(cudaMemcpy(crf.data(), st.expert_crf.data, E * sizeof(std::uint64_t), cudaMemcpyDeviceToHost));
    for (std::int32_t e = 0; e < E; ++e) REQUIRE(crf[static_cast<std::size_t>(e)] == host.policy().crf_q32(ExpertId(e)));
  }
  CHECK(res[1] >= 0);  // pinned since step 0
  CHECK(dev.device_stats().evictions > 100);
  CHECK(dev.take_errors() == 0u);
  REQUIRE_CUDA_OK(cudaGraphExecDestroy(exec));
  REQUIRE_CUDA_OK(cudaGraphDestroy(graph));
  REQUIRE_CUDA_OK(cudaStreamDestroy(x));
}
