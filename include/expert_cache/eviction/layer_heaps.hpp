#pragma once
// Per-layer indexed binary min-heaps over the ids of one pool (ids = layer * width + expert),
// keyed by a per-id double. Shared by the score-ordered policies (Lrfu, LayerShare): each
// keeps in a layer's heap the residents that may be evicted, so that layer's cheapest
// resident is its top. Layer l's heap lives in heap_[l * width, l * width + size_l): a layer
// never holds more than `width` ids, so one array of num_experts entries serves all of them
// and nothing allocates after construction. Ties break on the lower id (deterministic).
// LayerCrf and ForwardPins are the rest of what both policies keep beside their heaps.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "expert_cache/concepts.hpp"
#include "expert_cache/eviction/pool_layout.hpp"

namespace expert_cache::inline v0::detail {

class LayerHeaps {
 public:
  static constexpr std::int32_t none = -1;

  LayerHeaps() = default;
  LayerHeaps(CacheShape shape, PoolLayout layout)
      : width_(layout.layer_width(shape)),
        key_(static_cast<std::size_t>(shape.num_experts), 0.0),
        pos_(static_cast<std::size_t>(shape.num_experts), none),
        heap_(static_cast<std::size_t>(shape.num_experts), none),
        size_(static_cast<std::size_t>(layout.num_layers(shape)), 0) {}

  [[nodiscard]] std::int32_t width() const noexcept { return width_; }
  [[nodiscard]] std::int32_t num_layers() const noexcept { return static_cast<std::int32_t>(size_.size()); }
  [[nodiscard]] std::int32_t layer_of(std::int32_t id) const noexcept { return id / width_; }
  [[nodiscard]] bool contains(std::int32_t id) const noexcept { return pos_[idx(id)] != none; }
  [[nodiscard]] std::int32_t size(std::int32_t layer) const noexcept { return size_[idx(layer)]; }
  [[nodiscard]] std::int32_t top(std::int32_t layer) const noexcept {
    return size_[idx(layer)] > 0 ? heap_[base(layer)] : none;
  }
  [[nodiscard]] double key(std::int32_t id) const noexcept { return key_[idx(id)]; }

  // Sets the key of an id that may or may not be in its heap (re-sifting if it is).
  void set_key(std::int32_t id, double k) noexcept {
    key_[idx(id)] = k;
    if (contains(id)) {
      sift_up(layer_of(id), pos_[idx(id)]);
      sift_down(layer_of(id), pos_[idx(id)]);
    }
  }
  void push(std::int32_t id) noexcept {
    const std::int32_t l = layer_of(id);
    const std::int32_t at = size_[idx(l)]++;
    place(l, at, id);
    sift_up(l, at);
  }
  void remove(std::int32_t id) noexcept {
    const std::int32_t at = pos_[idx(id)];
    if (at == none) return;
    const std::int32_t l = layer_of(id);
    const std::int32_t last = --size_[idx(l)];
    pos_[idx(id)] = none;
    if (at == last) return;
    place(l, at, heap_[base(l) + idx(last)]);
    sift_up(l, at);
    sift_down(l, pos_[idx(heap_[base(l) + idx(at)])]);
  }

  friend bool operator==(const LayerHeaps&, const LayerHeaps&) = default;

 private:
  static std::size_t idx(std::int32_t i) noexcept { return static_cast<std::size_t>(i); }
  [[nodiscard]] std::size_t base(std::int32_t layer) const noexcept {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(width_);
  }
  [[nodiscard]] bool less(std::int32_t a, std::int32_t b) const noexcept {
    const double ka = key_[idx(a)], kb = key_[idx(b)];
    return ka < kb || (ka == kb && a < b);
  }
  void place(std::int32_t l, std::int32_t at, std::int32_t id) noexcept {
    heap_[base(l) + idx(at)] = id;
    pos_[idx(id)] = at;
  }
  void sift_up(std::int32_t l, std::int32_t at) noexcept {
    const std::int32_t id = heap_[base(l) + idx(at)];
    while (at > 0) {
      const std::int32_t parent = (at - 1) / 2;
      const std::int32_t p = heap_[base(l) + idx(parent)];
      if (!less(id, p)) break;
      place(l, at, p);
      at = parent;
    }
    place(l, at, id);
  }
  void sift_down(std::int32_t l, std::int32_t at) noexcept {
    const std::int32_t n = size_[idx(l)];
    const std::int32_t id = heap_[base(l) + idx(at)];
    for (;;) {
      std::int32_t child = 2 * at + 1;
      if (child >= n) break;
      if (child + 1 < n && less(heap_[base(l) + idx(child + 1)], heap_[base(l) + idx(child)])) ++child;
      const std::int32_t c = heap_[base(l) + idx(child)];
      if (!less(c, id)) break;
      place(l, at, c);
      at = child;
    }
    place(l, at, id);
  }

