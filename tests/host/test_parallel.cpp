// Several GPUs on SimRuntime (docs/parallel.md): the id-mapping chain (ExpertPlacement) and its
// validation errors; per-rank caches over ONE shared host pool (SharedHostPool) for expert
// parallel and tensor-slice; N = 1, 2, 4 simulated ranks (one stream and one cache per rank), in
// one SimRuntime (the race detector's clocks then span every rank, the shared pool and the
// reduction) and in one SimRuntime per rank (host-staged reduction); a host reference MoE per rank
// and a simulated reduction, equal bit for bit to the single-rank result; NVFP4 Marlin slices and
// their tile / scale-group checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "expert_cache/expert_cache.hpp"
#include "expert_cache/parallel/expert_placement.hpp"
#include "expert_cache/parallel/shared_host_pool.hpp"
#include "expert_cache/parallel/tp_slice.hpp"
#include "expert_cache/reference/nvfp4_reference.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

using namespace expert_cache;
using Ids = std::vector<std::int32_t>;

namespace {

ExpertPlacement placement_or_fail(PlacementConfig c) {
  auto p = ExpertPlacement::make(std::move(c));
  REQUIRE_MESSAGE(p.ok(), std::string(p.status().message()));
  return std::move(p.value());
}

std::string error_of(PlacementConfig c) {
  auto p = ExpertPlacement::make(std::move(c));
  REQUIRE_FALSE(p.ok());
  CHECK(p.status().code() == ErrorCode::invalid_argument);
  return std::string(p.status().message());
}

PlacementConfig ep(std::int32_t experts, std::int32_t world) {
  PlacementConfig c;
  c.num_global = experts;
  c.world_size = world;
  c.ranges = contiguous_ranges(experts, world);
  return c;
}

PlacementConfig tp(std::int32_t experts, std::int32_t world) {
  PlacementConfig c;
  c.num_global = experts;
  c.world_size = world;
  c.sharding = Sharding::tensor_slice;
  return c;
}

}  // namespace

TEST_CASE("placement: contiguous ranges, owner table, replica map and tensor-slice give the chain") {
  const ExpertPlacement p = placement_or_fail(ep(10, 4));  // 3, 3, 2, 2
  CHECK(p.num_local(0) == 3);
  CHECK(p.num_local(3) == 2);
  CHECK(p.owner_of(5) == 1);
  CHECK(p.local_of(5) == 2);
  CHECK(p.owner_of(6) == 2);
  CHECK(p.local_of(6) == 0);
  CHECK(p.storage_index(9) == 9);
  Ids local(4, 77);
  REQUIRE(p.to_local(2, Ids{6, 7, 0, -1}, local).ok());
  CHECK(local == Ids{0, 1, -1, -1});

  PlacementConfig o;
  o.num_global = 6;
  o.world_size = 2;
  o.owner = {1, 0, 1, 0, 0, 1};  // rank 0: 1, 3, 4; rank 1: 0, 2, 5
  const ExpertPlacement q = placement_or_fail(o);
  CHECK(q.num_local(0) == 3);
  CHECK(q.local_of(4) == 2);
  CHECK(q.local_of(5) == 2);
  CHECK(q.storage_index(0) == 3);  // rank-major storage: rank 1's run starts at 3
  CHECK(q.first_storage_index(1) == 3);
  REQUIRE(q.to_local(1, Ids{5, 4, 0}, local = Ids(3)).ok());
  CHECK(local == Ids{2, -1, 0});

  PlacementConfig r = ep(4, 2);  // replica map: logical 0 -> physical 3 (owned by rank 1)
  r.logical_to_physical = {3, 1, 2, 0};
  const ExpertPlacement rp = placement_or_fail(r);
  REQUIRE(rp.to_local(1, Ids{0, 3}, local = Ids(2)).ok());
  CHECK(local == Ids{1, -1});
  r.replica_kind = ReplicaMapKind::many_to_one;
  r.num_physical = 2;
  r.ranges = contiguous_ranges(2, 2);
  r.logical_to_physical = {0, 1, 1, 0};  // e.g. deduplicated identical experts
  const ExpertPlacement mp = placement_or_fail(r);
  REQUIRE(mp.to_local(1, Ids{0, 1, 2, 3}, local = Ids(4)).ok());
  CHECK(local == Ids{-1, 0, 0, -1});

  const ExpertPlacement t = placement_or_fail(tp(8, 4));
  for (std::int32_t k = 0; k < 4; ++k) {
    CHECK(t.num_local(k) == 8);
    REQUIRE(t.to_local(k, Ids{7, 0, -3}, local = Ids(3)).ok());
    CHECK(local == Ids{7, 0, -1});
  }
  CHECK(p.fingerprint() == placement_or_fail(ep(10, 4)).fingerprint());
  CHECK(p.fingerprint() != placement_or_fail(ep(10, 2)).fingerprint());
  const std::uint64_t fps[] = {p.fingerprint(), p.fingerprint(), placement_or_fail(ep(10, 2)).fingerprint()};
  const Status mismatch = ExpertPlacement::check_fingerprints(fps);
  REQUIRE_FALSE(mismatch.ok());
  CHECK(std::string(mismatch.message()).find("rank 2 was configured differently") != std::string::npos);
}

