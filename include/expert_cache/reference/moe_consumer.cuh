#pragma once
// A reference NVFP4 MoE consumer for small decode batches (1-16 tokens), reading the experts the
// cache made resident: through the forward map (global id -> slot) and the slot buffers, in the
// NVFP4-Marlin layout of layout/nvfp4_marlin.hpp (weight words, S0E5M3 block scales, per-slot
// fp32 global scales g'). Per token m and routed expert e (pair p = m * top_k + j):
//   C1  = x[m] . W13[slot]              (K -> 2Np; gate shard [0, Np), up shard [Np, 2Np))
//   A   = silu(C1[:Np]) * C1[Np:]       (padding rows are zero in W13, so A is zero there)
//   C3  = A . W2[slot]                  (Np -> K)
//   out[m] = sum_j topk_weight[p] * C3
// Dequant follows the kernel decode contract (docs/nvfp4_marlin.md, Decode contract): value = fp4 * 2^-B * s0e5m3(scale) * g'
// with B the activation dtype's bias. Pairs whose expert is -1, out of range or absent from the
// map contribute 0.
//
// Arithmetic: fp32 inputs and fp32 accumulation, through bf16 tensor-core MMAs (m16n8k16) so
// the decode, not the FMA, is the per-weight cost. Each fp32 input is split exactly into three
// bf16 terms (columns 0-2 of the MMA's B; about 24 significant bits); each weight times its block
// scale is exact in bf16 (2 + 4 significant bits). The weights are the MMA's A: Marlin's word
// 128 nt + 4 lane + w, lane = 4g + t, holds k = 2t + {0, 1, 8, 9} of columns 64 nt + 16w + g and
// + 8, which is exactly one lane's A fragment of a 16-column x 16-k tile (see mma_bf16).
//
// Two kernels per run (both 256 threads):
//   moe_w13  grid (Np/64, K/256, pairs): the gate tile j and the up tile j over 16 K-rows. The
//            last block of (pair, j) (integer counter) sums the splits in split order, applies
//            SiLU-and-mul and stores A as its three bf16 terms, already in MMA fragment order.
//   moe_w2   grid (K/64, Np/512, pairs): one 64-column tile over 32 K-rows, scaled by
//            topk_weight * g2'. The last block of (token, tile) sums pairs and splits in order.
// Deterministic: no floating-point atomics; every sum has a fixed order, so a cached run and an
// all-resident run of the same weights give bit-identical outputs. The counters reset themselves.
//
// Programmatic dependent launch (sm_90): moe_w2 is launched as soon as every moe_w13 block has
// started, loads its weights, and only then waits for moe_w13's results; moe_w13 itself waits
// for the previous kernel before reading anything. Without the launch attribute (older device
// or driver, PTX for an older target) plain stream order applies and the waits are no-ops.
//
// Readiness (the device-planned cache's overlap, docs/design.md edge D4): run() given an
// enabled SlotReadiness (DeviceExpertCache::readiness()) launches the waiting instantiations
// (moe_w13<ready_wait>, moe_w2<ready_wait>). Then moe_w13 does not wait for the previous kernel
// (the overlapped fill) at its start: each block waits, one thread then the block barrier, for
// its pair's slot's ready word (acquire, bounded by a timeout) right before it loads the slot,
// and reads slots with coherent loads (ld.global.cg: the fill writes them while this kernel
// runs, which the non-coherent path does not allow). So the blocks of resident experts compute
// while the fill still copies the missing ones, and each missing expert is taken as soon as it
// landed. moe_w13 still waits for the fill grid before it COMPLETES (griddepcontrol.wait, in one block, at
// its end). moe_w2 waits per slot the same way before its early weight loads, and then, instead
// of waiting for all of moe_w13, per pair (edge D4b): the moe_w13 block that stores tile j of
// pair p's act adds one to the pair's count (release, publish_tile), and moe_w2 blocks of pair p
// acquire-wait for the full count (await_pair, bounded like the slot waits) before they read
// act. So moe_w2 of the resident experts runs while the fill still copies the missing ones. The
// last moe_w2 block of a token takes the counts back to 0 (retire_token), so a replayed graph
// and many layers sharing one consumer need no reset. moe_w2 too waits for its previous grid
// (moe_w13, which waited for the fill) at its END: every later kernel on the stream, and the
// core's records there, still come after the fill. Inputs: ids, x and topk_weights must have
// been written before the cache's prepare, and run() directly follows that prepare (true in a
// decode loop: the router and the layer's input precede it).
// Deadlock freedom: only the consumer's blocks spin. moe_w13 blocks wait only for fill blocks,
// which are all running before moe_w13 is scheduled (the fill triggers programmatic launch in
// every block, after its griddepcontrol.wait) and never wait themselves. moe_w2 is launched
// with programmatic serialization too and moe_w13 triggers at its start, so moe_w2 is scheduled
// only once every moe_w13 block is running or done: a spinning moe_w2 block can never keep a
// moe_w13 block it waits for from being scheduled. Without the launch attribute stream order
// applies and every wait is already satisfied.
// Without readiness (default): the stream-ordered kernels, with no wait; the pair counts are not touched.
// Block order (readiness only, MoePairOrder): blocks take the pairs in pair order (default), or in
// ascending (expert, pair) order, the order in which the overlapped fill copies the missing
// experts (the plan's fill list follows its ascending unique list), so that a grid larger than
// the device holds at once schedules its blocks roughly as their experts land instead of letting
// blocks that spin on a late expert hold SM slots. Measured on the H200 at batch 4 and 16 (the
// benchmark's --consumer-order), expert order was not faster, so it is opt-in. Every block
// derives the same permutation from the ids alone (pair_in_expert_order); which block computes a
// pair changes no sum's order.
//
// One pass (opt-in, MoeConsumer::run_one_pass; compute from host): the caller names the experts
// whose slots do not hold them yet (MoeHostSource: per-expert flags and the experts' mapped host
// copies). Their pairs' blocks load their share of the weights, scales and g' from host memory
// instead of the slot, compute as usual, and the expert's first pair stores those bytes into
// the slot: no separate fill, and the slot is complete once the consumer completed (edge D7).
// Separate kernel entry points (moe_w13_one_pass, moe_w2_one_pass); the stream-ordered kernels
// do not carry its code. Bit-identical to filling first (the same bytes, the same arithmetic
// and order).
//
// Limits: inputs and activations below 2^63 in magnitude (they are pre-scaled by 2^62); scale
// bytes 1-7 (never produced by the repack) go through bf16 subnormals in the MMA.
#if !defined(__CUDACC__)
#error "expert_cache/reference/moe_consumer.cuh needs nvcc"
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "expert_cache/reference/moe_consumer.cuh needs sm_80 or newer (bf16 tensor-core MMA)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "expert_cache/base/config.hpp"
#include "expert_cache/kernels/griddep.cuh"
#include "expert_cache/kernels/slot_ready.cuh"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/runtime/cuda_error.hpp"
#include "expert_cache/base/status.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

// Where the six tensors of a slot live and which slot holds an expert. Built from a cache's
// ForwardView (moe_weights_from_view) or from all-resident arrays (slot = expert, identity map).
struct MoeWeights {
  const unsigned char* base[num_expert_tensors] = {};
  unsigned long long stride[num_expert_tensors] = {};  // bytes from slot s to s + 1
  const std::int32_t* expert_map = nullptr;             // [num_experts]: slot or -1
  std::int32_t num_experts = 0;
};

// The one-pass mode's source of the missing experts (MoeConsumer::run_one_pass): the experts'
// host copies, expert-major per tensor as a cache's host storage lays them out (tensor t of
// expert e at base[t] + e * stride[t]), as DEVICE addresses (mapped pinned host memory:
// cudaHostGetDevicePointer of a cudaHostAlloc(Mapped) / cudaHostRegister(Mapped) buffer; device
// memory works too), and which experts this run reads from there: missing[e] != 0 (device
// memory, [num_experts], written before the consumer's first kernel starts). A missing expert
// must have its slot in the map (the slot a fill would have filled); that slot is written.
struct MoeHostSource {
  const unsigned char* base[num_expert_tensors] = {};
  unsigned long long stride[num_expert_tensors] = {};  // bytes from expert e to e + 1
  const std::int32_t* missing = nullptr;                // [num_experts]: non-zero = read from host, write the slot
};

