#pragma once
/// The SimRuntime executor of DeviceExpertCache (BasicSimPlanExecutor, SimPlanExecutor and
/// DevicePlanExecutorFor<SimRuntime>): each device step is a simulated launch that runs the shared
/// planning code with SequentialBlock and declares what it touches, so the race detector checks
/// the cache's ordering without a GPU.
#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "expert_cache/base/status.hpp"
#include "expert_cache/device_cache/executor.hpp"
#include "expert_cache/device_cache/options.hpp"
#include "expert_cache/planning/device_plan.hpp"
#include "expert_cache/runtime/resources.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"
#include "expert_cache/storage/copy_region.hpp"

namespace expert_cache::inline v0 {

// The plan state in SimRuntime memory (device kind; the stats mirror and error word in
// pinned_host, as on the GPU). Each device step is one `launch` op whose body runs the shared
// planning code with SequentialBlock at completion, declaring what it touches:
//   plan:  reads the ids [ids, ids + n) and every state array; writes every state array (maps,
//          fill list, eviction list, scalars, counters), the stats mirror, the error word and
//          the sanitized ids. Declared per array, from the state view.
//   fill:  reads the fill list and the scalars (fill_count), reads the WHOLE host pool of every
//          copy region and writes the WHOLE slot buffer of every region. Whole, not per fill:
//          the rows are chosen by the plan op, which completes after this op is enqueued, and a
//          simulated launch declares its ranges at enqueue. It is also the real contract: the
//          host cannot know which slots a device-planned fill writes, so the ordering must
//          cover every slot (edge 1 orders all of the previous owner's readers before it).
//   overlapped fill (options.overlap, edge D4): the fill runs off the caller's stream X, so that
//          only the ready words order a consumer after it. One lane stream per slot j: the lane
//          waits for an event recorded on X after the plan, runs "fill slot j" (declares the
//          write of slot j's rows in every region and of slot_ready[j]; copies if the fill list
//          has slot j, then stores slot_ready[j] = slot_needed[j]) and records ready_event(j),
//          which stands for the ready word's release store. A consumer waits for
//          ready_event(j) before it reads slot j (the acquire). A lane's write is declared
//          even when this step does not fill slot j (conservative: the host does not know the
//          plan). join_fills() (the cache calls it before its next call, so before the core's
//          records on X) makes X wait for every lane: on the GPU the next kernels on X run
//          after the fill grid, because a readiness consumer waits for it before it completes.
//   copy engine (FillEngine::copy_engine, docs/design.md "Copy-engine fills"): the proxy is an
//          agent of its own, one stream P per cache. A fill is a post op on X (reads the fill list,
//          the scalars and slot_needed; writes the ring entry seq % proxy_ring_depth), recorded
//          as `posted` (edge P1); P waits for it, runs "take" (reads that entry; its `taken` event
//          frees the entry for the post that reuses it, the ring-room wait), then "copy" (reads the
//          WHOLE pools, writes the WHOLE slots and every ready word: the list is the device's), and
//          records `proxy_done` (edge P2: the ready words after the bytes). Without overlap X waits
//          for `proxy_done` (the post kernel's wait for the ready words); with overlap a consumer's
//          ready_event(j) is `proxy_done`. Prefetches post without the wait. The knobs
//          test_post_before_list (P1 removed) and test_ready_before_copy (P2 removed) record the
//          events early; test_fail_copies makes "copy" skip its bytes, flag plan_error_fill_failed
//          and publish the ready words, and the next call return the failure. P is a host-issued
//          stream (SimRuntime::set_host_issued): the executor's destructor waits for it (edge P4);
//          test_skip_shutdown_wait removes that wait, and freeing the slots under its pending
//          copy is then reported.
//   speculate_on_copy_engine (with overlap): prefetches post to the proxy as above, forwards
//          fill on the lanes. Each lane first waits for `proxy_done` (edge P6: a slot's pending
//          speculative copy, and its ready-word store, land before the lane writes the slot; on the
//          GPU per slot, for the tag the post stored); its ready_event(j) then follows both.
//          test_skip_pending_copy_wait removes that wait.
//
// Overlap = false: no overlapped fill is compiled and options.overlap is refused
// (ErrorCode::invalid_argument): make_expert_cache's executor, whose config has no overlap.
template <device_plan_policy Policy, bool Overlap = true>
class BasicSimPlanExecutor {
 public:
  using Stream = SimRuntime::Stream;

