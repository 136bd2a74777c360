#pragma once
/// Every concept of the library, in one place, with the vocabulary they are stated in.
//
//   eviction_policy      which resident to drop (eviction/: Lru, Lfru, Sieve, S3Fifo, Arc, ...)
//   expert_layout        which tensors an expert has and how big (layout/: Nvfp4Marlin,
//                        DenseBf16, ExplicitLayout); `scale_layout` is
//                        another name for it.
//   runtime              streams, events, async copies (runtime/: SimRuntime, CudaRuntime)
//   allocating_runtime   a runtime that also allocates device and pinned host memory
//   batching_runtime     a runtime with one call for many copies (cudaMemcpyBatchAsync)
//   staging_policy_for   how fills are issued (staging/: Inline, CopyStream, Batched, Gather)
//
// Each model static_asserts its concept next to its definition (the models include this
// header, so the asserts cannot live here); the archetype runtime below checks the runtime
// concepts themselves and lets the staging policies assert theirs without a real runtime.
// Host-only.
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>

#include "expert_cache/base/runtime_types.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/base/types.hpp"

namespace expert_cache::inline v0 {

// ---- eviction ------------------------------------------------------------------------------

/// Size of one cache: how many experts exist and how many slots hold them.
struct CacheShape {
  std::int32_t num_experts = 0;
  std::int32_t capacity = 0;
  friend bool operator==(const CacheShape&, const CacheShape&) = default;
};

/// The unique experts of the forward being planned. Policies must never choose a victim
/// that this set contains (in-forward victim protection: evicting an expert this forward has
/// already placed would overwrite a slot its expert map points to).
// Membership is an epoch-stamped array lookup, so testing it costs one load.
class ForwardSet {
 public:
  constexpr ForwardSet(const std::uint32_t* stamps, std::uint32_t epoch) noexcept
      : stamps_(stamps), epoch_(epoch) {}
  /// @param e  an expert id of the cache's id space
  /// @return true when `e` is one of the forward's unique experts
  [[nodiscard]] constexpr bool contains(ExpertId e) const noexcept {
    return stamps_[e.index()] == epoch_;
  }

