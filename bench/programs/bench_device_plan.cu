// Device planner micro-benchmark (Google Benchmark, CUDA events, manual time). The
// decode defaults: 48 layers x 512 experts, 208 slots per layer, top-10, batch 1. A router
// stand-in kernel (the graph's first node) writes every layer's ids on the device: 10 - k hot
// experts (resident after the first step) and k cold ones cycling through the other 502 experts
// (always misses under LRU with 208 slots), so every layer has exactly k misses per step once
// warm (reported as misses_per_layer, measured from the device stats).
//
//   ceiling                       one 256 MiB pinned H2D cudaMemcpyAsync (the same-run PCIe
//                                 ceiling every fill ratio is taken against)
//   plan/misses:k                 router + 48 x plan_forward captured once; GPU time per replay
//                                 (events over 20 replays); us_per_layer = replay / 48
//   plan/<policy>/misses:k        the same for each device policy (lru, lfru, crf; plan/misses:k
//                                 is lru): the hot ids have the higher frequency and CRF, so the
//                                 score policies also miss exactly the k cold ids per layer
//   plan_pdl/<policy>/misses:k    the same, every plan launched programmatically after the one
//                                 before it (launch overlapped; the plan waits inside)
//   plan_device_stats/lru/misses:k  plan/lru with the stats mirror in device memory instead of
//                                 mapped host memory (the cost of the mirror's PCIe stores)
//   fill/fused/<policy>/misses:k  the fused node for each device policy
//   fill/fused_pdl/misses:k       fill/fused with programmatic launches
//   router_only                   the router node alone (subtract from plan/* if wanted)
//   plan_block/<policy>/misses:k  batch 16 (160 ids per layer: 100 hot experts repeated, k cold
//                                 ones): the one-block planning kernel (more than plan_small_ids
//                                 ids), which takes a group's victims by rank through its
//                                 block-shared scratch when there are enough (plan_by_rank)
//   plan_block_argmin/<policy>/misses:k  the same plans by a block without the scratch: one block
//                                 arg-min per victim (same decisions; the same run's baseline)
//   fill/<nodes>/misses:k         router + 48 x (plan -> fill) [two_nodes] or 48 x plan_forward_fill
//                                 [fused]: k misses per layer of the NVFP4 Marlin expert (hidden
//                                 2048, intermediate 512: 1 MiB, 512 KiB, 128 KiB, 64 KiB, 4 B, 4 B
//                                 = 1.688 MiB) copied zero-copy from mapped pinned tensor-major
//                                 pools (one CopyRegion per tensor); ratio_of_pinned = the fill's
//                                 bytes per second / the ceiling, planning included
//
// Run: --benchmark_repetitions=5 --benchmark_report_aggregates_only=true (read the medians).
#include <benchmark/benchmark.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "expert_cache/device_cache/plan_storage.cuh"
#include "expert_cache/kernels/plan_fill.cuh"
#include "expert_cache/kernels/plan_kernels.cuh"
#include "expert_cache/planning/device_plan.hpp"
#include "bench_check.cuh"
#include "pinned_ceiling.cuh"

using namespace expert_cache;

namespace {

constexpr std::int32_t kExperts = 512, kSlots = 208, kTopK = 10, kLayers = 48;
constexpr std::size_t kTensors[] = {1u << 20, 512u << 10, 128u << 10, 64u << 10, 4, 4};
constexpr std::size_t kTensorCount = sizeof(kTensors) / sizeof(kTensors[0]);
constexpr std::size_t expert_bytes() {
  std::size_t b = 0;
  for (std::size_t t : kTensors) b += t;
  return b;
}

// Layer-independent ids (each layer has its own state), `per_layer` per layer: the first
// per_layer - k hot (experts 0..hot_experts-1, repeated), the last k cold ones cycling through
// the other experts (k misses per step once warm).
__global__ void router_kernel(std::int32_t* ids, std::int32_t per_layer, std::int32_t hot_experts, std::int32_t k,
                              std::uint64_t* step_counter) {
  const std::uint64_t step = *step_counter;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < kLayers * per_layer;
       i += static_cast<std::int32_t>(blockDim.x)) {
    const std::int32_t j = i % per_layer;
    const std::int32_t hot = per_layer - k;
    ids[i] = j < hot ? j % hot_experts
                     : hot_experts + static_cast<std::int32_t>((step * static_cast<std::uint64_t>(k) +
                                                                static_cast<std::uint64_t>(j - hot)) %
                                                               static_cast<std::uint64_t>(kExperts - hot_experts));
  }
  __syncthreads();
  if (threadIdx.x == 0) *step_counter = step + 1;
}
// Batch 1: top-10, 10 - k hot experts. Batch 16: 160 ids, 100 hot experts (repeated).
constexpr std::int32_t kBatchIds = 160, kBatchHot = 100;

