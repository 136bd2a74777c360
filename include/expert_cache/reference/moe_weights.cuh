#pragma once
/// The reference consumers' view of the experts: MoeWeights (where a slot's tensors live and which
/// slot holds an expert) and MoeHostSource (the one-pass mode's host copies of the missing experts),
/// with their builders from a cache's forward view and host storage.
#if !defined(__CUDACC__)
#error "expert_cache/reference/moe_weights.cuh needs nvcc"
#endif

#include <cstddef>
#include <cstdint>

#include "expert_cache/base/config.hpp"
#include "expert_cache/base/tensor_bytes.hpp"

namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS {

// Where the six tensors of a slot live and which slot holds an expert. Built from a cache's
// ForwardView (moe_weights_from_view) or from all-resident arrays (slot = expert, identity map).
struct MoeWeights {
  const unsigned char* base[num_expert_tensors] = {};
  unsigned long long stride[num_expert_tensors] = {};  // bytes from slot s to s + 1
  const std::int32_t* expert_map = nullptr;             // [num_experts]: slot or -1
  std::int32_t num_experts = 0;
};

// The one-pass mode's source of the missing experts (MoeConsumer::run_one_pass): the experts'
// host copies, expert-major per tensor as a cache's host storage lays them out (tensor t of
// expert e at base[t] + e * stride[t]), as DEVICE addresses (mapped pinned host memory:
// cudaHostGetDevicePointer of a cudaHostAlloc(Mapped) / cudaHostRegister(Mapped) buffer; device
// memory works too), and which experts this run reads from there: missing[e] != 0 (device
// memory, [num_experts], written before the consumer's first kernel starts). A missing expert
// must have its slot in the map (the slot a fill would have filled); that slot is written.
struct MoeHostSource {
  const unsigned char* base[num_expert_tensors] = {};
  unsigned long long stride[num_expert_tensors] = {};  // bytes from expert e to e + 1
  const std::int32_t* missing = nullptr;                // [num_experts]: non-zero = read from host, write the slot
};

template <class View>
MoeWeights moe_weights_from_view(const View& view, std::int32_t num_experts) noexcept {
  MoeWeights w;
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    w.base[t] = reinterpret_cast<const unsigned char*>(view.tensors[t].base);
    w.stride[t] = view.tensors[t].slot_stride;
  }
  w.expert_map = view.expert_map;
  w.num_experts = num_experts;
  return w;
}

// The one-pass source of a cache's host pools (a storage with tensors() and host_tensor(t, e),
// expert-major per tensor: tensor t of expert e at host_tensor(t, 0) + e * stride) and the
// missing flags of its view (DeviceCacheOptions::fill_by_consumer: ForwardView::missing). The
// pools' host pointers are their device addresses where the pinned pools are mapped with unified
// addressing (check_host_source says so, once, outside capture).
template <class Storage>
MoeHostSource moe_host_source_from(const Storage& storage, std::int32_t num_experts, const std::int32_t* missing) noexcept {
  MoeHostSource h;
  for (std::size_t t = 0; t < num_expert_tensors; ++t) {
    const std::size_t bytes = storage.tensors()[t].bytes_per_expert;
    if (bytes == 0) continue;
    const auto* first = reinterpret_cast<const unsigned char*>(storage.host_tensor(t, 0));
    h.base[t] = first;
    h.stride[t] = num_experts > 1
                      ? static_cast<unsigned long long>(reinterpret_cast<const unsigned char*>(storage.host_tensor(t, 1)) - first)
                      : bytes;
  }
  h.missing = missing;
  return h;
}

}  // namespace expert_cache::inline v0::device::inline EXPERT_CACHE_ARCH_NS
