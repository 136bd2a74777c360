// The device planner on the GPU (kernels/plan_kernels.cuh, kernels/plan_fill.cuh) against the host
// ForwardPlanner<Lru>:
//  (a) random traces planned by the kernel, maps and lists read back and compared with the host
//      planner after every group of every step (eager launches, invalidate kernels included);
//  (b) one CUDA graph (router stand-in writing ids on the device -> invalidate -> plan -> fill,
//      then every overflow group: plan_group -> fill) captured once and replayed >= 1000 times
//      with different ids each replay: per group hits, misses, fill and eviction lists and
//      forward map, then resident map, slot owners, free stack, stats, the sanitized ids and the
//      bytes of every resident slot, all equal to the host reference; bad ids and overflow
//      forwards come from the router inside the graph.
// EXPERT_CACHE_DPLAN_REPLAYS / _STEPS set the replay count (default 1000) and the eager steps per
// trace (default 200); smaller under compute-sanitizer.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "expert_cache/device_cache/plan_storage.cuh"
#include "expert_cache/eviction/crf.hpp"
#include "expert_cache/eviction/lfru.hpp"
#include "expert_cache/eviction/lru.hpp"
#include "expert_cache/kernels/plan_fill.cuh"
#include "expert_cache/kernels/plan_kernels.cuh"
#include "expert_cache/planning/device_plan.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "support/device_plan_support.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;

#define CUDA_OK(expr)                                                                         \
  do {                                                                                        \
    const cudaError_t err_ = (expr);                                                          \
    REQUIRE_MESSAGE(err_ == cudaSuccess, #expr, ": ", cudaGetErrorName(err_), ": ", cudaGetErrorString(err_)); \
  } while (0)

namespace {

// The host planner's plan of one group (plan_topk for a single group, plan_unique otherwise).
template <class P>
void host_plan(ForwardPlanner<P>& host, const Ids& ids, const std::vector<Ids>& groups, std::size_t g,
               ForwardPlan& plan) {
  if (groups.size() <= 1) {
    Ids valid;
    for (std::int32_t id : ids) {
      if (id == -1 || (id >= 0 && id < host.shape().num_experts)) valid.push_back(id);
    }
    REQUIRE(host.plan_topk(valid, plan));
  } else {
    REQUIRE(host.plan_unique(groups[g], plan));
  }
}

// A host copy of the device block, bound as a state view (the layout is position independent).
struct Mirror {
  struct alignas(16) Chunk {
    std::byte b[16];
  };
  std::vector<Chunk> block;
  DevicePlanState view;
  void read(const device::DevicePlanStorage& st, cudaStream_t stream) {
    block.resize((st.bytes() + sizeof(Chunk) - 1) / sizeof(Chunk));
    CUDA_OK(cudaMemcpyAsync(block.data(), st.device_block(), st.bytes(), cudaMemcpyDeviceToHost, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    view = bind_plan_state(block.data(), st.state().num_experts, st.state().capacity, st.host_stats(),
                           st.host_error_word());
  }
};

template <class P>
void check_group(const ForwardPlanner<P>& host, const ForwardPlan& plan, const DevicePlanScalars& k,
                 const PlanEntry* fills, const PlanEntry* evictions, const std::int32_t* forward_map) {
  REQUIRE(k.hits == static_cast<std::int32_t>(plan.hits));
  REQUIRE(k.misses == static_cast<std::int32_t>(plan.misses));
  REQUIRE(k.fill_count == static_cast<std::int32_t>(plan.fills.size()));
  REQUIRE(k.eviction_count == static_cast<std::int32_t>(plan.evictions.size()));
  CHECK(std::vector<PlanEntry>(fills, fills + k.fill_count) == entries(plan.fills));
  CHECK(std::vector<PlanEntry>(evictions, evictions + k.eviction_count) == entries(plan.evictions));
  const auto fm = host.forward_map();
  CHECK(std::memcmp(forward_map, fm.data(), fm.size_bytes()) == 0);  // byte-identical map
}

template <class P>
void check_residency(const ForwardPlanner<P>& host, const DevicePlanState& s) {
  const auto rm = host.resident_map();
  const auto so = host.slot_owner();
  CHECK(std::memcmp(s.resident_map.data, rm.data(), rm.size_bytes()) == 0);
  CHECK(std::memcmp(s.slot_owner.data, so.data(), so.size_bytes()) == 0);
  CHECK(to_vector(s.free_stack, s.scalars->free_count) == host.snapshot().free_slots);
  CHECK(to_vector(s.marks, s.num_experts) == std::vector<std::uint32_t>(static_cast<std::size_t>(s.num_experts), 0u));
}

Ids random_ids(std::mt19937_64& rng, std::int32_t E, std::int32_t top_k, std::int32_t tokens, double bad_p) {
  std::uniform_int_distribution<std::int32_t> any(0, E - 1);
  std::uniform_int_distribution<std::int32_t> hot(0, std::max(1, E / 8) - 1);
  std::uniform_real_distribution<double> u(0, 1);
  const std::int32_t bad_values[] = {E, E + 1, INT32_MAX, INT32_MIN, -2};
  Ids ids;
  for (std::int32_t t = 0; t < tokens; ++t) {
    std::set<std::int32_t> row;
    while (static_cast<std::int32_t>(row.size()) < top_k) row.insert(u(rng) < 0.5 ? hot(rng) : any(rng));
    for (std::int32_t id : row) {
      if (u(rng) < 0.05) id = -1;
      else if (u(rng) < bad_p) id = bad_values[rng() % 5];
      ids.push_back(id);
    }
  }
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { (void)cudaStreamDestroy(s); }
};
template <class T>
struct DeviceBuffer {
  T* p = nullptr;
  explicit DeviceBuffer(std::size_t n) { CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(n, 1) * sizeof(T))); }
  ~DeviceBuffer() { (void)cudaFree(p); }
};
struct PinnedBuffer {
  std::byte* p = nullptr;
  explicit PinnedBuffer(std::size_t n) {
    CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&p), n, cudaHostAllocMapped | cudaHostAllocPortable));
  }
  ~PinnedBuffer() { (void)cudaFreeHost(p); }
};

// ---- (b) the router stand-in: the same ids on the host and the device -------------------------