// The planning block without a rank scratch: victims by one block arg-min each.
template <int Threads>
struct ArgMinBlock : device::CubBlock<Threads> {
  using device::CubBlock<Threads>::CubBlock;
  __device__ RankScratch rank_scratch() noexcept { return {}; }
};
template <class Policy>
__global__ void __launch_bounds__(device::plan_block_threads)
    plan_argmin_kernel(const DevicePlanState s, const std::int32_t* ids, std::int32_t n_ids) {
  __shared__ typename device::CubBlock<device::plan_block_threads>::TempStorage temp;
  ArgMinBlock<device::plan_block_threads> b(temp);
  plan_forward<Policy>(b, s, ids, n_ids, nullptr);
}

struct World {
  cudaStream_t stream = nullptr;
  // Per device policy (DevicePolicyKind order: lru, lfru, crf): one state per layer, and its
  // fill parameters.
  std::vector<device::DevicePlanStorage> policy_states[3];
  std::vector<device::PlanFillParams> policy_fills[3];
  std::vector<device::DevicePlanStorage>& states = policy_states[0];
  std::int32_t* ids = nullptr;
  std::int32_t* batch_ids = nullptr;
  std::uint64_t* step = nullptr;
  std::byte* pools[kTensorCount] = {};
  std::byte* slots[kTensorCount] = {};
  std::vector<device::PlanFillParams>& fills = policy_fills[0];
  double ceiling_gbps = 0;
  cudaEvent_t start = nullptr, stop = nullptr;

  World() {
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreate(&start));
    BENCH_CUDA(cudaEventCreate(&stop));
    BENCH_CUDA(cudaMalloc(&ids, sizeof(std::int32_t) * kLayers * kTopK));
    BENCH_CUDA(cudaMalloc(&batch_ids, sizeof(std::int32_t) * kLayers * kBatchIds));
    BENCH_CUDA(cudaMalloc(&step, sizeof(std::uint64_t)));
    CopyRegions regions;
    regions.count = kTensorCount;
    for (std::size_t t = 0; t < kTensorCount; ++t) {  // tensor-major pools, shared by every layer
      BENCH_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&pools[t]), kTensors[t] * kExperts,
                               cudaHostAllocMapped | cudaHostAllocPortable));
      std::fill(pools[t], pools[t] + kTensors[t] * kExperts, std::byte{1});
      BENCH_CUDA(cudaMalloc(&slots[t], kTensors[t] * kSlots));
      regions.regions[t] = CopyRegion{pools[t], slots[t], kTensors[t], kTensors[t], kTensors[t]};
    }
    BENCH_CUDA(device::resolve_mapped_regions(regions));
    create_states<DeviceLru>(regions);
    create_states<DeviceLfru>(regions);
    create_states<DeviceCrf>(regions);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    ceiling_gbps = measure_ceiling();
  }

  template <class Policy>
  void create_states(const CopyRegions& regions) {
    const auto p = static_cast<std::size_t>(Policy::kind);
    policy_states[p].resize(kLayers);
    policy_fills[p].resize(kLayers);
    for (std::int32_t l = 0; l < kLayers; ++l) {
      BENCH_CUDA(policy_states[p][l].template create<Policy>(kExperts, kSlots, stream));
      BENCH_CUDA(device::make_plan_fill_params(regions, policy_states[p][l].state(), policy_fills[p][l]));
    }
  }

  // Median of 5 copies of 256 MiB pinned -> device (GB/s).
  double measure_ceiling() {
    Result<double> r = bench::pinned_ceiling_median(stream, std::size_t{256} << 20, 5);
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", std::string(r.status().message()).c_str());
      std::exit(1);
    }
    return r.value() * 1e-9;
  }

  // From the authoritative counters in the state block (device memory): every variant has them.
  std::uint64_t misses_layer0(std::size_t policy) {
    BENCH_CUDA(cudaStreamSynchronize(stream));
    DevicePlanStats st;
    BENCH_CUDA(cudaMemcpy(&st, policy_states[policy][0].state().counters, sizeof st, cudaMemcpyDeviceToHost));
    return st.misses;
  }

  // The plan_device_stats variant: the same states with the stats mirror and error word in
  // device memory instead of mapped host memory (what the mirror's PCIe stores cost).
  DevicePlanState device_stats_view(std::size_t policy, std::int32_t layer) {
    if (mirror == nullptr) {
      BENCH_CUDA(cudaMalloc(&mirror, sizeof(DevicePlanStats) * 3 * kLayers));
      BENCH_CUDA(cudaMalloc(&mirror_error, sizeof(std::uint32_t) * 3 * kLayers));
      BENCH_CUDA(cudaMemset(mirror, 0, sizeof(DevicePlanStats) * 3 * kLayers));
      BENCH_CUDA(cudaMemset(mirror_error, 0, sizeof(std::uint32_t) * 3 * kLayers));
    }
    DevicePlanState s = policy_states[policy][static_cast<std::size_t>(layer)].state();
    s.stats = mirror + policy * kLayers + static_cast<std::size_t>(layer);
    s.error_word = mirror_error + policy * kLayers + static_cast<std::size_t>(layer);
    return s;
  }
  DevicePlanStats* mirror = nullptr;
  std::uint32_t* mirror_error = nullptr;
};

