#pragma once
// expert-cache-bench: command-line arguments (BenchArgs, parse_args, --help) and the run
// configurations they select. Host-only; every problem is a UsageError (exit 2).
#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "cli_args.hpp"
#include "expert_cache/eviction/crf_math.hpp"
#include "expert_cache/planning/device_plan/policies.hpp"
#include "expert_cache/tools/prefetch_replay.hpp"

namespace expert_cache::bench {

inline constexpr int exit_ok = 0;
inline constexpr int exit_failure = 1;
inline constexpr int exit_usage = 2;

enum class RuntimeChoice : std::uint8_t { automatic, sim, cuda };

struct BenchArgs {
  // Synthetic model (defaults: the reference providers' 48-layer, 512-expert NVFP4 model, 208 slots per layer).
  std::int32_t layers = 48;
  std::int32_t experts = 512;
  std::int32_t top_k = 10;
  std::int64_t hidden = 2048;
  std::int64_t intermediate = 512;
  std::int32_t capacity = 208;
  std::int32_t batch = 1;    // tokens per decode step
  std::int32_t steps = 32;   // measured steps
  std::int32_t warmup = 64;  // steps before measuring (the first one is the cold start)
  // Generator (trace.hpp's GeneratorSpec): per-layer Zipf popularity + reuse of the last picks.
  double zipf = 1.0;
  double sticky = 0.4;
  std::uint64_t seed = 1;
  std::optional<std::string> trace_path;
  bool layers_given = false;
  bool experts_given = false;
  bool topk_given = false;
  std::vector<std::string> providers;  // row, cached, device, resident
  std::vector<std::string> staging;    // inline, copy_stream, batched, gather
  bool staging_given = false;
  bool overlap = false;  // the device provider also with per-slot readiness (measured only)
  bool one_pass = false;  // the device provider also with the consumer copying its misses (measured only)
  bool fill_only = false;  // the device provider also without its consumer (a timing decomposition)
  // --fill-engine: the engines the device rows move their fills with (sm_loads, copy_engine,
  // automatic; DeviceCacheOptions::fill_engine), one row each; measured only beyond sm_loads.
  std::vector<std::string> fill_engines{"sm_loads"};
  // The device provider's per-layer time budget: rows that leave a stage out or double it
  // (budget_stagings), and the table derived from them (measured only).
  bool budget = false;
  // The device provider's planning policies (lru, lfru, crf; "all" = the three), one row each in
  // one run, with the same routing. device_policy is the one a device run plans with (set per
  // row by with_device_policy).
  std::vector<std::string> device_policies{"lru"};
  std::string device_policy = "lru";
  // The fill engine one device run moves its fills with (one of fill_engines; set per run).
  std::string fill_engine = "sm_loads";
  // Lookahead (lookahead.hpp): predictor names (none | coact | prev | hint:R) of the extra rows of
  // the host-planned providers with copy_stream staging; empty = none asked (output as before).
  std::vector<std::string> prefetch;
  std::optional<std::int32_t> prefetch_budget;  // experts per layer; default top_k
  // --two-ahead R,...: each hint row of --prefetch once more per R, also prefetching layer L+2
  // after layer L from emulated hints of recall R (the row's wrong ids and noise); as spelled.
  std::vector<std::string> two_ahead;
  // --evict-last-forward: the lookahead rows' prefetches may evict the target cache's last forward
  // (PrefetchOptions::evict_last_forward; the loop prefetches layer L+1 after that cache's previous
  // forward was consumed), so a cache of top_k slots looks ahead too.
  bool evict_last_forward = false;
  RuntimeChoice runtime = RuntimeChoice::automatic;
  std::optional<std::string> json_path;
  std::int64_t sim_scale = 1024;  // SimRuntime holds weights scaled down by this factor
  bool progress = false;
  bool help = false;
  // --prompt: prompt lengths (tokens) of the TTFT mode (prompt_run.hpp); empty = the decode run.
  std::vector<std::int32_t> prompts;
  // --prompt-trace FILE[:STEP]: the TTFT mode's prompt from a trace file, the wide forward of each
  // layer at STEP (default: the first step with one); prompt_trace.hpp.
  std::optional<std::string> prompt_trace_path;
  std::optional<std::int32_t> prompt_trace_step;
  std::int32_t prompt_every = 0;  // --prompt-every K: the mixed run, one prompt every K decode tokens
  std::int32_t stream_slots = 0;  // --stream-slots N: per layer for the prompt mode (0: recommended_stream_slots)
  // --prompt-lists: how a round's pair and tile lists reach the consumer's kernels: read by the
  // kernels from mapped host memory (default), or copied into device memory on the consumer stream.
  bool prompt_lists_copied = false;
  double crf_half_life = 8.0;  // --crf-half-life H: the device crf policy's half-life in forwards
  // --prompt-precision: the prompt consumer's activations (GroupedPrecision): bf16, as an engine's
  // prefill GEMM takes them (default), or exact (three bf16 terms per fp32 value, 3x the MMAs).
  bool prompt_bf16 = true;
  // --consumer-order: the overlapped consumer's block order (device::MoePairOrder): pairs or experts.
  std::string consumer_order = "pairs";
  // --overlap-parts: the overlapped fill copies each expert whole (whole, the default) or every
  // missing expert's W13 tensors first, on their own ready word (w13-first).
  std::string overlap_parts = "whole";
  // --device-storage: how the measured device rows store experts: tensor_major (one host pool and
  // one slot array per tensor: a fill is one copy per tensor, six for NVFP4) or expert_major (each
  // expert's tensors contiguous on the host and in its slot: a fill is one copy, the fewest calls
  // for the copy proxy).
  std::string device_storage = "tensor_major";
  // --host-wait: how the host thread waits for the device (cudaSetDeviceFlags before the run):
  // auto (CUDA's default), spin, yield or blocking.
  std::string host_wait = "auto";
  // --prefetch-at: where the device rows' lookahead issues layer l+1's prefetch: after layer l's
  // prepare (prepare, the default: in the graph the fork then follows layer l's own fills, so
  // demand goes before speculation), after layer l's router (router: the engine's hint, layer
  // l+1's router applied to layer l's input, is known there), or auto: router where the
  // prefetch's fills run on the copy engine, prepare where they take SM loads.
  std::string prefetch_at = "prepare";
  // --timeline: the device rows log their step from the device (decode/timeline.cuh) and print a
  // summary per row: layer time, the consumer's tail, fill latencies, the link's idle time.
  bool timeline = false;
  // --timeline-csv PREFIX: with --timeline, each device row's events also go to
  // PREFIX.<row>.csv (decode/timeline_summary.hpp, write_timeline_csv).
  std::string timeline_csv;
  // --step-sync: the device rows wait for each step before launching the next, as an engine
  // that reads each step's sampled token back does (default: steps launched back to back).
  bool step_sync = false;
};

inline const std::vector<std::string>& provider_names() {
  static const std::vector<std::string> names{"row", "cached", "device", "resident"};
  return names;
}
inline const std::vector<std::string>& staging_names() {
  static const std::vector<std::string> names{"inline", "copy_stream", "batched", "gather"};
  return names;
}

inline void print_help(std::FILE* out, bool cuda_built) {
  std::fprintf(out,
               "usage: expert-cache-bench [options]\n"
               "\n"
               "Decode-loop benchmark of the expert cache on a synthetic NVFP4 MoE model: per step and layer\n"
               "prepare() then the MoE consumer. Compares the row provider (tensor-major, LRU), the cached provider\n"
               "(whole-expert, LFRU) under every staging policy, and an all-resident run (upper bound).\n"
               "Without a GPU the run is MODELLED on SimRuntime's virtual-time cost model (docs/benchmarks.md).\n"
               "\n"
               "model\n"
               "  --layers N          MoE layers (default 48)\n"
               "  --experts E         experts per layer (default 512)\n"
               "  --topk K            experts per token (default 10)\n"
               "  --hidden K          hidden size (default 2048)\n"
               "  --intermediate N    intermediate size (default 512): expert = 1.688 MiB in NVFP4-Marlin\n"
               "  --capacity C        GPU slots per layer (default 208)\n"
               "routing\n"
               "  --trace FILE        routing trace, format v1 (docs/trace_format.md); one trace step = one token;\n"
               "                      layers, experts and top-k come from the trace (--layers limits the layers)\n"
               "  --zipf S --sticky P --seed N   generator (default 1.0, 0.4, 1) when no --trace is given\n"
               "run\n"
               "  --batch B           tokens per decode step, 1..16 (default 1)\n"
               "  --steps N           measured decode steps (default 32)\n"
               "  --warmup N          steps before measuring; the first is the cold start (default 64)\n"
               "  --provider P,...    row, cached, device, resident, or all (default all)\n"
               "  --staging S,...     inline, copy_stream, batched, gather (CUDA only), or all (default: all that\n"
               "                      the runtime has)\n"
               "  --overlap           the device provider twice: as is (graph) and with fills overlapping the\n"
               "                      consumer (overlap: per-slot ready words); measured on a GPU only\n"
               "  --one-pass          the device provider once more with the consumer copying the misses from\n"
               "                      mapped host memory as it computes (one_pass: no fill node); GPU only\n"
               "  --fill-engine E,... the engines of the device rows' fills: sm_loads (default: the SMs read\n"
               "                      mapped host memory), copy_engine (a host proxy copies the plan's fill list;\n"
               "                      rows +ce), automatic (the link profile decides; rows +auto), split (SM\n"
               "                      loads for forwards, the copy engine for prefetches; overlap rows +split,\n"
               "                      DeviceCacheOptions::speculate_on_copy_engine), or all (the first three); GPU only\n"
               "  --device-policy P,... the device provider's planning policy: lru (default), lfru, crf, a comma\n"
               "                      list, or all (docs/policies.md); one device row per policy, same routing\n"
               "  --crf-half-life H   the device crf policy's half-life in forwards (default 8; DeviceCacheOptions\n"
               "                      ::crf_decay_q32)\n"
               "  --consumer-order O  with --overlap, the order in which the consumer's blocks take the\n"
               "                      (token, expert) pairs: pairs (default) or experts (the fill's order)\n"
               "  --device-storage S the measured device rows' storage: tensor_major (default; a fill is one copy\n"
               "                      per tensor) or expert_major (a fill is one copy); GPU only\n"
               "  --overlap-parts P   with --overlap: whole (each expert in one piece, default) or w13-first\n"
               "                      (every missing expert's W13 tensors first, on their own ready word)\n"
               "  --prefetch-at P     where the device rows' lookahead prefetches layer l+1: after layer l's\n"
               "                      prepare (prepare, default: after its own fills), after its router\n"
               "                      (router), or auto (router where the prefetch fills run on the copy\n"
               "                      engine, else prepare); GPU only\n"
               "  --timeline          the device rows watch their plan's slot words from a monitor kernel and\n"
               "                      print where a layer's time goes (diagnostic: the monitor costs a little\n"
               "                      speed); GPU only\n"
               "  --timeline-csv P    with --timeline, each device row's events also to P.<row>.csv\n"
               "  --step-sync         the device rows wait for each step before the next (as an engine that\n"
               "                      reads each sampled token back); default: steps launched back to back\n"
               "  --host-wait W       how the host thread waits for the GPU: auto (CUDA's default), spin,\n"
               "                      yield or blocking (cudaSetDeviceFlags); GPU only\n"
               "  --fill-only         the device provider once more with no consumer (router, plan and fills\n"
               "                      only): the time a perfectly hidden consumer would leave; outputs unchecked\n"
               "  --budget            the device provider's time per layer: rows with a stage left out or doubled\n"
               "                      (router only, router+plan, fill_only, plan doubled, consumer doubled) and\n"
               "                      the per-layer table they give; measured on a GPU only (implies --fill-only)\n"
               "  --prefetch P,...    lookahead rows for row/cached with copy_stream staging and (measured only)\n"
               "                      the device rows: after layer L's prepare (device rows: --prefetch-at),\n"
               "                      prefetch layer L+1's predicted experts (device: on a side stream inside\n"
               "                      the captured step): none, coact\n"
               "                      (co-activation table), prev (previous token), hint:R[:W][:noise=N]\n"
               "                      (EMULATED engine hints of recall R in (0, 1], drawn from the routing's\n"
               "                      future; wrong ids W: uniform (default), recent (the next layer's recent\n"
               "                      choices) or coact; noise=N in [0, 1]: scored hints, those below 0.5 not\n"
               "                      fetched)\n"
               "  --prefetch-budget N speculative fills per layer and token (default top-k)\n"
               "  --two-ahead R,...   each hint row of --prefetch once more per R, also prefetching layer L+2\n"
               "                      at the same point from EMULATED hints of recall R in (0, 1] (the row's\n"
               "                      wrong ids and noise); rows labelled +ahead2:R; GPU only\n"
               "  --evict-last-forward the lookahead rows' prefetches may evict the cache's last forward\n"
               "                      (PrefetchOptions::evict_last_forward: a cache of top_k slots looks ahead)\n"
               "prompts (measured on a GPU, else MODELLED; docs/benchmarks.md \"Prompts\")\n"
               "  --prompt LIST       TTFT of prompts of these lengths (e.g. 128,512,2048,8192), each served as one\n"
               "                      wide forward per layer, next to the streaming bound and an all-resident prefill;\n"
               "                      --provider picks the caches: cached (the default), row, device (the device-planned\n"
               "                      cache, its groups planned and filled on the device; measured on a GPU only)\n"
               "  --prompt-trace FILE[:STEP]\n"
               "                      TTFT of a real prompt instead of --prompt's generated ones: the wide forward\n"
               "                      (every record of one step and layer, one record per token) of each layer at\n"
               "                      trace step STEP, default the first step with more than one record in a layer;\n"
               "                      STEP is the text after the last ':' when it is all digits. The trace's layers,\n"
               "                      ascending, are the model's: as many as --layers; its records must fit --experts\n"
               "                      and --topk. Its steps with one record in every layer are the decode steps\n"
               "                      (warm-up, mixed run), generated when it has none\n"
               "  --prompt-every K    also the mixed run: one prompt (the last length, or the trace's prompt) every K\n"
               "                      decode tokens over --steps tokens, decode tok/s and hit rate, scan resistant vs\n"
               "                      admit-everything\n"
               "  --stream-slots N    stream slots per layer of the prompt mode (default recommended_stream_slots)\n"
               "  --prompt-precision P bf16 (default: the prompt consumer's activations rounded to bf16, as an\n"
               "                      engine's prefill GEMM) or exact (fp32 activations as three bf16 terms)\n"
               "  --prompt-lists L    mapped (default: a round's pair and tile lists read by the kernels from mapped\n"
               "                      host memory) or copy (copied to device memory on the consumer stream)\n"
               "  --runtime R         auto (CUDA when built with it and a device exists), sim, cuda (default auto)\n"
               "  --sim-scale F       SimRuntime stores weights scaled down by F; times use the real bytes (1024)\n"
               "output\n"
               "  --json FILE         Google-Benchmark-compatible JSON (also --benchmark_out=FILE)\n"
               "  --progress          progress on stderr (default: only when stderr is a terminal)\n"
               "  --help              this text\n"
               "\n"
               "This build: %s.\n"
               "Exit status: 0 ok, 2 bad arguments or bad trace, 1 runtime failure.\n",
               cuda_built ? "CUDA path built (measured on a GPU, modelled otherwise)" : "host only (modelled)");
}

namespace detail {

inline std::int64_t parse_int(std::string_view flag, std::string_view text, std::int64_t lo, std::int64_t hi) {
  std::int64_t v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc() || r.ptr != text.data() + text.size()) {
    throw UsageError{std::string(flag) + ": '" + std::string(text) + "' is not an integer"};
  }
  if (v < lo || v > hi) {
    throw UsageError{std::string(flag) + ": " + std::to_string(v) + " is outside [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]"};
  }
  return v;
}

inline double parse_real(std::string_view flag, std::string_view text, double lo, double hi) {
  double v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc() || r.ptr != text.data() + text.size() || !(v >= lo && v <= hi)) {
    throw UsageError{std::string(flag) + ": '" + std::string(text) + "' must be a number in [" + std::to_string(lo) +
                     ", " + std::to_string(hi) + "]"};
  }
  return v;
}

