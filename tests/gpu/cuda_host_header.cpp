// Self-containment check: the CUDA tier's host headers compile with the host compiler (g++)
// given only CUDA's include directory, and CudaRuntime models the runtime concepts. Runs
// without a device (constructing CudaRuntime touches no CUDA API).
#include "expert_cache/runtime/cuda_runtime.hpp"  // first: self-contained on its own
#include "expert_cache/cuda.hpp"

static_assert(expert_cache::runtime<expert_cache::CudaRuntime>);
static_assert(expert_cache::allocating_runtime<expert_cache::CudaRuntime>);
static_assert(expert_cache::batching_runtime<expert_cache::CudaRuntime>);

int main() {
  expert_cache::CudaRuntime rt;
  return rt.sync_after_enqueue() ? 0 : 0;
}
