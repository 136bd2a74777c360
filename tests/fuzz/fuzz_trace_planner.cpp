// libFuzzer target over the trace parser and the ForwardPlanner API (tests/fuzz/run.sh builds it).
//   clang++ -std=c++20 -fsanitize=fuzzer,address,undefined -Iinclude tests/fuzz/fuzz_trace_planner.cpp
// Part 1 parses the input as trace text and checks the parsed structure, a write/parse
// round trip and (for small traces) a replay. Part 2 reads the same bytes as a sequence of
// plan_topk / plan_unique / invalidate calls on a small planner (top-k drawn from the input),
// for every policy, and checks the planner's invariants after each call. Part 3 drives the same
// calls through ExpertCache on SimRuntime (prepare / prepare_unique / invalidate, and wide
// forwards of any width through prepare_wide in both admissions, some with a consumer that fails;
// the simulated GPU advances by a seeded schedule between calls): rejected calls leave stats, maps
// and the planner snapshot unchanged, a wide forward's rounds serve exactly its experts, stream
// admission and a failed forward leave the pool as it was, and the race detector reports nothing.
// The same calls on a two-layer ModelExpertCache. Failures abort (a crash for libFuzzer).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <set>
#include <sstream>
#include <string_view>
#include <tuple>
#include <vector>

#include "expert_cache/cache/model_cache.hpp"
#include "expert_cache/eviction/all.hpp"
#include "expert_cache/expert_cache.hpp"
#include "expert_cache/planning/forward_planner.hpp"
#include "expert_cache/runtime/sim_runtime.hpp"
#include "expert_cache/tools/replay.hpp"
#include "expert_cache/tools/trace_generator.hpp"
#include "expert_cache/tools/trace_io.hpp"

namespace ec = expert_cache;

#define FUZZ_CHECK(cond)                                                              \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                   \
    }                                                                                 \
  } while (0)

namespace {

// ---- part 1: parser ---------------------------------------------------------------------

void check_trace(const ec::Trace& t, std::optional<std::int32_t> num_experts) {
  std::uint64_t records = 0;
  std::uint64_t last_line = 0;
  std::uint64_t expected_begin = 0;
  std::set<std::pair<std::int32_t, std::int32_t>> keys;
  std::int32_t max_id = -1;
  for (const ec::TraceForward& f : t.forwards) {
    FUZZ_CHECK(f.step >= 0 && f.layer >= 0);
    FUZZ_CHECK(f.line > last_line);
    last_line = f.line;
    FUZZ_CHECK(f.records >= 1);
    records += f.records;
    FUZZ_CHECK(f.begin == expected_begin && f.end > f.begin && f.end <= t.ids.size());
    expected_begin = f.end;
    FUZZ_CHECK(keys.insert({f.step, f.layer}).second);  // one forward per (step, layer)
    const auto ids = t.experts(f);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      FUZZ_CHECK(ids[i] >= 0 && ids[i] < t.num_experts);
      if (i) FUZZ_CHECK(ids[i - 1] < ids[i]);  // unique, ascending
      max_id = std::max(max_id, ids[i]);
    }
  }
  FUZZ_CHECK(expected_begin == t.ids.size());
  FUZZ_CHECK(records == t.records);
  FUZZ_CHECK(t.num_experts == (num_experts ? *num_experts : max_id + 1));
}

