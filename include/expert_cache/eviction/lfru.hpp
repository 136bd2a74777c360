#pragma once
/// LFRU: vLLM CachedWeightProvider's policy, reproduced exactly (docs/reference_providers.md,
/// "LFRU, exactly").
// Score of a resident = freq / (clock - last + 1) in double (Python true division); the
// victim is the lowest score among residents outside the forward, first in insertion
// order on ties. One clock per cache, no decay, freq restarts at 1 after re-insertion.
#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/fixed_vector.hpp"

namespace expert_cache::inline v0 {

/// The LFRU eviction policy (an eviction_policy): vLLM CachedWeightProvider's, exactly.
class Lfru {
 public:
  static constexpr std::string_view name = "lfru";
  // vLLM's free list is [0..cap-1] popped from the end: the first miss gets slot cap-1.
  static constexpr FreeSlotOrder free_slot_order = FreeSlotOrder::highest_first;

  /// @param shape  the cache's experts and slots
  explicit Lfru(CacheShape shape)
      : state_(static_cast<std::size_t>(shape.num_experts)), order_(static_cast<std::size_t>(shape.capacity)) {}

  void on_hit(ExpertId e) noexcept {
    Entry& s = state_[e.index()];
    ++clock_;
    ++s.freq;
    s.last = clock_;
  }

  // Called after choose_victim: the clock moves only now, as in the reference.
  void on_insert(ExpertId e) noexcept {
    ++clock_;
    state_[e.index()] = Entry{1, clock_};
    order_.push_back(e.value);  // residents <= capacity: fits the fixed storage
  }

  void on_remove(ExpertId e) noexcept {
    // Linear find + shift keeps the scan in choose_victim contiguous; both are O(capacity)
    // and removal happens at most once per miss.
    const auto it = std::find(order_.begin(), order_.end(), e.value);
    if (it != order_.end()) order_.erase(it);
    state_[e.index()] = Entry{};
  }

  [[nodiscard]] ExpertId choose_victim(const ForwardSet& needed) const noexcept {
    return clock_ < exact_clock_limit ? victim_exact(needed) : victim_double(needed);
  }

  /// The policy's clock: one tick per hit and per insert.
  [[nodiscard]] std::uint64_t clock() const noexcept { return clock_; }
  // Starts the clock elsewhere (tests: exercise the large-clock path). Only before first use.
  void set_clock_for_testing(std::uint64_t clock) noexcept { clock_ = clock; }
  [[nodiscard]] std::uint64_t freq(ExpertId e) const noexcept { return state_[e.index()].freq; }
  [[nodiscard]] std::uint64_t last(ExpertId e) const noexcept { return state_[e.index()].last; }
  /// Current residents in insertion order (the reference dict's iteration order).
  [[nodiscard]] std::span<const std::int32_t> insertion_order() const noexcept { return order_.view(); }

  friend bool operator==(const Lfru&, const Lfru&) = default;

 private:
  struct Entry {
    std::uint64_t freq = 0;
    std::uint64_t last = 0;
    friend bool operator==(const Entry&, const Entry&) = default;
  };

  // Below this clock, comparing f1/a1 < f2/a2 by f1*a2 < f2*a1 in integers gives exactly the
  // double comparison: f <= clock and a <= clock+1, so two different ratios differ by at
  // least 1/(a1*a2), more than one ulp of the larger, and round to different doubles in the
  // same order; equal ratios round equally. This avoids ~capacity divisions per miss.
  static constexpr std::uint64_t exact_clock_limit = std::uint64_t{1} << 25;

  [[nodiscard]] ExpertId victim_exact(const ForwardSet& needed) const noexcept {
    // Start from an "infinite" score (age 0) so the first candidate always wins; branch-free
    // selection because the running minimum changes unpredictably.
    std::int32_t best = -1;
    std::uint64_t best_freq = 1, best_age = 0;
    for (const std::int32_t e : order_) {
      const Entry& s = state_[static_cast<std::size_t>(e)];
      const std::uint64_t age = clock_ - s.last + 1;
      // strict: ties keep the earliest-inserted
      const bool take = !needed.contains(ExpertId(e)) && s.freq * best_age < best_freq * age;
      best = take ? e : best;
      best_freq = take ? s.freq : best_freq;
      best_age = take ? age : best_age;
    }
    return ExpertId(best);  // -1 only if the precondition was violated; the planner reports it
  }

  [[nodiscard]] ExpertId victim_double(const ForwardSet& needed) const noexcept {
    std::int32_t best = -1;
    double best_score = 0.0;
    for (const std::int32_t e : order_) {
      if (needed.contains(ExpertId(e))) continue;
      const Entry& s = state_[static_cast<std::size_t>(e)];
      const double score = static_cast<double>(s.freq) / static_cast<double>(clock_ - s.last + 1);
      if (best < 0 || score < best_score) {
        best = e;
        best_score = score;
      }
    }
    return ExpertId(best);
  }

  std::vector<Entry> state_;          // per expert; zero when not resident
  detail::FixedVector<std::int32_t> order_;  // residents in insertion order (copies keep room)
  std::uint64_t clock_ = 0;
};

static_assert(eviction_policy<Lfru>);

}  // namespace expert_cache::inline v0
