// Staging benchmarks of the CUDA tier (Google Benchmark). Expert = NVFP4 Marlin layout, hidden
// 2048, intermediate 512: six tensors 1 MiB, 512 KiB, 128 KiB, 64 KiB, 4 B, 4 B (1.688 MiB).
//
//   ceiling                      one large pinned H2D cudaMemcpyAsync, measured first; every fill
//                                benchmark reports `ratio` = its GB/s / this ceiling
//   fill/<policy>/<storage>/misses:N   GPU time (cudaEvents, manual time) of a prepare() whose N
//                                experts all miss; counters GBps and ratio
//   cold208/<policy>/<storage>   a 208-slot cache filled from empty in one prepare
//                                <storage>: tensor_major, expert_major, expert_major_host (the
//                                expert-major pool scattered into per-tensor slot arrays)
//   host/<cache>/all_hit, host/<cache>/misses:10   wall-clock of the prepare() call alone (the
//                                GPU is drained before each call and not waited after it)
//   proxy_issue/<mode>/fills:16  GPU time (cudaEvents) of 16 back-to-back expert fills on one copy
//                                stream, issued as the copy-engine proxy issues them
//                                (device_cache/copy_proxy.cuh); counters GBps, ratio, us_per_fill.
//                                <mode>: one_copy (the expert's bytes as one copy), regions (its six
//                                regions in one cudaMemcpyBatchAsync), regions+word (and its ready word,
//                                cuStreamWriteValue32), two_parts+words (the first part and its word, then
//                                the rest and the whole word: the overlapped consumer's W13-first pass),
//                                regions+words_batched (the two words in one cuStreamBatchMemOp), and
//                                request+words_batched (every fill's regions in one batch call, then every
//                                word in one cuStreamBatchMemOp: readiness per request, not per fill),
//                                regions+tag_copy and two_parts+tag_copies (each word written by a
//                                4-byte copy of its tag after the part's copies, instead of a memop)
//
// What to read: the best staging policy's ratio of the ceiling at >= 8 misses, and the host us of an
// all-hit prepare and of one with 10 misses. Run with --benchmark_repetitions=5
// --benchmark_report_aggregates_only=true and read the medians.
#include <benchmark/benchmark.h>

#include <cuda.h>  // the stream memory operations' driver types; the functions come through the runtime
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "expert_cache/cuda.hpp"
#include "bench_check.cuh"
#include "pinned_ceiling.cuh"

using namespace expert_cache;

