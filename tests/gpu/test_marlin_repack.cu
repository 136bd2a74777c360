// GPU tests of the NVFP4 -> Marlin kernels and the gather helpers, against the host reference.
// Exits 77 (Meson: SKIP) when no CUDA device is present (tests/gpu/gpu_main.cu).
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expert_cache/kernels/expert_map.cuh"
#include "expert_cache/reference/nvfp4_reference.hpp"
#include "expert_cache/repack/cuda_repack.cuh"
#include "support/cuda_support.hpp"
#include "support/nvfp4_layers.hpp"

using namespace expert_cache;
using test_support::bytes_equal;
using test_support::DeviceBuffer;
using test_support::layers_equal;
using test_support::PinnedBuffer;
using HostLayer = test_support::Nvfp4HostLayer;
using HostMarlin = test_support::MarlinHostLayer;

namespace {

// The layers of this file: one expert (5) with differing w1/w3 globals.
HostLayer random_layer(const Nvfp4Marlin& l, std::int64_t e, std::uint32_t seed) {
  return test_support::random_nvfp4_layer(l, e, seed, {.mismatched_expert = 5});
}

// The layer resident on the device, in both layouts.
struct DeviceLayer {
  DeviceBuffer<std::uint8_t> w13, s13, w2, s2;
  DeviceBuffer<float> g13, g2;
  DeviceBuffer<std::uint32_t> mw13, mw2;
  DeviceBuffer<std::uint8_t> ms13, ms2;
  DeviceBuffer<float> mg13, mg2;
  DeviceLayer(const Nvfp4Marlin& l, const HostLayer& h)
      : w13(h.w13), s13(h.s13), w2(h.w2), s2(h.s2), g13(h.g13), g2(h.g2),
        mw13(static_cast<std::size_t>(h.e * l.w13_words())), mw2(static_cast<std::size_t>(h.e * l.w2_words())),
        ms13(static_cast<std::size_t>(h.e * l.w13_scale_bytes())), ms2(static_cast<std::size_t>(h.e * l.w2_scale_bytes())),
        mg13(static_cast<std::size_t>(h.e)), mg2(static_cast<std::size_t>(h.e)) {}
  device::Nvfp4CheckpointPtrs src() const { return {w13.get(), s13.get(), g13.get(), w2.get(), s2.get(), g2.get()}; }
  device::Nvfp4MarlinPtrs dst() const { return {mw13.get(), mw2.get(), ms13.get(), ms2.get(), mg13.get(), mg2.get()}; }
  HostMarlin download(const Nvfp4Marlin& l, std::int64_t e) const {
    HostMarlin m(l, e);
    m.w13 = mw13.download();
    m.w2 = mw2.download();
    m.s13 = ms13.download();
    m.s2 = ms2.download();
    m.g13 = mg13.download();
    m.g2 = mg2.download();
    return m;
  }
};

// Marlin outputs of `e` experts in pinned host memory (the chunked path's destination).
struct PinnedMarlin {
  PinnedBuffer<std::uint32_t> w13, w2;
  PinnedBuffer<std::uint8_t> s13, s2;
  PinnedBuffer<float> g13, g2;
  PinnedMarlin(const Nvfp4Marlin& l, std::int64_t e)
      : w13(static_cast<std::size_t>(e * l.w13_words())), w2(static_cast<std::size_t>(e * l.w2_words())),
        s13(static_cast<std::size_t>(e * l.w13_scale_bytes())), s2(static_cast<std::size_t>(e * l.w2_scale_bytes())),
        g13(static_cast<std::size_t>(e)), g2(static_cast<std::size_t>(e)) {}
  Nvfp4MarlinLayer view() const { return {w13.span(), w2.span(), s13.span(), s2.span(), g13.span(), g2.span()}; }
  HostMarlin collect(const Nvfp4Marlin& l, std::int64_t e) const {
    HostMarlin m(l, e);
    m.w13 = w13.vec();
    m.w2 = w2.vec();
    m.s13 = s13.vec();
    m.s2 = s2.vec();
    m.g13 = g13.vec();
    m.g2 = g2.vec();
    return m;
  }
};

struct Shape {
  std::int64_t k, n;
  ActDtype d;
};
// N = 128 and 96 (shard padding), K % 128 != 0, and two shapes whose k-tiles and scale groups do
// not fill the tiled kernels' runs (K = 320: 20 k-tiles, w2 padded 80 -> 128; K = 2304: 144 groups).
constexpr Shape shapes[] = {{256, 128, ActDtype::bf16}, {256, 96, ActDtype::bf16}, {192, 64, ActDtype::fp16},
                            {320, 80, ActDtype::bf16},  {2304, 64, ActDtype::fp16}};
constexpr std::int64_t num_experts = 8;

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("device repack is byte-identical to the host reference (E=8, N=128 and N=96)") {
  for (const Shape& s : shapes) {
    CAPTURE(s.k);
    CAPTURE(s.n);
    const Nvfp4Marlin l{s.k, s.n, s.d};
    const HostLayer h = random_layer(l, num_experts, static_cast<std::uint32_t>(s.n * 7 + s.k));
    HostMarlin want(l, num_experts);
    auto host_report = repack_layer_reference(l, h.view(), want.view());
    REQUIRE(host_report.ok());

    DeviceLayer d(l, h);
    std::vector<std::string> warnings;
    auto report = device::repack_layer_device(l, num_experts, d.src(), d.dst(), nullptr,
                                              [&](std::string_view w) { warnings.emplace_back(w); });
    REQUIRE(report.ok());
    REQUIRE_CUDA_OK(cudaDeviceSynchronize());
    CHECK(report->params == host_report->params);
    CHECK(report->w13_global_mismatches == 1);
    CHECK(report->first_mismatch == 5);
    REQUIRE(warnings.size() == 1);  // to the caller's sink only
    CHECK(warnings[0].find("(first: 5)") != std::string::npos);
    const HostMarlin got = d.download(l, num_experts);
    CHECK(bytes_equal(got.w13, want.w13));
    CHECK(bytes_equal(got.w2, want.w2));
    CHECK(bytes_equal(got.s13, want.s13));
    CHECK(bytes_equal(got.s2, want.s2));
    CHECK(bytes_equal(got.g13, want.g13));
    CHECK(bytes_equal(got.g2, want.g2));
  }
}

TEST_CASE("host-chunked path (chunks 3+3+2, and one chunk) is byte-identical to the device path") {
  cudaStream_t stream = nullptr;
  REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const Shape& s : shapes) {
    CAPTURE(s.k);
    CAPTURE(s.n);
    const Nvfp4Marlin l{s.k, s.n, s.d};
    const HostLayer h = random_layer(l, num_experts, static_cast<std::uint32_t>(s.n * 3 + s.k));
    DeviceLayer d(l, h);
    REQUIRE(device::repack_layer_device(l, num_experts, d.src(), d.dst(), stream).ok());
    REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
    const HostMarlin device_out = d.download(l, num_experts);

    // Pinned sources and outputs.
    PinnedBuffer<std::uint8_t> w13(h.w13.size()), s13(h.s13.size()), w2(h.w2.size()), s2(h.s2.size());
    PinnedBuffer<float> g13(h.g13.size()), g2(h.g2.size());
    w13.fill_from(h.w13);
    s13.fill_from(h.s13);
    w2.fill_from(h.w2);
    s2.fill_from(h.s2);
    g13.fill_from(h.g13);
    g2.fill_from(h.g2);
    const Nvfp4CheckpointLayer src{num_experts, w13.span(), s13.span(), g13.span(), w2.span(), s2.span(), g2.span()};
    const PinnedMarlin out(l, num_experts);
    const Nvfp4MarlinLayer dst = out.view();
    const auto& ms13 = out.s13;

    // Rounds of ceil(chunk / 2) experts: 2+2+2+2, 3+3+2 (not dividing E), one round, 1 each.
    for (std::int64_t chunk : {std::int64_t{3}, std::int64_t{5}, std::int64_t{64}, std::int64_t{1}}) {
      CAPTURE(chunk);
      std::fill(ms13.span().begin(), ms13.span().end(), std::uint8_t{0xAB});
      auto r = device::repack_layer_host_chunked(l, src, dst, stream, chunk);
      REQUIRE(r.ok());
      CHECK(layers_equal(out.collect(l, num_experts), device_out));
    }

    // expert_chunk <= 0 is rejected before any side effect.
    std::fill(ms13.span().begin(), ms13.span().end(), std::uint8_t{0xAB});
    for (std::int64_t chunk : {std::int64_t{0}, std::int64_t{-1}}) {
      auto r = device::repack_layer_host_chunked(l, src, dst, stream, chunk);
      CHECK(r.status().code() == ErrorCode::invalid_argument);
    }
    CHECK(std::all_of(ms13.span().begin(), ms13.span().end(), [](std::uint8_t b) { return b == 0xAB; }));
  }
  REQUIRE_CUDA_OK(cudaStreamDestroy(stream));
}

