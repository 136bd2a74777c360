// The compiled mode of the run-time-selected cache on SimRuntime (docs/any_cache.md, "Compiled
// mode"): this file instantiates make_expert_cache<SimRuntime> and the
// cache's non-virtual calls (detail::any_call_*) once. Add it to ONE target of the
// program and compile every translation unit that includes expert_cache/any_cache.hpp with
// EXPERT_CACHE_SEPARATE_COMPILATION defined: those then only declare the instantiation
// (extern template) and link to this one. Meson: dependency('expert_cache_any'); CMake: the
// expert_cache::any_cache target plus this file (cmake/expert_cacheConfig.cmake.in).
#include "expert_cache/any_cache.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

namespace expert_cache::inline v0 {

template Result<AnyExpertCache<SimRuntime>> make_expert_cache<SimRuntime>(SimRuntime& rt, const AnyCacheConfig& config);
template Result<ForwardView> detail::any_call_prepare_unique<SimRuntime>(detail::AnyCacheBase<SimRuntime>&, bool,
                                                                  std::span<const std::int32_t>, SimRuntime::Stream) noexcept;
template Result<ForwardView> detail::any_call_prepare_group<SimRuntime>(detail::AnyCacheBase<SimRuntime>&, bool, std::int32_t,
                                                                 SimRuntime::Stream) noexcept;
template Result<WideSummary> detail::any_call_prepare_wide<SimRuntime>(detail::AnyCacheBase<SimRuntime>&, bool,
                                                                std::span<const std::int32_t>, SimRuntime::Stream,
                                                                detail::WideConsumerRef, WideOptions) noexcept;
template Result<PrefetchView> detail::any_call_prefetch<SimRuntime>(detail::AnyCacheBase<SimRuntime>&, bool,
                                                             std::span<const std::int32_t>, SimRuntime::Stream,
                                                             PrefetchOptions) noexcept;
template Result<PrefetchView> detail::any_call_prefetch_device<SimRuntime>(detail::AnyCacheBase<SimRuntime>&, bool,
                                                                    const std::int32_t*, std::int32_t, SimRuntime::Stream,
                                                                    PrefetchOptions) noexcept;

}  // namespace expert_cache::inline v0
