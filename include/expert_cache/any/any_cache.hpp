#pragma once
// AnyExpertCache<Runtime>: an expert cache whose provider, eviction policy, staging policy and
// storage are chosen at run time by name (an engine's config knob), made by
//
//   Result<AnyExpertCache<Runtime>> make_expert_cache(runtime, AnyCacheConfig)
//
// and used like ExpertCache: prepare / prepare_unique / prepare_wide / invalidate / stats, the same
// ForwardView.
// The static templates (ExpertCache, RowCache, WholeExpertCache, DeviceExpertCache) stay the
// primary API; this is a thin wrapper that owns one of them behind one virtual call.
//
// What is erased and what is not: the RUNTIME stays a template parameter. An engine is built
// for one runtime (CudaRuntime in a CUDA engine, SimRuntime in tests), its streams are that
// runtime's streams (cudaStream_t) and it never switches at run time; erasing the stream too
// would cost a cast per call and let a SimRuntime stream reach a CUDA cache. What a config
// file picks (provider, policy, staging, storage, the layout's sizes) is erased, each choice
// behind its own interface so that it costs once, not once per combination: the provider kind
// behind a virtual interface (AnyCacheBase, one model per kind); the eviction policy, the
// staging policy, the storage arrangement and the device policy as values inside the static
// cache (AnyPolicy, AnyStaging, detail::AnyArrangementStorage, detail::AnyDevicePlanExecutor).
// The factory instantiates one host cache and one device cache.
//
// Cost: prepare() is one virtual call into the static cache's prepare() (no allocation; the
// returned ForwardView is the static one's) planning with AnyPolicy, which tells the held
// policy a forward's hits under one dispatch. bench/programs/bench_planner.cpp measures it
// (docs/benchmarks.md).
//
// Compiled mode (docs/any_cache.md): with EXPERT_CACHE_SEPARATE_COMPILATION defined, the
// SimRuntime factory (and, in any/any_cache_cuda.cuh, the CudaRuntime one) is only declared here and
// instantiated once, in src/any_cache_sim.cpp (any_cache_cuda.cu).
//
// Names (docs/any_cache.md):
//   provider  row (default: tensor_major + lru + copy_stream, the row provider)
//             cached (expert_major + lfru + copy_stream: vLLM's cached provider's hit/miss
//                     semantics, one transfer per miss; staging "inline" for its inline copies)
//             device (DeviceExpertCache: planned on the device, staging inline only; ids passed
//                     to prepare() are DEVICE memory; needs the runtime's plan executor)
//   policy    lru lfru sieve s3fifo arc wtinylfu lrfu layershare crf   (belady: offline only, refused)
//             device provider: lru lfru crf (DeviceLru / DeviceLfru / DeviceCrf; lfru and crf
//             on storage tensor_major only)
//   staging   inline copy_stream batched   (+ gather with CudaRuntime: include any/any_cache_cuda.cuh)
//   storage   tensor_major expert_major expert_major_host
// An empty policy/staging/storage takes the provider's default. Unknown names, impossible
// combinations and bad sizes are refused by the factory with a Status naming the valid choices;
// nothing is allocated for a refused name.
//
// Caller memory: config.options.memory (StorageMemory: the engine's own host tensors / host pool
// and slot workspace) reaches the storage of every provider unchanged, validated as the static
// cache validates it (a bad span is refused with the static cache's error, nothing allocated).
//
// Host tier: compiles with g++ alone. CUDA translation units include
// expert_cache/any/any_cache_cuda.cuh instead (adds gather and the CUDA device planner) BEFORE any
// use of make_expert_cache<CudaRuntime>.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "expert_cache/cache/expert_cache.hpp"
#include "expert_cache/base/concepts.hpp"
#include "expert_cache/device_cache/device_cache.hpp"
#include "expert_cache/eviction/any_policy.hpp"
#include "expert_cache/eviction/pool_layout.hpp"
#include "expert_cache/planning/device_plan.hpp"
#include "expert_cache/planning/split.hpp"
#include "expert_cache/staging/any_staging.hpp"
#include "expert_cache/staging/copy_staging.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/storage/slot_storage.hpp"
#include "expert_cache/cache/wide.hpp"

namespace expert_cache::inline v0 {

// A layout's name and sizes, taken from any expert_layout (its validate() result is kept and
// reported by the factory, which never throws for it).
struct AnyLayout {
  std::string name = "explicit";
  ExpertTensorBytes tensors{};
  Status validation{};