TEST_CASE("host-chunked path rejects bad values before writing any output, naming the first one") {
  const Nvfp4Marlin l{256, 96, ActDtype::bf16};
  cudaStream_t stream = nullptr;
  REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int which = 0; which < 3; ++which) {
    CAPTURE(which);
    HostLayer h = random_layer(l, num_experts, 99);
    const std::size_t last_s2 = h.s2.size() - 3, last_s13 = h.s13.size() - 1;
    std::string want;
    if (which == 0) {  // two bad w2 scales in different rounds: the first is named
      h.s2[last_s2] = 0x7F;
      h.s2[40] = 0xC0;
      want = "w2_scale[40]";
    }
    if (which == 1) {  // in the last expert, found only by the last round of the stats pass
      h.s13[last_s13] = 0xFF;
      want = "w13_scale[" + std::to_string(last_s13) + "]";
    }
    if (which == 2) {  // a w3 global (column 1) of expert 6
      h.g13[13] = std::nanf("");
      want = "w13_scale_2[13]";
    }
    const PinnedMarlin out(l, num_experts);
    const auto& mw13 = out.w13;
    const auto& ms2 = out.s2;
    const auto& mg13 = out.g13;
    std::fill(mw13.span().begin(), mw13.span().end(), 0xABABABABu);
    std::fill(ms2.span().begin(), ms2.span().end(), std::uint8_t{0xAB});
    std::fill(mg13.span().begin(), mg13.span().end(), -1.0f);
    auto r = device::repack_layer_host_chunked(l, h.view(), out.view(), stream, 3);
    REQUIRE(!r.ok());
    CHECK(r.status().code() == ErrorCode::invalid_argument);
    CHECK(r.status().message().find(want) != std::string::npos);
    CHECK(std::all_of(mw13.span().begin(), mw13.span().end(), [](std::uint32_t x) { return x == 0xABABABABu; }));
    CHECK(std::all_of(ms2.span().begin(), ms2.span().end(), [](std::uint8_t x) { return x == 0xAB; }));
    CHECK(std::all_of(mg13.span().begin(), mg13.span().end(), [](float x) { return x == -1.0f; }));
  }
  REQUIRE_CUDA_OK(cudaStreamDestroy(stream));
}

