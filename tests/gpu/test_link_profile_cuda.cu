// The link profile measured on the device (suite 'gpu'; the main exits 77 without a device):
//  * a profile of device 0 at 1.69 MiB experts: every number finite and > 0, copy-engine
//    bandwidths below 1000 GB/s, SM loads not above the link's copy-engine rate by more than a
//    third, the whole measurement within 200 ms, the device's real name and PCI bus id;
//  * the caller's current device is restored;
//  * link_profile_for returns the same profile (bit for bit) the second time, without measuring;
//  * set_link_profile with another bus id fails and leaves the cached profile; with the real
//    bus id it replaces it;
//  * bad arguments (no such device, 0 bytes) are errors that leave the output untouched.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include "expert_cache/staging/link_probe.cuh"

using namespace expert_cache;

namespace {

constexpr std::uint64_t kExpertBytes = 1769472;  // 1.69 MiB: an NVFP4 Marlin expert (docs/hardware_limits.md)

bool finite_positive(double v) { return std::isfinite(v) && v > 0; }

std::string device_bus_id(int device) {
  char bus[32] = {};
  REQUIRE(cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), device) == cudaSuccess);
  return bus;
}

// Sets the current device back to what it was at construction (the later tests of a grouped
// program expect theirs).
struct CurrentDeviceBack {
  int device = 0;
  CurrentDeviceBack() { REQUIRE(cudaGetDevice(&device) == cudaSuccess); }
  ~CurrentDeviceBack() { (void)cudaSetDevice(device); }
};

}  // namespace

TEST_CASE("link profile of device 0 at 1.69 MiB: sane numbers, within 200 ms, device restored") {
  const CurrentDeviceBack device_back;
  int device_count = 0;
  REQUIRE(cudaGetDeviceCount(&device_count) == cudaSuccess);
  // The caller's device stays current (the last one: with two or more devices a missed restore shows).
  const int callers_device = device_count - 1;
  REQUIRE(cudaSetDevice(callers_device) == cudaSuccess);

  LinkProfile p;
  const Status s = measure_link_profile(0, kExpertBytes, p);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  std::printf("%s\n", p.describe().c_str());
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  CHECK(current == callers_device);
  CHECK(cudaGetLastError() == cudaSuccess);  // no error left behind for the caller's own checks

  cudaDeviceProp prop{};
  REQUIRE(cudaGetDeviceProperties(&prop, 0) == cudaSuccess);
  CHECK(p.device == 0);
  CHECK(p.device_name == std::string(prop.name));
  CHECK(p.pci_bus_id == device_bus_id(0));
  CHECK(p.expert_bytes == kExpertBytes);
  CHECK(finite_positive(p.copy_engine_gbps_one));
  CHECK(finite_positive(p.copy_engine_gbps_batch));
  CHECK(finite_positive(p.copy_latency_us));
  CHECK(finite_positive(p.sm_load_gbps));
  CHECK(finite_positive(p.graph_fill_latency_us));
  CHECK(finite_positive(p.measure_ms));
  CHECK(p.copy_engine_gbps_one < 1000);
  CHECK(p.copy_engine_gbps_batch < 1000);
  // Both read the same host link: SM loads far above the copy engine would mean they were served
  // from a cache, not the link.
  CHECK(p.sm_load_gbps < 1.34 * p.copy_engine_gbps_batch);
  // A small copy or fill is far below a millisecond on any working link.
  CHECK(p.copy_latency_us < 1000);
  CHECK(p.graph_fill_latency_us < 1000);
  CHECK(p.measure_ms <= 200);
  CHECK(p.check_matches(0, device_bus_id(0), kExpertBytes).ok());
  std::string reason;
  const FillEngine engine = p.choose_engine(&reason);
  CHECK((engine == FillEngine::copy_engine || engine == FillEngine::sm_loads));
  std::printf("automatic fill engine: %s\n", reason.c_str());

  // The text survives a round trip.
  LinkProfile back;
  REQUIRE(LinkProfile::parse(p.serialize(), back).ok());
  CHECK(back == p);
}