__host__ __device__ inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Mostly a hot set (hits), some cold ids (misses, evictions), -1 padding, corrupted values. A
// normal step routes 1..3 tokens (<= 12 ids = capacity: one group; the rest is padding); every
// 9th step routes all 8 tokens over 2 * n distinct ids: more unique experts than slots (overflow).
__host__ __device__ inline std::int32_t router_id(std::uint64_t step, std::int32_t i, std::int32_t E) {
  const std::uint64_t h = mix64(step * 0x100000001B3ull + static_cast<std::uint64_t>(i));
  if (step % 9 == 4) return static_cast<std::int32_t>((static_cast<std::uint64_t>(i) * 2 + step) % static_cast<std::uint64_t>(E));
  const auto active = static_cast<std::int32_t>(4 * (1 + mix64(step) % 3));  // 4, 8 or 12 ids
  if (i >= active) return -1;
  const std::uint32_t r = static_cast<std::uint32_t>(h & 0xff);
  if (r < 10) return -1;
  if (r < 14) {
    const std::int32_t bad[] = {E, E + 5, INT32_MAX, INT32_MIN, -2};
    return bad[(h >> 8) % 5];
  }
  if ((h >> 16) & 1) return static_cast<std::int32_t>((h >> 20) % 8);
  return static_cast<std::int32_t>((h >> 20) % static_cast<std::uint64_t>(E));
}
__host__ __device__ inline std::int32_t router_invalidate(std::uint64_t step, std::int32_t E) {
  return static_cast<std::int32_t>((step * 13 + 5) % static_cast<std::uint64_t>(E));
}

// One block: reads the step, writes the ids and the expert to invalidate, advances the step.
__global__ void router_kernel(std::int32_t* ids, std::int32_t n, std::int32_t* invalidate, std::uint64_t* step_counter,
                              std::int32_t E) {
  const std::uint64_t step = *step_counter;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n; i += static_cast<std::int32_t>(blockDim.x)) {
    ids[i] = router_id(step, i, E);
  }
  __syncthreads();  // every thread read the step before it moves
  if (threadIdx.x == 0) {
    *invalidate = (step % 3 == 0) ? router_invalidate(step, E) : E + 1;  // E + 1: a bad id, counted
    *step_counter = step + 1;
  }
}

std::uint8_t pool_byte(std::int32_t e, std::size_t region, std::size_t offset) {
  return static_cast<std::uint8_t>(mix64((static_cast<std::uint64_t>(e) << 40) ^ (region << 32) ^ offset));
}

std::int32_t count_from_env(const char* name, std::int32_t fallback) {
  if (const char* v = std::getenv(name)) return std::max(1, std::atoi(v));
  return fallback;
}

}  // namespace

TEST_CASE("device plan kernel: random traces equal ForwardPlanner<Lru> after every group") {
  struct Config {
    std::int32_t E, C, top_k, max_tokens;
  };
  const Config configs[] = {{64, 16, 4, 8}, {512, 208, 10, 4}, {512, 208, 10, 40}, {300, 37, 6, 12},
                            {128, 10, 10, 2}, {16, 16, 4, 6}, {1000, 300, 8, 64}};
  Stream stream;
  const std::int32_t steps = count_from_env("EXPERT_CACHE_DPLAN_STEPS", 200);
  std::uint64_t seed = 100;
  std::uint64_t total_evictions = 0, total_overflows = 0;
  for (const Config& c : configs) {
    CAPTURE(c.E);
    CAPTURE(c.C);
    CAPTURE(c.max_tokens);
    std::mt19937_64 rng(seed++);
    device::DevicePlanStorage st;
    CUDA_OK(st.create(c.E, c.C, stream.s));
    const DevicePlanState& s = st.state();
    const std::int32_t max_n = c.max_tokens * c.top_k;
    const std::int32_t max_groups = plan_max_groups(max_n, c.E, c.C);
    DeviceBuffer<std::int32_t> d_ids(static_cast<std::size_t>(max_n)), d_clean(static_cast<std::size_t>(max_n));
    ForwardPlanner<Lru> host(CacheShape{c.E, c.C}, c.top_k);
    ForwardPlan plan;
    Mirror m;
    std::uint64_t bad = 0, overflows = 0, invalidate_bad = 0;
    for (int step = 0; step < steps; ++step) {
      CAPTURE(step);
      if (rng() % 10 == 0) {
        const auto e = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E + 2));  // E, E+1: bad
        CUDA_OK(device::launch_plan_invalidate(s, e, nullptr, stream.s));
        if (e < c.E) {
          REQUIRE(host.invalidate(e));
        } else {
          ++invalidate_bad;
        }
        m.read(st, stream.s);
        check_residency(host, m.view);
      }
      const auto tokens = static_cast<std::int32_t>(1 + rng() % static_cast<std::uint64_t>(c.max_tokens));
      const Ids ids = random_ids(rng, c.E, c.top_k, tokens, step % 4 == 0 ? 0.1 : 0.0);
      const auto n = static_cast<std::int32_t>(ids.size());
      bad += static_cast<std::uint64_t>(count_bad(ids, c.E));
      const auto groups = host_groups(ids, c.E, c.C);
      if (groups.size() > 1) ++overflows;
      CUDA_OK(cudaMemcpyAsync(d_ids.p, ids.data(), ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream.s));
      CUDA_OK(device::launch_plan_forward(s, d_ids.p, n, d_clean.p, stream.s));
      for (std::int32_t g = 0; g < max_groups; ++g) {
        CAPTURE(g);
        if (g > 0) CUDA_OK(device::launch_plan_group(s, g, stream.s));
        m.read(st, stream.s);
        const DevicePlanState& v = m.view;
        if (static_cast<std::size_t>(g) < groups.size() || (g == 0 && groups.empty())) {
          host_plan(host, ids, groups, static_cast<std::size_t>(g), plan);
          check_group(host, plan, *v.scalars, v.fills.data, v.evictions.data, v.forward_map.data);
        } else {
          CHECK(v.scalars->fill_count == 0);
          CHECK(to_vector(v.forward_map, c.E) == Ids(static_cast<std::size_t>(c.E), -1));
        }
        check_residency(host, v);
      }
      Ids clean(ids.size());
      CUDA_OK(cudaMemcpyAsync(clean.data(), d_clean.p, ids.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost, stream.s));
      CUDA_OK(cudaStreamSynchronize(stream.s));
      for (std::size_t i = 0; i < ids.size(); ++i) {
        REQUIRE(clean[i] == ((ids[i] >= 0 && ids[i] < c.E) ? ids[i] : -1));
      }
    }
    const DevicePlanStats ds = st.stats();
    CHECK(ds.hits == host.counters().hits);
    CHECK(ds.misses == host.counters().misses);
    CHECK(ds.evictions == host.counters().evictions);
    CHECK(ds.invalidations == host.counters().invalidations);
    CHECK(ds.bad_ids == bad + invalidate_bad);
    CHECK(ds.overflows == overflows);
    CHECK(ds.forwards == static_cast<std::uint64_t>(steps));
    total_evictions += ds.evictions;
    total_overflows += ds.overflows;
    CHECK(st.error_word() == ((bad + invalidate_bad > 0 ? plan_error_bad_id : 0u) |
                              (overflows > 0 ? plan_error_overflow : 0u)));
  }
  MESSAGE("eager traces: evictions ", total_evictions, ", overflowing forwards ", total_overflows);
  if (steps >= 200) {
    CHECK(total_evictions > 1000);
    CHECK(total_overflows > 50);
  }
}

