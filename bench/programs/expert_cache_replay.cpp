// expert-cache-replay: replay a routing trace (format v1, docs/trace_format.md) through the
// eviction policies and print hits, misses, hit rate and the ratio to OPT (Belady); with
// --prefetch, also the same runs with speculative fills of the next layer's predicted experts
// (tools/prefetch_replay.hpp, docs/prefetch.md).
// Exit codes: 0 ok, 2 bad arguments or bad trace, 1 internal error.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "../decode/cli_args.hpp"
#include "../decode/args.hpp"
#include "../decode/json_text.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/tools/prefetch_replay.hpp"
#include "expert_cache/tools/replay.hpp"
#include "expert_cache/tools/trace_generator.hpp"
#include "expert_cache/tools/trace_io.hpp"

namespace ec = expert_cache;

namespace {

constexpr int exit_usage = 2;

// The decode benchmark's default expert (expert-cache-bench: hidden x intermediate in NVFP4-Marlin),
// the size the byte metrics use unless --expert-bytes is given.
std::uint64_t default_expert_bytes() {
  const expert_cache::bench::BenchArgs defaults;
  return ec::Nvfp4Marlin{defaults.hidden, defaults.intermediate, ec::ActDtype::bf16}.bytes_per_expert();
}

void print_help(std::ostream& out) {
  out << "usage: expert-cache-replay [--trace FILE | --generate SPEC] [options]\n"
         "\n"
         "Replays an expert routing trace through ForwardPlanner with each eviction policy.\n"
         "\n"
         "  --trace FILE          trace in format v1 ('-' reads stdin); without it a generated\n"
         "                        trace is used (see --generate)\n"
         "  --generate SPEC       generated trace: 'default' or key=value,... with keys layers (8),\n"
         "                        experts (64), topk (6), steps (2000), zipf (1.0), sticky (0.4), seed (1)\n"
         "  --write-trace FILE    write the trace (generated or parsed) in format v1 to FILE\n"
         "                        ('-' = stdout) and exit without replaying\n"
         "  --capacity N[,N...]   slots per cache (default 8,16,32)\n"
         "  --policy P[,P...]     policies, or 'all' (default all); available:";
  for (const std::string& p : ec::replay_policy_names()) out << ' ' << p;
  out << "\n"
         "  --scope layer|global  layer: one cache per layer (default); global: one cache for all\n"
         "                        layers keyed layer_index*E + expert\n"
         "  --experts E           number of experts per layer (default: max id + 1); ids >= E are errors\n"
         "  --calibrate F         frequency priors: the first fraction F in (0, 1) of the steps only\n"
         "                        counts requests per expert; every policy replays the rest (cold),\n"
         "                        crf+prior / crf+pin take the counts as a bias (docs/policies.md)\n"
         "  --prior-weight W      crf+prior's bias: W x the expert's calibrated CRF (default 1)\n"
         "  --prior-pin P         crf+pin pins the most requested P x capacity experts (default 0.25)\n"
         "  --crf-half-life H     half-life of crf, crf+prior and crf+pin in forwards (default 8, the\n"
         "                        device planner's)\n"
         "  --json                print JSON instead of a table\n"
         "  --per-layer           per-layer breakdown against OPT (most useful with --scope global:\n"
         "                        which layers lose the most hits); JSON gains per_layer arrays\n"
         "  --miss-histogram S    per row, how many forwards of steps >= S missed 0, 1, 2, ... experts\n"
         "                        (the earlier steps replay as a warm-up); JSON gains forwards_by_misses\n"
         "  --prefetch P          after each forward, prefetch the next layer's predicted experts:\n"
         "                        none (default), coact (co-activation table learned online), prev\n"
         "                        (the previous token's experts), or hint:R[:W][:noise=N] (EMULATED\n"
         "                        engine hints drawn from the trace's future with recall R in (0, 1];\n"
         "                        wrong ids W: uniform (default), recent (the next layer's recent\n"
         "                        choices) or coact (its most co-activated experts); noise=N in [0, 1]:\n"
         "                        scored hints, a true id scoring 1 - N*u and a wrong one N*u, u\n"
         "                        uniform in [0, 1)); adds the columns with prefetch: hit rate, OPT's,\n"
         "                        coverage, precision, fills issued / used / wasted, extra MB per\n"
         "                        token, and with scores the hints skipped as unlikely (docs/prefetch.md)\n"
         "  --prefetch-budget N   speculative fills per forward (default: the widest forward, top_k)\n"
         "  --two-ahead R         with --prefetch hint:...: after layer L's prefetch of layer L+1, also\n"
         "                        prefetch layer L+2 from EMULATED hints of recall R in (0, 1] (the same\n"
         "                        wrong ids and noise; its own draws)\n"
         "  --precision-feedback  plan as a cache does by default: skip hint ranks whose fills were mostly\n"
         "                        wasted, but for one probe in 32 while the skipped hints turn out read\n"
         "                        (column 'imprecise'; default off: the\n"
         "                        predictor's own coverage and waste)\n"
         "  --min-score S         scored hints (hint:...:noise=N) below S in [0, 1] are not fetched\n"
         "                        (default 0.5: from there a fill is at least as likely used as wasted)\n"
         "  --expert-bytes N      bytes per expert for the byte columns (default "
      << default_expert_bytes()
      << ",\n"
         "                        the decode benchmark's default NVFP4 expert)\n"
         "  --progress            progress on stderr (default: only when stderr is a terminal)\n"
         "  --help                this text\n"
         "\n"
         "Exit status: 0 ok, 2 bad arguments or malformed trace, 1 internal error.\n";
}

using expert_cache::bench::ArgCursor;
using expert_cache::bench::UsageError;
using expert_cache::bench::json_string;
using expert_cache::bench::split_commas;

std::int32_t parse_int_arg(std::string_view flag, std::string_view text) {
  std::int64_t v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc() || r.ptr != text.data() + text.size() || v < INT32_MIN || v > INT32_MAX) {
    throw UsageError{std::string(flag) + ": '" + std::string(text) + "' is not an integer"};
  }
  return static_cast<std::int32_t>(v);
}

