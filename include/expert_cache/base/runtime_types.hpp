#pragma once
/// The vocabulary a runtime speaks: access modes, declared accesses, batched copies, memory kinds.
// The `runtime` concept that uses them is in expert_cache/base/concepts.hpp with the other
// concepts. Host-only, no CUDA includes.
#include "expert_cache/base/version.hpp"
#include <cstddef>
#include <cstdint>

namespace expert_cache::inline v0 {

/// How an operation (or the host) touches a byte range.
enum class AccessMode : std::uint8_t { read, write };

/// One declared memory access: [ptr, ptr + bytes) is read or written.
struct Access {
  const void* ptr = nullptr;
  std::size_t bytes = 0;
  AccessMode mode = AccessMode::read;
};

/// One copy of a batch: bytes [src, src + bytes) -> [dst, dst + bytes).
struct CopyDesc {
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
};

/// Where a runtime-owned allocation lives (allocating runtimes; runtime/resources.hpp).
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

}  // namespace expert_cache::inline v0
