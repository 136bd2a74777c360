#pragma once
// --timeline: where a device row's decode step spends its time, seen from the device.
//
// A monitor kernel on its own stream polls, for every layer, the first word of the layer's
// router ids, the first word of its output, and each slot's needed and ready words of its
// cache's plan state, and logs every change with the global timer. The plan writes a slot's
// needed word when it decides a fill (the forward's plan, or the prefetch's plan), the fill
// (SM loads or the copy proxy's memop) writes the ready word once the bytes landed; the router
// writes the ids, the consumer's last kernel the output. From these the summary gives, per
// layer, the time between consumers, the consumer's tail after its last fill landed, the side
// chain's delay from the router to the prefetch's plan, how long a fill takes from its plan to
// its bytes, and how long the link sat idle between landings.
//
// Diagnostic only: the monitor takes a few blocks of SMs and polls L2, so the row's own tok/s is
// slightly lower while it runs; its outputs are still checked.
#include <cuda/atomic>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "timeline_summary.hpp"

namespace expert_cache::bench {

inline constexpr int timeline_threads = 512;
inline constexpr int timeline_words_per_thread = 16;

__global__ void __launch_bounds__(timeline_threads)
    timeline_monitor_kernel(const std::uint32_t* const* words, std::uint32_t n_words, TimelineEvent* events,
                            unsigned long long* n_events, unsigned long long max_events, const std::uint32_t* stop) {
  const std::uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
  const std::uint32_t* addr[timeline_words_per_thread];
  std::uint32_t last[timeline_words_per_thread];
#pragma unroll
  for (int k = 0; k < timeline_words_per_thread; ++k) {
    const std::uint32_t w = tid + static_cast<std::uint32_t>(k) * stride;
    addr[k] = w < n_words ? words[w] : nullptr;
    last[k] = addr[k] != nullptr ? cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device>(
                                       *const_cast<std::uint32_t*>(addr[k]))
                                       .load(cuda::memory_order_relaxed)
                                 : 0u;
  }
  __shared__ bool done;
  for (std::uint32_t iter = 0;; ++iter) {
#pragma unroll
    for (int k = 0; k < timeline_words_per_thread; ++k) {
      if (addr[k] == nullptr) continue;
      const std::uint32_t v =
          cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device>(*const_cast<std::uint32_t*>(addr[k]))
              .load(cuda::memory_order_relaxed);
      if (v != last[k]) {
        last[k] = v;
        std::uint64_t t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        const unsigned long long i = atomicAdd(n_events, 1ull);
        if (i < max_events) events[i] = TimelineEvent{t, tid + static_cast<std::uint32_t>(k) * stride, v};
      }
    }
    if ((iter & 255u) == 0) {
      __syncthreads();
      if (threadIdx.x == 0) {
        done = cuda::atomic_ref<std::uint32_t, cuda::thread_scope_system>(*const_cast<std::uint32_t*>(stop))
                   .load(cuda::memory_order_relaxed) != 0u;
      }
      __syncthreads();
      if (done) return;
    }
  }
}

// The monitor of one row: started before the measured steps, stopped after them.
class Timeline {
 public:
  struct Layer {
    const std::uint32_t* ids0;  // the router's first id of the layer
    const std::uint32_t* out0;  // the consumer's first output word of the layer
    const std::uint32_t* needed;
    const std::uint32_t* ready;
  };

