#pragma once
/// DeviceExpertCache: the expert cache planned ON THE DEVICE. This header also brings its options
/// (device_cache/options.hpp) and the SimRuntime executor (device_cache/sim_executor.hpp), so it
/// alone gives the whole simulated cache.
///
/// It plans through the same library as ExpertCache: the same Storage (TensorMajorStorage /
/// ExpertMajorStorage and their copy_regions()), the same Layout (expert_layout), the same slot
/// buffers and ForwardView, and OrderingCore for every stream edge. What changes is who plans: the
/// router's top-k ids stay in device memory and the LRU planning step of planning/device_plan.hpp
/// (decisions equal to ForwardPlanner<Lru>) runs as a device op, writing the forward map, the
/// resident map and the fill list into the device plan state; a fill op then copies the listed
/// experts from the host pools into their slots. The host never sees the ids, so nothing
/// synchronises and the whole call can sit inside a captured CUDA graph that is replayed with new
/// ids.
///
///   DeviceExpertCache<Storage, Layout, Runtime>
///     prepare(device_ids, n_ids, X)  plan + fill on X (inline mode), returns the ForwardView
///     prepare_group(g, X)            overflow group g >= 1 of the last prepare (empty when the
///                                    forward had fewer groups: a graph provisions max_groups)
///     invalidate(e, X)               a device invalidate, ordered like any write
///     set_prior(bias, X)             DeviceCrf's frequency prior (one bias per expert), uploaded
///                                    on X, ordered like invalidate
///     prefetch(device_ids, n, P, o)  speculative fills planned on the device (plan_prefetch), on P;
///     prefetch(host_ids, P, o)       the next prepare (any stream) is ordered after them
///     prepare_wide(host_ids, X, c)   a forward wider than the pool (a prompt), eagerly in rounds:
///                                    residents read in place, the others streamed through the
///                                    stream slots by the copy engine, nothing admitted
///     stats(), device_stats()        from the device stats (mapped memory) + host counters
///     take_errors()                  read and clear the device error word (bad ids, overflow)
///     drop_unfilled(X)               fill_by_consumer: drop the last group's misses when its
///                                    consumer did not run
///
/// Inline mode: the fill stream is the caller's stream. The ids are written by a router kernel
/// on that stream, so plan -> fill -> consumer are ordered by stream order alone and a capture
/// of the caller's stream holds the whole call (no fork/join of a copy stream into the graph,
/// no event nodes). The core still orders calls that move between streams (edges 1, 2, 6 of
/// docs/design.md's table; the device path adds no edge of its own, see "Device-planned cache").
///
/// Every pointer of the returned view (slot tensors, forward map, resident map) is fixed for the
/// cache's lifetime, so a graph captured once stays correct on replay. view.hits / view.misses
/// are 0: the counts exist only on the device (stats() reads them from the mapped mirror).
///
/// Overlap (DeviceCacheOptions::overlap; docs/design.md edge D4 and "Overlap"): the fill may run
/// while the consumer already computes. The plan tags each slot the forward uses with the fill
/// sequence value its content must have reached (slot_needed); the fill stores that value into
/// the slot's ready word (slot_ready, release) once its bytes landed; a consumer given
/// readiness() waits for each slot's word (acquire) before it reads that slot, so it starts on
/// the resident experts and takes each missing one as soon as it landed. Values only grow:
/// a replayed graph needs no reset.
///
/// Compute from host (DeviceCacheOptions::fill_by_consumer; docs/design.md edge D9): prepare
/// plans only; view.missing flags the misses, which the consumer copies from the host pools into
/// their slots itself (MoeConsumer::run_one_pass reads them over the link as it computes).
///
/// The planning execution is a small executor per runtime (DevicePlanExecutorFor<Runtime>,
/// device_cache/executor.hpp): SimPlanExecutor in device_cache/sim_executor.hpp (simulated launches
/// that run the shared planning code with SequentialBlock and declare what they touch),
/// CudaPlanExecutor in device_cache/cuda_executor.cuh (the kernels of kernels/plan_kernels.cuh and
/// kernels/plan_fill.cuh).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/cache/expert_cache.hpp"
#include "expert_cache/core/ordering_core.hpp"
#include "expert_cache/device_cache/executor.hpp"
#include "expert_cache/device_cache/options.hpp"
#include "expert_cache/device_cache/sim_executor.hpp"
#include "expert_cache/planning/device_plan.hpp"
#include "expert_cache/runtime/resources.hpp"
#include "expert_cache/storage/copy_region.hpp"
#include "expert_cache/storage/slot_storage.hpp"

namespace expert_cache::inline v0 {

// ---- the cache ----------------------------------------------------------------------------

namespace detail {

template <template <class> class Storage, expert_layout Layout, allocating_runtime Runtime, class Edges,
          device_plan_policy Policy = DeviceLru>
class DeviceExpertCacheWithEdges {
 public:
  using Stream = typename Runtime::Stream;
  using StorageType = Storage<Runtime>;
  using LayoutType = Layout;
  using PolicyType = Policy;
  using Executor = typename DevicePlanExecutorOf<Runtime, Policy>::type;
  static_assert(device_plan_executor<Executor>);

