// ModelBridge (python/src/model_bridge.hpp: the model-level cache as the PyTorch extension drives
// it) on SimRuntime: per-layer pools plan each layer exactly as the reference planner of that
// layer, the global pool serves every layer from one set of slots, every layer's slots hold the
// bytes of the experts its map names, the eviction policy is chosen by name, and bad config,
// host tensors, layers and ids are refused with a specific message and nothing changed.
#include <doctest/doctest.h>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "expert_cache/runtime/sim_runtime.hpp"
#include "model_bridge.hpp"
#include "vllm_bridge.hpp"

using namespace expert_cache;
using namespace expert_cache::python;
using Stream = SimRuntime::Stream;
using Model = ModelBridge<SimRuntime>;

namespace {

SimRuntime::Options sim_options() {
  return SimRuntime::Options{.memory_limit = std::size_t{1} << 28, .seed = 9, .max_races = 64, .max_streams = 64};
}

constexpr std::int32_t L = 3, E = 8;
const std::vector<std::pair<std::string, std::size_t>> tensors = {{"w13", 80}, {"w2", 48}};

// [L, E, bytes] per tensor, 64-byte aligned, distinct bytes per (layer, expert, tensor).
struct ModelWeights {
  struct alignas(64) Line {
    std::byte b[64];
  };
  std::vector<std::vector<Line>> lines;
  std::vector<HostTensorArg> args;
  ModelWeights() {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const std::size_t n = static_cast<std::size_t>(L * E) * tensors[t].second;
      lines.emplace_back(n / 64 + 1);
      auto* p = lines.back().data()->b;
      for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>((t * 97 + i * 5 + i / 11) & 0xFF);
      args.push_back(HostTensorArg{tensors[t].first, p, n, DType::uint8, {L, E, static_cast<std::int64_t>(tensors[t].second)}});
    }
  }
};

ModelBridgeConfig model_config(const char* pool, std::int32_t capacity, const char* policy = "") {
  ModelBridgeConfig c;
  c.layout.name = "explicit";
  c.layout.tensors = tensors;
  c.pool = pool;
  c.policy = policy;
  c.num_layers = L;
  c.num_experts = E;
  c.capacity = capacity;
  c.top_k = 2;
  c.label = "model";
  return c;
}

// Layer l's slots hold, for every expert its device forward map names, that expert's bytes.
void check_layer_slots(SimRuntime& rt, const Model& m, const ModelWeights& w, std::int32_t l) {
  rt.drain();
  const LayerDescriptor& ld = m.layers()[static_cast<std::size_t>(l)];
  const auto* fmap = reinterpret_cast<const std::int32_t*>(ld.expert_map);
  for (std::int32_t e = 0; e < E; ++e) {
    const std::int32_t slot = fmap[e];
    if (slot < 0) continue;
    REQUIRE(slot < ld.capacity);
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const SlotDescriptor& d = m.slots()[t];
      const auto* dev = reinterpret_cast<const std::byte*>(ld.slot_bases[t] + static_cast<std::size_t>(slot) * d.slot_stride);
      const auto* host = static_cast<const std::byte*>(w.args[t].data) + static_cast<std::size_t>(l * E + e) * d.bytes_per_slot;
      REQUIRE(std::equal(dev, dev + d.bytes_per_slot, host));
    }
  }
}

std::map<std::string, std::int64_t> as_map(const std::vector<StatEntry>& v) {
  std::map<std::string, std::int64_t> m;
  for (const StatEntry& e : v) {
    if (!e.is_float) m[e.name] = e.int_value;
  }
  return m;
}

std::vector<std::int64_t> random_ids(std::mt19937& rng, std::int32_t unique_at_most) {
  std::vector<std::int64_t> pool;
  while (pool.size() < static_cast<std::size_t>(unique_at_most)) {
    const auto e = static_cast<std::int64_t>(rng() % E);
    if (std::find(pool.begin(), pool.end(), e) == pool.end()) pool.push_back(e);
  }
  std::vector<std::int64_t> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(rng() % 5 == 0 ? -1 : pool[rng() % pool.size()]);
  return ids;
}

}  // namespace

