#pragma once
/// CudaRuntime: the `runtime` (and `allocating_runtime`) model over the CUDA runtime API.
// Host compiler + <cuda_runtime_api.h> only: no kernels here (the Gather kernel lives in
// expert_cache/kernels/fill_copy.cuh), so this header builds with g++ given CUDA's include dir.
//
//   Stream = cudaStream_t (created non-blocking), Event = cudaEvent_t (cudaEventDisableTiming)
//   copy_async        cudaMemcpyAsync(cudaMemcpyDefault)
//   copy_batch_async  cudaMemcpyBatchAsync (one call for all copies; refused under capture)
//   allocate          device: cudaMalloc; pinned_host: cudaHostAlloc(Mapped | Portable), so
//                     Gather reads it zero-copy; host: malloc
//
// Every call is checked; a failure returns Status(runtime_failure, "<call> failed: <name>:
// <text>") and clears the runtime's last error. Debug aid: Options::sync_after_enqueue (or the
// environment variable EXPERT_CACHE_CUDA_SYNC=1) synchronises the stream after every enqueued
// operation, so an asynchronous fault is reported by the call that caused it.
//
// Graph capture (docs/cuda_backend.md): query()/synchronize(Event) switch the thread to the
// relaxed capture mode for the call, because the ordering core queries *eager* staging events
// while the caller's stream may be capturing (cudaEventQuery is otherwise an illegal call during
// a global/thread-local capture and would invalidate it). An event whose last record was made
// inside a capture stands for graph nodes, not executed work; outside that capture CUDA rejects
// queries and waits on it (cudaErrorCapturedEvent). The capture contract (a graph holding a
// captured cache call is launched and completed before the cache's next call) makes such work
// complete, so those calls report completion / do nothing.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/runtime/cuda_error.hpp"
#include "expert_cache/runtime/runtime.hpp"

namespace expert_cache::inline v0 {

/// The runtime every CUDA cache runs on: streams, events, copies and memory through the CUDA
/// runtime API of the calling thread's current device. Not copyable (caches keep a reference).
class CudaRuntime {
 public:
  using Stream = cudaStream_t;
  using Event = cudaEvent_t;

  /// Construction options.
  struct Options {
    /// Synchronise the stream after each enqueue (not while it is capturing). Also switched on
    /// by EXPERT_CACHE_CUDA_SYNC=1 in the environment.
    bool sync_after_enqueue = false;
  };

  /// A runtime with default options (EXPERT_CACHE_CUDA_SYNC still applies). Creates nothing.
  CudaRuntime() : CudaRuntime(Options{}) {}
  /// @param options  Options::sync_after_enqueue for debugging asynchronous faults; the
  ///                 environment variable EXPERT_CACHE_CUDA_SYNC=1 switches it on as well
  explicit CudaRuntime(Options options) : sync_after_enqueue_(options.sync_after_enqueue || env_sync()) {}
  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;

  /// Whether every enqueue is followed by a stream synchronisation (debug mode).
  [[nodiscard]] bool sync_after_enqueue() const noexcept { return sync_after_enqueue_; }

  // ---- streams and events ---------------------------------------------------------------

