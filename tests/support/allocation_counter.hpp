#pragma once
// Counts every heap allocation of the program so a test or benchmark can prove a hot path
// makes none. Replaces the global operator new/delete: include it in exactly ONE translation
// unit per executable.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace expert_cache::test {
inline std::atomic<std::uint64_t> g_allocations{0};
}  // namespace expert_cache::test

// noinline: once inlined, GCC pairs `delete` with the malloc below and warns (false positive).
[[gnu::noinline]] void* operator new(std::size_t size) {
  expert_cache::test::g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return operator new(size); }
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
