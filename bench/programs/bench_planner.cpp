// Planner + eviction policy micro-benchmarks, and a hit-rate table mode.
//
//   bench_planner [google-benchmark flags]        time one decode forward per policy
//   bench_planner --hit_rates=FILE.trace           per-layer hit rates at 8/16/32 slots
//   bench_planner --hit_rates_synthetic            same on generated traces with locality
//
// Timing setup: E = 512 experts, capacity = 208 slots, 10 unique ids per forward (a decode
// step). "cold" cycles through a fixed permutation of all 512 ids, so LRU-like policies
// miss on every id after warm-up; "warm" draws ids from a Zipf-like law (mostly hits).
// The counters report the measured hit rate and heap allocations per forward (must be 0).
// BM_plan_forward_global: the same id space, capacity and forward width as one global pool
// over 8 layers x 64 experts (ids layer*64 + e, forwards visiting the layers in order, as
// the replay tool's --scope global), the layer-aware policies given PoolLayout{64}.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ctime>

#include "expert_cache/any/any_cache.hpp"  // type-erased cache overhead cases
#include "expert_cache/eviction/all.hpp"
#include "expert_cache/eviction/make_policy.hpp"
#include "expert_cache/expert_cache.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

#include "../../tests/support/allocation_counter.hpp"  // the one TU of this program that replaces operator new

using expert_cache::test::g_allocations;

namespace {

using namespace expert_cache;

using Forwards = std::vector<std::vector<std::int32_t>>;

// Deterministic across standard libraries (std distributions are not).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : engine_(seed) {}
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }
  std::int32_t below(std::int32_t n) { return static_cast<std::int32_t>(uniform() * n); }
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

// Zipf-like sampler over ranks 0..n-1 (inverse CDF on a precomputed table).
class Zipf {
 public:
  Zipf(std::int32_t n, double s) : cdf_(static_cast<std::size_t>(n)) {
    double sum = 0.0;
    for (std::int32_t i = 0; i < n; ++i) sum += 1.0 / std::pow(i + 1.0, s);
    double acc = 0.0;
    for (std::int32_t i = 0; i < n; ++i) {
      acc += 1.0 / std::pow(i + 1.0, s) / sum;
      cdf_[static_cast<std::size_t>(i)] = acc;
    }
    cdf_.back() = 1.0;
  }
  std::int32_t operator()(Rng& rng) const {
    const auto it = std::lower_bound(cdf_.begin(), cdf_.end(), rng.uniform());
    return static_cast<std::int32_t>(std::min<std::ptrdiff_t>(it - cdf_.begin(),
                                                              static_cast<std::ptrdiff_t>(cdf_.size()) - 1));
  }

 private:
  std::vector<double> cdf_;
};

std::vector<std::int32_t> permutation(std::int32_t n, Rng& rng) {
  std::vector<std::int32_t> p(static_cast<std::size_t>(n));
  std::iota(p.begin(), p.end(), 0);
  for (std::int32_t i = n - 1; i > 0; --i) std::swap(p[static_cast<std::size_t>(i)], p[static_cast<std::size_t>(rng.below(i + 1))]);
  return p;
}

// ------------------------------------------------------------------------------------------
// Timing benchmarks

constexpr std::int32_t bench_experts = 512;
constexpr std::int32_t bench_capacity = 208;
constexpr std::int32_t bench_ids = 10;
constexpr std::size_t bench_warmup = 4096;
constexpr std::size_t bench_forwards = 1 << 16;

Forwards cold_forwards(std::size_t count) {
  Rng rng(7);
  const auto perm = permutation(bench_experts, rng);
  Forwards out(count);
  std::size_t pos = 0;
  for (auto& f : out) {
    for (std::int32_t j = 0; j < bench_ids; ++j) f.push_back(perm[pos++ % perm.size()]);
  }
  return out;
}

Forwards warm_forwards(std::size_t count) {
  Rng rng(11);
  const auto perm = permutation(bench_experts, rng);
  const Zipf zipf(bench_experts, 1.0);
  Forwards out(count);
  for (auto& f : out) {
    while (static_cast<std::int32_t>(f.size()) < bench_ids) {
      const std::int32_t id = perm[static_cast<std::size_t>(zipf(rng))];
      if (std::find(f.begin(), f.end(), id) == f.end()) f.push_back(id);
    }
  }
  return out;
}

