#pragma once
/// What DeviceExpertCache asks of the executor that runs its device steps on one runtime: the
/// device_plan_executor concept, the traits that name a runtime's executor (DevicePlanExecutorFor,
/// DevicePlanExecutorOf) and a wide forward's staging (DeviceWideStaging), and the recovery steps
/// every executor runs. The traits are customisation points: the run-time-selected cache and test
/// runtimes specialise them.
#include <concepts>
#include <cstddef>
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/planning/device_plan.hpp"
#include "expert_cache/staging/copy_staging.hpp"  // CopyStream

namespace expert_cache::inline v0 {

// What an executor does for the cache, on the stream the core hands it. `plan_enqueued` tells
// the cache whether the state may have changed (a failure after it leaves slots unfilled).
template <class X>
concept device_plan_executor = requires(X& x, const X& cx, typename X::Stream s, const std::int32_t* ids,
                                        std::int32_t n, bool& planned, bool in_rounds, std::int32_t width) {
  { cx.state() } -> std::same_as<const DevicePlanState&>;
  { cx.sanitized_ids() } -> std::same_as<std::int32_t*>;
  // in_rounds: the caller serves every group of this forward (DeviceForward::in_rounds), in
  // groups of `width` experts (0: the capacity).
  { x.plan_forward_fill(s, ids, n, planned, in_rounds, width) } -> std::same_as<Status>;
  { x.plan_group_fill(s, n, planned) } -> std::same_as<Status>;
  { x.invalidate(s, n) } -> std::same_as<Status>;
  { x.prefetch(s, ids, n, n, std::uint32_t{1}, planned) } -> std::same_as<Status>;
  { x.drop_fills(s) } -> std::same_as<Status>;
  { x.drop_missing(s) } -> std::same_as<Status>;  // plan_drop_missing (fill_by_consumer's recovery)
  { x.join_fills() } -> std::same_as<Status>;  // overlap: order later work after the last fill
  { cx.overlap() } -> std::same_as<bool>;
  { cx.stats() } -> std::same_as<DevicePlanStats>;
  { x.take_error_word() } -> std::same_as<std::uint32_t>;
  { cx.device_bytes() } -> std::same_as<std::size_t>;
};

// Specialised per runtime: `type` is the executor (SimPlanExecutor in device_cache/sim_executor.hpp;
// CudaPlanExecutor in device_cache/cuda_executor.cuh).
template <class Runtime>
struct DevicePlanExecutorFor;

// The executor of `Runtime` for `Policy`: DevicePlanExecutorFor<Runtime>::type for DeviceLru,
// its with_policy<Policy> for the others (a runtime without it plans LRU only).
template <class Runtime, class Policy>
struct DevicePlanExecutorOf {
  using type = typename DevicePlanExecutorFor<Runtime>::template with_policy<Policy>;
};
template <class Runtime>
struct DevicePlanExecutorOf<Runtime, DeviceLru> {
  using type = typename DevicePlanExecutorFor<Runtime>::type;
};

// The staging policy of a wide forward's round copies for `Policy` on `Runtime`: CopyStream (plain
// copies, coalesced and batched by the rounds). make() builds the one a cache holds. The
// run-time-selected cache (any/any_cache.hpp) names its host caches' staging type, holding
// CopyStream: the same copies, and the rounds' code is then shared with its host providers'.
template <class Policy, class Runtime>
struct DeviceWideStaging {
  using type = CopyStream;
  [[nodiscard]] static type make() noexcept { return {}; }
};

namespace detail {
// Drops every expert of the state's fill list (the recovery after a plan whose fill could not
// be enqueued: those slots never received their bytes). Runs on the device like any plan step.
template <plan_block Block>
EXPERT_CACHE_HOST_DEVICE void plan_drop_fills(Block& b, const DevicePlanState& s) noexcept {
  if (!plan_state_ok(s)) return;
  const std::int32_t n = s.scalars->fill_count;
  for (std::int32_t i = 0; i < n && i < s.capacity; ++i) plan_invalidate(b, s, s.fills[i].expert);
}
// Drops every miss of the last planned group (its experts flagged in `missing`): the recovery
// when a consumer that fills from host (fill_by_consumer) did not run. Read from the group's
// expert list, not the fill list, which a later prefetch rewrites.
template <plan_block Block>
EXPERT_CACHE_HOST_DEVICE void plan_drop_missing(Block& b, const DevicePlanState& s) noexcept {
  if (!plan_state_ok(s)) return;
  const std::int32_t n = s.scalars->prev_count;
  for (std::int32_t i = 0; i < n && i < s.capacity; ++i) {
    const std::int32_t e = s.prev_forward[i];
    if (e >= 0 && e < s.num_experts && s.missing[e] != 0) plan_invalidate(b, s, e);
  }
}
}  // namespace detail

}  // namespace expert_cache::inline v0
