#pragma once
/// What a cache's calls hand back: one forward's view (ForwardView), one round of a wide
/// forward (WideRound) and what one prefetch() did (PrefetchView).
// The device-planned cache returns the same types, so a consumer kernel reads either cache alike.
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/storage/slot_storage.hpp"

namespace expert_cache::inline v0 {

/// What a consumer kernel needs for one forward. All pointers are device pointers, fixed for the
/// cache's lifetime; what they point to holds for work enqueued on the prepare() stream after the
/// call (the copies are ordered before it) until the cache's next forward (each cache's prepare()
/// names the calls that end it).
struct ForwardView {
  /// Slot buffers per tensor: expert in slot s at tensors[t].slot(s); bytes == 0: tensor absent.
  std::array<SlotTensor, num_expert_tensors> tensors{};
  const std::int32_t* expert_map = nullptr;    ///< [num_experts] forward-scoped: this forward's experts -> slot, else -1
  /// [num_experts] every resident expert -> slot, else -1, as of this forward's prepare() (a
  /// later prefetch() may leave the device copy behind until the next prepare()). Read slots
  /// through expert_map.
  const std::int32_t* resident_map = nullptr;
  /// [num_experts] non-zero = a miss of this forward that the consumer must copy from the host
  /// pools into its slot (the expert map's) itself: DeviceExpertCache with
  /// DeviceCacheOptions::fill_by_consumer only; null otherwise (the cache filled every slot).
  const std::int32_t* missing = nullptr;
  std::uint32_t hits = 0;                      ///< this forward's unique experts already resident
  std::uint32_t misses = 0;                    ///< this forward's unique experts copied in
  std::uint64_t generation = 0;                ///< increases by one per accepted forward
  /// The slot buffers of tensor `t`.
  /// @param t  the tensor (e.g. ExpertTensor::w13)
  /// @return tensors[t]: base, slot stride and bytes (bytes == 0: the layout has no such tensor)
  [[nodiscard]] const SlotTensor& tensor(ExpertTensor t) const noexcept {
    return tensors[static_cast<std::size_t>(t)];
  }
};

/// One round of a wide forward (prepare_wide), handed to the caller's consumer: `view` has the
/// contract of a prepare()'s view for work the consumer enqueues on the prepare_wide() stream
/// during the call, and until the next call into the cache. Its expert map holds this round's
/// experts only (disjoint from every other round's); with WideAdmission::stream a streamed
/// expert's slot is a stream slot (>= capacity), which the resident map does not name.
struct WideRound {
  ForwardView view{};
  std::span<const std::int32_t> experts;  ///< this round's experts, ascending (host memory, valid during the call)
  std::span<const std::int32_t> slots;    ///< their slots (what the round's expert map holds for them)
  std::uint32_t index = 0;                ///< 0-based round number
  std::uint32_t rounds = 0;               ///< rounds of this forward
  std::uint32_t streamed = 0;             ///< experts of this round in stream slots
  /// @return true for round 0 only: where work that is not per expert (shared experts) belongs
  [[nodiscard]] bool include_shared() const noexcept { return index == 0; }
};

/// What one prefetch() did.
struct PrefetchView {
  std::uint32_t issued = 0;             ///< speculative fills enqueued
  std::uint32_t evictions = 0;          ///< residents dropped for them
  std::uint32_t skipped_resident = 0;   ///< predicted entries already resident or in flight
  std::uint32_t skipped_no_victim = 0;  ///< predicted ids dropped: every slot was protected
  std::uint32_t skipped_unlikely = 0;   ///< scored entries below min_score, never considered
  std::uint32_t skipped_imprecise = 0;  ///< entries at a rank whose fills were mostly wasted (precision_feedback)
  std::uint64_t bytes = 0;              ///< bytes enqueued
};

namespace detail {
// The view of a planned prefetch (ForwardPlanner's PrefetchPlan), for the caches that issue it.
template <class Plan>
[[nodiscard]] PrefetchView prefetch_view_of(const Plan& plan, std::uint64_t bytes_per_expert) noexcept {
  PrefetchView v;
  v.issued = static_cast<std::uint32_t>(plan.fills.size());
  v.evictions = static_cast<std::uint32_t>(plan.evictions.size());
  v.skipped_resident = plan.skipped_resident;
  v.skipped_no_victim = plan.skipped_no_victim;
  v.skipped_unlikely = plan.skipped_unlikely;
  v.skipped_imprecise = plan.skipped_imprecise;
  v.bytes = v.issued * bytes_per_expert;
  return v;
}
}  // namespace detail

}  // namespace expert_cache::inline v0
