// AnyExpertCache on the real CUDA runtime (suite 'gpu'; the main exits 77 without a device).
// make_expert_cache<CudaRuntime> for every provider / staging / storage an engine's config can
// name: after every prepare() every resident slot of every tensor holds its expert's host bytes,
// the maps the kernel reads agree with the host mirrors, and the hits and misses equal those of the
// same config on SimRuntime (the planning is the runtime-independent part). The device provider
// takes its ids from device memory and is checked the same way through its resident map.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "expert_cache/any/any_cache_cuda.cuh"
#include "expert_cache/runtime/sim_runtime.hpp"
#include "expert_cache/staging/link_probe.cuh"  // link_profile_for, set_link_profile (compiled mode leaves them out)
#include "support/cuda_support.hpp"

using namespace expert_cache;
using test_support::DeviceBuffer;

namespace {

constexpr std::int32_t kExperts = 20;
constexpr std::int32_t kCapacity = 8;
constexpr std::int32_t kTopK = 3;
constexpr int kSteps = 40;

ExplicitLayout layout_under_test() {
  // NVFP4-like tensor sizes (scaled down), one not a multiple of 16 (the gather tail path).
  return ExplicitLayout{{{{"w13", 64u << 10}, {"w2", 32u << 10}, {"w13_scale", 8u << 10}, {"w2_scale", 4u << 10},
                          {"w13_scale_2", 4}, {"w2_scale_2", 1000}}}};
}

unsigned char pattern(std::size_t t, std::int32_t e, std::size_t i) {
  std::uint64_t x = (t + 3) * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(e) + 11) * 0xBF58476D1CE4E5B9ull ^
                    (i / 8) * 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<unsigned char>(x >> (8 * (i % 8)));
}

template <class Any>
void fill_host(Any& any) {
  const ExpertTensorBytes& tensors = any.tensors();
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    const std::size_t n = tensors[t].bytes_per_expert;
    for (std::int32_t e = 0; e < kExperts && n != 0; ++e) {
      auto* p = reinterpret_cast<unsigned char*>(any.host_tensor(t, e));
      REQUIRE(p != nullptr);
      for (std::size_t i = 0; i < n; ++i) p[i] = pattern(t, e, i);
    }
  }
}

std::vector<std::vector<std::int32_t>> make_trace(std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<std::vector<std::int32_t>> out;
  for (int s = 0; s < kSteps; ++s) {
    std::vector<std::int32_t> ids;
    // Skewed so hits and evictions both happen.
    for (int k = 0; k < kTopK; ++k) ids.push_back(static_cast<std::int32_t>((g() % 7 == 0 ? g() : g() % 9) % kExperts));
    out.push_back(ids);
  }
  return out;
}

AnyCacheConfig config_of(std::string provider, std::string staging, std::string storage) {
  AnyCacheConfig c;
  c.provider = std::move(provider);
  c.staging = std::move(staging);
  c.storage = std::move(storage);
  c.layout = AnyLayout::of(layout_under_test());
  c.options.num_experts = kExperts;
  c.options.capacity = kCapacity;
  c.options.top_k = kTopK;
  c.options.label = "any_cuda";
  c.max_ids = kTopK;
  return c;
}

// Every resident slot of every tensor holds its expert's host bytes; returns the slots checked.
int check_resident_slots(const AnyExpertCache<CudaRuntime>& any, const std::vector<std::int32_t>& resident) {
  const ExpertTensorBytes& tensors = any.tensors();
  std::vector<unsigned char> got;
  int checked = 0;
  for (std::int32_t e = 0; e < kExperts; ++e) {
    const std::int32_t slot = resident[static_cast<std::size_t>(e)];
    if (slot < 0) continue;
    REQUIRE(slot < kCapacity);
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const std::size_t n = tensors[t].bytes_per_expert;
      if (n == 0) continue;
      got.resize(n);
      REQUIRE_CUDA_OK(cudaMemcpy(got.data(), any.slot_tensor(t).slot(slot), n, cudaMemcpyDeviceToHost));
      const auto* want = reinterpret_cast<const unsigned char*>(any.host_tensor(t, e));
      INFO("expert " << e << " slot " << slot << " tensor " << t);
      REQUIRE(std::memcmp(got.data(), want, n) == 0);
    }
    ++checked;
  }
  return checked;
}

