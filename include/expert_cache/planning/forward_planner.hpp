#pragma once
/// The host forward planner: one forward's ids become hits, misses, victims and slots, validated first.
// Forward planner: turns one forward's expert ids into hits, misses, victims and slot
// assignments, and keeps the resident map and the forward-scoped map (host mirrors).
// Validation happens before any state change: a rejected forward leaves residency,
// policy state and counters exactly as they were.
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/fixed_vector.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/types.hpp"
#include "expert_cache/prefetch/hint_selection.hpp"
#include "expert_cache/prefetch/rank_precision.hpp"

namespace expert_cache::inline v0 {

// SlotFill and SlotEviction: base/concepts.hpp (the staging concept is stated in them).

/// The outcome of planning one forward. Reused across forwards so the hot path never allocates.
struct ForwardPlan {
  std::vector<ExpertId> unique;         ///< the forward's unique experts, in processing order
  std::vector<SlotFill> fills;          ///< misses: slot `slot` must receive expert `expert`
  std::vector<SlotEviction> evictions;  ///< residents dropped to make room (their slot is in fills)
  std::uint32_t hits = 0;               ///< unique experts already resident
  std::uint32_t misses = 0;             ///< unique experts given a slot (one fill each)

  /// Empties every list and zeroes the counts (capacity kept).
  void clear() noexcept {
    unique.clear();
    fills.clear();
    evictions.clear();
    hits = misses = 0;
  }
};

/// The outcome of one plan_prefetch(). Reused across calls so the hot path never allocates.
struct PrefetchPlan {
  std::vector<SlotFill> fills;           ///< speculative fills: slot `slot` receives expert `expert`
  std::vector<SlotEviction> evictions;   ///< residents dropped for them
  std::uint32_t skipped_resident = 0;    ///< predicted entries already resident (or already in flight)
  std::uint32_t skipped_no_victim = 0;   ///< distinct predicted ids dropped: no slot may be evicted for them
  std::uint32_t skipped_unlikely = 0;    ///< scored entries below min_score, never considered
  std::uint32_t skipped_imprecise = 0;   ///< entries at a rank whose measured precision is below the threshold

  /// Empties both lists and zeroes the counts (capacity kept).
  void clear() noexcept {
    fills.clear();
    evictions.clear();
    skipped_resident = skipped_no_victim = skipped_unlikely = skipped_imprecise = 0;
  }
};

/// What a ForwardPlanner counted since construction (ExpertCache::stats() reports them).
struct PlannerCounters {
  std::uint64_t hits = 0;           ///< forward experts already resident
  std::uint64_t misses = 0;         ///< forward experts given a slot
  std::uint64_t promotions = 0;     ///< experts made resident by a forward
  std::uint64_t evictions = 0;      ///< residents evicted (forwards and prefetches)
  std::uint64_t invalidations = 0;  ///< experts dropped by invalidate()
  std::uint64_t prepare_calls = 0;  ///< accepted forwards
  std::uint64_t generation = 0;     ///< bumps on every accepted state change (forward, prefetch, invalidate)
  std::uint64_t speculative_issued = 0;  ///< experts made resident by plan_prefetch (not in promotions)
  std::uint64_t speculative_used = 0;    ///< ... later used by a forward (also counted as that forward's hit)
  std::uint64_t speculative_wasted = 0;  ///< ... expired, evicted or invalidated unused
  friend bool operator==(const PlannerCounters&, const PlannerCounters&) = default;
};

namespace detail {

// Experts watched for a number of accepted forwards, each with the rank bucket it was entered at:
// the planner's live speculative fills, its skipped hints and its fills' victims. Per expert the
// forwards left (0 = not watched) and a position in the live list, so aging visits only the live
// entries; sized at construction.
class ExpertWatchList {
 public:
  ExpertWatchList(std::int32_t num_experts, std::int32_t max_live)
      : left_(static_cast<std::size_t>(num_experts), 0u),
        pos_(static_cast<std::size_t>(num_experts), -1),
        rank_(static_cast<std::size_t>(num_experts), 0u),
        live_(static_cast<std::size_t>(max_live)) {}

