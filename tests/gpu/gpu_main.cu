// doctest main of every GPU test program. Exits 77 (Meson's SKIP) only when the machine has no
// CUDA device: cudaErrorNoDevice, a device count of 0, or cudaErrorInsufficientDriver where no
// driver is installed at all (no libcuda.so.1: the runtime then reports an insufficient driver,
// which on a machine without a GPU is the normal state). Any other CUDA error (an installed
// driver too old for this runtime, a device that cannot be initialised) FAILS with the library's
// message: a broken installation must not pass as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <dlfcn.h>

#include <cstdio>

#include "expert_cache/runtime/cuda_error.hpp"

namespace {

bool driver_installed() {
  void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (h == nullptr) return false;
  dlclose(h);
  return true;
}

int skip(const char* why) {
  std::printf("SKIP: no CUDA device (%s)\n", why);
  return 77;
}

}  // namespace

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorNoDevice) return skip(cudaGetErrorName(err));
  if (err == cudaErrorInsufficientDriver && !driver_installed())
    return skip("no CUDA driver installed: libcuda.so.1 not found");
  if (err == cudaSuccess && count == 0) return skip("0 devices");
  if (const expert_cache::Status s = expert_cache::cuda_status(err, "cudaGetDeviceCount"); !s) {
    std::fprintf(stderr, "FAIL: CUDA is installed but unusable: %.*s\n", static_cast<int>(s.message().size()),
                 s.message().data());
    return 1;
  }
  cudaDeviceProp prop{};
  if (const expert_cache::Status s = expert_cache::cuda_status(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
      !s) {
    std::fprintf(stderr, "FAIL: %.*s\n", static_cast<int>(s.message().size()), s.message().data());
    return 1;
  }
  std::printf("GPU 0: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  doctest::Context context(argc, argv);
  return context.run();
}
