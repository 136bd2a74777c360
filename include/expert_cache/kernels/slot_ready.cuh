#pragma once
/// Bounded device-side waits: the per-slot readiness wait and the timer every spin-wait uses.
// Bounded device-side waits (needs nvcc): the consumer's per-slot readiness wait of the
// device-planned cache's overlapped fill (edge D4 of docs/design.md), and the timer every
// spin-wait of the library's kernels uses so that none of them can hang.
//
// A spin gives up after its timeout (default about 1.5 s of %globaltimer), sets
// plan_error_wait_timeout in the cache's error word (mapped host memory: a relaxed system-scope
// load + store, the host has no native atomics over PCIe; a lost bit of a concurrent timeout
// is harmless, one is enough) and returns false; the caller goes on (its result is then not
// trustworthy, and the host sees the error word) instead of hanging the GPU.
#if !defined(__CUDACC__)
#error "expert_cache/kernels/slot_ready.cuh needs nvcc"
#endif

#include <cuda/atomic>

#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/planning/device_plan/readiness.hpp"
#include "expert_cache/planning/device_plan/state.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

inline constexpr std::uint64_t default_wait_timeout_ns = 1'500'000'000ull;

__device__ __forceinline__ std::uint64_t global_timer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void flag_wait_timeout(std::uint32_t* error_word) {
  if (error_word == nullptr) return;
  cuda::atomic_ref<std::uint32_t, cuda::thread_scope_system> a(*error_word);
  a.store(a.load(cuda::memory_order_relaxed) | plan_error_wait_timeout, cuda::memory_order_relaxed);
}

// Spins (one thread) until done() is true, with __nanosleep backoff (32 ns doubling to 1 us:
// a fill takes tens of microseconds, so the wake-up delay stays small against it). false: the
// timeout passed; flagged in error_word.
template <class Done>
__device__ __forceinline__ bool bounded_spin(Done done, std::uint64_t timeout_ns, std::uint32_t* error_word) {
  if (done()) return true;
  const std::uint64_t start = global_timer_ns();
  const std::uint64_t limit = timeout_ns != 0 ? timeout_ns : default_wait_timeout_ns;
  unsigned sleep_ns = 32;
  while (!done()) {
    if (global_timer_ns() - start > limit) {
      flag_wait_timeout(error_word);
      return false;
    }
    __nanosleep(sleep_ns);
    if (sleep_ns < 1024) sleep_ns *= 2;
  }
  return true;
}

// One thread: waits until slot `slot` holds the bytes this forward needs (acquire on its ready
// word). A slot outside [0, capacity) is not waited for (the consumer never reads it). The
// caller follows with a block barrier, so every thread's later loads of the slot are ordered
// after the acquire (causality through bar.sync), and reads the slot with coherent loads
// (ld.global.cg: never the non-coherent path, whose contract is memory that no one writes
// while the kernel runs).
// `first_part`: the reader reads only the fill's first part (edge D4c): it waits on
// ready_first when the view has it.
__device__ __forceinline__ bool wait_slot_ready(const SlotReadiness& r, std::int32_t slot, bool first_part = false) {
  if (!r.enabled() || slot < 0 || slot >= r.capacity) return true;
  // Written by the plan kernel, which completed before the fill kernel started (this kernel
  // started after that): ordered; read past L1 all the same.
  const std::uint32_t want = __ldcg(r.needed + slot);
  const std::uint32_t* word = first_part && r.ready_first != nullptr ? r.ready_first : r.ready;
  cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device> ready(const_cast<std::uint32_t&>(word[slot]));
  return bounded_spin([&] { return slot_seq_reached(ready.load(cuda::memory_order_acquire), want); }, r.timeout_ns,
                      r.error_word);
}

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
