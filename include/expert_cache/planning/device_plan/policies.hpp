#pragma once
/// The device policies, each a host policy of eviction/ run on the device plan's state with the same decisions:
/// DeviceLru = Lru (eviction/lru.hpp), DeviceLfru = Lfru (eviction/lfru.hpp), DeviceCrf = Crf (eviction/crf.hpp), and
/// DeviceRuntimePolicy, which plans with whichever of the three the state names.
//
// Named Device* for what differs from the host classes: a device policy is a tag, a template
// argument of every planning function, the kernels and DeviceExpertCache, and its state lives
// in DevicePlanState's arrays (state.hpp), not in an object of its own:
//   DeviceLru   Lru's list becomes a recency tick per slot (group.hpp says why that is exact).
//   DeviceLfru  Lfru's request count and insertion order per slot (slot_freq, slot_order); its
//               score freq / age compared as the bits of a double (lfru_key_of below).
//   DeviceCrf   Crf's CRF and last request per expert (kept after eviction, like Crf) and its
//               prior bias, decayed through the power table of eviction/crf_math.hpp.
//   DeviceRuntimePolicy  every branch on the policy reads DevicePlanState::policy, so one
//               instantiation plans with any of the three (host planning only, see there).
// Here too: the victim keys (PlanKey, ScoreKey) and the score and touch functions the planning
// steps share. plan_group_from (group.hpp) says how the score policies search.
#include <bit>
#include <concepts>
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/eviction/crf_math.hpp"
#include "expert_cache/planning/device_plan/state.hpp"

