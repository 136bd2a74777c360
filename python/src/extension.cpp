// expert_cache_torch._C: the torch side of the extension (g++ with torch headers). It only
// converts: torch tensors -> (pointer, bytes, dtype, shape) records and id spans, the current
// torch CUDA stream -> the cache's stream, slot and map pointers -> torch tensors that alias them
// (torch::from_blob, no copy), Status errors -> ExpertCacheError. Validation and the cache
// live in bridge.hpp (torch-free, tested on SimRuntime); the CUDA instantiation in
// bridge_cuda.cu (nvcc, no torch headers).
#include "bridge.hpp"
#include "model_bridge.hpp"
#include "vllm_bridge.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;
namespace ec = expert_cache::python;

namespace {

// Raised as expert_cache_torch.ExpertCacheError (a RuntimeError) with the library's message;
// bad arguments (wrong ids, sizes, names) as ExpertCacheValueError, a subclass of both
// ExpertCacheError and ValueError (vLLM's providers raise ValueError for those).
struct ExpertCacheError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct ExpertCacheValueError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void fail(const std::string& message) { throw ExpertCacheError(message); }
[[noreturn]] void fail_value(const std::string& message) { throw ExpertCacheValueError(message); }

void check(const expert_cache::Status& s) {
  if (s.ok()) return;
  switch (s.code()) {
    case expert_cache::ErrorCode::invalid_argument:
    case expert_cache::ErrorCode::invalid_capacity:
    case expert_cache::ErrorCode::expert_out_of_range:
    case expert_cache::ErrorCode::duplicate_expert:
      fail_value(std::string(s.message()));
    default:
      fail(std::string(s.message()));  // too_many_experts (vLLM: RuntimeError), runtime failures, ...
  }
}

py::dict prefetch_dict(const expert_cache::PrefetchView& v) {
  py::dict d;
  d["issued"] = v.issued;
  d["evictions"] = v.evictions;
  d["skipped_resident"] = v.skipped_resident;
  d["skipped_no_victim"] = v.skipped_no_victim;
  d["skipped_unlikely"] = v.skipped_unlikely;
  d["skipped_imprecise"] = v.skipped_imprecise;
  d["bytes"] = v.bytes;
  return d;
}

// Prefetch scores as the library reads them: float32 on the host, flattened (one per id, as the
// ids are flattened). Any floating-point dtype, on the CPU or a CUDA device (read back: one
// synchronisation). Integer and other tensors are refused, naming the dtype.
at::Tensor host_scores(const at::Tensor& scores, const std::string& label) {
  if (!scores.defined()) fail_value(label + ": prefetch scores are undefined");
  if (!at::isFloatingType(scores.scalar_type())) {
    fail_value(label + ": prefetch scores must be a floating-point tensor (got " +
               std::string(c10::toString(scores.scalar_type())) + ")");
  }
  if (!scores.is_cuda() && scores.device().type() != at::kCPU) {
    fail_value(label + ": prefetch scores must be a CPU or CUDA tensor (got " + scores.device().str() + ")");
  }
  return scores.reshape({-1}).to(at::TensorOptions().device(at::kCPU).dtype(at::kFloat)).contiguous();
}

// The HintScores of one prefetch: `holder` keeps the host copy of the scores the span reads.
ec::HintScores hint_scores(const std::optional<at::Tensor>& scores, double min_score, const std::string& label,
                           at::Tensor& holder, bool evict_last_forward) {
  ec::HintScores hints;
  hints.min_score = static_cast<float>(min_score);
  hints.evict_last_forward = evict_last_forward;
  if (scores) {
    holder = host_scores(*scores, label);
    hints.scores = std::span<const float>(holder.data_ptr<float>(), static_cast<std::size_t>(holder.numel()));
  }
  return hints;
}

ec::DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kByte: return ec::DType::uint8;
    case at::kInt: return ec::DType::int32;
    case at::kBFloat16: return ec::DType::bfloat16;
    case at::kFloat: return ec::DType::float32;
    default: return ec::DType::other;
  }
}

at::ScalarType scalar_type_of(ec::DType d) {
  switch (d) {
    case ec::DType::int32: return at::kInt;
    case ec::DType::bfloat16: return at::kBFloat16;
    case ec::DType::float32: return at::kFloat;
    default: return at::kByte;
  }
}

// A LinkProfile's fields, the engine FillEngine::automatic picks from it and why, its stored
// text (serialize()) and its one-line description.
py::dict link_profile_dict(const expert_cache::LinkProfile& p) {
  py::dict d;
  d["device"] = p.device;
  d["device_name"] = p.device_name;
  d["pci_bus_id"] = p.pci_bus_id;
  d["expert_bytes"] = p.expert_bytes;
  d["copy_engine_gbps_one"] = p.copy_engine_gbps_one;
  d["copy_engine_gbps_batch"] = p.copy_engine_gbps_batch;
  d["copy_latency_us"] = p.copy_latency_us;
  d["sm_load_gbps"] = p.sm_load_gbps;
  d["graph_fill_latency_us"] = p.graph_fill_latency_us;
  d["measure_ms"] = p.measure_ms;
  d["sm_load_share"] = p.sm_load_share();
  std::string reason;
  // What automatic picks for demand fills in this process (CUDA_DEVICE_MAX_CONNECTIONS included).
  const expert_cache::FillEngine engine =
      p.choose_engines(expert_cache::FillUse::demand, &reason, expert_cache::cuda_work_queues_from_env()).forwards;
  d["engine"] = std::string(expert_cache::to_string(engine));
  d["reason"] = reason;
  d["text"] = p.serialize();
  d["describe"] = p.describe();
  return d;
}

py::dict wide_summary_dict(const expert_cache::WideSummary& w) {
  py::dict d;
  d["rounds"] = w.rounds;
  d["unique"] = w.unique;
  d["hits"] = w.hits;
  d["streamed"] = w.streamed;
  d["admitted"] = w.admitted;
  d["copies"] = w.copies;
  d["bytes"] = w.bytes;
  d["span_rounds"] = w.span_rounds;
  d["wasted"] = w.wasted;
  d["admission"] = std::string(expert_cache::to_string(w.admission));
  d["fell_back"] = w.fell_back;
  return d;
}

// Runs a wide forward whose rounds call the Python `consumer` with the round object `make(info)`
// returns. A Python exception in the consumer ends the forward (the library's error path: no
// round half-published) and is re-raised as it was once the library returned.
template <class Run, class Make>
py::dict run_wide(Run&& run, Make&& make, const py::object& consumer) {
  std::optional<py::error_already_set> raised;
  const ec::WideConsumerFn fn = [&](const ec::WideRoundInfo& info) -> expert_cache::Status {
    try {
      consumer(make(info));
      return {};
    } catch (py::error_already_set& e) {
      raised.emplace(std::move(e));
      return expert_cache::Status(expert_cache::ErrorCode::runtime_failure, "the wide consumer raised");
    }
  };
  const expert_cache::Result<expert_cache::WideSummary> r = run(fn);
  if (raised) throw std::move(*raised);
  check(r.status());
  return wide_summary_dict(r.value());
}