  [[nodiscard]] bool contains(ExpertId e) const noexcept { return left_[e.index()] != 0; }
  [[nodiscard]] std::uint8_t rank(ExpertId e) const noexcept { return rank_[e.index()]; }
  [[nodiscard]] std::size_t size() const noexcept { return live_.size(); }
  [[nodiscard]] const ExpertId* begin() const noexcept { return live_.begin(); }
  [[nodiscard]] const ExpertId* end() const noexcept { return live_.end(); }
  // Per expert: forwards left, 0 = not watched (the planner's snapshot).
  [[nodiscard]] const std::vector<std::uint32_t>& forwards_left() const noexcept { return left_; }

  // Watches `e` (not watched yet) for `forwards` >= 1 accepted forwards.
  void add(ExpertId e, std::uint8_t rank, std::uint32_t forwards) noexcept {
    left_[e.index()] = forwards;
    rank_[e.index()] = rank;
    pos_[e.index()] = static_cast<std::int32_t>(live_.size());
    live_.push_back(e);
  }

  // Stops watching `e` (watched): swap with the last live entry.
  void remove(ExpertId e) noexcept {
    const std::int32_t at = pos_[e.index()];
    const ExpertId moved = live_.back();
    live_[static_cast<std::size_t>(at)] = moved;
    pos_[moved.index()] = at;
    live_.pop_back();
    pos_[e.index()] = -1;
    left_[e.index()] = 0;
  }

  // One accepted forward went by: every entry ages by one; those at zero are removed and passed
  // to expired(e, rank).
  template <class Expired>
  void age(Expired&& expired) noexcept {
    for (std::size_t i = live_.size(); i-- > 0;) {
      const ExpertId e = live_[i];
      if (left_[e.index()] == 1) {
        const std::uint8_t r = rank_[e.index()];
        remove(e);
        expired(e, r);
      } else {
        --left_[e.index()];
      }
    }
  }

 private:
  std::vector<std::uint32_t> left_;
  std::vector<std::int32_t> pos_;
  std::vector<std::uint8_t> rank_;
  FixedVector<ExpertId> live_;
};

}  // namespace detail

/// The host planner of one cache: residency (resident map, slot owners, free slots), the eviction policy and
/// the forward-scoped map. Host-only and synchronous: it enqueues nothing. Every call validates its input
/// before any state change, so a rejected call leaves residency, policy state and counters as they were.
/// Not thread-safe.
template <eviction_policy Policy>
class ForwardPlanner {
 public:
  /// Everything that defines the cache's observable state; equality compares it all.
  struct Snapshot {
    std::vector<std::int32_t> resident_map;
    std::vector<std::int32_t> slot_owner;
    std::vector<std::int32_t> free_slots;
    Policy policy;
    PlannerCounters counters;
    std::vector<std::uint32_t> speculative;  // per expert: forwards left before it expires, 0 = not speculative
    RankPrecision precision;                 // measured precision of speculative fills per rank
    std::vector<std::uint32_t> watched;      // per expert: forwards left to watch a skipped hint, 0 = none
    std::vector<std::uint32_t> victims;      // per expert: forwards left to watch a fill's victim, 0 = none
    friend bool operator==(const Snapshot&, const Snapshot&) = default;
  };

  /// Builds an empty planner (every slot free), sized once: planning never allocates after this.
  /// @param shape   experts and slots (CacheShape{num_experts, capacity})
  /// @param top_k   routed experts per token, in [1, capacity]
  /// @param policy  the eviction policy, made for `shape`
  /// @throws Error as validated(); std::bad_alloc when the tables cannot be allocated
  ForwardPlanner(CacheShape shape, std::int32_t top_k, Policy policy)
      : shape_(validated(shape, top_k)),
        top_k_(top_k),
        policy_(std::move(policy)),
        resident_map_(static_cast<std::size_t>(shape.num_experts), absent_slot),
        forward_map_(static_cast<std::size_t>(shape.num_experts), absent_slot),
        slot_owner_(static_cast<std::size_t>(shape.capacity), -1),
        free_slots_(static_cast<std::size_t>(shape.capacity)),
        stamps_(static_cast<std::size_t>(shape.num_experts), 0u),
        scratch_(static_cast<std::size_t>(shape.capacity)),
        previous_forward_(static_cast<std::size_t>(shape.capacity)),
        speculative_(shape.num_experts, shape.capacity),
        skipped_(shape.num_experts, shape.num_experts),
        victims_(shape.num_experts, shape.num_experts),
        hints_(shape.num_experts) {
    // The free list is a LIFO stack popped from the back.
    for (std::int32_t i = 0; i < shape.capacity; ++i) {
      free_slots_.push_back(free_slot_order_of(policy_) == FreeSlotOrder::lowest_first
                                ? shape.capacity - 1 - i
                                : i);
    }
  }

