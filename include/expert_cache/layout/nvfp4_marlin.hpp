#pragma once
/// NVFP4 (ModelOpt checkpoint) -> Marlin MoE layout: sizes, padding, index maps and encodes.
//
// Everything here is constexpr and EXPERT_CACHE_HOST_DEVICE, so the host repack
// (repack/host_repack.hpp), the CUDA kernels (kernels/marlin_repack.cuh) and the tests run the
// same code. Pure host header: compiles with g++ alone. See docs/nvfp4_marlin.md.
//
// Notation: E experts, K = hidden, N = intermediate (per TP partition), Np = padded N.
// A Marlin GEMM operand has size_k (reduction) x size_n (output); q(k, n) is its 4-bit code.
//   w13 GEMM: size_k = K,  size_n = 2*Np  (gate shard rows [0,Np), up shard rows [Np,2Np))
//   w2  GEMM: size_k = Np, size_n = K
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/config.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/tensor_bytes.hpp"

namespace expert_cache::inline v0 {

// Activation dtype of the MoE GEMM; it selects the scale factor rule and the global-scale bias.
enum class ActDtype : std::uint8_t { fp16, bf16 };

[[nodiscard]] constexpr std::string_view to_string(ActDtype d) noexcept {
  return d == ActDtype::fp16 ? "fp16" : "bf16";
}

namespace marlin {

inline constexpr std::int64_t group_size = 16;  // NVFP4: one e4m3 scale per 16 K elements
inline constexpr std::int64_t tile_k = 16;      // Marlin weight tile: 16 (k) x 64 (n)
inline constexpr std::int64_t tile_n = 64;
inline constexpr std::int64_t words_per_tile = 128;  // 16*64 nibbles / 8 per int32

// ---------------------------------------------------------------------------------------------
// Padding (docs/nvfp4_marlin.md, Padding). K is never padded. Np = round_up(N, 64) when K % 128 == 0,
// else round_up(N, 128) (K % 64 == 0 is then required). This picks Marlin's thread-tile family
// (n%64 & k%128) or (n%128 & k%64) valid for both GEMMs.

EXPERT_CACHE_HOST_DEVICE constexpr std::int64_t round_up(std::int64_t x, std::int64_t m) noexcept {
  return (x + m - 1) / m * m;
}

EXPERT_CACHE_HOST_DEVICE constexpr std::int64_t padded_intermediate(std::int64_t hidden,
                                                                    std::int64_t intermediate) noexcept {
  return hidden % 128 == 0 ? round_up(intermediate, 64) : round_up(intermediate, 128);
}

// w13 is padded per shard: GEMM column n of [0, 2Np) -> checkpoint row of [0, 2N), or -1 in the
// zero padding at the end of each shard.
EXPERT_CACHE_HOST_DEVICE constexpr std::int64_t w13_checkpoint_row(std::int64_t n, std::int64_t intermediate,
                                                                   std::int64_t padded) noexcept {
  const std::int64_t shard = n / padded;
  const std::int64_t row = n % padded;
  return row < intermediate ? shard * intermediate + row : -1;
}

// ---------------------------------------------------------------------------------------------
// Weight permutation (docs/nvfp4_marlin.md, Maps). Output per expert: int32 [size_k/16][2*size_n]; row kt holds
// size_n/64 tiles of 128 words. Word 128*nt + 4*t + w (warp w, lane t) holds, at nibble i:
//   i:  0      1        2        3          4        5        6          7
//   k:  r      r+8      r        r+8        r+1      r+9      r+1        r+9     (+16*kt)
//   n:  c      c        c+8      c+8        c        c        c+8        c+8     (+64*nt)
// with r = 2*(t%4), c = 16*w + t/4.

struct CodeCoord {
  std::int64_t k = 0;
  std::int64_t n = 0;
  friend constexpr bool operator==(const CodeCoord&, const CodeCoord&) = default;
};

struct NibbleCoord {
  std::int64_t word = 0;  // index into one expert's int32 [size_k/16][2*size_n], row-major
  int nibble = 0;         // 0..7, bits 4*nibble .. 4*nibble+3
  friend constexpr bool operator==(const NibbleCoord&, const NibbleCoord&) = default;
};

// Forward map: which code (k, n) lands in nibble `nibble` of word `j` of output row `kt`.
EXPERT_CACHE_HOST_DEVICE constexpr CodeCoord weight_source(std::int64_t kt, std::int64_t j, int nibble) noexcept {
  const std::int64_t nt = j / words_per_tile;
  const std::int64_t in_tile = j % words_per_tile;
  const std::int64_t t = in_tile / 4;
  const std::int64_t w = in_tile % 4;
  const std::int64_t r = 2 * (t % 4);
  const std::int64_t c = 16 * w + t / 4;
  const std::int64_t dk = ((nibble & 4) ? 1 : 0) + ((nibble & 1) ? 8 : 0);
  const std::int64_t dn = (nibble & 2) ? 8 : 0;
  return {tile_k * kt + r + dk, tile_n * nt + c + dn};
}

// Inverse map, derived independently: where code (k, n) goes.
EXPERT_CACHE_HOST_DEVICE constexpr NibbleCoord weight_dest(std::int64_t k, std::int64_t n,
                                                           std::int64_t size_n) noexcept {
  const std::int64_t kt = k / tile_k, kr = k % tile_k;
  const std::int64_t nt = n / tile_n, nc = n % tile_n;
  const std::int64_t lo = kr % 8;              // r + (odd row of the pair)
  const std::int64_t t = 4 * (nc % 8) + lo / 2;
  const std::int64_t w = nc / 16;
  const int nibble = ((lo & 1) ? 4 : 0) + ((nc % 16 >= 8) ? 2 : 0) + ((kr >= 8) ? 1 : 0);
  return {kt * 2 * size_n + words_per_tile * nt + 4 * t + w, nibble};
}

// One output word, gathering its eight codes from `code_at(k, n)` (returns 0..15).
template <class CodeAt>
EXPERT_CACHE_HOST_DEVICE constexpr std::uint32_t weight_word(const CodeAt& code_at, std::int64_t kt,
                                                             std::int64_t j) noexcept {
  std::uint32_t word = 0;
  for (int i = 0; i < 8; ++i) {
    const CodeCoord src = weight_source(kt, j, i);
    word |= (static_cast<std::uint32_t>(code_at(src.k, src.n)) & 0xFu) << (4 * i);
  }
  return word;
}

// The same word from the four checkpoint bytes it draws on. Codes k and k+1 (k even) share a
// byte (low nibble first), so word (kt, t, w) needs only the bytes holding k = r and k = r + 8 in
// columns c and c + 8. `quad` packs them, low byte first: (r, c), (r + 8, c), (r, c + 8),
// (r + 8, c + 8); its nibbles n0..n7 are then the codes of nibbles 0, 4, 1, 5, 2, 6, 3, 7 of the
// word, so the word is the nibble unshuffle [n0 n2 n4 n6 n1 n3 n5 n7]: two delta swaps. The
// tiled kernel uses this form; tests compare it with weight_word.
EXPERT_CACHE_HOST_DEVICE constexpr std::uint32_t weight_word_from_quad(std::uint32_t quad) noexcept {
  std::uint32_t t = (quad ^ (quad >> 4)) & 0x00F000F0u;  // swap nibbles 1 <-> 2 and 5 <-> 6
  quad ^= t ^ (t << 4);
  t = (quad ^ (quad >> 8)) & 0x0000FF00u;  // swap nibble pairs (2, 3) <-> (4, 5)
  return quad ^ t ^ (t << 8);
}

EXPERT_CACHE_HOST_DEVICE constexpr std::uint32_t weight_word_from_bytes(std::uint32_t row_c_lo, std::uint32_t row_c_hi,
                                                                        std::uint32_t row_c8_lo,
                                                                        std::uint32_t row_c8_hi) noexcept {
  return weight_word_from_quad((row_c_lo & 0xFFu) | (row_c_hi & 0xFFu) << 8 | (row_c8_lo & 0xFFu) << 16 |
                               (row_c8_hi & 0xFFu) << 24);
}

// 4-bit code of element k of a checkpoint row packed two per byte along K (low nibble first).
EXPERT_CACHE_HOST_DEVICE constexpr std::uint32_t packed_code(const std::uint8_t* row, std::int64_t k) noexcept {
  return (static_cast<std::uint32_t>(row[k / 2]) >> (4 * (k % 2))) & 0xFu;
}

// q(k, n) of the w13 GEMM from one expert's checkpoint w13 [2N, K/2]; 0 in the shard padding.
struct W13Codes {
  const std::uint8_t* w = nullptr;
  std::int64_t hidden = 0, intermediate = 0, padded = 0;
  EXPERT_CACHE_HOST_DEVICE constexpr std::uint32_t operator()(std::int64_t k, std::int64_t n) const noexcept {
    const std::int64_t row = w13_checkpoint_row(n, intermediate, padded);
    return row < 0 ? 0u : packed_code(w + row * (hidden / 2), k);
  }
};

// q(k, n) of the w2 GEMM from one expert's checkpoint w2 [K, N/2]: k runs over the
// intermediate dim (0 in the padding k >= N), n over hidden.
struct W2Codes {
  const std::uint8_t* w = nullptr;
  std::int64_t hidden = 0, intermediate = 0;
  EXPERT_CACHE_HOST_DEVICE constexpr std::uint32_t operator()(std::int64_t k, std::int64_t n) const noexcept {
    return k >= intermediate ? 0u : packed_code(w + n * (intermediate / 2), k);
  }
};

// ---------------------------------------------------------------------------------------------
// Scale permutation (docs/nvfp4_marlin.md, Maps). Per expert the scales form S[g][n], g < size_k/16, n < size_n.
// Output column col takes S[g][scale_source_col(col)]: within each aligned group of 4 the middle
// two swap, then within each 64-block an 8x8 transpose (sigma(i) = 8*(i%8) + i/8).

EXPERT_CACHE_HOST_DEVICE constexpr std::int64_t swap_middle_of_4(std::int64_t col) noexcept {
  const std::int64_t low = col & 3;
  return (low == 1 || low == 2) ? (col ^ 3) : col;
}

EXPERT_CACHE_HOST_DEVICE constexpr std::int64_t transpose_8x8(std::int64_t i) noexcept {
  return 8 * (i % 8) + i / 8;  // an involution on [0, 64)
}

EXPERT_CACHE_HOST_DEVICE constexpr std::int64_t scale_source_col(std::int64_t col) noexcept {
  const std::int64_t j1 = swap_middle_of_4(col);
  const std::int64_t i = j1 % 64;
  return j1 - i + transpose_8x8(i);
}

// Inverse: the output column that scale column n lands in.
EXPERT_CACHE_HOST_DEVICE constexpr std::int64_t scale_dest_col(std::int64_t n) noexcept {
  const std::int64_t i = n % 64;
  return swap_middle_of_4(n - i + transpose_8x8(i));
}

// e4m3 scale byte S[g][n] of the w13 GEMM from checkpoint w13_scale [2N, K/16]; 0 in padding.
struct W13Scales {
  const std::uint8_t* s = nullptr;
  std::int64_t hidden = 0, intermediate = 0, padded = 0;
  EXPERT_CACHE_HOST_DEVICE constexpr std::uint8_t operator()(std::int64_t g, std::int64_t n) const noexcept {
    const std::int64_t row = w13_checkpoint_row(n, intermediate, padded);
    return row < 0 ? std::uint8_t{0} : s[row * (hidden / group_size) + g];
  }
};

// e4m3 scale byte S[g][n] of the w2 GEMM from checkpoint w2_scale [K, N/16]; 0 for g >= N/16.
struct W2Scales {
  const std::uint8_t* s = nullptr;
  std::int64_t hidden = 0, intermediate = 0;
  EXPERT_CACHE_HOST_DEVICE constexpr std::uint8_t operator()(std::int64_t g, std::int64_t n) const noexcept {
    const std::int64_t groups = intermediate / group_size;
    return g >= groups ? std::uint8_t{0} : s[n * groups + g];
  }
};

// ---------------------------------------------------------------------------------------------
// Value encodes (docs/nvfp4_marlin.md, Encodes).

// Exact power of two as float for |e| <= 149 (loop keeps it constexpr and device-safe).
EXPERT_CACHE_HOST_DEVICE constexpr float exp2i(int e) noexcept {
  float r = 1.0f;
  for (; e > 0; --e) r *= 2.0f;
  for (; e < 0; ++e) r *= 0.5f;
  return r;
}

// e4m3fn bytes the layer validation rejects: NaN (0x7F, 0xFF) and negative non-zero values.
// -0 (0x80) is accepted: it is a zero scale.
EXPERT_CACHE_HOST_DEVICE constexpr bool is_bad_e4m3_scale(std::uint8_t b) noexcept {
  return (b & 0x7F) == 0x7F || ((b & 0x80) && (b & 0x7F));
}

// Positive finite e4m3 values are exactly the bytes 0x01..0x7E, ordered like their values,
// so "max over positive scales" is a max over bytes.
EXPERT_CACHE_HOST_DEVICE constexpr bool is_positive_e4m3(std::uint8_t b) noexcept {
  return b >= 0x01 && b <= 0x7E;
}

// Value of a non-NaN e4m3fn byte (bias 7): normal (8+m)*2^(e-10), subnormal m*2^-9.
EXPERT_CACHE_HOST_DEVICE constexpr float e4m3_value(std::uint8_t b) noexcept {
  const int e = (b >> 3) & 0xF, m = b & 7;
  const float mag = e == 0 ? static_cast<float>(m) * exp2i(-9) : static_cast<float>(8 + m) * exp2i(e - 10);
  return (b & 0x80) ? -mag : mag;
}

// e2m1 code (sign bit 3): magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
EXPERT_CACHE_HOST_DEVICE constexpr float e2m1_value(std::uint32_t code) noexcept {
  constexpr float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return (code & 8u) ? -mag[code & 7u] : mag[code & 7u];
}

// Layer-wide scale factor sf = 2^log2_sf (docs/nvfp4_marlin.md, Encodes; vLLM PR #37502): fp16 -> 1; bf16 -> the
// largest power of two with max_positive * sf <= 448 (1 when there is no positive scale or max >= 448).
// `max_positive_byte` is the largest byte in [0x01, 0x7E] over the family, or 0 if none.
EXPERT_CACHE_HOST_DEVICE constexpr int scale_factor_log2(std::uint8_t max_positive_byte, ActDtype dtype) noexcept {
  if (dtype == ActDtype::fp16 || !is_positive_e4m3(max_positive_byte)) return 0;
  const float m = e4m3_value(max_positive_byte);
  int p = 0;
  while (m * exp2i(p + 1) <= 448.0f) ++p;  // exact: m times a power of two
  return p;
}

// S0E5M3 byte of an e4m3 scale (docs/nvfp4_marlin.md, Encodes): v = s * sf * 128; v < 2 (incl. zero, negative)
// or NaN -> 0; else bits [14:7] of fp16(v) = (fp16 biased exponent << 3) | top 3 mantissa bits.
// v is exact in fp16 (3-bit mantissa); v >= 2^16 (only with an sf the layer rule never picks)
// saturates to fp16 inf -> 0xF8.
EXPERT_CACHE_HOST_DEVICE constexpr std::uint8_t s0e5m3_from_e4m3(std::uint8_t b, int log2_sf) noexcept {
  if (!is_positive_e4m3(b)) return 0;  // zero, -0, negative, NaN
  const int e = (b >> 3) & 0xF;
  int m = b & 7;
  int x = 0;  // v = (8 + mant) / 8 * 2^x
  if (e != 0) {
    x = e + log2_sf;  // (8+m)*2^(e-10) * 2^(log2_sf+7)
  } else {
    int shift = 0;  // subnormal m*2^-9*2^(log2_sf+7) = m*2^(log2_sf-2): normalise m into [8,16)
    while (m < 8) {
      m <<= 1;
      ++shift;
    }
    x = log2_sf + 1 - shift;
    m -= 8;
  }
  if (x < 1) return 0;          // v < 2: flushed (the bf16 decode needs the MSB set)
  if (x + 15 >= 31) return 0xF8;  // fp16 overflow -> inf
  return static_cast<std::uint8_t>(((x + 15) << 3) | m);
}

// Value the kernel decodes from an S0E5M3 byte (fp16 bits byte << 7; equals the bf16 decode for
// bytes with the MSB set, and 0 for byte 0). Host tests and dequant use it; invalid exponent 31
// is never produced except for the 0xF8 overflow case above (decoded here as 2^16).
EXPERT_CACHE_HOST_DEVICE constexpr float s0e5m3_value(std::uint8_t b) noexcept {
  const int e16 = b >> 3, m3 = b & 7;
  return e16 == 0 ? static_cast<float>(m3) * exp2i(-17) : static_cast<float>(8 + m3) * exp2i(e16 - 18);
}

// Exponent bias B of the activation dtype: 2^(E_t-1) - 2 (fp16: 14, bf16: 126). The kernel's
// fp4 decode yields fp4 * 2^-B; the global scale carries the compensation.
EXPERT_CACHE_HOST_DEVICE constexpr int dtype_bias(ActDtype dtype) noexcept {
  return dtype == ActDtype::fp16 ? 14 : 126;
}

// Global-scale transform (docs/nvfp4_marlin.md, Encodes): g' = g * 2^(B-7) / sf, in fp32, evaluated in that order.
EXPERT_CACHE_HOST_DEVICE constexpr float global_scale(float g, int log2_sf, ActDtype dtype) noexcept {
  return g * exp2i(dtype_bias(dtype) - 7) / exp2i(log2_sf);
}

}  // namespace marlin

// ---------------------------------------------------------------------------------------------
// Shape of one MoE layer's experts in the NVFP4-Marlin layout, and of its checkpoint source.
// Targets vLLM's moe_wna16_marlin_gemm revision with fp32 global_scale [E] and S0E5M3 scales.

struct MarlinGemmShape {
  std::int64_t size_k = 0;
  std::int64_t size_n = 0;
  [[nodiscard]] constexpr std::int64_t rows() const noexcept { return size_k / marlin::tile_k; }
  [[nodiscard]] constexpr std::int64_t words_per_row() const noexcept { return 2 * size_n; }
  [[nodiscard]] constexpr std::int64_t words() const noexcept { return rows() * words_per_row(); }
  [[nodiscard]] constexpr std::int64_t scale_bytes() const noexcept {
    return size_k / marlin::group_size * size_n;
  }
  friend constexpr bool operator==(const MarlinGemmShape&, const MarlinGemmShape&) = default;
};

/// The NVFP4 Marlin layout of one MoE layer's experts: an `expert_layout` with vLLM's six NVFP4
/// MoE tensors in the form moe_wna16_marlin_gemm reads.
struct Nvfp4Marlin {
  static constexpr std::string_view name = "nvfp4_marlin";
  static constexpr std::string_view kernel_revision =
      "vllm moe_wna16_marlin: S0E5M3 scales (max-based sf, <2 flushed), fp32 global_scale[E]";

