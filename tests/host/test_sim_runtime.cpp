#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <bitset>
#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "expert_cache/runtime/runtime.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

using namespace expert_cache;
using Stream = SimRuntime::Stream;
using Event = SimRuntime::Event;

static_assert(runtime<SimRuntime>);
static_assert(runtime_handle<SimRuntime::Stream> && runtime_handle<SimRuntime::Event>);

namespace {

// Missing host_access: not a runtime.
struct NoHostAccess {
  using Stream = int*;
  using Event = long*;
  Result<Stream> create_stream() { return Stream{}; }
  void destroy_stream(Stream) noexcept {}
  Result<Event> create_event() { return Event{}; }
  void destroy_event(Event) noexcept {}
  Status record(Event, Stream) noexcept { return {}; }
  Status wait(Stream, Event) noexcept { return {}; }
  Result<bool> query(Event) noexcept { return true; }
  Status synchronize(Event) noexcept { return {}; }
  Status synchronize(Stream) noexcept { return {}; }
  Status copy_async(void*, const void*, std::size_t, Stream) noexcept { return {}; }
  Result<bool> is_capturing(Stream) noexcept { return false; }
};
static_assert(!runtime<NoHostAccess>);

struct NotNoexcept {
  struct Stream {
    int v = 0;
    friend bool operator==(Stream, Stream) = default;
  };
  struct Event {
    int v = 0;
    friend bool operator==(Event, Event) = default;
  };
  Result<Stream> create_stream() { return Stream{}; }
  void destroy_stream(Stream) noexcept {}
  Result<Event> create_event() { return Event{}; }
  void destroy_event(Event) noexcept {}
  Status record(Event, Stream) { return {}; }  // missing noexcept
  Status wait(Stream, Event) noexcept { return {}; }
  Result<bool> query(Event) noexcept { return true; }
  Status synchronize(Event) noexcept { return {}; }
  Status synchronize(Stream) noexcept { return {}; }
  Status copy_async(void*, const void*, std::size_t, Stream) noexcept { return {}; }
  Result<bool> is_capturing(Stream) noexcept { return false; }
  void host_access(const void*, std::size_t, AccessMode) noexcept {}
};
static_assert(!runtime<NotNoexcept>);

template <class T>
T* alloc(SimRuntime& rt, std::size_t n, MemoryKind kind) {
  return static_cast<T*>(rt.allocate(n * sizeof(T), kind).value());
}

std::string all_descriptions(const SimRuntime& rt) {
  std::string s;
  for (const RaceReport& r : rt.races()) s += r.description + "\n";
  return s;
}

// The set-ups most cases start from: a fresh runtime with one, two or three streams.
struct OneStream {
  SimRuntime rt;
  const Stream s = rt.create_stream().value();
};
struct TwoStreamRuntime {
  SimRuntime rt;
  const Stream s1 = rt.create_stream().value();
  const Stream s2 = rt.create_stream().value();
};
struct ThreeStreams : TwoStreamRuntime {
  const Stream s3 = rt.create_stream().value();
};

// One stream copies device bytes d into pinned host bytes h, then records e.
struct DeviceToHost : OneStream {
  const Event e = rt.create_event().value();
  std::uint8_t* h = alloc<std::uint8_t>(rt, 32, MemoryKind::pinned_host);
  std::uint8_t* d = alloc<std::uint8_t>(rt, 32, MemoryKind::device);
  DeviceToHost() {
    REQUIRE(rt.copy_async(h, d, 32, s).ok());  // D2H into h
    REQUIRE(rt.record(e, s).ok());
  }
};

// Producer/consumer on two streams: s1 copies src -> buf, s2 reads buf (launch).
struct TwoStreams {
  SimRuntime rt;
  Stream s1 = rt.create_stream().value();
  Stream s2 = rt.create_stream().value();
  Event ev = rt.create_event().value();
  std::uint8_t* src = alloc<std::uint8_t>(rt, 64, MemoryKind::pinned_host);
  std::uint8_t* buf = alloc<std::uint8_t>(rt, 64, MemoryKind::device);
  std::uint8_t* out = alloc<std::uint8_t>(rt, 64, MemoryKind::device);

  TwoStreams() {
    for (int i = 0; i < 64; ++i) src[i] = static_cast<std::uint8_t>(i + 1);
    rt.set_stream_name(s1, "copy");
    rt.set_stream_name(s2, "compute");
  }

  void enqueue(bool with_wait) {
    rt.set_next_label("fill buf");
    REQUIRE(rt.copy_async(buf, src, 64, s1).ok());
    REQUIRE(rt.record(ev, s1).ok());
    if (with_wait) REQUIRE(rt.wait(s2, ev).ok());
    const std::array<Access, 2> acc{Access{buf, 64, AccessMode::read}, Access{out, 64, AccessMode::write}};
    rt.set_next_label("gemm");
    REQUIRE(rt.launch(s2, acc, [this] { std::memcpy(out, buf, 64); }).ok());
  }
};

}  // namespace

TEST_CASE_FIXTURE(OneStream, "nothing runs at enqueue; copy bytes land only when the op completes") {
  auto* src = alloc<std::uint32_t>(rt, 4, MemoryKind::pinned_host);
  auto* dst = alloc<std::uint32_t>(rt, 4, MemoryKind::device);
  for (std::uint32_t i = 0; i < 4; ++i) src[i] = 100 + i;
  REQUIRE(rt.copy_async(dst, src, 16, s).ok());
  CHECK(rt.pending_ops() == 1);
  CHECK(dst[0] == 0);
  CHECK(rt.step(s));
  CHECK(dst[3] == 103);
  CHECK_FALSE(rt.step(s));  // empty
  CHECK(rt.idle());
  CHECK(rt.counters().copies == 1);
  CHECK(rt.counters().copy_bytes == 16);
  CHECK(rt.counters().completed_ops == 1);
  CHECK(rt.races().empty());
}

