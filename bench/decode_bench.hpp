#pragma once
// expert-cache-bench, the part every build shares (host-only): arguments, the routing source
// (trace v1 file or the replay tool's generator), the synthetic NVFP4 model, result rows, the
// table / Google-Benchmark-compatible JSON output, and the MODELLED run on SimRuntime.
// bench/expert_cache_bench.cpp (host build) and bench/expert_cache_bench.cu (CUDA build, adds
// the measured GPU path) both call bench_main().
//
// The decode loop is the same on both runtimes. Per step (B tokens) and MoE layer:
//   1. the host waits for the consumer stream (an engine reads the routing ids back here: vLLM's
//      providers sync once per layer), then uploads the ids on the consumer stream,
//   2. cache.prepare(ids, consumer) makes the experts resident (copies on the fill stream),
//   3. the consumer reads the experts through the slot buffers and the forward map.
// The "resident" provider is the same loop without a cache: every expert in HBM (upper bound).
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "cli_args.hpp"
#include "json_text.hpp"
#include "expert_cache/expert_cache.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"
#include "expert_cache/tools/trace_generator.hpp"
#include "expert_cache/tools/trace_io.hpp"

namespace expert_cache::bench {

inline constexpr int exit_ok = 0;
inline constexpr int exit_failure = 1;
inline constexpr int exit_usage = 2;

// ---- arguments ------------------------------------------------------------------------------

enum class RuntimeChoice : std::uint8_t { automatic, sim, cuda };

struct BenchArgs {
  // Synthetic model (defaults: the seed's 48-layer, 512-expert NVFP4 model, 208 slots per layer).
  std::int32_t layers = 48;
  std::int32_t experts = 512;
  std::int32_t top_k = 10;
  std::int64_t hidden = 2048;
  std::int64_t intermediate = 512;
  std::int32_t capacity = 208;
  std::int32_t batch = 1;    // tokens per decode step
  std::int32_t steps = 32;   // measured steps
  std::int32_t warmup = 64;  // steps before measuring (the first one is the cold start)
  // Generator (trace.hpp's GeneratorSpec): per-layer Zipf popularity + reuse of the last picks.
  double zipf = 1.0;
  double sticky = 0.4;
  std::uint64_t seed = 1;
  std::optional<std::string> trace_path;
  bool layers_given = false;
  bool experts_given = false;
  bool topk_given = false;
  std::vector<std::string> providers;  // row, cached, resident
  std::vector<std::string> staging;    // inline, copy_stream, batched, gather
  bool staging_given = false;
  RuntimeChoice runtime = RuntimeChoice::automatic;
  std::optional<std::string> json_path;
  std::int64_t sim_scale = 1024;  // SimRuntime holds weights scaled down by this factor
  bool progress = false;
  bool help = false;
};

inline const std::vector<std::string>& provider_names() {
  static const std::vector<std::string> names{"row", "cached", "resident"};
  return names;
}
inline const std::vector<std::string>& staging_names() {
  static const std::vector<std::string> names{"inline", "copy_stream", "batched", "gather"};
  return names;
}

inline void print_help(std::FILE* out, bool cuda_built) {
  std::fprintf(out,
               "usage: expert-cache-bench [options]\n"
               "\n"
               "Decode-loop benchmark of the expert cache on a synthetic NVFP4 MoE model: per step and layer\n"
               "prepare() then the MoE consumer. Compares the row provider (tensor-major, LRU), the cached provider\n"
               "(whole-expert, LFRU) under every staging policy, and an all-resident run (upper bound).\n"
               "Without a GPU the run is MODELLED on SimRuntime's virtual-time cost model (docs/benchmarks.md).\n"
               "\n"
               "model\n"
               "  --layers N          MoE layers (default 48)\n"
               "  --experts E         experts per layer (default 512)\n"
               "  --topk K            experts per token (default 10)\n"
               "  --hidden K          hidden size (default 2048)\n"
               "  --intermediate N    intermediate size (default 512): expert = 1.688 MiB in NVFP4-Marlin\n"
               "  --capacity C        GPU slots per layer (default 208)\n"
               "routing\n"
               "  --trace FILE        routing trace, format v1 (docs/trace_format.md); one trace step = one token;\n"
               "                      layers, experts and top-k come from the trace (--layers limits the layers)\n"
               "  --zipf S --sticky P --seed N   generator (default 1.0, 0.4, 1) when no --trace is given\n"
               "run\n"
               "  --batch B           tokens per decode step, 1..16 (default 1)\n"
               "  --steps N           measured decode steps (default 32)\n"
               "  --warmup N          steps before measuring; the first is the cold start (default 64)\n"
               "  --provider P,...    row, cached, resident, or all (default all)\n"
               "  --staging S,...     inline, copy_stream, batched, gather (CUDA only), or all (default: all that\n"
               "                      the runtime has)\n"
               "  --runtime R         auto (CUDA when built with it and a device exists), sim, cuda (default auto)\n"
               "  --sim-scale F       SimRuntime stores weights scaled down by F; times use the real bytes (1024)\n"
               "output\n"
               "  --json FILE         Google-Benchmark-compatible JSON (also --benchmark_out=FILE)\n"
               "  --progress          progress on stderr (default: only when stderr is a terminal)\n"
               "  --help              this text\n"
               "\n"
               "This build: %s.\n"
               "Exit status: 0 ok, 2 bad arguments or bad trace, 1 runtime failure.\n",
               cuda_built ? "CUDA path built (measured on a GPU, modelled otherwise)" : "host only (modelled)");
}

namespace detail {

inline std::int64_t parse_int(std::string_view flag, std::string_view text, std::int64_t lo, std::int64_t hi) {
  std::int64_t v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc() || r.ptr != text.data() + text.size()) {
    throw UsageError{std::string(flag) + ": '" + std::string(text) + "' is not an integer"};
  }
  if (v < lo || v > hi) {
    throw UsageError{std::string(flag) + ": " + std::to_string(v) + " is outside [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]"};
  }
  return v;
}

inline double parse_real(std::string_view flag, std::string_view text, double lo, double hi) {
  double v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc() || r.ptr != text.data() + text.size() || !(v >= lo && v <= hi)) {
    throw UsageError{std::string(flag) + ": '" + std::string(text) + "' must be a number in [" + std::to_string(lo) +
                     ", " + std::to_string(hi) + "]"};
  }
  return v;
}