  /// As above, with the policy constructed from the validated shape.
  /// @param shape  experts and slots
  /// @param top_k  routed experts per token, in [1, capacity]
  /// @throws Error as validated()
  explicit ForwardPlanner(CacheShape shape, std::int32_t top_k = 1)
    requires std::constructible_from<Policy, CacheShape>
      : ForwardPlanner(shape, top_k, Policy(validated(shape, top_k))) {}

  /// Plan from top-k routing ids (any length, duplicates allowed, negative ids are padding).
  /// The unique set is processed in ascending order, as both reference providers do.
  /// @param topk_ids  the forward's ids, read during the call only
  /// @param plan      receives the plan (cleared first); left as it was when the call is rejected
  /// @return ok; expert_out_of_range (an id >= num_experts) or too_many_experts (more unique experts than
  ///         slots), with nothing changed; internal when the policy returns an invalid victim
  Status plan_topk(std::span<const std::int32_t> topk_ids, ForwardPlan& plan) noexcept {
    next_epoch();
    scratch_.clear();
    for (const std::int32_t id : topk_ids) {
      if (id < 0) continue;
      if (id >= shape_.num_experts) return out_of_range(id);
      if (stamps_[static_cast<std::size_t>(id)] == epoch_) continue;
      if (static_cast<std::int32_t>(scratch_.size()) == shape_.capacity) {
        return too_many(count_unique_topk(topk_ids));
      }
      stamps_[static_cast<std::size_t>(id)] = epoch_;
      scratch_.push_back(ExpertId(id));
    }
    std::sort(scratch_.begin(), scratch_.end());
    return apply(plan);
  }

  /// Plan from an explicit list of unique ids, processed in the given order.
  /// @param unique_ids  distinct ids in [0, num_experts), read during the call only
  /// @param plan        receives the plan (cleared first); left as it was when the call is rejected
  /// @param keep        a wide forward's previous round, still to be read: residents that are not planned
  ///                    but may not be evicted either; the unique ids plus the resident ones of `keep` must
  ///                    fit the capacity
  /// @return ok; with nothing changed: too_many_experts (more ids than slots, or than `keep`'s residents leave),
  ///         expert_out_of_range (an id of either list outside [0, num_experts), negative included),
  ///         duplicate_expert; internal when the policy returns an invalid victim
  Status plan_unique(std::span<const std::int32_t> unique_ids, ForwardPlan& plan,
                     std::span<const std::int32_t> keep = {}) noexcept {
    if (static_cast<std::int64_t>(unique_ids.size()) > shape_.capacity) {
      return too_many(static_cast<std::int64_t>(unique_ids.size()));
    }
    next_epoch();
    scratch_.clear();
    for (const std::int32_t id : unique_ids) {
      if (id < 0 || id >= shape_.num_experts) return out_of_range(id);
      if (stamps_[static_cast<std::size_t>(id)] == epoch_) {
        return Status::format(ErrorCode::duplicate_expert, "expert %d appears more than once in the unique id list", id);
      }
      stamps_[static_cast<std::size_t>(id)] = epoch_;
      scratch_.push_back(ExpertId(id));
    }
    std::int64_t kept = 0;
    for (const std::int32_t id : keep) {
      if (id < 0 || id >= shape_.num_experts) return out_of_range(id);
      std::uint32_t& stamp = stamps_[static_cast<std::size_t>(id)];
      if (stamp == epoch_) continue;
      stamp = epoch_;
      if (resident_map_[static_cast<std::size_t>(id)] != absent_slot) ++kept;
    }
    if (kept + static_cast<std::int64_t>(unique_ids.size()) > shape_.capacity) {
      return too_many(kept + static_cast<std::int64_t>(unique_ids.size()));
    }
    return apply(plan);
  }

