// multi-gpu-decode: expert parallel and tensor-slice caches on 2 GPUs of one host (one process,
// two devices, ncclCommInitAll), against one GPU at the same per-GPU slot memory
// (docs/parallel.md, "The 2-GPU run"). Built only when NCCL is found (-Dnccl=enabled).
//
// One synthetic NVFP4 layer (random ModelOpt checkpoint, repacked on the host: the full layer and
// its two 1/2 slices with the full layer's factors) in ONE shared registered host pool per mode;
// a skewed batch-1 decode trace. Per mode:
//   check pass  every step: each rank's step (reference/rank_step.cuh) + NCCL all-reduce, and the
//               1-GPU reference on device 0 with the same per-rank partials summed in rank order
//               (expert parallel: one cache over every expert, ids masked to each rank's experts;
//               tensor-slice: both slices all-resident); the outputs must be bit-identical (2
//               ranks: p0 + p1 in every backend). Also the unsplit 1-GPU output, within 1e-4.
//   timed pass  fresh caches, `--steps` decode steps (prepare + consumer + all-reduce + the
//               host waits for the output, as a decode loop does): tok/s and hit rate per rank.
// The 1-GPU baseline: one cache of `--capacity` whole experts on device 0, the same loop.
// NVLink multicast stays off: the program sets NCCL_NVLS_ENABLE=0 before NCCL starts (docs/parallel.md).
// Exit: 0 all checks passed, 1 a check failed, 2 bad usage, 3 fewer than 2 devices.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "expert_cache/cuda.hpp"
#include "expert_cache/parallel/all_reduce.cuh"
#include "expert_cache/parallel/expert_placement.hpp"
#include "expert_cache/parallel/shared_host_pool.hpp"
#include "expert_cache/parallel/tp_slice.hpp"
#include "expert_cache/reference/moe_consumer.cuh"
#include "expert_cache/reference/nvfp4_reference.hpp"
#include "expert_cache/reference/rank_step.cuh"

#if !defined(EXPERT_CACHE_HAVE_NCCL)
#error "bench/programs/multi_gpu_decode.cu needs NCCL (configure with -Dnccl=enabled [-Dnccl_root=DIR])"
#endif

using namespace expert_cache;
using Cache = RowCache<CudaRuntime, Nvfp4Marlin>;
using Ids = std::vector<std::int32_t>;

namespace {

struct Args {
  std::int64_t hidden = 2048, inter = 512, experts = 64;
  int top_k = 8, capacity = 16, steps = 500, check_steps = 50;
};

[[noreturn]] void die(const char* what, const Status& s) {
  std::fprintf(stderr, "multi-gpu-decode: %s: %s\n", what, std::string(s.message()).c_str());
  std::exit(1);
}
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(what, cuda_status(e, what));
}

