#pragma once
/// The CUDA executor of DeviceExpertCache: plan state on the device, plan and fill kernels, the copy proxy.
// The CUDA executor of DeviceExpertCache (needs nvcc): the plan state in device memory with its
// stats mirror and error word in mapped pinned memory (DevicePlanStorage,
// device_cache/plan_storage.cuh), and the kernels of kernels/plan_kernels.cuh and
// kernels/plan_fill.cuh. Include this header, then use
//   DeviceExpertCache<TensorMajorStorage | ExpertMajorStorage, Layout, CudaRuntime>.
//
// Every launch takes only parameters fixed for the cache's lifetime (the state view, the id
// buffer's address and n_ids, the group index, the fill parameters built once from the
// storage's copy regions with the pools' mapped device addresses), so a captured prepare()
// replays correctly with new ids: what changes per step lives in device memory.
//
//   prepare         fused: plan_forward_fill_kernel (plan + fill of group 0, one node);
//                   otherwise plan_forward (one warp for <= 16 ids) -> plan_fill;
//                   overlap: plan_forward -> plan_fill_ready (always two nodes: the consumer
//                   may start while the fill runs, so the plan must be complete before it; on
//                   sm_90 the fill is launched programmatically, scheduled while the plan runs,
//                   and waits for the plan grid before it touches memory)
//   prepare_group   plan_group -> plan_fill (overlap: plan_fill_ready)
//   invalidate      plan_invalidate
//   prefetch        plan_prefetch (one warp) -> plan_fill (overlap: plan_fill_ready, plain order)
//   recovery        drop_fills_kernel (below): after a plan whose fill could not be enqueued;
//                   drop_missing_kernel: drop_unfilled (fill_by_consumer)
//   fill_by_consumer  plan_forward / plan_group only (the consumer copies the misses); on sm_90
//                   the plan is launched programmatically (edge D6)
//   copy engine     (FillEngine::copy_engine) every fill above is replaced by proxy_post: the
//                   plan's fill list goes to the device's CopyProxy, which copies on a copy
//                   engine and publishes each slot's ready word (device_cache/copy_proxy.cuh); without
//                   overlap the post node also waits for the ready words. Never fused.
#if !defined(__CUDACC__)
#error "expert_cache/device_cache/cuda_executor.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "expert_cache/device_cache/copy_proxy.cuh"
#include "expert_cache/device_cache/device_cache.hpp"
#include "expert_cache/device_cache/plan_storage.cuh"
#include "expert_cache/kernels/plan_fill.cuh"
#include "expert_cache/kernels/plan_kernels.cuh"
#include "expert_cache/runtime/cuda_error.hpp"
#include "expert_cache/runtime/cuda_runtime.hpp"
#include "expert_cache/runtime/resources.hpp"
#include "expert_cache/staging/link_probe.cuh"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

// One thread: a recovery path, not a hot one (SequentialBlock is a valid one-thread block).
/// @brief Drops every expert of the state's fill list (detail::plan_drop_fills): the recovery
/// after a plan whose fill could not be enqueued.
/// @param s the state view (device memory)
template <int Unused = 0>
EXPERT_CACHE_KERNEL void __launch_bounds__(1) drop_fills_kernel(const DevicePlanState s) {
  SequentialBlock b;
  expert_cache::detail::plan_drop_fills(b, s);
}
/// @brief Drops every miss of the last planned group (detail::plan_drop_missing): drop_unfilled's
/// recovery when a fill_by_consumer consumer did not run.
/// @param s the state view (device memory)
template <int Unused = 0>
EXPERT_CACHE_KERNEL void __launch_bounds__(1) drop_missing_kernel(const DevicePlanState s) {
  SequentialBlock b;
  expert_cache::detail::plan_drop_missing(b, s);
}

template <device_plan_policy Policy>
class BasicCudaPlanExecutor {
 public:
  using Stream = cudaStream_t;

