#pragma once
/// SimRuntime: a deterministic, single-threaded host model of the `runtime` concept with a
/// happens-before race detector.
// Host-only, no CUDA.
//
// Model
// - Every stream is a FIFO of operations (copy, batched copy, event record, event wait,
//   kernel-like launch, host gate). Nothing runs at enqueue time: an op completes only when
//   the test advances it (step, run_random, drain) or the host blocks (synchronize). A copy's
//   memcpy and a launch's body run when the op completes, so data checks see real bytes.
// - Happens-before uses vector clocks, one component per stream plus one for the host
//   (actor 0). Edges: stream order; host enqueue -> op (everything the host did before the
//   call); record -> wait (the record current when wait() was called); record -> host on
//   synchronize(event) and on query()==true; stream -> host on synchronize(stream); host ->
//   gate op on open_gate().
// - Race detection (sim/shadow_memory.hpp): every completing op checks its declared accesses
//   (copies: read src, write dst; launches: the declared list), and host_access() checks as
//   the host. Accesses of ops still pending are checked when they complete, so drain() before
//   asserting races().empty().
// - Graph capture is only a flag (set_capturing): ops still run normally. Under capture,
//   synchronize(stream) and copy_batch_async return capture_unsupported, as CUDA does
//   (cudaMemcpyBatchAsync is rejected during capture).
// - Optional virtual time (SimCostModel, sim/cost_model.hpp).
//
// Parts: sim/vector_clock.hpp (happens-before), sim/stream_queue.hpp (streams, events, gates),
// sim/scheduler.hpp (which heads may run, seeded choice), sim/shadow_memory.hpp (races),
// sim/fault_injection.hpp, sim/cost_model.hpp, sim/trace.hpp (counters and call log). This
// class composes them: the API, enqueue, op execution and memory.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "expert_cache/base/status.hpp"
#include "expert_cache/runtime/runtime.hpp"
#include "expert_cache/runtime/sim/cost_model.hpp"
#include "expert_cache/runtime/sim/fault_injection.hpp"
#include "expert_cache/runtime/sim/op_kind.hpp"
#include "expert_cache/runtime/sim/scheduler.hpp"
#include "expert_cache/runtime/sim/shadow_memory.hpp"
#include "expert_cache/runtime/sim/stream_queue.hpp"
#include "expert_cache/runtime/sim/trace.hpp"
#include "expert_cache/runtime/sim/vector_clock.hpp"

namespace expert_cache::inline v0 {

class SimRuntime {
 public:
  // Handles: 0 is never a live handle, so a default-constructed one is rejected.
  struct Stream {
    std::uint32_t id = 0;
    friend bool operator==(Stream, Stream) = default;
  };
  struct Event {
    std::uint32_t id = 0;
    friend bool operator==(Event, Event) = default;
  };
  struct Gate {
    std::uint32_t id = 0;
    friend bool operator==(Gate, Gate) = default;
  };

  struct Options {
    std::size_t memory_limit = std::size_t{1} << 30;  // bytes allocate() may hold in total
    std::uint64_t seed = 0x5EED5EED5EED5EEDull;       // RNG of synchronize() / drain()
    std::size_t max_races = 1024;                     // reports kept; later ones only counted
    std::uint32_t max_streams = 1024;
  };

  SimRuntime() : SimRuntime(Options{}) {}
  explicit SimRuntime(Options options) : options_(options), seed_(options.seed), rng_(options.seed) {
    reset_clocks();
  }
  SimRuntime(const SimRuntime&) = delete;
  SimRuntime& operator=(const SimRuntime&) = delete;
  ~SimRuntime() { free_all(); }

  // ---- the `runtime` concept -------------------------------------------------------------

  Result<Stream> create_stream() noexcept {
    if (streams_.size() >= options_.max_streams)
      return Status(ErrorCode::runtime_failure,
                    "SimRuntime: stream limit reached (" + std::to_string(options_.max_streams) + ")");
    try {
      auto st = std::make_unique<StreamState>();
      const auto id = static_cast<std::uint32_t>(streams_.size() + 1);
      st->clock.assign(id + 1, 0);
      st->clock[id] = 1;  // epoch 0 means "never", so every actor starts at 1
      streams_.push_back(std::move(st));
      return Stream{id};
    } catch (const std::exception& e) {
      return Status(ErrorCode::runtime_failure, std::string("SimRuntime: create_stream: ") + e.what());
    }
  }

  // Like cudaStreamDestroy: pending work still completes; the handle becomes invalid.
  void destroy_stream(Stream s) noexcept {
    if (StreamState* st = live_stream(s)) st->alive = false;
  }

