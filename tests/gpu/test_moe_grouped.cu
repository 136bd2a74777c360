// The grouped NVFP4 MoE consumer (device/moe_grouped.cuh), suite 'gpu' (exits 77 without a
// device, through gpu_main.cu):
//  * per (token, expert) row it matches a double-precision host MoE built from
//    dequant_marlin_reference, for several token counts (tiles of 1..64 rows, experts with more
//    than 64 rows, partial warps) and shapes (shard padding included);
//  * rows are bit-identical whether a call covers every expert (an all-resident prefill) or the
//    experts are split over calls with other slots (wide-forward rounds);
//  * rows of an expert absent from the map are 0; tiles with a bad row range are skipped (their
//    rows untouched); run() refuses sizes beyond its workspace.
// Layer, make_layer and ResidentLayer are the ones of test_moe_consumer.cu.
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
#include "expert_cache/device/moe_grouped.cuh"
#include "expert_cache/layout/nvfp4_reference.hpp"
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

// A call's rows: the (token, j) pairs of `experts` (ascending), sorted by expert then pair.
struct Rows {
  std::vector<std::int32_t> src, dst, expert;
  std::vector<float> coef;
  std::vector<device::GroupedTile> tiles;
};

Rows make_rows(const std::vector<std::int32_t>& ids, int top_k, const std::vector<std::int32_t>& experts) {
  Rows r;
  for (const std::int32_t e : experts) {
    const auto first = static_cast<std::int32_t>(r.src.size());
    for (std::size_t p = 0; p < ids.size(); ++p) {
      if (ids[p] != e) continue;
      r.src.push_back(static_cast<std::int32_t>(p) / top_k);
      r.dst.push_back(static_cast<std::int32_t>(p));
      r.expert.push_back(e);
      r.coef.push_back(0.25f + 0.125f * static_cast<float>(p % 3));
    }
    device::append_grouped_tiles(e, first, static_cast<std::int32_t>(r.src.size()) - first, r.tiles);
  }
  return r;
}

// Runs `rows` into `out` ([pairs, hidden], device) with the weights `res`.
void run_rows(const device::GroupedMoe& moe, const device::MoeWeights& w, const Rows& rows, const DevArray<float>& x,
              DevArray<float>& out) {
  DevArray<std::int32_t> src(rows.src), dst(rows.dst);
  DevArray<float> coef(rows.coef);
  std::vector<std::int32_t> tile_words(rows.tiles.size() * 4);
  std::memcpy(tile_words.data(), rows.tiles.data(), tile_words.size() * sizeof(std::int32_t));
  DevArray<std::int32_t> tiles(tile_words);
  REQUIRE(moe.run(w, reinterpret_cast<const device::GroupedTile*>(tiles.get()), static_cast<int>(rows.tiles.size()),
                  src.get(), dst.get(), coef.get(), x.get(), out.get(), static_cast<int>(rows.src.size()), nullptr)
              .ok());
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
}

// Row v of the host reference: coef * (silu(gate) * up) . W2 in double.
std::vector<double> reference_row(const Layer& L, const std::vector<float>& x, std::int32_t token, std::int32_t e, float coef) {
  const std::int64_t K = L.layout.hidden, N = L.layout.intermediate;
  std::vector<double> c1(static_cast<std::size_t>(2 * N)), out(static_cast<std::size_t>(K));
  for (std::int64_t r = 0; r < 2 * N; ++r) {
    double s = 0;
    for (std::int64_t k = 0; k < K; ++k)
      s += L.dq13[static_cast<std::size_t>((e * 2 * N + r) * K + k)] * x[static_cast<std::size_t>(token * K + k)];
    c1[static_cast<std::size_t>(r)] = s;
  }
  std::vector<double> act(static_cast<std::size_t>(N));
  for (std::int64_t i = 0; i < N; ++i) {
    const double gate = c1[static_cast<std::size_t>(i)];
    act[static_cast<std::size_t>(i)] = gate / (1.0 + std::exp(-gate)) * c1[static_cast<std::size_t>(N + i)];
  }
  for (std::int64_t n = 0; n < K; ++n) {
    double s = 0;
    for (std::int64_t i = 0; i < N; ++i) s += L.dq2[static_cast<std::size_t>((e * K + n) * N + i)] * act[static_cast<std::size_t>(i)];
    out[static_cast<std::size_t>(n)] = static_cast<double>(coef) * s;
  }
  return out;
}

