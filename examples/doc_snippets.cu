// The code blocks of README.md and docs/cuda_backend.md that are pieces of an engine rather than
// whole programs, each in a function whose parameters are what the block takes from the engine
// (its weights, workspace, options, layout, ids and stream). examples/meson.build compiles this
// file with warnings as errors and does not run it: the engine's memory is not here.
// tests/headers/check_doc_snippets.py checks that each block equals its marked region.
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "expert_cache/cuda.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"

namespace doc_snippets {

using namespace expert_cache;

// README.md, "Serving an engine's own weights".
void own_weights(CudaRuntime& rt, const Nvfp4Marlin& layout, const std::array<void*, num_expert_tensors>& weights,
                 void* workspace) {
  // [own_weights]
  CacheOptions o;  // num_experts, capacity, top_k as usual
  const ExpertTensorBytes tensors = layout.tensors();
  const auto E = static_cast<std::size_t>(o.num_experts);
  for (std::size_t t = 0; t < num_expert_tensors; ++t)  // the engine's [E, bytes_t] weight tensors, as they are
    if (tensors[t].bytes_per_expert != 0) o.memory.host_tensors[t] = MemorySpan{weights[t], E * tensors[t].bytes_per_expert};
  const CacheShape shape{o.num_experts, o.capacity};
  o.memory.slot_workspace = MemorySpan{workspace, TensorMajorStorage<CudaRuntime>::slot_workspace_bytes(shape, tensors)};
  RowCache<CudaRuntime, Nvfp4Marlin> cache(rt, o, layout);  // spans registered in place; slots carved from workspace
  // [own_weights]
}

// docs/cuda_backend.md, the opening example.
void gather_cache(const CacheOptions& options, const Nvfp4Marlin& layout, std::span<const std::int32_t> topk_ids,
                  cudaStream_t stream) {
  // [gather_cache]
  using namespace expert_cache;
  CudaRuntime rt;                                   // or CudaRuntime({.sync_after_enqueue = true})
  ExpertCache<TensorMajorStorage, Lru, Gather, Nvfp4Marlin, CudaRuntime> cache(rt, options, layout);
  // fill cache.storage().host_tensor(t, e) once (pinned, mapped host memory)
  auto view = cache.prepare(topk_ids, stream);      // stream: cudaStream_t (or to_cuda_stream(ref))
  // launch the MoE kernels on `stream` with view.value().tensors / expert_map
  // [gather_cache]
}

// docs/cuda_backend.md, "Your own memory and per-tensor slots".
void own_memory_gather(CudaRuntime& rt, const Nvfp4Marlin& layout, const std::array<std::span<std::byte>, 6>& weights,
                       void* workspace) {
  // [own_memory_gather]
  CacheOptions o;                       // num_experts, capacity, top_k as usual
  for (std::size_t t = 0; t < 6; ++t)   // the engine's [E, ...] weight tensors, as they are
    o.memory.host_tensors[t] = MemorySpan{weights[t].data(), weights[t].size_bytes()};
  o.memory.slot_workspace = MemorySpan{workspace, TensorMajorStorage<CudaRuntime>::slot_workspace_bytes(
                                                      {o.num_experts, o.capacity}, layout.tensors())};
  ExpertCache<TensorMajorStorage, Lru, Gather, Nvfp4Marlin, CudaRuntime> cache(rt, o, layout);
  // [own_memory_gather]
}

}  // namespace doc_snippets
