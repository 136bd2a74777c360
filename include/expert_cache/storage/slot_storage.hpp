#pragma once
// Where experts live: host pools holding every expert (the source of fills) and device slot
// buffers holding `capacity` of them. Two arrangements:
//   TensorMajorStorage  one host pool and one slot buffer per tensor, one row per expert/slot
//                       (the row provider's layout; a fill is one copy per tensor);
//   ExpertMajorStorage  each expert's tensors contiguous on the host and in a blob slot on the
//                       device (a fill is ONE transfer); the consumer indexes each tensor with
//                       the blob stride.
// Memory comes from the runtime (pinned host + device for CUDA, plain memory for SimRuntime).
//
// Each storage describes its fill copies as CopyRegions (storage/copy_region.hpp): per fill of
// expert e into slot s, one copy per region of `bytes` from host_base + e * host_stride to
// slot_base + s * slot_stride. Staging policies read only that, so the region count is the one
// source of copies per fill. `expert_contiguous` stays as a description for tools (bench); no
// staging policy reads it.
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "expert_cache/concepts.hpp"
#include "expert_cache/layout/tensor_bytes.hpp"
#include "expert_cache/runtime/resources.hpp"
#include "expert_cache/storage/copy_region.hpp"

namespace expert_cache::inline v0 {

// One tensor of the slot buffers as the consumer sees it: tensor of slot s starts at
// base + s * slot_stride and is `bytes` long. bytes == 0: the layout has no such tensor.
struct SlotTensor {
  std::byte* base = nullptr;
  std::size_t slot_stride = 0;
  std::size_t bytes = 0;
  [[nodiscard]] std::byte* slot(std::int32_t s) const noexcept {
    return base + static_cast<std::size_t>(s) * slot_stride;
  }
};

// Upper bound for any single pool: refuses sizes that cannot be real before they reach an
// allocation (1 TiB).
inline constexpr std::size_t max_pool_bytes = std::size_t{1} << 40;

namespace detail {
inline std::size_t checked_pool_bytes(std::size_t rows, std::size_t row_bytes, const char* what) {
  if (row_bytes != 0 && rows > max_pool_bytes / row_bytes) {
    throw Error(ErrorCode::invalid_argument, std::string(what) + ": " + std::to_string(rows) + " rows of " +
                                                 std::to_string(row_bytes) + " bytes exceed the 1 TiB pool limit");
  }
  return rows * row_bytes;
}
inline void check_tensors(const ExpertTensorBytes& tensors) {
  if (total_bytes_per_expert(tensors) == 0) {
    throw Error(ErrorCode::invalid_argument, "the layout has no tensor with a non-zero size");
  }
  for (const auto& t : tensors) {
    if (t.bytes_per_expert > max_pool_bytes) {
      throw Error(ErrorCode::invalid_argument, std::string("tensor ") + std::string(t.name) + " of " +
                                                   std::to_string(t.bytes_per_expert) + " bytes per expert is too large");
    }
  }
}
}  // namespace detail

template <allocating_runtime R>
class TensorMajorStorage {
 public:
  static constexpr bool expert_contiguous = false;
  static constexpr std::string_view name = "tensor_major";

  TensorMajorStorage(R& rt, CacheShape shape, const ExpertTensorBytes& tensors) : tensors_(tensors) {
    detail::check_tensors(tensors);
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      const std::size_t row = tensors[t].bytes_per_expert;
      if (row == 0) continue;
      const std::size_t host = detail::checked_pool_bytes(static_cast<std::size_t>(shape.num_experts), row, "host pool");
      const std::size_t slots = detail::checked_pool_bytes(static_cast<std::size_t>(shape.capacity), row, "slot buffer");
      host_[t] = RuntimeBuffer<R>(rt, host, MemoryKind::pinned_host);
      slots_[t] = RuntimeBuffer<R>(rt, slots, MemoryKind::device);
      host_bytes_ += host;
      slot_bytes_ += slots;
      regions_.regions[regions_.count++] = CopyRegion{host_[t].data(), slots_[t].data(), row, row, row};
    }
  }

  // One region per present tensor, in tensor order.
  [[nodiscard]] const CopyRegions& copy_regions() const noexcept { return regions_; }

