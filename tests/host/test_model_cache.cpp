// ModelExpertCache on SimRuntime. per_layer mode: the same per-layer hits, misses, maps, stats and
// slot bytes as L separate ExpertCaches for the same trace; the whole model creates ONE copy stream
// and one event set; its host pool is one allocation carved per layer; no race under the seeded
// random scheduler with readers of every layer on two consumer streams. global mode: the same
// hits/misses (total and per layer) as the replay tool's global scope for the same policy and
// capacity; each layer's view reads its own range and a prepare uploads only that layer's
// forward range. Bad layer (and expert) ids are rejected with nothing changed. prefetch (lookahead):
// per_layer mode gives the same fills, hits and counters as L separate ExpertCaches; a global pool
// keeps its latest forward and counts victims per layer; bad input changes nothing; a prepare
// using a fill waits for its slot (edge 9, negative half included); no race under the random
// scheduler with prefetches between the layers' forwards.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "expert_cache/base/splitmix64.hpp"
#include "expert_cache/cache/model_cache.hpp"
#include "expert_cache/eviction/all.hpp"
#include "expert_cache/tools/replay.hpp"
#include "expert_cache/tools/trace_generator.hpp"
#include "support/caller_memory.hpp"
#include "support/removed_edges.hpp"
#include "support/sim_cache_harness.hpp"
#include "support/stats_checks.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;
using Stream = SimRuntime::Stream;

namespace {

template <template <class> class StorageT, class PolicyT, class StagingT>
struct Config {
  template <class R>
  using Storage = StorageT<R>;
  using Policy = PolicyT;
  using Staging = StagingT;
  using Model = ModelExpertCache<StorageT, PolicyT, StagingT, ExplicitLayout, SimRuntime>;
  using Layer = ExpertCache<StorageT, PolicyT, StagingT, ExplicitLayout, SimRuntime>;
};
using RowLru = Config<TensorMajorStorage, Lru, CopyStream>;
using BlobLfru = Config<ExpertMajorStorage, Lfru, CopyStream>;
using RowSieveInline = Config<TensorMajorStorage, Sieve, Inline>;
using BlobArcBatched = Config<ExpertMajorStorage, Arc, Batched>;

// Layer l's expert e has the pattern of key l*E + e, so a slot holding another layer's expert
// (or another expert) is caught.
std::int32_t pattern_key(std::int32_t layer, std::int32_t experts, std::int32_t e) { return layer * experts + e; }

template <class Model>
void fill_model(Model& m) {
  const auto& tensors = m.storage().tensors();
  const std::int32_t E = m.options().num_experts;
  for (std::int32_t l = 0; l < m.num_layers(); ++l) {
    for (std::int32_t e = 0; e < E; ++e) {
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        std::byte* p = m.host_tensor(l, t, e);
        for (std::size_t i = 0; i < tensors[t].bytes_per_expert; ++i) p[i] = pattern_byte(t, pattern_key(l, E, e), i);
      }
    }
  }
}

template <class Cache>
void fill_layer_cache(Cache& c, std::int32_t layer) {
  const auto& tensors = c.storage().tensors();
  const std::int32_t E = c.options().num_experts;
  for (std::int32_t e = 0; e < E; ++e) {
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      std::byte* p = c.storage().host_tensor(t, e);
      for (std::size_t i = 0; i < tensors[t].bytes_per_expert; ++i) p[i] = pattern_byte(t, pattern_key(layer, E, e), i);
    }
  }
}

// Every resident expert of `layer` (per the host resident map) has its bytes in its slot.
template <class Model>
std::size_t bad_slots(const Model& m, std::int32_t layer) {
  const ForwardView v = m.layer_view(layer).value();
  const std::int32_t E = m.options().num_experts;
  const auto res = m.resident_map_host(layer);
  std::size_t bad = 0;
  for (std::int32_t e = 0; e < E; ++e) {
    const std::int32_t s = res[static_cast<std::size_t>(e)];
    if (s == absent_slot) continue;
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const SlotTensor& st = v.tensors[t];
      for (std::size_t i = 0; i < st.bytes; ++i) {
        if (st.slot(s)[i] != pattern_byte(t, pattern_key(layer, E, e), i)) {
          ++bad;
          break;
        }
      }
    }
  }
  return bad;
}

// A forward of `tokens` x top_k ids with skew (low ids more likely) and padding.
Ids random_forward(detail::SplitMix64& rng, std::int32_t experts, std::int32_t tokens, std::int32_t top_k) {
  Ids ids;
  for (std::int32_t t = 0; t < tokens; ++t) {
    for (std::int32_t k = 0; k < top_k; ++k) {
      if (rng.below(16) == 0) {
        ids.push_back(-1);
        continue;
      }
      const auto a = rng.below(static_cast<std::uint32_t>(experts));
      const auto b = rng.below(static_cast<std::uint32_t>(experts));
      ids.push_back(static_cast<std::int32_t>(std::min(a, b)));
    }
  }
  return ids;
}

ModelCacheOptions model_options(std::int32_t layers, std::int32_t experts, std::int32_t capacity, std::int32_t top_k,
                                ModelPool pool = ModelPool::per_layer) {
  ModelCacheOptions o;
  o.num_layers = layers;
  o.num_experts = experts;
  o.capacity = capacity;
  o.top_k = top_k;
  o.pool = pool;
  return o;
}

// Streams / events a runtime has created so far (SimRuntime hands out ids 1, 2, ...).
std::uint32_t streams_created(SimRuntime& rt) { return rt.create_stream().value().id - 1; }
std::uint32_t events_created(SimRuntime& rt) { return rt.create_event().value().id - 1; }

}  // namespace

TEST_CASE_TEMPLATE("model cache (per_layer): the same per-layer results as L separate ExpertCaches", C, RowLru, BlobLfru,
                   RowSieveInline, BlobArcBatched) {
  constexpr std::int32_t L = 4, E = 16, top_k = 2;
  const std::vector<std::int32_t> caps = {4, 6, 5, 8};
  SimRuntime model_rt, layers_rt;
  const Stream mx = model_rt.create_stream().value();
  const Stream lx = layers_rt.create_stream().value();
  ModelCacheOptions mo = model_options(L, E, 0, top_k);
  mo.layer_capacities = caps;
  typename C::Model model(model_rt, mo, six_tensor_layout());
  fill_model(model);
  std::vector<std::unique_ptr<typename C::Layer>> caches;
  for (std::int32_t l = 0; l < L; ++l) {
    caches.push_back(std::make_unique<typename C::Layer>(layers_rt, quiet_options(E, caps[static_cast<std::size_t>(l)], top_k),
                                                         six_tensor_layout()));
    fill_layer_cache(*caches.back(), l);
  }
  detail::SplitMix64 rng{42};
  std::size_t mismatched_maps = 0, bad = 0;
  for (int step = 0; step < 150; ++step) {
    for (std::int32_t l = 0; l < L; ++l) {
      auto& cache = *caches[static_cast<std::size_t>(l)];
      if (rng.below(10) == 0) {  // an occasional invalidate, on both
        const auto e = static_cast<std::int32_t>(rng.below(E));
        REQUIRE(model.invalidate(l, e, mx).ok());
        REQUIRE(cache.invalidate(e, lx).ok());
      }
      const Ids ids = random_forward(rng, E, 2, top_k);
      Result<ForwardView> mv = model.prepare(l, ids, mx);
      Result<ForwardView> cv = cache.prepare(ids, lx);
      REQUIRE(mv.ok());
      REQUIRE(cv.ok());
      CHECK(mv.value().hits == cv.value().hits);
      CHECK(mv.value().misses == cv.value().misses);
      CHECK(mv.value().generation == cv.value().generation);
      model_rt.drain();
      layers_rt.drain();
      // Host and device maps, entry for entry (same slot ids: the layer's own slot numbering).
      const auto hm = model.forward_map_host(l), hc = cache.forward_map_host();
      const auto rm = model.resident_map_host(l), rc = cache.resident_map_host();
      for (std::int32_t e = 0; e < E; ++e) {
        const auto i = static_cast<std::size_t>(e);
        if (hm[i] != hc[i] || rm[i] != rc[i] || mv.value().expert_map[e] != cv.value().expert_map[e] ||
            mv.value().resident_map[e] != cv.value().resident_map[e] || mv.value().expert_map[e] != hm[i] ||
            mv.value().resident_map[e] != rm[i]) {
          ++mismatched_maps;
        }
      }
      bad += bad_slots(model, l);
      check_plan_stats_equal(model.stats().per_layer[static_cast<std::size_t>(l)], cache.stats());
    }
  }
  CHECK(mismatched_maps == 0);
  CHECK(bad == 0);
  CHECK(model_rt.race_count() == 0);
  const ModelCacheStats s = model.stats();
  std::uint64_t hits = 0, misses = 0;
  for (const auto& c : caches) {
    hits += c->stats().hits;
    misses += c->stats().misses;
  }
  CHECK(s.total.hits == hits);
  CHECK(s.total.misses == misses);
  CHECK(s.total.capacity == 4 + 6 + 5 + 8);
}

