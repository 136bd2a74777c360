#pragma once
/// The ordering core: the ONLY code in the library that records events and makes streams wait.
// Every ExpertCache instantiation (row, whole-expert, any staging policy) goes through it, and
// through ONE entry, write(): the cache plans, hands the core the call's writes, and reads.
//
// Streams involved:
//   X      the caller's (consumer) stream of the current prepare()/invalidate()
//   owner  the stream of the last accepted prepare(): where kernels read the slots and maps
//   F      the fill stream: the cache-owned copy stream, or X itself in inline mode (a wide
//          forward's fills: the wide stream, where an inline core has one: add_wide_stream)
//   last_fill  the stream that last wrote slots / the resident map (differs from F only in
//              inline mode, when calls move between streams)
//
// write(X, purpose, resident_map, writes) runs the protocol of one call:
//   1. order F after previous use: F waits for the owner's readers and the last writer
//      (and joins X's graph capture when X is capturing);
//   2. writes(F): the caller's device writes (slot fills), enqueued on F only;
//   3. the resident-map upload, on F so generations land in order;
//   4. publish: record `ready` on F; X waits for it;
//   5. for a prepare(), X becomes the owner (the reader).
// A prepare() with nothing to write (WritePurpose::read_only) skips 1-4 and only adopts X as
// the reader: X waits for the previous owner's readers (it overwrites the forward map) and for
// the latest `ready` it has not seen. invalidate() runs 1-4 and leaves the owner as it is.
// A prefetch() (WritePurpose::speculative) runs 1, then 3 and 4 without X waiting (the map
// lands first), then 2: its fills, each followed by record_speculative(slot, F). X neither
// waits nor becomes the owner: the fills overlap the work on X. A later prepare() whose forward
// uses a speculative slot waits for exactly that slot's event (wait_speculative, edge 9).
//
// A wide forward (cache/wide.hpp) runs its rounds through wide_begin (edges 1, 2 on F; X adopted as
// the reader with edges 4, 5), then per round wide_fill (F waits for the release of the buffer
// it refills, edge 10; the round's writes; the resident map; `ready` on F, X NOT waiting yet),
// wide_acquire (X waits for the latest `ready`: the round it is about to read, edge 3) and, after
// the round's consumer, wide_release (the buffer's release recorded on X). The host calls
// wide_acquire(r) before wide_fill(r + 1), so X waits for round r's copies only and round
// r + 1's copies overlap round r's consumer.
//
// Readers: one core may serve several caches that share its fill stream and events (the
// model-level cache, cache/model_cache.hpp: one reader per layer). Each reader index has its own
// owner, so a write for reader r waits for r's owner exactly as a core of its own would; the
// writer (last_fill) and `ready` are shared, and each covers every earlier write of every
// reader (docs/design.md, "Model-level cache"). One reader (the default) is the single cache.
//
// Each happens-before edge (docs/design.md's table, numbered there) is a compile-time switch
// in OrderingEdges. Only tests turn one off (through detail::ExpertCacheWithEdges; the public
// ExpertCache always uses OrderingEdges) and show the race detector then fires: an edge nobody
// can remove without failing a test is an edge that is tested.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "expert_cache/base/concepts.hpp"
#include "expert_cache/base/runtime_types.hpp"
#include "expert_cache/base/status.hpp"
#include "expert_cache/runtime/resources.hpp"