TEST_CASE("device plan kernel: one graph (router -> invalidate -> plan -> fill, overflow groups) replayed with new ids") {
  constexpr std::int32_t E = 64, C = 12, top_k = 4, tokens = 8, n = tokens * top_k;
  const std::int32_t max_groups = plan_max_groups(n, E, C);  // 3
  REQUIRE(max_groups == 3);
  Stream stream;
  device::DevicePlanStorage st;
  CUDA_OK(st.create(E, C, stream.s));
  const DevicePlanState& s = st.state();

  // Three regions, one per work-item width: 16-byte aligned, 4-byte aligned with a 3-byte tail,
  // and byte-wise (odd size and stride).
  struct RegionSpec {
    std::size_t bytes, stride;
  };
  const RegionSpec spec[] = {{2064, 2064}, {999, 1000}, {37, 37}};
  std::vector<std::unique_ptr<PinnedBuffer>> pools;
  std::vector<std::unique_ptr<DeviceBuffer<std::byte>>> slots;
  CopyRegions regions;
  for (std::size_t r = 0; r < 3; ++r) {
    pools.push_back(std::make_unique<PinnedBuffer>(spec[r].stride * E));
    slots.push_back(std::make_unique<DeviceBuffer<std::byte>>(spec[r].stride * C));
    for (std::int32_t e = 0; e < E; ++e) {
      for (std::size_t o = 0; o < spec[r].stride; ++o) {
        pools[r]->p[static_cast<std::size_t>(e) * spec[r].stride + o] = static_cast<std::byte>(pool_byte(e, r, o));
      }
    }
    CUDA_OK(cudaMemset(slots[r]->p, 0xEE, spec[r].stride * C));
    regions.regions[r] = CopyRegion{pools[r]->p, slots[r]->p, spec[r].stride, spec[r].stride, spec[r].bytes};
  }
  regions.count = 3;
  CUDA_OK(device::resolve_mapped_regions(regions));
  device::PlanFillParams fill{};
  CUDA_OK(device::make_plan_fill_params(regions, s, fill));
  CHECK(fill.width[0] == 16);
  CHECK(fill.width[1] == 4);
  CHECK(fill.width[2] == 1);

  DeviceBuffer<std::int32_t> d_ids(n), d_invalidate(1);
  DeviceBuffer<std::uint64_t> d_step(1);
  CUDA_OK(cudaMemset(d_step.p, 0, sizeof(std::uint64_t)));
  // Per group: scalars, fills, evictions and forward map, copied out inside the graph.
  struct Snapshot {
    DevicePlanScalars scalars;
    PlanEntry fills[C];
    PlanEntry evictions[C];
    std::int32_t forward_map[E];
  };
  DeviceBuffer<Snapshot> d_snap(static_cast<std::size_t>(max_groups));
  CUDA_OK(cudaStreamSynchronize(stream.s));

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal));
  router_kernel<<<1, 128, 0, stream.s>>>(d_ids.p, n, d_invalidate.p, d_step.p, E);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(device::launch_plan_invalidate(s, 0, d_invalidate.p, stream.s));
  for (std::int32_t g = 0; g < max_groups; ++g) {
    if (g == 0) {
      CUDA_OK(device::launch_plan_forward(s, d_ids.p, n, d_ids.p, stream.s));  // sanitized in place
    } else {
      CUDA_OK(device::launch_plan_group(s, g, stream.s));
    }
    CUDA_OK(device::launch_plan_fill(fill, stream.s));
    Snapshot* snap = d_snap.p + g;
    CUDA_OK(cudaMemcpyAsync(&snap->scalars, s.scalars, sizeof(DevicePlanScalars), cudaMemcpyDeviceToDevice, stream.s));
    CUDA_OK(cudaMemcpyAsync(snap->fills, s.fills.data, sizeof(snap->fills), cudaMemcpyDeviceToDevice, stream.s));
    CUDA_OK(cudaMemcpyAsync(snap->evictions, s.evictions.data, sizeof(snap->evictions), cudaMemcpyDeviceToDevice, stream.s));
    CUDA_OK(cudaMemcpyAsync(snap->forward_map, s.forward_map.data, sizeof(snap->forward_map), cudaMemcpyDeviceToDevice, stream.s));
  }
  CUDA_OK(cudaStreamEndCapture(stream.s, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  std::uint64_t step_now = 1;
  CUDA_OK(cudaMemcpy(&step_now, d_step.p, sizeof(step_now), cudaMemcpyDeviceToHost));
  CHECK(step_now == 0);  // capture ran nothing

  ForwardPlanner<Lru> host(CacheShape{E, C}, top_k);
  ForwardPlan plan;
  Mirror m;
  std::vector<Snapshot> snaps(static_cast<std::size_t>(max_groups));
  std::vector<std::vector<std::byte>> slot_bytes(3);
  Ids dev_ids(n);
  std::uint64_t bad = 0, overflows = 0, fills_total = 0;
  const std::int32_t replays = count_from_env("EXPERT_CACHE_DPLAN_REPLAYS", 1000);
  for (std::int32_t step = 0; step < replays; ++step) {
    CAPTURE(step);
    CUDA_OK(cudaGraphLaunch(exec, stream.s));
    CUDA_OK(cudaMemcpyAsync(snaps.data(), d_snap.p, snaps.size() * sizeof(Snapshot), cudaMemcpyDeviceToHost, stream.s));
    CUDA_OK(cudaMemcpyAsync(dev_ids.data(), d_ids.p, dev_ids.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost, stream.s));
    for (std::size_t r = 0; r < 3; ++r) {
      slot_bytes[r].resize(spec[r].stride * C);
      CUDA_OK(cudaMemcpyAsync(slot_bytes[r].data(), slots[r]->p, slot_bytes[r].size(), cudaMemcpyDeviceToHost, stream.s));
    }
    m.read(st, stream.s);  // synchronises the stream

    // Host reference of the same step.
    const auto ustep = static_cast<std::uint64_t>(step);
    const std::int32_t inv = (ustep % 3 == 0) ? router_invalidate(ustep, E) : E + 1;
    if (inv < E) {
      REQUIRE(host.invalidate(inv));
    } else {
      ++bad;
    }
    Ids ids(n);
    for (std::int32_t i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = router_id(ustep, i, E);
    bad += static_cast<std::uint64_t>(count_bad(ids, E));
    for (std::int32_t i = 0; i < n; ++i) {
      const std::int32_t id = ids[static_cast<std::size_t>(i)];
      REQUIRE(dev_ids[static_cast<std::size_t>(i)] == ((id >= 0 && id < E) ? id : -1));
    }
    const auto groups = host_groups(ids, E, C);
    if (groups.size() > 1) ++overflows;
    for (std::int32_t g = 0; g < max_groups; ++g) {
      CAPTURE(g);
      const Snapshot& sn = snaps[static_cast<std::size_t>(g)];
      if (static_cast<std::size_t>(g) < groups.size() || (g == 0 && groups.empty())) {
        host_plan(host, ids, groups, static_cast<std::size_t>(g), plan);
        check_group(host, plan, sn.scalars, sn.fills, sn.evictions, sn.forward_map);
        fills_total += plan.fills.size();
      } else {
        CHECK(sn.scalars.fill_count == 0);
        CHECK(Ids(sn.forward_map, sn.forward_map + E) == Ids(E, -1));
      }
    }
    check_residency(host, m.view);
    // Every resident slot holds its expert's bytes, in every region (tails included).
    const auto owner = host.slot_owner();
    for (std::int32_t slot = 0; slot < C; ++slot) {
      const std::int32_t e = owner[static_cast<std::size_t>(slot)];
      if (e < 0) continue;
      for (std::size_t r = 0; r < 3; ++r) {
        const std::byte* got = slot_bytes[r].data() + static_cast<std::size_t>(slot) * spec[r].stride;
        const std::byte* want = pools[r]->p + static_cast<std::size_t>(e) * spec[r].stride;
        REQUIRE_MESSAGE(std::memcmp(got, want, spec[r].bytes) == 0, "slot ", slot, " expert ", e, " region ", r);
      }
    }
    const DevicePlanStats ds = st.stats();
    REQUIRE(ds.hits == host.counters().hits);
    REQUIRE(ds.misses == host.counters().misses);
    REQUIRE(ds.evictions == host.counters().evictions);
    REQUIRE(ds.invalidations == host.counters().invalidations);
    REQUIRE(ds.bad_ids == bad);
    REQUIRE(ds.overflows == overflows);
    REQUIRE(ds.forwards == ustep + 1);
  }
  const DevicePlanStats ds = st.stats();
  MESSAGE("graph replays ", replays, ": hits ", ds.hits, ", misses ", ds.misses, ", evictions ", ds.evictions,
          ", overflowing forwards ", ds.overflows, ", bad ids ", ds.bad_ids, ", fills ", fills_total);
  CHECK(st.error_word() == (plan_error_bad_id | (overflows > 0 ? plan_error_overflow : 0u)));
  CHECK(ds.evictions > 0);
  if (replays >= 9) CHECK(ds.overflows > 0);
  if (replays >= 100) CHECK(ds.hits > 0);
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
}

namespace {
// Layer l's ids of one decode step: top_k - k hot experts (always resident once warm) and k cold
// ones cycling through 300 experts (mostly misses; the measured misses per layer are reported).
__global__ void timing_router_kernel(std::int32_t* ids, std::int32_t layers, std::int32_t top_k, std::int32_t k,
                                     std::uint64_t* step_counter) {
  const std::uint64_t step = *step_counter;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < layers * top_k;
       i += static_cast<std::int32_t>(blockDim.x)) {
    const std::int32_t j = i % top_k;
    ids[i] = j < top_k - k ? j * 3 : static_cast<std::int32_t>(200 + (step * static_cast<std::uint64_t>(k) + static_cast<std::uint64_t>(j)) % 300);
  }
  __syncthreads();
  if (threadIdx.x == 0) *step_counter = step + 1;
}
}  // namespace

TEST_CASE("device plan kernel: GPU time per layer in a replayed graph (reported, not asserted)") {
  // The defaults of the decode benchmark: 48 layers x 512 experts, 208 slots, top-10, batch 1.
  // Each layer: plan_forward + plan_fill (experts of 4 KiB here: the fill's fixed cost, not PCIe).
  constexpr std::int32_t E = 512, C = 208, top_k = 10, layers = 48, expert_bytes = 4096;
  Stream stream;
  std::vector<device::DevicePlanStorage> states(layers);
  PinnedBuffer pool(static_cast<std::size_t>(E) * expert_bytes);
  std::memset(pool.p, 1, static_cast<std::size_t>(E) * expert_bytes);
  DeviceBuffer<std::byte> slots(static_cast<std::size_t>(layers) * C * expert_bytes);
  std::vector<device::PlanFillParams> fills(layers);
  for (std::int32_t l = 0; l < layers; ++l) {
    CUDA_OK(states[static_cast<std::size_t>(l)].create(E, C, stream.s));
    CopyRegions r;
    r.count = 1;
    r.regions[0] = CopyRegion{pool.p, slots.p + static_cast<std::size_t>(l) * C * expert_bytes, expert_bytes, expert_bytes,
                              expert_bytes};
    CUDA_OK(device::resolve_mapped_regions(r));
    CUDA_OK(device::make_plan_fill_params(r, states[static_cast<std::size_t>(l)].state(), fills[static_cast<std::size_t>(l)]));
  }
  DeviceBuffer<std::int32_t> ids(static_cast<std::size_t>(layers) * top_k);
  DeviceBuffer<std::uint64_t> step(1);
  CUDA_OK(cudaMemset(step.p, 0, sizeof(std::uint64_t)));
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  for (const bool with_fill : {false, true}) {
    for (const std::int32_t k : {0, 1, 2, 4, 8}) {
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      CUDA_OK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal));
      timing_router_kernel<<<1, 256, 0, stream.s>>>(ids.p, layers, top_k, k, step.p);
      for (std::int32_t l = 0; l < layers; ++l) {
        CUDA_OK(device::launch_plan_forward(states[static_cast<std::size_t>(l)].state(), ids.p + l * top_k, top_k,
                                            nullptr, stream.s));
        if (with_fill) CUDA_OK(device::launch_plan_fill(fills[static_cast<std::size_t>(l)], stream.s));
      }
      CUDA_OK(cudaStreamEndCapture(stream.s, &graph));
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      for (int w = 0; w < 5; ++w) CUDA_OK(cudaGraphLaunch(exec, stream.s));  // warm: the hot set is resident
      CUDA_OK(cudaStreamSynchronize(stream.s));  // the mapped stats are read only once the warm-up is done
      const std::uint64_t misses_before = states[0].stats().misses;
      constexpr int reps = 50;
      CUDA_OK(cudaEventRecord(start, stream.s));
      for (int i = 0; i < reps; ++i) CUDA_OK(cudaGraphLaunch(exec, stream.s));
      CUDA_OK(cudaEventRecord(stop, stream.s));
      CUDA_OK(cudaEventSynchronize(stop));
      float ms = 0;
      CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
      const std::uint64_t misses = states[0].stats().misses - misses_before;
      MESSAGE((with_fill ? "plan+fill" : "plan only"), " k=", k, " misses/layer: ",
              static_cast<double>(misses) / reps, "  GPU us per layer: ", 1000.0 * ms / (reps * layers));
      CUDA_OK(cudaGraphExecDestroy(exec));
      CUDA_OK(cudaGraphDestroy(graph));
    }
  }
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
}