  // Allocates the state, resets it (on a temporary stream, waited for: construction is not on
  // any hot path) and builds the fill parameters. Throws Error on a CUDA failure or regions
  // the fill kernel cannot take (pools that are not mapped pinned memory, more than
  // max_copy_regions, a region wider than its stride).
  BasicCudaPlanExecutor(CudaRuntime& rt, std::int32_t num_experts, std::int32_t capacity, std::int32_t max_ids,
                   const CopyRegions& regions, const DeviceCacheOptions& options)
      : rt_(&rt),
        sanitized_(rt, static_cast<std::size_t>(std::max(max_ids, 1)) * sizeof(std::int32_t), MemoryKind::device),
        fused_(options.fused_plan_fill),
        overlap_(options.overlap),
        by_consumer_(options.fill_by_consumer),
        debug_{options.test_fill_delay_ns, options.test_fill_delay_index, options.test_fill_delay_part,
               options.test_publish_first_early},
        use_debug_(options.test_fill_delay_ns != 0 || options.test_publish_first_early),
        fill_pdl_(options.overlap && plan_fill_ready_pdl_supported()) {
    check_first_part(regions, options);
    if (options.fill_engine == FillEngine::automatic) {
      throw Error(Status::format(ErrorCode::invalid_argument,
                                 "%s: the executor needs a resolved fill engine (copy_engine or sm_loads)",
                                 options.label.c_str()));
    }
    copy_engine_ = options.fill_engine == FillEngine::copy_engine;
    speculate_on_proxy_ = !copy_engine_ && options.speculate_on_copy_engine;  // with overlap (the cache checks)
    if (copy_engine_ && by_consumer_) {
      throw Error(Status::format(ErrorCode::invalid_argument,
                                 "%s: fill_by_consumer reads host memory with SM loads; it cannot run with the copy_engine "
                                 "fill engine (use overlap)",
                                 options.label.c_str()));
    }
    RuntimeStream<CudaRuntime> init(rt);
    throw_on(storage_.template create<Policy>(num_experts, capacity, init.get(), options.crf_decay_q32), "DevicePlanStorage::create");
    CopyRegions mapped = regions;
    throw_on(resolve_mapped_regions(mapped), "resolve_mapped_regions (pools must be mapped pinned memory)");
    throw_on(make_plan_fill_params(mapped, storage_.state(), fill_, options.ready_first_regions),
             "make_plan_fill_params");
    throw_on(cudaStreamSynchronize(init.get()), "cudaStreamSynchronize (plan state reset)");
    if (copy_engine_ || speculate_on_proxy_) start_proxy(regions, options);
  }
  ~BasicCudaPlanExecutor() { release(); }

  // Leaves the device's proxy (edges P4 and P5 of device_cache/copy_proxy.cuh). The cache calls it
  // before it frees any of its memory; idempotent.
  void release() noexcept {
    if (!channel_) return;
    (void)proxy_->detach(channel_, !skip_release_drain_);
    channel_.reset();
  }