TEST_CASE("stream order is honoured under every schedule") {
  for (std::uint64_t seed = 0; seed < 200; ++seed) {
    SimRuntime rt;
    const Stream s = rt.create_stream().value();
    const Stream other = rt.create_stream().value();
    auto* a = alloc<std::uint32_t>(rt, 8, MemoryKind::pinned_host);
    auto* b = alloc<std::uint32_t>(rt, 8, MemoryKind::device);
    auto* c = alloc<std::uint32_t>(rt, 8, MemoryKind::device);
    auto* unrelated = alloc<std::uint32_t>(rt, 8, MemoryKind::device);
    for (std::uint32_t i = 0; i < 8; ++i) a[i] = 7 * i + 1;
    std::vector<int> order;
    REQUIRE(rt.copy_async(b, a, 32, s).ok());  // b <- a
    REQUIRE(rt.launch(s, std::array{Access{b, 32, AccessMode::write}}, [&] {
      order.push_back(1);
      for (int i = 0; i < 8; ++i) b[i] *= 2;
    }).ok());
    REQUIRE(rt.copy_async(c, b, 32, s).ok());  // c <- b (after the doubling)
    REQUIRE(rt.launch(s, std::array{Access{c, 32, AccessMode::read}}, [&] { order.push_back(2); }).ok());
    REQUIRE(rt.launch(other, std::array{Access{unrelated, 32, AccessMode::write}}, [&] {
      order.push_back(9);
    }).ok());
    rt.run_random(seed);
    CHECK(rt.idle());
    for (std::uint32_t i = 0; i < 8; ++i) CHECK(c[i] == 2 * (7 * i + 1));
    std::erase(order, 9);
    CHECK(order == std::vector<int>{1, 2});
    CHECK(rt.races().empty());
  }
}

TEST_CASE("an event edge orders two streams; removing the wait makes the detector fire") {
  for (std::uint64_t seed = 0; seed < 100; ++seed) {
    TwoStreams t;
    t.enqueue(/*with_wait=*/true);
    t.rt.run_random(seed);
    REQUIRE(t.rt.idle());
    CHECK(t.rt.races().empty());
    CHECK(t.out[63] == 64);
  }
  bool saw_stale_read = false;
  for (std::uint64_t seed = 0; seed < 100; ++seed) {
    TwoStreams t;
    t.enqueue(/*with_wait=*/false);
    t.rt.run_random(seed);
    REQUIRE(t.rt.idle());
    // Whatever the interleaving, the missing edge is reported (here exactly once).
    REQUIRE(t.rt.races().size() == 1);
    const RaceReport& r = t.rt.races()[0];
    CHECK(r.end - r.begin == 64);
    CHECK(r.begin == reinterpret_cast<std::uintptr_t>(t.buf));
    const bool copy_first = r.earlier.kind == SimOpKind::copy;
    CHECK((copy_first ? r.later.kind : r.earlier.kind) == SimOpKind::launch);
    CHECK((copy_first ? r.earlier.stream : r.later.stream) == t.s1.id);
    const std::string& d = r.description;
    CHECK(d.find("'fill buf'") != std::string::npos);
    CHECK(d.find("'gemm'") != std::string::npos);
    CHECK(d.find("'copy'") != std::string::npos);
    CHECK(d.find("'compute'") != std::string::npos);
    CHECK(d.find("device allocation") != std::string::npos);
    CHECK(d.find("bytes [0, 64)") != std::string::npos);
    saw_stale_read |= t.out[63] == 0;
  }
  CHECK(saw_stale_read);  // and some schedule really read the slot before it was filled
}

TEST_CASE_FIXTURE(ThreeStreams, "happens-before is transitive across a chain of streams and through the host") {
  const Event e1 = rt.create_event().value();
  const Event e2 = rt.create_event().value();
  auto* x = alloc<std::uint8_t>(rt, 16, MemoryKind::device);
  auto* y = alloc<std::uint8_t>(rt, 16, MemoryKind::device);
  REQUIRE(rt.launch(s1, std::array{Access{x, 16, AccessMode::write}}).ok());
  REQUIRE(rt.record(e1, s1).ok());
  REQUIRE(rt.wait(s2, e1).ok());
  REQUIRE(rt.launch(s2, std::array{Access{y, 16, AccessMode::write}}).ok());
  REQUIRE(rt.record(e2, s2).ok());
  REQUIRE(rt.wait(s3, e2).ok());
  REQUIRE(rt.launch(s3, std::array{Access{x, 16, AccessMode::write}, Access{y, 8, AccessMode::read}}).ok());
  rt.drain();
  CHECK(rt.idle());
  CHECK(rt.races().empty());

  // Host edge: s1 writes, the host synchronizes s1 and then enqueues on s2 without an event.
  SimRuntime rt2;
  const Stream a = rt2.create_stream().value();
  const Stream b = rt2.create_stream().value();
  auto* z = alloc<std::uint8_t>(rt2, 16, MemoryKind::device);
  REQUIRE(rt2.launch(a, std::array{Access{z, 16, AccessMode::write}}).ok());
  REQUIRE(rt2.synchronize(a).ok());
  REQUIRE(rt2.launch(b, std::array{Access{z, 16, AccessMode::write}}).ok());
  rt2.drain();
  CHECK(rt2.races().empty());
}

TEST_CASE_FIXTURE(TwoStreamRuntime, "re-recording replaces the record; a wait keeps the record current at wait time") {
  const Event e = rt.create_event().value();
  auto* x = alloc<std::uint8_t>(rt, 8, MemoryKind::device);
  auto* y = alloc<std::uint8_t>(rt, 8, MemoryKind::device);

  REQUIRE(rt.launch(s1, std::array{Access{x, 8, AccessMode::write}}).ok());  // A
  REQUIRE(rt.record(e, s1).ok());                                            // r1
  REQUIRE(rt.wait(s2, e).ok());                                              // waits on r1
  const auto gate = rt.enqueue_gate(s1).value();                             // holds B back
  REQUIRE(rt.launch(s1, std::array{Access{y, 8, AccessMode::write}}).ok());  // B
  REQUIRE(rt.record(e, s1).ok());                                            // r2 replaces r1
  REQUIRE(rt.launch(s2, std::array{Access{x, 8, AccessMode::read}}).ok());   // ordered after A only

  CHECK_FALSE(rt.step(s2));  // r1 not complete yet
  CHECK(rt.step(s1));        // A
  CHECK(rt.step(s1));        // r1
  CHECK_FALSE(rt.query(e).value());  // the latest record (r2) is behind the gate
  CHECK(rt.step(s2));        // the wait on r1 is satisfied although r2 is pending
  CHECK(rt.step(s2));        // read x
  CHECK(rt.races().empty());

  // A wait issued now captures r2, so it cannot pass before the gate opens.
  REQUIRE(rt.wait(s2, e).ok());
  REQUIRE(rt.launch(s2, std::array{Access{y, 8, AccessMode::read}}).ok());
  CHECK_FALSE(rt.step(s2));
  CHECK(rt.run_random(1) == 0);  // s1 blocked on the gate, s2 on r2
  REQUIRE(rt.open_gate(gate).ok());
  rt.drain();
  CHECK(rt.idle());
  CHECK(rt.query(e).value());
  CHECK(rt.races().empty());
}

