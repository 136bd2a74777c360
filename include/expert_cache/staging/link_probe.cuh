#pragma once
/// Measures a LinkProfile (runtime/link_profile.hpp) on a CUDA device (needs nvcc: it launches the
/// Gather fill kernel), and keeps one per (device, expert size) per process.
//
//   measure_link_profile(device, expert_bytes, out)  measures now (meant to take under 200 ms)
//   link_profile_for(device, expert_bytes, out)      measured once per process, then cached
//   set_link_profile(profile)                        installs a stored profile into that cache
//                                                    (no probe), after checking its PCI bus id
//
// What is measured, each the median of several repetitions timed with CUDA events on a stream
// of its own (docs/cuda_backend.md "Link profile"): one expert per cudaMemcpyAsync; a batch of
// experts back to back (per-expert cudaMemcpyAsync, and one cudaMemcpyBatchAsync where the
// toolkit has it: the better of the two); a 4 KiB copy from an idle stream; the Gather fill
// kernel (kernels/fill_copy.cuh, the Gather policy's grid) over the same batch read from mapped
// pinned memory; a 4 KiB fill kernel captured in a CUDA graph and replayed. Buffers: at most
// 16 experts and 64 MiB (an expert above 32 MiB is measured with 32 MiB copies: a single copy
// runs near the link's plateau there). Every function restores the caller's current device, frees what it
// allocated on every path and returns errors as Status; none throws.
#if !defined(__CUDACC__)
#error "expert_cache/staging/link_probe.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "expert_cache/base/config.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/kernels/fill_copy.cuh"
#include "expert_cache/runtime/cuda_error.hpp"
#include "expert_cache/runtime/link_profile.hpp"
#include "expert_cache/staging/gather_staging.cuh"

namespace expert_cache::inline v0 {

/// Largest single copy the probe makes; a larger expert is measured with copies of this size.
inline constexpr std::uint64_t link_probe_max_copy_bytes = std::uint64_t{32} << 20;
/// Host (and device) buffer budget of the probe: the batch is as many experts as fit, 2 to 16.
inline constexpr std::uint64_t link_probe_buffer_bytes = std::uint64_t{64} << 20;
inline constexpr int link_probe_max_batch = 16;
/// Bytes of the latency probes (one small copy, one small in-graph fill).
inline constexpr std::uint64_t link_probe_small_bytes = 4096;

namespace detail::link_probe {

inline constexpr int bandwidth_reps = 7;
inline constexpr int latency_reps = 15;
static_assert(bandwidth_reps <= latency_reps, "median_us keeps at most latency_reps times");

// The profiles of this process, shared by every translation unit (and every architecture the
// measuring code was compiled for): one mutex, one list.
struct Registry {
  std::mutex mutex;
  std::vector<LinkProfile> profiles;
};
inline Registry& registry() noexcept {
  static Registry r;
  return r;
}


struct PinnedBuffer {
  void* host = nullptr;
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (host != nullptr) (void)cuda_status(cudaFreeHost(host), "cudaFreeHost");
  }
};

struct DeviceBuffer {
  void* ptr = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr != nullptr) (void)cuda_status(cudaFree(ptr), "cudaFree");
  }
};