const Forwards& bench_sequence(bool warm) {
  static const Forwards cold = cold_forwards(bench_warmup + bench_forwards);
  static const Forwards hot = warm_forwards(bench_warmup + bench_forwards);
  return warm ? hot : cold;
}

// Global pool: 8 layers x 64 experts = the same 512 ids, 208 slots, 10 ids per
// forward; step-major, layers in order. "cold": each layer cycles through its own
// permutation (512 ids in the cycle > 208 slots: LRU misses every id); "warm": each layer
// draws from its own Zipf(1.0) over its 64 experts.
constexpr std::int32_t global_layers = 8;
constexpr std::int32_t global_width = bench_experts / global_layers;

Forwards global_forwards(std::size_t count, bool warm) {
  Rng rng(warm ? 13 : 17);
  std::vector<std::vector<std::int32_t>> perm;
  for (std::int32_t l = 0; l < global_layers; ++l) perm.push_back(permutation(global_width, rng));
  const Zipf zipf(global_width, 1.0);
  std::vector<std::size_t> pos(global_layers, 0);
  Forwards out(count);
  for (std::size_t t = 0; t < count; ++t) {
    const auto l = static_cast<std::size_t>(t % global_layers);
    auto& f = out[t];
    while (static_cast<std::int32_t>(f.size()) < bench_ids) {
      const std::int32_t e = warm ? perm[l][static_cast<std::size_t>(zipf(rng))] : perm[l][pos[l]++ % perm[l].size()];
      const std::int32_t id = static_cast<std::int32_t>(l) * global_width + e;
      if (std::find(f.begin(), f.end(), id) == f.end()) f.push_back(id);
    }
  }
  return out;
}

const Forwards& global_sequence(bool warm) {
  // bench_warmup and bench_forwards are multiples of global_layers: a wrap restarts at layer 0.
  static_assert(bench_warmup % global_layers == 0 && bench_forwards % global_layers == 0);
  static const Forwards cold = global_forwards(bench_warmup + bench_forwards, false);
  static const Forwards hot = global_forwards(bench_warmup + bench_forwards, true);
  return warm ? hot : cold;
}

template <class P, bool Global>
void plan_forward(benchmark::State& state) {
  const bool warm = state.range(0) != 0;
  const Forwards& seq = Global ? global_sequence(warm) : bench_sequence(warm);
  const CacheShape shape{bench_experts, bench_capacity};
  // Flatten so the timed loop only reads contiguous ids.
  std::vector<std::int32_t> flat;
  for (const auto& f : seq) flat.insert(flat.end(), f.begin(), f.end());
  const auto span_of = [&](std::size_t t) {
    return std::span<const std::int32_t>(flat.data() + t * bench_ids, bench_ids);
  };

  std::unique_ptr<ForwardPlanner<P>> planner;
  ForwardPlan plan;  // caller-owned; sized once so the timed loop never grows it
  plan.unique.reserve(bench_capacity);
  plan.fills.reserve(bench_capacity);
  plan.evictions.reserve(bench_capacity);
  std::size_t t = 0;
  const auto reset = [&] {
    if constexpr (Global) {
      planner = std::make_unique<ForwardPlanner<P>>(shape, bench_ids, make_policy<P>(shape, seq, PoolLayout{global_width}));
    } else {
      planner = std::make_unique<ForwardPlanner<P>>(shape, bench_ids, make_policy<P>(shape, seq));
    }
    for (t = 0; t < bench_warmup; ++t) (void)planner->plan_unique(span_of(t), plan);
  };
  reset();

  std::uint64_t hits = 0, misses = 0;
  const std::uint64_t allocs_before = g_allocations.load(std::memory_order_relaxed);
  std::uint64_t reset_allocs = 0;
  for (auto _ : state) {
    if (t == seq.size()) {
      // Belady's future ends here; others just wrap. Rare enough not to matter.
      state.PauseTiming();
      const std::uint64_t a = g_allocations.load(std::memory_order_relaxed);
      if constexpr (std::is_same_v<P, Belady>) reset(); else t = bench_warmup;
      reset_allocs += g_allocations.load(std::memory_order_relaxed) - a;
      state.ResumeTiming();
    }
    const Status s = planner->plan_unique(span_of(t), plan);
    benchmark::DoNotOptimize(s.ok());
    benchmark::DoNotOptimize(plan.fills.data());
    hits += plan.hits;
    misses += plan.misses;
    ++t;
  }
  const std::uint64_t allocs = g_allocations.load(std::memory_order_relaxed) - allocs_before - reset_allocs;
  state.counters["hit_rate"] = static_cast<double>(hits) / static_cast<double>(std::max<std::uint64_t>(1, hits + misses));
  state.counters["allocs_per_fwd"] =
      static_cast<double>(allocs) / static_cast<double>(std::max<benchmark::IterationCount>(1, state.iterations()));
}