TEST_CASE("ModelBridge per_layer: every layer plans as its own reference planner; slots hold the mapped bytes") {
  for (const char* policy : {"lru", "lfru"}) {
    CAPTURE(policy);
    SimRuntime rt(sim_options());
    const Stream s = rt.create_stream().value();
    ModelWeights w;
    auto made = Model::create(rt, model_config("per_layer", 3, policy), w.args);
    REQUIRE(made.ok());
    Model& m = *made.value();
    CHECK(m.policy() == policy);
    REQUIRE(m.layers().size() == L);
    std::vector<std::unique_ptr<ReferencePlanner>> refs;
    for (std::int32_t l = 0; l < L; ++l) refs.push_back(std::move(ReferencePlanner::create(policy, E, 3, 2).value()));
    std::mt19937 rng(policy[1]);
    for (int step = 0; step < 90; ++step) {
      CAPTURE(step);
      const auto l = static_cast<std::int32_t>(step % L);
      const auto ids = random_ids(rng, 1 + static_cast<std::int32_t>(rng() % 3));
      const std::vector<std::int32_t> ids32(ids.begin(), ids.end());
      const auto got = m.prepare(l, ids, s);
      REQUIRE(got.ok());
      const auto exp = refs[static_cast<std::size_t>(l)]->plan(ids32, false);
      REQUIRE(exp.ok());
      CHECK(got.value().hits == exp.value().hits);
      CHECK(got.value().misses == exp.value().misses);
      CHECK(m.forward_map_host(l).value() == refs[static_cast<std::size_t>(l)]->forward_map());
      check_layer_slots(rt, m, w, l);
    }
    const auto st = m.stats();
    REQUIRE(st.size() == L + 1);
    std::int64_t hits = 0;
    for (std::int32_t l = 0; l < L; ++l) hits += as_map(st[static_cast<std::size_t>(l) + 1])["hits"];
    CHECK(as_map(st[0])["hits"] == hits);
    CHECK(as_map(st[0])["prepare_calls"] == 90);
    CHECK(rt.race_count() == 0);
  }
}

TEST_CASE("ModelBridge global: one pool for all layers; unique lists; invalidate") {
  SimRuntime rt(sim_options());
  const Stream s = rt.create_stream().value();
  ModelWeights w;
  auto made = Model::create(rt, model_config("global", 5, "layershare"), w.args);
  REQUIRE(made.ok());
  Model& m = *made.value();
  CHECK(m.policy() == "layershare");
  for (const LayerDescriptor& ld : m.layers()) {
    CHECK(ld.capacity == 5);
    CHECK(ld.slot_bases == m.layers()[0].slot_bases);  // the pool's slots, for every layer
  }
  std::mt19937 rng(3);
  for (int step = 0; step < 60; ++step) {
    const auto l = static_cast<std::int32_t>(rng() % L);
    REQUIRE(m.prepare(l, random_ids(rng, 2), s).ok());
    check_layer_slots(rt, m, w, l);
  }
  const auto u = m.prepare_unique(1, std::vector<std::int64_t>{7, 2}, s);
  REQUIRE(u.ok());
  check_layer_slots(rt, m, w, 1);
  CHECK(m.forward_map_host(1).value()[7] >= 0);
  REQUIRE(m.invalidate(1, 7, s).ok());
  CHECK(as_map(m.stats()[2])["invalidations"] == 1);
  CHECK(rt.race_count() == 0);
}

TEST_CASE("ModelBridge: bad config and host tensors are refused by name; refused calls change nothing") {
  SimRuntime rt(sim_options());
  ModelWeights w;
  const auto refused = [](const Status& st, const std::string& expected) {
    REQUIRE(!st.ok());
    const std::string msg(st.message());
    INFO("message: " << msg);
    CHECK(msg.find(expected) != std::string::npos);
  };
  refused(Model::create(rt, model_config("shared", 3), w.args).status(), "model: unknown pool 'shared' (valid: per_layer, global)");
  refused(Model::create(rt, model_config("per_layer", 3, "fifo"), w.args).status(),
          "model: unknown eviction policy 'fifo' (valid: lru, lfru");
  auto bad_layers = model_config("per_layer", 3);
  bad_layers.num_layers = 0;
  refused(Model::create(rt, bad_layers, w.args).status(), "num_layers 0");
  refused(Model::create(rt, model_config("per_layer", 9), w.args).status(), "capacity");
  auto short_args = w.args;
  short_args[1].bytes -= 48;
  refused(Model::create(rt, model_config("per_layer", 3), short_args).status(),
          "host tensor 'w2' has 1104 bytes, expected exactly 1152 (3 layers * 8 experts * 48 bytes)");
  refused(Model::create(rt, model_config("per_layer", 3), std::span(w.args).first(1)).status(), "host tensor 'w2' missing");
  CHECK(rt.allocated_bytes() == 0);  // nothing allocated for a refused build

  const Stream s = rt.create_stream().value();
  auto made = Model::create(rt, model_config("per_layer", 3), w.args);
  REQUIRE(made.ok());
  Model& m = *made.value();
  REQUIRE(m.prepare(0, std::vector<std::int64_t>{1, 2}, s).ok());
  rt.drain();
  const auto before = m.stats();
  const auto map_before = m.forward_map_host(0).value();
  const auto unchanged = [&](const Status& st, const std::string& expected) {
    refused(st, expected);
    rt.drain();
    const auto after = m.stats();
    REQUIRE(after.size() == before.size());
    for (std::size_t i = 0; i < after.size(); ++i) CHECK(as_map(after[i]) == as_map(before[i]));
    CHECK(m.forward_map_host(0).value() == map_before);
    check_layer_slots(rt, m, w, 0);
  };
  using V = std::vector<std::int64_t>;
  unchanged(m.prepare(3, V{1}, s).status(), "model: layer 3 out of range [0, 3)");
  unchanged(m.prepare(-1, V{1}, s).status(), "layer -1 out of range");
  unchanged(m.prepare(0, V{1, 8}, s).status(), "model: layer 0: topk_ids[1] = 8 out of range (num_experts 8)");
  unchanged(m.prepare(0, V{1, 2, 3, 4}, s).status(), "4 unique experts");
  unchanged(m.prepare_unique(0, V{1, 1}, s).status(), "unique_ids[1] = 1 appears twice");
  unchanged(m.prepare_unique(0, V{-1}, s).status(), "unique_ids[0] = -1 outside [0, 8)");
  unchanged(m.invalidate(0, 8, s), "invalidate(layer 0, expert 8): expert out of range [0, 8)");
  unchanged(m.invalidate(5, 1, s), "layer 5 out of range");
  refused(m.forward_map_host(4).status(), "layer 4 out of range");
  CHECK(rt.race_count() == 0);
}

