#pragma once
/// Split plans for forwards wider than the cache: token chunks and expert groups, as pure functions.
// Plans for forwards wider than the cache (the reference providers' split modes: docs/reference_providers.md).
//  - token split (exact): greedy chunks of consecutive rows whose union of experts fits.
//  - expert split (rounding-level differences): ascending groups of <= capacity expert ids,
//    shared work (e.g. shared experts) flagged for group 0 only.
// Both are pure functions of the routing: no cache state is read or changed.
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "expert_cache/base/status.hpp"

namespace expert_cache::inline v0 {

/// One chunk of a token split: consecutive rows whose experts fit the cache together.
struct TokenChunk {
  std::int64_t row_begin = 0;            ///< rows [row_begin, row_end) of the top-k matrix
  std::int64_t row_end = 0;              ///< one past the chunk's last row
  std::vector<std::int32_t> unique_ids;  ///< sorted union of the chunk's expert ids (for prepare_unique)
  friend bool operator==(const TokenChunk&, const TokenChunk&) = default;
};

/// One group of an expert split: ids for one prepare_unique(), the forward run once per group.
struct ExpertGroup {
  std::vector<std::int32_t> unique_ids;  ///< ascending, at most `capacity` ids
  bool include_shared = false;           ///< true for group 0 only: where shared (not per expert) work goes
  friend bool operator==(const ExpertGroup&, const ExpertGroup&) = default;
};

namespace detail {
inline Status check_split_args(std::size_t ids, std::int32_t top_k, std::int32_t capacity,
                               std::int32_t num_experts) {
  if (top_k <= 0) return Status::format(ErrorCode::invalid_argument, "top_k must be positive, got %d", top_k);
  if (capacity <= 0) return Status::format(ErrorCode::invalid_capacity, "capacity must be positive, got %d", capacity);
  if (ids % static_cast<std::size_t>(top_k) != 0) {
    return Status::format(ErrorCode::invalid_argument, "top-k id count %zu is not a multiple of top_k %d", ids, top_k);
  }
  (void)num_experts;
  return {};
}

inline Status check_id(std::int32_t id, std::int32_t num_experts, std::int64_t row) {
  if (id >= num_experts) {
    return Status::format(ErrorCode::expert_out_of_range, "expert id %d in row %lld is outside [0, %d)", id,
                          static_cast<long long>(row), num_experts);
  }
  return {};
}
}  // namespace detail

/// Token split (exact): greedy chunks of consecutive rows whose union of experts fits `capacity`.
/// A pure function: no cache state is read or changed.
/// @param topk_ids     row-major [rows, top_k] routing ids; negative ids are padding
/// @param top_k        ids per row (> 0)
/// @param capacity     the cache's slots (> 0)
/// @param num_experts  valid ids are below it
/// @return the chunks in row order, covering every row (none for no rows); invalid_argument for top_k <= 0 or
///         a length that is not a multiple of top_k, invalid_capacity for capacity <= 0, expert_out_of_range
///         for an id >= num_experts, row_exceeds_capacity for a single row needing more than `capacity`
///         experts (it cannot be planned)
/// @throws std::bad_alloc when the result cannot be allocated
inline Result<std::vector<TokenChunk>> plan_token_chunks(std::span<const std::int32_t> topk_ids,
                                                         std::int32_t top_k, std::int32_t capacity,
                                                         std::int32_t num_experts) {
  if (Status s = detail::check_split_args(topk_ids.size(), top_k, capacity, num_experts); !s) return s;
  const auto k = static_cast<std::size_t>(top_k);
  const auto rows = static_cast<std::int64_t>(topk_ids.size() / k);
  std::vector<TokenChunk> chunks;
  std::vector<std::int32_t> seen, row_ids, merged;
  std::int64_t start = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    row_ids.clear();
    for (std::size_t j = 0; j < k; ++j) {
      const std::int32_t id = topk_ids[static_cast<std::size_t>(r) * k + j];
      if (id < 0) continue;
      if (Status s = detail::check_id(id, num_experts, r); !s) return s;
      row_ids.push_back(id);
    }
    std::sort(row_ids.begin(), row_ids.end());
    row_ids.erase(std::unique(row_ids.begin(), row_ids.end()), row_ids.end());
    if (static_cast<std::int64_t>(row_ids.size()) > capacity) {
      return Status(ErrorCode::row_exceeds_capacity,
                    "row " + std::to_string(r) + " routes to " + std::to_string(row_ids.size()) +
                        " experts but the cache has " + std::to_string(capacity) + " slots");
    }
    merged.clear();
    std::set_union(seen.begin(), seen.end(), row_ids.begin(), row_ids.end(), std::back_inserter(merged));
    if (static_cast<std::int64_t>(merged.size()) > capacity) {
      chunks.push_back(TokenChunk{start, r, seen});
      start = r;
      seen = row_ids;
    } else {
      seen.swap(merged);
    }
  }
  if (rows > start) chunks.push_back(TokenChunk{start, rows, seen});
  return chunks;
}

/// Expert split (rounding-level differences from one pass): the forward's unique ids in ascending groups
/// of at most `capacity`. A pure function: no cache state is read or changed.
/// @param topk_ids     row-major [rows, top_k] routing ids; negative ids are padding
/// @param top_k        ids per row (> 0)
/// @param capacity     the cache's slots (> 0)
/// @param num_experts  valid ids are below it
/// @return the groups, group 0 flagged include_shared; an empty batch gives one empty group (the forward
///         still runs once, e.g. for shared experts). invalid_argument for top_k <= 0 or a length that is
///         not a multiple of top_k, invalid_capacity for capacity <= 0, expert_out_of_range for an id
///         >= num_experts
/// @throws std::bad_alloc when the result cannot be allocated
inline Result<std::vector<ExpertGroup>> plan_expert_groups(std::span<const std::int32_t> topk_ids,
                                                           std::int32_t top_k, std::int32_t capacity,
                                                           std::int32_t num_experts) {
  if (Status s = detail::check_split_args(topk_ids.size(), top_k, capacity, num_experts); !s) return s;
  std::vector<std::int32_t> unique;
  unique.reserve(topk_ids.size());
  for (std::size_t i = 0; i < topk_ids.size(); ++i) {
    const std::int32_t id = topk_ids[i];
    if (id < 0) continue;
    if (Status s = detail::check_id(id, num_experts, static_cast<std::int64_t>(i / static_cast<std::size_t>(top_k))); !s) return s;
    unique.push_back(id);
  }
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  std::vector<ExpertGroup> groups;
  const auto cap = static_cast<std::size_t>(capacity);
  for (std::size_t begin = 0; begin < unique.size(); begin += cap) {
    const std::size_t end = std::min(unique.size(), begin + cap);
    groups.push_back(ExpertGroup{{unique.begin() + static_cast<std::ptrdiff_t>(begin),
                                  unique.begin() + static_cast<std::ptrdiff_t>(end)},
                                 groups.empty()});
  }
  if (groups.empty()) groups.push_back(ExpertGroup{{}, true});
  return groups;
}

}  // namespace expert_cache::inline v0
