#pragma once
/// Wide forwards: a forward with more unique experts than the cache holds (a prompt, a large
/// batch), served in rounds by ExpertCache::prepare_wide / ModelExpertCache::prepare_wide.
//
// Each round hands the caller's consumer a view with the contract of a normal prepare()
// (slot buffers, forward-scoped expert map, resident map); the round's experts are disjoint
// from every other round's, so a consumer that accumulates each round's expert outputs
// computes the whole forward (the expert split of planning/split.hpp, run by the library). The copies
// of round r+1 are enqueued on the fill stream before the consumer of round r, so they overlap
// it; a buffer is refilled only after the consumer of the round that read it (edge 10,
// docs/design.md "Wide forwards").
//
// Two admissions (WideAdmission):
//   stream  (default, scan resistant) experts already resident are read from their pool slots
//           (a pure read: the planner, the policy and the hit/miss counters stay as they were),
//           spread over the rounds so each consumer has work while the next fill streams;
//           the others are copied into the cache's stream slots (CacheOptions::stream_slots,
//           appended to the same slot storage so one expert map indexes both), two halves used
//           alternately, never admitted. A run of consecutive expert ids goes to consecutive
//           stream slots as ONE copy per tensor (or per blob) where the storage is dense.
//   admit   the reference providers' behaviour: rounds of at most capacity/2 experts go through
//           the pool with the policy's evictions (round r+1 keeps round r's experts).
//
// Host-only vocabulary plus the helpers both caches share.
#include <algorithm>
#include <concepts>
#include <iterator>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/nvtx.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/types.hpp"
#include "expert_cache/staging/coalescing.hpp"
#include "expert_cache/staging/copy_staging.hpp"
#include "expert_cache/storage/copy_region.hpp"

