#pragma once
/// AnyPolicy: one eviction_policy type holding any of the library's online policies, picked at run
/// time by name.
// The run-time-selected cache (any/any_cache.hpp) plans with it, so a cache is instantiated once
// per storage and staging choice instead of once per policy as well: the policies' own code is
// compiled once, in this class.
//
// Dispatch is a switch over a closed list (std::variant), not a virtual call: the planner calls
// the policy once per unique id of every forward, and a switch on a constant index is predicted
// and lets each policy's small on_hit be inlined where a virtual call could not. A policy added
// to the library becomes selectable by adding it to AnyPolicy::Variant and `names` below.
//
// The free-slot order (Lfru hands out the highest slot first, as vLLM's cached provider) is the
// held policy's, reported per instance (free_slot_order_of(policy), base/concepts.hpp). Host-only.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/fixed_vector.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/eviction/arc.hpp"
#include "expert_cache/eviction/crf.hpp"
#include "expert_cache/eviction/layer_share.hpp"
#include "expert_cache/eviction/lfru.hpp"
#include "expert_cache/eviction/lrfu.hpp"
#include "expert_cache/eviction/lru.hpp"
#include "expert_cache/eviction/pool_layout.hpp"
#include "expert_cache/eviction/s3fifo.hpp"
#include "expert_cache/eviction/sieve.hpp"
#include "expert_cache/eviction/wtinylfu.hpp"

namespace expert_cache::inline v0 {

/// One eviction_policy holding any of the library's online policies, chosen by name at run time
/// (use it as AnyPolicy).
template <class = void>
class BasicAnyPolicy {
 public:
  // Belady is not here: it needs the future trace (make_policy<Belady>, the replay tool). The
  // list of held types: only its size and alternatives are read (the held policy is one heap
  // object of its own type, not a std::variant, whose machinery every build would instantiate).
  using Variant = std::variant<Lru, Lfru, Sieve, S3Fifo, Arc, WTinyLfu, Lrfu, LayerShare, Crf>;
  static constexpr std::array<std::string_view, std::variant_size_v<Variant>> names = {
      Lru::name, Lfru::name, Sieve::name, S3Fifo::name, Arc::name, WTinyLfu::name, Lrfu::name, LayerShare::name,
      Crf::name};
  // The planner's name for error messages; held_name() is the held policy's.
  static constexpr std::string_view name = "any";

 private:
  template <std::size_t I>
  using Alternative = std::variant_alternative_t<I, Variant>;
  static constexpr std::size_t count = std::variant_size_v<Variant>;
  // The index of P in the list (count when P is not in it).
  template <class P, std::size_t... I>
  static constexpr std::size_t index_of_type(std::index_sequence<I...>) noexcept {
    std::size_t k = count;
    ((std::is_same_v<P, Alternative<I>> ? (void)(k = I) : void()), ...);
    return k;
  }
  template <class P>
  static constexpr std::size_t type_index = index_of_type<P>(std::make_index_sequence<count>{});

  // A switch over the held index (what std::visit generates for a short list, spelled out):
  // f(the held policy as its own type), `p` pointing to the held policy of index `index`.
  template <class Ptr, class F>
  static decltype(auto) visit_ptr(std::size_t index, Ptr p, F&& f) {
    switch (index) {
      case 0: return f(*cast<0>(p));
      case 1: return f(*cast<1>(p));
      case 2: return f(*cast<2>(p));
      case 3: return f(*cast<3>(p));
      case 4: return f(*cast<4>(p));
      case 5: return f(*cast<5>(p));
      case 6: return f(*cast<6>(p));
      case 7: return f(*cast<7>(p));
      default: return f(*cast<8>(p));
    }
  }
  static_assert(count == 9, "visit_ptr: one case per alternative");
  template <std::size_t I>
  static Alternative<I>* cast(void* p) noexcept {
    return static_cast<Alternative<I>*>(p);
  }
  template <std::size_t I>
  static const Alternative<I>* cast(const void* p) noexcept {
    return static_cast<const Alternative<I>*>(p);
  }
  template <class F>
  decltype(auto) visit(F&& f) {
    return visit_ptr(held_.get_deleter().index, held_.get(), std::forward<F>(f));
  }
  template <class F>
  decltype(auto) visit(F&& f) const {
    return visit_ptr(held_.get_deleter().index, static_cast<const void*>(held_.get()), std::forward<F>(f));
  }