inline std::vector<std::string> parse_list(std::string_view flag, std::string_view text,
                                           const std::vector<std::string>& known) {
  std::vector<std::string> out;
  for (const std::string_view item : split_commas(text)) {
    if (item == "all") {
      for (const std::string& k : known)
        if (std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
      continue;
    }
    if (std::find(known.begin(), known.end(), item) == known.end()) {
      std::string list;
      for (const std::string& k : known) list += " " + k;
      throw UsageError{std::string(flag) + ": unknown " + std::string(flag.substr(2)) + " '" + std::string(item) +
                       "' (available:" + list + ", all)"};
    }
    if (std::find(out.begin(), out.end(), item) == out.end()) out.emplace_back(item);
  }
  return out;
}

}  // namespace detail

inline BenchArgs parse_args(int argc, char** argv) {
  BenchArgs a;
  ArgCursor cursor(argc, argv);
  while (cursor.next()) {
    const std::string_view arg = cursor.name();
    auto value = [&] { return cursor.value(); };
    auto no_value = [&] { cursor.no_value(); };
    using detail::parse_int;
    if (arg == "--help" || arg == "-h") {
      no_value();
      a.help = true;
    } else if (arg == "--layers") {
      a.layers = static_cast<std::int32_t>(parse_int(arg, value(), 1, 4096));
      a.layers_given = true;
    } else if (arg == "--experts") {
      a.experts = static_cast<std::int32_t>(parse_int(arg, value(), 1, 1 << 16));
      a.experts_given = true;
    } else if (arg == "--topk") {
      a.top_k = static_cast<std::int32_t>(parse_int(arg, value(), 1, 1024));
      a.topk_given = true;
    } else if (arg == "--hidden") {
      a.hidden = parse_int(arg, value(), 64, 1 << 16);
    } else if (arg == "--intermediate") {
      a.intermediate = parse_int(arg, value(), 16, 1 << 16);
    } else if (arg == "--capacity") {
      a.capacity = static_cast<std::int32_t>(parse_int(arg, value(), 1, 1 << 16));
    } else if (arg == "--batch") {
      a.batch = static_cast<std::int32_t>(parse_int(arg, value(), 1, 16));
    } else if (arg == "--steps") {
      a.steps = static_cast<std::int32_t>(parse_int(arg, value(), 1, 1 << 20));
    } else if (arg == "--warmup") {
      a.warmup = static_cast<std::int32_t>(parse_int(arg, value(), 0, 1 << 20));
    } else if (arg == "--zipf") {
      a.zipf = detail::parse_real(arg, value(), 0.0, 10.0);
    } else if (arg == "--sticky") {
      a.sticky = detail::parse_real(arg, value(), 0.0, 1.0);
    } else if (arg == "--seed") {
      a.seed = static_cast<std::uint64_t>(parse_int(arg, value(), 0, INT64_MAX));
    } else if (arg == "--trace") {
      a.trace_path = std::string(value());
    } else if (arg == "--provider") {
      a.providers = detail::parse_list(arg, value(), provider_names());
    } else if (arg == "--staging") {
      a.staging = detail::parse_list(arg, value(), staging_names());
      a.staging_given = true;
    } else if (arg == "--runtime") {
      const std::string_view v = value();
      if (v == "auto") a.runtime = RuntimeChoice::automatic;
      else if (v == "sim") a.runtime = RuntimeChoice::sim;
      else if (v == "cuda") a.runtime = RuntimeChoice::cuda;
      else throw UsageError{"--runtime: '" + std::string(v) + "' is not auto, sim or cuda"};
    } else if (arg == "--sim-scale") {
      a.sim_scale = parse_int(arg, value(), 1, 1 << 20);
    } else if (arg == "--json" || arg == "--benchmark_out") {
      a.json_path = std::string(value());
      if (a.json_path->empty()) throw UsageError{std::string(arg) + " needs a file name"};
    } else if (arg == "--benchmark_out_format") {
      if (value() != "json") throw UsageError{"--benchmark_out_format: only json is written"};
    } else if (arg == "--progress") {
      no_value();
      a.progress = true;
    } else {
      throw UsageError{"unknown argument '" + std::string(arg) + "' (see --help)"};
    }
  }
  if (a.providers.empty()) a.providers = provider_names();
  return a;
}

// ---- model and routing ----------------------------------------------------------------------

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

