#pragma once
/// The device planner's fill kernels (needs nvcc): each copies the experts of a plan's fill list
/// (device memory) from mapped pinned host memory (zero-copy) into their slots: after the plan
/// (plan_fill_kernel), beside the consumer with per-slot ready words (plan_fill_ready_kernel), or
/// in one node with the plan (plan_forward_fill_kernel); with their parameters and launchers.
///
/// Graph safety: every kernel parameter is fixed for the cache's lifetime (the state view, the
/// id buffer's address and length, the copy regions); what changes per step (the ids, the plan,
/// the fill list and its length) lives in device memory. So plan -> fill can be captured once and
/// replayed with new ids every time. All kernels are templates (vague linkage): any number of
/// translation units can include this header.
///
/// Plan and fill in one kernel node (plan_forward_fill_kernel): warp 0 of block 0 plans, then
/// publishes the fill list to the other blocks through a device-scope flag in the state's
/// scalars (fill_ready: release store after the plan, acquire spin in each other block before it
/// reads the list); the last block to finish (fill_done, acq_rel counter) clears both for the next
/// launch, which stream order puts after this one. This flag is an ordering edge of the cache
/// (docs/design.md's table); tests/gpu/test_device_plan.cu delays the plan so that a fill that
/// did not wait would copy the previous step's experts, and checks every slot's bytes. The
/// waiting blocks need block 0 to run: the grid is capped at what is co-resident (blocks are
/// dispatched in index order, the forward-progress assumption CUB's decoupled look-back makes).
/// That spin is bounded (kernels/slot_ready.cuh): after about 1.5 s it flags
/// plan_error_wait_timeout and goes on instead of hanging.
///
/// Overlapped fill (plan_fill_ready_kernel, DeviceCacheOptions::overlap; edge D4 of
/// docs/design.md): the fill of a two-node step (plan -> fill) that lets the consumer run while
/// it copies. On sm_90 it is itself launched programmatically after the plan kernel (which
/// triggers at its start), so its blocks are scheduled while the plan runs; each block first waits
/// for the plan grid (griddepcontrol.wait), then triggers programmatic dependent launch, so a
/// consumer launched with cudaLaunchAttributeProgrammaticStreamSerialization may start at once
/// (and only after the plan completed: it reads the maps without a wait of its own); each fill i is
/// copied by all blocks together, each block counts itself in (fill_arrivals[i]), and the last
/// one stores slot_ready[slot] = slot_needed[slot] with release semantics; the consumer acquires
/// that word before it reads the slot. Deadlock freedom: the consumer's blocks spin, the fill's
/// never do, and PDL starts the dependent grid only once every block of this grid has triggered
/// (or exited), i.e. once every fill block is resident; so the spinning blocks can never keep a
/// fill block from running, and every fill completes.
#if !defined(__CUDACC__)
#error "expert_cache/kernels/plan_fill.cuh needs nvcc"
#endif

#include <cuda/atomic>
#include <cuda_runtime.h>

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/kernels/fill_copy.cuh"
#include "expert_cache/kernels/griddep.cuh"
#include "expert_cache/kernels/plan_block.cuh"
#include "expert_cache/kernels/plan_kernels.cuh"
#include "expert_cache/kernels/slot_ready.cuh"
#include "expert_cache/planning/device_plan.hpp"
#include "expert_cache/storage/copy_region.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

inline constexpr int plan_fill_threads = 512;
inline constexpr int plan_fill_max_blocks = 32;  // zero-copy saturates PCIe with ~16 blocks (docs/hardware_limits.md)
// Threads per block of the fused plan + fill kernel. LRU's plan fits the 128 registers per
// thread that 512 threads allow; the score policies' plans (LFRU, CRF) need up to about 240 and
// would spill about 1.4-1.9 KB per thread to local memory (ptxas -v, sm_90), which the plan's
// warp then waits on. They get 256 threads (255 registers) and twice the blocks (the launch
// scales its cap), so the fill keeps as many threads in flight.
template <class Policy>
inline constexpr int plan_fused_threads = std::same_as<Policy, DeviceLru> ? plan_fill_threads : plan_fill_threads / 2;