  template <expert_layout L>
  [[nodiscard]] static AnyLayout of(const L& layout) {
    return AnyLayout{std::string(L::name), layout.tensors(), layout.validate()};
  }
  [[nodiscard]] static AnyLayout explicit_bytes(const ExpertTensorBytes& tensors) {
    return AnyLayout{"explicit", tensors, Status()};
  }
};

struct AnyCacheConfig {
  std::string provider = "row";  // row | cached | device
  std::string policy;            // "" = the provider's default
  std::string staging;           // "" = the provider's default
  std::string storage;           // "" = the provider's default
  AnyLayout layout;
  // num_experts, capacity, top_k, staging_ring, label, log (one line at construction, naming
  // the provider and every choice), stats_callback/stats_every (host providers), memory (the
  // caller's host spans / host pool and slot workspace, any provider; kept alive by the caller).
  CacheOptions options;
  PoolLayout pool{};           // lrfu, layershare: experts_per_layer of a pool shared by layers
  std::int32_t max_ids = 0;    // device: the largest prepare() (tokens * top_k); required > 0
  bool fused_plan_fill = true; // device on CUDA: plan + first fill in one kernel
  // device: the engine that moves fills (DeviceCacheOptions::fill_engine) and a stored link
  // profile for automatic (DeviceCacheOptions::link_profile).
  FillEngine fill_engine = FillEngine::automatic;
  std::optional<LinkProfile> link_profile;
};

inline constexpr std::array<std::string_view, 3> any_cache_providers = {"row", "cached", "device"};

namespace detail {

template <class... Ts>
struct TypeList {
  static constexpr std::size_t size = sizeof...(Ts);
};

template <template <class> class S>
struct StorageTag {
  template <class R>
  using type = S<R>;
  static constexpr std::string_view name = S<RuntimeArchetype>::name;
};

using AnyStorages =
    TypeList<StorageTag<TensorMajorStorage>, StorageTag<ExpertMajorStorage>, StorageTag<ExpertMajorHostStorage>>;

// The device provider's policies, by P::name.
using AnyDevicePolicies = TypeList<DeviceLru, DeviceLfru, DeviceCrf>;
inline constexpr std::array<std::string_view, 3> any_device_policy_names = {DeviceLru::name, DeviceLfru::name,
                                                                            DeviceCrf::name};

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
                  bool& planned) noexcept {
    return with_alternative(held_, [&](auto& x) { return x.prefetch(s, ids, n, max_fills, expires_after, planned); });
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

// SimRuntime plans on the host: ONE executor, whose policy is a run-time value of its state
// (DeviceRuntimePolicy), instead of one per policy. The kernels of a GPU runtime need their
// policy at compile time; the host planning code does not, and each of its instantiations costs
// a user's -O2 build seconds. Without the overlapped fill: AnyCacheConfig has no overlap.
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

// The staging policies make_expert_cache<Runtime> offers. any/any_cache_cuda.cuh specialises it
// for CudaRuntime (adds Gather); a policy a runtime cannot run is refused with not_supported.
template <class Runtime>
struct AnyCacheStagings {
  using type = detail::TypeList<Inline, CopyStream, Batched>;
};

// The runtime has a device-plan executor (SimRuntime here; CudaRuntime once
// device_cache/cuda_executor.cuh is included, which any/any_cache_cuda.cuh does).
template <class Runtime>
concept has_device_plan_executor = requires { typename DevicePlanExecutorFor<Runtime>::type; };

namespace detail {

template <class... Ts>
constexpr auto names_of(TypeList<Ts...>) noexcept {
  return std::array<std::string_view, sizeof...(Ts)>{Ts::name...};
}

// "a, b, c" into a fixed buffer (cold path; messages stay allocation-free Status).
struct NameListText {
  char text[160] = {};
  explicit NameListText(std::span<const std::string_view> names) noexcept {
    std::size_t at = 0;
    for (std::size_t i = 0; i < names.size(); ++i) {
      const std::string_view sep = i == 0 ? std::string_view() : std::string_view(", ");
      for (std::string_view part : {sep, names[i]}) {
        for (char c : part) {
          if (at + 1 < sizeof text) text[at++] = c;
        }
      }
    }
    text[at] = '\0';
  }
};

constexpr std::optional<std::size_t> index_of(std::span<const std::string_view> names, std::string_view name) noexcept {
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return i;
  }
  return std::nullopt;
}

// Calls f.template operator()<T>() for the i-th type of the list (i < size).
template <class R, class... Ts, class F>
R visit_type(TypeList<Ts...>, std::size_t i, F&& f) {
  std::optional<R> out;
  std::size_t k = 0;
  ((k++ == i ? (void)out.emplace(f.template operator()<Ts>()) : void()), ...);
  return std::move(*out);
}

// A non-owning reference to prepare_wide's consumer: one indirect call per round, no allocation.
struct WideConsumerRef {
  void* object = nullptr;
  Status (*call)(void*, const WideRound&) = nullptr;
  Status operator()(const WideRound& round) const { return call(object, round); }
};

// The erased interface: one vtable per provider kind. It holds what every program calls
// (prepare, stats, the storage's accessors). The calls a program may never make (prepare_unique,
// prepare_group, prepare_wide, prefetch, prefetch_device) are the models' plain members, reached
// through any_call_* below: a virtual one would be compiled with the vtable by every program that
// makes a cache, whereas these are compiled only where the program calls them, as a static
// cache's members are.
template <class Runtime>
class AnyCacheBase {
 public:
  using Stream = typename Runtime::Stream;
  virtual ~AnyCacheBase() = default;
  virtual Result<ForwardView> prepare(std::span<const std::int32_t> ids, Stream stream) noexcept = 0;
  virtual Status invalidate(std::int32_t expert, Stream stream) noexcept = 0;
  [[nodiscard]] virtual CacheStats stats() const noexcept = 0;
  [[nodiscard]] virtual const ExpertTensorBytes& tensors() const noexcept = 0;
  [[nodiscard]] virtual std::byte* host_tensor(std::size_t t, std::int32_t expert) const noexcept = 0;
  [[nodiscard]] virtual SlotTensor slot_tensor(std::size_t t) const noexcept = 0;
  [[nodiscard]] virtual const CopyRegions& copy_regions() const noexcept = 0;
  [[nodiscard]] virtual std::size_t host_bytes() const noexcept = 0;
  [[nodiscard]] virtual std::size_t storage_slot_bytes() const noexcept = 0;
  [[nodiscard]] virtual std::span<const std::int32_t> resident_map_host() const noexcept = 0;
  [[nodiscard]] virtual std::span<const std::int32_t> forward_map_host() const noexcept = 0;
  [[nodiscard]] virtual const std::int32_t* resident_map_device() const noexcept = 0;
  [[nodiscard]] virtual const std::int32_t* forward_map_device() const noexcept = 0;
  [[nodiscard]] virtual const ForwardPlan* last_plan() const noexcept = 0;
  [[nodiscard]] virtual std::optional<Stream> copy_stream() const noexcept = 0;
  [[nodiscard]] virtual std::optional<Stream> owner() const noexcept = 0;
  virtual Status set_stats_callback(std::function<void(const CacheStats&)> callback, std::uint64_t every) = 0;
  [[nodiscard]] virtual std::uint32_t take_errors() noexcept = 0;
  [[nodiscard]] virtual std::optional<FillEngine> fill_engine() const noexcept = 0;
};

// Shared by both models: the storage accessors and what both caches spell alike (invalidate).
template <class Runtime, class Cache>
class AnyCacheModelBase : public AnyCacheBase<Runtime> {
 public:
  using Stream = typename Runtime::Stream;
  template <class... Args>
  explicit AnyCacheModelBase(Args&&... args) : cache_(std::forward<Args>(args)...) {}
  [[nodiscard]] CacheStats stats() const noexcept final { return cache_.stats(); }
  [[nodiscard]] const ExpertTensorBytes& tensors() const noexcept final { return cache_.storage().tensors(); }
  [[nodiscard]] std::byte* host_tensor(std::size_t t, std::int32_t expert) const noexcept final {
    return cache_.storage().host_tensor(t, expert);
  }
  [[nodiscard]] SlotTensor slot_tensor(std::size_t t) const noexcept final { return cache_.storage().slot_tensor(t); }
  [[nodiscard]] const CopyRegions& copy_regions() const noexcept final { return cache_.storage().copy_regions(); }
  [[nodiscard]] std::size_t host_bytes() const noexcept final { return cache_.storage().host_bytes(); }
  [[nodiscard]] std::size_t storage_slot_bytes() const noexcept final { return cache_.storage().slot_bytes(); }
  [[nodiscard]] const std::int32_t* resident_map_device() const noexcept final { return cache_.resident_map_device(); }
  [[nodiscard]] const std::int32_t* forward_map_device() const noexcept final { return cache_.forward_map_device(); }
  [[nodiscard]] std::optional<Stream> owner() const noexcept final { return cache_.owner(); }
  Status invalidate(std::int32_t expert, Stream stream) noexcept final { return cache_.invalidate(expert, stream); }

 protected:
  Cache cache_;
};

// A host-planned ExpertCache (providers row and cached).
template <class Runtime, class Cache>
class HostCacheModel final : public AnyCacheModelBase<Runtime, Cache> {
  using Base = AnyCacheModelBase<Runtime, Cache>;

 public:
  using Stream = typename Runtime::Stream;
  using Base::Base;
  Result<ForwardView> prepare(std::span<const std::int32_t> ids, Stream stream) noexcept final {
    return this->cache_.prepare(ids, stream);
  }
  Result<ForwardView> prepare_unique(std::span<const std::int32_t> ids, Stream stream) noexcept {
    return this->cache_.prepare_unique(ids, stream);
  }
  Result<ForwardView> prepare_group(std::int32_t, Stream) noexcept {
    return Status(ErrorCode::not_supported,
                  "prepare_group is the device provider's overflow round; host providers split with "
                  "plan_expert_groups / plan_token_chunks and prepare_unique");
  }
  Result<WideSummary> prepare_wide(std::span<const std::int32_t> ids, Stream stream, WideConsumerRef consumer,
                                   WideOptions options) noexcept {
    return this->cache_.prepare_wide(ids, stream, consumer, options);
  }
  Result<PrefetchView> prefetch(std::span<const std::int32_t> ids, Stream stream,
                                PrefetchOptions options) noexcept {
    return this->cache_.prefetch(ids, stream, options);
  }
  Result<PrefetchView> prefetch_device(const std::int32_t*, std::int32_t, Stream, PrefetchOptions) noexcept {
    return Status(ErrorCode::not_supported,
                  "prefetch_device: a host-planned provider plans host ids; read the predicted ids back and call "
                  "prefetch, or use the device provider");
  }
  [[nodiscard]] std::span<const std::int32_t> resident_map_host() const noexcept final {
    return this->cache_.resident_map_host();
  }
  [[nodiscard]] std::span<const std::int32_t> forward_map_host() const noexcept final {
    return this->cache_.forward_map_host();
  }
  [[nodiscard]] const ForwardPlan* last_plan() const noexcept final { return &this->cache_.last_plan(); }
  [[nodiscard]] std::optional<Stream> copy_stream() const noexcept final { return this->cache_.copy_stream(); }
  Status set_stats_callback(std::function<void(const CacheStats&)> callback, std::uint64_t every) final {
    this->cache_.set_stats_callback(std::move(callback), every);
    return {};
  }
  [[nodiscard]] std::uint32_t take_errors() noexcept final { return 0; }
  [[nodiscard]] std::optional<FillEngine> fill_engine() const noexcept final { return std::nullopt; }
};

// A DeviceExpertCache (provider device): ids are device memory, no host maps or plans.
template <class Runtime, class Cache>
class DeviceCacheModel final : public AnyCacheModelBase<Runtime, Cache> {
  using Base = AnyCacheModelBase<Runtime, Cache>;

 public:
  using Stream = typename Runtime::Stream;
  using Base::Base;
  Result<ForwardView> prepare(std::span<const std::int32_t> device_ids, Stream stream) noexcept final {
    if (device_ids.size() > static_cast<std::size_t>(INT32_MAX)) {
      return Status::format(ErrorCode::invalid_argument, "prepare of %zu ids (device provider: at most max_ids)",
                            device_ids.size());
    }
    return this->cache_.prepare(device_ids.data(), static_cast<std::int32_t>(device_ids.size()), stream);
  }
  Result<ForwardView> prepare_unique(std::span<const std::int32_t>, Stream) noexcept {
    return Status(ErrorCode::not_supported,
                  "prepare_unique: the device provider plans the router's ids on the device; use prepare and "
                  "prepare_group");
  }
  Result<ForwardView> prepare_group(std::int32_t group, Stream stream) noexcept {
    return this->cache_.prepare_group(group, stream);
  }
  // A wide forward on the device planner. Stream admission on a cache with stream slots:
  // DeviceExpertCache::prepare_wide from these device ids (read back with the resident map, the
  // misses streamed through the stream slots by copies, nothing admitted; eager, not capturable).
  // Otherwise (admit, or no stream slots: fell_back): prepare, then prepare_group
  // 1..max_groups(n) - 1, the consumer after each (round g's view maps group g's experts: ids [g*C, (g+1)*C) of the unique
  // list, which holds the experts resident at the forward's start first, so no group evicts one
  // a later group reads; a group the forward does not have is an empty round). The groups go
  // through the pool (admit: not scan resistant) and are not overlapped (group g + 1 is planned after the
  // consumer of group g was enqueued, on the same stream). The host never sees the ids, so a
  // round's experts/slots spans are empty and the summary counts rounds only; the device counts
  // the forward in stats() (overflows) but, every group being served here, does not flag
  // plan_error_overflow (DeviceForward::in_rounds): a legitimate wide forward leaves the error
  // word clear, while a plain prepare() of the same ids still reports the overflow.
  Result<WideSummary> prepare_wide(std::span<const std::int32_t> device_ids, Stream stream, WideConsumerRef consumer,
                                   WideOptions options) noexcept {
    if (device_ids.size() > static_cast<std::size_t>(INT32_MAX)) {
      return Status::format(ErrorCode::invalid_argument, "prepare_wide of %zu ids (device provider: at most max_ids)",
                            device_ids.size());
    }
    if (options.admission == WideAdmission::stream && this->cache_.options().stream_slots >= 2) {
      return this->cache_.prepare_wide(device_ids.data(), device_ids.size(), stream, consumer, options);
    }
    const auto n = static_cast<std::int32_t>(device_ids.size());
    Result<ForwardView> view = this->cache_.prepare(device_ids.data(), n, stream, DeviceForward::in_rounds);
    if (!view.ok()) return view.status().with_context("prepare_wide");
    const auto rounds = static_cast<std::uint32_t>(std::max<std::int32_t>(1, this->cache_.max_groups(n)));
    WideSummary summary;
    summary.admission = WideAdmission::admit;
    summary.fell_back = options.admission == WideAdmission::stream;
    for (std::uint32_t g = 0; g < rounds; ++g) {
      if (g > 0) {
        view = this->cache_.prepare_group(static_cast<std::int32_t>(g), stream);
        if (!view.ok()) return view.status().with_context("prepare_wide: round %u of %u", g, rounds);
      }
      WideRound round;
      round.view = view.value();
      round.index = g;
      round.rounds = rounds;
      if (Status s = consumer(round); !s) return s.with_context("prepare_wide: round %u of %u", g, rounds);
      ++summary.rounds;
    }
    return summary;
  }
  // Host ids (validated, uploaded, planned on the device), unlike prepare's span.
  Result<PrefetchView> prefetch(std::span<const std::int32_t> ids, Stream stream,
                                PrefetchOptions options) noexcept {
    return this->cache_.prefetch(ids, stream, options);
  }
  Result<PrefetchView> prefetch_device(const std::int32_t* device_ids, std::int32_t n_ids, Stream stream,
                                       PrefetchOptions options) noexcept {
    return this->cache_.prefetch(device_ids, n_ids, stream, options);
  }
  [[nodiscard]] std::span<const std::int32_t> resident_map_host() const noexcept final { return {}; }
  [[nodiscard]] std::span<const std::int32_t> forward_map_host() const noexcept final { return {}; }
  [[nodiscard]] const ForwardPlan* last_plan() const noexcept final { return nullptr; }
  [[nodiscard]] std::optional<Stream> copy_stream() const noexcept final { return std::nullopt; }
  Status set_stats_callback(std::function<void(const CacheStats&)>, std::uint64_t) final {
    return Status(ErrorCode::not_supported, "the device provider has no stats callback (read stats())");
  }
  [[nodiscard]] std::uint32_t take_errors() noexcept final { return this->cache_.take_errors(); }
  [[nodiscard]] std::optional<FillEngine> fill_engine() const noexcept final { return this->cache_.fill_engine(); }
};

// The calls AnyCacheBase leaves out, on the model the provider kind names (defined below,
// after the cache types). Not inline: the compiled mode declares them extern and instantiates
// them once, beside the factory.
template <class Runtime>
Result<ForwardView> any_call_prepare_unique(AnyCacheBase<Runtime>& impl, bool device, std::span<const std::int32_t> ids,
                                            typename Runtime::Stream stream) noexcept;
template <class Runtime>
Result<ForwardView> any_call_prepare_group(AnyCacheBase<Runtime>& impl, bool device, std::int32_t group,
                                           typename Runtime::Stream stream) noexcept;
template <class Runtime>
Result<WideSummary> any_call_prepare_wide(AnyCacheBase<Runtime>& impl, bool device, std::span<const std::int32_t> ids,
                                          typename Runtime::Stream stream, WideConsumerRef consumer,
                                          WideOptions options) noexcept;
template <class Runtime>
Result<PrefetchView> any_call_prefetch(AnyCacheBase<Runtime>& impl, bool device, std::span<const std::int32_t> ids,
                                       typename Runtime::Stream stream, PrefetchOptions options) noexcept;
template <class Runtime>
Result<PrefetchView> any_call_prefetch_device(AnyCacheBase<Runtime>& impl, bool device, const std::int32_t* device_ids,
                                              std::int32_t n_ids, typename Runtime::Stream stream,
                                              PrefetchOptions options) noexcept;

}  // namespace detail

template <allocating_runtime Runtime>
class AnyExpertCache;

template <allocating_runtime Runtime>
[[gnu::cold]] Result<AnyExpertCache<Runtime>> make_expert_cache(Runtime& rt, const AnyCacheConfig& config);

// The type-erased cache. Move-only; a moved-from object may only be destroyed or assigned.
template <allocating_runtime Runtime>
class AnyExpertCache {
 public:
  using Stream = typename Runtime::Stream;

