#pragma once
/// Predictors of the next layer's experts, for speculative fills (ForwardPlanner::plan_prefetch).
// Host-only, header-only, deterministic; every buffer is sized at construction, so observe() and
// predict() never allocate. docs/prefetch.md describes them and the replay that measures them.
//
// Layers are numbered by their rank among the model's MoE layers (0 .. num_layers-1; a trace's
// layers in ascending order), expert ids are per layer, in [0, num_experts). Per token the caller:
//   1. runs layer L's forward with experts `current`,
//   2. observe(step, L, current),
//   3. predict({step, L, current, truth}, max_ids, out): `out` ranks layer L+1's experts, best
//      first, at most max_ids of them (a view into the predictor, valid until its next call).
// `truth` (layer L+1's real experts at this step) is read by EmulatedHintPredictor only: it
// stands in for an engine that computes hints from hidden states, which a routing trace lacks.
// With a score noise it also gives emulated per-id confidences (scores(), for
// PrefetchOptions::scores).
// The last layer predicts nothing (empty list): the next token's first layer is not predicted.
//
// Errors (Status, state unchanged): a layer outside [0, num_layers), an id outside
// [0, num_experts), a duplicate id in `current`, max_ids < 0.
#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expert_cache/base/splitmix64.hpp"
#include "expert_cache/base/status.hpp"

namespace expert_cache::inline v0 {

/// What a predictor is asked at one (step, layer).
struct PredictionQuery {
  std::int32_t step = 0;
  std::int32_t layer = 0;                   // rank of the layer that just ran (L)
  std::span<const std::int32_t> current;    // layer L's experts at this step (unique)
  std::span<const std::int32_t> truth;      // layer L+1's experts at this step (emulated hints only)
};

/// The predictor interface (the replay tool is written against it):
/// - `observe(step, layer, experts)`: layer `layer` of step `step` chose the unique `experts`;
///   returns invalid_argument for a layer out of range or ids that are not unique in
///   [0, num_experts).
/// - `predict(query, max_ids, out)`: `out` gets at most `max_ids` predicted experts of layer
///   query.layer + 1, best first, a view into the predictor valid until its next call; errors
///   as observe's, and for a negative max_ids.
template <class P>
concept expert_predictor = requires(P& p, const PredictionQuery& q, std::span<const std::int32_t> ids,
                                    std::span<const std::int32_t>& out) {
  { P::name } -> std::convertible_to<std::string_view>;
  { p.observe(std::int32_t{}, std::int32_t{}, ids) } noexcept -> std::same_as<Status>;
  { p.predict(q, std::int32_t{}, out) } noexcept -> std::same_as<Status>;
};

namespace detail {

// Shape checks shared by the predictors (constructors throw, like ForwardPlanner's).
inline void check_predictor_shape(std::int32_t num_layers, std::int32_t num_experts) {
  if (num_layers < 1) throw Error(ErrorCode::invalid_argument, "a predictor needs at least one layer");
  if (num_experts < 1) throw Error(ErrorCode::invalid_argument, "a predictor needs at least one expert");
}

// Validates `ids` as unique ids in [0, num_experts) using `stamps` (epoch marks, no allocation).
class IdChecker {
 public:
  explicit IdChecker(std::int32_t num_experts) : stamps_(static_cast<std::size_t>(num_experts), 0u) {}

  Status check(std::span<const std::int32_t> ids, const char* what, bool unique) noexcept {
    next_epoch();
    const auto n = static_cast<std::int32_t>(stamps_.size());
    for (const std::int32_t id : ids) {
      if (id < 0 || id >= n) {
        return Status::format(ErrorCode::expert_out_of_range, "%s: expert id %d is outside [0, %d)", what, id, n);
      }
      std::uint32_t& s = stamps_[static_cast<std::size_t>(id)];
      if (unique && s == epoch_) {
        return Status::format(ErrorCode::duplicate_expert, "%s: expert %d appears more than once", what, id);
      }
      s = epoch_;
    }
    return {};
  }
  // After check(): whether `id` was in the list just checked.
  [[nodiscard]] bool marked(std::int32_t id) const noexcept { return stamps_[static_cast<std::size_t>(id)] == epoch_; }