std::vector<std::int32_t> download_map(const std::int32_t* device_map) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(kExperts));
  REQUIRE_CUDA_OK(cudaMemcpy(out.data(), device_map, out.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  return out;
}

void run_config(const AnyCacheConfig& config, std::uint64_t seed) {
  CAPTURE(config.provider);
  CAPTURE(config.staging);
  CAPTURE(config.storage);
  CudaRuntime rt;
  auto made = make_expert_cache(rt, config);
  REQUIRE_MESSAGE(made.ok(), std::string(made.status().message()));
  AnyExpertCache<CudaRuntime> any = std::move(made.value());
  fill_host(any);

  SimRuntime sim;
  // Gather exists only on CUDA; the planning (what is compared) does not depend on the staging.
  AnyCacheConfig sim_config = config;
  if (sim_config.staging == "gather") sim_config.staging = "inline";
  auto made_sim = make_expert_cache(sim, sim_config);
  REQUIRE_MESSAGE(made_sim.ok(), std::string(made_sim.status().message()));
  AnyExpertCache<SimRuntime> reference = std::move(made_sim.value());
  const SimRuntime::Stream sim_stream = sim.create_stream().value();
  RuntimeBuffer<SimRuntime> sim_ids(sim, sizeof(std::int32_t) * kTopK, MemoryKind::device);

  auto stream_or = rt.create_stream();
  REQUIRE(stream_or.ok());
  const CudaRuntime::Stream stream = stream_or.value();
  DeviceBuffer<std::int32_t> device_ids(kTopK);

  const bool device_provider = config.provider == "device";
  int slots_checked = 0;
  for (const auto& ids : make_trace(seed)) {
    if (device_provider) {
      device_ids.upload(ids);
      auto view = any.prepare(std::span<const std::int32_t>(device_ids.get(), ids.size()), stream);
      REQUIRE_MESSAGE(view.ok(), std::string(view.status().message()));
      // The router's output on the simulated device, declared to its race detector.
      // stream -> host needs synchronize() (drain() alone runs the ops but orders nothing).
      REQUIRE(sim.synchronize(sim_stream).ok());
      sim.host_access(sim_ids.data(), ids.size() * sizeof(std::int32_t), AccessMode::write);
      std::memcpy(sim_ids.data(), ids.data(), ids.size() * sizeof(std::int32_t));
      auto ref_view = reference.prepare(
          std::span<const std::int32_t>(reinterpret_cast<const std::int32_t*>(sim_ids.data()), ids.size()), sim_stream);
      REQUIRE(ref_view.ok());
      REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
      REQUIRE(any.take_errors() == 0u);
      const auto resident = download_map(any.resident_map_device());
      const auto forward = download_map(any.forward_map_device());
      for (const std::int32_t id : ids) REQUIRE(forward[static_cast<std::size_t>(id)] >= 0);
      slots_checked += check_resident_slots(any, resident);
    } else {
      auto view = any.prepare(ids, stream);
      REQUIRE_MESSAGE(view.ok(), std::string(view.status().message()));
      auto ref_view = reference.prepare(ids, sim_stream);
      REQUIRE(ref_view.ok());
      CHECK(view.value().hits == ref_view.value().hits);
      CHECK(view.value().misses == ref_view.value().misses);
      REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
      // The device maps the kernel reads equal the host mirrors.
      const auto resident = download_map(view.value().resident_map);
      const auto forward = download_map(view.value().expert_map);
      const auto resident_host = any.resident_map_host();
      const auto forward_host = any.forward_map_host();
      REQUIRE(std::equal(resident.begin(), resident.end(), resident_host.begin(), resident_host.end()));
      REQUIRE(std::equal(forward.begin(), forward.end(), forward_host.begin(), forward_host.end()));
      slots_checked += check_resident_slots(any, resident);
    }
  }
  REQUIRE(sim.synchronize(sim_stream).ok());
  CHECK(sim.races().empty());
  const CacheStats got = any.stats();
  const CacheStats want = reference.stats();
  CHECK(got.hits == want.hits);
  CHECK(got.misses == want.misses);
  CHECK(got.evictions == want.evictions);
  CHECK(got.hits > 0);
  CHECK(got.evictions > 0);
  CHECK(slots_checked > kSteps);
  REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
  rt.destroy_stream(stream);
}

}  // namespace