  BasicSimPlanExecutor(SimRuntime& rt, std::int32_t num_experts, std::int32_t capacity, std::int32_t max_ids,
                       const CopyRegions& regions, const DeviceCacheOptions& options /* fused: always two ops here */)
    requires(!std::same_as<Policy, DeviceRuntimePolicy>)
      : BasicSimPlanExecutor(rt, num_experts, capacity, max_ids, regions, options, Policy::kind, Bound{}) {}
  // DeviceRuntimePolicy: `kind` is the policy it plans with.
  BasicSimPlanExecutor(SimRuntime& rt, std::int32_t num_experts, std::int32_t capacity, std::int32_t max_ids,
                       const CopyRegions& regions, const DeviceCacheOptions& options, DevicePolicyKind kind)
    requires std::same_as<Policy, DeviceRuntimePolicy>
      : BasicSimPlanExecutor(rt, num_experts, capacity, max_ids, regions, options, kind, Bound{}) {}

 private:
  struct Bound {};
  [[gnu::cold]]
  BasicSimPlanExecutor(SimRuntime& rt, std::int32_t num_experts, std::int32_t capacity, std::int32_t max_ids,
                       const CopyRegions& regions, const DeviceCacheOptions& options, DevicePolicyKind kind, Bound)
      : rt_(&rt),
        overlap_(options.overlap),
        by_consumer_(options.fill_by_consumer),
        copy_engine_(options.fill_engine == FillEngine::copy_engine),
        speculate_on_proxy_(!copy_engine_ && options.speculate_on_copy_engine),
        skip_pending_copy_wait_(options.test_skip_pending_copy_wait),
        post_before_list_(options.test_post_before_list),
        ready_before_copy_(options.test_ready_before_copy),
        fail_copies_(options.test_fail_copies),
        skip_shutdown_wait_(options.test_skip_shutdown_wait),
        block_(rt, plan_state_bytes(num_experts, capacity), MemoryKind::device),
        words_(rt, sizeof(MappedWords), MemoryKind::pinned_host),
        sanitized_(rt, static_cast<std::size_t>(std::max(max_ids, 1)) * sizeof(std::int32_t), MemoryKind::device),
        regions_(regions) {
    // As the CUDA executor: a first part naming regions the storage lacks is refused (the model
    // itself copies whole experts, so it has no other use for the mask).
    if (regions.count < 32 && (options.ready_first_regions >> regions.count) != 0) {
      throw Error(Status::format(ErrorCode::invalid_argument,
                                 "%s: ready_first_regions 0x%x names copy regions past the storage's %zu",
                                 options.label.c_str(), options.ready_first_regions, regions.count));
    }
    if constexpr (!Overlap) {
      if (options.overlap) {
        throw Error(Status::format(ErrorCode::invalid_argument, "%s: overlap needs an executor with the overlapped fill",
                                   options.label.c_str()));
      }
    }
    auto* w = reinterpret_cast<MappedWords*>(words_.data());
    state_ = bind_plan_state(block_.data(), num_experts, capacity, &w->stats, &w->error_word);
    state_.policy = kind;
    // Fresh memory, nothing enqueued yet: the reset runs on the host (declared as a host write).
    rt.host_access(block_.data(), block_.size(), AccessMode::write);
    rt.host_access(words_.data(), words_.size(), AccessMode::write);
    SequentialBlock b;
    reset_plan_state<Policy>(b, state_, options.crf_decay_q32);
    for (const CopyRegion& r : regions_) {
      if (r.bytes == 0) continue;
      pools_.push_back({r.host_base, extent(r.host_stride, num_experts, r.bytes), AccessMode::read});
      slots_.push_back({r.slot_base, extent(r.slot_stride, capacity, r.bytes), AccessMode::write});
    }
    if (uses_proxy()) {
      proxy_stream_ = RuntimeStream<SimRuntime>(rt);
      rt.set_host_issued(proxy_stream_.get());  // its ops stand for the proxy thread's calls
      posted_ = RuntimeEvent<SimRuntime>(rt);
      proxy_done_ = RuntimeEvent<SimRuntime>(rt);
      ring_ = RuntimeBuffer<SimRuntime>(rt, proxy_ring_depth * static_cast<std::size_t>(capacity) * sizeof(SimProxyFill),
                                        MemoryKind::pinned_host);
      for (std::uint32_t k = 0; k < proxy_ring_depth; ++k) taken_.emplace_back(rt);
      proxy_failed_ = std::make_shared<bool>(false);
    }
    if constexpr (Overlap) {
      if (overlap_ && !copy_engine_) {
        planned_ = RuntimeEvent<SimRuntime>(rt);
        for (std::int32_t j = 0; j < capacity; ++j) {
          lanes_.emplace_back(rt);
          ready_.emplace_back(rt);
        }
      }
    }
  }