template <class View>
MoeWeights moe_weights_from_view(const View& view, std::int32_t num_experts) noexcept {
  MoeWeights w;
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    w.base[t] = reinterpret_cast<const unsigned char*>(view.tensors[t].base);
    w.stride[t] = view.tensors[t].slot_stride;
  }
  w.expert_map = view.expert_map;
  w.num_experts = num_experts;
  return w;
}

// The one-pass source of a cache's host pools (a storage with tensors() and host_tensor(t, e),
// expert-major per tensor: tensor t of expert e at host_tensor(t, 0) + e * stride) and the
// missing flags of its view (DeviceCacheOptions::fill_by_consumer: ForwardView::missing). The
// pools' host pointers are their device addresses where the pinned pools are mapped with unified
// addressing (check_host_source says so, once, outside capture).
template <class Storage>
MoeHostSource moe_host_source_from(const Storage& storage, std::int32_t num_experts, const std::int32_t* missing) noexcept {
  MoeHostSource h;
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    const std::size_t bytes = storage.tensors()[t].bytes_per_expert;
    if (bytes == 0) continue;
    const auto* first = reinterpret_cast<const unsigned char*>(storage.host_tensor(t, 0));
    h.base[t] = first;
    h.stride[t] = num_experts > 1
                      ? static_cast<unsigned long long>(reinterpret_cast<const unsigned char*>(storage.host_tensor(t, 1)) - first)
                      : bytes;
  }
  h.missing = missing;
  return h;
}

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

// Which kernel instantiation: stream-ordered (no readiness), waiting on ready words and pair progress,
// or (tests only) one wait left out, to show that the wait is what orders the reads:
// ready_test_skip_wait drops the slot waits of both kernels (moe_w2 still waits for all of
// moe_w13 before it reads act); ready_test_skip_act_wait keeps moe_w13's slot waits but runs
// moe_w2 with no wait at all before its reads (neither slot words, nor pair progress, nor
// griddepcontrol.wait).
inline constexpr int ready_none = 0;
inline constexpr int ready_wait = 1;
inline constexpr int ready_test_skip_wait = 2;
inline constexpr int ready_test_skip_act_wait = 3;
EXPERT_CACHE_HOST_DEVICE constexpr bool w13_waits_for_slot(int mode) noexcept {
  return mode == ready_wait || mode == ready_test_skip_act_wait;
}
EXPERT_CACHE_HOST_DEVICE constexpr bool w2_waits_for_slot(int mode) noexcept { return mode == ready_wait; }

inline constexpr int warps = 8;
inline constexpr int threads = 32 * warps;
inline constexpr int rows_per_warp = 4;  // K-rows (of 16 k) per warp: 4 x 16-byte weight loads in flight per lane
inline constexpr int w13_row_groups = 4;  // warps per tile in moe_w13 (gate tile: warps 0-3, up tile: 4-7)
inline constexpr int w13_rows = w13_row_groups * rows_per_warp;  // K-rows per moe_w13 block
inline constexpr int w2_rows = warps * rows_per_warp;            // K-rows per moe_w2 block
inline constexpr int terms = 3;                                  // bf16 terms per fp32 input
inline constexpr int w13_blocks_per_sm = 5;  // 48 registers: moe_w13's 640 blocks (K = 2048, Np = 512, top 10) in one wave
static_assert(warps == 2 * w13_row_groups, "moe_w13: half the warps on the gate tile, half on the up tile");

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

using detail::griddep_launch_dependents;  // kernels/griddep.cuh
using detail::griddep_wait;