namespace expert_cache::inline v0 {

/// The edges of docs/design.md's happens-before table, each on by default. A test derives from
/// this struct and hides one member with `false` to remove that edge.
struct OrderingEdges {
  static constexpr bool release_wait = true;             // 1: F waits for the owner's readers (WAR)
  static constexpr bool last_fill_release = true;        // 2: F waits for the last writer stream (WAW)
  static constexpr bool ready_wait = true;               // 3: X waits for its call's writes (RAW)
  static constexpr bool all_hit_ready_wait = true;       // 4: a reader without writes waits for the latest ones
  static constexpr bool owner_change_release = true;     // 5: a new owner waits for the previous owner's readers
  static constexpr bool invalidate_order = true;         // 6: invalidate's map write is ordered like a fill
  static constexpr bool resident_map_serialised = true;  // 7: resident-map uploads go on F
  static constexpr bool staging_guard = true;            // 8: a staging buffer waits for its last copy
  static constexpr bool speculative_slot_wait = true;    // 9: a forward using a speculative fill waits for its slot's event
  static constexpr bool wide_buffer_release = true;      // 10: a wide round refills a buffer after the consumer that read it
  static constexpr bool wide_resident_read_wait = true;  // D10: the host plans a device-planned wide forward after its pool read-back
  static constexpr bool speculative_overwrite_wait = true;  // 11: a slot write waits for the slot's pending speculative fill
};

/// What a call through OrderingCore::write() does.
enum class WritePurpose : std::uint8_t {
  fill,        // prepare() with writes (slot fills and/or a stale resident map); X then reads
  read_only,   // prepare() with nothing to write (all hits, resident map current); X only reads
  invalidate,  // invalidate(): the resident map changes; the owner keeps reading
  speculative, // prefetch(): the resident map, then slot fills X does not wait for; the owner keeps reading
};

/// A host map (int32 entries, as many as the core's map_entries) and the device buffer it is
/// uploaded to. An empty upload (host == nullptr) uploads nothing.
struct MapUpload {
  const std::int32_t* host = nullptr;
  std::int32_t* device = nullptr;
  std::size_t entries = 0;  // entries to copy from host/device on; 0 = the core's map_entries
};

/// What the core did since construction (a cache's stats report them).
struct OrderingCounters {
  std::uint64_t owner_changes = 0;
  std::uint64_t map_uploads = 0;
  std::uint64_t staging_stalls = 0;  // host waited for a staging buffer's copy to finish
  std::uint64_t release_edges = 0;
  std::uint64_t ready_edges = 0;
};

/// The write protocol of one cache (or of one model cache's layers): its streams, events and
/// staging ring, and every wait and record between them.
template <allocating_runtime R, class Edges = OrderingEdges>
class OrderingCore {
 public:
  using Stream = typename R::Stream;
  using Event = typename R::Event;

  /// @param rt                   the runtime; it must outlive the core
  /// @param fill_on_copy_stream  true: fills on a cache-owned copy stream; false: inline mode
  ///                             (fills on the caller's stream, the cached provider's semantics)
  /// @param map_entries          int32 entries of each device map upload
  /// @param staging_ring         pinned host staging buffers for map uploads (at least 2)
  /// @param readers              owners tracked separately (see the header comment; 1 for one
  ///                             cache)
  /// @throws Error invalid_argument for staging_ring < 2 or readers < 1, or the runtime's error
  ///         when a stream, event or buffer cannot be made
  OrderingCore(R& rt, bool fill_on_copy_stream, std::size_t map_entries, std::size_t staging_ring,
               std::size_t readers = 1)
      : rt_(&rt),
        inline_mode_(!fill_on_copy_stream),
        map_bytes_(map_entries * sizeof(std::int32_t)),
        release_owner_(rt),
        release_fill_(rt),
        ready_(rt) {
    if (staging_ring < 2) throw Error(ErrorCode::invalid_argument, "staging ring needs at least 2 buffers");
    if (readers < 1) throw Error(ErrorCode::invalid_argument, "an ordering core needs at least 1 reader");
    owners_.resize(readers);
    before_forward_.emplace_back(rt);  // reader 0's; the others' with the first prefetch
    before_forward_valid_.assign(readers, 0);
    if (fill_on_copy_stream) copy_stream_.emplace(rt);
    ring_.reserve(staging_ring);
    for (std::size_t i = 0; i < staging_ring; ++i) {
      ring_.push_back(StagingBuffer{RuntimeBuffer<R>(rt, map_bytes_, MemoryKind::pinned_host),
                                    RuntimeEvent<R>(rt), false, 0});
    }
  }