 public:
  // Edge P4: the proxy's pending work (its take and copy ops) completes before the cache's
  // memory goes, as the CUDA executor's detach waits for the proxy to take every request and
  // synchronises its copy stream.
  [[gnu::cold]] ~BasicSimPlanExecutor() {
    if (uses_proxy() && !skip_shutdown_wait_) (void)rt_->synchronize(proxy_stream_.get());
  }
  BasicSimPlanExecutor(const BasicSimPlanExecutor&) = delete;
  BasicSimPlanExecutor& operator=(const BasicSimPlanExecutor&) = delete;

  [[nodiscard]] bool overlap() const noexcept { return overlap_; }
  // The event that stands for slot j's ready word (overlap only): recorded after the lane's
  // fill of slot j in the latest step. A consumer waits for it before reading slot j.
  [[nodiscard]] SimRuntime::Event ready_event(std::int32_t j) const noexcept {
    if (copy_engine_) return proxy_done_.get();
    return ready_[static_cast<std::size_t>(j)].get();
  }

  // Overlap: the stream the last fill forked from waits for every lane (see above). The copy
  // engine: a failed copy since the last call is returned once.
  Status join_fills() noexcept {
    if (uses_proxy() && *proxy_failed_) {
      *proxy_failed_ = false;
      return Status(ErrorCode::runtime_failure, "device_expert_cache: a copy-engine fill failed (simulated)");
    }
    if (!fork_) return {};
    const Stream x = *fork_;
    fork_.reset();
    for (const auto& e : ready_)
      if (Status r = rt_->wait(x, e.get()); !r) return r;
    return {};
  }

  [[nodiscard]] const DevicePlanState& state() const noexcept { return state_; }
  [[nodiscard]] std::int32_t* sanitized_ids() const noexcept { return reinterpret_cast<std::int32_t*>(sanitized_.data()); }
  [[nodiscard]] std::size_t device_bytes() const noexcept { return block_.size() + sanitized_.size(); }