// Streamed once: skip L1. volatile keeps them ahead of griddep_wait (moe_w2 prefetches).
__device__ __forceinline__ uint4 load_stream16(const unsigned char* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 load_stream8(const unsigned char* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
// The readiness kernels' slot loads: coherent at L2 (the fill writes the slots during the kernel);
// the memory clobber keeps them after the barrier that follows the ready-word acquire.
__device__ __forceinline__ uint4 load_cg16(const unsigned char* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint2 load_cg8(const unsigned char* p) {
  uint2 v;
  asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
}
template <int Mode>
__device__ __forceinline__ uint4 load_slot16(const unsigned char* p) {
  if constexpr (Mode == ready_none) {
    return load_stream16(p);
  } else {
    return load_cg16(p);
  }
}
template <int Mode>
__device__ __forceinline__ uint2 load_slot8(const unsigned char* p) {
  if constexpr (Mode == ready_none) {
    return load_stream8(p);
  } else {
    return load_cg8(p);
  }
}
// The one-pass mode (MoeConsumer::run_one_pass): host_none is the stream-ordered kernels; host_one_pass
// reads missing experts from host memory and writes them into their slots; (tests only)
// host_test_skip_start_wait is host_one_pass without moe_w13's griddepcontrol.wait at its
// start, to show that this wait is what orders the slot writes after the previous kernel's
// reads (edge D7).
inline constexpr int host_none = 0;
inline constexpr int host_one_pass = 1;
inline constexpr int host_test_skip_start_wait = 2;

// Host (mapped) memory is read once per run: streamed, as the gather fill reads it (__ldcs).
// volatile keeps moe_w2's loads ahead of its griddep_wait, like load_stream16.
__device__ __forceinline__ uint4 load_host16(const unsigned char* p) {
  uint4 v;
  asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 load_host8(const unsigned char* p) {
  uint2 v;
  asm volatile("ld.global.cs.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ std::uint32_t load_host4(const unsigned char* p) {
  std::uint32_t v;
  asm volatile("ld.global.cs.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// Whether pair p is the first pair of the run (lowest index) whose id is expert e: that pair's
// blocks write the expert's slot, so that several pairs of one missing expert (batch > 1) do
// not write it twice. Every thread of the block must call it (block-uniform arguments).
__device__ __forceinline__ bool first_pair_of_expert(const std::int32_t* ids, int p, std::int32_t e) {
  int earlier = 0;
  for (int q = static_cast<int>(threadIdx.x); q < p; q += static_cast<int>(blockDim.x)) earlier |= ids[q] == e ? 1 : 0;
  return __syncthreads_or(earlier) == 0;
}

// The missing flag of pair p's expert (0 for an invalid id; always 0 without the one-pass mode).
// Called right after slot_of: volatile, so that the load is issued next to the map's (both need
// only ids[p]) rather than after the first use of the slot, one round trip later.
template <int Host>
__device__ __forceinline__ std::int32_t missing_flag(const MoeHostSource& host, std::int32_t num_experts,
                                                     const std::int32_t* ids, int p) {
  std::int32_t flag = 0;
  if constexpr (Host != host_none) {
    const std::int32_t e = ids[p];
    if (e >= 0 && e < num_experts)
      asm volatile("ld.global.u32 %0, [%1];" : "=r"(flag) : "l"(host.missing + e));
  }
  return flag;
}

// A pair's source in the one-pass mode: block-uniform. from_host: the pair's expert is missing
// (its bytes are read from `host`); writer: this pair's blocks also store them into the slot.
struct PairSource {
  std::int32_t expert = -1;
  bool from_host = false;
  bool writer = false;
};
template <int Host>
__device__ __forceinline__ PairSource pair_source(const std::int32_t* ids, int p, std::int32_t slot, std::int32_t flag) {
  PairSource src;
  if constexpr (Host != host_none) {
    if (slot >= 0 && flag != 0) {  // slot >= 0: ids[p] is a valid expert (slot_of)
      src.expert = ids[p];
      src.from_host = true;
    }
    if (src.from_host) src.writer = first_pair_of_expert(ids, p, src.expert);
  }
  return src;
}
__device__ __forceinline__ const unsigned char* host_row(const MoeHostSource& host, int tensor, std::int32_t expert) {
  return host.base[tensor] + static_cast<unsigned long long>(expert) * host.stride[tensor];
}
// The slot row the one-pass mode writes (MoeWeights holds read-only views of the slot buffers;
// run_one_pass documents that they must be writable).
__device__ __forceinline__ unsigned char* slot_row_rw(const MoeWeights& w, int tensor, std::int32_t slot) {
  return const_cast<unsigned char*>(w.base[tensor]) + static_cast<unsigned long long>(slot) * w.stride[tensor];
}

// Before a block reads `slot`: one thread waits for its ready word, the barrier orders the
// block's loads after that acquire. Uniform per block (the slot depends on blockIdx.z only).
// FirstPart: the block reads only W13's tensors (w13, w13_scale, w13_scale_2), which a fill
// given first_pass_regions copies first and publishes on ready_first (edge D4c).
template <bool Wait, bool FirstPart = false>
__device__ __forceinline__ void await_slot(const SlotReadiness& ready, std::int32_t slot) {
  if constexpr (Wait) {
    if (threadIdx.x == 0) (void)wait_slot_ready(ready, slot, FirstPart);
    __syncthreads();
  }
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

// Each column's three terms summed in fixed order ((0 + 1) + 2: lane t = 0 holds terms 0 and 1,
// lane t = 1 term 2), stored by lanes t = 0 into red[warp][col].
__device__ __forceinline__ void stash_acc(float (&red)[warps][64], const float (&acc)[4][4], int warp, int lane) {
#pragma unroll
  for (int w = 0; w < 4; ++w)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float term2 = __shfl_down_sync(0xFFFFFFFFu, acc[w][2 * h], 1);
      if ((lane & 3) == 0) red[warp][16 * w + 8 * h + (lane >> 2)] = (acc[w][2 * h] + acc[w][2 * h + 1]) + term2;
    }
}

// Column c of warps [w0, w0 + n), in warp order.
__device__ __forceinline__ float reduce_col(const float (&red)[warps][64], int w0, int n, int c) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += red[w0 + i][c];
  return s;
}

// Publishes this block's partials and counts it in; true in every thread of the block that
// arrives last (it then sees all partials through L2). The last block resets the counter, so
// the next run starts from 0 without a memset.
__device__ __forceinline__ bool arrive_last(unsigned* counter, unsigned expected) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1u) == expected - 1u;
    if (last) {
      *counter = 0u;
      __threadfence();
    }
  }
  __syncthreads();
  return last;
}

__device__ __forceinline__ std::int32_t slot_of(const MoeWeights& w, const std::int32_t* ids, int p) {
  const std::int32_t e = ids[p];
  if (e < 0 || e >= w.num_experts) return -1;
  return w.expert_map[e];
}

// Per-pair progress of moe_w13 for the readiness kernels' moe_w2 (edge D4b of docs/design.md):
// moe_w2 blocks of pair p read act as soon as all of pair p's tiles are stored, not after all of
// moe_w13 (which completes only after the fill grid). Unused by ready_none.
struct PairProgress {
  unsigned* tiles_done = nullptr;  // [pairs]: moe_w13 tiles of the pair whose act is stored
  unsigned* token_done = nullptr;  // [tokens]: moe_w2 (token, tile) reductions finished
  unsigned w13_tiles = 0;          // Np / 64: tiles_done of a pair once its act is complete
  int ordered_pairs = 0;           // > 0: blocks take this many pairs in expert order (pair_in_expert_order)
};

// Most pairs the expert order ranks (one 32-bit key per pair in shared memory: expert + 1 above
// the pair's 10 bits), and the experts it can tell apart.
inline constexpr int max_ordered_pairs = 1024;
inline constexpr long long max_ordered_experts = (1LL << 22) - 1;

// The pair that block index z takes in ascending (expert, pair) order, pairs with an absent or
// invalid id first (they exit at once). Every thread of the block calls it; the permutation is
// a pure function of the ids, so all blocks agree and each pair gets exactly one block per tile.
__device__ __forceinline__ int pair_in_expert_order(const std::int32_t* ids, int num_experts, int pairs, int z) {
  __shared__ unsigned keys[max_ordered_pairs];
  __shared__ int chosen;
  const int tid = static_cast<int>(threadIdx.x);
  for (int i = tid; i < pairs; i += threads) {
    const std::int32_t e = ids[i];
    const unsigned rank_of_expert = e >= 0 && e < num_experts ? static_cast<unsigned>(e) + 1u : 0u;
    keys[i] = (rank_of_expert << 10) | static_cast<unsigned>(i);
  }
  __syncthreads();
  for (int i = tid; i < pairs; i += threads) {
    const unsigned mine = keys[i];
    int below = 0;
#pragma unroll 8
    for (int j = 0; j < pairs; ++j) below += keys[j] < mine ? 1 : 0;
    if (below == z) chosen = i;  // keys are distinct: exactly one thread writes
  }
  __syncthreads();
  return chosen;
}

// The pair of this block: blockIdx.z, or its place in expert order (readiness kernels only).
template <int Mode>
__device__ __forceinline__ int pair_of_block(const std::int32_t* ids, int num_experts, const PairProgress& progress) {
  const int z = static_cast<int>(blockIdx.z);
  if constexpr (Mode != ready_none) {
    if (progress.ordered_pairs > 0) return pair_in_expert_order(ids, num_experts, progress.ordered_pairs, z);
  }
  return z;
}

// moe_w13, in the block that stored tile j of pair p's act (every thread of it): "pair p: one
// more tile done". Publication (PTX memory model): threads 0-63 stored the tile's act above;
// bar.sync orders those stores before thread 0's next operations (CTA-scope synchronisation,
// part of causality order); thread 0's fence + release RMW at device scope then releases them
// cumulatively. The tiles' RMWs on the word chain in observation order, so the acquire load in
// await_pair that reads the final count (w13_tiles) synchronises with every tile's release; its
// block barrier then orders all of that block's act loads after it. (The pattern of
// plan_fill_ready_kernel's ready words.)
__device__ __forceinline__ void publish_tile(unsigned* tiles_done) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    cuda::atomic_ref<unsigned, cuda::thread_scope_device>(*tiles_done).fetch_add(1u, cuda::memory_order_release);
  }
}

// moe_w2, before a block reads pair p's act (slot >= 0 only: absent pairs publish nothing and
// read nothing): one thread acquire-waits until the pair's count is w13_tiles, then the block
// barrier. Bounded like the slot waits (the readiness' timeout, plan_error_wait_timeout in its
// error word). Exactly w13_tiles: a count that overshoots is a bug and times out, flagged.
__device__ __forceinline__ void await_pair(const SlotReadiness& ready, const PairProgress& progress, int p) {
  if (threadIdx.x == 0) {
    cuda::atomic_ref<unsigned, cuda::thread_scope_device> done(progress.tiles_done[p]);
    const unsigned want = progress.w13_tiles;
    (void)bounded_spin([&] { return done.load(cuda::memory_order_acquire) == want; }, ready.timeout_ns, ready.error_word);
  }
  __syncthreads();
}

// moe_w2, thread 0 of the last block of (token m, tile nt): counts the token's tiles; the last
// one takes w13_tiles back off each of the token's present pairs, so every count is 0 again for
// the next run (no memset, in a replayed graph too, for any number of layers sharing the
// consumer). Why no wait can see it: each moe_w2 block of token m passed its await_pair (program
// order, then its barrier) before it arrived at its (m, nt) counter, and the arrivals (fence +
// RMW) and this acq_rel RMW chain, so every wait of token m happened before the reset and has
// already read the full count (coherence). No later moe_w13 can add to the counts before it:
// the next run's moe_w13 starts only after the next plan kernel, launched in plain stream
// order, i.e. after this grid completed. An atomic subtraction, not a store of 0: if a wait
// timed out or was skipped (ready_test_skip_act_wait), tiles of this run may still arrive after
// the reset; moe_w13 completes before this grid does (griddepcontrol.wait at its end), so the
// count is exactly 0 again before any next run.
__device__ __forceinline__ void retire_token(const MoeWeights& w, const std::int32_t* ids, const PairProgress& progress,
                                             int m, int top_k, unsigned tiles) {
  if (threadIdx.x != 0) return;
  cuda::atomic_ref<unsigned, cuda::thread_scope_device> done(progress.token_done[m]);
  if (done.fetch_add(1u, cuda::memory_order_acq_rel) != tiles - 1u) return;
  done.store(0u, cuda::memory_order_relaxed);  // every tile of the token counted: ready for the next run
  for (int j = 0; j < top_k; ++j) {
    const int p = m * top_k + j;
    // The same slot look-up as moe_w13's (ids and the map do not change during the run): a pair
    // moe_w13 skipped has a count of 0 and is left alone.
    if (slot_of(w, ids, p) >= 0)
      cuda::atomic_ref<unsigned, cuda::thread_scope_device>(progress.tiles_done[p]).fetch_sub(progress.w13_tiles, cuda::memory_order_relaxed);
  }
}

template <int Mode = ready_none>
__device__ __forceinline__ float global_of(const MoeWeights& w, int tensor, std::int32_t slot) {
  float g;
  const unsigned char* p = w.base[tensor] + static_cast<unsigned long long>(slot) * w.stride[tensor];
  if constexpr (Mode == ready_none) {
    memcpy(&g, p, sizeof g);
  } else {
    std::uint32_t bits;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(bits) : "l"(p) : "memory");
    g = __uint_as_float(bits);
  }
  return g;
}