  std::int64_t hidden = 0;        // K
  std::int64_t intermediate = 0;  // N per TP partition, unpadded
  ActDtype dtype = ActDtype::bf16;

  /// @return ok, or invalid_argument when a size is outside [1, 2^20], hidden is not a multiple
  ///         of 64 or intermediate not a multiple of 16
  [[nodiscard]] Status validate() const {
    const auto shape = "nvfp4_marlin: K=" + std::to_string(hidden) + " N=" + std::to_string(intermediate);
    if (hidden <= 0 || intermediate <= 0 || hidden > (std::int64_t{1} << 20) ||
        intermediate > (std::int64_t{1} << 20)) {
      return Status(ErrorCode::invalid_argument, shape + ": sizes must be in [1, 2^20]");
    }
    if (hidden % 64 != 0) {
      return Status(ErrorCode::invalid_argument, shape + ": hidden size must be a multiple of 64");
    }
    if (intermediate % marlin::group_size != 0) {
      return Status(ErrorCode::invalid_argument,
                    shape + ": intermediate size must be a multiple of 16 (one e4m3 scale per 16)");
    }
    return {};
  }

  /// N padded to Marlin's column tile (docs/nvfp4_marlin.md, Padding).
  [[nodiscard]] constexpr std::int64_t padded_intermediate() const noexcept {
    return marlin::padded_intermediate(hidden, intermediate);
  }
  [[nodiscard]] constexpr MarlinGemmShape w13_gemm() const noexcept { return {hidden, 2 * padded_intermediate()}; }
  [[nodiscard]] constexpr MarlinGemmShape w2_gemm() const noexcept { return {padded_intermediate(), hidden}; }

