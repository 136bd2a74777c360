#pragma once
/// MoeConsumer: the reference NVFP4 MoE consumer for small decode batches (1-16 tokens); it owns
/// its workspace and launches the kernels of reference/moe_consumer_kernels.cuh. This comment says
/// what those kernels compute and how they order their reads.
//
// Parts: reference/moe_weights.cuh (MoeWeights, MoeHostSource: what the kernels read),
// reference/moe_mma.cuh (the decode and MMA arithmetic, shared with reference/moe_grouped.cuh),
// reference/moe_consumer_helpers.cuh (the kernels' device helpers), reference/moe_consumer_kernels.cuh.
//
// The kernels read the experts the cache made resident, through the forward map (global id -> slot)
// and the slot buffers, in the NVFP4-Marlin layout of layout/nvfp4_marlin.hpp (weight words, S0E5M3
// block scales, per-slot fp32 global scales g'). Per token m and routed expert e (pair p = m * top_k + j):
//   C1  = x[m] . W13[slot]              (K -> 2Np; gate shard [0, Np), up shard [Np, 2Np))
//   A   = silu(C1[:Np]) * C1[Np:]       (padding rows are zero in W13, so A is zero there)
//   C3  = A . W2[slot]                  (Np -> K)
//   out[m] = sum_j topk_weight[p] * C3
// Dequant follows the kernel decode contract (docs/nvfp4_marlin.md, Decode contract): value = fp4 * 2^-B *
// s0e5m3(scale) * g' with B the activation dtype's bias. Pairs whose expert is -1, out of range or absent from the
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

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/kernels/slot_ready.cuh"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/reference/moe_consumer_kernels.cuh"
#include "expert_cache/reference/moe_weights.cuh"
#include "expert_cache/runtime/cuda_error.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

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