World& world() {
  static World w;
  return w;
}

// plan_pdl / fill_fused_pdl: every planning node launched programmatically after the one
// before it (its launch overlaps that kernel; it waits for it inside). plan_device_stats: the
// stats mirror in device memory.
enum class Graph {
  router_only,
  plan,
  plan_pdl,
  plan_device_stats,
  fill_two_nodes,
  fill_fused,
  fill_fused_pdl,
  plan_block,
  plan_block_argmin
};

template <class Policy>
cudaGraphExec_t capture(World& w, Graph kind, std::int32_t k) {
  const auto p = static_cast<std::size_t>(Policy::kind);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (kind == Graph::plan_device_stats) (void)w.device_stats_view(p, 0);  // allocates: not under capture
  const bool batch = kind == Graph::plan_block || kind == Graph::plan_block_argmin;
  BENCH_CUDA(cudaStreamBeginCapture(w.stream, cudaStreamCaptureModeGlobal));
  if (batch) router_kernel<<<1, 256, 0, w.stream>>>(w.batch_ids, kBatchIds, kBatchHot, k, w.step);
  else router_kernel<<<1, 256, 0, w.stream>>>(w.ids, kTopK, kTopK, k, w.step);
  BENCH_CUDA(cudaGetLastError());
  for (std::int32_t l = 0; kind != Graph::router_only && l < kLayers; ++l) {
    const DevicePlanState s = kind == Graph::plan_device_stats
                                  ? w.device_stats_view(p, l)
                                  : w.policy_states[p][static_cast<std::size_t>(l)].state();
    const device::PlanFillParams& fill = w.policy_fills[p][static_cast<std::size_t>(l)];
    std::int32_t* layer_ids = w.ids + l * kTopK;
    if (batch) {
      std::int32_t* layer_batch = w.batch_ids + l * kBatchIds;
      if (kind == Graph::plan_block_argmin) {
        plan_argmin_kernel<Policy><<<1, device::plan_block_threads, 0, w.stream>>>(s, layer_batch, kBatchIds);
        BENCH_CUDA(cudaGetLastError());
      } else {
        BENCH_CUDA((device::launch_plan_forward<device::plan_block_threads, Policy>(s, layer_batch, kBatchIds, nullptr,
                                                                                    w.stream)));
      }
    } else if (kind == Graph::fill_fused || kind == Graph::fill_fused_pdl) {
      BENCH_CUDA((device::launch_plan_forward_fill<4, Policy>(s, layer_ids, kTopK, nullptr, fill, w.stream,
                                                              device::plan_fill_max_blocks, 0,
                                                              kind == Graph::fill_fused_pdl)));
    } else {
      BENCH_CUDA((device::launch_plan_forward<device::plan_block_threads, Policy>(s, layer_ids, kTopK, nullptr, w.stream,
                                                                                  kind == Graph::plan_pdl)));
      if (kind == Graph::fill_two_nodes) BENCH_CUDA(device::launch_plan_fill(fill, w.stream));
    }
  }
  BENCH_CUDA(cudaStreamEndCapture(w.stream, &graph));
  BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  BENCH_CUDA(cudaGraphDestroy(graph));
  return exec;
}