  Result<Event> create_event() noexcept {
    try {
      events_.push_back(EventState{});
      return Event{static_cast<std::uint32_t>(events_.size())};
    } catch (const std::exception& e) {
      return Status(ErrorCode::runtime_failure, std::string("SimRuntime: create_event: ") + e.what());
    }
  }

  void destroy_event(Event e) noexcept {
    if (EventState* ev = live_event(e)) {
      ev->alive = false;
      ev->latest.reset();  // pending waits keep their record alive
    }
  }

  Status record(Event e, Stream s) noexcept {
    Label label = take_label();
    if (consume_fault(FaultKind::record)) return injected(FaultKind::record);
    EventState* ev = live_event(e);
    if (ev == nullptr) return bad_event("record", e);
    if (live_stream(s) == nullptr) return bad_stream("record", s);
    try {
      auto rec = std::make_shared<RecordState>();
      rec->stream = s.id;
      Op& op = push_op(s, SimOpKind::record, std::move(label));
      rec->seq = op.seq;
      op.record = rec;
      ev->latest = std::move(rec);  // re-recording replaces; earlier waits keep the old record
      ++counters_.records;
      trace(SimCall::record, s.id, e.id, 0, op.label);
      return {};
    } catch (const std::exception& ex) {
      return alloc_failure("record", ex);
    }
  }

  Status wait(Stream s, Event e) noexcept {
    Label label = take_label();
    if (consume_fault(FaultKind::wait)) return injected(FaultKind::wait);
    EventState* ev = live_event(e);
    if (ev == nullptr) return bad_event("wait", e);
    if (live_stream(s) == nullptr) return bad_stream("wait", s);
    try {
      trace(SimCall::wait, s.id, e.id, 0, label);
      if (!ev->latest) {  // never recorded: cudaStreamWaitEvent is a no-op
        ++counters_.noop_waits;
        return {};
      }
      Op& op = push_op(s, SimOpKind::wait, std::move(label));
      op.record = ev->latest;  // captured now; a later re-record does not affect this wait
      ++counters_.waits;
      return {};
    } catch (const std::exception& ex) {
      return alloc_failure("wait", ex);
    }
  }

  Result<bool> query(Event e) noexcept {
    EventState* ev = live_event(e);
    if (ev == nullptr) return bad_event("query", e);
    trace(SimCall::query, 0, e.id, 0, {});
    if (Status err = take_async_error(); !err.ok()) return err;
    const RecordState* rec = ev->latest.get();
    if (rec == nullptr) return true;
    if (!rec->completed) return false;
    acquire_on_host(*rec);
    return true;
  }

  Status synchronize(Event e) noexcept {
    EventState* ev = live_event(e);
    if (ev == nullptr) return bad_event("synchronize", e);
    trace(SimCall::synchronize_event, 0, e.id, 0, {});
    const std::shared_ptr<RecordState> rec = ev->latest;
    if (rec) {
      if (!run_until([&] { return rec->completed; }, rng_))
        return deadlock("synchronize(event #" + std::to_string(e.id) + ") on its record (op #" +
                        std::to_string(rec->seq) + " on stream #" + std::to_string(rec->stream) + ")");
      acquire_on_host(*rec);
    }
    ++counters_.host_syncs;
    return take_async_error();
  }

  Status synchronize(Stream s) noexcept {
    StreamState* st = live_stream(s);
    if (st == nullptr) return bad_stream("synchronize", s);
    if (st->capturing)
      return Status(ErrorCode::capture_unsupported,
                    "SimRuntime: synchronize(stream #" + std::to_string(s.id) +
                        ") while the stream is capturing (cudaStreamSynchronize is illegal during capture)");
    trace(SimCall::synchronize_stream, s.id, 0, 0, {});
    if (!run_until([&] { return st->empty(); }, rng_))
      return deadlock("synchronize(stream #" + std::to_string(s.id) + ")");
    try {
      // The stream's own component already names its *next* op; the host knows only the
      // completed ones.
      Clock done = st->clock;
      --done[s.id];
      detail::sim::join(host_clock_, done);
    } catch (const std::exception& ex) {
      return alloc_failure("synchronize", ex);
    }
    host_time_ns_ = std::max(host_time_ns_, st->time_ns);
    ++counters_.host_syncs;
    return take_async_error();
  }

