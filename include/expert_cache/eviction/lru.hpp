#pragma once
/// Least recently requested first (the row provider's policy).
#include <cstdint>
#include <vector>

#include "expert_cache/base/concepts.hpp"

namespace expert_cache::inline v0 {

/// The LRU eviction policy (an eviction_policy): evicts the least recently requested resident.
// Intrusive doubly linked list over expert ids: O(1) touch, insert and remove, no allocation
// after construction. Head = least recently used.
class Lru {
 public:
  static constexpr std::string_view name = "lru";

  /// @param shape  the cache's experts and slots
  explicit Lru(CacheShape shape)
      : prev_(static_cast<std::size_t>(shape.num_experts), none),
        next_(static_cast<std::size_t>(shape.num_experts), none) {}

  void on_hit(ExpertId e) noexcept {
    unlink(e.value);
    push_back(e.value);
  }
  void on_insert(ExpertId e) noexcept { push_back(e.value); }
  void on_remove(ExpertId e) noexcept { unlink(e.value); }

  [[nodiscard]] ExpertId choose_victim(const ForwardSet& needed) const noexcept {
    for (std::int32_t e = head_; e != none; e = next_[static_cast<std::size_t>(e)]) {
      if (!needed.contains(ExpertId(e))) return ExpertId(e);
    }
    return ExpertId();  // precondition violated; the planner reports it
  }

  friend bool operator==(const Lru&, const Lru&) = default;

 private:
  static constexpr std::int32_t none = -1;

  void push_back(std::int32_t e) noexcept {
    const auto i = static_cast<std::size_t>(e);
    prev_[i] = tail_;
    next_[i] = none;
    if (tail_ != none) next_[static_cast<std::size_t>(tail_)] = e; else head_ = e;
    tail_ = e;
  }
  void unlink(std::int32_t e) noexcept {
    const auto i = static_cast<std::size_t>(e);
    if (prev_[i] != none) next_[static_cast<std::size_t>(prev_[i])] = next_[i]; else head_ = next_[i];
    if (next_[i] != none) prev_[static_cast<std::size_t>(next_[i])] = prev_[i]; else tail_ = prev_[i];
    prev_[i] = next_[i] = none;
  }

  std::vector<std::int32_t> prev_, next_;
  std::int32_t head_ = none, tail_ = none;
};

static_assert(eviction_policy<Lru>);

}  // namespace expert_cache::inline v0
