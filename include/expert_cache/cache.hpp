#pragma once
// ExpertCache: the forward-oriented public API, composed from compile-time policies.
//
//   ExpertCache<Storage, EvictionPolicy, StagingPolicy, Layout, Runtime>
//
//   Storage         TensorMajorStorage | ExpertMajorStorage (template over the runtime)
//   EvictionPolicy  any eviction_policy (Lru, Lfru, ...)
//   StagingPolicy   Inline | CopyStream | Batched | (CUDA tier: Gather, ...)
//   Layout          any expert_layout (Nvfp4Marlin | DenseBf16 | ExplicitLayout): the
//                   per-expert tensors and their sizes (formerly named ScaleLayout)
//   Runtime         SimRuntime (host model) | CudaRuntime
//
// prepare(ids, stream) plans the forward, hands its fills to the ordering core's one write
// entry (which orders, issues, uploads the resident map, publishes and adopts the reader) and
// uploads the forward map; every stream/event edge comes from the core. prefetch(ids, stream)
// plans speculative fills of predicted experts (planner.hpp, plan_prefetch) and hands them to
// the same entry; a later prepare() using one waits for exactly that fill (docs/design.md,
// "Prefetch" and edge 9).
//
// ExpertCache is an alias of detail::ExpertCacheWithEdges with every ordering edge on. The
// sixth parameter exists only for the negative tests (tests/test_cache_sim.cpp), which remove
// one edge and show the race detector fires; it is not part of the public type.
#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expert_cache/concepts.hpp"
#include "expert_cache/core/ordering_core.hpp"
#include "expert_cache/layout/tensor_bytes.hpp"
#include "expert_cache/nvtx.hpp"
#include "expert_cache/planner.hpp"
#include "expert_cache/runtime/resources.hpp"
#include "expert_cache/split.hpp"
#include "expert_cache/staging/copy_staging.hpp"
#include "expert_cache/storage/slot_storage.hpp"

