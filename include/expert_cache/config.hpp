#pragma once
// Compiler configuration shared by host and device code. Self-contained: no includes.

// Functions that both the host reference and the CUDA kernels call (index maps, encodes).
// Under nvcc they are compiled for both sides; under a plain host compiler the macro is empty,
// so the same headers build with g++ alone.
#if defined(__CUDACC__)
#define EXPERT_CACHE_HOST_DEVICE __host__ __device__
#else
#define EXPERT_CACHE_HOST_DEVICE
#endif
