#pragma once
// NVFP4 test layers shared by the host layout test (tests/host/test_layout_nvfp4_marlin.cpp) and the
// GPU repack test (tests/gpu/test_marlin_repack.cu). Host code only:
//  * random_nvfp4_layer: a checkpoint layer with random codes and a mix of block scales (zeros,
//    subnormals, -0, the family's maximum and normals below it) and optionally one expert whose
//    w1 and w3 global scales differ;
//  * MarlinHostLayer: Marlin outputs of E experts, poisoned so an untouched output shows;
//  * the flush oracle: which block scales the Marlin layout reads as 0, computed from the values
//    (e4m3 decoded here, the layer factor from the maximum) and not from the encode under test.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/reference/nvfp4_reference.hpp"

namespace test_support {

struct Nvfp4HostLayer {
  std::int64_t e = 0;
  std::vector<std::uint8_t> w13, s13, w2, s2;
  std::vector<float> g13, g2;
  [[nodiscard]] expert_cache::Nvfp4CheckpointLayer view() const { return {e, w13, s13, g13, w2, s2, g2}; }
};

struct Nvfp4LayerOptions {
  std::uint8_t w13_scale_max = 0x7E;   // 448: the bf16 layer factor is 1
  std::uint8_t w2_scale_max = 0x3F;    // 1.875: small, so the bf16 layer factor is > 1
  std::int64_t mismatched_expert = -1; // expert whose w3 global is half its w1 global, or -1
};

// One block scale: zero, a subnormal, -0, the maximum, or a normal in [0x08, max].
inline std::uint8_t random_block_scale(std::mt19937& rng, std::uint8_t max) {
  const unsigned kind = rng() % 16;
  if (kind == 0) return 0;
  if (kind == 1) return static_cast<std::uint8_t>(1 + rng() % 7);
  if (kind == 2) return 0x80;
  if (kind == 3) return max;
  return static_cast<std::uint8_t>(0x08 + rng() % (max - 0x08 + 1u));
}

inline Nvfp4HostLayer random_nvfp4_layer(const expert_cache::Nvfp4Marlin& l, std::int64_t e, std::uint32_t seed,
                                         const Nvfp4LayerOptions& o = {}) {
  std::mt19937 rng(seed);
  Nvfp4HostLayer h;
  h.e = e;
  auto bytes = [&](std::int64_t n) {
    std::vector<std::uint8_t> v(static_cast<std::size_t>(n));
    for (auto& b : v) b = static_cast<std::uint8_t>(rng());
    return v;
  };
  h.w13 = bytes(e * l.ckpt_w13_bytes());
  h.w2 = bytes(e * l.ckpt_w2_bytes());
  h.s13.resize(static_cast<std::size_t>(e * l.ckpt_w13_scale_bytes()));
  h.s2.resize(static_cast<std::size_t>(e * l.ckpt_w2_scale_bytes()));
  for (auto& b : h.s13) b = random_block_scale(rng, o.w13_scale_max);
  for (auto& b : h.s2) b = random_block_scale(rng, o.w2_scale_max);
  std::uniform_real_distribution<float> gd(1e-4f, 1e-2f);
  for (std::int64_t i = 0; i < e; ++i) {
    const float g = gd(rng);
    h.g13.push_back(g);
    h.g13.push_back(i == o.mismatched_expert ? g * 0.5f : g);
    h.g2.push_back(gd(rng));
  }
  return h;
}

// Marlin outputs of `e` experts, every element poisoned (untouched() tells whether any changed).
struct MarlinHostLayer {
  std::vector<std::uint32_t> w13, w2;
  std::vector<std::uint8_t> s13, s2;
  std::vector<float> g13, g2;
  MarlinHostLayer(const expert_cache::Nvfp4Marlin& l, std::int64_t e)
      : w13(static_cast<std::size_t>(e * l.w13_words()), 0xDEADBEEFu),
        w2(static_cast<std::size_t>(e * l.w2_words()), 0xDEADBEEFu),
        s13(static_cast<std::size_t>(e * l.w13_scale_bytes()), 0xAB),
        s2(static_cast<std::size_t>(e * l.w2_scale_bytes()), 0xAB),
        g13(static_cast<std::size_t>(e), -1.0f),
        g2(static_cast<std::size_t>(e), -1.0f) {}
  [[nodiscard]] expert_cache::Nvfp4MarlinLayer view() { return {w13, w2, s13, s2, g13, g2}; }
  [[nodiscard]] bool untouched() const {
    auto all = [](const auto& v, auto x) { return std::all_of(v.begin(), v.end(), [&](auto y) { return y == x; }); };
    return all(w13, 0xDEADBEEFu) && all(w2, 0xDEADBEEFu) && all(s13, std::uint8_t{0xAB}) &&
           all(s2, std::uint8_t{0xAB}) && all(g13, -1.0f) && all(g2, -1.0f);
  }
};

// Same size and the same bytes (floats compared bit for bit).
inline bool bytes_equal(const auto& a, const auto& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
}

inline bool layers_equal(const MarlinHostLayer& a, const MarlinHostLayer& b) {
  return bytes_equal(a.w13, b.w13) && bytes_equal(a.w2, b.w2) && bytes_equal(a.s13, b.s13) &&
         bytes_equal(a.s2, b.s2) && bytes_equal(a.g13, b.g13) && bytes_equal(a.g2, b.g2);
}

// ---- the flush oracle ---------------------------------------------------------------------------
// NVFP4 block scales are FP8 E4M3 (bias 7, 3 mantissa bits, 0x7F/0xFF NaN). The Marlin layout
// stores v = scale * sf * 128 (sf the layer factor) as bits [14:7] of its fp16 encoding, and the
// kernel's bf16 decode needs bit 14 set, i.e. v >= 2; every smaller (zero, negative, subnormal
// at sf = 1) scale reads as 0 (docs/nvfp4_marlin.md). These helpers decide that from the values.

inline double literal_e4m3(std::uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (b & 0x80) ? -mag : mag;
}

// The layer factor's exponent: bf16 -> the largest p with max * 2^p <= 448 over the positive
// scales (0 without any); fp16 -> 0.
inline int literal_log2_sf(std::span<const std::uint8_t> scales, expert_cache::ActDtype dtype) {
  if (dtype == expert_cache::ActDtype::fp16) return 0;
  double m = 0;
  bool any = false;
  for (auto b : scales) {
    const double v = literal_e4m3(b);
    if (v > 0 && !std::isnan(v) && (b & 0x7F) != 0x7F) {
      m = any ? std::max(m, v) : v;
      any = true;
    }
  }
  if (!any || !(m < 448.0)) return 0;
  return static_cast<int>(std::floor(std::log2(448.0 / m)));
}

// True when the Marlin layout reads block scale `b` as 0 under layer factor 2^log2_sf.
inline bool marlin_flushes_scale(std::uint8_t b, int log2_sf) {
  if ((b & 0x7F) == 0x7F) return true;  // NaN (rejected by validation before any repack)
  return !(literal_e4m3(b) * std::ldexp(1.0, log2_sf) * 128.0 >= 2.0);
}

// Checkpoint values e2m1 * e4m3 * g (dequant_checkpoint_reference without its flush option) with
// every element whose block scale the oracle flushes set to 0: what dequantising the Marlin
// layout must give. The factors come from literal_log2_sf.
inline void expected_marlin_dequant(const expert_cache::Nvfp4Marlin& l, const Nvfp4HostLayer& h,
                                    std::vector<double>& w13, std::vector<double>& w2) {
  const std::int64_t k = l.hidden, n = l.intermediate;
  w13.assign(static_cast<std::size_t>(h.e * 2 * n * k), 0.0);
  w2.assign(static_cast<std::size_t>(h.e * k * n), 0.0);
  if (!expert_cache::dequant_checkpoint_reference(l, h.view(), w13, w2).ok()) {
    w13.clear();  // a size mismatch: the comparison that follows fails
    w2.clear();
    return;
  }
  const int sf13 = literal_log2_sf(h.s13, l.dtype), sf2 = literal_log2_sf(h.s2, l.dtype);
  for (std::size_t i = 0; i < w13.size(); ++i) {  // element (row r, column c): scale r * K/16 + c/16
    const std::size_t r = i / static_cast<std::size_t>(k), c = i % static_cast<std::size_t>(k);
    if (marlin_flushes_scale(h.s13[r * static_cast<std::size_t>(k / 16) + c / 16], sf13)) w13[i] = 0.0;
  }
  for (std::size_t i = 0; i < w2.size(); ++i) {
    const std::size_t r = i / static_cast<std::size_t>(n), c = i % static_cast<std::size_t>(n);
    if (marlin_flushes_scale(h.s2[r * static_cast<std::size_t>(n / 16) + c / 16], sf2)) w2[i] = 0.0;
  }
}

}  // namespace test_support
