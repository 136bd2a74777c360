#pragma once
/// The copy-engine fill of the device-planned cache (needs nvcc): the plan stays on the GPU, a host proxy thread
/// moves the bytes on a copy engine.
//
// Why a proxy: how fast SM loads of mapped host memory cross PCIe depends on the host (IOMMU,
// read-request size, virtualisation; 53-92 % of the link on H100 hosts of the same kind), while
// the copy engine reaches about 90 % everywhere. A kernel cannot start a copy-engine copy, so a
// host thread does it for the kernels, as NVSHMEM's and NCCL's proxies do (docs/design.md,
// "Copy-engine fills").
//
// Protocol (edges P1-P4 of docs/design.md; one ring per cache, in mapped pinned memory):
//   device  proxy_post_kernel, in stream order after the plan: copies the plan's fill list
//           (expert, slot, tag = slot_needed[slot]) into ring entry posted % depth, then
//           __threadfence_system and a system-scope release store of `posted` (P1: the list is
//           visible before the proxy reads it). It first waits (bounded) for a free entry:
//           posted - taken < depth.
//   proxy   polls `posted` of every registered ring, copies the entry out, stores `taken`, and
//           for each fill issues its regions (cudaMemcpyAsync, outside any capture) and then
//           cuStreamWriteValue32(slot_ready[slot], tag) on its copy stream. The write
//           memop carries a memory barrier and runs after the copies in stream order (P2: a
//           ready word is set only after its bytes landed). With a first part (edge D4c) every
//           fill's first part is copied and published on slot_ready_first, then the rest.
//   device  a readiness consumer (overlap) acquires slot_ready[slot] before it reads a slot;
//           without overlap the post kernel itself waits (bounded) until every slot's ready word
//           reached its needed tag, so the plain consumer after it reads landed bytes.
//   P3: a slot is overwritten only by copies of a later post, and a post runs after the plan,
//   which stream order puts after every earlier consumer of the cache on that stream.
//   P4 (shutdown): a cache waits until the proxy took every request it posted, unregisters
//   and synchronises the copy stream before its slots and pools may go; the proxy thread is
//   joined when the last cache of its device lets go of it.
//   P5 (release): while other caches of the device stay attached, the leaving cache then waits
//   for the device to go idle before it frees anything (CopyProxy::detach): a free waits for
//   the device while holding the driver, so a step that waits for the proxy would stall it.
// Failures: a refused copy or memop is recorded for the cache (its next call returns the
// Status), flags plan_error_fill_failed in its error word and still publishes the ready word,
// so no consumer waits for bytes that will never come; every device wait is bounded
// (kernels/slot_ready.cuh) and flags plan_error_wait_timeout instead of hanging.
#if !defined(__CUDACC__)
#error "expert_cache/device_cache/copy_proxy.cuh needs nvcc"
#endif

#include <cuda.h>  // the memop's driver types only: the function is resolved through the runtime
#include <cuda/atomic>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "expert_cache/base/config.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/kernels/griddep.cuh"
#include "expert_cache/kernels/slot_ready.cuh"
#include "expert_cache/planning/device_plan/readiness.hpp"
#include "expert_cache/planning/device_plan/state.hpp"
#include "expert_cache/runtime/cuda_error.hpp"
#include "expert_cache/storage/copy_region.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {


/// One fill of a posted request.
struct ProxyFill {
  std::int32_t expert;
  std::int32_t slot;
  std::uint32_t tag;  // slot_needed[slot] when planned: the value the ready word takes
  std::uint32_t unused;
};

/// The ring's two counters, each on its own cache line (one written by the device, one by the
/// host).
struct ProxyRingHeader {
  alignas(64) std::uint32_t posted;  // requests posted (device: system-scope release store)
  alignas(64) std::uint32_t taken;   // requests the proxy copied out (host store)
};

/// Bytes of one request: its count, then `capacity` fills.
EXPERT_CACHE_HOST_DEVICE constexpr std::size_t proxy_request_bytes(std::int32_t capacity) noexcept {
  return 16 + sizeof(ProxyFill) * static_cast<std::size_t>(capacity > 0 ? capacity : 0);
}
EXPERT_CACHE_HOST_DEVICE constexpr std::size_t proxy_ring_bytes(std::int32_t capacity) noexcept {
  return sizeof(ProxyRingHeader) + proxy_ring_depth * proxy_request_bytes(capacity);
}

