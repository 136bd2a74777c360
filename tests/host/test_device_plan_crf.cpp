// DeviceCrf's power table (eviction/crf_math.hpp crf_decay_pow_table, DevicePlanState::crf_pow):
// the planner decays a CRF with one table word per resident instead of square-and-multiply, and
// must get the same value bit for bit, at every age, including ages past the table (residents
// idle for hundreds of forwards), where the high bits continue the product with a loop. Checked
// on the arithmetic for many decays, on the table reset_plan_state writes, and on the planner
// against the host Crf with residents idle for up to thousands of forwards.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "expert_cache/eviction/crf.hpp"
#include "expert_cache/planning/device_plan.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "support/device_plan_support.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;

namespace {

std::vector<std::uint64_t> power_table(std::uint64_t d) {
  std::vector<std::uint64_t> t(crf_pow_table_size);
  for (std::uint32_t a = 0; a < crf_pow_table_size; ++a) t[a] = crf_decay_pow(d, a);
  return t;
}

// Ages where the table path and the loop could part: every age below 5000 (the table, the first
// high bits, where a short half-life underflows to 0), powers of two and their neighbours, the
// largest ages, and random ones.
std::vector<std::uint32_t> probe_ages(std::mt19937_64& rng) {
  std::vector<std::uint32_t> ages;
  for (std::uint32_t a = 0; a < 5000; ++a) ages.push_back(a);
  for (std::uint32_t k = 0; k < 32; ++k) {
    const std::uint32_t p = 1u << k;
    ages.insert(ages.end(), {p - 1u, p, p + 1u, p | crf_pow_table_mask});
  }
  ages.insert(ages.end(), {0xffffffffu, 0xfffffffeu, 0x80000000u});
  for (int i = 0; i < 3000; ++i) ages.push_back(static_cast<std::uint32_t>(rng()));
  return ages;
}

}  // namespace

TEST_CASE("crf_decay_pow_table equals crf_decay_pow at every age, for every decay") {
  std::mt19937_64 rng(77);
  std::vector<std::uint64_t> decays = {
      crf_default_decay_q32,
      1,                                  // underflows at once
      std::uint64_t{1} << 31,             // half-life 1
      3558320637u,                        // ~2^(-1/4)
      4247451500u,                        // ~2^(-1/64): the table's ages do not reach 0
      (std::uint64_t{1} << 32) - 1,       // the slowest decay: never 0 within 2^32 forwards
      (std::uint64_t{1} << 32) - 4096,
  };
  for (int i = 0; i < 40; ++i) decays.push_back(1 + rng() % ((std::uint64_t{1} << 32) - 1));
  const std::vector<std::uint32_t> ages = probe_ages(rng);
  std::uint64_t past_table_nonzero = 0, past_table_zero = 0;
  for (const std::uint64_t d : decays) {
    CAPTURE(d);
    const std::vector<std::uint64_t> table = power_table(d);
    std::uint64_t mismatches = 0, first_bad_age = 0;
    for (const std::uint32_t a : ages) {
      const std::uint64_t want = crf_decay_pow(d, a);
      if (crf_decay_pow_table(table.data(), a) != want) {
        if (mismatches++ == 0) first_bad_age = a;
      }
      // crf_at_table decays a CRF exactly like crf_at (random CRFs, from 0 to the largest).
      const std::uint64_t crf = a % 7 == 0 ? 0 : rng() >> (a % 24);
      const std::uint32_t last = static_cast<std::uint32_t>(rng());
      if (crf_at_table(table.data(), crf, last, last + a) != crf_at(crf, last, last + a, d)) ++mismatches;
      if (a >= crf_pow_table_size) (want != 0 ? past_table_nonzero : past_table_zero) += 1;
    }
    CAPTURE(first_bad_age);
    CHECK(mismatches == 0);
  }
  // Both outcomes of the high-bit loop are exercised.
  CHECK(past_table_nonzero > 10000);
  CHECK(past_table_zero > 10000);
}

TEST_CASE("reset_plan_state writes the power table of the state's decay; a view without it is refused") {
  HostPlanStorage st(64, 16);
  SequentialBlock b;
  const DevicePlanState& s = st.state();
  REQUIRE(s.crf_pow.size == static_cast<std::int32_t>(crf_pow_table_size));
  for (std::int32_t a = 0; a < s.crf_pow.size; ++a) s.crf_pow[a] = 12345;  // garbage a reset must overwrite
  reset_plan_state<DeviceCrf>(b, s);
  CHECK(s.scalars->crf_decay == crf_default_decay_q32);
  CHECK(to_vector(s.crf_pow, s.crf_pow.size) == power_table(crf_default_decay_q32));
  CHECK(s.crf_pow[0] == crf_one);
  CHECK(s.crf_pow[8] == crf_decay_pow(crf_default_decay_q32, 8));  // ~0.5 after one half-life

  CHECK(plan_view_ok(s));
  DevicePlanState broken = s;
  broken.crf_pow.size -= 1;
  CHECK_FALSE(plan_view_ok(broken));
  // The planner refuses it: nothing planned, the state as it was, the error flagged.
  const std::vector<std::uint64_t> crf_before = to_vector(s.expert_crf, s.num_experts);
  const Ids ids = {1, 2, 3};
  plan_forward<DeviceCrf>(b, broken, ids.data(), 3);
  CHECK((*s.error_word & plan_error_bad_state) != 0u);
  CHECK(s.stats->forwards == 0u);
  CHECK(to_vector(s.expert_crf, s.num_experts) == crf_before);
  CHECK(s.resident_map[1] == -1);
}

