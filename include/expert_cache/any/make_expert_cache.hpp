#pragma once
/// make_expert_cache: builds the AnyExpertCache an AnyCacheConfig names, every name checked
/// before anything is constructed; with the compiled mode's instantiation list.
// Compiled mode (docs/any_cache.md): with EXPERT_CACHE_SEPARATE_COMPILATION defined, the
// SimRuntime factory (and, in any/any_cache_cuda.cuh, the CudaRuntime one) is only declared here and
// instantiated once, in src/any_cache_sim.cpp (any_cache_cuda.cu).
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <string_view>
#include <utility>

#include "expert_cache/any/any_expert_cache.hpp"
#include "expert_cache/any/cache_models.hpp"
#include "expert_cache/any/config.hpp"
#include "expert_cache/any/erased_storage_policy.hpp"
#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/cache/options.hpp"
#include "expert_cache/device_cache/device_cache.hpp"
#include "expert_cache/eviction/any_policy.hpp"
#include "expert_cache/layout/explicit.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/runtime/link_profile.hpp"

namespace expert_cache::inline v0 {

namespace detail {

// An exception from a static cache's constructor as the factory's Status (same code; the
// message without the "code: " prefix Error adds).
[[gnu::cold]] inline Status status_of(const Error& e) noexcept {
  std::string_view m = e.what();
  const std::string_view code = to_string(e.code());
  if (m.size() > code.size() + 2 && m.substr(0, code.size()) == code && m.substr(code.size(), 2) == ": ") {
    m.remove_prefix(code.size() + 2);
  }
  return Status(e.code(), m);
}

// The device's link profile, for the device provider's default storage (device_default_storage) when
// automatic picks the engine and the config holds no profile: none where the runtime cannot measure one
// (SimRuntime); any/any_cache_cuda.cuh gives CudaRuntime's (measured once per process and device, the profile
// the executor's automatic then uses too).
template <class Runtime>
struct AnyLinkProfileSource {
  static std::optional<LinkProfile> measure(std::uint64_t /*expert_bytes*/) noexcept { return std::nullopt; }
};

}  // namespace detail

/// Builds the cache the config names. Every name is checked before anything is constructed;
/// construction failures (sizes, capacity, allocation) come back as the static type's error, never
/// as an exception. Writes one line to config.options.log (provider, every choice, byte sizes) when
/// a sink is given.
/// Cold: it runs once per cache, so the compiler optimises it (and what only it calls: the
/// caches' constructors) for size.
/// @param rt      the runtime that allocates memory and enqueues every call's work; it must outlive the cache
/// @param config  provider, policy, staging and storage names ("" = the provider's default), layout,
///                CacheOptions and the device provider's settings (AnyCacheConfig); read during the call only
/// @return the cache; or invalid_argument for an unknown provider, policy, staging or storage name, an
///         offline-only policy (belady, opt), staging gather without the CUDA tier, a device-provider
///         combination it cannot run (staging other than inline, a policy other than lru on a storage other
///         than tensor_major, max_ids <= 0, a stats callback), overlap or lookahead with a host provider;
///         not_supported for overlap on a runtime whose erased executor lacks it (SimRuntime), and for the
///         device provider on a
///         runtime without a plan executor or a staging the runtime cannot run; the layout's validation error;
///         AnyPolicy::make's error; the static cache's error for an impossible configuration
///         (invalid_capacity, invalid_argument, the runtime's error for an allocation); runtime_failure when
///         the host runs out of memory
template <allocating_runtime Runtime>
Result<AnyExpertCache<Runtime>> make_expert_cache(Runtime& rt, const AnyCacheConfig& config) {
  using Base = detail::AnyCacheBase<Runtime>;
  using Stagings = typename AnyCacheStagings<Runtime>::type;
  constexpr auto policy_names = AnyPolicy::names;
  constexpr auto staging_names = detail::names_of(Stagings{});
  constexpr auto storage_names = detail::names_of(detail::AnyStorages{});
  detail::AnyCacheChoices chosen;
  if (Status s = detail::check_any_cache_config(config, staging_names, has_device_plan_executor<Runtime>, chosen); !s) {
    return s;
  }
  // The device provider's default storage follows the engines automatic picks on this device's link.
  if (chosen.device && config.storage.empty() && config.fill_engine == FillEngine::automatic && !config.link_profile) {
    if (std::optional<LinkProfile> measured =
            detail::AnyLinkProfileSource<Runtime>::measure(total_bytes_per_expert(config.layout.tensors))) {
      AnyCacheConfig profiled = config;
      profiled.link_profile = std::move(measured);
      detail::AnyCacheChoices with_profile;
      if (Status s =
              detail::check_any_cache_config(profiled, staging_names, has_device_plan_executor<Runtime>, with_profile);
          !s) {
        return s;
      }
      // Only the storage: the other names may view the copy's strings (a default storage is a literal).
      chosen.storage = with_profile.storage;
      chosen.storage_name = with_profile.storage_name;
    }
  }
  const bool device = chosen.device;
  const std::string_view policy_name = chosen.policy_name;
  if (device && config.overlap && !detail::any_device_overlap<Runtime>) {
    return Status(ErrorCode::not_supported,
                  "overlap: this runtime's run-time-selected device executor has no overlapped fill (a simulated "
                  "runtime; DeviceExpertCache with options.overlap models it)");
  }

  // ---- construction ----
  CacheOptions inner = config.options;
  inner.log = {};  // the line below names the provider and the layout
  const ExplicitLayout layout{config.layout.tensors};
  using Made = Result<std::unique_ptr<Base>>;
  // Constructed, never assigned: nvcc flags an assignment of a [[nodiscard]] class.
  const auto build = [&]() -> Made {
    try {
      detail::AnyChoice choice;
      choice.storage = chosen.storage;
      if (device) {
        if constexpr (has_device_plan_executor<Runtime>) {
          DeviceCacheOptions o;
          o.num_experts = inner.num_experts;
          o.capacity = inner.capacity;
          o.max_ids = config.max_ids;
          o.fused_plan_fill = config.fused_plan_fill;
          o.fill_engine = config.fill_engine;
          o.link_profile = config.link_profile;
          o.overlap = config.overlap;
          o.lookahead = config.lookahead;
          o.stream_slots = inner.stream_slots;
          o.max_wide_ids = inner.max_wide_ids;
          o.label = inner.label;
          o.memory = inner.memory;
          choice.device_policy = chosen.device_policy;
          const detail::AnyChoiceScope scope(choice);
          using Model = detail::DeviceCacheModel<Runtime, detail::AnyDeviceCache<Runtime>>;
          return std::unique_ptr<Base>(std::make_unique<Model>(rt, o, layout));
        } else {
          return Status(ErrorCode::internal, "device provider without executor");
        }
      }
      const CacheShape shape =
          ForwardPlanner<AnyPolicy>::validated(CacheShape{inner.num_experts, inner.capacity}, inner.top_k);
      Result<AnyPolicy> made_policy = AnyPolicy::make(policy_name, shape, config.pool);
      if (!made_policy.ok()) return made_policy.status();
      const Status runnable = detail::visit_type<Status>(Stagings{}, chosen.staging, [&]<class G>() -> Status {
        if constexpr (staging_policy_for<G, Runtime, detail::AnyArrangementStorage>) {
          return {};
        } else {
          return Status::format(ErrorCode::not_supported, "staging '%.*s' cannot run on this runtime",
                                static_cast<int>(G::name.size()), G::name.data());
        }
      });
      if (!runnable) return runnable;
      const detail::AnyChoiceScope scope(choice);
      using Model = detail::HostCacheModel<Runtime, detail::AnyHostCache<Runtime>>;
      return std::unique_ptr<Base>(std::make_unique<Model>(rt, inner, layout, std::move(made_policy.value()),
                                                           detail::AnyStagingFor<Runtime>(chosen.staging)));
    } catch (const Error& e) {
      return detail::status_of(e);
    } catch (const std::bad_alloc&) {
      return Status(ErrorCode::runtime_failure, "make_expert_cache: out of host memory");
    } catch (const std::exception& e) {
      return Status(ErrorCode::runtime_failure, e.what());
    }
  };
  Made made = build();
  if (!made.ok()) return made.status();

  AnyExpertCache<Runtime> cache;
  cache.impl_ = std::move(made.value());
  cache.device_ = device;
  cache.options_ = config.options;
  cache.provider_ = any_cache_providers[chosen.provider];
  cache.policy_ = policy_names[chosen.policy];
  cache.staging_ = staging_names[chosen.staging];
  cache.storage_ = storage_names[chosen.storage];
  cache.layout_ = config.layout.name;
  if (config.options.log) {
    const CacheStats s = cache.stats();
    config.options.log(detail::join({config.options.label, ": ", cache.provider_, " provider, ", cache.policy_, "/",
                                     cache.staging_, "/", cache.storage_, "/", cache.layout_, ", ",
                                     detail::DecimalText(config.options.capacity), " of ",
                                     detail::DecimalText(config.options.num_experts), " experts, slot bytes ",
                                     detail::DecimalText(s.slot_bytes), ", host bytes ",
                                     detail::DecimalText(s.host_bytes)}));
  }
  return Result<AnyExpertCache<Runtime>>(std::move(cache));
}

}  // namespace expert_cache::inline v0

