// The reference NVFP4 MoE consumer (reference/moe_consumer.cuh), suite 'gpu' (exits 77 without a
// device, through gpu_main.cu):
//  * its fast decodes equal the layout's reference decodes, its nibble map equals
//    marlin::weight_source;
//  * on a repacked random checkpoint (intermediate 80: shard padding exercised) it matches a
//    double-precision host MoE built from dequant_marlin_reference;
//  * through CudaRuntime caches (row and whole-expert, every staging policy run here) its output
//    is bit-identical to the all-resident run, step after step with evictions;
//  * through an OVERLAPPED DeviceExpertCache (per-slot ready words, docs/design.md edge D4) with a
//    deliberately slowed fill: bit-identical to the non-overlapped cache and to the all-resident
//    run, eagerly and in a captured graph replayed with new ids; and, in a captured graph (where
//    the consumer overlaps the fill: eagerly the ready-event record of prepare serialises them),
//    with the test-only "skip the wait" kernels the consumer reads the slot's previous expert
//    (the wait is what orders it);
//  * edge D4b (moe_w2 waits per pair for moe_w13's activations, not for all of moe_w13): with the
//    same slowed fill (the missing expert's W2 equal to the evicted one's, so only activations can
//    be stale), bit-identical to the non-overlapped cache; in a captured graph, moe_w2 without
//    that wait reads the previous run's activations of the slowed pair (a run that does not
//    differ prints INCONCLUSIVE and fails: PDL did not overlap the kernels);
//  * at batch 1 on the default benchmark expert shape it reports its weight-read bandwidth against the HBM
//    copy (a message, no assertion: the speed target is a benchmark number, docs/benchmarks.md).
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "expert_cache/cuda.hpp"
#include "expert_cache/device_cache/cuda_executor.cuh"
#include "expert_cache/reference/moe_consumer.cuh"
#include "expert_cache/reference/nvfp4_reference.hpp"
#include "support/cuda_support.hpp"
#include "support/marlin_layer.cuh"

using namespace expert_cache;

namespace {

template <class T>
using DevArray = test_support::DeviceBuffer<T>;

using test_support::Layer;
using test_support::make_layer;
using test_support::max_abs;
using test_support::random_x;
using test_support::ResidentLayer;

// out[m][n] in double, from the dequantised weights.
// `map` (expert -> slot or -1, empty: all present): experts absent from it contribute 0.
std::vector<double> reference_moe(const Layer& L, const std::vector<float>& x, const std::vector<std::int32_t>& ids,
                                  const std::vector<float>& w, int tokens, int top_k,
                                  const std::vector<std::int32_t>& map = {}) {
  const std::int64_t K = L.layout.hidden, N = L.layout.intermediate;
  std::vector<double> out(static_cast<std::size_t>(tokens * K), 0.0);
  std::vector<double> c1(static_cast<std::size_t>(2 * N)), act(static_cast<std::size_t>(N));
  for (int m = 0; m < tokens; ++m)
    for (int j = 0; j < top_k; ++j) {
      const std::int32_t e = ids[static_cast<std::size_t>(m * top_k + j)];
      if (e < 0 || e >= L.experts) continue;
      if (!map.empty() && map[static_cast<std::size_t>(e)] < 0) continue;
      for (std::int64_t r = 0; r < 2 * N; ++r) {
        double s = 0;
        for (std::int64_t k = 0; k < K; ++k)
          s += L.dq13[static_cast<std::size_t>((e * 2 * N + r) * K + k)] * x[static_cast<std::size_t>(m * K + k)];
        c1[static_cast<std::size_t>(r)] = s;
      }
      for (std::int64_t i = 0; i < N; ++i) {
        const double gate = c1[static_cast<std::size_t>(i)];
        act[static_cast<std::size_t>(i)] = gate / (1.0 + std::exp(-gate)) * c1[static_cast<std::size_t>(N + i)];
      }
      for (std::int64_t n = 0; n < K; ++n) {
        double s = 0;
        for (std::int64_t i = 0; i < N; ++i) s += L.dq2[static_cast<std::size_t>((e * K + n) * N + i)] * act[static_cast<std::size_t>(i)];
        out[static_cast<std::size_t>(m * K + n)] += static_cast<double>(w[static_cast<std::size_t>(m * top_k + j)]) * s;
      }
    }
  return out;
}


}  // namespace

