// NVFP4 -> Marlin layout: index maps, encodes, padding, sizes, validation and round trips.
// The "literal" helpers below rebuild every step the way docs/nvfp4_marlin.md (Maps, Encodes) states it
// (GPTQ int32 view, per-lane tile loops, scale_perm list, float path through fp16 bits), so
// they share no code with the closed forms under test. The random layers and the flush oracle
// (which scales Marlin reads as 0, decided from the values) are shared with the GPU repack test
// (tests/support/nvfp4_layers.hpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "expert_cache/layout/dense.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/reference/nvfp4_reference.hpp"
#include "support/nvfp4_layers.hpp"

using namespace expert_cache;
using test_support::literal_e4m3;
using test_support::literal_log2_sf;
using HostLayer = test_support::Nvfp4HostLayer;
using MarlinBuffers = test_support::MarlinHostLayer;

namespace {

// ---- independent scalar helpers --------------------------------------------------------------

// fp16 bits of a double that fp16 represents exactly or that overflows (round to nearest is not
// needed: every value the encode sees has at most 4 significant bits).
std::uint16_t literal_fp16_bits(double v) {
  if (v == 0.0) return 0;
  int exp = 0;
  const double frac = std::frexp(v, &exp);  // v = frac * 2^exp, frac in [0.5, 1)
  int e16 = exp - 1 + 15;
  if (e16 >= 31) return 0x7C00;
  if (e16 <= 0) return static_cast<std::uint16_t>(std::ldexp(v, 24));  // subnormal
  const auto mant = static_cast<std::uint16_t>(std::ldexp(frac * 2.0 - 1.0, 10));
  return static_cast<std::uint16_t>((e16 << 10) | mant);
}

std::uint8_t literal_s0e5m3(std::uint8_t b, int log2_sf) {
  if ((b & 0x7F) == 0x7F) return 0;  // NaN: the layer validation rejects it; the encode maps it to 0
  const double v = literal_e4m3(b) * std::ldexp(1.0, log2_sf) * 128.0;
  if (!(v >= 2.0)) return 0;
  return static_cast<std::uint8_t>((literal_fp16_bits(v) >> 7) & 0xFF);
}

// ---- literal per-expert repack -----------------------------------------------------------------

// Step A: bytes [size_n][size_k/2] -> int32 little endian [size_n][size_k/8] -> transpose Q[size_k/8][size_n].
std::vector<std::uint32_t> gptq_view(const std::vector<std::uint8_t>& bytes, std::int64_t size_k, std::int64_t size_n) {
  std::vector<std::uint32_t> q(static_cast<std::size_t>(size_k / 8 * size_n));
  for (std::int64_t n = 0; n < size_n; ++n)
    for (std::int64_t kw = 0; kw < size_k / 8; ++kw) {
      std::uint32_t word = 0;
      std::memcpy(&word, &bytes[static_cast<std::size_t>(n * (size_k / 2) + kw * 4)], 4);
      q[static_cast<std::size_t>(kw * size_n + n)] = word;
    }
  return q;
}

// Step B as the kernel's per-lane loops: vals = [r, r+1, r+8, r+9] at c, then at c+8; pack order
// {0,2,4,6,1,3,5,7}.
std::vector<std::uint32_t> literal_repack(const std::vector<std::uint32_t>& q, std::int64_t size_k, std::int64_t size_n) {
  auto code = [&](std::int64_t k, std::int64_t n) {
    return (q[static_cast<std::size_t>((k / 8) * size_n + n)] >> (4 * (k % 8))) & 0xFu;
  };
  std::vector<std::uint32_t> out(static_cast<std::size_t>(size_k / 16 * 2 * size_n));
  constexpr int pack_idx[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  for (std::int64_t kt = 0; kt < size_k / 16; ++kt)
    for (std::int64_t nt = 0; nt < size_n / 64; ++nt)
      for (int w = 0; w < 4; ++w)
        for (int t = 0; t < 32; ++t) {
          const std::int64_t k0 = 16 * kt, n0 = 64 * nt;
          const int r = 2 * (t % 4), c = 16 * w + t / 4;
          std::uint32_t vals[8];
          const int rows[4] = {r, r + 1, r + 8, r + 9};
          for (int j = 0; j < 4; ++j) {
            vals[j] = code(k0 + rows[j], n0 + c);
            vals[4 + j] = code(k0 + rows[j], n0 + c + 8);
          }
          std::uint32_t res = 0;
          for (int i = 0; i < 8; ++i) res |= vals[pack_idx[i]] << (4 * i);
          out[static_cast<std::size_t>(kt * 2 * size_n + 128 * nt + 4 * t + w)] = res;
        }
  return out;
}

std::vector<int> literal_scale_perm() {
  std::vector<int> perm;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) perm.push_back(i + 8 * j);
  return perm;
}

// Scales [size_n][groups] (checkpoint orientation, padded) -> Marlin bytes [groups][size_n].
std::vector<std::uint8_t> literal_scales(const std::vector<std::uint8_t>& s, std::int64_t groups, std::int64_t size_n,
                                         int log2_sf) {
  const auto perm = literal_scale_perm();
  std::vector<std::uint8_t> out(static_cast<std::size_t>(groups * size_n));
  for (std::int64_t g = 0; g < groups; ++g) {
    std::vector<std::uint8_t> row(static_cast<std::size_t>(size_n)), p(row.size()), r(row.size());
    for (std::int64_t n = 0; n < size_n; ++n) row[static_cast<std::size_t>(n)] = s[static_cast<std::size_t>(n * groups + g)];
    for (std::int64_t b = 0; b < size_n / 64; ++b)
      for (int i = 0; i < 64; ++i) p[static_cast<std::size_t>(64 * b + i)] = row[static_cast<std::size_t>(64 * b + perm[static_cast<std::size_t>(i)])];
    constexpr int swap[4] = {0, 2, 1, 3};
    for (std::int64_t a = 0; a < size_n / 4; ++a)
      for (int i = 0; i < 4; ++i) r[static_cast<std::size_t>(4 * a + i)] = p[static_cast<std::size_t>(4 * a + swap[i])];
    for (std::int64_t n = 0; n < size_n; ++n)
      out[static_cast<std::size_t>(g * size_n + n)] = literal_s0e5m3(r[static_cast<std::size_t>(n)], log2_sf);
  }
  return out;
}

// ---- random layers ---------------------------------------------------------------------------

// Literal whole-layer reference: pad as docs/nvfp4_marlin.md (Padding) says, then run the literal per-expert steps.
MarlinBuffers literal_layer(const Nvfp4Marlin& l, const HostLayer& h) {
  MarlinBuffers out(l, h.e);
  const std::int64_t K = l.hidden, N = l.intermediate, Np = l.padded_intermediate();
  const int sf13 = literal_log2_sf(h.s13, l.dtype), sf2 = literal_log2_sf(h.s2, l.dtype);
  for (std::int64_t e = 0; e < h.e; ++e) {
    // w13: [2, N, cols] -> pad rows of each shard to Np -> [2Np, cols]
    std::vector<std::uint8_t> w13p(static_cast<std::size_t>(2 * Np * K / 2), 0), s13p(static_cast<std::size_t>(2 * Np * K / 16), 0);
    for (int shard = 0; shard < 2; ++shard)
      for (std::int64_t r = 0; r < N; ++r) {
        const std::int64_t src = e * 2 * N + shard * N + r, dst = shard * Np + r;
        std::memcpy(&w13p[static_cast<std::size_t>(dst * K / 2)], &h.w13[static_cast<std::size_t>(src * K / 2)], static_cast<std::size_t>(K / 2));
        std::memcpy(&s13p[static_cast<std::size_t>(dst * K / 16)], &h.s13[static_cast<std::size_t>(src * K / 16)], static_cast<std::size_t>(K / 16));
      }
    // w2: pad the last dim N/2 -> Np/2 and N/16 -> Np/16
    std::vector<std::uint8_t> w2p(static_cast<std::size_t>(K * Np / 2), 0), s2p(static_cast<std::size_t>(K * Np / 16), 0);
    for (std::int64_t r = 0; r < K; ++r) {
      std::memcpy(&w2p[static_cast<std::size_t>(r * Np / 2)], &h.w2[static_cast<std::size_t>((e * K + r) * N / 2)], static_cast<std::size_t>(N / 2));
      std::memcpy(&s2p[static_cast<std::size_t>(r * Np / 16)], &h.s2[static_cast<std::size_t>((e * K + r) * N / 16)], static_cast<std::size_t>(N / 16));
    }
    const auto w13m = literal_repack(gptq_view(w13p, K, 2 * Np), K, 2 * Np);
    const auto w2m = literal_repack(gptq_view(w2p, Np, K), Np, K);
    const auto s13m = literal_scales(s13p, K / 16, 2 * Np, sf13);
    const auto s2m = literal_scales(s2p, Np / 16, K, sf2);
    std::copy(w13m.begin(), w13m.end(), out.w13.begin() + e * l.w13_words());
    std::copy(w2m.begin(), w2m.end(), out.w2.begin() + e * l.w2_words());
    std::copy(s13m.begin(), s13m.end(), out.s13.begin() + e * l.w13_scale_bytes());
    std::copy(s2m.begin(), s2m.end(), out.s2.begin() + e * l.w2_scale_bytes());
    const int bias = l.dtype == ActDtype::fp16 ? 14 : 126;
    out.g13[static_cast<std::size_t>(e)] = static_cast<float>(std::ldexp(h.g13[static_cast<std::size_t>(2 * e)], bias - 7 - sf13));
    out.g2[static_cast<std::size_t>(e)] = static_cast<float>(std::ldexp(h.g2[static_cast<std::size_t>(e)], bias - 7 - sf2));
  }
  return out;
}

HostLayer random_layer(const Nvfp4Marlin& l, std::int64_t e, std::uint32_t seed) {
  return test_support::random_nvfp4_layer(l, e, seed);  // w1 == w3 globals (the common case)
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) { return test_support::bytes_equal(a, b); }

}  // namespace

