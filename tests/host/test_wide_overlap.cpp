// Wide forwards overlap fills and compute (docs/design.md "Wide forwards"): the consumer stream
// carries no copy (a host->device copy there would queue in the copy engine behind the next
// round's fill and serialise every consumer behind it), and in SimRuntime's virtual time a
// wide forward takes about max(fills, consumers), not their sum.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "support/sim_cache_harness.hpp"

using namespace expert_cache;
using namespace expert_cache::test;
using Ids = std::vector<std::int32_t>;
using Stream = SimRuntime::Stream;

namespace {

using Cache = ExpertCache<TensorMajorStorage, Lru, CopyStream, ExplicitLayout, SimRuntime>;
using Model = ModelExpertCache<TensorMajorStorage, Lru, CopyStream, ExplicitLayout, SimRuntime>;

Ids all_experts(std::int32_t n) {
  Ids ids(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = i;
  return ids;
}

// Copies enqueued on `s` in the trace (single or batched).
std::size_t copies_on(const SimRuntime& rt, Stream s) {
  return static_cast<std::size_t>(std::count_if(rt.trace_log().begin(), rt.trace_log().end(), [&](const SimTraceEntry& e) {
    return e.stream == s.id && (e.call == SimCall::copy || e.call == SimCall::copy_batch);
  }));
}

struct Fixture {
  SimRuntime rt{SimRuntime::Options{.memory_limit = std::size_t{1} << 26, .seed = 3, .max_races = 8, .max_streams = 8}};
  Stream consumer = rt.create_stream().value();
  Cache cache;

  Fixture(std::int32_t experts, std::int32_t capacity, std::int32_t stream_slots)
      : cache(rt, options(experts, capacity, stream_slots), six_tensor_layout()) {
    fill_host_pools(cache);
  }
  static CacheOptions options(std::int32_t experts, std::int32_t capacity, std::int32_t stream_slots) {
    CacheOptions o = quiet_options(experts, capacity, 2);
    o.stream_slots = stream_slots;
    return o;
  }
  // One wide forward whose consumer is a kernel of `consumer_ns` per round (none when 0);
  // returns the forward's virtual time, from an idle device to the last consumer's end.
  double timed_wide(const Ids& ids, double consumer_ns, WideAdmission admission, std::uint32_t& rounds) {
    REQUIRE(rt.synchronize(consumer).ok());
    rt.drain();
    const double t0 = rt.host_time_ns();
    auto r = cache.prepare_wide(
        ids, consumer,
        [&](const WideRound& round) noexcept -> Status {
          if (consumer_ns <= 0) return {};
          const Access map{round.view.expert_map, 64 * sizeof(std::int32_t), AccessMode::read};
          rt.set_next_duration_ns(consumer_ns);
          return rt.launch(consumer, std::span<const Access>(&map, 1));
        },
        WideOptions{admission, WideCopy::runs});
    REQUIRE(r.ok());
    rounds = r.value().rounds;
    REQUIRE(rt.synchronize(consumer).ok());
    rt.drain();
    CHECK(rt.races().empty());
    return rt.host_time_ns() - t0;
  }
};

}  // namespace

TEST_CASE("wide forward: no copy on the consumer stream; every round's map goes on the fill stream") {
  for (const WideAdmission admission : {WideAdmission::stream, WideAdmission::admit}) {
    CAPTURE(to_string(admission));
    Fixture f(64, 8, 8);
    const Stream fill = f.cache.copy_stream().value();
    f.rt.set_tracing(true);
    auto r = f.cache.prepare_wide(all_experts(64), f.consumer, [](const WideRound&) noexcept { return Status(); },
                                  WideOptions{admission, WideCopy::runs});
    REQUIRE(r.ok());
    CHECK(r.value().rounds == 16u);  // stream: 64 / 4 (half the stream slots); admit: 64 / 4 (capacity / 2)
    CHECK(copies_on(f.rt, f.consumer) == 0);
    // Per round at least its map upload and one copy of its experts.
    CHECK(copies_on(f.rt, fill) >= 2 * r.value().rounds);
    f.rt.drain();
    CHECK(f.rt.races().empty());
  }
}

TEST_CASE("model cache wide forward: no copy on the consumer stream") {
  SimRuntime rt{SimRuntime::Options{.memory_limit = std::size_t{1} << 26, .seed = 5, .max_races = 8, .max_streams = 8}};
  const Stream consumer = rt.create_stream().value();
  ModelCacheOptions o;
  o.num_layers = 2;
  o.num_experts = 32;
  o.capacity = 4;
  o.top_k = 2;
  o.stream_slots = 8;
  Model cache(rt, o, six_tensor_layout());
  rt.set_tracing(true);
  for (std::int32_t layer = 0; layer < 2; ++layer) {
    auto r = cache.prepare_wide(layer, all_experts(32), consumer, [](const WideRound&) noexcept { return Status(); });
    REQUIRE(r.ok());
    CHECK(r.value().rounds == 8u);
  }
  CHECK(copies_on(rt, consumer) == 0);
  rt.drain();
  CHECK(rt.races().empty());
}

TEST_CASE("wide forward, virtual time: fills and consumers overlap (about the larger sum, not both)") {
  // 64 experts of 188 bytes, 1 byte/ns: a round of 4 streamed experts fills in about 1 us.
  SimCostModel cost;
  cost.copy_latency_ns = 20;
  cost.copy_bytes_per_ns = 1.0;
  for (const WideAdmission admission : {WideAdmission::stream, WideAdmission::admit}) {
    CAPTURE(to_string(admission));
    Fixture f(64, 8, 8);
    f.rt.set_cost_model(cost);
    std::uint32_t rounds = 0, rounds_fill = 0;
    const double fill = f.timed_wide(all_experts(64), 0, admission, rounds_fill);
    REQUIRE(rounds_fill == 16);
    const double per_round = fill / rounds_fill;
    for (const double ratio : {0.5, 0.9, 1.5}) {
      CAPTURE(ratio);
      const double d = ratio * per_round;
      const double t = f.timed_wide(all_experts(64), d, admission, rounds);
      REQUIRE(rounds == rounds_fill);
      const double compute = d * rounds;
      MESSAGE(to_string(admission), " consumer/fill ", ratio, ": fill ", fill, " ns, compute ", compute, " ns, wide ",
              t, " ns");
      // Pipelined: the longer side plus one round of the other (the first fill or last consumer).
      CHECK(t <= std::max(fill, compute) + std::min(per_round, d) * 1.5 + 1.0);
      CHECK(t < 0.8 * (fill + compute));
    }
  }
}
