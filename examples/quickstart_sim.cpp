// docs/quickstart.md, part 1: the host tier on SimRuntime (a host model of a GPU: no device,
// no CUDA). Built and run by examples/meson.build, so the quickstart cannot rot; the quickstart
// shows the region between the [quickstart_sim] markers (tests/headers/check_doc_snippets.py).
// [quickstart_sim]
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <vector>

#include "expert_cache/expert_cache.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

namespace ec = expert_cache;

int main() {
  ec::SimRuntime rt;
  const auto stream = rt.create_stream().value();

  // Bytes per expert of each tensor (real models: ec::Nvfp4Marlin or ec::DenseBf16).
  const ec::ExplicitLayout layout{{{{"w13", 1024}, {"w2", 512}}}};
  ec::CacheOptions options;
  options.num_experts = 32;  // experts of this layer
  options.capacity = 8;      // GPU slots
  options.top_k = 4;         // ids per token
  ec::RowCache<ec::SimRuntime, ec::ExplicitLayout> cache(rt, options, layout);

  // All experts live in the cache's pinned host storage: write each one's weights once.
  for (std::int32_t e = 0; e < options.num_experts; ++e) {
    std::memset(cache.storage().host_tensor(0, e), e + 1, 1024);  // w13
    std::memset(cache.storage().host_tensor(1, e), e + 1, 512);   // w2
  }

  // Before each MoE forward: its routed ids (duplicates are fine) -> resident experts.
  const std::vector<std::int32_t> topk_ids{5, 9, 5, 17};
  const auto view = cache.prepare(topk_ids, stream);
  if (!view.ok()) {
    std::fprintf(stderr, "prepare failed: %s\n", view.status().to_string().c_str());
    return 1;
  }
  rt.drain();  // on a GPU: the MoE kernel, enqueued on `stream`, reads the slots

  // expert_map: global expert id -> slot (-1 = not in this forward); the slot holds the weights.
  const ec::ForwardView& v = view.value();
  const std::int32_t slot = v.expert_map[9];
  const std::byte* w13 = v.tensor(ec::ExpertTensor::w13).slot(slot);
  std::printf("hits %u, misses %u; expert 9 in slot %d, first w13 byte %d; expert 0 -> %d\n", v.hits, v.misses, slot,
              static_cast<int>(w13[0]), v.expert_map[0]);
  return v.misses == 3 && w13[0] == std::byte{10} && v.expert_map[0] == -1 && rt.race_count() == 0 ? 0 : 1;
}
// [quickstart_sim]
