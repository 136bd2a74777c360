#pragma once
// The host half of --timeline (decode/timeline.cuh): what the monitor kernel logged, summarised.
//
// The monitor watches, per layer, the first word of the router's ids, the first word of the
// layer's output, and each slot's needed and ready words of the layer's plan state, and logs
// every change with the device clock. Word k of layer l is entry l * words_per_layer + k: k = 0
// the ids, 1 the output, 2 .. 2 + C the needed words, 2 + C .. 2 + 2C the ready words. A fill is
// planned when its slot's needed word takes a new value and has landed when the slot's ready
// word reaches that value. Host-only (g++), so that the analysis is tested without a GPU.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace expert_cache::bench {

struct TimelineEvent {
  std::uint64_t t;  // device clock, ns
  std::uint32_t word;
  std::uint32_t value;
};

struct TimelineShape {
  std::uint32_t layers = 0;
  std::uint32_t capacity = 0;
  [[nodiscard]] constexpr std::uint32_t words_per_layer() const noexcept { return 2 + 2 * capacity; }
  [[nodiscard]] constexpr std::uint32_t words() const noexcept { return layers * words_per_layer(); }
  [[nodiscard]] constexpr std::uint32_t router_word(std::uint32_t l) const noexcept { return l * words_per_layer(); }
  [[nodiscard]] constexpr std::uint32_t output_word(std::uint32_t l) const noexcept { return l * words_per_layer() + 1; }
  [[nodiscard]] constexpr std::uint32_t needed_word(std::uint32_t l, std::uint32_t s) const noexcept {
    return l * words_per_layer() + 2 + s;
  }
  [[nodiscard]] constexpr std::uint32_t ready_word(std::uint32_t l, std::uint32_t s) const noexcept {
    return l * words_per_layer() + 2 + capacity + s;
  }
};

struct TimelineSummary {
  std::size_t events = 0;
  bool overflow = false;  // the monitor's log filled up: later changes are missing
  // Layer time: a layer's output change after the previous layer's (same step), µs.
  double layer_median_us = 0, layer_p90_us = 0;
  std::size_t layers_timed = 0;
  // The output change after the layer's last landing, for layers whose last fill landed after
  // their router (the consumer waited for it), µs.
  double tail_median_us = 0;
  std::size_t tails = 0;
  // Router of layer l -> the first plan of a layer-(l+1) fill before layer l+1's router: the
  // side chain up to the prefetch's plan, µs.
  double side_median_us = 0;
  std::size_t sides = 0;
  // Plan -> landed per fill, µs: prefetched fills (planned before their layer's router, after
  // the layer before's) and demand fills (planned after their layer's router).
  double prefetched_median_us = 0, prefetched_p90_us = 0;
  std::size_t prefetched_fills = 0;
  double demand_median_us = 0, demand_p90_us = 0;
  std::size_t demand_fills = 0;
  // Landings in time order: the span from the first to the last, one fill's time at the link
  // rate given, and the sum of the gaps beyond that time (the link idle between landings).
  std::size_t landings = 0;
  double span_us = 0, per_fill_us = 0, idle_us = 0;
  [[nodiscard]] double idle_share() const noexcept { return span_us > 0 ? idle_us / span_us : 0; }
};

namespace detail {
inline double timeline_quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
}
}  // namespace detail