TEST_CASE("placement: every inconsistent configuration is refused with its own message") {
  auto has = [](const std::string& msg, const char* what) {
    INFO(msg);
    CHECK(msg.find(what) != std::string::npos);
  };
  PlacementConfig c = ep(8, 2);
  c.ranges = {{0, 5}, {4, 8}};
  has(error_of(c), "rank 1 range [4, 8) overlaps");
  c.ranges = {{0, 3}, {4, 8}};
  has(error_of(c), "experts [3, 4) are owned by no rank");
  c.ranges = {{0, 4}, {4, 7}};
  has(error_of(c), "experts [7, 8) are owned by no rank");
  c.ranges = {{0, 4}, {4, 9}};
  has(error_of(c), "is not inside [0, 8)");
  c.ranges = contiguous_ranges(8, 3);
  has(error_of(c), "3 ranges for world_size 2");
  c.ranges = {{0, 8}, {8, 8}};
  has(error_of(c), "rank 1 owns no expert");
  c = ep(4, 2);
  c.ranges.clear();
  c.owner = {0, 1, 2, 0};
  has(error_of(c), "owner[2] = 2 is not a rank of world_size 2");
  c.owner = {0, 1, 1};
  has(error_of(c), "owner table has 3 entries");
  c.owner = {0, 1, 1, 0};
  c.ranges = contiguous_ranges(4, 2);
  has(error_of(c), "not both");
  c = ep(4, 2);
  c.logical_to_physical = {0, 1, 2, 4};
  has(error_of(c), "replica map[3] = 4 is outside [0, 4)");
  c.logical_to_physical = {0, 1, 1, 2};
  has(error_of(c), "not a bijection: logical 1 and 2 both map to physical 1");
  c.logical_to_physical = {0, 1, 2};
  has(error_of(c), "replica map has 3 entries");
  c.logical_to_physical.clear();
  c.num_physical = 6;
  has(error_of(c), "needs a replica map");
  c = tp(4, 2);
  c.ranges = contiguous_ranges(4, 2);
  has(error_of(c), "tensor_slice takes no ranges");
  c = ep(4, 0);
  has(error_of(c), "world_size 0");
  c = ep(4, 2);
  c.ranges.clear();
  has(error_of(c), "needs ranges or an owner table");

  const ExpertPlacement p = placement_or_fail(ep(8, 2));
  Ids local{9, 9, 9};
  const Status bad = p.to_local(1, Ids{5, 8, 6}, local);  // 8 is outside every range
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.code() == ErrorCode::expert_out_of_range);
  has(std::string(bad.message()), "global id 8 at position 1 is outside every rank's experts [0, 8)");
  CHECK(local == Ids{9, 9, 9});  // nothing written
  CHECK_FALSE(p.to_local(2, Ids{1}, std::span<std::int32_t>(local).first(1)).ok());
  CHECK_FALSE(p.to_local(0, Ids{1, 2}, local).ok());  // length mismatch
  CHECK(local == Ids{9, 9, 9});
  has(std::string(p.check_rank(1, 4, 4).message()), "rank 1 has world_size 4, the placement 2");
  has(std::string(p.check_rank(1, 2, 8).message()), "rank 1's cache has 8 experts, the placement gives it 4");
  CHECK(p.check_rank(1, 2, 4).ok());
}

