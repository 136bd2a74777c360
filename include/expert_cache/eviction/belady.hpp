#pragma once
/// Belady's MIN (OPT): the offline optimum for demand fetching.
// Built from the whole sequence of forwards one cache will see; evicts the resident outside the
// current forward whose next request is furthest away (never again = infinitely far; ties: lowest
// id).
// Works on any id space [0, num_experts), e.g. layer * E + expert for one global cache.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/fixed_vector.hpp"
#include "expert_cache/base/status.hpp"

namespace expert_cache::inline v0 {

/// The request sequence, indexed by expert: for each id the ascending list of forwards
/// (0-based) that request it. Immutable and shared by every copy of a Belady policy.
class BeladyFuture {
 public:
  static constexpr std::uint32_t never = std::numeric_limits<std::uint32_t>::max();

  /// @param num_experts  the id space [0, num_experts)
  /// @param forwards     `forwards[t]` = the unique ids of forward t (any order)
  /// @throws Error on an id outside [0, num_experts) or a duplicate inside one forward
  BeladyFuture(std::int32_t num_experts, const std::vector<std::vector<std::int32_t>>& forwards)
      : num_experts_(num_experts), num_forwards_(forwards.size()) {
    if (num_experts <= 0) {
      throw Error(ErrorCode::invalid_argument, "BeladyFuture: num_experts must be positive");
    }
    if (forwards.size() >= never) {
      throw Error(ErrorCode::invalid_argument, "BeladyFuture: too many forwards");
    }
    const auto n = static_cast<std::size_t>(num_experts);
    offsets_.assign(n + 1, 0);
    forward_sizes_.reserve(forwards.size());
    for (std::size_t t = 0; t < forwards.size(); ++t) {
      forward_sizes_.push_back(static_cast<std::uint32_t>(forwards[t].size()));
      for (const std::int32_t id : forwards[t]) {
        if (id < 0 || id >= num_experts) {
          throw Error(ErrorCode::expert_out_of_range,
                      "BeladyFuture: forward " + std::to_string(t) + " holds id " + std::to_string(id) +
                          " outside [0, " + std::to_string(num_experts) + ")");
        }
        ++offsets_[static_cast<std::size_t>(id) + 1];
      }
    }
    for (std::size_t i = 0; i < n; ++i) offsets_[i + 1] += offsets_[i];
    uses_.resize(offsets_[n]);
    std::vector<std::size_t> fill(offsets_.begin(), offsets_.end() - 1);
    for (std::size_t t = 0; t < forwards.size(); ++t) {
      for (const std::int32_t id : forwards[t]) {
        std::size_t& at = fill[static_cast<std::size_t>(id)];
        // Forwards are visited in order, so a duplicate would repeat the previous entry.
        if (at > offsets_[static_cast<std::size_t>(id)] && uses_[at - 1] == t) {
          throw Error(ErrorCode::duplicate_expert,
                      "BeladyFuture: forward " + std::to_string(t) + " lists id " + std::to_string(id) + " twice");
        }
        uses_[at++] = static_cast<std::uint32_t>(t);
      }
    }
  }

  [[nodiscard]] std::int32_t num_experts() const noexcept { return num_experts_; }
  [[nodiscard]] std::size_t num_forwards() const noexcept { return num_forwards_; }
  [[nodiscard]] std::size_t forward_size(std::size_t t) const noexcept { return forward_sizes_[t]; }
  // Forwards that request `id`, ascending.
  [[nodiscard]] std::span<const std::uint32_t> uses(std::int32_t id) const noexcept {
    const auto i = static_cast<std::size_t>(id);
    return {uses_.data() + offsets_[i], offsets_[i + 1] - offsets_[i]};
  }

 private:
  std::int32_t num_experts_;
  std::size_t num_forwards_;
  std::vector<std::size_t> offsets_;  // CSR over ids
  std::vector<std::uint32_t> uses_;
  std::vector<std::uint32_t> forward_sizes_;
};

/// Belady's MIN (an eviction_policy): offline, it needs the forwards it will see.
class Belady {
 public:
  static constexpr std::string_view name = "belady";