template <class P>
void BM_plan_forward(benchmark::State& state) { plan_forward<P, false>(state); }
template <class P>
void BM_plan_forward_global(benchmark::State& state) { plan_forward<P, true>(state); }

#define EC_BENCH_POLICY(P)                                                  \
  BENCHMARK_TEMPLATE(BM_plan_forward, P)->ArgName("warm")->Arg(0)->Arg(1)
#define EC_BENCH_POLICY_GLOBAL(P)                                           \
  BENCHMARK_TEMPLATE(BM_plan_forward_global, P)->ArgName("warm")->Arg(0)->Arg(1)

EC_BENCH_POLICY(Lru);
EC_BENCH_POLICY(Lfru);
EC_BENCH_POLICY(Sieve);
EC_BENCH_POLICY(S3Fifo);
EC_BENCH_POLICY(Arc);
EC_BENCH_POLICY(WTinyLfu);
EC_BENCH_POLICY(Lrfu);
EC_BENCH_POLICY(LayerShare);
EC_BENCH_POLICY(Belady);
// Global pool: Lru is the same-run reference; Lrfu and LayerShare get PoolLayout{64}.
EC_BENCH_POLICY_GLOBAL(Lru);
EC_BENCH_POLICY_GLOBAL(Lrfu);
EC_BENCH_POLICY_GLOBAL(LayerShare);

// ------------------------------------------------------------------------------------------
// Type-erased cache overhead: prepare() through AnyExpertCache (provider "row":
// tensor_major + lru + copy_stream) against the static RowCache on SimRuntime, the same
// forwards on twin runtimes (E = 512, C = 208, 10 ids, 6 small tensors). "hit": the same
// resident ids every forward (no fill, no map upload); "miss": one miss per forward (a fill of
// 6 copies and two map uploads). SimRuntime is drained every 16 prepares in both, so both pay the same
// simulated-runtime cost and the difference is the erased call. BM_any_cache_overhead times
// batches of 64 prepares of each cache alternately in thread CPU time (the build machine is
// shared: wall time includes preemption) and reports the per-prepare difference (overhead_ns)
// from the same run, which drifts less than two separate cases.

