// The run-time-selected cache from an installed expert_cache through CMake, built twice by
// CMakeLists.txt: header-only (expert_cache::expert_cache) and in the compiled mode
// (expert_cache::any_cache plus the one instantiation source, docs/any_cache.md). The provider
// comes from the command line, as an engine's config would pick it.
#include <cstdio>
#include <string>
#include <vector>

#include "expert_cache/any/any_cache.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

namespace ec = expert_cache;

int main(int argc, char** argv) {
  ec::SimRuntime rt;
  const auto stream = rt.create_stream().value();
  ec::AnyCacheConfig config;
  config.provider = argc > 1 ? argv[1] : "cached";
  config.policy = argc > 2 ? argv[2] : "";
  config.layout = ec::AnyLayout::explicit_bytes(ec::ExplicitLayout{{{{"w13", 4096}, {"w2", 2048}}}}.tensors());
  config.options.num_experts = 16;
  config.options.capacity = 4;
  config.options.top_k = 2;
  auto made = ec::make_expert_cache(rt, config);
  if (!made.ok()) {
    std::fprintf(stderr, "make_expert_cache: %s\n", made.status().to_string().c_str());
    return 1;
  }
  auto cache = std::move(made.value());
  const std::vector<std::int32_t> ids{3, 7};
  auto first = cache.prepare(ids, stream);
  auto second = cache.prepare(ids, stream);
  rt.drain();
  const bool ok = first.ok() && second.ok() && first.value().misses == 2 && second.value().hits == 2;
  std::printf("expert_cache %s: %s provider, %s policy: first prepare %u misses, second %u hits, races %llu\n",
              EXPERT_CACHE_VERSION, std::string(cache.provider()).c_str(), std::string(cache.policy()).c_str(),
              first.ok() ? first.value().misses : 0U, second.ok() ? second.value().hits : 0U,
              static_cast<unsigned long long>(rt.race_count()));
  return ok && rt.race_count() == 0 ? 0 : 1;
}