TEST_SUITE("layout") {

// ---- compile-time facts -------------------------------------------------------------------------
static_assert(marlin::s0e5m3_from_e4m3(0x38, 0) == 0xB0);  // 1.0 -> fp16 128 = 0x5800 -> bits 14..7
static_assert(marlin::s0e5m3_value(0xB0) == 128.0f);
static_assert(marlin::padded_intermediate(2048, 512) == 512);
static_assert(marlin::padded_intermediate(256, 96) == 128);
static_assert(marlin::padded_intermediate(192, 64) == 128);
static_assert(Nvfp4Marlin{2048, 512, ActDtype::bf16}.bytes_per_expert() == 1769480);  // 1.688 MiB

TEST_CASE("tensor sizes for K=2048, N=512 match the measured expert (1 MiB, 512 KiB, 128 KiB, 64 KiB, 4 B, 4 B)") {
  const Nvfp4Marlin l{2048, 512, ActDtype::bf16};
  REQUIRE(l.validate().ok());
  const auto t = l.tensors();
  CHECK(t[0] == TensorBytes{"w13", 1u << 20});
  CHECK(t[1] == TensorBytes{"w2", 512u << 10});
  CHECK(t[2] == TensorBytes{"w13_scale", 128u << 10});
  CHECK(t[3] == TensorBytes{"w2_scale", 64u << 10});
  CHECK(t[4] == TensorBytes{"w13_scale_2", 4});
  CHECK(t[5] == TensorBytes{"w2_scale_2", 4});
  CHECK(l.bytes_per_expert() == (1u << 20) + (512u << 10) + (128u << 10) + (64u << 10) + 8);
  // The repack is a pure nibble permutation: Marlin weights hold as many bytes as the padded checkpoint.
  CHECK(l.w13_words() * 4 == 2 * l.padded_intermediate() * l.hidden / 2);
  CHECK(l.w2_words() * 4 == l.hidden * l.padded_intermediate() / 2);

  const DenseBf16 d{2048, 512};
  REQUIRE(d.validate().ok());
  CHECK(d.tensors()[0].bytes_per_expert == 2u * 512 * 2048 * 2);
  CHECK(d.tensors()[1].bytes_per_expert == 2048u * 512 * 2);
  for (std::size_t i = 2; i < 6; ++i) CHECK(d.tensors()[i].bytes_per_expert == 0);
  CHECK(d.tensors()[3].name == "w2_scale");
  CHECK_FALSE(DenseBf16{0, 4}.validate().ok());
}

TEST_CASE("padding rules: N=128, N=96, the K%128!=0 branch, per-shard w13 padding") {
  struct Case { std::int64_t k, n, np; };
  for (const Case c : {Case{256, 128, 128}, Case{256, 96, 128}, Case{256, 64, 64}, Case{256, 16, 64},
                       Case{192, 64, 128}, Case{192, 128, 128}, Case{192, 192, 256}, Case{64, 96, 128},
                       Case{2048, 512, 512}, Case{2880, 2880, 2944}}) {
    CAPTURE(c.k);
    CAPTURE(c.n);
    CHECK(marlin::padded_intermediate(c.k, c.n) == c.np);
    const Nvfp4Marlin l{c.k, c.n, ActDtype::bf16};
    CHECK(l.validate().ok());
    CHECK(l.w13_gemm() == MarlinGemmShape{c.k, 2 * c.np});
    CHECK(l.w2_gemm() == MarlinGemmShape{c.np, c.k});
  }
  // Per-shard: N=96 -> Np=128: GEMM columns 96..127 and 224..255 are padding; 128..223 = up rows 96..191.
  CHECK(marlin::w13_checkpoint_row(0, 96, 128) == 0);
  CHECK(marlin::w13_checkpoint_row(95, 96, 128) == 95);
  CHECK(marlin::w13_checkpoint_row(96, 96, 128) == -1);
  CHECK(marlin::w13_checkpoint_row(127, 96, 128) == -1);
  CHECK(marlin::w13_checkpoint_row(128, 96, 128) == 96);
  CHECK(marlin::w13_checkpoint_row(223, 96, 128) == 191);
  CHECK(marlin::w13_checkpoint_row(224, 96, 128) == -1);
}

TEST_CASE("weight index map equals the permutation built by the reference's per-lane loops") {
  for (const auto& shape : {std::pair<std::int64_t, std::int64_t>{16, 64}, {64, 128}, {128, 192}, {32, 256}}) {
    // Not a structured binding: CAPTURE's lambda captures these (clang before 16 refuses bindings).
    const std::int64_t size_k = shape.first, size_n = shape.second;
    CAPTURE(size_k);
    CAPTURE(size_n);
    // Literal construction with unique ids: record which (k, n) each (word, nibble) receives.
    std::vector<std::int64_t> src_of(static_cast<std::size_t>(size_k / 16 * 2 * size_n * 8), -1);
    for (std::int64_t kt = 0; kt < size_k / 16; ++kt)
      for (std::int64_t nt = 0; nt < size_n / 64; ++nt)
        for (int w = 0; w < 4; ++w)
          for (int t = 0; t < 32; ++t) {
            const int r = 2 * (t % 4), c = 16 * w + t / 4;
            std::int64_t vals[8];
            const int rows[4] = {r, r + 1, r + 8, r + 9};
            for (int j = 0; j < 4; ++j) {
              vals[j] = (16 * kt + rows[j]) * size_n + 64 * nt + c;
              vals[4 + j] = (16 * kt + rows[j]) * size_n + 64 * nt + c + 8;
            }
            constexpr int pack_idx[8] = {0, 2, 4, 6, 1, 3, 5, 7};
            const std::int64_t word = kt * 2 * size_n + 128 * nt + 4 * t + w;
            for (int i = 0; i < 8; ++i) src_of[static_cast<std::size_t>(word * 8 + i)] = vals[pack_idx[i]];
          }
    std::vector<int> seen(static_cast<std::size_t>(size_k * size_n), 0);
    bool forward_ok = true, inverse_ok = true;
    for (std::int64_t word = 0; word < size_k / 16 * 2 * size_n; ++word)
      for (int i = 0; i < 8; ++i) {
        const std::int64_t id = src_of[static_cast<std::size_t>(word * 8 + i)];
        const auto got = marlin::weight_source(word / (2 * size_n), word % (2 * size_n), i);
        forward_ok &= got == marlin::CodeCoord{id / size_n, id % size_n};
        inverse_ok &= marlin::weight_dest(id / size_n, id % size_n, size_n) == marlin::NibbleCoord{word, i};
        ++seen[static_cast<std::size_t>(id)];
      }
    CHECK(forward_ok);
    CHECK(inverse_ok);
    CHECK(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; }));  // a bijection
  }
}

