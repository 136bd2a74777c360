#pragma once
// expert-cache-bench: the report as Google-Benchmark-compatible JSON (--json). Host-only.
#include <cmath>
#include <cstdio>
#include <ctime>
#include <ostream>
#include <string>
#include <thread>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "json_text.hpp"
#include "report.hpp"

namespace expert_cache::bench {

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
    std::string name =
        r.provider == "resident" ? std::string("decode/resident") : "decode/" + r.label() + "/" + r.staging;
    if (r.is_lookahead_row()) name += "/prefetch:" + r.prefetch;
    const double ms_per_token = r.seconds_per_token() * 1e3;
    const auto vr = rep.vs_resident(r);
    out << (i ? ",\n" : "\n") << "    {\"name\": " << json_string(name) << ", \"family_index\": " << i
        << ", \"per_family_instance_index\": 0, \"run_name\": " << json_string(name)
        << ", \"run_type\": \"iteration\", \"repetitions\": 1, \"repetition_index\": 0, \"threads\": 1"
        << ", \"iterations\": " << r.tokens << ", \"real_time\": " << json_number(ms_per_token)
        << ", \"cpu_time\": " << json_number(ms_per_token) << ", \"time_unit\": \"ms\""
        << ", \"label\": " << json_string(mode_label(r.modelled)) << ", \"provider\": " << json_string(r.provider)
        << ", \"staging\": " << json_string(r.staging)
        << (r.device_policy.empty() ? std::string() : ", \"device_policy\": " + json_string(r.device_policy)) << ", \"tokens_per_second\": " << json_number(r.tokens_per_second())
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
        << ", \"batch\": " << m.batch << ", \"host_syncs_per_token\": " << json_number(r.host_syncs_per_token())
        << ", \"check_failures\": " << r.check_failures;
    if (!r.prefetch.empty()) {  // --prefetch rows only: the output without it is unchanged
      out << ", \"prefetch\": " << json_string(r.prefetch)
          << ", \"prefetch_label\": " << json_string(prefetch_label(r.prefetch))
          << ", \"prefetch_emulated\": " << (prefetch_is_emulated(r.prefetch) ? "true" : "false")
          << ", \"prefetch_budget\": " << rep.prefetch_budget
          << ", \"prefetch_at\": " << json_string(r.prefetch_at)
          << ", \"speculative_issued_per_token\": " << json_number(r.per_token(r.speculative_issued))
          << ", \"speculative_used_per_token\": " << json_number(r.per_token(r.speculative_used))
          << ", \"speculative_wasted_per_token\": " << json_number(r.per_token(r.speculative_wasted))
          << ", \"bytes_moved_per_token\": " << json_number(r.pcie_bytes_per_token())
          << ", \"bytes_needed_per_token\": " << json_number(rep.needed_bytes_per_token(r))
          << ", \"vs_pcie_bound_moved\": " << json_number(rep.vs_pcie(r))
          << ", \"vs_pcie_bound_needed\": " << json_number(rep.vs_pcie_needed(r));
    }
    out << "}";
  }
  out << "\n  ]\n}\n";
}

}  // namespace expert_cache::bench