namespace expert_cache::inline v0 {

// A layout given by explicit per-tensor byte counts (tests, custom formats).
struct ExplicitLayout {
  static constexpr std::string_view name = "explicit";
  ExpertTensorBytes bytes{};
  [[nodiscard]] Status validate() const { return {}; }
  [[nodiscard]] constexpr ExpertTensorBytes tensors() const noexcept { return bytes; }
};
static_assert(expert_layout<ExplicitLayout>);

/// Counters of one cache since construction (ExpertCache::stats()); cheap to take.
struct CacheStats {
  std::uint64_t hits = 0;           ///< forward experts already resident
  std::uint64_t misses = 0;         ///< forward experts that had to be copied in
  std::uint64_t promotions = 0;     ///< policy promotions (e.g. Lfru's probation -> protected)
  std::uint64_t evictions = 0;      ///< experts evicted to make room
  std::uint64_t invalidations = 0;  ///< experts dropped by invalidate()
  std::int64_t resident = 0;        ///< experts resident now
  std::int64_t capacity = 0;        ///< GPU slots
  std::uint64_t prepare_calls = 0;  ///< accepted prepare() / prepare_unique() calls
  std::uint64_t generation = 0;     ///< generation of the last accepted forward
  std::uint64_t last_copies = 0;    ///< copies the last prepare() enqueued
  std::uint64_t total_copies = 0;   ///< copies enqueued since construction
  std::uint64_t owner_changes = 0;  ///< prepares on a stream other than the previous reader's
  std::uint64_t map_uploads = 0;    ///< expert/resident map uploads
  std::uint64_t staging_stalls = 0; ///< waits for a free host staging buffer
  std::uint64_t faults = 0;         ///< runtime failures reported by prepare()/invalidate()
  std::uint64_t speculative_issued = 0;  ///< experts filled by prefetch() (not in misses or promotions)
  std::uint64_t speculative_used = 0;    ///< ... then used by a forward (also counted in hits)
  std::uint64_t speculative_wasted = 0;  ///< ... expired, evicted or invalidated unused
  std::uint64_t speculative_bytes = 0;   ///< bytes copied by prefetch()
  std::size_t slot_bytes = 0;       ///< device: slot buffers + maps
  std::size_t host_bytes = 0;       ///< host: expert pools + map staging
  /// hits / (hits + misses); 0 before the first forward.
  [[nodiscard]] double hit_rate() const noexcept {
    const auto n = hits + misses;
    return n == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(n);
  }
};

/// What a consumer kernel needs for one forward. All pointers are device pointers, valid for
/// work enqueued on the prepare() stream after the call (the copies are ordered before it) until
/// the next prepare() of this cache.
struct ForwardView {
  /// Slot buffers per tensor: expert in slot s at tensors[t].slot(s); bytes == 0: tensor absent.
  std::array<SlotTensor, num_expert_tensors> tensors{};
  const std::int32_t* expert_map = nullptr;    ///< [num_experts] forward-scoped: this forward's experts -> slot, else -1
  const std::int32_t* resident_map = nullptr;  ///< [num_experts] every resident expert -> slot, else -1
  std::uint32_t hits = 0;                      ///< this forward's unique experts already resident
  std::uint32_t misses = 0;                    ///< this forward's unique experts copied in
  std::uint64_t generation = 0;                ///< increases by one per accepted forward
  /// The slot buffers of tensor `t` (e.g. ExpertTensor::w13).
  [[nodiscard]] const SlotTensor& tensor(ExpertTensor t) const noexcept {
    return tensors[static_cast<std::size_t>(t)];
  }
};

/// Budget and lifetime of one prefetch() call.
struct PrefetchOptions {
  /// Bytes this call may copy: max_bytes / bytes per expert fills (0 = none; < 0 is an error).
  std::int64_t max_bytes = 0;
  /// Accepted forwards a fill stays protected unused before it counts wasted (>= 1): 1 for a
  /// per-layer cache prefetched one forward ahead, L for a cache shared by L layers.
  std::uint32_t expires_after = 1;
};

/// What one prefetch() did.
struct PrefetchView {
  std::uint32_t issued = 0;             ///< speculative fills enqueued
  std::uint32_t evictions = 0;          ///< residents dropped for them
  std::uint32_t skipped_resident = 0;   ///< predicted entries already resident or in flight
  std::uint32_t skipped_no_victim = 0;  ///< predicted ids dropped: every slot was protected
  std::uint64_t bytes = 0;              ///< bytes enqueued
};

/// Construction parameters of an ExpertCache. The constructor throws Error when they are
/// impossible (capacity 0, > num_experts or < top_k).
struct CacheOptions {
  std::int32_t num_experts = 0;  ///< experts of the layer (valid ids are [0, num_experts))
  std::int32_t capacity = 0;     ///< GPU slots (experts resident at once)
  std::int32_t top_k = 1;        ///< routed experts per token
  std::size_t staging_ring = 8;  ///< host staging buffers for map uploads
  std::string label = "expert_cache";  ///< name in log lines and error messages
  /// Called every `stats_every` accepted prepare() calls (0 = never).
  std::function<void(const CacheStats&)> stats_callback;
  std::uint64_t stats_every = 1000;  ///< see stats_callback
  /// Receives one line at construction (policies, sizes, byte accounting). The library is
  /// silent unless a sink is given here.
  std::function<void(std::string_view)> log;
  /// Caller-owned host pools and/or slot workspace (storage/storage_memory.hpp); empty: the
  /// storage allocates them. The caller keeps the memory alive for the cache's lifetime.
  StorageMemory memory{};
};

namespace detail {

/// The cache (public name: ExpertCache, or RowCache / WholeExpertCache / CudaRowCache ...): a
/// fixed pool of GPU slots over every expert in pinned host memory. prepare() makes a forward's
/// experts resident and returns their slot buffers plus the expert map. Not thread-safe: one
/// host thread drives a cache; any number of streams may read what prepare() returns.
template <template <class> class Storage, eviction_policy EvictionPolicy, class StagingPolicy, expert_layout Layout,
          allocating_runtime Runtime, class Edges>
  requires staging_policy_for<StagingPolicy, Runtime, Storage>
class ExpertCacheWithEdges {
 public:
  using Stream = typename Runtime::Stream;
  using StorageType = Storage<Runtime>;
  using Policy = EvictionPolicy;
  using LayoutType = Layout;
  using ScaleLayout = Layout;  // the earlier name