  Result<Stream> create_stream() {
    Stream s = nullptr;
    // Non-blocking: the cache's copy stream must not serialise with the legacy default stream.
    if (Status st = cuda_status(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); !st)
      return st;
    return s;
  }
  void destroy_stream(Stream s) noexcept {
    if (s != nullptr) (void)cuda_status(cudaStreamDestroy(s), "cudaStreamDestroy");
  }
  Result<Event> create_event() {
    Event e = nullptr;
    if (Status st = cuda_status(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags"); !st)
      return st;
    return e;
  }
  void destroy_event(Event e) noexcept {
    if (e != nullptr) (void)cuda_status(cudaEventDestroy(e), "cudaEventDestroy");
  }

  Status record(Event e, Stream s) noexcept {
    if (Status st = cuda_status(cudaEventRecord(e, s), "cudaEventRecord"); !st) return st;
    // Remember events whose latest record is a capture node. Once that capture has ended,
    // CUDA rejects waits on them (seen on the H200: cudaErrorInvalidValue, not only
    // cudaErrorCapturedEvent); by the capture contract their work has completed then.
    // Until any capture has been seen, skip the query: every cache call asks for its stream's
    // capture state (capture_id / is_capturing) before its first record on that stream, so the
    // first capture is always observed in time, and the common never-captured path stays cheap.
    if (!capture_seen_) return {};
    Result<std::uint64_t> capture = capture_id(s);
    const std::uint64_t id = capture.ok() ? capture.value() : 0;
    const auto it = std::find_if(captured_events_.begin(), captured_events_.end(),
                                 [e](const CapturedRecord& r) { return r.event == e; });
    if (id != 0) {
      if (it != captured_events_.end()) *it = CapturedRecord{e, s, id};
      else captured_events_.push_back(CapturedRecord{e, s, id});  // bounded by the cache's events
    } else if (it != captured_events_.end()) {
      captured_events_.erase(it);
    }
    return {};
  }

  Status wait(Stream s, Event e) noexcept {
    if (recorded_in_finished_capture(e)) return {};
    const cudaError_t err = cudaStreamWaitEvent(s, e, 0);
    // The event's last record is a node of a finished capture: complete by the capture
    // contract (see the header comment). Inside a capture the error is real.
    if (err == cudaErrorCapturedEvent && !capturing_or_unknown(s)) {
      (void)cudaGetLastError();
      return {};
    }
    return cuda_status(err, "cudaStreamWaitEvent");
  }

  Result<bool> query(Event e) noexcept {
    if (recorded_in_finished_capture(e)) return true;  // complete by the capture contract
    cudaError_t err = cudaSuccess;
    {
      RelaxedCaptureMode relaxed;
      err = cudaEventQuery(e);
    }
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // "not ready" is an answer, not an error a caller should see later
      return false;
    }
    if (err == cudaErrorCapturedEvent) {
      (void)cudaGetLastError();
      return true;
    }
    return cuda_status(err, "cudaEventQuery");
  }

  Status synchronize(Event e) noexcept {
    if (recorded_in_finished_capture(e)) return {};
    cudaError_t err = cudaSuccess;
    {
      RelaxedCaptureMode relaxed;
      err = cudaEventSynchronize(e);
    }
    if (err == cudaErrorCapturedEvent) {
      (void)cudaGetLastError();
      return {};
    }
    return cuda_status(err, "cudaEventSynchronize");
  }

  Status synchronize(Stream s) noexcept { return cuda_status(cudaStreamSynchronize(s), "cudaStreamSynchronize"); }

  Result<bool> is_capturing(Stream s) noexcept {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (Status st = cuda_status(cudaStreamIsCapturing(s, &status), "cudaStreamIsCapturing"); !st) return st;
    // An invalidated capture still counts: anything enqueued now would be lost with it.
    if (status != cudaStreamCaptureStatusNone) capture_seen_ = true;
    return status != cudaStreamCaptureStatusNone;
  }

  /// @param s  a stream
  /// @return 0 when `s` is not capturing, else the capture sequence id + 1 (distinct per capture)
  Result<std::uint64_t> capture_id(Stream s) noexcept {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    if (Status st = cuda_status(cudaStreamGetCaptureInfo(s, &status, &id), "cudaStreamGetCaptureInfo"); !st) return st;
    if (status == cudaStreamCaptureStatusNone) return std::uint64_t{0};
    capture_seen_ = true;
    return static_cast<std::uint64_t>(id) + 1;  // +1: keep 0 for "not capturing"
  }

  // ---- copies -----------------------------------------------------------------------------

  Status copy_async(void* dst, const void* src, std::size_t n, Stream s) noexcept {
    if (n == 0) return {};
    if (Status st = cuda_status(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s), "cudaMemcpyAsync"); !st) return st;
    return after_enqueue(s, "cudaMemcpyAsync");
  }