namespace {

float bf16_value(std::uint32_t bits16) {
  const std::uint32_t bits = bits16 << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// e2m1_pair_bf16<I>: nibbles I and I + 4 of any word -> bf16 halves e2m1 * 2^-126, neighbours ignored.
template <int I>
void check_e2m1_pair() {
  CAPTURE(I);
  for (std::uint32_t lo = 0; lo < 16; ++lo)
    for (std::uint32_t hi = 0; hi < 16; ++hi) {
      const std::uint32_t word = (0x9ABCDEF1u & ~((15u << (4 * I)) | (15u << (4 * I + 16)))) | (lo << (4 * I)) | (hi << (4 * I + 16));
      const std::uint32_t pair = device::moe_detail::e2m1_pair_bf16<I>(word);
      CHECK(bf16_value(pair & 0xFFFFu) == marlin::e2m1_value(lo) * 0x1p-126f);
      CHECK(bf16_value(pair >> 16) == marlin::e2m1_value(hi) * 0x1p-126f);
    }
}

}  // namespace

TEST_CASE("moe consumer: fast decodes, the nibble map and the MMA fragment maps equal the layout's reference") {
  for (std::uint32_t c = 0; c < 16; ++c) CHECK(device::e2m1_decode(c) == marlin::e2m1_value(c));
  check_e2m1_pair<0>();
  check_e2m1_pair<1>();
  check_e2m1_pair<2>();
  check_e2m1_pair<3>();
  for (std::uint32_t b = 0; b < 256; ++b) CHECK(device::s0e5m3_decode(b) == marlin::s0e5m3_value(static_cast<std::uint8_t>(b)));
  // Scale bytes as bf16 pairs: byte b at position scale_byte(w, h) of a lane's eight bytes is the
  // scale of column 16w + 8h + g (marlin::scale_dest_col), decoded exactly as s0e5m3 * 2^-112.
  for (int nt = 0; nt < 3; ++nt)
    for (int g = 0; g < 8; ++g)
      for (int w = 0; w < 4; ++w)
        for (int h = 0; h < 2; ++h)
          CHECK(marlin::scale_dest_col(64 * nt + 16 * w + 8 * h + g) == 64 * nt + 8 * g + device::moe_detail::scale_byte(w, h));
  for (std::uint32_t b = 0; b < 256; ++b)
    for (int w = 0; w < 4; ++w)
      for (int h = 0; h < 2; ++h) {
        unsigned char bytes[8] = {0x5A, 0xA5, 0xFF, 0x01, 0x80, 0x7F, 0x3C, 0xC3};
        bytes[device::moe_detail::scale_byte(w, h)] = static_cast<unsigned char>(b);
        std::uint32_t lo, hi;
        std::memcpy(&lo, bytes, 4);
        std::memcpy(&hi, bytes + 4, 4);
        const std::uint32_t pair = device::moe_detail::s0e5m3_pair_bf16(lo, hi, w);
        CHECK(bf16_value(h == 0 ? pair & 0xFFFFu : pair >> 16) == marlin::s0e5m3_value(static_cast<std::uint8_t>(b)) * 0x1p-112f);
      }
  // A fragment order: element kk of a K-row sits at lane t = index / 4, slot e = index % 4 with
  // k = 2t + (e & 1) + (e & 2 ? 8 : 0) (MMA registers a0a1, a4a5).
  for (int kk = 0; kk < 16; ++kk) {
    const int idx = device::moe_detail::a_frag_index(kk);
    const int t = idx / 4, e = idx % 4;
    CHECK(2 * t + (e & 1) + ((e & 2) ? 8 : 0) == kk);
  }
  for (int lane = 0; lane < 32; ++lane)
    for (int w = 0; w < 4; ++w)
      for (int i = 0; i < 8; ++i) {
        const marlin::CodeCoord cc = marlin::weight_source(3, 128 * 2 + 4 * lane + w, i);
        const std::int64_t dk = ((i & 4) ? 1 : 0) + ((i & 1) ? 8 : 0), dn = (i & 2) ? 8 : 0;
        CHECK(cc.k == 16 * 3 + 2 * (lane % 4) + dk);
        CHECK(cc.n == 64 * 2 + 16 * w + lane / 4 + dn);
      }
}

namespace {

// Runs the consumer on `res` and compares with the double host MoE (absent experts per `map`):
// max |gpu - host| / max|host| must stay below 2e-4. A second run must be bit-identical.
void check_against_host(const Layer& L, const ResidentLayer& res, const std::vector<std::int32_t>& map,
                        const std::vector<std::int32_t>& ids, int tokens, int top_k, int max_tokens, std::uint64_t seed) {
  CAPTURE(L.layout.hidden);
  CAPTURE(L.layout.intermediate);
  CAPTURE(tokens);
  CAPTURE(top_k);
  const std::int64_t hidden = L.layout.hidden;
  REQUIRE(ids.size() == static_cast<std::size_t>(tokens * top_k));
  std::vector<float> w(ids.size());
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.1f + 0.05f * static_cast<float>(i % 5);
  const std::vector<float> x = random_x(tokens, hidden, seed);
  const std::vector<double> want = reference_moe(L, x, ids, w, tokens, top_k, map);

  DevArray<std::int32_t> d_ids(ids);
  DevArray<float> d_w(w), d_x(x), d_out(static_cast<std::size_t>(tokens * hidden));
  device::MoeConsumer moe(L.layout, max_tokens, top_k);
  REQUIRE(moe.run(res.weights, d_ids.get(), d_w.get(), d_x.get(), d_out.get(), tokens, nullptr).ok());
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = d_out.download();
  const double scale = max_abs(want);
  REQUIRE(scale > 0);
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    REQUIRE(std::isfinite(got[i]));
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]) / scale);
  }
  INFO("max |gpu - host| / max|host| = " << worst << ", max|host| = " << scale);
  CHECK(worst < 2e-4);
  // Tokens whose every pair is absent get exact zeros.
  for (int m = 0; m < tokens; ++m) {
    bool any = false;
    for (int j = 0; j < top_k; ++j) {
      const std::int32_t e = ids[static_cast<std::size_t>(m * top_k + j)];
      any = any || (e >= 0 && e < L.experts && (map.empty() || map[static_cast<std::size_t>(e)] >= 0));
    }
    if (!any)
      for (std::int64_t n = 0; n < hidden; ++n) CHECK(got[static_cast<std::size_t>(m * hidden + n)] == 0.0f);
  }
  // Deterministic: the same run again (the counters reset themselves) gives the same bits.
  REQUIRE(moe.run(res.weights, d_ids.get(), d_w.get(), d_x.get(), d_out.get(), tokens, nullptr).ok());
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> again = d_out.download();
  CHECK(std::memcmp(got.data(), again.data(), got.size() * sizeof(float)) == 0);
}

}  // namespace

TEST_CASE("moe consumer: matches the double host MoE on a repacked checkpoint (shard padding)") {
  for (const auto& [hidden, inter] : {std::pair<std::int64_t, std::int64_t>{256, 80}, {192, 64}, {192, 96}}) {
    const Layer L = make_layer(hidden, inter, 8, 11 + static_cast<std::uint64_t>(hidden + inter));
    const ResidentLayer res(L);
    const std::vector<std::int32_t> ids{0, 5, 7, 2, 3, -1, 5, 1, 6, 4, 0, 7};  // -1: a padded pair
    check_against_host(L, res, {}, ids, 3, 4, 16, 5);
  }
}

TEST_CASE("moe consumer: several K splits in both GEMMs (last-block reductions)") {
  // K = 1024: 64 K-rows = 4 moe_w13 splits; Np = 576: 36 K-rows = 2 moe_w2 splits.
  const Layer L = make_layer(1024, 576, 6, 31);
  const ResidentLayer res(L);
  check_against_host(L, res, {}, {4, 1, 5, 2, -1, 0}, 2, 3, 2, 7);
}

TEST_CASE("moe consumer: the benchmark's shape (K 2048, N 512, top-10, batch 1)") {
  // 8 moe_w13 splits per (pair, tile pair), 10 arrivals per moe_w2 (token, tile).
  const Layer L = make_layer(2048, 512, 12, 61);
  const ResidentLayer res(L);
  check_against_host(L, res, {}, {3, 9, 0, 11, 5, 7, 1, 10, 4, 8}, 1, 10, 1, 17);
}

TEST_CASE("moe consumer: batch 16, and fewer tokens than the workspace holds") {
  const Layer L = make_layer(256, 96, 8, 41);  // Np = 128: 32 rows of shard padding
  const ResidentLayer res(L);
  std::vector<std::int32_t> ids(32);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 5 + i / 7) % 8);
  ids[9] = -1;
  check_against_host(L, res, {}, ids, 16, 2, 16, 9);
  check_against_host(L, res, {}, std::vector<std::int32_t>(ids.begin(), ids.begin() + 10), 5, 2, 16, 10);
}

TEST_CASE("moe consumer: experts absent from the map, ids out of range, permuted slots") {
  // 8 experts in 10 slots: expert e in slot (7 e + 3) % 10, experts 2 and 6 absent (their slots
  // and the two spare ones hold garbage). Ids 8 and 12 are out of range, -1 is a padded pair.
  const Layer L = make_layer(192, 96, 8, 51);  // K % 128 != 0: Np = 128
  std::vector<std::int32_t> map(8);
  for (std::size_t e = 0; e < map.size(); ++e) map[e] = static_cast<std::int32_t>((7 * e + 3) % 10);
  map[2] = map[6] = -1;
  const ResidentLayer res(L, map, 10);
  // Token 2 has only absent / invalid pairs: its output must be exactly zero.
  const std::vector<std::int32_t> ids{0, 2, 5, 7, 6, 1, 2, 8, -1, 3, 12, 4, 6, 6, 0};
  check_against_host(L, res, map, ids, 5, 3, 8, 13);
}

