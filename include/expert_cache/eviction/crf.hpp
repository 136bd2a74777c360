#pragma once
/// Crf: LRFU's CRF order for a per-layer cache, in fixed point so that the device planner
/// (planning/device_plan.hpp, DeviceCrf) takes bit-identical decisions.
// Each expert's value is its combined recency-frequency CRF = sum over its past requests of d^age
// (d = 2^(-1/h), age in forwards of this cache), kept for non-residents too, so a returning expert
// resumes its history.
// The victim is the resident outside the forward with the lowest CRF now (plus its prior bias,
// below), ties to the lower id: with one layer that is Lrfu's victim (lrfu.hpp: the lowest CRF
// is the longest expected wait). The arithmetic is eviction/crf_math.hpp's, integers only.
// Differences from Lrfu (which keeps a double log-domain key in heaps): a full O(capacity) scan
// per victim instead of heaps, which a GPU block does in one reduction, and no layer split
// (a global pool ticks one clock per forward).
//
// Frequency priors: `bias` (optional, per expert, Q32 like a CRF) is added to the expert's CRF
// when victims are ranked, so a popular expert (from a calibration trace or counted online) is
// kept over a recent one of similar CRF; a bias near UINT64_MAX pins it (crf_pin_bias). Pinned
// experts are still evicted when nothing else can be (the forward needs the slot).
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/fixed_vector.hpp"
#include "expert_cache/eviction/crf_math.hpp"

namespace expert_cache::inline v0 {

/// Crf's parameter: the decay per forward.
struct CrfParams {
  std::uint64_t decay_q32 = crf_default_decay_q32;  // d in Q32, in (0, 2^32)
  friend bool operator==(const CrfParams&, const CrfParams&) = default;
};

/// The fixed-point CRF eviction policy (an eviction_policy), bit-identical to DeviceCrf.
class Crf {
 public:
  static constexpr std::string_view name = "crf";

  /// @param shape   the cache's experts and slots
  /// @param params  the decay per forward
  /// @param bias    a prior per expert (eviction/popularity.hpp): empty (no prior) or one entry
  ///                per expert; any other size counts as empty
  explicit Crf(CacheShape shape, CrfParams params = {}, std::span<const std::uint64_t> bias = {})
      : params_(params),
        crf_(static_cast<std::size_t>(shape.num_experts), 0),
        last_(static_cast<std::size_t>(shape.num_experts), 0),
        bias_(bias.begin(), bias.end()),
        residents_(static_cast<std::size_t>(shape.capacity)) {
    if (bias_.size() != crf_.size()) bias_.assign(crf_.size(), 0);
  }

  // One clock tick per non-empty forward (the device ticks once per planned group).
  void begin_forward(std::span<const ExpertId> ids) noexcept {
    if (!ids.empty()) ++clock_;
  }
  void on_hit(ExpertId e) noexcept { touch(e.index()); }
  void on_insert(ExpertId e) noexcept {
    touch(e.index());
    residents_.push_back(e.value);  // residents <= capacity
  }
  void on_remove(ExpertId e) noexcept {
    for (std::int32_t* it = residents_.begin(); it != residents_.end(); ++it) {
      if (*it == e.value) {
        residents_.erase(it);
        return;
      }
    }
  }

  [[nodiscard]] ExpertId choose_victim(const ForwardSet& needed) const noexcept {
    std::int32_t best = -1;
    std::uint64_t best_key = 0;
    for (const std::int32_t e : residents_) {
      if (needed.contains(ExpertId(e))) continue;
      const std::uint64_t k = key(static_cast<std::size_t>(e));
      if (best < 0 || k < best_key || (k == best_key && e < best)) {
        best = e;
        best_key = k;
      }
    }
    return ExpertId(best);
  }

  // Victim key of `e` now: CRF + bias (saturating).
  [[nodiscard]] std::uint64_t key(std::size_t e) const noexcept {
    return crf_add_sat(crf_at(crf_[e], last_[e], clock_, params_.decay_q32), bias_[e]);
  }
  [[nodiscard]] std::uint64_t crf_q32(ExpertId e) const noexcept { return crf_[e.index()]; }
  [[nodiscard]] std::uint32_t last(ExpertId e) const noexcept { return last_[e.index()]; }
  [[nodiscard]] std::uint32_t clock() const noexcept { return clock_; }

  friend bool operator==(const Crf&, const Crf&) = default;

 private:
  void touch(std::size_t e) noexcept {
    crf_[e] = crf_at(crf_[e], last_[e], clock_, params_.decay_q32) + crf_one;
    last_[e] = clock_;
  }

  CrfParams params_;
  std::vector<std::uint64_t> crf_;   // per expert, Q32, as of last_
  std::vector<std::uint32_t> last_;  // per expert: clock at its last request
  std::vector<std::uint64_t> bias_;  // per expert prior (0: none)
  detail::FixedVector<std::int32_t> residents_;
  std::uint32_t clock_ = 0;
};

static_assert(eviction_policy<Crf>);
static_assert(has_begin_forward<Crf>);

}  // namespace expert_cache::inline v0
