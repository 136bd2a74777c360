#pragma once
/// S3-FIFO (Yang et al., SOSP'23), adapted to a fixed slot pool that asks for one victim per miss.
// New experts enter a small probationary FIFO (~10 % of the slots); at its tail an expert that was
// hit meanwhile moves to the main FIFO, one that was not is evicted and remembered in a ghost FIFO.
// A miss on a ghost goes straight to main. Main is FIFO with reinsertion: a 2-bit counter (capped
// at 3) buys that many extra passes.
// Adaptations: the small queue is drained only while it holds at least its target size
// (otherwise main is over its share and gives the victim); a promoted expert restarts at
// freq 0; residents of the current forward are passed over in place (never moved, aged,
// or evicted).
#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/intrusive_queues.hpp"

namespace expert_cache::inline v0 {

/// The S3-FIFO eviction policy (an eviction_policy).
class S3Fifo {
 public:
  static constexpr std::string_view name = "s3fifo";

  /// @param shape  the cache's experts and slots (the small FIFO's target is a tenth of them)
  explicit S3Fifo(CacheShape shape)
      : queues_(shape.num_experts),
        freq_(static_cast<std::size_t>(shape.num_experts), 0),
        ghost_stamp_(static_cast<std::size_t>(shape.num_experts), 0),
        small_target_(std::max<std::int32_t>(1, (shape.capacity + 5) / 10)),
        ghost_capacity_(std::max<std::int32_t>(1, shape.capacity - small_target_)) {}

  void on_hit(ExpertId e) noexcept {
    std::uint8_t& f = freq_[e.index()];
    f = static_cast<std::uint8_t>(std::min<int>(f + 1, max_freq));
  }

  void on_insert(ExpertId e) noexcept {
    std::uint64_t& stamp = ghost_stamp_[e.index()];
    const bool ghost = in_ghost(stamp);
    stamp = 0;
    freq_[e.index()] = 0;
    queues_.push_newest(ghost ? main : small, e.value);
  }

  void on_remove(ExpertId e) noexcept {
    // Only a victim taken from the small queue leaves a ghost; invalidations leave none.
    if (e.value == ghost_candidate_) ghost_stamp_[e.index()] = ++ghost_count_;
    ghost_candidate_ = none;
    queues_.remove(e.value);
    freq_[e.index()] = 0;
  }

  [[nodiscard]] ExpertId choose_victim(const ForwardSet& needed) noexcept {
    ghost_candidate_ = none;
    if (queues_.size(small) >= small_target_) {
      if (const std::int32_t v = drain_small(needed); v != none) {
        ghost_candidate_ = v;
        return ExpertId(v);
      }
    }
    if (const std::int32_t v = evict_main(needed); v != none) return ExpertId(v);
    // Main is all in use: take the oldest small entry outside the forward, hit or not.
    for (std::int32_t e = queues_.oldest(small); e != none; e = queues_.newer(e)) {
      if (!needed.contains(ExpertId(e))) {
        ghost_candidate_ = e;
        return ExpertId(e);
      }
    }
    return ExpertId();  // every resident is in the forward: precondition violated
  }

  [[nodiscard]] std::int32_t small_size() const noexcept { return queues_.size(small); }
  [[nodiscard]] std::int32_t main_size() const noexcept { return queues_.size(main); }
  [[nodiscard]] bool in_small(ExpertId e) const noexcept { return queues_.contains(small, e.value); }
  [[nodiscard]] bool in_main(ExpertId e) const noexcept { return queues_.contains(main, e.value); }
  [[nodiscard]] bool in_ghost(ExpertId e) const noexcept { return in_ghost(ghost_stamp_[e.index()]); }
  [[nodiscard]] std::int32_t freq(ExpertId e) const noexcept { return freq_[e.index()]; }

  friend bool operator==(const S3Fifo&, const S3Fifo&) = default;

 private:
  static constexpr std::size_t small = 0, main = 1;
  static constexpr std::int32_t none = -1;
  static constexpr int max_freq = 3;

  // The ghost is a FIFO of the last ghost_capacity_ small-queue victims; a per-expert stamp
  // of its insertion number replaces the queue itself (older stamps have fallen out).
  [[nodiscard]] bool in_ghost(std::uint64_t stamp) const noexcept {
    return stamp != 0 && ghost_count_ - stamp < static_cast<std::uint64_t>(ghost_capacity_);
  }

  // Small-queue tail: promote hit entries to main, return the first unhit one.
  std::int32_t drain_small(const ForwardSet& needed) noexcept {
    std::int32_t e = queues_.oldest(small);
    while (e != none) {
      const std::int32_t next = queues_.newer(e);
      if (!needed.contains(ExpertId(e))) {
        std::uint8_t& f = freq_[static_cast<std::size_t>(e)];
        if (f == 0) return e;
        f = 0;
        queues_.move_to_newest(main, e);
      }
      e = next;
    }
    return none;
  }

  // Main tail: reinsert while the counter is positive (decrementing it), else evict.
  // Each pass lowers every passed counter, so max_freq + 1 passes always suffice.
  std::int32_t evict_main(const ForwardSet& needed) noexcept {
    const std::int32_t n = queues_.size(main);
    std::int32_t e = queues_.oldest(main);
    for (std::int32_t steps = (max_freq + 1) * n + 1; steps > 0 && e != none; --steps) {
      const std::int32_t next = queues_.newer(e);
      if (!needed.contains(ExpertId(e))) {
        std::uint8_t& f = freq_[static_cast<std::size_t>(e)];
        if (f == 0) return e;
        --f;
        queues_.move_to_newest(main, e);
      }
      // After a reinsertion `next` may be none only if e was the newest; wrap to the oldest.
      e = next != none ? next : queues_.oldest(main);
    }
    return none;
  }

  detail::IntrusiveQueues<2> queues_;
  std::vector<std::uint8_t> freq_;          // 0..max_freq, hits since insertion/promotion
  std::vector<std::uint64_t> ghost_stamp_;  // 0: never a ghost
  std::uint64_t ghost_count_ = 0;
  std::int32_t small_target_;
  std::int32_t ghost_capacity_;
  std::int32_t ghost_candidate_ = none;  // victim chosen from small: ghosted in on_remove
};

static_assert(eviction_policy<S3Fifo>);

}  // namespace expert_cache::inline v0