  Status copy_async(void* dst, const void* src, std::size_t bytes, Stream s) noexcept {
    Label label = take_label();
    if (consume_fault(FaultKind::copy)) return injected(FaultKind::copy);
    if (live_stream(s) == nullptr) return bad_stream("copy_async", s);
    if (bytes == 0) return {};  // like cudaMemcpyAsync: nothing to do
    if (Status st = check_copy(dst, src, bytes); !st.ok()) return st;
    try {
      Op& op = push_op(s, SimOpKind::copy, std::move(label));
      op.copies.push_back(CopyDesc{dst, src, bytes});
      op.duration_ns = cost_.copy_cost(bytes);
      op.shares_link = cost_.model().copies_share_link;
      ++counters_.copies;
      counters_.copy_bytes += bytes;
      trace(SimCall::copy, s.id, 0, bytes, op.label);
      return {};
    } catch (const std::exception& ex) {
      return alloc_failure("copy_async", ex);
    }
  }

  Result<bool> is_capturing(Stream s) noexcept {
    StreamState* st = live_stream(s);
    if (st == nullptr) return bad_stream("is_capturing", s);
    return st->capturing;
  }

  // The host touches [p, p + bytes) now; checked like an op of the host actor.
  void host_access(const void* p, std::size_t bytes, AccessMode mode) noexcept {
    Label label = take_label();
    if (p == nullptr || bytes == 0) return;
    try {
      const AccessRec rec{0, host_clock_[0], next_seq_++, SimOpKind::host, mode, std::move(label)};
      check_access(reinterpret_cast<std::uintptr_t>(p), bytes, rec, host_clock_);
    } catch (const std::exception&) {
      // shadow bookkeeping could not allocate: the access goes unchecked
    }
  }

  // ---- extra operations -----------------------------------------------------------------

  // A kernel-like op: `body` runs at completion; `accesses` are checked by the race detector.
  Status launch(Stream s, std::span<const Access> accesses, std::function<void()> body = {}) noexcept {
    Label label = take_label();
    if (consume_fault(FaultKind::launch)) return injected(FaultKind::launch);
    if (live_stream(s) == nullptr) return bad_stream("launch", s);
    for (const Access& a : accesses)
      if (a.ptr == nullptr && a.bytes != 0)
        return Status(ErrorCode::invalid_argument, "SimRuntime: launch: access with a null pointer");
    try {
      Op& op = push_op(s, SimOpKind::launch, std::move(label));
      op.accesses.assign(accesses.begin(), accesses.end());
      op.body = std::move(body);
      op.duration_ns = cost_.take_duration(cost_.model().launch_ns);
      ++counters_.launches;
      trace(SimCall::launch, s.id, 0, 0, op.label);
      return {};
    } catch (const std::exception& ex) {
      return alloc_failure("launch", ex);
    }
  }

  // One op carrying several copies (cudaMemcpyBatchAsync-like). Rejected during capture.
  Status copy_batch_async(std::span<const CopyDesc> copies, Stream s) noexcept {
    Label label = take_label();
    if (consume_fault(FaultKind::copy)) return injected(FaultKind::copy);
    StreamState* st = live_stream(s);
    if (st == nullptr) return bad_stream("copy_batch_async", s);
    if (st->capturing)
      return Status(ErrorCode::capture_unsupported,
                    "SimRuntime: copy_batch_async on capturing stream #" + std::to_string(s.id) +
                        " (cudaMemcpyBatchAsync is not permitted while the stream is capturing)");
    std::size_t total = 0;
    for (const CopyDesc& c : copies) {
      if (c.bytes == 0) continue;
      if (Status bad = check_copy(c.dst, c.src, c.bytes); !bad.ok()) return bad;
      total += c.bytes;
    }
    if (total == 0) return {};
    try {
      Op& op = push_op(s, SimOpKind::copy_batch, std::move(label));
      double cost = 0.0;
      for (const CopyDesc& c : copies) {
        if (c.bytes == 0) continue;
        op.copies.push_back(c);
        cost += cost_.copy_cost(c.bytes);
      }
      op.duration_ns = cost;
      op.shares_link = cost_.model().copies_share_link;
      ++counters_.copy_batches;
      counters_.batch_copies += op.copies.size();
      counters_.copy_bytes += total;
      trace(SimCall::copy_batch, s.id, 0, total, op.label);
      return {};
    } catch (const std::exception& ex) {
      return alloc_failure("copy_batch_async", ex);
    }
  }

  // A gate op blocks its stream until the host calls open_gate (models a stream waiting on a
  // host-written flag). Opening creates a host -> stream edge. Synchronizing on work behind a
  // closed gate is a deadlock.
  Result<Gate> enqueue_gate(Stream s) noexcept {
    Label label = take_label();
    if (live_stream(s) == nullptr) return bad_stream("enqueue_gate", s);
    try {
      gates_.push_back(GateState{});
      const Gate g{static_cast<std::uint32_t>(gates_.size())};
      Op& op = push_op(s, SimOpKind::gate, std::move(label));
      op.gate = g.id;
      ++counters_.gates;
      trace(SimCall::gate, s.id, 0, 0, op.label);
      return g;
    } catch (const std::exception& ex) {
      return alloc_failure("enqueue_gate", ex);
    }
  }

