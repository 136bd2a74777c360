#pragma once
// ModelBridge<Runtime>: the model-level cache (ModelExpertCache: one object for all MoE layers,
// per-layer slots or one global pool) as the PyTorch extension drives it, in plain data and
// torch-free like CacheBridge (bridge.hpp): every config value and host tensor is validated
// before the cache is touched, the eviction policy is chosen by name, and the per-layer slot
// arrays and maps are described as raw device pointers.
//
// Host tensors: one per layout tensor, [L, E, ...] (or [L * E, ...], or uint8 bytes), layer-major
// as ModelCacheOptions::memory takes them; registered in place, never copied. Staging: the copy
// stream (the row provider's), the storage tensor-major (the caller's arrays).
//
// Host tier: g++ alone (bridge_cuda.cu instantiates it for CudaRuntime).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "bridge.hpp"
#include "expert_cache/cache/model_cache.hpp"

namespace expert_cache::inline v0::python {

struct ModelBridgeConfig {
  LayoutConfig layout;
  std::string policy;  // "" = lru
  std::string pool = "per_layer";  // per_layer | global
  std::int32_t num_layers = 0;
  std::int32_t num_experts = 0;  // per layer
  std::int32_t capacity = 0;     // per layer (per_layer) or of the pool (global)
  std::vector<std::int32_t> layer_capacities;  // per_layer only, optional
  std::int32_t top_k = 1;
  std::int32_t stream_slots = 0;  // slots after the pool(s) for wide forwards (ModelCacheOptions::stream_slots)
  std::string label = "model_expert_cache";
  bool host_registered = false;
};

// One layer's slot arrays (the pool's in global mode) and maps.
struct LayerDescriptor {
  std::int32_t capacity = 0;  // slots this layer's view indexes
  std::vector<std::uintptr_t> slot_bases;  // per layout tensor (same order as the bridge's slots())
  std::uintptr_t expert_map = 0;
  std::uintptr_t resident_map = 0;
};

namespace detail {

template <class Runtime>
class ModelCacheBase {
 public:
  using Stream = typename Runtime::Stream;
  virtual ~ModelCacheBase() = default;
  virtual Result<ForwardView> prepare(std::int32_t layer, std::span<const std::int32_t> ids, Stream s) noexcept = 0;
  virtual Result<ForwardView> prepare_unique(std::int32_t layer, std::span<const std::int32_t> ids, Stream s) noexcept = 0;
  virtual Result<WideSummary> prepare_wide(std::int32_t layer, std::span<const std::int32_t> ids, Stream s,
                                           ::expert_cache::detail::WideConsumerRef consumer,
                                           WideOptions options) noexcept = 0;
  virtual Status invalidate(std::int32_t layer, std::int32_t expert, Stream s) noexcept = 0;
  virtual Result<PrefetchView> prefetch(std::int32_t layer, std::span<const std::int32_t> ids, Stream s,
                                        PrefetchOptions options) noexcept = 0;
  [[nodiscard]] virtual ModelCacheStats stats() const = 0;
  [[nodiscard]] virtual Result<ForwardView> layer_view(std::int32_t layer) const noexcept = 0;
  [[nodiscard]] virtual std::span<const std::int32_t> forward_map_host(std::int32_t layer) const noexcept = 0;
  [[nodiscard]] virtual std::int32_t layer_capacity(std::int32_t layer) const noexcept = 0;
  [[nodiscard]] virtual const ExpertTensorBytes& tensors() const noexcept = 0;
  [[nodiscard]] virtual std::byte* host_tensor(std::int32_t layer, std::size_t t, std::int32_t expert) const noexcept = 0;
  [[nodiscard]] virtual std::string_view policy() const noexcept = 0;
};

template <class Runtime, class Cache>
class ModelCacheModel final : public ModelCacheBase<Runtime> {
 public:
  using Stream = typename Runtime::Stream;
  template <class... Args>
  explicit ModelCacheModel(std::string_view policy, Args&&... args)
      : policy_(policy), cache_(std::forward<Args>(args)...) {}
  Result<ForwardView> prepare(std::int32_t layer, std::span<const std::int32_t> ids, Stream s) noexcept override {
    return cache_.prepare(layer, ids, s);
  }
  Result<PrefetchView> prefetch(std::int32_t layer, std::span<const std::int32_t> ids, Stream s,
                                PrefetchOptions options) noexcept override {
    return cache_.prefetch(layer, ids, s, options);
  }
  Result<ForwardView> prepare_unique(std::int32_t layer, std::span<const std::int32_t> ids, Stream s) noexcept override {
    return cache_.prepare_unique(layer, ids, s);
  }
  Result<WideSummary> prepare_wide(std::int32_t layer, std::span<const std::int32_t> ids, Stream s,
                                   ::expert_cache::detail::WideConsumerRef consumer, WideOptions options) noexcept override {
    return cache_.prepare_wide(layer, ids, s, consumer, options);
  }
  Status invalidate(std::int32_t layer, std::int32_t expert, Stream s) noexcept override {
    return cache_.invalidate(layer, expert, s);
  }
  [[nodiscard]] ModelCacheStats stats() const override { return cache_.stats(); }
  [[nodiscard]] Result<ForwardView> layer_view(std::int32_t layer) const noexcept override { return cache_.layer_view(layer); }
  [[nodiscard]] std::span<const std::int32_t> forward_map_host(std::int32_t layer) const noexcept override {
    return cache_.forward_map_host(layer);
  }
  [[nodiscard]] std::int32_t layer_capacity(std::int32_t layer) const noexcept override {
    return cache_.layer_capacity(layer);
  }
  [[nodiscard]] const ExpertTensorBytes& tensors() const noexcept override { return cache_.storage().tensors(); }
  [[nodiscard]] std::byte* host_tensor(std::int32_t layer, std::size_t t, std::int32_t expert) const noexcept override {
    return cache_.host_tensor(layer, t, expert);
  }
  [[nodiscard]] std::string_view policy() const noexcept override { return policy_; }