  /// True when fills run on the caller's stream.
  [[nodiscard]] bool inline_mode() const noexcept { return inline_mode_; }
  /// The stream of the last accepted prepare (any reader); owner(r): reader r's.
  [[nodiscard]] std::optional<Stream> owner() const noexcept { return owner_; }
  [[nodiscard]] std::optional<Stream> owner(std::size_t reader) const noexcept {
    return reader < owners_.size() ? owners_[reader] : std::nullopt;
  }
  /// Readers tracked (construction's `readers`).
  [[nodiscard]] std::size_t readers() const noexcept { return owners_.size(); }
  /// The cache-owned copy stream; nullopt in inline mode.
  [[nodiscard]] std::optional<Stream> copy_stream() const noexcept {
    return copy_stream_ ? std::optional<Stream>(copy_stream_->get()) : std::nullopt;
  }
  /// What the core did since construction.
  [[nodiscard]] const OrderingCounters& counters() const noexcept { return counters_; }
  /// Pinned host bytes of the staging ring.
  [[nodiscard]] std::size_t staging_bytes() const noexcept { return ring_.size() * map_bytes_; }

  /// The stream that writes slots and the resident map for a call from `caller`.
  [[nodiscard]] Stream fill_stream(Stream caller) const noexcept {
    return inline_mode_ ? caller : copy_stream_->get();
  }
  // Inline mode: a stream for wide forwards' fills only (the device-planned cache streams a
  // wide forward's misses from the host with copies, which must overlap its consumers; its
  // other writes stay on the caller's stream). A core with a copy stream uses that one.
  void add_wide_stream() {
    if (inline_mode_ && !wide_stream_) wide_stream_.emplace(*rt_);
  }
  // The stream a wide forward's rounds are filled on.
  [[nodiscard]] Stream wide_fill_stream(Stream caller) const noexcept {
    if (!inline_mode_) return copy_stream_->get();
    return wide_stream_ ? wide_stream_->get() : caller;
  }

  /// One cache call's device work in protocol order (the header comment lists the steps).
  /// On failure the call's work may be partly enqueued; the caller decides what it no longer
  /// trusts (ExpertCache drops the experts it was filling).
  /// @param caller    the stream of the cache call (X)
  /// @param purpose   what the call does
  /// @param resident  the resident map, uploaded after the writes (skipped when empty)
  /// @param writes    `writes(F)` enqueues the call's writes on F and returns their Status; it is
  ///                  not called for WritePurpose::read_only
  /// @param reader    whose owner this call orders against and becomes (in [0, readers()))
  /// @return the first failure of a runtime call or of `writes`; invalid_argument for a reader
  ///         out of range
  template <class Writes>
    requires std::is_nothrow_invocable_r_v<Status, Writes&, Stream>
  // `reader`: whose owner this call orders against and becomes (in [0, readers())).
  Status write(Stream caller, WritePurpose purpose, MapUpload resident, Writes&& writes,
               std::size_t reader = 0) noexcept {
    if (reader >= owners_.size()) {
      return Status::format(ErrorCode::invalid_argument, "ordering core reader %zu is outside [0, %zu)", reader,
                            owners_.size());
    }
    if (purpose == WritePurpose::read_only) return adopt_reader(caller, false, reader);
    // invalidate() may free a slot the latest forward's consumers still read: a speculative
    // write into it must follow them (the owner's release made then), until the next forward.
    if (purpose == WritePurpose::invalidate) before_forward_valid_[reader] = 0;
    const Stream fill = fill_stream(caller);
    if (purpose == WritePurpose::speculative) {
      // Edges 1 and 2 as for a fill. The resident map goes first and `ready` right after it, so
      // a later reader without writes waits for the map (edge 4) but not for these fills: it
      // waits for the slots it uses only (edge 9). Nobody waits for this `ready` now.
      Status s = order_writes_after_previous_use<Edges::release_wait, Edges::last_fill_release>(fill, caller, reader);
      if (s && resident.host != nullptr) {
        s = upload_map(resident.host, resident.device, Edges::resident_map_serialised ? fill : caller, resident.entries);
      }
      if (s) s = rt_->record(ready_.get(), fill);
      if (!s) return s;
      ready_recorded_ = true;
      ready_seen_count_ = 0;
      return writes(fill);
    }
    Status s = purpose == WritePurpose::fill
                   ? order_writes_after_previous_use<Edges::release_wait, Edges::last_fill_release>(fill, caller, reader)
                   : order_writes_after_previous_use<Edges::invalidate_order, Edges::invalidate_order>(fill, caller, reader);
    if (s) s = writes(fill);
    if (s && resident.host != nullptr) {
      s = upload_map(resident.host, resident.device, Edges::resident_map_serialised ? fill : caller, resident.entries);
    }
    if (s) s = publish_writes(fill, caller);
    if (s && purpose == WritePurpose::fill) s = adopt_reader(caller, true, reader);
    return s;
  }