TEST_CASE_FIXTURE(OneStream, "waiting on a never-recorded event is a no-op; query is true and synchronize returns") {
  const Event e = rt.create_event().value();
  CHECK(rt.query(e).value());
  CHECK(rt.synchronize(e).ok());
  REQUIRE(rt.wait(s, e).ok());
  CHECK(rt.pending_ops() == 0);
  CHECK(rt.counters().noop_waits == 1);
  CHECK(rt.counters().waits == 0);
  auto* x = alloc<std::uint8_t>(rt, 8, MemoryKind::device);
  REQUIRE(rt.launch(s, std::array{Access{x, 8, AccessMode::write}}).ok());
  CHECK(rt.step(s));  // nothing blocks the stream
}

TEST_CASE_FIXTURE(DeviceToHost, "synchronize and query()==true order the host after device work") {
  SUBCASE("host_access after synchronize(event) is race-free") {
    REQUIRE(rt.synchronize(e).ok());
    rt.host_access(h, 32, AccessMode::read);
    rt.host_access(h, 32, AccessMode::write);
    CHECK(rt.races().empty());
    CHECK(rt.counters().host_syncs == 1);
  }
  SUBCASE("host_access after synchronize(stream) is race-free") {
    REQUIRE(rt.synchronize(s).ok());
    rt.host_access(h, 32, AccessMode::write);
    CHECK(rt.races().empty());
    // The edge covers only work completed at the synchronize, not the stream's next op.
    REQUIRE(rt.copy_async(h, d, 32, s).ok());
    rt.drain();
    rt.host_access(h, 4, AccessMode::read);
    CHECK(rt.races().size() == 1);
  }
  SUBCASE("query()==true creates the edge; query()==false does not") {
    CHECK_FALSE(rt.query(e).value());
    rt.drain();  // the work completes, but the host has not observed it yet
    rt.host_access(h, 8, AccessMode::read);
    CHECK(rt.races().size() == 1);
    rt.clear_races();
    CHECK(rt.query(e).value());
    rt.host_access(h, 32, AccessMode::write);
    CHECK(rt.races().empty());
  }
  SUBCASE("host_access before synchronize races, whichever side the sim runs first") {
    for (bool complete_first : {false, true}) {
      DeviceToHost f;  // a fresh runtime per order
      if (complete_first) f.rt.drain();
      f.rt.set_next_label("host reads result early");
      f.rt.host_access(f.h + 8, 4, AccessMode::read);
      REQUIRE(f.rt.synchronize(f.e).ok());
      REQUIRE(f.rt.races().size() == 1);
      const RaceReport& r = f.rt.races()[0];
      CHECK(r.end - r.begin == 4);
      CHECK(r.description.find("the host") != std::string::npos);
      CHECK(r.description.find("host reads result early") != std::string::npos);
      CHECK(r.description.find("pinned_host allocation") != std::string::npos);
    }
  }
}

TEST_CASE_FIXTURE(OneStream, "host enqueue orders earlier host writes before the op; later host writes race") {
  const Event e = rt.create_event().value();
  auto* staging = alloc<std::uint8_t>(rt, 16, MemoryKind::pinned_host);
  auto* dev = alloc<std::uint8_t>(rt, 16, MemoryKind::device);
  rt.host_access(staging, 16, AccessMode::write);
  std::memset(staging, 5, 16);
  REQUIRE(rt.copy_async(dev, staging, 16, s).ok());
  REQUIRE(rt.record(e, s).ok());
  rt.drain();
  CHECK(rt.races().empty());
  CHECK(dev[15] == 5);
  // Reusing the staging buffer before observing the copy is a WAR race ...
  rt.host_access(staging, 16, AccessMode::write);
  REQUIRE(rt.races().size() == 1);
  CHECK(rt.races()[0].earlier.mode == AccessMode::read);
  CHECK(rt.races()[0].later.mode == AccessMode::write);
  rt.clear_races();
  // ... and after synchronizing the copy's event it is fine.
  REQUIRE(rt.synchronize(e).ok());
  rt.host_access(staging, 16, AccessMode::write);
  CHECK(rt.races().empty());
}

TEST_CASE_FIXTURE(TwoStreamRuntime, "detector basics: read/read, disjoint and adjacent ranges, partial overlap, write/write") {
  auto* m = alloc<std::uint8_t>(rt, 256, MemoryKind::device);
  auto launch = [&](Stream s, std::size_t off, std::size_t n, AccessMode mode) {
    REQUIRE(rt.launch(s, std::array{Access{m + off, n, mode}}).ok());
  };
  launch(s1, 0, 64, AccessMode::read);
  launch(s2, 0, 64, AccessMode::read);    // read/read: fine
  launch(s1, 64, 64, AccessMode::write);
  launch(s2, 128, 64, AccessMode::write);  // adjacent, not overlapping
  rt.drain();
  CHECK(rt.races().empty());

  launch(s1, 100, 50, AccessMode::write);  // overlaps s2's [128, 192) in [128, 150)
  rt.drain();
  REQUIRE(rt.races().size() == 1);
  CHECK(rt.races()[0].begin == reinterpret_cast<std::uintptr_t>(m + 128));
  CHECK(rt.races()[0].end == reinterpret_cast<std::uintptr_t>(m + 150));
  CHECK(rt.races()[0].earlier.mode == AccessMode::write);
  CHECK(rt.races()[0].later.mode == AccessMode::write);
  rt.clear_races();
  CHECK(rt.race_count() == 0);

  launch(s2, 0, 8, AccessMode::write);  // WAR against both earlier readers of [0, 64)
  rt.drain();
  REQUIRE(rt.races().size() == 1);  // s1's read; s2's own read is in stream order
  CHECK(rt.races()[0].earlier.stream == s1.id);
}

