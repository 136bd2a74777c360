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
#include "expert_cache/planning/device_plan/readiness.hpp"
#include "expert_cache/planning/split.hpp"

namespace expert_cache::inline v0 {

template <allocating_runtime Runtime>
class AnyExpertCache;

template <allocating_runtime Runtime>
[[gnu::cold]] Result<AnyExpertCache<Runtime>> make_expert_cache(Runtime& rt, const AnyCacheConfig& config);

/// The type-erased cache: one of the providers row, cached (host-planned ExpertCache) or device
/// (DeviceExpertCache), chosen by name at run time; made only by make_expert_cache. Move-only; a moved-from
/// object may only be destroyed or assigned. Not thread-safe, as the caches it holds.
template <allocating_runtime Runtime>
class AnyExpertCache {
 public:
  using Stream = typename Runtime::Stream;

  AnyExpertCache(AnyExpertCache&&) noexcept = default;
  AnyExpertCache& operator=(AnyExpertCache&&) noexcept = default;

  /// One forward: host providers as ExpertCache::prepare, the device provider as DeviceExpertCache::prepare
  /// (DeviceForward::single).
  /// @param ids     host providers: top-k ids in host memory (duplicates fine, negative = padding); device
  ///                provider: the span is [device pointer, n_ids) of ids in device memory
  /// @param stream  the consumer stream that reads the returned view
  /// @return the view and its errors, as the provider's prepare(); the device provider also refuses more
  ///         than INT32_MAX ids (invalid_argument)
  Result<ForwardView> prepare(std::span<const std::int32_t> ids, Stream stream) noexcept {
    return impl_->prepare(ids, stream);
  }
  /// An explicit unique list, as ExpertCache::prepare_unique. Host providers only.
  /// @param unique_ids  distinct expert ids in [0, num_experts), host memory
  /// @param stream      the consumer stream that reads the returned view
  /// @return as ExpertCache::prepare_unique; not_supported from the device provider
  Result<ForwardView> prepare_unique(std::span<const std::int32_t> unique_ids, Stream stream) noexcept {
    return detail::any_call_prepare_unique(*impl_, device_, unique_ids, stream);
  }
  /// Overflow group `group` of the last prepare, as DeviceExpertCache::prepare_group. Device provider only.
  /// @param group   the group, in [1, max_groups(max_ids))
  /// @param stream  the consumer stream
  /// @return as DeviceExpertCache::prepare_group; not_supported from a host provider (split with
  ///         plan_expert_groups / plan_token_chunks and prepare_unique)
  Result<ForwardView> prepare_group(std::int32_t group, Stream stream) noexcept {
    return detail::any_call_prepare_group(*impl_, device_, group, stream);
  }
  /// A forward of any width in rounds (cache/wide.hpp). Host providers: ExpertCache::prepare_wide (ids in
  /// host memory; stream admission needs options.stream_slots >= 2, else admit, fell_back).
  /// Device provider: ids in DEVICE memory. With options.stream_slots >= 2 and stream admission,
  /// DeviceExpertCache::prepare_wide (at most max_wide_ids ids; eager: the host waits for their
  /// read-back); otherwise at most max_ids, served as admit through prepare + prepare_group, not
  /// overlapped, each round's experts and slots spans empty (DeviceCacheModel::prepare_wide).
  /// @param ids       the forward's top-k ids: host memory (host providers) or [device pointer, n_ids)
  ///                  (device provider)
  /// @param stream    the consumer stream: each round's work goes on it
  /// @param consumer  `consumer(const WideRound&)`, called once per round on this thread: enqueues the round's
  ///                  work on `stream` and returns a Status; it must not call into this cache
  /// @param options   admission, copy mode and batching (WideOptions)
  /// @return what the forward did (WideSummary; the device provider's admit path counts rounds only), or the
  ///         provider's error
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
  /// Drops an expert, as the provider's invalidate() (ExpertCache::invalidate, DeviceExpertCache::invalidate).
  /// @param expert  expert id in [0, num_experts)
  /// @param stream  the caller's stream
  /// @return ok, or the provider's error (expert_out_of_range with nothing changed)
  Status invalidate(std::int32_t expert, Stream stream) noexcept { return impl_->invalidate(expert, stream); }
  /// Speculative fills of predicted ids in HOST memory, as ExpertCache::prefetch (every
  /// provider; the device provider uploads them and plans on the device, its view counting only
  /// skipped_unlikely: see stats()).
  /// @param predicted  predicted expert ids, best first, in [0, num_experts), at most num_experts; host memory
  /// @param stream     the caller's stream
  /// @param options    byte budget, expiry, scores (PrefetchOptions)
  /// @return what the call did, or the provider's error (before any state change for invalid input)
  Result<PrefetchView> prefetch(std::span<const std::int32_t> predicted, Stream stream,
                                PrefetchOptions options = {}) noexcept {
    return detail::any_call_prefetch(*impl_, device_, predicted, stream, options);
  }
  /// Predicted ids in DEVICE memory (e.g. written by a kernel inside a captured step), planned on
  /// the device: the device provider only (DeviceExpertCache::prefetch from device ids).
  /// @param device_ids  `n_ids` predicted ids in device memory, best first (-1 = padding)
  /// @param n_ids       number of ids, in [0, num_experts]
  /// @param stream      the stream the plan and the fills run on
  /// @param options     byte budget and expiry (scores must be empty)
  /// @return a view that counts nothing (see stats()), or DeviceExpertCache::prefetch's errors; not_supported
  ///         from a host provider
  Result<PrefetchView> prefetch_device(const std::int32_t* device_ids, std::int32_t n_ids, Stream stream,
                                       PrefetchOptions options = {}) noexcept {
    return detail::any_call_prefetch_device(*impl_, device_, device_ids, n_ids, stream, options);
  }
  /// @return the provider's counters since construction (CacheStats; the device provider's as
  ///         DeviceExpertCache::stats)
  [[nodiscard]] CacheStats stats() const noexcept { return impl_->stats(); }

