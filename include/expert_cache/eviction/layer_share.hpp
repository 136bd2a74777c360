#pragma once
/// Layer-aware capacity for one pool shared by all layers: every layer owns a share (target) of the
/// slots, and shares move to the layers whose working sets need them.
// A victim comes from the layer most above its share (outside the forward); inside a layer it is
// the resident with the lowest recency-frequency value (CRF with per-layer time, as in Lrfu).
// Shares adapt on ghost hits, as ARC's p does between its two lists: a miss on an id that
// its layer evicted within the pool's last capacity/10 evictions means that layer
// would have hit with one more slot, so its share grows by one slot, taken from the other
// layers in proportion to their shares (the total stays `capacity`).
// A layer's forward that needs more than its share borrows from the layers above theirs;
// the next forward takes the loan back from the layer just done, so a layer's share keeps
// its most valuable experts and the slack rotates (scan resistance in a cyclic pool).
// Cost: O(log n) per hit/insert/remove, O(L) per victim and per ghost hit (L = layers).
// Device planner: fits; the state is per-id arrays plus L shares, the victim an argmax over
// L layers (one warp), and the share update an O(L) vector operation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/eviction/layer_heaps.hpp"
#include "expert_cache/eviction/pool_layout.hpp"

namespace expert_cache::inline v0 {

/// LayerShare's parameters.
struct LayerShareParams {
  double half_life = 8.0;   // steps, for the within-layer CRF order
  double ghost_gain = 1.0;  // slots a layer's share grows by per ghost hit
  double ghost_depth = 0.1; // ghosts remembered, as a fraction of the capacity (the marginal slots)
  friend bool operator==(const LayerShareParams&, const LayerShareParams&) = default;
};

/// The layer-share eviction policy for one pool shared by all layers (an eviction_policy).
class LayerShare {
 public:
  static constexpr std::string_view name = "layershare";

  /// @param shape   the pool's experts (all layers') and slots
  /// @param layout  how the pool's ids split into layers (default: one layer)
  /// @param params  the within-layer half-life and how shares follow ghost hits
  explicit LayerShare(CacheShape shape, PoolLayout layout = {}, LayerShareParams params = {})
      : heaps_(shape, layout),
        params_(params),
        capacity_(shape.capacity),
        ghost_depth_(static_cast<std::uint64_t>(std::max(1.0, params.ghost_depth * shape.capacity))),
        crf_(shape, heaps_.num_layers(), params.half_life),
        evicted_at_(static_cast<std::size_t>(shape.num_experts), 0),
        share_(static_cast<std::size_t>(heaps_.num_layers()),
               static_cast<double>(shape.capacity) / heaps_.num_layers()),
        residents_(static_cast<std::size_t>(heaps_.num_layers()), 0),
        pins_(shape.num_experts, shape.capacity) {}

  void begin_forward(std::span<const ExpertId> ids) noexcept {
    detail::begin_layer_forward(heaps_, pins_, crf_, ids, [this](ExpertId e, std::int32_t l) {
      if (pins_.available(heaps_, e.value)) {
        pins_.claim(heaps_, e.value);
      } else if (is_ghost(e.value)) {
        // This forward will miss on an id its layer evicted lately. Adapt before the
        // forward's victims are chosen, as ARC adapts p before its replacement.
        grow(l);
      }
    });
  }

  void on_hit(ExpertId e) noexcept { touch(e.value); }

  void on_insert(ExpertId e) noexcept {
    const auto i = e.index();
    evicted_at_[i] = 0;
    ++residents_[static_cast<std::size_t>(heaps_.layer_of(e.value))];
    touch(e.value);
    pins_.pin_new(heaps_, e.value);  // pinned at once: pushing it to take it out again moves no top
  }

  void on_remove(ExpertId e) noexcept {
    const auto i = e.index();
    --residents_[static_cast<std::size_t>(heaps_.layer_of(e.value))];
    heaps_.remove(e.value);
    if (e.value == victim_) evicted_at_[i] = ++evictions_;  // invalidations leave no ghost
    victim_ = -1;
    pins_.forget(e.value);
  }

  [[nodiscard]] ExpertId choose_victim(const ForwardSet& needed) noexcept {
    std::int32_t best = -1;
    double best_excess = 0.0;
    for (std::int32_t l = 0; l < heaps_.num_layers(); ++l) {
      const std::int32_t e = heaps_.top(l);
      if (e < 0 || needed.contains(ExpertId(e))) continue;
      const double excess = residents_[static_cast<std::size_t>(l)] - share_[static_cast<std::size_t>(l)];
      if (best < 0 || excess > best_excess) {
        best = e;
        best_excess = excess;
      }
    }
    victim_ = best;
    return ExpertId(best);
  }

  [[nodiscard]] double share(std::int32_t layer) const noexcept { return share_[static_cast<std::size_t>(layer)]; }
  [[nodiscard]] std::int32_t residents(std::int32_t layer) const noexcept {
    return residents_[static_cast<std::size_t>(layer)];
  }

  friend bool operator==(const LayerShare&, const LayerShare&) = default;

 private:
  [[nodiscard]] bool is_ghost(std::int32_t e) const noexcept {
    const std::uint64_t at = evicted_at_[static_cast<std::size_t>(e)];
    return at != 0 && evictions_ - at < ghost_depth_;
  }

  void touch(std::int32_t e) noexcept { heaps_.set_key(e, crf_.touch(e, heaps_.layer_of(e))); }

  // Layer l would have hit with one more slot: move ghost_gain slots to it from the others,
  // in proportion to their shares.
  void grow(std::int32_t l) noexcept {
    double& mine = share_[static_cast<std::size_t>(l)];
    const double others = capacity_ - mine;
    const double gain = std::min(params_.ghost_gain, others);
    if (gain <= 0.0) return;
    const double keep = (others - gain) / others;
    for (std::size_t m = 0; m < share_.size(); ++m) {
      if (m != static_cast<std::size_t>(l)) share_[m] *= keep;
    }
    mine += gain;
  }

  detail::LayerHeaps heaps_;
  LayerShareParams params_;
  std::int32_t capacity_;
  std::uint64_t ghost_depth_;
  detail::LayerCrf crf_;                   // within-layer order
  std::vector<std::uint64_t> evicted_at_;  // per id: eviction number, 0 = no ghost
  std::vector<double> share_;              // per layer: target slots, sum = capacity
  std::vector<std::int32_t> residents_;    // per layer
  detail::ForwardPins pins_;               // residents of the current forward (out of the heaps)
  std::uint64_t evictions_ = 0;
  std::int32_t victim_ = -1;  // last choose_victim result, ghosted in on_remove
};

static_assert(eviction_policy<LayerShare>);
static_assert(has_begin_forward<LayerShare>);

}  // namespace expert_cache::inline v0