TEST_CASE("device plan kernel: fill parameters reject what the kernel could not copy safely") {
  device::DevicePlanStorage st;
  Stream stream;
  CUDA_OK(st.create(8, 4, stream.s));
  CUDA_OK(cudaStreamSynchronize(stream.s));
  device::PlanFillParams p{};
  CopyRegions r;
  r.count = 1;
  r.regions[0] = CopyRegion{nullptr, nullptr, 64, 64, 32};
  CHECK(device::make_plan_fill_params(r, st.state(), p) == cudaErrorInvalidValue);  // null bases
  std::byte dummy[64];
  r.regions[0] = CopyRegion{dummy, dummy, 16, 16, 32};
  CHECK(device::make_plan_fill_params(r, st.state(), p) == cudaErrorInvalidValue);  // wider than its stride
  r.count = max_copy_regions + 1;
  CHECK(device::make_plan_fill_params(r, st.state(), p) == cudaErrorInvalidValue);
  device::DevicePlanStorage bad;
  CHECK(bad.create(4, 8, stream.s) == cudaErrorInvalidValue);  // capacity > E
}

namespace {
// k cold misses per step on top of a hot set (router stand-in of the fused-kernel test).
__global__ void fused_router_kernel(std::int32_t* ids, std::int32_t top_k, std::int32_t k, std::uint64_t* step_counter) {
  const std::uint64_t step = *step_counter;
  for (std::int32_t j = static_cast<std::int32_t>(threadIdx.x); j < top_k; j += static_cast<std::int32_t>(blockDim.x)) {
    ids[j] = j < top_k - k ? j : static_cast<std::int32_t>(top_k + (step * static_cast<std::uint64_t>(k) + static_cast<std::uint64_t>(j)) % 50);
  }
  __syncthreads();
  if (threadIdx.x == 0) *step_counter = step + 1;
}
}  // namespace

