#pragma once
/// Frequency priors: a popularity table turned into Crf's per-expert bias (eviction/crf.hpp).
// The table counts requests per expert, from a calibration trace or online across requests; the
// host policy Crf and the device policy DeviceCrf (DevicePlanStorage::set_bias / plan_set_bias)
// both take the bias, with the same decisions.
//   weighted: bias = weight * (the expert's request rate per forward) / (1 - d) in Q32, i.e.
//             weight times the CRF the expert would settle at if it kept that rate: a popular
//             expert keeps part of its value when it is not requested for a while.
//   pinned:   the `pins` most requested experts get crf_pin_bias: evicted only when nothing
//             else can be. Ties go to the lower id.
// Host-only.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "expert_cache/eviction/crf.hpp"

namespace expert_cache::inline v0 {

/// Requests per expert over the forwards counted, and the Crf biases made from them.
class PopularityTable {
 public:
  /// @param num_experts  the id space [0, num_experts) counted (negative counts as 0)
  explicit PopularityTable(std::int32_t num_experts) : counts_(static_cast<std::size_t>(std::max(num_experts, 0)), 0) {}

  /// Counts one forward.
  /// @param unique_ids  the forward's unique ids; ids outside [0, E) are ignored (not counted)
  void count(std::span<const std::int32_t> unique_ids) noexcept {
    for (const std::int32_t e : unique_ids) {
      if (e >= 0 && static_cast<std::size_t>(e) < counts_.size()) ++counts_[static_cast<std::size_t>(e)];
    }
    ++forwards_;
  }

  /// Forwards counted so far.
  [[nodiscard]] std::uint64_t forwards() const noexcept { return forwards_; }
  /// Requests per expert so far.
  [[nodiscard]] std::span<const std::uint64_t> counts() const noexcept { return counts_; }

  /// The `weighted` prior (see the top of this header).
  /// @param weight     how much of its settled CRF an expert keeps; <= 0 gives no prior
  /// @param decay_q32  the Crf decay the bias is for (CrfParams::decay_q32)
  /// @return one bias per expert, for Crf's `bias` or DevicePlanStorage::set_bias
  [[nodiscard]] std::vector<std::uint64_t> weighted_bias(double weight,
                                                         std::uint64_t decay_q32 = crf_default_decay_q32) const {
    std::vector<std::uint64_t> bias(counts_.size(), 0);
    if (forwards_ == 0 || !(weight > 0.0)) return bias;
    const double one_minus_d = 1.0 - static_cast<double>(decay_q32) / static_cast<double>(crf_one);
    for (std::size_t e = 0; e < counts_.size(); ++e) {
      const double rate = static_cast<double>(counts_[e]) / static_cast<double>(forwards_);
      bias[e] = static_cast<std::uint64_t>(std::llround(weight * rate / one_minus_d * static_cast<double>(crf_one)));
    }
    return bias;
  }

  /// The `pinned` prior (see the top of this header).
  /// @param pins  how many of the most requested experts to pin (never-requested ones are not)
  /// @return one bias per expert: crf_pin_bias for the pinned, 0 for the others
  [[nodiscard]] std::vector<std::uint64_t> pinned_bias(std::int32_t pins) const {
    std::vector<std::uint64_t> bias(counts_.size(), 0);
    std::vector<std::int32_t> order(counts_.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
      return counts_[static_cast<std::size_t>(a)] > counts_[static_cast<std::size_t>(b)];
    });
    for (std::int32_t i = 0; i < pins && static_cast<std::size_t>(i) < order.size(); ++i) {
      if (counts_[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] == 0) break;  // never requested
      bias[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] = crf_pin_bias;
    }
    return bias;
  }

 private:
  std::vector<std::uint64_t> counts_;
  std::uint64_t forwards_ = 0;
};

}  // namespace expert_cache::inline v0
