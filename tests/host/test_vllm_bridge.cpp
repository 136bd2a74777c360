// The torch-free half of the vLLM-surface providers (python/src/vllm_bridge.hpp and the
// CacheBridge calls they use), on SimRuntime:
// - the constructor's source checks (pairs, row counts, shapes, dtypes, capacity), each refusal
//   naming the tensor and the expected value;
// - the reference planners against the LFRU rules of docs/reference_providers.md, transcribed
//   independently here, and the examples listed there;
// - a CacheBridge over six vLLM-shaped tensors, semantics "lfru" and "row", equal to the
//   reference planner call by call (hits, misses, fills, victims, forward map, slot bytes of all
//   six tensors), with explicit unique lists, invalidate, and refused calls changing nothing;
// - invalidate_if_held (vLLM's invalidate: every id not held is a no-op) next to the native
//   invalidate, which keeps refusing ids outside [0, E);
// - prefetch through the bridge; the token / expert split plans (a row wider than the slots
//   refused in vLLM's words);
// - prefetch_order (the order a scored prefetch considers its hints) and a scored prefetch
//   filling the free slots in that order, which the providers' compatibility state follows.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "bridge.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"
#include "vllm_bridge.hpp"

using namespace expert_cache;
using namespace expert_cache::python;
using Stream = SimRuntime::Stream;
using Bridge = CacheBridge<SimRuntime>;
using Pairs = std::vector<std::pair<std::int32_t, std::int32_t>>;

namespace {

SimRuntime::Options sim_options() {
  return SimRuntime::Options{.memory_limit = std::size_t{1} << 28, .seed = 7, .max_races = 64, .max_streams = 64};
}

void refused_with(const Status& s, const std::string& expected) {
  REQUIRE(!s.ok());
  const std::string m(s.message());
  INFO("message: " << m);
  CHECK(m.find(expected) != std::string::npos);
}

// An NVFP4-Marlin-like layer: int32 weights, uint8 block scales, float32 global scales.
std::vector<SourceArg> nvfp4_sources(std::int64_t E) {
  return {{"w13_weight", true, "torch.int32", 4, {E, 2, 12}}, {"w2_weight", true, "torch.int32", 4, {E, 4, 4}},
          {"w13_scale", true, "torch.uint8", 1, {E, 2, 12}},  {"w2_scale", true, "torch.uint8", 1, {E, 16}},
          {"w13_scale_2", true, "torch.float32", 4, {E}},     {"w2_scale_2", true, "torch.float32", 4, {E, 1}}};
}

SourceArg* find(std::vector<SourceArg>& v, const std::string& name) {
  for (SourceArg& a : v) {
    if (a.name == name) return &a;
  }
  return nullptr;
}

}  // namespace

TEST_CASE("validate_provider_sources: bytes and trailing shapes per tensor, capacity clamped to E") {
  const auto src = nvfp4_sources(8);
  auto r = validate_provider_sources(5, src);
  REQUIRE(r.ok());
  const ProviderSpec& spec = r.value();
  CHECK(spec.num_experts == 8);
  CHECK(spec.capacity == 5);
  REQUIRE(spec.sources.size() == 6);
  const std::vector<std::pair<std::string, std::size_t>> want = {{"w13", 96}, {"w2", 64},         {"w13_scale", 24},
                                                                  {"w2_scale", 16}, {"w13_scale_2", 4}, {"w2_scale_2", 4}};
  for (std::size_t i = 0; i < 6; ++i) {
    CHECK(spec.sources[i].slot_name == want[i].first);
    CHECK(spec.sources[i].bytes_per_expert == want[i].second);
  }
  CHECK(spec.sources[0].trailing == std::vector<std::int64_t>{2, 12});
  CHECK(spec.sources[4].trailing.empty());  // [E] global scales: one element per expert
  CHECK(spec.sources[5].trailing == std::vector<std::int64_t>{1});

  auto big = validate_provider_sources(100, src);  // vLLM's effective capacity: min(size, E)
  REQUIRE(big.ok());
  CHECK(big.value().capacity == 8);

  // Weights only (unquantized): absent pairs are simply not there.
  std::vector<SourceArg> dense = {{"w13_weight", true, "torch.bfloat16", 2, {4, 6, 8}},
                                  {"w2_weight", true, "torch.bfloat16", 2, {4, 8, 3}},
                                  {"w13_scale", false, "", 0, {}}};
  auto d = validate_provider_sources(2, dense);
  REQUIRE(d.ok());
  REQUIRE(d.value().sources.size() == 2);
  CHECK(d.value().sources[1].bytes_per_expert == 48);
}

