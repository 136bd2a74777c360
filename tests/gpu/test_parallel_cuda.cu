// Several GPUs' worth of ranks side by side on ONE device (docs/parallel.md), suite 'gpu' (exits
// 77 without a device, through gpu_main.cu): two ranks' caches over one shared registered host
// pool, each rank's step (reference/rank_step.cuh: global -> local ids, prepare, the reference
// NVFP4 consumer) and the same-device reduction (parallel/all_reduce.cuh):
//  * expert parallel: equal bit for bit to one cache over every expert whose consumer runs the
//    two ranks' partials (ids masked to each rank's experts) and sums them in rank order, and
//    within fp32 rounding of the unsplit single-consumer output;
//  * tensor-slice (TP = 2, N = 256 -> 128-column slices): equal bit for bit to the two slices
//    all-resident on one device reduced in rank order, and within rounding of the full layer;
//  * per-rank hit rates reported, evictions happen.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "expert_cache/cuda.hpp"
#include "expert_cache/parallel/all_reduce.cuh"
#include "expert_cache/parallel/expert_placement.hpp"
#include "expert_cache/parallel/shared_host_pool.hpp"
#include "expert_cache/parallel/tp_slice.hpp"
#include "expert_cache/reference/moe_consumer.cuh"
#include "expert_cache/reference/nvfp4_reference.hpp"
#include "expert_cache/reference/rank_step.cuh"
#include "support/cuda_support.hpp"

using namespace expert_cache;

namespace {

template <class T>
using DevArray = test_support::DeviceBuffer<T>;
using Ids = std::vector<std::int32_t>;
using Cache = RowCache<CudaRuntime, Nvfp4Marlin>;

constexpr std::int64_t kHidden = 256, kInter = 256, kExperts = 16;
constexpr int kTokens = 2, kTopK = 2, kRanks = 2;  // <= 4 unique experts per forward: fits every capacity

// One layer in the Marlin layout, as six host byte arrays [E][bytes_t].
struct MarlinBytes {
  Nvfp4Marlin layout;
  std::vector<std::vector<unsigned char>> t;  // per tensor
  [[nodiscard]] const unsigned char* expert(std::size_t tensor, std::int64_t e) const {
    return t[tensor].data() + static_cast<std::size_t>(e) * layout.tensors()[tensor].bytes_per_expert;
  }
};

MarlinBytes marlin_bytes(const Nvfp4Marlin& layout, std::int64_t experts) {
  MarlinBytes m{layout, {}};
  for (std::size_t i = 0; i < 6; ++i) m.t.emplace_back(static_cast<std::size_t>(experts) * layout.tensors()[i].bytes_per_expert);
  return m;
}
Nvfp4MarlinLayer as_layer(MarlinBytes& m) {
  auto span32 = [](std::vector<unsigned char>& v) { return std::span<std::uint32_t>(reinterpret_cast<std::uint32_t*>(v.data()), v.size() / 4); };
  auto spanf = [](std::vector<unsigned char>& v) { return std::span<float>(reinterpret_cast<float*>(v.data()), v.size() / 4); };
  return {span32(m.t[0]), span32(m.t[1]), m.t[2], m.t[3], spanf(m.t[4]), spanf(m.t[5])};
}

struct Checkpoint {
  std::vector<std::uint8_t> w13, w2, s13, s2;
  std::vector<float> g13, g2;
  Nvfp4CheckpointLayer layer;
};

Checkpoint make_checkpoint(const Nvfp4Marlin& lay, std::uint64_t seed) {
  Checkpoint c;
  std::mt19937_64 rng(seed);
  auto bytes = [&](std::int64_t n, int lo, int hi) {
    std::vector<std::uint8_t> v(static_cast<std::size_t>(n));
    std::uniform_int_distribution<int> d(lo, hi);
    for (auto& b : v) b = static_cast<std::uint8_t>(d(rng));
    return v;
  };
  c.w13 = bytes(kExperts * lay.ckpt_w13_bytes(), 0, 255);
  c.w2 = bytes(kExperts * lay.ckpt_w2_bytes(), 0, 255);
  c.s13 = bytes(kExperts * lay.ckpt_w13_scale_bytes(), 0x30, 0x58);
  c.s2 = bytes(kExperts * lay.ckpt_w2_scale_bytes(), 0x30, 0x58);
  std::uniform_real_distribution<float> g(0.01f, 0.03f);
  for (std::int64_t e = 0; e < kExperts; ++e) {
    const float a = g(rng);
    c.g13.push_back(a);
    c.g13.push_back(a);
    c.g2.push_back(g(rng));
  }
  c.layer = Nvfp4CheckpointLayer{kExperts, c.w13, c.s13, c.g13, c.w2, c.s2, c.g2};
  return c;
}

// A layer all-resident on the device, slot = expert (identity map): the 1-GPU reference.
struct Resident {
  std::vector<std::unique_ptr<DevArray<unsigned char>>> t;
  std::unique_ptr<DevArray<std::int32_t>> map;
  device::MoeWeights w;
  explicit Resident(const MarlinBytes& m) {
    Ids ident(static_cast<std::size_t>(kExperts));
    for (std::size_t e = 0; e < ident.size(); ++e) ident[e] = static_cast<std::int32_t>(e);
    map = std::make_unique<DevArray<std::int32_t>>(ident);
    for (std::size_t i = 0; i < num_expert_tensors; ++i) {
      const std::size_t b = m.layout.tensors()[i].bytes_per_expert;
      if (b == 0) continue;
      t.push_back(std::make_unique<DevArray<unsigned char>>(m.t[i]));
      w.base[i] = t.back()->get();
      w.stride[i] = b;
    }
    w.expert_map = map->get();
    w.num_experts = static_cast<std::int32_t>(kExperts);
  }
};

std::vector<float> random_x(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(kTokens * kHidden));
  for (auto& v : x) v = d(rng);
  return x;
}