namespace any_bench {

using RowSim = RowCache<SimRuntime, ExplicitLayout>;
constexpr std::size_t drain_every = 16;

ExplicitLayout layout() {
  return ExplicitLayout{{{{"w13", 256}, {"w2", 128}, {"w13_scale", 32}, {"w2_scale", 16}, {"w13_scale_2", 16}, {"w2_scale_2", 16}}}};
}
CacheOptions options() {
  CacheOptions o;
  o.num_experts = bench_experts;
  o.capacity = bench_capacity;
  o.top_k = bench_ids;
  return o;
}
SimRuntime::Options sim() { return SimRuntime::Options{.memory_limit = std::size_t{1} << 30, .seed = 1}; }

std::unique_ptr<RowSim> make_static(SimRuntime& rt) { return std::make_unique<RowSim>(rt, options(), layout()); }
std::unique_ptr<AnyExpertCache<SimRuntime>> make_any(SimRuntime& rt) {
  AnyCacheConfig c;
  c.provider = "row";
  c.layout = AnyLayout::of(layout());
  c.options = options();
  return std::make_unique<AnyExpertCache<SimRuntime>>(std::move(make_expert_cache(rt, c).value()));
}

// The forwards, flattened: "hit" the same 10 ids every time; "miss" 9 of them plus one id
// cycling through the other 503 (longer than the 208 slots, so it misses every time under
// LRU: one fill, 6 copies, per prepare, as a warm decode step with one new expert).
std::vector<std::int32_t> forwards(bool hit) {
  std::vector<std::int32_t> flat;
  const Forwards& seq = bench_sequence(false);
  const std::vector<std::int32_t>& hot = seq[0];
  std::vector<std::int32_t> cold;
  for (std::int32_t e = 0; e < bench_experts; ++e) {
    if (std::find(hot.begin(), hot.end() - 1, e) == hot.end() - 1) cold.push_back(e);
  }
  for (std::size_t t = 0; t < bench_warmup + bench_forwards; ++t) {
    flat.insert(flat.end(), hot.begin(), hot.end() - 1);
    flat.push_back(hit ? hot.back() : cold[t % cold.size()]);
  }
  return flat;
}

// One cache, one runtime, one stream: prepare the next forward (drain every drain_every).
template <class Cache>
struct Runner {
  SimRuntime rt{sim()};
  SimRuntime::Stream stream = rt.create_stream().value();
  std::unique_ptr<Cache> cache;
  const std::vector<std::int32_t>* flat = nullptr;
  std::size_t t = 0;
  std::uint64_t hits = 0, misses = 0;
  template <class Make>
  Runner(Make make, const std::vector<std::int32_t>& ids) : cache(make(rt)), flat(&ids) {
    for (std::size_t i = 0; i < bench_warmup; ++i) step();
    rt.drain();
  }
  void step() {
    if ((t + 1) * bench_ids > flat->size()) t = bench_warmup;
    auto v = cache->prepare(std::span<const std::int32_t>(flat->data() + t * bench_ids, bench_ids), stream);
    if (!v.ok()) throw std::runtime_error(std::string(v.status().message()));
    hits += v.value().hits;
    misses += v.value().misses;
    benchmark::DoNotOptimize(v.value().expert_map);
    if (++t % drain_every == 0) rt.drain();
  }
};

}  // namespace any_bench

template <bool Erased>
void BM_cache_prepare(benchmark::State& state) {
  using namespace any_bench;
  const bool hit = state.range(0) != 0;
  const auto flat = forwards(hit);
  std::unique_ptr<Runner<RowSim>> s;
  std::unique_ptr<Runner<AnyExpertCache<SimRuntime>>> a;
  if constexpr (Erased) a = std::make_unique<Runner<AnyExpertCache<SimRuntime>>>(make_any, flat);
  else s = std::make_unique<Runner<RowSim>>(make_static, flat);
  const std::uint64_t allocs_before = g_allocations.load(std::memory_order_relaxed);
  for (auto _ : state) {
    if constexpr (Erased) a->step(); else s->step();
  }
  const std::uint64_t allocs = g_allocations.load(std::memory_order_relaxed) - allocs_before;
  const std::uint64_t h = Erased ? a->hits : s->hits, m = Erased ? a->misses : s->misses;
  state.counters["hit_rate"] = static_cast<double>(h) / static_cast<double>(std::max<std::uint64_t>(1, h + m));
  state.counters["allocs_per_prepare"] =
      static_cast<double>(allocs) / static_cast<double>(std::max<benchmark::IterationCount>(1, state.iterations()));
}
BENCHMARK_TEMPLATE(BM_cache_prepare, false)->Name("BM_cache_prepare/static")->ArgName("hit")->Arg(1)->Arg(0);
BENCHMARK_TEMPLATE(BM_cache_prepare, true)->Name("BM_cache_prepare/any")->ArgName("hit")->Arg(1)->Arg(0);