  Status plan_forward_fill(Stream s, const std::int32_t* ids, std::int32_t n, bool& planned, bool in_rounds,
                           std::int32_t round_width) noexcept {
    planned = false;
    std::vector<Access> acc;
    if (n > 0) acc.push_back({ids, static_cast<std::size_t>(n) * sizeof(std::int32_t), AccessMode::read});
    if (n > 0) acc.push_back({sanitized_ids(), static_cast<std::size_t>(n) * sizeof(std::int32_t), AccessMode::write});
    add_state_accesses(acc);
    DevicePlanState st = state_;
    st.forward_in_rounds = in_rounds;
    st.round_width = in_rounds ? round_width : 0;
    std::int32_t* out = sanitized_ids();
    rt_->set_next_label("device plan_forward");
    if (Status r = rt_->launch(s, acc, [st, ids, n, out] {
          SequentialBlock b;
          if constexpr (std::same_as<Policy, DeviceRuntimePolicy>) {
            // Every forward on the general path: the small path is the GPU's register fast path
            // to the same state (tests/host/test_device_policies.cpp compares them byte for byte), and
            // here it would only be a second copy of the group step in a user's build.
            plan_forward_general<Policy>(b, st, ids, n, out);
          } else {
            plan_forward<Policy>(b, st, ids, n, out);
          }
        });
        !r) {
      return r;
    }
    planned = true;
    return by_consumer_ ? Status{} : fill(s);  // fill_by_consumer: the consumer copies the misses
  }

  Status plan_group_fill(Stream s, std::int32_t g, bool& planned) noexcept {
    planned = false;
    std::vector<Access> acc;
    add_state_accesses(acc);
    const DevicePlanState st = state_;
    rt_->set_next_label("device plan_group");
    if (Status r = rt_->launch(s, acc, [st, g] {
          SequentialBlock b;
          plan_group<Policy>(b, st, g);
        });
        !r) {
      return r;
    }
    planned = true;
    return by_consumer_ ? Status{} : fill(s);  // fill_by_consumer: the consumer copies the misses
  }

  // plan_prefetch, then its fills as one stream-ordered fill op (also with overlap: a forward's
  // consumer reads a prefetched slot only after the next prepare, which is ordered after this
  // call's stream by the core, and whose lane for that slot waits for its plan).
  Status prefetch(Stream s, const std::int32_t* ids, std::int32_t n, std::int32_t max_fills, std::uint32_t expires_after,
                  bool& planned, bool evict_last_forward = false) noexcept {
    planned = false;
    std::vector<Access> acc;
    if (n > 0) acc.push_back({ids, static_cast<std::size_t>(n) * sizeof(std::int32_t), AccessMode::read});
    add_state_accesses(acc, false);
    const DevicePlanState st = state_;
    rt_->set_next_label("device plan_prefetch");
    if (Status r = rt_->launch(s, acc, [st, ids, n, max_fills, expires_after, evict_last_forward] {
          SequentialBlock b;
          plan_prefetch<Policy>(b, st, ids, n, max_fills, expires_after, evict_last_forward);
        });
        !r) {
      return r;
    }
    planned = true;
    if (uses_proxy()) return fill_by_proxy(s, false);
    return fill_stream_ordered(s, overlap_);
  }

  Status invalidate(Stream s, std::int32_t expert) noexcept {
    std::vector<Access> acc;
    add_state_accesses(acc);
    const DevicePlanState st = state_;
    rt_->set_next_label("device plan_invalidate");
    return rt_->launch(s, acc, [st, expert] {
      SequentialBlock b;
      plan_invalidate(b, st, expert);
    });
  }

  Status drop_fills(Stream s) noexcept {
    return recovery(s, "device drop_fills", [](SequentialBlock& b, const DevicePlanState& st) { detail::plan_drop_fills(b, st); });
  }
  Status drop_missing(Stream s) noexcept {
    return recovery(s, "device drop_missing",
                    [](SequentialBlock& b, const DevicePlanState& st) { detail::plan_drop_missing(b, st); });
  }

  // The mapped mirror, read without ordering (like the GPU's: readable while work runs; each
  // word is written whole). Not declared to the race detector for that reason.
  [[nodiscard]] DevicePlanStats stats() const noexcept { return reinterpret_cast<const MappedWords*>(words_.data())->stats; }