// {name: CUDA tensor [slot_count, *slot shape]} over one round's slot arrays (the pool, then the
// stream slots), aliasing cache memory through `alias`.
template <class Alias>
py::dict round_tensors(const std::vector<ec::SlotDescriptor>& slots, const ec::WideRoundInfo& info, Alias&& alias) {
  py::dict d;
  for (std::size_t t = 0; t < slots.size(); ++t) {
    const ec::SlotDescriptor& s = slots[t];
    const auto elem = static_cast<std::int64_t>(ec::element_size(s.dtype));
    std::vector<std::int64_t> sizes{info.slot_count};
    sizes.insert(sizes.end(), s.shape.begin(), s.shape.end());
    std::vector<std::int64_t> strides(sizes.size(), 1);
    for (std::size_t i = sizes.size() - 1; i > 1; --i) strides[i - 1] = strides[i] * sizes[i];
    strides[0] = static_cast<std::int64_t>(s.slot_stride) / elem;
    d[py::str(s.name)] = alias(info.slot_bases[t], sizes, strides, scalar_type_of(s.dtype));
  }
  return d;
}

// Whether the tensor's own bytes are page-locked and mapped (pin_memory(), or cudaHostRegister,
// also by another cache over the same tensor, which must then outlive this one).
// Tensor::is_pinned() asks about the start of the tensor's storage, which for a view into a
// larger allocation (host_empty's page-aligned views) is not the view's first byte.
bool host_bytes_pinned(const at::Tensor& t) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, t.data_ptr()) != cudaSuccess) {
    (void)cudaGetLastError();  // a failed query leaves its (non-sticky) error: clear it
    return false;
  }
  return a.type == cudaMemoryTypeHost;
}

// The round as Python sees it: a tuple (index, rounds, streamed, experts, slots, tensors,
// expert_map) that expert_cache_torch wraps in a WideRound.
template <class Alias>
py::tuple round_tuple(const std::vector<ec::SlotDescriptor>& slots, const ec::WideRoundInfo& info, std::int64_t experts,
                      Alias&& alias) {
  std::vector<std::int32_t> ids(info.experts.begin(), info.experts.end());
  std::vector<std::int32_t> where(info.slots.begin(), info.slots.end());
  return py::make_tuple(info.index, info.rounds, info.streamed, ids, where, round_tensors(slots, info, alias),
                        alias(info.expert_map, {experts}, {1}, at::kInt));
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) fail("cudaStreamIsCapturing failed");
  return status != cudaStreamCaptureStatusNone;
}

// The cache and the host tensors it reads, owned together: slot/map aliases hold this, so the
// host memory outlives the registration, and the cache (declared last) goes first.
struct Owned {
  std::vector<at::Tensor> host;  // the caller's host tensors
  std::unique_ptr<ec::CudaBridge> bridge;
};

class TorchCache {
 public:
  TorchCache(const std::string& layout, std::int64_t hidden, std::int64_t intermediate, std::int64_t group_size,
             const std::vector<std::pair<std::string, std::size_t>>& explicit_tensors, const std::string& provider,
             const std::string& policy, const std::string& staging, const std::string& storage, std::int32_t num_experts,
             std::int32_t capacity, std::int32_t top_k, std::int32_t max_ids, const std::string& label,
             const std::map<std::string, at::Tensor>& host_tensors, std::int32_t stream_slots,
             const std::string& fill_engine, const std::string& link_profile) {
    ec::BridgeConfig c;
    c.stream_slots = stream_slots;
    c.fill_engine = fill_engine;
    c.link_profile = link_profile;
    c.layout = ec::LayoutConfig{layout, hidden, intermediate, group_size, explicit_tensors};
    c.provider = provider;
    c.policy = policy;
    c.staging = staging;
    c.storage = storage;
    c.num_experts = num_experts;
    c.capacity = capacity;
    c.top_k = top_k;
    c.max_ids = max_ids;
    c.label = label;
    // A bad engine name or profile text is refused before CUDA is touched (the bridge checks
    // it again where it builds the cache).
    check(ec::fill_engine_choice(c).status());

    std::vector<ec::HostTensorArg> args;
    std::vector<at::Tensor> host;
    std::size_t pinned = 0;
    for (const auto& [name, t] : host_tensors) {
      if (!t.defined()) fail_value(label + ": host tensor '" + name + "' is undefined");
      if (t.device().type() != at::kCPU) fail_value(label + ": host tensor '" + name + "' must be a CPU tensor (got " + t.device().str() + ")");
      if (!t.is_contiguous()) fail_value(label + ": host tensor '" + name + "' must be contiguous");
      const bool is_pinned = host_bytes_pinned(t);
      pinned += is_pinned ? 1 : 0;
      std::vector<std::int64_t> shape(t.sizes().begin(), t.sizes().end());
      args.push_back(ec::HostTensorArg{name, t.data_ptr(), t.nbytes(), dtype_of(t.scalar_type()), shape, is_pinned});
      host.push_back(t);  // the cache reads this memory for its whole life
    }
    // Pinned tensors (tensor.pin_memory()) are already page-locked and mapped: not registered
    // again. A mix is refused by the bridge, after its checks of names, sizes and shapes.
    c.host_registered = pinned != 0;

    const c10::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();  // initialises CUDA
    device_ = stream.device_index();
    auto made = ec::make_cuda_bridge(c, args);
    check(made.status());
    owned_ = std::make_shared<Owned>(Owned{std::move(host), std::move(made.value())});
    bridge_ = owned_->bridge.get();
    num_experts_ = num_experts;
    label_ = label;
  }

  // (has_counts, hits, misses, generation), on torch's current stream. name_experts: a forward
  // wider than the slots is refused naming its experts (the vLLM surface's message).
  py::tuple prepare(const at::Tensor& ids, bool name_experts) {
    const std::string& label = label_;
    if (!ids.defined()) fail_value(label + ": topk_ids is undefined");
    if (ids.scalar_type() != at::kInt && ids.scalar_type() != at::kLong) {
      fail_value(label + ": topk_ids must be int32 or int64 (got " + std::string(c10::toString(ids.scalar_type())) + ")");
    }
    if (!ids.is_contiguous()) fail_value(label + ": topk_ids must be contiguous");
    if (!ids.is_cuda() && ids.device().type() != at::kCPU) fail_value(label + ": topk_ids must be a CPU or CUDA tensor");
    const expert_cache::Result<ec::PrepareResult> r = bridge_->device_provider() ? prepare_device(ids) : prepare_host(ids, name_experts);
    check(r.status());
    const ec::PrepareResult p = r.value();
    if (!p.has_counts) return py::make_tuple(false, py::none(), py::none(), p.generation);
    return py::make_tuple(true, p.hits, p.misses, p.generation);
  }