// Both caches in one run, alternating batches of 64 prepares; counters are ns per prepare.
void BM_any_cache_overhead(benchmark::State& state) {
  using namespace any_bench;
  const auto cpu_ns = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
  };
  const bool hit = state.range(0) != 0;
  const auto flat = forwards(hit);
  Runner<RowSim> s(make_static, flat);
  Runner<AnyExpertCache<SimRuntime>> a(make_any, flat);
  constexpr int batch = 64;
  double static_ns = 0, any_ns = 0;
  std::uint64_t batches = 0;
  for (auto _ : state) {
    const double t0 = cpu_ns();
    for (int i = 0; i < batch; ++i) s.step();
    const double t1 = cpu_ns();
    for (int i = 0; i < batch; ++i) a.step();
    const double t2 = cpu_ns();
    static_ns += t1 - t0;
    any_ns += t2 - t1;
    ++batches;
  }
  const double n = static_cast<double>(std::max<std::uint64_t>(1, batches) * batch);
  state.counters["static_ns"] = static_ns / n;
  state.counters["any_ns"] = any_ns / n;
  state.counters["overhead_ns"] = (any_ns - static_ns) / n;
}
BENCHMARK(BM_any_cache_overhead)->ArgName("hit")->Arg(1)->Arg(0);

// ------------------------------------------------------------------------------------------
// Hit-rate mode

// One cache's request stream: each forward is a list of rows (token routings).
using Rows = std::vector<std::vector<std::int32_t>>;
struct Layered {
  std::int32_t num_experts = 0;
  std::vector<std::vector<Rows>> layers;  // layer -> forwards -> rows
};

