#pragma once
// Forward planner: turns one forward's expert ids into hits, misses, victims and slot
// assignments, and keeps the resident map and the forward-scoped map (host mirrors).
// Validation happens before any state change: a rejected forward leaves residency,
// policy state and counters exactly as they were.
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "expert_cache/concepts.hpp"
#include "expert_cache/eviction/fixed_vector.hpp"
#include "expert_cache/status.hpp"
#include "expert_cache/types.hpp"

namespace expert_cache::inline v0 {

// SlotFill and SlotEviction: concepts.hpp (the staging concept is stated in them).

// The outcome of planning one forward. Reused across forwards so the hot path never allocates.
struct ForwardPlan {
  std::vector<ExpertId> unique;         // the forward's unique experts, in processing order
  std::vector<SlotFill> fills;          // misses: slot `slot` must receive expert `expert`
  std::vector<SlotEviction> evictions;  // residents dropped to make room (their slot is in fills)
  std::uint32_t hits = 0;
  std::uint32_t misses = 0;

  void clear() noexcept {
    unique.clear();
    fills.clear();
    evictions.clear();
    hits = misses = 0;
  }
};

struct PlannerCounters {
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t promotions = 0;  // experts made resident
  std::uint64_t evictions = 0;
  std::uint64_t invalidations = 0;
  std::uint64_t prepare_calls = 0;  // accepted forwards
  std::uint64_t generation = 0;     // bumps on every accepted state change (forward or invalidate)
  friend bool operator==(const PlannerCounters&, const PlannerCounters&) = default;
};

template <eviction_policy Policy>
class ForwardPlanner {
 public:
  // Everything that defines the cache's observable state; equality compares it all.
  struct Snapshot {
    std::vector<std::int32_t> resident_map;
    std::vector<std::int32_t> slot_owner;
    std::vector<std::int32_t> free_slots;
    Policy policy;
    PlannerCounters counters;
    friend bool operator==(const Snapshot&, const Snapshot&) = default;
  };

  // Throws Error(invalid_capacity / invalid_argument) for an impossible shape.
  ForwardPlanner(CacheShape shape, std::int32_t top_k, Policy policy)
      : shape_(validated(shape, top_k)),
        top_k_(top_k),
        policy_(std::move(policy)),
        resident_map_(static_cast<std::size_t>(shape.num_experts), absent_slot),
        forward_map_(static_cast<std::size_t>(shape.num_experts), absent_slot),
        slot_owner_(static_cast<std::size_t>(shape.capacity), -1),
        free_slots_(static_cast<std::size_t>(shape.capacity)),
        stamps_(static_cast<std::size_t>(shape.num_experts), 0u),
        scratch_(static_cast<std::size_t>(shape.capacity)),
        previous_forward_(static_cast<std::size_t>(shape.capacity)) {
    // The free list is a LIFO stack popped from the back.
    for (std::int32_t i = 0; i < shape.capacity; ++i) {
      free_slots_.push_back(free_slot_order_of<Policy>() == FreeSlotOrder::lowest_first
                                ? shape.capacity - 1 - i
                                : i);
    }
  }

  explicit ForwardPlanner(CacheShape shape, std::int32_t top_k = 1)
    requires std::constructible_from<Policy, CacheShape>
      : ForwardPlanner(shape, top_k, Policy(validated(shape, top_k))) {}

  // Plan from top-k routing ids (any length, duplicates allowed, negative ids are padding).
  // The unique set is processed in ascending order, as both reference providers do.
  Status plan_topk(std::span<const std::int32_t> topk_ids, ForwardPlan& plan) noexcept {
    next_epoch();
    scratch_.clear();
    for (const std::int32_t id : topk_ids) {
      if (id < 0) continue;
      if (id >= shape_.num_experts) return out_of_range(id);
      if (stamps_[static_cast<std::size_t>(id)] == epoch_) continue;
      if (static_cast<std::int32_t>(scratch_.size()) == shape_.capacity) {
        return too_many(count_unique_topk(topk_ids));
      }
      stamps_[static_cast<std::size_t>(id)] = epoch_;
      scratch_.push_back(ExpertId(id));
    }
    std::sort(scratch_.begin(), scratch_.end());
    return apply(plan);
  }

