#pragma once
/// LinkProfile: what one host -> device link delivers at one expert size, measured on the device
/// (expert_cache/staging/link_probe.cuh, nvcc) or read back from a stored text.
// Host-only: the record, its text format, the rule that picks a fill engine from it, and the check
// that a stored profile belongs to this device and this expert size. docs/cuda_backend.md "Link
// profile".
//
// Text format (serialize / parse), one `key=value` per line, keys in this order:
//   expert_cache link profile v1
//   device=0
//   device_name=NVIDIA H100 80GB HBM3
//   pci_bus_id=0000:19:00.0
//   expert_bytes=1769472
//   copy_engine_gbps_one=50.5
//   copy_engine_gbps_batch=51
//   copy_latency_us=9.8
//   sm_load_gbps=30.2
//   graph_fill_latency_us=7.1
//   measure_ms=85
// Numbers are written in the shortest form that reads back to the same double.
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/version.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <system_error>

namespace expert_cache::inline v0 {

/// Who moves a miss's bytes from host to device memory: the copy engines (cudaMemcpyAsync /
/// cudaMemcpyBatchAsync), the SMs loading mapped pinned memory (the Gather fill kernel), or a
/// choice made from a LinkProfile (LinkProfile::choose_engine).
enum class FillEngine : std::uint8_t { automatic, copy_engine, sm_loads };

[[nodiscard]] constexpr std::string_view to_string(FillEngine engine) noexcept {
  switch (engine) {
    case FillEngine::automatic: return "automatic";
    case FillEngine::copy_engine: return "copy_engine";
    case FillEngine::sm_loads: return "sm_loads";
  }
  return "unknown";
}

/// What a cache's fills run beside, for FillEngine::automatic (LinkProfile::choose_engine):
/// `demand`, each layer's own misses; `overlapped_lookahead`, also the next layer's speculative
/// fills (prefetch) while a consumer that overlaps its fills computes.
enum class FillUse : std::uint8_t { demand, overlapped_lookahead };

/// Parses "automatic" | "copy_engine" | "sm_loads" (exact spelling).
[[nodiscard]] inline Result<FillEngine> parse_fill_engine(std::string_view text) noexcept {
  for (FillEngine e : {FillEngine::automatic, FillEngine::copy_engine, FillEngine::sm_loads}) {
    if (text == to_string(e)) return e;
  }
  return Status::format(ErrorCode::invalid_argument,
                        "unknown fill engine '%.*s' (available: automatic, copy_engine, sm_loads)",
                        static_cast<int>(std::min<std::size_t>(text.size(), 64)), text.data());
}

/// SM loads are chosen when they reach this share of the copy engine's batch bandwidth. They
/// avoid the host proxy's round trip in every layer (post kernel, the proxy's reaction, its
/// driver calls, the first copy's latency), which on H100 hosts was worth more than a 20 %
/// bandwidth deficit: where SM loads reached 0.92 of the link the SM-load rows of the decode
/// benchmark beat the copy engine's by 1.3-1.6x, and where they reached 0.53 the copy engine won
/// by 1.08-1.21x (docs/cuda_backend.md "Link profile").
inline constexpr double sm_load_min_share = 0.8;

/// The process's CUDA_DEVICE_MAX_CONNECTIONS: how many hardware work queues CUDA gives each context
/// it creates (its default is 8). 0 when the variable is unset or not a whole number from 1 to 1024.
/// Engines set it to 1 to keep kernels in launch order; the copy engine's fills for the forwards
/// then stall (LinkProfile::choose_engines).
[[nodiscard]] inline int cuda_work_queues_from_env() noexcept {
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (v == nullptr) return 0;
  const std::string_view text(v);
  int n = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  return ec == std::errc{} && end == text.data() + text.size() && n >= 1 && n <= 1024 ? n : 0;
}

/// One device's link at one expert size. Bandwidths in GB/s (1e9 bytes/s), latencies in us.
struct LinkProfile {
  static constexpr std::string_view format_header = "expert_cache link profile v1";

  int device = -1;              // CUDA device ordinal the profile was measured on
  std::string device_name;      // cudaDeviceProp::name
  std::string pci_bus_id;       // cudaDeviceGetPCIBusId: the device's identity across processes
  std::uint64_t expert_bytes = 0;
  double copy_engine_gbps_one = 0;    // one expert per cudaMemcpyAsync, from an idle stream
  double copy_engine_gbps_batch = 0;  // several experts back to back (the better of per-expert copies and one batch call)
  double copy_latency_us = 0;         // a small copy, issue to completion (median)
  double sm_load_gbps = 0;            // the Gather fill kernel over the same experts
  double graph_fill_latency_us = 0;   // a small fill kernel replayed in a CUDA graph (median)
  double measure_ms = 0;              // wall time of the whole measurement