namespace {

// ---- a dense MoE whose every value is exact in fp32 ------------------------------------------
// Weights are bf16 integers in [-2, 2], inputs integers in [-2, 2], router weights 1/2 and 1/4,
// and the activation is gate * up (a GLU without the SiLU): every product and partial sum is an
// integer below 2^24 times a power of two, so fp32 sums are exact in ANY order and the reduced
// N-rank output equals the single-rank output bit for bit (docs/parallel.md, Bit-identity).
constexpr std::int32_t kHidden = 32, kInter = 16, kExperts = 16, kTopK = 2, kTokens = 2;

float bf16(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<std::uint16_t>(u >> 16);  // exact for the small integers used here
}

struct DenseModel {
  std::vector<std::uint16_t> w13, w2;  // [E][2N][K], [E][K][N]
  DenseModel() {
    std::mt19937_64 rng(17);
    std::uniform_int_distribution<int> d(-2, 2);
    w13.resize(static_cast<std::size_t>(kExperts) * 2 * kInter * kHidden);
    w2.resize(static_cast<std::size_t>(kExperts) * kHidden * kInter);
    for (auto& w : w13) w = to_bf16(static_cast<float>(d(rng)));
    for (auto& w : w2) w = to_bf16(static_cast<float>(d(rng)));
  }
  [[nodiscard]] const std::uint16_t* expert_w13(std::int32_t e) const { return w13.data() + static_cast<std::size_t>(e) * 2 * kInter * kHidden; }
  [[nodiscard]] const std::uint16_t* expert_w2(std::int32_t e) const { return w2.data() + static_cast<std::size_t>(e) * kHidden * kInter; }
};

// One expert (w13 [2n, K], w2 [K, n] bf16) applied to x, scaled by coef, added into y.
void expert_forward(const std::uint16_t* w13, const std::uint16_t* w2, std::int32_t n, const float* x, float coef,
                    float* y) {
  std::vector<float> act(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) {
    float gate = 0, up = 0;
    for (std::int32_t k = 0; k < kHidden; ++k) {
      gate += bf16(w13[i * kHidden + k]) * x[k];
      up += bf16(w13[(n + i) * kHidden + k]) * x[k];
    }
    act[static_cast<std::size_t>(i)] = gate * up;
  }
  for (std::int32_t k = 0; k < kHidden; ++k) {
    float s = 0;
    for (std::int32_t i = 0; i < n; ++i) s += bf16(w2[k * n + i]) * act[static_cast<std::size_t>(i)];
    y[k] += coef * s;
  }
}

// The single-rank reference, straight from the model's weights (no cache).
std::vector<float> reference_moe(const DenseModel& m, const Ids& ids, const std::vector<float>& coef,
                                 const std::vector<float>& x) {
  std::vector<float> out(static_cast<std::size_t>(kTokens) * kHidden, 0.0f);
  for (std::int32_t p = 0; p < kTokens * kTopK; ++p) {
    const std::int32_t e = ids[static_cast<std::size_t>(p)];
    if (e < 0) continue;
    const std::int32_t t = p / kTopK;
    expert_forward(m.expert_w13(e), m.expert_w2(e), kInter, x.data() + t * kHidden, coef[static_cast<std::size_t>(p)],
                   out.data() + t * kHidden);
  }
  return out;
}

using RankCache = RowCache<SimRuntime, DenseBf16>;

// How the simulated ranks map to SimRuntimes. shared: ONE runtime for every rank (the detector's
// clocks span the ranks, the shared pool and the reduction, which is a launch on its own stream
// waiting for each rank's event). per_rank: one runtime per rank (as one device each); the
// reduction is host-staged (synchronize each rank, read its partial, sum on the host in rank
// order), and each detector sees its own rank's accesses, the shared pool's reads among them.
enum class Runtimes { shared, per_rank };

// N simulated ranks: per rank a consumer stream, a cache over its part of the shared pool, a
// partial-output buffer and a "done" event; one reduction stream.
class ParallelSim {
 public:
  ParallelSim(Sharding sharding, std::int32_t world, std::int32_t capacity, const DenseModel& model,
              Runtimes runtimes = Runtimes::shared)
      : rts_(make_runtimes(runtimes == Runtimes::shared ? 1 : world)),
        rt_(*rts_.front()),
        placement_(placement_or_fail(sharding == Sharding::expert_parallel ? ep(kExperts, world) : tp(kExperts, world))),
        layout_(sharding == Sharding::expert_parallel ? DenseBf16{kHidden, kInter}
                                                      : tp_slice_layout(DenseBf16{kHidden, kInter}, world).value()),
        pool_(rt_, placement_, layout_.tensors()),
        out_(rt_, out_bytes(), MemoryKind::device),
        reduce_stream_(rt_.create_stream().value()) {
    // Load: every expert byte written once into the shared pool (host writes, declared).
    for (std::int32_t e = 0; e < kExperts; ++e) {
      if (sharding == Sharding::expert_parallel) {
        std::memcpy(pool_.expert(0, 0, e), model.expert_w13(e), layout_.w13_bytes());
        std::memcpy(pool_.expert(1, 0, e), model.expert_w2(e), layout_.w2_bytes());
      } else {
        for (std::int32_t r = 0; r < world; ++r)
          slice_dense_expert(DenseBf16{kHidden, kInter}, world, r, model.expert_w13(e), model.expert_w2(e),
                             reinterpret_cast<std::uint16_t*>(pool_.expert(0, r, e)),
                             reinterpret_cast<std::uint16_t*>(pool_.expert(1, r, e)));
      }
    }
    for (auto& rt : rts_)
      for (std::size_t t = 0; t < 2; ++t) rt->host_access(pool_.expert(t, 0, 0), pool_.host_bytes(t), AccessMode::write);
    for (std::int32_t r = 0; r < world; ++r) {
      CacheOptions o;
      o.num_experts = placement_.num_local(r);
      o.capacity = std::min(capacity, o.num_experts);
      o.top_k = kTopK;
      o.memory = pool_.rank_memory(r);
      o.label = "rank " + std::to_string(r);
      SimRuntime& rt = rank_rt(r);
      Rank k{rt.create_stream().value(), std::make_unique<RankCache>(rt, o, layout_),
             RuntimeBuffer<SimRuntime>(rt, out_bytes(), MemoryKind::device), rt.create_event().value(), &rt};
      REQUIRE(placement_.check_rank(r, world, k.cache->options().num_experts).ok());
      ranks_.push_back(std::move(k));
    }
  }

