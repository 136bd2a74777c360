#pragma once
// expert-cache-bench: the MODELLED run. The decode loop on SimRuntime with a virtual-time cost
// model (ModelledSim forwards each call with its own cost); weights are stored scaled down and
// charged for the bytes they stand for. The device provider's run is in modelled_device.hpp.
// Host-only.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "args.hpp"
#include "expert_cache/expert_cache.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"
#include "json_report.hpp"
#include "lookahead.hpp"
#include "model.hpp"
#include "progress.hpp"
#include "report.hpp"

namespace expert_cache::bench {

// Constants of the model (nanoseconds, bytes/ns). Sources: docs/hardware_limits.md (H200,
// PCIe Gen5 x16, CUDA 13, measured) where marked [hardware_limits.md]; the rest are stated assumptions.
struct SimCosts {
  double pcie_bytes_per_ns = 55.0;        // [hardware_limits.md] one big pinned H2D copy: 55.0-55.4 GB/s
  double copy_device_ns = 3000.0;         // per cudaMemcpyAsync on the copy engine; fits [hardware_limits.md] 91.6% for one
                                          // 1.69 MiB copy and 56-63% for six per-tensor copies of an expert
  double batch_copy_device_ns = 800.0;    // per descriptor of a cudaMemcpyBatchAsync; fits [hardware_limits.md] 97.2%
                                          // (64 x 1.69 MiB) and 88-89% (tensor-major rows)
  double copy_host_ns = 2100.0;           // [hardware_limits.md] host cost of one cudaMemcpyAsync
  double batch_host_ns_per_copy = 4000.0; // [hardware_limits.md] host cost of cudaMemcpyBatchAsync, per copy
  double event_host_ns = 175.0;           // [hardware_limits.md] record + wait = 0.35 us per pair
  double launch_host_ns = 2500.0;         // assumption: host cost of one kernel launch
  double consumer_fixed_ns = 5000.0;      // assumption: launch latency + tail of the MoE consumer
  double hbm_bytes_per_ns = 1570.0;       // fit to the measured consumer (docs/benchmarks.md, H200 at a8e2c2f):
                                          // 10 experts (17.7 MB) in 16.3 us = 5 us + 17.7 MB / 1.57 TB/s
  // The device provider (one replayed graph per step; modelled_device.hpp). [plan] = the device planner's
  // plan + maps per layer inside a replayed 48-layer graph as measured on the H200 at ea81317 (bench_device_plan;
  // docs/benchmarks.md "Device planner" has the current rows: the model keeps the figures it was fitted to).
  double graph_launch_host_ns = 5000.0;   // assumption: host cost of one cudaGraphLaunch of a decode step
  double graph_node_ns = 2000.0;          // assumption: a one-block kernel node (router stand-in, step counter)
  double plan_ns = 2960.0;                // [plan] all hit: 2.96 us per layer
  double plan_first_victim_ns = 3500.0;   // [plan] one evicting miss: 6.49 us
  double plan_victim_ns = 1400.0;         // [plan] each further victim: ~1.4 us
  double plan_free_miss_ns = 300.0;       // [plan] a miss into a free slot: ~0.3 us
  double fill_fixed_ns = 1100.0;          // fit to [plan]'s in-graph fill (two nodes): 37.6 us at 1 miss,
  double fill_bytes_per_ns = 48.5;        // 292.8 us at 8 (plan subtracted) = 1.1 us + bytes / 48.5 GB/s
  [[nodiscard]] std::string json() const {
    using detail::json_number;
    return "{\"pcie_bytes_per_ns\": " + json_number(pcie_bytes_per_ns) + ", \"copy_device_ns\": " + json_number(copy_device_ns) +
           ", \"batch_copy_device_ns\": " + json_number(batch_copy_device_ns) + ", \"copy_host_ns\": " +
           json_number(copy_host_ns) + ", \"batch_host_ns_per_copy\": " + json_number(batch_host_ns_per_copy) +
           ", \"event_host_ns\": " + json_number(event_host_ns) + ", \"launch_host_ns\": " + json_number(launch_host_ns) +
           ", \"consumer_fixed_ns\": " + json_number(consumer_fixed_ns) + ", \"hbm_bytes_per_ns\": " +
           json_number(hbm_bytes_per_ns) + ", \"graph_launch_host_ns\": " + json_number(graph_launch_host_ns) +
           ", \"graph_node_ns\": " + json_number(graph_node_ns) + ", \"plan_ns\": " + json_number(plan_ns) +
           ", \"plan_first_victim_ns\": " + json_number(plan_first_victim_ns) + ", \"plan_victim_ns\": " +
           json_number(plan_victim_ns) + ", \"plan_free_miss_ns\": " + json_number(plan_free_miss_ns) +
           ", \"fill_fixed_ns\": " + json_number(fill_fixed_ns) + ", \"fill_bytes_per_ns\": " +
           json_number(fill_bytes_per_ns) + "}";
  }
};

// SimRuntime with per-call costs: a thin `runtime` that sets SimRuntime's cost model before
// each forwarded call, so every call kind pays its own host cost (SimCostModel has one) and
// every copy its real duration. Weights are stored scaled down (SimRuntime really copies
// bytes); copies out of a registered weight pool are charged for the bytes they stand for.
class ModelledSim {
 public:
  using Stream = SimRuntime::Stream;
  using Event = SimRuntime::Event;