  // FillEngine::automatic -> the engines the link profile picks for this device and expert size
  // (options.link_profile when given, checked against both; else measured once per process): with
  // overlapped lookahead and fast SM loads, SM loads for forwards and the proxy for prefetches. When
  // it picks copy_engine for fill_by_consumer, the cache overlaps instead (DeviceCacheOptions).
  // With one hardware work queue per context (CUDA_DEVICE_MAX_CONNECTIONS=1) steps that wait for the
  // proxy stall (LinkProfile::choose_engines): copy_engine is refused, automatic takes SM loads.
  static DeviceCacheOptions resolve_fill_engine(DeviceCacheOptions o, std::uint64_t expert_bytes) {
    const int work_queues = cuda_work_queues_from_env();
    if (o.fill_engine == FillEngine::copy_engine && work_queues == 1) {
      throw Error(Status::format(ErrorCode::invalid_argument,
                                 "%s: fill_engine copy_engine with CUDA_DEVICE_MAX_CONNECTIONS=1: every stream then shares "
                                 "one hardware work queue and a step that waits for the copy proxy stalls; use sm_loads or "
                                 "automatic, or unset the variable",
                                 o.label.c_str()));
    }
    if (o.fill_engine != FillEngine::automatic) return o;
    int device = 0;
    throw_on(cudaGetDevice(&device), "cudaGetDevice");
    LinkProfile p;
    if (o.link_profile) {
      char bus[32] = {};
      throw_on(cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), device), "cudaDeviceGetPCIBusId");
      if (Status s = o.link_profile->check_matches(device, bus, expert_bytes); !s) {
        throw Error(s.with_context("%s: DeviceCacheOptions::link_profile", o.label.c_str()));
      }
      p = *o.link_profile;
    } else if (Status s = link_profile_for(device, expert_bytes, p); !s) {
      throw Error(s.with_context("%s: measuring the link profile for FillEngine::automatic", o.label.c_str()));
    }
    const LinkProfile::EngineChoice choice = p.choose_engines(fill_use_of(o), nullptr, work_queues);
    o.fill_engine = choice.forwards;
    o.speculate_on_copy_engine = o.speculate_on_copy_engine || choice.speculate_on_copy_engine;
    if (o.fill_engine == FillEngine::copy_engine && o.fill_by_consumer) {
      o.fill_by_consumer = false;
      o.overlap = true;
    }
    return o;
  }
  BasicCudaPlanExecutor(const BasicCudaPlanExecutor&) = delete;
  BasicCudaPlanExecutor& operator=(const BasicCudaPlanExecutor&) = delete;

  [[nodiscard]] const DevicePlanState& state() const noexcept { return storage_.state(); }
  [[nodiscard]] std::int32_t* sanitized_ids() const noexcept { return reinterpret_cast<std::int32_t*>(sanitized_.data()); }
  [[nodiscard]] std::size_t device_bytes() const noexcept { return storage_.bytes() + sanitized_.size(); }
  [[nodiscard]] const PlanFillParams& fill_params() const noexcept { return fill_; }

  Status plan_forward_fill(Stream s, const std::int32_t* ids, std::int32_t n, bool& planned, bool in_rounds,
                           std::int32_t round_width) noexcept {
    planned = false;
    // The launch's own copy of the state carries the flag and the width (kernel arguments): the
    // stored state, and every other launch, keep forward_in_rounds false.
    DevicePlanState st = state();
    st.forward_in_rounds = in_rounds;
    st.round_width = in_rounds ? round_width : 0;
    if (by_consumer_) {  // the plan alone: the consumer copies the misses (no fill node)
      EXPERT_CACHE_TRY_CUDA((launch_plan_forward<plan_block_threads, Policy>(st, ids, n, sanitized_ids(), s, plan_pdl_)));
      planned = true;
      return rt_->after_enqueue(s, "plan_forward_kernel");
    }
    if (fused_ && !overlap_ && !copy_engine_) {
      // One node: nothing is enqueued unless the whole step is.
      EXPERT_CACHE_TRY_CUDA((launch_plan_forward_fill<4, Policy>(st, ids, n, sanitized_ids(), fill_, s)));
      planned = true;
      return rt_->after_enqueue(s, "plan_forward_fill_kernel");
    }
    // Overlap on sm_90: the plan too is launched programmatically (edge D6: it waits for the
    // kernel before it, the router, inside), so its launch overlaps that kernel's tail.
    EXPERT_CACHE_TRY_CUDA((launch_plan_forward<plan_block_threads, Policy>(st, ids, n, sanitized_ids(), s, fill_pdl_)));
    planned = true;
    if (Status st = rt_->after_enqueue(s, "plan_forward_kernel"); !st) return st;
    return fill(s);
  }

  Status plan_group_fill(Stream s, std::int32_t g, bool& planned) noexcept {
    planned = false;
    EXPERT_CACHE_TRY_CUDA((launch_plan_group<plan_block_threads, Policy>(state(), g, s)));
    planned = true;
    if (Status st = rt_->after_enqueue(s, "plan_group_kernel"); !st) return st;
    return by_consumer_ ? Status{} : fill(s);
  }

  // Nothing to join on the GPU: the next call's kernels are stream ordered after the fill grid
  // (a readiness consumer waits for it before it completes, docs/design.md edge D4). The copy
  // engine: a copy the proxy could not issue since the last call surfaces here.
  Status join_fills() noexcept {
    if (!channel_) return {};
    Status s = CopyProxy::take_status(*channel_);
    if (!s) return s.with_context("%s: a copy-engine fill failed", label_.c_str());
    return s;
  }
  [[nodiscard]] bool overlap() const noexcept { return overlap_; }
  [[nodiscard]] FillEngine fill_engine() const noexcept {
    return copy_engine_ ? FillEngine::copy_engine : FillEngine::sm_loads;
  }
  // Prefetches go through the proxy while forwards' fills use SM loads (speculate_on_copy_engine).
  [[nodiscard]] bool speculates_on_copy_engine() const noexcept { return speculate_on_proxy_; }
  // Requests and fills the proxy took for this cache (copy engine; 0 otherwise).
  [[nodiscard]] std::uint64_t proxy_requests() const noexcept { return channel_ ? channel_->requests.load() : 0; }
  [[nodiscard]] std::uint64_t proxy_fills() const noexcept { return channel_ ? channel_->fills.load() : 0; }
  // The proxy's host time issuing this cache's requests, summed (ns).
  [[nodiscard]] std::uint64_t proxy_issue_ns() const noexcept { return channel_ ? channel_->issue_ns.load() : 0; }
  // Of that, the time inside the copy calls and inside the ready-word memops (ns).
  [[nodiscard]] std::uint64_t proxy_copy_call_ns() const noexcept { return channel_ ? channel_->copy_call_ns.load() : 0; }
  [[nodiscard]] std::uint64_t proxy_word_call_ns() const noexcept { return channel_ ? channel_->word_call_ns.load() : 0; }
  /// The proxy's longest single copy call or ready-word memop for this cache, in nanoseconds.
  [[nodiscard]] std::uint64_t proxy_longest_call_ns() const noexcept { return channel_ ? channel_->longest_call_ns.load() : 0; }

  // plan_prefetch (one warp), then the fill of its list: with overlap the ready-word fill
  // (launched in plain stream order), so a later readiness consumer finds every prefetched
  // slot's ready word published; otherwise the plain fill.
  Status prefetch(Stream s, const std::int32_t* ids, std::int32_t n, std::int32_t max_fills, std::uint32_t expires_after,
                  bool& planned, bool evict_last_forward = false) noexcept {
    planned = false;
    EXPERT_CACHE_TRY_CUDA(launch_plan_prefetch<Policy>(state(), ids, n, max_fills, expires_after, s, evict_last_forward));
    planned = true;
    if (Status st = rt_->after_enqueue(s, "plan_prefetch_kernel"); !st) return st;
    if (copy_engine_ || speculate_on_proxy_) {  // posted only: a later forward waits for the slots it reads
      EXPERT_CACHE_TRY_CUDA(launch_proxy_post(post_, false, s));
      return rt_->after_enqueue(s, "proxy_post_kernel (prefetch)");
    }
    if (overlap_) {
      EXPERT_CACHE_TRY_CUDA(launch_plan_fill_ready(fill_, s, nullptr, plan_fill_max_blocks, false));
      return rt_->after_enqueue(s, "plan_fill_ready_kernel (prefetch)");
    }
    EXPERT_CACHE_TRY_CUDA(launch_plan_fill(fill_, s));
    return rt_->after_enqueue(s, "plan_fill_kernel (prefetch)");
  }

  Status invalidate(Stream s, std::int32_t expert) noexcept {
    EXPERT_CACHE_TRY_CUDA(launch_plan_invalidate(state(), expert, nullptr, s));
    return rt_->after_enqueue(s, "plan_invalidate_kernel");
  }

  Status drop_fills(Stream s) noexcept { return launch_recovery(&drop_fills_kernel<0>, s, "drop_fills_kernel"); }
  Status drop_missing(Stream s) noexcept { return launch_recovery(&drop_missing_kernel<0>, s, "drop_missing_kernel"); }

  // The mapped mirror, word by word (current while kernels run).
  [[nodiscard]] DevicePlanStats stats() const noexcept { return storage_.stats(); }

  // Read and clear; only while the cache's streams are idle (the device ORs with load + store).
  std::uint32_t take_error_word() noexcept {
    std::uint32_t* w = storage_.host_error_word();
    if (w == nullptr) return 0;
    volatile std::uint32_t* v = w;
    const std::uint32_t bits = *v;
    *v = 0u;
    return bits;
  }

 private:
  Status fill(Stream s) noexcept {
    if (copy_engine_) {
      EXPERT_CACHE_TRY_CUDA(launch_proxy_post(post_, !overlap_, s, overlap_ && fill_pdl_));
      return rt_->after_enqueue(s, "proxy_post_kernel");
    }
    if (overlap_) {
      EXPERT_CACHE_TRY_CUDA(launch_plan_fill_ready(fill_, s, use_debug_ ? &debug_ : nullptr, plan_fill_max_blocks, fill_pdl_));
      return rt_->after_enqueue(s, "plan_fill_ready_kernel");
    }
    EXPERT_CACHE_TRY_CUDA(launch_plan_fill(fill_, s));
    return rt_->after_enqueue(s, "plan_fill_kernel");
  }

  // A one-thread recovery kernel on the state.
  Status launch_recovery(void (*kernel)(DevicePlanState), Stream s, const char* what) noexcept {
    const DevicePlanState st = state();
    void* args[] = {const_cast<DevicePlanState*>(&st)};
    EXPERT_CACHE_TRY_CUDA(cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(1), dim3(1), args, 0, s));
    return rt_->after_enqueue(s, what);
  }

  // The ring (mapped pinned), the device's post counter, and the channel of the device's proxy.
  void start_proxy(const CopyRegions& regions, const DeviceCacheOptions& o) {
    const DevicePlanState& st = state();
    void* ring = nullptr;
    throw_on(cudaHostAlloc(&ring, proxy_ring_bytes(st.capacity), cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc (copy proxy ring)");
    ring_.reset(static_cast<unsigned char*>(ring));
    std::memset(ring_.get(), 0, proxy_ring_bytes(st.capacity));
    unsigned char* ring_dev = nullptr;
    throw_on(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ring_dev), ring_.get(), 0),
             "cudaHostGetDevicePointer (copy proxy ring)");
    // Two counters, then (speculate_on_copy_engine) one word per slot: the tag of the slot's latest
    // posted fill, which a forward's SM-load fill of that slot waits for (edge P6).
    const std::size_t words = 2 + static_cast<std::size_t>(speculate_on_proxy_ ? st.capacity : 0);
    void* count = nullptr;
    throw_on(cudaMalloc(&count, words * sizeof(std::uint32_t)), "cudaMalloc (copy proxy post count)");
    post_count_.reset(static_cast<std::uint32_t*>(count));
    // Waited for: the caller's streams may be non-blocking, unordered with the legacy stream.
    {
      RuntimeStream<CudaRuntime> zero(*rt_);
      throw_on(cudaMemsetAsync(post_count_.get(), 0, words * sizeof(std::uint32_t), zero.get()), "cudaMemsetAsync (copy proxy post count)");
      throw_on(cudaStreamSynchronize(zero.get()), "cudaStreamSynchronize (copy proxy post count)");
    }
    label_ = o.label;
    skip_release_drain_ = o.test_skip_release_drain;
    post_.fills = st.fills.data;
    post_.scalars = st.scalars;
    post_.slot_needed = st.slot_needed.data;
    post_.slot_ready = st.slot_ready.data;
    post_.post_count = post_count_.get();
    if (speculate_on_proxy_) {
      post_.slot_posted = post_count_.get() + 2;
      if (!o.test_skip_pending_copy_wait) fill_.slot_posted = post_.slot_posted;
    }
    post_.ring = ring_dev;
    post_.error_word = st.error_word;
    post_.capacity = st.capacity;
    post_.test_post_before_list = o.test_post_before_list;
    ProxyChannelConfig c;
    c.ring_host = reinterpret_cast<ProxyRingHeader*>(ring_.get());
    // The first part's regions first, as make_plan_fill_params orders them (host addresses).
    c.regions = first_part_first(regions, o.ready_first_regions, c.first_part_regions);
    if (c.first_part_regions == regions.count) c.first_part_regions = 0;
    c.slot_ready = st.slot_ready.data;
    c.slot_ready_first = st.slot_ready_first.data;
    c.error_word_host = storage_.host_error_word();
    c.num_experts = st.num_experts;
    c.capacity = st.capacity;
    c.test_ready_before_copy = o.test_ready_before_copy;
    c.test_fail_copies = o.test_fail_copies;
    load_step_kernels();
    int device = 0;
    throw_on(cudaGetDevice(&device), "cudaGetDevice");
    Result<std::shared_ptr<CopyProxy>> proxy = CopyProxy::for_device(device);
    if (!proxy.ok()) throw Error(proxy.status());
    proxy_ = std::move(proxy).value();
    Result<std::shared_ptr<CopyProxy::Channel>> channel = proxy_->attach(c);
    if (!channel.ok()) throw Error(channel.status().with_context("%s: attaching to the copy proxy", o.label.c_str()));
    channel_ = std::move(channel).value();
  }

  // Every kernel this executor may launch, loaded now. With lazy module loading (the CUDA
  // default since 12.2) a kernel's first launch loads it, and loading may wait for the device to
  // go idle while holding the driver's lock; if a kernel on the device is then waiting for the
  // proxy, the proxy's next copy call waits for that lock, and the wait only ends when the
  // kernel's bounded wait gives up. Here nothing waits for the proxy yet. The engine's own
  // kernels need the same (docs/design.md, "Copy-engine fills": lazy loading).
  static void load_step_kernels() {
    const void* kernels[] = {
        reinterpret_cast<const void*>(&proxy_post_kernel<true>),
        reinterpret_cast<const void*>(&proxy_post_kernel<false>),
        reinterpret_cast<const void*>(&plan_forward_kernel<plan_block_threads, Policy>),
        reinterpret_cast<const void*>(&plan_forward_warp_kernel<0, Policy>),
        reinterpret_cast<const void*>(&plan_group_kernel<plan_block_threads, Policy>),
        reinterpret_cast<const void*>(&plan_invalidate_kernel<32>),
        reinterpret_cast<const void*>(&plan_prefetch_kernel<0, Policy>),
        reinterpret_cast<const void*>(&plan_forward_fill_kernel<4, Policy>),
        reinterpret_cast<const void*>(&plan_fill_kernel<4>),
        reinterpret_cast<const void*>(&plan_fill_ready_kernel<4, false>),
        reinterpret_cast<const void*>(&plan_fill_ready_kernel<4, true>),
        reinterpret_cast<const void*>(&drop_fills_kernel<0>),
        reinterpret_cast<const void*>(&drop_missing_kernel<0>),
    };
    for (const void* k : kernels) {
      cudaFuncAttributes attributes{};
      throw_on(cudaFuncGetAttributes(&attributes, k), "cudaFuncGetAttributes (loading the step's kernels)");
    }
  }

  // ready_first_regions names regions the storage has (checked before anything is enqueued).
  static void check_first_part(const CopyRegions& regions, const DeviceCacheOptions& o) {
    if (regions.count < 32 && (o.ready_first_regions >> regions.count) != 0) {
      throw Error(Status::format(ErrorCode::invalid_argument,
                                 "%s: ready_first_regions 0x%x names copy regions past the storage's %zu",
                                 o.label.c_str(), o.ready_first_regions, regions.count));
    }
  }
  static void throw_on(cudaError_t err, const char* what) {
    if (err != cudaSuccess) throw Error(cuda_status(err, what));
  }

  CudaRuntime* rt_;
  DevicePlanStorage storage_;
  RuntimeBuffer<CudaRuntime> sanitized_;
  PlanFillParams fill_{};
  bool fused_;
  bool overlap_;
  bool by_consumer_;
  PlanFillDebug debug_;
  bool use_debug_;
  bool fill_pdl_;  // overlap on sm_90: the fill is launched programmatically after the plan
  // fill_by_consumer on sm_90: the plan is launched programmatically (it waits for the kernel
  // before it, edge D6), and so is the one-pass consumer after it (it waits for the plan, D7).
  bool plan_pdl_ = by_consumer_ && plan_fill_ready_pdl_supported();
  // The copy engine (FillEngine::copy_engine): every fill is a post to the device's proxy.
  bool copy_engine_ = false;
  // speculate_on_copy_engine: only prefetches post; forwards' fills stay SM loads.
  bool speculate_on_proxy_ = false;
  bool skip_release_drain_ = false;  // DeviceCacheOptions::test_skip_release_drain
  std::string label_ = "device_expert_cache";
  struct FreeHost {
    void operator()(void* p) const noexcept { (void)cudaFreeHost(p); }
  };
  struct FreeDevice {
    void operator()(void* p) const noexcept { (void)cudaFree(p); }
  };
  std::unique_ptr<unsigned char, FreeHost> ring_;        // mapped pinned: ProxyRingHeader + requests
  std::unique_ptr<std::uint32_t, FreeDevice> post_count_;  // device memory: ProxyPostParams::post_count
  ProxyPostParams post_{};
  std::shared_ptr<CopyProxy> proxy_;
  std::shared_ptr<CopyProxy::Channel> channel_;
};
using CudaPlanExecutor = BasicCudaPlanExecutor<DeviceLru>;
static_assert(device_plan_executor<CudaPlanExecutor>);

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS

namespace expert_cache::inline v0 {
template <>
struct DevicePlanExecutorFor<CudaRuntime> {
  using type = device::CudaPlanExecutor;
  template <device_plan_policy Policy>
  using with_policy = device::BasicCudaPlanExecutor<Policy>;
};
}  // namespace expert_cache::inline v0