struct Args {
  std::optional<std::string> trace_path;
  std::optional<std::string> generate_spec;
  std::optional<std::string> write_trace;
  std::vector<std::int32_t> capacities{8, 16, 32};
  std::vector<std::string> policies;  // empty = all
  ec::ReplayScope scope = ec::ReplayScope::layer;
  std::optional<std::int32_t> experts;
  ec::PrefetchSpec prefetch;
  std::optional<std::int32_t> prefetch_budget;
  std::optional<float> min_score;
  bool precision_feedback = false;
  std::optional<double> two_ahead;  // --two-ahead R
  std::uint64_t expert_bytes = 0;
  double calibrate = 0.0;
  double prior_weight = 1.0;
  double crf_half_life = 8.0;
  double prior_pin = 0.25;
  bool json = false;
  bool per_layer = false;
  std::optional<std::int32_t> miss_histogram_from;
  bool progress = false;
  bool help = false;
};

Args parse_args(int argc, char** argv) {
  Args a;
  ArgCursor cursor(argc, argv);
  while (cursor.next()) {
    const std::string_view arg = cursor.name();
    auto value = [&] { return cursor.value(); };
    auto no_value = [&] { cursor.no_value(); };
    if (arg == "--help" || arg == "-h") {
      no_value();
      a.help = true;
    } else if (arg == "--trace") {
      a.trace_path = std::string(value());
    } else if (arg == "--generate") {
      a.generate_spec = std::string(value());
    } else if (arg == "--write-trace") {
      a.write_trace = std::string(value());
    } else if (arg == "--capacity") {
      a.capacities.clear();
      for (const std::string_view c : split_commas(value())) {
        const std::int32_t n = parse_int_arg("--capacity", c);
        if (n < 1) throw UsageError{"--capacity: " + std::to_string(n) + " is below 1"};
        a.capacities.push_back(n);
      }
    } else if (arg == "--policy") {
      a.policies.clear();
      const std::vector<std::string> known = ec::replay_policy_names();
      for (const std::string_view p : split_commas(value())) {
        if (p == "all") {
          a.policies.insert(a.policies.end(), known.begin(), known.end());
          continue;
        }
        if (std::find(known.begin(), known.end(), p) == known.end()) {
          std::string list;
          for (const std::string& k : known) list += " " + k;
          throw UsageError{"--policy: unknown policy '" + std::string(p) + "' (available:" + list + ")"};
        }
        a.policies.emplace_back(p);
      }
    } else if (arg == "--scope") {
      const std::string_view s = value();
      if (s == "layer") a.scope = ec::ReplayScope::layer;
      else if (s == "global") a.scope = ec::ReplayScope::global;
      else throw UsageError{"--scope: '" + std::string(s) + "' is not 'layer' or 'global'"};
    } else if (arg == "--experts") {
      const std::int32_t e = parse_int_arg("--experts", value());
      if (e < 1 || e > ec::trace_max_experts) {
        throw UsageError{"--experts: must be in [1, " + std::to_string(ec::trace_max_experts) + "]"};
      }
      a.experts = e;
    } else if (arg == "--prefetch") {
      ec::Result<ec::PrefetchSpec> spec = ec::parse_prefetch_spec(value());
      if (!spec.ok()) throw UsageError{"--prefetch: " + std::string(spec.status().message())};
      a.prefetch = spec.value();
    } else if (arg == "--prefetch-budget") {
      const std::int32_t n = parse_int_arg("--prefetch-budget", value());
      if (n < 0) throw UsageError{"--prefetch-budget: " + std::to_string(n) + " is negative"};
      a.prefetch_budget = n;
    } else if (arg == "--expert-bytes") {
      const std::int32_t n = parse_int_arg("--expert-bytes", value());
      if (n < 1) throw UsageError{"--expert-bytes: " + std::to_string(n) + " is below 1"};
      a.expert_bytes = static_cast<std::uint64_t>(n);
    } else if (arg == "--precision-feedback") {
      a.precision_feedback = true;
    } else if (arg == "--two-ahead") {
      const std::string v(value());
      const std::optional<double> x = ec::detail::parse_fixed_decimal(v);
      if (!x) throw UsageError{"--two-ahead: '" + v + "' is not a decimal number"};
      if (!(*x > 0.0 && *x <= 1.0)) throw UsageError{"--two-ahead: " + v + " is not a recall in (0, 1]"};
      a.two_ahead = *x;
    } else if (arg == "--min-score") {
      const std::string v(value());
      const std::optional<double> x = ec::detail::parse_fixed_decimal(v);
      if (!x) throw UsageError{"--min-score: '" + v + "' is not a decimal number"};
      if (!(*x >= 0.0 && *x <= 1.0)) throw UsageError{"--min-score: " + v + " is not in [0, 1]"};
      a.min_score = static_cast<float>(*x);
    } else if (arg == "--calibrate" || arg == "--prior-weight" || arg == "--prior-pin" || arg == "--crf-half-life") {
      const std::string v(value());
      char* end = nullptr;
      const double x = std::strtod(v.c_str(), &end);
      if (v.empty() || end != v.c_str() + v.size() || !std::isfinite(x)) {
        throw UsageError{std::string(arg) + ": '" + v + "' is not a number"};
      }
      if (arg == "--calibrate") {
        if (!(x > 0.0 && x < 1.0)) throw UsageError{"--calibrate: " + v + " is not in (0, 1)"};
        a.calibrate = x;
      } else if (arg == "--prior-weight") {
        if (x < 0.0) throw UsageError{"--prior-weight: " + v + " is negative"};
        a.prior_weight = x;
      } else if (arg == "--crf-half-life") {
        if (!(x > 0.0)) throw UsageError{"--crf-half-life: " + v + " is not above 0"};
        a.crf_half_life = x;
      } else {
        if (x < 0.0 || x > 1.0) throw UsageError{"--prior-pin: " + v + " is not in [0, 1]"};
        a.prior_pin = x;
      }
    } else if (arg == "--per-layer") {
      no_value();
      a.per_layer = true;
    } else if (arg == "--miss-histogram") {
      const std::string v(value());
      const std::int32_t step = parse_int_arg("--miss-histogram", v);
      if (step < 0) throw UsageError{"--miss-histogram: " + v + " is below 0"};
      a.miss_histogram_from = step;
    } else if (arg == "--json") {
      no_value();
      a.json = true;
    } else if (arg == "--progress") {
      no_value();
      a.progress = true;
    } else {
      throw UsageError{"unknown argument '" + std::string(arg) + "' (see --help)"};
    }
  }
  if (a.trace_path && a.generate_spec) throw UsageError{"--trace and --generate are mutually exclusive"};
  if (a.calibrate > 0.0 && a.prefetch.kind != ec::PrefetchKind::none) {
    throw UsageError{"--calibrate and --prefetch cannot be combined (the prefetch replay has no calibration part)"};
  }
  if (a.miss_histogram_from && a.prefetch.kind != ec::PrefetchKind::none) {
    throw UsageError{"--miss-histogram and --prefetch cannot be combined (the histogram counts plain replays)"};
  }
  if (a.precision_feedback && a.prefetch.kind == ec::PrefetchKind::none) {
    throw UsageError{"--precision-feedback needs --prefetch"};
  }
  if (a.two_ahead && (a.prefetch.kind != ec::PrefetchKind::hint || a.prefetch.wrong == ec::HintWrongIds::coact)) {
    throw UsageError{"--two-ahead needs --prefetch hint:R[:uniform|recent][:noise=N] (layer L+2's lists are emulated "
                     "hints with that predictor's wrong ids and noise; coact pairs consecutive layers only)"};
  }
  if (a.min_score && !ec::is_scored(a.prefetch)) {
    throw UsageError{"--min-score applies to scored hints only (--prefetch hint:R[:W]:noise=N)"};
  }
  if (a.policies.empty()) a.policies = ec::replay_policy_names();
  if (a.expert_bytes == 0) a.expert_bytes = default_expert_bytes();
  return a;
}