TEST_CASE("misaligned tensors take the generic kernels and stay byte-identical to the host reference") {
  const Nvfp4Marlin l{320, 80, ActDtype::bf16};
  const HostLayer h = random_layer(l, num_experts, 4242);
  HostMarlin want(l, num_experts);
  REQUIRE(repack_layer_reference(l, h.view(), want.view()).ok());
  // Every tensor at an offset that breaks the tiled kernels' alignment (words stay 4-aligned).
  constexpr std::size_t byte_shift = 1, word_shift = 4;
  const auto padded = [](std::size_t bytes) { return bytes + 16; };
  DeviceBuffer<std::uint8_t> w13(padded(h.w13.size())), w2(padded(h.w2.size()));
  DeviceBuffer<std::uint8_t> mw13(padded(want.w13.size() * 4)), mw2(padded(want.w2.size() * 4));
  DeviceBuffer<std::uint8_t> ms13(padded(want.s13.size())), ms2(padded(want.s2.size()));
  const DeviceBuffer<std::uint8_t> s13(h.s13), s2(h.s2);
  const DeviceBuffer<float> g13(h.g13), g2(h.g2);
  DeviceBuffer<float> mg13(want.g13.size()), mg2(want.g2.size());
  REQUIRE_CUDA_OK(cudaMemcpy(w13.get() + byte_shift, h.w13.data(), h.w13.size(), cudaMemcpyHostToDevice));
  REQUIRE_CUDA_OK(cudaMemcpy(w2.get() + byte_shift, h.w2.data(), h.w2.size(), cudaMemcpyHostToDevice));
  const device::Nvfp4CheckpointPtrs src{w13.get() + byte_shift, s13.get(), g13.get(), w2.get() + byte_shift, s2.get(), g2.get()};
  const device::Nvfp4MarlinPtrs dst{reinterpret_cast<std::uint32_t*>(mw13.get() + word_shift),
                                    reinterpret_cast<std::uint32_t*>(mw2.get() + word_shift), ms13.get() + byte_shift,
                                    ms2.get() + byte_shift, mg13.get(), mg2.get()};
  auto report = device::repack_layer_device(l, num_experts, src, dst, nullptr);
  REQUIRE(report.ok());
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  HostMarlin got(l, num_experts);
  REQUIRE_CUDA_OK(cudaMemcpy(got.w13.data(), mw13.get() + word_shift, got.w13.size() * 4, cudaMemcpyDeviceToHost));
  REQUIRE_CUDA_OK(cudaMemcpy(got.w2.data(), mw2.get() + word_shift, got.w2.size() * 4, cudaMemcpyDeviceToHost));
  REQUIRE_CUDA_OK(cudaMemcpy(got.s13.data(), ms13.get() + byte_shift, got.s13.size(), cudaMemcpyDeviceToHost));
  REQUIRE_CUDA_OK(cudaMemcpy(got.s2.data(), ms2.get() + byte_shift, got.s2.size(), cudaMemcpyDeviceToHost));
  got.g13 = mg13.download();
  got.g2 = mg2.download();
  CHECK(layers_equal(got, want));
}