// Builds the model and the routing; every problem is a UsageError (exit 2), raised before any
// runtime (GPU) work.
inline std::pair<Model, Routing> build_model_and_routing(const BenchArgs& a) {
  Model m;
  m.batch = a.batch;
  m.layout = Nvfp4Marlin{a.hidden, a.intermediate, ActDtype::bf16};
  if (Status s = m.layout.validate(); !s) throw UsageError{s.message()};
  const std::int32_t total_steps = a.warmup + a.steps;
  const std::int64_t tokens = static_cast<std::int64_t>(total_steps) * a.batch;
  Trace trace;
  Routing r;
  if (a.trace_path) {
    if (a.topk_given) throw UsageError{"--topk cannot be combined with --trace (top-k comes from the trace)"};
    Result<Trace> t = load_trace(*a.trace_path);
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

// ---- results --------------------------------------------------------------------------------

struct RunResult {
  std::string provider;  // row | cached | resident
  std::string staging;   // inline | copy_stream | batched | gather | "-"
  bool modelled = true;
  std::int64_t tokens = 0;          // measured tokens
  std::int64_t prepares = 0;        // measured prepare() calls
  double time_ns = 0;               // measured steps (modelled or wall clock)
  double cold_start_ns = 0;         // the first token
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t copies = 0;
  double pcie_bytes = 0;            // expert bytes moved host -> device (maps excluded)
  double map_bytes = 0;
  double prepare_wall_ns = 0;       // real wall clock inside prepare()
  double prepare_model_ns = 0;      // modelled host time inside prepare() (SimRuntime only)
  std::uint64_t check_failures = 0; // consumer saw a wrong expert (sim) / outputs differ (GPU)
  bool output_checked = false;
  [[nodiscard]] double seconds_per_token() const noexcept { return tokens ? time_ns * 1e-9 / static_cast<double>(tokens) : 0; }
  [[nodiscard]] double tokens_per_second() const noexcept { return time_ns > 0 ? static_cast<double>(tokens) / (time_ns * 1e-9) : 0; }
  [[nodiscard]] double hit_rate() const noexcept {
    return hits + misses ? static_cast<double>(hits) / static_cast<double>(hits + misses) : 1.0;
  }
  [[nodiscard]] double misses_per_token() const noexcept { return tokens ? static_cast<double>(misses) / static_cast<double>(tokens) : 0; }
  [[nodiscard]] double pcie_bytes_per_token() const noexcept { return tokens ? pcie_bytes / static_cast<double>(tokens) : 0; }
};

struct Report {
  bool modelled = true;
  std::string runtime_name;    // "SimRuntime (modelled)" | device name
  double pcie_ceiling_bytes_per_s = 0;  // same run: one big pinned H2D copy
  std::string cost_model_json;          // modelled runs: the constants
  Model model;
  std::string routing;
  std::int32_t steps = 0, warmup = 0;
  std::vector<RunResult> runs;
  std::vector<std::string> notes;  // extra lines printed under the table
  [[nodiscard]] const RunResult* resident() const noexcept {
    for (const RunResult& r : runs)
      if (r.provider == "resident") return &r;
    return nullptr;
  }
  // tokens/s of this run / tokens/s of the all-resident run (1 = as fast as no offload).
  [[nodiscard]] std::optional<double> vs_resident(const RunResult& r) const noexcept {
    const RunResult* res = resident();
    if (res == nullptr || res->tokens_per_second() <= 0) return std::nullopt;
    return r.tokens_per_second() / res->tokens_per_second();
  }
  // Time per token that moving the misses at the same-run pinned-copy ceiling takes, over the
  // time per token achieved (1 = running at the PCIe bound; 0 = no misses).
  [[nodiscard]] double pcie_bound_seconds_per_token(const RunResult& r) const noexcept {
    return pcie_ceiling_bytes_per_s > 0 ? r.pcie_bytes_per_token() / pcie_ceiling_bytes_per_s : 0;
  }
  [[nodiscard]] double vs_pcie(const RunResult& r) const noexcept {
    const double t = r.seconds_per_token();
    return t > 0 ? pcie_bound_seconds_per_token(r) / t : 0;
  }
};

inline std::string mode_label(bool modelled) {
  return modelled ? "MODELLED (SimRuntime cost model), not measured" : "MEASURED (CUDA)";
}

inline void print_table(std::FILE* out, const Report& rep) {
  const Model& m = rep.model;
  std::fprintf(out, "expert-cache-bench: %s\n", mode_label(rep.modelled).c_str());
  std::fprintf(out, "runtime: %s\n", rep.runtime_name.c_str());
  std::fprintf(out,
               "model: %d MoE layers, %d experts, top-%d, hidden %lld, intermediate %lld, NVFP4-Marlin expert %.3f MiB, "
               "%d slots/layer, batch %d\n",
               m.layers, m.experts, m.top_k, static_cast<long long>(m.layout.hidden),
               static_cast<long long>(m.layout.intermediate), static_cast<double>(m.expert_bytes()) / 1048576.0,
               m.capacity, m.batch);
  std::fprintf(out, "routing: %s; %d warm-up steps (first = cold start), %d measured steps\n", rep.routing.c_str(),
               rep.warmup, rep.steps);
  std::fprintf(out, "pinned-copy ceiling (same run): %.1f GB/s%s\n\n", rep.pcie_ceiling_bytes_per_s * 1e-9,
               rep.modelled ? " (modelled)" : "");
  std::fprintf(out, "%-9s %-12s %9s %8s %8s %7s %8s %9s %9s %9s %9s\n", "provider", "staging", "tok/s", "vs_res",
               "vs_pcie", "hit%", "miss/tok", "MB/tok", rep.modelled ? "prep_us*" : "prep_us", "prep_us", "cold_ms");
  std::fprintf(out, "%-9s %-12s %9s %8s %8s %7s %8s %9s %9s %9s %9s\n", "", "", "", "", "", "", "", "(PCIe)",
               rep.modelled ? "(model)" : "(real)", rep.modelled ? "(realCPU)" : "", "");
  for (const RunResult& r : rep.runs) {
    const auto vr = rep.vs_resident(r);
    char vs_res[32];
    if (vr) std::snprintf(vs_res, sizeof vs_res, "%.3f", *vr);
    else std::snprintf(vs_res, sizeof vs_res, "-");
    const double prep_model = r.prepares ? r.prepare_model_ns * 1e-3 / static_cast<double>(r.prepares) : 0;
    const double prep_real = r.prepares ? r.prepare_wall_ns * 1e-3 / static_cast<double>(r.prepares) : 0;
    char prep1[32], prep2[32];
    if (r.prepares == 0) {
      std::snprintf(prep1, sizeof prep1, "-");
      std::snprintf(prep2, sizeof prep2, "-");
    } else if (rep.modelled) {
      std::snprintf(prep1, sizeof prep1, "%.1f", prep_model);
      std::snprintf(prep2, sizeof prep2, "%.1f", prep_real);
    } else {
      std::snprintf(prep1, sizeof prep1, "%.1f", prep_real);
      std::snprintf(prep2, sizeof prep2, " ");
    }
    std::fprintf(out, "%-9s %-12s %9.2f %8s %8.3f %6.1f%% %8.2f %9.2f %9s %9s %9.2f\n", r.provider.c_str(),
                 r.staging.c_str(), r.tokens_per_second(), vs_res, rep.vs_pcie(r), 100.0 * r.hit_rate(),
                 r.misses_per_token(), r.pcie_bytes_per_token() / 1e6, prep1, prep2, r.cold_start_ns * 1e-6);
  }
  std::fprintf(out,
               "\nvs_res = tok/s / all-resident tok/s; vs_pcie = (PCIe bytes per token / ceiling) / time per token.\n");
  if (rep.modelled) {
    std::fprintf(out,
                 "Times, tok/s and prep_us(model) are MODELLED on SimRuntime; hit rates, misses and bytes are exact for\n"
                 "this routing; prep_us(realCPU) is the real wall clock of prepare() on this CPU, SimRuntime's own\n"
                 "bookkeeping (race detector) included.\n");
  }
  for (const std::string& n : rep.notes) std::fprintf(out, "%s\n", n.c_str());
  for (const RunResult& r : rep.runs) {
    if (r.output_checked && r.check_failures != 0) {
      std::fprintf(out, "CHECK FAILED: %s/%s: %llu consumer checks failed\n", r.provider.c_str(), r.staging.c_str(),
                   static_cast<unsigned long long>(r.check_failures));
    }
  }
}

namespace detail {
inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}
inline std::string host_name() {
#if defined(__unix__) || defined(__APPLE__)
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) == 0) return buf;
#endif
  return "unknown";
}
inline std::string iso_date() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::tm tm{};
#if defined(__unix__) || defined(__APPLE__)
  localtime_r(&t, &tm);
