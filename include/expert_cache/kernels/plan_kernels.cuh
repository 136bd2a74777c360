#pragma once
/// The planning kernels (needs nvcc): each step of planning/device_plan.hpp (reset, forward,
/// group, invalidate, prefetch) as a kernel of one CubBlock or one WarpBlock
/// (kernels/plan_block.cuh), and the host functions that launch them. The fills that copy a
/// plan's fill list are in kernels/plan_fill.cuh.
///
/// Graph safety: every kernel parameter is fixed for the cache's lifetime (the state view, the
/// id buffer's address and length, the group index of a graph node); what changes per step (the
/// ids, the plan) lives in device memory. So a plan can be captured once and replayed with new
/// ids every time. All kernels are templates (vague linkage): any number of translation units
/// can include this header.
#if !defined(__CUDACC__)
#error "expert_cache/kernels/plan_kernels.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/kernels/griddep.cuh"
#include "expert_cache/kernels/plan_block.cuh"
#include "expert_cache/planning/device_plan.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

namespace detail {
// Programmatic dependent launch (sm_90; no-ops below). The planning kernels trigger at their
// start, so an overlapped fill launched programmatically after them (launch_plan_fill_ready with
// `programmatic`) is scheduled while the plan runs; the fill waits (griddepcontrol.wait: the plan
// grid completed, its writes visible) before it touches memory. A dependent launched without the
// attribute ignores the trigger. The planning kernels themselves wait right after the trigger, so
// they may be launched programmatically too (launch_plan_forward's `programmatic`): the launch of
// a plan then overlaps the kernel before it (the router; in a graph of plans, the previous
// layer's plan), and only the wait's release is left on the chain, not a node launch.
// (the two instructions: kernels/griddep.cuh)
}  // namespace detail

// ---- planning kernels (one block of Threads threads each) -------------------------------------

// Every planning kernel takes the device policy (planning/device_plan.hpp) as its last template
// argument, DeviceLru by default; one state is planned by one policy for its whole life.
// The state is a __grid_constant__ parameter: the planning code holds it by reference (and the
// one-warp kernel passes it to its out-of-line general path), and a plain by-value parameter
// whose address is taken is first copied to local memory, all of it (424 bytes), at every launch.

/// @brief Resets a state to an empty cache for `Policy` (reset_plan_state): its free-slot order,
/// counters, error word, policy state and DeviceCrf's decay.
/// @param s the state view (device memory)
/// @param crf_decay DeviceCrf's decay per forward in Q32 (the other policies ignore it)
template <int Threads = plan_block_threads, device_plan_policy Policy = DeviceLru>
EXPERT_CACHE_KERNEL void __launch_bounds__(Threads)
    plan_reset_kernel(const __grid_constant__ DevicePlanState s, std::uint64_t crf_decay) {
  __shared__ typename CubBlock<Threads>::TempStorage temp;
  CubBlock<Threads> b(temp);
  reset_plan_state<Policy>(b, s, crf_decay);
}

/// @brief Plans one forward (plan_forward) on one block: the forward map, the resident map, the
/// fill list of group 0 and the counters.
/// @param s the state view (device memory)
/// @param ids device buffer of n_ids int32 ([tokens, top_k], -1 padding) whose contents may
///        change between graph replays
/// @param n_ids how many ids
/// @param sanitized optional (may equal ids): receives the ids with every dropped one as -1
template <int Threads = plan_block_threads, device_plan_policy Policy = DeviceLru>
EXPERT_CACHE_KERNEL void __launch_bounds__(Threads)
    plan_forward_kernel(const __grid_constant__ DevicePlanState s, const std::int32_t* ids, std::int32_t n_ids,
                        std::int32_t* sanitized) {
  __shared__ typename CubBlock<Threads>::TempStorage temp;
  CubBlock<Threads> b(temp);
  detail::griddep_launch_dependents();
  detail::griddep_wait();
  plan_forward<Policy>(b, s, ids, n_ids, sanitized);
}

