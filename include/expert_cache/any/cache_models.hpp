#pragma once
/// The erased interface of AnyExpertCache (detail::AnyCacheBase, one vtable per provider kind),
/// its two models over the one host-planned and the one device-planned cache type, and the
/// calls left out of the vtable (detail::any_call_*).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <utility>

#include "expert_cache/any/config.hpp"
#include "expert_cache/any/erased_storage_policy.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/cache/expert_cache.hpp"
#include "expert_cache/cache/options.hpp"
#include "expert_cache/cache/stats.hpp"
#include "expert_cache/cache/views.hpp"
#include "expert_cache/cache/wide.hpp"
#include "expert_cache/device_cache/device_cache.hpp"
#include "expert_cache/eviction/any_policy.hpp"
#include "expert_cache/layout/explicit.hpp"
#include "expert_cache/planning/device_plan/readiness.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/staging/any_staging.hpp"
#include "expert_cache/storage/copy_region.hpp"
#include "expert_cache/storage/slot_storage.hpp"

namespace expert_cache::inline v0 {

namespace detail {

// A non-owning reference to prepare_wide's consumer: one indirect call per round, no allocation.
struct WideConsumerRef {
  void* object = nullptr;
  Status (*call)(void*, const WideRound&) = nullptr;
  Status operator()(const WideRound& round) const { return call(object, round); }
};

// The erased interface: one vtable per provider kind. It holds what every program calls
// (prepare, stats, the storage's accessors). The calls a program may never make (prepare_unique,
// prepare_group, prepare_wide, prefetch, prefetch_device) are the models' plain members, reached
// through any_call_* below: a virtual one would be compiled with the vtable by every program that
// makes a cache, whereas these are compiled only where the program calls them, as a static
// cache's members are.
template <class Runtime>
class AnyCacheBase {
 public:
  using Stream = typename Runtime::Stream;
  virtual ~AnyCacheBase() = default;
  virtual Result<ForwardView> prepare(std::span<const std::int32_t> ids, Stream stream) noexcept = 0;
  virtual Status invalidate(std::int32_t expert, Stream stream) noexcept = 0;
  [[nodiscard]] virtual CacheStats stats() const noexcept = 0;
  [[nodiscard]] virtual const ExpertTensorBytes& tensors() const noexcept = 0;
  [[nodiscard]] virtual std::byte* host_tensor(std::size_t t, std::int32_t expert) const noexcept = 0;
  [[nodiscard]] virtual SlotTensor slot_tensor(std::size_t t) const noexcept = 0;
  [[nodiscard]] virtual const CopyRegions& copy_regions() const noexcept = 0;
  [[nodiscard]] virtual std::size_t host_bytes() const noexcept = 0;
  [[nodiscard]] virtual std::size_t storage_slot_bytes() const noexcept = 0;
  [[nodiscard]] virtual std::span<const std::int32_t> resident_map_host() const noexcept = 0;
  [[nodiscard]] virtual std::span<const std::int32_t> forward_map_host() const noexcept = 0;
  [[nodiscard]] virtual const std::int32_t* resident_map_device() const noexcept = 0;
  [[nodiscard]] virtual const std::int32_t* forward_map_device() const noexcept = 0;
  [[nodiscard]] virtual const ForwardPlan* last_plan() const noexcept = 0;
  [[nodiscard]] virtual std::optional<Stream> copy_stream() const noexcept = 0;
  [[nodiscard]] virtual std::optional<Stream> owner() const noexcept = 0;
  virtual Status set_stats_callback(std::function<void(const CacheStats&)> callback, std::uint64_t every) = 0;
  [[nodiscard]] virtual std::uint32_t take_errors() noexcept = 0;
  [[nodiscard]] virtual std::optional<FillEngine> fill_engine() const noexcept = 0;
  [[nodiscard]] virtual SlotReadiness readiness() const noexcept = 0;
};

// Shared by both models: the storage accessors and what both caches spell alike (invalidate).
template <class Runtime, class Cache>
class AnyCacheModelBase : public AnyCacheBase<Runtime> {
 public:
  using Stream = typename Runtime::Stream;
  template <class... Args>
  explicit AnyCacheModelBase(Args&&... args) : cache_(std::forward<Args>(args)...) {}
  [[nodiscard]] CacheStats stats() const noexcept final { return cache_.stats(); }
  [[nodiscard]] const ExpertTensorBytes& tensors() const noexcept final { return cache_.storage().tensors(); }
  [[nodiscard]] std::byte* host_tensor(std::size_t t, std::int32_t expert) const noexcept final {
    return cache_.storage().host_tensor(t, expert);
  }
  [[nodiscard]] SlotTensor slot_tensor(std::size_t t) const noexcept final { return cache_.storage().slot_tensor(t); }
  [[nodiscard]] const CopyRegions& copy_regions() const noexcept final { return cache_.storage().copy_regions(); }
  [[nodiscard]] std::size_t host_bytes() const noexcept final { return cache_.storage().host_bytes(); }
  [[nodiscard]] std::size_t storage_slot_bytes() const noexcept final { return cache_.storage().slot_bytes(); }
  [[nodiscard]] const std::int32_t* resident_map_device() const noexcept final { return cache_.resident_map_device(); }
  [[nodiscard]] const std::int32_t* forward_map_device() const noexcept final { return cache_.forward_map_device(); }
  [[nodiscard]] std::optional<Stream> owner() const noexcept final { return cache_.owner(); }
  Status invalidate(std::int32_t expert, Stream stream) noexcept final { return cache_.invalidate(expert, stream); }

