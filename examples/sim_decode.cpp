// Builds the row and whole-expert caches on SimRuntime (the host model of a GPU), replays a
// generated decode trace through both and prints their stats. Runs anywhere, no GPU needed.
// Registered as a test: exits non-zero when a prepare fails or the race detector reports.
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "expert_cache/expert_cache.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

using namespace expert_cache;

namespace {

constexpr std::int32_t num_experts = 64;
constexpr std::int32_t top_k = 6;
constexpr std::int32_t capacity = 16;
constexpr int steps = 2000;

// Decode routing with temporal locality: each token reuses some of the previous token's
// experts and draws the rest from a skewed popularity.
std::vector<std::vector<std::int32_t>> generate_trace(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> weight(num_experts);
  for (std::int32_t e = 0; e < num_experts; ++e) weight[static_cast<std::size_t>(e)] = 1.0 / (1.0 + e);
  std::shuffle(weight.begin(), weight.end(), rng);
  std::discrete_distribution<std::int32_t> popular(weight.begin(), weight.end());
  std::vector<std::vector<std::int32_t>> trace;
  std::vector<std::int32_t> previous;
  for (int s = 0; s < steps; ++s) {
    std::vector<std::int32_t> ids;
    for (std::int32_t e : previous) {
      if (rng() % 2 == 0) ids.push_back(e);
    }
    while (static_cast<std::int32_t>(ids.size()) < top_k) {
      const std::int32_t e = popular(rng);
      if (std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
    }
    trace.push_back(ids);
    previous = ids;
  }
  return trace;
}

// True when every prepare succeeded and the run was race-free.
template <class Cache>
bool replay(const char* title, const std::vector<std::vector<std::int32_t>>& trace) {
  SimRuntime rt;
  const auto stream = rt.create_stream().value();
  // A small layout so the example runs instantly; real use passes Nvfp4Marlin or DenseBf16.
  const ExplicitLayout layout{{{{"w13", 4096}, {"w2", 2048}, {"w13_scale", 512}, {"w2_scale", 256},
                                {"w13_scale_2", 4}, {"w2_scale_2", 4}}}};
  CacheOptions options;
  options.num_experts = num_experts;
  options.capacity = capacity;
  options.top_k = top_k;
  options.label = title;
  Cache cache(rt, options, layout);
  for (const auto& ids : trace) {
    auto view = cache.prepare(ids, stream);
    if (!view.ok()) {
      std::fprintf(stderr, "%s: prepare failed: %s\n", title, view.status().to_string().c_str());
      return false;
    }
    rt.run_random(view.value().generation, 64);  // the simulated GPU makes some progress
  }
  rt.drain();
  const CacheStats s = cache.stats();
  std::printf("%-13s hit rate %5.1f%%  hits %6llu  misses %6llu  evictions %6llu  copies %7llu  map uploads %5llu  races %zu\n",
              title, 100.0 * s.hit_rate(), static_cast<unsigned long long>(s.hits),
              static_cast<unsigned long long>(s.misses), static_cast<unsigned long long>(s.evictions),
              static_cast<unsigned long long>(s.total_copies), static_cast<unsigned long long>(s.map_uploads),
              rt.races().size());
  if (rt.race_count() != 0) {
    std::fprintf(stderr, "%s: %llu race(s) reported, first: %s\n", title,
                 static_cast<unsigned long long>(rt.race_count()),
                 rt.races().empty() ? "(dropped)" : rt.races()[0].description.c_str());
    return false;
  }
  return true;
}

}  // namespace

int main() {
  const auto trace = generate_trace(2026);
  std::printf("decode trace: %d steps, %d experts, top-%d, %d slots\n", steps, num_experts, top_k, capacity);
  // Both run even when the first fails, so one failing run does not hide the other's result.
  const bool row_ok = replay<RowCache<SimRuntime, ExplicitLayout>>("row", trace);
  const bool whole_ok = replay<WholeExpertCache<SimRuntime, ExplicitLayout>>("whole-expert", trace);
  return row_ok && whole_ok ? 0 : 1;
}