#else
  tm = *std::localtime(&t);
#endif
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S%z", &tm);
  return buf;
}
}  // namespace detail

// Google Benchmark's JSON schema (context + benchmarks[] with name, run_type, iterations,
// real_time, cpu_time, time_unit and user counters as extra numeric fields), written by a plain
// driver: the decode loop is one long stateful run per configuration, which Google Benchmark's
// repeat-until-stable iteration model does not fit. Tools that read GB JSON (compare.py, plot.py)
// read this. Times are per token, in milliseconds.
inline void write_json(std::ostream& out, const Report& rep, const std::string& executable) {
  using detail::json_number;
  const Model& m = rep.model;
  out << "{\n  \"context\": {\n"
      << "    \"date\": " << json_string(detail::iso_date()) << ",\n"
      << "    \"host_name\": " << json_string(detail::host_name()) << ",\n"
      << "    \"executable\": " << json_string(executable) << ",\n"
      << "    \"num_cpus\": " << std::max(1u, std::thread::hardware_concurrency()) << ",\n"
      << "    \"mhz_per_cpu\": 0,\n    \"cpu_scaling_enabled\": false,\n    \"caches\": [],\n    \"load_avg\": [],\n"
      << "    \"library_build_type\": \"release\",\n"
      << "    \"expert_cache_mode\": " << json_string(rep.modelled ? "modelled" : "measured") << ",\n"
      << "    \"expert_cache_label\": " << json_string(mode_label(rep.modelled)) << ",\n"
      << "    \"runtime\": " << json_string(rep.runtime_name) << ",\n"
      << "    \"pcie_ceiling_bytes_per_second\": " << json_number(rep.pcie_ceiling_bytes_per_s) << ",\n"
      << "    \"routing\": " << json_string(rep.routing) << ",\n"
      << "    \"model\": {\"layers\": " << m.layers << ", \"experts\": " << m.experts << ", \"top_k\": " << m.top_k
      << ", \"hidden\": " << m.layout.hidden << ", \"intermediate\": " << m.layout.intermediate
      << ", \"expert_bytes\": " << m.expert_bytes() << ", \"capacity\": " << m.capacity << ", \"batch\": " << m.batch
      << ", \"steps\": " << rep.steps << ", \"warmup\": " << rep.warmup << "}";
  if (!rep.cost_model_json.empty()) out << ",\n    \"cost_model\": " << rep.cost_model_json;
  out << "\n  },\n  \"benchmarks\": [";
  for (std::size_t i = 0; i < rep.runs.size(); ++i) {
    const RunResult& r = rep.runs[i];
    const std::string name =
        r.provider == "resident" ? std::string("decode/resident") : "decode/" + r.provider + "/" + r.staging;
    const double ms_per_token = r.seconds_per_token() * 1e3;
    const auto vr = rep.vs_resident(r);
    out << (i ? ",\n" : "\n") << "    {\"name\": " << json_string(name) << ", \"family_index\": " << i
        << ", \"per_family_instance_index\": 0, \"run_name\": " << json_string(name)
        << ", \"run_type\": \"iteration\", \"repetitions\": 1, \"repetition_index\": 0, \"threads\": 1"
        << ", \"iterations\": " << r.tokens << ", \"real_time\": " << json_number(ms_per_token)
        << ", \"cpu_time\": " << json_number(ms_per_token) << ", \"time_unit\": \"ms\""
        << ", \"label\": " << json_string(mode_label(r.modelled)) << ", \"provider\": " << json_string(r.provider)
        << ", \"staging\": " << json_string(r.staging) << ", \"tokens_per_second\": " << json_number(r.tokens_per_second())
        << ", \"hit_rate\": " << json_number(r.hit_rate()) << ", \"misses_per_token\": " << json_number(r.misses_per_token())
        << ", \"pcie_bytes_per_token\": " << json_number(r.pcie_bytes_per_token())
        << ", \"copies_per_token\": "
        << json_number(r.tokens ? static_cast<double>(r.copies) / static_cast<double>(r.tokens) : 0)
        << ", \"host_us_per_prepare\": "
        << json_number(r.prepares ? r.prepare_wall_ns * 1e-3 / static_cast<double>(r.prepares) : 0)
        << ", \"host_us_per_prepare_is_real\": 1";
    if (rep.modelled) {
      out << ", \"modelled_host_us_per_prepare\": "
          << json_number(r.prepares ? r.prepare_model_ns * 1e-3 / static_cast<double>(r.prepares) : 0);
    }
    out << ", \"vs_resident\": " << (vr ? json_number(*vr) : std::string("null"))
        << ", \"vs_pcie_bound\": " << json_number(rep.vs_pcie(r))
        << ", \"pcie_bound_tokens_per_second\": "
        << json_number(rep.pcie_bound_seconds_per_token(r) > 0 ? 1.0 / rep.pcie_bound_seconds_per_token(r) : 0)
        << ", \"cold_start_ms\": " << json_number(r.cold_start_ns * 1e-6) << ", \"capacity\": " << m.capacity
        << ", \"batch\": " << m.batch << ", \"check_failures\": " << r.check_failures << "}";
  }
  out << "\n  ]\n}\n";
}

// ---- progress -------------------------------------------------------------------------------