  // Read and clear: declared as a host access, so calling it while a plan op is pending and
  // unordered with the host is reported (the contract: only when the cache's streams are idle).
  std::uint32_t take_error_word() noexcept {
    auto* w = reinterpret_cast<MappedWords*>(words_.data());
    rt_->host_access(&w->error_word, sizeof(w->error_word), AccessMode::write);
    return std::exchange(w->error_word, 0u);
  }

 private:
  struct MappedWords {
    DevicePlanStats stats;
    std::uint32_t error_word = 0;
  };

  // Every region of `expert` from the host pools into `slot` (the simulated fills' bytes).
  static void copy_expert(const CopyRegions& regions, std::int32_t expert, std::int32_t slot) noexcept {
    for (const CopyRegion& r : regions) {
      std::memcpy(r.slot_base + static_cast<std::size_t>(slot) * r.slot_stride,
                  r.host_base + static_cast<std::size_t>(expert) * r.host_stride, r.bytes);
    }
  }
  static std::size_t extent(std::size_t stride, std::int32_t rows, std::size_t bytes) noexcept {
    return rows <= 0 ? 0 : stride * static_cast<std::size_t>(rows - 1) + bytes;
  }

  // One op on the whole state (the recovery steps: they run rarely and touch what they find).
  template <class Body>
  Status recovery(Stream s, const char* label, Body body) noexcept {
    std::vector<Access> acc;
    add_state_accesses(acc);
    const DevicePlanState st = state_;
    rt_->set_next_label(label);
    return rt_->launch(s, acc, [st, body] {
      SequentialBlock b;
      body(b, st);
    });
  }

  // One array of the state and when a step declares it (a table, so that the accesses are
  // pushed by one loop instead of one inlined push per array and mode).
  enum class Declared : std::uint8_t { always, forward, unless_copy_engine };
  struct StateArray {
    const void* data;
    std::size_t bytes;
    Declared when;
  };
  template <class T>
  static StateArray array_of(PlanSpan<T> span, Declared when = Declared::always) noexcept {
    return StateArray{span.data, static_cast<std::size_t>(span.size) * sizeof(T), when};
  }
  // Every array read and written, in this order; `forward`: the current forward's arrays too
  // (forward map, unique list, its group's experts). plan_prefetch never touches them, so a
  // consumer of the forward may read its forward map while a prefetch runs beside it.
  void add_state_accesses(std::vector<Access>& acc, bool forward = true) const {
    const StateArray arrays[] = {
        array_of(PlanSpan<DevicePlanScalars>{state_.scalars, 1}),
        array_of(PlanSpan<DevicePlanStats>{state_.counters, 1}),
        array_of(state_.slot_tick),
        array_of(state_.resident_map),
        array_of(state_.forward_map, Declared::forward),
        array_of(state_.unique, Declared::forward),
        array_of(state_.prev_forward, Declared::forward),
        array_of(state_.missing, Declared::forward),
        array_of(state_.marks),
        array_of(state_.slot_owner),
        array_of(state_.free_stack),
        array_of(state_.fills),
        array_of(state_.evictions),
        array_of(state_.slot_needed),
        // The ready words: no planning step touches them (only the reset at construction). With
        // the copy engine the proxy stores them while later plans run (the words are its release
        // flags, not data), so they are left out there; otherwise declared, as the fills are joined.
        array_of(state_.slot_ready, Declared::unless_copy_engine),
        array_of(state_.slot_ready_first, Declared::unless_copy_engine),
        array_of(state_.fill_arrivals),
        array_of(state_.fill_arrivals_first),
        array_of(state_.slot_spec_left),
        // The policies' state: every plan step may read and write it (a prior's bias is read).
        array_of(state_.slot_freq),
        array_of(state_.slot_order),
        array_of(state_.expert_crf),
        array_of(state_.expert_bias),
        array_of(state_.expert_last),
        array_of(state_.crf_pow),
    };
    for (const StateArray& a : arrays) {
      if ((a.when == Declared::forward && !forward) || (a.when == Declared::unless_copy_engine && uses_proxy())) continue;
      acc.push_back({a.data, a.bytes, AccessMode::read});
      acc.push_back({a.data, a.bytes, AccessMode::write});
    }
    acc.push_back({state_.stats, sizeof(DevicePlanStats), AccessMode::write});
    acc.push_back({state_.error_word, sizeof(std::uint32_t), AccessMode::write});
  }

