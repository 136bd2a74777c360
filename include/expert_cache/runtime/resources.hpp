#pragma once
/// Owned runtime resources: a memory allocation (RuntimeBuffer) and a stream or event
/// (RuntimeHandle, with the RuntimeStream / RuntimeEvent aliases), each released on destruction.
// Any allocating_runtime / runtime model works (SimRuntime, CudaRuntime).
// Host-only.
#include <cstddef>
#include <type_traits>
#include <utility>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/runtime_types.hpp"
#include "expert_cache/base/status.hpp"

namespace expert_cache::inline v0 {

namespace detail {
template <allocating_runtime R>
void deallocate(R& rt, void* p, MemoryKind kind) noexcept {
  if constexpr (requires { rt.deallocate(p, kind); }) {
    (void)rt.deallocate(p, kind);
  } else {
    (void)rt.deallocate(p);
  }
}
}  // namespace detail

/// An owned runtime allocation, freed on destruction.
template <allocating_runtime R>
class RuntimeBuffer {
 public:
  RuntimeBuffer() = default;
  /// @param rt     the runtime that allocates and later frees; it must outlive the buffer
  /// @param bytes  size; 0 allocates nothing (data() is null)
  /// @param kind   device, pinned_host or host memory
  /// @throws Error with the runtime's status when the allocation fails
  RuntimeBuffer(R& rt, std::size_t bytes, MemoryKind kind) : rt_(&rt), kind_(kind), bytes_(bytes) {
    if (bytes == 0) return;
    auto r = rt.allocate(bytes, kind);
    if (!r.ok()) throw Error(r.status());
    ptr_ = static_cast<std::byte*>(r.value());
  }
  RuntimeBuffer(RuntimeBuffer&& o) noexcept { swap(o); }
  RuntimeBuffer& operator=(RuntimeBuffer&& o) noexcept {
    RuntimeBuffer(std::move(o)).swap(*this);
    return *this;
  }
  RuntimeBuffer(const RuntimeBuffer&) = delete;
  RuntimeBuffer& operator=(const RuntimeBuffer&) = delete;
  ~RuntimeBuffer() {
    if (ptr_ != nullptr) detail::deallocate(*rt_, ptr_, kind_);
  }
  /// The allocation (null when empty or moved from).
  [[nodiscard]] std::byte* data() const noexcept { return ptr_; }
  /// Bytes asked for at construction.
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }

 private:
  void swap(RuntimeBuffer& o) noexcept {
    std::swap(rt_, o.rt_);
    std::swap(kind_, o.kind_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
  }
  R* rt_ = nullptr;
  MemoryKind kind_ = MemoryKind::host;
  std::byte* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Owns one stream or event of a runtime.
template <runtime R, bool IsStream>
class RuntimeHandle {
 public:
  using Handle = std::conditional_t<IsStream, typename R::Stream, typename R::Event>;
  RuntimeHandle() = default;
  /// Creates the stream or event.
  /// @param rt  the runtime that creates and later destroys it; it must outlive the handle
  /// @throws Error with the runtime's status when creation fails
  explicit RuntimeHandle(R& rt) : rt_(&rt) {
    auto h = IsStream ? wrap(rt.create_stream()) : wrap(rt.create_event());
    if (!h.ok()) throw Error(h.status());
    handle_ = h.value();
  }
  RuntimeHandle(RuntimeHandle&& o) noexcept : rt_(std::exchange(o.rt_, nullptr)), handle_(o.handle_) {}
  RuntimeHandle& operator=(RuntimeHandle&& o) noexcept {
    reset();
    rt_ = std::exchange(o.rt_, nullptr);
    handle_ = o.handle_;
    return *this;
  }
  RuntimeHandle(const RuntimeHandle&) = delete;
  RuntimeHandle& operator=(const RuntimeHandle&) = delete;
  ~RuntimeHandle() { reset(); }
  /// The runtime's handle, to pass to its calls (ownership stays here).
  [[nodiscard]] Handle get() const noexcept { return handle_; }

 private:
  template <class T>
  static Result<Handle> wrap(Result<T> r) {
    if constexpr (std::is_same_v<T, Handle>) {
      return r;
    } else {
      return Status(ErrorCode::internal, "runtime handle type mismatch");
    }
  }
  void reset() noexcept {
    if (rt_ == nullptr) return;
    if constexpr (IsStream) rt_->destroy_stream(handle_); else rt_->destroy_event(handle_);
    rt_ = nullptr;
  }
  R* rt_ = nullptr;
  Handle handle_{};
};

/// An owned stream.
template <runtime R>
using RuntimeStream = RuntimeHandle<R, true>;
/// An owned event.
template <runtime R>
using RuntimeEvent = RuntimeHandle<R, false>;

}  // namespace expert_cache::inline v0
