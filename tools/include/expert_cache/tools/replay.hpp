#pragma once
/// Replay engine: runs a Trace through ForwardPlanner<Policy> for each requested policy and
/// capacity and reports hits, misses and the ratio to OPT (Belady).
// Host-only.
//
// Scopes (docs/trace_format.md):
//   layer  - one cache per distinct layer, `capacity` slots each, experts [0, E)
//   global - one cache of `capacity` slots shared by all layers, keyed layer_index*E + e
//            (layer_index = rank of the layer among the trace's distinct layers)
// Either way a forward is one (step, layer) of the trace, and forwards are replayed in
// trace order.
#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/types.hpp"
#include "expert_cache/eviction/all.hpp"
#include "expert_cache/eviction/popularity.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/tools/trace_generator.hpp"
#include "expert_cache/tools/trace_io.hpp"

namespace expert_cache::inline v0 {

enum class ReplayScope : std::uint8_t { layer, global };

[[nodiscard]] constexpr std::string_view to_string(ReplayScope s) noexcept {
  return s == ReplayScope::layer ? "layer" : "global";
}

// Bound on experts per cache (global: layers * E), so a replay never allocates planner
// arrays from an absurd key space.
inline constexpr std::int64_t replay_max_cache_experts = std::int64_t{1} << 26;

// The forwards one cache sees, flattened: forward i is ids[offsets[i], offsets[i+1]),
// unique and ascending, and came from trace forward source[i].
struct CacheStream {
  std::int32_t num_experts = 0;
  std::int32_t experts_per_layer = 0;  // E: ids are layer_index * E + expert (global scope)
  std::vector<std::int32_t> ids;
  std::vector<std::size_t> offsets{0};
  std::vector<std::size_t> source;
  std::vector<std::int32_t> layer_index;  // per forward: rank of its layer among the trace's layers
  // Frequency prior (ReplayOptions::calibrate): requests per key in the calibration part, and how
  // the prior policies turn it into a bias. Empty: no calibration (their bias is then zero).
  std::optional<PopularityTable> popularity;
  double prior_weight = 1.0;
  double prior_pin = 0.25;
  // The CRF policies' decay per forward (crf, crf+prior, crf+pin; ReplayOptions::crf_half_life).
  std::uint64_t crf_decay_q32 = crf_default_decay_q32;