  AnyExpertCache(AnyExpertCache&&) noexcept = default;
  AnyExpertCache& operator=(AnyExpertCache&&) noexcept = default;

  // Host providers: top-k ids in host memory, as ExpertCache::prepare. Device provider: the
  // span is [device pointer, n_ids) of ids in device memory, as DeviceExpertCache::prepare.
  Result<ForwardView> prepare(std::span<const std::int32_t> ids, Stream stream) noexcept {
    return impl_->prepare(ids, stream);
  }
  // Host providers only (the device provider returns not_supported).
  Result<ForwardView> prepare_unique(std::span<const std::int32_t> unique_ids, Stream stream) noexcept {
    return detail::any_call_prepare_unique(*impl_, device_, unique_ids, stream);
  }
  // Device provider only: overflow group g >= 1 of the last prepare (DeviceExpertCache).
  Result<ForwardView> prepare_group(std::int32_t group, Stream stream) noexcept {
    return detail::any_call_prepare_group(*impl_, device_, group, stream);
  }
  // A forward of any width in rounds (cache/wide.hpp): `consumer(const WideRound&)` returns a Status
  // and enqueues each round's work on `stream`. Host providers: ExpertCache::prepare_wide (ids in
  // host memory; stream admission needs options.stream_slots >= 2, else admit, fell_back).
  // Device provider: ids in DEVICE memory. With options.stream_slots >= 2 and stream admission,
  // DeviceExpertCache::prepare_wide (at most max_wide_ids ids; eager: the host waits for their
  // read-back); otherwise at most max_ids, served as admit through prepare + prepare_group, not
  // overlapped (DeviceCacheModel::prepare_wide). The consumer must not call
  // into this cache.
  template <class Consumer>
    requires std::is_invocable_r_v<Status, Consumer&, const WideRound&>
  Result<WideSummary> prepare_wide(std::span<const std::int32_t> ids, Stream stream, Consumer&& consumer,
                                   WideOptions options = {}) noexcept {
    using C = std::remove_reference_t<Consumer>;
    const detail::WideConsumerRef ref{const_cast<void*>(static_cast<const void*>(std::addressof(consumer))),
                                      [](void* object, const WideRound& round) -> Status {
                                        return (*static_cast<C*>(object))(round);
                                      }};
    return detail::any_call_prepare_wide(*impl_, device_, ids, stream, ref, options);
  }
  Status invalidate(std::int32_t expert, Stream stream) noexcept { return impl_->invalidate(expert, stream); }
  // Speculative fills of predicted ids in HOST memory, as ExpertCache::prefetch (every
  // provider; the device provider uploads them and plans on the device, its view counts nothing:
  // see stats()).
  Result<PrefetchView> prefetch(std::span<const std::int32_t> predicted, Stream stream,
                                PrefetchOptions options = {}) noexcept {
    return detail::any_call_prefetch(*impl_, device_, predicted, stream, options);
  }
  // Predicted ids in DEVICE memory (e.g. written by a kernel inside a captured step), planned on
  // the device: the device provider only (DeviceExpertCache::prefetch); host-planned providers
  // return not_supported.
  Result<PrefetchView> prefetch_device(const std::int32_t* device_ids, std::int32_t n_ids, Stream stream,
                                       PrefetchOptions options = {}) noexcept {
    return detail::any_call_prefetch_device(*impl_, device_, device_ids, n_ids, stream, options);
  }
  [[nodiscard]] CacheStats stats() const noexcept { return impl_->stats(); }

