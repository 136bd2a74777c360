#pragma once
// CacheBridge<Runtime>: what the PyTorch extension does with a cache, in plain data, so it can be
// tested without torch and without a GPU (tests/host/test_python_bridge.cpp drives it on SimRuntime).
//
// The extension (python/src/extension.cpp) turns torch tensors into (name, pointer, bytes, dtype,
// shape) records and integer id spans; this header validates every one of them BEFORE the cache
// is touched, builds an AnyExpertCache over the caller's host tensors (CacheOptions::memory:
// registered at their exact size, never copied) and describes the slot arrays and maps as raw
// device pointers with dtype and per-slot shape, which the extension wraps with torch::from_blob.
//
// No torch, no CUDA headers: host tier only (g++ alone). python/src/bridge_cuda.cu instantiates
// it for CudaRuntime and exposes the non-template CudaBridge below.
#include <algorithm>
#include <array>
#include <cstddef>
#include <functional>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "expert_cache/any/any_cache.hpp"
#include "expert_cache/layout/dense.hpp"
#include "expert_cache/layout/nvfp4_marlin.hpp"
#include "expert_cache/runtime/link_profile.hpp"
#include "expert_cache/storage/storage_memory.hpp"

namespace expert_cache::inline v0::python {

// Element types the bridge knows (the extension maps torch dtypes onto these; anything else is
// `other`, accepted only by the explicit layout, which moves bytes).
enum class DType : std::uint8_t { uint8 = 0, int32, bfloat16, float32, other };

[[nodiscard]] constexpr std::size_t element_size(DType d) noexcept {
  switch (d) {
    case DType::uint8: return 1;
    case DType::int32: return 4;
    case DType::bfloat16: return 2;
    case DType::float32: return 4;
    case DType::other: return 1;
  }
  return 1;
}
[[nodiscard]] constexpr std::string_view to_string(DType d) noexcept {
  switch (d) {
    case DType::uint8: return "uint8";
    case DType::int32: return "int32";
    case DType::bfloat16: return "bfloat16";
    case DType::float32: return "float32";
    case DType::other: return "other";
  }
  return "other";
}

// The layout by name: "dense_bf16" (hidden, intermediate), "nvfp4_marlin" (hidden,
// intermediate, group_size == 16) or "explicit" (tensors: name -> bytes per expert).
struct LayoutConfig {
  std::string name = "dense_bf16";
  std::int64_t hidden = 0;
  std::int64_t intermediate = 0;
  std::int64_t group_size = 16;
  std::vector<std::pair<std::string, std::size_t>> tensors;  // explicit only
};

struct BridgeConfig {
  LayoutConfig layout;
  std::string provider = "row";  // row | cached | device
  std::string policy;            // "" = provider default
  std::string staging;
  std::string storage;           // "" = tensor_major (caller tensors are [E, ...] per tensor)
  std::int32_t num_experts = 0;
  std::int32_t capacity = 0;
  std::int32_t top_k = 1;
  std::int32_t max_ids = 0;      // device provider: largest prepare (tokens * top_k)
  std::int32_t stream_slots = 0; // slots after `capacity` for wide forwards' scan-resistant streaming (cache/wide.hpp)
  std::string label = "expert_cache";
  bool host_registered = false;  // the host tensors are pinned already (torch pin_memory())
  // Device provider: who moves the fills' bytes, "automatic" | "copy_engine" | "sm_loads"
  // (DeviceCacheOptions::fill_engine), and a stored profile for automatic: the text of
  // LinkProfile::serialize() ("" = none: measured once per process and expert size).
  std::string fill_engine = "automatic";
  std::string link_profile;
};

// BridgeConfig::fill_engine and link_profile parsed.
struct FillEngineChoice {
  FillEngine engine = FillEngine::automatic;
  std::optional<LinkProfile> profile;
};

// Parses and checks the fill engine and the stored profile: a name parse_fill_engine knows, a
// text LinkProfile::parse reads; both only for provider 'device' (host providers copy on the
// copy stream: no engine to pick), and a profile only with "automatic" (the one engine that
// reads it). Whether the profile belongs to this device and expert size is checked by the cache
// when it is built (LinkProfile::check_matches).
inline Result<FillEngineChoice> fill_engine_choice(const BridgeConfig& config) {
  const char* label = config.label.c_str();
  Result<FillEngine> engine = parse_fill_engine(config.fill_engine);
  if (!engine.ok()) return engine.status().with_context("%s", label);
  FillEngineChoice choice;
  choice.engine = engine.value();
  if (!config.link_profile.empty()) {
    LinkProfile p;
    if (Status s = LinkProfile::parse(config.link_profile, p); !s) return s.with_context("%s: link_profile", label);
    choice.profile = std::move(p);
  }
  const bool known_host_provider =
      config.provider != "device" &&
      std::find(any_cache_providers.begin(), any_cache_providers.end(), config.provider) != any_cache_providers.end();
  if (known_host_provider && (choice.engine != FillEngine::automatic || choice.profile)) {
    return Status::format(ErrorCode::invalid_argument,
                          "%s: fill_engine '%s'%s: the fill engine is chosen for provider 'device' only (provider '%s' "
                          "copies on its copy stream)",
                          label, std::string(to_string(choice.engine)).c_str(), choice.profile ? " with a link_profile" : "",
                          config.provider.c_str());
  }
  if (choice.profile && choice.engine != FillEngine::automatic) {
    return Status::format(ErrorCode::invalid_argument,
                          "%s: a link_profile is read by fill_engine 'automatic' only (got fill_engine '%s': pass one "
                          "or the other)",
                          label, std::string(to_string(choice.engine)).c_str());
  }
  return choice;
}

// The arguments of expert_cache_torch.link_profile(device, expert_bytes), checked before any
// CUDA call: a device ordinal in [0, 2^31) and a positive byte count (the library checks the
// device against the device count).
inline Status check_link_profile_request(std::int64_t device, std::int64_t expert_bytes) noexcept {
  if (device < 0 || device > std::numeric_limits<std::int32_t>::max()) {
    return Status::format(ErrorCode::invalid_argument, "link_profile: device %lld is not a CUDA device ordinal",
                          static_cast<long long>(device));
  }
  if (expert_bytes <= 0) {
    return Status::format(ErrorCode::invalid_argument,
                          "link_profile: expert_bytes %lld (accepted: > 0, the bytes of one expert, all tensors)",
                          static_cast<long long>(expert_bytes));
  }
  return {};
}

// One caller host tensor: [E, ...] contiguous, E * bytes-per-expert bytes. `shape` (optional)
// is checked against [E, per-slot shape] unless the dtype is uint8 (a byte view).
struct HostTensorArg {
  std::string name;
  void* data = nullptr;
  std::size_t bytes = 0;
  DType dtype = DType::uint8;
  std::vector<std::int64_t> shape;
  bool pinned = false;  // page-locked and mapped already (pin_memory(), or registered by another cache)
};

// The storage registers all of a cache's host tensors or none, so the given tensors must be all
// pinned or all pageable; checked after every other check of the tensors, so that a tensor with
// a wrong shape is reported as such even when it is also the odd one out.
inline Status check_pinned_alike(const std::vector<const HostTensorArg*>& given, const std::string& label) {
  std::size_t pinned = 0;
  for (const HostTensorArg* h : given) pinned += h != nullptr && h->pinned ? 1 : 0;
  if (pinned != 0 && pinned != given.size()) {
    return Status::format(ErrorCode::invalid_argument,
                          "%s: host tensors must be all pinned (pin_memory()) or all pageable; got a mix", label.c_str());
  }
  return {};
}

// One slot array: slot s of tensor `name` starts at base + s * slot_stride; per-slot element
// shape `shape` of `dtype` (product * element size == bytes_per_slot).
struct SlotDescriptor {
  std::string name;
  std::size_t index = 0;  // ExpertTensorBytes entry
  std::uintptr_t base = 0;
  std::size_t slot_stride = 0;  // bytes
  std::size_t bytes_per_slot = 0;
  std::int32_t capacity = 0;
  DType dtype = DType::uint8;
  std::vector<std::int64_t> shape;  // one slot
};

// One round of a wide forward (prepare_wide) as the extension hands it on: the round's slot
// arrays (one base per slots() descriptor, `slot_count` slots each: the pool and, for stream
// admission, the stream slots after it) and forward map, valid for work enqueued on the call's
// stream during the round; experts/slots: the round's experts and their slots (host providers;
// empty for the device provider, whose plan stays on the device).
struct WideRoundInfo {
  std::uint32_t index = 0;
  std::uint32_t rounds = 0;
  std::uint32_t streamed = 0;
  std::span<const std::int32_t> experts;
  std::span<const std::int32_t> slots;
  std::vector<std::uintptr_t> slot_bases;
  std::int32_t slot_count = 0;
  std::uintptr_t expert_map = 0;
  std::uintptr_t resident_map = 0;
};
using WideConsumerFn = std::function<Status(const WideRoundInfo&)>;

// WideOptions from names: admission "stream" (default) | "admit"; copy "automatic" (default) |
// "runs" | "span".
inline Result<WideOptions> wide_options_of(std::string_view admission, std::string_view copy) noexcept {
  WideOptions o;
  if (admission.empty() || admission == "stream") {
    o.admission = WideAdmission::stream;
  } else if (admission == "admit") {
    o.admission = WideAdmission::admit;
  } else {
    return Status::format(ErrorCode::invalid_argument, "unknown wide admission '%.*s' (valid: stream, admit)",
                          static_cast<int>(std::min<std::size_t>(admission.size(), 40)), admission.data());
  }
  if (copy.empty() || copy == "automatic") {
    o.copy = WideCopy::automatic;
  } else if (copy == "runs") {
    o.copy = WideCopy::runs;
  } else if (copy == "span") {
    o.copy = WideCopy::span;
  } else {
    return Status::format(ErrorCode::invalid_argument, "unknown wide copy '%.*s' (valid: automatic, runs, span)",
                          static_cast<int>(std::min<std::size_t>(copy.size(), 40)), copy.data());
  }
  return o;
}

namespace detail {
// Calls `consumer` for one round; an exception (the extension's converter failing) is a Status.
inline Status call_wide_consumer(const WideConsumerFn& consumer, const WideRoundInfo& info) noexcept {
  try {
    return consumer(info);
  } catch (const std::exception& e) {
    return Status(ErrorCode::runtime_failure, e.what());
  } catch (...) {
    return Status(ErrorCode::runtime_failure, "the wide consumer threw");
  }
}
}  // namespace detail

// The scored-hint arguments of one prefetch as Python gives them (PrefetchOptions::scores and
// min_score; docs/prefetch.md "Scored hints"): `scores` nullopt for None (no scores), else one
// score per predicted id (an empty span for an empty id list). The span is read during the call.
// With them the call's PrefetchOptions::evict_last_forward (the caller's ordering promise).
struct HintScores {
  std::optional<std::span<const float>> scores;
  float min_score = default_min_score;
  bool evict_last_forward = false;
};

namespace detail {
// A prefetch's byte budget and expiry as Python gives them (int64), checked before the cache is touched.
inline Status check_prefetch_budget(const std::string& label, std::int64_t max_bytes, std::int64_t expires_after) noexcept {
  if (max_bytes < 0) {
    return Status::format(ErrorCode::invalid_argument, "%s: prefetch max_bytes = %lld (accepted: >= 0)", label.c_str(),
                          static_cast<long long>(max_bytes));
  }
  if (expires_after < 1 || expires_after > (std::int64_t{1} << 30)) {
    return Status::format(ErrorCode::invalid_argument, "%s: prefetch expires_after = %lld (accepted: 1..2^30)",
                          label.c_str(), static_cast<long long>(expires_after));
  }
  return {};
}
// The PrefetchOptions of host ids `ids` (already checked) with `hints`: one score per id when
// scores are given, each valid (check_hint_scores; its message prefixed with the label).
inline Result<PrefetchOptions> hinted_prefetch_options(const std::string& label, std::span<const std::int32_t> ids,
                                                       std::int64_t max_bytes, std::int64_t expires_after,
                                                       const HintScores& hints) noexcept {
  if (Status s = check_prefetch_budget(label, max_bytes, expires_after); !s) return s;
  if (hints.scores && hints.scores->size() != ids.size()) {
    return Status::format(ErrorCode::invalid_argument,
                          "%s: prefetch got %zu scores for %zu predicted ids (scores[i] belongs to ids[i]; no "
                          "scores: None)",
                          label.c_str(), hints.scores->size(), ids.size());
  }
  const std::span<const float> scores = hints.scores.value_or(std::span<const float>{});
  if (Status s = check_hint_scores(ids, scores, hints.min_score); !s) return s.with_context("%s", label.c_str());
  PrefetchOptions o{max_bytes, static_cast<std::uint32_t>(expires_after), scores, hints.min_score};
  o.evict_last_forward = hints.evict_last_forward;
  return o;
}
}  // namespace detail

struct PrepareResult {
  bool has_counts = true;  // false for the device provider (counts live on the device)
  std::int64_t hits = 0;
  std::int64_t misses = 0;
  std::uint64_t generation = 0;
};

// A stats() entry: integer unless is_float.
struct StatEntry {
  std::string name;
  std::int64_t int_value = 0;
  double float_value = 0.0;
  bool is_float = false;
};

namespace detail {

struct TypedTensor {
  std::string name;
  std::size_t bytes = 0;
  DType dtype = DType::uint8;
  std::vector<std::int64_t> shape;
};

inline std::int64_t product(const std::vector<std::int64_t>& v) noexcept {
  std::int64_t p = 1;
  for (std::int64_t x : v) p *= x;
  return p;
}

inline std::string shape_text(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The layout's tensors with dtype and per-slot shape (docs/nvfp4_marlin.md for the Marlin ones).
inline Result<std::vector<TypedTensor>> typed_tensors(const LayoutConfig& l) {
  std::vector<TypedTensor> out;
  if (l.name == "dense_bf16") {
    const DenseBf16 d{l.hidden, l.intermediate};
    if (Status s = d.validate(); !s) return s;
    out.push_back({"w13", d.w13_bytes(), DType::bfloat16, {2 * l.intermediate, l.hidden}});
    out.push_back({"w2", d.w2_bytes(), DType::bfloat16, {l.hidden, l.intermediate}});
  } else if (l.name == "nvfp4_marlin") {
    if (l.group_size != marlin::group_size) {
      return Status::format(ErrorCode::invalid_argument, "nvfp4_marlin: group_size must be %lld (NVFP4), got %lld",
                            static_cast<long long>(marlin::group_size), static_cast<long long>(l.group_size));
    }
    const Nvfp4Marlin m{l.hidden, l.intermediate, ActDtype::bf16};
    if (Status s = m.validate(); !s) return s;
    const std::int64_t k = l.hidden, np = m.padded_intermediate();
    const ExpertTensorBytes b = m.tensors();
    out.push_back({"w13", b[0].bytes_per_expert, DType::int32, {k / 16, 4 * np}});
    out.push_back({"w2", b[1].bytes_per_expert, DType::int32, {np / 16, 2 * k}});
    out.push_back({"w13_scale", b[2].bytes_per_expert, DType::uint8, {k / 16, 2 * np}});
    out.push_back({"w2_scale", b[3].bytes_per_expert, DType::uint8, {np / 16, k}});
    out.push_back({"w13_scale_2", b[4].bytes_per_expert, DType::float32, {1}});
    out.push_back({"w2_scale_2", b[5].bytes_per_expert, DType::float32, {1}});
  } else if (l.name == "explicit") {
    if (l.tensors.empty() || l.tensors.size() > max_expert_tensors) {
      return Status::format(ErrorCode::invalid_argument, "explicit layout: %zu tensors (accepted: 1..%zu)",
                            l.tensors.size(), max_expert_tensors);
    }
    for (const auto& [name, bytes] : l.tensors) {
      if (name.empty() || name.size() > 64) {
        return Status::format(ErrorCode::invalid_argument, "explicit layout: tensor names must be 1..64 characters (got %zu)",
                              name.size());
      }
      if (bytes == 0 || bytes > max_pool_bytes) {
        return Status::format(ErrorCode::invalid_argument, "explicit layout: tensor '%s' has %zu bytes per expert (accepted: 1..2^40)",
                              name.c_str(), bytes);
      }
      for (const TypedTensor& o : out) {
        if (o.name == name) return Status::format(ErrorCode::invalid_argument, "explicit layout: tensor '%s' named twice", name.c_str());
      }
      out.push_back({name, bytes, DType::uint8, {static_cast<std::int64_t>(bytes)}});
    }
  } else {
    return Status::format(ErrorCode::invalid_argument, "unknown layout '%.*s' (valid: dense_bf16, nvfp4_marlin, explicit)",
                          static_cast<int>(std::min<std::size_t>(l.name.size(), 40)), l.name.c_str());
  }
  return out;
}

}  // namespace detail

template <allocating_runtime Runtime>
class CacheBridge {
 public:
  using Stream = typename Runtime::Stream;

