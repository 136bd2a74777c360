#pragma once
// expert-cache-bench: the driver both builds call (bench_main): arguments and routing are
// validated first, then the measured GPU path (GpuHooks, CUDA build) or the modelled one runs,
// and the table (and --json) is written. Host-only.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <tuple>

#include "args.hpp"
#include "json_report.hpp"
#include "model.hpp"
#include "modelled_run.hpp"
#include "progress.hpp"
#include "prompt_run.hpp"
#include "report.hpp"

namespace expert_cache::bench {

// The CUDA build passes a measured path: nullopt = no usable device (falls back to modelled).
struct GpuHooks {
  bool built = false;
  std::function<bool(std::string& why)> device_available;
  std::function<Report(const Model&, const Routing&, const BenchArgs&, Progress&)> run;
  // --prompt / --prompt-trace measured (exit code); the trace is null for generated prompts.
  std::function<int(const Model&, const BenchArgs&, const PromptTrace*)> prompt;
};

inline int bench_main(int argc, char** argv, const GpuHooks& gpu) {
  BenchArgs args;
  Model model;
  Routing routing;
  std::optional<PromptTrace> prompt_trace;
  bool use_gpu = false;
  try {
    args = parse_args(argc, argv);
    if (args.help) {
      print_help(stdout, gpu.built);
      return exit_ok;
    }
    if (args.runtime == RuntimeChoice::cuda && !gpu.built) {
      throw UsageError{"--runtime cuda: this build has no CUDA path (configure with -Dcuda=enabled)"};
    }
    // Arguments and the routing are validated completely before any device work.
    std::tie(model, routing) = build_model_and_routing(args);
    if (args.prompt_trace_path) {
      if (!args.prompts.empty()) throw UsageError{"--prompt-trace and --prompt: give one (a trace's prompt or generated ones)"};
      prompt_trace = load_prompt_trace(*args.prompt_trace_path, args.prompt_trace_step, model);
    }
    if (args.prompt_every > 0 && args.prompts.empty() && !prompt_trace)
      throw UsageError{"--prompt-every needs --prompt or --prompt-trace"};
    if (args.runtime != RuntimeChoice::sim && gpu.built) {
      std::string why;
      use_gpu = gpu.device_available(why);
      if (!use_gpu && args.runtime == RuntimeChoice::cuda) throw UsageError{"--runtime cuda: no usable CUDA device (" + why + ")"};
    }
    if (args.overlap) {
      if (std::find(args.providers.begin(), args.providers.end(), "device") == args.providers.end())
        throw UsageError{"--overlap needs the device provider (--provider device or all)"};
      if (!use_gpu)
        throw UsageError{"--overlap needs the CUDA runtime (a GPU): the modelled run has no model of the overlap"};
    }
    if (args.one_pass) {
      if (std::find(args.providers.begin(), args.providers.end(), "device") == args.providers.end())
        throw UsageError{"--one-pass needs the device provider (--provider device or all)"};
      if (!use_gpu) throw UsageError{"--one-pass needs the CUDA runtime (a GPU): the modelled run has no one-pass consumer"};
    }
    if (args.fill_engines != std::vector<std::string>{"sm_loads"}) {
      if (std::find(args.providers.begin(), args.providers.end(), "device") == args.providers.end())
        throw UsageError{"--fill-engine needs the device provider (--provider device or all)"};
      if (!use_gpu) throw UsageError{"--fill-engine needs the CUDA runtime (a GPU): the modelled run has no proxy"};
      if (std::find(args.fill_engines.begin(), args.fill_engines.end(), "split") != args.fill_engines.end() && !args.overlap)
        throw UsageError{"--fill-engine split needs --overlap (forwards then wait per slot for the speculative copies)"};
    }
    if (args.device_storage != "tensor_major") {
      if (args.overlap_parts == "w13-first")
        throw UsageError{"--device-storage expert_major cannot take --overlap-parts w13-first: a fill is one copy, "
                         "so no part lands first"};
      if (!args.prompts.empty() || args.prompt_trace_path)
        throw UsageError{"--device-storage sets the decode run's device rows; the prompt run's device rows are "
                         "tensor-major (leave out --prompt and --prompt-trace)"};
      if (!use_gpu)
        throw UsageError{"--device-storage needs the CUDA runtime (a GPU): it sets the measured device rows' storage"};
    }
    if (args.host_wait != "auto" && !use_gpu)
      throw UsageError{"--host-wait needs the CUDA runtime (a GPU): the modelled run does not wait for a device"};
    if (!args.timeline_csv.empty() && !args.timeline) throw UsageError{"--timeline-csv needs --timeline"};
    if ((args.timeline || args.step_sync) && !use_gpu)
      throw UsageError{std::string(args.timeline ? "--timeline" : "--step-sync") +
                       " needs the CUDA runtime (a GPU): the modelled run has no device step"};
    if (args.prefetch_at != "prepare" && (args.prefetch.empty() || !use_gpu))
      throw UsageError{"--prefetch-at needs --prefetch and the CUDA runtime (a GPU): it places the device rows' prefetch"};
    if (args.fill_only) {
      const char* flag = args.budget ? "--budget" : "--fill-only";
      if (std::find(args.providers.begin(), args.providers.end(), "device") == args.providers.end())
        throw UsageError{std::string(flag) + " needs the device provider (--provider device or all)"};
      if (!use_gpu) throw UsageError{std::string(flag) + " needs the CUDA runtime (a GPU)"};
    }
    if (args.evict_last_forward && args.prefetch.empty())
      throw UsageError{"--evict-last-forward needs --prefetch: it sets the lookahead rows' prefetches"};
    if (!args.two_ahead.empty() &&
        std::none_of(args.prefetch.begin(), args.prefetch.end(), hint_spec))
      throw UsageError{"--two-ahead needs a hint predictor in --prefetch (hint:R...): layer L+2's lists are emulated hints "
                       "with that row's wrong ids and noise"};
    if (!args.prefetch.empty() || args.prefetch_budget) {
      if (args.prefetch.empty()) throw UsageError{"--prefetch-budget needs --prefetch"};
      const bool host_planned = std::any_of(args.providers.begin(), args.providers.end(), prefetch_provider);
      const bool device = std::find(args.providers.begin(), args.providers.end(), "device") != args.providers.end();
      if (!host_planned && !(device && use_gpu))
        throw UsageError{"--prefetch needs a host-planned provider (--provider row or cached), or the device provider "
                         "on the CUDA runtime (the modelled run has no device lookahead)"};
      if (host_planned && args.staging_given &&
          std::find(args.staging.begin(), args.staging.end(), std::string(prefetch_staging)) == args.staging.end())
        throw UsageError{"--prefetch needs --staging copy_stream (the staging whose fills run on the copy stream, so "
                         "speculative fills overlap the consumer)"};
    }
    for (const std::string& s : args.staging) {
      if (s == "gather" && !use_gpu) {
        throw UsageError{"--staging gather needs the CUDA runtime (a GPU); the modelled run has inline, copy_stream, batched"};
      }
    }
    if (args.json_path) {  // fail before the run, not after it
      std::ofstream probe(*args.json_path, std::ios::app);
      if (!probe) throw UsageError{"--json: cannot write '" + *args.json_path + "'"};
    }
  } catch (const UsageError& e) {
    std::fprintf(stderr, "expert-cache-bench: %s\n(run with --help for usage)\n", e.message.c_str());
    return exit_usage;
  }

  if (!args.prompts.empty() || prompt_trace) {  // measured on a GPU (prompt_measured.cuh), else modelled (prompt_run.hpp)
    const PromptTrace* trace = prompt_trace ? &*prompt_trace : nullptr;
    try {
      if (use_gpu && gpu.prompt) return gpu.prompt(model, args, trace);
      return run_prompt_mode(model, args, trace);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "expert-cache-bench: prompt run failed: %s\n", e.what());
      return exit_failure;
    }
  }
  const bool tty = stderr_is_tty();
  Progress progress(args.progress || tty, tty);
  Report rep;
  try {
    rep = use_gpu ? gpu.run(model, routing, args, progress) : run_modelled(model, routing, args, progress);
  } catch (const UsageError& e) {
    progress.finish();
    std::fprintf(stderr, "expert-cache-bench: %s\n", e.message.c_str());
    return exit_usage;
  } catch (const std::exception& e) {
    progress.finish();
    std::fprintf(stderr, "expert-cache-bench: run failed: %s\n", e.what());
    return exit_failure;
  }
  rep.model = model;
  rep.routing = routing.source;
  rep.steps = args.steps;
  rep.warmup = args.warmup;
  rep.prefetch_budget = prefetch_budget(args, model);
  rep.prefetch_at = args.prefetch_at;
  rep.evict_last_forward = args.evict_last_forward;
  print_table(stdout, rep);
  std::fflush(stdout);
  if (args.json_path) {
    std::ofstream out(*args.json_path, std::ios::binary | std::ios::trunc);
    write_json(out, rep, argc > 0 ? argv[0] : "expert-cache-bench");
    out.close();
    if (!out) {
      std::fprintf(stderr, "expert-cache-bench: error writing '%s'\n", args.json_path->c_str());
      return exit_failure;
    }
  }
  for (const RunResult& r : rep.runs)
    if (r.check_failures != 0) return exit_failure;
  return exit_ok;
}

}  // namespace expert_cache::bench
