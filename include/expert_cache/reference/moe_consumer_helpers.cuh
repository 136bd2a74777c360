#pragma once
/// The device helpers of the reference consumer's kernels: their modes and block geometry, the
/// slot, host and streaming loads, the one-pass mode's pair sources and slot writes, the readiness
/// waits and per-pair progress (docs/design.md, edges D4, D4b, D4c), and the block reductions and
/// arrival counters.
#if !defined(__CUDACC__)
#error "expert_cache/reference/moe_consumer_helpers.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "expert_cache/base/config.hpp"
#include "expert_cache/kernels/griddep.cuh"
#include "expert_cache/kernels/slot_ready.cuh"
#include "expert_cache/reference/moe_mma.cuh"
#include "expert_cache/reference/moe_weights.cuh"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

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
inline constexpr int w13_blocks_per_sm = 5;  // 48 registers: moe_w13's 640 blocks (K = 2048, Np = 512, top 10) in one wave
static_assert(warps == 2 * w13_row_groups, "moe_w13: half the warps on the gate tile, half on the up tile");

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

}  // namespace moe_detail

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