TEST_CASE("different seeds give different interleavings, race-free programs the same bytes") {
  constexpr int streams = 3;
  constexpr int ops_per_stream = 6;
  std::set<std::vector<int>> interleavings;
  std::vector<std::uint8_t> reference;
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    SimRuntime rt;
    std::vector<Stream> s;
    for (int i = 0; i < streams; ++i) s.push_back(rt.create_stream().value());
    const Event e = rt.create_event().value();
    auto* src = alloc<std::uint8_t>(rt, 256, MemoryKind::pinned_host);
    auto* dst = alloc<std::uint8_t>(rt, 256, MemoryKind::device);
    for (int i = 0; i < 256; ++i) src[i] = static_cast<std::uint8_t>(i * 13);
    std::vector<int> order;
    // Each stream fills its own 64-byte region piecewise, then stream 0 sums everything.
    for (int k = 0; k < ops_per_stream; ++k) {
      for (int i = 0; i < streams; ++i) {
        const std::size_t off = static_cast<std::size_t>(i * 64 + k * 8);
        REQUIRE(rt.copy_async(dst + off, src + off, 8, s[static_cast<std::size_t>(i)]).ok());
        REQUIRE(rt.launch(s[static_cast<std::size_t>(i)], std::array{Access{dst + off, 8, AccessMode::write}},
                          [&order, i, k, p = dst + off] {
                            order.push_back(i * 100 + k);
                            for (int j = 0; j < 8; ++j) p[j] = static_cast<std::uint8_t>(p[j] + 1);
                          }).ok());
      }
    }
    for (int i = 1; i < streams; ++i) {
      REQUIRE(rt.record(e, s[static_cast<std::size_t>(i)]).ok());
      REQUIRE(rt.wait(s[0], e).ok());  // captures this record before the next re-record
    }
    REQUIRE(rt.launch(s[0],
                      std::array{Access{dst, 192, AccessMode::read}, Access{dst + 192, 1, AccessMode::write}},
                      [dst] {
                        unsigned sum = 0;
                        for (int j = 0; j < 192; ++j) sum += dst[j];
                        dst[192] = static_cast<std::uint8_t>(sum);
                      }).ok());
    rt.run_random(seed);
    REQUIRE(rt.idle());
    CHECK(rt.races().empty());
    interleavings.insert(order);
    std::vector<std::uint8_t> bytes(dst, dst + 256);
    if (reference.empty()) reference = bytes;
    CHECK(bytes == reference);
  }
  CHECK(interleavings.size() > 10);
}

TEST_CASE_FIXTURE(TwoStreamRuntime, "deadlock: synchronizing on work behind a closed gate reports an error") {
  const Event e = rt.create_event().value();
  auto* x = alloc<std::uint8_t>(rt, 8, MemoryKind::device);
  rt.set_next_label("host flag");
  const auto gate = rt.enqueue_gate(s1).value();
  REQUIRE(rt.launch(s1, std::array{Access{x, 8, AccessMode::write}}).ok());
  REQUIRE(rt.record(e, s1).ok());
  REQUIRE(rt.wait(s2, e).ok());
  REQUIRE(rt.launch(s2, std::array{Access{x, 8, AccessMode::read}}).ok());

  const Status st = rt.synchronize(e);
  CHECK(st.code() == ErrorCode::runtime_failure);
  CHECK(st.message().find("deadlock") != std::string::npos);
  CHECK(st.message().find("gate #1") != std::string::npos);
  CHECK(st.message().find("host flag") != std::string::npos);
  const Status st2 = rt.synchronize(s2);
  CHECK(st2.code() == ErrorCode::runtime_failure);
  CHECK(st2.message().find("awaiting record") != std::string::npos);
  CHECK(rt.pending_ops() == 5);
  CHECK(rt.drain() == 0);

  REQUIRE(rt.open_gate(gate).ok());
  CHECK(rt.synchronize(s2).ok());
  CHECK(rt.idle());
  CHECK(rt.races().empty());
}

TEST_CASE_FIXTURE(OneStream, "opening a gate orders the host's earlier writes before the gated stream") {
  auto* staging = alloc<std::uint8_t>(rt, 8, MemoryKind::pinned_host);
  auto* dev = alloc<std::uint8_t>(rt, 8, MemoryKind::device);
  const auto gate = rt.enqueue_gate(s).value();
  REQUIRE(rt.copy_async(dev, staging, 8, s).ok());
  rt.host_access(staging, 8, AccessMode::write);  // after enqueue, but before the gate opens
  REQUIRE(rt.open_gate(gate).ok());
  rt.drain();
  CHECK(rt.races().empty());
  rt.host_access(staging, 8, AccessMode::write);  // after the gate opened: unordered
  CHECK(rt.races().size() == 1);
}

TEST_CASE_FIXTURE(OneStream, "fault injection: the nth call of a kind fails and enqueues nothing") {
  const Event e = rt.create_event().value();
  auto* a = alloc<std::uint8_t>(rt, 16, MemoryKind::pinned_host);
  auto* b = alloc<std::uint8_t>(rt, 16, MemoryKind::device);
  const std::array<CopyDesc, 1> batch{CopyDesc{b, a, 16}};

  auto call = [&](FaultKind kind) -> Status {
    switch (kind) {
      case FaultKind::copy: return rt.copy_async(b, a, 16, s);
      case FaultKind::record: return rt.record(e, s);
      case FaultKind::wait: return rt.wait(s, e);
      case FaultKind::launch: return rt.launch(s, std::array{Access{b, 16, AccessMode::read}});
    }
    return Status(ErrorCode::internal, "unreachable");
  };
  REQUIRE(rt.record(e, s).ok());  // so that waits enqueue
  for (FaultKind kind : {FaultKind::copy, FaultKind::record, FaultKind::wait, FaultKind::launch}) {
    CAPTURE(to_string(kind));
    rt.inject_failure(kind, 2);
    CHECK(call(kind).ok());
    const std::size_t pending = rt.pending_ops();
    const Status st = call(kind);
    CHECK(st.code() == ErrorCode::runtime_failure);
    CHECK(st.message().find("injected failure") != std::string::npos);
    CHECK(st.message().find(to_string(kind)) != std::string::npos);
    CHECK(rt.pending_ops() == pending);
    CHECK(call(kind).ok());
  }
  CHECK(rt.counters().injected_failures == 4);

  // copy_batch_async counts as a copy call; two injections at once.
  rt.inject_failure(FaultKind::copy);
  rt.inject_failure(FaultKind::copy, 3);
  CHECK(rt.copy_batch_async(batch, s).code() == ErrorCode::runtime_failure);
  CHECK(rt.copy_batch_async(batch, s).ok());
  CHECK(rt.copy_async(b, a, 16, s).code() == ErrorCode::runtime_failure);
  CHECK(rt.copy_async(b, a, 16, s).ok());
  rt.inject_failure(FaultKind::launch);
  rt.clear_failures();
  CHECK(call(FaultKind::launch).ok());
  rt.drain();
  CHECK(rt.idle());
  CHECK(rt.races().empty());
}