 private:
  const std::uint32_t* stamps_;
  std::uint32_t epoch_;
};

/// The eviction policy interface: a policy tracks the order of the residents and names a victim
/// when a miss finds no free slot. The planner owns residency (expert <-> slot); the policy only
/// ranks.
///
/// Call protocol, per forward: begin_forward (optional hook), then for each unique expert
/// in processing order either on_hit, or [choose_victim + on_remove(victim)] + on_insert.
/// invalidate() calls on_remove outside a forward. Policies are values: copyable and
/// equality comparable so that tests can snapshot the whole cache state.
///
/// - `P::name`: the policy's name (AnyPolicy and the tools select by it).
/// - `on_hit(e)`: resident `e` was requested again.
/// - `on_insert(e)`: `e` was just filled into a slot.
/// - `on_remove(e)`: resident `e` left (a victim, or invalidate()).
/// - `choose_victim(needed)`: the resident to evict, never one in `needed`. Precondition: every
///   slot is taken and at least one resident is outside `needed`.
template <class P>
concept eviction_policy =
    std::copyable<P> && std::equality_comparable<P> &&
    requires(P& p, const P& cp, ExpertId e, const ForwardSet& needed) {
      { P::name } -> std::convertible_to<std::string_view>;
      { p.on_hit(e) } noexcept -> std::same_as<void>;
      { p.on_insert(e) } noexcept -> std::same_as<void>;
      { p.on_remove(e) } noexcept -> std::same_as<void>;
      // Precondition: every slot is taken and at least one resident is outside `needed`.
      { p.choose_victim(needed) } noexcept -> std::same_as<ExpertId>;
    };

/// Optional hook: told the forward's unique experts before any on_hit/on_insert (Belady
/// uses it to advance its position in the trace).
template <class P>
concept has_begin_forward = requires(P& p, std::span<const ExpertId> ids) {
  { p.begin_forward(ids) } noexcept;
};

/// Which free slot a miss takes first. Both providers pop a LIFO free list; they differ in
/// its initial order. vLLM's cached provider hands out capacity-1 first, the row provider 0.
enum class FreeSlotOrder : std::uint8_t { lowest_first, highest_first };

/// A policy type's free-slot order: its static `free_slot_order`, else lowest_first.
template <class P>
constexpr FreeSlotOrder free_slot_order_of() noexcept {
  if constexpr (requires { P::free_slot_order; }) {
    return P::free_slot_order;
  } else {
    return FreeSlotOrder::lowest_first;
  }
}

/// The same for a policy value: a policy type that holds one of several policies (AnyPolicy)
/// reports the held one's order through dynamic_free_slot_order().
template <class P>
constexpr FreeSlotOrder free_slot_order_of(const P& policy) noexcept {
  if constexpr (requires { { policy.dynamic_free_slot_order() } -> std::same_as<FreeSlotOrder>; }) {
    return policy.dynamic_free_slot_order();
  } else {
    return free_slot_order_of<P>();
  }
}

// ---- fills (what the planner hands a staging policy) ---------------------------------------

/// One fill of a forward's plan: copy `expert` into `slot`.
struct SlotFill {
  ExpertId expert;
  SlotId slot;
  friend bool operator==(const SlotFill&, const SlotFill&) = default;
};

/// One eviction of a forward's plan: `expert` left `slot`.
struct SlotEviction {
  ExpertId expert;
  SlotId slot;
  friend bool operator==(const SlotEviction&, const SlotEviction&) = default;
};

// ---- runtimes ------------------------------------------------------------------------------

/// Stream and event handles are small values (a cudaStream_t / cudaEvent_t, or an index),
/// copied freely and compared with ==. Ownership stays with the runtime.
template <class H>
concept runtime_handle = std::regular<H> && std::is_trivially_copyable_v<H>;

/// The runtime interface: streams, events and asynchronous copies. Every call that can fail
/// returns Status or Result; semantics every model must follow (CUDA's):
/// - record(e, s): e's latest record becomes "all work enqueued on s so far"; re-recording
///   replaces it. wait(s, e) captures the record current at the time of the call; waiting on
///   a never-recorded event is a no-op.
/// - query(e): true when the latest record has completed (never recorded: true); a true
///   result orders the host after that record, as synchronize(e) does.
/// - copy_async reads [src, src + bytes) and writes [dst, dst + bytes) when it runs.
/// - is_capturing(s): whether `s` is being captured into a graph.
/// - host_access(p, n, mode): the host declares it touches host memory now (a no-op on CUDA;
///   SimRuntime checks it against in-flight device work, e.g. staging-buffer reuse).
template <class R>
concept runtime =
    runtime_handle<typename R::Stream> && runtime_handle<typename R::Event> &&
    requires(R& rt, typename R::Stream s, typename R::Event e, void* dst, const void* src,
             const void* p, std::size_t n, AccessMode mode) {
      { rt.create_stream() } -> std::same_as<Result<typename R::Stream>>;
      { rt.destroy_stream(s) } noexcept -> std::same_as<void>;
      { rt.create_event() } -> std::same_as<Result<typename R::Event>>;
      { rt.destroy_event(e) } noexcept -> std::same_as<void>;
      { rt.record(e, s) } noexcept -> std::same_as<Status>;
      { rt.wait(s, e) } noexcept -> std::same_as<Status>;
      { rt.query(e) } noexcept -> std::same_as<Result<bool>>;
      { rt.synchronize(e) } noexcept -> std::same_as<Status>;
      { rt.synchronize(s) } noexcept -> std::same_as<Status>;
      { rt.copy_async(dst, src, n, s) } noexcept -> std::same_as<Status>;
      { rt.is_capturing(s) } noexcept -> std::same_as<Result<bool>>;
      { rt.host_access(p, n, mode) } noexcept -> std::same_as<void>;
    };

/// Runtimes that can allocate the memory a cache needs (device, pinned host).
/// deallocate may take the kind (CUDA frees pinned and device memory differently) or not.
template <class R>
concept allocating_runtime =
    runtime<R> && requires(R& rt, std::size_t n, MemoryKind kind) {
      { rt.allocate(n, kind) } -> std::same_as<Result<void*>>;
    } && (requires(R& rt, void* p, MemoryKind kind) { rt.deallocate(p, kind); } ||
          requires(R& rt, void* p) { rt.deallocate(p); });

/// Runtimes that issue many copies in one call (the Batched staging policy).
template <class R>
concept batching_runtime = runtime<R> && requires(R& rt, std::span<const CopyDesc> copies, typename R::Stream s) {
  { rt.copy_batch_async(copies, s) } noexcept -> std::same_as<Status>;
};

// ---- layouts -------------------------------------------------------------------------------

/// The expert layout interface: which tensors an expert has and how many bytes each takes
/// (`tensors()`: ExpertTensorBytes; 0 = absent), plus a check of the layout's own parameters
/// (`validate()`: ok or invalid_argument). The cache sizes its pools and slots from it.
template <class L>
concept expert_layout = requires(const L& l) {
  { L::name } -> std::convertible_to<std::string_view>;
  { l.tensors() } -> std::same_as<ExpertTensorBytes>;
  { l.validate() } -> std::same_as<Status>;
};

/// Another name of expert_layout, accepted wherever it is.
template <class L>
concept scale_layout = expert_layout<L>;

// ---- staging -------------------------------------------------------------------------------

/// The staging policy interface: how a prepare()'s fills are issued, on the stream the ordering
/// core hands it (already ordered after earlier use, published afterwards), reading only
/// Storage's copy regions.
/// - `S::uses_copy_stream`: fills run on the cache-owned copy stream (else on the caller's).
/// - `issue(rt, stream, storage, fills)`: enqueues every fill's copies on `stream`; returns the
///   first failure.
/// - Optional: `precheck(rt, caller)`, called before planning (e.g. Batched refusing stream
///   capture).
template <class S, class R, template <class> class Storage>
concept staging_policy_for = allocating_runtime<R> && requires(S& s, R& rt, typename R::Stream st,
                                                                const Storage<R>& storage, std::span<const SlotFill> f) {
  { S::name } -> std::convertible_to<std::string_view>;
  { S::uses_copy_stream } -> std::convertible_to<bool>;
  { s.issue(rt, st, storage, f) } noexcept -> std::same_as<Status>;
};

/// Whether a staging policy value issues on the cache-owned copy stream: its static
/// uses_copy_stream, or, for a type that holds one of several policies (AnyStaging), the held one's.
template <class S>
constexpr bool uses_copy_stream_of(const S& staging) noexcept {
  if constexpr (requires { { staging.dynamic_uses_copy_stream() } -> std::same_as<bool>; }) {
    return staging.dynamic_uses_copy_stream();
  } else {
    return S::uses_copy_stream;
  }
}

namespace detail {
// The smallest allocating, batching runtime: declarations only, for concept checks in
// unevaluated contexts (the staging policies assert themselves against it).
struct RuntimeArchetype {
  struct Stream {
    int id = 0;
    friend bool operator==(Stream, Stream) = default;
  };
  struct Event {
    int id = 0;
    friend bool operator==(Event, Event) = default;
  };
  Result<Stream> create_stream();
  void destroy_stream(Stream) noexcept;
  Result<Event> create_event();
  void destroy_event(Event) noexcept;
  Status record(Event, Stream) noexcept;
  Status wait(Stream, Event) noexcept;
  Result<bool> query(Event) noexcept;
  Status synchronize(Event) noexcept;
  Status synchronize(Stream) noexcept;
  Status copy_async(void*, const void*, std::size_t, Stream) noexcept;
  Status copy_batch_async(std::span<const CopyDesc>, Stream) noexcept;
  Result<bool> is_capturing(Stream) noexcept;
  void host_access(const void*, std::size_t, AccessMode) noexcept;
  Result<void*> allocate(std::size_t, MemoryKind);
  void deallocate(void*, MemoryKind) noexcept;
};
}  // namespace detail

static_assert(runtime<detail::RuntimeArchetype>);
static_assert(allocating_runtime<detail::RuntimeArchetype>);
static_assert(batching_runtime<detail::RuntimeArchetype>);

}  // namespace expert_cache::inline v0