// The fused plan + fill kernel's flag is an ordering edge: the plan is delayed by 20 us, so a
// fill block that did not wait for fill_ready would read the previous step's fill list and copy
// the wrong experts. Every resident slot's bytes are checked after every replay, and the
// planning decisions against the host planner.
TEST_CASE("device plan kernel: fused plan + fill in one node waits for the plan (flag ordering edge)") {
  constexpr std::int32_t E = 64, C = 16, top_k = 6, k = 3;
  constexpr std::size_t bytes = 256 * 1024;  // many blocks' worth per expert
  Stream stream;
  device::DevicePlanStorage st;
  CUDA_OK(st.create(E, C, stream.s));
  const DevicePlanState& s = st.state();
  PinnedBuffer pool(bytes * E);
  for (std::int32_t e = 0; e < E; ++e) {
    for (std::size_t i = 0; i < bytes; ++i) pool.p[static_cast<std::size_t>(e) * bytes + i] = std::byte{pool_byte(e, 0, i)};
  }
  DeviceBuffer<std::byte> slots(bytes * C);
  CopyRegions regions;
  regions.count = 1;
  regions.regions[0] = CopyRegion{pool.p, slots.p, bytes, bytes, bytes};
  CUDA_OK(device::resolve_mapped_regions(regions));
  device::PlanFillParams fill{};
  CUDA_OK(device::make_plan_fill_params(regions, s, fill));
  DeviceBuffer<std::int32_t> d_ids(top_k);
  DeviceBuffer<std::uint64_t> d_step(1);
  CUDA_OK(cudaMemset(d_step.p, 0, sizeof(std::uint64_t)));
  CUDA_OK(cudaStreamSynchronize(stream.s));

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal));
  fused_router_kernel<<<1, 32, 0, stream.s>>>(d_ids.p, top_k, k, d_step.p);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(device::launch_plan_forward_fill(s, d_ids.p, top_k, nullptr, fill, stream.s, device::plan_fill_max_blocks,
                                           20000));
  CUDA_OK(cudaStreamEndCapture(stream.s, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  ForwardPlanner<Lru> host(CacheShape{E, C}, top_k);
  ForwardPlan plan;
  Mirror m;
  std::vector<std::byte> got(bytes * C);
  const std::int32_t replays = std::min(200, count_from_env("EXPERT_CACHE_DPLAN_REPLAYS", 200));
  std::uint64_t misses = 0;
  for (std::int32_t step = 0; step < replays; ++step) {
    CAPTURE(step);
    CUDA_OK(cudaGraphLaunch(exec, stream.s));
    CUDA_OK(cudaMemcpyAsync(got.data(), slots.p, got.size(), cudaMemcpyDeviceToHost, stream.s));
    m.read(st, stream.s);
    Ids ids(top_k);
    for (std::int32_t j = 0; j < top_k; ++j) {
      ids[static_cast<std::size_t>(j)] =
          j < top_k - k ? j : static_cast<std::int32_t>(top_k + (static_cast<std::uint64_t>(step) * k + static_cast<std::uint64_t>(j)) % 50);
    }
    REQUIRE(host.plan_topk(ids, plan));
    misses += plan.misses;
    check_group(host, plan, *m.view.scalars, m.view.fills.data, m.view.evictions.data, m.view.forward_map.data);
    check_residency(host, m.view);
    CHECK(m.view.scalars->fill_ready == 0u);  // reset by the last block for the next launch
    CHECK(m.view.scalars->fill_done == 0u);
    const auto owner = host.slot_owner();
    for (std::int32_t slot = 0; slot < C; ++slot) {
      const std::int32_t e = owner[static_cast<std::size_t>(slot)];
      if (e < 0) continue;
      REQUIRE_MESSAGE(std::memcmp(got.data() + static_cast<std::size_t>(slot) * bytes, pool.p + static_cast<std::size_t>(e) * bytes,
                                  bytes) == 0,
                      "slot ", slot, " expert ", e);
    }
  }
  CHECK(misses >= static_cast<std::uint64_t>(replays) * k - 2 * top_k);
  CHECK(st.stats().misses == host.counters().misses);
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
}

// The overlapped fill (edge D4, kernels/plan_fill.cuh plan_fill_ready_kernel): plan -> fill in
// a captured graph replayed with new ids and never reset. After every replay each resident
// slot holds its expert's bytes (several blocks share each fill), its ready word equals the
// value the plan tagged it with, every per-fill arrival counter is back at 0, and the fill
// sequence counts the misses. One replay in ten runs the test kernel with a 30 us delay.
TEST_CASE("device plan kernel: the overlapped fill publishes each slot's ready word at the plan's tag (replays, no reset)") {
  constexpr std::int32_t E = 64, C = 16, top_k = 6, k = 3;
  constexpr std::size_t bytes = 256 * 1024;
  Stream stream;
  device::DevicePlanStorage st;
  CUDA_OK(st.create(E, C, stream.s));
  const DevicePlanState& s = st.state();
  PinnedBuffer pool(bytes * E);
  for (std::int32_t e = 0; e < E; ++e) {
    for (std::size_t i = 0; i < bytes; ++i) pool.p[static_cast<std::size_t>(e) * bytes + i] = std::byte{pool_byte(e, 0, i)};
  }
  DeviceBuffer<std::byte> slots(bytes * C);
  CopyRegions regions;
  regions.count = 1;
  regions.regions[0] = CopyRegion{pool.p, slots.p, bytes, bytes, bytes};
  CUDA_OK(device::resolve_mapped_regions(regions));
  device::PlanFillParams fill{};
  CUDA_OK(device::make_plan_fill_params(regions, s, fill));
  REQUIRE(fill.slot_ready == s.slot_ready.data);
  DeviceBuffer<std::int32_t> d_ids(top_k);
  DeviceBuffer<std::uint64_t> d_step(1);
  CUDA_OK(cudaMemset(d_step.p, 0, sizeof(std::uint64_t)));
  CUDA_OK(cudaStreamSynchronize(stream.s));

  auto capture = [&](const device::PlanFillDebug* debug) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal));
    fused_router_kernel<<<1, 32, 0, stream.s>>>(d_ids.p, top_k, k, d_step.p);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(device::launch_plan_forward(s, d_ids.p, top_k, nullptr, stream.s));
    CUDA_OK(device::launch_plan_fill_ready(fill, stream.s, debug));
    CUDA_OK(cudaStreamEndCapture(stream.s, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphDestroy(graph));
    return exec;
  };
  const device::PlanFillDebug slow{30000, 0};
  cudaGraphExec_t fast_exec = capture(nullptr), slow_exec = capture(&slow);

  ForwardPlanner<Lru> host(CacheShape{E, C}, top_k);
  ForwardPlan plan;
  Mirror m;
  std::vector<std::byte> got(bytes * C);
  const std::int32_t replays = std::min(200, count_from_env("EXPERT_CACHE_DPLAN_REPLAYS", 200));
  std::uint64_t misses = 0;
  for (std::int32_t step = 0; step < replays; ++step) {
    CAPTURE(step);
    CUDA_OK(cudaGraphLaunch(step % 10 == 3 ? slow_exec : fast_exec, stream.s));
    CUDA_OK(cudaMemcpyAsync(got.data(), slots.p, got.size(), cudaMemcpyDeviceToHost, stream.s));
    m.read(st, stream.s);
    Ids ids(top_k);
    for (std::int32_t j = 0; j < top_k; ++j) {
      ids[static_cast<std::size_t>(j)] =
          j < top_k - k ? j : static_cast<std::int32_t>(top_k + (static_cast<std::uint64_t>(step) * k + static_cast<std::uint64_t>(j)) % 50);
    }
    REQUIRE(host.plan_topk(ids, plan));
    misses += plan.misses;
    check_group(host, plan, *m.view.scalars, m.view.fills.data, m.view.evictions.data, m.view.forward_map.data);
    CHECK(m.view.scalars->fill_seq == static_cast<std::uint32_t>(misses));
    for (std::int32_t i = 0; i < C; ++i) CHECK(m.view.fill_arrivals[i] == 0u);
    for (std::int32_t i = 0; i < m.view.scalars->fill_count; ++i) {
      // This step's fills carry this step's tags: the last `fill_count` sequence values.
      const PlanEntry f = m.view.fills[i];
      CHECK(m.view.slot_needed[f.slot] == static_cast<std::uint32_t>(misses) - static_cast<std::uint32_t>(m.view.scalars->fill_count - 1 - i));
    }
    const auto owner = host.slot_owner();
    for (std::int32_t slot = 0; slot < C; ++slot) {
      const std::int32_t e = owner[static_cast<std::size_t>(slot)];
      if (e < 0) continue;
      CHECK_MESSAGE(m.view.slot_ready[slot] == m.view.slot_needed[slot], "slot ", slot, " ready word ", m.view.slot_ready[slot],
                    " needed ", m.view.slot_needed[slot]);
      REQUIRE_MESSAGE(std::memcmp(got.data() + static_cast<std::size_t>(slot) * bytes, pool.p + static_cast<std::size_t>(e) * bytes,
                                  bytes) == 0,
                      "slot ", slot, " expert ", e);
    }
  }
  CHECK(misses >= static_cast<std::uint64_t>(replays) * k - 2 * top_k);
  CHECK(st.error_word() == 0u);
  CUDA_OK(cudaGraphExecDestroy(fast_exec));
  CUDA_OK(cudaGraphExecDestroy(slow_exec));
}

