#pragma once
/// SimRuntime's scheduler: which stream heads may complete, and a seeded random choice among them.
// The choice is the only source of nondeterminism in the model, so a seed names a schedule.
// Host-only.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "expert_cache/base/splitmix64.hpp"
#include "expert_cache/runtime/sim/stream_queue.hpp"

namespace expert_cache::inline v0::detail::sim {

// SplitMix64 with a modulo draw (the schedules recorded by tests depend on this exact draw).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) noexcept : gen_{seed} {}
  std::uint64_t next() noexcept { return gen_.next(); }
  std::size_t below(std::size_t n) noexcept { return static_cast<std::size_t>(next() % n); }

 private:
  SplitMix64 gen_;
};

// A head is ready unless it waits on an incomplete record or sits behind a closed gate.
[[nodiscard]] inline bool head_ready(const StreamState& st, const std::vector<GateState>& gates) noexcept {
  if (st.empty()) return false;
  const Op& op = st.front();
  switch (op.kind) {
    case SimOpKind::wait: return op.record->completed;
    case SimOpKind::gate: return gates[op.gate - 1].open;
    default: return true;
  }
}

// Picks a random stream id (index + 1) with a ready head; 0 when none. `ready` is scratch.
inline std::uint32_t pick_ready(const std::vector<std::unique_ptr<StreamState>>& streams,
                                const std::vector<GateState>& gates, Rng& rng, std::vector<std::uint32_t>& ready) {
  ready.clear();
  for (std::size_t i = 0; i < streams.size(); ++i)
    if (head_ready(*streams[i], gates)) ready.push_back(static_cast<std::uint32_t>(i + 1));
  if (ready.empty()) return 0;
  return ready[ready.size() == 1 ? 0 : rng.below(ready.size())];
}

// The virtual time at which a ready head can start: after its stream's last op, its enqueue on
// the host, and (wait) the awaited record or (gate) the gate's opening.
[[nodiscard]] inline double head_start_ns(const StreamState& st, const std::vector<GateState>& gates) noexcept {
  const Op& op = st.front();
  double t = st.time_ns > op.host_time_ns ? st.time_ns : op.host_time_ns;
  if (op.kind == SimOpKind::wait && op.record->time_ns > t) t = op.record->time_ns;
  if (op.kind == SimOpKind::gate && gates[op.gate - 1].time_ns > t) t = gates[op.gate - 1].time_ns;
  return t;
}

// The ready stream whose head starts earliest in virtual time (ties: the lowest id), 0 when
// none: the order of a discrete-event simulation, so that a shared resource (the link of
// SimCostModel::copies_share_link) is booked in the order its users become ready.
inline std::uint32_t pick_earliest(const std::vector<std::unique_ptr<StreamState>>& streams,
                                   const std::vector<GateState>& gates) noexcept {
  std::uint32_t best = 0;
  double best_t = 0.0;
  for (std::size_t i = 0; i < streams.size(); ++i) {
    if (!head_ready(*streams[i], gates)) continue;
    const double t = head_start_ns(*streams[i], gates);
    if (best == 0 || t < best_t) {
      best = static_cast<std::uint32_t>(i + 1);
      best_t = t;
    }
  }
  return best;
}

}  // namespace expert_cache::inline v0::detail::sim