// ---- fill from the device fill list -----------------------------------------------------------

// Fixed for the cache's lifetime (a graph keeps its own copy). Region bases must be device
// addresses: host_base of mapped pinned memory (see resolve_mapped_regions), slot_base of the
// slot buffers. Work item = one `width`-byte piece of one region of one fill.
struct PlanFillParams {
  CopyRegions regions{};
  std::uint32_t width[max_copy_regions] = {};           // 16 when bases and strides are 16-aligned, else 4 or 1
  std::uint32_t item_begin[max_copy_regions + 1] = {};  // first item of each region inside a fill
  std::uint32_t items_per_fill = 0;
  std::int32_t num_experts = 0;
  std::int32_t capacity = 0;
  const PlanEntry* fills = nullptr;                // the state's fill list
  const DevicePlanScalars* scalars = nullptr;      // its fill_count
  // The overlapped fill only (plan_fill_ready_kernel): the state's readiness arrays.
  const std::uint32_t* slot_needed = nullptr;
  std::uint32_t* slot_ready = nullptr;
  std::uint32_t* fill_arrivals = nullptr;
  std::uint32_t* slot_ready_first = nullptr;
  std::uint32_t* fill_arrivals_first = nullptr;
  // Device memory, one word per slot, or null: the tag of the slot's latest fill posted to the
  // copy proxy (speculate_on_copy_engine). The overlapped fill waits until a slot's ready word
  // reached it before it writes the slot (edge P6): the proxy's copy and its ready-word store
  // must not land after this fill's.
  const std::uint32_t* slot_posted = nullptr;
  std::uint32_t* error_word = nullptr;  // the state's (mapped): a timed-out wait above is flagged here
  // Items of a fill's first part (edge D4c): the regions make_plan_fill_params was told to
  // copy first, placed at the front of `regions`. 0: one part (the whole expert).
  std::uint32_t first_part_items = 0;
};

// Test-only knob of the overlapped fill (compiled in only by plan_fill_ready_kernel<Ilp, true>):
// every block waits `delay_ns` before it copies part `delay_part` of fill `delay_fill`, so a
// consumer that did not wait for that part's ready word would read the slot's previous bytes.
// `publish_first_early` stores the first part's ready word before the part is copied: the
// edge D4c removed, so a test can show that it sees the difference.
struct PlanFillDebug {
  std::uint32_t delay_ns = 0;
  std::int32_t delay_fill = -1;
  std::int32_t delay_part = 0;
  bool publish_first_early = false;
};

namespace detail {

__device__ __forceinline__ bool locate_plan_item(const PlanFillParams& p, std::uint64_t idx, int4& v, int4*& dst16) {
  const auto fill = static_cast<std::uint32_t>(idx / p.items_per_fill);
  const auto r = static_cast<std::uint32_t>(idx - static_cast<std::uint64_t>(fill) * p.items_per_fill);
  // Past L1: in the fused kernel another SM wrote the list during this kernel.
  const int2 raw = __ldcg(reinterpret_cast<const int2*>(p.fills) + fill);
  const PlanEntry f{raw.x, raw.y};
  // The list is written by the planner; checked anyway so nothing outside the pools is touched.
  if (f.expert < 0 || f.expert >= p.num_experts || f.slot < 0 || f.slot >= p.capacity) return false;
  std::size_t t = 0;
  while (t + 1 < p.regions.count && r >= p.item_begin[t + 1]) ++t;
  const CopyRegion& g = p.regions.regions[t];
  const std::uint32_t width = p.width[t];
  const std::uint64_t offset = static_cast<std::uint64_t>(r - p.item_begin[t]) * width;
  const std::byte* src = g.host_base + static_cast<std::uint64_t>(f.expert) * g.host_stride + offset;
  std::byte* dst = g.slot_base + static_cast<std::uint64_t>(f.slot) * g.slot_stride + offset;
  return copy_item(src, dst, width, g.bytes - offset, v, dst16);
}

}  // namespace detail