inline std::vector<std::string> parse_list(std::string_view flag, std::string_view text,
                                           const std::vector<std::string>& known) {
  std::vector<std::string> out;
  for (const std::string_view item : split_commas(text)) {
    if (item == "all") {
      for (const std::string& k : known)
        if (std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
      continue;
    }
    if (std::find(known.begin(), known.end(), item) == known.end()) {
      std::string list;
      for (const std::string& k : known) list += " " + k;
      throw UsageError{std::string(flag) + ": unknown " + std::string(flag.substr(2)) + " '" + std::string(item) +
                       "' (available:" + list + ", all)"};
    }
    if (std::find(out.begin(), out.end(), item) == out.end()) out.emplace_back(item);
  }
  return out;
}

}  // namespace detail

inline BenchArgs parse_args(int argc, char** argv) {
  BenchArgs a;
  ArgCursor cursor(argc, argv);
  while (cursor.next()) {
    const std::string_view arg = cursor.name();
    auto value = [&] { return cursor.value(); };
    auto no_value = [&] { cursor.no_value(); };
    using detail::parse_int;
    if (arg == "--help" || arg == "-h") {
      no_value();
      a.help = true;
    } else if (arg == "--layers") {
      a.layers = static_cast<std::int32_t>(parse_int(arg, value(), 1, 4096));
      a.layers_given = true;
    } else if (arg == "--experts") {
      a.experts = static_cast<std::int32_t>(parse_int(arg, value(), 1, 1 << 16));
      a.experts_given = true;
    } else if (arg == "--topk") {
      a.top_k = static_cast<std::int32_t>(parse_int(arg, value(), 1, 1024));
      a.topk_given = true;
    } else if (arg == "--hidden") {
      a.hidden = parse_int(arg, value(), 64, 1 << 16);
    } else if (arg == "--intermediate") {
      a.intermediate = parse_int(arg, value(), 16, 1 << 16);
    } else if (arg == "--capacity") {
      a.capacity = static_cast<std::int32_t>(parse_int(arg, value(), 1, 1 << 16));
    } else if (arg == "--batch") {
      a.batch = static_cast<std::int32_t>(parse_int(arg, value(), 1, 16));
    } else if (arg == "--steps") {
      a.steps = static_cast<std::int32_t>(parse_int(arg, value(), 1, 1 << 20));
    } else if (arg == "--warmup") {
      a.warmup = static_cast<std::int32_t>(parse_int(arg, value(), 0, 1 << 20));
    } else if (arg == "--zipf") {
      a.zipf = detail::parse_real(arg, value(), 0.0, 10.0);
    } else if (arg == "--sticky") {
      a.sticky = detail::parse_real(arg, value(), 0.0, 1.0);
    } else if (arg == "--seed") {
      a.seed = static_cast<std::uint64_t>(parse_int(arg, value(), 0, INT64_MAX));
    } else if (arg == "--trace") {
      a.trace_path = std::string(value());
    } else if (arg == "--provider") {
      a.providers = detail::parse_list(arg, value(), provider_names());
    } else if (arg == "--staging") {
      a.staging = detail::parse_list(arg, value(), staging_names());
      a.staging_given = true;
    } else if (arg == "--runtime") {
      const std::string_view v = value();
      if (v == "auto") a.runtime = RuntimeChoice::automatic;
      else if (v == "sim") a.runtime = RuntimeChoice::sim;
      else if (v == "cuda") a.runtime = RuntimeChoice::cuda;
      else throw UsageError{"--runtime: '" + std::string(v) + "' is not auto, sim or cuda"};
    } else if (arg == "--sim-scale") {
      a.sim_scale = parse_int(arg, value(), 1, 1 << 20);
    } else if (arg == "--json" || arg == "--benchmark_out") {
      a.json_path = std::string(value());
      if (a.json_path->empty()) throw UsageError{std::string(arg) + " needs a file name"};
    } else if (arg == "--benchmark_out_format") {
      if (value() != "json") throw UsageError{"--benchmark_out_format: only json is written"};
    } else if (arg == "--progress") {
      no_value();
      a.progress = true;
    } else if (arg == "--overlap") {
      no_value();
      a.overlap = true;
    } else if (arg == "--one-pass") {
      no_value();
      a.one_pass = true;
    } else if (arg == "--fill-engine") {
      const std::string_view list = value();
      a.fill_engines.clear();
      for (const std::string_view item : split_commas(list)) {
        const std::string e(item);
        if (e == "all") {
          a.fill_engines = {"sm_loads", "copy_engine", "automatic"};
          break;
        }
        if (e != "sm_loads" && e != "copy_engine" && e != "automatic" && e != "split")
          throw UsageError{"--fill-engine: '" + e + "' in '" + std::string(list) +
                           "' (sm_loads, copy_engine, automatic, split or all)"};
        if (std::find(a.fill_engines.begin(), a.fill_engines.end(), e) == a.fill_engines.end()) a.fill_engines.push_back(e);
      }
    } else if (arg == "--device-policy") {
      const std::string_view list = value();
      a.device_policies.clear();
      for (const std::string_view item : split_commas(list)) {
        const std::string p(item);
        if (p.empty()) throw UsageError{"--device-policy: an empty name in '" + std::string(list) + "' (lru, lfru, crf or all)"};
        if (p == "all") {
          a.device_policies = {"lru", "lfru", "crf"};
          break;
        }
        if (p != "lru" && p != "lfru" && p != "crf")
          throw UsageError{"--device-policy: '" + p + "' is not lru, lfru, crf or all"};
        if (std::find(a.device_policies.begin(), a.device_policies.end(), p) == a.device_policies.end())
          a.device_policies.push_back(p);
      }
      a.device_policy = a.device_policies.front();
    } else if (arg == "--consumer-order") {
      const std::string v(value());
      if (v != "pairs" && v != "experts") throw UsageError{"--consumer-order: '" + v + "' is not pairs or experts"};
      a.consumer_order = v;
    } else if (arg == "--device-storage") {
      const std::string v(value());
      if (v != "tensor_major" && v != "expert_major")
        throw UsageError{"--device-storage: '" + v + "' is not tensor_major or expert_major"};
      a.device_storage = v;
    } else if (arg == "--overlap-parts") {
      const std::string v(value());
      if (v != "w13-first" && v != "whole") throw UsageError{"--overlap-parts: '" + v + "' is not whole or w13-first"};
      a.overlap_parts = v;
    } else if (arg == "--evict-last-forward") {
      a.evict_last_forward = true;
    } else if (arg == "--step-sync") {
      a.step_sync = true;
    } else if (arg == "--timeline") {
      a.timeline = true;
    } else if (arg == "--timeline-csv") {
      a.timeline_csv = std::string(value());
      if (a.timeline_csv.empty()) throw UsageError{"--timeline-csv needs a file prefix"};
    } else if (arg == "--prefetch-at") {
      const std::string v(value());
      if (v != "router" && v != "prepare" && v != "auto")
        throw UsageError{"--prefetch-at: '" + v + "' is not router, prepare or auto"};
      a.prefetch_at = v;
    } else if (arg == "--host-wait") {
      const std::string v(value());
      if (v != "auto" && v != "spin" && v != "yield" && v != "blocking")
        throw UsageError{"--host-wait: '" + v + "' is not auto, spin, yield or blocking"};
      a.host_wait = v;
    } else if (arg == "--crf-half-life") {
      const std::string v(value());
      char* end = nullptr;
      const double h = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || crf_decay_for_half_life(h) == 0)
        throw UsageError{"--crf-half-life: '" + v + "' is not a positive number of forwards"};
      a.crf_half_life = h;
    } else if (arg == "--fill-only") {
      no_value();
      a.fill_only = true;
    } else if (arg == "--budget") {
      no_value();
      a.budget = true;
      a.fill_only = true;
    } else if (arg == "--prefetch") {
      for (const std::string_view item : split_commas(value())) {
        const Result<PrefetchSpec> spec = parse_prefetch_spec(item);
        if (!spec.ok()) throw UsageError{"--prefetch: " + std::string(spec.status().message())};
        const std::string name = to_string(spec.value());
        if (std::find(a.prefetch.begin(), a.prefetch.end(), name) == a.prefetch.end()) a.prefetch.push_back(name);
      }
      if (a.prefetch.empty()) throw UsageError{"--prefetch needs a predictor (none, coact, prev, hint:R[:W][:noise=N])"};
    } else if (arg == "--two-ahead") {
      for (const std::string_view item : split_commas(value())) {
        const std::string v(item);
        const std::optional<double> r = expert_cache::detail::parse_fixed_decimal(v);
        if (!r || !(*r > 0.0 && *r <= 1.0)) throw UsageError{"--two-ahead: '" + v + "' is not a recall in (0, 1]"};
        if (std::find(a.two_ahead.begin(), a.two_ahead.end(), v) == a.two_ahead.end()) a.two_ahead.push_back(v);
      }
      if (a.two_ahead.empty()) throw UsageError{"--two-ahead needs a recall in (0, 1]"};
    } else if (arg == "--prefetch-budget") {
      a.prefetch_budget = static_cast<std::int32_t>(parse_int(arg, value(), 0, 1 << 16));
    } else if (arg == "--prompt") {
      a.prompts.clear();
      for (const std::string_view item : split_commas(value())) {
        a.prompts.push_back(static_cast<std::int32_t>(parse_int(arg, item, 1, 1 << 16)));
      }
      if (a.prompts.empty()) throw UsageError{"--prompt needs at least one prompt length"};
    } else if (arg == "--prompt-trace") {
      const std::string_view v = value();
      std::string_view path = v;
      a.prompt_trace_step.reset();
      if (const std::size_t colon = v.rfind(':'); colon != std::string_view::npos && colon + 1 < v.size() &&
                                                  std::all_of(v.begin() + static_cast<std::ptrdiff_t>(colon) + 1, v.end(),
                                                              [](char c) { return c >= '0' && c <= '9'; })) {
        a.prompt_trace_step = static_cast<std::int32_t>(parse_int("--prompt-trace STEP", v.substr(colon + 1), 0, INT32_MAX));
        path = v.substr(0, colon);
      }
      if (path.empty()) throw UsageError{"--prompt-trace needs a file name (FILE or FILE:STEP)"};
      a.prompt_trace_path = std::string(path);
    } else if (arg == "--prompt-every") {
      a.prompt_every = static_cast<std::int32_t>(parse_int(arg, value(), 1, 1 << 20));
    } else if (arg == "--stream-slots") {
      a.stream_slots = static_cast<std::int32_t>(parse_int(arg, value(), 2, 1 << 20));
    } else if (arg == "--prompt-precision") {
      const std::string_view v = value();
      if (v != "bf16" && v != "exact") throw UsageError{"--prompt-precision: '" + std::string(v) + "' (valid: bf16, exact)"};
      a.prompt_bf16 = v == "bf16";
    } else if (arg == "--prompt-lists") {
      const std::string_view v = value();
      if (v != "copy" && v != "mapped") throw UsageError{"--prompt-lists: '" + std::string(v) + "' (valid: copy, mapped)"};
      a.prompt_lists_copied = v == "copy";
    } else {
      throw UsageError{"unknown argument '" + std::string(arg) + "' (see --help)"};
    }
  }
  if (a.providers.empty()) a.providers = provider_names();
  return a;
}

