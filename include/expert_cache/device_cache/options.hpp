#pragma once
/// The options a DeviceExpertCache is built with (DeviceCacheOptions) and the forward mode of its
/// prepare (DeviceForward). Apart from the cache class so that every executor reads them without
/// the cache.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "expert_cache/base/version.hpp"
#include "expert_cache/cache/wide.hpp"            // default_max_wide_ids
#include "expert_cache/eviction/crf_math.hpp"     // crf_default_decay_q32
#include "expert_cache/runtime/link_profile.hpp"  // FillEngine, LinkProfile
#include "expert_cache/storage/storage_memory.hpp"

namespace expert_cache::inline v0 {

/// Construction parameters of a DeviceExpertCache. The constructor throws Error when they are impossible.
struct DeviceCacheOptions {
  std::int32_t num_experts = 0;  ///< experts of the layer (valid ids are [0, num_experts))
  std::int32_t capacity = 0;     ///< GPU slots of the pool, in [1, num_experts]
  std::int32_t max_ids = 0;      ///< the largest n_ids prepare() accepts (tokens * top_k); > 0
  /// CUDA: plan and the fill of group 0 in one kernel node (plan_forward_fill_kernel); false:
  /// two nodes (plan_forward, plan_fill). SimRuntime always runs two ops.
  bool fused_plan_fill = true;
  /// Per-slot readiness (edge D4): plan -> overlapped fill (two nodes; the fused node is not
  /// used), a consumer given readiness() may run concurrently with the fill. false: the
  /// stream-ordered path (readiness() is empty).
  bool overlap = false;
  /// Compute from host: the plan enqueues no fill for a forward's misses. The consumer copies
  /// each missing expert itself: ForwardView::missing flags them (device memory, [num_experts]),
  /// their slots are the expert map's, and the consumer must write every byte of each such slot
  /// from the host pools before any later reader (MoeConsumer::run_one_pass does: it reads the
  /// expert from mapped host memory, computes with it and stores it into the slot; edge D7 of
  /// docs/design.md). A group whose consumer did not run must be dropped with drop_unfilled().
  /// Prefetches still fill. Not with overlap (refused at construction: ErrorCode::invalid_argument).
  bool fill_by_consumer = false;
  /// Test-only (overlap): every fill block waits test_fill_delay_ns before it copies fill number
  /// test_fill_delay_index of a step. Read once at construction; 0 selects the full-speed fill
  /// kernel, which has no knob. SimRuntime ignores it (its schedules already reorder).
  std::uint32_t test_fill_delay_ns = 0;
  std::int32_t test_fill_delay_index = 0;  ///< test-only: see test_fill_delay_ns
  /// Overlap, CUDA: copy regions (bit r = the storage's copy region r; TensorMajorStorage: one per
  /// non-empty tensor, in tensor order) that every fill of a step copies first, each slot's part
  /// then published on its own ready word (SlotReadiness::ready_first, edge D4c), so a consumer
  /// whose first pass reads only them starts on a missing expert before the rest lands (the
  /// NVFP4 consumer: MoeConsumer::first_pass_regions). 0: one part. A bit past the regions is
  /// refused at construction (ErrorCode::invalid_argument).
  std::uint32_t ready_first_regions = 0;
  /// DeviceCrf's decay per forward in Q32, in [1, 2^32 - 1] (Crf's CrfParams::decay_q32: the same
  /// value plans the same victims; crf_decay_for_half_life(h) for a half-life of h forwards). Read
  /// at construction; outside the range is refused there (ErrorCode::invalid_argument). The other
  /// policies ignore it.
  std::uint64_t crf_decay_q32 = crf_default_decay_q32;
  /// Test-only (with test_fill_delay_ns): the delay applies to part test_fill_delay_part of the
  /// fill (0: the first part, 1: the rest); test_publish_first_early stores the first part's
  /// ready word BEFORE copying it (the edge removed, to show a test can see it).
  std::int32_t test_fill_delay_part = 0;
  bool test_publish_first_early = false;  ///< test-only: see test_fill_delay_part
  /// Slots appended after the pool for wide forwards (prepare_wide, stream admission): two
  /// halves used alternately, never admitted, never touched by the device planner. 0: no
  /// prepare_wide (recommended_stream_slots() gives a size). The slot workspace covers
  /// capacity + stream_slots slots.
  std::int32_t stream_slots = 0;
  /// Most top-k ids one prepare_wide() accepts (too_many_experts beyond).
  std::int64_t max_wide_ids = default_max_wide_ids;
  /// Which engine moves the fills' bytes (docs/design.md, "Copy-engine fills"): the SMs reading
  /// mapped host memory (sm_loads: the fill kernels, the overlapped fill, fill_by_consumer), or a
  /// copy engine driven by the device's proxy thread from the plan's fill list (copy_engine: the
  /// plan stays on the GPU and in the captured step). automatic: the link profile decides
  /// (LinkProfile::choose_engine; measured once per device and expert size, or `link_profile`).
  /// When automatic picks copy_engine for a cache with fill_by_consumer, the cache runs with
  /// overlap instead: ForwardView::missing is then null and readiness() is set, so the consumer
  /// computes from slots as they land. fill_by_consumer with copy_engine named explicitly is
  /// refused (ErrorCode::invalid_argument). SimRuntime models the proxy (automatic there: sm_loads).
  FillEngine fill_engine = FillEngine::automatic;
  /// A stored profile for automatic (LinkProfile::parse of a saved serialize()): skips the
  /// measurement. One from another device or expert size is refused at construction.
  std::optional<LinkProfile> link_profile;
  /// The engine prefetches the next layer's experts while this one computes (lookahead). With
  /// overlap and room to look ahead (fill_use_of), automatic then puts the speculative copies on
  /// the copy engine (FillUse::overlapped_lookahead; LinkProfile::choose_engines): they take no SMs
  /// from the consumer. With fast SM loads the forwards' fills stay SM loads
  /// (speculate_on_copy_engine), otherwise every fill goes through the copy engine. Read by
  /// automatic only.
  bool lookahead = false;
  /// Prefetches' fills go through the copy proxy while the forwards' fills use SM loads (needs
  /// overlap; with fill_engine resolved to copy_engine every fill goes through the proxy anyway).
  /// A demand fill starts as soon as its plan ends, without the proxy's round trip, and the
  /// speculative copies take no SMs from the consumer. A forward's fill of a slot first waits
  /// until the slot's pending speculative copy landed (edge P6 of docs/design.md).
  bool speculate_on_copy_engine = false;
  /// Test-only: the forward's fill does not wait for a slot's pending speculative copy (P6 removed).
  bool test_skip_pending_copy_wait = false;
  /// Test-only knobs of the copy engine (each removes one ordering edge of docs/design.md):
  /// the post publishes before the fill list is written (P1), the proxy publishes a ready word
  /// before its copies (P2); test_fail_copies makes the proxy's copies fail.
  bool test_post_before_list = false;
  bool test_ready_before_copy = false;  ///< test-only: see test_post_before_list
  bool test_fail_copies = false;        ///< test-only: see test_post_before_list
  /// Test-only (SimRuntime's executor): destruction skips its wait for the proxy (P4 removed).
  bool test_skip_shutdown_wait = false;
  /// Test-only (CudaRuntime): destruction frees its memory without first waiting for the device
  /// while other caches use the proxy (P5 removed).
  bool test_skip_release_drain = false;
  std::string label = "device_expert_cache";  ///< name in log lines and error messages
  std::function<void(std::string_view)> log;  ///< one line at construction; silent when empty
  /// Caller-owned host pools and/or slot workspace, as CacheOptions::memory (the storage
  /// validates and registers them; never copied or freed; the caller keeps them alive).
  StorageMemory memory{};
};

/// How DeviceExpertCache::prepare's caller serves a forward with more unique experts than slots.
enum class DeviceForward : std::uint8_t {
  single,     ///< one round: an overflow is an error the error word reports (plan_error_overflow)
  in_rounds,  ///< the caller runs prepare_group for every further group: the overflow is planned
};

/// How the fills of a cache are used, for FillEngine::automatic.
/// @return FillUse::overlapped_lookahead when the engine looks ahead (`lookahead`), the cache overlaps
///         (`overlap`) and the pool holds the next forward's experts beside the current one's
///         (capacity >= 2 * max_ids); FillUse::demand otherwise. Without that room a speculative fill
///         finds no slot outside the current forward, so lookahead moves no bytes and the demand fills
///         alone should choose the engine (on an 8-slot pool with top-8 routing, taking the copy engine
///         for lookahead only made decode slower: docs/benchmarks.md).
[[nodiscard]] constexpr FillUse fill_use_of(bool lookahead, bool overlap, std::int32_t capacity,
                                          std::int32_t max_ids) noexcept {
  const bool room = static_cast<std::int64_t>(capacity) >= 2 * static_cast<std::int64_t>(max_ids);
  return lookahead && overlap && room ? FillUse::overlapped_lookahead : FillUse::demand;
}
/// The same from a cache's options.
[[nodiscard]] constexpr FillUse fill_use_of(const DeviceCacheOptions& o) noexcept {
  return fill_use_of(o.lookahead, o.overlap, o.capacity, o.max_ids);
}

}  // namespace expert_cache::inline v0