 protected:
  Cache cache_;
};

// A host-planned ExpertCache (providers row and cached).
template <class Runtime, class Cache>
class HostCacheModel final : public AnyCacheModelBase<Runtime, Cache> {
  using Base = AnyCacheModelBase<Runtime, Cache>;

 public:
  using Stream = typename Runtime::Stream;
  using Base::Base;
  Result<ForwardView> prepare(std::span<const std::int32_t> ids, Stream stream) noexcept final {
    return this->cache_.prepare(ids, stream);
  }
  Result<ForwardView> prepare_unique(std::span<const std::int32_t> ids, Stream stream) noexcept {
    return this->cache_.prepare_unique(ids, stream);
  }
  Result<ForwardView> prepare_group(std::int32_t, Stream) noexcept {
    return Status(ErrorCode::not_supported,
                  "prepare_group is the device provider's overflow round; host providers split with "
                  "plan_expert_groups / plan_token_chunks and prepare_unique");
  }
  Result<WideSummary> prepare_wide(std::span<const std::int32_t> ids, Stream stream, WideConsumerRef consumer,
                                   WideOptions options) noexcept {
    return this->cache_.prepare_wide(ids, stream, consumer, options);
  }
  Result<PrefetchView> prefetch(std::span<const std::int32_t> ids, Stream stream,
                                PrefetchOptions options) noexcept {
    return this->cache_.prefetch(ids, stream, options);
  }
  Result<PrefetchView> prefetch_device(const std::int32_t*, std::int32_t, Stream, PrefetchOptions) noexcept {
    return Status(ErrorCode::not_supported,
                  "prefetch_device: a host-planned provider plans host ids; read the predicted ids back and call "
                  "prefetch, or use the device provider");
  }
  [[nodiscard]] std::span<const std::int32_t> resident_map_host() const noexcept final {
    return this->cache_.resident_map_host();
  }
  [[nodiscard]] std::span<const std::int32_t> forward_map_host() const noexcept final {
    return this->cache_.forward_map_host();
  }
  [[nodiscard]] const ForwardPlan* last_plan() const noexcept final { return &this->cache_.last_plan(); }
  [[nodiscard]] std::optional<Stream> copy_stream() const noexcept final { return this->cache_.copy_stream(); }
  Status set_stats_callback(std::function<void(const CacheStats&)> callback, std::uint64_t every) final {
    this->cache_.set_stats_callback(std::move(callback), every);
    return {};
  }
  [[nodiscard]] std::uint32_t take_errors() noexcept final { return 0; }
  [[nodiscard]] std::optional<FillEngine> fill_engine() const noexcept final { return std::nullopt; }
  [[nodiscard]] SlotReadiness readiness() const noexcept final { return {}; }
};

// A DeviceExpertCache (provider device): ids are device memory, no host maps or plans.
template <class Runtime, class Cache>
class DeviceCacheModel final : public AnyCacheModelBase<Runtime, Cache> {
  using Base = AnyCacheModelBase<Runtime, Cache>;