  // Whether write_speculative_slots may run for `reader`: its latest forward reads only its own
  // experts' slots (no other reader reads them: a model cache's layers have their own slots) and
  // was adopted after the first prefetch, and no invalidate() of it since.
  [[nodiscard]] bool speculative_before_forward(std::size_t reader = 0) const noexcept {
    return reader < before_forward_valid_.size() && before_forward_valid_[reader] != 0 &&
           reader < before_forward_.size() && speculative_stream_.has_value();
  }

  // Speculative slot writes that touch no slot of the latest forward (ExpertCache::prefetch,
  // where speculative_before_forward()): on the speculative stream S, after the owner's stream
  // as it was when that forward was adopted (edge 1; the consumers of earlier forwards), not
  // after everything enqueued there since, so a prefetch of layer L+1 made after layer L's
  // consumer copies while that consumer runs. No map and no `ready`: the caller uploads the
  // resident map with its next forward, a forward using a fill waits for its slot (edge 9), and
  // a later write of a slot waits for its pending fill (order_slot_write, edge 11). F never
  // holds these fills, so the next forward's own writes do not queue behind them.
  template <class Writes>
    requires std::is_nothrow_invocable_r_v<Status, Writes&, Stream>
  Status write_speculative_slots(Writes&& writes, std::size_t reader = 0) noexcept {
    if (!speculative_before_forward(reader)) {
      return Status(ErrorCode::internal, "write_speculative_slots without an adopted forward to order after");
    }
    const Stream spec = speculative_stream_->get();
    if constexpr (Edges::release_wait) {
      if (owners_[reader] && *owners_[reader] != spec) {
        if (Status s = rt_->wait(spec, before_forward_[reader].get()); !s) return s;
        ++counters_.release_edges;
      }
    }
    return writes(spec);
  }

  // Before a write of `slot` on `stream`: a speculative fill of it still pending (made on S, or
  // one no forward waited for) is waited for first (edge 11), and is then no longer pending.
  Status order_slot_write(std::size_t slot, Stream stream) noexcept {
    if (slot >= speculative_.size() || !speculative_[slot].pending) return {};
    if constexpr (Edges::speculative_overwrite_wait) {
      if (Status s = rt_->wait(stream, speculative_[slot].event.get()); !s) return s;
    }
    forget_speculative(slot);
    return {};
  }