Ids random_ids(std::mt19937_64& rng) {
  Ids ids;
  for (int t = 0; t < kTokens; ++t) {
    while (static_cast<int>(ids.size()) < (t + 1) * kTopK) {
      const auto e = static_cast<std::int32_t>(std::min(rng() % kExperts, rng() % kExperts));  // skewed
      if (std::find(ids.begin() + t * kTopK, ids.end(), e) == ids.end()) ids.push_back(e);
    }
  }
  return ids;
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0, d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, static_cast<double>(std::fabs(b[i])));
    d = std::max(d, static_cast<double>(std::fabs(a[i] - b[i])));
  }
  return m == 0 ? d : d / m;
}

struct RankRig {
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
  std::unique_ptr<Cache> cache;
  std::unique_ptr<device::RankStep<Cache>> step;
  std::unique_ptr<DevArray<float>> partial;
};

// The two ranks side by side: caches over the shared pool, a step each, same-device reduction.
void run_ranks(Sharding sharding) {
  const std::string mode = sharding == Sharding::tensor_slice ? "tensor-slice" : "expert parallel";
  INFO(mode);
  const Nvfp4Marlin full{kHidden, kInter, ActDtype::bf16};
  const Checkpoint ck = make_checkpoint(full, 41);
  MarlinBytes full_m = marlin_bytes(full, kExperts);
  REQUIRE(repack_layer_reference(full, ck.layer, as_layer(full_m)).ok());

  PlacementConfig pc;
  pc.num_global = static_cast<std::int32_t>(kExperts);
  pc.world_size = kRanks;
  pc.sharding = sharding;
  if (sharding == Sharding::expert_parallel) pc.ranges = contiguous_ranges(pc.num_global, kRanks);
  auto placement_r = ExpertPlacement::make(pc);
  REQUIRE(placement_r.ok());
  const ExpertPlacement placement = placement_r.value();
  const Nvfp4Marlin rank_layout = sharding == Sharding::expert_parallel ? full : tp_slice_layout(full, kRanks).value();
  std::vector<MarlinBytes> slices;
  if (sharding == Sharding::tensor_slice)
    for (int r = 0; r < kRanks; ++r) {
      slices.push_back(marlin_bytes(rank_layout, kExperts));
      REQUIRE(repack_tp_slice_reference(full, ck.layer, kRanks, r, as_layer(slices.back())).ok());
    }

  CudaRuntime rt;
  SharedHostPool<CudaRuntime> pool(rt, placement, rank_layout.tensors());
  for (std::size_t t = 0; t < 6; ++t)
    for (std::int32_t e = 0; e < kExperts; ++e)
      for (int r = 0; r < (sharding == Sharding::tensor_slice ? kRanks : 1); ++r)
        std::memcpy(pool.expert(t, r, e), sharding == Sharding::tensor_slice ? slices[static_cast<std::size_t>(r)].expert(t, e) : full_m.expert(t, e),
                    rank_layout.tensors()[t].bytes_per_expert);

  // Same slot memory per rank: expert parallel 5 whole experts, tensor-slice 10 half experts.
  const std::int32_t capacity = sharding == Sharding::expert_parallel ? 5 : 10;
  std::vector<RankRig> ranks(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    RankRig& k = ranks[static_cast<std::size_t>(r)];
    REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
    REQUIRE_CUDA_OK(cudaEventCreateWithFlags(&k.done, cudaEventDisableTiming));
    CacheOptions o;
    o.num_experts = placement.num_local(r);
    o.capacity = capacity;
    o.top_k = kTopK;
    o.memory = pool.rank_memory(r);
    k.cache = std::make_unique<Cache>(rt, o, rank_layout);
    k.step = std::make_unique<device::RankStep<Cache>>(placement, r, *k.cache, kTokens, kTopK);
    k.partial = std::make_unique<DevArray<float>>(static_cast<std::size_t>(kTokens * kHidden));
  }

  // 1-GPU references: all-resident layers (the full one and, for TP, each slice).
  const Resident res_full(full_m);
  std::vector<std::unique_ptr<Resident>> res_slices;
  for (const MarlinBytes& s : slices) res_slices.push_back(std::make_unique<Resident>(s));
  device::MoeConsumer moe_full(full, kTokens, kTopK);
  device::MoeConsumer moe_slice(rank_layout, kTokens, kTopK);
  cudaStream_t main;
  REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&main, cudaStreamNonBlocking));

  const std::vector<float> x = random_x(7);
  const std::vector<float> w{0.6f, 0.4f, 0.5f, 0.5f};
  const std::size_t out_n = static_cast<std::size_t>(kTokens * kHidden);
  DevArray<float> d_x(x), d_w(w), d_ids(static_cast<std::size_t>(kTokens * kTopK)), out(out_n), ref(out_n), unsplit(out_n);
  DevArray<std::int32_t> d_gids(static_cast<std::size_t>(kTokens * kTopK)), d_masked(static_cast<std::size_t>(kTokens * kTopK));
  std::vector<std::unique_ptr<DevArray<float>>> ref_part;
  for (int r = 0; r < kRanks; ++r) ref_part.push_back(std::make_unique<DevArray<float>>(out_n));

  std::mt19937_64 rng(11);
  for (int s = 0; s < 40; ++s) {
    CAPTURE(s);
    const Ids ids = random_ids(rng);
    d_gids.upload(ids);
    // The ranks.
    std::vector<const float*> parts;
    for (RankRig& k : ranks) {
      auto view = k.step->run(ids, d_gids.get(), d_w.get(), d_x.get(), k.partial->get(), kTokens, k.stream);
      REQUIRE_MESSAGE(view.ok(), std::string(view.status().message()));
      REQUIRE_CUDA_OK(cudaEventRecord(k.done, k.stream));
      REQUIRE_CUDA_OK(cudaStreamWaitEvent(main, k.done, 0));
      parts.push_back(k.partial->get());
    }
    REQUIRE(device::SameDeviceAllReduce::run(parts, out.get(), out_n, main).ok());
    // The 1-GPU reference with the same per-rank partials and the same rank order.
    std::vector<const float*> rparts;
    for (int r = 0; r < kRanks; ++r) {
      if (sharding == Sharding::expert_parallel) {
        Ids masked = ids;
        for (auto& e : masked)
          if (e >= 0 && placement.owner_of(e) != r) e = -1;
        d_masked.upload(masked);
        REQUIRE(moe_full.run(res_full.w, d_masked.get(), d_w.get(), d_x.get(), ref_part[static_cast<std::size_t>(r)]->get(), kTokens, main).ok());
        REQUIRE_CUDA_OK(cudaStreamSynchronize(main));  // d_masked is reused
      } else {
        REQUIRE(moe_slice.run(res_slices[static_cast<std::size_t>(r)]->w, d_gids.get(), d_w.get(), d_x.get(),
                              ref_part[static_cast<std::size_t>(r)]->get(), kTokens, main).ok());
      }
      rparts.push_back(ref_part[static_cast<std::size_t>(r)]->get());
    }
    REQUIRE(device::SameDeviceAllReduce::run(rparts, ref.get(), out_n, main).ok());
    REQUIRE(moe_full.run(res_full.w, d_gids.get(), d_w.get(), d_x.get(), unsplit.get(), kTokens, main).ok());
    REQUIRE_CUDA_OK(cudaStreamSynchronize(main));
    const auto a = out.download(), b = ref.download(), c = unsplit.download();
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    CHECK(max_rel_diff(a, c) < 1e-4);  // the unsplit layer: the same sums in another order
  }
  std::uint64_t evictions = 0;
  for (int r = 0; r < kRanks; ++r) {
    const CacheStats st = ranks[static_cast<std::size_t>(r)].cache->stats();
    MESSAGE("rank " << r << ": hit rate " << st.hit_rate() << " (" << st.hits << "/" << st.hits + st.misses << "), "
                    << st.evictions << " evictions");
    evictions += st.evictions;
    CHECK(st.hits + st.misses > 0);
  }
  CHECK(evictions > 0);  // the caches were too small for the trace
  for (RankRig& k : ranks) {
    REQUIRE_CUDA_OK(cudaStreamSynchronize(k.stream));
    k.step.reset();
    k.cache.reset();  // before the pool (it unregisters the host memory)
    REQUIRE_CUDA_OK(cudaStreamDestroy(k.stream));
    REQUIRE_CUDA_OK(cudaEventDestroy(k.done));
  }
  REQUIRE_CUDA_OK(cudaStreamDestroy(main));
}

}  // namespace

