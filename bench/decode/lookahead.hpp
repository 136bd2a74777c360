#pragma once
// expert-cache-bench: lookahead in the decode loop (--prefetch). After layer L's
// prepare() and consumer launch, a predictor (prefetch/predictors.hpp) ranks layer L+1's experts
// of the same token and the loop hands them to cache[L+1].prefetch(). Host-only.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "args.hpp"  // two_ahead_marker
#include "expert_cache/base/status.hpp"
#include "expert_cache/cache/expert_cache.hpp"
#include "expert_cache/prefetch/predictors.hpp"
#include "expert_cache/tools/prefetch_replay.hpp"

namespace expert_cache::bench {

// A row's lookahead: "SPEC" prefetches layer L+1 after layer L; "SPEC+ahead2:R" (--two-ahead) also
// prefetches layer L+2 there, from emulated hints of recall R with SPEC's wrong ids and noise.
struct RowPrefetch {
  std::string next;                 // layer L+1's predictor spec
  std::optional<double> two_ahead;  // layer L+2's recall, if the row prefetches it
};
inline RowPrefetch split_row_prefetch(const std::string& spec) {
  const std::size_t at = spec.find(two_ahead_marker);
  if (at == std::string::npos) return {spec, std::nullopt};
  return {spec.substr(0, at), std::stod(spec.substr(at + two_ahead_marker.size()))};
}

// "none", "coact", "prev", "hint:0.8 (emulated hint)", "hint:0.9:recent:noise=0.3 +ahead2:0.7
// (emulated hint)": the label every printed row carries.
inline std::string prefetch_label(const std::string& spec) {
  const RowPrefetch row = split_row_prefetch(spec);
  const Result<PrefetchSpec> s = parse_prefetch_spec(row.next);
  if (!s.ok()) return spec;
  std::string label = to_string(s.value());
  if (row.two_ahead) label += spec.substr(spec.find(two_ahead_marker));
  return label + (is_emulated(s.value()) ? " (emulated hint)" : "");
}
inline bool prefetch_is_emulated(const std::string& spec) {
  const Result<PrefetchSpec> s = parse_prefetch_spec(split_row_prefetch(spec).next);
  return s.ok() && is_emulated(s.value());
}

// One row's predictor plus the per-forward scratch (unique ids: predictors want them unique,
// a batch > 1 forward repeats ids and pads with -1).
class Lookahead {
 public:
  // spec: "" or "none" = no lookahead; otherwise a name parse_prefetch_spec accepts. budget:
  // fills per prefetch(); the predictor is asked for max(budget, widest forward) ids, as in the
  // replay tool, so already-resident predictions leave room for the next ones in the ranking.
  // A spec with "+ahead2:R" adds layer L+2's emulated hints (two_ahead()); its predictor has its
  // own seed, so layer L+1's lists are those of the same row without it.
  Lookahead(const std::string& row_spec, std::int32_t layers, std::int32_t experts, std::int32_t budget,
            std::int32_t widest_forward, std::uint64_t seed)
      : budget_(budget), list_length_(std::max(budget, widest_forward)), seen_(static_cast<std::size_t>(experts), 0u) {
    const RowPrefetch row = split_row_prefetch(row_spec);
    const std::string& spec = row.next;
    if (spec.empty() || spec == "none") return;
    const Result<PrefetchSpec> s = parse_prefetch_spec(spec);
    if (!s.ok()) throw Error(s.status());
    if (row.two_ahead) {
      if (s.value().kind != PrefetchKind::hint)
        throw Error(ErrorCode::invalid_argument, "two layers ahead takes emulated hints (hint:R...), not " + spec);
      two_.emplace(layers, experts, *row.two_ahead, ~seed, s.value().wrong, s.value().noise, 2);
      truth_two_.reserve(static_cast<std::size_t>(experts));
    }
    switch (s.value().kind) {
      case PrefetchKind::none: break;
      case PrefetchKind::coact: predictor_.emplace<CoactivationPredictor>(layers, experts, s.value().decay); break;
      case PrefetchKind::prev: predictor_.emplace<PreviousTokenPredictor>(layers, experts); break;
      case PrefetchKind::hint:
        predictor_.emplace<EmulatedHintPredictor>(layers, experts, s.value().recall, seed, s.value().wrong,
                                                  s.value().noise);
        break;
    }
    current_.reserve(static_cast<std::size_t>(experts));
    truth_.reserve(static_cast<std::size_t>(experts));
  }
  [[nodiscard]] bool active() const noexcept { return !std::holds_alternative<std::monostate>(predictor_); }
  // Whether the row also prefetches layer L+2 after layer L (two_ahead()).
  [[nodiscard]] bool two_layers() const noexcept { return two_.has_value(); }
  [[nodiscard]] std::int32_t budget() const noexcept { return budget_; }
  [[nodiscard]] std::int32_t list_length() const noexcept { return list_length_; }
  // Scored hints (hint:R[:W]:noise=N): after_layer()'s list comes with scores, parallel to it
  // (scores(); empty otherwise), and prefetch() takes them with the default min_score.
  [[nodiscard]] bool scored() const noexcept {
    const auto* h = std::get_if<EmulatedHintPredictor>(&predictor_);
    return h != nullptr && h->noise().has_value();
  }
  // The last after_layer() list's scores (empty for unscored predictors and for the last layer's
  // empty list, whose predictor kept the layer before's scores), valid until its next call.
  [[nodiscard]] std::span<const float> scores() const noexcept {
    const auto* h = std::get_if<EmulatedHintPredictor>(&predictor_);
    if (h == nullptr || last_list_size_ == 0) return {};
    return h->scores();
  }
  // The same for the last two_ahead() list.
  [[nodiscard]] std::span<const float> scores_two_ahead() const noexcept {
    if (!two_ || last_two_size_ == 0) return {};
    return two_->scores();
  }
  // The options of the prefetch() of the last after_layer() list: `max_bytes`, expiry after one
  // forward, its scores (if any) and --evict-last-forward (the loop prefetches a layer's cache after
  // its previous forward was consumed).
  [[nodiscard]] PrefetchOptions prefetch_options(std::int64_t max_bytes, bool evict_last_forward = false) const noexcept {
    PrefetchOptions o{max_bytes, 1};
    o.scores = scores();
    o.evict_last_forward = evict_last_forward;
    return o;
  }
  // The same for the last two_ahead() list (expiry after layer L+2's next forward).
  [[nodiscard]] PrefetchOptions prefetch_options_two_ahead(std::int64_t max_bytes,
                                                           bool evict_last_forward = false) const noexcept {
    PrefetchOptions o{max_bytes, 1};
    o.scores = scores_two_ahead();
    o.evict_last_forward = evict_last_forward;
    return o;
  }