namespace {

constexpr std::size_t expert_bytes = (1u << 20) + (512u << 10) + (128u << 10) + (64u << 10) + 4 + 4;
constexpr std::int32_t fill_capacity = 208;
constexpr std::int32_t fill_experts = 352;  // >= capacity + 128: a sliding window of misses never hits

ExplicitLayout nvfp4_layout() {
  return ExplicitLayout{{{{"w13", 1u << 20}, {"w2", 512u << 10}, {"w13_scale", 128u << 10}, {"w2_scale", 64u << 10},
                          {"w13_scale_2", 4}, {"w2_scale_2", 4}}}};
}

CudaRuntime& runtime() {
  static CudaRuntime rt;
  return rt;
}

double g_ceiling_gbps = 0.0;

// Median GB/s of 9 large pinned H2D copies (the copy engine's ceiling on this machine).
double measure_ceiling() {
  cudaStream_t s = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Result<double> r = bench::pinned_ceiling_median(s, 128 * expert_bytes, 9);  // 216 MiB, like 128 misses
  BENCH_CUDA(cudaStreamDestroy(s));
  if (!r.ok()) {
    std::fprintf(stderr, "%s\n", std::string(r.status().message()).c_str());
    std::exit(1);
  }
  return r.value() * 1e-9;
}

void BM_Ceiling(benchmark::State& state) {
  for (auto _ : state) {
    state.SetIterationTime(static_cast<double>(128 * expert_bytes) / (g_ceiling_gbps * 1e9));
  }
  state.counters["GBps"] = g_ceiling_gbps;
  state.counters["ratio"] = 1.0;
}

// One cache alive at a time (each holds ~600 MiB of pinned host memory): asking for another
// type destroys the previous one. Benchmarks of one cache type run back to back.
struct Held {
  const std::type_info* type = nullptr;
  std::shared_ptr<void> cache;
  cudaStream_t stream = nullptr;
};
Held& held() {
  static Held h;
  return h;
}

template <class Cache>
Cache& cache_for(std::int32_t experts, std::int32_t capacity) {
  Held& h = held();
  if (h.type == nullptr || *h.type != typeid(Cache) || static_cast<Cache*>(h.cache.get())->options().capacity != capacity ||
      static_cast<Cache*>(h.cache.get())->options().num_experts != experts) {
    BENCH_CUDA(cudaDeviceSynchronize());
    h.cache.reset();
    CacheOptions o;
    o.num_experts = experts;
    o.capacity = capacity;
    o.top_k = 8;
    o.log = {};
    h.cache = std::make_shared<Cache>(runtime(), o, nvfp4_layout());
    h.type = &typeid(Cache);
    if (h.stream == nullptr) h.stream = runtime().create_stream().value();
  }
  return *static_cast<Cache*>(h.cache.get());
}

// Drops every resident expert (untimed), so the next prepare fills from empty.
template <class Cache>
void make_cold(Cache& cache, cudaStream_t s) {
  for (std::int32_t e = 0; e < cache.options().num_experts; ++e) {
    if (cache.resident_map_host()[static_cast<std::size_t>(e)] >= 0) (void)cache.invalidate(e, s);
  }
  BENCH_CUDA(cudaDeviceSynchronize());
}

// GPU time of prepare() with `misses` misses: events around the call on the caller stream (the
// caller waits for the fills, so the end event covers them).
template <class Cache>
void BM_Fill(benchmark::State& state, std::int32_t misses, bool cold) {
  const std::int32_t capacity = fill_capacity;
  Cache& cache = cache_for<Cache>(fill_experts, capacity);
  const cudaStream_t s = held().stream;
  cudaEvent_t a = nullptr, b = nullptr;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(misses));
  std::int32_t next = 0;
  std::uint64_t bytes = 0;
  double gpu_seconds = 0;
  make_cold(cache, s);  // earlier runs left experts resident that the window below would hit
  for (auto _ : state) {
    if (cold) {
      make_cold(cache, s);
      next = 0;
    }
    for (auto& id : ids) {
      id = next;
      next = (next + 1) % fill_experts;
    }
    BENCH_CUDA(cudaStreamSynchronize(s));
    BENCH_CUDA(cudaEventRecord(a, s));
    auto view = cache.prepare_unique(ids, s);
    BENCH_CUDA(cudaEventRecord(b, s));
    BENCH_CUDA(cudaEventSynchronize(b));
    if (!view.ok()) {
      state.SkipWithError(view.status().to_string().c_str());
      break;
    }
    if (view.value().misses != static_cast<std::uint32_t>(misses)) {
      state.SkipWithError("benchmark setup: not every expert missed");
      break;
    }
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    state.SetIterationTime(ms / 1e3);
    gpu_seconds += ms / 1e3;
    bytes += static_cast<std::uint64_t>(misses) * expert_bytes;
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  // GB/s over the GPU (event) time of the iterations, and its share of the ceiling measured in
  // this process. With --benchmark_repetitions the aggregates give their median.
  const double gbps = gpu_seconds > 0 ? static_cast<double>(bytes) / gpu_seconds / 1e9 : 0.0;
  state.counters["GBps"] = gbps;
  state.counters["ratio"] = g_ceiling_gbps > 0 ? gbps / g_ceiling_gbps : 0.0;
  BENCH_CUDA(cudaEventDestroy(a));
  BENCH_CUDA(cudaEventDestroy(b));
}

// Host wall-clock of prepare() alone; the GPU is drained before each call (untimed) so no staging
// stall or queue back-pressure is measured, and not waited after it.
template <class Cache>
void BM_HostPrepare(benchmark::State& state, std::int32_t misses) {
  Cache& cache = cache_for<Cache>(fill_experts, fill_capacity);
  const cudaStream_t s = held().stream;
  std::vector<std::int32_t> ids;
  std::int32_t next = 0;
  if (misses == 0) {
    ids = {3, 17, 42, 5, 99, 120, 7, 64};  // one token, top-8, all resident after the warm-up
    if (!cache.prepare(ids, s).ok()) state.SkipWithError("warm-up prepare failed");
  } else {
    make_cold(cache, s);  // earlier runs left experts resident that the window below would hit
    ids.resize(static_cast<std::size_t>(misses));
  }
  for (auto _ : state) {
    if (misses != 0) {
      for (auto& id : ids) {
        id = next;
        next = (next + 1) % fill_experts;
      }
    }
    BENCH_CUDA(cudaStreamSynchronize(s));
    const auto t0 = std::chrono::steady_clock::now();
    auto view = cache.prepare(ids, s);
    const auto t1 = std::chrono::steady_clock::now();
    if (!view.ok()) {
      state.SkipWithError(view.status().to_string().c_str());
      break;
    }
    if (view.value().misses != static_cast<std::uint32_t>(misses)) {
      state.SkipWithError("benchmark setup: unexpected hit/miss count");
      break;
    }
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
  }
  BENCH_CUDA(cudaDeviceSynchronize());
}

// The proxy's copy-stream work for 16 fills (see the header). Raw CUDA: this measures what the
// copy engine does with the proxy's sequence of calls, not the proxy's host time.
enum class ProxyIssueMode {
  one_copy,
  regions,
  regions_word,
  two_parts_words,
  regions_words_batched,
  request_words_batched,
  regions_tag_copy,
  two_parts_tag_copies
};

void BM_ProxyIssue(benchmark::State& state, ProxyIssueMode mode) {
  constexpr int proxy_fills = 16, proxy_experts = 64, proxy_slots = 32;
  // nvfp4_layout()'s regions in its order; the first part is w13, w13_scale, w13_scale_2.
  constexpr std::array<std::size_t, 6> region_bytes = {1u << 20, 512u << 10, 128u << 10, 64u << 10, 4, 4};
  constexpr std::array<bool, 6> first_part = {true, false, true, false, true, false};
  using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  using BatchMemOp = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
  void* wv_fn = nullptr;
  void* bm_fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  BENCH_CUDA(cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &wv_fn, 12000, cudaEnableDefault, &found));
  BENCH_CUDA(cudaGetDriverEntryPointByVersion("cuStreamBatchMemOp", &bm_fn, 12000, cudaEnableDefault, &found));
  if (wv_fn == nullptr || bm_fn == nullptr) {
    state.SkipWithError("the driver has no cuStreamWriteValue32 / cuStreamBatchMemOp");
    return;
  }
  const auto write_value = reinterpret_cast<WriteValue32>(wv_fn);
  const auto batch_mem_op = reinterpret_cast<BatchMemOp>(bm_fn);
  std::array<unsigned char*, 6> host{}, dev{};
  for (std::size_t r = 0; r < region_bytes.size(); ++r) {
    BENCH_CUDA(cudaHostAlloc(&host[r], region_bytes[r] * proxy_experts, cudaHostAllocMapped | cudaHostAllocPortable));
    BENCH_CUDA(cudaMalloc(&dev[r], region_bytes[r] * proxy_slots));
  }
  unsigned char* host_whole = nullptr;
  unsigned char* dev_whole = nullptr;
  BENCH_CUDA(cudaHostAlloc(&host_whole, expert_bytes * proxy_experts, cudaHostAllocDefault));
  BENCH_CUDA(cudaMalloc(&dev_whole, expert_bytes * proxy_slots));
  std::uint32_t* words = nullptr;  // two per slot: the first part's and the whole expert's
  BENCH_CUDA(cudaMalloc(&words, sizeof(std::uint32_t) * 2 * proxy_slots));
  std::uint32_t* host_tag = nullptr;  // the tag a ready word takes, as the source of a 4-byte copy
  BENCH_CUDA(cudaHostAlloc(&host_tag, sizeof(std::uint32_t), cudaHostAllocDefault));
  cudaStream_t s = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a = nullptr, b = nullptr;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  const auto copy_batch = [&](std::vector<void*>& d, std::vector<const void*>& h, std::vector<std::size_t>& z) {
    if (d.empty()) return;
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    std::size_t attr_index = 0;
    BENCH_CUDA(cudaMemcpyBatchAsync(d.data(), h.data(), z.data(), d.size(), &attr, &attr_index, 1, s));
    d.clear(), h.clear(), z.clear();
  };
  // A ready word written by a 4-byte copy after the fill's copies, in stream order (the copy
  // engine's own ordering instead of a stream memory operation).
  const auto tag_copy = [&](int slot, int which) {
    BENCH_CUDA(cudaMemcpyAsync(words + 2 * slot + which, host_tag, sizeof(std::uint32_t), cudaMemcpyHostToDevice, s));
  };
  const auto word_op = [&](int slot, int which, std::uint32_t tag) {
    CUstreamBatchMemOpParams op{};
    op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
    op.writeValue.address = reinterpret_cast<CUdeviceptr>(words + 2 * slot + which);
    op.writeValue.value = tag;
    return op;
  };
  std::vector<void*> d;
  std::vector<const void*> h;
  std::vector<std::size_t> z;
  std::vector<CUstreamBatchMemOpParams> ops;
  std::uint32_t tag = 0;
  double gpu_seconds = 0;
  std::uint64_t bytes = 0;
  bool failed = false;
  for (auto _ : state) {
    BENCH_CUDA(cudaStreamSynchronize(s));
    BENCH_CUDA(cudaEventRecord(a, s));
    ++tag;
    *host_tag = tag;  // the stream was drained: no copy still reads the previous tag
    for (int f = 0; f < proxy_fills; ++f) {
      const int slot = f % proxy_slots, expert = static_cast<int>((f * 5 + tag) % proxy_experts);
      const auto add = [&](bool first) {
        for (std::size_t r = 0; r < region_bytes.size(); ++r) {
          if (first_part[r] != first) continue;
          d.push_back(dev[r] + static_cast<std::size_t>(slot) * region_bytes[r]);
          h.push_back(host[r] + static_cast<std::size_t>(expert) * region_bytes[r]);
          z.push_back(region_bytes[r]);
        }
      };
      switch (mode) {
        case ProxyIssueMode::one_copy:
          BENCH_CUDA(cudaMemcpyAsync(dev_whole + static_cast<std::size_t>(slot) * expert_bytes,
                                     host_whole + static_cast<std::size_t>(expert) * expert_bytes, expert_bytes,
                                     cudaMemcpyHostToDevice, s));
          break;
        case ProxyIssueMode::regions:
        case ProxyIssueMode::regions_word:
        case ProxyIssueMode::regions_words_batched:
        case ProxyIssueMode::regions_tag_copy:
          add(true), add(false), copy_batch(d, h, z);
          if (mode == ProxyIssueMode::regions_tag_copy) tag_copy(slot, 1);
          if (mode == ProxyIssueMode::regions_word) {
            failed |= write_value(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(words + 2 * slot + 1), tag, 0) != CUDA_SUCCESS;
          } else if (mode == ProxyIssueMode::regions_words_batched) {
            std::array<CUstreamBatchMemOpParams, 2> two = {word_op(slot, 0, tag), word_op(slot, 1, tag)};
            failed |= batch_mem_op(reinterpret_cast<CUstream>(s), 2, two.data(), 0) != CUDA_SUCCESS;
          }
          break;
        case ProxyIssueMode::two_parts_words:
          add(true), copy_batch(d, h, z);
          failed |= write_value(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(words + 2 * slot), tag, 0) != CUDA_SUCCESS;
          add(false), copy_batch(d, h, z);
          failed |= write_value(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(words + 2 * slot + 1), tag, 0) != CUDA_SUCCESS;
          break;
        case ProxyIssueMode::two_parts_tag_copies:
          add(true), copy_batch(d, h, z), tag_copy(slot, 0);
          add(false), copy_batch(d, h, z), tag_copy(slot, 1);
          break;
        case ProxyIssueMode::request_words_batched:
          add(true), add(false);
          ops.push_back(word_op(slot, 0, tag)), ops.push_back(word_op(slot, 1, tag));
          break;
      }
    }
    if (mode == ProxyIssueMode::request_words_batched) {
      copy_batch(d, h, z);
      failed |= batch_mem_op(reinterpret_cast<CUstream>(s), static_cast<unsigned int>(ops.size()), ops.data(), 0) != CUDA_SUCCESS;
      ops.clear();
    }
    BENCH_CUDA(cudaEventRecord(b, s));
    BENCH_CUDA(cudaEventSynchronize(b));
    if (failed) {
      state.SkipWithError("a stream memory operation was refused");
      break;
    }
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    state.SetIterationTime(ms / 1e3);
    gpu_seconds += ms / 1e3;
    bytes += proxy_fills * expert_bytes;
  }
  // Every ready word holds the last tag: the memops ran (and after every copy of the stream).
  std::vector<std::uint32_t> seen(2 * proxy_slots);
  BENCH_CUDA(cudaMemcpy(seen.data(), words, sizeof(std::uint32_t) * seen.size(), cudaMemcpyDeviceToHost));
  const bool wrote_words = mode != ProxyIssueMode::one_copy && mode != ProxyIssueMode::regions;
  if (wrote_words && !failed && seen[1] != tag) state.SkipWithError("a ready word does not hold the last tag");
  const double gbps = gpu_seconds > 0 ? static_cast<double>(bytes) / gpu_seconds / 1e9 : 0.0;
  state.counters["GBps"] = gbps;
  state.counters["ratio"] = g_ceiling_gbps > 0 ? gbps / g_ceiling_gbps : 0.0;
  state.counters["us_per_fill"] = bytes > 0 ? gpu_seconds * 1e6 * expert_bytes / static_cast<double>(bytes) : 0.0;
  BENCH_CUDA(cudaEventDestroy(a));
  BENCH_CUDA(cudaEventDestroy(b));
  BENCH_CUDA(cudaStreamDestroy(s));
  BENCH_CUDA(cudaFree(words));
  BENCH_CUDA(cudaFreeHost(host_tag));
  BENCH_CUDA(cudaFree(dev_whole));
  BENCH_CUDA(cudaFreeHost(host_whole));
  for (std::size_t r = 0; r < region_bytes.size(); ++r) {
    BENCH_CUDA(cudaFree(dev[r]));
    BENCH_CUDA(cudaFreeHost(host[r]));
  }
}

