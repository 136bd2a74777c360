#pragma once
// Failure checks of the GPU benchmarks' set-up code: a failed CUDA call or library Status prints
// what failed and ends the program (exit 1), so no timing is taken from a broken set-up.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "expert_cache/base/status.hpp"

#define BENCH_CUDA(call)                                                                \
  do {                                                                                  \
    const cudaError_t err_ = (call);                                                    \
    if (err_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(err_));         \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

#define BENCH_OK(status_expr)                                                                     \
  do {                                                                                            \
    const ::expert_cache::Status st_ = (status_expr);                                             \
    if (!st_.ok()) {                                                                              \
      std::fprintf(stderr, "%s failed: %s\n", #status_expr, std::string(st_.message()).c_str()); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)
