#pragma once
/// LRFU (Lee et al., IEEE ToC 2001) with per-layer time, for a pool that spans layers.
// Each expert's value is its combined recency-frequency CRF = sum over past requests of
// 2^(-age / half_life), the age counted in forwards of the expert's own layer (steps), not
// in pool accesses: in a global pool every layer is visited once per step, so a pool-wide
// clock would make an expert of the next layer look older than one of the layer just done,
// although it is needed sooner. The victim is the resident outside the forward whose next
// request is expected furthest away: d + L * (1/p - 1) forwards, where p = CRF * (1 - 2^(-1/h))
// estimates the chance of a request per step and d is how many forwards until its layer
// comes round again. Within a layer that is the lowest CRF (a heap top), so a miss looks at
// one candidate per layer. CRF is kept for non-residents too (the id space is small and
// dense), so a returning expert resumes its history.
// Cost: O(log n) per hit/insert/remove, O(L + log n) per victim (L = layers in the pool).
// Device planner: fits. Per id one float + one int, per layer a heap; the victim is an
// argmax over L layer tops (one warp), the heap update a short sequential sift.
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

/// Lrfu's parameters.
struct LrfuParams {
  double half_life = 8.0;     // steps (forwards of the expert's layer)
  double phase_weight = 1.0;  // 0: ignore where in the layer cycle the pool stands
  friend bool operator==(const LrfuParams&, const LrfuParams&) = default;
};

/// The LRFU eviction policy with per-layer time (an eviction_policy).
class Lrfu {
 public:
  static constexpr std::string_view name = "lrfu";

  /// @param shape   the pool's experts (all layers') and slots
  /// @param layout  how the pool's ids split into layers (default: one layer)
  /// @param params  half-life and the weight of the layer-cycle phase
  explicit Lrfu(CacheShape shape, PoolLayout layout = {}, LrfuParams params = {})
      : heaps_(shape, layout),
        params_(params),
        crf_(shape, heaps_.num_layers(), params.half_life),
        one_minus_decay_(1.0 - std::exp2(-crf_.inv_half_life())),
        wait_(static_cast<std::size_t>(heaps_.num_layers())),
        resident_(static_cast<std::size_t>(shape.num_experts), 0),
        pins_(shape.num_experts, shape.capacity) {}

  // Residents of the previous forward become evictable again; this forward's are pinned
  // (taken out of their heap), so every heap top is a legal victim.
  void begin_forward(std::span<const ExpertId> ids) noexcept {
    detail::begin_layer_forward(heaps_, pins_, crf_, ids, [this](ExpertId e, std::int32_t l) {
      current_layer_ = l;
      if (resident_[e.index()] && pins_.available(heaps_, e.value)) pins_.claim(heaps_, e.value);
    });
  }

  void on_hit(ExpertId e) noexcept { touch(e.value); }

  void on_insert(ExpertId e) noexcept {
    resident_[e.index()] = 1;
    touch(e.value);
    pins_.pin_new(heaps_, e.value);  // pinned at once: pushing it to take it out again moves no top
  }

  void on_remove(ExpertId e) noexcept {
    resident_[e.index()] = 0;
    heaps_.remove(e.value);
    pins_.forget(e.value);
  }

  [[nodiscard]] ExpertId choose_victim(const ForwardSet& needed) const noexcept {
    const std::int32_t layers = heaps_.num_layers();
    std::int32_t best = -1;
    double best_wait = 0.0;
    for (std::int32_t l = 0; l < layers; ++l) {
      const std::int32_t e = heaps_.top(l);
      if (e < 0 || needed.contains(ExpertId(e))) continue;  // pinned forward ids are never tops
      const double wait = expected_wait(e, l);
      if (best < 0 || wait > best_wait) {
        best = e;
        best_wait = wait;
      }
    }
    return ExpertId(best);  // -1 only if every resident is in the forward (precondition)
  }

  // CRF of `e` now (in its layer's time).
  [[nodiscard]] double crf(ExpertId e) const noexcept { return crf_.crf(e.value, heaps_.layer_of(e.value)); }

  friend bool operator==(const Lrfu&, const Lrfu&) = default;

 private:
  void touch(std::int32_t e) noexcept { heaps_.set_key(e, crf_.touch(e, heaps_.layer_of(e))); }

  // Expected forwards until `e` (top of layer l) is requested again.
  [[nodiscard]] double expected_wait(std::int32_t e, std::int32_t l) const noexcept {
    const std::int32_t layers = heaps_.num_layers();
    const std::int32_t d = (l - current_layer_ + layers) % layers;  // forwards until layer l again
    return params_.phase_weight * d + request_wait(e, l);
  }
  // layers * (1/p - 1), the part of expected_wait that needs exp2. A layer's top and clock
  // rarely change between two victims, so the last value per layer is reused (same bits).
  [[nodiscard]] double request_wait(std::int32_t e, std::int32_t l) const noexcept {
    const double key = heaps_.key(e);
    const std::uint32_t clock = crf_.clock(l);
    WaitCache::Entry& c = wait_.layer[static_cast<std::size_t>(l)];
    if (c.id == e && c.key == key && c.clock == clock) return c.wait;
    const std::int32_t layers = heaps_.num_layers();
    const double log_crf = key - static_cast<double>(clock) * crf_.inv_half_life();
    const double p = std::min(1.0, std::exp2(log_crf) * one_minus_decay_);
    c = {e, clock, key, layers * (1.0 / std::max(p, 1e-300) - 1.0)};
    return c.wait;
  }

  // Memo of request_wait, not state: two policies with the same history are equal whatever
  // their memos hold.
  struct WaitCache {
    struct Entry {
      std::int32_t id = -1;
      std::uint32_t clock = 0;
      double key = 0.0;
      double wait = 0.0;
    };
    WaitCache() = default;
    explicit WaitCache(std::size_t layers) : layer(layers) {}
    std::vector<Entry> layer;
    friend bool operator==(const WaitCache&, const WaitCache&) noexcept { return true; }
  };

  detail::LayerHeaps heaps_;
  LrfuParams params_;
  detail::LayerCrf crf_;
  double one_minus_decay_;
  mutable WaitCache wait_;
  std::vector<std::uint8_t> resident_;
  detail::ForwardPins pins_;  // residents of the current forward (out of the heaps)
  std::int32_t current_layer_ = 0;
};

static_assert(eviction_policy<Lrfu>);
static_assert(has_begin_forward<Lrfu>);

}  // namespace expert_cache::inline v0
