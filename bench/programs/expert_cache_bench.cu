// expert-cache-bench, CUDA build: the decode-loop benchmark MEASURED on a GPU (CudaRuntime
// caches, the reference NVFP4 MoE consumer of reference/moe_consumer.cuh), and the MODELLED
// SimRuntime run of decode_bench.hpp when no device is usable (or with --runtime sim). The
// --prompt mode's measured tables: decode/prompt_measured.cuh (included at the end).
//
// Per configuration the 48 layers' host pools (41.5 GB pinned for the default model) are
// allocated and filled with synthetic NVFP4-Marlin bytes (a hash of layer, expert, tensor and
// offset; scales are valid S0E5M3 bytes, globals are finite), so every configuration and the
// all-resident run consume the same weights: the last step's outputs must be bit-identical to
// the all-resident run's (the consumer is deterministic).
//
// The device provider: DeviceExpertCache (TensorMajorStorage, device LRU = the row
// provider's Lru decisions) with the whole decode step -- per layer a router stand-in kernel
// (ids and top-k weights of step *counter from a routing buffer uploaded once before timing),
// prepare (plan + fill on the device), the same MoeConsumer, [prepare_group + consumer for
// max_groups rounds], then a one-thread kernel that bumps the step counter -- captured ONCE into
// a CUDA graph; each step is one cudaGraphLaunch and nothing else. Its outputs of a few steps
// (warm-up steps after their sync, and the last step) must be bit-identical to the host-planned
// row provider's outputs of the same steps (same consumer kernels, same weight bytes), else the
// run fails. Host synchronisations of every provider are counted (host_syncs_per_token).
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../decode/decode_bench.hpp"
#include "../decode/timeline.cuh"
#include "expert_cache/cuda.hpp"
#include "expert_cache/device_cache/cuda_executor.cuh"
#include "expert_cache/prefetch/hint_selection.hpp"
#include "expert_cache/reference/moe_consumer.cuh"
#include "pinned_ceiling.cuh"

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
  explicit PinnedBuffer(std::size_t bytes, unsigned flags = cudaHostAllocDefault) {
    check_cuda(cudaHostAlloc(&p, bytes, flags), "cudaHostAlloc");
  }
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
  Result<std::vector<double>> r = pinned_copy_rates(stream, std::size_t{256} << 20, 3);
  if (!r.ok()) throw Error(r.status());
  return *std::max_element(r.value().begin(), r.value().end());
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
  std::uint64_t host_syncs = 0;           // the bench's own host waits (counted_sync)
  double pcie_ceiling_bytes_per_s = 0;    // the same-run pinned ceiling
  // Outputs of the check steps per run ("provider/staging" -> step -> [layers, batch, hidden]).
  std::map<std::string, std::map<std::int32_t, std::vector<float>>> snapshots;
  std::string row_reference;  // the first host-planned row run: the device provider's reference
  // Every layer's tensor-major host pools, pinned, mapped and filled once: each tensor-major
  // row's caches adopt them (StorageMemory, host_registered) instead of pinning and filling the
  // whole model's bytes again, which costs tens of seconds per row at the default model. An
  // expert-major row releases them before it adopts its own.
  std::vector<std::array<std::unique_ptr<PinnedBuffer>, num_expert_tensors>> host_pools;
  // The same for the expert-major rows: every layer's [E, blob] pool, shared by those rows; a
  // tensor-major row releases them, so that pinned memory never holds the model twice.
  std::vector<std::unique_ptr<PinnedBuffer>> expert_pools;
};

// Layer l's tensor-major host pools as caller memory, made on first use (synth_fill's bytes,
// the same as a cache's own pools filled by the row).
StorageMemory shared_host_pools(const Model& m, GpuContext& ctx, Progress& progress, std::int32_t l) {
  const ExpertTensorBytes tensors = m.layout.tensors();
  const auto E = static_cast<std::size_t>(m.experts);
  if (ctx.host_pools.empty()) {
    ctx.expert_pools.clear();
    progress.note("allocating and filling the pinned host pools of every layer (shared by the rows)");
    ctx.host_pools.resize(static_cast<std::size_t>(m.layers));
    for (auto& layer : ctx.host_pools)
      for (std::size_t t = 0; t < num_expert_tensors; ++t)
        if (tensors[t].bytes_per_expert > 0)
          layer[t] = std::make_unique<PinnedBuffer>(tensors[t].bytes_per_expert * E, cudaHostAllocMapped | cudaHostAllocPortable);
    parallel_experts(m.layers, m.experts, [&](std::int32_t li, std::int32_t e) {
      for (std::size_t t = 0; t < num_expert_tensors; ++t)
        if (const auto& buf = ctx.host_pools[static_cast<std::size_t>(li)][t])
          synth_fill(buf->as<unsigned char>() + static_cast<std::size_t>(e) * tensors[t].bytes_per_expert,
                     tensors[t].bytes_per_expert, li, e, t);
    });
  }
  StorageMemory mem;
  mem.host_registered = true;
  for (std::size_t t = 0; t < num_expert_tensors; ++t)
    if (const auto& buf = ctx.host_pools[static_cast<std::size_t>(l)][t]) mem.host_tensors[t] = {buf->p, tensors[t].bytes_per_expert * E};
  return mem;
}

// Layer l's expert-major host pool ([E, blob_bytes]) as caller memory, made on first use; `fresh`
// is set when this call made them (the row then fills them through its caches' storage).
StorageMemory shared_expert_pools(const Model& m, GpuContext& ctx, Progress& progress, std::int32_t l,
                                  std::size_t blob_bytes, bool& fresh) {
  const auto E = static_cast<std::size_t>(m.experts);
  if (ctx.expert_pools.empty()) {
    ctx.host_pools.clear();
    progress.note("allocating the pinned expert-major host pools of every layer (shared by the rows)");
    ctx.expert_pools.resize(static_cast<std::size_t>(m.layers));
    for (auto& pool : ctx.expert_pools)
      pool = std::make_unique<PinnedBuffer>(blob_bytes * E, cudaHostAllocMapped | cudaHostAllocPortable);
    fresh = true;
  }
  StorageMemory mem;
  mem.host_registered = true;
  mem.host_pool = {ctx.expert_pools[static_cast<std::size_t>(l)]->p, blob_bytes * E};
  return mem;
}

// Fills the shared expert-major pools that shared_expert_pools just made, through the caches'
// storage: each tensor at its place in the blob (synth_fill's bytes, as in the tensor-major pools).
template <class Caches>
void fill_shared_expert_pools(const Model& m, Caches& caches, Progress& progress, const std::string& row) {
  const ExpertTensorBytes tensors = m.layout.tensors();
  progress.note(row + ": filling the expert-major host pools");
  parallel_experts(m.layers, m.experts, [&](std::int32_t l, std::int32_t e) {
    auto& st = caches[static_cast<std::size_t>(l)]->storage();
    for (std::size_t t = 0; t < num_expert_tensors; ++t)
      synth_fill(reinterpret_cast<unsigned char*>(st.host_tensor(t, e)), tensors[t].bytes_per_expert, l, e, t);
  });
}

