#pragma once
/// ARC (Megiddo & Modha, FAST'03) on a fixed slot pool.
// T1 holds experts seen once recently, T2 experts seen at least twice; the ghost lists B1/B2
// remember ids recently evicted from each. A miss that finds its id in B1 (B2) grows (shrinks) the
// target size p of T1, so the split between recency and frequency tunes itself.
// Adaptations: ARC's replacement depends on the missing id, which the eviction_policy
// interface does not pass to choose_victim; the policy records the forward's ids in
// begin_forward and counts on_hit/on_insert calls to know which id the current miss is.
// Victims skip residents of the current forward (falling back to the other list); an
// invalidated expert leaves no ghost.
#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/fixed_vector.hpp"
#include "expert_cache/base/intrusive_queues.hpp"

namespace expert_cache::inline v0 {

/// The ARC eviction policy (an eviction_policy).
class Arc {
 public:
  static constexpr std::string_view name = "arc";

  /// @param shape  the cache's experts and slots
  explicit Arc(CacheShape shape)
      : lists_(shape.num_experts), capacity_(shape.capacity), forward_(static_cast<std::size_t>(shape.capacity)) {}

  // The planner never passes more ids than the capacity; assign() keeps at most that many, so
  // this stays allocation-free even if a caller does.
  void begin_forward(std::span<const ExpertId> ids) noexcept {
    forward_.assign(ids.begin(), ids.end());
    cursor_ = 0;
  }

  void on_hit(ExpertId e) noexcept {
    lists_.move_to_newest(t2, e.value);
    ++cursor_;
  }

  void on_insert(ExpertId e) noexcept {
    const std::uint8_t q = lists_.queue_of(e.value);
    if (!adapted_) adapt(q);  // a miss that found a free slot still adapts p
    adapted_ = false;
    if (q == b1 || q == b2) {
      lists_.remove(e.value);
      lists_.push_newest(t2, e.value);
    } else {
      // Keep the directory within c ids of history for T1+B1 and 2c overall.
      if (lists_.size(t1) + lists_.size(b1) >= capacity_) {
        if (lists_.size(b1) > 0) lists_.remove(lists_.oldest(b1));
      } else if (directory_size() >= 2 * capacity_ && lists_.size(b2) > 0) {
        lists_.remove(lists_.oldest(b2));
      }
      lists_.push_newest(t1, e.value);
    }
    ++cursor_;
  }

  void on_remove(ExpertId e) noexcept {
    const std::uint8_t q = lists_.queue_of(e.value);
    lists_.remove(e.value);
    if (e.value == victim_ && ghost_victim_) lists_.push_newest(q == t1 ? b1 : b2, e.value);
    victim_ = none;
  }

  [[nodiscard]] ExpertId choose_victim(const ForwardSet& needed) noexcept {
    const std::int32_t x = current_miss();
    const std::uint8_t q = x != none ? lists_.queue_of(x) : detail::IntrusiveQueues<4>::no_queue;
    adapt(q);
    adapted_ = true;
    std::int32_t v = none;
    ghost_victim_ = true;
    if (q != b1 && q != b2 && lists_.size(t1) >= capacity_) {
      // T1 alone fills the directory's recency half: drop its LRU without a ghost.
      v = lru_outside(t1, needed);
      ghost_victim_ = false;
    }
    if (v == none) {
      const double t1_size = lists_.size(t1);
      const bool from_t1 = lists_.size(t1) > 0 && (t1_size > p_ || (q == b2 && t1_size == p_));
      v = lru_outside(from_t1 ? t1 : t2, needed);
      if (v == none) v = lru_outside(from_t1 ? t2 : t1, needed);
      ghost_victim_ = true;
    }
    victim_ = v;
    return ExpertId(v);
  }

  [[nodiscard]] double target_t1() const noexcept { return p_; }
  [[nodiscard]] bool in_t1(ExpertId e) const noexcept { return lists_.contains(t1, e.value); }
  [[nodiscard]] bool in_t2(ExpertId e) const noexcept { return lists_.contains(t2, e.value); }
  [[nodiscard]] bool in_b1(ExpertId e) const noexcept { return lists_.contains(b1, e.value); }
  [[nodiscard]] bool in_b2(ExpertId e) const noexcept { return lists_.contains(b2, e.value); }

  friend bool operator==(const Arc&, const Arc&) = default;

 private:
  static constexpr std::uint8_t t1 = 0, t2 = 1, b1 = 2, b2 = 3;
  static constexpr std::int32_t none = -1;

  [[nodiscard]] std::int32_t current_miss() const noexcept {
    return cursor_ < forward_.size() ? forward_[cursor_].value : none;
  }
  [[nodiscard]] std::int32_t directory_size() const noexcept {
    return lists_.size(t1) + lists_.size(t2) + lists_.size(b1) + lists_.size(b2);
  }

  // ARC's learning rule: a ghost hit in B1 means T1 was too small, in B2 too large.
  void adapt(std::uint8_t q) noexcept {
    const double n1 = lists_.size(b1), n2 = lists_.size(b2);
    if (q == b1) {
      p_ = std::min<double>(capacity_, p_ + std::max(1.0, n2 / n1));
    } else if (q == b2) {
      p_ = std::max(0.0, p_ - std::max(1.0, n1 / n2));
    }
  }

  [[nodiscard]] std::int32_t lru_outside(std::uint8_t q, const ForwardSet& needed) const noexcept {
    for (std::int32_t e = lists_.oldest(q); e != none; e = lists_.newer(e)) {
      if (!needed.contains(ExpertId(e))) return e;
    }
    return none;
  }

  detail::IntrusiveQueues<4> lists_;  // oldest = LRU end
  std::int32_t capacity_;
  double p_ = 0.0;                     // target size of T1
  detail::FixedVector<ExpertId> forward_;  // this forward's ids in processing order (copies keep room)
  std::size_t cursor_ = 0;             // on_hit + on_insert calls since begin_forward
  std::int32_t victim_ = none;         // last choose_victim result, consumed by on_remove
  bool ghost_victim_ = true;
  bool adapted_ = false;               // p already adapted for the current miss
};

static_assert(eviction_policy<Arc>);
static_assert(has_begin_forward<Arc>);

}  // namespace expert_cache::inline v0