TEST_CASE("weight_word_from_bytes (the tiled kernel's form) equals weight_word on random rows") {
  // One 16 x 64 tile of random checkpoint rows (64 rows n, 8 bytes = 16 codes k each).
  std::mt19937 rng(77);
  std::array<std::uint8_t, 64 * 8> rows{};
  for (auto& b : rows) b = static_cast<std::uint8_t>(rng());
  const auto code_at = [&](std::int64_t k, std::int64_t n) {
    return marlin::packed_code(rows.data() + n * 8, k);
  };
  int mismatches = 0;
  for (int t = 0; t < 32; ++t)
    for (int w = 0; w < 4; ++w) {
      const int byte = t % 4, c = 16 * w + t / 4;  // k = r = 2 * (t % 4) lives in byte t % 4
      const std::uint32_t got = marlin::weight_word_from_bytes(rows[c * 8 + byte], rows[c * 8 + byte + 4],
                                                               rows[(c + 8) * 8 + byte], rows[(c + 8) * 8 + byte + 4]);
      mismatches += got != marlin::weight_word(code_at, 0, 4 * t + w) ? 1 : 0;
    }
  CHECK(mismatches == 0);
}

TEST_CASE("scale index map equals scale_perm followed by the [0,2,1,3] swap") {
  const auto perm = literal_scale_perm();
  CHECK(perm[1] == 8);
  CHECK(perm[8] == 1);
  for (std::int64_t size_n : {64, 128, 256, 2048}) {
    bool ok = true;
    for (std::int64_t col = 0; col < size_n; ++col) {
      constexpr int swap[4] = {0, 2, 1, 3};
      const std::int64_t p = col - col % 4 + swap[col % 4];                               // R[col] = P[p]
      const std::int64_t src = p - p % 64 + perm[static_cast<std::size_t>(p % 64)];     // P[p] = S[src]
      ok &= marlin::scale_source_col(col) == src;
      ok &= marlin::scale_dest_col(src) == col;
    }
    CHECK(ok);
  }
}

