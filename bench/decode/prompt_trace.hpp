#pragma once
// expert-cache-bench --prompt / --prompt-trace: the routing of the prompt mode. The prompts of the
// TTFT table (generated per --prompt length, or the wide forward of one step of a trace file) and
// the decode steps of the warm-up and the mixed run (generated, or the trace's one-token steps).
// A trace is validated completely against the model before anything runs; every problem is a
// UsageError naming the file and the line or step. Host-only.
//
// A prompt in a trace (format v1, docs/trace_format.md): every record of one (step, layer) is one
// token's experts, so a step whose layers have several records each is a prompt served as one wide
// forward per layer. The trace's distinct layers, in ascending order, are the model's layers
// 0..L-1; their number must be the model's.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "args.hpp"
#include "model.hpp"
#include "expert_cache/tools/trace_generator.hpp"
#include "expert_cache/tools/trace_io.hpp"

namespace expert_cache::bench {

// The most tokens one prompt may have (--prompt's limit too).
inline constexpr std::int32_t max_prompt_tokens = 1 << 16;

// A prompt's routing: per model layer tokens * top_k ids, token t's at [t * top_k, (t + 1) * top_k),
// ascending, padded with -1 (a token of fewer than top_k distinct experts).
struct PromptRouting {
  std::int32_t tokens = 0;
  std::vector<std::vector<std::int32_t>> ids;
};

// Decode steps of batch 1: forward s * layers + l of `trace` is step s at model layer l.
struct DecodeSteps {
  Trace trace;
  std::int32_t steps = 0;
  std::int32_t layers = 0;
  [[nodiscard]] std::span<const std::int32_t> ids(std::int64_t step, std::int32_t layer) const noexcept {
    return trace.experts(static_cast<std::size_t>(step % steps) * static_cast<std::size_t>(layers) +
                         static_cast<std::size_t>(layer));
  }
};

// --prompt-trace FILE[:STEP], loaded and checked against the model.
struct PromptTrace {
  std::string path;
  std::int32_t step = 0;             // the prompt's step number, as the trace writes it
  bool step_given = false;           // false: the first step with a wide forward
  std::uint64_t first_line = 0;      // lines of the prompt's first and last records
  std::uint64_t last_line = 0;
  PromptRouting prompt;
  DecodeSteps decode;                // the one-token steps (decode.steps == 0: none)
  std::int32_t unused_steps = 0;     // steps neither the prompt nor one-token steps of every layer
};

// The generated prompt of `tokens` tokens (the decode generator with its own seed).
inline PromptRouting generate_prompt(const Model& m, const BenchArgs& a, std::int32_t tokens, std::uint64_t seed) {
  GeneratorSpec spec;
  spec.layers = m.layers;
  spec.experts = m.experts;
  spec.top_k = m.top_k;
  spec.steps = tokens;
  spec.zipf_s = a.zipf;
  spec.sticky = a.sticky;
  spec.seed = seed;
  const Trace t = generate_trace(spec);
  PromptRouting p;
  p.tokens = tokens;
  const auto k = static_cast<std::size_t>(m.top_k);
  p.ids.assign(static_cast<std::size_t>(m.layers), std::vector<std::int32_t>(static_cast<std::size_t>(tokens) * k, -1));
  for (const TraceForward& f : t.forwards) {
    const auto e = t.experts(f);
    std::copy_n(e.begin(), std::min(k, e.size()),
                p.ids[static_cast<std::size_t>(f.layer)].begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(f.step) * k));
  }
  return p;
}

// The generated decode steps (4096, cycled), as the prompt mode has always used them.
inline DecodeSteps generate_decode_steps(const Model& m, const BenchArgs& a) {
  GeneratorSpec spec;
  spec.layers = m.layers;
  spec.experts = m.experts;
  spec.top_k = m.top_k;
  spec.steps = 4096;
  spec.zipf_s = a.zipf;
  spec.sticky = a.sticky;
  spec.seed = a.seed;
  DecodeSteps d;
  d.trace = generate_trace(spec);
  d.steps = spec.steps;
  d.layers = m.layers;
  return d;
}

