// expert-cache-bench, CUDA build: the decode-loop benchmark MEASURED on a GPU (CudaRuntime
// caches, the reference NVFP4 MoE consumer of device/moe_consumer.cuh), and the MODELLED
// SimRuntime run of decode_bench.hpp when no device is usable (or with --runtime sim).
//
// Per configuration the 48 layers' host pools (41.5 GB pinned for the default model) are
// allocated and filled with synthetic NVFP4-Marlin bytes (a hash of layer, expert, tensor and
// offset; scales are valid S0E5M3 bytes, globals are finite), so every configuration and the
// all-resident run consume the same weights: the last step's outputs must be bit-identical to
// the all-resident run's (the consumer is deterministic).
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "decode_bench.hpp"
#include "expert_cache/cuda.hpp"
#include "expert_cache/device/moe_consumer.cuh"

namespace expert_cache::bench {
namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error(ErrorCode::runtime_failure, std::string(what) + " failed: " + cudaGetErrorName(err) + ": " +
                                                cudaGetErrorString(err));
  }
}

// ---- synthetic weights ------------------------------------------------------------------------

std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Fills tensor `t` of expert `e` of `layer` (bytes of the real NVFP4-Marlin layout).
void synth_fill(unsigned char* dst, std::size_t bytes, std::int32_t layer, std::int32_t e, std::size_t t) {
  const std::uint64_t key = mix64((static_cast<std::uint64_t>(layer) << 40) ^ (static_cast<std::uint64_t>(e) << 8) ^ t);
  if (t >= 4) {  // w13_scale_2 / w2_scale_2: g' (bias 2^126 folded in), weights of size ~1/256
    const float u = static_cast<float>(key >> 40) * 0x1p-24f;
    const float g = std::ldexp(0.5f + u, 118);
    std::memcpy(dst, &g, std::min(bytes, sizeof g));
    return;
  }
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w = mix64(key + i);
    if (t == 2 || t == 3) w = (w & 0x1F1F1F1F1F1F1F1FULL) | 0x8080808080808080ULL;  // S0E5M3 in [2, 30]
    std::memcpy(dst + i, &w, 8);
  }
  for (; i < bytes; ++i) dst[i] = static_cast<unsigned char>(mix64(key + i) & (t == 2 || t == 3 ? 0x1F : 0xFF)) | (t == 2 || t == 3 ? 0x80 : 0);
}

// Runs fn(layer, expert) over all (layer, expert) pairs on every CPU core.
template <class Fn>
void parallel_experts(std::int32_t layers, std::int32_t experts, Fn fn) {
  const unsigned n = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  const std::int64_t total = static_cast<std::int64_t>(layers) * experts;
  for (unsigned w = 0; w < n; ++w) {
    pool.emplace_back([&, w] {
      for (std::int64_t i = w; i < total; i += n) fn(static_cast<std::int32_t>(i / experts), static_cast<std::int32_t>(i % experts));
    });
  }
  for (std::thread& th : pool) th.join();
}

// ---- device buffers ---------------------------------------------------------------------------

struct DeviceBuffer {
  void* p = nullptr;
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) { check_cuda(cudaMalloc(&p, bytes), "cudaMalloc"); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p(o.p) { o.p = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p, o.p);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (p) cudaFree(p);
  }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(p);
  }
};

struct PinnedBuffer {
  void* p = nullptr;
  explicit PinnedBuffer(std::size_t bytes) { check_cuda(cudaHostAlloc(&p, bytes, cudaHostAllocDefault), "cudaHostAlloc"); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (p) cudaFreeHost(p);
  }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(p);
  }
};