TEST_CASE("S0E5M3 encode of all 256 e4m3 bytes for several sf, and its decode") {
  for (int log2_sf : {0, 1, 3, 5, 7, 9, 12, 17}) {
    CAPTURE(log2_sf);
    int mismatches = 0, shortcut_mismatches = 0;
    for (int b = 0; b < 256; ++b) {
      const auto byte = static_cast<std::uint8_t>(b);
      const std::uint8_t got = marlin::s0e5m3_from_e4m3(byte, log2_sf);
      mismatches += got != literal_s0e5m3(byte, log2_sf);
      if (got != 0) {
        CHECK((got & 0x80) != 0);  // MSB set: the bf16 decode reads it as exponent bit
        if (got != 0xF8) CHECK(static_cast<double>(marlin::s0e5m3_value(got)) == literal_e4m3(byte) * std::ldexp(1.0, log2_sf + 7));
      }
      // Integer shortcut (docs/nvfp4_marlin.md, Encodes) for normal positive e4m3 when the result stays in fp16 range.
      const int e = (b >> 3) & 0xF;
      if (b >= 0x08 && b <= 0x7E && e + log2_sf <= 15 && e + log2_sf >= 1)
        shortcut_mismatches += got != static_cast<std::uint8_t>(b + ((log2_sf + 15) << 3));
    }
    CHECK(mismatches == 0);
    CHECK(shortcut_mismatches == 0);
  }
  // Flush: with sf = 1 every subnormal and every value < 2/128 goes to 0; negative and NaN too.
  for (std::uint8_t b = 1; b < 8; ++b) CHECK(marlin::s0e5m3_from_e4m3(b, 0) == 0);
  CHECK(marlin::s0e5m3_from_e4m3(0x04, 0) == 0);              // 2^-7*128 = 1 < 2
  CHECK(marlin::s0e5m3_from_e4m3(0x08, 0) == 0x80);           // 2^-6*128 = 2: kept, fp16 0x4000
  CHECK(marlin::s0e5m3_from_e4m3(0xB8, 3) == 0);              // -1.0
  CHECK(marlin::s0e5m3_from_e4m3(0x7F, 3) == 0);              // NaN
  CHECK(marlin::s0e5m3_from_e4m3(0x01, 17) == 0xF0);          // 2^-9 * 2^17 * 128 = 2^15 -> 0x7800 >> 7
}

