#pragma once
/// The run-time choice of AnyExpertCache: what a config holds (AnyCacheConfig, AnyLayout), the
/// names it may use (providers, storages, device policies, the runtime's staging list) and their
/// check before anything is built (detail::check_any_cache_config).
// Names (docs/any_cache.md; any/any_cache.hpp lists them with their defaults):
//   provider  row | cached | device
//   policy    AnyPolicy::names (belady: offline only, refused); device provider: lru lfru crf
//   staging   AnyCacheStagings<Runtime> (any/any_cache_cuda.cuh adds gather for CudaRuntime)
//   storage   tensor_major expert_major expert_major_host
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/cache/options.hpp"
#include "expert_cache/device_cache/device_cache.hpp"
#include "expert_cache/eviction/any_policy.hpp"
#include "expert_cache/eviction/pool_layout.hpp"
#include "expert_cache/planning/device_plan.hpp"
#include "expert_cache/runtime/link_profile.hpp"
#include "expert_cache/staging/copy_staging.hpp"
#include "expert_cache/storage/slot_storage.hpp"

namespace expert_cache::inline v0 {

/// A layout's name and sizes, taken from any expert_layout (its validate() result is kept and
/// reported by the factory, which never throws for it).
struct AnyLayout {
  std::string name = "explicit";  ///< the layout's name (AnyExpertCache::layout())
  ExpertTensorBytes tensors{};    ///< the per-expert tensors and their sizes
  Status validation{};            ///< the layout's validate() result; make_expert_cache refuses a failed one