  // An explicit unique list (host providers), processed in its order.
  py::tuple prepare_unique(const std::vector<std::int64_t>& unique_ids) {
    const c10::cuda::CUDAStream stream = current_stream();
    if (!bridge_->device_provider() && capturing(stream.stream())) fail(not_capturable());
    const auto r = bridge_->prepare_unique(unique_ids, static_cast<void*>(stream.stream()));
    check(r.status());
    const ec::PrepareResult p = r.value();
    return py::make_tuple(true, p.hits, p.misses, p.generation);
  }

  // Speculative fills of predicted experts (int32/int64, distinct, in [0, E)). CPU ids: every
  // provider (the device provider uploads them). CUDA ids: the device provider plans them on the
  // device as they are (no synchronisation; capturable); a host-planned provider reads them back
  // first (one synchronisation of the current stream). `scores` (undefined: none): one
  // floating-point score per id (host_scores), the hints selected on the host (bridge.hpp
  // HintScores); with CUDA ids the device provider refuses them (its plan takes the ids as given).
  py::dict prefetch(const at::Tensor& ids, std::int64_t max_bytes, std::int64_t expires_after,
                    const std::optional<at::Tensor>& scores, double min_score, bool evict_last_forward) {
    if (!ids.defined()) fail_value(label_ + ": prefetch ids are undefined");
    if (ids.scalar_type() != at::kInt && ids.scalar_type() != at::kLong) {
      fail_value(label_ + ": prefetch ids must be int32 or int64 (got " + std::string(c10::toString(ids.scalar_type())) + ")");
    }
    const c10::cuda::CUDAStream stream = current_stream();
    if (scores && scores->defined() && scores->is_cuda() && capturing(stream.stream())) {
      fail(label_ + ": prefetch scores on the GPU are read back to the host (the hints are selected there), which a "
                    "CUDA graph cannot capture: pass CPU scores");
    }
    at::Tensor score_tensor;
    const ec::HintScores hints = hint_scores(scores, min_score, label_, score_tensor, evict_last_forward);
    if (ids.is_cuda() && bridge_->device_provider()) {
      if (ids.device().index() != device_) {
        fail_value(label_ + ": prefetch ids on " + ids.device().str() + ", the cache on cuda:" + std::to_string(device_));
      }
      last_prefetch_ids_ = ids.reshape({-1}).to(at::kInt).contiguous();
      const auto r = bridge_->prefetch_device(last_prefetch_ids_.data_ptr<std::int32_t>(), last_prefetch_ids_.numel(),
                                              max_bytes, expires_after, static_cast<void*>(stream.stream()), hints);
      check(r.status());
      return prefetch_dict(r.value());
    }
    if (ids.is_cuda() && capturing(stream.stream())) fail(not_capturable());
    if (!ids.is_cuda() && ids.device().type() != at::kCPU) fail_value(label_ + ": prefetch ids must be a CPU or CUDA tensor");
    const at::Tensor host = ids.reshape({-1}).to(at::TensorOptions().device(at::kCPU).dtype(at::kLong)).contiguous();
    const auto n = static_cast<std::size_t>(host.numel());
    const auto r = bridge_->prefetch_host(std::span<const std::int64_t>(host.data_ptr<std::int64_t>(), n), max_bytes,
                                          expires_after, static_cast<void*>(stream.stream()), hints);
    check(r.status());
    return prefetch_dict(r.value());
  }

  // The last prepare's misses and victims as (expert, slot) pairs (host providers; empty for
  // the device provider).
  std::vector<std::pair<std::int32_t, std::int32_t>> last_fills() const { return bridge_->last_fills(); }
  std::vector<std::pair<std::int32_t, std::int32_t>> last_evictions() const { return bridge_->last_evictions(); }
  py::object resident_map_host() {
    if (bridge_->device_provider()) return py::none();
    const auto m = bridge_->resident_map_host();
    at::Tensor t = at::empty({static_cast<std::int64_t>(m.size())}, at::TensorOptions().dtype(at::kInt));
    std::copy(m.begin(), m.end(), t.data_ptr<std::int32_t>());
    return py::cast(t);
  }

  void invalidate(std::int64_t expert) {
    const c10::cuda::CUDAStream stream = current_stream();
    check(bridge_->invalidate(expert, static_cast<void*>(stream.stream())));
  }

  // vLLM's invalidate (the vLLM-surface classes): an id the cache does not hold, in [0, E) or
  // not, is a no-op.
  void invalidate_if_held(std::int64_t expert) {
    const c10::cuda::CUDAStream stream = current_stream();
    check(ec::invalidate_if_held(*bridge_, num_experts_, expert, static_cast<void*>(stream.stream())));
  }

  // Device provider: its counters live in mapped host memory written by the device, so the
  // current stream is synchronised first (not inside a capture).
  py::dict stats() {
    if (bridge_->device_provider()) {
      const c10::cuda::CUDAStream stream = current_stream();
      if (!capturing(stream.stream())) stream.synchronize();
    }
    py::dict d;
    for (const ec::StatEntry& e : bridge_->stats()) {
      if (e.is_float) d[py::str(e.name)] = e.float_value;
      else d[py::str(e.name)] = e.int_value;
    }
    return d;
  }

  // Device provider: read and clear the device error word (bad ids, overflow); synchronises.
  std::uint32_t device_errors() {
    const c10::cuda::CUDAStream stream = current_stream();
    stream.synchronize();
    return bridge_->device_errors();
  }