namespace {

template <class Cache>
void cached_equals_resident(const char* what) {
  INFO(what);
  const Layer L = make_layer(256, 128, 16, 21);
  ResidentLayer res(L);
  CudaRuntime rt;
  CacheOptions o;
  o.num_experts = 16;
  o.capacity = 8;
  o.top_k = 4;
  o.log = {};
  Cache cache(rt, o, L.layout);
  const ExpertTensorBytes b = L.layout.tensors();
  for (std::int32_t e = 0; e < 16; ++e)
    for (std::size_t t = 0; t < num_expert_tensors; ++t)
      if (b[t].bytes_per_expert != 0) std::memcpy(cache.storage().host_tensor(t, e), L.tensor(t, e), b[t].bytes_per_expert);
  cudaStream_t stream;
  REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int tokens = 2, top_k = 4;
  device::MoeConsumer moe(L.layout, tokens, top_k);
  const std::vector<float> x = random_x(tokens, 256, 9);
  std::vector<float> w{0.4f, 0.3f, 0.2f, 0.1f, 0.25f, 0.25f, 0.25f, 0.25f};
  DevArray<float> d_x(x), d_w(w), out_c(static_cast<std::size_t>(tokens * 256)), out_r(static_cast<std::size_t>(tokens * 256));
  DevArray<std::int32_t> d_ids(8);
  std::mt19937_64 rng(3);
  std::uint64_t misses = 0;
  for (int step = 0; step < 24; ++step) {
    std::vector<std::int32_t> ids(8);
    for (auto& id : ids) id = static_cast<std::int32_t>(rng() % 16);
    if (step % 5 == 4) ids[3] = -1;
    // The union of a step fits the 8 slots; duplicates are fine.
    d_ids.upload(ids);
    auto view = cache.prepare(ids, stream);
    REQUIRE(view.ok());
    misses += view.value().misses;
    REQUIRE(moe.run(device::moe_weights_from_view(view.value(), 16), d_ids.get(), d_w.get(), d_x.get(), out_c.get(), tokens, stream).ok());
    REQUIRE(moe.run(res.weights, d_ids.get(), d_w.get(), d_x.get(), out_r.get(), tokens, stream).ok());
    REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<float> a = out_c.download(), r = out_r.download();
    CAPTURE(step);
    CHECK(std::memcmp(a.data(), r.data(), a.size() * sizeof(float)) == 0);
  }
  CHECK(misses > 8);  // evictions happened
  REQUIRE_CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace

TEST_CASE("moe consumer: cached runs are bit-identical to the all-resident run") {
  cached_equals_resident<ExpertCache<TensorMajorStorage, Lru, CopyStream, Nvfp4Marlin, CudaRuntime>>("row/copy_stream");
  cached_equals_resident<ExpertCache<ExpertMajorStorage, Lfru, CopyStream, Nvfp4Marlin, CudaRuntime>>("cached/copy_stream");
  cached_equals_resident<ExpertCache<ExpertMajorStorage, Lfru, Inline, Nvfp4Marlin, CudaRuntime>>("cached/inline");
  cached_equals_resident<ExpertCache<TensorMajorStorage, Lru, Batched, Nvfp4Marlin, CudaRuntime>>("row/batched");
  cached_equals_resident<ExpertCache<TensorMajorStorage, Lru, Gather, Nvfp4Marlin, CudaRuntime>>("row/gather");
  cached_equals_resident<ExpertCache<ExpertMajorStorage, Lfru, Gather, Nvfp4Marlin, CudaRuntime>>("cached/gather");
}

namespace {

using DevCache = DeviceExpertCache<TensorMajorStorage, Nvfp4Marlin, CudaRuntime>;

// A device-planned cache of `L` (C = `capacity` slots, up to `max_ids` ids; 4 and 4 by default), its host pools filled.
// Parts (edge D4c): `first_regions` copied and published first, the delay on part `delay_part`,
// `early`: the first part's ready word stored before its bytes (test kernel).
struct FillParts {
  std::uint32_t first_regions = 0;
  std::int32_t delay_part = 0;
  bool early = false;
};
std::unique_ptr<DevCache> make_device_cache(CudaRuntime& rt, const Layer& L, bool overlap, std::uint32_t delay_ns,
                                            FillParts parts = {}, std::int32_t capacity = 4, std::int32_t max_ids = 4,
                                            bool fill_by_consumer = false, FillEngine engine = FillEngine::sm_loads) {
  DeviceCacheOptions o;
  o.fill_by_consumer = fill_by_consumer;
  o.num_experts = static_cast<std::int32_t>(L.experts);
  o.capacity = capacity;
  o.max_ids = max_ids;
  o.overlap = overlap;
  o.test_fill_delay_ns = delay_ns;
  o.fill_engine = engine;  // the delay knob is the fill kernel's (sm_loads)
  o.test_fill_delay_index = 0;
  o.ready_first_regions = parts.first_regions;
  o.test_fill_delay_part = parts.delay_part;
  o.test_publish_first_early = parts.early;
  auto cache = std::make_unique<DevCache>(rt, o, L.layout);
  const ExpertTensorBytes b = L.layout.tensors();
  for (std::int64_t e = 0; e < L.experts; ++e)
    for (std::size_t t = 0; t < num_expert_tensors; ++t)
      if (b[t].bytes_per_expert != 0)
        std::memcpy(cache->storage().host_tensor(t, static_cast<std::int32_t>(e)), L.tensor(t, e), b[t].bytes_per_expert);
  return cache;
}

// Which readiness kernels a step's consumer runs (MoeConsumer::run's test knobs): every wait,
// without the slot waits (test_skip_wait), or moe_w2 without any wait before it reads the
// activations (test_skip_act_wait; moe_w13 still waits for its slots).
enum class Waits { all, skip_slot_wait, skip_act_wait };

Status run_consumer(DevCache& cache, const device::MoeConsumer& moe, const ForwardView& view, const DevArray<float>& d_w,
                    const DevArray<float>& d_x, DevArray<float>& d_out, cudaStream_t stream, Waits waits) {
  return moe.run(device::moe_weights_from_view(view, 16), cache.sanitized_ids_device(), d_w.get(), d_x.get(), d_out.get(), 1,
                 stream, cache.readiness(), waits == Waits::skip_slot_wait, waits == Waits::skip_act_wait);
}

// One forward of 1 token x 4 experts through `cache` on `stream`: ids uploaded, prepare, consumer
// (with the cache's readiness when it overlaps); returns the output.
std::vector<float> device_step(DevCache& cache, const device::MoeConsumer& moe, const std::vector<std::int32_t>& ids,
                               DevArray<std::int32_t>& d_ids, const DevArray<float>& d_w, const DevArray<float>& d_x,
                               DevArray<float>& d_out, cudaStream_t stream, Waits waits = Waits::all) {
  REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
  d_ids.upload(ids);
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());  // the pageable upload's DMA too (legacy stream)
  auto view = cache.prepare(d_ids.get(), static_cast<std::int32_t>(ids.size()), stream);
  REQUIRE_MESSAGE(view.ok(), std::string(view.status().message()));
  REQUIRE(run_consumer(cache, moe, view.value(), d_w, d_x, d_out, stream, waits).ok());
  REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
  return d_out.download();
}

// The same forward as one CUDA graph, as the product runs it (expert-cache-bench, decode loops):
// prepare + consumer captured on `stream` (non-blocking), instantiated, launched once; returns
// the output. Inside the capture the cache's `ready` event record adds no node, so the consumer's
// first kernel gets a programmatic edge from the overlapped fill and may run while it copies.
std::vector<float> graph_step(DevCache& cache, const device::MoeConsumer& moe, const std::vector<std::int32_t>& ids,
                              DevArray<std::int32_t>& d_ids, const DevArray<float>& d_w, const DevArray<float>& d_x,
                              DevArray<float>& d_out, cudaStream_t stream, Waits waits = Waits::all) {
  REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
  d_ids.upload(ids);
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  REQUIRE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  auto view = cache.prepare(d_ids.get(), static_cast<std::int32_t>(ids.size()), stream);
  const bool ran = view.ok() && run_consumer(cache, moe, view.value(), d_w, d_x, d_out, stream, waits).ok();
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);  // always end it, even after a failure
  REQUIRE_MESSAGE(view.ok(), std::string(view.status().message()));
  REQUIRE(ran);
  REQUIRE_CUDA_OK(ended);
  REQUIRE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  REQUIRE_CUDA_OK(cudaGraphLaunch(exec, stream));
  REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
  REQUIRE_CUDA_OK(cudaGraphExecDestroy(exec));
  REQUIRE_CUDA_OK(cudaGraphDestroy(graph));
  return d_out.download();
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The setup of the slowed-fill cases (edge D4): 1 token x 4 experts, a device cache of 4 slots.
// Step A fills slots 0-3 with experts 0-3; step B hits 0, 1, 2 and evicts 3: expert 9 lands in
// slot 3, whose old bytes (expert 3) are what a consumer that did not wait would read. Every
// fill block of an overlapped cache waits 500 us before copying fill 0 (expert 9), far longer
// than the consumer runs. The constructor computes the all-resident outputs of A and B and step
// B through a non-overlapped cache (plain_b, the reference of every overlapped run).
struct SlowedFill {
  static constexpr std::uint32_t delay_ns = 500'000;
  const Layer& L;
  ResidentLayer res;
  CudaRuntime rt;
  cudaStream_t stream = nullptr;
  device::MoeConsumer moe;
  DevArray<float> d_x, d_w, d_out, d_ref;
  DevArray<std::int32_t> d_ids, d_ids_ref;
  const std::vector<std::int32_t> a{0, 1, 2, 3}, b{0, 1, 2, 9};
  std::vector<float> ref_a, ref_b, plain_b;

  explicit SlowedFill(const Layer& layer)
      : L(layer), res(layer), moe(layer.layout, 1, 4), d_x(random_x(1, layer.layout.hidden, 3)),
        d_w(std::vector<float>{0.4f, 0.3f, 0.2f, 0.1f}), d_out(static_cast<std::size_t>(layer.layout.hidden)),
        d_ref(static_cast<std::size_t>(layer.layout.hidden)), d_ids(4), d_ids_ref(4) {
    REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    ref_a = resident(a);
    ref_b = resident(b);
    auto plain = make_device_cache(rt, L, false, 0);
    REQUIRE(!plain->readiness().enabled());
    CHECK(same_bits(device_step(*plain, moe, a, d_ids, d_w, d_x, d_out, stream), ref_a));
    plain_b = device_step(*plain, moe, b, d_ids, d_w, d_x, d_out, stream);
    CHECK(same_bits(plain_b, ref_b));
  }
  SlowedFill(const SlowedFill&) = delete;
  SlowedFill& operator=(const SlowedFill&) = delete;
  ~SlowedFill() { (void)cudaStreamDestroy(stream); }

  std::vector<float> resident(const std::vector<std::int32_t>& ids) {
    d_ids_ref.upload(ids);
    REQUIRE_CUDA_OK(cudaDeviceSynchronize());
    REQUIRE(moe.run(res.weights, d_ids_ref.get(), d_w.get(), d_x.get(), d_ref.get(), 1, stream).ok());
    REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
    return d_ref.download();
  }

  // A fresh overlapped cache with the slowed fill: step A (every wait; checked against the
  // all-resident run), then step B eagerly or as a captured graph with `waits`. Returns step B's
  // output; the cache stays in `ov` for the caller's checks.
  std::vector<float> step_b(std::unique_ptr<DevCache>& ov, bool graph, Waits waits, FillParts parts = {}) {
    ov = make_device_cache(rt, L, true, delay_ns, parts);
    REQUIRE(ov->readiness().enabled());
    const std::vector<float> got_a = device_step(*ov, moe, a, d_ids, d_w, d_x, d_out, stream);
    // The test fill that publishes a part before its bytes (parts.early) is wrong by design on
    // every step whose consumer can start before the fill ends (programmatic launches on sm_90
    // included), step A too: only the correct fills' step A is checked.
    if (!parts.early) CHECK(same_bits(got_a, ref_a));
    return graph ? graph_step(*ov, moe, b, d_ids, d_w, d_x, d_out, stream, waits)
                 : device_step(*ov, moe, b, d_ids, d_w, d_x, d_out, stream, waits);
  }

  // After a run that skipped a wait: the fill did land, so the same forward again (all hits,
  // every wait) is right, and no bounded wait timed out.
  void check_recovered(DevCache& ov) {
    CHECK(same_bits(device_step(ov, moe, b, d_ids, d_w, d_x, d_out, stream), ref_b));  // all hits now: correct
    check_no_errors(ov);
  }
  static void check_no_errors(DevCache& ov) {
    const std::uint32_t errors = ov.take_errors();
    CHECK_MESSAGE(errors == 0u, "device error word " << errors << " (16 = a bounded wait timed out)");
  }
};

// Expert `to` gets expert `from`'s down projection (W2 words, scales, global scale; and its
// double dequantisation): a moe_w2 that reads slot bytes of `from` where `to` is being filled
// still computes with the right W2, so only its activations can be stale.
void alias_w2(Layer& L, std::int64_t from, std::int64_t to) {
  const ExpertTensorBytes b = L.layout.tensors();
  for (const std::size_t t : {std::size_t{1}, std::size_t{3}, std::size_t{5}}) {
    const std::size_t n = b[t].bytes_per_expert;
    unsigned char* base = const_cast<unsigned char*>(L.tensor(t, 0));  // L's own vectors
    std::memcpy(base + n * static_cast<std::size_t>(to), base + n * static_cast<std::size_t>(from), n);
  }
  const auto n = static_cast<std::size_t>(L.layout.hidden * L.layout.intermediate);
  std::copy_n(L.dq2.begin() + static_cast<std::ptrdiff_t>(n * static_cast<std::size_t>(from)), n,
              L.dq2.begin() + static_cast<std::ptrdiff_t>(n * static_cast<std::size_t>(to)));
}

}  // namespace

TEST_CASE("moe consumer + overlapped device cache (edge D4): a slowed fill is waited for, bit-identical; in a captured graph skipping the wait reads stale bytes") {
  const Layer L = make_layer(256, 128, 16, 71);
  SlowedFill f(L);
  // Step B eagerly and as a captured graph (where the product runs it).
  for (const bool graph : {false, true}) {
    CAPTURE(graph);
    {  // Overlap with the wait: bit-identical, no timeout flagged.
      std::unique_ptr<DevCache> ov;
      const std::vector<float> got = f.step_b(ov, graph, Waits::all);
      CHECK_MESSAGE(same_bits(got, f.plain_b), "overlapped run differs from the non-overlapped one: the readiness wait did not order the read");
      std::int32_t slot9 = -1;
      REQUIRE_CUDA_OK(cudaMemcpy(&slot9, ov->resident_map_device() + 9, sizeof slot9, cudaMemcpyDeviceToHost));
      CHECK(slot9 == 3);
      SlowedFill::check_no_errors(*ov);
    }
    {  // Overlap WITHOUT the wait (test kernels).
      std::unique_ptr<DevCache> ov;
      const std::vector<float> got = f.step_b(ov, graph, Waits::skip_slot_wait);
      const bool stale = !same_bits(got, f.ref_b);
      if (graph) {
        // The negative check: in the graph the consumer's first kernel hangs off the fill node by
        // a programmatic edge, starts while fill 0 is held back, and reads slot 3 (expert 3).
        CHECK_MESSAGE(stale,
                      "in a captured graph, without the wait the consumer still saw expert 9's bytes: it did not "
                      "overlap the slowed fill (programmatic dependent launch inactive? sm_90 and a driver with "
                      "programmatic edges in stream capture are needed), so this run cannot show that the wait "
                      "orders the read");
      } else {
        // Eagerly, prepare records the cache's `ready` event on the stream after the fill
        // (OrderingCore::publish_writes), so the fill and the consumer are not adjacent kernels
        // and the consumer starts only after the fill grid (seen on the H200). Stream order is
        // not guaranteed to stay that strict, so this is reported, not asserted.
        MESSAGE("eager prepare + consumer without the wait: " << (stale ? "read stale bytes (overlapped)" : "correct (serialised at the ready-event record)"));
      }
      f.check_recovered(*ov);
    }
  }
}

TEST_CASE("moe consumer + overlapped device cache (edge D4b): moe_w2 waits per pair for moe_w13's activations; in a captured graph skipping that wait reads stale activations") {
  // Expert 9's W2 is expert 3's, so the stale slot-3 bytes moe_w2 may load are the right W2: only
  // the activations of pair 3 (written by moe_w13 after the slowed fill of expert 9) can be stale.
  Layer L = make_layer(256, 128, 16, 71);
  alias_w2(L, 3, 9);
  SlowedFill f(L);
  REQUIRE_MESSAGE(!same_bits(f.ref_a, f.ref_b), "expert 9's activations must differ from expert 3's for this test to show anything");
  for (const bool graph : {false, true}) {
    CAPTURE(graph);
    {  // Every wait, moe_w2 per pair: bit-identical to the non-overlapped run.
      std::unique_ptr<DevCache> ov;
      const std::vector<float> got = f.step_b(ov, graph, Waits::all);
      const bool same = same_bits(got, f.plain_b);
      MESSAGE("D4b " << (graph ? "graph" : "eager") << ", moe_w2 waits per pair: " << (same ? "bit-identical to the non-overlapped run" : "DIFFERS from the non-overlapped run"));
      CHECK_MESSAGE(same, "overlapped run with the per-pair wait differs from the non-overlapped one: moe_w2 read activations before moe_w13 published them");
      SlowedFill::check_no_errors(*ov);
    }
    if (!graph) continue;  // eagerly the consumer follows the fill grid (see the edge D4 case): nothing to show
    {  // moe_w2 without any wait before it reads the activations (moe_w13 still waits for slot 3).
      std::unique_ptr<DevCache> ov;
      const std::vector<float> got = f.step_b(ov, graph, Waits::skip_act_wait);
      const bool stale = !same_bits(got, f.ref_b);
      // Stale means: pair 3's activations of step A (expert 3; pairs 0-2 are the same in A and B)
      // with expert 9's W2, which is expert 3's, i.e. exactly step A's output.
      const bool step_a = same_bits(got, f.ref_a);
      if (!stale) {
        MESSAGE("D4b INCONCLUSIVE: in a captured graph, moe_w2 without the per-pair wait still read expert 9's "
                "activations: it did not overlap the slowed fill (programmatic dependent launch inactive? sm_90 and a "
                "driver with programmatic edges in stream capture are needed), so this run cannot show that the wait "
                "orders the read");
      } else {
        MESSAGE("D4b graph, moe_w2 without the per-pair wait: read stale activations (output "
                << (step_a ? "equals step A's: pair 3's activations of the previous run" : "differs from both steps") << ")");
      }
      CHECK_MESSAGE(stale, "D4b INCONCLUSIVE (see above)");
      CHECK_MESSAGE(step_a, "moe_w2 without the wait should read exactly the previous run's activations of pair 3");
      f.check_recovered(*ov);
    }
  }
}

// Edge D4c: the fill copies every missing expert's W13 tensors (MoeConsumer::first_pass_regions)
// first and publishes them on ready_first; moe_w13 waits on that word, moe_w2 on the whole
// expert's. With fill 0 (expert 9) slowed in its W13 part, then in its W2 part: bit-identical to
// the non-overlapped run (a moe_w2 that waited only for the W13 part would read expert 3's W2
// bytes in the second case). In a captured graph, the test fill that stores the W13 word before
// copying the W13 part (the edge removed) must make moe_w13 read expert 3's bytes.
TEST_CASE("moe consumer + overlapped device cache (edge D4c): W13 parts first on their own ready word; removing the order reads stale bytes") {
  const Layer L = make_layer(256, 128, 16, 71);
  SlowedFill f(L);
  const std::uint32_t w13 = device::MoeConsumer::first_pass_regions;
  for (const bool graph : {false, true}) {
    CAPTURE(graph);
    for (const std::int32_t part : {0, 1}) {
      CAPTURE(part);
      std::unique_ptr<DevCache> ov;
      const std::vector<float> got = f.step_b(ov, graph, Waits::all, FillParts{w13, part, false});
      const device::PlanFillParams& fp = ov->executor().fill_params();
      CHECK(fp.first_part_items > 0);
      CHECK(fp.first_part_items < fp.items_per_fill);
      CHECK_MESSAGE(same_bits(got, f.plain_b), "parted fill: the consumer read a part before its ready word");
      SlowedFill::check_no_errors(*ov);
      // Both words of every resident slot reached its tag.
      std::vector<std::uint32_t> first(4), whole(4), needed(4);
      const DevicePlanState& s = ov->plan_state();
      REQUIRE_CUDA_OK(cudaMemcpy(first.data(), s.slot_ready_first.data, 16, cudaMemcpyDeviceToHost));
      REQUIRE_CUDA_OK(cudaMemcpy(whole.data(), s.slot_ready.data, 16, cudaMemcpyDeviceToHost));
      REQUIRE_CUDA_OK(cudaMemcpy(needed.data(), s.slot_needed.data, 16, cudaMemcpyDeviceToHost));
      CHECK(first == needed);
      CHECK(whole == needed);
    }
    if (!graph) continue;  // eagerly the consumer follows the fill grid (see the edge D4 case)
    std::unique_ptr<DevCache> ov;
    const std::vector<float> got = f.step_b(ov, graph, Waits::all, FillParts{w13, 0, true});
    CHECK_MESSAGE(!same_bits(got, f.ref_b),
                  "D4c INCONCLUSIVE: with the W13 word stored before its bytes the consumer still read expert 9's W13 "
                  "(programmatic dependent launch inactive?), so this run cannot show that the word orders the read");
    f.check_recovered(*ov);
  }
}

namespace {
void overlapped_steps_equal_resident(FillEngine engine, FillParts parts) {
  const Layer L = make_layer(512, 256, 16, 73);
  const ResidentLayer res(L);
  CudaRuntime rt;
  cudaStream_t stream;
  REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  device::MoeConsumer moe(L.layout, 1, 4);
  DevArray<float> d_x(random_x(1, 512, 5)), d_w(std::vector<float>{0.1f, 0.2f, 0.3f, 0.4f}), d_out(512), d_ref(512);
  DevArray<std::int32_t> d_ids(4), d_ids_ref(4);
  // SM loads: 20 us on every step's first fill (the knob of the fill kernel).
  auto cache = make_device_cache(rt, L, true, engine == FillEngine::sm_loads ? 20'000 : 0, parts, 4, 4, false, engine);
  REQUIRE(cache->fill_engine() == engine);
  std::mt19937_64 rng(11);
  auto random_ids = [&] {
    std::vector<std::int32_t> ids(4);
    for (auto& id : ids) id = static_cast<std::int32_t>(rng() % 16);
    return ids;
  };
  auto resident = [&](const std::vector<std::int32_t>& ids) {
    d_ids_ref.upload(ids);
    REQUIRE_CUDA_OK(cudaDeviceSynchronize());
    REQUIRE(moe.run(res.weights, d_ids_ref.get(), d_w.get(), d_x.get(), d_ref.get(), 1, stream).ok());
    REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
    return d_ref.download();
  };
  for (int step = 0; step < 30; ++step) {
    const std::vector<std::int32_t> ids = random_ids();
    const std::vector<float> want = resident(ids);
    const std::vector<float> got = device_step(*cache, moe, ids, d_ids, d_w, d_x, d_out, stream);
    CAPTURE(step);
    CHECK(std::memcmp(got.data(), want.data(), 512 * sizeof(float)) == 0);
  }
  // One captured step (prepare + consumer), replayed with new ids: no reset between replays.
  REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  REQUIRE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  auto view = cache->prepare(d_ids.get(), 4, stream);
  const bool ran = view.ok() && moe.run(device::moe_weights_from_view(view.value(), 16), cache->sanitized_ids_device(),
                                        d_w.get(), d_x.get(), d_out.get(), 1, stream, cache->readiness())
                                    .ok();
  REQUIRE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  REQUIRE(ran);
  REQUIRE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  const std::uint64_t misses0 = cache->stats().misses;
  for (int replay = 0; replay < 40; ++replay) {
    const std::vector<std::int32_t> ids = random_ids();
    const std::vector<float> want = resident(ids);
    d_ids.upload(ids);
    REQUIRE_CUDA_OK(cudaDeviceSynchronize());
    REQUIRE_CUDA_OK(cudaGraphLaunch(exec, stream));
    REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
    CAPTURE(replay);
    CHECK(std::memcmp(d_out.download().data(), want.data(), 512 * sizeof(float)) == 0);
  }
  CHECK(cache->stats().misses > misses0 + 20);  // the replays did fill
  const std::uint32_t errors = cache->take_errors();
  CHECK_MESSAGE(errors == 0u, "device error word " << errors << " (16 = a bounded wait timed out)");
  REQUIRE_CUDA_OK(cudaGraphExecDestroy(exec));
  REQUIRE_CUDA_OK(cudaGraphDestroy(graph));
  REQUIRE_CUDA_OK(cudaStreamDestroy(stream));
}
}  // namespace

TEST_CASE("moe consumer + overlapped device cache: eager steps with evictions and a captured graph replayed with new ids equal the all-resident run") {
  overlapped_steps_equal_resident(FillEngine::sm_loads, {});
}
// The copy engine publishes the same ready words (the W13 part first on its own word, D4c).
TEST_CASE("moe consumer + overlapped device cache with the copy engine: eager and replayed steps equal the all-resident run, W13 part first") {
  overlapped_steps_equal_resident(FillEngine::copy_engine, FillParts{device::MoeConsumer::first_pass_regions});
  overlapped_steps_equal_resident(FillEngine::copy_engine, {});
}

TEST_CASE("moe consumer + overlapped device cache, 8 tokens: blocks in pair order and in expert order equal the all-resident run") {
  // 8 tokens x top-3 over 32 experts, 24 slots: every step fills and evicts; the first fill of
  // each step is slowed by 20 us so that blocks do wait. Expert order is the fill's order; each
  // pair must still be computed exactly once per tile (a wrong permutation drops or repeats pairs).
  constexpr int tokens = 8, top_k = 3, pairs = tokens * top_k;
  const Layer L = make_layer(512, 256, 32, 79);
  const ResidentLayer res(L);
  CudaRuntime rt;
  cudaStream_t stream;
  REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  device::MoeConsumer moe(L.layout, tokens, top_k);
  std::vector<float> weights(pairs);
  for (int p = 0; p < pairs; ++p) weights[static_cast<std::size_t>(p)] = 0.1f + 0.05f * static_cast<float>(p % top_k);
  const auto out_n = static_cast<std::size_t>(tokens) * 512;
  DevArray<float> d_x(random_x(tokens, 512, 7)), d_w(weights), d_out(out_n), d_ref(out_n);
  DevArray<std::int32_t> d_ids(pairs), d_ids_ref(pairs);
  std::mt19937_64 rng(23);
  auto random_ids = [&] {
    std::vector<std::int32_t> ids(pairs);
    for (auto& id : ids) id = static_cast<std::int32_t>(rng() % 32);
    ids[5] = -1;  // an absent pair: skipped in either order
    return ids;
  };
  auto resident = [&](const std::vector<std::int32_t>& ids) {
    d_ids_ref.upload(ids);
    REQUIRE_CUDA_OK(cudaDeviceSynchronize());
    REQUIRE(moe.run(res.weights, d_ids_ref.get(), d_w.get(), d_x.get(), d_ref.get(), tokens, stream).ok());
    REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
    return d_ref.download();
  };
  CHECK(moe.pair_order() == device::MoePairOrder::pairs);  // the default
  CHECK(!moe.expert_order_for(tokens, 32));
  for (const device::MoePairOrder order : {device::MoePairOrder::pairs, device::MoePairOrder::experts}) {
    moe.set_pair_order(order);
    const bool by_expert = order == device::MoePairOrder::experts;
    CHECK(moe.expert_order_for(tokens, 32) == by_expert);
    auto cache = make_device_cache(rt, L, true, 20'000, FillParts{device::MoeConsumer::first_pass_regions}, 24, pairs);
    for (int step = 0; step < 12; ++step) {
      const std::vector<std::int32_t> ids = random_ids();
      const std::vector<float> want = resident(ids);
      REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
      d_ids.upload(ids);
      REQUIRE_CUDA_OK(cudaDeviceSynchronize());
      auto view = cache->prepare(d_ids.get(), pairs, stream);
      REQUIRE_MESSAGE(view.ok(), std::string(view.status().message()));
      REQUIRE(moe.run(device::moe_weights_from_view(view.value(), 32), cache->sanitized_ids_device(), d_w.get(), d_x.get(),
                      d_out.get(), tokens, stream, cache->readiness())
                  .ok());
      REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
      CAPTURE(by_expert);
      CAPTURE(step);
      CHECK(std::memcmp(d_out.download().data(), want.data(), out_n * sizeof(float)) == 0);
    }
    CHECK(cache->stats().misses > 24);  // the steps did fill
    const std::uint32_t errors = cache->take_errors();
    CHECK_MESSAGE(errors == 0u, "device error word " << errors << " (16 = a bounded wait timed out)");
  }
  REQUIRE_CUDA_OK(cudaStreamDestroy(stream));
}

TEST_CASE("moe consumer: batch-1 weight-read bandwidth against the HBM copy (reported)") {
  // The default benchmark expert (hidden 2048, intermediate 512: 1.688 MiB), 64 experts resident, top-10.
  const Nvfp4Marlin layout{2048, 512, ActDtype::bf16};
  const std::int64_t experts = 64;
  const ExpertTensorBytes b = layout.tensors();
  device::MoeWeights w;
  std::vector<std::unique_ptr<DevArray<unsigned char>>> arrays;
  std::mt19937_64 rng(1);
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    if (b[t].bytes_per_expert == 0) continue;  // the layout's six tensors only
    std::vector<unsigned char> host(b[t].bytes_per_expert * static_cast<std::size_t>(experts));
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<unsigned char>(rng());
    if (t == 2 || t == 3)
      for (auto& v : host) v = static_cast<unsigned char>(0x80 | (v & 0x1F));
    if (t == 4 || t == 5)  // the fp32 global scales
      for (std::size_t e = 0; e < static_cast<std::size_t>(experts); ++e) {
        const float g = std::ldexp(1.0f, 110);
        std::memcpy(host.data() + e * sizeof(float), &g, sizeof g);
      }
    arrays.push_back(std::make_unique<DevArray<unsigned char>>(host.size()));
    REQUIRE_CUDA_OK(cudaMemcpy(arrays.back()->get(), host.data(), host.size(), cudaMemcpyHostToDevice));
    w.base[t] = arrays.back()->get();
    w.stride[t] = b[t].bytes_per_expert;
  }
  std::vector<std::int32_t> ident(static_cast<std::size_t>(experts));
  for (std::size_t e = 0; e < ident.size(); ++e) ident[e] = static_cast<std::int32_t>(e);
  DevArray<std::int32_t> map(ident);
  w.expert_map = map.get();
  w.num_experts = static_cast<std::int32_t>(experts);
  // Six disjoint sets of 10 experts (106 MB in all, twice the 50 MB L2), cycled, so each run's
  // weights come from HBM rather than from the L2 one repeated set (~18 MB) would stay in.
  constexpr int sets = 6;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(sets * 10));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 37) % experts);  // 37 coprime to 64
  DevArray<std::int32_t> d_ids(ids);
  DevArray<float> d_w(std::vector<float>(10, 0.1f)), d_x(random_x(1, 2048, 2)), d_out(2048);
  device::MoeConsumer moe(layout, 1, 10);

  cudaEvent_t e0, e1;
  REQUIRE_CUDA_OK(cudaEventCreate(&e0));
  REQUIRE_CUDA_OK(cudaEventCreate(&e1));
  auto time_ms = [&](auto&& fn, int reps) {
    fn();
    REQUIRE_CUDA_OK(cudaDeviceSynchronize());
    REQUIRE_CUDA_OK(cudaEventRecord(e0));
    for (int i = 0; i < reps; ++i) fn();
    REQUIRE_CUDA_OK(cudaEventRecord(e1));
    REQUIRE_CUDA_OK(cudaEventSynchronize(e1));
    float ms = 0;
    REQUIRE_CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    return static_cast<double>(ms) / reps;
  };
  int run_index = 0;
  const double consumer_ms = time_ms(
      [&] { REQUIRE(moe.run(w, d_ids.get() + 10 * (run_index++ % sets), d_w.get(), d_x.get(), d_out.get(), 1, nullptr).ok()); }, 60);
  const double weight_bytes = 10.0 * static_cast<double>(layout.bytes_per_expert());
  const double consumer_gbs = weight_bytes / (consumer_ms * 1e-3) * 1e-9;
  // The HBM reference: a large device-to-device copy, read + write bytes.
  const std::size_t copy_bytes = std::size_t{1} << 30;
  DevArray<unsigned char> a(copy_bytes), c(copy_bytes);
  const double copy_ms = time_ms([&] { REQUIRE_CUDA_OK(cudaMemcpyAsync(c.get(), a.get(), copy_bytes, cudaMemcpyDeviceToDevice)); }, 5);
  const double hbm_gbs = 2.0 * static_cast<double>(copy_bytes) / (copy_ms * 1e-3) * 1e-9;
  MESSAGE("consumer batch 1, 10 experts: " << consumer_ms * 1e3 << " us, weight reads " << consumer_gbs
                                            << " GB/s; HBM copy (read+write) " << hbm_gbs << " GB/s; ratio "
                                            << consumer_gbs / hbm_gbs);
  // Informational: the speed target (>= 50% of HBM at batch 1) is a benchmark number, reported
  // by bench/programs/expert_cache_bench.cu and docs/benchmarks.md, not a unit-test assertion.
  REQUIRE_CUDA_OK(cudaEventDestroy(e0));
  REQUIRE_CUDA_OK(cudaEventDestroy(e1));
}

