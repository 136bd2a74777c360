// Compute from host, measured (Google Benchmark, CUDA events, manual time): a decode layer's
// missing experts either filled into their slots first and then consumed, or read by the
// consumer itself from mapped pinned host memory in one pass (MoeConsumer::run_one_pass, which
// also writes them into their slots). The decode benchmark's defaults: 48 layers, NVFP4-Marlin
// experts of hidden 2048, intermediate 512 (1 MiB + 512 KiB + 128 KiB + 64 KiB + 4 B + 4 B =
// 1.688 MiB), top-10. Each layer has its own 20 slots (slot = expert id, identity map) and its
// own 4 host experts (mapped pinned, tensor-major: expert-major per tensor, as a cache's host
// storage); layer l's missing expert e < m is host expert 4 l + e, so a replay reads 48 m
// distinct host experts.
//
// Rows (one CUDA graph of 48 layers each, captured once; median of 30 timed replays):
//   fill_then_consumer/batch:B/missing:m  per layer: the gather fill (fill_gather_kernel, 32 x
//                                 512 threads as the Gather staging policy launches it) of the m
//                                 missing experts into their slots, then MoeConsumer::run()
//   one_pass/batch:B/missing:m    per layer: MoeConsumer::run_one_pass() with experts 0..m-1
//                                 flagged missing (read from host, written into their slots)
//   consumer_resident/batch:B     per layer: MoeConsumer::run(), everything resident
// Batch 1: ids 0..9. Batch 4: token t routes to experts (3 t + j) % 20, j < 10 (19 distinct; the
// missing expert 3 is in two pairs, so at m = 4 five pairs read from host).
//
// Counters: us_per_layer (median replay / 48); link_us_per_layer = m x 1.688 MiB at the same
// run's pinned ceiling (one 256 MiB pinned H2D cudaMemcpyAsync, median of 5); ratio_of_pinned =
// link_us_per_layer / us_per_layer (the missing bytes' share of the layer time at the ceiling;
// m > 0 only); host_pairs_per_layer (one_pass: pairs that read from host); check_failures: after
// the timed replays the missing slots of every layer are overwritten with 0xFF, one more replay
// runs, and its output (the last layer's) must equal the all-resident output bit for bit and
// layers 0 and 47 must hold the host bytes again (0 = both hold).
//
// Run: bench_consumer_host --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
// (each repetition is itself a median of 30 replays).
#include <benchmark/benchmark.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "expert_cache/kernels/fill_copy.cuh"
#include "expert_cache/reference/moe_consumer.cuh"
#include "bench_check.cuh"
#include "pinned_ceiling.cuh"

using namespace expert_cache;

namespace {

constexpr int kLayers = 48, kTopK = 10, kSlots = 20, kMaxMissing = 4, kReplays = 30, kWarm = 3;
constexpr std::size_t kTensors = num_default_expert_tensors;
const Nvfp4Marlin kLayout{2048, 512, ActDtype::bf16};
constexpr int kFillBlocks = 32, kFillThreads = 512;  // as the Gather staging policy (staging/gather_staging.cuh)

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Random expert bytes with finite values: block scales 0x80-0x9F (S0E5M3 2-16), g' = 2^110.
void random_tensor(unsigned char* dst, std::size_t t, std::size_t bytes, std::uint64_t seed) {
  if (t == 4 || t == 5) {
    const float g = 0x1p110f;
    for (std::size_t i = 0; i + 4 <= bytes; i += 4) std::memcpy(dst + i, &g, 4);
    return;
  }
  std::uint64_t s = seed;
  for (std::size_t i = 0; i < bytes; i += 8) {
    const std::uint64_t v = splitmix(s);
    std::memcpy(dst + i, &v, std::min<std::size_t>(8, bytes - i));
  }
  if (t == 2 || t == 3)
    for (std::size_t i = 0; i < bytes; ++i) dst[i] = static_cast<unsigned char>(0x80 | (dst[i] & 0x1F));
}

struct World {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::size_t bytes[kTensors] = {};
  std::size_t expert_bytes = 0;
  unsigned char* slots[kLayers][kTensors] = {};  // [kSlots] experts each
  unsigned char* host[kTensors] = {};            // [kLayers * kMaxMissing] experts each, mapped pinned
  const unsigned char* host_dev[kTensors] = {};
  std::int32_t* map = nullptr;                   // identity over kSlots
  std::int32_t* flags[kMaxMissing + 1] = {};     // flags[m][e] = e < m
  std::int32_t* ids[2] = {};                     // batch 1, batch 4
  float *x = nullptr, *topk_weights = nullptr, *out = nullptr, *out_ref[2] = {};
  std::unique_ptr<device::MoeConsumer> moe[2];
  double ceiling_gbps = 0;

