// doctest main of the GPU suite: exits 77 (Meson's SKIP) when no CUDA device is usable, so the
// suite builds and "passes as skipped" on machines without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdio>

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::printf("SKIP: no CUDA device (%s)\n", err == cudaSuccess ? "0 devices" : cudaGetErrorString(err));
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    std::printf("GPU 0: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  }
  doctest::Context context(argc, argv);
  return context.run();
}