 private:
  void next_epoch() noexcept {
    if (++epoch_ == 0) {
      std::fill(stamps_.begin(), stamps_.end(), 0u);
      epoch_ = 1;
    }
  }
  std::vector<std::uint32_t> stamps_;
  std::uint32_t epoch_ = 0;
};

inline Status check_layer(std::int32_t layer, std::int32_t num_layers) noexcept {
  if (layer < 0 || layer >= num_layers) {
    return Status::format(ErrorCode::invalid_argument, "layer %d is outside [0, %d)", layer, num_layers);
  }
  return {};
}

inline Status check_max_ids(std::int32_t max_ids) noexcept {
  if (max_ids < 0) return Status::format(ErrorCode::invalid_argument, "max_ids %d is negative", max_ids);
  return {};
}

}  // namespace detail

/// Layer-to-layer co-activation table, learned online. After layer L+1 of a step is observed
/// right after layer L of the same step, every pair (a in L's experts, b in L+1's) gains weight.
/// predict() scores each expert b of layer L+1 by the summed weights of (a, b) over the current
/// experts a of layer L and returns the experts with a positive score, highest first (ties:
/// lower id). With decay d < 1 a pair seen n updates of its layer pair ago weighs d^n (recent
/// tokens count more); d = 1 (default) keeps plain counts. A batched forward counts pairs of its
/// unions (a trace merges a step's records).
class CoactivationPredictor {
 public:
  static constexpr std::string_view name = "coact";
  // Bound on table entries ((num_layers-1) * num_experts^2 doubles, 256 MiB), so a bad shape is
  // an error rather than a huge allocation.
  static constexpr std::int64_t max_table_entries = std::int64_t{1} << 25;

  /// @param num_layers   layers of the model (at least 1)
  /// @param num_experts  experts per layer (at least 1)
  /// @param decay        weight of a pair per later update of its layer pair, in (0, 1]
  /// @throws Error invalid_argument for a bad shape or decay, or a table above max_table_entries
  CoactivationPredictor(std::int32_t num_layers, std::int32_t num_experts, double decay = 1.0)
      : layers_(num_layers), experts_(num_experts), decay_(decay), ids_(checked(num_layers, num_experts, decay)) {
    const auto e = static_cast<std::size_t>(num_experts);
    table_.assign(static_cast<std::size_t>(num_layers - 1) * e * e, 0.0);
    weight_.assign(static_cast<std::size_t>(num_layers), 1.0);
    previous_.assign(e, 0);
    scores_.assign(e, 0.0);
    ranked_.assign(e, 0);
  }

  [[nodiscard]] std::int32_t num_layers() const noexcept { return layers_; }
  [[nodiscard]] std::int32_t num_experts() const noexcept { return experts_; }
  [[nodiscard]] double decay() const noexcept { return decay_; }
  // Pairs counted so far (updates of any layer pair).
  [[nodiscard]] std::uint64_t updates() const noexcept { return updates_; }

  Status observe(std::int32_t step, std::int32_t layer, std::span<const std::int32_t> experts) noexcept {
    if (Status s = detail::check_layer(layer, layers_); !s) return s.with_context("coact observe");
    if (Status s = ids_.check(experts, "coact observe", true); !s) return s;
    if (has_previous_ && previous_step_ == step && previous_layer_ == layer - 1) {
      const std::size_t pair = static_cast<std::size_t>(layer - 1);
      double& w = weight_[pair];
      if (decay_ < 1.0) {
        // Growing the increment instead of shrinking every entry: d^n up to one rescale.
        w /= decay_;
        if (w > 1e150) rescale(pair);
      }
      double* t = table_row(pair, 0);
      const auto e = static_cast<std::size_t>(experts_);
      for (std::size_t i = 0; i < previous_count_; ++i) {
        double* row = t + static_cast<std::size_t>(previous_[i]) * e;
        for (const std::int32_t b : experts) row[static_cast<std::size_t>(b)] += weight_[pair];
      }
      ++updates_;
    }
    std::copy(experts.begin(), experts.end(), previous_.begin());
    previous_count_ = experts.size();
    previous_step_ = step;
    previous_layer_ = layer;
    has_previous_ = true;
    return {};
  }