Layered read_trace(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::map<std::int64_t, std::map<std::int64_t, Rows>> by_layer;  // layer -> step -> rows
  std::int32_t max_id = -1;
  std::string line;
  while (std::getline(in, line)) {
    if (const auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream ls(line);
    std::int64_t step = 0, layer = 0;
    if (!(ls >> step >> layer)) continue;
    std::vector<std::int32_t> row;
    for (std::int32_t e = 0; ls >> e;) {
      row.push_back(e);
      max_id = std::max(max_id, e);
    }
    by_layer[layer][step].push_back(std::move(row));
  }
  Layered out;
  out.num_experts = max_id + 1 <= 64 ? 64 : max_id + 1;
  for (auto& [layer, steps] : by_layer) {
    auto& fwd = out.layers.emplace_back();
    for (auto& [step, rows] : steps) fwd.push_back(std::move(rows));
  }
  return out;
}

// vLLM's token split (docs/reference_providers.md, split modes): one chunk if the union fits, else greedy row chunks.
Forwards token_split(const std::vector<Rows>& forwards, std::int32_t capacity) {
  Forwards chunks;
  for (const Rows& rows : forwards) {
    std::set<std::int32_t> seen;
    for (const auto& row : rows) {
      std::set<std::int32_t> merged = seen;
      for (const std::int32_t e : row) if (e >= 0) merged.insert(e);
      if (static_cast<std::int32_t>(merged.size()) > capacity) {
        if (seen.empty()) throw Error(ErrorCode::row_exceeds_capacity, "row exceeds capacity");
        chunks.emplace_back(seen.begin(), seen.end());
        seen.clear();
        for (const std::int32_t e : row) if (e >= 0) seen.insert(e);
      } else {
        seen = std::move(merged);
      }
    }
    if (!seen.empty()) chunks.emplace_back(seen.begin(), seen.end());
  }
  return chunks;
}

struct Tally {
  std::uint64_t hits = 0, misses = 0;
  [[nodiscard]] double rate() const { return hits + misses == 0 ? 0.0 : 100.0 * static_cast<double>(hits) / static_cast<double>(hits + misses); }
};

template <class P>
void replay(const Forwards& chunks, CacheShape shape, std::int32_t top_k, Tally& tally) {
  ForwardPlanner<P> planner(shape, std::min(top_k, shape.capacity), make_policy<P>(shape, chunks));
  ForwardPlan plan;
  for (const auto& c : chunks) throw_if_error(planner.plan_unique(c, plan));
  tally.hits += planner.counters().hits;
  tally.misses += planner.counters().misses;
}

void print_table(const std::string& title, const Layered& trace, std::int32_t top_k) {
  std::printf("\n%s (%zu layers, %d experts, per-layer cache, hit rate %%)\n", title.c_str(),
              trace.layers.size(), trace.num_experts);
  std::printf("| policy | 8 slots | 16 slots | 32 slots |\n|---|---|---|---|\n");
  const std::array<std::int32_t, 3> caps{8, 16, 32};
  std::array<std::array<Tally, 3>, 6> t{};
  for (std::size_t c = 0; c < caps.size(); ++c) {
    const CacheShape shape{trace.num_experts, caps[c]};
    for (const auto& layer : trace.layers) {
      const Forwards chunks = token_split(layer, caps[c]);
      replay<Lru>(chunks, shape, top_k, t[0][c]);
      replay<Lfru>(chunks, shape, top_k, t[1][c]);
      replay<Sieve>(chunks, shape, top_k, t[2][c]);
      replay<S3Fifo>(chunks, shape, top_k, t[3][c]);
      replay<Arc>(chunks, shape, top_k, t[4][c]);
      replay<Belady>(chunks, shape, top_k, t[5][c]);
    }
  }
  const std::array<std::string_view, 6> names{Lru::name, Lfru::name, Sieve::name, S3Fifo::name, Arc::name, "OPT (belady)"};
  for (std::size_t p = 0; p < names.size(); ++p) {
    std::printf("| %.*s | %.1f | %.1f | %.1f |\n", static_cast<int>(names[p].size()), names[p].data(),
                t[p][0].rate(), t[p][1].rate(), t[p][2].rate());
  }
}

// Synthetic per-layer streams with temporal locality. Each layer has its own popularity
// ranking (Zipf with exponent `skew` over a random permutation); each token keeps each of the
// previous token's experts with probability `stick`, and every `drift_every` steps a fraction
// `drift` of the ranking is reshuffled (phase changes, e.g. a new prompt or topic).
struct SynthConfig {
  const char* name;
  double skew;
  double stick;
  std::int32_t drift_every;
  double drift;
};

Layered synthesize(const SynthConfig& cfg, std::uint64_t seed) {
  constexpr std::int32_t experts = 64, top_k = 6, layers = 8, steps = 2048;
  Rng rng(seed);
  const Zipf zipf(experts, cfg.skew);
  Layered out;
  out.num_experts = experts;
  for (std::int32_t l = 0; l < layers; ++l) {
    auto rank = permutation(experts, rng);
    std::vector<std::int32_t> prev;
    auto& fwd = out.layers.emplace_back();
    for (std::int32_t s = 0; s < steps; ++s) {
      if (cfg.drift_every > 0 && s > 0 && s % cfg.drift_every == 0) {
        const auto swaps = static_cast<std::int32_t>(cfg.drift * experts / 2);
        for (std::int32_t i = 0; i < swaps; ++i) std::swap(rank[static_cast<std::size_t>(rng.below(experts))], rank[static_cast<std::size_t>(rng.below(experts))]);
      }
      std::vector<std::int32_t> row;
      for (const std::int32_t e : prev) if (rng.uniform() < cfg.stick) row.push_back(e);
      while (static_cast<std::int32_t>(row.size()) < top_k) {
        const std::int32_t e = rank[static_cast<std::size_t>(zipf(rng))];
        if (std::find(row.begin(), row.end(), e) == row.end()) row.push_back(e);
      }
      prev = row;
      fwd.push_back(Rows{row});
    }
  }
  return out;
}

int hit_rate_mode(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.starts_with("--hit_rates=")) {
      const std::string path(arg.substr(12));
      print_table(path, read_trace(path), 6);
    } else if (arg == "--hit_rates_synthetic") {
      const std::array<SynthConfig, 3> configs{{
          {"zipf0.8 stick0.3", 0.8, 0.3, 0, 0.0},
          {"zipf1.1 stick0.5 drift(25% every 256)", 1.1, 0.5, 256, 0.25},
          {"zipf0.6 stick0.7 drift(50% every 128)", 0.6, 0.7, 128, 0.5},
      }};
      for (const auto& cfg : configs) {
        print_table(std::string("synthetic ") + cfg.name, synthesize(cfg, 1234), 6);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.starts_with("--hit_rates")) return hit_rate_mode(argc, argv);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