  // Plan from an explicit list of unique ids, processed in the given order. Duplicates and
  // ids outside [0, num_experts) (negative included) are errors.
  Status plan_unique(std::span<const std::int32_t> unique_ids, ForwardPlan& plan) noexcept {
    if (static_cast<std::int64_t>(unique_ids.size()) > shape_.capacity) {
      return too_many(static_cast<std::int64_t>(unique_ids.size()));
    }
    next_epoch();
    scratch_.clear();
    for (const std::int32_t id : unique_ids) {
      if (id < 0 || id >= shape_.num_experts) return out_of_range(id);
      if (stamps_[static_cast<std::size_t>(id)] == epoch_) {
        return Status::format(ErrorCode::duplicate_expert, "expert %d appears more than once in the unique id list", id);
      }
      stamps_[static_cast<std::size_t>(id)] = epoch_;
      scratch_.push_back(ExpertId(id));
    }
    return apply(plan);
  }

  // Drop `expert` from residency. Returns the freed slot, or an invalid SlotId when the
  // expert was not resident (a no-op, like the reference providers).
  Result<SlotId> invalidate(std::int32_t expert) noexcept {
    if (expert < 0 || expert >= shape_.num_experts) return out_of_range(expert);
    const auto e = static_cast<std::size_t>(expert);
    const std::int32_t slot = resident_map_[e];
    if (slot == absent_slot) return SlotId();
    policy_.on_remove(ExpertId(expert));
    resident_map_[e] = absent_slot;
    forward_map_[e] = absent_slot;
    slot_owner_[static_cast<std::size_t>(slot)] = -1;
    free_slots_.push_back(slot);
    ++counters_.invalidations;
    ++counters_.generation;
    return SlotId(slot);
  }

  [[nodiscard]] std::span<const std::int32_t> resident_map() const noexcept { return resident_map_; }
  [[nodiscard]] std::span<const std::int32_t> forward_map() const noexcept { return forward_map_; }
  [[nodiscard]] std::span<const std::int32_t> slot_owner() const noexcept { return slot_owner_; }
  [[nodiscard]] const PlannerCounters& counters() const noexcept { return counters_; }
  [[nodiscard]] const Policy& policy() const noexcept { return policy_; }
  [[nodiscard]] CacheShape shape() const noexcept { return shape_; }
  [[nodiscard]] std::int32_t top_k() const noexcept { return top_k_; }
  [[nodiscard]] std::int32_t resident_count() const noexcept {
    return shape_.capacity - static_cast<std::int32_t>(free_slots_.size());
  }
  [[nodiscard]] bool is_resident(std::int32_t expert) const noexcept {
    return expert >= 0 && expert < shape_.num_experts &&
           resident_map_[static_cast<std::size_t>(expert)] != absent_slot;
  }

  [[nodiscard]] Snapshot snapshot() const {
    return Snapshot{resident_map_, slot_owner_, std::vector<std::int32_t>(free_slots_.begin(), free_slots_.end()),
                    policy_, counters_};
  }

  static CacheShape validated(CacheShape shape, std::int32_t top_k) {
    if (shape.num_experts <= 0) {
      throw Error(ErrorCode::invalid_argument,
                  "num_experts must be positive, got " + std::to_string(shape.num_experts));
    }
    if (shape.capacity <= 0 || shape.capacity > shape.num_experts) {
      throw Error(ErrorCode::invalid_capacity,
                  "capacity must be in [1, num_experts=" + std::to_string(shape.num_experts) +
                      "], got " + std::to_string(shape.capacity));
    }
    if (top_k <= 0 || top_k > shape.capacity) {
      throw Error(ErrorCode::invalid_capacity,
                  "capacity " + std::to_string(shape.capacity) + " is below top_k " +
                      std::to_string(top_k) + " (top_k must be in [1, capacity])");
    }
    return shape;
  }