void fuzz_parser(std::string_view text, std::optional<std::int32_t> num_experts) {
  const ec::ToolResult<ec::Trace> r = ec::parse_trace_text(text, ec::ParseOptions{num_experts});
  if (!r.ok()) {
    FUZZ_CHECK(r.status().code() == ec::ToolErrorCode::parse_error);
    FUZZ_CHECK(r.status().message().rfind("line ", 0) == 0);
    return;
  }
  const ec::Trace& t = r.value();
  check_trace(t, num_experts);

  // Round trip through the writer.
  std::ostringstream out;
  ec::write_trace(out, t);
  const ec::ToolResult<ec::Trace> back = ec::parse_trace_text(out.str(), ec::ParseOptions{num_experts});
  FUZZ_CHECK(back.ok());
  FUZZ_CHECK(back.value().ids == t.ids);
  FUZZ_CHECK(back.value().forwards.size() == t.forwards.size());

  // Replay small traces with every policy and OPT at the smallest feasible capacity.
  if (t.forwards.empty() || t.num_experts > 512) return;
  std::size_t widest = 0;
  for (const ec::TraceForward& f : t.forwards) widest = std::max(widest, f.size());
  ec::ReplayOptions options;
  options.policies = ec::replay_policy_names();
  options.capacities = {static_cast<std::int32_t>(widest)};
  for (const ec::ReplayScope scope : {ec::ReplayScope::layer, ec::ReplayScope::global}) {
    options.scope = scope;
    if (scope == ec::ReplayScope::global && t.layers().size() * static_cast<std::size_t>(t.num_experts) > 4096) break;
    const ec::Result<ec::ReplayReport> rep = ec::replay(t, options);
    FUZZ_CHECK(rep.ok());
    for (const ec::ReplayRow& row : rep.value().rows) {
      FUZZ_CHECK(row.counts.accesses() == t.ids.size());
      // Belady is optimal for demand fetching: nobody beats it without invalidations.
      if (row.hits_vs_opt) FUZZ_CHECK(*row.hits_vs_opt <= 1.0);
    }
    // A capacity below the widest forward names a line.
    if (widest > 1) {
      ec::ReplayOptions narrow = options;
      narrow.capacities = {static_cast<std::int32_t>(widest - 1)};
      const ec::Result<ec::ReplayReport> bad = ec::replay(t, narrow);
      FUZZ_CHECK(!bad.ok() && bad.status().code() == ec::ErrorCode::too_many_experts);
      FUZZ_CHECK(bad.status().message().rfind("line ", 0) == 0);
    }
  }
}

// ---- part 2: planner API ---------------------------------------------------------------