namespace expert_cache::inline v0 {

/// Where a wide forward's missing experts go (WideOptions::admission).
enum class WideAdmission : std::uint8_t {
  stream,  ///< scan resistant: missing experts go through the stream slots, never into the pool
  admit,   ///< every expert goes through the pool (the policy evicts), as the reference providers
};

[[nodiscard]] constexpr std::string_view to_string(WideAdmission a) noexcept {
  return a == WideAdmission::stream ? "stream" : "admit";
}

/// How stream admission copies a round's missing experts (dense storages with a coalescing
/// staging policy; otherwise always `runs`).
///   runs       every run of consecutive missing ids is one copy per dense region.
///   span       a round is an id range of at most half the stream slots: ONE copy per dense
///              region of the whole range, unneeded and resident experts in it included (they
///              are copied, never mapped).
///   automatic  per round, the cheaper of the two under WideCopyCost (per expert served); a
///              span without gaps is a run, so it is taken only when it skips gaps.
enum class WideCopy : std::uint8_t { runs, span, automatic };

[[nodiscard]] constexpr std::string_view to_string(WideCopy c) noexcept {
  return c == WideCopy::runs ? "runs" : c == WideCopy::span ? "span" : "automatic";
}

/// Cost model of one host->device copy of n bytes: overhead_ns + n / link_bytes_per_ns. The
/// defaults are the H200's copy-size curve (docs/hardware_limits.md: 64 KiB at 11 GB/s, 1 MiB
/// at 43, 4 MiB at 50 against a 55.2 GB/s ceiling: about 5 us of fixed cost per copy). A span
/// wins when the bytes it wastes cost less than the copies it saves: wasted bytes <
/// saved copies x 5 us x 55 GB/s = saved copies x 275 KB.
struct WideCopyCost {
  double copy_overhead_ns = 5000.0;  ///< fixed cost of one copy, ns
  double link_bytes_per_ns = 55.0;   ///< link bandwidth, bytes per ns (= GB/s)
};

/// Options of one prepare_wide() call.
struct WideOptions {
  WideAdmission admission = WideAdmission::stream;  ///< stream slots (scan resistant) or the pool
  WideCopy copy = WideCopy::automatic;               ///< how stream admission copies a round
  WideCopyCost cost{};                               ///< the cost model WideCopy::automatic uses
  /// Stream admission: each round's copies in ONE batched call where the runtime has one
  /// (CudaRuntime: cudaMemcpyBatchAsync; a wide forward is never captured, so it is always
  /// allowed), which keeps the copy engine from paying a fixed cost per copy; false: one copy
  /// call each through the staging policy. The same bytes either way.
  bool batch_copies = true;
};

/// What a wide forward did (returned by prepare_wide once every round's consumer succeeded).
struct WideSummary {
  std::uint32_t rounds = 0;     ///< rounds served (consumer calls)
  std::uint32_t unique = 0;     ///< unique experts of the forward
  std::uint32_t hits = 0;       ///< experts served from the pool without a copy
  std::uint32_t streamed = 0;   ///< stream admission: experts copied into stream slots
  std::uint32_t admitted = 0;   ///< admit admission: experts copied into the pool
  std::uint64_t copies = 0;     ///< copy operations enqueued (a coalesced run counts once per region)
  std::uint64_t bytes = 0;      ///< bytes copied (span copies: the unneeded experts in the span too)
  std::uint32_t span_rounds = 0;  ///< stream admission: rounds copied as one span (WideCopy)
  std::uint32_t wasted = 0;     ///< experts copied by spans that no round maps (unneeded or resident)
  WideAdmission admission = WideAdmission::stream;  ///< the admission that served the forward
  bool fell_back = false;       ///< stream admission asked for without stream slots: served by admit
};

/// Recommended stream slots for a cache: two halves of max(top_k, capacity / 16) slots, i.e.
/// about an eighth of the pool (a round's compute then hides the next round's transfer without
/// taking much memory from the cache).
/// @param capacity  the cache's slots
/// @param top_k     experts per token
/// @return the stream slots to configure (even, at least 2)
[[nodiscard]] constexpr std::int32_t recommended_stream_slots(std::int32_t capacity, std::int32_t top_k) noexcept {
  const std::int32_t half = std::max<std::int32_t>(std::max<std::int32_t>(top_k, 1), capacity / 16);
  return 2 * half;
}

/// Default bound on the ids of one wide forward (CacheOptions::max_wide_ids): 8192 tokens of
/// top-128, far beyond any prompt a single forward takes, small enough to refuse garbage sizes.
inline constexpr std::int64_t default_max_wide_ids = std::int64_t{1} << 20;

namespace detail {

// Staging-ring buffers one wide forward's map uploads need so that the host never waits for one:
// two per round (its map, and at most one resident-map upload) for rounds of `round_experts`
// of `experts`, and 4 to spare.
[[nodiscard]] constexpr std::size_t wide_ring_buffers(std::size_t experts, std::size_t round_experts) noexcept {
  const std::size_t per_round = round_experts < 1 ? 1 : round_experts;
  return 2 * ((experts + per_round - 1) / per_round) + 4;
}

// Where a round's copies go. Without a batch (or a runtime without copy_batch_async) each one
// through the staging policy; with one, collected (a coalescing staging policy issues plain
// copies, so the copies are the same) and issued as ONE batched call by flush().
template <class Staging, class R>
class RoundIssuer {
 public:
  RoundIssuer(Staging& staging, R& rt, typename R::Stream fill, std::vector<CopyDesc>* batch) noexcept
      : staging_(&staging), rt_(&rt), fill_(fill), batch_(batching_runtime<R> ? batch : nullptr) {
    if (batch_ != nullptr) batch_->clear();
  }
  template <class Regions>
  Status issue(const Regions& regions, std::span<const SlotFill> fills) noexcept {
    if (batch_ == nullptr) return staging_->issue(*rt_, fill_, regions, fills);
    // The caches reserve room for a round's copies; should a list not fit, what is collected
    // goes first and these copies one by one (the same copies, never an allocation here).
    if (batch_->capacity() - batch_->size() < regions.copy_regions().count * fills.size()) {
      if (Status s = flush(); !s) return s;
      batch_->clear();
      return staging_->issue(*rt_, fill_, regions, fills);
    }
    return for_each_fill_copy(regions.copy_regions(), fills, [&](void* dst, const void* src, std::size_t n) noexcept {
      batch_->push_back(CopyDesc{dst, src, n});
      return Status();
    });
  }
  Status flush() noexcept {
    if constexpr (batching_runtime<R>) {
      if (batch_ == nullptr || batch_->empty()) return {};
      EXPERT_CACHE_NVTX_RANGE("expert_cache::fill");
      return rt_->copy_batch_async(std::span<const CopyDesc>(*batch_), fill_);
    } else {
      return {};
    }
  }

