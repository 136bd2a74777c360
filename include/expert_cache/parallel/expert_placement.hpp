#pragma once
/// The id-mapping chain of a model served on several GPUs (docs/parallel.md).
// From the router's id to a rank's cache:
//
//   global expert id (what the router emits, [0, num_global))
//     -> physical id     optional replica map (logical -> physical, as expert load balancers use)
//     -> owning rank     expert parallel: contiguous ranges or an explicit owner table;
//                        tensor-slice: every rank owns every expert (each caches its slice)
//     -> local id        the expert's index among its owner's experts ([0, num_local(rank)))
//     -> slot            the rank's own cache (its planner's maps; not this header's business)
//
// Built once and validated completely at construction (ExpertPlacement::make): every failure is a
// Status naming the problem (overlapping or missing ranges, a rank out of range, a world size
// that does not match, a replica entry out of range...). Nothing is ever dropped silently: an id
// owned by another rank becomes -1 in a rank's local ids (padding, which the planner and the
// consumer already ignore), and an id outside [0, num_global) is an error reported before any
// output is written. Host-only (plain data); compiles with g++ alone.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "expert_cache/base/status.hpp"

namespace expert_cache::inline v0 {

/// [begin, end) of physical ids, one per rank (expert parallel with contiguous ranges).
struct ExpertRange {
  std::int32_t begin = 0;
  std::int32_t end = 0;
  friend constexpr bool operator==(const ExpertRange&, const ExpertRange&) = default;
};

/// How a model's experts are spread over the ranks.
enum class Sharding : std::uint8_t {
  expert_parallel,  // each physical expert has one owning rank; only the owner caches it
  tensor_slice,     // every rank caches every expert, only its 1/world slice of the tensors
};

/// What a replica map may be.
enum class ReplicaMapKind : std::uint8_t {
  bijection,    // a permutation of [0, num_global): num_physical == num_global
  many_to_one,  // several logical ids may share one physical expert; every entry in range
};

/// Everything ExpertPlacement::make validates: the id spaces, the ranks and who owns what.
struct PlacementConfig {
  std::int32_t num_global = 0;    // logical experts of the layer (router ids)
  std::int32_t num_physical = 0;  // physical experts stored; 0: num_global (no replica map)
  std::int32_t world_size = 0;    // ranks
  Sharding sharding = Sharding::expert_parallel;
  // Optional replica map [num_global] -> physical id; empty: identity.
  std::vector<std::int32_t> logical_to_physical;
  ReplicaMapKind replica_kind = ReplicaMapKind::bijection;
  // Expert parallel: exactly one of these two. ranges: one per rank in rank order, together
  // covering [0, num_physical) without overlap (empty ranges allowed). owner: [num_physical]
  // rank per physical id; a rank's local ids follow ascending physical ids.
  std::vector<ExpertRange> ranges;
  std::vector<std::int32_t> owner;
};

/// `world` contiguous ranges over [0, num): the first num % world ranks get one expert more (the
/// split engines use for EP).
[[nodiscard]] inline std::vector<ExpertRange> contiguous_ranges(std::int32_t num, std::int32_t world) {
  std::vector<ExpertRange> r;
  if (num < 0 || world <= 0) return r;
  r.reserve(static_cast<std::size_t>(world));
  std::int32_t b = 0;
  for (std::int32_t i = 0; i < world; ++i) {
    const std::int32_t n = num / world + (i < num % world ? 1 : 0);
    r.push_back({b, b + n});
    b += n;
  }
  return r;
}

/// One layer's validated id-mapping chain (global -> physical -> owner rank -> local id).
class ExpertPlacement {
 public:
  /// Validates `c` completely; the placement exists only if every check passed.
  /// @param c  the configuration
  /// @return the placement, or a Status naming the first problem (overlapping or missing ranges,
  ///         a rank out of range, a replica entry out of range...)
  [[nodiscard]] static Result<ExpertPlacement> make(PlacementConfig c) {
    if (c.num_global <= 0 || c.num_global > (1 << 24))
      return Status::format(ErrorCode::invalid_argument, "placement: num_global %d outside [1, 2^24]", c.num_global);
    if (c.world_size <= 0 || c.world_size > 4096)
      return Status::format(ErrorCode::invalid_argument, "placement: world_size %d outside [1, 4096]", c.world_size);
    if (c.num_physical == 0) c.num_physical = c.num_global;
    if (c.num_physical < 0 || c.num_physical > (1 << 24))
      return Status::format(ErrorCode::invalid_argument, "placement: num_physical %d outside [1, 2^24]", c.num_physical);
    if (Status s = check_replicas(c); !s) return s;

    ExpertPlacement p;
    p.c_ = std::move(c);
    const PlacementConfig& k = p.c_;
    const auto P = static_cast<std::size_t>(k.num_physical);
    const auto W = static_cast<std::size_t>(k.world_size);
    p.owner_.assign(P, 0);
    p.local_.assign(P, 0);
    p.local_count_.assign(W, 0);
    p.first_storage_.assign(W + 1, 0);
    if (k.sharding == Sharding::tensor_slice) {
      if (!k.ranges.empty() || !k.owner.empty())
        return Status(ErrorCode::invalid_argument,
                      "placement: tensor_slice takes no ranges or owner table (every rank owns every expert)");
      for (std::size_t e = 0; e < P; ++e) p.local_[e] = static_cast<std::int32_t>(e);
      std::fill(p.local_count_.begin(), p.local_count_.end(), k.num_physical);
    } else if (!k.ranges.empty()) {
      if (!k.owner.empty())
        return Status(ErrorCode::invalid_argument, "placement: give ranges or an owner table, not both");
      if (k.ranges.size() != W)
        return Status::format(ErrorCode::invalid_argument,
                              "placement: %zu ranges for world_size %d (one per rank: world size mismatch)",
                              k.ranges.size(), k.world_size);
      std::int32_t expected = 0;  // ranges in rank order, each starting where the previous ended
      for (std::size_t r = 0; r < W; ++r) {
        const ExpertRange g = k.ranges[r];
        if (g.begin < 0 || g.end < g.begin || g.end > k.num_physical)
          return Status::format(ErrorCode::invalid_argument, "placement: rank %zu range [%d, %d) is not inside [0, %d)",
                                r, g.begin, g.end, k.num_physical);
        if (g.begin < expected)
          return Status::format(ErrorCode::invalid_argument,
                                "placement: rank %zu range [%d, %d) overlaps the previous ranks (they end at %d)", r,
                                g.begin, g.end, expected);
        if (g.begin > expected)
          return Status::format(ErrorCode::invalid_argument,
                                "placement: experts [%d, %d) are owned by no rank (rank %zu starts at %d)", expected,
                                g.begin, r, g.begin);
        for (std::int32_t e = g.begin; e < g.end; ++e) {
          p.owner_[static_cast<std::size_t>(e)] = static_cast<std::int32_t>(r);
          p.local_[static_cast<std::size_t>(e)] = e - g.begin;
        }
        p.local_count_[r] = g.end - g.begin;
        expected = g.end;
      }
      if (expected != k.num_physical)
        return Status::format(ErrorCode::invalid_argument, "placement: experts [%d, %d) are owned by no rank", expected,
                              k.num_physical);
    } else if (!k.owner.empty()) {
      if (k.owner.size() != P)
        return Status::format(ErrorCode::invalid_argument, "placement: owner table has %zu entries, num_physical is %d",
                              k.owner.size(), k.num_physical);
      for (std::size_t e = 0; e < P; ++e) {
        const std::int32_t r = k.owner[e];
        if (r < 0 || r >= k.world_size)
          return Status::format(ErrorCode::invalid_argument,
                                "placement: owner[%zu] = %d is not a rank of world_size %d", e, r, k.world_size);
        p.owner_[e] = r;
        p.local_[e] = p.local_count_[static_cast<std::size_t>(r)]++;
      }
    } else {
      return Status(ErrorCode::invalid_argument, "placement: expert_parallel needs ranges or an owner table");
    }
    for (std::size_t r = 0; r < W; ++r) {
      if (p.local_count_[r] == 0 && k.sharding == Sharding::expert_parallel)
        return Status::format(ErrorCode::invalid_argument,
                              "placement: rank %zu owns no expert (a cache needs at least one; fewer ranks?)", r);
      p.first_storage_[r + 1] = p.first_storage_[r] + (k.sharding == Sharding::expert_parallel ? p.local_count_[r] : 0);
    }
    // Per rank: global id -> local id or -1 (the table a device kernel reads).
    p.table_.assign(W * static_cast<std::size_t>(k.num_global), -1);
    for (std::size_t r = 0; r < W; ++r)
      for (std::int32_t g = 0; g < k.num_global; ++g) {
        const std::int32_t ph = p.physical_of(g);
        if (k.sharding == Sharding::tensor_slice || p.owner_[static_cast<std::size_t>(ph)] == static_cast<std::int32_t>(r))
          p.table_[r * static_cast<std::size_t>(k.num_global) + static_cast<std::size_t>(g)] =
              p.local_[static_cast<std::size_t>(ph)];
      }
    return p;
  }