  // Owns the held policy: deletes it as its own type.
  struct Deleter {
    std::size_t index = 0;
    void operator()(void* p) const noexcept {
      visit_ptr(index, p, [](auto& policy) noexcept { delete &policy; });
    }
  };
  using Held = std::unique_ptr<void, Deleter>;

  template <std::size_t I>
  static void begin_forward_as(BasicAnyPolicy& self, std::span<const ExpertId> ids) noexcept {
    auto& p = *cast<I>(self.held_.get());
    self.replay_hits(p);
    if constexpr (has_begin_forward<Alternative<I>>) p.begin_forward(ids);
    // The hits before the forward's first miss are told now (all of an all-hit forward's).
    const std::size_t i = tell_hits(p, ids.data(), ids.size(), self.resident_.data());
    self.forward_.assign(ids.begin() + static_cast<std::ptrdiff_t>(i), ids.end());
    self.replayed_ = 0;
  }
  using BeginForward = void (*)(BasicAnyPolicy&, std::span<const ExpertId>) noexcept;
  template <std::size_t... I>
  static constexpr std::array<BeginForward, sizeof...(I)> begin_table(std::index_sequence<I...>) noexcept {
    return {&begin_forward_as<I>...};
  }

 public:
  /// Holds a policy built by the caller.
  /// @param policy  one of the listed policies, for `shape`, that has seen no call yet
  /// @param shape   the cache's experts and slots
  template <class P>
    requires(type_index<std::remove_cvref_t<P>> < count)
  BasicAnyPolicy(P&& policy, CacheShape shape)
      : BasicAnyPolicy(Adopt{},
                       Held(new std::remove_cvref_t<P>(std::forward<P>(policy)), Deleter{type_index<std::remove_cvref_t<P>>}),
                       shape) {}

  /// Builds the policy named `policy_name`.
  /// @param policy_name  one of `names` (lru, lfru, sieve, s3fifo, arc, wtinylfu, lrfu,
  ///                     layershare, crf)
  /// @param shape        the cache's experts and slots
  /// @param pool         the layer split for the layer-aware ones (lrfu, layershare)
  /// @return the policy; invalid_argument for an unknown name (listing the valid ones), a shape
  ///         no planner accepts is refused as the planner refuses it (before anything is
  ///         allocated), a policy constructor's Error comes back as its Status
  [[nodiscard, gnu::cold]] static Result<BasicAnyPolicy> make(std::string_view policy_name, CacheShape shape,
                                              const PoolLayout& pool = {}) {
    const std::optional<std::size_t> index = index_of(policy_name);
    if (!index) {
      return Status::format(ErrorCode::invalid_argument, "unknown eviction policy '%.*s' (valid: %s)",
                            static_cast<int>(std::min<std::size_t>(policy_name.size(), 40)), policy_name.data(),
                            name_list().text);
    }
    if (shape.num_experts <= 0) {
      return Status::format(ErrorCode::invalid_argument, "num_experts must be positive, got %d", shape.num_experts);
    }
    if (shape.capacity <= 0 || shape.capacity > shape.num_experts) {
      return Status::format(ErrorCode::invalid_capacity, "capacity must be in [1, num_experts=%d], got %d",
                            shape.num_experts, shape.capacity);
    }
    try {
      return make_at(*index, shape, pool, std::make_index_sequence<count>{});
    } catch (const Error& e) {  // the message without the "code: " prefix Error adds
      std::string_view m = e.what();
      const std::string_view code = to_string(e.code());
      if (m.size() > code.size() + 2 && m.substr(0, code.size()) == code) m.remove_prefix(code.size() + 2);
      return Status(e.code(), m);
    } catch (const std::bad_alloc&) {
      return Status(ErrorCode::runtime_failure, "AnyPolicy::make: out of host memory");
    }
  }

  /// @param policy_name  a policy name
  /// @return its index in `names`, or nullopt when it names no policy here
  [[nodiscard]] static constexpr std::optional<std::size_t> index_of(std::string_view policy_name) noexcept {
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (names[i] == policy_name) return i;
    }
    return std::nullopt;
  }