class Progress {
 public:
  Progress(bool enabled, bool tty) : enabled_(enabled), tty_(tty) {}
  void run_started(std::size_t index, std::size_t total, const std::string& what) {
    index_ = index;
    total_ = total;
    what_ = what;
    last_ = {};
    if (enabled_) line(0, 0, true);
  }
  void step(std::int32_t done, std::int32_t total) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (done != total && now - last_ < std::chrono::milliseconds(tty_ ? 200 : 2000)) return;
    last_ = now;
    line(done, total, false);
  }
  void note(const std::string& text) {
    if (!enabled_) return;
    std::fprintf(stderr, "%sexpert-cache-bench: %s%s", tty_ ? "\r\033[K" : "", text.c_str(), tty_ ? "" : "\n");
    std::fflush(stderr);
  }
  void finish() {
    if (enabled_ && tty_) std::fputs("\r\033[K", stderr);
  }

 private:
  void line(std::int32_t done, std::int32_t total, bool start) {
    if (start) {
      std::fprintf(stderr, "%sexpert-cache-bench: [%zu/%zu] %s%s", tty_ ? "\r\033[K" : "", index_ + 1, total_,
                   what_.c_str(), tty_ ? "" : "\n");
    } else {
      std::fprintf(stderr, "%sexpert-cache-bench: [%zu/%zu] %s step %d/%d%s", tty_ ? "\r\033[K" : "", index_ + 1,
                   total_, what_.c_str(), done, total, tty_ ? "" : "\n");
    }
    std::fflush(stderr);
  }
  bool enabled_;
  bool tty_;
  std::size_t index_ = 0, total_ = 0;
  std::string what_;
  std::chrono::steady_clock::time_point last_{};
};

inline bool stderr_is_tty() {
#if defined(__unix__) || defined(__APPLE__)
  return isatty(STDERR_FILENO) != 0;
#else
  return false;
#endif
}

// One configuration of the run: a provider and (for caches) a staging policy.
struct RunConfig {
  std::string provider;
  std::string staging;
};

inline std::vector<RunConfig> run_configs(const BenchArgs& a, const std::vector<std::string>& staging) {
  std::vector<RunConfig> out;
  for (const std::string& p : a.providers) {
    if (p == "resident") continue;
    for (const std::string& s : staging) out.push_back({p, s});
  }
  // The all-resident run goes first: the ratios need it, and it is the cheapest.
  if (std::find(a.providers.begin(), a.providers.end(), "resident") != a.providers.end())
    out.insert(out.begin(), RunConfig{"resident", "-"});
  return out;
}

// ---- the MODELLED path: SimRuntime with a cost model ------------------------------------------

// Constants of the model (nanoseconds, bytes/ns). Sources: /work/shared/limits/h200.md (H200,
// PCIe Gen5 x16, CUDA 13) where marked [h200.md]; the rest are stated assumptions.
struct SimCosts {
  double pcie_bytes_per_ns = 55.0;        // [h200.md] one big pinned H2D copy: 55.0-55.4 GB/s
  double copy_device_ns = 3000.0;         // per cudaMemcpyAsync on the copy engine; fits [h200.md] 91.6% for one
                                          // 1.69 MiB copy and 56-63% for six per-tensor copies of an expert
  double batch_copy_device_ns = 800.0;    // per descriptor of a cudaMemcpyBatchAsync; fits [h200.md] 97.2%
                                          // (64 x 1.69 MiB) and 88-89% (tensor-major rows)
  double copy_host_ns = 2100.0;           // [h200.md] host cost of one cudaMemcpyAsync
  double batch_host_ns_per_copy = 4000.0; // [h200.md] host cost of cudaMemcpyBatchAsync, per copy
  double event_host_ns = 175.0;           // [h200.md] record + wait = 0.35 us per pair
  double launch_host_ns = 2500.0;         // assumption: host cost of one kernel launch
  double consumer_fixed_ns = 5000.0;      // assumption: launch latency + tail of the MoE consumer
  double hbm_bytes_per_ns = 1570.0;       // fit to the measured consumer (docs/benchmarks.md, H200 at a8e2c2f):
                                          // 10 experts (17.7 MB) in 16.3 us = 5 us + 17.7 MB / 1.57 TB/s
  [[nodiscard]] std::string json() const {
    using detail::json_number;
    return "{\"pcie_bytes_per_ns\": " + json_number(pcie_bytes_per_ns) + ", \"copy_device_ns\": " + json_number(copy_device_ns) +
           ", \"batch_copy_device_ns\": " + json_number(batch_copy_device_ns) + ", \"copy_host_ns\": " +
           json_number(copy_host_ns) + ", \"batch_host_ns_per_copy\": " + json_number(batch_host_ns_per_copy) +
           ", \"event_host_ns\": " + json_number(event_host_ns) + ", \"launch_host_ns\": " + json_number(launch_host_ns) +
           ", \"consumer_fixed_ns\": " + json_number(consumer_fixed_ns) + ", \"hbm_bytes_per_ns\": " +
           json_number(hbm_bytes_per_ns) + "}";
  }
};

// SimRuntime with per-call costs: a thin `runtime` that sets SimRuntime's cost model before
// each forwarded call, so every call kind pays its own host cost (SimCostModel has one) and
// every copy its real duration. Weights are stored scaled down (SimRuntime really copies
// bytes); copies out of a registered weight pool are charged for the bytes they stand for.
class ModelledSim {
 public:
  using Stream = SimRuntime::Stream;
  using Event = SimRuntime::Event;

  explicit ModelledSim(const SimCosts& costs) : sim_(options()), costs_(costs) {}
  ModelledSim(const ModelledSim&) = delete;
  ModelledSim& operator=(const ModelledSim&) = delete;

  [[nodiscard]] SimRuntime& sim() noexcept { return sim_; }
  [[nodiscard]] const SimCosts& costs() const noexcept { return costs_; }

  // [p, p + bytes) holds weights scaled down: a copy of n bytes from it stands for n * factor.
  void add_weight_pool(const void* p, std::size_t bytes, double factor) {
    pools_[reinterpret_cast<std::uintptr_t>(p)] = Pool{bytes, factor};
  }

  Result<Stream> create_stream() noexcept { return sim_.create_stream(); }
  void destroy_stream(Stream s) noexcept { sim_.destroy_stream(s); }
  Result<Event> create_event() noexcept { return sim_.create_event(); }
  void destroy_event(Event e) noexcept { sim_.destroy_event(e); }
  Status record(Event e, Stream s) noexcept {
    set(costs_.event_host_ns, 0.0);
    return sim_.record(e, s);
  }
  Status wait(Stream s, Event e) noexcept {
    set(costs_.event_host_ns, 0.0);
    return sim_.wait(s, e);
  }
  Result<bool> query(Event e) noexcept { return sim_.query(e); }
  Status synchronize(Event e) noexcept { return sim_.synchronize(e); }
  Status synchronize(Stream s) noexcept { return sim_.synchronize(s); }
  Result<bool> is_capturing(Stream s) noexcept { return sim_.is_capturing(s); }
  void host_access(const void* p, std::size_t n, AccessMode mode) noexcept { sim_.host_access(p, n, mode); }