  // One forward on every rank, then the reduction; returns the reduced output (host copy).
  // skip_wait_rank >= 0 leaves that rank's wait out of the reduction (the negative test).
  std::vector<float> step(const Ids& ids, const std::vector<float>& coef, const std::vector<float>& x,
                          std::int32_t skip_wait_rank = -1) {
    for (std::int32_t r = 0; r < world(); ++r) {
      Rank& k = ranks_[static_cast<std::size_t>(r)];
      Ids local(ids.size());
      REQUIRE(placement_.to_local(r, ids, local).ok());
      auto view = k.cache->prepare(local, k.stream);
      REQUIRE_MESSAGE(view.ok(), std::string(view.status().message()));
      REQUIRE(launch_consumer(k, view.value(), std::move(local), coef, x).ok());
      REQUIRE(k.rt->record(k.done, k.stream).ok());
    }
    if (rts_.size() > 1) return host_reduction(skip_wait_rank);
    for (std::int32_t r = 0; r < world(); ++r)
      if (r != skip_wait_rank) REQUIRE(rt_.wait(reduce_stream_, ranks_[static_cast<std::size_t>(r)].done).ok());
    std::vector<Access> acc;
    for (const Rank& k : ranks_) acc.push_back({k.partial.data(), out_bytes(), AccessMode::read});
    acc.push_back({out_.data(), out_bytes(), AccessMode::write});
    REQUIRE(rt_.launch(reduce_stream_, acc, [this] {
                 // Simulated all-reduce: a fixed rank order (0, 1, ..., N-1).
                 auto* out = reinterpret_cast<float*>(out_.data());
                 std::fill(out, out + kTokens * kHidden, 0.0f);
                 for (const Rank& k : ranks_) {
                   const auto* p = reinterpret_cast<const float*>(k.partial.data());
                   for (std::int32_t i = 0; i < kTokens * kHidden; ++i) out[i] += p[i];
                 }
               }).ok());
    REQUIRE(rt_.synchronize(reduce_stream_).ok());
    rt_.host_access(out_.data(), out_bytes(), AccessMode::read);
    std::vector<float> host(static_cast<std::size_t>(kTokens) * kHidden);
    std::memcpy(host.data(), out_.data(), out_bytes());
    return host;
  }

  [[nodiscard]] std::int32_t world() const noexcept { return placement_.world_size(); }
  [[nodiscard]] std::uint64_t race_count() const noexcept {
    std::uint64_t n = 0;
    for (const auto& rt : rts_) n += rt->race_count();
    return n;
  }
  [[nodiscard]] std::vector<std::string> races() const {
    std::vector<std::string> d;
    for (const auto& rt : rts_)
      for (const auto& r : rt->races()) d.push_back(r.description);
    return d;
  }
  [[nodiscard]] std::size_t runtimes() const noexcept { return rts_.size(); }
  [[nodiscard]] CacheStats stats(std::int32_t r) const { return ranks_[static_cast<std::size_t>(r)].cache->stats(); }
  [[nodiscard]] RankCache& cache(std::int32_t r) { return *ranks_[static_cast<std::size_t>(r)].cache; }
  [[nodiscard]] const ExpertPlacement& placement() const noexcept { return placement_; }
  SimRuntime& rt() noexcept { return rt_; }
  SharedHostPool<SimRuntime>& pool() noexcept { return pool_; }
  void finish() {
    for (auto& rt : rts_) rt->drain();
  }

 private:
  struct Rank {
    SimRuntime::Stream stream;
    std::unique_ptr<RankCache> cache;
    RuntimeBuffer<SimRuntime> partial;
    SimRuntime::Event done;
    SimRuntime* rt;  // the rank's runtime
  };
  static std::vector<std::unique_ptr<SimRuntime>> make_runtimes(std::int32_t n) {
    std::vector<std::unique_ptr<SimRuntime>> v;
    for (std::int32_t i = 0; i < n; ++i) v.push_back(std::make_unique<SimRuntime>());
    return v;
  }
  SimRuntime& rank_rt(std::int32_t r) { return rts_.size() == 1 ? *rts_.front() : *rts_[static_cast<std::size_t>(r)]; }

  // Per-rank runtimes: the host waits for each rank, reads its partial (declared) and sums in
  // rank order. skip_wait_rank's partial is read without the wait (the negative test).
  std::vector<float> host_reduction(std::int32_t skip_wait_rank) {
    std::vector<float> out(static_cast<std::size_t>(kTokens) * kHidden, 0.0f);
    for (std::int32_t r = 0; r < world(); ++r) {
      Rank& k = ranks_[static_cast<std::size_t>(r)];
      if (r != skip_wait_rank) REQUIRE(k.rt->synchronize(k.stream).ok());
      k.rt->host_access(k.partial.data(), out_bytes(), AccessMode::read);
      const auto* p = reinterpret_cast<const float*>(k.partial.data());
      for (std::size_t i = 0; i < out.size(); ++i) out[i] += p[i];
    }
    return out;
  }
  static std::size_t out_bytes() noexcept { return static_cast<std::size_t>(kTokens) * kHidden * sizeof(float); }

