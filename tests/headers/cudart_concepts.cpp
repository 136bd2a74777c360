// CudaRuntime models the runtime concepts with the host compiler alone (CUDA's include
// directory, no nvcc); linked into test_headers_alone_cudart. Constructing one touches no CUDA
// API, so this runs without a device.
#include "expert_cache/cuda.hpp"

static_assert(expert_cache::runtime<expert_cache::CudaRuntime>);
static_assert(expert_cache::allocating_runtime<expert_cache::CudaRuntime>);
static_assert(expert_cache::batching_runtime<expert_cache::CudaRuntime>);

[[maybe_unused]] static const bool cuda_runtime_constructs = [] {
  expert_cache::CudaRuntime rt;
  return rt.sync_after_enqueue() || true;
}();
