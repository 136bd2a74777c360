#pragma once
// The ordering core: the ONLY code in the library that records events and makes streams wait.
// Every ExpertCache instantiation (row, whole-expert, any staging policy) goes through it.
//
// Streams involved:
//   X      the caller's (consumer) stream of the current prepare()/invalidate()
//   owner  the stream of the last accepted prepare(): where kernels read the slots and maps
//   F      the fill stream: the cache-owned copy stream, or X itself in inline mode
//   last_fill  the stream that last wrote slots / the resident map (differs from F only in
//              inline mode, when calls move between streams)
//
// Edges (docs/design.md has the full happens-before table):
//   release_wait    record `release` on owner and last_fill, F waits: slot and map overwrites
//                   come after every earlier reader (WAR) and writer (WAW).
//   ready_wait      record `ready` on F after the writes, X waits: readers see the fills (RAW).
//   invalidate_order  invalidate()'s resident-map write waits like a fill does.
//   resident_map_serialised  resident-map uploads go on F, in order with slot copies, so an
//                   older generation can never land after a newer one.
//   staging_guard   a host staging buffer is rewritten only after the copy reading it finished.
// Tests build the core with one edge removed (a compile-time switch) and show the race
// detector fires: an edge nobody can remove without failing a test is an edge that is tested.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "expert_cache/runtime/runtime.hpp"
#include "expert_cache/status.hpp"

namespace expert_cache::inline v0 {

struct OrderingEdges {
  static constexpr bool release_wait = true;
  static constexpr bool ready_wait = true;
  static constexpr bool invalidate_order = true;
  static constexpr bool resident_map_serialised = true;
  static constexpr bool staging_guard = true;
};

// Runtimes that can allocate the memory a cache needs (device, pinned host).
// deallocate may take the kind (CUDA frees pinned and device memory differently) or not.
template <class R>
concept allocating_runtime =
    runtime<R> && requires(R& rt, std::size_t n, MemoryKind kind) {
      { rt.allocate(n, kind) } -> std::same_as<Result<void*>>;
    } && (requires(R& rt, void* p, MemoryKind kind) { rt.deallocate(p, kind); } ||
          requires(R& rt, void* p) { rt.deallocate(p); });

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

// An owned runtime allocation, freed on destruction.
template <allocating_runtime R>
class RuntimeBuffer {
 public:
  RuntimeBuffer() = default;
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
  [[nodiscard]] std::byte* data() const noexcept { return ptr_; }
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

// Owns one stream or event of a runtime.
template <runtime R, bool IsStream>
class RuntimeHandle {
 public:
  using Handle = std::conditional_t<IsStream, typename R::Stream, typename R::Event>;
  RuntimeHandle() = default;
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

struct OrderingCounters {
  std::uint64_t owner_changes = 0;
  std::uint64_t map_uploads = 0;
  std::uint64_t staging_stalls = 0;  // host waited for a staging buffer's copy to finish
  std::uint64_t release_edges = 0;
  std::uint64_t ready_edges = 0;
};

template <allocating_runtime R, class Edges = OrderingEdges>
class OrderingCore {
 public:
  using Stream = typename R::Stream;
  using Event = typename R::Event;

  // `fill_on_copy_stream`: false = inline mode (fills on the caller's stream, the cached
  // provider's semantics). `map_entries`: int32 entries of each device map upload.
  OrderingCore(R& rt, bool fill_on_copy_stream, std::size_t map_entries, std::size_t staging_ring)
      : rt_(&rt),
        inline_mode_(!fill_on_copy_stream),
        map_bytes_(map_entries * sizeof(std::int32_t)),
        release_owner_(rt),
        release_fill_(rt),
        ready_(rt) {
    if (staging_ring < 2) throw Error(ErrorCode::invalid_argument, "staging ring needs at least 2 buffers");
    if (fill_on_copy_stream) copy_stream_.emplace(rt);
    ring_.reserve(staging_ring);
    for (std::size_t i = 0; i < staging_ring; ++i) {
      ring_.push_back(StagingBuffer{RuntimeBuffer<R>(rt, map_bytes_, MemoryKind::pinned_host),
                                    RuntimeHandle<R, false>(rt), false, 0});
    }
  }