/// Fixed for a cache's lifetime (a captured post node keeps its own copy).
struct ProxyPostParams {
  const PlanEntry* fills = nullptr;            // the state's fill list
  const DevicePlanScalars* scalars = nullptr;  // its fill_count
  const std::uint32_t* slot_needed = nullptr;
  const std::uint32_t* slot_ready = nullptr;
  // Device memory, two words: requests this cache posted, and the proxy's `taken` as the post
  // kernel last read it (a post reads the mapped word over PCIe only when that copy shows the
  // ring full).
  std::uint32_t* post_count = nullptr;
  // Device memory, one word per slot (speculate_on_copy_engine; null otherwise): each posted
  // fill's tag at its slot, which a later SM-load fill of the slot waits for (edge P6).
  std::uint32_t* slot_posted = nullptr;
  unsigned char* ring = nullptr;               // device address of the mapped ring
  std::uint32_t* error_word = nullptr;
  std::int32_t capacity = 0;
  std::uint64_t timeout_ns = 0;  // 0: default_wait_timeout_ns
  // Test-only: store `posted` before the entry is written (edge P1 removed).
  bool test_post_before_list = false;
};

inline constexpr int proxy_post_threads = 256;

namespace detail {
__device__ __forceinline__ std::uint32_t load_mapped_word(const std::uint32_t* w) {
  return cuda::atomic_ref<std::uint32_t, cuda::thread_scope_system>(const_cast<std::uint32_t&>(*w))
      .load(cuda::memory_order_acquire);
}
}  // namespace detail

/// Posts the last planned group's fill list to the proxy (one block). `WaitAll`: then waits
/// until every slot's ready word reached its needed tag (the stream-ordered consumer's join;
/// also covers slots an earlier prefetch is still filling).
template <bool WaitAll>
EXPERT_CACHE_KERNEL void __launch_bounds__(proxy_post_threads) proxy_post_kernel(const __grid_constant__ ProxyPostParams p) {
  // Launched programmatically after the plan (overlap on sm_90): wait for it first.
  detail::griddep_wait();
  __shared__ std::uint32_t seq;
  __shared__ std::int32_t n;
  __shared__ bool room;
  auto* header = reinterpret_cast<ProxyRingHeader*>(p.ring);
  if (threadIdx.x == 0) {
    std::int32_t c = p.scalars->fill_count;
    n = c < 0 ? 0 : (c > p.capacity ? p.capacity : c);
    seq = *p.post_count;
    const std::uint32_t s = seq;
    std::uint32_t& known_taken = p.post_count[1];
    room = n == 0 || s - known_taken < proxy_ring_depth ||
           bounded_spin(
               [&] {
                 known_taken = detail::load_mapped_word(&header->taken);
                 return s - known_taken < proxy_ring_depth;
               },
               p.timeout_ns, p.error_word);
  }
  __syncthreads();
  if (n > 0 && room) {
    unsigned char* req = p.ring + sizeof(ProxyRingHeader) + (seq % proxy_ring_depth) * proxy_request_bytes(p.capacity);
    auto* fills = reinterpret_cast<ProxyFill*>(req + 16);
    if (p.test_post_before_list) {  // the edge removed: posted first, the list 200 us later
      if (threadIdx.x == 0) {
        cuda::atomic_ref<std::uint32_t, cuda::thread_scope_system>(header->posted).store(seq + 1, cuda::memory_order_release);
        const std::uint64_t until = global_timer_ns() + 200'000;
        while (global_timer_ns() < until) __nanosleep(1000);
      }
      __syncthreads();
    }
    for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n; i += blockDim.x) {
      const PlanEntry f = p.fills[i];
      const bool ok = f.slot >= 0 && f.slot < p.capacity;
      const std::uint32_t tag = ok ? p.slot_needed[f.slot] : 0u;
      fills[i] = ProxyFill{f.expert, ok ? f.slot : -1, tag, 0u};
      if (ok && p.slot_posted != nullptr) p.slot_posted[f.slot] = tag;
    }
    if (threadIdx.x == 0) *reinterpret_cast<std::uint32_t*>(req) = static_cast<std::uint32_t>(n);
    // Every thread's entry stores, then the barrier, then thread 0's system fence and release
    // store: the proxy that acquires `posted` sees the whole entry (edge P1).
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      cuda::atomic_ref<std::uint32_t, cuda::thread_scope_system>(header->posted).store(seq + 1, cuda::memory_order_release);
      // And out now: the proxy must see the request while this kernel goes on (WaitAll spins
      // below until the proxy's copies landed).
      __threadfence_system();
      *p.post_count = seq + 1;
    }
  }
  // The consumer after this node (programmatic on sm_90) may start: the plan completed.
  detail::griddep_launch_dependents();
  if constexpr (WaitAll) {
    for (std::int32_t s = static_cast<std::int32_t>(threadIdx.x); s < p.capacity; s += blockDim.x) {
      const std::uint32_t want = __ldcg(p.slot_needed + s);
      cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> ready(const_cast<std::uint32_t&>(p.slot_ready[s]));
      (void)bounded_spin([&] { return slot_seq_reached(ready.load(cuda::memory_order_acquire), want); }, p.timeout_ns,
                         p.error_word);
    }
    // The consumer's loads follow this kernel's completion (stream order): every acquire above
    // happens before them.
  }
}