namespace detail {
// This block's share of the fill of n experts (grid-stride, Ilp 16-byte loads in flight per
// thread before the stores).
template <int Ilp>
__device__ __forceinline__ void plan_fill_items(const PlanFillParams& p, std::int32_t n) {
  n = n < 0 ? 0 : (n > p.capacity ? p.capacity : n);
  copy_items<Ilp>(static_cast<std::uint64_t>(n) * p.items_per_fill,
                  [&p](std::uint64_t idx, int4& v, int4*& dst16) { return locate_plan_item(p, idx, v, dst16); });
}
}  // namespace detail

/// @brief The stream-ordered fill: copies every entry of the state's fill list from the host
/// pools (mapped) into its slot. Grid sized for the worst case (capacity fills); blocks beyond
/// the actual list exit at once.
/// @param p the fill parameters (make_plan_fill_params), fixed for the cache's lifetime
template <int Ilp = 4>
EXPERT_CACHE_KERNEL void __launch_bounds__(plan_fill_threads) plan_fill_kernel(const __grid_constant__ PlanFillParams p) {
  detail::plan_fill_items<Ilp>(p, p.scalars->fill_count);
}

/// @brief The overlapped fill (see the top of this file): copies the fill list and stores each
/// filled slot's ready word (release) once its bytes landed, so a consumer may run beside it.
/// Grid as plan_fill_kernel's.
///
/// With a first part (first_part_items, edge D4c) the copy runs in the consumer's order: the
/// first part of every fill, in list order, each published on slot_ready_first, then the rest of
/// every fill, each published on slot_ready. A consumer whose first pass reads only the first
/// part (the NVFP4 MoE's W13 GEMM) then starts on the k-th missing expert once k first parts
/// landed, and after the last byte only its second pass over the last expert is left.
/// @param p the fill parameters (make_plan_fill_params), with the state's readiness arrays
/// @param debug the test-only delay and early publication; read only by the Debug instantiation
template <int Ilp = 4, bool Debug = false>
EXPERT_CACHE_KERNEL void __launch_bounds__(plan_fill_threads)
    plan_fill_ready_kernel(const __grid_constant__ PlanFillParams p, const PlanFillDebug debug) {
  // Launched programmatically after the plan kernel: wait for it (completed, writes visible)
  // before any memory access; in plain stream order this returns at once.
  detail::griddep_wait();
  // Then, in every block: the dependent (consumer) grid may start once all of this grid's
  // blocks got here, i.e. after the plan completed (the consumer reads the maps and ids without
  // a wait). No memory ordering comes with it for the fill; the ready words provide that.
  detail::griddep_launch_dependents();
  // The plan kernel completed (stream order, or the wait above): plain loads.
  std::int32_t n = p.scalars->fill_count;
  n = n < 0 ? 0 : (n > p.capacity ? p.capacity : n);
  const bool split = p.first_part_items > 0 && p.first_part_items < p.items_per_fill;
  for (std::int32_t part = 0; part < (split ? 2 : 1); ++part) {
    const std::uint32_t lo = split && part == 1 ? p.first_part_items : 0u;
    const std::uint32_t hi = split && part == 0 ? p.first_part_items : p.items_per_fill;
    // Whole experts (no split) and second parts end on slot_ready (and, without a split, on
    // slot_ready_first too); first parts on slot_ready_first.
    const bool first_word = !split || part == 0, whole_word = !split || part == 1;
    std::uint32_t* arrivals_of = split && part == 0 ? p.fill_arrivals_first : p.fill_arrivals;
    for (std::int32_t i = 0; i < n; ++i) {
      if constexpr (Debug) {
        if (debug.publish_first_early && first_word && threadIdx.x == 0 && blockIdx.x == 0) {
          const PlanEntry f = p.fills[i];
          if (f.slot >= 0 && f.slot < p.capacity) {
            cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device>(p.slot_ready_first[f.slot])
                .store(p.slot_needed[f.slot], cuda::memory_order_release);
          }
        }
        if (i == debug.delay_fill && (!split || part == debug.delay_part) && debug.delay_ns != 0) {
          const std::uint64_t until = global_timer_ns() + debug.delay_ns;
          while (global_timer_ns() < until) __nanosleep(1000);
        }
      }
      // Edge P6: a copy-engine fill of this slot still in flight lands first (one thread per
      // block acquires the ready word; the barrier orders the block's stores after it).
      if (p.slot_posted != nullptr && part == 0) {
        if (threadIdx.x == 0) {
          const PlanEntry f = p.fills[i];
          if (f.slot >= 0 && f.slot < p.capacity) {
            const std::uint32_t want = __ldcg(p.slot_posted + f.slot);
            cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> ready(p.slot_ready[f.slot]);
            (void)bounded_spin([&] { return slot_seq_reached(ready.load(cuda::memory_order_acquire), want); }, 0,
                               p.error_word);
          }
        }
        __syncthreads();
      }
      // Fill i's part, shared by all blocks (grid-stride over its items): parts become ready in
      // list order, the first one after about 1/n of the part's bytes.
      const std::uint64_t base = static_cast<std::uint64_t>(i) * p.items_per_fill + lo;
      detail::copy_items<Ilp>(hi - lo, [&p, base](std::uint64_t idx, int4& v, int4*& dst16) {
        return detail::locate_plan_item(p, base + idx, v, dst16);
      });
      // Publication (PTX memory model): every thread of the block issued its stores of fill i
      // above; bar.sync orders them before thread 0's next operations (CTA-scope
      // synchronisation, part of causality order); thread 0's fence.acq_rel.gpu + acq_rel RMW
      // at device scope then releases them cumulatively to whoever acquires the counter. The
      // last block's RMW reads the release sequence of every earlier arrival (acquire), so all
      // blocks' stores of fill i precede its release store of the ready word, which the
      // consumer acquires before its barrier and its loads of the slot. (The pattern of
      // cooperative groups' grid barrier.) Each part has its own counter: a block may arrive
      // for fill i's second part before the last block arrived for its first.
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> arrivals(arrivals_of[i]);
        if (arrivals.fetch_add(1u, cuda::memory_order_acq_rel) == gridDim.x - 1) {
          arrivals.store(0u, cuda::memory_order_relaxed);  // every block arrived: ready for the next launch
          const PlanEntry f = p.fills[i];
          if (f.slot >= 0 && f.slot < p.capacity) {
            const std::uint32_t tag = p.slot_needed[f.slot];
            if (first_word) {
              cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device>(p.slot_ready_first[f.slot])
                  .store(tag, cuda::memory_order_release);
            }
            if (whole_word) {
              cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device>(p.slot_ready[f.slot])
                  .store(tag, cuda::memory_order_release);
            }
          }
        }
      }
    }
  }
}