  /// Speculative fills for `predicted` (best first), at most `max_fills`. A victim is chosen by the
  /// policy among residents that are neither in the most recent accepted forward (unless
  /// `evict_last_forward`: PrefetchOptions::evict_last_forward states the caller's promise), nor an unused,
  /// unexpired speculative fill, nor named anywhere in this list (evicting one prediction for
  /// another costs a copy and, at similar likelihoods, saves nothing; a resident named after the
  /// budget ran out is a prediction too). No such resident: the remaining ids are skipped, not an
  /// error.
  /// A fill is speculative until a forward uses it (a hit, counted used) or `expires_after`
  /// accepted forwards pass without one (counted wasted; then evictable like any resident).
  /// The forward map is not touched: the current forward's readers keep reading it.
  /// @param predicted      predicted ids, best first, read during the call only
  /// @param max_fills      the most fills to plan (>= 0)
  /// @param expires_after  accepted forwards a fill stays protected unused (>= 1)
  /// @param out            receives the plan (cleared first); left as it was when the call is rejected
  /// @param evict_last_forward  the last forward's residents are victims too (its readers are done)
  /// @return ok. Errors, before any state change: an id outside [0, num_experts) (expert_out_of_range), more
  ///         than num_experts entries (too_many_experts: a priority list never needs more), max_fills < 0
  ///         or expires_after == 0 (invalid_argument); internal when the policy returns an invalid victim
  Status plan_prefetch(std::span<const std::int32_t> predicted, std::int32_t max_fills, std::uint32_t expires_after,
                       PrefetchPlan& out, bool evict_last_forward = false) noexcept {
    if (Status s = check_prefetch(predicted, max_fills, expires_after); !s) return s;
    return plan_prefetch_checked(predicted, max_fills, expires_after, out, -1.0f, evict_last_forward);
  }

  /// The same with the caller's scores (PrefetchOptions in cache/options.hpp states the contract):
  /// scores[i] is the probability that the next forward reads predicted[i]. Empty `scores` and
  /// no feedback: the overload above, exactly. Otherwise the entries scoring below `min_score`
  /// are skipped (out.skipped_unlikely; they are not protected either) and the others are
  /// planned highest score first, equal scores in the given order (HintSelector,
  /// prefetch/hint_selection.hpp), under the rules above: the same protections, at most
  /// max_fills fills. With `precision_feedback`, a non-resident entry at a rank of that order
  /// whose measured precision (prefetch/rank_precision.hpp) is below `min_score`, or below
  /// RankPrecision::min_admit_precision whatever `min_score` says, is skipped too
  /// (out.skipped_imprecise, not protected), except for the rank's periodic probe, which runs only
  /// while the rank's skipped hints, watched, turn out read by the next forwards. A rank's precision
  /// is net of its regret: how often a forward missed the expert one of its fills evicted.
  /// @param predicted           predicted ids, read during the call only
  /// @param scores              one probability in [0, 1] per predicted id, or empty
  /// @param min_score           the least score (and, with feedback, rank precision) a hint needs, in [0, 1]
  /// @param max_fills           the most fills to plan (>= 0)
  /// @param expires_after       accepted forwards a fill stays protected unused (>= 1)
  /// @param out                 receives the plan; left as it was when the call is rejected
  /// @param precision_feedback  skip ranks whose measured precision is below min_score or min_admit_precision
  /// @param evict_last_forward  the last forward's residents are victims too (its readers are done)
  /// @return ok. Errors, before any state change: those above (every entry's id is checked, skipped ones
  ///         too), and invalid_argument for a min_score outside [0, 1] or NaN, a number of scores other
  ///         than predicted.size(), or a score that is NaN, infinite or outside [0, 1].
  Status plan_prefetch(std::span<const std::int32_t> predicted, std::span<const float> scores, float min_score,
                       std::int32_t max_fills, std::uint32_t expires_after, PrefetchPlan& out,
                       bool precision_feedback = false, bool evict_last_forward = false) noexcept {
    if (Status s = check_prefetch(predicted, max_fills, expires_after); !s) return s;
    if (Status s = hints_.select(predicted, scores, min_score); !s) return s;
    const float feedback_threshold = std::max(min_score, RankPrecision::min_admit_precision);
    const Status s =
        plan_prefetch_checked(hints_.ids(), max_fills, expires_after, out,
                              precision_feedback ? feedback_threshold : -1.0f, evict_last_forward);
    out.skipped_unlikely = hints_.skipped_unlikely();
    return s;
  }