  // A wide forward (ExpertCache::prepare_wide): host providers take CPU or CUDA ids (CUDA ids
  // are read back once), the device provider CUDA ids as they are; `consumer(round)` per round.
  py::dict prepare_wide(const at::Tensor& ids, const py::object& consumer, const std::string& admission,
                        const std::string& copy) {
    if (!ids.defined()) fail_value(label_ + ": topk_ids is undefined");
    if (ids.scalar_type() != at::kInt && ids.scalar_type() != at::kLong) {
      fail_value(label_ + ": topk_ids must be int32 or int64 (got " + std::string(c10::toString(ids.scalar_type())) + ")");
    }
    const c10::cuda::CUDAStream stream = current_stream();
    if (capturing(stream.stream())) fail(label_ + ": prepare_wide cannot be captured in a CUDA graph");
    const auto make = [&](const ec::WideRoundInfo& info) {
      return round_tuple(bridge_->slots(), info, num_experts_,
                         [&](std::uintptr_t p, std::vector<std::int64_t> sizes, std::vector<std::int64_t> strides,
                             at::ScalarType t) { return alias(p, std::move(sizes), std::move(strides), t); });
    };
    if (bridge_->device_provider()) {
      if (!ids.is_cuda()) fail_value(label_ + ": provider 'device' takes CUDA topk_ids; got a CPU tensor");
      if (ids.device().index() != device_) {
        fail_value(label_ + ": topk_ids on " + ids.device().str() + ", the cache on cuda:" + std::to_string(device_));
      }
      last_ids_ = ids.scalar_type() == at::kInt ? ids.reshape({-1}).contiguous() : ids.reshape({-1}).to(at::kInt);
      return run_wide(
          [&](const ec::WideConsumerFn& fn) {
            return bridge_->prepare_wide_device(last_ids_.data_ptr<std::int32_t>(), last_ids_.numel(), stream.stream(),
                                                fn, admission, copy);
          },
          make, consumer);
    }
    at::Tensor host = ids.reshape({-1});
    if (ids.is_cuda()) {
      host = host.to(at::TensorOptions().dtype(at::kLong).device(at::kCPU));  // one synchronisation
    } else {
      host = host.to(at::kLong).contiguous();
    }
    return run_wide(
        [&](const ec::WideConsumerFn& fn) {
          return bridge_->prepare_wide_host64(
              std::span<const std::int64_t>(host.data_ptr<std::int64_t>(), static_cast<std::size_t>(host.numel())),
              stream.stream(), fn, admission, copy);
        },
        make, consumer);
  }

  // Aliases of the slot arrays: [capacity, *slot shape], slot stride from the storage.
  py::dict slot_tensors() {
    py::dict d;
    for (const ec::SlotDescriptor& s : bridge_->slots()) {
      const at::ScalarType st = scalar_type_of(s.dtype);
      const auto elem = static_cast<std::int64_t>(ec::element_size(s.dtype));
      std::vector<std::int64_t> sizes{s.capacity};
      sizes.insert(sizes.end(), s.shape.begin(), s.shape.end());
      std::vector<std::int64_t> strides(sizes.size(), 1);
      for (std::size_t i = sizes.size() - 1; i > 1; --i) strides[i - 1] = strides[i] * sizes[i];
      if (s.slot_stride % static_cast<std::size_t>(elem) != 0) fail("slot stride is not a multiple of the element size");
      strides[0] = static_cast<std::int64_t>(s.slot_stride) / elem;
      d[py::str(s.name)] = alias(s.base, sizes, strides, st);
    }
    return d;
  }
  at::Tensor expert_map() { return alias(bridge_->expert_map_device(), {num_experts_}, {1}, at::kInt); }
  at::Tensor resident_map() { return alias(bridge_->resident_map_device(), {num_experts_}, {1}, at::kInt); }
  // Host providers: a CPU copy of this forward's map (E int32); None for the device provider.
  py::object expert_map_host() {
    if (bridge_->device_provider()) return py::none();
    const auto m = bridge_->expert_map_host();
    at::Tensor t = at::empty({static_cast<std::int64_t>(m.size())}, at::TensorOptions().dtype(at::kInt));
    std::copy(m.begin(), m.end(), t.data_ptr<std::int32_t>());
    return py::cast(t);
  }

  std::uintptr_t host_pointer(const std::string& name, std::int64_t expert) {
    auto r = bridge_->host_pointer(name, expert);
    check(r.status());
    return r.value();
  }

  std::string provider() const { return bridge_->provider(); }
  std::string policy() const { return bridge_->policy(); }
  std::string staging() const { return bridge_->staging(); }
  std::string storage() const { return bridge_->storage(); }
  bool device_provider() const { return bridge_->device_provider(); }
  // The device provider's resolved fill engine ("copy_engine" | "sm_loads"); None for host providers.
  py::object fill_engine() const {
    const std::string e = bridge_->fill_engine();
    return e.empty() ? py::object(py::none()) : py::object(py::str(e));
  }

 private:
  // Device provider: CUDA ids as they are, no synchronisation.
  expert_cache::Result<ec::PrepareResult> prepare_device(const at::Tensor& ids) {
    const c10::cuda::CUDAStream stream = current_stream();
    if (!ids.is_cuda()) fail_value(label_ + ": provider 'device' takes CUDA topk_ids (the router's output); got a CPU tensor");
    if (ids.device().index() != device_) {
      fail_value(label_ + ": topk_ids on " + ids.device().str() + ", the cache on cuda:" + std::to_string(device_));
    }
    // int64 -> int32 on the current stream (one small kernel; allowed inside a capture). Kept
    // until the next prepare so the plan kernel reads live memory.
    last_ids_ = ids.scalar_type() == at::kInt ? ids : ids.to(at::kInt);
    return bridge_->prepare_device(last_ids_.data_ptr<std::int32_t>(), last_ids_.numel(), stream.stream());
  }

  // Host-planned providers: CPU ids as they are; CUDA ids read back first (one synchronisation).
  expert_cache::Result<ec::PrepareResult> prepare_host(const at::Tensor& ids, bool name_experts) {
    const c10::cuda::CUDAStream stream = current_stream();
    if (capturing(stream.stream())) fail(not_capturable());
    at::Tensor host = ids;
    if (ids.is_cuda()) {
      // One copy into a reused pinned buffer on the current stream, then one synchronisation
      // of that stream (the plan needs the ids on the host).
      if (!pinned_ids_.defined() || pinned_ids_.scalar_type() != ids.scalar_type() || pinned_ids_.numel() < ids.numel()) {
        pinned_ids_ = at::empty({std::max<std::int64_t>(ids.numel(), 64)},
                                at::TensorOptions().dtype(ids.scalar_type()).device(at::kCPU).pinned_memory(true));
      }
      host = pinned_ids_.narrow(0, 0, ids.numel());
      host.copy_(ids.reshape({-1}), /*non_blocking=*/true);
      stream.synchronize();
    }
    const auto n = static_cast<std::size_t>(host.numel());
    if (host.scalar_type() == at::kInt) {
      return bridge_->prepare_host32(std::span<const std::int32_t>(host.data_ptr<std::int32_t>(), n), stream.stream(),
                                     name_experts);
    }
    return bridge_->prepare_host64(std::span<const std::int64_t>(host.data_ptr<std::int64_t>(), n), stream.stream(),
                                   name_experts);
  }