// Plan (warp 0 of block 0) and fill (every block) in one kernel node; see the top of this file
// for the flag protocol. `debug_plan_delay_ns` delays the plan (tests: a fill that does not
// wait for the flag then copies stale experts).
struct PlanFusedParams {
  DevicePlanState state{};
  const std::int32_t* ids = nullptr;
  std::int32_t n_ids = 0;
  std::int32_t* sanitized = nullptr;
  PlanFillParams fill{};
  std::uint32_t debug_plan_delay_ns = 0;
};

/// @brief Plans a forward (warp 0 of block 0) and fills its group 0 (every block) in one kernel
/// node; the flag that orders the fill after the plan is described at the top of this file.
/// @param p the state, the ids, the fill parameters and the test-only plan delay
template <int Ilp = 4, device_plan_policy Policy = DeviceLru>
EXPERT_CACHE_KERNEL void __launch_bounds__(plan_fused_threads<Policy>)
    plan_forward_fill_kernel(const __grid_constant__ PlanFusedParams p) {
  // Launched programmatically (launch_plan_forward_fill's `programmatic`): the kernel before it
  // completed, its writes (the ids) visible, before any block reads; a no-op otherwise.
  detail::griddep_wait();
  DevicePlanScalars* sc = p.state.scalars;
  cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> ready(sc->fill_ready);
  cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> done(sc->fill_done);
  if (blockIdx.x == 0) {
    if (threadIdx.x < 32) {
      if (p.debug_plan_delay_ns != 0) {
        const std::uint64_t until = clock64() + 2ull * p.debug_plan_delay_ns;  // >= 1 ns per 2 cycles below 2 GHz
        while (clock64() < until) __nanosleep(1000);
      }
      WarpBlock w;
      plan_forward<Policy>(w, p.state, p.ids, p.n_ids, p.sanitized);
      __syncwarp();  // every lane's plan writes happen before lane 0's release
      if (threadIdx.x == 0) ready.store(1u, cuda::memory_order_release);
    }
    __syncthreads();  // block 0's other warps: ordered after the plan by the barrier
  } else {
    if (threadIdx.x == 0) {
      // Bounded: on a timeout the error word says so and the block copies what the list holds
      // (bounds-checked), so the kernel ends and the done-counter protocol stays intact.
      (void)bounded_spin([&] { return ready.load(cuda::memory_order_acquire) != 0u; }, 0, p.state.error_word);
    }
    __syncthreads();  // the acquire, then the barrier: the block's reads below see the plan
  }
  // Read past L1 (written by another SM in this kernel).
  detail::plan_fill_items<Ilp>(p.fill, __ldcg(&sc->fill_count));
  __syncthreads();
  if (threadIdx.x == 0 && done.fetch_add(1u, cuda::memory_order_acq_rel) == gridDim.x - 1) {
    done.store(0u, cuda::memory_order_relaxed);  // the last block: every other block has read the flag
    ready.store(0u, cuda::memory_order_relaxed);
  }
}