  Timeline(std::vector<Layer> layers, std::int32_t capacity) : layers_(std::move(layers)), capacity_(capacity) {
    std::vector<const std::uint32_t*> words;
    for (const Layer& l : layers_) {
      words.push_back(l.ids0);
      words.push_back(l.out0);
      for (std::int32_t s = 0; s < capacity_; ++s) words.push_back(l.needed + s);
      for (std::int32_t s = 0; s < capacity_; ++s) words.push_back(l.ready + s);
    }
    n_words_ = static_cast<std::uint32_t>(words.size());
    blocks_ = static_cast<int>((n_words_ + timeline_threads * timeline_words_per_thread - 1) /
                               (timeline_threads * timeline_words_per_thread));
    ok_ = cudaMalloc(&words_, words.size() * sizeof(void*)) == cudaSuccess &&
          cudaMemcpy(words_, words.data(), words.size() * sizeof(void*), cudaMemcpyHostToDevice) == cudaSuccess &&
          cudaMalloc(&events_, max_events_ * sizeof(TimelineEvent)) == cudaSuccess &&
          cudaMalloc(&n_events_, sizeof(unsigned long long)) == cudaSuccess &&
          cudaHostAlloc(&stop_, sizeof(std::uint32_t), cudaHostAllocMapped) == cudaSuccess &&
          cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) == cudaSuccess;
  }
  ~Timeline() {
    if (stream_ != nullptr) {
      if (stop_ != nullptr) *stop_ = 1u;
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    cudaFree(words_);
    cudaFree(events_);
    cudaFree(n_events_);
    if (stop_ != nullptr) cudaFreeHost(stop_);
  }
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  [[nodiscard]] bool ok() const noexcept { return ok_; }

  void start() {
    if (!ok_) return;
    *stop_ = 0u;
    cudaMemsetAsync(n_events_, 0, sizeof(unsigned long long), stream_);
    std::uint32_t* stop_dev = nullptr;
    cudaHostGetDevicePointer(reinterpret_cast<void**>(&stop_dev), stop_, 0);
    timeline_monitor_kernel<<<blocks_, timeline_threads, 0, stream_>>>(words_, n_words_, events_, n_events_, max_events_,
                                                                        stop_dev);
    ok_ = cudaGetLastError() == cudaSuccess;
  }

  // Stops the monitor (after the measured steps completed) and summarises. `fill_bytes`: one
  // fill's bytes; `link_bytes_per_s`: the pinned ceiling, for the link's idle time. `csv_path`:
  // where the events go as CSV as well (empty: nowhere).
  std::string stop_and_summarise(double fill_bytes, double link_bytes_per_s, const std::string& csv_path = {}) {
    if (!ok_) return "timeline: the monitor could not be started";
    std::atomic_ref<std::uint32_t>(*stop_).store(1u, std::memory_order_release);
    if (cudaStreamSynchronize(stream_) != cudaSuccess) return "timeline: the monitor failed";
    unsigned long long n = 0;
    if (cudaMemcpy(&n, n_events_, sizeof n, cudaMemcpyDeviceToHost) != cudaSuccess) return "timeline: no event count";
    const bool overflow = n > max_events_;
    n = std::min<unsigned long long>(n, max_events_);
    std::vector<TimelineEvent> ev(n);
    if (cudaMemcpy(ev.data(), events_, n * sizeof(TimelineEvent), cudaMemcpyDeviceToHost) != cudaSuccess)
      return "timeline: the events could not be read";
    const TimelineShape shape{static_cast<std::uint32_t>(layers_.size()), static_cast<std::uint32_t>(capacity_)};
    std::string text = format_timeline(summarise_timeline(ev, shape, overflow, fill_bytes, link_bytes_per_s));
    if (!csv_path.empty()) {
      text += write_timeline_csv(csv_path, std::move(ev), shape) ? "; events in " + csv_path
                                                                 : "; COULD NOT WRITE " + csv_path;
    }
    return text;
  }

 private:
  std::vector<Layer> layers_;
  std::int32_t capacity_ = 0;
  std::uint32_t n_words_ = 0;
  int blocks_ = 1;
  const std::uint32_t** words_ = nullptr;
  TimelineEvent* events_ = nullptr;
  unsigned long long* n_events_ = nullptr;
  unsigned long long max_events_ = 1ull << 20;
  std::uint32_t* stop_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool ok_ = false;
};

}  // namespace expert_cache::bench