TEST_CASE("ModelBridge::prepare_wide: a layer's wide forward over the stream slots; each round's slots hold its bytes") {
  for (const char* pool : {"per_layer", "global"}) {
    CAPTURE(pool);
    SimRuntime rt(SimRuntime::Options{.memory_limit = std::size_t{1} << 28, .seed = 9, .max_races = 16, .max_streams = 16});
    const auto s = rt.create_stream().value();
    ModelWeights w;
    ModelBridgeConfig c = model_config(pool, 4);
    c.stream_slots = 4;
    auto made = Model::create(rt, c, w.args);
    REQUIRE(made.ok());
    Model& m = *made.value();
    std::vector<std::int64_t> all;
    for (std::int32_t e = 0; e < E; ++e) all.push_back(e);
    const std::int32_t layer = 1;
    std::vector<std::int32_t> seen;
    std::uint32_t rounds = 0;
    auto r = m.prepare_wide(layer, all, s, [&](const WideRoundInfo& info) {
      ++rounds;
      REQUIRE(info.experts.size() == info.slots.size());
      // Read back at once (a test shortcut: SimRuntime runs the round's fills on drain).
      rt.drain();
      const auto* fmap = reinterpret_cast<const std::int32_t*>(info.expert_map);
      for (std::size_t k = 0; k < info.experts.size(); ++k) {
        const std::int32_t e = info.experts[k], slot = info.slots[k];
        seen.push_back(e);
        CHECK(fmap[e] == slot);
        CHECK(slot < info.slot_count);
        for (std::size_t t = 0; t < tensors.size(); ++t) {
          const SlotDescriptor& d = m.slots()[t];
          const auto* dev = reinterpret_cast<const std::byte*>(info.slot_bases[t] + static_cast<std::size_t>(slot) * d.slot_stride);
          const auto* host = static_cast<const std::byte*>(w.args[t].data) + static_cast<std::size_t>(layer * E + e) * d.bytes_per_slot;
          CHECK(std::equal(dev, dev + d.bytes_per_slot, host));
        }
      }
      return Status();
    });
    REQUIRE(r.ok());
    CHECK(r.value().rounds == rounds);
    CHECK(r.value().streamed == static_cast<std::uint32_t>(E));
    std::sort(seen.begin(), seen.end());
    CHECK(seen.size() == static_cast<std::size_t>(E));
    CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end());
    // Refused before anything changes: a bad layer, an id out of range, a bad admission name.
    int calls = 0;
    const auto count = [&](const WideRoundInfo&) {
      ++calls;
      return Status();
    };
    CHECK(m.prepare_wide(L, all, s, count).status().code() == ErrorCode::invalid_argument);
    CHECK(m.prepare_wide(0, std::vector<std::int64_t>{E}, s, count).status().code() == ErrorCode::expert_out_of_range);
    CHECK(std::string(m.prepare_wide(0, all, s, count, "scan").status().message()).find("valid: stream, admit") !=
          std::string::npos);
    CHECK(calls == 0);
    CHECK(rt.races().empty());
  }
}