  /// SM-load bandwidth as a share of the better copy-engine bandwidth (0 when nothing was measured).
  [[nodiscard]] double sm_load_share() const noexcept {
    const double best = std::max(copy_engine_gbps_one, copy_engine_gbps_batch);
    return best > 0 && std::isfinite(best) ? sm_load_gbps / best : 0.0;
  }

  /// One human-readable line.
  [[nodiscard]] std::string describe() const {
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "link profile: device %d, %s [%s], expert %.2f MiB: copy engine %.1f GB/s one, %.1f batch, %.1f us "
                  "per copy; SM loads %.1f GB/s (%.2f of the copy engine); graph fill %.1f us; measured in %.0f ms",
                  device, device_name.c_str(), pci_bus_id.c_str(), static_cast<double>(expert_bytes) / (1024.0 * 1024.0),
                  copy_engine_gbps_one, copy_engine_gbps_batch, copy_latency_us, sm_load_gbps, sm_load_share(),
                  graph_fill_latency_us, measure_ms);
    return buf;
  }

  /// The versioned text (see the header comment); parse() reads it back to an equal profile.
  [[nodiscard]] std::string serialize() const {
    std::string s(format_header);
    s += '\n';
    auto line = [&s](std::string_view key, std::string_view value) {
      s += key;
      s += '=';
      s += value;
      s += '\n';
    };
    line("device", std::to_string(device));
    line("device_name", one_line(device_name));
    line("pci_bus_id", one_line(pci_bus_id));
    line("expert_bytes", std::to_string(expert_bytes));
    for (const NumberField& f : number_fields()) line(f.key, shortest(this->*f.member));
    return s;
  }

  /// Strict reader of serialize()'s text: the first line must be format_header; then every key
  /// exactly once, nothing else (a trailing newline and '\r' line ends are accepted); device
  /// >= 0; expert_bytes > 0; bandwidths and latencies finite and > 0, measure_ms finite and >= 0;
  /// device_name and pci_bus_id not empty. On error `out` is left untouched and the message
  /// names the line and key.
  /// @param text  a stored profile
  /// @param out   gets the profile when the text is valid
  /// @return ok, or invalid_argument naming the line and key
  [[nodiscard]] static Status parse(std::string_view text, LinkProfile& out) {
    LinkProfile p;
    std::array<bool, field_count> seen{};
    std::size_t line_no = 0;
    bool header_seen = false;
    while (!text.empty()) {
      const std::size_t nl = text.find('\n');
      std::string_view line = text.substr(0, nl);
      text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (!header_seen) {
        if (line != format_header) {
          return Status::format(ErrorCode::invalid_argument,
                                "link profile line 1: expected '%.*s', got '%.*s' (unknown format or version)",
                                static_cast<int>(format_header.size()), format_header.data(), clip(line), line.data());
        }
        header_seen = true;
        continue;
      }
      const std::size_t eq = line.find('=');
      if (eq == std::string_view::npos) {
        return Status::format(ErrorCode::invalid_argument, "link profile line %zu: '%.*s' is not key=value", line_no,
                              clip(line), line.data());
      }
      const std::string_view key = line.substr(0, eq);
      const std::string_view value = line.substr(eq + 1);
      const int index = field_index(key);
      if (index < 0) {
        return Status::format(ErrorCode::invalid_argument, "link profile line %zu: unknown key '%.*s'", line_no,
                              clip(key), key.data());
      }
      if (seen[static_cast<std::size_t>(index)]) {
        return Status::format(ErrorCode::invalid_argument, "link profile line %zu: key '%.*s' appears twice", line_no,
                              clip(key), key.data());
      }
      seen[static_cast<std::size_t>(index)] = true;
      if (Status s = p.read_field(index, value); !s) return s.with_context("link profile line %zu", line_no);
    }
    if (!header_seen) return Status(ErrorCode::invalid_argument, "link profile: empty text (no format line)");
    for (std::size_t i = 0; i < field_count; ++i) {
      if (!seen[i]) {
        return Status::format(ErrorCode::invalid_argument, "link profile: missing key '%.*s'",
                              static_cast<int>(field_keys[i].size()), field_keys[i].data());
      }
    }
    out = std::move(p);
    return {};
  }

