#pragma once
/// Compiler configuration shared by host and device code.
// Self-contained: includes only base/version.hpp (the C++20 check and the version macros).
#include "expert_cache/base/version.hpp"

// Functions that both the host reference and the CUDA kernels call (index maps, encodes).
// Under nvcc they are compiled for both sides; under a plain host compiler the macro is empty,
// so the same headers build with g++ alone.
#if defined(__CUDACC__)
#define EXPERT_CACHE_HOST_DEVICE __host__ __device__
#else
#define EXPERT_CACHE_HOST_DEVICE
#endif

// ---- kernel linkage ---------------------------------------------------------------------------
// Device code (everything in expert_cache::device, kernels and their launchers) lives in an inline
// namespace named after the architectures the translation unit is compiled for, as CCCL does:
// two objects built for different -arch lists (a library compiled for sm_80 linked with one for
// sm_90) then define different symbols, so the linker never merges a launcher or a kernel stub of
// one build into the other (which would launch code the device may not have). Spelled from
// nvcc's __CUDA_ARCH_LIST__ (the same in host and device passes, unlike __CUDA_ARCH__), e.g.
// `sm_900` or `sm_800_900`; `sm_unknown` where the compiler does not define it.
#define EXPERT_CACHE_PP_CAT_(a, b) a##b
#define EXPERT_CACHE_PP_CAT(a, b) EXPERT_CACHE_PP_CAT_(a, b)
#define EXPERT_CACHE_PP_COUNT_(_1, _2, _3, _4, _5, _6, _7, _8, n, ...) n
#define EXPERT_CACHE_PP_COUNT(...) EXPERT_CACHE_PP_COUNT_(__VA_ARGS__, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define EXPERT_CACHE_ARCH_NS_1(a) sm_##a
#define EXPERT_CACHE_ARCH_NS_2(a, b) sm_##a##_##b
#define EXPERT_CACHE_ARCH_NS_3(a, b, c) sm_##a##_##b##_##c
#define EXPERT_CACHE_ARCH_NS_4(a, b, c, d) sm_##a##_##b##_##c##_##d
#define EXPERT_CACHE_ARCH_NS_5(a, b, c, d, e) sm_##a##_##b##_##c##_##d##_##e
#define EXPERT_CACHE_ARCH_NS_6(a, b, c, d, e, f) sm_##a##_##b##_##c##_##d##_##e##_##f
#define EXPERT_CACHE_ARCH_NS_7(a, b, c, d, e, f, g) sm_##a##_##b##_##c##_##d##_##e##_##f##_##g
#define EXPERT_CACHE_ARCH_NS_8(a, b, c, d, e, f, g, h) sm_##a##_##b##_##c##_##d##_##e##_##f##_##g##_##h
#define EXPERT_CACHE_ARCH_NS_FROM_(...) EXPERT_CACHE_PP_CAT(EXPERT_CACHE_ARCH_NS_, EXPERT_CACHE_PP_COUNT(__VA_ARGS__))(__VA_ARGS__)
#if defined(__CUDA_ARCH_LIST__)
#define EXPERT_CACHE_ARCH_NS EXPERT_CACHE_ARCH_NS_FROM_(__CUDA_ARCH_LIST__)
#else
#define EXPERT_CACHE_ARCH_NS sm_unknown
#endif

// The device headers open it as `namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS`.

// Every kernel of the library: hidden visibility (as CUB's kernel attributes), so a shared
// library built from these headers neither exports its kernel stubs nor binds to another
// library's copy of the same kernel. Kernels in headers are also templates (a non-template
// __global__ defined in a header is a second definition in every other translation unit).
#if defined(__GNUC__) || defined(__clang__)
#define EXPERT_CACHE_KERNEL __global__ __attribute__((visibility("hidden")))
#else
#define EXPERT_CACHE_KERNEL __global__
#endif
