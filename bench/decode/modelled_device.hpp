#pragma once
// expert-cache-bench: the device provider's MODELLED run. DeviceExpertCache (TensorMajorStorage,
// one device policy per row: DeviceLru = the row provider's Lru decisions, DeviceLfru = the cached
// provider's Lfru, DeviceCrf = Crf) on ModelledSim, through the library's own SimRuntime executor
// (BasicSimPlanExecutor<Policy>: the very planning code the GPU runs, as simulated launches that
// declare what they touch). Hits, misses and bytes are therefore each policy's own; the plan's
// modelled time is the LRU planner's measured cost for every policy (SimCosts). Per step, as on the GPU, and enqueued the same way every step (the
// ops never name the step: what a replayed graph does):
//   graph launch (host cost once per step) -> per layer: router stand-in (reads the device step
//   counter and writes the layer's ids from the routing buffer, uploaded once before timing) ->
//   prepare (plan + fill) -> consumer [-> prepare_group -> consumer, max_groups rounds] -> step
//   counter + 1.
// The ops of a step cost the host nothing (graph replay) and the stream is marked capturing, so a
// host synchronisation inside a step would fail the run. Host-only.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "expert_cache/device_cache/device_cache.hpp"
#include "modelled_run.hpp"

namespace expert_cache::bench {

// DeviceExpertCache's executor on ModelledSim: the library's SimPlanExecutor on the wrapped
// SimRuntime, with the modelled device costs. The fill's size is decided by the plan on the
// device, after the enqueue, while a simulated op's duration is fixed when it is enqueued; so the
// executor completes the plan op right away (drain: a valid schedule, the host time does not
// move), reads the fill count and the evictions the plan made, and charges the victim search
// and the transfer to a zero-access op that follows the library's fill op on the same stream.
template <device_plan_policy Policy>
class ModelledPlanExecutor {
 public:
  using Stream = ModelledSim::Stream;

  ModelledPlanExecutor(ModelledSim& rt, std::int32_t num_experts, std::int32_t capacity, std::int32_t max_ids,
                       const CopyRegions& regions, const DeviceCacheOptions& options)
      : rt_(&rt), inner_(rt.sim(), num_experts, capacity, max_ids, regions, options), regions_(regions) {}

  [[nodiscard]] const DevicePlanState& state() const noexcept { return inner_.state(); }
  [[nodiscard]] std::int32_t* sanitized_ids() const noexcept { return inner_.sanitized_ids(); }
  [[nodiscard]] std::size_t device_bytes() const noexcept { return inner_.device_bytes(); }
  [[nodiscard]] DevicePlanStats stats() const noexcept { return inner_.stats(); }
  std::uint32_t take_error_word() noexcept { return inner_.take_error_word(); }
  [[nodiscard]] bool overlap() const noexcept { return inner_.overlap(); }
  Status join_fills() noexcept { return inner_.join_fills(); }

  Status plan_forward_fill(Stream s, const std::int32_t* ids, std::int32_t n, bool& planned, bool in_rounds,
                           std::int32_t round_width) noexcept {
    rt_->set_call_costs(rt_->costs().launch_host_ns, 0.0);
    rt_->sim().set_next_duration_ns(rt_->costs().plan_ns);
    if (Status st = inner_.plan_forward_fill(s, ids, n, planned, in_rounds, round_width); !st) return st;
    return charge_fill(s);
  }
  Status plan_group_fill(Stream s, std::int32_t g, bool& planned) noexcept {
    rt_->set_call_costs(rt_->costs().launch_host_ns, 0.0);
    rt_->sim().set_next_duration_ns(rt_->costs().plan_ns);
    if (Status st = inner_.plan_group_fill(s, g, planned); !st) return st;
    return charge_fill(s);
  }
  // Costed like a forward's plan + fill (the modelled run issues no prefetch today).
  Status prefetch(Stream s, const std::int32_t* ids, std::int32_t n, std::int32_t max_fills, std::uint32_t expires_after,
                  bool& planned, bool evict_last_forward = false) noexcept {
    rt_->set_call_costs(rt_->costs().launch_host_ns, 0.0);
    rt_->sim().set_next_duration_ns(rt_->costs().plan_ns);
    if (Status st = inner_.prefetch(s, ids, n, max_fills, expires_after, planned, evict_last_forward); !st) return st;
    return charge_fill(s);
  }
  Status invalidate(Stream s, std::int32_t expert) noexcept {
    rt_->set_call_costs(rt_->costs().launch_host_ns, 0.0);
    rt_->sim().set_next_duration_ns(rt_->costs().graph_node_ns);
    return inner_.invalidate(s, expert);
  }
  Status drop_fills(Stream s) noexcept {
    rt_->set_call_costs(rt_->costs().launch_host_ns, 0.0);
    rt_->sim().set_next_duration_ns(rt_->costs().graph_node_ns);
    return inner_.drop_fills(s);
  }
  Status drop_missing(Stream s) noexcept {
    rt_->set_call_costs(rt_->costs().launch_host_ns, 0.0);
    rt_->sim().set_next_duration_ns(rt_->costs().graph_node_ns);
    return inner_.drop_missing(s);
  }