namespace expert_cache::inline v0 {

// Ordering key of a resident: (tick, slot). Ticks of residents are distinct; the slot only
// makes the order total should a corrupted state repeat one.
struct PlanKey {
  std::uint64_t tick = ~std::uint64_t{0};
  std::int32_t slot = 0x7fffffff;
  EXPERT_CACHE_HOST_DEVICE friend constexpr bool operator<(const PlanKey& a, const PlanKey& b) noexcept {
    return a.tick < b.tick || (a.tick == b.tick && a.slot < b.slot);
  }
};

// Ordering key of a resident under a score policy: (score, tie, slot), the lowest is the victim.
// DeviceLfru: score = the bits of the double freq / age (positive doubles order like their bits),
// tie = insertion tick. DeviceCrf: score = CRF + bias, tie = expert id.
struct ScoreKey {
  std::uint64_t score = ~std::uint64_t{0};
  std::uint64_t tie = ~std::uint64_t{0};
  std::int32_t slot = 0x7fffffff;
  EXPERT_CACHE_HOST_DEVICE friend constexpr bool operator<(const ScoreKey& a, const ScoreKey& b) noexcept {
    return a.score < b.score || (a.score == b.score && (a.tie < b.tie || (a.tie == b.tie && a.slot < b.slot)));
  }
};

// The device policies, chosen at compile time (a template argument of every planning function,
// the kernels and DeviceExpertCache; DeviceLru by default). Each takes exactly the decisions of
// its host policy (`host` names it): DeviceLru = Lru, DeviceLfru = Lfru (vLLM's LFRU), DeviceCrf =
// Crf (LRFU's CRF order per layer, eviction/crf.hpp).
struct DeviceLru {
  static constexpr DevicePolicyKind kind = DevicePolicyKind::lru;
  static constexpr const char* name = "lru";
  static constexpr bool free_highest_first = false;  // Lru's FreeSlotOrder::lowest_first
};
struct DeviceLfru {
  static constexpr DevicePolicyKind kind = DevicePolicyKind::lfru;
  static constexpr const char* name = "lfru";
  static constexpr bool free_highest_first = true;  // Lfru's FreeSlotOrder::highest_first
};
struct DeviceCrf {
  static constexpr DevicePolicyKind kind = DevicePolicyKind::crf;
  static constexpr const char* name = "crf";
  static constexpr bool free_highest_first = false;
};
// The policy chosen at run time: every branch a static policy resolves at compile time reads
// the state's kind (DevicePlanState::policy) instead, so ONE instantiation of the planning code
// plans with any of the three, with the same decisions. For host planning, where each
// instantiation costs seconds of a user's -O2 build (the SimRuntime executor behind
// make_expert_cache); the kernels keep the static policies, their branches resolved at
// compile time.
struct DeviceRuntimePolicy {
  static constexpr const char* name = "runtime";
};
template <class P>
concept device_plan_policy = std::same_as<P, DeviceRuntimePolicy> || requires {
  { P::kind } -> std::convertible_to<DevicePolicyKind>;
  { P::free_highest_first } -> std::convertible_to<bool>;
};

namespace detail {
template <class Policy>
inline constexpr bool plan_kind_fixed = !std::same_as<Policy, DeviceRuntimePolicy>;
template <class Policy>
struct PlanFixedKind {
  static constexpr DevicePolicyKind value = Policy::kind;
};
template <>
struct PlanFixedKind<DeviceRuntimePolicy> {
  static constexpr DevicePolicyKind value = DevicePolicyKind::lru;  // never read (plan_kind_fixed is false)
};
template <device_plan_policy Policy>
EXPERT_CACHE_HOST_DEVICE constexpr bool plan_free_highest_first(DevicePolicyKind state_kind) noexcept {
  if constexpr (std::same_as<Policy, DeviceRuntimePolicy>) {
    return state_kind == DeviceLfru::kind ? DeviceLfru::free_highest_first
           : state_kind == DeviceCrf::kind ? DeviceCrf::free_highest_first
                                           : DeviceLru::free_highest_first;
  } else {
    (void)state_kind;
    return Policy::free_highest_first;
  }
}
}  // namespace detail

// Whether a step of Policy on `state` plans with kind K. For a static policy a constant
// expression (`true ? constant : ...`), so each branch on it resolves at compile time and the
// kernels' code is what `if constexpr` on Policy::kind gives; for DeviceRuntimePolicy the
// state's kind. A macro because a function's result is never a constant expression once an
// argument is a run-time value.
#define EXPERT_CACHE_PLAN_KIND_IS(Policy, state, K)                                                        \
  (::expert_cache::detail::plan_kind_fixed<Policy> ? ::expert_cache::detail::PlanFixedKind<Policy>::value == (K) \
                                                   : (state).policy == (K))

namespace detail {

// The bits of a positive double, ordered like its value.
EXPERT_CACHE_HOST_DEVICE inline std::uint64_t double_bits(double x) noexcept {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint64_t>(__double_as_longlong(x));
#else
  return std::bit_cast<std::uint64_t>(x);
#endif
}

// Lfru's score freq / (clock - last + 1) as Lfru::victim_double divides it (IEEE, round to
// nearest on both sides; the explicit intrinsic keeps nvcc from approximating). Below clock 2^25
// Lfru compares by cross-multiplication instead, which orders exactly like these doubles
// (eviction/lfru.hpp says why), so one comparison serves both of its paths.
EXPERT_CACHE_HOST_DEVICE inline ScoreKey lfru_key_of(std::uint64_t freq, std::uint64_t order, std::int32_t slot,
                                                     std::uint64_t clock, std::uint64_t last) noexcept {
  const double f = static_cast<double>(freq);
  const double a = static_cast<double>(clock - last + 1);
#if defined(__CUDA_ARCH__)
  const double q = __ddiv_rn(f, a);
#else
  const double q = f / a;
#endif
  return ScoreKey{double_bits(q), order, slot};
}
EXPERT_CACHE_HOST_DEVICE inline ScoreKey lfru_key(const DevicePlanState& s, std::int32_t slot, std::uint64_t clock,
                                                  std::uint64_t last) noexcept {
  return lfru_key_of(s.slot_freq[slot], s.slot_order[slot], slot, clock, last);
}

// Crf's victim key of resident `owner` (in `slot`) at clock `clk`: CRF + prior bias, then id.
EXPERT_CACHE_HOST_DEVICE inline ScoreKey crf_key(const DevicePlanState& s, std::int32_t slot, std::int32_t owner,
                                                 std::uint32_t clk) noexcept {
  const std::uint64_t crf = crf_at_table(s.crf_pow.data, s.expert_crf[owner], s.expert_last[owner], clk);
  return ScoreKey{crf_add_sat(crf, s.expert_bias[owner]), static_cast<std::uint64_t>(owner), slot};
}

// Crf::touch: one request of expert e at clock clk.
EXPERT_CACHE_HOST_DEVICE inline void crf_touch(const DevicePlanState& s, std::int32_t e, std::uint32_t clk) noexcept {
  s.expert_crf[e] = crf_at_table(s.crf_pow.data, s.expert_crf[e], s.expert_last[e], clk) + crf_one;
  s.expert_last[e] = clk;
}

}  // namespace detail

}  // namespace expert_cache::inline v0