  /// Builds the cache: host pools, capacity + stream_slots slots, the device plan state and the executor
  /// (FillEngine::automatic resolved here, measuring the link when no stored profile is given). Writes one line
  /// to `options.log` when a sink is given.
  /// @param rt       the runtime that allocates memory and enqueues every call's work; it must outlive the cache
  /// @param options  sizes, modes, sinks and caller memory (DeviceCacheOptions); the cache keeps its own copy
  /// @param layout   the per-expert tensors and their sizes; validated here
  /// @throws Error invalid_capacity for capacity outside [1, num_experts]; invalid_argument for stream_slots
  ///         outside [0, num_experts], max_wide_ids < 0, max_ids <= 0, fill_by_consumer with overlap or with
  ///         FillEngine::copy_engine, speculate_on_copy_engine without overlap, crf_decay_q32 outside [1, 2^32 - 1], ready_first_regions naming a copy
  ///         region the storage lacks, a link_profile of another device or expert size, FillEngine::copy_engine on
  ///         CUDA with CUDA_DEVICE_MAX_CONNECTIONS=1; the layout's validate()
  ///         error; the storage's invalid_argument for bad caller memory; the runtime's error when an
  ///         allocation, a stream or an event cannot be made
  [[gnu::cold]] DeviceExpertCacheWithEdges(Runtime& rt, DeviceCacheOptions options, Layout layout)
      : rt_(&rt),
        options_(resolve_fill_engine(validated(std::move(options)), layout)),
        layout_(validated(layout)),
        storage_(rt, CacheShape{options_.num_experts, options_.capacity + options_.stream_slots}, layout_.tensors(),
                 options_.memory),
        // Inline mode (fills on the caller's stream). The staging ring holds the host-id
        // prefetch uploads and, with stream slots, every round map of one wide forward.
        core_(rt, false, static_cast<std::size_t>(options_.num_experts), wide_ring_size(options_)),
        exec_(rt, options_.num_experts, options_.capacity, options_.max_ids, storage_.copy_regions(), options_),
        prefetch_ids_(rt, static_cast<std::size_t>(options_.num_experts) * sizeof(std::int32_t), MemoryKind::device),
        hints_(options_.num_experts) {
    if (options_.stream_slots >= 2) {
      const std::size_t map = static_cast<std::size_t>(options_.num_experts) * sizeof(std::int32_t);
      core_.add_wide_stream();
      wide_state_.emplace(rt, map);
      wide_.reserve(static_cast<std::size_t>(options_.num_experts), storage_.copy_regions().count);
    }
    for (std::size_t t = 0; t < num_expert_tensors; ++t) view_.tensors[t] = storage_.slot_tensor(t);
    view_.expert_map = exec_.state().forward_map.data;
    view_.resident_map = exec_.state().resident_map.data;
    if (options_.fill_by_consumer) view_.missing = exec_.state().missing.data;
    copies_per_fill_ = storage_.copy_regions().count;
    bytes_per_expert_ = total_bytes_per_expert(layout_.tensors());
    if (options_.log) {
      const CacheStats s = stats();
      options_.log(join({options_.label, ": device-planned ", Policy::name, "/inline/", StorageType::name, "/",
                         Layout::name, ", ", DecimalText(options_.capacity), " of ", DecimalText(options_.num_experts),
                         " experts, up to ", DecimalText(options_.max_ids), " ids, slot bytes ",
                         DecimalText(s.slot_bytes), ", host bytes ", DecimalText(s.host_bytes), ", fill engine ",
                         to_string(options_.fill_engine)}));
    }
  }
  // The executor leaves the copy engine's proxy before any member frees memory (CUDA: edge P5 of
  // device_cache/copy_proxy.cuh).
  ~DeviceExpertCacheWithEdges() {
    if constexpr (requires { exec_.release(); }) exec_.release();
  }
  DeviceExpertCacheWithEdges(const DeviceExpertCacheWithEdges&) = delete;
  DeviceExpertCacheWithEdges& operator=(const DeviceExpertCacheWithEdges&) = delete;

  /// Plans the forward of `n_ids` top-k ids in device memory and fills its group 0 (its first W unique
  /// experts, W = the capacity or round_width), on `stream`: inline mode, so plan -> fill -> consumer are
  /// ordered by `stream` alone and the call can be captured and replayed with new ids. The core orders it
  /// after the owner's readers and the last writer (edges 1, 2) and makes `stream` the owner. With
  /// DeviceCacheOptions::overlap the fill may still run when the consumer starts: it waits per slot with
  /// readiness(); with fill_by_consumer nothing is filled and view.missing flags the misses.
  /// @param device_ids  `n_ids` ids in device memory, written on `stream` or ordered before the call: -1 is
  ///                    padding; any other id outside [0, E) is dropped, counted (device_stats().bad_ids) and
  ///                    flagged (plan_error_bad_id)
  /// @param n_ids       number of ids, in [0, max_ids]
  /// @param stream      the consumer stream
  /// @param mode        DeviceForward::single (default): more unique experts than one group is an overflow
  ///                    flagged in the error word (plan_error_overflow); in_rounds: the caller serves every
  ///                    group (prepare_group 1..max_groups(n_ids, round_width) - 1 after this call), so an
  ///                    overflow is counted in stats() but not flagged, and the groups list the experts
  ///                    resident at the forward's start first
  /// @param round_width in_rounds only: experts per group, 1..capacity (0: the capacity), so that a prefetch
  ///                    of the next group can fill beside the group being consumed
  /// @return the view (cache/views.hpp): pointers fixed for the cache's lifetime, so a captured graph stays
  ///         correct; hits and misses 0 (the counts exist only on the device: stats()); its contents hold for
  ///         work enqueued on `stream` after the call, until the next prepare() or prepare_group(). Errors,
  ///         nothing enqueued: invalid_argument (n_ids outside [0, max_ids], round_width outside [0, capacity]
  ///         or non-zero for single, null ids with n_ids > 0), a stream the runtime refuses. A runtime failure
  ///         after the plan was enqueued makes the next call drop the planned experts first (their slots may
  ///         not hold their bytes) and counts a fault.
  Result<ForwardView> prepare(const std::int32_t* device_ids, std::int32_t n_ids, Stream stream,
                              DeviceForward mode = DeviceForward::single, std::int32_t round_width = 0) noexcept {
    if (n_ids < 0 || n_ids > options_.max_ids) {
      return Status::format(ErrorCode::invalid_argument, "%s: prepare of %d ids (accepted: 0..%d, max_ids)",
                            options_.label.c_str(), n_ids, options_.max_ids);
    }
    if (round_width < 0 || round_width > options_.capacity || (round_width != 0 && mode != DeviceForward::in_rounds)) {
      return Status::format(ErrorCode::invalid_argument,
                            "%s: prepare with round_width %d (accepted: 0..%d, the capacity, and only in rounds)",
                            options_.label.c_str(), round_width, options_.capacity);
    }
    if (device_ids == nullptr && n_ids > 0) {
      return Status::format(ErrorCode::invalid_argument, "%s: prepare of %d ids from a null pointer",
                            options_.label.c_str(), n_ids);
    }
    if (Status s = check_stream(stream, "prepare"); !s) return s;
    Status s = write(stream, WritePurpose::fill, [&](Stream f, bool& planned) noexcept {
      return exec_.plan_forward_fill(f, device_ids, n_ids, planned, mode == DeviceForward::in_rounds, round_width);
    });
    if (!s) return s.with_context("%s: prepare(%d ids)", options_.label.c_str(), n_ids);
    round_width_ = round_width;
    ++prepare_calls_;
    view_.generation = ++generation_;
    return view_;
  }

  /// Overflow group `group` of the last prepare(), W its group width (the capacity, or its round_width): plans
  /// ids [g*W, (g+1)*W) of its unique list and fills them, on `stream`, ordered like prepare(). A group the
  /// forward does not have is empty: the forward map is cleared, nothing is filled, the consumer computes
  /// nothing (so a graph can provision max_groups() groups).
  /// @param group   the group, in [1, max_groups(max_ids, W))
  /// @param stream  the consumer stream
  /// @return the view, as prepare()'s, its expert map holding group `group`'s experts. Errors, nothing
  ///         enqueued: invalid_argument (group outside the range), a stream the runtime refuses; a runtime
  ///         failure is handled as in prepare()
  Result<ForwardView> prepare_group(std::int32_t group, Stream stream) noexcept {
    const std::int32_t most = max_groups(options_.max_ids, round_width_);
    if (group < 1 || group >= most) {
      return Status::format(ErrorCode::invalid_argument,
                            "%s: prepare_group(%d) outside 1..%d (max_groups(max_ids, the last prepare's width) = %d)",
                            options_.label.c_str(), group, most - 1, most);
    }
    if (Status s = check_stream(stream, "prepare_group"); !s) return s;
    Status s = write(stream, WritePurpose::fill, [&](Stream f, bool& planned) noexcept {
      return exec_.plan_group_fill(f, group, planned);
    });
    if (!s) return s.with_context("%s: prepare_group(%d)", options_.label.c_str(), group);
    view_.generation = ++generation_;
    return view_;
  }