  /// Throws Error on an impossible configuration (capacity 0 or > num_experts or < top_k, a
  /// layout that does not validate, sizes that cannot be allocated). `staging`: a staging
  /// policy value (AnyStaging holds the one picked at run time; the others are stateless or
  /// start empty).
  ExpertCacheWithEdges(Runtime& rt, CacheOptions options, Layout layout, EvictionPolicy policy,
                       StagingPolicy staging = StagingPolicy{})
      : rt_(&rt),
        options_(std::move(options)),
        layout_(validated(layout)),
        planner_(CacheShape{options_.num_experts, options_.capacity}, options_.top_k, std::move(policy)),
        storage_(rt, planner_.shape(), layout_.tensors(), options_.memory),
        core_(rt, uses_copy_stream_of(staging), static_cast<std::size_t>(options_.num_experts), options_.staging_ring),
        resident_device_(rt, map_bytes(), MemoryKind::device),
        forward_device_(rt, map_bytes(), MemoryKind::device),
        staging_(std::move(staging)) {
    for (std::size_t t = 0; t < num_expert_tensors; ++t) view_.tensors[t] = storage_.slot_tensor(t);
    view_.expert_map = reinterpret_cast<const std::int32_t*>(forward_device_.data());
    forward_shadow_.assign(static_cast<std::size_t>(options_.num_experts), absent_slot);
    view_.resident_map = reinterpret_cast<const std::int32_t*>(resident_device_.data());
    copies_per_fill_ = storage_.copy_regions().count;
    if (options_.log) {
      const CacheStats s = stats();
      options_.log(options_.label + ": " + std::string(EvictionPolicy::name) + "/" + std::string(StagingPolicy::name) +
                   "/" + std::string(StorageType::name) + "/" + std::string(Layout::name) + ", " +
                   std::to_string(options_.capacity) + " of " + std::to_string(options_.num_experts) +
                   " experts, slot bytes " + std::to_string(s.slot_bytes) + ", host bytes " +
                   std::to_string(s.host_bytes));
    }
  }

  /// As above, with the eviction policy constructed from the cache shape.
  ExpertCacheWithEdges(Runtime& rt, CacheOptions options, Layout layout)
    requires std::constructible_from<EvictionPolicy, CacheShape>
      : ExpertCacheWithEdges(rt, options, layout,
                    EvictionPolicy(ForwardPlanner<EvictionPolicy>::validated(
                        CacheShape{options.num_experts, options.capacity}, options.top_k))) {}

  ExpertCacheWithEdges(const ExpertCacheWithEdges&) = delete;
  ExpertCacheWithEdges& operator=(const ExpertCacheWithEdges&) = delete;

  /// Makes a forward's experts resident for work enqueued on `stream` after this call.
  /// `topk_ids`: top-k routing ids (duplicates fine, negative = padding), processed in ascending
  /// order. Errors (an id out of range, more unique experts than slots: see plan_token_chunks /
  /// plan_expert_groups) leave the cache unchanged; a runtime failure after planning drops the
  /// forward's fills (refetched by the next prepare).
  Result<ForwardView> prepare(std::span<const std::int32_t> topk_ids, Stream stream) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::prepare");
    return prepare_impl<false>(topk_ids, stream);
  }
  /// As prepare(), for an explicit unique list (e.g. one expert-split group), processed in the
  /// given order; a duplicate id is an error.
  Result<ForwardView> prepare_unique(std::span<const std::int32_t> unique_ids, Stream stream) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::prepare_unique");
    return prepare_impl<true>(unique_ids, stream);
  }