namespace {
// The policy state the kernels keep equals the host policy's.
void check_policy_state(const Lfru& h, const DevicePlanState& s) {
  REQUIRE(s.scalars->tick - 1 == h.clock());
  for (std::int32_t slot = 0; slot < s.capacity; ++slot) {
    const std::int32_t e = s.slot_owner[slot];
    if (e < 0) continue;
    CHECK(s.slot_freq[slot] == h.freq(ExpertId(e)));
    CHECK(s.slot_tick[slot] == h.last(ExpertId(e)));
  }
}
void check_policy_state(const Crf& h, const DevicePlanState& s) {
  REQUIRE(s.scalars->crf_clock == h.clock());
  for (std::int32_t e = 0; e < s.num_experts; ++e) {
    CHECK(s.expert_crf[e] == h.crf_q32(ExpertId(e)));
    CHECK(s.expert_last[e] == h.last(ExpertId(e)));
  }
}

// Eager launches of every planning kernel of `Policy` (warp and block forward, group,
// invalidate, prefetch) against ForwardPlanner<HostPolicy> after every group and prefetch.
template <class Policy, class HostPolicy>
void policy_kernel_trace(std::uint64_t seed, std::uint64_t crf_decay = crf_default_decay_q32) {
  struct Config {
    std::int32_t E, C, top_k, max_tokens;
  };
  const Config configs[] = {{64, 16, 4, 8}, {512, 208, 10, 40}, {300, 37, 6, 12}, {128, 10, 10, 2}, {1000, 300, 8, 64}};
  Stream stream;
  const std::int32_t steps = count_from_env("EXPERT_CACHE_DPLAN_STEPS", 200);
  std::uint64_t evictions = 0, spec_used = 0;
  for (const Config& c : configs) {
    CAPTURE(c.E);
    CAPTURE(c.C);
    std::mt19937_64 rng(seed++);
    device::DevicePlanStorage st;
    CUDA_OK(st.create<Policy>(c.E, c.C, stream.s, crf_decay));
    const DevicePlanState& s = st.state();
    const std::int32_t max_n = c.max_tokens * c.top_k;
    const std::int32_t max_groups = plan_max_groups(max_n, c.E, c.C);
    DeviceBuffer<std::int32_t> d_ids(static_cast<std::size_t>(std::max(max_n, c.E)));
    ForwardPlanner<HostPolicy> host = [&] {
      if constexpr (std::is_same_v<HostPolicy, Crf>) {
        return ForwardPlanner<HostPolicy>(CacheShape{c.E, c.C}, c.top_k, Crf(CacheShape{c.E, c.C}, CrfParams{crf_decay}));
      } else {
        return ForwardPlanner<HostPolicy>(CacheShape{c.E, c.C}, c.top_k);
      }
    }();
    ForwardPlan plan;
    Mirror m;
    for (int step = 0; step < steps; ++step) {
      CAPTURE(step);
      if (rng() % 10 == 0) {
        const auto e = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E));
        CUDA_OK(device::launch_plan_invalidate(s, e, nullptr, stream.s));
        REQUIRE(host.invalidate(e));
      }
      const auto tokens = static_cast<std::int32_t>(1 + rng() % static_cast<std::uint64_t>(c.max_tokens));
      const Ids ids = random_ids(rng, c.E, c.top_k, tokens, 0.0);
      const auto n = static_cast<std::int32_t>(ids.size());
      const auto groups = host_groups(ids, c.E, c.C);
      CUDA_OK(cudaMemcpyAsync(d_ids.p, ids.data(), ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream.s));
      CUDA_OK((device::launch_plan_forward<device::plan_block_threads, Policy>(s, d_ids.p, n, nullptr, stream.s)));
      for (std::int32_t g = 0; g < max_groups; ++g) {
        CAPTURE(g);
        if (g > 0) CUDA_OK((device::launch_plan_group<device::plan_block_threads, Policy>(s, g, stream.s)));
        m.read(st, stream.s);
        const DevicePlanState& v = m.view;
        if (static_cast<std::size_t>(g) < groups.size() || (g == 0 && groups.empty())) {
          host_plan(host, ids, groups, static_cast<std::size_t>(g), plan);
          check_group(host, plan, *v.scalars, v.fills.data, v.evictions.data, v.forward_map.data);
        } else {
          CHECK(v.scalars->fill_count == 0);
        }
        check_residency(host, v);
        check_policy_state(host.policy(), v);
      }
      if (rng() % 3 == 0) {  // a prefetch of predicted ids (valid: the host refuses others)
        Ids pred;
        const auto k = static_cast<std::int32_t>(1 + rng() % static_cast<std::uint64_t>(2 * c.top_k));
        for (std::int32_t i = 0; i < k; ++i) pred.push_back(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.E)));
        const auto max_fills = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.top_k + 1));
        CUDA_OK(cudaMemcpyAsync(d_ids.p, pred.data(), pred.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream.s));
        CUDA_OK(device::launch_plan_prefetch<Policy>(s, d_ids.p, k, max_fills, 2, stream.s));
        PrefetchPlan hp;
        REQUIRE(host.plan_prefetch(pred, max_fills, 2, hp));
        m.read(st, stream.s);
        const DevicePlanState& v = m.view;
        REQUIRE(v.scalars->fill_count == static_cast<std::int32_t>(hp.fills.size()));
        CHECK(to_vector(v.fills, v.scalars->fill_count) == entries(hp.fills));
        CHECK(to_vector(v.evictions, v.scalars->eviction_count) == entries(hp.evictions));
        check_residency(host, v);
        check_policy_state(host.policy(), v);
      }
    }
    const DevicePlanStats ds = st.stats();
    CHECK(ds.hits == host.counters().hits);
    CHECK(ds.misses == host.counters().misses);
    CHECK(ds.evictions == host.counters().evictions);
    CHECK(ds.speculative_used == host.counters().speculative_used);
    CHECK((st.error_word() & (plan_error_bad_state | plan_error_bad_argument)) == 0u);
    evictions += ds.evictions;
    spec_used += ds.speculative_used;
  }
  MESSAGE(std::string(Policy::name), " kernels: evictions ", evictions, ", speculative used ", spec_used);
  if (steps >= 200) CHECK(evictions > 1000);
}
}  // namespace

