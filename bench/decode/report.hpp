#pragma once
// expert-cache-bench: result rows (RunResult), the whole report, and the text table that
// bench/scripts/run.sh prints. Host-only.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "lookahead.hpp"
#include "model.hpp"

namespace expert_cache::bench {

struct RunResult {
  std::string provider;  // row | cached | resident
  std::string staging;   // inline | copy_stream | batched | gather | "-"
  std::string device_policy;  // the device provider's policy when the run names it (lru, lfru, crf), else empty
  // "device:crf" when the policy is named, else the provider.
  [[nodiscard]] std::string label() const { return device_policy.empty() ? provider : provider + ":" + device_policy; }
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
  std::uint64_t host_syncs = 0;     // host waits in the measured steps: the loop's own stream/event
                                    // synchronisations and device reads, plus the caches' staging stalls
  std::uint64_t check_failures = 0; // consumer saw a wrong expert (sim) / outputs differ (GPU)
  bool output_checked = false;
  // Lookahead (--prefetch): "" = not asked, "none" = the baseline row, else the predictor.
  // With a predictor, pcie_bytes includes the speculative fills (wasted ones too).
  std::string prefetch;
  std::string prefetch_at = "prepare";  // where layer L+1's prefetch was issued: prepare or router (device rows)
  std::uint64_t speculative_issued = 0;
  std::uint64_t speculative_used = 0;
  std::uint64_t speculative_wasted = 0;
  [[nodiscard]] bool is_lookahead_row() const noexcept { return !prefetch.empty() && prefetch != "none"; }
  [[nodiscard]] double per_token(std::uint64_t n) const noexcept {
    return tokens ? static_cast<double>(n) / static_cast<double>(tokens) : 0;
  }
  [[nodiscard]] double seconds_per_token() const noexcept { return tokens ? time_ns * 1e-9 / static_cast<double>(tokens) : 0; }
  [[nodiscard]] double tokens_per_second() const noexcept { return time_ns > 0 ? static_cast<double>(tokens) / (time_ns * 1e-9) : 0; }
  [[nodiscard]] double hit_rate() const noexcept {
    return hits + misses ? static_cast<double>(hits) / static_cast<double>(hits + misses) : 1.0;
  }
  [[nodiscard]] double misses_per_token() const noexcept { return tokens ? static_cast<double>(misses) / static_cast<double>(tokens) : 0; }
  [[nodiscard]] double pcie_bytes_per_token() const noexcept { return tokens ? pcie_bytes / static_cast<double>(tokens) : 0; }
  [[nodiscard]] double host_syncs_per_token() const noexcept {
    return tokens ? static_cast<double>(host_syncs) / static_cast<double>(tokens) : 0;
  }
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
  std::int32_t prefetch_budget = 0;  // experts per layer (--prefetch runs)
  std::string prefetch_at = "prepare";  // where the device rows prefetch layer L+1 (--prefetch-at)
  bool evict_last_forward = false;       // --evict-last-forward
  [[nodiscard]] bool has_lookahead() const noexcept {
    for (const RunResult& r : runs)
      if (!r.prefetch.empty()) return true;
    return false;
  }
  // Bytes a perfect cache would move for this routing: the misses of the no-prefetch row of the
  // same provider and staging in this run (nullptr when that row is missing).
  [[nodiscard]] const RunResult* lookahead_baseline(const RunResult& r) const noexcept {
    for (const RunResult& b : runs)
      if (b.prefetch == "none" && b.provider == r.provider && b.device_policy == r.device_policy && b.staging == r.staging)
        return &b;
    return nullptr;
  }
  [[nodiscard]] double needed_bytes_per_token(const RunResult& r) const noexcept {
    const RunResult* b = lookahead_baseline(r);
    return b ? b->pcie_bytes_per_token() : 0;
  }
  // The PCIe-bound ratio on the bytes needed: moving the baseline's misses at the ceiling over
  // this row's time per token.
  [[nodiscard]] double vs_pcie_needed(const RunResult& r) const noexcept {
    const double t = r.seconds_per_token();
    return t > 0 && pcie_ceiling_bytes_per_s > 0 ? needed_bytes_per_token(r) / pcie_ceiling_bytes_per_s / t : 0;
  }
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

// --prefetch: the baseline and predictor rows (hint rows labelled emulated).
inline void print_lookahead_table(std::FILE* out, const Report& rep) {
  std::fprintf(out,
               "\nlookahead (cache[L+1].prefetch() of the predicted experts: host-planned rows after layer L's prepare\n"
               "and consumer, device rows after layer L's %s; budget %d experts per layer and token; the predictor\n"
               "ranks max(budget, widest forward) experts)\n",
               rep.prefetch_at == "auto" ? "router where the prefetch fills run on the copy engine (+ce, +split), "
                                           "else after its prepare"
                                         : rep.prefetch_at.c_str(),
               rep.prefetch_budget);
  std::fprintf(out, "%-11s %-12s %-34s %9s %7s %8s %8s %8s %9s %9s %8s %8s\n", "provider", "staging", "prefetch",
               "tok/s", "hit%", "spec_iss", "spec_use", "spec_wst", "MB/tok", "MB/tok", "vs_pcie", "vs_pcie");
  std::fprintf(out, "%-11s %-12s %-34s %9s %7s %8s %8s %8s %9s %9s %8s %8s\n", "", "", "", "", "", "/tok", "/tok", "/tok",
               "(moved)", "(needed)", "(moved)", "(needed)");
  for (const RunResult& r : rep.runs) {
    if (r.prefetch.empty()) continue;
    std::fprintf(out, "%-11s %-12s %-34s %9.2f %6.1f%% %8.2f %8.2f %8.2f %9.2f %9.2f %8.3f %8.3f\n", r.label().c_str(),
                 r.staging.c_str(), prefetch_label(r.prefetch).c_str(), r.tokens_per_second(), 100.0 * r.hit_rate(),
                 r.per_token(r.speculative_issued), r.per_token(r.speculative_used), r.per_token(r.speculative_wasted),
                 r.pcie_bytes_per_token() / 1e6, rep.needed_bytes_per_token(r) / 1e6, rep.vs_pcie(r),
                 rep.vs_pcie_needed(r));
  }
  std::fprintf(out,
               "spec_* = speculative fills issued / used by a later prepare() / wasted (expired or evicted unused) per\n"
               "token; MB/tok(moved) = all expert bytes copied, wasted fills included; MB/tok(needed) = the misses of\n"
               "the prefetch-none row (what a perfect cache moves); vs_pcie = (MB/tok / ceiling) / time per token.\n"
               "hint rows are EMULATED engine hints drawn from the routing's future (the benchmark has no hidden states).\n");
  if (std::any_of(rep.runs.begin(), rep.runs.end(),
                  [](const RunResult& r) { return split_row_prefetch(r.prefetch).two_ahead.has_value(); }))
    std::fprintf(out,
                 "+ahead2:R rows also prefetch layer L+2 at the same point, after layer L+1's prefetch, from EMULATED\n"
                 "hints of recall R with the row's wrong ids and noise.\n");
  if (rep.evict_last_forward)
    std::fprintf(out,
                 "every prefetch may evict its cache's last forward (PrefetchOptions::evict_last_forward; each layer's\n"
                 "previous forward was consumed before its next prefetch), except the residents its list names.\n");
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
  std::fprintf(out, "%-11s %-12s %9s %8s %8s %7s %8s %9s %9s %9s %9s %9s\n", "provider", "staging", "tok/s", "vs_res",
               "vs_pcie", "hit%", "miss/tok", "MB/tok", rep.modelled ? "prep_us*" : "prep_us", "prep_us", "cold_ms",
               "syncs");
  std::fprintf(out, "%-11s %-12s %9s %8s %8s %7s %8s %9s %9s %9s %9s %9s\n", "", "", "", "", "", "", "", "(PCIe)",
               rep.modelled ? "(model)" : "(real)", rep.modelled ? "(realCPU)" : "", "", "/tok");
  for (const RunResult& r : rep.runs) {
    if (r.is_lookahead_row()) continue;  // in the lookahead table below
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
    std::fprintf(out, "%-11s %-12s %9.2f %8s %8.3f %6.1f%% %8.2f %9.2f %9s %9s %9.2f %9.2f\n", r.label().c_str(),
                 r.staging.c_str(), r.tokens_per_second(), vs_res, rep.vs_pcie(r), 100.0 * r.hit_rate(),
                 r.misses_per_token(), r.pcie_bytes_per_token() / 1e6, prep1, prep2, r.cold_start_ns * 1e-6,
                 r.host_syncs_per_token());
  }
  std::fprintf(out,
               "\nvs_res = tok/s / all-resident tok/s; vs_pcie = (PCIe bytes per token / ceiling) / time per token.\n"
               "syncs/tok = host synchronisations per measured token (stream/event waits and device reads of the\n"
               "decode loop, plus the caches' staging stalls); the one wait after the last step that stops the\n"
               "clock is not part of a step.\n");
  if (rep.modelled) {
    std::fprintf(out,
                 "Times, tok/s and prep_us(model) are MODELLED on SimRuntime; hit rates, misses and bytes are exact for\n"
                 "this routing; prep_us(realCPU) is the real wall clock of prepare() on this CPU, SimRuntime's own\n"
                 "bookkeeping (race detector) included.\n");
  }
  if (rep.has_lookahead()) print_lookahead_table(out, rep);
  for (const std::string& n : rep.notes) std::fprintf(out, "%s\n", n.c_str());
  for (const RunResult& r : rep.runs) {
    if (r.output_checked && r.check_failures != 0) {
      std::fprintf(out, "CHECK FAILED: %s/%s: %llu consumer checks failed\n", r.label().c_str(), r.staging.c_str(),
                   static_cast<unsigned long long>(r.check_failures));
    }
  }
}

}  // namespace expert_cache::bench
