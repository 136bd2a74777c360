// Consumer of an installed expert_cache through pkg-config (expert_cache.pc): the host tier on
// SimRuntime (no GPU). One forward's experts are made resident, then the same forward hits.
#include <cstdio>
#include <vector>

#include "expert_cache/expert_cache.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

namespace ec = expert_cache;

int main() {
  ec::SimRuntime rt;
  const auto stream = rt.create_stream().value();
  const ec::ExplicitLayout layout{{{{"w13", 4096}, {"w2", 2048}}}};  // bytes per expert per tensor
  ec::CacheOptions options;
  options.num_experts = 16;
  options.capacity = 4;
  options.top_k = 2;
  ec::RowCache<ec::SimRuntime, ec::ExplicitLayout> cache(rt, options, layout);

  const std::vector<std::int32_t> ids{3, 7};
  auto first = cache.prepare(ids, stream);
  if (!first.ok()) {
    std::fprintf(stderr, "prepare failed: %s\n", first.status().to_string().c_str());
    return 1;
  }
  const bool cold = first.value().misses == 2 && first.value().hits == 0;
  auto second = cache.prepare(ids, stream);
  const bool warm = second.ok() && second.value().hits == 2 && second.value().misses == 0;
  rt.drain();
  std::printf("expert_cache %s: first prepare %u misses, second %u hits, races %llu\n", EXPERT_CACHE_VERSION,
              first.value().misses, second.ok() ? second.value().hits : 0U,
              static_cast<unsigned long long>(rt.race_count()));
  return cold && warm && rt.race_count() == 0 ? 0 : 1;
}
