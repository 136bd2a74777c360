#pragma once
/// Per-layer indexed binary min-heaps over the ids of one pool (ids = layer * width + expert),
/// keyed by a per-id double.
// Shared by the score-ordered policies (Lrfu, LayerShare): each keeps in a layer's heap the
// residents that may be evicted, so that layer's cheapest resident is its top. Layer l's heap lives
// in heap_[l * width, l * width + size_l): a layer never holds more than `width` ids, so one array
// of num_experts entries serves all of them and nothing allocates after construction. Ties break on
// the lower id (deterministic).
// LayerCrf and ForwardPins are the rest of what both policies keep beside their heaps.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "expert_cache/base/concepts.hpp"
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
        heap_(static_cast<std::size_t>(shape.num_experts), Node{0.0, none}),
        size_(static_cast<std::size_t>(layout.num_layers(shape)), 0) {}

  [[nodiscard]] std::int32_t width() const noexcept { return width_; }
  [[nodiscard]] std::int32_t num_layers() const noexcept { return static_cast<std::int32_t>(size_.size()); }
  [[nodiscard]] std::int32_t layer_of(std::int32_t id) const noexcept { return id / width_; }
  [[nodiscard]] bool contains(std::int32_t id) const noexcept { return pos_[idx(id)] != none; }
  [[nodiscard]] std::int32_t size(std::int32_t layer) const noexcept { return size_[idx(layer)]; }
  [[nodiscard]] std::int32_t top(std::int32_t layer) const noexcept {
    return size_[idx(layer)] > 0 ? heap_[base(layer)].id : none;
  }
  [[nodiscard]] double key(std::int32_t id) const noexcept { return key_[idx(id)]; }

  // Sets the key of an id that may or may not be in its heap (re-sifting if it is).
  void set_key(std::int32_t id, double k) noexcept {
    key_[idx(id)] = k;
    if (contains(id)) {
      const std::int32_t l = layer_of(id);
      heap_[base(l) + idx(pos_[idx(id)])].key = k;
      sift_up(l, pos_[idx(id)]);
      sift_down(l, pos_[idx(id)]);
    }
  }
  void push(std::int32_t id) noexcept {
    const std::int32_t l = layer_of(id);
    const std::int32_t at = size_[idx(l)]++;
    place(l, at, Node{key_[idx(id)], id});
    sift_up(l, at);
  }
  // Bottom-up removal: the hole goes down to a leaf along the smaller children (one compare
  // per level instead of two), then the last node fills it and sifts up (usually not far).
  void remove(std::int32_t id) noexcept {
    std::int32_t at = pos_[idx(id)];
    if (at == none) return;
    const std::int32_t l = layer_of(id);
    const std::int32_t n = --size_[idx(l)];
    pos_[idx(id)] = none;
    if (at == n) return;
    Node* const h = heap_.data() + base(l);
    const Node moved = h[n];
    for (std::int32_t child = 2 * at + 1; child < n; child = 2 * at + 1) {
      if (child + 1 < n && less(h[child + 1], h[child])) ++child;
      place(l, at, h[child]);
      at = child;
    }
    place(l, at, moved);
    sift_up(l, at);
  }

  friend bool operator==(const LayerHeaps&, const LayerHeaps&) = default;

 private:
  // The key travels with the id in the heap, so a sift compares without a second lookup.
  struct Node {
    double key;
    std::int32_t id;
    friend bool operator==(const Node&, const Node&) = default;
  };

  static std::size_t idx(std::int32_t i) noexcept { return static_cast<std::size_t>(i); }
  [[nodiscard]] std::size_t base(std::int32_t layer) const noexcept {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(width_);
  }
  static bool less(const Node& a, const Node& b) noexcept {
    return a.key < b.key || (a.key == b.key && a.id < b.id);
  }
  void place(std::int32_t l, std::int32_t at, const Node& node) noexcept {
    heap_[base(l) + idx(at)] = node;
    pos_[idx(node.id)] = at;
  }
  void sift_up(std::int32_t l, std::int32_t at) noexcept {
    Node* const h = heap_.data() + base(l);
    const Node node = h[at];
    while (at > 0) {
      const std::int32_t parent = (at - 1) / 2;
      if (!less(node, h[parent])) break;
      place(l, at, h[parent]);
      at = parent;
    }
    place(l, at, node);
  }
  void sift_down(std::int32_t l, std::int32_t at) noexcept {
    Node* const h = heap_.data() + base(l);
    const std::int32_t n = size_[idx(l)];
    const Node node = h[at];
    for (;;) {
      std::int32_t child = 2 * at + 1;
      if (child >= n) break;
      if (child + 1 < n && less(h[child + 1], h[child])) ++child;
      if (!less(h[child], node)) break;
      place(l, at, h[child]);
      at = child;
    }
    place(l, at, node);
  }

  std::int32_t width_ = 1;
  std::vector<double> key_;          // per id
  std::vector<std::int32_t> pos_;    // per id: index in its layer's heap, none if absent
  std::vector<Node> heap_;           // per layer, contiguous
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
        clock_(static_cast<std::size_t>(num_layers), 0),
        decay_(decay_table_size) {
    for (std::uint32_t age = 0; age < decay_table_size; ++age) decay_[age] = decay_of(age);
  }

  [[nodiscard]] double inv_half_life() const noexcept { return inv_half_life_; }
  [[nodiscard]] std::uint32_t clock(std::int32_t layer) const noexcept { return clock_[static_cast<std::size_t>(layer)]; }
  void tick(std::int32_t layer) noexcept { ++clock_[static_cast<std::size_t>(layer)]; }

  // Counts a request of `id` (of `layer`) now and returns its heap key. Forward decay:
  // log2(CRF) + now/h orders a layer's ids the same at every later time.
  double touch(std::int32_t id, std::int32_t layer) noexcept {
    const auto i = static_cast<std::size_t>(id);
    const std::uint32_t now = clock(layer);
    crf_[i] = crf_[i] * decay(now - last_[i]) + 1.0;
    last_[i] = now;
    return std::log2(crf_[i]) + static_cast<double>(now) * inv_half_life_;
  }

  // CRF of `id` (of `layer`) now.
  [[nodiscard]] double crf(std::int32_t id, std::int32_t layer) const noexcept {
    const auto i = static_cast<std::size_t>(id);
    return crf_[i] * decay(clock(layer) - last_[i]);
  }

  friend bool operator==(const LayerCrf&, const LayerCrf&) = default;

 private:
  // Most requests come back within a few forwards of their layer: their decay factor is a
  // table entry, computed by the same expression, so every value is bit-identical to exp2's.
  static constexpr std::uint32_t decay_table_size = 64;
  [[nodiscard]] double decay_of(std::uint32_t age) const noexcept {
    return std::exp2(-static_cast<double>(age) * inv_half_life_);
  }
  [[nodiscard]] double decay(std::uint32_t age) const noexcept {
    return age < decay_table_size ? decay_[age] : decay_of(age);
  }

  double inv_half_life_ = 1.0;
  std::vector<double> crf_;           // per id, as of last_
  std::vector<std::uint32_t> last_;   // per id: its layer's clock at its last request
  std::vector<std::uint32_t> clock_;  // per layer: forwards seen
  std::vector<double> decay_;         // decay_[age] = 2^(-age / half_life)
};

