#pragma once
/// ModelExpertCache: one cache object for all MoE layers of a model. This path also gives its
/// options and stats (cache/model_options.hpp).
//
//   ModelExpertCache<Storage, EvictionPolicy, StagingPolicy, Layout, Runtime>
//
// An engine that holds one ExpertCache per layer has one copy stream, one event set and one
// set of host pools per layer (48 of each for a 48-layer model). This object shares them:
//
//   ModelPool::per_layer  (mode A) every layer keeps its own capacity, planner, policy and maps,
//                         exactly as a separate ExpertCache of that layer would; the layers share
//                         ONE OrderingCore (one copy stream, one event set, one staging ring; one
//                         owner per layer, see ordering_core.hpp "Readers"), ONE host pool
//                         allocation (per tensor for TensorMajorStorage, one blob pool for
//                         ExpertMajorStorage) carved into layer ranges, and one slot allocation
//                         carved into layer slot ranges.
//   ModelPool::global     (mode B) one pool of `capacity` slots for all layers: one planner over
//                         L*E ids keyed layer*E + expert (the replay tool's `--scope global`; a
//                         policy constructible from (CacheShape, PoolLayout), e.g. LayerShare or
//                         Lrfu, gets the layer split), one owner for the whole pool.
//
// Either way the device maps are [L][E] int32 arrays and layer l's ForwardView points at its
// E-entry range, so a per-layer consumer kernel reads it unchanged (in mode B the slot ids in
// it index the shared pool, and the view's tensors are the pool's). A prepare(l) uploads only
// layer l's forward-map range; the resident-map upload covers layer l and, in mode B, the
// layers its victims came from (one contiguous range of layers).
//
// How long a view stays valid (docs/design.md "Model-level cache"): mode A, until the next
// prepare()/invalidate() of the same layer, read on the stream that prepare was given (what L
// separate caches give); mode B, until the next prepare()/invalidate() of ANY layer (any of
// them may evict any layer's slots), read on the stream of that layer's prepare.
#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/nvtx.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/cache/model_options.hpp"
#include "expert_cache/cache/options.hpp"
#include "expert_cache/cache/stats.hpp"
#include "expert_cache/cache/views.hpp"
#include "expert_cache/cache/wide.hpp"
#include "expert_cache/core/ordering_core.hpp"
#include "expert_cache/eviction/pool_layout.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/runtime/resources.hpp"
#include "expert_cache/storage/copy_region.hpp"
#include "expert_cache/storage/slot_storage.hpp"
#include "expert_cache/storage/storage_memory.hpp"

namespace expert_cache::inline v0 {

namespace detail {
// A storage's copy regions shifted to one layer's experts and slots: what a staging policy
// reads (copy_regions() only) for that layer's fills.
struct LayerCopyRegions {
  CopyRegions regions{};
  [[nodiscard]] const CopyRegions& copy_regions() const noexcept { return regions; }
};
}  // namespace detail

namespace detail {

/// The model-level cache with its ordering edges as a parameter: ModelExpertCache (below) has every edge on;
/// tests remove one to show the race detector then fires (ExpertCacheWithEdges does the same).
template <template <class> class Storage, eviction_policy EvictionPolicy, class StagingPolicy, expert_layout Layout,
          allocating_runtime Runtime, class Edges>
  requires staging_policy_for<StagingPolicy, Runtime, Storage>
class ModelExpertCacheWithEdges {
 public:
  using Stream = typename Runtime::Stream;
  using StorageType = Storage<Runtime>;
  using Policy = EvictionPolicy;
  using Planner = ForwardPlanner<EvictionPolicy>;
  using LayoutType = Layout;

  /// Builds the model's cache: one host pool of L*E experts (layer-major), every layer's slots plus the stream
  /// slots, the [L][E] device maps and one ordering core. Writes one line to `options.log` when a sink is given.
  /// @param rt           the runtime that allocates memory and enqueues every call's work; it must outlive the
  ///                     cache
  /// @param options      the model's shape, pool mode, sinks and caller memory (ModelCacheOptions); copied
  /// @param layout       the per-expert tensors and their sizes, the same for every layer; validated here
  /// @param make_policy  `make_policy(shape, pool)` builds each planner's policy (per_layer: L calls with the
  ///                     layer's shape and a one-layer PoolLayout; global: one call with {L*E, capacity} and
  ///                     PoolLayout{E}); the shape is validated before it is called
  /// @throws Error invalid_argument for num_layers < 1, num_experts < 1, L*E above model_max_experts,
  ///         stream_slots outside [0, num_experts], max_wide_ids < 0, layer_capacities given for a global pool
  ///         or not one per layer; invalid_capacity for a capacity outside [1, the planner's experts] or top_k
  ///         outside [1, capacity]; the layout's validate() error; the storage's invalid_argument for bad
  ///         caller memory; the runtime's error when an allocation, a stream or an event cannot be made
  template <class MakePolicy>
    requires std::is_invocable_r_v<EvictionPolicy, MakePolicy&, CacheShape, PoolLayout>
  ModelExpertCacheWithEdges(Runtime& rt, ModelCacheOptions options, Layout layout, MakePolicy make_policy)
      : rt_(&rt),
        options_(validated(std::move(options))),
        layout_(validated(layout)),
        capacities_(layer_capacities(options_)),
        planners_(make_planners(make_policy)),
        storage_(rt, CacheShape{model_experts(), total_slots() + options_.stream_slots}, layout_.tensors(),
                 options_.memory),
        core_(rt, StagingPolicy::uses_copy_stream,
              static_cast<std::size_t>(global() ? model_experts() : options_.num_experts), ring_size(options_),
              global() ? 1 : static_cast<std::size_t>(options_.num_layers)),
        resident_device_(rt, model_map_bytes(), MemoryKind::device),
        forward_device_(rt, model_map_bytes(), MemoryKind::device),
        wide_device_(rt, static_cast<std::size_t>(options_.num_experts) * sizeof(std::int32_t), MemoryKind::device),
        stagings_(std::make_unique<StagingPolicy[]>(global() ? 1 : layers())) {
    const std::size_t L = layers();
    const std::size_t E = experts();
    copies_per_fill_ = storage_.copy_regions().count;
    slot_offsets_.resize(L, 0);
    for (std::size_t l = 1; l < L && !global(); ++l) slot_offsets_[l] = slot_offsets_[l - 1] + capacities_[l - 1];
    if (!global()) {
      regions_.resize(L);
      for (std::size_t l = 0; l < L; ++l) {
        regions_[l].regions = storage_.copy_regions();
        for (std::size_t r = 0; r < regions_[l].regions.count; ++r) {
          CopyRegion& c = regions_[l].regions.regions[r];
          c.host_base += l * E * c.host_stride;
          c.slot_base += static_cast<std::size_t>(slot_offsets_[l]) * c.slot_stride;
        }
      }
    }
    views_.resize(L);
    for (std::size_t l = 0; l < L; ++l) {
      ForwardView& v = views_[l];
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        SlotTensor st = storage_.slot_tensor(t);
        if (st.base != nullptr) st.base += static_cast<std::size_t>(slot_offsets_[l]) * st.slot_stride;
        v.tensors[t] = st;
      }
      v.expert_map = reinterpret_cast<const std::int32_t*>(forward_device_.data()) + l * E;
      v.resident_map = reinterpret_cast<const std::int32_t*>(resident_device_.data()) + l * E;
    }
    forward_shadow_.assign(L * E, absent_slot);
    shadow_valid_.assign(L, 0);
    resident_dirty_.assign(L, 1);  // the device maps start unwritten
    layer_counters_.resize(L);
    ids_.reserve(static_cast<std::size_t>(total_slots()) * static_cast<std::size_t>(options_.top_k));
    for (auto* v : {&wide_unique_, &wide_hits_, &wide_misses_, &wide_round_, &wide_slots_}) v->reserve(E);
    wide_hit_begin_.reserve(E + 2);
    wide_rows_.assign(E, 0);
    wide_fills_.reserve(E);
    wide_batch_.reserve(E * max_copy_regions);  // a round's copies: at most one per fill and region
    wide_map_.assign(E, absent_slot);
    if (options_.log) {
      const CacheStats s = stats().total;
      options_.log(options_.label + ": " + std::string(EvictionPolicy::name) + "/" + std::string(StagingPolicy::name) +
                   "/" + std::string(StorageType::name) + "/" + std::string(Layout::name) + ", " +
                   std::string(to_string(options_.pool)) + " pool, " + std::to_string(options_.num_layers) +
                   " layers of " + std::to_string(options_.num_experts) + " experts, " +
                   std::to_string(total_slots()) + " slots, slot bytes " + std::to_string(s.slot_bytes) +
                   ", host bytes " + std::to_string(s.host_bytes));
    }
  }