TEST_CASE("allocation: absurd and zero sizes are rejected, the limit is enforced, deallocate works") {
  SimRuntime::Options opt;
  opt.memory_limit = 1 << 20;
  SimRuntime rt(opt);
  const auto huge = rt.allocate(std::numeric_limits<std::size_t>::max(), MemoryKind::device);
  CHECK(huge.status().code() == ErrorCode::runtime_failure);
  CHECK(huge.status().message().find("limit") != std::string::npos);
  CHECK(rt.allocate(0, MemoryKind::host).status().code() == ErrorCode::invalid_argument);
  void* p = rt.allocate(1 << 19, MemoryKind::device).value();
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 256 == 0);
  CHECK(static_cast<unsigned char*>(p)[100] == 0);
  CHECK_FALSE(rt.allocate((1 << 19) + 1, MemoryKind::device).ok());
  CHECK(rt.allocated_bytes() == (1 << 19));
  CHECK(rt.deallocate(p).ok());
  CHECK(rt.deallocate(p).code() == ErrorCode::invalid_argument);
  CHECK(rt.allocate(1 << 20, MemoryKind::pinned_host).ok());
}

TEST_CASE("deallocate under a pending op of a host-issued stream is reported, and the block stays allocated") {
  SimRuntime rt;
  const SimRuntime::Stream proxy = rt.create_stream().value();
  rt.set_host_issued(proxy);
  void* b = rt.allocate(256, MemoryKind::device).value();
  const Access on_b[] = {{b, 256, AccessMode::write}};
  rt.set_next_label("proxy work");
  REQUIRE(rt.launch(proxy, on_b).ok());
  CHECK(rt.races().empty());
  // Freeing it under that op: one report, and the block is kept until reset.
  CHECK(rt.deallocate(b).ok());
  REQUIRE(rt.races().size() == 1);
  const std::string d = rt.races()[0].description;
  CHECK(d.find("device allocation") != std::string::npos);
  CHECK(d.find("freed while write by launch 'proxy work'") != std::string::npos);
  CHECK(d.find("issued by a host thread") != std::string::npos);
  CHECK(rt.allocated_bytes() == 256);
  CHECK(rt.synchronize(proxy).ok());  // the pending op writes memory that is still allocated
  // Once the op has completed, freeing is silent.
  void* c = rt.allocate(64, MemoryKind::device).value();
  const Access on_c[] = {{c, 64, AccessMode::write}};
  REQUIRE(rt.launch(proxy, on_c).ok());
  CHECK(rt.synchronize(proxy).ok());
  CHECK(rt.deallocate(c).ok());
  CHECK(rt.races().size() == 1);
}

TEST_CASE_FIXTURE(OneStream, "capture flag: is_capturing, capture-illegal calls, batch copies rejected") {
  auto* a = alloc<std::uint8_t>(rt, 64, MemoryKind::pinned_host);
  auto* b = alloc<std::uint8_t>(rt, 64, MemoryKind::device);
  for (int i = 0; i < 64; ++i) a[i] = static_cast<std::uint8_t>(200 - i);
  CHECK_FALSE(rt.is_capturing(s).value());
  REQUIRE(rt.set_capturing(s, true).ok());
  CHECK(rt.is_capturing(s).value());
  const std::array<CopyDesc, 2> batch{CopyDesc{b, a, 32}, CopyDesc{b + 32, a + 32, 32}};
  CHECK(rt.copy_batch_async(batch, s).code() == ErrorCode::capture_unsupported);
  CHECK(rt.synchronize(s).code() == ErrorCode::capture_unsupported);
  CHECK(rt.copy_async(b, a, 32, s).ok());  // plain async copies are capturable
  REQUIRE(rt.set_capturing(s, false).ok());
  CHECK(rt.copy_batch_async(batch, s).ok());
  CHECK(rt.pending_ops() == 2);
  CHECK(rt.counters().copy_batches == 1);
  CHECK(rt.counters().batch_copies == 2);
  CHECK(rt.counters().copy_bytes == 96);
  REQUIRE(rt.synchronize(s).ok());
  CHECK(std::equal(a, a + 64, b));
  CHECK(rt.races().empty());
  CHECK(rt.is_capturing(Stream{}).status().code() == ErrorCode::invalid_argument);
}

TEST_CASE_FIXTURE(OneStream, "invalid handles and arguments are rejected with invalid_argument") {
  const Event e = rt.create_event().value();
  std::array<std::uint8_t, 16> x{}, y{};
  CHECK(rt.record(e, Stream{}).code() == ErrorCode::invalid_argument);
  CHECK(rt.record(Event{}, s).code() == ErrorCode::invalid_argument);
  CHECK(rt.wait(Stream{42}, e).code() == ErrorCode::invalid_argument);
  CHECK(rt.copy_async(nullptr, y.data(), 4, s).code() == ErrorCode::invalid_argument);
  CHECK(rt.copy_async(x.data(), x.data() + 2, 4, s).code() == ErrorCode::invalid_argument);  // overlap
  CHECK(rt.copy_async(x.data(), y.data(), 0, s).ok());  // zero bytes: nothing to do
  CHECK(rt.launch(s, std::array{Access{nullptr, 4, AccessMode::read}}).code() == ErrorCode::invalid_argument);
  CHECK(rt.pending_ops() == 0);
  rt.destroy_event(e);
  CHECK(rt.query(e).status().code() == ErrorCode::invalid_argument);
  REQUIRE(rt.copy_async(x.data(), y.data(), 16, s).ok());  // ordinary (pageable) memory works too
  rt.destroy_stream(s);
  CHECK(rt.copy_async(x.data(), y.data(), 16, s).code() == ErrorCode::invalid_argument);
  CHECK(rt.pending_ops() == 1);  // work enqueued before destroy still completes
  rt.drain();
  CHECK(rt.idle());
}

TEST_CASE_FIXTURE(OneStream, "a throwing launch body surfaces as an async error from the next synchronize") {
  REQUIRE(rt.launch(s, {}, [] { throw std::runtime_error("kernel fault"); }).ok());
  const Status st = rt.synchronize(s);
  CHECK(st.code() == ErrorCode::runtime_failure);
  CHECK(st.message().find("kernel fault") != std::string::npos);
  CHECK(rt.synchronize(s).ok());  // reported once
}