/// Launches the post (capturable). `programmatic`: as launch_plan_fill_ready's.
inline cudaError_t launch_proxy_post(const ProxyPostParams& p, bool wait_all, cudaStream_t stream,
                                     bool programmatic = false) noexcept {
  ProxyPostParams copy = p;
  void* args[] = {&copy};
  const void* kernel = wait_all ? reinterpret_cast<const void*>(&proxy_post_kernel<true>)
                                : reinterpret_cast<const void*>(&proxy_post_kernel<false>);
  if (!programmatic) return cudaLaunchKernel(kernel, dim3(1), dim3(proxy_post_threads), args, 0, stream);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(1);
  cfg.blockDim = dim3(proxy_post_threads);
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  cudaError_t err = cudaLaunchKernelExC(&cfg, kernel, args);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    err = cudaLaunchKernel(kernel, dim3(1), dim3(proxy_post_threads), args, 0, stream);
  }
  return err;
}

/// What the proxy needs of one cache: its ring, its copy regions (host pointers, first part
/// first), its ready words and error word.
struct ProxyChannelConfig {
  ProxyRingHeader* ring_host = nullptr;  // host address of the mapped ring
  CopyRegions regions{};                 // host_base: host addresses of the pinned pools
  std::size_t first_part_regions = 0;    // the first this many regions are the first part (0: none)
  std::uint32_t* slot_ready = nullptr;        // device memory
  std::uint32_t* slot_ready_first = nullptr;  // device memory
  std::uint32_t* error_word_host = nullptr;   // mapped: the cache's error word, host address
  std::int32_t num_experts = 0;
  std::int32_t capacity = 0;
  // Test-only: publish each ready word before its copies, which then start 200 us late (edge P2
  // removed, with a window no reader misses).
  bool test_ready_before_copy = false;
  // Test-only: the proxy fails every copy of this channel (a refused copy, as from the driver).
  bool test_fail_copies = false;
};

/// One per device and process: a thread and a copy stream serving every cache of the device.
class CopyProxy {
 public:
  struct Channel {
    ProxyChannelConfig config;
    std::uint32_t taken = 0;  // the proxy's own count (mirrored into the ring)
    std::mutex status_mutex;
    Status status;            // the first failure since the cache last asked
    std::atomic<bool> failed{false};  // status holds one: the cache's calls lock only then
    std::atomic<std::uint64_t> requests{0}, fills{0};
    // Host time from seeing a request to the last call issued for it, summed (nanoseconds), and
    // the part of it spent inside the copy calls and inside the ready-word memops.
    std::atomic<std::uint64_t> issue_ns{0}, copy_call_ns{0}, word_call_ns{0};
    // The longest single copy call or memop (nanoseconds): a call that waited for the device, or
    // for a driver lock another thread held, shows here (a stalled step's diagnosis).
    std::atomic<std::uint64_t> longest_call_ns{0};
  };

