#pragma once
/// Which staging policies issue plain copies of the regions they are given, so that a run of
/// consecutive experts in consecutive slots can travel as one copy per region.
#include <concepts>
#include <type_traits>

#include "expert_cache/staging/copy_staging.hpp"
#include "expert_cache/storage/copy_region.hpp"

namespace expert_cache::inline v0::detail {

// A storage's copy regions widened to a run of `n` consecutive experts in consecutive slots:
// what a copy-based staging policy reads for ONE fill (the run's first expert and slot).
struct RunCopyRegions {
  CopyRegions regions{};
  [[nodiscard]] const CopyRegions& copy_regions() const noexcept { return regions; }
};

// A region coalesces when both sides are densely packed (host_stride == slot_stride == bytes):
// tensor-major pools and expert-major blobs do, an expert-major host scattered into per-tensor
// slots (ExpertMajorHostStorage) does not.
[[nodiscard]] constexpr bool dense_region(const CopyRegion& r) noexcept {
  return r.host_stride == r.bytes && r.slot_stride == r.bytes;
}

// Staging policies whose issue() is plain copies of the regions it is given (copy_staging.hpp):
// they accept a RunCopyRegions. Others (Gather caches per-storage state) get per-expert fills.
template <class Staging>
struct StaticCoalescing
    : std::bool_constant<std::is_same_v<Staging, CopyStream> || std::is_same_v<Staging, Inline> ||
                         std::is_same_v<Staging, Batched>> {};

// A staging policy that holds one of several at run time (AnyStaging) answers for the held one:
// held_has<Trait>() is Trait of the held policy.
template <class Staging>
concept run_time_staging = requires(const Staging& s) {
  { s.template held_has<StaticCoalescing>() } -> std::convertible_to<bool>;
};

// May `Staging` coalesce (compile time: the code paths exist), and does this instance (run time).
template <class Staging>
inline constexpr bool coalescing_staging = StaticCoalescing<Staging>::value || run_time_staging<Staging>;

template <class Staging>
[[nodiscard]] bool coalesces(const Staging& staging) noexcept {
  if constexpr (StaticCoalescing<Staging>::value) {
    return true;
  } else if constexpr (run_time_staging<Staging>) {
    return staging.template held_has<StaticCoalescing>();
  } else {
    (void)staging;
    return false;
  }
}

}  // namespace expert_cache::inline v0::detail