void register_proxy_issue() {
  const std::array<std::pair<const char*, ProxyIssueMode>, 8> modes = {{
      {"one_copy", ProxyIssueMode::one_copy},
      {"regions", ProxyIssueMode::regions},
      {"regions+word", ProxyIssueMode::regions_word},
      {"two_parts+words", ProxyIssueMode::two_parts_words},
      {"regions+words_batched", ProxyIssueMode::regions_words_batched},
      {"request+words_batched", ProxyIssueMode::request_words_batched},
      {"regions+tag_copy", ProxyIssueMode::regions_tag_copy},
      {"two_parts+tag_copies", ProxyIssueMode::two_parts_tag_copies},
  }};
  for (const auto& [name, mode] : modes) {
    benchmark::RegisterBenchmark((std::string("proxy_issue/") + name + "/fills:16").c_str(),
                                 [mode](benchmark::State& st) { BM_ProxyIssue(st, mode); })
        ->UseManualTime()
        ->MinTime(0.2)
        ->Unit(benchmark::kMicrosecond);
  }
}

template <template <class> class S, class P>
using BenchCache = ExpertCache<S, Lru, P, ExplicitLayout, CudaRuntime>;

template <template <class> class S, class P>
void register_fill(const char* policy, const char* storage) {
  for (std::int32_t m : {1, 8, 32, 128}) {
    benchmark::RegisterBenchmark((std::string("fill/") + policy + "/" + storage + "/misses:" + std::to_string(m)).c_str(),
                                 [m](benchmark::State& st) { BM_Fill<BenchCache<S, P>>(st, m, false); })
        ->UseManualTime()
        ->MinTime(0.2)
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::RegisterBenchmark((std::string("cold208/") + policy + "/" + storage).c_str(),
                               [](benchmark::State& st) { BM_Fill<BenchCache<S, P>>(st, fill_capacity, true); })
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond)
      ->Iterations(5);
}

