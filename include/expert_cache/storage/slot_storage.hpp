#pragma once
/// Where experts live: host pools holding every expert (the source of fills) and device slot
/// buffers holding `capacity` of them.
// Three arrangements (host pool / slots):
//   TensorMajorStorage        one [E, bytes_t] host array and one [capacity, bytes_t] slot
//                             array per tensor (the row provider's layout; a fill is one copy
//                             per tensor);
//   ExpertMajorStorage        each expert's tensors contiguous on the host and in a blob slot
//                             on the device (a fill is ONE transfer); the consumer indexes each
//                             tensor with the blob stride;
//   ExpertMajorHostStorage    the expert-major host pool (one contiguous read per miss) and
//                             one contiguous [capacity, bytes_t] slot array per tensor, what a
//                             Marlin MoE kernel reads: a fill scatters the blob into the
//                             tensors, one copy region per tensor with host_stride = blob bytes
//                             and slot_stride = tensor bytes.
// Memory comes from the runtime (pinned host + device for CUDA, plain memory for SimRuntime)
// unless the caller brings its own (storage/storage_memory.hpp: host spans registered at their
// exact size and never copied, a device workspace the slots are carved from).
//
// Each storage describes its fill copies as CopyRegions (storage/copy_region.hpp): per fill of
// expert e into slot s, one copy per region of `bytes` from host_base + e * host_stride to
// slot_base + s * slot_stride. Staging policies read only that, so the region count is the one
// source of copies per fill. `expert_contiguous` (the host pool is expert-major) stays as a
// description for tools (bench); no staging policy reads it.
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/runtime/resources.hpp"
#include "expert_cache/storage/copy_region.hpp"
#include "expert_cache/storage/storage_memory.hpp"

namespace expert_cache::inline v0 {

/// One tensor of the slot buffers as the consumer sees it: tensor of slot s starts at
/// base + s * slot_stride and is `bytes` long. bytes == 0: the layout has no such tensor.
/// slot_stride == bytes: the tensor's slots are one contiguous [capacity, bytes] array.
struct SlotTensor {
  std::byte* base = nullptr;
  std::size_t slot_stride = 0;
  std::size_t bytes = 0;
  /// @param s  a slot id, [0, capacity)
  /// @return the device address of this tensor in slot `s`
  [[nodiscard]] std::byte* slot(std::int32_t s) const noexcept {
    return base + static_cast<std::size_t>(s) * slot_stride;
  }
  /// True when the tensor's slots form one [capacity, bytes] array (what a Marlin MoE kernel reads).
  [[nodiscard]] bool contiguous() const noexcept { return slot_stride == bytes; }
};

// Upper bound for any single pool: refuses sizes that cannot be real before they reach an
// allocation (1 TiB).
inline constexpr std::size_t max_pool_bytes = std::size_t{1} << 40;

enum class HostArrangement : std::uint8_t { tensor_major, expert_major };
enum class SlotArrangement : std::uint8_t { per_tensor, blob };

/// Where each tensor sits in an expert-major blob: offsets rounded up to 16 bytes so every
/// tensor stays 16-byte aligned for vector loads.
struct BlobLayout {
  std::array<std::size_t, max_expert_tensors> offsets{};
  std::size_t blob_bytes = 0;
};

namespace detail {
inline std::size_t checked_pool_bytes(std::size_t rows, std::size_t row_bytes, const char* what) {
  if (row_bytes != 0 && rows > max_pool_bytes / row_bytes) {
    throw Error(ErrorCode::invalid_argument, join({what, ": ", DecimalText(rows), " rows of ", DecimalText(row_bytes),
                                                   " bytes exceed the 1 TiB pool limit"}));
  }
  return rows * row_bytes;
}
inline void check_tensors(const ExpertTensorBytes& tensors) {
  if (total_bytes_per_expert(tensors) == 0) {
    throw Error(ErrorCode::invalid_argument, "the layout has no tensor with a non-zero size");
  }
  for (const auto& t : tensors) {
    if (t.bytes_per_expert > max_pool_bytes) {
      throw Error(ErrorCode::invalid_argument,
                  join({"tensor ", t.name, " of ", DecimalText(t.bytes_per_expert), " bytes per expert is too large"}));
    }
  }
  // Present tensors are found by name (find_tensor), so each needs a distinct one.
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].bytes_per_expert == 0) continue;
    if (tensors[i].name.empty()) {
      throw Error(ErrorCode::invalid_argument, join({"tensor #", DecimalText(i), " has bytes but no name"}));
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (tensors[j].bytes_per_expert != 0 && tensors[j].name == tensors[i].name) {
        throw Error(ErrorCode::invalid_argument, join({"two tensors are named ", tensors[i].name}));
      }
    }
  }
}