TEST_CASE("round trip: dequant of the device output == e2m1 * e4m3 * g up to the flush") {
  for (const Shape& s : shapes) {
    CAPTURE(s.k);
    CAPTURE(s.n);
    const Nvfp4Marlin l{s.k, s.n, s.d};
    const HostLayer h = random_layer(l, num_experts, static_cast<std::uint32_t>(s.n + 11));
    DeviceLayer d(l, h);
    auto report = device::repack_layer_device(l, num_experts, d.src(), d.dst(), nullptr);
    REQUIRE(report.ok());
    REQUIRE_CUDA_OK(cudaDeviceSynchronize());
    HostMarlin got = d.download(l, num_experts);
    const auto n13 = static_cast<std::size_t>(num_experts * 2 * s.n * s.k), n2 = static_cast<std::size_t>(num_experts * s.k * s.n);
    std::vector<double> a13(n13), a2(n2), b13(n13), b2(n2);
    REQUIRE(dequant_marlin_reference(l, num_experts, got.view().as_const(), a13, a2).ok());
    REQUIRE(dequant_checkpoint_reference(l, h.view(), b13, b2, &report->params).ok());
    CHECK(a13 == b13);
    CHECK(a2 == b2);
    // The flushed scales as the oracle decides them (values and the max-based factors), not as
    // the encode under test does.
    CHECK(report->params.w13_log2_sf == test_support::literal_log2_sf(h.s13, s.d));
    CHECK(report->params.w2_log2_sf == test_support::literal_log2_sf(h.s2, s.d));
    std::vector<double> o13, o2;
    test_support::expected_marlin_dequant(l, h, o13, o2);
    CHECK(a13 == o13);
    CHECK(a2 == o2);
  }
}

TEST_CASE("device path rejects NaN / negative scales before writing any output") {
  const Nvfp4Marlin l{256, 96, ActDtype::bf16};
  HostLayer h = random_layer(l, num_experts, 1234);
  for (int which = 0; which < 3; ++which) {
    CAPTURE(which);
    HostLayer b = h;
    if (which == 0) b.s13[100] = 0x7F;   // NaN
    if (which == 1) b.s2[7] = 0xC0;      // negative
    if (which == 2) b.g2[3] = -0.5f;     // negative global
    DeviceLayer d(l, b);
    REQUIRE_CUDA_OK(cudaMemset(d.mw13.get(), 0xAB, static_cast<std::size_t>(num_experts * l.w13_words()) * 4));
    REQUIRE_CUDA_OK(cudaMemset(d.ms2.get(), 0xAB, static_cast<std::size_t>(num_experts * l.w2_scale_bytes())));
    auto r = device::repack_layer_device(l, num_experts, d.src(), d.dst(), nullptr);
    CHECK(r.status().code() == ErrorCode::invalid_argument);
    REQUIRE_CUDA_OK(cudaDeviceSynchronize());
    const auto w = d.mw13.download();
    const auto s = d.ms2.download();
    CHECK(std::all_of(w.begin(), w.end(), [](std::uint32_t x) { return x == 0xABABABABu; }));
    CHECK(std::all_of(s.begin(), s.end(), [](std::uint8_t x) { return x == 0xAB; }));
  }
}