// C1 partials of the gate tile j and the up tile j over K-rows [16 split, 16 split + 16), then, in
// the last block of (pair, j), A = silu(gate) * up for k in [64 j, 64 j + 64) as bf16 terms in
// fragment order: act[pair][kt][term][a_frag_index(kk)]. Grid (Np / 64, splits, pairs).
// A template (Mode: ready_none / ready_wait / ready_test_skip_wait) so that every translation
// unit may define it; moe_w13<> is the stream-ordered kernel.
// Host != host_none (the one-pass mode, with Mode == ready_none): a pair whose expert is missing
// loads its weights, scales and g' from `host` instead of the slot, computes with them exactly as
// with the slot's bytes, and, in the expert's writer pair, stores what it loaded into the slot at
// the same offsets. The blocks of a pair together load every byte of W13, w13_scale (each block
// its 16 K-rows of its gate and up tiles) once; g1' is loaded by every block (threads 0-63, for
// the last block's use) and stored by block (0, 0).
template <int Mode, int Host = host_none>
__device__ __forceinline__ void moe_w13_body(const MoeWeights& w, const std::int32_t* ids, const float* x, int hidden,
                                             int top_k, int rows, int padded, float gscale, float* partial,
                                             unsigned* counters, unsigned short* act, const SlotReadiness& ready,
                                             const PairProgress& progress, const MoeHostSource& host = {}) {
  if constexpr (Mode == ready_none && Host != host_test_skip_start_wait) {
    // ids, x and the slot buffers may come from the previous kernel. One-pass: also every
    // earlier kernel's reads of a slot this run writes are over (edge D7).
    griddep_wait();
  }
  // ready_none: only after the wait (moe_w2 reads slot buffers before its own); with
  // readiness moe_w2 waits for each slot's ready word itself.
  griddep_launch_dependents();
  const int j = static_cast<int>(blockIdx.x), tiles = static_cast<int>(gridDim.x);
  const int split = static_cast<int>(blockIdx.y), splits = static_cast<int>(gridDim.y);
  const int p = pair_of_block<Mode>(ids, w.num_experts, progress);
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int kt0 = split * w13_rows;
  const int m = p / top_k;
  // This block's slice of x (16 w13_rows elements), loaded before the slot look-up.
  constexpr int x_per_thread = (16 * w13_rows + threads - 1) / threads;
  float xv[x_per_thread];
#pragma unroll
  for (int i = 0; i < x_per_thread; ++i) {
    const int idx = tid + i * threads;
    xv[i] = idx < 16 * w13_rows && kt0 + idx / 16 < rows ? x[static_cast<long long>(m) * hidden + 16LL * kt0 + idx] : 0.0f;
  }
  const std::int32_t slot = slot_of(w, ids, p);
  const std::int32_t flag = missing_flag<Host>(host, w.num_experts, ids, p);
  if (slot < 0) return;  // never read: moe_w2 skips absent pairs
  await_slot<w13_waits_for_slot(Mode), true>(ready, slot);
  const PairSource src = pair_source<Host>(ids, p, slot, flag);

  const long long size_n = 2LL * padded;
  const int sel = warp / w13_row_groups, rg = warp % w13_row_groups;
  const long long nt = static_cast<long long>(sel) * tiles + j;
  const unsigned char* wp = w.base[0] + static_cast<unsigned long long>(slot) * w.stride[0] + nt * 512 + lane * 16;
  const unsigned char* sp = w.base[2] + static_cast<unsigned long long>(slot) * w.stride[2] + nt * 64 + 8 * g;
  uint4 q[rows_per_warp];
  uint2 s[rows_per_warp];
  std::uint32_t g1_host = 0;  // the missing expert's g1' bits (threads 0-63: the last block's reduction threads)
  if (!src.from_host) {
#pragma unroll
    for (int i = 0; i < rows_per_warp; ++i) {
      const int kt = kt0 + rg * rows_per_warp + i;
      q[i] = make_uint4(0u, 0u, 0u, 0u);
      s[i] = make_uint2(0u, 0u);
      if (kt < rows) {
        q[i] = load_slot16<Mode>(wp + kt * 8 * size_n);
        s[i] = load_slot8<Mode>(sp + kt * size_n);
      }
    }
  } else if constexpr (Host != host_none) {
    const unsigned char* hwp = host_row(host, 0, src.expert) + nt * 512 + lane * 16;
    const unsigned char* hsp = host_row(host, 2, src.expert) + nt * 64 + 8 * g;
#pragma unroll
    for (int i = 0; i < rows_per_warp; ++i) {
      const int kt = kt0 + rg * rows_per_warp + i;
      q[i] = make_uint4(0u, 0u, 0u, 0u);
      s[i] = make_uint2(0u, 0u);
      if (kt < rows) {
        q[i] = load_host16(hwp + kt * 8 * size_n);
        s[i] = load_host8(hsp + kt * size_n);
      }
    }
    if (tid < 64) g1_host = load_host4(host_row(host, 4, src.expert));
  }

  __shared__ __align__(16) unsigned short a_s[w13_rows][terms][16];
  __shared__ float red[warps][64];
#pragma unroll
  for (int i = 0; i < x_per_thread; ++i) {
    const int idx = tid + i * threads;
    if (idx < 16 * w13_rows) {
      unsigned short b[terms];
      split_bf16(xv[i] * in_scale, b);
#pragma unroll
      for (int r = 0; r < terms; ++r) a_s[idx / 16][r][a_frag_index(idx % 16)] = b[r];
    }
  }
  __syncthreads();

  if constexpr (Host != host_none) {
    if (src.writer) {  // the bytes loaded from host, into the slot at the same offsets
      // (here, where q and s are live anyway: after the MMAs they would be held for the stores)
      unsigned char* dwp = slot_row_rw(w, 0, slot) + nt * 512 + lane * 16;
      unsigned char* dsp = slot_row_rw(w, 2, slot) + nt * 64 + 8 * g;
#pragma unroll
      for (int i = 0; i < rows_per_warp; ++i) {
        const int kt = kt0 + rg * rows_per_warp + i;
        if (kt < rows) {
          *reinterpret_cast<uint4*>(dwp + kt * 8 * size_n) = q[i];
          if (t == 0) *reinterpret_cast<uint2*>(dsp + kt * size_n) = s[i];  // lanes t = 1-3 loaded the same 8 bytes
        }
      }
      if (j == 0 && split == 0 && tid == 0) *reinterpret_cast<std::uint32_t*>(slot_row_rw(w, 4, slot)) = g1_host;
    }
  }
  float acc[4][4] = {};
#pragma unroll
  for (int i = 0; i < rows_per_warp; ++i) {
    const int ktl = rg * rows_per_warp + i;
    const uint2 a = g < terms ? *reinterpret_cast<const uint2*>(&a_s[ktl][g][4 * t]) : make_uint2(0u, 0u);
    mma_row(acc, a, q[i], s[i]);
  }
  stash_acc(red, acc, warp, lane);
  __syncthreads();
  float* part = partial + static_cast<long long>(p) * splits * size_n + 64LL * j;
  if (tid < 128) {
    const int sel_c = tid >> 6, c = tid & 63;
    part[split * size_n + sel_c * padded + c] = reduce_col(red, sel_c * w13_row_groups, w13_row_groups, c);
  }
  if (!arrive_last(&counters[static_cast<long long>(p) * tiles + j], static_cast<unsigned>(splits))) return;

  if (tid < 64) {
    float g1 = 0.0f;
    if constexpr (Host != host_none) {
      g1 = src.from_host ? __uint_as_float(g1_host) : global_of<Mode>(w, 4, slot);
    } else {
      g1 = global_of<Mode>(w, 4, slot);
    }
    const float gs = g1 * gscale;
    float gate = 0.0f, up = 0.0f;
#pragma unroll 8
    for (int i = 0; i < splits; ++i) {
      gate += __ldcg(part + i * size_n + tid);
      up += __ldcg(part + i * size_n + padded + tid);
    }
    gate *= gs;
    up *= gs;
    const float a = gate / (1.0f + expf(-gate)) * up;
    unsigned short b[terms];
    split_bf16(a * in_scale, b);
    const int k = 64 * j + tid;
    unsigned short* dst = act + (static_cast<long long>(p) * (padded / 16) + k / 16) * (terms * 16) + a_frag_index(k % 16);
#pragma unroll
    for (int r = 0; r < terms; ++r) dst[16 * r] = b[r];
  }
  if constexpr (Mode != ready_none) publish_tile(progress.tiles_done + p);  // edge D4b: moe_w2 of pair p may read it
}