  /// Token split of a forward wider than the cache (planning/split.hpp, with the config's top_k, capacity and
  /// num_experts; host providers use it, any provider can compute it). Reads no cache state.
  /// @param topk_ids  row-major [rows, top_k] routing ids in host memory; negative = padding
  /// @return the chunks, or plan_token_chunks' errors
  [[nodiscard]] Result<std::vector<TokenChunk>> plan_token_chunks(std::span<const std::int32_t> topk_ids) const {
    return expert_cache::plan_token_chunks(topk_ids, options_.top_k, options_.capacity, options_.num_experts);
  }
  /// Expert split of a forward wider than the cache: groups for prepare_unique() (planning/split.hpp, as
  /// plan_token_chunks()).
  /// @param topk_ids  row-major [rows, top_k] routing ids in host memory; negative = padding
  /// @return the groups, or plan_expert_groups' errors
  [[nodiscard]] Result<std::vector<ExpertGroup>> plan_expert_groups(std::span<const std::int32_t> topk_ids) const {
    return expert_cache::plan_expert_groups(topk_ids, options_.top_k, options_.capacity, options_.num_experts);
  }
  /// Rounds (prepare + prepare_group 1..) a device-provider graph needs for n_ids ids, in groups of the
  /// capacity.
  /// @param n_ids  the most ids of one forward
  /// @return ceil(min(n_ids, num_experts) / capacity), at least 1
  [[nodiscard]] std::int32_t max_groups(std::int64_t n_ids) const noexcept {
    return plan_max_groups(n_ids, options_.num_experts, options_.capacity);
  }

  // Storage (host pools to fill, slot tensors, copy regions), as Storage's accessors.
  /// @return the layout's tensors the storage was built for
  [[nodiscard]] const ExpertTensorBytes& tensors() const noexcept { return impl_->tensors(); }
  /// Where the caller writes an expert's weights, before the first prepare. Not range-checked.
  /// @param t       tensor index (ExpertTensor, or the layout's own order)
  /// @param expert  expert id, [0, num_experts)
  /// @return host address of tensor `t` of `expert`
  [[nodiscard]] std::byte* host_tensor(std::size_t t, std::int32_t expert) const noexcept {
    return impl_->host_tensor(t, expert);
  }
  /// @param t  tensor index
  /// @return tensor `t` of the slot buffers: base, slot stride and bytes (ForwardView::tensors)
  [[nodiscard]] SlotTensor slot_tensor(std::size_t t) const noexcept { return impl_->slot_tensor(t); }
  /// @return the storage's dense copy regions (what a fill copies per expert)
  [[nodiscard]] const CopyRegions& copy_regions() const noexcept { return impl_->copy_regions(); }
  /// @return host bytes of the expert pools
  [[nodiscard]] std::size_t host_pool_bytes() const noexcept { return impl_->host_bytes(); }
  /// @return device bytes of the slot buffers, stream slots included (the maps not)
  [[nodiscard]] std::size_t slot_buffer_bytes() const noexcept { return impl_->storage_slot_bytes(); }