  /// @param layout  any expert_layout
  /// @return its name, tensors and validate() result
  template <expert_layout L>
  [[nodiscard]] static AnyLayout of(const L& layout) {
    return AnyLayout{std::string(L::name), layout.tensors(), layout.validate()};
  }
  /// @param tensors  the per-expert tensors and their sizes
  /// @return a layout named "explicit" with those tensors, not validated (validation ok)
  [[nodiscard]] static AnyLayout explicit_bytes(const ExpertTensorBytes& tensors) {
    return AnyLayout{"explicit", tensors, Status()};
  }
};

/// What make_expert_cache builds: the names of the provider and its policies, the layout and the options.
struct AnyCacheConfig {
  std::string provider = "row";  ///< row | cached | device
  /// Eviction policy: AnyPolicy::names (device provider: lru, lfru, crf); "" = the provider's default (row: lru,
  /// cached: lfru, device: lru).
  std::string policy;
  /// Staging policy: the runtime's AnyCacheStagings list (device provider: inline only); "" = the provider's
  /// default (row, cached: copy_stream; device: inline).
  std::string staging;
  /// Storage: tensor_major, expert_major or expert_major_host; "" = the provider's default (row: tensor_major;
  /// cached: expert_major; device: device_default_storage below).
  std::string storage;
  AnyLayout layout;  ///< the per-expert tensors (make_expert_cache refuses one whose validation failed)
  /// num_experts, capacity, top_k, staging_ring, label, log (one line at construction, naming
  /// the provider and every choice), stats_callback/stats_every (host providers), memory (the
  /// caller's host spans / host pool and slot workspace, any provider; kept alive by the caller),
  /// stream_slots and max_wide_ids (any provider).
  CacheOptions options;
  PoolLayout pool{};           ///< lrfu, layershare: experts_per_layer of a pool shared by layers
  std::int32_t max_ids = 0;    ///< device: the largest prepare() (tokens * top_k); required > 0
  bool fused_plan_fill = true; ///< device on CUDA: plan + first fill in one kernel
  /// device: the engine that moves fills (DeviceCacheOptions::fill_engine).
  FillEngine fill_engine = FillEngine::automatic;
  /// device: a stored link profile for automatic (DeviceCacheOptions::link_profile).
  std::optional<LinkProfile> link_profile;
  /// device: overlapped fills (DeviceCacheOptions::overlap): the consumer computes resident experts at once and
  /// waits per slot, through AnyExpertCache::readiness(), for each missing one. Host providers refuse it.
  bool overlap = false;
  /// device: the engine looks ahead with prefetch (DeviceCacheOptions::lookahead): with overlap and room in the
  /// pool, automatic then puts the speculative copies on the copy engine (fill_use_of,
  /// LinkProfile::choose_engines). Host providers refuse it.
  bool lookahead = false;
};

/// The device provider's storage when AnyCacheConfig::storage is "": expert_major where the copy proxy moves
/// fills, with policy lru and no caller memory; tensor_major otherwise. The proxy moves fills with fill_engine
/// copy_engine, and with automatic where the link profile puts fills on the copy engine: every fill on a host
/// whose SM loads are slow, the speculative copies of an overlapped lookahead on one whose SM loads are fast
/// (LinkProfile::choose_engines). Without a profile in the config, automatic counts as the copy engine for the
/// overlapped lookahead only (make_expert_cache on CUDA measures the device's profile first). With
/// CUDA_DEVICE_MAX_CONNECTIONS=1 automatic moves no fill through the proxy (cuda_work_queues_from_env). The proxy's host
/// time per fill grows with the copies of a fill, six for a tensor-major NVFP4 expert and one for an
/// expert-major one, and decides when a copied fill starts; SM-load fills of tensor-major slots were the faster
/// ones without lookahead (docs/cuda_backend.md, "Storage and the proxy").
/// @param config the config; its provider is taken to be "device"
/// @param policy_name the resolved policy name
[[nodiscard]] inline std::string_view device_default_storage(const AnyCacheConfig& config,
                                                             std::string_view policy_name) noexcept {
  const StorageMemory& m = config.options.memory;
  const bool caller_memory = m.caller_host_tensors() || !m.host_pool.empty() || !m.slot_workspace.empty();
  const FillUse use = fill_use_of(config.lookahead, config.overlap, config.options.capacity, config.max_ids);
  bool proxy_moves_fills = config.fill_engine == FillEngine::copy_engine;
  if (config.fill_engine == FillEngine::automatic) {
    const int work_queues = cuda_work_queues_from_env();  // one: automatic keeps every fill on SM loads
    if (config.link_profile) {
      const LinkProfile::EngineChoice choice = config.link_profile->choose_engines(use, nullptr, work_queues);
      proxy_moves_fills = choice.forwards == FillEngine::copy_engine || choice.speculate_on_copy_engine;
    } else {
      proxy_moves_fills = use == FillUse::overlapped_lookahead && work_queues != 1;
    }
  }
  return proxy_moves_fills && policy_name == "lru" && !caller_memory ? "expert_major" : "tensor_major";
}

/// The provider names AnyCacheConfig::provider accepts, in index order.
inline constexpr std::array<std::string_view, 3> any_cache_providers = {"row", "cached", "device"};

namespace detail {

template <class... Ts>
struct TypeList {
  static constexpr std::size_t size = sizeof...(Ts);
};

template <template <class> class S>
struct StorageTag {
  template <class R>
  using type = S<R>;
  static constexpr std::string_view name = S<RuntimeArchetype>::name;
};

using AnyStorages =
    TypeList<StorageTag<TensorMajorStorage>, StorageTag<ExpertMajorStorage>, StorageTag<ExpertMajorHostStorage>>;

// The device provider's policies, by P::name.
using AnyDevicePolicies = TypeList<DeviceLru, DeviceLfru, DeviceCrf>;
inline constexpr std::array<std::string_view, 3> any_device_policy_names = {DeviceLru::name, DeviceLfru::name,
                                                                            DeviceCrf::name};

}  // namespace detail

// The staging policies make_expert_cache<Runtime> offers. any/any_cache_cuda.cuh specialises it
// for CudaRuntime (adds Gather); a policy a runtime cannot run is refused with not_supported.
template <class Runtime>
struct AnyCacheStagings {
  using type = detail::TypeList<Inline, CopyStream, Batched>;
};

// The runtime has a device-plan executor (SimRuntime here; CudaRuntime once
// device_cache/cuda_executor.cuh is included, which any/any_cache_cuda.cuh does).
template <class Runtime>
concept has_device_plan_executor = requires { typename DevicePlanExecutorFor<Runtime>::type; };

namespace detail {

template <class... Ts>
constexpr auto names_of(TypeList<Ts...>) noexcept {
  return std::array<std::string_view, sizeof...(Ts)>{Ts::name...};
}

// "a, b, c" into a fixed buffer (cold path; messages stay allocation-free Status).
struct NameListText {
  char text[160] = {};
  explicit NameListText(std::span<const std::string_view> names) noexcept {
    std::size_t at = 0;
    for (std::size_t i = 0; i < names.size(); ++i) {
      const std::string_view sep = i == 0 ? std::string_view() : std::string_view(", ");
      for (std::string_view part : {sep, names[i]}) {
        for (char c : part) {
          if (at + 1 < sizeof text) text[at++] = c;
        }
      }
    }
    text[at] = '\0';
  }
};

constexpr std::optional<std::size_t> index_of(std::span<const std::string_view> names, std::string_view name) noexcept {
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return i;
  }
  return std::nullopt;
}

// Calls f.template operator()<T>() for the i-th type of the list (i < size).
template <class R, class... Ts, class F>
R visit_type(TypeList<Ts...>, std::size_t i, F&& f) {
  std::optional<R> out;
  std::size_t k = 0;
  ((k++ == i ? (void)out.emplace(f.template operator()<Ts>()) : void()), ...);
  return std::move(*out);
}

// What a config chose: each name's index in the list make_expert_cache offers, and the names.
struct AnyCacheChoices {
  std::size_t provider = 0, policy = 0, staging = 0, storage = 0;
  std::size_t device_policy = 0;  // device provider: index into any_device_policy_names
  bool device = false;
  std::string_view policy_name, staging_name, storage_name;
};

// Every name, every combination and the device provider's sizes, checked before anything is
// constructed. Not a template (the runtime only changes the staging list and whether it has a
// device-plan executor), so a build compiles it once.
[[gnu::cold]]
inline Status check_any_cache_config(const AnyCacheConfig& config, std::span<const std::string_view> staging_names,
                                     bool has_device_executor, AnyCacheChoices& out) noexcept {
  constexpr auto policy_names = AnyPolicy::names;
  constexpr auto storage_names = names_of(AnyStorages{});
  const auto clip = [](const std::string& s) { return static_cast<int>(std::min<std::size_t>(s.size(), 40)); };

  const std::optional<std::size_t> provider = index_of(any_cache_providers, config.provider);
  if (!provider) {
    return Status::format(ErrorCode::invalid_argument, "unknown provider '%.*s' (valid: %s)", clip(config.provider),
                          config.provider.c_str(), NameListText(any_cache_providers).text);
  }
  const bool device = *provider == 2;
  static constexpr std::array<std::string_view, 3> default_policy = {"lru", "lfru", "lru"};
  static constexpr std::array<std::string_view, 3> default_staging = {"copy_stream", "copy_stream", "inline"};
  static constexpr std::array<std::string_view, 2> default_host_storage = {"tensor_major", "expert_major"};
  const std::string_view policy_name = config.policy.empty() ? default_policy[*provider] : std::string_view(config.policy);
  const std::string_view staging_name = config.staging.empty() ? default_staging[*provider] : std::string_view(config.staging);
  const std::string_view storage_name =
      !config.storage.empty() ? std::string_view(config.storage)
                              : (device ? device_default_storage(config, policy_name) : default_host_storage[*provider]);

  // The device provider plans with a device policy (DeviceExpertCache's Policy, one type each).
  constexpr auto device_policy_names = any_device_policy_names;
  const std::optional<std::size_t> device_policy = index_of(device_policy_names, policy_name);
  if (device) {
    if (!device_policy) {
      return Status::format(ErrorCode::invalid_argument,
                            "provider 'device' plans on the device with policy lru, lfru or crf (got '%.*s'; "
                            "valid: %s)",
                            static_cast<int>(std::min<std::size_t>(policy_name.size(), 40)), policy_name.data(),
                            NameListText(device_policy_names).text);
    }
  }
  const std::optional<std::size_t> policy = index_of(policy_names, policy_name);
  if (!policy) {
    if (policy_name == "belady" || policy_name == "opt") {
      return Status::format(ErrorCode::invalid_argument,
                            "policy '%.*s' is offline-only (it needs the future trace: use ExpertCache with "
                            "make_policy<Belady>, or the replay tool); online policies: %s",
                            static_cast<int>(policy_name.size()), policy_name.data(), NameListText(policy_names).text);
    }
    return Status::format(ErrorCode::invalid_argument, "unknown eviction policy '%.*s' (valid: %s)",
                          static_cast<int>(std::min<std::size_t>(policy_name.size(), 40)), policy_name.data(),
                          NameListText(policy_names).text);
  }
  const std::optional<std::size_t> staging = index_of(staging_names, staging_name);
  if (!staging) {
    if (staging_name == "gather") {
      return Status::format(ErrorCode::invalid_argument,
                            "staging 'gather' needs the CUDA tier (CudaRuntime, include expert_cache/any/any_cache_cuda.cuh "
                            "in a .cu); valid with this runtime: %s",
                            NameListText(staging_names).text);
    }
    return Status::format(ErrorCode::invalid_argument, "unknown staging policy '%.*s' (valid: %s)",
                          static_cast<int>(std::min<std::size_t>(staging_name.size(), 40)), staging_name.data(),
                          NameListText(staging_names).text);
  }
  const std::optional<std::size_t> storage = index_of(storage_names, storage_name);
  if (!storage) {
    return Status::format(ErrorCode::invalid_argument, "unknown storage '%.*s' (valid: %s)",
                          static_cast<int>(std::min<std::size_t>(storage_name.size(), 40)), storage_name.data(),
                          NameListText(storage_names).text);
  }
  if (!device && (config.overlap || config.lookahead)) {
    return Status::format(ErrorCode::invalid_argument,
                          "%s is for provider 'device' (its fills and the consumer's per-slot waits); provider "
                          "'%.*s' copies on its copy stream, which its prepare() orders before the consumer",
                          config.overlap ? "overlap" : "lookahead", clip(config.provider), config.provider.c_str());
  }
  if (device) {
    if (staging_name != "inline") {
      return Status::format(ErrorCode::invalid_argument,
                            "provider 'device' fills inline (got staging '%.*s'; valid: staging inline, policy %s, "
                            "storage %s)",
                            static_cast<int>(staging_name.size()), staging_name.data(),
                            NameListText(device_policy_names).text, NameListText(storage_names).text);
    }
    if (policy_name != "lru" && storage_name != "tensor_major") {
      return Status::format(ErrorCode::invalid_argument,
                            "provider 'device' plans with policy '%.*s' on storage tensor_major only (got '%.*s'; "
                            "policy lru takes every storage: %s)",
                            static_cast<int>(policy_name.size()), policy_name.data(),
                            static_cast<int>(std::min<std::size_t>(storage_name.size(), 40)), storage_name.data(),
                            NameListText(storage_names).text);
    }
    if (!has_device_executor) {
      return Status(ErrorCode::not_supported,
                    "provider 'device' has no plan executor for this runtime (CudaRuntime: include "
                    "expert_cache/any/any_cache_cuda.cuh, which brings device_cache/cuda_executor.cuh)");
    }
    if (config.max_ids <= 0) {
      return Status::format(ErrorCode::invalid_argument, "provider 'device' needs max_ids > 0 (tokens * top_k), got %d",
                            config.max_ids);
    }
    if (config.options.stats_callback) {
      return Status(ErrorCode::invalid_argument, "provider 'device' has no stats callback (read stats())");
    }
  }
  if (!config.layout.validation) {
    return config.layout.validation.with_context("layout %.*s", clip(config.layout.name), config.layout.name.c_str());
  }
  out.provider = *provider;
  out.policy = *policy;
  out.staging = *staging;
  out.storage = *storage;
  out.device_policy = device_policy.value_or(0);
  out.device = device;
  out.policy_name = policy_name;
  out.staging_name = staging_name;
  out.storage_name = storage_name;
  return {};
}

}  // namespace detail

}  // namespace expert_cache::inline v0