  // Validates the config and every host tensor, then builds the cache. Nothing is allocated or
  // registered when a check fails; the caller keeps `rt` and the host memory alive.
  static Result<std::unique_ptr<CacheBridge>> create(Runtime& rt, const BridgeConfig& config,
                                                     std::span<const HostTensorArg> host) {
    auto typed = detail::typed_tensors(config.layout);
    if (!typed.ok()) return typed.status();
    std::unique_ptr<CacheBridge> b(new CacheBridge());
    b->typed_ = std::move(typed.value());
    b->config_ = config;
    const std::string& label = config.label;
    if (config.num_experts <= 0 || config.num_experts > (1 << 24)) {
      return Status::format(ErrorCode::invalid_argument, "%s: num_experts %d (accepted: 1..2^24)", label.c_str(),
                            config.num_experts);
    }
    Result<FillEngineChoice> engine = fill_engine_choice(config);
    if (!engine.ok()) return engine.status();
    // The caller's tensors are [E, ...] per tensor: tensor-major host pools only.
    std::string storage = config.storage.empty() ? std::string("tensor_major") : config.storage;
    if (storage == "expert_major" || storage == "expert_major_host") {
      return Status::format(ErrorCode::invalid_argument,
                            "%s: storage '%s' keeps one [E, blob] host pool; caller host tensors ([E, ...] per "
                            "tensor) need storage 'tensor_major' (or \"\")",
                            label.c_str(), storage.c_str());
    }

    // ---- host tensors: every layout tensor exactly once, exact size, aligned, dtype/shape ----
    const auto E = static_cast<std::size_t>(config.num_experts);
    std::vector<const HostTensorArg*> given(b->typed_.size(), nullptr);
    for (const HostTensorArg& h : host) {
      std::size_t t = 0;
      while (t < b->typed_.size() && b->typed_[t].name != h.name) ++t;
      if (t == b->typed_.size()) {
        return Status::format(ErrorCode::invalid_argument, "%s: unknown host tensor '%.*s' (layout %s has: %s)",
                              label.c_str(), static_cast<int>(std::min<std::size_t>(h.name.size(), 40)), h.name.c_str(),
                              config.layout.name.c_str(), b->names_text().c_str());
      }
      if (given[t] != nullptr) {
        return Status::format(ErrorCode::invalid_argument, "%s: host tensor '%s' given twice", label.c_str(), h.name.c_str());
      }
      given[t] = &h;
      const detail::TypedTensor& want = b->typed_[t];
      const std::size_t bytes = E * want.bytes;
      if (h.data == nullptr) {
        return Status::format(ErrorCode::invalid_argument, "%s: host tensor '%s' is a null pointer", label.c_str(), h.name.c_str());
      }
      if (h.bytes != bytes) {
        return Status::format(ErrorCode::invalid_argument,
                              "%s: host tensor '%s' has %zu bytes, expected exactly %zu (%zu experts * %zu bytes)",
                              label.c_str(), h.name.c_str(), h.bytes, bytes, E, want.bytes);
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
      // Raw bytes are accepted as [E, bytes per expert] uint8, also for tensors whose typed dtype is uint8.
      const bool flat_bytes = h.dtype == DType::uint8 && h.shape.size() == 2 &&
                              h.shape[0] == static_cast<std::int64_t>(E) &&
                              h.shape[1] == static_cast<std::int64_t>(want.bytes);
      if (!explicit_layout && h.dtype == want.dtype && !h.shape.empty() && !flat_bytes) {
        std::vector<std::int64_t> full{static_cast<std::int64_t>(E)};
        full.insert(full.end(), want.shape.begin(), want.shape.end());
        if (h.shape != full) {
          return Status::format(ErrorCode::invalid_argument, "%s: host tensor '%s' has shape %s, expected %s", label.c_str(),
                                h.name.c_str(), detail::shape_text(h.shape).c_str(), detail::shape_text(full).c_str());
        }
      }
    }
    for (std::size_t t = 0; t < given.size(); ++t) {
      if (given[t] == nullptr) {
        return Status::format(ErrorCode::invalid_argument, "%s: host tensor '%s' missing (layout %s needs: %s)", label.c_str(),
                              b->typed_[t].name.c_str(), config.layout.name.c_str(), b->names_text().c_str());
      }
    }
    if (Status s = check_pinned_alike(given, label); !s) return s;

    // ---- the cache ----
    AnyCacheConfig c;
    c.provider = config.provider;
    c.policy = config.policy;
    c.staging = config.staging;
    c.storage = storage;
    c.max_ids = config.max_ids;
    c.fill_engine = engine.value().engine;
    c.link_profile = engine.value().profile;
    c.options.stream_slots = config.stream_slots;
    c.options.num_experts = config.num_experts;
    c.options.capacity = config.capacity;
    c.options.top_k = config.top_k;
    c.options.label = label;
    ExpertTensorBytes tensors{};
    // The cache keeps string_views of the names: they point into typed_, owned by the bridge
    // and never resized after this point.
    for (std::size_t t = 0; t < b->typed_.size(); ++t) {
      tensors[t] = TensorBytes{b->typed_[t].name, b->typed_[t].bytes};
      c.options.memory.host_tensors[t] = MemorySpan{given[t]->data, given[t]->bytes};
    }
    c.options.memory.host_registered = config.host_registered;
    if (config.layout.name == "dense_bf16") {
      c.layout = AnyLayout::of(DenseBf16{config.layout.hidden, config.layout.intermediate});
    } else if (config.layout.name == "nvfp4_marlin") {
      c.layout = AnyLayout::of(Nvfp4Marlin{config.layout.hidden, config.layout.intermediate, ActDtype::bf16});
    } else {
      c.layout = AnyLayout::explicit_bytes(tensors);
    }
    auto made = make_expert_cache(rt, c);
    if (!made.ok()) return made.status();
    b->cache_ = std::make_unique<AnyExpertCache<Runtime>>(std::move(made.value()));
    b->device_ = b->cache_->provider() == "device";
    b->stamps_.assign(E, 0u);
    b->fill_engine_ = b->cache_->fill_engine();

    for (std::size_t t = 0; t < b->typed_.size(); ++t) {
      const std::size_t index = find_tensor(b->cache_->tensors(), b->typed_[t].name);
      const SlotTensor st = b->cache_->slot_tensor(index);
      SlotDescriptor d;
      d.name = b->typed_[t].name;
      d.index = index;
      d.base = reinterpret_cast<std::uintptr_t>(st.base);
      d.slot_stride = st.slot_stride;
      d.bytes_per_slot = st.bytes;
      d.capacity = config.capacity + config.stream_slots;  // the stream slots follow the pool
      d.dtype = b->typed_[t].dtype;
      d.shape = b->typed_[t].shape;
      b->slots_.push_back(std::move(d));
    }
    return Result<std::unique_ptr<CacheBridge>>(std::move(b));
  }

  // Host ids (host providers). int32 or int64; negative ids are padding (as the planner treats
  // them), ids >= num_experts are refused before the cache is touched.
  // name_experts: a forward with more unique experts than slots is refused with a message that
  // names them and the capacity (the vLLM surface's error) instead of the planner's count.
  Result<PrepareResult> prepare(std::span<const std::int32_t> ids, Stream stream, bool name_experts = false) noexcept {
    if (device_) return not_host("prepare with host ids");
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] >= config_.num_experts) return out_of_range(i, ids[i]);
    }
    if (name_experts) {
      if (Status s = check_fits(ids); !s) return s;
    }
    return counts(cache_->prepare(ids, stream));
  }
  Result<PrepareResult> prepare(std::span<const std::int64_t> ids, Stream stream, bool name_experts = false) noexcept {
    if (device_) return not_host("prepare with host ids");
    try {
      ids32_.resize(ids.size());
    } catch (...) {
      return Status(ErrorCode::runtime_failure, "prepare: out of host memory");
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] >= config_.num_experts) return out_of_range(i, ids[i]);
      ids32_[i] = ids[i] < 0 ? -1 : static_cast<std::int32_t>(ids[i]);
    }
    if (name_experts) {
      if (Status s = check_fits(std::span<const std::int32_t>(ids32_)); !s) return s;
    }
    return counts(cache_->prepare(std::span<const std::int32_t>(ids32_), stream));
  }

  // An explicit unique list (vLLM's prepare(topk_ids, unique_ids)), processed in the given
  // order: every id in [0, num_experts) (no padding here), no duplicates, at most capacity of
  // them; refused before the cache is touched. Host providers only.
  Result<PrepareResult> prepare_unique(std::span<const std::int64_t> unique_ids, Stream stream) noexcept {
    if (device_) return not_host("prepare with unique_ids");
    if (Status s = narrow_unique(unique_ids, "unique_ids"); !s) return s;
    if (unique_ids.size() > static_cast<std::size_t>(config_.capacity)) {
      return too_many(std::span<const std::int32_t>(ids32_));
    }
    return counts(cache_->prepare_unique(std::span<const std::int32_t>(ids32_), stream));
  }

  // Speculative fills of predicted experts in host memory (every provider; the device provider
  // uploads and plans them on the device). Ids in [0, num_experts), distinct, at most
  // num_experts of them; max_bytes >= 0 bounds the bytes copied (0: nothing). With
  // hints.scores, one score per id, each in [0, 1]: the hints below hints.min_score are skipped
  // (PrefetchView::skipped_unlikely), the others taken highest score first (PrefetchOptions).
  // Every check runs before the cache is touched; the scores' messages are the library's
  // (check_hint_scores), prefixed with the label.
  Result<PrefetchView> prefetch(std::span<const std::int64_t> predicted, std::int64_t max_bytes,
                                std::int64_t expires_after, Stream stream, const HintScores& hints = {}) noexcept {
    if (Status s = detail::check_prefetch_budget(config_.label, max_bytes, expires_after); !s) return s;
    if (Status s = narrow_unique(predicted, "predicted ids"); !s) return s;
    const std::span<const std::int32_t> ids(ids32_);
    const Result<PrefetchOptions> options = detail::hinted_prefetch_options(config_.label, ids, max_bytes, expires_after, hints);
    if (!options.ok()) return options.status();
    return cache_->prefetch(ids, stream, options.value());
  }
  // Predicted int32 ids in device memory (written by a kernel, e.g. inside a captured step):
  // the device provider only; planned on the device in the given order, so no scores (the
  // device plan takes none: DeviceExpertCache::prefetch); hints.min_score is checked all the same.
  Result<PrefetchView> prefetch_device(const std::int32_t* device_ids, std::int64_t n, std::int64_t max_bytes,
                                       std::int64_t expires_after, Stream stream, const HintScores& hints = {}) noexcept {
    if (!device_) {
      return Status::format(ErrorCode::invalid_argument,
                            "%s: prefetch with CUDA ids needs provider 'device' (provider '%s' plans on the host: "
                            "pass CPU ids)",
                            config_.label.c_str(), config_.provider.c_str());
    }
    if (Status s = detail::check_prefetch_budget(config_.label, max_bytes, expires_after); !s) return s;
    if (n < 0 || n > config_.num_experts) {
      return Status::format(ErrorCode::invalid_argument, "%s: prefetch of %lld device ids (accepted: 0..num_experts = %d)",
                            config_.label.c_str(), static_cast<long long>(n), config_.num_experts);
    }
    if (device_ids == nullptr && n > 0) {
      return Status::format(ErrorCode::invalid_argument, "%s: prefetch of %lld ids from a null pointer",
                            config_.label.c_str(), static_cast<long long>(n));
    }
    if (hints.scores) {
      return Status::format(ErrorCode::invalid_argument,
                            "%s: prefetch with CUDA ids takes no scores (%zu given): provider 'device' plans CUDA ids "
                            "on the GPU in the given order; pass CPU ids with the scores, or the CUDA ids best first",
                            config_.label.c_str(), hints.scores->size());
    }
    if (Status s = check_hint_scores({}, {}, hints.min_score); !s) return s.with_context("%s", config_.label.c_str());
    PrefetchOptions options{max_bytes, static_cast<std::uint32_t>(expires_after)};
    options.min_score = hints.min_score;
    options.evict_last_forward = hints.evict_last_forward;
    return cache_->prefetch_device(device_ids, static_cast<std::int32_t>(n), stream, options);
  }

  // The last accepted prepare's misses (expert, slot) and victims (expert, slot): host providers;
  // empty for the device provider (its plan lives on the device).
  [[nodiscard]] std::vector<std::pair<std::int32_t, std::int32_t>> last_fills() const {
    std::vector<std::pair<std::int32_t, std::int32_t>> out;
    if (const ForwardPlan* p = cache_->last_plan()) {
      for (const SlotFill& f : p->fills) out.emplace_back(f.expert.value, f.slot.value);
    }
    return out;
  }
  [[nodiscard]] std::vector<std::pair<std::int32_t, std::int32_t>> last_evictions() const {
    std::vector<std::pair<std::int32_t, std::int32_t>> out;
    if (const ForwardPlan* p = cache_->last_plan()) {
      for (const SlotEviction& v : p->evictions) out.emplace_back(v.expert.value, v.slot.value);
    }
    return out;
  }

  // Device provider: n int32 ids in device memory (the router's output), planned on the device;
  // ids out of range are reported by the device error word (device_errors()).
  Result<PrepareResult> prepare_device(const std::int32_t* device_ids, std::int64_t n, Stream stream) noexcept {
    if (!device_) {
      return Status::format(ErrorCode::invalid_argument,
                            "%s: prepare_device needs provider 'device' (provider '%s' plans on the host: pass host ids)",
                            config_.label.c_str(), config_.provider.c_str());
    }
    if (n < 0 || n > config_.max_ids) {
      return Status::format(ErrorCode::invalid_argument, "%s: prepare of %lld ids (device provider: 0..max_ids = %d)",
                            config_.label.c_str(), static_cast<long long>(n), config_.max_ids);
    }
    if (device_ids == nullptr && n > 0) {
      return Status::format(ErrorCode::invalid_argument, "%s: prepare of %lld ids from a null pointer", config_.label.c_str(),
                            static_cast<long long>(n));
    }
    auto r = cache_->prepare(std::span<const std::int32_t>(device_ids, static_cast<std::size_t>(n)), stream);
    if (!r.ok()) return r.status();
    PrepareResult p;
    p.has_counts = false;
    p.generation = r.value().generation;
    return p;
  }

  // A forward of any width in rounds (AnyExpertCache::prepare_wide): host ids, host providers.
  // Ids >= num_experts are refused (negative = padding) before the cache is touched; `consumer`
  // is called once per round and enqueues the round's work on `stream`.
  Result<WideSummary> prepare_wide(std::span<const std::int64_t> ids, Stream stream, const WideConsumerFn& consumer,
                                   std::string_view admission = {}, std::string_view copy = {}) noexcept {
    if (device_) return not_host("prepare_wide with host ids");
    Result<WideOptions> options = wide_options_of(admission, copy);
    if (!options.ok()) return options.status().with_context("%s", config_.label.c_str());
    try {
      ids32_.resize(ids.size());
    } catch (...) {
      return Status(ErrorCode::runtime_failure, "prepare_wide: out of host memory");
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] >= config_.num_experts) return out_of_range(i, ids[i]);
      ids32_[i] = ids[i] < 0 ? -1 : static_cast<std::int32_t>(ids[i]);
    }
    return wide(std::span<const std::int32_t>(ids32_), stream, consumer, options.value());
  }
  // The device provider: n int32 ids in device memory. With stream slots and stream admission
  // (the default) the ids are read back with the pool's resident map and the misses streamed
  // through the stream slots (DeviceExpertCache::prepare_wide; eager, at most max_wide_ids ids);
  // otherwise at most max_ids, served in rounds of prepare + prepare_group (through the pool).
  Result<WideSummary> prepare_wide_device(const std::int32_t* device_ids, std::int64_t n, Stream stream,
                                          const WideConsumerFn& consumer, std::string_view admission = {},
                                          std::string_view copy = {}) noexcept {
    if (!device_) {
      return Status::format(ErrorCode::invalid_argument,
                            "%s: prepare_wide with CUDA ids needs provider 'device' (provider '%s' plans on the host: "
                            "pass host ids)",
                            config_.label.c_str(), config_.provider.c_str());
    }
    Result<WideOptions> options = wide_options_of(admission, copy);
    if (!options.ok()) return options.status().with_context("%s", config_.label.c_str());
    const bool streamed = options.value().admission == WideAdmission::stream && config_.stream_slots >= 2;
    if (n < 0 || (!streamed && n > config_.max_ids)) {
      return Status::format(ErrorCode::invalid_argument, "%s: prepare_wide of %lld ids (device provider: 0..max_ids = %d)",
                            config_.label.c_str(), static_cast<long long>(n), config_.max_ids);
    }
    if (device_ids == nullptr && n > 0) {
      return Status::format(ErrorCode::invalid_argument, "%s: prepare_wide of %lld ids from a null pointer",
                            config_.label.c_str(), static_cast<long long>(n));
    }
    return wide(std::span<const std::int32_t>(device_ids, static_cast<std::size_t>(n)), stream, consumer,
                options.value());
  }

  Status invalidate(std::int64_t expert, Stream stream) noexcept {
    if (expert < 0 || expert >= config_.num_experts) {
      return Status::format(ErrorCode::invalid_argument, "%s: invalidate(%lld): expert out of range [0, %d)",
                            config_.label.c_str(), static_cast<long long>(expert), config_.num_experts);
    }
    return cache_->invalidate(static_cast<std::int32_t>(expert), stream);
  }

  // Every CacheStats field by name, plus hit_rate (float) and, for the device provider, the
  // device error word (read and cleared: only when the cache's streams are idle).
  [[nodiscard]] std::vector<StatEntry> stats() const {
    const CacheStats s = cache_->stats();
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
            i("wide_forwards", s.wide_forwards),
            i("wide_rounds", s.wide_rounds),
            i("wide_hits", s.wide_hits),
            i("wide_streamed", s.wide_streamed),
            i("wide_bytes", s.wide_bytes),
            i("slot_bytes", s.slot_bytes),
            i("host_bytes", s.host_bytes),
            StatEntry{"hit_rate", 0, s.hit_rate(), true}};
  }
  [[nodiscard]] std::uint32_t device_errors() noexcept { return cache_->take_errors(); }

  [[nodiscard]] const std::vector<SlotDescriptor>& slots() const noexcept { return slots_; }
  [[nodiscard]] std::uintptr_t expert_map_device() const noexcept {
    return reinterpret_cast<std::uintptr_t>(cache_->forward_map_device());
  }
  [[nodiscard]] std::uintptr_t resident_map_device() const noexcept {
    return reinterpret_cast<std::uintptr_t>(cache_->resident_map_device());
  }
  // Host copy of the forward map (host providers; empty for the device provider).
  [[nodiscard]] std::span<const std::int32_t> expert_map_host() const noexcept { return cache_->forward_map_host(); }
  [[nodiscard]] std::span<const std::int32_t> resident_map_host() const noexcept { return cache_->resident_map_host(); }

  // Debug accessor: the storage's host address of expert `e` of tensor `name` (the caller's
  // memory when adopted without copy).
  [[nodiscard]] Result<std::uintptr_t> host_pointer(std::string_view name, std::int64_t expert) const {
    if (expert < 0 || expert >= config_.num_experts) {
      return Status::format(ErrorCode::invalid_argument, "%s: host_pointer: expert %lld out of range [0, %d)",
                            config_.label.c_str(), static_cast<long long>(expert), config_.num_experts);
    }
    const std::size_t t = find_tensor(cache_->tensors(), name);
    if (t == max_expert_tensors) {
      return Status::format(ErrorCode::invalid_argument, "%s: host_pointer: unknown tensor '%.*s' (layout has: %s)",
                            config_.label.c_str(), static_cast<int>(std::min<std::size_t>(name.size(), 40)), name.data(),
                            names_text().c_str());
    }
    return reinterpret_cast<std::uintptr_t>(cache_->host_tensor(t, static_cast<std::int32_t>(expert)));
  }

  [[nodiscard]] bool device_provider() const noexcept { return device_; }
  // The device provider's fill engine as the cache resolved it (never automatic); nullopt for
  // the host providers.
  [[nodiscard]] std::optional<FillEngine> fill_engine() const noexcept { return fill_engine_; }
  [[nodiscard]] const BridgeConfig& config() const noexcept { return config_; }
  [[nodiscard]] std::string_view provider() const noexcept { return cache_->provider(); }
  [[nodiscard]] std::string_view policy() const noexcept { return cache_->policy(); }
  [[nodiscard]] std::string_view staging() const noexcept { return cache_->staging(); }
  [[nodiscard]] std::string_view storage() const noexcept { return cache_->storage(); }
  [[nodiscard]] AnyExpertCache<Runtime>& cache() noexcept { return *cache_; }

 private:
  CacheBridge() = default;


  [[nodiscard]] std::string names_text() const {
    std::string s;
    for (const auto& t : typed_) s += (s.empty() ? "" : ", ") + t.name;
    return s;
  }
  Status not_host(const char* what) const noexcept {
    return Status::format(ErrorCode::invalid_argument,
                          "%s: %s: provider 'device' plans on the device and takes device ids (a CUDA tensor)",
                          config_.label.c_str(), what);
  }
  Status out_of_range(std::size_t i, std::int64_t id) const noexcept {
    return Status::format(ErrorCode::invalid_argument, "%s: topk_ids[%zu] = %lld out of range (num_experts %d)",
                          config_.label.c_str(), i, static_cast<long long>(id), config_.num_experts);
  }
  // The forward's distinct experts (ids already range-checked; negative = padding) must fit the
  // slots: checked here so the message names them (the planner only counts them).
  Status check_fits(std::span<const std::int32_t> ids) noexcept {
    next_epoch();
    std::size_t unique = 0;
    for (const std::int32_t id : ids) {
      if (id < 0 || stamps_[static_cast<std::size_t>(id)] == epoch_) continue;
      stamps_[static_cast<std::size_t>(id)] = epoch_;
      ++unique;
    }
    if (unique <= static_cast<std::size_t>(config_.capacity)) return {};
    std::vector<std::int32_t> u;
    try {
      u.reserve(unique);
    } catch (...) {
      return Status(ErrorCode::runtime_failure, "prepare: out of host memory");
    }
    for (std::size_t e = 0; e < stamps_.size(); ++e) {
      if (stamps_[e] == epoch_) u.push_back(static_cast<std::int32_t>(e));
    }
    return too_many(u);
  }
  Status too_many(std::span<const std::int32_t> unique) const noexcept {
    std::string list;
    try {
      std::vector<std::int32_t> sorted(unique.begin(), unique.end());
      std::sort(sorted.begin(), sorted.end());
      const std::size_t shown = std::min<std::size_t>(sorted.size(), 32);
      for (std::size_t i = 0; i < shown; ++i) list += (i ? ", " : "") + std::to_string(sorted[i]);
      if (shown < sorted.size()) list += ", ... (" + std::to_string(sorted.size() - shown) + " more)";
    } catch (...) {
      list = "...";
    }
    // The list goes last: a Status message is bounded (message_capacity), and a long list is
    // cut at its end, never the counts.
    return Status::format(ErrorCode::too_many_experts,
                          "%s: %zu unique experts in one forward, capacity %d slots (split it: run_with_expert_cache); "
                          "experts [%s]",
                          config_.label.c_str(), unique.size(), config_.capacity, list.c_str());
  }
  // ids32_ = `ids` narrowed, each in [0, num_experts) and distinct (a list, not a forward).
  Status narrow_unique(std::span<const std::int64_t> ids, const char* what) noexcept {
    try {
      ids32_.resize(ids.size());
    } catch (...) {
      return Status(ErrorCode::runtime_failure, "out of host memory");
    }
    next_epoch();
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= config_.num_experts) {
        return Status::format(ErrorCode::expert_out_of_range, "%s: %s[%zu] = %lld outside [0, %d)", config_.label.c_str(),
                              what, i, static_cast<long long>(ids[i]), config_.num_experts);
      }
      auto& stamp = stamps_[static_cast<std::size_t>(ids[i])];
      if (stamp == epoch_) {
        return Status::format(ErrorCode::duplicate_expert, "%s: %s[%zu] = %lld appears twice (ids must be distinct)",
                              config_.label.c_str(), what, i, static_cast<long long>(ids[i]));
      }
      stamp = epoch_;
      ids32_[i] = static_cast<std::int32_t>(ids[i]);
    }
    return {};
  }
  void next_epoch() noexcept {
    if (++epoch_ == 0) {  // wrapped: old stamps could alias the new epoch
      std::fill(stamps_.begin(), stamps_.end(), 0u);
      epoch_ = 1;
    }
  }
  Result<WideSummary> wide(std::span<const std::int32_t> ids, Stream stream, const WideConsumerFn& consumer,
                           const WideOptions& options) noexcept {
    // Every slot a round's map may name: the pool, then the stream slots.
    const std::int32_t slot_count = config_.capacity + config_.stream_slots;
    WideRoundInfo info;
    try {
      info.slot_bases.resize(slots_.size());
    } catch (...) {
      return Status(ErrorCode::runtime_failure, "prepare_wide: out of host memory");
    }
    return cache_->prepare_wide(
        ids, stream,
        [&](const WideRound& round) -> Status {
          info.index = round.index;
          info.rounds = round.rounds;
          info.streamed = round.streamed;
          info.experts = round.experts;
          info.slots = round.slots;
          info.slot_count = slot_count;
          for (std::size_t t = 0; t < slots_.size(); ++t) {
            info.slot_bases[t] = reinterpret_cast<std::uintptr_t>(round.view.tensors[slots_[t].index].base);
          }
          info.expert_map = reinterpret_cast<std::uintptr_t>(round.view.expert_map);
          info.resident_map = reinterpret_cast<std::uintptr_t>(round.view.resident_map);
          for (const std::int32_t slot : round.slots) {
            if (slot < 0 || slot >= slot_count) {
              return Status::format(ErrorCode::internal, "%s: prepare_wide round %u maps slot %d outside [0, %d)",
                                    config_.label.c_str(), round.index, slot, slot_count);
            }
          }
          return detail::call_wide_consumer(consumer, info);
        },
        options);
  }
  static Result<PrepareResult> counts(const Result<ForwardView>& r) noexcept {
    if (!r.ok()) return r.status();
    PrepareResult p;
    p.hits = r.value().hits;
    p.misses = r.value().misses;
    p.generation = r.value().generation;
    return p;
  }

  BridgeConfig config_;
  std::vector<detail::TypedTensor> typed_;  // names the cache's string_views point into
  std::vector<SlotDescriptor> slots_;
  std::vector<std::int32_t> ids32_;  // int64 ids narrowed (reused)
  std::vector<std::uint32_t> stamps_;  // [num_experts]: seen in the current check (== epoch_)
  std::uint32_t epoch_ = 0;
  bool device_ = false;
  std::optional<FillEngine> fill_engine_;
  std::unique_ptr<AnyExpertCache<Runtime>> cache_;  // last: destroyed before the names it views
};

