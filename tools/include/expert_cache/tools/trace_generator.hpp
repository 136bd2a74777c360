#pragma once
/// Deterministic synthetic routing traces (docs/trace_format.md).
// Host-only.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "expert_cache/base/splitmix64.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/tools/tool_status.hpp"
#include "expert_cache/tools/trace_io.hpp"

namespace expert_cache::inline v0 {
// ---------------------------------------------------------------------------------------
// Deterministic synthetic traces with temporal locality (docs/trace_format.md).
// Every step routes each layer to top_k distinct experts. Each of the top_k picks either
// reuses one of that layer's previous picks (probability `sticky`) or draws from a
// per-layer Zipf(zipf_s) popularity over a per-layer random permutation of the experts.
// Bit-for-bit reproducible across platforms: own PRNG, no <random> distributions.
struct GeneratorSpec {
  std::int32_t layers = 8;
  std::int32_t experts = 64;
  std::int32_t top_k = 6;
  std::int32_t steps = 2000;
  double zipf_s = 1.0;
  double sticky = 0.4;
  std::uint64_t seed = 1;
};

namespace detail {

inline double zipf_weight(std::int32_t rank, double s) noexcept {
  // s == 1 (the default) avoids pow, so the default trace does not depend on libm.
  const double r = static_cast<double>(rank + 1);
  if (s == 1.0) return 1.0 / r;
  return 1.0 / std::pow(r, s);
}

}  // namespace detail

// Parse "key=value,key=value" (keys: layers experts topk steps zipf sticky seed); an empty
// string or "default" keeps the defaults.
[[nodiscard]] inline ToolResult<GeneratorSpec> parse_generator_spec(std::string_view text) {
  GeneratorSpec spec;
  if (text.empty() || text == "default") return spec;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t comma = std::min(text.find(',', pos), text.size());
    const std::string_view item = text.substr(pos, comma - pos);
    pos = comma + 1;
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      return ToolStatus(ToolErrorCode::invalid_argument, "generator spec item '" + std::string(item) + "' is not key=value");
    }
    const std::string_view key = item.substr(0, eq);
    const std::string_view val = item.substr(eq + 1);
    auto int_in = [&](std::int64_t lo, std::int64_t hi, std::int64_t& out) -> bool {
      const auto r = std::from_chars(val.data(), val.data() + val.size(), out);
      return r.ec == std::errc() && r.ptr == val.data() + val.size() && out >= lo && out <= hi;
    };
    auto real_in = [&](double lo, double hi, double& out) -> bool {
      const auto r = std::from_chars(val.data(), val.data() + val.size(), out);
      return r.ec == std::errc() && r.ptr == val.data() + val.size() && out >= lo && out <= hi;
    };
    auto bad = [&](const char* range) {
      return ToolStatus(ToolErrorCode::invalid_argument, "generator spec: " + std::string(key) + "='" + std::string(val) +
                                                     "' must be " + range);
    };
    std::int64_t v = 0;
    if (key == "layers") {
      if (!int_in(1, 4096, v)) return bad("an integer in [1, 4096]");
      spec.layers = static_cast<std::int32_t>(v);
    } else if (key == "experts") {
      if (!int_in(1, 1 << 20, v)) return bad("an integer in [1, 1048576]");
      spec.experts = static_cast<std::int32_t>(v);
    } else if (key == "topk") {
      if (!int_in(1, 1 << 20, v)) return bad("an integer in [1, experts]");
      spec.top_k = static_cast<std::int32_t>(v);
    } else if (key == "steps") {
      if (!int_in(1, trace_max_step, v)) return bad("an integer in [1, 2147483647]");
      spec.steps = static_cast<std::int32_t>(v);
    } else if (key == "seed") {
      if (!int_in(0, INT64_MAX, v)) return bad("a non-negative integer");
      spec.seed = static_cast<std::uint64_t>(v);
    } else if (key == "zipf") {
      if (!real_in(0.0, 10.0, spec.zipf_s)) return bad("a number in [0, 10]");
    } else if (key == "sticky") {
      if (!real_in(0.0, 1.0, spec.sticky)) return bad("a number in [0, 1]");
    } else {
      return ToolStatus(ToolErrorCode::invalid_argument,
                    "generator spec: unknown key '" + std::string(key) +
                        "' (known: layers, experts, topk, steps, zipf, sticky, seed)");
    }
  }
  if (spec.top_k > spec.experts) {
    return ToolStatus(ToolErrorCode::invalid_argument, "generator spec: topk " + std::to_string(spec.top_k) +
                                                   " exceeds experts " + std::to_string(spec.experts));
  }
  if (static_cast<std::int64_t>(spec.layers) * spec.steps * spec.top_k > (std::int64_t{1} << 31)) {
    return ToolStatus(ToolErrorCode::invalid_argument, "generator spec: layers*steps*topk exceeds 2^31 ids");
  }
  return spec;
}