// ---- host side --------------------------------------------------------------------------------

// Replaces each region's host_base (mapped pinned memory: cudaHostAlloc(Mapped) or
// cudaHostRegister(Mapped)) by its device address. Once per storage, not under capture.
inline cudaError_t resolve_mapped_regions(CopyRegions& regions) noexcept {
  if (regions.count > max_copy_regions) return cudaErrorInvalidValue;
  for (std::size_t i = 0; i < regions.count; ++i) {
    CopyRegion& r = regions.regions[i];
    if (r.bytes == 0) continue;
    void* dev = nullptr;
    const cudaError_t err = cudaHostGetDevicePointer(&dev, const_cast<std::byte*>(r.host_base), 0);
    if (err != cudaSuccess) return err;
    r.host_base = static_cast<const std::byte*>(dev);
  }
  return cudaSuccess;
}

// Builds the fill kernel's parameters for a state and its storage's copy regions.
// cudaErrorInvalidValue: more than max_copy_regions, a null base, a region wider than its
// stride, or more than 2^31 work items per fill.
//
// `first_part_regions` (bit r = regions[r]; the overlapped fill only, edge D4c): the regions
// every fill copies and publishes first; they are moved to the front of the parameters' region
// list (order within each part kept). 0, or every region: one part. A bit at or past
// regions.count: cudaErrorInvalidValue.
inline cudaError_t make_plan_fill_params(const CopyRegions& regions, const DevicePlanState& s, PlanFillParams& out,
                                         std::uint32_t first_part_regions = 0) noexcept {
  if (regions.count > max_copy_regions || !plan_view_ok(s)) return cudaErrorInvalidValue;
  if (regions.count < 32 && (first_part_regions >> regions.count) != 0) return cudaErrorInvalidValue;
  PlanFillParams p;
  std::size_t first_count = 0;
  p.regions = first_part_first(regions, first_part_regions, first_count);
  p.num_experts = s.num_experts;
  p.capacity = s.capacity;
  p.fills = s.fills.data;
  p.scalars = s.scalars;
  p.slot_needed = s.slot_needed.data;
  p.slot_ready = s.slot_ready.data;
  p.fill_arrivals = s.fill_arrivals.data;
  p.slot_ready_first = s.slot_ready_first.data;
  p.fill_arrivals_first = s.fill_arrivals_first.data;
  p.error_word = s.error_word;
  std::uint64_t items = 0;
  for (std::size_t i = 0; i < regions.count; ++i) {
    const CopyRegion& r = p.regions.regions[i];
    if (r.bytes > 0 && (r.host_base == nullptr || r.slot_base == nullptr || r.bytes > r.host_stride ||
                        r.bytes > r.slot_stride)) {
      return cudaErrorInvalidValue;
    }
    auto aligned = [&](std::uintptr_t a) {
      return (reinterpret_cast<std::uintptr_t>(r.host_base) % a) == 0 &&
             (reinterpret_cast<std::uintptr_t>(r.slot_base) % a) == 0 && r.host_stride % a == 0 &&
             r.slot_stride % a == 0;
    };
    p.width[i] = aligned(16) ? 16u : (aligned(4) ? 4u : 1u);
    p.item_begin[i] = static_cast<std::uint32_t>(items);
    items += (r.bytes + p.width[i] - 1) / p.width[i];
    if (items >= (std::uint64_t{1} << 31)) return cudaErrorInvalidValue;
  }
  p.item_begin[regions.count] = static_cast<std::uint32_t>(items);
  p.items_per_fill = static_cast<std::uint32_t>(items);
  // Every region in one part, or none in the first: no split.
  p.first_part_items = first_count > 0 && first_count < regions.count ? p.item_begin[first_count] : 0u;
  out = p;
  return cudaSuccess;
}

