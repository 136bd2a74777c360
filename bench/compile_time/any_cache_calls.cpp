// Compile-time probe (bench/scripts/compile_time.sh): any_cache.cpp's program with static_cache_calls.cpp's
// calls (prepare, a prefetch and a wide forward), its provider chosen at run time.
#include <cstdio>

#include "expert_cache/any/any_cache.hpp"
#include "expert_cache/layout/dense.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

int main(int argc, char** argv) {
  using namespace expert_cache;
  SimRuntime rt;
  AnyCacheConfig c;
  c.provider = argc > 1 ? argv[1] : "cached";
  c.layout = AnyLayout::of(DenseBf16{.hidden = 64, .intermediate = 32});
  c.options.num_experts = 64;
  c.options.capacity = 16;
  c.options.top_k = 8;
  c.max_ids = 64;
  auto made = make_expert_cache(rt, c);
  if (!made.ok()) return 1;
  auto cache = std::move(made.value());
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