  // Per-slot events of speculative fills (edge 9), created on the first prefetch: `slots` is the
  // cache's capacity. An event that cannot be made fails the call (the events made so far are kept).
  Status reserve_speculative_slots(std::size_t slots) noexcept {
    if (before_forward_.size() < owners_.size()) {
      try {
        while (before_forward_.size() < owners_.size()) before_forward_.emplace_back(*rt_);
      } catch (...) {
        return Status(ErrorCode::runtime_failure, "could not create the readers' speculative ordering events");
      }
    }
    if (!speculative_stream_) {
      try {
        speculative_stream_.emplace(*rt_);
      } catch (const Error& e) {
        return Status(e.code(), e.what());
      } catch (...) {
        return Status(ErrorCode::runtime_failure, "could not create the speculative fills' stream");
      }
    }
    if (speculative_.size() >= slots) return {};
    try {
      speculative_.reserve(slots);
      while (speculative_.size() < slots) speculative_.push_back(SpeculativeSlot{RuntimeEvent<R>(*rt_), false});
    } catch (const Error& e) {
      return Status(e.code(), e.what());
    } catch (...) {
      return Status(ErrorCode::runtime_failure, "could not allocate the per-slot events of speculative fills");
    }
    return {};
  }
  // Inside write(speculative)'s `writes`, after the copy into `slot` was enqueued on `fill`.
  Status record_speculative(std::size_t slot, Stream fill) noexcept {
    if (slot >= speculative_.size()) {
      return Status::format(ErrorCode::internal, "speculative slot %zu outside the %zu reserved", slot,
                            speculative_.size());
    }
    forget_speculative(slot);
    if (Status s = rt_->record(speculative_[slot].event.get(), fill); !s) return s;
    speculative_[slot].pending = true;
    ++speculative_pending_count_;
    return {};
  }
  // Whether any slot holds a speculative fill no prepare has waited for yet: lets a prepare of a
  // cache with nothing in flight skip the per-expert test.
  [[nodiscard]] bool any_speculative_pending() const noexcept { return speculative_pending_count_ != 0; }
  // Whether `slot` holds a speculative fill no prepare has waited for yet.
  [[nodiscard]] bool speculative_pending(std::size_t slot) const noexcept {
    return slot < speculative_.size() && speculative_[slot].pending;
  }
  // Edge 9: `caller` (a prepare that reads `slot`) waits for that slot's fill, then forgets it:
  // later readers are ordered after this one (edges 1, 4, 5), which saw the bytes.
  Status wait_speculative(std::size_t slot, Stream caller) noexcept {
    if (!speculative_pending(slot)) return {};
    if constexpr (Edges::speculative_slot_wait) {
      if (Status s = rt_->wait(caller, speculative_[slot].event.get()); !s) return s;
    }
    forget_speculative(slot);
    return {};
  }
  // The slot is written again by a prepare's fill (ordered by edges 1-3) or freed.
  void forget_speculative(std::size_t slot) noexcept {
    if (slot < speculative_.size() && speculative_[slot].pending) {
      speculative_[slot].pending = false;
      --speculative_pending_count_;
    }
  }

  // ---- wide forwards (header comment; docs/design.md "Wide forwards") ----

  // Before a wide forward's first round: F after every earlier reader and writer (edges 1, 2),
  // `caller` becomes reader `reader` after the previous owner's readers and the latest `ready`
  // (edges 5, 4). The two buffer-release events are made on the first call.
  Status wide_begin(Stream caller, std::size_t reader = 0) noexcept {
    if (reader >= owners_.size()) {
      return Status::format(ErrorCode::invalid_argument, "ordering core reader %zu is outside [0, %zu)", reader,
                            owners_.size());
    }
    if (wide_release_.size() < 2) {
      try {
        while (wide_release_.size() < 2) wide_release_.emplace_back(*rt_);
      } catch (const Error& e) {
        return Status(e.code(), e.what());
      } catch (...) {
        return Status(ErrorCode::runtime_failure, "could not create the wide forward's buffer-release events");
      }
    }
    wide_released_ = {false, false};
    const Stream fill = wide_fill_stream(caller);
    Status s = order_writes_after_previous_use<Edges::release_wait, Edges::last_fill_release>(fill, caller, reader);
    // Edge 10 across forwards: the buffers are shared by every reader (a model cache's layers),
    // so F also waits for the stream of the last wide forward when it is not this reader's owner.
    if constexpr (Edges::wide_buffer_release) {
      const std::optional<Stream>& owner = owners_[reader];
      if (s && wide_reader_ && *wide_reader_ != fill && (!owner || *wide_reader_ != *owner)) {
        s = rt_->record(release_owner_.get(), *wide_reader_);
        if (s) s = rt_->wait(fill, release_owner_.get());
        if (s) ++counters_.release_edges;
      }
    }
    if (s) s = adopt_reader(caller, false, reader, false);
    if (s) wide_reader_ = caller;
    return s;
  }
  // One round's writes on F into buffer `buffer` (0 or 1), after the consumer that last read
  // that buffer in this forward (edge 10), then the resident map (edge 7) and `ready`.
  template <class Writes>
    requires std::is_nothrow_invocable_r_v<Status, Writes&, Stream>
  Status wide_fill(Stream caller, std::size_t buffer, MapUpload resident, Writes&& writes) noexcept {
    const Stream fill = wide_fill_stream(caller);
    if (buffer >= wide_release_.size()) return Status(ErrorCode::internal, "wide_fill before wide_begin");
    if constexpr (Edges::wide_buffer_release) {
      if (wide_released_[buffer] && fill != caller) {
        if (Status s = rt_->wait(fill, wide_release_[buffer].get()); !s) return s;
        ++counters_.release_edges;
      }
    }
    wide_released_[buffer] = false;
    last_fill_ = fill;
    Status s = writes(fill);
    if (s && resident.host != nullptr) {
      s = upload_map(resident.host, resident.device, Edges::resident_map_serialised ? fill : caller, resident.entries);
    }
    if (s) s = rt_->record(ready_.get(), fill);
    if (!s) return s;
    ready_recorded_ = true;
    ready_seen_count_ = 0;
    return {};
  }
  // `caller` waits for the latest wide_fill (edge 3): the round it reads next.
  Status wide_acquire(Stream caller) noexcept {
    if (wide_fill_stream(caller) != caller && ready_recorded_ && !ready_seen_by(caller)) {
      if constexpr (Edges::ready_wait) {
        if (Status s = rt_->wait(caller, ready_.get()); !s) return s;
        ++counters_.ready_edges;
      }
    }
    note_ready_seen(caller);
    return {};
  }
  // After the consumer of a round that read buffer `buffer`: its release, recorded on `caller`.
  Status wide_release(Stream caller, std::size_t buffer) noexcept {
    if (buffer >= wide_release_.size()) return Status(ErrorCode::internal, "wide_release before wide_begin");
    if (Status s = rt_->record(wide_release_[buffer].get(), caller); !s) return s;
    wide_released_[buffer] = true;
    return {};
  }

