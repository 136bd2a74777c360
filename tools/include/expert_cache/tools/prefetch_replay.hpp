#pragma once
/// Replay with prefetch: the trace replay (tools/replay.hpp) plus, after each forward, a
/// speculative fill of the next layer's predicted experts (ForwardPlanner::plan_prefetch).
// Host-only. docs/prefetch.md defines the metrics and shows results.
//
// For each forward (step, layer L) in trace order:
//   1. the forward is planned on its cache (demand: hits and misses as in the plain replay),
//   2. the predictor observes it, then ranks layer L+1's experts for the same step,
//   3. plan_prefetch(ranked, max_fills = budget, expires_after) on the cache of layer L+1 (with
//      a scored predictor, its scores and min_score: the scored plan_prefetch):
//        layer scope  - layer L+1's own cache, expires_after = 1 (its next forward),
//        global scope - the shared cache, keys layer_index*E + e, expires_after = layers
//                       (one token's worth of forwards of that cache).
// The last layer prefetches nothing. Every cache plans its own forwards in the same order as
// in the plain replay, so with budget 0 (or prefetch none) every count equals replay()'s.
// OPT rows (Belady) are replayed without prefetch: they are the reference.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "expert_cache/base/status.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/prefetch/hint_selection.hpp"
#include "expert_cache/prefetch/predictors.hpp"
#include "expert_cache/tools/replay.hpp"
#include "expert_cache/tools/trace_io.hpp"

