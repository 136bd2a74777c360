#pragma once
/// How a storage's bytes move on a fill: a small list of copy regions, each one strided run of
/// bytes per expert from the host pool into the slot buffers.
// Staging policies (host-issued copies, batched copies, gather kernels, the device-planned fill)
// read only this list, so a new storage arrangement needs no change in any of them. Host and device
// (plain data).
#include <array>
#include <cstddef>
#include <cstdint>

#include "expert_cache/base/tensor_bytes.hpp"

namespace expert_cache::inline v0 {

/// One strided run of bytes per expert: expert e's bytes of this region are host_base + e *
/// host_stride .. + bytes; slot s's are slot_base + s * slot_stride .. + bytes.
// Tensor-major storage has one region per present tensor (both strides = the tensor's bytes);
// expert-major storage one region covering the whole (padded) blob; expert-major host with
// per-tensor slots one region per present tensor with host_stride = blob bytes and slot_stride =
// tensor bytes (a fill scatters).
struct CopyRegion {
  const std::byte* host_base = nullptr;
  std::byte* slot_base = nullptr;
  std::size_t host_stride = 0;
  std::size_t slot_stride = 0;
  std::size_t bytes = 0;
};

/// At most one region per expert tensor.
inline constexpr std::size_t max_copy_regions = max_expert_tensors;

/// A storage's copy regions: per fill, one copy per region.
struct CopyRegions {
  std::array<CopyRegion, max_copy_regions> regions{};
  std::size_t count = 0;
  [[nodiscard]] constexpr const CopyRegion* begin() const noexcept { return regions.data(); }
  [[nodiscard]] constexpr const CopyRegion* end() const noexcept { return regions.data() + count; }
  /// Bytes one fill moves (the sum of the regions' bytes).
  [[nodiscard]] constexpr std::size_t bytes_per_expert() const noexcept {
    std::size_t sum = 0;
    for (std::size_t i = 0; i < count; ++i) sum += regions[i].bytes;
    return sum;
  }
};

/// `regions` with the ones `first_part` names moved to the front, the order within each part
/// kept: the order of a fill that copies and publishes a first part before the rest (the
/// device-planned cache's fills, edge D4c).
/// @param regions      a storage's copy regions
/// @param first_part   bit r names regions.regions[r]; bits at or past regions.count are the
///                     caller's to refuse
/// @param first_count  gets the size of the first part
/// @return the reordered regions
[[nodiscard]] constexpr CopyRegions first_part_first(const CopyRegions& regions, std::uint32_t first_part,
                                                     std::size_t& first_count) noexcept {
  CopyRegions out;
  out.count = regions.count;
  std::size_t at = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (std::size_t i = 0; i < regions.count; ++i) {
      const bool first = i < 32 && ((first_part >> i) & 1u) != 0;
      if (first == (pass == 0)) out.regions[at++] = regions.regions[i];
    }
    if (pass == 0) first_count = at;
  }
  return out;
}

}  // namespace expert_cache::inline v0