namespace detail {

inline std::string ordinal(std::size_t n) {
  const char* suffix = (n % 100 >= 11 && n % 100 <= 13) ? "th" : n % 10 == 1 ? "st" : n % 10 == 2 ? "nd" : n % 10 == 3 ? "rd" : "th";
  return std::to_string(n) + suffix;
}

}  // namespace detail

// Reads `path`, validates it (format v1, then against the model) and takes the prompt at `step`
// (default: the first step, in file order, with more than one record in some layer). Throws
// UsageError naming the file and the line or step of the first problem.
inline PromptTrace load_prompt_trace(const std::string& path, std::optional<std::int32_t> step, const Model& m) {
  const std::string where = "--prompt-trace " + path + ": ";
  std::string text;
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw UsageError{"--prompt-trace: cannot open trace file '" + path + "'"};
    std::ostringstream buf;
    buf << in.rdbuf();
    if (in.bad()) throw UsageError{"--prompt-trace: cannot read trace file '" + path + "'"};
    text = std::move(buf).str();
  }
  ToolResult<Trace> parsed = parse_trace_text(text);
  if (!parsed.ok()) throw UsageError{where + std::string(parsed.status().message())};
  const Trace& trace = parsed.value();
  if (trace.forwards.empty()) throw UsageError{where + "the trace has no records"};

  // Layers: the trace's distinct layers, ascending, are the model's 0..L-1.
  const std::vector<std::int32_t> layers = trace.layers();
  if (layers.size() != static_cast<std::size_t>(m.layers)) {
    std::string msg = where + "the trace has " + std::to_string(layers.size()) + " layer" + (layers.size() == 1 ? "" : "s") +
                      " (" + std::to_string(layers.front()) + (layers.size() == 1 ? "" : " to " + std::to_string(layers.back())) +
                      ") but the model has " + std::to_string(m.layers) + " (--layers)";
    if (layers.size() > static_cast<std::size_t>(m.layers)) {
      // Name where the first layer beyond the model's count appears.
      const std::int32_t extra = layers[static_cast<std::size_t>(m.layers)];
      for (const TraceForward& f : trace.forwards) {
        if (f.layer == extra) {
          msg += "; layer " + std::to_string(extra) + ", the trace's " + detail::ordinal(static_cast<std::size_t>(m.layers) + 1) +
                 ", first appears on line " + std::to_string(f.line);
          break;
        }
      }
    }
    throw UsageError{msg};
  }
  std::unordered_map<std::int32_t, std::int32_t> rank;  // trace layer -> model layer
  for (std::size_t i = 0; i < layers.size(); ++i) rank[layers[i]] = static_cast<std::int32_t>(i);

  // Steps in order of first appearance, each with its forward per model layer (-1: none).
  std::vector<std::int32_t> step_numbers;
  std::unordered_map<std::int32_t, std::size_t> step_index;
  std::vector<std::vector<std::int64_t>> by_step;
  for (std::size_t i = 0; i < trace.forwards.size(); ++i) {
    const TraceForward& f = trace.forwards[i];
    auto [it, inserted] = step_index.try_emplace(f.step, step_numbers.size());
    if (inserted) {
      step_numbers.push_back(f.step);
      by_step.emplace_back(static_cast<std::size_t>(m.layers), -1);
    }
    by_step[it->second][static_cast<std::size_t>(rank[f.layer])] = static_cast<std::int64_t>(i);
  }
  const auto wide = [&](std::size_t s) {
    return std::any_of(by_step[s].begin(), by_step[s].end(), [&](std::int64_t f) {
      return f >= 0 && trace.forwards[static_cast<std::size_t>(f)].records > 1;
    });
  };
  const auto first_line_of = [&](std::size_t s) {
    std::uint64_t line = 0;
    for (const std::int64_t f : by_step[s])
      if (f >= 0 && (line == 0 || trace.forwards[static_cast<std::size_t>(f)].line < line))
        line = trace.forwards[static_cast<std::size_t>(f)].line;
    return line;
  };

  PromptTrace out;
  out.path = path;
  out.step_given = step.has_value();
  std::size_t prompt_step = 0;
  if (step) {
    const auto it = step_index.find(*step);
    if (it == step_index.end()) throw UsageError{where + "step " + std::to_string(*step) + " is not in the trace"};
    prompt_step = it->second;
    if (!wide(prompt_step)) {
      throw UsageError{where + "step " + std::to_string(*step) + " (line " + std::to_string(first_line_of(prompt_step)) +
                       ") has no wide forward: no layer has more than one record (token) at that step"};
    }
  } else {
    std::size_t s = 0;
    while (s < by_step.size() && !wide(s)) ++s;
    if (s == by_step.size()) {
      throw UsageError{where + "no step has a wide forward (a layer with more than one record, one per token): "
                       "the trace holds no prompt"};
    }
    prompt_step = s;
  }
  out.step = step_numbers[prompt_step];

  // The prompt: every layer's forward at the step, all with the same number of tokens.
  const std::vector<std::int64_t>& prompt_forwards = by_step[prompt_step];
  const TraceForward* widest = nullptr;
  for (std::size_t l = 0; l < prompt_forwards.size(); ++l) {
    if (prompt_forwards[l] < 0) {
      throw UsageError{where + "step " + std::to_string(out.step) + " (line " + std::to_string(first_line_of(prompt_step)) +
                       ") has no records for layer " + std::to_string(layers[l]) +
                       ": a prompt's tokens pass every layer"};
    }
    const TraceForward& f = trace.forwards[static_cast<std::size_t>(prompt_forwards[l])];
    if (widest == nullptr || f.records > widest->records) widest = &f;
  }
  for (const std::int64_t fi : prompt_forwards) {
    const TraceForward& f = trace.forwards[static_cast<std::size_t>(fi)];
    if (f.records != widest->records) {
      throw UsageError{where + "line " + std::to_string(f.line) + ": step " + std::to_string(out.step) + " layer " +
                       std::to_string(f.layer) + " has " + std::to_string(f.records) + " record(s) but layer " +
                       std::to_string(widest->layer) + " has " + std::to_string(widest->records) + " (line " +
                       std::to_string(widest->line) + "): a prompt's tokens pass every layer, one record each"};
    }
  }
  if (widest->records > static_cast<std::uint32_t>(max_prompt_tokens)) {
    throw UsageError{where + "step " + std::to_string(out.step) + " (line " + std::to_string(widest->line) + ") has " +
                     std::to_string(widest->records) + " tokens, more than the " + std::to_string(max_prompt_tokens) +
                     " a prompt may have"};
  }
  out.prompt.tokens = static_cast<std::int32_t>(widest->records);
  const auto K = static_cast<std::size_t>(m.top_k);
  out.prompt.ids.assign(static_cast<std::size_t>(m.layers),
                        std::vector<std::int32_t>(static_cast<std::size_t>(out.prompt.tokens) * K, -1));

  // Every record against the model (experts, top-k); the prompt step's records become its tokens.
  // The parser accepted the text, so every token here is a well-formed number.
  std::vector<std::size_t> token_of(static_cast<std::size_t>(m.layers), 0);
  std::vector<std::int32_t> record;
  std::uint64_t line_no = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    ++line_no;
    std::size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line = std::string_view(text).substr(pos, end - pos);
    pos = end + 1;
    if (const std::size_t hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    std::size_t i = 0;
    const auto next_number = [&](std::int64_t& v) {
      while (i < line.size() && expert_cache::detail::is_trace_space(line[i])) ++i;
      const std::size_t start = i;
      while (i < line.size() && !expert_cache::detail::is_trace_space(line[i])) ++i;
      if (start == i) return false;
      (void)expert_cache::detail::parse_trace_int(line.substr(start, i - start), trace_max_step, v);
      return true;
    };
    std::int64_t s = 0, layer = 0, id = 0;
    if (!next_number(s)) continue;  // blank or comment-only
    (void)next_number(layer);
    record.clear();
    while (next_number(id)) {
      if (id >= m.experts) {
        throw UsageError{where + "line " + std::to_string(line_no) + ": expert id " + std::to_string(id) +
                         " is outside the model's " + std::to_string(m.experts) + " experts (--experts)"};
      }
      record.push_back(static_cast<std::int32_t>(id));
    }
    std::sort(record.begin(), record.end());
    record.erase(std::unique(record.begin(), record.end()), record.end());
    if (record.size() > K) {
      throw UsageError{where + "line " + std::to_string(line_no) + ": a record (one token) of " +
                       std::to_string(record.size()) + " distinct experts, more than the model's top-k " +
                       std::to_string(m.top_k) + " (--topk)"};
    }
    if (s != out.step) continue;
    const auto l = static_cast<std::size_t>(rank[static_cast<std::int32_t>(layer)]);
    std::copy(record.begin(), record.end(),
              out.prompt.ids[l].begin() + static_cast<std::ptrdiff_t>(token_of[l]++ * K));
    if (out.first_line == 0) out.first_line = line_no;
    out.last_line = line_no;
  }

  // Decode steps: the other steps with exactly one record in every layer, in file order.
  out.decode.layers = m.layers;
  for (std::size_t s = 0; s < by_step.size(); ++s) {
    if (s == prompt_step) continue;
    const bool one_token = std::all_of(by_step[s].begin(), by_step[s].end(), [&](std::int64_t f) {
      return f >= 0 && trace.forwards[static_cast<std::size_t>(f)].records == 1;
    });
    if (!one_token) {
      ++out.unused_steps;
      continue;
    }
    for (std::size_t l = 0; l < by_step[s].size(); ++l) {
      const auto e = trace.experts(static_cast<std::size_t>(by_step[s][l]));
      TraceForward f;
      f.step = out.decode.steps;
      f.layer = static_cast<std::int32_t>(l);
      f.records = 1;
      f.begin = out.decode.trace.ids.size();
      out.decode.trace.ids.insert(out.decode.trace.ids.end(), e.begin(), e.end());
      f.end = out.decode.trace.ids.size();
      out.decode.trace.forwards.push_back(f);
    }
    ++out.decode.steps;
  }
  out.decode.trace.num_experts = m.experts;
  return out;
}