  explicit ModelledSim(const SimCosts& costs) : sim_(options()), costs_(costs) {}
  ModelledSim(const ModelledSim&) = delete;
  ModelledSim& operator=(const ModelledSim&) = delete;

  [[nodiscard]] SimRuntime& sim() noexcept { return sim_; }
  [[nodiscard]] const SimCosts& costs() const noexcept { return costs_; }

  // [p, p + bytes) holds weights scaled down: a copy of n bytes from it stands for n * factor.
  void add_weight_pool(const void* p, std::size_t bytes, double factor) {
    pools_[reinterpret_cast<std::uintptr_t>(p)] = Pool{bytes, factor};
  }

  Result<Stream> create_stream() noexcept { return sim_.create_stream(); }
  void destroy_stream(Stream s) noexcept { sim_.destroy_stream(s); }
  Result<Event> create_event() noexcept { return sim_.create_event(); }
  void destroy_event(Event e) noexcept { sim_.destroy_event(e); }
  Status record(Event e, Stream s) noexcept {
    set(costs_.event_host_ns, 0.0);
    return sim_.record(e, s);
  }
  Status wait(Stream s, Event e) noexcept {
    set(costs_.event_host_ns, 0.0);
    return sim_.wait(s, e);
  }
  Result<bool> query(Event e) noexcept { return sim_.query(e); }
  Status synchronize(Event e) noexcept { return sim_.synchronize(e); }
  Status synchronize(Stream s) noexcept { return sim_.synchronize(s); }
  Result<bool> is_capturing(Stream s) noexcept { return sim_.is_capturing(s); }
  void host_access(const void* p, std::size_t n, AccessMode mode) noexcept { sim_.host_access(p, n, mode); }

  Status copy_async(void* dst, const void* src, std::size_t n, Stream s) noexcept {
    bool weights = false;
    const double real = real_bytes(src, n, weights);
    set(costs_.copy_host_ns, costs_.copy_device_ns + real / costs_.pcie_bytes_per_ns);
    Status st = sim_.copy_async(dst, src, n, s);
    if (st && n != 0) count(real, weights, 1);
    return st;
  }

  Status copy_batch_async(std::span<const CopyDesc> copies, Stream s) noexcept {
    double real = 0, weight_bytes = 0;
    std::size_t n = 0;
    for (const CopyDesc& c : copies) {
      if (c.bytes == 0) continue;
      bool weights = false;
      const double b = real_bytes(c.src, c.bytes, weights);
      real += b;
      if (weights) weight_bytes += b;
      ++n;
    }
    if (n == 0) return sim_.copy_batch_async(copies, s);
    // SimRuntime charges latency per descriptor: spread the transfer time over them.
    set(costs_.batch_host_ns_per_copy * static_cast<double>(n),
        costs_.batch_copy_device_ns + real / costs_.pcie_bytes_per_ns / static_cast<double>(n));
    Status st = sim_.copy_batch_async(copies, s);
    if (st) {
      weight_bytes_ += weight_bytes;
      other_bytes_ += real - weight_bytes;
      copies_ += n;
    }
    return st;
  }

