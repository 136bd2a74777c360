#pragma once
// The same-run pinned host -> device ceiling every GPU benchmark divides by: copies of one large
// pinned buffer to device memory on the caller's stream, each timed with events, after one
// warm-up copy. Part of the benchmarks, not a public header.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <utility>
#include <vector>

#include "expert_cache/cuda.hpp"

namespace expert_cache::bench {

// Bytes per second of each of `copies` copies of `bytes` (after a warm-up copy not counted).
[[nodiscard]] inline Result<std::vector<double>> pinned_copy_rates(cudaStream_t stream, std::size_t bytes, int copies) {
  struct Resources {
    void* host = nullptr;
    void* dev = nullptr;
    cudaEvent_t a = nullptr, b = nullptr;
    ~Resources() {
      if (a != nullptr) cudaEventDestroy(a);
      if (b != nullptr) cudaEventDestroy(b);
      if (dev != nullptr) cudaFree(dev);
      if (host != nullptr) cudaFreeHost(host);
    }
  } r;
  if (Status s = cuda_status(cudaHostAlloc(&r.host, bytes, cudaHostAllocDefault), "cudaHostAlloc(ceiling)"); !s) return s;
  if (Status s = cuda_status(cudaMalloc(&r.dev, bytes), "cudaMalloc(ceiling)"); !s) return s;
  std::memset(r.host, 1, bytes);
  if (Status s = cuda_status(cudaEventCreate(&r.a), "cudaEventCreate"); !s) return s;
  if (Status s = cuda_status(cudaEventCreate(&r.b), "cudaEventCreate"); !s) return s;
  std::vector<double> rates;
  for (int i = 0; i <= copies; ++i) {
    if (Status s = cuda_status(cudaEventRecord(r.a, stream), "cudaEventRecord"); !s) return s;
    if (Status s = cuda_status(cudaMemcpyAsync(r.dev, r.host, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync(ceiling)"); !s)
      return s;
    if (Status s = cuda_status(cudaEventRecord(r.b, stream), "cudaEventRecord"); !s) return s;
    if (Status s = cuda_status(cudaEventSynchronize(r.b), "cudaEventSynchronize"); !s) return s;
    float ms = 0;
    if (Status s = cuda_status(cudaEventElapsedTime(&ms, r.a, r.b), "cudaEventElapsedTime"); !s) return s;
    if (i > 0) rates.push_back(static_cast<double>(bytes) / (static_cast<double>(ms) * 1e-3));
  }
  return rates;
}

// The median of pinned_copy_rates.
[[nodiscard]] inline Result<double> pinned_ceiling_median(cudaStream_t stream, std::size_t bytes, int copies) {
  Result<std::vector<double>> r = pinned_copy_rates(stream, bytes, copies);
  if (!r.ok()) return r.status();
  std::vector<double> v = std::move(r.value());
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace expert_cache::bench
