#pragma once
// The `runtime` concept: the only interface through which the library touches streams,
// events and asynchronous copies. Shaped after the CUDA runtime API (cudaStream_t,
// cudaEvent_t without timing, cudaEventRecord, cudaStreamWaitEvent, cudaMemcpyAsync) so a
// CudaRuntime is a thin wrapper; SimRuntime (sim_runtime.hpp) is the deterministic host
// model with a race detector. Host-only, no CUDA includes.
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "expert_cache/status.hpp"

namespace expert_cache::inline v0 {

// How an operation (or the host) touches a byte range.
enum class AccessMode : std::uint8_t { read, write };

// One declared memory access: [ptr, ptr + bytes) is read or written.
struct Access {
  const void* ptr = nullptr;
  std::size_t bytes = 0;
  AccessMode mode = AccessMode::read;
};

// One copy of a batch: bytes [src, src + bytes) -> [dst, dst + bytes).
struct CopyDesc {
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
};

// Where a runtime-owned allocation lives (used by allocation helpers; not part of the concept).
enum class MemoryKind : std::uint8_t { device, pinned_host, host };

[[nodiscard]] constexpr const char* to_string(AccessMode mode) noexcept {
  return mode == AccessMode::read ? "read" : "write";
}

[[nodiscard]] constexpr const char* to_string(MemoryKind kind) noexcept {
  switch (kind) {
    case MemoryKind::device: return "device";
    case MemoryKind::pinned_host: return "pinned_host";
    case MemoryKind::host: return "host";
  }
  return "unknown";
}

// Stream and event handles are small values (a cudaStream_t / cudaEvent_t, or an index),
// copied freely and compared with ==. Ownership stays with the runtime.
template <class H>
concept runtime_handle = std::regular<H> && std::is_trivially_copyable_v<H>;

// Semantics every model must follow (CUDA's):
// - record(e, s): e's latest record becomes "all work enqueued on s so far"; re-recording
//   replaces it. wait(s, e) captures the record current at the time of the call; waiting on
//   a never-recorded event is a no-op.
// - query(e): true when the latest record has completed (never recorded: true); a true
//   result orders the host after that record, as synchronize(e) does.
// - copy_async reads [src, src + bytes) and writes [dst, dst + bytes) when it runs.
// - host_access(p, n, mode): the host declares it touches host memory now (a no-op on CUDA;
//   SimRuntime checks it against in-flight device work, e.g. staging-buffer reuse).
template <class R>
concept runtime =
    runtime_handle<typename R::Stream> && runtime_handle<typename R::Event> &&
    requires(R& rt, typename R::Stream s, typename R::Event e, void* dst, const void* src,
             const void* p, std::size_t n, AccessMode mode) {
      { rt.create_stream() } -> std::same_as<Result<typename R::Stream>>;
      { rt.destroy_stream(s) } noexcept -> std::same_as<void>;
      { rt.create_event() } -> std::same_as<Result<typename R::Event>>;
      { rt.destroy_event(e) } noexcept -> std::same_as<void>;
      { rt.record(e, s) } noexcept -> std::same_as<Status>;
      { rt.wait(s, e) } noexcept -> std::same_as<Status>;
      { rt.query(e) } noexcept -> std::same_as<Result<bool>>;
      { rt.synchronize(e) } noexcept -> std::same_as<Status>;
      { rt.synchronize(s) } noexcept -> std::same_as<Status>;
      { rt.copy_async(dst, src, n, s) } noexcept -> std::same_as<Status>;
      { rt.is_capturing(s) } noexcept -> std::same_as<Result<bool>>;
      { rt.host_access(p, n, mode) } noexcept -> std::same_as<void>;
    };

}  // namespace expert_cache::inline v0
