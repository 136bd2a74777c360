#pragma once
// GPU test helpers shared by the CUDA cache tests (tests/gpu/test_cache_cuda.cu,
// test_wide_cuda.cu): a finite GPU delay, and the per-tensor views and word weights their
// checksum consumers sum a slot's bytes with (a wrong slot, a stale fill or a missing map entry
// changes the sum).
#if !defined(__CUDACC__)
#error "tests/support/slot_checksum.cuh needs nvcc"
#endif

#include <cstddef>

#include "expert_cache/base/tensor_bytes.hpp"

namespace test_support {
namespace {  // each test program is one translation unit with its own copies

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A finite GPU delay: keeps the stream (and the graph it is part of) busy for `ns`.
__global__ void spin_kernel(unsigned long long ns) {
  const unsigned long long t0 = global_ns();
  while (global_ns() - t0 < ns) {
  }
}

// One tensor of a slot buffer (base, stride per slot, bytes per expert).
struct TensorRef {
  const unsigned char* base = nullptr;
  unsigned long long stride = 0;
  unsigned long long bytes = 0;
};
struct TensorRefs {
  TensorRef t[expert_cache::num_expert_tensors];
};

// The weight of word i of tensor `tensor` in a checksum.
__host__ __device__ inline unsigned long long word_weight(std::size_t tensor, unsigned long long i) {
  return i * 2654435761ull + tensor * 0x9E3779B97F4A7C15ull + 1;
}

}  // namespace
}  // namespace test_support
