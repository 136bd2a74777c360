#pragma once
/// The device plan, whole: an umbrella that includes every part under planning/device_plan/, so one include gives the
/// state, the policies and every planning step.
//
// Device-side forward planning: the LRU planning step written once as __host__ __device__ code
// over a flat state of plain arrays, so the CPU suite runs the very algorithm the CUDA kernel
// runs (these headers + SequentialBlock on the host, kernels/plan_kernels.cuh + plan_block.cuh's CubBlock on the
// GPU). Its decisions equal ForwardPlanner<Lru> exactly: the same hits, misses, victims, slots,
// fill and eviction lists, resident map and forward map after every step
// (tests/host/test_device_plan.cpp, tests/gpu/test_device_plan.cu); with DeviceLfru and DeviceCrf
// those of ForwardPlanner<Lfru> and ForwardPlanner<Crf> (tests/host/test_device_policies.cpp).
//
// The parts, each including only parts listed above it:
//   state.hpp         DevicePlanState and its vocabulary, its one-allocation layout, its checks
//   policies.hpp      DeviceLru, DeviceLfru, DeviceCrf, DeviceRuntimePolicy, their victim keys
//   block.hpp         plan_block (what the planning code needs from its threads), SequentialBlock
//   readiness.hpp     per-slot readiness: SlotReadiness, slot_seq_reached
//   victims.hpp       the victim search's keys (VictimChunk), when a group ranks them (plan_by_rank)
//   reset.hpp         reset_plan_state, plan_invalidate
//   group.hpp         the group step: plan_group (overflow and the recency tick explained there)
//   forward.hpp       plan_forward: deduplication, the small and the general path
//   prefetch.hpp      plan_prefetch: speculative fills
//   host_storage.hpp  HostPlanStorage, plan_set_bias (host only)
//
// Host-compilable with g++ alone (no CUDA headers); under nvcc every function here is
// __host__ __device__.
#include "expert_cache/planning/device_plan/block.hpp"
#include "expert_cache/planning/device_plan/forward.hpp"
#include "expert_cache/planning/device_plan/group.hpp"
#include "expert_cache/planning/device_plan/host_storage.hpp"
#include "expert_cache/planning/device_plan/policies.hpp"
#include "expert_cache/planning/device_plan/prefetch.hpp"
#include "expert_cache/planning/device_plan/readiness.hpp"
#include "expert_cache/planning/device_plan/reset.hpp"
#include "expert_cache/planning/device_plan/state.hpp"
#include "expert_cache/planning/device_plan/victims.hpp"
