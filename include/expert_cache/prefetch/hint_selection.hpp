#pragma once
/// Scored prefetch hints: which of a caller's predicted ids a prefetch considers, and in which
/// order.
// Host-only. One place for the rule, so that every prefetch entry applies the same one:
// ForwardPlanner::plan_prefetch (and through it ExpertCache::prefetch and the replay tool) and
// DeviceExpertCache::prefetch from host ids, which passes the selected ids on to its device plan.
//
// The contract (PrefetchOptions in cache/options.hpp, docs/prefetch.md "Scored hints"): scores[i] is the
// caller's estimate of the probability that the next forward reads ids[i], in [0, 1]. With
// scores, the hints scoring below min_score are skipped (counted, not fetched) and the others are
// taken highest score first; equal scores keep the caller's order. Without scores (an empty span)
// the ids are taken as given, best first.
//
// Why min_score defaults to 0.5. A speculative fill costs one expert's copy on the link whether it
// is used or not, and in a full cache it evicts a resident. A hint of probability p saves a demand
// miss (one copy on the critical path) with probability p and wastes its copy with probability
// 1 - p. Where the link is the bottleneck (a fill that overlaps compute still delays the next
// fills and misses), a wasted copy costs as much as the miss it might have saved, so the expected
// saving p - (1 - p) is positive exactly from p = 0.5: a fill that is more likely wasted than
// used makes the step slower on average. It is the lowest threshold that keeps the bytes moved by
// speculative fills at most twice the bytes they save (precision >= 0.5 for calibrated scores).
// The eviction only raises the break-even (the evicted resident may be needed again), so 0.5 is
// the permissive end of what pays off on a busy link. A caller whose link idles during compute
// (wasted copies cost only the eviction) may lower it; one whose evicted residents are often
// needed again may raise it.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "expert_cache/base/status.hpp"

namespace expert_cache::inline v0 {

/// The least score a scored hint needs to be fetched, unless the caller says otherwise
/// (PrefetchOptions::min_score). Why 0.5: the header comment above.
inline constexpr float default_min_score = 0.5f;

/// Checks scored-hint arguments without selecting: `min_score` in [0, 1], and, when `scores` is
/// not empty, one score per id, each a finite number in [0, 1].
/// @param ids        the predicted ids
/// @param scores     their probabilities, parallel to `ids`; empty: unscored
/// @param min_score  the least score a hint needs to be fetched
/// @return ok, or invalid_argument with the offending index and value in the message
[[nodiscard]] inline Status check_hint_scores(std::span<const std::int32_t> ids, std::span<const float> scores,
                                              float min_score) noexcept {
  if (!(min_score >= 0.0f && min_score <= 1.0f)) {  // also NaN
    return Status::format(ErrorCode::invalid_argument,
                          "prefetch min_score %g is not in [0, 1] (the least probability a scored hint needs)",
                          static_cast<double>(min_score));
  }
  if (scores.empty()) return {};
  if (scores.size() != ids.size()) {
    return Status::format(ErrorCode::invalid_argument,
                          "prefetch got %zu scores for %zu predicted ids (scores[i] belongs to ids[i]; no scores: "
                          "an empty span)",
                          scores.size(), ids.size());
  }
  for (std::size_t i = 0; i < scores.size(); ++i) {
    const float s = scores[i];
    if (!(s >= 0.0f && s <= 1.0f)) {  // also NaN and the infinities
      return Status::format(ErrorCode::invalid_argument,
                            "prefetch score %g at index %zu (expert %d) is not a probability in [0, 1]",
                            static_cast<double>(s), i, ids[i]);
    }
  }
  return {};
}

/// Applies the scored-hint rule to one predicted list. Buffers are sized at construction for
/// `max_hints` ids (a cache's experts), so select() never allocates.
class HintSelector {
 public:
  /// @param max_hints  the most ids one list may have (a cache's experts)
  /// @throws Error invalid_argument for max_hints < 0
  explicit HintSelector(std::int32_t max_hints)
      : order_(checked(max_hints)), selected_(static_cast<std::size_t>(max_hints)) {}

  /// Selects from `ids` (best first when unscored) with `scores` (empty = no scores) and
  /// `min_score`; read the result with ids() and skipped_unlikely(). The ids themselves are not
  /// checked (the caller's range checks stay where they are).
  /// @return ok; on error the previous selection stays as it was: those of check_hint_scores,
  ///         and too_many_experts for more than max_hints ids
  Status select(std::span<const std::int32_t> ids, std::span<const float> scores, float min_score) noexcept {
    if (ids.size() > order_.size()) {
      return Status::format(ErrorCode::too_many_experts, "prefetch got %zu predicted ids, more than the %zu experts",
                            ids.size(), order_.size());
    }
    if (Status s = check_hint_scores(ids, scores, min_score); !s) return s;
    if (scores.empty()) {
      unscored_ = ids;
      scored_ = false;
      skipped_unlikely_ = 0;
      return {};
    }
    std::size_t n = 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (scores[i] >= min_score) order_[n++] = static_cast<std::int32_t>(i);
    }
    // Highest score first; the index breaks ties, so equal scores keep the caller's order
    // (std::sort, unlike std::stable_sort, needs no buffer).
    std::sort(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(n), [&](std::int32_t a, std::int32_t b) {
      const float sa = scores[static_cast<std::size_t>(a)];
      const float sb = scores[static_cast<std::size_t>(b)];
      return sa != sb ? sa > sb : a < b;
    });
    for (std::size_t k = 0; k < n; ++k) selected_[k] = ids[static_cast<std::size_t>(order_[k])];
    count_ = n;
    scored_ = true;
    skipped_unlikely_ = static_cast<std::uint32_t>(ids.size() - n);
    return {};
  }

  /// The ids to consider, in order: a view into this selector (scored) or the caller's `ids`
  /// (unscored), valid until the next select() and, unscored, while the caller's ids live.
  [[nodiscard]] std::span<const std::int32_t> ids() const noexcept {
    return scored_ ? std::span<const std::int32_t>(selected_.data(), count_) : unscored_;
  }
  /// Entries of the last selected list skipped for a score below min_score.
  [[nodiscard]] std::uint32_t skipped_unlikely() const noexcept { return skipped_unlikely_; }
  /// The bound given at construction.
  [[nodiscard]] std::int32_t max_hints() const noexcept { return static_cast<std::int32_t>(order_.size()); }

 private:
  static std::size_t checked(std::int32_t max_hints) {
    if (max_hints < 0) {
      throw Error(ErrorCode::invalid_argument,
                  detail::join({"a hint selector needs max_hints >= 0, got ", detail::DecimalText(max_hints)}));
    }
    return static_cast<std::size_t>(max_hints);
  }

  std::vector<std::int32_t> order_;     // scratch: indices of the kept hints, sorted
  std::vector<std::int32_t> selected_;  // the kept ids, in order
  std::size_t count_ = 0;                 // scored: how many of selected_ were kept
  std::span<const std::int32_t> unscored_;  // unscored: the caller's ids
  bool scored_ = false;
  std::uint32_t skipped_unlikely_ = 0;
};

}  // namespace expert_cache::inline v0