  [[nodiscard]] std::int32_t num_global() const noexcept { return c_.num_global; }
  [[nodiscard]] std::int32_t num_physical() const noexcept { return c_.num_physical; }
  [[nodiscard]] std::int32_t world_size() const noexcept { return c_.world_size; }
  [[nodiscard]] Sharding sharding() const noexcept { return c_.sharding; }
  [[nodiscard]] const PlacementConfig& config() const noexcept { return c_; }

  /// The chain, one step at a time (arguments must be in range: callers validated ids already).
  [[nodiscard]] std::int32_t physical_of(std::int32_t global) const noexcept {
    return c_.logical_to_physical.empty() ? global : c_.logical_to_physical[static_cast<std::size_t>(global)];
  }
  /// Expert parallel: the one owner. Tensor-slice: every rank owns it; 0 is returned.
  [[nodiscard]] std::int32_t owner_of(std::int32_t physical) const noexcept { return owner_[static_cast<std::size_t>(physical)]; }
  [[nodiscard]] std::int32_t local_of(std::int32_t physical) const noexcept { return local_[static_cast<std::size_t>(physical)]; }
  [[nodiscard]] bool owns(std::int32_t rank, std::int32_t physical) const noexcept {
    return c_.sharding == Sharding::tensor_slice || owner_[static_cast<std::size_t>(physical)] == rank;
  }
  /// Experts rank `rank` caches: its cache's num_experts.
  [[nodiscard]] std::int32_t num_local(std::int32_t rank) const noexcept { return local_count_[static_cast<std::size_t>(rank)]; }
  /// Where the rank's experts start in the shared host pool's storage order (expert parallel:
  /// rank-major, local order; every rank's experts are one contiguous run, so its cache adopts one
  /// sub-span per tensor. With contiguous ranges this is the physical id. Tensor-slice: 0).
  [[nodiscard]] std::int32_t first_storage_index(std::int32_t rank) const noexcept {
    return first_storage_[static_cast<std::size_t>(rank)];
  }
  /// The storage index of a physical expert (the pool row its bytes live in).
  [[nodiscard]] std::int32_t storage_index(std::int32_t physical) const noexcept {
    if (c_.sharding == Sharding::tensor_slice) return physical;
    return first_storage_[static_cast<std::size_t>(owner_of(physical))] + local_of(physical);
  }
  /// [num_global]: global id -> local id on `rank`, -1 where another rank owns it.
  [[nodiscard]] std::span<const std::int32_t> local_table(std::int32_t rank) const noexcept {
    return std::span<const std::int32_t>(table_).subspan(static_cast<std::size_t>(rank) * static_cast<std::size_t>(c_.num_global),
                                                         static_cast<std::size_t>(c_.num_global));
  }