template <int Mode = ready_none>
EXPERT_CACHE_KERNEL void __launch_bounds__(threads, w13_blocks_per_sm)
    moe_w13(MoeWeights w, const std::int32_t* ids, const float* x, int hidden, int top_k, int rows, int padded,
            float gscale, float* partial, unsigned* counters, unsigned short* act, SlotReadiness ready,
            PairProgress progress) {
  moe_w13_body<Mode>(w, ids, x, hidden, top_k, rows, padded, gscale, partial, counters, act, ready, progress);
  // With readiness: complete only after the previous kernel (the overlapped fill), so that
  // moe_w2's wait and every later kernel on the stream come after the fill grid (edge D4).
  // One block's wait is enough (a grid completes when its last block exits); the others exit
  // when their work is done, so they free their SM slots for the blocks not yet resident and
  // for moe_w2 instead of holding them until the last byte of the fill landed.
  if constexpr (Mode != ready_none) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) griddep_wait();
  }
}

// C3 of the 64-column tile nt over K-rows [32 split, 32 split + 32) times topk_weight * g2'
// (0 for absent pairs), then, in the last block of (token, nt), out = the sum over the token's
// pairs and splits in order. Grid (K / 64, splits, pairs). A template for the same reason.
// Host != host_none (one-pass): as in moe_w13, a missing expert's W2, w2_scale and g2' come from
// `host`, and its writer pair stores them into the slot (g2' by block (0, 0)). The loads are
// issued before the wait for moe_w13, like the slot loads; the stores right before the MMAs.
template <int Mode, int Host = host_none>
__device__ __forceinline__ void moe_w2_body(const MoeWeights& w, const std::int32_t* ids, const float* topk_weights,
                                            int hidden, int top_k, int rows, float gscale, const unsigned short* act,
                                            float* partial, unsigned* counters, float* out, const SlotReadiness& ready,
                                            const PairProgress& progress, const MoeHostSource& host = {}) {
  const int nt = static_cast<int>(blockIdx.x), tiles = static_cast<int>(gridDim.x);
  const int split = static_cast<int>(blockIdx.y), splits = static_cast<int>(gridDim.y);
  const int p = pair_of_block<Mode>(ids, w.num_experts, progress);
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int kt0 = split * w2_rows + warp * rows_per_warp;

  // Before the wait, only what no kernel since moe_w13's own wait can write: ids, the map and
  // the slot buffers. This is the overlap with moe_w13: these weights are loaded while it runs.
  const std::int32_t slot = slot_of(w, ids, p);
  const std::int32_t flag = missing_flag<Host>(host, w.num_experts, ids, p);
  uint4 q[rows_per_warp];
  uint2 s[rows_per_warp];
  float g2 = 0.0f;
  if (slot >= 0) await_slot<w2_waits_for_slot(Mode)>(ready, slot);
  const PairSource src = pair_source<Host>(ids, p, slot, flag);
  std::uint32_t g2_host = 0;  // the missing expert's g2' bits
  if (slot >= 0 && !src.from_host) {
    const unsigned char* wp = w.base[1] + static_cast<unsigned long long>(slot) * w.stride[1] + nt * 512LL + lane * 16;
    const unsigned char* sp = w.base[3] + static_cast<unsigned long long>(slot) * w.stride[3] + nt * 64LL + 8 * g;
#pragma unroll
    for (int i = 0; i < rows_per_warp; ++i) {
      const int kt = kt0 + i;
      q[i] = make_uint4(0u, 0u, 0u, 0u);
      s[i] = make_uint2(0u, 0u);
      if (kt < rows) {
        q[i] = load_slot16<Mode>(wp + static_cast<long long>(kt) * 8 * hidden);
        s[i] = load_slot8<Mode>(sp + static_cast<long long>(kt) * hidden);
      }
    }
    g2 = global_of<Mode>(w, 5, slot) * gscale;
  } else if constexpr (Host != host_none) {
    if (src.from_host) {
      const unsigned char* hwp = host_row(host, 1, src.expert) + nt * 512LL + lane * 16;
      const unsigned char* hsp = host_row(host, 3, src.expert) + nt * 64LL + 8 * g;
#pragma unroll
      for (int i = 0; i < rows_per_warp; ++i) {
        const int kt = kt0 + i;
        q[i] = make_uint4(0u, 0u, 0u, 0u);
        s[i] = make_uint2(0u, 0u);
        if (kt < rows) {
          q[i] = load_host16(hwp + static_cast<long long>(kt) * 8 * hidden);
          s[i] = load_host8(hsp + static_cast<long long>(kt) * hidden);
        }
      }
      g2_host = load_host4(host_row(host, 5, src.expert));
      g2 = __uint_as_float(g2_host) * gscale;
    }
  }
  griddep_launch_dependents();
  if constexpr (Mode == ready_none || Mode == ready_test_skip_wait) {
    // After the wait: act (moe_w13), topk_weights (the previous kernel) and the partials and
    // counters (still used by the previous run's moe_w2 until moe_w13 waited for it).
    griddep_wait();
  } else if constexpr (Mode == ready_wait) {
    // Readiness (edge D4b): only this pair's act is waited for (publish_tile / await_pair), not
    // all of moe_w13, which completes only after the fill. The other inputs need no wait here:
    // topk_weights, like moe_w13's ids and x, were written before the cache's prepare, and the
    // previous run's moe_w2 (the partials', counters' and act's last user) completed before this
    // run's plan kernel started (plain stream order), hence before moe_w13 and this grid.
    if (slot >= 0) await_pair(ready, progress, p);
  }
  // ready_test_skip_act_wait: no wait at all; act may still be the previous run's.

  __shared__ float red[warps][64];
  float* part = partial + (static_cast<long long>(p) * splits + split) * hidden + 64LL * nt;
  if (slot >= 0) {
    const float coef = topk_weights[p];
    uint2 a[rows_per_warp];
#pragma unroll
    for (int i = 0; i < rows_per_warp; ++i) {
      const int kt = kt0 + i;
      a[i] = make_uint2(0u, 0u);
      if (g < terms && kt < rows)
        a[i] = __ldcg(reinterpret_cast<const uint2*>(act + (static_cast<long long>(p) * rows + kt) * (terms * 16) + 16 * g) + t);
    }
    if constexpr (Host != host_none) {
      if (src.writer) {  // the bytes loaded from host, into the slot at the same offsets
        unsigned char* dwp = slot_row_rw(w, 1, slot) + nt * 512LL + lane * 16;
        unsigned char* dsp = slot_row_rw(w, 3, slot) + nt * 64LL + 8 * g;
#pragma unroll
        for (int i = 0; i < rows_per_warp; ++i) {
          const int kt = kt0 + i;
          if (kt < rows) {
            *reinterpret_cast<uint4*>(dwp + static_cast<long long>(kt) * 8 * hidden) = q[i];
            if (t == 0) *reinterpret_cast<uint2*>(dsp + static_cast<long long>(kt) * hidden) = s[i];
          }
        }
        if (nt == 0 && split == 0 && tid == 0) *reinterpret_cast<std::uint32_t*>(slot_row_rw(w, 5, slot)) = g2_host;
      }
    }
    float acc[4][4] = {};
#pragma unroll
    for (int i = 0; i < rows_per_warp; ++i) mma_row(acc, a[i], q[i], s[i]);
    stash_acc(red, acc, warp, lane);
    __syncthreads();
    if (tid < 64) part[tid] = coef * (reduce_col(red, 0, warps, tid) * g2);
  } else if (tid < 64) {
    part[tid] = 0.0f;
  }
  const int m = p / top_k;
  const unsigned arrivals = static_cast<unsigned>(top_k) * static_cast<unsigned>(splits);
  if (!arrive_last(&counters[static_cast<long long>(m) * tiles + nt], arrivals)) return;

  if (tid < 64) {
    const float* src = partial + static_cast<long long>(m) * arrivals * hidden + 64LL * nt + tid;
    float sum = 0.0f;
#pragma unroll 8
    for (unsigned i = 0; i < arrivals; ++i) sum += __ldcg(src + static_cast<long long>(i) * hidden);
    out[static_cast<long long>(m) * hidden + 64LL * nt + tid] = sum;
  }
  if constexpr (Mode != ready_none) retire_token(w, ids, progress, m, top_k, static_cast<unsigned>(tiles));
}

