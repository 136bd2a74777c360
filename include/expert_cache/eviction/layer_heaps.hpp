#pragma once
// Per-layer indexed binary min-heaps over the ids of one pool (ids = layer * width + expert),
// keyed by a per-id double. Shared by the score-ordered policies (Lrfu, LayerShare): each
// keeps in a layer's heap the residents that may be evicted, so that layer's cheapest
// resident is its top. Layer l's heap lives in heap_[l * width, l * width + size_l): a layer
// never holds more than `width` ids, so one array of num_experts entries serves all of them
// and nothing allocates after construction. Ties break on the lower id (deterministic).
#include <cstdint>
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

}  // namespace expert_cache::inline v0::detail