  std::string not_capturable() const {
    return label_ + ": provider '" + bridge_->provider() +
           "' plans on the host and cannot be captured in a CUDA graph (a replay would repeat this forward's "
           "plan); capture with provider 'device'";
  }

  c10::cuda::CUDAStream current_stream() const {
    const c10::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
    if (stream.device_index() != device_) {
      fail("the current CUDA device is cuda:" + std::to_string(stream.device_index()) + ", the cache lives on cuda:" +
           std::to_string(device_));
    }
    return stream;
  }

  // A CUDA tensor over cache memory, no copy. Its deleter frees nothing; it holds the cache and
  // its host tensors, so a tensor outliving the Python cache object keeps the memory valid.
  at::Tensor alias(std::uintptr_t p, std::vector<std::int64_t> sizes, std::vector<std::int64_t> strides, at::ScalarType t) {
    std::shared_ptr<Owned> keep = owned_;
    return torch::from_blob(reinterpret_cast<void*>(p), sizes, strides, [keep](void*) {},
                            at::TensorOptions().dtype(t).device(at::kCUDA, device_));
  }

  std::shared_ptr<Owned> owned_;
  ec::CudaBridge* bridge_ = nullptr;  // owned_->bridge
  at::Tensor pinned_ids_;         // host-planned + CUDA ids: the pinned read-back buffer
  at::Tensor last_ids_;           // device provider: the ids the last plan reads
  at::Tensor last_prefetch_ids_;  // device provider: the ids the last device prefetch reads
  c10::DeviceIndex device_ = 0;
  std::int64_t num_experts_ = 0;
  std::string label_ = "expert_cache";
};

// The model-level cache (model_bridge.hpp): one object for all MoE layers. Host tensors are
// [L, E, ...] per layout tensor; ids are host-planned (CUDA ids read back once per prepare).
struct OwnedModel {
  std::vector<at::Tensor> host;
  std::unique_ptr<ec::CudaModelBridge> bridge;
};

class TorchModelCache {
 public:
  TorchModelCache(const std::string& layout, std::int64_t hidden, std::int64_t intermediate, std::int64_t group_size,
                  const std::vector<std::pair<std::string, std::size_t>>& explicit_tensors, const std::string& policy,
                  const std::string& pool, std::int32_t num_layers, std::int32_t num_experts, std::int32_t capacity,
                  const std::vector<std::int32_t>& layer_capacities, std::int32_t top_k, const std::string& label,
                  const std::map<std::string, at::Tensor>& host_tensors, std::int32_t stream_slots)
      : label_(label) {
    ec::ModelBridgeConfig c;
    c.stream_slots = stream_slots;
    c.layout = ec::LayoutConfig{layout, hidden, intermediate, group_size, explicit_tensors};
    c.policy = policy;
    c.pool = pool;
    c.num_layers = num_layers;
    c.num_experts = num_experts;
    c.capacity = capacity;
    c.layer_capacities = layer_capacities;
    c.top_k = top_k;
    c.label = label;
    std::vector<ec::HostTensorArg> args;
    std::vector<at::Tensor> host;
    std::size_t pinned = 0;
    for (const auto& [name, t] : host_tensors) {
      if (!t.defined()) fail_value(label + ": host tensor '" + name + "' is undefined");
      if (t.device().type() != at::kCPU) {
        fail_value(label + ": host tensor '" + name + "' must be a CPU tensor (got " + t.device().str() + ")");
      }
      if (!t.is_contiguous()) fail_value(label + ": host tensor '" + name + "' must be contiguous");
      const bool is_pinned = host_bytes_pinned(t);
      pinned += is_pinned ? 1 : 0;
      std::vector<std::int64_t> shape(t.sizes().begin(), t.sizes().end());
      args.push_back(ec::HostTensorArg{name, t.data_ptr(), t.nbytes(), dtype_of(t.scalar_type()), shape, is_pinned});
      host.push_back(t);
    }
    c.host_registered = pinned != 0;  // a mix is refused by the bridge, after its other checks
    const c10::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();  // initialises CUDA
    device_ = stream.device_index();
    auto made = ec::make_cuda_model_bridge(c, args);
    check(made.status());
    owned_ = std::make_shared<OwnedModel>(OwnedModel{std::move(host), std::move(made.value())});
    bridge_ = owned_->bridge.get();
    num_experts_ = num_experts;
    num_layers_ = num_layers;
  }

