// The code block of docs/any_cache.md, in a function whose parameters are what the block takes
// from the engine (its runtime, ids and stream), instantiated for SimRuntime. examples/meson.build
// compiles this file with warnings as errors and does not run it: the block's 512 NVFP4 experts
// would take more host memory than a test should. tests/headers/check_doc_snippets.py checks
// that the block equals the marked region.
#include <cstdint>
#include <span>
#include <utility>

#include "expert_cache/any/any_cache.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"

namespace doc_snippets {

// docs/any_cache.md, the opening example.
template <class Runtime>
void any_cache(Runtime& runtime, std::span<const std::int32_t> topk_ids, typename Runtime::Stream stream) {
  // [any_cache]
  expert_cache::AnyCacheConfig c;
  c.provider = "cached";                          // row | cached | device
  c.policy = "s3fifo";                            // "" = the provider's default
  c.staging = "";                                 // inline | copy_stream | batched | gather (CUDA)
  c.layout = expert_cache::AnyLayout::of(expert_cache::Nvfp4Marlin{.hidden = 2048, .intermediate = 768});
  c.options.num_experts = 512; c.options.capacity = 208; c.options.top_k = 10;
  auto made = expert_cache::make_expert_cache(runtime, c);   // Result<AnyExpertCache<Runtime>>
  if (!made.ok()) { /* made.status(): invalid_argument, the message lists the valid names */ }
  auto cache = std::move(made.value());
  auto view = cache.prepare(topk_ids, stream);    // Result<ForwardView>, as ExpertCache
  // [any_cache]
}

template void any_cache<expert_cache::SimRuntime>(expert_cache::SimRuntime&, std::span<const std::int32_t>,
                                                  expert_cache::SimRuntime::Stream);

}  // namespace doc_snippets
