#pragma once
// expert-cache-bench --prompt: time to first token (TTFT) of whole prompts served as ONE wide
// forward per layer (prepare_wide), and a mixed run (one prompt every K decode tokens), both
// MODELLED on SimRuntime with the decode run's cost model (modelled_run.hpp). Host-planned
// provider: per-layer whole-expert caches (expert-major blobs, Lfru, copy stream) with the
// recommended stream slots; with --provider device also the device-planned cache (tensor-major,
// DeviceLru, the same stream slots; its decode steps planned by the library's SimRuntime planner,
// modelled_device.hpp), whose prepare_wide reads the pool's resident map back first. Per layer the
// host first waits for the consumer stream (the router's ids on the host), then prepare_wide; each
// round's consumer is one modelled kernel. The prompts and decode steps are generated, or a trace's
// (--prompt-trace, prompt_trace.hpp). Host-only. On a CUDA build with a device the tables are
// measured instead (prompt_measured.cuh).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "args.hpp"
#include "expert_cache/expert_cache.hpp"
#include "model.hpp"
#include "modelled_device.hpp"
#include "modelled_run.hpp"
#include "prompt_trace.hpp"

namespace expert_cache::bench {

// Compute model of the prompt consumer (assumption, stated in docs/benchmarks.md): per round a
// launch (consumer_fixed_ns), the round's expert weights read once from HBM, and per
// (token, expert) pair 6 * hidden * intermediate flops at prompt_flops_per_ns.
inline constexpr double prompt_flops_per_ns = 400e3;  // 400 TFLOP/s effective (NVFP4 peak is far higher)

// Stream slots per layer of the prompt mode: --stream-slots, else the recommended size.
inline std::int32_t prompt_stream_slots(const Model& m, const BenchArgs& a) noexcept {
  return std::min(m.experts, a.stream_slots > 0 ? a.stream_slots : recommended_stream_slots(m.capacity, m.top_k));
}

// Device = false: the host-planned whole-expert cache; true: the device-planned cache.
template <bool Device>
class PromptBench {
 public:
  using Cache = std::conditional_t<Device, DeviceExpertCache<TensorMajorStorage, ExplicitLayout, ModelledSim, DeviceLru>,
                                   ExpertCache<ExpertMajorStorage, Lfru, CopyStream, ExplicitLayout, ModelledSim>>;

  PromptBench(const Model& m, const BenchArgs& a, const SimCosts& costs, const DecodeSteps& decode)
      : m_(m), a_(a), rt_(costs), decode_(decode) {
    consumer_ = rt_.create_stream().value();
    const ExpertTensorBytes real = m.layout.tensors();
    const ExplicitLayout layout = scaled_layout(real, a.sim_scale);
    for (std::int32_t l = 0; l < m.layers; ++l) {
      if constexpr (Device) {
        DeviceCacheOptions o;
        o.num_experts = m.experts;
        o.capacity = m.capacity;
        o.max_ids = m.top_k;  // a decode step of one token
        o.stream_slots = prompt_stream_slots(m, a);
        o.log = {};
        caches_.push_back(std::make_unique<Cache>(rt_, o, layout));
      } else {
        CacheOptions o;
        o.num_experts = m.experts;
        o.capacity = m.capacity;
        o.top_k = m.top_k;
        o.stream_slots = prompt_stream_slots(m, a);
        o.log = {};
        caches_.push_back(std::make_unique<Cache>(rt_, o, layout));
      }
      fill_sim_pools(*caches_.back(), rt_, l, real);
    }
    if constexpr (Device) ids_dev_ = RuntimeBuffer<ModelledSim>(rt_, static_cast<std::size_t>(m.top_k) * sizeof(std::int32_t), MemoryKind::device);
  }