  Status fill(Stream s) noexcept {
    if (copy_engine_) return fill_by_proxy(s, !overlap_);
    if constexpr (Overlap) {
      if (overlap_) return fill_overlapped(s);
    }
    return fill_stream_ordered(s);
  }

  // The copy engine (see the class comment): post on s, take + copy on the proxy's stream.
  Status fill_by_proxy(Stream s, bool wait_all) noexcept {
    const DevicePlanState st = state_;
    const std::uint32_t k = post_seq_++ % proxy_ring_depth;
    auto* entry = reinterpret_cast<SimProxyFill*>(ring_.data()) + static_cast<std::size_t>(k) * static_cast<std::size_t>(st.capacity);
    const std::size_t entry_bytes = static_cast<std::size_t>(st.capacity) * sizeof(SimProxyFill);
    const std::size_t words = static_cast<std::size_t>(st.capacity) * sizeof(std::uint32_t);
    const Stream p = proxy_stream_.get();
    // The ring-room wait: the entry is free once the proxy took its previous request.
    if (Status r = rt_->wait(s, taken_[k].get()); !r) return r;
    if (post_before_list_) {
      if (Status r = rt_->record(posted_.get(), s); !r) return r;
    }
    {
      std::vector<Access> acc{{st.scalars, sizeof(DevicePlanScalars), AccessMode::read},
                              {st.fills.data, static_cast<std::size_t>(st.capacity) * sizeof(PlanEntry), AccessMode::read},
                              {st.slot_needed.data, words, AccessMode::read},
                              {entry, entry_bytes, AccessMode::write}};
      rt_->set_next_label("device proxy_post");
      if (Status r = rt_->launch(s, acc, [st, entry] {
            const std::int32_t n = std::min(st.scalars->fill_count, st.capacity);
            for (std::int32_t i = 0; i < st.capacity; ++i) {
              const PlanEntry f = i < n ? st.fills[i] : PlanEntry{-1, -1};
              const bool ok = f.slot >= 0 && f.slot < st.capacity;
              entry[i] = SimProxyFill{f.expert, ok ? f.slot : -1, ok ? st.slot_needed[f.slot] : 0u};
            }
          });
          !r) {
        return r;
      }
    }
    if (!post_before_list_) {
      if (Status r = rt_->record(posted_.get(), s); !r) return r;
    }
    if (Status r = rt_->wait(p, posted_.get()); !r) return r;
    auto list = std::make_shared<std::vector<SimProxyFill>>();
    {
      const Access a{entry, entry_bytes, AccessMode::read};
      rt_->set_next_label("proxy take");
      if (Status r = rt_->launch(p, std::span<const Access>(&a, 1),
                                 [entry, list, c = st.capacity] { list->assign(entry, entry + c); });
          !r) {
        return r;
      }
      if (Status r = rt_->record(taken_[k].get(), p); !r) return r;
    }
    if (ready_before_copy_) {
      if (Status r = rt_->record(proxy_done_.get(), p); !r) return r;
    }
    {
      std::vector<Access> acc;
      acc.insert(acc.end(), pools_.begin(), pools_.end());
      acc.insert(acc.end(), slots_.begin(), slots_.end());
      acc.push_back({st.slot_ready.data, words, AccessMode::write});
      acc.push_back({st.slot_ready_first.data, words, AccessMode::write});
      if (fail_copies_) acc.push_back({st.error_word, sizeof(std::uint32_t), AccessMode::write});
      const CopyRegions regions = regions_;
      rt_->set_next_label("proxy copy");
      if (Status r = rt_->launch(p, acc, [st, regions, list, fail = fail_copies_, failed = proxy_failed_] {
            for (const SimProxyFill& f : *list) {
              if (f.expert < 0 || f.expert >= st.num_experts || f.slot < 0 || f.slot >= st.capacity) continue;
              if (!fail) {
                copy_expert(regions, f.expert, f.slot);
              } else {
                *failed = true;
                *st.error_word |= plan_error_fill_failed;
              }
              st.slot_ready_first[f.slot] = st.slot_ready[f.slot] = f.tag;  // after the bytes (P2)
            }
          });
          !r) {
        return r;
      }
    }
    if (!ready_before_copy_) {
      if (Status r = rt_->record(proxy_done_.get(), p); !r) return r;
    }
    // Without overlap the post waits for the ready words; with it the consumer waits per slot.
    return wait_all ? rt_->wait(s, proxy_done_.get()) : Status{};
  }