// Every host wait of a decode loop goes through here, so it is counted.
void counted_sync(GpuContext& ctx, cudaStream_t s) {
  ++ctx.host_syncs;
  check_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

// Warm-up steps whose outputs are kept (after their step's sync: not timed), plus the last step.
std::vector<std::int32_t> check_steps(const BenchArgs& a, std::int32_t total) {
  std::vector<std::int32_t> out;
  for (const std::int32_t s : {1, a.warmup / 2, a.warmup - 1})
    if (s >= 1 && s < a.warmup && std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  out.push_back(total - 1);
  return out;
}

using Clock = std::chrono::steady_clock;
double ns_since(Clock::time_point t0) {
  return static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

// One measured decode run. `prepare(l, ids)` returns the MoeWeights for layer l (the cache's
// view, or the resident arrays) and accounts hits/misses itself.
std::vector<float> last_outputs(const Model& m, GpuContext& ctx);

// `after(s, l)` runs after layer l's consumer is enqueued (the lookahead's prefetch point).
struct NoAfterLayer {
  void operator()(std::int32_t, std::int32_t) const noexcept {}
};
template <class PrepareFn, class AfterFn = NoAfterLayer>
void decode_loop(const Model& m, const Routing& routing, const BenchArgs& a, GpuContext& ctx, RunResult& r,
                 Progress& progress, const std::string& key, PrepareFn&& prepare, AfterFn&& after = AfterFn{}) {
  const std::size_t n_ids = static_cast<std::size_t>(m.ids_per_forward());
  const std::vector<std::int32_t> checks = check_steps(a, routing.steps);
  auto& snaps = ctx.snapshots[key];
  snaps.clear();
  std::uint64_t syncs0 = 0;
  auto* stage_ids = ctx.staging->as<std::int32_t>();
  auto* stage_w = reinterpret_cast<float*>(stage_ids + n_ids);
  Clock::time_point measure_start{};
  for (std::int32_t s = 0; s < routing.steps; ++s) {
    if (s == a.warmup) {
      measure_start = Clock::now();
      syncs0 = ctx.host_syncs;
    }
    const auto step_start = Clock::now();
    for (std::int32_t l = 0; l < m.layers; ++l) {
      // The routing read-back point of an engine: the host waits for the consumer stream.
      counted_sync(ctx, ctx.consumer);
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
      after(s, l);
    }
    counted_sync(ctx, ctx.consumer);
    if (s == 0) r.cold_start_ns = ns_since(step_start);
    if (s < a.warmup && std::find(checks.begin(), checks.end(), s) != checks.end()) snaps[s] = last_outputs(m, ctx);
    progress.step(s + 1, routing.steps);
  }
  r.time_ns = ns_since(measure_start);
  r.tokens = static_cast<std::int64_t>(a.steps) * m.batch;
  r.host_syncs = ctx.host_syncs - syncs0;
  snaps[routing.steps - 1] = last_outputs(m, ctx);
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
  decode_loop(m, routing, a, ctx, r, progress, "resident",
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
                  "consumer (reference/moe_consumer.cuh), batch %d, %.1f experts per layer (measured, resident weights, %d "
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
  // Tensor-major rows adopt the shared tensor-major pools, expert-major ones the shared expert-major
  // pools (made and filled by the first such row; each kind releases the other's first, so that
  // pinned memory never holds the model twice).
  constexpr bool shared_pools = !Cache::StorageType::expert_contiguous;
  bool fill_expert_pools = false;
  for (std::int32_t l = 0; l < m.layers; ++l) {
    CacheOptions o;
    o.num_experts = m.experts;
    o.capacity = m.capacity;
    o.top_k = m.top_k;
    o.log = {};
    if constexpr (shared_pools) {
      o.memory = shared_host_pools(m, ctx, progress, l);
    } else {
      o.memory = shared_expert_pools(m, ctx, progress, l,
                                     Cache::StorageType::blob_layout(m.layout.tensors()).blob_bytes, fill_expert_pools);
    }
    caches.push_back(std::make_unique<Cache>(rt, o, m.layout));
  }
  const ExpertTensorBytes tensors = m.layout.tensors();
  if (fill_expert_pools) fill_shared_expert_pools(m, caches, progress, cfg.provider + "/" + cfg.staging);
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
  r.prefetch = cfg.prefetch;
  r.modelled = false;
  std::uint64_t hits0 = 0, misses0 = 0, copies0 = 0, stalls0 = 0;
  std::uint64_t spec0[3] = {0, 0, 0};
  bool snap = false;
  const std::string key = run_label(cfg);
  // --prefetch: this row's predictor; one prefetch() may copy budget experts of this layout.
  Lookahead lookahead(cfg.prefetch, m.layers, m.experts, prefetch_budget(a, m), routing.widest, a.seed);
  const auto prefetch_bytes =
      static_cast<std::int64_t>(lookahead.budget()) * static_cast<std::int64_t>(total_bytes_per_expert(tensors));
  // After layer l's consumer is enqueued on ctx.consumer (the kernels that read cache[l]'s maps;
  // edge 9 asks for prefetch() after them): predict layer l+1 of the same token and prefetch it
  // into cache[l+1]. The fills run on that cache's copy stream; the consumer stream does not wait
  // for them (a later prepare() that uses one waits for exactly that fill).
  auto after = [&](std::int32_t s, std::int32_t l) {
    if (!lookahead.active()) return;
    const bool last = l + 1 == m.layers;
    const auto next = last ? std::span<const std::int32_t>{} : routing.forward(s, l + 1);
    const std::span<const std::int32_t> predicted = lookahead.after_layer(s, l, routing.forward(s, l), next, last);
    if (last) return;
    Result<PrefetchView> pv = caches[static_cast<std::size_t>(l + 1)]->prefetch(
        predicted, ctx.consumer, lookahead.prefetch_options(prefetch_bytes, a.evict_last_forward));
    if (!pv.ok()) throw Error(pv.status());
    // --two-ahead: layer l+2 too, after layer l+1's (its fills queue behind them).
    if (!lookahead.two_layers() || l + 2 >= m.layers) return;
    const std::span<const std::int32_t> two = lookahead.two_ahead(s, l, routing.forward(s, l + 2));
    Result<PrefetchView> pv2 = caches[static_cast<std::size_t>(l + 2)]->prefetch(
        two, ctx.consumer, lookahead.prefetch_options_two_ahead(prefetch_bytes, a.evict_last_forward));
    if (!pv2.ok()) throw Error(pv2.status());
  };
  decode_loop(m, routing, a, ctx, r, progress, key, [&](std::int32_t l, std::span<const std::int32_t> ids, bool measured) {
    if (measured && !snap) {
      snap = true;
      for (auto& c : caches) {
        const CacheStats s = c->stats();
        hits0 += s.hits;
        misses0 += s.misses;
        copies0 += s.total_copies;
        stalls0 += s.staging_stalls;
        spec0[0] += s.speculative_issued;
        spec0[1] += s.speculative_used;
        spec0[2] += s.speculative_wasted;
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
  }, after);
  std::uint64_t stalls = 0;
  for (auto& c : caches) {
    const CacheStats s = c->stats();
    r.hits += s.hits;
    r.misses += s.misses;
    r.copies += s.total_copies;
    stalls += s.staging_stalls;
    r.speculative_issued += s.speculative_issued;
    r.speculative_used += s.speculative_used;
    r.speculative_wasted += s.speculative_wasted;
  }
  r.hits -= hits0;
  r.misses -= misses0;
  r.copies -= copies0;
  r.speculative_issued -= spec0[0];
  r.speculative_used -= spec0[1];
  r.speculative_wasted -= spec0[2];
  r.host_syncs += stalls - stalls0;  // the library's own host waits (staging buffer reuse)
  // Bytes moved: the misses and every speculative fill (used or wasted), each one fill's bytes.
  r.pcie_bytes = static_cast<double>(r.misses + r.speculative_issued) * static_cast<double>(bytes_per_fill);
  compare_outputs(m, ctx, r);
  if (cfg.provider == "row" && ctx.row_reference.empty()) ctx.row_reference = key;
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

// ---- the device provider: one captured graph per decode step --------------------------------

// Router stand-in: the ids and top-k weights of step *counter, layer `layer`, from the routing
// buffer (the whole run's, uploaded once). The step is read on the device, so the same graph
// replays every step with new ids.
__global__ void router_kernel(const std::int32_t* ids_table, const float* w_table, const std::uint32_t* counter,
                              std::int32_t steps, std::int32_t layers, std::int32_t layer, std::int32_t n,
                              std::int32_t* ids, float* weights) {
  // A router that lets its dependents launch at once, as an engine's may: a plan launched
  // programmatically after it (overlap on sm_90) is scheduled while it runs and waits for it.
  device::detail::griddep_launch_dependents();
  const std::uint32_t step = *counter % static_cast<std::uint32_t>(steps);
  const std::size_t at = (static_cast<std::size_t>(step) * static_cast<std::size_t>(layers) + static_cast<std::size_t>(layer)) *
                         static_cast<std::size_t>(n);
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n; i += static_cast<std::int32_t>(blockDim.x)) {
    ids[i] = ids_table[at + static_cast<std::size_t>(i)];
    weights[i] = w_table[at + static_cast<std::size_t>(i)];
  }
}
__global__ void step_counter_kernel(std::uint32_t* counter) { *counter += 1; }
// Lookahead stand-in: the predictions made after layer `layer` of step *counter (for layer + 1, or
// layer + 2 from the two-ahead table; computed on the host before timing, -1 padded), read in the
// graph like the router's ids.
__global__ void hint_kernel(const std::int32_t* table, const std::uint32_t* counter, std::int32_t steps,
                            std::int32_t layers, std::int32_t layer, std::int32_t n, std::int32_t* out) {
  const std::uint32_t step = *counter % static_cast<std::uint32_t>(steps);
  const std::size_t at = (static_cast<std::size_t>(step) * static_cast<std::size_t>(layers) + static_cast<std::size_t>(layer)) *
                         static_cast<std::size_t>(n);
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n; i += static_cast<std::int32_t>(blockDim.x))
    out[i] = table[at + static_cast<std::size_t>(i)];
}
// Overflow rounds g >= 1 write their own output; an empty round (every routing this benchmark
// accepts fits one group) leaves zeros, which are not added, so the result stays bit-identical.
__global__ void add_round_kernel(float* out, const float* part, std::int32_t n) {
  const std::int32_t i = static_cast<std::int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n && part[i] != 0.0f) out[i] += part[i];
}

// Whether the overlapped fill copies W13 first (--overlap-parts w13-first; whole experts by
// default: measured faster at batch 1 and 16, docs/benchmarks.md).
inline bool overlap_w13_first(const BenchArgs& a) { return a.overlap_parts == "w13-first"; }

// overlap: DeviceCacheOptions::overlap and the consumer given the cache's readiness: the row
// "device/overlap", otherwise "device/graph".
// prefetch ("", "none" or a predictor): lookahead. The predictor runs on the host BEFORE timing
// over the whole routing (the same calls, in the same order, as the host-planned rows make
// during their loop); its lists are uploaded with the routing. In the graph, after layer l's
// prepare or router (--prefetch-at; auto: the router where the prefetch's fills run on the copy
// engine), a side stream forks from the consumer stream, a kernel copies layer l+1's list of the
// step, and cache[l+1].prefetch() plans and fills it on the device there, overlapping layer l's
// consumer; prepare(l+1) joins the side stream (edge 2).
// budget (a --budget staging, or empty): the row leaves a stage out or doubles it (see
// budget_router_staging and the others in decode/args.hpp); its outputs are not checked.
template <class Policy, template <class> class Storage>
RunResult run_device_with(const Model& m, const Routing& routing, const BenchArgs& a, GpuContext& ctx, CudaRuntime& rt,
                          Progress& progress, std::vector<std::string>& notes, bool overlap, const std::string& prefetch,
                          bool fill_only, const std::string& budget = "", bool one_pass = false,
                          FillEngine engine = FillEngine::sm_loads) {
  using Cache = DeviceExpertCache<Storage, Nvfp4Marlin, CudaRuntime, Policy>;
  const bool router_only = budget == budget_router_staging, plan_only = budget == budget_plan_staging;
  const bool plan_x2 = budget == budget_plan_x2_staging, consumer_x2 = budget == budget_consumer_x2_staging;
  fill_only = fill_only || plan_x2;  // plan_x2 is fill_only with a second plan
  const std::string device_staging_text =
      !budget.empty() ? budget
                      : (fill_only ? device_fill_only_staging
                                   : (overlap ? device_overlap_staging
                                              : (one_pass ? device_one_pass_staging : bench::device_staging)));
  // split (speculate_on_copy_engine) runs with engine sm_loads; its rows say +split.
  const std::string device_staging_label =
      device_staging_text + fill_engine_suffix(overlap && a.fill_engine == "split" ? "split" : to_string(engine));
  const char* const device_staging = device_staging_label.c_str();
  const std::int32_t n = m.ids_per_forward();
  const auto un = static_cast<std::size_t>(n);
  const std::size_t act = static_cast<std::size_t>(m.batch) * static_cast<std::size_t>(m.layout.hidden);
  std::vector<std::unique_ptr<Cache>> caches;
  const bool lookahead_row = !prefetch.empty() && prefetch != "none";
  // Expert-major rows (--device-storage expert_major) take the shared expert-major pools, the
  // host-planned rows' (made and filled by the first row that uses them).
  constexpr bool expert_major = Cache::StorageType::expert_contiguous;
  bool fill_expert_pools = false;
  for (std::int32_t l = 0; l < m.layers; ++l) {
    DeviceCacheOptions o;
    o.num_experts = m.experts;
    o.capacity = m.capacity;
    o.max_ids = n;
    o.crf_decay_q32 = crf_decay_for_half_life(a.crf_half_life);
    o.overlap = overlap;
    o.fill_by_consumer = one_pass;
    o.fill_engine = engine;
    o.speculate_on_copy_engine = overlap && a.fill_engine == "split";
    o.lookahead = lookahead_row;  // automatic: FillUse::overlapped_lookahead with overlap
    // Overlap: every missing expert's W13 tensors first, on their own ready word (edge D4c).
    o.ready_first_regions = overlap && overlap_w13_first(a) ? device::MoeConsumer::first_pass_regions : 0u;
    if constexpr (expert_major) {
      o.memory = shared_expert_pools(m, ctx, progress, l, Cache::StorageType::blob_layout(m.layout.tensors()).blob_bytes,
                                     fill_expert_pools);
    } else {
      o.memory = shared_host_pools(m, ctx, progress, l);
    }
    caches.push_back(std::make_unique<Cache>(rt, o, m.layout));
  }
  if (fill_expert_pools) fill_shared_expert_pools(m, caches, progress, "device");
  if (engine == FillEngine::automatic) {
    // Which engine automatic picked, and why (the profile is measured once per process).
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    LinkProfile lp;
    if (Status st = link_profile_for(device, total_bytes_per_expert(m.layout.tensors()), lp); !st) throw Error(st);
    // The use the caches were built for (fill_use_of, as the executor resolves automatic): the
    // note then names the engine the caches run, and says so if they differ.
    DeviceCacheOptions built;
    built.capacity = m.capacity;
    built.max_ids = n;
    built.overlap = overlap;
    built.lookahead = lookahead_row;
    std::string reason;
    const LinkProfile::EngineChoice picked = lp.choose_engines(fill_use_of(built), &reason, cuda_work_queues_from_env());
    if (picked.forwards != caches[0]->fill_engine() ||
        picked.speculate_on_copy_engine != caches[0]->speculates_on_copy_engine()) {
      reason += std::string(" (but the cache runs ") + std::string(to_string(caches[0]->fill_engine())) +
                (caches[0]->speculates_on_copy_engine() ? ", prefetches on the copy engine" : "") + ")";
    }
    notes.push_back(std::string("device/") + device_staging + (lookahead_row ? "+" + prefetch : std::string()) +
                    ": automatic picked " + reason);
  }
  // With automatic picking the copy engine, fill_by_consumer became overlap (no missing flags).
  one_pass = one_pass && caches[0]->view().missing != nullptr;
  overlap = overlap || caches[0]->readiness().enabled();
  const ExpertTensorBytes tensors = m.layout.tensors();
  const std::int32_t rounds = caches[0]->max_groups(n);
  // one_pass: each layer's host pools and missing flags as the consumer's source, checked once here.
  std::vector<device::MoeHostSource> host_sources;
  if (one_pass) {
    for (const auto& c : caches) {
      host_sources.push_back(device::moe_host_source_from(c->storage(), m.experts, c->view().missing));
      if (Status st = ctx.moe->check_host_source(host_sources.back()); !st) throw Error(st);
    }
  }
  // budget:plan_x2: per layer a shadow plan state planned with the same ids just before the
  // cache's own plan (the same decisions, so the same misses: a second plan of the same cost).
  std::vector<device::DevicePlanStorage> shadows;
  if (plan_x2) {
    shadows.resize(static_cast<std::size_t>(m.layers));
    for (auto& sh : shadows) check_cuda(sh.template create<Policy>(m.experts, m.capacity, ctx.consumer), "shadow plan state");
    check_cuda(cudaStreamSynchronize(ctx.consumer), "cudaStreamSynchronize(shadow plan states)");
  }

  // Lookahead lists: [steps][layers][list_length], -1 padded (the last layer's is empty).
  Lookahead lookahead(prefetch, m.layers, m.experts, prefetch_budget(a, m), routing.widest, a.seed);
  const std::int32_t list_n = lookahead.active() ? lookahead.list_length() : 0;
  // auto: after the router where the prefetch's fills leave the SMs and the forwards' fills alone.
  const bool prefetch_at_router =
      a.prefetch_at == "router" ||
      (a.prefetch_at == "auto" &&
       (caches[0]->fill_engine() == FillEngine::copy_engine || caches[0]->speculates_on_copy_engine()));
  // hints: layer l+1's list after layer l; hints_two: layer l+2's (--two-ahead rows), same shape.
  std::vector<std::int32_t> hints, hints_two;
  if (lookahead.active()) {
    hints.assign(static_cast<std::size_t>(routing.steps) * static_cast<std::size_t>(m.layers) * static_cast<std::size_t>(list_n), -1);
    if (lookahead.two_layers()) hints_two.assign(hints.size(), -1);
    // Scored hints: selected on the host as the cache's host-ids prefetch selects them (score
    // order, below min_score dropped); the device prefetch then takes the selected ids.
    HintSelector selector(m.experts);
    for (std::int32_t s = 0; s < routing.steps; ++s) {
      for (std::int32_t l = 0; l < m.layers; ++l) {
        const bool last = l + 1 == m.layers;
        const auto next = last ? std::span<const std::int32_t>{} : routing.forward(s, l + 1);
        std::span<const std::int32_t> p = lookahead.after_layer(s, l, routing.forward(s, l), next, last);
        if (lookahead.scored()) {
          const PrefetchOptions o = lookahead.prefetch_options(0);
          if (Status st = selector.select(p, o.scores, o.min_score); !st) throw Error(st);
          p = selector.ids();
        }
        const auto at = static_cast<std::ptrdiff_t>((static_cast<std::size_t>(s) * m.layers + l) * list_n);
        std::copy(p.begin(), p.end(), hints.begin() + at);
        if (!lookahead.two_layers() || l + 2 >= m.layers) continue;
        std::span<const std::int32_t> p2 = lookahead.two_ahead(s, l, routing.forward(s, l + 2));
        if (lookahead.scored()) {
          const PrefetchOptions o = lookahead.prefetch_options_two_ahead(0);
          if (Status st = selector.select(p2, o.scores, o.min_score); !st) throw Error(st);
          p2 = selector.ids();
        }
        std::copy(p2.begin(), p2.end(), hints_two.begin() + at);
      }
    }
  }
  const auto prefetch_bytes =
      static_cast<std::int64_t>(lookahead.budget()) * static_cast<std::int64_t>(total_bytes_per_expert(tensors));
  DeviceBuffer table_hints(std::max<std::size_t>(hints.size(), 1) * sizeof(std::int32_t));
  if (!hints.empty()) {
    check_cuda(cudaMemcpy(table_hints.p, hints.data(), hints.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice),
               "cudaMemcpy(lookahead lists)");
  }
  DeviceBuffer table_hints_two(std::max<std::size_t>(hints_two.size(), 1) * sizeof(std::int32_t));
  if (!hints_two.empty()) {
    check_cuda(cudaMemcpy(table_hints_two.p, hints_two.data(), hints_two.size() * sizeof(std::int32_t),
                          cudaMemcpyHostToDevice),
               "cudaMemcpy(two-ahead lists)");
  }
  DeviceBuffer layer_hints(std::max<std::size_t>(static_cast<std::size_t>(m.layers) * static_cast<std::size_t>(list_n), 1) *
                           sizeof(std::int32_t));
  DeviceBuffer layer_hints_two(std::max<std::size_t>(static_cast<std::size_t>(m.layers) * static_cast<std::size_t>(list_n), 1) *
                               sizeof(std::int32_t));
  cudaStream_t side = nullptr;
  cudaEvent_t forked = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreateWithFlags(side)");
  check_cuda(cudaEventCreateWithFlags(&forked, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  struct SideGuard {
    cudaStream_t s;
    cudaEvent_t e;
    ~SideGuard() {
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
      cudaEventDestroy(e);
    }
  } side_guard{side, forked};

  // The routing buffer (every step's ids and weights, uploaded once, before timing), the step
  // counter, per-layer ids / weights, the outputs of overflow rounds.
  DeviceBuffer table_ids(routing.ids.size() * sizeof(std::int32_t));
  DeviceBuffer table_w(routing.weights.size() * sizeof(float));
  check_cuda(cudaMemcpy(table_ids.p, routing.ids.data(), routing.ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice),
             "cudaMemcpy(routing ids)");
  check_cuda(cudaMemcpy(table_w.p, routing.weights.data(), routing.weights.size() * sizeof(float), cudaMemcpyHostToDevice),
             "cudaMemcpy(routing weights)");
  DeviceBuffer counter(sizeof(std::uint32_t));
  check_cuda(cudaMemset(counter.p, 0, sizeof(std::uint32_t)), "cudaMemset(counter)");
  DeviceBuffer ids(static_cast<std::size_t>(m.layers) * un * sizeof(std::int32_t));
  DeviceBuffer weights(static_cast<std::size_t>(m.layers) * un * sizeof(float));
  DeviceBuffer part(rounds > 1 ? act * sizeof(float) : sizeof(float));
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  // Capture the whole step once.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  const auto t_capture = Clock::now();
  check_cuda(cudaStreamBeginCapture(ctx.consumer, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  try {
    for (std::int32_t l = 0; l < m.layers; ++l) {
      auto* l_ids = ids.as<std::int32_t>() + static_cast<std::size_t>(l) * un;
      auto* l_w = weights.as<float>() + static_cast<std::size_t>(l) * un;
      float* out = ctx.out.as<float>() + static_cast<std::size_t>(l) * act;
      router_kernel<<<1, 128, 0, ctx.consumer>>>(table_ids.as<std::int32_t>(), table_w.as<float>(), counter.as<std::uint32_t>(),
                                                 routing.steps, m.layers, l, n, l_ids, l_w);
      check_cuda(cudaGetLastError(), "router_kernel");
      Cache& cache = *caches[static_cast<std::size_t>(l)];
      if (router_only) continue;
      if (plan_only) {  // the plan alone, on the cache's state: no fill, no consumer
        check_cuda((device::launch_plan_forward<device::plan_block_threads, Policy>(cache.plan_state(), l_ids, n, nullptr,
                                                                                    ctx.consumer)),
                   "launch_plan_forward (budget)");
        continue;
      }
      if (plan_x2) {
        check_cuda((device::launch_plan_forward<device::plan_block_threads, Policy>(
                       shadows[static_cast<std::size_t>(l)].state(), l_ids, n, nullptr, ctx.consumer)),
                   "launch_plan_forward (shadow)");
      }
      // Layer l+1's prefetch on the side stream, forked from the consumer stream (the caches are
      // per layer, so it depends on no step of cache l).
      // Layer `target`'s list made after layer l (from `table`) into `lists`, then its prefetch,
      // both on the side stream.
      const auto prefetch_list = [&](DeviceBuffer& table, DeviceBuffer& lists, std::int32_t target) {
        std::int32_t* h = lists.as<std::int32_t>() + static_cast<std::size_t>(l) * static_cast<std::size_t>(list_n);
        hint_kernel<<<1, 32, 0, side>>>(table.as<std::int32_t>(), counter.as<std::uint32_t>(), routing.steps, m.layers,
                                        l, list_n, h);
        check_cuda(cudaGetLastError(), "hint_kernel");
        // The side stream forks from the consumer stream, after every earlier step's consumers:
        // the target cache's last forward is read before its prefetch (--evict-last-forward).
        PrefetchOptions o{prefetch_bytes, 1};
        o.evict_last_forward = a.evict_last_forward;
        Result<PrefetchView> pv = caches[static_cast<std::size_t>(target)]->prefetch(h, list_n, side, o);
        if (!pv.ok()) throw Error(pv.status());
      };
      const auto fork_prefetch = [&] {
        if (list_n == 0 || l + 1 >= m.layers) return;
        check_cuda(cudaEventRecord(forked, ctx.consumer), "cudaEventRecord(fork)");
        check_cuda(cudaStreamWaitEvent(side, forked, 0), "cudaStreamWaitEvent(fork)");
        prefetch_list(table_hints, layer_hints, l + 1);
        // --two-ahead: layer l+2's list after layer l+1's prefetch (its plan, and so its fills, go
        // first).
        if (!hints_two.empty() && l + 2 < m.layers) prefetch_list(table_hints_two, layer_hints_two, l + 2);
      };
      if (prefetch_at_router) fork_prefetch();
      for (std::int32_t g = 0; g < rounds; ++g) {
        Result<ForwardView> view = g == 0 ? cache.prepare(l_ids, n, ctx.consumer) : cache.prepare_group(g, ctx.consumer);
        if (!view.ok()) throw Error(view.status());
        if (g == 0 && !prefetch_at_router) fork_prefetch();
        float* dst = g == 0 ? out : part.as<float>();
        if (g > 0) check_cuda(cudaMemsetAsync(dst, 0, act * sizeof(float), ctx.consumer), "cudaMemsetAsync(round)");
        if (fill_only) continue;  // the timing decomposition: router, plan and fills only
        const Status ran =
            one_pass ? ctx.moe->run_one_pass(device::moe_weights_from_view(view.value(), m.experts),
                                             host_sources[static_cast<std::size_t>(l)], cache.sanitized_ids_device(), l_w,
                                             ctx.x.as<float>(), dst, m.batch, ctx.consumer)
                     : ctx.moe->run(device::moe_weights_from_view(view.value(), m.experts), cache.sanitized_ids_device(),
                                    l_w, ctx.x.as<float>(), dst, m.batch, ctx.consumer, cache.readiness());
        if (!ran) throw Error(ran);
        if (consumer_x2) {  // the same consumer again (same inputs, same output)
          if (Status st = ctx.moe->run(device::moe_weights_from_view(view.value(), m.experts), cache.sanitized_ids_device(),
                                       l_w, ctx.x.as<float>(), dst, m.batch, ctx.consumer, cache.readiness());
              !st)
            throw Error(st);
        }
        if (g > 0) {
          add_round_kernel<<<static_cast<unsigned>((act + 255) / 256), 256, 0, ctx.consumer>>>(out, part.as<float>(),
                                                                                              static_cast<std::int32_t>(act));
          check_cuda(cudaGetLastError(), "add_round_kernel");
        }
      }
    }
    step_counter_kernel<<<1, 1, 0, ctx.consumer>>>(counter.as<std::uint32_t>());
    check_cuda(cudaGetLastError(), "step_counter_kernel");
  } catch (...) {
    (void)cudaStreamEndCapture(ctx.consumer, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  check_cuda(cudaStreamEndCapture(ctx.consumer, &graph), "cudaStreamEndCapture");
  std::size_t nodes = 0;
  check_cuda(cudaGraphGetNodes(graph, nullptr, &nodes), "cudaGraphGetNodes");
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check_cuda(inst, "cudaGraphInstantiate");
  struct ExecGuard {
    cudaGraphExec_t e;
    ~ExecGuard() { cudaGraphExecDestroy(e); }
  } exec_guard{exec};
  const double capture_ms = ns_since(t_capture) * 1e-6;

  RunResult r;
  r.provider = "device";
  r.staging = device_staging;
  r.prefetch = prefetch;
  r.prefetch_at = prefetch_at_router ? "router" : "prepare";
  r.modelled = false;
  const std::vector<std::int32_t> checks = check_steps(a, routing.steps);
  const std::string key = provider_label("device", device_policy_labelled(a) ? a.device_policy : std::string()) + "/" +
                          device_staging + (lookahead.active() ? "+" + prefetch : "");
  auto& snaps = ctx.snapshots[key];
  snaps.clear();
  std::uint64_t hits0 = 0, misses0 = 0, stalls0 = 0, syncs0 = 0;
  std::uint64_t spec0[3] = {0, 0, 0};
  double launch_ns = 0;
  Clock::time_point measure_start{};
  // --timeline: the monitor watches the measured steps (started after the warm-up's wait).
  std::unique_ptr<Timeline> timeline;
  if (a.timeline && !fill_only && budget.empty()) {
    std::vector<Timeline::Layer> tl;
    for (std::int32_t l = 0; l < m.layers; ++l) {
      const DevicePlanState& st = caches[static_cast<std::size_t>(l)]->plan_state();
      tl.push_back(Timeline::Layer{
          reinterpret_cast<const std::uint32_t*>(ids.as<std::int32_t>() + static_cast<std::size_t>(l) * un),
          reinterpret_cast<const std::uint32_t*>(ctx.out.as<float>() + static_cast<std::size_t>(l) * act),
          st.slot_needed.data, st.slot_ready.data});
    }
    timeline = std::make_unique<Timeline>(std::move(tl), m.capacity);
  }
  for (std::int32_t s = 0; s < routing.steps; ++s) {
    if (s == a.warmup) {
      // Exact device stats need an idle stream; this wait is before the measured steps.
      check_cuda(cudaStreamSynchronize(ctx.consumer), "cudaStreamSynchronize");
      for (auto& c : caches) {
        const CacheStats cs = c->stats();
        hits0 += cs.hits;
        misses0 += cs.misses;
        stalls0 += cs.staging_stalls;
        spec0[0] += cs.speculative_issued;
        spec0[1] += cs.speculative_used;
        spec0[2] += cs.speculative_wasted;
      }
      syncs0 = ctx.host_syncs;
      if (timeline) timeline->start();
      measure_start = Clock::now();
    }
    const auto step_start = Clock::now();
    check_cuda(cudaGraphLaunch(exec, ctx.consumer), "cudaGraphLaunch");  // the whole step
    if (s >= a.warmup) launch_ns += ns_since(step_start);
    if (a.step_sync && s > 0) counted_sync(ctx, ctx.consumer);  // the engine reads the step's token
    if (s == 0) {  // the cold start (a warm-up step)
      counted_sync(ctx, ctx.consumer);
      r.cold_start_ns = ns_since(step_start);
    }
    if (s < a.warmup && std::find(checks.begin(), checks.end(), s) != checks.end()) {
      counted_sync(ctx, ctx.consumer);
      snaps[s] = last_outputs(m, ctx);
    }
    progress.step(s + 1, routing.steps);
  }
  r.host_syncs = ctx.host_syncs - syncs0;  // waits inside the measured steps: none, or one per step with --step-sync
  check_cuda(cudaStreamSynchronize(ctx.consumer), "cudaStreamSynchronize");  // stops the clock, after the last step
  r.time_ns = ns_since(measure_start);
  r.tokens = static_cast<std::int64_t>(a.steps) * m.batch;
  if (timeline) {
    std::string csv;
    if (!a.timeline_csv.empty()) {
      csv = a.timeline_csv + ".";
      for (const char c : key) csv += std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' ? c : '_';
      csv += ".csv";
    }
    notes.push_back(key + ": " + timeline->stop_and_summarise(static_cast<double>(m.expert_bytes()),
                                                              ctx.pcie_ceiling_bytes_per_s, csv));
  }
  snaps[routing.steps - 1] = last_outputs(m, ctx);
  std::uint64_t stalls = 0, errors = 0;
  for (auto& c : caches) {
    const CacheStats cs = c->stats();
    r.hits += cs.hits;
    r.misses += cs.misses;
    stalls += cs.staging_stalls;
    r.speculative_issued += cs.speculative_issued;
    r.speculative_used += cs.speculative_used;
    r.speculative_wasted += cs.speculative_wasted;
    if (c->take_errors() != 0) ++errors;  // bad ids / overflow: impossible for a validated routing
  }
  r.hits -= hits0;
  r.misses -= misses0;  // copies stay 0: the fills are kernels, no copy calls
  r.speculative_issued -= spec0[0];
  r.speculative_used -= spec0[1];
  r.speculative_wasted -= spec0[2];
  r.host_syncs += stalls - stalls0;
  // Bytes moved: the misses and every speculative fill (used or wasted).
  r.pcie_bytes = static_cast<double>(r.misses + r.speculative_issued) * static_cast<double>(m.expert_bytes());
  if (!budget.empty()) return r;  // described once, with the table (budget_notes)
  if (fill_only) {
    notes.emplace_back("device/fill_only: no consumer in the graph (router, plan and fills): the time a perfectly hidden "
                       "consumer would leave; outputs not checked");
    return r;
  }
  compare_outputs(m, ctx, r);
  r.output_checked = true;
  r.check_failures += errors;

  // Bit-identical to the host-planned row provider at the same steps (same consumer kernels on
  // the same weight bytes; slots differ in no byte the consumer reads).
  std::string steps_text;
  const auto ref_it = ctx.snapshots.find(ctx.row_reference);
  std::uint64_t compared = 0, differ = 0;
  if (!ctx.row_reference.empty() && ref_it != ctx.snapshots.end()) {
    for (const auto& [step, out] : snaps) {
      const auto it = ref_it->second.find(step);
      if (it == ref_it->second.end()) continue;
      ++compared;
      steps_text += (steps_text.empty() ? "" : ", ") + std::to_string(step);
      if (it->second.size() != out.size() || std::memcmp(it->second.data(), out.data(), out.size() * sizeof(float)) != 0)
        ++differ;
    }
  }
  char buf[640];
  if (compared == 0) {
    std::snprintf(buf, sizeof buf,
                  "%s: no host-planned row run before it in this invocation; last-step outputs compared "
                  "with the all-resident run only",
                  key.c_str());
  } else {
    std::snprintf(buf, sizeof buf, "%s: outputs of steps %s %s %s (host-planned, same steps)", key.c_str(),
                  steps_text.c_str(), differ == 0 ? "bit-identical to" : "DIFFER from", ctx.row_reference.c_str());
  }
  notes.emplace_back(buf);
  r.check_failures += differ;
  std::snprintf(buf, sizeof buf,
                "%s: one CUDA graph per step (%zu nodes, %d round(s) per layer; captured and instantiated "
                "once in %.1f ms); cudaGraphLaunch %.1f us of host time per step; %s storage; %s",
                key.c_str(), nodes, rounds, capture_ms, a.steps ? launch_ns * 1e-3 / a.steps : 0.0,
                expert_major ? "expert-major (a fill is one copy)" : "tensor-major (a fill is one copy per tensor)",
                errors == 0 ? "device error word 0" : "DEVICE ERROR WORD SET (bad ids, overflow or a wait timeout)");
  notes.emplace_back(buf);
  if (caches[0]->fill_engine() == FillEngine::copy_engine || caches[0]->speculates_on_copy_engine()) {
    std::uint64_t requests = 0, fills = 0, issue_ns = 0, copy_ns = 0, word_ns = 0, longest_ns = 0;
    for (const auto& c : caches) {
      longest_ns = std::max(longest_ns, c->executor().proxy_longest_call_ns());
      requests += c->executor().proxy_requests();
      fills += c->executor().proxy_fills();
      issue_ns += c->executor().proxy_issue_ns();
      copy_ns += c->executor().proxy_copy_call_ns();
      word_ns += c->executor().proxy_word_call_ns();
    }
    const auto per_fill = [&](std::uint64_t ns) { return fills ? static_cast<double>(ns) * 1e-3 / static_cast<double>(fills) : 0.0; };
    std::snprintf(buf, sizeof buf,
                  "%s: copy proxy served %llu requests of %.2f fills on average (warm-up included); host time "
                  "issuing a request %.2f us, %.2f us per fill (copy calls %.2f, ready-word memops %.2f; the longest "
                  "call %.1f us)",
                  key.c_str(), static_cast<unsigned long long>(requests),
                  requests ? static_cast<double>(fills) / static_cast<double>(requests) : 0.0,
                  requests ? static_cast<double>(issue_ns) * 1e-3 / static_cast<double>(requests) : 0.0,
                  per_fill(issue_ns), per_fill(copy_ns), per_fill(word_ns), static_cast<double>(longest_ns) * 1e-3);
    notes.emplace_back(buf);
  }
  return r;
}

// --device-policy: the device provider's planning policy (one per run).
RunResult run_device(const Model& m, const Routing& routing, const BenchArgs& a, GpuContext& ctx, CudaRuntime& rt,
                     Progress& progress, std::vector<std::string>& notes, bool overlap = false,
                     const std::string& prefetch = "", bool fill_only = false, const std::string& budget = "",
                     bool one_pass = false, FillEngine engine = FillEngine::sm_loads) {
  return visit_device_policy(a.device_policy, [&]<class Policy>(Policy) {
    if (a.device_storage == "expert_major") {
      return run_device_with<Policy, ExpertMajorStorage>(m, routing, a, ctx, rt, progress, notes, overlap, prefetch,
                                                         fill_only, budget, one_pass, engine);
    }
    return run_device_with<Policy, TensorMajorStorage>(m, routing, a, ctx, rt, progress, notes, overlap, prefetch,
                                                       fill_only, budget, one_pass, engine);
  });
}

// --budget: the per-layer time budget of the device step from the rows that leave a stage out
// or double it (same run). Each line is a difference of two rows' time per layer.
// The budget table of one fill engine's rows (staging names ending in `suffix`).
void budget_notes_for(const Model& m, const Report& rep, std::vector<std::string>& notes, const char* suffix) {
  auto us_per_layer = [&](const char* staging) -> double {
    const std::string name = std::string(staging) + suffix;
    for (const RunResult& r : rep.runs) {
      if (r.provider == "device" && r.staging == name && !r.is_lookahead_row() && r.tokens_per_second() > 0)
        return 1e6 * m.batch / r.tokens_per_second() / m.layers;
    }
    return -1;
  };
  const double router = us_per_layer(budget_router_staging), plan = us_per_layer(budget_plan_staging);
  const double fill = us_per_layer(device_fill_only_staging), plan2 = us_per_layer(budget_plan_x2_staging);
  const double graph = us_per_layer(bench::device_staging), overlap = us_per_layer(device_overlap_staging);
  const double cons2 = us_per_layer(budget_consumer_x2_staging);
  const std::string engine(fill_engine_of_staging(std::string(device_fill_only_staging) + suffix));
  if (router < 0 || plan < 0 || fill < 0 || plan2 < 0 || graph < 0 || cons2 < 0) return;
  double bytes = 0;  // the fills' bytes per layer (the graph row's misses)
  for (const RunResult& r : rep.runs) {
    if (r.provider == "device" && r.staging == std::string(bench::device_staging) + suffix && !r.is_lookahead_row() &&
        r.tokens > 0)
      bytes = r.pcie_bytes / (static_cast<double>(r.tokens) / m.batch) / m.layers;
  }
  const double at_ceiling = rep.pcie_ceiling_bytes_per_s > 0 ? 1e6 * bytes / rep.pcie_ceiling_bytes_per_s : 0;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "budget (us per layer; batch %d; fill engine %s): router %.2f | plan %.2f (router+plan - router) | fill %.2f "
                "(fill_only - router+plan), of which %.2f is the layer's %.0f KB at the pinned ceiling and %.2f "
                "launch gap, ramp-up and tail | consumer after the fill %.2f (graph - fill_only)",
                m.batch, engine.c_str(), router, plan - router, fill - plan, at_ceiling, bytes / 1024, fill - plan - at_ceiling,
                graph - fill);
  notes.emplace_back(buf);
  std::snprintf(buf, sizeof buf,
                "budget (us per layer; fill engine %s): a second plan adds %.2f (plan_x2 - fill_only); a second consumer adds %.2f "
                "(consumer_x2 - graph)%s",
                engine.c_str(), plan2 - fill, cons2 - graph, overlap > 0 ? "" : "; add --overlap for the overlapped row");
  notes.emplace_back(buf);
  if (overlap > 0) {
    std::snprintf(buf, sizeof buf,
                  "budget (us per layer; fill engine %s): overlap %.2f, %.2f below graph; its consumer tail after the fill is %.2f "
                  "(overlap - fill_only)",
                  engine.c_str(), overlap, graph - overlap, overlap - fill);
    notes.emplace_back(buf);
  }
}

// One table per fill engine whose rows ran (suffix "" = sm_loads, "+ce", "+auto"; the engine is
// named in each line).
void budget_notes(const Model& m, const Report& rep, std::vector<std::string>& notes) {
  for (const char* suffix : {"", "+ce", "+auto"}) budget_notes_for(m, rep, notes, suffix);
  notes.emplace_back("budget rows (device/budget:*): router only; router + plan (no fill, no consumer); plan_x2 = "
                     "fill_only with a second plan of the same ids on a shadow state; consumer_x2 = the full step "
                     "with the consumer run twice. Outputs not checked.");
}

Report run_measured(const Model& m, const Routing& routing, const BenchArgs& a, Progress& progress) {
  Report rep;
  rep.modelled = false;
  if (a.host_wait != "auto") {
    const unsigned flags = a.host_wait == "spin"    ? cudaDeviceScheduleSpin
                           : a.host_wait == "yield" ? cudaDeviceScheduleYield
                                                    : cudaDeviceScheduleBlockingSync;
    check_cuda(cudaSetDeviceFlags(flags), "cudaSetDeviceFlags (--host-wait)");
  }
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
  ctx.pcie_ceiling_bytes_per_s = rep.pcie_ceiling_bytes_per_s;
  {
    // The host's link at this model's expert size: what FillEngine::automatic decides from.
    LinkProfile lp;
    if (Status st = link_profile_for(0, total_bytes_per_expert(m.layout.tensors()), lp); !st) throw Error(st);
    std::string reason;
    (void)lp.choose_engines(FillUse::demand, &reason, cuda_work_queues_from_env());
    rep.notes.push_back(lp.describe());
    rep.notes.push_back("fill engine automatic: " + reason);
  }
  ctx.moe = std::make_unique<device::MoeConsumer>(m.layout, m.batch, m.top_k);
  ctx.moe->set_pair_order(a.consumer_order == "experts" ? device::MoePairOrder::experts : device::MoePairOrder::pairs);
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
    progress.run_started(i, configs.size(), run_label(cfg));
    if (cfg.provider == "resident") {
      rep.runs.push_back(run_resident(m, routing, a, ctx, progress, rep.notes));
    } else if (cfg.provider == "device") {
      const std::string base = staging_without_engine(cfg.staging);
      const Result<FillEngine> engine = parse_fill_engine(fill_engine_of_staging(cfg.staging));  // split: sm_loads
      BenchArgs row_args = with_device_policy(a, cfg);
      row_args.fill_engine = std::string(fill_engine_of_staging(cfg.staging));
      rep.runs.push_back(run_device(m, routing, row_args, ctx, rt, progress, rep.notes,
                                    base == device_overlap_staging, cfg.prefetch, base == device_fill_only_staging,
                                    budget_staging(base) ? base : "", base == device_one_pass_staging,
                                    engine.ok() ? engine.value() : FillEngine::sm_loads));
      rep.runs.back().device_policy = cfg.device_policy;
    } else if (cfg.provider == "row") {
      rep.runs.push_back(run_cached_staging<TensorMajorStorage, Lru>(m, routing, a, ctx, rt, cfg, progress));
    } else {
      rep.runs.push_back(run_cached_staging<ExpertMajorStorage, Lfru>(m, routing, a, ctx, rt, cfg, progress));
    }
    progress.run_done(rep.runs.back().tokens_per_second(), rep.runs.back().hit_rate());
  }
  progress.finish();
  // Every copy-engine / automatic row against its SM-load twin (same row, same lookahead).
  for (const RunResult& r : rep.runs) {
    if (r.provider != "device" || fill_engine_of_staging(r.staging) == "sm_loads") continue;
    for (const RunResult& t : rep.runs) {
      if (t.provider != "device" || t.staging != staging_without_engine(r.staging) || t.prefetch != r.prefetch ||
          t.device_policy != r.device_policy || t.tokens_per_second() <= 0)
        continue;
      char buf[256];
      std::snprintf(buf, sizeof buf, "device/%s: %.3fx the tokens per second of device/%s%s%s", r.staging.c_str(),
                    r.tokens_per_second() / t.tokens_per_second(), t.staging.c_str(), r.prefetch.empty() ? "" : " with ",
                    r.prefetch.c_str());
      rep.notes.emplace_back(buf);
    }
  }
  // The overlap row's gain over the plain graph row, measured in the same run.
  const RunResult* plain = nullptr;
  const RunResult* ov = nullptr;
  for (const RunResult& r : rep.runs) {
    if (r.provider != "device" || r.is_lookahead_row()) continue;
    if (r.staging == bench::device_staging) plain = &r;
    if (r.staging == device_overlap_staging) ov = &r;
  }
  if (ov != nullptr) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "device/overlap: the consumer's blocks take the pairs in %s order (--consumer-order %s); the fill "
                  "copies %s",
                  ctx.moe->expert_order_for(m.batch, m.experts) ? "expert" : "pair", a.consumer_order.c_str(),
                  overlap_w13_first(a) ? "every missing expert's W13 tensors first" : "each expert whole");
    rep.notes.emplace_back(buf);
  }
  if (a.host_wait != "auto") rep.notes.emplace_back("host thread waits for the GPU by " + a.host_wait + " (--host-wait)");
  if (plain != nullptr && ov != nullptr && plain->tokens_per_second() > 0) {
    char buf[256];
    std::snprintf(buf, sizeof buf, "device/overlap: %.3fx the tokens per second of device/graph",
                  ov->tokens_per_second() / plain->tokens_per_second());
    rep.notes.emplace_back(buf);
  }
  const RunResult* op = nullptr;
  for (const RunResult& r : rep.runs)
    if (r.provider == "device" && !r.is_lookahead_row() && r.staging == device_one_pass_staging) op = &r;
  if (plain != nullptr && op != nullptr && plain->tokens_per_second() > 0) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "device/one_pass: %.3fx the tokens per second of device/graph (no fill node: the consumer copies "
                  "the misses from mapped host memory as it computes)",
                  op->tokens_per_second() / plain->tokens_per_second());
    rep.notes.emplace_back(buf);
  }
  const RunResult* fo = nullptr;
  for (const RunResult& r : rep.runs)
    if (r.provider == "device" && r.staging == device_fill_only_staging) fo = &r;
  if (plain != nullptr && fo != nullptr && fo->tokens_per_second() > 0 && plain->tokens_per_second() > 0) {
    // Per token: graph = fills path + consumer; fill_only = fills path alone.
    const double t_graph = 1e3 / plain->tokens_per_second(), t_fill = 1e3 / fo->tokens_per_second();
    char buf[320];
    if (ov != nullptr && ov->tokens_per_second() > 0) {
      const double t_ov = 1e3 / ov->tokens_per_second();
      std::snprintf(buf, sizeof buf,
                    "decomposition (ms/token): graph %.3f, overlap %.3f, fill_only %.3f; a fully hidden consumer would "
                    "give %.3fx graph; overlap hides %.0f%% of the consumer's %.3f ms",
                    t_graph, t_ov, t_fill, t_graph / t_fill, t_graph > t_fill ? 100.0 * (t_graph - t_ov) / (t_graph - t_fill) : 0.0,
                    t_graph - t_fill);
    } else {
      std::snprintf(buf, sizeof buf, "decomposition (ms/token): graph %.3f, fill_only %.3f (consumer %.3f)", t_graph, t_fill,
                    t_graph - t_fill);
    }
    rep.notes.emplace_back(buf);
  }
  if (a.budget) budget_notes(m, rep, rep.notes);
  return rep;
}

}  // namespace
}  // namespace expert_cache::bench

#include "../decode/prompt_measured.cuh"  // uses the helpers above

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
    gpu.prompt = run_prompt_measured;
    return bench_main(argc, argv, gpu);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "expert-cache-bench: internal error: %s\n", e.what());
    return 1;
  }
}
