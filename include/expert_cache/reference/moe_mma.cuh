#pragma once
/// The arithmetic both reference NVFP4 consumers share: exact e2m1 and S0E5M3 decoders, and the
/// bf16 tensor-core MMA over Marlin words (the weights times their block scales as the MMA's A,
/// each fp32 input split into three bf16 terms as its B).
//
// Why this is exact: reference/moe_consumer.cuh, "Arithmetic" at its top.
#if !defined(__CUDACC__)
#error "expert_cache/reference/moe_mma.cuh needs nvcc"
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "expert_cache/reference/moe_mma.cuh needs sm_80 or newer (bf16 tensor-core MMA)"
#endif

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

#include "expert_cache/base/config.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

namespace moe_detail {
// The float whose bits are `bits` (the decoders below build the bits with integer ops).
EXPERT_CACHE_HOST_DEVICE inline float float_from_bits(std::uint32_t bits) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}
}  // namespace moe_detail

// e2m1 code (sign bit 3) -> float, exact; integer ops and a select (no table).
EXPERT_CACHE_HOST_DEVICE inline float e2m1_decode(std::uint32_t code) noexcept {
  const std::uint32_t m = code & 7u;
  // m >= 2: exponent 126 + (m >> 1), mantissa bit m & 1 -> 1, 1.5, 2, 3, 4, 6; m = 1: 0.5.
  const std::uint32_t bits = (m >= 2u ? (m + 252u) << 22 : (m != 0u ? 0x3F000000u : 0u)) | ((code & 8u) << 28);
  return moe_detail::float_from_bits(bits);
}

// S0E5M3 scale byte -> float, exact (= marlin::s0e5m3_value): bytes >= 8 are fp16 bits << 7,
// i.e. float exponent e16 + 112 and the top three mantissa bits.
EXPERT_CACHE_HOST_DEVICE inline float s0e5m3_decode(std::uint32_t b) noexcept {
  if (b < 8u) return static_cast<float>(b) * 7.62939453125e-06f;  // b * 2^-17 (fp16 subnormal)
  const std::uint32_t bits = (b + 896u) << 20;
  return moe_detail::float_from_bits(bits);
}