// The prompts of the TTFT table: the trace's, or one generated per --prompt length.
inline std::vector<PromptRouting> table_prompts(const Model& m, const BenchArgs& a, const PromptTrace* trace) {
  std::vector<PromptRouting> out;
  if (trace != nullptr) {
    out.push_back(trace->prompt);
  } else {
    for (const std::int32_t tokens : a.prompts) out.push_back(generate_prompt(m, a, tokens, a.seed + 7919));
  }
  return out;
}

// The decode steps of the warm-up and the mixed run: the trace's one-token steps if it has any.
inline DecodeSteps prompt_decode_steps(const Model& m, const BenchArgs& a, const PromptTrace* trace) {
  if (trace != nullptr && trace->decode.steps > 0) return trace->decode;
  return generate_decode_steps(m, a);
}

// One line naming the prompt mode's routing (printed under the model line of every prompt table).
inline std::string prompt_routing_line(const BenchArgs& a, const PromptTrace* trace) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "--zipf %g --sticky %g --seed %llu", a.zipf, a.sticky,
                static_cast<unsigned long long>(a.seed));
  const std::string generator = buf;
  if (trace == nullptr) return "routing: generated prompts and decode steps (" + generator + ")";
  std::string s = "routing: prompt = " + trace->path + " step " + std::to_string(trace->step) +
                  (trace->step_given ? "" : " (the first step with a wide forward)") + ", lines " +
                  std::to_string(trace->first_line) + "-" + std::to_string(trace->last_line) + ", " +
                  std::to_string(trace->prompt.tokens) + " tokens per layer; decode steps = ";
  if (trace->decode.steps > 0) {
    s += "the trace's " + std::to_string(trace->decode.steps) + " one-token steps, in file order, cycled";
  } else {
    s += "generated (" + generator + "; the trace has no step with one record in every layer)";
  }
  if (trace->unused_steps > 0) s += "; " + std::to_string(trace->unused_steps) + " other step(s) not used";
  return s;
}

}  // namespace expert_cache::bench
