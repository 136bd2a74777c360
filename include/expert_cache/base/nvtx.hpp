#pragma once
/// Optional NVTX ranges (Nsight Systems) around prepare(), invalidate() and the staging fills.
// Off by default and then free: EXPERT_CACHE_NVTX_RANGE expands to nothing. Define
// EXPERT_CACHE_NVTX (for the whole program: every translation unit must agree, the ranges sit
// in inline functions) to get a scoped range per call from the CUDA toolkit's header-only NVTX3
// (<nvtx3/nvToolsExt.h>; needs CUDA's include directory, no library).
#include "expert_cache/base/config.hpp"

#if defined(EXPERT_CACHE_NVTX)
#include <nvtx3/nvToolsExt.h>

namespace expert_cache::inline v0::detail {

// Pushes a range on construction, pops it at scope exit (also on early returns).
class NvtxRange {
 public:
  explicit NvtxRange(const char* name) noexcept { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace expert_cache::inline v0::detail

#define EXPERT_CACHE_NVTX_RANGE(name) \
  const ::expert_cache::detail::NvtxRange EXPERT_CACHE_PP_CAT(expert_cache_nvtx_range_, __LINE__)(name)
#else
#define EXPERT_CACHE_NVTX_RANGE(name) static_cast<void>(0)
#endif