  [[nodiscard]] const ExpertTensorBytes& tensors() const noexcept { return tensors_; }
  [[nodiscard]] std::byte* host_tensor(std::size_t t, std::int32_t expert) const noexcept {
    return host_[t].data() + static_cast<std::size_t>(expert) * tensors_[t].bytes_per_expert;
  }
  [[nodiscard]] SlotTensor slot_tensor(std::size_t t) const noexcept {
    return SlotTensor{slots_[t].data(), tensors_[t].bytes_per_expert, tensors_[t].bytes_per_expert};
  }
  [[nodiscard]] std::size_t host_bytes() const noexcept { return host_bytes_; }
  [[nodiscard]] std::size_t slot_bytes() const noexcept { return slot_bytes_; }

 private:
  ExpertTensorBytes tensors_;
  std::array<RuntimeBuffer<R>, num_expert_tensors> host_{};
  std::array<RuntimeBuffer<R>, num_expert_tensors> slots_{};
  std::size_t host_bytes_ = 0;
  std::size_t slot_bytes_ = 0;
  CopyRegions regions_{};
};

template <allocating_runtime R>
class ExpertMajorStorage {
 public:
  static constexpr bool expert_contiguous = true;
  static constexpr std::string_view name = "expert_major";
  // Tensor offsets inside a blob are rounded up to this so every tensor stays 16-byte
  // aligned for vector loads.
  static constexpr std::size_t tensor_alignment = 16;

  ExpertMajorStorage(R& rt, CacheShape shape, const ExpertTensorBytes& tensors) : tensors_(tensors) {
    detail::check_tensors(tensors);
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      offsets_[t] = blob_bytes_;
      const std::size_t b = tensors[t].bytes_per_expert;
      blob_bytes_ += (b + tensor_alignment - 1) / tensor_alignment * tensor_alignment;
    }
    host_bytes_ = detail::checked_pool_bytes(static_cast<std::size_t>(shape.num_experts), blob_bytes_, "host pool");
    slot_bytes_ = detail::checked_pool_bytes(static_cast<std::size_t>(shape.capacity), blob_bytes_, "slot buffer");
    host_ = RuntimeBuffer<R>(rt, host_bytes_, MemoryKind::pinned_host);
    slots_ = RuntimeBuffer<R>(rt, slot_bytes_, MemoryKind::device);
    regions_.regions[0] = CopyRegion{host_.data(), slots_.data(), blob_bytes_, blob_bytes_, blob_bytes_};
    regions_.count = 1;
  }

  // One region: the whole (padded) blob, so a fill is ONE transfer.
  [[nodiscard]] const CopyRegions& copy_regions() const noexcept { return regions_; }

  [[nodiscard]] const ExpertTensorBytes& tensors() const noexcept { return tensors_; }
  [[nodiscard]] std::size_t blob_bytes() const noexcept { return blob_bytes_; }
  [[nodiscard]] std::byte* host_expert(std::int32_t expert) const noexcept {
    return host_.data() + static_cast<std::size_t>(expert) * blob_bytes_;
  }
  [[nodiscard]] std::byte* host_tensor(std::size_t t, std::int32_t expert) const noexcept {
    return host_expert(expert) + offsets_[t];
  }
  [[nodiscard]] std::byte* slot_blob(std::int32_t slot) const noexcept {
    return slots_.data() + static_cast<std::size_t>(slot) * blob_bytes_;
  }
  [[nodiscard]] SlotTensor slot_tensor(std::size_t t) const noexcept {
    return SlotTensor{slots_.data() + offsets_[t], blob_bytes_, tensors_[t].bytes_per_expert};
  }
  [[nodiscard]] std::size_t host_bytes() const noexcept { return host_bytes_; }
  [[nodiscard]] std::size_t slot_bytes() const noexcept { return slot_bytes_; }

 private:
  ExpertTensorBytes tensors_;
  std::array<std::size_t, num_expert_tensors> offsets_{};
  std::size_t blob_bytes_ = 0;
  std::size_t host_bytes_ = 0;
  std::size_t slot_bytes_ = 0;
  RuntimeBuffer<R> host_;
  RuntimeBuffer<R> slots_;
  CopyRegions regions_{};
};

}  // namespace expert_cache::inline v0