 private:
  std::string_view policy_;  // a static name (AnyPolicy::names)
  Cache cache_;
};

}  // namespace detail

template <allocating_runtime Runtime>
class ModelBridge {
 public:
  using Stream = typename Runtime::Stream;

  static Result<std::unique_ptr<ModelBridge>> create(Runtime& rt, const ModelBridgeConfig& config,
                                                     std::span<const HostTensorArg> host) {
    const std::string& label = config.label;
    auto typed = detail::typed_tensors(config.layout);
    if (!typed.ok()) return typed.status().with_context("%s", label.c_str());
    std::unique_ptr<ModelBridge> b(new ModelBridge());
    b->typed_ = std::move(typed.value());
    b->config_ = config;
    if (config.num_layers < 1 || config.num_layers > (1 << 16)) {
      return Status::format(ErrorCode::invalid_argument, "%s: num_layers %d (accepted: 1..65536)", label.c_str(),
                            config.num_layers);
    }
    if (config.num_experts < 1 || static_cast<std::int64_t>(config.num_layers) * config.num_experts > model_max_experts) {
      return Status::format(ErrorCode::invalid_argument, "%s: num_experts %d per layer (accepted: 1, L * E <= 2^26)",
                            label.c_str(), config.num_experts);
    }
    ModelPool pool;
    if (config.pool == "per_layer") {
      pool = ModelPool::per_layer;
    } else if (config.pool == "global") {
      pool = ModelPool::global;
    } else {
      return Status::format(ErrorCode::invalid_argument, "%s: unknown pool '%.*s' (valid: per_layer, global)",
                            label.c_str(), static_cast<int>(std::min<std::size_t>(config.pool.size(), 40)),
                            config.pool.c_str());
    }
    constexpr auto policy_names = AnyPolicy::names;
    const std::string_view policy_name = config.policy.empty() ? std::string_view("lru") : std::string_view(config.policy);
    const std::optional<std::size_t> policy = AnyPolicy::index_of(policy_name);
    if (!policy) {
      return Status::format(ErrorCode::invalid_argument, "%s: unknown eviction policy '%.*s' (valid: %s)", label.c_str(),
                            static_cast<int>(std::min<std::size_t>(policy_name.size(), 40)), policy_name.data(),
                            ::expert_cache::detail::NameListText(policy_names).text);
    }

    // ---- host tensors: [L * E] experts per layout tensor, exact size, aligned, dtype/shape ----
    const auto LE = static_cast<std::size_t>(config.num_layers) * static_cast<std::size_t>(config.num_experts);
    std::vector<const HostTensorArg*> given(b->typed_.size(), nullptr);
    for (const HostTensorArg& h : host) {
      std::size_t t = 0;
      while (t < b->typed_.size() && b->typed_[t].name != h.name) ++t;
      if (t == b->typed_.size()) {
        return Status::format(ErrorCode::invalid_argument, "%s: unknown host tensor '%.*s'", label.c_str(),
                              static_cast<int>(std::min<std::size_t>(h.name.size(), 40)), h.name.c_str());
      }
      if (given[t] != nullptr) {
        return Status::format(ErrorCode::invalid_argument, "%s: host tensor '%s' given twice", label.c_str(), h.name.c_str());
      }
      given[t] = &h;
      const detail::TypedTensor& want = b->typed_[t];
      if (h.data == nullptr) {
        return Status::format(ErrorCode::invalid_argument, "%s: host tensor '%s' is a null pointer", label.c_str(), h.name.c_str());
      }
      if (h.bytes != LE * want.bytes) {
        return Status::format(ErrorCode::invalid_argument,
                              "%s: host tensor '%s' has %zu bytes, expected exactly %zu (%d layers * %d experts * %zu bytes)",
                              label.c_str(), h.name.c_str(), h.bytes, LE * want.bytes, config.num_layers,
                              config.num_experts, want.bytes);
      }
      if (reinterpret_cast<std::uintptr_t>(h.data) % caller_memory_alignment != 0) {
        return Status::format(ErrorCode::invalid_argument, "%s: host tensor '%s' is not %zu-byte aligned", label.c_str(),
                              h.name.c_str(), caller_memory_alignment);
      }
      const bool explicit_layout = config.layout.name == "explicit";
      if (!explicit_layout && h.dtype != DType::uint8 && h.dtype != want.dtype) {
        return Status::format(ErrorCode::invalid_argument, "%s: host tensor '%s' has dtype %s, expected %s (or uint8 bytes)",
                              label.c_str(), h.name.c_str(), std::string(to_string(h.dtype)).c_str(),
                              std::string(to_string(want.dtype)).c_str());
      }
      if (!explicit_layout && h.dtype == want.dtype && !h.shape.empty()) {
        std::vector<std::int64_t> by_layer{config.num_layers, config.num_experts};
        by_layer.insert(by_layer.end(), want.shape.begin(), want.shape.end());
        std::vector<std::int64_t> flat{static_cast<std::int64_t>(LE)};
        flat.insert(flat.end(), want.shape.begin(), want.shape.end());
        const bool bytes_view = h.dtype == DType::uint8 && h.shape.back() == static_cast<std::int64_t>(want.bytes);
        if (h.shape != by_layer && h.shape != flat && !bytes_view) {
          return Status::format(ErrorCode::invalid_argument, "%s: host tensor '%s' has shape %s, expected %s", label.c_str(),
                                h.name.c_str(), detail::shape_text(h.shape).c_str(), detail::shape_text(by_layer).c_str());
        }
      }
    }
    for (std::size_t t = 0; t < given.size(); ++t) {
      if (given[t] == nullptr) {
        return Status::format(ErrorCode::invalid_argument, "%s: host tensor '%s' missing", label.c_str(),
                              b->typed_[t].name.c_str());
      }
    }
    if (Status s = check_pinned_alike(given, label); !s) return s;

    // ---- the cache ----
    ModelCacheOptions o;
    o.num_layers = config.num_layers;
    o.num_experts = config.num_experts;
    o.capacity = config.capacity;
    o.layer_capacities = config.layer_capacities;
    o.top_k = config.top_k;
    o.stream_slots = config.stream_slots;
    o.pool = pool;
    o.label = label;
    ExpertTensorBytes tensors{};
    for (std::size_t t = 0; t < b->typed_.size(); ++t) {
      tensors[t] = TensorBytes{b->typed_[t].name, b->typed_[t].bytes};
      o.memory.host_tensors[t] = MemorySpan{given[t]->data, given[t]->bytes};
    }
    o.memory.host_registered = config.host_registered;
    const ExplicitLayout layout{tensors};
    using Made = Result<std::unique_ptr<detail::ModelCacheBase<Runtime>>>;
    try {
      // One model cache type: the policy is a value (AnyPolicy), built per planner by name.
      using Cache = ModelExpertCache<TensorMajorStorage, AnyPolicy, CopyStream, ExplicitLayout, Runtime>;
      const std::string_view held = policy_names[*policy];
      const auto make_policy = [held](CacheShape shape, PoolLayout pool_layout) -> AnyPolicy {
        Result<AnyPolicy> p = AnyPolicy::make(held, shape, pool_layout);
        if (!p.ok()) throw Error(p.status().code(), std::string(p.status().message()));
        return std::move(p.value());
      };
      Made made = std::unique_ptr<detail::ModelCacheBase<Runtime>>(
          std::make_unique<detail::ModelCacheModel<Runtime, Cache>>(held, rt, o, layout, make_policy));
      if (!made.ok()) return made.status();
      b->cache_ = std::move(made.value());
    } catch (const Error& e) {
      return ::expert_cache::detail::status_of(e);
    } catch (const std::bad_alloc&) {
      return Status(ErrorCode::runtime_failure, "model cache: out of host memory");
    } catch (const std::exception& e) {
      return Status(ErrorCode::runtime_failure, e.what());
    }

    for (std::size_t t = 0; t < b->typed_.size(); ++t) {
      SlotDescriptor d;
      d.name = b->typed_[t].name;
      d.index = t;
      d.bytes_per_slot = b->typed_[t].bytes;
      d.dtype = b->typed_[t].dtype;
      d.shape = b->typed_[t].shape;
      b->slots_.push_back(std::move(d));
    }
    for (std::int32_t l = 0; l < config.num_layers; ++l) {
      const Result<ForwardView> v = b->cache_->layer_view(l);
      if (!v.ok()) return v.status();
      LayerDescriptor ld;
      ld.capacity = b->cache_->layer_capacity(l);
      for (std::size_t t = 0; t < b->typed_.size(); ++t) {
        const SlotTensor& st = v.value().tensors[t];
        ld.slot_bases.push_back(reinterpret_cast<std::uintptr_t>(st.base));
        b->slots_[t].slot_stride = st.slot_stride;
      }
      ld.expert_map = reinterpret_cast<std::uintptr_t>(v.value().expert_map);
      ld.resident_map = reinterpret_cast<std::uintptr_t>(v.value().resident_map);
      b->layers_.push_back(std::move(ld));
    }
    b->stamps_.assign(static_cast<std::size_t>(config.num_experts), 0u);
    return Result<std::unique_ptr<ModelBridge>>(std::move(b));
  }

