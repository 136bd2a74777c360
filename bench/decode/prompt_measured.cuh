#pragma once
// expert-cache-bench --prompt, MEASURED on a GPU: time to first token (TTFT) of whole prompts,
// each served as ONE prepare_wide per layer on CudaRuntime caches over real pinned host pools,
// with the grouped NVFP4 consumer (reference/moe_grouped.cuh) doing each round's work; and the
// mixed run (one prompt every K decode tokens; its decode steps use reference/moe_consumer.cuh). Part of
// expert_cache_bench.cu: included there after its helpers (check_cuda, DeviceBuffer,
// PinnedBuffer, synth_fill, parallel_experts, measure_pcie_ceiling), not a public header.
//
// Many tokens per expert: a round's (token, expert) pairs sorted by expert are the rows of
// GroupedMoe::run, each expert's rows in tiles of up to 64, so each expert's weights are read
// once per 64 rows. Per round: the pair and tile lists (built on the host, read from mapped
// pinned memory by one load kernel, which writes them into device memory for the rest;
// --prompt-lists copy copies them to device memory on the consumer stream instead, which on the
// H200 makes the rounds' compute 2-3x slower: those small copies wait behind the fill stream's
// large ones), then GroupedMoe::run
// in chunks of at most `chunk_pairs` rows cut at expert boundaries, each row's output going to
// its own pair row; after the layer's rounds a reduction sums every token's top-k rows in a
// fixed order. A row's result depends only on its expert's tile (same rows, same order), not on
// the round: every configuration's last-layer output must be bit-identical to the all-resident
// prefill's (same kernels, same bytes), else the run fails.
//
// The prompts and decode steps are generated, or a trace's (--prompt-trace, prompt_trace.hpp).
// Per prompt (each --prompt length, or the trace's), after --warmup decode steps from an emptied
// cache: the all-resident prefill (every expert on the device, one round per layer), then stream
// admission with each WideCopy (runs, span, automatic; the pool is not changed, so they see the
// same residents), a fill-only pass (the rounds with a consumer that enqueues nothing: the transfer pipeline
// alone, whose bytes / time is the rounds' achieved link rate), and admit admission last.
// Compute is the sum of the rounds' consumer times (events around each round's work, which
// starts after the round's fill: edge 3). The streaming bound is the non-resident experts'
// bytes over the same-run pinned ceiling (one large cudaMemcpyAsync timed with events).
//
// --provider device: the device-planned cache (DeviceExpertCache, tensor-major, as the decode
// benchmark's device provider; one table per --device-policy). Per layer the layer's ids go to
// device memory (a kernel reading them from mapped host memory), then prepare(in_rounds, width
// C/2) plans and fills group 0 and prepare_group(g) each further group (the unique ids, the
// experts resident at the layer's start first). Before a group's consumer, the next group's
// experts are prefetched on a side stream, beside the group being consumed (a prefetch never
// evicts the group planned last), so the next group's plan finds them resident and the link
// works while the consumer computes. The host builds a group's pair and tile lists from the
// unique ids it knows; the slots come from the view's forward map. Its bound takes the non-resident experts from each layer's resident map,
// read before the clock starts; its fills come from the device counters. The fill-only pass
// admits every group, so the measured pass starts after a fresh reset and warm-up.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "expert_cache/cuda.hpp"
#include "expert_cache/expert_cache.hpp"
#include "expert_cache/reference/moe_consumer.cuh"
#include "expert_cache/reference/moe_grouped.cuh"
#include "prompt_run.hpp"

namespace expert_cache::bench {
namespace prompt_gpu {

// One (token, expert) pair of a round, as the host writes it into mapped pinned memory.
struct PairRec {
  std::int32_t src;     // token
  std::int32_t expert;  // routed expert
  std::int32_t pair;    // token * top_k + j
  float weight;         // top-k weight
};

__global__ void input_kernel(float* x, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ULL;
    x[i] = static_cast<float>(z >> 40) * 0x1p-23f - 1.0f;  // [-1, 1)
  }
}

// A round's rows into the consumer's arrays, and (when `tiles_in` is given) its tile list into
// device memory: the round's only reads of host memory, in one kernel.
__global__ void load_pairs_kernel(const PairRec* rec, std::int32_t n, std::int32_t* ids, float* w, std::int32_t* src,
                                  std::int32_t* pair, const device::GroupedTile* tiles_in, std::int32_t num_tiles,
                                  device::GroupedTile* tiles_out) {
  const std::int32_t i = static_cast<std::int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (tiles_in != nullptr && i < num_tiles) tiles_out[i] = tiles_in[i];
  if (i >= n) return;
  const PairRec r = rec[i];
  ids[i] = r.expert;
  w[i] = r.weight;
  src[i] = r.src;
  pair[i] = r.pair;
}

// The layer's ids from mapped host memory into device memory (read once, coalesced).
__global__ void load_ids_kernel(const std::int32_t* host, std::size_t n, std::int32_t* ids) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) ids[i] = host[i];
}

// out[t] = sum over j in order of pair_out[t * top_k + j] (pairs with id < 0 contribute 0).
// It reads every pair's row (tokens x top_k x hidden floats: 671 MB per layer at 8192 tokens),
// after the layer's last round and before the next layer can route, so it is on the critical
// path: each thread loads all of its top-k rows' values first (16-byte loads, independent, so
// they are in flight together), then sums them in the fixed order. Adding +0.0f for a padding
// pair equals skipping it (the sum starts at +0.0f and never becomes -0.0f).
__global__ void reduce_pairs_kernel(const float* pair_out, const std::int32_t* ids, std::int32_t top_k,
                                    std::int64_t hidden, float* out) {
  constexpr std::int32_t max_k = 16;
  const auto t = static_cast<std::int64_t>(blockIdx.x);
  if (hidden % 4 == 0 && top_k <= max_k) {
    const std::int64_t h4 = hidden / 4;
    bool valid[max_k];
#pragma unroll
    for (std::int32_t j = 0; j < max_k; ++j) valid[j] = j < top_k && ids[t * top_k + j] >= 0;
    for (std::int64_t k = threadIdx.x; k < h4; k += blockDim.x) {
      float4 v[max_k];
#pragma unroll
      for (std::int32_t j = 0; j < max_k; ++j)
        if (j < top_k) v[j] = reinterpret_cast<const float4*>(pair_out + (t * top_k + j) * hidden)[k];
      float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (std::int32_t j = 0; j < max_k; ++j) {
        if (j < top_k && valid[j]) {
          sum.x += v[j].x;
          sum.y += v[j].y;
          sum.z += v[j].z;
          sum.w += v[j].w;
        }
      }
      reinterpret_cast<float4*>(out + t * hidden)[k] = sum;
    }
    return;
  }
  for (std::int64_t k = threadIdx.x; k < hidden; k += blockDim.x) {
    float sum = 0.0f;
    for (std::int32_t j = 0; j < top_k; ++j) {
      const std::int64_t p = t * top_k + j;
      if (ids[p] >= 0) sum += pair_out[p * hidden + k];
    }
    out[t * hidden + k] = sum;
  }
}