  // Hits are the hot path (an all-hit forward makes nothing but them), so on_hit does nothing:
  // a forward's hits are known without it. An id that is resident when the forward begins is a
  // hit (the planner never evicts an id of the forward being planned), any other a miss,
  // inserted in its turn. begin_forward tells the held policy the hits before the first miss
  // at once (all of them for an all-hit forward: one dispatch per forward) and keeps the rest of
  // the ids; the hits among those are told, in order, before the held policy is asked or told
  // anything else (choose_victim, on_insert, on_remove, the next begin_forward, ==, held<P>()).
  // It sees exactly the call sequence a static policy sees. Residency is tracked here from
  // on_insert / on_remove (the planner reports every change through them).
  void on_hit(ExpertId) noexcept {}
  // One indirect call per forward into the held policy's own begin_forward_as<P> (a table, not
  // the switch: nine policies' hit loops inlined into the planner's forward would crowd it).
  void begin_forward(std::span<const ExpertId> ids) noexcept {
    static constexpr auto table = begin_table(std::make_index_sequence<count>{});
    table[index()](*this, ids);
  }
  // The miss-path calls stay out of line: one copy of the nine policies' code per program, not
  // one per call site (a miss costs a copy, which dwarfs the call).
  [[gnu::noinline]] void on_insert(ExpertId e) noexcept {
    visit([&](auto& p) noexcept {
      replay_hits(p);
      p.on_insert(e);
    });
    if (replayed_ < forward_.size() && forward_[replayed_] == e) ++replayed_;  // this forward's miss
    resident_[e.index()] = 1;
  }
  [[gnu::noinline]] void on_remove(ExpertId e) noexcept {
    visit([&](auto& p) noexcept {
      replay_hits(p);
      p.on_remove(e);
    });
    resident_[e.index()] = 0;
  }
  // Not const: some policies update their state while looking (LayerShare, Lrfu).
  [[gnu::noinline]] [[nodiscard]] ExpertId choose_victim(const ForwardSet& needed) noexcept {
    return visit([&](auto& p) noexcept {
      replay_hits(p);
      return p.choose_victim(needed);
    });
  }
  [[nodiscard]] FreeSlotOrder dynamic_free_slot_order() const noexcept {
    return visit([](const auto& p) noexcept { return free_slot_order_of<std::remove_cvref_t<decltype(p)>>(); });
  }

  /// The held policy's name.
  [[nodiscard]] std::string_view held_name() const noexcept { return names[index()]; }
  /// The held policy's index in `names`.
  [[nodiscard]] std::size_t index() const noexcept { return held_.get_deleter().index; }

  // A value like the policies it holds (copies are deep); the held policy lives on the heap so
  // that the planner holding an AnyPolicy stays as compact as one holding Lru (the largest
  // policies are several hundred bytes, and the planner's hot members come after its policy).
  BasicAnyPolicy(const BasicAnyPolicy& o)
      : held_(o.visit([](const auto& p) -> void* { return new std::remove_cvref_t<decltype(p)>(p); }), o.held_.get_deleter()),
        resident_(o.resident_),
        forward_(o.forward_),
        replayed_(o.replayed_) {}
  BasicAnyPolicy& operator=(const BasicAnyPolicy& o) {
    if (this != &o) *this = BasicAnyPolicy(o);
    return *this;
  }
  BasicAnyPolicy(BasicAnyPolicy&&) noexcept = default;
  BasicAnyPolicy& operator=(BasicAnyPolicy&&) noexcept = default;
  ~BasicAnyPolicy() = default;
  /// A copy of the held policy with every recorded hit applied (tests compare it with a static
  /// one); nullopt when another policy is held.
  template <class P>
  [[nodiscard]] std::optional<P> held() const {
    BasicAnyPolicy copy = *this;
    copy.flush();
    static_assert(type_index<P> < count, "held<P>: P is not a listed policy");
    if (copy.index() == type_index<P>) return *static_cast<const P*>(copy.held_.get());
    return std::nullopt;
  }
  /// Tells the held policy the hits it has not been told yet.
  void flush() noexcept {
    visit([&](auto& p) noexcept { replay_hits(p); });
  }