  // Layer `layer`'s top-k ids (int64; negative = padding; >= E refused before the cache is touched).
  Result<PrepareResult> prepare(std::int32_t layer, std::span<const std::int64_t> ids, Stream stream) noexcept {
    if (Status s = check_layer(layer); !s) return s;
    try {
      ids32_.resize(ids.size());
    } catch (...) {
      return Status(ErrorCode::runtime_failure, "prepare: out of host memory");
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] >= config_.num_experts) {
        return Status::format(ErrorCode::expert_out_of_range, "%s: layer %d: topk_ids[%zu] = %lld out of range (num_experts %d)",
                              config_.label.c_str(), layer, i, static_cast<long long>(ids[i]), config_.num_experts);
      }
      ids32_[i] = ids[i] < 0 ? -1 : static_cast<std::int32_t>(ids[i]);
    }
    return counts(cache_->prepare(layer, std::span<const std::int32_t>(ids32_), stream));
  }
  // A wide forward of layer `layer` (ModelExpertCache::prepare_wide): ids as prepare() takes
  // them, `consumer` once per round (WideRoundInfo: the layer's slot arrays, slot_count slots).
  Result<WideSummary> prepare_wide(std::int32_t layer, std::span<const std::int64_t> ids, Stream stream,
                                   const WideConsumerFn& consumer, std::string_view admission = {},
                                   std::string_view copy = {}) noexcept {
    if (Status s = check_layer(layer); !s) return s;
    Result<WideOptions> options = wide_options_of(admission, copy);
    if (!options.ok()) return options.status().with_context("%s", config_.label.c_str());
    WideRoundInfo info;
    try {
      ids32_.resize(ids.size());
      info.slot_bases.resize(slots_.size());
    } catch (...) {
      return Status(ErrorCode::runtime_failure, "prepare_wide: out of host memory");
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] >= config_.num_experts) {
        return Status::format(ErrorCode::expert_out_of_range, "%s: layer %d: topk_ids[%zu] = %lld out of range (num_experts %d)",
                              config_.label.c_str(), layer, i, static_cast<long long>(ids[i]), config_.num_experts);
      }
      ids32_[i] = ids[i] < 0 ? -1 : static_cast<std::int32_t>(ids[i]);
    }
    const auto fn = [&](const WideRound& round) -> Status {
      info.index = round.index;
      info.rounds = round.rounds;
      info.streamed = round.streamed;
      info.experts = round.experts;
      info.slots = round.slots;
      // The layer's view indexes its own slots, then the stream slots after every layer's.
      info.slot_count = layers_[static_cast<std::size_t>(layer)].capacity;
      for (const std::int32_t slot : round.slots) info.slot_count = std::max(info.slot_count, slot + 1);
      for (std::size_t t = 0; t < slots_.size(); ++t) {
        info.slot_bases[t] = reinterpret_cast<std::uintptr_t>(round.view.tensors[t].base);
      }
      info.expert_map = reinterpret_cast<std::uintptr_t>(round.view.expert_map);
      info.resident_map = reinterpret_cast<std::uintptr_t>(round.view.resident_map);
      return ::expert_cache::v0::python::detail::call_wide_consumer(consumer, info);
    };
    const ::expert_cache::detail::WideConsumerRef ref{
        const_cast<void*>(static_cast<const void*>(&fn)),
        [](void* object, const WideRound& round) -> Status { return (*static_cast<decltype(fn)*>(object))(round); }};
    return cache_->prepare_wide(layer, std::span<const std::int32_t>(ids32_), stream, ref, options.value());
  }
  // An explicit unique list of layer `layer` (distinct, in [0, E)), in its order.
  Result<PrepareResult> prepare_unique(std::int32_t layer, std::span<const std::int64_t> ids, Stream stream) noexcept {
    if (Status s = check_layer(layer); !s) return s;
    if (Status s = narrow_unique(layer, ids, "unique_ids"); !s) return s;
    return counts(cache_->prepare_unique(layer, std::span<const std::int32_t>(ids32_), stream));
  }
  // Speculative fills of layer `layer`'s predicted experts (ModelExpertCache::prefetch): ids in
  // [0, num_experts), distinct, best first; max_bytes >= 0 bounds the bytes copied; hints.scores
  // (one per id, in [0, 1]) select them as CacheBridge::prefetch does. Every check runs before the
  // cache is touched.
  Result<PrefetchView> prefetch(std::int32_t layer, std::span<const std::int64_t> predicted, std::int64_t max_bytes,
                                std::int64_t expires_after, Stream stream, const HintScores& hints = {}) noexcept {
    if (Status s = check_layer(layer); !s) return s;
    if (Status s = detail::check_prefetch_budget(config_.label, max_bytes, expires_after); !s) return s;
    if (predicted.size() > static_cast<std::size_t>(config_.num_experts)) {
      return Status::format(ErrorCode::too_many_experts, "%s: layer %d: prefetch of %zu ids, more than the %d experts",
                            config_.label.c_str(), layer, predicted.size(), config_.num_experts);
    }
    if (Status s = narrow_unique(layer, predicted, "predicted ids"); !s) return s;
    const std::span<const std::int32_t> ids(ids32_);
    const Result<PrefetchOptions> options = detail::hinted_prefetch_options(config_.label, ids, max_bytes, expires_after, hints);
    if (!options.ok()) return options.status();
    return cache_->prefetch(layer, ids, stream, options.value());
  }
  Status invalidate(std::int32_t layer, std::int64_t expert, Stream stream) noexcept {
    if (Status s = check_layer(layer); !s) return s;
    if (expert < 0 || expert >= config_.num_experts) {
      return Status::format(ErrorCode::invalid_argument, "%s: invalidate(layer %d, expert %lld): expert out of range [0, %d)",
                            config_.label.c_str(), layer, static_cast<long long>(expert), config_.num_experts);
    }
    return cache_->invalidate(layer, static_cast<std::int32_t>(expert), stream);
  }

  // The model's totals and one entry list per layer (StatEntry as CacheBridge::stats).
  [[nodiscard]] std::vector<std::vector<StatEntry>> stats() const {
    const ModelCacheStats s = cache_->stats();
    std::vector<std::vector<StatEntry>> out;
    out.push_back(entries(s.total));
    for (const CacheStats& l : s.per_layer) out.push_back(entries(l));
    return out;
  }

  [[nodiscard]] const std::vector<SlotDescriptor>& slots() const noexcept { return slots_; }
  [[nodiscard]] const std::vector<LayerDescriptor>& layers() const noexcept { return layers_; }
  [[nodiscard]] Result<std::vector<std::int32_t>> forward_map_host(std::int32_t layer) const {
    if (Status s = check_layer(layer); !s) return s;
    const auto m = cache_->forward_map_host(layer);
    return std::vector<std::int32_t>(m.begin(), m.end());
  }
  [[nodiscard]] Result<std::uintptr_t> host_pointer(std::int32_t layer, std::size_t tensor, std::int64_t expert) const {
    if (Status s = check_layer(layer); !s) return s;
    if (tensor >= typed_.size() || expert < 0 || expert >= config_.num_experts) {
      return Status::format(ErrorCode::invalid_argument, "%s: host_pointer(layer %d, tensor %zu, expert %lld) out of range",
                            config_.label.c_str(), layer, tensor, static_cast<long long>(expert));
    }
    return reinterpret_cast<std::uintptr_t>(cache_->host_tensor(layer, tensor, static_cast<std::int32_t>(expert)));
  }
  [[nodiscard]] std::string_view policy() const noexcept { return cache_->policy(); }
  [[nodiscard]] const ModelBridgeConfig& config() const noexcept { return config_; }

 private:
  ModelBridge() = default;
  // `ids` of layer `layer` narrowed into ids32_: each in [0, E), none twice (`what` names them).
  Status narrow_unique(std::int32_t layer, std::span<const std::int64_t> ids, const char* what) noexcept {
    try {
      ids32_.resize(ids.size());
    } catch (...) {
      return Status::format(ErrorCode::runtime_failure, "%s: out of host memory", what);
    }
    if (++epoch_ == 0) {
      std::fill(stamps_.begin(), stamps_.end(), 0u);
      epoch_ = 1;
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= config_.num_experts) {
        return Status::format(ErrorCode::expert_out_of_range, "%s: layer %d: %s[%zu] = %lld outside [0, %d)",
                              config_.label.c_str(), layer, what, i, static_cast<long long>(ids[i]), config_.num_experts);
      }
      auto& stamp = stamps_[static_cast<std::size_t>(ids[i])];
      if (stamp == epoch_) {
        return Status::format(ErrorCode::duplicate_expert, "%s: layer %d: %s[%zu] = %lld appears twice",
                              config_.label.c_str(), layer, what, i, static_cast<long long>(ids[i]));
      }
      stamp = epoch_;
      ids32_[i] = static_cast<std::int32_t>(ids[i]);
    }
    return {};
  }
  Status check_layer(std::int32_t layer) const noexcept {
    if (layer < 0 || layer >= config_.num_layers) {
      return Status::format(ErrorCode::invalid_argument, "%s: layer %d out of range [0, %d)", config_.label.c_str(), layer,
                            config_.num_layers);
    }
    return {};
  }
  static std::vector<StatEntry> entries(const CacheStats& s) {
    const auto i = [](const char* n, auto v) { return StatEntry{n, static_cast<std::int64_t>(v), 0.0, false}; };
    return {i("hits", s.hits),
            i("misses", s.misses),
            i("promotions", s.promotions),
            i("evictions", s.evictions),
            i("invalidations", s.invalidations),
            i("resident", s.resident),
            i("capacity", s.capacity),
            i("prepare_calls", s.prepare_calls),
            i("generation", s.generation),
            i("last_copies", s.last_copies),
            i("total_copies", s.total_copies),
            i("owner_changes", s.owner_changes),
            i("map_uploads", s.map_uploads),
            i("staging_stalls", s.staging_stalls),
            i("faults", s.faults),
            i("speculative_issued", s.speculative_issued),
            i("speculative_used", s.speculative_used),
            i("speculative_wasted", s.speculative_wasted),
            i("speculative_bytes", s.speculative_bytes),
            i("slot_bytes", s.slot_bytes),
            i("host_bytes", s.host_bytes),
            StatEntry{"hit_rate", 0, s.hit_rate(), true}};
  }
  static Result<PrepareResult> counts(const Result<ForwardView>& r) noexcept {
    if (!r.ok()) return r.status();
    PrepareResult p;
    p.hits = r.value().hits;
    p.misses = r.value().misses;
    p.generation = r.value().generation;
    return p;
  }

  ModelBridgeConfig config_;
  std::vector<detail::TypedTensor> typed_;  // names the cache's string_views point into
  std::vector<SlotDescriptor> slots_;       // dtype, per-slot shape, stride (base: per layer)
  std::vector<LayerDescriptor> layers_;
  std::vector<std::int32_t> ids32_;
  std::vector<std::uint32_t> stamps_;
  std::uint32_t epoch_ = 0;
  std::unique_ptr<detail::ModelCacheBase<Runtime>> cache_;  // last: destroyed before the names it views
};