TEST_CASE("any cache on CUDA: row and cached providers, every staging and storage, bytes and maps checked") {
  std::uint64_t seed = 1;
  for (const char* provider : {"row", "cached"}) {
    for (const char* staging : {"inline", "copy_stream", "batched", "gather"}) {
      for (const char* storage : {"tensor_major", "expert_major", "expert_major_host"}) {
        run_config(config_of(provider, staging, storage), seed++);
      }
    }
  }
}

TEST_CASE("any cache on CUDA: device provider, ids in device memory, same hits as on SimRuntime") {
  std::uint64_t seed = 100;
  for (const char* storage : {"tensor_major", "expert_major", "expert_major_host"}) {
    run_config(config_of("device", "", storage), seed++);
  }
}

TEST_CASE("any cache on CUDA: a bad config is refused with a named error") {
  CudaRuntime rt;
  auto c = config_of("row", "gahter", "");
  auto made = make_expert_cache(rt, c);
  REQUIRE_FALSE(made.ok());
  CHECK(std::string(made.status().message()).find("gahter") != std::string::npos);
}

TEST_CASE("any cache on CUDA: device provider with overlap hands the consumer its per-slot readiness") {
  CudaRuntime rt;
  // Storage "": the device provider's default, expert-major where every fill goes through the proxy.
  for (const auto& [engine, storage] : {std::pair{"sm_loads", "tensor_major"}, std::pair{"copy_engine", "tensor_major"},
                                        std::pair{"copy_engine", ""}, std::pair{"sm_loads", ""}}) {
    CAPTURE(engine);
    CAPTURE(storage);
    AnyCacheConfig c = config_of("device", "", storage);
    c.overlap = true;
    c.lookahead = true;
    c.fill_engine = std::string_view(engine) == "copy_engine" ? FillEngine::copy_engine : FillEngine::sm_loads;
    auto made = make_expert_cache(rt, c);
    REQUIRE_MESSAGE(made.ok(), std::string(made.status().message()));
    AnyExpertCache<CudaRuntime> any = std::move(made.value());
    const bool default_expert_major = std::string_view(storage).empty() && c.fill_engine == FillEngine::copy_engine;
    CHECK(any.storage() == (default_expert_major ? "expert_major" : "tensor_major"));
    fill_host(any);
    REQUIRE(any.fill_engine() == c.fill_engine);
    const SlotReadiness r = any.readiness();
    REQUIRE(r.enabled());
    CHECK(r.capacity == kCapacity);
    auto stream_or = rt.create_stream();
    REQUIRE(stream_or.ok());
    const CudaRuntime::Stream stream = stream_or.value();
    DeviceBuffer<std::int32_t> device_ids(kTopK);
    int words_checked = 0;
    for (const auto& ids : make_trace(7)) {
      device_ids.upload(ids);
      REQUIRE(any.prepare(std::span<const std::int32_t>(device_ids.get(), ids.size()), stream).ok());
      REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
      // Every slot the forward maps gets its ready word at the value the consumer waits for. With the
      // copy engine the proxy writes it on its own stream, after the bytes: poll (bounded) as a
      // consumer would, then read the slots.
      const auto forward = download_map(any.forward_map_device());
      std::vector<std::uint32_t> ready(kCapacity), needed(kCapacity);
      bool all_ready = false;
      for (int poll = 0; poll < 20000 && !all_ready; ++poll) {
        REQUIRE_CUDA_OK(cudaMemcpy(ready.data(), r.ready, kCapacity * sizeof(std::uint32_t), cudaMemcpyDeviceToHost));
        REQUIRE_CUDA_OK(cudaMemcpy(needed.data(), r.needed, kCapacity * sizeof(std::uint32_t), cudaMemcpyDeviceToHost));
        all_ready = true;
        for (const std::int32_t id : ids) {
          const std::int32_t slot = forward[static_cast<std::size_t>(id)];
          REQUIRE(slot >= 0);
          REQUIRE(slot < kCapacity);
          all_ready = all_ready && slot_seq_reached(ready[static_cast<std::size_t>(slot)], needed[static_cast<std::size_t>(slot)]);
        }
      }
      REQUIRE(all_ready);
      REQUIRE_CUDA_OK(cudaDeviceSynchronize());
      REQUIRE(any.take_errors() == 0u);
      words_checked += static_cast<int>(ids.size());
      check_resident_slots(any, download_map(any.resident_map_device()));
    }
    CHECK(words_checked > kSteps);
    rt.destroy_stream(stream);
  }
}

