#pragma once
/// The runtime interface: the only way the library touches streams, events and asynchronous copies.
// Shaped after the CUDA runtime API (cudaStream_t, cudaEvent_t without timing, cudaEventRecord,
// cudaStreamWaitEvent, cudaMemcpyAsync) so a CudaRuntime is a thin wrapper;
// SimRuntime (sim_runtime.hpp) is the deterministic host model with a race detector.
//
// This header gathers the vocabulary (runtime_types.hpp) and the `runtime` concept, which
// lives with every other concept in expert_cache/base/concepts.hpp. Host-only, no CUDA includes.
#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/runtime_types.hpp"
#include "expert_cache/base/status.hpp"
