#pragma once
/// A device plan state in host memory (HostPlanStorage) and the host's write of its prior biases (plan_set_bias):
/// what the CPU suite plans on.
//
// Host only: the block is a std::vector, reset on construction with SequentialBlock.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "expert_cache/eviction/crf_math.hpp"
#include "expert_cache/planning/device_plan/block.hpp"
#include "expert_cache/planning/device_plan/reset.hpp"
#include "expert_cache/planning/device_plan/state.hpp"

namespace expert_cache::inline v0 {

// Sets every expert's prior bias (DeviceCrf's frequency prior, eviction/crf_math.hpp's Q32; see
// eviction/crf.hpp) in a state the host can write (HostPlanStorage; DeviceExpertCache uploads the
// same table with set_prior_bias). A table of the wrong length, or none, is refused: false,
// nothing written.
inline bool plan_set_bias(const DevicePlanState& s, const std::uint64_t* bias, std::int32_t n) noexcept {
  if (!plan_view_ok(s) || bias == nullptr || n != s.num_experts) return false;
  for (std::int32_t e = 0; e < n; ++e) s.expert_bias[e] = bias[e];
  return true;
}

// Host memory for one state (the CPU suite): the block laid out by
// bind_plan_state, stats and error word, reset to an empty cache. Not for device code.
class HostPlanStorage {
 public:
  HostPlanStorage(std::int32_t num_experts, std::int32_t capacity, std::uint64_t crf_decay = crf_default_decay_q32)
      : block_((plan_state_bytes(num_experts, capacity) + sizeof(Chunk) - 1) / sizeof(Chunk)) {
    state_ = bind_plan_state(block_.data(), num_experts, capacity, &stats_, &error_word_);
    SequentialBlock b;
    reset_plan_state(b, state_, crf_decay);
  }
  HostPlanStorage(const HostPlanStorage&) = delete;  // the view points into this object
  HostPlanStorage& operator=(const HostPlanStorage&) = delete;

  [[nodiscard]] const DevicePlanState& state() const noexcept { return state_; }
  [[nodiscard]] void* block() noexcept { return block_.data(); }
  [[nodiscard]] std::size_t bytes() const noexcept { return block_.size() * sizeof(Chunk); }

 private:
  struct alignas(16) Chunk {
    std::byte b[16];
  };
  std::vector<Chunk> block_;
  DevicePlanStats stats_{};
  std::uint32_t error_word_ = 0;
  DevicePlanState state_{};
};

}  // namespace expert_cache::inline v0
