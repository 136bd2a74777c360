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

namespace expert_cache::bench {

struct TimelineEvent {
  std::uint64_t t;
  std::uint32_t word;
  std::uint32_t value;
};

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
    words_per_layer_ = 2 + 2 * static_cast<std::uint32_t>(capacity_);
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
  // fill's bytes; `link_bytes_per_s`: the pinned ceiling, for the link's idle time.
  std::string stop_and_summarise(double fill_bytes, double link_bytes_per_s) {
    if (!ok_) return "timeline: the monitor could not be started";
    std::atomic_ref<std::uint32_t>(*stop_).store(1u, std::memory_order_release);
    if (cudaStreamSynchronize(stream_) != cudaSuccess) return "timeline: the monitor failed";
    unsigned long long n = 0;
    cudaMemcpy(&n, n_events_, sizeof n, cudaMemcpyDeviceToHost);
    const bool overflow = n > max_events_;
    n = std::min<unsigned long long>(n, max_events_);
    std::vector<TimelineEvent> ev(n);
    cudaMemcpy(ev.data(), events_, n * sizeof(TimelineEvent), cudaMemcpyDeviceToHost);
    std::sort(ev.begin(), ev.end(), [](const TimelineEvent& a, const TimelineEvent& b) { return a.t < b.t; });
    return summarise(ev, overflow, fill_bytes, link_bytes_per_s);
  }

 private:
  static double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }
  static double pct(std::vector<double> v, double q) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
  }

  std::string summarise(const std::vector<TimelineEvent>& ev, bool overflow, double fill_bytes, double link) const {
    const auto L = static_cast<std::uint32_t>(layers_.size());
    const auto cap = static_cast<std::uint32_t>(capacity_);
    // Per layer: router and consumer-end times; per (layer, slot): needed times by value.
    std::vector<std::vector<std::uint64_t>> router(L), out(L);
    struct Need {
      std::uint64_t t;
      std::uint32_t slot, value;
    };
    std::vector<std::vector<Need>> needs(L);
    struct Land {
      std::uint64_t t;
      std::uint32_t layer, slot, value;
    };
    std::vector<Land> lands;
    for (const TimelineEvent& e : ev) {
      const std::uint32_t layer = e.word / words_per_layer_, k = e.word % words_per_layer_;
      if (layer >= L) continue;
      if (k == 0) router[layer].push_back(e.t);
      else if (k == 1) out[layer].push_back(e.t);
      else if (k < 2 + cap) needs[layer].push_back(Need{e.t, k - 2, e.value});
      else lands.push_back(Land{e.t, layer, k - 2 - cap, e.value});
    }
    // Layer durations: consumer end of layer l after consumer end of layer l-1 (same step).
    std::vector<double> layer_us, tail_us, side_us, spec_lat_us, demand_lat_us;
    for (std::uint32_t l = 1; l < L; ++l) {
      for (const std::uint64_t t : out[l]) {
        auto it = std::upper_bound(out[l - 1].begin(), out[l - 1].end(), t);
        if (it == out[l - 1].begin()) continue;
        const double d = static_cast<double>(t - *(it - 1)) * 1e-3;
        if (d < 5000) layer_us.push_back(d);
      }
    }
    // Fill latency (plan -> landed), split into prefetched (planned before the layer's router)
    // and demand fills; the consumer's tail after the layer's last landing.
    std::vector<std::uint64_t> land_t;
    for (const Land& d : lands) {
      land_t.push_back(d.t);
      const auto& nl = needs[d.layer];
      const Need* need = nullptr;
      for (auto it = nl.rbegin(); it != nl.rend(); ++it) {
        if (it->t <= d.t && it->slot == d.slot && it->value == d.value) {
          need = &*it;
          break;
        }
      }
      if (need == nullptr) continue;
      // A forward's plan follows its own layer's router; a prefetch's plan follows the router of
      // the layer before (the latest router before the plan is that layer's).
      const auto latest_before = [&](std::uint32_t layer, std::uint64_t t) -> std::uint64_t {
        const auto& rt = router[layer];
        auto r = std::upper_bound(rt.begin(), rt.end(), t);
        return r == rt.begin() ? 0 : *(r - 1);
      };
      const bool speculative = d.layer > 0 && latest_before(d.layer - 1, need->t) > latest_before(d.layer, need->t);
      (speculative ? spec_lat_us : demand_lat_us).push_back(static_cast<double>(d.t - need->t) * 1e-3);
    }
    for (std::uint32_t l = 0; l < L; ++l) {
      // Tail: each consumer end after the last landing of the layer before it (and after the
      // layer's router of that step).
      for (const std::uint64_t t : out[l]) {
        auto r = std::upper_bound(router[l].begin(), router[l].end(), t);
        if (r == router[l].begin()) continue;
        const std::uint64_t t_router = *(r - 1);
        std::uint64_t last = 0;
        for (const Land& d : lands)
          if (d.layer == l && d.t <= t && d.t + 200'000 > t_router) last = std::max(last, d.t);
        if (last != 0 && last > t_router) tail_us.push_back(static_cast<double>(t - last) * 1e-3);
      }
      // Side chain: router(l) -> first needed change of layer l+1 after it and before router(l+1).
      if (l + 1 < L) {
        for (const std::uint64_t t : router[l]) {
          auto nr = std::upper_bound(router[l + 1].begin(), router[l + 1].end(), t);
          const std::uint64_t limit = nr == router[l + 1].end() ? ~0ull : *nr;
          std::uint64_t first = ~0ull;
          for (const Need& nd : needs[l + 1])
            if (nd.t > t && nd.t < limit) first = std::min(first, nd.t);
          if (first != ~0ull) side_us.push_back(static_cast<double>(first - t) * 1e-3);
        }
      }
    }
    // Link idle: landings in time order; each fill needs fill_bytes / link on the link; a gap
    // longer than that is idle for the difference (landings closer than that overlap).
    std::sort(land_t.begin(), land_t.end());
    const double per_fill_us = link > 0 ? fill_bytes / link * 1e6 : 0;
    double idle = 0, span = 0;
    if (land_t.size() > 1) {
      span = static_cast<double>(land_t.back() - land_t.front()) * 1e-3;
      for (std::size_t i = 1; i < land_t.size(); ++i) {
        const double gap = static_cast<double>(land_t[i] - land_t[i - 1]) * 1e-3;
        if (gap > per_fill_us) idle += gap - per_fill_us;
      }
    }
    char buf[1024];
    std::snprintf(buf, sizeof buf,
                  "timeline (device clock; %zu events%s): layer %.1f us median (p90 %.1f); consumer end after the "
                  "layer's last landing %.1f us median; router(l) -> prefetch plan of l+1 %.1f us median; fill "
                  "plan -> landed: prefetched %.1f us median (p90 %.1f, %zu fills), demand %.1f us (p90 %.1f, %zu "
                  "fills); %zu landings over %.0f us, %.1f us per fill at the ceiling: link idle between landings "
                  "%.1f us = %.3f of the span",
                  ev.size(), overflow ? ", LOG FULL" : "", median(layer_us), pct(layer_us, 0.9), median(tail_us),
                  median(side_us), median(spec_lat_us), pct(spec_lat_us, 0.9), spec_lat_us.size(),
                  median(demand_lat_us), pct(demand_lat_us, 0.9), demand_lat_us.size(), land_t.size(), span,
                  per_fill_us, idle, span > 0 ? idle / span : 0.0);
    return buf;
  }

  std::vector<Layer> layers_;
  std::int32_t capacity_ = 0;
  std::uint32_t words_per_layer_ = 0;
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
