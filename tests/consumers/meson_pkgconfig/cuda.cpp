// CUDA tier through pkg-config (expert_cache_cuda.pc: cudart), built with the host compiler:
// cuda.hpp and CudaRuntime. Constructing CudaRuntime touches no CUDA API, so this runs without a device.
#include <cstdio>

#include "expert_cache/cuda.hpp"

int main() {
  expert_cache::CudaRuntime rt;
  (void)rt;
  const expert_cache::Status s = expert_cache::cuda_status(cudaSuccess, "nothing");
  std::printf("expert_cache %s CUDA tier: cudaSuccess -> %s\n", EXPERT_CACHE_VERSION, s.ok() ? "ok" : "error");
  return s.ok() ? 0 : 1;
}
