// CUDA tier of expert_cache through expert_cache_cuda_dep, with the host compiler: cuda.hpp and
// cudart. Constructing CudaRuntime touches no CUDA API, so this runs without a device.
#include "expert_cache/cuda.hpp"

int main() {
  expert_cache::CudaRuntime rt;
  (void)rt;
  return expert_cache::cuda_status(cudaSuccess, "nothing").ok() ? 0 : 1;
}