TEST_CASE("link_profile_for measures once per device and expert size; set_link_profile checks the bus id") {
  LinkProfile first;
  const Status s = link_profile_for(0, kExpertBytes, first);
  REQUIRE_MESSAGE(s.ok(), s.to_string());

  // The second call is the cached profile: equal to the last bit (a new measurement is not) and
  // far quicker than one.
  LinkProfile second;
  const auto begin = std::chrono::steady_clock::now();
  REQUIRE(link_profile_for(0, kExpertBytes, second).ok());
  const double second_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
  CHECK(second == first);
  CHECK(second.serialize() == first.serialize());
  CHECK(second_ms < 5.0);

  // A profile from another machine (another bus id) is refused; the cache keeps the measured one.
  LinkProfile foreign = first;
  foreign.pci_bus_id = "ffff:ff:1f.7";
  foreign.sm_load_gbps = first.sm_load_gbps + 1;
  const Status refused = set_link_profile(foreign);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.code() == ErrorCode::invalid_argument);
  CHECK(refused.message().find("ffff:ff:1f.7") != std::string_view::npos);
  CHECK(refused.message().find(first.pci_bus_id) != std::string_view::npos);
  LinkProfile after_refusal;
  REQUIRE(link_profile_for(0, kExpertBytes, after_refusal).ok());
  CHECK(after_refusal == first);

  // A profile with a missing measurement is refused too.
  LinkProfile incomplete = first;
  incomplete.graph_fill_latency_us = 0;
  const Status incomplete_refused = set_link_profile(incomplete);
  CHECK_FALSE(incomplete_refused.ok());
  CHECK(incomplete_refused.message().find("graph_fill_latency_us") != std::string_view::npos);
  REQUIRE(link_profile_for(0, kExpertBytes, after_refusal).ok());
  CHECK(after_refusal == first);

  // A stored profile of this device (read back from its text) replaces the measured one.
  LinkProfile stored;
  REQUIRE(LinkProfile::parse(first.serialize(), stored).ok());
  stored.sm_load_gbps = first.copy_engine_gbps_batch;  // e.g. measured on a quieter host
  REQUIRE(set_link_profile(stored).ok());
  LinkProfile installed;
  REQUIRE(link_profile_for(0, kExpertBytes, installed).ok());
  CHECK(installed == stored);
  CHECK(installed.choose_engine() == FillEngine::sm_loads);

  // Another expert size is a profile of its own, installed without a probe.
  LinkProfile other_size = stored;
  other_size.expert_bytes = 2 * kExpertBytes;
  REQUIRE(set_link_profile(other_size).ok());
  LinkProfile got_other;
  REQUIRE(link_profile_for(0, 2 * kExpertBytes, got_other).ok());
  CHECK(got_other == other_size);
  REQUIRE(link_profile_for(0, kExpertBytes, installed).ok());
  CHECK(installed == stored);
}

TEST_CASE("link profile: bad arguments are errors and leave the output untouched") {
  int device_count = 0;
  REQUIRE(cudaGetDeviceCount(&device_count) == cudaSuccess);
  LinkProfile out;
  out.device_name = "untouched";
  const LinkProfile before = out;

  const Status no_device = measure_link_profile(device_count, kExpertBytes, out);
  CHECK(no_device.code() == ErrorCode::invalid_argument);
  CHECK(no_device.message().find("outside") != std::string_view::npos);
  CHECK(out == before);
  CHECK(measure_link_profile(-1, kExpertBytes, out).code() == ErrorCode::invalid_argument);
  CHECK(out == before);
  const Status no_bytes = measure_link_profile(0, 0, out);
  CHECK(no_bytes.code() == ErrorCode::invalid_argument);
  CHECK(no_bytes.message().find("expert_bytes is 0") != std::string_view::npos);
  CHECK(out == before);
  CHECK(link_profile_for(device_count, kExpertBytes, out).code() == ErrorCode::invalid_argument);
  CHECK(out == before);

  LinkProfile nowhere;
  nowhere.device = device_count;
  CHECK(set_link_profile(nowhere).code() == ErrorCode::invalid_argument);
}