// One configuration of the run: a provider and (for host-planned caches) a staging policy. The
// device provider (planned on the GPU, one CUDA graph per step) has no staging policy: it runs
// once, labelled "graph", whatever --staging lists; with --overlap a second time, labelled
// "overlap" (DeviceCacheOptions::overlap: the consumer waits per slot, fills overlap it).
inline constexpr const char* device_staging = "graph";
inline constexpr const char* device_overlap_staging = "overlap";
// --one-pass: DeviceCacheOptions::fill_by_consumer with MoeConsumer::run_one_pass (no fill node:
// the consumer reads each missing expert from mapped host memory and writes its slot).
inline constexpr const char* device_one_pass_staging = "one_pass";
inline constexpr const char* device_fill_only_staging = "fill_only";
// --fill-engine: a device row's staging label ends in the engine's suffix (sm_loads: none).
inline std::string fill_engine_suffix(std::string_view engine) {
  if (engine == "copy_engine") return "+ce";
  if (engine == "automatic") return "+auto";
  if (engine == "split") return "+split";
  return "";
}
// The engine of a device row's staging label, and the label without the suffix.
inline std::string_view fill_engine_of_staging(std::string_view staging) {
  if (staging.ends_with("+ce")) return "copy_engine";
  if (staging.ends_with("+auto")) return "automatic";
  if (staging.ends_with("+split")) return "split";
  return "sm_loads";
}
inline std::string staging_without_engine(std::string_view staging) {
  const auto plus = staging.rfind('+');
  return std::string(plus == std::string_view::npos ? staging : staging.substr(0, plus));
}
// --budget rows of the device provider (stages left out or doubled; outputs unchecked):
// router kernels only; router + plan (no fill, no consumer); fill_only with a second plan of the
// same ids on a shadow state in front of each layer's; the full step with the consumer twice.
inline constexpr const char* budget_router_staging = "budget:router";
inline constexpr const char* budget_plan_staging = "budget:router+plan";
inline constexpr const char* budget_plan_x2_staging = "budget:plan_x2";
inline constexpr const char* budget_consumer_x2_staging = "budget:consumer_x2";
inline bool budget_staging(const std::string& s) { return s.rfind("budget:", 0) == 0; }
// With --prefetch, the host-planned copy_stream rows are the lookahead baseline (prefetch
// "none") and each predictor adds a row after them ("coact", "prev", "hint:R").
inline constexpr const char* prefetch_staging = "copy_stream";
struct RunConfig {
  std::string provider;
  std::string staging;
  std::string prefetch;  // "" (no --prefetch), "none", or a predictor name
  // The device provider's planning policy; empty for the others. Named in the row's label
  // (device:lfru) unless the run plans LRU only, the default.
  std::string device_policy = {};
};

