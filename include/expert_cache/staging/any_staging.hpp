#pragma once
/// AnyStaging<Stagings...>: one staging-policy type holding any of the listed staging policies,
/// picked at run time.
// The run-time-selected cache (any/any_cache.hpp) issues its fills through it, so a cache is
// instantiated once per storage instead of once per storage and staging.
//
// Where fills run is the held policy's: the cache asks uses_copy_stream_of(staging)
// (base/concepts.hpp), which reads dynamic_uses_copy_stream(); the static uses_copy_stream the
// concept names is the first alternative's (what a default-constructed AnyStaging holds).
// precheck and issue dispatch with a switch over the held index (a prepare calls precheck once;
// issue only when it has fills). A listed policy the runtime cannot run (Batched without
// copy_batch_async, Gather off CUDA) is refused with not_supported; the factory never selects
// one. Host-only (Gather comes from a CUDA translation unit's list: any/any_cache_cuda.cuh).
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <tuple>
#include <utility>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/staging/coalescing.hpp"
#include "expert_cache/storage/copy_region.hpp"

namespace expert_cache::inline v0 {

namespace detail {
// What a plain-copy staging policy (StaticCoalescing: Inline, CopyStream, Batched) reads of the
// storage it is given: its copy regions, here by reference.
struct CopyRegionsView {
  const CopyRegions* regions = nullptr;
  [[nodiscard]] const CopyRegions& copy_regions() const noexcept { return *regions; }
};
}  // namespace detail

/// One staging policy holding any of `Stagings...` (one to eight), chosen at run time; a
/// default-constructed one holds the first.
template <class... Stagings>
class AnyStaging {
  static_assert(sizeof... (Stagings) >= 1 && sizeof...(Stagings) <= 8, "AnyStaging: one to eight policies");
  // Every listed policy, default-constructed (stateless, or empty until it issues), and the
  // index of the held one: the others are never called. A tuple, not a std::variant, whose
  // machinery every build would instantiate.
  using Held = std::tuple<Stagings...>;
  using First = std::tuple_element_t<0, Held>;

 public:
  static constexpr std::string_view name = "any";
  static constexpr bool uses_copy_stream = First::uses_copy_stream;
  static constexpr std::size_t size = sizeof...(Stagings);

  AnyStaging() = default;
  /// Holds the index-th listed policy, default-constructed.
  /// @param index  position in `Stagings...`
  /// @throws Error invalid_argument for an index past the list (the factory passes only the
  ///         index of a name it found)
  explicit AnyStaging(std::size_t index) {
    if (index >= size) {
      throw Error(ErrorCode::invalid_argument, detail::join({"AnyStaging: staging index ", detail::DecimalText(index),
                                                             " outside the ", detail::DecimalText(size), " listed policies"}));
    }
    index_ = index;
  }

  /// The held policy's position in `Stagings...`.
  [[nodiscard]] std::size_t index() const noexcept { return index_; }
  /// The held policy's name.
  [[nodiscard]] std::string_view held_name() const noexcept {
    return visit_at(staging_, [](const auto& g) noexcept { return std::string_view(std::remove_cvref_t<decltype(g)>::name); });
  }
  /// Trait<held policy>::value: e.g. whether the held policy coalesces runs of copies (cache/wide.hpp).
  template <template <class> class Trait>
  [[nodiscard]] bool held_has() const noexcept {
    return visit_at(staging_, [](const auto& g) noexcept { return bool(Trait<std::remove_cvref_t<decltype(g)>>::value); });
  }
  [[nodiscard]] bool dynamic_uses_copy_stream() const noexcept {
    return visit_at(staging_, [](const auto& g) noexcept { return bool(std::remove_cvref_t<decltype(g)>::uses_copy_stream); });
  }

  template <class R>
  Status precheck(R& rt, typename R::Stream caller) noexcept {
    return visit_at(staging_, [&](auto& g) noexcept -> Status {
      if constexpr (requires { g.precheck(rt, caller); }) {
        return g.precheck(rt, caller);
      } else {
        Status ok;  // default-initialised: `return {}` would zero the whole message buffer on every prepare
        return ok;
      }
    });
  }

  // Out of line: called only with fills, whose copies dwarf the call. When every listed policy
  // only copies regions, every storage type the cache issues from (its storage, a wide
  // forward's runs) reaches one dispatch over the regions, so each policy's issue is compiled
  // once, not once per type.
  template <class R, class Storage>
  Status issue(R& rt, typename R::Stream stream, const Storage& storage, std::span<const SlotFill> fills) noexcept {
    if constexpr ((detail::StaticCoalescing<Stagings>::value && ...)) {
      return issue_held(rt, stream, detail::CopyRegionsView{&storage.copy_regions()}, fills);
    } else {
      return issue_held(rt, stream, storage, fills);
    }
  }

 private:
  template <class R, class Storage>
  [[gnu::noinline]] Status issue_held(R& rt, typename R::Stream stream, const Storage& storage,
                                      std::span<const SlotFill> fills) noexcept {
    return visit_at(staging_, [&](auto& g) noexcept -> Status {
      if constexpr (requires { g.issue(rt, stream, storage, fills); }) {
        return g.issue(rt, stream, storage, fills);
      } else {
        return Status::format(ErrorCode::not_supported, "staging '%.*s' cannot run on this runtime",
                              static_cast<int>(std::remove_cvref_t<decltype(g)>::name.size()),
                              std::remove_cvref_t<decltype(g)>::name.data());
      }
    });
  }

  // A switch over the held index (see AnyPolicy): predicted, and the held policy's code inlined.
  template <class V, class F>
  decltype(auto) visit_at(V& v, F&& f) const {
    return visit_from<0>(v, f);
  }
  template <std::size_t I, class V, class F>
  decltype(auto) visit_from(V& v, F& f) const {
    if constexpr (I + 1 == size) {
      return f(std::get<I>(v));
    } else {
      if (index_ == I) return f(std::get<I>(v));
      return visit_from<I + 1>(v, f);
    }
  }

  Held staging_{};
  std::size_t index_ = 0;
};

}  // namespace expert_cache::inline v0