  // Per-expert element counts of the Marlin tensors.
  [[nodiscard]] constexpr std::int64_t w13_words() const noexcept { return w13_gemm().words(); }
  [[nodiscard]] constexpr std::int64_t w2_words() const noexcept { return w2_gemm().words(); }
  [[nodiscard]] constexpr std::int64_t w13_scale_bytes() const noexcept { return w13_gemm().scale_bytes(); }
  [[nodiscard]] constexpr std::int64_t w2_scale_bytes() const noexcept { return w2_gemm().scale_bytes(); }

  // Per-expert element counts of the checkpoint (ModelOpt) tensors, unpadded.
  [[nodiscard]] constexpr std::int64_t ckpt_w13_bytes() const noexcept { return 2 * intermediate * hidden / 2; }
  [[nodiscard]] constexpr std::int64_t ckpt_w2_bytes() const noexcept { return hidden * intermediate / 2; }
  [[nodiscard]] constexpr std::int64_t ckpt_w13_scale_bytes() const noexcept {
    return 2 * intermediate * (hidden / marlin::group_size);
  }
  [[nodiscard]] constexpr std::int64_t ckpt_w2_scale_bytes() const noexcept {
    return hidden * (intermediate / marlin::group_size);
  }
  static constexpr std::int64_t ckpt_w13_scale_2_floats = 2;  // [E, 2]: w1, w3 (w3 ignored: w1's is used for both halves)
  static constexpr std::int64_t ckpt_w2_scale_2_floats = 1;

  /// The cache's tensor list: w13, w2, their block scales and their global scales (one float
  /// each), in ExpertTensor order.
  [[nodiscard]] constexpr ExpertTensorBytes tensors() const noexcept {
    return {{{expert_tensor_names[0], static_cast<std::size_t>(w13_words()) * 4},
             {expert_tensor_names[1], static_cast<std::size_t>(w2_words()) * 4},
             {expert_tensor_names[2], static_cast<std::size_t>(w13_scale_bytes())},
             {expert_tensor_names[3], static_cast<std::size_t>(w2_scale_bytes())},
             {expert_tensor_names[4], sizeof(float)},
             {expert_tensor_names[5], sizeof(float)}}};
  }
  /// Bytes of one expert over its six tensors.
  [[nodiscard]] constexpr std::size_t bytes_per_expert() const noexcept {
    return total_bytes_per_expert(tensors());
  }
};
static_assert(expert_layout<Nvfp4Marlin>);

}  // namespace expert_cache::inline v0