  /// Speculative fills of `predicted` (best first, ids in [0, num_experts), at most num_experts
  /// entries) for a later prepare(), under `options.max_bytes`. Enqueued on the fill stream after
  /// the previous readers and writers (edges 1, 2), with the resident map (edge 7); `stream`
  /// does not wait for them and stays what it was (the owner is unchanged). The forward map is
  /// not touched: kernels of the current forward keep reading it. Never evicts an expert of the
  /// most recent prepare() or an unused, unexpired speculative fill. A later prepare() whose
  /// forward uses a fill makes its stream wait for exactly that fill (edge 9). The device
  /// resident map names a speculative slot before its bytes land: read slots through the
  /// forward map (expert_map), whose entries are always ordered for the prepare's stream.
  /// Errors (before any state change): expert_out_of_range, too_many_experts (more entries
  /// than num_experts), invalid_argument (max_bytes < 0, expires_after == 0),
  /// capture_unsupported (`stream` is capturing: the per-slot events must be eager). A runtime
  /// failure drops the call's fills (counted wasted and invalidated).
  Result<PrefetchView> prefetch(std::span<const std::int32_t> predicted, Stream stream,
                                PrefetchOptions options = {}) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::prefetch");
    if (options.max_bytes < 0) {
      return Status::format(ErrorCode::invalid_argument, "prefetch max_bytes must be >= 0, got %lld",
                            static_cast<long long>(options.max_bytes));
    }
    const std::uint64_t bytes_per_expert = total_bytes_per_expert(layout_.tensors());
    const std::uint64_t budget_fills = static_cast<std::uint64_t>(options.max_bytes) / bytes_per_expert;
    const auto max_fills = static_cast<std::int32_t>(
        std::min<std::uint64_t>(budget_fills, static_cast<std::uint64_t>(options_.capacity)));
    if constexpr (requires { staging_.precheck(*rt_, stream); }) {
      if (Status s = staging_.precheck(*rt_, stream); !s) return s;
    }
    Result<bool> capturing = rt_->is_capturing(stream);
    if (!capturing.ok()) return capturing.status();
    if (capturing.value()) {
      return Status(ErrorCode::capture_unsupported,
                    "prefetch() under stream capture: its per-slot events must be recorded eagerly");
    }
    // The one-time per-slot events, then the plan (which validates before any state change).
    if (max_fills > 0) {
      if (Status s = core_.reserve_speculative_slots(static_cast<std::size_t>(options_.capacity)); !s) return s;
    }
    if (Status s = planner_.plan_prefetch(predicted, max_fills, options.expires_after, prefetch_plan_); !s) return s;
    if (prefetch_plan_.fills.empty()) return prefetch_view(bytes_per_expert);
    resident_dirty_ = true;
    Status s = core_.write(stream, WritePurpose::speculative, resident_upload(), [&](Stream fill) noexcept {
      for (const SlotFill& f : prefetch_plan_.fills) {
        if (Status w = staging_.issue(*rt_, fill, storage_, std::span<const SlotFill>(&f, 1)); !w) return w;
        if (Status w = core_.record_speculative(f.slot.index(), fill); !w) return w;
      }
      return Status();
    });
    if (!s) {
      // As roll_back(): the slots' contents are unknown; drop them, re-upload the map next time.
      for (const SlotFill& f : prefetch_plan_.fills) {
        (void)planner_.invalidate(f.expert.value);
        core_.forget_speculative(f.slot.index());
      }
      ++faults_;
      return s.with_context("prefetch failed after planning (%zu speculative experts dropped)",
                            prefetch_plan_.fills.size());
    }
    resident_dirty_ = false;
    total_copies_ += prefetch_plan_.fills.size() * copies_per_fill_;
    speculative_bytes_ += prefetch_plan_.fills.size() * bytes_per_expert;
    return prefetch_view(bytes_per_expert);
  }

  /// Drop an expert (e.g. its weights changed). Ordered after in-flight copies; the slot is
  /// rewritten only by a later prepare(), after the readers of the previous forward.
  Status invalidate(std::int32_t expert, Stream stream) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::invalidate");
    Result<SlotId> freed = planner_.invalidate(expert);
    if (!freed.ok()) return freed.status();
    if (!freed.value().valid()) return {};
    core_.forget_speculative(freed.value().index());  // rewritten only after edges 1/2 order it
    resident_dirty_ = true;
    // Only the resident map changes: no slot writes, the owner keeps reading.
    Status s = core_.write(stream, WritePurpose::invalidate, resident_upload(), [](Stream) noexcept { return Status(); });
    if (!s) {
      ++faults_;
      return s.with_context("invalidate(%d) (the expert is dropped; the next prepare re-uploads the resident map)",
                            expert);
    }
    resident_dirty_ = false;
    return {};
  }

  /// Token split of a forward wider than the cache: chunks whose unique experts each fit.
  [[nodiscard]] Result<std::vector<TokenChunk>> plan_token_chunks(std::span<const std::int32_t> topk_ids) const {
    return expert_cache::plan_token_chunks(topk_ids, options_.top_k, options_.capacity, options_.num_experts);
  }
  /// Expert split of a forward wider than the cache: groups for prepare_unique().
  [[nodiscard]] Result<std::vector<ExpertGroup>> plan_expert_groups(std::span<const std::int32_t> topk_ids) const {
    return expert_cache::plan_expert_groups(topk_ids, options_.top_k, options_.capacity, options_.num_experts);
  }

  /// Counters since construction.
  [[nodiscard]] CacheStats stats() const noexcept {
    const auto& c = planner_.counters();
    const auto& o = core_.counters();
    CacheStats s;
    s.hits = c.hits;
    s.misses = c.misses;
    s.promotions = c.promotions;
    s.evictions = c.evictions;
    s.invalidations = c.invalidations;
    s.resident = planner_.resident_count();
    s.capacity = options_.capacity;
    s.prepare_calls = c.prepare_calls;
    s.generation = c.generation;
    s.last_copies = last_copies_;
    s.total_copies = total_copies_;
    s.owner_changes = o.owner_changes;
    s.map_uploads = o.map_uploads;
    s.staging_stalls = o.staging_stalls;
    s.faults = faults_;
    s.speculative_issued = c.speculative_issued;
    s.speculative_used = c.speculative_used;
    s.speculative_wasted = c.speculative_wasted;
    s.speculative_bytes = speculative_bytes_;
    s.slot_bytes = storage_.slot_bytes() + 2 * map_bytes();
    s.host_bytes = storage_.host_bytes() + core_.staging_bytes();
    return s;
  }

  /// The host pools (write the experts' weights here: host_tensor(t, expert)) and slot buffers.
  [[nodiscard]] StorageType& storage() noexcept { return storage_; }
  [[nodiscard]] const StorageType& storage() const noexcept { return storage_; }
  [[nodiscard]] const ForwardPlanner<EvictionPolicy>& planner() const noexcept { return planner_; }
  [[nodiscard]] const ForwardPlan& last_plan() const noexcept { return plan_; }
  [[nodiscard]] const PrefetchPlan& last_prefetch() const noexcept { return prefetch_plan_; }
  [[nodiscard]] const Layout& layout() const noexcept { return layout_; }
  [[nodiscard]] const CacheOptions& options() const noexcept { return options_; }
  [[nodiscard]] std::optional<Stream> copy_stream() const noexcept { return core_.copy_stream(); }
  [[nodiscard]] std::optional<Stream> owner() const noexcept { return core_.owner(); }
  [[nodiscard]] std::span<const std::int32_t> resident_map_host() const noexcept { return planner_.resident_map(); }
  [[nodiscard]] std::span<const std::int32_t> forward_map_host() const noexcept { return planner_.forward_map(); }
  [[nodiscard]] const std::int32_t* resident_map_device() const noexcept { return view_.resident_map; }
  [[nodiscard]] const std::int32_t* forward_map_device() const noexcept { return view_.expert_map; }

  void set_stats_callback(std::function<void(const CacheStats&)> callback, std::uint64_t every) {
    options_.stats_callback = std::move(callback);
    options_.stats_every = every;
  }

 private:
  static Layout validated(const Layout& layout) {
    throw_if_error(layout.validate());
    return layout;
  }
  [[nodiscard]] std::size_t map_bytes() const noexcept {
    return static_cast<std::size_t>(options_.num_experts) * sizeof(std::int32_t);
  }

  template <bool Unique>
  Result<ForwardView> prepare_impl(std::span<const std::int32_t> ids, Stream stream) noexcept {
    if constexpr (requires { staging_.precheck(*rt_, stream); }) {
      if (Status s = staging_.precheck(*rt_, stream); !s) return s;
    }
    Status planned = Unique ? planner_.plan_unique(ids, plan_) : planner_.plan_topk(ids, plan_);
    if (!planned) return planned;  // validation failed: nothing changed
    const bool writes = !plan_.fills.empty() || resident_dirty_;
    Status s = core_.write(stream, writes ? WritePurpose::fill : WritePurpose::read_only, resident_upload(),
                           [&](Stream fill) noexcept {
                             return staging_.issue(*rt_, fill, storage_, std::span<const SlotFill>(plan_.fills));
                           });
    if (s) s = wait_speculative_fills(stream);
    if (s && !forward_map_uploaded()) s = upload_forward_map(stream);
    if (!s) return roll_back(s);
    if (writes) resident_dirty_ = false;
    last_copies_ = plan_.fills.size() * copies_per_fill_;
    total_copies_ += last_copies_;
    view_.hits = plan_.hits;
    view_.misses = plan_.misses;
    view_.generation = planner_.counters().generation;
    if (options_.stats_callback && options_.stats_every != 0 &&
        planner_.counters().prepare_calls % options_.stats_every == 0) {
      options_.stats_callback(stats());
    }
    return view_;
  }

  // Edge 9: the forward's hits that are speculative fills no prepare waited for yet: `stream`
  // waits for each one's own event. Slots this forward fills again are covered by `ready`.
  // Runs on every prepare: with no fill pending (a cache that never prefetched, or all waited
  // for) it returns before touching the plan.
  Status wait_speculative_fills(Stream stream) noexcept {
    if (!core_.any_speculative_pending()) return {};
    for (const SlotFill& f : plan_.fills) core_.forget_speculative(f.slot.index());
    const auto map = planner_.forward_map();
    for (const ExpertId e : plan_.unique) {
      if (!core_.any_speculative_pending()) break;  // the rest cannot be pending
      if (Status s = core_.wait_speculative(static_cast<std::size_t>(map[e.index()]), stream); !s) return s;
    }
    return {};
  }

  PrefetchView prefetch_view(std::uint64_t bytes_per_expert) const noexcept {
    PrefetchView v;
    v.issued = static_cast<std::uint32_t>(prefetch_plan_.fills.size());
    v.evictions = static_cast<std::uint32_t>(prefetch_plan_.evictions.size());
    v.skipped_resident = prefetch_plan_.skipped_resident;
    v.skipped_no_victim = prefetch_plan_.skipped_no_victim;
    v.bytes = v.issued * bytes_per_expert;
    return v;
  }

  // The device forward map already holds the host's: the last upload had the same entries, was
  // enqueued outside any graph capture (a captured upload only lands if the graph is launched),
  // and nothing failed since. Readers are ordered after that upload like after any earlier write
  // (stream order, or the owner-change wait in adopt_reader), so skipping a repeat is safe.
  [[nodiscard]] bool forward_map_uploaded() const noexcept {
    const auto map = planner_.forward_map();
    return forward_shadow_valid_ && std::equal(map.begin(), map.end(), forward_shadow_.begin());
  }

  Status upload_forward_map(Stream stream) noexcept {
    forward_shadow_valid_ = false;  // unknown until the upload is enqueued
    const auto map = planner_.forward_map();
    Status s = core_.upload_map(map.data(), const_cast<std::int32_t*>(view_.expert_map), stream);
    if (s && !core_.last_upload_captured()) {
      std::copy(map.begin(), map.end(), forward_shadow_.begin());
      forward_shadow_valid_ = true;
    }
    return s;
  }

  [[nodiscard]] MapUpload resident_upload() const noexcept {
    return MapUpload{planner_.resident_map().data(), reinterpret_cast<std::int32_t*>(resident_device_.data())};
  }

  // A runtime failure after planning: the filled slots' contents are unknown, so those
  // experts are dropped and refetched by a later prepare; the resident map is re-uploaded.
  Status roll_back(const Status& failure) noexcept {
    for (const SlotFill& f : plan_.fills) (void)planner_.invalidate(f.expert.value);
    resident_dirty_ = true;
    forward_shadow_valid_ = false;
    ++faults_;
    last_copies_ = 0;
    return failure.with_context("prepare failed after planning (%zu filled experts dropped; the next prepare refetches them)",
                                plan_.fills.size());
  }

  Runtime* rt_;
  CacheOptions options_;
  Layout layout_;
  ForwardPlanner<EvictionPolicy> planner_;
  StorageType storage_;
  OrderingCore<Runtime, Edges> core_;
  RuntimeBuffer<Runtime> resident_device_;
  RuntimeBuffer<Runtime> forward_device_;
  std::vector<std::int32_t> forward_shadow_;  // what the last uncaptured forward-map upload wrote
  bool forward_shadow_valid_ = false;
  StagingPolicy staging_{};
  ForwardPlan plan_;
  PrefetchPlan prefetch_plan_;
  ForwardView view_;
  bool resident_dirty_ = true;  // the device resident map is behind the host's
  std::size_t copies_per_fill_ = 0;
  std::uint64_t last_copies_ = 0;
  std::uint64_t total_copies_ = 0;
  std::uint64_t faults_ = 0;
  std::uint64_t speculative_bytes_ = 0;
};

}  // namespace detail

// The public cache type: every ordering edge on.
/// The cache, composed from compile-time policies (see detail::ExpertCacheWithEdges for its
/// members; RowCache and WholeExpertCache in expert_cache.hpp are the standard instantiations).
template <template <class> class Storage, eviction_policy EvictionPolicy, class StagingPolicy, expert_layout Layout,
          allocating_runtime Runtime>
  requires staging_policy_for<StagingPolicy, Runtime, Storage>
using ExpertCache = detail::ExpertCacheWithEdges<Storage, EvictionPolicy, StagingPolicy, Layout, Runtime, OrderingEdges>;

}  // namespace expert_cache::inline v0