constexpr BlobLayout blob_layout(const ExpertTensorBytes& tensors, std::size_t alignment) noexcept {
  BlobLayout l;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    l.offsets[t] = l.blob_bytes;
    l.blob_bytes += (tensors[t].bytes_per_expert + alignment - 1) / alignment * alignment;
  }
  return l;
}

[[noreturn]] inline void bad_memory(std::string_view what) {
  throw Error(ErrorCode::invalid_argument, join({"caller memory: ", what}));
}

// A caller span must be exactly `bytes` (or at least, for a workspace), non-null, aligned.
inline void check_span(const MemorySpan& s, std::size_t bytes, bool exact, std::string_view what) {
  if (s.data == nullptr) bad_memory(join({what, ": null pointer (", DecimalText(s.bytes), " bytes)"}));
  if (exact ? s.bytes != bytes : s.bytes < bytes) {
    bad_memory(join({what, ": ", DecimalText(s.bytes), " bytes, ", exact ? "expected exactly " : "needs at least ",
                     DecimalText(bytes)}));
  }
  if (reinterpret_cast<std::uintptr_t>(s.data) % caller_memory_alignment != 0) {
    bad_memory(join({what, " is not ", DecimalText(caller_memory_alignment), "-byte aligned"}));
  }
}

// Registers caller host memory for the storage's lifetime (the caller keeps ownership). A
// runtime without register_host (none so far) takes plain memory as it is.
template <class R>
class HostRegistration {
 public:
  HostRegistration() = default;
  HostRegistration(R& rt, void* p, std::size_t bytes, std::string_view what) {
    if constexpr (requires { rt.register_host(p, bytes); rt.unregister_host(p); }) {
      Status s = rt.register_host(p, bytes);
      if (!s) throw Error(s.code(), join({"caller memory: registering ", what, ": ", s.message()}));
      rt_ = &rt;
      p_ = p;
    }
  }
  HostRegistration(HostRegistration&& o) noexcept
      : rt_(std::exchange(o.rt_, nullptr)), p_(std::exchange(o.p_, nullptr)) {}
  HostRegistration& operator=(HostRegistration&& o) noexcept {
    HostRegistration(std::move(o)).swap(*this);
    return *this;
  }
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  ~HostRegistration() {
    if constexpr (requires(R& r, void* q) { r.unregister_host(q); }) {
      if (p_ != nullptr) (void)rt_->unregister_host(p_);
    }
  }

 private:
  void swap(HostRegistration& o) noexcept {
    std::swap(rt_, o.rt_);
    std::swap(p_, o.p_);
  }
  R* rt_ = nullptr;
  void* p_ = nullptr;
};

/// The one implementation of the three arrangements. Construction validates the layout and
/// the caller's memory before anything is allocated or registered. Dynamic: the arrangement is
/// the constructor's (host, slots) arguments instead of Host and Slots, so that one
/// instantiation serves all three (the run-time-selected cache's storage, any/any_cache.hpp).
template <allocating_runtime R, HostArrangement Host, SlotArrangement Slots, bool Dynamic = false>
class BasicSlotStorage {
 public:
  static constexpr HostArrangement host_arrangement = Host;
  static constexpr SlotArrangement slot_arrangement = Slots;
  static constexpr bool expert_contiguous = Host == HostArrangement::expert_major;
  // Tensor offsets inside a blob are rounded up to this (16-byte vector loads).
  static constexpr std::size_t tensor_alignment = 16;
  // Per-tensor slot arrays carved from a caller workspace start at this offset granularity
  // (cudaMalloc's alignment, so a carved array is placed like an allocated one).
  static constexpr std::size_t slot_array_alignment = 256;