// A prompt's routing: per layer tokens * top_k ids (-1 padded); top-k weights 1 / top_k.
using Prompt = PromptRouting;

struct PromptTimes {
  double ttft_ns = 0, compute_ns = 0, bound_ns = 0, bytes = 0;
  // Sums over the layers: each layer's last round's consumer, its pair reduction, and the time
  // from a layer's reduction to the next layer's first consumer (router read-back, host
  // planning, the first round's fill): what no fill of the layer overlaps.
  double last_round_ns = 0, reduce_ns = 0, lead_ns = 0;
  std::uint64_t rounds = 0, copies = 0, span_rounds = 0, wasted = 0, missing = 0;
  std::uint64_t errors = 0;  // device-planned: caches whose error word was set (bad ids, overflow)
};

enum class PromptMode { wide, fill_only, resident };

// Every expert of every layer on the device (tensor-major arrays, slot = expert): the
// all-resident prefill's weights, filled with the same synthetic bytes as the host pools.
class ResidentWeights {
 public:
  ResidentWeights(const Model& m) : tensors_(m.layout.tensors()), experts_(m.experts) {
    const auto E = static_cast<std::size_t>(m.experts);
    std::size_t layer_bytes = 0;
    for (const auto& t : tensors_) layer_bytes += t.bytes_per_expert * E;
    PinnedBuffer stage(layer_bytes);
    arrays_.resize(static_cast<std::size_t>(m.layers));
    for (std::int32_t l = 0; l < m.layers; ++l) {
      std::array<std::size_t, num_expert_tensors> offs{};
      std::size_t off = 0;
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        offs[t] = off;
        off += tensors_[t].bytes_per_expert * E;
      }
      parallel_experts(1, m.experts, [&](std::int32_t, std::int32_t e) {
        for (std::size_t t = 0; t < num_expert_tensors; ++t)
          synth_fill(stage.as<unsigned char>() + offs[t] + static_cast<std::size_t>(e) * tensors_[t].bytes_per_expert,
                     tensors_[t].bytes_per_expert, l, e, t);
      });
      for (std::size_t t = 0; t < num_expert_tensors; ++t) {
        auto& arr = arrays_[static_cast<std::size_t>(l)][t];
        arr = std::make_unique<DeviceBuffer>(std::max<std::size_t>(1, tensors_[t].bytes_per_expert * E));
        if (tensors_[t].bytes_per_expert != 0)
          check_cuda(cudaMemcpy(arr->p, stage.as<unsigned char>() + offs[t], tensors_[t].bytes_per_expert * E,
                                cudaMemcpyHostToDevice),
                     "cudaMemcpy(resident weights)");
      }
    }
    identity_ = DeviceBuffer(E * sizeof(std::int32_t));
    std::vector<std::int32_t> ident(E);
    for (std::size_t e = 0; e < E; ++e) ident[e] = static_cast<std::int32_t>(e);
    check_cuda(cudaMemcpy(identity_.p, ident.data(), E * sizeof(std::int32_t), cudaMemcpyHostToDevice), "cudaMemcpy(map)");
  }
  [[nodiscard]] device::MoeWeights weights(std::int32_t l) const {
    device::MoeWeights w;
    for (std::size_t t = 0; t < num_expert_tensors; ++t) {
      w.base[t] = arrays_[static_cast<std::size_t>(l)][t]->as<const unsigned char>();
      w.stride[t] = tensors_[t].bytes_per_expert;
    }
    w.expert_map = identity_.as<const std::int32_t>();
    w.num_experts = experts_;
    return w;
  }

 private:
  ExpertTensorBytes tensors_;
  std::int32_t experts_;
  std::vector<std::array<std::unique_ptr<DeviceBuffer>, num_expert_tensors>> arrays_;
  DeviceBuffer identity_;
};

// A device-planned cache (DeviceExpertCache): its overflow rounds are prepare_group calls.
template <class Cache>
inline constexpr bool device_planned_v = requires(Cache& c, cudaStream_t s) { c.prepare_group(std::int32_t{1}, s); };

// The per-layer caches of one provider (host-planned ExpertCache or device-planned
// DeviceExpertCache) and the prompt / decode drivers.
template <class Cache>
class PromptRunner {
 public:
  static constexpr bool device_planned = device_planned_v<Cache>;
  static constexpr std::int32_t chunk_pairs = 16384;  // GroupedMoe rows per run (workspace ~19 KB per row)