TEST_CASE("ModelBridge::prefetch: layer L+1's hints fill its slots, the next prepare hits them; bad hints change nothing") {
  for (const char* pool : {"per_layer", "global"}) {
    CAPTURE(pool);
    SimRuntime rt(sim_options());
    const Stream s = rt.create_stream().value();
    ModelWeights w;
    auto made = Model::create(rt, model_config(pool, std::string(pool) == "global" ? 6 : 4), w.args);
    REQUIRE(made.ok());
    Model& m = *made.value();
    const auto expert_bytes = static_cast<std::int64_t>(tensors[0].second + tensors[1].second);
    REQUIRE(m.prepare(0, std::vector<std::int64_t>{0, 1}, s).ok());
    // Layer 1's experts while layer 0 computes: two fills, the third hint is beyond the budget.
    const auto p = m.prefetch(1, std::vector<std::int64_t>{5, 6, 7}, 2 * expert_bytes, 1, s);
    REQUIRE(p.ok());
    CHECK(p.value().issued == 2);
    CHECK(p.value().bytes == static_cast<std::uint64_t>(2 * expert_bytes));
    const auto stat_maps = [&] {
      std::vector<std::map<std::string, std::int64_t>> out;
      for (const auto& entries : m.stats()) out.push_back(as_map(entries));
      return out;
    };
    const auto before = stat_maps();
    rt.drain();
    const std::size_t ops_before = rt.counters().copies;
    // Every bad hint is refused by name before the cache is touched.
    const auto refused = [&](const Result<PrefetchView>& r, ErrorCode code, const char* words) {
      REQUIRE_FALSE(r.ok());
      CHECK(r.status().code() == code);
      CHECK(std::string(r.status().message()).find(words) != std::string::npos);
    };
    refused(m.prefetch(L, std::vector<std::int64_t>{1}, expert_bytes, 1, s), ErrorCode::invalid_argument, "layer 3");
    refused(m.prefetch(1, std::vector<std::int64_t>{E}, expert_bytes, 1, s), ErrorCode::expert_out_of_range, "outside [0, 8)");
    refused(m.prefetch(1, std::vector<std::int64_t>{-1}, expert_bytes, 1, s), ErrorCode::expert_out_of_range, "outside");
    refused(m.prefetch(1, std::vector<std::int64_t>{2, 2}, expert_bytes, 1, s), ErrorCode::duplicate_expert, "twice");
    refused(m.prefetch(1, std::vector<std::int64_t>{2}, -1, 1, s), ErrorCode::invalid_argument, "max_bytes");
    refused(m.prefetch(1, std::vector<std::int64_t>{2}, expert_bytes, 0, s), ErrorCode::invalid_argument, "expires_after");
    const std::vector<float> two = {0.9f, 0.8f};
    HintScores wrong_count;
    wrong_count.scores = std::span<const float>(two);
    refused(m.prefetch(1, std::vector<std::int64_t>{2}, expert_bytes, 1, s, wrong_count), ErrorCode::invalid_argument,
            "2 scores for 1");
    const std::vector<float> above = {1.5f};
    HintScores out_of_range;
    out_of_range.scores = std::span<const float>(above);
    refused(m.prefetch(1, std::vector<std::int64_t>{2}, expert_bytes, 1, s, out_of_range), ErrorCode::invalid_argument, "score");
    CHECK(stat_maps() == before);
    CHECK(rt.counters().copies == ops_before);
    // Scored hints: the unlikely one is skipped, the likely one fetched.
    const std::vector<float> scores = {0.2f, 0.9f};
    HintScores scored;
    scored.scores = std::span<const float>(scores);
    const auto q = m.prefetch(2, std::vector<std::int64_t>{3, 4}, 2 * expert_bytes, 1, s, scored);
    REQUIRE(q.ok());
    CHECK(q.value().issued == 1);
    CHECK(q.value().skipped_unlikely == 1);
    // The next prepare of layer 1 uses the fills: hits, counted as used.
    const auto v = m.prepare(1, std::vector<std::int64_t>{5, 6}, s);
    REQUIRE(v.ok());
    CHECK(v.value().hits == 2);
    CHECK(v.value().misses == 0);
    check_layer_slots(rt, m, w, 1);
    const auto st = m.stats();
    CHECK(as_map(st[0])["speculative_issued"] == 3);
    CHECK(as_map(st[0])["speculative_used"] == 2);
    CHECK(as_map(st[0])["speculative_bytes"] == 3 * expert_bytes);
    if (std::string(pool) == "per_layer") CHECK(as_map(st[2])["speculative_issued"] == 2);
    CHECK(rt.race_count() == 0);
  }
}