  // A kernel: `device_ns` on its stream, launch_host_ns on the host.
  Status launch(Stream s, std::span<const Access> accesses, std::function<void()> body, double device_ns) noexcept {
    set(costs_.launch_host_ns, 0.0);
    sim_.set_next_duration_ns(device_ns);
    return sim_.launch(s, accesses, std::move(body));
  }

  Result<void*> allocate(std::size_t bytes, MemoryKind kind) noexcept { return sim_.allocate(bytes, kind); }
  Status deallocate(void* p) noexcept {
    pools_.erase(reinterpret_cast<std::uintptr_t>(p));
    return sim_.deallocate(p);
  }

  // Graph replay (the device provider): the ops of a captured step cost the host nothing; the
  // step's one cudaGraphLaunch is charged by graph_launch().
  void set_graph_replay(bool on) noexcept { graph_replay_ = on; }
  Status graph_launch(Stream s) noexcept {
    graph_replay_ = false;
    set(costs_.graph_launch_host_ns, 0.0);
    sim_.set_next_label("cudaGraphLaunch (modelled)");
    sim_.set_next_duration_ns(0.0);
    Status st = sim_.launch(s, {}, {});
    graph_replay_ = true;
    return st;
  }
  // Host and device costs of the next calls outside the typed entries (the device provider's
  // executor enqueues through SimRuntime directly).
  void set_call_costs(double host_ns, double latency_ns) noexcept { set(host_ns, latency_ns); }
  // The real bytes `n` bytes at `src` stand for, and accounting of weight bytes a device-side
  // fill moved (its size is decided on the device, after the enqueue).
  [[nodiscard]] double real_bytes_of(const void* src, std::size_t n) const noexcept {
    bool weights = false;
    return real_bytes(src, n, weights);
  }
  void count_device_fill(double real_bytes) noexcept { weight_bytes_ += real_bytes; }

  [[nodiscard]] double weight_bytes() const noexcept { return weight_bytes_; }
  [[nodiscard]] double other_bytes() const noexcept { return other_bytes_; }
  [[nodiscard]] std::uint64_t copies() const noexcept { return copies_; }
  [[nodiscard]] double now_ns() const noexcept { return sim_.host_time_ns(); }

 private:
  struct Pool {
    std::size_t bytes;
    double factor;
  };
  static SimRuntime::Options options() {
    SimRuntime::Options o;
    o.memory_limit = std::size_t{16} << 30;  // scaled pools: ~60 MB for the default model
    o.max_races = 64;
    return o;
  }
  void set(double host_ns, double latency_ns) noexcept {
    SimCostModel c;
    c.host_call_ns = graph_replay_ ? 0.0 : host_ns;
    c.copy_latency_ns = latency_ns;
    c.copy_bytes_per_ns = 0.0;  // the latency carries the whole duration
    c.copies_share_link = true;  // demand and speculative copies queue on one PCIe link
    sim_.set_cost_model(c);
  }
  double real_bytes(const void* src, std::size_t n, bool& weights) const noexcept {
    const auto p = reinterpret_cast<std::uintptr_t>(src);
    auto it = pools_.upper_bound(p);
    if (it != pools_.begin()) {
      --it;
      if (p < it->first + it->second.bytes) {
        weights = true;
        return static_cast<double>(n) * it->second.factor;
      }
    }
    weights = false;
    return static_cast<double>(n);
  }
  void count(double real, bool weights, std::uint64_t copies) noexcept {
    (weights ? weight_bytes_ : other_bytes_) += real;
    copies_ += copies;
  }

