#pragma once
/// The rounds of a wide forward with stream admission on a pool (detail::run_stream_rounds),
/// shared by ExpertCache and DeviceExpertCache, and the guarded call of a wide consumer.
// Both caches reach the rounds through function-pointer hooks, so the rounds are compiled once
// per cache type, not once per consumer type.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <utility>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/runtime_types.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/base/types.hpp"
#include "expert_cache/cache/views.hpp"
#include "expert_cache/cache/wide.hpp"
#include "expert_cache/core/ordering_core.hpp"

namespace expert_cache::inline v0 {

namespace detail {

// Stream admission's rounds on a pool (ExpertCache and DeviceExpertCache; cache/wide.hpp's header):
// the forward's unique experts (w.unique, their row counts in w.rows) split into the pool's
// residents (`resident`: expert -> pool slot, host memory), read in place and spread over the
// rounds, and the others, streamed into stream half r % 2 (slots `capacity` on) by the copies of
// `staging` from `storage`'s regions. The ordering is the core's wide entries (edges 3 and 10);
// the caller ran wide_begin. What differs between the caches comes from `hooks` (a cache's own
// hooks object behind StreamRoundHooks::of):
//   hooks.before_rounds(hits) -> Status   once, before the first fill (e.g. edge 9's waits)
//   hooks.resident_upload() -> MapUpload  the resident map a round's fill uploads (empty: none)
//   hooks.uploaded()                      after a fill that uploaded it
//   hooks.round_map(r) -> std::int32_t*   round r's device forward map (two, alternating)
//   hooks.view() -> ForwardView           the view a round's map goes into
//   hooks.consume(round) -> Status        the caller's consumer, its failure in context
//   hooks.served(hits, streamed)          after a round's consumer
//   hooks.fault()                         a runtime failure (not the consumer's)
// A cache's stream-round hooks behind function pointers (the members run_stream_rounds calls):
// the rounds are then compiled once per cache type, not once per consumer type, and a
// run-time-selected cache's host and device providers share one copy of them. A round is a
// fill and a consumer call, so the indirect calls are noise beside it.
struct StreamRoundHooks {
  void* self = nullptr;
  Status (*before_rounds_)(void*, std::span<const std::int32_t>) noexcept = nullptr;
  MapUpload (*resident_upload_)(void*) noexcept = nullptr;
  void (*uploaded_)(void*) noexcept = nullptr;
  std::int32_t* (*round_map_)(void*, std::size_t) noexcept = nullptr;
  ForwardView (*view_)(void*) noexcept = nullptr;
  Status (*consume_)(void*, const WideRound&) noexcept = nullptr;
  void (*served_)(void*, std::size_t, std::size_t) noexcept = nullptr;
  void (*fault_)(void*) noexcept = nullptr;