  Status copy_async(void* dst, const void* src, std::size_t n, Stream s) noexcept {
    bool weights = false;
    const double real = real_bytes(src, n, weights);
    set(costs_.copy_host_ns, costs_.copy_device_ns + real / costs_.pcie_bytes_per_ns);
    Status st = sim_.copy_async(dst, src, n, s);
    if (st && n != 0) count(real, weights, 1);
    return st;
  }

  Status copy_batch_async(std::span<const CopyDesc> copies, Stream s) noexcept {
    double real = 0, weight_bytes = 0;
    std::size_t n = 0;
    for (const CopyDesc& c : copies) {
      if (c.bytes == 0) continue;
      bool weights = false;
      const double b = real_bytes(c.src, c.bytes, weights);
      real += b;
      if (weights) weight_bytes += b;
      ++n;
    }
    if (n == 0) return sim_.copy_batch_async(copies, s);
    // SimRuntime charges latency per descriptor: spread the transfer time over them.
    set(costs_.batch_host_ns_per_copy * static_cast<double>(n),
        costs_.batch_copy_device_ns + real / costs_.pcie_bytes_per_ns / static_cast<double>(n));
    Status st = sim_.copy_batch_async(copies, s);
    if (st) {
      weight_bytes_ += weight_bytes;
      other_bytes_ += real - weight_bytes;
      copies_ += n;
    }
    return st;
  }

  // A kernel: `device_ns` on its stream, launch_host_ns on the host.
  Status launch(Stream s, std::span<const Access> accesses, std::function<void()> body, double device_ns) noexcept {
    set(costs_.launch_host_ns, 0.0);
    sim_.set_next_duration_ns(device_ns);
    return sim_.launch(s, accesses, std::move(body));
  }

  Result<void*> allocate(std::size_t bytes, MemoryKind kind) noexcept { return sim_.allocate(bytes, kind); }
  Status deallocate(void* p) noexcept {
    pools_.erase(reinterpret_cast<std::uintptr_t>(p));
    return sim_.deallocate(p);
  }

  [[nodiscard]] double weight_bytes() const noexcept { return weight_bytes_; }
  [[nodiscard]] double other_bytes() const noexcept { return other_bytes_; }
  [[nodiscard]] std::uint64_t copies() const noexcept { return copies_; }
  [[nodiscard]] double now_ns() const noexcept { return sim_.host_time_ns(); }

 private:
  struct Pool {
    std::size_t bytes;
    double factor;
  };
  static SimRuntime::Options options() {
    SimRuntime::Options o;
    o.memory_limit = std::size_t{16} << 30;  // scaled pools: ~60 MB for the default model
    o.max_races = 64;
    return o;
  }
  void set(double host_ns, double latency_ns) noexcept {
    SimCostModel c;
    c.host_call_ns = host_ns;
    c.copy_latency_ns = latency_ns;
    c.copy_bytes_per_ns = 0.0;  // the latency carries the whole duration
    sim_.set_cost_model(c);
  }
  double real_bytes(const void* src, std::size_t n, bool& weights) const noexcept {
    const auto p = reinterpret_cast<std::uintptr_t>(src);
    auto it = pools_.upper_bound(p);
    if (it != pools_.begin()) {
      --it;
      if (p < it->first + it->second.bytes) {
        weights = true;
        return static_cast<double>(n) * it->second.factor;
      }
    }
    weights = false;
    return static_cast<double>(n);
  }
  void count(double real, bool weights, std::uint64_t copies) noexcept {
    (weights ? weight_bytes_ : other_bytes_) += real;
    copies_ += copies;
  }

  SimRuntime sim_;
  SimCosts costs_;
  std::map<std::uintptr_t, Pool> pools_;
  double weight_bytes_ = 0;
  double other_bytes_ = 0;
  std::uint64_t copies_ = 0;
};

static_assert(allocating_runtime<ModelledSim>);
static_assert(batching_runtime<ModelledSim>);

// The layout SimRuntime stores: each real tensor size divided by `scale` (rounded up, at least
// the real size for tiny tensors such as the 4-byte global scales).
inline ExplicitLayout scaled_layout(const ExpertTensorBytes& real, std::int64_t scale) {
  ExplicitLayout l;
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    const std::size_t b = real[t].bytes_per_expert;
    std::size_t s = (b + static_cast<std::size_t>(scale) - 1) / static_cast<std::size_t>(scale);
    if (b <= 16) s = b;
    l.bytes[t] = TensorBytes{real[t].name, s};
  }
  return l;
}

// Byte `i` of tensor `t` of expert `e` in layer `layer`: what the host pools hold, so the
// consumer can check it reads the expert the map names.
inline std::uint8_t pattern_byte(std::int32_t layer, std::int32_t e, std::size_t t, std::size_t i) noexcept {
  const std::uint64_t h = (static_cast<std::uint64_t>(layer) * 0x9E3779B97F4A7C15ull) ^
                          (static_cast<std::uint64_t>(e) * 0xC2B2AE3D27D4EB4Full) ^ (t * 0x165667B19E3779F9ull) ^ i;
  return static_cast<std::uint8_t>((h ^ (h >> 29) ^ (h >> 47)) & 0xFF);
}

template <class Cache>
void fill_sim_pools(Cache& cache, ModelledSim& rt, std::int32_t layer, const ExpertTensorBytes& real) {
  auto& st = cache.storage();
  const std::int32_t experts = cache.options().num_experts;
  if constexpr (std::remove_reference_t<decltype(st)>::expert_contiguous) {
    std::size_t real_blob = 0;
    for (const auto& t : real) real_blob += (t.bytes_per_expert + 15) / 16 * 16;
    rt.add_weight_pool(st.host_expert(0), st.blob_bytes() * static_cast<std::size_t>(experts),
                       static_cast<double>(real_blob) / static_cast<double>(st.blob_bytes()));
  } else {
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const std::size_t b = st.tensors()[t].bytes_per_expert;
      if (b == 0) continue;
      rt.add_weight_pool(st.host_tensor(t, 0), b * static_cast<std::size_t>(experts),
                         static_cast<double>(real[t].bytes_per_expert) / static_cast<double>(b));
    }
  }
  for (std::int32_t e = 0; e < experts; ++e)
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const std::size_t b = st.tensors()[t].bytes_per_expert;
      std::uint8_t* p = reinterpret_cast<std::uint8_t*>(st.host_tensor(t, e));
      for (std::size_t i = 0; i < b; ++i) p[i] = pattern_byte(layer, e, t, i);
    }
}

