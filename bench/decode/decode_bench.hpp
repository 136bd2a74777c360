#pragma once
// expert-cache-bench, the part every build shares (host-only). bench/programs/expert_cache_bench.cpp (host
// build) and bench/programs/expert_cache_bench.cu (CUDA build, adds the measured GPU path) include this
// header and call bench_main(). One header per job under bench/decode/:
//   args.hpp          arguments, --help, the run configurations they select
//   model.hpp         the synthetic NVFP4 model and the routing (trace file or generator)
//   report.hpp        result rows and the text table
//   json_report.hpp   Google-Benchmark-compatible JSON
//   progress.hpp      progress lines on stderr
//   modelled_run.hpp  the MODELLED run on SimRuntime with a cost model
//   modelled_device.hpp  the device provider's MODELLED run (DeviceExpertCache on SimRuntime)
//   prompt_trace.hpp  the prompt mode's routing: generated, or a trace's prompt (--prompt-trace)
//   prompt_run.hpp    the prompt mode's MODELLED tables (--prompt, --prompt-trace, --prompt-every)
//   main.hpp          bench_main: validate, run (measured or modelled), report
//
// The decode loop is the same on both runtimes. Per step (B tokens) and MoE layer:
//   1. the host waits for the consumer stream (an engine reads the routing ids back here: vLLM's
//      providers sync once per layer), then uploads the ids on the consumer stream,
//   2. cache.prepare(ids, consumer) makes the experts resident (copies on the fill stream),
//   3. the consumer reads the experts through the slot buffers and the forward map.
// The "resident" provider is the same loop without a cache: every expert in HBM (upper bound).
// The "device" provider plans on the device: the ids never reach the host, each step is one
// replay of a graph captured once (router stand-in -> prepare -> consumer per layer).
#include "args.hpp"
#include "json_report.hpp"
#include "main.hpp"
#include "model.hpp"
#include "modelled_device.hpp"
#include "modelled_run.hpp"
#include "progress.hpp"
#include "report.hpp"