// The rows of a run name the device policy unless it is the default LRU alone.
inline bool device_policy_labelled(const BenchArgs& a) {
  return !(a.device_policies.size() == 1 && a.device_policies.front() == "lru");
}
inline std::string provider_label(const std::string& provider, const std::string& device_policy) {
  return device_policy.empty() ? provider : provider + ":" + device_policy;
}
// Calls f with a value of the device policy type that `name` names (lru, lfru, crf; validated
// with the arguments, anything else is lru).
template <class F>
decltype(auto) visit_device_policy(const std::string& name, F&& f) {
  if (name == "lfru") return f(DeviceLfru{});
  if (name == "crf") return f(DeviceCrf{});
  return f(DeviceLru{});
}
// The arguments one device row runs with: its policy as the policy.
inline BenchArgs with_device_policy(const BenchArgs& a, const RunConfig& c) {
  BenchArgs out = a;
  if (c.provider == "device" && !c.device_policy.empty()) out.device_policy = c.device_policy;
  return out;
}

inline bool prefetch_provider(const std::string& p) { return p == "row" || p == "cached"; }

// "resident", "cached/copy_stream", "cached/copy_stream+coact" (progress lines).
inline std::string run_label(const RunConfig& c) {
  if (c.provider == "resident") return "resident";
  std::string s = provider_label(c.provider, c.device_policy) + "/" + c.staging;
  if (!c.prefetch.empty() && c.prefetch != "none") s += "+" + c.prefetch;
  return s;
}

