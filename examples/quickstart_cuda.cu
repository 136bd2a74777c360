// docs/quickstart.md, part 2: the same on a GPU with CudaRuntime, and a kernel that reads an
// expert through expert_map. Built by examples/meson.build with warnings as errors; run in the
// 'gpu' suite (exit 77, skip, without a CUDA device). The quickstart shows the region between the
// [quickstart_cuda] markers (tests/headers/check_doc_snippets.py).
// [quickstart_cuda]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "expert_cache/cuda.hpp"

namespace ec = expert_cache;

// Stand-in for the MoE kernel: the first w13 byte of `expert`, found through the expert map.
__global__ void first_w13_byte(const std::int32_t* expert_map, ec::SlotTensor w13, std::int32_t expert, int* out) {
  const std::int32_t slot = expert_map[expert];
  *out = slot < 0 ? -1 : static_cast<int>(w13.base[static_cast<std::size_t>(slot) * w13.slot_stride]);
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  try {
    ec::CudaRuntime rt;
    cudaStream_t stream = nullptr;  // the engine's compute stream
    if (cudaStreamCreate(&stream) != cudaSuccess) return 1;

    const ec::ExplicitLayout layout{{{{"w13", 1024}, {"w2", 512}}}};
    ec::CacheOptions options;
    options.num_experts = 32;
    options.capacity = 8;
    options.top_k = 4;
    ec::CudaRowCache<ec::ExplicitLayout> cache(rt, options, layout);  // pinned host pools, GPU slots
    for (std::int32_t e = 0; e < options.num_experts; ++e) {
      std::memset(cache.storage().host_tensor(0, e), e + 1, 1024);
      std::memset(cache.storage().host_tensor(1, e), e + 1, 512);
    }

    const std::vector<std::int32_t> topk_ids{5, 9, 5, 17};
    const auto view = cache.prepare(topk_ids, stream);  // copies are ordered before `stream`'s next work
    if (!view.ok()) {
      std::fprintf(stderr, "prepare failed: %s\n", view.status().to_string().c_str());
      return 1;
    }
    int* out = nullptr;
    if (cudaMallocManaged(&out, sizeof(int)) != cudaSuccess) return 1;
    first_w13_byte<<<1, 1, 0, stream>>>(view.value().expert_map, view.value().tensor(ec::ExpertTensor::w13), 9, out);
    if (cudaStreamSynchronize(stream) != cudaSuccess) return 1;
    std::printf("hits %u, misses %u; expert 9's first w13 byte on the GPU: %d\n", view.value().hits,
                view.value().misses, *out);
    const bool ok = *out == 10;
    (void)cudaFree(out);
    (void)cudaStreamDestroy(stream);
    return ok ? 0 : 1;
  } catch (const ec::Error& e) {  // constructors throw on bad options or a failed allocation
    std::fprintf(stderr, "expert_cache: %s\n", e.what());
    return 1;
  }
}
// [quickstart_cuda]