 private:
  // Everything was validated; from here on nothing can fail except a broken policy.
  Status apply(ForwardPlan& plan) noexcept {
    plan.clear();
    reserve(plan);
    for (const ExpertId e : previous_forward_) forward_map_[e.index()] = absent_slot;
    previous_forward_.clear();
    if constexpr (has_begin_forward<Policy>) policy_.begin_forward(std::span<const ExpertId>(scratch_));
    const ForwardSet needed(stamps_.data(), epoch_);
    for (const ExpertId e : scratch_) {
      std::int32_t& slot = resident_map_[e.index()];
      if (slot != absent_slot) {
        policy_.on_hit(e);
        ++plan.hits;
      } else {
        std::int32_t target;
        if (!free_slots_.empty()) {
          target = free_slots_.back();
          free_slots_.pop_back();
        } else {
          const ExpertId victim = policy_.choose_victim(needed);
          if (!victim.valid() || victim.value >= shape_.num_experts ||
              resident_map_[victim.index()] == absent_slot || needed.contains(victim)) {
            return Status::format(ErrorCode::internal, "eviction policy '%.*s' returned an invalid victim %d",
                                  static_cast<int>(std::string_view(Policy::name).size()),
                                  std::string_view(Policy::name).data(), victim.value);
          }
          target = resident_map_[victim.index()];
          policy_.on_remove(victim);
          resident_map_[victim.index()] = absent_slot;
          plan.evictions.push_back({victim, SlotId(target)});
          ++counters_.evictions;
        }
        slot = target;
        slot_owner_[static_cast<std::size_t>(target)] = e.value;
        policy_.on_insert(e);
        plan.fills.push_back({e, SlotId(target)});
        ++plan.misses;
        ++counters_.promotions;
      }
      forward_map_[e.index()] = slot;
      previous_forward_.push_back(e);
      plan.unique.push_back(e);
    }
    counters_.hits += plan.hits;
    counters_.misses += plan.misses;
    ++counters_.prepare_calls;
    ++counters_.generation;
    return {};
  }

  // A plan never holds more than `capacity` entries per list: sized once, reused after.
  void reserve(ForwardPlan& plan) const noexcept {
    const auto cap = static_cast<std::size_t>(shape_.capacity);
    if (plan.unique.capacity() >= cap) return;
    try {
      plan.unique.reserve(cap);
      plan.fills.reserve(cap);
      plan.evictions.reserve(cap);
    } catch (...) {  // out of memory: the push_backs below report it by terminating, as before
    }
  }

  void next_epoch() noexcept {
    if (++epoch_ == 0) {  // wrapped: old stamps could alias the new epoch
      std::fill(stamps_.begin(), stamps_.end(), 0u);
      epoch_ = 1;
    }
  }

  std::int64_t count_unique_topk(std::span<const std::int32_t> ids) noexcept {
    next_epoch();
    std::int64_t n = 0;
    for (const std::int32_t id : ids) {
      if (id < 0 || id >= shape_.num_experts || stamps_[static_cast<std::size_t>(id)] == epoch_) continue;
      stamps_[static_cast<std::size_t>(id)] = epoch_;
      ++n;
    }
    return n;
  }

  Status out_of_range(std::int32_t id) const {
    return Status::format(ErrorCode::expert_out_of_range, "expert id %d is outside [0, %d)", id, shape_.num_experts);
  }
  Status too_many(std::int64_t unique) const {
    return Status::format(ErrorCode::too_many_experts,
                          "forward needs %lld unique experts but the cache has %d slots; use a token or expert split plan",
                          static_cast<long long>(unique), shape_.capacity);
  }

  CacheShape shape_;
  std::int32_t top_k_;
  Policy policy_;
  std::vector<std::int32_t> resident_map_;  // expert -> slot, -1 absent (everything resident)
  std::vector<std::int32_t> forward_map_;   // expert -> slot for this forward only
  std::vector<std::int32_t> slot_owner_;    // slot -> expert, -1 free
  // Bounded lists sized at construction (FixedVector, not reserve(): a copied planner keeps
  // its room, so a copy plans without allocating).
  detail::FixedVector<std::int32_t> free_slots_;  // LIFO stack, popped from the back
  std::vector<std::uint32_t> stamps_;       // forward-membership stamps (scratch, not state)
  std::uint32_t epoch_ = 0;
  detail::FixedVector<ExpertId> scratch_;           // validated unique ids of the forward being planned
  detail::FixedVector<ExpertId> previous_forward_;  // entries to clear in forward_map_
  PlannerCounters counters_;
};

}  // namespace expert_cache::inline v0