  // Layer `layer` of step `step` ran with `ids`; `next` is layer+1's routing of the same step
  // (read by the emulated hints only; empty for the last layer). Returns layer+1's predicted
  // experts, best first, at most list_length (empty for the last layer).
  std::span<const std::int32_t> after_layer(std::int32_t step, std::int32_t layer, std::span<const std::int32_t> ids,
                                            std::span<const std::int32_t> next, bool last_layer) {
    unique_into(ids, current_);
    unique_into(next, truth_);
    std::span<const std::int32_t> out;
    std::visit(
        [&](auto& p) {
          if constexpr (!std::is_same_v<std::decay_t<decltype(p)>, std::monostate>) {
            if (Status st = p.observe(step, layer, current_); !st) throw Error(st);
            if (last_layer) return;
            const PredictionQuery q{step, layer, current_, truth_};
            if (Status st = p.predict(q, list_length_, out); !st) throw Error(st);
          }
        },
        predictor_);
    last_list_size_ = out.size();
    if (two_) {
      if (Status st = two_->observe(step, layer, current_); !st) throw Error(st);
    }
    return out;
  }

  // After after_layer() of the same layer (two_layers() rows): layer layer+2's predicted experts,
  // best first, at most list_length, from `next2`, layer+2's routing of the same step (empty past
  // the last layer, and the list then too); scores_two_ahead() holds their scores.
  std::span<const std::int32_t> two_ahead(std::int32_t step, std::int32_t layer, std::span<const std::int32_t> next2) {
    std::span<const std::int32_t> out;
    last_two_size_ = 0;
    if (!two_ || next2.empty()) return out;
    unique_into(next2, truth_two_);
    const PredictionQuery q{step, layer, current_, truth_two_};
    if (Status st = two_->predict(q, list_length_, out); !st) throw Error(st);
    last_two_size_ = out.size();
    return out;
  }

 private:
  std::size_t last_list_size_ = 0;  // the last after_layer() list's length
  std::size_t last_two_size_ = 0;   // the last two_ahead() list's length

  void unique_into(std::span<const std::int32_t> ids, std::vector<std::int32_t>& out) {
    out.clear();
    if (++epoch_ == 0) {
      std::fill(seen_.begin(), seen_.end(), 0u);
      epoch_ = 1;
    }
    for (const std::int32_t e : ids) {
      if (e < 0 || static_cast<std::size_t>(e) >= seen_.size()) continue;
      if (seen_[static_cast<std::size_t>(e)] == epoch_) continue;
      seen_[static_cast<std::size_t>(e)] = epoch_;
      out.push_back(e);
    }
  }

  std::variant<std::monostate, CoactivationPredictor, PreviousTokenPredictor, EmulatedHintPredictor> predictor_;
  std::int32_t budget_ = 0;
  std::int32_t list_length_ = 0;
  std::vector<std::uint32_t> seen_;
  std::uint32_t epoch_ = 0;
  std::vector<std::int32_t> current_, truth_, truth_two_;
  std::optional<EmulatedHintPredictor> two_;  // layer L+2's hints (two_layers() rows)
};

}  // namespace expert_cache::bench
