#pragma once
// CUDA layer of the test support (nvcc or g++ + CUDA's include directory, with doctest):
//  * REQUIRE_CUDA_OK(expr): the one check of a CUDA call in the tests; on failure it stops the
//    test case with the library's own message (cuda_status: "<call> failed: <name>: <text>").
//  * DeviceBuffer<T> / PinnedBuffer<T>: `n` elements of T in device / pinned host memory, owned
//    through the library's RuntimeBuffer on a CudaRuntime (the allocations the cache itself
//    makes), so a test exercises the same allocation and error path as the library.
// The GPU programs' main (SKIP only without a device) is tests/gpu/gpu_main.cu.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "expert_cache/cuda.hpp"

#define REQUIRE_CUDA_OK(expr)                                                                      \
  do {                                                                                             \
    const ::expert_cache::Status expert_cache_test_status_ = ::expert_cache::cuda_status((expr), #expr); \
    REQUIRE_MESSAGE(expert_cache_test_status_.ok(), std::string(expert_cache_test_status_.message())); \
  } while (0)

namespace test_support {

// The runtime every support buffer allocates through; constructing it touches no CUDA API.
inline expert_cache::CudaRuntime& cuda_runtime() {
  static expert_cache::CudaRuntime rt;
  return rt;
}

// `n` elements of T in memory of `Kind`, owned by a RuntimeBuffer (at least one byte is
// allocated, so get() is a valid address even for n == 0).
template <class T, expert_cache::MemoryKind Kind>
class RuntimeArray {
 public:
  explicit RuntimeArray(std::size_t n) : buffer_(cuda_runtime(), std::max<std::size_t>(n, 1) * sizeof(T), Kind), n_(n) {}
  [[nodiscard]] T* get() const noexcept { return reinterpret_cast<T*>(buffer_.data()); }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return n_ * sizeof(T); }

 private:
  expert_cache::RuntimeBuffer<expert_cache::CudaRuntime> buffer_;
  std::size_t n_;
};

template <class T = std::byte>
class DeviceBuffer : public RuntimeArray<T, expert_cache::MemoryKind::device> {
 public:
  explicit DeviceBuffer(std::size_t n) : RuntimeArray<T, expert_cache::MemoryKind::device>(n) {}
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  void upload(const std::vector<T>& host) const {
    REQUIRE(host.size() == this->size());
    REQUIRE_CUDA_OK(cudaMemcpy(this->get(), host.data(), this->bytes(), cudaMemcpyHostToDevice));
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> host(this->size());
    REQUIRE_CUDA_OK(cudaMemcpy(host.data(), this->get(), this->bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  template <class U>
  [[nodiscard]] U* as() const noexcept {
    return reinterpret_cast<U*>(this->get());
  }
};

// Pinned and mapped (CudaRuntime's pinned_host kind): kernels may read it through device_ptr().
template <class T = std::byte>
class PinnedBuffer : public RuntimeArray<T, expert_cache::MemoryKind::pinned_host> {
 public:
  explicit PinnedBuffer(std::size_t n) : RuntimeArray<T, expert_cache::MemoryKind::pinned_host>(n) {}
  [[nodiscard]] std::span<T> span() const noexcept { return {this->get(), this->size()}; }
  [[nodiscard]] std::vector<T> vec() const { return {this->get(), this->get() + this->size()}; }
  void fill_from(const std::vector<T>& v) const {
    REQUIRE(v.size() == this->size());
    std::copy(v.begin(), v.end(), this->get());
  }
  // The device address of the mapped buffer (zero-copy reads by kernels).
  [[nodiscard]] const T* device_ptr() const {
    auto p = cuda_runtime().device_pointer(this->get());
    REQUIRE_MESSAGE(p.ok(), std::string(p.status().message()));
    return static_cast<const T*>(p.value());
  }
};

// Loads kernels now, as an engine does before its first step: with lazy module loading (the
// CUDA default) a kernel's first launch loads it and may wait for the device, which a waiting
// copy-engine fill then holds until its bounded wait gives up.
template <class... Kernels>
void load_kernels(Kernels... kernels) {
  const auto load = [](const void* k) {
    cudaFuncAttributes a{};
    REQUIRE_CUDA_OK(cudaFuncGetAttributes(&a, k));
  };
  (load(reinterpret_cast<const void*>(kernels)), ...);
}

}  // namespace test_support