  Status open_gate(Gate g) noexcept {
    if (g.id == 0 || g.id > gates_.size())
      return Status(ErrorCode::invalid_argument,
                    "SimRuntime: open_gate: unknown gate #" + std::to_string(g.id));
    GateState& gs = gates_[g.id - 1];
    if (gs.open) return {};
    try {
      gs.host_clock = host_clock_;
      gs.time_ns = host_time_ns_;
      gs.open = true;
      ++host_clock_[0];  // later host actions are not ordered before the gate's stream
      return {};
    } catch (const std::exception& ex) {
      return alloc_failure("open_gate", ex);
    }
  }

  Status set_capturing(Stream s, bool capturing) noexcept {
    StreamState* st = live_stream(s);
    if (st == nullptr) return bad_stream("set_capturing", s);
    st->capturing = capturing;
    return {};
  }

  // ---- progress ---------------------------------------------------------------------------

  // Completes the head op of `s` if it is ready; false when the stream is empty, blocked or
  // not a stream.
  bool step(Stream s) noexcept {
    if (s.id == 0 || s.id > streams_.size()) return false;
    if (!detail::sim::head_ready(*streams_[s.id - 1], gates_)) return false;
    execute_head(s.id);
    return true;
  }

  // Seeded scheduler: up to max_ops times, completes the head of a random stream whose head is
  // ready. Returns the number of ops completed (fewer when everything is done or blocked).
  std::size_t run_random(std::uint64_t seed,
                         std::size_t max_ops = std::numeric_limits<std::size_t>::max()) noexcept {
    Rng rng(seed);
    return run_some(rng, max_ops);
  }

  // Completes every op that can complete, in an order drawn from the runtime's own RNG.
  // Returns the number completed; idle() tells whether anything is left blocked.
  std::size_t drain() noexcept { return run_some(rng_, std::numeric_limits<std::size_t>::max()); }

  void set_seed(std::uint64_t seed) noexcept {
    seed_ = seed;
    rng_ = Rng(seed);
  }

  [[nodiscard]] bool idle() const noexcept { return pending_ops() == 0; }
  [[nodiscard]] std::size_t pending_ops() const noexcept {
    std::size_t n = 0;
    for (const auto& st : streams_) n += st->size();
    return n;
  }
  [[nodiscard]] std::size_t pending_ops(Stream s) const noexcept {
    return (s.id == 0 || s.id > streams_.size()) ? 0 : streams_[s.id - 1]->size();
  }

  // ---- memory -----------------------------------------------------------------------------

  // Runtime-owned memory (256-byte aligned, zero-filled), freed by deallocate, reset or the
  // destructor. Every kind is ordinary host memory; the kind only labels race reports.
  Result<void*> allocate(std::size_t bytes, MemoryKind kind) noexcept {
    if (bytes == 0) return Status(ErrorCode::invalid_argument, "SimRuntime: allocate of 0 bytes");
    if (bytes > options_.memory_limit - std::min(options_.memory_limit, allocated_bytes_))
      return Status(ErrorCode::runtime_failure,
                    "SimRuntime: allocate(" + std::to_string(bytes) + " bytes, " + to_string(kind) +
                        ") exceeds the simulated memory limit (" + std::to_string(allocated_bytes_) +
                        " of " + std::to_string(options_.memory_limit) + " bytes in use)");
    void* p = nullptr;
    try {
      p = ::operator new(bytes, std::align_val_t{alignment});
      std::memset(p, 0, bytes);
      allocations_.emplace(reinterpret_cast<std::uintptr_t>(p), Allocation{bytes, kind, ++allocation_ids_});
    } catch (const std::exception& e) {
      if (p != nullptr) ::operator delete(p, std::align_val_t{alignment});
      return Status(ErrorCode::runtime_failure, std::string("SimRuntime: allocate: ") + e.what());
    }
    allocated_bytes_ += bytes;
    return p;
  }

  // Marks `s` as a host-issued stream (a copy proxy's): deallocate reports memory freed while
  // one of its pending ops touches it.
  void set_host_issued(Stream s) noexcept {
    if (StreamState* st = live_stream(s)) st->host_issued = true;
  }