// ---- the CUDA bridge, non-template (python/src/bridge_cuda.cu) -------------------------------
// The extension never sees CudaRuntime or the .cuh headers: streams travel as void*
// (cudaStream_t), pointers as uintptr_t.
class CudaBridge {
 public:
  virtual ~CudaBridge() = default;
  virtual Result<PrepareResult> prepare_host32(std::span<const std::int32_t> ids, void* stream,
                                               bool name_experts) noexcept = 0;
  virtual Result<PrepareResult> prepare_host64(std::span<const std::int64_t> ids, void* stream,
                                               bool name_experts) noexcept = 0;
  virtual Result<PrepareResult> prepare_device(const std::int32_t* ids, std::int64_t n, void* stream) noexcept = 0;
  virtual Result<PrepareResult> prepare_unique(std::span<const std::int64_t> unique_ids, void* stream) noexcept = 0;
  virtual Result<WideSummary> prepare_wide_host64(std::span<const std::int64_t> ids, void* stream,
                                                  const WideConsumerFn& consumer, std::string_view admission,
                                                  std::string_view copy) noexcept = 0;
  virtual Result<WideSummary> prepare_wide_device(const std::int32_t* ids, std::int64_t n, void* stream,
                                                  const WideConsumerFn& consumer, std::string_view admission,
                                                  std::string_view copy) noexcept = 0;
  virtual Result<PrefetchView> prefetch_host(std::span<const std::int64_t> ids, std::int64_t max_bytes,
                                             std::int64_t expires_after, void* stream,
                                             const HintScores& hints) noexcept = 0;
  virtual Result<PrefetchView> prefetch_device(const std::int32_t* ids, std::int64_t n, std::int64_t max_bytes,
                                               std::int64_t expires_after, void* stream,
                                               const HintScores& hints) noexcept = 0;
  [[nodiscard]] virtual std::vector<std::pair<std::int32_t, std::int32_t>> last_fills() const = 0;
  [[nodiscard]] virtual std::vector<std::pair<std::int32_t, std::int32_t>> last_evictions() const = 0;
  [[nodiscard]] virtual std::span<const std::int32_t> resident_map_host() const noexcept = 0;
  virtual Status invalidate(std::int64_t expert, void* stream) noexcept = 0;
  [[nodiscard]] virtual std::vector<StatEntry> stats() const = 0;
  [[nodiscard]] virtual std::uint32_t device_errors() noexcept = 0;
  [[nodiscard]] virtual const std::vector<SlotDescriptor>& slots() const noexcept = 0;
  [[nodiscard]] virtual std::uintptr_t expert_map_device() const noexcept = 0;
  [[nodiscard]] virtual std::uintptr_t resident_map_device() const noexcept = 0;
  [[nodiscard]] virtual std::span<const std::int32_t> expert_map_host() const noexcept = 0;
  [[nodiscard]] virtual Result<std::uintptr_t> host_pointer(std::string_view name, std::int64_t expert) const = 0;
  [[nodiscard]] virtual bool device_provider() const noexcept = 0;
  // The device provider's resolved fill engine ("copy_engine" | "sm_loads"); "" for host providers.
  [[nodiscard]] virtual std::string fill_engine() const = 0;
  [[nodiscard]] virtual std::string provider() const = 0;
  [[nodiscard]] virtual std::string policy() const = 0;
  [[nodiscard]] virtual std::string staging() const = 0;
  [[nodiscard]] virtual std::string storage() const = 0;
};

// Defined in bridge_cuda.cu (nvcc): the CUDA runtime on the current device plus the bridge.
Result<std::unique_ptr<CudaBridge>> make_cuda_bridge(const BridgeConfig& config, std::span<const HostTensorArg> host);

// Defined in bridge_cuda.cu (nvcc; staging/link_probe.cuh). The link profile of `device` at
// `expert_bytes` (check_link_profile_request first): measured on the first call of this process
// for that pair, then the same profile (link_profile_for); the caller's current device is kept.
Result<LinkProfile> cuda_link_profile(std::int64_t device, std::int64_t expert_bytes);
// Installs a stored profile (the text of LinkProfile::serialize()) for later caches and
// cuda_link_profile calls of its device and expert size: parsed, then set_link_profile (refused
// when the text is malformed or the device's PCI bus id differs; nothing changes then).
Status cuda_set_link_profile(std::string_view text);

}  // namespace expert_cache::inline v0::python