TEST_CASE("layer scale factor: max-based power of two for bf16, 1 for fp16") {
  for (int b = 0; b < 256; ++b) {
    const auto byte = static_cast<std::uint8_t>(b);
    const std::vector<std::uint8_t> one{byte, 0};
    const int want = marlin::is_positive_e4m3(byte) ? literal_log2_sf(one, ActDtype::bf16) : 0;
    CHECK(marlin::scale_factor_log2(marlin::is_positive_e4m3(byte) ? byte : std::uint8_t{0}, ActDtype::bf16) == want);
    CHECK(marlin::scale_factor_log2(byte, ActDtype::fp16) == 0);
  }
  CHECK(marlin::scale_factor_log2(0x7E, ActDtype::bf16) == 0);   // 448
  CHECK(marlin::scale_factor_log2(0x38, ActDtype::bf16) == 8);   // 1.0 -> 256 <= 448 < 512
  CHECK(marlin::scale_factor_log2(0x01, ActDtype::bf16) == 17);  // 2^-9
  CHECK(marlin::scale_factor_log2(0, ActDtype::bf16) == 0);      // no positive scale
}

TEST_CASE("global scale transform g * 2^(B-7) / sf") {
  for (float g : {1.0f, 3.0e-3f, 1.0f / 2688.0f, 0.0f}) {
    for (int sf : {0, 4, 17}) {
      CHECK(marlin::global_scale(g, sf, ActDtype::fp16) == static_cast<float>(std::ldexp(static_cast<double>(g), 7 - sf)));
      CHECK(marlin::global_scale(g, sf, ActDtype::bf16) == static_cast<float>(std::ldexp(static_cast<double>(g), 119 - sf)));
    }
  }
}

