// NVFP4 -> Marlin repack benchmarks (Google Benchmark, GPU). Kernels:
// include/expert_cache/kernels/marlin_repack.cuh; launchers: repack/cuda_repack.cuh; layout:
// layout/nvfp4_marlin.hpp.
//
// Shapes (bf16): E64_K2048_N512 (the realistic layer: 108 MiB in, 108 MiB out), E64_K2048_N96_Np128
// (w13 shards and w2 rows padded 96 -> 128), E32_K2880_N720_Np768 (K % 128 != 0: N padded to a
// multiple of 128). Inputs are generated deterministically (splitmix64): random weight bytes, block
// scales that are positive finite e4m3 bytes (0x01..0x7E), positive global scales with w1 == w3.
//
// "Bytes moved" of a repack = S + D: S = every checkpoint source byte (six tensors, globals
// included) read, D = every Marlin output byte (six tensors, padding included) written.
//
//   reference/d2d/<shape>          D2D cudaMemcpyAsync of (S+D)/2 bytes, i.e. the same S+D bytes
//                                  read + written; GBps counts read + write. Its median (measured in
//                                  main() before any benchmark runs) is the denominator of every
//                                  ratio_to_d2d below; the benchmark re-measures it (ratio ~ 1 =
//                                  run-to-run noise).
//   repack_kernels/<shape>         launch_repack_experts only (the one tiled kernel for the whole layer,
//                                  factors precomputed; no validation/stats pass, no host sync),
//                                  cudaEvents around 8 back-to-back launches (launch gaps amortised
//                                  exactly like the reference's 8 back-to-back copies).
//                                  Counters: GBps = (S+D)/t, ratio_to_d2d.
//   repack_layer_device/<shape>    repack_layer_device end to end: wall clock of the call (stats
//                                  kernel + its host sync + repack launches) until the stream drains.
//                                  Counters: GBps, ratio_to_d2d.
//   reference/pinned_h2d_256MiB    one pinned H2D cudaMemcpyAsync of 256 MiB: the ceiling, measured in
//   reference/pinned_d2h_256MiB    main() first (and its D2H twin); re-measured by these benchmarks.
//   host_chunked/<shape>/chunk:C   repack_layer_host_chunked end to end (pinned host sources and
//                                  outputs, expert_chunk C = 64 and 16): wall clock of the call, which
//                                  returns after both its streams drained. See BM_HostChunked.
//   host_analyze/<shape>           analyze_checkpoint alone on the pinned sources: the host-side scan
//                                  the chunked path used before it validated on the GPU (kept as the
//                                  comparison for that design choice).
//
// Every benchmark has a fixed iteration count and uses manual time, so one repetition is one call;
// with --benchmark_repetitions=3 the whole program runs in well under a minute on an H200. Read the
// medians:
//   bench_repack --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "expert_cache/base/splitmix64.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/reference/nvfp4_reference.hpp"
#include "expert_cache/repack/cuda_repack.cuh"

using namespace expert_cache;

