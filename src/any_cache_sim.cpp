// The compiled mode of the run-time-selected cache on SimRuntime (docs/any_cache.md, "Compiled
// mode"): this file instantiates make_expert_cache<SimRuntime> and the
// cache's non-virtual calls (detail::any_call_*) once. Add it to ONE target of the
// program and compile every translation unit that includes expert_cache/any/any_cache.hpp with
// EXPERT_CACHE_SEPARATE_COMPILATION defined: those then only declare the instantiation
// (extern template) and link to this one. Meson: dependency('expert_cache_any'); CMake: the
// expert_cache::any_cache target plus this file (cmake/expert_cacheConfig.cmake.in).
#include "expert_cache/any/any_cache.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

namespace expert_cache::inline v0 {

EXPERT_CACHE_ANY_CACHE_INSTANTIATIONS(, SimRuntime);

}  // namespace expert_cache::inline v0
