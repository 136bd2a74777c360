#pragma once
/// SimRuntime's per-stream state: each stream is a FIFO of operations that complete only when the
/// scheduler runs them.
// Events hold their latest record; gates block a stream until the host opens them. Host-only.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "expert_cache/runtime/runtime.hpp"
#include "expert_cache/runtime/sim/op_kind.hpp"
#include "expert_cache/runtime/sim/vector_clock.hpp"

namespace expert_cache::inline v0::detail::sim {

// One event record. Waits hold it by shared_ptr, so re-recording or destroying the event does
// not affect waits enqueued earlier.
struct RecordState {
  bool completed = false;
  std::uint32_t stream = 0;
  std::uint64_t seq = 0;
  double time_ns = 0.0;
  Clock clock;  // the recording stream's clock at completion
};

struct Op {
  SimOpKind kind = SimOpKind::launch;
  std::uint32_t gate = 0;
  std::uint64_t seq = 0;
  double host_time_ns = 0.0;
  double duration_ns = 0.0;
  bool shares_link = false;  // a copy under SimCostModel::copies_share_link
  Clock host_clock;  // the host's clock at enqueue: host -> op edge
  std::vector<CopyDesc> copies;
  std::vector<Access> accesses;
  std::function<void()> body;
  std::shared_ptr<RecordState> record;  // record: completed by this op; wait: awaited
  Label label;
};

// FIFO as a vector + head index, so steady-state enqueue/complete does not allocate.
struct StreamState {
  std::vector<Op> ops;
  std::size_t head = 0;
  Clock clock;
  double time_ns = 0.0;
  bool alive = true;
  bool capturing = false;
  // Its ops stand for work a host thread issues later (a copy proxy): freeing memory does not
  // wait for them, as cudaFree's implicit device synchronisation does not wait for calls a host
  // thread has yet to make.
  bool host_issued = false;
  std::string name;

  [[nodiscard]] bool empty() const noexcept { return head == ops.size(); }
  [[nodiscard]] std::size_t size() const noexcept { return ops.size() - head; }
  [[nodiscard]] const Op& front() const noexcept { return ops[head]; }

  // Appends an op, first compacting a FIFO that never empties.
  Op& push() {
    if (head > 64 && head * 2 > ops.size()) {
      ops.erase(ops.begin(), ops.begin() + static_cast<std::ptrdiff_t>(head));
      head = 0;
    }
    return ops.emplace_back();
  }

  // Removes and returns the head op.
  Op pop() noexcept {
    Op op = std::move(ops[head]);
    ++head;
    if (empty()) {  // keep capacity, drop the moved-from shells
      ops.clear();
      head = 0;
    }
    return op;
  }
};

struct EventState {
  std::shared_ptr<RecordState> latest;
  bool alive = true;
};

struct GateState {
  bool open = false;
  double time_ns = 0.0;
  Clock host_clock;
};

}  // namespace expert_cache::inline v0::detail::sim