namespace {

// ---------------------------------------------------------------------------------------------
// Error handling: helpers return std::string (empty = success); benchmark bodies turn a failure
// into state.SkipWithError and return (every resource below is RAII, so early returns free it).

// The library's message (cuda_status also clears a non-sticky error so later benchmarks can run).
std::string cuda_error(cudaError_t err, const char* what) { return std::string(expert_cache::cuda_status(err, what).message()); }

#define TRY_CUDA(call)                                                         \
  do {                                                                         \
    if (const cudaError_t err_ = (call); err_ != cudaSuccess) return cuda_error(err_, #call); \
  } while (0)

#define TRY_OK(expr)                                        \
  do {                                                      \
    if (std::string msg_ = (expr); !msg_.empty()) return msg_; \
  } while (0)

#define REPACK_CUDA(state, call)                                       \
  do {                                                                \
    if (const cudaError_t err_ = (call); err_ != cudaSuccess) {       \
      (state).SkipWithError(cuda_error(err_, #call).c_str());         \
      return;                                                         \
    }                                                                 \
  } while (0)

#define REPACK_OK(state, expr)                           \
  do {                                                  \
    if (std::string msg_ = (expr); !msg_.empty()) {     \
      (state).SkipWithError(msg_.c_str());              \
      return;                                           \
    }                                                   \
  } while (0)

// Owner of one CUDA handle or allocation, released with `Free` (errors at release are ignored).
template <class T, cudaError_t (*Free)(T)>
class Owned {
 public:
  Owned() = default;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() {
    if (v_ != T{}) (void)Free(v_);
  }
  T* out() noexcept { return &v_; }
  [[nodiscard]] T get() const noexcept { return v_; }

 private:
  T v_{};
};

cudaError_t free_device(void* p) { return cudaFree(p); }
cudaError_t free_pinned(void* p) { return cudaFreeHost(p); }
cudaError_t destroy_stream(cudaStream_t s) { return cudaStreamDestroy(s); }
cudaError_t destroy_event(cudaEvent_t e) { return cudaEventDestroy(e); }

using DeviceMem = Owned<void*, free_device>;
using PinnedMem = Owned<void*, free_pinned>;
using Stream = Owned<cudaStream_t, destroy_stream>;
using Event = Owned<cudaEvent_t, destroy_event>;

// A non-blocking stream and two events.
struct Timing {
  Stream stream;
  Event start, stop;
  std::string init() {
    TRY_CUDA(cudaStreamCreateWithFlags(stream.out(), cudaStreamNonBlocking));
    TRY_CUDA(cudaEventCreate(start.out()));
    TRY_CUDA(cudaEventCreate(stop.out()));
    return {};
  }
  // GPU time of what `enqueue` (returns std::string) puts on the stream, in ms.
  template <class F>
  std::string time(F&& enqueue, float& ms) {
    TRY_CUDA(cudaStreamSynchronize(stream.get()));
    TRY_CUDA(cudaEventRecord(start.get(), stream.get()));
    if (std::string m = enqueue(); !m.empty()) {
      (void)cudaStreamSynchronize(stream.get());
      return m;
    }
    TRY_CUDA(cudaEventRecord(stop.get(), stream.get()));
    TRY_CUDA(cudaEventSynchronize(stop.get()));
    TRY_CUDA(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    return {};
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

constexpr int kBatch = 8;            // back-to-back operations per timed sample (kernels and D2D)
constexpr int kRefWarmup = 2;        // untimed samples before a reference median
constexpr int kRefSamples = 9;       // timed samples of a reference median
constexpr std::size_t kCeilingBytes = std::size_t{256} << 20;
constexpr double kMiB = 1024.0 * 1024.0;

// ---------------------------------------------------------------------------------------------
// Shapes and the layer held on host (pinned) and device.

struct Shape {
  const char* name;
  std::int64_t experts, hidden, intermediate;
  ActDtype dtype;
  [[nodiscard]] Nvfp4Marlin layout() const { return {hidden, intermediate, dtype}; }
};

constexpr Shape kShapes[] = {
    {"E64_K2048_N512", 64, 2048, 512, ActDtype::bf16},
    {"E64_K2048_N96_Np128", 64, 2048, 96, ActDtype::bf16},
    {"E32_K2880_N720_Np768", 32, 2880, 720, ActDtype::bf16},
};
constexpr std::size_t kNumShapes = std::size(kShapes);

// Per-layer byte counts, in the order of Nvfp4CheckpointPtrs / Nvfp4MarlinPtrs.
struct LayerBytes {
  std::array<std::size_t, 6> src{};  // w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2
  std::array<std::size_t, 6> dst{};  // w13, w2, w13_scale, w2_scale, w13_scale_2, w2_scale_2
  [[nodiscard]] std::size_t src_total() const { return sum(src); }
  [[nodiscard]] std::size_t dst_total() const { return sum(dst); }
  [[nodiscard]] std::size_t moved() const { return src_total() + dst_total(); }

 private:
  static std::size_t sum(const std::array<std::size_t, 6>& a) {
    std::size_t s = 0;
    for (std::size_t x : a) s += x;
    return s;
  }
};

LayerBytes layer_bytes(const Shape& s) {
  const Nvfp4Marlin l = s.layout();
  const auto e = static_cast<std::size_t>(s.experts);
  auto u = [](std::int64_t x) { return static_cast<std::size_t>(x); };
  LayerBytes b;
  b.src = {e * u(l.ckpt_w13_bytes()), e * u(l.ckpt_w13_scale_bytes()), e * 2 * sizeof(float),
           e * u(l.ckpt_w2_bytes()),  e * u(l.ckpt_w2_scale_bytes()),  e * sizeof(float)};
  b.dst = {e * u(l.w13_words()) * 4, e * u(l.w2_words()) * 4, e * u(l.w13_scale_bytes()),
           e * u(l.w2_scale_bytes()), e * sizeof(float),        e * sizeof(float)};
  return b;
}

void fill_weights(std::uint8_t* p, std::size_t n, std::uint64_t seed) {
  expert_cache::detail::SplitMix64 rng{seed};
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t r = rng.next();
    std::memcpy(p + i, &r, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<std::uint8_t>(rng.next());
}

// Positive finite e4m3fn bytes only: 0x01..0x7E (never 0x7F = NaN, never a sign bit).
void fill_scales(std::uint8_t* p, std::size_t n, std::uint64_t seed) {
  expert_cache::detail::SplitMix64 rng{seed};
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::uint8_t>(0x01 + rng.next() % 0x7E);
}

// Positive globals in [1e-3, 2e-3); `pairs`: [E, 2] with equal columns (no w1/w3 mismatch warning).
void fill_globals(float* p, std::size_t experts, bool pairs, std::uint64_t seed) {
  expert_cache::detail::SplitMix64 rng{seed};
  for (std::size_t e = 0; e < experts; ++e) {
    const float g = 1e-3f * (1.0f + static_cast<float>(rng.next() % 1000) / 1000.0f);
    if (pairs) {
      p[2 * e] = g;
      p[2 * e + 1] = g;
    } else {
      p[e] = g;
    }
  }
}

// One shape's layer: checkpoint sources in pinned host and device memory, Marlin outputs in
// device and pinned host memory, and the layer factors from one validated repack_layer_device.
struct Fixture {
  std::size_t shape_index = 0;
  Shape shape{};
  Nvfp4Marlin layout{};
  LayerBytes bytes{};
  std::array<PinnedMem, 6> h_src, h_dst;
  std::array<DeviceMem, 6> d_src, d_dst;
  Nvfp4MarlinParams params{};

  std::string init(std::size_t index) {
    shape_index = index;
    shape = kShapes[index];
    layout = shape.layout();
    if (Status s = layout.validate(); !s.ok()) return s.to_string();
    bytes = layer_bytes(shape);
    for (std::size_t i = 0; i < 6; ++i) {
      TRY_CUDA(cudaHostAlloc(h_src[i].out(), bytes.src[i], cudaHostAllocDefault));
      TRY_CUDA(cudaHostAlloc(h_dst[i].out(), bytes.dst[i], cudaHostAllocDefault));
      TRY_CUDA(cudaMalloc(d_src[i].out(), bytes.src[i]));
      TRY_CUDA(cudaMalloc(d_dst[i].out(), bytes.dst[i]));
    }
    const std::uint64_t seed = 0x5EED0000ull + index * 0x1000ull;
    const auto e = static_cast<std::size_t>(shape.experts);
    fill_weights(static_cast<std::uint8_t*>(h_src[0].get()), bytes.src[0], seed + 1);
    fill_scales(static_cast<std::uint8_t*>(h_src[1].get()), bytes.src[1], seed + 2);
    fill_globals(static_cast<float*>(h_src[2].get()), e, true, seed + 3);
    fill_weights(static_cast<std::uint8_t*>(h_src[3].get()), bytes.src[3], seed + 4);
    fill_scales(static_cast<std::uint8_t*>(h_src[4].get()), bytes.src[4], seed + 5);
    fill_globals(static_cast<float*>(h_src[5].get()), e, false, seed + 6);
    for (std::size_t i = 0; i < 6; ++i) {
      TRY_CUDA(cudaMemcpy(d_src[i].get(), h_src[i].get(), bytes.src[i], cudaMemcpyHostToDevice));
      TRY_CUDA(cudaMemset(d_dst[i].get(), 0, bytes.dst[i]));
      std::memset(h_dst[i].get(), 0, bytes.dst[i]);
    }
    // Validated pass once (also the warm-up): the layer factors for the kernels-only benchmark.
    auto report = device::repack_layer_device(layout, shape.experts, src_ptrs(), dst_ptrs(), nullptr);
    if (!report.ok()) return "repack_layer_device (setup): " + report.status().to_string();
    TRY_CUDA(cudaDeviceSynchronize());
    params = report->params;
    return {};
  }

  [[nodiscard]] device::Nvfp4CheckpointPtrs src_ptrs() const {
    return {static_cast<const std::uint8_t*>(d_src[0].get()), static_cast<const std::uint8_t*>(d_src[1].get()),
            static_cast<const float*>(d_src[2].get()),        static_cast<const std::uint8_t*>(d_src[3].get()),
            static_cast<const std::uint8_t*>(d_src[4].get()), static_cast<const float*>(d_src[5].get())};
  }
  [[nodiscard]] device::Nvfp4MarlinPtrs dst_ptrs() const {
    return {static_cast<std::uint32_t*>(d_dst[0].get()), static_cast<std::uint32_t*>(d_dst[1].get()),
            static_cast<std::uint8_t*>(d_dst[2].get()),  static_cast<std::uint8_t*>(d_dst[3].get()),
            static_cast<float*>(d_dst[4].get()),         static_cast<float*>(d_dst[5].get())};
  }
  template <class T>
  static std::span<T> span_of(const PinnedMem& m, std::size_t bytes) {
    return {static_cast<T*>(m.get()), bytes / sizeof(T)};
  }
  [[nodiscard]] Nvfp4CheckpointLayer host_src() const {
    return {shape.experts,
            span_of<const std::uint8_t>(h_src[0], bytes.src[0]),
            span_of<const std::uint8_t>(h_src[1], bytes.src[1]),
            span_of<const float>(h_src[2], bytes.src[2]),
            span_of<const std::uint8_t>(h_src[3], bytes.src[3]),
            span_of<const std::uint8_t>(h_src[4], bytes.src[4]),
            span_of<const float>(h_src[5], bytes.src[5])};
  }
  [[nodiscard]] Nvfp4MarlinLayer host_dst() const {
    return {span_of<std::uint32_t>(h_dst[0], bytes.dst[0]), span_of<std::uint32_t>(h_dst[1], bytes.dst[1]),
            span_of<std::uint8_t>(h_dst[2], bytes.dst[2]),  span_of<std::uint8_t>(h_dst[3], bytes.dst[3]),
            span_of<float>(h_dst[4], bytes.dst[4]),         span_of<float>(h_dst[5], bytes.dst[5])};
  }
};

// One shape's fixture alive at a time (benchmarks are registered grouped by shape).
std::unique_ptr<Fixture>& held() {
  static std::unique_ptr<Fixture> f;
  return f;
}

std::string fixture_for(std::size_t index, Fixture*& out) {
  auto& h = held();
  if (!h || h->shape_index != index) {
    TRY_CUDA(cudaDeviceSynchronize());
    h.reset();
    auto f = std::make_unique<Fixture>();
    TRY_OK(f->init(index));
    h = std::move(f);
  }
  out = h.get();
  return {};
}

// ---------------------------------------------------------------------------------------------
// References, measured in main() before any benchmark runs.

struct References {
  double h2d_gbps = 0;                       // pinned H2D, 256 MiB
  double d2h_gbps = 0;                       // pinned D2H, 256 MiB
  std::array<double, kNumShapes> d2d_gbps{};  // D2D of (S+D)/2 bytes per shape, read + write counted
};
References g_ref;

// D2D copy buffers of (S+D)/2 bytes for `shape`.
struct D2dBuffers {
  std::size_t copy_bytes = 0;
  DeviceMem a, b;
  std::string init(const Shape& s) {
    copy_bytes = (layer_bytes(s).moved() + 1) / 2;
    TRY_CUDA(cudaMalloc(a.out(), copy_bytes));
    TRY_CUDA(cudaMalloc(b.out(), copy_bytes));
    TRY_CUDA(cudaMemset(a.get(), 1, copy_bytes));
    TRY_CUDA(cudaMemset(b.get(), 0, copy_bytes));
    return {};
  }
  // kBatch back-to-back copies a -> b.
  std::string enqueue(cudaStream_t s) const {
    for (int i = 0; i < kBatch; ++i) TRY_CUDA(cudaMemcpyAsync(b.get(), a.get(), copy_bytes, cudaMemcpyDeviceToDevice, s));
    return {};
  }
  // GB/s of read + write bytes for one sample of `ms`.
  [[nodiscard]] double gbps(float ms) const { return 2.0 * static_cast<double>(copy_bytes) * kBatch / (ms * 1e6); }
};

// Pinned host and device buffers of kCeilingBytes.
struct CeilingBuffers {
  PinnedMem host;
  DeviceMem dev;
  std::string init() {
    TRY_CUDA(cudaHostAlloc(host.out(), kCeilingBytes, cudaHostAllocDefault));
    TRY_CUDA(cudaMalloc(dev.out(), kCeilingBytes));
    std::memset(host.get(), 1, kCeilingBytes);
    TRY_CUDA(cudaMemset(dev.get(), 2, kCeilingBytes));
    return {};
  }
  std::string enqueue(cudaStream_t s, bool h2d) const {
    if (h2d) {
      TRY_CUDA(cudaMemcpyAsync(dev.get(), host.get(), kCeilingBytes, cudaMemcpyHostToDevice, s));
    } else {
      TRY_CUDA(cudaMemcpyAsync(host.get(), dev.get(), kCeilingBytes, cudaMemcpyDeviceToHost, s));
    }
    return {};
  }
};

double ceiling_gbps(float ms) { return static_cast<double>(kCeilingBytes) / (ms * 1e6); }

std::string measure_references() {
  Timing t;
  TRY_OK(t.init());
  {
    CeilingBuffers c;
    TRY_OK(c.init());
    for (bool h2d : {true, false}) {
      std::vector<double> gbps;
      for (int r = 0; r < kRefWarmup + kRefSamples; ++r) {
        float ms = 0;
        TRY_OK(t.time([&] { return c.enqueue(t.stream.get(), h2d); }, ms));
        if (r >= kRefWarmup) gbps.push_back(ceiling_gbps(ms));
      }
      (h2d ? g_ref.h2d_gbps : g_ref.d2h_gbps) = median(gbps);
    }
  }
  for (std::size_t i = 0; i < kNumShapes; ++i) {
    D2dBuffers d;
    TRY_OK(d.init(kShapes[i]));
    std::vector<double> gbps;
    for (int r = 0; r < kRefWarmup + kRefSamples; ++r) {
      float ms = 0;
      TRY_OK(t.time([&] { return d.enqueue(t.stream.get()); }, ms));
      if (r >= kRefWarmup) gbps.push_back(d.gbps(ms));
    }
    g_ref.d2d_gbps[i] = median(gbps);
  }
  return {};
}

double ratio(double gbps, double ref) { return ref > 0 ? gbps / ref : 0.0; }

// ---------------------------------------------------------------------------------------------
// Benchmarks.

void BM_CeilingRef(benchmark::State& state, bool h2d) {
  Timing t;
  REPACK_OK(state, t.init());
  CeilingBuffers c;
  REPACK_OK(state, c.init());
  double seconds = 0;
  for (auto _ : state) {
    float ms = 0;
    REPACK_OK(state, t.time([&] { return c.enqueue(t.stream.get(), h2d); }, ms));
    state.SetIterationTime(ms / 1e3);
    seconds += ms / 1e3;
  }
  const double bytes = static_cast<double>(kCeilingBytes) * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  const double gbps = seconds > 0 ? bytes / seconds / 1e9 : 0.0;
  state.counters["GBps"] = gbps;
  state.counters["ratio_to_pinned_ceiling"] = ratio(gbps, g_ref.h2d_gbps);
}

void BM_D2dRef(benchmark::State& state, std::size_t index) {
  Timing t;
  REPACK_OK(state, t.init());
  D2dBuffers d;
  REPACK_OK(state, d.init(kShapes[index]));
  double seconds = 0;
  for (auto _ : state) {
    float ms = 0;
    REPACK_OK(state, t.time([&] { return d.enqueue(t.stream.get()); }, ms));
    state.SetIterationTime(ms / 1e3);
    seconds += ms / 1e3;
  }
  const double bytes = 2.0 * static_cast<double>(d.copy_bytes) * kBatch * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  const double gbps = seconds > 0 ? bytes / seconds / 1e9 : 0.0;
  state.counters["GBps"] = gbps;
  state.counters["ratio_to_d2d"] = ratio(gbps, g_ref.d2d_gbps[index]);
  state.counters["MiB_moved"] = 2.0 * static_cast<double>(d.copy_bytes) / kMiB;
}

// Kernels only: kBatch back-to-back launch_repack_experts between two events.
void BM_RepackKernels(benchmark::State& state, std::size_t index) {
  Fixture* f = nullptr;
  REPACK_OK(state, fixture_for(index, f));
  Timing t;
  REPACK_OK(state, t.init());
  const auto src = f->src_ptrs();
  const auto dst = f->dst_ptrs();
  auto enqueue = [&]() -> std::string {
    for (int i = 0; i < kBatch; ++i) {
      if (Status s = device::launch_repack_experts(f->layout, f->shape.experts, src, dst, f->params, t.stream.get());
          !s.ok())
        return "launch_repack_experts: " + s.to_string();
    }
    return {};
  };
  double seconds = 0;
  for (auto _ : state) {
    float ms = 0;
    REPACK_OK(state, t.time(enqueue, ms));
    state.SetIterationTime(ms / 1e3);
    seconds += ms / 1e3;
  }
  const double bytes = static_cast<double>(f->bytes.moved()) * kBatch * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  const double gbps = seconds > 0 ? bytes / seconds / 1e9 : 0.0;
  state.counters["GBps"] = gbps;
  state.counters["ratio_to_d2d"] = ratio(gbps, g_ref.d2d_gbps[index]);
  state.counters["MiB_moved"] = static_cast<double>(f->bytes.moved()) / kMiB;
}

// repack_layer_device end to end: host wall clock from the call until the stream has drained
// (stream drained before the call, untimed).
void BM_RepackLayerDevice(benchmark::State& state, std::size_t index) {
  Fixture* f = nullptr;
  REPACK_OK(state, fixture_for(index, f));
  Stream stream;
  REPACK_CUDA(state, cudaStreamCreateWithFlags(stream.out(), cudaStreamNonBlocking));
  const auto src = f->src_ptrs();
  const auto dst = f->dst_ptrs();
  double seconds = 0;
  for (auto _ : state) {
    REPACK_CUDA(state, cudaStreamSynchronize(stream.get()));
    const auto t0 = std::chrono::steady_clock::now();
    auto report = device::repack_layer_device(f->layout, f->shape.experts, src, dst, stream.get());
    if (!report.ok()) {
      (void)cudaStreamSynchronize(stream.get());
      state.SkipWithError(("repack_layer_device: " + report.status().to_string()).c_str());
      return;
    }
    REPACK_CUDA(state, cudaStreamSynchronize(stream.get()));
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(dt);
    seconds += dt;
  }
  const double bytes = static_cast<double>(f->bytes.moved()) * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  const double gbps = seconds > 0 ? bytes / seconds / 1e9 : 0.0;
  state.counters["GBps"] = gbps;
  state.counters["ratio_to_d2d"] = ratio(gbps, g_ref.d2d_gbps[index]);
}

// repack_layer_host_chunked end to end, pinned sources and outputs.
//
// The path copies the scale bytes H2D once for the stats pass, then the S source bytes H2D and
// the D output bytes D2H; copies out run on a second stream, overlapping the next round's upload
// (both copy engines busy), so t >= ~max(S/B_h2d, D/B_d2h) + one round's fill and drain.
// Counters (t = wall clock of the call):
//   GBps                         (S + D) / t: both directions' bytes.
//   ratio_to_pinned_ceiling      GBps / B_h2d. 1.0 = the bytes of both directions moved at one
//                                direction's ceiling (what a serial design at best reaches); with
//                                H2D and D2H overlapped the ideal approaches ~2.0.
//   src_ratio_to_pinned_ceiling  (S / t) / B_h2d: only the checkpoint upload counted, i.e. compared
//                                with "just copying the sources in". Ideal for this design
//                                ~ S / (S + D) (0.5 unpadded, less with padding).
//   ratio_to_serial_ideal        (S / B_h2d + D / B_d2h) / t, using both measured ceilings: 1.0 =
//                                the copies alone, one after the other, at their ceilings; above
//                                1.0 only through the H2D/D2H overlap.
void BM_HostChunked(benchmark::State& state, std::size_t index, std::int64_t chunk) {
  Fixture* f = nullptr;
  REPACK_OK(state, fixture_for(index, f));
  Stream stream;
  REPACK_CUDA(state, cudaStreamCreateWithFlags(stream.out(), cudaStreamNonBlocking));
  const Nvfp4CheckpointLayer src = f->host_src();
  const Nvfp4MarlinLayer dst = f->host_dst();
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    auto report = device::repack_layer_host_chunked(f->layout, src, dst, stream.get(), chunk);  // drains the stream
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!report.ok()) {
      state.SkipWithError(("repack_layer_host_chunked: " + report.status().to_string()).c_str());
      return;
    }
    state.SetIterationTime(dt);
    seconds += dt;
  }
  const double iters = static_cast<double>(state.iterations());
  const double s_bytes = static_cast<double>(f->bytes.src_total());
  const double d_bytes = static_cast<double>(f->bytes.dst_total());
  state.SetBytesProcessed(static_cast<std::int64_t>((s_bytes + d_bytes) * iters));
  const double per_call = seconds > 0 ? seconds / iters : 0.0;
  const double gbps = per_call > 0 ? (s_bytes + d_bytes) / per_call / 1e9 : 0.0;
  const double src_gbps = per_call > 0 ? s_bytes / per_call / 1e9 : 0.0;
  const double ideal_s = (g_ref.h2d_gbps > 0 && g_ref.d2h_gbps > 0)
                             ? s_bytes / (g_ref.h2d_gbps * 1e9) + d_bytes / (g_ref.d2h_gbps * 1e9)
                             : 0.0;
  state.counters["GBps"] = gbps;
  state.counters["ratio_to_pinned_ceiling"] = ratio(gbps, g_ref.h2d_gbps);
  state.counters["src_ratio_to_pinned_ceiling"] = ratio(src_gbps, g_ref.h2d_gbps);
  state.counters["ratio_to_serial_ideal"] = per_call > 0 ? ideal_s / per_call : 0.0;
  state.counters["MiB_moved"] = (s_bytes + d_bytes) / kMiB;
}

// analyze_checkpoint alone on the pinned sources (host validation + layer factors; the first step
// of repack_layer_host_chunked).
void BM_HostAnalyze(benchmark::State& state, std::size_t index) {
  Fixture* f = nullptr;
  REPACK_OK(state, fixture_for(index, f));
  const Nvfp4CheckpointLayer src = f->host_src();
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    auto report = analyze_checkpoint(f->layout, src);
    benchmark::DoNotOptimize(report);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!report.ok()) {
      state.SkipWithError(("analyze_checkpoint: " + report.status().to_string()).c_str());
      return;
    }
    state.SetIterationTime(dt);
  }
  state.counters["scale_MiB"] =
      static_cast<double>(f->bytes.src[1] + f->bytes.src[4]) / kMiB;
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    std::fprintf(stderr, "bench_repack: no CUDA device\n");
    return 77;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  if (std::string err = measure_references(); !err.empty()) {
    std::fprintf(stderr, "bench_repack: measuring the references failed: %s\n", err.c_str());
    return 1;
  }
  std::fprintf(stderr, "references (median of %d): pinned H2D 256 MiB %.2f GB/s, pinned D2H 256 MiB %.2f GB/s\n",
               kRefSamples, g_ref.h2d_gbps, g_ref.d2h_gbps);
  for (std::size_t i = 0; i < kNumShapes; ++i) {
    const LayerBytes b = layer_bytes(kShapes[i]);
    std::fprintf(stderr, "  %-22s S = %8.2f MiB, D = %8.2f MiB, D2D of (S+D)/2: %.1f GB/s (read + write)\n",
                 kShapes[i].name, static_cast<double>(b.src_total()) / kMiB, static_cast<double>(b.dst_total()) / kMiB,
                 g_ref.d2d_gbps[i]);
  }

  benchmark::RegisterBenchmark("reference/pinned_h2d_256MiB", [](benchmark::State& st) { BM_CeilingRef(st, true); })
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond)
      ->Iterations(10);
  benchmark::RegisterBenchmark("reference/pinned_d2h_256MiB", [](benchmark::State& st) { BM_CeilingRef(st, false); })
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond)
      ->Iterations(10);
  for (std::size_t i = 0; i < kNumShapes; ++i) {
    const std::string name = kShapes[i].name;
    benchmark::RegisterBenchmark(("reference/d2d/" + name).c_str(), [i](benchmark::State& st) { BM_D2dRef(st, i); })
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond)
        ->Iterations(30);
    benchmark::RegisterBenchmark(("repack_kernels/" + name).c_str(),
                                 [i](benchmark::State& st) { BM_RepackKernels(st, i); })
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond)
        ->Iterations(30);
    benchmark::RegisterBenchmark(("repack_layer_device/" + name).c_str(),
                                 [i](benchmark::State& st) { BM_RepackLayerDevice(st, i); })
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond)
        ->Iterations(30);
    for (std::int64_t chunk : {std::int64_t{64}, std::int64_t{16}}) {
      benchmark::RegisterBenchmark(("host_chunked/" + name + "/chunk:" + std::to_string(chunk)).c_str(),
                                   [i, chunk](benchmark::State& st) { BM_HostChunked(st, i, chunk); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(8);
    }
    benchmark::RegisterBenchmark(("host_analyze/" + name).c_str(), [i](benchmark::State& st) { BM_HostAnalyze(st, i); })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(8);
  }

  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  (void)cudaDeviceSynchronize();
  held().reset();  // free the last fixture while the CUDA context is alive
  return 0;
}