  /// The engine for FillEngine::automatic: sm_loads when SM loads reach sm_load_min_share of the
  /// copy engine's batch bandwidth, else copy_engine.
  /// @param reason  if not null, gets the numbers that decided
  /// @return copy_engine or sm_loads, never automatic
  [[nodiscard]] FillEngine choose_engine(std::string* reason = nullptr) const {
    return choose_engine(FillUse::demand, reason);
  }

  /// The same for fills used as `use` (fill_use_of in device_cache/options.hpp): the engine of the
  /// forwards' fills (choose_engines(use).forwards).
  [[nodiscard]] FillEngine choose_engine(FillUse use, std::string* reason = nullptr) const {
    return choose_engines(use, reason).forwards;
  }

  /// What FillEngine::automatic picks for fills used as `use`: the forwards' engine, and whether
  /// prefetches go through the copy engine beside SM-load forwards (DeviceCacheOptions::
  /// speculate_on_copy_engine). Slow SM loads (below sm_load_min_share of the copy engine's batch
  /// bandwidth), or no measurement: the copy engine for every fill. Fast SM loads: SM loads for the
  /// forwards, and with FillUse::overlapped_lookahead the speculative copies on the copy engine,
  /// where they take no SMs from the consumer they run beside while a forward's fill still starts
  /// without the proxy's round trip. On an H100 host where SM loads reached 0.93 of the copy
  /// engine's batch bandwidth, the overlapping rows with lookahead ran at 0.730 of the PCIe bound
  /// this way against 0.717-0.727 with every fill on the copy engine and 0.658-0.662 with every fill
  /// on SM loads (docs/prefetch.md).
  struct EngineChoice {
    FillEngine forwards = FillEngine::copy_engine;
    bool speculate_on_copy_engine = false;
  };
  ///
  /// `work_queues`: the process's hardware work queues per context (cuda_work_queues_from_env; 0:
  /// not limited). With one, every fill goes to SM loads whatever the profile: all streams of the
  /// context then share one queue, and on an H100 host every copy-engine step of the GPU tests
  /// waited for the proxy's copies until its bounded wait gave up (docs/design.md, "One hardware
  /// work queue"; which queued work holds the copies back is not established).
  [[nodiscard]] EngineChoice choose_engines(FillUse use, std::string* reason = nullptr, int work_queues = 0) const {
    if (work_queues == 1) {
      if (reason != nullptr) {
        *reason = "sm_loads: CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream on one hardware work queue, where a step "
                  "that waits for the copy proxy stalls";
      }
      return EngineChoice{FillEngine::sm_loads, false};
    }
    const bool measured = copy_engine_gbps_batch > 0 && std::isfinite(copy_engine_gbps_batch) &&
                          sm_load_gbps >= 0 && std::isfinite(sm_load_gbps);
    if (!measured) {
      if (reason != nullptr) *reason = "copy_engine: the profile holds no copy-engine and SM-load measurement";
      return {};
    }
    const bool fast_sm = sm_load_gbps >= sm_load_min_share * copy_engine_gbps_batch;
    const bool split = fast_sm && use == FillUse::overlapped_lookahead;
    if (reason != nullptr) {
      char buf[400];
      std::snprintf(buf, sizeof buf, "%s: SM loads %.1f GB/s are %.3f of the copy engine's batch %.1f GB/s (%s %.2f)%s",
                    split ? "split" : (fast_sm ? "sm_loads" : "copy_engine"), sm_load_gbps,
                    sm_load_gbps / copy_engine_gbps_batch, copy_engine_gbps_batch, fast_sm ? "at least" : "below",
                    sm_load_min_share,
                    split ? "; forwards' fills with SM loads, the overlapped lookahead's speculative copies on the copy "
                            "engine, which takes no SMs from the consumer"
                          : "");
      *reason = buf;
    }
    return EngineChoice{fast_sm ? FillEngine::sm_loads : FillEngine::copy_engine, split};
  }

  /// Whether a stored profile belongs to this device and expert size.
  /// @param device_ordinal  the CUDA device ordinal
  /// @param bus_id          its PCI bus id (compared without regard to case)
  /// @param bytes           the cache's bytes per expert
  /// @return ok when this profile was measured there at that size; otherwise an invalid_argument
  ///         naming both sides
  [[nodiscard]] Status check_matches(int device_ordinal, const std::string& bus_id, std::uint64_t bytes) const noexcept {
    if (device_ordinal != device || !same_bus_id(bus_id, pci_bus_id)) {
      return Status::format(ErrorCode::invalid_argument,
                            "link profile is for device %d [%s], not device %d [%s]: measure it on this device", device,
                            pci_bus_id.c_str(), device_ordinal, bus_id.c_str());
    }
    if (bytes != expert_bytes) {
      return Status::format(ErrorCode::invalid_argument,
                            "link profile is for experts of %llu bytes, not %llu: measure it at this expert size",
                            static_cast<unsigned long long>(expert_bytes), static_cast<unsigned long long>(bytes));
    }
    return {};
  }