template <int Mode = ready_none>
EXPERT_CACHE_KERNEL void __launch_bounds__(threads) moe_w2(MoeWeights w, const std::int32_t* ids, const float* topk_weights,
                                                  int hidden, int top_k, int rows, float gscale,
                                                  const unsigned short* act, float* partial, unsigned* counters,
                                                  float* out, SlotReadiness ready, PairProgress progress) {
  moe_w2_body<Mode>(w, ids, topk_weights, hidden, top_k, rows, gscale, act, partial, counters, out, ready, progress);
  // Readiness: complete only after moe_w13 (hence after the fill), as before the per-pair wait,
  // so that every later kernel on the stream still comes after both. One block's wait is
  // enough, as in moe_w13.
  if constexpr (Mode == ready_wait || Mode == ready_test_skip_act_wait) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) griddep_wait();
  }
}

// The one-pass kernels (MoeConsumer::run_one_pass; Host = host_one_pass or
// host_test_skip_start_wait): their own entry points, so that the stream-ordered kernels keep their
// parameters. Stream-ordered like moe_w13<> / moe_w2<> (no readiness).
template <int Host>
EXPERT_CACHE_KERNEL void __launch_bounds__(threads, w13_blocks_per_sm)
    moe_w13_one_pass(MoeWeights w, MoeHostSource host, const std::int32_t* ids, const float* x, int hidden, int top_k,
                     int rows, int padded, float gscale, float* partial, unsigned* counters, unsigned short* act) {
  moe_w13_body<ready_none, Host>(w, ids, x, hidden, top_k, rows, padded, gscale, partial, counters, act, SlotReadiness{},
                                 PairProgress{}, host);
}
template <int Host>
EXPERT_CACHE_KERNEL void __launch_bounds__(threads)
    moe_w2_one_pass(MoeWeights w, MoeHostSource host, const std::int32_t* ids, const float* topk_weights, int hidden,
                    int top_k, int rows, float gscale, const unsigned short* act, float* partial, unsigned* counters,
                    float* out) {
  moe_w2_body<ready_none, Host>(w, ids, topk_weights, hidden, top_k, rows, gscale, act, partial, counters, out,
                                SlotReadiness{}, PairProgress{}, host);
}

// Bytes per load (and store) of tensor t in the kernels: the alignment its base and strides need.
// (Nvfp4Marlin has exactly the six default tensors.)
inline constexpr unsigned long long tensor_access_bytes[num_default_expert_tensors] = {16, 16, 8, 8, 4, 4};

}  // namespace moe_detail

// The order in which the readiness kernels' blocks take the pairs (top of this file): pairs
// (default), or experts (at most moe_detail::max_ordered_pairs pairs and fewer than
// moe_detail::max_ordered_experts experts; else pair order). Without readiness the blocks
// always take pair order.
enum class MoePairOrder : std::uint8_t { pairs, experts };

// Owns the workspace for up to `max_tokens` tokens of `top_k` experts; run() enqueues two
// kernels on `stream`. Inputs and outputs are device pointers: ids and weights [tokens * top_k],
// x and out [tokens, hidden] fp32.
class MoeConsumer {
 public:
  // The copy regions of a TensorMajorStorage of this layout (one per tensor, in ExpertTensor
  // order: all six are non-empty) that moe_w13 reads: w13, w13_scale, w13_scale_2. Given as
  // DeviceCacheOptions::ready_first_regions, the overlapped fill copies them first for every
  // missing expert and moe_w13 waits only for them (edge D4c).
  static constexpr std::uint32_t first_pass_regions = (1u << 0) | (1u << 2) | (1u << 4);