TEST_CASE("apply_expert_map: global -> slot, -1 for absent and for any out-of-range id") {
  const std::int32_t num = 8, cap = 4;
  const std::vector<std::int32_t> map{-1, 2, -1, 0, 3, -1, 1, 7 /* not a valid slot */};
  DeviceBuffer<std::int32_t> d_map(map);
  const std::vector<std::int32_t> ids32{0, 1, 2, 3, 4, 5, 6, 7, 8, -1, INT_MIN, INT_MAX, 1};
  const std::vector<std::int32_t> want{-1, 2, -1, 0, 3, -1, 1, -1, -1, -1, -1, -1, 2};
  DeviceBuffer<std::int32_t> d_ids(ids32), d_out(ids32.size());
  REQUIRE(device::apply_expert_map(d_ids.get(), static_cast<std::int64_t>(ids32.size()), d_map.get(), num, cap, d_out.get(), nullptr).ok());
  CHECK(d_out.download() == want);
  for (std::size_t i = 0; i < ids32.size(); ++i) CHECK(device::map_expert_to_slot(ids32[i], map.data(), num, cap) == want[i]);

  const std::vector<std::int64_t> ids64{3, (std::int64_t{1} << 32) + 3, -(std::int64_t{1} << 40), LLONG_MAX, 6};
  const std::vector<std::int32_t> want64{0, -1, -1, -1, 1};
  DeviceBuffer<std::int64_t> d_ids64(ids64);
  DeviceBuffer<std::int32_t> d_out64(ids64.size());
  REQUIRE(device::apply_expert_map(d_ids64.get(), static_cast<std::int64_t>(ids64.size()), d_map.get(), num, cap, d_out64.get(), nullptr).ok());
  CHECK(d_out64.download() == want64);
  CHECK(device::apply_expert_map(d_ids.get(), -1, d_map.get(), num, cap, d_out.get(), nullptr).code() == ErrorCode::invalid_argument);
}

TEST_CASE("gather_experts_to_slots copies whole rows into slots, from device or mapped host memory") {
  const std::int32_t num = 6, cap = 3;
  for (std::size_t row_bytes : {std::size_t{4096 + 16}, std::size_t{1000 + 3}}) {  // 16-byte path and byte path
    CAPTURE(row_bytes);
    std::vector<std::uint8_t> pool(static_cast<std::size_t>(num) * row_bytes);
    for (std::size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<std::uint8_t>(i * 31 + i / row_bytes);
    const std::vector<std::int32_t> experts{4, 1, 9 /* dropped */, 5};
    const std::vector<std::int32_t> slots{2, 0, 1, -1 /* dropped */};
    DeviceBuffer<std::int32_t> d_e(experts), d_s(slots);
    std::vector<std::uint8_t> init(static_cast<std::size_t>(cap) * row_bytes, 0xEE);
    std::vector<std::uint8_t> want = init;
    std::copy_n(pool.begin() + 4 * static_cast<std::ptrdiff_t>(row_bytes), row_bytes, want.begin() + 2 * static_cast<std::ptrdiff_t>(row_bytes));
    std::copy_n(pool.begin() + 1 * static_cast<std::ptrdiff_t>(row_bytes), row_bytes, want.begin());

    DeviceBuffer<std::uint8_t> d_pool(pool), d_slots(init);
    REQUIRE(device::gather_experts_to_slots(d_pool.get(), num, d_slots.get(), cap, row_bytes, d_e.get(), d_s.get(), 4, nullptr).ok());
    CHECK(d_slots.download() == want);

    // Zero-copy from mapped pinned host memory.
    const PinnedBuffer<std::uint8_t> mapped(pool.size());
    mapped.fill_from(pool);
    d_slots.upload(init);
    REQUIRE(device::gather_experts_to_slots(mapped.device_ptr(), num, d_slots.get(), cap, row_bytes, d_e.get(), d_s.get(), 4,
                                            nullptr).ok());
    CHECK(d_slots.download() == want);
  }
}

}  // TEST_SUITE
