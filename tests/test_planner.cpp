#include <doctest/doctest.h>

#include <vector>

#include "expert_cache/eviction/lru.hpp"
#include "expert_cache/planner.hpp"

using namespace expert_cache;

TEST_CASE("planner smoke: hits, misses, maps") {
  ForwardPlanner<Lru> p(CacheShape{8, 2}, 1);
  ForwardPlan plan;
  const std::vector<std::int32_t> a{3, -1, 5, 3};
  REQUIRE(p.plan_topk(a, plan).ok());
  CHECK(plan.misses == 2);
  CHECK(plan.fills.size() == 2);
  CHECK(p.forward_map()[3] == plan.fills[0].slot.value);
}