namespace expert_cache::inline v0 {

enum class PrefetchKind : std::uint8_t { none, coact, prev, hint };

// Which predictor, and its knobs. Spelled none | coact | prev |
// hint:R[:uniform|recent|coact][:noise=N] on the command line.
struct PrefetchSpec {
  PrefetchKind kind = PrefetchKind::none;
  double recall = 1.0;     // hint: share of the true experts among the hinted ones, (0, 1]
  HintWrongIds wrong = HintWrongIds::uniform;  // hint: where its wrong ids come from
  std::optional<double> noise;  // hint: score noise in [0, 1]; none = unscored hints
  std::uint64_t seed = 1;  // hint: SplitMix64 seed of the draws
  double decay = 1.0;      // coact: weight factor per update, (0, 1] (1 = plain counts)
  friend bool operator==(const PrefetchSpec&, const PrefetchSpec&) = default;
};

// "none", "coact", "prev", "hint:0.8"; emulated hints say so wherever they are printed, so
// callers print to_label() (which adds " (emulated)") next to results.
[[nodiscard]] inline std::string to_string(const PrefetchSpec& s) {
  switch (s.kind) {
    case PrefetchKind::none: return "none";
    case PrefetchKind::coact: return "coact";
    case PrefetchKind::prev: return "prev";
    case PrefetchKind::hint: {
      char buf[64];
      std::snprintf(buf, sizeof buf, "hint:%g", s.recall);
      std::string text(buf);
      // uniform is the plain spelling's meaning
      if (s.wrong != HintWrongIds::uniform) text += ":" + std::string(to_string(s.wrong));
      if (s.noise) {
        std::snprintf(buf, sizeof buf, ":noise=%g", *s.noise);
        text += buf;
      }
      return text;
    }
  }
  return "?";
}
[[nodiscard]] inline bool is_emulated(const PrefetchSpec& s) noexcept { return s.kind == PrefetchKind::hint; }
// Whether the predictor gives scores (PrefetchOptions::scores): emulated hints with a noise.
[[nodiscard]] inline bool is_scored(const PrefetchSpec& s) noexcept {
  return s.kind == PrefetchKind::hint && s.noise.has_value();
}
[[nodiscard]] inline std::string to_label(const PrefetchSpec& s) {
  return to_string(s) + (is_emulated(s) ? " (emulated engine hints)" : "");
}

namespace detail {

// A decimal number (no exponent, no inf/nan) of the whole text, or nothing.
inline std::optional<double> parse_fixed_decimal(std::string_view text) {
  double v = 0.0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v, std::chars_format::fixed);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

}  // namespace detail

// Parses none | coact | prev | hint:R[:W][:noise=N] with R a decimal in (0, 1], W the wrong-id
// model (uniform when absent) and N the score noise, a decimal in [0, 1] (no noise part:
// unscored hints).
[[nodiscard]] inline Result<PrefetchSpec> parse_prefetch_spec(std::string_view text) {
  PrefetchSpec s;
  if (text == "none") return s;
  if (text == "coact") {
    s.kind = PrefetchKind::coact;
    return s;
  }
  if (text == "prev") {
    s.kind = PrefetchKind::prev;
    return s;
  }
  constexpr std::string_view hint = "hint:";
  if (text.starts_with(hint)) {
    const auto quoted = [&] { return "'" + std::string(text) + "'"; };
    const std::string_view rest = text.substr(hint.size());
    const auto colon = rest.find(':');
    const std::string_view r = rest.substr(0, colon);
    HintWrongIds wrong = HintWrongIds::uniform;
    std::optional<double> noise;
    bool wrong_given = false;
    constexpr std::string_view noise_key = "noise=";
    // The parts after the recall, each after a ':' (an empty one included).
    for (std::size_t at = colon; at != std::string_view::npos;) {
      const std::size_t end = rest.find(':', at + 1);
      const std::string_view part = rest.substr(at + 1, end == std::string_view::npos ? end : end - at - 1);
      at = end;
      if (part.starts_with(noise_key)) {
        if (noise) return Status(ErrorCode::invalid_argument, quoted() + ": 'noise=' is given twice");
        const std::string_view v = part.substr(noise_key.size());
        const std::optional<double> n = detail::parse_fixed_decimal(v);
        if (!n) {
          return Status(ErrorCode::invalid_argument,
                        quoted() + ": the score noise after 'noise=' must be a decimal number in [0, 1]");
        }
        if (!(*n >= 0.0 && *n <= 1.0)) {
          return Status(ErrorCode::invalid_argument, quoted() + ": noise " + std::string(v) + " is outside [0, 1]");
        }
        noise = n;
      } else if (noise || wrong_given) {
        return Status(ErrorCode::invalid_argument, quoted() + ": '" + std::string(part) +
                                                       "' is out of place (spelled hint:R[:uniform|recent|coact]"
                                                       "[:noise=N])");
      } else if (part == "uniform") {
        wrong_given = true;
      } else if (part == "recent") {
        wrong = HintWrongIds::recent;
        wrong_given = true;
      } else if (part == "coact") {
        wrong = HintWrongIds::coact;
        wrong_given = true;
      } else {
        return Status(ErrorCode::invalid_argument, quoted() + ": the wrong ids after the recall are drawn "
                                                   "'uniform', 'recent' or 'coact', not '" + std::string(part) +
                                                   "' (then ':noise=N' may follow)");
      }
    }
    const std::optional<double> v = detail::parse_fixed_decimal(r);
    if (!v) {
      return Status(ErrorCode::invalid_argument, quoted() + ": the recall after 'hint:' must be a decimal number in (0, 1]");
    }
    if (!(*v > 0.0 && *v <= 1.0)) {
      return Status(ErrorCode::invalid_argument, quoted() + ": recall " + std::string(r) + " is outside (0, 1]");
    }
    s.kind = PrefetchKind::hint;
    s.recall = *v;
    s.wrong = wrong;
    s.noise = noise;
    return s;
  }
  return Status(ErrorCode::invalid_argument,
                "unknown prefetch '" + std::string(text) +
                    "' (available: none, coact, prev, hint:R[:uniform|recent|coact][:noise=N] with R in (0, 1] and N "
                    "in [0, 1])");
}

struct PrefetchReplayOptions {
  ReplayScope scope = ReplayScope::layer;
  std::vector<std::int32_t> capacities;
  std::vector<std::string> policies;  // names from replay_policy_names()
  PrefetchSpec prefetch;
  // Speculative fills per forward (experts); nullopt = the widest forward of the trace (top_k
  // at batch 1).
  std::optional<std::int32_t> budget;
  std::uint64_t expert_bytes = 0;  // bytes per expert, for the byte metrics
  // Scored predictors (is_scored): hints scoring below this are skipped (PrefetchOptions::min_score).
  float min_score = default_min_score;
  // The caches' precision feedback (PrefetchOptions::precision_feedback): off by default, so a
  // replay measures the predictor's own coverage and waste; on, what a cache would fetch of it.
  bool precision_feedback = false;
  // Two layers of lookahead: with emulated hints (prefetch.kind hint, wrong ids not coact), after
  // layer L's prefetch of layer L+1 also prefetch layer L+2 from emulated hints of this recall, with
  // the same wrong ids, noise and min_score (EmulatedHintPredictor with distance 2, its own seed).
  std::optional<double> two_ahead;
  std::function<void(const ReplayProgress&)> progress;  // optional (plain and prefetch runs)
  std::uint64_t progress_every = 1u << 16;
};

// Speculative-fill counts of one run (all its caches).
struct PrefetchCounts {
  std::uint64_t predicted = 0;          // ids the predictor returned
  std::uint64_t issued = 0;             // speculative fills made
  std::uint64_t used = 0;               // ... that a later forward hit before they expired
  std::uint64_t wasted = 0;             // ... that expired, or were evicted, unused
  std::uint64_t pending = 0;            // ... still speculative when the trace ended
  std::uint64_t skipped_resident = 0;   // predicted ids already resident
  std::uint64_t skipped_no_victim = 0;  // predicted ids dropped: no evictable slot
  std::uint64_t skipped_unlikely = 0;   // scored ids below min_score, never considered
  std::uint64_t skipped_imprecise = 0;  // ids at a rank the precision feedback throttled
  friend bool operator==(const PrefetchCounts&, const PrefetchCounts&) = default;
};

struct PrefetchRow {
  std::string policy;
  std::int32_t capacity = 0;
  ReplayCounts without;                  // the plain replay
  std::optional<ReplayCounts> with;      // with prefetch (absent for OPT, the reference)
  std::optional<PrefetchCounts> speculative;
  std::optional<ReplayCounts> opt;       // OPT at this capacity, without prefetch
  // Metrics (absent where undefined: OPT rows, or a zero denominator):
  std::optional<double> coverage;        // used / without.misses
  std::optional<double> precision;       // used / issued
  std::optional<double> extra_bytes_per_token;  // (issued - used) * expert_bytes / tokens
  std::optional<double> bytes_per_token_with;   // (with.misses + issued) * expert_bytes / tokens
  double bytes_per_token_without = 0.0;         // without.misses * expert_bytes / tokens
};

struct PrefetchReplayReport {
  ReplayReport plain;      // the replay without prefetch (its rows match rows below, in order)
  PrefetchSpec prefetch;
  std::int32_t budget = 0;       // max fills per forward
  std::int32_t list_length = 0;  // ids asked of the predictor per forward: max(budget, widest forward)
  std::uint32_t expires_after = 0;
  std::optional<float> min_score;  // scored predictors only
  bool precision_feedback = false;
  std::optional<double> two_ahead;  // layer L+2's hint recall, when the run prefetched two layers ahead
  std::uint64_t expert_bytes = 0;
  double tokens = 0.0;           // records / layers (a record is one token at one layer)
  std::vector<PrefetchRow> rows;
};

namespace detail {

// The trace's forwards with what the prefetch loop needs: layer rank and the forwards of the
// next layer and the one after at the same step (for emulated hints).
struct PrefetchForwards {
  std::vector<std::int32_t> layer_index;
  std::vector<std::int64_t> next_layer_forward;  // -1: no forward (step, next layer)
  std::vector<std::int64_t> two_layers_forward;  // -1: no forward (step, layer after the next)
  std::int32_t widest = 0;
};

inline PrefetchForwards index_prefetch_forwards(const Trace& trace, const std::vector<std::int32_t>& layers) {
  PrefetchForwards out;
  const std::size_t n = trace.forwards.size();
  out.layer_index.resize(n);
  out.next_layer_forward.assign(n, -1);
  out.two_layers_forward.assign(n, -1);
  std::unordered_map<std::uint64_t, std::size_t> by_key;
  by_key.reserve(n);
  auto key = [](std::int32_t step, std::int32_t layer_rank) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(step)) << 32) | static_cast<std::uint32_t>(layer_rank);
  };
  for (std::size_t i = 0; i < n; ++i) {
    const TraceForward& f = trace.forwards[i];
    const auto li = static_cast<std::int32_t>(std::lower_bound(layers.begin(), layers.end(), f.layer) - layers.begin());
    out.layer_index[i] = li;
    by_key.emplace(key(f.step, li), i);
    out.widest = std::max(out.widest, static_cast<std::int32_t>(f.size()));
  }
  for (std::size_t i = 0; i < n; ++i) {
    const auto it = by_key.find(key(trace.forwards[i].step, out.layer_index[i] + 1));
    if (it != by_key.end()) out.next_layer_forward[i] = static_cast<std::int64_t>(it->second);
    const auto two = by_key.find(key(trace.forwards[i].step, out.layer_index[i] + 2));
    if (two != by_key.end()) out.two_layers_forward[i] = static_cast<std::int64_t>(two->second);
  }
  return out;
}