  [[nodiscard]] bool inline_mode() const noexcept { return inline_mode_; }
  [[nodiscard]] std::optional<Stream> owner() const noexcept { return owner_; }
  [[nodiscard]] std::optional<Stream> copy_stream() const noexcept {
    return copy_stream_ ? std::optional<Stream>(copy_stream_->get()) : std::nullopt;
  }
  [[nodiscard]] const OrderingCounters& counters() const noexcept { return counters_; }
  [[nodiscard]] std::size_t staging_bytes() const noexcept { return ring_.size() * map_bytes_; }

  // The stream that writes slots and the resident map for a call from `caller`.
  [[nodiscard]] Stream fill_stream(Stream caller) const noexcept {
    return inline_mode_ ? caller : copy_stream_->get();
  }

  // Before any write on F: F waits for every earlier reader (owner) and writer (last_fill).
  // `enabled` is the edge switch of the calling operation (fills or invalidate).
  // capture_join: when the caller's stream is being captured into a graph and F is another
  // stream, F first waits for a record made on the caller inside the capture, which forks F
  // into the same capture (otherwise F's writes would run eagerly, outside the graph).
  template <bool Enabled>
  Status order_writes_after_previous_use(Stream fill, Stream caller) noexcept {
    if (fill != caller) {
      Result<bool> capturing = rt_->is_capturing(caller);
      if (!capturing.ok()) return capturing.status();
      if (capturing.value()) {
        if (Status s = rt_->record(release_owner_.get(), caller); !s) return s;
        if (Status s = rt_->wait(fill, release_owner_.get()); !s) return s;
      }
    }
    if constexpr (Enabled) {
      if (owner_ && *owner_ != fill) {
        if (Status s = rt_->record(release_owner_.get(), *owner_); !s) return s;
        if (Status s = rt_->wait(fill, release_owner_.get()); !s) return s;
        ++counters_.release_edges;
      }
      if (last_fill_ && *last_fill_ != fill && (!owner_ || *last_fill_ != *owner_)) {
        if (Status s = rt_->record(release_fill_.get(), *last_fill_); !s) return s;
        if (Status s = rt_->wait(fill, release_fill_.get()); !s) return s;
        ++counters_.release_edges;
      }
    }
    last_fill_ = fill;  // set before the writes: a partly enqueued fill still counts as a writer
    return {};
  }

  // After the writes on F: record `ready` there; `caller` waits for it. Other streams that
  // later read without writing of their own wait in adopt_reader().
  Status publish_writes(Stream fill, Stream caller) noexcept {
    if (Status s = rt_->record(ready_.get(), fill); !s) return s;
    ready_recorded_ = true;
    ready_seen_count_ = 0;
    if (fill != caller) {
      if constexpr (Edges::ready_wait) {
        if (Status s = rt_->wait(caller, ready_.get()); !s) return s;
        ++counters_.ready_edges;
      }
    }
    note_ready_seen(caller);
    return {};
  }

  // prepare() from `caller` that wrote nothing itself (all hits, maps clean). Readers on
  // caller must come after the latest writes (fills or an invalidate's map upload, possibly
  // issued from another stream) and, on an owner change, after the previous owner's readers of
  // the forward map this call overwrites. With writes, publish/order_writes already did both.
  Status adopt_reader(Stream caller, bool writes_done) noexcept {
    const bool owner_changed = owner_ && *owner_ != caller;
    if (owner_changed) ++counters_.owner_changes;
    if (!writes_done) {
      if constexpr (Edges::release_wait) {
        if (owner_changed) {
          if (Status s = rt_->record(release_owner_.get(), *owner_); !s) return s;
          if (Status s = rt_->wait(caller, release_owner_.get()); !s) return s;
          ++counters_.release_edges;
        }
      }
      if constexpr (Edges::ready_wait) {
        if (ready_recorded_ && !ready_seen_by(caller)) {
          if (Status s = rt_->wait(caller, ready_.get()); !s) return s;
          ++counters_.ready_edges;
          note_ready_seen(caller);
        }
      }
    }
    owner_ = caller;
    return {};
  }