  // Split plans for forwards wider than the cache (host providers; any provider can compute them).
  [[nodiscard]] Result<std::vector<TokenChunk>> plan_token_chunks(std::span<const std::int32_t> topk_ids) const {
    return expert_cache::plan_token_chunks(topk_ids, options_.top_k, options_.capacity, options_.num_experts);
  }
  [[nodiscard]] Result<std::vector<ExpertGroup>> plan_expert_groups(std::span<const std::int32_t> topk_ids) const {
    return expert_cache::plan_expert_groups(topk_ids, options_.top_k, options_.capacity, options_.num_experts);
  }
  // Rounds (prepare + prepare_group 1..) a device-provider graph needs for n_ids ids.
  [[nodiscard]] std::int32_t max_groups(std::int64_t n_ids) const noexcept {
    return plan_max_groups(n_ids, options_.num_experts, options_.capacity);
  }

  // Storage (host pools to fill, slot tensors, copy regions), as Storage's accessors.
  [[nodiscard]] const ExpertTensorBytes& tensors() const noexcept { return impl_->tensors(); }
  [[nodiscard]] std::byte* host_tensor(std::size_t t, std::int32_t expert) const noexcept {
    return impl_->host_tensor(t, expert);
  }
  [[nodiscard]] SlotTensor slot_tensor(std::size_t t) const noexcept { return impl_->slot_tensor(t); }
  [[nodiscard]] const CopyRegions& copy_regions() const noexcept { return impl_->copy_regions(); }
  [[nodiscard]] std::size_t host_pool_bytes() const noexcept { return impl_->host_bytes(); }
  [[nodiscard]] std::size_t slot_buffer_bytes() const noexcept { return impl_->storage_slot_bytes(); }