  // (hits, misses, generation) of layer `layer`'s forward, on torch's current stream.
  py::tuple prepare(std::int32_t layer, const at::Tensor& ids) {
    check_id_tensor(ids, "topk_ids", false);
    const c10::cuda::CUDAStream stream = host_planning_stream();
    // One copy into a pinned int64 buffer on the current stream, one synchronisation (CUDA ids).
    at::Tensor host = ids.reshape({-1});
    if (ids.is_cuda()) {
      if (!pinned_ids_.defined() || pinned_ids_.numel() < ids.numel()) {
        pinned_ids_ = at::empty({std::max<std::int64_t>(ids.numel(), 64)},
                                at::TensorOptions().dtype(at::kLong).device(at::kCPU).pinned_memory(true));
      }
      at::Tensor dst = pinned_ids_.narrow(0, 0, ids.numel());
      dst.copy_(host, /*non_blocking=*/true);
      stream.synchronize();
      host = dst;
    } else {
      host = host.to(at::kLong).contiguous();
    }
    const auto r = bridge_->prepare(layer, std::span<const std::int64_t>(host.data_ptr<std::int64_t>(),
                                                                         static_cast<std::size_t>(host.numel())),
                                    static_cast<void*>(stream.stream()));
    check(r.status());
    return py::make_tuple(r.value().hits, r.value().misses, r.value().generation);
  }
  // A wide forward of layer `layer` (ModelExpertCache::prepare_wide); CUDA ids read back once.
  py::dict prepare_wide(std::int32_t layer, const at::Tensor& ids, const py::object& consumer,
                        const std::string& admission, const std::string& copy) {
    if (!ids.defined()) fail_value(label_ + ": topk_ids is undefined");
    if (ids.scalar_type() != at::kInt && ids.scalar_type() != at::kLong) {
      fail_value(label_ + ": topk_ids must be int32 or int64 (got " + std::string(c10::toString(ids.scalar_type())) + ")");
    }
    const c10::cuda::CUDAStream stream = current_stream();
    if (capturing(stream.stream())) fail(label_ + ": prepare_wide cannot be captured in a CUDA graph");
    const at::Tensor host = ids.reshape({-1}).to(at::TensorOptions().dtype(at::kLong).device(at::kCPU)).contiguous();
    return run_wide(
        [&](const ec::WideConsumerFn& fn) {
          return bridge_->prepare_wide(
              layer, std::span<const std::int64_t>(host.data_ptr<std::int64_t>(), static_cast<std::size_t>(host.numel())),
              stream.stream(), fn, admission, copy);
        },
        [&](const ec::WideRoundInfo& info) {
          return round_tuple(bridge_->slots(), info, num_experts_,
                             [&](std::uintptr_t p, std::vector<std::int64_t> sizes, std::vector<std::int64_t> strides,
                                 at::ScalarType t) { return alias(p, std::move(sizes), std::move(strides), t); });
        },
        consumer);
  }
  py::tuple prepare_unique(std::int32_t layer, const std::vector<std::int64_t>& unique_ids) {
    const c10::cuda::CUDAStream stream = host_planning_stream();
    const auto r = bridge_->prepare_unique(layer, unique_ids, static_cast<void*>(stream.stream()));
    check(r.status());
    return py::make_tuple(r.value().hits, r.value().misses, r.value().generation);
  }
  void invalidate(std::int32_t layer, std::int64_t expert) {
    const c10::cuda::CUDAStream stream = current_stream();
    check(bridge_->invalidate(layer, expert, static_cast<void*>(stream.stream())));
  }
  // Speculative fills of layer `layer`'s predicted experts (int32/int64, distinct, in [0, E), best
  // first). The model cache plans on the host: CUDA ids are read back first (one synchronisation
  // of the current stream), and it cannot be captured. `scores` as ExpertCache.prefetch takes them.
  py::dict prefetch(std::int32_t layer, const at::Tensor& ids, std::int64_t max_bytes, std::int64_t expires_after,
                    const std::optional<at::Tensor>& scores, double min_score, bool evict_last_forward) {
    check_id_tensor(ids, "prefetch ids", true);
    const c10::cuda::CUDAStream stream = host_planning_stream();
    at::Tensor score_tensor;
    const ec::HintScores hints = hint_scores(scores, min_score, label_, score_tensor, evict_last_forward);
    const at::Tensor host = ids.reshape({-1}).to(at::TensorOptions().device(at::kCPU).dtype(at::kLong)).contiguous();
    const auto r = bridge_->prefetch(layer,
                                     std::span<const std::int64_t>(host.data_ptr<std::int64_t>(),
                                                                   static_cast<std::size_t>(host.numel())),
                                     max_bytes, expires_after, static_cast<void*>(stream.stream()), hints);
    check(r.status());
    return prefetch_dict(r.value());
  }
  // {"total": {...}, "per_layer": [{...}, ...]}
  py::dict stats() {
    const auto all = bridge_->stats();
    const auto dict_of = [](const std::vector<ec::StatEntry>& v) {
      py::dict d;
      for (const ec::StatEntry& e : v) {
        if (e.is_float) d[py::str(e.name)] = e.float_value;
        else d[py::str(e.name)] = e.int_value;
      }
      return d;
    };
    py::dict out;
    out["total"] = dict_of(all.front());
    py::list layers;
    for (std::size_t l = 1; l < all.size(); ++l) layers.append(dict_of(all[l]));
    out["per_layer"] = layers;
    return out;
  }
  // Layer `layer`'s slot tensors [capacity of its view, *slot shape] (global: the pool's).
  py::dict layer_tensors(std::int32_t layer) {
    const ec::LayerDescriptor& ld = layer_of(layer);
    py::dict d;
    const auto& slots = bridge_->slots();
    for (std::size_t t = 0; t < slots.size(); ++t) {
      const ec::SlotDescriptor& s = slots[t];
      const auto elem = static_cast<std::int64_t>(ec::element_size(s.dtype));
      std::vector<std::int64_t> sizes{ld.capacity};
      sizes.insert(sizes.end(), s.shape.begin(), s.shape.end());
      std::vector<std::int64_t> strides(sizes.size(), 1);
      for (std::size_t i = sizes.size() - 1; i > 1; --i) strides[i - 1] = strides[i] * sizes[i];
      if (s.slot_stride % static_cast<std::size_t>(elem) != 0) fail("slot stride is not a multiple of the element size");
      strides[0] = static_cast<std::int64_t>(s.slot_stride) / elem;
      d[py::str(s.name)] = alias(ld.slot_bases[t], sizes, strides, scalar_type_of(s.dtype));
    }
    return d;
  }
  at::Tensor expert_map(std::int32_t layer) { return alias(layer_of(layer).expert_map, {num_experts_}, {1}, at::kInt); }
  at::Tensor resident_map(std::int32_t layer) {
    return alias(layer_of(layer).resident_map, {num_experts_}, {1}, at::kInt);
  }
  at::Tensor expert_map_host(std::int32_t layer) {
    auto r = bridge_->forward_map_host(layer);
    check(r.status());
    const std::vector<std::int32_t>& m = r.value();
    at::Tensor t = at::empty({static_cast<std::int64_t>(m.size())}, at::TensorOptions().dtype(at::kInt));
    std::copy(m.begin(), m.end(), t.data_ptr<std::int32_t>());
    return t;
  }
  std::uintptr_t host_pointer(std::int32_t layer, const std::string& name, std::int64_t expert) {
    const auto& slots = bridge_->slots();
    std::size_t t = 0;
    while (t < slots.size() && slots[t].name != name) ++t;
    if (t == slots.size()) fail_value(label_ + ": host_pointer: unknown tensor '" + name + "'");
    auto r = bridge_->host_pointer(layer, t, expert);
    check(r.status());
    return r.value();
  }
  std::string policy() const { return bridge_->policy(); }

 private:
  // Ids the model cache reads: defined, int32 or int64, on the CPU or a CUDA device. `what` names
  // them in the errors ("<what> is undefined", or "are" when `plural`).
  void check_id_tensor(const at::Tensor& ids, const char* what, bool plural) const {
    if (!ids.defined()) fail_value(label_ + ": " + what + (plural ? " are" : " is") + " undefined");
    if (ids.scalar_type() != at::kInt && ids.scalar_type() != at::kLong) {
      fail_value(label_ + ": " + what + " must be int32 or int64 (got " + std::string(c10::toString(ids.scalar_type())) + ")");
    }
    if (!ids.is_cuda() && ids.device().type() != at::kCPU) fail_value(label_ + ": " + what + " must be a CPU or CUDA tensor");
  }
  // torch's current stream, refused while it captures: the model cache plans on the host.
  c10::cuda::CUDAStream host_planning_stream() const {
    const c10::cuda::CUDAStream stream = current_stream();
    if (capturing(stream.stream())) {
      fail(label_ + ": the model cache plans on the host and cannot be captured in a CUDA graph");
    }
    return stream;
  }
  const ec::LayerDescriptor& layer_of(std::int32_t layer) const {
    if (layer < 0 || layer >= num_layers_) {
      fail_value(label_ + ": layer " + std::to_string(layer) + " out of range [0, " + std::to_string(num_layers_) + ")");
    }
    return bridge_->layers()[static_cast<std::size_t>(layer)];
  }
  c10::cuda::CUDAStream current_stream() const {
    const c10::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
    if (stream.device_index() != device_) {
      fail("the current CUDA device is cuda:" + std::to_string(stream.device_index()) + ", the cache lives on cuda:" +
           std::to_string(device_));
    }
    return stream;
  }
  at::Tensor alias(std::uintptr_t p, std::vector<std::int64_t> sizes, std::vector<std::int64_t> strides, at::ScalarType t) {
    std::shared_ptr<OwnedModel> keep = owned_;
    return torch::from_blob(reinterpret_cast<void*>(p), sizes, strides, [keep](void*) {},
                            at::TensorOptions().dtype(t).device(at::kCUDA, device_));
  }