  // One async copy of a host map (int32 entries) into a device buffer on `stream`, through
  // the next staging buffer of the ring.
  //
  // Under graph capture the copy becomes a graph node that reads the staging buffer at each
  // launch, and `consumed` becomes a captured event the host cannot query. Such a buffer is
  // treated as free by the capture contract (docs/cuda_backend.md: a graph holding a captured
  // cache call is launched and completed before the cache's next call), except inside the
  // capture that used it: rewriting it there would change what the graph uploads, so that
  // is refused.
  // `entries` (0 = map_entries): a shorter map, e.g. one layer's range of a model-level map.
  Status upload_map(const std::int32_t* host_map, std::int32_t* device_map, Stream stream,
                    std::size_t entries = 0) noexcept {
    const std::size_t bytes = entries == 0 ? map_bytes_ : entries * sizeof(std::int32_t);
    if (bytes > map_bytes_) {
      return Status::format(ErrorCode::invalid_argument, "map upload of %zu entries exceeds the core's %zu",
                            entries, map_bytes_ / sizeof(std::int32_t));
    }
    Result<std::uint64_t> capture = capture_sequence(stream);
    if (!capture.ok()) return capture.status();
    StagingBuffer& buf = ring_[next_staging_];
    if (buf.capture != 0) {
      if (buf.capture == capture.value()) {
        return Status::format(ErrorCode::capture_unsupported,
                              "one graph capture needs more map uploads than the staging ring holds (%zu buffers); "
                              "raise CacheOptions::staging_ring",
                              ring_.size());
      }
      buf.recorded = false;
      buf.capture = 0;
    }
    next_staging_ = (next_staging_ + 1) % ring_.size();
    if constexpr (Edges::staging_guard) {
      if (buf.recorded) {
        Result<bool> done = rt_->query(buf.consumed.get());
        if (!done.ok()) return done.status();
        if (!done.value()) {
          ++counters_.staging_stalls;
          if (Status s = rt_->synchronize(buf.consumed.get()); !s) return s;
        }
      }
    }
    rt_->host_access(buf.memory.data(), bytes, AccessMode::write);
    std::memcpy(buf.memory.data(), host_map, bytes);
    if (Status s = rt_->copy_async(device_map, buf.memory.data(), bytes, stream); !s) return s;
    if (Status s = rt_->record(buf.consumed.get(), stream); !s) {
      buf.recorded = false;
      return s;
    }
    buf.recorded = true;
    buf.capture = capture.value();
    last_upload_captured_ = capture.value() != 0;
    ++counters_.map_uploads;
    return {};
  }