struct NoPredictor {};
using AnyPredictor = std::variant<NoPredictor, CoactivationPredictor, PreviousTokenPredictor, EmulatedHintPredictor>;

inline AnyPredictor make_predictor(const PrefetchSpec& s, std::int32_t layers, std::int32_t experts) {
  switch (s.kind) {
    case PrefetchKind::coact: return CoactivationPredictor(layers, experts, s.decay);
    case PrefetchKind::prev: return PreviousTokenPredictor(layers, experts);
    case PrefetchKind::hint: return EmulatedHintPredictor(layers, experts, s.recall, s.seed, s.wrong, s.noise);
    case PrefetchKind::none: break;
  }
  return NoPredictor{};
}

// Layer L+2's emulated hints of a two-ahead run (PrefetchReplayOptions::two_ahead): the row's wrong
// ids and noise, distance 2, a seed of their own so that layer L+1's lists stay those of the run
// without. Throws Error (invalid_argument) for a predictor that is not hint, or coact wrong ids.
inline std::optional<EmulatedHintPredictor> make_two_ahead(const PrefetchReplayOptions& o, std::int32_t layers,
                                                           std::int32_t experts) {
  if (!o.two_ahead) return std::nullopt;
  if (o.prefetch.kind != PrefetchKind::hint) {
    throw Error(ErrorCode::invalid_argument, "two layers ahead takes emulated hints (hint:R...), not " + to_string(o.prefetch));
  }
  if (layers < 3) return std::nullopt;  // no layer two ahead of another
  return EmulatedHintPredictor(layers, experts, *o.two_ahead, ~o.prefetch.seed, o.prefetch.wrong, o.prefetch.noise, 2);
}

