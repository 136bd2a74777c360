#pragma once
/// CUDA error -> Status conversion shared by the CUDA tier: the one place a cudaError_t becomes a
/// message.
// Host compiler + <cuda_runtime_api.h>.
#include <cuda_runtime_api.h>

#include "expert_cache/base/status.hpp"

namespace expert_cache::inline v0 {

/// A CUDA result as a Status. Also reads and clears the runtime's last error, so a failure
/// reported here does not resurface in an unrelated later cudaGetLastError() check of the
/// caller (sticky errors stay sticky: CUDA keeps them anyway).
/// @param err   the CUDA call's result
/// @param call  the call's name, for the message
/// @return ok for cudaSuccess, else Status(runtime_failure, "<call> failed: <name>: <description>")
[[nodiscard]] inline Status cuda_status(cudaError_t err, const char* call) noexcept {
  if (err == cudaSuccess) return {};
  (void)cudaGetLastError();
  return Status::format(ErrorCode::runtime_failure, "%s failed: %s: %s", call, cudaGetErrorName(err),
                        cudaGetErrorString(err));
}

namespace detail {
// The calling thread's current device, set back on destruction (for code that works on another
// device for a while: the link probe, the copy proxy).
class DeviceRestore {
 public:
  DeviceRestore() noexcept : ok_(cudaGetDevice(&previous_) == cudaSuccess) {
    if (!ok_) (void)cudaGetLastError();
  }
  ~DeviceRestore() {
    if (ok_) (void)cuda_status(cudaSetDevice(previous_), "cudaSetDevice (restoring the caller's device)");
  }
  DeviceRestore(const DeviceRestore&) = delete;
  DeviceRestore& operator=(const DeviceRestore&) = delete;
  [[nodiscard]] bool ok() const noexcept { return ok_; }

 private:
  int previous_ = 0;
  bool ok_ = false;
};
}  // namespace detail

}  // namespace expert_cache::inline v0

/// Evaluates `expr` (a cudaError_t) and, when it failed, returns cuda_status(err, "<expr>") from
/// the enclosing function (which returns Status or a Result<T>).
#define EXPERT_CACHE_TRY_CUDA(expr)                                                                  \
  do {                                                                                               \
    if (::expert_cache::Status expert_cache_cuda_status_ = ::expert_cache::cuda_status((expr), #expr); \
        !expert_cache_cuda_status_)                                                                  \
      return expert_cache_cuda_status_;                                                              \
  } while (0)