  /// Drops `expert` on the device (no-op there when it is not resident). Enqueued on `stream`, ordered like a
  /// write: after the owner's readers and the last writer (edge 6); the owner keeps reading. Capturable.
  /// @param expert  expert id in [0, num_experts)
  /// @param stream  the stream the device invalidate runs on
  /// @return ok; expert_out_of_range or a stream the runtime refuses, nothing enqueued; the runtime's error
  ///         when enqueueing fails (counted as a fault)
  Status invalidate(std::int32_t expert, Stream stream) noexcept {
    if (expert < 0 || expert >= options_.num_experts) {
      return Status::format(ErrorCode::expert_out_of_range, "%s: invalidate(%d): expert outside [0, %d)",
                            options_.label.c_str(), expert, options_.num_experts);
    }
    if (Status s = check_stream(stream, "invalidate"); !s) return s;
    Status s = write(stream, WritePurpose::invalidate, [&](Stream f, bool&) noexcept { return exec_.invalidate(f, expert); });
    if (!s) return s.with_context("%s: invalidate(%d)", options_.label.c_str(), expert);
    ++generation_;
    return {};
  }

  /// fill_by_consumer only: the consumer of the last planned group did not run (it failed, or
  /// was never enqueued), so the slots of that group's missing experts never received their
  /// bytes: drops those experts (each as invalidate() would), so that no later forward reads
  /// them; they miss again when next requested. Enqueued on `stream`, ordered like invalidate() (edge 6).
  /// Call it before the next prepare().
  /// @param stream  the stream the drop runs on
  /// @return ok. Errors, nothing enqueued: a cache without fill_by_consumer (ErrorCode::not_supported: its
  ///         fills copy every miss), a stream the runtime refuses; the runtime's error when enqueueing fails
  Status drop_unfilled(Stream stream) noexcept {
    if (!options_.fill_by_consumer) {
      return Status::format(ErrorCode::not_supported,
                            "%s: drop_unfilled without fill_by_consumer (the cache's fills copy every miss)",
                            options_.label.c_str());
    }
    if (Status s = check_stream(stream, "drop_unfilled"); !s) return s;
    Status s = write(stream, WritePurpose::invalidate, [&](Stream f, bool&) noexcept { return exec_.drop_missing(f); });
    if (!s) return s.with_context("%s: drop_unfilled", options_.label.c_str());
    ++generation_;
    return {};
  }

  /// DeviceCrf's frequency prior (docs/policies.md, "Frequency priors"): one bias per expert in
  /// CRF units (1.0 = what one request adds to an expert's CRF), added to the expert's CRF when
  /// victims are ranked; 2^30 or more pins the expert (crf_pin_bias). Replaces the whole table.
  /// Uploaded on `stream` through the core's staging ring and ordered like invalidate(): after
  /// every plan already enqueued, which read the old table (edges 1 and 6 of docs/design.md), and
  /// before the next call on any stream (edge 2: this stream is then the last writer). Capturable.
  /// @param bias    one finite bias >= 0 per expert ([num_experts]), host memory, read during the call only
  /// @param stream  the stream the upload runs on
  /// @return ok. Errors, nothing enqueued and the cache as it was: a policy that ranks without a prior
  ///         (DeviceLru, DeviceLfru: not_supported), not one entry per expert (invalid_argument), an entry
  ///         that is negative, NaN or infinite (invalid_argument), runtime_failure when the host table cannot
  ///         be allocated, a stream the runtime refuses; the runtime's error when the upload fails
  Status set_prior(std::span<const double> bias, Stream stream) noexcept {
    if (Status s = check_prior_shape(bias.size(), "set_prior"); !s) return s;
    for (std::size_t e = 0; e < bias.size(); ++e) {
      if (!std::isfinite(bias[e]) || bias[e] < 0.0) {
        return Status::format(ErrorCode::invalid_argument,
                              "%s: set_prior: the bias of expert %zu is %g (need a finite value >= 0)",
                              options_.label.c_str(), e, bias[e]);
      }
    }
    std::vector<std::uint64_t> q32;
    try {
      q32.resize(bias.size());
    } catch (...) {
      return Status::format(ErrorCode::runtime_failure, "%s: set_prior: no host memory for the table", options_.label.c_str());
    }
    constexpr double pin = static_cast<double>(crf_pin_bias) / static_cast<double>(crf_one);  // 2^30
    for (std::size_t e = 0; e < bias.size(); ++e) {
      q32[e] = bias[e] >= pin ? crf_pin_bias
                              : static_cast<std::uint64_t>(std::llround(bias[e] * static_cast<double>(crf_one)));
    }
    return upload_prior(q32.data(), stream, "set_prior");
  }

  /// The same from a table in the planner's Q32 (as PopularityTable::weighted_bias and
  /// pinned_bias return it: crf_one = 1.0, crf_pin_bias pins).
  /// @param bias    one Q32 bias per expert ([num_experts]), host memory, read during the call only
  /// @param stream  the stream the upload runs on
  /// @return ok. Errors, nothing enqueued and the cache as it was: not_supported (a policy without a prior),
  ///         invalid_argument (not one entry per expert), a stream the runtime refuses; the runtime's error when
  ///         the upload fails
  Status set_prior_q32(std::span<const std::uint64_t> bias, Stream stream) noexcept {
    if (Status s = check_prior_shape(bias.size(), "set_prior_q32"); !s) return s;
    return upload_prior(bias.data(), stream, "set_prior_q32");
  }

