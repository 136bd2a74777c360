#pragma once
/// AnyExpertCache<Runtime>: the type-erased cache an engine holds, made by make_expert_cache
/// (any/make_expert_cache.hpp) and used like ExpertCache.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "expert_cache/any/cache_models.hpp"
#include "expert_cache/any/config.hpp"
#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/cache/options.hpp"
#include "expert_cache/cache/stats.hpp"
#include "expert_cache/cache/views.hpp"
#include "expert_cache/cache/wide.hpp"
#include "expert_cache/planning/device_plan.hpp"
#include "expert_cache/planning/split.hpp"

namespace expert_cache::inline v0 {

template <allocating_runtime Runtime>
class AnyExpertCache;

template <allocating_runtime Runtime>
[[gnu::cold]] Result<AnyExpertCache<Runtime>> make_expert_cache(Runtime& rt, const AnyCacheConfig& config);

// The type-erased cache. Move-only; a moved-from object may only be destroyed or assigned.
template <allocating_runtime Runtime>
class AnyExpertCache {
 public:
  using Stream = typename Runtime::Stream;

  AnyExpertCache(AnyExpertCache&&) noexcept = default;
  AnyExpertCache& operator=(AnyExpertCache&&) noexcept = default;

  // Host providers: top-k ids in host memory, as ExpertCache::prepare. Device provider: the
  // span is [device pointer, n_ids) of ids in device memory, as DeviceExpertCache::prepare.
  Result<ForwardView> prepare(std::span<const std::int32_t> ids, Stream stream) noexcept {
    return impl_->prepare(ids, stream);
  }
  // Host providers only (the device provider returns not_supported).
  Result<ForwardView> prepare_unique(std::span<const std::int32_t> unique_ids, Stream stream) noexcept {
    return detail::any_call_prepare_unique(*impl_, device_, unique_ids, stream);
  }
  // Device provider only: overflow group g >= 1 of the last prepare (DeviceExpertCache).
  Result<ForwardView> prepare_group(std::int32_t group, Stream stream) noexcept {
    return detail::any_call_prepare_group(*impl_, device_, group, stream);
  }
  // A forward of any width in rounds (cache/wide.hpp): `consumer(const WideRound&)` returns a Status
  // and enqueues each round's work on `stream`. Host providers: ExpertCache::prepare_wide (ids in
  // host memory; stream admission needs options.stream_slots >= 2, else admit, fell_back).
  // Device provider: ids in DEVICE memory. With options.stream_slots >= 2 and stream admission,
  // DeviceExpertCache::prepare_wide (at most max_wide_ids ids; eager: the host waits for their
  // read-back); otherwise at most max_ids, served as admit through prepare + prepare_group, not
  // overlapped (DeviceCacheModel::prepare_wide). The consumer must not call
  // into this cache.
  template <class Consumer>
    requires std::is_invocable_r_v<Status, Consumer&, const WideRound&>
  Result<WideSummary> prepare_wide(std::span<const std::int32_t> ids, Stream stream, Consumer&& consumer,
                                   WideOptions options = {}) noexcept {
    using C = std::remove_reference_t<Consumer>;
    const detail::WideConsumerRef ref{const_cast<void*>(static_cast<const void*>(std::addressof(consumer))),
                                      [](void* object, const WideRound& round) -> Status {
                                        return (*static_cast<C*>(object))(round);
                                      }};
    return detail::any_call_prepare_wide(*impl_, device_, ids, stream, ref, options);
  }
  Status invalidate(std::int32_t expert, Stream stream) noexcept { return impl_->invalidate(expert, stream); }
  // Speculative fills of predicted ids in HOST memory, as ExpertCache::prefetch (every
  // provider; the device provider uploads them and plans on the device, its view counts nothing:
  // see stats()).
  Result<PrefetchView> prefetch(std::span<const std::int32_t> predicted, Stream stream,
                                PrefetchOptions options = {}) noexcept {
    return detail::any_call_prefetch(*impl_, device_, predicted, stream, options);
  }
  // Predicted ids in DEVICE memory (e.g. written by a kernel inside a captured step), planned on
  // the device: the device provider only (DeviceExpertCache::prefetch); host-planned providers
  // return not_supported.
  Result<PrefetchView> prefetch_device(const std::int32_t* device_ids, std::int32_t n_ids, Stream stream,
                                       PrefetchOptions options = {}) noexcept {
    return detail::any_call_prefetch_device(*impl_, device_, device_ids, n_ids, stream, options);
  }
  [[nodiscard]] CacheStats stats() const noexcept { return impl_->stats(); }