  [[nodiscard]] double expert_bytes() const noexcept { return static_cast<double>(m_.expert_bytes()); }
  [[nodiscard]] double pair_ns() const noexcept {
    return 6.0 * static_cast<double>(a_.hidden) * static_cast<double>(a_.intermediate) / prompt_flops_per_ns;
  }
  [[nodiscard]] double now() noexcept {
    (void)rt_.synchronize(consumer_);
    return rt_.now_ns();
  }

  // One decode step (batch 1): per layer sync, prepare, one consumer kernel.
  void decode_step() {
    for (std::int32_t l = 0; l < m_.layers; ++l) {
      (void)rt_.synchronize(consumer_);
      const auto ids = decode_.ids(step_, l);
      Result<ForwardView> v = [&] {
        if constexpr (Device) {
          // The router stand-in writes the step's ids into device memory; the plan reads them there.
          auto* dst = reinterpret_cast<std::int32_t*>(ids_dev_.data());
          const std::vector<std::int32_t> step(ids.begin(), ids.end());
          const Access w{dst, step.size() * sizeof(std::int32_t), AccessMode::write};
          check(rt_.launch(consumer_, std::span<const Access>(&w, 1), [dst, step] { std::copy(step.begin(), step.end(), dst); },
                           rt_.costs().graph_node_ns));
          return caches_[static_cast<std::size_t>(l)]->prepare(dst, static_cast<std::int32_t>(step.size()), consumer_);
        } else {
          return caches_[static_cast<std::size_t>(l)]->prepare(ids, consumer_);
        }
      }();
      if (!v.ok()) throw Error(v.status());
      const auto& c = rt_.costs();
      check(rt_.launch(consumer_, {}, {}, c.consumer_fixed_ns + static_cast<double>(ids.size()) * expert_bytes() / c.hbm_bytes_per_ns));
    }
    ++step_;
  }

  struct PromptTimes {
    double ttft_ns = 0, compute_ns = 0, bound_ns = 0, resident_ns = 0, bytes = 0;
    std::uint64_t rounds = 0, copies = 0;
  };

  // One prompt as one wide forward per layer.
  PromptTimes prompt(const PromptRouting& p, WideAdmission admission) {
    PromptTimes t;
    const auto& c = rt_.costs();
    const double start = now();
    for (std::int32_t l = 0; l < m_.layers; ++l) {
      (void)rt_.synchronize(consumer_);
      Cache& cache = *caches_[static_cast<std::size_t>(l)];
      const auto& ids = p.ids[static_cast<std::size_t>(l)];
      // Tokens per expert of this layer (the consumer's work per round).
      std::vector<std::int32_t> pairs(static_cast<std::size_t>(m_.experts), 0);
      std::size_t routed = 0;  // (token, expert) pairs
      for (const std::int32_t e : ids) {
        if (e < 0) continue;  // padding: a token with fewer than top-k experts
        ++pairs[static_cast<std::size_t>(e)];
        ++routed;
      }
      std::size_t missing = 0, unique = 0;
      const std::int32_t* device_map = nullptr;
      if constexpr (Device) {  // the pool's residency, read with the stream idle (not timed: the bound's input)
        device_map = cache.resident_map_device();
        rt_.sim().host_access(device_map, static_cast<std::size_t>(m_.experts) * sizeof(std::int32_t), AccessMode::read);
      }
      for (std::int32_t e = 0; e < m_.experts; ++e) {
        if (pairs[static_cast<std::size_t>(e)] == 0) continue;
        ++unique;
        bool resident = false;
        if constexpr (Device) {
          resident = device_map[e] >= 0;
        } else {
          resident = cache.planner().is_resident(e);
        }
        if (!resident) ++missing;
      }
      t.bound_ns += static_cast<double>(missing) * expert_bytes() / c.pcie_bytes_per_ns;
      t.resident_ns += c.consumer_fixed_ns + static_cast<double>(unique) * expert_bytes() / c.hbm_bytes_per_ns +
                       static_cast<double>(routed) * pair_ns();
      auto r = cache.prepare_wide(ids, consumer_, [&](const WideRound& round) noexcept {
        double work = 0;
        for (const std::int32_t e : round.experts) work += pairs[static_cast<std::size_t>(e)];
        const double ns = c.consumer_fixed_ns + static_cast<double>(round.experts.size()) * expert_bytes() / c.hbm_bytes_per_ns +
                          work * pair_ns();
        t.compute_ns += ns;
        return rt_.launch(consumer_, {}, {}, ns);
      }, wide_options(admission));
      if (!r.ok()) throw Error(r.status());
      t.rounds += r.value().rounds;
      t.copies += r.value().copies;
      t.bytes += static_cast<double>(r.value().streamed + r.value().admitted) * expert_bytes();
    }
    t.ttft_ns = now() - start;
    return t;
  }

