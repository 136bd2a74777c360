#pragma once
// Test support shared by the device planner's host test (test_device_plan.cpp) and GPU test
// (gpu/test_device_plan.cu): the host-side views they compare the device state with.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "expert_cache/planning/device_plan/state.hpp"
#include "expert_cache/planning/forward_planner.hpp"

namespace expert_cache::test {

template <class T>
std::vector<T> to_vector(PlanSpan<T> s, std::int32_t n) {
  return std::vector<T>(s.data, s.data + n);
}

inline std::vector<PlanEntry> entries(const std::vector<SlotFill>& v) {
  std::vector<PlanEntry> out;
  for (const auto& f : v) out.push_back({f.expert.value, f.slot.value});
  return out;
}
inline std::vector<PlanEntry> entries(const std::vector<SlotEviction>& v) {
  std::vector<PlanEntry> out;
  for (const auto& f : v) out.push_back({f.expert.value, f.slot.value});
  return out;
}

// Sorted unique valid ids, split into ascending groups of <= capacity (planning/split.hpp's expert split).
inline std::vector<std::vector<std::int32_t>> host_groups(const std::vector<std::int32_t>& ids,
                                                          std::int32_t num_experts, std::int32_t capacity) {
  std::set<std::int32_t> u;
  for (std::int32_t id : ids) {
    if (id >= 0 && id < num_experts) u.insert(id);
  }
  const std::vector<std::int32_t> all(u.begin(), u.end());
  std::vector<std::vector<std::int32_t>> groups;
  for (std::size_t b = 0; b < all.size(); b += static_cast<std::size_t>(capacity)) {
    const std::size_t e = std::min(all.size(), b + static_cast<std::size_t>(capacity));
    groups.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(b), all.begin() + static_cast<std::ptrdiff_t>(e));
  }
  return groups;
}

// A forward served in rounds (DevicePlanState::forward_in_rounds): its unique valid ids with the
// experts resident before it first, each part ascending, in groups of <= capacity.
inline std::vector<std::vector<std::int32_t>> host_groups_residents_first(const std::vector<std::int32_t>& ids,
                                                                          std::span<const std::int32_t> resident_map,
                                                                          std::int32_t capacity) {
  const auto E = static_cast<std::int32_t>(resident_map.size());
  std::set<std::int32_t> u;
  for (std::int32_t id : ids) {
    if (id >= 0 && id < E) u.insert(id);
  }
  std::vector<std::int32_t> all;
  for (const bool resident : {true, false}) {
    for (const std::int32_t e : u) {
      if ((resident_map[static_cast<std::size_t>(e)] >= 0) == resident) all.push_back(e);
    }
  }
  std::vector<std::vector<std::int32_t>> groups;
  for (std::size_t b = 0; b < all.size(); b += static_cast<std::size_t>(capacity)) {
    const std::size_t e = std::min(all.size(), b + static_cast<std::size_t>(capacity));
    groups.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(b), all.begin() + static_cast<std::ptrdiff_t>(e));
  }
  return groups;
}

// Ids the planner counts as bad: neither padding (-1) nor in [0, num_experts).
inline std::int64_t count_bad(const std::vector<std::int32_t>& ids, std::int32_t num_experts) {
  return std::count_if(ids.begin(), ids.end(),
                       [&](std::int32_t id) { return id != -1 && (id < 0 || id >= num_experts); });
}

// Random routing ids of `tokens` tokens x top_k distinct experts (half from a hot eighth of the
// experts), each id replaced by padding (-1) with probability pad_p, else by one of `bad_values`
// with probability bad_p; shuffled. The same rng draws give the same ids in every test.
inline std::vector<std::int32_t> random_plan_ids(std::mt19937_64& rng, std::int32_t E, std::int32_t top_k,
                                                 std::int32_t tokens, double pad_p, double bad_p,
                                                 std::span<const std::int32_t> bad_values) {
  std::uniform_int_distribution<std::int32_t> any(0, E - 1);
  std::uniform_int_distribution<std::int32_t> hot(0, std::max(1, E / 8) - 1);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<std::int32_t> ids;
  for (std::int32_t t = 0; t < tokens; ++t) {
    std::set<std::int32_t> row;
    while (static_cast<std::int32_t>(row.size()) < top_k) row.insert(u(rng) < 0.5 ? hot(rng) : any(rng));
    for (std::int32_t id : row) {
      if (u(rng) < pad_p) id = -1;
      else if (u(rng) < bad_p) id = bad_values[rng() % bad_values.size()];
      ids.push_back(id);
    }
  }
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

}  // namespace expert_cache::test