  /// Speculative fills of predicted experts (docs/prefetch.md), planned ON THE DEVICE
  /// on `stream` with ForwardPlanner<Lru>::plan_prefetch's rules (planning/device_plan.hpp,
  /// plan_prefetch): at most min(capacity, options.max_bytes / bytes-per-expert) fills; never a victim from
  /// the last prepared forward, an unused unexpired speculative fill or a resident the list names. Ordered
  /// like a write (edges 1, 2: after the owner's readers enqueued so far and after the last writer); the
  /// owner does not change and nothing waits for the fills now, so they overlap whatever the
  /// owner's stream runs next. The next prepare() (any stream) is ordered after them: this
  /// call's stream is then its last writer (edge 2), so a forward that uses a prefetched expert
  /// reads it complete, and a forward that does not still waits for this call's fills (the host
  /// cannot know which slots a device-planned fill wrote). Capturable, with ids that change
  /// between replays.
  /// Scores are not taken here: the ids are in device memory and the device plan takes them in the given
  /// order; an engine with scores passes its ids best first, or calls the host-ids overload below, which
  /// selects on the host.
  /// @param device_ids  `n_ids` predicted ids in device memory, best first, written on `stream` or ordered
  ///                    before the call (-1 is padding; other ids outside [0, E) are dropped and counted, as
  ///                    in prepare)
  /// @param n_ids       number of ids, in [0, num_experts]
  /// @param stream      the stream the plan and the fills run on
  /// @param options     byte budget and expiry (PrefetchOptions; scores must be empty, precision_feedback is
  ///                    ignored)
  /// @return a view that counts nothing (decisions are made on the device: stats() has speculative_issued /
  ///         used / wasted / bytes); nothing is enqueued for n_ids == 0 or a budget of no fill. Errors, nothing
  ///         enqueued: n_ids outside [0, E] (invalid_argument below 0, too_many_experts above E), null ids with
  ///         n_ids > 0, max_bytes < 0, expires_after == 0, min_score NaN or outside [0, 1] (invalid_argument),
  ///         scores (not_supported), a stream the runtime refuses. A runtime failure after the plan was
  ///         enqueued is handled as in prepare().
  Result<PrefetchView> prefetch(const std::int32_t* device_ids, std::int32_t n_ids, Stream stream,
                                PrefetchOptions options = {}) noexcept {
    Result<std::int32_t> max_fills = prefetch_budget(n_ids, options);
    if (!max_fills.ok()) return max_fills.status();
    if (!options.scores.empty()) {
      return Status::format(ErrorCode::not_supported,
                            "%s: prefetch from device ids takes no scores (%zu given): the device plan takes the "
                            "ids in the given order; select on the host (prefetch from host ids with scores) or "
                            "pass the ids best first",
                            options_.label.c_str(), options.scores.size());
    }
    if (device_ids == nullptr && n_ids > 0) {
      return Status::format(ErrorCode::invalid_argument, "%s: prefetch of %d ids from a null pointer",
                            options_.label.c_str(), n_ids);
    }
    if (Status s = check_stream(stream, "prefetch"); !s) return s;
    if (n_ids == 0 || max_fills.value() == 0) return PrefetchView{};
    Status s = write(stream, WritePurpose::speculative, [&](Stream f, bool& planned) noexcept {
      return exec_.prefetch(f, device_ids, n_ids, max_fills.value(), options.expires_after, planned,
                            options.evict_last_forward);
    });
    if (!s) return s.with_context("%s: prefetch(%d ids)", options_.label.c_str(), n_ids);
    ++generation_;
    return PrefetchView{};
  }

  /// The same for predicted ids in host memory, validated like ExpertCache::prefetch (every id in
  /// [0, E), at most E of them: otherwise refused before anything is enqueued), then uploaded on
  /// `stream` through the ordering core's staging ring (graph-safe like its map uploads). With
  /// options.scores the hints are selected on the host first, as ExpertCache::prefetch selects
  /// them (PrefetchOptions; HintSelector), and only the selected ids, highest score first, are
  /// uploaded and planned.
  /// @param predicted  predicted expert ids, best first, in [0, num_experts), at most num_experts of them; host
  ///                   memory, read during the call only
  /// @param stream     the stream the upload, the plan and the fills run on
  /// @param options    byte budget, expiry, scores and min_score (PrefetchOptions; precision_feedback is
  ///                   ignored)
  /// @return a view that counts skipped_unlikely only (the rest is decided on the device: stats()). Errors,
  ///         nothing enqueued: too_many_experts (more than E ids), expert_out_of_range, invalid_argument
  ///         (max_bytes < 0, expires_after == 0, and the scored-hint errors of PrefetchOptions), a stream the
  ///         runtime refuses. A runtime failure after the plan was enqueued is handled as in prepare().
  Result<PrefetchView> prefetch(std::span<const std::int32_t> predicted, Stream stream,
                                PrefetchOptions options = {}) noexcept {
    if (predicted.size() > static_cast<std::size_t>(options_.num_experts)) {
      return Status::format(ErrorCode::too_many_experts, "%s: prefetch got %zu predicted ids, more than the %d experts",
                            options_.label.c_str(), predicted.size(), options_.num_experts);
    }
    const auto n = static_cast<std::int32_t>(predicted.size());
    Result<std::int32_t> max_fills = prefetch_budget(n, options);
    if (!max_fills.ok()) return max_fills.status();
    for (const std::int32_t id : predicted) {
      if (id < 0 || id >= options_.num_experts) {
        return Status::format(ErrorCode::expert_out_of_range, "%s: prefetch of expert %d outside [0, %d)",
                              options_.label.c_str(), id, options_.num_experts);
      }
    }
    if (Status s = hints_.select(predicted, options.scores, options.min_score); !s) {
      return s.with_context("%s", options_.label.c_str());
    }
    if (Status s = check_stream(stream, "prefetch"); !s) return s;
    PrefetchView view;
    view.skipped_unlikely = hints_.skipped_unlikely();
    const std::span<const std::int32_t> chosen = hints_.ids();
    const auto n_chosen = static_cast<std::int32_t>(chosen.size());
    if (n_chosen == 0 || max_fills.value() == 0) return view;
    auto* ids = reinterpret_cast<std::int32_t*>(prefetch_ids_.data());
    Status s = write(stream, WritePurpose::speculative, [&](Stream f, bool& planned) noexcept {
      if (Status u = core_.upload_map(chosen.data(), ids, f, static_cast<std::size_t>(n_chosen)); !u) return u;
      return exec_.prefetch(f, ids, n_chosen, max_fills.value(), options.expires_after, planned,
                            options.evict_last_forward);
    });
    if (!s) return s.with_context("%s: prefetch(%d host ids)", options_.label.c_str(), n);
    ++generation_;
    return view;
  }