  Status predict(const PredictionQuery& q, std::int32_t max_ids, std::span<const std::int32_t>& out) noexcept {
    out = {};
    if (Status s = detail::check_layer(q.layer, layers_); !s) return s.with_context("coact predict");
    if (Status s = detail::check_max_ids(max_ids); !s) return s.with_context("coact predict");
    if (Status s = ids_.check(q.current, "coact predict", true); !s) return s;
    if (q.layer + 1 >= layers_ || max_ids == 0) return {};
    const auto e = static_cast<std::size_t>(experts_);
    std::fill(scores_.begin(), scores_.end(), 0.0);
    const double* t = table_row(static_cast<std::size_t>(q.layer), 0);
    for (const std::int32_t a : q.current) {
      const double* row = t + static_cast<std::size_t>(a) * e;
      for (std::size_t b = 0; b < e; ++b) scores_[b] += row[b];
    }
    std::size_t n = 0;
    for (std::size_t b = 0; b < e; ++b) {
      if (scores_[b] > 0.0) ranked_[n++] = static_cast<std::int32_t>(b);
    }
    const std::size_t keep = std::min(n, static_cast<std::size_t>(max_ids));
    std::partial_sort(ranked_.begin(), ranked_.begin() + static_cast<std::ptrdiff_t>(keep),
                      ranked_.begin() + static_cast<std::ptrdiff_t>(n), [&](std::int32_t x, std::int32_t y) {
                        const double sx = scores_[static_cast<std::size_t>(x)];
                        const double sy = scores_[static_cast<std::size_t>(y)];
                        return sx != sy ? sx > sy : x < y;
                      });
    out = std::span<const std::int32_t>(ranked_.data(), keep);
    return {};
  }

  // The weight of pair (a at layer, b at layer+1), in units of the latest update's weight
  // (plain counts when decay = 1). For tests and inspection.
  [[nodiscard]] double weight(std::int32_t layer, std::int32_t a, std::int32_t b) const noexcept {
    if (layer < 0 || layer + 1 >= layers_ || a < 0 || a >= experts_ || b < 0 || b >= experts_) return 0.0;
    const auto pair = static_cast<std::size_t>(layer);
    return table_row(pair, a)[static_cast<std::size_t>(b)] / weight_[pair];
  }

 private:
  static std::int32_t checked(std::int32_t num_layers, std::int32_t num_experts, double decay) {
    detail::check_predictor_shape(num_layers, num_experts);
    if (!(decay > 0.0 && decay <= 1.0)) {
      throw Error(ErrorCode::invalid_argument, "coact decay must be in (0, 1], got " + std::to_string(decay));
    }
    const std::int64_t entries = std::int64_t{num_layers - 1} * num_experts * num_experts;
    if (entries > max_table_entries) {
      throw Error(ErrorCode::invalid_argument,
                  "coact table of " + std::to_string(num_layers - 1) + " layer pairs x " + std::to_string(num_experts) +
                      "^2 experts = " + std::to_string(entries) + " entries is above the limit " +
                      std::to_string(max_table_entries));
    }
    return num_experts;
  }
  [[nodiscard]] double* table_row(std::size_t pair, std::int32_t a) noexcept {
    const auto e = static_cast<std::size_t>(experts_);
    return table_.data() + (pair * e + static_cast<std::size_t>(a)) * e;
  }
  [[nodiscard]] const double* table_row(std::size_t pair, std::int32_t a) const noexcept {
    const auto e = static_cast<std::size_t>(experts_);
    return table_.data() + (pair * e + static_cast<std::size_t>(a)) * e;
  }
  void rescale(std::size_t pair) noexcept {
    const auto e = static_cast<std::size_t>(experts_);
    const double inv = 1.0 / weight_[pair];
    double* t = table_row(pair, 0);
    for (std::size_t i = 0; i < e * e; ++i) t[i] *= inv;
    weight_[pair] = 1.0;
  }