  /// @param tensors  the layout's tensors (`layout.tensors()`)
  /// @return each tensor's offset in an expert-major blob and the padded blob size
  [[nodiscard]] static constexpr BlobLayout blob_layout(const ExpertTensorBytes& tensors) noexcept {
    return detail::blob_layout(tensors, tensor_alignment);
  }
  /// Bytes a caller slot workspace (StorageMemory::slot_workspace) must have for this arrangement.
  /// @param shape    the cache's experts and slots (only `capacity` sizes the slots)
  /// @param tensors  the layout's tensors (`layout.tensors()`)
  /// @return the slot bytes plus the alignment padding between per-tensor arrays
  /// @throws Error invalid_argument for a layout with no tensor, an unnamed or twice-named tensor,
  ///         or sizes beyond max_pool_bytes
  [[nodiscard]] static std::size_t slot_workspace_bytes(CacheShape shape, const ExpertTensorBytes& tensors)
    requires(!Dynamic)
  {
    check_tensors(tensors);
    return slot_layout(shape, tensors, Slots == SlotArrangement::blob).total;
  }

  /// Allocates (or adopts) the host pools and the slots.
  /// @param rt       the runtime that allocates pinned host and device memory and registers
  ///                 caller host memory; it must outlive the storage
  /// @param shape    how many experts the host pools hold and how many slots the device holds
  /// @param tensors  the layout's tensors (`layout.tensors()`)
  /// @param memory   caller memory to use instead of allocating (storage/storage_memory.hpp);
  ///                 empty fields are allocated from `rt`
  /// @throws Error invalid_argument for a bad layout or caller memory (checked before anything is
  ///         allocated or registered), or the runtime's error when an allocation or a
  ///         registration fails
  BasicSlotStorage(R& rt, CacheShape shape, const ExpertTensorBytes& tensors, const StorageMemory& memory = {})
    requires(!Dynamic)
      : BasicSlotStorage(rt, shape, tensors, memory, Host, Slots, Arranged{}) {}
  /// The same, with the arrangement chosen at run time (Dynamic storages only).
  /// @param host   tensor-major or expert-major host pools
  /// @param slots  per-tensor slot arrays or blob slots
  BasicSlotStorage(R& rt, CacheShape shape, const ExpertTensorBytes& tensors, const StorageMemory& memory,
                   HostArrangement host, SlotArrangement slots)
    requires Dynamic
      : BasicSlotStorage(rt, shape, tensors, memory, host, slots, Arranged{}) {}