TEST_CASE("model cache: ONE copy stream and one event set for the whole model, one host pool carved per layer") {
  constexpr std::int32_t L = 8, E = 32, cap = 6;
  SimRuntime model_rt, layers_rt;
  using Model = RowLru::Model;
  Model model(model_rt, model_options(L, E, cap, 2), six_tensor_layout());
  const std::uint32_t model_streams = streams_created(model_rt);
  const std::uint32_t model_events = events_created(model_rt);
  std::vector<std::unique_ptr<RowLru::Layer>> caches;
  for (std::int32_t l = 0; l < L; ++l) {
    caches.push_back(std::make_unique<RowLru::Layer>(layers_rt, quiet_options(E, cap, 2), six_tensor_layout()));
  }
  const std::uint32_t layer_streams = streams_created(layers_rt);
  const std::uint32_t layer_events = events_created(layers_rt);
  CHECK(model_streams == 1);
  CHECK(layer_streams == static_cast<std::uint32_t>(L));
  // 4 ordering events + one per staging buffer (8 per layer, as the separate caches have).
  CHECK(model_events == 4 + 8 * L);
  CHECK(layer_events == static_cast<std::uint32_t>(L) * (4 + 8));
  CHECK(model.stats().total.host_bytes == [&] {
    std::size_t n = 0;
    for (const auto& c : caches) n += c->stats().host_bytes;
    return n;
  }());

  // Every fill copy of every layer runs on the one copy stream.
  fill_model(model);
  const Stream x = model_rt.create_stream().value();
  model_rt.set_tracing(true);
  for (std::int32_t l = 0; l < L; ++l) REQUIRE(model.prepare(l, Ids{l % E, (3 * l + 1) % E, 7}, x).ok());
  model_rt.drain();
  REQUIRE(model.copy_stream().has_value());
  const std::uint32_t copy_stream = model.copy_stream()->id;
  std::size_t on_copy = 0, elsewhere = 0;
  for (const SimTraceEntry& t : model_rt.trace_log()) {
    if (t.call != SimCall::copy) continue;
    // Slot fills are copies of a tensor row; map uploads are E * 4 = 128 bytes (x's forward maps).
    if (t.bytes != E * sizeof(std::int32_t)) (t.stream == copy_stream ? on_copy : elsewhere) += 1;
  }
  CHECK(on_copy > 0);
  CHECK(elsewhere == 0);
  for (std::int32_t l = 0; l < L; ++l) CHECK(bad_slots(model, l) == 0);

  // The host pool: each tensor's layers are consecutive ranges of one allocation.
  const auto& tensors = model.storage().tensors();
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    if (tensors[t].bytes_per_expert == 0) continue;
    for (std::int32_t l = 0; l + 1 < L; ++l) {
      CHECK(model.host_tensor(l + 1, t, 0) == model.host_tensor(l, t, 0) + E * tensors[t].bytes_per_expert);
    }
  }
  // And the slots: layer l's slot tensors start where layer l-1's end.
  for (std::int32_t l = 0; l + 1 < L; ++l) {
    const ForwardView a = model.layer_view(l).value(), b = model.layer_view(l + 1).value();
    CHECK(b.tensors[0].base == a.tensors[0].base + cap * a.tensors[0].slot_stride);
    CHECK(b.expert_map == a.expert_map + E);
    CHECK(b.resident_map == a.resident_map + E);
  }
}

namespace {

struct LayerReaderLog {
  std::uint64_t runs = 0;
  std::uint64_t mismatches = 0;
};

// A kernel-like reader of layer `layer`'s forward `ids` on `stream`: reads the layer's forward
// and resident ranges and every tensor of each requested slot, and checks what it finds.
template <class Model>
Status launch_layer_reader(SimRuntime& rt, const Model& m, std::int32_t layer, const ForwardView& v, const Ids& ids,
                           Stream stream, std::shared_ptr<LayerReaderLog> log) {
  const std::int32_t E = m.options().num_experts;
  std::vector<Access> accesses;
  accesses.push_back({v.expert_map, static_cast<std::size_t>(E) * sizeof(std::int32_t), AccessMode::read});
  accesses.push_back({v.resident_map, static_cast<std::size_t>(E) * sizeof(std::int32_t), AccessMode::read});
  Ids unique, slots;
  for (std::int32_t e : ids) {
    if (e >= 0 && std::find(unique.begin(), unique.end(), e) == unique.end()) unique.push_back(e);
  }
  for (std::int32_t e : unique) slots.push_back(m.forward_map_host(layer)[static_cast<std::size_t>(e)]);
  for (std::size_t k = 0; k < unique.size(); ++k) {
    for (const SlotTensor& t : v.tensors) {
      if (t.bytes != 0) accesses.push_back({t.slot(slots[k]), t.bytes, AccessMode::read});
    }
  }
  return rt.launch(stream, accesses, [v, layer, E, unique, slots, log]() {
    ++log->runs;
    for (std::size_t k = 0; k < unique.size(); ++k) {
      bool ok = v.expert_map[unique[k]] == slots[k] && v.resident_map[unique[k]] == slots[k];
      for (std::size_t t = 0; ok && t < num_expert_tensors; ++t) {
        for (std::size_t i = 0; i < v.tensors[t].bytes; ++i) {
          if (v.tensors[t].slot(slots[k])[i] != pattern_byte(t, pattern_key(layer, E, unique[k]), i)) {
            ok = false;
            break;
          }
        }
      }
      if (!ok) ++log->mismatches;
    }
  });
}

}  // namespace