  // Frees an allocate()d block and forgets its access history. No pending op may touch it: a
  // pending op of a host-issued stream that does is reported as a race ("freed while ..."), and
  // the block then stays allocated until reset() or the destructor, so the op stays harmless.
  Status deallocate(void* p) noexcept {
    const auto it = allocations_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == allocations_.end())
      return Status(ErrorCode::invalid_argument,
                    "SimRuntime: deallocate of a pointer allocate() did not return");
    if (report_freed_under_pending(it->first, it->first + it->second.bytes, it->second)) return {};
    shadow_.forget(it->first, it->first + it->second.bytes);
    allocated_bytes_ -= it->second.bytes;
    ::operator delete(p, std::align_val_t{alignment});
    allocations_.erase(it);
    return {};
  }

  [[nodiscard]] std::size_t allocated_bytes() const noexcept { return allocated_bytes_; }

  // Caller-owned host memory (CudaRuntime: cudaHostRegister). Nothing changes in the memory;
  // the runtime only records the range, refusing what CUDA refuses: null, 0 bytes, a range
  // overlapping a registered one, unregistering an address that was not registered.
  Status register_host(void* p, std::size_t bytes) noexcept {
    if (p == nullptr || bytes == 0) return Status(ErrorCode::invalid_argument, "SimRuntime: register_host: null pointer or 0 bytes");
    const auto b = reinterpret_cast<std::uintptr_t>(p);
    auto next = registered_.lower_bound(b);
    if ((next != registered_.end() && next->first < b + bytes) ||
        (next != registered_.begin() && std::prev(next)->first + std::prev(next)->second > b))
      return Status(ErrorCode::invalid_argument, "SimRuntime: register_host: the range overlaps a registered one");
    try {
      registered_.emplace(b, bytes);
    } catch (const std::exception& ex) {
      return alloc_failure("register_host", ex);
    }
    return {};
  }
  Status unregister_host(void* p) noexcept {
    if (registered_.erase(reinterpret_cast<std::uintptr_t>(p)) == 0)
      return Status(ErrorCode::invalid_argument, "SimRuntime: unregister_host of an address that is not registered");
    return {};
  }
  [[nodiscard]] std::size_t registered_ranges() const noexcept { return registered_.size(); }
  [[nodiscard]] bool is_registered(const void* p, std::size_t bytes) const noexcept {
    const auto it = registered_.find(reinterpret_cast<std::uintptr_t>(p));
    return it != registered_.end() && it->second == bytes;
  }

  // ---- races, labels, faults, counters, trace -----------------------------------------------

  [[nodiscard]] std::span<const RaceReport> races() const noexcept { return shadow_.races(); }
  [[nodiscard]] std::uint64_t race_count() const noexcept { return shadow_.race_count(); }  // incl. dropped
  void clear_races() noexcept { shadow_.clear_races(); }

  // Label for the next enqueued op or host_access (consumed by it, even if the call fails).
  void set_next_label(std::string_view label) {
    next_label_ = label.empty() ? nullptr : std::make_shared<const std::string>(label);
  }
  void set_stream_name(Stream s, std::string_view name) {
    if (StreamState* st = live_stream(s)) st->name = std::string(name);
  }

  // The nth call of `kind` from now (1 = the next one) fails with runtime_failure and
  // enqueues nothing. Several injections may be pending at once.
  void inject_failure(FaultKind kind, std::uint64_t nth = 1) {
    faults_.inject(kind, nth);
  }
  void clear_failures() noexcept { faults_.clear_pending(); }

  [[nodiscard]] const SimCounters& counters() const noexcept { return counters_; }

  void set_cost_model(const SimCostModel& model) noexcept { cost_.set_model(model); }
  [[nodiscard]] const SimCostModel& cost_model() const noexcept { return cost_.model(); }
  // Duration of the next launch (overrides SimCostModel::launch_ns once).
  void set_next_duration_ns(double ns) noexcept { cost_.set_next_duration_ns(ns); }
  [[nodiscard]] double host_time_ns() const noexcept { return host_time_ns_; }
  [[nodiscard]] double stream_time_ns(Stream s) const noexcept {
    return (s.id == 0 || s.id > streams_.size()) ? 0.0 : streams_[s.id - 1]->time_ns;
  }

  void set_tracing(bool on) noexcept { tracing_ = on; }
  [[nodiscard]] std::span<const SimTraceEntry> trace_log() const noexcept { return trace_; }
  void clear_trace() noexcept { trace_.clear(); }

  // Back to the freshly constructed state (handles invalidated, memory freed, counters,
  // races, faults and trace cleared); keeps options, cost model and the current seed.
  void reset() noexcept {
    free_all();
    streams_.clear();
    events_.clear();
    gates_.clear();
    shadow_.clear();
    counters_ = {};
    faults_.reset();
    trace_.clear();
    next_label_.reset();
    cost_.clear_override();
    next_seq_ = 1;
    allocation_ids_ = 0;
    host_time_ns_ = 0.0;
    link_.clear();
    async_error_ = {};
    rng_ = Rng(seed_);
    reset_clocks();
  }