  /// The device's proxy, started on first use and shared by every cache of the device.
  static Result<std::shared_ptr<CopyProxy>> for_device(int device) {
    static std::mutex registry_mutex;
    static std::map<int, std::weak_ptr<CopyProxy>> registry;
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (auto p = registry[device].lock()) return p;
    std::shared_ptr<CopyProxy> p(new CopyProxy(device));
    if (Status s = p->start(); !s) return s;
    registry[device] = p;
    return p;
  }

  CopyProxy(const CopyProxy&) = delete;
  CopyProxy& operator=(const CopyProxy&) = delete;
  ~CopyProxy() {
    stop_.store(true, std::memory_order_release);
    if (thread_.joinable()) thread_.join();
    if (stream_ != nullptr) {
      const expert_cache::detail::DeviceRestore restore;
      (void)cudaSetDevice(device_);
      (void)cudaStreamSynchronize(stream_);
      (void)cudaStreamDestroy(stream_);
    }
  }

  /// Adds a cache's ring; the proxy serves it from its next poll. First copies expert 0 into
  /// slot 0 and rewrites slot 0's ready words with their value (0: the state was just reset),
  /// on the proxy's stream, waited for: the first use of the cache's pools, slots and ready
  /// words by these calls happens here, while no kernel waits for them.
  Result<std::shared_ptr<Channel>> attach(const ProxyChannelConfig& config) {
    auto c = std::make_shared<Channel>();
    c->config = config;
    if (config.capacity > 0 && config.num_experts > 0 && !config.test_fail_copies) {
      const expert_cache::detail::DeviceRestore restore;
      EXPERT_CACHE_TRY_CUDA(cudaSetDevice(device_));
      copy(*c, ProxyFill{0, 0, 0u, 0u}, 0, config.regions.count);
      publish(*c, ProxyFill{0, 0, 0u, 0u}, false, 0);
      EXPERT_CACHE_TRY_CUDA(cudaStreamSynchronize(stream_));
      if (Status s = take_status(*c); !s) return s;
    }
    const CallerLock lock(*this);
    channels_.push_back(c);
    return c;
  }

  /// Waits (bounded) until the proxy took every request the ring shows posted, removes the
  /// channel and synchronises the copy stream, so that no copy of it is left to land (edge P4).
  /// `drain_device`: when other caches of the device are still attached, then also waits for the
  /// device to go idle (edge P5). The caller frees its memory next, and cudaFree, cudaFreeHost
  /// and cudaHostUnregister wait for the device while holding the driver: a step of another
  /// cache that waits for the proxy would stall the proxy's next copy call until the step's
  /// bounded wait gave up. Waiting here holds nothing the proxy needs.
  Status detach(const std::shared_ptr<Channel>& c, bool drain_device = true,
                std::chrono::milliseconds patience = std::chrono::milliseconds(2000)) {
    if (!c) return {};
    const auto until = std::chrono::steady_clock::now() + patience;
    Status result;
    while (true) {
      const std::uint32_t posted = std::atomic_ref<std::uint32_t>(c->config.ring_host->posted).load(std::memory_order_acquire);
      std::uint32_t taken;
      {
        const CallerLock lock(*this);
        taken = c->taken;
      }
      if (posted == taken) break;
      if (std::chrono::steady_clock::now() > until) {
        result = Status(ErrorCode::runtime_failure, "copy proxy: a cache was destroyed with requests the proxy never took");
        break;
      }
      std::this_thread::yield();
    }
    bool others = false;
    {
      const CallerLock lock(*this);
      channels_.erase(std::remove(channels_.begin(), channels_.end(), c), channels_.end());
      others = !channels_.empty();
    }
    const expert_cache::detail::DeviceRestore restore;
    (void)cudaSetDevice(device_);
    cudaError_t err = cudaStreamSynchronize(stream_);
    if (err != cudaSuccess && result.ok()) result = cuda_status(err, "cudaStreamSynchronize (copy proxy stream)");
    if (others && drain_device) {
      err = cudaDeviceSynchronize();
      if (err != cudaSuccess && result.ok()) result = cuda_status(err, "cudaDeviceSynchronize (copy proxy detach)");
    }
    return result;
  }