TEST_CASE("trace log records the API calls in order (golden protocol tests)") {
  SimRuntime rt;
  rt.set_tracing(true);
  const Stream compute = rt.create_stream().value();
  const Stream copy = rt.create_stream().value();
  const Event release = rt.create_event().value();
  const Event ready = rt.create_event().value();
  std::array<std::uint8_t, 32> host{}, slot{};
  REQUIRE(rt.record(release, compute).ok());
  REQUIRE(rt.wait(copy, release).ok());
  rt.set_next_label("fill slot 0");
  REQUIRE(rt.copy_async(slot.data(), host.data(), 32, copy).ok());
  REQUIRE(rt.record(ready, copy).ok());
  REQUIRE(rt.wait(compute, ready).ok());
  REQUIRE(rt.synchronize(copy).ok());
  const auto log = rt.trace_log();
  REQUIRE(log.size() == 6);
  CHECK(log[0].call == SimCall::record);
  CHECK(log[0].stream == compute.id);
  CHECK(log[0].event == release.id);
  CHECK(log[1].call == SimCall::wait);
  CHECK(log[1].stream == copy.id);
  CHECK(log[2].call == SimCall::copy);
  CHECK(log[2].bytes == 32);
  CHECK(log[2].label == "fill slot 0");
  CHECK(log[3].call == SimCall::record);
  CHECK(log[3].event == ready.id);
  CHECK(log[4].call == SimCall::wait);
  CHECK(log[4].stream == compute.id);
  CHECK(log[5].call == SimCall::synchronize_stream);
}

TEST_CASE("virtual time follows stream order, event edges and host synchronization") {
  SimRuntime rt;
  SimCostModel cost;
  cost.copy_latency_ns = 100;
  cost.copy_bytes_per_ns = 10;
  cost.launch_ns = 50;
  rt.set_cost_model(cost);
  const Stream copy = rt.create_stream().value();
  const Stream compute = rt.create_stream().value();
  const Event ready = rt.create_event().value();
  std::vector<std::uint8_t> host(1000), slot(1000);
  REQUIRE(rt.copy_async(slot.data(), host.data(), 1000, copy).ok());  // 100 + 100
  REQUIRE(rt.record(ready, copy).ok());
  REQUIRE(rt.launch(compute, {}).ok());  // 50, independent
  REQUIRE(rt.wait(compute, ready).ok());
  rt.set_next_duration_ns(30);
  REQUIRE(rt.launch(compute, {}).ok());  // starts at 200
  REQUIRE(rt.synchronize(compute).ok());
  CHECK(rt.stream_time_ns(copy) == doctest::Approx(200));
  CHECK(rt.stream_time_ns(compute) == doctest::Approx(230));
  CHECK(rt.host_time_ns() == doctest::Approx(230));
}

TEST_CASE("copies_share_link: copies of two streams take turns on one link, launches do not") {
  SimRuntime rt;
  SimCostModel cost;
  cost.copy_bytes_per_ns = 10;  // 1000 bytes: 100 ns
  cost.launch_ns = 100;
  std::vector<std::uint8_t> host(1000), a(1000), b(1000);
  for (const bool shared : {false, true}) {
    CAPTURE(shared);
    rt.reset();
    cost.copies_share_link = shared;
    rt.set_cost_model(cost);
    const Stream s1 = rt.create_stream().value();
    const Stream s2 = rt.create_stream().value();
    REQUIRE(rt.copy_async(a.data(), host.data(), 1000, s1).ok());
    REQUIRE(rt.copy_async(b.data(), host.data(), 1000, s2).ok());
    REQUIRE(rt.launch(s1, {}).ok());
    rt.drain();
    // Shared: one copy takes [0, 100), the other [100, 200); the launch follows its stream's copy.
    const double t1 = rt.stream_time_ns(s1), t2 = rt.stream_time_ns(s2);
    if (shared) {
      CHECK(std::min(t1 - 100.0, t2) == doctest::Approx(100));
      CHECK(std::max(t1 - 100.0, t2) == doctest::Approx(200));
    } else {
      CHECK(t1 == doctest::Approx(200));
      CHECK(t2 == doctest::Approx(100));
    }
  }
}

TEST_CASE("copies_share_link: copies take the link in the order they become ready, in the first gap that holds them") {
  std::vector<std::uint8_t> host(1000), a(1000), b(1000);
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    CAPTURE(seed);
    SimRuntime::Options o;
    o.seed = seed;  // without a shared link drain() would pick among ready streams at random
    SimRuntime rt(o);
    SimCostModel cost;
    cost.copy_bytes_per_ns = 10;  // 1000 bytes: 100 ns
    cost.copies_share_link = true;
    rt.set_cost_model(cost);
    const Stream slow = rt.create_stream().value();
    const Stream late = rt.create_stream().value();
    const Stream early = rt.create_stream().value();
    const Event gate = rt.create_event().value();
    // `late`'s copy is enqueued first but ready at 500 (after a 500 ns launch on `slow`),
    // `early`'s at 0: `early` takes [0, 100), `late` [500, 600).
    rt.set_next_duration_ns(500);
    REQUIRE(rt.launch(slow, {}).ok());
    REQUIRE(rt.record(gate, slow).ok());
    REQUIRE(rt.wait(late, gate).ok());
    REQUIRE(rt.copy_async(a.data(), host.data(), 1000, late).ok());
    REQUIRE(rt.copy_async(b.data(), host.data(), 1000, early).ok());
    rt.drain();
    CHECK(rt.stream_time_ns(late) == doctest::Approx(600));
    CHECK(rt.stream_time_ns(early) == doctest::Approx(100));
    // A third copy ready at 550 finds [500, 600) busy: it takes [600, 700).
    rt.set_next_duration_ns(50);
    REQUIRE(rt.launch(slow, {}).ok());
    REQUIRE(rt.record(gate, slow).ok());
    REQUIRE(rt.wait(early, gate).ok());
    REQUIRE(rt.copy_async(b.data(), host.data(), 1000, early).ok());
    rt.drain();
    CHECK(rt.stream_time_ns(early) == doctest::Approx(700));
  }
}

TEST_CASE_FIXTURE(OneStream, "reset returns to the constructed state") {
  auto* x = alloc<std::uint8_t>(rt, 8, MemoryKind::device);
  REQUIRE(rt.launch(s, std::array{Access{x, 8, AccessMode::write}}).ok());
  rt.drain();
  rt.host_access(x, 8, AccessMode::write);
  CHECK(rt.races().size() == 1);
  rt.reset();
  CHECK(rt.races().empty());
  CHECK(rt.counters() == SimCounters{});
  CHECK(rt.allocated_bytes() == 0);
  CHECK(rt.idle());
  CHECK(rt.is_capturing(s).status().code() == ErrorCode::invalid_argument);
  const Stream s2 = rt.create_stream().value();
  CHECK(s2 == s);  // ids restart
}