TEST_CASE("device plan kernels (DeviceLfru) equal ForwardPlanner<Lfru> after every group and prefetch") {
  policy_kernel_trace<DeviceLfru, Lfru>(900);
}
TEST_CASE("device plan kernels (DeviceCrf) equal ForwardPlanner<Crf> after every group and prefetch") {
  policy_kernel_trace<DeviceCrf, Crf>(950);
}
TEST_CASE("device plan kernels (DeviceCrf, half-lives 3 and 32) equal ForwardPlanner<Crf> with the same decay") {
  for (const double half_life : {3.0, 32.0}) {
    CAPTURE(half_life);
    policy_kernel_trace<DeviceCrf, Crf>(970, crf_decay_for_half_life(half_life));
  }
}

// DeviceCrf's power table on the GPU (eviction/crf_math.hpp): six experts with a prior bias sit
// idle through 260-3000 forwards of slow churn and are then evicted by fast churn, so their keys
// and CRFs take the high-bit path of crf_decay_pow_table (__umul64hi). Every forward alternates
// the one-warp kernel (its ids) and the block kernel (the same ids padded past plan_small_ids);
// fills, evictions and every expert's CRF must equal the host Crf with the same bias.
TEST_CASE("device plan kernels (DeviceCrf): residents idle past the power table, with a prior, equal Crf") {
  constexpr std::int32_t E = 96, C = 24, top_k = 6, biased = 6;
  std::vector<std::uint64_t> bias(E, 0);
  for (std::int32_t e = 0; e < biased; ++e) bias[static_cast<std::size_t>(e)] = crf_one / 20 * static_cast<std::uint64_t>(13 + e);
  Stream stream;
  device::DevicePlanStorage st;
  CUDA_OK(st.create<DeviceCrf>(E, C, stream.s));
  CUDA_OK(st.set_bias(bias.data(), E, stream.s));
  const DevicePlanState& s = st.state();
  ForwardPlanner<Crf> host(CacheShape{E, C}, top_k, Crf(CacheShape{E, C}, CrfParams{}, bias));
  std::vector<Ids> forwards;
  std::int32_t cold = 0;
  auto next_cold = [&] { return biased + (cold++ % (E - biased)); };
  for (const std::int32_t slow : {300, 700, 260, 3000}) {
    Ids all_biased;
    for (std::int32_t e = 0; e < biased; ++e) all_biased.push_back(e);
    forwards.push_back(all_biased);
    for (std::int32_t i = 0; i < slow; ++i) forwards.push_back({next_cold(), next_cold()});
    for (std::int32_t i = 0; i < 8; ++i) {
      Ids f;
      for (std::int32_t j = 0; j < top_k; ++j) f.push_back(next_cold());
      forwards.push_back(f);
    }
  }
  DeviceBuffer<std::int32_t> d_ids(32);
  ForwardPlan plan;
  Mirror m;
  std::uint64_t old_victims = 0;
  for (std::size_t step = 0; step < forwards.size(); ++step) {
    CAPTURE(step);
    Ids ids = forwards[step];
    std::sort(ids.begin(), ids.end());
    Ids sent = ids;
    if (step % 2 == 1) sent.resize(20, -1);  // the block kernel's general path
    CUDA_OK(cudaMemcpyAsync(d_ids.p, sent.data(), sent.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream.s));
    CUDA_OK((device::launch_plan_forward<device::plan_block_threads, DeviceCrf>(s, d_ids.p, static_cast<std::int32_t>(sent.size()),
                                                                                nullptr, stream.s)));
    REQUIRE(host.plan_topk(ids, plan));
    m.read(st, stream.s);
    check_group(host, plan, *m.view.scalars, m.view.fills.data, m.view.evictions.data, m.view.forward_map.data);
    check_residency(host, m.view);
    for (std::int32_t e = 0; e < E; ++e) {
      REQUIRE(m.view.expert_crf[e] == host.policy().crf_q32(ExpertId(e)));
      REQUIRE(m.view.expert_last[e] == host.policy().last(ExpertId(e)));
    }
    for (const auto& v : plan.evictions) {
      if (host.policy().clock() - host.policy().last(v.expert) >= crf_pow_table_size) ++old_victims;
    }
  }
  MESSAGE("victims idle for ", crf_pow_table_size, " forwards or more: ", old_victims);
  CHECK(old_victims >= 10);
  CHECK((st.error_word() & (plan_error_bad_state | plan_error_bad_argument)) == 0u);
}

