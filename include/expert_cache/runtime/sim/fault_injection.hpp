#pragma once
/// SimRuntime's fault injection: the nth call of a kind from now fails with runtime_failure and
/// enqueues nothing.
// Several injections may be pending per kind. Host-only.
#include "expert_cache/base/version.hpp"
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace expert_cache::inline v0 {

// API calls that can be made to fail by SimRuntime::inject_failure.
// `copy` covers copy_async and copy_batch_async.
enum class FaultKind : std::uint8_t { copy, record, wait, launch };

[[nodiscard]] constexpr const char* to_string(FaultKind kind) noexcept {
  switch (kind) {
    case FaultKind::copy: return "copy";
    case FaultKind::record: return "record";
    case FaultKind::wait: return "wait";
    case FaultKind::launch: return "launch";
  }
  return "unknown";
}

namespace detail::sim {

class FaultInjector {
 public:
  // The nth call of `kind` from now (1 = the next one; 0 counts as 1) fails.
  void inject(FaultKind kind, std::uint64_t nth) {
    Kind& k = kinds_[index(kind)];
    k.fail_at.push_back(k.calls + std::max<std::uint64_t>(nth, 1));
  }
  // Drops pending injections; call counts keep running.
  void clear_pending() noexcept {
    for (Kind& k : kinds_) k.fail_at.clear();
  }
  // Drops pending injections and call counts.
  void reset() noexcept {
    for (Kind& k : kinds_) k = {};
  }
  // Counts one call of `kind`; true when that call must fail (its injection is used up).
  bool consume(FaultKind kind) noexcept {
    Kind& k = kinds_[index(kind)];
    ++k.calls;
    const auto it = std::find(k.fail_at.begin(), k.fail_at.end(), k.calls);
    if (it == k.fail_at.end()) return false;
    k.fail_at.erase(it);
    return true;
  }
  // Calls of `kind` counted so far (the number of the call that just failed, after consume).
  [[nodiscard]] std::uint64_t calls(FaultKind kind) const noexcept { return kinds_[index(kind)].calls; }

 private:
  struct Kind {
    std::uint64_t calls = 0;
    std::vector<std::uint64_t> fail_at;
  };
  static constexpr std::size_t index(FaultKind kind) noexcept { return static_cast<std::size_t>(kind); }

  std::array<Kind, 4> kinds_{};
};

}  // namespace detail::sim

}  // namespace expert_cache::inline v0
