#pragma once
/// SimRuntime's optional virtual time: op finish = max(stream time, host time at enqueue, awaited
/// record / gate time) + cost.
// Independent of the schedule chosen by run_random.
// Host-only.
#include "expert_cache/base/version.hpp"
#include <algorithm>
#include <cstddef>
#include <vector>

namespace expert_cache::inline v0 {

// Virtual-time costs (nanoseconds). All zero by default: time stays 0.
struct SimCostModel {
  double copy_latency_ns = 0.0;    // per copy (a batch pays it once per descriptor)
  double copy_bytes_per_ns = 0.0;  // bandwidth; 0 = infinite
  double launch_ns = 0.0;          // default duration of a launch (see set_next_duration_ns)
  double host_call_ns = 0.0;       // host time spent per enqueueing call
  // Copies of every stream take turns on one link (a PCIe direction is one link, whichever
  // stream or engine issues the copy): a copy enqueued under this model occupies the link for
  // its duration, starting in the first gap at or after its ready time that holds it whole.
  // Off: each stream copies at full bandwidth, however many copy at once.
  bool copies_share_link = false;
};

namespace detail::sim {

// The shared link's busy intervals [start, end), sorted and disjoint. A copy takes the first
// gap at or after its ready time that holds its whole duration (first fit): the result does
// not depend on which of two ready streams the scheduler completes first, as long as both
// fit where they would go. Only the latest `max_intervals` are kept (a copy older than those
// sees a free link), so a long run costs bounded memory.
class LinkTimeline {
 public:
  static constexpr std::size_t max_intervals = 4096;

  // The start of a copy of `duration` ready at `ready`, and its interval booked.
  double book(double ready, double duration) {
    if (duration <= 0.0) return ready;
    double start = ready;
    // Skip the intervals wholly before it (sorted and disjoint, so their ends are sorted too).
    auto i = static_cast<std::size_t>(
        std::partition_point(busy_.begin(), busy_.end(), [&](const Interval& b) { return b.end <= start; }) -
        busy_.begin());
    for (; i < busy_.size(); ++i) {
      if (start + duration <= busy_[i].start) break;  // fits in the gap before interval i
      start = std::max(start, busy_[i].end);
    }
    busy_.insert(busy_.begin() + static_cast<std::ptrdiff_t>(i), Interval{start, start + duration});
    if (busy_.size() > max_intervals) busy_.erase(busy_.begin());
    return start;
  }
  void clear() noexcept { busy_.clear(); }
  [[nodiscard]] std::size_t size() const noexcept { return busy_.size(); }

 private:
  struct Interval {
    double start;
    double end;
  };
  std::vector<Interval> busy_;
};

// The model plus the one-shot duration override of the next launch.
class CostClock {
 public:
  void set_model(const SimCostModel& model) noexcept { model_ = model; }
  [[nodiscard]] const SimCostModel& model() const noexcept { return model_; }

  void set_next_duration_ns(double ns) noexcept { next_duration_ns_ = ns; }
  // The override if one is set (and clears it), else `fallback`.
  double take_duration(double fallback) noexcept {
    const double d = next_duration_ns_ >= 0.0 ? next_duration_ns_ : fallback;
    next_duration_ns_ = -1.0;
    return d;
  }
  void clear_override() noexcept { next_duration_ns_ = -1.0; }

  [[nodiscard]] double copy_cost(std::size_t bytes) const noexcept {
    return model_.copy_latency_ns +
           (model_.copy_bytes_per_ns > 0.0 ? static_cast<double>(bytes) / model_.copy_bytes_per_ns : 0.0);
  }

 private:
  SimCostModel model_;
  double next_duration_ns_ = -1.0;  // < 0: use the cost model
};

}  // namespace detail::sim

}  // namespace expert_cache::inline v0