  /// @param expert  any id (outside [0, num_experts): false)
  /// @return true when `expert` was issued by plan_prefetch and not yet used, expired, evicted or invalidated
  [[nodiscard]] bool is_speculative(std::int32_t expert) const noexcept {
    return expert >= 0 && expert < shape_.num_experts && speculative_.contains(ExpertId(expert));
  }
  /// @return the live speculative fills (see is_speculative)
  [[nodiscard]] std::int32_t speculative_count() const noexcept { return static_cast<std::int32_t>(speculative_.size()); }

  /// Drop `expert` from residency (its forward-map entry too); a live speculative fill of it counts wasted.
  /// @param expert  expert id in [0, num_experts)
  /// @return the freed slot, or an invalid SlotId when the expert was not resident (a no-op, like the
  ///         reference providers); expert_out_of_range with nothing changed
  Result<SlotId> invalidate(std::int32_t expert) noexcept {
    if (expert < 0 || expert >= shape_.num_experts) return out_of_range(expert);
    const auto e = static_cast<std::size_t>(expert);
    const std::int32_t slot = resident_map_[e];
    if (slot == absent_slot) return SlotId();
    if (speculative_.contains(ExpertId(expert))) resolve_speculative(ExpertId(expert), false);
    policy_.on_remove(ExpertId(expert));
    resident_map_[e] = absent_slot;
    forward_map_[e] = absent_slot;
    slot_owner_[static_cast<std::size_t>(slot)] = -1;
    free_slots_.push_back(slot);
    ++counters_.invalidations;
    ++counters_.generation;
    return SlotId(slot);
  }

  /// @return [num_experts] every resident expert -> slot, else -1 (speculative fills included); the span stays
  ///         valid for the planner's lifetime, its entries change with each accepted call
  [[nodiscard]] std::span<const std::int32_t> resident_map() const noexcept { return resident_map_; }
  /// @return [num_experts] the last accepted forward's experts -> slot, else -1
  [[nodiscard]] std::span<const std::int32_t> forward_map() const noexcept { return forward_map_; }
  /// @return [capacity] slot -> expert holding it, -1 when free
  [[nodiscard]] std::span<const std::int32_t> slot_owner() const noexcept { return slot_owner_; }
  /// @return the counters since construction
  [[nodiscard]] const PlannerCounters& counters() const noexcept { return counters_; }
  /// @return the eviction policy and its state
  [[nodiscard]] const Policy& policy() const noexcept { return policy_; }
  /// @return the validated shape
  [[nodiscard]] CacheShape shape() const noexcept { return shape_; }
  /// @return the routed experts per token given at construction
  [[nodiscard]] std::int32_t top_k() const noexcept { return top_k_; }
  /// @return the slots holding an expert
  [[nodiscard]] std::int32_t resident_count() const noexcept {
    return shape_.capacity - static_cast<std::int32_t>(free_slots_.size());
  }
  /// @param expert  any id (outside [0, num_experts): false)
  /// @return true when `expert` holds a slot
  [[nodiscard]] bool is_resident(std::int32_t expert) const noexcept {
    return expert >= 0 && expert < shape_.num_experts &&
           resident_map_[static_cast<std::size_t>(expert)] != absent_slot;
  }

  /// @return a copy of the whole observable state (for tests and replay comparisons)
  /// @throws std::bad_alloc when the copy cannot be allocated
  [[nodiscard]] Snapshot snapshot() const {
    return Snapshot{resident_map_, slot_owner_, std::vector<std::int32_t>(free_slots_.begin(), free_slots_.end()),
                    policy_, counters_, speculative_.forwards_left(), precision_, skipped_.forwards_left(),
                    victims_.forwards_left()};
  }

  /// Checks a shape before anything is built for it.
  /// @param shape  experts and slots
  /// @param top_k  routed experts per token
  /// @return `shape`, unchanged
  /// @throws Error invalid_argument for num_experts <= 0; invalid_capacity for capacity outside
  ///         [1, num_experts] or top_k outside [1, capacity]
  static CacheShape validated(CacheShape shape, std::int32_t top_k) {
    if (shape.num_experts <= 0) {
      throw Error(ErrorCode::invalid_argument,
                  detail::join({"num_experts must be positive, got ", detail::DecimalText(shape.num_experts)}));
    }
    if (shape.capacity <= 0 || shape.capacity > shape.num_experts) {
      throw Error(ErrorCode::invalid_capacity,
                  detail::join({"capacity must be in [1, num_experts=", detail::DecimalText(shape.num_experts), "], got ",
                                detail::DecimalText(shape.capacity)}));
    }
    if (top_k <= 0 || top_k > shape.capacity) {
      throw Error(ErrorCode::invalid_capacity,
                  detail::join({"capacity ", detail::DecimalText(shape.capacity), " is below top_k ",
                                detail::DecimalText(top_k), " (top_k must be in [1, capacity])"}));
    }
    return shape;
  }