// Declared after the buffers, so it is destroyed first: its work is finished before they are freed.
struct ProbeStream {
  cudaStream_t stream = nullptr;
  ProbeStream() = default;
  ProbeStream(const ProbeStream&) = delete;
  ProbeStream& operator=(const ProbeStream&) = delete;
  ~ProbeStream() {
    if (stream == nullptr) return;
    (void)cuda_status(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    (void)cuda_status(cudaStreamDestroy(stream), "cudaStreamDestroy");
  }
};

struct EventPair {
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  EventPair() = default;
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
  ~EventPair() {
    if (start != nullptr) (void)cuda_status(cudaEventDestroy(start), "cudaEventDestroy");
    if (stop != nullptr) (void)cuda_status(cudaEventDestroy(stop), "cudaEventDestroy");
  }
};

struct GraphHandles {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  GraphHandles() = default;
  GraphHandles(const GraphHandles&) = delete;
  GraphHandles& operator=(const GraphHandles&) = delete;
  ~GraphHandles() {
    if (exec != nullptr) (void)cuda_status(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
    if (graph != nullptr) (void)cuda_status(cudaGraphDestroy(graph), "cudaGraphDestroy");
  }
};

// Fill-kernel parameters copying `fills` blobs of `bytes` each, blob i of the host buffer
// (device address `src`) into blob i of `dst`; the work-item width as the Gather policy picks it.
inline device::FillGatherParams<link_probe_max_batch> fill_params(const void* src, void* dst, std::uint64_t bytes,
                                                                  int fills) noexcept {
  device::FillGatherParams<link_probe_max_batch> p{};
  const std::uintptr_t bits = reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst) | bytes;
  const std::uint32_t width = (bits % 16 == 0) ? 16 : (bits % 4 == 0) ? 4 : 1;
  device::GatherTensor& g = p.tensors[0];
  g.src = static_cast<const unsigned char*>(src);
  g.dst = static_cast<unsigned char*>(dst);
  g.src_stride = bytes;
  g.dst_stride = bytes;
  g.copy_bytes = bytes;
  g.width = width;
  g.items = static_cast<std::uint32_t>((bytes + width - 1) / width);
  p.item_begin[0] = 0;
  p.item_begin[1] = g.items;
  p.num_tensors = 1;
  p.items_per_fill = g.items;
  p.num_fills = static_cast<std::uint32_t>(fills);
  for (int i = 0; i < fills; ++i) {
    p.expert[i] = i;
    p.slot[i] = i;
  }
  return p;
}

// Median in microseconds of `reps` runs of `enqueue` (returns cudaError_t), each from an idle
// stream between two events. One untimed run first (lazy module loading, first-touch costs).
template <class Enqueue>
Status median_us(cudaStream_t stream, const EventPair& events, int reps, const char* what, Enqueue enqueue,
                 double& out) noexcept {
  std::array<float, latency_reps> ms{};
  for (int r = -1; r < reps; ++r) {
    if (Status s = cuda_status(cudaEventRecord(events.start, stream), "cudaEventRecord"); !s) return s.with_context("%s", what);
    if (Status s = cuda_status(enqueue(), what); !s) return s;
    if (Status s = cuda_status(cudaEventRecord(events.stop, stream), "cudaEventRecord"); !s) return s.with_context("%s", what);
    if (Status s = cuda_status(cudaEventSynchronize(events.stop), "cudaEventSynchronize"); !s) return s.with_context("%s", what);
    if (r < 0) continue;
    if (Status s = cuda_status(cudaEventElapsedTime(&ms[static_cast<std::size_t>(r)], events.start, events.stop),
                               "cudaEventElapsedTime");
        !s)
      return s.with_context("%s", what);
  }
  std::sort(ms.begin(), ms.begin() + reps);
  out = 1000.0 * static_cast<double>(ms[static_cast<std::size_t>(reps / 2)]);
  return {};
}

inline double gbps(std::uint64_t bytes, double us) noexcept { return static_cast<double>(bytes) / (us * 1e3); }

// cudaMemcpyBatchAsync of `count` blobs of `bytes` (host blob i -> device blob i), sources read
// in stream order (as CudaRuntime::copy_batch_async); cudaErrorNotSupported before CUDA 12.8.
inline cudaError_t copy_batch(unsigned char* dst, const unsigned char* src, std::uint64_t bytes, int count,
                              cudaStream_t stream) noexcept {
#if CUDART_VERSION >= 12080
  std::array<void*, link_probe_max_batch> dsts{};
  std::array<const void*, link_probe_max_batch> srcs{};
  std::array<std::size_t, link_probe_max_batch> sizes{};
  for (int i = 0; i < count; ++i) {
    dsts[static_cast<std::size_t>(i)] = dst + static_cast<std::uint64_t>(i) * bytes;
    srcs[static_cast<std::size_t>(i)] = src + static_cast<std::uint64_t>(i) * bytes;
    sizes[static_cast<std::size_t>(i)] = static_cast<std::size_t>(bytes);
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagDefault;
  std::size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), static_cast<std::size_t>(count), &attr,
                              &attr_index, 1, stream);
#else
  std::size_t fail_index = 0;
  return cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(),
                              static_cast<std::size_t>(count), &attr, &attr_index, 1, &fail_index, stream);
