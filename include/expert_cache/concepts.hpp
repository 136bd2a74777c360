#pragma once
// The compile-time policy concepts ExpertCache is composed from. Host-only.
#include <concepts>
#include <cstdint>
#include <span>
#include <string_view>

#include "expert_cache/types.hpp"

namespace expert_cache::inline v0 {

// Size of one cache: how many experts exist and how many slots hold them.
struct CacheShape {
  std::int32_t num_experts = 0;
  std::int32_t capacity = 0;
  friend bool operator==(const CacheShape&, const CacheShape&) = default;
};

// The unique experts of the forward being planned. Policies must never choose a victim
// that this set contains (in-forward victim protection, the bug class vLLM #50562 fixed).
// Membership is an epoch-stamped array lookup, so testing it costs one load.
class ForwardSet {
 public:
  constexpr ForwardSet(const std::uint32_t* stamps, std::uint32_t epoch) noexcept
      : stamps_(stamps), epoch_(epoch) {}
  [[nodiscard]] constexpr bool contains(ExpertId e) const noexcept {
    return stamps_[e.index()] == epoch_;
  }

 private:
  const std::uint32_t* stamps_;
  std::uint32_t epoch_;
};

// An eviction policy tracks the order of the residents and names a victim when a miss
// finds no free slot. The planner owns residency (expert <-> slot); the policy only ranks.
// Call protocol, per forward: begin_forward (optional hook), then for each unique expert
// in processing order either on_hit, or [choose_victim + on_remove(victim)] + on_insert.
// invalidate() calls on_remove outside a forward. Policies are values: copyable and
// equality comparable so that tests can snapshot the whole cache state.
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

// Optional hook: told the forward's unique experts before any on_hit/on_insert (Belady
// uses it to advance its position in the trace).
template <class P>
concept has_begin_forward = requires(P& p, std::span<const ExpertId> ids) {
  { p.begin_forward(ids) } noexcept;
};

// Which free slot a miss takes first. Both providers pop a LIFO free list; they differ in
// its initial order. vLLM's cached provider hands out capacity-1 first, the row provider 0.
enum class FreeSlotOrder : std::uint8_t { lowest_first, highest_first };

template <class P>
constexpr FreeSlotOrder free_slot_order_of() noexcept {
  if constexpr (requires { P::free_slot_order; }) {
    return P::free_slot_order;
  } else {
    return FreeSlotOrder::lowest_first;
  }
}

}  // namespace expert_cache::inline v0
