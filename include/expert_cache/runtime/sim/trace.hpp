#pragma once
/// What SimRuntime did: per-kind counters of successful calls, and the optional call log (in
/// API-call order, for golden protocol tests).
// Host-only.
#include "expert_cache/base/version.hpp"
#include <cstddef>
#include <cstdint>
#include <string>

namespace expert_cache::inline v0 {

// Calls logged by the optional trace.
enum class SimCall : std::uint8_t {
  copy, copy_batch, record, wait, launch, gate, synchronize_event, synchronize_stream, query
};

[[nodiscard]] constexpr const char* to_string(SimCall call) noexcept {
  switch (call) {
    case SimCall::copy: return "copy";
    case SimCall::copy_batch: return "copy_batch";
    case SimCall::record: return "record";
    case SimCall::wait: return "wait";
    case SimCall::launch: return "launch";
    case SimCall::gate: return "gate";
    case SimCall::synchronize_event: return "synchronize_event";
    case SimCall::synchronize_stream: return "synchronize_stream";
    case SimCall::query: return "query";
  }
  return "unknown";
}

// Successful calls, per kind (for tests and for modelled benchmarks).
struct SimCounters {
  std::uint64_t copies = 0;          // copy_async calls that enqueued an op
  std::uint64_t copy_batches = 0;    // copy_batch_async calls that enqueued an op
  std::uint64_t batch_copies = 0;    // descriptors inside those batches
  std::uint64_t copy_bytes = 0;      // bytes of all enqueued copies (single and batched)
  std::uint64_t records = 0;
  std::uint64_t waits = 0;           // wait() calls that enqueued an op
  std::uint64_t noop_waits = 0;      // wait() on a never-recorded event (nothing enqueued)
  std::uint64_t launches = 0;
  std::uint64_t gates = 0;
  std::uint64_t host_syncs = 0;      // successful synchronize(event|stream)
  std::uint64_t completed_ops = 0;
  std::uint64_t injected_failures = 0;
  friend bool operator==(const SimCounters&, const SimCounters&) = default;
};

struct SimTraceEntry {
  SimCall call = SimCall::copy;
  std::uint32_t stream = 0;  // 0 for calls without a stream
  std::uint32_t event = 0;   // record / wait / synchronize_event / query; 0 otherwise
  std::size_t bytes = 0;     // copy bytes (batch: total)
  std::string label;
};

}  // namespace expert_cache::inline v0