#endif
#else
  (void)dst, (void)src, (void)bytes, (void)count, (void)stream;
  return cudaErrorNotSupported;
#endif
}

// The device's name and PCI bus id.
inline Status identify(int device, std::string& name, std::string& bus_id) noexcept {
  char bus[32] = {};
  if (Status s = cuda_status(cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), device), "cudaDeviceGetPCIBusId"); !s)
    return s;
  cudaDeviceProp prop{};
  if (Status s = cuda_status(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties"); !s) return s;
  try {
    name = prop.name;
    bus_id = bus;
  } catch (...) {
    return Status(ErrorCode::runtime_failure, "link profile: out of host memory for the device name");
  }
  return {};
}

inline Status check_device(int device) noexcept {
  int count = 0;
  if (Status s = cuda_status(cudaGetDeviceCount(&count), "cudaGetDeviceCount"); !s) return s;
  if (device < 0 || device >= count) {
    return Status::format(ErrorCode::invalid_argument, "link profile: device %d is outside [0, %d)", device, count);
  }
  return {};
}

// The measurement proper, on the current device; every resource is released when it returns.
inline Status run_probes(std::uint64_t expert_bytes, LinkProfile& p) noexcept {
  // Rounded up to 16 bytes: an expert's large tensors are 16-byte multiples, which the fill
  // kernels read with 16-byte loads; an odd total (small scale tensors) would make the probe's
  // one-blob fill use 4-byte loads, which cross the link far slower than the cache's fills do.
  const std::uint64_t copy_bytes = (std::min(expert_bytes, link_probe_max_copy_bytes) + 15) / 16 * 16;
  const int batch = static_cast<int>(std::clamp<std::uint64_t>(link_probe_buffer_bytes / copy_bytes, 2, link_probe_max_batch));
  const std::uint64_t buffer_bytes = std::max<std::uint64_t>(static_cast<std::uint64_t>(batch) * copy_bytes,
                                                             link_probe_small_bytes);
  PinnedBuffer host;
  DeviceBuffer slots;
  ProbeStream ps;
  EventPair events;
  GraphHandles graph;
  // Mapped and portable, as CudaRuntime allocates pinned pools (the fill kernel reads them).
  EXPERT_CACHE_TRY_CUDA(cudaHostAlloc(&host.host, buffer_bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  EXPERT_CACHE_TRY_CUDA(cudaMalloc(&slots.ptr, buffer_bytes));
  EXPERT_CACHE_TRY_CUDA(cudaStreamCreateWithFlags(&ps.stream, cudaStreamNonBlocking));
  EXPERT_CACHE_TRY_CUDA(cudaEventCreate(&events.start));
  EXPERT_CACHE_TRY_CUDA(cudaEventCreate(&events.stop));
  void* mapped = nullptr;
  EXPERT_CACHE_TRY_CUDA(cudaHostGetDevicePointer(&mapped, host.host, 0));
  const cudaStream_t s = ps.stream;
  auto* const src = static_cast<const unsigned char*>(host.host);
  auto* const dst = static_cast<unsigned char*>(slots.ptr);

  double us = 0;
  if (Status st = median_us(s, events, bandwidth_reps, "one-expert cudaMemcpyAsync",
                            [&] { return cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyHostToDevice, s); }, us);
      !st)
    return st;
  p.copy_engine_gbps_one = gbps(copy_bytes, us);

  const std::uint64_t batch_bytes = static_cast<std::uint64_t>(batch) * copy_bytes;
  auto copies_back_to_back = [&]() -> cudaError_t {
    for (int i = 0; i < batch; ++i) {
      const std::uint64_t at = static_cast<std::uint64_t>(i) * copy_bytes;
      if (cudaError_t e = cudaMemcpyAsync(dst + at, src + at, copy_bytes, cudaMemcpyHostToDevice, s); e != cudaSuccess) return e;
    }
    return cudaSuccess;
  };
  if (Status st = median_us(s, events, bandwidth_reps, "back-to-back cudaMemcpyAsync", copies_back_to_back, us); !st) return st;
  p.copy_engine_gbps_batch = gbps(batch_bytes, us);
  // One batch call where the toolkit and driver take it (its untimed first run tells).
  if (cudaError_t probe = copy_batch(dst, src, copy_bytes, batch, s); probe == cudaSuccess) {
    if (Status st = median_us(s, events, bandwidth_reps, "cudaMemcpyBatchAsync",
                              [&] { return copy_batch(dst, src, copy_bytes, batch, s); }, us);
        !st)
      return st;
    p.copy_engine_gbps_batch = std::max(p.copy_engine_gbps_batch, gbps(batch_bytes, us));
  } else {
    (void)cudaGetLastError();  // not available here: the back-to-back copies stand for the batch
  }

  if (Status st = median_us(s, events, latency_reps, "small cudaMemcpyAsync",
                            [&] { return cudaMemcpyAsync(dst, src, link_probe_small_bytes, cudaMemcpyHostToDevice, s); }, us);
      !st)
    return st;
  p.copy_latency_us = us;

  const device::FillGatherParams<link_probe_max_batch> fill = fill_params(mapped, dst, copy_bytes, batch);
  const int fill_grid = Gather::grid_for(static_cast<std::uint64_t>(fill.num_fills) * fill.items_per_fill);
  if (Status st = median_us(s, events, bandwidth_reps, "fill_gather_kernel",
                            [&] { return device::launch_fill_gather(fill, fill_grid, Gather::threads, s); }, us);
      !st)
    return st;
  p.sm_load_gbps = gbps(batch_bytes, us);

  const device::FillGatherParams<link_probe_max_batch> small = fill_params(mapped, dst, link_probe_small_bytes, 1);
  const int small_grid = Gather::grid_for(static_cast<std::uint64_t>(small.items_per_fill));
  // Thread-local capture: another thread's unrelated CUDA calls neither break it nor are refused.
  EXPERT_CACHE_TRY_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  const cudaError_t launched = device::launch_fill_gather(small, small_grid, Gather::threads, s);
  const cudaError_t ended = cudaStreamEndCapture(s, &graph.graph);  // always: the stream must leave capture mode
  EXPERT_CACHE_TRY_CUDA(launched);
  EXPERT_CACHE_TRY_CUDA(ended);
  EXPERT_CACHE_TRY_CUDA(cudaGraphInstantiate(&graph.exec, graph.graph, 0));
  if (Status st = median_us(s, events, latency_reps, "cudaGraphLaunch of a small fill",
                            [&] { return cudaGraphLaunch(graph.exec, s); }, us);
      !st)
    return st;
  p.graph_fill_latency_us = us;
  return {};
}

}  // namespace detail::link_probe

// The functions that launch kernels live in the architecture's namespace (base/config.hpp: two
// translation units built for different architectures must not define one inline function twice).
inline namespace EXPERT_CACHE_ARCH_NS {

/// Measures `device`'s link at `expert_bytes` into `out` (left untouched on error). The device's
/// context is created first and not counted in measure_ms; the caller's current device is restored.
/// @param device        CUDA device ordinal
/// @param expert_bytes  bytes of one expert (> 0)
/// @param out           gets the profile
/// @return ok; invalid_argument for 0 bytes or a device that does not exist; runtime_failure when
///         a CUDA call fails
[[nodiscard]] inline Status measure_link_profile(int device, std::uint64_t expert_bytes, LinkProfile& out) noexcept {
  if (expert_bytes == 0) return Status(ErrorCode::invalid_argument, "link profile: expert_bytes is 0");
  if (Status s = detail::link_probe::check_device(device); !s) return s;
  expert_cache::detail::DeviceRestore restore;
  if (!restore.ok()) return Status(ErrorCode::runtime_failure, "link profile: cudaGetDevice failed");
  EXPERT_CACHE_TRY_CUDA(cudaSetDevice(device));
  // The context and the fill kernel's module (a JIT compile where only PTX is embedded) are
  // loaded before the clock starts: one-time costs of any CUDA use, not of the link.
  EXPERT_CACHE_TRY_CUDA(cudaFree(nullptr));
  cudaFuncAttributes kernel{};
  EXPERT_CACHE_TRY_CUDA(cudaFuncGetAttributes(
      &kernel, reinterpret_cast<const void*>(&device::fill_gather_kernel<link_probe_max_batch>)));
  try {
    LinkProfile p;
    p.device = device;
    p.expert_bytes = expert_bytes;
    if (Status s = detail::link_probe::identify(device, p.device_name, p.pci_bus_id); !s) return s;
    const auto begin = std::chrono::steady_clock::now();
    if (Status s = detail::link_probe::run_probes(expert_bytes, p); !s) return s.with_context("link profile of device %d", device);
    p.measure_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
    out = std::move(p);
  } catch (...) {
    return Status(ErrorCode::runtime_failure, "link profile: out of host memory");
  }
  return {};
}

/// The profile of (`device`, `expert_bytes`): measured on the first call in this process (or
/// installed by set_link_profile), then the same profile. Calls are serialised (a second
/// measurement beside the first would halve both).
/// @param device        CUDA device ordinal
/// @param expert_bytes  bytes of one expert
/// @param out           gets the profile
/// @return ok, or measure_link_profile's error
[[nodiscard]] inline Status link_profile_for(int device, std::uint64_t expert_bytes, LinkProfile& out) noexcept {
  detail::link_probe::Registry& registry = detail::link_probe::registry();
  try {
    const std::lock_guard<std::mutex> lock(registry.mutex);
    for (const LinkProfile& p : registry.profiles) {
      if (p.device == device && p.expert_bytes == expert_bytes) {
        out = p;
        return {};
      }
    }
    LinkProfile measured;
    if (Status s = measure_link_profile(device, expert_bytes, measured); !s) return s;
    registry.profiles.push_back(measured);
    out = std::move(measured);
  } catch (...) {
    return Status(ErrorCode::runtime_failure, "link profile: out of host memory or a failed lock");
  }
  return {};
}

}  // inline namespace EXPERT_CACHE_ARCH_NS

/// Installs a stored profile (e.g. LinkProfile::parse of a file from an earlier run) so that
/// link_profile_for returns it without measuring. Refused, with the cache unchanged, when the
/// device does not exist, its PCI bus id differs from the profile's (another machine or another
/// device order), or a measurement is missing (zero or not finite).
/// @param profile  the stored profile; its device and expert_bytes key it
/// @return ok, or the reason it was refused
[[nodiscard]] inline Status set_link_profile(const LinkProfile& profile) noexcept {
  if (Status s = detail::link_probe::check_device(profile.device); !s) return s.with_context("set_link_profile");
  char bus[32] = {};
  if (Status s = cuda_status(cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), profile.device), "cudaDeviceGetPCIBusId");
      !s)
    return s.with_context("set_link_profile");
  try {
    if (Status s = profile.check_matches(profile.device, std::string(bus), profile.expert_bytes); !s)
      return s.with_context("set_link_profile");
    // The same checks as parse(): a profile built by hand must be as complete as a stored one.
    LinkProfile checked;
    if (Status s = LinkProfile::parse(profile.serialize(), checked); !s) return s.with_context("set_link_profile");
    detail::link_probe::Registry& registry = detail::link_probe::registry();
    const std::lock_guard<std::mutex> lock(registry.mutex);
    for (LinkProfile& p : registry.profiles) {
      if (p.device == profile.device && p.expert_bytes == profile.expert_bytes) {
        p = profile;
        return {};
      }
    }
    registry.profiles.push_back(profile);
  } catch (...) {
    return Status(ErrorCode::runtime_failure, "set_link_profile: out of host memory or a failed lock");
  }
  return {};
}

}  // namespace expert_cache::inline v0