 private:
  using Clock = detail::sim::Clock;
  using Label = detail::sim::Label;
  using Rng = detail::sim::Rng;
  using Op = detail::sim::Op;
  using RecordState = detail::sim::RecordState;
  using StreamState = detail::sim::StreamState;
  using EventState = detail::sim::EventState;
  using GateState = detail::sim::GateState;
  using AccessRec = detail::sim::AccessRec;
  static constexpr std::size_t alignment = 256;

  struct Allocation {
    std::size_t bytes = 0;
    MemoryKind kind = MemoryKind::device;
    std::uint64_t id = 0;
  };

  // ---- handles & errors ----

  StreamState* live_stream(Stream s) noexcept {
    if (s.id == 0 || s.id > streams_.size()) return nullptr;
    StreamState* st = streams_[s.id - 1].get();
    return st->alive ? st : nullptr;
  }
  EventState* live_event(Event e) noexcept {
    if (e.id == 0 || e.id > events_.size()) return nullptr;
    EventState* ev = &events_[e.id - 1];
    return ev->alive ? ev : nullptr;
  }
  static Status bad_stream(const char* verb, Stream s) {
    return Status(ErrorCode::invalid_argument,
                  std::string("SimRuntime: ") + verb + ": stream #" + std::to_string(s.id) +
                      " is not a live stream");
  }
  static Status bad_event(const char* verb, Event e) {
    return Status(ErrorCode::invalid_argument,
                  std::string("SimRuntime: ") + verb + ": event #" + std::to_string(e.id) +
                      " is not a live event");
  }
  static Status alloc_failure(const char* verb, const std::exception& e) {
    return Status(ErrorCode::runtime_failure, std::string("SimRuntime: ") + verb + ": " + e.what());
  }
  static Status check_copy(void* dst, const void* src, std::size_t bytes) {
    if (dst == nullptr || src == nullptr)
      return Status(ErrorCode::invalid_argument, "SimRuntime: copy with a null pointer");
    const auto d = reinterpret_cast<std::uintptr_t>(dst);
    const auto s = reinterpret_cast<std::uintptr_t>(src);
    if (d < s + bytes && s < d + bytes)
      return Status(ErrorCode::invalid_argument, "SimRuntime: copy source and destination overlap");
    return {};
  }

  bool consume_fault(FaultKind kind) noexcept { return faults_.consume(kind); }
  Status injected(FaultKind kind) {
    ++counters_.injected_failures;
    return Status(ErrorCode::runtime_failure,
                  std::string("SimRuntime: injected failure of ") + to_string(kind) + " call #" +
                      std::to_string(faults_.calls(kind)) +
                      " (nothing was enqueued)");
  }

  Status deadlock(const std::string& what) {
    std::string msg = "SimRuntime: deadlock: " + what + " cannot complete; no stream can progress.";
    for (std::size_t i = 0; i < streams_.size(); ++i) {
      const StreamState& st = *streams_[i];
      if (st.empty()) continue;
      const Op& op = st.ops[st.head];
      msg += " stream #" + std::to_string(i + 1) + " (" + std::to_string(st.size()) +
             " pending) is blocked on " +
             to_string(op.kind) + " op #" + std::to_string(op.seq);
      if (op.kind == SimOpKind::wait)
        msg += " awaiting record op #" + std::to_string(op.record->seq) + " on stream #" +
               std::to_string(op.record->stream);
      if (op.kind == SimOpKind::gate) msg += " (gate #" + std::to_string(op.gate) + " closed)";
      if (op.label) msg += " '" + *op.label + "'";
      msg += ";";
    }
    return Status(ErrorCode::runtime_failure, std::move(msg));
  }

  Status take_async_error() {
    Status err = std::move(async_error_);
    async_error_ = {};
    return err;
  }

  Label take_label() noexcept { return std::move(next_label_); }
  void trace(SimCall call, std::uint32_t stream, std::uint32_t event, std::size_t bytes, const Label& label) {
    if (!tracing_) return;
    trace_.push_back(SimTraceEntry{call, stream, event, bytes, label ? *label : std::string()});
  }

  // ---- clocks ----

  void reset_clocks() {
    host_clock_.assign(1, 1);
  }
  void acquire_on_host(const RecordState& rec) {
    detail::sim::join(host_clock_, rec.clock);
    host_time_ns_ = std::max(host_time_ns_, rec.time_ns);
  }

