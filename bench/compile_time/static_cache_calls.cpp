// Compile-time probe (bench/scripts/compile_time.sh): the static WholeExpertCache of static_cache.cpp,
// with a prefetch and a wide forward beside the prepare (what an engine with lookahead and
// prompts calls).
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
  const int next[] = {9, 10};
  const auto fetched = cache.prefetch(next, s);
  const auto wide = cache.prepare_wide(ids, s, [](const WideRound&) { return Status{}; });
  const bool ok = view.ok() && fetched.ok() && wide.ok();
  std::printf("%s %u\n", ok ? "ok" : "failed", view.ok() ? view.value().misses : 0u);
  return ok ? 0 : 1;
}