  MoeConsumer(const Nvfp4Marlin& layout, int max_tokens, int top_k) : layout_(layout), max_tokens_(max_tokens), top_k_(top_k) {
    throw_if_error(layout.validate());
    if (max_tokens < 1 || top_k < 1) throw Error(ErrorCode::invalid_argument, "MoeConsumer: max_tokens and top_k must be >= 1");
    const long long pairs = static_cast<long long>(max_tokens) * top_k;
    if (pairs > 65535) throw Error(ErrorCode::invalid_argument, "MoeConsumer: max_tokens * top_k must be <= 65535");
    const long long padded = layout.padded_intermediate();
    rows1_ = static_cast<int>(layout.hidden / marlin::tile_k);
    rows2_ = static_cast<int>(padded / marlin::tile_k);
    splits1_ = (rows1_ + moe_detail::w13_rows - 1) / moe_detail::w13_rows;
    splits2_ = (rows2_ + moe_detail::w2_rows - 1) / moe_detail::w2_rows;
    counters1_ = pairs * (padded / 64);
    counters2_ = static_cast<long long>(max_tokens) * (layout.hidden / 64);
    // After the two kernels' counters: the readiness kernels' pair progress (one word per pair,
    // then one per token; moe_detail::PairProgress).
    const long long words = counters1_ + counters2_ + pairs + max_tokens;
    alloc(part1_, static_cast<std::size_t>(pairs * splits1_ * 2 * padded) * sizeof(float));
    alloc(act_, static_cast<std::size_t>(pairs * rows2_ * moe_detail::terms * 16) * sizeof(unsigned short));
    alloc(part2_, static_cast<std::size_t>(pairs * splits2_ * layout.hidden) * sizeof(float));
    alloc(counters_, static_cast<std::size_t>(words) * sizeof(unsigned));
    // The kernels keep the counters at zero between runs; they start at zero once. Waited for
    // here, so that runs on any stream (non-blocking ones too) see it.
    check(cudaMemsetAsync(counters_, 0, static_cast<std::size_t>(words) * sizeof(unsigned), cudaStreamLegacy),
          "cudaMemsetAsync");
    check(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize");
    unbias_ = marlin::exp2i(-marlin::dtype_bias(layout.dtype));
    use_pdl_ = pdl_supported();
    w13_resident_ = resident_blocks(moe_detail::moe_w13<moe_detail::ready_wait>);
    load_kernels();
  }
  MoeConsumer(const MoeConsumer&) = delete;
  MoeConsumer& operator=(const MoeConsumer&) = delete;
  ~MoeConsumer() {
    cudaFree(part1_);
    cudaFree(act_);
    cudaFree(part2_);
    cudaFree(counters_);
  }

  // `ready`: DeviceExpertCache::readiness() of an overlapping cache (the kernels then wait per
  // slot and moe_w2 per pair, see the top of this file; run() must then directly follow that
  // cache's prepare on `stream`); empty: the stream-ordered kernels. Tests only:
  // test_skip_wait runs the readiness kernels without the slot waits, test_skip_act_wait runs
  // moe_w2 without any wait before it reads act (moe_w13 still waits for its slots).
  [[nodiscard]] Status run(const MoeWeights& w, const std::int32_t* ids, const float* topk_weights, const float* x,
                           float* out, int tokens, cudaStream_t stream, const SlotReadiness& ready = {},
                           bool test_skip_wait = false, bool test_skip_act_wait = false) const noexcept {
    if (!ready.enabled()) return run_mode<moe_detail::ready_none>(w, ids, topk_weights, x, out, tokens, stream, ready);
    if (test_skip_wait) return run_mode<moe_detail::ready_test_skip_wait>(w, ids, topk_weights, x, out, tokens, stream, ready);
    if (test_skip_act_wait)
      return run_mode<moe_detail::ready_test_skip_act_wait>(w, ids, topk_weights, x, out, tokens, stream, ready);
    return run_mode<moe_detail::ready_wait>(w, ids, topk_weights, x, out, tokens, stream, ready);
  }

  // One-pass mode (compute from host; opt-in, run() is unchanged). Like run() without
  // readiness, except for the pairs whose expert e has host.missing[e] != 0 (a "missing" expert:
  // its slot does not hold it yet). Those read e's bytes (weights, block scales, g') from `host`
  // (mapped host memory, read over the link by the SMs) instead of the slot and compute with
  // them as usual; the first pair of e in this run (lowest pair index: one writer when e appears
  // in several pairs, batch > 1; every pair of e reads from host) stores every byte it read into
  // e's slot at the same offsets. Fill and compute in one pass: the output is bit-identical to
  // filling the missing experts' slots and then calling run(), and once the consumer completed
  // each missing expert's slot holds exactly its host bytes (six tensors, as a fill leaves them).
  //
  // Contract: `w`'s slot buffers are writable device memory; a missing expert's map entry is the
  // slot a fill would have filled, used by no other expert of the run and by no other work
  // while the consumer runs; `host` and its `missing` flags are device-accessible and written
  // before the consumer's first kernel starts; an expert flagged missing that no pair of the run
  // routes to, or that the map drops (-1), is neither read nor written. Readiness words are not
  // touched: this mode replaces the fill, so it takes no SlotReadiness (an overlapped cache's
  // fill would write the same slots). The map that names the slot is the caller's (a plan that
  // does not fill); the slot is complete when this run's second kernel completes.
  // Ordering (docs/design.md, edge D7): the slot writes come after every earlier kernel on
  // `stream` (moe_w13's griddepcontrol.wait precedes its first load and store, and moe_w2 is
  // scheduled only after every moe_w13 block passed it) and before every later one (stream
  // order: moe_w2, which waits for moe_w13, completes last).
  // Bad input (checked here, before any launch; nothing is enqueued): tokens out of range, a
  // null `missing`, a null host or slot base of a tensor the layout has, a stride shorter than
  // the tensor, a base or stride not aligned to the kernels' access width (16 bytes for the
  // weights, 8 for the block scales, 4 for g'), a null map. check_host_source() also checks that
  // the host addresses are device addresses (call it once, outside stream capture).
  // Tests only: test_skip_start_wait drops moe_w13's griddepcontrol.wait (edge D7 removed).
  [[nodiscard]] Status run_one_pass(const MoeWeights& w, const MoeHostSource& host, const std::int32_t* ids,
                                    const float* topk_weights, const float* x, float* out, int tokens, cudaStream_t stream,
                                    bool test_skip_start_wait = false) const noexcept {
    if (tokens < 1 || tokens > max_tokens_) {
      return Status::format(ErrorCode::invalid_argument, "MoeConsumer::run_one_pass: tokens %d outside [1, %d]", tokens,
                            max_tokens_);
    }
    if (Status st = one_pass_inputs_status(w, host); !st) return st;
    if (test_skip_start_wait)
      return run_one_pass_mode<moe_detail::host_test_skip_start_wait>(w, host, ids, topk_weights, x, out, tokens, stream);
    return run_one_pass_mode<moe_detail::host_one_pass>(w, host, ids, topk_weights, x, out, tokens, stream);
  }

  // The checks of run_one_pass's `host`, plus: every host base is a device address (mapped pinned
  // host memory given by its device pointer, or device / managed memory; pageable memory and a
  // host pointer whose device address differs are refused), and so is `missing`. Uses
  // cudaPointerGetAttributes: call it once at setup, not under stream capture.
  [[nodiscard]] Status check_host_source(const MoeHostSource& host) const noexcept {
    if (Status st = host_source_status(host); !st) return st;
    const ExpertTensorBytes b = layout_.tensors();
    constexpr std::size_t n = num_default_expert_tensors;
    for (std::size_t t = 0; t <= n; ++t) {  // the six tensors, then `missing`
      const void* p = t < n ? static_cast<const void*>(host.base[t]) : static_cast<const void*>(host.missing);
      if (t < n && b[t].bytes_per_expert == 0) continue;
      const char* what = t < n ? b[t].name.data() : "missing";
      cudaPointerAttributes a{};
      if (const cudaError_t err = cudaPointerGetAttributes(&a, p); err != cudaSuccess) {
        (void)cudaGetLastError();
        return Status::format(ErrorCode::invalid_argument, "MoeConsumer::check_host_source: %s: cudaPointerGetAttributes: %s",
                              what, cudaGetErrorString(err));
      }
      if (a.type == cudaMemoryTypeUnregistered) {
        return Status::format(ErrorCode::invalid_argument,
                              "MoeConsumer::check_host_source: %s is pageable host memory: the kernels read it "
                              "directly; pin and map it (cudaHostAlloc / cudaHostRegister, Mapped) and pass its device pointer",
                              what);
      }
      if (a.devicePointer != p) {
        return Status::format(ErrorCode::invalid_argument,
                              "MoeConsumer::check_host_source: %s is not a device address (its device pointer differs: "
                              "pass cudaHostGetDevicePointer's)",
                              what);
      }
    }
    return {};
  }

  [[nodiscard]] int top_k() const noexcept { return top_k_; }
  [[nodiscard]] int max_tokens() const noexcept { return max_tokens_; }
  // The readiness kernels' block order (MoePairOrder); pairs by default.
  void set_pair_order(MoePairOrder order) noexcept { pair_order_ = order; }
  [[nodiscard]] MoePairOrder pair_order() const noexcept { return pair_order_; }
  // Whether run() with readiness would take `tokens` tokens' pairs in expert order over experts
  // [0, num_experts).
  [[nodiscard]] bool expert_order_for(int tokens, std::int32_t num_experts) const noexcept {
    const long long pairs = static_cast<long long>(tokens) * top_k_;
    return pair_order_ == MoePairOrder::experts && pairs >= 1 && pairs <= moe_detail::max_ordered_pairs &&
           num_experts < moe_detail::max_ordered_experts;
  }
  // Whether moe_w13's grid for `tokens` tokens (the readiness kernel) is resident on the device at
  // once, so that no block waits for another's SM slot.
  [[nodiscard]] bool one_wave(int tokens) const noexcept {
    const long long w13_blocks = static_cast<long long>(tokens) * top_k_ * (layout_.padded_intermediate() / 64) * splits1_;
    return w13_blocks <= w13_resident_;
  }

 private:
  // Every tensor the layout has: a non-null base, a stride of at least its bytes, both aligned to
  // the kernels' access width. `which` names the side ("host" or "slot") in the error.
  [[nodiscard]] Status tensor_region_status(const unsigned char* const (&base)[num_expert_tensors],
                                            const unsigned long long (&stride)[num_expert_tensors],
                                            const char* which) const noexcept {
    const ExpertTensorBytes b = layout_.tensors();
    for (std::size_t t = 0; t < num_default_expert_tensors; ++t) {
      if (b[t].bytes_per_expert == 0) continue;
      const unsigned long long align = moe_detail::tensor_access_bytes[t];
      if (base[t] == nullptr)
        return Status::format(ErrorCode::invalid_argument, "MoeConsumer::run_one_pass: %s base of %s is null", which, b[t].name.data());
      if (stride[t] < b[t].bytes_per_expert)
        return Status::format(ErrorCode::invalid_argument, "MoeConsumer::run_one_pass: %s stride of %s is %llu, below its %zu bytes",
                              which, b[t].name.data(), stride[t], b[t].bytes_per_expert);
      if (reinterpret_cast<std::uintptr_t>(base[t]) % align != 0 || stride[t] % align != 0)
        return Status::format(ErrorCode::invalid_argument,
                              "MoeConsumer::run_one_pass: %s base or stride of %s not a multiple of %llu bytes", which,
                              b[t].name.data(), align);
    }
    return {};
  }

  [[nodiscard]] Status host_source_status(const MoeHostSource& host) const noexcept {
    if (host.missing == nullptr)
      return Status(ErrorCode::invalid_argument, "MoeConsumer::run_one_pass: host.missing is null (the missing experts' flags)");
    return tensor_region_status(host.base, host.stride, "host");
  }

  [[nodiscard]] Status one_pass_inputs_status(const MoeWeights& w, const MoeHostSource& host) const noexcept {
    if (Status st = host_source_status(host); !st) return st;
    if (w.expert_map == nullptr || w.num_experts < 1)
      return Status(ErrorCode::invalid_argument, "MoeConsumer::run_one_pass: the weights have no expert map");
    return tensor_region_status(w.base, w.stride, "slot");
  }

  template <int Host>
  [[nodiscard]] Status run_one_pass_mode(const MoeWeights& w, const MoeHostSource& host, const std::int32_t* ids,
                                         const float* topk_weights, const float* x, float* out, int tokens,
                                         cudaStream_t stream) const noexcept {
    const unsigned pairs = static_cast<unsigned>(tokens * top_k_);
    const int padded = static_cast<int>(layout_.padded_intermediate());
    const int hidden = static_cast<int>(layout_.hidden);
    const float gscale = unbias_ * moe_detail::out_scale;
    cudaError_t err = launch(moe_detail::moe_w13_one_pass<Host>,
                             dim3(static_cast<unsigned>(padded / 64), static_cast<unsigned>(splits1_), pairs), stream, w, host,
                             ids, x, hidden, top_k_, rows1_, padded, gscale, part1_, counters_, act_);
    if (err == cudaSuccess) {
      err = launch(moe_detail::moe_w2_one_pass<Host>, dim3(static_cast<unsigned>(hidden / 64), static_cast<unsigned>(splits2_), pairs),
                   stream, w, host, ids, topk_weights, hidden, top_k_, rows2_, gscale, static_cast<const unsigned short*>(act_),
                   part2_, counters_ + counters1_, out);
    }
    if (err == cudaSuccess) err = cudaGetLastError();
    return cuda_status(err, "MoeConsumer::run_one_pass: launch");
  }

  template <int Mode>
  [[nodiscard]] Status run_mode(const MoeWeights& w, const std::int32_t* ids, const float* topk_weights, const float* x,
                                float* out, int tokens, cudaStream_t stream, const SlotReadiness& ready) const noexcept {
    if (tokens < 1 || tokens > max_tokens_) {
      return Status::format(ErrorCode::invalid_argument, "MoeConsumer::run: tokens %d outside [1, %d]", tokens,
                            max_tokens_);
    }
    const unsigned pairs = static_cast<unsigned>(tokens * top_k_);
    const int padded = static_cast<int>(layout_.padded_intermediate());
    const int hidden = static_cast<int>(layout_.hidden);
    const float gscale = unbias_ * moe_detail::out_scale;
    moe_detail::PairProgress progress;
    progress.tiles_done = counters_ + counters1_ + counters2_;
    progress.token_done = progress.tiles_done + static_cast<long long>(max_tokens_) * top_k_;
    progress.w13_tiles = static_cast<unsigned>(padded / 64);
    if constexpr (Mode != moe_detail::ready_none) {
      if (expert_order_for(tokens, w.num_experts)) progress.ordered_pairs = static_cast<int>(pairs);
    }
    // Both with the PDL attribute where supported (launch): with readiness, moe_w2 is then
    // scheduled only once every moe_w13 block triggered, i.e. is running or done, which is what
    // makes its per-pair wait deadlock-free (top of this file).
    cudaError_t err = launch(moe_detail::moe_w13<Mode>, dim3(static_cast<unsigned>(padded / 64), static_cast<unsigned>(splits1_), pairs),
                             stream, w, ids, x, hidden, top_k_, rows1_, padded, gscale, part1_, counters_, act_, ready, progress);
    if (err == cudaSuccess) {
      err = launch(moe_detail::moe_w2<Mode>, dim3(static_cast<unsigned>(hidden / 64), static_cast<unsigned>(splits2_), pairs), stream, w,
                   ids, topk_weights, hidden, top_k_, rows2_, gscale, static_cast<const unsigned short*>(act_), part2_,
                   counters_ + counters1_, out, ready, progress);
    }
    if (err == cudaSuccess) err = cudaGetLastError();
    return cuda_status(err, "MoeConsumer::run: launch");
  }

  // Blocks of `kernel` (moe_detail::threads each) resident at once on the current device; 0 if
  // unknown (one_wave then says no).
  template <class... Params>
  static long long resident_blocks(void (*kernel)(Params...)) noexcept {
    int dev = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, moe_detail::threads, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return static_cast<long long>(sms) * per_sm;
  }

  // Every mode's kernels loaded at construction, as an engine loads its own before the first
  // step: with lazy module loading a first launch loads the kernel and may wait for the device,
  // which a copy-engine fill then holds until its bounded wait gives up (docs/design.md,
  // "Copy-engine fills").
  static void load_kernels() {
    const void* kernels[] = {
        reinterpret_cast<const void*>(&moe_detail::moe_w13<moe_detail::ready_none>),
        reinterpret_cast<const void*>(&moe_detail::moe_w13<moe_detail::ready_wait>),
        reinterpret_cast<const void*>(&moe_detail::moe_w13<moe_detail::ready_test_skip_wait>),
        reinterpret_cast<const void*>(&moe_detail::moe_w13<moe_detail::ready_test_skip_act_wait>),
        reinterpret_cast<const void*>(&moe_detail::moe_w2<moe_detail::ready_none>),
        reinterpret_cast<const void*>(&moe_detail::moe_w2<moe_detail::ready_wait>),
        reinterpret_cast<const void*>(&moe_detail::moe_w2<moe_detail::ready_test_skip_wait>),
        reinterpret_cast<const void*>(&moe_detail::moe_w2<moe_detail::ready_test_skip_act_wait>),
    };
    for (const void* k : kernels) {
      cudaFuncAttributes a{};
      check(cudaFuncGetAttributes(&a, k), "cudaFuncGetAttributes (loading the consumer's kernels)");
    }
  }

  // PDL needs sm_90 and kernels whose code has the waits (PTX for sm_90 or newer): a kernel
  // JIT-compiled from older PTX would not wait, so it then runs in plain stream order.
  static bool pdl_supported() noexcept {
    int dev = 0, major = 0;
    cudaFuncAttributes a13{}, a2{};
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaFuncGetAttributes(&a13, moe_detail::moe_w13<>) != cudaSuccess ||
        cudaFuncGetAttributes(&a2, moe_detail::moe_w2<>) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return major >= 9 && a13.ptxVersion >= 90 && a2.ptxVersion >= 90;
  }

  // With the PDL attribute where supported; a launch refused with it is retried in plain
  // stream order (always correct: the kernels' waits are then no-ops).
  template <class... Params, class... Args>
  cudaError_t launch(void (*kernel)(Params...), dim3 grid, cudaStream_t stream, const Args&... args) const noexcept {
    cudaLaunchAttribute attr[1] = {};
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(moe_detail::threads);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = use_pdl_ ? 1u : 0u;
    cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
    if (err != cudaSuccess && cfg.numAttrs != 0) {
      (void)cudaGetLastError();
      cfg.numAttrs = 0;
      err = cudaLaunchKernelEx(&cfg, kernel, args...);
    }
    return err;
  }

  static void check(cudaError_t err, const char* what) {
    if (Status s = cuda_status(err, what); !s) throw Error(s.with_context("MoeConsumer"));
  }
  template <class T>
  static void alloc(T*& p, std::size_t bytes) {
    if (Status s = cuda_status(cudaMalloc(&p, bytes), "cudaMalloc"); !s)
      throw Error(s.with_context("MoeConsumer: %zu bytes", bytes));
  }

  Nvfp4Marlin layout_;
  int max_tokens_;
  int top_k_;
  int rows1_ = 0;
  int rows2_ = 0;
  int splits1_ = 1;
  int splits2_ = 1;
  long long counters1_ = 0;
  long long counters2_ = 0;
  float unbias_ = 1.0f;
  bool use_pdl_ = false;
  long long w13_resident_ = 0;  // moe_w13 blocks (readiness kernel) the device holds at once
  MoePairOrder pair_order_ = MoePairOrder::pairs;
  float* part1_ = nullptr;
  unsigned short* act_ = nullptr;
  float* part2_ = nullptr;
  unsigned* counters_ = nullptr;
};

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