  // Enqueue: the op inherits the host's clock (host -> op edge), then the host ticks so its
  // later actions are not ordered before the op.
  Op& push_op(Stream s, SimOpKind kind, Label label) {
    Op& op = streams_[s.id - 1]->push();
    op.kind = kind;
    op.seq = next_seq_++;
    op.host_clock = host_clock_;
    host_time_ns_ += cost_.model().host_call_ns;
    op.host_time_ns = host_time_ns_;
    op.label = std::move(label);
    ++host_clock_[0];
    return op;
  }

  // ---- scheduling ----

  // With a shared link the heads complete in virtual-time order (the link is booked as a real
  // one serves it); otherwise in a seeded random order (the schedules the race detector explores).
  std::uint32_t pick_ready(Rng& rng) {
    if (cost_.model().copies_share_link) return detail::sim::pick_earliest(streams_, gates_);
    return detail::sim::pick_ready(streams_, gates_, rng, ready_);
  }

  std::size_t run_some(Rng& rng, std::size_t max_ops) noexcept {
    std::size_t done = 0;
    try {
      while (done < max_ops) {
        const std::uint32_t sid = pick_ready(rng);
        if (sid == 0) break;
        execute_head(sid);
        ++done;
      }
    } catch (const std::exception&) {  // scratch allocation failed: stop early
    }
    return done;
  }

