#pragma once
// expert-cache-bench: the synthetic NVFP4 model and the routing of every step (a trace v1 file
// or the replay tool's generator), validated before any runtime work. Host-only.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "args.hpp"
#include "expert_cache/base/splitmix64.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/tools/trace_generator.hpp"
#include "expert_cache/tools/trace_io.hpp"

namespace expert_cache::bench {

struct Model {
  std::int32_t layers = 0;
  std::int32_t experts = 0;
  std::int32_t top_k = 0;
  std::int32_t capacity = 0;
  std::int32_t batch = 1;
  Nvfp4Marlin layout;
  [[nodiscard]] std::size_t expert_bytes() const noexcept { return layout.bytes_per_expert(); }
  [[nodiscard]] std::int32_t ids_per_forward() const noexcept { return batch * top_k; }
};

// Routing of every step (warm-up included): per step and layer, batch * top_k ids (-1 = none)
// and the number of unique experts (what the consumer reads).
struct Routing {
  std::string source;
  std::int32_t steps = 0;
  std::vector<std::int32_t> ids;      // [steps][layers][batch * top_k]
  std::vector<std::int32_t> unique;   // [steps][layers]
  std::vector<float> weights;         // [steps][layers][batch * top_k], sum 1 per token
  std::int32_t widest = 0;            // largest unique count of any forward
  std::int32_t layers = 0;
  std::int32_t per_forward = 0;
  [[nodiscard]] std::span<const std::int32_t> forward(std::int32_t step, std::int32_t layer) const noexcept {
    const auto at = (static_cast<std::size_t>(step) * static_cast<std::size_t>(layers) + static_cast<std::size_t>(layer)) *
                    static_cast<std::size_t>(per_forward);
    return std::span<const std::int32_t>(ids).subspan(at, static_cast<std::size_t>(per_forward));
  }
  [[nodiscard]] std::span<const float> forward_weights(std::int32_t step, std::int32_t layer) const noexcept {
    const auto at = (static_cast<std::size_t>(step) * static_cast<std::size_t>(layers) + static_cast<std::size_t>(layer)) *
                    static_cast<std::size_t>(per_forward);
    return std::span<const float>(weights).subspan(at, static_cast<std::size_t>(per_forward));
  }
  [[nodiscard]] std::int32_t unique_count(std::int32_t step, std::int32_t layer) const noexcept {
    return unique[static_cast<std::size_t>(step) * static_cast<std::size_t>(layers) + static_cast<std::size_t>(layer)];
  }
};

// --prefetch-budget, default top-k (of the model: a trace's top-k when --trace is given).
inline std::int32_t prefetch_budget(const BenchArgs& a, const Model& m) noexcept {
  return a.prefetch_budget.value_or(m.top_k);
}

// Builds the model and the routing; every problem is a UsageError (exit 2), raised before any
// runtime (GPU) work.
inline std::pair<Model, Routing> build_model_and_routing(const BenchArgs& a) {
  Model m;
  m.batch = a.batch;
  m.layout = Nvfp4Marlin{a.hidden, a.intermediate, ActDtype::bf16};
  if (Status s = m.layout.validate(); !s) throw UsageError{std::string(s.message())};
  const std::int32_t total_steps = a.warmup + a.steps;
  const std::int64_t tokens = static_cast<std::int64_t>(total_steps) * a.batch;
  Trace trace;
  Routing r;
  if (a.trace_path) {
    if (a.topk_given) throw UsageError{"--topk cannot be combined with --trace (top-k comes from the trace)"};
    ToolResult<Trace> t = load_trace(*a.trace_path);
    if (!t.ok()) throw UsageError{t.status().to_string()};
    trace = std::move(t).value();
    if (trace.forwards.empty()) throw UsageError{*a.trace_path + ": the trace has no records"};
    r.source = *a.trace_path;
  } else {
    GeneratorSpec spec;
    spec.layers = a.layers;
    spec.experts = a.experts;
    spec.top_k = a.top_k;
    if (a.top_k > a.experts) {
      throw UsageError{"--topk " + std::to_string(a.top_k) + " exceeds --experts " + std::to_string(a.experts)};
    }
    if (tokens * a.layers * a.top_k > (std::int64_t{1} << 31)) throw UsageError{"too many steps for the generator"};
    spec.steps = static_cast<std::int32_t>(tokens);
    spec.zipf_s = a.zipf;
    spec.sticky = a.sticky;
    spec.seed = a.seed;
    trace = generate_trace(spec);
    char buf[160];
    std::snprintf(buf, sizeof buf, "generated:layers=%d,experts=%d,topk=%d,steps=%lld,zipf=%g,sticky=%g,seed=%llu",
                  a.layers, a.experts, a.top_k, static_cast<long long>(tokens), a.zipf, a.sticky,
                  static_cast<unsigned long long>(a.seed));
    r.source = buf;
  }
  // Layers (first --layers of the trace's), experts, top-k, the distinct steps in order.
  std::vector<std::int32_t> layers = trace.layers();
  if (a.layers_given && a.trace_path && static_cast<std::size_t>(a.layers) < layers.size()) layers.resize(static_cast<std::size_t>(a.layers));
  m.layers = static_cast<std::int32_t>(layers.size());
  m.experts = trace.num_experts;
  if (a.experts_given) {
    if (a.experts < trace.num_experts) {
      throw UsageError{"--experts " + std::to_string(a.experts) + " is below the trace's " +
                       std::to_string(trace.num_experts) + " experts"};
    }
    m.experts = a.experts;
  }
  if (!a.trace_path) m.experts = a.experts;
  std::vector<std::int32_t> step_numbers;
  std::unordered_map<std::uint64_t, std::size_t> by_key;
  std::size_t widest_record = 0;
  for (std::size_t i = 0; i < trace.forwards.size(); ++i) {
    const TraceForward& f = trace.forwards[i];
    if (step_numbers.empty() || step_numbers.back() != f.step) {
      if (std::find(step_numbers.begin(), step_numbers.end(), f.step) == step_numbers.end()) step_numbers.push_back(f.step);
    }
    by_key[(static_cast<std::uint64_t>(static_cast<std::uint32_t>(f.step)) << 32) | static_cast<std::uint32_t>(f.layer)] = i;
    widest_record = std::max(widest_record, f.size());
  }
  m.top_k = a.trace_path ? static_cast<std::int32_t>(widest_record) : a.top_k;
  if (static_cast<std::int64_t>(step_numbers.size()) < tokens) {
    throw UsageError{r.source + ": has " + std::to_string(step_numbers.size()) + " steps but (--warmup " +
                     std::to_string(a.warmup) + " + --steps " + std::to_string(a.steps) + ") x --batch " +
                     std::to_string(a.batch) + " = " + std::to_string(tokens) + " tokens are needed"};
  }
  m.capacity = a.capacity;
  if (m.capacity > m.experts) {
    throw UsageError{"--capacity " + std::to_string(m.capacity) + " exceeds the " + std::to_string(m.experts) +
                     " experts per layer"};
  }
  if (m.capacity < m.top_k) {
    throw UsageError{"--capacity " + std::to_string(m.capacity) + " is below top-k " + std::to_string(m.top_k) +
                     " (one token's experts must fit the slots)"};
  }

  r.steps = total_steps;
  r.layers = m.layers;
  r.per_forward = m.ids_per_forward();
  const auto forwards = static_cast<std::size_t>(total_steps) * static_cast<std::size_t>(m.layers);
  r.ids.assign(forwards * static_cast<std::size_t>(r.per_forward), -1);
  r.weights.assign(r.ids.size(), 0.0f);
  r.unique.assign(forwards, 0);
  std::vector<std::uint32_t> seen(static_cast<std::size_t>(m.experts), 0);
  std::uint32_t epoch = 0;
  expert_cache::detail::SplitMix64 rng{a.seed ^ 0x5bd1e995u};
  for (std::int32_t s = 0; s < total_steps; ++s) {
    for (std::int32_t l = 0; l < m.layers; ++l) {
      ++epoch;
      const std::size_t fwd = static_cast<std::size_t>(s) * static_cast<std::size_t>(m.layers) + static_cast<std::size_t>(l);
      std::int32_t unique = 0;
      for (std::int32_t b = 0; b < m.batch; ++b) {
        const std::int32_t step_no = step_numbers[static_cast<std::size_t>(s * m.batch + b)];
        const auto it = by_key.find((static_cast<std::uint64_t>(static_cast<std::uint32_t>(step_no)) << 32) |
                                    static_cast<std::uint32_t>(layers[static_cast<std::size_t>(l)]));
        if (it == by_key.end()) continue;  // this token skipped the layer
        const auto ids = trace.experts(it->second);
        const std::size_t base = fwd * static_cast<std::size_t>(r.per_forward) + static_cast<std::size_t>(b * m.top_k);
        float sum = 0.0f;
        for (std::size_t k = 0; k < ids.size(); ++k) {
          r.ids[base + k] = ids[k];
          r.weights[base + k] = 0.25f + static_cast<float>(rng.uniform());
          sum += r.weights[base + k];
          if (seen[static_cast<std::size_t>(ids[k])] != epoch) {
            seen[static_cast<std::size_t>(ids[k])] = epoch;
            ++unique;
          }
        }
        for (std::size_t k = 0; k < ids.size(); ++k) r.weights[base + k] /= sum;
      }
      r.unique[fwd] = unique;
      r.widest = std::max(r.widest, unique);
    }
  }
  if (r.widest > m.capacity) {
    throw UsageError{"a decode step needs " + std::to_string(r.widest) + " unique experts in one layer but --capacity is " +
                     std::to_string(m.capacity) + " (lower --batch or raise --capacity)"};
  }
  return {m, std::move(r)};
}

}  // namespace expert_cache::bench
