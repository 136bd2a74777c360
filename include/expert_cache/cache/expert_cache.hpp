#pragma once
/// ExpertCache: the forward-oriented public API, composed from compile-time policies. This path
/// also gives its vocabulary (cache/stats.hpp, views.hpp, options.hpp) and ExplicitLayout.
//
//   ExpertCache<Storage, EvictionPolicy, StagingPolicy, Layout, Runtime>
//
//   Storage         TensorMajorStorage | ExpertMajorStorage (template over the runtime)
//   EvictionPolicy  any eviction_policy (Lru, Lfru, ...)
//   StagingPolicy   Inline | CopyStream | Batched | (CUDA tier: Gather, ...)
//   Layout          any expert_layout (Nvfp4Marlin | DenseBf16 | ExplicitLayout): the
//                   per-expert tensors and their sizes
//   Runtime         SimRuntime (host model) | CudaRuntime
//
// prepare(ids, stream) plans the forward, hands its fills to the ordering core's one write
// entry (which orders, issues, uploads the resident map, publishes and adopts the reader) and
// uploads the forward map; every stream/event edge comes from the core. prefetch(ids, stream)
// plans speculative fills of predicted experts (planning/forward_planner.hpp, plan_prefetch) and hands them to
// the same entry; a later prepare() using one waits for exactly that fill (docs/design.md,
// "Prefetch" and edge 9).
//
// ExpertCache is an alias of detail::ExpertCacheWithEdges with every ordering edge on. The
// sixth parameter exists only for the negative tests (tests/host/test_cache_sim.cpp), which remove
// one edge and show the race detector fires; it is not part of the public type.
#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/nvtx.hpp"
#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/cache/options.hpp"
#include "expert_cache/cache/stats.hpp"
#include "expert_cache/cache/stream_rounds.hpp"
#include "expert_cache/cache/views.hpp"
#include "expert_cache/cache/wide.hpp"
#include "expert_cache/core/ordering_core.hpp"
#include "expert_cache/layout/explicit.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/planning/split.hpp"
#include "expert_cache/runtime/resources.hpp"
#include "expert_cache/staging/copy_staging.hpp"
#include "expert_cache/storage/slot_storage.hpp"

namespace expert_cache::inline v0 {

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

  /// Builds the cache: the host pools, capacity + stream_slots slots, the device maps and the ordering core's
  /// streams and events. Writes one line to `options.log` when a sink is given.
  /// @param rt       the runtime that allocates memory and enqueues every call's work; it must outlive the cache
  /// @param options  sizes, sinks and caller memory (CacheOptions); the cache keeps its own copy
  /// @param layout   the per-expert tensors and their sizes; validated here
  /// @param policy   the eviction policy, made for CacheShape{num_experts, capacity}
  /// @param staging  a staging policy value (AnyStaging holds the one picked at run time; the others are
  ///                 stateless or start empty)
  /// @throws Error invalid_argument for num_experts <= 0, stream_slots outside [0, num_experts] or
  ///         max_wide_ids < 0; invalid_capacity for capacity outside [1, num_experts] or top_k outside
  ///         [1, capacity]; the layout's validate() error; the storage's invalid_argument for bad caller
  ///         memory; the runtime's error when an allocation, a stream or an event cannot be made
  [[gnu::cold]] ExpertCacheWithEdges(Runtime& rt, CacheOptions options, Layout layout, EvictionPolicy policy,
                       StagingPolicy staging = StagingPolicy{})
      : rt_(&rt),
        options_(std::move(options)),
        layout_(validated(layout)),
        planner_(CacheShape{options_.num_experts, options_.capacity}, options_.top_k, std::move(policy)),
        storage_(rt, storage_shape(planner_.shape(), options_), layout_.tensors(), options_.memory),
        core_(rt, uses_copy_stream_of(staging), static_cast<std::size_t>(options_.num_experts), ring_size(options_)),
        resident_device_(rt, map_bytes(), MemoryKind::device),
        forward_device_(rt, map_bytes(), MemoryKind::device),
        wide_device_(rt, map_bytes(), MemoryKind::device),
        staging_(std::move(staging)) {
    for (std::size_t t = 0; t < num_expert_tensors; ++t) view_.tensors[t] = storage_.slot_tensor(t);
    view_.expert_map = reinterpret_cast<const std::int32_t*>(forward_device_.data());
    forward_shadow_.assign(static_cast<std::size_t>(options_.num_experts), absent_slot);
    view_.resident_map = reinterpret_cast<const std::int32_t*>(resident_device_.data());
    copies_per_fill_ = storage_.copy_regions().count;
    const auto experts = static_cast<std::size_t>(options_.num_experts);
    wide_.reserve(experts, copies_per_fill_);
    if (options_.log) {
      const CacheStats s = stats();
      options_.log(join({options_.label, ": ", EvictionPolicy::name, "/", StagingPolicy::name, "/", StorageType::name, "/",
                         Layout::name, ", ", DecimalText(options_.capacity), " of ", DecimalText(options_.num_experts),
                         " experts, slot bytes ", DecimalText(s.slot_bytes), ", host bytes ",
                         DecimalText(s.host_bytes)}));
    }
  }