  std::int32_t layers_;
  std::int32_t experts_;
  double decay_;
  detail::IdChecker ids_;
  std::vector<double> table_;    // [pair L][a][b]: weight of (a at L, b at L+1)
  std::vector<double> weight_;   // per pair: the weight the next update adds (decay < 1 grows it)
  std::vector<std::int32_t> previous_;  // the last observed forward's experts
  std::size_t previous_count_ = 0;
  std::int32_t previous_step_ = 0;
  std::int32_t previous_layer_ = -1;
  bool has_previous_ = false;
  std::uint64_t updates_ = 0;
  std::vector<double> scores_;          // predict() scratch
  std::vector<std::int32_t> ranked_;    // predict() result
};

/// Baseline: layer L+1's experts of the most recent observed forward of layer L+1 (in a
/// step-major trace, the previous token's), in the order they were observed (a trace's are
/// ascending), at most max_ids of them. Empty until layer L+1 has been observed once.
class PreviousTokenPredictor {
 public:
  static constexpr std::string_view name = "prev";

  /// @param num_layers   layers of the model (at least 1)
  /// @param num_experts  experts per layer (at least 1)
  /// @throws Error invalid_argument for a bad shape
  PreviousTokenPredictor(std::int32_t num_layers, std::int32_t num_experts)
      : layers_(num_layers), experts_(num_experts), ids_((detail::check_predictor_shape(num_layers, num_experts), num_experts)) {
    last_.assign(static_cast<std::size_t>(num_layers) * static_cast<std::size_t>(num_experts), 0);
    count_.assign(static_cast<std::size_t>(num_layers), 0);
  }

  [[nodiscard]] std::int32_t num_layers() const noexcept { return layers_; }
  [[nodiscard]] std::int32_t num_experts() const noexcept { return experts_; }

  Status observe(std::int32_t step, std::int32_t layer, std::span<const std::int32_t> experts) noexcept {
    (void)step;
    if (Status s = detail::check_layer(layer, layers_); !s) return s.with_context("prev observe");
    if (Status s = ids_.check(experts, "prev observe", true); !s) return s;
    std::copy(experts.begin(), experts.end(), last_.begin() + offset(layer));
    count_[static_cast<std::size_t>(layer)] = experts.size();
    return {};
  }

  Status predict(const PredictionQuery& q, std::int32_t max_ids, std::span<const std::int32_t>& out) noexcept {
    out = {};
    if (Status s = detail::check_layer(q.layer, layers_); !s) return s.with_context("prev predict");
    if (Status s = detail::check_max_ids(max_ids); !s) return s.with_context("prev predict");
    if (q.layer + 1 >= layers_) return {};
    const std::size_t n = std::min(count_[static_cast<std::size_t>(q.layer + 1)], static_cast<std::size_t>(max_ids));
    out = std::span<const std::int32_t>(last_.data() + offset(q.layer + 1), n);
    return {};
  }