  friend bool operator==(const LinkProfile&, const LinkProfile&) = default;

 private:
  using NumberMember = double LinkProfile::*;
  struct NumberField {
    std::string_view key;
    NumberMember member;
    bool zero_allowed;  // measure_ms may be 0 (a profile written by hand); a 0 bandwidth or latency is no measurement
  };
  static constexpr std::size_t field_count = 10;
  static constexpr std::array<std::string_view, field_count> field_keys = {
      "device", "device_name", "pci_bus_id", "expert_bytes", "copy_engine_gbps_one", "copy_engine_gbps_batch",
      "copy_latency_us", "sm_load_gbps", "graph_fill_latency_us", "measure_ms"};
  static constexpr std::array<NumberField, 6> number_fields() noexcept {
    return {{{"copy_engine_gbps_one", &LinkProfile::copy_engine_gbps_one, false},
             {"copy_engine_gbps_batch", &LinkProfile::copy_engine_gbps_batch, false},
             {"copy_latency_us", &LinkProfile::copy_latency_us, false},
             {"sm_load_gbps", &LinkProfile::sm_load_gbps, false},
             {"graph_fill_latency_us", &LinkProfile::graph_fill_latency_us, false},
             {"measure_ms", &LinkProfile::measure_ms, true}}};
  }

  static int clip(std::string_view s) noexcept { return static_cast<int>(std::min<std::size_t>(s.size(), 64)); }

  static int field_index(std::string_view key) noexcept {
    for (std::size_t i = 0; i < field_count; ++i) {
      if (field_keys[i] == key) return static_cast<int>(i);
    }
    return -1;
  }

  static bool same_bus_id(std::string_view a, std::string_view b) noexcept {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i) {
      auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
      if (lower(a[i]) != lower(b[i])) return false;
    }
    return true;
  }

  // A line break inside a value would end its line early: written as a space.
  static std::string one_line(std::string v) {
    std::replace_if(v.begin(), v.end(), [](char c) { return c == '\n' || c == '\r'; }, ' ');
    return v;
  }

  static std::string shortest(double v) {
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    return std::string(buf, r.ptr);
  }

  // Reads field `index` (field_keys order) from `value` into this profile.
  Status read_field(int index, std::string_view value) {
    const std::string_view key = field_keys[static_cast<std::size_t>(index)];
    const char* end = value.data() + value.size();
    switch (index) {
      case 0: {
        int v = 0;
        const auto r = std::from_chars(value.data(), end, v);
        if (value.empty() || r.ec != std::errc() || r.ptr != end || v < 0) {
          return Status::format(ErrorCode::invalid_argument, "device: '%.*s' is not a device ordinal (an integer >= 0)",
                                clip(value), value.data());
        }
        device = v;
        return {};
      }
      case 1:
      case 2: {
        if (value.empty()) {
          return Status::format(ErrorCode::invalid_argument, "%.*s: empty", static_cast<int>(key.size()), key.data());
        }
        (index == 1 ? device_name : pci_bus_id) = std::string(value);
        return {};
      }
      case 3: {
        std::uint64_t v = 0;
        const auto r = std::from_chars(value.data(), end, v);
        if (value.empty() || r.ec != std::errc() || r.ptr != end || v == 0) {
          return Status::format(ErrorCode::invalid_argument, "expert_bytes: '%.*s' is not a byte count (an integer > 0)",
                                clip(value), value.data());
        }
        expert_bytes = v;
        return {};
      }
      default: break;
    }
    for (const NumberField& f : number_fields()) {
      if (f.key != key) continue;
      double v = 0;
      const auto r = std::from_chars(value.data(), end, v);
      if (value.empty() || r.ec != std::errc() || r.ptr != end) {
        return Status::format(ErrorCode::invalid_argument, "%.*s: '%.*s' is not a number", static_cast<int>(key.size()),
                              key.data(), clip(value), value.data());
      }
      if (!std::isfinite(v) || v < 0 || (v == 0 && !f.zero_allowed)) {
        return Status::format(ErrorCode::invalid_argument, "%.*s: %.*s is not a finite number %s 0",
                              static_cast<int>(key.size()), key.data(), clip(value), value.data(),
                              f.zero_allowed ? ">=" : ">");
      }
      this->*f.member = v;
      return {};
    }
    return Status(ErrorCode::internal, "link profile: a key without a reader");
  }
};

}  // namespace expert_cache::inline v0