  [[nodiscard]] std::size_t size() const noexcept { return source.size(); }
  [[nodiscard]] std::span<const std::int32_t> forward(std::size_t i) const noexcept {
    return std::span<const std::int32_t>(ids).subspan(offsets[i], offsets[i + 1] - offsets[i]);
  }
  // The forwards as spans of ExpertId (what a clairvoyant policy is constructed from).
  [[nodiscard]] std::vector<std::span<const ExpertId>> forwards_as_expert_ids() const {
    static_assert(sizeof(ExpertId) == sizeof(std::int32_t) && std::is_standard_layout_v<ExpertId>);
    std::vector<std::span<const ExpertId>> out;
    out.reserve(size());
    const auto* base = reinterpret_cast<const ExpertId*>(ids.data());
    for (std::size_t i = 0; i < size(); ++i) out.emplace_back(base + offsets[i], offsets[i + 1] - offsets[i]);
    return out;
  }
};

// Split a trace into the streams of its caches. Fails (invalid_argument) if the key space
// is too large or the trace is empty.
[[nodiscard]] inline Result<std::vector<CacheStream>> build_cache_streams(const Trace& trace, ReplayScope scope) {
  if (trace.forwards.empty() || trace.num_experts <= 0) {
    return Status(ErrorCode::invalid_argument, "the trace contains no records");
  }
  const std::vector<std::int32_t> layers = trace.layers();
  auto layer_index = [&](std::int32_t layer) {
    return static_cast<std::size_t>(std::lower_bound(layers.begin(), layers.end(), layer) - layers.begin());
  };
  const std::int64_t E = trace.num_experts;
  std::vector<CacheStream> streams;
  if (scope == ReplayScope::layer) {
    streams.resize(layers.size());
    for (CacheStream& s : streams) s.num_experts = s.experts_per_layer = trace.num_experts;
  } else {
    const std::int64_t keys = static_cast<std::int64_t>(layers.size()) * E;
    if (keys > replay_max_cache_experts) {
      return Status(ErrorCode::invalid_argument,
                    "global scope needs " + std::to_string(layers.size()) + " layers x " + std::to_string(E) +
                        " experts = " + std::to_string(keys) + " keys, above the limit " +
                        std::to_string(replay_max_cache_experts));
    }
    streams.resize(1);
    streams[0].num_experts = static_cast<std::int32_t>(keys);
    streams[0].experts_per_layer = trace.num_experts;
    streams[0].ids.reserve(trace.ids.size());
  }
  for (std::size_t i = 0; i < trace.forwards.size(); ++i) {
    const TraceForward& f = trace.forwards[i];
    const std::size_t li = layer_index(f.layer);
    CacheStream& s = streams[scope == ReplayScope::layer ? li : 0];
    const std::int32_t base = scope == ReplayScope::layer ? 0 : static_cast<std::int32_t>(static_cast<std::int64_t>(li) * E);
    for (const std::int32_t e : trace.experts(f)) s.ids.push_back(base + e);  // stays ascending
    s.offsets.push_back(s.ids.size());
    s.source.push_back(i);
    s.layer_index.push_back(static_cast<std::int32_t>(li));
  }
  return streams;
}

// ---- policy registry ------------------------------------------------------------------

// How a prior policy of the replay turns the calibrated popularity into its bias.
enum class PriorKind : std::uint8_t { weighted, pinned };

template <class... Policies>
struct PolicyList {};

// Belady's view of one cache's future (independent of the capacity, so built once).
[[nodiscard]] inline std::shared_ptr<const BeladyFuture> make_belady_future(const CacheStream& stream) {
  std::vector<std::vector<std::int32_t>> forwards;
  forwards.reserve(stream.size());
  for (std::size_t i = 0; i < stream.size(); ++i) {
    const auto f = stream.forward(i);
    forwards.emplace_back(f.begin(), f.end());
  }
  return std::make_shared<const BeladyFuture>(stream.num_experts, forwards);
}

// How a policy is built for one cache: ordinary policies take the CacheShape; layer-aware
// ones also the pool's layer split; Belady also takes the cache's whole forward sequence
// (`future`, built on first use).
template <class P>
P make_replay_policy(CacheShape shape, const CacheStream& stream, std::shared_ptr<const BeladyFuture>& future) {
  if constexpr (requires { P::prior_kind; }) {
    (void)future;
    std::vector<std::uint64_t> bias;
    if (stream.popularity) {
      bias = P::prior_kind == PriorKind::weighted
                 ? stream.popularity->weighted_bias(stream.prior_weight, stream.crf_decay_q32)
                 : stream.popularity->pinned_bias(
                       static_cast<std::int32_t>(std::lround(stream.prior_pin * static_cast<double>(shape.capacity))));
    }
    return P(shape, CrfParams{stream.crf_decay_q32}, bias);
  } else if constexpr (std::same_as<P, Crf>) {
    (void)future;
    return Crf(shape, CrfParams{stream.crf_decay_q32});
  } else if constexpr (std::constructible_from<P, std::shared_ptr<const BeladyFuture>, CacheShape>) {
    if (!future) future = make_belady_future(stream);
    return P(future, shape);
  } else if constexpr (std::constructible_from<P, CacheShape, PoolLayout>) {
    (void)future;
    return P(shape, PoolLayout{stream.experts_per_layer});
  } else {
    (void)stream, (void)future;
    return P(shape);
  }
}

// Crf with the calibrated prior (ReplayOptions::calibrate): weighted bias, or the most requested
// experts pinned. Without calibration they plan exactly as Crf.
class CrfPrior : public Crf {
 public:
  static constexpr std::string_view name = "crf+prior";
  static constexpr PriorKind prior_kind = PriorKind::weighted;
  using Crf::Crf;
};
class CrfPin : public Crf {
 public:
  static constexpr std::string_view name = "crf+pin";
  static constexpr PriorKind prior_kind = PriorKind::pinned;
  using Crf::Crf;
};

using ReplayPolicies = PolicyList<Lru, Lfru, Sieve, S3Fifo, Arc, WTinyLfu, Lrfu, LayerShare, Crf, CrfPrior, CrfPin>;
// The policy used as OPT (void would leave OPT and the ratio columns out).
using ReplayOptPolicy = Belady;

// Names of OPT accepted by replay(); rows keep the name they were requested by.
inline constexpr std::string_view opt_policy_alias = "opt";

namespace detail {
inline bool is_opt_name(std::string_view name) noexcept {
  if (name == opt_policy_alias) return true;
  if constexpr (!std::is_void_v<ReplayOptPolicy>) return name == ReplayOptPolicy::name;
  return false;
}
}  // namespace detail

namespace detail {

template <class... Ps>
std::vector<std::string> policy_names(PolicyList<Ps...>) {
  return {std::string(Ps::name)...};
}

}  // namespace detail

// Names accepted by replay(), in the order the CLI lists them ("opt" last when available).
[[nodiscard]] inline std::vector<std::string> replay_policy_names() {
  std::vector<std::string> names = detail::policy_names(ReplayPolicies{});
  if constexpr (!std::is_void_v<ReplayOptPolicy>) names.emplace_back(opt_policy_alias);
  return names;
}

[[nodiscard]] constexpr bool replay_has_opt() noexcept { return !std::is_void_v<ReplayOptPolicy>; }

// ---- results ----------------------------------------------------------------------------

struct ReplayProgress {
  std::string_view policy;
  std::int32_t capacity = 0;
  std::uint64_t done = 0;   // forwards replayed so far, over all runs
  std::uint64_t total = 0;  // forwards to replay over all runs
};

struct ReplayOptions {
  ReplayScope scope = ReplayScope::layer;
  std::vector<std::int32_t> capacities;
  std::vector<std::string> policies;  // names from replay_policy_names()
  std::function<void(const ReplayProgress&)> progress;  // optional
  std::uint64_t progress_every = 1u << 16;                // forwards between progress calls
  // Frequency priors: in (0, 1), the first `calibrate` of the trace's steps only count requests
  // per key (PopularityTable) and every policy replays the rest, cold; crf+prior and crf+pin take
  // the counts as their bias (prior_weight; prior_pin = pinned experts as a fraction of the
  // capacity). 0: no calibration, the whole trace is replayed.
  double calibrate = 0.0;
  double prior_weight = 1.0;
  double prior_pin = 0.25;
  // The CRF policies' half-life in forwards (> 0; 8 = Crf's default; DeviceCrf takes the same
  // decay through DeviceCacheOptions::crf_decay_q32): decay 2^(-1/h) rounded to Q32.
  double crf_half_life = 8.0;
  // ReplayRow::forwards_by_misses counts the forwards of steps >= this one only (the earlier ones
  // are replayed, as a warm-up, but not counted there); 0 counts every forward.
  std::int32_t histogram_from_step = 0;
};

// 2^(-1/h) in Q32, for a half-life h > 0 (0 when h is not positive and finite; at least 1).
[[nodiscard]] inline std::uint64_t crf_decay_q32_for(double half_life) noexcept {
  return crf_decay_for_half_life(half_life);
}

struct ReplayCounts {
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t evictions = 0;
  [[nodiscard]] std::uint64_t accesses() const noexcept { return hits + misses; }
  [[nodiscard]] double hit_rate() const noexcept {
    return accesses() == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(accesses());
  }
  friend bool operator==(const ReplayCounts&, const ReplayCounts&) = default;
};

struct ReplayRow {
  std::string policy;
  std::int32_t capacity = 0;
  ReplayCounts counts;
  // Hits and misses of each layer (index = rank in ReplayReport::layers; evictions stay 0:
  // in a global pool a victim's layer is not the forward's).
  std::vector<ReplayCounts> per_layer;
  std::optional<std::vector<ReplayCounts>> opt_per_layer;  // OPT's, when available
  // [m]: how many forwards missed exactly m experts (from ReplayOptions::histogram_from_step on);
  // the per-forward cost of a miss depends on how the misses spread over forwards, not only on
  // their total (a forward with none moves nothing; several share one fill's fixed latency).
  std::vector<std::uint64_t> forwards_by_misses;
  // Present when OPT is available: this policy's hits / OPT's hits, misses / OPT's misses
  // (1.0 when both are zero).
  std::optional<double> hits_vs_opt;
  std::optional<double> misses_vs_opt;
};

struct ReplayReport {
  ReplayScope scope = ReplayScope::layer;
  std::int32_t num_experts = 0;   // E of the trace
  std::int32_t num_layers = 0;    // distinct layers
  std::vector<std::int32_t> layers;  // the distinct layer numbers, ascending (per_layer's index)
  std::int32_t cache_experts = 0; // keys per cache: E (layer) or layers*E (global)
  std::int32_t caches = 0;        // caches replayed per run
  std::uint64_t forwards = 0;
  std::uint64_t records = 0;
  std::uint64_t accesses = 0;     // unique experts summed over forwards (same for every run)
  bool has_opt = false;
  // With calibration: the first replayed step, and the forwards only counted (not replayed).
  std::optional<std::int32_t> replay_from_step;
  std::uint64_t calibration_forwards = 0;
  std::vector<ReplayRow> rows;    // capacities outer, policies inner, in request order
};

namespace detail {

inline std::string forward_where(const Trace& trace, std::size_t forward) {
  const TraceForward& f = trace.forwards[forward];
  std::string where = f.line != 0 ? "line " + std::to_string(f.line) + ": "
                                  : "forward #" + std::to_string(forward) + ": ";
  return where + "forward (step " + std::to_string(f.step) + ", layer " + std::to_string(f.layer) + ")";
}

struct ProgressState {
  const ReplayOptions* options;
  std::uint64_t done = 0;
  std::uint64_t total = 0;
  std::uint64_t next_report = 0;
};

// Counts of one run: the total and per layer (per_layer has one entry per trace layer).
struct RunCounts {
  ReplayCounts total;
  std::vector<ReplayCounts> per_layer;
  std::vector<std::uint64_t> forwards_by_misses;
};

template <class P>
Result<ReplayCounts> replay_stream(const Trace& trace, const CacheStream& stream, std::int32_t capacity,
                                   std::shared_ptr<const BeladyFuture>& future, ProgressState& progress,
                                   std::vector<ReplayCounts>& per_layer, std::vector<std::uint64_t>& by_misses) {
  const CacheShape shape{stream.num_experts, capacity};
  ForwardPlanner<P> planner(shape, 1, make_replay_policy<P>(shape, stream, future));
  ForwardPlan plan;
  for (std::size_t i = 0; i < stream.size(); ++i) {
    if (Status st = planner.plan_unique(stream.forward(i), plan); !st.ok()) {
      return Status(st.code(), forward_where(trace, stream.source[i]) + ": " + std::string(st.message()));
    }
    ReplayCounts& layer = per_layer[static_cast<std::size_t>(stream.layer_index[i])];
    layer.hits += plan.hits;
    layer.misses += plan.misses;
    if (trace.forwards[stream.source[i]].step >= progress.options->histogram_from_step) {
      const std::size_t m = plan.misses;
      if (by_misses.size() <= m) by_misses.resize(m + 1, 0);
      ++by_misses[m];
    }
    if (++progress.done >= progress.next_report && progress.options->progress) {
      progress.options->progress(ReplayProgress{P::name, capacity, progress.done, progress.total});
      progress.next_report = progress.done + std::max<std::uint64_t>(progress.options->progress_every, 1);
    }
  }
  if constexpr (requires { planner.policy().divergent_forwards(); }) {
    if (planner.policy().divergent_forwards() != 0) {  // OPT was fed a different sequence: a bug
      return Status(ErrorCode::internal, std::string(P::name) + " saw forwards that differ from its future");
    }
  }
  const PlannerCounters& c = planner.counters();
  return ReplayCounts{c.hits, c.misses, c.evictions};
}

// Per-cache state shared across runs: the streams and Belady's futures (built lazily).
struct ReplayCaches {
  std::vector<CacheStream> streams;
  std::vector<std::shared_ptr<const BeladyFuture>> futures;
  std::size_t num_layers = 0;
};

template <class P>
Result<RunCounts> replay_policy(const Trace& trace, ReplayCaches& caches, std::int32_t capacity,
                                ProgressState& progress) {
  RunCounts run;
  run.per_layer.resize(caches.num_layers);
  for (std::size_t i = 0; i < caches.streams.size(); ++i) {
    Result<ReplayCounts> r =
        replay_stream<P>(trace, caches.streams[i], capacity, caches.futures[i], progress, run.per_layer,
                         run.forwards_by_misses);
    if (!r.ok()) return r.status();
    run.total.hits += r.value().hits;
    run.total.misses += r.value().misses;
    run.total.evictions += r.value().evictions;
  }
  if (progress.options->progress) {  // always report the end of a run
    progress.options->progress(ReplayProgress{P::name, capacity, progress.done, progress.total});
    progress.next_report = progress.done + std::max<std::uint64_t>(progress.options->progress_every, 1);
  }
  return run;
}

// Dispatch a policy name to its type.
template <class... Ps>
std::optional<Result<RunCounts>> replay_named(PolicyList<Ps...>, std::string_view name, const Trace& trace,
                                                 ReplayCaches& caches, std::int32_t capacity,
                                                 ProgressState& progress) {
  std::optional<Result<RunCounts>> out;
  ((name == Ps::name && !out ? (void)(out.emplace(replay_policy<Ps>(trace, caches, capacity, progress))) : (void)0),
   ...);
  return out;
}

// OPT's counts, or nothing while no OPT policy exists (Opt = void).
template <class Opt>
std::optional<Result<RunCounts>> replay_opt(const Trace& trace, ReplayCaches& caches, std::int32_t capacity,
                                               ProgressState& progress) {
  if constexpr (std::is_void_v<Opt>) {
    (void)trace, (void)caches, (void)capacity, (void)progress;
    return std::nullopt;
  } else {
    return replay_policy<Opt>(trace, caches, capacity, progress);
  }
}

inline double ratio(std::uint64_t a, std::uint64_t b) noexcept {
  if (b == 0) return a == 0 ? 1.0 : std::numeric_limits<double>::infinity();
  return static_cast<double>(a) / static_cast<double>(b);
}

}  // namespace detail

// Replay `trace` for every (capacity, policy). Errors: invalid_argument (unknown policy,
// empty trace, no capacities), invalid_capacity (capacity < 1 or above the experts of one
// cache), too_many_experts (a forward's union exceeds a capacity; names its line).
[[nodiscard]] inline Result<ReplayReport> replay(const Trace& trace, const ReplayOptions& options) noexcept {
  try {
    if (options.capacities.empty()) return Status(ErrorCode::invalid_argument, "no capacity given");
    if (options.policies.empty()) return Status(ErrorCode::invalid_argument, "no policy given");
    const std::vector<std::string> known = replay_policy_names();
    for (const std::string& p : options.policies) {
      if (std::find(known.begin(), known.end(), p) == known.end() && !(replay_has_opt() && detail::is_opt_name(p))) {
        std::string list;
        for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
        return Status(ErrorCode::invalid_argument, "unknown policy '" + p + "' (available: " + list + ")");
      }
    }
    Result<std::vector<CacheStream>> streams_r = build_cache_streams(trace, options.scope);
    if (!streams_r.ok()) return streams_r.status();
    detail::ReplayCaches caches{std::move(streams_r).value(), {}, trace.layers().size()};
    caches.futures.resize(caches.streams.size());
    if (!(options.calibrate >= 0.0 && options.calibrate < 1.0) || !(options.prior_weight >= 0.0) ||
        !(options.prior_pin >= 0.0 && options.prior_pin <= 1.0) || crf_decay_q32_for(options.crf_half_life) == 0) {
      return Status(ErrorCode::invalid_argument,
                    "calibrate must be in [0, 1), prior_weight >= 0, prior_pin in [0, 1] and crf_half_life > 0");
    }
    for (CacheStream& st : caches.streams) st.crf_decay_q32 = crf_decay_q32_for(options.crf_half_life);
    std::optional<std::int32_t> split_step;
    std::uint64_t calibration_forwards = 0, replayed_accesses = 0;
    if (options.calibrate > 0.0) {
      std::vector<std::int32_t> steps;
      for (const TraceForward& f : trace.forwards) steps.push_back(f.step);
      std::sort(steps.begin(), steps.end());
      steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
      const auto at = static_cast<std::size_t>(options.calibrate * static_cast<double>(steps.size()));
      if (at == 0 || at >= steps.size()) {
        return Status(ErrorCode::invalid_argument, "calibrate " + std::to_string(options.calibrate) + " leaves no step to " +
                                                       (at == 0 ? "calibrate on" : "replay") + " (the trace has " +
                                                       std::to_string(steps.size()) + " steps)");
      }
      split_step = steps[at];
      for (CacheStream& st : caches.streams) {
        CacheStream rest;
        rest.num_experts = st.num_experts;
        rest.experts_per_layer = st.experts_per_layer;
        rest.popularity.emplace(st.num_experts);
        rest.prior_weight = options.prior_weight;
        rest.prior_pin = options.prior_pin;
        rest.crf_decay_q32 = st.crf_decay_q32;
        for (std::size_t i = 0; i < st.size(); ++i) {
          const auto f = st.forward(i);
          if (trace.forwards[st.source[i]].step < *split_step) {
            rest.popularity->count(f);
            ++calibration_forwards;
            continue;
          }
          rest.ids.insert(rest.ids.end(), f.begin(), f.end());
          rest.offsets.push_back(rest.ids.size());
          rest.source.push_back(st.source[i]);
          rest.layer_index.push_back(st.layer_index[i]);
          replayed_accesses += f.size();
        }
        st = std::move(rest);
      }
    }
    const std::vector<CacheStream>& streams = caches.streams;

    ReplayReport report;
    report.scope = options.scope;
    report.num_experts = trace.num_experts;
    report.layers = trace.layers();
    report.num_layers = static_cast<std::int32_t>(report.layers.size());
    report.cache_experts = streams[0].num_experts;
    report.caches = static_cast<std::int32_t>(streams.size());
    report.forwards = trace.forwards.size();
    report.records = trace.records;
    report.accesses = trace.ids.size();
    report.has_opt = replay_has_opt();
    if (split_step) {
      report.replay_from_step = split_step;
      report.calibration_forwards = calibration_forwards;
      report.forwards -= calibration_forwards;
      report.accesses = replayed_accesses;
    }

    // Validate every capacity before running anything, so errors come back fast.
    std::size_t widest = 0;  // the first forward with the largest union
    for (std::size_t i = 0; i < trace.forwards.size(); ++i) {
      if (trace.forwards[i].size() > trace.forwards[widest].size()) widest = i;
    }
    for (const std::int32_t c : options.capacities) {
      if (c < 1 || c > report.cache_experts) {
        return Status(ErrorCode::invalid_capacity,
                      "capacity " + std::to_string(c) + " must be in [1, " + std::to_string(report.cache_experts) +
                          "] (the experts one " + std::string(to_string(options.scope)) + "-scope cache can hold)");
      }
      if (trace.forwards[widest].size() > static_cast<std::size_t>(c)) {
        std::size_t first = 0;  // name the first forward that does not fit
        while (trace.forwards[first].size() <= static_cast<std::size_t>(c)) ++first;
        return Status(ErrorCode::too_many_experts,
                      detail::forward_where(trace, first) + " needs " + std::to_string(trace.forwards[first].size()) +
                          " unique experts but the cache has " + std::to_string(c) +
                          " slots (largest forward in the trace: " + std::to_string(trace.forwards[widest].size()) + ")");
      }
    }

    const std::size_t runs = options.capacities.size() *
                             (options.policies.size() + (replay_has_opt() ? 1 : 0));
    detail::ProgressState progress{&options, 0, runs * report.forwards,
                                   std::max<std::uint64_t>(options.progress_every, 1)};

    for (const std::int32_t c : options.capacities) {
      std::optional<ReplayCounts> opt;
      std::optional<std::vector<ReplayCounts>> opt_per_layer;
      std::vector<std::uint64_t> opt_by_misses;
      if (std::optional<Result<detail::RunCounts>> r = detail::replay_opt<ReplayOptPolicy>(trace, caches, c, progress)) {
        if (!r->ok()) return r->status();
        opt = r->value().total;
        opt_per_layer = r->value().per_layer;
        opt_by_misses = r->value().forwards_by_misses;
      }
      for (const std::string& name : options.policies) {
        ReplayRow row;
        row.policy = name;
        row.capacity = c;
        if (detail::is_opt_name(name) && opt) {
          row.counts = *opt;
          row.per_layer = *opt_per_layer;
          row.forwards_by_misses = opt_by_misses;
        } else {
          std::optional<Result<detail::RunCounts>> r =
              detail::replay_named(ReplayPolicies{}, name, trace, caches, c, progress);
          if (!r) return Status(ErrorCode::internal, "policy '" + name + "' is listed but not dispatchable");
          if (!r->ok()) return r->status();
          row.counts = r->value().total;
          row.per_layer = std::move(r->value().per_layer);
          row.forwards_by_misses = std::move(r->value().forwards_by_misses);
        }
        row.opt_per_layer = opt_per_layer;
        if (opt) {
          row.hits_vs_opt = detail::ratio(row.counts.hits, opt->hits);
          row.misses_vs_opt = detail::ratio(row.counts.misses, opt->misses);
        }
        report.rows.push_back(std::move(row));
      }
    }
    return report;
  } catch (const Error& e) {
    return Status(e.code(), e.what());
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::invalid_argument, "out of memory during replay");
  } catch (...) {
    return Status(ErrorCode::internal, "unexpected exception during replay");
  }
}

}  // namespace expert_cache::inline v0
