#pragma once
/// Fixed-point CRF arithmetic (combined recency-frequency, LRFU), shared by the host policy `Crf`
/// (eviction/crf.hpp) and the device planner (planning/device_plan.hpp), so that both compute
/// bit-identical keys.
// Integers only: no exp2/log2, whose last bits differ between glibc and CUDA's libdevice, and no
// floating multiply-add that nvcc would contract into an FMA.
// A CRF is an unsigned Q32.32 number: 1.0 = 2^32. The decay per forward is d = 2^(-1/half_life)
// in Q32 (crf_decay_q32); d^age comes from square-and-multiply with truncation at every step,
// which is not exactly round(2^32 * 2^(-age/h)), but the same on both sides, which is what
// parity needs.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "expert_cache/base/config.hpp"

namespace expert_cache::inline v0 {

/// 1.0 in Q32.
inline constexpr std::uint64_t crf_one = std::uint64_t{1} << 32;
/// round(2^32 * 2^(-1/8)): half-life 8 forwards, Lrfu's default.
inline constexpr std::uint64_t crf_default_decay_q32 = 3938502376u;

/// 2^(-1/h) in Q32 for a half-life of h forwards (host only: the conversion is done once, and both
/// sides then use the same integer). 0 when h is not positive and finite; else in [1, 2^32 - 1].
[[nodiscard]] inline std::uint64_t crf_decay_for_half_life(double half_life) noexcept {
  if (!(half_life > 0.0) || !std::isfinite(half_life)) return 0;
  const double d = std::round(std::exp2(-1.0 / half_life) * static_cast<double>(crf_one));
  return std::clamp<std::uint64_t>(static_cast<std::uint64_t>(d), 1, crf_one - 1);
}

// (a * b) >> 32, with the full 128-bit product.
EXPERT_CACHE_HOST_DEVICE inline std::uint64_t crf_mul_q32(std::uint64_t a, std::uint64_t b) noexcept {
#if defined(__CUDA_ARCH__)
  const std::uint64_t hi = __umul64hi(a, b);
  const std::uint64_t lo = a * b;
#else
  __extension__ using U128 = unsigned __int128;  // GCC/Clang extension (-Wpedantic)
  const U128 p = static_cast<U128>(a) * b;
  const auto hi = static_cast<std::uint64_t>(p >> 64);
  const auto lo = static_cast<std::uint64_t>(p);
#endif
  return (hi << 32) | (lo >> 32);
}

// Square-and-multiply from `result`: multiplies it by base^(2^k) for each set bit k of `bits`, in
// ascending k, squaring `base` as it goes (truncated at every step); 0 once a product underflows.
EXPERT_CACHE_HOST_DEVICE inline std::uint64_t crf_square_multiply(std::uint64_t result, std::uint64_t base,
                                                                  std::uint32_t bits) noexcept {
  while (bits != 0 && result != 0) {
    if ((bits & 1u) != 0) result = crf_mul_q32(result, base);
    base = crf_mul_q32(base, base);
    bits >>= 1;
    if (base == 0 && bits != 0) return 0;
  }
  return result;
}

/// d^age in Q32 (d < 1.0 in Q32; 1.0 for age 0; 0 once the product underflows).
EXPERT_CACHE_HOST_DEVICE inline std::uint64_t crf_decay_pow(std::uint64_t d, std::uint32_t age) noexcept {
  return crf_square_multiply(crf_one, d, age);
}

/// CRF of an expert at `now` whose CRF was `crf` at its last request `last` (last <= now).
EXPERT_CACHE_HOST_DEVICE inline std::uint64_t crf_at(std::uint64_t crf, std::uint32_t last, std::uint32_t now,
                                                     std::uint64_t d) noexcept {
  return crf == 0 ? 0 : crf_mul_q32(crf, crf_decay_pow(d, now - last));
}

// d^age from a table of its first powers: table[a] = crf_decay_pow(d, a) for a < crf_pow_table_size.
// The result equals crf_decay_pow(d, age) bit for bit: square-and-multiply multiplies the result by
// d^(2^k) for each set bit k of age in ascending k, so the table entry of the low bits is the
// product of their factors, and the high bits continue the same product with the same squarings
// (d^(2^bits) = table[size / 2]^2, truncated as the loop truncates it). A planner looks up one
// word per resident instead of a chain of about log2(age) dependent 64-bit multiplies; ages of
// crf_pow_table_size forwards or more (a resident unused that long) take the loop for the high bits.
inline constexpr std::uint32_t crf_pow_table_bits = 8;
inline constexpr std::uint32_t crf_pow_table_size = 1u << crf_pow_table_bits;
inline constexpr std::uint32_t crf_pow_table_mask = crf_pow_table_size - 1u;

// The factors of age's bits at or above crf_pow_table_bits, applied to `low` = table[age & mask].
// `table` is read only when such bits exist.
EXPERT_CACHE_HOST_DEVICE inline std::uint64_t crf_pow_high_bits(const std::uint64_t* table, std::uint64_t low,
                                                                 std::uint32_t age) noexcept {
  const std::uint32_t high = age >> crf_pow_table_bits;
  if (high == 0 || low == 0) return low;
  const std::uint64_t half = table[crf_pow_table_size / 2];
  return crf_square_multiply(low, crf_mul_q32(half, half), high);
}

EXPERT_CACHE_HOST_DEVICE inline std::uint64_t crf_decay_pow_table(const std::uint64_t* table,
                                                                  std::uint32_t age) noexcept {
  return crf_pow_high_bits(table, table[age & crf_pow_table_mask], age);
}

// crf_at with the power from the table (the same value).
EXPERT_CACHE_HOST_DEVICE inline std::uint64_t crf_at_table(const std::uint64_t* table, std::uint64_t crf,
                                                           std::uint32_t last, std::uint32_t now) noexcept {
  return crf == 0 ? 0 : crf_mul_q32(crf, crf_decay_pow_table(table, now - last));
}

/// A bias that keeps an expert over every unbiased one (CRF < 2^40 always: d^age sums to < 1/(1-d)).
inline constexpr std::uint64_t crf_pin_bias = std::uint64_t{1} << 62;

// Saturating add: a victim key is CRF + prior bias; a pinning bias is near UINT64_MAX.
EXPERT_CACHE_HOST_DEVICE constexpr std::uint64_t crf_add_sat(std::uint64_t a, std::uint64_t b) noexcept {
  return a + b < a ? ~std::uint64_t{0} : a + b;
}

}  // namespace expert_cache::inline v0