TEST_CASE("validate_provider_sources: every bad input is refused naming the tensor and the expected value") {
  const auto bad = [](auto edit, std::int64_t capacity, const std::string& expected) {
    auto src = nvfp4_sources(8);
    edit(src);
    refused_with(validate_provider_sources(capacity, src, "layer3").status(), expected);
  };
  const auto none = [](std::vector<SourceArg>&) {};
  bad(none, 0, "layer3: capacity must be positive, got 0");
  bad(none, -4, "capacity must be positive, got -4");
  bad([](auto& s) { find(s, "w2_weight")->given = false; }, 4, "w2_weight is required");
  bad([](auto& s) { find(s, "w13_scale")->given = false; }, 4,
      "w2_scale given without w13_scale: per-expert scales come in pairs");
  bad([](auto& s) { find(s, "w2_scale_2")->given = false; }, 4,
      "w13_scale_2 given without w2_scale_2: per-expert scales come in pairs");
  bad([](auto& s) { find(s, "w13_scale_2")->shape = {7}; }, 4, "w13_scale_2 has shape [7], expected [8");
  bad([](auto& s) { find(s, "w2_scale_2")->shape = {}; }, 4, "w2_scale_2 has shape [], expected [8");
  bad([](auto& s) { find(s, "w2_weight")->shape = {9, 4, 4}; }, 4, "w2_weight has shape [9, 4, 4], expected [8, ...]");
  bad([](auto& s) { find(s, "w13_weight")->shape = {8}; }, 4, "w13_weight has shape [8], expected [E, ...] with at least 2");
  bad([](auto& s) { find(s, "w13_weight")->shape = {0, 4}; }, 4, "w13_weight has 0 experts");
  bad([](auto& s) { find(s, "w2_weight")->dtype = "torch.float16"; }, 4,
      "w2_weight has dtype torch.float16, expected torch.int32 (w13_weight's)");
  bad([](auto& s) { find(s, "w2_scale")->dtype = "torch.float8_e4m3fn"; }, 4,
      "w2_scale has dtype torch.float8_e4m3fn, expected torch.uint8 (w13_scale's)");
  bad([](auto& s) { find(s, "w2_scale")->shape = {8, 0}; }, 4, "w2_scale has shape [8, 0]: every dimension after the first");
  bad([](auto& s) { find(s, "w2_scale")->shape = {8, std::int64_t{1} << 41}; }, 4, "more than 2^40 bytes per expert");
  bad([](auto& s) { s.push_back({"w13_bias", true, "torch.float32", 4, {8, 2}}); }, 4, "unknown source tensor 'w13_bias'");
  bad([](auto& s) { s.push_back(s.front()); }, 4, "source tensor 'w13_weight' given twice");
}

TEST_CASE("provider_semantics: names to provider and policy; unknown names listed") {
  CHECK(provider_semantics("lfru").value().provider == "cached");
  CHECK(provider_semantics("lfru").value().policy == "lfru");
  CHECK(provider_semantics("row").value().provider == "row");
  CHECK(provider_semantics("row").value().policy == "lru");
  CHECK(provider_semantics("device").value().provider == "device");
  CHECK(provider_semantics("row", "sieve").value().policy == "sieve");
  refused_with(provider_semantics("lru").status(), "unknown semantics 'lru' (valid: lfru");
}

namespace {

// docs/reference_providers.md "LFRU, exactly", transcribed without the library.
struct VllmLfru {
  struct Entry {
    std::int32_t expert, slot;
    long freq, last;
  };
  std::int32_t capacity;
  long clock = 0;
  std::vector<Entry> resident;  // insertion order; hits do not reorder
  std::vector<std::int32_t> free_slots;
  explicit VllmLfru(std::int32_t c) : capacity(c) {
    for (std::int32_t s = 0; s < c; ++s) free_slots.push_back(s);
  }
  ReferencePlanner::Step prepare(std::vector<std::int32_t> ids) {
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    ReferencePlanner::Step st;
    for (const std::int32_t e : ids) {
      auto it = std::find_if(resident.begin(), resident.end(), [&](const Entry& r) { return r.expert == e; });
      if (it != resident.end()) {
        ++clock;
        ++it->freq;
        it->last = clock;
        ++st.hits;
        continue;
      }
      std::int32_t slot;
      if (!free_slots.empty()) {
        slot = free_slots.back();
        free_slots.pop_back();
      } else {
        std::size_t victim = resident.size();
        double best = 0;
        for (std::size_t i = 0; i < resident.size(); ++i) {
          if (std::find(ids.begin(), ids.end(), resident[i].expert) != ids.end()) continue;
          const double score = static_cast<double>(resident[i].freq) / static_cast<double>(clock - resident[i].last + 1);
          if (victim == resident.size() || score < best) victim = i, best = score;
        }
        REQUIRE(victim < resident.size());
        slot = resident[victim].slot;
        st.evictions.emplace_back(resident[victim].expert, slot);
        resident.erase(resident.begin() + static_cast<std::ptrdiff_t>(victim));
      }
      ++clock;
      resident.push_back({e, slot, 1, clock});
      st.fills.emplace_back(e, slot);
      ++st.misses;
    }
    return st;
  }
  void invalidate(std::int32_t e) {
    auto it = std::find_if(resident.begin(), resident.end(), [&](const Entry& r) { return r.expert == e; });
    if (it == resident.end()) return;
    free_slots.push_back(it->slot);
    resident.erase(it);
  }
};

std::unique_ptr<ReferencePlanner> reference(const char* policy, std::int32_t E, std::int32_t C) {
  auto r = ReferencePlanner::create(policy, E, C, 1);
  REQUIRE(r.ok());
  return std::move(r.value());
}

ReferencePlanner::Step plan(ReferencePlanner& p, std::vector<std::int32_t> ids) {
  auto r = p.plan(ids, false);
  REQUIRE(r.ok());
  return r.value();
}

}  // namespace