// One modelled run of a configuration. Cache = nullptr type (void) runs all-resident.
template <class Cache>
RunResult run_sim(const Model& m, const Routing& routing, const BenchArgs& a, const SimCosts& costs,
                  const std::string& provider, const std::string& staging, Progress& progress) {
  constexpr bool cached = !std::is_void_v<Cache>;
  ModelledSim rt(costs);
  const auto consumer = rt.create_stream().value();
  rt.sim().set_stream_name(consumer, "consumer");
  const ExpertTensorBytes real = m.layout.tensors();
  const ExplicitLayout layout = scaled_layout(real, a.sim_scale);
  const double expert_real_bytes = static_cast<double>(m.expert_bytes());

  using CacheType = std::conditional_t<cached, Cache, int>;  // int: placeholder of the resident run
  std::vector<std::unique_ptr<CacheType>> caches;
  if constexpr (cached) {
    for (std::int32_t l = 0; l < m.layers; ++l) {
      CacheOptions o;
      o.num_experts = m.experts;
      o.capacity = m.capacity;
      o.top_k = m.top_k;
      o.log = {};
      caches.push_back(std::make_unique<Cache>(rt, o, layout));
      fill_sim_pools(*caches.back(), rt, l, real);
    }
  }
  const std::size_t id_bytes = static_cast<std::size_t>(m.ids_per_forward()) * sizeof(std::int32_t);
  RuntimeBuffer<ModelledSim> ids_host(rt, id_bytes, MemoryKind::pinned_host);
  RuntimeBuffer<ModelledSim> ids_dev(rt, id_bytes, MemoryKind::device);

  RunResult r;
  r.provider = provider;
  r.staging = staging;
  r.modelled = true;
  r.output_checked = cached;
  std::uint64_t check_failures = 0;
  std::uint64_t hits0 = 0, misses0 = 0;
  double bytes0 = 0, other0 = 0;
  std::uint64_t copies0 = 0;
  double measure_start = 0;
  const std::int32_t total = routing.steps;
  std::vector<Access> accesses;
  for (std::int32_t s = 0; s < total; ++s) {
    if (s == a.warmup) {  // start of the measured steps: snapshot the counters
      measure_start = rt.now_ns();
      if constexpr (cached) {
        for (auto& c : caches) {
          hits0 += c->stats().hits;
          misses0 += c->stats().misses;
        }
      }
      bytes0 = rt.weight_bytes();
      other0 = rt.other_bytes();
      copies0 = rt.copies();
    }
    const bool measured = s >= a.warmup;
    const double step_start = rt.now_ns();
    for (std::int32_t l = 0; l < m.layers; ++l) {
      // (1) routing read-back point: the host waits for the consumer stream.
      if (Status st = rt.synchronize(consumer); !st) throw Error(st);
      rt.sim().drain();
      const auto ids = routing.forward(s, l);
      rt.host_access(ids_host.data(), id_bytes, AccessMode::write);
      std::memcpy(ids_host.data(), ids.data(), id_bytes);
      if (Status st = rt.copy_async(ids_dev.data(), ids_host.data(), id_bytes, consumer); !st) throw Error(st);
      const double unique = static_cast<double>(routing.unique_count(s, l));
      const double consumer_ns = costs.consumer_fixed_ns + unique * expert_real_bytes / costs.hbm_bytes_per_ns;
      accesses.clear();
      accesses.push_back(Access{ids_dev.data(), id_bytes, AccessMode::read});
      if constexpr (cached) {
        Cache& cache = *caches[static_cast<std::size_t>(l)];
        // (2) prepare(): real wall clock and modelled host time.
        const double model0 = rt.now_ns();
        const auto t0 = std::chrono::steady_clock::now();
        Result<ForwardView> view = cache.prepare(ids, consumer);
        const auto t1 = std::chrono::steady_clock::now();
        if (!view.ok()) throw Error(view.status());
        if (measured) {
          r.prepare_wall_ns += static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
          r.prepare_model_ns += rt.now_ns() - model0;
          ++r.prepares;
        }
        // (3) the consumer: reads the forward map and each routed expert's slot, and checks
        // (when it runs) that the slot holds the expert the map names.
        const ForwardView v = view.value();
        const std::int32_t experts = m.experts;
        accesses.push_back(Access{v.expert_map, static_cast<std::size_t>(experts) * sizeof(std::int32_t), AccessMode::read});
        for (const std::int32_t e : ids) {
          if (e < 0) continue;
          const std::int32_t slot = cache.forward_map_host()[static_cast<std::size_t>(e)];
          for (const SlotTensor& t : v.tensors)
            if (t.bytes != 0) accesses.push_back(Access{t.slot(slot), t.bytes, AccessMode::read});
        }
        std::vector<std::int32_t> want(ids.begin(), ids.end());
        auto body = [v, want = std::move(want), l, &check_failures] {
          for (const std::int32_t e : want) {
            if (e < 0) continue;
            const std::int32_t slot = v.expert_map[e];
            if (slot < 0) {
              ++check_failures;
              continue;
            }
            for (std::size_t t = 0; t < num_expert_tensors; ++t) {
              const SlotTensor& st = v.tensors[t];
              if (st.bytes == 0) continue;
              const auto* p = reinterpret_cast<const std::uint8_t*>(st.slot(slot));
              if (p[0] != pattern_byte(l, e, t, 0) || p[st.bytes - 1] != pattern_byte(l, e, t, st.bytes - 1)) {
                ++check_failures;
                break;
              }
            }
          }
        };
        if (Status st = rt.launch(consumer, accesses, body, consumer_ns); !st) throw Error(st);
      } else {
        if (Status st = rt.launch(consumer, accesses, {}, consumer_ns); !st) throw Error(st);
      }
    }
    if (Status st = rt.synchronize(consumer); !st) throw Error(st);
    rt.sim().drain();
    if (s == 0) r.cold_start_ns = rt.now_ns() - step_start;
    progress.step(s + 1, total);
  }
  r.time_ns = rt.now_ns() - measure_start;
  r.tokens = static_cast<std::int64_t>(a.steps) * m.batch;
  if constexpr (cached) {
    for (auto& c : caches) {
      r.hits += c->stats().hits;
      r.misses += c->stats().misses;
    }
    r.hits -= hits0;
    r.misses -= misses0;
  }
  r.pcie_bytes = rt.weight_bytes() - bytes0;
  r.map_bytes = rt.other_bytes() - other0;
  r.copies = rt.copies() - copies0;
  r.check_failures = check_failures + rt.sim().race_count();
  return r;
}

