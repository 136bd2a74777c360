#pragma once
/// Sums the ranks' partial MoE outputs (docs/parallel.md).
// Two backends with one shape of call, run(partials..., out, count, stream):
//
//   SameDeviceAllReduce  several ranks' caches side by side on ONE GPU (tests, and a sanity
//                        path without NCCL): one kernel sums the partials in rank order
//                        0, 1, ..., N-1 (element i: ((p0 + p1) + p2) + ...). No atomics.
//   NcclAllReduce        one communicator per rank (ncclCommInitAll: one process, several
//                        devices; or ncclCommInitRank per process), ncclAllReduce(sum, fp32) on
//                        the rank's stream. Compiled only when EXPERT_CACHE_HAVE_NCCL is defined
//                        (Meson defines it when nccl.h is found: -Dnccl=enabled, -Dnccl_root=DIR).
//
// Bit-identity: with 2 ranks every backend computes p0 + p1 per element (fp32 addition is
// commutative), so the same-device sum, NCCL's ring or tree, and a 1-GPU run of the two partials
// in rank order agree bit for bit. With more ranks NCCL's order depends on its algorithm and
// topology; compare with a tolerance there, or use exactly representable values.
// Keep NVLink multicast off (NCCL_NVLS_ENABLE=0 in the environment): see docs/parallel.md.
#if !defined(__CUDACC__)
#error "expert_cache/parallel/all_reduce.cuh needs nvcc"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "expert_cache/base/config.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/runtime/cuda_error.hpp"

#if defined(EXPERT_CACHE_HAVE_NCCL)
#include <nccl.h>
#endif

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

inline constexpr int max_same_device_ranks = 16;

namespace parallel_detail {

struct PartialPointers {
  const float* p[max_same_device_ranks] = {};
  int ranks = 0;
};

template <class = void>
__global__ void sum_partials_kernel(PartialPointers parts, long long count, float* out) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    float s = parts.p[0][i];
    for (int r = 1; r < parts.ranks; ++r) s += parts.p[r][i];  // rank order
    out[i] = s;
  }
}

}  // namespace parallel_detail

/// Sums the ranks' partials on ONE device with one kernel, in rank order.
class SameDeviceAllReduce {
 public:
  /// Sums `partials` into `out` in rank order. The caller orders the stream after every rank's
  /// producer (an event per rank).
  /// @param partials  device pointers on the current device, each `count` floats; 1 to
  ///                  max_same_device_ranks of them
  /// @param out       device pointer of `count` floats; may be one of the partials
  /// @param count     floats per partial
  /// @param stream    where the kernel runs
  /// @return ok; invalid_argument for a bad rank count or a null pointer; the launch's error
  [[nodiscard]] static Status run(std::span<const float* const> partials, float* out, std::size_t count,
                                  cudaStream_t stream) noexcept {
    if (partials.empty() || partials.size() > static_cast<std::size_t>(max_same_device_ranks))
      return Status::format(ErrorCode::invalid_argument, "SameDeviceAllReduce: %zu ranks outside [1, %d]",
                            partials.size(), max_same_device_ranks);
    parallel_detail::PartialPointers p;
    p.ranks = static_cast<int>(partials.size());
    for (std::size_t r = 0; r < partials.size(); ++r) {
      if (partials[r] == nullptr) return Status::format(ErrorCode::invalid_argument, "SameDeviceAllReduce: partial %zu is null", r);
      p.p[r] = partials[r];
    }
    if (out == nullptr) return Status(ErrorCode::invalid_argument, "SameDeviceAllReduce: null output");
    if (count == 0) return {};
    const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((count + 255) / 256, 1024));
    parallel_detail::sum_partials_kernel<<<blocks, 256, 0, stream>>>(p, static_cast<long long>(count), out);
    return cuda_status(cudaGetLastError(), "SameDeviceAllReduce: sum_partials_kernel launch");
  }
};

#if defined(EXPERT_CACHE_HAVE_NCCL)

[[nodiscard]] inline Status nccl_status(ncclResult_t r, const char* what) noexcept {
  if (r == ncclSuccess) return {};
  return Status::format(ErrorCode::runtime_failure, "%s failed: %s", what, ncclGetErrorString(r));
}

/// One communicator per rank; owns them (ncclCommDestroy on destruction).
class NcclAllReduce {
 public:
  /// One process driving `devices` (ncclCommInitAll).
  /// @param devices  CUDA device ordinals; rank r is devices[r]
  /// @throws Error invalid_argument for no devices, runtime_failure when NCCL fails
  explicit NcclAllReduce(std::span<const int> devices) : devices_(devices.begin(), devices.end()) {
    if (devices_.empty()) throw Error(ErrorCode::invalid_argument, "NcclAllReduce: no devices");
    comms_.resize(devices_.size());
    if (Status s = nccl_status(ncclCommInitAll(comms_.data(), static_cast<int>(devices_.size()), devices_.data()),
                               "ncclCommInitAll");
        !s)
      throw Error(s);
  }
  NcclAllReduce(const NcclAllReduce&) = delete;
  NcclAllReduce& operator=(const NcclAllReduce&) = delete;
  ~NcclAllReduce() {
    for (ncclComm_t c : comms_)
      if (c != nullptr) (void)ncclCommDestroy(c);
  }

  [[nodiscard]] int ranks() const noexcept { return static_cast<int>(comms_.size()); }
  [[nodiscard]] int device(int rank) const noexcept { return devices_[static_cast<std::size_t>(rank)]; }

  /// Every rank's sum at once (one process, several devices: the calls are grouped, as NCCL
  /// requires when one thread drives several communicators).
  /// @param partials  per rank, `count` floats on device(r)
  /// @param outs      per rank, `count` floats on device(r); outs[r] may equal partials[r]
  /// @param count     floats per rank
  /// @param streams   per rank, a stream of device(r)
  /// @return ok; invalid_argument when a span's size is not ranks(); the first NCCL failure
  [[nodiscard]] Status run(std::span<const float* const> partials, std::span<float* const> outs, std::size_t count,
                           std::span<const cudaStream_t> streams) noexcept {
    const std::size_t n = comms_.size();
    if (partials.size() != n || outs.size() != n || streams.size() != n)
      return Status::format(ErrorCode::invalid_argument, "NcclAllReduce: %zu/%zu/%zu partials/outputs/streams for %zu ranks",
                            partials.size(), outs.size(), streams.size(), n);
    if (Status s = nccl_status(ncclGroupStart(), "ncclGroupStart"); !s) return s;
    Status first;
    for (std::size_t r = 0; r < n; ++r) {
      Status s = nccl_status(ncclAllReduce(partials[r], outs[r], count, ncclFloat32, ncclSum, comms_[r], streams[r]),
                             "ncclAllReduce");
      if (!s && first.ok()) first = s.with_context("rank %zu", r);
    }
    Status end = nccl_status(ncclGroupEnd(), "ncclGroupEnd");
    return first.ok() ? end : first;
  }

 private:
  std::vector<int> devices_;
  std::vector<ncclComm_t> comms_;
};

#endif  // EXPERT_CACHE_HAVE_NCCL

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