// Residents idle for far longer than the table (256 forwards): six experts with a prior bias of
// 0.65-0.9 CRF stay resident while a slow churn (2 new experts per forward: each leaves at CRF
// ~0.5) goes on for 300-1200 forwards; a fast churn (6 per forward: they leave at CRF ~0.8) then
// evicts them, idle that long. Their keys (and their CRFs when they return) take the high-bit
// path; every victim, fill and CRF must still equal the host Crf's.
TEST_CASE("DeviceCrf equals Crf with residents idle for hundreds and thousands of forwards") {
  constexpr std::int32_t E = 96, C = 24, top_k = 6, biased = 6;
  std::vector<std::uint64_t> bias(E, 0);
  for (std::int32_t e = 0; e < biased; ++e) {
    bias[static_cast<std::size_t>(e)] = crf_one / 20 * static_cast<std::uint64_t>(13 + e);  // 0.65 ... 0.9
  }
  ForwardPlanner<Crf> host(CacheShape{E, C}, top_k, Crf(CacheShape{E, C}, CrfParams{}, bias));
  HostPlanStorage dev(E, C);
  SequentialBlock b;
  const DevicePlanState& s = dev.state();
  reset_plan_state<DeviceCrf>(b, s);
  REQUIRE(plan_set_bias(s, bias.data(), E));

  std::mt19937_64 rng(909);
  const std::int32_t slow_phases[] = {300, 700, 1200, 260, 3000};
  std::uint32_t oldest_victim_age = 0;
  std::uint64_t evictions_past_table = 0, victims_past_table = 0;
  std::int32_t cold = 0;
  auto next_cold = [&] { return biased + (cold++ % (E - biased)); };
  std::vector<Ids> forwards;
  for (const std::int32_t slow : slow_phases) {
    Ids all_biased;
    for (std::int32_t e = 0; e < biased; ++e) all_biased.push_back(e);
    forwards.push_back(all_biased);  // the biased experts (re)enter
    for (std::int32_t i = 0; i < slow; ++i) forwards.push_back({next_cold(), next_cold()});
    for (std::int32_t i = 0; i < 8; ++i) {
      Ids f;
      for (std::int32_t j = 0; j < top_k; ++j) f.push_back(next_cold());
      forwards.push_back(f);
    }
  }
  ForwardPlan plan;
  for (std::size_t step = 0; step < forwards.size(); ++step) {
    CAPTURE(step);
    Ids ids = forwards[step];
    std::sort(ids.begin(), ids.end());
    // The oldest resident about to be ranked: its age at this forward's clock.
    const std::uint32_t clk = s.scalars->crf_clock + 1u;
    std::uint32_t oldest = 0;
    for (std::int32_t slot = 0; slot < C; ++slot) {
      const std::int32_t e = s.slot_owner[slot];
      if (e >= 0 && !std::binary_search(ids.begin(), ids.end(), e)) oldest = std::max(oldest, clk - s.expert_last[e]);
    }
    Ids sent = ids;
    if (step % 2 == 1) sent.resize(20, -1);  // past plan_small_ids: the general path, every other forward
    plan_forward<DeviceCrf>(b, s, sent.data(), static_cast<std::int32_t>(sent.size()));
    REQUIRE(host.plan_topk(ids, plan));
    REQUIRE(s.scalars->fill_count == static_cast<std::int32_t>(plan.fills.size()));
    REQUIRE(to_vector(s.fills, s.scalars->fill_count) == entries(plan.fills));
    REQUIRE(to_vector(s.evictions, s.scalars->eviction_count) == entries(plan.evictions));
    REQUIRE(to_vector(s.resident_map, E) == Ids(host.resident_map().begin(), host.resident_map().end()));
    for (std::int32_t e = 0; e < E; ++e) {
      REQUIRE(s.expert_crf[e] == host.policy().crf_q32(ExpertId(e)));
      REQUIRE(s.expert_last[e] == host.policy().last(ExpertId(e)));
    }
    if (!plan.evictions.empty() && oldest >= crf_pow_table_size) ++evictions_past_table;
    for (const auto& v : plan.evictions) {
      const std::uint32_t age = clk - host.policy().last(v.expert);
      oldest_victim_age = std::max(oldest_victim_age, age);
      if (age >= crf_pow_table_size) ++victims_past_table;
    }
    // A prefetch now and then ranks the same keys from its own search.
    if (step % 97 == 0) {
      const Ids predicted = {6 + static_cast<std::int32_t>(rng() % (E - 6)), 6 + static_cast<std::int32_t>(rng() % (E - 6))};
      PrefetchPlan hp;
      REQUIRE(host.plan_prefetch(predicted, 2, 1, hp));
      plan_prefetch<DeviceCrf>(b, s, predicted.data(), 2, 2, 1);
      REQUIRE(to_vector(s.fills, s.scalars->fill_count) == entries(hp.fills));
      REQUIRE(to_vector(s.evictions, s.scalars->eviction_count) == entries(hp.evictions));
    }
  }
  CHECK((*s.error_word & plan_error_bad_state) == 0u);
  MESSAGE("evicting forwards with a resident idle >= ", crf_pow_table_size, " forwards: ", evictions_past_table,
          "; victims idle that long: ", victims_past_table, ", the oldest idle ", oldest_victim_age, " forwards");
  // The trace reaches what it is for: keys past the table rank residents and decide victims.
  CHECK(evictions_past_table > 1000);
  CHECK(victims_past_table >= 12);
  CHECK(oldest_victim_age >= 2000);
}
