#pragma once
/// One rank's reference MoE step: global ids to local, the rank's cache prepare, the reference consumer.
// One rank's MoE step on its device (docs/parallel.md): the forward's global top-k ids ->
// local ids (ExpertPlacement::to_local on the host, validated before anything changes) ->
// the rank's cache prepare -> the same translation on the device (the consumer reads the ids
// there) -> the reference NVFP4 consumer (reference/moe_consumer.cuh) -> the rank's partial output.
// Pairs owned by another rank are -1 for this rank's consumer and contribute exactly 0.
// The reduction of the partials is all_reduce.cuh's.
#if !defined(__CUDACC__)
#error "expert_cache/reference/rank_step.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "expert_cache/base/status.hpp"
#include "expert_cache/cache/expert_cache.hpp"
#include "expert_cache/parallel/expert_placement.hpp"
#include "expert_cache/reference/moe_consumer.cuh"
#include "expert_cache/runtime/cuda_error.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

namespace parallel_detail {

// ids [n] global -> local through table [num_global] (-1: another rank's); padding and ids
// outside [0, num_global) -> -1 (the host check already refused the latter).
template <class = void>
__global__ void map_to_local_kernel(const std::int32_t* ids, int n, const std::int32_t* table, int num_global,
                                    std::int32_t* out) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  const std::int32_t g = ids[i];
  out[i] = (g < 0 || g >= num_global) ? -1 : table[g];
}

}  // namespace parallel_detail

// Cache: an ExpertCache over CudaRuntime with the Nvfp4Marlin layout of this rank (expert
// parallel: the layer's layout over the rank's local experts; tensor slice: tp_slice_layout).
// Construct and run with the rank's device current.
template <class Cache>
class RankStep {
 public:
  RankStep(const ExpertPlacement& placement, std::int32_t rank, Cache& cache, int max_tokens, int top_k)
      : placement_(placement), rank_(rank), cache_(&cache), consumer_(cache.layout(), max_tokens, top_k) {
    if (Status s = placement.check_rank(rank, placement.world_size(), cache.options().num_experts); !s) throw Error(s);
    const auto table = placement.local_table(rank);
    const std::size_t ids = static_cast<std::size_t>(max_tokens) * static_cast<std::size_t>(top_k);
    check(cudaMalloc(&table_, table.size_bytes()), "cudaMalloc");
    check(cudaMalloc(&local_ids_, ids * sizeof(std::int32_t)), "cudaMalloc");
    check(cudaMemcpy(table_, table.data(), table.size_bytes(), cudaMemcpyHostToDevice), "cudaMemcpy");
    local_host_.resize(ids);
  }
  RankStep(const RankStep&) = delete;
  RankStep& operator=(const RankStep&) = delete;
  ~RankStep() {
    cudaFree(table_);
    cudaFree(local_ids_);
  }

  // `global_host` and `global_dev` hold the same tokens * top_k global ids. Errors before the
  // prepare (a bad id, a length mismatch) leave the cache unchanged.
  [[nodiscard]] Result<ForwardView> run(std::span<const std::int32_t> global_host, const std::int32_t* global_dev,
                                        const float* topk_weights, const float* x, float* partial, int tokens,
                                        cudaStream_t stream) noexcept {
    const std::size_t n = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(consumer_.top_k());
    if (tokens < 1 || tokens > consumer_.max_tokens() || global_host.size() != n)
      return Status::format(ErrorCode::invalid_argument, "RankStep: %zu ids for %d tokens of top-%d (at most %d tokens)",
                            global_host.size(), tokens, consumer_.top_k(), consumer_.max_tokens());
    std::span<std::int32_t> local(local_host_.data(), n);
    if (Status s = placement_.to_local(rank_, global_host, local); !s) return s;
    auto view = cache_->prepare(local, stream);
    if (!view.ok()) return view.status().with_context("rank %d", rank_);
    parallel_detail::map_to_local_kernel<<<static_cast<unsigned>((n + 127) / 128), 128, 0, stream>>>(
        global_dev, static_cast<int>(n), table_, placement_.num_global(), local_ids_);
    if (Status s = cuda_status(cudaGetLastError(), "RankStep: map_to_local_kernel launch"); !s) return s;
    const MoeWeights w = moe_weights_from_view(view.value(), cache_->options().num_experts);
    if (Status s = consumer_.run(w, local_ids_, topk_weights, x, partial, tokens, stream); !s)
      return s.with_context("rank %d", rank_);
    return view;
  }

  [[nodiscard]] std::int32_t rank() const noexcept { return rank_; }
  [[nodiscard]] Cache& cache() noexcept { return *cache_; }

 private:
  // Throws from the constructor, whose destructor then does not run: free what exists first.
  void check(cudaError_t err, const char* what) {
    if (Status s = cuda_status(err, what); !s) {
      cudaFree(table_);
      cudaFree(local_ids_);
      throw Error(s.with_context("RankStep"));
    }
  }

  ExpertPlacement placement_;
  std::int32_t rank_;
  Cache* cache_;
  MoeConsumer consumer_;
  std::int32_t* table_ = nullptr;
  std::int32_t* local_ids_ = nullptr;
  std::vector<std::int32_t> local_host_;
};

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