// A lookahead row that also prefetches layer L+2: "SPEC" + two_ahead_marker + "R" (lookahead.hpp).
inline constexpr std::string_view two_ahead_marker = "+ahead2:";
// Whether a --prefetch name is an emulated hint (hint:R...), the only predictor --two-ahead extends.
inline bool hint_spec(const std::string& spec) { return spec.rfind("hint", 0) == 0; }
// The lookahead rows after a row's "none" baseline: each predictor of --prefetch, each hint one
// followed by its --two-ahead twins ("hint:0.9:recent:noise=0.3+ahead2:0.7").
inline std::vector<std::string> row_prefetches(const BenchArgs& a) {
  std::vector<std::string> out;
  for (const std::string& spec : a.prefetch) {
    if (spec == "none") continue;
    out.push_back(spec);
    if (!hint_spec(spec)) continue;
    for (const std::string& r : a.two_ahead) out.push_back(spec + std::string(two_ahead_marker) + r);
  }
  return out;
}

inline std::vector<RunConfig> run_configs(const BenchArgs& a, const std::vector<std::string>& staging) {
  std::vector<RunConfig> out;
  for (const std::string& p : a.providers) {
    if (p == "resident") continue;
    if (p == "device") {
      // Every row once per device policy (--device-policy), the policies one after the other.
      // With --prefetch every device row has a lookahead twin per predictor (prefetch() on the
      // device from a side stream of the captured step; measured runs only).
      for (const std::string& policy : a.device_policies) {
        const std::string dp = device_policy_labelled(a) ? policy : std::string();
        for (const std::string& engine : a.fill_engines) {
          const std::string suffix = fill_engine_suffix(engine);
          // split: the overlap row only (speculate_on_copy_engine needs overlap).
          if (engine == "split") {
            if (!a.overlap) continue;
            out.push_back({p, device_overlap_staging + suffix, a.prefetch.empty() ? "" : "none", dp});
            for (const std::string& spec : row_prefetches(a))
              out.push_back({p, device_overlap_staging + suffix, spec, dp});
            continue;
          }
          // The time budget's rows once per engine (its table is given per engine).
          if (a.budget) {
            out.push_back({p, budget_router_staging + suffix, "", dp});
            out.push_back({p, budget_plan_staging + suffix, "", dp});
            out.push_back({p, budget_plan_x2_staging + suffix, "", dp});
            out.push_back({p, budget_consumer_x2_staging + suffix, "", dp});
          }
          if (a.fill_only) out.push_back({p, device_fill_only_staging + suffix, "", dp});
          std::vector<std::string> rows{device_staging};
          if (a.overlap) rows.emplace_back(device_overlap_staging);
          // The one-pass consumer reads host memory with SM loads: no copy-engine twin.
          if (a.one_pass && engine != "copy_engine") rows.emplace_back(device_one_pass_staging);
          for (const std::string& s : rows) {
            out.push_back({p, s + suffix, a.prefetch.empty() ? "" : "none", dp});
            for (const std::string& spec : row_prefetches(a)) out.push_back({p, s + suffix, spec, dp});
          }
        }
      }
      continue;
    }
    for (const std::string& s : staging) {
      const bool lookahead = !a.prefetch.empty() && s == prefetch_staging && prefetch_provider(p);
      out.push_back({p, s, lookahead ? "none" : ""});
      if (!lookahead) continue;
      for (const std::string& spec : row_prefetches(a)) out.push_back({p, s, spec});
    }
  }
  // The all-resident run goes first: the ratios need it, and it is the cheapest.
  if (std::find(a.providers.begin(), a.providers.end(), "resident") != a.providers.end())
    out.insert(out.begin(), RunConfig{"resident", "-", ""});
  return out;
}

}  // namespace expert_cache::bench
