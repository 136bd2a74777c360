// OrderingCore under (simulated) graph capture: the capture join that forks the copy stream into
// the caller's capture, and the staging ring's handling of buffers recorded inside a capture.
// SimRuntime models capture as a flag only, so these pin the protocol; tests/gpu checks CUDA.
// Also the core's one write entry, driven directly.
#include <doctest/doctest.h>

#include "support/sim_cache_harness.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;

namespace {
using CopySim = ExpertCache<TensorMajorStorage, Lru, CopyStream, ExplicitLayout, SimRuntime>;
}

TEST_CASE("capture join: a capturing caller forks the copy stream before any fill") {
  SimRuntime rt;
  const auto caller = rt.create_stream().value();
  CopySim cache(rt, quiet_options(8, 4, 2), six_tensor_layout());
  fill_host_pools(cache);
  const auto copy = cache.copy_stream().value();
  REQUIRE(rt.set_capturing(caller, true).ok());
  rt.set_tracing(true);
  REQUIRE(cache.prepare(Ids{1, 2}, caller).ok());  // first call: no owner, no earlier fill
  const auto log = rt.trace_log();
  REQUIRE(log.size() >= 3);
  CHECK(log[0].call == SimCall::record);
  CHECK(log[0].stream == caller.id);
  CHECK(log[1].call == SimCall::wait);
  CHECK(log[1].stream == copy.id);
  CHECK(log[1].event == log[0].event);
  CHECK(log[2].call == SimCall::copy);
  CHECK(log[2].stream == copy.id);
  REQUIRE(rt.set_capturing(caller, false).ok());
  rt.drain();
  CHECK(rt.races().empty());
}

TEST_CASE("no capture join when the caller is not capturing") {
  SimRuntime rt;
  const auto caller = rt.create_stream().value();
  CopySim cache(rt, quiet_options(8, 4, 2), six_tensor_layout());
  rt.set_tracing(true);
  REQUIRE(cache.prepare(Ids{1, 2}, caller).ok());
  const auto log = rt.trace_log();
  REQUIRE(!log.empty());
  CHECK(log[0].call == SimCall::copy);  // fills first: nothing to order after
}

TEST_CASE("staging ring: a buffer is not reused inside the capture that recorded it") {
  SimRuntime rt;
  const auto caller = rt.create_stream().value();
  CacheOptions o = quiet_options(8, 4, 2);
  o.staging_ring = 2;
  CopySim cache(rt, o, six_tensor_layout());
  fill_host_pools(cache);
  REQUIRE(cache.prepare(Ids{1, 2}, caller).ok());  // eager: both buffers used
  rt.drain();
  // SimRuntime's capture is a per-stream flag: mark the copy stream too, as CUDA does once the
  // capture join made it wait on the caller.
  const auto copy = cache.copy_stream().value();
  REQUIRE(rt.set_capturing(caller, true).ok());
  REQUIRE(rt.set_capturing(copy, true).ok());
  REQUIRE(cache.prepare(Ids{3, 4}, caller).ok());  // captured: misses use both buffers
  auto again = cache.prepare(Ids{3, 4}, caller);   // all hit: needs a third upload in this capture
  REQUIRE_FALSE(again.ok());
  CHECK(again.status().code() == ErrorCode::capture_unsupported);
  CHECK(again.status().message().find("staging_ring") != std::string::npos);
  REQUIRE(rt.set_capturing(caller, false).ok());
  REQUIRE(rt.set_capturing(copy, false).ok());
  // The capture contract: the graph's launches complete (host-synchronised) before the next
  // call; then the capture's buffers are free again and eager calls proceed.
  REQUIRE(rt.synchronize(caller).ok());
  REQUIRE(rt.synchronize(copy).ok());
  for (int i = 0; i < 4; ++i) REQUIRE(cache.prepare(Ids{static_cast<std::int32_t>(i), 5}, caller).ok());
  rt.drain();
  CHECK(rt.races().empty());
  const auto host = cache.resident_map_host();
  CHECK(std::equal(host.begin(), host.end(), cache.resident_map_device()));
}

TEST_CASE("core write entry: each purpose runs its steps; only a prepare changes the reader") {
  SimRuntime rt;
  const auto s0 = rt.create_stream().value();
  const auto s1 = rt.create_stream().value();
  OrderingCore<SimRuntime> core(rt, /*fill_on_copy_stream=*/true, 4, 2);
  const auto copy = core.copy_stream().value();
  int calls = 0;
  SimRuntime::Stream written_on{};
  auto writes = [&](SimRuntime::Stream f) noexcept {
    ++calls;
    written_on = f;
    return Status();
  };
  // Nothing to write: the writes are not run, the caller becomes the reader.
  REQUIRE(core.write(s0, WritePurpose::read_only, MapUpload{}, writes).ok());
  CHECK(calls == 0);
  CHECK(core.owner() == s0);
  CHECK(core.counters().map_uploads == 0);
  // invalidate: writes on the fill stream, the resident map uploaded there, the owner stays.
  RuntimeBuffer<SimRuntime> device(rt, 4 * sizeof(std::int32_t), MemoryKind::device);
  const std::int32_t host[4] = {0, -1, 1, -1};
  const MapUpload resident{host, reinterpret_cast<std::int32_t*>(device.data())};
  REQUIRE(core.write(s1, WritePurpose::invalidate, resident, writes).ok());
  CHECK(calls == 1);
  CHECK(written_on == copy);
  CHECK(core.owner() == s0);
  CHECK(core.counters().map_uploads == 1);
  CHECK(core.counters().owner_changes == 0);
  // fill from another stream: writes on the fill stream, then the caller is the owner.
  REQUIRE(core.write(s1, WritePurpose::fill, resident, writes).ok());
  CHECK(calls == 2);
  CHECK(written_on == copy);
  CHECK(core.owner() == s1);
  CHECK(core.counters().owner_changes == 1);
  CHECK(core.counters().map_uploads == 2);
  // A failing write stops the protocol: no upload, no publish, no owner change.
  const auto ready_before = core.counters().ready_edges;
  auto failing = [](SimRuntime::Stream) noexcept { return Status(ErrorCode::runtime_failure, "write failed"); };
  const Status failed = core.write(s0, WritePurpose::fill, resident, failing);
  CHECK(failed.code() == ErrorCode::runtime_failure);
  CHECK(core.owner() == s1);
  CHECK(core.counters().map_uploads == 2);
  CHECK(core.counters().ready_edges == ready_before);
  rt.drain();
  CHECK(rt.races().empty());
  CHECK(std::equal(host, host + 4, reinterpret_cast<const std::int32_t*>(device.data())));
}