template <class Policy = DeviceLru>
void run_graph(benchmark::State& state, Graph kind, std::int32_t k, int replays_per_iteration, int warm) {
  World& w = world();
  const auto p = static_cast<std::size_t>(Policy::kind);
  cudaGraphExec_t exec = capture<Policy>(w, kind, k);
  for (int i = 0; i < warm; ++i) BENCH_CUDA(cudaGraphLaunch(exec, w.stream));  // slots full, cycle wrapped
  const std::uint64_t misses_before = w.misses_layer0(p);
  double total_s = 0;
  std::int64_t replays = 0;
  for (auto _ : state) {
    BENCH_CUDA(cudaEventRecord(w.start, w.stream));
    for (int i = 0; i < replays_per_iteration; ++i) BENCH_CUDA(cudaGraphLaunch(exec, w.stream));
    BENCH_CUDA(cudaEventRecord(w.stop, w.stream));
    BENCH_CUDA(cudaEventSynchronize(w.stop));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, w.start, w.stop));
    const double s = ms * 1e-3 / replays_per_iteration;
    state.SetIterationTime(s);
    total_s += s * replays_per_iteration;
    replays += replays_per_iteration;
  }
  const double misses = static_cast<double>(w.misses_layer0(p) - misses_before);
  const double per_replay_s = total_s / static_cast<double>(std::max<std::int64_t>(replays, 1));
  state.counters["us_per_layer"] = per_replay_s * 1e6 / kLayers;
  if (kind != Graph::router_only) state.counters["misses_per_layer"] = misses / static_cast<double>(std::max<std::int64_t>(replays, 1));
  if (kind == Graph::fill_two_nodes || kind == Graph::fill_fused || kind == Graph::fill_fused_pdl) {
    const double bytes = static_cast<double>(kLayers) * k * static_cast<double>(expert_bytes());
    state.counters["GBps"] = bytes / per_replay_s * 1e-9;
    state.counters["ratio_of_pinned"] = bytes / per_replay_s * 1e-9 / w.ceiling_gbps;
    state.counters["ceiling_GBps"] = w.ceiling_gbps;
  }
  BENCH_CUDA(cudaGraphExecDestroy(exec));
}

void BM_ceiling(benchmark::State& state) {
  World& w = world();
  for (auto _ : state) {
    const double gbps = w.measure_ceiling();
    state.SetIterationTime(static_cast<double>(std::size_t{256} << 20) / (gbps * 1e9));
    state.counters["GBps"] = gbps;
  }
  state.counters["setup_ceiling_GBps"] = w.ceiling_gbps;
}
void BM_router_only(benchmark::State& state) { run_graph(state, Graph::router_only, 0, 20, 5); }
// Every other row: k = the benchmark's argument. Replays per iteration and warm-up replays (the
// slots full, the cold cycle wrapped) by kind: fills replay 3 times per iteration, plans 20.
template <Graph Kind, class Policy = DeviceLru>
void BM_graph(benchmark::State& state) {
  const auto k = static_cast<std::int32_t>(state.range(0));
  const bool fill = Kind == Graph::fill_two_nodes || Kind == Graph::fill_fused || Kind == Graph::fill_fused_pdl;
  const bool batch = Kind == Graph::plan_block || Kind == Graph::plan_block_argmin;
  const int warm = k == 0 ? 5 : fill ? 220 / k + 3 : batch ? 460 / k + 5 : 260 / k + 5;
  run_graph<Policy>(state, Kind, k, fill ? 3 : 20, warm);
}

}  // namespace