 private:
  // plan_prefetch's checks, before any state change.
  Status check_prefetch(std::span<const std::int32_t> predicted, std::int32_t max_fills,
                        std::uint32_t expires_after) const noexcept {
    if (max_fills < 0) {
      return Status::format(ErrorCode::invalid_argument, "prefetch max_fills must be >= 0, got %d", max_fills);
    }
    if (expires_after == 0) {
      return Status(ErrorCode::invalid_argument, "prefetch expires_after must be >= 1 forward");
    }
    if (static_cast<std::int64_t>(predicted.size()) > shape_.num_experts) {
      return Status::format(ErrorCode::too_many_experts, "prefetch got %zu predicted ids, more than the %d experts",
                            predicted.size(), shape_.num_experts);
    }
    for (const std::int32_t id : predicted) {
      if (id < 0 || id >= shape_.num_experts) return out_of_range(id);
    }
    return {};
  }

  // plan_prefetch once its arguments were checked.
  // `feedback_threshold` >= 0: the least measured precision a rank needs (< 0: no feedback).
  Status plan_prefetch_checked(std::span<const std::int32_t> predicted, std::int32_t max_fills,
                               std::uint32_t expires_after, PrefetchPlan& out, float feedback_threshold = -1.0f,
                               bool evict_last_forward = false) noexcept {
    out.clear();
    reserve(out);
    // Protected residents: the most recent forward's, the live speculative fills, every resident
    // the list names (a hint is never evicted for another hint: at similar likelihoods the swap
    // costs a copy and saves nothing), and (below) the fills made. `needed` marks them for
    // choose_victim.
    next_epoch();
    std::int32_t protected_residents = 0;
    const auto protect = [&](ExpertId e) noexcept {
      std::uint32_t& stamp = stamps_[e.index()];
      if (stamp == epoch_) return;
      stamp = epoch_;
      if (resident_map_[e.index()] != absent_slot) ++protected_residents;
    };
    if (!evict_last_forward) {
      for (const ExpertId e : previous_forward_) protect(e);
    }
    for (const ExpertId e : speculative_) protect(e);
    for (const std::int32_t id : predicted) {
      if (resident_map_[static_cast<std::size_t>(id)] != absent_slot) protect(ExpertId(id));
    }
    const ForwardSet needed(stamps_.data(), epoch_);
    std::size_t next = 0;
    bool no_victim = false;
    for (; next < predicted.size(); ++next) {
      const ExpertId e(predicted[next]);
      if (resident_map_[e.index()] != absent_slot) {  // protected above, or one of this call's fills
        ++out.skipped_resident;
        continue;
      }
      if (static_cast<std::int32_t>(out.fills.size()) >= max_fills) break;
      if (feedback_threshold >= 0.0f && !precision_.admit(next, feedback_threshold)) {
        ++out.skipped_imprecise;
        // Watched: its outcome gates the rank's probes (rank_precision.hpp); a hint already watched
        // keeps its first rank and expiry.
        if (!skipped_.contains(e)) skipped_.add(e, RankPrecision::bucket(next), expires_after);
        continue;
      }
      std::int32_t target;
      if (!free_slots_.empty()) {
        target = free_slots_.back();
        free_slots_.pop_back();
      } else {
        if (protected_residents >= shape_.capacity) {
          no_victim = true;
          break;
        }
        const ExpertId victim = policy_.choose_victim(needed);
        if (!victim.valid()) {  // a policy may see no candidate (Lrfu/LayerShare look at heap tops only)
          no_victim = true;
          break;
        }
        if (victim.value >= shape_.num_experts || resident_map_[victim.index()] == absent_slot ||
            needed.contains(victim)) {
          return invalid_victim(victim);
        }
        target = resident_map_[victim.index()];
        policy_.on_remove(victim);
        resident_map_[victim.index()] = absent_slot;
        out.evictions.push_back({victim, SlotId(target)});
        ++counters_.evictions;
        // Watched: a later forward that misses it is this fill's regret (rank_precision.hpp).
        if (!victims_.contains(victim)) {
          victims_.add(victim, RankPrecision::bucket(next), victim_watch_forwards(expires_after));
        }
      }
      resident_map_[e.index()] = target;
      slot_owner_[static_cast<std::size_t>(target)] = e.value;
      policy_.on_insert(e);
      out.fills.push_back({e, SlotId(target)});
      if (skipped_.contains(e)) skipped_.remove(e);  // the fill's outcome stands for it
      speculative_.add(e, RankPrecision::bucket(next), expires_after);
      ++counters_.speculative_issued;
      protect(e);
    }
    if (no_victim) {
      // Count the distinct non-resident ids left (fresh stamps: no victim is chosen any more).
      next_epoch();
      for (; next < predicted.size(); ++next) {
        const auto i = static_cast<std::size_t>(predicted[next]);
        if (resident_map_[i] != absent_slot || stamps_[i] == epoch_) continue;
        stamps_[i] = epoch_;
        ++out.skipped_no_victim;
      }
    }
    if (!out.fills.empty()) ++counters_.generation;
    return {};
  }