  // The same held policy in the same state once told every hit (on copies: equality is for tests
  // and snapshots, never the hot path).
  friend bool operator==(const BasicAnyPolicy& a, const BasicAnyPolicy& b) {
    BasicAnyPolicy x = a, y = b;
    x.flush();
    y.flush();
    return x.index() == y.index() && x.visit([&](const auto& p) {
             return p == *static_cast<const std::remove_cvref_t<decltype(p)>*>(y.held_.get());
           });
  }

 private:

  struct Adopt {};
  BasicAnyPolicy(Adopt, Held held, CacheShape shape)
      : held_(std::move(held)),
        resident_(static_cast<std::size_t>(std::max(shape.num_experts, 0)), 0),
        forward_(static_cast<std::size_t>(std::max(shape.capacity, 0))) {}

  // One small function per policy (its constructor, then the heap block it moves into, as the
  // public constructor orders them), picked from a table; the rest of the construction is
  // shared, so a build compiles it once, not once per policy.
  template <std::size_t I>
  [[gnu::cold]] static Held make_held(CacheShape shape, const PoolLayout& pool) {
    Alternative<I> policy = build<Alternative<I>>(shape, pool);
    return Held(new Alternative<I>(std::move(policy)), Deleter{I});
  }
  template <std::size_t... I>
  [[gnu::cold]] static BasicAnyPolicy make_at(std::size_t index, CacheShape shape, const PoolLayout& pool,
                                             std::index_sequence<I...>) {
    using MakeHeld = Held (*)(CacheShape, const PoolLayout&);
    static constexpr std::array<MakeHeld, sizeof...(I)> makers = {&make_held<I>...};
    return BasicAnyPolicy(Adopt{}, makers[index](shape, pool), shape);  // index: from index_of, in range
  }
  template <class P>
  static P build(CacheShape shape, const PoolLayout& pool) {
    if constexpr (std::is_constructible_v<P, CacheShape, PoolLayout>) {
      return P(shape, pool);
    } else {
      return P(shape);
    }
  }

  struct NameList {
    char text[120] = {};
  };
  static NameList name_list() noexcept {
    NameList out;
    std::size_t at = 0;
    for (std::size_t i = 0; i < names.size(); ++i) {
      for (std::string_view part : {i == 0 ? std::string_view() : std::string_view(", "), names[i]}) {
        for (char c : part) {
          if (at + 1 < sizeof out.text) out.text[at++] = c;
        }
      }
    }
    return out;
  }


  // The forward's hits not yet told: from replayed_ up to its next miss (an id not resident yet;
  // once the forward is done every id of it is resident, so all of them).
  template <class P>
  void replay_hits(P& p) noexcept {
    if (replayed_ < forward_.size()) {
      replayed_ += tell_hits(p, forward_.begin() + replayed_, forward_.size() - replayed_, resident_.data());
    }
  }
  // Tells `p` the leading hits of [ids, ids + n) (the ids resident now, up to the first that is
  // not) and returns how many: the one loop over a policy's on_hit, out of line, so that each
  // policy's on_hit is compiled once, not once per caller (a forward's first hits, and the
  // replay before each miss-path call).
  template <class P>
  [[gnu::noinline]] static std::size_t tell_hits(P& p, const ExpertId* ids, std::size_t n,
                                                 const std::uint8_t* resident) noexcept {
    std::size_t i = 0;
    for (; i < n && resident[ids[i].index()] != 0; ++i) p.on_hit(ids[i]);
    return i;
  }

  Held held_;                             // never null but after a move; its deleter holds the index
  std::vector<std::uint8_t> resident_;    // per expert: 1 while resident (from on_insert / on_remove)
  detail::FixedVector<ExpertId> forward_; // the current forward's unique ids, in processing order
  std::size_t replayed_ = 0;              // forward_[0, replayed_) were told (hit or insert)
};

/// The run-time-selected eviction policy. A class template only so that what a program does
/// not call (copies, comparisons, held<P>()) is compiled where it is called, not in every
/// translation unit that includes this header.
using AnyPolicy = BasicAnyPolicy<void>;

static_assert(eviction_policy<AnyPolicy>);
static_assert(has_begin_forward<AnyPolicy>);

}  // namespace expert_cache::inline v0