TEST_CASE_TEMPLATE("model cache ordering: no race under the seeded random scheduler, readers on two consumer streams", C,
                   RowLru, BlobLfru, RowSieveInline) {
  constexpr std::int32_t L = 3, E = 12, top_k = 2;
  const int seeds = 250;
  std::uint64_t races = 0, mismatches = 0, runs = 0;
  for (int seed = 0; seed < seeds; ++seed) {
    for (const ModelPool pool : {ModelPool::per_layer, ModelPool::global}) {
      SimRuntime rt(SimRuntime::Options{.memory_limit = std::size_t{1} << 28, .seed = 1000u + static_cast<unsigned>(seed),
                                        .max_races = 16, .max_streams = 16});
      const Stream xs[2] = {rt.create_stream().value(), rt.create_stream().value()};
      typename C::Model model(rt, model_options(L, E, pool == ModelPool::global ? 8 : 4, top_k, pool),
                              six_tensor_layout());
      fill_model(model);
      auto log = std::make_shared<LayerReaderLog>();
      detail::SplitMix64 rng{static_cast<std::uint64_t>(seed) * 7919u + (pool == ModelPool::global ? 1 : 0)};
      for (int step = 0; step < 12; ++step) {
        struct Pending {
          std::int32_t layer;
          ForwardView view;
          Ids ids;
          Stream stream;
        };
        std::vector<Pending> pending;
        for (std::int32_t l = 0; l < L; ++l) {
          const Stream x = xs[rng.below(2)];  // layers move between the streams independently
          if (rng.below(8) == 0) REQUIRE(model.invalidate(l, static_cast<std::int32_t>(rng.below(E)), xs[rng.below(2)]).ok());
          const Ids ids = random_forward(rng, E, 2, top_k);
          Result<ForwardView> v = model.prepare(l, ids, x);
          REQUIRE(v.ok());
          Pending p{l, v.value(), ids, x};
          if (pool == ModelPool::global) {
            // A global pool's view lasts until the next prepare of any layer: read it now.
            REQUIRE(launch_layer_reader(rt, model, p.layer, p.view, p.ids, p.stream, log).ok());
          } else {
            pending.push_back(p);  // per_layer: read after the other layers' prepares, as L caches allow
          }
          rt.run_random(rng.next(), rng.below(6));
        }
        for (const Pending& p : pending) REQUIRE(launch_layer_reader(rt, model, p.layer, p.view, p.ids, p.stream, log).ok());
        rt.run_random(rng.next(), rng.below(10));
      }
      rt.drain();
      REQUIRE(rt.idle());
      races += rt.race_count();
      mismatches += log->mismatches;
      runs += log->runs;
    }
  }
  CHECK(races == 0);
  CHECK(mismatches == 0);
  CHECK(runs == static_cast<std::uint64_t>(seeds) * 2 * 12 * L);
}