// The same-run ceiling: best of three 256 MiB pinned H2D copies.
double measure_pcie_ceiling(cudaStream_t stream) {
  const std::size_t bytes = std::size_t{256} << 20;
  PinnedBuffer host(bytes);
  DeviceBuffer dev(bytes);
  std::memset(host.p, 1, bytes);
  cudaEvent_t a, b;
  check_cuda(cudaEventCreate(&a), "cudaEventCreate");
  check_cuda(cudaEventCreate(&b), "cudaEventCreate");
  float best_ms = 1e30f;
  for (int i = 0; i < 4; ++i) {
    check_cuda(cudaEventRecord(a, stream), "cudaEventRecord");
    check_cuda(cudaMemcpyAsync(dev.p, host.p, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    check_cuda(cudaEventRecord(b, stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    if (i > 0) best_ms = std::min(best_ms, ms);  // the first is a warm-up
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return static_cast<double>(bytes) / (static_cast<double>(best_ms) * 1e-3);
}

// State shared by the runs of one report: inputs, per-layer outputs of the last step.
struct GpuContext {
  cudaStream_t consumer = nullptr;
  std::unique_ptr<device::MoeConsumer> moe;
  DeviceBuffer x;         // [batch, hidden] fp32, the same input every layer
  DeviceBuffer ids;       // [batch * top_k]
  DeviceBuffer weights;   // [batch * top_k]
  DeviceBuffer out;       // [layers, batch, hidden]
  std::unique_ptr<PinnedBuffer> staging;  // ids + weights upload
  std::vector<float> resident_out;        // the all-resident run's last-step outputs
};

using Clock = std::chrono::steady_clock;
double ns_since(Clock::time_point t0) {
  return static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

// One measured decode run. `prepare(l, ids)` returns the MoeWeights for layer l (the cache's
// view, or the resident arrays) and accounts hits/misses itself.
template <class PrepareFn>
void decode_loop(const Model& m, const Routing& routing, const BenchArgs& a, GpuContext& ctx, RunResult& r,
                 Progress& progress, PrepareFn&& prepare) {
  const std::size_t n_ids = static_cast<std::size_t>(m.ids_per_forward());
  auto* stage_ids = ctx.staging->as<std::int32_t>();
  auto* stage_w = reinterpret_cast<float*>(stage_ids + n_ids);
  Clock::time_point measure_start{};
  for (std::int32_t s = 0; s < routing.steps; ++s) {
    if (s == a.warmup) measure_start = Clock::now();
    const auto step_start = Clock::now();
    for (std::int32_t l = 0; l < m.layers; ++l) {
      // The routing read-back point of an engine: the host waits for the consumer stream.
      check_cuda(cudaStreamSynchronize(ctx.consumer), "cudaStreamSynchronize");
      const auto ids = routing.forward(s, l);
      const auto w = routing.forward_weights(s, l);
      std::memcpy(stage_ids, ids.data(), n_ids * sizeof(std::int32_t));
      std::memcpy(stage_w, w.data(), n_ids * sizeof(float));
      check_cuda(cudaMemcpyAsync(ctx.ids.p, stage_ids, n_ids * sizeof(std::int32_t), cudaMemcpyHostToDevice, ctx.consumer),
                 "cudaMemcpyAsync(ids)");
      check_cuda(cudaMemcpyAsync(ctx.weights.p, stage_w, n_ids * sizeof(float), cudaMemcpyHostToDevice, ctx.consumer),
                 "cudaMemcpyAsync(weights)");
      const device::MoeWeights mw = prepare(l, ids, s >= a.warmup);
      float* out = ctx.out.as<float>() + static_cast<std::size_t>(l) * static_cast<std::size_t>(m.batch * m.layout.hidden);
      if (Status st = ctx.moe->run(mw, ctx.ids.as<std::int32_t>(), ctx.weights.as<float>(), ctx.x.as<float>(), out, m.batch,
                                   ctx.consumer);
          !st)
        throw Error(st);
    }
    check_cuda(cudaStreamSynchronize(ctx.consumer), "cudaStreamSynchronize");
    if (s == 0) r.cold_start_ns = ns_since(step_start);
    progress.step(s + 1, routing.steps);
  }
  r.time_ns = ns_since(measure_start);
  r.tokens = static_cast<std::int64_t>(a.steps) * m.batch;
}

std::vector<float> last_outputs(const Model& m, GpuContext& ctx) {
  std::vector<float> out(static_cast<std::size_t>(m.layers) * static_cast<std::size_t>(m.batch * m.layout.hidden));
  check_cuda(cudaMemcpy(out.data(), ctx.out.p, out.size() * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy(out)");
  return out;
}

void compare_outputs(const Model& m, GpuContext& ctx, RunResult& r) {
  if (ctx.resident_out.empty()) return;
  const std::vector<float> out = last_outputs(m, ctx);
  r.output_checked = true;
  r.check_failures = std::memcmp(out.data(), ctx.resident_out.data(), out.size() * sizeof(float)) == 0 ? 0 : 1;
}

// ---- consumer speed references ------------------------------------------------------------------

// Microseconds per layer of `cycles` passes over `layers` launches of enqueue_layer (after one
// warm-up pass), enqueued one by one.
template <class Enqueue>
double time_per_layer(std::int32_t layers, int cycles, cudaStream_t stream, Enqueue&& enqueue_layer) {
  for (std::int32_t l = 0; l < layers; ++l) enqueue_layer(l);
  cudaEvent_t e0, e1;
  check_cuda(cudaEventCreate(&e0), "cudaEventCreate");
  check_cuda(cudaEventCreate(&e1), "cudaEventCreate");
  check_cuda(cudaEventRecord(e0, stream), "cudaEventRecord");
  for (int c = 0; c < cycles; ++c)
    for (std::int32_t l = 0; l < layers; ++l) enqueue_layer(l);
  check_cuda(cudaEventRecord(e1, stream), "cudaEventRecord");
  check_cuda(cudaEventSynchronize(e1), "cudaEventSynchronize");
  float ms = 0;
  check_cuda(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return static_cast<double>(ms) * 1e3 / (static_cast<double>(cycles) * layers);
}

// The same, with one pass captured in a CUDA graph and the graph launched `cycles` times.
template <class Enqueue>
double time_per_layer_graph(std::int32_t layers, int cycles, cudaStream_t stream, Enqueue&& enqueue_layer) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  try {
    for (std::int32_t l = 0; l < layers; ++l) enqueue_layer(l);
  } catch (...) {
    (void)cudaStreamEndCapture(stream, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  check_cuda(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check_cuda(inst, "cudaGraphInstantiate");
  double us = 0;
  try {
    us = time_per_layer(1, cycles, stream, [&](std::int32_t) { check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch"); }) /
         layers;
  } catch (...) {
    cudaGraphExecDestroy(exec);
    throw;
  }
  cudaGraphExecDestroy(exec);
  return us;
}

// Read + write bytes per second of a 1 GiB device-to-device copy (median of 3).
double hbm_copy_bytes_per_s(cudaStream_t stream) {
  const std::size_t bytes = std::size_t{1} << 30;
  DeviceBuffer a(bytes), b(bytes);
  std::vector<double> us;
  for (int i = 0; i < 4; ++i) {
    const double t = time_per_layer(1, 1, stream, [&](std::int32_t) {
      check_cuda(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync(D2D)");
    });
    if (i > 0) us.push_back(t);  // the first is the warm-up
  }
  std::sort(us.begin(), us.end());
  return 2.0 * static_cast<double>(bytes) / (us[1] * 1e-6);
}

RunResult run_resident(const Model& m, const Routing& routing, const BenchArgs& a, GpuContext& ctx, Progress& progress,
                       std::vector<std::string>& notes) {
  const ExpertTensorBytes tensors = m.layout.tensors();
  const auto E = static_cast<std::size_t>(m.experts);
  // Per layer and tensor one device array of E experts (slot = expert), filled through a
  // pinned staging buffer of one layer.
  std::vector<std::array<std::unique_ptr<DeviceBuffer>, num_expert_tensors>> arrays(static_cast<std::size_t>(m.layers));
  std::size_t layer_bytes = 0;
  for (const auto& t : tensors) layer_bytes += t.bytes_per_expert * E;
  PinnedBuffer stage(layer_bytes);
  progress.note("resident: filling " + std::to_string(layer_bytes * static_cast<std::size_t>(m.layers) >> 20) +
                " MiB of device weights");
  for (std::int32_t l = 0; l < m.layers; ++l) {
    std::size_t off = 0;
    std::array<std::size_t, num_expert_tensors> offs{};
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      offs[t] = off;
      off += tensors[t].bytes_per_expert * E;
    }
    parallel_experts(1, m.experts, [&](std::int32_t, std::int32_t e) {
      for (std::size_t t = 0; t < num_expert_tensors; ++t)
        synth_fill(stage.as<unsigned char>() + offs[t] + static_cast<std::size_t>(e) * tensors[t].bytes_per_expert,
                   tensors[t].bytes_per_expert, l, e, t);
    });
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      auto& arr = arrays[static_cast<std::size_t>(l)][t];
      arr = std::make_unique<DeviceBuffer>(tensors[t].bytes_per_expert * E);
      check_cuda(cudaMemcpy(arr->p, stage.as<unsigned char>() + offs[t], tensors[t].bytes_per_expert * E, cudaMemcpyHostToDevice),
                 "cudaMemcpy(resident weights)");
    }
  }
  DeviceBuffer identity(E * sizeof(std::int32_t));
  std::vector<std::int32_t> ident(E);
  for (std::size_t e = 0; e < E; ++e) ident[e] = static_cast<std::int32_t>(e);
  check_cuda(cudaMemcpy(identity.p, ident.data(), E * sizeof(std::int32_t), cudaMemcpyHostToDevice), "cudaMemcpy(map)");
  auto weights_of = [&](std::int32_t l) {
    device::MoeWeights w;
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      w.base[t] = arrays[static_cast<std::size_t>(l)][t]->as<const unsigned char>();
      w.stride[t] = tensors[t].bytes_per_expert;
    }
    w.expert_map = identity.as<const std::int32_t>();
    w.num_experts = m.experts;
    return w;
  };

  RunResult r;
  r.provider = "resident";
  r.staging = "-";
  r.modelled = false;
  decode_loop(m, routing, a, ctx, r, progress,
              [&](std::int32_t l, std::span<const std::int32_t>, bool) { return weights_of(l); });
  ctx.resident_out = last_outputs(m, ctx);

  // Consumer weight-read bandwidth at this batch: the first step's forwards, cycling through all
  // layers (each layer's own experts and ids), so the weights come from HBM, not from an L2 that a
  // single repeated layer (~18 MB) would fit in. Measured two ways in the same run, each against a
  // large device-to-device copy: the consumer enqueued run by run (eager), and the same runs
  // replayed from a CUDA graph (how an engine's decode step runs them).
  {
    const std::size_t n_ids = static_cast<std::size_t>(m.ids_per_forward());
    DeviceBuffer all_ids(n_ids * sizeof(std::int32_t) * static_cast<std::size_t>(m.layers));
    double bytes_per_cycle = 0;
    for (std::int32_t l = 0; l < m.layers; ++l) {
      const auto ids = routing.forward(0, l);
      check_cuda(cudaMemcpy(all_ids.as<std::int32_t>() + static_cast<std::size_t>(l) * n_ids, ids.data(),
                            ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice),
                 "cudaMemcpy");
      bytes_per_cycle += static_cast<double>(routing.unique_count(0, l)) * static_cast<double>(m.expert_bytes());
    }
    const auto layer_ids = [&](std::int32_t l) { return all_ids.as<std::int32_t>() + static_cast<std::size_t>(l) * n_ids; };
    const auto run_layer = [&](std::int32_t l) {
      if (Status st = ctx.moe->run(weights_of(l), layer_ids(l), ctx.weights.as<float>(), ctx.x.as<float>(),
                                   ctx.out.as<float>(), m.batch, ctx.consumer);
          !st)
        throw Error(st);
    };
    const int cycles = std::max(1, 200 / m.layers);
    const double eager_us = time_per_layer(m.layers, cycles, ctx.consumer, run_layer);
    const double graph_us = time_per_layer_graph(m.layers, cycles, ctx.consumer, run_layer);
    const double hbm = hbm_copy_bytes_per_s(ctx.consumer);
    const double bytes = bytes_per_cycle / m.layers;
    const auto rate = [&](double us) { return bytes / (us * 1e-6); };
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "consumer (device/moe_consumer.cuh), batch %d, %.1f experts per layer (measured, resident weights, %d "
                  "layers cycled): %.1f us per layer eager = weight reads %.0f GB/s = %.3f of the HBM copy (%.0f GB/s "
                  "read+write); %.1f us graph-replayed = %.3f of HBM",
                  m.batch, bytes / static_cast<double>(m.expert_bytes()), m.layers, eager_us, rate(eager_us) * 1e-9,
                  rate(eager_us) / hbm, hbm * 1e-9, graph_us, rate(graph_us) / hbm);
    notes.emplace_back(buf);
  }
  return r;
}

template <class Cache>
RunResult run_cached(const Model& m, const Routing& routing, const BenchArgs& a, GpuContext& ctx, CudaRuntime& rt,
                     const RunConfig& cfg, Progress& progress) {
  std::vector<std::unique_ptr<Cache>> caches;
  progress.note(cfg.provider + "/" + cfg.staging + ": allocating and filling pinned host pools");
  for (std::int32_t l = 0; l < m.layers; ++l) {
    CacheOptions o;
    o.num_experts = m.experts;
    o.capacity = m.capacity;
    o.top_k = m.top_k;
    o.log = {};
    caches.push_back(std::make_unique<Cache>(rt, o, m.layout));
  }
  const ExpertTensorBytes tensors = m.layout.tensors();
  parallel_experts(m.layers, m.experts, [&](std::int32_t l, std::int32_t e) {
    auto& st = caches[static_cast<std::size_t>(l)]->storage();
    for (std::size_t t = 0; t < num_expert_tensors; ++t)
      synth_fill(reinterpret_cast<unsigned char*>(st.host_tensor(t, e)), tensors[t].bytes_per_expert, l, e, t);
  });
  std::size_t bytes_per_fill = 0;
  {
    const auto& st = caches[0]->storage();
    if constexpr (Cache::StorageType::expert_contiguous) {
      bytes_per_fill = st.blob_bytes();
    } else {
      bytes_per_fill = m.expert_bytes();
    }
  }
  RunResult r;
  r.provider = cfg.provider;
  r.staging = cfg.staging;
  r.modelled = false;
  std::uint64_t hits0 = 0, misses0 = 0, copies0 = 0;
  bool snap = false;
  decode_loop(m, routing, a, ctx, r, progress, [&](std::int32_t l, std::span<const std::int32_t> ids, bool measured) {
    if (measured && !snap) {
      snap = true;
      for (auto& c : caches) {
        const CacheStats s = c->stats();
        hits0 += s.hits;
        misses0 += s.misses;
        copies0 += s.total_copies;
      }
    }
    Cache& cache = *caches[static_cast<std::size_t>(l)];
    const auto t0 = Clock::now();
    Result<ForwardView> view = cache.prepare(ids, ctx.consumer);
    const double ns = ns_since(t0);
    if (!view.ok()) throw Error(view.status());
    if (measured) {
      r.prepare_wall_ns += ns;
      ++r.prepares;
    }
    return device::moe_weights_from_view(view.value(), m.experts);
  });
  for (auto& c : caches) {
    const CacheStats s = c->stats();
    r.hits += s.hits;
    r.misses += s.misses;
    r.copies += s.total_copies;
  }
  r.hits -= hits0;
  r.misses -= misses0;
  r.copies -= copies0;
  r.pcie_bytes = static_cast<double>(r.misses) * static_cast<double>(bytes_per_fill);
  compare_outputs(m, ctx, r);
  return r;
}

template <template <class> class Storage, class Policy>
RunResult run_cached_staging(const Model& m, const Routing& routing, const BenchArgs& a, GpuContext& ctx, CudaRuntime& rt,
                             const RunConfig& cfg, Progress& progress) {
  if (cfg.staging == "inline")
    return run_cached<ExpertCache<Storage, Policy, Inline, Nvfp4Marlin, CudaRuntime>>(m, routing, a, ctx, rt, cfg, progress);
  if (cfg.staging == "copy_stream")
    return run_cached<ExpertCache<Storage, Policy, CopyStream, Nvfp4Marlin, CudaRuntime>>(m, routing, a, ctx, rt, cfg, progress);
  if (cfg.staging == "batched")
    return run_cached<ExpertCache<Storage, Policy, Batched, Nvfp4Marlin, CudaRuntime>>(m, routing, a, ctx, rt, cfg, progress);
  return run_cached<ExpertCache<Storage, Policy, Gather, Nvfp4Marlin, CudaRuntime>>(m, routing, a, ctx, rt, cfg, progress);
}

Report run_measured(const Model& m, const Routing& routing, const BenchArgs& a, Progress& progress) {
  Report rep;
  rep.modelled = false;
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  rep.runtime_name = std::string("CUDA: ") + prop.name + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ")";
  GpuContext ctx;
  check_cuda(cudaStreamCreateWithFlags(&ctx.consumer, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{ctx.consumer};
  rep.pcie_ceiling_bytes_per_s = measure_pcie_ceiling(ctx.consumer);
  ctx.moe = std::make_unique<device::MoeConsumer>(m.layout, m.batch, m.top_k);
  const std::size_t n_ids = static_cast<std::size_t>(m.ids_per_forward());
  const std::size_t act = static_cast<std::size_t>(m.batch) * static_cast<std::size_t>(m.layout.hidden);
  ctx.x = DeviceBuffer(act * sizeof(float));
  ctx.ids = DeviceBuffer(n_ids * sizeof(std::int32_t));
  ctx.weights = DeviceBuffer(n_ids * sizeof(float));
  ctx.out = DeviceBuffer(act * static_cast<std::size_t>(m.layers) * sizeof(float));
  ctx.staging = std::make_unique<PinnedBuffer>(n_ids * (sizeof(std::int32_t) + sizeof(float)));
  {
    std::vector<float> x(act);
    for (std::size_t i = 0; i < act; ++i) x[i] = static_cast<float>(mix64(i) >> 40) * 0x1p-23f - 1.0f;  // [-1, 1)
    check_cuda(cudaMemcpy(ctx.x.p, x.data(), act * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy(x)");
  }
  CudaRuntime rt;
  const std::vector<std::string> staging =
      a.staging_given ? a.staging : std::vector<std::string>{"inline", "copy_stream", "batched", "gather"};
  const std::vector<RunConfig> configs = run_configs(a, staging);
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const RunConfig& cfg = configs[i];
    progress.run_started(i, configs.size(), cfg.provider == "resident" ? std::string("resident") : cfg.provider + "/" + cfg.staging);
    if (cfg.provider == "resident") {
      rep.runs.push_back(run_resident(m, routing, a, ctx, progress, rep.notes));
    } else if (cfg.provider == "row") {
      rep.runs.push_back(run_cached_staging<TensorMajorStorage, Lru>(m, routing, a, ctx, rt, cfg, progress));
    } else {
      rep.runs.push_back(run_cached_staging<ExpertMajorStorage, Lfru>(m, routing, a, ctx, rt, cfg, progress));
    }
  }
  progress.finish();
  return rep;
}

}  // namespace
}  // namespace expert_cache::bench

int main(int argc, char** argv) {
  using namespace expert_cache::bench;
  try {
    GpuHooks gpu;
    gpu.built = true;
    gpu.device_available = [](std::string& why) {
      int count = 0;
      const cudaError_t err = cudaGetDeviceCount(&count);
      if (err != cudaSuccess || count == 0) {
        why = err == cudaSuccess ? "0 devices" : cudaGetErrorString(err);
        (void)cudaGetLastError();
        return false;
      }
      return true;
    };
    gpu.run = run_measured;
    return bench_main(argc, argv, gpu);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "expert-cache-bench: internal error: %s\n", e.what());
    return 1;
  }
}