  // Host copies of the maps (host providers; empty for the device provider) and the device maps.
  [[nodiscard]] std::span<const std::int32_t> resident_map_host() const noexcept { return impl_->resident_map_host(); }
  [[nodiscard]] std::span<const std::int32_t> forward_map_host() const noexcept { return impl_->forward_map_host(); }
  [[nodiscard]] const std::int32_t* resident_map_device() const noexcept { return impl_->resident_map_device(); }
  [[nodiscard]] const std::int32_t* forward_map_device() const noexcept { return impl_->forward_map_device(); }
  // The last prepare's plan (host providers; nullptr for the device provider).
  [[nodiscard]] const ForwardPlan* last_plan() const noexcept { return impl_->last_plan(); }
  [[nodiscard]] std::optional<Stream> copy_stream() const noexcept { return impl_->copy_stream(); }
  [[nodiscard]] std::optional<Stream> owner() const noexcept { return impl_->owner(); }
  // Device provider: read and clear the device error word (0 for host providers).
  [[nodiscard]] std::uint32_t take_errors() noexcept { return impl_->take_errors(); }
  /// The engine the device provider's fills run on (FillEngine::automatic resolved when the
  /// cache was made); none for the host-planned providers, which copy on their copy stream.
  [[nodiscard]] std::optional<FillEngine> fill_engine() const noexcept { return impl_->fill_engine(); }
  // Host providers (the device provider returns not_supported).
  Status set_stats_callback(std::function<void(const CacheStats&)> callback, std::uint64_t every) {
    return impl_->set_stats_callback(std::move(callback), every);
  }

  [[nodiscard]] const CacheOptions& options() const noexcept { return options_; }
  [[nodiscard]] std::string_view provider() const noexcept { return provider_; }
  [[nodiscard]] std::string_view policy() const noexcept { return policy_; }
  [[nodiscard]] std::string_view staging() const noexcept { return staging_; }
  [[nodiscard]] std::string_view storage() const noexcept { return storage_; }
  [[nodiscard]] std::string_view layout() const noexcept { return layout_; }

 private:
  friend Result<AnyExpertCache> make_expert_cache<Runtime>(Runtime& rt, const AnyCacheConfig& config);
  AnyExpertCache() = default;