  // Everything was validated; from here on nothing can fail except a broken policy.
  Status apply(ForwardPlan& plan) noexcept {
    plan.clear();
    reserve(plan);
    for (const ExpertId e : previous_forward_) forward_map_[e.index()] = absent_slot;
    previous_forward_.clear();
    if constexpr (has_begin_forward<Policy>) policy_.begin_forward(std::span<const ExpertId>(scratch_));
    const ForwardSet needed(stamps_.data(), epoch_);
    for (const ExpertId e : scratch_) {
      std::int32_t& slot = resident_map_[e.index()];
      if (skipped_.contains(e)) {
        precision_.record_watched(skipped_.rank(e), true);
        skipped_.remove(e);
      }
      if (victims_.contains(e)) {
        precision_.record_regret(victims_.rank(e), slot == absent_slot);
        victims_.remove(e);
      }
      if (slot != absent_slot) {
        policy_.on_hit(e);
        ++plan.hits;
        if (speculative_.contains(e)) resolve_speculative(e, true);
      } else {
        std::int32_t target;
        if (!free_slots_.empty()) {
          target = free_slots_.back();
          free_slots_.pop_back();
        } else {
          const ExpertId victim = policy_.choose_victim(needed);
          if (!victim.valid() || victim.value >= shape_.num_experts ||
              resident_map_[victim.index()] == absent_slot || needed.contains(victim)) {
            return invalid_victim(victim);
          }
          target = resident_map_[victim.index()];
          if (speculative_.contains(victim)) resolve_speculative(victim, false);  // evicted unused: wasted
          policy_.on_remove(victim);
          resident_map_[victim.index()] = absent_slot;
          plan.evictions.push_back({victim, SlotId(target)});
          ++counters_.evictions;
        }
        slot = target;
        slot_owner_[static_cast<std::size_t>(target)] = e.value;
        policy_.on_insert(e);
        plan.fills.push_back({e, SlotId(target)});
        ++plan.misses;
        ++counters_.promotions;
      }
      forward_map_[e.index()] = slot;
      previous_forward_.push_back(e);
      plan.unique.push_back(e);
    }
    counters_.hits += plan.hits;
    counters_.misses += plan.misses;
    // Unused speculative fills age by one accepted forward; at zero they are wasted.
    speculative_.age([&](ExpertId, std::uint8_t rank) noexcept { resolved(rank, false); });
    victims_.age([&](ExpertId, std::uint8_t rank) noexcept { precision_.record_regret(rank, false); });
    skipped_.age([&](ExpertId, std::uint8_t rank) noexcept { precision_.record_watched(rank, false); });
    ++counters_.prepare_calls;
    ++counters_.generation;
    return {};
  }

  void reserve(PrefetchPlan& plan) const noexcept {
    const auto cap = static_cast<std::size_t>(shape_.capacity);
    if (plan.fills.capacity() >= cap) return;
    try {
      plan.fills.reserve(cap);
      plan.evictions.reserve(cap);
    } catch (...) {  // as reserve(ForwardPlan&)
    }
  }

