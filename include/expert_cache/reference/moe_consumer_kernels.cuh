#pragma once
/// The reference NVFP4 consumer's kernels: moe_w13 and moe_w2 (stream-ordered and readiness
/// instantiations) and their one-pass entry points; what they compute and how they order their
/// reads is described at the top of reference/moe_consumer.cuh, which launches them.
#if !defined(__CUDACC__)
#error "expert_cache/reference/moe_consumer_kernels.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/kernels/slot_ready.cuh"
#include "expert_cache/reference/moe_consumer_helpers.cuh"
#include "expert_cache/reference/moe_mma.cuh"
#include "expert_cache/reference/moe_weights.cuh"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

namespace moe_detail {

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

/// @brief The first pass: C1 partials of the gate and up tile j over one split of K-rows of one
/// pair, then, in the last block of (pair, j), A = silu(gate) * up (moe_w13_body). Grid
/// (Np / 64, splits, pairs) of `threads` threads.
/// @tparam Mode ready_none (stream-ordered), ready_wait (readiness) or a tests-only mode.
/// @param w The slots' tensors and the forward map.
/// @param ids The routed expert of each pair [tokens * top_k].
/// @param x The inputs [tokens, hidden], fp32.
/// @param hidden K.
/// @param top_k Experts per token.
/// @param rows 16-k rows of W13 (K / 16).
/// @param padded Np.
/// @param gscale 2^-B of the activation dtype times out_scale.
/// @param partial Workspace: the C1 partials per pair, split and column.
/// @param counters Arrival counters per (pair, tile); zero between runs.
/// @param act Output: A per pair as three bf16 terms per element, in MMA fragment order.
/// @param ready The slots' ready words (readiness modes; empty for ready_none).
/// @param progress Per-pair tile counts for moe_w2 and the block order (readiness modes).
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

/// @brief The second pass: C3 of the 64-column tile nt over one split of Np-rows of one pair,
/// times topk_weight * g2', then, in the last block of (token, nt), out = the sum over the
/// token's pairs and splits (moe_w2_body). Grid (K / 64, splits, pairs) of `threads` threads.
/// @tparam Mode As moe_w13's.
/// @param w The slots' tensors and the forward map.
/// @param ids The routed expert of each pair [tokens * top_k].
/// @param topk_weights The routing weight of each pair [tokens * top_k].
/// @param hidden K.
/// @param top_k Experts per token.
/// @param rows 16-k rows of W2 (Np / 16).
/// @param gscale 2^-B of the activation dtype times out_scale.
/// @param act moe_w13's output.
/// @param partial Workspace: the weighted C3 partials per pair and split.
/// @param counters Arrival counters per (token, tile); zero between runs.
/// @param out Output [tokens, hidden], fp32.
/// @param ready The slots' ready words (readiness modes; empty for ready_none).
/// @param progress moe_w13's per-pair tile counts and the block order (readiness modes).
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

/// @brief moe_w13<> in the one-pass mode: a missing expert's pairs read W13, w13_scale and g1'
/// from `host`, and its writer pair stores them into the slot.
/// @tparam Host host_one_pass, or host_test_skip_start_wait (tests: no wait at the start).
/// @param w The slots' tensors (writable) and the forward map.
/// @param host The missing experts' host copies and their flags.
/// @param ids The routed expert of each pair [tokens * top_k].
/// @param x The inputs [tokens, hidden], fp32.
/// @param hidden K.
/// @param top_k Experts per token.
/// @param rows 16-k rows of W13 (K / 16).
/// @param padded Np.
/// @param gscale 2^-B of the activation dtype times out_scale.
/// @param partial Workspace: the C1 partials per pair, split and column.
/// @param counters Arrival counters per (pair, tile); zero between runs.
/// @param act Output: A per pair as three bf16 terms per element, in MMA fragment order.
template <int Host>
EXPERT_CACHE_KERNEL void __launch_bounds__(threads, w13_blocks_per_sm)
    moe_w13_one_pass(MoeWeights w, MoeHostSource host, const std::int32_t* ids, const float* x, int hidden, int top_k,
                     int rows, int padded, float gscale, float* partial, unsigned* counters, unsigned short* act) {
  moe_w13_body<ready_none, Host>(w, ids, x, hidden, top_k, rows, padded, gscale, partial, counters, act, SlotReadiness{},
                                 PairProgress{}, host);
}
/// @brief moe_w2<> in the one-pass mode: a missing expert's pairs read W2, w2_scale and g2' from
/// `host`, and its writer pair stores them into the slot.
/// @tparam Host As moe_w13_one_pass's.
/// @param w The slots' tensors (writable) and the forward map.
/// @param host The missing experts' host copies and their flags.
/// @param ids The routed expert of each pair [tokens * top_k].
/// @param topk_weights The routing weight of each pair [tokens * top_k].
/// @param hidden K.
/// @param top_k Experts per token.
/// @param rows 16-k rows of W2 (Np / 16).
/// @param gscale 2^-B of the activation dtype times out_scale.
/// @param act moe_w13's output.
/// @param partial Workspace: the weighted C3 partials per pair and split.
/// @param counters Arrival counters per (token, tile); zero between runs.
/// @param out Output [tokens, hidden], fp32.
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

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