  std::unique_ptr<detail::AnyCacheBase<Runtime>> impl_;
  bool device_ = false;  // impl_ is the device provider's model (the any_call_* casts)
  CacheOptions options_;
  std::string_view provider_, policy_, staging_, storage_;  // static names
  std::string layout_;
};

namespace detail {

// An exception from a static cache's constructor as the factory's Status (same code; the
// message without the "code: " prefix Error adds).
[[gnu::cold]] inline Status status_of(const Error& e) noexcept {
  std::string_view m = e.what();
  const std::string_view code = to_string(e.code());
  if (m.size() > code.size() + 2 && m.substr(0, code.size()) == code && m.substr(code.size(), 2) == ": ") {
    m.remove_prefix(code.size() + 2);
  }
  return Status(e.code(), m);
}

template <class List>
struct AnyStagingOf;
template <class... Gs>
struct AnyStagingOf<TypeList<Gs...>> {
  using type = AnyStaging<Gs...>;
};

// The one host-planned cache type: the storage arrangement, the eviction policy and the
// staging policy are values (AnyArrangementStorage, AnyPolicy, AnyStaging), so none of them
// multiplies the instantiations (each choice is compiled once, in its erased type).
template <class Runtime>
using AnyStagingFor = typename AnyStagingOf<typename AnyCacheStagings<Runtime>::type>::type;
template <class Runtime>
using AnyHostCache = ExpertCache<AnyArrangementStorage, AnyPolicy, AnyStagingFor<Runtime>, ExplicitLayout, Runtime>;
// The one device-planned cache type (storage arrangement and device policy as values).
template <class Runtime>
using AnyDeviceCache = DeviceExpertCache<AnyArrangementStorage, ExplicitLayout, Runtime, AnyDevicePolicy>;

// f(the model impl is): the device provider's where `device`, else the host-planned one's.
template <class Runtime, class F>
decltype(auto) with_any_model(AnyCacheBase<Runtime>& impl, bool device, F&& f) noexcept {
  if constexpr (has_device_plan_executor<Runtime>) {
    if (device) return f(static_cast<DeviceCacheModel<Runtime, AnyDeviceCache<Runtime>>&>(impl));
  }
  return f(static_cast<HostCacheModel<Runtime, AnyHostCache<Runtime>>&>(impl));
}

template <class Runtime>
Result<ForwardView> any_call_prepare_unique(AnyCacheBase<Runtime>& impl, bool device, std::span<const std::int32_t> ids,
                                            typename Runtime::Stream stream) noexcept {
  return with_any_model(impl, device, [&](auto& m) { return m.prepare_unique(ids, stream); });
}
template <class Runtime>
Result<ForwardView> any_call_prepare_group(AnyCacheBase<Runtime>& impl, bool device, std::int32_t group,
                                           typename Runtime::Stream stream) noexcept {
  return with_any_model(impl, device, [&](auto& m) { return m.prepare_group(group, stream); });
}
template <class Runtime>
Result<WideSummary> any_call_prepare_wide(AnyCacheBase<Runtime>& impl, bool device, std::span<const std::int32_t> ids,
                                          typename Runtime::Stream stream, WideConsumerRef consumer,
                                          WideOptions options) noexcept {
  return with_any_model(
      impl, device, [&](auto& m) { return m.prepare_wide(ids, stream, consumer, options); });
}
template <class Runtime>
Result<PrefetchView> any_call_prefetch(AnyCacheBase<Runtime>& impl, bool device, std::span<const std::int32_t> ids,
                                       typename Runtime::Stream stream, PrefetchOptions options) noexcept {
  return with_any_model(impl, device, [&](auto& m) { return m.prefetch(ids, stream, options); });
}
template <class Runtime>
Result<PrefetchView> any_call_prefetch_device(AnyCacheBase<Runtime>& impl, bool device, const std::int32_t* device_ids,
                                              std::int32_t n_ids, typename Runtime::Stream stream,
                                              PrefetchOptions options) noexcept {
  return with_any_model(
      impl, device, [&](auto& m) { return m.prefetch_device(device_ids, n_ids, stream, options); });
}

}  // namespace detail

// The device provider's wide rounds copy through the host providers' staging type, holding
// CopyStream (what a static DeviceExpertCache copies with): one instantiation of the rounds
// serves both providers.
template <class Runtime>
struct DeviceWideStaging<detail::AnyDevicePolicy, Runtime> {
  using type = detail::AnyStagingFor<Runtime>;
  [[nodiscard]] static type make() {
    constexpr auto names = detail::names_of(typename AnyCacheStagings<Runtime>::type{});
    constexpr std::optional<std::size_t> copy_stream = detail::index_of(names, CopyStream::name);
    static_assert(copy_stream.has_value(), "the staging list offers CopyStream");
    return type(*copy_stream);
  }
};

namespace detail {

// What a config chose: each name's index in the list make_expert_cache offers, and the names.
struct AnyCacheChoices {
  std::size_t provider = 0, policy = 0, staging = 0, storage = 0;
  std::size_t device_policy = 0;  // device provider: index into any_device_policy_names
  bool device = false;
  std::string_view policy_name, staging_name, storage_name;
};

// Every name, every combination and the device provider's sizes, checked before anything is
// constructed. Not a template (the runtime only changes the staging list and whether it has a
// device-plan executor), so a build compiles it once.
[[gnu::cold]]
inline Status check_any_cache_config(const AnyCacheConfig& config, std::span<const std::string_view> staging_names,
                                     bool has_device_executor, AnyCacheChoices& out) noexcept {
  constexpr auto policy_names = AnyPolicy::names;
  constexpr auto storage_names = names_of(AnyStorages{});
  const auto clip = [](const std::string& s) { return static_cast<int>(std::min<std::size_t>(s.size(), 40)); };

  const std::optional<std::size_t> provider = index_of(any_cache_providers, config.provider);
  if (!provider) {
    return Status::format(ErrorCode::invalid_argument, "unknown provider '%.*s' (valid: %s)", clip(config.provider),
                          config.provider.c_str(), NameListText(any_cache_providers).text);
  }
  const bool device = *provider == 2;
  static constexpr std::array<std::string_view, 3> default_policy = {"lru", "lfru", "lru"};
  static constexpr std::array<std::string_view, 3> default_staging = {"copy_stream", "copy_stream", "inline"};
  static constexpr std::array<std::string_view, 3> default_storage = {"tensor_major", "expert_major", "tensor_major"};
  const std::string_view policy_name = config.policy.empty() ? default_policy[*provider] : std::string_view(config.policy);
  const std::string_view staging_name = config.staging.empty() ? default_staging[*provider] : std::string_view(config.staging);
  const std::string_view storage_name = config.storage.empty() ? default_storage[*provider] : std::string_view(config.storage);

  // The device provider plans with a device policy (DeviceExpertCache's Policy, one type each).
  constexpr auto device_policy_names = any_device_policy_names;
  const std::optional<std::size_t> device_policy = index_of(device_policy_names, policy_name);
  if (device) {
    if (!device_policy) {
      return Status::format(ErrorCode::invalid_argument,
                            "provider 'device' plans on the device with policy lru, lfru or crf (got '%.*s'; "
                            "valid: %s)",
                            static_cast<int>(std::min<std::size_t>(policy_name.size(), 40)), policy_name.data(),
                            NameListText(device_policy_names).text);
    }
  }
  const std::optional<std::size_t> policy = index_of(policy_names, policy_name);
  if (!policy) {
    if (policy_name == "belady" || policy_name == "opt") {
      return Status::format(ErrorCode::invalid_argument,
                            "policy '%.*s' is offline-only (it needs the future trace: use ExpertCache with "
                            "make_policy<Belady>, or the replay tool); online policies: %s",
                            static_cast<int>(policy_name.size()), policy_name.data(), NameListText(policy_names).text);
    }
    return Status::format(ErrorCode::invalid_argument, "unknown eviction policy '%.*s' (valid: %s)",
                          static_cast<int>(std::min<std::size_t>(policy_name.size(), 40)), policy_name.data(),
                          NameListText(policy_names).text);
  }
  const std::optional<std::size_t> staging = index_of(staging_names, staging_name);
  if (!staging) {
    if (staging_name == "gather") {
      return Status::format(ErrorCode::invalid_argument,
                            "staging 'gather' needs the CUDA tier (CudaRuntime, include expert_cache/any/any_cache_cuda.cuh "
                            "in a .cu); valid with this runtime: %s",
                            NameListText(staging_names).text);
    }
    return Status::format(ErrorCode::invalid_argument, "unknown staging policy '%.*s' (valid: %s)",
                          static_cast<int>(std::min<std::size_t>(staging_name.size(), 40)), staging_name.data(),
                          NameListText(staging_names).text);
  }
  const std::optional<std::size_t> storage = index_of(storage_names, storage_name);
  if (!storage) {
    return Status::format(ErrorCode::invalid_argument, "unknown storage '%.*s' (valid: %s)",
                          static_cast<int>(std::min<std::size_t>(storage_name.size(), 40)), storage_name.data(),
                          NameListText(storage_names).text);
  }
  if (device) {
    if (staging_name != "inline") {
      return Status::format(ErrorCode::invalid_argument,
                            "provider 'device' fills inline (got staging '%.*s'; valid: staging inline, policy %s, "
                            "storage %s)",
                            static_cast<int>(staging_name.size()), staging_name.data(),
                            NameListText(device_policy_names).text, NameListText(storage_names).text);
    }
    if (policy_name != "lru" && storage_name != "tensor_major") {
      return Status::format(ErrorCode::invalid_argument,
                            "provider 'device' plans with policy '%.*s' on storage tensor_major only (got '%.*s'; "
                            "policy lru takes every storage: %s)",
                            static_cast<int>(policy_name.size()), policy_name.data(),
                            static_cast<int>(std::min<std::size_t>(storage_name.size(), 40)), storage_name.data(),
                            NameListText(storage_names).text);
    }
    if (!has_device_executor) {
      return Status(ErrorCode::not_supported,
                    "provider 'device' has no plan executor for this runtime (CudaRuntime: include "
                    "expert_cache/any/any_cache_cuda.cuh, which brings device_cache/cuda_executor.cuh)");
    }
    if (config.max_ids <= 0) {
      return Status::format(ErrorCode::invalid_argument, "provider 'device' needs max_ids > 0 (tokens * top_k), got %d",
                            config.max_ids);
    }
    if (config.options.stats_callback) {
      return Status(ErrorCode::invalid_argument, "provider 'device' has no stats callback (read stats())");
    }
  }
  if (!config.layout.validation) {
    return config.layout.validation.with_context("layout %.*s", clip(config.layout.name), config.layout.name.c_str());
  }
  out.provider = *provider;
  out.policy = *policy;
  out.staging = *staging;
  out.storage = *storage;
  out.device_policy = device_policy.value_or(0);
  out.device = device;
  out.policy_name = policy_name;
  out.staging_name = staging_name;
  out.storage_name = storage_name;
  return {};
}

}  // namespace detail

// Builds the cache the config names. Every name is checked before anything is constructed;
// construction failures (sizes, capacity, allocation) come back as the static type's error.
// Cold: it runs once per cache, so the compiler optimises it (and what only it calls: the
// caches' constructors) for size.
template <allocating_runtime Runtime>
Result<AnyExpertCache<Runtime>> make_expert_cache(Runtime& rt, const AnyCacheConfig& config) {
  using Base = detail::AnyCacheBase<Runtime>;
  using Stagings = typename AnyCacheStagings<Runtime>::type;
  constexpr auto policy_names = AnyPolicy::names;
  constexpr auto staging_names = detail::names_of(Stagings{});
  constexpr auto storage_names = detail::names_of(detail::AnyStorages{});
  detail::AnyCacheChoices chosen;
  if (Status s = detail::check_any_cache_config(config, staging_names, has_device_plan_executor<Runtime>, chosen); !s) {
    return s;
  }
  const bool device = chosen.device;
  const std::string_view policy_name = chosen.policy_name;

  // ---- construction ----
  CacheOptions inner = config.options;
  inner.log = {};  // the line below names the provider and the layout
  const ExplicitLayout layout{config.layout.tensors};
  using Made = Result<std::unique_ptr<Base>>;
  // Constructed, never assigned: nvcc flags an assignment of a [[nodiscard]] class (#2810).
  const auto build = [&]() -> Made {
    try {
      detail::AnyChoice choice;
      choice.storage = chosen.storage;
      if (device) {
        if constexpr (has_device_plan_executor<Runtime>) {
          DeviceCacheOptions o;
          o.num_experts = inner.num_experts;
          o.capacity = inner.capacity;
          o.max_ids = config.max_ids;
          o.fused_plan_fill = config.fused_plan_fill;
          o.fill_engine = config.fill_engine;
          o.link_profile = config.link_profile;
          o.stream_slots = inner.stream_slots;
          o.max_wide_ids = inner.max_wide_ids;
          o.label = inner.label;
          o.memory = inner.memory;
          choice.device_policy = chosen.device_policy;
          const detail::AnyChoiceScope scope(choice);
          using Model = detail::DeviceCacheModel<Runtime, detail::AnyDeviceCache<Runtime>>;
          return std::unique_ptr<Base>(std::make_unique<Model>(rt, o, layout));
        } else {
          return Status(ErrorCode::internal, "device provider without executor");
        }
      }
      const CacheShape shape =
          ForwardPlanner<AnyPolicy>::validated(CacheShape{inner.num_experts, inner.capacity}, inner.top_k);
      Result<AnyPolicy> made_policy = AnyPolicy::make(policy_name, shape, config.pool);
      if (!made_policy.ok()) return made_policy.status();
      const Status runnable = detail::visit_type<Status>(Stagings{}, chosen.staging, [&]<class G>() -> Status {
        if constexpr (staging_policy_for<G, Runtime, detail::AnyArrangementStorage>) {
          return {};
        } else {
          return Status::format(ErrorCode::not_supported, "staging '%.*s' cannot run on this runtime",
                                static_cast<int>(G::name.size()), G::name.data());
        }
      });
      if (!runnable) return runnable;
      const detail::AnyChoiceScope scope(choice);
      using Model = detail::HostCacheModel<Runtime, detail::AnyHostCache<Runtime>>;
      return std::unique_ptr<Base>(std::make_unique<Model>(rt, inner, layout, std::move(made_policy.value()),
                                                           detail::AnyStagingFor<Runtime>(chosen.staging)));
    } catch (const Error& e) {
      return detail::status_of(e);
    } catch (const std::bad_alloc&) {
      return Status(ErrorCode::runtime_failure, "make_expert_cache: out of host memory");
    } catch (const std::exception& e) {
      return Status(ErrorCode::runtime_failure, e.what());
    }
  };
  Made made = build();
  if (!made.ok()) return made.status();

  AnyExpertCache<Runtime> cache;
  cache.impl_ = std::move(made.value());
  cache.device_ = device;
  cache.options_ = config.options;
  cache.provider_ = any_cache_providers[chosen.provider];
  cache.policy_ = policy_names[chosen.policy];
  cache.staging_ = staging_names[chosen.staging];
  cache.storage_ = storage_names[chosen.storage];
  cache.layout_ = config.layout.name;
  if (config.options.log) {
    const CacheStats s = cache.stats();
    config.options.log(detail::join({config.options.label, ": ", cache.provider_, " provider, ", cache.policy_, "/",
                                     cache.staging_, "/", cache.storage_, "/", cache.layout_, ", ",
                                     detail::DecimalText(config.options.capacity), " of ",
                                     detail::DecimalText(config.options.num_experts), " experts, slot bytes ",
                                     detail::DecimalText(s.slot_bytes), ", host bytes ",
                                     detail::DecimalText(s.host_bytes)}));
  }
  return Result<AnyExpertCache<Runtime>>(std::move(cache));
}

}  // namespace expert_cache::inline v0

