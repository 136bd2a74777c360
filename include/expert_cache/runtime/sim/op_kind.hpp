#pragma once
/// What a SimRuntime operation is, as named in race reports, deadlock messages and traces.
// Host-only.
#include "expert_cache/base/version.hpp"
#include <cstdint>
#include <memory>
#include <string>

namespace expert_cache::inline v0 {

enum class SimOpKind : std::uint8_t { copy, copy_batch, record, wait, launch, gate, host };

[[nodiscard]] constexpr const char* to_string(SimOpKind kind) noexcept {
  switch (kind) {
    case SimOpKind::copy: return "copy";
    case SimOpKind::copy_batch: return "copy_batch";
    case SimOpKind::record: return "record";
    case SimOpKind::wait: return "wait";
    case SimOpKind::launch: return "launch";
    case SimOpKind::gate: return "gate";
    case SimOpKind::host: return "host_access";
  }
  return "unknown";
}

namespace detail::sim {
// An op's label, shared between the op, its shadow-memory records and race reports.
using Label = std::shared_ptr<const std::string>;
}  // namespace detail::sim

}  // namespace expert_cache::inline v0