  SimRuntime sim_;
  SimCosts costs_;
  std::map<std::uintptr_t, Pool> pools_;
  double weight_bytes_ = 0;
  double other_bytes_ = 0;
  std::uint64_t copies_ = 0;
  bool graph_replay_ = false;
};

static_assert(allocating_runtime<ModelledSim>);
static_assert(batching_runtime<ModelledSim>);

// The layout SimRuntime stores: each real tensor size divided by `scale` (rounded up, at least
// the real size for tiny tensors such as the 4-byte global scales).
inline ExplicitLayout scaled_layout(const ExpertTensorBytes& real, std::int64_t scale) {
  ExplicitLayout l;
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    const std::size_t b = real[t].bytes_per_expert;
    std::size_t s = (b + static_cast<std::size_t>(scale) - 1) / static_cast<std::size_t>(scale);
    if (b <= 16) s = b;
    l.bytes[t] = TensorBytes{real[t].name, s};
  }
  return l;
}

// Byte `i` of tensor `t` of expert `e` in layer `layer`: what the host pools hold, so the
// consumer can check it reads the expert the map names.
inline std::uint8_t pattern_byte(std::int32_t layer, std::int32_t e, std::size_t t, std::size_t i) noexcept {
  const std::uint64_t h = (static_cast<std::uint64_t>(layer) * 0x9E3779B97F4A7C15ull) ^
                          (static_cast<std::uint64_t>(e) * 0xC2B2AE3D27D4EB4Full) ^ (t * 0x165667B19E3779F9ull) ^ i;
  return static_cast<std::uint8_t>((h ^ (h >> 29) ^ (h >> 47)) & 0xFF);
}

// Whether slot `slot` of view `v` holds expert e of `layer` (the first and last byte of every
// non-empty tensor equal the pools' pattern).
inline bool slot_holds_expert(const ForwardView& v, std::int32_t slot, std::int32_t layer, std::int32_t e) noexcept {
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    const SlotTensor& st = v.tensors[t];
    if (st.bytes == 0) continue;
    const auto* p = reinterpret_cast<const std::uint8_t*>(st.slot(slot));
    if (p[0] != pattern_byte(layer, e, t, 0) || p[st.bytes - 1] != pattern_byte(layer, e, t, st.bytes - 1)) return false;
  }
  return true;
}

template <class Cache>
void fill_sim_pools(Cache& cache, ModelledSim& rt, std::int32_t layer, const ExpertTensorBytes& real) {
  auto& st = cache.storage();
  const std::int32_t experts = cache.options().num_experts;
  if constexpr (std::remove_reference_t<decltype(st)>::expert_contiguous) {
    std::size_t real_blob = 0;
    for (const auto& t : real) real_blob += (t.bytes_per_expert + 15) / 16 * 16;
    rt.add_weight_pool(st.host_expert(0), st.blob_bytes() * static_cast<std::size_t>(experts),
                       static_cast<double>(real_blob) / static_cast<double>(st.blob_bytes()));
  } else {
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const std::size_t b = st.tensors()[t].bytes_per_expert;
      if (b == 0) continue;
      rt.add_weight_pool(st.host_tensor(t, 0), b * static_cast<std::size_t>(experts),
                         static_cast<double>(real[t].bytes_per_expert) / static_cast<double>(b));
    }
  }
  for (std::int32_t e = 0; e < experts; ++e)
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const std::size_t b = st.tensors()[t].bytes_per_expert;
      std::uint8_t* p = reinterpret_cast<std::uint8_t*>(st.host_tensor(t, e));
      for (std::size_t i = 0; i < b; ++i) p[i] = pattern_byte(layer, e, t, i);
    }
}

