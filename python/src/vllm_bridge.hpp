#pragma once
// The torch-free half of the vLLM-surface providers (expert_cache_torch.vllm): what vLLM's
// expert-cache providers check and decide, in plain data, so CI tests it without torch or a GPU
// (tests/host/test_vllm_bridge.cpp). docs/reference_providers.md describes the two providers;
// docs/python.md "Coming from vLLM" maps their surface onto this one.
//
//   validate_provider_sources  the constructor's tensors (w13_weight, w2_weight, the optional
//                              scale pairs) as (name, dtype, element size, shape) records ->
//                              E, the effective capacity, bytes per expert of each tensor;
//   provider_semantics         "lfru" | "row" | "device" -> the AnyExpertCache provider/policy;
//   ReferencePlanner           the library's host planners (Lfru, Lru) alone: hits, misses,
//                              fills, victims and maps of every call, the oracle the GPU test
//                              compares the providers with;
//   plan_split                 the token / expert split of a forward wider than the cache;
//   prefetch_order             the order a scored prefetch considers its hints (HintSelector).
//
// Host tier: g++ alone.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "expert_cache/base/status.hpp"
#include "expert_cache/base/tensor_bytes.hpp"
#include "expert_cache/eviction/lfru.hpp"
#include "expert_cache/eviction/lru.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/planning/split.hpp"
#include "expert_cache/prefetch/hint_selection.hpp"
#include "expert_cache/storage/slot_storage.hpp"  // max_pool_bytes

