#pragma once
// SimRuntime's optional virtual time: op finish = max(stream time, host time at enqueue,
// awaited record / gate time) + cost. Independent of the schedule chosen by run_random.
// Host-only.
#include "expert_cache/version.hpp"
#include <cstddef>

namespace expert_cache::inline v0 {

// Virtual-time costs (nanoseconds). All zero by default: time stays 0.
struct SimCostModel {
  double copy_latency_ns = 0.0;    // per copy (a batch pays it once per descriptor)
  double copy_bytes_per_ns = 0.0;  // bandwidth; 0 = infinite
  double launch_ns = 0.0;          // default duration of a launch (see set_next_duration_ns)
  double host_call_ns = 0.0;       // host time spent per enqueueing call
};

namespace detail::sim {

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