// One modelled run of a configuration. Cache = nullptr type (void) runs all-resident.
template <class Cache>
RunResult run_sim(const Model& m, const Routing& routing, const BenchArgs& a, const SimCosts& costs,
                  const std::string& provider, const std::string& staging, Progress& progress,
                  const std::string& prefetch = {}) {
  constexpr bool cached = !std::is_void_v<Cache>;
  ModelledSim rt(costs);
  const auto consumer = rt.create_stream().value();
  rt.sim().set_stream_name(consumer, "consumer");
  const ExpertTensorBytes real = m.layout.tensors();
  const ExplicitLayout layout = scaled_layout(real, a.sim_scale);
  const double expert_real_bytes = static_cast<double>(m.expert_bytes());

  using CacheType = std::conditional_t<cached, Cache, int>;  // int: placeholder of the resident run
  std::vector<std::unique_ptr<CacheType>> caches;
  if constexpr (cached) {
    for (std::int32_t l = 0; l < m.layers; ++l) {
      CacheOptions o;
      o.num_experts = m.experts;
      o.capacity = m.capacity;
      o.top_k = m.top_k;
      o.log = {};
      caches.push_back(std::make_unique<Cache>(rt, o, layout));
      fill_sim_pools(*caches.back(), rt, l, real);
    }
  }
  const std::size_t id_bytes = static_cast<std::size_t>(m.ids_per_forward()) * sizeof(std::int32_t);
  RuntimeBuffer<ModelledSim> ids_host(rt, id_bytes, MemoryKind::pinned_host);
  RuntimeBuffer<ModelledSim> ids_dev(rt, id_bytes, MemoryKind::device);

  // --prefetch: the predictor of this row (inactive for "", "none") and the byte budget of one
  // prefetch() in the cache's own (scaled) bytes per expert.
  Lookahead lookahead(prefetch, m.layers, m.experts, prefetch_budget(a, m), routing.widest, a.seed);
  const auto prefetch_bytes =
      static_cast<std::int64_t>(lookahead.budget()) * static_cast<std::int64_t>(total_bytes_per_expert(layout.tensors()));
  std::uint64_t spec0[3] = {0, 0, 0};

  RunResult r;
  r.provider = provider;
  r.staging = staging;
  r.prefetch = prefetch;
  r.modelled = true;
  r.output_checked = cached;
  std::uint64_t check_failures = 0;
  std::uint64_t hits0 = 0, misses0 = 0;
  double bytes0 = 0, other0 = 0;
  std::uint64_t copies0 = 0;
  double measure_start = 0;
  const std::int32_t total = routing.steps;
  std::vector<Access> accesses;
  std::uint64_t syncs = 0, stalls0 = 0;  // the loop's own host waits in measured steps; library waits
  for (std::int32_t s = 0; s < total; ++s) {
    if (s == a.warmup) {  // start of the measured steps: snapshot the counters
      measure_start = rt.now_ns();
      if constexpr (cached) {
        for (auto& c : caches) {
          hits0 += c->stats().hits;
          misses0 += c->stats().misses;
          stalls0 += c->stats().staging_stalls;
          spec0[0] += c->stats().speculative_issued;
          spec0[1] += c->stats().speculative_used;
          spec0[2] += c->stats().speculative_wasted;
        }
      }
      bytes0 = rt.weight_bytes();
      other0 = rt.other_bytes();
      copies0 = rt.copies();
    }
    const bool measured = s >= a.warmup;
    const double step_start = rt.now_ns();
    for (std::int32_t l = 0; l < m.layers; ++l) {
      // (1) routing read-back point: the host waits for the consumer stream.
      if (Status st = rt.synchronize(consumer); !st) throw Error(st);
      if (measured) ++syncs;
      rt.sim().drain();
      const auto ids = routing.forward(s, l);
      rt.host_access(ids_host.data(), id_bytes, AccessMode::write);
      std::memcpy(ids_host.data(), ids.data(), id_bytes);
      if (Status st = rt.copy_async(ids_dev.data(), ids_host.data(), id_bytes, consumer); !st) throw Error(st);
      const double unique = static_cast<double>(routing.unique_count(s, l));
      const double consumer_ns = costs.consumer_fixed_ns + unique * expert_real_bytes / costs.hbm_bytes_per_ns;
      accesses.clear();
      accesses.push_back(Access{ids_dev.data(), id_bytes, AccessMode::read});
      if constexpr (cached) {
        Cache& cache = *caches[static_cast<std::size_t>(l)];
        // (2) prepare(): real wall clock and modelled host time.
        const double model0 = rt.now_ns();
        const auto t0 = std::chrono::steady_clock::now();
        Result<ForwardView> view = cache.prepare(ids, consumer);
        const auto t1 = std::chrono::steady_clock::now();
        if (!view.ok()) throw Error(view.status());
        if (measured) {
          r.prepare_wall_ns += static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
          r.prepare_model_ns += rt.now_ns() - model0;
          ++r.prepares;
        }
        // (3) the consumer: reads the forward map and each routed expert's slot, and checks
        // (when it runs) that the slot holds the expert the map names.
        const ForwardView v = view.value();
        const std::int32_t experts = m.experts;
        accesses.push_back(Access{v.expert_map, static_cast<std::size_t>(experts) * sizeof(std::int32_t), AccessMode::read});
        for (const std::int32_t e : ids) {
          if (e < 0) continue;
          const std::int32_t slot = cache.forward_map_host()[static_cast<std::size_t>(e)];
          for (const SlotTensor& t : v.tensors)
            if (t.bytes != 0) accesses.push_back(Access{t.slot(slot), t.bytes, AccessMode::read});
        }
        std::vector<std::int32_t> want(ids.begin(), ids.end());
        auto body = [v, want = std::move(want), l, &check_failures] {
          for (const std::int32_t e : want) {
            if (e < 0) continue;
            const std::int32_t slot = v.expert_map[e];
            if (slot < 0) {
              ++check_failures;
              continue;
            }
            if (!slot_holds_expert(v, slot, l, e)) ++check_failures;
          }
        };
        if (Status st = rt.launch(consumer, accesses, body, consumer_ns); !st) throw Error(st);
        // (4) lookahead: layer L+1's predicted experts of this token, after the kernels that read
        // this layer's maps are enqueued (edge 9); the last layer predicts nothing.
        if (lookahead.active()) {
          const bool last = l + 1 == m.layers;
          const auto next = last ? std::span<const std::int32_t>{} : routing.forward(s, l + 1);
          const std::span<const std::int32_t> predicted = lookahead.after_layer(s, l, ids, next, last);
          if (!last) {
            Result<PrefetchView> pv = caches[static_cast<std::size_t>(l + 1)]->prefetch(
                predicted, consumer, lookahead.prefetch_options(prefetch_bytes, a.evict_last_forward));
            if (!pv.ok()) throw Error(pv.status());
          }
          // --two-ahead: layer L+2 too, after layer L+1's (its fills queue behind them).
          if (lookahead.two_layers() && l + 2 < m.layers) {
            const std::span<const std::int32_t> two = lookahead.two_ahead(s, l, routing.forward(s, l + 2));
            Result<PrefetchView> pv = caches[static_cast<std::size_t>(l + 2)]->prefetch(
                two, consumer, lookahead.prefetch_options_two_ahead(prefetch_bytes, a.evict_last_forward));
            if (!pv.ok()) throw Error(pv.status());
          }
        }
      } else {
        if (Status st = rt.launch(consumer, accesses, {}, consumer_ns); !st) throw Error(st);
      }
    }
    if (Status st = rt.synchronize(consumer); !st) throw Error(st);
    if (measured) ++syncs;
    rt.sim().drain();
    if (s == 0) r.cold_start_ns = rt.now_ns() - step_start;
    progress.step(s + 1, total);
  }
  r.time_ns = rt.now_ns() - measure_start;
  r.tokens = static_cast<std::int64_t>(a.steps) * m.batch;
  if constexpr (cached) {
    for (auto& c : caches) {
      r.hits += c->stats().hits;
      r.misses += c->stats().misses;
      syncs += c->stats().staging_stalls;
      r.speculative_issued += c->stats().speculative_issued;
      r.speculative_used += c->stats().speculative_used;
      r.speculative_wasted += c->stats().speculative_wasted;
    }
    r.hits -= hits0;
    r.misses -= misses0;
    syncs -= stalls0;
    r.speculative_issued -= spec0[0];
    r.speculative_used -= spec0[1];
    r.speculative_wasted -= spec0[2];
  }
  r.host_syncs = syncs;
  r.pcie_bytes = rt.weight_bytes() - bytes0;
  r.map_bytes = rt.other_bytes() - other0;
  r.copies = rt.copies() - copies0;
  r.check_failures = check_failures + rt.sim().race_count();
  return r;
}