  /// A forward's global top-k ids -> rank `rank`'s local ids (same length). Negative ids are
  /// padding and stay -1; ids owned by another rank become -1.
  /// @param rank    the rank whose local ids are wanted
  /// @param global  the router's ids (negative: padding)
  /// @param local   gets one local id or -1 per global id; as long as `global`
  /// @return ok; every id is checked before the first output is written: an id >= num_global, a
  ///         rank out of range or a length mismatch is an error and `local` is unchanged
  [[nodiscard]] Status to_local(std::int32_t rank, std::span<const std::int32_t> global,
                                std::span<std::int32_t> local) const noexcept {
    if (rank < 0 || rank >= c_.world_size)
      return Status::format(ErrorCode::invalid_argument, "placement: rank %d is not a rank of world_size %d", rank,
                            c_.world_size);
    if (local.size() != global.size())
      return Status::format(ErrorCode::invalid_argument, "placement: %zu global ids, %zu local outputs", global.size(),
                            local.size());
    for (std::size_t i = 0; i < global.size(); ++i)
      if (global[i] >= c_.num_global)
        return Status::format(ErrorCode::expert_out_of_range,
                              "placement: global id %d at position %zu is outside every rank's experts [0, %d)", global[i],
                              i, c_.num_global);
    const auto table = local_table(rank);
    for (std::size_t i = 0; i < global.size(); ++i)
      local[i] = global[i] < 0 ? -1 : table[static_cast<std::size_t>(global[i])];
    return {};
  }