// The compiled mode's instantiations for one runtime R, listed once: declared with
// EXPERT_CACHE_ANY_CACHE_INSTANTIATIONS(extern, R) where a translation unit only links to them,
// defined with EXPERT_CACHE_ANY_CACHE_INSTANTIATIONS(, R) in the compiled units (src/).
#define EXPERT_CACHE_ANY_CACHE_INSTANTIATIONS(KEYWORD, R)                                                             \
  KEYWORD template Result<AnyExpertCache<R>> make_expert_cache<R>(R& rt, const AnyCacheConfig& config);               \
  KEYWORD template Result<ForwardView> detail::any_call_prepare_unique<R>(detail::AnyCacheBase<R>&, bool,              \
                                                                          std::span<const std::int32_t>,              \
                                                                          typename R::Stream) noexcept;               \
  KEYWORD template Result<ForwardView> detail::any_call_prepare_group<R>(detail::AnyCacheBase<R>&, bool, std::int32_t, \
                                                                         typename R::Stream) noexcept;                \
  KEYWORD template Result<WideSummary> detail::any_call_prepare_wide<R>(                                              \
      detail::AnyCacheBase<R>&, bool, std::span<const std::int32_t>, typename R::Stream, detail::WideConsumerRef,     \
      WideOptions) noexcept;                                                                                          \
  KEYWORD template Result<PrefetchView> detail::any_call_prefetch<R>(detail::AnyCacheBase<R>&, bool,                  \
                                                                     std::span<const std::int32_t>,                  \
                                                                     typename R::Stream, PrefetchOptions) noexcept;   \
  KEYWORD template Result<PrefetchView> detail::any_call_prefetch_device<R>(                                          \
      detail::AnyCacheBase<R>&, bool, const std::int32_t*, std::int32_t, typename R::Stream, PrefetchOptions) noexcept

// Compiled mode (docs/any_cache.md): the SimRuntime factory and the non-virtual calls are
// instantiated once, in src/any_cache_sim.cpp, not in every translation unit
// that calls them.
#if defined(EXPERT_CACHE_SEPARATE_COMPILATION)
#include "expert_cache/runtime/sim_runtime.hpp"

namespace expert_cache::inline v0 {
EXPERT_CACHE_ANY_CACHE_INSTANTIATIONS(extern, SimRuntime);
}  // namespace expert_cache::inline v0
#endif