namespace moe_detail {

inline constexpr int terms = 3;                                  // bf16 terms per fp32 input

// Inputs are scaled by 2^62 before the bf16 split and the weight values carry 2^-111 (below), so the
// MMA sums are sum(x * fp4 * s0e5m3) * 2^-49: normal floats for |x * fp4 * s0e5m3| > 2^-77.
inline constexpr float in_scale = 0x1p62f;
inline constexpr float out_scale = 0x1p49f;
inline constexpr std::uint32_t bf16x2_two_pow_127 = 0x7F007F00u;

// bf16x2 of the e2m1 nibbles I (low half) and I + 4 (high half) of a Marlin word, each as
// e2m1 * 2^-126: the three magnitude bits land in the two lowest exponent bits and the top
// mantissa bit (e = 0 codes are bf16 subnormals, just as e2m1's own subnormal), the sign in the
// sign. Nibbles I and I + 4 are the MMA's k = 2t and 2t + 1 (I = 0, 2) or 2t + 8 and 2t + 9
// (I = 1, 3) of column 16w + g (I = 0, 1) or 16w + g + 8 (I = 2, 3). The bf16 multiply by the
// scale (subnormal inputs are exact there, as in Marlin's own bf16 path) makes them normal.
template <int I>
EXPERT_CACHE_HOST_DEVICE constexpr std::uint32_t e2m1_pair_bf16(std::uint32_t word) noexcept {
  static_assert(I >= 0 && I < 4);
  std::uint32_t mag = 0;
  if constexpr (I < 2) {
    mag = word << (6 - 4 * I);
  } else {
    mag = word >> (4 * I - 6);
  }
  return (mag & 0x01C001C0u) | ((word << (12 - 4 * I)) & 0x80008000u);
}

// A lane's eight scale bytes of a K-row (bytes 8g..8g+7 of the tile's 64) hold the scales of its
// columns 16w + 8h + g at byte swap_middle_of_4(2w + h) (marlin::scale_dest_col). The two of word w
// as bf16x2 {h = 0, h = 1}, each s0e5m3 * 2^-112 exactly (bf16 bits = byte << 4, bytes < 8 as bf16
// subnormals, 0 as 0): w = 0, 1 take bytes {0, 2}, {1, 3} of `lo`; w = 2, 3 the same of `hi`.
EXPERT_CACHE_HOST_DEVICE constexpr std::uint32_t s0e5m3_pair_bf16(std::uint32_t lo, std::uint32_t hi, int w) noexcept {
  const std::uint32_t s = w < 2 ? lo : hi;
  return ((w & 1) != 0 ? s >> 4 : s << 4) & 0x0FF00FF0u;
}
EXPERT_CACHE_HOST_DEVICE constexpr int scale_byte(int w, int h) noexcept {
  const int j = 2 * w + h;
  return ((j & 3) == 1 || (j & 3) == 2) ? (j ^ 3) : j;
}

// Position of input element kk (0..15) of a K-row in the lane-ordered input fragment [t][4] (the
// MMA's B): lane t holds k = 2t, 2t + 1 (register b0b1) and 2t + 8, 2t + 9 (register b2b3).
EXPERT_CACHE_HOST_DEVICE constexpr int a_frag_index(int kk) noexcept {
  return ((kk & 7) >> 1) * 4 + (kk & 1) + ((kk & 8) >> 2);
}

__device__ __forceinline__ std::uint32_t bf16x2_mul(std::uint32_t a, std::uint32_t b) {
  std::uint32_t d;
#if __CUDA_ARCH__ >= 900
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#endif
  return d;
}

// c += W (x) X for one 16-column group: the weights are the MMA's A (16 columns x 16 k, row
// major) and the input's three bf16 terms its B (16 k x 8: terms in columns 0-2, the rest zero).
// A Marlin word is exactly one lane's A fragment: nibbles I and I + 4 are k = 2t, 2t + 1
// (I = 0, 2) or 2t + 8, 2t + 9 (I = 1, 3) of column 16w + g (I = 0, 1) or 16w + g + 8 (I = 2, 3),
// i.e. registers a0a1, a4a5, a2a3, a6a7. D: lane (g, t) holds terms 2t, 2t + 1 of columns g, g + 8.
// One MMA per word and no zero operands to materialise (the previous orientation, weights as B,
// needed two MMAs per word with rows 8-15 of A zero).
__device__ __forceinline__ void mma_bf16(float (&c)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                         std::uint32_t a3, uint2 b) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y));
}

// One K-row of a 64-column tile: the lane's 16-byte weight piece (words w = 0..3), its eight
// scale bytes and the row's input terms (B fragment); one MMA per 16-column group w.
__device__ __forceinline__ void mma_row(float (&acc)[4][4], uint2 x_terms, uint4 q, uint2 s) {
  const std::uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    // s0e5m3 * 2^-112 * 2^127: every byte's scale as a normal bf16, so scale * e2m1 * 2^-126 is.
    const std::uint32_t sc = bf16x2_mul(s0e5m3_pair_bf16(s.x, s.y, w), bf16x2_two_pow_127);
    const std::uint32_t s0 = __byte_perm(sc, 0u, 0x1010), s1 = __byte_perm(sc, 0u, 0x3232);
    const std::uint32_t v = words[w];
    mma_bf16(acc[w], bf16x2_mul(e2m1_pair_bf16<0>(v), s0), bf16x2_mul(e2m1_pair_bf16<2>(v), s1),
             bf16x2_mul(e2m1_pair_bf16<1>(v), s0), bf16x2_mul(e2m1_pair_bf16<3>(v), s1), x_terms);
  }
}

// v (already times in_scale) as three bf16 terms whose sum is v to about 24 bits: each
// difference is exact in fp32.
__device__ __forceinline__ void split_bf16(float v, unsigned short (&out)[terms]) {
#pragma unroll
  for (int i = 0; i < terms; ++i) {
    const __nv_bfloat16 b = __float2bfloat16_rn(v);
    out[i] = __bfloat16_as_ushort(b);
    v -= __bfloat162float(b);
  }
}

}  // namespace moe_detail

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
