#pragma once
// Staging policies built from plain runtime copies. A staging policy decides WHERE fills run
// (the cache-owned copy stream or the caller's stream) and HOW they are issued; the ordering
// core decides WHEN (its events). Both storage arrangements are handled: an expert-major
// storage fills a miss with ONE transfer, a tensor-major one with one copy per tensor.
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "expert_cache/planner.hpp"
#include "expert_cache/runtime/runtime.hpp"
#include "expert_cache/storage/slot_storage.hpp"

namespace expert_cache::inline v0 {

namespace detail {
// Calls fn(dst, src, bytes) for every copy the fills need.
template <class Storage, class Fn>
Status for_each_fill_copy(const Storage& storage, std::span<const SlotFill> fills, Fn&& fn) noexcept {
  for (const SlotFill& f : fills) {
    if constexpr (Storage::expert_contiguous) {
      if (Status s = fn(storage.slot_blob(f.slot.value), storage.host_expert(f.expert.value), storage.blob_bytes()); !s) {
        return s;
      }
    } else {
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        const std::size_t bytes = storage.tensors()[t].bytes_per_expert;
        if (bytes == 0) continue;
        if (Status s = fn(storage.slot_tensor(t).slot(f.slot.value), storage.host_tensor(t, f.expert.value), bytes); !s) {
          return s;
        }
      }
    }
  }
  return {};
}

template <class Storage>
std::size_t copies_per_fill(const Storage& storage) noexcept {
  if constexpr (Storage::expert_contiguous) {
    return 1;
  } else {
    std::size_t n = 0;
    for (const auto& t : storage.tensors()) n += t.bytes_per_expert != 0 ? 1 : 0;
    return n;
  }
}
}  // namespace detail

// One copy per tensor row (or per expert blob) on the cache-owned copy stream: the row
// provider's path and the baseline.
struct CopyStream {
  static constexpr std::string_view name = "copy_stream";
  static constexpr bool uses_copy_stream = true;

  template <class R, class Storage>
  Status issue(R& rt, typename R::Stream stream, const Storage& storage, std::span<const SlotFill> fills) noexcept {
    return detail::for_each_fill_copy(storage, fills, [&](void* dst, const void* src, std::size_t n) noexcept {
      return rt.copy_async(dst, src, n, stream);
    });
  }
};

// The same copies on the caller's stream (the cached provider's semantics: no extra stream).
struct Inline {
  static constexpr std::string_view name = "inline";
  static constexpr bool uses_copy_stream = false;

  template <class R, class Storage>
  Status issue(R& rt, typename R::Stream stream, const Storage& storage, std::span<const SlotFill> fills) noexcept {
    return CopyStream{}.issue(rt, stream, storage, fills);
  }
};

template <class R>
concept batching_runtime = runtime<R> && requires(R& rt, std::span<const CopyDesc> copies, typename R::Stream s) {
  { rt.copy_batch_async(copies, s) } noexcept -> std::same_as<Status>;
};

// All of a prepare's copies in ONE batched call on the copy stream (cudaMemcpyBatchAsync).
// CUDA silently drops a batched copy under stream capture, so capture is detected and refused.
class Batched {
 public:
  static constexpr std::string_view name = "batched";
  static constexpr bool uses_copy_stream = true;

  // Called before anything is planned, so a refused call leaves the cache untouched. A caller
  // stream under capture would pull the copy stream into the capture through the events.
  template <batching_runtime R>
  Status precheck(R& rt, typename R::Stream caller) const noexcept {
    return refuse_capture(rt, caller);
  }

  template <batching_runtime R, class Storage>
  Status issue(R& rt, typename R::Stream stream, const Storage& storage, std::span<const SlotFill> fills) noexcept {
    if (Status s = refuse_capture(rt, stream); !s) return s;
    copies_.clear();
    Status s = detail::for_each_fill_copy(storage, fills, [&](void* dst, const void* src, std::size_t n) noexcept {
      copies_.push_back(CopyDesc{dst, src, n});  // capacity reserved on first use; no steady-state allocation
      return Status();
    });
    if (!s) return s;
    if (copies_.empty()) return {};
    return rt.copy_batch_async(std::span<const CopyDesc>(copies_), stream);
  }

 private:
  template <class R>
  static Status refuse_capture(R& rt, typename R::Stream stream) noexcept {
    Result<bool> capturing = rt.is_capturing(stream);
    if (!capturing.ok()) return capturing.status();
    if (capturing.value()) {
      return Status(ErrorCode::capture_unsupported,
                    "Batched staging: batched copies are dropped under stream capture; use Gather or CopyStream in graphs");
    }
    return {};
  }

  std::vector<CopyDesc> copies_;
};

}  // namespace expert_cache::inline v0