// The modelled ceiling: one 256 MiB pinned copy under the same cost model.
inline double sim_pcie_ceiling(const SimCosts& c) {
  const double bytes = 256.0 * 1048576.0;
  return bytes / ((c.copy_device_ns + bytes / c.pcie_bytes_per_ns) * 1e-9);
}

template <template <class> class Storage, class Policy>
RunResult run_sim_staging(const Model& m, const Routing& routing, const BenchArgs& a, const SimCosts& costs,
                          const RunConfig& cfg, Progress& progress) {
  if (cfg.staging == "inline")
    return run_sim<ExpertCache<Storage, Policy, Inline, ExplicitLayout, ModelledSim>>(m, routing, a, costs, cfg.provider,
                                                                                     cfg.staging, progress);
  if (cfg.staging == "copy_stream")
    return run_sim<ExpertCache<Storage, Policy, CopyStream, ExplicitLayout, ModelledSim>>(
        m, routing, a, costs, cfg.provider, cfg.staging, progress, cfg.prefetch);
  if (cfg.staging == "batched")
    return run_sim<ExpertCache<Storage, Policy, Batched, ExplicitLayout, ModelledSim>>(m, routing, a, costs, cfg.provider,
                                                                                      cfg.staging, progress);
  throw UsageError{"staging '" + cfg.staging + "' is not available on SimRuntime"};
}

