#pragma once
/// The GPU's plan_block models (needs nvcc), on which the planning steps of
/// planning/device_plan.hpp run: CubBlock, one thread block (CUB block scan / reduce,
/// cuda::atomic_ref counters), and WarpBlock, one warp (shuffles, __syncwarp, no shared memory).
///
/// One block because planning is a short chain of dependent block-wide steps (mark, scan,
/// classify, victim arg-min, apply) over a few hundred entries: a grid would need grid-wide
/// barriers between them, costing more than the work. 256 threads cover E = 512 in two scan
/// rounds and C = 208 slots in one victim pass. A forward of at most plan_small_ids ids (the
/// register small path, planning/device_plan.hpp) runs on ONE WARP instead (WarpBlock): nothing
/// in it is E-wide, and warp barriers are cheaper.
#if !defined(__CUDACC__)
#error "expert_cache/kernels/plan_block.cuh needs nvcc"
#endif

#include <cuda/atomic>

#include <cstdint>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "expert_cache/base/config.hpp"
#include "expert_cache/planning/device_plan.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

inline constexpr int plan_block_threads = 256;

// The stores of a plan_block (CubBlock, WarpBlock) to words other threads or the host read.
struct PlanBlockStores {
  // Stats and the error word live in mapped host memory that the host reads while graphs run:
  // system scope. A relaxed load + store, not a read-modify-write: over PCIe the GPU has no
  // native atomics on host memory (cudaDevAttrHostNativeAtomicSupported is 0 on the H200 here,
  // and compute-sanitizer rejects system-scoped RMWs on it). There is a single writer: thread 0
  // of the one block, and the plan kernels of one state are stream ordered; so each aligned word
  // still changes in one single-copy-atomic store, and the host reads old or new, never torn.
  // Relaxed: a counter orders nothing. (The host clears the error word only while the stream
  // is idle.)
  // The stats mirror is only ever stored (the authoritative counters are in device memory):
  // no PCIe read on the planning path.
  __device__ void publish(std::uint64_t& w, std::uint64_t v) noexcept {
    cuda::atomic_ref<std::uint64_t, cuda::thread_scope_system>(w).store(v, cuda::memory_order_relaxed);
  }
  __device__ void flags_or(std::uint32_t& w, std::uint32_t v) noexcept {
    cuda::atomic_ref<std::uint32_t, cuda::thread_scope_system> a(w);
    a.store(a.load(cuda::memory_order_relaxed) | v, cuda::memory_order_relaxed);
  }
  // Many threads mark the same expert: atomic stores make the race well defined; the barrier
  // that follows publishes them.
  __device__ void mark(std::uint32_t& w) noexcept {
    cuda::atomic_ref<std::uint32_t, cuda::thread_scope_block>(w).store(1u, cuda::memory_order_relaxed);
  }
};

// The plan_block of the GPU: threadIdx.x of a 1-D block of exactly Threads threads.
template <int Threads>
class CubBlock : public PlanBlockStores {
  using Scan = cub::BlockScan<std::int32_t, Threads>;
  using ReduceSum = cub::BlockReduce<std::int32_t, Threads>;
  using ReduceKey = cub::BlockReduce<PlanKey, Threads>;
  using ReduceScore = cub::BlockReduce<ScoreKey, Threads>;

 public:
  struct TempStorage {
    union {
      typename Scan::TempStorage scan;
      typename ReduceSum::TempStorage sum;
      typename ReduceKey::TempStorage key;
      typename ReduceScore::TempStorage score;
    } cub;
    std::uint64_t key_tick;  // broadcast slots (BlockReduce's result is valid in thread 0 only)
    std::uint64_t key_tie;
    std::int32_t key_slot;
    std::int32_t value;
    // Rank selection of victims (plan_group_from): 12 bytes of key per slot, up to two slots
    // per thread (the default capacity, 208, in one pass of 256 threads): 6 KB at 256 threads.
    std::uint64_t rank_primary[2 * Threads];
    std::uint32_t rank_secondary[2 * Threads];
  };

  __device__ explicit CubBlock(TempStorage& t) noexcept : t_(t) {}

  __device__ std::int32_t thread_rank() const noexcept { return static_cast<std::int32_t>(threadIdx.x); }
  __device__ std::int32_t size() const noexcept { return Threads; }
  __device__ void sync() noexcept { __syncthreads(); }
  __device__ RankScratch rank_scratch() noexcept { return {t_.rank_primary, t_.rank_secondary, 2 * Threads}; }

