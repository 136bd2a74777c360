#pragma once
// Test support shared by the device planner's host test (test_device_plan.cpp) and GPU test
// (gpu/test_device_plan.cu): the host-side views they compare the device state with.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

#include "expert_cache/planner.hpp"
#include "expert_cache/planning/device_plan.hpp"

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

// Sorted unique valid ids, split into ascending groups of <= capacity (split.hpp's expert split).
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

// Ids the planner counts as bad: neither padding (-1) nor in [0, num_experts).
inline std::int64_t count_bad(const std::vector<std::int32_t>& ids, std::int32_t num_experts) {
  return std::count_if(ids.begin(), ids.end(),
                       [&](std::int32_t id) { return id != -1 && (id < 0 || id >= num_experts); });
}

}  // namespace expert_cache::test