  /// Checks that a rank's cache was built for this placement. A mismatch (a rank started with
  /// another configuration, a restarted rank with a stale world size) is an error, never a
  /// silent drop.
  /// @param rank           the rank's index
  /// @param world_size     the world size the rank was told
  /// @param cache_experts  its cache's num_experts
  /// @return ok, or invalid_argument naming the mismatch
  [[nodiscard]] Status check_rank(std::int32_t rank, std::int32_t world_size, std::int32_t cache_experts) const noexcept {
    if (world_size != c_.world_size)
      return Status::format(ErrorCode::invalid_argument, "placement: rank %d has world_size %d, the placement %d", rank,
                            world_size, c_.world_size);
    if (rank < 0 || rank >= c_.world_size)
      return Status::format(ErrorCode::invalid_argument, "placement: rank %d is not a rank of world_size %d", rank,
                            c_.world_size);
    if (cache_experts != num_local(rank))
      return Status::format(ErrorCode::invalid_argument,
                            "placement: rank %d's cache has %d experts, the placement gives it %d", rank, cache_experts,
                            num_local(rank));
    return {};
  }

  /// A 64-bit digest of the configuration (FNV-1a over every field). Ranks exchange it once at
  /// start-up (an all-gather); check_fingerprints refuses any rank whose digest differs.
  [[nodiscard]] std::uint64_t fingerprint() const noexcept {
    std::uint64_t h = 0xcbf29ce484222325ull;
    auto mix = [&h](std::int64_t v) {
      for (int i = 0; i < 8; ++i) {
        h ^= static_cast<std::uint64_t>(v >> (8 * i)) & 0xFFu;
        h *= 0x100000001b3ull;
      }
    };
    mix(c_.num_global);
    mix(c_.num_physical);
    mix(c_.world_size);
    mix(static_cast<std::int64_t>(c_.sharding));
    mix(static_cast<std::int64_t>(c_.replica_kind));
    mix(static_cast<std::int64_t>(c_.logical_to_physical.size()));
    for (std::int32_t v : c_.logical_to_physical) mix(v);
    for (std::int32_t v : owner_) mix(v);
    for (std::int32_t v : local_) mix(v);
    return h;
  }
  /// @param per_rank  every rank's fingerprint(), in rank order (the all-gather's result)
  /// @return ok when all are equal, else invalid_argument naming the first rank that differs
  [[nodiscard]] static Status check_fingerprints(std::span<const std::uint64_t> per_rank) noexcept {
    for (std::size_t r = 1; r < per_rank.size(); ++r)
      if (per_rank[r] != per_rank[0])
        return Status::format(ErrorCode::invalid_argument,
                              "placement: rank %zu was configured differently from rank 0 (fingerprint %016llx vs %016llx)",
                              r, static_cast<unsigned long long>(per_rank[r]), static_cast<unsigned long long>(per_rank[0]));
    return {};
  }

 private:
  ExpertPlacement() = default;

  static Status check_replicas(const PlacementConfig& c) noexcept {
    if (c.logical_to_physical.empty()) {
      if (c.num_physical != c.num_global)
        return Status::format(ErrorCode::invalid_argument,
                              "placement: num_physical %d != num_global %d needs a replica map", c.num_physical,
                              c.num_global);
      return {};
    }
    if (c.logical_to_physical.size() != static_cast<std::size_t>(c.num_global))
      return Status::format(ErrorCode::invalid_argument, "placement: replica map has %zu entries, num_global is %d",
                            c.logical_to_physical.size(), c.num_global);
    for (std::size_t g = 0; g < c.logical_to_physical.size(); ++g) {
      const std::int32_t p = c.logical_to_physical[g];
      if (p < 0 || p >= c.num_physical)
        return Status::format(ErrorCode::invalid_argument, "placement: replica map[%zu] = %d is outside [0, %d)", g, p,
                              c.num_physical);
    }
    if (c.replica_kind == ReplicaMapKind::bijection) {
      if (c.num_physical != c.num_global)
        return Status::format(ErrorCode::invalid_argument,
                              "placement: a bijective replica map needs num_physical == num_global (%d vs %d)",
                              c.num_physical, c.num_global);
      std::vector<std::int32_t> seen(static_cast<std::size_t>(c.num_physical), -1);
      for (std::size_t g = 0; g < c.logical_to_physical.size(); ++g) {
        auto& s = seen[static_cast<std::size_t>(c.logical_to_physical[g])];
        if (s >= 0)
          return Status::format(ErrorCode::invalid_argument,
                                "placement: replica map is not a bijection: logical %d and %zu both map to physical %d", s,
                                g, c.logical_to_physical[g]);
        s = static_cast<std::int32_t>(g);
      }
    }
    return {};
  }

  PlacementConfig c_;
  std::vector<std::int32_t> owner_;          // [num_physical]
  std::vector<std::int32_t> local_;          // [num_physical]
  std::vector<std::int32_t> local_count_;    // [world]
  std::vector<std::int32_t> first_storage_;  // [world + 1]
  std::vector<std::int32_t> table_;          // [world][num_global]
};

}  // namespace expert_cache::inline v0