 private:
  Status charge_fill(Stream s) noexcept {
    rt_->sim().drain();
    const DevicePlanState& st = inner_.state();
    const std::int32_t fills = std::clamp(st.scalars->fill_count, 0, st.capacity);
    const std::uint64_t evictions = st.counters->evictions;
    const auto victims = static_cast<double>(evictions - evictions_seen_);
    evictions_seen_ = evictions;
    const SimCosts& c = rt_->costs();
    if (real_fill_bytes_ < 0) {  // the pools are registered as weights after the cache is built
      real_fill_bytes_ = 0;
      for (const CopyRegion& r : regions_)
        if (r.bytes != 0) real_fill_bytes_ += rt_->real_bytes_of(r.host_base, r.bytes);
    }
    double ns = 0;
    if (victims > 0) ns += c.plan_first_victim_ns + (victims - 1) * c.plan_victim_ns;
    ns += std::max(0.0, static_cast<double>(fills) - victims) * c.plan_free_miss_ns;
    if (fills > 0) ns += c.fill_fixed_ns + static_cast<double>(fills) * real_fill_bytes_ / c.fill_bytes_per_ns;
    rt_->count_device_fill(static_cast<double>(fills) * real_fill_bytes_);
    rt_->set_call_costs(0.0, 0.0);
    rt_->sim().set_next_label("device fill time (modelled)");
    rt_->sim().set_next_duration_ns(ns);
    return rt_->sim().launch(s, {}, {});
  }

  ModelledSim* rt_;
  BasicSimPlanExecutor<Policy> inner_;
  CopyRegions regions_;
  double real_fill_bytes_ = -1;  // real bytes of one expert's fill; < 0 until the first fill
  std::uint64_t evictions_seen_ = 0;
};

}  // namespace expert_cache::bench

namespace expert_cache::inline v0 {
template <>
struct DevicePlanExecutorFor<bench::ModelledSim> {
  using type = bench::ModelledPlanExecutor<DeviceLru>;
  template <device_plan_policy Policy>
  using with_policy = bench::ModelledPlanExecutor<Policy>;
};
}  // namespace expert_cache::inline v0