  // All copies in ONE cudaMemcpyBatchAsync, sources read in stream order. The pointer arrays
  // are kept between calls (capacity grows to the largest batch, then no allocation).
  Status copy_batch_async(std::span<const CopyDesc> copies, Stream s) noexcept {
    try {
      dsts_.clear();
      srcs_.clear();
      sizes_.clear();
      for (const CopyDesc& c : copies) {
        if (c.bytes == 0) continue;  // CUDA rejects empty copies
        dsts_.push_back(c.dst);
        srcs_.push_back(c.src);
        sizes_.push_back(c.bytes);
      }
    } catch (...) {
      return Status(ErrorCode::runtime_failure, "copy_batch_async: out of host memory for the copy list");
    }
    if (dsts_.empty()) return {};
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagDefault;
    std::size_t attr_index = 0;
#if CUDART_VERSION >= 13000
    const cudaError_t err = cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), dsts_.size(), &attr,
                                                 &attr_index, 1, s);
#elif CUDART_VERSION >= 12080
    std::size_t fail_index = 0;
    const cudaError_t err = cudaMemcpyBatchAsync(dsts_.data(), const_cast<void**>(srcs_.data()), sizes_.data(),
                                                 dsts_.size(), &attr, &attr_index, 1, &fail_index, s);
#else
    const cudaError_t err = cudaErrorNotSupported;
#endif
    if (Status st = cuda_status(err, "cudaMemcpyBatchAsync"); !st) return st;
    return after_enqueue(s, "cudaMemcpyBatchAsync");
  }

  void host_access(const void*, std::size_t, AccessMode) noexcept {}

  // ---- memory -----------------------------------------------------------------------------

  Result<void*> allocate(std::size_t bytes, MemoryKind kind) noexcept {
    void* p = nullptr;
    switch (kind) {
      case MemoryKind::device:
        if (Status st = cuda_status(cudaMalloc(&p, bytes), "cudaMalloc"); !st) return with_size(st, bytes, kind);
        return p;
      case MemoryKind::pinned_host:
        // Mapped: kernels (Gather) read it zero-copy; Portable: pinned for every device.
        if (Status st = cuda_status(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
            !st)
          return with_size(st, bytes, kind);
        return p;
      case MemoryKind::host:
        p = std::malloc(bytes == 0 ? 1 : bytes);
        if (p == nullptr) return Status(ErrorCode::runtime_failure, "malloc failed");
        return p;
    }
    return Status(ErrorCode::invalid_argument, "allocate: unknown memory kind");
  }

  void deallocate(void* p, MemoryKind kind) noexcept {
    if (p == nullptr) return;
    switch (kind) {
      case MemoryKind::device: (void)cuda_status(cudaFree(p), "cudaFree"); return;
      case MemoryKind::pinned_host: (void)cuda_status(cudaFreeHost(p), "cudaFreeHost"); return;
      case MemoryKind::host: std::free(p); return;
    }
  }

  /// Pins (and maps) caller-owned host memory, e.g. a pool the caller allocated; undo with
  /// unregister_host before freeing it.
  /// @param p      start of the memory
  /// @param bytes  its exact size
  /// @return invalid_argument for a null pointer or 0 bytes, else cudaHostRegister's outcome
  Status register_host(void* p, std::size_t bytes) noexcept {
    if (p == nullptr || bytes == 0) return Status(ErrorCode::invalid_argument, "register_host: null pointer or 0 bytes");
    return cuda_status(cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable), "cudaHostRegister");
  }
  /// Undoes register_host(p).
  Status unregister_host(void* p) noexcept { return cuda_status(cudaHostUnregister(p), "cudaHostUnregister"); }

  /// @param p  mapped pinned host memory (allocated pinned_host, or registered)
  /// @return its device address (equal to `p` under unified addressing)
  Result<const void*> device_pointer(const void* p) noexcept {
    void* d = nullptr;
    cudaError_t err = cudaSuccess;
    {
      RelaxedCaptureMode relaxed;  // may run first inside a capture (Gather resolves lazily)
      err = cudaHostGetDevicePointer(&d, const_cast<void*>(p), 0);
    }
    if (Status st = cuda_status(err, "cudaHostGetDevicePointer"); !st) return st;
    return static_cast<const void*>(d);
  }

  // Called after every enqueue of the tier (Gather's launch too): in debug mode waits for the
  // stream so a fault surfaces here, naming the operation.
  Status after_enqueue(Stream s, const char* what) noexcept {
    if (!sync_after_enqueue_) return {};
    Result<bool> capturing = is_capturing(s);
    if (!capturing.ok()) return capturing.status();
    if (capturing.value()) return {};  // nothing runs during capture; illegal to synchronise
    if (Status st = cuda_status(cudaStreamSynchronize(s), "cudaStreamSynchronize (EXPERT_CACHE_CUDA_SYNC)"); !st) {
      return st.with_context("after %s", what);
    }
    return {};
  }

 private:
  // cudaEventQuery / cudaEventSynchronize of an eager event are safe during a capture but
  // count as "potentially unsafe" in the global and thread-local capture modes; the relaxed
  // mode permits them for the duration of one call.
  class RelaxedCaptureMode {
   public:
    RelaxedCaptureMode() noexcept { ok_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess; }
    ~RelaxedCaptureMode() {
      if (ok_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);
    }
    RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
    RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

   private:
    cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
    bool ok_ = false;
  };

  // True when e's latest record is a node of a capture that has ended (the recording stream
  // is no longer in that capture). While the capture runs, waits on e are real capture edges
  // (they join other streams into it) and must reach CUDA.
  bool recorded_in_finished_capture(Event e) noexcept {
    if (captured_events_.empty()) return false;
    const auto it = std::find_if(captured_events_.begin(), captured_events_.end(),
                                 [e](const CapturedRecord& r) { return r.event == e; });
    if (it == captured_events_.end()) return false;
    Result<std::uint64_t> now = capture_id(it->stream);
    return !now.ok() || now.value() != it->capture;
  }

  bool capturing_or_unknown(Stream s) noexcept {
    Result<bool> c = is_capturing(s);
    return !c.ok() || c.value();
  }

  static Status with_size(const Status& st, std::size_t bytes, MemoryKind kind) {
    return Status::format(st.code(), "%.*s (%zu bytes of %s)", static_cast<int>(st.message().size()),
                          st.message().data(), bytes, to_string(kind));
  }

  static bool env_sync() noexcept {
    const char* v = std::getenv("EXPERT_CACHE_CUDA_SYNC");
    return v != nullptr && std::strcmp(v, "0") != 0 && v[0] != '\0';
  }

  bool sync_after_enqueue_;
  struct CapturedRecord {
    Event event;
    Stream stream;
    std::uint64_t capture;
  };
  std::vector<CapturedRecord> captured_events_;
  bool capture_seen_ = false;  // sticky: some stream was seen capturing
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<std::size_t> sizes_;
};

static_assert(runtime<CudaRuntime>);
static_assert(allocating_runtime<CudaRuntime>);
static_assert(batching_runtime<CudaRuntime>);

}  // namespace expert_cache::inline v0