  /// @return the host resident map, [num_experts] expert -> slot or -1 (host providers; empty for the device
  ///         provider)
  [[nodiscard]] std::span<const std::int32_t> resident_map_host() const noexcept { return impl_->resident_map_host(); }
  /// @return the host forward map of the last forward (host providers; empty for the device provider)
  [[nodiscard]] std::span<const std::int32_t> forward_map_host() const noexcept { return impl_->forward_map_host(); }
  /// @return the device resident map (ForwardView::resident_map), fixed for the cache's lifetime
  [[nodiscard]] const std::int32_t* resident_map_device() const noexcept { return impl_->resident_map_device(); }
  /// @return the device forward map (ForwardView::expert_map), fixed for the cache's lifetime
  [[nodiscard]] const std::int32_t* forward_map_device() const noexcept { return impl_->forward_map_device(); }
  /// @return the last prepare's plan (host providers; nullptr for the device provider)
  [[nodiscard]] const ForwardPlan* last_plan() const noexcept { return impl_->last_plan(); }
  /// @return the cache-owned copy stream; nullopt for an inline staging and for the device provider
  [[nodiscard]] std::optional<Stream> copy_stream() const noexcept { return impl_->copy_stream(); }
  /// @return the stream of the last accepted prepare-family call; nullopt before the first
  [[nodiscard]] std::optional<Stream> owner() const noexcept { return impl_->owner(); }
  /// Device provider: reads and clears the device error word (DeviceExpertCache::take_errors).
  /// @return the PlanErrorBit bits set since the last call; 0 for host providers
  [[nodiscard]] std::uint32_t take_errors() noexcept { return impl_->take_errors(); }
  /// The engine the device provider's fills run on (FillEngine::automatic resolved when the
  /// cache was made); none for the host-planned providers, which copy on their copy stream.
  /// @return the engine, or nullopt for a host provider
  [[nodiscard]] std::optional<FillEngine> fill_engine() const noexcept { return impl_->fill_engine(); }
  /// The device provider built with AnyCacheConfig::overlap: what a consumer waits on before it reads each
  /// slot (DeviceExpertCache::readiness). Empty (enabled() false) otherwise: the consumer relies on stream
  /// order after prepare().
  /// @return the readiness words (device pointers, fixed for the cache's lifetime), or an empty view
  [[nodiscard]] SlotReadiness readiness() const noexcept { return impl_->readiness(); }
  /// Replaces the stats callback (ExpertCache::set_stats_callback). Host providers only.
  /// @param callback  receives stats() from a successful prepare when prepare_calls is a multiple of `every`
  /// @param every     the period in accepted forwards; 0 = never
  /// @return ok; not_supported from the device provider (read stats())
  Status set_stats_callback(std::function<void(const CacheStats&)> callback, std::uint64_t every) {
    return impl_->set_stats_callback(std::move(callback), every);
  }

  /// @return the config's CacheOptions (the log sink included)
  [[nodiscard]] const CacheOptions& options() const noexcept { return options_; }
  /// @return the provider's name: row, cached or device
  [[nodiscard]] std::string_view provider() const noexcept { return provider_; }
  /// @return the eviction policy's name (the provider's default resolved)
  [[nodiscard]] std::string_view policy() const noexcept { return policy_; }
  /// @return the staging policy's name (the provider's default resolved)
  [[nodiscard]] std::string_view staging() const noexcept { return staging_; }
  /// @return the storage's name (the provider's default resolved)
  [[nodiscard]] std::string_view storage() const noexcept { return storage_; }
  /// @return the layout's name (AnyLayout::name)
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