std::string json_number(std::optional<double> v) {
  if (!v || !std::isfinite(*v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6f", *v);
  return buf;
}

std::string ratio_text(std::optional<double> v) {
  if (!v) return "-";
  if (!std::isfinite(*v)) return "inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", *v);
  return buf;
}

// ", \"per_layer\": [...]" of one result (--per-layer): the plain replay's counts per layer.
void print_per_layer_json(std::ostream& out, const ec::ReplayReport& r, const ec::ReplayRow& row) {
  out << ", \"per_layer\": [";
  for (std::size_t l = 0; l < row.per_layer.size(); ++l) {
    out << (l ? ", " : "") << "{\"layer\": " << r.layers[l] << ", \"hits\": " << row.per_layer[l].hits
        << ", \"misses\": " << row.per_layer[l].misses;
    if (row.opt_per_layer) out << ", \"opt_hits\": " << (*row.opt_per_layer)[l].hits;
    out << "}";
  }
  out << "]";
}

// How many forwards missed m experts, m = 0, 1, ...; its mean (misses per counted forward).
double mean_misses(const std::vector<std::uint64_t>& by_misses, std::uint64_t& forwards) {
  std::uint64_t misses = 0;
  forwards = 0;
  for (std::size_t m = 0; m < by_misses.size(); ++m) {
    forwards += by_misses[m];
    misses += m * by_misses[m];
  }
  return forwards == 0 ? 0.0 : static_cast<double>(misses) / static_cast<double>(forwards);
}

void print_miss_histogram(std::ostream& out, const ec::ReplayReport& r, std::int32_t from_step) {
  out << "\nforwards by misses (steps >= " << from_step << "; share of the counted forwards)\n";
  char buf[64];
  for (const ec::ReplayRow& row : r.rows) {
    std::uint64_t forwards = 0;
    const double mean = mean_misses(row.forwards_by_misses, forwards);
    std::snprintf(buf, sizeof buf, "%-10s %8d  mean %.3f:", row.policy.c_str(), row.capacity, mean);
    out << buf;
    for (std::size_t m = 0; m < row.forwards_by_misses.size(); ++m) {
      std::snprintf(buf, sizeof buf, " %zu: %.1f%%", m,
                    forwards == 0 ? 0.0 : 100.0 * static_cast<double>(row.forwards_by_misses[m]) / static_cast<double>(forwards));
      out << buf;
    }
    out << " (" << forwards << " forwards)\n";
  }
}

void print_json(std::ostream& out, const std::string& source, const ec::ReplayReport& r, bool per_layer,
                bool miss_histogram) {
  out << "{\n  \"trace\": " << json_string(source) << ",\n  \"scope\": \"" << ec::to_string(r.scope)
      << "\",\n  \"num_experts\": " << r.num_experts << ",\n  \"num_layers\": " << r.num_layers
      << ",\n  \"cache_experts\": " << r.cache_experts << ",\n  \"caches\": " << r.caches
      << ",\n  \"records\": " << r.records << ",\n  \"forwards\": " << r.forwards
      << ",\n  \"accesses\": " << r.accesses << ",\n  \"has_opt\": " << (r.has_opt ? "true" : "false");
  if (r.replay_from_step) {
    out << ",\n  \"replay_from_step\": " << *r.replay_from_step << ",\n  \"calibration_forwards\": " << r.calibration_forwards;
  }
  out << ",\n  \"results\": [";
  for (std::size_t i = 0; i < r.rows.size(); ++i) {
    const ec::ReplayRow& row = r.rows[i];
    out << (i ? ",\n" : "\n") << "    {\"policy\": " << json_string(row.policy) << ", \"capacity\": " << row.capacity
        << ", \"hits\": " << row.counts.hits << ", \"misses\": " << row.counts.misses
        << ", \"evictions\": " << row.counts.evictions << ", \"hit_rate\": " << json_number(row.counts.hit_rate());
    if (r.has_opt) {
      out << ", \"hits_vs_opt\": " << json_number(row.hits_vs_opt)
          << ", \"misses_vs_opt\": " << json_number(row.misses_vs_opt);
    }
    if (per_layer) print_per_layer_json(out, r, row);
    if (miss_histogram) {
      out << ", \"forwards_by_misses\": [";
      for (std::size_t m = 0; m < row.forwards_by_misses.size(); ++m) out << (m ? ", " : "") << row.forwards_by_misses[m];
      out << "]";
    }
    out << "}";
  }
  out << "\n  ]\n}\n";
}

void print_table(std::ostream& out, const std::string& source, const ec::ReplayReport& r) {
  out << "trace: " << source << "\n"
      << "  " << r.records << " records, " << r.forwards << " forwards, " << r.num_layers << " layers, "
      << r.num_experts << " experts, " << r.accesses << " expert requests\n"
      << "scope: " << ec::to_string(r.scope) << " (" << r.caches << (r.caches == 1 ? " cache" : " caches")
      << " of " << r.cache_experts << " keys; capacity = slots per cache)\n";
  if (r.replay_from_step) {
    out << "calibrated on the steps before " << *r.replay_from_step << " (" << r.calibration_forwards
        << " forwards, counted only); the rows replay the rest\n";
  }
  out << "\n";
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-10s %8s %12s %12s %9s", "policy", "capacity", "hits", "misses", "hit_rate");
  out << buf;
  if (r.has_opt) {
    std::snprintf(buf, sizeof buf, " %9s %11s", "hits/OPT", "misses/OPT");
    out << buf;
  }
  out << '\n';
  std::int32_t last_capacity = -1;
  for (const ec::ReplayRow& row : r.rows) {
    if (last_capacity != -1 && row.capacity != last_capacity) out << '\n';
    last_capacity = row.capacity;
    std::snprintf(buf, sizeof buf, "%-10s %8d %12llu %12llu %8.2f%%", row.policy.c_str(), row.capacity,
                  static_cast<unsigned long long>(row.counts.hits),
                  static_cast<unsigned long long>(row.counts.misses), 100.0 * row.counts.hit_rate());
    out << buf;
    if (r.has_opt) {
      std::snprintf(buf, sizeof buf, " %9s %11s", ratio_text(row.hits_vs_opt).c_str(),
                    ratio_text(row.misses_vs_opt).c_str());
      out << buf;
    }
    out << '\n';
  }
}

// Per capacity: one line per layer with OPT's hit rate and every policy's hits / OPT, then
// for each policy the layers that lose the most hits against OPT (where a better policy or
// a larger share of a global pool would pay off).
void print_per_layer(std::ostream& out, const ec::ReplayReport& r) {
  char buf[64];
  std::size_t first = 0;
  while (first < r.rows.size()) {
    std::size_t end = first;
    while (end < r.rows.size() && r.rows[end].capacity == r.rows[first].capacity) ++end;
    const ec::ReplayRow& head = r.rows[first];
    if (!head.opt_per_layer) return;  // no OPT: nothing to compare with
    const std::vector<ec::ReplayCounts>& opt = *head.opt_per_layer;
    out << "\nper layer, capacity " << head.capacity << " (" << ec::to_string(r.scope)
        << " scope): hit rate of OPT, hits / OPT of each policy\n";
    std::snprintf(buf, sizeof buf, "%6s %9s %7s", "layer", "requests", "OPT");
    out << buf;
    for (std::size_t i = first; i < end; ++i) {
      std::snprintf(buf, sizeof buf, " %10.10s", r.rows[i].policy.c_str());
      out << buf;
    }
    out << '\n';
    for (std::size_t l = 0; l < opt.size(); ++l) {
      std::snprintf(buf, sizeof buf, "%6d %9llu %6.1f%%", r.layers[l], static_cast<unsigned long long>(opt[l].accesses()),
                    100.0 * opt[l].hit_rate());
      out << buf;
      for (std::size_t i = first; i < end; ++i) {
        const double x = opt[l].hits == 0 ? 1.0 : static_cast<double>(r.rows[i].per_layer[l].hits) /
                                                      static_cast<double>(opt[l].hits);
        std::snprintf(buf, sizeof buf, " %10.3f", x);
        out << buf;
      }
      out << '\n';
    }
    for (std::size_t i = first; i < end; ++i) {
      const ec::ReplayRow& row = r.rows[i];
      std::vector<std::size_t> order(opt.size());
      for (std::size_t l = 0; l < order.size(); ++l) order[l] = l;
      auto lost = [&](std::size_t l) {
        return static_cast<std::int64_t>(opt[l].hits) - static_cast<std::int64_t>(row.per_layer[l].hits);
      };
      std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return lost(a) > lost(b); });
      std::int64_t total = 0;
      for (std::size_t l = 0; l < opt.size(); ++l) total += lost(l);
      if (total <= 0) continue;  // OPT itself, or a policy that matches it
      out << "  " << row.policy << " loses " << total << " hits vs OPT; most at layers";
      for (std::size_t k = 0; k < std::min<std::size_t>(5, order.size()) && lost(order[k]) > 0; ++k) {
        out << ' ' << r.layers[order[k]] << " (" << lost(order[k]) << ')';
      }
      out << '\n';
    }
    first = end;
  }
}