struct PrefetchRunCounts {
  ReplayCounts demand;
  PrefetchCounts speculative;
};

struct PrefetchProgress {
  const PrefetchReplayOptions* options;
  std::uint64_t done = 0;
  std::uint64_t total = 0;
  std::uint64_t next_report = 0;
  void tick(std::string_view policy, std::int32_t capacity, bool force = false) {
    if (!options->progress || (!force && done < next_report)) return;
    options->progress(ReplayProgress{policy, capacity, done, total});
    next_report = done + std::max<std::uint64_t>(options->progress_every, 1);
  }
};

template <class P>
Result<PrefetchRunCounts> prefetch_run(const Trace& trace, const PrefetchForwards& index, std::int32_t num_layers,
                                       const PrefetchReplayOptions& options, std::int32_t capacity,
                                       std::int32_t budget, std::int32_t list_length, PrefetchProgress& progress) {
  const std::int32_t E = trace.num_experts;
  const bool global = options.scope == ReplayScope::global;
  CacheStream shape_of;  // make_replay_policy reads only the key space and the layer split
  shape_of.num_experts = global ? num_layers * E : E;
  shape_of.experts_per_layer = E;
  const CacheShape shape{shape_of.num_experts, capacity};
  std::shared_ptr<const BeladyFuture> no_future;
  std::vector<ForwardPlanner<P>> planners;
  const std::size_t caches = global ? 1 : static_cast<std::size_t>(num_layers);
  planners.reserve(caches);
  for (std::size_t c = 0; c < caches; ++c) planners.emplace_back(shape, 1, make_replay_policy<P>(shape, shape_of, no_future));
  AnyPredictor predictor = make_predictor(options.prefetch, num_layers, E);
  std::optional<EmulatedHintPredictor> two_ahead = make_two_ahead(options, num_layers, E);
  const std::uint32_t expires_after = global ? static_cast<std::uint32_t>(num_layers) : 1u;

  ForwardPlan plan;
  PrefetchPlan prefetch;
  std::vector<std::int32_t> keys(static_cast<std::size_t>(std::max(E, 1)));
  PrefetchRunCounts run;
  for (std::size_t i = 0; i < trace.forwards.size(); ++i) {
    const TraceForward& f = trace.forwards[i];
    const std::int32_t li = index.layer_index[i];
    const std::span<const std::int32_t> local = trace.experts(f);
    const std::int32_t base = global ? li * E : 0;
    auto to_keys = [&](std::span<const std::int32_t> ids, std::int32_t offset) {
      for (std::size_t k = 0; k < ids.size(); ++k) keys[k] = offset + ids[k];
      return std::span<const std::int32_t>(keys.data(), ids.size());
    };
    // A ranked list prefetched into layer `target`'s planner, its counts added to the run's.
    auto prefetch_into = [&](std::int32_t target, std::span<const std::int32_t> ranked,
                             std::span<const float> scores) -> Status {
      run.speculative.predicted += ranked.size();
      ForwardPlanner<P>& planner = planners[global ? 0 : static_cast<std::size_t>(target)];
      if (Status s = planner.plan_prefetch(to_keys(ranked, global ? target * E : 0), scores, options.min_score, budget,
                                           expires_after, prefetch, options.precision_feedback);
          !s) {
        return s;
      }
      run.speculative.skipped_resident += prefetch.skipped_resident;
      run.speculative.skipped_no_victim += prefetch.skipped_no_victim;
      run.speculative.skipped_unlikely += prefetch.skipped_unlikely;
      run.speculative.skipped_imprecise += prefetch.skipped_imprecise;
      return {};
    };
    ForwardPlanner<P>& own = planners[global ? 0 : static_cast<std::size_t>(li)];
    if (Status st = own.plan_unique(to_keys(local, base), plan); !st.ok()) {
      return Status(st.code(), forward_where(trace, i) + ": " + std::string(st.message()));
    }
    run.demand.hits += plan.hits;
    run.demand.misses += plan.misses;
    const bool has_next = li + 1 < num_layers;
    Status st = std::visit(
        [&](auto& p) -> Status {
          if constexpr (std::is_same_v<std::decay_t<decltype(p)>, NoPredictor>) {
            return {};
          } else {
            if (Status s = p.observe(f.step, li, local); !s) return s;
            if (!has_next) return {};
            const std::int64_t next = index.next_layer_forward[i];
            const std::span<const std::int32_t> truth =
                next < 0 ? std::span<const std::int32_t>() : trace.experts(static_cast<std::size_t>(next));
            std::span<const std::int32_t> ranked;
            if (Status s = p.predict(PredictionQuery{f.step, li, local, truth}, list_length, ranked); !s) return s;
            std::span<const float> scores;  // parallel to `ranked`; empty = unscored
            if constexpr (requires { p.scores(); }) scores = p.scores();
            return prefetch_into(li + 1, ranked, scores);
          }
        },
        predictor);
    if (!st.ok()) return Status(st.code(), forward_where(trace, i) + ": prefetch: " + std::string(st.message()));
    if (two_ahead) {  // layer L+2, after layer L+1's prefetch
      if (Status s = two_ahead->observe(f.step, li, local); !s) {
        return Status(s.code(), forward_where(trace, i) + ": two ahead: " + std::string(s.message()));
      }
      const std::int64_t two = index.two_layers_forward[i];
      if (li + 2 < num_layers && two >= 0) {
        std::span<const std::int32_t> ranked;
        Status s = two_ahead->predict(PredictionQuery{f.step, li, local, trace.experts(static_cast<std::size_t>(two))},
                                      list_length, ranked);
        if (s) s = prefetch_into(li + 2, ranked, two_ahead->scores());
        if (!s) return Status(s.code(), forward_where(trace, i) + ": two ahead: " + std::string(s.message()));
      }
    }
    ++progress.done;
    progress.tick(P::name, capacity);
  }
  for (const ForwardPlanner<P>& p : planners) {
    const PlannerCounters& c = p.counters();
    run.demand.evictions += c.evictions;
    run.speculative.issued += c.speculative_issued;
    run.speculative.used += c.speculative_used;
    run.speculative.wasted += c.speculative_wasted;
    run.speculative.pending += static_cast<std::uint64_t>(p.speculative_count());
  }
  return run;
}