  // Runs random ready ops until `done()`; false on deadlock.
  template <class Pred>
  bool run_until(Pred done, Rng& rng) noexcept {
    try {
      while (!done()) {
        const std::uint32_t sid = pick_ready(rng);
        if (sid == 0) return false;
        execute_head(sid);
      }
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  void execute_head(std::uint32_t sid) noexcept {
    StreamState& st = *streams_[sid - 1];
    Op op = st.pop();
    try {
      detail::sim::join(st.clock, op.host_clock);
      double start = std::max(st.time_ns, op.host_time_ns);
      if (op.kind == SimOpKind::wait) {
        detail::sim::join(st.clock, op.record->clock);
        start = std::max(start, op.record->time_ns);
      } else if (op.kind == SimOpKind::gate) {
        const GateState& g = gates_[op.gate - 1];
        detail::sim::join(st.clock, g.host_clock);
        start = std::max(start, g.time_ns);
      }
      const std::uint32_t epoch = st.clock[sid];
      const auto rec = [&](AccessMode mode) {
        return AccessRec{sid, epoch, op.seq, op.kind, mode, op.label};
      };
      switch (op.kind) {
        case SimOpKind::copy:
        case SimOpKind::copy_batch:
          for (const CopyDesc& c : op.copies) {
            check_access(reinterpret_cast<std::uintptr_t>(c.src), c.bytes, rec(AccessMode::read), st.clock);
            check_access(reinterpret_cast<std::uintptr_t>(c.dst), c.bytes, rec(AccessMode::write), st.clock);
          }
          for (const CopyDesc& c : op.copies) std::memcpy(c.dst, c.src, c.bytes);
          break;
        case SimOpKind::launch:
          for (const Access& a : op.accesses)
            if (a.bytes != 0)
              check_access(reinterpret_cast<std::uintptr_t>(a.ptr), a.bytes, rec(a.mode), st.clock);
          if (op.body) {
            try {
              op.body();
            } catch (const std::exception& e) {
              if (async_error_.ok())
                async_error_ = Status(ErrorCode::runtime_failure,
                                      "SimRuntime: launch op #" + std::to_string(op.seq) +
                                          " body threw: " + e.what());
            }
          }
          break;
        default: break;
      }
      if (op.shares_link) start = link_.book(start, op.duration_ns);
      st.time_ns = start + op.duration_ns;
      if (op.kind == SimOpKind::record) {
        op.record->clock = st.clock;
        op.record->time_ns = st.time_ns;
        op.record->completed = true;
      }
      ++st.clock[sid];  // the next op on this stream is ordered after this one
      ++counters_.completed_ops;
    } catch (...) {
      // Out of memory in bookkeeping. Still complete a record so waiters cannot hang forever.
      if (op.kind == SimOpKind::record) op.record->completed = true;
      if (async_error_.ok())
        async_error_ = Status(ErrorCode::runtime_failure, "SimRuntime: out of memory while completing an op");
    }
  }

  // ---- race reports ----

  // A pending op of a host-issued stream touching [lo, hi): one report, true.
  bool report_freed_under_pending(std::uintptr_t lo, std::uintptr_t hi, const Allocation& a) noexcept {
    const auto touches = [&](const void* ptr, std::size_t bytes) {
      const auto b = reinterpret_cast<std::uintptr_t>(ptr);
      return bytes != 0 && b < hi && lo < b + bytes;
    };
    for (std::size_t k = 0; k < streams_.size(); ++k) {
      const StreamState& st = *streams_[k];
      if (!st.host_issued) continue;
      for (std::size_t i = st.head; i < st.ops.size(); ++i) {
        const Op& op = st.ops[i];
        bool hit = false;
        for (const CopyDesc& c : op.copies) hit = hit || touches(c.src, c.bytes) || touches(c.dst, c.bytes);
        for (const Access& x : op.accesses) hit = hit || touches(x.ptr, x.bytes);
        if (!hit) continue;
        try {
          RaceReport r;
          r.earlier = RaceReport::Side{op.kind, AccessMode::write, static_cast<std::uint32_t>(k + 1), op.seq,
                                       op.label ? *op.label : std::string()};
          r.later = RaceReport::Side{SimOpKind::host, AccessMode::write, 0, next_seq_, "deallocate"};
          r.begin = lo;
          r.end = hi;
          r.description = std::string(to_string(a.kind)) + " allocation #" + std::to_string(a.id) +
                          " freed while " + describe_side(r.earlier) +
                          ", issued by a host thread, is still pending and touches it";
          shadow_.add_report(std::move(r), options_.max_races);
        } catch (...) {
        }
        return true;
      }
    }
    return false;
  }

  void check_access(std::uintptr_t lo, std::size_t bytes, const AccessRec& acc, const Clock& clock) {
    shadow_.check(lo, bytes, acc, clock, options_.max_races, [this](RaceReport& r) { describe(r); });
  }

  std::string describe_side(const RaceReport::Side& s) const {
    std::string out = std::string(to_string(s.mode)) + " by " + to_string(s.kind);
    if (!s.label.empty()) out += " '" + s.label + "'";
    out += " (op #" + std::to_string(s.op) + " on ";
    if (s.stream == 0) {
      out += "the host)";
    } else {
      out += "stream #" + std::to_string(s.stream);
      const std::string& name = streams_[s.stream - 1]->name;
      if (!name.empty()) out += " '" + name + "'";
      out += ")";
    }
    return out;
  }

  void describe(RaceReport& r) const {
    char addr[64];
    std::snprintf(addr, sizeof addr, "[0x%llx, 0x%llx)", static_cast<unsigned long long>(r.begin),
                  static_cast<unsigned long long>(r.end));
    std::string where = std::to_string(r.end - r.begin) + " bytes " + addr;
    auto it = allocations_.upper_bound(r.begin);
    if (it != allocations_.begin()) {
      --it;
      if (r.begin < it->first + it->second.bytes)
        where += " = " + std::string(to_string(it->second.kind)) + " allocation #" +
                 std::to_string(it->second.id) + " bytes [" + std::to_string(r.begin - it->first) + ", " +
                 std::to_string(r.end - it->first) + ")";
    }
    r.description = "data race on " + where + ": " + describe_side(r.earlier) + " and " +
                    describe_side(r.later) +
                    " are not ordered by happens-before";
  }

  void free_all() noexcept {
    for (const auto& [addr, a] : allocations_)
      ::operator delete(reinterpret_cast<void*>(addr), std::align_val_t{alignment});
    allocations_.clear();
    allocated_bytes_ = 0;
  }

  Options options_;
  std::uint64_t seed_;
  Rng rng_;
  detail::sim::CostClock cost_;
  std::vector<std::unique_ptr<StreamState>> streams_;  // id k at index k - 1
  std::vector<EventState> events_;
  std::vector<GateState> gates_;
  Clock host_clock_;
  double host_time_ns_ = 0.0;
  detail::sim::LinkTimeline link_;  // SimCostModel::copies_share_link
  std::uint64_t next_seq_ = 1;
  Label next_label_;
  detail::sim::ShadowMemory shadow_;
  std::vector<std::uint32_t> ready_;   // scratch: streams with a ready head
  std::map<std::uintptr_t, Allocation> allocations_;
  std::size_t allocated_bytes_ = 0;
  std::uint64_t allocation_ids_ = 0;
  std::map<std::uintptr_t, std::size_t> registered_;  // register_host ranges: begin -> bytes
  detail::sim::FaultInjector faults_;
  SimCounters counters_;
  Status async_error_;
  bool tracing_ = false;
  std::vector<SimTraceEntry> trace_;
};

static_assert(runtime<SimRuntime>);
static_assert(allocating_runtime<SimRuntime>);
static_assert(batching_runtime<SimRuntime>);

}  // namespace expert_cache::inline v0