  /// A wide forward from HOST ids (a prompt, a large batch; cache/wide.hpp), served eagerly in rounds
  /// with stream admission: the pool's residents are read where they are, every other expert is
  /// copied from the host pools into the stream slots (DeviceCacheOptions::stream_slots) by the
  /// copy engine, never admitted: the device planner's state (residents, recency, counters) is
  /// exactly what it was, so the decode working set survives the prompt. Steps: the pool's
  /// resident map is read back on `stream`, ordered like invalidate() after every plan, fill and
  /// prefetch enqueued so far (edges 6, 2), and the host waits for that copy (edge D10); then the
  /// rounds run as ExpertCache's stream rounds (docs/design.md "Wide forwards": round r + 1's
  /// copies, on the core's wide stream, overlap round r's consumer; edges 3 and 10), each run of
  /// consecutive missing experts as one copy per dense region, a round's copies in one batched
  /// call where the runtime has one. Not capturable (the host waits for the read-back): the in-graph way to
  /// serve a wide forward is prepare(in_rounds) + prepare_group, whose rounds go through the pool.
  /// @param topk_ids  top-k routing ids in host memory, read during the call only: duplicates fine, negative =
  ///                  padding; at most max_wide_ids of them
  /// @param stream    the consumer stream: the read-back and each round's work go on it
  /// @param consumer  `consumer(const WideRound&)`, called once per round on this thread: enqueues the round's
  ///                  work on `stream` and returns a Status (an exception is caught as runtime_failure); each
  ///                  round's view has a forward-scoped expert map of its own (missing is null); it must not
  ///                  call into this cache
  /// @param options   stream admission, copy mode and batching (WideOptions)
  /// @return what the forward did (WideSummary), once every round's consumer succeeded. Errors before anything
  ///         is enqueued: admission admit (not_supported: use prepare(in_rounds) and prepare_group), no stream
  ///         slots (not_supported), more ids than max_wide_ids (too_many_experts), an id outside [0, E)
  ///         (expert_out_of_range), `stream` capturing (capture_unsupported), a stream the runtime refuses. A
  ///         consumer that fails (or throws) ends the forward with its status; a runtime failure is reported
  ///         with its round and counts a fault. The pool is never changed, so either way the cache stays as it
  ///         was and usable.
  template <class Consumer>
    requires std::is_invocable_r_v<Status, Consumer&, const WideRound&>
  Result<WideSummary> prepare_wide(std::span<const std::int32_t> topk_ids, Stream stream, Consumer&& consumer,
                                   WideOptions options = {}) noexcept {
    if (Status s = wide_allowed(stream, options); !s) return s;
    if (Status s = detail::wide_unique(topk_ids, options_.num_experts, options_.max_wide_ids, wide_.rows, wide_.unique);
        !s) {
      return s.with_context("%s: prepare_wide", options_.label.c_str());
    }
    const detail::ClearWideRowsOnExit clear_rows{wide_.unique, wide_.rows};
    if (Status s = read_back(stream, nullptr, 0); !s) return s;
    return serve_wide(stream, consumer, options);
  }

  /// The same from `n_ids` ids in DEVICE memory (a router's output, written on `stream` or
  /// ordered before the call): copied to pinned host memory together with the resident map
  /// (one wait for both), then validated and served as above.
  /// @param device_ids  `n_ids` top-k ids in device memory (negative = padding)
  /// @param n_ids       number of ids, at most max_wide_ids
  /// @param stream      the consumer stream: the read-back and each round's work go on it
  /// @param consumer    as above
  /// @param options     as above
  /// @return as above. Errors before anything is enqueued: those above, too_many_experts (n_ids above
  ///         max_wide_ids), invalid_argument (null ids with n_ids > 0), the runtime's error when the pinned
  ///         buffer for the ids cannot be grown. An id outside [0, E) is reported after the read-back
  ///         (expert_out_of_range); the cache is unchanged either way.
  template <class Consumer>
    requires std::is_invocable_r_v<Status, Consumer&, const WideRound&>
  Result<WideSummary> prepare_wide(const std::int32_t* device_ids, std::size_t n_ids, Stream stream, Consumer&& consumer,
                                   WideOptions options = {}) noexcept {
    if (Status s = wide_allowed(stream, options); !s) return s;
    if (n_ids > static_cast<std::uint64_t>(options_.max_wide_ids)) {
      return Status::format(ErrorCode::too_many_experts,
                            "%s: prepare_wide of %zu ids exceeds the configured maximum of %lld (max_wide_ids)",
                            options_.label.c_str(), n_ids, static_cast<long long>(options_.max_wide_ids));
    }
    if (device_ids == nullptr && n_ids > 0) {
      return Status::format(ErrorCode::invalid_argument, "%s: prepare_wide of %zu ids from a null pointer",
                            options_.label.c_str(), n_ids);
    }
    WideState& w = *wide_state_;
    if (w.ids_host.size() < n_ids * sizeof(std::int32_t)) {
      try {
        w.ids_host = RuntimeBuffer<Runtime>(*rt_, n_ids * sizeof(std::int32_t), MemoryKind::pinned_host);
      } catch (const Error& e) {
        return Status(e.code(), e.what()).with_context("%s: prepare_wide: host memory for %zu ids", options_.label.c_str(), n_ids);
      } catch (...) {
        return Status::format(ErrorCode::runtime_failure, "%s: prepare_wide: no host memory for %zu ids",
                              options_.label.c_str(), n_ids);
      }
    }
    if (Status s = read_back(stream, device_ids, n_ids); !s) return s;
    const std::span<const std::int32_t> ids(reinterpret_cast<const std::int32_t*>(w.ids_host.data()), n_ids);
    if (Status s = detail::wide_unique(ids, options_.num_experts, options_.max_wide_ids, wide_.rows, wide_.unique); !s) {
      return s.with_context("%s: prepare_wide", options_.label.c_str());
    }
    const detail::ClearWideRowsOnExit clear_rows{wide_.unique, wide_.rows};
    return serve_wide(stream, consumer, options);
  }

  /// Rounds (prepare + prepare_group 1..) a graph needs for forwards of up to n_ids ids.
  /// @param n_ids        the most ids of one forward
  /// @param round_width  experts per group (0, or any value outside [1, capacity]: the capacity)
  /// @return ceil(min(n_ids, E) / width), at least 1
  [[nodiscard]] std::int32_t max_groups(std::int64_t n_ids, std::int32_t round_width = 0) const noexcept {
    return plan_max_groups(n_ids, options_.num_experts, plan_group_width(round_width, options_.capacity));
  }

  /// Device counters from the mapped mirror (current while work runs; exact once the cache's
  /// streams are idle) plus the host's counters. promotions = misses (every miss inserts one
  /// expert); resident = inserted - evicted - invalidated. last_copies is 0: how many fills a
  /// step made is known only on the device; total_copies = (misses + speculative fills) * copies per fill,
  /// plus the wide forwards' copies.
  /// @return the counters (CacheStats)
  [[nodiscard]] CacheStats stats() const noexcept {
    const DevicePlanStats d = exec_.stats();
    const auto& o = core_.counters();
    CacheStats s;
    s.hits = d.hits;
    s.misses = d.misses;
    s.promotions = d.misses;
    s.evictions = d.evictions;
    s.invalidations = d.invalidations;
    s.resident = static_cast<std::int64_t>(d.misses) + static_cast<std::int64_t>(d.speculative_issued) -
                 static_cast<std::int64_t>(d.evictions) - static_cast<std::int64_t>(d.invalidations);
    s.capacity = options_.capacity;
    s.prepare_calls = prepare_calls_;
    s.generation = generation_;
    s.last_copies = 0;
    s.total_copies = (d.misses + d.speculative_issued) * copies_per_fill_;
    s.speculative_issued = d.speculative_issued;
    s.speculative_used = d.speculative_used;
    s.speculative_wasted = d.speculative_wasted;
    s.speculative_bytes = d.speculative_issued * bytes_per_expert_;
    s.owner_changes = o.owner_changes;
    s.map_uploads = o.map_uploads;
    s.staging_stalls = o.staging_stalls;
    s.faults = faults_;
    s.total_copies += wide_copies_;
    s.wide_forwards = wide_forwards_;
    s.wide_rounds = wide_rounds_;
    s.wide_hits = wide_hits_count_;
    s.wide_streamed = wide_streamed_count_;
    s.wide_bytes = wide_bytes_;
    s.slot_bytes = storage_.slot_bytes() + exec_.device_bytes() + (wide_state_ ? 2 * wide_state_->maps[0].size() : 0);
    s.host_bytes = storage_.host_bytes() + core_.staging_bytes() + (wide_state_ ? wide_state_->resident_host.size() : 0);
    return s;
  }
  /// @return the device plan's own counters (DevicePlanStats: overflows, bad ids, prefetches ...), from the
  ///         mapped mirror, as stats()
  [[nodiscard]] DevicePlanStats device_stats() const noexcept { return exec_.stats(); }

