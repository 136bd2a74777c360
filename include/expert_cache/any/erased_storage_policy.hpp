#pragma once
/// The storage arrangement and the device policy of AnyExpertCache as run-time values inside
/// its one host cache type and one device cache type (detail::AnyArrangementStorage,
/// detail::AnyDevicePlanExecutor), and how make_expert_cache hands them the choice.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

#include "expert_cache/any/config.hpp"
#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/device_cache/device_cache.hpp"
#include "expert_cache/planning/device_plan.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"
#include "expert_cache/storage/copy_region.hpp"
#include "expert_cache/storage/slot_storage.hpp"

namespace expert_cache::inline v0 {

namespace detail {

// ---- storage and device policy chosen at run time --------------------------------------------
// The factory builds ONE host cache type and ONE device cache type: the storage arrangement and
// the device policy are run-time values inside them (AnyArrangementStorage, AnyDevicePlanExecutor),
// as the eviction and staging policies are (AnyPolicy, AnyStaging). Each instantiation of a static
// cache costs seconds of -O2 per translation unit, and the storages and device policies change
// only how the slots are laid out (copy regions) and what the plan code runs, not the caches'
// own code.
//
// The static caches construct their storage from (rt, shape, tensors, memory) and their plan
// executor from (rt, sizes, copy regions, options): neither constructor has a parameter for a
// choice made at run time. make_expert_cache names the choice for the one construction it runs,
// on its own thread (AnyChoiceScope); the erased storage and executor read it in their
// constructors and refuse to be built outside the factory.
struct AnyChoice {
  std::size_t storage = 0;        // index into AnyStorages
  std::size_t device_policy = 0;  // index into AnyDevicePolicies
};
inline thread_local const AnyChoice* any_choice_pending = nullptr;

class AnyChoiceScope {
 public:
  explicit AnyChoiceScope(const AnyChoice& choice) noexcept : outer_(std::exchange(any_choice_pending, &choice)) {}
  ~AnyChoiceScope() { any_choice_pending = outer_; }
  AnyChoiceScope(const AnyChoiceScope&) = delete;
  AnyChoiceScope& operator=(const AnyChoiceScope&) = delete;