  // The reference consumer of one rank: reads the forward map and the slots of its local
  // experts (declared), writes its partial output.
  Status launch_consumer(Rank& k, const ForwardView& v, Ids local, const std::vector<float>& coef,
                         const std::vector<float>& x) {
    const std::int32_t n = static_cast<std::int32_t>(layout_.intermediate);
    const auto E = static_cast<std::size_t>(k.cache->options().num_experts);
    std::vector<Access> acc{{v.expert_map, E * sizeof(std::int32_t), AccessMode::read},
                            {k.partial.data(), out_bytes(), AccessMode::write}};
    const auto host_map = k.cache->forward_map_host();
    for (std::int32_t l : local)
      if (l >= 0)
        for (std::size_t t = 0; t < 2; ++t)
          acc.push_back({v.tensors[t].slot(host_map[static_cast<std::size_t>(l)]), v.tensors[t].bytes, AccessMode::read});
    return k.rt->launch(k.stream, acc, [v, n, local = std::move(local), coef, x, partial = k.partial.data()] {
      auto* out = reinterpret_cast<float*>(partial);
      std::fill(out, out + kTokens * kHidden, 0.0f);
      for (std::size_t p = 0; p < local.size(); ++p) {
        if (local[p] < 0) continue;  // another rank's expert, or padding
        const std::int32_t slot = v.expert_map[local[p]];
        const auto* w13 = reinterpret_cast<const std::uint16_t*>(v.tensors[0].slot(slot));
        const auto* w2 = reinterpret_cast<const std::uint16_t*>(v.tensors[1].slot(slot));
        const auto t = static_cast<std::int32_t>(p) / kTopK;
        expert_forward(w13, w2, n, x.data() + t * kHidden, coef[p], out + t * kHidden);
      }
    });
  }

  std::vector<std::unique_ptr<SimRuntime>> rts_;  // one, or one per rank
  SimRuntime& rt_;                                // the host's (rank 0's): pool registration, reduction
  ExpertPlacement placement_;
  DenseBf16 layout_;
  SharedHostPool<SimRuntime> pool_;
  RuntimeBuffer<SimRuntime> out_;
  SimRuntime::Stream reduce_stream_;
  std::vector<Rank> ranks_;
};

struct Forward {
  Ids ids;
  std::vector<float> coef, x;
};

// A skewed decode trace: kTopK distinct experts per token, hot experts more often.
std::vector<Forward> make_trace(std::size_t steps, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> xs(-2, 2);
  std::vector<Forward> f(steps);
  for (auto& s : f) {
    for (std::int32_t t = 0; t < kTokens; ++t) {
      std::int32_t a = static_cast<std::int32_t>(std::min<std::uint64_t>(rng() % kExperts, rng() % kExperts));
      std::int32_t b = static_cast<std::int32_t>(rng() % kExperts);
      if (b == a) b = (a + 1 + static_cast<std::int32_t>(rng() % (kExperts - 1))) % kExperts;
      s.ids.push_back(a);
      s.ids.push_back(b);
      s.coef.push_back(0.5f);
      s.coef.push_back(0.25f);
    }
    for (std::int32_t i = 0; i < kTokens * kHidden; ++i) s.x.push_back(static_cast<float>(xs(rng)));
  }
  return f;
}

}  // namespace

TEST_CASE("parallel sim: N = 1, 2, 4 ranks, expert parallel and tensor-slice, equal the single-rank result bit for bit") {
  const DenseModel model;
  const auto trace = make_trace(60, 5);
  // The single-rank run: one cache over every expert, through the same harness.
  ParallelSim single(Sharding::expert_parallel, 1, 6, model);
  std::vector<std::vector<float>> single_out;
  for (const Forward& f : trace) {
    single_out.push_back(single.step(f.ids, f.coef, f.x));
    const auto ref = reference_moe(model, f.ids, f.coef, f.x);
    REQUIRE(std::memcmp(single_out.back().data(), ref.data(), ref.size() * sizeof(float)) == 0);
  }
  single.finish();
  CHECK(single.rt().races().empty());
  const CacheStats one = single.stats(0);
  CHECK(one.evictions > 0);  // the trace exercises eviction (capacity 6 of 16)

  std::vector<std::uint64_t> shared_hits;  // per (split, N, rank), in loop order
  for (Runtimes rts : {Runtimes::shared, Runtimes::per_rank}) {
    std::size_t at = 0;
    for (Sharding sh : {Sharding::expert_parallel, Sharding::tensor_slice}) {
      for (std::int32_t world : {1, 2, 4}) {
        CAPTURE(world);
        CAPTURE(sh == Sharding::tensor_slice);
        CAPTURE(rts == Runtimes::per_rank);
        // Same per-GPU slot memory as the single run: expert parallel keeps 6 slots per rank,
        // tensor-slice 6 * world slices (each 1/world of an expert).
        const std::int32_t cap = sh == Sharding::expert_parallel ? 6 : std::min(6 * world, kExperts);
        ParallelSim sim(sh, world, cap, model, rts);
        for (std::size_t s = 0; s < trace.size(); ++s) {
          const auto out = sim.step(trace[s].ids, trace[s].coef, trace[s].x);
          REQUIRE_MESSAGE(std::memcmp(out.data(), single_out[s].data(), out.size() * sizeof(float)) == 0, "step " << s);
        }
        sim.finish();
        for (const auto& race : sim.races()) FAIL_CHECK(race);
        CHECK(sim.race_count() == 0);
        CHECK(sim.runtimes() == (rts == Runtimes::shared ? 1u : static_cast<std::size_t>(world)));
        std::uint64_t lookups = 0, misses = 0;
        for (std::int32_t r = 0; r < world; ++r) {
          const CacheStats s = sim.stats(r);
          if (rts == Runtimes::per_rank) {
            CHECK(s.hits == shared_hits[at++]);  // the same decisions as with one shared runtime
          } else {
            shared_hits.push_back(s.hits);
            MESSAGE(std::string(sh == Sharding::tensor_slice ? "tensor-slice" : "expert parallel")
                    << " N=" << world << " rank " << r << ": hit rate " << s.hit_rate() << " (" << s.hits << "/"
                    << s.hits + s.misses << ")");
          }
          lookups += s.hits + s.misses;
          misses += s.misses;
          if (sh == Sharding::tensor_slice) {
            // Every rank sees every id: the same lookups as the single cache, the same decisions
            // on every rank (same ids, same capacity).
            CHECK(s.hits + s.misses == one.hits + one.misses);
            CHECK(s.hits == sim.stats(0).hits);
          }
        }
        if (sh == Sharding::expert_parallel) {
          CHECK(lookups == one.hits + one.misses);  // each lookup at its owner only
          CHECK(misses <= one.misses);  // 6 slots per rank over fewer experts: LRU inclusion, never more misses
        } else {
          CHECK(sim.stats(0).misses <= one.misses);  // 6 * world slices per rank: the same ids, more room
        }
        if (world == 1) CHECK(misses == one.misses);
      }
    }
  }
}