/// `fill_bytes`: one fill's bytes; `link_bytes_per_s`: the rate that defines a fill's time on the
/// link (the pinned ceiling). Events may come in any order; words outside the shape are ignored.
inline TimelineSummary summarise_timeline(std::vector<TimelineEvent> ev, TimelineShape shape, bool overflow,
                                          double fill_bytes, double link_bytes_per_s) {
  std::sort(ev.begin(), ev.end(), [](const TimelineEvent& a, const TimelineEvent& b) { return a.t < b.t; });
  TimelineSummary out;
  out.events = ev.size();
  out.overflow = overflow;
  const std::uint32_t L = shape.layers, cap = shape.capacity, wpl = shape.words_per_layer();
  std::vector<std::vector<std::uint64_t>> router(L), output(L);
  struct Need {
    std::uint64_t t;
    std::uint32_t slot, value;
  };
  struct Land {
    std::uint64_t t;
    std::uint32_t layer, slot, value;
  };
  std::vector<std::vector<Need>> needs(L);
  std::vector<Land> lands;
  for (const TimelineEvent& e : ev) {
    if (wpl == 0 || e.word >= shape.words()) continue;
    const std::uint32_t layer = e.word / wpl, k = e.word % wpl;
    if (k == 0) router[layer].push_back(e.t);
    else if (k == 1) output[layer].push_back(e.t);
    else if (k < 2 + cap) needs[layer].push_back(Need{e.t, k - 2, e.value});
    else lands.push_back(Land{e.t, layer, k - 2 - cap, e.value});
  }
  const auto us = [](std::uint64_t a, std::uint64_t b) { return static_cast<double>(a - b) * 1e-3; };
  const auto latest_before = [](const std::vector<std::uint64_t>& times, std::uint64_t t) -> std::uint64_t {
    auto r = std::upper_bound(times.begin(), times.end(), t);
    return r == times.begin() ? 0 : *(r - 1);
  };

  std::vector<double> layer_us, tail_us, side_us, pre_us, dem_us;
  for (std::uint32_t l = 1; l < L; ++l) {
    for (const std::uint64_t t : output[l]) {
      const std::uint64_t before = latest_before(output[l - 1], t);
      // A layer-0 output more than 5 ms back belongs to another step (or the warm-up).
      if (before != 0 && t - before < 5'000'000) layer_us.push_back(us(t, before));
    }
  }
  std::vector<std::uint64_t> land_t;
  land_t.reserve(lands.size());
  for (const Land& d : lands) {
    land_t.push_back(d.t);
    const Need* need = nullptr;
    const auto& nl = needs[d.layer];
    for (auto it = nl.rbegin(); it != nl.rend(); ++it) {
      if (it->t <= d.t && it->slot == d.slot && it->value == d.value) {
        need = &*it;
        break;
      }
    }
    if (need == nullptr) continue;
    // A forward's plan follows its own layer's router; a prefetch's plan follows the layer
    // before's router, so the latest router before the plan is that layer's.
    const bool prefetched =
        d.layer > 0 && latest_before(router[d.layer - 1], need->t) > latest_before(router[d.layer], need->t);
    (prefetched ? pre_us : dem_us).push_back(us(d.t, need->t));
  }
  for (std::uint32_t l = 0; l < L; ++l) {
    for (const std::uint64_t t : output[l]) {
      const std::uint64_t t_router = latest_before(router[l], t);
      if (t_router == 0) continue;
      std::uint64_t last = 0;
      for (const Land& d : lands)
        if (d.layer == l && d.t <= t && d.t > t_router) last = std::max(last, d.t);
      if (last != 0) tail_us.push_back(us(t, last));
    }
    if (l + 1 < L) {
      for (const std::uint64_t t : router[l]) {
        auto next = std::upper_bound(router[l + 1].begin(), router[l + 1].end(), t);
        const std::uint64_t limit = next == router[l + 1].end() ? ~0ull : *next;
        std::uint64_t first = ~0ull;
        for (const Need& nd : needs[l + 1])
          if (nd.t > t && nd.t < limit) first = std::min(first, nd.t);
        if (first != ~0ull) side_us.push_back(us(first, t));
      }
    }
  }
  std::sort(land_t.begin(), land_t.end());
  out.landings = land_t.size();
  out.per_fill_us = link_bytes_per_s > 0 ? fill_bytes / link_bytes_per_s * 1e6 : 0;
  if (land_t.size() > 1) {
    out.span_us = us(land_t.back(), land_t.front());
    for (std::size_t i = 1; i < land_t.size(); ++i) {
      const double gap = us(land_t[i], land_t[i - 1]);
      if (gap > out.per_fill_us) out.idle_us += gap - out.per_fill_us;
    }
  }
  using detail::timeline_quantile;
  out.layer_median_us = timeline_quantile(layer_us, 0.5);
  out.layer_p90_us = timeline_quantile(layer_us, 0.9);
  out.layers_timed = layer_us.size();
  out.tail_median_us = timeline_quantile(tail_us, 0.5);
  out.tails = tail_us.size();
  out.side_median_us = timeline_quantile(side_us, 0.5);
  out.sides = side_us.size();
  out.prefetched_median_us = timeline_quantile(pre_us, 0.5);
  out.prefetched_p90_us = timeline_quantile(pre_us, 0.9);
  out.prefetched_fills = pre_us.size();
  out.demand_median_us = timeline_quantile(dem_us, 0.5);
  out.demand_p90_us = timeline_quantile(dem_us, 0.9);
  out.demand_fills = dem_us.size();
  return out;
}

inline std::string format_timeline(const TimelineSummary& s) {
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "timeline (device clock; %zu events%s): layer %.1f us median (p90 %.1f); consumer end after the "
                "layer's last landing %.1f us median; router(l) -> prefetch plan of l+1 %.1f us median; fill "
                "plan -> landed: prefetched %.1f us median (p90 %.1f, %zu fills), demand %.1f us (p90 %.1f, %zu "
                "fills); %zu landings over %.0f us, %.1f us per fill at the ceiling: link idle between landings "
                "%.1f us = %.3f of the span",
                s.events, s.overflow ? ", LOG FULL" : "", s.layer_median_us, s.layer_p90_us, s.tail_median_us,
                s.side_median_us, s.prefetched_median_us, s.prefetched_p90_us, s.prefetched_fills, s.demand_median_us,
                s.demand_p90_us, s.demand_fills, s.landings, s.span_us, s.per_fill_us, s.idle_us, s.idle_share());
  return buf;
}

/// The events as CSV (t_ns,layer,word,slot,value; word: router, output, needed or ready; slot -1
/// for router and output), time order. false when the file cannot be written.
inline bool write_timeline_csv(const std::string& path, std::vector<TimelineEvent> ev, TimelineShape shape) {
  std::sort(ev.begin(), ev.end(), [](const TimelineEvent& a, const TimelineEvent& b) { return a.t < b.t; });
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  std::fprintf(f, "t_ns,layer,word,slot,value\n");
  const std::uint32_t wpl = shape.words_per_layer();
  for (const TimelineEvent& e : ev) {
    if (wpl == 0 || e.word >= shape.words()) continue;
    const std::uint32_t layer = e.word / wpl, k = e.word % wpl;
    const char* kind = k == 0 ? "router" : k == 1 ? "output" : k < 2 + shape.capacity ? "needed" : "ready";
    const long long slot = k < 2 ? -1 : static_cast<long long>(k < 2 + shape.capacity ? k - 2 : k - 2 - shape.capacity);
    std::fprintf(f, "%llu,%u,%s,%lld,%u\n", static_cast<unsigned long long>(e.t), layer, kind, slot, e.value);
  }
  return std::fclose(f) == 0;
}

}  // namespace expert_cache::bench