  /// Reads and clears the device error word. Call it while the cache's streams are idle (the device ORs bits
  /// with a plain load + store).
  /// @return the PlanErrorBit bits set since the last call (bad ids, overflow, ...); 0 when none
  [[nodiscard]] std::uint32_t take_errors() noexcept { return exec_.take_error_word(); }
  /// @return the engine that moves this cache's fills (FillEngine::automatic resolved at construction)
  [[nodiscard]] FillEngine fill_engine() const noexcept { return options_.fill_engine; }
  /// Whether prefetches' fills go through the copy proxy while forwards' fills use SM loads
  /// (DeviceCacheOptions::speculate_on_copy_engine with the engine resolved to sm_loads).
  [[nodiscard]] bool speculates_on_copy_engine() const noexcept {
    return options_.speculate_on_copy_engine && options_.fill_engine == FillEngine::sm_loads;
  }

  /// @return the host pools (write the experts' weights here: host_tensor(t, expert)) and slot buffers
  [[nodiscard]] StorageType& storage() noexcept { return storage_; }
  /// @return the storage (read-only)
  [[nodiscard]] const StorageType& storage() const noexcept { return storage_; }
  /// @return the layout the cache was built with
  [[nodiscard]] const Layout& layout() const noexcept { return layout_; }
  /// @return the options, fill_engine resolved
  [[nodiscard]] const DeviceCacheOptions& options() const noexcept { return options_; }
  /// @return the view prepare() returns (pointers fixed for the cache's lifetime), with the generation of the
  ///         last prepare() or prepare_group()
  [[nodiscard]] const ForwardView& view() const noexcept { return view_; }
  /// @return the device state (device pointers): maps, fill list, scalars; for tests and tools
  [[nodiscard]] const DevicePlanState& plan_state() const noexcept { return exec_.state(); }
  /// Overlap (options().overlap): what a consumer needs to wait for each slot's bytes.
  /// @return the readiness words (device pointers, fixed for the cache's lifetime); empty (enabled() false)
  ///         without overlap: the consumer then relies on stream order
  [[nodiscard]] SlotReadiness readiness() const noexcept {
    return exec_.overlap() ? slot_readiness_of(exec_.state()) : SlotReadiness{};
  }
  /// @return the plan executor (SimPlanExecutor or CudaPlanExecutor); for tests and tools
  [[nodiscard]] const Executor& executor() const noexcept { return exec_; }
  /// @return the device forward map (ForwardView::expert_map): [num_experts] int32, fixed for the lifetime
  [[nodiscard]] const std::int32_t* forward_map_device() const noexcept { return view_.expert_map; }
  /// @return the device resident map (ForwardView::resident_map): [num_experts] int32, fixed for the lifetime
  [[nodiscard]] const std::int32_t* resident_map_device() const noexcept { return view_.resident_map; }
  /// The last prepare's ids with every dropped one as -1 (n_ids entries, device memory): a
  /// consumer indexing the maps with these stays in bounds whatever the router wrote.
  /// @return the device address of those ids (fixed for the cache's lifetime; written by each prepare())
  [[nodiscard]] const std::int32_t* sanitized_ids_device() const noexcept { return exec_.sanitized_ids(); }
  /// @return the stream of the last accepted prepare(), prepare_group() or prepare_wide(); nullopt before any
  [[nodiscard]] std::optional<Stream> owner() const noexcept { return core_.owner(); }
  /// @return what the ordering core did since construction (edges, owner changes, map uploads, stalls)
  [[nodiscard]] const OrderingCounters& ordering_counters() const noexcept { return core_.counters(); }

 private:
  // FillEngine::automatic resolved by the executor (the CUDA one from the link profile); an
  // executor that resolves nothing (SimRuntime's) takes sm_loads. After validated(): a bad
  // configuration is refused before any measurement.
  [[gnu::cold]] static DeviceCacheOptions resolve_fill_engine(DeviceCacheOptions o, const Layout& layout) {
    if (o.fill_engine == FillEngine::copy_engine && o.fill_by_consumer) {
      throw Error(Status::format(ErrorCode::invalid_argument,
                                 "%s: fill_by_consumer reads host memory with SM loads; it cannot run with the "
                                 "copy_engine fill engine (use overlap)",
                                 o.label.c_str()));
    }
    if constexpr (requires { Executor::resolve_fill_engine(o, std::uint64_t{}); }) {
      return Executor::resolve_fill_engine(std::move(o), total_bytes_per_expert(layout.tensors()));
    } else {
      if (o.fill_engine == FillEngine::automatic) o.fill_engine = FillEngine::sm_loads;
      return o;
    }
  }
  [[gnu::cold]] static DeviceCacheOptions validated(DeviceCacheOptions o) {
    if (o.capacity <= 0 || o.capacity > o.num_experts) {
      throw Error(Status::format(ErrorCode::invalid_capacity, "%s: capacity %d for %d experts (need 1..num_experts)",
                                 o.label.c_str(), o.capacity, o.num_experts));
    }
    if (o.stream_slots < 0 || o.stream_slots > o.num_experts) {
      throw Error(Status::format(ErrorCode::invalid_argument, "%s: stream_slots %d (need 0..num_experts = %d)",
                                 o.label.c_str(), o.stream_slots, o.num_experts));
    }
    if (o.max_wide_ids < 0) {
      throw Error(Status::format(ErrorCode::invalid_argument, "%s: max_wide_ids %lld (need >= 0)", o.label.c_str(),
                                 static_cast<long long>(o.max_wide_ids)));
    }
    if (o.max_ids <= 0) {
      throw Error(Status::format(ErrorCode::invalid_argument, "%s: max_ids %d (need > 0: tokens * top_k)",
                                 o.label.c_str(), o.max_ids));
    }
    if (o.fill_by_consumer && o.overlap) {
      throw Error(Status::format(ErrorCode::invalid_argument,
                                 "%s: fill_by_consumer with overlap (the consumer fills the missing experts itself, so "
                                 "there is no fill to overlap)",
                                 o.label.c_str()));
    }
    if (o.speculate_on_copy_engine && !o.overlap) {
      throw Error(Status::format(ErrorCode::invalid_argument,
                                 "%s: speculate_on_copy_engine without overlap (a forward then reads its slots "
                                 "without waiting for their ready words, so a speculative copy it hits may not have landed)",
                                 o.label.c_str()));
    }
    if (o.crf_decay_q32 == 0 || o.crf_decay_q32 >= crf_one) {
      throw Error(Status::format(ErrorCode::invalid_argument,
                                 "%s: crf_decay_q32 %llu (need 1..2^32 - 1: a decay per forward below 1.0 in Q32)",
                                 o.label.c_str(), static_cast<unsigned long long>(o.crf_decay_q32)));
    }
    return o;
  }
  static Layout validated(const Layout& layout) {
    throw_if_error(layout.validate());
    return layout;
  }

