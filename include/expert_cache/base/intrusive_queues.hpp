#pragma once
/// A fixed set of FIFO/LRU queues threaded through per-expert link arrays: every expert is in at
/// most one queue, so one pair of link arrays serves all of them.
// O(1) push/remove, no allocation after construction. Shared by the multi-queue policies (S3-FIFO,
// ARC).
#include "expert_cache/base/version.hpp"
#include <array>
#include <cstdint>
#include <vector>

namespace expert_cache::inline v0::detail {

template <std::size_t NumQueues>
class IntrusiveQueues {
 public:
  static constexpr std::int32_t none = -1;
  static constexpr std::uint8_t no_queue = 0xff;

  IntrusiveQueues() = default;
  explicit IntrusiveQueues(std::int32_t num_ids)
      : newer_(static_cast<std::size_t>(num_ids), none),
        older_(static_cast<std::size_t>(num_ids), none),
        queue_(static_cast<std::size_t>(num_ids), no_queue) {}

  [[nodiscard]] std::uint8_t queue_of(std::int32_t e) const noexcept { return queue_[idx(e)]; }
  [[nodiscard]] bool contains(std::size_t q, std::int32_t e) const noexcept { return queue_[idx(e)] == q; }
  [[nodiscard]] std::int32_t oldest(std::size_t q) const noexcept { return ends_[q].oldest; }
  [[nodiscard]] std::int32_t newer(std::int32_t e) const noexcept { return newer_[idx(e)]; }
  [[nodiscard]] std::int32_t size(std::size_t q) const noexcept { return ends_[q].size; }

  // Precondition: e is in no queue.
  void push_newest(std::size_t q, std::int32_t e) noexcept {
    Ends& end = ends_[q];
    const auto i = idx(e);
    older_[i] = end.newest;
    newer_[i] = none;
    queue_[i] = static_cast<std::uint8_t>(q);
    if (end.newest != none) newer_[idx(end.newest)] = e; else end.oldest = e;
    end.newest = e;
    ++end.size;
  }

  // No-op when e is in no queue.
  void remove(std::int32_t e) noexcept {
    const auto i = idx(e);
    if (queue_[i] == no_queue) return;
    Ends& end = ends_[queue_[i]];
    if (older_[i] != none) newer_[idx(older_[i])] = newer_[i]; else end.oldest = newer_[i];
    if (newer_[i] != none) older_[idx(newer_[i])] = older_[i]; else end.newest = older_[i];
    newer_[i] = older_[i] = none;
    queue_[i] = no_queue;
    --end.size;
  }

  void move_to_newest(std::size_t q, std::int32_t e) noexcept {
    remove(e);
    push_newest(q, e);
  }

  friend bool operator==(const IntrusiveQueues&, const IntrusiveQueues&) = default;

 private:
  struct Ends {
    std::int32_t oldest = none, newest = none, size = 0;
    friend bool operator==(const Ends&, const Ends&) = default;
  };
  static std::size_t idx(std::int32_t e) noexcept { return static_cast<std::size_t>(e); }

  std::vector<std::int32_t> newer_, older_;
  std::vector<std::uint8_t> queue_;
  std::array<Ends, NumQueues> ends_{};
};

}  // namespace expert_cache::inline v0::detail
