#pragma once
/// Measured precision of speculative fills by their rank in a prefetch's hint list: what lets a
/// cache throttle hints that turn out wrong, scored or not.
// Host-only.
//
// Why. A speculative fill pays only when a later forward reads it (hint_selection.hpp: on a busy
// link the break-even probability is min_score, 0.5 by default). Scores say how likely each hint
// is, but a caller may give none, or scores that are not calibrated. The cache sees the outcome
// of every fill it issued (used by a forward, or wasted: expired, evicted or invalidated unused),
// so it can measure, per rank of the list it was given, how often a fill at that rank is used,
// and stop fetching ranks whose measured precision is below min_score. This is the accuracy
// feedback of hardware prefetchers (Srinath, Mutlu, Kim and Patt, "Feedback Directed
// Prefetching", HPCA 2007), per rank because an engine's hint list is ordered best first: its
// head is usually right, its tail often wrong.
//
// The estimate per rank is an exponential moving average of the outcomes (1 used, 0 wasted),
// weight 1/16, starting at 1 (hints are trusted until their fills are seen wasted: about ten
// wasted outcomes in a row bring a rank from 1 below 0.5). A rank below the threshold still gets
// one fill in every `probe_every` hints that reach it, so a predictor that improves is noticed,
// but only while the hints it skips look right: the planner watches each skipped hint for the
// forwards a fill of it would have stayed protected and records whether one of them read it, a
// second average per rank. A watched hint costs no link time, but it is no fill: it evicts
// nothing, so it looks better than a fill would have turned out wherever a fill's eviction costs
// a later miss (small caches). It therefore gates the probes and never admits a rank by itself:
// where the skipped hints turn out wrong, the probes, the whole cost of a useless predictor,
// stop.
//
// A fill also evicts a resident, and a later forward may miss that victim (on a small cache it
// often does): the planner watches each victim of a speculative fill for eight times the fill's
// protection and records whether a forward missed it, a third average per rank (its regret,
// starting at 0). A rank is admitted on its precision net of its regret: a used fill saves one
// demand copy and a regretted eviction costs one.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

#include "expert_cache/base/version.hpp"

namespace expert_cache::inline v0 {

/// The per-rank averages of one cache's speculative fills, and the rule that admits a hint.
class RankPrecision {
 public:
  static constexpr std::size_t buckets = 16;
  static constexpr float weight = 1.0f / 16.0f;
  static constexpr std::uint32_t probe_every = 32;
  /// The least net precision feedback admits a rank at, whatever the prefetch's min_score. Speculative
  /// fills move bytes a link-bound decode step also needs: at precision p a rank moves 1/p copies per
  /// demand copy it saves, and latency hiding must pay for the rest. In the decode model (SimRuntime,
  /// host-planned copies, docs/prefetch.md) a floor of 0.5 let hints of recall 0.8 with uniform wrong ids,
  /// whose fetched half is wrong, cost 27 % at batch 1; floors of 0.6, 0.7, 0.8 and 0.9 left the worst of
  /// 30 lookahead rows at 0.83, 0.96, 0.977 and 0.979 of no lookahead, while the rows with recall-0.9
  /// hints kept their gains up to 0.8.
  static constexpr float min_admit_precision = 0.8f;

  /// The bucket of a hint's rank: the rank itself, the last bucket for every rank past it.
  [[nodiscard]] static constexpr std::uint8_t bucket(std::size_t rank) noexcept {
    return static_cast<std::uint8_t>(std::min<std::size_t>(rank, buckets - 1));
  }

  /// Whether a hint at `rank` is fetched: its bucket's precision net of its regret is at least
  /// `threshold`, or it is the bucket's probe (every probe_every-th hint that reaches a throttled
  /// bucket while its watched hints' precision is at least `threshold`).
  /// @param rank       the hint's position in the list it came in (0 = best)
  /// @param threshold  the least net precision a rank needs (the prefetch's min_score)
  /// @return true when the hint is fetched (counts a throttled bucket's probe)
  [[nodiscard]] bool admit(std::size_t rank, float threshold) noexcept {
    const std::uint8_t b = bucket(rank);
    if (precision_[b] - regret_[b] >= threshold) return true;
    if (watched_[b] < threshold) return false;
    if (++since_probe_[b] < probe_every) return false;
    since_probe_[b] = 0;
    return true;
  }

  /// The outcome of a fill issued at bucket `b`: used by a forward, or wasted.
  void record(std::uint8_t b, bool used) noexcept { update(precision_, b, used); }

  /// The outcome of a hint skipped at bucket `b` and watched: read by a forward, or not.
  void record_watched(std::uint8_t b, bool used) noexcept { update(watched_, b, used); }
  /// The outcome of the victim of a fill issued at bucket `b`: missed by a later forward, or not.
  void record_regret(std::uint8_t b, bool missed) noexcept { update(regret_, b, missed); }

  /// The share of fills at `rank`'s bucket that a forward used (moving average, from 1).
  [[nodiscard]] float precision(std::size_t rank) const noexcept { return precision_[bucket(rank)]; }
  /// The share of watched skipped hints at `rank`'s bucket that a forward read (from 1).
  [[nodiscard]] float watched_precision(std::size_t rank) const noexcept { return watched_[bucket(rank)]; }
  /// The share of victims of fills at `rank`'s bucket that a later forward missed (from 0).
  [[nodiscard]] float regret(std::size_t rank) const noexcept { return regret_[bucket(rank)]; }

  friend bool operator==(const RankPrecision&, const RankPrecision&) = default;

 private:
  std::array<float, buckets> precision_ = filled(1.0f);
  std::array<float, buckets> watched_ = filled(1.0f);
  std::array<float, buckets> regret_ = filled(0.0f);
  std::array<std::uint32_t, buckets> since_probe_{};

  static void update(std::array<float, buckets>& a, std::uint8_t b, bool used) noexcept {
    float& p = a[std::min<std::size_t>(b, buckets - 1)];
    p += weight * ((used ? 1.0f : 0.0f) - p);
  }

  static constexpr std::array<float, buckets> filled(float v) noexcept {
    std::array<float, buckets> a{};
    a.fill(v);
    return a;
  }
};

}  // namespace expert_cache::inline v0