 private:
  struct Arranged {};
  [[gnu::cold]] BasicSlotStorage(R& rt, CacheShape shape, const ExpertTensorBytes& tensors, const StorageMemory& memory,
                   HostArrangement host, SlotArrangement slots, Arranged)
      : tensors_(tensors), host_(host), slots_(slots) {
    check_tensors(tensors);
    const auto experts = static_cast<std::size_t>(shape.num_experts);
    const BlobLayout blob = blob_layout(tensors);
    offsets_ = blob.offsets;
    blob_bytes_ = blob.blob_bytes;
    const SlotPlan plan = slot_layout(shape, tensors, blob_slots());
    if (expert_major_host()) {
      host_bytes_ = checked_pool_bytes(experts, blob_bytes_, "host pool");
    } else {
      for (std::size_t t = 0; t < max_expert_tensors; ++t)
        host_bytes_ += checked_pool_bytes(experts, tensors[t].bytes_per_expert, "host pool");
    }
    slot_bytes_ = plan.bytes;
    validate_memory(memory, experts, plan);  // throws before anything is allocated or registered

    // Host pools: the caller's (registered unless it says they are) or allocated.
    if (expert_major_host()) {
      if (!memory.host_pool.empty()) {
        host_pool_ = static_cast<std::byte*>(memory.host_pool.data);
        if (!memory.host_registered) host_reg_[0] = HostRegistration<R>(rt, host_pool_, host_bytes_, "the host pool");
      } else {
        host_owned_[0] = RuntimeBuffer<R>(rt, host_bytes_, MemoryKind::pinned_host);
        host_pool_ = host_owned_[0].data();
      }
      for (std::size_t t = 0; t < max_expert_tensors; ++t) host_base_[t] = host_pool_ + offsets_[t];
    } else {
      const bool caller = memory.caller_host_tensors();
      for (std::size_t t = 0; t < max_expert_tensors; ++t) {
        const std::size_t row = tensors[t].bytes_per_expert;
        if (row == 0) continue;
        if (caller) {
          host_base_[t] = static_cast<std::byte*>(memory.host_tensors[t].data);
          if (!memory.host_registered)
            host_reg_[t] = HostRegistration<R>(rt, host_base_[t], experts * row, join({"the host pool of tensor ", tensors[t].name}));
        } else {
          host_owned_[t] = RuntimeBuffer<R>(rt, experts * row, MemoryKind::pinned_host);
          host_base_[t] = host_owned_[t].data();
        }
      }
    }

    // Slots: carved from the caller's workspace or allocated (one buffer per tensor, or one blob buffer).
    std::byte* workspace = static_cast<std::byte*>(memory.slot_workspace.data);
    if (blob_slots()) {
      if (workspace != nullptr) {
        slot_pool_ = workspace;
      } else {
        slot_owned_[0] = RuntimeBuffer<R>(rt, slot_bytes_, MemoryKind::device);
        slot_pool_ = slot_owned_[0].data();
      }
      for (std::size_t t = 0; t < max_expert_tensors; ++t) slot_base_[t] = slot_pool_ + offsets_[t];
    } else {
      for (std::size_t t = 0; t < max_expert_tensors; ++t) {
        if (tensors[t].bytes_per_expert == 0) continue;
        if (workspace != nullptr) {
          slot_base_[t] = workspace + plan.offsets[t];
        } else {
          slot_owned_[t] = RuntimeBuffer<R>(rt, plan.sizes[t], MemoryKind::device);
          slot_base_[t] = slot_owned_[t].data();
        }
      }
    }

    // Copy regions.
    if (expert_major_host() && blob_slots()) {
      regions_.regions[0] = CopyRegion{host_pool_, slot_pool_, blob_bytes_, blob_bytes_, blob_bytes_};
      regions_.count = 1;
    } else {
      for (std::size_t t = 0; t < max_expert_tensors; ++t) {
        const std::size_t row = tensors[t].bytes_per_expert;
        if (row == 0) continue;
        regions_.regions[regions_.count++] = CopyRegion{host_base_[t], slot_base_[t], host_stride(t), row, row};
      }
    }
  }


 public:
  /// How a fill copies: one region per present tensor, in tensor order (expert-major host + blob
  /// slots: one region, the whole padded blob, so a fill is ONE transfer).
  [[nodiscard]] const CopyRegions& copy_regions() const noexcept { return regions_; }

  /// The layout's tensors this storage was built for.
  [[nodiscard]] const ExpertTensorBytes& tensors() const noexcept { return tensors_; }
  /// Where the caller writes an expert's weights once, before the first prepare.
  /// @param t       tensor index (ExpertTensor, or the layout's own order)
  /// @param expert  expert id, [0, num_experts)
  /// @return host address of tensor `t` of `expert` (bytes_per_expert bytes)
  [[nodiscard]] std::byte* host_tensor(std::size_t t, std::int32_t expert) const noexcept {
    return host_base_[t] + static_cast<std::size_t>(expert) * host_stride(t);
  }
  /// @param t  tensor index
  /// @return tensor `t` of the slot buffers: base, slot stride and bytes (ForwardView::tensors)
  [[nodiscard]] SlotTensor slot_tensor(std::size_t t) const noexcept {
    if (blob_slots()) {
      return SlotTensor{slot_base_[t], blob_bytes_, tensors_[t].bytes_per_expert};
    } else {
      return SlotTensor{slot_base_[t], tensors_[t].bytes_per_expert, tensors_[t].bytes_per_expert};
    }
  }
  /// Host pool bytes, whoever owns them (caller memory included; RuntimeBuffer accounting is the
  /// runtime's).
  [[nodiscard]] std::size_t host_bytes() const noexcept { return host_bytes_; }
  /// Slot bytes, whoever owns them (without the padding of a carved workspace).
  [[nodiscard]] std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  /// True when the host pools are the caller's memory (nothing allocated for them).
  [[nodiscard]] bool caller_host() const noexcept { return caller_host_; }
  /// True when the slots are carved from the caller's workspace.
  [[nodiscard]] bool caller_slots() const noexcept { return caller_slots_; }

