#pragma once
/// SimRuntime's race detector over declared byte ranges.
// Every completed access (an op's declared reads and writes, or a host_access) is checked against a
// shadow map of earlier accesses: two race when their byte ranges overlap, at least one writes, and
// neither happens-before the other. Races are recorded, never thrown.
//
// History is pruned FastTrack-style: per disjoint byte segment, the last write plus the reads
// not already ordered before a later read. A pruned access can only hide a race when another
// race on the same bytes has been reported. Memory use is bounded by the number of distinct
// segments times the number of actors. Host-only.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "expert_cache/runtime/runtime.hpp"
#include "expert_cache/runtime/sim/op_kind.hpp"
#include "expert_cache/runtime/sim/vector_clock.hpp"

namespace expert_cache::inline v0 {

// One detected race. `earlier` completed (or happened on the host) first in the simulated
// execution; neither side happens-before the other.
struct RaceReport {
  struct Side {
    SimOpKind kind = SimOpKind::host;
    AccessMode mode = AccessMode::read;
    std::uint32_t stream = 0;  // stream id; 0 = the host
    std::uint64_t op = 0;      // sequence number of the op or host access (unique per runtime)
    std::string label;
  };
  Side earlier;
  Side later;
  std::uintptr_t begin = 0;  // overlapping bytes [begin, end)
  std::uintptr_t end = 0;
  std::string description;
};

namespace detail::sim {

// One access in the shadow history: (actor, epoch) decides happens-before.
struct AccessRec {
  std::uint32_t actor = 0;
  std::uint32_t epoch = 0;
  std::uint64_t seq = 0;
  SimOpKind kind = SimOpKind::host;
  AccessMode mode = AccessMode::read;
  Label label;
};

[[nodiscard]] inline bool happens_before(const AccessRec& a, const Clock& c) noexcept {
  return happens_before(a.actor, a.epoch, c);
}

class ShadowMemory {
 public:
  // Checks one access of [lo, lo + bytes) made at `clock` against the history and records it.
  // Reports beyond `max_races` are only counted. `describe(RaceReport&)` fills in the
  // description of each report this access made (the shadow knows addresses, not allocations).
  template <class Describe>
  void check(std::uintptr_t lo, std::size_t bytes, const AccessRec& acc, const Clock& clock, std::size_t max_races,
             Describe&& describe) {
    const std::uintptr_t hi = lo + bytes;
    found_.clear();
    if (bytes == 0) return;  // touches nothing
    // Three common cases need no split of their own: an access that overlaps no history (a first
    // touch: one new segment, nothing to check), and one inside a single segment, which covers
    // it exactly (the same buffer range again: recorded in place) or in part.
    auto it = shadow_.lower_bound(lo);
    const auto before = it == shadow_.begin() ? shadow_.end() : std::prev(it);
    if ((it == shadow_.end() || it->first >= hi) && (before == shadow_.end() || before->second.end <= lo)) {
      Segment seg;
      seg.end = hi;
      record_access(seg, acc, clock);
      const auto added = shadow_.emplace_hint(it, lo, std::move(seg));
      coalesce_from(before == shadow_.end() ? added : before, hi);
      return;
    }
    const auto holder = (it != shadow_.end() && it->first == lo) ? it : before;
    if (holder != shadow_.end() && holder->second.end >= hi) {
      record_inside(holder, lo, hi, acc, clock, max_races, describe);
      return;
    }
    split_at(lo);
    split_at(hi);
    for (auto part = shadow_.lower_bound(lo); part != shadow_.end() && part->first < hi; ++part)
      check_against(part->second, part->first, part->second.end, acc, clock, max_races);
    for (const std::size_t i : found_) describe(races_[i]);

    if (acc.mode == AccessMode::write) {
      // The new write supersedes everything in the range: one segment.
      shadow_.erase(shadow_.lower_bound(lo), shadow_.lower_bound(hi));
      Segment seg;
      seg.end = hi;
      record_access(seg, acc, clock);
      shadow_.emplace(lo, std::move(seg));
    } else {
      add_read(lo, hi, acc, clock);
    }
    coalesce(lo, hi);
  }

  // Forgets the history of [lo, hi) (freed memory).
  void forget(std::uintptr_t lo, std::uintptr_t hi) noexcept {
    try {
      split_at(lo);
      split_at(hi);
      shadow_.erase(shadow_.lower_bound(lo), shadow_.lower_bound(hi));
    } catch (...) {
      shadow_.clear();  // losing history only loses detection, never reports a false race
    }
  }

  // A report made outside an access check (memory freed under a pending op).
  void add_report(RaceReport r, std::size_t max_races) {
    ++race_count_;
    if (races_.size() < max_races) races_.push_back(std::move(r));
  }

  [[nodiscard]] std::span<const RaceReport> races() const noexcept { return races_; }
  [[nodiscard]] std::uint64_t race_count() const noexcept { return race_count_; }  // incl. dropped
  void clear_races() noexcept {
    races_.clear();
    race_count_ = 0;
  }
  // History and reports.
  void clear() noexcept {
    shadow_.clear();
    clear_races();
  }

 private:
  // Shadow state of a disjoint byte segment [key, end).
  struct Segment {
    std::uintptr_t end = 0;
    bool has_write = false;
    AccessRec write;
    std::vector<AccessRec> reads;  // none happens-before another
  };