  /// The first failure of the channel's copies since the last call (then cleared).
  static Status take_status(Channel& c) {
    if (!c.failed.load(std::memory_order_acquire)) return {};
    std::lock_guard<std::mutex> lock(c.status_mutex);
    Status s = c.status;
    c.status = Status{};
    c.failed.store(false, std::memory_order_relaxed);
    return s;
  }

  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

 private:
  using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

  explicit CopyProxy(int device) : device_(device) {}

  // mutex_ for a caller's thread, announced to the polling thread.
  class CallerLock {
   public:
    explicit CallerLock(CopyProxy& p) : p_(p) {
      p_.callers_waiting_.fetch_add(1, std::memory_order_relaxed);
      p_.mutex_.lock();
      p_.callers_waiting_.fetch_sub(1, std::memory_order_relaxed);
    }
    ~CallerLock() { p_.mutex_.unlock(); }
    CallerLock(const CallerLock&) = delete;
    CallerLock& operator=(const CallerLock&) = delete;

   private:
    CopyProxy& p_;
  };

  Status start() {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    {
      const expert_cache::detail::DeviceRestore restore;
      EXPERT_CACHE_TRY_CUDA(cudaSetDevice(device_));
      EXPERT_CACHE_TRY_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      EXPERT_CACHE_TRY_CUDA(cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000, cudaEnableDefault, &found));
    }
    if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
      return Status(ErrorCode::not_supported, "copy proxy: the driver has no cuStreamWriteValue32");
    }
    write_value_ = reinterpret_cast<WriteValue32>(fn);
    std::promise<Status> warmed;
    std::future<Status> ready = warmed.get_future();
    try {
      thread_ = std::thread([this, w = std::move(warmed)]() mutable { run(w); });
    } catch (...) {
      return Status(ErrorCode::runtime_failure, "copy proxy: could not start its thread");
    }
    // The proxy serves nothing before its first copy and memop completed on its thread: a
    // driver's first use of a call may wait for the device, and a kernel that waits for the
    // proxy would then hold it until the kernel's bounded wait gave up.
    Status warm = ready.get();
    if (!warm) {
      stop_.store(true, std::memory_order_release);
      thread_.join();
    }
    return warm;
  }

  // A copy and a memop on the proxy's stream, waited for.
  Status warm_up() {
    void* host = nullptr;
    void* dev = nullptr;
    cudaError_t err = cudaHostAlloc(&host, 64, cudaHostAllocDefault);
    if (err == cudaSuccess) err = cudaMalloc(&dev, 64);
    if (err == cudaSuccess) {
      std::memset(host, 0, 64);
      err = cudaMemcpyAsync(dev, host, 64, cudaMemcpyHostToDevice, stream_);
      if (err == cudaSuccess &&
          write_value_(reinterpret_cast<CUstream>(stream_), reinterpret_cast<CUdeviceptr>(dev), 1u, 0) != CUDA_SUCCESS) {
        err = cudaErrorUnknown;
      }
      if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
    }
    if (dev != nullptr) (void)cudaFree(dev);
    if (host != nullptr) (void)cudaFreeHost(host);
    return err == cudaSuccess ? Status{} : cuda_status(err, "copy proxy: warm-up copy and memop");
  }

  // Polls every ring; spins while requests come (a post is seen within a microsecond or so),
  // sleeps briefly after a long idle stretch so that an idle process does not hold a core.
  void run(std::promise<Status>& warmed) {
    Status warm = cuda_status(cudaSetDevice(device_), "copy proxy: cudaSetDevice");
    if (warm) warm = warm_up();
    const bool ok = warm.ok();
    warmed.set_value(std::move(warm));
    if (!ok) return;
    auto last_work = std::chrono::steady_clock::now();
    std::vector<ProxyFill> fills;
    while (!stop_.load(std::memory_order_acquire)) {
      bool worked = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        for (const std::shared_ptr<Channel>& c : channels_) worked |= serve(*c, fills);
      }
      if (callers_waiting_.load(std::memory_order_relaxed) > 0) std::this_thread::yield();
      if (worked) {
        last_work = std::chrono::steady_clock::now();
      } else if (std::chrono::steady_clock::now() - last_work > idle_spin_) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      } else {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      }
    }
  }

  // Serves every request the channel has posted. Called with mutex_ held.
  bool serve(Channel& c, std::vector<ProxyFill>& fills) {
    ProxyRingHeader* h = c.config.ring_host;
    const std::uint32_t posted = std::atomic_ref<std::uint32_t>(h->posted).load(std::memory_order_acquire);
    bool worked = false;
    while (c.taken != posted) {
      const auto* req = reinterpret_cast<const unsigned char*>(h) + sizeof(ProxyRingHeader) +
                        (c.taken % proxy_ring_depth) * proxy_request_bytes(c.config.capacity);
      std::uint32_t n = *reinterpret_cast<const volatile std::uint32_t*>(req);
      n = std::min<std::uint32_t>(n, static_cast<std::uint32_t>(c.config.capacity));
      fills.resize(n);
      std::memcpy(fills.data(), req + 16, n * sizeof(ProxyFill));
      ++c.taken;
      std::atomic_ref<std::uint32_t>(h->taken).store(c.taken, std::memory_order_release);
      const auto t0 = std::chrono::steady_clock::now();
      issue(c, fills);
      c.issue_ns.fetch_add(static_cast<std::uint64_t>(
                               std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count()),
                           std::memory_order_relaxed);
      c.requests.fetch_add(1, std::memory_order_relaxed);
      c.fills.fetch_add(n, std::memory_order_relaxed);
      worked = true;
    }
    return worked;
  }

  // Each fill's regions, then its slot's ready word: per fill (and part) one cudaMemcpyBatchAsync
  // where the toolkit has it and one memop. Driver calls cost the proxy's thread a few
  // microseconds each (H100 hosts, CUDA 13.0), so one call per region (six for an NVFP4 expert)
  // made issuing a request take longer than its copies; per fill, a slot's ready word still
  // follows its own bytes, so the consumer starts on it before the request's later fills land.
  void issue(Channel& c, const std::vector<ProxyFill>& fills) {
    const ProxyChannelConfig& k = c.config;
    const std::size_t count = k.regions.count;
    const bool split = k.first_part_regions > 0 && k.first_part_regions < count;
    for (int part = 0; part < (split ? 2 : 1); ++part) {
      const std::size_t lo = split && part == 1 ? k.first_part_regions : 0;
      const std::size_t hi = split && part == 0 ? k.first_part_regions : count;
      for (const ProxyFill& f : fills) {
        // The list comes from the planner; checked anyway so nothing outside the pools is touched.
        if (f.expert < 0 || f.expert >= k.num_experts || f.slot < 0 || f.slot >= k.capacity) continue;
        if (k.test_ready_before_copy) {  // the edge removed, and the copy 200 us late so the reader wins
          publish(c, f, split, part);
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        const auto t0 = std::chrono::steady_clock::now();
        copy(c, f, lo, hi);
        const auto t1 = std::chrono::steady_clock::now();
        if (!k.test_ready_before_copy) publish(c, f, split, part);
        const auto t2 = std::chrono::steady_clock::now();
        c.copy_call_ns.fetch_add(elapsed_ns(t0, t1), std::memory_order_relaxed);
        c.word_call_ns.fetch_add(elapsed_ns(t1, t2), std::memory_order_relaxed);
        const std::uint64_t longest = std::max(elapsed_ns(t0, t1), elapsed_ns(t1, t2));
        if (longest > c.longest_call_ns.load(std::memory_order_relaxed)) {
          c.longest_call_ns.store(longest, std::memory_order_relaxed);  // the proxy's thread is the only writer
        }
      }
    }
  }

  static std::uint64_t elapsed_ns(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
    return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count());
  }

  // Regions [lo, hi) of one fill: one batch call (per-region copies where it is missing or
  // refused).
  void copy(Channel& c, const ProxyFill& f, std::size_t lo, std::size_t hi) {
    if (c.config.test_fail_copies) {
      fail(c, cuda_status(cudaErrorInvalidValue, "copy proxy: the fill's copy"));
      return;
    }
    std::array<void*, max_copy_regions> dsts{};
    std::array<const void*, max_copy_regions> srcs{};
    std::array<std::size_t, max_copy_regions> sizes{};
    std::size_t n = 0;
    for (std::size_t r = lo; r < hi && n < max_copy_regions; ++r) {
      const CopyRegion& g = c.config.regions.regions[r];
      if (g.bytes == 0) continue;  // CUDA rejects empty copies
      dsts[n] = g.slot_base + static_cast<std::size_t>(f.slot) * g.slot_stride;
      srcs[n] = g.host_base + static_cast<std::size_t>(f.expert) * g.host_stride;
      sizes[n] = g.bytes;
      ++n;
    }
    if (n == 0) return;
    const bool batch = n > 1 && batch_supported_.load(std::memory_order_relaxed);
    cudaError_t err = batch ? copy_batch(dsts.data(), srcs.data(), sizes.data(), n) : cudaErrorNotSupported;
    if (err == cudaErrorNotSupported) {
      (void)cudaGetLastError();
      if (batch) batch_supported_.store(false, std::memory_order_relaxed);
      err = cudaSuccess;
      for (std::size_t i = 0; i < n && err == cudaSuccess; ++i) {
        err = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyHostToDevice, stream_);
      }
    }
    if (err != cudaSuccess) fail(c, cuda_status(err, "copy proxy: the fill's copy"));
  }

  cudaError_t copy_batch(void** dsts, const void** srcs, std::size_t* sizes, std::size_t n) noexcept {
#if CUDART_VERSION >= 12080
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagDefault;
    std::size_t attr_index = 0;
#if CUDART_VERSION >= 13000
    return cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &attr_index, 1, stream_);