// The residents of the current forward, taken out of their layer heap for the rest of the
// forward so that every heap top is a legal victim. A forward never holds more than
// `capacity` ids; beyond that an id simply stays evictable by the heap (choose_victim still
// skips it through `needed`). Fixed arrays, not push_back: copies keep no reserve.
// A resident needed by two forwards in a row stays out of its heap: releasing it only to take
// it out again would cost two sifts and change no heap top (the heap order is total, so the
// top depends only on the set, not on the layout).
class ForwardPins {
 public:
  ForwardPins() = default;
  ForwardPins(std::int32_t num_ids, std::int32_t capacity)
      : pinned_(static_cast<std::size_t>(capacity), -1),
        previous_(static_cast<std::size_t>(capacity), -1),
        state_(static_cast<std::size_t>(num_ids), free) {}

  // Start of a forward: the current pins become the previous forward's, still out of the heaps.
  void begin() noexcept {
    std::swap(pinned_, previous_);
    previous_count_ = count_;
    count_ = 0;
    for (std::size_t i = 0; i < previous_count_; ++i) state_[idx(previous_[i])] = previous;
  }
  // Whether `id` could be pinned now: in its heap or pinned by the previous forward.
  [[nodiscard]] bool available(const LayerHeaps& heaps, std::int32_t id) const noexcept {
    return state_[idx(id)] == previous || heaps.contains(id);
  }
  // Pins an available id (the forward's own resident).
  void claim(LayerHeaps& heaps, std::int32_t id) noexcept {
    if (count_ == pinned_.size()) return;  // a previous pin left here goes back in end()
    if (state_[idx(id)] != previous) heaps.remove(id);
    add(id);
  }
  // End of begin_forward: the previous forward's pins not needed now become evictable again.
  void end(LayerHeaps& heaps) noexcept {
    for (std::size_t i = 0; i < previous_count_; ++i) {
      const std::int32_t id = previous_[i];
      if (state_[idx(id)] != previous) continue;
      state_[idx(id)] = free;
      heaps.push(id);
    }
    previous_count_ = 0;
  }
  // Pins an id just inserted (not in its heap); if the pins are full it goes into the heap.
  void pin_new(LayerHeaps& heaps, std::int32_t id) noexcept {
    if (count_ == pinned_.size()) {
      heaps.push(id);
      return;
    }
    add(id);
  }
  // Drops `id` if pinned (only an invalidation finds it here).
  void forget(std::int32_t id) noexcept {
    if (state_[idx(id)] != current) return;
    state_[idx(id)] = free;
    for (std::size_t i = 0; i < count_; ++i) {
      if (pinned_[i] == id) {
        pinned_[i] = pinned_[--count_];
        break;
      }
    }
  }