// Mode plan_test_skip_wait of plan_forward_warp_kernel (tests only) leaves out the wait for the
// preceding kernel, so that a programmatically launched plan reads ids the kernel before it has
// not written yet.
inline constexpr int plan_test_skip_wait = 1;
/// @brief plan_forward_kernel's step on one warp (small forwards: n_ids <= plan_small_ids;
/// correct for any n_ids).
/// @param s the state view (device memory)
/// @param ids device buffer of n_ids int32 (-1 padding) whose contents may change between replays
/// @param n_ids how many ids
/// @param sanitized optional (may equal ids): receives the ids with every dropped one as -1
template <int Mode = 0, device_plan_policy Policy = DeviceLru>
EXPERT_CACHE_KERNEL void __launch_bounds__(32)
    plan_forward_warp_kernel(const __grid_constant__ DevicePlanState s, const std::int32_t* ids, std::int32_t n_ids,
                             std::int32_t* sanitized) {
  WarpBlock b;
  detail::griddep_launch_dependents();
  if constexpr (Mode != plan_test_skip_wait) detail::griddep_wait();
  plan_forward_small<Policy>(b, s, ids, n_ids, sanitized);  // any other forward: the general path, out of line
}

/// @brief Plans group g >= 1 of an overflowing forward; empty (clears the forward map) when
/// g >= group_count.
/// @param s the state view (device memory)
/// @param group the group index g (fixed per graph node)
template <int Threads = plan_block_threads, device_plan_policy Policy = DeviceLru>
EXPERT_CACHE_KERNEL void __launch_bounds__(Threads)
    plan_group_kernel(const __grid_constant__ DevicePlanState s, std::int32_t group) {
  __shared__ typename CubBlock<Threads>::TempStorage temp;
  CubBlock<Threads> b(temp);
  detail::griddep_launch_dependents();
  detail::griddep_wait();
  plan_group<Policy>(b, s, group);
}

/// @brief Drops one expert from the state (plan_invalidate; a no-op when it is not resident).
/// @param s the state view (device memory)
/// @param expert the expert, used when expert_ptr is null
/// @param expert_ptr optional device word holding the expert (graph-friendly: it may change
///        between replays); read instead of `expert` when set
template <int Threads = 32>
EXPERT_CACHE_KERNEL void __launch_bounds__(Threads)
    plan_invalidate_kernel(const __grid_constant__ DevicePlanState s, std::int32_t expert,
                           const std::int32_t* expert_ptr) {
  __shared__ typename CubBlock<Threads>::TempStorage temp;
  CubBlock<Threads> b(temp);
  plan_invalidate(b, s, expert_ptr != nullptr ? *expert_ptr : expert);
}

/// @brief Plans speculative fills (plan_prefetch) on one warp; the fills it lists are then copied
/// by plan_fill_kernel or plan_fill_ready_kernel exactly like a forward's.
/// @param s the state view (device memory)
/// @param ids device buffer of n_ids predicted ids (best first, -1 padding) whose contents may
///        change between graph replays
/// @param n_ids how many ids
/// @param max_fills most fills this call makes
/// @param expires_after forwards an unused speculative fill stays protected (>= 1)
/// @param evict_last_forward the last forward's residents are victims too (PrefetchOptions)
template <int Unused = 0, device_plan_policy Policy = DeviceLru>
EXPERT_CACHE_KERNEL void __launch_bounds__(32)
    plan_prefetch_kernel(const __grid_constant__ DevicePlanState s, const std::int32_t* ids, std::int32_t n_ids,
                         std::int32_t max_fills, std::uint32_t expires_after, bool evict_last_forward) {
  WarpBlock b;
  detail::griddep_launch_dependents();
  detail::griddep_wait();
  plan_prefetch<Policy>(b, s, ids, n_ids, max_fills, expires_after, evict_last_forward);
}

// ---- host side --------------------------------------------------------------------------------