// Grid for the worst case: `capacity` fills (at most plan_fill_max_blocks blocks).
template <int Ilp = 4>
inline cudaError_t launch_plan_fill(const PlanFillParams& p, cudaStream_t stream,
                                    int max_blocks = plan_fill_max_blocks) noexcept {
  const std::uint64_t worst = static_cast<std::uint64_t>(p.capacity) * p.items_per_fill;
  const std::uint64_t per_block = static_cast<std::uint64_t>(plan_fill_threads) * Ilp;
  std::uint64_t blocks = (worst + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > static_cast<std::uint64_t>(max_blocks > 0 ? max_blocks : 1)) blocks = max_blocks > 0 ? max_blocks : 1;
  void* args[] = {const_cast<PlanFillParams*>(&p)};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&plan_fill_kernel<Ilp>), dim3(static_cast<unsigned>(blocks)),
                          dim3(plan_fill_threads), args, 0, stream);
}

// The overlapped fill (same grid as launch_plan_fill). `debug` non-null selects the test
// instantiation with the delay knob; the full-speed kernel has none. `programmatic` (sm_90,
// plan_fill_ready_pdl_supported()): launched with programmatic stream serialization, so that it
// is scheduled while the plan kernel before it runs (the kernel waits for the plan first); a
// launch refused with the attribute is retried in plain stream order.
template <int Ilp = 4>
inline cudaError_t launch_plan_fill_ready(const PlanFillParams& p, cudaStream_t stream, const PlanFillDebug* debug = nullptr,
                                          int max_blocks = plan_fill_max_blocks, bool programmatic = false) noexcept {
  if (p.slot_ready == nullptr || p.slot_needed == nullptr || p.fill_arrivals == nullptr || p.slot_ready_first == nullptr ||
      p.fill_arrivals_first == nullptr) {
    return cudaErrorInvalidValue;
  }
  const std::uint64_t worst = static_cast<std::uint64_t>(p.capacity) * p.items_per_fill;
  const std::uint64_t per_block = static_cast<std::uint64_t>(plan_fill_threads) * Ilp;
  std::uint64_t blocks = (worst + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > static_cast<std::uint64_t>(max_blocks > 0 ? max_blocks : 1)) blocks = max_blocks > 0 ? max_blocks : 1;
  PlanFillDebug d = debug != nullptr ? *debug : PlanFillDebug{};
  void* args[] = {const_cast<PlanFillParams*>(&p), &d};
  const void* kernel = debug != nullptr ? reinterpret_cast<const void*>(&plan_fill_ready_kernel<Ilp, true>)
                                        : reinterpret_cast<const void*>(&plan_fill_ready_kernel<Ilp, false>);
  return detail::launch_maybe_programmatic(kernel, static_cast<unsigned>(blocks), plan_fill_threads, args, stream,
                                           programmatic);
}