TEST_CASE("parallel on one device: two expert-parallel ranks over one shared pool equal the 1-GPU run") {
  run_ranks(Sharding::expert_parallel);
}

TEST_CASE("parallel on one device: two tensor-slice ranks over one shared pool equal the 1-GPU run") {
  run_ranks(Sharding::tensor_slice);
}

TEST_CASE("parallel on one device: a rank step refuses a bad id before its cache changes") {
  const Nvfp4Marlin full{kHidden, kInter, ActDtype::bf16};
  PlacementConfig pc;
  pc.num_global = static_cast<std::int32_t>(kExperts);
  pc.world_size = kRanks;
  pc.ranges = contiguous_ranges(pc.num_global, kRanks);
  const ExpertPlacement placement = ExpertPlacement::make(pc).value();
  CudaRuntime rt;
  SharedHostPool<CudaRuntime> pool(rt, placement, full.tensors());
  CacheOptions o;
  o.num_experts = 8;
  o.capacity = 4;
  o.top_k = kTopK;
  o.memory = pool.rank_memory(1);
  Cache cache(rt, o, full);
  device::RankStep<Cache> step(placement, 1, cache, kTokens, kTopK);
  CacheOptions wrong = o;
  wrong.num_experts = 16;
  wrong.capacity = 4;
  wrong.memory = StorageMemory{};
  Cache wrong_cache(rt, wrong, full);
  CHECK_THROWS_AS(device::RankStep<Cache>(placement, 1, wrong_cache, kTokens, kTopK), Error);  // mismatched config
  DevArray<float> d_x(static_cast<std::size_t>(kTokens * kHidden)), d_w(static_cast<std::size_t>(kTokens * kTopK)),
      part(static_cast<std::size_t>(kTokens * kHidden));
  DevArray<std::int32_t> d_ids(static_cast<std::size_t>(kTokens * kTopK));
  const Ids bad{1, 16, 3, 4};
  auto r = step.run(bad, d_ids.get(), d_w.get(), d_x.get(), part.get(), kTokens, cudaStreamLegacy);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == ErrorCode::expert_out_of_range);
  CHECK(cache.stats().prepare_calls == 0);
  CHECK(cache.stats().misses == 0);
}