std::vector<std::int32_t> random_ids(int tokens, int top_k, std::int32_t experts, std::uint64_t seed) {
  // Skewed routing (expert e with weight 1 / (e + 1)): some experts get more than 64 rows.
  std::mt19937_64 rng(seed);
  std::vector<double> wts(static_cast<std::size_t>(experts));
  for (std::int32_t e = 0; e < experts; ++e) wts[static_cast<std::size_t>(e)] = 1.0 / (e + 1);
  std::discrete_distribution<std::int32_t> d(wts.begin(), wts.end());
  std::vector<std::int32_t> ids;
  for (int m = 0; m < tokens; ++m) {
    std::vector<std::int32_t> row;
    while (static_cast<int>(row.size()) < top_k) {
      const std::int32_t e = d(rng);
      if (std::find(row.begin(), row.end(), e) == row.end()) row.push_back(e);
    }
    ids.insert(ids.end(), row.begin(), row.end());
  }
  return ids;
}

void check_against_host(std::int64_t hidden, std::int64_t intermediate, int tokens, int top_k, std::uint64_t seed) {
  CAPTURE(hidden);
  CAPTURE(intermediate);
  CAPTURE(tokens);
  const std::int32_t E = 8;
  const Layer L = make_layer(hidden, intermediate, E, seed);
  const ResidentLayer res(L);
  const std::vector<std::int32_t> ids = random_ids(tokens, top_k, E, seed + 1);
  std::vector<std::int32_t> all(E);
  for (std::int32_t e = 0; e < E; ++e) all[static_cast<std::size_t>(e)] = e;
  const Rows rows = make_rows(ids, top_k, all);
  const std::vector<float> xh = random_x(tokens, hidden, seed + 2);
  DevArray<float> x(xh), out(ids.size() * static_cast<std::size_t>(hidden));
  device::GroupedMoe moe(L.layout, static_cast<int>(rows.src.size()), static_cast<int>(rows.tiles.size()));
  run_rows(moe, res.weights, rows, x, out);
  const std::vector<float> got = out.download();
  double worst = 0, scale = 0;
  std::size_t multi_tile = 0;
  for (const auto& t : rows.tiles) multi_tile += t.count == device::grouped_tile_rows ? 1 : 0;
  for (std::size_t v = 0; v < rows.src.size(); ++v) {
    const std::vector<double> want = reference_row(L, xh, rows.src[v], rows.expert[v], rows.coef[v]);
    const double m = max_abs(want);
    REQUIRE(m > 0);
    scale = std::max(scale, m);
    for (std::int64_t n = 0; n < hidden; ++n) {
      const float g = got[static_cast<std::size_t>(rows.dst[v]) * static_cast<std::size_t>(hidden) + static_cast<std::size_t>(n)];
      REQUIRE(std::isfinite(g));
      worst = std::max(worst, std::abs(static_cast<double>(g) - want[static_cast<std::size_t>(n)]) / m);
    }
  }
  INFO("rows " << rows.src.size() << ", tiles " << rows.tiles.size() << " (" << multi_tile << " full), max |gpu - host| / max|row| = " << worst);
  // The moe_consumer.cu bound: inputs and activations carried to ~24 bits, fp32 sums.
  CHECK(worst < 2e-4);
  if (tokens * top_k > 2 * 64 * E) CHECK(multi_tile > 0);
  // Deterministic: the same call again gives the same bits.
  DevArray<float> again(ids.size() * static_cast<std::size_t>(hidden));
  run_rows(moe, res.weights, rows, x, again);
  const std::vector<float> got2 = again.download();
  CHECK(std::memcmp(got.data(), got2.data(), got.size() * sizeof(float)) == 0);
}

}  // namespace

TEST_CASE("grouped consumer: matches the double host MoE per row (several token counts, shard padding)") {
  check_against_host(256, 80, 1, 2, 11);    // one row per tile
  check_against_host(256, 80, 37, 2, 12);   // partial warps
  check_against_host(256, 128, 300, 4, 13);  // experts with several full tiles
  check_against_host(512, 256, 129, 3, 14);
}