  /// @param future  the forwards this cache will see, in order
  /// @param shape   the cache's experts and slots; num_experts must equal
  ///                future->num_experts()
  /// @throws Error invalid_argument when `future` is null or covers another id space
  Belady(std::shared_ptr<const BeladyFuture> future, CacheShape shape)
      : future_(std::move(future)),
        cursor_(static_cast<std::size_t>(shape.num_experts), 0),
        next_(static_cast<std::size_t>(shape.num_experts), BeladyFuture::never),
        residents_(static_cast<std::size_t>(shape.capacity)),
        slot_of_(static_cast<std::size_t>(shape.num_experts), -1) {
    if (!future_ || future_->num_experts() != shape.num_experts) {
      throw Error(ErrorCode::invalid_argument, "Belady: the future must cover exactly num_experts ids");
    }
  }

  // Advances to the next forward, checks that it is the one the future predicted, and
  // refreshes the next use of its ids (the only ids whose next use changes here).
  void begin_forward(std::span<const ExpertId> ids) noexcept {
    ++position_;
    // Every id must be requested here and the counts must agree (ids are unique).
    bool matches = position_ < future_->num_forwards() && future_->forward_size(position_) == ids.size();
    for (const ExpertId e : ids) {
      const auto uses = future_->uses(e.value);
      std::uint32_t& c = cursor_[e.index()];
      while (c < uses.size() && uses[c] < position_) ++c;  // ids only move forward: amortised O(1)
      const bool here = c < uses.size() && uses[c] == position_;
      matches = matches && here;
      const std::uint32_t after = here ? c + 1 : c;
      next_[e.index()] = after < uses.size() ? uses[after] : BeladyFuture::never;
    }
    if (!matches) ++divergent_forwards_;
  }

  void on_hit(ExpertId) noexcept {}
  void on_insert(ExpertId e) noexcept {
    slot_of_[e.index()] = static_cast<std::int32_t>(residents_.size());
    residents_.push_back(e.value);  // residents <= capacity: fits the fixed storage
  }
  void on_remove(ExpertId e) noexcept {
    const std::int32_t at = slot_of_[e.index()];
    if (at < 0) return;
    const std::int32_t moved = residents_.back();
    residents_[static_cast<std::size_t>(at)] = moved;
    slot_of_[static_cast<std::size_t>(moved)] = at;
    residents_.pop_back();
    slot_of_[e.index()] = -1;
  }

  [[nodiscard]] ExpertId choose_victim(const ForwardSet& needed) const noexcept {
    std::int32_t best = -1;
    std::uint32_t best_next = 0;
    for (const std::int32_t e : residents_) {
      if (needed.contains(ExpertId(e))) continue;
      const std::uint32_t next = next_[static_cast<std::size_t>(e)];
      if (best < 0 || next > best_next || (next == best_next && e < best)) {
        best = e;
        best_next = next;
      }
    }
    return ExpertId(best);
  }

  // Forwards whose ids differed from the future (0 when used as intended).
  [[nodiscard]] std::uint64_t divergent_forwards() const noexcept { return divergent_forwards_; }
  [[nodiscard]] const std::shared_ptr<const BeladyFuture>& future() const noexcept { return future_; }

  friend bool operator==(const Belady& a, const Belady& b) noexcept {
    return a.future_ == b.future_ && a.position_ == b.position_ && a.cursor_ == b.cursor_ && a.next_ == b.next_ &&
           a.residents_ == b.residents_ && a.slot_of_ == b.slot_of_ &&
           a.divergent_forwards_ == b.divergent_forwards_;
  }

 private:
  std::shared_ptr<const BeladyFuture> future_;
  std::uint32_t position_ = static_cast<std::uint32_t>(-1);  // forward being planned
  std::vector<std::uint32_t> cursor_;     // per id: index into future_->uses(id)
  std::vector<std::uint32_t> next_;       // per id: next forward requesting it after its last one
  detail::FixedVector<std::int32_t> residents_;  // dense, unordered (copies keep room)
  std::vector<std::int32_t> slot_of_;     // id -> index in residents_, -1 absent
  std::uint64_t divergent_forwards_ = 0;
};

static_assert(eviction_policy<Belady>);
static_assert(has_begin_forward<Belady>);

}  // namespace expert_cache::inline v0