// The modelled ceiling: one 256 MiB pinned copy under the same cost model.
inline double sim_pcie_ceiling(const SimCosts& c) {
  const double bytes = 256.0 * 1048576.0;
  return bytes / ((c.copy_device_ns + bytes / c.pcie_bytes_per_ns) * 1e-9);
}

template <template <class> class Storage, class Policy>
RunResult run_sim_staging(const Model& m, const Routing& routing, const BenchArgs& a, const SimCosts& costs,
                          const RunConfig& cfg, Progress& progress) {
  if (cfg.staging == "inline")
    return run_sim<ExpertCache<Storage, Policy, Inline, ExplicitLayout, ModelledSim>>(m, routing, a, costs, cfg.provider,
                                                                                     cfg.staging, progress);
  if (cfg.staging == "copy_stream")
    return run_sim<ExpertCache<Storage, Policy, CopyStream, ExplicitLayout, ModelledSim>>(m, routing, a, costs,
                                                                                         cfg.provider, cfg.staging, progress);
  if (cfg.staging == "batched")
    return run_sim<ExpertCache<Storage, Policy, Batched, ExplicitLayout, ModelledSim>>(m, routing, a, costs, cfg.provider,
                                                                                      cfg.staging, progress);
  throw UsageError{"staging '" + cfg.staging + "' is not available on SimRuntime"};
}

inline Report run_modelled(const Model& m, const Routing& routing, const BenchArgs& a, Progress& progress) {
  const SimCosts costs;
  Report rep;
  rep.modelled = true;
  rep.runtime_name = "SimRuntime (virtual time, cost model in docs/benchmarks.md)";
  rep.pcie_ceiling_bytes_per_s = sim_pcie_ceiling(costs);
  rep.cost_model_json = costs.json();
  const std::vector<std::string> staging =
      a.staging_given ? a.staging : std::vector<std::string>{"inline", "copy_stream", "batched"};
  const std::vector<RunConfig> configs = run_configs(a, staging);
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const RunConfig& cfg = configs[i];
    progress.run_started(i, configs.size(), cfg.provider == "resident" ? std::string("resident") : cfg.provider + "/" + cfg.staging);
    if (cfg.provider == "resident") {
      rep.runs.push_back(run_sim<void>(m, routing, a, costs, "resident", "-", progress));
    } else if (cfg.provider == "row") {
      rep.runs.push_back(run_sim_staging<TensorMajorStorage, Lru>(m, routing, a, costs, cfg, progress));
    } else {
      rep.runs.push_back(run_sim_staging<ExpertMajorStorage, Lfru>(m, routing, a, costs, cfg, progress));
    }
  }
  progress.finish();
  return rep;
}

// ---- main -----------------------------------------------------------------------------------

// The CUDA build passes a measured path: nullopt = no usable device (falls back to modelled).
struct GpuHooks {
  bool built = false;
  std::function<bool(std::string& why)> device_available;
  std::function<Report(const Model&, const Routing&, const BenchArgs&, Progress&)> run;
};

inline int bench_main(int argc, char** argv, const GpuHooks& gpu) {
  BenchArgs args;
  Model model;
  Routing routing;
  bool use_gpu = false;
  try {
    args = parse_args(argc, argv);
    if (args.help) {
      print_help(stdout, gpu.built);
      return exit_ok;
    }
    if (args.runtime == RuntimeChoice::cuda && !gpu.built) {
      throw UsageError{"--runtime cuda: this build has no CUDA path (configure with -Dcuda=enabled)"};
    }
    // Arguments and the routing are validated completely before any device work.
    std::tie(model, routing) = build_model_and_routing(args);
    if (args.runtime != RuntimeChoice::sim && gpu.built) {
      std::string why;
      use_gpu = gpu.device_available(why);
      if (!use_gpu && args.runtime == RuntimeChoice::cuda) throw UsageError{"--runtime cuda: no usable CUDA device (" + why + ")"};
    }
    for (const std::string& s : args.staging) {
      if (s == "gather" && !use_gpu) {
        throw UsageError{"--staging gather needs the CUDA runtime (a GPU); the modelled run has inline, copy_stream, batched"};
      }
    }
    if (args.json_path) {  // fail before the run, not after it
      std::ofstream probe(*args.json_path, std::ios::app);
      if (!probe) throw UsageError{"--json: cannot write '" + *args.json_path + "'"};
    }
  } catch (const UsageError& e) {
    std::fprintf(stderr, "expert-cache-bench: %s\n(run with --help for usage)\n", e.message.c_str());
    return exit_usage;
  }

  const bool tty = stderr_is_tty();
  Progress progress(args.progress || tty, tty);
  Report rep;
  try {
    rep = use_gpu ? gpu.run(model, routing, args, progress) : run_modelled(model, routing, args, progress);
  } catch (const UsageError& e) {
    progress.finish();
    std::fprintf(stderr, "expert-cache-bench: %s\n", e.message.c_str());
    return exit_usage;
  } catch (const std::exception& e) {
    progress.finish();
    std::fprintf(stderr, "expert-cache-bench: run failed: %s\n", e.what());
    return exit_failure;
  }
  rep.model = model;
  rep.routing = routing.source;
  rep.steps = args.steps;
  rep.warmup = args.warmup;
  print_table(stdout, rep);
  std::fflush(stdout);
  if (args.json_path) {
    std::ofstream out(*args.json_path, std::ios::binary | std::ios::trunc);
    write_json(out, rep, argc > 0 ? argv[0] : "expert-cache-bench");
    out.close();
    if (!out) {
      std::fprintf(stderr, "expert-cache-bench: error writing '%s'\n", args.json_path->c_str());
      return exit_failure;
    }
  }
  for (const RunResult& r : rep.runs)
    if (r.check_failures != 0) return exit_failure;
  return exit_ok;
}

}  // namespace expert_cache::bench