// The device provider's modelled run (modelled_device.hpp, included at the end of this file).
inline RunResult run_sim_device(const Model& m, const Routing& routing, const BenchArgs& a, const SimCosts& costs,
                                Progress& progress);

inline Report run_modelled(const Model& m, const Routing& routing, const BenchArgs& a, Progress& progress) {
  const SimCosts costs;
  Report rep;
  rep.modelled = true;
  rep.runtime_name = "SimRuntime (virtual time, cost model in docs/benchmarks.md)";
  rep.pcie_ceiling_bytes_per_s = sim_pcie_ceiling(costs);
  rep.cost_model_json = costs.json();
  const std::vector<std::string> staging =
      a.staging_given ? a.staging : std::vector<std::string>{"inline", "copy_stream", "batched"};
  const std::vector<RunConfig> configs = run_configs(a, staging);
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const RunConfig& cfg = configs[i];
    progress.run_started(i, configs.size(), run_label(cfg));
    if (cfg.provider == "resident") {
      rep.runs.push_back(run_sim<void>(m, routing, a, costs, "resident", "-", progress));
    } else if (cfg.provider == "device") {
      if (!cfg.prefetch.empty() && cfg.prefetch != "none") continue;  // device lookahead: measured runs only
      rep.runs.push_back(run_sim_device(m, routing, with_device_policy(a, cfg), costs, progress));
      rep.runs.back().device_policy = cfg.device_policy;
    } else if (cfg.provider == "row") {
      rep.runs.push_back(run_sim_staging<TensorMajorStorage, Lru>(m, routing, a, costs, cfg, progress));
    } else {
      rep.runs.push_back(run_sim_staging<ExpertMajorStorage, Lfru>(m, routing, a, costs, cfg, progress));
    }
    progress.run_done(rep.runs.back().tokens_per_second(), rep.runs.back().hit_rate());
  }
  progress.finish();
  if (device_policy_labelled(a) && std::find(a.providers.begin(), a.providers.end(), "device") != a.providers.end()) {
    rep.notes.emplace_back(
        "device policies: each row plans with its own policy (the planning code the GPU runs), so its hits, misses "
        "and bytes are that policy's; its plan time is modelled with the LRU planner's measured cost for every "
        "policy (bench_device_plan measures each policy's)");
  }
  return rep;
}

}  // namespace expert_cache::bench

#include "modelled_device.hpp"  // NOLINT: after the definitions it needs
