#pragma once
// CUDA error -> Status conversion shared by the CUDA tier. Host compiler + <cuda_runtime_api.h>.
#include <cuda_runtime_api.h>

#include "expert_cache/status.hpp"

namespace expert_cache::inline v0 {

// Status(runtime_failure, "<call> failed: <name>: <description>"). Also reads and clears the
// runtime's last error, so a failure reported here does not resurface in an unrelated later
// cudaGetLastError() check of the caller (sticky errors stay sticky: CUDA keeps them anyway).
[[nodiscard]] inline Status cuda_status(cudaError_t err, const char* call) noexcept {
  if (err == cudaSuccess) return {};
  (void)cudaGetLastError();
  return Status::format(ErrorCode::runtime_failure, "%s failed: %s: %s", call, cudaGetErrorName(err),
                        cudaGetErrorString(err));
}

}  // namespace expert_cache::inline v0