namespace expert_cache::inline v0::python {

// One constructor tensor as the extension sees it. `given` false: the argument was None.
struct SourceArg {
  std::string name;       // w13_weight | w2_weight | w13_scale | w2_scale | w13_scale_2 | w2_scale_2
  bool given = false;
  std::string dtype;      // torch's name, e.g. "torch.bfloat16" (compared, never interpreted)
  std::size_t element_size = 0;
  std::vector<std::int64_t> shape;
};

// A validated tensor: its slot-array name (the AnyExpertCache tensor), bytes per expert and the
// per-expert (trailing) shape the slot buffer gets.
struct ProviderSource {
  std::string name;       // the constructor argument
  std::string slot_name;  // w13 | w2 | w13_scale | w2_scale | w13_scale_2 | w2_scale_2
  std::string dtype;
  std::size_t bytes_per_expert = 0;
  std::vector<std::int64_t> trailing;
};

struct ProviderSpec {
  std::int32_t num_experts = 0;
  std::int32_t capacity = 0;  // min(requested, num_experts), as vLLM's effective capacity
  std::vector<ProviderSource> sources;  // given tensors, in the order of provider_source_names
};

inline constexpr std::array<std::string_view, 6> provider_source_names = {
    "w13_weight", "w2_weight", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2"};
inline constexpr std::array<std::string_view, 6> provider_slot_names = {"w13",      "w2",          "w13_scale",
                                                                         "w2_scale", "w13_scale_2", "w2_scale_2"};

namespace detail {

inline std::string shape_of(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace detail

// The constructor's checks, in vLLM's order of concern, before anything is allocated:
// - capacity > 0 (the row provider's ValueError); capacity above E is clamped to E (vLLM's
//   effective capacity, min(cache size, experts));
// - w13_weight and w2_weight given, [E, ...] with at least 2 dimensions, the same E and dtype;
// - w13_scale / w2_scale and w13_scale_2 / w2_scale_2 each given as a pair or not at all, each
//   with at least 1 dimension and size(0) == E (the row provider's check of the _2 scales, applied
//   to both pairs: a scale that is not per expert has no slot), the two of a pair of one dtype;
// - every tensor at least one element per expert, at most 2^40 bytes per expert.
// Errors name the tensor and the expected value (ErrorCode::invalid_argument or
// invalid_capacity: the extension raises ValueError).
inline Result<ProviderSpec> validate_provider_sources(std::int64_t capacity, std::span<const SourceArg> args,
                                                      std::string_view label = "expert_cache") {
  const std::string l(label.substr(0, 64));
  std::array<const SourceArg*, 6> by_name{};
  for (const SourceArg& a : args) {
    std::size_t i = 0;
    while (i < provider_source_names.size() && provider_source_names[i] != a.name) ++i;
    if (i == provider_source_names.size()) {
      return Status::format(ErrorCode::invalid_argument, "%s: unknown source tensor '%.*s'", l.c_str(),
                            static_cast<int>(std::min<std::size_t>(a.name.size(), 40)), a.name.c_str());
    }
    if (by_name[i] != nullptr) {
      return Status::format(ErrorCode::invalid_argument, "%s: source tensor '%s' given twice", l.c_str(), a.name.c_str());
    }
    by_name[i] = &a;
  }
  const auto given = [&](std::size_t i) { return by_name[i] != nullptr && by_name[i]->given; };
  if (capacity <= 0) {
    return Status::format(ErrorCode::invalid_capacity, "%s: capacity must be positive, got %lld", l.c_str(),
                          static_cast<long long>(capacity));
  }
  for (std::size_t i = 0; i < 2; ++i) {
    if (!given(i)) {
      return Status::format(ErrorCode::invalid_argument, "%s: %s is required (a tensor [E, ...])", l.c_str(),
                            std::string(provider_source_names[i]).c_str());
    }
  }
  for (std::size_t p = 2; p < 6; p += 2) {
    if (given(p) != given(p + 1)) {
      const std::string have(provider_source_names[given(p) ? p : p + 1]);
      const std::string missing(provider_source_names[given(p) ? p + 1 : p]);
      return Status::format(ErrorCode::invalid_argument,
                            "%s: %s given without %s: per-expert scales come in pairs (give both or neither)", l.c_str(),
                            have.c_str(), missing.c_str());
    }
  }
  const SourceArg& w13 = *by_name[0];
  if (w13.shape.size() < 2) {
    return Status::format(ErrorCode::invalid_argument, "%s: w13_weight has shape %s, expected [E, ...] with at least 2 dimensions",
                          l.c_str(), detail::shape_of(w13.shape).c_str());
  }
  const std::int64_t E = w13.shape[0];
  if (E < 1 || E > (std::int64_t{1} << 24)) {
    return Status::format(ErrorCode::invalid_argument, "%s: w13_weight has %lld experts (shape[0]), expected 1..2^24",
                          l.c_str(), static_cast<long long>(E));
  }

  ProviderSpec spec;
  spec.num_experts = static_cast<std::int32_t>(E);
  spec.capacity = static_cast<std::int32_t>(std::min<std::int64_t>(capacity, E));
  for (std::size_t i = 0; i < provider_source_names.size(); ++i) {
    if (!given(i)) continue;
    const SourceArg& a = *by_name[i];
    const bool weight = i < 2;
    const std::size_t min_dims = weight ? 2 : 1;
    if (a.shape.size() < min_dims || a.shape[0] != E) {
      const std::string expected = weight ? "[" + std::to_string(E) + ", ...]"
                                          : "[" + std::to_string(E) + "] or [" + std::to_string(E) + ", ...]";
      return Status::format(ErrorCode::invalid_argument,
                            "%s: %s has shape %s, expected %s (one row per expert, E = w13_weight.shape[0])", l.c_str(),
                            a.name.c_str(), detail::shape_of(a.shape).c_str(), expected.c_str());
    }
    const SourceArg* partner = (i % 2 == 1) ? by_name[i - 1] : nullptr;
    if (partner != nullptr && a.dtype != partner->dtype) {
      return Status::format(ErrorCode::invalid_argument, "%s: %s has dtype %.*s, expected %.*s (%s's)", l.c_str(),
                            a.name.c_str(), static_cast<int>(std::min<std::size_t>(a.dtype.size(), 40)), a.dtype.c_str(),
                            static_cast<int>(std::min<std::size_t>(partner->dtype.size(), 40)), partner->dtype.c_str(),
                            partner->name.c_str());
    }
    if (a.element_size == 0 || a.element_size > 16) {
      return Status::format(ErrorCode::invalid_argument, "%s: %s has element size %zu bytes (accepted: 1..16)", l.c_str(),
                            a.name.c_str(), a.element_size);
    }
    std::size_t bytes = a.element_size;
    for (std::size_t d = 1; d < a.shape.size(); ++d) {
      const std::int64_t n = a.shape[d];
      if (n <= 0) {
        return Status::format(ErrorCode::invalid_argument, "%s: %s has shape %s: every dimension after the first must be >= 1",
                              l.c_str(), a.name.c_str(), detail::shape_of(a.shape).c_str());
      }
      if (static_cast<std::uint64_t>(n) > max_pool_bytes / bytes) {
        return Status::format(ErrorCode::invalid_argument, "%s: %s has shape %s: more than 2^40 bytes per expert", l.c_str(),
                              a.name.c_str(), detail::shape_of(a.shape).c_str());
      }
      bytes *= static_cast<std::size_t>(n);
    }
    ProviderSource src;
    src.name = a.name;
    src.slot_name = std::string(provider_slot_names[i]);
    src.dtype = a.dtype;
    src.bytes_per_expert = bytes;
    src.trailing.assign(a.shape.begin() + 1, a.shape.end());
    spec.sources.push_back(std::move(src));
  }
  return spec;
}

// vLLM's invalidate(expert_id) looks the id up among the experts the provider holds, so an id it
// does not hold is a no-op whatever its value: never loaded, already dropped, negative or >= E.
// The vLLM-surface classes invalidate through this; the native API (CacheBridge::invalidate,
// ExpertCache.invalidate) keeps refusing ids outside [0, E). Works with CacheBridge and CudaBridge.
template <class Bridge, class Stream>
Status invalidate_if_held(Bridge& bridge, std::int64_t num_experts, std::int64_t expert, Stream stream) noexcept {
  if (expert < 0 || expert >= num_experts) return {};
  return bridge.invalidate(expert, stream);
}

// The order in which a scored prefetch considers its hints (HintSelector, the rule every prefetch
// entry applies: the ids scoring below min_score dropped, the others highest score first, equal
// scores in the given order). An accepted scored prefetch fills in this order, so it is the
// processing order the providers' compatibility state (_vllm_state.StateLedger) follows.
// `scores`: one per id. Errors (invalid_argument): another number of scores, an id outside
// int32, and those of check_hint_scores.
inline Result<std::vector<std::int64_t>> prefetch_order(std::span<const std::int64_t> ids, std::span<const float> scores,
                                                        float min_score) {
  if (scores.size() != ids.size()) {
    return Status::format(ErrorCode::invalid_argument, "prefetch_order: %zu scores for %zu ids (one score per id)",
                          scores.size(), ids.size());
  }
  if (ids.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
    return Status::format(ErrorCode::invalid_argument, "prefetch_order: %zu ids (at most 2^31 - 1)", ids.size());
  }
  std::vector<std::int32_t> narrow(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < std::numeric_limits<std::int32_t>::min() || ids[i] > std::numeric_limits<std::int32_t>::max()) {
      return Status::format(ErrorCode::invalid_argument, "prefetch_order: ids[%zu] = %lld is not an expert id", i,
                            static_cast<long long>(ids[i]));
    }
    narrow[i] = static_cast<std::int32_t>(ids[i]);
  }
  HintSelector selector(static_cast<std::int32_t>(narrow.size()));
  if (Status s = selector.select(narrow, scores, min_score); !s) return s;
  const std::span<const std::int32_t> chosen = selector.ids();
  return std::vector<std::int64_t>(chosen.begin(), chosen.end());
}

// The semantics of one vLLM provider, as AnyExpertCache names.
struct ProviderChoice {
  std::string provider;  // cached | row | device
  std::string policy;    // lfru | lru
};

// "lfru": vLLM's CachedWeightProvider (Lfru, bit for bit: docs/reference_providers.md "LFRU,
// exactly"); "row": the row provider (Lru with in-forward protection, slot 0 first); "device":
// planned on the GPU from CUDA ids (Lru; CUDA-graph capturable). `policy` ("" = the semantics'
// own) swaps the eviction policy of "lfru"/"row" by name (any AnyExpertCache policy; the
// factory refuses unknown ones); for "device" it names a device policy (lru, lfru or crf).
inline Result<ProviderChoice> provider_semantics(std::string_view semantics, std::string_view policy = {}) {
  ProviderChoice c;
  if (semantics == "lfru") {
    c = {"cached", "lfru"};
  } else if (semantics == "row") {
    c = {"row", "lru"};
  } else if (semantics == "device") {
    c = {"device", "lru"};
  } else {
    return Status::format(ErrorCode::invalid_argument,
                          "unknown semantics '%.*s' (valid: lfru = vLLM's CachedWeightProvider, row = the row provider's "
                          "LRU, device = planned on the GPU)",
                          static_cast<int>(std::min<std::size_t>(semantics.size(), 40)), semantics.data());
  }
  if (!policy.empty()) c.policy = std::string(policy.substr(0, 64));
  return c;
}

// The library's host planner alone, by policy name ("lfru" | "lru"): the reference semantics the
// providers must reproduce. Rejected calls leave it unchanged (ForwardPlanner's guarantee).
class ReferencePlanner {
 public:
  struct Step {
    std::uint32_t hits = 0;
    std::uint32_t misses = 0;
    std::vector<std::pair<std::int32_t, std::int32_t>> fills;      // (expert, slot)
    std::vector<std::pair<std::int32_t, std::int32_t>> evictions;  // (expert, slot)
  };

  static Result<std::unique_ptr<ReferencePlanner>> create(std::string_view policy, std::int32_t num_experts,
                                                          std::int32_t capacity, std::int32_t top_k) {
    if (num_experts <= 0 || num_experts > (1 << 24)) {
      return Status::format(ErrorCode::invalid_argument, "reference planner: num_experts %d (accepted: 1..2^24)", num_experts);
    }
    if (top_k < 1 || capacity < top_k || capacity > num_experts) {
      return Status::format(ErrorCode::invalid_capacity,
                            "reference planner: capacity %d (accepted: top_k %d .. num_experts %d)", capacity, top_k,
                            num_experts);
    }
    std::unique_ptr<ReferencePlanner> p(new ReferencePlanner());
    const CacheShape shape{num_experts, capacity};
    try {
      if (policy == "lfru") {
        p->impl_ = std::make_unique<Impl<Lfru>>(shape, top_k);
      } else if (policy == "lru") {
        p->impl_ = std::make_unique<Impl<Lru>>(shape, top_k);
      } else {
        return Status::format(ErrorCode::invalid_argument, "reference planner: unknown policy '%.*s' (valid: lfru, lru)",
                              static_cast<int>(std::min<std::size_t>(policy.size(), 40)), policy.data());
      }
    } catch (const Error& e) {
      return Status(e.code(), e.what());
    }
    return Result<std::unique_ptr<ReferencePlanner>>(std::move(p));
  }

  // Top-k ids (negative = padding) or, with `unique`, an explicit unique list in its order.
  Result<Step> plan(std::span<const std::int32_t> ids, bool unique) { return impl_->plan(ids, unique); }
  Status invalidate(std::int32_t expert) { return impl_->invalidate(expert); }
  [[nodiscard]] std::vector<std::int32_t> forward_map() const { return impl_->forward_map(); }
  [[nodiscard]] std::vector<std::int32_t> resident_map() const { return impl_->resident_map(); }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual Result<Step> plan(std::span<const std::int32_t> ids, bool unique) = 0;
    virtual Status invalidate(std::int32_t expert) = 0;
    [[nodiscard]] virtual std::vector<std::int32_t> forward_map() const = 0;
    [[nodiscard]] virtual std::vector<std::int32_t> resident_map() const = 0;
  };
  template <class Policy>
  struct Impl final : Base {
    Impl(CacheShape shape, std::int32_t top_k) : planner(shape, top_k) {}
    Result<Step> plan(std::span<const std::int32_t> ids, bool unique) override {
      Status s = unique ? planner.plan_unique(ids, last) : planner.plan_topk(ids, last);
      if (!s) return s;
      Step out;
      out.hits = last.hits;
      out.misses = last.misses;
      for (const SlotFill& f : last.fills) out.fills.emplace_back(f.expert.value, f.slot.value);
      for (const SlotEviction& v : last.evictions) out.evictions.emplace_back(v.expert.value, v.slot.value);
      return out;
    }
    Status invalidate(std::int32_t expert) override {
      Result<SlotId> r = planner.invalidate(expert);
      return r.ok() ? Status() : r.status();
    }
    [[nodiscard]] std::vector<std::int32_t> forward_map() const override {
      return {planner.forward_map().begin(), planner.forward_map().end()};
    }
    [[nodiscard]] std::vector<std::int32_t> resident_map() const override {
      return {planner.resident_map().begin(), planner.resident_map().end()};
    }
    ForwardPlanner<Policy> planner;
    ForwardPlan last;
  };
  ReferencePlanner() = default;
  std::unique_ptr<Base> impl_;
};

// One part of a split forward: rows [row_begin, row_end) of the top-k matrix and the unique
// experts to prepare for them; include_shared: the part that adds the forward-wide work.
struct SplitPart {
  std::int64_t row_begin = 0;
  std::int64_t row_end = 0;
  std::vector<std::int32_t> unique_ids;
  bool include_shared = false;
};

// The split of a [rows, top_k] forward (ids row-major; negative = padding; ids >= num_experts
// refused) into parts that each fit `capacity` slots: "token" (planning/split.hpp plan_token_chunks:
// exact, whole rows per part) or "expert" (plan_expert_groups: every row per part, experts cut
// into groups, part sums differ from one call only by rounding).
inline Result<std::vector<SplitPart>> plan_split(std::span<const std::int64_t> ids, std::int32_t top_k,
                                                 std::int32_t capacity, std::int32_t num_experts, std::string_view split) {
  if (split != "token" && split != "expert") {
    return Status::format(ErrorCode::invalid_argument, "unknown split '%.*s' (valid: token, expert)",
                          static_cast<int>(std::min<std::size_t>(split.size(), 40)), split.data());
  }
  if (top_k < 1) return Status::format(ErrorCode::invalid_argument, "split: top_k %d (accepted: >= 1)", top_k);
  std::vector<std::int32_t> ids32(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= num_experts) {
      return Status::format(ErrorCode::expert_out_of_range, "topk_ids[%zu] = %lld outside [0, %d)", i,
                            static_cast<long long>(ids[i]), num_experts);
    }
    ids32[i] = ids[i] < 0 ? -1 : static_cast<std::int32_t>(ids[i]);
  }
  std::vector<SplitPart> parts;
  const auto rows = static_cast<std::int64_t>(ids.size() / static_cast<std::size_t>(top_k));
  if (split == "token" && ids.size() % static_cast<std::size_t>(top_k) == 0) {
    // No split helps a token that alone needs more experts than slots: vLLM's plan_chunks words
    // it "one token routes to N experts"; said here with the row and the capacity.
    std::vector<std::int32_t> row;
    for (std::int64_t r = 0; r < rows; ++r) {
      const auto first = ids32.begin() + r * top_k;
      row.assign(first, first + top_k);
      std::sort(row.begin(), row.end());
      row.erase(std::unique(row.begin(), row.end()), row.end());
      const auto n = static_cast<std::int64_t>(row.size()) - (row.front() < 0 ? 1 : 0);
      if (n > capacity) {
        return Status::format(ErrorCode::row_exceeds_capacity,
                              "one token routes to %lld experts (row %lld) but capacity is %d slots: no split fits it",
                              static_cast<long long>(n), static_cast<long long>(r), capacity);
      }
    }
  }
  if (split == "token") {
    auto chunks = plan_token_chunks(ids32, top_k, capacity, num_experts);
    if (!chunks.ok()) return chunks.status();
    for (TokenChunk& c : chunks.value()) parts.push_back({c.row_begin, c.row_end, std::move(c.unique_ids), true});
  } else {
    auto groups = plan_expert_groups(ids32, top_k, capacity, num_experts);
    if (!groups.ok()) return groups.status();
    for (ExpertGroup& g : groups.value()) parts.push_back({0, rows, std::move(g.unique_ids), g.include_shared});
  }
  return parts;
}

}  // namespace expert_cache::inline v0::python