 private:
  Staging* staging_;
  R* rt_;
  typename R::Stream fill_;
  std::vector<CopyDesc>* batch_;
};

// Issues `fills` (slots consecutive where experts are: the stream slots of one round) with every
// run of consecutive experts in consecutive slots as one copy per dense region; non-dense regions
// and non-coalescing staging policies get one copy per fill and region. Adds the copies issued.
// `batch` (may be null): where a coalescing policy's copies are collected for one batched call.
template <class Staging, class R, class Storage>
Status issue_coalesced(Staging& staging, R& rt, typename R::Stream fill, const Storage& storage,
                       std::span<const SlotFill> fills, std::uint64_t& copies,
                       std::vector<CopyDesc>* batch = nullptr) noexcept {
  const CopyRegions& all = storage.copy_regions();
  if constexpr (!coalescing_staging<Staging>) {
    (void)batch;
    copies += fills.size() * all.count;
    return staging.issue(rt, fill, storage, fills);
  } else {
    if (!coalesces(staging)) {
      copies += fills.size() * all.count;
      return staging.issue(rt, fill, storage, fills);
    }
    RoundIssuer<Staging, R> out(staging, rt, fill, batch);
    RunCopyRegions dense, sparse;
    for (const CopyRegion& r : all) {
      (dense_region(r) ? dense.regions.regions[dense.regions.count++] : sparse.regions.regions[sparse.regions.count++]) = r;
    }
    std::size_t begin = 0;
    while (begin < fills.size()) {
      std::size_t end = begin + 1;
      while (end < fills.size() && fills[end].expert.value == fills[end - 1].expert.value + 1 &&
             fills[end].slot.value == fills[end - 1].slot.value + 1) {
        ++end;
      }
      if (dense.regions.count != 0) {
        RunCopyRegions run = dense;
        for (std::size_t i = 0; i < run.regions.count; ++i) run.regions.regions[i].bytes *= end - begin;
        if (Status s = out.issue(run, fills.subspan(begin, 1)); !s) return s;
        copies += run.regions.count;
      }
      begin = end;
    }
    if (sparse.regions.count != 0) {
      if (Status s = out.issue(sparse, fills); !s) return s;
      copies += fills.size() * sparse.regions.count;
    }
    return out.flush();
  }
}

// A span round (StreamRound::span): ONE copy per dense region of the `width` experts from
// `first` (expert first.expert into slot first.slot onwards), then the non-dense regions of
// the round's `fills` one by one. Only for coalescing staging policies (plan_stream_rounds is
// given no dense regions otherwise). `batch` as for issue_coalesced.
template <class Staging, class R, class Storage>
Status issue_span(Staging& staging, R& rt, typename R::Stream fill, const Storage& storage, SlotFill first,
                  std::size_t width, std::span<const SlotFill> fills, std::uint64_t& copies,
                  std::vector<CopyDesc>* batch = nullptr) noexcept {
  if constexpr (!coalescing_staging<Staging>) {
    (void)first;
    (void)width;
    (void)batch;
    copies += fills.size() * storage.copy_regions().count;
    return staging.issue(rt, fill, storage, fills);
  } else {
    if (!coalesces(staging)) {  // never planned (dense_copy_shape gives 0 regions): per-expert fills
      (void)first;
      (void)width;
      copies += fills.size() * storage.copy_regions().count;
      return staging.issue(rt, fill, storage, fills);
    }
    RoundIssuer<Staging, R> out(staging, rt, fill, batch);
    RunCopyRegions dense, sparse;
    for (const CopyRegion& r : storage.copy_regions()) {
      (dense_region(r) ? dense.regions.regions[dense.regions.count++] : sparse.regions.regions[sparse.regions.count++]) = r;
    }
    if (dense.regions.count != 0) {
      for (std::size_t i = 0; i < dense.regions.count; ++i) dense.regions.regions[i].bytes *= width;
      if (Status s = out.issue(dense, std::span<const SlotFill>(&first, 1)); !s) return s;
      copies += dense.regions.count;
    }
    if (sparse.regions.count != 0) {
      if (Status s = out.issue(sparse, fills); !s) return s;
      copies += fills.size() * sparse.regions.count;
    }
    return out.flush();
  }
}

// Dense copy regions per expert of a storage, and their bytes (what a span copies per expert);
// zero regions where the staging policy (the held one, for a run-time choice) does not coalesce.
template <class Staging, class Storage>
[[nodiscard]] std::pair<std::size_t, std::uint64_t> dense_copy_shape(const Staging& staging,
                                                                     const Storage& storage) noexcept {
  std::size_t n = 0;
  std::uint64_t bytes = 0;
  if (coalesces(staging)) {
    for (const CopyRegion& r : storage.copy_regions()) {
      if (dense_region(r)) {
        ++n;
        bytes += r.bytes;
      }
    }
  }
  return {n, bytes};
}

// One round of stream admission: misses [begin, end) of the forward's ascending missing list.
// span: copied as the id range [first, misses[end - 1]] into consecutive stream slots (slot of
// expert e = the half's first slot + e - first); else each expert k of the round in slot k.
struct StreamRound {
  std::size_t begin = 0, end = 0;
  std::int32_t first = 0;
  bool span = false;
};

// Splits the ascending `misses` into rounds of at most `half` stream slots each. dense_regions
// / dense_bytes: the dense copy regions per expert (0: spans impossible, every round `runs`).
// `out` has room for misses.size() + 1 rounds (reserved by the owner: no allocation).
inline void plan_stream_rounds(std::span<const std::int32_t> misses, std::size_t half, WideCopy mode,
                               const WideCopyCost& cost, std::size_t dense_regions, std::uint64_t dense_bytes,
                               std::vector<StreamRound>& out) noexcept {
  out.clear();
  const std::size_t n = misses.size();
  const double per_copy = cost.copy_overhead_ns;
  const double per_expert = cost.link_bytes_per_ns > 0 ? static_cast<double>(dense_bytes) / cost.link_bytes_per_ns : 0.0;
  std::size_t i = 0;
  while (i < n) {
    // runs: the next `half` misses, one copy per dense region and run.
    const std::size_t a_end = std::min(n, i + half);
    std::size_t a_runs = 1;
    for (std::size_t k = i + 1; k < a_end; ++k) a_runs += misses[k] != misses[k - 1] + 1 ? 1 : 0;
    StreamRound round{i, a_end, misses[i], false};
    if (mode != WideCopy::runs && dense_regions != 0) {
      // span: the misses within `half` ids of the first one, one copy per dense region.
      std::size_t b_end = i + 1;
      while (b_end < n && static_cast<std::size_t>(misses[b_end] - misses[i]) < half) ++b_end;
      const auto width = static_cast<double>(misses[b_end - 1] - misses[i] + 1);
      const double cost_a = (static_cast<double>(a_runs * dense_regions) * per_copy +
                             static_cast<double>(a_end - i) * per_expert) /
                            static_cast<double>(a_end - i);
      const double cost_b =
          (static_cast<double>(dense_regions) * per_copy + width * per_expert) / static_cast<double>(b_end - i);
      // A span without gaps is a run: automatic keeps the fuller runs round then.
      const bool gaps = width > static_cast<double>(b_end - i);
      if (mode == WideCopy::span || (gaps && cost_b < cost_a)) round = StreamRound{i, b_end, misses[i], true};
    }
    out.push_back(round);
    i = round.end;
  }
}

// The forward's unique experts, ascending, from top-k ids (negative = padding), and each one's
// number of ids: one pass over the ids, which a prompt makes long (tokens x top_k) and which
// runs before the forward's first copy can start. Validated completely before the caller changes
// anything. `rows` holds one counter per expert, all zero on entry; on success rows[e] is e's
// ids for each e in `out` (the caller zeroes them again with clear_wide_rows), on error all of
// rows is zero again. `out` has room for num_experts ids.
inline Status wide_unique(std::span<const std::int32_t> ids, std::int32_t num_experts, std::int64_t max_ids,
                          std::vector<std::uint32_t>& rows, std::vector<std::int32_t>& out) noexcept {
  out.clear();
  if (static_cast<std::int64_t>(ids.size()) > max_ids) {
    return Status::format(ErrorCode::too_many_experts,
                          "wide forward of %zu ids exceeds the configured maximum of %lld (CacheOptions::max_wide_ids)",
                          ids.size(), static_cast<long long>(max_ids));
  }
  const auto experts = static_cast<std::uint32_t>(num_experts);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int32_t id = ids[i];
    if (static_cast<std::uint32_t>(id) < experts) {
      ++rows[static_cast<std::size_t>(id)];
    } else if (id >= 0) [[unlikely]] {
      for (std::size_t j = 0; j < i; ++j) {
        if (ids[j] >= 0) rows[static_cast<std::size_t>(ids[j])] = 0;
      }
      return Status::format(ErrorCode::expert_out_of_range, "expert id %d is outside [0, %d)", id, num_experts);
    }
  }
  for (std::int32_t e = 0; e < num_experts; ++e) {
    if (rows[static_cast<std::size_t>(e)] != 0) out.push_back(e);  // capacity num_experts reserved by the owner
  }
  return {};
}

// Zeroes the counters wide_unique left for `unique` (only those entries are touched).
inline void clear_wide_rows(std::span<const std::int32_t> unique, std::vector<std::uint32_t>& rows) noexcept {
  for (const std::int32_t e : unique) rows[static_cast<std::size_t>(e)] = 0;
}

// Zeroes them when the forward that counted them returns, on every path.
struct ClearWideRowsOnExit {
  const std::vector<std::int32_t>& unique;
  std::vector<std::uint32_t>& rows;
  ~ClearWideRowsOnExit() { clear_wide_rows(unique, rows); }
};

// The checks of a call that must run eagerly, before its cache changes anything: the staging's
// own precheck where it has one, and no stream capture of `stream` (`under_capture` says why).
template <class Runtime, class Staging>
Status eager_call_allowed(Runtime& rt, Staging& staging, typename Runtime::Stream stream,
                          const char* under_capture) noexcept {
  if constexpr (requires { staging.precheck(rt, stream); }) {
    if (Status s = staging.precheck(rt, stream); !s) return s;
  }
  Result<bool> capturing = rt.is_capturing(stream);
  if (!capturing.ok()) return capturing.status();
  if (capturing.value()) return Status(ErrorCode::capture_unsupported, under_capture);
  return {};
}

// The checks every wide forward starts with (the ids are checked next, by wide_unique): the
// rounds wait on the host, so no capture.
template <class Runtime, class Staging>
Status wide_forward_allowed(Runtime& rt, Staging& staging, typename Runtime::Stream stream) noexcept {
  return eager_call_allowed(rt, staging, stream, "prepare_wide() under stream capture is not supported");
}

// Which rounds of a stream-admitted wide forward read which hits: round r reads hits
// [begin[r], begin[r + 1]) of the ascending `hits` from their pool slots. A round's consumer runs
// while the next round's fill streams, and a hit needs no copy, so the hits are what keeps the
// consumer busy while the link works: they are spread over the rounds a later fill can hide
// (0 .. R - 2), in equal shares of their rows (the forward's ids naming them, so a popular expert
// weighs what its compute weighs), and the last round, whose consumer nothing overlaps, carries
// only its misses. With every hit in round 0 instead, round 0's consumer could hold most of the
// layer's compute while only one further fill (one free stream half) ran. With one round every
// hit is in it.
// `rows[e]`: e's ids in the forward (an expert counted 0 weighs 1). `begin` gets rounds + 1
// entries (reserved by the owner: no allocation).
inline void split_wide_hits(std::span<const std::int32_t> hits, std::span<const std::uint32_t> rows, std::size_t rounds,
                            std::vector<std::size_t>& begin) noexcept {
  begin.clear();
  const std::size_t carriers = rounds > 1 ? rounds - 1 : 1;
  const auto weight = [&](std::int32_t e) { return std::max<std::uint64_t>(1, rows[static_cast<std::size_t>(e)]); };
  std::uint64_t total = 0;
  for (const std::int32_t e : hits) total += weight(e);
  begin.push_back(0);
  std::uint64_t before = 0;
  for (std::size_t i = 0; i < hits.size(); ++i) {
    const std::uint64_t w = weight(hits[i]);
    // The round of the hit's midpoint (2 * before + w) / (2 * total) of the way through the
    // hits' rows; non-decreasing in i, so each round's hits are a contiguous ascending range.
    const std::size_t r = std::min<std::size_t>(carriers - 1, static_cast<std::size_t>((2 * before + w) * carriers / (2 * total)));
    while (begin.size() <= r) begin.push_back(i);
    before += w;
  }
  while (begin.size() <= rounds) begin.push_back(hits.size());
}

// Round r's share of the hits, as split_wide_hits left it in `begin`.
[[nodiscard]] inline std::span<const std::int32_t> round_hits(std::span<const std::int32_t> hits,
                                                              std::span<const std::size_t> begin, std::size_t r) noexcept {
  return hits.subspan(begin[r], begin[r + 1] - begin[r]);
}

// Round r's experts (ascending) and their slots, as both caches' stream admission serves them:
// `hits` (round r's share, split_wide_hits) are read from their pool slots; each streamed expert
// of `streamed` (the round's ascending misses) takes stream_slot(r, its index in `streamed`). The
// outputs are cleared and refilled (reserved by the owner: no allocation).
template <class StreamSlot>
void compose_wide_round(std::size_t r, std::span<const std::int32_t> hits, std::span<const std::int32_t> streamed,
                        std::span<const std::int32_t> resident, StreamSlot&& stream_slot,
                        std::vector<std::int32_t>& experts, std::vector<std::int32_t>& slots) {
  experts.clear();
  slots.clear();
  std::merge(hits.begin(), hits.end(), streamed.begin(), streamed.end(), std::back_inserter(experts));
  std::size_t k = 0;  // streamed's index of the next streamed expert (experts is ascending)
  for (const std::int32_t e : experts) {
    const std::int32_t pool = resident[static_cast<std::size_t>(e)];
    slots.push_back(pool != absent_slot ? pool : stream_slot(r, k++));
  }
}

// The host vectors of one cache's wide forwards, reserved at construction (no allocation while
// a forward runs).
struct WideScratch {
  std::vector<std::int32_t> unique, hits, misses, round, slots, map;
  std::vector<std::uint32_t> rows;      // per expert: its ids in the wide forward (zero between forwards)
  std::vector<std::size_t> hit_begin;   // round r's hits: [hit_begin[r], hit_begin[r + 1]) of hits
  std::vector<SlotFill> fills;
  std::vector<CopyDesc> batch;          // a stream round's copies for one batched call (WideOptions::batch_copies)
  std::vector<StreamRound> plan;

  void reserve(std::size_t experts, std::size_t copies_per_fill) {
    unique.reserve(experts);
    hits.reserve(experts);
    misses.reserve(experts);
    round.reserve(experts);
    slots.reserve(experts);
    fills.reserve(experts);
    batch.reserve(experts * copies_per_fill);  // a round's copies: at most one per fill and region
    plan.reserve(experts + 1);
    hit_begin.reserve(experts + 2);
    rows.assign(experts, 0);
    map.assign(experts, absent_slot);
  }
};

}  // namespace detail

}  // namespace expert_cache::inline v0
