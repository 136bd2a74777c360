// Compile-time probe (bench/scripts/compile_time.sh --cuda): the same program with its provider chosen at run time.
// Also a test of the header-only mode on CudaRuntime (tests/meson.build: any_cache_cuda_header_only_*).
#include <cstdio>
#include <span>
#include <string>

#include "expert_cache/any/any_cache_cuda.cuh"
#include "expert_cache/layout/dense.hpp"

int main(int argc, char** argv) {
  using namespace expert_cache;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  CudaRuntime rt;
  AnyCacheConfig c;
  c.provider = argc > 1 ? argv[1] : "cached";
  c.layout = AnyLayout::of(DenseBf16{.hidden = 64, .intermediate = 32});
  c.options.num_experts = 64;
  c.options.capacity = 16;
  c.options.top_k = 8;
  c.max_ids = 64;
  auto made = make_expert_cache(rt, c);
  if (!made.ok()) {
    std::printf("make_expert_cache: %s\n", made.status().to_string().c_str());
    return 1;
  }
  auto cache = std::move(made.value());
  const int ids[] = {1, 2, 3, 4, 5, 6, 7, 8};
  bool ok = false;
  if (c.provider == "device") {  // the device provider plans ids in device memory; its view counts nothing
    int* device_ids = nullptr;
    if (cudaMalloc(&device_ids, sizeof ids) != cudaSuccess) return 1;
    ok = cudaMemcpy(device_ids, ids, sizeof ids, cudaMemcpyHostToDevice) == cudaSuccess &&
         cache.prepare(std::span<const int>(device_ids, 8), cudaStreamPerThread).ok() &&
         cudaStreamSynchronize(cudaStreamPerThread) == cudaSuccess && cache.take_errors() == 0;
    cudaFree(device_ids);
  } else {
    const auto view = cache.prepare(ids, cudaStreamPerThread);
    ok = view.ok() && view.value().misses == 8 && cudaStreamSynchronize(cudaStreamPerThread) == cudaSuccess;
  }
  std::printf("%s provider: %s\n", std::string(cache.provider()).c_str(), ok ? "ok" : "failed");
  return ok ? 0 : 1;
}