 public:
  using Stream = typename Runtime::Stream;
  using Base::Base;
  Result<ForwardView> prepare(std::span<const std::int32_t> device_ids, Stream stream) noexcept final {
    if (device_ids.size() > static_cast<std::size_t>(INT32_MAX)) {
      return Status::format(ErrorCode::invalid_argument, "prepare of %zu ids (device provider: at most max_ids)",
                            device_ids.size());
    }
    return this->cache_.prepare(device_ids.data(), static_cast<std::int32_t>(device_ids.size()), stream);
  }
  Result<ForwardView> prepare_unique(std::span<const std::int32_t>, Stream) noexcept {
    return Status(ErrorCode::not_supported,
                  "prepare_unique: the device provider plans the router's ids on the device; use prepare and "
                  "prepare_group");
  }
  Result<ForwardView> prepare_group(std::int32_t group, Stream stream) noexcept {
    return this->cache_.prepare_group(group, stream);
  }
  // A wide forward on the device planner. Stream admission on a cache with stream slots:
  // DeviceExpertCache::prepare_wide from these device ids (read back with the resident map, the
  // misses streamed through the stream slots by copies, nothing admitted; eager, not capturable).
  // Otherwise (admit, or no stream slots: fell_back): prepare, then prepare_group
  // 1..max_groups(n) - 1, the consumer after each (round g's view maps group g's experts: ids [g*C, (g+1)*C) of the
  // unique list, which holds the experts resident at the forward's start first, so no group evicts one a later group
  // reads; a group the forward does not have is an empty round). The groups go through the pool (admit: not scan
  // resistant) and are not overlapped (group g + 1 is planned after the consumer of group g was enqueued, on the same
  // stream). The host never sees the ids, so a round's experts/slots spans are empty and the summary counts rounds
  // only; the device counts the forward in stats() (overflows) but, every group being served here, does not flag
  // plan_error_overflow (DeviceForward::in_rounds): a legitimate wide forward leaves the error word clear, while a
  // plain prepare() of the same ids still reports the overflow.
  Result<WideSummary> prepare_wide(std::span<const std::int32_t> device_ids, Stream stream, WideConsumerRef consumer,
                                   WideOptions options) noexcept {
    if (device_ids.size() > static_cast<std::size_t>(INT32_MAX)) {
      return Status::format(ErrorCode::invalid_argument, "prepare_wide of %zu ids (device provider: at most max_ids)",
                            device_ids.size());
    }
    if (options.admission == WideAdmission::stream && this->cache_.options().stream_slots >= 2) {
      return this->cache_.prepare_wide(device_ids.data(), device_ids.size(), stream, consumer, options);
    }
    const auto n = static_cast<std::int32_t>(device_ids.size());
    Result<ForwardView> view = this->cache_.prepare(device_ids.data(), n, stream, DeviceForward::in_rounds);
    if (!view.ok()) return view.status().with_context("prepare_wide");
    const auto rounds = static_cast<std::uint32_t>(std::max<std::int32_t>(1, this->cache_.max_groups(n)));
    WideSummary summary;
    summary.admission = WideAdmission::admit;
    summary.fell_back = options.admission == WideAdmission::stream;
    for (std::uint32_t g = 0; g < rounds; ++g) {
      if (g > 0) {
        view = this->cache_.prepare_group(static_cast<std::int32_t>(g), stream);
        if (!view.ok()) return view.status().with_context("prepare_wide: round %u of %u", g, rounds);
      }
      WideRound round;
      round.view = view.value();
      round.index = g;
      round.rounds = rounds;
      if (Status s = consumer(round); !s) return s.with_context("prepare_wide: round %u of %u", g, rounds);
      ++summary.rounds;
    }
    return summary;
  }
  // Host ids (validated, uploaded, planned on the device), unlike prepare's span.
  Result<PrefetchView> prefetch(std::span<const std::int32_t> ids, Stream stream,
                                PrefetchOptions options) noexcept {
    return this->cache_.prefetch(ids, stream, options);
  }
  Result<PrefetchView> prefetch_device(const std::int32_t* device_ids, std::int32_t n_ids, Stream stream,
                                       PrefetchOptions options) noexcept {
    return this->cache_.prefetch(device_ids, n_ids, stream, options);
  }
  [[nodiscard]] std::span<const std::int32_t> resident_map_host() const noexcept final { return {}; }
  [[nodiscard]] std::span<const std::int32_t> forward_map_host() const noexcept final { return {}; }
  [[nodiscard]] const ForwardPlan* last_plan() const noexcept final { return nullptr; }
  [[nodiscard]] std::optional<Stream> copy_stream() const noexcept final { return std::nullopt; }
  Status set_stats_callback(std::function<void(const CacheStats&)>, std::uint64_t) final {
    return Status(ErrorCode::not_supported, "the device provider has no stats callback (read stats())");
  }
  [[nodiscard]] std::uint32_t take_errors() noexcept final { return this->cache_.take_errors(); }
  [[nodiscard]] std::optional<FillEngine> fill_engine() const noexcept final { return this->cache_.fill_engine(); }
  [[nodiscard]] SlotReadiness readiness() const noexcept final { return this->cache_.readiness(); }
};

// The calls AnyCacheBase leaves out, on the model the provider kind names (defined below,
// after the cache types). Not inline: the compiled mode declares them extern and instantiates
// them once, beside the factory.
template <class Runtime>
Result<ForwardView> any_call_prepare_unique(AnyCacheBase<Runtime>& impl, bool device, std::span<const std::int32_t> ids,
                                            typename Runtime::Stream stream) noexcept;
template <class Runtime>
Result<ForwardView> any_call_prepare_group(AnyCacheBase<Runtime>& impl, bool device, std::int32_t group,
                                           typename Runtime::Stream stream) noexcept;
template <class Runtime>
Result<WideSummary> any_call_prepare_wide(AnyCacheBase<Runtime>& impl, bool device, std::span<const std::int32_t> ids,
                                          typename Runtime::Stream stream, WideConsumerRef consumer,
                                          WideOptions options) noexcept;
template <class Runtime>
Result<PrefetchView> any_call_prefetch(AnyCacheBase<Runtime>& impl, bool device, std::span<const std::int32_t> ids,
                                       typename Runtime::Stream stream, PrefetchOptions options) noexcept;
template <class Runtime>
Result<PrefetchView> any_call_prefetch_device(AnyCacheBase<Runtime>& impl, bool device, const std::int32_t* device_ids,
                                              std::int32_t n_ids, typename Runtime::Stream stream,
                                              PrefetchOptions options) noexcept;

template <class List>
struct AnyStagingOf;
template <class... Gs>
struct AnyStagingOf<TypeList<Gs...>> {
  using type = AnyStaging<Gs...>;
};

// The one host-planned cache type: the storage arrangement, the eviction policy and the
// staging policy are values (AnyArrangementStorage, AnyPolicy, AnyStaging), so none of them
// multiplies the instantiations (each choice is compiled once, in its erased type).
template <class Runtime>
using AnyStagingFor = typename AnyStagingOf<typename AnyCacheStagings<Runtime>::type>::type;
template <class Runtime>
using AnyHostCache = ExpertCache<AnyArrangementStorage, AnyPolicy, AnyStagingFor<Runtime>, ExplicitLayout, Runtime>;
// The one device-planned cache type (storage arrangement and device policy as values).
template <class Runtime>
using AnyDeviceCache = DeviceExpertCache<AnyArrangementStorage, ExplicitLayout, Runtime, AnyDevicePolicy>;

// f(the model impl is): the device provider's where `device`, else the host-planned one's.
template <class Runtime, class F>
decltype(auto) with_any_model(AnyCacheBase<Runtime>& impl, bool device, F&& f) noexcept {
  if constexpr (has_device_plan_executor<Runtime>) {
    if (device) return f(static_cast<DeviceCacheModel<Runtime, AnyDeviceCache<Runtime>>&>(impl));
  }
  return f(static_cast<HostCacheModel<Runtime, AnyHostCache<Runtime>>&>(impl));
}

template <class Runtime>
Result<ForwardView> any_call_prepare_unique(AnyCacheBase<Runtime>& impl, bool device, std::span<const std::int32_t> ids,
                                            typename Runtime::Stream stream) noexcept {
  return with_any_model(impl, device, [&](auto& m) { return m.prepare_unique(ids, stream); });
}
template <class Runtime>
Result<ForwardView> any_call_prepare_group(AnyCacheBase<Runtime>& impl, bool device, std::int32_t group,
                                           typename Runtime::Stream stream) noexcept {
  return with_any_model(impl, device, [&](auto& m) { return m.prepare_group(group, stream); });
}
template <class Runtime>
Result<WideSummary> any_call_prepare_wide(AnyCacheBase<Runtime>& impl, bool device, std::span<const std::int32_t> ids,
                                          typename Runtime::Stream stream, WideConsumerRef consumer,
                                          WideOptions options) noexcept {
  return with_any_model(
      impl, device, [&](auto& m) { return m.prepare_wide(ids, stream, consumer, options); });
}
template <class Runtime>
Result<PrefetchView> any_call_prefetch(AnyCacheBase<Runtime>& impl, bool device, std::span<const std::int32_t> ids,
                                       typename Runtime::Stream stream, PrefetchOptions options) noexcept {
  return with_any_model(impl, device, [&](auto& m) { return m.prefetch(ids, stream, options); });
}
template <class Runtime>
Result<PrefetchView> any_call_prefetch_device(AnyCacheBase<Runtime>& impl, bool device, const std::int32_t* device_ids,
                                              std::int32_t n_ids, typename Runtime::Stream stream,
                                              PrefetchOptions options) noexcept {
  return with_any_model(
      impl, device, [&](auto& m) { return m.prefetch_device(device_ids, n_ids, stream, options); });
}

}  // namespace detail

// The device provider's wide rounds copy through the host providers' staging type, holding
// CopyStream (what a static DeviceExpertCache copies with): one instantiation of the rounds
// serves both providers.
template <class Runtime>
struct DeviceWideStaging<detail::AnyDevicePolicy, Runtime> {
  using type = detail::AnyStagingFor<Runtime>;
  [[nodiscard]] static type make() {
    constexpr auto names = detail::names_of(typename AnyCacheStagings<Runtime>::type{});
    constexpr std::optional<std::size_t> copy_stream = detail::index_of(names, CopyStream::name);
    static_assert(copy_stream.has_value(), "the staging list offers CopyStream");
    return type(*copy_stream);
  }
};

}  // namespace expert_cache::inline v0