  // Whether the last successful upload_map was recorded into a graph capture.
  [[nodiscard]] bool last_upload_captured() const noexcept { return last_upload_captured_; }

 private:
  // Before any write on F: F waits for every earlier reader (owner) and writer (last_fill).
  // capture_join: when the caller's stream is being captured into a graph and F is another
  // stream, F first waits for a record made on the caller inside the capture, which forks F
  // into the same capture (otherwise F's writes would run eagerly, outside the graph).
  // `owner_before_forward`: the owner's release is before_forward_ (recorded when its latest
  // forward was adopted) instead of a record made now.
  template <bool OwnerRelease, bool LastFillRelease>
  Status order_writes_after_previous_use(Stream fill, Stream caller, std::size_t reader,
                                         bool owner_before_forward = false) noexcept {
    const std::optional<Stream>& owner = owners_[reader];  // this reader's owner
    (void)owner;  // unused only when a test removes both edges below
    if (fill != caller) {
      Result<bool> capturing = rt_->is_capturing(caller);
      if (!capturing.ok()) return capturing.status();
      if (capturing.value()) {
        if (Status s = rt_->record(release_owner_.get(), caller); !s) return s;
        if (Status s = rt_->wait(fill, release_owner_.get()); !s) return s;
      }
    }
    if constexpr (OwnerRelease) {
      if (owner && *owner != fill) {
        if (owner_before_forward) {
          if (Status s = rt_->wait(fill, before_forward_[reader].get()); !s) return s;
        } else {
          if (Status s = rt_->record(release_owner_.get(), *owner); !s) return s;
          if (Status s = rt_->wait(fill, release_owner_.get()); !s) return s;
        }
        ++counters_.release_edges;
      }
    }
    if constexpr (LastFillRelease) {
      // A last writer that is the owner is covered by the owner's release above.
      if (last_fill_ && *last_fill_ != fill && (!owner || *last_fill_ != *owner)) {
        if (Status s = rt_->record(release_fill_.get(), *last_fill_); !s) return s;
        if (Status s = rt_->wait(fill, release_fill_.get()); !s) return s;
        ++counters_.release_edges;
      }
    }
    last_fill_ = fill;  // set before the writes: a partly enqueued fill still counts as a writer
    return {};
  }

  // After the writes on F: record `ready` there; `caller` waits for it. Other streams that
  // later read without writing of their own wait in adopt_reader().
  Status publish_writes(Stream fill, Stream caller) noexcept {
    if (Status s = rt_->record(ready_.get(), fill); !s) return s;
    ready_recorded_ = true;
    ready_seen_count_ = 0;
    if (fill != caller) {
      if constexpr (Edges::ready_wait) {
        if (Status s = rt_->wait(caller, ready_.get()); !s) return s;
        ++counters_.ready_edges;
      }
    }
    note_ready_seen(caller);
    return {};
  }

  // `caller` becomes the reader (owner). Without writes of its own, its readers must come after
  // the latest writes (fills or an invalidate's map upload, possibly issued from another stream)
  // and, on an owner change, after the previous owner's readers of the forward map this call
  // overwrites. With writes, order_writes/publish_writes already did both.
  // `slots_of_own_experts`: the forward's consumers read only its own experts' slots (a wide
  // forward may read any resident in place: false).
  Status adopt_reader(Stream caller, bool writes_done, std::size_t reader, bool slots_of_own_experts = true) noexcept {
    std::optional<Stream>& reader_owner = owners_[reader];
    const bool owner_changed = reader_owner && *reader_owner != caller;
    if (owner_changed) ++counters_.owner_changes;
    if (!writes_done) {
      if constexpr (Edges::owner_change_release) {
        if (owner_changed) {
          if (Status s = rt_->record(release_owner_.get(), *reader_owner); !s) return s;
          if (Status s = rt_->wait(caller, release_owner_.get()); !s) return s;
          ++counters_.release_edges;
        }
      }
      if constexpr (Edges::all_hit_ready_wait) {
        if (ready_recorded_ && !ready_seen_by(caller)) {
          if (Status s = rt_->wait(caller, ready_.get()); !s) return s;
          ++counters_.ready_edges;
          note_ready_seen(caller);
        }
      }
    }
    before_forward_valid_[reader] = 0;
    if (slots_of_own_experts && !speculative_.empty() && reader < before_forward_.size()) {
      if (Status s = rt_->record(before_forward_[reader].get(), caller); !s) return s;
      before_forward_valid_[reader] = 1;
    }
    reader_owner = caller;
    owner_ = caller;
    return {};
  }

