#pragma once
// Caller-owned host tensors for tests of StorageMemory through the caches: one 64-byte aligned
// [experts, bytes_t] array per tensor (an engine's weight tensors as they are), expert e of
// tensor t holding pattern_byte(t, e, i) (what fill_host_pools writes), and the StorageMemory
// naming them.
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/storage/storage_memory.hpp"
#include "support/sim_cache_harness.hpp"

namespace expert_cache::test {

struct CallerHostTensors {
  struct alignas(64) Line {
    std::byte b[64];
  };

  CallerHostTensors(const ExpertTensorBytes& tensors, std::int32_t experts) {
    for (std::size_t t = 0; t < max_expert_tensors; ++t) {
      const std::size_t b = tensors[t].bytes_per_expert;
      if (b == 0) continue;
      bytes[t] = static_cast<std::size_t>(experts) * b;
      lines[t].resize((bytes[t] + sizeof(Line) - 1) / sizeof(Line));
      for (std::int32_t e = 0; e < experts; ++e)
        for (std::size_t i = 0; i < b; ++i) data(t)[static_cast<std::size_t>(e) * b + i] = pattern_byte(t, e, i);
    }
  }
  [[nodiscard]] std::byte* data(std::size_t t) noexcept { return lines[t].empty() ? nullptr : lines[t].data()->b; }
  [[nodiscard]] StorageMemory memory() {
    StorageMemory m;
    for (std::size_t t = 0; t < max_expert_tensors; ++t)
      if (bytes[t] != 0) m.host_tensors[t] = MemorySpan{data(t), bytes[t]};
    return m;
  }

  std::array<std::vector<Line>, max_expert_tensors> lines{};
  std::array<std::size_t, max_expert_tensors> bytes{};
};

}  // namespace expert_cache::test
