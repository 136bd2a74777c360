#pragma once
// A repacked random NVFP4 layer in the Marlin layout and its device slot buffers, shared by the
// GPU consumer tests (test_moe_consumer.cu, test_moe_grouped.cu). Needs nvcc and doctest.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include <doctest/doctest.h>

#include "expert_cache/reference/moe_consumer.cuh"
#include "expert_cache/reference/nvfp4_reference.hpp"
#include "support/cuda_support.hpp"

namespace test_support {

using namespace expert_cache;

template <class T>
using DevArray = DeviceBuffer<T>;

// A repacked random layer in the Marlin layout (host) plus its double dequantisation.
struct Layer {
  Nvfp4Marlin layout;
  std::int64_t experts = 0;
  std::vector<std::uint32_t> w13, w2;
  std::vector<std::uint8_t> s13, s2;
  std::vector<float> g13, g2;
  std::vector<double> dq13, dq2;  // [E, 2N, K], [E, K, N]
  // Bytes of tensor t of expert e in the Marlin layout (what a cache slot holds).
  [[nodiscard]] const unsigned char* tensor(std::size_t t, std::int64_t e) const {
    const ExpertTensorBytes b = layout.tensors();
    const auto off = static_cast<std::size_t>(e) * b[t].bytes_per_expert;
    switch (t) {
      case 0: return reinterpret_cast<const unsigned char*>(w13.data()) + off;
      case 1: return reinterpret_cast<const unsigned char*>(w2.data()) + off;
      case 2: return s13.data() + off;
      case 3: return s2.data() + off;
      case 4: return reinterpret_cast<const unsigned char*>(g13.data()) + off;
      default: return reinterpret_cast<const unsigned char*>(g2.data()) + off;
    }
  }
};

inline Layer make_layer(std::int64_t hidden, std::int64_t intermediate, std::int64_t experts, std::uint64_t seed) {
  Layer L;
  L.layout = Nvfp4Marlin{hidden, intermediate, ActDtype::bf16};
  L.experts = experts;
  const Nvfp4Marlin& lay = L.layout;
  std::mt19937_64 rng(seed);
  auto bytes = [&](std::int64_t n, int lo, int hi) {
    std::vector<std::uint8_t> v(static_cast<std::size_t>(n));
    std::uniform_int_distribution<int> d(lo, hi);
    for (auto& b : v) b = static_cast<std::uint8_t>(d(rng));
    return v;
  };
  const auto w13 = bytes(experts * lay.ckpt_w13_bytes(), 0, 255);
  const auto w2 = bytes(experts * lay.ckpt_w2_bytes(), 0, 255);
  const auto s13 = bytes(experts * lay.ckpt_w13_scale_bytes(), 0x30, 0x58);
  const auto s2 = bytes(experts * lay.ckpt_w2_scale_bytes(), 0x30, 0x58);
  std::vector<float> g13c(static_cast<std::size_t>(experts * 2)), g2c(static_cast<std::size_t>(experts));
  std::uniform_real_distribution<float> g(0.01f, 0.03f);
  for (std::int64_t e = 0; e < experts; ++e) {
    g13c[static_cast<std::size_t>(2 * e)] = g13c[static_cast<std::size_t>(2 * e + 1)] = g(rng);
    g2c[static_cast<std::size_t>(e)] = g(rng);
  }
  L.w13.resize(static_cast<std::size_t>(experts * lay.w13_words()));
  L.w2.resize(static_cast<std::size_t>(experts * lay.w2_words()));
  L.s13.resize(static_cast<std::size_t>(experts * lay.w13_scale_bytes()));
  L.s2.resize(static_cast<std::size_t>(experts * lay.w2_scale_bytes()));
  L.g13.resize(static_cast<std::size_t>(experts));
  L.g2.resize(static_cast<std::size_t>(experts));
  const Nvfp4CheckpointLayer src{experts, w13, s13, g13c, w2, s2, g2c};
  const Nvfp4MarlinLayer dst{L.w13, L.w2, L.s13, L.s2, L.g13, L.g2};
  REQUIRE(repack_layer_reference(lay, src, dst).ok());
  L.dq13.resize(static_cast<std::size_t>(experts * 2 * intermediate * hidden));
  L.dq2.resize(static_cast<std::size_t>(experts * hidden * intermediate));
  REQUIRE(dequant_marlin_reference(lay, experts, dst.as_const(), L.dq13, L.dq2).ok());
  return L;
}

// Device slot buffers of a layer: expert e in slot map[e] (map empty: slot = expert, identity
// map, all resident). Slots no expert maps to hold garbage (NaN global scales), so reading one shows.
struct ResidentLayer {
  std::vector<std::unique_ptr<DevArray<unsigned char>>> tensors;
  std::unique_ptr<DevArray<std::int32_t>> map_dev;
  device::MoeWeights weights;
  explicit ResidentLayer(const Layer& L, std::vector<std::int32_t> map = {}, std::int64_t slots = 0) {
    if (map.empty()) {
      map.resize(static_cast<std::size_t>(L.experts));
      for (std::size_t e = 0; e < map.size(); ++e) map[e] = static_cast<std::int32_t>(e);
    }
    if (slots == 0) slots = L.experts;
    const ExpertTensorBytes b = L.layout.tensors();
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const std::size_t row = b[t].bytes_per_expert;
      if (row == 0) continue;  // tensors the layout does not have
      std::vector<unsigned char> host(row * static_cast<std::size_t>(slots), 0xFF);
      for (std::size_t e = 0; e < map.size(); ++e)
        if (map[e] >= 0) std::memcpy(host.data() + row * static_cast<std::size_t>(map[e]), L.tensor(t, static_cast<std::int64_t>(e)), row);
      tensors.push_back(std::make_unique<DevArray<unsigned char>>(host));
      weights.base[t] = tensors.back()->get();
      weights.stride[t] = row;
    }
    map_dev = std::make_unique<DevArray<std::int32_t>>(map);
    weights.expert_map = map_dev->get();
    weights.num_experts = static_cast<std::int32_t>(L.experts);
  }
};

inline std::vector<float> random_x(int tokens, std::int64_t hidden, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(tokens * hidden));
  for (auto& v : x) v = d(rng);
  return x;
}

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (const double x : v) m = std::max(m, std::abs(x));
  return m;
}

}  // namespace test_support
