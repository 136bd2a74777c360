#pragma once
/// Programmatic dependent launch from inside a kernel (sm_90), shared by the plan and consumer kernels.
// Programmatic dependent launch (sm_90) from inside a kernel, shared by the planner's and the
// consumer's kernels. launch_dependents lets a dependent grid launched with
// cudaLaunchAttributeProgrammaticStreamSerialization be scheduled once every block of this grid
// has triggered (or exited); it orders no memory. wait blocks until the preceding grid completed
// and its writes are visible. Both are no-ops below sm_90 and for a dependent launched without
// the attribute (plain stream order then holds).
#if !defined(__CUDACC__)
#error "expert_cache/kernels/griddep.cuh needs nvcc"
#endif

#include "expert_cache/base/config.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS::detail {

__device__ __forceinline__ void griddep_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS::detail