  // `publish_ready` (a prefetch's fill with overlap): also stores each filled slot's ready word,
  // as the GPU's ready-word fill does, so a later readiness consumer finds it at the needed value.
  Status fill_stream_ordered(Stream s, bool publish_ready = false) noexcept {
    std::vector<Access> acc;
    acc.push_back({state_.scalars, sizeof(DevicePlanScalars), AccessMode::read});
    acc.push_back({state_.fills.data, static_cast<std::size_t>(state_.capacity) * sizeof(PlanEntry), AccessMode::read});
    if (publish_ready) {
      const std::size_t words = static_cast<std::size_t>(state_.capacity) * sizeof(std::uint32_t);
      acc.push_back({state_.slot_needed.data, words, AccessMode::read});
      acc.push_back({state_.slot_ready.data, words, AccessMode::write});
      acc.push_back({state_.slot_ready_first.data, words, AccessMode::write});
    }
    acc.insert(acc.end(), pools_.begin(), pools_.end());
    acc.insert(acc.end(), slots_.begin(), slots_.end());
    const DevicePlanState st = state_;
    const CopyRegions regions = regions_;
    rt_->set_next_label("device plan_fill");
    return rt_->launch(s, acc, [st, regions, publish_ready] {
      const std::int32_t n = std::min(st.scalars->fill_count, st.capacity);
      for (std::int32_t i = 0; i < n; ++i) {
        const PlanEntry f = st.fills[i];
        // Checked like the kernel: nothing outside the pools is touched, whatever the list says.
        if (f.expert < 0 || f.expert >= st.num_experts || f.slot < 0 || f.slot >= st.capacity) continue;
        copy_expert(regions, f.expert, f.slot);
        if (publish_ready) st.slot_ready_first[f.slot] = st.slot_ready[f.slot] = st.slot_needed[f.slot];
      }
    });
  }