TEST_CASE("moe consumer one pass + device cache with fill_by_consumer: eager steps, a replayed graph and 3 tokens equal the all-resident run; slots end with the host bytes; drop_unfilled") {
  // The plan enqueues no fill: MoeConsumer::run_one_pass reads each flagged miss from the mapped
  // host pools and writes its slot (edge D7), so every later step that hits it reads it there.
  const Layer L = make_layer(512, 256, 32, 83);
  const ResidentLayer res(L);
  CudaRuntime rt;
  cudaStream_t stream;
  REQUIRE_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::mt19937_64 rng(29);
  for (const int tokens : {1, 3}) {
    CAPTURE(tokens);
    constexpr int top_k = 4;
    const int pairs = tokens * top_k;
    device::MoeConsumer moe(L.layout, tokens, top_k);
    std::vector<float> weights(static_cast<std::size_t>(pairs));
    for (int p = 0; p < pairs; ++p) weights[static_cast<std::size_t>(p)] = 0.1f + 0.07f * static_cast<float>(p % top_k);
    const auto out_n = static_cast<std::size_t>(tokens) * 512;
    DevArray<float> d_x(random_x(tokens, 512, 13)), d_w(weights), d_out(out_n), d_ref(out_n);
    DevArray<std::int32_t> d_ids(static_cast<std::size_t>(pairs)), d_ids_ref(static_cast<std::size_t>(pairs));
    auto cache = make_device_cache(rt, L, false, 0, {}, 12, pairs, true);  // 12 of 32 experts
    REQUIRE(cache->view().missing != nullptr);
    const device::MoeHostSource host = device::moe_host_source_from(cache->storage(), 32, cache->view().missing);
    REQUIRE(moe.check_host_source(host).ok());
    auto random_ids = [&] {
      std::vector<std::int32_t> ids(static_cast<std::size_t>(pairs));
      for (auto& id : ids) id = static_cast<std::int32_t>(rng() % 32);
      return ids;
    };
    auto resident = [&](const std::vector<std::int32_t>& ids) {
      d_ids_ref.upload(ids);
      REQUIRE_CUDA_OK(cudaDeviceSynchronize());
      REQUIRE(moe.run(res.weights, d_ids_ref.get(), d_w.get(), d_x.get(), d_ref.get(), tokens, stream).ok());
      REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
      return d_ref.download();
    };
    auto consume = [&](const ForwardView& v) {
      return moe.run_one_pass(device::moe_weights_from_view(v, 32), host, cache->sanitized_ids_device(), d_w.get(), d_x.get(),
                              d_out.get(), tokens, stream);
    };
    auto eager = [&](const std::vector<std::int32_t>& ids) {
      REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
      d_ids.upload(ids);
      REQUIRE_CUDA_OK(cudaDeviceSynchronize());
      auto view = cache->prepare(d_ids.get(), pairs, stream);
      REQUIRE_MESSAGE(view.ok(), std::string(view.status().message()));
      REQUIRE(consume(view.value()).ok());
      REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
      return d_out.download();
    };
    for (int step = 0; step < 24; ++step) {
      const std::vector<std::int32_t> ids = random_ids();
      CAPTURE(step);
      CHECK(same_bits(eager(ids), resident(ids)));
    }
    // One captured step (plan + one-pass consumer: no fill node), replayed with new ids.
    REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    REQUIRE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    auto view = cache->prepare(d_ids.get(), pairs, stream);
    const bool ran = view.ok() && consume(view.value()).ok();
    REQUIRE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
    REQUIRE(ran);
    REQUIRE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    const std::uint64_t misses0 = cache->stats().misses;
    for (int replay = 0; replay < 30; ++replay) {
      const std::vector<std::int32_t> ids = random_ids();
      const std::vector<float> want = resident(ids);
      d_ids.upload(ids);
      REQUIRE_CUDA_OK(cudaDeviceSynchronize());
      REQUIRE_CUDA_OK(cudaGraphLaunch(exec, stream));
      REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
      CAPTURE(replay);
      CHECK(same_bits(d_out.download(), want));
    }
    CHECK(cache->stats().misses > misses0 + 20);  // the replays did miss: the consumer copied them
    REQUIRE_CUDA_OK(cudaGraphExecDestroy(exec));
    REQUIRE_CUDA_OK(cudaGraphDestroy(graph));
    // Every resident expert's slot holds its host bytes, as a fill would have left it.
    std::vector<std::int32_t> rmap(32);
    REQUIRE_CUDA_OK(cudaMemcpy(rmap.data(), cache->resident_map_device(), 32 * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    const ExpertTensorBytes b = L.layout.tensors();
    int compared = 0;
    for (std::int32_t e = 0; e < 32; ++e) {
      const std::int32_t slot = rmap[static_cast<std::size_t>(e)];
      if (slot < 0) continue;
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        const std::size_t n = b[t].bytes_per_expert;
        if (n == 0) continue;
        std::vector<unsigned char> got(n);
        REQUIRE_CUDA_OK(cudaMemcpy(got.data(), cache->view().tensors[t].slot(slot), n, cudaMemcpyDeviceToHost));
        CAPTURE(e);
        CAPTURE(t);
        CHECK(std::memcmp(got.data(), L.tensor(t, e), n) == 0);
      }
      ++compared;
    }
    CHECK(compared == 12);
    // drop_unfilled: a step whose consumer never ran; its misses are dropped and miss again.
    std::vector<std::int32_t> fresh;
    for (std::int32_t e = 0; e < 32 && static_cast<int>(fresh.size()) < pairs; ++e)
      if (rmap[static_cast<std::size_t>(e)] < 0) fresh.push_back(e);
    REQUIRE(static_cast<int>(fresh.size()) == pairs);
    d_ids.upload(fresh);
    REQUIRE_CUDA_OK(cudaDeviceSynchronize());
    REQUIRE(cache->prepare(d_ids.get(), pairs, stream).ok());
    REQUIRE(cache->drop_unfilled(stream).ok());
    REQUIRE_CUDA_OK(cudaStreamSynchronize(stream));
    const std::uint64_t misses1 = cache->stats().misses;
    CHECK(same_bits(eager(fresh), resident(fresh)));
    CHECK(cache->stats().misses - misses1 == static_cast<std::uint64_t>(pairs));
    const std::uint32_t errors = cache->take_errors();
    CHECK_MESSAGE(errors == 0u, "device error word " << errors);
  }
  REQUIRE_CUDA_OK(cudaStreamDestroy(stream));
}