std::string percent_text(std::optional<double> v) {
  if (!v || !std::isfinite(*v)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f%%", 100.0 * *v);
  return buf;
}

std::string ops_number(std::optional<std::uint64_t> v) { return v ? std::to_string(*v) : "null"; }

std::optional<double> hit_rate_of(const std::optional<ec::ReplayCounts>& c) {
  if (!c) return std::nullopt;
  return c->hit_rate();
}

// The prefetch header of the table and of the JSON.
std::string prefetch_scope_text(const ec::PrefetchReplayReport& p) {
  return p.plain.scope == ec::ReplayScope::layer ? "into layer L+1's own cache" : "into the shared cache";
}

// JSON with prefetch: the plain document's fields plus, per result, the prefetch ones (null on
// OPT rows, the reference), and a top-level "prefetch" object.
void print_prefetch_json(std::ostream& out, const std::string& source, const ec::PrefetchReplayReport& p,
                         bool per_layer) {
  const ec::ReplayReport& r = p.plain;
  out << "{\n  \"trace\": " << json_string(source) << ",\n  \"scope\": \"" << ec::to_string(r.scope)
      << "\",\n  \"num_experts\": " << r.num_experts << ",\n  \"num_layers\": " << r.num_layers
      << ",\n  \"cache_experts\": " << r.cache_experts << ",\n  \"caches\": " << r.caches
      << ",\n  \"records\": " << r.records << ",\n  \"forwards\": " << r.forwards
      << ",\n  \"accesses\": " << r.accesses << ",\n  \"has_opt\": " << (r.has_opt ? "true" : "false")
      << ",\n  \"prefetch\": {\"predictor\": " << json_string(ec::to_string(p.prefetch))
      << ", \"emulated\": " << (ec::is_emulated(p.prefetch) ? "true" : "false")
      << ", \"scored\": " << (ec::is_scored(p.prefetch) ? "true" : "false") << ", \"min_score\": "
      << (p.min_score ? json_number(std::optional<double>(*p.min_score)) : std::string("null"))
      << ", \"precision_feedback\": " << (p.precision_feedback ? "true" : "false")
      << ", \"two_ahead\": " << json_number(p.two_ahead) << ", \"budget\": " << p.budget
      << ", \"list_length\": " << p.list_length << ", \"expires_after\": " << p.expires_after
      << ", \"expert_bytes\": " << p.expert_bytes << ", \"tokens\": " << json_number(p.tokens) << "}"
      << ",\n  \"results\": [";
  for (std::size_t i = 0; i < p.rows.size(); ++i) {
    const ec::PrefetchRow& row = p.rows[i];
    const ec::ReplayRow& plain = r.rows[i];
    const std::optional<ec::PrefetchCounts>& sp = row.speculative;
    auto field = [&](std::uint64_t ec::PrefetchCounts::*m) {
      return sp ? std::optional<std::uint64_t>((*sp).*m) : std::nullopt;
    };
    out << (i ? ",\n" : "\n") << "    {\"policy\": " << json_string(row.policy) << ", \"capacity\": " << row.capacity
        << ", \"hits\": " << row.without.hits << ", \"misses\": " << row.without.misses
        << ", \"evictions\": " << row.without.evictions << ", \"hit_rate\": " << json_number(row.without.hit_rate());
    if (r.has_opt) {
      out << ", \"hits_vs_opt\": " << json_number(plain.hits_vs_opt)
          << ", \"misses_vs_opt\": " << json_number(plain.misses_vs_opt)
          << ", \"opt_hit_rate\": " << json_number(hit_rate_of(row.opt));
    }
    out << ", \"prefetch_hits\": " << ops_number(row.with ? std::optional<std::uint64_t>(row.with->hits) : std::nullopt)
        << ", \"prefetch_misses\": "
        << ops_number(row.with ? std::optional<std::uint64_t>(row.with->misses) : std::nullopt)
        << ", \"prefetch_hit_rate\": " << json_number(hit_rate_of(row.with))
        << ", \"coverage\": " << json_number(row.coverage) << ", \"precision\": " << json_number(row.precision)
        << ", \"predicted\": " << ops_number(field(&ec::PrefetchCounts::predicted))
        << ", \"issued\": " << ops_number(field(&ec::PrefetchCounts::issued))
        << ", \"used\": " << ops_number(field(&ec::PrefetchCounts::used))
        << ", \"wasted\": " << ops_number(field(&ec::PrefetchCounts::wasted))
        << ", \"pending\": " << ops_number(field(&ec::PrefetchCounts::pending))
        << ", \"skipped_resident\": " << ops_number(field(&ec::PrefetchCounts::skipped_resident))
        << ", \"skipped_no_victim\": " << ops_number(field(&ec::PrefetchCounts::skipped_no_victim))
        << ", \"skipped_unlikely\": " << ops_number(field(&ec::PrefetchCounts::skipped_unlikely))
        << ", \"skipped_imprecise\": " << ops_number(field(&ec::PrefetchCounts::skipped_imprecise))
        << ", \"extra_bytes_per_token\": " << json_number(row.extra_bytes_per_token)
        << ", \"bytes_per_token\": " << json_number(row.bytes_per_token_without)
        << ", \"prefetch_bytes_per_token\": " << json_number(row.bytes_per_token_with);
    if (per_layer) print_per_layer_json(out, r, plain);
    out << "}";
  }
  out << "\n  ]\n}\n";
}

void print_prefetch_table(std::ostream& out, const std::string& source, const ec::PrefetchReplayReport& p) {
  const ec::ReplayReport& r = p.plain;
  out << "trace: " << source << "\n"
      << "  " << r.records << " records, " << r.forwards << " forwards, " << r.num_layers << " layers, "
      << r.num_experts << " experts, " << r.accesses << " expert requests\n"
      << "scope: " << ec::to_string(r.scope) << " (" << r.caches << (r.caches == 1 ? " cache" : " caches")
      << " of " << r.cache_experts << " keys; capacity = slots per cache)\n"
      << "prefetch: " << ec::to_label(p.prefetch) << ": after each forward of layer L, up to " << p.budget
      << " speculative fills of layer L+1's predicted experts " << prefetch_scope_text(p) << " (unused after "
      << p.expires_after << (p.expires_after == 1 ? " forward" : " forwards") << " = wasted)\n";
  if (p.min_score) {
    char line[160];
    std::snprintf(line, sizeof line,
                  "  scored hints: highest score first, those below min_score %g skipped (column 'unlikely')\n",
                  static_cast<double>(*p.min_score));
    out << line;
  }
  if (p.two_ahead) {
    char line[200];
    std::snprintf(line, sizeof line,
                  "  two layers ahead: then up to %d fills of layer L+2's EMULATED hints of recall %g (the same wrong "
                  "ids and noise)\n",
                  p.budget, *p.two_ahead);
    out << line;
  }
  if (p.precision_feedback) {
    out << "  precision feedback: hint ranks whose fills were mostly wasted skipped but for one probe in 32 "
           "while the skipped hints turn out read (column 'imprecise')\n";
  }
  char buf[320];
  std::snprintf(buf, sizeof buf, "  bytes: %llu per expert, %.6g tokens (records / layers)\n\n",
                static_cast<unsigned long long>(p.expert_bytes), p.tokens);
  out << buf;
  std::snprintf(buf, sizeof buf, "%-10s %8s %12s %9s", "policy", "capacity", "misses", "hit_rate");
  out << buf;
  if (r.has_opt) {
    std::snprintf(buf, sizeof buf, " %9s %9s", "hits/OPT", "OPT_rate");
    out << buf;
  }
  const bool scored = p.min_score.has_value();
  std::snprintf(buf, sizeof buf, " | %9s %9s %9s %10s %10s %10s %11s %11s", "+prefetch", "coverage", "precision",
                "issued", "used", "wasted", "extraMB/tok", "MB/tok(pf)");
  out << buf;
  if (scored) {
    std::snprintf(buf, sizeof buf, " %10s", "unlikely");
    out << buf;
  }
  if (p.precision_feedback) {
    std::snprintf(buf, sizeof buf, " %10s", "imprecise");
    out << buf;
  }
  out << '\n';
  std::int32_t last_capacity = -1;
  for (std::size_t i = 0; i < p.rows.size(); ++i) {
    const ec::PrefetchRow& row = p.rows[i];
    if (last_capacity != -1 && row.capacity != last_capacity) out << '\n';
    last_capacity = row.capacity;
    std::snprintf(buf, sizeof buf, "%-10s %8d %12llu %8.2f%%", row.policy.c_str(), row.capacity,
                  static_cast<unsigned long long>(row.without.misses), 100.0 * row.without.hit_rate());
    out << buf;
    if (r.has_opt) {
      std::snprintf(buf, sizeof buf, " %9s %9s", ratio_text(r.rows[i].hits_vs_opt).c_str(),
                    percent_text(hit_rate_of(row.opt)).c_str());
      out << buf;
    }
    auto count = [&](std::uint64_t ec::PrefetchCounts::*m) {
      return row.speculative ? std::to_string((*row.speculative).*m) : std::string("-");
    };
    auto mb = [](std::optional<double> v) {
      if (!v) return std::string("-");
      char b[32];
      std::snprintf(b, sizeof b, "%.3f", *v / 1e6);
      return std::string(b);
    };
    std::snprintf(buf, sizeof buf, " | %9s %9s %9s %10s %10s %10s %11s %11s", percent_text(hit_rate_of(row.with)).c_str(),
                  percent_text(row.coverage).c_str(), percent_text(row.precision).c_str(),
                  count(&ec::PrefetchCounts::issued).c_str(), count(&ec::PrefetchCounts::used).c_str(),
                  count(&ec::PrefetchCounts::wasted).c_str(), mb(row.extra_bytes_per_token).c_str(),
                  mb(row.bytes_per_token_with).c_str());
    out << buf;
    if (scored) {
      std::snprintf(buf, sizeof buf, " %10s", count(&ec::PrefetchCounts::skipped_unlikely).c_str());
      out << buf;
    }
    if (p.precision_feedback) {
      std::snprintf(buf, sizeof buf, " %10s", count(&ec::PrefetchCounts::skipped_imprecise).c_str());
      out << buf;
    }
    out << '\n';
  }
  if (ec::is_emulated(p.prefetch)) {
    out << "\n(" << ec::to_string(p.prefetch)
        << " is EMULATED: hints drawn from the trace's own future at the given recall"
        << (ec::is_scored(p.prefetch) ? ", scores drawn with the given noise" : "") << ", not a real predictor)\n";
  }
}

bool stderr_is_tty() {
#if defined(__unix__) || defined(__APPLE__)
  return isatty(STDERR_FILENO) != 0;
#else
  return false;
#endif
}

int fail(const ec::ToolStatus& st) {
  std::cerr << "expert-cache-replay: " << st.to_string() << '\n';
  return st.code() == ec::ToolErrorCode::library && st.library_code() == ec::ErrorCode::internal ? 1 : exit_usage;
}

int run(int argc, char** argv) {
  Args args;
  try {
    args = parse_args(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "expert-cache-replay: " << e.message << "\n(run with --help for usage)\n";
    return exit_usage;
  }
  if (args.help) {
    print_help(std::cout);
    return 0;
  }

  ec::Trace trace;
  std::string source;
  const ec::ParseOptions parse_options{args.experts};
  if (args.trace_path) {
    source = *args.trace_path;
    ec::ToolResult<ec::Trace> r = *args.trace_path == "-" ? ec::parse_trace(std::cin, parse_options)
                                                      : ec::load_trace(*args.trace_path, parse_options);
    if (!r.ok()) {
      // load_trace already names the file; stdin gets its name here.
      if (*args.trace_path == "-") return fail(r.status().with_prefix("<stdin>"));
      return fail(r.status());
    }
    trace = std::move(r).value();
  } else {
    ec::ToolResult<ec::GeneratorSpec> spec = ec::parse_generator_spec(args.generate_spec.value_or("default"));
    if (!spec.ok()) return fail(spec.status());
    source = "generated:" + args.generate_spec.value_or("default");
    trace = ec::generate_trace(spec.value());
    if (args.experts) {
      if (*args.experts < trace.num_experts) {
        return fail(ec::Status(ec::ErrorCode::expert_out_of_range,
                               "--experts " + std::to_string(*args.experts) + " is below the generated trace's " +
                                   std::to_string(trace.num_experts) + " experts"));
      }
      trace.num_experts = *args.experts;
    }
  }

  if (args.write_trace) {
    const std::string comment = "source: " + source;
    if (*args.write_trace == "-") {
      ec::write_trace(std::cout, trace, comment);
      std::cout.flush();
      return std::cout ? 0 : fail(ec::ToolStatus(ec::ToolErrorCode::io_error, "error writing the trace to stdout"));
    }
    std::ofstream out(*args.write_trace, std::ios::binary);
    if (!out) return fail(ec::ToolStatus(ec::ToolErrorCode::io_error, "cannot create '" + *args.write_trace + "'"));
    ec::write_trace(out, trace, comment);
    out.close();
    if (!out) return fail(ec::ToolStatus(ec::ToolErrorCode::io_error, "error writing '" + *args.write_trace + "'"));
    return 0;
  }

  ec::ReplayOptions options;
  options.scope = args.scope;
  options.capacities = args.capacities;
  options.policies = args.policies;
  options.calibrate = args.calibrate;
  options.histogram_from_step = args.miss_histogram_from.value_or(0);
  options.prior_weight = args.prior_weight;
  options.prior_pin = args.prior_pin;
  options.crf_half_life = args.crf_half_life;
  const bool tty = stderr_is_tty();
  const bool show_progress = args.progress || tty;
  if (show_progress) {
    options.progress_every = 1u << 15;
    // On a terminal one line is redrawn; into a file or pipe each report is its own line.
    options.progress = [tty](const ec::ReplayProgress& p) {
      std::fprintf(stderr, "%sreplay: %-6.*s capacity %-6d %llu/%llu forwards (%3.0f%%)%s", tty ? "\r" : "",
                   static_cast<int>(p.policy.size()), p.policy.data(), p.capacity,
                   static_cast<unsigned long long>(p.done), static_cast<unsigned long long>(p.total),
                   p.total ? 100.0 * static_cast<double>(p.done) / static_cast<double>(p.total) : 100.0,
                   tty ? "" : "\n");
      std::fflush(stderr);
    };
  }
  if (args.prefetch.kind != ec::PrefetchKind::none) {
    ec::PrefetchReplayOptions po;
    po.scope = options.scope;
    po.capacities = options.capacities;
    po.policies = options.policies;
    po.prefetch = args.prefetch;
    po.budget = args.prefetch_budget;
    if (args.min_score) po.min_score = *args.min_score;
    po.precision_feedback = args.precision_feedback;
    po.two_ahead = args.two_ahead;
    po.expert_bytes = args.expert_bytes;
    po.progress = options.progress;
    po.progress_every = options.progress_every;
    ec::Result<ec::PrefetchReplayReport> pr = ec::replay_with_prefetch(trace, po);
    if (tty && show_progress) std::fputs("\r\033[K", stderr);
    if (!pr.ok()) {
      const ec::Status& st = pr.status();
      if (args.trace_path && st.code() == ec::ErrorCode::too_many_experts) {
        return fail(ec::ToolStatus(st).with_prefix(*args.trace_path));
      }
      return fail(st);
    }
    if (args.json) {
      print_prefetch_json(std::cout, source, pr.value(), args.per_layer);
    } else {
      print_prefetch_table(std::cout, source, pr.value());
      if (args.per_layer) print_per_layer(std::cout, pr.value().plain);
    }
    std::cout.flush();
    return std::cout ? 0 : 1;
  }
  ec::Result<ec::ReplayReport> report = ec::replay(trace, options);
  if (tty && show_progress) std::fputs("\r\033[K", stderr);  // clear the progress line
  if (!report.ok()) {
    const ec::Status& st = report.status();
    if (args.trace_path && st.code() == ec::ErrorCode::too_many_experts) {
      return fail(ec::ToolStatus(st).with_prefix(*args.trace_path));
    }
    return fail(st);
  }
  if (args.json) {
    print_json(std::cout, source, report.value(), args.per_layer, args.miss_histogram_from.has_value());
  } else {
    print_table(std::cout, source, report.value());
    if (args.miss_histogram_from) print_miss_histogram(std::cout, report.value(), *args.miss_histogram_from);
    if (args.per_layer) print_per_layer(std::cout, report.value());
  }
  std::cout.flush();
  return std::cout ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "expert-cache-replay: internal error: " << e.what() << '\n';
    return 1;
  } catch (...) {
    std::cerr << "expert-cache-replay: internal error\n";
    return 1;
  }
}