namespace expert_cache::bench {

template <device_plan_policy Policy>
RunResult run_sim_device_with(const Model& m, const Routing& routing, const BenchArgs& a, const SimCosts& costs,
                              Progress& progress) {
  using Cache = DeviceExpertCache<TensorMajorStorage, ExplicitLayout, ModelledSim, Policy>;
  ModelledSim rt(costs);
  const auto consumer = rt.create_stream().value();
  rt.sim().set_stream_name(consumer, "consumer");
  const ExpertTensorBytes real = m.layout.tensors();
  const ExplicitLayout layout = scaled_layout(real, a.sim_scale);
  const double expert_real_bytes = static_cast<double>(m.expert_bytes());
  const std::int32_t n = m.ids_per_forward();
  const auto un = static_cast<std::size_t>(n);

  std::vector<std::unique_ptr<Cache>> caches;
  for (std::int32_t l = 0; l < m.layers; ++l) {
    DeviceCacheOptions o;
    o.num_experts = m.experts;
    o.capacity = m.capacity;
    o.max_ids = n;
    o.crf_decay_q32 = crf_decay_for_half_life(a.crf_half_life);
    caches.push_back(std::make_unique<Cache>(rt, o, layout));
    fill_sim_pools(*caches.back(), rt, l, real);
  }
  const std::int32_t rounds = caches[0]->max_groups(n);

  // The routing buffer (every step's ids, uploaded once), the step counter, per-layer id buffers.
  const std::size_t table_bytes = routing.ids.size() * sizeof(std::int32_t);
  RuntimeBuffer<ModelledSim> table_host(rt, table_bytes, MemoryKind::pinned_host);
  RuntimeBuffer<ModelledSim> table(rt, table_bytes, MemoryKind::device);
  RuntimeBuffer<ModelledSim> counter(rt, sizeof(std::uint32_t), MemoryKind::device);
  RuntimeBuffer<ModelledSim> ids_dev(rt, static_cast<std::size_t>(m.layers) * un * sizeof(std::int32_t), MemoryKind::device);
  rt.host_access(table_host.data(), table_bytes, AccessMode::write);
  std::memcpy(table_host.data(), routing.ids.data(), table_bytes);
  if (Status st = rt.copy_async(table.data(), table_host.data(), table_bytes, consumer); !st) throw Error(st);
  auto* counter_p = reinterpret_cast<std::uint32_t*>(counter.data());
  {
    const Access acc[] = {{counter_p, sizeof(std::uint32_t), AccessMode::write}};
    if (Status st = rt.launch(consumer, acc, [counter_p] { *counter_p = 0; }, costs.graph_node_ns); !st) throw Error(st);
  }
  if (Status st = rt.synchronize(consumer); !st) throw Error(st);
  rt.sim().drain();

  RunResult r;
  r.provider = "device";
  r.staging = device_staging;
  r.modelled = true;
  r.output_checked = true;
  std::uint64_t check_failures = 0;
  std::uint64_t hits0 = 0, misses0 = 0, stalls0 = 0;
  double bytes0 = 0, other0 = 0;
  std::uint64_t copies0 = 0;
  double measure_start = 0;
  const std::int32_t total = routing.steps;
  const auto layers = static_cast<std::size_t>(m.layers);
  const auto* table_p = reinterpret_cast<const std::int32_t*>(table.data());
  std::vector<std::int32_t> found(layers, 0);  // valid ids found by the consumers of a layer's rounds
  std::vector<Access> acc;
  const auto wait_idle = [&] {
    if (Status st = rt.synchronize(consumer); !st) throw Error(st);
    rt.sim().drain();
  };
  for (std::int32_t s = 0; s < total; ++s) {
    if (s == a.warmup) {  // exact device stats need idle streams: this wait is before the measured steps
      wait_idle();
      measure_start = rt.now_ns();
      for (auto& c : caches) {
        hits0 += c->stats().hits;
        misses0 += c->stats().misses;
        stalls0 += c->stats().staging_stalls;
      }
      bytes0 = rt.weight_bytes();
      other0 = rt.other_bytes();
      copies0 = rt.copies();
    }
    const double step_start = rt.now_ns();
    // One replay of the step's graph: a host synchronisation inside it would fail (capturing).
    if (Status st = rt.sim().set_capturing(consumer, true); !st) throw Error(st);
    if (Status st = rt.graph_launch(consumer); !st) throw Error(st);
    for (std::int32_t l = 0; l < m.layers; ++l) {
      auto* ids = reinterpret_cast<std::int32_t*>(ids_dev.data()) + static_cast<std::size_t>(l) * un;
      // Router stand-in: the step comes from the device counter, not from the host.
      acc.assign({Access{table_p, table_bytes, AccessMode::read}, Access{counter_p, sizeof(std::uint32_t), AccessMode::read},
                  Access{ids, un * sizeof(std::int32_t), AccessMode::write}});
      const std::int32_t steps = routing.steps, nl = m.layers;
      auto router = [table_p, counter_p, ids, l, n, steps, nl] {
        const std::uint32_t step = *counter_p % static_cast<std::uint32_t>(steps);
        std::memcpy(ids, table_p + (static_cast<std::size_t>(step) * static_cast<std::size_t>(nl) + static_cast<std::size_t>(l)) *
                                       static_cast<std::size_t>(n),
                    static_cast<std::size_t>(n) * sizeof(std::int32_t));
      };
      rt.sim().set_next_label("router stand-in");
      if (Status st = rt.launch(consumer, acc, router, costs.graph_node_ns); !st) throw Error(st);
      Cache& cache = *caches[static_cast<std::size_t>(l)];
      const double unique = static_cast<double>(routing.unique_count(s, l));
      const double consumer_ns = costs.consumer_fixed_ns + unique * expert_real_bytes / costs.hbm_bytes_per_ns;
      // Only the checks know the step: the consumer compares the ids it reads with the routing.
      const auto want_span = routing.forward(s, l);
      auto want = std::make_shared<const std::vector<std::int32_t>>(want_span.begin(), want_span.end());
      const std::int32_t valid = static_cast<std::int32_t>(std::count_if(want->begin(), want->end(), [](std::int32_t e) { return e >= 0; }));
      for (std::int32_t g = 0; g < rounds; ++g) {
        Result<ForwardView> view = g == 0 ? cache.prepare(ids, n, consumer) : cache.prepare_group(g, consumer);
        if (!view.ok()) throw Error(view.status());
        // The consumer: the sanitized ids, the forward map and (the host cannot know which
        // slots) every slot; checks that each mapped expert's slot holds its bytes.
        const ForwardView v = view.value();
        const std::int32_t* sanitized = cache.sanitized_ids_device();
        acc.clear();
        acc.push_back(Access{sanitized, un * sizeof(std::int32_t), AccessMode::read});
        acc.push_back(Access{v.expert_map, static_cast<std::size_t>(m.experts) * sizeof(std::int32_t), AccessMode::read});
        for (const SlotTensor& t : v.tensors)
          if (t.bytes != 0)
            acc.push_back(Access{t.base, t.slot_stride * static_cast<std::size_t>(m.capacity - 1) + t.bytes, AccessMode::read});
        const bool first = g == 0, last = g + 1 == rounds;
        std::int32_t* found_l = &found[static_cast<std::size_t>(l)];
        auto body = [v, sanitized, want, n, l, first, last, valid, found_l, &check_failures] {
          if (first) *found_l = 0;
          for (std::int32_t i = 0; i < n; ++i) {
            const std::int32_t e = sanitized[i];
            if (e != (*want)[static_cast<std::size_t>(i)]) {  // the router read the wrong step
              ++check_failures;
              continue;
            }
            if (e < 0) continue;
            const std::int32_t slot = v.expert_map[e];
            if (slot < 0) continue;  // in another group's round
            ++*found_l;
            if (!slot_holds_expert(v, slot, l, e)) ++check_failures;
          }
          if (last && *found_l != valid) ++check_failures;
        };
        rt.sim().set_next_label("consumer");
        if (Status st = rt.launch(consumer, acc, body, consumer_ns); !st) throw Error(st);
      }
    }
    {
      const Access bump[] = {{counter_p, sizeof(std::uint32_t), AccessMode::read}, {counter_p, sizeof(std::uint32_t), AccessMode::write}};
      rt.sim().set_next_label("step counter + 1");
      if (Status st = rt.launch(consumer, bump, [counter_p] { *counter_p += 1; }, costs.graph_node_ns); !st) throw Error(st);
    }
    if (Status st = rt.sim().set_capturing(consumer, false); !st) throw Error(st);
    rt.set_graph_replay(false);
    if (s == 0) {  // the cold start (a warm-up step): timed to its end
      wait_idle();
      r.cold_start_ns = rt.now_ns() - step_start;
    }
    progress.step(s + 1, total);
  }
  wait_idle();  // stops the clock: after the last step, not part of one
  r.time_ns = rt.now_ns() - measure_start;
  r.tokens = static_cast<std::int64_t>(a.steps) * m.batch;
  std::uint64_t stalls = 0;
  for (auto& c : caches) {
    const CacheStats cs = c->stats();
    r.hits += cs.hits;
    r.misses += cs.misses;
    stalls += cs.staging_stalls;
    // Bad ids or an overflow cannot come from a validated routing: either is a failure here.
    if (c->take_errors() != 0) ++check_failures;
  }
  r.hits -= hits0;
  r.misses -= misses0;
  r.host_syncs = stalls - stalls0;  // the steps themselves hold no host wait (capturing)
  r.pcie_bytes = rt.weight_bytes() - bytes0;
  r.map_bytes = rt.other_bytes() - other0;
  r.copies = rt.copies() - copies0;
  r.check_failures = check_failures + rt.sim().race_count();
  return r;
}

// The policy of a.device_policy (lru, lfru, crf; the arguments were validated).
inline RunResult run_sim_device(const Model& m, const Routing& routing, const BenchArgs& a, const SimCosts& costs,
                                Progress& progress) {
  return visit_device_policy(a.device_policy, [&]<class Policy>(Policy) {
    return run_sim_device_with<Policy>(m, routing, a, costs, progress);
  });
}

}  // namespace expert_cache::bench