template <int Threads = plan_block_threads, device_plan_policy Policy = DeviceLru>
inline cudaError_t launch_plan_reset(const DevicePlanState& s, cudaStream_t stream,
                                     std::uint64_t crf_decay = crf_default_decay_q32) noexcept {
  void* args[] = {const_cast<DevicePlanState*>(&s), &crf_decay};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&plan_reset_kernel<Threads, Policy>), dim3(1), dim3(Threads), args, 0,
                          stream);
}

namespace detail {
// A launch with programmatic stream serialization when `programmatic` (sm_90: the kernel waits
// for its predecessor itself); refused with the attribute, retried in plain stream order.
inline cudaError_t launch_maybe_programmatic(const void* kernel, unsigned grid, unsigned block, void** args,
                                             cudaStream_t stream, bool programmatic) noexcept {
  if (!programmatic) return cudaLaunchKernel(kernel, dim3(grid), dim3(block), args, 0, stream);
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaError_t err = cudaLaunchKernelExC(&cfg, kernel, args);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    cfg.numAttrs = 0;
    err = cudaLaunchKernelExC(&cfg, kernel, args);
  }
  return err;
}
}  // namespace detail

// Up to plan_small_ids ids: the one-warp kernel; more: one block of Threads. `programmatic`
// (sm_90, plan_fill_ready_pdl_supported()): launched with programmatic stream serialization,
// scheduled while the kernel before it runs; the plan waits for that kernel before it reads
// (edge D6 of docs/design.md). WarpMode plan_test_skip_wait (tests only, one-warp kernel): without
// that wait. A template argument, so that no other caller compiles the test kernel.
template <int Threads = plan_block_threads, device_plan_policy Policy = DeviceLru, int WarpMode = 0>
inline cudaError_t launch_plan_forward(const DevicePlanState& s, const std::int32_t* ids, std::int32_t n_ids,
                                       std::int32_t* sanitized, cudaStream_t stream, bool programmatic = false) noexcept {
  void* args[] = {const_cast<DevicePlanState*>(&s), &ids, &n_ids, &sanitized};
  if (n_ids >= 0 && n_ids <= plan_small_ids) {
    return detail::launch_maybe_programmatic(reinterpret_cast<const void*>(&plan_forward_warp_kernel<WarpMode, Policy>), 1,
                                             32, args, stream, programmatic);
  }
  return detail::launch_maybe_programmatic(reinterpret_cast<const void*>(&plan_forward_kernel<Threads, Policy>), 1,
                                           Threads, args, stream, programmatic);
}

template <int Threads = plan_block_threads, device_plan_policy Policy = DeviceLru>
inline cudaError_t launch_plan_group(const DevicePlanState& s, std::int32_t group, cudaStream_t stream) noexcept {
  void* args[] = {const_cast<DevicePlanState*>(&s), &group};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&plan_group_kernel<Threads, Policy>), dim3(1), dim3(Threads), args, 0,
                          stream);
}

inline cudaError_t launch_plan_invalidate(const DevicePlanState& s, std::int32_t expert, const std::int32_t* expert_ptr,
                                          cudaStream_t stream) noexcept {
  void* args[] = {const_cast<DevicePlanState*>(&s), &expert, &expert_ptr};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&plan_invalidate_kernel<32>), dim3(1), dim3(32), args, 0,
                          stream);
}

template <device_plan_policy Policy = DeviceLru>
inline cudaError_t launch_plan_prefetch(const DevicePlanState& s, const std::int32_t* ids, std::int32_t n_ids,
                                        std::int32_t max_fills, std::uint32_t expires_after, cudaStream_t stream,
                                        bool evict_last_forward = false) noexcept {
  void* args[] = {const_cast<DevicePlanState*>(&s), &ids, &n_ids, &max_fills, &expires_after, &evict_last_forward};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&plan_prefetch_kernel<0, Policy>), dim3(1), dim3(32), args, 0,
                          stream);
}

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