// The compiled mode's instantiations for one runtime R, listed once: declared with
// EXPERT_CACHE_ANY_CACHE_INSTANTIATIONS(extern, R) where a translation unit only links to them,
// defined with EXPERT_CACHE_ANY_CACHE_INSTANTIATIONS(, R) in the compiled unit (compiled/).
#define EXPERT_CACHE_ANY_CACHE_INSTANTIATIONS(KEYWORD, R)                                                             \
  KEYWORD template Result<AnyExpertCache<R>> make_expert_cache<R>(R& rt, const AnyCacheConfig& config);               \
  KEYWORD template Result<ForwardView> detail::any_call_prepare_unique<R>(detail::AnyCacheBase<R>&, bool,              \
                                                                          std::span<const std::int32_t>,              \
                                                                          typename R::Stream) noexcept;               \
  KEYWORD template Result<ForwardView> detail::any_call_prepare_group<R>(detail::AnyCacheBase<R>&, bool, std::int32_t, \
                                                                         typename R::Stream) noexcept;                \
  KEYWORD template Result<WideSummary> detail::any_call_prepare_wide<R>(                                              \
      detail::AnyCacheBase<R>&, bool, std::span<const std::int32_t>, typename R::Stream, detail::WideConsumerRef,     \
      WideOptions) noexcept;                                                                                          \
  KEYWORD template Result<PrefetchView> detail::any_call_prefetch<R>(detail::AnyCacheBase<R>&, bool,                  \
                                                                     std::span<const std::int32_t>,                  \
                                                                     typename R::Stream, PrefetchOptions) noexcept;   \
  KEYWORD template Result<PrefetchView> detail::any_call_prefetch_device<R>(                                          \
      detail::AnyCacheBase<R>&, bool, const std::int32_t*, std::int32_t, typename R::Stream, PrefetchOptions) noexcept

// Compiled mode (docs/any_cache.md): the SimRuntime factory and the non-virtual calls are
// instantiated once, in src/any_cache_sim.cpp, not in every translation unit
// that calls them.
#if defined(EXPERT_CACHE_SEPARATE_COMPILATION)
#include "expert_cache/runtime/sim_runtime.hpp"

namespace expert_cache::inline v0 {
EXPERT_CACHE_ANY_CACHE_INSTANTIATIONS(extern, SimRuntime);
}  // namespace expert_cache::inline v0
#endif
