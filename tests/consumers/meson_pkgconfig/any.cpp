// Consumer of an installed expert_cache through pkg-config: the run-time-selected cache in the
// compiled mode (make_expert_cache instantiated once, in the package's any_cache_source).
#include <cstdio>
#include <string>
#include <vector>

#include "expert_cache/any/any_cache.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

namespace ec = expert_cache;

int main() {
  ec::SimRuntime rt;
  const auto stream = rt.create_stream().value();
  ec::AnyCacheConfig config;
  config.provider = "row";
  config.policy = "sieve";
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
  std::printf("compiled mode: %s/%s, first prepare %u misses, second %u hits, races %llu\n",
              std::string(cache.provider()).c_str(), std::string(cache.policy()).c_str(),
              first.ok() ? first.value().misses : 0U, second.ok() ? second.value().hits : 0U,
              static_cast<unsigned long long>(rt.race_count()));
  return ok && rt.race_count() == 0 ? 0 : 1;
}