  // Expert-major host pools.
  /// Bytes of one expert's blob (tensors at 16-byte aligned offsets).
  [[nodiscard]] std::size_t blob_bytes() const noexcept
    requires(Host == HostArrangement::expert_major || Slots == SlotArrangement::blob)
  {
    return blob_bytes_;
  }
  /// @param t  tensor index
  /// @return offset of tensor `t` inside a blob
  [[nodiscard]] std::size_t tensor_offset(std::size_t t) const noexcept
    requires(Host == HostArrangement::expert_major || Slots == SlotArrangement::blob)
  {
    return offsets_[t];
  }
  /// @param expert  expert id, [0, num_experts)
  /// @return host address of the expert's blob (blob_bytes() bytes)
  [[nodiscard]] std::byte* host_expert(std::int32_t expert) const noexcept
    requires(Host == HostArrangement::expert_major)
  {
    return host_pool_ + static_cast<std::size_t>(expert) * blob_bytes_;
  }
  // Blob slots.
  /// @param slot  slot id, [0, capacity)
  /// @return device address of the slot's blob
  [[nodiscard]] std::byte* slot_blob(std::int32_t slot) const noexcept
    requires(Slots == SlotArrangement::blob)
  {
    return slot_pool_ + static_cast<std::size_t>(slot) * blob_bytes_;
  }

 private:
  struct SlotPlan {
    std::array<std::size_t, max_expert_tensors> offsets{};  // per-tensor arrays inside a workspace
    std::array<std::size_t, max_expert_tensors> sizes{};
    std::size_t bytes = 0;  // slot memory proper (what slot_bytes() reports)
    std::size_t total = 0;  // workspace bytes incl. alignment padding between arrays
  };

  static SlotPlan slot_layout(CacheShape shape, const ExpertTensorBytes& tensors, bool blob) {
    SlotPlan p;
    const auto cap = static_cast<std::size_t>(shape.capacity);
    if (blob) {
      p.bytes = checked_pool_bytes(cap, detail::blob_layout(tensors, tensor_alignment).blob_bytes, "slot buffer");
      p.total = p.bytes;
    } else {
      for (std::size_t t = 0; t < max_expert_tensors; ++t) {
        const std::size_t b = tensors[t].bytes_per_expert;
        if (b == 0) continue;
        p.sizes[t] = checked_pool_bytes(cap, b, "slot buffer");
        p.total = (p.total + slot_array_alignment - 1) / slot_array_alignment * slot_array_alignment;
        p.offsets[t] = p.total;
        p.total += p.sizes[t];
        p.bytes += p.sizes[t];
      }
    }
    return p;
  }

  // The arrangement: compile-time constants, or the constructor's arguments when Dynamic.
  [[nodiscard]] bool expert_major_host() const noexcept {
    if constexpr (Dynamic) {
      return host_ == HostArrangement::expert_major;
    } else {
      return Host == HostArrangement::expert_major;
    }
  }
  [[nodiscard]] bool blob_slots() const noexcept {
    if constexpr (Dynamic) {
      return slots_ == SlotArrangement::blob;
    } else {
      return Slots == SlotArrangement::blob;
    }
  }

  [[nodiscard]] std::size_t host_stride(std::size_t t) const noexcept {
    return expert_major_host() ? blob_bytes_ : tensors_[t].bytes_per_expert;
  }