  /// As above, with the policies built from (CacheShape, PoolLayout) when they take it, else from CacheShape.
  /// @param rt       the runtime; it must outlive the cache
  /// @param options  the model's shape, pool mode, sinks and caller memory (ModelCacheOptions)
  /// @param layout   the per-expert tensors and their sizes
  /// @throws Error as the constructor above
  ModelExpertCacheWithEdges(Runtime& rt, ModelCacheOptions options, Layout layout)
    requires std::constructible_from<EvictionPolicy, CacheShape> ||
             std::constructible_from<EvictionPolicy, CacheShape, PoolLayout>
      : ModelExpertCacheWithEdges(rt, std::move(options), layout, [](CacheShape shape, PoolLayout pool) {
          if constexpr (std::constructible_from<EvictionPolicy, CacheShape, PoolLayout>) {
            return EvictionPolicy(shape, pool);
          } else {
            (void)pool;
            return EvictionPolicy(shape);
          }
        }) {}

  ModelExpertCacheWithEdges(const ModelExpertCacheWithEdges&) = delete;
  ModelExpertCacheWithEdges& operator=(const ModelExpertCacheWithEdges&) = delete;

  /// Layer `layer`'s forward, as ExpertCache::prepare on that layer's planner (per_layer) or on the one pool
  /// (global, the ids keyed layer * E + id). The misses' copies go on the model's fill stream (copy_stream(), or
  /// `stream` with an inline staging policy) after the layer's owner's readers (global: the pool's owner) and
  /// the last writer of any layer, with the resident-map range that is behind (per_layer: the layer's; global:
  /// the contiguous range of behind layers, the forward's and its victims' included); `stream` waits for them;
  /// the layer's forward-map range is uploaded on `stream`; `stream` becomes the layer's owner (global: the
  /// pool's).
  /// @param layer     the layer, in [0, num_layers)
  /// @param topk_ids  that layer's top-k routing ids in host memory, read during the call only: ids in [0, E),
  ///                  duplicates fine, negative = padding; the unique set is processed in ascending order
  /// @param stream    the consumer stream that reads the returned view
  /// @return the layer's view: its E-entry ranges of the device maps and its slot tensors (per_layer: from the
  ///         layer's first slot; global: the pool's, which the map's slot ids index), hits, misses, generation;
  ///         the pointers are fixed for the cache's lifetime. What they point to holds for work enqueued on
  ///         `stream` after the call, until the next prepare-family call or invalidate() of the same layer
  ///         (per_layer) or of any layer (global: any of them may evict any layer's slots). Errors, with
  ///         nothing changed: invalid_argument (a layer outside [0, num_layers)), expert_out_of_range,
  ///         too_many_experts (more unique experts than the layer's slots; global: the pool's), a staging
  ///         policy's precheck (Batched: capture_unsupported while `stream` is capturing). A runtime failure
  ///         after planning drops the forward's fills (refetched when next requested) and counts a fault for
  ///         the layer.
  Result<ForwardView> prepare(std::int32_t layer, std::span<const std::int32_t> topk_ids, Stream stream) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::model_prepare");
    return prepare_impl<false>(layer, topk_ids, stream);
  }
  /// As prepare(layer, ...), for an explicit unique list of layer `layer`'s experts, processed in the given
  /// order.
  /// @param layer       the layer, in [0, num_layers)
  /// @param unique_ids  distinct expert ids of that layer in [0, E), host memory, read during the call only
  /// @param stream      the consumer stream that reads the returned view
  /// @return as prepare(layer, ...). Errors, with nothing changed: those of prepare(), expert_out_of_range for
  ///         a negative id too, duplicate_expert
  Result<ForwardView> prepare_unique(std::int32_t layer, std::span<const std::int32_t> unique_ids,
                                     Stream stream) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::model_prepare_unique");
    return prepare_impl<true>(layer, unique_ids, stream);
  }

  /// Speculative fills of layer `layer`'s predicted experts for a later prepare(layer, ...) (ExpertCache::prefetch,
  /// for one layer: the engine's lookahead, e.g. layer L+1's hints made while layer L computes). At most
  /// min(the layer's slots (global: the pool's), max_bytes / bytes per expert) fills; never evicts an expert of
  /// the layer's most recent forward (global: of the pool's most recent forward, whichever layer it was), an
  /// unused, unexpired speculative fill or an expert `predicted` names. The fills go on the model's fill stream, ordered after the layer's
  /// owner's readers (global: the pool's) and the last writer of any layer (edges 1, 2), with the resident-map
  /// range that is behind; `stream` does not wait for them and the owner is unchanged. The forward map is not
  /// touched. A later prepare of the layer whose forward uses a fill waits for exactly that fill (edge 9), and
  /// a later write of the slot waits for it (edge 11). Global pool: a prefetch may evict any layer's experts,
  /// so like a prepare it ends the views of every layer. With `options.scores`, the hints are selected first
  /// (PrefetchOptions), and precision feedback works per layer (global: per pool), as in ExpertCache.
  /// @param layer      the layer, in [0, num_layers)
  /// @param predicted  that layer's predicted expert ids, best first, in [0, E), at most E entries; host
  ///                   memory, read during the call only
  /// @param stream     the caller's stream: refused while capturing; the fills' stream with an inline staging
  ///                   policy
  /// @param options    byte budget, expiry, scores and precision feedback (PrefetchOptions)
  /// @return what the call did (PrefetchView); nothing is enqueued when no fill was planned. Errors, with
  ///         nothing changed: invalid_argument (a bad layer, max_bytes < 0, expires_after == 0, the scored-hint
  ///         errors of PrefetchOptions, evict_last_forward with a shared pool), expert_out_of_range, too_many_experts
  ///         (more than E entries),
  ///         capture_unsupported, a staging policy's precheck, the runtime's error when the first prefetch's
  ///         per-slot events cannot be made. A runtime failure while enqueueing drops the call's fills and
  ///         counts a fault for the layer.
  Result<PrefetchView> prefetch(std::int32_t layer, std::span<const std::int32_t> predicted, Stream stream,
                                PrefetchOptions options = {}) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::model_prefetch");
    if (Status s = check_layer(layer, "prefetch"); !s) return s;
    if (options.evict_last_forward && global()) {
      return Status::format(ErrorCode::invalid_argument,
                            "prefetch of layer %d: evict_last_forward needs per-layer caches (the shared pool's last "
                            "forward is another layer's, which may still be read)",
                            layer);
    }
    const auto l = static_cast<std::size_t>(layer);
    StagingPolicy& staging = stagings_[global() ? 0 : l];
    const std::uint64_t bytes_per_expert = total_bytes_per_expert(layout_.tensors());
    const Result<std::int32_t> budget = detail::prefetch_fill_budget(options.max_bytes, bytes_per_expert,
                                                                     global() ? options_.capacity : capacities_[l]);
    if (!budget.ok()) return budget.status().with_context("prefetch of layer %d", layer);
    const std::int32_t max_fills = budget.value();
    if (Status s = detail::prefetch_allowed(*rt_, staging, stream); !s) return s;
    std::span<const std::int32_t> ids = predicted;
    if (global()) {
      // The one planner sees L*E ids: an id of another layer's range must not pass as this layer's.
      if (predicted.size() > experts()) {
        return Status::format(ErrorCode::too_many_experts, "prefetch of layer %d got %zu predicted ids, more than the %d experts",
                              layer, predicted.size(), options_.num_experts);
      }
      if (Status s = key_ids(l, predicted, false, "prefetch"); !s) return s;
      ids = ids_;
    }
    // The one-time per-slot events (every slot of the model), then the plan (which validates before any
    // state change).
    if (max_fills > 0) {
      if (Status s = core_.reserve_speculative_slots(static_cast<std::size_t>(total_slots())); !s) return s;
    }
    if (Status s = planner_of(l).plan_prefetch(ids, options.scores, options.min_score, max_fills, options.expires_after,
                                               prefetch_plan_, options.precision_feedback, options.evict_last_forward);
        !s) {
      return s.with_context("prefetch of layer %d", layer);
    }
    if (prefetch_plan_.fills.empty()) return prefetch_view(bytes_per_expert);
    LayerCounters& lc = layer_counters_[l];
    if (global()) {
      for (const SlotEviction& ev : prefetch_plan_.evictions) {
        const std::size_t victim_layer = ev.expert.index() / experts();
        resident_dirty_[victim_layer] = 1;
        --layer_counters_[victim_layer].resident;
        ++layer_counters_[victim_layer].evictions;
      }
      lc.resident += static_cast<std::int64_t>(prefetch_plan_.fills.size());
    }
    resident_dirty_[l] = 1;
    const auto fills = [&](Stream fill) noexcept {
      for (const SlotFill& f : prefetch_plan_.fills) {
        const std::size_t slot = model_slot(l, f.slot.value);
        if (Status w = core_.order_slot_write(slot, fill); !w) return w;
        const std::span<const SlotFill> one(&f, 1);
        if (Status w = global() ? staging.issue(*rt_, fill, storage_, one) : staging.issue(*rt_, fill, regions_[l], one);
            !w) {
          return w;
        }
        if (Status w = core_.record_speculative(slot, fill); !w) return w;
      }
      return Status();
    };
    // The fills never touch a slot of the latest forward of the layer (global: of the pool), so
    // where the core can they go on its speculative stream after that forward's adoption, not
    // after its consumers, and ahead of nothing on the fill stream: the layer's next prepare's
    // demand copies do not queue behind them. The resident map then goes with the next prepare.
    // With evict_last_forward they may touch them: then they follow `stream` and the forward's
    // owner, as a prepare's copies do (edge 1).
    const bool before_forward = !options.evict_last_forward && core_.speculative_before_forward(reader(l));
    Status s = before_forward ? core_.write_speculative_slots(fills, reader(l))
                              : core_.write(stream, WritePurpose::speculative, resident_upload(l), fills, reader(l));
    if (!s) {
      // As roll_back(): the slots' contents are unknown; drop them, re-upload the maps next time. A
      // fill already recorded stays pending: the slot's next write waits for it (edge 11).
      for (const SlotFill& f : prefetch_plan_.fills) {
        (void)planner_of(l).invalidate(f.expert.value);
        if (global()) {
          --lc.resident;
          ++lc.invalidations;
        }
      }
      if (global()) std::fill(resident_dirty_.begin(), resident_dirty_.end(), 1);
      ++lc.faults;
      return s.with_context("prefetch of layer %d failed after planning (%zu speculative experts dropped)", layer,
                            prefetch_plan_.fills.size());
    }
    if (!before_forward) clear_dirty(l);
    lc.total_copies += prefetch_plan_.fills.size() * copies_per_fill_;
    lc.speculative_bytes += prefetch_plan_.fills.size() * bytes_per_expert;
    return prefetch_view(bytes_per_expert);
  }

  /// A wide forward of layer `layer` (ExpertCache::prepare_wide, same contract per layer): the rounds' views are
  /// the layer's (its map range, its slot tensors: a stream slot's id in the layer's map is relative to the
  /// layer's first slot like the pool's). WideAdmission::stream goes through the model's stream slots, round
  /// r + 1's copies on the fill stream overlapping round r's consumer; the pool is not changed.
  /// WideAdmission::admit (and stream admission on a cache without stream slots, WideSummary::fell_back) goes
  /// through the layer's pool (the pool's in global mode) in ascending groups of half its slots, each as
  /// prepare_unique(layer, ...), not overlapped: a round's copies wait for the previous round's consumer.
  /// @param layer     the layer, in [0, num_layers)
  /// @param topk_ids  that layer's top-k routing ids in host memory, read during the call only: duplicates
  ///                  fine, negative = padding; at most ModelCacheOptions::max_wide_ids of them
  /// @param stream    the consumer stream: each round's work goes on it; refused while capturing
  /// @param consumer  `consumer(const WideRound&)`, called once per round on this thread: enqueues the round's
  ///                  work on `stream` and returns a Status (an exception is caught as runtime_failure); it must
  ///                  not call into this cache
  /// @param options   admission, copy mode and batching (WideOptions)
  /// @return what the forward did (WideSummary), once every round's consumer succeeded. Errors before anything
  ///         changes: invalid_argument (a bad layer), capture_unsupported, a staging policy's precheck,
  ///         too_many_experts (more than max_wide_ids ids), expert_out_of_range. A consumer that fails ends the
  ///         forward with its Status; a runtime failure ends it with the runtime's Status and counts a fault. Stream
  ///         admission leaves the pool as it was either way; admit leaves it as after the rounds prepared so far
  ///         (a runtime failure drops the failing round's fills, as prepare() does).
  template <class Consumer>
    requires std::is_invocable_r_v<Status, Consumer&, const WideRound&>
  Result<WideSummary> prepare_wide(std::int32_t layer, std::span<const std::int32_t> topk_ids, Stream stream,
                                   Consumer&& consumer, WideOptions options = {}) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::model_prepare_wide");
    if (Status s = check_layer(layer, "prepare_wide"); !s) return s;
    // Without stream slots: admit, as ExpertCache::prepare_wide (WideSummary::fell_back).
    const bool fell_back = options.admission == WideAdmission::stream && options_.stream_slots < 2;
    if (options.admission == WideAdmission::admit || fell_back) return admit_wide(layer, topk_ids, stream, consumer, fell_back);
    const auto l = static_cast<std::size_t>(layer);
    StagingPolicy& staging = stagings_[global() ? 0 : l];
    if (Status s = detail::wide_forward_allowed(*rt_, staging, stream); !s) return s;
    if (Status s = detail::wide_unique(topk_ids, options_.num_experts, options_.max_wide_ids, wide_rows_, wide_unique_);
        !s) {
      return s.with_context("prepare_wide of layer %d", layer);
    }
    // The per-expert row counts serve the rounds' split of the hits; zero again on return.
    const detail::ClearWideRowsOnExit clear_rows{wide_unique_, wide_rows_};
    LayerCounters& lc = layer_counters_[l];
    shadow_valid_[l] = 0;  // the rounds overwrite the layer's device forward map
    if (Status s = core_.wide_begin(stream, reader(l)); !s) {
      ++lc.faults;
      return s.with_context("prepare_wide of layer %d: ordering the forward after earlier work", layer);
    }
    // Pure read of the pool: hits from the resident map, the rest through the stream slots.
    const auto resident = resident_map_host(layer);
    wide_hits_.clear();
    wide_misses_.clear();
    for (const std::int32_t e : wide_unique_) {
      (resident[static_cast<std::size_t>(e)] != absent_slot ? wide_hits_ : wide_misses_).push_back(e);
    }
    // Edge 9: a hit that is a speculative fill no prepare waited for yet is read only after its copy.
    for (const std::int32_t e : wide_hits_) {
      if (Status s = core_.wait_speculative(model_slot(l, resident[static_cast<std::size_t>(e)]), stream); !s) {
        ++lc.faults;
        return s.with_context("prepare_wide of layer %d: waiting for a speculative fill", layer);
      }
    }
    WideSummary summary;
    summary.unique = static_cast<std::uint32_t>(wide_unique_.size());
    summary.hits = static_cast<std::uint32_t>(wide_hits_.size());
    const std::size_t half = static_cast<std::size_t>(options_.stream_slots / 2);
    const std::size_t rounds = std::max<std::size_t>(1, (wide_misses_.size() + half - 1) / half);
    detail::split_wide_hits(wide_hits_, wide_rows_, rounds, wide_hit_begin_);
    const auto hits_of = [&](std::size_t r) { return detail::round_hits(wide_hits_, wide_hit_begin_, r); };
    const std::uint64_t bytes_per_expert = total_bytes_per_expert(layout_.tensors());
    // A stream slot as the layer's maps name it (relative to the layer's first slot).
    const std::int32_t stream_base = total_slots() - slot_offsets_[l];
    const auto chunk = [&](std::size_t r) {
      const std::size_t b = std::min(wide_misses_.size(), r * half);
      return std::span<const std::int32_t>(wide_misses_).subspan(b, std::min(wide_misses_.size(), b + half) - b);
    };
    const auto stream_slot = [&](std::size_t r, std::size_t i) {
      return stream_base + static_cast<std::int32_t>((r % 2) * half + i);
    };
    const auto fill_round = [&](std::size_t r) noexcept -> Status {
      const auto c = chunk(r);
      wide_fills_.clear();
      for (std::size_t i = 0; i < c.size(); ++i) {
        wide_fills_.push_back({ExpertId(key(l, c[i])), SlotId(stream_slot(r, i))});
      }
      const bool upload = global() ? any_dirty() : resident_dirty_[l] != 0;
      Status s = core_.wide_fill(stream, r % 2, upload ? resident_upload(l) : MapUpload{}, [&](Stream f) noexcept {
        // The round's map on the fill stream before its copies (ExpertCache::upload_round_map).
        for (const std::int32_t e : hits_of(r)) wide_map_[static_cast<std::size_t>(e)] = resident[static_cast<std::size_t>(e)];
        for (std::size_t i = 0; i < c.size(); ++i) wide_map_[static_cast<std::size_t>(c[i])] = stream_slot(r, i);
        Status m = core_.upload_map(wide_map_.data(), round_map_device(l, r), f, experts());
        for (const std::int32_t e : hits_of(r)) wide_map_[static_cast<std::size_t>(e)] = absent_slot;
        for (const std::int32_t e : c) wide_map_[static_cast<std::size_t>(e)] = absent_slot;
        if (!m) return m;
        const std::span<const SlotFill> fills(wide_fills_);
        std::vector<CopyDesc>* const batch = options.batch_copies ? &wide_batch_ : nullptr;
        if (global()) return detail::issue_coalesced(staging, *rt_, f, storage_, fills, summary.copies, batch);
        return detail::issue_coalesced(staging, *rt_, f, regions_[l], fills, summary.copies, batch);
      });
      if (s && upload) clear_dirty(l);
      if (s) {
        summary.streamed += static_cast<std::uint32_t>(c.size());
        summary.bytes += c.size() * bytes_per_expert;
      }
      return s;
    };
    Status s = fill_round(0);
    for (std::size_t r = 0; s && r < rounds; ++r) {
      const auto c = chunk(r);
      detail::compose_wide_round(r, hits_of(r), c, resident, stream_slot, wide_round_, wide_slots_);
      // Only round r's fill (its map included) is waited for: round r + 1's overlaps the consumer.
      s = core_.wide_acquire(stream);
      if (s && r + 1 < rounds) s = fill_round(r + 1);
      if (!s) break;
      WideRound round;
      round.view = views_[l];
      round.view.expert_map = round_map_device(l, r);
      round.view.hits = static_cast<std::uint32_t>(hits_of(r).size());
      round.view.misses = static_cast<std::uint32_t>(c.size());
      round.experts = wide_round_;
      round.slots = wide_slots_;
      round.index = static_cast<std::uint32_t>(r);
      round.rounds = static_cast<std::uint32_t>(rounds);
      round.streamed = static_cast<std::uint32_t>(c.size());
      Status cs;
      try {
        cs = consumer(round);
        if (!cs) cs = cs.with_context("wide forward of layer %d: the consumer of round %zu of %zu failed", layer, r, rounds);
      } catch (...) {
        cs = Status::format(ErrorCode::runtime_failure, "wide forward of layer %d: the consumer of round %zu threw", layer, r);
      }
      if (!cs) {
        lc.total_copies += summary.copies;
        return cs;
      }
      ++summary.rounds;
      s = core_.wide_release(stream, r % 2);
    }
    lc.total_copies += summary.copies;
    lc.last_copies = summary.copies;
    last_copies_ = summary.copies;
    if (!s) {
      ++lc.faults;
      return s.with_context("prepare_wide of layer %d (streamed experts are never admitted; the pool is unchanged)",
                            layer);
    }
    return summary;
  }

  /// Drops layer `layer`'s expert `expert` (ExpertCache::invalidate, for one layer): the resident-map range that
  /// is behind is uploaded on the fill stream, ordered like a fill after the layer's owner's readers and the
  /// last writer (edge 6); `stream` waits for it; the owner is unchanged.
  /// @param layer   the layer, in [0, num_layers)
  /// @param expert  expert id of that layer in [0, E); one that is not resident is a no-op (nothing enqueued)
  /// @param stream  the caller's stream; it waits for the resident-map upload
  /// @return ok; invalid_argument (a bad layer) or expert_out_of_range with nothing changed; the runtime's error
  ///         when the upload fails, the expert then staying dropped (the next call re-uploads the map range)
  Status invalidate(std::int32_t layer, std::int32_t expert, Stream stream) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::model_invalidate");
    if (Status s = check_layer(layer, "invalidate"); !s) return s;
    if (expert < 0 || expert >= options_.num_experts) return out_of_range(layer, expert);
    const auto l = static_cast<std::size_t>(layer);
    Result<SlotId> freed = planner_of(l).invalidate(key(l, expert));
    if (!freed.ok()) return freed.status();
    if (!freed.value().valid()) return {};
    --layer_counters_[l].resident;
    ++layer_counters_[l].invalidations;
    resident_dirty_[l] = 1;
    Status s = core_.write(stream, WritePurpose::invalidate, resident_upload(l),
                           [](Stream) noexcept { return Status(); }, reader(l));
    if (!s) {
      ++layer_counters_[l].faults;
      return s.with_context(
          "invalidate(layer %d, expert %d) (the expert is dropped; the next prepare re-uploads the resident map)", layer,
          expert);
    }
    clear_dirty(l);
    return {};
  }

  /// The view of `layer` without a call: its maps and slot tensors, and the hits, misses and generation of its
  /// last prepare. Before the layer's first prepare its device maps are not yet written.
  /// @param layer  the layer, in [0, num_layers)
  /// @return the layer's view (pointers fixed for the cache's lifetime), or invalid_argument for a bad layer
  [[nodiscard]] Result<ForwardView> layer_view(std::int32_t layer) const noexcept {
    if (Status s = check_layer(layer, "layer_view"); !s) return s;
    return views_[static_cast<std::size_t>(layer)];
  }

  /// The model's counters since construction (ModelCacheStats: the total and one entry per layer; the ordering
  /// counters only in the total), taken from the host.
  /// @return the counters
  /// @throws std::bad_alloc when the per-layer vector cannot be allocated
  [[nodiscard]] ModelCacheStats stats() const {
    ModelCacheStats out;
    const std::size_t L = layers();
    out.per_layer.resize(L);
    CacheStats& t = out.total;
    for (std::size_t l = 0; l < L; ++l) {
      CacheStats& s = out.per_layer[l];
      const LayerCounters& lc = layer_counters_[l];
      if (!global()) {
        const PlannerCounters& c = planners_[l].counters();
        s.hits = c.hits;
        s.misses = c.misses;
        s.promotions = c.promotions;
        s.evictions = c.evictions;
        s.invalidations = c.invalidations;
        s.prepare_calls = c.prepare_calls;
        s.generation = c.generation;
        s.resident = planners_[l].resident_count();
        s.speculative_issued = c.speculative_issued;
        s.speculative_used = c.speculative_used;
        s.speculative_wasted = c.speculative_wasted;
        s.capacity = capacities_[l];
        s.slot_bytes = slot_bytes_per_slot() * static_cast<std::size_t>(capacities_[l]) + 2 * layer_map_bytes();
      } else {
        s.hits = lc.hits;
        s.misses = lc.misses;
        s.promotions = lc.misses;
        s.evictions = lc.evictions;
        s.invalidations = lc.invalidations;
        s.prepare_calls = lc.prepare_calls;
        s.generation = planners_[0].counters().generation;
        s.resident = lc.resident;
        s.capacity = options_.capacity;
        s.slot_bytes = slot_bytes_per_slot() * static_cast<std::size_t>(lc.resident) + 2 * layer_map_bytes();
      }
      s.last_copies = lc.last_copies;
      s.total_copies = lc.total_copies;
      s.faults = lc.faults;
      s.speculative_bytes = lc.speculative_bytes;
      s.host_bytes = (storage_.host_bytes() + core_.staging_bytes()) / L;
      t.hits += s.hits;
      t.misses += s.misses;
      t.promotions += s.promotions;
      t.evictions += s.evictions;
      t.invalidations += s.invalidations;
      t.prepare_calls += s.prepare_calls;
      t.resident += s.resident;
      t.total_copies += s.total_copies;
      t.faults += s.faults;
      t.speculative_issued += s.speculative_issued;
      t.speculative_used += s.speculative_used;
      t.speculative_wasted += s.speculative_wasted;
      t.speculative_bytes += s.speculative_bytes;
      if (!global()) t.generation += s.generation;
    }
    if (global()) {
      // One planner for the pool: its speculative fills are counted for the model, not per layer.
      const PlannerCounters& c = planners_[0].counters();
      t.generation = c.generation;
      t.speculative_issued = c.speculative_issued;
      t.speculative_used = c.speculative_used;
      t.speculative_wasted = c.speculative_wasted;
    }
    t.capacity = total_slots();
    t.last_copies = last_copies_;
    const OrderingCounters& o = core_.counters();
    t.owner_changes = o.owner_changes;
    t.map_uploads = o.map_uploads;
    t.staging_stalls = o.staging_stalls;
    t.slot_bytes = storage_.slot_bytes() + 2 * model_map_bytes();
    t.host_bytes = storage_.host_bytes() + core_.staging_bytes();
    return out;
  }

  /// @return the layers (ModelCacheOptions::num_layers)
  [[nodiscard]] std::int32_t num_layers() const noexcept { return options_.num_layers; }
  /// @return the pool mode (per_layer or global)
  [[nodiscard]] ModelPool pool() const noexcept { return options_.pool; }
  /// @return the construction options
  [[nodiscard]] const ModelCacheOptions& options() const noexcept { return options_; }
  /// @return the layout the cache was built with
  [[nodiscard]] const Layout& layout() const noexcept { return layout_; }
  /// @return the model's storage: L*E experts layer-major (expert l*E + e) and every layer's slots
  [[nodiscard]] StorageType& storage() noexcept { return storage_; }
  /// @return the model's storage (read-only)
  [[nodiscard]] const StorageType& storage() const noexcept { return storage_; }
  /// Where the caller writes an expert's weights, before the layer's first prepare. Not range-checked.
  /// @param layer   the layer, in [0, num_layers)
  /// @param tensor  tensor index (ExpertTensor, or the layout's own order)
  /// @param expert  expert id of that layer, in [0, E)
  /// @return host address of tensor `tensor` of expert `expert` of `layer`
  [[nodiscard]] std::byte* host_tensor(std::int32_t layer, std::size_t tensor, std::int32_t expert) const noexcept {
    return storage_.host_tensor(tensor, layer * options_.num_experts + expert);  // the pool is [L][E] in both modes
  }
  /// @param layer  the layer, in [0, num_layers) (not checked; ignored in global mode)
  /// @return per_layer: layer `layer`'s planner; global: the one planner (ids keyed layer * E + expert)
  [[nodiscard]] const Planner& planner(std::int32_t layer = 0) const noexcept {
    return planners_[global() ? 0 : static_cast<std::size_t>(layer)];
  }
  /// @param layer  the layer, in [0, num_layers) (not checked)
  /// @return the layer's slots (per_layer); the pool's capacity in global mode
  [[nodiscard]] std::int32_t layer_capacity(std::int32_t layer) const noexcept {
    return capacities_[static_cast<std::size_t>(layer)];
  }
  /// @param layer  the layer, in [0, num_layers) (not checked)
  /// @return the layer's first slot in the model's slot storage (per_layer); 0 in global mode
  [[nodiscard]] std::int32_t slot_offset(std::int32_t layer) const noexcept {
    return slot_offsets_[static_cast<std::size_t>(layer)];
  }
  /// @return the model's copy stream; nullopt with an inline staging policy (fills on the caller's stream)
  [[nodiscard]] std::optional<Stream> copy_stream() const noexcept { return core_.copy_stream(); }
  /// @return the stream of the last accepted prepare-family call of any layer; nullopt before the first
  [[nodiscard]] std::optional<Stream> owner() const noexcept { return core_.owner(); }
  /// @return the model's one ordering core (per-layer owners, counters)
  [[nodiscard]] const OrderingCore<Runtime, Edges>& core() const noexcept { return core_; }
  /// Layer `layer`'s E entries of the host maps (global: slot ids of the pool). In global mode
  /// the host forward map holds only the model's last forward; the device keeps every layer's.
  /// @param layer  the layer, in [0, num_layers) (not checked)
  /// @return the layer's resident map: expert -> slot, -1 when not resident
  [[nodiscard]] std::span<const std::int32_t> resident_map_host(std::int32_t layer) const noexcept {
    return layer_range(planner(layer).resident_map(), static_cast<std::size_t>(layer));
  }
  /// @param layer  the layer, in [0, num_layers) (not checked)
  /// @return the layer's host forward map (its last forward's experts -> slot, else -1; see above for global)
  [[nodiscard]] std::span<const std::int32_t> forward_map_host(std::int32_t layer) const noexcept {
    return layer_range(planner(layer).forward_map(), static_cast<std::size_t>(layer));
  }

 private:
  struct LayerCounters {
    std::uint64_t hits = 0, misses = 0, evictions = 0, invalidations = 0, prepare_calls = 0;  // global mode
    std::int64_t resident = 0;                                                             // global mode
    std::uint64_t last_copies = 0, total_copies = 0, faults = 0;
    std::uint64_t speculative_bytes = 0;
  };

  [[nodiscard]] bool global() const noexcept { return options_.pool == ModelPool::global; }
  [[nodiscard]] std::size_t layers() const noexcept { return static_cast<std::size_t>(options_.num_layers); }
  [[nodiscard]] std::size_t experts() const noexcept { return static_cast<std::size_t>(options_.num_experts); }
  [[nodiscard]] std::int32_t model_experts() const noexcept { return options_.num_layers * options_.num_experts; }
  [[nodiscard]] std::int32_t total_slots() const noexcept {
    if (global()) return options_.capacity;
    std::int64_t n = 0;
    for (const std::int32_t c : capacities_) n += c;
    return static_cast<std::int32_t>(n);
  }
  [[nodiscard]] std::size_t layer_map_bytes() const noexcept { return experts() * sizeof(std::int32_t); }
  [[nodiscard]] std::size_t model_map_bytes() const noexcept { return layers() * layer_map_bytes(); }
  // Both storages' slot bytes are linear in the slot count.
  [[nodiscard]] std::size_t slot_bytes_per_slot() const noexcept {
    return storage_.slot_bytes() / static_cast<std::size_t>(total_slots());
  }
  [[nodiscard]] std::size_t reader(std::size_t l) const noexcept { return global() ? 0 : l; }
  [[nodiscard]] Planner& planner_of(std::size_t l) noexcept { return planners_[global() ? 0 : l]; }
  // The planner's id of layer l's expert e.
  [[nodiscard]] std::int32_t key(std::size_t l, std::int32_t e) const noexcept {
    return global() ? static_cast<std::int32_t>(l * experts()) + e : e;
  }
  [[nodiscard]] std::span<const std::int32_t> layer_range(std::span<const std::int32_t> map,
                                                          std::size_t l) const noexcept {
    return global() ? map.subspan(l * experts(), experts()) : map;
  }
  [[nodiscard]] std::int32_t* resident_device(std::size_t l) const noexcept {
    return reinterpret_cast<std::int32_t*>(resident_device_.data()) + l * experts();
  }
  [[nodiscard]] std::int32_t* forward_device(std::size_t l) const noexcept {
    return reinterpret_cast<std::int32_t*>(forward_device_.data()) + l * experts();
  }
  // Wide round r's forward map of layer l: the layer's forward map and one shared buffer,
  // alternately (as ExpertCache::round_map_device; the shared one is ordered across layers by
  // edge 10's cross-forward wait in wide_begin).
  [[nodiscard]] std::int32_t* round_map_device(std::size_t l, std::size_t r) const noexcept {
    return r % 2 == 0 ? forward_device(l) : reinterpret_cast<std::int32_t*>(wide_device_.data());
  }

  static ModelCacheOptions validated(ModelCacheOptions o) {
    if (o.num_layers < 1) {
      throw Error(ErrorCode::invalid_argument, "num_layers must be positive, got " + std::to_string(o.num_layers));
    }
    if (o.num_experts < 1) {
      throw Error(ErrorCode::invalid_argument, "num_experts must be positive, got " + std::to_string(o.num_experts));
    }
    if (static_cast<std::int64_t>(o.num_layers) * o.num_experts > model_max_experts) {
      throw Error(ErrorCode::invalid_argument, std::to_string(o.num_layers) + " layers x " +
                                                   std::to_string(o.num_experts) + " experts exceed the limit " +
                                                   std::to_string(model_max_experts));
    }
    if (o.stream_slots < 0 || o.stream_slots > o.num_experts) {
      throw Error(ErrorCode::invalid_argument, "stream_slots must be in [0, num_experts=" +
                                                   std::to_string(o.num_experts) + "], got " +
                                                   std::to_string(o.stream_slots));
    }
    if (o.max_wide_ids < 0) {
      throw Error(ErrorCode::invalid_argument, "max_wide_ids must be >= 0, got " + std::to_string(o.max_wide_ids));
    }
    if (!o.layer_capacities.empty()) {
      if (o.pool == ModelPool::global) {
        throw Error(ErrorCode::invalid_argument, "layer_capacities is for a per_layer pool; a global pool has one capacity");
      }
      if (o.layer_capacities.size() != static_cast<std::size_t>(o.num_layers)) {
        throw Error(ErrorCode::invalid_argument, "layer_capacities has " + std::to_string(o.layer_capacities.size()) +
                                                     " entries for " + std::to_string(o.num_layers) + " layers");
      }
    }
    return o;
  }
  static Layout validated(const Layout& layout) {
    throw_if_error(layout.validate());
    return layout;
  }
  static std::vector<std::int32_t> layer_capacities(const ModelCacheOptions& o) {
    if (!o.layer_capacities.empty()) return o.layer_capacities;
    return std::vector<std::int32_t>(static_cast<std::size_t>(o.num_layers), o.capacity);
  }
  static std::size_t ring_size(const ModelCacheOptions& o) {
    const auto L = static_cast<std::size_t>(o.num_layers);
    std::size_t ring = o.staging_ring != 0 ? o.staging_ring : (o.pool == ModelPool::global ? 2 * L + 8 : 8 * L);
    if (o.stream_slots >= 2) {  // one wide forward's map uploads never wait for a staging buffer
      ring += detail::wide_ring_buffers(static_cast<std::size_t>(o.num_experts), static_cast<std::size_t>(o.stream_slots / 2));
    }
    return ring;
  }
  template <class MakePolicy>
  std::vector<Planner> make_planners(MakePolicy& make_policy) const {
    std::vector<Planner> out;
    const PoolLayout pool{options_.num_experts};
    auto add = [&](CacheShape shape) {
      const CacheShape valid = Planner::validated(shape, options_.top_k);  // before the policy sees it
      out.emplace_back(valid, options_.top_k, make_policy(valid, pool));
    };
    if (global()) {
      out.reserve(1);
      add(CacheShape{model_experts(), options_.capacity});
    } else {
      out.reserve(layers());
      for (const std::int32_t c : capacities_) add(CacheShape{options_.num_experts, c});
    }
    return out;
  }

  Status check_layer(std::int32_t layer, const char* call) const noexcept {
    if (layer >= 0 && layer < options_.num_layers) return {};
    return Status::format(ErrorCode::invalid_argument, "%s: layer %d is outside [0, %d)", call, layer,
                          options_.num_layers);
  }
  Status out_of_range(std::int32_t layer, std::int32_t id) const noexcept {
    return Status::format(ErrorCode::expert_out_of_range, "expert id %d of layer %d is outside [0, %d)", id, layer,
                          options_.num_experts);
  }

  // Plans layer l's forward into plan_. Global mode: the ids are checked against [0, E) and
  // keyed l*E + e first (ids_ grows only when a longer id list arrives).
  // WideAdmission::admit for layer `layer`: ascending groups of half the layer's capacity (the
  // pool's in global mode), each through prepare_unique's path (plan, fills ordered after the
  // previous round's consumer like any prepare, forward map), then the round's consumer. A
  // round's fills therefore wait for the previous round's consumer (no overlap): the
  // admit-everything baseline, not the fast path. A failure leaves the pool as after the rounds
  // prepared so far (a runtime failure drops the failing round's fills, as prepare() does).
  template <class Consumer>
  Result<WideSummary> admit_wide(std::int32_t layer, std::span<const std::int32_t> topk_ids, Stream stream,
                                 Consumer& consumer, bool fell_back) noexcept {
    const auto l = static_cast<std::size_t>(layer);
    StagingPolicy& staging = stagings_[global() ? 0 : l];
    if (Status s = detail::wide_forward_allowed(*rt_, staging, stream); !s) return s;
    if (Status s = detail::wide_unique(topk_ids, options_.num_experts, options_.max_wide_ids, wide_rows_, wide_unique_);
        !s) {
      return s.with_context("prepare_wide of layer %d", layer);
    }
    detail::clear_wide_rows(wide_unique_, wide_rows_);  // admit rounds do not split hits by rows
    const std::int32_t pool = global() ? options_.capacity : capacities_[l];
    const std::size_t group = static_cast<std::size_t>(std::max(1, pool / 2));
    const std::size_t n = wide_unique_.size();
    const std::size_t rounds = std::max<std::size_t>(1, (n + group - 1) / group);
    const std::uint64_t bytes_per_expert = total_bytes_per_expert(layout_.tensors());
    WideSummary summary;
    summary.unique = static_cast<std::uint32_t>(n);
    summary.admission = WideAdmission::admit;
    summary.fell_back = fell_back;
    std::uint64_t copies = 0;
    for (std::size_t r = 0; r < rounds; ++r) {
      const std::size_t b = std::min(n, r * group);
      const auto ids = std::span<const std::int32_t>(wide_unique_).subspan(b, std::min(n, b + group) - b);
      Result<ForwardView> v = prepare_impl<true>(layer, ids, stream);
      if (!v.ok()) {
        layer_counters_[l].last_copies = copies;
        return v.status().with_context("prepare_wide (admit) of layer %d: round %zu of %zu", layer, r, rounds);
      }
      copies += layer_counters_[l].last_copies;
      summary.hits += v.value().hits;
      summary.admitted += v.value().misses;
      summary.bytes += v.value().misses * bytes_per_expert;
      const auto map = forward_map_host(layer);
      wide_round_.assign(ids.begin(), ids.end());
      wide_slots_.clear();
      for (const std::int32_t e : wide_round_) wide_slots_.push_back(map[static_cast<std::size_t>(e)]);
      WideRound round;
      round.view = v.value();
      round.experts = wide_round_;
      round.slots = wide_slots_;
      round.index = static_cast<std::uint32_t>(r);
      round.rounds = static_cast<std::uint32_t>(rounds);
      Status cs;
      try {
        cs = consumer(round);
        if (!cs) cs = cs.with_context("wide forward of layer %d: the consumer of round %zu of %zu failed", layer, r, rounds);
      } catch (...) {
        cs = Status::format(ErrorCode::runtime_failure, "wide forward of layer %d: the consumer of round %zu threw", layer, r);
      }
      if (!cs) {
        layer_counters_[l].last_copies = copies;
        return cs;
      }
      ++summary.rounds;
    }
    summary.copies = copies;
    layer_counters_[l].last_copies = copies;
    last_copies_ = copies;
    return summary;
  }

  template <bool Unique>
  Status plan(std::size_t l, std::span<const std::int32_t> ids) noexcept {
    if (!global()) return Unique ? planners_[l].plan_unique(ids, plan_) : planners_[l].plan_topk(ids, plan_);
    if (Status s = key_ids(l, ids, !Unique, "forward"); !s) return s;
    const std::span<const std::int32_t> keyed(ids_);
    return Unique ? planners_[0].plan_unique(keyed, plan_) : planners_[0].plan_topk(keyed, plan_);
  }

  template <bool Unique>
  Result<ForwardView> prepare_impl(std::int32_t layer, std::span<const std::int32_t> ids, Stream stream) noexcept {
    if (Status s = check_layer(layer, Unique ? "prepare_unique" : "prepare"); !s) return s;
    const auto l = static_cast<std::size_t>(layer);
    StagingPolicy& staging = stagings_[global() ? 0 : l];
    if constexpr (requires { staging.precheck(*rt_, stream); }) {
      if (Status s = staging.precheck(*rt_, stream); !s) return s;
    }
    if (Status planned = plan<Unique>(l, ids); !planned) return planned;  // nothing changed
    LayerCounters& lc = layer_counters_[l];
    if (global()) {
      // The pool's victims may belong to other layers: their resident entries changed too.
      for (const SlotEviction& ev : plan_.evictions) {
        const std::size_t victim_layer = ev.expert.index() / experts();
        resident_dirty_[victim_layer] = 1;
        --layer_counters_[victim_layer].resident;
        ++layer_counters_[victim_layer].evictions;
      }
      lc.hits += plan_.hits;
      lc.misses += plan_.misses;
      lc.resident += static_cast<std::int64_t>(plan_.fills.size());
      ++lc.prepare_calls;
    }
    if (!plan_.fills.empty()) resident_dirty_[l] = 1;
    const bool writes = global() ? any_dirty() : resident_dirty_[l] != 0;
    Status s = core_.write(stream, writes ? WritePurpose::fill : WritePurpose::read_only, resident_upload(l),
                           [&](Stream fill) noexcept {
                             // Edge 11: a slot this forward refills waits for its pending speculative fill.
                             if (core_.any_speculative_pending()) {
                               for (const SlotFill& f : plan_.fills) {
                                 if (Status w = core_.order_slot_write(model_slot(l, f.slot.value), fill); !w) return w;
                               }
                             }
                             return issue(staging, l, fill);
                           },
                           reader(l));
    if (s) s = wait_speculative_fills(l, stream);
    if (s && !forward_map_uploaded(l)) s = upload_forward_map(l, stream);
    if (!s) return roll_back(l, s);
    if (writes) clear_dirty(l);
    lc.last_copies = plan_.fills.size() * copies_per_fill_;
    lc.total_copies += lc.last_copies;
    last_copies_ = lc.last_copies;
    ForwardView& v = views_[l];
    v.hits = plan_.hits;
    v.misses = plan_.misses;
    v.generation = planner_of(l).counters().generation;
    return v;
  }

  // Global pool: layer l's ids as the one planner's keys (layer * E + id) in ids_. An id >= E (or
  // negative, unless `negatives_pass`: top-k padding the planner handles) is out of range: an id
  // of another layer's key range must not pass as this layer's.
  Status key_ids(std::size_t l, std::span<const std::int32_t> ids, bool negatives_pass, const char* what) noexcept {
    for (const std::int32_t id : ids) {
      if (id >= options_.num_experts || (!negatives_pass && id < 0)) return out_of_range(static_cast<std::int32_t>(l), id);
    }
    try {
      ids_.resize(ids.size());
    } catch (...) {
      return Status::format(ErrorCode::invalid_argument, "out of memory translating the %s's ids", what);
    }
    for (std::size_t i = 0; i < ids.size(); ++i) ids_[i] = ids[i] < 0 ? ids[i] : key(l, ids[i]);
    return {};
  }

  // Layer l's slot `slot` (its planner's numbering) in the model's slot storage: the index of the
  // core's per-slot speculative events.
  [[nodiscard]] std::size_t model_slot(std::size_t l, std::int32_t slot) const noexcept {
    return static_cast<std::size_t>(slot_offsets_[l]) + static_cast<std::size_t>(slot);
  }

  // Edge 9: the forward's experts that are speculative fills no prepare waited for yet: `stream`
  // waits for each one's own event (ExpertCache::wait_speculative_fills). Slots the forward fills
  // again were waited for by the fill's stream (edge 11).
  Status wait_speculative_fills(std::size_t l, Stream stream) noexcept {
    if (!core_.any_speculative_pending()) return {};
    const auto map = planner_of(l).forward_map();
    for (const ExpertId e : plan_.unique) {
      if (!core_.any_speculative_pending()) break;  // the rest cannot be pending
      if (Status s = core_.wait_speculative(model_slot(l, map[e.index()]), stream); !s) return s;
    }
    return {};
  }

  [[nodiscard]] PrefetchView prefetch_view(std::uint64_t bytes_per_expert) const noexcept {
    return detail::prefetch_view_of(prefetch_plan_, bytes_per_expert);
  }

  Status issue(StagingPolicy& staging, std::size_t l, Stream fill) noexcept {
    const std::span<const SlotFill> fills(plan_.fills);
    if (global()) return staging.issue(*rt_, fill, storage_, fills);
    return staging.issue(*rt_, fill, regions_[l], fills);
  }

  [[nodiscard]] bool any_dirty() const noexcept {
    return std::find(resident_dirty_.begin(), resident_dirty_.end(), 1) != resident_dirty_.end();
  }
  // After a successful resident upload for layer l: per_layer mode uploaded layer l's range,
  // global mode every dirty layer's.
  void clear_dirty(std::size_t l) noexcept {
    if (global()) {
      std::fill(resident_dirty_.begin(), resident_dirty_.end(), 0);
    } else {
      resident_dirty_[l] = 0;
    }
  }

  // The resident-map upload of a call for layer l: per_layer mode, layer l's E entries (only
  // when they are behind the host); global mode, the contiguous range of layers whose entries
  // are behind the host (layer l's and its victims' layers), or nothing.
  [[nodiscard]] MapUpload resident_upload(std::size_t l) const noexcept {
    const std::size_t E = experts();
    if (!global()) {
      if (!resident_dirty_[l]) return MapUpload{};
      return MapUpload{planners_[l].resident_map().data(), resident_device(l), E};
    }
    std::size_t lo = layers();
    std::size_t hi = 0;
    for (std::size_t j = 0; j < layers(); ++j) {
      if (resident_dirty_[j]) {
        lo = std::min(lo, j);
        hi = j + 1;
      }
    }
    if (hi == 0) return MapUpload{};
    return MapUpload{planners_[0].resident_map().data() + lo * E, resident_device(lo), (hi - lo) * E};
  }

  // Layer l's device forward range already holds the host's (ExpertCache::forward_map_uploaded).
  [[nodiscard]] bool forward_map_uploaded(std::size_t l) const noexcept {
    const auto map = forward_map_host(static_cast<std::int32_t>(l));
    return shadow_valid_[l] && std::equal(map.begin(), map.end(), forward_shadow_.begin() + l * experts());
  }

  // Only layer l's E entries: the other layers' ranges keep their own last forwards.
  Status upload_forward_map(std::size_t l, Stream stream) noexcept {
    shadow_valid_[l] = 0;
    const auto map = forward_map_host(static_cast<std::int32_t>(l));
    Status s = core_.upload_map(map.data(), forward_device(l), stream, experts());
    if (s && !core_.last_upload_captured()) {
      std::copy(map.begin(), map.end(), forward_shadow_.begin() + l * experts());
      shadow_valid_[l] = 1;
    }
    return s;
  }

  // ExpertCache::roll_back for layer l: the filled experts are dropped (refetched later) and
  // the resident map of the layers involved is re-uploaded by the next call.
  Status roll_back(std::size_t l, const Status& failure) noexcept {
    for (const SlotFill& f : plan_.fills) {
      (void)planner_of(l).invalidate(f.expert.value);
      if (global()) {
        --layer_counters_[l].resident;
        ++layer_counters_[l].invalidations;
      }
    }
    if (global()) {
      std::fill(resident_dirty_.begin(), resident_dirty_.end(), 1);
    } else {
      resident_dirty_[l] = 1;
    }
    shadow_valid_[l] = 0;
    ++layer_counters_[l].faults;
    layer_counters_[l].last_copies = 0;
    last_copies_ = 0;
    return failure.with_context(
        "prepare of layer %zu failed after planning (%zu filled experts dropped; the next prepare refetches them)", l,
        plan_.fills.size());
  }

  Runtime* rt_;
  ModelCacheOptions options_;
  Layout layout_;
  std::vector<std::int32_t> capacities_;  // per layer (per_layer mode)
  std::vector<Planner> planners_;         // per layer, or one (global)
  StorageType storage_;                   // L*E experts; all slots of the model
  OrderingCore<Runtime, Edges> core_;     // the model's one copy stream and event set
  RuntimeBuffer<Runtime> resident_device_;  // [L][E]
  RuntimeBuffer<Runtime> forward_device_;   // [L][E]
  RuntimeBuffer<Runtime> wide_device_;      // [E]: the odd wide rounds' forward map (any layer)
  std::unique_ptr<StagingPolicy[]> stagings_;  // per layer (a staging may cache per-storage state), or one
  std::vector<std::int32_t> slot_offsets_;     // first slot of each layer (per_layer mode)
  std::vector<detail::LayerCopyRegions> regions_;  // per layer (per_layer mode)
  std::vector<ForwardView> views_;
  std::vector<std::int32_t> forward_shadow_;  // [L][E]: what each layer's last uncaptured upload wrote
  std::vector<char> shadow_valid_;
  std::vector<char> resident_dirty_;  // per layer: the device resident range is behind the host's
  std::vector<LayerCounters> layer_counters_;
  std::vector<std::int32_t> ids_;  // keyed ids (global mode)
  // Wide forwards: scratch of E entries each, sized at construction.
  std::vector<std::int32_t> wide_unique_, wide_hits_, wide_misses_, wide_round_, wide_slots_, wide_map_;
  std::vector<std::uint32_t> wide_rows_;     // per expert: its ids in the wide forward (zero between forwards)
  std::vector<std::size_t> wide_hit_begin_;  // round r's hits: [begin[r], begin[r + 1]) of wide_hits_
  std::vector<SlotFill> wide_fills_;
  std::vector<CopyDesc> wide_batch_;  // a stream round's copies for one batched call (WideOptions::batch_copies)
  ForwardPlan plan_;
  PrefetchPlan prefetch_plan_;
  std::size_t copies_per_fill_ = 0;
  std::uint64_t last_copies_ = 0;
};

}  // namespace detail

/// One cache object for all MoE layers of a model (see the file comment), every ordering edge on.
template <template <class> class Storage, eviction_policy EvictionPolicy, class StagingPolicy, expert_layout Layout,
          allocating_runtime Runtime>
  requires staging_policy_for<StagingPolicy, Runtime, Storage>
using ModelExpertCache = detail::ModelExpertCacheWithEdges<Storage, EvictionPolicy, StagingPolicy, Layout, Runtime,
                                                           OrderingEdges>;

}  // namespace expert_cache::inline v0