  // Every collective ends with a barrier, so the shared temp storage may be reused at once.
  __device__ std::int32_t exclusive_sum(std::int32_t v, std::int32_t& total) noexcept {
    std::int32_t out = 0;
    Scan(t_.cub.scan).ExclusiveSum(v, out, total);
    __syncthreads();
    return out;
  }
  __device__ std::int32_t sum(std::int32_t v) noexcept {
    const std::int32_t r = ReduceSum(t_.cub.sum).Sum(v);
    if (threadIdx.x == 0) t_.value = r;
    __syncthreads();
    const std::int32_t all = t_.value;
    __syncthreads();  // nobody overwrites the broadcast slot before everyone read it
    return all;
  }
  __device__ PlanKey min_key(PlanKey k) noexcept {
    const PlanKey r = ReduceKey(t_.cub.key).Reduce(k, KeyMin{});
    if (threadIdx.x == 0) {
      t_.key_tick = r.tick;
      t_.key_slot = r.slot;
    }
    __syncthreads();
    PlanKey all;
    all.tick = t_.key_tick;
    all.slot = t_.key_slot;
    __syncthreads();
    return all;
  }
  __device__ ScoreKey min_score(ScoreKey k) noexcept {
    const ScoreKey r = ReduceScore(t_.cub.score).Reduce(k, KeyMin{});
    if (threadIdx.x == 0) {
      t_.key_tick = r.score;
      t_.key_tie = r.tie;
      t_.key_slot = r.slot;
    }
    __syncthreads();
    ScoreKey all;
    all.score = t_.key_tick;
    all.tie = t_.key_tie;
    all.slot = t_.key_slot;
    __syncthreads();
    return all;
  }
 private:
  struct KeyMin {
    __device__ PlanKey operator()(const PlanKey& a, const PlanKey& b) const noexcept { return b < a ? b : a; }
    __device__ ScoreKey operator()(const ScoreKey& a, const ScoreKey& b) const noexcept { return b < a ? b : a; }
  };
  TempStorage& t_;
};

// The plan_block of one warp (lanes of threadIdx.x / 32 == the calling warp; the whole warp
// calls every collective). Barriers are __syncwarp (which orders memory among the warp's
// threads); scans and reductions are shuffles, results in every lane.
class WarpBlock : public PlanBlockStores {
  static constexpr unsigned full = 0xffffffffu;

 public:
  __device__ std::int32_t thread_rank() const noexcept { return static_cast<std::int32_t>(threadIdx.x & 31u); }
  __device__ std::int32_t size() const noexcept { return 32; }
  __device__ void sync() noexcept { __syncwarp(); }
  // None: a warp's arg-min is a few shuffles without a barrier, cheaper than a pass over the keys.
  __device__ RankScratch rank_scratch() noexcept { return {}; }
  __device__ std::int32_t exclusive_sum(std::int32_t v, std::int32_t& total) noexcept {
    const std::int32_t lane = thread_rank();
    // The planning code sums 0/1 flags (a miss, a new id): one vote and one ballot then, instead
    // of five dependent shuffles on the plan's chain.
    if (__all_sync(full, v == 0 || v == 1)) {
      const unsigned set = __ballot_sync(full, v != 0);
      total = __popc(set);
      return __popc(set & ((1u << lane) - 1u));
    }
    std::int32_t x = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const std::int32_t y = __shfl_up_sync(full, x, d);
      if (lane >= d) x += y;
    }
    total = __shfl_sync(full, x, 31);
    return x - v;
  }
  __device__ std::int32_t sum(std::int32_t v) noexcept {
    return static_cast<std::int32_t>(__reduce_add_sync(full, static_cast<unsigned>(v)));
  }
  __device__ PlanKey min_key(PlanKey k) noexcept {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      PlanKey o;
      o.tick = __shfl_xor_sync(full, k.tick, d);
      o.slot = __shfl_xor_sync(full, k.slot, d);
      if (o < k) k = o;
    }
    return k;
  }
  __device__ ScoreKey min_score(ScoreKey k) noexcept {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      ScoreKey o;
      o.score = __shfl_xor_sync(full, k.score, d);
      o.tie = __shfl_xor_sync(full, k.tie, d);
      o.slot = __shfl_xor_sync(full, k.slot, d);
      if (o < k) k = o;
    }
    return k;
  }
};

static_assert(plan_block<CubBlock<plan_block_threads>>);

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
