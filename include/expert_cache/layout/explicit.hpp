#pragma once
/// ExplicitLayout: an expert layout given by explicit per-tensor byte counts (tests, custom
/// formats, and the run-time-selected cache, which erases the layout to its sizes).
#include <string_view>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/tensor_bytes.hpp"

namespace expert_cache::inline v0 {

// A layout given by explicit per-tensor byte counts (tests, custom formats).
struct ExplicitLayout {
  static constexpr std::string_view name = "explicit";
  ExpertTensorBytes bytes{};
  [[nodiscard]] Status validate() const { return {}; }
  [[nodiscard]] constexpr ExpertTensorBytes tensors() const noexcept { return bytes; }
};
static_assert(expert_layout<ExplicitLayout>);

}  // namespace expert_cache::inline v0