template <class Cache>
void register_host(const char* name) {
  benchmark::RegisterBenchmark((std::string("host/") + name + "/all_hit").c_str(),
                               [](benchmark::State& st) { BM_HostPrepare<Cache>(st, 0); })
      ->UseManualTime()
      ->MinTime(0.1)
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark((std::string("host/") + name + "/misses:10").c_str(),
                               [](benchmark::State& st) { BM_HostPrepare<Cache>(st, 10); })
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond)
      ->Iterations(2000);
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "bench_staging: no CUDA device\n");
    return 77;
  }
  benchmark::Initialize(&argc, argv);
  g_ceiling_gbps = measure_ceiling();
  std::fprintf(stderr, "ceiling: one %.0f MiB pinned H2D cudaMemcpyAsync = %.2f GB/s (median of 9)\n",
               128.0 * expert_bytes / (1 << 20), g_ceiling_gbps);
  benchmark::RegisterBenchmark("ceiling/pinned_memcpy_216MiB", BM_Ceiling)->UseManualTime()->Unit(benchmark::kMillisecond);

  register_fill<TensorMajorStorage, CopyStream>("copy_stream", "tensor_major");
  register_fill<ExpertMajorStorage, CopyStream>("copy_stream", "expert_major");
  register_fill<ExpertMajorHostStorage, CopyStream>("copy_stream", "expert_major_host");
  register_fill<TensorMajorStorage, Inline>("inline", "tensor_major");
  register_fill<ExpertMajorStorage, Inline>("inline", "expert_major");
  register_fill<ExpertMajorHostStorage, Inline>("inline", "expert_major_host");
  register_fill<TensorMajorStorage, Batched>("batched", "tensor_major");
  register_fill<ExpertMajorStorage, Batched>("batched", "expert_major");
  register_fill<ExpertMajorHostStorage, Batched>("batched", "expert_major_host");
  register_fill<TensorMajorStorage, Gather>("gather", "tensor_major");
  register_fill<ExpertMajorStorage, Gather>("gather", "expert_major");
  register_fill<ExpertMajorHostStorage, Gather>("gather", "expert_major_host");

  register_proxy_issue();

  register_host<RowCache<CudaRuntime, ExplicitLayout>>("row_cache");
  register_host<WholeExpertCache<CudaRuntime, ExplicitLayout>>("whole_expert_cache");
  register_host<ExpertCache<TensorMajorStorage, Lru, Gather, ExplicitLayout, CudaRuntime>>("gather_row_cache");
  register_host<ExpertCache<ExpertMajorStorage, Lfru, Gather, ExplicitLayout, CudaRuntime>>("gather_whole_expert_cache");

  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  held().cache.reset();
  return 0;
}
