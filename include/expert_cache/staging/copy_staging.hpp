#pragma once
/// Staging policies built from plain runtime copies.
// A staging policy decides WHERE fills run (the cache-owned copy stream or the caller's stream) and
// HOW they are issued; the ordering core decides WHEN (its events). What to copy comes only from
// the storage's copy regions (storage/copy_region.hpp): an expert-major storage has one region (a
// miss is ONE transfer), a tensor-major one a region per present tensor. Every policy here
// scatters: each region is its own copy with its own host and slot strides (ExpertMajorHostStorage:
// per fill one copy per tensor from the host blob into that tensor's contiguous slot array).
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/nvtx.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/runtime/runtime.hpp"
#include "expert_cache/storage/copy_region.hpp"
#include "expert_cache/storage/slot_storage.hpp"

namespace expert_cache::inline v0 {

namespace detail {
// Calls fn(dst, src, bytes) for every copy the fills need: per fill, one per copy region.
template <class Fn>
Status for_each_fill_copy(const CopyRegions& regions, std::span<const SlotFill> fills, Fn&& fn) noexcept {
  for (const SlotFill& f : fills) {
    const auto e = static_cast<std::size_t>(f.expert.value);
    const auto slot = static_cast<std::size_t>(f.slot.value);
    for (const CopyRegion& r : regions) {
      if (Status s = fn(r.slot_base + slot * r.slot_stride, r.host_base + e * r.host_stride, r.bytes); !s) return s;
    }
  }
  return {};
}
}  // namespace detail

/// One copy per tensor row (or per expert blob) on the cache-owned copy stream: the row
/// provider's path and the baseline.
struct CopyStream {
  static constexpr std::string_view name = "copy_stream";
  static constexpr bool uses_copy_stream = true;

  /// Enqueues every fill's copies (one per copy region) on `stream`.
  /// @param rt       the cache's runtime
  /// @param stream   the fill stream the ordering core hands over
  /// @param storage  the cache's storage (its copy_regions())
  /// @param fills    the planned (expert, slot) fills
  /// @return the first failed copy's status (the copies before it stay enqueued)
  template <class R, class Storage>
  Status issue(R& rt, typename R::Stream stream, const Storage& storage, std::span<const SlotFill> fills) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::fill");
    return detail::for_each_fill_copy(storage.copy_regions(), fills, [&](void* dst, const void* src, std::size_t n) noexcept {
      return rt.copy_async(dst, src, n, stream);
    });
  }
};

/// The same copies on the caller's stream (the cached provider's semantics: no extra stream).
struct Inline {
  static constexpr std::string_view name = "inline";
  static constexpr bool uses_copy_stream = false;

  /// As CopyStream::issue; `stream` is the caller's.
  template <class R, class Storage>
  Status issue(R& rt, typename R::Stream stream, const Storage& storage, std::span<const SlotFill> fills) noexcept {
    return CopyStream{}.issue(rt, stream, storage, fills);
  }
};

/// All of a prepare's copies in ONE batched call on the copy stream (cudaMemcpyBatchAsync).
/// CUDA silently drops a batched copy under stream capture, so capture is detected and refused.
class Batched {
 public:
  static constexpr std::string_view name = "batched";
  static constexpr bool uses_copy_stream = true;

  /// Called before anything is planned, so a refused call leaves the cache untouched. A caller
  /// stream under capture would pull the copy stream into the capture through the events.
  /// @param rt      the cache's runtime
  /// @param caller  the stream of the cache call
  /// @return capture_unsupported while `caller` is capturing, a failed capture query's status,
  ///         else ok
  template <batching_runtime R>
  Status precheck(R& rt, typename R::Stream caller) const noexcept {
    return refuse_capture(rt, caller);
  }

  /// Enqueues every fill's copies in one copy_batch_async call on `stream`.
  /// @return capture_unsupported while `stream` is capturing, else the batched call's status
  template <batching_runtime R, class Storage>
  Status issue(R& rt, typename R::Stream stream, const Storage& storage, std::span<const SlotFill> fills) noexcept {
    EXPERT_CACHE_NVTX_RANGE("expert_cache::fill");
    if (Status s = refuse_capture(rt, stream); !s) return s;
    copies_.clear();
    Status s = detail::for_each_fill_copy(storage.copy_regions(), fills, [&](void* dst, const void* src, std::size_t n) noexcept {
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

static_assert(staging_policy_for<CopyStream, detail::RuntimeArchetype, TensorMajorStorage>);
static_assert(staging_policy_for<CopyStream, detail::RuntimeArchetype, ExpertMajorStorage>);
static_assert(staging_policy_for<Inline, detail::RuntimeArchetype, TensorMajorStorage>);
static_assert(staging_policy_for<Inline, detail::RuntimeArchetype, ExpertMajorStorage>);
static_assert(staging_policy_for<Batched, detail::RuntimeArchetype, TensorMajorStorage>);
static_assert(staging_policy_for<Batched, detail::RuntimeArchetype, ExpertMajorStorage>);
static_assert(staging_policy_for<CopyStream, detail::RuntimeArchetype, ExpertMajorHostStorage>);
static_assert(staging_policy_for<Inline, detail::RuntimeArchetype, ExpertMajorHostStorage>);
static_assert(staging_policy_for<Batched, detail::RuntimeArchetype, ExpertMajorHostStorage>);

}  // namespace expert_cache::inline v0
