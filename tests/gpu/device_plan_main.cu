// doctest main of test_gpu_device_plan: exits 77 (Meson's SKIP) only when there is no CUDA
// device: cudaErrorNoDevice, zero devices, or no driver installed at all (a machine without a
// GPU has no libcuda.so.1, and the runtime then reports cudaErrorInsufficientDriver). Any other
// CUDA error is a failure, also an insufficient driver that IS installed, so a broken driver or
// runtime on a GPU machine cannot pass as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <dlfcn.h>

#include <cstdio>

namespace {
bool driver_installed() {
  void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (h == nullptr) return false;
  dlclose(h);
  return true;
}
}  // namespace

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorNoDevice || (err == cudaSuccess && count == 0) ||
      (err == cudaErrorInsufficientDriver && !driver_installed())) {
    std::printf("SKIP: no CUDA device (%s)\n",
                err == cudaSuccess ? "0 devices"
                : err == cudaErrorNoDevice ? cudaGetErrorName(err)
                                           : "no CUDA driver installed (libcuda.so.1 not found)");
    return 77;
  }
  if (err != cudaSuccess) {
    std::printf("FAIL: cudaGetDeviceCount: %s: %s\n", cudaGetErrorName(err), cudaGetErrorString(err));
    return 1;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    std::printf("GPU 0: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  }
  doctest::Context context(argc, argv);
  return context.run();
}