TEST_CASE("layer repack equals the literal spec construction, byte for byte") {
  struct Case { std::int64_t k, n, e; ActDtype d; };
  for (const Case c : {Case{256, 128, 3, ActDtype::bf16}, Case{256, 96, 3, ActDtype::bf16}, Case{192, 64, 2, ActDtype::fp16},
                       Case{192, 48, 2, ActDtype::bf16}, Case{128, 32, 2, ActDtype::fp16}}) {
    CAPTURE(c.k);
    CAPTURE(c.n);
    const Nvfp4Marlin l{c.k, c.n, c.d};
    const HostLayer h = random_layer(l, c.e, static_cast<std::uint32_t>(c.k * 131 + c.n));
    MarlinBuffers got(l, c.e);
    auto rep = repack_layer_reference(l, h.view(), got.view());
    REQUIRE(rep.ok());
    CHECK(rep->params.w13_log2_sf == literal_log2_sf(h.s13, c.d));
    CHECK(rep->params.w2_log2_sf == literal_log2_sf(h.s2, c.d));
    if (c.d == ActDtype::bf16) CHECK(rep->params.w2_log2_sf > 0);  // the small w2 scales exercise sf > 1
    const MarlinBuffers want = literal_layer(l, h);
    CHECK(got.w13 == want.w13);
    CHECK(got.w2 == want.w2);
    CHECK(got.s13 == want.s13);
    CHECK(got.s2 == want.s2);
    CHECK(same_bits(got.g13, want.g13));
    CHECK(same_bits(got.g2, want.g2));

    // Padding holds zero codes and zero scales.
    const std::int64_t np = l.padded_intermediate();
    bool pad_zero = true;
    for (std::int64_t e = 0; e < c.e; ++e) {
      for (std::int64_t n = 0; n < 2 * np; ++n) {
        if (marlin::w13_checkpoint_row(n, c.n, np) >= 0) continue;
        for (std::int64_t k = 0; k < c.k; ++k) {
          const auto d = marlin::weight_dest(k, n, 2 * np);
          pad_zero &= ((got.w13[static_cast<std::size_t>(e * l.w13_words() + d.word)] >> (4 * d.nibble)) & 0xF) == 0;
        }
        for (std::int64_t g = 0; g < c.k / 16; ++g)
          pad_zero &= got.s13[static_cast<std::size_t>(e * l.w13_scale_bytes() + g * 2 * np + marlin::scale_dest_col(n))] == 0;
      }
      for (std::int64_t k = c.n; k < np; ++k)
        for (std::int64_t n = 0; n < c.k; ++n) {
          const auto d = marlin::weight_dest(k, n, c.k);
          pad_zero &= ((got.w2[static_cast<std::size_t>(e * l.w2_words() + d.word)] >> (4 * d.nibble)) & 0xF) == 0;
          pad_zero &= got.s2[static_cast<std::size_t>(e * l.w2_scale_bytes() + (k / 16) * c.k + marlin::scale_dest_col(n))] == 0;
        }
    }
    CHECK(pad_zero);
  }
}