  friend bool operator==(const ForwardPins&, const ForwardPins&) = default;

 private:
  static constexpr std::uint8_t free = 0, previous = 1, current = 2;
  static std::size_t idx(std::int32_t i) noexcept { return static_cast<std::size_t>(i); }
  void add(std::int32_t id) noexcept {
    state_[idx(id)] = current;
    pinned_[count_++] = id;
  }

  std::vector<std::int32_t> pinned_;    // this forward's pins
  std::vector<std::int32_t> previous_;  // the previous forward's, during begin_forward only
  std::vector<std::uint8_t> state_;     // per id: free, previous or current
  std::size_t count_ = 0;
  std::size_t previous_count_ = 0;
};

// The start of a forward for Lrfu and LayerShare: the previous forward's pins become evictable
// again (those this forward needs stay pinned) and each layer's clock advances once per forward
// of that layer (a forward's ids of one layer are contiguous); per_id(e, layer) for every id,
// in order, may claim e (pins.available first).
template <class PerId>
void begin_layer_forward(LayerHeaps& heaps, ForwardPins& pins, LayerCrf& crf, std::span<const ExpertId> ids,
                         PerId per_id) noexcept {
  pins.begin();
  std::int32_t last_layer = -1;
  for (const ExpertId e : ids) {
    const std::int32_t l = heaps.layer_of(e.value);
    if (l != last_layer) crf.tick(l);
    last_layer = l;
    per_id(e, l);
  }
  pins.end(heaps);
}

}  // namespace expert_cache::inline v0::detail