TEST_CASE("grouped consumer: rows bit-identical whether one call covers every expert or rounds of other slots do") {
  const std::int32_t E = 8;
  const std::int64_t hidden = 256;
  const Layer L = make_layer(hidden, 128, E, 21);
  const int tokens = 200, top_k = 4;
  const std::vector<std::int32_t> ids = random_ids(tokens, top_k, E, 22);
  const std::vector<float> xh = random_x(tokens, hidden, 23);
  DevArray<float> x(xh);
  const std::size_t n = ids.size() * static_cast<std::size_t>(hidden);
  // All resident, one call.
  const ResidentLayer all_res(L);
  const Rows all = make_rows(ids, top_k, {0, 1, 2, 3, 4, 5, 6, 7});
  device::GroupedMoe moe(L.layout, static_cast<int>(all.src.size()), static_cast<int>(all.tiles.size()));
  DevArray<float> ref(n);
  run_rows(moe, all_res.weights, all, x, ref);
  // Two rounds, each with only its experts in (other) slots: the map names the round's experts only.
  DevArray<float> split(n);
  const std::vector<std::vector<std::int32_t>> rounds = {{0, 3, 5}, {1, 2, 4, 6, 7}};
  for (const auto& experts : rounds) {
    std::vector<std::int32_t> map(E, -1);
    for (std::size_t i = 0; i < experts.size(); ++i) map[static_cast<std::size_t>(experts[i])] = static_cast<std::int32_t>(experts.size() - 1 - i);
    const ResidentLayer round_res(L, map, static_cast<std::int64_t>(experts.size()));
    run_rows(moe, round_res.weights, make_rows(ids, top_k, experts), x, split);
  }
  const std::vector<float> a = ref.download(), b = split.download();
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

TEST_CASE("grouped consumer: absent experts give zero rows, bad tiles are skipped, oversized calls refused") {
  const std::int32_t E = 4;
  const std::int64_t hidden = 256;
  const Layer L = make_layer(hidden, 80, E, 31);
  const int tokens = 40, top_k = 2;
  const std::vector<std::int32_t> ids = random_ids(tokens, top_k, E, 32);
  const std::vector<float> xh = random_x(tokens, hidden, 33);
  DevArray<float> x(xh);
  // Expert 1 absent from the map.
  const ResidentLayer res(L, {0, -1, 2, 3}, E);
  Rows rows = make_rows(ids, top_k, {0, 1, 2, 3});
  // Bad tiles: empty, more than 64 rows, past the rows; each refers to real rows it must not touch.
  const auto nrows = static_cast<std::int32_t>(rows.src.size());
  rows.tiles.push_back({0, 0, 0, 0});
  rows.tiles.push_back({0, 0, 65, 0});
  // A tile of expert 5 (out of range) over a row of a real expert's: its rows are written as 0
  // too, so give it rows of their own by duplicating the first row with a spare destination.
  const std::size_t n = (ids.size() + 1) * static_cast<std::size_t>(hidden);
  std::vector<float> sentinel(n, 7.0f);
  rows.src.push_back(0);
  rows.dst.push_back(static_cast<std::int32_t>(ids.size()));
  rows.expert.push_back(5);
  rows.coef.push_back(1.0f);
  rows.tiles.push_back({5, nrows, 1, 0});
  // Past the rows: counted against the call's final row count (the spare row included), else
  // this tile would be in range and write expert 0 into the spare row.
  rows.tiles.push_back({0, static_cast<std::int32_t>(rows.src.size()) - 1, 2, 0});
  DevArray<float> out(sentinel);
  device::GroupedMoe moe(L.layout, static_cast<int>(rows.src.size()), static_cast<int>(rows.tiles.size()));
  run_rows(moe, res.weights, rows, x, out);
  const std::vector<float> got = out.download();
  std::size_t zero_rows = 0;
  for (std::size_t v = 0; v < rows.src.size(); ++v) {
    const bool absent = rows.expert[v] == 1 || rows.expert[v] == 5;
    bool all_zero = true, any_sentinel = false;
    for (std::int64_t c = 0; c < hidden; ++c) {
      const float g = got[static_cast<std::size_t>(rows.dst[v]) * static_cast<std::size_t>(hidden) + static_cast<std::size_t>(c)];
      all_zero = all_zero && g == 0.0f;
      any_sentinel = any_sentinel || g == 7.0f;
    }
    CHECK(!any_sentinel);  // every real row written once by its good tile
    if (absent) {
      CHECK(all_zero);
      ++zero_rows;
    } else {
      CHECK(!all_zero);
    }
  }
  CHECK(zero_rows > 1);
  // Oversized calls: refused before any launch, the output untouched.
  DevArray<float> untouched(sentinel);
  DevArray<std::int32_t> d_src(rows.src), d_dst(rows.dst);
  DevArray<float> d_coef(rows.coef);
  const auto big = moe.run(res.weights, nullptr, moe.max_tiles() + 1, d_src.get(), d_dst.get(), d_coef.get(), x.get(),
                           untouched.get(), 1, nullptr);
  CHECK(big.code() == ErrorCode::invalid_argument);
  const auto many = moe.run(res.weights, nullptr, 1, d_src.get(), d_dst.get(), d_coef.get(), x.get(), untouched.get(),
                            moe.max_rows() + 1, nullptr);
  CHECK(many.code() == ErrorCode::invalid_argument);
  REQUIRE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> u = untouched.download();
  CHECK(std::all_of(u.begin(), u.end(), [](float v) { return v == 7.0f; }));
}