 private:
  [[nodiscard]] std::ptrdiff_t offset(std::int32_t layer) const noexcept {
    return static_cast<std::ptrdiff_t>(layer) * experts_;
  }
  std::int32_t layers_;
  std::int32_t experts_;
  detail::IdChecker ids_;
  std::vector<std::int32_t> last_;   // [layer][.. count_[layer]]: its last observed experts
  std::vector<std::size_t> count_;
};

/// Where an emulated hint list's wrong ids come from (docs/prefetch.md, "The hint model"):
///  uniform  any expert of layer L+1 not in the truth, uniformly;
///  recent   experts layer L+1 chose in its last `hint_recent_window` observed forwards (not in
///           the truth), uniformly; a router's near misses tend to be experts it picks often;
///  coact    the experts layer L+1 chose most often together with layer L's current experts
///           (a co-activation table, as CoactivationPredictor keeps), best first: the wrong ids
///           a predictor that learned the routing would make.
/// Where the chosen source has too few ids, the rest is drawn uniformly.
enum class HintWrongIds : std::uint8_t { uniform, recent, coact };
inline constexpr std::int32_t hint_recent_window = 8;

[[nodiscard]] constexpr std::string_view to_string(HintWrongIds w) noexcept {
  switch (w) {
    case HintWrongIds::uniform: return "uniform";
    case HintWrongIds::recent: return "recent";
    case HintWrongIds::coact: return "coact";
  }
  return "?";
}

/// EMULATED engine hints, drawn from the routing's future (a trace has no hidden states). For a
/// query with k = |truth| true experts of layer L+1 it returns a list of k ids: n of them true
/// (a uniformly drawn subset of truth) and k - n wrong ones (drawn as HintWrongIds says; fewer
/// when not that many experts exist), shuffled so the position says nothing, then cut to
/// max_ids. n makes the running share of true ids track the recall R exactly: after queries with
/// k_1..k_m true experts, the true ids returned total round(R * (k_1 + ... + k_m)), so the first
/// query gets round(R * k) and each later one floor or ceil of R * k. Seeded SplitMix64:
/// the same seed and queries give the same lists. observe() validates and, for `recent` and
/// `coact`, records what each layer chose.
///
/// Scores (with `noise`, in [0, 1]): predict() also gives each returned id an EMULATED
/// confidence, scores() parallel to the list (PrefetchOptions::scores): a true id 1 - noise * u,
/// a wrong one noise * u, with u uniform in [0, 1) drawn per id. Noise 0 separates them exactly
/// (1 and 0); noise 1 makes both uniform on [0, 1], so the score says nothing; in between, true
/// ids score above 1 - noise and wrong ones below noise. The u come from a second SplitMix64
/// stream of the same seed, so the ids are the same with and without scores (and any noise).
/// Without `noise`, scores() is empty: an unscored list.
///
/// Distance (`distance` = d, default 1): the lists are for layer L+d, so a query's truth is layer L+d's
/// experts, `recent` draws from layer L+d's recent choices, and a query with L+d past the last layer
/// gets an empty list. An engine that prefetches two layers ahead models its second list with a second
/// predictor of distance 2 and, usually, a lower recall. `coact` is one layer ahead only.
class EmulatedHintPredictor {
 public:
  static constexpr std::string_view name = "hint";

  /// @param num_layers   layers of the model (at least 1)
  /// @param num_experts  experts per layer (at least 1)
  /// @param recall       the share R of true ids in the lists, in (0, 1]
  /// @param seed         the SplitMix64 seed of the draws
  /// @param wrong        where the wrong ids come from
  /// @param noise        with a value in [0, 1]: scored lists (see above); without: unscored
  /// @param distance     how many layers ahead the lists are, in [1, num_layers); 1 with `coact`
  /// @throws Error invalid_argument for a bad shape, recall, noise or distance
  EmulatedHintPredictor(std::int32_t num_layers, std::int32_t num_experts, double recall, std::uint64_t seed = 1,
                        HintWrongIds wrong = HintWrongIds::uniform, std::optional<double> noise = std::nullopt,
                        std::int32_t distance = 1)
      : layers_(num_layers), experts_(num_experts), recall_(checked(num_layers, num_experts, recall)), wrong_(wrong),
        noise_(checked_noise(noise)), distance_(checked_distance(num_layers, wrong, distance)), ids_(num_experts),
        rng_{seed}, score_rng_{score_seed(seed)} {
    pool_.assign(static_cast<std::size_t>(num_experts), 0);
    out_.assign(static_cast<std::size_t>(num_experts), 0);
    if (noise_) scores_.assign(static_cast<std::size_t>(num_experts), 0.0f);
    taken_.assign(static_cast<std::size_t>(num_experts), 0);
    if (wrong == HintWrongIds::recent) {
      // Never chosen: older than any window.
      seen_at_.assign(static_cast<std::size_t>(num_layers) * static_cast<std::size_t>(num_experts),
                      std::numeric_limits<std::int64_t>::min());
      observed_.assign(static_cast<std::size_t>(num_layers), 0);
    }
    if (wrong == HintWrongIds::coact) coact_.emplace(num_layers, num_experts);
  }

  [[nodiscard]] double recall() const noexcept { return recall_; }
  [[nodiscard]] HintWrongIds wrong_ids() const noexcept { return wrong_; }
  [[nodiscard]] std::optional<double> noise() const noexcept { return noise_; }
  [[nodiscard]] std::int32_t distance() const noexcept { return distance_; }
  /// The last predict()'s scores, parallel to its list (empty without noise, or after an error
  /// or an empty list); a view into the predictor, valid until its next call.
  [[nodiscard]] std::span<const float> scores() const noexcept {
    return std::span<const float>(scores_.data(), scored_);
  }
  // Totals over all queries: true experts asked about, true ids returned (before max_ids cuts).
  [[nodiscard]] std::uint64_t truth_total() const noexcept { return truth_total_; }
  [[nodiscard]] std::uint64_t true_returned() const noexcept { return true_returned_; }