  // A live speculative fill's outcome: counted, fed to its rank's precision, and dropped.
  void resolve_speculative(ExpertId e, bool used) noexcept {
    const std::uint8_t rank = speculative_.rank(e);
    speculative_.remove(e);
    resolved(rank, used);
  }
  void resolved(std::uint8_t rank, bool used) noexcept {
    ++(used ? counters_.speculative_used : counters_.speculative_wasted);
    precision_.record(rank, used);
  }

  // A speculative fill's eviction is regretted when a forward within this many forwards misses
  // the victim: eight times the fill's protection, since a victim (the policy's least wanted
  // resident) comes back later than a hint is used. In the modelled decode loop 8 did better
  // than 4 on every routing tried and as well as 16 (docs/prefetch.md).
  static constexpr std::uint32_t victim_watch_forwards(std::uint32_t expires_after) noexcept {
    return expires_after > 0x1FFFFFFFu ? 0xFFFFFFFFu : 8 * expires_after;
  }

  Status invalid_victim(ExpertId victim) const {
    return Status::format(ErrorCode::internal, "eviction policy '%.*s' returned an invalid victim %d",
                          static_cast<int>(std::string_view(Policy::name).size()),
                          std::string_view(Policy::name).data(), victim.value);
  }

  // A plan never holds more than `capacity` entries per list: sized once, reused after.
  void reserve(ForwardPlan& plan) const noexcept {
    const auto cap = static_cast<std::size_t>(shape_.capacity);
    if (plan.unique.capacity() >= cap) return;
    try {
      plan.unique.reserve(cap);
      plan.fills.reserve(cap);
      plan.evictions.reserve(cap);
    } catch (...) {  // out of memory: the push_backs below report it by terminating, as before
    }
  }

  void next_epoch() noexcept {
    if (++epoch_ == 0) {  // wrapped: old stamps could alias the new epoch
      std::fill(stamps_.begin(), stamps_.end(), 0u);
      epoch_ = 1;
    }
  }

  std::int64_t count_unique_topk(std::span<const std::int32_t> ids) noexcept {
    next_epoch();
    std::int64_t n = 0;
    for (const std::int32_t id : ids) {
      if (id < 0 || id >= shape_.num_experts || stamps_[static_cast<std::size_t>(id)] == epoch_) continue;
      stamps_[static_cast<std::size_t>(id)] = epoch_;
      ++n;
    }
    return n;
  }

  Status out_of_range(std::int32_t id) const {
    return Status::format(ErrorCode::expert_out_of_range, "expert id %d is outside [0, %d)", id, shape_.num_experts);
  }
  Status too_many(std::int64_t unique) const {
    return Status::format(ErrorCode::too_many_experts,
                          "forward needs %lld unique experts but the cache has %d slots; use a token or expert split plan",
                          static_cast<long long>(unique), shape_.capacity);
  }

  CacheShape shape_;
  std::int32_t top_k_;
  Policy policy_;
  std::vector<std::int32_t> resident_map_;  // expert -> slot, -1 absent (everything resident)
  std::vector<std::int32_t> forward_map_;   // expert -> slot for this forward only
  std::vector<std::int32_t> slot_owner_;    // slot -> expert, -1 free
  // Bounded lists sized at construction (FixedVector, not reserve(): a copied planner keeps
  // its room, so a copy plans without allocating).
  detail::FixedVector<std::int32_t> free_slots_;  // LIFO stack, popped from the back
  std::vector<std::uint32_t> stamps_;       // forward-membership stamps (scratch, not state)
  std::uint32_t epoch_ = 0;
  detail::FixedVector<ExpertId> scratch_;           // validated unique ids of the forward being planned
  detail::FixedVector<ExpertId> previous_forward_;  // entries to clear in forward_map_
  PlannerCounters counters_;
  // Speculative fills (plan_prefetch) live until used, expired, evicted or invalidated; hints
  // skipped for their rank's precision (no slot, no bytes) and the victims of speculative fills,
  // watched for their outcome. Each with the rank bucket it came from.
  detail::ExpertWatchList speculative_;
  detail::ExpertWatchList skipped_;
  detail::ExpertWatchList victims_;
  RankPrecision precision_;  // outcomes per rank (prefetch/rank_precision.hpp)
  HintSelector hints_;  // scored plan_prefetch's selection (scratch sized at construction, not state)
};

}  // namespace expert_cache::inline v0