  std::int32_t width_ = 1;
  std::vector<double> key_;          // per id
  std::vector<std::int32_t> pos_;    // per id: index in its layer's heap, none if absent
  std::vector<std::int32_t> heap_;   // per layer, contiguous
  std::vector<std::int32_t> size_;   // per layer
};

// Per-id CRF (LRFU's combined recency-frequency) in per-layer time: the age of a request is
// counted in forwards of the id's own layer. Kept for non-residents too, so a returning id
// resumes its history.
class LayerCrf {
 public:
  LayerCrf() = default;
  LayerCrf(CacheShape shape, std::int32_t num_layers, double half_life)
      : inv_half_life_(1.0 / std::max(half_life, 1e-3)),
        crf_(static_cast<std::size_t>(shape.num_experts), 0.0),
        last_(static_cast<std::size_t>(shape.num_experts), 0),
        clock_(static_cast<std::size_t>(num_layers), 0) {}

  [[nodiscard]] double inv_half_life() const noexcept { return inv_half_life_; }
  [[nodiscard]] std::uint32_t clock(std::int32_t layer) const noexcept { return clock_[static_cast<std::size_t>(layer)]; }
  void tick(std::int32_t layer) noexcept { ++clock_[static_cast<std::size_t>(layer)]; }

  // Counts a request of `id` (of `layer`) now and returns its heap key. Forward decay:
  // log2(CRF) + now/h orders a layer's ids the same at every later time.
  double touch(std::int32_t id, std::int32_t layer) noexcept {
    const auto i = static_cast<std::size_t>(id);
    const std::uint32_t now = clock(layer);
    crf_[i] = crf_[i] * std::exp2(-static_cast<double>(now - last_[i]) * inv_half_life_) + 1.0;
    last_[i] = now;
    return std::log2(crf_[i]) + static_cast<double>(now) * inv_half_life_;
  }

  // CRF of `id` (of `layer`) now.
  [[nodiscard]] double crf(std::int32_t id, std::int32_t layer) const noexcept {
    const auto i = static_cast<std::size_t>(id);
    return crf_[i] * std::exp2(-static_cast<double>(clock(layer) - last_[i]) * inv_half_life_);
  }

  friend bool operator==(const LayerCrf&, const LayerCrf&) = default;

 private:
  double inv_half_life_ = 1.0;
  std::vector<double> crf_;           // per id, as of last_
  std::vector<std::uint32_t> last_;   // per id: its layer's clock at its last request
  std::vector<std::uint32_t> clock_;  // per layer: forwards seen
};

// The residents of the current forward, taken out of their layer heap for the rest of the
// forward so that every heap top is a legal victim. A forward never holds more than
// `capacity` ids; beyond that an id simply stays evictable by the heap (choose_victim still
// skips it through `needed`). A fixed array, not push_back: copies keep no reserve.
class ForwardPins {
 public:
  ForwardPins() = default;
  explicit ForwardPins(std::int32_t capacity) : pinned_(static_cast<std::size_t>(capacity), -1) {}

  // The previous forward's pins become evictable again.
  void release(LayerHeaps& heaps) noexcept {
    for (std::size_t i = 0; i < count_; ++i) heaps.push(pinned_[i]);
    count_ = 0;
  }
  void pin(LayerHeaps& heaps, std::int32_t id) noexcept {
    if (count_ == pinned_.size()) return;
    heaps.remove(id);
    pinned_[count_++] = id;
  }
  // Drops `id` if pinned (only an invalidation finds it here).
  void forget(std::int32_t id) noexcept {
    for (std::size_t i = 0; i < count_; ++i) {
      if (pinned_[i] == id) {
        pinned_[i] = pinned_[--count_];
        break;
      }
    }
  }

  friend bool operator==(const ForwardPins&, const ForwardPins&) = default;

 private:
  std::vector<std::int32_t> pinned_;
  std::size_t count_ = 0;
};

// The start of a forward for Lrfu and LayerShare: the previous forward's pins become evictable
// again and each layer's clock advances once per forward of that layer (a forward's ids of one
// layer are contiguous); then per_id(e, layer) for every id, in order.
template <class PerId>
void begin_layer_forward(LayerHeaps& heaps, ForwardPins& pins, LayerCrf& crf, std::span<const ExpertId> ids,
                         PerId per_id) noexcept {
  pins.release(heaps);
  std::int32_t last_layer = -1;
  for (const ExpertId e : ids) {
    const std::int32_t l = heaps.layer_of(e.value);
    if (l != last_layer) crf.tick(l);
    last_layer = l;
    per_id(e, l);
  }
}

}  // namespace expert_cache::inline v0::detail