template <class... Ps>
std::optional<Result<PrefetchRunCounts>> prefetch_named(PolicyList<Ps...>, std::string_view name, const Trace& trace,
                                                         const PrefetchForwards& index, std::int32_t num_layers,
                                                         const PrefetchReplayOptions& options, std::int32_t capacity,
                                                         std::int32_t budget, std::int32_t list_length,
                                                         PrefetchProgress& progress) {
  std::optional<Result<PrefetchRunCounts>> out;
  ((name == Ps::name && !out
        ? (void)(out.emplace(prefetch_run<Ps>(trace, index, num_layers, options, capacity, budget, list_length, progress)))
        : (void)0),
   ...);
  return out;
}

inline std::optional<double> share(std::uint64_t a, std::uint64_t b) noexcept {
  if (b == 0) return std::nullopt;
  return static_cast<double>(a) / static_cast<double>(b);
}

}  // namespace detail

// Replay `trace` without and with prefetch for every (capacity, policy). Errors: those of
// replay(), and invalid_argument for a negative budget, a min_score outside [0, 1] (checked for
// every predictor), a predictor that cannot be built, or a two-ahead recall outside (0, 1] or
// without emulated hints (or with coact wrong ids).
[[nodiscard]] inline Result<PrefetchReplayReport> replay_with_prefetch(const Trace& trace,
                                                                       const PrefetchReplayOptions& options) noexcept {
  try {
    if (options.budget && *options.budget < 0) {
      return Status::format(ErrorCode::invalid_argument, "prefetch budget %d is negative", *options.budget);
    }
    if (Status s = check_hint_scores({}, {}, options.min_score); !s) return s;
    // A predictor's own limits (e.g. the coact table size) are errors before any run.
    if (!trace.forwards.empty() && trace.num_experts > 0) {
      (void)detail::make_predictor(options.prefetch, static_cast<std::int32_t>(trace.layers().size()), trace.num_experts);
    }
    if (options.two_ahead) {  // checked with or without a trace
      if (!(*options.two_ahead > 0.0 && *options.two_ahead <= 1.0)) {
        return Status::format(ErrorCode::invalid_argument, "two-ahead hint recall %g is outside (0, 1]", *options.two_ahead);
      }
      (void)detail::make_two_ahead(options, 3, std::max(trace.num_experts, 1));
    }
    ReplayOptions plain_options;
    plain_options.scope = options.scope;
    plain_options.capacities = options.capacities;
    plain_options.policies = options.policies;
    plain_options.progress = options.progress;
    plain_options.progress_every = options.progress_every;
    Result<ReplayReport> plain = replay(trace, plain_options);
    if (!plain.ok()) return plain.status();

    PrefetchReplayReport report;
    report.plain = std::move(plain).value();
    report.prefetch = options.prefetch;
    report.expert_bytes = options.expert_bytes;
    const std::int32_t num_layers = report.plain.num_layers;
    report.expires_after = options.scope == ReplayScope::global ? static_cast<std::uint32_t>(num_layers) : 1u;
    if (is_scored(options.prefetch)) report.min_score = options.min_score;
    report.precision_feedback = options.precision_feedback;
    report.two_ahead = options.two_ahead;
    report.tokens = static_cast<double>(trace.records) / static_cast<double>(num_layers);
    const detail::PrefetchForwards index = detail::index_prefetch_forwards(trace, report.plain.layers);
    report.budget = options.budget.value_or(index.widest);
    report.list_length = std::max(report.budget, index.widest);

    std::size_t prefetch_runs = 0;
    for (const ReplayRow& row : report.plain.rows) prefetch_runs += detail::is_opt_name(row.policy) ? 0 : 1;
    detail::PrefetchProgress progress{&options, 0, prefetch_runs * trace.forwards.size(),
                                      std::max<std::uint64_t>(options.progress_every, 1)};
    const auto B = static_cast<double>(options.expert_bytes);
    for (const ReplayRow& base : report.plain.rows) {
      PrefetchRow row;
      row.policy = base.policy;
      row.capacity = base.capacity;
      row.without = base.counts;
      if (base.opt_per_layer) {
        ReplayCounts opt;
        for (const ReplayCounts& l : *base.opt_per_layer) {
          opt.hits += l.hits;
          opt.misses += l.misses;
        }
        row.opt = opt;
      }
      row.bytes_per_token_without = static_cast<double>(row.without.misses) * B / report.tokens;
      if (!detail::is_opt_name(base.policy)) {
        std::optional<Result<detail::PrefetchRunCounts>> r =
            detail::prefetch_named(ReplayPolicies{}, base.policy, trace, index, num_layers, options, base.capacity,
                                   report.budget, report.list_length, progress);
        if (!r) return Status(ErrorCode::internal, "policy '" + base.policy + "' is listed but not dispatchable");
        if (!r->ok()) return r->status();
        const detail::PrefetchRunCounts& c = r->value();
        row.with = c.demand;
        row.speculative = c.speculative;
        row.coverage = detail::share(c.speculative.used, row.without.misses);
        row.precision = detail::share(c.speculative.used, c.speculative.issued);
        row.extra_bytes_per_token = static_cast<double>(c.speculative.issued - c.speculative.used) * B / report.tokens;
        row.bytes_per_token_with =
            static_cast<double>(c.demand.misses + c.speculative.issued) * B / report.tokens;
        progress.tick(base.policy, base.capacity, true);
      }
      report.rows.push_back(std::move(row));
    }
    return report;
  } catch (const Error& e) {
    return Status(e.code(), e.what());
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::invalid_argument, "out of memory during prefetch replay");
  } catch (...) {
    return Status(ErrorCode::internal, "unexpected exception during prefetch replay");
  }
}

}  // namespace expert_cache::inline v0