TEST_CASE("round trip: dequant(Marlin) == e2m1 * e4m3 * g, exact except the documented flush") {
  struct Case { std::int64_t k, n, e; ActDtype d; };
  for (const Case c : {Case{256, 128, 3, ActDtype::bf16}, Case{256, 96, 2, ActDtype::fp16}, Case{192, 64, 2, ActDtype::bf16}}) {
    CAPTURE(c.k);
    CAPTURE(c.n);
    const Nvfp4Marlin l{c.k, c.n, c.d};
    const HostLayer h = random_layer(l, c.e, 7u + static_cast<std::uint32_t>(c.n));
    MarlinBuffers m(l, c.e);
    auto rep = repack_layer_reference(l, h.view(), m.view());
    REQUIRE(rep.ok());
    const auto w13_size = static_cast<std::size_t>(c.e * 2 * c.n * c.k), w2_size = static_cast<std::size_t>(c.e * c.k * c.n);
    std::vector<double> got13(w13_size), got2(w2_size), want13(w13_size), want2(w2_size), raw13(w13_size), raw2(w2_size);
    REQUIRE(dequant_marlin_reference(l, c.e, m.view().as_const(), got13, got2).ok());
    REQUIRE(dequant_checkpoint_reference(l, h.view(), want13, want2, &rep->params).ok());
    REQUIRE(dequant_checkpoint_reference(l, h.view(), raw13, raw2).ok());
    // Which scales flush is decided by the oracle (values and the max-based factor), not by the
    // encode under test; the library's own flush option must agree with it.
    CHECK(rep->params.w13_log2_sf == literal_log2_sf(h.s13, c.d));
    CHECK(rep->params.w2_log2_sf == literal_log2_sf(h.s2, c.d));
    std::vector<double> oracle13, oracle2;
    test_support::expected_marlin_dequant(l, h, oracle13, oracle2);
    CHECK(got13 == oracle13);
    CHECK(got2 == oracle2);
    CHECK(want13 == oracle13);
    CHECK(want2 == oracle2);
    CHECK(got13 == want13);
    CHECK(got2 == want2);
    // The flush is the only difference, and it only ever zeroes values.
    std::size_t flushed = 0;
    bool only_zeroed = true;
    for (std::size_t i = 0; i < w13_size; ++i)
      if (got13[i] != raw13[i]) { ++flushed; only_zeroed &= got13[i] == 0.0; }
    for (std::size_t i = 0; i < w2_size; ++i)
      if (got2[i] != raw2[i]) { ++flushed; only_zeroed &= got2[i] == 0.0; }
    CHECK(only_zeroed);
    if (c.d == ActDtype::fp16) CHECK(flushed > 0);  // sf = 1: subnormal scales are flushed
  }
}