  std::shared_ptr<OwnedModel> owned_;
  ec::CudaModelBridge* bridge_ = nullptr;
  at::Tensor pinned_ids_;
  c10::DeviceIndex device_ = 0;
  std::int64_t num_experts_ = 0;
  std::int32_t num_layers_ = 0;
  std::string label_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "expert_cache: GPU expert cache for MoE inference (use the expert_cache_torch package)";
  auto& error = py::register_exception<ExpertCacheError>(m, "ExpertCacheError", PyExc_RuntimeError);
  // A subclass of ExpertCacheError and ValueError: the bases as a tuple (PyErr_NewException takes one).
  py::register_exception<ExpertCacheValueError>(m, "ExpertCacheValueError",
                                                py::make_tuple(error, py::handle(PyExc_ValueError)));
  py::class_<TorchCache, std::shared_ptr<TorchCache>>(m, "Cache")
      .def(py::init([](const std::string& layout, std::int64_t hidden, std::int64_t intermediate, std::int64_t group_size,
                       const std::vector<std::pair<std::string, std::size_t>>& explicit_tensors, const std::string& provider,
                       const std::string& policy, const std::string& staging, const std::string& storage,
                       std::int32_t num_experts, std::int32_t capacity, std::int32_t top_k, std::int32_t max_ids,
                       const std::string& label, const std::map<std::string, at::Tensor>& host_tensors,
                       std::int32_t stream_slots, const std::string& fill_engine, const std::string& link_profile) {
             return std::make_shared<TorchCache>(layout, hidden, intermediate, group_size, explicit_tensors, provider,
                                                 policy, staging, storage, num_experts, capacity, top_k, max_ids, label,
                                                 host_tensors, stream_slots, fill_engine, link_profile);
           }),
           py::arg("layout"), py::arg("hidden"), py::arg("intermediate"), py::arg("group_size"),
           py::arg("explicit_tensors"), py::arg("provider"), py::arg("policy"), py::arg("staging"), py::arg("storage"),
           py::arg("num_experts"), py::arg("capacity"), py::arg("top_k"), py::arg("max_ids"), py::arg("label"),
           py::arg("host_tensors"), py::arg("stream_slots") = 0, py::arg("fill_engine") = "automatic",
           py::arg("link_profile") = "")
      .def("prepare_wide", &TorchCache::prepare_wide, py::arg("topk_ids"), py::arg("consumer"),
           py::arg("admission") = "stream", py::arg("copy") = "automatic")
      .def("prepare", &TorchCache::prepare, py::arg("topk_ids"), py::arg("name_experts") = false)
      .def("prepare_unique", &TorchCache::prepare_unique, py::arg("unique_ids"))
      .def("prefetch", &TorchCache::prefetch, py::arg("ids"), py::arg("max_bytes"), py::arg("expires_after"),
           py::arg("scores") = py::none(), py::arg("min_score") = static_cast<double>(expert_cache::default_min_score),
           py::arg("evict_last_forward") = false)
      .def("last_fills", &TorchCache::last_fills)
      .def("last_evictions", &TorchCache::last_evictions)
      .def("resident_map_host", &TorchCache::resident_map_host)
      .def("invalidate", &TorchCache::invalidate, py::arg("expert"))
      .def("invalidate_if_held", &TorchCache::invalidate_if_held, py::arg("expert"))
      .def("stats", &TorchCache::stats)
      .def("device_errors", &TorchCache::device_errors)
      .def("slot_tensors", &TorchCache::slot_tensors)
      .def("expert_map", &TorchCache::expert_map)
      .def("resident_map", &TorchCache::resident_map)
      .def("expert_map_host", &TorchCache::expert_map_host)
      .def("host_pointer", &TorchCache::host_pointer, py::arg("name"), py::arg("expert"))
      .def_property_readonly("provider", &TorchCache::provider)
      .def_property_readonly("policy", &TorchCache::policy)
      .def_property_readonly("staging", &TorchCache::staging)
      .def_property_readonly("storage", &TorchCache::storage)
      .def_property_readonly("device_provider", &TorchCache::device_provider)
      .def_property_readonly("fill_engine", &TorchCache::fill_engine);

  // ---- the link profile (staging/link_probe.cuh, through bridge_cuda.cu) ----
  m.def("link_profile",
        [](std::int64_t device, std::int64_t expert_bytes) {
          const expert_cache::Result<expert_cache::LinkProfile> r = [&] {
            py::gil_scoped_release released;  // the first call of a (device, size) pair measures
            return ec::cuda_link_profile(device, expert_bytes);
          }();
          check(r.status());
          return link_profile_dict(r.value());
        },
        py::arg("device"), py::arg("expert_bytes"));
  m.def("set_link_profile", [](const std::string& text) { check(ec::cuda_set_link_profile(text)); }, py::arg("text"));