// Whether launch_plan_fill_ready may use `programmatic`: an sm_90+ device and fill kernels whose
// code has the wait (PTX 9.0+; older PTX JIT-compiled would not wait). Host calls: ask once.
template <int Ilp = 4>
inline bool plan_fill_ready_pdl_supported() noexcept {
  int dev = 0, major = 0;
  cudaFuncAttributes a{}, b{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&plan_fill_ready_kernel<Ilp, false>)) != cudaSuccess ||
      cudaFuncGetAttributes(&b, reinterpret_cast<const void*>(&plan_fill_ready_kernel<Ilp, true>)) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major >= 9 && a.ptxVersion >= 90 && b.ptxVersion >= 90;
}

// One node: plan_forward of `ids` then the fill of its group 0 (overflow groups still take
// launch_plan_group + launch_plan_fill). `fill` from make_plan_fill_params for the same state.
// The grid is capped at plan_fill_max_blocks and at what the device holds at once (the waiting
// blocks need block 0 to be resident).
template <int Ilp = 4, device_plan_policy Policy = DeviceLru>
inline cudaError_t launch_plan_forward_fill(const DevicePlanState& s, const std::int32_t* ids, std::int32_t n_ids,
                                            std::int32_t* sanitized, const PlanFillParams& fill, cudaStream_t stream,
                                            int max_blocks = plan_fill_max_blocks,
                                            std::uint32_t debug_plan_delay_ns = 0, bool programmatic = false) noexcept {
  if (!plan_view_ok(s) || fill.scalars != s.scalars || fill.fills != s.fills.data) return cudaErrorInvalidValue;
  PlanFusedParams p;
  p.state = s;
  p.ids = ids;
  p.n_ids = n_ids;
  p.sanitized = sanitized;
  p.fill = fill;
  p.debug_plan_delay_ns = debug_plan_delay_ns;
  constexpr int threads = plan_fused_threads<Policy>;
  const std::uint64_t worst = static_cast<std::uint64_t>(fill.capacity) * fill.items_per_fill;
  const std::uint64_t per_block = static_cast<std::uint64_t>(threads) * Ilp;
  std::uint64_t blocks = (worst + per_block - 1) / per_block;
  int device = 0, sms = 1, per_sm = 1;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, reinterpret_cast<const void*>(&plan_forward_fill_kernel<Ilp, Policy>), threads, 0);
  }
  if (err != cudaSuccess) return err;
  const std::uint64_t resident = static_cast<std::uint64_t>(sms) * static_cast<std::uint64_t>(per_sm > 0 ? per_sm : 1);
  // max_blocks counts blocks of plan_fill_threads: the same threads in flight at any block size.
  const std::uint64_t cap = static_cast<std::uint64_t>(max_blocks > 0 ? max_blocks : 1) * (plan_fill_threads / threads);
  if (blocks > cap) blocks = cap;
  if (blocks > resident) blocks = resident;
  if (blocks < 1) blocks = 1;
  void* args[] = {&p};
  return detail::launch_maybe_programmatic(reinterpret_cast<const void*>(&plan_forward_fill_kernel<Ilp, Policy>),
                                           static_cast<unsigned>(blocks), threads, args, stream, programmatic);
}

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