TEST_CASE("w13_scale_2 halves that differ: column 0 is used and the mismatch is reported") {
  const Nvfp4Marlin l{128, 64, ActDtype::bf16};
  HostLayer h = random_layer(l, 4, 99);
  h.g13[2 * 1 + 1] = h.g13[2 * 1] * 2.0f;
  h.g13[2 * 3 + 1] = 0.5f;
  MarlinBuffers m(l, 4);
  std::vector<std::string> warnings;
  auto rep = repack_layer_reference(l, h.view(), m.view(), [&](std::string_view w) { warnings.emplace_back(w); });
  REQUIRE(rep.ok());
  CHECK(rep->w13_global_mismatches == 2);
  CHECK(rep->first_mismatch == 1);
  // The warning goes to the caller's sink (the library prints nothing itself).
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].find("for 2 expert(s) (first: 1)") != std::string::npos);
  MarlinBuffers quiet(l, 4);
  CHECK(repack_layer_reference(l, h.view(), quiet.view()).ok());  // no sink: silent
  for (std::size_t e = 0; e < 4; ++e)
    CHECK(m.g13[e] == marlin::global_scale(h.g13[2 * e], rep->params.w13_log2_sf, l.dtype));
}

TEST_CASE("bad inputs return an error and leave the outputs untouched") {
  const Nvfp4Marlin good{128, 64, ActDtype::bf16};
  const HostLayer h = random_layer(good, 2, 5);

  SUBCASE("bad shapes") {
    for (const Nvfp4Marlin bad : {Nvfp4Marlin{100, 64, ActDtype::bf16}, Nvfp4Marlin{96, 64, ActDtype::bf16},
                                  Nvfp4Marlin{128, 40, ActDtype::bf16}, Nvfp4Marlin{0, 64, ActDtype::bf16},
                                  Nvfp4Marlin{128, -16, ActDtype::bf16}}) {
      CHECK(bad.validate().code() == ErrorCode::invalid_argument);
    }
    CHECK(good.validate().ok());
  }

  auto expect_rejected = [&](const Nvfp4Marlin& l, const Nvfp4CheckpointLayer& src, std::int64_t dst_experts) {
    MarlinBuffers m(l.validate().ok() ? l : good, dst_experts);
    auto r = repack_layer_reference(l, src, m.view());
    CHECK_FALSE(r.ok());
    CHECK(r.status().code() == ErrorCode::invalid_argument);
    CHECK(m.untouched());
  };

  SUBCASE("K not a multiple of 64") { expect_rejected(Nvfp4Marlin{96, 64, ActDtype::bf16}, h.view(), 2); }
  SUBCASE("no experts") {
    auto v = h.view();
    v.num_experts = 0;
    expect_rejected(good, v, 2);
  }
  SUBCASE("mismatched checkpoint sizes") {
    auto v = h.view();
    v.w2_scale = v.w2_scale.first(v.w2_scale.size() - 1);
    expect_rejected(good, v, 2);
    v = h.view();
    v.w13_scale_2 = v.w13_scale_2.first(2);  // [E] instead of [E, 2]
    expect_rejected(good, v, 2);
  }
  SUBCASE("mismatched output sizes") { expect_rejected(good, h.view(), 3); }
  SUBCASE("negative block scale") {
    HostLayer b = h;
    b.s13[17] = 0xB8;  // -1.0
    expect_rejected(good, b.view(), 2);
  }
  SUBCASE("NaN block scale") {
    HostLayer b = h;
    b.s2[3] = 0x7F;
    expect_rejected(good, b.view(), 2);
  }
  SUBCASE("NaN, negative or infinite global scale") {
    for (float g : {std::nanf(""), -1.0f, INFINITY}) {
      HostLayer b = h;
      b.g2[1] = g;
      expect_rejected(good, b.view(), 2);
      b = h;
      b.g13[3] = g;
      expect_rejected(good, b.view(), 2);
    }
  }
  SUBCASE("-0 scales are zero scales, not errors") {
    HostLayer b = h;
    b.s13[0] = 0x80;
    MarlinBuffers m(good, 2);
    CHECK(repack_layer_reference(good, b.view(), m.view()).ok());
  }
}

}  // TEST_SUITE