TEST_CASE("parallel sim: global ids used as local ids on ranks >= 1 are caught (the engine bug)") {
  // Rank 1 owns [8, 16). The bug passed global ids to rank 1's cache: the ids are outside its
  // [0, 8) and an engine that masked them to -1 dropped every expert of rank 1 silently.
  const DenseModel model;
  ParallelSim sim(Sharding::expert_parallel, 2, 4, model);
  const Ids ids{9, 12, 3, 15};
  Ids local(ids.size());
  REQUIRE(sim.placement().to_local(1, ids, local).ok());
  CHECK(local == Ids{1, 4, -1, 7});
  const Ids as_global_bug{9, 12, -1, 15};  // what the buggy engine handed the rank
  auto refused = sim.cache(1).prepare(as_global_bug, SimRuntime::Stream{1});
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == ErrorCode::expert_out_of_range);
  // Through the chain, rank 1's experts contribute: the reduced output equals the reference,
  // and would not with rank 1's pairs dropped (the output of rank 0 alone differs).
  const std::vector<float> coef{0.5f, 0.25f, 0.5f, 0.25f};
  std::vector<float> x(static_cast<std::size_t>(kTokens) * kHidden);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i % 5) - 2);
  const auto out = sim.step(ids, coef, x);
  const auto ref = reference_moe(model, ids, coef, x);
  CHECK(std::memcmp(out.data(), ref.data(), ref.size() * sizeof(float)) == 0);
  const auto dropped = reference_moe(model, Ids{-1, -1, 3, -1}, coef, x);
  CHECK(std::memcmp(dropped.data(), ref.data(), ref.size() * sizeof(float)) != 0);
  CHECK(sim.stats(1).misses == 3);
}

TEST_CASE("parallel sim: a bad global id is refused before any rank's cache changes") {
  const DenseModel model;
  ParallelSim sim(Sharding::expert_parallel, 2, 4, model);
  const std::vector<float> coef{0.5f, 0.25f, 0.5f, 0.25f};
  const std::vector<float> x(static_cast<std::size_t>(kTokens) * kHidden, 1.0f);
  (void)sim.step(Ids{1, 9, 2, 10}, coef, x);
  const CacheStats before0 = sim.stats(0), before1 = sim.stats(1);
  const std::vector<std::int32_t> map0(sim.cache(0).resident_map_host().begin(), sim.cache(0).resident_map_host().end());
  Ids local(4, 0);
  const Status s = sim.placement().to_local(1, Ids{1, 16, 2, 10}, local);
  REQUIRE_FALSE(s.ok());  // 16 is outside every range: the rank step stops here, for every rank
  CHECK(local == Ids{0, 0, 0, 0});
  CHECK(sim.stats(0).prepare_calls == before0.prepare_calls);
  CHECK(sim.stats(1).prepare_calls == before1.prepare_calls);
  CHECK(sim.stats(1).misses == before1.misses);
  CHECK(std::equal(map0.begin(), map0.end(), sim.cache(0).resident_map_host().begin()));
  sim.finish();
  CHECK(sim.rt().race_count() == 0);
}

TEST_CASE("parallel sim: the race detector covers the reduction and the shared pool") {
  const DenseModel model;
  const auto trace = make_trace(4, 9);
  SUBCASE("a reduction that does not wait for rank 1 races with rank 1's consumer") {
    for (Runtimes rts : {Runtimes::shared, Runtimes::per_rank}) {
      ParallelSim sim(Sharding::tensor_slice, 2, 8, model, rts);
      (void)sim.step(trace[0].ids, trace[0].coef, trace[0].x, /*skip_wait_rank=*/1);
      sim.finish();
      REQUIRE(sim.race_count() > 0);
      CHECK(sim.races()[0].find("data race") != std::string::npos);
    }
  }
  SUBCASE("ranks reading the shared pool: silent; a host write into it while fills are pending: a race") {
    ParallelSim sim(Sharding::tensor_slice, 4, 8, model);
    for (const Forward& f : trace) (void)sim.step(f.ids, f.coef, f.x);
    sim.finish();
    CHECK(sim.rt().race_count() == 0);
    // New ids: every rank's copy stream reads its slice; the host rewrites expert 15's slice of
    // rank 2 before those fills completed (no synchronize): the detector reports it.
    for (std::int32_t r = 0; r < 4; ++r) {
      REQUIRE(sim.cache(r).invalidate(15, SimRuntime::Stream{1}).ok());  // so that 15 is a fill on every rank
      Ids local(4);
      REQUIRE(sim.placement().to_local(r, Ids{15, 14, 13, 12}, local).ok());
      REQUIRE(sim.cache(r).prepare(local, SimRuntime::Stream{1}).ok());
    }
    sim.rt().host_access(sim.pool().expert(0, 2, 15), 64, AccessMode::write);
    sim.finish();
    CHECK(sim.rt().race_count() > 0);
  }
}