  // Fills a prefetch may make: max_bytes / bytes per expert, at most the capacity.
  Result<std::int32_t> prefetch_budget(std::int32_t n_ids, const PrefetchOptions& o) const noexcept {
    if (n_ids < 0 || n_ids > options_.num_experts) {
      return Status::format(n_ids < 0 ? ErrorCode::invalid_argument : ErrorCode::too_many_experts,
                            "%s: prefetch of %d ids (accepted: 0..%d, the experts)", options_.label.c_str(), n_ids,
                            options_.num_experts);
    }
    if (o.max_bytes < 0) {
      return Status::format(ErrorCode::invalid_argument, "%s: prefetch max_bytes must be >= 0, got %lld",
                            options_.label.c_str(), static_cast<long long>(o.max_bytes));
    }
    if (o.expires_after == 0) {
      return Status::format(ErrorCode::invalid_argument, "%s: prefetch expires_after must be >= 1 forward",
                            options_.label.c_str());
    }
    if (Status s = check_hint_scores({}, {}, o.min_score); !s) return s.with_context("%s", options_.label.c_str());
    const std::uint64_t fills = bytes_per_expert_ == 0 ? 0 : static_cast<std::uint64_t>(o.max_bytes) / bytes_per_expert_;
    return static_cast<std::int32_t>(std::min<std::uint64_t>(fills, static_cast<std::uint64_t>(options_.capacity)));
  }

  Status check_prior_shape(std::size_t entries, const char* what) const noexcept {
    if constexpr (Policy::kind != DevicePolicyKind::crf) {
      return Status::format(ErrorCode::not_supported, "%s: %s: the device policy %s ranks without a prior (DeviceCrf takes one)",
                            options_.label.c_str(), what, Policy::name);
    }
    if (entries != static_cast<std::size_t>(options_.num_experts)) {
      return Status::format(ErrorCode::invalid_argument, "%s: %s got %zu entries for %d experts (need one per expert)",
                            options_.label.c_str(), what, entries, options_.num_experts);
    }
    return {};
  }

  // The Q32 table into the plan state's bias array, as two map uploads of E int32 words each
  // (the core's staging buffers hold E words; the table is 2E), inside one ordered write.
  Status upload_prior(const std::uint64_t* q32, Stream stream, const char* what) noexcept {
    if (Status s = check_stream(stream, what); !s) return s;
    const auto words = static_cast<std::size_t>(options_.num_experts);
    const auto* src = reinterpret_cast<const std::int32_t*>(q32);
    auto* dst = reinterpret_cast<std::int32_t*>(exec_.state().expert_bias.data);
    Status s = write(stream, WritePurpose::invalidate, [&](Stream f, bool&) noexcept {
      if (Status u = core_.upload_map(src, dst, f, words); !u) return u;
      return core_.upload_map(src + words, dst + words, f, words);
    });
    if (!s) return s.with_context("%s: %s", options_.label.c_str(), what);
    ++generation_;
    return {};
  }

  // The staging ring: the host-id prefetch upload (2 buffers are enough) and, with stream
  // slots, every round map of one wide forward, so the host does not wait inside a forward.
  static std::size_t wide_ring_size(const DeviceCacheOptions& o) {
    if (o.stream_slots < 2) return 2;
    return detail::wide_ring_buffers(static_cast<std::size_t>(std::max(o.num_experts, 1)),
                                     static_cast<std::size_t>(o.stream_slots / 2));
  }

  // What every prepare_wide checks before anything is enqueued.
  Status wide_allowed(Stream stream, const WideOptions& options) noexcept {
    if (options.admission != WideAdmission::stream) {
      return Status::format(ErrorCode::not_supported,
                            "%s: prepare_wide with admit admission (the device planner admits through "
                            "prepare(ids, n, X, DeviceForward::in_rounds) and prepare_group)",
                            options_.label.c_str());
    }
    if (!wide_state_) {
      return Status::format(ErrorCode::not_supported,
                            "%s: prepare_wide needs stream slots (DeviceCacheOptions::stream_slots is %d; "
                            "recommended_stream_slots() gives a size)",
                            options_.label.c_str(), options_.stream_slots);
    }
    if (Status s = detail::wide_forward_allowed(*rt_, wide_staging_, stream); !s) {
      return s.with_context("%s: prepare_wide (nothing enqueued)", options_.label.c_str());
    }
    return {};
  }

  // The pool's resident map (and `n_ids` device ids, when given) into pinned host memory on
  // `stream`, ordered like invalidate(): after the owner's readers and the last writer (edges
  // 6, 2: every plan and prefetch fill enqueued so far), then the host waits for those copies
  // (edge D10) before it reads them.
  Status read_back(Stream stream, const std::int32_t* device_ids, std::size_t n_ids) noexcept {
    WideState& w = *wide_state_;
    const std::size_t bytes = static_cast<std::size_t>(options_.num_experts) * sizeof(std::int32_t);
    Status s = write(stream, WritePurpose::invalidate, [&](Stream f, bool&) noexcept -> Status {
      if (Status c = rt_->copy_async(w.resident_host.data(), exec_.state().resident_map.data, bytes, f); !c) return c;
      if (n_ids > 0) {
        if (Status c = rt_->copy_async(w.ids_host.data(), device_ids, n_ids * sizeof(std::int32_t), f); !c) return c;
      }
      return rt_->record(w.read_back_done.get(), f);
    });
    if (s && Edges::wide_resident_read_wait) s = rt_->synchronize(w.read_back_done.get());
    if (!s) return s.with_context("%s: prepare_wide: reading the pool's resident map back", options_.label.c_str());
    rt_->host_access(w.resident_host.data(), bytes, AccessMode::read);
    if (n_ids > 0) rt_->host_access(w.ids_host.data(), n_ids * sizeof(std::int32_t), AccessMode::read);
    return {};
  }