// ---- the CUDA model bridge, non-template (python/src/bridge_cuda.cu), as CudaBridge ----
class CudaModelBridge {
 public:
  virtual ~CudaModelBridge() = default;
  virtual Result<PrepareResult> prepare(std::int32_t layer, std::span<const std::int64_t> ids, void* stream) noexcept = 0;
  virtual Result<PrepareResult> prepare_unique(std::int32_t layer, std::span<const std::int64_t> ids,
                                               void* stream) noexcept = 0;
  virtual Result<WideSummary> prepare_wide(std::int32_t layer, std::span<const std::int64_t> ids, void* stream,
                                           const WideConsumerFn& consumer, std::string_view admission,
                                           std::string_view copy) noexcept = 0;
  virtual Status invalidate(std::int32_t layer, std::int64_t expert, void* stream) noexcept = 0;
  virtual Result<PrefetchView> prefetch(std::int32_t layer, std::span<const std::int64_t> predicted,
                                        std::int64_t max_bytes, std::int64_t expires_after, void* stream,
                                        const HintScores& hints) noexcept = 0;
  [[nodiscard]] virtual std::vector<std::vector<StatEntry>> stats() const = 0;
  [[nodiscard]] virtual const std::vector<SlotDescriptor>& slots() const noexcept = 0;
  [[nodiscard]] virtual const std::vector<LayerDescriptor>& layers() const noexcept = 0;
  [[nodiscard]] virtual Result<std::vector<std::int32_t>> forward_map_host(std::int32_t layer) const = 0;
  [[nodiscard]] virtual Result<std::uintptr_t> host_pointer(std::int32_t layer, std::size_t tensor,
                                                            std::int64_t expert) const = 0;
  [[nodiscard]] virtual std::string policy() const = 0;
};

// Defined in bridge_cuda.cu (nvcc): the CUDA runtime on the current device plus the model bridge.
Result<std::unique_ptr<CudaModelBridge>> make_cuda_model_bridge(const ModelBridgeConfig& config,
                                                                std::span<const HostTensorArg> host);

}  // namespace expert_cache::inline v0::python