namespace {

template <class P>
void check_global_against_replay() {
  GeneratorSpec spec;
  spec.layers = 6;
  spec.experts = 16;
  spec.top_k = 3;
  spec.steps = 250;
  spec.seed = 17;
  const Trace trace = generate_trace(spec);
  REQUIRE(trace.layers().size() == 6);
  for (const std::int32_t capacity : {12, 30}) {
    ReplayOptions ro;
    ro.scope = ReplayScope::global;
    ro.capacities = {capacity};
    ro.policies = {std::string(P::name)};
    Result<ReplayReport> report = replay(trace, ro);
    REQUIRE(report.ok());
    const ReplayRow& row = report.value().rows.at(0);

    SimRuntime rt;
    const Stream x = rt.create_stream().value();
    ModelExpertCache<TensorMajorStorage, P, CopyStream, ExplicitLayout, SimRuntime> model(
        rt, model_options(spec.layers, spec.experts, capacity, 1, ModelPool::global), six_tensor_layout());
    fill_model(model);
    for (std::size_t i = 0; i < trace.forwards.size(); ++i) {
      const TraceForward& f = trace.forwards[i];
      const auto ids = trace.experts(f);
      REQUIRE(model.prepare(f.layer, Ids(ids.begin(), ids.end()), x).ok());
      if (i % 97 == 0) {
        rt.drain();
        CHECK(bad_slots(model, f.layer) == 0);
      }
    }
    const ModelCacheStats s = model.stats();
    CHECK(s.total.hits == row.counts.hits);
    CHECK(s.total.misses == row.counts.misses);
    CHECK(s.total.evictions == row.counts.evictions);
    REQUIRE(row.per_layer.size() == 6);
    for (std::size_t l = 0; l < 6; ++l) {
      CHECK(s.per_layer[l].hits == row.per_layer[l].hits);
      CHECK(s.per_layer[l].misses == row.per_layer[l].misses);
    }
    std::uint64_t evictions = 0;
    std::int64_t resident = 0;
    for (const CacheStats& l : s.per_layer) evictions += l.evictions, resident += l.resident;
    CHECK(evictions == s.total.evictions);
    CHECK(resident == model.planner().resident_count());
    rt.drain();
    CHECK(rt.race_count() == 0);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("model cache (global): the same hits and misses as the replay tool's global scope", P, Lru, Lrfu,
                   LayerShare, Sieve, S3Fifo) {
  check_global_against_replay<P>();
}

TEST_CASE("model cache (global): each layer's view reads its own range; a prepare uploads only its layer's forward range") {
  constexpr std::int32_t L = 5, E = 10;
  SimRuntime rt;
  const Stream x = rt.create_stream().value();
  RowLru::Model model(rt, model_options(L, E, 9, 2, ModelPool::global), six_tensor_layout());
  fill_model(model);
  const ForwardView v0 = model.layer_view(0).value();
  for (std::int32_t l = 0; l < L; ++l) {
    const ForwardView v = model.layer_view(l).value();
    CHECK(v.expert_map == v0.expert_map + l * E);
    CHECK(v.resident_map == v0.resident_map + l * E);
    CHECK(v.tensors[0].base == v0.tensors[0].base);  // one pool: the same slot tensors
  }
  detail::SplitMix64 rng{5};
  std::vector<Ids> last(L);  // each layer's last forward (unique ids)
  for (int step = 0; step < 80; ++step) {
    const auto l = static_cast<std::int32_t>(rng.below(L));
    rt.drain();
    const std::vector<std::int32_t> before(v0.expert_map, v0.expert_map + L * E);
    Ids ids = random_forward(rng, E, 2, 2);
    REQUIRE(model.prepare(l, ids, x).ok());
    rt.drain();
    Ids unique;
    for (std::int32_t e : ids) {
      if (e >= 0 && std::find(unique.begin(), unique.end(), e) == unique.end()) unique.push_back(e);
    }
    last[static_cast<std::size_t>(l)] = unique;
    // The device forward map: layer l's range is this forward (global slot ids), every other
    // layer's range is untouched.
    for (std::int32_t j = 0; j < L; ++j) {
      for (std::int32_t e = 0; e < E; ++e) {
        const std::int32_t dev = v0.expert_map[j * E + e];
        if (j != l) {
          CHECK(dev == before[static_cast<std::size_t>(j * E + e)]);
          continue;
        }
        const bool wanted = std::find(unique.begin(), unique.end(), e) != unique.end();
        CHECK((dev != absent_slot) == wanted);
        if (wanted) CHECK(dev == model.planner().resident_map()[static_cast<std::size_t>(j * E + e)]);
      }
    }
    // The device resident map equals the host's everywhere (victims of other layers included).
    const auto host_res = model.planner().resident_map();
    CHECK(std::equal(host_res.begin(), host_res.end(), v0.resident_map));
    CHECK(bad_slots(model, l) == 0);
  }
  // An all-hit forward that changes layer 2's map: one copy of E entries, not L*E.
  REQUIRE(model.prepare(2, Ids{1, 2}, x).ok());
  REQUIRE(model.prepare(2, Ids{1, 2}, x).ok());
  rt.drain();
  const SimCounters c0 = rt.counters();
  Result<ForwardView> v = model.prepare(2, Ids{2}, x);
  REQUIRE(v.ok());
  CHECK(v.value().hits == 1);
  CHECK(v.value().misses == 0);
  CHECK(rt.counters().copies - c0.copies == 1);
  CHECK(rt.counters().copy_bytes - c0.copy_bytes == E * sizeof(std::int32_t));
  rt.drain();
  CHECK(v.value().expert_map[1] == absent_slot);
  CHECK(v.value().expert_map[2] != absent_slot);
  CHECK(v.value().expert_map == v0.expert_map + 2 * E);
  CHECK(rt.race_count() == 0);
}

namespace {

template <class Model>
struct ModelSnapshot {
  std::vector<typename Model::Planner::Snapshot> planners;
  std::vector<std::uint64_t> stats;
  SimCounters counters;
  std::size_t pending = 0;
  std::vector<std::int32_t> device_maps;
  friend bool operator==(const ModelSnapshot&, const ModelSnapshot&) = default;
};

template <class Model>
ModelSnapshot<Model> snapshot(const Model& m, const SimRuntime& rt) {
  ModelSnapshot<Model> s;
  const std::int32_t planners = m.pool() == ModelPool::global ? 1 : m.num_layers();
  for (std::int32_t l = 0; l < planners; ++l) s.planners.push_back(m.planner(l).snapshot());
  const ModelCacheStats st = m.stats();
  auto add = [&](const CacheStats& c) {
    for (std::uint64_t v : {c.hits, c.misses, c.evictions, c.invalidations, c.prepare_calls, c.generation,
                            c.total_copies, c.faults, c.map_uploads, c.owner_changes, c.speculative_issued,
                            c.speculative_wasted, c.speculative_bytes}) {
      s.stats.push_back(v);
    }
    s.stats.push_back(static_cast<std::uint64_t>(c.resident));
  };
  add(st.total);
  for (const CacheStats& c : st.per_layer) add(c);
  s.counters = rt.counters();
  s.pending = rt.pending_ops();
  const std::int32_t E = m.options().num_experts;
  for (std::int32_t l = 0; l < m.num_layers(); ++l) {
    const ForwardView v = m.layer_view(l).value();
    s.device_maps.insert(s.device_maps.end(), v.expert_map, v.expert_map + E);
    s.device_maps.insert(s.device_maps.end(), v.resident_map, v.resident_map + E);
  }
  return s;
}

}  // namespace

TEST_CASE("model cache: bad layer and expert ids are rejected with nothing changed") {
  constexpr std::int32_t L = 3, E = 8;
  for (const ModelPool pool : {ModelPool::per_layer, ModelPool::global}) {
    CAPTURE(to_string(pool));
    SimRuntime rt;
    const Stream x = rt.create_stream().value();
    RowLru::Model model(rt, model_options(L, E, 4, 2, pool), six_tensor_layout());
    fill_model(model);
    REQUIRE(model.prepare(0, Ids{1, 2}, x).ok());
    REQUIRE(model.prepare(2, Ids{3, 5}, x).ok());
    rt.drain();
    const auto before = snapshot(model, rt);
    for (const std::int32_t layer : {-1, L, L + 7, std::numeric_limits<std::int32_t>::min()}) {
      Result<ForwardView> p = model.prepare(layer, Ids{1}, x);
      REQUIRE_FALSE(p.ok());
      CHECK(p.status().code() == ErrorCode::invalid_argument);
      CHECK(std::string(p.status().message()).find("layer") != std::string::npos);
      CHECK(model.prepare_unique(layer, Ids{1}, x).status().code() == ErrorCode::invalid_argument);
      CHECK(model.invalidate(layer, 1, x).code() == ErrorCode::invalid_argument);
      CHECK(model.layer_view(layer).status().code() == ErrorCode::invalid_argument);
      CHECK(snapshot(model, rt) == before);
    }
    // Expert ids are per layer: E is out of range even where a global pool has key L*E > E.
    CHECK(model.prepare(0, Ids{1, E}, x).status().code() == ErrorCode::expert_out_of_range);
    CHECK(model.prepare_unique(1, Ids{-1}, x).status().code() == ErrorCode::expert_out_of_range);
    CHECK(model.prepare_unique(1, Ids{2, 2}, x).status().code() == ErrorCode::duplicate_expert);
    CHECK(model.prepare(1, Ids{0, 1, 2, 3, 4}, x).status().code() == ErrorCode::too_many_experts);
    CHECK(model.invalidate(0, E, x).code() == ErrorCode::expert_out_of_range);
    CHECK(model.invalidate(0, -1, x).code() == ErrorCode::expert_out_of_range);
    CHECK(snapshot(model, rt) == before);
    // Still usable afterwards.
    REQUIRE(model.prepare(1, Ids{0, 7}, x).ok());
    rt.drain();
    CHECK(bad_slots(model, 1) == 0);
    CHECK(rt.race_count() == 0);
  }
  SimRuntime rt;
  using Model = RowLru::Model;
  CHECK_THROWS_AS(Model(rt, model_options(0, E, 4, 1), six_tensor_layout()), Error);
  CHECK_THROWS_AS(Model(rt, model_options(L, 0, 4, 1), six_tensor_layout()), Error);
  CHECK_THROWS_AS(Model(rt, model_options(L, E, E + 1, 1), six_tensor_layout()), Error);  // per layer <= E
  CHECK_NOTHROW(Model(rt, model_options(L, E, E + 1, 1, ModelPool::global), six_tensor_layout()));  // pool <= L*E
  CHECK_THROWS_AS(Model(rt, model_options(L, E, 2, 3), six_tensor_layout()), Error);  // capacity < top_k
  ModelCacheOptions wrong = model_options(L, E, 4, 1);
  wrong.layer_capacities = {4, 4};
  CHECK_THROWS_AS(Model(rt, wrong, six_tensor_layout()), Error);
  wrong = model_options(L, E, 4, 1, ModelPool::global);
  wrong.layer_capacities = {4, 4, 4};
  CHECK_THROWS_AS(Model(rt, wrong, six_tensor_layout()), Error);
}

TEST_CASE("model cache: an injected fault drops the layer's fills, the next prepare refetches them") {
  constexpr std::int32_t L = 3, E = 8;
  for (const ModelPool pool : {ModelPool::per_layer, ModelPool::global}) {
    CAPTURE(to_string(pool));
    SimRuntime rt;
    const Stream x = rt.create_stream().value();
    RowLru::Model model(rt, model_options(L, E, 4, 2, pool), six_tensor_layout());
    fill_model(model);
    REQUIRE(model.prepare(0, Ids{1, 2}, x).ok());
    rt.inject_failure(FaultKind::copy, 2);
    Result<ForwardView> failed = model.prepare(1, Ids{3, 4}, x);
    REQUIRE_FALSE(failed.ok());
    CHECK(failed.status().code() == ErrorCode::runtime_failure);
    CHECK(model.stats().per_layer[1].faults == 1);
    CHECK(model.resident_map_host(1)[3] == absent_slot);
    CHECK(model.resident_map_host(1)[4] == absent_slot);
    Result<ForwardView> again = model.prepare(1, Ids{3, 4}, x);
    REQUIRE(again.ok());
    CHECK(again.value().misses == 2);
    rt.drain();
    for (std::int32_t l = 0; l < L; ++l) CHECK(bad_slots(model, l) == 0);
    const ForwardView v = model.layer_view(0).value();
    if (pool == ModelPool::global) {
      const auto res = model.planner().resident_map();
      CHECK(std::equal(res.begin(), res.end(), v.resident_map));
    } else {
      for (std::int32_t l = 0; l < 2; ++l) {  // the prepared layers (layer 2's maps are not written yet)
        const auto res = model.resident_map_host(l);
        CHECK(std::equal(res.begin(), res.end(), model.layer_view(l).value().resident_map));
      }
    }
    CHECK(rt.race_count() == 0);
  }
}

TEST_CASE("ordering core readers: a shared core keeps one owner per reader (a single owner would race)") {
  // Layer 0 prepares on S1, layer 1 on S2, layer 0's kernel reads its slot on S1 (still valid:
  // only layer 0's next prepare retires that view), then layer 0 refills its slot from S2. Its
  // fill must wait for S1's reader: reader 0's owner is S1 even though the core's last owner is S2.
  for (const std::size_t readers : {std::size_t{2}, std::size_t{1}}) {
    CAPTURE(readers);
    SimRuntime rt;
    const Stream s1 = rt.create_stream().value(), s2 = rt.create_stream().value();
    OrderingCore<SimRuntime> core(rt, true, 4, 4, readers);
    auto* src = static_cast<std::byte*>(rt.allocate(64, MemoryKind::pinned_host).value());
    auto* slot0 = static_cast<std::byte*>(rt.allocate(64, MemoryKind::device).value());
    auto* slot1 = static_cast<std::byte*>(rt.allocate(64, MemoryKind::device).value());
    const std::size_t r0 = 0, r1 = readers - 1;
    auto fill = [&](std::byte* slot) {
      return [&rt, slot, src](Stream f) noexcept { return rt.copy_async(slot, src, 64, f); };
    };
    REQUIRE(core.write(s1, WritePurpose::fill, MapUpload{}, fill(slot0), r0).ok());
    REQUIRE(core.write(s2, WritePurpose::fill, MapUpload{}, fill(slot1), r1).ok());
    const Access read0{slot0, 64, AccessMode::read};
    REQUIRE(rt.launch(s1, std::span<const Access>(&read0, 1)).ok());
    REQUIRE(core.write(s2, WritePurpose::fill, MapUpload{}, fill(slot0), r0).ok());
    CHECK(core.owner() == s2);
    CHECK(core.owner(r0) == s2);
    rt.drain();
    if (readers == 2) {
      CHECK(rt.race_count() == 0);
    } else {
      CHECK(rt.race_count() > 0);  // the single-owner core loses S1's reader
    }
    CHECK(core.write(s1, WritePurpose::read_only, MapUpload{}, fill(slot0), readers).code() ==
          ErrorCode::invalid_argument);
  }
}

TEST_CASE("model cache: caller host tensors ([L][E] per tensor) and slot workspace are used in place, never copied") {
  constexpr std::int32_t L = 3, E = 8, cap = 3;
  const ExpertTensorBytes tensors = six_tensor_layout().tensors();
  SimRuntime rt, ref_rt;
  CallerHostTensors host(tensors, L * E);  // expert l*E + e holds layer l's expert e (pattern_key)
  const auto before = host.lines;
  const std::size_t ws_bytes = TensorMajorStorage<SimRuntime>::slot_workspace_bytes({L * E, L * cap}, tensors);
  auto* ws = static_cast<std::byte*>(rt.allocate(ws_bytes, MemoryKind::device).value());
  const std::size_t ws_allocated = rt.allocated_bytes();
  using Model = RowLru::Model;
  const Model ref(ref_rt, model_options(L, E, cap, 2), six_tensor_layout());  // its own pools and slots
  ModelCacheOptions o = model_options(L, E, cap, 2);
  o.memory = host.memory();
  o.memory.slot_workspace = MemorySpan{ws, ws_bytes};
  {
    Model model(rt, o, six_tensor_layout());
    CHECK(model.storage().caller_host());
    CHECK(model.storage().caller_slots());
    std::size_t own_bytes = 0;  // what ref allocated for pools and slots
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const std::size_t b = tensors[t].bytes_per_expert;
      if (b == 0) continue;
      for (std::int32_t l = 0; l < L; ++l) {
        CHECK(model.host_tensor(l, t, 5) == host.data(t) + static_cast<std::size_t>(l * E + 5) * b);  // the caller's
        const std::byte* slots = model.layer_view(l).value().tensors[t].base;
        CHECK((slots >= ws && slots + cap * b <= ws + ws_bytes));
      }
      CHECK(rt.is_registered(host.data(t), host.bytes[t]));
      own_bytes += host.bytes[t] + L * cap * b;
    }
    CHECK(rt.allocated_bytes() - ws_allocated == ref_rt.allocated_bytes() - own_bytes);  // no pool, no slots

    // Fills from the caller's tensors: every layer's resident experts hold their own bytes.
    const Stream x = rt.create_stream().value();
    for (int step = 0; step < 6; ++step)
      for (std::int32_t l = 0; l < L; ++l) REQUIRE(model.prepare(l, Ids{(l + step) % E, (3 * step + 1) % E}, x).ok());
    rt.drain();
    for (std::int32_t l = 0; l < L; ++l) CHECK(bad_slots(model, l) == 0);
    CHECK(rt.races().empty());
  }
  CHECK(rt.registered_ranges() == 0);           // unregistered with the cache
  CHECK(rt.allocated_bytes() == ws_allocated);  // the workspace is the caller's: not freed
  for (std::size_t t = 0; t < num_expert_tensors; ++t)
    if (host.bytes[t] != 0) CHECK(std::memcmp(before[t].data(), host.lines[t].data(), host.bytes[t]) == 0);  // never written
  REQUIRE(rt.deallocate(ws).ok());
}

// ---- prefetch: lookahead through the model-level cache -------------------------------------

namespace {

// Hints for a forward: most of its experts (about 3 in 4), then other ids, best first, distinct.
Ids hints_for(detail::SplitMix64& rng, const Ids& forward, std::int32_t experts) {
  Ids out;
  const auto add = [&](std::int32_t e) {
    if (e >= 0 && std::find(out.begin(), out.end(), e) == out.end()) out.push_back(e);
  };
  for (const std::int32_t e : forward) {
    if (rng.below(4) != 0) add(e);
  }
  const auto extra = rng.below(4);
  for (std::uint32_t i = 0; i < extra; ++i) add(static_cast<std::int32_t>(rng.below(static_cast<std::uint32_t>(experts))));
  return out;
}

PrefetchOptions budget_of(std::uint32_t fills, std::uint32_t expires_after = 1) {
  PrefetchOptions o;
  o.max_bytes = static_cast<std::int64_t>(fills * total_bytes_per_expert(six_tensor_layout().tensors()));
  o.expires_after = expires_after;
  return o;
}

}  // namespace

TEST_CASE_TEMPLATE("model cache (per_layer): prefetch gives the same fills, hits and counters as L separate ExpertCaches", C,
                   RowLru, BlobLfru, RowSieveInline) {
  constexpr std::int32_t L = 4, E = 16, top_k = 2;
  const std::vector<std::int32_t> caps = {4, 6, 5, 8};
  SimRuntime model_rt, layers_rt;
  const Stream mx = model_rt.create_stream().value();
  const Stream lx = layers_rt.create_stream().value();
  ModelCacheOptions mo = model_options(L, E, 0, top_k);
  mo.layer_capacities = caps;
  typename C::Model model(model_rt, mo, six_tensor_layout());
  fill_model(model);
  std::vector<std::unique_ptr<typename C::Layer>> caches;
  for (std::int32_t l = 0; l < L; ++l) {
    caches.push_back(std::make_unique<typename C::Layer>(layers_rt, quiet_options(E, caps[static_cast<std::size_t>(l)], top_k),
                                                         six_tensor_layout()));
    fill_layer_cache(*caches.back(), l);
  }
  detail::SplitMix64 rng{7};
  std::size_t mismatched_maps = 0, bad = 0, views_differ = 0;
  for (int step = 0; step < 120; ++step) {
    std::vector<Ids> forwards;
    for (std::int32_t l = 0; l < L; ++l) forwards.push_back(random_forward(rng, E, 2, top_k));
    for (std::int32_t l = 0; l < L; ++l) {
      const auto li = static_cast<std::size_t>(l);
      Result<ForwardView> mv = model.prepare(l, forwards[li], mx);
      Result<ForwardView> cv = caches[li]->prepare(forwards[li], lx);
      REQUIRE(mv.ok());
      REQUIRE(cv.ok());
      CHECK(mv.value().hits == cv.value().hits);
      CHECK(mv.value().misses == cv.value().misses);
      if (l + 1 < L) {  // layer l+1's hints while layer l computes
        const Ids hints = hints_for(rng, forwards[li + 1], E);
        PrefetchOptions po = budget_of(rng.below(4), 1 + rng.below(2));
        std::vector<float> scores;
        if (step % 3 == 2) {  // scored hints every third step: the selection runs per layer too
          for (std::size_t i = 0; i < hints.size(); ++i) scores.push_back(static_cast<float>(rng.below(100)) / 99.0f);
          po.scores = scores;
        }
        Result<PrefetchView> mp = model.prefetch(l + 1, hints, mx, po);
        Result<PrefetchView> cp = caches[li + 1]->prefetch(hints, lx, po);
        REQUIRE(mp.ok());
        REQUIRE(cp.ok());
        const PrefetchView& a = mp.value();
        const PrefetchView& b = cp.value();
        if (a.issued != b.issued || a.evictions != b.evictions || a.skipped_resident != b.skipped_resident ||
            a.skipped_no_victim != b.skipped_no_victim || a.skipped_unlikely != b.skipped_unlikely ||
            a.skipped_imprecise != b.skipped_imprecise || a.bytes != b.bytes) {
          ++views_differ;
        }
      }
    }
    model_rt.drain();
    layers_rt.drain();
    for (std::int32_t l = 0; l < L; ++l) {
      const auto rm = model.resident_map_host(l), rc = caches[static_cast<std::size_t>(l)]->resident_map_host();
      const ForwardView v = model.layer_view(l).value();
      for (std::int32_t e = 0; e < E; ++e) {
        const auto i = static_cast<std::size_t>(e);
        if (rm[i] != rc[i] || v.resident_map[e] != rm[i]) ++mismatched_maps;
      }
      bad += bad_slots(model, l);  // every resident expert, speculative fills included, holds its bytes
      check_plan_stats_equal(model.stats().per_layer[static_cast<std::size_t>(l)],
                             caches[static_cast<std::size_t>(l)]->stats());
    }
  }
  CHECK(views_differ == 0);
  CHECK(mismatched_maps == 0);
  CHECK(bad == 0);
  CHECK(model_rt.race_count() == 0);
  const ModelCacheStats s = model.stats();
  CHECK(s.total.speculative_issued > 0);
  CHECK(s.total.speculative_used > 0);
  CHECK(s.total.speculative_wasted > 0);
  std::uint64_t issued = 0;
  for (const auto& c : caches) issued += c->stats().speculative_issued;
  CHECK(s.total.speculative_issued == issued);
}

TEST_CASE("model cache (global): a prefetch keeps the pool's latest forward, counts victims per layer, and is used") {
  constexpr std::int32_t L = 3, E = 8;
  SimRuntime rt;
  const Stream x = rt.create_stream().value();
  RowLru::Model model(rt, model_options(L, E, 6, 2, ModelPool::global), six_tensor_layout());
  fill_model(model);
  REQUIRE(model.prepare(0, Ids{0, 1}, x).ok());
  REQUIRE(model.prepare(1, Ids{2, 3}, x).ok());
  REQUIRE(model.prepare(2, Ids{4, 5}, x).ok());  // the pool is full: layers 0, 1 and 2 hold two each
  // Layer 0's next experts while layer 2 computes: two fills, whose victims are not layer 2's.
  Result<PrefetchView> p = model.prefetch(0, Ids{6, 7, 0}, x, budget_of(2));
  REQUIRE(p.ok());
  CHECK(p.value().issued == 2);
  CHECK(p.value().evictions == 2);
  CHECK(p.value().skipped_resident == 1);  // 0: listed, so kept (and counted once examined)
  const auto layer2 = model.resident_map_host(2);
  CHECK(layer2[4] != absent_slot);
  CHECK(layer2[5] != absent_slot);
  ModelCacheStats s = model.stats();
  CHECK(s.total.speculative_issued == 2);
  std::int64_t resident = 0;
  std::uint64_t evictions = 0;
  for (const CacheStats& c : s.per_layer) resident += c.resident, evictions += c.evictions;
  CHECK(resident == model.planner().resident_count());
  CHECK(evictions == 2);
  // LRU's victims are the pool's oldest that the list does not name: layer 0's 1 and layer 1's 2
  // (0 is listed, so it stays with the two fills).
  CHECK(s.per_layer[0].resident == 3);
  CHECK(s.per_layer[0].evictions == 1);
  CHECK(s.per_layer[1].resident == 1);
  CHECK(s.per_layer[1].evictions == 1);
  CHECK(s.per_layer[2].resident == 2);
  CHECK(model.resident_map_host(0)[0] != absent_slot);
  Result<ForwardView> v = model.prepare(0, Ids{6, 7}, x);
  REQUIRE(v.ok());
  CHECK(v.value().hits == 2);
  CHECK(v.value().misses == 0);
  s = model.stats();
  CHECK(s.total.speculative_used == 2);
  CHECK(s.per_layer[0].speculative_bytes == 2 * total_bytes_per_expert(six_tensor_layout().tensors()));
  rt.drain();
  CHECK(bad_slots(model, 0) == 0);
  CHECK(bad_slots(model, 2) == 0);
  CHECK(rt.race_count() == 0);
}

TEST_CASE("model cache prefetch: bad input gets a specific error and changes nothing") {
  constexpr std::int32_t L = 3, E = 8;
  for (const ModelPool pool : {ModelPool::per_layer, ModelPool::global}) {
    CAPTURE(to_string(pool));
    SimRuntime rt;
    const Stream x = rt.create_stream().value();
    RowLru::Model model(rt, model_options(L, E, 4, 2, pool), six_tensor_layout());
    fill_model(model);
    REQUIRE(model.prepare(0, Ids{1, 2}, x).ok());
    REQUIRE(model.prefetch(1, Ids{3}, x, budget_of(1)).ok());
    rt.drain();
    const auto before = snapshot(model, rt);
    for (const std::int32_t layer : {-1, L, std::numeric_limits<std::int32_t>::max()}) {
      Result<PrefetchView> p = model.prefetch(layer, Ids{1}, x, budget_of(1));
      REQUIRE_FALSE(p.ok());
      CHECK(p.status().code() == ErrorCode::invalid_argument);
      CHECK(std::string(p.status().message()).find("layer") != std::string::npos);
    }
    // Per layer ids: E is out of range although a global pool's key L*E + E would exist.
    CHECK(model.prefetch(1, Ids{4, E}, x, budget_of(2)).status().code() == ErrorCode::expert_out_of_range);
    CHECK(model.prefetch(1, Ids{-1}, x, budget_of(1)).status().code() == ErrorCode::expert_out_of_range);
    CHECK(model.prefetch(1, Ids{0, 1, 2, 3, 4, 5, 6, 7, 0}, x, budget_of(1)).status().code() ==
          ErrorCode::too_many_experts);
    PrefetchOptions negative = budget_of(1);
    negative.max_bytes = -1;
    CHECK(model.prefetch(1, Ids{4}, x, negative).status().code() == ErrorCode::invalid_argument);
    CHECK(model.prefetch(1, Ids{4}, x, budget_of(1, 0)).status().code() == ErrorCode::invalid_argument);
    const std::vector<float> one_score = {0.9f};
    PrefetchOptions scored = budget_of(2);
    scored.scores = one_score;  // one score for two ids
    CHECK(model.prefetch(1, Ids{4, 5}, x, scored).status().code() == ErrorCode::invalid_argument);
    const std::vector<float> nan_score = {std::numeric_limits<float>::quiet_NaN()};
    scored.scores = nan_score;
    CHECK(model.prefetch(1, Ids{4}, x, scored).status().code() == ErrorCode::invalid_argument);
    // A shared pool's last forward is another layer's: the promise cannot cover it.
    if (pool == ModelPool::global) {
      PrefetchOptions evict = budget_of(1);
      evict.evict_last_forward = true;
      const Result<PrefetchView> p = model.prefetch(1, Ids{4}, x, evict);
      REQUIRE_FALSE(p.ok());
      CHECK(p.status().code() == ErrorCode::invalid_argument);
      CHECK(std::string(p.status().message()).find("evict_last_forward") != std::string::npos);
    }
    CHECK(snapshot(model, rt) == before);
    // Still usable afterwards; a zero budget plans nothing and enqueues nothing.
    REQUIRE(model.prefetch(2, Ids{5}, x, budget_of(0)).ok());
    CHECK(snapshot(model, rt) == before);
    REQUIRE(model.prepare(1, Ids{3, 6}, x).ok());
    rt.drain();
    CHECK(bad_slots(model, 1) == 0);
    CHECK(rt.race_count() == 0);
  }
}

namespace {

struct ModelDetected {
  std::size_t races = 0;
  std::uint64_t mismatches = 0;
};

template <class Edges, class StagingT>
using EdgeModel = detail::ModelExpertCacheWithEdges<TensorMajorStorage, Lru, StagingT, ExplicitLayout, SimRuntime, Edges>;

// Edge 9: prefetch(layer 1, {2}), then an all-hit prepare of layer 1 using 2 on the consumer
// stream and a reader of its slots: only the slot's event orders the reader after the copy (the
// call's `ready` is recorded before its fills).
template <class Edges>
ModelDetected model_reads_speculative_fill(ModelPool pool) {
  SimRuntime rt;
  const Stream x = rt.create_stream().value();
  EdgeModel<Edges, CopyStream> model(rt, model_options(2, 8, 4, 2, pool), six_tensor_layout());
  fill_model(model);
  auto log = std::make_shared<LayerReaderLog>();
  REQUIRE(model.prepare(1, Ids{0, 1}, x).ok());
  REQUIRE(model.prefetch(1, Ids{2}, x, budget_of(1)).ok());
  REQUIRE(model.stats().total.speculative_issued == 1);
  Result<ForwardView> v = model.prepare(1, Ids{0, 2}, x);
  REQUIRE(v.ok());
  REQUIRE(model.stats().per_layer[1].last_copies == 0);  // all hits: nothing else orders the reader
  REQUIRE(launch_layer_reader(rt, model, 1, v.value(), Ids{0, 2}, x, log).ok());
  rt.drain();
  if (!rt.races().empty()) MESSAGE(rt.races()[0].description);
  return {rt.races().size(), log->mismatches};
}

// Edge 11: forward {0, 1} of layer 0, a first prefetch (reserves the speculative stream), the same
// forward again (adopted after it), prefetch(layer 0, {2}) (on the speculative stream, after that
// adoption), invalidate(2), then a forward whose miss 3 takes 2's freed slot: only the slot's
// pending-fill event orders that copy after the speculative one.
template <class Edges>
ModelDetected model_refills_pending_slot(ModelPool pool) {
  SimRuntime rt;
  const Stream x = rt.create_stream().value();
  EdgeModel<Edges, CopyStream> model(rt, model_options(2, 8, 4, 2, pool), six_tensor_layout());
  fill_model(model);
  auto log = std::make_shared<LayerReaderLog>();
  REQUIRE(model.prepare(0, Ids{0, 1}, x).ok());
  REQUIRE(model.prefetch(0, Ids{0}, x, budget_of(1)).ok());  // resident: no fill
  REQUIRE(model.prepare(0, Ids{0, 1}, x).ok());
  REQUIRE(model.prefetch(0, Ids{2}, x, budget_of(1)).ok());
  REQUIRE(model.stats().total.speculative_issued == 1);
  const std::int32_t freed = model.resident_map_host(0)[2];
  REQUIRE(model.invalidate(0, 2, x).ok());
  Result<ForwardView> v = model.prepare(0, Ids{0, 3}, x);
  REQUIRE(v.ok());
  REQUIRE(model.forward_map_host(0)[3] == freed);
  REQUIRE(launch_layer_reader(rt, model, 0, v.value(), Ids{0, 3}, x, log).ok());
  rt.drain();
  if (!rt.races().empty()) MESSAGE(rt.races()[0].description);
  return {rt.races().size(), log->mismatches};
}

// evict_last_forward (per-layer pool, 2 slots per layer, top_k 2): forward {0, 1} of layer 0, a
// prefetch that reserves the speculative stream, forward {1, 0} (adopted, its reader on x), then
// from another stream a prefetch of layer 0 that may evict that forward's slots: only the slot's
// release (edge 1) orders the fill after the reader; the adoption event comes before it.
template <class Edges>
ModelDetected model_evicts_last_forward() {
  SimRuntime rt;
  const Stream x = rt.create_stream().value();
  const Stream y = rt.create_stream().value();
  EdgeModel<Edges, CopyStream> model(rt, model_options(2, 8, 2, 2, ModelPool::per_layer), six_tensor_layout());
  fill_model(model);
  auto log = std::make_shared<LayerReaderLog>();
  REQUIRE(model.prepare(0, Ids{0, 1}, x).ok());
  REQUIRE(model.prefetch(0, Ids{0}, x, budget_of(1)).ok());  // resident: no fill
  Result<ForwardView> v = model.prepare(0, Ids{1, 0}, x);
  REQUIRE(v.ok());
  REQUIRE(launch_layer_reader(rt, model, 0, v.value(), Ids{1, 0}, x, log).ok());
  PrefetchOptions o = budget_of(1);
  o.evict_last_forward = true;
  REQUIRE(model.prefetch(0, Ids{2}, y, o).ok());
  REQUIRE(model.stats().total.speculative_issued == 1);
  rt.drain();
  if (!rt.races().empty()) MESSAGE(rt.races()[0].description);
  return {rt.races().size(), log->mismatches};
}

}  // namespace

TEST_CASE("negative (edge 1, model cache, evict_last_forward): a prefetch into the last forward's slots waits for its reader") {
  const ModelDetected with = model_evicts_last_forward<OrderingEdges>();
  CHECK(with.races == 0);
  CHECK(with.mismatches == 0);
  const ModelDetected without = model_evicts_last_forward<NoReleaseWait>();
  CHECK(without.races > 0);
}

TEST_CASE("negative (edge 9, model cache): a prepare using a speculative fill waits for its slot; without the wait it races the copy") {
  for (const ModelPool pool : {ModelPool::per_layer, ModelPool::global}) {
    CAPTURE(to_string(pool));
    const ModelDetected with = model_reads_speculative_fill<OrderingEdges>(pool);
    CHECK(with.races == 0);
    CHECK(with.mismatches == 0);
    const ModelDetected without = model_reads_speculative_fill<NoSpeculativeSlotWait>(pool);
    CHECK(without.races > 0);
  }
}

TEST_CASE("negative (edge 11, model cache): a refill of a slot waits for its pending speculative fill; without it the writes race") {
  for (const ModelPool pool : {ModelPool::per_layer, ModelPool::global}) {
    CAPTURE(to_string(pool));
    const ModelDetected with = model_refills_pending_slot<OrderingEdges>(pool);
    CHECK(with.races == 0);
    CHECK(with.mismatches == 0);
    const ModelDetected without = model_refills_pending_slot<NoSpeculativeOverwriteWait>(pool);
    CHECK(without.races > 0);
  }
}

TEST_CASE("model cache prefetch after the layer's adopted forward: on the speculative stream, not ahead of the next prepare's copies") {
  for (const ModelPool pool : {ModelPool::per_layer, ModelPool::global}) {
    CAPTURE(to_string(pool));
    SimRuntime rt;
    const Stream x = rt.create_stream().value();
    RowLru::Model model(rt, model_options(3, 8, 4, 2, pool), six_tensor_layout());
    fill_model(model);
    REQUIRE(model.prepare(1, Ids{0, 1}, x).ok());
    REQUIRE(model.prefetch(1, Ids{0}, x, budget_of(1)).ok());  // resident: reserves the speculative stream
    REQUIRE(model.prepare(1, Ids{0, 1}, x).ok());              // adopted after it
    REQUIRE(model.prepare(0, Ids{5, 6}, x).ok());              // layer 0's forward (global: now the latest)
    REQUIRE(model.copy_stream().has_value());
    const Stream copy = *model.copy_stream();
    const std::size_t on_caller = rt.pending_ops(x), on_copy = rt.pending_ops(copy), total = rt.pending_ops();
    const Result<PrefetchView> p = model.prefetch(1, Ids{2, 3}, x, budget_of(2));
    REQUIRE(p.ok());
    REQUIRE(p.value().issued == 2);
    // Global: the pool's latest forward is layer 0's, adopted after the first prefetch, and its
    // experts are protected: the same path.
    CHECK(rt.pending_ops() > total);
    CHECK(rt.pending_ops(x) == on_caller);
    CHECK(rt.pending_ops(copy) == on_copy);  // nothing in front of layer 1's next demand copies
    Result<ForwardView> v = model.prepare(1, Ids{2, 7}, x);
    REQUIRE(v.ok());
    CHECK(v.value().hits == 1);
    auto log = std::make_shared<LayerReaderLog>();
    REQUIRE(launch_layer_reader(rt, model, 1, v.value(), Ids{2, 7}, x, log).ok());
    rt.drain();
    CHECK(rt.race_count() == 0);
    CHECK(log->mismatches == 0);
    CHECK(bad_slots(model, 1) == 0);
  }
}


namespace {

// A wide forward with stream admission after a prefetch: prefetch(layer 1, {2}), then
// prepare_wide of layer 1 over {2, 5}, whose round reads 2 from its pool slot.
template <class Edges>
ModelDetected model_wide_reads_speculative_fill(ModelPool pool) {
  SimRuntime rt;
  const Stream x = rt.create_stream().value();
  ModelCacheOptions o = model_options(2, 8, 4, 2, pool);
  o.stream_slots = 2;
  EdgeModel<Edges, CopyStream> model(rt, o, six_tensor_layout());
  fill_model(model);
  auto log = std::make_shared<LayerReaderLog>();
  REQUIRE(model.prepare(1, Ids{0, 1}, x).ok());
  REQUIRE(model.prefetch(1, Ids{2}, x, budget_of(1)).ok());
  REQUIRE(model.stats().total.speculative_issued == 1);
  std::uint32_t rounds_read = 0;
  Result<WideSummary> w = model.prepare_wide(1, Ids{2, 5}, x, [&](const WideRound& r) noexcept {
    std::vector<Access> acc;
    const Ids ids(r.experts.begin(), r.experts.end()), slots(r.slots.begin(), r.slots.end());
    for (const std::int32_t slot : slots)
      for (const SlotTensor& t : r.view.tensors)
        if (t.bytes != 0) acc.push_back({t.slot(slot), t.bytes, AccessMode::read});
    ++rounds_read;
    const ForwardView v = r.view;
    return rt.launch(x, acc, [v, ids, slots, log]() {
      ++log->runs;
      for (std::size_t k = 0; k < ids.size(); ++k)
        for (std::size_t t = 0; t < num_expert_tensors; ++t)
          for (std::size_t i = 0; i < v.tensors[t].bytes; ++i)
            if (v.tensors[t].slot(slots[k])[i] != pattern_byte(t, pattern_key(1, 8, ids[k]), i)) {
              ++log->mismatches;
              return;
            }
    });
  });
  REQUIRE(w.ok());
  REQUIRE(w.value().hits == 1);  // 2, from its pool slot
  REQUIRE(rounds_read >= 1);
  rt.drain();
  if (!rt.races().empty()) MESSAGE(rt.races()[0].description);
  return {rt.races().size(), log->mismatches};
}

}  // namespace

// The wide forward waits for the slot's event; its first round's fill goes on the same fill
// stream after the speculative copy and the consumer waits for that round, which orders the read
// as well: with edge 9 removed the detector stays silent too (edge 9's negative halves are the
// prepare() case above and ExpertCache's).
TEST_CASE("model cache wide forward: a round reading a speculative fill from the pool reads its landed bytes") {
  for (const ModelPool pool : {ModelPool::per_layer, ModelPool::global}) {
    CAPTURE(to_string(pool));
    const ModelDetected with = model_wide_reads_speculative_fill<OrderingEdges>(pool);
    CHECK(with.races == 0);
    CHECK(with.mismatches == 0);
    const ModelDetected without_9 = model_wide_reads_speculative_fill<NoSpeculativeSlotWait>(pool);
    CHECK(without_9.races == 0);
    CHECK(without_9.mismatches == 0);
  }
}

TEST_CASE_TEMPLATE("model cache ordering with prefetch: no race under the seeded random scheduler, two consumer streams",
                   C, RowLru, BlobLfru, RowSieveInline) {
  constexpr std::int32_t L = 3, E = 12, top_k = 2;
  const int seeds = 120;
  std::uint64_t races = 0, mismatches = 0, runs = 0, issued = 0, used = 0;
  for (int seed = 0; seed < seeds; ++seed) {
    for (const ModelPool pool : {ModelPool::per_layer, ModelPool::global}) {
      SimRuntime rt(SimRuntime::Options{.memory_limit = std::size_t{1} << 28, .seed = 5000u + static_cast<unsigned>(seed),
                                        .max_races = 16, .max_streams = 16});
      const Stream xs[2] = {rt.create_stream().value(), rt.create_stream().value()};
      typename C::Model model(rt, model_options(L, E, pool == ModelPool::global ? 9 : 5, top_k, pool),
                              six_tensor_layout());
      fill_model(model);
      auto log = std::make_shared<LayerReaderLog>();
      detail::SplitMix64 rng{static_cast<std::uint64_t>(seed) * 104729u + (pool == ModelPool::global ? 1 : 0)};
      for (int step = 0; step < 12; ++step) {
        std::vector<Ids> forwards;
        for (std::int32_t l = 0; l < L; ++l) forwards.push_back(random_forward(rng, E, 2, top_k));
        struct Pending {
          std::int32_t layer;
          ForwardView view;
          Ids ids;
          Stream stream;
        };
        std::vector<Pending> pending;
        for (std::int32_t l = 0; l < L; ++l) {
          const auto li = static_cast<std::size_t>(l);
          const Stream x = xs[rng.below(2)];
          if (rng.below(8) == 0) REQUIRE(model.invalidate(l, static_cast<std::int32_t>(rng.below(E)), xs[rng.below(2)]).ok());
          Result<ForwardView> v = model.prepare(l, forwards[li], x);
          REQUIRE(v.ok());
          Pending p{l, v.value(), forwards[li], x};
          if (pool == ModelPool::global) {
            // A global pool's view lasts until the next prepare or prefetch of any layer: read it now.
            REQUIRE(launch_layer_reader(rt, model, p.layer, p.view, p.ids, p.stream, log).ok());
          } else {
            pending.push_back(p);
          }
          if (l + 1 < L && rng.below(3) != 0) {
            const Ids hints = hints_for(rng, forwards[li + 1], E);
            REQUIRE(model.prefetch(l + 1, hints, xs[rng.below(2)], budget_of(1 + rng.below(3), 1 + rng.below(2))).ok());
          }
          rt.run_random(rng.next(), rng.below(6));
        }
        for (const Pending& p : pending) REQUIRE(launch_layer_reader(rt, model, p.layer, p.view, p.ids, p.stream, log).ok());
        rt.run_random(rng.next(), rng.below(10));
      }
      rt.drain();
      REQUIRE(rt.idle());
      races += rt.race_count();
      mismatches += log->mismatches;
      runs += log->runs;
      issued += model.stats().total.speculative_issued;
      used += model.stats().total.speculative_used;
    }
  }
  CHECK(races == 0);
  CHECK(mismatches == 0);
  CHECK(runs == static_cast<std::uint64_t>(seeds) * 2 * 12 * L);
  CHECK(issued > 0);
  CHECK(used > 0);
}