 private:
  const AnyChoice* outer_;
};

inline const AnyChoice& pending_any_choice(const char* what) {
  if (any_choice_pending == nullptr) {
    throw Error(ErrorCode::internal, std::string(what) + " is built by make_expert_cache only (no choice pending)");
  }
  return *any_choice_pending;
}

// Constructs alternative `which` of a variant in place (the variant is returned as a prvalue, so
// the alternative is never moved: neither storages nor executors need to be movable).
template <class Variant, std::size_t I = 0, class... Args>
Variant emplace_alternative(std::size_t which, Args&... args) {
  if constexpr (I + 1 < std::variant_size_v<Variant>) {
    if (which != I) return emplace_alternative<Variant, I + 1>(which, args...);
  } else if (which != I) {
    throw Error(ErrorCode::internal,
                join({"make_expert_cache: choice ", DecimalText(which), " outside the erased list"}));
  }
  return Variant(std::in_place_index<I>, args...);
}

// Calls f on the held alternative (an index switch: no bad_variant_access path).
template <std::size_t I = 0, class Variant, class F>
decltype(auto) with_alternative(Variant& v, F&& f) {
  if constexpr (I + 1 < std::variant_size_v<std::remove_const_t<Variant>>) {
    if (v.index() != I) return with_alternative<I + 1>(v, std::forward<F>(f));
  }
  return f(*std::get_if<I>(&v));
}

// The arrangements of the erased storages, in AnyStorages' order.
template <class... Tags>
constexpr auto arrangements_of(TypeList<Tags...>) noexcept {
  return std::array<std::pair<HostArrangement, SlotArrangement>, sizeof...(Tags)>{
      std::pair{Tags::template type<RuntimeArchetype>::host_arrangement,
                Tags::template type<RuntimeArchetype>::slot_arrangement}...};
}

// A storage whose arrangement (tensor_major, expert_major, expert_major_host) is chosen at run
// time: the storages' one implementation with the arrangement as a value (BasicSlotStorage's
// Dynamic form), built with the chosen storage's arrangement and the same arguments, so it
// allocates, validates and lays out the slots exactly as the chosen static storage does, and
// one instantiation serves all three.
template <allocating_runtime R>
class AnyArrangementStorage
    : private BasicSlotStorage<R, HostArrangement::tensor_major, SlotArrangement::per_tensor, true> {
  using Base = BasicSlotStorage<R, HostArrangement::tensor_major, SlotArrangement::per_tensor, true>;

 public:
  // The chosen arrangement's name is AnyExpertCache::storage(); the factory never lets the
  // static cache log this one.
  static constexpr std::string_view name = "any_arrangement";

  AnyArrangementStorage(R& rt, CacheShape shape, const ExpertTensorBytes& tensors, const StorageMemory& memory = {})
      : AnyArrangementStorage(rt, shape, tensors, memory, arrangement(pending_any_choice("AnyArrangementStorage").storage)) {}

  // The storage accessors the caches and staging policies use.
  using Base::copy_regions;
  using Base::host_bytes;
  using Base::host_tensor;
  using Base::slot_bytes;
  using Base::slot_tensor;
  using Base::tensors;

 private:
  AnyArrangementStorage(R& rt, CacheShape shape, const ExpertTensorBytes& tensors, const StorageMemory& memory,
                        std::pair<HostArrangement, SlotArrangement> a)
      : Base(rt, shape, tensors, memory, a.first, a.second) {}
  static std::pair<HostArrangement, SlotArrangement> arrangement(std::size_t which) {
    constexpr auto arrangements = arrangements_of(AnyStorages{});
    if (which >= arrangements.size()) {
      throw Error(ErrorCode::internal,
                  join({"make_expert_cache: choice ", DecimalText(which), " outside the erased list"}));
    }
    return arrangements[which];
  }
};

// DeviceExpertCache's policy parameter for a policy chosen at run time: the cache's executor is
// then AnyDevicePlanExecutor (below), which holds the chosen policy's own executor, and every plan
// runs that policy's code. These members only satisfy device_plan_policy; no plan reads them.
struct AnyDevicePolicy {
  static constexpr DevicePolicyKind kind = DevicePolicyKind::lru;
  static constexpr const char* name = "any";
  static constexpr bool free_highest_first = false;
};

template <class Runtime, class List>
struct DeviceExecutorVariantOf;
template <class Runtime, class... Ps>
struct DeviceExecutorVariantOf<Runtime, TypeList<Ps...>> {
  using type = std::variant<typename DevicePlanExecutorOf<Runtime, Ps>::type...>;
};

// The runtime's plan executor for the device policy chosen at run time: one call forwarded per
// step (a plan is a kernel launch or a simulated op; the switch is noise beside it).
template <class Runtime>
class AnyDevicePlanExecutor {
  using Held = typename DeviceExecutorVariantOf<Runtime, AnyDevicePolicies>::type;
  using First = std::variant_alternative_t<0, Held>;

 public:
  using Stream = typename Runtime::Stream;

  // The runtime's resolution of FillEngine::automatic (the same for every policy).
  static DeviceCacheOptions resolve_fill_engine(DeviceCacheOptions o, std::uint64_t expert_bytes)
    requires requires { First::resolve_fill_engine(o, expert_bytes); }
  {
    return First::resolve_fill_engine(std::move(o), expert_bytes);
  }

  AnyDevicePlanExecutor(Runtime& rt, std::int32_t num_experts, std::int32_t capacity, std::int32_t max_ids,
                        const CopyRegions& regions, const DeviceCacheOptions& options)
      : held_(emplace_alternative<Held>(pending_any_choice("AnyDevicePlanExecutor").device_policy, rt, num_experts,
                                        capacity, max_ids, regions, options)) {}