#else
    std::size_t fail_index = 0;
    return cudaMemcpyBatchAsync(dsts, const_cast<void**>(srcs), sizes, n, &attr, &attr_index, 1, &fail_index, stream_);
#endif
#else
    (void)dsts, (void)srcs, (void)sizes, (void)n;
    return cudaErrorNotSupported;
#endif
  }

  void publish(Channel& c, const ProxyFill& f, bool split, int part) {
    const ProxyChannelConfig& k = c.config;
    const bool first_word = !split || part == 0, whole_word = !split || part == 1;
    CUresult r = CUDA_SUCCESS;
    if (first_word && k.slot_ready_first != nullptr) {
      r = write_value_(reinterpret_cast<CUstream>(stream_), reinterpret_cast<CUdeviceptr>(k.slot_ready_first + f.slot), f.tag, 0);
    }
    if (r == CUDA_SUCCESS && whole_word) {
      r = write_value_(reinterpret_cast<CUstream>(stream_), reinterpret_cast<CUdeviceptr>(k.slot_ready + f.slot), f.tag, 0);
    }
    if (r != CUDA_SUCCESS) {
      fail(c, Status::format(ErrorCode::runtime_failure, "copy proxy: cuStreamWriteValue32 of a ready word failed (CUresult %d)",
                             static_cast<int>(r)));
    }
  }

  static void fail(Channel& c, Status s) {
    {
      std::lock_guard<std::mutex> lock(c.status_mutex);
      if (c.status.ok()) c.status = std::move(s);
      c.failed.store(true, std::memory_order_release);
    }
    if (c.config.error_word_host != nullptr) {
      std::atomic_ref<std::uint32_t> w(*c.config.error_word_host);
      w.store(w.load(std::memory_order_relaxed) | plan_error_fill_failed, std::memory_order_relaxed);
    }
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  WriteValue32 write_value_ = nullptr;
  std::atomic<bool> batch_supported_{true};  // cleared when the driver refuses the batch call
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  // Callers waiting for mutex_ (attach, detach): the polling thread, which takes the lock again
  // right after it let go, yields to them so that they are not starved.
  std::atomic<int> callers_waiting_{0};
  std::vector<std::shared_ptr<Channel>> channels_;
  std::chrono::milliseconds idle_spin_{20};

};

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