TEST_CASE("any cache on CUDA: the device provider's default storage follows automatic's engines on the device's link") {
  CudaRuntime rt;
  int device = 0;
  REQUIRE_CUDA_OK(cudaGetDevice(&device));
  // An expert size of this case's own: the profiles it installs (set_link_profile) reach no other case.
  ExpertTensorBytes tensors = layout_under_test().tensors();
  tensors[5].bytes_per_expert = 1004;
  AnyCacheConfig base = config_of("device", "", "");
  base.layout.tensors = tensors;
  base.overlap = true;
  LinkProfile measured;
  REQUIRE(link_profile_for(device, total_bytes_per_expert(tensors), measured).ok());
  LinkProfile slow = measured, fast = measured;  // SM loads at 0.5 and 1.0 of the copy engine's batch rate
  slow.sm_load_gbps = 0.5 * measured.copy_engine_gbps_batch;
  fast.sm_load_gbps = measured.copy_engine_gbps_batch;
  struct Case {
    const char* what;
    const LinkProfile* profile;
    bool lookahead;
    const char* storage;
    FillEngine forwards;
  };
  for (const Case& k : {Case{"slow SM loads: every fill through the proxy", &slow, false, "expert_major", FillEngine::copy_engine},
                        Case{"fast SM loads, no lookahead", &fast, false, "tensor_major", FillEngine::sm_loads},
                        Case{"fast SM loads, lookahead: speculation through the proxy", &fast, true, "expert_major",
                             FillEngine::sm_loads}}) {
    CAPTURE(k.what);
    REQUIRE(set_link_profile(*k.profile).ok());
    AnyCacheConfig c = base;
    c.lookahead = k.lookahead;
    REQUIRE(c.fill_engine == FillEngine::automatic);
    auto made = make_expert_cache(rt, c);
    REQUIRE_MESSAGE(made.ok(), std::string(made.status().message()));
    AnyExpertCache<CudaRuntime> any = std::move(made.value());
    CHECK(any.storage() == k.storage);
    CHECK(any.fill_engine() == k.forwards);
    fill_host(any);
    auto stream_or = rt.create_stream();
    REQUIRE(stream_or.ok());
    const CudaRuntime::Stream stream = stream_or.value();
    DeviceBuffer<std::int32_t> device_ids(kTopK);
    int slots_checked = 0;
    for (const auto& ids : make_trace(11)) {
      device_ids.upload(ids);
      REQUIRE(any.prepare(std::span<const std::int32_t>(device_ids.get(), ids.size()), stream).ok());
      REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
      // Overlap: the proxy's or the fill kernel's ready words come after the prepare's stream work;
      // the device going idle covers both before the slots are read.
      REQUIRE_CUDA_OK(cudaDeviceSynchronize());
      REQUIRE(any.take_errors() == 0u);
      slots_checked += check_resident_slots(any, download_map(any.resident_map_device()));
    }
    CHECK(slots_checked > kSteps);
    rt.destroy_stream(stream);
  }
  REQUIRE(set_link_profile(measured).ok());
}
