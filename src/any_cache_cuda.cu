// The compiled mode of the run-time-selected cache on CudaRuntime (docs/any_cache.md, "Compiled
// mode"): this file instantiates make_expert_cache<CudaRuntime> once (every provider, staging
// "gather" and the device planner's CUDA executor included). Add it to ONE target of the program
// (with nvcc, C++20) and compile every translation unit that includes expert_cache/any/any_cache_cuda.cuh
// with EXPERT_CACHE_SEPARATE_COMPILATION defined. Meson: dependency('expert_cache_any_cuda'), which
// also brings the SimRuntime unit (src/any_cache_sim.cpp).
#define EXPERT_CACHE_ANY_CACHE_INSTANTIATION 1  // the full CUDA tier (any/any_cache_cuda.cuh)
#include "expert_cache/any/any_cache_cuda.cuh"

namespace expert_cache::inline v0 {

EXPERT_CACHE_ANY_CACHE_INSTANTIATIONS(, CudaRuntime);

}  // namespace expert_cache::inline v0
