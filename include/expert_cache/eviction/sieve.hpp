#pragma once
/// SIEVE (Zhang et al., NSDI'24): a FIFO queue with one visited bit per entry and a hand that
/// sweeps from the oldest entry towards the newest.
// A hit only sets the bit (no list move), the hand clears set bits as it passes and evicts the
// first unvisited entry.
#include <cstdint>
#include <string_view>
#include <vector>

#include "expert_cache/base/concepts.hpp"

namespace expert_cache::inline v0 {

/// The SIEVE eviction policy (an eviction_policy).
class Sieve {
 public:
  static constexpr std::string_view name = "sieve";

  /// @param shape  the cache's experts and slots
  explicit Sieve(CacheShape shape)
      : newer_(static_cast<std::size_t>(shape.num_experts), none),
        older_(static_cast<std::size_t>(shape.num_experts), none),
        visited_(static_cast<std::size_t>(shape.num_experts), 0) {}

  void on_hit(ExpertId e) noexcept { visited_[e.index()] = 1; }

  void on_insert(ExpertId e) noexcept {  // new entries enter at the newest end, unvisited
    const auto i = e.index();
    older_[i] = newest_;
    newer_[i] = none;
    visited_[i] = 0;
    if (newest_ != none) newer_[static_cast<std::size_t>(newest_)] = e.value; else oldest_ = e.value;
    newest_ = e.value;
    ++size_;
  }

  void on_remove(ExpertId e) noexcept {
    const auto i = e.index();
    // The hand keeps its place in the sweep: it moves on to the next newer entry.
    if (hand_ == e.value) hand_ = newer_[i];
    if (older_[i] != none) newer_[static_cast<std::size_t>(older_[i])] = newer_[i]; else oldest_ = newer_[i];
    if (newer_[i] != none) older_[static_cast<std::size_t>(newer_[i])] = older_[i]; else newest_ = older_[i];
    newer_[i] = older_[i] = none;
    visited_[i] = 0;
    --size_;
  }

  // Mutates (clears bits, moves the hand), hence not const. Entries of the current forward
  // are passed over untouched: they are in use, so neither evicted nor aged. Terminates
  // within two sweeps because at least one resident is outside `needed`.
  [[nodiscard]] ExpertId choose_victim(const ForwardSet& needed) noexcept {
    std::int32_t e = hand_ != none ? hand_ : oldest_;
    // Two full sweeps always suffice; the bound only guards a violated precondition.
    for (std::int32_t steps = 2 * size_ + 2; steps > 0; --steps) {
      if (e == none) {
        if (oldest_ == none) return ExpertId();  // empty: precondition violated
        e = oldest_;                             // wrap around
      }
      const auto i = static_cast<std::size_t>(e);
      if (!needed.contains(ExpertId(e))) {
        if (visited_[i] == 0) {
          hand_ = e;  // on_remove advances it past the victim
          return ExpertId(e);
        }
        visited_[i] = 0;
      }
      e = newer_[i];
    }
    return ExpertId();  // every resident is in the forward: precondition violated
  }

  friend bool operator==(const Sieve&, const Sieve&) = default;

 private:
  static constexpr std::int32_t none = -1;

  std::vector<std::int32_t> newer_, older_;  // intrusive FIFO over expert ids
  std::vector<std::uint8_t> visited_;
  std::int32_t newest_ = none, oldest_ = none;
  std::int32_t size_ = 0;
  std::int32_t hand_ = none;  // none: start the next sweep at the oldest entry
};

static_assert(eviction_policy<Sieve>);

}  // namespace expert_cache::inline v0