BENCHMARK(BM_ceiling)->Name("ceiling")->UseManualTime()->Iterations(3)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_router_only)->Name("router_only")->UseManualTime()->Iterations(50)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::plan>)->Name("plan")->ArgName("misses")->Arg(0)->Arg(1)->Arg(2)->Arg(4)->Arg(8)->UseManualTime()
    ->Iterations(50)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::plan, DeviceLru>)->Name("plan/lru")->ArgName("misses")->Arg(0)->Arg(1)->Arg(2)->Arg(4)->Arg(8)
    ->UseManualTime()->Iterations(50)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::plan, DeviceLfru>)->Name("plan/lfru")->ArgName("misses")->Arg(0)->Arg(1)->Arg(2)->Arg(4)->Arg(8)
    ->UseManualTime()->Iterations(50)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::plan, DeviceCrf>)->Name("plan/crf")->ArgName("misses")->Arg(0)->Arg(1)->Arg(2)->Arg(4)->Arg(8)
    ->UseManualTime()->Iterations(50)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::plan_pdl, DeviceLru>)->Name("plan_pdl/lru")->ArgName("misses")->Arg(0)->Arg(1)->Arg(2)->Arg(4)->Arg(8)
    ->UseManualTime()->Iterations(50)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::plan_pdl, DeviceLfru>)->Name("plan_pdl/lfru")->ArgName("misses")->Arg(0)->Arg(1)->Arg(8)
    ->UseManualTime()->Iterations(50)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::plan_pdl, DeviceCrf>)->Name("plan_pdl/crf")->ArgName("misses")->Arg(0)->Arg(1)->Arg(8)
    ->UseManualTime()->Iterations(50)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::plan_device_stats, DeviceLru>)->Name("plan_device_stats/lru")->ArgName("misses")->Arg(0)->Arg(1)->Arg(8)
    ->UseManualTime()->Iterations(50)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::fill_fused_pdl>)->Name("fill/fused_pdl")->ArgName("misses")->Arg(1)->Arg(2)->Arg(4)->Arg(8)
    ->UseManualTime()->Iterations(5)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::fill_fused, DeviceLfru>)->Name("fill/fused/lfru")->ArgName("misses")->Arg(1)->Arg(8)
    ->UseManualTime()->Iterations(5)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::fill_fused, DeviceCrf>)->Name("fill/fused/crf")->ArgName("misses")->Arg(1)->Arg(8)
    ->UseManualTime()->Iterations(5)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::fill_two_nodes>)->Name("fill/two_nodes")->ArgName("misses")->Arg(1)->Arg(2)->Arg(4)->Arg(8)
    ->UseManualTime()->Iterations(5)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_graph<Graph::fill_fused>)->Name("fill/fused")->ArgName("misses")->Arg(1)->Arg(2)->Arg(4)->Arg(8)->UseManualTime()
    ->Iterations(5)->Unit(benchmark::kMicrosecond);

#define EXPERT_CACHE_PLAN_BLOCK_BENCH(fn, label)                                                              \
  BENCHMARK(fn)->Name(label)->ArgName("misses")->Arg(0)->Arg(2)->Arg(4)->Arg(8)->Arg(16)->Arg(32)->UseManualTime() \
      ->Iterations(50)->Unit(benchmark::kMicrosecond)
EXPERT_CACHE_PLAN_BLOCK_BENCH((BM_graph<Graph::plan_block, DeviceLru>), "plan_block/lru");
EXPERT_CACHE_PLAN_BLOCK_BENCH((BM_graph<Graph::plan_block_argmin, DeviceLru>), "plan_block_argmin/lru");
EXPERT_CACHE_PLAN_BLOCK_BENCH((BM_graph<Graph::plan_block, DeviceCrf>), "plan_block/crf");
EXPERT_CACHE_PLAN_BLOCK_BENCH((BM_graph<Graph::plan_block_argmin, DeviceCrf>), "plan_block_argmin/crf");
EXPERT_CACHE_PLAN_BLOCK_BENCH((BM_graph<Graph::plan_block, DeviceLfru>), "plan_block/lfru");

BENCHMARK_MAIN();
