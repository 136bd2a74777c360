#pragma once
/// AnyExpertCache<Runtime>, an expert cache whose provider, eviction policy, staging policy and
/// storage are chosen at run time by name: this header includes its parts, any/config.hpp (the
/// choice), any/erased_storage_policy.hpp, any/cache_models.hpp, any/any_expert_cache.hpp (the
/// class) and any/make_expert_cache.hpp (the factory).
//
// Chosen by an engine's config knob and made by
//
//   Result<AnyExpertCache<Runtime>> make_expert_cache(runtime, AnyCacheConfig)
//
// and used like ExpertCache: prepare / prepare_unique / prepare_wide / invalidate / stats, the same
// ForwardView.
// The static templates (ExpertCache, RowCache, WholeExpertCache, DeviceExpertCache) stay the
// primary API; this is a thin wrapper that owns one of them behind one virtual call.
//
// What is erased and what is not: the RUNTIME stays a template parameter. An engine is built
// for one runtime (CudaRuntime in a CUDA engine, SimRuntime in tests), its streams are that
// runtime's streams (cudaStream_t) and it never switches at run time; erasing the stream too
// would cost a cast per call and let a SimRuntime stream reach a CUDA cache. What a config
// file picks (provider, policy, staging, storage, the layout's sizes) is erased, each choice
// behind its own interface so that it costs once, not once per combination: the provider kind
// behind a virtual interface (AnyCacheBase, one model per kind); the eviction policy, the
// staging policy, the storage arrangement and the device policy as values inside the static
// cache (AnyPolicy, AnyStaging, detail::AnyArrangementStorage, detail::AnyDevicePlanExecutor).
// The factory instantiates one host cache and one device cache.
//
// Cost: prepare() is one virtual call into the static cache's prepare() (no allocation; the
// returned ForwardView is the static one's) planning with AnyPolicy, which tells the held
// policy a forward's hits under one dispatch. bench/programs/bench_planner.cpp measures it
// (docs/benchmarks.md).
//
// Compiled mode (docs/any_cache.md): with EXPERT_CACHE_SEPARATE_COMPILATION defined, the
// SimRuntime factory (and, in any/any_cache_cuda.cuh, the CudaRuntime one) is only declared
// (any/make_expert_cache.hpp) and instantiated once, in src/any_cache_sim.cpp (any_cache_cuda.cu).
//
// Names (docs/any_cache.md):
//   provider  row (default: tensor_major + lru + copy_stream, the row provider)
//             cached (expert_major + lfru + copy_stream: vLLM's cached provider's hit/miss
//                     semantics, one transfer per miss; staging "inline" for its inline copies)
//             device (DeviceExpertCache: planned on the device, staging inline only; ids passed
//                     to prepare() are DEVICE memory; needs the runtime's plan executor)
//   policy    lru lfru sieve s3fifo arc wtinylfu lrfu layershare crf   (belady: offline only, refused)
//             device provider: lru lfru crf (DeviceLru / DeviceLfru / DeviceCrf; lfru and crf
//             on storage tensor_major only)
//   staging   inline copy_stream batched   (+ gather with CudaRuntime: include any/any_cache_cuda.cuh)
//   storage   tensor_major expert_major expert_major_host
// An empty policy/staging/storage takes the provider's default. Unknown names, impossible
// combinations and bad sizes are refused by the factory with a Status naming the valid choices;
// nothing is allocated for a refused name.
//
// Caller memory: config.options.memory (StorageMemory: the engine's own host tensors / host pool
// and slot workspace) reaches the storage of every provider unchanged, validated as the static
// cache validates it (a bad span is refused with the static cache's error, nothing allocated).
//
// Host tier: compiles with g++ alone. CUDA translation units include
// expert_cache/any/any_cache_cuda.cuh instead (adds gather and the CUDA device planner) BEFORE any
// use of make_expert_cache<CudaRuntime>.
#include "expert_cache/any/any_expert_cache.hpp"
#include "expert_cache/any/cache_models.hpp"
#include "expert_cache/any/config.hpp"
#include "expert_cache/any/erased_storage_policy.hpp"
#include "expert_cache/any/make_expert_cache.hpp"