  // One async copy of a host map (int32 entries) into a device buffer on `stream`, through
  // the next staging buffer of the ring.
  //
  // Under graph capture the copy becomes a graph node that reads the staging buffer at each
  // launch, and `consumed` becomes a captured event the host cannot query. Such a buffer is
  // treated as free by the capture contract (docs/cuda_backend.md: a graph holding a captured
  // cache call is launched and completed before the cache's next call), except inside the
  // capture that used it: rewriting it there would change what the graph uploads, so that
  // is refused.
  Status upload_map(const std::int32_t* host_map, std::int32_t* device_map, Stream stream) noexcept {
    Result<std::uint64_t> capture = capture_sequence(stream);
    if (!capture.ok()) return capture.status();
    StagingBuffer& buf = ring_[next_staging_];
    if (buf.capture != 0) {
      if (buf.capture == capture.value()) {
        return Status::format(ErrorCode::capture_unsupported,
                              "one graph capture needs more map uploads than the staging ring holds (%zu buffers); "
                              "raise CacheOptions::staging_ring",
                              ring_.size());
      }
      buf.recorded = false;
      buf.capture = 0;
    }
    next_staging_ = (next_staging_ + 1) % ring_.size();
    if constexpr (Edges::staging_guard) {
      if (buf.recorded) {
        Result<bool> done = rt_->query(buf.consumed.get());
        if (!done.ok()) return done.status();
        if (!done.value()) {
          ++counters_.staging_stalls;
          if (Status s = rt_->synchronize(buf.consumed.get()); !s) return s;
        }
      }
    }
    rt_->host_access(buf.memory.data(), map_bytes_, AccessMode::write);
    std::memcpy(buf.memory.data(), host_map, map_bytes_);
    if (Status s = rt_->copy_async(device_map, buf.memory.data(), map_bytes_, stream); !s) return s;
    if (Status s = rt_->record(buf.consumed.get(), stream); !s) {
      buf.recorded = false;
      return s;
    }
    buf.recorded = true;
    buf.capture = capture.value();
    last_upload_captured_ = capture.value() != 0;
    ++counters_.map_uploads;
    return {};
  }

  // Whether the last successful upload_map was recorded into a graph capture.
  [[nodiscard]] bool last_upload_captured() const noexcept { return last_upload_captured_; }

 private:
  // 0 when `s` is not capturing, else an id of the capture sequence: distinct per capture
  // where the runtime has capture_id() (CudaRuntime), otherwise 1 for every capture.
  Result<std::uint64_t> capture_sequence(Stream s) noexcept {
    if constexpr (requires { { rt_->capture_id(s) } -> std::same_as<Result<std::uint64_t>>; }) {
      return rt_->capture_id(s);
    } else {
      Result<bool> capturing = rt_->is_capturing(s);
      if (!capturing.ok()) return capturing.status();
      return std::uint64_t{capturing.value() ? 1u : 0u};
    }
  }

  [[nodiscard]] bool ready_seen_by(Stream s) const noexcept {
    for (std::size_t i = 0; i < ready_seen_count_; ++i) {
      if (ready_seen_[i] == s) return true;
    }
    return false;
  }
  // A full list only costs a redundant wait later, never a missing one.
  void note_ready_seen(Stream s) noexcept {
    if (ready_seen_count_ < ready_seen_.size() && !ready_seen_by(s)) ready_seen_[ready_seen_count_++] = s;
  }

  struct StagingBuffer {
    RuntimeBuffer<R> memory;
    RuntimeHandle<R, false> consumed;  // recorded after the copy that reads `memory`
    bool recorded = false;
    std::uint64_t capture = 0;  // capture sequence of the last record (0: recorded eagerly)
  };

  R* rt_;
  bool inline_mode_;
  std::size_t map_bytes_;
  std::optional<RuntimeHandle<R, true>> copy_stream_;
  RuntimeHandle<R, false> release_owner_;
  RuntimeHandle<R, false> release_fill_;
  RuntimeHandle<R, false> ready_;
  bool ready_recorded_ = false;
  std::array<Stream, 4> ready_seen_{};  // streams that already waited for the latest `ready`
  std::size_t ready_seen_count_ = 0;
  std::optional<Stream> owner_;
  std::optional<Stream> last_fill_;
  std::vector<StagingBuffer> ring_;
  std::size_t next_staging_ = 0;
  bool last_upload_captured_ = false;
  OrderingCounters counters_;
};

}  // namespace expert_cache::inline v0