  // One op per slot on its own lane (see the class comment).
  Status fill_overlapped(Stream s) noexcept {
    if (Status r = rt_->record(planned_.get(), s); !r) return r;
    fork_ = s;
    const DevicePlanState st = state_;
    for (std::int32_t j = 0; j < st.capacity; ++j) {
      const Stream lane = lanes_[static_cast<std::size_t>(j)].get();
      if (Status r = rt_->wait(lane, planned_.get()); !r) return r;
      if (speculate_on_proxy_ && !skip_pending_copy_wait_) {  // edge P6
        if (Status r = rt_->wait(lane, proxy_done_.get()); !r) return r;
      }
      std::vector<Access> acc;
      acc.push_back({st.scalars, sizeof(DevicePlanScalars), AccessMode::read});
      acc.push_back({st.fills.data, static_cast<std::size_t>(st.capacity) * sizeof(PlanEntry), AccessMode::read});
      acc.push_back({st.slot_needed.data + j, sizeof(std::uint32_t), AccessMode::read});
      acc.push_back({st.slot_ready.data + j, sizeof(std::uint32_t), AccessMode::write});
      acc.push_back({st.slot_ready_first.data + j, sizeof(std::uint32_t), AccessMode::write});
      acc.insert(acc.end(), pools_.begin(), pools_.end());
      for (const CopyRegion& r : regions_) {
        if (r.bytes != 0) acc.push_back({r.slot_base + static_cast<std::size_t>(j) * r.slot_stride, r.bytes, AccessMode::write});
      }
      const CopyRegions regions = regions_;
      rt_->set_next_label("device plan_fill_ready (slot " + std::to_string(j) + ")");
      if (Status r = rt_->launch(lane, acc, [st, regions, j] {
            const std::int32_t n = std::min(st.scalars->fill_count, st.capacity);
            for (std::int32_t i = 0; i < n; ++i) {
              const PlanEntry f = st.fills[i];
              if (f.slot != j || f.expert < 0 || f.expert >= st.num_experts) continue;
              copy_expert(regions, f.expert, j);
              // The release stores (after the bytes; the model has no first part of its own).
              st.slot_ready_first[j] = st.slot_ready[j] = st.slot_needed[j];
            }
          });
          !r) {
        return r;
      }
      if (Status r = rt_->record(ready_[static_cast<std::size_t>(j)].get(), lane); !r) return r;
    }
    return {};
  }

  struct SimProxyFill {
    std::int32_t expert;
    std::int32_t slot;
    std::uint32_t tag;
  };

  SimRuntime* rt_;
  bool overlap_;
  bool by_consumer_;  // fill_by_consumer: plans enqueue no fill
  bool copy_engine_;  // FillEngine::copy_engine: fills through the modelled proxy
  bool speculate_on_proxy_;      // speculate_on_copy_engine: prefetches through the proxy, forwards on the lanes
  bool skip_pending_copy_wait_;  // test knob (edge P6)
  [[nodiscard]] bool uses_proxy() const noexcept { return copy_engine_ || speculate_on_proxy_; }
  bool post_before_list_, ready_before_copy_, fail_copies_;  // test knobs (edges P1, P2; failures)
  bool skip_shutdown_wait_;                                    // test knob (edge P4)
  RuntimeStream<SimRuntime> proxy_stream_;
  RuntimeEvent<SimRuntime> posted_, proxy_done_;
  std::vector<RuntimeEvent<SimRuntime>> taken_;  // per ring entry
  RuntimeBuffer<SimRuntime> ring_;
  std::uint32_t post_seq_ = 0;
  std::shared_ptr<bool> proxy_failed_;
  RuntimeEvent<SimRuntime> planned_;
  std::vector<RuntimeStream<SimRuntime>> lanes_;
  std::vector<RuntimeEvent<SimRuntime>> ready_;
  std::optional<Stream> fork_;
  RuntimeBuffer<SimRuntime> block_;
  RuntimeBuffer<SimRuntime> words_;
  RuntimeBuffer<SimRuntime> sanitized_;
  CopyRegions regions_;
  std::vector<Access> pools_;
  std::vector<Access> slots_;
  DevicePlanState state_{};
};
using SimPlanExecutor = BasicSimPlanExecutor<DeviceLru>;
static_assert(device_plan_executor<SimPlanExecutor>);
static_assert(device_plan_executor<BasicSimPlanExecutor<DeviceLfru>>);
static_assert(device_plan_executor<BasicSimPlanExecutor<DeviceRuntimePolicy>>);
static_assert(device_plan_executor<BasicSimPlanExecutor<DeviceRuntimePolicy, false>>);

template <>
struct DevicePlanExecutorFor<SimRuntime> {
  using type = SimPlanExecutor;
  template <device_plan_policy Policy>
  using with_policy = BasicSimPlanExecutor<Policy>;
};

}  // namespace expert_cache::inline v0