  // 0 when `s` is not capturing, else an id of the capture sequence: distinct per capture
  // where the runtime has capture_id() (CudaRuntime), otherwise 1 for every capture.
  Result<std::uint64_t> capture_sequence(Stream s) noexcept {
    if constexpr (requires { { rt_->capture_id(s) } -> std::same_as<Result<std::uint64_t>>; }) {
      return rt_->capture_id(s);
    } else {
      Result<bool> capturing = rt_->is_capturing(s);
      if (!capturing.ok()) return capturing.status();
      return std::uint64_t{capturing.value() ? 1u : 0u};
    }
  }

  [[nodiscard]] bool ready_seen_by(Stream s) const noexcept {
    for (std::size_t i = 0; i < ready_seen_count_; ++i) {
      if (ready_seen_[i] == s) return true;
    }
    return false;
  }
  // A full list only costs a redundant wait later, never a missing one.
  void note_ready_seen(Stream s) noexcept {
    if (ready_seen_count_ < ready_seen_.size() && !ready_seen_by(s)) ready_seen_[ready_seen_count_++] = s;
  }

  struct SpeculativeSlot {
    RuntimeEvent<R> event;  // recorded on F after the slot's speculative copy
    bool pending = false;   // recorded, and no prepare has waited for it yet
  };

  struct StagingBuffer {
    RuntimeBuffer<R> memory;
    RuntimeEvent<R> consumed;  // recorded after the copy that reads `memory`
    bool recorded = false;
    std::uint64_t capture = 0;  // capture sequence of the last record (0: recorded eagerly)
  };

  R* rt_;
  bool inline_mode_;
  std::size_t map_bytes_;
  std::optional<RuntimeStream<R>> copy_stream_;
  std::optional<RuntimeStream<R>> wide_stream_;  // inline mode, add_wide_stream(): wide fills only
  std::optional<RuntimeStream<R>> speculative_stream_;  // S: write_speculative_slots (every reader)
  RuntimeEvent<R> release_owner_;
  RuntimeEvent<R> release_fill_;
  RuntimeEvent<R> ready_;
  // Per reader, after the first prefetch: recorded on the reader's stream when a forward that
  // reads only its own experts' slots is adopted, i.e. after every earlier forward's consumer of
  // that reader and before this one's (see write_speculative_slots); valid until the reader's next
  // adoption without it, or an invalidate() of it.
  std::vector<RuntimeEvent<R>> before_forward_;
  std::vector<char> before_forward_valid_;
  bool ready_recorded_ = false;
  std::array<Stream, 4> ready_seen_{};  // streams that already waited for the latest `ready`
  std::size_t ready_seen_count_ = 0;
  std::optional<Stream> owner_;                // the last accepted prepare's stream (any reader)
  std::vector<std::optional<Stream>> owners_;  // per reader: the stream its readers are on
  std::optional<Stream> last_fill_;
  std::vector<StagingBuffer> ring_;
  std::vector<SpeculativeSlot> speculative_;  // per slot, empty until the first prefetch
  std::vector<RuntimeEvent<R>> wide_release_;  // per wide buffer (2), made by the first wide_begin
  std::array<bool, 2> wide_released_{};        // recorded in this wide forward, not yet waited for
  std::optional<Stream> wide_reader_;          // the stream of the last wide forward (any reader)
  std::size_t speculative_pending_count_ = 0;  // slots of speculative_ with `pending` set
  std::size_t next_staging_ = 0;
  bool last_upload_captured_ = false;
  OrderingCounters counters_;
};

}  // namespace expert_cache::inline v0