  Status observe(std::int32_t step, std::int32_t layer, std::span<const std::int32_t> experts) noexcept {
    if (Status s = detail::check_layer(layer, layers_); !s) return s.with_context("hint observe");
    if (Status s = ids_.check(experts, "hint observe", true); !s) return s;
    if (wrong_ == HintWrongIds::recent) {
      const auto l = static_cast<std::size_t>(layer);
      const std::int64_t at = observed_[l]++;
      for (std::int32_t e : experts) seen_at_[l * static_cast<std::size_t>(experts_) + static_cast<std::size_t>(e)] = at;
    }
    if (coact_) return coact_->observe(step, layer, experts);
    return {};
  }

  Status predict(const PredictionQuery& q, std::int32_t max_ids, std::span<const std::int32_t>& out) noexcept {
    out = {};
    scored_ = 0;
    if (Status s = detail::check_layer(q.layer, layers_); !s) return s.with_context("hint predict");
    if (Status s = detail::check_max_ids(max_ids); !s) return s.with_context("hint predict");
    // The co-activation ranking first (it checks q.current and uses the id checker itself).
    std::span<const std::int32_t> ranked;
    if (coact_ && q.layer + 1 < layers_) {
      if (Status s = coact_->predict(q, experts_, ranked); !s) return s.with_context("hint predict (coact)");
    }
    if (Status s = ids_.check(q.truth, "hint predict (truth)", true); !s) return s;
    if (q.layer + distance_ >= layers_ || q.truth.empty()) return {};
    const std::size_t k = q.truth.size();
    // Running target: round(R * total), so the share of true ids is R up to one id overall.
    const std::uint64_t before = true_returned_;
    truth_total_ += k;
    const auto target = static_cast<std::uint64_t>(std::llround(recall_ * static_cast<double>(truth_total_)));
    const std::size_t n_true = static_cast<std::size_t>(std::min<std::uint64_t>(target - std::min(target, before), k));
    true_returned_ = before + n_true;
    // n_true of the truth (partial Fisher-Yates over a copy).
    std::copy(q.truth.begin(), q.truth.end(), pool_.begin());
    std::size_t len = 0;
    for (std::size_t i = 0; i < n_true; ++i) {
      const std::size_t j = i + rng_.below(static_cast<std::uint32_t>(k - i));
      std::swap(pool_[i], pool_[j]);
      out_[len++] = pool_[i];
    }
    // k - n_true wrong ids (ids_ marks the truth after the check above): from the model's source
    // first, then uniformly from what is left.
    const std::size_t want = k - n_true;
    std::size_t n_wrong = 0;
    ++epoch_;
    auto take = [&](std::int32_t id) {
      out_[len++] = id;
      taken_[static_cast<std::size_t>(id)] = epoch_;
      ++n_wrong;
    };
    if (wrong_ == HintWrongIds::coact) {
      for (std::size_t i = 0; i < ranked.size() && n_wrong < want; ++i) {
        if (!ids_.marked(ranked[i])) take(ranked[i]);
      }
    } else if (wrong_ == HintWrongIds::recent && observed_[static_cast<std::size_t>(q.layer + distance_)] > 0) {
      const auto l = static_cast<std::size_t>(q.layer + distance_);
      const std::int64_t since = observed_[l] - hint_recent_window;
      std::size_t m = 0;
      for (std::int32_t id = 0; id < experts_; ++id) {
        if (!ids_.marked(id) && seen_at_[l * static_cast<std::size_t>(experts_) + static_cast<std::size_t>(id)] >= since) {
          pool_[m++] = id;
        }
      }
      draw(m, want, take, n_wrong);
    }
    if (n_wrong < want) {
      std::size_t m = 0;
      for (std::int32_t id = 0; id < experts_; ++id) {
        if (!ids_.marked(id) && taken_[static_cast<std::size_t>(id)] != epoch_) pool_[m++] = id;
      }
      draw(m, want, take, n_wrong);
    }
    for (std::size_t i = len; i > 1; --i) {  // shuffle: the order carries no hint
      std::swap(out_[i - 1], out_[rng_.below(static_cast<std::uint32_t>(i))]);
    }
    const std::size_t kept = std::min(len, static_cast<std::size_t>(max_ids));
    if (noise_) {
      // One draw per listed id (before the cut, so max_ids does not shift later draws).
      for (std::size_t i = 0; i < len; ++i) {
        const double spread = *noise_ * score_rng_.uniform();
        scores_[i] = static_cast<float>(ids_.marked(out_[i]) ? 1.0 - spread : spread);
      }
      scored_ = kept;
    }
    out = std::span<const std::int32_t>(out_.data(), kept);
    return {};
  }