TEST_CASE("ReferencePlanner lfru equals the LFRU rules transcribed from docs/reference_providers.md") {
  constexpr std::int32_t E = 12, C = 4;
  auto lib = reference("lfru", E, C);
  VllmLfru ref(C);
  std::mt19937 rng(11);
  for (int step = 0; step < 400; ++step) {
    CAPTURE(step);
    if (step % 17 == 16) {
      const auto e = static_cast<std::int32_t>(rng() % E);
      REQUIRE(lib->invalidate(e).ok());
      ref.invalidate(e);
      continue;
    }
    std::vector<std::int32_t> ids;
    const auto unique = 1 + rng() % C;
    while (ids.size() < unique) {
      const auto e = static_cast<std::int32_t>(rng() % E);
      if (std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
    }
    const auto a = plan(*lib, ids);
    const auto b = ref.prepare(ids);
    CHECK(a.hits == b.hits);
    CHECK(a.misses == b.misses);
    CHECK(a.fills == b.fills);
    CHECK(a.evictions == b.evictions);
  }
}

TEST_CASE("ReferencePlanner: the examples of docs/reference_providers.md") {
  SUBCASE("LFRU: frequency beats recency") {
    auto p = reference("lfru", 8, 2);
    plan(*p, {0});
    plan(*p, {0});
    plan(*p, {0});  // expert 0: freq 3
    plan(*p, {1});  // expert 1: freq 1, newer
    const auto s = plan(*p, {2});
    CHECK(s.evictions == Pairs{{1, 0}});  // the recent but rare expert goes, the frequent one stays
    CHECK(p->resident_map()[0] == 1);
  }
  SUBCASE("LFRU: a stale high-frequency expert loses") {
    auto p = reference("lfru", 8, 3);
    for (int i = 0; i < 3; ++i) plan(*p, {0});   // expert 0: freq 3, last 3
    for (int i = 0; i < 10; ++i) plan(*p, {1});  // expert 1: freq 10, last 13
    plan(*p, {2});                               // expert 2: freq 1, last 14
    // Scores at clock 14: expert 0 3/12, expert 1 10/1, expert 2 1/1: the stale frequent one goes.
    CHECK(plan(*p, {5}).evictions == Pairs{{0, 2}});
    CHECK(p->resident_map()[2] >= 0);
  }
  SUBCASE("capacity 1: every new expert evicts the only one, same slot") {
    for (const char* policy : {"lfru", "lru"}) {
      CAPTURE(policy);
      auto p = reference(policy, 4, 1);
      CHECK(plan(*p, {2}).fills == Pairs{{2, 0}});
      const auto s = plan(*p, {3});
      CHECK(s.evictions == Pairs{{2, 0}});
      CHECK(s.fills == Pairs{{3, 0}});
      CHECK(plan(*p, {3}).hits == 1);
      refused_with(p->plan(std::vector<std::int32_t>{1, 2}, false).status(), "2 unique experts");
    }
  }
  SUBCASE("free slots: lfru hands out the highest first, row (lru) slot 0 first; eviction reuses the slot") {
    auto f = reference("lfru", 8, 3);
    CHECK(plan(*f, {0, 1, 2}).fills == Pairs{{0, 2}, {1, 1}, {2, 0}});
    auto r = reference("lru", 8, 3);
    CHECK(plan(*r, {0, 1, 2}).fills == Pairs{{0, 0}, {1, 1}, {2, 2}});
    const auto s = plan(*r, {5});
    CHECK(s.evictions == Pairs{{0, 0}});
    CHECK(s.fills == Pairs{{5, 0}});
  }
  SUBCASE("invalidate frees the slot (reused next, LIFO), absent experts are a no-op") {
    auto p = reference("lfru", 8, 3);
    plan(*p, {0, 1, 2});  // slots 2, 1, 0
    REQUIRE(p->invalidate(1).ok());
    REQUIRE(p->invalidate(1).ok());  // absent now: nothing happens
    REQUIRE(p->invalidate(6).ok());  // never resident
    CHECK(p->resident_map()[1] == -1);
    const auto s = plan(*p, {7});
    CHECK(s.evictions.empty());
    CHECK(s.fills == Pairs{{7, 1}});
    refused_with(p->invalidate(8), "");
  }
  SUBCASE("in-forward protection: a needed resident is never the victim") {
    auto p = reference("lru", 6, 2);
    plan(*p, {0});
    plan(*p, {1});
    // Expert 2 misses while 0 is still the LRU-most: 0 is needed by this call, so 1 goes.
    const auto s = p->plan(std::vector<std::int32_t>{2, 0}, true);
    REQUIRE(s.ok());
    CHECK(s.value().evictions == Pairs{{1, 1}});
    CHECK(s.value().fills == Pairs{{2, 1}});
  }
}

namespace {

// Six vLLM-shaped host tensors (bytes per expert as nvfp4_sources), 64-byte aligned.
struct HostSources {
  struct alignas(64) Line {
    std::byte b[64];
  };
  std::vector<std::vector<Line>> lines;
  std::vector<HostTensorArg> args;
  std::vector<std::size_t> bytes;
  HostSources(const ProviderSpec& spec) {
    const auto E = static_cast<std::size_t>(spec.num_experts);
    for (std::size_t t = 0; t < spec.sources.size(); ++t) {
      const std::size_t n = E * spec.sources[t].bytes_per_expert;
      lines.emplace_back(n / 64 + 1);
      auto* p = lines.back().data()->b;
      for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>((t * 131 + i * 7 + i / 13) & 0xFF);
      args.push_back(HostTensorArg{spec.sources[t].slot_name, p, n, DType::uint8, {}});
      bytes.push_back(spec.sources[t].bytes_per_expert);
    }
  }
};

BridgeConfig provider_config(const ProviderSpec& spec, const ProviderChoice& choice) {
  BridgeConfig c;
  c.layout.name = "explicit";
  for (const ProviderSource& s : spec.sources) c.layout.tensors.emplace_back(s.slot_name, s.bytes_per_expert);
  c.provider = choice.provider;
  c.policy = choice.policy;
  c.num_experts = spec.num_experts;
  c.capacity = spec.capacity;
  c.top_k = 1;
  c.label = "moe.3";
  return c;
}

struct Observed {
  std::vector<std::pair<std::string, std::int64_t>> stats;
  std::vector<std::int32_t> forward, resident;
  friend bool operator==(const Observed&, const Observed&) = default;
};
Observed observe(SimRuntime& rt, Bridge& b) {
  rt.drain();
  Observed o;
  for (const StatEntry& e : b.stats()) {
    if (!e.is_float) o.stats.emplace_back(e.name, e.int_value);
  }
  const auto* fd = reinterpret_cast<const std::int32_t*>(b.expert_map_device());
  const auto* rd = reinterpret_cast<const std::int32_t*>(b.resident_map_device());
  o.forward.assign(fd, fd + b.config().num_experts);
  o.resident.assign(rd, rd + b.config().num_experts);
  return o;
}

// Every expert the forward map names holds its bytes of all six tensors in its slot.
void check_slots(SimRuntime& rt, Bridge& b, const HostSources& h) {
  rt.drain();
  const auto* fd = reinterpret_cast<const std::int32_t*>(b.expert_map_device());
  for (std::int32_t e = 0; e < b.config().num_experts; ++e) {
    if (fd[e] < 0) continue;
    for (std::size_t t = 0; t < b.slots().size(); ++t) {
      const SlotDescriptor& d = b.slots()[t];
      const auto* dev = reinterpret_cast<const std::byte*>(d.base + static_cast<std::size_t>(fd[e]) * d.slot_stride);
      const auto* host = static_cast<const std::byte*>(h.args[t].data) + static_cast<std::size_t>(e) * h.bytes[t];
      REQUIRE(d.bytes_per_slot == h.bytes[t]);
      REQUIRE(std::equal(dev, dev + d.bytes_per_slot, host));
    }
  }
}

}  // namespace

TEST_CASE("CacheBridge over vLLM-shaped sources equals the reference planner call by call (lfru and row)") {
  constexpr std::int64_t E = 10;
  const ProviderSpec spec = validate_provider_sources(4, nvfp4_sources(E)).value();
  for (const char* semantics : {"lfru", "row"}) {
    CAPTURE(semantics);
    const ProviderChoice choice = provider_semantics(semantics).value();
    SimRuntime rt(sim_options());
    const Stream s = rt.create_stream().value();
    HostSources h(spec);
    auto made = Bridge::create(rt, provider_config(spec, choice), h.args);
    REQUIRE(made.ok());
    Bridge& b = *made.value();
    CHECK(b.policy() == choice.policy);
    auto ref = reference(choice.policy.c_str(), spec.num_experts, spec.capacity);
    std::mt19937 rng(semantics[0]);
    std::int64_t hits = 0, misses = 0;
    for (int step = 0; step < 150; ++step) {
      CAPTURE(step);
      if (step % 13 == 12) {
        const auto e = static_cast<std::int32_t>(rng() % E);
        REQUIRE(b.invalidate(e, s).ok());
        REQUIRE(ref->invalidate(e).ok());
        continue;
      }
      // Top-k ids with padding, or (every third step) an explicit unique list in its own order.
      const bool unique = step % 3 == 2;
      std::vector<std::int32_t> distinct;
      const auto want = 1 + rng() % spec.capacity;
      while (distinct.size() < want) {
        const auto e = static_cast<std::int32_t>(rng() % E);
        if (std::find(distinct.begin(), distinct.end(), e) == distinct.end()) distinct.push_back(e);
      }
      std::vector<std::int32_t> ids32 = distinct;  // unique: in drawn order, not sorted
      if (!unique) {
        for (std::size_t extra = rng() % 4; extra > 0; --extra) {
          ids32.push_back(rng() % 3 == 0 ? -1 : distinct[rng() % distinct.size()]);  // repeats and padding
        }
        std::shuffle(ids32.begin(), ids32.end(), rng);
      }
      const std::vector<std::int64_t> ids(ids32.begin(), ids32.end());
      const auto got = unique ? b.prepare_unique(ids, s) : b.prepare(ids, s);
      REQUIRE(got.ok());
      const auto exp = ref->plan(ids32, unique);
      REQUIRE(exp.ok());
      CHECK(got.value().hits == exp.value().hits);
      CHECK(got.value().misses == exp.value().misses);
      CHECK(b.last_fills() == exp.value().fills);
      CHECK(b.last_evictions() == exp.value().evictions);
      const auto fm = b.expert_map_host();
      CHECK(std::vector<std::int32_t>(fm.begin(), fm.end()) == ref->forward_map());
      hits += exp.value().hits;
      misses += exp.value().misses;
      check_slots(rt, b, h);
      const Observed o = observe(rt, b);
      CHECK(o.forward == ref->forward_map());
      CHECK(o.resident == ref->resident_map());
    }
    const auto st = b.stats();
    CHECK(st[0].name == "hits");
    CHECK(st[0].int_value == hits);
    CHECK(st[1].int_value == misses);
    CHECK(rt.race_count() == 0);
  }
}

TEST_CASE("CacheBridge: refused prepares, unique lists and prefetches change no counter, map or slot") {
  constexpr std::int64_t E = 10;
  const ProviderSpec spec = validate_provider_sources(4, nvfp4_sources(E)).value();
  SimRuntime rt(sim_options());
  const Stream s = rt.create_stream().value();
  HostSources h(spec);
  auto made = Bridge::create(rt, provider_config(spec, provider_semantics("lfru").value()), h.args);
  REQUIRE(made.ok());
  Bridge& b = *made.value();
  REQUIRE(b.prepare(std::vector<std::int64_t>{1, 2, 2, 5}, s).ok());
  const Observed before = observe(rt, b);
  const auto unchanged = [&](const Status& st, const std::string& expected) {
    refused_with(st, expected);
    CHECK(observe(rt, b) == before);
    check_slots(rt, b, h);
  };
  using V = std::vector<std::int64_t>;
  unchanged(b.prepare(V{0, 1, 2, 3, 4, 4, -1}, s, true).status(),
            "moe.3: 5 unique experts in one forward, capacity 4 slots (split it: run_with_expert_cache); experts [0, 1, 2, 3, 4]");
  unchanged(b.prepare(std::vector<std::int32_t>{9, 8, 7, 6, 5}, s, true).status(), "experts [5, 6, 7, 8, 9]");
  // Without name_experts: the planner's own message (the ExpertCache API's).
  unchanged(b.prepare(std::vector<std::int32_t>{9, 8, 7, 6, 5}, s).status(),
            "forward needs 5 unique experts but the cache has 4 slots");
  // A long list is cut at its end; the counts stay.
  unchanged(b.prepare_unique(V{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, s).status(), "10 unique experts in one forward, capacity 4");
  unchanged(b.prepare(V{0, E}, s).status(), "topk_ids[1] = 10 out of range (num_experts 10)");
  unchanged(b.prepare_unique(V{3, 1, 3}, s).status(), "moe.3: unique_ids[2] = 3 appears twice");
  unchanged(b.prepare_unique(V{3, -1}, s).status(), "moe.3: unique_ids[1] = -1 outside [0, 10)");
  unchanged(b.prepare_unique(V{3, 12}, s).status(), "unique_ids[1] = 12 outside [0, 10)");
  unchanged(b.prepare_unique(V{0, 1, 2, 3, 4}, s).status(), "5 unique experts in one forward, capacity 4");
  unchanged(b.prefetch(V{3, 3}, 1 << 20, 1, s).status(), "predicted ids[1] = 3 appears twice");
  unchanged(b.prefetch(V{3, 10}, 1 << 20, 1, s).status(), "predicted ids[1] = 10 outside [0, 10)");
  unchanged(b.prefetch(V{3}, -1, 1, s).status(), "prefetch max_bytes = -1 (accepted: >= 0)");
  unchanged(b.prefetch(V{3}, 1 << 20, 0, s).status(), "prefetch expires_after = 0");
  unchanged(b.prefetch_device(nullptr, 0, 0, 1, s).status(), "prefetch with CUDA ids needs provider 'device'");
  unchanged(b.invalidate(E, s), "invalidate(10): expert out of range");
  // An absent expert's invalidate is a no-op that succeeds.
  REQUIRE(b.invalidate(7, s).ok());
  CHECK(observe(rt, b) == before);
  CHECK(rt.race_count() == 0);
}

TEST_CASE("invalidate_if_held: vLLM's invalidate, a no-op for every id not held; the native invalidate still refuses") {
  constexpr std::int64_t E = 10;
  const ProviderSpec spec = validate_provider_sources(4, nvfp4_sources(E)).value();
  for (const char* semantics : {"lfru", "row"}) {
    CAPTURE(semantics);
    SimRuntime rt(sim_options());
    const Stream s = rt.create_stream().value();
    HostSources h(spec);
    auto made = Bridge::create(rt, provider_config(spec, provider_semantics(semantics).value()), h.args);
    REQUIRE(made.ok());
    Bridge& b = *made.value();
    REQUIRE(b.prepare(std::vector<std::int64_t>{1, 2, 5}, s).ok());
    const Observed before = observe(rt, b);
    const std::vector<std::int32_t> resident_before(b.resident_map_host().begin(), b.resident_map_host().end());
    // Not held: negative, E, far beyond E, the int64 ends, in range but never loaded.
    for (const std::int64_t e : {std::int64_t{-1}, std::int64_t{-7}, E, E + 1, std::int64_t{1} << 40,
                                 std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max(),
                                 std::int64_t{0}, std::int64_t{9}}) {
      CAPTURE(e);
      REQUIRE(invalidate_if_held(b, E, e, s).ok());
      CHECK(observe(rt, b) == before);
      CHECK(std::vector<std::int32_t>(b.resident_map_host().begin(), b.resident_map_host().end()) == resident_before);
    }
    // The native API keeps its error for ids outside [0, E), and changes nothing either.
    refused_with(b.invalidate(-1, s), "invalidate(-1): expert out of range [0, 10)");
    refused_with(b.invalidate(E, s), "invalidate(10): expert out of range [0, 10)");
    CHECK(observe(rt, b) == before);
    // A held expert is dropped exactly as the native invalidate drops it: its slot is the next
    // miss's (LIFO), the counters say one invalidation.
    const std::int32_t slot = resident_before[2];
    REQUIRE(slot >= 0);
    REQUIRE(invalidate_if_held(b, E, 2, s).ok());
    CHECK(b.resident_map_host()[2] == -1);
    std::map<std::string, std::int64_t> st;
    for (const StatEntry& x : b.stats()) st[x.name] = x.int_value;
    CHECK(st["invalidations"] == 1);
    CHECK(st["resident"] == 2);
    REQUIRE(invalidate_if_held(b, E, 2, s).ok());  // held no more: a no-op
    for (const StatEntry& x : b.stats()) st[x.name] = x.int_value;
    CHECK(st["invalidations"] == 1);
    REQUIRE(b.prepare(std::vector<std::int64_t>{7}, s).ok());
    CHECK(b.last_fills() == Pairs{{7, slot}});
    check_slots(rt, b, h);
    CHECK(rt.race_count() == 0);
  }
}

TEST_CASE("CacheBridge prefetch: host ids fill free slots within the byte budget; the next prepare hits them") {
  constexpr std::int64_t E = 10;
  const ProviderSpec spec = validate_provider_sources(4, nvfp4_sources(E)).value();
  std::size_t per_expert = 0;
  for (const ProviderSource& src : spec.sources) per_expert += src.bytes_per_expert;
  for (const char* semantics : {"lfru", "row"}) {
    CAPTURE(semantics);
    SimRuntime rt(sim_options());
    const Stream s = rt.create_stream().value();
    HostSources h(spec);
    auto made = Bridge::create(rt, provider_config(spec, provider_semantics(semantics).value()), h.args);
    REQUIRE(made.ok());
    Bridge& b = *made.value();
    REQUIRE(b.prepare(std::vector<std::int64_t>{1}, s).ok());
    // Budget for two experts: the third prediction is not issued.
    const auto p = b.prefetch(std::vector<std::int64_t>{6, 1, 8, 9}, static_cast<std::int64_t>(2 * per_expert), 1, s);
    REQUIRE(p.ok());
    CHECK(p.value().issued == 2);
    CHECK(p.value().skipped_resident == 1);
    CHECK(p.value().bytes >= 2 * per_expert);
    const auto r = b.prepare(std::vector<std::int64_t>{6, 8}, s);
    REQUIRE(r.ok());
    CHECK(r.value().hits == 2);
    CHECK(r.value().misses == 0);
    check_slots(rt, b, h);
    std::map<std::string, std::int64_t> st;
    for (const StatEntry& e : b.stats()) st[e.name] = e.int_value;
    CHECK(st["speculative_issued"] == 2);
    CHECK(st["speculative_used"] == 2);
    CHECK(rt.race_count() == 0);
  }
}

TEST_CASE("plan_split: token chunks keep whole rows, expert groups cut the sorted experts; bad input refused") {
  // 4 rows of top-2 over capacity 3.
  const std::vector<std::int64_t> ids = {0, 1, 1, 2, 3, 4, 4, -1};
  auto t = plan_split(ids, 2, 3, 8, "token");
  REQUIRE(t.ok());
  REQUIRE(t.value().size() == 2);
  CHECK(t.value()[0].row_begin == 0);
  CHECK(t.value()[0].row_end == 2);
  CHECK(t.value()[0].unique_ids == std::vector<std::int32_t>{0, 1, 2});
  CHECK(t.value()[1].row_begin == 2);
  CHECK(t.value()[1].row_end == 4);
  CHECK(t.value()[1].unique_ids == std::vector<std::int32_t>{3, 4});
  CHECK(t.value()[1].include_shared);
  auto g = plan_split(ids, 2, 3, 8, "expert");
  REQUIRE(g.ok());
  REQUIRE(g.value().size() == 2);
  CHECK(g.value()[0].unique_ids == std::vector<std::int32_t>{0, 1, 2});
  CHECK(g.value()[0].include_shared);
  CHECK(g.value()[1].unique_ids == std::vector<std::int32_t>{3, 4});
  CHECK(!g.value()[1].include_shared);
  CHECK(g.value()[1].row_begin == 0);
  CHECK(g.value()[1].row_end == 4);
  // A forward that fits is one part.
  auto one = plan_split(std::vector<std::int64_t>{5, 6, 6, 5}, 2, 3, 8, "token");
  REQUIRE(one.ok());
  CHECK(one.value().size() == 1);
  refused_with(plan_split(ids, 2, 3, 8, "rows").status(), "unknown split 'rows' (valid: token, expert)");
  refused_with(plan_split(std::vector<std::int64_t>{0, 9}, 2, 3, 8, "token").status(), "topk_ids[1] = 9 outside [0, 8)");
  refused_with(plan_split(std::vector<std::int64_t>{0, 1, 2}, 2, 3, 8, "expert").status(), "not a multiple of top_k 2");
  // One row needing more experts than slots: vLLM's wording, the row and the capacity.
  const auto wide_row = plan_split(std::vector<std::int64_t>{5, 6, 5, -1, 0, 1, 2, 3}, 4, 3, 8, "token");
  refused_with(wide_row.status(), "one token routes to 4 experts (row 1) but capacity is 3 slots: no split fits it");
  CHECK(wide_row.status().code() == ErrorCode::row_exceeds_capacity);
  // Padding and repeats do not count: 3 distinct experts fit 3 slots.
  auto padded = plan_split(std::vector<std::int64_t>{0, 1, 1, 2, -1, -1, 2, 0}, 4, 3, 8, "token");
  REQUIRE(padded.ok());
  CHECK(padded.value().size() == 1);
  // The expert split has no such limit: the row's experts go to two groups.
  auto groups = plan_split(std::vector<std::int64_t>{0, 1, 2, 3}, 4, 3, 8, "expert");
  REQUIRE(groups.ok());
  CHECK(groups.value().size() == 2);
  // An empty forward: no token chunk, one empty expert group.
  auto empty_token = plan_split(std::vector<std::int64_t>{}, 2, 3, 8, "token");
  REQUIRE(empty_token.ok());
  CHECK(empty_token.value().empty());
  auto empty_expert = plan_split(std::vector<std::int64_t>{}, 2, 3, 8, "expert");
  REQUIRE(empty_expert.ok());
  REQUIRE(empty_expert.value().size() == 1);
  CHECK(empty_expert.value()[0].unique_ids.empty());
}

TEST_CASE("prefetch_order: the scored hints a prefetch considers, highest score first, ties as given") {
  using V = std::vector<std::int64_t>;
  using F = std::vector<float>;
  const auto order = [](V ids, F scores, float min_score) {
    auto r = prefetch_order(ids, scores, min_score);
    REQUIRE_MESSAGE(r.ok(), std::string(r.status().message()));
    return r.value();
  };
  CHECK(order(V{5, 6, 7, 8}, F{0.6f, 0.9f, 0.3f, 0.7f}, 0.5f) == V{6, 8, 5});
  CHECK(order(V{9, 3, 4}, F{0.8f, 0.8f, 0.8f}, 0.5f) == V{9, 3, 4});
  CHECK(order(V{1, 2, 3, 4}, F{0.5f, 0.7f, 0.5f, 0.49f}, 0.5f) == V{2, 1, 3});  // min_score inclusive
  CHECK(order(V{1, 2}, F{0.0f, 0.0f}, 0.0f) == V{1, 2});
  CHECK(order(V{1, 2}, F{0.2f, 0.1f}, 0.5f).empty());
  CHECK(order(V{}, F{}, 0.5f).empty());
  const auto refused = [](V ids, F scores, float min_score, const std::string& expected) {
    refused_with(prefetch_order(ids, scores, min_score).status(), expected);
  };
  refused(V{1, 2}, F{0.5f}, 0.5f, "prefetch_order: 1 scores for 2 ids (one score per id)");
  refused(V{1, 2}, F{}, 0.5f, "prefetch_order: 0 scores for 2 ids");
  refused(V{1, std::int64_t{1} << 40}, F{0.5f, 0.5f}, 0.5f, "prefetch_order: ids[1] = 1099511627776 is not an expert id");
  refused(V{1, 2}, F{0.5f, std::numeric_limits<float>::quiet_NaN()}, 0.5f,
          "prefetch score nan at index 1 (expert 2) is not a probability in [0, 1]");
  refused(V{1, 2}, F{0.5f, 0.5f}, 1.25f, "prefetch min_score 1.25 is not in [0, 1]");
}

TEST_CASE("CacheBridge: a scored prefetch fills in prefetch_order's order (what the providers' ledger follows)") {
  constexpr std::int64_t E = 10;
  const ProviderSpec spec = validate_provider_sources(4, nvfp4_sources(E)).value();
  std::int64_t per_expert = 0;
  for (const ProviderSource& src : spec.sources) per_expert += static_cast<std::int64_t>(src.bytes_per_expert);
  // lfru takes free slots from the top (the first miss gets slot C-1), row from slot 0.
  for (const auto& semantics_and_slot : {std::pair{std::string("lfru"), 3}, std::pair{std::string("row"), 0}}) {
    const std::string& semantics = semantics_and_slot.first;  // a plain reference: CAPTURE takes it in a lambda
    const int first_free = semantics_and_slot.second;
    CAPTURE(semantics);
    SimRuntime rt(sim_options());
    const Stream s = rt.create_stream().value();
    HostSources h(spec);
    auto made = Bridge::create(rt, provider_config(spec, provider_semantics(semantics).value()), h.args);
    REQUIRE(made.ok());
    Bridge& b = *made.value();
    const std::vector<std::int64_t> ids{5, 6, 7, 8};
    const std::vector<float> scores{0.6f, 0.9f, 0.3f, 0.7f};
    const auto order = prefetch_order(ids, scores, 0.5f);
    REQUIRE(order.ok());
    REQUIRE(order.value() == std::vector<std::int64_t>{6, 8, 5});
    const auto p = b.prefetch(ids, 3 * per_expert, 1, s, HintScores{scores, 0.5f});
    REQUIRE(p.ok());
    CHECK(p.value().issued == 3);
    CHECK(p.value().skipped_unlikely == 1);
    // Three fills into an empty cache: the free slots in the semantics' order, taken by the
    // experts in prefetch_order's order.
    const auto resident = b.resident_map_host();
    const int step = first_free == 0 ? 1 : -1;
    for (std::size_t k = 0; k < order.value().size(); ++k) {
      CHECK(resident[static_cast<std::size_t>(order.value()[k])] == first_free + step * static_cast<int>(k));
    }
    CHECK(resident[7] == -1);
    // The next forward finds all three in their slots.
    const auto r = b.prepare(std::vector<std::int64_t>{5, 6, 8}, s);
    REQUIRE(r.ok());
    CHECK(r.value().hits == 3);
    CHECK(r.value().misses == 0);
    check_slots(rt, b, h);
    CHECK(rt.race_count() == 0);
  }
}