  // The pools hold weights scaled down by sim_scale while the cost model charges the real bytes:
  // the copy-shape choice (WideCopy::automatic) sees the link slowed by the same factor, so it
  // chooses as it would for the real experts.
  [[nodiscard]] WideOptions wide_options(WideAdmission admission) const noexcept {
    WideOptions o;
    o.admission = admission;
    o.cost.link_bytes_per_ns /= static_cast<double>(std::max<std::int64_t>(1, a_.sim_scale));
    return o;
  }

  [[nodiscard]] CacheStats totals() const {
    CacheStats s;
    for (const auto& c : caches_) {
      const CacheStats x = c->stats();
      s.hits += x.hits;
      s.misses += x.misses;
    }
    return s;
  }

 private:
  static void check(const Status& s) {
    if (!s) throw Error(s);
  }
  const Model& m_;
  const BenchArgs& a_;
  ModelledSim rt_;
  SimRuntime::Stream consumer_{};
  std::vector<std::unique_ptr<Cache>> caches_;
  RuntimeBuffer<ModelledSim> ids_dev_;  // Device: a decode step's ids
  const DecodeSteps& decode_;
  std::int64_t step_ = 0;
};

// One provider's --prompt tables (MODELLED): TTFT per prompt, then the mixed run.
template <bool Device>
void print_prompt_tables(const Model& m, const BenchArgs& a, const SimCosts& costs, const std::vector<PromptRouting>& prompts,
                         const DecodeSteps& decode, const PromptTrace* trace) {
  std::printf("\n%s: TTFT (one wide forward per layer, stream admission, after %d decode warm-up steps; bound = "
              "non-resident bytes / %.1f GB/s)\n",
              Device ? "device-planned cache (tensor-major, DeviceLru; prepare_wide reads the resident map back first)"
                     : "host-planned whole-expert cache (Lfru, copy stream)",
              a.warmup, costs.pcie_bytes_per_ns);
  std::printf("%8s %10s %10s %10s %8s %12s %12s %8s %8s\n", "tokens", "ttft_ms", "bound_ms", "bound/ttft", "GB/s",
              "compute_ms", "resident_ms", "rounds", "copies");
  using Bench = PromptBench<Device>;
  for (const PromptRouting& p : prompts) {
    Bench b(m, a, costs, decode);
    for (std::int32_t s = 0; s < a.warmup; ++s) b.decode_step();
    const typename Bench::PromptTimes t = b.prompt(p, WideAdmission::stream);
    std::printf("%8d %10.3f %10.3f %10.3f %8.1f %12.3f %12.3f %8llu %8llu\n", p.tokens, t.ttft_ns / 1e6, t.bound_ns / 1e6,
                t.ttft_ns > 0 ? t.bound_ns / t.ttft_ns : 0.0, t.ttft_ns > 0 ? t.bytes / t.ttft_ns : 0.0,
                t.compute_ns / 1e6, t.resident_ns / 1e6, static_cast<unsigned long long>(t.rounds),
                static_cast<unsigned long long>(t.copies));
  }
  if (a.prompt_every > 0) {
    // Generated: a new prompt of the last --prompt length each time; a trace: its prompt each time.
    const std::int32_t tokens = trace != nullptr ? trace->prompt.tokens : a.prompts.back();
    std::printf("\nmixed: %s %d-token prompt every %d decode tokens, %d decode tokens measured after warm-up\n",
                trace != nullptr ? "the trace's" : "a", tokens, a.prompt_every, a.steps);
    std::printf("%-24s %12s %14s\n", "admission", "decode_tok/s", "decode_hit_rate");
    // The device-planned cache's admit is its groups through the pool (prepare in rounds +
    // prepare_group): measured on a GPU only.
    for (int mode = 0; mode < (Device ? 2 : 3); ++mode) {
      Bench b(m, a, costs, decode);
      for (std::int32_t s = 0; s < a.warmup; ++s) b.decode_step();
      double decode_ns = 0;
      std::uint64_t hits = 0, misses = 0;
      std::uint64_t prompt_seed = a.seed + 104729;
      for (std::int32_t s = 0; s < a.steps; ++s) {
        if (mode > 0 && s % a.prompt_every == 0) {
          const WideAdmission admission = mode == 1 ? WideAdmission::stream : WideAdmission::admit;
          if (trace != nullptr) {
            (void)b.prompt(trace->prompt, admission);
          } else {
            (void)b.prompt(generate_prompt(m, a, tokens, prompt_seed++), admission);
          }
        }
        const CacheStats s0 = b.totals();
        const double t0 = b.now();
        b.decode_step();
        decode_ns += b.now() - t0;
        const CacheStats s1 = b.totals();
        hits += s1.hits - s0.hits;
        misses += s1.misses - s0.misses;
      }
      const char* name = mode == 0 ? "decode only" : mode == 1 ? "stream (scan resistant)" : "admit (reference)";
      std::printf("%-24s %12.1f %14.4f\n", name, decode_ns > 0 ? a.steps / (decode_ns / 1e9) : 0.0,
                  hits + misses > 0 ? static_cast<double>(hits) / static_cast<double>(hits + misses) : 0.0);
    }
    if (Device) std::printf("(device-planned groups, which admit: measured on a GPU only)\n");
  }
}

// The --prompt / --prompt-trace tables (MODELLED); `trace` null: generated prompts. Returns the
// process exit code.
inline int run_prompt_mode(const Model& m, const BenchArgs& a, const PromptTrace* trace) {
  const SimCosts costs;
  std::printf("expert-cache-bench --prompt: MODELLED on SimRuntime (no GPU measurement; costs as the decode run's, "
              "compute %.0f TFLOP/s assumed)\n",
              prompt_flops_per_ns / 1e3);
  std::printf("model: %d layers x %d experts, top-%d, %d slots per layer, expert %.3f MiB, %d stream slots per layer\n",
              m.layers, m.experts, m.top_k, m.capacity, static_cast<double>(m.expert_bytes()) / (1 << 20),
              prompt_stream_slots(m, a));
  std::printf("%s\n", prompt_routing_line(a, trace).c_str());
  const std::vector<PromptRouting> prompts = table_prompts(m, a, trace);
  const DecodeSteps decode = prompt_decode_steps(m, a, trace);
  // The host-planned cache always; the device-planned one when --provider names it (its groups
  // rows, which admit, are measured on a GPU only).
  const bool all = a.providers.size() == provider_names().size();
  const bool device = !all && std::find(a.providers.begin(), a.providers.end(), "device") != a.providers.end();
  print_prompt_tables<false>(m, a, costs, prompts, decode, trace);
  if (device) {
    print_prompt_tables<true>(m, a, costs, prompts, decode, trace);
    std::printf("device: its groups rows (prepare in rounds + prepare_group) measured on a GPU only\n");
  }
  return 0;
}

}  // namespace expert_cache::bench