  template <class Hooks>
  [[nodiscard]] static StreamRoundHooks of(Hooks& h) noexcept {
    StreamRoundHooks r;
    r.self = &h;
    r.before_rounds_ = [](void* p, std::span<const std::int32_t> hits) noexcept {
      return static_cast<Hooks*>(p)->before_rounds(hits);
    };
    r.resident_upload_ = [](void* p) noexcept { return static_cast<Hooks*>(p)->resident_upload(); };
    r.uploaded_ = [](void* p) noexcept { static_cast<Hooks*>(p)->uploaded(); };
    r.round_map_ = [](void* p, std::size_t round) noexcept { return static_cast<Hooks*>(p)->round_map(round); };
    r.view_ = [](void* p) noexcept { return static_cast<const Hooks*>(p)->view(); };
    r.consume_ = [](void* p, const WideRound& round) noexcept { return static_cast<Hooks*>(p)->consume(round); };
    r.served_ = [](void* p, std::size_t hits, std::size_t streamed) noexcept {
      static_cast<Hooks*>(p)->served(hits, streamed);
    };
    r.fault_ = [](void* p) noexcept { static_cast<Hooks*>(p)->fault(); };
    return r;
  }
  Status before_rounds(std::span<const std::int32_t> hits) const noexcept { return before_rounds_(self, hits); }
  MapUpload resident_upload() const noexcept { return resident_upload_(self); }
  void uploaded() const noexcept { uploaded_(self); }
  std::int32_t* round_map(std::size_t r) const noexcept { return round_map_(self, r); }
  ForwardView view() const noexcept { return view_(self); }
  Status consume(const WideRound& round) const noexcept { return consume_(self, round); }
  void served(std::size_t hits, std::size_t streamed) const noexcept { served_(self, hits, streamed); }
  void fault() const noexcept { fault_(self); }
};

template <class Core, class Staging, class R, class Storage>
Status run_stream_rounds(Core& core, Staging& staging, R& rt, const Storage& storage, typename R::Stream stream,
                         std::span<const std::int32_t> resident, std::int32_t capacity, std::int32_t stream_slots,
                         std::uint64_t bytes_per_expert, const WideOptions& options, WideScratch& w,
                         const StreamRoundHooks& hooks, WideSummary& summary) noexcept {
  w.hits.clear();
  w.misses.clear();
  for (const std::int32_t e : w.unique) {
    const std::int32_t slot = resident[static_cast<std::size_t>(e)];
    // A slot outside the pool is no residency to read (a device-held map is not trusted blindly).
    (slot >= 0 && slot < capacity ? w.hits : w.misses).push_back(e);
  }
  const std::size_t half = static_cast<std::size_t>(stream_slots / 2);
  std::vector<CopyDesc>* const batch = options.batch_copies ? &w.batch : nullptr;
  // Not a structured binding: the fill lambda below captures both (clang before 16 refuses that).
  const std::pair<std::size_t, std::uint64_t> dense_shape = dense_copy_shape(staging, storage);
  const std::size_t dense_regions = dense_shape.first;
  const std::uint64_t dense_bytes = dense_shape.second;
  plan_stream_rounds(w.misses, half, options.copy, options.cost, dense_regions, dense_bytes, w.plan);
  const std::size_t rounds = std::max<std::size_t>(1, w.plan.size());
  split_wide_hits(w.hits, w.rows, rounds, w.hit_begin);
  const auto hits_of = [&](std::size_t r) { return round_hits(w.hits, w.hit_begin, r); };
  summary.hits = static_cast<std::uint32_t>(w.hits.size());
  if (Status s = hooks.before_rounds(std::span<const std::int32_t>(w.hits)); !s) {
    hooks.fault();
    return s;
  }
  const auto chunk = [&](std::size_t r) {
    if (r >= w.plan.size()) return std::span<const std::int32_t>();
    return std::span<const std::int32_t>(w.misses).subspan(w.plan[r].begin, w.plan[r].end - w.plan[r].begin);
  };
  const auto stream_slot = [&](std::size_t r, std::size_t i) {
    const StreamRound& p = w.plan[r];
    const std::size_t k = p.span ? static_cast<std::size_t>(w.misses[p.begin + i] - p.first) : i;
    return capacity + static_cast<std::int32_t>((r % 2) * half + k);
  };
  const auto fill_round = [&](std::size_t r) noexcept -> Status {
    const auto c = chunk(r);
    w.fills.clear();
    for (std::size_t i = 0; i < c.size(); ++i) w.fills.push_back({ExpertId(c[i]), SlotId(stream_slot(r, i))});
    const MapUpload upload = hooks.resident_upload();
    const bool span = !c.empty() && w.plan[r].span;
    const std::size_t width = span ? static_cast<std::size_t>(c.back() - c.front() + 1) : c.size();
    Status s = core.wide_fill(stream, r % 2, upload, [&](typename R::Stream f) noexcept {
      // The round's map (its pool hits too), then its copies.
      for (const std::int32_t e : hits_of(r)) w.map[static_cast<std::size_t>(e)] = resident[static_cast<std::size_t>(e)];
      for (std::size_t i = 0; i < c.size(); ++i) w.map[static_cast<std::size_t>(c[i])] = stream_slot(r, i);
      Status m = core.upload_map(w.map.data(), hooks.round_map(r), f);
      for (const std::int32_t e : hits_of(r)) w.map[static_cast<std::size_t>(e)] = absent_slot;
      for (const std::int32_t e : c) w.map[static_cast<std::size_t>(e)] = absent_slot;
      if (!m) return m;
      const std::span<const SlotFill> fills(w.fills);
      if (span) {
        const SlotFill first{ExpertId(c.front()), SlotId(stream_slot(r, 0))};
        return issue_span(staging, rt, f, storage, first, width, fills, summary.copies, batch);
      }
      return issue_coalesced(staging, rt, f, storage, fills, summary.copies, batch);
    });
    if (s && upload.host != nullptr) hooks.uploaded();
    if (s) {
      summary.streamed += static_cast<std::uint32_t>(c.size());
      summary.bytes += c.size() * bytes_per_expert;
      if (span) {
        ++summary.span_rounds;
        summary.wasted += static_cast<std::uint32_t>(width - c.size());
        summary.bytes += (width - c.size()) * dense_bytes;
      }
    }
    return s;
  };
  Status s = fill_round(0);
  for (std::size_t r = 0; s && r < rounds; ++r) {
    const auto c = chunk(r);
    compose_wide_round(r, hits_of(r), c, resident, stream_slot, w.round, w.slots);
    // Only the fill of round r (its map included) is waited for: round r + 1's fill, enqueued
    // next on the fill stream, overlaps round r's consumer.
    s = core.wide_acquire(stream);
    if (s && r + 1 < rounds) s = fill_round(r + 1);
    if (!s) {
      hooks.fault();
      return s.with_context("prepare_wide: round %zu of %zu (streamed experts are never admitted; the pool is "
                            "unchanged)",
                            r, rounds);
    }
    WideRound round;
    round.view = hooks.view();
    round.view.expert_map = hooks.round_map(r);
    round.view.hits = static_cast<std::uint32_t>(hits_of(r).size());
    round.view.misses = static_cast<std::uint32_t>(c.size());
    round.experts = w.round;
    round.slots = w.slots;
    round.index = static_cast<std::uint32_t>(r);
    round.rounds = static_cast<std::uint32_t>(rounds);
    round.streamed = static_cast<std::uint32_t>(c.size());
    if (Status cs = hooks.consume(round); !cs) return cs;
    ++summary.rounds;
    hooks.served(hits_of(r).size(), c.size());
    s = core.wide_release(stream, r % 2);
    if (!s) {
      hooks.fault();
      return s.with_context("prepare_wide: releasing round %zu", r);
    }
  }
  return s;
}

// A wide consumer's call: an exception becomes an error Status (the APIs are noexcept).
template <class Consumer>
Status call_wide_consumer(Consumer& consumer, const WideRound& round) noexcept {
  try {
    Status s = consumer(round);
    if (!s) return s.with_context("wide forward: the consumer of round %u of %u failed", round.index, round.rounds);
    return s;
  } catch (const std::exception& e) {
    return Status::format(ErrorCode::runtime_failure, "wide forward: the consumer of round %u of %u threw: %s",
                          round.index, round.rounds, e.what());
  } catch (...) {
    return Status::format(ErrorCode::runtime_failure, "wide forward: the consumer of round %u of %u threw",
                          round.index, round.rounds);
  }
}

}  // namespace detail

}  // namespace expert_cache::inline v0
