#pragma once
/// W-TinyLFU (Einziger, Friedman & Manes, ACM ToS 2017; Caffeine's policy) on a fixed slot pool.
// A small LRU window (1 % of the slots) takes every new expert; the main area is a segmented LRU
// (probation 20 %, protected 80 %). When the window is full its oldest entry is a candidate for
// main and must beat main's victim on frequency to be admitted; the loser is evicted. Frequency is
// TinyLFU's aged counter: +1 per request (capped at 15, as the 4-bit sketch), all counters halved
// every 10 x capacity requests (the "reset").
// Adaptations: the id space is small and dense, so the frequency sketch is an exact
// counter per id (no collisions, same memory as a count-min sketch of that width); the
// window/main split is fixed; residents of the current forward are never candidates.
// Cost: O(1) per request, the reset O(num_experts) every 10 x capacity requests (amortised
// O(1) when num_experts <= 10 x capacity, which holds at the capacities that matter).
// Device planner: fits (three intrusive lists and a byte per id; the reset is one parallel
// pass), but its list walks are sequential.
#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/intrusive_queues.hpp"

namespace expert_cache::inline v0 {

/// The W-TinyLFU eviction policy (an eviction_policy).
class WTinyLfu {
 public:
  static constexpr std::string_view name = "wtinylfu";

  /// @param shape  the cache's experts and slots
  explicit WTinyLfu(CacheShape shape)
      : lists_(shape.num_experts),
        freq_(static_cast<std::size_t>(shape.num_experts), 0),
        window_target_(std::max<std::int32_t>(1, (shape.capacity + 50) / 100)),
        protected_target_(std::max<std::int32_t>(
            0, static_cast<std::int32_t>(0.8 * (shape.capacity - window_target_)))),
        main_capacity_(shape.capacity - window_target_),
        sample_size_(10 * static_cast<std::uint64_t>(std::max(shape.capacity, 1))) {}

  void on_hit(ExpertId e) noexcept {
    count(e.value);
    switch (lists_.queue_of(e.value)) {
      case window: lists_.move_to_newest(window, e.value); break;
      case probation:
        lists_.move_to_newest(protect, e.value);
        if (lists_.size(protect) > protected_target_) {  // demote protected's oldest
          lists_.move_to_newest(probation, lists_.oldest(protect));
        }
        break;
      default: lists_.move_to_newest(protect, e.value); break;
    }
  }

  void on_insert(ExpertId e) noexcept {
    count(e.value);
    lists_.push_newest(window, e.value);
    // While the pool fills (free slots, no victims) the window's overflow moves to main
    // unopposed; once full, the duel in choose_victim keeps the split.
    if (lists_.size(window) > window_target_ && lists_.size(probation) + lists_.size(protect) < main_capacity_) {
      lists_.move_to_newest(probation, lists_.oldest(window));
    }
  }

  void on_remove(ExpertId e) noexcept { lists_.remove(e.value); }

  // Mutates (admits the window's candidate into probation), hence not const.
  [[nodiscard]] ExpertId choose_victim(const ForwardSet& needed) noexcept {
    const std::int32_t main_victim = oldest_outside(probation, needed) != none ? oldest_outside(probation, needed)
                                                                               : oldest_outside(protect, needed);
    if (lists_.size(window) >= window_target_) {
      const std::int32_t candidate = oldest_outside(window, needed);
      if (candidate != none) {
        if (main_victim == none || freq_[idx(candidate)] <= freq_[idx(main_victim)]) return ExpertId(candidate);
        lists_.move_to_newest(probation, candidate);  // admitted: main's victim goes instead
        return ExpertId(main_victim);
      }
    }
    if (main_victim != none) return ExpertId(main_victim);
    return ExpertId(oldest_outside(window, needed));  // -1 only if the precondition is violated
  }

  [[nodiscard]] std::int32_t frequency(ExpertId e) const noexcept { return freq_[e.index()]; }
  [[nodiscard]] bool in_window(ExpertId e) const noexcept { return lists_.contains(window, e.value); }
  [[nodiscard]] bool in_probation(ExpertId e) const noexcept { return lists_.contains(probation, e.value); }
  [[nodiscard]] bool in_protected(ExpertId e) const noexcept { return lists_.contains(protect, e.value); }

  friend bool operator==(const WTinyLfu&, const WTinyLfu&) = default;

 private:
  static constexpr std::uint8_t window = 0, probation = 1, protect = 2;
  static constexpr std::int32_t none = -1;
  static constexpr std::uint8_t max_freq = 15;
  static std::size_t idx(std::int32_t e) noexcept { return static_cast<std::size_t>(e); }

  void count(std::int32_t e) noexcept {
    std::uint8_t& f = freq_[idx(e)];
    if (f < max_freq) ++f;
    if (++samples_ >= sample_size_) {  // TinyLFU reset: halve every counter
      samples_ = 0;
      for (std::uint8_t& c : freq_) c = static_cast<std::uint8_t>(c >> 1);
    }
  }

  [[nodiscard]] std::int32_t oldest_outside(std::uint8_t q, const ForwardSet& needed) const noexcept {
    for (std::int32_t e = lists_.oldest(q); e != none; e = lists_.newer(e)) {
      if (!needed.contains(ExpertId(e))) return e;
    }
    return none;
  }

  detail::IntrusiveQueues<3> lists_;  // oldest = LRU end
  std::vector<std::uint8_t> freq_;
  std::int32_t window_target_;
  std::int32_t protected_target_;
  std::int32_t main_capacity_;
  std::uint64_t sample_size_;
  std::uint64_t samples_ = 0;
};

static_assert(eviction_policy<WTinyLfu>);

}  // namespace expert_cache::inline v0