  // The rounds of a validated wide forward (wide_.unique holds it) after the read-back.
  template <class Consumer>
  Result<WideSummary> serve_wide(Stream stream, Consumer& consumer, const WideOptions& options) noexcept {
    if (Status s = core_.wide_begin(stream); !s) {
      ++faults_;
      return s.with_context("%s: prepare_wide: ordering the forward after earlier work", options_.label.c_str());
    }
    WideSummary summary;
    summary.unique = static_cast<std::uint32_t>(wide_.unique.size());
    summary.admission = WideAdmission::stream;
    Status s = wide_stream_rounds(stream, consumer, summary, options);
    wide_copies_ += summary.copies;
    wide_bytes_ += summary.bytes;
    wide_rounds_ += summary.rounds;
    if (!s) return s.with_context("%s", options_.label.c_str());
    ++wide_forwards_;
    return summary;
  }

  // detail::run_stream_rounds on the device planner's pool, read from the resident map's
  // read-back; the round maps in two buffers of the cache's own (the plan state's forward map
  // belongs to prepare()).
  template <class Consumer>
  Status wide_stream_rounds(Stream stream, Consumer& consumer, WideSummary& summary,
                            const WideOptions& options) noexcept {
    WideState& w = *wide_state_;
    const std::span<const std::int32_t> resident(reinterpret_cast<const std::int32_t*>(w.resident_host.data()),
                                                 static_cast<std::size_t>(options_.num_experts));
    struct Hooks {
      DeviceExpertCacheWithEdges& c;
      Consumer& consumer;
      Status before_rounds(std::span<const std::int32_t>) noexcept { return {}; }  // the read-back ordered them (edges 6, 2)
      MapUpload resident_upload() noexcept { return {}; }  // the pool's map is the device's own
      void uploaded() noexcept {}
      std::int32_t* round_map(std::size_t r) noexcept {
        return reinterpret_cast<std::int32_t*>(c.wide_state_->maps[r % 2].data());
      }
      ForwardView view() const noexcept {
        ForwardView v = c.view_;
        v.missing = nullptr;  // every expert of a round is in its slot when the consumer reads it
        return v;
      }
      Status consume(const WideRound& round) noexcept { return detail::call_wide_consumer(consumer, round); }
      void served(std::size_t hits, std::size_t streamed) noexcept {
        c.wide_hits_count_ += hits;
        c.wide_streamed_count_ += streamed;
      }
      void fault() noexcept { ++c.faults_; }
    } hooks{*this, consumer};
    return detail::run_stream_rounds(core_, wide_staging_, *rt_, storage_, stream, resident, options_.capacity,
                                     options_.stream_slots, bytes_per_expert_, options, wide_,
                                     detail::StreamRoundHooks::of(hooks), summary);
  }

  // A stream the runtime does not know is refused before anything is enqueued.
  Status check_stream(Stream stream, const char* what) noexcept {
    Result<bool> capturing = rt_->is_capturing(stream);
    if (!capturing.ok()) {
      return capturing.status().with_context("%s: %s refused the stream (nothing enqueued)", options_.label.c_str(), what);
    }
    return {};
  }

  // One call through the core's write entry. Before its own step, a pending recovery drops the
  // experts of a plan whose fill never got enqueued. The step is called through a pointer, so
  // the entry is compiled once per cache, not once per caller (each runs a plan: the call is
  // noise beside it).
  template <class Step>
  Status write(Stream stream, WritePurpose purpose, Step&& step) noexcept {
    using S = std::remove_reference_t<Step>;
    return write_step(stream, purpose, &step, [](void* p, Stream f, bool& planned) noexcept -> Status {
      return (*static_cast<S*>(p))(f, planned);
    });
  }
  [[gnu::noinline]] Status write_step(Stream stream, WritePurpose purpose, void* step,
                                      Status (*call)(void*, Stream, bool&) noexcept) noexcept {
    bool planned = false;
    // Overlap: the last fill joins its stream first, so the core's records there cover it.
    if (Status j = exec_.join_fills(); !j) {
      ++faults_;
      return j;
    }
    Status s = core_.write(stream, purpose, MapUpload{}, [&](Stream f) noexcept -> Status {
      if (drop_pending_) {
        if (Status d = exec_.drop_fills(f); !d) return d;
        drop_pending_ = false;
      }
      Status r = call(step, f, planned);
      if (!r && planned) drop_pending_ = true;
      return r;
    });
    if (!s) ++faults_;
    return s;
  }

  Runtime* rt_;
  DeviceCacheOptions options_;
  Layout layout_;
  StorageType storage_;
  OrderingCore<Runtime, Edges> core_;
  Executor exec_;
  RuntimeBuffer<Runtime> prefetch_ids_;  // [E] int32: host-given predicted ids, uploaded per call
  HintSelector hints_;                   // the host-ids prefetch's scored-hint selection (E ids)
  // Wide forwards (stream_slots >= 2 only): the resident map read back, the two round maps, and
  // the event the host waits for before it plans the rounds.
  struct WideState {
    WideState(Runtime& rt, std::size_t map_bytes)
        : resident_host(rt, map_bytes, MemoryKind::pinned_host),
          maps{RuntimeBuffer<Runtime>(rt, map_bytes, MemoryKind::device), RuntimeBuffer<Runtime>(rt, map_bytes, MemoryKind::device)},
          read_back_done(rt) {}
    RuntimeBuffer<Runtime> resident_host;
    RuntimeBuffer<Runtime> ids_host;  // prepare_wide from device ids: grown to the largest forward
    std::array<RuntimeBuffer<Runtime>, 2> maps;
    RuntimeEvent<Runtime> read_back_done;  // recorded after the read-back's copies
  };
  std::optional<WideState> wide_state_;
  // A wide round's copies: plain copies (coalesced, batched by the rounds).
  typename DeviceWideStaging<Policy, Runtime>::type wide_staging_ = DeviceWideStaging<Policy, Runtime>::make();
  detail::WideScratch wide_;
  std::uint64_t wide_forwards_ = 0, wide_rounds_ = 0, wide_hits_count_ = 0, wide_streamed_count_ = 0;
  std::uint64_t wide_bytes_ = 0, wide_copies_ = 0;
  ForwardView view_;
  bool drop_pending_ = false;
  std::int32_t round_width_ = 0;  // round_width of the last prepare (prepare_group's range; 0 = capacity)
  std::size_t copies_per_fill_ = 0;
  std::uint64_t bytes_per_expert_ = 0;
  std::uint64_t prepare_calls_ = 0;
  std::uint64_t generation_ = 0;
  std::uint64_t faults_ = 0;
};

}  // namespace detail

/// The public type: every ordering edge on. Policy: DeviceLru (= Lru), DeviceLfru (= Lfru) or
/// DeviceCrf (= Crf), planning/device_plan.hpp.
template <template <class> class Storage, expert_layout Layout, allocating_runtime Runtime,
          device_plan_policy Policy = DeviceLru>
using DeviceExpertCache = detail::DeviceExpertCacheWithEdges<Storage, Layout, Runtime, OrderingEdges, Policy>;

}  // namespace expert_cache::inline v0