namespace {

// The row provider's protocol (docs/reference_providers.md) on top of the runtime: per forward, release event on the consumer, copy
// stream waits, slot copies, ready event, consumer waits, consumer kernels read the slots.
// `skip` drops one edge to prove the detector sees it.
enum class Skip { none, release_wait, ready_wait };

struct ProtocolRun {
  std::size_t races = 0;
  std::vector<std::uint8_t> checksums;
};

ProtocolRun run_protocol(SimRuntime& rt, std::uint64_t seed, Skip skip, int forwards) {
  constexpr int experts = 8;
  constexpr int slots = 3;
  constexpr std::size_t row = 32;
  const Stream consumer = rt.create_stream().value();
  const Stream copy = rt.create_stream().value();
  const Event release = rt.create_event().value();
  const Event ready = rt.create_event().value();
  auto* host = static_cast<std::uint8_t*>(rt.allocate(experts * row, MemoryKind::pinned_host).value());
  auto* slot_buf = static_cast<std::uint8_t*>(rt.allocate(slots * row, MemoryKind::device).value());
  auto* out =
      static_cast<std::uint8_t*>(rt.allocate(static_cast<std::size_t>(forwards), MemoryKind::device).value());
  for (std::size_t i = 0; i < experts * row; ++i) host[i] = static_cast<std::uint8_t>(i * 7 + 3);

  std::array<int, slots> owner{-1, -1, -1};
  std::uint64_t rng = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&rng](std::uint64_t n) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng % n;
  };
  for (int f = 0; f < forwards; ++f) {
    // The forward needs `want` (one expert); fill it into a random slot on a miss.
    const int want = static_cast<int>(next(experts));
    int slot = -1;
    for (int sl = 0; sl < slots; ++sl)
      if (owner[static_cast<std::size_t>(sl)] == want) slot = sl;
    if (slot < 0) {
      slot = static_cast<int>(next(slots));
      owner[static_cast<std::size_t>(slot)] = want;
      REQUIRE(rt.record(release, consumer).ok());
      if (skip != Skip::release_wait) REQUIRE(rt.wait(copy, release).ok());
      rt.set_next_label("fill slot " + std::to_string(slot) + " <- expert " + std::to_string(want));
      REQUIRE(rt.copy_async(slot_buf + static_cast<std::size_t>(slot) * row,
                            host + static_cast<std::size_t>(want) * row, row, copy).ok());
      REQUIRE(rt.record(ready, copy).ok());
    }
    if (skip != Skip::ready_wait) REQUIRE(rt.wait(consumer, ready).ok());
    std::uint8_t* rows = slot_buf + static_cast<std::size_t>(slot) * row;
    rt.set_next_label("expert gemm");
    REQUIRE(rt.launch(consumer,
                      std::array{Access{rows, row, AccessMode::read}, Access{out + f, 1, AccessMode::write}},
                      [rows, o = out + f] {
                        std::uint8_t sum = 0;
                        for (std::size_t i = 0; i < row; ++i) sum = static_cast<std::uint8_t>(sum + rows[i]);
                        *o = sum;
                      }).ok());
    // Let the device make some progress between host calls.
    rt.run_random(seed + static_cast<std::uint64_t>(f), next(4));
  }
  rt.run_random(seed ^ 0xABCDEFull);
  REQUIRE(rt.idle());
  ProtocolRun result;
  result.races = rt.races().size();
  result.checksums.assign(out, out + forwards);
  return result;
}

}  // namespace

TEST_CASE("the release/ready slot protocol is race-free; dropping either edge is detected") {
  SimRuntime rt;
  std::size_t release_detected = 0;
  std::size_t ready_detected = 0;
  constexpr int runs = 2000;
  for (std::uint64_t seed = 0; seed < runs; ++seed) {
    rt.reset();
    const ProtocolRun good = run_protocol(rt, seed, Skip::none, 12);
    CHECK(good.races == 0);
    if (good.races != 0) FAIL_CHECK(all_descriptions(rt));
    rt.reset();
    const ProtocolRun no_release = run_protocol(rt, seed, Skip::release_wait, 12);
    rt.reset();
    const ProtocolRun no_ready = run_protocol(rt, seed, Skip::ready_wait, 12);
    release_detected += no_release.races > 0;
    ready_detected += no_ready.races > 0;
  }
  // Every trace with a refill after a use lacks the WAR edge; almost every trace has one.
  CHECK(release_detected > runs * 9 / 10);
  CHECK(ready_detected > runs * 9 / 10);
}

TEST_CASE("perf sanity: 10^4 random schedules of ~50 ops on a reset runtime") {
  SimRuntime rt;
  std::uint64_t total_ops = 0;
  for (std::uint64_t seed = 0; seed < 10000; ++seed) {
    rt.reset();
    const Stream a = rt.create_stream().value();
    const Stream b = rt.create_stream().value();
    const Event e = rt.create_event().value();
    auto* h = static_cast<std::uint8_t*>(rt.allocate(12 * 128, MemoryKind::pinned_host).value());
    auto* d = static_cast<std::uint8_t*>(rt.allocate(12 * 128, MemoryKind::device).value());
    for (int i = 0; i < 12; ++i) {  // distinct rows: reusing one would need a release edge
      const std::size_t off = static_cast<std::size_t>(i) * 128;
      REQUIRE(rt.copy_async(d + off, h + off, 128, a).ok());
      REQUIRE(rt.record(e, a).ok());
      REQUIRE(rt.wait(b, e).ok());
      REQUIRE(rt.launch(b, std::array{Access{d + off, 128, AccessMode::read}}).ok());
    }
    total_ops += rt.run_random(seed);
    REQUIRE(rt.idle());
    if (!rt.races().empty()) FAIL(all_descriptions(rt));
  }
  CHECK(total_ops == 10000u * 48u);
}

namespace {

// Independent oracle: an explicit happens-before graph over every op and host action, its
// transitive closure, and byte-granular conflict checks of every pair of accesses.
class HbOracle {
 public:
  static constexpr std::size_t max_nodes = 512;

  std::size_t host_node() {
    const std::size_t n = add_node();
    if (last_host_ != none) edge(last_host_, n);
    last_host_ = n;
    return n;
  }
  // An enqueue: a host action followed (edge) by the op on the stream.
  std::size_t op_node(std::size_t stream) {
    const std::size_t h = host_node();
    const std::size_t n = add_node();
    edge(h, n);
    if (last_op_[stream] != none) edge(last_op_[stream], n);
    last_op_[stream] = n;
    return n;
  }
  void edge(std::size_t from, std::size_t to) { preds_[to].push_back(from); }
  void access(std::size_t node, std::size_t lo, std::size_t n, AccessMode mode) {
    accesses_.push_back({node, lo, lo + n, mode});
  }
  std::size_t last_op(std::size_t stream) const { return last_op_[stream]; }