  // Split plans for forwards wider than the cache (host providers; any provider can compute them).
  [[nodiscard]] Result<std::vector<TokenChunk>> plan_token_chunks(std::span<const std::int32_t> topk_ids) const {
    return expert_cache::plan_token_chunks(topk_ids, options_.top_k, options_.capacity, options_.num_experts);
  }
  [[nodiscard]] Result<std::vector<ExpertGroup>> plan_expert_groups(std::span<const std::int32_t> topk_ids) const {
    return expert_cache::plan_expert_groups(topk_ids, options_.top_k, options_.capacity, options_.num_experts);
  }
  // Rounds (prepare + prepare_group 1..) a device-provider graph needs for n_ids ids.
  [[nodiscard]] std::int32_t max_groups(std::int64_t n_ids) const noexcept {
    return plan_max_groups(n_ids, options_.num_experts, options_.capacity);
  }

  // Storage (host pools to fill, slot tensors, copy regions), as Storage's accessors.
  [[nodiscard]] const ExpertTensorBytes& tensors() const noexcept { return impl_->tensors(); }
  [[nodiscard]] std::byte* host_tensor(std::size_t t, std::int32_t expert) const noexcept {
    return impl_->host_tensor(t, expert);
  }
  [[nodiscard]] SlotTensor slot_tensor(std::size_t t) const noexcept { return impl_->slot_tensor(t); }
  [[nodiscard]] const CopyRegions& copy_regions() const noexcept { return impl_->copy_regions(); }
  [[nodiscard]] std::size_t host_pool_bytes() const noexcept { return impl_->host_bytes(); }
  [[nodiscard]] std::size_t slot_buffer_bytes() const noexcept { return impl_->storage_slot_bytes(); }

  // Host copies of the maps (host providers; empty for the device provider) and the device maps.
  [[nodiscard]] std::span<const std::int32_t> resident_map_host() const noexcept { return impl_->resident_map_host(); }
  [[nodiscard]] std::span<const std::int32_t> forward_map_host() const noexcept { return impl_->forward_map_host(); }
  [[nodiscard]] const std::int32_t* resident_map_device() const noexcept { return impl_->resident_map_device(); }
  [[nodiscard]] const std::int32_t* forward_map_device() const noexcept { return impl_->forward_map_device(); }
  // The last prepare's plan (host providers; nullptr for the device provider).
  [[nodiscard]] const ForwardPlan* last_plan() const noexcept { return impl_->last_plan(); }
  [[nodiscard]] std::optional<Stream> copy_stream() const noexcept { return impl_->copy_stream(); }
  [[nodiscard]] std::optional<Stream> owner() const noexcept { return impl_->owner(); }
  // Device provider: read and clear the device error word (0 for host providers).
  [[nodiscard]] std::uint32_t take_errors() noexcept { return impl_->take_errors(); }
  /// The engine the device provider's fills run on (FillEngine::automatic resolved when the
  /// cache was made); none for the host-planned providers, which copy on their copy stream.
  [[nodiscard]] std::optional<FillEngine> fill_engine() const noexcept { return impl_->fill_engine(); }
  // Host providers (the device provider returns not_supported).
  Status set_stats_callback(std::function<void(const CacheStats&)> callback, std::uint64_t every) {
    return impl_->set_stats_callback(std::move(callback), every);
  }

  [[nodiscard]] const CacheOptions& options() const noexcept { return options_; }
  [[nodiscard]] std::string_view provider() const noexcept { return provider_; }
  [[nodiscard]] std::string_view policy() const noexcept { return policy_; }
  [[nodiscard]] std::string_view staging() const noexcept { return staging_; }
  [[nodiscard]] std::string_view storage() const noexcept { return storage_; }
  [[nodiscard]] std::string_view layout() const noexcept { return layout_; }

 private:
  friend Result<AnyExpertCache> make_expert_cache<Runtime>(Runtime& rt, const AnyCacheConfig& config);
  AnyExpertCache() = default;

  std::unique_ptr<detail::AnyCacheBase<Runtime>> impl_;
  bool device_ = false;  // impl_ is the device provider's model (the any_call_* casts)
  CacheOptions options_;
  std::string_view provider_, policy_, staging_, storage_;  // static names
  std::string layout_;
};

}  // namespace expert_cache::inline v0