 private:
  // Draws from pool_[0, m) without replacement until `want` wrong ids were taken.
  template <class Take>
  void draw(std::size_t m, std::size_t want, Take& take, const std::size_t& n_wrong) {
    for (std::size_t i = 0; i < m && n_wrong < want; ++i) {
      const std::size_t j = i + rng_.below(static_cast<std::uint32_t>(m - i));
      std::swap(pool_[i], pool_[j]);
      take(pool_[i]);
    }
  }
  static std::optional<double> checked_noise(std::optional<double> noise) {
    if (noise && !(*noise >= 0.0 && *noise <= 1.0)) {
      throw Error(ErrorCode::invalid_argument, "emulated hint score noise must be in [0, 1], got " + std::to_string(*noise));
    }
    return noise;
  }
  static std::int32_t checked_distance(std::int32_t num_layers, HintWrongIds wrong, std::int32_t distance) {
    if (distance < 1 || distance >= std::max(num_layers, 2)) {
      throw Error(ErrorCode::invalid_argument, "emulated hint distance must be in [1, " +
                                                   std::to_string(std::max(num_layers, 2) - 1) + "] layers, got " +
                                                   std::to_string(distance));
    }
    if (distance != 1 && wrong == HintWrongIds::coact) {
      throw Error(ErrorCode::invalid_argument,
                  "emulated hints with co-activation wrong ids are one layer ahead only, got distance " +
                      std::to_string(distance));
    }
    return distance;
  }
  // The scores' own stream: another SplitMix64 sequence of the same seed.
  static std::uint64_t score_seed(std::uint64_t seed) noexcept { return detail::SplitMix64{~seed}.next(); }
  static double checked(std::int32_t num_layers, std::int32_t num_experts, double recall) {
    detail::check_predictor_shape(num_layers, num_experts);
    if (!(recall > 0.0 && recall <= 1.0)) {
      throw Error(ErrorCode::invalid_argument, "emulated hint recall must be in (0, 1], got " + std::to_string(recall));
    }
    return recall;
  }
  std::int32_t layers_;
  std::int32_t experts_;
  double recall_;
  HintWrongIds wrong_;
  std::optional<double> noise_;  // scores: none without
  std::int32_t distance_;        // the lists are for layer L + distance_
  detail::IdChecker ids_;
  detail::SplitMix64 rng_;
  detail::SplitMix64 score_rng_;  // the scores' u, apart from the ids' draws
  std::uint64_t truth_total_ = 0;
  std::uint64_t true_returned_ = 0;
  std::vector<std::int32_t> pool_;  // scratch: truth copy, then the wrong ids' candidates
  std::vector<std::int32_t> out_;   // predict() result
  std::vector<float> scores_;       // predict() scores, parallel to out_ (noise only)
  std::size_t scored_ = 0;          // entries of scores_ that belong to the last list
  std::vector<std::uint32_t> taken_;  // epoch marks: wrong ids already in this list
  std::uint32_t epoch_ = 0;
  std::vector<std::int64_t> seen_at_;   // recent: [layer][expert] index of the last forward that chose it
  std::vector<std::int64_t> observed_;  // recent: forwards observed per layer
  std::optional<CoactivationPredictor> coact_;  // coact: the co-activation table
};

static_assert(expert_predictor<CoactivationPredictor>);
static_assert(expert_predictor<PreviousTokenPredictor>);
static_assert(expert_predictor<EmulatedHintPredictor>);

}  // namespace expert_cache::inline v0