// Generate a trace (layers numbered 0..layers-1, steps 0..steps-1, step-major).
[[nodiscard]] inline Trace generate_trace(const GeneratorSpec& spec) {
  Trace trace;
  trace.num_experts = spec.experts;
  const auto E = static_cast<std::size_t>(spec.experts);
  const auto K = static_cast<std::size_t>(spec.top_k);
  detail::SplitMix64 rng{spec.seed};

  // Zipf CDF over ranks, shared; each layer maps ranks to experts through its own permutation.
  std::vector<double> cdf(E);
  double total = 0.0;
  for (std::size_t r = 0; r < E; ++r) {
    total += detail::zipf_weight(static_cast<std::int32_t>(r), spec.zipf_s);
    cdf[r] = total;
  }
  std::vector<std::vector<std::int32_t>> perm(static_cast<std::size_t>(spec.layers));
  for (auto& p : perm) {
    p.resize(E);
    for (std::size_t i = 0; i < E; ++i) p[i] = static_cast<std::int32_t>(i);
    for (std::size_t i = E; i > 1; --i) std::swap(p[i - 1], p[rng.below(static_cast<std::uint32_t>(i))]);
  }
  std::vector<std::vector<std::int32_t>> previous(static_cast<std::size_t>(spec.layers));
  std::vector<std::uint32_t> taken(E, 0);  // epoch stamps: experts already picked this forward
  std::uint32_t epoch = 0;
  std::vector<std::int32_t> picks;
  picks.reserve(K);

  trace.forwards.reserve(static_cast<std::size_t>(spec.layers) * static_cast<std::size_t>(spec.steps));
  trace.ids.reserve(trace.forwards.capacity() * K);
  for (std::int32_t step = 0; step < spec.steps; ++step) {
    for (std::int32_t layer = 0; layer < spec.layers; ++layer) {
      ++epoch;
      picks.clear();
      auto& prev = previous[static_cast<std::size_t>(layer)];
      std::uint32_t rejected = 0;
      while (picks.size() < K) {
        std::int32_t e;
        if (rejected > 64) {
          // A steep Zipf rarely draws its tail: take the most popular untaken expert so
          // the loop is bounded (deterministic, so still reproducible).
          std::size_t rank = 0;
          while (taken[static_cast<std::size_t>(perm[static_cast<std::size_t>(layer)][rank])] == epoch) ++rank;
          e = perm[static_cast<std::size_t>(layer)][rank];
        } else if (!prev.empty() && rng.uniform() < spec.sticky) {
          e = prev[rng.below(static_cast<std::uint32_t>(prev.size()))];
        } else {
          const double u = rng.uniform() * total;
          auto rank = static_cast<std::size_t>(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
          rank = std::min(rank, E - 1);
          e = perm[static_cast<std::size_t>(layer)][rank];
        }
        if (taken[static_cast<std::size_t>(e)] == epoch) {
          ++rejected;
          continue;
        }
        taken[static_cast<std::size_t>(e)] = epoch;
        picks.push_back(e);
      }
      prev = picks;
      std::sort(picks.begin(), picks.end());
      TraceForward f;
      f.step = step;
      f.layer = layer;
      f.line = 0;  // not from a file
      f.records = 1;
      f.begin = trace.ids.size();
      trace.ids.insert(trace.ids.end(), picks.begin(), picks.end());
      f.end = trace.ids.size();
      trace.forwards.push_back(f);
      ++trace.records;
    }
  }
  return trace;
}

}  // namespace expert_cache::inline v0