  /// As above, with the eviction policy constructed from the cache shape (validated before the policy sees it).
  /// @param rt       the runtime; it must outlive the cache
  /// @param options  sizes, sinks and caller memory (CacheOptions)
  /// @param layout   the per-expert tensors and their sizes
  /// @throws Error as the constructor above
  ExpertCacheWithEdges(Runtime& rt, CacheOptions options, Layout layout)
    requires std::constructible_from<EvictionPolicy, CacheShape>
      : ExpertCacheWithEdges(rt, options, layout,
                    EvictionPolicy(ForwardPlanner<EvictionPolicy>::validated(
                        CacheShape{options.num_experts, options.capacity}, options.top_k))) {}

  ExpertCacheWithEdges(const ExpertCacheWithEdges&) = delete;
  ExpertCacheWithEdges& operator=(const ExpertCacheWithEdges&) = delete;

  /// Makes a forward's experts resident for work enqueued on `stream` after this call. The misses' copies and
  /// the resident map go on the fill stream (copy_stream(), or `stream` itself with an inline staging policy),
  /// after the previous owner's readers and the last writer (edges 1, 2); `stream` waits for them (edge 3) and
  /// for every prefetch() fill the forward reads (edge 9); the forward map is uploaded on `stream` (skipped when
  /// the last upload holds the same entries); `stream` becomes the owner. A successful call after which
  /// stats().prepare_calls is a multiple of stats_every invokes CacheOptions::stats_callback on this thread.
  /// @param topk_ids  top-k routing ids in host memory, read during the call only: duplicates fine, negative =
  ///                  padding; the unique set is processed in ascending order
  /// @param stream    the consumer stream that reads the returned view
  /// @return the forward's view (cache/views.hpp): slot tensors, forward-scoped expert map and resident map
  ///         (device pointers, fixed for the cache's lifetime), hits, misses, generation. What they point to
  ///         holds for work enqueued on `stream` after this call, until the next prepare(), prepare_unique()
  ///         or prepare_wide(). Errors, with the cache unchanged: expert_out_of_range (an id >= num_experts),
  ///         too_many_experts (more unique experts than slots: see plan_token_chunks / plan_expert_groups), a
  ///         staging policy's precheck (Batched: capture_unsupported while `stream` is capturing). A runtime
  ///         failure after planning drops the forward's fills (refetched by the next prepare) and counts a fault.
  Result<ForwardView> prepare(std::span<const std::int32_t> topk_ids, Stream stream) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::prepare");
    return prepare_impl<false>(topk_ids, stream);
  }
  /// As prepare(), for an explicit unique list (e.g. one group of plan_expert_groups()), processed in the
  /// given order.
  /// @param unique_ids  distinct expert ids in [0, num_experts), host memory, read during the call only
  /// @param stream      the consumer stream that reads the returned view
  /// @return as prepare(). Errors, with the cache unchanged: too_many_experts (more ids than slots),
  ///         expert_out_of_range (an id outside [0, num_experts), a negative one included), duplicate_expert,
  ///         a staging policy's precheck
  Result<ForwardView> prepare_unique(std::span<const std::int32_t> unique_ids, Stream stream) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::prepare_unique");
    return prepare_impl<true>(unique_ids, stream);
  }

  /// Speculative fills of `predicted` for a later prepare(), at most min(capacity, max_bytes / bytes per
  /// expert). Never evicts an expert of the most recent prepare(), an unused, unexpired speculative fill or
  /// an expert `predicted` names.
  /// The fills are ordered after the owner's readers and the last writer (edges 1, 2): on the fill stream
  /// (copy_stream(), or `stream` with an inline staging policy) with the resident map (edge 7), or, when the
  /// latest forward was adopted after the first prefetch and no invalidate() came since, on a cache-owned
  /// speculative stream after that forward's adoption, the resident map then going with the next prepare().
  /// `stream` does not wait for them and stays what it was (the owner is unchanged). The forward map is
  /// not touched: kernels of the current forward keep reading it. A later prepare() whose forward uses a fill
  /// makes its stream wait for exactly that fill (edge 9). The device resident map names a speculative slot
  /// before its bytes land: read slots through the forward map (expert_map), whose entries are always ordered
  /// for the prepare's stream. With `options.scores`, the hints are selected first (PrefetchOptions: below
  /// min_score skipped, the rest highest score first).
  /// @param predicted  predicted expert ids, best first, in [0, num_experts), at most num_experts entries;
  ///                   host memory, read during the call only
  /// @param stream     the caller's stream: refused while capturing; the fills' stream with an inline staging
  ///                   policy
  /// @param options    byte budget, expiry, scores and precision feedback (PrefetchOptions)
  /// @return what the call did (PrefetchView: fills issued, evictions, entries skipped and why, bytes); nothing
  ///         is enqueued when no fill was planned. Errors (before any state change): invalid_argument
  ///         (max_bytes < 0, expires_after == 0, and the scored-hint errors of PrefetchOptions),
  ///         expert_out_of_range (any entry, a skipped one too), too_many_experts (more entries than
  ///         num_experts), capture_unsupported (`stream` is capturing: the per-slot events must be eager), a
  ///         staging policy's precheck, the runtime's error when the first prefetch's per-slot events cannot be
  ///         made. A runtime failure while enqueueing drops the call's fills (counted wasted and invalidated)
  ///         and counts a fault.
  Result<PrefetchView> prefetch(std::span<const std::int32_t> predicted, Stream stream,
                                PrefetchOptions options = {}) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::prefetch");
    const std::uint64_t bytes_per_expert = total_bytes_per_expert(layout_.tensors());
    const Result<std::int32_t> budget = detail::prefetch_fill_budget(options.max_bytes, bytes_per_expert, options_.capacity);
    if (!budget.ok()) return budget.status();
    const std::int32_t max_fills = budget.value();
    if (Status s = detail::prefetch_allowed(*rt_, staging_, stream); !s) return s;
    // The one-time per-slot events, then the plan (which validates before any state change).
    if (max_fills > 0) {
      if (Status s = core_.reserve_speculative_slots(static_cast<std::size_t>(options_.capacity)); !s) return s;
    }
    if (Status s = planner_.plan_prefetch(predicted, options.scores, options.min_score, max_fills,
                                          options.expires_after, prefetch_plan_, options.precision_feedback,
                                          options.evict_last_forward);
        !s) {
      return s;
    }
    if (prefetch_plan_.fills.empty()) return prefetch_view(bytes_per_expert);
    resident_dirty_ = true;
    const auto fills = [&](Stream fill) noexcept {
      for (const SlotFill& f : prefetch_plan_.fills) {
        if (Status w = core_.order_slot_write(f.slot.index(), fill); !w) return w;
        if (Status w = staging_.issue(*rt_, fill, storage_, std::span<const SlotFill>(&f, 1)); !w) return w;
        if (Status w = core_.record_speculative(f.slot.index(), fill); !w) return w;
      }
      return Status();
    };
    // The fills never touch a slot of the latest forward (plan_prefetch protects its experts), so
    // where the core can, they follow that forward's adoption rather than its consumers, and the
    // resident map goes with the next prepare (OrderingCore::write_speculative_slots). With
    // evict_last_forward they may: then they follow `stream` and the forward's owner, as a
    // prepare's copies do (edge 1).
    const bool before_forward = !options.evict_last_forward && core_.speculative_before_forward();
    Status s = before_forward ? core_.write_speculative_slots(fills)
                              : core_.write(stream, WritePurpose::speculative, resident_upload(), fills);
    if (!s) {
      // As roll_back(): the slots' contents are unknown; drop them, re-upload the map next time.
      // A fill already recorded stays pending: the slot's next write waits for it (edge 11).
      for (const SlotFill& f : prefetch_plan_.fills) (void)planner_.invalidate(f.expert.value);
      ++faults_;
      return s.with_context("prefetch failed after planning (%zu speculative experts dropped)",
                            prefetch_plan_.fills.size());
    }
    if (!before_forward) resident_dirty_ = false;
    total_copies_ += prefetch_plan_.fills.size() * copies_per_fill_;
    speculative_bytes_ += prefetch_plan_.fills.size() * bytes_per_expert;
    return prefetch_view(bytes_per_expert);
  }

  /// A forward of any width (e.g. a whole prompt), served in rounds whose experts are disjoint. Round r + 1's
  /// copies are enqueued on the fill stream (copy_stream(), or `stream` itself with an inline staging policy,
  /// which then does not overlap) before round r's consumer runs, so they overlap it; a buffer is refilled only
  /// after the consumer of the round that read it (edge 10); `stream` waits for each round's copies before its
  /// consumer's work (edge 3) and becomes the owner. The host never waits for the device (beyond the staging
  /// guard, edge 8).
  /// WideAdmission::stream (default): resident experts are read from their pool slots without touching the
  /// planner or the policy, spread over the rounds (every round but the last gets an equal share of their rows,
  /// so each consumer has work while the next fill streams); the others stream through the stream slots in
  /// ascending order, runs of consecutive ids as one copy per dense region; the pool is left exactly as it was.
  /// WideAdmission::admit: ascending groups of capacity / 2 go through the pool as prepare_unique() calls would
  /// (round r + 1 may not evict round r's experts). Stream admission on a cache without stream slots
  /// (CacheOptions::stream_slots < 2) is served as admit (WideSummary::fell_back, said once on the log).
  /// @param topk_ids  top-k routing ids in host memory, read during the call only: duplicates fine, negative =
  ///                  padding; at most CacheOptions::max_wide_ids of them
  /// @param stream    the consumer stream: each round's work goes on it; refused while capturing
  /// @param consumer  `consumer(const WideRound&)`, called once per round on this thread: enqueues the round's
  ///                  work on `stream` and returns a Status (an exception is caught as runtime_failure). The
  ///                  round's view holds for that work (cache/views.hpp, WideRound). It must not call into
  ///                  this cache.
  /// @param options   admission, how a round's missing experts are copied (WideCopy: runs, one span of ids, or
  ///                  the cheaper under options.cost) and batching (WideOptions)
  /// @return what the forward did (WideSummary), once every round's consumer succeeded. Errors before anything
  ///         changes: too_many_experts (more than max_wide_ids ids), expert_out_of_range, capture_unsupported
  ///         (`stream` is capturing), a staging policy's precheck. A consumer that fails ends the forward with
  ///         its Status (context: the round); a runtime failure drops what the failing round was filling
  ///         (admit: as prepare() does) and counts a fault. Either way no round is half published: stream
  ///         admission leaves the pool as it was; admit leaves it as after the rounds planned so far (rounds
  ///         0..r + 1 when round r's consumer failed). The device forward map then holds the last uploaded
  ///         round's; the next prepare() uploads its own.
  template <class Consumer>
    requires std::is_invocable_r_v<Status, Consumer&, const WideRound&>
  Result<WideSummary> prepare_wide(std::span<const std::int32_t> topk_ids, Stream stream, Consumer&& consumer,
                                   WideOptions options = {}) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::prepare_wide");
    // Without stream slots the forward still works: through the pool (admit), which is not scan
    // resistant; said once on the cache's log (silent without one) and in the summary.
    const bool fell_back = options.admission == WideAdmission::stream && options_.stream_slots < 2;
    const bool streaming = options.admission == WideAdmission::stream && !fell_back;
    if (Status s = detail::wide_forward_allowed(*rt_, staging_, stream); !s) return s;
    if (Status s = detail::wide_unique(topk_ids, options_.num_experts, options_.max_wide_ids, wide_.rows, wide_.unique);
        !s) {
      return s;
    }
    // The per-expert row counts serve the stream rounds' split of the hits; zero again on return.
    const detail::ClearWideRowsOnExit clear_rows{wide_.unique, wide_.rows};
    // Validated: from here on the cache changes.
    forward_shadow_valid_ = false;  // the rounds overwrite the device forward map
    if (Status s = core_.wide_begin(stream); !s) {
      ++faults_;
      return s.with_context("prepare_wide: ordering the forward after earlier work");
    }
    WideSummary summary;
    summary.unique = static_cast<std::uint32_t>(wide_.unique.size());
    summary.admission = streaming ? WideAdmission::stream : WideAdmission::admit;
    summary.fell_back = fell_back;
    if (fell_back && !wide_fallback_logged_ && options_.log) {
      wide_fallback_logged_ = true;
      try {
        options_.log(join({options_.label,
                           ": prepare_wide serves wide forwards through the pool (WideAdmission::admit, not scan "
                           "resistant): CacheOptions::stream_slots is ",
                           DecimalText(options_.stream_slots), "; recommended_stream_slots() gives ",
                           DecimalText(recommended_stream_slots(options_.capacity, options_.top_k))}));
      } catch (...) {  // a failing log sink does not fail the forward
      }
    }
    last_copies_ = 0;
    Status s = streaming ? wide_stream_rounds(stream, consumer, summary, options)
                         : wide_admit_rounds(stream, consumer, summary);
    total_copies_ += summary.copies;
    last_copies_ = summary.copies;
    wide_bytes_ += summary.bytes;
    wide_rounds_ += summary.rounds;
    if (!s) return s;
    ++wide_forwards_;
    return summary;
  }

  /// Drops an expert (e.g. its weights changed). A resident expert's slot is freed and the resident map is
  /// uploaded on the fill stream (copy_stream(), or `stream` with an inline staging policy), ordered like a
  /// fill after the owner's readers and the last writer (edge 6); `stream` waits for the upload; the owner is
  /// unchanged and keeps reading. The slot is rewritten only by a later prepare() or prefetch(), after the
  /// readers of the previous forward; a pending speculative fill of it stays pending (the slot's next write
  /// waits for it, edge 11).
  /// @param expert  expert id in [0, num_experts); one that is not resident is a no-op (nothing enqueued)
  /// @param stream  the caller's stream; it waits for the resident-map upload
  /// @return ok; expert_out_of_range with the cache unchanged; the runtime's error when the upload fails, the
  ///         expert then staying dropped (the next prepare() re-uploads the resident map) and a fault counted
  Status invalidate(std::int32_t expert, Stream stream) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::invalidate");
    Result<SlotId> freed = planner_.invalidate(expert);
    if (!freed.ok()) return freed.status();
    if (!freed.value().valid()) return {};
    // A speculative fill of the slot still pending stays pending: the slot's next write waits
    // for it (edge 11).
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

  /// Token split of a forward wider than the cache: chunks of consecutive rows whose unique experts each fit
  /// the capacity (plan_token_chunks in planning/split.hpp, with this cache's top_k, capacity, num_experts).
  /// Reads no cache state.
  /// @param topk_ids  row-major [rows, top_k] routing ids in host memory; negative = padding
  /// @return the chunks, in row order; invalid_argument for a length that is not a multiple of top_k,
  ///         expert_out_of_range for an id >= num_experts, row_exceeds_capacity for a row needing more slots
  ///         than the cache has
  [[nodiscard]] Result<std::vector<TokenChunk>> plan_token_chunks(std::span<const std::int32_t> topk_ids) const {
    return expert_cache::plan_token_chunks(topk_ids, options_.top_k, options_.capacity, options_.num_experts);
  }
  /// Expert split of a forward wider than the cache: groups for prepare_unique() (plan_expert_groups in
  /// planning/split.hpp, with this cache's top_k, capacity, num_experts). Reads no cache state.
  /// @param topk_ids  row-major [rows, top_k] routing ids in host memory; negative = padding
  /// @return ascending groups of at most capacity ids, group 0 flagged include_shared (one empty group for no
  ///         ids); invalid_argument for a length that is not a multiple of top_k, expert_out_of_range for an
  ///         id >= num_experts
  [[nodiscard]] Result<std::vector<ExpertGroup>> plan_expert_groups(std::span<const std::int32_t> topk_ids) const {
    return expert_cache::plan_expert_groups(topk_ids, options_.top_k, options_.capacity, options_.num_experts);
  }

  /// @return the counters since construction (CacheStats), taken from the host; the device is not read
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
    s.wide_forwards = wide_forwards_;
    s.wide_rounds = wide_rounds_;
    s.wide_hits = wide_hits_count_;
    s.wide_streamed = wide_streamed_count_;
    s.wide_bytes = wide_bytes_;
    s.slot_bytes = storage_.slot_bytes() + 2 * map_bytes();
    s.host_bytes = storage_.host_bytes() + core_.staging_bytes();
    return s;
  }

  /// The host pools (write the experts' weights here, before the first prepare: host_tensor(t, expert)) and
  /// the slot buffers.
  /// @return the cache's storage, alive as long as the cache
  [[nodiscard]] StorageType& storage() noexcept { return storage_; }
  /// @return the cache's storage (read-only)
  [[nodiscard]] const StorageType& storage() const noexcept { return storage_; }
  /// @return the host planner: residency, policy state and counters (ForwardPlanner)
  [[nodiscard]] const ForwardPlanner<EvictionPolicy>& planner() const noexcept { return planner_; }
  /// @return the plan of the last accepted prepare() or prepare_unique() (or admit round): unique experts,
  ///         fills, evictions; overwritten by the next one
  [[nodiscard]] const ForwardPlan& last_plan() const noexcept { return plan_; }
  /// @return the plan of the last prefetch() that passed validation; overwritten by the next one
  [[nodiscard]] const PrefetchPlan& last_prefetch() const noexcept { return prefetch_plan_; }
  /// @return the layout the cache was built with
  [[nodiscard]] const Layout& layout() const noexcept { return layout_; }
  /// @return the construction options (with the callback of set_stats_callback)
  [[nodiscard]] const CacheOptions& options() const noexcept { return options_; }
  /// @return the cache-owned copy stream the fills run on; nullopt with an inline staging policy (fills on the
  ///         caller's stream)
  [[nodiscard]] std::optional<Stream> copy_stream() const noexcept { return core_.copy_stream(); }
  /// @return the stream of the last accepted prepare-family call (where the slots are read); nullopt before
  ///         the first
  [[nodiscard]] std::optional<Stream> owner() const noexcept { return core_.owner(); }
  /// @return the host resident map: [num_experts] expert -> slot, -1 when not resident (prefetch() fills
  ///         included); valid until the cache is destroyed, changed by each call
  [[nodiscard]] std::span<const std::int32_t> resident_map_host() const noexcept { return planner_.resident_map(); }
  /// @return the host forward map: [num_experts] the last accepted forward's experts -> slot, else -1
  [[nodiscard]] std::span<const std::int32_t> forward_map_host() const noexcept { return planner_.forward_map(); }
  /// @return the device resident map (ForwardView::resident_map): [num_experts] int32, fixed for the cache's
  ///         lifetime
  [[nodiscard]] const std::int32_t* resident_map_device() const noexcept { return view_.resident_map; }
  /// Whether the device resident map is behind the host's (a prefetch() since the last upload:
  /// the next prepare() uploads it).
  /// @return true until the next successful upload (true at construction: the device map starts unwritten)
  [[nodiscard]] bool resident_map_behind() const noexcept { return resident_dirty_; }
  /// @return the device forward map (ForwardView::expert_map): [num_experts] int32, fixed for the cache's
  ///         lifetime
  [[nodiscard]] const std::int32_t* forward_map_device() const noexcept { return view_.expert_map; }

  /// Replaces CacheOptions::stats_callback and stats_every. Not thread-safe: call it between cache calls.
  /// @param callback  receives stats(), on the calling thread, from a successful prepare() or prepare_unique()
  ///                  after which stats().prepare_calls is a multiple of `every`; empty = none
  /// @param every     the period in accepted forwards; 0 = never
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
  // The pool's slots plus the stream slots (checked here: the storage is sized from it).
  static CacheShape storage_shape(CacheShape pool, const CacheOptions& o) {
    if (o.stream_slots < 0 || o.stream_slots > o.num_experts) {
      throw Error(ErrorCode::invalid_argument, join({"stream_slots must be in [0, num_experts=", DecimalText(o.num_experts),
                                                     "], got ", DecimalText(o.stream_slots)}));
    }
    if (o.max_wide_ids < 0) {
      throw Error(ErrorCode::invalid_argument, join({"max_wide_ids must be >= 0, got ", DecimalText(o.max_wide_ids)}));
    }
    return CacheShape{pool.num_experts, pool.capacity + o.stream_slots};
  }
  // With stream slots, room in the staging ring for every round's map uploads of one wide
  // forward (a round per half of the stream slots, or per capacity / 2 admitted), so the host
  // does not wait for a staging buffer inside a forward.
  static std::size_t ring_size(const CacheOptions& o) {
    if (o.stream_slots < 2 || o.capacity < 1) return o.staging_ring;
    const auto experts = static_cast<std::size_t>(std::max(o.num_experts, 1));
    const auto half = static_cast<std::size_t>(o.stream_slots / 2);
    const auto group = static_cast<std::size_t>(std::max(o.capacity / 2, 1));
    return std::max(o.staging_ring, detail::wide_ring_buffers(experts, std::min(half, group)));
  }


  // The device forward map of wide round r: two buffers used alternately, like the stream-slot
  // halves, so round r + 1's map is written while round r's consumer reads the other one.
  [[nodiscard]] std::int32_t* round_map_device(std::size_t r) noexcept {
    return reinterpret_cast<std::int32_t*>(r % 2 == 0 ? forward_device_.data() : wide_device_.data());
  }
  // Uploads `map` as round r's forward map on the fill stream `f`, inside the round's
  // wide_fill: ordered after the consumer that last read the buffer (edge 10) and before the
  // round's `ready` (edge 3). On the consumer stream it would be a host->device copy queued in
  // the copy engine behind the next round's fill, which serialises every consumer behind the
  // following fill (docs/design.md "Wide forwards").
  Status upload_round_map(const std::int32_t* map, std::size_t r, Stream f) noexcept {
    return core_.upload_map(map, round_map_device(r), f);
  }

  // WideAdmission::stream: detail::run_stream_rounds on the planner's pool, round maps on the
  // fill stream (into round_map_device), the pool's speculative fills a hit reads waited for first
  // (edge 9), a stale resident map uploaded with the first fill.
  template <class Consumer>
  Status wide_stream_rounds(Stream stream, Consumer& consumer, WideSummary& summary,
                            const WideOptions& options) noexcept {
    const auto resident = planner_.resident_map();
    struct Hooks {
      ExpertCacheWithEdges& c;
      Consumer& consumer;
      std::span<const std::int32_t> resident;
      Stream stream;
      Status before_rounds(std::span<const std::int32_t> hits) noexcept {
        for (const std::int32_t e : hits) {
          if (Status s = c.core_.wait_speculative(static_cast<std::size_t>(resident[static_cast<std::size_t>(e)]), stream);
              !s) {
            return s.with_context("prepare_wide: waiting for a speculative fill");
          }
        }
        return {};
      }
      MapUpload resident_upload() noexcept { return c.resident_dirty_ ? c.resident_upload() : MapUpload{}; }
      void uploaded() noexcept { c.resident_dirty_ = false; }
      std::int32_t* round_map(std::size_t r) noexcept { return c.round_map_device(r); }
      ForwardView view() const noexcept { return c.view_; }
      Status consume(const WideRound& round) noexcept { return detail::call_wide_consumer(consumer, round); }
      void served(std::size_t hits, std::size_t streamed) noexcept {
        c.wide_hits_count_ += hits;
        c.wide_streamed_count_ += streamed;
      }
      void fault() noexcept { ++c.faults_; }
    } hooks{*this, consumer, resident, stream};
    return detail::run_stream_rounds(core_, staging_, *rt_, storage_, stream, resident, options_.capacity,
                                     options_.stream_slots, total_bytes_per_expert(layout_.tensors()), options, wide_,
                                     detail::StreamRoundHooks::of(hooks), summary);
  }

  // WideAdmission::admit: ascending groups of capacity / 2 through the planner. With room for
  // two groups, round r + 1 is planned (keeping round r's experts) and filled before round r's
  // consumer; a one-slot cache plans each round after the previous consumer.
  template <class Consumer>
  Status wide_admit_rounds(Stream stream, Consumer& consumer, WideSummary& summary) noexcept {
    const std::size_t group = static_cast<std::size_t>(std::max(1, options_.capacity / 2));
    const bool overlap = 2 * group <= static_cast<std::size_t>(options_.capacity);
    const std::size_t n = wide_.unique.size();
    const std::size_t rounds = std::max<std::size_t>(1, (n + group - 1) / group);
    const std::uint64_t bytes_per_expert = total_bytes_per_expert(layout_.tensors());
    const auto ids = [&](std::size_t r) {
      const std::size_t b = std::min(n, r * group);
      return std::span<const std::int32_t>(wide_.unique).subspan(b, std::min(n, b + group) - b);
    };
    std::uint32_t round_hits = 0, round_misses = 0, next_hits = 0, next_misses = 0;
    const auto plan_round = [&](std::size_t r) noexcept -> Status {
      const auto keep = overlap && r > 0 ? ids(r - 1) : std::span<const std::int32_t>();
      if (Status p = planner_.plan_unique(ids(r), plan_, keep); !p) return p;
      next_hits = plan_.hits;
      next_misses = plan_.misses;
      if (!plan_.fills.empty()) resident_dirty_ = true;
      // Always a wide_fill: the round's map goes on the fill stream even when nothing is copied.
      const bool upload = resident_dirty_;
      Status s = core_.wide_fill(stream, r % 2, upload ? resident_upload() : MapUpload{}, [&](Stream f) noexcept {
        for (const SlotFill& x : plan_.fills) {
          if (Status w = core_.order_slot_write(x.slot.index(), f); !w) return w;
        }
        if (Status m = upload_round_map(planner_.forward_map().data(), r, f); !m) return m;
        return staging_.issue(*rt_, f, storage_, std::span<const SlotFill>(plan_.fills));
      });
      if (s && upload) resident_dirty_ = false;
      if (s) {
        const auto map = planner_.forward_map();
        for (const ExpertId e : plan_.unique) {
          if (Status w = core_.wait_speculative(static_cast<std::size_t>(map[e.index()]), stream); !w) return w;
        }
        summary.hits += plan_.hits;
        summary.admitted += plan_.misses;
        summary.copies += plan_.fills.size() * copies_per_fill_;
        summary.bytes += plan_.fills.size() * bytes_per_expert;
      } else {
        // As roll_back(): the round's slots are unknown; drop them, re-upload the map next time.
        for (const SlotFill& f : plan_.fills) (void)planner_.invalidate(f.expert.value);
        resident_dirty_ = true;
      }
      return s;
    };
    Status s = plan_round(0);
    for (std::size_t r = 0; s && r < rounds; ++r) {
      if (r > 0 && !overlap) s = plan_round(r);
      round_hits = next_hits;
      round_misses = next_misses;
      if (s) s = core_.wide_acquire(stream);
      if (s) {
        const auto map = planner_.forward_map();
        const auto experts = ids(r);
        wide_.round.assign(experts.begin(), experts.end());
        wide_.slots.clear();
        for (const std::int32_t e : wide_.round) wide_.slots.push_back(map[static_cast<std::size_t>(e)]);
      }
      if (s && overlap && r + 1 < rounds) s = plan_round(r + 1);
      if (!s) {
        ++faults_;
        return s.with_context("prepare_wide (admit): round %zu of %zu", r, rounds);
      }
      WideRound round;
      round.view = view_;
      round.view.expert_map = round_map_device(r);
      round.view.hits = round_hits;
      round.view.misses = round_misses;
      round.view.generation = planner_.counters().generation;
      round.experts = wide_.round;
      round.slots = wide_.slots;
      round.index = static_cast<std::uint32_t>(r);
      round.rounds = static_cast<std::uint32_t>(rounds);
      if (Status cs = detail::call_wide_consumer(consumer, round); !cs) return cs;
      ++summary.rounds;
      s = core_.wide_release(stream, r % 2);
      if (!s) {
        ++faults_;
        return s.with_context("prepare_wide (admit): releasing round %zu", r);
      }
    }
    return s;
  }

  template <bool Unique>
  Result<ForwardView> prepare_impl(std::span<const std::int32_t> ids, Stream stream) noexcept {
    if constexpr (requires { staging_.precheck(*rt_, stream); }) {
      if (Status s = staging_.precheck(*rt_, stream); !s) return s;
    }
    Status planned = Unique ? planner_.plan_unique(ids, plan_) : planner_.plan_topk(ids, plan_);
    if (!planned) return planned;  // validation failed: nothing changed
    return serve_plan(stream);
  }

  // The planned forward (plan_) made resident and published: the part prepare() and
  // prepare_unique() share, one copy for both.
  Result<ForwardView> serve_plan(Stream stream) noexcept {
    const bool writes = !plan_.fills.empty() || resident_dirty_;
    Status s = core_.write(stream, writes ? WritePurpose::fill : WritePurpose::read_only, resident_upload(),
                           [&](Stream fill) noexcept {
                             if (core_.any_speculative_pending()) {
                               for (const SlotFill& f : plan_.fills) {
                                 if (Status w = core_.order_slot_write(f.slot.index(), fill); !w) return w;
                               }
                             }
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
  // waits for each one's own event. Slots this forward fills again were waited for by the
  // fill's stream (order_slot_write, edge 11).
  // Runs on every prepare: with no fill pending (a cache that never prefetched, or all waited
  // for) it returns before touching the plan.
  Status wait_speculative_fills(Stream stream) noexcept {
    if (!core_.any_speculative_pending()) return {};
    const auto map = planner_.forward_map();
    for (const ExpertId e : plan_.unique) {
      if (!core_.any_speculative_pending()) break;  // the rest cannot be pending
      if (Status s = core_.wait_speculative(static_cast<std::size_t>(map[e.index()]), stream); !s) return s;
    }
    return {};
  }

  PrefetchView prefetch_view(std::uint64_t bytes_per_expert) const noexcept {
    return detail::prefetch_view_of(prefetch_plan_, bytes_per_expert);
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
  RuntimeBuffer<Runtime> wide_device_;  // the odd wide rounds' forward map (round_map_device)
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
  // Wide forwards: scratch sized at construction (num_experts entries each), and counters.
  detail::WideScratch wide_;
  bool wide_fallback_logged_ = false;
  std::uint64_t wide_forwards_ = 0, wide_rounds_ = 0, wide_hits_count_ = 0, wide_streamed_count_ = 0, wide_bytes_ = 0;
};

}  // namespace detail

// The public cache type: every ordering edge on.
/// The cache, composed from compile-time policies (see detail::ExpertCacheWithEdges for its
/// members; RowCache and WholeExpertCache in cache/presets.hpp are the standard instantiations).
template <template <class> class Storage, eviction_policy EvictionPolicy, class StagingPolicy, expert_layout Layout,
          allocating_runtime Runtime>
  requires staging_policy_for<StagingPolicy, Runtime, Storage>
using ExpertCache = detail::ExpertCacheWithEdges<Storage, EvictionPolicy, StagingPolicy, Layout, Runtime, OrderingEdges>;

}  // namespace expert_cache::inline v0