TEST_CASE("shared host pool: expert parallel adopts one sub-span per rank, tensor-slice shares the global scales") {
  SimRuntime rt;
  const Nvfp4Marlin full{128, 256, ActDtype::bf16};
  const Nvfp4Marlin slice = tp_slice_layout(full, 2).value();
  CHECK(slice.intermediate == 128);
  {  // tensor-slice: 2 ranks, one registration per tensor, global scales stored once
    const ExpertPlacement p = placement_or_fail(tp(6, 2));
    SharedHostPool<SimRuntime> pool(rt, p, slice.tensors());
    const StorageMemory m0 = pool.rank_memory(0), m1 = pool.rank_memory(1);
    CHECK(m0.host_registered);
    CHECK(m0.host_tensors[0].bytes == 6 * slice.tensors()[0].bytes_per_expert);
    CHECK(m1.host_tensors[0].data != m0.host_tensors[0].data);
    CHECK(m1.host_tensors[4].data == m0.host_tensors[4].data);  // w13_scale_2: one copy
    CHECK(m1.host_tensors[5].data == m0.host_tensors[5].data);
    CHECK(pool.host_bytes(4) == 64);  // 6 floats, rounded up to 64
    CHECK(pool.host_bytes(0) == 2 * 6 * slice.tensors()[0].bytes_per_expert);
    for (std::size_t t = 0; t < 6; ++t) {
      const auto b = slice.tensors()[t].bytes_per_expert;
      for (std::int32_t r = 0; r < 2; ++r)
        for (std::int32_t e = 0; e < 6; ++e)
          for (std::size_t i = 0; i < b; ++i)
            pool.expert(t, r, e)[i] = static_cast<std::byte>((t * 31 + static_cast<std::size_t>(r) * 7 +
                                                              static_cast<std::size_t>(e) * 3 + i) & 0xFF);
    }
    // Both ranks' caches over the pool: host memory adopted in place (no second registration:
    // SimRuntime refuses overlapping registrations, so a re-registration would throw).
    std::vector<std::unique_ptr<RowCache<SimRuntime, Nvfp4Marlin>>> caches;
    std::vector<SimRuntime::Stream> streams;
    for (std::int32_t r = 0; r < 2; ++r) {
      CacheOptions o;
      o.num_experts = 6;
      o.capacity = 3;
      o.top_k = 1;
      o.memory = pool.rank_memory(r);
      caches.push_back(std::make_unique<RowCache<SimRuntime, Nvfp4Marlin>>(rt, o, slice));
      streams.push_back(rt.create_stream().value());
      CHECK(caches.back()->storage().host_tensor(0, 0) == pool.expert(0, r, 0));
      CHECK(caches.back()->storage().host_tensor(5, 2) == pool.expert(5, 0, 2));
    }
    for (std::int32_t r = 0; r < 2; ++r) REQUIRE(caches[static_cast<std::size_t>(r)]->prepare(Ids{4, 1}, streams[static_cast<std::size_t>(r)]).ok());
    REQUIRE(rt.synchronize(streams[0]).ok());
    REQUIRE(rt.synchronize(streams[1]).ok());
    rt.drain();
    CHECK(rt.race_count() == 0);  // both ranks' copy streams read the shared scales: reads only
    for (std::int32_t r = 0; r < 2; ++r) {
      auto& c = *caches[static_cast<std::size_t>(r)];
      const std::int32_t slot = c.resident_map_host()[4];
      for (std::size_t t = 0; t < 6; ++t) {
        const SlotTensor st = c.storage().slot_tensor(t);
        rt.host_access(st.slot(slot), st.bytes, AccessMode::read);
        CHECK(std::memcmp(st.slot(slot), pool.expert(t, r, 4), st.bytes) == 0);
      }
    }
  }
  {  // expert parallel over an owner table: rank-major runs, 64-byte aligned starts
    PlacementConfig c;
    c.num_global = 5;
    c.world_size = 2;
    c.owner = {1, 0, 1, 0, 1};
    const ExpertPlacement p = placement_or_fail(c);
    SharedHostPool<SimRuntime> pool(rt, p, full.tensors());
    const StorageMemory m1 = pool.rank_memory(1);
    CHECK(m1.host_tensors[5].bytes == 3 * sizeof(float));
    CHECK(reinterpret_cast<std::uintptr_t>(m1.host_tensors[5].data) % 64 == 0);
    CHECK(pool.expert(5, 0, 2) == static_cast<std::byte*>(m1.host_tensors[5].data) + sizeof(float));  // local 1 of rank 1
    CHECK(pool.expert(0, 0, 3) == static_cast<std::byte*>(pool.rank_memory(0).host_tensors[0].data) +
                                      full.tensors()[0].bytes_per_expert);
  }
}