  [[nodiscard]] const DevicePlanState& state() const noexcept {
    return with_alternative(held_, [](const auto& x) -> const DevicePlanState& { return x.state(); });
  }
  [[nodiscard]] std::int32_t* sanitized_ids() const noexcept {
    return with_alternative(held_, [](const auto& x) { return x.sanitized_ids(); });
  }
  Status plan_forward_fill(Stream s, const std::int32_t* ids, std::int32_t n, bool& planned, bool in_rounds,
                           std::int32_t round_width) noexcept {
    return with_alternative(held_, [&](auto& x) { return x.plan_forward_fill(s, ids, n, planned, in_rounds, round_width); });
  }
  Status plan_group_fill(Stream s, std::int32_t g, bool& planned) noexcept {
    return with_alternative(held_, [&](auto& x) { return x.plan_group_fill(s, g, planned); });
  }
  Status invalidate(Stream s, std::int32_t expert) noexcept {
    return with_alternative(held_, [&](auto& x) { return x.invalidate(s, expert); });
  }
  Status prefetch(Stream s, const std::int32_t* ids, std::int32_t n, std::int32_t max_fills, std::uint32_t expires_after,
                  bool& planned, bool evict_last_forward = false) noexcept {
    return with_alternative(held_, [&](auto& x) {
      return x.prefetch(s, ids, n, max_fills, expires_after, planned, evict_last_forward);
    });
  }
  Status drop_fills(Stream s) noexcept {
    return with_alternative(held_, [&](auto& x) { return x.drop_fills(s); });
  }
  Status drop_missing(Stream s) noexcept {
    return with_alternative(held_, [&](auto& x) { return x.drop_missing(s); });
  }
  Status join_fills() noexcept {
    return with_alternative(held_, [](auto& x) { return x.join_fills(); });
  }
  [[nodiscard]] bool overlap() const noexcept {
    return with_alternative(held_, [](const auto& x) { return x.overlap(); });
  }
  [[nodiscard]] DevicePlanStats stats() const noexcept {
    return with_alternative(held_, [](const auto& x) { return x.stats(); });
  }
  std::uint32_t take_error_word() noexcept {
    return with_alternative(held_, [](auto& x) { return x.take_error_word(); });
  }
  [[nodiscard]] std::size_t device_bytes() const noexcept {
    return with_alternative(held_, [](const auto& x) { return x.device_bytes(); });
  }

 private:
  Held held_;
};

// Whether the runtime's erased device executor has the overlapped fill (AnyCacheConfig::overlap).
template <class Runtime>
inline constexpr bool any_device_overlap = true;

// SimRuntime plans on the host: ONE executor, whose policy is a run-time value of its state
// (DeviceRuntimePolicy), instead of one per policy. The kernels of a GPU runtime need their
// policy at compile time; the host planning code does not, and each of its instantiations costs
// a user's -O2 build seconds. Without the overlapped fill, for the same reason: make_expert_cache
// refuses AnyCacheConfig::overlap on SimRuntime (the static DeviceExpertCache models it).
template <>
inline constexpr bool any_device_overlap<SimRuntime> = false;

template <>
class AnyDevicePlanExecutor<SimRuntime> : public BasicSimPlanExecutor<DeviceRuntimePolicy, false> {
 public:
  AnyDevicePlanExecutor(SimRuntime& rt, std::int32_t num_experts, std::int32_t capacity, std::int32_t max_ids,
                        const CopyRegions& regions, const DeviceCacheOptions& options)
      : BasicSimPlanExecutor<DeviceRuntimePolicy, false>(rt, num_experts, capacity, max_ids, regions, options,
                                                         kind_of(pending_any_choice("AnyDevicePlanExecutor").device_policy)) {}

 private:
  static DevicePolicyKind kind_of(std::size_t which) {
    constexpr auto kinds = []<class... Ps>(TypeList<Ps...>) {
      return std::array<DevicePolicyKind, sizeof...(Ps)>{Ps::kind...};
    }(AnyDevicePolicies{});
    if (which >= kinds.size()) {
      throw Error(ErrorCode::internal,
                  join({"make_expert_cache: device policy ", DecimalText(which), " outside the erased list"}));
    }
    return kinds[which];
  }
};

}  // namespace detail

template <class Runtime>
struct DevicePlanExecutorOf<Runtime, detail::AnyDevicePolicy> {
  using type = detail::AnyDevicePlanExecutor<Runtime>;
};

}  // namespace expert_cache::inline v0