  // check() for [lo, hi) inside the one segment `holder` (holder->first <= lo, hi <= its end): the
  // same reports and the same resulting segments as splitting at lo and hi, then recording the
  // access on the middle part (in place when the access covers the whole segment).
  template <class Describe>
  void record_inside(std::map<std::uintptr_t, Segment>::iterator holder, std::uintptr_t lo, std::uintptr_t hi,
                     const AccessRec& acc, const Clock& clock, std::size_t max_races, Describe& describe) {
    Segment& whole = holder->second;
    check_against(whole, lo, hi, acc, clock, max_races);
    for (const std::size_t i : found_) describe(races_[i]);
    if (hi < whole.end) shadow_.emplace_hint(std::next(holder), hi, whole);  // the part after: a copy
    auto middle = holder;
    if (holder->first < lo) {  // the part before keeps the node; the middle is a new one
      Segment seg;
      if (acc.mode == AccessMode::read) seg = whole;
      seg.end = hi;
      whole.end = lo;
      record_access(seg, acc, clock);
      middle = shadow_.emplace_hint(std::next(holder), lo, std::move(seg));
    } else {
      whole.end = hi;
      record_access(whole, acc, clock);
    }
    coalesce_from(middle == shadow_.begin() ? middle : std::prev(middle), hi);
  }

  // Reports the races of an access to [lo, hi) with the history of `seg`, which holds those bytes.
  void check_against(const Segment& seg, std::uintptr_t lo, std::uintptr_t hi, const AccessRec& acc, const Clock& clock,
                     std::size_t max_races) {
    if (seg.has_write && !happens_before(seg.write, clock)) report(seg.write, acc, lo, hi, max_races);
    if (acc.mode == AccessMode::write)
      for (const AccessRec& r : seg.reads)
        if (!happens_before(r, clock)) report(r, acc, lo, hi, max_races);
  }

  // Records the access in `seg`'s history: a write replaces it; a read drops the reads ordered
  // before it and joins the rest.
  static void record_access(Segment& seg, const AccessRec& acc, const Clock& clock) {
    if (acc.mode == AccessMode::write) {
      seg.has_write = true;
      seg.write = acc;
      seg.reads.clear();
    } else {
      std::erase_if(seg.reads, [&](const AccessRec& r) { return happens_before(r, clock); });
      seg.reads.push_back(acc);
    }
  }

  // Splits the segment containing x (strictly inside) so that a segment starts at x.
  void split_at(std::uintptr_t x) {
    auto it = shadow_.upper_bound(x);
    if (it == shadow_.begin()) return;
    --it;
    if (it->first == x || it->second.end <= x) return;
    Segment right = it->second;  // copies the history
    it->second.end = x;
    shadow_.emplace_hint(std::next(it), x, std::move(right));
  }

  static bool same_history(const Segment& a, const Segment& b) noexcept {
    if (a.has_write != b.has_write || (a.has_write && a.write.seq != b.write.seq)) return false;
    if (a.reads.size() != b.reads.size()) return false;
    for (std::size_t i = 0; i < a.reads.size(); ++i)
      if (a.reads[i].seq != b.reads[i].seq) return false;
    return true;
  }

  // Merges neighbours with identical history in [lo, hi] so the map stays small.
  void coalesce(std::uintptr_t lo, std::uintptr_t hi) {
    auto it = shadow_.lower_bound(lo);
    if (it != shadow_.begin()) --it;
    coalesce_from(it, hi);
  }
  // The same from `it`, the segment before lo's (or the first one).
  void coalesce_from(std::map<std::uintptr_t, Segment>::iterator it, std::uintptr_t hi) {
    while (it != shadow_.end() && it->first <= hi) {
      auto nx = std::next(it);
      if (nx == shadow_.end()) break;
      if (it->second.end == nx->first && same_history(it->second, nx->second)) {
        it->second.end = nx->second.end;
        shadow_.erase(nx);
      } else {
        it = nx;
      }
    }
  }

  // Records a read over [lo, hi): prunes reads ordered before it, fills gaps.
  void add_read(std::uintptr_t lo, std::uintptr_t hi, const AccessRec& acc, const Clock& clock) {
    std::uintptr_t cursor = lo;
    auto it = shadow_.lower_bound(lo);
    while (cursor < hi) {
      if (it == shadow_.end() || it->first > cursor) {  // a gap without history
        Segment seg;
        seg.end = (it == shadow_.end()) ? hi : std::min<std::uintptr_t>(hi, it->first);
        record_access(seg, acc, clock);
        const std::uintptr_t start = cursor;
        cursor = seg.end;
        shadow_.emplace_hint(it, start, std::move(seg));
        continue;
      }
      Segment& seg = it->second;
      record_access(seg, acc, clock);
      cursor = seg.end;
      ++it;
    }
  }

  void report(const AccessRec& earlier, const AccessRec& later, std::uintptr_t lo, std::uintptr_t hi,
              std::size_t max_races) {
    for (const std::size_t i : found_) {  // one report per (earlier access, this access)
      RaceReport& r = races_[i];
      if (r.earlier.op == earlier.seq && r.earlier.mode == earlier.mode) {
        r.begin = std::min(r.begin, lo);
        r.end = std::max(r.end, hi);
        return;
      }
    }
    ++race_count_;
    if (races_.size() >= max_races) return;
    RaceReport r;
    r.earlier = side(earlier);
    r.later = side(later);
    r.begin = lo;
    r.end = hi;
    races_.push_back(std::move(r));
    found_.push_back(races_.size() - 1);
  }

  static RaceReport::Side side(const AccessRec& a) {
    return RaceReport::Side{a.kind, a.mode, a.actor, a.seq, a.label ? *a.label : std::string()};
  }

  std::map<std::uintptr_t, Segment> shadow_;
  std::vector<RaceReport> races_;
  std::uint64_t race_count_ = 0;
  std::vector<std::size_t> found_;  // scratch: reports made by the current access
};

}  // namespace detail::sim

}  // namespace expert_cache::inline v0