class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  [[nodiscard]] bool empty() const noexcept { return pos_ >= size_; }
  std::uint8_t next() noexcept { return pos_ < size_ ? data_[pos_++] : 0; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

enum class OpKind : std::uint8_t { topk, unique, invalidate, wide };

struct Op {
  OpKind kind;
  std::vector<std::int32_t> ids;  // the id list, or {expert} for invalidate
  bool accepted;                  // predicted outcome
  std::vector<std::int32_t> set;  // the forward's unique set in processing order (wide: ascending), if accepted
  bool admit = false;             // wide: WideAdmission::admit instead of stream
  bool consumer_fails = false;    // wide, stream admission: the consumer fails in round 0
};

// Most ids of one wide forward in the cache of part 3 (CacheOptions::max_wide_ids).
std::int64_t fuzz_max_wide_ids(std::int32_t capacity) { return 2 * static_cast<std::int64_t>(capacity) + 3; }

// Decode ops and predict which are accepted, independently of the planner.
std::vector<Op> decode_ops(Bytes& in, std::int32_t num_experts, std::int32_t capacity) {
  std::vector<Op> ops;
  while (!in.empty() && ops.size() < 256) {
    Op op;
    const std::uint8_t b = in.next();
    op.kind = static_cast<OpKind>(b % 4);
    // Ids range over [-2, num_experts + 1] so out-of-range and padding ids occur.
    auto draw_id = [&] { return static_cast<std::int32_t>(in.next() % static_cast<unsigned>(num_experts + 4)) - 2; };
    if (op.kind == OpKind::invalidate) {
      op.ids.push_back(draw_id());
      op.accepted = op.ids[0] >= 0 && op.ids[0] < num_experts;
    } else if (op.kind == OpKind::wide) {
      // Any width, sometimes beyond max_wide_ids; negative ids are padding, ids >= E refused.
      const std::size_t n = in.next() % static_cast<unsigned>(3 * capacity + 6);
      for (std::size_t i = 0; i < n; ++i) op.ids.push_back(draw_id());
      if ((b & 0x80) == 0) {
        for (std::int32_t& id : op.ids) id = std::min(id, num_experts - 1);
      }
      op.admit = (b & 0x40) != 0;
      op.consumer_fails = !op.admit && (b & 0x20) != 0;
      bool in_range = true;
      for (const std::int32_t id : op.ids) {
        if (id >= num_experts) in_range = false;
        if (id >= 0 && std::find(op.set.begin(), op.set.end(), id) == op.set.end()) op.set.push_back(id);
      }
      std::sort(op.set.begin(), op.set.end());
      op.accepted = in_range && static_cast<std::int64_t>(op.ids.size()) <= fuzz_max_wide_ids(capacity);
    } else {
      const std::size_t n = in.next() % static_cast<unsigned>(capacity + 4);
      for (std::size_t i = 0; i < n; ++i) op.ids.push_back(draw_id());
      // Mostly in-range ids: clamp negatives away for half the ops so forwards get accepted.
      if ((b & 0x80) == 0) {
        for (std::int32_t& id : op.ids) id = std::clamp(id, 0, num_experts - 1);
      }
      bool in_range = true;
      bool duplicate = false;
      std::vector<std::int32_t> seen;
      for (const std::int32_t id : op.ids) {
        if (op.kind == OpKind::topk && id < 0) continue;  // padding
        if (id < 0 || id >= num_experts) in_range = false;
        if (std::find(seen.begin(), seen.end(), id) != seen.end()) {
          duplicate = true;
          continue;
        }
        seen.push_back(id);
      }
      if (op.kind == OpKind::topk) {
        std::sort(seen.begin(), seen.end());
        op.accepted = in_range && static_cast<std::int32_t>(seen.size()) <= capacity;
      } else {
        op.accepted = in_range && !duplicate && static_cast<std::int32_t>(seen.size()) <= capacity;
      }
      op.set = std::move(seen);
    }
    ops.push_back(std::move(op));
  }
  return ops;
}

template <class Planner>
void check_maps(const Planner& p) {
  const ec::CacheShape shape = p.shape();
  const auto resident = p.resident_map();
  const auto owner = p.slot_owner();
  FUZZ_CHECK(resident.size() == static_cast<std::size_t>(shape.num_experts));
  FUZZ_CHECK(owner.size() == static_cast<std::size_t>(shape.capacity));
  std::int32_t count = 0;
  for (std::int32_t e = 0; e < shape.num_experts; ++e) {
    const std::int32_t s = resident[static_cast<std::size_t>(e)];
    if (s == ec::absent_slot) continue;
    FUZZ_CHECK(s >= 0 && s < shape.capacity);
    FUZZ_CHECK(owner[static_cast<std::size_t>(s)] == e);
    ++count;
  }
  for (std::int32_t s = 0; s < shape.capacity; ++s) {
    const std::int32_t e = owner[static_cast<std::size_t>(s)];
    if (e == -1) continue;
    FUZZ_CHECK(e >= 0 && e < shape.num_experts && resident[static_cast<std::size_t>(e)] == s);
  }
  FUZZ_CHECK(count == p.resident_count());
}

template <class Policy>
void run_ops(const std::vector<Op>& ops, ec::CacheShape shape, std::int32_t top_k, Policy policy) {
  ec::ForwardPlanner<Policy> p(shape, top_k, std::move(policy));
  FUZZ_CHECK(p.top_k() == top_k);
  ec::ForwardPlan plan;
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  for (const Op& op : ops) {
    if (op.kind == OpKind::wide) continue;  // a cache's call (part 3), not the planner's
    const auto before = p.snapshot();
    // The snapshot leaves out the forward map (it is per-forward, not cache state), but a
    // rejected call must not touch it either.
    const std::vector<std::int32_t> forward_before(p.forward_map().begin(), p.forward_map().end());
    bool ok;
    if (op.kind == OpKind::invalidate) {
      const bool was_resident = p.is_resident(op.ids[0]);
      const std::int32_t old_slot = was_resident ? p.resident_map()[static_cast<std::size_t>(op.ids[0])] : -1;
      const ec::Result<ec::SlotId> r = p.invalidate(op.ids[0]);
      ok = r.ok();
      if (ok) {
        FUZZ_CHECK(r.value().valid() == was_resident);
        if (was_resident) FUZZ_CHECK(r.value().value == old_slot);
        FUZZ_CHECK(!p.is_resident(op.ids[0]));
        FUZZ_CHECK(p.forward_map()[static_cast<std::size_t>(op.ids[0])] == ec::absent_slot);
        if (!was_resident) FUZZ_CHECK(p.snapshot() == before);
      } else {
        FUZZ_CHECK(r.status().code() == ec::ErrorCode::expert_out_of_range);
      }
    } else {
      const ec::Status st = op.kind == OpKind::topk ? p.plan_topk(op.ids, plan) : p.plan_unique(op.ids, plan);
      ok = st.ok();
      if (ok) {
        // The plan covers exactly the forward's set; hits were resident before.
        FUZZ_CHECK(plan.unique.size() == op.set.size());
        std::uint32_t expected_hits = 0;
        for (std::size_t i = 0; i < op.set.size(); ++i) {
          FUZZ_CHECK(plan.unique[i].value == op.set[i]);
          if (before.resident_map[static_cast<std::size_t>(op.set[i])] != ec::absent_slot) ++expected_hits;
        }
        FUZZ_CHECK(plan.hits == expected_hits);
        FUZZ_CHECK(plan.hits + plan.misses == op.set.size());
        FUZZ_CHECK(plan.fills.size() == plan.misses);
        FUZZ_CHECK(plan.evictions.size() <= plan.fills.size());
        hits += plan.hits;
        misses += plan.misses;
        for (const ec::SlotEviction& ev : plan.evictions) {
          FUZZ_CHECK(std::find(op.set.begin(), op.set.end(), ev.expert.value) == op.set.end());
          FUZZ_CHECK(!p.is_resident(ev.expert.value));
          FUZZ_CHECK(before.resident_map[ev.expert.index()] == ev.slot.value);
        }
        for (const ec::SlotFill& f : plan.fills) FUZZ_CHECK(p.resident_map()[f.expert.index()] == f.slot.value);
        // forward_map is exactly the forward's set, each at its resident slot.
        const auto fwd = p.forward_map();
        std::size_t in_forward = 0;
        for (std::int32_t e = 0; e < shape.num_experts; ++e) {
          const std::int32_t s = fwd[static_cast<std::size_t>(e)];
          if (s == ec::absent_slot) continue;
          ++in_forward;
          FUZZ_CHECK(std::find(op.set.begin(), op.set.end(), e) != op.set.end());
          FUZZ_CHECK(s == p.resident_map()[static_cast<std::size_t>(e)]);
        }
        FUZZ_CHECK(in_forward == op.set.size());
      } else {
        const ec::ErrorCode c = st.code();
        FUZZ_CHECK(c == ec::ErrorCode::expert_out_of_range || c == ec::ErrorCode::too_many_experts ||
                   c == ec::ErrorCode::duplicate_expert);
      }
    }
    FUZZ_CHECK(ok == op.accepted);
    if (!ok) {  // rejected calls change nothing
      FUZZ_CHECK(p.snapshot() == before);
      FUZZ_CHECK(std::equal(forward_before.begin(), forward_before.end(), p.forward_map().begin(),
                            p.forward_map().end()));
    }
    check_maps(p);
  }
  FUZZ_CHECK(p.counters().hits == hits && p.counters().misses == misses);
  if constexpr (requires { p.policy().divergent_forwards(); }) FUZZ_CHECK(p.policy().divergent_forwards() == 0);
}

// ---- part 3: ExpertCache on SimRuntime ----------------------------------------------------

auto stats_fields(const ec::CacheStats& s) {
  return std::tuple(s.hits, s.misses, s.promotions, s.evictions, s.invalidations, s.resident, s.capacity,
                    s.prepare_calls, s.generation, s.last_copies, s.total_copies, s.owner_changes, s.map_uploads,
                    s.staging_stalls, s.faults, s.slot_bytes, s.host_bytes);
}

// The simulated GPU makes a seeded amount of progress, so calls land on in-flight work.
void advance(ec::SimRuntime& rt, std::uint64_t seed, std::uint64_t step) {
  rt.run_random(seed + step, static_cast<std::size_t>((seed >> (step % 32)) & 7u));
}

// Runs what is left: everything completes, and the race detector saw no race.
void check_drained(ec::SimRuntime& rt) {
  rt.drain();
  FUZZ_CHECK(rt.idle());
  if (rt.race_count() != 0) {
    std::fprintf(stderr, "race: %s\n", rt.races().empty() ? "(dropped)" : rt.races()[0].description.c_str());
  }
  FUZZ_CHECK(rt.race_count() == 0);
}

// One wide forward of `op` through `prepare_wide(consumer, options)`; `pool_unchanged()` says
// whether the cache's pool is as it was before the call. Checks the outcome against the
// prediction: a refused forward calls no consumer; with stream admission (stream slots given; a
// stream forward without them falls back to admit, which is not scan resistant) a consumer that
// fails in round 0 ends the forward, and a streamed or failed forward leaves the pool as it was; an
// accepted forward's rounds serve exactly its unique experts. Returns whether the forward got past
// validation (a failing consumer fails it after that).
template <class PrepareWide, class PoolUnchanged>
bool check_wide(const Op& op, std::int32_t stream_slots, PrepareWide&& prepare_wide, PoolUnchanged&& pool_unchanged) {
  const bool streams = !op.admit && stream_slots >= 2;
  const bool fails = op.consumer_fails && streams;
  std::vector<std::int32_t> served;
  std::uint32_t calls = 0;
  auto consumer = [&](const ec::WideRound& round) noexcept {
    ++calls;
    FUZZ_CHECK(round.experts.size() == round.slots.size());
    served.insert(served.end(), round.experts.begin(), round.experts.end());
    if (fails) return ec::Status(ec::ErrorCode::runtime_failure, "fuzz consumer failed");
    return ec::Status();
  };
  ec::WideOptions options;
  options.admission = op.admit ? ec::WideAdmission::admit : ec::WideAdmission::stream;
  const ec::Result<ec::WideSummary> r = prepare_wide(consumer, options);
  const bool accepted = r.ok() || (fails && r.status().code() == ec::ErrorCode::runtime_failure);
  if (!op.accepted) {
    FUZZ_CHECK(!accepted && calls == 0);
    const ec::ErrorCode c = r.status().code();
    FUZZ_CHECK(c == ec::ErrorCode::expert_out_of_range || c == ec::ErrorCode::too_many_experts);
  } else if (fails) {
    FUZZ_CHECK(!r.ok() && calls == 1);
    FUZZ_CHECK(pool_unchanged());
  } else {
    FUZZ_CHECK(r.ok() && r.value().unique == op.set.size() && r.value().rounds == calls);
    // The rounds are disjoint and cover exactly the forward's experts.
    std::sort(served.begin(), served.end());
    FUZZ_CHECK(served == op.set);
    if (streams) {  // stream admission: the pool is only read
      FUZZ_CHECK(pool_unchanged());
      FUZZ_CHECK(r.value().hits + r.value().streamed == r.value().unique);
    }
  }
  return accepted;
}

template <class Cache>
void run_cache(const std::vector<Op>& ops, ec::CacheShape shape, std::int32_t top_k, std::int32_t stream_slots,
               std::uint64_t seed) {
  ec::SimRuntime rt;
  rt.set_seed(seed);
  const ec::SimRuntime::Stream stream = rt.create_stream().value();
  // Tiny tensors: the cache's copies, maps and ordering are what is under test, not bandwidth.
  const ec::ExplicitLayout layout{{{{"w13", 64}, {"w2", 32}, {"w13_scale", 16}, {"w2_scale", 8},
                                    {"w13_scale_2", 4}, {"w2_scale_2", 4}}}};
  ec::CacheOptions options;
  options.num_experts = shape.num_experts;
  options.capacity = shape.capacity;
  options.top_k = top_k;
  options.stream_slots = stream_slots;
  options.max_wide_ids = fuzz_max_wide_ids(shape.capacity);
  Cache cache(rt, options, layout);
  FUZZ_CHECK(cache.planner().top_k() == top_k);
  std::uint64_t step = 0;
  for (const Op& op : ops) {
    const auto stats_before = stats_fields(cache.stats());
    const auto snapshot_before = cache.planner().snapshot();
    const std::vector<std::int32_t> resident_before(cache.resident_map_host().begin(), cache.resident_map_host().end());
    const std::vector<std::int32_t> forward_before(cache.forward_map_host().begin(), cache.forward_map_host().end());
    bool ok;
    if (op.kind == OpKind::wide) {
      ok = check_wide(
          op, stream_slots,
          [&](auto& consumer, const ec::WideOptions& o) { return cache.prepare_wide(op.ids, stream, consumer, o); },
          [&] {
            return cache.planner().snapshot() == snapshot_before &&
                   std::equal(resident_before.begin(), resident_before.end(), cache.resident_map_host().begin(),
                              cache.resident_map_host().end());
          });
    } else if (op.kind == OpKind::invalidate) {
      const ec::Status st = cache.invalidate(op.ids[0], stream);
      ok = st.ok();
      if (ok) {
        FUZZ_CHECK(cache.resident_map_host()[static_cast<std::size_t>(op.ids[0])] == ec::absent_slot);
      } else {
        FUZZ_CHECK(st.code() == ec::ErrorCode::expert_out_of_range);
      }
    } else {
      const ec::Result<ec::ForwardView> view =
          op.kind == OpKind::topk ? cache.prepare(op.ids, stream) : cache.prepare_unique(op.ids, stream);
      ok = view.ok();
      if (ok) {
        // Every expert of the forward is in the forward map, at its resident slot.
        const ec::ForwardView& v = view.value();
        FUZZ_CHECK(v.hits + v.misses == op.set.size());
        for (const std::int32_t e : op.set) {
          const std::int32_t slot = cache.forward_map_host()[static_cast<std::size_t>(e)];
          FUZZ_CHECK(slot >= 0 && slot < shape.capacity);
          FUZZ_CHECK(slot == cache.resident_map_host()[static_cast<std::size_t>(e)]);
        }
      } else {
        const ec::ErrorCode c = view.status().code();
        FUZZ_CHECK(c == ec::ErrorCode::expert_out_of_range || c == ec::ErrorCode::too_many_experts ||
                   c == ec::ErrorCode::duplicate_expert);
      }
    }
    FUZZ_CHECK(ok == op.accepted);
    if (!ok) {  // a rejected call changes nothing the caller can see
      FUZZ_CHECK(stats_fields(cache.stats()) == stats_before);
      FUZZ_CHECK(cache.planner().snapshot() == snapshot_before);
      FUZZ_CHECK(std::equal(resident_before.begin(), resident_before.end(), cache.resident_map_host().begin(),
                            cache.resident_map_host().end()));
      FUZZ_CHECK(std::equal(forward_before.begin(), forward_before.end(), cache.forward_map_host().begin(),
                            cache.forward_map_host().end()));
    }
    check_maps(cache.planner());
    advance(rt, seed, ++step);
  }
  check_drained(rt);
  FUZZ_CHECK(cache.stats().faults == 0);
}

// The same calls on a two-layer ModelExpertCache (per-layer pools or one global pool), op i on
// layer i % 2: the same predictions hold per layer, a wide forward serves exactly its experts, and
// stream admission, refused and failed calls leave the layer's planner as it was.
template <class Cache>
void run_model_cache(const std::vector<Op>& ops, ec::CacheShape shape, std::int32_t top_k, std::int32_t stream_slots,
                     ec::ModelPool pool, std::uint64_t seed) {
  ec::SimRuntime rt;
  rt.set_seed(seed);
  const ec::SimRuntime::Stream stream = rt.create_stream().value();
  const ec::ExplicitLayout layout{{{{"w13", 48}, {"w2", 16}, {"w13_scale", 8}, {"w2_scale", 4}, {"w13_scale_2", 4},
                                    {"w2_scale_2", 4}}}};
  ec::ModelCacheOptions options;
  options.num_layers = 2;
  options.num_experts = shape.num_experts;
  options.capacity = shape.capacity;
  options.top_k = top_k;
  options.pool = pool;
  options.stream_slots = stream_slots;
  options.max_wide_ids = fuzz_max_wide_ids(shape.capacity);
  Cache cache(rt, options, layout);
  std::uint64_t step = 0;
  for (const Op& op : ops) {
    const auto layer = static_cast<std::int32_t>(step % 2);
    const auto total_before = stats_fields(cache.stats().total);
    const auto snapshot_before = cache.planner(layer).snapshot();
    const auto resident = [&] { return cache.resident_map_host(layer); };
    const std::vector<std::int32_t> resident_before(resident().begin(), resident().end());
    bool ok;
    if (op.kind == OpKind::wide) {
      ok = check_wide(
          op, stream_slots,
          [&](auto& consumer, const ec::WideOptions& o) { return cache.prepare_wide(layer, op.ids, stream, consumer, o); },
          [&] {
            return cache.planner(layer).snapshot() == snapshot_before &&
                   std::equal(resident_before.begin(), resident_before.end(), resident().begin(), resident().end());
          });
    } else if (op.kind == OpKind::invalidate) {
      ok = cache.invalidate(layer, op.ids[0], stream).ok();
      if (ok) FUZZ_CHECK(resident()[static_cast<std::size_t>(op.ids[0])] == ec::absent_slot);
    } else {
      const ec::Result<ec::ForwardView> view = op.kind == OpKind::topk ? cache.prepare(layer, op.ids, stream)
                                                                        : cache.prepare_unique(layer, op.ids, stream);
      ok = view.ok();
      if (ok) {
        for (const std::int32_t e : op.set) FUZZ_CHECK(resident()[static_cast<std::size_t>(e)] != ec::absent_slot);
      }
    }
    FUZZ_CHECK(ok == op.accepted);
    if (!ok) {  // a rejected call changes nothing the caller can see
      FUZZ_CHECK(stats_fields(cache.stats().total) == total_before);
      FUZZ_CHECK(cache.planner(layer).snapshot() == snapshot_before);
      FUZZ_CHECK(std::equal(resident_before.begin(), resident_before.end(), resident().begin(), resident().end()));
    }
    check_maps(cache.planner(layer));
    advance(rt, seed, ++step);
  }
  check_drained(rt);
  FUZZ_CHECK(cache.stats().total.faults == 0);
}

void fuzz_planner(const std::uint8_t* data, std::size_t size) {
  Bytes in(data, size);
  const std::int32_t num_experts = 1 + in.next() % 16;
  const std::int32_t capacity = 1 + in.next() % static_cast<unsigned>(num_experts);
  const std::int32_t top_k = 1 + in.next() % static_cast<unsigned>(capacity);  // any valid top-k
  const std::uint8_t staging = in.next();
  // 0 (wide forwards fall back to admit), 2 or 4 stream slots; at most num_experts (CacheOptions' bound).
  std::int32_t stream_slots = 2 * (in.next() % 3);
  while (stream_slots > num_experts) stream_slots -= 2;
  const std::uint64_t seed = static_cast<std::uint64_t>(in.next()) | static_cast<std::uint64_t>(in.next()) << 8;
  const ec::CacheShape shape{num_experts, capacity};
  const std::vector<Op> ops = decode_ops(in, num_experts, capacity);

  run_ops(ops, shape, top_k, ec::Lru(shape));
  run_ops(ops, shape, top_k, ec::Lfru(shape));
  run_ops(ops, shape, top_k, ec::Sieve(shape));
  run_ops(ops, shape, top_k, ec::S3Fifo(shape));
  run_ops(ops, shape, top_k, ec::Arc(shape));
  // Belady's future is the sequence of accepted forwards.
  std::vector<std::vector<std::int32_t>> future;
  for (const Op& op : ops) {
    if ((op.kind == OpKind::topk || op.kind == OpKind::unique) && op.accepted) future.push_back(op.set);
  }
  run_ops(ops, shape, top_k, ec::Belady(std::make_shared<const ec::BeladyFuture>(num_experts, future), shape));

  // Both storages (whole-expert with LFRU, tensor-major with LRU); the staging policy from the input.
  using ec::ExpertCache;
  using ec::ExpertMajorStorage;
  using ec::ExplicitLayout;
  using ec::SimRuntime;
  using ec::TensorMajorStorage;
  switch (staging % 3) {
    case 0:
      run_cache<ExpertCache<ExpertMajorStorage, ec::Lfru, ec::Inline, ExplicitLayout, SimRuntime>>(ops, shape, top_k, stream_slots, seed);
      run_cache<ExpertCache<TensorMajorStorage, ec::Lru, ec::Inline, ExplicitLayout, SimRuntime>>(ops, shape, top_k, stream_slots, seed);
      break;
    case 1:
      run_cache<ExpertCache<ExpertMajorStorage, ec::Lfru, ec::CopyStream, ExplicitLayout, SimRuntime>>(ops, shape, top_k, stream_slots, seed);
      run_cache<ExpertCache<TensorMajorStorage, ec::Lru, ec::CopyStream, ExplicitLayout, SimRuntime>>(ops, shape, top_k, stream_slots, seed);
      break;
    default:
      run_cache<ExpertCache<ExpertMajorStorage, ec::Lfru, ec::Batched, ExplicitLayout, SimRuntime>>(ops, shape, top_k, stream_slots, seed);
      run_cache<ExpertCache<TensorMajorStorage, ec::Lru, ec::Batched, ExplicitLayout, SimRuntime>>(ops, shape, top_k, stream_slots, seed);
      break;
  }
  // A model cache over two layers, the pool kind from the input.
  using ModelCache = ec::ModelExpertCache<ExpertMajorStorage, ec::Lru, ec::CopyStream, ExplicitLayout, SimRuntime>;
  run_model_cache<ModelCache>(ops, shape, top_k, stream_slots,
                              (staging & 0x10) != 0 ? ec::ModelPool::global : ec::ModelPool::per_layer, seed);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  // First byte: parser options (num_experts given or not, and how many).
  const std::uint8_t mode = data[0];
  std::optional<std::int32_t> num_experts;
  if (mode & 1) num_experts = 1 + (mode >> 1);
  fuzz_parser(std::string_view(reinterpret_cast<const char*>(data + 1), size - 1), num_experts);
  fuzz_planner(data + 1, size - 1);
  return 0;
}