  static int batch_index(int batch) { return batch == 1 ? 0 : 1; }
  static std::vector<std::int32_t> ids_of(int batch) {
    std::vector<std::int32_t> v(static_cast<std::size_t>(batch * kTopK));
    for (int t = 0; t < batch; ++t)
      for (int j = 0; j < kTopK; ++j) v[static_cast<std::size_t>(t * kTopK + j)] = (3 * t + j) % kSlots;
    return v;
  }

  World() {
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreate(&start));
    BENCH_CUDA(cudaEventCreate(&stop));
    const ExpertTensorBytes b = kLayout.tensors();
    for (std::size_t t = 0; t < kTensors; ++t) {
      bytes[t] = b[t].bytes_per_expert;
      expert_bytes += bytes[t];
    }
    // Slots: random experts (layer, slot seeds), the missing ones overwritten by the host bytes below.
    std::vector<unsigned char> buf;
    for (int l = 0; l < kLayers; ++l)
      for (std::size_t t = 0; t < kTensors; ++t) {
        buf.resize(bytes[t] * kSlots);
        for (int s = 0; s < kSlots; ++s)
          random_tensor(buf.data() + bytes[t] * static_cast<std::size_t>(s), t, bytes[t],
                        (static_cast<std::uint64_t>(l) << 32) | (static_cast<std::uint64_t>(s) << 8) | t);
        BENCH_CUDA(cudaMalloc(&slots[l][t], buf.size()));
        BENCH_CUDA(cudaMemcpy(slots[l][t], buf.data(), buf.size(), cudaMemcpyHostToDevice));
      }
    for (std::size_t t = 0; t < kTensors; ++t) {
      const std::size_t n = bytes[t] * kLayers * kMaxMissing;
      BENCH_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host[t]), n, cudaHostAllocMapped | cudaHostAllocPortable));
      for (int e = 0; e < kLayers * kMaxMissing; ++e)
        random_tensor(host[t] + bytes[t] * static_cast<std::size_t>(e), t, bytes[t], 0xABCD0000ull + static_cast<std::uint64_t>(e) * 16 + t);
      void* dev = nullptr;
      BENCH_CUDA(cudaHostGetDevicePointer(&dev, host[t], 0));
      host_dev[t] = static_cast<const unsigned char*>(dev);
    }
    // The reference state: every layer's experts 0..3 hold its host experts (what any variant
    // leaves behind), so every row computes the same outputs.
    for (int l = 0; l < kLayers; ++l)
      for (std::size_t t = 0; t < kTensors; ++t)
        BENCH_CUDA(cudaMemcpy(slots[l][t], host[t] + bytes[t] * static_cast<std::size_t>(l * kMaxMissing), bytes[t] * kMaxMissing,
                              cudaMemcpyHostToDevice));
    std::vector<std::int32_t> ident(kSlots);
    for (int e = 0; e < kSlots; ++e) ident[static_cast<std::size_t>(e)] = e;
    map = upload(ident);
    for (int m = 0; m <= kMaxMissing; ++m) {
      std::vector<std::int32_t> f(kSlots, 0);
      for (int e = 0; e < m; ++e) f[static_cast<std::size_t>(e)] = 1;
      flags[m] = upload(f);
    }
    for (const int batch : {1, 4}) ids[batch_index(batch)] = upload(ids_of(batch));
    std::vector<float> xv(static_cast<std::size_t>(4 * kLayout.hidden)), wv(static_cast<std::size_t>(4 * kTopK), 0.1f);
    std::uint64_t s = 7;
    for (auto& v : xv) v = static_cast<float>(static_cast<double>(splitmix(s) >> 11) * 0x1p-53 * 2.0 - 1.0);
    x = upload(xv);
    topk_weights = upload(wv);
    BENCH_CUDA(cudaMalloc(&out, sizeof(float) * 4 * static_cast<std::size_t>(kLayout.hidden)));
    for (const int batch : {1, 4}) {
      moe[batch_index(batch)] = std::make_unique<device::MoeConsumer>(kLayout, batch, kTopK);
      BENCH_OK(moe[batch_index(batch)]->check_host_source(host_source(0, 1)));
      // The all-resident output of the last layer (the reference of check_failures).
      float*& ref = out_ref[batch_index(batch)];
      BENCH_CUDA(cudaMalloc(&ref, sizeof(float) * static_cast<std::size_t>(batch * kLayout.hidden)));
      BENCH_OK(moe[batch_index(batch)]->run(weights(kLayers - 1), ids[batch_index(batch)], topk_weights, x, ref, batch, stream));
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    ceiling_gbps = measure_ceiling();
  }

  template <class T>
  static T* upload(const std::vector<T>& v) {
    T* d = nullptr;
    BENCH_CUDA(cudaMalloc(&d, sizeof(T) * v.size()));
    BENCH_CUDA(cudaMemcpy(d, v.data(), sizeof(T) * v.size(), cudaMemcpyHostToDevice));
    return d;
  }

  [[nodiscard]] device::MoeWeights weights(int l) const {
    device::MoeWeights w;
    for (std::size_t t = 0; t < kTensors; ++t) {
      w.base[t] = slots[l][t];
      w.stride[t] = bytes[t];
    }
    w.expert_map = map;
    w.num_experts = kSlots;
    return w;
  }
  // Layer l's host experts; expert e < m of the layer is host expert 4 l + e.
  [[nodiscard]] device::MoeHostSource host_source(int l, int m) const {
    device::MoeHostSource h;
    for (std::size_t t = 0; t < kTensors; ++t) {
      h.base[t] = host_dev[t] + bytes[t] * static_cast<std::size_t>(l * kMaxMissing);
      h.stride[t] = bytes[t];
    }
    h.missing = flags[m];
    return h;
  }
  // The gather fill of layer l's experts 0..m-1 (host expert 4 l + e -> slot e).
  [[nodiscard]] device::FillGatherParams<16> fill_params(int l, int m) const {
    device::FillGatherParams<16> p{};
    p.num_tensors = kTensors;
    p.items_per_fill = 0;
    for (std::size_t t = 0; t < kTensors; ++t) {
      device::GatherTensor& g = p.tensors[t];
      g.src = host_dev[t] + bytes[t] * static_cast<std::size_t>(l * kMaxMissing);
      g.dst = slots[l][t];
      g.src_stride = g.dst_stride = g.copy_bytes = bytes[t];
      g.width = bytes[t] % 16 == 0 ? 16 : 4;
      g.items = static_cast<std::uint32_t>((bytes[t] + g.width - 1) / g.width);
      p.item_begin[t] = p.items_per_fill;
      p.items_per_fill += g.items;
    }
    p.item_begin[kTensors] = p.items_per_fill;
    p.num_fills = static_cast<std::uint32_t>(m);
    for (int e = 0; e < m; ++e) p.expert[e] = p.slot[e] = e;
    return p;
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

  // Every layer's experts 0..m-1 overwritten with 0xFF (what a consumer that skipped them would
  // read: NaN global scales).
  void scribble(int m) {
    for (int l = 0; l < kLayers; ++l)
      for (std::size_t t = 0; t < kTensors; ++t) BENCH_CUDA(cudaMemsetAsync(slots[l][t], 0xFF, bytes[t] * static_cast<std::size_t>(m), stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
  }
  // Layers 0 and 47: experts 0..m-1 hold their host bytes.
  bool slots_hold_host(int m) {
    for (const int l : {0, kLayers - 1})
      for (std::size_t t = 0; t < kTensors; ++t) {
        const std::size_t n = bytes[t] * static_cast<std::size_t>(m);
        std::vector<unsigned char> got(n);
        BENCH_CUDA(cudaMemcpy(got.data(), slots[l][t], n, cudaMemcpyDeviceToHost));
        if (std::memcmp(got.data(), host[t] + bytes[t] * static_cast<std::size_t>(l * kMaxMissing), n) != 0) return false;
      }
    return true;
  }
  bool output_matches(int batch) {
    const std::size_t n = static_cast<std::size_t>(batch * kLayout.hidden);
    std::vector<float> a(n), r(n);
    BENCH_CUDA(cudaMemcpy(a.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(r.data(), out_ref[batch_index(batch)], n * sizeof(float), cudaMemcpyDeviceToHost));
    return std::memcmp(a.data(), r.data(), n * sizeof(float)) == 0;
  }
};

World& world() {
  static World w;
  return w;
}

enum class Row { fill_then_consumer, one_pass, consumer_resident };

cudaGraphExec_t capture(World& w, Row row, int batch, int m) {
  const device::MoeConsumer& moe = *w.moe[World::batch_index(batch)];
  const std::int32_t* ids = w.ids[World::batch_index(batch)];
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BENCH_CUDA(cudaStreamBeginCapture(w.stream, cudaStreamCaptureModeThreadLocal));
  for (int l = 0; l < kLayers; ++l) {
    if (row == Row::one_pass) {
      BENCH_OK(moe.run_one_pass(w.weights(l), w.host_source(l, m), ids, w.topk_weights, w.x, w.out, batch, w.stream));
      continue;
    }
    if (row == Row::fill_then_consumer && m > 0) BENCH_CUDA(device::launch_fill_gather(w.fill_params(l, m), kFillBlocks, kFillThreads, w.stream));
    BENCH_OK(moe.run(w.weights(l), ids, w.topk_weights, w.x, w.out, batch, w.stream));
  }
  BENCH_CUDA(cudaStreamEndCapture(w.stream, &graph));
  BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  BENCH_CUDA(cudaGraphDestroy(graph));
  return exec;
}

void run_row(benchmark::State& state, Row row) {
  World& w = world();
  const int batch = static_cast<int>(state.range(0));
  const int m = row == Row::consumer_resident ? 0 : static_cast<int>(state.range(1));
  cudaGraphExec_t exec = capture(w, row, batch, m);
  for (int i = 0; i < kWarm; ++i) BENCH_CUDA(cudaGraphLaunch(exec, w.stream));
  BENCH_CUDA(cudaStreamSynchronize(w.stream));
  std::vector<double> replay_s;
  for (auto _ : state) {
    BENCH_CUDA(cudaEventRecord(w.start, w.stream));
    BENCH_CUDA(cudaGraphLaunch(exec, w.stream));
    BENCH_CUDA(cudaEventRecord(w.stop, w.stream));
    BENCH_CUDA(cudaEventSynchronize(w.stop));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, w.start, w.stop));
    state.SetIterationTime(ms * 1e-3);
    replay_s.push_back(ms * 1e-3);
  }
  // The check: missing slots overwritten, one replay, the output and the slots as expected.
  w.scribble(m);
  BENCH_CUDA(cudaGraphLaunch(exec, w.stream));
  BENCH_CUDA(cudaStreamSynchronize(w.stream));
  const bool ok = w.output_matches(batch) && w.slots_hold_host(m);
  if (!ok) {
    // Leave the reference state for the next rows whatever happened.
    for (int l = 0; l < kLayers; ++l)
      for (std::size_t t = 0; t < kTensors; ++t)
        BENCH_CUDA(cudaMemcpy(w.slots[l][t], w.host[t] + w.bytes[t] * static_cast<std::size_t>(l * kMaxMissing),
                              w.bytes[t] * kMaxMissing, cudaMemcpyHostToDevice));
  }
  BENCH_CUDA(cudaGraphExecDestroy(exec));

  std::sort(replay_s.begin(), replay_s.end());
  const double median_s = replay_s.empty() ? 0.0 : replay_s[replay_s.size() / 2];
  const double us_per_layer = median_s * 1e6 / kLayers;
  state.counters["us_per_layer"] = us_per_layer;
  state.counters["ceiling_GBps"] = w.ceiling_gbps;
  state.counters["check_failures"] = ok ? 0.0 : 1.0;
  if (m > 0) {
    const double link_us = static_cast<double>(m) * static_cast<double>(w.expert_bytes) / (w.ceiling_gbps * 1e3);
    state.counters["link_us_per_layer"] = link_us;
    state.counters["ratio_of_pinned"] = link_us / us_per_layer;
  }
  if (row == Row::one_pass) {
    const std::vector<std::int32_t> ids = World::ids_of(batch);
    state.counters["host_pairs_per_layer"] =
        static_cast<double>(std::count_if(ids.begin(), ids.end(), [m](std::int32_t e) { return e < m; }));
  }
}

void BM_fill_then_consumer(benchmark::State& state) { run_row(state, Row::fill_then_consumer); }
void BM_one_pass(benchmark::State& state) { run_row(state, Row::one_pass); }
void BM_consumer_resident(benchmark::State& state) { run_row(state, Row::consumer_resident); }

void BM_ceiling(benchmark::State& state) {
  World& w = world();
  for (auto _ : state) {
    const double gbps = w.measure_ceiling();
    state.SetIterationTime(static_cast<double>(std::size_t{256} << 20) / (gbps * 1e9));
    state.counters["GBps"] = gbps;
  }
}

// Batch 1 rows first, then batch 4.
void batch_missing(benchmark::internal::Benchmark* b) {
  for (const int batch : {1, 4})
    for (const int m : {0, 1, 2, 4}) b->Args({batch, m});
}

}  // namespace

BENCHMARK(BM_ceiling)->Name("ceiling")->UseManualTime()->Iterations(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_consumer_resident)->Name("consumer_resident")->ArgNames({"batch"})->Arg(1)->Arg(4)->UseManualTime()
    ->Iterations(kReplays)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_fill_then_consumer)->Name("fill_then_consumer")->ArgNames({"batch", "missing"})->Apply(batch_missing)
    ->UseManualTime()->Iterations(kReplays)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_one_pass)->Name("one_pass")->ArgNames({"batch", "missing"})->Apply(batch_missing)
    ->UseManualTime()->Iterations(kReplays)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