TEST_CASE("tensor-slice NVFP4 Marlin: tile and scale-group checks; each rank's repacked slice decodes to its columns") {
  auto err = [](Nvfp4Marlin l, std::int32_t n_tp) {
    auto r = tp_slice_layout(l, n_tp);
    REQUIRE_FALSE(r.ok());
    return std::string(r.status().message());
  };
  CHECK(err({128, 96, ActDtype::bf16}, 2).find("48 is not a multiple of the 64-column Marlin tile") != std::string::npos);
  CHECK(err({128, 160, ActDtype::bf16}, 4).find("40 is not a multiple of the 16-element scale group") != std::string::npos);
  CHECK(err({128, 128, ActDtype::bf16}, 3).find("not divisible by TP=3") != std::string::npos);
  CHECK(err({192, 256, ActDtype::bf16}, 4).find("128-column Marlin tile for K=192") != std::string::npos);
  CHECK(tp_slice_layout(Nvfp4Marlin{192, 256, ActDtype::bf16}, 2).ok());
  CHECK(tp_slice_layout(Nvfp4Marlin{2048, 512, ActDtype::bf16}, 8).ok());  // 64-column slices
  CHECK_FALSE(tp_slice_layout(DenseBf16{64, 30}, 4).ok());
  CHECK(tp_slice_layout(DenseBf16{64, 32}, 4).value().intermediate == 8);

  const Nvfp4Marlin full{128, 128, ActDtype::bf16};
  constexpr std::int64_t E = 3;
  std::mt19937_64 rng(3);
  auto bytes = [&](std::int64_t n, int lo, int hi) {
    std::vector<std::uint8_t> v(static_cast<std::size_t>(n));
    std::uniform_int_distribution<int> d(lo, hi);
    for (auto& b : v) b = static_cast<std::uint8_t>(d(rng));
    return v;
  };
  const auto w13 = bytes(E * full.ckpt_w13_bytes(), 0, 255), w2 = bytes(E * full.ckpt_w2_bytes(), 0, 255);
  const auto s13 = bytes(E * full.ckpt_w13_scale_bytes(), 0x01, 0x5F), s2 = bytes(E * full.ckpt_w2_scale_bytes(), 0x01, 0x5F);
  const std::vector<float> g13{0.02f, 0.02f, 0.5f, 0.5f, 3.0f, 3.0f}, g2{0.1f, 0.03f, 2.0f};
  const Nvfp4CheckpointLayer src{E, w13, s13, g13, w2, s2, g2};
  const auto report = analyze_checkpoint(full, src);
  REQUIRE(report.ok());
  std::vector<double> full13(static_cast<std::size_t>(E * 2 * 128 * 128)), full2(static_cast<std::size_t>(E * 128 * 128));
  REQUIRE(dequant_checkpoint_reference(full, src, full13, full2, &report.value().params).ok());
  const Nvfp4Marlin sl = tp_slice_layout(full, 2).value();
  const std::int64_t n = sl.intermediate, K = full.hidden, N = full.intermediate;
  for (std::int32_t r = 0; r < 2; ++r) {
    std::vector<std::uint32_t> m13(static_cast<std::size_t>(E * sl.w13_words())), m2(static_cast<std::size_t>(E * sl.w2_words()));
    std::vector<std::uint8_t> ms13(static_cast<std::size_t>(E * sl.w13_scale_bytes())), ms2(static_cast<std::size_t>(E * sl.w2_scale_bytes()));
    std::vector<float> mg13(E), mg2(E);
    const Nvfp4MarlinLayer dst{m13, m2, ms13, ms2, mg13, mg2};
    const auto rep = repack_tp_slice_reference(full, src, 2, r, dst);
    REQUIRE_MESSAGE(rep.ok(), std::string(rep.status().message()));
    CHECK(rep.value().params == report.value().params);  // the full layer's factors
    std::vector<double> d13(static_cast<std::size_t>(E * 2 * n * K)), d2(static_cast<std::size_t>(E * K * n));
    REQUIRE(dequant_marlin_reference(sl, E, dst.as_const(), d13, d2).ok());
    std::int64_t bad = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      for (std::int64_t row = 0; row < 2 * n; ++row)
        for (std::int64_t k = 0; k < K; ++k) {
          const std::int64_t full_row = (row / n) * N + r * n + row % n;
          bad += d13[static_cast<std::size_t>((e * 2 * n + row) * K + k)] != full13[static_cast<std::size_t>((e * 2 * N + full_row) * K + k)];
        }
      for (std::int64_t k = 0; k < K; ++k)
        for (std::int64_t i = 0; i < n; ++i)
          bad += d2[static_cast<std::size_t>((e * K + k) * n + i)] != full2[static_cast<std::size_t>((e * K + k) * N + r * n + i)];
    }
    CHECK(bad == 0);
  }
  CHECK_FALSE(repack_tp_slice_reference(full, src, 2, 2, Nvfp4MarlinLayer{}).ok());  // rank out of range
}