  py::class_<TorchModelCache, std::shared_ptr<TorchModelCache>>(m, "ModelCache")
      .def(py::init([](const std::string& layout, std::int64_t hidden, std::int64_t intermediate, std::int64_t group_size,
                       const std::vector<std::pair<std::string, std::size_t>>& explicit_tensors, const std::string& policy,
                       const std::string& pool, std::int32_t num_layers, std::int32_t num_experts, std::int32_t capacity,
                       const std::vector<std::int32_t>& layer_capacities, std::int32_t top_k, const std::string& label,
                       const std::map<std::string, at::Tensor>& host_tensors, std::int32_t stream_slots) {
             return std::make_shared<TorchModelCache>(layout, hidden, intermediate, group_size, explicit_tensors, policy,
                                                      pool, num_layers, num_experts, capacity, layer_capacities, top_k,
                                                      label, host_tensors, stream_slots);
           }),
           py::arg("layout"), py::arg("hidden"), py::arg("intermediate"), py::arg("group_size"),
           py::arg("explicit_tensors"), py::arg("policy"), py::arg("pool"), py::arg("num_layers"),
           py::arg("num_experts"), py::arg("capacity"), py::arg("layer_capacities"), py::arg("top_k"),
           py::arg("label"), py::arg("host_tensors"), py::arg("stream_slots") = 0)
      .def("prepare", &TorchModelCache::prepare, py::arg("layer"), py::arg("topk_ids"))
      .def("prepare_wide", &TorchModelCache::prepare_wide, py::arg("layer"), py::arg("topk_ids"), py::arg("consumer"),
           py::arg("admission") = "stream", py::arg("copy") = "automatic")
      .def("prepare_unique", &TorchModelCache::prepare_unique, py::arg("layer"), py::arg("unique_ids"))
      .def("invalidate", &TorchModelCache::invalidate, py::arg("layer"), py::arg("expert"))
      .def("prefetch", &TorchModelCache::prefetch, py::arg("layer"), py::arg("ids"), py::arg("max_bytes"),
           py::arg("expires_after"), py::arg("scores") = py::none(),
           py::arg("min_score") = static_cast<double>(expert_cache::default_min_score),
           py::arg("evict_last_forward") = false)
      .def("stats", &TorchModelCache::stats)
      .def("layer_tensors", &TorchModelCache::layer_tensors, py::arg("layer"))
      .def("expert_map", &TorchModelCache::expert_map, py::arg("layer"))
      .def("resident_map", &TorchModelCache::resident_map, py::arg("layer"))
      .def("expert_map_host", &TorchModelCache::expert_map_host, py::arg("layer"))
      .def("host_pointer", &TorchModelCache::host_pointer, py::arg("layer"), py::arg("name"), py::arg("expert"))
      .def_property_readonly("policy", &TorchModelCache::policy);

  // ---- the vLLM-surface providers' torch-free checks (vllm_bridge.hpp) ----
  // records: (name, given, dtype, element size, shape) -> (E, capacity,
  // [(name, slot name, dtype, bytes per expert, trailing shape)]).
  m.def("validate_provider_sources",
        [](std::int64_t capacity,
           const std::vector<std::tuple<std::string, bool, std::string, std::size_t, std::vector<std::int64_t>>>& records,
           const std::string& label) {
          std::vector<ec::SourceArg> args;
          for (const auto& [name, given, dtype, element_size, shape] : records) {
            args.push_back(ec::SourceArg{name, given, dtype, element_size, shape});
          }
          auto r = ec::validate_provider_sources(capacity, args, label);
          check(r.status());
          py::list sources;
          for (const ec::ProviderSource& s : r.value().sources) {
            sources.append(py::make_tuple(s.name, s.slot_name, s.dtype, s.bytes_per_expert, s.trailing));
          }
          return py::make_tuple(r.value().num_experts, r.value().capacity, sources);
        },
        py::arg("capacity"), py::arg("records"), py::arg("label"));
  // The fill engine and stored link profile of a cache of `provider` checked (fill_engine_choice),
  // before its sources are pinned; -> the engine named (automatic unresolved).
  m.def("check_fill_engine",
        [](const std::string& provider, const std::string& fill_engine, const std::string& link_profile,
           const std::string& label) {
          ec::BridgeConfig c;
          c.provider = provider;
          c.fill_engine = fill_engine;
          c.link_profile = link_profile;
          c.label = label;
          auto r = ec::fill_engine_choice(c);
          check(r.status());
          return std::string(expert_cache::to_string(r.value().engine));
        },
        py::arg("provider"), py::arg("fill_engine"), py::arg("link_profile"), py::arg("label"));
  m.def("provider_semantics",
        [](const std::string& semantics, const std::string& policy) {
          auto r = ec::provider_semantics(semantics, policy);
          check(r.status());
          return py::make_tuple(r.value().provider, r.value().policy);
        },
        py::arg("semantics"), py::arg("policy"));
  // The order a scored prefetch of `ids` considers them (HintSelector): what the vLLM-surface
  // providers' compatibility state follows after one. `scores` as prefetch takes them.
  m.def("prefetch_order",
        [](const std::vector<std::int64_t>& ids, const at::Tensor& scores, double min_score) {
          const at::Tensor host = host_scores(scores, "prefetch_order");
          auto r = ec::prefetch_order(ids, std::span<const float>(host.data_ptr<float>(), static_cast<std::size_t>(host.numel())),
                                      static_cast<float>(min_score));
          check(r.status());
          return r.value();
        },
        py::arg("ids"), py::arg("scores"), py::arg("min_score"));
  // -> [(row_begin, row_end, unique ids, include_shared)]
  m.def("plan_split",
        [](const std::vector<std::int64_t>& ids, std::int32_t top_k, std::int32_t capacity, std::int32_t num_experts,
           const std::string& split) {
          auto r = ec::plan_split(ids, top_k, capacity, num_experts, split);
          check(r.status());
          py::list parts;
          for (const ec::SplitPart& p : r.value()) {
            parts.append(py::make_tuple(p.row_begin, p.row_end, p.unique_ids, p.include_shared));
          }
          return parts;
        },
        py::arg("ids"), py::arg("top_k"), py::arg("capacity"), py::arg("num_experts"), py::arg("split"));
  py::class_<ec::ReferencePlanner, std::shared_ptr<ec::ReferencePlanner>>(m, "ReferencePlanner")
      .def(py::init([](const std::string& policy, std::int32_t num_experts, std::int32_t capacity, std::int32_t top_k) {
             auto r = ec::ReferencePlanner::create(policy, num_experts, capacity, top_k);
             check(r.status());
             return std::shared_ptr<ec::ReferencePlanner>(std::move(r.value()));
           }),
           py::arg("policy"), py::arg("num_experts"), py::arg("capacity"), py::arg("top_k") = 1)
      // -> (hits, misses, fills [(expert, slot)], evictions [(expert, slot)])
      .def("plan",
           [](ec::ReferencePlanner& p, const std::vector<std::int32_t>& ids, bool unique) {
             auto r = p.plan(ids, unique);
             check(r.status());
             return py::make_tuple(r.value().hits, r.value().misses, r.value().fills, r.value().evictions);
           },
           py::arg("ids"), py::arg("unique") = false)
      .def("invalidate", [](ec::ReferencePlanner& p, std::int32_t e) { check(p.invalidate(e)); }, py::arg("expert"))
      .def("forward_map", &ec::ReferencePlanner::forward_map)
      .def("resident_map", &ec::ReferencePlanner::resident_map);
}