  [[gnu::cold]] void validate_memory(const StorageMemory& m, std::size_t experts, const SlotPlan& plan) {
    if (expert_major_host()) {
      if (m.caller_host_tensors()) {
        bad_memory("host_tensors given to an expert-major host layout (it takes one host_pool of num_experts * blob bytes)");
      }
      if (!m.host_pool.empty()) {
        check_span(m.host_pool, host_bytes_, true,
                   join({"host pool (", DecimalText(experts), " experts * ", DecimalText(blob_bytes_), " blob bytes)"}));
        caller_host_ = true;
      }
    } else {
      if (!m.host_pool.empty()) {
        bad_memory("host_pool given to a tensor-major host layout (it takes one host_tensors span per tensor)");
      }
      if (m.caller_host_tensors()) {
        for (std::size_t t = 0; t < max_expert_tensors; ++t) {
          const std::size_t row = tensors_[t].bytes_per_expert;
          const MemorySpan& s = m.host_tensors[t];
          const std::string name = row != 0 ? join({"tensor ", tensors_[t].name}) : join({"tensor #", DecimalText(t)});
          if (row == 0) {
            if (!s.empty()) bad_memory(join({name, ": the layout has no such tensor, but a host span was given"}));
            continue;
          }
          check_span(s, experts * row, true,
                     join({name, " host span (", DecimalText(experts), " experts * ", DecimalText(row), " bytes)"}));
          const auto b = reinterpret_cast<std::uintptr_t>(s.data);
          for (std::size_t u = 0; u < t; ++u) {
            const MemorySpan& o = m.host_tensors[u];
            if (tensors_[u].bytes_per_expert == 0) continue;
            const auto ob = reinterpret_cast<std::uintptr_t>(o.data);
            if (b < ob + o.bytes && ob < b + s.bytes) {
              bad_memory(join({name, ": host span overlaps the one of tensor ", tensors_[u].name}));
            }
          }
        }
        caller_host_ = true;
      }
    }
    if (!m.slot_workspace.empty()) {
      check_span(m.slot_workspace, plan.total, false, "slot workspace");
      caller_slots_ = true;
    }
  }

  ExpertTensorBytes tensors_;
  HostArrangement host_;  // Dynamic: the arrangement (otherwise Host and Slots, unread)
  SlotArrangement slots_;
  std::array<std::size_t, max_expert_tensors> offsets_{};  // blob offsets
  std::size_t blob_bytes_ = 0;
  std::size_t host_bytes_ = 0;
  std::size_t slot_bytes_ = 0;
  bool caller_host_ = false;
  bool caller_slots_ = false;
  std::byte* host_pool_ = nullptr;  // expert-major host
  std::byte* slot_pool_ = nullptr;  // blob slots
  std::array<std::byte*, max_expert_tensors> host_base_{};  // expert 0's bytes of tensor t
  std::array<std::byte*, max_expert_tensors> slot_base_{};  // slot 0's bytes of tensor t
  std::array<HostRegistration<R>, max_expert_tensors> host_reg_{};  // caller host pools only
  std::array<RuntimeBuffer<R>, max_expert_tensors> host_owned_{};
  std::array<RuntimeBuffer<R>, max_expert_tensors> slot_owned_{};
  CopyRegions regions_{};
};
}  // namespace detail

/// Tensor-major host pools and per-tensor slot arrays: a fill is one copy per tensor.
template <allocating_runtime R>
class TensorMajorStorage
    : public detail::BasicSlotStorage<R, HostArrangement::tensor_major, SlotArrangement::per_tensor> {
 public:
  static constexpr std::string_view name = "tensor_major";
  using detail::BasicSlotStorage<R, HostArrangement::tensor_major, SlotArrangement::per_tensor>::BasicSlotStorage;
};

/// Expert-major host pool and blob slots: a fill is ONE transfer.
template <allocating_runtime R>
class ExpertMajorStorage : public detail::BasicSlotStorage<R, HostArrangement::expert_major, SlotArrangement::blob> {
 public:
  static constexpr std::string_view name = "expert_major";
  using detail::BasicSlotStorage<R, HostArrangement::expert_major, SlotArrangement::blob>::BasicSlotStorage;
};

/// Expert-major host pool, per-tensor contiguous slot arrays (a fill scatters; see the top).
template <allocating_runtime R>
class ExpertMajorHostStorage
    : public detail::BasicSlotStorage<R, HostArrangement::expert_major, SlotArrangement::per_tensor> {
 public:
  static constexpr std::string_view name = "expert_major_host";
  using detail::BasicSlotStorage<R, HostArrangement::expert_major, SlotArrangement::per_tensor>::BasicSlotStorage;
};

}  // namespace expert_cache::inline v0