  PromptRunner(const Model& m, const BenchArgs& a, CudaRuntime& rt, cudaStream_t consumer, std::int32_t stream_slots,
               std::int32_t max_tokens, const ResidentWeights& resident, const DecodeSteps& decode)
      : m_(m),
        consumer_(consumer),
        resident_(resident),
        hidden_(m.layout.hidden),
        max_pairs_(static_cast<std::size_t>(max_tokens) * static_cast<std::size_t>(m.top_k)),
        prompt_moe_(m.layout, chunk_pairs, chunk_pairs,
                    a.prompt_bf16 ? device::GroupedPrecision::bf16 : device::GroupedPrecision::exact),
        decode_moe_(m.layout, 1, m.top_k),
        decode_(decode) {
    if constexpr (device_planned) check_cuda(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreate");
    for (std::int32_t l = 0; l < m.layers; ++l) {
      if constexpr (device_planned) {
        // As the decode benchmark's device provider (inline fills, no overlap), with room for
        // the longest prompt's ids.
        DeviceCacheOptions o;
        o.num_experts = m.experts;
        o.capacity = m.capacity;
        o.max_ids = static_cast<std::int32_t>(max_pairs_);
        o.crf_decay_q32 = crf_decay_for_half_life(a.crf_half_life);
        o.stream_slots = stream_slots;  // prepare_wide's stream rounds
        o.fill_engine = parse_fill_engine(a.fill_engine).value();  // checked by the argument parser
        o.log = {};
        caches_.push_back(std::make_unique<Cache>(rt, o, m.layout));
      } else {
        CacheOptions o;
        o.num_experts = m.experts;
        o.capacity = m.capacity;
        o.top_k = m.top_k;
        o.stream_slots = stream_slots;
        o.log = {};
        caches_.push_back(std::make_unique<Cache>(rt, o, m.layout));
      }
    }
    const ExpertTensorBytes tensors = m.layout.tensors();
    parallel_experts(m.layers, m.experts, [&](std::int32_t l, std::int32_t e) {
      auto& st = caches_[static_cast<std::size_t>(l)]->storage();
      for (std::size_t t = 0; t < num_expert_tensors; ++t)
        synth_fill(reinterpret_cast<unsigned char*>(st.host_tensor(t, e)), tensors[t].bytes_per_expert, l, e, t);
    });
    const auto H = static_cast<std::size_t>(hidden_);
    x_ = DeviceBuffer(static_cast<std::size_t>(max_tokens) * H * sizeof(float));
    input_kernel<<<1024, 256, 0, consumer_>>>(x_.as<float>(), static_cast<std::size_t>(max_tokens) * H);
    check_cuda(cudaGetLastError(), "input_kernel");
    pair_out_ = DeviceBuffer(max_pairs_ * H * sizeof(float));
    out_ = DeviceBuffer(static_cast<std::size_t>(max_tokens) * H * sizeof(float));
    ids_v_ = DeviceBuffer(max_pairs_ * sizeof(std::int32_t));
    w_v_ = DeviceBuffer(max_pairs_ * sizeof(float));
    src_v_ = DeviceBuffer(max_pairs_ * sizeof(std::int32_t));
    pair_v_ = DeviceBuffer(max_pairs_ * sizeof(std::int32_t));
    ids_dev_ = DeviceBuffer(max_pairs_ * sizeof(std::int32_t));
    recs_copy_ = DeviceBuffer(max_pairs_ * sizeof(PairRec));
    tiles_copy_ = DeviceBuffer(max_pairs_ * sizeof(device::GroupedTile));
    lists_copied_ = a.prompt_lists_copied;
    // Pair records, tiles (at most one per pair) and the layer's ids.
    check_cuda(cudaHostAlloc(&mapped_, max_pairs_ * (sizeof(PairRec) + sizeof(device::GroupedTile) + sizeof(std::int32_t)),
                             cudaHostAllocMapped),
               "cudaHostAlloc(mapped pair lists)");
    recs_ = static_cast<PairRec*>(mapped_);
    tiles_ = reinterpret_cast<device::GroupedTile*>(recs_ + max_pairs_);
    layer_ids_ = reinterpret_cast<std::int32_t*>(tiles_ + max_pairs_);
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&recs_dev_), recs_, 0), "cudaHostGetDevicePointer");
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&layer_ids_dev_), layer_ids_, 0),
               "cudaHostGetDevicePointer");
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&tiles_dev_), tiles_, 0), "cudaHostGetDevicePointer");
    // Decode: batch 1, the decode steps' routing (generated or a trace's), weights 1 / top_k.
    const auto K = static_cast<std::size_t>(m.top_k);
    x_dec_ = DeviceBuffer(H * sizeof(float));
    input_kernel<<<8, 256, 0, consumer_>>>(x_dec_.as<float>(), H);
    check_cuda(cudaGetLastError(), "input_kernel");
    out_dec_ = DeviceBuffer(H * sizeof(float));
    dec_ids_ = DeviceBuffer(K * sizeof(std::int32_t));
    dec_w_ = DeviceBuffer(K * sizeof(float));
    const std::vector<float> w(K, 1.0f / static_cast<float>(K));
    check_cuda(cudaMemcpy(dec_w_.p, w.data(), K * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy(decode weights)");
    dec_stage_ = std::make_unique<PinnedBuffer>(K * sizeof(std::int32_t));
    counts_.assign(static_cast<std::size_t>(m.experts) + 1, 0);
    for (int i = 0; i < 4096; ++i) {  // two per round; more are made when a prompt needs them
      cudaEvent_t e = nullptr;
      check_cuda(cudaEventCreate(&e), "cudaEventCreate");
      events_.push_back(e);
    }
    for (std::int32_t i = 0; i < 2 * m.layers; ++i) {
      cudaEvent_t e = nullptr;
      check_cuda(cudaEventCreate(&e), "cudaEventCreate");
      reduce_event_store_.push_back(e);
    }
    reduce_events_ = reduce_event_store_.data();
    order_.resize(max_pairs_);
    check_cuda(cudaStreamSynchronize(consumer_), "cudaStreamSynchronize");
  }
  ~PromptRunner() {
    if (side_) cudaStreamDestroy(side_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    for (cudaEvent_t e : reduce_event_store_) cudaEventDestroy(e);
    if (mapped_) cudaFreeHost(mapped_);
  }
  PromptRunner(const PromptRunner&) = delete;
  PromptRunner& operator=(const PromptRunner&) = delete;

  // Every cache emptied (invalidate), so each measurement starts from the same state.
  void reset() {
    check_cuda(cudaStreamSynchronize(consumer_), "cudaStreamSynchronize");
    for (std::size_t l = 0; l < caches_.size(); ++l) {
      auto& c = caches_[l];
      std::vector<std::int32_t> device_map;
      if constexpr (device_planned) device_map = resident_map(static_cast<std::int32_t>(l));
      for (std::int32_t e = 0; e < m_.experts; ++e) {
        bool resident = false;
        if constexpr (device_planned) {
          resident = device_map[static_cast<std::size_t>(e)] >= 0;
        } else {
          resident = c->planner().is_resident(e);
        }
        if (resident) {
          if (Status s = c->invalidate(e, consumer_); !s) throw Error(s);
        }
      }
    }
    check_cuda(cudaStreamSynchronize(consumer_), "cudaStreamSynchronize");
    step_ = 0;
  }

  // One decode step (batch 1): per layer the router read-back (sync), prepare, the consumer.
  // Returns its wall time (ns), ending with the step's last kernel.
  double decode_step() {
    const auto t0 = Clock::now();
    const auto K = static_cast<std::size_t>(m_.top_k);
    for (std::int32_t l = 0; l < m_.layers; ++l) {
      check_cuda(cudaStreamSynchronize(consumer_), "cudaStreamSynchronize");
      const auto ids = decode_.ids(step_, l);
      auto* stage = dec_stage_->as<std::int32_t>();
      std::fill(stage, stage + K, -1);
      std::copy_n(ids.begin(), std::min(K, ids.size()), stage);
      check_cuda(cudaMemcpyAsync(dec_ids_.p, stage, K * sizeof(std::int32_t), cudaMemcpyHostToDevice, consumer_),
                 "cudaMemcpyAsync(decode ids)");
      Cache& cache = *caches_[static_cast<std::size_t>(l)];
      const std::int32_t* consumer_ids = dec_ids_.as<std::int32_t>();
      Result<ForwardView> v = [&] {
        if constexpr (device_planned) {
          // Planned on the device from the uploaded ids; the consumer reads the plan's sanitized
          // copy (equal here: every id is valid or -1 padding).
          consumer_ids = cache.sanitized_ids_device();
          return cache.prepare(dec_ids_.as<std::int32_t>(), static_cast<std::int32_t>(K), consumer_);
        } else {
          return cache.prepare(std::span<const std::int32_t>(stage, K), consumer_);
        }
      }();
      if (!v.ok()) throw Error(v.status());
      if (Status s = decode_moe_.run(device::moe_weights_from_view(v.value(), m_.experts), consumer_ids,
                                     dec_w_.as<float>(), x_dec_.as<float>(), out_dec_.as<float>(), 1, consumer_);
          !s)
        throw Error(s);
    }
    check_cuda(cudaStreamSynchronize(consumer_), "cudaStreamSynchronize");
    ++step_;
    return ns_since(t0);
  }

  // One prompt: per layer the router read-back (sync), then one wide forward (or the
  // all-resident round), then the pair reduction. Device-planned: admission stream is
  // prepare_wide (host ids, stream slots, copy-engine copies); admit the device planner's
  // groups (prepare in rounds + prepare_group, SM gather fills, through the pool).
  PromptTimes prompt(const Prompt& p, PromptMode mode, WideOptions options) {
    PromptTimes t;
    const bool device_groups = device_planned && options.admission == WideAdmission::admit;
    const auto K = static_cast<std::size_t>(m_.top_k);
    const std::size_t pairs = static_cast<std::size_t>(p.tokens) * K;
    if (pairs > max_pairs_) throw Error(ErrorCode::invalid_argument, "prompt longer than the runner's buffers");
    std::size_t ev = 0;
    check_cuda(cudaStreamSynchronize(consumer_), "cudaStreamSynchronize");
    // Device-planned: the bound's non-resident experts from each layer's resident map, read
    // before the clock starts (nothing touches layer l's cache between here and its forward),
    // and the fills from the device counters (exact while the stream is idle).
    std::vector<std::uint64_t> missing_at_start;
    std::uint64_t misses0 = 0;
    if constexpr (device_planned) {
      if (mode != PromptMode::resident && device_groups) {
        missing_at_start = non_resident_experts(p);
        misses0 = fills();
      }
    }
    std::vector<std::pair<std::size_t, std::size_t>> layer_rounds;  // per layer: its first and last event pair
    const auto t0 = Clock::now();
    for (std::int32_t l = 0; l < m_.layers; ++l) {
      check_cuda(cudaStreamSynchronize(consumer_), "cudaStreamSynchronize");  // the router read-back
      const std::size_t layer_ev = ev;
      const std::vector<std::int32_t>& ids = p.ids[static_cast<std::size_t>(l)];
      // The consumer's pair lists (a counting sort of the layer's ids) and the ids for the
      // reduction: host work an engine does on the GPU. The host-planned cache needs neither
      // before its first fills are enqueued, so they are built in the first round's consumer,
      // while those fills stream, instead of holding the layer's first copy back.
      // The ids reach device memory on the consumer stream ahead of the rounds' work, so the
      // reduction after the last round does not wait for them.
      const bool lists_first = mode == PromptMode::resident;
      bool bucketed = false;
      const auto lists = [&]() -> Status {
        bucketed = true;
        bucket(ids);
        std::copy(ids.begin(), ids.end(), layer_ids_);
        if (device_groups && mode != PromptMode::resident) return {};  // loaded before its plan, below
        load_ids_kernel<<<static_cast<unsigned>((pairs + 255) / 256), 256, 0, consumer_>>>(layer_ids_dev_, pairs,
                                                                                         ids_dev_.as<std::int32_t>());
        if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_status(err, "load_ids_kernel");
        return {};
      };
      if (lists_first) {
        if (Status s = lists(); !s) throw Error(s);
      }
      std::size_t off = 0, tile_off = 0;
      const auto consume = [&](const device::MoeWeights& w, std::span<const std::int32_t> experts) -> Status {
        if (!bucketed) {
          if (Status s = lists(); !s) return s;
        }
        if (ev + 2 > events_.size()) {
          for (int i = 0; i < 256; ++i) {
            cudaEvent_t e = nullptr;
            if (cudaError_t err = cudaEventCreate(&e); err != cudaSuccess) return cuda_status(err, "cudaEventCreate");
            events_.push_back(e);
          }
        }
        if (cudaError_t err = cudaEventRecord(events_[ev], consumer_); err != cudaSuccess)
          return cuda_status(err, "cudaEventRecord");
        // Chunks of at most chunk_pairs rows, cut at expert boundaries (an expert has at most
        // one row per token, so at most max_tokens <= chunk_pairs rows).
        std::size_t n = 0, chunk = 0, chunk_tiles = tile_off;
        for (const std::int32_t e : experts) {
          const std::uint32_t b = counts_[static_cast<std::size_t>(e)], c = counts_[static_cast<std::size_t>(e) + 1] - b;
          if (n - chunk + c > static_cast<std::size_t>(chunk_pairs) && n > chunk) {
            if (Status s = enqueue_rows(w, off + chunk, n - chunk, chunk_tiles, tile_off - chunk_tiles); !s) return s;
            chunk = n;
            chunk_tiles = tile_off;
          }
          for (std::uint32_t i = 0; i < c; i += device::grouped_tile_rows) {
            tiles_[tile_off++] = device::GroupedTile{e, static_cast<std::int32_t>(n - chunk + i),
                                                     static_cast<std::int32_t>(std::min<std::uint32_t>(device::grouped_tile_rows, c - i)), 0};
          }
          for (std::uint32_t i = b; i < b + c; ++i) {
            const std::uint32_t q = order_[i];
            recs_[off + n++] = PairRec{static_cast<std::int32_t>(q / K), e, static_cast<std::int32_t>(q),
                                       1.0f / static_cast<float>(K)};
          }
        }
        if (n > chunk) {
          if (Status s = enqueue_rows(w, off + chunk, n - chunk, chunk_tiles, tile_off - chunk_tiles); !s) return s;
        }
        off += n;
        if (cudaError_t err = cudaEventRecord(events_[ev + 1], consumer_); err != cudaSuccess)
          return cuda_status(err, "cudaEventRecord");
        ev += 2;
        return {};
      };
      if (mode == PromptMode::resident) {
        for (std::int32_t e = 0; e < m_.experts; ++e) unique_[static_cast<std::size_t>(e)] = e;
        if (Status s = consume(resident_.weights(l), std::span<const std::int32_t>(unique_.data(), unique_.size())); !s)
          throw Error(s);
      } else if (!device_groups) {
        Cache& cache = *caches_[static_cast<std::size_t>(l)];
        Result<WideSummary> r = cache.prepare_wide(
            ids, consumer_,
            [&](const WideRound& round) -> Status {
              if (mode == PromptMode::fill_only) return {};
              return consume(device::moe_weights_from_view(round.view, m_.experts), round.experts);
            },
            options);
        if (!r.ok()) throw Error(r.status());
        if (!bucketed && mode != PromptMode::fill_only) {  // no round called the consumer
          if (Status s = lists(); !s) throw Error(s);
        }
        const WideSummary& s = r.value();
        t.rounds += s.rounds;
        t.copies += s.copies;
        t.span_rounds += s.span_rounds;
        t.wasted += s.wasted;
        t.bytes += static_cast<double>(s.bytes);
        t.missing += s.unique - s.hits;
      } else if constexpr (device_planned) {
        // The ids to device memory (the plan reads them there; the reduction below reuses them),
        // then group 0 (prepare, in rounds) and groups 1..max_groups - 1 (prepare_group), each
        // followed by its consumer on the same stream. Group g is ids [g*C, (g+1)*C) of the
        // unique list: the experts resident at the layer's start first, then the others, each
        // part ascending. The host knows both (the resident map read before the clock), so it
        // builds that group's pair and tile lists; the slots come from the view's forward map,
        // which holds group g only.
        // The pair lists (a counting sort of the ids) are built after group 0's plan and fill
        // are enqueued, while they run, as the host-planned path builds them in its first round.
        Cache& cache = *caches_[static_cast<std::size_t>(l)];
        std::copy(ids.begin(), ids.end(), layer_ids_);
        load_ids_kernel<<<static_cast<unsigned>((pairs + 255) / 256), 256, 0, consumer_>>>(layer_ids_dev_, pairs,
                                                                                           ids_dev_.as<std::int32_t>());
        check_cuda(cudaGetLastError(), "load_ids_kernel");
        const auto n = static_cast<std::int32_t>(pairs);
        const std::int32_t W = std::max<std::int32_t>(1, m_.capacity / 2);
        const auto C = static_cast<std::size_t>(W);
        const std::int32_t groups = cache.max_groups(n, W);
        for (std::int32_t g = 0; g < groups; ++g) {
          Result<ForwardView> v = g == 0 ? cache.prepare(ids_dev_.as<std::int32_t>(), n, consumer_, DeviceForward::in_rounds, W)
                                         : cache.prepare_group(g, consumer_);
          if (!v.ok()) throw Error(v.status());
          if (g == 0) {
            bucketed = true;
            bucket(ids);
            unique_.clear();
            const std::vector<char>& was_resident = start_resident_[static_cast<std::size_t>(l)];
            for (const char part : {char{1}, char{0}}) {
              for (std::int32_t e = 0; e < m_.experts; ++e) {
                const auto i = static_cast<std::size_t>(e);
                if (counts_[i + 1] > counts_[i] && was_resident[i] == part) unique_.push_back(e);
              }
            }
          }
          const std::size_t begin = std::min(unique_.size(), static_cast<std::size_t>(g) * C);
          const std::size_t end = std::min(unique_.size(), begin + C);
          if (begin == end) continue;  // a group this forward does not have: planned empty, nothing to compute
          ++t.rounds;
          if (end < unique_.size()) {
            // The next group's experts, prefetched on the side stream while this group computes
            // (ordered after this group's plan and fill; the next prepare_group after them).
            const std::size_t next_end = std::min(unique_.size(), end + C);
            PrefetchOptions po;
            po.max_bytes = static_cast<std::int64_t>(next_end - end) * static_cast<std::int64_t>(m_.expert_bytes());
            po.expires_after = 1;
            auto pv = cache.prefetch(std::span<const std::int32_t>(unique_.data() + end, next_end - end), side_, po);
            if (!pv.ok()) throw Error(pv.status());
          }
          if (mode == PromptMode::fill_only) continue;
          if (Status s = consume(device::moe_weights_from_view(v.value(), m_.experts),
                                 std::span<const std::int32_t>(unique_.data() + begin, end - begin));
              !s)
            throw Error(s);
        }
        t.missing += missing_at_start[static_cast<std::size_t>(l)];
      }
      if (mode != PromptMode::fill_only) {
        if (ev > layer_ev) layer_rounds.emplace_back(layer_ev, ev - 2);
        cudaEvent_t* re = reduce_events_ + 2 * static_cast<std::size_t>(l);
        check_cuda(cudaEventRecord(re[0], consumer_), "cudaEventRecord");
        reduce_pairs_kernel<<<static_cast<unsigned>(p.tokens), 256, 0, consumer_>>>(
            pair_out_.as<float>(), ids_dev_.as<std::int32_t>(), m_.top_k, hidden_, out_.as<float>());
        check_cuda(cudaGetLastError(), "reduce_pairs_kernel");
        check_cuda(cudaEventRecord(re[1], consumer_), "cudaEventRecord");
      }
    }
    check_cuda(cudaStreamSynchronize(consumer_), "cudaStreamSynchronize");
    t.ttft_ns = ns_since(t0);
    if constexpr (device_planned) {
      if (mode != PromptMode::resident && device_groups) {
        // Every miss and every prefetched expert is one whole-expert fill; fills beyond the
        // experts missing at the layers' starts are refills of experts an earlier group of the
        // same forward evicted.
        const std::uint64_t fills = this->fills() - misses0;
        t.copies = fills;
        t.bytes = static_cast<double>(fills) * static_cast<double>(m_.expert_bytes());
        t.wasted = fills > t.missing ? fills - t.missing : 0;
        for (auto& c : caches_) t.errors += c->take_errors() != 0 ? 1u : 0u;
      }
    }
    const auto elapsed_ns = [](cudaEvent_t a, cudaEvent_t b) {
      float ms = 0;
      check_cuda(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
      return static_cast<double>(ms) * 1e6;
    };
    for (std::size_t i = 0; i + 1 < ev; i += 2) t.compute_ns += elapsed_ns(events_[i], events_[i + 1]);
    if (mode != PromptMode::fill_only && layer_rounds.size() == static_cast<std::size_t>(m_.layers)) {
      for (std::size_t l = 0; l < layer_rounds.size(); ++l) {
        const std::size_t last = layer_rounds[l].second;
        t.last_round_ns += elapsed_ns(events_[last], events_[last + 1]);
        t.reduce_ns += elapsed_ns(reduce_events_[2 * l], reduce_events_[2 * l + 1]);
        if (l + 1 < layer_rounds.size())
          t.lead_ns += elapsed_ns(reduce_events_[2 * l + 1], events_[layer_rounds[l + 1].first]);
      }
    }
    return t;
  }

  // The last layer's output rows of the last prompt ([tokens, hidden]).
  [[nodiscard]] std::vector<float> output(std::int32_t tokens) const {
    std::vector<float> out(static_cast<std::size_t>(tokens) * static_cast<std::size_t>(hidden_));
    check_cuda(cudaMemcpy(out.data(), out_.p, out.size() * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy(out)");
    return out;
  }

  // Device-planned: layer l's resident map (expert -> slot, -1 absent), read with the stream idle.
  [[nodiscard]] std::vector<std::int32_t> resident_map(std::int32_t l) const
    requires device_planned
  {
    std::vector<std::int32_t> map(static_cast<std::size_t>(m_.experts));
    check_cuda(cudaMemcpy(map.data(), caches_[static_cast<std::size_t>(l)]->resident_map_device(),
                          map.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost),
               "cudaMemcpy(resident map)");
    return map;
  }

  // Device-planned: per layer, the prompt's unique experts that are not resident now (and which
  // experts are, in start_resident_: a forward in rounds lists those first).
  [[nodiscard]] std::vector<std::uint64_t> non_resident_experts(const Prompt& p)
    requires device_planned
  {
    std::vector<std::uint64_t> out(static_cast<std::size_t>(m_.layers), 0);
    std::vector<char> seen(static_cast<std::size_t>(m_.experts));
    start_resident_.assign(static_cast<std::size_t>(m_.layers), std::vector<char>(static_cast<std::size_t>(m_.experts)));
    for (std::int32_t l = 0; l < m_.layers; ++l) {
      const std::vector<std::int32_t> map = resident_map(l);
      for (std::size_t e = 0; e < map.size(); ++e) start_resident_[static_cast<std::size_t>(l)][e] = map[e] >= 0;
      std::fill(seen.begin(), seen.end(), 0);
      for (const std::int32_t e : p.ids[static_cast<std::size_t>(l)]) {
        if (e < 0 || seen[static_cast<std::size_t>(e)]) continue;
        seen[static_cast<std::size_t>(e)] = 1;
        if (map[static_cast<std::size_t>(e)] < 0) ++out[static_cast<std::size_t>(l)];
      }
    }
    return out;
  }

  // Experts copied into the caches so far: misses and speculative fills (device-planned prompts
  // fill every group after the first by a prefetch).
  [[nodiscard]] std::uint64_t fills() const {
    std::uint64_t n = 0;
    for (const auto& c : caches_) {
      const CacheStats s = c->stats();
      n += s.misses + s.speculative_issued;
    }
    return n;
  }

  [[nodiscard]] std::pair<std::uint64_t, std::uint64_t> hits_misses() const {
    std::uint64_t h = 0, m = 0;
    for (const auto& c : caches_) {
      const CacheStats s = c->stats();
      h += s.hits;
      m += s.misses;
    }
    return {h, m};
  }

 private:
  // Counting sort of the layer's pairs by expert: the pairs of expert e are
  // order_[counts_[e] .. counts_[e + 1]).
  void bucket(const std::vector<std::int32_t>& ids) {
    std::fill(counts_.begin(), counts_.end(), 0u);
    for (const std::int32_t e : ids)
      if (e >= 0) ++counts_[static_cast<std::size_t>(e) + 1];
    for (std::size_t e = 1; e < counts_.size(); ++e) counts_[e] += counts_[e - 1];
    cursor_.assign(counts_.begin(), counts_.end() - 1);
    for (std::size_t q = 0; q < ids.size(); ++q)
      if (ids[q] >= 0) order_[cursor_[static_cast<std::size_t>(ids[q])]++] = static_cast<std::uint32_t>(q);
    unique_.resize(static_cast<std::size_t>(m_.experts));
  }

  // The rows recs_[off, off + n) with the tiles tiles_[tile_off, tile_off + tiles): load, then
  // the grouped consumer (each row's output into its pair's row of pair_out_).
  Status enqueue_rows(const device::MoeWeights& w, std::size_t off, std::size_t n, std::size_t tile_off,
                      std::size_t tiles) noexcept {
    if (n == 0) return {};
    const PairRec* recs = recs_dev_ + off;
    // The consumer's kernels read the tiles from device memory either way (the load kernel
    // copies them from the mapped list, or a cudaMemcpyAsync does).
    device::GroupedTile* tile_list = tiles_copy_.as<device::GroupedTile>() + tile_off;
    const device::GroupedTile* tiles_in = tiles_dev_ + tile_off;
    if (lists_copied_) {
      // Disjoint ranges per call within a layer; the host waits for the consumer stream before
      // the next layer writes the same ranges again. (Slower under load: docs/benchmarks.md.)
      recs = recs_copy_.as<PairRec>() + off;
      tiles_in = nullptr;
      if (cudaError_t err = cudaMemcpyAsync(const_cast<PairRec*>(recs), recs_ + off, n * sizeof(PairRec),
                                            cudaMemcpyHostToDevice, consumer_);
          err != cudaSuccess)
        return cuda_status(err, "cudaMemcpyAsync(pair list)");
      if (cudaError_t err = cudaMemcpyAsync(tile_list, tiles_ + tile_off,
                                            tiles * sizeof(device::GroupedTile), cudaMemcpyHostToDevice, consumer_);
          err != cudaSuccess)
        return cuda_status(err, "cudaMemcpyAsync(tile list)");
    }
    const std::size_t threads = std::max(n, tiles);
    load_pairs_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, consumer_>>>(
        recs, static_cast<std::int32_t>(n), ids_v_.as<std::int32_t>() + off, w_v_.as<float>() + off,
        src_v_.as<std::int32_t>() + off, pair_v_.as<std::int32_t>() + off, tiles_in, static_cast<std::int32_t>(tiles),
        tile_list);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_status(err, "load_pairs_kernel");
    return prompt_moe_.run(w, tile_list, static_cast<int>(tiles), src_v_.as<std::int32_t>() + off,
                           pair_v_.as<std::int32_t>() + off, w_v_.as<float>() + off, x_.as<float>(), pair_out_.as<float>(),
                           static_cast<int>(n), consumer_);
  }

  const Model& m_;
  cudaStream_t consumer_;
  const ResidentWeights& resident_;
  std::int64_t hidden_;
  std::size_t max_pairs_;
  device::GroupedMoe prompt_moe_;
  device::MoeConsumer decode_moe_;
  std::vector<std::unique_ptr<Cache>> caches_;
  DeviceBuffer x_, pair_out_, out_, ids_v_, w_v_, src_v_, pair_v_, ids_dev_, recs_copy_, tiles_copy_;
  bool lists_copied_ = false;
  void* mapped_ = nullptr;
  PairRec* recs_ = nullptr;
  PairRec* recs_dev_ = nullptr;
  device::GroupedTile* tiles_ = nullptr;
  device::GroupedTile* tiles_dev_ = nullptr;
  std::int32_t* layer_ids_ = nullptr;
  std::int32_t* layer_ids_dev_ = nullptr;
  DeviceBuffer x_dec_, out_dec_, dec_ids_, dec_w_;
  std::unique_ptr<PinnedBuffer> dec_stage_;
  const DecodeSteps& decode_;
  std::int64_t step_ = 0;
  std::vector<std::uint32_t> counts_, cursor_, order_;
  std::vector<std::int32_t> unique_;
  cudaStream_t side_ = nullptr;  // device-planned: the stream of the next group's prefetch
  std::vector<std::vector<char>> start_resident_;  // device-planned: per layer, resident at the prompt's start
  std::vector<cudaEvent_t> events_;
  std::vector<cudaEvent_t> reduce_event_store_;  // two per layer, around its pair reduction
  cudaEvent_t* reduce_events_ = nullptr;
};

inline bool same_bytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One provider's TTFT table and its mixed run (device-planned: stream rows against the
// device planner's groups, which admit).
template <class Cache>
int run_provider(const char* name, const Model& m, const BenchArgs& a, CudaRuntime& rt, cudaStream_t consumer,
                 double ceiling, const ResidentWeights& resident, const std::vector<Prompt>& prompts,
                 const DecodeSteps& decode, const PromptTrace* trace) {
  constexpr bool device_planned = PromptRunner<Cache>::device_planned;
  const std::int32_t stream_slots = prompt_stream_slots(m, a);
  std::int32_t max_tokens = 0;
  for (const Prompt& p : prompts) max_tokens = std::max(max_tokens, p.tokens);
  std::fprintf(stderr, "expert-cache-bench --prompt: %s: allocating and filling pinned host pools\n", name);
  PromptRunner<Cache> b(m, a, rt, consumer, stream_slots, max_tokens, resident, decode);
  const double eb = static_cast<double>(m.expert_bytes());
  if constexpr (device_planned) {
    std::printf("\n%s: %d slots per layer and %d stream slots; rows: stream (prepare_wide from the host ids: the "
                "resident map read back, stream rounds copied by the copy engine, nothing admitted) and groups (groups "
                "of %d experts planned on the device: prepare in rounds, then prepare_group, the experts resident at a "
                "layer's start first; each group's consumer runs while the next group's experts are prefetched on a "
                "side stream); TTFT after %d decode warm-up steps from an emptied cache (bound = non-resident expert "
                "bytes / the %.1f GB/s ceiling)\n",
                name, m.capacity, stream_slots, std::max(1, m.capacity / 2), a.warmup, ceiling * 1e-9);
  } else {
    std::printf("\n%s: %d stream slots per layer; TTFT after %d decode warm-up steps from an emptied cache "
                "(bound = non-resident expert bytes / the %.1f GB/s ceiling)\n",
                name, stream_slots, a.warmup, ceiling * 1e-9);
  }
  std::printf("%7s %-9s %9s %9s %7s %7s %9s %7s %7s %10s %10s %7s %7s %6s %6s %s\n", "tokens", "copy", "ttft_ms",
              "bound_ms", "bnd/tt", "GB/s", "fill_ms", "fillGB", "fill/c", "compute_ms", "resid_ms", "rounds", "copies",
              "spans", "waste", "output");
  int failures = 0;
  std::vector<std::pair<std::int32_t, PromptTimes>> tails;  // the runs rows, for the note below the table
  for (const Prompt& p : prompts) {
    const std::int32_t tokens = p.tokens;
    b.reset();
    for (std::int32_t s = 0; s < a.warmup; ++s) (void)b.decode_step();
    const PromptTimes res = b.prompt(p, PromptMode::resident, {});
    const std::vector<float> ref = b.output(tokens);
    PromptTimes fill = b.prompt(p, PromptMode::fill_only, WideOptions{});
    const auto row = [&](const char* copy, const PromptTimes& t) {
      const std::vector<float> out = b.output(tokens);
      const bool ok = same_bytes(out, ref) && t.errors == 0 && fill.errors == 0;
      if (!ok) ++failures;
      const double bound = static_cast<double>(t.missing) * eb / ceiling * 1e9;
      char spans[24];
      if (device_planned) {
        std::snprintf(spans, sizeof spans, "-");
      } else {
        std::snprintf(spans, sizeof spans, "%llu", static_cast<unsigned long long>(t.span_rounds));
      }
      std::printf("%7d %-9s %9.2f %9.2f %7.3f %7.1f %9.2f %7.1f %7.3f %10.2f %10.2f %7llu %7llu %6s %6llu %s\n", tokens,
                  copy, t.ttft_ns / 1e6, bound / 1e6, t.ttft_ns > 0 ? bound / t.ttft_ns : 0.0,
                  t.ttft_ns > 0 ? t.bytes / t.ttft_ns : 0.0, fill.ttft_ns / 1e6,
                  fill.ttft_ns > 0 ? fill.bytes / fill.ttft_ns : 0.0,
                  fill.ttft_ns > 0 ? fill.bytes / fill.ttft_ns / (ceiling * 1e-9) : 0.0, t.compute_ns / 1e6,
                  res.ttft_ns / 1e6, static_cast<unsigned long long>(t.rounds),
                  static_cast<unsigned long long>(t.copies), spans, static_cast<unsigned long long>(t.wasted),
                  t.errors != 0 || fill.errors != 0 ? "DEVICE ERROR WORD SET"
                  : ok                              ? "bit-identical to resident"
                                                    : "DIFFERS from resident");
    };
    if constexpr (device_planned) {
      // Stream rounds leave the pool as it was (the fill-only pass above too); the groups'
      // fill-only pass admits every group, so each groups pass starts from the warmed state again.
      row("stream", b.prompt(p, PromptMode::wide, WideOptions{}));
      WideOptions groups;
      groups.admission = WideAdmission::admit;
      b.reset();
      for (std::int32_t s = 0; s < a.warmup; ++s) (void)b.decode_step();
      fill = b.prompt(p, PromptMode::fill_only, groups);
      b.reset();
      for (std::int32_t s = 0; s < a.warmup; ++s) (void)b.decode_step();
      row("groups", b.prompt(p, PromptMode::wide, groups));
    } else {
      PromptTimes runs;
      for (const WideCopy copy : {WideCopy::runs, WideCopy::span, WideCopy::automatic}) {
        WideOptions o;
        o.copy = copy;
        const PromptTimes t = b.prompt(p, PromptMode::wide, o);
        row(std::string(to_string(copy)).c_str(), t);
        if (copy == WideCopy::runs) runs = t;
      }
      tails.push_back({tokens, runs});
      WideOptions unbatched;  // automatic copies, one copy call each instead of one batched call per round
      unbatched.batch_copies = false;
      row("unbatched", b.prompt(p, PromptMode::wide, unbatched));
      WideOptions admit;
      admit.admission = WideAdmission::admit;
      row("admit", b.prompt(p, PromptMode::wide, admit));
    }
  }
  if constexpr (device_planned) {
    std::printf("(stream: automatic copies, each round's copies in one batched call; groups: the layer's ids "
                "uploaded by a kernel reading mapped host memory, then group 0's plan + fill; per group the prefetch "
                "of the next group's experts on the side stream, the group's consumer, the next group's plan (which "
                "finds them resident); rounds: the forward's rounds or groups; copies: stream, copy operations; "
                "groups, whole-expert fills, misses and prefetches (device counters), waste: refills of experts an "
                "earlier group of the same forward evicted; bound from each layer's non-resident experts before the "
                "prompt; fill_ms: the same rows with no consumer; compute_ms: the sum of the rounds' consumer times; "
                "resid_ms: the all-resident prefill)\n");
  } else {
    std::printf("(runs, span, automatic: each round's copies in one batched call; unbatched: automatic with one "
                "copy call each)\n");
    std::printf("(fill_ms: the stream rounds with an empty consumer, automatic copies: the transfer pipeline alone; "
                "fillGB: its bytes / time; fill/c: that over the ceiling; compute_ms: the sum of the rounds' consumer "
                "times; resid_ms: the all-resident prefill)\n");
    for (const auto& [tokens, t] : tails) {
      std::printf("(%d tokens, runs: what no fill overlaps, summed over the layers: last rounds' consumers %.2f ms, "
                  "pair reductions %.2f ms, reduction to the next layer's first consumer %.2f ms)\n",
                  tokens, t.last_round_ns / 1e6, t.reduce_ns / 1e6, t.lead_ns / 1e6);
    }
  }
  if (a.prompt_every > 0) {
    // Generated: a new prompt of the last --prompt length each time; a trace: its prompt each time.
    const std::int32_t tokens = trace != nullptr ? trace->prompt.tokens : a.prompts.back();
    std::printf("\n%s mixed: %s %d-token prompt every %d decode tokens, %d decode tokens measured after warm-up\n",
                name, trace != nullptr ? "the trace's" : "a", tokens, a.prompt_every, a.steps);
    std::printf("%-24s %12s %14s\n", "admission", "decode_tok/s", "decode_hit_rate");
    for (int mode = 0; mode < 3; ++mode) {
      b.reset();
      for (std::int32_t s = 0; s < a.warmup; ++s) (void)b.decode_step();
      double decode_ns = 0;
      std::uint64_t hits = 0, misses = 0;
      std::uint64_t seed = a.seed + 104729;
      for (std::int32_t s = 0; s < a.steps; ++s) {
        if (mode > 0 && s % a.prompt_every == 0) {
          WideOptions o;
          o.admission = mode == 1 ? WideAdmission::stream : WideAdmission::admit;
          if (trace != nullptr) {
            (void)b.prompt(trace->prompt, PromptMode::wide, o);
          } else {
            (void)b.prompt(generate_prompt(m, a, tokens, seed++), PromptMode::wide, o);
          }
        }
        const auto [h0, m0] = b.hits_misses();
        decode_ns += b.decode_step();
        const auto [h1, m1] = b.hits_misses();
        hits += h1 - h0;
        misses += m1 - m0;
      }
      const char* label = mode == 0   ? "decode only"
                          : mode == 1 ? "stream (scan resistant)"
                                      : (device_planned ? "groups (admit)" : "admit (reference)");
      std::printf("%-24s %12.1f %14.4f\n", label, decode_ns > 0 ? a.steps / (decode_ns / 1e9) : 0.0,
                  hits + misses > 0 ? static_cast<double>(hits) / static_cast<double>(hits + misses) : 0.0);
    }
  }
  return failures;
}

}  // namespace prompt_gpu

// The --prompt / --prompt-trace tables, MEASURED; `trace` null: generated prompts. Returns the
// process exit code.
inline int run_prompt_measured(const Model& m, const BenchArgs& a, const PromptTrace* trace) {
  using namespace prompt_gpu;
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cudaStream_t consumer = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&consumer, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{consumer};
  const double ceiling = measure_pcie_ceiling(consumer);
  std::printf("expert-cache-bench --prompt: MEASURED on CUDA: %s (sm_%d%d); pinned host->device ceiling %.1f GB/s "
              "(same run)\n",
              prop.name, prop.major, prop.minor, ceiling * 1e-9);
  std::printf("model: %d layers x %d experts, top-%d, %d slots per layer, expert %.3f MiB; consumer: "
              "reference/moe_grouped.cuh (%s activations), each expert's (token, expert) rows in tiles of up to %d; pair "
              "and tile lists %s\n",
              m.layers, m.experts, m.top_k, m.capacity, static_cast<double>(m.expert_bytes()) / (1 << 20),
              a.prompt_bf16 ? "bf16" : "exact fp32", device::grouped_tile_rows,
              a.prompt_lists_copied ? "copied to device memory" : "read from mapped host memory");
  std::printf("%s\n", prompt_routing_line(a, trace).c_str());
  {
    // The host's link at this expert size: what the device rows' FillEngine::automatic decides from.
    LinkProfile lp;
    if (Status st = link_profile_for(0, total_bytes_per_expert(m.layout.tensors()), lp); !st) throw Error(st);
    std::string reason;
    (void)lp.choose_engine(&reason);
    std::printf("%s\nfill engine automatic: %s\n", lp.describe().c_str(), reason.c_str());
  }
  const std::vector<Prompt> prompts = table_prompts(m, a, trace);
  const DecodeSteps decode = prompt_decode_steps(m, a, trace);
  std::fprintf(stderr, "expert-cache-bench --prompt: filling the all-resident weights\n");
  const ResidentWeights resident(m);
  CudaRuntime rt;
  // Default: the whole-expert provider (the best host-planned one for whole-expert fills);
  // --provider row (or row,cached) adds or selects the row cache.
  const bool all = a.providers.size() == provider_names().size();
  const auto want = [&](const char* p) { return std::find(a.providers.begin(), a.providers.end(), p) != a.providers.end(); };
  int failures = 0;
  if (all || want("cached")) {
    failures += run_provider<ExpertCache<ExpertMajorStorage, Lfru, CopyStream, Nvfp4Marlin, CudaRuntime>>(
        "cached (whole-expert, Lfru, copy_stream)", m, a, rt, consumer, ceiling, resident, prompts, decode, trace);
  }
  if (!all && want("row")) {
    failures += run_provider<ExpertCache<TensorMajorStorage, Lru, CopyStream, Nvfp4Marlin, CudaRuntime>>(
        "row (tensor-major, Lru, copy_stream)", m, a, rt, consumer, ceiling, resident, prompts, decode, trace);
  }
  if (!all && want("device")) {
    // The decode benchmark's device provider (tensor-major, planned on the GPU), once per
    // --device-policy (named in the table's title).
    // Once per fill engine too (--fill-engine; sm_loads by default).
    for (const std::string& policy : a.device_policies) {
      for (const std::string& engine : a.fill_engines) {
        BenchArgs pa = a;
        pa.device_policy = policy;
        pa.fill_engine = engine;
        failures += visit_device_policy(policy, [&]<class Policy>(Policy) {
          std::string type(Policy::name);  // lru -> DeviceLru, as the policy's type is spelled
          type[0] = static_cast<char>(type[0] - 'a' + 'A');
          const std::string name = "device (tensor-major, Device" + type + ", planned on the GPU, fill engine " + engine + ")";
          return run_provider<DeviceExpertCache<TensorMajorStorage, Nvfp4Marlin, CudaRuntime, Policy>>(
              name.c_str(), m, pa, rt, consumer, ceiling, resident, prompts, decode, trace);
        });
      }
    }
  }
  if (failures != 0) {
    std::printf("%d configuration(s) DIFFER from the all-resident prefill (or set a device error word)\n", failures);
    return exit_failure;
  }
  return exit_ok;
}

}  // namespace expert_cache::bench
