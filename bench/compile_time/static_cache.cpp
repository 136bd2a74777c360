// Compile-time probe (bench/scripts/compile_time.sh): a static WholeExpertCache on SimRuntime, prepared once.
#include <cstdio>

#include "expert_cache/expert_cache.hpp"
#include "expert_cache/layout/dense.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

int main() {
  using namespace expert_cache;
  SimRuntime rt;
  CacheOptions o;
  o.num_experts = 64;
  o.capacity = 16;
  o.top_k = 8;
  WholeExpertCache<SimRuntime, DenseBf16> cache(rt, o, DenseBf16{.hidden = 64, .intermediate = 32});
  const SimRuntime::Stream s = rt.create_stream().value();
  const int ids[] = {1, 2, 3, 4, 5, 6, 7, 8};
  const auto view = cache.prepare(ids, s);
  std::printf("%s %u\n", view.ok() ? "ok" : "failed", view.ok() ? view.value().misses : 0u);
  return view.ok() ? 0 : 1;
}
