// Compile-time probe (bench/scripts/compile_time.sh --cuda): a static WholeExpertCache on CudaRuntime.
#include <cstdio>

#include "expert_cache/cuda.hpp"
#include "expert_cache/expert_cache.hpp"
#include "expert_cache/layout/dense.hpp"

int main() {
  using namespace expert_cache;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  CudaRuntime rt;
  CacheOptions o;
  o.num_experts = 64;
  o.capacity = 16;
  o.top_k = 8;
  try {
    WholeExpertCache<CudaRuntime, DenseBf16> cache(rt, o, DenseBf16{.hidden = 64, .intermediate = 32});
    const int ids[] = {1, 2, 3, 4, 5, 6, 7, 8};
    const auto view = cache.prepare(ids, cudaStreamPerThread);
    std::printf("%s\n", view.ok() ? "ok" : "failed");
    return view.ok() ? 0 : 1;
  } catch (const Error& e) {
    std::printf("%s\n", e.what());
    return 1;
  }
}