template <class T>
struct Dev {  // device array on the current device
  T* p = nullptr;
  std::size_t n = 0;
  explicit Dev(std::size_t count) : n(count) { cuda_ok(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMalloc"); }
  Dev(const Dev&) = delete;
  ~Dev() { cudaFree(p); }
  void up(const T* h) { cuda_ok(cudaMemcpy(p, h, n * sizeof(T), cudaMemcpyHostToDevice), "upload"); }
  std::vector<T> down() const {
    std::vector<T> h(n);
    cuda_ok(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return h;
  }
};

struct Marlin {  // one layer in the Marlin layout, six host arrays [E][b]
  Nvfp4Marlin layout;
  std::vector<std::vector<unsigned char>> t;
  Marlin(const Nvfp4Marlin& l, std::int64_t e) : layout(l) {
    for (std::size_t i = 0; i < 6; ++i) t.emplace_back(static_cast<std::size_t>(e) * l.tensors()[i].bytes_per_expert);
  }
  const unsigned char* expert(std::size_t i, std::int64_t e) const {
    return t[i].data() + static_cast<std::size_t>(e) * layout.tensors()[i].bytes_per_expert;
  }
  Nvfp4MarlinLayer layer() {
    auto u = [](std::vector<unsigned char>& v) { return std::span<std::uint32_t>(reinterpret_cast<std::uint32_t*>(v.data()), v.size() / 4); };
    auto f = [](std::vector<unsigned char>& v) { return std::span<float>(reinterpret_cast<float*>(v.data()), v.size() / 4); };
    return {u(t[0]), u(t[1]), t[2], t[3], f(t[4]), f(t[5])};
  }
};

struct Resident {  // a layer all-resident on the current device, identity map
  std::vector<std::unique_ptr<Dev<unsigned char>>> t;
  std::unique_ptr<Dev<std::int32_t>> map;
  device::MoeWeights w;
  Resident(const Marlin& m, std::int64_t experts) {
    Ids ident(static_cast<std::size_t>(experts));
    for (std::size_t e = 0; e < ident.size(); ++e) ident[e] = static_cast<std::int32_t>(e);
    map = std::make_unique<Dev<std::int32_t>>(ident.size());
    map->up(ident.data());
    for (std::size_t i = 0; i < 6; ++i) {
      t.push_back(std::make_unique<Dev<unsigned char>>(m.t[i].size()));
      t.back()->up(m.t[i].data());
      w.base[i] = t.back()->p;
      w.stride[i] = m.layout.tensors()[i].bytes_per_expert;
    }
    w.expert_map = map->p;
    w.num_experts = static_cast<std::int32_t>(experts);
  }
};

struct Rank {
  int device = 0;
  cudaStream_t stream = nullptr;
  std::unique_ptr<Cache> cache;
  std::unique_ptr<device::RankStep<Cache>> step;
  std::unique_ptr<Dev<std::int32_t>> ids;
  std::unique_ptr<Dev<float>> w, x, partial;
};

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto val = [&]() -> long long {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "multi-gpu-decode: %s needs a value\n", f.c_str());
        std::exit(2);
      }
      return std::atoll(argv[++i]);
    };
    if (f == "--hidden") a.hidden = val();
    else if (f == "--inter") a.inter = val();
    else if (f == "--experts") a.experts = val();
    else if (f == "--top-k") a.top_k = static_cast<int>(val());
    else if (f == "--capacity") a.capacity = static_cast<int>(val());
    else if (f == "--steps") a.steps = static_cast<int>(val());
    else if (f == "--check-steps") a.check_steps = static_cast<int>(val());
    else {
      std::fprintf(stderr,
                   "usage: multi-gpu-decode [--hidden K] [--inter N] [--experts E] [--top-k k] [--capacity C "
                   "(whole experts per GPU)] [--steps S] [--check-steps S]\n");
      return f == "--help" ? 0 : 2;
    }
  }
  if (a.top_k < 1 || a.capacity < a.top_k || a.capacity > a.experts / 2 || a.steps < 1) {
    std::fprintf(stderr, "multi-gpu-decode: need 1 <= top-k <= capacity <= experts / 2 and steps >= 1\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) {
    std::fprintf(stderr, "multi-gpu-decode: needs 2 CUDA devices, found %d\n", devices);
    return 3;
  }
  // NVLink multicast (NVLS) stays off whatever the caller's environment says: on a shared host a
  // program using it can take every GPU out of service (docs/parallel.md). Set before NCCL starts.
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  std::printf("multi-gpu-decode: K=%lld N=%lld E=%lld top-%d, %d whole experts of slots per GPU, NCCL_NVLS_ENABLE=%s\n",
              static_cast<long long>(a.hidden), static_cast<long long>(a.inter), static_cast<long long>(a.experts), a.top_k,
              a.capacity, std::getenv("NCCL_NVLS_ENABLE"));

  const Nvfp4Marlin full{a.hidden, a.inter, ActDtype::bf16};
  auto sliced = tp_slice_layout(full, 2);
  if (!sliced.ok()) die("tensor-slice layout", sliced.status());
  const Nvfp4Marlin half = sliced.value();
  const std::int64_t E = a.experts;
  // Random checkpoint, repacked: the full layer and both slices (the full layer's factors).
  std::mt19937_64 rng(1);
  auto bytes = [&](std::int64_t n, int lo, int hi) {
    std::vector<std::uint8_t> v(static_cast<std::size_t>(n));
    std::uniform_int_distribution<int> d(lo, hi);
    for (auto& b : v) b = static_cast<std::uint8_t>(d(rng));
    return v;
  };
  const auto w13 = bytes(E * full.ckpt_w13_bytes(), 0, 255), w2 = bytes(E * full.ckpt_w2_bytes(), 0, 255);
  const auto s13 = bytes(E * full.ckpt_w13_scale_bytes(), 0x30, 0x58), s2 = bytes(E * full.ckpt_w2_scale_bytes(), 0x30, 0x58);
  std::vector<float> g13, g2;
  for (std::int64_t e = 0; e < E; ++e) {
    g13.push_back(0.02f);
    g13.push_back(0.02f);
    g2.push_back(0.015f);
  }
  const Nvfp4CheckpointLayer ck{E, w13, s13, g13, w2, s2, g2};
  Marlin full_m(full, E);
  if (auto r = repack_layer_reference(full, ck, full_m.layer()); !r.ok()) die("repack", r.status());
  std::vector<Marlin> slice_m;
  for (int r = 0; r < 2; ++r) {
    slice_m.emplace_back(half, E);
    if (auto s = repack_tp_slice_reference(full, ck, 2, r, slice_m.back().layer()); !s.ok()) die("slice repack", s.status());
  }
  // Trace: batch 1, top-k distinct, skewed (the min of two uniforms).
  std::vector<Ids> trace(static_cast<std::size_t>(std::max(a.steps, a.check_steps)));
  for (Ids& ids : trace)
    while (static_cast<int>(ids.size()) < a.top_k) {
      const auto e = static_cast<std::int32_t>(std::min(rng() % E, rng() % E));
      if (std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
    }
  std::vector<float> x(static_cast<std::size_t>(a.hidden)), topw(static_cast<std::size_t>(a.top_k), 1.0f / static_cast<float>(a.top_k));
  std::uniform_real_distribution<float> xd(-1.0f, 1.0f);
  for (float& v : x) v = xd(rng);
  const std::size_t out_n = static_cast<std::size_t>(a.hidden);

  CudaRuntime rt;
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  // ---- 1 GPU: baseline tok/s and the references --------------------------------------------
  cudaStream_t s0;
  cuda_ok(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking), "stream");
  device::MoeConsumer moe_full(full, 1, a.top_k), moe_half(half, 1, a.top_k);
  Dev<std::int32_t> d_ids(static_cast<std::size_t>(a.top_k)), d_masked(static_cast<std::size_t>(a.top_k));
  Dev<float> d_x(out_n), d_w(static_cast<std::size_t>(a.top_k)), d_out(out_n), d_ref(out_n), d_p0(out_n), d_p1(out_n);
  d_x.up(x.data());
  d_w.up(topw.data());
  const Resident res_full(full_m, E), res_h0(slice_m[0], E), res_h1(slice_m[1], E);
  double one_gpu_tok_s = 0, one_gpu_hit = 0;
  {
    CacheOptions o;
    o.num_experts = static_cast<std::int32_t>(E);
    o.capacity = a.capacity;
    o.top_k = a.top_k;
    Cache c(rt, o, full);
    for (std::size_t t = 0; t < 6; ++t)
      for (std::int64_t e = 0; e < E; ++e)
        std::memcpy(c.storage().host_tensor(t, static_cast<std::int32_t>(e)), full_m.expert(t, e), full.tensors()[t].bytes_per_expert);
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < a.steps; ++s) {
      d_ids.up(trace[static_cast<std::size_t>(s)].data());
      auto v = c.prepare(trace[static_cast<std::size_t>(s)], s0);
      if (!v.ok()) die("1-GPU prepare", v.status());
      if (Status st = moe_full.run(device::moe_weights_from_view(v.value(), o.num_experts), d_ids.p, d_w.p, d_x.p, d_out.p, 1, s0); !st)
        die("1-GPU consumer", st);
      cuda_ok(cudaStreamSynchronize(s0), "sync");
    }
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    one_gpu_tok_s = a.steps / sec;
    one_gpu_hit = c.stats().hit_rate();
  }
  std::printf("%-16s %-6s %10s %12s\n", "mode", "rank", "hit rate", "tok/s");
  std::printf("%-16s %-6s %10.3f %12.1f\n", "1 GPU", "0", one_gpu_hit, one_gpu_tok_s);

  int failures = 0;
  const int devs[2] = {0, 1};
  device::NcclAllReduce nccl(devs);
  for (Sharding mode : {Sharding::expert_parallel, Sharding::tensor_slice}) {
    const bool ep = mode == Sharding::expert_parallel;
    PlacementConfig pc;
    pc.num_global = static_cast<std::int32_t>(E);
    pc.world_size = 2;
    pc.sharding = mode;
    if (ep) pc.ranges = contiguous_ranges(pc.num_global, 2);
    auto placement = ExpertPlacement::make(pc);
    if (!placement.ok()) die("placement", placement.status());
    const Nvfp4Marlin& lay = ep ? full : half;
    cuda_ok(cudaSetDevice(0), "cudaSetDevice");
    SharedHostPool<CudaRuntime> pool(rt, placement.value(), lay.tensors());  // registered once, portable
    for (std::size_t t = 0; t < 6; ++t)
      for (std::int32_t e = 0; e < E; ++e)
        for (int r = 0; r < (ep ? 1 : 2); ++r)
          std::memcpy(pool.expert(t, r, e), ep ? full_m.expert(t, e) : slice_m[static_cast<std::size_t>(r)].expert(t, e),
                      lay.tensors()[t].bytes_per_expert);
    for (int pass = 0; pass < 2; ++pass) {  // 0: check, 1: timed (fresh caches)
      const bool check = pass == 0;
      std::vector<Rank> ranks(2);
      for (int r = 0; r < 2; ++r) {
        Rank& k = ranks[static_cast<std::size_t>(r)];
        k.device = devs[r];
        cuda_ok(cudaSetDevice(k.device), "cudaSetDevice");
        cuda_ok(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking), "stream");
        CacheOptions o;
        o.num_experts = placement.value().num_local(r);
        o.capacity = ep ? a.capacity : std::min<int>(2 * a.capacity, static_cast<int>(E));  // same slot bytes per GPU
        o.top_k = a.top_k;
        o.memory = pool.rank_memory(r);
        k.cache = std::make_unique<Cache>(rt, o, lay);
        k.step = std::make_unique<device::RankStep<Cache>>(placement.value(), r, *k.cache, 1, a.top_k);
        k.ids = std::make_unique<Dev<std::int32_t>>(static_cast<std::size_t>(a.top_k));
        k.w = std::make_unique<Dev<float>>(static_cast<std::size_t>(a.top_k));
        k.x = std::make_unique<Dev<float>>(out_n);
        k.partial = std::make_unique<Dev<float>>(out_n);
        k.w->up(topw.data());
        k.x->up(x.data());
      }
      const int steps = check ? a.check_steps : a.steps;
      const auto t0 = std::chrono::steady_clock::now();
      for (int s = 0; s < steps; ++s) {
        const Ids& ids = trace[static_cast<std::size_t>(s)];
        const float* parts[2];
        float* outs[2];
        cudaStream_t streams[2];
        for (int r = 0; r < 2; ++r) {
          Rank& k = ranks[static_cast<std::size_t>(r)];
          cuda_ok(cudaSetDevice(k.device), "cudaSetDevice");
          k.ids->up(ids.data());
          auto v = k.step->run(ids, k.ids->p, k.w->p, k.x->p, k.partial->p, 1, k.stream);
          if (!v.ok()) die("rank step", v.status());
          parts[r] = outs[r] = k.partial->p;  // in place
          streams[r] = k.stream;
        }
        if (Status st = nccl.run(parts, outs, out_n, streams); !st) die("all-reduce", st);
        for (Rank& k : ranks) {
          cuda_ok(cudaSetDevice(k.device), "cudaSetDevice");
          cuda_ok(cudaStreamSynchronize(k.stream), "sync");
        }
        if (!check) continue;
        // The 1-GPU reference on device 0: the same two partials, summed in rank order.
        cuda_ok(cudaSetDevice(0), "cudaSetDevice");
        d_ids.up(ids.data());
        float* p[2] = {d_p0.p, d_p1.p};
        for (int r = 0; r < 2; ++r) {
          Status st;
          if (ep) {
            Ids masked = ids;
            for (auto& e : masked)
              if (placement.value().owner_of(e) != r) e = -1;
            d_masked.up(masked.data());
            st = moe_full.run(res_full.w, d_masked.p, d_w.p, d_x.p, p[r], 1, s0);
            cuda_ok(cudaStreamSynchronize(s0), "sync");
          } else {
            st = moe_half.run(r == 0 ? res_h0.w : res_h1.w, d_ids.p, d_w.p, d_x.p, p[r], 1, s0);
          }
          if (!st) die("reference consumer", st);
        }
        const float* cp[2] = {d_p0.p, d_p1.p};
        if (Status st = device::SameDeviceAllReduce::run(cp, d_ref.p, out_n, s0); !st) die("reference sum", st);
        if (Status st = moe_full.run(res_full.w, d_ids.p, d_w.p, d_x.p, d_out.p, 1, s0); !st) die("unsplit", st);
        cuda_ok(cudaStreamSynchronize(s0), "sync");
        const auto got = ranks[0].partial->down(), got1 = ranks[1].partial->down(), want = d_ref.down(), unsplit = d_out.down();
        double m = 0, d = 0;
        for (std::size_t i = 0; i < out_n; ++i) {
          m = std::max(m, static_cast<double>(std::fabs(unsplit[i])));
          d = std::max(d, static_cast<double>(std::fabs(got[i] - unsplit[i])));
        }
        const bool same = std::memcmp(got.data(), want.data(), out_n * sizeof(float)) == 0 &&
                          std::memcmp(got1.data(), want.data(), out_n * sizeof(float)) == 0;
        if (!same || d > 1e-4 * m) {
          ++failures;
          std::printf("%s step %d: %s, max |2 GPUs - unsplit| / max = %.3g\n", ep ? "expert parallel" : "tensor-slice", s,
                      same ? "bit-identical" : "NOT bit-identical to the 1-GPU rank-order reference", m == 0 ? d : d / m);
        }
      }
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      double hit[2];
      for (int r = 0; r < 2; ++r) {  // each rank's resources freed with its device current
        Rank& k = ranks[static_cast<std::size_t>(r)];
        hit[r] = k.cache->stats().hit_rate();
        cuda_ok(cudaSetDevice(k.device), "cudaSetDevice");
        cuda_ok(cudaStreamSynchronize(k.stream), "sync");
        k.step.reset();  // before its cache
        k.cache.reset();
        k.ids.reset();
        k.w.reset();
        k.x.reset();
        k.partial.reset();
        cuda_ok(cudaStreamDestroy(k.stream), "cudaStreamDestroy");
      }
      if (check) {
        std::printf("%s: %d steps checked, %s\n", ep ? "expert parallel" : "tensor-slice", steps,
                    failures == 0 ? "bit-identical to the 1-GPU run (rank-order partials)" : "FAILED");
        continue;
      }
      for (int r = 0; r < 2; ++r)
        std::printf("%-16s %-6d %10.3f %12.1f\n", ep ? "EP 2 GPUs" : "TP-slice 2 GPUs", r, hit[r], steps / sec);
    }
  }
  std::printf("%s\n", failures == 0 ? "all checks passed" : "CHECKS FAILED");
  return failures == 0 ? 0 : 1;
}
