// expert-cache-bench, host build: the decode-loop benchmark, MODELLED on SimRuntime (no GPU
// needed). The CUDA build compiles bench/programs/expert_cache_bench.cu instead, which adds the measured
// path and falls back to this one without a device. Everything shared is in decode_bench.hpp.
#include <cstdio>
#include <exception>

#include "../decode/decode_bench.hpp"

int main(int argc, char** argv) {
  try {
    return expert_cache::bench::bench_main(argc, argv, expert_cache::bench::GpuHooks{});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "expert-cache-bench: internal error: %s\n", e.what());
    return 1;
  }
}