namespace {
// Triggers its dependents at once, then writes step *counter's ids after `delay_ns`: a plan
// launched programmatically after it is running while the ids are still the previous step's.
__global__ void late_router_kernel(std::int32_t* ids, std::int32_t n, std::int32_t experts, std::uint64_t* counter,
                                   std::uint64_t delay_ns) {
  device::detail::griddep_launch_dependents();
  const std::uint64_t until = device::global_timer_ns() + delay_ns;
  while (device::global_timer_ns() < until) __nanosleep(1000);
  const std::uint64_t step = *counter;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n; i += static_cast<std::int32_t>(blockDim.x)) {
    ids[i] = static_cast<std::int32_t>((step * static_cast<std::uint64_t>(n) + static_cast<std::uint64_t>(i)) %
                                       static_cast<std::uint64_t>(experts));
  }
  __syncthreads();
  if (threadIdx.x == 0) *counter = step + 1;
}
}  // namespace

// Edge D6 (docs/design.md): a plan launched programmatically after the kernel that writes its
// ids (launch_plan_forward's `programmatic`) waits for that kernel (griddepcontrol.wait) before
// it reads them. The router triggers at its start and writes the ids 40 us later; after every
// step the forward map must hold exactly that step's ids. The test kernel without the wait
// (plan_test_skip_wait) must get some step wrong, which shows the check can fail.
TEST_CASE("device plan kernel: a programmatically launched plan waits for the kernel that writes its ids (edge D6)") {
  if (!device::plan_fill_ready_pdl_supported()) {
    MESSAGE("no programmatic dependent launch on this device: nothing to order");
    return;
  }
  constexpr std::int32_t E = 64, C = 16, top_k = 8;
  Stream stream;
  device::DevicePlanStorage st;
  CUDA_OK(st.create(E, C, stream.s));
  const DevicePlanState& s = st.state();
  DeviceBuffer<std::int32_t> d_ids(top_k);
  DeviceBuffer<std::uint64_t> d_step(1);
  CUDA_OK(cudaMemset(d_step.p, 0, sizeof(std::uint64_t)));
  CUDA_OK(cudaMemset(d_ids.p, 0xff, sizeof(std::int32_t) * top_k));  // -1: padding
  CUDA_OK(cudaStreamSynchronize(stream.s));
  Mirror m;
  auto run = [&](bool skip_wait, std::int32_t steps) {
    std::int32_t wrong = 0;
    for (std::int32_t step = 0; step < steps; ++step) {
      std::uint64_t at = 0;
      CUDA_OK(cudaMemcpy(&at, d_step.p, sizeof at, cudaMemcpyDeviceToHost));
      late_router_kernel<<<1, 32, 0, stream.s>>>(d_ids.p, top_k, E, d_step.p, 40000);
      CUDA_OK(cudaGetLastError());
      CUDA_OK(skip_wait ? (device::launch_plan_forward<device::plan_block_threads, DeviceLru, device::plan_test_skip_wait>(
                              s, d_ids.p, top_k, nullptr, stream.s, true))
                        : device::launch_plan_forward(s, d_ids.p, top_k, nullptr, stream.s, true));
      m.read(st, stream.s);
      std::vector<std::int32_t> want(static_cast<std::size_t>(E), 0);
      for (std::int32_t i = 0; i < top_k; ++i) want[static_cast<std::size_t>((at * top_k + static_cast<std::uint64_t>(i)) % E)] = 1;
      bool same = true;
      for (std::int32_t e = 0; e < E; ++e) same = same && ((m.view.forward_map[e] >= 0) == (want[static_cast<std::size_t>(e)] != 0));
      wrong += same ? 0 : 1;
    }
    return wrong;
  };
  CHECK(run(false, 50) == 0);
  CHECK(run(true, 20) > 0);  // without the wait the plan reads the previous step's ids
}