  bool any_race() const {
    std::vector<std::bitset<max_nodes>> reach(preds_.size());
    for (std::size_t n = 0; n < preds_.size(); ++n)  // nodes are created in topological order
      for (std::size_t p : preds_[n]) {
        reach[n] |= reach[p];
        reach[n].set(p);
      }
    for (std::size_t i = 0; i < accesses_.size(); ++i)
      for (std::size_t j = i + 1; j < accesses_.size(); ++j) {
        const Acc& a = accesses_[i];
        const Acc& b = accesses_[j];
        if (a.node == b.node) continue;
        if (a.mode == AccessMode::read && b.mode == AccessMode::read) continue;
        if (a.hi <= b.lo || b.hi <= a.lo) continue;
        const auto [x, y] = std::minmax(a.node, b.node);
        if (!reach[y].test(x)) return true;
      }
    return false;
  }

 private:
  static constexpr std::size_t none = static_cast<std::size_t>(-1);
  struct Acc {
    std::size_t node, lo, hi;
    AccessMode mode;
  };
  std::size_t add_node() {
    REQUIRE(preds_.size() < max_nodes);
    preds_.emplace_back();
    return preds_.size() - 1;
  }
  std::vector<std::vector<std::size_t>> preds_;
  std::vector<Acc> accesses_;
  std::size_t last_host_ = none;
  std::array<std::size_t, 3> last_op_{none, none, none};
};

}  // namespace

TEST_CASE("differential fuzz: the detector finds a race exactly when the brute-force oracle does") {
  constexpr std::size_t num_streams = 3;
  constexpr std::size_t num_events = 2;
  constexpr std::size_t mem = 64;
  std::size_t racy_programs = 0;
  SimRuntime rt;
  for (std::uint64_t seed = 1; seed <= 4000; ++seed) {
    rt.reset();
    HbOracle oracle;
    std::array<Stream, num_streams> streams{};
    for (auto& s : streams) s = rt.create_stream().value();
    std::array<Event, num_events> events{};
    for (auto& e : events) e = rt.create_event().value();
    std::array<std::size_t, num_events> latest_record{};  // oracle node + 1; 0 = never recorded
    auto* base = static_cast<std::uint8_t*>(rt.allocate(mem, MemoryKind::device).value());

    std::uint64_t rng = seed * 0x9E3779B97F4A7C15ull;
    auto next = [&rng](std::uint64_t n) {
      rng ^= rng << 13;
      rng ^= rng >> 7;
      rng ^= rng << 17;
      return static_cast<std::size_t>(rng % n);
    };
    auto range = [&](std::size_t limit_lo, std::size_t limit_hi) {
      const std::size_t n = 1 + next(4);
      const std::size_t lo = limit_lo + next(limit_hi - limit_lo - n + 1);
      return std::pair{lo, n};
    };
    // Each actor (streams 0..2, host 3) mostly touches its own 16-byte quarter, so that racy
    // and race-free programs are both common.
    auto home_range = [&](std::size_t actor) {
      if (next(10) == 0) return range(0, mem);
      return range(actor * 16, actor * 16 + 16);
    };
    for (int step = 0, steps = 10 + static_cast<int>(next(30)); step < steps; ++step) {
      const std::size_t r = next(100);
      const std::size_t si = next(num_streams);
      const std::size_t ei = next(num_events);
      if (r < 35) {  // launch with one or two accesses
        std::vector<Access> acc;
        const std::size_t node = oracle.op_node(si);
        for (std::size_t k = 0, count = 1 + next(2); k < count; ++k) {
          const auto [lo, n] = home_range(si);
          const AccessMode mode = next(2) ? AccessMode::write : AccessMode::read;
          acc.push_back(Access{base + lo, n, mode});
          oracle.access(node, lo, n, mode);
        }
        REQUIRE(rt.launch(streams[si], acc).ok());
      } else if (r < 45) {  // copy into the second half of the home quarter
        const std::size_t q = si * 16;
        const std::size_t other = ((si + 1) % num_streams) * 16;  // sometimes read a neighbour
        const auto [src, n] = next(10) == 0 ? range(other, other + 16) : range(q, q + 8);
        const std::size_t dst = q + 8 + next(8 - n + 1);
        const std::size_t node = oracle.op_node(si);
        oracle.access(node, src, n, AccessMode::read);
        oracle.access(node, dst, n, AccessMode::write);
        REQUIRE(rt.copy_async(base + dst, base + src, n, streams[si]).ok());
      } else if (r < 60) {
        latest_record[ei] = oracle.op_node(si) + 1;
        REQUIRE(rt.record(events[ei], streams[si]).ok());
      } else if (r < 75) {
        if (latest_record[ei] != 0) oracle.edge(latest_record[ei] - 1, oracle.op_node(si));
        REQUIRE(rt.wait(streams[si], events[ei]).ok());
      } else if (r < 83) {
        const auto [lo, n] = home_range(3);
        const AccessMode mode = next(2) ? AccessMode::write : AccessMode::read;
        oracle.access(oracle.host_node(), lo, n, mode);
        rt.host_access(base + lo, n, mode);
      } else if (r < 86) {
        const std::size_t h = oracle.host_node();
        if (latest_record[ei] != 0) oracle.edge(latest_record[ei] - 1, h);
        REQUIRE(rt.synchronize(events[ei]).ok());
      } else if (r < 89) {
        const std::size_t h = oracle.host_node();
        if (oracle.last_op(si) != static_cast<std::size_t>(-1)) oracle.edge(oracle.last_op(si), h);
        REQUIRE(rt.synchronize(streams[si]).ok());
      } else if (r < 93) {
        const bool done = rt.query(events[ei]).value();
        const std::size_t h = oracle.host_node();
        if (done && latest_record[ei] != 0) oracle.edge(latest_record[ei] - 1, h);
      } else {
        rt.run_random(seed * 31 + static_cast<std::uint64_t>(step), next(4));
      }
    }
    rt.run_random(seed);
    REQUIRE(rt.idle());
    const bool expected = oracle.any_race();
    racy_programs += expected;
    CAPTURE(seed);
    CHECK(expected == (rt.race_count() > 0));
  }
  // Both outcomes must be well represented for the comparison to mean anything.
  MESSAGE("racy programs: " << racy_programs << " of 4000");
  CHECK(racy_programs > 800);
  CHECK(racy_programs < 3200);
}
