#pragma once
/// A vector whose storage is sized once, at construction, to its maximum length.
// Policies use it instead of std::vector::reserve(): a copy of a reserved std::vector gets only
// size() elements of room, so a copied policy (a planner takes its policy by value) would allocate
// on the hot path as it grows again. Here the storage itself has `capacity` elements, and copies
// (construction or assignment) keep them.
#include "expert_cache/base/version.hpp"
#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace expert_cache::inline v0::detail {

template <class T>
class FixedVector {
 public:
  FixedVector() = default;
  explicit FixedVector(std::size_t capacity) : data_(capacity) {}

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return data_.size(); }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

  [[nodiscard]] T* begin() noexcept { return data_.data(); }
  [[nodiscard]] T* end() noexcept { return data_.data() + size_; }
  [[nodiscard]] const T* begin() const noexcept { return data_.data(); }
  [[nodiscard]] const T* end() const noexcept { return data_.data() + size_; }
  [[nodiscard]] T& operator[](std::size_t i) noexcept { return data_[i]; }
  [[nodiscard]] const T& operator[](std::size_t i) const noexcept { return data_[i]; }
  [[nodiscard]] T& back() noexcept { return data_[size_ - 1]; }
  [[nodiscard]] std::span<const T> view() const noexcept { return {data_.data(), size_}; }

  // Callers keep size() <= capacity() (residents <= slots); a push beyond is dropped rather
  // than written out of bounds.
  void push_back(const T& v) noexcept {
    if (size_ < data_.size()) data_[size_++] = v;
  }
  void pop_back() noexcept { --size_; }
  void clear() noexcept { size_ = 0; }
  // Order-preserving erase (shifts the tail down by one).
  void erase(T* at) noexcept {
    std::copy(at + 1, end(), at);
    --size_;
  }
  // Replaces the contents with at most capacity() elements of [first, last).
  template <class It>
  void assign(It first, It last) noexcept {
    size_ = 0;
    for (; first != last && size_ < data_.size(); ++first) data_[size_++] = *first;
  }

  // Equal contents; the capacity and the dead tail do not count.
  friend bool operator==(const FixedVector& a, const FixedVector& b) noexcept {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  std::vector<T> data_;  // always capacity elements; only [0, size_) are live
  std::size_t size_ = 0;
};

}  // namespace expert_cache::inline v0::detail
